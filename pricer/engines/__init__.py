"""Stage 4: the pricing engines, one module per backend, chosen by name from a small registry.

Every engine has `name` and `price(params: LatticeParams) -> np.ndarray` (float64, one price per
option, in the order given). Engines never see ids, files or MPI.
"""

from __future__ import annotations

from pricer.errors import InputError

BACKENDS = ("auto", "serial", "cpu")


def resolve_backend(name: str) -> str:
    """The concrete backend for a requested name; `auto` picks the best one this machine has."""
    if name not in BACKENDS:
        raise InputError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    if name == "auto":
        return "cpu"
    return name


def get_engine(name: str):
    backend = resolve_backend(name)
    if backend == "serial":
        from pricer.engines.serial import SerialEngine
        return SerialEngine()
    from pricer.engines.cpu import CpuEngine
    return CpuEngine()
