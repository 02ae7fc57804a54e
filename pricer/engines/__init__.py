"""The pricing engines: the interface and registry (base.py), the CPU engines (cpu/), the GPU
engines (gpu/), and the built-in backends' registry entries (below). Engines never see ids, files
or MPI; what an engine is and can say about itself is pricer.engines.base.Engine.
"""

from __future__ import annotations

import functools

from pricer.engines.base import Engine, backend, backends, register, unregister
from pricer.errors import InputError

__all__ = ["AUTO_CPU_MAX_NODES", "Engine", "backend", "backends", "get_engine",
           "gpu_available", "register", "resolve_backend", "set_local_rank", "unregister"]


# `auto` on a GPU machine is `batch`; a rank's share of at most this many lattice nodes is priced on
# the CPU instead (a launch, its copies and the first-use set-up cost more than that much CPU work).
AUTO_CPU_MAX_NODES = 2_000_000


def gpu_available() -> bool:
    """True if the GPU backends can run here (pricer.engines.gpu.runtime.gpu_available)."""
    from pricer.engines.gpu.runtime import gpu_available as available
    return available()


def set_local_rank(rank: int | None) -> None:
    """The run's word on this process's rank among the processes of its node, which chooses its
    GPU where the launcher says nothing (the run splits its communicator by node)."""
    from pricer.engines.gpu.runtime import set_local_rank as set_rank
    set_rank(rank)


def resolve_backend(name: str) -> str:
    """The concrete backend for a requested name; `auto` picks the best one this machine has."""
    known = backend(name)
    if name == "auto":
        return "batch" if gpu_available() else "cpu"
    if known.needs_gpu and not gpu_available():
        # raised on rank 0 while the input is checked, before any collective work
        raise InputError(f"backend {name!r} needs a CUDA GPU, pycuda and nvcc; none usable here "
                         f"(use --backend cpu)")
    return name


def get_engine(name: str, family: str = "options", method: str = "lattice",
               **overrides) -> Engine:
    """The engine of backend `name` for `family` by `method` (`auto`: for options its own
    routing, for bonds the GPU's where one is usable, else the CPU's). `overrides` (GpuConfig
    fields such as t1, t2) configure the option GPU backends over their calibrated or default
    values; the other engines ignore them."""
    concrete = "auto" if name == "auto" and backend("auto").prices(family, method) else \
        resolve_backend(name)
    return backend(concrete).engine(family, method, asked=name, **overrides)


# ------------------------------------------------------------------------- the built-in backends

def _serial(**overrides) -> Engine:
    from pricer.engines.cpu.serial import SerialEngine
    return SerialEngine()


def _cpu(**overrides) -> Engine:
    from pricer.engines.cpu.parallel import CpuEngine
    return CpuEngine()


def _gpu(mode: str, **overrides) -> Engine:
    from pricer.engines.gpu.engine import GpuEngine
    from pricer.engines.gpu.runtime import GpuUnavailable
    try:
        return GpuEngine(mode, **overrides)
    except GpuUnavailable as exc:
        raise InputError(f"backend {mode!r} needs a usable GPU: {exc}") from None


def _auto(**overrides) -> Engine:
    if not gpu_available():
        return _cpu()
    from pricer.engines.gpu.engine import GpuEngine
    from pricer.engines.gpu.runtime import GpuUnavailable
    try:
        return GpuEngine("batch", cpu_max_nodes=AUTO_CPU_MAX_NODES, **overrides)
    except GpuUnavailable as exc:
        raise InputError(f"backend 'batch' needs a usable GPU: {exc}") from None


def _bonds_cpu(threads: int | None = None, **ignored) -> Engine:
    from pricer.engines.cpu.trinomial import HullWhiteCpuEngine
    return HullWhiteCpuEngine(threads)


def _bonds_serial(**ignored) -> Engine:
    return _bonds_cpu(1)


def _bonds_gpu(**ignored) -> Engine:
    from pricer.engines.gpu.runtime import GpuUnavailable
    from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
    try:
        return HullWhiteGpuEngine()
    except GpuUnavailable as exc:
        raise InputError(f"bond options on the GPU need a usable GPU: {exc}") from None


OPTIONS, BONDS = ("options", "lattice"), ("bonds", "lattice")
# `auto` prices options by its own routing; its bonds are the backend it resolves to's
register("auto", {OPTIONS: _auto},
         help="batch where a GPU is usable (a small share on the CPU), else cpu")
register("serial", {OPTIONS: _serial, BONDS: _bonds_serial},
         help="one core, the reference engine")
register("cpu", {OPTIONS: _cpu, BONDS: _bonds_cpu}, help="all the rank's cores (numba)")
register("gpu", {OPTIONS: functools.partial(_gpu, "gpu"), BONDS: _bonds_gpu}, needs_gpu=True,
         help="batch kernels up to 16 383 steps, the GPU regimes above, down to level 0")
register("hybrid", {OPTIONS: functools.partial(_gpu, "hybrid"), BONDS: _bonds_gpu},
         needs_gpu=True,
         help="as gpu, with small options and the regimes' last levels on the CPU")
register("batch", {OPTIONS: functools.partial(_gpu, "batch"), BONDS: _bonds_gpu},
         needs_gpu=True,
         help="whole books per launch; wider options through the regimes and a CPU tail")
