"""The `serial` backend: one core, numba-compiled backward induction — the reference engine.

Asset prices are never updated incrementally over the lattice: node (t, i) uses S0*exp(t*log_down) *
exp(i*(log_up - log_down)) from two tables whose entries are within a few ulp (see _exp_table), so
the exercise value is as accurate at N = 1 000 000 as at N = 10. The kernels below are also the building blocks of the `cpu` backend and of the GPU CPU tail; all
of them do exactly the same floating-point operations per node, so every backend that uses them is
bitwise equal to this one.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from pricer.lattice import LatticeParams

# Option values below 2**-963 (~1e-290) are set to 0. Far out-of-the-money nodes of wide lattices
# otherwise decay into subnormal numbers, which x86 cores handle in microcode: a 7x slow-down on a
# tenth of the nodes of such lattices. Values are never negative, so on the GPU the same test is an
# integer compare of the high word (< 0x03C00000), which keeps every backend bitwise equal; the
# prices move by less than 1e-280 at most.
UNDERFLOW = 2.0 ** -963


@njit(cache=True, nogil=True)
def _exp_table(scale, rate, count, out):
    """out[k] = scale * exp(k * rate) for k < count, with about 2*sqrt(count) calls to exp: each
    entry is one product of two correctly rounded exponentials, so it is within a few ulp."""
    block = int(math.sqrt(count)) + 1
    small = np.empty(block)
    for j in range(block):
        small[j] = math.exp(j * rate)
    for start in range(0, count, block):
        big = scale * math.exp(start * rate)
        for j in range(min(block, count - start)):
            out[start + j] = big * small[j]


@njit(cache=True, nogil=True)
def power_tables(spot, log_up, log_down, steps, level_base, ratio):
    """level_base[t] = S0*d^t (price of node (t, 0)); ratio[i] = (u/d)^i."""
    _exp_table(spot, log_down, steps + 1, level_base)
    _exp_table(1.0, log_up - log_down, steps + 1, ratio)


@njit(cache=True, nogil=True)
def terminal_values(values, steps, strike, sign, level_base, ratio):
    base = level_base[steps]
    for i in range(steps + 1):
        payoff = sign * (base * ratio[i] - strike)
        values[i] = payoff if payoff > 0.0 else 0.0


@njit(cache=True, nogil=True)
def advance(values, width, t_from, levels, strike, sign, american, pu, pd, level_base, ratio):
    """Take `levels` backward steps in place from level t_from, whose first `width` nodes are in
    values[0..width); each step leaves one node fewer. ratio may be offset (ratio[j] belongs to
    values[j]), which lets a chunk of a level advance on its own."""
    minus_strike = -sign * strike
    for s in range(1, levels + 1):
        signed_base = sign * level_base[t_from - s]
        count = width - s
        if american:
            # sign is +-1, so signed_base*ratio + minus_strike == sign*(S - strike) exactly
            for i in range(count):
                hold = pu * values[i + 1] + pd * values[i]
                hold = hold if hold >= UNDERFLOW else 0.0
                exercise = signed_base * ratio[i] + minus_strike
                values[i] = exercise if exercise > hold else hold
        else:
            for i in range(count):
                hold = pu * values[i + 1] + pd * values[i]
                values[i] = hold if hold >= UNDERFLOW else 0.0


@njit(cache=True, nogil=True)
def backward_inplace(values, t_from, t_to, strike, sign, american, pu, pd, level_base, ratio):
    """From level t_from (values[0..t_from]) down to level t_to, in place."""
    advance(values, t_from + 1, t_from, t_from - t_to, strike, sign, american, pu, pd,
            level_base, ratio)


# Greeks need the option values of the lattice's first levels: LEVEL_VALUES numbers per option,
# V(1, 0), V(1, 1), V(2, 0), V(2, 1), V(2, 2) (NaN for an option with fewer than 2 steps).
LEVEL_VALUES = 5


@njit(cache=True, nogil=True)
def backward_keeping_levels(values, t_from, strike, sign, american, pu, pd, level_base, ratio,
                            levels, row):
    """backward_inplace down to level 0, keeping levels 2 and 1 in levels[row] (if it has rows).
    The same steps in the same order, so the price is bitwise the one backward_inplace gives."""
    if levels.shape[0] == 0 or t_from < 2:
        if levels.shape[0] > 0:
            levels[row, :] = np.nan
        backward_inplace(values, t_from, 0, strike, sign, american, pu, pd, level_base, ratio)
        return
    backward_inplace(values, t_from, 2, strike, sign, american, pu, pd, level_base, ratio)
    levels[row, 2] = values[0]
    levels[row, 3] = values[1]
    levels[row, 4] = values[2]
    backward_inplace(values, 2, 1, strike, sign, american, pu, pd, level_base, ratio)
    levels[row, 0] = values[0]
    levels[row, 1] = values[1]
    backward_inplace(values, 1, 0, strike, sign, american, pu, pd, level_base, ratio)


@njit(cache=True, nogil=True)
def price_one(spot, strike, steps, call, american, log_up, log_down, pu, pd,
              values, level_base, ratio, levels, row):
    """Price one option with caller-provided work arrays of length >= steps + 1; levels[row]
    receives its first levels' values if `levels` has rows."""
    sign = 1.0 if call else -1.0
    power_tables(spot, log_up, log_down, steps, level_base, ratio)
    terminal_values(values, steps, strike, sign, level_base, ratio)
    backward_keeping_levels(values, steps, strike, sign, american, pu, pd, level_base, ratio,
                            levels, row)
    return values[0]


@njit(cache=True, nogil=True)
def price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out, levels):
    """Price the options order[0..], one after another, reusing one set of work arrays;
    `levels` is (len(out), LEVEL_VALUES) to keep the first levels' values, or (0, LEVEL_VALUES)."""
    if order.size == 0:
        return
    width = 1
    for k in order:
        width = max(width, steps[k] + 1)
    values = np.empty(width)
    level_base = np.empty(width)
    ratio = np.empty(width)
    for k in order:
        out[k] = price_one(spot[k], strike[k], steps[k], call[k], american[k], log_up[k],
                           log_down[k], pu[k], pd[k], values, level_base, ratio, levels, k)


def kernel_arguments(params: LatticeParams):
    return (params.spot, params.strike, params.steps, params.call, params.american,
            params.log_up, params.log_down, params.pu, params.pd)


def level_array(levels: np.ndarray | None) -> np.ndarray:
    """The `levels` argument of the kernels: the caller's (n, LEVEL_VALUES) array, or no rows."""
    return np.empty((0, LEVEL_VALUES)) if levels is None else levels


class SerialEngine:
    """One core, options one after another."""

    name = "serial"

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        out = np.empty(len(params))
        price_range(*kernel_arguments(params), np.arange(len(params), dtype=np.int64), out,
                    level_array(levels))
        return out
