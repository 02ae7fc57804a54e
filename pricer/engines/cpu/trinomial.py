"""The CPU engine of the Hull–White trinomial family (pricer/model/hw1f.py): each instrument's
forward induction (the Arrow–Debreu prices and the displacements alpha that fit its curve) and
backward induction (the bond's cash flows and the option) in one compiled function, a level at a
time across the tree's width, with one division a step and a table of e^{-j dr dt}; the
instruments spread over numba's threads, heaviest first, dealt round-robin.

The step's factor e^{-alpha_m dt} is taken as P(0, (m + 1) dt) / sum_j Q(m, j) e^{-j dr dt}, as
GPU-FLAT takes it, which is the NumPy reference's (hw1f.price) exp(-(ln sum - ln P)) without
its two logarithms and exponential (on small trees those were a third of the time); it is kept
from the forward sweep for the backward one. Otherwise the reference's arithmetic in its order:
prices agree to rounding (the reference sums a level with np.dot and np.add.at)."""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.base import Engine
from pricer.model.bond_book import HullWhiteParams

OPTION, CALLABLE, PUTTABLE = 0, 1, 2   # hw1f.PRODUCTS' codes


@njit(cache=True, nogil=True)
def _branching(jmax, M, offset, pu, pm, pd):
    """hw1f.branching into the given arrays (rows j + jmax)."""
    for row in range(2 * jmax + 1):
        j = row - jmax
        jm, jjmm = j * M, j * j * M * M
        if row == 2 * jmax:
            offset[row] = -1
            pu[row] = 7.0 / 6.0 + (jjmm + 3.0 * jm) / 2.0
            pm[row] = -1.0 / 3.0 - jjmm - 2.0 * jm
            pd[row] = 1.0 / 6.0 + (jjmm + jm) / 2.0
        elif row == 0:
            offset[row] = 1
            pu[row] = 1.0 / 6.0 + (jjmm - jm) / 2.0
            pm[row] = -1.0 / 3.0 - jjmm + 2.0 * jm
            pd[row] = 7.0 / 6.0 + (jjmm - 3.0 * jm) / 2.0
        else:
            offset[row] = 0
            pu[row] = 1.0 / 6.0 + (jjmm + jm) / 2.0
            pm[row] = 2.0 / 3.0 - jjmm
            pd[row] = 1.0 / 6.0 + (jjmm - jm) / 2.0


SCRATCH_ROWS = 10     # value_one's float arrays of a tree's width


# error_model numpy: a level whose sum is 0 gives inf, then a NaN price (bond_book.NO_VALUE's
# rows), not a ZeroDivisionError
@njit(cache=True, nogil=True, error_model="numpy")
def value_one(a, dt, steps, jmax, dr, strike, face, sign, product, flows, exercise, discount,
              scratch, offset, shifts):
    """One instrument's value today (hw1f.price on its row of HullWhiteParams); scratch
    (SCRATCH_ROWS, >= 2 jmax + 1), offset (>= 2 jmax + 1, int64) and shifts (>= steps: each
    step's e^{-alpha_m dt}): its working arrays, reused from one instrument to the next."""
    width = 2 * jmax + 1
    pu, pm, pd = scratch[0, :width], scratch[1, :width], scratch[2, :width]
    _branching(jmax, math.expm1(-a * dt), offset, pu, pm, pd)
    q, q_next = scratch[3, :width], scratch[4, :width]
    local = scratch[5, :width]                   # e^{-j dr dt} at row j + jmax
    for row in range(width):
        local[row] = math.exp(-(row - jmax) * dr * dt)
    q[0] = 1.0                                   # level m's node j at index j + min(m, jmax)
    for m in range(steps):
        w, w_next = min(m, jmax), min(m + 1, jmax)
        total = 0.0
        for i in range(2 * w + 1):
            total += q[i] * local[i - w + jmax]
        shift = discount[m + 1] / total
        shifts[m] = shift
        for i in range(2 * w_next + 1):
            q_next[i] = 0.0
        for i in range(2 * w + 1):
            row = i - w + jmax
            centre = i - w + offset[row] + w_next
            v = q[i] * (local[row] * shift)
            q_next[centre + 1] += v * pu[row]
            q_next[centre] += v * pm[row]
            q_next[centre - 1] += v * pd[row]
        q, q_next = q_next, q
    bond, bond_next = scratch[6, :width], scratch[7, :width]
    value, value_next = scratch[8, :width], scratch[9, :width]
    w = min(steps, jmax)
    for i in range(2 * w + 1):                   # ex-coupon at maturity: nothing left
        bond[i] = 0.0
        value[i] = 0.0
    if exercise[steps]:                          # against the redemption (hw1f._at_maturity)
        for i in range(2 * w + 1):
            if product == OPTION:
                value[i] = max(value[i], max(sign * (face - strike), 0.0))
            elif product == CALLABLE:
                value[i] = min(face, strike) - face
            else:
                value[i] = max(face, strike) - face
    # the bond alone is needed only by an option on it (its exercise value); a callable or
    # puttable bond's value carries the bond's flows itself
    with_bond = product == OPTION
    for m in range(steps - 1, -1, -1):
        w_next, w = w, min(m, jmax)
        flow = flows[m + 1]
        shift = shifts[m]
        carried = 0.0 if with_bond else flow
        for i in range(2 * w_next + 1):
            if with_bond:
                bond_next[i] = bond[i] + flow
            value_next[i] = value[i] + carried
        for i in range(2 * w + 1):
            row = i - w + jmax
            centre = i - w + offset[row] + w_next
            disc = shift * local[row]
            if with_bond:
                bond[i] = disc * (pu[row] * bond_next[centre + 1] + pm[row] * bond_next[centre]
                                  + pd[row] * bond_next[centre - 1])
            value[i] = disc * (pu[row] * value_next[centre + 1] + pm[row] * value_next[centre]
                               + pd[row] * value_next[centre - 1])
        if exercise[m]:
            _exercise(bond, value, 2 * w + 1, strike, sign, product)
    return value[0]


@njit(cache=True, nogil=True)
def _exercise(bond, value, count, strike, sign, product):
    for i in range(count):
        if product == OPTION:
            value[i] = max(value[i], max(sign * (bond[i] - strike), 0.0))
        elif product == CALLABLE:
            value[i] = min(value[i], strike)
        else:
            value[i] = max(value[i], strike)


@njit(cache=True, parallel=True)
def _value_all(a, dt, steps, jmax, dr, strike, face, sign, product, starts, flows, exercise,
               discount, order, threads, out):
    n = order.size
    width, height = 2 * jmax.max() + 1, steps.max()
    for t in prange(threads):
        scratch = np.empty((SCRATCH_ROWS, width))
        offset = np.empty(width, dtype=np.int64)
        shifts = np.empty(height)
        for k in range(t, n, threads):
            i = order[k]
            lo, hi = starts[i], starts[i] + steps[i] + 1
            out[i] = value_one(a[i], dt[i], steps[i], jmax[i], dr[i], strike[i], face[i],
                               sign[i], product[i], flows[lo:hi], exercise[lo:hi],
                               discount[lo:hi], scratch, offset, shifts)


class HullWhiteCpuEngine(Engine):
    """The family's CPU engine on all of numba's threads (or at most `threads`)."""

    name = "cpu"

    def __init__(self, threads: int | None = None):
        self.threads = threads
        if threads == 1:
            self.name = "serial"

    def price(self, params: HullWhiteParams, levels=None) -> np.ndarray:
        out = np.empty(len(params))
        if len(params) == 0:
            return out
        order = np.argsort(-params.nodes(), kind="stable")
        threads = max(1, min(numba.get_num_threads(), self.threads or len(params), len(params)))
        p = params
        _value_all(p.a, p.dt, p.steps, p.jmax, p.dr, p.strike, p.face, p.sign, p.product,
                   p.starts, p.flows, p.exercise, p.discount, order, threads, out)
        return out
