"""Implied volatilities (`pricer implied-vol`, `pricer.implied_volatility`, pricer/model/implied.py):
round trips on fresh random books, QuantLib's Brent on its BinomialVanillaEngine as the independent
reference, the statuses, the pool and the chunks not changing an answer, and the command end to
end under mpiexec with hostile input."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

import pricer
from gpu_cases import needs_gpu
from helpers import run_pricer
from pricer.engines.cpu.parallel import CpuEngine
from pricer.model import implied_pool
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results
from pricer.model.implied import (ABOVE_BOUND, CONVERGED, NO_LATTICE_FOUND, NO_TIME_VALUE,
                                  PRICE_FLOOR, PRICE_TOLERANCE, SIGMA_HIGH)
from pricer.model.implied_pool import solve
from pricer.model.lattice import TREE_NAMES, lattice_parameters

CPU = CpuEngine()
TREES = ("crr", "ql-crr", "jr", "tian", "lr")


def random_book(rng, n: int, trees=("crr",), steps=(16, 400)) -> dict:
    """Calls and puts, American and European, with dividends, each option's tree drawn from
    `trees`; volatility is the true one."""
    strike = rng.uniform(60.0, 140.0, n)
    return dict(id=np.arange(n) * 3 + 1, spot=strike * rng.uniform(0.7, 1.4, n), strike=strike,
                maturity=rng.uniform(0.05, 3.0, n), rate=rng.uniform(-0.01, 0.08, n),
                dividend=rng.uniform(0.0, 0.05, n), volatility=rng.uniform(0.05, 0.9, n),
                steps=rng.integers(*steps, n), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.7, tree=np.array(trees)[rng.integers(0, len(trees), n)])


def lattice_prices(book: dict, volatility=None) -> np.ndarray:
    cols = {k: np.asarray(v) for k, v in book.items() if k not in ("id", "tree", "market_price")}
    cols["tree"] = np.array([TREE_NAMES.index(t) for t in book["tree"]])
    if volatility is not None:
        cols["volatility"] = volatility
    return CPU.price(lattice_parameters(cols, "crr"))


def lattice_vega(book: dict, bump: float = 1e-5) -> np.ndarray:
    """dV/dsigma of each option's own lattice, the smaller of its one-sided differences: an
    American option's price at its payoff is flat on one side of the sigma where holding starts
    to pay, and there a band of sigmas gives the price."""
    sigma = np.asarray(book["volatility"])
    here = lattice_prices(book, sigma)
    return np.minimum(lattice_prices(book, sigma + bump) - here,
                      here - lattice_prices(book, sigma - bump)) / bump


def market_book(book: dict, guess: bool = False) -> dict:
    """The book with its lattice prices as market prices; the volatility a start or left out."""
    out = dict(book, market_price=lattice_prices(book))
    if not guess:
        del out["volatility"]
    return out


def check_accuracy(book: dict, result) -> None:
    """The required accuracy: every converged price within the tolerance of its market price;
    sigma recovered within 1e-8 where the lattice's vega > 1e-4 K; only options with no vega
    to speak of left without an answer."""
    market, strike = book["market_price"], book["strike"]
    ok = result["status"].to_numpy() == CONVERGED
    tolerance = PRICE_TOLERANCE * np.maximum(market, PRICE_FLOOR * strike)
    assert (np.abs(result["price"].to_numpy() - market)[ok] <= tolerance[ok]).all()
    vega = lattice_vega(book)
    firm = vega > 1e-4 * strike
    assert ok[firm].all(), np.flatnonzero(firm & ~ok)
    error = np.abs(result["implied_volatility"].to_numpy() - book["volatility"])
    assert (error[firm] <= 1e-8).all(), (error[firm].max(), np.flatnonzero(firm)[error[firm].argmax()])
    assert np.isnan(result["implied_volatility"].to_numpy()[~ok]).all()


@pytest.mark.parametrize("guess", [False, True])
def test_round_trip_recovers_sigma_on_every_tree(rng, guess):
    book = random_book(rng, 400, TREES)
    given = market_book(book, guess=guess)
    if guess:   # a start near the answer, as yesterday's volatility would be
        given["volatility"] = book["volatility"] * rng.uniform(0.7, 1.3, 400)
    result = pricer.implied_volatility(given, backend="cpu")
    check_accuracy(dict(book, market_price=given["market_price"]), result)
    assert (result["id"].to_numpy() == book["id"]).all()
    # the price at the answer is the lattice price there, bitwise (pricer.price at that sigma)
    ok = result["status"].to_numpy() == CONVERGED
    again = pricer.price(dict(book, volatility=np.where(ok, result["implied_volatility"], 0.2)),
                         backend="cpu")
    assert np.array_equal(again["price"].to_numpy()[ok], result["price"].to_numpy()[ok])
    assert result["iterations"].to_numpy()[ok].mean() < 8


def test_no_time_value_and_above_bound(rng):
    n = 60
    book = random_book(rng, n, steps=(50, 200))
    market = lattice_prices(book)
    spot, strike, call = book["spot"], book["strike"], book["call"]
    american = book["american"]
    intrinsic = np.maximum(np.where(call, spot - strike, strike - spot), 0.0)
    grows = np.exp(-np.where(call, book["dividend"], book["rate"]) * book["maturity"])
    bound = np.where(call, spot, strike) * np.where(call | american, np.maximum(grows, 1), grows)
    kind = np.arange(n) % 3
    price = np.where(kind == 0, np.where(american, intrinsic, 0.0) * 0.999,
                     np.where(kind == 1, bound * 1.0001, market))
    given = dict(book, market_price=price)
    del given["volatility"]
    result = pricer.implied_volatility(given, backend="cpu")
    status = result["status"].to_numpy()
    assert (status[kind == 0] == NO_TIME_VALUE).all()
    assert (status[kind == 1] == ABOVE_BOUND).all()
    assert np.isnan(result["implied_volatility"].to_numpy()[kind != 2]).all()
    assert np.isnan(result["price"].to_numpy()[kind != 2]).all()
    # a price above what the lattice gives at sigma = 10 (inside the no-arbitrage bound) has none
    one = {k: v[:1] for k, v in given.items()}
    one.update(spot=np.array([100.0]), strike=np.array([100.0]), maturity=np.array([0.1]),
               call=np.array([True]), american=np.array([False]), steps=np.array([64]),
               rate=np.array([0.0]), dividend=np.array([0.0]), market_price=np.array([99.99]))
    assert pricer.implied_volatility(one, backend="cpu")["status"][0] == ABOVE_BOUND
    # a call of an absurd strike: its tolerance is not 1e-18 K's size (100 here, which took the
    # first sigma, priced 0); only the lattice's top nodes reach K, at sigma ~8
    one.update(strike=np.array([1e20]), maturity=np.array([1.0]), market_price=np.array([3.71]))
    absurd = pricer.implied_volatility(one, backend="cpu")
    assert absurd["status"][0] == CONVERGED and absurd["implied_volatility"][0] > 5.0
    assert abs(absurd["price"][0] - 3.71) <= 1e-10 * 3.71


def test_books_the_bounds_settle_alone_get_their_statuses(tmp_path):
    """No option left to search: every row still gets its status and NaN, on any rank count."""
    book = dict(id=np.array([1, 2, 3, 4]), spot=np.array([100.0, 100.0, 100.0, 100.0]),
                strike=np.array([80.0, 120.0, 80.0, 120.0]), maturity=np.ones(4),
                rate=np.full(4, 0.03), dividend=np.zeros(4), steps=np.full(4, 100),
                call=np.array([True, False, True, False]), american=np.ones(4, bool),
                tree=np.array(["crr"] * 4), market_price=np.array([20.0, 20.0, 100.0, 120.0]))
    want = [NO_TIME_VALUE, NO_TIME_VALUE, ABOVE_BOUND, ABOVE_BOUND]
    result = pricer.implied_volatility(book, backend="cpu")
    assert result["status"].tolist() == want
    assert result[["implied_volatility", "price"]].isna().all().all()
    write_book(tmp_path / "book.h5", book)
    for ranks in (1, 3):
        out = tmp_path / f"o{ranks}.h5"
        done = run_pricer(["implied-vol", str(tmp_path / "book.h5"), "-o", str(out), "--backend",
                           "cpu", "--partition", "count"], ranks=ranks)
        assert done.returncode == 0, done.stderr
        got = read_results(str(out))
        assert got["status"].tolist() == want and np.isnan(got["implied_volatility"]).all()
        assert np.isnan(got["price"]).all() and (got["iterations"] == 0).all()


def test_bounds_with_negative_rates_and_dividends():
    """An American put's value may pass K where r < 0 (and a call's S0 where q < 0): K e^-rT."""
    book = dict(id=np.array([1, 2, 3]), spot=np.array([10.0, 100.0, 10.0]),
                strike=np.array([100.0, 10.0, 100.0]), maturity=np.full(3, 5.0),
                rate=np.array([-0.05, 0.0, -0.05]), dividend=np.array([0.0, -0.05, 0.0]),
                volatility=np.full(3, 0.6), steps=np.full(3, 200),
                call=np.array([False, True, False]), american=np.array([True, True, False]),
                tree=np.array(["crr"] * 3))
    given = market_book(book)
    assert (given["market_price"] > np.minimum(book["spot"], book["strike"]) * 10).all()
    result = pricer.implied_volatility(given, backend="cpu")
    assert (result["status"] == CONVERGED).all()
    assert np.allclose(result["implied_volatility"], 0.6, rtol=0, atol=1e-8)


def test_a_tree_without_a_lattice_at_any_sigma_searched_says_so(rng, tmp_path):
    """crr has p in (0, 1) only where sigma sqrt(dt) > |r - q| dt: American options whose drawn
    rate or dividend needs a sigma above the search's range get status 23 on every CPU backend
    (their neighbours in the book, European near the money, solve), and the command's summary
    names it. Their market price, 25, is within the bounds (above a payoff of at most 20, below
    S0 and K; a European put's bound K e^-rT would refuse it first)."""
    n = 6
    steps = rng.integers(20, 400, 2 * n)
    maturity = rng.uniform(0.5, 3.0, 2 * n)
    # |r - q| sqrt(dt) 1.5 to 4 times the highest sigma searched, r or q
    gap = rng.uniform(1.5, 4.0, n) * SIGMA_HIGH / np.sqrt(maturity[:n] / steps[:n])
    high = rng.random(n) < 0.5
    book = dict(id=np.arange(1, 2 * n + 1), spot=np.full(2 * n, 100.0),
                strike=np.concatenate([rng.uniform(80.0, 120.0, n), rng.uniform(90.0, 110.0, n)]),
                maturity=maturity,
                rate=np.concatenate([np.where(high, gap, 0.0), rng.uniform(0.0, 0.05, n)]),
                dividend=np.concatenate([np.where(high, 0.0, gap), np.zeros(n)]),
                volatility=rng.uniform(0.2, 0.5, 2 * n), steps=steps,
                call=rng.random(2 * n) < 0.5, american=np.arange(2 * n) < n,
                tree=np.array(["crr"] * (2 * n)))
    solvable = market_book({k: v[n:] for k, v in book.items()})
    given = {k: np.concatenate([book[k][:n], v]) for k, v in solvable.items()
             if k != "market_price"}
    given["market_price"] = np.concatenate([np.full(n, 25.0), solvable["market_price"]])
    for backend in ("cpu", "serial"):
        result = pricer.implied_volatility(given, backend=backend)
        assert (result["status"][:n] == NO_LATTICE_FOUND).all(), result
        assert np.isnan(result["implied_volatility"][:n]).all()
        assert (result["status"][n:] == CONVERGED).all(), result
    write_book(tmp_path / "book.h5", given)
    proc = run_pricer(["implied-vol", tmp_path / "book.h5", "-o", tmp_path / "iv.h5", "--backend",
                       "cpu"])
    assert proc.returncode == 0, proc.stderr
    assert f"{n} no lattice (status 23)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("guess", [np.nan, 0.01, 10.0, 1e6, 1e-300])
def test_hard_starts_find_the_lattice(guess):
    """Lattices that exist only at large sigma (joshi4 at N = 4 and 7), and QuantLib's trees,
    whose prices fall again at volatilities of several hundred per cent, from any start."""
    rows = [("jr", 3, True, True, 95.65, 110.6, 1.407, 0.228, 0.021, 0.1478),
            ("jr", 2, True, False, 170.8, 130.8, 0.3364, 0.049, 0.00662, 0.5173),
            ("ql-crr", 267, True, False, 159.1, 126.6, 3.532, 0.0848, 0.0134, 2.109),
            ("joshi4", 7, True, True, 119.3, 127.3, 0.0004509, 0.0246, 0.0417, 7.467),
            ("joshi4", 4, True, True, 111.4, 64.37, 5.345, 0.296, 0.0121, 0.5609)]
    c = list(zip(*rows))
    book = dict(id=np.arange(1, 6), tree=np.array(c[0]), steps=np.array(c[1]),
                call=np.array(c[2]), american=np.array(c[3]), spot=np.array(c[4]),
                strike=np.array(c[5]), maturity=np.array(c[6]), rate=np.array(c[7]),
                dividend=np.array(c[8]), volatility=np.array(c[9]))
    given = dict(market_book(book), volatility=np.full(5, guess))
    result = pricer.implied_volatility(given, backend="cpu")
    assert (result["status"] == CONVERGED).all(), result
    assert np.allclose(result["implied_volatility"], book["volatility"], rtol=0, atol=1e-8)


def test_pool_size_groups_and_order_do_not_change_an_answer(rng, monkeypatch):
    """The pool's size, its groups (Solver.rounds: groups of GROUP_ROWS options, here 4, taking
    their rounds in turn) and the options' order leave every answer bitwise as it is."""
    book = market_book(random_book(rng, 97, TREES))
    cols = {k: np.asarray(v) for k, v in book.items() if k not in ("id", "tree")}
    cols["tree"] = np.array([TREE_NAMES.index(t) for t in book["tree"]])
    whole = solve(CPU, cols, cols["market_price"], "crr")
    monkeypatch.setattr(implied_pool, "GROUP_ROWS", 4)
    for rows in (1, 5, 40, 97):
        pooled = solve(CPU, cols, cols["market_price"], "crr", pool_rows=rows)
        for name, value in whole.items():
            assert np.array_equal(value, pooled[name], equal_nan=True), (rows, name)
    backwards = solve(CPU, {k: v[::-1] for k, v in cols.items()}, cols["market_price"][::-1],
                      "crr", pool_rows=7)
    for name, value in whole.items():
        assert np.array_equal(value, backwards[name][::-1], equal_nan=True), name


# --------------------------------------------------------------------------------------- QuantLib

def quantlib_implied(book: dict, days: np.ndarray, tree: str) -> np.ndarray:
    """QuantLib's Brent on BinomialVanillaEngine's NPV, option by option (QuantLib's own
    VanillaOption.impliedVolatility would move American options to a finite-difference engine)."""
    ql = pytest.importorskip("QuantLib")
    today = ql.Date(15, 1, 2025)
    dc = ql.Actual365Fixed()
    before = ql.Settings.instance().evaluationDate
    ql.Settings.instance().evaluationDate = today
    names = {"ql-crr": "crr", "jr": "jr", "tian": "tian", "lr": "lr"}
    try:
        out = np.empty(len(days))
        for k in range(len(days)):
            vol = ql.SimpleQuote(0.2)
            process = ql.BlackScholesMertonProcess(
                ql.QuoteHandle(ql.SimpleQuote(float(book["spot"][k]))),
                ql.YieldTermStructureHandle(ql.FlatForward(today, float(book["dividend"][k]), dc)),
                ql.YieldTermStructureHandle(ql.FlatForward(today, float(book["rate"][k]), dc)),
                ql.BlackVolTermStructureHandle(
                    ql.BlackConstantVol(today, ql.NullCalendar(), ql.QuoteHandle(vol), dc)))
            expiry = today + int(days[k])
            exercise = (ql.AmericanExercise(today, expiry) if book["american"][k]
                        else ql.EuropeanExercise(expiry))
            kind = ql.Option.Call if book["call"][k] else ql.Option.Put
            option = ql.VanillaOption(ql.PlainVanillaPayoff(kind, float(book["strike"][k])),
                                      exercise)
            option.setPricingEngine(ql.BinomialVanillaEngine(process, names[tree],
                                                             int(book["steps"][k])))
            target = float(book["market_price"][k])

            def error(sigma, option=option, vol=vol, target=target):
                vol.setValue(sigma)
                return option.NPV() - target

            # a bracket around the volatility the price was made with, where QuantLib's tree
            # has probabilities in [0, 1] (it throws outside)
            sigma = float(book["volatility"][k])
            out[k] = ql.Brent().solve(error, 1e-14, sigma, 0.8 * sigma, 1.25 * sigma)
        return out
    finally:
        ql.Settings.instance().evaluationDate = before


@pytest.mark.parametrize("tree", ["ql-crr", "jr", "lr"])
def test_agrees_with_quantlib_brent_on_the_same_tree(rng, tree):
    n = 30
    days = rng.integers(30, 3 * 365, n)
    steps = rng.integers(10, 300, n)
    book = random_book(rng, n, (tree,))
    book.update(maturity=days / 365.0, steps=steps, volatility=rng.uniform(0.1, 0.8, n),
                spot=book["strike"] * rng.uniform(0.85, 1.2, n))
    # QuantLib's maturity trap (docs/numerics.md) changes the American lattice where fl(T/N) N < T
    trap = book["american"] & ((book["maturity"] / book["steps"]) * book["steps"] < book["maturity"])
    book["american"] = book["american"] & ~trap
    given = market_book(book)
    ours = pricer.implied_volatility(given, backend="cpu")
    theirs = quantlib_implied(dict(given, volatility=book["volatility"]), days, tree)
    firm = lattice_vega(book) > 1e-4 * book["strike"]
    ok = ours["status"].to_numpy() == CONVERGED
    assert ok[firm].all()
    difference = np.abs(ours["implied_volatility"].to_numpy() - theirs)[firm]
    assert (difference <= 1e-8).all(), difference.max()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["batch", "gpu", "hybrid"])
def test_every_gpu_backend_solves_as_the_cpu_does(rng, backend, monkeypatch):
    """Within 1e-9 in sigma of the cpu backend, the price at the answer the backend's own; the
    pool in groups of 50 options (Solver.rounds), two engine calls out on the GPU at once."""
    book = random_book(rng, 400, TREES, steps=(16, 700))
    given = market_book(book)
    monkeypatch.setattr(implied_pool, "GROUP_ROWS", 50)
    got = pricer.implied_volatility(given, backend=backend)
    check_accuracy(given | {"volatility": book["volatility"]}, got)
    cpu = pricer.implied_volatility(given, backend="cpu")
    both = (got["status"].to_numpy() == CONVERGED) & (cpu["status"].to_numpy() == CONVERGED)
    firm = lattice_vega(book) > 1e-4 * book["strike"]
    gap = np.abs(got["implied_volatility"].to_numpy() - cpu["implied_volatility"].to_numpy())
    assert (gap[both & firm] <= 1e-9).all(), gap[both & firm].max()
    # the price at the answer is the backend's own lattice price there, bitwise
    ok = got["status"].to_numpy() == CONVERGED
    again = pricer.price(dict(book, volatility=np.where(ok, got["implied_volatility"], 0.2)),
                         backend=backend)
    assert np.array_equal(again["price"].to_numpy()[ok], got["price"].to_numpy()[ok])


@needs_gpu
@pytest.mark.gpu
def test_command_on_the_gpu_under_mpiexec_matches_the_api(tmp_path, rng):
    book = market_book(random_book(rng, 500, TREES, steps=(16, 700)))
    write_book(tmp_path / "book.h5", book)
    expected = pricer.implied_volatility(book, backend="batch")
    out = tmp_path / "out.h5"
    done = run_pricer(["implied-vol", str(tmp_path / "book.h5"), "-o", str(out), "--backend",
                       "batch"], ranks=2)
    assert done.returncode == 0, done.stderr
    got = read_results(str(out))
    for name in ("implied_volatility", "price", "status", "iterations"):
        assert np.array_equal(got[name], expected[name].to_numpy(), equal_nan=True), name


# ---------------------------------------------------------------------------------- the command

def write_book(path, book: dict) -> None:
    """A book as a file; a volatility left out is left out of the file too."""
    book = dict(book)
    book.setdefault("volatility", np.full(len(book["id"]), np.nan))
    write_portfolio(str(path), Portfolio(**book))


def test_command_under_mpiexec_matches_the_api_for_any_ranks(tmp_path, rng):
    book = market_book(random_book(rng, 300, TREES))
    write_book(tmp_path / "book.h5", book)
    expected = pricer.implied_volatility(book, backend="cpu")
    for ranks, distribute in ((1, "scatter"), (3, "scatter"), (2, "read")):
        out = tmp_path / f"out{ranks}{distribute}.h5"
        done = run_pricer(["implied-vol", str(tmp_path / "book.h5"), "-o", str(out), "--backend",
                           "cpu", "--distribute", distribute], ranks=ranks)
        assert done.returncode == 0, done.stderr
        assert "solved the implied volatilities of 300 options" in done.stdout
        got = read_results(str(out))
        for name in ("implied_volatility", "price", "status", "iterations"):
            assert np.array_equal(got[name], expected[name].to_numpy(), equal_nan=True), name
        assert got["attrs"]["task"] == "implied-vol"


def test_checkpoint_resumes_an_implied_vol_run(tmp_path, rng):
    book = market_book(random_book(rng, 200, ("crr",), steps=(16, 64)))
    write_book(tmp_path / "book.h5", book)
    args = ["implied-vol", str(tmp_path / "book.h5"), "--backend", "cpu", "--chunk-nodes",
            "20000", "--checkpoint", str(tmp_path / "ck")]
    first = run_pricer(args + ["-o", str(tmp_path / "a.h5")],
                       extra_env={"PRICER_FAULT": "raise:0:3"})
    assert first.returncode != 0 and not (tmp_path / "a.h5").exists()
    priced = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "p.h5"),
                         "--backend", "cpu", "--checkpoint", str(tmp_path / "ck")])
    assert priced.returncode == 2 and "checkpoint" in priced.stderr   # not a pricing run's
    second = run_pricer(args + ["-o", str(tmp_path / "a.h5")])
    assert second.returncode == 0, second.stderr
    assert "of them from the checkpoint" in second.stdout
    expected = pricer.implied_volatility(book, backend="cpu")
    got = read_results(str(tmp_path / "a.h5"))
    assert np.array_equal(got["implied_volatility"], expected["implied_volatility"].to_numpy(),
                          equal_nan=True)


@pytest.mark.parametrize("case, message", [
    ("negative", "column market_price must be >= 0; it is not for option id(s) 4"),
    ("nan", "column market_price is NaN or infinite for option id(s) 4"),
    ("missing", "implied volatilities need a market_price column"),
    ("few-steps", "option id(s) 4 have fewer steps than their tree needs"),
])
def test_hostile_books_exit_2_naming_the_cause(tmp_path, rng, case, message):
    book = market_book(random_book(rng, 20, ("crr",)))
    if case == "negative":
        book["market_price"][1] = -1.0
    elif case == "nan":
        book["market_price"][1] = np.nan
    elif case == "missing":
        del book["market_price"]
        book["volatility"] = np.full(20, 0.2)
    else:
        book["tree"] = np.array(["joshi4"] * 20)
        book["steps"][1] = 1
    write_book(tmp_path / "book.h5", book)
    done = run_pricer(["implied-vol", str(tmp_path / "book.h5"), "-o", str(tmp_path / "o.h5"),
                       "--backend", "cpu"], ranks=2)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "o.h5").exists()


def test_skip_gives_the_bad_rows_a_status_and_solves_the_rest(tmp_path, rng):
    book = market_book(random_book(rng, 40, ("crr",)))
    book["market_price"][3] = np.nan
    book["spot"][5] = -1.0
    result = pricer.implied_volatility(book, backend="cpu", invalid="skip")
    status = result["status"].to_numpy()
    assert status[3] == 1 and status[5] == 2
    clean = np.ones(40, bool)
    clean[[3, 5]] = False
    alone = pricer.implied_volatility({k: v[clean] for k, v in book.items()}, backend="cpu")
    assert np.array_equal(result["implied_volatility"].to_numpy()[clean],
                          alone["implied_volatility"].to_numpy(), equal_nan=True)


def test_a_book_of_market_prices_is_not_priced_without_volatilities(tmp_path, rng):
    book = market_book(random_book(rng, 10, ("crr",)))
    write_book(tmp_path / "book.h5", book)
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "o.h5"),
                       "--backend", "cpu"])
    assert done.returncode == 2
    assert "column volatility is NaN or absent for option id(s) 1, 4, 7" in done.stderr
    with h5py.File(tmp_path / "book.h5") as f:
        assert "volatility" not in f["portfolio"]


def test_pricing_ignores_the_market_price_column(tmp_path, rng):
    """A book with quotes (one of them NaN) and volatilities prices as it would without them."""
    book = random_book(rng, 20, ("crr",))
    quoted = dict(book, market_price=np.where(np.arange(20) == 3, np.nan, 5.0))
    assert np.array_equal(pricer.price(quoted, backend="cpu")["price"].to_numpy(),
                          pricer.price(book, backend="cpu")["price"].to_numpy())
    with pytest.raises(pricer.InputError, match="column market_price is NaN or infinite for "
                                                "option id\\(s\\) 10"):
        pricer.implied_volatility(quoted, backend="cpu")


class _Recording(CpuEngine):
    """The cpu engine, noting numba's threads on the thread that starts each call."""

    def __init__(self, uses_gpu: bool):
        super().__init__()
        self.uses_gpu, self.threads = uses_gpu, []

    def start(self, params):
        import numba
        self.threads.append(numba.get_num_threads())
        return super().start(params)


def test_a_search_beside_a_gpu_caps_numbas_threads_by_its_groups_and_restores_them(rng):
    """Beside a GPU the search's own passes are light: numba's threads on its thread are capped
    to one per ROWS_PER_THREAD rows of a group (here 1) for the search, and set back after it;
    an engine on the CPU keeps them all."""
    import numba
    if numba.get_num_threads() < 2:
        pytest.skip("one thread: nothing to cap")
    book = market_book(random_book(rng, 60, TREES))
    cols = {k: np.asarray(v) for k, v in book.items() if k not in ("id", "tree")}
    cols["tree"] = np.array([TREE_NAMES.index(t) for t in book["tree"]])
    before = numba.get_num_threads()
    beside, alone = _Recording(uses_gpu=True), _Recording(uses_gpu=False)
    got = solve(beside, cols, cols["market_price"], "crr")
    want = solve(alone, cols, cols["market_price"], "crr")
    assert set(beside.threads) == {1} and set(alone.threads) == {before}
    assert numba.get_num_threads() == before
    for name, value in want.items():
        assert np.array_equal(value, got[name], equal_nan=True), name
