"""Kernel compilation as a run sees it: numba's compiles (its cache misses) and nvcc's builds of
the CUDA kernels, timed as one clock, so that a run can report them as their own stage (not as
its read or compute) and keep them out of its nodes per second, and can say that it is compiling
when it starts to (the first run on a machine: tens of seconds on 2 cores, silent otherwise).

The clock counts wall time while at least one compile is under way (compiles nest, and nvcc's run
in threads at once: their union, not their sum). Only compiles count: a kernel loaded from a
cache is not one.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import Callable

_lock = threading.Lock()
_depth = 0                  # compiles under way, in every thread of this process
_since = 0.0                # when the outermost of them began
_total = 0.0                # seconds of the finished ones
_notice: Callable[[], None] | None = None   # called once, as the process's first compile begins


def seconds() -> float:
    """Wall seconds this process has spent compiling kernels so far."""
    with _lock:
        return _total + (time.perf_counter() - _since if _depth else 0.0)


def notify_first(callback: Callable[[], None] | None) -> None:
    """Call `callback` once, from the thread whose compile it is, when the next compile of this
    process begins (nested in one under way or not); None cancels a callback not yet called."""
    global _notice
    with _lock:
        _notice = callback


@contextmanager
def compiling():
    """Wraps one compile (nvcc's build of a module: pricer/engines/gpu/runtime.py)."""
    _begin()
    try:
        yield
    finally:
        _end()


def _begin() -> None:
    global _depth, _since, _notice
    with _lock:
        if _depth == 0:
            _since = time.perf_counter()
        _depth += 1
        callback, _notice = _notice, None
    if callback is not None:
        callback()


def _end() -> None:
    global _depth, _total
    with _lock:
        _depth -= 1
        if _depth == 0:
            _total += time.perf_counter() - _since


@functools.lru_cache(maxsize=1)
def watch_numba() -> None:
    """Count numba's compiles on this clock (its "numba:compile" event, which it raises only
    where no cached kernel serves: numba.core.dispatcher). Imports numba: for commands that
    price, which import it anyway."""
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, event):
            _begin()

        def on_end(self, event):
            _end()

    event.register("numba:compile", _Listener())


class StageClock:
    """A run's stages timed one after the other, the compiles each held (seconds()) taken out of
    it into a "compile" stage of their own, first (and left out where there were none)."""

    def __init__(self):
        self.stages = {"compile": 0.0}
        self._at, self._compiled = time.perf_counter(), seconds()

    def lap(self, name: str, less: float = 0.0, beside: float = 0.0) -> float:
        """Close stage `name` (begun where the last one ended), less `less` seconds that another
        stage counts (and that hold no compile); returns its seconds. `beside`: seconds of other
        work the stage did in another thread while it compiled (a plan beside an engine's
        start): only the compile beyond it lengthened the stage, so only that counts as the
        compile's."""
        compiled = seconds()
        now = time.perf_counter()
        elapsed = now - self._at
        held = min(compiled - self._compiled, max(0.0, elapsed - beside))
        self.stages["compile"] += held
        self.stages[name] = max(0.0, elapsed - held - less)
        self._at, self._compiled = now, compiled
        return self.stages[name]

    def restart(self) -> None:
        """Time the next stage from now (what came between counts nowhere)."""
        self._compiled = seconds()
        self._at = time.perf_counter()

    def result(self) -> dict:
        return {k: v for k, v in self.stages.items() if k != "compile" or v > 0.0}


def prefer_full_width_vectors() -> None:
    """On AVX-512 machines LLVM still vectorises the node loops 256 bits wide (the CPU model's
    "prefer-256-bit" tuning); 512-bit loops measured faster per core (docs/decisions.md), with the
    same elementwise arithmetic, so prices do not change by a bit. numba's code generation is the
    process's, so the `pricer` command sets it (before its first compile); a program that imports
    pricer keeps numba's own choice (or sets NUMBA_CPU_FEATURES itself)."""
    import os

    import llvmlite.binding as llvm
    import numba

    if os.environ.get("NUMBA_CPU_FEATURES") or os.environ.get("NUMBA_CPU_NAME"):
        return  # the user chose the code generation
    llvm.initialize_native_target()
    features = llvm.get_host_cpu_features()
    if features.get("avx512f"):
        numba.config.CPU_NAME = llvm.get_host_cpu_name()
        numba.config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"
