"""The process's CUDA runtime: one context per process on this rank's GPU, the compile cache of
the kernels, and what the scheduler asks of the device (occupancy, SMs).

Process model: the context is created on first use (GpuRuntime.get) on device (local rank modulo
the visible devices), pushed once, and popped at exit (atexit, or close()) after every device array
has been freed. The local rank is the launcher's (Open MPI, MPICH's hydra, Slurm), else the one the
run set (set_local_rank: the run splits its communicator by node), else 0. CUDA_VISIBLE_DEVICES is
honoured by the driver; pricer.devices.show_each_rank_its_gpu narrows it to the rank's own GPU
before CUDA starts.

Kernels are compiled at run time for the device's sm_XY with nvcc (through pycuda) and cached on
disk as cubins (PRICER_CUDA_CACHE, else $XDG_CACHE_HOME/pricer/cuda, else ~/.cache/pricer/cuda),
keyed by the hash of the source, the options, the arch and the toolchain (nvcc's resolved path
and size, pycuda's version), so that one cache serves several nodes and users. A cubin is written
atomically, and compiled under a lock on its own name (flock), so that ranks starting at once on
a cold cache compile each kernel once and the others wait for it. An engine asks for every
variant it may need at its start (GpuRuntime.precompile), and the missing ones compile at once,
one nvcc per core, beside the read of the input. pycuda is imported lazily, so this module
imports on machines without it.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from pricer.compiling import compiling
from pricer.devices import launcher_local_rank, show_each_rank_its_gpu
from pricer.files import atomic_write, cache_dir


class GpuUnavailable(RuntimeError):
    """No usable GPU: pycuda missing, no device, or no nvcc to build the kernels."""


def cuda_source_dir() -> Path:
    """cuda/ of the installed package (pricer/cuda) or of the source tree; PRICER_CUDA_DIR wins."""
    env = os.environ.get("PRICER_CUDA_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "cuda", here.parents[3] / "cuda"):
        if (candidate / "binomial.cu").exists():
            return candidate
    return here.parents[3] / "cuda"


_run_local_rank: int | None = None


def set_local_rank(rank: int | None) -> None:
    """The run's word on this process's rank among its node's (used where the launcher says none)."""
    global _run_local_rank
    _run_local_rank = rank


def local_rank() -> int:
    """This process's rank among the processes of its node: the launcher's word first, else the
    run's (set_local_rank), else 0."""
    from_launcher = launcher_local_rank()
    if from_launcher is not None:
        return from_launcher
    return _run_local_rank or 0


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True if the GPU backends can run here: pycuda importable, a CUDA device visible, nvcc found.
    Cheap (no context is created); PRICER_NO_GPU=1 says no."""
    if os.environ.get("PRICER_NO_GPU", "") not in ("", "0"):
        return False
    show_each_rank_its_gpu()
    if importlib.util.find_spec("pycuda") is None:
        return False
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return False
    try:
        import pycuda.driver as cuda
        cuda.init()
        return cuda.Device.count() > 0
    except Exception:
        return False


def resident_blocks(rt, fn, warps: int) -> int:
    """Blocks of `warps` warps of kernel fn that the whole GPU holds at once: per SM, the least
    of what its registers (allocated per warp in units of 256, per SM sub-partition), threads,
    block slots and shared memory allow, times the SMs."""
    attr = rt.cuda.device_attribute
    dev = rt.device
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
    return max(per_sm, 0) * rt.sms


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
        self._cubins: dict = {}     # precompiled, not loaded yet (an unwritable cache keeps them)
        self.stream = cuda.Stream()
        self.closed = False
        atexit.register(self.close)

    @functools.cached_property
    def sms(self) -> int:
        """The GPU's streaming multiprocessors."""
        return int(self.device.get_attribute(self.cuda.device_attribute.MULTIPROCESSOR_COUNT))

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
            cubin = self._cubins.pop(key, None) or compiled_cubin(self.arch, defines, source)
            self._modules[key] = self.cuda.module_from_buffer(cubin)
        return self._modules[key]

    def precompile(self, variants: list) -> None:
        """The cubins of these (defines, source) variants that the cache does not hold, compiled
        at once (one nvcc per core of this process); module() loads them when they are first
        used. Those another process is compiling are left to it at first, so that ranks bound to
        a core each share the work, then waited for. A variant that fails to compile is left to
        its first use, which fails there."""
        wanted = {(source, *defines): (list(defines), source) for defines, source in variants}
        missing = [key for key, (defines, source) in wanted.items()
                   if key not in self._modules and key not in self._cubins
                   and not cubin_path(self.arch, defines, source).exists()]
        if not missing:
            return

        def compile_one(key, wait):
            try:
                return compiled_cubin(self.arch, *wanted[key], wait=wait)
            except Exception:  # noqa: BLE001 - module() compiles it again and fails where used
                return b""

        workers = min(len(missing), len(os.sched_getaffinity(0)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pricer-nvcc") as pool:
            first = list(pool.map(lambda key: compile_one(key, False), missing))
            busy = [key for key, cubin in zip(missing, first) if cubin is None]
            later = list(pool.map(lambda key: compile_one(key, True), busy))
        for key, cubin in [*zip(missing, first), *zip(busy, later)]:
            if cubin:
                self._cubins[key] = cubin

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


def cubin_path(arch: str, defines: list[str], name: str = "binomial.cu") -> Path:
    """Where the cache keeps cuda/NAME compiled for `arch` with these -D options."""
    source = (cuda_source_dir() / name).read_text()
    key = hashlib.sha256("\0".join([source, arch, _toolchain(), *_nvcc_options(defines)])
                         .encode()).hexdigest()[:24]
    return cache_dir("cuda", "PRICER_CUDA_CACHE") / f"{Path(name).stem}-{key}-{arch}.cubin"


def compiled_cubin(arch: str, defines: list[str], name: str = "binomial.cu",
                   wait: bool = True) -> bytes | None:
    """cuda/NAME compiled for `arch` with these -D options: from the cache on disk, else by nvcc
    (and then cached), under the cubin's lock: a process that finds another compiling it waits
    and reads the other's cubin (wait=False: returns None at once instead)."""
    path = cubin_path(arch, defines, name)
    if path.exists():
        return path.read_bytes()
    with _compiling(path, wait) as held:
        if not held:
            return None
        if path.exists():
            return path.read_bytes()
        from pycuda.compiler import compile as nvcc_compile
        with compiling():       # the run's compile stage (pricer/compiling.py)
            cubin = nvcc_compile((cuda_source_dir() / name).read_text(),
                                 options=_nvcc_options(defines), arch=arch, no_extern_c=True,
                                 cache_dir=False)
        try:
            atomic_write(path, cubin)
        except OSError:
            pass  # an unwritable cache only costs a recompile next time
    return cubin


def _nvcc_options(defines: list[str]) -> list[str]:
    return ["-O3", *defines]


@functools.lru_cache(maxsize=1)
def _toolchain() -> str:
    """What else decides a cubin's bytes: nvcc (its resolved path and size, which differ between
    CUDA versions) and pycuda's version (the flags it adds)."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc")
    try:
        real = os.path.realpath(nvcc)
        found = f"{real}:{os.stat(real).st_size}"
    except OSError:
        found = "nvcc not found"
    try:
        from pycuda import VERSION_TEXT
    except ImportError:
        VERSION_TEXT = "no pycuda"
    return f"{found} pycuda {VERSION_TEXT}"


# how long a process waits for another's compile of the same cubin (one takes seconds) before it
# compiles the cubin itself: a holder that hangs must not hold every rank's start
LOCK_WAIT_SECONDS = 300.0


@contextmanager
def _compiling(path: Path, wait: bool = True):
    """An exclusive lock on PATH.lock while the cubin is compiled (filelock's FileLock: an
    flock, released if the process dies); yields True to compile. Without a lock (an unwritable
    cache, a file system without locks, a holder that keeps it past LOCK_WAIT_SECONDS) it yields
    True too; where another process holds it and `wait` is False, False."""
    import filelock

    lock = filelock.FileLock(path.with_suffix(".lock"), timeout=LOCK_WAIT_SECONDS if wait else 0,
                             fallback_to_soft=False, preserve_lock_file=True)
    held = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        held = True
    except filelock.Timeout:
        if not wait:
            yield False
            return
    except (OSError, NotImplementedError):   # no folder, no write access, no locks there
        pass
    try:
        yield True
    finally:
        if held:
            lock.release()
