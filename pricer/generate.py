"""Synthetic portfolios, deterministic in (dist, count, seed, options): for demos, tests and benchmarks.

- uniform:   every option has the same N (seed 003's U portfolios).
- random:    N uniform in [min_steps, max_steps] (R portfolios; default [16, 4096]).
- skewed:    N uniform in [64, 256], and 1% of the options 10-50x larger (S portfolios).
- scenarios: the seed's validation grid of American puts, K = 100: moneyness S0 = 90/100/110
             (ITM/ATM/OTM), sigma 0.1-0.6, T 0.25-5, r 0/5/10 %, q = 0; repeated to `count`.
"""

from __future__ import annotations

import itertools

import numpy as np

from pricer.errors import InputError
from pricer.portfolio import Portfolio

DISTRIBUTIONS = ("uniform", "random", "skewed", "scenarios")
EXERCISE = ("mixed", "american", "european")

SCENARIO_SPOTS = (90.0, 100.0, 110.0)
SCENARIO_VOLS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
SCENARIO_MATURITIES = (0.25, 0.5, 1.0, 2.0, 5.0)
SCENARIO_RATES = (0.0, 0.05, 0.10)


def scenario_grid() -> np.ndarray:
    """Rows (spot, volatility, maturity, rate) of the validation grid, 270 in all."""
    return np.array(list(itertools.product(SCENARIO_SPOTS, SCENARIO_VOLS, SCENARIO_MATURITIES,
                                           SCENARIO_RATES)))


def _market(rng, count: int) -> dict:
    return {
        "spot": rng.uniform(80.0, 120.0, count),
        "strike": rng.uniform(80.0, 120.0, count),
        "maturity": rng.uniform(0.25, 2.0, count),
        "rate": rng.uniform(0.0, 0.08, count),
        "dividend": rng.uniform(0.0, 0.04, count),
        "volatility": rng.uniform(0.1, 0.5, count),
        "call": rng.random(count) < 0.5,
    }


def _steps(rng, dist: str, count: int, steps: int, min_steps: int, max_steps: int) -> np.ndarray:
    if dist == "uniform":
        return np.full(count, steps, dtype=np.int64)
    if dist == "random":
        return rng.integers(min_steps, max_steps + 1, count, dtype=np.int64)
    base = rng.integers(64, 257, count, dtype=np.int64)
    large = rng.random(count) < 0.01
    factor = rng.uniform(10.0, 50.0, count)
    return np.where(large, np.rint(base * factor).astype(np.int64), base)


def generate(dist: str, count: int, seed: int = 0, steps: int = 1000, exercise: str = "mixed",
             min_steps: int = 16, max_steps: int = 4096) -> Portfolio:
    if dist not in DISTRIBUTIONS:
        raise InputError(f"unknown distribution {dist!r}; known: {', '.join(DISTRIBUTIONS)}")
    if exercise not in EXERCISE:
        raise InputError(f"unknown exercise {exercise!r}; known: {', '.join(EXERCISE)}")
    if count < 1:
        raise InputError(f"--count must be >= 1, got {count}")
    if steps < 1 or min_steps < 1 or max_steps < min_steps:
        raise InputError(f"steps must be >= 1 and min_steps <= max_steps "
                         f"(got {steps}, {min_steps}, {max_steps})")
    rng = np.random.default_rng(seed)
    ids = np.arange(1, count + 1, dtype=np.int64)
    if dist == "scenarios":
        grid = scenario_grid()[np.arange(count) % len(scenario_grid())]
        return Portfolio(id=ids, spot=grid[:, 0].copy(), strike=np.full(count, 100.0),
                         maturity=grid[:, 2].copy(), rate=grid[:, 3].copy(),
                         dividend=np.zeros(count), volatility=grid[:, 1].copy(),
                         steps=np.full(count, steps, dtype=np.int64),
                         call=np.zeros(count, bool), american=np.ones(count, bool))
    market = _market(rng, count)
    american = {"mixed": rng.random(count) < 0.5, "american": np.ones(count, bool),
                "european": np.zeros(count, bool)}[exercise]
    return Portfolio(id=ids, steps=_steps(rng, dist, count, steps, min_steps, max_steps),
                     american=american, **market)
