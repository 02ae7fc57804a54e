"""The `gpu` and `hybrid` backends: the seed's GPU regimes (cuda/binomial.cu) driven from Python.

Regimes, per option, as the level narrows (t = steps still to take = level width - 1):
- tiled          while t > T1: K steps fused per launch, TILED_B threads x TILED_VT nodes each;
- persistent     while t > T2 (`hybrid`) or down to 0 (`gpu`): one launch (below; before run 9 the
                 mid / warp-per-block regimes, still there with pers_vt = 0);
- CPU tail       (`hybrid`): the level (<= T2 + 1 nodes) is copied to the host and finished with
                 pricer.engines.serial.backward_inplace.
`hybrid` also prices options with steps <= cpu_max_steps (default T2) on the CPU outright (the
`cpu` engine, bitwise equal to serial). In `gpu` and `hybrid`, the remaining options with steps <=
batch_max_steps (8191) go through the batch kernel: one block per option, all steps in one launch,
nodes in registers, one launch per size class (BATCH_CLASSES); wider options run one by one
through the regimes.
The modes `wavefront`, `tiled`, `warp` and `pers` run one regime all the way down (benchmarks,
tests; `pers` goes through tiled first while the level is too wide for all its tiles at once).

Arithmetic: the power tables (S0*d^t, (u/d)^i) are built on the host by the serial engine's own
`power_tables` and uploaded. With fma=True (default since run 5, ~20 % faster at N = 1M) hold and
exercise use fused multiply-adds: prices differ from the serial engine's by rounding only (~1e-15
relative on the device, within issue 3's 1e-11 / 1e-9). With fma=False (exact mode) the kernels
round every product and sum separately, in the serial engine's order, so prices are bitwise equal
to the serial engine's.

Regimes below T1 in `gpu`/`hybrid` (run 9): the persistent kernel, ONE launch from min(T1, the
widest level whose tiles all fit on the GPU at once) down to T2 (`hybrid`) or 0 (`gpu`): warp tiles
of 32 x pers_vt nodes in registers, each owning 32 x pers_vt - pers_k nodes of every level, halos
of pers_k nodes exchanged every pers_k steps, through shared memory between the tiles of one
block and through global memory between blocks (cuda/binomial.cu, pers_steps; mode `pers` runs
it all the way). Below level pers_narrow_below (default: where the wide tiles
fill half the GPU's SM sub-partitions, 50 688 on 132 SMs) a second launch of the same kernel built
with pers_narrow_vt nodes per lane takes over: more and smaller tiles finish each narrow level
sooner (5k-100k: 6-14 % faster, run 11 in docs/performance.md). In either shape a tile of an
American option whose nodes cannot be worth exercising during an epoch (a put's above the strike)
runs that epoch with the European node, bitwise the same values (pers_eu_tiles; run 12: 100k
2 %, 500k 4 % faster), and a put's tile whose nodes all hold their exercise value skips the
epoch's steps, again bitwise the same (pers_skip, scaled arithmetic, under pers_skip_limit); with
its exercised tiles skipping, such a put goes to the narrow shape as high as the narrow tiles hold
the level (run 14: 100k 5.6 -> 4.9 ms). A tile's warp polls for its halo as one (a vote per
round, no divergence around the wait), and a scaled American step's exercise values are computed
during the step before (pers_expipe); run 13: 100k 6.0 -> 5.3 ms. With pers_vt = 0: the tiled kernel in a narrow
shape there (mid_b x mid_vt nodes, mid_k steps per launch, the rest in one launch once the level
fits one tile), and with mid_b = 0 as well the warp-per-block regime of runs 1-4.

Process model: one CUDA context per process, created on first use on device
(local rank modulo visible devices) -- the local rank comes from MPI's COMM_TYPE_SHARED split when
MPI runs with more than one rank (a collective: engines are built on every rank), else from the
launcher's environment; CUDA_VISIBLE_DEVICES is honoured by the driver. The context is pushed once
and popped at exit (atexit, or GpuRuntime.close()), after every device array has been freed.

Kernels are compiled at run time for the device's sm_XY with nvcc (through pycuda) and cached on
disk as cubins keyed by the hash of source + options + arch (PRICER_CUDA_CACHE, else
$XDG_CACHE_HOME/pricer/cuda, else ~/.cache/pricer/cuda); cache files are written atomically.
pycuda is imported lazily, so this module imports on machines without it.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from numba import njit

from pricer.engines.serial import (EXERCISE_SLACK, LEVEL_VALUES, UNDERFLOW,
                                   backward_keeping_levels, exercise_limit, level_array, power_tables)
from pricer.lattice import LatticeParams

MODES = ("gpu", "hybrid", "wavefront", "tiled", "warp", "pers")
PERS_SLOTS = 4            # cuda/binomial.cu PERS_D: ring slots per tile
# batch kernel size classes (threads per block, nodes per thread): an option with steps + 1 <= B*VT
# goes to the smallest class that holds it
BATCH_CLASSES = ((32, 8), (64, 8), (128, 8), (256, 8), (512, 8), (1024, 8))


def batch_class(steps: np.ndarray) -> np.ndarray:
    widths = np.array([b * vt for b, vt in BATCH_CLASSES])
    return np.searchsorted(widths, np.asarray(steps) + 1)


@njit(cache=True, nogil=True)
def batch_tables(spot, log_up, log_down, steps, offsets, tab):
    """Option j's level_base at tab[offsets[j]:][:steps+1], its ratio right after."""
    for j in range(steps.size):
        n = steps[j]
        o = offsets[j]
        power_tables(spot[j], log_up[j], log_down[j], n, tab[o:o + n + 1], tab[o + n + 1:o + 2 * n + 2])


def batch_inputs(p: LatticeParams, rows: np.ndarray):
    """Host arrays for batch_price over options `rows` (in that order)."""
    steps = p.steps[rows].astype(np.int64)
    sizes = 2 * (steps + 1)
    offsets = np.zeros(rows.size, dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    tab = np.empty(int(sizes.sum()))
    batch_tables(p.spot[rows], p.log_up[rows], p.log_down[rows], steps, offsets, tab)
    return dict(tables=tab, offsets=offsets, steps=steps.astype(np.int32),
                pu=np.ascontiguousarray(p.pu[rows]), pd=np.ascontiguousarray(p.pd[rows]),
                strike=np.ascontiguousarray(p.strike[rows]),
                sign=np.where(p.call[rows], 1.0, -1.0), american=p.american[rows].astype(np.int32))


class GpuUnavailable(RuntimeError):
    """No usable GPU: pycuda missing, no device, or no nvcc to build the kernels."""


class GpuError(RuntimeError):
    """A kernel could not finish its work (the persistent kernel's wait gave up)."""


_POWS_CACHE: dict = {}


def pers_pows(pd: float, k: int, out: np.ndarray) -> bool:
    """out[:k+1] = pd^s and out[k+1:2k+2] = pd^-s for s = 0..k, each rounded once from long
    double; whether the persistent kernel may use its scaled arithmetic with them (pd^k >= 2^-600,
    so X = V / pd^s stays far from overflow)."""
    key = (pd, k)
    hit = _POWS_CACHE.get(key)
    if hit is None:
        powers = np.cumprod(np.r_[np.longdouble(1.0), np.full(k, np.longdouble(pd))])
        ok = bool(0.0 < pd < 1.0 and powers[-1] >= np.longdouble(2.0) ** -600)
        hit = (np.r_[powers.astype(np.float64), (1 / powers).astype(np.float64)] if ok
               else np.ones(2 * k + 2), ok)
        if len(_POWS_CACHE) > 64:
            _POWS_CACHE.clear()
        _POWS_CACHE[key] = hit
    out[:2 * k + 2] = hit[0]
    return hit[1]


def pers_skip_limit(strike, steps, pu, pd, log_up, log_down) -> float:
    """cuda/binomial.cu PERS_SKIP: an S below which a put's node whose two successors hold their
    exercise value (bit for bit) is exercised too, whatever the rounding, in the persistent kernel's
    scaled arithmetic; NaN: none is known to be.  The serial engine's exercise_limit, each rounding
    error bound widened four times more: the scaled steps round a few more times than the serial
    engine's (a = pu/pd, the pd^-s factors and the exercise numbers scaled by them)."""
    limit = exercise_limit(strike, steps, pu, pd, log_up, log_down, 4.0 * EXERCISE_SLACK)
    return limit if limit > 0.0 else np.nan


def cuda_source_dir() -> Path:
    env = os.environ.get("PRICER_CUDA_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for candidate in (here.parent.parent / "cuda", here.parents[2] / "cuda"):
        if (candidate / "binomial.cu").exists():
            return candidate
    return here.parents[2] / "cuda"


def cache_dir() -> Path:
    env = os.environ.get("PRICER_CUDA_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pricer" / "cuda"


@dataclass(frozen=True)
class GpuConfig:
    t1: int = 200_000         # tiled while t > t1 (run 9: 80 000 before the persistent kernel)
    t2: int = 500             # warp per block while t > t2 (hybrid), CPU below
    tiled_b: int = 256        # threads per tiled block
    tiled_vt: int = 8         # nodes per thread (tiled)
    tiled_k: int = 256        # steps fused per tiled launch (< tiled_b * tiled_vt)
    warp_vt: int = 8          # nodes per lane (warp per block)
    warp_k: int = 64          # steps per warp launch while the level is wider than one tile
    mid_b: int = 256          # gpu/hybrid below t1: the tiled kernel in a narrow shape (mid_b threads
    mid_vt: int = 2           # x mid_vt nodes, mid_k steps per launch, the whole rest in one launch
    mid_k: int = 256          # once the level fits one tile); mid_b = 0: warp per block instead
    pers_vt: int = 8          # gpu/hybrid below t1 (when not 0): the persistent kernel, ONE launch down
    pers_k: int = 64          # to t2 (hybrid) or 0 (gpu): warp tiles of 32 x pers_vt nodes exchanging
    pers_warps: int = 4       # pers_k-node halos every pers_k steps; pers_warps warps per block;
                              # pers_vt = 0: the mid (or warp) regime there instead
    pers_narrow_vt: int = 4   # levels t <= pers_narrow_below: a second persistent launch with tiles
    pers_narrow_below: int | None = None  # of 32 x pers_narrow_vt nodes (same pers_k), i.e. more
                              # tiles where the wide ones leave SM sub-partitions idle; None: where
                              # the wide tiles fill half of them (50 688 on 132 SMs); 0: one shape
    pers_eu_tiles: bool = True  # American options: a tile that cannot exercise during an epoch runs
                                # it with the European node (bitwise the same values, sooner)
    pers_expipe: bool = True  # persistent kernel, fma mode: a step's exercise values computed
                              # during the step before (bitwise the same values, sooner)
    pers_skip: bool = True    # persistent kernel, fma mode: a put's tile whose nodes all hold their
                              # exercise value skips the epoch's steps (bitwise the same values)
    wavefront_block: int = 256
    fma: bool = True          # fused multiply-adds (faster; False: exact mode, bitwise equal to serial)
    cpu_max_steps: int | None = None  # hybrid: options with steps <= this on the CPU (None: t2)
    batch_max_steps: int = 8191       # gpu/hybrid: options up to this many steps go through the
                                      # batch kernel (one block per option, one launch per size class)

    @property
    def tiled_w(self) -> int:
        return self.tiled_b * self.tiled_vt

    @property
    def warp_w(self) -> int:
        return 32 * self.warp_vt

    @property
    def mid_w(self) -> int:
        return self.mid_b * self.mid_vt

    @property
    def pers_w(self) -> int:
        return 32 * self.pers_vt

    def check(self) -> "GpuConfig":
        if not (1 <= self.tiled_k < self.tiled_w):
            raise ValueError(f"tiled_k must be in [1, {self.tiled_w - 1}], got {self.tiled_k}")
        if not (1 <= self.warp_k < self.warp_w):
            raise ValueError(f"warp_k must be in [1, {self.warp_w - 1}], got {self.warp_k}")
        if self.mid_b and not (1 <= self.mid_k < self.mid_w):
            raise ValueError(f"mid_k must be in [1, {self.mid_w - 1}], got {self.mid_k}")
        if self.mid_b % 32 or not (0 <= self.mid_b <= 1024) or self.mid_vt < 1:
            raise ValueError("mid_b must be 0 or a multiple of 32 in [32, 1024], mid_vt >= 1")
        if self.pers_vt and not (1 <= self.pers_vt <= 32 and self.pers_k % self.pers_vt == 0
                                 and 2 <= self.pers_k < self.pers_w and 1 <= self.pers_warps <= 32):
            raise ValueError("persistent kernel: pers_vt in [1, 32] (or 0: off), pers_k a multiple of "
                             f"pers_vt in [2, {self.pers_w - 1}], pers_warps in [1, 32]; got "
                             f"{self.pers_vt}/{self.pers_k}/{self.pers_warps}")
        if self.pers_vt and self.pers_narrow_vt and not (
                1 <= self.pers_narrow_vt <= 32 and self.pers_k % self.pers_narrow_vt == 0
                and self.pers_k < 32 * self.pers_narrow_vt
                and (self.pers_narrow_below is None or self.pers_narrow_below >= 0)):
            raise ValueError("persistent kernel's narrow shape: pers_narrow_vt in [1, 32] (or 0: "
                             "off) dividing pers_k, with pers_k < 32 * pers_narrow_vt, and "
                             f"pers_narrow_below >= 0 (or None); got {self.pers_narrow_vt}, pers_k "
                             f"{self.pers_k}, {self.pers_narrow_below}")
        if self.batch_max_steps >= BATCH_CLASSES[-1][0] * BATCH_CLASSES[-1][1]:
            raise ValueError(f"batch_max_steps must be < {BATCH_CLASSES[-1][0] * BATCH_CLASSES[-1][1]}")
        if self.t1 < 0 or self.t2 < 0:
            raise ValueError("t1 and t2 must be >= 0")
        if self.tiled_b % 32 or not (32 <= self.tiled_b <= 1024):
            raise ValueError("tiled_b must be a multiple of 32 in [32, 1024]")
        return self

    def defines(self) -> list[str]:
        d = [f"-DPRICER_FMA={int(self.fma)}", f"-DTILED_B={self.tiled_b}",
             f"-DTILED_VT={self.tiled_vt}", f"-DWARP_VT={self.warp_vt}"]
        if self.pers_vt:
            d += [f"-DPERS_VT={self.pers_vt}", f"-DPERS_K={self.pers_k}",
                  f"-DPERS_WARPS={self.pers_warps}", f"-DPERS_EU_TILES={int(self.pers_eu_tiles)}",
                  f"-DPERS_EXPIPE={int(self.pers_expipe)}", f"-DPERS_SKIP={int(self.pers_skip)}"]
        return d

    def narrow(self) -> "GpuConfig | None":
        """The configuration of the persistent kernel's narrow shape (None: one shape only)."""
        if not (self.pers_vt and self.pers_narrow_vt and self.pers_narrow_below != 0):
            return None
        return replace(self, pers_vt=self.pers_narrow_vt, pers_narrow_vt=0)

    def mid_defines(self) -> list[str]:
        """The module whose tiled_steps runs the mid regime (TILED_B/VT = mid_b/mid_vt)."""
        return [f"-DPRICER_FMA={int(self.fma)}", f"-DTILED_B={self.mid_b}",
                f"-DTILED_VT={self.mid_vt}", f"-DWARP_VT={self.warp_vt}"]


# ---------------------------------------------------------------------------------------------
# Process-wide CUDA runtime (one context per process).

LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MPI_LOCAL_RANK",
                        "PMI_LOCAL_RANK", "SLURM_LOCALID")


def launcher_local_rank(environ=os.environ) -> int | None:
    """This process's rank on its node as the launcher (Open MPI, MPICH's hydra, Slurm) says, or None."""
    for var in LOCAL_RANK_VARIABLES:
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def local_rank() -> int:
    """This process's rank among the processes of its node: the launcher's word first (no MPI call,
    so it cannot wait on a rank that failed before asking), else a node communicator."""
    from_launcher = launcher_local_rank()
    if from_launcher is not None:
        return from_launcher
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
                node = mpi.COMM_WORLD.Split_type(mpi.COMM_TYPE_SHARED)
                try:
                    return node.Get_rank()
                finally:
                    node.Free()
        except Exception:  # pragma: no cover
            pass
    return 0


def resident_blocks(rt, fn, warps: int) -> int:
    """Blocks of `warps` warps of kernel fn that the whole GPU holds at once: per SM, the least
    of what its registers (allocated per warp in units of 256, per SM sub-partition), threads,
    block slots and shared memory allow, times the SMs."""
    attr = rt.cuda.device_attribute
    dev = rt.device
    sms = dev.get_attribute(attr.MULTIPROCESSOR_COUNT)
    regs_sm = dev.get_attribute(attr.MAX_REGISTERS_PER_MULTIPROCESSOR)
    threads_sm = dev.get_attribute(attr.MAX_THREADS_PER_MULTIPROCESSOR)
    blocks_sm = 16
    if hasattr(attr, "MAX_BLOCKS_PER_MULTIPROCESSOR"):
        blocks_sm = dev.get_attribute(attr.MAX_BLOCKS_PER_MULTIPROCESSOR)
    warp_regs = -(-max(int(fn.num_regs), 1) * 32 // 256) * 256
    warps_sm = 4 * ((regs_sm // 4) // warp_regs)
    per_sm = min(warps_sm // warps, threads_sm // (32 * warps), blocks_sm)
    shared = int(fn.shared_size_bytes)
    if shared:
        per_sm = min(per_sm, dev.get_attribute(attr.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) // shared)
    return max(per_sm, 0) * sms


class GpuRuntime:
    """The process's CUDA context and everything allocated in it."""

    _instance: "GpuRuntime | None" = None
    _lock = threading.Lock()

    def __init__(self, device_index: int | None = None):
        try:
            import pycuda.driver as cuda
        except ImportError as exc:
            raise GpuUnavailable(f"pycuda is not installed ({exc})") from exc
        self.cuda = cuda
        cuda.init()
        count = cuda.Device.count()
        if count == 0:
            raise GpuUnavailable("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
        self.local_rank = local_rank()
        self.device_index = (self.local_rank % count) if device_index is None else device_index
        self.device = cuda.Device(self.device_index)
        self.context = self.device.make_context()   # pushed: current for the rest of the process
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.name = self.device.name()
        try:
            self.pci_bus_id = self.device.pci_bus_id()
        except Exception:  # pragma: no cover
            self.pci_bus_id = "?"
        self._allocations: list = []
        self._modules: dict = {}
        self.stream = cuda.Stream()
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "GpuRuntime":
        with cls._lock:
            if cls._instance is None or cls._instance.closed:
                cls._instance = GpuRuntime()
            return cls._instance

    def alloc(self, nbytes: int):
        a = self.cuda.mem_alloc(max(int(nbytes), 8))
        self._allocations.append(a)
        return a

    def free(self, allocation) -> None:
        try:
            self._allocations.remove(allocation)
        except ValueError:
            pass
        allocation.free()

    def module(self, defines: list[str], source: str = "binomial.cu"):
        """The kernels of cuda/SOURCE compiled for this device with these -D options (disk-cached)."""
        key = (source, *defines)
        if key not in self._modules:
            self._modules[key] = self.cuda.module_from_buffer(compiled_cubin(self.arch, defines, source))
        return self._modules[key]

    def close(self) -> None:
        """Free every device array, then pop and detach the context (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.context.synchronize()
        except Exception:
            pass
        for a in self._allocations:
            try:
                a.free()
            except Exception:
                pass
        self._allocations.clear()
        self._modules.clear()
        self.stream = None
        try:
            self.context.pop()
        finally:
            self.context.detach()


def compiled_cubin(arch: str, defines: list[str], name: str = "binomial.cu") -> bytes:
    source = (cuda_source_dir() / name).read_text()
    options = ["-O3", *defines]
    key = hashlib.sha256("\0".join([source, arch, *options]).encode()).hexdigest()[:24]
    folder = cache_dir()
    path = folder / f"{Path(name).stem}-{key}-{arch}.cubin"
    if path.exists():
        return path.read_bytes()
    from pycuda.compiler import compile as nvcc_compile
    cubin = nvcc_compile(source, options=options, arch=arch, no_extern_c=True, cache_dir=False)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".cubin")
        with os.fdopen(fd, "wb") as fh:
            fh.write(cubin)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a recompile next time
    return cubin


class CudaKernels:
    """The launch interface the schedule uses, backed by pycuda (see NumpyKernels for the emulation)."""

    def __init__(self, config: GpuConfig, runtime: GpuRuntime | None = None):
        self.config = config
        self.rt = runtime or GpuRuntime.get()
        mod = self.rt.module(config.defines())
        self._terminal = mod.get_function("terminal_values")
        self._terminal.prepare("PPPidd")   # values, level_base, ratio, steps, strike, sign
        self._wave = mod.get_function("wavefront_step")
        self._wave.prepare("PPPPiddddi")
        self._tiled = mod.get_function("tiled_steps")
        self._tiled.prepare("PPPPiiddddi")
        self._warp = mod.get_function("warp_steps")
        self._warp.prepare("PPPPiiddddi")
        self._mid = None
        if config.mid_b:
            self._mid = self.rt.module(config.mid_defines()).get_function("tiled_steps")
            self._mid.prepare("PPPPiiddddi")
        self._pers = None
        if config.pers_vt:
            self._pers = mod.get_function("pers_steps")
            # vin, vout, level_base, ratio, pows, ring, progress, status, t, t_stop, tiles, pu, pd,
            # strike, sign, skip_lim, american, scaled, gen
            self._pers.prepare("PPPPPPPPiiidddddiiI")
        self._pers_ring = None      # ring, progress, status, tiles, pows, allocation (_pers_alloc)
        self._pers_gen = 0
        self._pers_tiles = None
        self._narrow = None         # the narrow shape's kernels (narrow_kernels)
        self._capacity = 0
        self._bufs = None
        self._batch_fns: dict = {}

    # The persistent kernel: how many of its tiles (warps) fit on the GPU at once.  Its blocks wait
    # on each other, so every block must be resident: count blocks per SM from the kernel's
    # registers (allocated per warp in units of 256, per SM sub-partition), threads, shared memory
    # and the blocks-per-SM limit, times the SMs.
    def pers_tiles(self) -> int:
        """0 where the runtime cannot say (no such figures, e.g. a stand-in): then the persistent
        kernel is not used."""
        if self._pers_tiles is None:
            self._pers_tiles = 0
            if self._pers is not None:
                try:
                    self._pers_tiles = self._count_pers_tiles()
                except Exception:  # noqa: BLE001 -- a runtime without occupancy figures
                    self._pers_tiles = 0
        return self._pers_tiles

    def _count_pers_tiles(self) -> int:
        warps = self.config.pers_warps
        return resident_blocks(self.rt, self._pers, warps) * warps

    def pers_top(self) -> int:
        """The widest level (t) the persistent kernel may start on: its tiles all fit at once."""
        c = self.config
        return self.pers_tiles() * (c.pers_w - c.pers_k) - 1

    def sub_partitions(self) -> int:
        """The GPU's SM sub-partitions (warp schedulers): 4 per SM since Volta."""
        return 4 * self.rt.device.get_attribute(self.rt.cuda.device_attribute.MULTIPROCESSOR_COUNT)

    def narrow_kernels(self) -> "CudaKernels | None":
        """The persistent kernel in its narrow shape (config.narrow(): its own module, ring and
        tile count, this runtime), built at first use; None where there is none."""
        if self._narrow is None and self.config.narrow() is not None:
            self._narrow = CudaKernels(self.config.narrow(), self.rt)
        return self._narrow

    def _pers_alloc(self):
        """The ring (tiles x PERS_SLOTS x pers_k 16-byte words), the progress words, the status
        word and the pd^s / pd^-s table: one allocation, made at the first persistent launch and
        kept (a few MiB, sized by the tiles that fit; outside memory.py's per-node estimate, inside
        its DEVICE_ALLOWANCE)."""
        if self._pers_ring is None:
            k, tiles = self.config.pers_k, self.pers_tiles() + 1
            ring_b, prog_b = 16 * PERS_SLOTS * k * tiles, -(-4 * tiles // 16) * 16
            block = self.rt.alloc(ring_b + prog_b + 16 + 16 * (k + 1))
            base = int(block)
            self._pers_ring = (base, base + ring_b, base + ring_b + prog_b, tiles,
                               base + ring_b + prog_b + 16, block)
            self._pers_gen = 4095           # zeroed at the first launch
            self._pows_key = None
        return self._pers_ring

    def pers_pows(self, host: np.ndarray):
        """Device copy of the pd^s / pd^-s table (copied only when it changes)."""
        pows = self._pers_alloc()[4]
        key = host.tobytes()
        if key != self._pows_key:
            self.rt.cuda.memcpy_htod(pows, host)
            self._pows_key = key
        return pows

    def _pers_buffers(self):
        cuda = self.rt.cuda
        ring, progress, status, tiles = self._pers_alloc()[:4]
        self._pers_gen += 1
        if self._pers_gen >= 4096:          # flags carry 12 bits of it: zero the words, start again
            cuda.memset_d32(ring, 0, 4 * PERS_SLOTS * self.config.pers_k * tiles)
            cuda.memset_d32(progress, 0, tiles)
            cuda.memset_d32(status, 0, 1)
            self._pers_gen = 1
        return ring, progress, status

    def pers(self, vin, vout, lb, r, pows, t, stop, pu, pd, strike, sign, american, scaled,
             skip_lim=np.nan):
        """Level t -> level stop in one launch of the persistent kernel (skip_lim: pers_skip_limit)."""
        c = self.config
        out_w = c.pers_w - c.pers_k
        tiles = (t - min(c.pers_k, t - stop) + out_w) // out_w
        if tiles > self.pers_tiles() or -(-(t - stop) // c.pers_k) >= 1 << 20:
            raise ValueError(f"level {t} is too wide for the persistent kernel ({tiles} tiles, "
                             f"{self.pers_tiles()} fit)")
        ring, progress, status = self._pers_buffers()
        blocks = -(-tiles // c.pers_warps)
        self._pers.prepared_async_call((blocks, 1), (32 * c.pers_warps, 1, 1), self.rt.stream,
                                       vin, vout, lb, r, pows, ring, progress, status,
                                       np.int32(t), np.int32(stop), np.int32(tiles), pu, pd, strike,
                                       sign, skip_lim, np.int32(american), np.int32(scaled),
                                       np.uint32(self._pers_gen))

    def pers_failed(self) -> bool:
        """Whether a persistent launch gave up waiting (its outputs are NaN); clears the flag."""
        if self._pers_ring is None:
            return False
        flag = np.zeros(1, dtype=np.int32)
        self.rt.cuda.memcpy_dtoh(flag, self._pers_ring[2])
        self.rt.cuda.memset_d32(self._pers_ring[2], 0, 1)
        return bool(flag[0])

    # buffers: two level buffers and one table buffer (level_base then ratio, 2 * (N + 1) entries),
    # grown to the largest option seen
    def reserve(self, nodes: int):
        if nodes > self._capacity:
            if self._bufs is not None:
                for b in self._bufs:
                    self.rt.free(b)
            cap = max(nodes, 1024)
            self._bufs = [self.rt.alloc(8 * cap), self.rt.alloc(8 * cap), self.rt.alloc(16 * cap)]
            self._capacity = cap
        return self._bufs

    @staticmethod
    def split_tables(tab, steps: int):
        """Device addresses of level_base and ratio inside the table buffer."""
        return int(tab), int(tab) + 8 * (steps + 1)

    def host_array(self, size: int) -> np.ndarray:
        """A float64 host buffer in page-locked memory (the tables' upload at N = 100k: 0.10 ms
        from pageable memory, 0.04 ms from page-locked, H200)."""
        return self.rt.cuda.pagelocked_empty(size, np.float64)

    def upload(self, dst, host: np.ndarray):
        self.rt.cuda.memcpy_htod(dst, host)

    def download(self, host: np.ndarray, src):
        self.rt.cuda.memcpy_dtoh(host, src)

    def terminal(self, v, lb, r, steps, strike, sign):
        block = 256
        grid = ((steps + 1 + block - 1) // block, 1)
        self._terminal.prepared_async_call(grid, (block, 1, 1), self.rt.stream, v, lb, r,
                                           np.int32(steps), strike, sign)

    def wavefront(self, vin, vout, lb, r, t, pu, pd, strike, sign, american):
        """Level t+1 -> level t."""
        block = self.config.wavefront_block
        grid = ((t + 1 + block - 1) // block, 1)
        self._wave.prepared_async_call(grid, (block, 1, 1), self.rt.stream, vin, vout, lb, r,
                                       np.int32(t), pu, pd, strike, sign, np.int32(american))

    def tiled(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american):
        """Level t -> level t-k."""
        out_w = self.config.tiled_w - k
        grid = ((t - k + 1 + out_w - 1) // out_w, 1)
        self._tiled.prepared_async_call(grid, (self.config.tiled_b, 1, 1), self.rt.stream, vin, vout,
                                        lb, r, np.int32(t), np.int32(k), pu, pd, strike, sign,
                                        np.int32(american))

    def warp(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american):
        """Level t -> level t-k."""
        out_w = self.config.warp_w - k
        grid = ((t - k + 1 + out_w - 1) // out_w, 1)
        self._warp.prepared_async_call(grid, (32, 1, 1), self.rt.stream, vin, vout, lb, r,
                                       np.int32(t), np.int32(k), pu, pd, strike, sign,
                                       np.int32(american))

    def mid(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american):
        """Level t -> level t-k through the tiled kernel in the mid shape."""
        out_w = self.config.mid_w - k
        grid = ((t - k + 1 + out_w - 1) // out_w, 1)
        self._mid.prepared_async_call(grid, (self.config.mid_b, 1, 1), self.rt.stream, vin, vout,
                                      lb, r, np.int32(t), np.int32(k), pu, pd, strike, sign,
                                      np.int32(american))

    def synchronize(self):
        self.rt.stream.synchronize()

    def batch(self, p: LatticeParams, rows: np.ndarray, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices of options `rows` (all with steps + 1 <= the largest class width), one launch
        per size class; with `levels` ((rows.size, LEVEL_VALUES)) also their first levels' values."""
        cls = batch_class(p.steps[rows])
        order = np.argsort(cls, kind="stable")
        rows_sorted, cls_sorted = rows[order], cls[order]
        host = batch_inputs(p, rows_sorted)
        cuda, rt = self.rt.cuda, self.rt
        dev = {}
        try:
            for key, arr in host.items():
                dev[key] = rt.alloc(arr.nbytes)
                cuda.memcpy_htod(dev[key], arr)
            out_d = dev["out"] = rt.alloc(8 * rows.size)
            levels_d = None
            if levels is not None:
                levels_d = dev["levels"] = rt.alloc(8 * LEVEL_VALUES * rows.size)
            for c in np.unique(cls_sorted):
                lo, hi = np.searchsorted(cls_sorted, [c, c + 1])
                b, vt = BATCH_CLASSES[int(c)]
                fn = self._batch_fn(b, vt)
                ptr = lambda key, size: int(dev[key]) + size * int(lo)  # noqa: E731
                fn.prepared_async_call((int(hi - lo), 1), (b, 1, 1), rt.stream, int(dev["tables"]),
                                       ptr("offsets", 8), ptr("steps", 4), ptr("pu", 8), ptr("pd", 8),
                                       ptr("strike", 8), ptr("sign", 8), ptr("american", 4),
                                       int(out_d) + 8 * int(lo),
                                       0 if levels_d is None else ptr("levels", 8 * LEVEL_VALUES),
                                       np.int32(hi - lo))
            out_sorted = np.empty(rows.size)
            cuda.memcpy_dtoh(out_sorted, out_d)     # waits for the stream (blocking stream)
            if levels is not None:
                levels_sorted = np.empty((rows.size, LEVEL_VALUES))
                cuda.memcpy_dtoh(levels_sorted, levels_d)
                levels[order] = levels_sorted
        finally:
            rt.stream.synchronize()
            for a in dev.values():
                rt.free(a)
        out = np.empty(rows.size)
        out[order] = out_sorted
        return out

    def _batch_fn(self, b, vt):
        key = (b, vt)
        if key not in self._batch_fns:
            defines = [f"-DPRICER_FMA={int(self.config.fma)}", f"-DTILED_B={b}", f"-DTILED_VT={vt}",
                       f"-DWARP_VT={self.config.warp_vt}"]
            fn = self.rt.module(defines).get_function("batch_price")
            fn.prepare("PPPPPPPPPPi")
            self._batch_fns[key] = fn
        return self._batch_fns[key]


class NumpyKernels:
    """A numpy emulation of cuda/binomial.cu with the same tiles, halos and guards (exact
    arithmetic, as fma=False), so the schedule and the index logic can be checked without a GPU."""

    def __init__(self, config: GpuConfig):
        self.config = config
        self._bufs = None
        self._narrow = None

    def narrow_kernels(self):
        """As CudaKernels.narrow_kernels: the same emulation (and stand-in tile count) in the
        narrow shape."""
        if self._narrow is None and self.config.narrow() is not None:
            self._narrow = type(self)(self.config.narrow())
            self._narrow.pers_tiles = self.pers_tiles
            self._narrow.sub_partitions_count = self.sub_partitions_count
        return self._narrow

    def reserve(self, nodes):
        if self._bufs is None or self._bufs[0].size < nodes:
            self._bufs = [np.zeros(nodes), np.zeros(nodes), np.zeros(2 * nodes)]
        return self._bufs

    @staticmethod
    def split_tables(tab, steps: int):
        return tab[:steps + 1], tab[steps + 1:2 * steps + 2]

    @staticmethod
    def pers_pows(host):
        return host.copy()

    @staticmethod
    def host_array(size: int) -> np.ndarray:
        return np.empty(size)

    def upload(self, dst, host):
        dst[:host.size] = host

    def download(self, host, src):
        host[:] = src[:host.size]

    def synchronize(self):
        pass

    def terminal(self, v, lb, r, steps, strike, sign):
        payoff = sign * (lb[steps] * r[:steps + 1] - strike)
        v[:steps + 1] = np.where(payoff > 0.0, payoff, 0.0)

    @staticmethod
    def _node(pu, pd, up, down, sbase, r, mstrike, american):
        hold = pu * up + pd * down
        hold = np.where(hold >= UNDERFLOW, hold, 0.0)
        if american:
            ex = sbase * r + mstrike
            return np.where(ex > hold, ex, hold)
        return hold

    def wavefront(self, vin, vout, lb, r, t, pu, pd, strike, sign, american):
        n = t + 1
        vout[:n] = self._node(pu, pd, vin[1:n + 1], vin[:n], sign * lb[t], r[:n], -sign * strike,
                              american)

    def _tiles(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american, width, vt, warp):
        out_w = width - k
        blocks = (t - k + 1 + out_w - 1) // out_w
        g = np.arange(blocks)[:, None] * out_w + np.arange(width)[None, :]
        inside = g <= t
        gi = np.where(inside, g, 0)
        v = np.where(inside, vin[gi], 0.0)
        rr = np.where(inside, r[gi], 0.0) if american else np.zeros_like(v)
        mstrike = -sign * strike
        exercised = american & self._may_exercise(lb, r, t, k, np.arange(blocks) * out_w, width,
                                                   strike, sign)[:, None]
        for s in range(1, k + 1):
            up = np.empty_like(v)
            up[:, :-1] = v[:, 1:]
            # the last node's neighbour: lane 31's own v[0] (shuffle) or the zeroed halo slot
            up[:, -1] = v[:, width - vt] if warp else 0.0
            hold = self._node(pu, pd, up, v, 0.0, rr, mstrike, False)
            v = (np.where(exercised, self._node(pu, pd, up, v, sign * lb[t - s], rr, mstrike, True),
                          hold) if american else hold)
        keep = (np.arange(width)[None, :] < out_w) & (g <= t - k)
        written = g[keep]
        # on the GPU the blocks run in any order: every output node written exactly once
        if written.size != t - k + 1 or not np.array_equal(np.sort(written), np.arange(t - k + 1)):
            raise AssertionError(f"tiles write {written.size} nodes for a level of {t - k + 1}")
        vout[written] = v[keep]

    @staticmethod
    def _may_exercise(lb, r, t, k, first, width, strike, sign):
        """cuda/binomial.cu may_exercise, per block: blocks that cannot exercise in these k steps
        run the European body there."""
        last = np.minimum(first + width - 1, t)
        inside = first <= t
        l_a, l_b = lb[max(t - 1, 0)], lb[max(t - k, 0)]
        r_a, r_b = r[np.where(inside, first, 0)], r[np.where(inside, last, 0)]
        if sign < 0.0:
            may = min(l_a, l_b) * np.minimum(r_a, r_b) < strike * (1.0 + 1e-9)
        else:
            may = max(l_a, l_b) * np.maximum(r_a, r_b) > strike * (1.0 - 1e-9)
        return inside & may

    def batch(self, p: LatticeParams, rows: np.ndarray, levels: np.ndarray | None = None) -> np.ndarray:
        h = batch_inputs(p, rows)
        out = np.empty(rows.size)
        if levels is not None:
            levels[:] = np.nan
        for j, c in enumerate(batch_class(p.steps[rows])):
            b, vt = BATCH_CLASSES[int(c)]
            width, n, o = b * vt, int(h["steps"][j]), int(h["offsets"][j])
            lb, r = h["tables"][o:o + n + 1], h["tables"][o + n + 1:o + 2 * n + 2]
            sign, strike, american = h["sign"][j], h["strike"][j], bool(h["american"][j])
            rr = np.zeros(width)
            rr[:n + 1] = r
            v = np.zeros(width)
            payoff = sign * (lb[n] * r - strike)
            v[:n + 1] = np.where(payoff > 0.0, payoff, 0.0)
            for s in range(0, n + 1):
                if s > 0:
                    up = np.empty_like(v)
                    up[:-1] = v[1:]
                    up[-1] = 0.0
                    v = self._node(h["pu"][j], h["pd"][j], up, v, sign * lb[n - s], rr,
                                   -sign * strike, american)
                if levels is not None and n >= 2 and n - s == 2:   # N < 2 keeps NaN
                    levels[j, 2:5] = v[:3]          # V(2,0), V(2,1), V(2,2)
                elif levels is not None and n >= 2 and n - s == 1:
                    levels[j, 0:2] = v[:2]          # V(1,0), V(1,1)
            out[j] = v[0]
        return out

    def pers_top(self) -> int:
        """As CudaKernels.pers_top, for a stand-in GPU of `pers_tiles` tiles."""
        c = self.config
        return self.pers_tiles * (c.pers_w - c.pers_k) - 1

    pers_tiles = 64
    sub_partitions_count = 4     # the stand-in GPU's SM sub-partitions

    def sub_partitions(self) -> int:
        return self.sub_partitions_count

    def pers_failed(self) -> bool:
        return False

    def pers(self, vin, vout, lb, r, pows, t, stop, pu, pd, strike, sign, american, scaled,
             skip_lim=np.nan):
        """cuda/binomial.cu pers_steps (exact arithmetic, as every kernel here: `scaled` and the
        scaled arithmetic's skip_lim are ignored): tiles of W =
        32 * pers_vt nodes owning OUT = W - pers_k output nodes each, epochs of k <= pers_k steps,
        each tile's halo the right neighbour's first pers_k nodes of the epoch's start level."""
        c = self.config
        width, vt, kk = c.pers_w, c.pers_vt, c.pers_k
        out_w = width - kk
        tiles = (t - min(kk, t - stop) + out_w) // out_w
        assert tiles <= self.pers_tiles
        a0 = np.arange(tiles) * out_w
        g = a0[:, None] + np.arange(width)[None, :]
        inside = g <= t
        gi = np.where(inside, g, 0)
        v = np.where(inside, vin[gi], 0.0)
        rr = np.where(inside, r[gi], 0.0) if american else np.zeros_like(v)
        mstrike = -sign * strike
        e = 0
        while t > stop:
            k = min(kk, t - stop)
            if e > 0:
                # the halo: tile j+1's first pers_k nodes of level t where it has any (it computed
                # the last epoch), else zeros
                has = np.r_[a0[1:] <= t, False]
                halo = np.zeros((tiles, kk))
                halo[:-1] = v[1:, :kk]
                v[:, out_w:] = np.where(has[:, None], halo, 0.0)
            for s in range(1, k + 1):
                up = np.empty_like(v)
                up[:, :-1] = v[:, 1:]
                up[:, -1] = v[:, width - vt]          # lane 31's shuffle returns its own v[0]
                v = self._node(pu, pd, up, v, sign * lb[t - s], rr, mstrike, american)
            t -= k
            e += 1
        keep = (np.arange(width)[None, :] < out_w) & (g <= stop)
        written = g[keep]
        if written.size != stop + 1 or not np.array_equal(np.sort(written), np.arange(stop + 1)):
            raise AssertionError(f"tiles write {written.size} nodes for a level of {stop + 1}")
        vout[written] = v[keep]

    def tiled(self, vin, vout, lb, r, t, k, *args):
        c = self.config
        self._tiles(vin, vout, lb, r, t, k, *args, c.tiled_w, c.tiled_vt, warp=False)

    def warp(self, vin, vout, lb, r, t, k, *args):
        c = self.config
        self._tiles(vin, vout, lb, r, t, k, *args, c.warp_w, c.warp_vt, warp=True)

    def mid(self, vin, vout, lb, r, t, k, *args):
        c = self.config
        self._tiles(vin, vout, lb, r, t, k, *args, c.mid_w, c.mid_vt, warp=False)


# ---------------------------------------------------------------------------------------------
# The schedule.

class GpuEngine:
    """Options one after another, each through the regimes of `mode` (see the module docstring).

    Configuration: an explicit `config` is taken as it is; without one, GpuConfig() <- `defaults`
    <- the cached calibration of this GPU (`pricer calibrate`; pricer/calibrate.py) <- nothing else.
    `overrides` (GpuConfig fields, e.g. t1=..., t2=...) win in both cases. The calibration is looked
    up by `device_name`, else by the name of the GPU the engine runs on (none with given kernels).
    """

    def __init__(self, mode: str = "gpu", config: GpuConfig | None = None, kernels=None,
                 device_name: str | None = None, defaults: dict | None = None, **overrides):
        if mode not in MODES:
            raise ValueError(f"unknown GPU mode {mode!r}; known: {', '.join(MODES)}")
        self.mode = mode
        self.name = "hybrid" if mode == "hybrid" else ("gpu" if mode == "gpu" else f"gpu-{mode}")
        runtime = None
        self.calibration = None      # the calibration file the configuration came from, if any
        if config is None:
            if device_name is None and kernels is None:
                runtime = GpuRuntime.get()
                device_name = runtime.name
            from pricer.calibrate import effective_config
            self.config, self.calibration = effective_config(device_name, overrides, defaults)
        else:
            self.config = replace(config, **overrides).check()
        if mode == "pers" and not self.config.pers_vt:
            raise ValueError("mode 'pers' needs pers_vt > 0")
        self.kernels = kernels if kernels is not None else CudaKernels(self.config, runtime)
        self._host = None
        # set once a persistent launch gave up waiting (its blocks were not all resident, e.g. a
        # GPU shared with other processes' kernels under MPS): the launch-per-K regimes from then on
        self.pers_off = False

    def _host_buffers(self, nodes):
        if self._host is None or self._host[0].size < nodes:
            self._host = [self.kernels.host_array(nodes), self.kernels.host_array(2 * nodes)]
        return self._host

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        out = np.empty(len(params))
        if len(params) == 0:
            return out
        gpu_rows = np.arange(len(params))
        if self.mode == "hybrid":
            limit = self.config.t2 if self.config.cpu_max_steps is None else self.config.cpu_max_steps
            small = params.steps <= limit
            if small.any():
                from pricer.engines.cpu import CpuEngine
                rows = np.flatnonzero(small)
                part = None if levels is None else np.empty((rows.size, LEVEL_VALUES))
                out[rows] = CpuEngine().price(params.take(rows), part)
                if levels is not None:
                    levels[rows] = part
            gpu_rows = np.flatnonzero(~small)
        if self.mode in ("gpu", "hybrid") and self.config.batch_max_steps > 0 and gpu_rows.size:
            in_batch = params.steps[gpu_rows] <= self.config.batch_max_steps
            if in_batch.any():
                rows = gpu_rows[in_batch]
                part = None if levels is None else np.empty((rows.size, LEVEL_VALUES))
                out[rows] = self.kernels.batch(params, rows, part)
                if levels is not None:
                    levels[rows] = part
                gpu_rows = gpu_rows[~in_batch]
        if gpu_rows.size:
            top = int(params.steps[gpu_rows].max()) + 2
            bufs = self.kernels.reserve(top)
            host = self._host_buffers(top)
            for k in gpu_rows:
                out[k] = self.price_one(params, int(k), bufs, host, levels)
        return out

    def _pers_phases(self, K, stop: int, skips: bool = False) -> list:
        """The persistent launches down to level `stop`, as [(kernels, level it stops at)]: the
        wide shape while the level is above pers_narrow_below (or above the widest level the narrow
        shape's tiles hold at once, if that is lower), then the narrow shape, whose more and smaller
        tiles keep more SM sub-partitions busy on narrow levels (docs/performance.md, run 11).
        Where the option's exercised tiles skip their epochs (`skips`, pers_skip), the narrow shape
        by default takes over as soon as its tiles hold the level (run 14)."""
        narrow = K.narrow_kernels()
        if narrow is None or narrow.pers_top() < 0:
            return [(K, stop)]
        c = self.config
        below = c.pers_narrow_below
        if below is None and skips:   # the tiles that skip leave their sub-partitions to the others
            below = narrow.pers_top()
        elif below is None:  # run 11's best on 528 sub-partitions, 40 000-60 000, scaled to this GPU
            below = K.sub_partitions() * (c.pers_w - c.pers_k) // 2
        mid = max(stop, min(below, narrow.pers_top()))
        return [(K, mid), (narrow, stop)]

    def price_one(self, p: LatticeParams, k: int, bufs=None, host=None, levels=None) -> float:
        """One option through the regimes; levels[k] receives its first levels' values if given
        (the GPU then stops at level 2 at the latest and the host takes the last two steps)."""
        n = int(p.steps[k])
        if n < 1:
            raise ValueError("steps must be >= 1")
        if bufs is None:
            bufs = self.kernels.reserve(n + 2)
        if host is None:
            host = self._host_buffers(n + 2)
        c, K = self.config, self.kernels
        a, b, tab_d = bufs
        values, tab = host
        lb, ratio = tab[:n + 1], tab[n + 1:2 * n + 2]
        sign = 1.0 if p.call[k] else -1.0
        american = bool(p.american[k])
        strike, pu, pd = float(p.strike[k]), float(p.pu[k]), float(p.pd[k])
        power_tables(float(p.spot[k]), float(p.log_up[k]), float(p.log_down[k]), n, lb, ratio)
        floor = 2 if levels is not None else 0    # levels 2 and 1 are kept on the host
        use_pers = self.mode == "pers" or (self.mode in ("gpu", "hybrid") and c.pers_vt > 0
                                           and not self.pers_off)
        if use_pers and K.pers_top() < 0:          # occupancy unknown: not the persistent kernel
            if self.mode == "pers":
                raise GpuError("the persistent kernel needs the GPU's occupancy figures")
            use_pers = False
        last = max(floor, c.t2 if self.mode == "hybrid" else 0)   # where the GPU regimes stop
        scaled, pows = False, None
        skip_lim = np.nan               # pers_skip: a put's tiles below it skip exercised epochs
        if use_pers:                               # pd^s, pd^-s (both shapes have the same pers_k)
            pows = np.empty(2 * c.pers_k + 2)
            scaled = c.fma and pers_pows(pd, c.pers_k, pows)
            if scaled and american and sign < 0 and c.pers_skip:
                skip_lim = pers_skip_limit(strike, n, pu, pd, float(p.log_up[k]), float(p.log_down[k]))
        phases = self._pers_phases(K, last, not np.isnan(skip_lim)) if use_pers else []
        K.upload(tab_d, tab[:2 * n + 2])           # both tables in one copy
        lb_d, r_d = K.split_tables(tab_d, n)
        K.terminal(a, lb_d, r_d, n, strike, sign)
        src, dst = a, b
        t = n
        scalars = (pu, pd, strike, sign, american)

        if self.mode == "wavefront":
            while t > floor:
                K.wavefront(src, dst, lb_d, r_d, t - 1, *scalars)
                src, dst = dst, src
                t -= 1
        else:
            if self.mode in ("gpu", "hybrid", "tiled", "pers"):
                # tiled while t > T1 (gpu/hybrid), to the end (tiled), or while the level is too
                # wide for all the persistent kernel's tiles to be resident at once
                tiled_to = floor if self.mode == "tiled" else (0 if self.mode == "pers" else c.t1)
                if use_pers:
                    tiled_to = min(tiled_to, K.pers_top()) if self.mode != "pers" else K.pers_top()
                tiled_to = max(floor, tiled_to)
                while t > tiled_to:
                    step = min(c.tiled_k, t - tiled_to)
                    K.tiled(src, dst, lb_d, r_d, t, step, *scalars)
                    src, dst = dst, src
                    t -= step
            if use_pers:
                for kernels, until in phases:      # each shape's levels in one launch
                    if t > until:
                        kernels.pers(src, dst, lb_d, r_d, kernels.pers_pows(pows), t, until,
                                     *scalars, scaled, skip_lim)
                        src, dst = dst, src
                        t = until
            else:
                if self.mode in ("gpu", "hybrid") and c.mid_b:
                    narrow, width, per_launch = K.mid, c.mid_w, c.mid_k
                else:
                    narrow, width, per_launch = K.warp, c.warp_w, c.warp_k
                while t > last:
                    # per_launch steps per launch; once the level fits one tile, the whole rest in one
                    step = t - last if t + 1 <= width else min(per_launch, t - last)
                    narrow(src, dst, lb_d, r_d, t, step, *scalars)
                    src, dst = dst, src
                    t -= step

        level = values[:t + 1]
        K.download(level, src)
        if use_pers and np.isnan(level).any() and any([k.pers_failed() for k, _ in phases]):
            if self.mode == "pers":
                raise GpuError("the persistent kernel gave up waiting for a neighbour tile (were "
                               "its blocks not all resident?); no price returned")
            print("pricer: warning: the persistent GPU kernel gave up waiting for a neighbour tile "
                  "(its blocks were not all resident: a GPU shared with other processes' kernels?); "
                  "this and later options use the launch-per-step-block regimes instead",
                  file=sys.stderr, flush=True)
            self.pers_off = True
            return self.price_one(p, k, bufs, host, levels)
        if t > 0 or levels is not None:
            backward_keeping_levels(values, t, strike, sign, american, pu, pd, lb, ratio,
                                    level_array(levels), k, 0.0)
        return float(values[0])


def make_engine(mode: str, **overrides) -> GpuEngine:
    return GpuEngine(mode, **overrides)
