"""Stage 4: the pricing engines, one module per backend, chosen by name from a small registry.

Every engine has `name` and `price(params: LatticeParams) -> np.ndarray` (float64, one price per
option, in the order given). Engines never see ids, files or MPI.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from pricer.errors import InputError


def _key_numba_cache_by_source() -> None:
    """numba re-checks a cached kernel only against its own file, not against the kernels it calls
    in other modules (cpu.py and gpu.py build on serial.py's): after an edit of serial.py alone the
    cached cpu kernels would still run the old code. So the cache lives in one folder per hash of
    the engine sources, under NUMBA_CACHE_DIR if set (point it at node-local storage on clusters)."""
    import numba

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "pricer", "numba")
    numba.config.CACHE_DIR = os.path.join(base, f"engines-{digest.hexdigest()[:16]}")


_key_numba_cache_by_source()


def _prefer_full_width_vectors() -> None:
    """On AVX-512 machines LLVM still vectorises the node loops 256 bits wide (the CPU model's
    "prefer-256-bit" tuning); 512-bit loops measured 1.2-1.45x faster per core here, with the same
    elementwise arithmetic, so prices do not change by a bit. Applies only if no numba code was
    compiled in this process before the engines were imported."""
    import llvmlite.binding as llvm
    import numba

    if os.environ.get("NUMBA_CPU_FEATURES") or os.environ.get("NUMBA_CPU_NAME"):
        return  # the user chose the code generation
    llvm.initialize_native_target()
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        numba.config.CPU_NAME = llvm.get_host_cpu_name()
        numba.config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"


_prefer_full_width_vectors()



BACKENDS = ("auto", "serial", "cpu", "gpu", "hybrid", "batch")

# `hybrid` picked by hand prices options up to this many steps on the CPU outright (all cores beat
# its one-option-at-a-time GPU path there: docs/gpu-notes.md, H200, 16 cores), unless `pricer
# calibrate` measured another crossover for this GPU.
AUTO_CPU_MAX_STEPS = 500
# `auto` on a GPU machine is `batch`; a rank's share of at most this many lattice nodes is priced on
# the CPU instead (a launch, its copies and the first-use set-up cost more than that much CPU work).
AUTO_CPU_MAX_NODES = 2_000_000


def show_each_rank_its_gpu(environ=os.environ, gpus: int | None = None) -> None:
    """On a node with several GPUs, where the launcher set no CUDA_VISIBLE_DEVICES, show this rank
    only GPU (local rank mod GPUs) — the one GpuRuntime would pick — before CUDA starts: otherwise
    every rank's CUDA start sets up every GPU of the node, and the ranks queue for the driver
    (engine start 0.44 s at 1 rank, 0.86 s at 4 on a 4 x H200 node, docs/performance.md).
    PRICER_GPU_PIN=0 leaves the variable alone."""
    if "CUDA_VISIBLE_DEVICES" in environ or environ.get("PRICER_GPU_PIN", "1") == "0":
        return
    from pricer.engines.gpu import launcher_local_rank
    local = launcher_local_rank(environ)
    if gpus is None:   # the driver's list: counting the GPUs must not start CUDA
        gpus = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    if local is not None and gpus > 1:
        environ["CUDA_VISIBLE_DEVICES"] = str(local % gpus)


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


def resolve_backend(name: str) -> str:
    """The concrete backend for a requested name; `auto` picks the best one this machine has."""
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    if name == "auto":
        return "batch" if gpu_available() else "cpu"
    if name in ("gpu", "hybrid", "batch") and not gpu_available():
        # raised on rank 0 while the input is checked, before any collective work
        raise InputError(f"backend {name!r} needs a CUDA GPU, pycuda and nvcc; none usable here "
                         f"(use --backend cpu)")
    return name


def get_engine(name: str, **overrides):
    """The engine for backend `name`. `overrides` (GpuConfig fields such as t1, t2) configure the GPU
    backends over their calibrated or default values; the CPU backends have none and ignore them."""
    backend = resolve_backend(name)
    if backend == "batch":
        from pricer.engines.batch import BatchEngine
        from pricer.engines.gpu import GpuUnavailable
        try:
            return BatchEngine(cpu_max_nodes=AUTO_CPU_MAX_NODES if name == "auto" else 0,
                               **overrides)
        except GpuUnavailable as exc:
            raise InputError(f"backend 'batch' needs a usable GPU: {exc}") from None
    if backend in ("gpu", "hybrid"):
        from pricer.engines.gpu import GpuEngine, GpuUnavailable
        # a default only: a cached calibration's cpu_max_steps replaces it
        defaults = {"cpu_max_steps": AUTO_CPU_MAX_STEPS} if name == "auto" else {}
        try:
            return GpuEngine(backend, defaults=defaults, **overrides)
        except GpuUnavailable as exc:
            raise InputError(f"backend {backend!r} needs a usable GPU: {exc}") from None
    if backend == "serial":
        from pricer.engines.serial import SerialEngine
        return SerialEngine()
    from pricer.engines.cpu import CpuEngine
    return CpuEngine()
