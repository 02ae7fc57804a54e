"""The CRR lattice and the CPU engines: Cao (2025)'s Table 1 invariants, Black–Scholes–Merton,
put–call parity, hand computations at N = 1 and 2, an independent numpy lattice, QuantLib, Cao's
own benchmark prices, the N = 20 000 reference set, and serial == cpu bit for bit.

Tolerances that come from the lattice (not from rounding) are written as C * S*sigma*sqrt(T) / N: the
CRR error of a vanilla option is O(1/N) with a constant proportional to S*sigma*sqrt(T) (Diener &
Diener 2004); C was measured over thousands of random options in the ranges drawn here (largest seen:
0.35 against Black–Scholes–Merton, 0.16 for |V_N - V_2N|) and is set a few times above that.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit

from pricer.engines.cpu.exp_table import EXP_TABLE_MAX_ARGUMENT, exp_table
from pricer.engines.cpu.kernels import (UNDERFLOW, advance, backward_keeping_levels, exercise_limit,
                                        power_tables, table_kinds, terminal_values)
from pricer.engines.cpu.padded import LANES, PAD, PAIR_MAX_STEPS, backward_padded, floor_needed
from pricer.engines.cpu.parallel import BLOCK_STEPS, MIN_CHUNK_NODES, CpuEngine, _price_wide
from pricer.engines.cpu.serial import SerialEngine
from pricer.errors import InputError
from pricer.model.lattice import (CENTRED, CLAMPED, LEVEL_VALUES, PLAIN, TREE_NAMES, TREES,
                                  lattice_faults, lattice_parameters)
from pricer.tools.generate import generate

from oracle import oracle_prices, textbook_prices

DATA = Path(__file__).parent / "data"
SERIAL, CPU = SerialEngine(), CpuEngine()
# the cpu engine sharing levels among threads from N = 4 096 (its default waits for wider options),
# so that the level-parallel path is tested on lattices of moderate size
CPU_WIDE = CpuEngine(level_parallel_min_steps=4_096)
REFERENCE_STEPS = 20_000


# ---------------------------------------------------------------------------------------------- helpers

def make_columns(**given) -> dict:
    """Engine input columns; scalars are broadcast to the length of the array arguments."""
    n = max(np.size(v) for v in given.values())
    defaults = {"dividend": 0.0, "call": False, "american": True}
    cols = {}
    for name in ("spot", "strike", "maturity", "rate", "dividend", "volatility", "steps", "call",
                 "american"):
        value = given.get(name, defaults.get(name))
        dtype = {"steps": np.int64, "call": bool, "american": bool}.get(name, np.float64)
        cols[name] = np.array(np.broadcast_to(np.asarray(value, dtype=dtype), (n,)))
    return cols


def price(cols: dict, engine=SERIAL) -> np.ndarray:
    return engine.price(lattice_parameters(cols))


def random_market(rng, n: int, steps=(200, 2000), call=None, american=None, dividend=True) -> dict:
    """Random options in the ranges the tolerances above were measured on."""
    strike = rng.uniform(80.0, 120.0, n)
    return make_columns(
        spot=strike * rng.uniform(0.7, 1.4, n), strike=strike, maturity=rng.uniform(0.1, 3.0, n),
        rate=rng.uniform(0.0, 0.1, n), dividend=rng.uniform(0.0, 0.05, n) if dividend else 0.0,
        volatility=rng.uniform(0.1, 0.6, n), steps=rng.integers(steps[0], steps[1] + 1, n),
        call=rng.random(n) < 0.5 if call is None else call,
        american=rng.random(n) < 0.5 if american is None else american)


def lattice_scale(cols: dict) -> np.ndarray:
    """S*sigma*sqrt(T)/N: the size of the CRR discretisation error."""
    return cols["spot"] * cols["volatility"] * np.sqrt(cols["maturity"]) / cols["steps"]


def bsm(spot, strike, maturity, rate, dividend, vol, call) -> float:
    """Black–Scholes–Merton price with a continuous dividend yield."""
    cdf = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))  # noqa: E731
    sd = vol * math.sqrt(maturity)
    d1 = (math.log(spot / strike) + (rate - dividend + 0.5 * vol * vol) * maturity) / sd
    d2 = d1 - sd
    fwd_s, fwd_k = spot * math.exp(-dividend * maturity), strike * math.exp(-rate * maturity)
    if call:
        return fwd_s * cdf(d1) - fwd_k * cdf(d2)
    return fwd_k * cdf(-d2) - fwd_s * cdf(-d1)


def bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float64), np.ascontiguousarray(b, np.float64)
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


def relative_error(value, reference, strike) -> np.ndarray:
    """|value - reference| relative to the reference, or to 1e-8 * strike for tiny prices."""
    return np.abs(value - reference) / np.maximum(np.abs(reference), 1e-8 * strike)


@pytest.fixture
def two_threads():
    """The cpu engine with two numba threads (its parallel paths), restored afterwards."""
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    yield 2
    numba.set_num_threads(before)


# ------------------------------------------------------------------------------- Table 1 invariants

def test_american_put_bounds(rng):
    cols = random_market(rng, 48, call=False, american=True)
    s, k, t, r, q = (cols[c] for c in ("spot", "strike", "maturity", "rate", "dividend"))
    american = price(cols)
    european = price(dict(cols, american=np.zeros(48, bool)))
    assert (american > 0).all()
    assert (american <= k).all()
    assert (american >= np.maximum(k - s, 0.0)).all()
    assert (american >= european).all()
    # European bounds: max(K e^-rT - S e^-qT, 0) <= P <= K e^-rT (the lattice keeps them to rounding)
    assert (european <= k * np.exp(-r * t) * (1 + 1e-12)).all()
    assert (european >= k * np.exp(-r * t) - s * np.exp(-q * t) - 1e-12 * k).all()
    # the early-exercise premium is real for some of them (deep ITM puts with r > 0)
    assert (american > european + 1e-6).any()


def test_american_put_monotone(rng):
    n = 40
    cols = random_market(rng, n, call=False, american=True)
    base = price(cols)
    bump = rng.uniform(0.01, 0.1, n)
    # In S and K the lattice is monotone exactly, rounding included: a fixed N fixes u, d and p,
    # and rounded products, sums and max are monotone in their arguments.
    assert (price(dict(cols, spot=cols["spot"] * (1 + bump))) <= base).all()
    assert (price(dict(cols, strike=cols["strike"] * (1 + bump))) >= base).all()
    higher_vol = price(dict(cols, volatility=cols["volatility"] + 0.05))
    longer = price(dict(cols, maturity=cols["maturity"] * 1.25))
    assert (higher_vol >= base - 1e-12 * cols["strike"]).all()
    assert (longer >= base - 1e-12 * cols["strike"]).all()
    # and the bumps matter where the option is not simply exercised now
    alive = base > np.maximum(cols["strike"] - cols["spot"], 0.0) + 1e-3
    assert alive.any()
    assert (higher_vol[alive] > base[alive]).all()


def test_american_call_bounds_and_monotone(rng):
    n = 40
    cols = random_market(rng, n, call=True, american=True)
    s, k = cols["spot"], cols["strike"]
    american = price(cols)
    european = price(dict(cols, american=np.zeros(n, bool)))
    assert (american > 0).all()
    assert (american <= s).all()
    assert (american >= np.maximum(s - k, 0.0)).all()
    assert (american >= european).all()
    bump = rng.uniform(0.01, 0.1, n)
    assert (price(dict(cols, spot=s * (1 + bump))) >= american).all()
    assert (price(dict(cols, strike=k * (1 + bump))) <= american).all()
    assert (price(dict(cols, volatility=cols["volatility"] + 0.05)) >= american - 1e-12 * k).all()
    assert (price(dict(cols, maturity=cols["maturity"] * 1.25)) >= american - 1e-12 * k).all()


def test_american_call_without_dividend_is_european(rng):
    """With q = 0 and r >= 0 early exercise of a call never pays, on the lattice too (the hold value
    is at least S - K e^{-r dt} >= S - K at every node)."""
    cols = random_market(rng, 30, call=True, american=True, dividend=False)
    american = price(cols)
    european = price(dict(cols, american=np.zeros(30, bool)))
    assert (relative_error(american, european, cols["strike"]) <= 1e-12).all()
    # ... whereas with a dividend it does pay for some deep in-the-money calls
    deep = make_columns(spot=180.0, strike=100.0, maturity=2.0, rate=0.02, dividend=0.08,
                        volatility=0.2, steps=500, call=True, american=True)
    assert price(deep)[0] > price(dict(deep, american=np.zeros(1, bool)))[0] + 1.0


@pytest.mark.parametrize("call", [False, True], ids=["put", "call"])
def test_cauchy_convergence(rng, call):
    """|V_N - V_2N| is O(1/N) for every option, and shrinks ~16x from N = 100 to N = 1600 over a batch
    (single options oscillate between N and 2N, so the shrinking is checked on the sum)."""
    cols = random_market(rng, 30, call=call, american=True)
    levels = [100, 200, 400, 800, 1600, 3200]
    values = np.array([price(dict(cols, steps=np.full(30, n))) for n in levels])
    diffs = np.abs(np.diff(values, axis=0))
    for j, n in enumerate(levels[:-1]):
        scale = cols["spot"] * cols["volatility"] * np.sqrt(cols["maturity"]) / n
        assert (diffs[j] <= 1.0 * scale).all(), (n, (diffs[j] / scale).max())
    assert diffs[-1].sum() * 3 <= diffs[0].sum(), diffs.sum(axis=1)


# --------------------------------------------------------------------- European: BSM and put–call parity

@pytest.mark.parametrize("call", [False, True], ids=["put", "call"])
def test_european_matches_black_scholes_merton(rng, call):
    n = 60
    cols = random_market(rng, n, steps=(200, 2000), call=call, american=False)
    lattice = price(cols)
    exact = np.array([bsm(*(cols[c][i] for c in ("spot", "strike", "maturity", "rate", "dividend",
                                                 "volatility")), call) for i in range(n)])
    ratio = np.abs(lattice - exact) / lattice_scale(cols)
    assert ratio.max() <= 1.0, (ratio.max(), int(ratio.argmax()))


def test_bsm_formula_agrees_with_quantlib(rng):
    """The closed form used above, checked against QuantLib's AnalyticEuropeanEngine."""
    ql = pytest.importorskip("QuantLib")
    today = ql.Date(2, 1, 2024)
    ql.Settings.instance().evaluationDate = today
    dc = ql.Actual365Fixed()
    for _ in range(10):
        s, k = rng.uniform(70, 140), rng.uniform(80, 120)
        days = int(rng.integers(30, 1100))
        r, q, vol, call = rng.uniform(0, 0.1), rng.uniform(0, 0.05), rng.uniform(0.1, 0.6), rng.random() < 0.5
        process = ql.BlackScholesMertonProcess(
            ql.QuoteHandle(ql.SimpleQuote(s)), ql.YieldTermStructureHandle(ql.FlatForward(today, q, dc)),
            ql.YieldTermStructureHandle(ql.FlatForward(today, r, dc)),
            ql.BlackVolTermStructureHandle(ql.BlackConstantVol(today, ql.NullCalendar(), vol, dc)))
        option = ql.VanillaOption(ql.PlainVanillaPayoff(ql.Option.Call if call else ql.Option.Put, k),
                                  ql.EuropeanExercise(today + days))
        option.setPricingEngine(ql.AnalyticEuropeanEngine(process))
        assert bsm(s, k, days / 365, r, q, vol, call) == pytest.approx(option.NPV(), rel=1e-9, abs=1e-12)


def test_put_call_parity_on_the_lattice(rng):
    """C - P = S e^{-qT} - K e^{-rT} holds exactly on the CRR lattice (p makes the discounted asset a
    martingale, and max(x, 0) - max(-x, 0) = x); in FP64 to about N * eps."""
    n = 60
    cols = random_market(rng, n, steps=(1, 2000), american=False)
    cols["steps"][:4] = [1, 2, 3, 7]
    cols["volatility"][:4] = 0.5  # keeps p in (0, 1) at N = 1
    calls = price(dict(cols, call=np.ones(n, bool)))
    puts = price(dict(cols, call=np.zeros(n, bool)))
    s, k, t = cols["spot"], cols["strike"], cols["maturity"]
    forward = s * np.exp(-cols["dividend"] * t) - k * np.exp(-cols["rate"] * t)
    error = np.abs((calls - puts) - forward) / np.maximum(s, k)
    assert error.max() <= 1e-12, error.max()


# ------------------------------------------------------------------------- small N by hand, p checks

def hand_price(s, k, t, r, q, vol, steps, call, american):
    """N = 1 or 2 written out node by node."""
    dt = t / steps
    u = math.exp(vol * math.sqrt(dt))
    d = 1.0 / u
    p = (math.exp((r - q) * dt) - d) / (u - d)
    disc = math.exp(-r * dt)

    def pay(x):
        return max(x - k, 0.0) if call else max(k - x, 0.0)

    def node(up_value, down_value, asset):
        hold = disc * (p * up_value + (1 - p) * down_value)
        return max(hold, pay(asset)) if american else hold

    if steps == 1:
        return node(pay(s * u), pay(s * d), s)
    up = node(pay(s * u * u), pay(s), s * u)
    down = node(pay(s), pay(s * d * d), s * d)
    return node(up, down, s)


HAND_CASES = {
    # name: (S, K, T, r, q, sigma, N, call, american, early exercise binds at t = 0)
    "put-american-N1-exercise-now": (80.0, 100.0, 0.5, 0.08, 0.0, 0.2, 1, False, True, True),
    "put-european-N1": (80.0, 100.0, 0.5, 0.08, 0.0, 0.2, 1, False, False, False),
    "call-european-N1-dividend": (105.0, 100.0, 1.0, 0.03, 0.02, 0.3, 1, True, False, False),
    "put-american-N2": (100.0, 100.0, 1.0, 0.1, 0.0, 0.25, 2, False, True, False),
    "call-american-N2-dividend": (150.0, 100.0, 1.0, 0.0, 0.12, 0.2, 2, True, True, True),
    "call-european-N2": (95.0, 100.0, 0.75, 0.05, 0.01, 0.35, 2, True, False, False),
}


@pytest.mark.parametrize("case", list(HAND_CASES), ids=list(HAND_CASES))
def test_one_and_two_steps_by_hand(case, two_threads):
    s, k, t, r, q, vol, steps, call, american, exercise_now = HAND_CASES[case]
    expected = hand_price(s, k, t, r, q, vol, steps, call, american)
    cols = make_columns(spot=s, strike=k, maturity=t, rate=r, dividend=q, volatility=vol, steps=steps,
                        call=call, american=american)
    for engine in (SERIAL, CPU):
        assert price(cols, engine)[0] == pytest.approx(expected, rel=1e-13)
    intrinsic = max(s - k, 0.0) if call else max(k - s, 0.0)
    assert (expected == intrinsic) == exercise_now
    if american:
        european = hand_price(s, k, t, r, q, vol, steps, call, False)
        if exercise_now or case == "put-american-N2":
            assert expected > european  # the case really exercises the American branch


def test_p_outside_unit_interval_is_rejected_by_id():
    # id 4242: r = 50 % with sigma = 1 % over one step: e^{r dt} > u, so p > 1.
    # id 77: a 60 % dividend yield: e^{(r-q) dt} < d, so p < 0.
    ids = np.array([31337, 4242, 50505, 77])
    cols = make_columns(spot=100.0, strike=100.0, maturity=1.0, rate=[0.05, 0.5, 0.05, 0.0],
                        dividend=[0.0, 0.0, 0.0, 0.6], volatility=[0.2, 0.01, 0.2, 0.05],
                        steps=[100, 1, 100, 1], call=False, american=True)
    with pytest.raises(InputError) as info:
        lattice_parameters(cols, ids=ids)
    message = str(info.value)
    assert "4242" in message and "77" in message
    assert "31337" not in message and "50505" not in message
    assert "(0, 1)" in message
    # each alone
    for bad_id, row in ((4242, 1), (77, 3)):
        keep = np.array([0, row, 2])
        with pytest.raises(InputError, match=str(bad_id)):
            lattice_parameters({c: v[keep] for c, v in cols.items()}, ids=ids[keep])
    # and the good ones alone are accepted
    good = np.array([0, 2])
    params = lattice_parameters({c: v[good] for c, v in cols.items()}, ids=ids[good])
    assert len(params) == 2


def test_lattices_beyond_the_fp64_factors_price_and_only_weighty_clamps_are_refused():
    """Node (t, i) is S0 e^{t ln d} x e^{i ln(u/d)}: past (u/d)^N ~ e^709 a single pair of tables
    would overflow (σ = 3, T = 3: from N ~ 4 700) and past σ sqrt(T N) ~ 700 the nodes themselves
    leave FP64 (N ~ 18 000). The engines centre the tables, then clamp nodes that carry no weight,
    so every one of these prices as Black–Scholes (the lattice's error at these N is ~1e-4); only
    a lattice whose clamped nodes its paths can reach (a spot of 1e295 here) is refused by id."""
    ids = np.array([11, 12, 13, 14])
    cols = make_columns(spot=100.0, strike=100.0, maturity=3.0, rate=0.02, dividend=0.0,
                        volatility=3.0, steps=[4000, 6000, 8000, 20_000],
                        call=[True, False, True, False], american=False)
    p = lattice_parameters(cols, ids=ids)
    assert list(table_kinds(p.spot, p.log_up, p.log_down, p.steps)) == [PLAIN, CENTRED, CENTRED,
                                                                        CLAMPED]
    exact = [bsm(100.0, 100.0, 3.0, 0.02, 0.0, 3.0, call) for call in cols["call"]]
    for backend in (SerialEngine(), CpuEngine()):
        np.testing.assert_allclose(backend.price(p), exact, rtol=3e-4)
    far = dict(cols, spot=np.array([100.0, 1e295, 100.0, 1e295]))
    with pytest.raises(InputError) as info:
        lattice_parameters(far, ids=ids)
    message = str(info.value)
    assert "id(s) 12, 14" in message and "6000 steps" in message and "FP64 range" in message
    assert "11" not in message.split(":")[0]


def test_a_level_factor_beyond_fp64_alone_takes_the_centred_tables():
    """d^N alone beyond e^-700 while the nodes are inside (a spot of e^600 with a dividend yield of
    1000 % a year, jr; a spot of e^-600 with a 1000 % rate): S0 d^t as one factor would underflow
    to 0 and the price with it. So CENTRED, and as the oracle prices them (1.9e-174, 2.1e-262)."""
    cols = make_columns(spot=[math.exp(600), math.exp(-600)],
                        strike=[math.exp(-420), math.exp(400)], maturity=1.0, rate=[0.0, 1000.0],
                        dividend=[1000.0, 0.0], volatility=0.2, steps=1000, call=[True, False],
                        american=False)
    cols["tree"] = np.full(2, TREE_NAMES.index("jr"))
    p = lattice_parameters(cols)
    assert list(table_kinds(p.spot, p.log_up, p.log_down, p.steps)) == [CENTRED, CENTRED]
    ref = oracle_prices(p)
    assert 1e-175 < ref[0] < 1e-173 and 1e-263 < ref[1] < 1e-261
    np.testing.assert_allclose(SerialEngine().price(p), ref, rtol=1e-12)


def test_centred_and_clamped_lattices_agree_with_the_oracle_on_every_tree(rng):
    """Fresh random lattices wider than a single pair of tables holds (σ from 100 % to 600 %, N to
    3 000, every tree, calls and puts, American and European), against the NumPy oracle (node
    prices from their logarithms, no tables; clipped at e^709 where FP64 ends)."""
    n = 120
    cols = make_columns(spot=np.exp(rng.uniform(-3, 8, n)), strike=1.0,
                        maturity=rng.uniform(0.5, 30, n), rate=rng.uniform(-0.02, 0.15, n),
                        dividend=rng.uniform(0, 0.1, n), volatility=rng.uniform(1.0, 6.0, n),
                        steps=rng.integers(200, 3000, n), call=rng.random(n) < 0.5,
                        american=rng.random(n) < 0.6)
    cols["strike"] = cols["spot"] * np.exp(rng.normal(0, 0.3, n))
    cols["tree"] = rng.integers(0, len(TREE_NAMES), n)
    # sigma sqrt(T) 13 to 16: sigma sqrt(T N) past 700 (clamped) with paths that stay far inside
    cols["volatility"][:12], cols["maturity"][:12] = 3.0, rng.uniform(20, 30, 12)
    cols["steps"][:12] = rng.integers(2800, 3000, 12)
    cols = {k: v[~lattice_faults(cols)] for k, v in cols.items()}
    p = lattice_parameters(cols)
    kinds = table_kinds(p.spot, p.log_up, p.log_down, p.steps)
    assert (kinds == CENTRED).sum() >= 20 and (kinds == CLAMPED).sum() >= 3
    ref = oracle_prices(p)
    scale = np.maximum(np.abs(ref), 1e-8 * p.strike)
    serial = SerialEngine().price(p)
    assert np.all(np.abs(serial - ref) <= 1e-12 * scale)
    assert np.array_equal(CpuEngine().price(p).view(np.int64), serial.view(np.int64))


# ---------------------------------------------------------------------- serial and cpu bit for bit

def test_serial_and_cpu_bitwise_equal(rng, two_threads):
    n = 60
    cols = random_market(rng, n, steps=(1, 3000))
    cols["volatility"] = np.maximum(cols["volatility"], 0.35)  # p in (0, 1) at N = 1
    cols["steps"][rng.choice(n, 4, replace=False)] = [1, 2, 3, 5]
    wide = int(rng.integers(0, n))
    cols["steps"][wide] = int(rng.integers(20_000, 24_000))
    params = lattice_parameters(cols)
    # with two threads the large option takes the level-parallel path, the others the per-option one
    assert numba.get_num_threads() == 2
    assert CPU_WIDE.level_parallel(params.steps, 2).tolist() == [k == wide for k in range(n)]
    assert not CPU.level_parallel(params.steps, 2).any()
    serial = SERIAL.price(params)
    for cpu in (CPU, CPU_WIDE):
        assert bitwise_equal(serial, cpu.price(params)), np.flatnonzero(serial != cpu.price(params))
        # the engines price the options they are given, in that order
        order = rng.permutation(n)
        assert bitwise_equal(cpu.price(params.take(order)), serial[order])


def terminal_lattice(params, k: int):
    """Option k's steps, payoff level, power tables and sign, from the plain kernels."""
    n = int(params.steps[k])
    values, level_base, ratio = np.empty(n + 1), np.empty(n + 1), np.empty(n + 1)
    sign = 1.0 if params.call[k] else -1.0
    power_tables(params.spot[k], params.log_up[k], params.log_down[k], n, level_base, ratio)
    terminal_values(values, n, params.strike[k], sign, level_base, ratio)
    return n, values, level_base, ratio, sign


def price_alone(params, levels: np.ndarray) -> np.ndarray:
    """Each option on its own through the plain kernels (power_tables, terminal_values,
    backward_keeping_levels: what the GPU engines' CPU tail and the cpu engine's wide path run)."""
    out = np.empty(len(params))
    for k in range(len(params)):
        n, values, level_base, ratio, sign = terminal_lattice(params, k)
        backward_keeping_levels(values, n, params.strike[k], sign, params.american[k], params.pu[k],
                                params.pd[k], level_base, ratio, levels, k)
        out[k] = values[0]
    return out


def test_options_priced_in_pairs_bitwise_equal_alone(rng):
    """The engines price two lattices at a time in 8-wide vectors, past each level's end, from
    PAIR_MAX_STEPS down (serial.advance_pair): every price and first-levels value must be the one
    the option gets alone, whatever its partner (N below 2, below and above PAIR_MAX_STEPS, call or
    put, American or European, any N mod 8)."""
    n = 75   # odd: the last option has no partner
    cols = random_market(rng, n, steps=(1, PAIR_MAX_STEPS + 700))
    cols["volatility"] = np.maximum(cols["volatility"], 0.35)  # p in (0, 1) at N = 1
    cols["steps"][:20] = rng.permutation([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 63, 64,
                                          65, PAIR_MAX_STEPS - 1, PAIR_MAX_STEPS, PAIR_MAX_STEPS + 1])
    order = rng.permutation(n)
    params = lattice_parameters({k: v[order] for k, v in cols.items()})
    alone_levels = np.empty((n, LEVEL_VALUES))
    alone = price_alone(params, alone_levels)
    assert bitwise_equal(SERIAL.price(params), alone)
    for engine in (SERIAL, CPU):
        levels = np.empty((n, LEVEL_VALUES))
        assert bitwise_equal(engine.price(params, levels), alone), engine.name
        assert bitwise_equal(levels, alone_levels), engine.name
    shuffled = rng.permutation(n)   # other partners
    assert bitwise_equal(SERIAL.price(params.take(shuffled)), alone[shuffled])


def test_level_parallel_chunks_bitwise_equal(rng):
    """The wide path with several chunk counts and sizes, so chunk edges fall everywhere."""
    for chunks in (2, 3, 5):
        low = chunks * MIN_CHUNK_NODES + BLOCK_STEPS
        steps = int(rng.integers(low, low + 4000))
        call, american = bool(rng.random() < 0.5), bool(rng.random() < 0.7)
        cols = random_market(rng, 1, steps=(steps, steps), call=call, american=american)
        p = lattice_parameters(cols)
        wide = _price_wide(p.spot[0], p.strike[0], p.steps[0], p.call[0], p.american[0], p.log_up[0],
                           p.log_down[0], p.pu[0], p.pd[0], chunks, np.empty((0, 5)), 0)
        assert bitwise_equal(np.array([wide]), SERIAL.price(p)), (chunks, steps)


def test_cpu_engine_single_thread_and_empty(rng):
    cols = random_market(rng, 10, steps=(16, 500))
    params = lattice_parameters(cols)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert bitwise_equal(CPU.price(params), SERIAL.price(params))
    finally:
        numba.set_num_threads(before)
    empty = params.take(slice(0, 0))
    assert CPU.price(empty).shape == (0,) and SERIAL.price(empty).shape == (0,)


@njit(cache=False)
def every_node(values, t_from, strike, sign, american, pu, pd, level_base, ratio):
    """The backward step on every node of every level, the American one on all of them: the kernel
    before nodes were skipped (no runs, no +0.0 nodes left alone), the reference for bits."""
    minus_strike = -sign * strike
    for t in range(t_from - 1, -1, -1):
        signed_base = sign * level_base[t]
        for i in range(t + 1):
            hold = pu * values[i + 1] + pd * values[i]
            hold = hold if hold >= UNDERFLOW else 0.0
            if american:
                exercise = signed_base * ratio[i] + minus_strike
                hold = exercise if exercise > hold else hold
            values[i] = hold
    return values[0]


def every_node_prices(params) -> np.ndarray:
    out = np.empty(len(params))
    for k in range(len(params)):
        n, values, level_base, ratio, sign = terminal_lattice(params, k)
        out[k] = every_node(values, n, params.strike[k], sign, params.american[k], params.pu[k],
                            params.pd[k], level_base, ratio)
    return out


@pytest.mark.parametrize("tree", ["crr", "lr", "jr"])
def test_skipped_nodes_change_no_bit(rng, tree, two_threads):
    """The kernels give nodes that cannot be exercised the European step and leave +0.0 nodes alone
    (serial.put_edge, call_edge, zero_boundary): the prices must be bitwise those of the American
    step on every node, for options deep in and far out of the money, one per call (the one-option
    path) and together (pairs, level-parallel chunks)."""
    n = 40
    cols = random_market(rng, n, steps=(1, 1300))
    cols["volatility"] = np.maximum(cols["volatility"], 0.35)  # p in (0, 1) at N = 1
    cols["spot"] = cols["strike"] * np.exp(rng.uniform(-2.5, 2.5, n))
    # lr's p reaches 1.0 far from the strike at few steps: only options whose lattice exists
    p = TREES[tree].probabilities(cols)[3]
    cols = {key: value[(p > 0.0) & (p < 1.0)] for key, value in cols.items()}
    n = len(cols["spot"])
    params = lattice_parameters(cols, tree)
    reference = every_node_prices(params)
    for engine in (SERIAL, CPU):
        assert bitwise_equal(engine.price(params), reference), engine.name
        one_by_one = np.array([engine.price(params.take([k]))[0] for k in range(n)])
        assert bitwise_equal(one_by_one, reference), engine.name
    wide = random_market(rng, 1, steps=(2 * MIN_CHUNK_NODES + BLOCK_STEPS + 500,) * 2)
    p = lattice_parameters(wide, tree)
    price_wide = _price_wide(p.spot[0], p.strike[0], p.steps[0], p.call[0], p.american[0],
                             p.log_up[0], p.log_down[0], p.pu[0], p.pd[0], 2, np.empty((0, 5)), 0)
    assert bitwise_equal(np.array([price_wide]), every_node_prices(p))


@njit(cache=False)
def fill_exp_table(out, count, rate, scale):
    exp_table(out, count, rate, scale)


def test_exp_table_within_a_few_ulp(rng):
    """The power tables' exponentials (engines/exp_table.py, vector code): every entry within
    4 + |x| ulp of scale * exp(x), x = j * rate exactly (decimal arithmetic; the |x| is the
    rounding of the argument, which the C library's exp(j * rate) has too; 2.7 is the most seen
    over 66 000 entries, and a broken reduction or polynomial is off by far more), exp(0) exactly
    the scale, and nothing written past `count`."""
    worst = 0.0
    for _ in range(150):
        n = int(rng.integers(1, 3000))
        rate = rng.uniform(-1.0, 1.0) * EXP_TABLE_MAX_ARGUMENT / n * rng.random() ** 2
        scale = rng.uniform(1.0, 200.0)
        out = np.full(n + 9, -7.0)
        fill_exp_table(out, n, rate, scale)
        assert (out[n:] == -7.0).all()
        with localcontext() as exact:
            exact.prec = 50
            for j in [*range(0, n, max(1, n // 20)), n - 1]:
                x = Decimal(j) * Decimal(rate)
                value = Decimal(scale) * x.exp()
                ulps = float(abs(Decimal(out[j]) - value)) / np.spacing(float(value))
                worst = max(worst, ulps - abs(float(x)))
    assert worst <= 4.0, worst
    scaled = np.empty(11)
    fill_exp_table(scaled, 11, 0.0, 97.25)
    assert (scaled == 97.25).all()


def skip_market(rng, n: int) -> dict:
    """American puts for the exercised-node skip: deep in the money to out of it, rates from 0 (no
    put is exercised early) through tiny ones (too small a margin to skip) to 20 %, dividends from
    -2 % to 20 % (exercise_limit finite or infinite), N from 1 to 3 000 (the single, pair and
    wide-level paths)."""
    strike = rng.uniform(50.0, 150.0, n)
    rate = rng.choice([0.0, 1e-13, 1e-7, 0.01, 0.05, 0.2], n) * rng.uniform(0.5, 1.0, n)
    dividend = rng.choice([-0.02, 0.0, 0.0, 0.03, 0.2], n) * rng.uniform(0.5, 1.0, n)
    steps = np.where(rng.random(n) < 0.2, rng.integers(1, 40, n), rng.integers(40, 3001, n))
    return make_columns(spot=strike * np.exp(rng.uniform(-2.0, 1.0, n)), strike=strike,
                        maturity=rng.uniform(0.05, 5.0, n), rate=rate, dividend=dividend,
                        volatility=np.where(steps < 40, 0.6, rng.uniform(0.15, 0.8, n)),
                        steps=steps, call=False, american=True)


@pytest.mark.parametrize("tree", ["crr", "lr", "jr", "tian"])
def test_exercised_nodes_skipped_change_no_bit(rng, tree, two_threads):
    """An American put's nodes that serial.exercise_limit proves exercised are not computed
    (_put_skip): prices and first levels' values must be bitwise those of the American step on
    every node, whole books (pairs), one option per call (the single path), with levels kept."""
    n = 48
    for _ in range(10):   # a rare draw has no lattice on a tree (lr: u = d at seed 371): redraw
        try:
            params = lattice_parameters(skip_market(rng, n), tree)
            break
        except InputError:
            continue
    reference = every_node_prices(params)
    levels_alone = np.empty((n, LEVEL_VALUES))
    alone = price_alone(params, levels_alone)   # the plain kernels (advance), which skip none
    assert bitwise_equal(alone, reference)
    for engine in (SERIAL, CPU):
        assert bitwise_equal(engine.price(params), reference), engine.name
        levels = np.empty((n, LEVEL_VALUES))
        assert bitwise_equal(engine.price(params, levels), reference), engine.name
        assert bitwise_equal(levels, levels_alone), engine.name
        one_by_one = np.array([engine.price(params.take([k]))[0] for k in range(n)])
        assert bitwise_equal(one_by_one, reference), engine.name
    # the level-parallel path (serial.advance with the limit, chunk by chunk, then its tail)
    wide = skip_market(rng, 3)
    wide["steps"][:] = 2 * MIN_CHUNK_NODES + BLOCK_STEPS + 700
    wide["rate"][:] = [0.05, 0.08, 0.03]
    wide["dividend"][:] = [0.0, 0.03, 0.1]
    wide["volatility"][:] = 0.3
    p = lattice_parameters(wide, tree)
    for k in range(3):
        price_wide = _price_wide(p.spot[k], p.strike[k], p.steps[k], p.call[k], p.american[k],
                                 p.log_up[k], p.log_down[k], p.pu[k], p.pd[k], 2,
                                 np.empty((0, 5)), 0)
        assert bitwise_equal(np.array([price_wide]), every_node_prices(p.take([k])))


def test_exercise_limit_skips_where_it_may():
    """The limit lets the skip work where the put is exercised early (else the test above tests
    nothing new) and forbids it where it cannot be: r <= 0, and r too small for the rounding."""
    cols = make_columns(spot=100.0, strike=100.0, maturity=1.0, rate=[0.05, 0.05, 0.0, -0.01, 1e-14],
                        dividend=[0.0, 0.03, 0.0, 0.0, 0.0], volatility=0.2, steps=1000)
    p = lattice_parameters(cols)
    limits = [exercise_limit(p.strike[k], p.steps[k], p.pu[k], p.pd[k], p.log_up[k],
                             p.log_down[k]) for k in range(len(p))]
    assert limits[0] > 1e6 * 100.0        # no dividend: only rounding bounds it
    assert 100.0 < limits[1] < 1e4        # dividends: S < K (r dt) / (q dt), about 170
    assert limits[2:] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("call", [False, True], ids=["put", "call"])
def test_unordered_ratio_table_takes_every_node(rng, call):
    """Skipping rests on the ratio table being non-decreasing; where it is not (it always is, barring
    rounding at extreme inputs), advance and backward_padded must take every node (here a table
    with two entries swapped)."""
    n = 150
    p = lattice_parameters(random_market(rng, 1, steps=(n, n), call=call, american=True))
    size = (n + 1 + PAD + LANES - 1) & -LANES
    values, level_base, ratio = np.zeros(size), np.zeros(size), np.zeros(size)
    power_tables(p.spot[0], p.log_up[0], p.log_down[0], n, level_base, ratio)
    ratio[60], ratio[61] = ratio[61], ratio[60]
    sign = 1.0 if call else -1.0
    terminal_values(values, n, p.strike[0], sign, level_base, ratio)
    args = (p.strike[0], sign, True, p.pu[0], p.pd[0], level_base, ratio)
    reference = every_node(values.copy(), n, *args)
    plain, padded = values.copy(), values.copy()
    advance(plain, n + 1, n, n, *args)
    backward_padded(padded, n, 0, *args, n, p.log_up[0], p.log_down[0])
    assert bitwise_equal(np.array([plain[0], padded[0]]), np.array([reference, reference]))


# ------------------------------------------------------------------------------ independent oracles

def test_textbook_lattice_matches_independent_numpy(rng):
    n = 16
    cols = random_market(rng, n, steps=(4, 2000))
    cols["call"][:4] = [False, False, True, True]
    cols["american"][:4] = [True, False, True, False]
    ours = price(cols)
    theirs = textbook_prices(cols)
    error = relative_error(ours, theirs, cols["strike"])
    assert error.max() <= 1e-12, (error.max(), int(error.argmax()))


def test_underflow_flush_leaves_prices_unchanged(rng):
    """Wide, volatile, zero-rate lattices push far nodes below 1e-290, where the engines write 0
    (serial.UNDERFLOW); the independent numpy lattice keeps every subnormal and must agree."""
    n = 6
    cols = make_columns(spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n),
                        maturity=np.full(n, 5.0), rate=np.zeros(n), dividend=np.zeros(n),
                        volatility=rng.uniform(0.5, 0.6, n), steps=rng.integers(3000, 4000, n),
                        call=np.arange(n) % 2 == 0, american=np.arange(n) % 3 != 0)
    ours = price(cols)
    theirs = textbook_prices(cols)
    error = relative_error(ours, theirs, cols["strike"])
    assert error.max() <= 1e-12, (error.max(), int(error.argmax()))


def test_floor_left_out_only_where_it_changes_no_bit(rng, two_threads):
    """The kernels leave the UNDERFLOW floor out where serial.floor_needed proves no positive value
    can fall below it: bitwise the prices of the floored step on every node, for lattices at the
    usual scale (floor left out up to N ~ 800) and scaled down to ~1e-285, where nodes do fall
    below it and the floor must stay."""
    n = 24
    scale = np.where(np.arange(n) % 2 == 0, 1.0, 10.0 ** rng.uniform(-287, -283, n))
    strike = rng.uniform(80.0, 120.0, n)
    cols = make_columns(spot=strike * rng.uniform(0.7, 1.4, n) * scale, strike=strike * scale,
                        maturity=rng.uniform(0.5, 3.0, n), rate=rng.uniform(0.0, 0.1, n),
                        dividend=rng.uniform(0.0, 0.05, n), volatility=rng.uniform(0.3, 0.6, n),
                        steps=rng.integers(60, 1000, n), call=rng.random(n) < 0.5,
                        american=rng.random(n) < 0.7)
    params = lattice_parameters(cols)
    needed = [floor_needed(params.strike[k], params.steps[k], params.pu[k], params.pd[k])
              for k in range(n)]
    assert all(needed[1::2]) and not all(needed[0::2])
    reference = every_node_prices(params)
    for engine in (SERIAL, CPU):
        assert bitwise_equal(engine.price(params), reference), engine.name
        one_by_one = np.array([engine.price(params.take([k]))[0] for k in range(n)])
        assert bitwise_equal(one_by_one, reference), engine.name


def test_close_to_quantlib_binomial_crr(rng):
    """QuantLib's "crr" tree has the same u and d but p = 1/2 + (r - q - sigma^2/2) sqrt(dt) / (2 sigma):
    it differs from the textbook p by O(dt^1.5), so the two lattices agree to O(1/N) (measured over
    640 random American options: within 0.4 S sigma sqrt(T) / N, largest where the strike sits between
    nodes; the bound checked is 2.5 times that: an error in the exercise rule, the dividend or the
    discounting is far larger)."""
    ql = pytest.importorskip("QuantLib")
    today = ql.Date(2, 1, 2024)
    ql.Settings.instance().evaluationDate = today
    dc = ql.Actual365Fixed()
    n, steps = 16, 1000
    cols = random_market(rng, n, steps=(steps, steps), american=True)
    days = rng.integers(60, 730, n)
    cols["maturity"] = days / 365.0
    ours = price(cols)
    for i in range(n):
        s, k, r, q, vol = (float(cols[c][i]) for c in ("spot", "strike", "rate", "dividend", "volatility"))
        process = ql.BlackScholesMertonProcess(
            ql.QuoteHandle(ql.SimpleQuote(s)), ql.YieldTermStructureHandle(ql.FlatForward(today, q, dc)),
            ql.YieldTermStructureHandle(ql.FlatForward(today, r, dc)),
            ql.BlackVolTermStructureHandle(ql.BlackConstantVol(today, ql.NullCalendar(), vol, dc)))
        kind = ql.Option.Call if cols["call"][i] else ql.Option.Put
        option = ql.VanillaOption(ql.PlainVanillaPayoff(kind, k),
                                  ql.AmericanExercise(today, today + int(days[i])))
        option.setPricingEngine(ql.BinomialVanillaEngine(process, "crr", steps))
        bound = 1.0 * s * vol * math.sqrt(cols["maturity"][i]) / steps
        assert abs(ours[i] - option.NPV()) <= bound, (i, ours[i], option.NPV(), bound)


def test_seed_american_put_benchmarks():
    """Cao (2025)'s reference set: 4-decimal American put prices from an N = 20 000 lattice, whatever
    its N column says; each distinct parameter set priced at N = 20 000 must round to it."""
    rows = np.loadtxt(DATA / "seed002_american_put_benchmarks.txt", delimiter=",", comments="#")
    assert rows.shape[1] == 7
    sets = np.unique(rows[:, [0, 1, 2, 3, 4, 6]], axis=0)  # S0, K, r, sigma, T, expected
    assert len(sets) >= 14
    cols = make_columns(spot=sets[:, 0], strike=sets[:, 1], rate=sets[:, 2], volatility=sets[:, 3],
                        maturity=sets[:, 4], steps=REFERENCE_STEPS, call=False, american=True)
    error = np.abs(price(cols) - sets[:, 5])
    assert error.max() <= 5e-5, (error.max(), sets[int(error.argmax())])


# ------------------------------------------------------------------ the reference set at N = 20 000

def load_reference() -> dict:
    with open(DATA / "scenarios_n20000.csv") as f:
        rows = [line.strip().split(",") for line in f if line.strip() and not line.startswith("#")]
    header, body = rows[0], rows[1:]
    out = {}
    for j, name in enumerate(header):
        kind = np.int64 if name in ("id", "steps", "call", "american") else np.float64
        out[name] = np.array([kind(row[j]) for row in body])
    return out


@pytest.fixture(scope="module")
def reference():
    ref = load_reference()
    grid = generate("scenarios", 270, steps=REFERENCE_STEPS)
    for name in ("id", "spot", "strike", "maturity", "rate", "dividend", "volatility", "steps"):
        assert np.array_equal(ref[name], getattr(grid, name)), name
    assert np.array_equal(ref["call"] != 0, grid.call) and np.array_equal(ref["american"] != 0,
                                                                           grid.american)
    cols = grid.columns()
    return lattice_parameters(cols, ids=grid.id), ref["price"], ref["strike"]


# The stored prices were made on one machine. On another CPU the same code may round differently
# in the last bit (numba compiles for the CPU it runs on, and libm picks its exp and pow, which
# build a lattice's factors, by the CPU's features), and 20 000 levels carry that to ~1e-11
# (8e-12 measured between an AVX-512 and an AVX2 x86-64 host). On one
# machine the engines agree bit for bit (test_serial_and_cpu_bitwise_equal) and with the
# independent NumPy oracle on fresh inputs
# (test_centred_and_clamped_lattices_agree_with_the_oracle_on_every_tree).
STORED_TOLERANCE = 1e-10


def check_against_reference(engine, reference, index, one_by_one=False) -> None:
    params, prices, strike = reference
    if one_by_one:
        got = np.array([engine.price(params.take(index[k:k + 1]))[0] for k in range(index.size)])
    else:
        got = engine.price(params.take(index))
    error = relative_error(got, prices[index], strike[index])
    assert error.max() <= STORED_TOLERANCE, (engine.name, error.max(), index[int(error.argmax())])


def test_reference_file_is_the_scenarios_grid(reference):
    params, prices, _ = reference
    assert len(params) == prices.size == 270
    assert (prices > 0).all() and np.isfinite(prices).all()


def test_serial_matches_reference_subset(reference, rng):
    check_against_reference(SERIAL, reference, np.sort(rng.choice(270, 20, replace=False)))


def test_cpu_matches_reference(reference, two_threads):
    """The whole grid through both paths of the cpu engine: as one batch (options spread over the
    threads) and one option at a time through CPU_WIDE (N = 20 000 alone is above a thread's share,
    so all threads share each level). About 20 s on 2 cores."""
    params = reference[0]
    assert not CPU_WIDE.level_parallel(params.steps[:20], 2).any()
    assert CPU_WIDE.level_parallel(params.steps[:1], 2).all()
    check_against_reference(CPU, reference, np.arange(270))
    check_against_reference(CPU_WIDE, reference, np.arange(270), one_by_one=True)


def test_each_rank_sees_its_own_gpu_unless_the_launcher_chose():
    """devices.show_each_rank_its_gpu: local rank mod GPUs, only where nothing was chosen."""
    from pricer.devices import show_each_rank_its_gpu
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "5"}
    show_each_rank_its_gpu(env, gpus=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    env = {"SLURM_LOCALID": "2"}
    show_each_rank_its_gpu(env, gpus=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    for env, gpus in (({"MPI_LOCALRANKID": "1", "CUDA_VISIBLE_DEVICES": "3"}, 4),  # launcher's
                      ({"MPI_LOCALRANKID": "1", "PRICER_GPU_PIN": "0"}, 4),        # switched off
                      ({}, 4),                                                     # no local rank
                      ({"MPI_LOCALRANKID": "1"}, 1)):                              # one GPU
        before = dict(env)
        show_each_rank_its_gpu(env, gpus=gpus)
        assert env == before


def test_an_engine_starts_without_importing_scipy_linalg():
    """numba imports scipy.linalg at its first load only to ask whether BLAS is there; an engine
    starts without that import (pricer.numba_cache._numba_without_scipy_at_start), and numba's
    answer, and np.convolve in a user's function, stay what they are with it. In a fresh
    interpreter, since the suite's process has loaded numba's NumPy implementations already."""
    pytest.importorskip("scipy")
    import subprocess
    import sys
    code = (
        "import sys, numpy as np, numba\n"
        "from pricer.model.implied import _normal_cdf\n"     # a kernel before any engine
        "_normal_cdf(0.0)\n"
        "from pricer.engines import get_engine\n"
        "get_engine('serial').warm_up()\n"
        "print('scipy.linalg' in sys.modules)\n"
        "import numba.np.arraymath as am\n"
        "print(am._HAVE_BLAS)\n"
        "f = numba.njit(lambda a, b: np.convolve(a, b))\n"
        "a, b = np.random.default_rng(1).random(50), np.random.default_rng(2).random(7)\n"
        "print(np.allclose(f(a, b), np.convolve(a, b), rtol=1e-14, atol=0))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent).stdout.split()
    assert out == ["False", "True", "True"]
