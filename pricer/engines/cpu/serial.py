"""The `serial` backend: one core, options one after another through the padded kernels
(padded.py), two lattices at a time (options.py) -- the reference engine every other backend is
checked against (bitwise for the CPU engines and the GPU's exact mode)."""

from __future__ import annotations

import numpy as np

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.base import Engine, sample_params
from pricer.engines.cpu.options import (_prepare, _work_size, _work_views, is_clamped,
                                        price_clamped, price_options, price_range)
from pricer.engines.cpu.padded import backward_padded
from pricer.model.lattice import FLAGS_ROW, FLOAT_ROWS, LEVEL_VALUES, STEPS_ROW, LatticeParams

_SPOT, _STRIKE = FLOAT_ROWS["spot"], FLOAT_ROWS["strike"]
_LOG_UP, _LOG_DOWN, _PU, _PD = (FLOAT_ROWS[name] for name in ("log_up", "log_down", "pu", "pd"))


@njit(cache=True, nogil=True)
def packed_arguments(packed):
    """kernel_arguments from LatticeParams.packed (see lattice.packed_views)."""
    n = packed.shape[1]
    flags = packed[FLAGS_ROW].view(np.bool_)
    return (packed[_SPOT], packed[_STRIKE], packed[STEPS_ROW].view(np.int64), flags[:n],
            flags[n:2 * n], packed[_LOG_UP], packed[_LOG_DOWN], packed[_PU], packed[_PD])


@njit(cache=True, nogil=True)
def _price_alone(spot, strike, steps, call, american, log_up, log_down, pu, pd):
    """One option's price, from scalars: the pair machinery's bookkeeping (arrays handed through
    four calls, each counting references) is a sizeable share of a small option's time."""
    return _price_in(np.empty(_work_size(steps + 1)), spot, strike, steps, call, american, log_up,
                     log_down, pu, pd)


@njit(cache=True, nogil=True, _nrt=False)
def _price_in(buf, spot, strike, steps, call, american, log_up, log_down, pu, pd):
    """_price_alone in its work buffer, without reference counting (the views would be counted)."""
    values, level_base, ratio, scratch = _work_views(buf, steps + 1)
    sign = _prepare(values, level_base, ratio, scratch, spot, strike, steps, call, log_up,
                    log_down)
    # np.int64(0), not 0: a literal 0 compiled a second copy of backward_padded
    backward_padded(values, steps, np.int64(0), strike, sign, american, pu, pd, level_base, ratio,
                    steps, log_up, log_down)
    return values[0]


@intrinsic
def _bits(typingctx, x):
    """The 64 bits of a float64 as an int64 (LatticeParams.packed keeps steps and flags so)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@njit(cache=True, nogil=True)
def price_all(packed, out):
    """price_range over all the options of LatticeParams.packed, without their first levels: two
    array arguments, where the nine fields would each add to numba's dispatch per call. Returns
    price_range's count of the CLAMPED lattices it left (price_packed prices them)."""
    if out.size == 1 and not is_clamped(packed[_SPOT, 0], packed[_LOG_UP, 0],
                                        packed[_LOG_DOWN, 0], _bits(packed[STEPS_ROW, 0])):
        out[0] = _price_one(packed)
        return 0
    spot, strike, steps, call, american, log_up, log_down, pu, pd = packed_arguments(packed)
    if out.size == 0:
        return 0
    return price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd,
                       np.arange(out.size), out, np.empty((0, LEVEL_VALUES)))


@njit(cache=True, nogil=True, inline="always")
def _price_one(packed):
    """_price_alone of LatticeParams.packed's first option, from the numbers themselves: nine
    views of packed's rows would each be reference-counted. The flags row holds call then
    american, a byte each (packed_views; little-endian)."""
    flags = _bits(packed[FLAGS_ROW, 0])
    return _price_alone(packed[_SPOT, 0], packed[_STRIKE, 0], _bits(packed[STEPS_ROW, 0]),
                        (flags & 0xFF) != 0, (flags & 0xFF00) != 0, packed[_LOG_UP, 0],
                        packed[_LOG_DOWN, 0], packed[_PU, 0], packed[_PD, 0])


def kernel_arguments(params: LatticeParams):
    return (params.spot, params.strike, params.steps, params.call, params.american,
            params.log_up, params.log_down, params.pu, params.pd)


# Shared and never written (it has no rows): allocating one per call costs as much as a small option.
_NO_LEVELS = np.empty((0, LEVEL_VALUES))


def level_array(levels: np.ndarray | None) -> np.ndarray:
    """The `levels` argument of the kernels: the caller's (n, LEVEL_VALUES) array, or no rows."""
    return _NO_LEVELS if levels is None else levels


class Direct:
    """A kernel called through its compiled entry point for one signature, without numba's type
    dispatch (a measurable share of a small call). Only for arguments that always have exactly
    those types: LatticeParams.packed (always a C-contiguous float64 (PACKED_ROWS, n) array) and a
    fresh float64 `out`. Compiled (or loaded from numba's cache) on the first call."""

    def __init__(self, kernel, signature: str):
        self.kernel, self.signature = kernel, signature
        self.call = self._first_call

    def _first_call(self, *args):
        self.call = self.kernel.compile(self.signature)
        return self.call(*args)


_price_all = Direct(price_all, "int64(float64[:, ::1], float64[::1])")


def price_packed(params: LatticeParams, out: np.ndarray) -> None:
    """price_all into out, then the CLAMPED lattices it left."""
    if _price_all.call(params.packed, out):
        price_clamped(*kernel_arguments(params), np.arange(params.count, dtype=np.int64), out,
                      _NO_LEVELS)


def price_here(params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
    """All the options on this thread, in one kernel call (two where a lattice is CLAMPED)."""
    out = np.empty(len(params))
    if levels is None:
        price_packed(params, out)
    else:
        price_options(*kernel_arguments(params), np.arange(len(params), dtype=np.int64), out,
                      levels)
    return out


class SerialEngine(Engine):
    """One core, options one after another."""

    name = "serial"

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        return price_here(params, levels)

    def warm_up(self) -> None:
        """price_all compiled (or loaded from numba's cache) beside the read, on a small book."""
        self.price(sample_params([16, 24]))
