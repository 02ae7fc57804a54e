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


@njit(cache=True, nogil=True)
def price_one(spot, strike, steps, call, american, log_up, log_down, pu, pd,
              values, level_base, ratio):
    """Price one option with caller-provided work arrays of length >= steps + 1."""
    sign = 1.0 if call else -1.0
    power_tables(spot, log_up, log_down, steps, level_base, ratio)
    terminal_values(values, steps, strike, sign, level_base, ratio)
    backward_inplace(values, steps, 0, strike, sign, american, pu, pd, level_base, ratio)
    return values[0]


@njit(cache=True, nogil=True)
def price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out):
    """Price the options order[0..], one after another, reusing one set of work arrays."""
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
                           log_down[k], pu[k], pd[k], values, level_base, ratio)


def kernel_arguments(params: LatticeParams):
    return (params.spot, params.strike, params.steps, params.call, params.american,
            params.log_up, params.log_down, params.pu, params.pd)


class SerialEngine:
    """One core, options one after another."""

    name = "serial"

    def price(self, params: LatticeParams) -> np.ndarray:
        out = np.empty(len(params))
        price_range(*kernel_arguments(params), np.arange(len(params), dtype=np.int64), out)
        return out
