"""The memory guard: before any work, rank 0 estimates the host memory each rank needs for this
portfolio and refuses a run that would not fit in the node's available memory, with the numbers.

The estimate (bytes; n options, k outputs per option, R ranks, N the largest steps):
- rank 0: the columns as read (2x: h5py's arrays and their converted copies, ~66 B per option, more
  with a tree column), the 10-double matrix that travels to the ranks, the gathered (n, k) result
  and its copy in the file write, plus its own slice;
- every rank: its slice of the matrix and of the results (the whole matrix with --distribute bcast),
  with --distribute read also the whole book's id and steps columns and its own rows' columns as
  read (2x, as rank 0's above; rank 0 then holds no other rows), plus one chunk's working set: ~30 float64 arrays per lattice priced (5 per option with --greeks,
  +1 with --richardson) and the engine's 4 arrays of N + 1 doubles per thread.
Pricing streams through chunks (pricer/checkpoint.py), so a rank's working set does not grow with
the portfolio beyond these per-option arrays.

Device memory (GPU backends; every rank drives its own GPU): each rank measures its GPU's free
memory once every rank's engine has started (the CUDA context and, for `batch`, every kernel exist
then) and rank 0 fits every rank's share to it before its verdict (distributed.py), from what the
engines allocate (device_need): `batch` holds two buffer sets of one chunk's rows (at most
chunk_options; batch_plan.chunk_size: INPUT_BYTES_PER_OPTION in, the class key (int32), the price
out, with --greeks LEVEL_VALUES doubles more) and each set's GPU sort counts (BATCH_SORT_BYTES);
`gpu`/`hybrid` (and `batch` for options above MAX_STEPS, through hybrid) hold 32 bytes per node of
the widest option's widest level (N + 2 nodes, at least 1024) from then on; `gpu`/`hybrid` allocate
each call's batch-kernel arrays (16 (N + 1) + 56 bytes per option, 40 more with levels) for the
call. Ranks that share a GPU share its free memory equally, and each keeps DEVICE_ALLOWANCE for what
CUDA takes after the measurement. What streams is shrunk to fit (`batch`: chunk_options;
`gpu`/`hybrid`: a chunk is priced in several engine calls); an option whose own arrays do not fit is
refused with the numbers, exit 2, before any pricing.
PRICER_DEVICE_MEMORY_LIMIT (bytes, or K/M/G) replaces every GPU's free memory.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import numpy as np

from pricer.engines.batch_plan import INPUT_BYTES_PER_OPTION, KEY_BINS, MAX_STEPS, chunk_size
from pricer.engines.serial import LEVEL_VALUES
from pricer.errors import InputError
from pricer.greeks import Analytics, richardson_steps
from pricer.portfolio import lattice_nodes

COLUMN_BYTES = 8 * 8 + 2      # id, spot, strike, maturity, rate, dividend, volatility, steps, 2 flags
TREE_BYTES = 64               # a tree name as read (object + str) and its code
MATRIX_BYTES = 10 * 8         # one row of the matrix that travels to the ranks
CHUNK_ARRAY_BYTES = 30 * 8    # lattice parameters and engine inputs of one lattice
ENGINE_BYTES_PER_STEP = 4 * 8
INDEX_BYTES = 2 * 8           # --distribute read: the id and steps columns every rank reads whole
GIB = float(1 << 30)


@dataclass
class Estimate:
    root: float      # bytes on rank 0
    other: float     # bytes on each other rank
    available: float
    node_ranks: int

    def fits(self) -> bool:
        return self.root + (self.node_ranks - 1) * self.other <= self.available


def parse_bytes(text: str) -> float:
    """'123', '64K', '1.5G' -> bytes (K/M/G are powers of 1024)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return float(text.rstrip("KMG")) * scale


def available_bytes(environ=os.environ) -> float:
    """PRICER_MEMORY_LIMIT (bytes, or with a K/M/G suffix) if set, else the kernel's MemAvailable."""
    limit = environ.get("PRICER_MEMORY_LIMIT", "").strip().upper()
    if limit:
        return parse_bytes(limit)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def estimate(n: int, outputs: int, ranks: int, node_ranks: int, chunk_rows: int, max_steps: int,
             lattices: int, threads: int, tree: bool, bcast: bool, read: bool = False) -> Estimate:
    share = -(-n // ranks)
    working = (chunk_rows * lattices * CHUNK_ARRAY_BYTES
               + threads * ENGINE_BYTES_PER_STEP * (max_steps + 1))
    columns = 2 * COLUMN_BYTES + (TREE_BYTES if tree else 0)
    if read:   # every rank reads its own rows (and the id and steps columns whole)
        other = n * INDEX_BYTES + share * (columns + MATRIX_BYTES + outputs * 8) + working
        root = other + n * (INDEX_BYTES + 2 * outputs * 8)   # the plan's ids/steps, the results
        return Estimate(root=float(root), other=float(other), available=available_bytes(),
                        node_ranks=node_ranks)
    matrix = (n if bcast else share) * MATRIX_BYTES
    other = matrix + share * outputs * 8 + working
    root = (n * (columns + MATRIX_BYTES + 2 * outputs * 8)
            + other)
    return Estimate(root=float(root), other=float(other), available=available_bytes(),
                    node_ranks=node_ranks)


def check(est: Estimate, what: str) -> None:
    """Refuse, naming the numbers, a run whose estimate exceeds the node's available memory."""
    if est.fits():
        return
    raise InputError(
        f"{what}: not enough memory: this run needs an estimated {est.root / GIB:.2f} GiB on rank 0 "
        f"and {est.other / GIB:.2f} GiB on each other rank, {(est.root + (est.node_ranks - 1) * est.other) / GIB:.2f} GiB "
        f"for the {est.node_ranks} rank(s) on rank 0's node, which has {est.available / GIB:.2f} GiB "
        f"available; use more nodes, fewer ranks per node, or split the portfolio")


# ----------------------------------------------------------------------- device memory (GPU)

# What CUDA takes on a rank's GPU after its free memory is measured, beyond the buffers counted
# below: kernel modules loaded later (gpu/hybrid load their batch-kernel modules, and hybrid inside
# `batch` its regime modules, at first use; with lazy loading a kernel's code arrives at its first
# launch), the local memory the driver reserves at a kernel's first launch (its per-thread local
# memory x every resident thread: ~0.26 GiB per KiB of local memory per thread on a 132-SM H100),
# cuMemAlloc rounding (up to 2 MiB per allocation, ~10-20 live ones) and the events and streams.
# The context itself is not in it: it exists when the free memory is measured. Not measured: a
# figure chosen to cover one KiB of local memory per thread, and under 1 % of a 80 GiB GPU.
DEVICE_ALLOWANCE = 512 << 20
REGIME_BYTES_PER_NODE = 32       # CudaKernels.reserve: two level buffers and the two power tables
REGIME_MIN_NODES = 1024          # ... of max(N + 2, 1024) nodes, kept (grown only) across calls
GPU_BATCH_BYTES_PER_NODE = 16    # CudaKernels.batch: an option's two power tables, 2 (N + 1) doubles
GPU_BATCH_BYTES_PER_OPTION = 56  # and its offset 8, steps 4, pu, pd, strike, sign 32, american 4,
                                 # price 8 (allocated for the call, freed after it)
BATCH_SETS = 2                   # CudaBatchRunner: two page-locked/device buffer sets alternate
BATCH_SORT_BYTES = 2 * 4 * KEY_BINS   # and each its GPU sort's counts and starts, int32 per key
DEVICE_LIMIT_VARIABLE = "PRICER_DEVICE_MEMORY_LIMIT"


def batch_row_bytes(levels: bool) -> int:
    """Device bytes of one option in one CudaBatchRunner buffer set: its input bytes, its class
    key (int32, batch_width_keys), its price out, and with levels (--greeks) its first levels'
    LEVEL_VALUES doubles."""
    return INPUT_BYTES_PER_OPTION + 4 + 8 * (1 + (LEVEL_VALUES if levels else 0))


def regime_bytes(steps) -> np.ndarray:
    """Device bytes an option of `steps` holds while the regimes (gpu/hybrid) price it: two level
    buffers and the power tables, 32 bytes per node of max(N + 2, 1024); 0 for steps <= 0."""
    n = np.asarray(steps, dtype=np.float64)
    return np.where(n > 0, REGIME_BYTES_PER_NODE * np.maximum(n + 2, REGIME_MIN_NODES), 0.0)


def gpu_batch_bytes(steps, levels: bool = False) -> np.ndarray:
    """Device bytes of an option priced by gpu/hybrid's batch kernel (CudaKernels.batch); with
    levels (--greeks) also its first levels' LEVEL_VALUES doubles."""
    n = np.asarray(steps, dtype=np.float64)
    return (GPU_BATCH_BYTES_PER_NODE * (n + 1) + GPU_BATCH_BYTES_PER_OPTION
            + (8 * LEVEL_VALUES if levels else 0))


@dataclass(frozen=True)
class DeviceProfile:
    """What decides a GPU engine's device memory (device_profile reads it from the engine)."""
    backend: str                  # "batch", "gpu" or "hybrid"
    chunk_options: int = 0        # batch: options per chunk (CudaBatchRunner.chunk_options)
    cpu_max_nodes: float = 0.0    # batch (`auto`): a call of at most this many nodes runs on the CPU
    cpu_max_steps: int = 0        # hybrid: options with steps <= this run on the CPU
    batch_max_steps: int = 0      # gpu/hybrid: options up to this go through the batch kernel


def device_profile(engine) -> DeviceProfile | None:
    """The engine's DeviceProfile, or None for an engine that uses no GPU."""
    name = getattr(engine, "name", None)
    if name == "batch":
        return DeviceProfile("batch", chunk_options=int(engine.runner.chunk_options),
                             cpu_max_nodes=float(engine.cpu_max_nodes))
    if name in ("gpu", "hybrid"):
        c = engine.config
        cpu = (c.t2 if c.cpu_max_steps is None else c.cpu_max_steps) if name == "hybrid" else 0
        return DeviceProfile(name, cpu_max_steps=int(cpu), batch_max_steps=int(c.batch_max_steps))
    return None


def lattice_kinds(steps: np.ndarray, analytics: Analytics) -> list:
    """[(steps, count)]: the lattices an engine call prices per option (greeks.price_with_analytics:
    the option and its four bumped copies, N steps each; its Richardson lattice, M ~ N/2 steps)."""
    steps = np.asarray(steps, dtype=np.int64)
    kinds = [(steps, 5 if analytics.greeks else 1)]
    if analytics.richardson:
        kinds.append((richardson_steps(steps), 1))
    return kinds


@dataclass
class DeviceNeed:
    """One rank's device bytes for its share (without DEVICE_ALLOWANCE)."""
    held: float = 0.0      # whatever the chunking: the widest regime option's arrays (and batch's
                           # sort counts)
    held_row: int = -1     # that option's row in the share (-1: none)
    held_steps: int = 0
    streamed: float = 0.0  # the streamed buffers as the engine is set now
    least: float = 0.0     # the streamed buffers at their finest (one option per chunk or call)
    unit: float = 0.0      # batch: bytes per option of chunk_options (0: gpu/hybrid)

    @property
    def total(self) -> float:
        return self.held + self.streamed


def device_need(profile: DeviceProfile, steps: np.ndarray, cuts: np.ndarray,
                analytics: Analytics) -> DeviceNeed:
    """Device bytes of a share whose options have `steps`, priced in engine calls of rows
    cuts[j]:cuts[j+1] (distributed.py's chunks), as the engine allocates them (see the module doc)."""
    steps = np.asarray(steps, dtype=np.int64)
    if steps.size == 0:
        return DeviceNeed()
    starts = np.asarray(cuts[:-1], dtype=np.int64)
    kinds = lattice_kinds(steps, analytics)
    widest = np.zeros(steps.size, dtype=np.int64)
    if profile.backend == "batch":
        # BatchEngine.price: a call of <= cpu_max_nodes nodes runs on the CPU; wider than MAX_STEPS
        # through hybrid (the regimes); the rest through the runner's buffers. prepare() sizes them
        # for the share's options, a call for its lattices: one chunk of the larger (chunk_size).
        row_nodes = sum(count * lattice_nodes(s) for s, count in kinds)
        on_gpu = np.repeat(np.add.reduceat(row_nodes, starts) > profile.cpu_max_nodes,
                           np.diff(cuts))
        narrow = np.zeros(steps.size, dtype=np.int64)
        for s, count in kinds:
            narrow += count * (s <= MAX_STEPS)
            widest = np.maximum(widest, np.where(on_gpu & (s > MAX_STEPS), s, 0))
        rows = int(np.add.reduceat(np.where(on_gpu, narrow, 0), starts).max())
        if lattice_nodes(steps).sum() > profile.cpu_max_nodes:
            rows = max(rows, int((steps <= MAX_STEPS).sum()))
        rows = chunk_size(rows, profile.chunk_options) if rows else 0
        unit = BATCH_SETS * batch_row_bytes(analytics.greeks)
        need = DeviceNeed(held=BATCH_SETS * BATCH_SORT_BYTES if rows else 0.0,
                          streamed=rows * unit, least=unit if rows else 0.0, unit=unit)
    else:
        # GpuEngine.price: hybrid prices steps <= cpu_max_steps on the CPU; without levels the batch
        # kernel takes steps <= batch_max_steps (its arrays live for the call); the regimes the rest
        per_row = gpu_call_bytes(profile, steps, analytics)
        for s, count in kinds:
            regime = (s > profile.cpu_max_steps) & ~_in_gpu_batch(profile, s, analytics)
            widest = np.maximum(widest, np.where(regime, s, 0))
        need = DeviceNeed(streamed=float(np.add.reduceat(per_row, starts).max()),
                          least=float(per_row.max()))
    if widest.max() > 0:
        need.held_row = int(np.argmax(widest))
        need.held_steps = int(widest[need.held_row])
        need.held += float(regime_bytes(need.held_steps))
    return need


def _in_gpu_batch(profile: DeviceProfile, steps: np.ndarray, analytics: Analytics) -> np.ndarray:
    """gpu/hybrid: the lattices its batch kernel prices (on the GPU, steps <= batch_max_steps; with
    --greeks too, since that kernel keeps the first levels)."""
    if profile.backend not in ("gpu", "hybrid") or profile.batch_max_steps <= 0:
        return np.zeros(steps.shape, dtype=bool)
    return (steps > profile.cpu_max_steps) & (steps <= profile.batch_max_steps)


def gpu_call_bytes(profile: DeviceProfile, steps: np.ndarray, analytics: Analytics) -> np.ndarray:
    """Per option: the bytes gpu/hybrid's batch kernel allocates for it (and its other lattices)
    in an engine call, i.e. what splitting a chunk into several calls saves."""
    out = np.zeros(len(steps))
    for s, count in lattice_kinds(steps, analytics):
        out += count * np.where(_in_gpu_batch(profile, s, analytics),
                                gpu_batch_bytes(s, analytics.greeks), 0.0)
    return out


def split_calls(row_bytes: np.ndarray, budget: float) -> np.ndarray:
    """Boundaries [0, ..., n] of consecutive rows whose bytes add up to at most `budget` (a row
    alone may exceed it: it is a call of its own)."""
    n = len(row_bytes)
    total = np.concatenate(([0.0], np.cumsum(row_bytes)))
    cuts = [0]
    while cuts[-1] < n:
        end = int(np.searchsorted(total, total[cuts[-1]] + budget, side="right")) - 1
        cuts.append(min(max(end, cuts[-1] + 1), n))
    return np.array(cuts, dtype=np.int64)


def fit(need: DeviceNeed, budget: float) -> int | None:
    """The streaming setting that fits `budget` bytes: 0 if the engine fits as it is; for batch the
    chunk_options, for gpu/hybrid the bytes per call; None if even its finest streaming does not."""
    if need.total <= budget:
        return 0
    if need.held + need.least > budget:
        return None
    room = budget - need.held
    return max(1, int(room // need.unit)) if need.unit else max(1, int(room))


@dataclass
class DeviceInfo:
    """A rank's GPU as measured once its engine has started."""
    free: float    # bytes free (cuMemGetInfo)
    total: float
    device: str    # host and PCI bus id: ranks with the same one share the GPU
    name: str


def measure_device(engine) -> DeviceInfo | None:
    """This rank's GPU, measured in its CUDA context (cuMemGetInfo), or None where it has none."""
    from pricer.engines.gpu import GpuRuntime
    rt = GpuRuntime._instance
    if rt is None or rt.closed:
        return None
    free, total = rt.cuda.mem_get_info()
    return DeviceInfo(float(free), float(total), f"{socket.gethostname()}:{rt.pci_bus_id}:"
                      f"{rt.device_index if rt.pci_bus_id == '?' else ''}", str(rt.name))


def device_info(engine) -> DeviceInfo | None:
    """measure_device for an engine that uses a GPU; None otherwise or if it cannot be measured
    (never raises: every rank calls it before a collective)."""
    try:
        return measure_device(engine) if device_profile(engine) is not None else None
    except Exception:  # noqa: BLE001 - no figure: the check is skipped for this rank
        return None


def device_limit(environ=os.environ) -> float | None:
    text = environ.get(DEVICE_LIMIT_VARIABLE, "").strip()
    if not text:
        return None
    try:
        value = parse_bytes(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise InputError(f"{DEVICE_LIMIT_VARIABLE} must be a number of bytes, optionally with K, M "
                         f"or G, got {text!r}")
    return value


@dataclass
class DeviceFit:
    settings: np.ndarray    # per rank: 0 as it is; batch: chunk_options; gpu/hybrid: bytes per call
    notes: list


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB"


def size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def fit_devices(profile: DeviceProfile, infos: list, shares: list, analytics: Analytics, what: str,
                environ=os.environ) -> DeviceFit:
    """Rank 0: every rank's share (shares[r] = (steps, cuts, ids)) fitted to its GPU (infos[r], None
    where unmeasured: not checked); raises InputError with the numbers for a share that cannot fit."""
    limit = device_limit(environ)
    sharing: dict = {}
    for info in infos:
        if info is not None:
            sharing[info.device] = sharing.get(info.device, 0) + 1
    free_of = {}
    for info in infos:
        if info is not None:
            free = info.free if limit is None else limit
            free_of[info.device] = min(free_of.get(info.device, free), free)
    settings = np.zeros(len(infos), dtype=np.int64)
    shrunk = []
    for rank, info in enumerate(infos):
        if info is None:
            continue
        steps, cuts, ids = shares[rank]
        need = device_need(profile, steps, cuts, analytics)
        free, k = free_of[info.device], sharing[info.device]
        budget = free / k - DEVICE_ALLOWANCE
        setting = fit(need, budget)
        if setting is None:
            raise InputError(_refusal(what, rank, info, need, free, k, ids, limit is not None,
                                      profile.backend))
        settings[rank] = setting
        if setting:
            shrunk.append((rank, setting, need, free / k))
    return DeviceFit(settings, _notes(profile, shrunk, len(infos)))


def _refusal(what, rank, info, need, free, k, ids, limited, backend) -> str:
    where = (f"the GPU of rank {rank} ({info.name}) has {gib(free)} free"
             + (f" ({DEVICE_LIMIT_VARIABLE})" if limited else "")
             + (f", shared by {k} ranks ({gib(free / k)} each)" if k > 1 else ""))
    allowance = f"{gib(DEVICE_ALLOWANCE)} kept for CUDA"
    if need.held_row >= 0:
        return (f"{what}: not enough GPU memory: option id {ids[need.held_row]} (N = "
                f"{need.held_steps} steps) needs {gib(need.held)} on the device ("
                f"{REGIME_BYTES_PER_NODE} bytes per node of its widest level: two level buffers "
                f"and the power tables), "
                f"{gib(need.held + need.least + DEVICE_ALLOWANCE)} with the "
                f"{allowance}, but {where}; the {backend} backend prices such an option whole on "
                f"one GPU: use a GPU with more free memory, fewer ranks per GPU, or --backend cpu")
    return (f"{what}: not enough GPU memory: the {backend} backend needs at least "
            f"{gib(need.held + need.least + DEVICE_ALLOWANCE)} on rank {rank}'s GPU (one option "
            f"at a time, and {allowance}), but {where}; use a GPU with more free memory, fewer "
            f"ranks per GPU, or --backend cpu")


def _notes(profile: DeviceProfile, shrunk: list, ranks: int) -> list:
    if not shrunk:
        return []
    which = _ranks_text([rank for rank, *_ in shrunk], ranks)
    least_free = min(free for *_, free in shrunk)
    if profile.backend == "batch":
        sizes = sorted({setting for _, setting, *_ in shrunk})
        size = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        return [f"GPU memory: batch chunks of {size} options (not {profile.chunk_options}) on "
                f"{which}, to fit {size_text(least_free)} free per rank (less "
                f"{size_text(DEVICE_ALLOWANCE)} kept for CUDA)"]
    budget = min(setting for _, setting, *_ in shrunk)
    return [f"GPU memory: chunks priced in engine calls of at most {size_text(budget)} of "
            f"batch-kernel arrays on {which}, to fit {size_text(least_free)} free per rank (less "
            f"{size_text(DEVICE_ALLOWANCE)} kept for CUDA)"]


def _ranks_text(ranks: list, size: int) -> str:
    if len(ranks) == size and size > 1:
        return f"all {size} ranks"
    if len(ranks) <= 8:
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
    return f"{len(ranks)} of {size} ranks"
