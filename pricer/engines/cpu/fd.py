"""The CPU engine of the finite-difference method (pricer/model/fd.py): options in groups of LANES,
each SIMD lane one option, as the paper's implicit2 on the CPU (Giles et al. (2014), section 4):
a grid of the group's J nodes is LANES options wide, so every step's sweeps over the nodes run
the lanes side by side. The tridiagonal matrix of a step is constant in time (the coefficients
are), so each lane's Thomas pivots are computed once (the paper's implicit3) and a step is a
right-hand side, a forward and a backward substitution, and the American splitting.

Lanes of one group share J and run to the group's most steps; a lane's values are taken at its
own last step, and its arithmetic never reads another lane's, so an option's values are the same
in any group: at any thread count, partition or order (the groups follow the options sorted by
nodes and steps). Values per option: the spot node's and its two neighbours' (price, delta,
gamma) and the spot node's one step before the last (theta), FD_VALUES."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.model.fd import RANNACHER_STEPS, FdParams, cell_average, end_values

LANES = 8              # float64 lanes of an AVX-512 vector
FD_VALUES = 4          # u[j0 - 1], u[j0], u[j0 + 1] at the last step, u[j0] a step before


def fd_values(params: FdParams, spot: np.ndarray) -> np.ndarray:
    """(n, FD_VALUES) node values of every option of `params` (spot: each option's, whose log
    is its grid's node j0)."""
    n = len(params)
    out = np.empty((n, FD_VALUES))
    if n == 0:
        return out
    lanes = groups(params.space, params.steps)
    s_lo = np.exp(params.x_min)
    s_hi = np.exp(params.x_min + (params.space - 1) * params.h)
    _price_groups(lanes, params.space, params.j0, params.steps, params.dt, params.alpha,
                  params.beta, params.rate, params.dividend, params.strike, params.call,
                  params.american, params.x_min, params.h, s_lo, s_hi, float(params.theta), out)
    return out


def groups(space: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """(groups, LANES) option numbers, -1 for an empty lane: the options sorted by (J, steps), cut
    into LANES at a time within each J."""
    order = np.lexsort((steps, space))
    cuts = np.flatnonzero(np.diff(space[order])) + 1
    rows = []
    for run in np.split(order, cuts):
        pad = (-run.size) % LANES
        rows.append(np.concatenate((run, np.full(pad, -1, dtype=np.int64))).reshape(-1, LANES))
    return np.ascontiguousarray(np.concatenate(rows).astype(np.int64))


@njit(cache=True, nogil=True, parallel=True)
def _price_groups(lanes, space, j0, steps, dt, alpha, beta, rate, dividend, strike, call,
                  american, x_min, h, s_lo, s_hi, theta, out):
    for g in prange(lanes.shape[0]):
        _group(lanes[g], space, j0, steps, dt, alpha, beta, rate, dividend, strike, call,
               american, x_min, h, s_lo, s_hi, theta, out)


@njit(cache=True, nogil=True)
def _pivots(a, b, c, th, J, cp, inv):
    """The Thomas pivots of the interior rows 1 .. J-2 of (I - th A): cp_j (the upper factor)
    and inv_j (the reciprocal of the pivot), per lane."""
    W = a.size
    for k in range(W):
        lo, mid, up = -th * a[k], 1.0 - th * b[k], -th * c[k]
        inv[1, k] = 1.0 / mid
        cp[1, k] = up * inv[1, k]
        for j in range(2, J - 1):
            inv[j, k] = 1.0 / (mid - lo * cp[j - 1, k])
            cp[j, k] = up * inv[j, k]


@njit(cache=True, nogil=True)
def _group(lane, space, j0s, steps, dt, alpha, beta, rate, dividend, strike, call, american,
           x_min, h, s_lo, s_hi, theta, out):
    W = LANES
    first = lane[0]
    J, j0 = space[first], j0s[first]
    # each lane's numbers (an empty lane repeats the first option's; its values are dropped)
    opt = np.empty(W, np.int64)
    for k in range(W):
        opt[k] = lane[k] if lane[k] >= 0 else first
    most = 0
    for k in range(W):
        most = max(most, steps[opt[k]])
    a, b, c = np.empty(W), np.empty(W), np.empty(W)
    ah, bh, ch = np.empty(W), np.empty(W), np.empty(W)
    step, K, r, q, lo_s, hi_s = (np.empty(W), np.empty(W), np.empty(W), np.empty(W),
                                 np.empty(W), np.empty(W))
    is_call, is_am, last = np.empty(W, np.bool_), np.empty(W, np.bool_), np.empty(W, np.int64)
    for k in range(W):
        i = opt[k]
        step[k] = dt[i]
        a[k] = dt[i] * (alpha[i] - beta[i])
        b[k] = -dt[i] * (2.0 * alpha[i] + rate[i])
        c[k] = dt[i] * (alpha[i] + beta[i])
        ah[k], bh[k], ch[k] = 0.5 * a[k], 0.5 * b[k], 0.5 * c[k]
        K[k], r[k], q[k] = strike[i], rate[i], dividend[i]
        lo_s[k], hi_s[k] = s_lo[i], s_hi[i]
        is_call[k], is_am[k], last[k] = call[i], american[i], steps[i]
    u, lam, g = np.empty((J, W)), np.zeros((J, W)), np.empty((J, W))
    d = np.empty((J, W))
    cp, inv = np.empty((J, W)), np.empty((J, W))
    cph, invh = np.empty((J, W)), np.empty((J, W))
    _start(opt, J, x_min, h, strike, call, u, g)
    rannacher = theta == 0.5
    if theta > 0.0:
        _pivots(a, b, c, theta, J, cp, inv)
    if rannacher:
        _pivots(ah, bh, ch, 1.0, J, cph, invh)
    half = np.empty(W)
    for k in range(W):
        half[k] = 0.5 * step[k]
        if last[k] == 1 and lane[k] >= 0:   # theta's value one step before the last: tau = 0
            out[lane[k], 3] = u[j0, k]
    tau = np.zeros(W)
    for n in range(most):
        if rannacher and n < RANNACHER_STEPS:
            for _ in range(2):
                for k in range(W):
                    tau[k] += half[k]
                _step(u, lam, g, d, ah, bh, ch, 1.0, cph, invh, half, tau, K, r, q, lo_s,
                      hi_s, is_call, is_am, J)
        else:
            for k in range(W):
                tau[k] = (n + 1) * step[k]
            _step(u, lam, g, d, a, b, c, theta, cp, inv, step, tau, K, r, q, lo_s, hi_s,
                  is_call, is_am, J)
        for k in range(W):
            if lane[k] >= 0:
                if n + 2 == last[k]:
                    out[lane[k], 3] = u[j0, k]
                elif n + 1 == last[k]:
                    out[lane[k], 0] = u[j0 - 1, k]
                    out[lane[k], 1] = u[j0, k]
                    out[lane[k], 2] = u[j0 + 1, k]


@njit(cache=True, nogil=True)
def _start(opt, J, x_min, h, strike, call, u, g):
    """The payoff on the nodes (g, the American obstacle) and the values at tau = 0 (u: the node
    nearest the strike its cell average, pricer/model/fd.py's start)."""
    for k in range(opt.size):
        i = opt[k]
        for j in range(J):
            s = math.exp(x_min[i] + j * h[i])
            g[j, k] = max(s - strike[i], 0.0) if call[i] else max(strike[i] - s, 0.0)
            u[j, k] = g[j, k]
        j = int(np.rint((math.log(strike[i]) - x_min[i]) / h[i]))
        if 0 < j < J - 1:
            u[j, k] = cell_average(x_min[i] + j * h[i], h[i], strike[i], call[i])


@njit(cache=True, nogil=True)
def _step(u, lam, g, d, a, b, c, th, cp, inv, dts, tau, K, r, q, lo_s, hi_s, is_call, is_am, J):
    """One step of the theta-scheme to `tau` (per lane) in the change form, the American lanes by
    Ikonen–Toivanen's splitting (theta > 0) or the payoff's maximum (explicit)."""
    W = a.size
    lo, hi = np.empty(W), np.empty(W)
    for k in range(W):                    # the ends' values at tau (pricer/model/fd.py)
        lo[k], hi[k] = end_values(is_call[k], is_am[k], K[k], r[k], q[k], lo_s[k], hi_s[k],
                                  tau[k])
    for j in range(1, J - 1):
        for k in range(W):
            d[j, k] = a[k] * u[j - 1, k] + b[k] * u[j, k] + c[k] * u[j + 1, k]
    if th == 0.0:
        for j in range(1, J - 1):
            for k in range(W):
                v = u[j, k] + d[j, k]
                u[j, k] = max(v, g[j, k]) if is_am[k] else v
    else:
        for k in range(W):
            if is_am[k]:
                for j in range(1, J - 1):
                    d[j, k] += dts[k] * lam[j, k]
            d[1, k] += th * a[k] * (lo[k] - u[0, k])
            d[J - 2, k] += th * c[k] * (hi[k] - u[J - 1, k])
        for k in range(W):
            d[1, k] *= inv[1, k]
        for j in range(2, J - 1):
            for k in range(W):
                d[j, k] = (d[j, k] + th * a[k] * d[j - 1, k]) * inv[j, k]
        for j in range(J - 3, 0, -1):
            for k in range(W):
                d[j, k] -= cp[j, k] * d[j + 1, k]
        for j in range(1, J - 1):
            for k in range(W):
                v = u[j, k] + d[j, k]
                if is_am[k]:
                    u[j, k] = max(v - dts[k] * lam[j, k], g[j, k])
                    lam[j, k] = max(0.0, lam[j, k] + (g[j, k] - v) / dts[k])
                else:
                    u[j, k] = v
    for k in range(W):
        u[0, k], u[J - 1, k] = lo[k], hi[k]
