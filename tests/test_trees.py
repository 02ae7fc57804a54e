"""The binomial trees: the textbook `crr` and QuantLib 1.44's trees (`ql-crr`, `jr`, `eqp`,
`trigeorgis`, `tian`, `lr`, `joshi4`) — parity with QuantLib's BinomialVanillaEngine on the serial and
cpu backends, QuantLib's maturity trap, the lattice invariants of every tree, convergence to
Black–Scholes–Merton, refusals, and the portfolio's per-option `tree` column end to end.

QuantLib convention (docs/numerics.md): valuation date 2025-01-15, maturity date a whole number of
days D ahead, FlatForward curves for r and q (continuous, Actual365Fixed), BlackConstantVol with
Actual365Fixed; QuantLib's year fraction is then D/365.0 exactly, and that double is the portfolio's
`maturity`. AmericanExercise(today, expiry): exercise allowed from t = 0 on, as in pricer.
"""

from __future__ import annotations

import math
import os

import h5py
import numba
import numpy as np
import pytest

from helpers import run_pricer
from pricer.engines.cpu.parallel import CpuEngine
from pricer.engines.cpu.serial import SerialEngine
from pricer.errors import InputError
from pricer.model.lattice import TREE_NAMES, TREES, lattice_parameters
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results

ql = pytest.importorskip("QuantLib")

SERIAL, CPU = SerialEngine(), CpuEngine()
QL_TREES = {"ql-crr": "crr", "jr": "jr", "eqp": "eqp", "trigeorgis": "trigeorgis", "tian": "tian",
            "lr": "lr", "joshi4": "joshi4"}   # our name -> QuantLib's BinomialVanillaEngine name
TODAY = ql.Date(15, 1, 2025)
PARITY = 1e-9            # relative, against QuantLib
COLUMNS = ("spot", "strike", "maturity", "rate", "dividend", "volatility", "steps", "call", "american")


# ---------------------------------------------------------------------------------------------- helpers

def make_columns(n: int, **given) -> dict:
    defaults = {"dividend": 0.0, "call": False, "american": True}
    cols = {}
    for name in COLUMNS:
        dtype = {"steps": np.int64, "call": bool, "american": bool}.get(name, np.float64)
        value = given.get(name, defaults.get(name))
        cols[name] = np.array(np.broadcast_to(np.asarray(value, dtype=dtype), (n,)))
    return cols


def price(cols: dict, tree: str, engine=SERIAL) -> np.ndarray:
    return engine.price(lattice_parameters(cols, tree))


def relative_error(value, reference, strike) -> np.ndarray:
    """As in test_engines: relative to the reference, or to 1e-8 * strike for tiny prices."""
    return np.abs(value - reference) / np.maximum(np.abs(reference), 1e-8 * strike)


def bitwise_equal(a, b) -> bool:
    a, b = np.ascontiguousarray(a, np.float64), np.ascontiguousarray(b, np.float64)
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


def quantlib_drops_terminal_payoff(maturity, steps, american) -> np.ndarray:
    """QuantLib 1.44's maturity trap (docs/numerics.md): an American option's payoff at maturity is
    not applied when the last point of TimeGrid(T, N), fl(fl(T/N)*N), falls below T. QuantLib's value
    is then the same lattice rolled back from level N-1 with the exercise value as its terminal
    value, i.e. our lattice with N - 1 steps and the same factors."""
    maturity, steps = np.asarray(maturity, np.float64), np.asarray(steps, np.int64)
    return np.asarray(american, bool) & ((maturity / steps) * steps < maturity)


def quantlib_expected(cols: dict, tree: str, engine=SERIAL) -> tuple[np.ndarray, np.ndarray]:
    """What QuantLib must return, option by option: our price, or for the trap's cases our lattice
    without its terminal level (same parameters, N - 1 levels)."""
    params = lattice_parameters(cols, tree)
    expected = engine.price(params)
    trap = quantlib_drops_terminal_payoff(cols["maturity"], cols["steps"], cols["american"])
    if trap.any():
        short = params.take(np.flatnonzero(trap))
        short.steps = short.steps - 1
        expected[trap] = engine.price(short)
    return expected, trap


def quantlib_prices(cols: dict, days: np.ndarray, tree: str) -> np.ndarray:
    """QuantLib's BinomialVanillaEngine on each option (see the module docstring for the inputs)."""
    dc = ql.Actual365Fixed()
    before = ql.Settings.instance().evaluationDate
    ql.Settings.instance().evaluationDate = TODAY
    try:
        out = np.empty(len(days))
        for k in range(len(days)):
            assert dc.yearFraction(TODAY, TODAY + int(days[k])) == cols["maturity"][k]
            process = ql.BlackScholesMertonProcess(
                ql.QuoteHandle(ql.SimpleQuote(float(cols["spot"][k]))),
                ql.YieldTermStructureHandle(ql.FlatForward(TODAY, float(cols["dividend"][k]), dc)),
                ql.YieldTermStructureHandle(ql.FlatForward(TODAY, float(cols["rate"][k]), dc)),
                ql.BlackVolTermStructureHandle(
                    ql.BlackConstantVol(TODAY, ql.NullCalendar(), float(cols["volatility"][k]), dc)))
            expiry = TODAY + int(days[k])
            exercise = (ql.AmericanExercise(TODAY, expiry) if cols["american"][k]
                        else ql.EuropeanExercise(expiry))
            kind = ql.Option.Call if cols["call"][k] else ql.Option.Put
            option = ql.VanillaOption(ql.PlainVanillaPayoff(kind, float(cols["strike"][k])), exercise)
            option.setPricingEngine(ql.BinomialVanillaEngine(process, QL_TREES[tree],
                                                             int(cols["steps"][k])))
            out[k] = option.NPV()
        return out
    finally:
        ql.Settings.instance().evaluationDate = before


def parity_book(rng, n: int) -> tuple[dict, np.ndarray]:
    """Fresh random options for the QuantLib comparison: calls and puts, American and European,
    q != 0, maturities of 30 days to 3 years, N from 10 to 5000 (log-uniform to 1000 for most, a few
    from 1000 to 5000, one at 5000 — QuantLib takes ~0.2-0.5 s for one option at N = 5000). The
    moneyness and volatility ranges keep |d2| small enough for joshi4's series at N = 10."""
    big = 6
    steps = np.concatenate([np.exp(rng.uniform(np.log(10), np.log(1000), n - big)),
                            rng.uniform(1000, 5000, big - 1), [5000]]).round().astype(np.int64)
    days = rng.integers(30, 3 * 365 + 1, n)
    strike = rng.uniform(80.0, 120.0, n)
    cols = make_columns(
        n, spot=strike * rng.uniform(0.8, 1.25, n), strike=strike, maturity=days / 365.0,
        rate=rng.uniform(-0.01, 0.1, n), dividend=rng.uniform(0.005, 0.06, n) * rng.choice([-1, 1], n),
        volatility=rng.uniform(0.15, 0.6, n), steps=rng.permutation(steps),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)
    return cols, days


def bsm(spot, strike, maturity, rate, dividend, vol, call) -> float:
    cdf = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))  # noqa: E731
    sd = vol * math.sqrt(maturity)
    d1 = (math.log(spot / strike) + (rate - dividend + 0.5 * vol * vol) * maturity) / sd
    fwd_s, fwd_k = spot * math.exp(-dividend * maturity), strike * math.exp(-rate * maturity)
    if call:
        return fwd_s * cdf(d1) - fwd_k * cdf(d1 - sd)
    return fwd_k * cdf(sd - d1) - fwd_s * cdf(-d1)


def market(rng, n: int, steps) -> dict:
    """Random options in the ranges the invariant and convergence bounds were measured on."""
    strike = rng.uniform(80.0, 120.0, n)
    return make_columns(
        n, spot=strike * rng.uniform(0.8, 1.25, n), strike=strike, maturity=rng.uniform(0.1, 3.0, n),
        rate=rng.uniform(0.0, 0.1, n), dividend=rng.uniform(0.0, 0.05, n),
        volatility=rng.uniform(0.15, 0.6, n), steps=steps, call=rng.random(n) < 0.5,
        american=rng.random(n) < 0.5)


@pytest.fixture
def two_threads():
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    yield 2
    numba.set_num_threads(before)


# ------------------------------------------------------------------------------- QuantLib parity

def test_tree_registry():
    assert TREE_NAMES == ("crr", "ql-crr", "jr", "eqp", "trigeorgis", "tian", "lr", "joshi4")
    assert set(QL_TREES) == set(TREE_NAMES) - {"crr"}
    assert all(TREES[name].name == name for name in TREE_NAMES)


@pytest.mark.parametrize("tree", list(QL_TREES))
def test_quantlib_parity_serial_and_cpu(rng, tree, two_threads):
    """300 fresh options per tree: serial and cpu within 1e-9 relative of QuantLib (measured: ~5e-11,
    the rounding of QuantLib's forward-rate drift), serial == cpu bit for bit. American options
    caught by QuantLib's maturity trap are compared with QuantLib's own (trapped) value, which our
    lattice reproduces exactly when its terminal level is dropped — nothing is skipped."""
    cols, days = parity_book(rng, 300)
    theirs = quantlib_prices(cols, days, tree)
    for engine in (SERIAL, CPU):
        expected, trap = quantlib_expected(cols, tree, engine)
        error = relative_error(expected, theirs, cols["strike"])
        worst = int(error.argmax())
        print(f"{tree} {engine.name}: max relative error {error.max():.3g} over {len(days)} options, "
              f"{int(trap.sum())} in QuantLib's maturity trap")
        assert error.max() <= PARITY, (engine.name, error.max(), {c: cols[c][worst] for c in cols},
                                       int(days[worst]), theirs[worst], expected[worst])
    assert bitwise_equal(price(cols, tree, CPU), price(cols, tree, SERIAL))
    # the cpu engine's level-parallel path (one option wider than a thread's share) is bitwise too
    wide = {c: v[cols["steps"] == 5000][:1] for c, v in cols.items()}
    sharing = CpuEngine(level_parallel_min_steps=4_096)
    assert sharing.level_parallel(wide["steps"], 2).all()
    assert bitwise_equal(price(wide, tree, sharing), price(wide, tree, SERIAL))


STRIKE_PARITY = 1e-10    # |pricer - QuantLib| / strike on any market (measured: up to 4.5e-11)


@pytest.mark.parametrize("tree", list(QL_TREES))
def test_quantlib_parity_on_wide_markets_is_bounded_by_the_strike(rng, tree):
    """Markets far wider than parity_book's (spot e^+-0.7 of the strike, volatility 5-100 %,
    maturities to 10 years, rates -2-15 %, dividends -3-8 %): the difference from QuantLib stays
    below STRIKE_PARITY x the strike. Relative to the price it is not bounded: an option worth
    1e-6 of its strike carries the same ~1e-11 K (QuantLib's drift, from forward rates over
    [0, 1e-4], is r - q to ~1e-12 only: docs/numerics.md), so relative errors of 1e-10-1e-9 are
    measured on such prices."""
    n = 40
    days = rng.integers(10, 10 * 365 + 1, n)
    strike = rng.uniform(20.0, 200.0, n)
    steps = np.exp(rng.uniform(np.log(20), np.log(1000), n)).round().astype(np.int64)
    if tree in ("lr", "joshi4"):
        steps |= 1
    cols = make_columns(n, spot=strike * np.exp(rng.uniform(-0.7, 0.7, n)), strike=strike,
                        maturity=days / 365.0, rate=rng.uniform(-0.02, 0.15, n),
                        dividend=rng.uniform(-0.03, 0.08, n), volatility=rng.uniform(0.05, 1.0, n),
                        steps=steps, call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)
    try:
        expected, _ = quantlib_expected(cols, tree)
    except InputError as exc:      # a draw whose lattice does not exist (eqp, joshi4 far out)
        pytest.skip(f"a drawn option has no {tree} lattice: {exc}")
    theirs = quantlib_prices(cols, days, tree)
    gap = np.abs(expected - theirs) / cols["strike"]
    print(f"{tree}: max |pricer - QuantLib| / K {gap.max():.3g}")
    assert gap.max() <= STRIKE_PARITY, gap.max()


def test_textbook_crr_is_not_quantlibs_crr(rng):
    """`crr` (the default) keeps the textbook p; QuantLib's "crr" is `ql-crr`: the same u and d (to
    rounding), another p, so the textbook tree misses QuantLib by far more than the parity
    tolerance, and `ql-crr` is the one that matches."""
    cols, days = parity_book(rng, 12)
    cols["steps"] = np.full(12, 200)
    theirs = quantlib_prices(cols, days, "ql-crr")
    expected, _ = quantlib_expected(cols, "ql-crr")
    assert relative_error(expected, theirs, cols["strike"]).max() <= PARITY
    assert relative_error(price(cols, "crr"), theirs, cols["strike"]).max() > 1e-6
    params_crr, params_ql = lattice_parameters(cols, "crr"), lattice_parameters(cols, "ql-crr")
    assert np.allclose(params_crr.log_up, params_ql.log_up, rtol=1e-15, atol=0)
    assert not np.allclose(params_crr.pu, params_ql.pu, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------- QuantLib's maturity trap

@pytest.mark.parametrize("tree", list(QL_TREES))
def test_quantlib_maturity_trap_180_to_183_days(tree):
    """A case that springs the trap: American put, S 100, K 105, r 3 %, q 0, sigma 30 %, 500 steps, valued on
    2025-01-15. At 180 and 183 days QuantLib agrees with our lattice; at 181 and 182 days
    fl(fl(T/500)*500) < T, QuantLib never applies the payoff at maturity and is off by ~1e-3
    relative (1.2e-2 absolute for ql-crr) — and equal to our lattice without its terminal level."""
    days = np.array([180, 181, 182, 183])
    cols = make_columns(4, spot=100.0, strike=105.0, maturity=days / 365.0, rate=0.03, dividend=0.0,
                        volatility=0.3, steps=500, call=False, american=True)
    trap = quantlib_drops_terminal_payoff(cols["maturity"], cols["steps"], cols["american"])
    assert trap.tolist() == [False, True, True, False]
    theirs = quantlib_prices(cols, days, tree)
    ours = price(cols, tree)
    expected, _ = quantlib_expected(cols, tree)
    assert relative_error(expected, theirs, cols["strike"]).max() <= PARITY
    error = relative_error(ours, theirs, cols["strike"])
    assert (error[~trap] <= PARITY).all(), error
    assert (error[trap] > 1e-5).all(), error
    if tree == "ql-crr":
        assert 1.0e-2 < np.abs(ours - theirs)[trap].min() < 1.3e-2
    # European options have no trap: QuantLib checks maturity with a tolerance there
    european = dict(cols, american=np.zeros(4, bool))
    assert relative_error(price(european, tree), quantlib_prices(european, days, tree),
                          cols["strike"]).max() <= PARITY


def test_quantlib_maturity_trap_rule_on_random_cases(rng):
    """Random maturities and step counts chosen so that the rule holds (about 4.5 % of (days, N)
    pairs do): QuantLib's American price equals our lattice without its terminal level, which
    differs from our price; with the same inputs as European options, QuantLib equals ours."""
    found = []
    while len(found) < 8:
        days, steps = int(rng.integers(30, 3 * 365)), int(rng.integers(10, 600))
        if quantlib_drops_terminal_payoff(days / 365.0, steps, True):
            found.append((days, steps))
    days = np.array([d for d, _ in found])
    n = days.size
    cols = make_columns(n, spot=rng.uniform(85, 115, n), strike=100.0, maturity=days / 365.0,
                        rate=rng.uniform(0.0, 0.08, n), dividend=rng.uniform(0.0, 0.04, n),
                        volatility=rng.uniform(0.15, 0.5, n), steps=[s for _, s in found],
                        call=rng.random(n) < 0.5, american=True)
    for tree in ("ql-crr", "lr", "tian"):
        theirs = quantlib_prices(cols, days, tree)
        expected, trap = quantlib_expected(cols, tree)
        assert trap.all()
        assert relative_error(expected, theirs, cols["strike"]).max() <= PARITY
        # and the trap is real (an option can escape it: where exercise is optimal at every node
        # of level N - 1 whose children straddle the strike, the terminal level does not matter)
        assert relative_error(price(cols, tree), theirs, cols["strike"]).max() > 1e-5
        european = dict(cols, american=np.zeros(n, bool))
        assert relative_error(price(european, tree), quantlib_prices(european, days, tree),
                              cols["strike"]).max() <= PARITY


# ------------------------------------------------------------------------------------ invariants

@pytest.mark.parametrize("tree", TREE_NAMES)
def test_invariants(rng, tree):
    """Positive prices, American >= European and >= intrinsic (exercise at t = 0 included),
    serial == cpu bit for bit."""
    n = 64
    cols = market(rng, n, rng.integers(10, 1500, n))
    american = price(dict(cols, american=np.ones(n, bool)), tree)
    european = price(dict(cols, american=np.zeros(n, bool)), tree)
    sign = np.where(cols["call"], 1.0, -1.0)
    intrinsic = np.maximum(sign * (cols["spot"] - cols["strike"]), 0.0)
    assert (european > 0).all() and (american > 0).all()
    assert (american >= european).all()
    assert (american >= intrinsic).all()
    assert bitwise_equal(price(cols, tree, CPU), price(cols, tree, SERIAL))


@pytest.mark.parametrize("tree", TREE_NAMES)
def test_put_call_parity_of_the_lattice(rng, tree):
    """European C - P on any lattice is disc^N (S0 m^N - K), m = p u + (1 - p) d its one-step mean.
    That is the textbook parity C - P = S0 e^{-qT} - K e^{-rT} only where the tree matches the
    forward, m = e^{(r-q)dt}: crr and tian always, lr and joshi4 for odd N (for even N QuantLib
    rolls an N+1-step tree back over N levels). ql-crr, jr, eqp and trigeorgis match moments of
    log S instead, so their C - P misses the textbook parity by O(1/N) (eqp by O(1/sqrt(N)))."""
    n = 48
    cols = market(rng, n, rng.integers(10, 1500, n))
    cols["steps"][: n // 2] |= 1                             # half odd
    cols["steps"][n // 2:] += cols["steps"][n // 2:] % 2     # half even
    euro = dict(cols, american=np.zeros(n, bool))
    calls = price(dict(euro, call=np.ones(n, bool)), tree)
    puts = price(dict(euro, call=np.zeros(n, bool)), tree)
    s, k, t, r, q, steps = (cols[c] for c in ("spot", "strike", "maturity", "rate", "dividend", "steps"))
    params = lattice_parameters(euro, tree)
    disc = params.pu + params.pd
    p = params.pu / disc
    mean = p * np.exp(params.log_up) + (1 - p) * np.exp(params.log_down)
    scale = s + k
    lattice_gap = np.abs(calls - puts - disc ** steps * (s * mean ** steps - k)) / scale
    assert lattice_gap.max() <= 1e-11, lattice_gap.max()
    textbook_gap = np.abs(calls - puts - (s * np.exp(-q * t) - k * np.exp(-r * t))) / scale
    holds = {"crr": np.ones(n, bool), "tian": np.ones(n, bool),
             "lr": steps % 2 == 1, "joshi4": steps % 2 == 1}.get(tree, np.zeros(n, bool))
    assert textbook_gap[holds].max(initial=0.0) <= 1e-11, textbook_gap[holds].max(initial=0.0)
    if (~holds).any():   # and where it does not hold, the gap is far above rounding
        assert textbook_gap[~holds].max() > 1e-6, textbook_gap[~holds].max()


# Bounds |V_N - BSM| <= C * S sigma sqrt(T) / N^a for European options: (C, a) per tree, for even and
# odd N. C is about 3 times the largest ratio measured over 1500 random options in `market`'s ranges
# at N = 100, 101, 1600, 1601: 0.18 for the O(1/N) trees; for lr and joshi4 0.96 at even N (QuantLib
# rolls an (N+1)-step tree back over N levels), and against 1/N^2 at odd N 0.020 (lr) and 3.4e-4
# (joshi4); 0.26 against 1/sqrt(N) for eqp.
CONVERGENCE = {
    "crr": ((0.5, 1), (0.5, 1)), "ql-crr": ((0.5, 1), (0.5, 1)), "jr": ((0.5, 1), (0.5, 1)),
    "trigeorgis": ((0.5, 1), (0.5, 1)), "tian": ((0.5, 1), (0.5, 1)), "eqp": ((0.8, 0.5), (0.8, 0.5)),
    "lr": ((2.8, 1), (0.06, 2)), "joshi4": ((2.8, 1), (1e-3, 2)),   # ((C, a) even N, (C, a) odd N)
}


@pytest.mark.parametrize("tree", TREE_NAMES)
def test_convergence_to_black_scholes(rng, tree):
    """European prices approach Black–Scholes–Merton as N grows, at each tree's rate: O(1/N) for
    most, O(1/N^2) for lr and joshi4 at odd N, O(1/sqrt(N)) for QuantLib's eqp (its log step is
    +-up around the drift with up^2 = sigma^2 dt - O(dt^1.5): the variance is off by O(1/sqrt(N)))."""
    n = 24
    cols = market(rng, n, 1)
    cols["american"][:] = False
    exact = np.array([bsm(*(cols[c][i] for c in ("spot", "strike", "maturity", "rate", "dividend",
                                                  "volatility", "call"))) for i in range(n)])
    scale = cols["spot"] * cols["volatility"] * np.sqrt(cols["maturity"])
    errors = {}
    for steps in (100, 101, 1600, 1601):
        error = np.abs(price(dict(cols, steps=np.full(n, steps)), tree) - exact)
        c, a = CONVERGENCE[tree][steps % 2]
        assert (error <= c * scale / steps ** a).all(), (steps, (error / (scale / steps ** a)).max())
        errors[steps] = error.mean()
    # and the mean error really shrinks with N 16 times larger: by at least a quarter of 16^a
    for small, large in ((100, 1600), (101, 1601)):
        a = CONVERGENCE[tree][small % 2][1]
        assert errors[large] < errors[small] / 16 ** a * 4 or errors[large] < 1e-10, errors


# ----------------------------------------------------------------------------------------- refusals

def test_tree_refusals_name_the_ids():
    ids = np.array([501, 502, 503, 504])
    # joshi4 is undefined at N = 1 (its series divides by (N - 1)/2)
    cols = make_columns(4, spot=100.0, strike=100.0, maturity=1.0, rate=0.05, volatility=0.2,
                        steps=[10, 1, 10, 1])
    with pytest.raises(InputError, match=r"joshi4 tree needs steps >= 2; option id\(s\) 502, 504"):
        lattice_parameters(cols, "joshi4", ids=ids)
    # joshi4's series leaves (0, 1) far from the strike at few steps (QuantLib would price it)
    cols = make_columns(4, spot=[100.0, 100.0, 300.0, 100.0], strike=100.0, maturity=0.1,
                        rate=0.05, volatility=0.1, steps=10)
    with pytest.raises(InputError,
                       match=r"joshi4 lattice is not arbitrage-free for option id\(s\) 503:"):
        lattice_parameters(cols, "joshi4", ids=ids)
    # eqp: 4 sigma^2 dt < 3 drift^2 dt^2 leaves no real up factor (QuantLib would return NaN)
    cols = make_columns(4, spot=100.0, strike=100.0, maturity=1.0, rate=[0.05, 0.05, 0.05, 0.8],
                        volatility=0.05, steps=10)
    with pytest.raises(InputError, match=r"eqp lattice is undefined for option id\(s\) 504:"):
        lattice_parameters(cols, "eqp", ids=ids)
    # ql-crr: p = 1/2 + drift dt / (2 sigma sqrt(dt)) > 1 (QuantLib: "negative probability")
    cols = make_columns(4, spot=100.0, strike=100.0, maturity=1.0, rate=[0.05, 0.9, 0.05, 0.05],
                        volatility=0.05, steps=1)
    with pytest.raises(InputError,
                       match=r"ql-crr lattice is not arbitrage-free for option id\(s\) 502:"):
        lattice_parameters(cols, "ql-crr", ids=ids)
    with pytest.raises(InputError, match="unknown tree 'LR'; known trees: crr, ql-crr"):
        lattice_parameters(cols, "LR")


def test_per_option_trees_equal_one_tree_at_a_time(rng):
    """A tree code per option (the portfolio's tree column) prices each option exactly as a run of
    that one tree would; code -1 takes the run's tree."""
    n = 40
    cols = market(rng, n, rng.integers(10, 400, n))
    codes = rng.integers(-1, len(TREE_NAMES), n)
    mixed = price(dict(cols, tree=codes), "tian")
    for code in np.unique(codes):
        rows = codes == code
        alone = price({c: v[rows] for c, v in cols.items()}, TREE_NAMES[code] if code >= 0 else "tian")
        assert bitwise_equal(mixed[rows], alone)


# ------------------------------------------------------------------- the tree column, end to end

def tree_book(rng, n: int, trees) -> Portfolio:
    strike = rng.uniform(90, 110, n)
    return Portfolio(
        id=rng.permutation(np.arange(9000, 9000 + 7 * n, 7, dtype=np.int64)),
        spot=strike * rng.uniform(0.85, 1.15, n), strike=strike, maturity=rng.uniform(0.25, 2, n),
        rate=rng.uniform(0, 0.08, n), dividend=rng.uniform(0, 0.04, n),
        volatility=rng.uniform(0.15, 0.5, n), steps=rng.integers(10, 400, n),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5, tree=trees)


def test_price_with_tree_column_and_tree_flag(tmp_path, rng):
    """`pricer price` on a book with a tree column: every option priced by its own tree (the
    column wins over --tree), the results name the trees used; without the column --tree applies."""
    n = 40
    trees = np.array([TREE_NAMES[k % len(TREE_NAMES)] for k in range(n)])
    book = tree_book(rng, n, rng.permutation(trees))
    path = tmp_path / "book.h5"
    write_portfolio(str(path), book)
    expected = SERIAL.price(lattice_parameters(book.columns(), "crr"))
    for k in range(n):
        one = book.take(np.array([k]))
        one.tree = None
        assert bitwise_equal(expected[k:k + 1], SERIAL.price(lattice_parameters(
            one.columns(), str(book.tree[k]))))
    out = tmp_path / "out.h5"
    proc = run_pricer(["price", path, "-o", out, "--backend", "cpu", "--tree", "lr", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    results = read_results(str(out))
    assert np.array_equal(results["id"], book.id) and bitwise_equal(results["price"], expected)
    assert results["attrs"]["tree"] == ",".join(TREE_NAMES)
    # the same book without the column: --tree prices every option
    plain = tree_book(rng, n, None)
    write_portfolio(str(path), plain)
    proc = run_pricer(["price", path, "-o", out, "--backend", "serial", "--tree", "joshi4",
                       "--overwrite", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    results = read_results(str(out))
    assert results["attrs"]["tree"] == "joshi4"
    assert bitwise_equal(results["price"], SERIAL.price(lattice_parameters(
        plain.columns(), "joshi4")))


@pytest.mark.parametrize("ranks", [None, 2])
def test_bad_tree_names_exit_2_nothing_written(tmp_path, rng, ranks):
    """Unknown names in the tree column: exit code 2 on every rank, one message naming the column,
    the values and the first ids, no output file."""
    n = 12
    trees = np.array(["lr"] * n, dtype=object)
    trees[[3, 8]] = ["Leisen-Reimer", "crr2"]
    book = tree_book(rng, n, None)
    path = tmp_path / "book.h5"
    write_portfolio(str(path), book)
    with h5py.File(path, "a") as f:
        f["portfolio"].create_dataset("tree", data=trees, dtype=h5py.string_dtype())
    out = tmp_path / "out.h5"
    proc = run_pricer(["price", path, "-o", out, "--backend", "cpu"], ranks=ranks, timeout=90)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("pricer: error:") == 1, proc.stderr
    for needle in ("column tree", "'Leisen-Reimer'", "'crr2'", str(book.id[3]), str(book.id[8])):
        assert needle in proc.stderr, (needle, proc.stderr)
    assert sorted(os.listdir(tmp_path)) == ["book.h5"]


def test_tree_that_cannot_price_an_option_exit_2(tmp_path, rng):
    """A valid name whose lattice does not exist for one option (joshi4 at N = 1) is refused like
    any other bad input: exit 2, the tree and the id named, nothing written."""
    n = 6
    book = tree_book(rng, n, np.array(["crr", "joshi4", "lr", "joshi4", "jr", "tian"]))
    book.steps[3] = 1
    book.steps[0] = 1   # crr is fine at N = 1
    path = tmp_path / "book.h5"
    write_portfolio(str(path), book)
    proc = run_pricer(["price", path, "-o", tmp_path / "out.h5"])
    assert proc.returncode == 2, proc.stderr
    assert "joshi4 tree needs steps >= 2" in proc.stderr and str(book.id[3]) in proc.stderr
    assert str(book.id[0]) not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["book.h5"]


@pytest.mark.parametrize("tree,ok", [("jr", True), ("QL-CRR", False)])
def test_job_file_tree_key(tmp_path, tree, ok):
    """`pricing.tree` in a job file: a known name prices with it, anything else is refused by name."""
    book = tree_book(np.random.default_rng(5), 10, None)
    write_portfolio(str(tmp_path / "book.h5"), book)
    (tmp_path / "job.toml").write_text(f'[portfolio]\npath = "book.h5"\n[pricing]\nbackend = "serial"\n'
                                       f'tree = "{tree}"\n[output]\npath = "out.h5"\n')
    proc = run_pricer(["run", "job.toml", "--quiet"], cwd=tmp_path)
    if ok:
        assert proc.returncode == 0, proc.stderr
        results = read_results(str(tmp_path / "out.h5"))
        assert results["attrs"]["tree"] == tree
        assert bitwise_equal(results["price"], SERIAL.price(lattice_parameters(
            book.columns(), tree)))
    else:
        assert proc.returncode == 2 and "unknown tree 'QL-CRR'; known trees: crr, ql-crr" in proc.stderr
        assert not (tmp_path / "out.h5").exists()
