"""The plain NumPy oracle every backend is checked against, written apart from the engines.

- `oracle_prices(params, levels=None)`: backward induction over whole levels with numpy, from an
  engine's own inputs (LatticeParams: pu, pd, log_up, log_down), for every tree. The node price is
  computed where it is used, S0 exp(t ln d + i ln(u/d)) (no power tables, no skipped nodes, no
  floor below which values are flushed), and American options take max(hold, exercise) at every
  node, t = 0 included. It checks the engines' arithmetic and schedules, to rounding.
- `textbook_crr(...)`: the textbook CRR lattice from the market data (u = e^{sigma sqrt(dt)}, d = 1/u,
  p = (e^{(r-q)dt} - d)/(u - d)), which checks the lattice parameters themselves.
- `OracleEngine`: the oracle as an engine (pricer.engines.base.Engine), so that it can also run
  through `pricer price` as a registered backend (tests/data/oracle_backend.py).
Agreement is to rounding: 1e-12 relative for N up to a few thousand (the error grows like N times
the unit roundoff), scaled by the strike where a price is below 1e-8 of it.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from pricer.engines.base import Engine
from pricer.model.lattice import LEVEL_VALUES, LatticeParams


def _one(spot, strike, steps, call, american, log_up, log_down, pu, pd, keep=None):
    sign = 1.0 if call else -1.0
    spread = log_up - log_down

    def exercise(level):
        x = level * log_down + np.arange(level + 1) * spread
        with np.errstate(over="ignore"):
            price = spot * np.exp(x)
        # where e^x alone would overflow or underflow, the product's logarithm, clipped below
        # e^709 (FP64's largest): the engines clamp such nodes too
        log_price = np.log(spot) + x
        far = ~(np.abs(x) <= 700.0) | ~(np.abs(log_price) <= 700.0)
        price[far] = np.exp(np.minimum(log_price[far], 709.0))
        return sign * (price - strike)

    values = np.maximum(exercise(steps), 0.0)
    for level in range(steps, -1, -1):
        if level < steps:
            values = pu * values[1:] + pd * values[:-1]
            if american:
                values = np.maximum(values, exercise(level))
        if keep is not None and level == 2:
            keep[2:5] = values
        elif keep is not None and level == 1:
            keep[0:2] = values
    return float(values[0])


def oracle_prices(params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
    """Every option of params by the oracle; with `levels` ((n, LEVEL_VALUES)) also V(1, 0..1)
    and V(2, 0..2) (NaN for an option of fewer than 2 steps), as the engines keep them."""
    out = np.empty(len(params))
    for k in range(len(params)):
        keep = None
        if levels is not None:
            levels[k] = np.nan
            keep = levels[k] if params.steps[k] >= 2 else None
        out[k] = _one(float(params.spot[k]), float(params.strike[k]), int(params.steps[k]),
                      bool(params.call[k]), bool(params.american[k]), float(params.log_up[k]),
                      float(params.log_down[k]), float(params.pu[k]), float(params.pd[k]), keep)
    return out


def textbook_crr(spot, strike, maturity, rate, dividend, vol, steps, call, american) -> float:
    """The textbook CRR lattice, written independently of pricer.model.lattice: the asset at node
    (t, j) as S u^j d^(t-j) = S exp((2j - t) sigma sqrt(dt)) (one exp per node: u**j would carry
    u's rounding error j-fold), the discount applied to the expectation."""
    dt = maturity / steps
    log_u = vol * np.sqrt(dt)
    u, d = np.exp(log_u), np.exp(-log_u)
    p = (np.exp((rate - dividend) * dt) - d) / (u - d)
    disc = np.exp(-rate * dt)
    sign = 1.0 if call else -1.0

    def exercise(level):
        return sign * (spot * np.exp((2.0 * np.arange(level + 1) - level) * log_u) - strike)

    values = np.maximum(exercise(steps), 0.0)
    for level in range(steps - 1, -1, -1):
        values = disc * (p * values[1:] + (1.0 - p) * values[:-1])
        if american:
            values = np.maximum(values, exercise(level))
    return float(values[0])


def textbook_prices(cols: dict) -> np.ndarray:
    names = ("spot", "strike", "maturity", "rate", "dividend", "volatility", "steps", "call",
             "american")
    return np.array([textbook_crr(*(cols[c][i] for c in names)) for i in range(cols["spot"].size)])


def relative_error(got, want, strike) -> np.ndarray:
    """|got - want| relative to want, or to the strike where want is below 1e-8 of it."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.where(np.abs(want) < 1e-8 * np.asarray(strike), strike, np.abs(want))
    return np.abs(got - want) / scale


class OracleEngine(Engine):
    """The oracle as a backend: slow (numpy per level), exact to rounding, and independent."""

    name = "oracle"

    def __init__(self, **overrides):   # the run's GPU settings (t1, t2) mean nothing here
        pass

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        if levels is not None:
            assert levels.shape == (len(params), LEVEL_VALUES)
        return oracle_prices(params, levels)


def crr_wide(spot, strike, maturity, rate, dividend, vol, steps, call, american) -> float:
    """The textbook CRR lattice at N in the millions, independently of the engines' node tables:
    the asset prices of the last level from their logarithms, S0 e^{(2i - N) sigma sqrt(dt)} (inside
    FP64 wherever sigma sqrt(T N) < 700), then each level's from the next one's times u, in place
    (S(t, i) = S(t + 1, i) u: N roundings, ~1e-10 relative at N = 10^6), numba-parallel over a
    level's nodes."""
    dt = maturity / steps
    log_up = vol * math.sqrt(dt)
    up, down = math.exp(log_up), math.exp(-log_up)
    p = (math.exp((rate - dividend) * dt) - down) / (up - down)
    disc = math.exp(-rate * dt)
    return float(_crr_wide(spot, strike, log_up, up, p, disc, steps, 1.0 if call else -1.0,
                           american))



@njit(parallel=True)
def _crr_wide(spot, strike, log_up, up, p, disc, steps, sign, american):
    price = np.empty(steps + 1)
    values = np.empty(steps + 1)
    for i in prange(steps + 1):
        price[i] = spot * math.exp((2 * i - steps) * log_up)
        values[i] = max(sign * (price[i] - strike), 0.0)
    fresh = np.empty(steps + 1)
    for t in range(steps - 1, -1, -1):
        for i in prange(t + 1):
            hold = disc * (p * values[i + 1] + (1.0 - p) * values[i])
            price[i] *= up
            fresh[i] = max(hold, sign * (price[i] - strike)) if american else hold
        values, fresh = fresh, values
    return values[0]
