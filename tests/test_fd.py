"""The finite-difference method's numerics and its CPU engine (pricer/model/fd.py,
pricer/engines/cpu/fd.py): against the dense NumPy reference (tests/fd_oracle.py) on fresh random
books, every scheme, European and American; against Black–Scholes with second-order convergence;
an American put against QuantLib's FdBlackScholesVanillaEngine; an option's values the same in any
group of lanes; unstable and coarse grids refused by id."""

from __future__ import annotations

import math

import numpy as np
import pytest

import fd_oracle
from pricer.engines.cpu.fd import fd_values
from pricer.errors import InputError
from pricer.model import fd


def book(rng, n: int, american: bool | None = None, steps=(20, 80)) -> dict:
    return dict(id=np.arange(n) + 1, spot=rng.uniform(60.0, 150.0, n),
                strike=rng.uniform(80.0, 120.0, n), maturity=rng.uniform(0.05, 3.0, n),
                rate=rng.uniform(-0.01, 0.08, n), dividend=rng.uniform(0.0, 0.05, n),
                volatility=rng.uniform(0.15, 0.5, n), steps=rng.integers(*steps, n),
                call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.5 if american is None else np.full(n, american))


def black_scholes(S, K, T, r, q, sigma, call) -> float:
    N = lambda x: 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))     # noqa: E731
    d1 = (math.log(S / K) + (r - q + 0.5 * sigma * sigma) * T) / (sigma * math.sqrt(T))
    d2 = d1 - sigma * math.sqrt(T)
    if call:
        return S * math.exp(-q * T) * N(d1) - K * math.exp(-r * T) * N(d2)
    return K * math.exp(-r * T) * N(-d2) - S * math.exp(-q * T) * N(-d1)


@pytest.mark.parametrize("scheme", sorted(fd.SCHEMES))
def test_the_engine_is_the_dense_reference(scheme, rng):
    """Every scheme, European and American calls and puts: the engine's node values within 1e-12
    of the reference's (rounding: the change form and Thomas' sweeps against dense solves)."""
    cols = book(rng, 12, steps=(3000, 4000) if scheme == "explicit" else (5, 60))
    params = fd.parameters(cols, scheme, 48)
    got = fd_values(params, cols["spot"])
    want = np.array([fd_oracle.values(params, k) for k in range(len(params))])
    scale = np.maximum(np.abs(want), 1e-8 * cols["strike"][:, None])
    assert np.max(np.abs(got - want) / scale) < 1e-12


def test_an_options_values_are_the_same_in_any_group(rng):
    """Lanes never read each other: a book, its reverse and its halves give bitwise one value
    per option, whatever shares its group."""
    cols = book(rng, 37)
    params = fd.parameters(cols, "crank-nicolson", 64)
    whole = fd_values(params, cols["spot"])
    for rows in (np.arange(37)[::-1], np.arange(0, 37, 2), np.arange(1, 37, 3)):
        part = {k: v[rows] for k, v in cols.items()}
        assert np.array_equal(fd_values(fd.parameters(part, "crank-nicolson", 64),
                                        part["spot"]), whole[rows])


def test_european_prices_converge_to_black_scholes_at_second_order(rng):
    """Crank–Nicolson with Rannacher's start: the error falls ~4x as J and M double, and is
    within 2e-6 of the price (of 1 % of the strike, for a smaller one) at J = 2048, M = 1024
    near the money."""
    cols = book(rng, 6, american=False)
    cols["spot"] = cols["strike"] * rng.uniform(0.9, 1.1, 6)
    exact = np.array([black_scholes(*(cols[k][i] for k in ("spot", "strike", "maturity", "rate",
                                                             "dividend", "volatility")),
                                    cols["call"][i]) for i in range(6)])
    errors = []
    for J, M in ((256, 128), (512, 256), (1024, 512), (2048, 1024)):
        c = dict(cols, steps=np.full(6, M))
        errors.append(np.abs(fd_values(fd.parameters(c, "crank-nicolson", J), c["spot"])[:, 1]
                             - exact) / np.maximum(exact, 0.01 * cols["strike"]))
    ratios = np.array(errors[:-1]) / np.array(errors[1:])
    assert (np.median(ratios, axis=1) > 3.0).all(), ratios
    assert errors[-1].max() < 2e-6, errors[-1]


def test_an_american_put_is_quantlibs_finite_difference_price():
    """An American put on QuantLib's FdBlackScholesVanillaEngine (Crank–Nicolson, 2 damping
    steps) and here, both fine grids: within 1e-4 relative (two grids' truncations)."""
    ql = pytest.importorskip("QuantLib")
    S, K, T, r, q, sigma = 100.0, 105.0, 1.5, 0.04, 0.01, 0.3
    today = ql.Date(7, 12, 2026)
    ql.Settings.instance().evaluationDate = today
    dc = ql.Actual365Fixed()
    process = ql.BlackScholesMertonProcess(
        ql.QuoteHandle(ql.SimpleQuote(S)),
        ql.YieldTermStructureHandle(ql.FlatForward(today, q, dc)),
        ql.YieldTermStructureHandle(ql.FlatForward(today, r, dc)),
        ql.BlackVolTermStructureHandle(ql.BlackConstantVol(today, ql.NullCalendar(), sigma, dc)))
    expiry = today + int(round(T * 365))
    option = ql.VanillaOption(ql.PlainVanillaPayoff(ql.Option.Put, K),
                              ql.AmericanExercise(today, expiry))
    option.setPricingEngine(ql.FdBlackScholesVanillaEngine(process, 2000, 2000, 2))
    t = (expiry - today) / 365.0
    cols = dict(spot=np.array([S]), strike=np.array([K]), maturity=np.array([t]),
                rate=np.array([r]), dividend=np.array([q]), volatility=np.array([sigma]),
                steps=np.array([2000]), call=np.array([False]), american=np.array([True]))
    price = fd_values(fd.parameters(cols, "crank-nicolson", 2048), cols["spot"])[0, 1]
    assert abs(price - option.NPV()) / option.NPV() < 1e-4, (price, option.NPV())


def test_an_american_option_is_worth_at_least_its_european_and_its_exercise(rng):
    cols = book(rng, 40, american=True)
    am = fd_values(fd.parameters(cols, "crank-nicolson", 128), cols["spot"])[:, 1]
    eu = fd_values(fd.parameters(dict(cols, american=np.zeros(40, bool)), "crank-nicolson", 128),
                   cols["spot"])[:, 1]
    exercise = np.where(cols["call"], cols["spot"] - cols["strike"],
                        cols["strike"] - cols["spot"])
    assert (am >= eu - 1e-9 * cols["strike"]).all() and (am >= exercise - 1e-12).all()


def test_an_unstable_explicit_grid_is_refused_by_id(rng):
    cols = book(rng, 10, steps=(5000, 6000))
    cols["steps"][[3, 7]] = 10
    with pytest.raises(InputError) as info:
        fd.parameters(cols, "explicit", 256)
    assert sorted(info.value.ids.tolist()) == [4, 8] and info.value.column == "steps"
    assert "stability bound" in str(info.value) and "it needs >=" in str(info.value)
    need = int(str(info.value).split("it needs >= ")[1].split(")")[0])
    enough = {k: v[[3]] for k, v in dict(cols, steps=np.full(10, need)).items()}
    fd.parameters(enough, "explicit", 256)          # the steps it names are enough


def test_a_grid_too_coarse_for_its_drift_or_too_small_is_refused_by_id(rng):
    cols = book(rng, 6)
    cols["volatility"][2], cols["rate"][2], cols["maturity"][2] = 0.02, 0.08, 30.0
    with pytest.raises(InputError) as info:
        fd.parameters(cols, "crank-nicolson", 64)
    assert info.value.ids.tolist() == [3] and "space_steps >=" in str(info.value)
    need = int(str(info.value).split("space_steps >= ")[1])
    fd.parameters({k: v[[2]] for k, v in cols.items()}, "crank-nicolson", need)
    with pytest.raises(InputError, match="nodes: it needs 8"):
        fd.parameters(cols, "implicit", 4)
