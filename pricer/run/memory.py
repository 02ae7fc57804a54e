"""The memory guard: before any work, rank 0 estimates the host memory each rank needs for this
portfolio and refuses a run that would not fit in the node's available memory, with the numbers.

The estimate (bytes; n options, k outputs per option, R ranks, N the largest steps):
- rank 0: the columns as read (2x: h5py's arrays and their converted copies, ~66 B per option, more
  with a tree column), the 10-double matrix that travels to the ranks, the gathered (n, k) result
  and its copy in the file write, plus its own slice;
- every rank: its slice of the matrix and of the results (the whole matrix with --distribute bcast),
  with --distribute read also the whole book's id and steps columns and its own rows' columns as
  read (2x, as rank 0's above; rank 0 then holds no other rows), plus one chunk's working set:
  ~30 float64 arrays per lattice priced (5 per option with --greeks, +1 with --richardson) and
  the engine's 4 arrays of N + 1 doubles per thread.
Pricing streams through chunks (pricer/run/chunks.py), so a rank's working set does not grow with
the portfolio beyond these per-option arrays.

Device memory (GPU backends; every rank drives its own GPU): each rank measures its GPU's free
memory once every rank's engine has started (the CUDA context and the kernels exist then), and rank
0 fits every rank's share to it before its verdict (fit_devices), by the engine's own account of
what it allocates (Engine.device_need; pricer/engines/gpu/engine.py). Ranks that share a GPU share
its free memory equally, and each keeps DEVICE_ALLOWANCE for what CUDA takes after the measurement.
What streams is shrunk to fit (the options per chunk of the engine's device buffers); an option
whose own arrays do not fit is refused with the numbers, exit 2, before any pricing.
PRICER_DEVICE_MEMORY_LIMIT (bytes, or K/M/G) replaces every GPU's free memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from pricer.engines.base import DeviceInfo
from pricer.errors import InputError

COLUMN_BYTES = 8 * 8 + 2      # id, spot, strike, maturity, rate, dividend, volatility, steps, 2 flags
TREE_BYTES = 64               # a tree name as read (object + str) and its code
MATRIX_BYTES = 10 * 8         # one row of the matrix that travels to the ranks
# An implied-volatility run's searches, per option of a rank's share: the market price's column,
# the solver's table of the option's columns and its search state (pricer.model.implied), and the
# results it hands back (measured ~240 bytes an option at N = 16)
SEARCH_BYTES_PER_OPTION = 8 + 320
# lattice parameters and engine inputs of one lattice, and the next chunk's columns and lattice
# parameters, prepared meanwhile (pricer/run/pricing.run_chunks)
CHUNK_ARRAY_BYTES = (30 + 18) * 8
ENGINE_BYTES_PER_STEP = 4 * 8
# bond options (the Hull–White family): a tree's per-step arrays (flows, discounts, exercise
# flags, the shifts e^{-alpha dt}) and a thread's working rows per row of its widest tree
BOND_BYTES_PER_STEP = 8 + 8 + 1 + 8
BOND_BYTES_PER_ROW = 10 * 8 + 8
INDEX_BYTES = 2 * 8           # --distribute read: the id and steps columns every rank reads whole
GIB = float(1 << 30)


def bond_working_bytes(steps: float, widest: float, threads: int) -> float:
    """Bond options' working memory: trees of `steps` per-step entries in all, on `threads` threads
    whose widest tree has `widest` rows."""
    return float(steps) * BOND_BYTES_PER_STEP + threads * float(widest) * BOND_BYTES_PER_ROW


@dataclass
class Estimate:
    root: float      # bytes on rank 0
    other: float     # bytes on each other rank
    available: float
    node_ranks: int
    source: str = "available"   # what limits `available` (available_memory)

    def fits(self) -> bool:
        return self.root + (self.node_ranks - 1) * self.other <= self.available


def parse_bytes(text: str) -> float:
    """'123', '64K', '1.5G' -> bytes (K/M/G are powers of 1024)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return float(text.rstrip("KMG")) * scale


# A rank's own footprint before any book: Python, numpy, numba, h5py, mpi4py (measured ~200 MiB of
# resident memory per rank of `mpiexec -n 2 pricer price` on a tiny book, ~325 MiB in a process that
# compiles numba's kernels). Counted against totals that include the ranks themselves (a Slurm
# allocation), not against what is still free (MemAvailable, a cgroup's room), which excludes them.
RANK_BASELINE = 300 << 20


def available_bytes(environ=os.environ, node_ranks: int = 1) -> float:
    """available_memory's bytes."""
    return available_memory(environ, node_ranks)[0]


def available_memory(environ=os.environ, node_ranks: int = 1) -> tuple[float, str]:
    """(bytes the run may still take on this node, what limits it): PRICER_MEMORY_LIMIT (bytes, or
    with a K/M/G suffix) if set; else the least of the kernel's MemAvailable, the room left under
    this process's memory cgroup (v1 or v2, its own and its parents' limits), and Slurm's memory
    for the job on this node (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE, MiB)
    less RANK_BASELINE for each of the node's ranks."""
    limit = environ.get("PRICER_MEMORY_LIMIT", "").strip().upper()
    if limit:
        return parse_bytes(limit), "available (PRICER_MEMORY_LIMIT)"
    found = [(_mem_available(), "available")]
    room = _cgroup_room()
    if room is not None:
        found.append((room, "left under this process's cgroup memory limit"))
    slurm = _slurm_memory(environ)
    if slurm is not None:
        found.append((slurm - node_ranks * RANK_BASELINE,
                      f"of Slurm's memory for the job on this node, less {RANK_BASELINE >> 20} MiB "
                      f"for each of its {node_ranks} rank(s)"))
    return min(found)


def _mem_available() -> float:
    """What the kernel says a new process can still take without swapping (psutil: Linux's
    MemAvailable, and its like elsewhere). A cgroup's own limit is not in it: _cgroup_room."""
    import psutil
    try:
        return float(psutil.virtual_memory().available)
    except (OSError, psutil.Error):   # /proc unreadable (a sandbox): the free pages, as sysconf
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


NO_LIMIT = 1 << 60      # cgroup v1 writes "no limit" as a number near 2^63


def _cgroup_room(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The least room (limit - usage) over this process's memory cgroup and its parents; None
    where no limit is set or the files cannot be read."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, files, cache = root, ("memory.max", "memory.current"), "inactive_file"   # v2
        elif "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes",
                                                         "memory.usage_in_bytes")         # v1
            cache = "total_inactive_file"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(base, *parts[:depth])
            try:
                with open(os.path.join(folder, files[0])) as f:
                    text = f.read().strip()
                with open(os.path.join(folder, files[1])) as f:
                    used = float(f.read().strip())
            except (OSError, ValueError):
                continue
            if text != "max" and text.isdigit() and int(text) < NO_LIMIT:
                # page cache the kernel can reclaim counts as used, but is room
                rooms.append(float(text) - used + _stat(os.path.join(folder, "memory.stat"),
                                                        cache))
    return min(rooms) if rooms else None


def _stat(path: str, key: str) -> float:
    """A counter of a cgroup's memory.stat (0 where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return float(value)
    except (OSError, ValueError):
        pass
    return 0.0


def _slurm_memory(environ) -> float | None:
    """The job's memory on this node as Slurm states it (MiB in its variables), or None."""
    per_node = environ.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return float(per_node) * (1 << 20)
    per_cpu, cpus = environ.get("SLURM_MEM_PER_CPU", ""), environ.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu.isdigit() and cpus.isdigit() and int(per_cpu) > 0:
        return float(per_cpu) * int(cpus) * (1 << 20)
    return None


def estimate(n: int, outputs: int, ranks: int, node_ranks: int, chunk_rows: int, max_steps: int,
             lattices: int, threads: int, tree: bool, bcast: bool, read: bool = False,
             per_option: float = 0.0) -> Estimate:
    """`per_option`: bytes per option of a rank's share beyond its rows and outputs (an
    implied-volatility run's searches, SEARCH_BYTES_PER_OPTION)."""
    share = -(-n // ranks)
    working = (min(chunk_rows, share) * lattices * CHUNK_ARRAY_BYTES
               + threads * ENGINE_BYTES_PER_STEP * (max_steps + 1) + share * per_option)
    columns = 2 * COLUMN_BYTES + (TREE_BYTES if tree else 0)
    if read:   # every rank reads its own rows (and the id and steps columns whole)
        other = n * INDEX_BYTES + share * (columns + MATRIX_BYTES + outputs * 8) + working
        root = other + n * (INDEX_BYTES + 2 * outputs * 8)   # the plan's ids/steps, the results
        return Estimate(float(root), float(other), *_available(node_ranks))
    matrix = (n if bcast else share) * MATRIX_BYTES
    other = matrix + share * outputs * 8 + working
    root = (n * (columns + MATRIX_BYTES + 2 * outputs * 8)
            + other)
    return Estimate(float(root), float(other), *_available(node_ranks))


def _available(node_ranks: int) -> tuple:
    room, source = available_memory(node_ranks=node_ranks)
    return room, node_ranks, source


def check(est: Estimate, what: str) -> None:
    """Refuse, naming the numbers, a run whose estimate exceeds the node's available memory."""
    if est.fits():
        return
    raise InputError(
        f"{what}: not enough memory: this run needs an estimated {est.root / GIB:.2f} GiB on rank 0 "
        f"and {est.other / GIB:.2f} GiB on each other rank, {(est.root + (est.node_ranks - 1) * est.other) / GIB:.2f} GiB "
        f"for the {est.node_ranks} rank(s) on rank 0's node, which has {est.available / GIB:.2f} GiB "
        f"{est.source}; use more nodes, fewer ranks per node, or split the portfolio")


# ----------------------------------------------------------------------- device memory (GPU)

# What CUDA takes on a rank's GPU after its free memory is measured, beyond the buffers counted
# below: kernel modules loaded later (the regime modules, at an engine's first option above the
# batch kernels' limit; with lazy loading a kernel's code arrives at its first launch), the local memory the driver reserves at a kernel's first launch (its per-thread local
# memory x every resident thread: ~0.26 GiB per KiB per thread on 132 SMs of 2 048 threads),
# cuMemAlloc rounding (up to 2 MiB per allocation, ~10-20 live ones) and the events and streams.
# The context itself is not in it: it exists when the free memory is measured. Not measured: a
# figure chosen to cover one KiB of local memory per thread, and under 1 % of a 80 GiB GPU.
DEVICE_ALLOWANCE = 512 << 20
DEVICE_LIMIT_VARIABLE = "PRICER_DEVICE_MEMORY_LIMIT"


def device_info(engine) -> DeviceInfo | None:
    """The rank's GPU as its engine measures it (Engine.device_info), or None where it has none or
    cannot say (never raises: every rank calls it before a collective)."""
    try:
        return engine.device_info() if engine is not None and engine.uses_gpu else None
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
    chunk_options: np.ndarray   # per rank: options per chunk of its engine's device buffers (0: as
    notes: list                 # they are), and what the summary says of them


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB"


def size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if nbytes >= 0.1 * scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def fit_devices(engine, infos: list, shares: list, analytics, what: str,
                environ=os.environ) -> DeviceFit:
    """Rank 0: every rank's share (shares[r] = (steps, cuts, ids)) fitted to its GPU (infos[r], None
    where unmeasured: not checked) by the engine's own sizing (Engine.device_need; every rank runs
    the same backend with the same settings); raises InputError with the numbers for a share that
    cannot fit."""
    limit = device_limit(environ)
    sharing: dict = {}
    free_of: dict = {}
    for info in infos:
        if info is not None:
            sharing[info.device] = sharing.get(info.device, 0) + 1
            free = info.free if limit is None else limit
            free_of[info.device] = min(free_of.get(info.device, free), free)
    settings = np.zeros(len(infos), dtype=np.int64)
    shrunk = []
    for rank, info in enumerate(infos):
        if info is None:
            continue
        steps, cuts, ids = shares[rank]
        need = engine.device_need(steps, cuts, analytics)
        free, k = free_of[info.device], sharing[info.device]
        setting = need.fit(free / k - DEVICE_ALLOWANCE)
        if setting is None:
            raise InputError(_refusal(what, rank, info, need, free, k, ids, limit is not None,
                                      engine.name))
        settings[rank] = setting
        if setting:
            shrunk.append((rank, setting, free / k))
    return DeviceFit(settings, _notes(engine, shrunk, len(infos)))


def _refusal(what, rank, info, need, free, k, ids, limited, backend) -> str:
    where = (f"the GPU of rank {rank} ({info.name}) has {gib(free)} free"
             + (f" ({DEVICE_LIMIT_VARIABLE})" if limited else "")
             + (f", shared by {k} ranks ({gib(free / k)} each)" if k > 1 else ""))
    allowance = f"{gib(DEVICE_ALLOWANCE)} kept for CUDA"
    if need.held_row >= 0:
        return (f"{what}: not enough GPU memory: option id {ids[need.held_row]} (N = "
                f"{need.held_steps} steps) needs {gib(need.held)} on the device ("
                f"{need.held_what}), "
                f"{gib(need.held + need.least + DEVICE_ALLOWANCE)} with the "
                f"{allowance}, but {where}; the {backend} backend prices such an option whole on "
                f"one GPU: use a GPU with more free memory, fewer ranks per GPU, or --backend cpu")
    return (f"{what}: not enough GPU memory: the {backend} backend needs at least "
            f"{gib(need.held + need.least + DEVICE_ALLOWANCE)} on rank {rank}'s GPU (one option "
            f"at a time, and {allowance}), but {where}; use a GPU with more free memory, fewer "
            f"ranks per GPU, or --backend cpu")


def _notes(engine, shrunk: list, ranks: int) -> list:
    if not shrunk:
        return []
    which = _ranks_text([rank for rank, *_ in shrunk], ranks)
    least_free = min(free for *_, free in shrunk)
    sizes = sorted({setting for _, setting, _ in shrunk})
    size = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return [f"GPU memory: chunks of {size} options on the GPU (not {engine.chunk_options}) on "
            f"{which}, to fit {size_text(least_free)} free per rank (less "
            f"{size_text(DEVICE_ALLOWANCE)} kept for CUDA)"]


def _ranks_text(ranks: list, size: int) -> str:
    if len(ranks) == size and size > 1:
        return f"all {size} ranks"
    if len(ranks) <= 8:
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
    return f"{len(ranks)} of {size} ranks"
