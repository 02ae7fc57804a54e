"""Every backend against the plain NumPy oracle (tests/oracle.py) on fresh random inputs, and the
backend registry: a backend added as a user would add one runs through `pricer price` under
`mpiexec -n 2`. GPU backends are marked `gpu`: they skip here with the reason and run on the GPU
machine (python3 -m pytest -m gpu tests/test_backends.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pricer.engines import backends, get_engine, register, resolve_backend, unregister
from pricer.engines.base import Engine, Route, route
from pricer.errors import InputError
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from pricer.model.greeks import GREEKS, Analytics, price_with_analytics
from pricer.model.lattice import LEVEL_VALUES, TREE_NAMES, lattice_parameters
from pricer.tools.generate import generate

from gpu_cases import GPU
from helpers import ROOT, env, mpiexec
from oracle import OracleEngine, oracle_prices, relative_error

BACKENDS = [pytest.param(name, marks=GPU if name in ("gpu", "hybrid", "batch") else [])
            for name in ("serial", "cpu", "gpu", "hybrid", "batch")]


def random_params(rng, n: int, most: int, tree: str = "crr"):
    """Calls and puts, American and European, all trees' lattices, steps 1 .. most (a few small)."""
    strike = rng.uniform(80.0, 120.0, n)
    steps = rng.integers(1, most + 1, n)
    steps[: n // 8] = rng.integers(1, 8, n // 8)
    cols = dict(spot=strike * rng.uniform(0.6, 1.6, n), strike=strike,
                maturity=rng.uniform(0.05, 3.0, n), rate=rng.uniform(0.0, 0.08, n),
                dividend=rng.uniform(0.0, 0.04, n), volatility=rng.uniform(0.15, 0.6, n),
                steps=steps.astype(np.int64), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.6)
    cols["steps"] = np.maximum(cols["steps"], 2)   # joshi4 needs 2
    # volatile enough that p stays inside (0, 1) on the coarsest lattices of every tree
    cols["volatility"] = np.maximum(cols["volatility"],
                                    3 * np.abs(cols["rate"] - cols["dividend"]) + 0.2)
    return lattice_parameters(cols, tree)


def tolerance(steps) -> np.ndarray:
    """Rounding grows with the levels; the batch kernels' exp-built node prices add a few ulp."""
    return np.where(np.asarray(steps) <= 5_000, 1e-11, 1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", ["crr", "lr", "tian"])
def test_every_backend_agrees_with_the_oracle(backend, tree, rng):
    engine = get_engine(backend)
    most = 3_000 if backend in ("serial", "cpu") else 20_000
    p = random_params(rng, 48, most, tree)
    got, want = engine.price(p), oracle_prices(p)
    err = relative_error(got, want, p.strike)
    assert (err <= tolerance(p.steps)).all(), (err.max(), int(p.steps[np.argmax(err)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_keeps_the_oracles_first_levels(backend, rng):
    """The levels the Greeks are built from (V(1, .), V(2, .)), NaN below 2 steps."""
    p = random_params(rng, 24, 1_500)
    p.steps[0] = 1
    got, want = np.empty((len(p), LEVEL_VALUES)), np.empty((len(p), LEVEL_VALUES))
    get_engine(backend).price(p, got)
    oracle_prices(p, want)
    assert np.isnan(got[0]).all() and np.isnan(want[0]).all()
    err = relative_error(got[1:], want[1:], p.strike[1:, None])
    assert (err <= 1e-10).all(), err.max()


def test_the_oracle_is_independent_of_the_engines_and_exact_to_rounding(rng):
    """The oracle and the serial engine share nothing but LatticeParams; it must still be right:
    against the closed form of a European option on a fine lattice (Black-Scholes), within the
    lattice's O(1/N) error."""
    from math import erf, exp, log, sqrt

    cdf = lambda x: 0.5 * (1 + erf(x / sqrt(2)))  # noqa: E731
    s, k, t, r, q, sigma = 100.0, 105.0, 1.0, 0.03, 0.01, 0.25
    d1 = (log(s / k) + (r - q + sigma * sigma / 2) * t) / (sigma * sqrt(t))
    call = s * exp(-q * t) * cdf(d1) - k * exp(-r * t) * cdf(d1 - sigma * sqrt(t))
    cols = {name: np.array([value]) for name, value in
            dict(spot=s, strike=k, maturity=t, rate=r, dividend=q, volatility=sigma).items()}
    cols.update(steps=np.array([4000]), call=np.array([True]), american=np.array([False]))
    assert abs(oracle_prices(lattice_parameters(cols))[0] - call) < 5e-3


# ------------------------------------------------------------------------------------ registry

def test_the_registry_names_every_built_in_backend_auto_first():
    assert backends()[0] == "auto"
    assert set(backends()) >= {"auto", "serial", "cpu", "gpu", "hybrid", "batch"}
    with pytest.raises(InputError, match="unknown backend 'nope'; known backends: auto"):
        resolve_backend("nope")


def test_route_sends_each_option_to_the_first_engine_that_takes_it(rng):
    """The combinator behind the GPU engines: rows to engines by ranges of their steps, prices and
    levels scattered back in input order."""
    class Tagged(Engine):
        def __init__(self, tag):
            self.tag, self.seen = tag, []

        def price(self, params, levels=None):
            self.seen.append(params)
            if levels is not None:
                levels[:] = self.tag
            return np.full(len(params), float(self.tag))

    small, large = Tagged(1), Tagged(2)
    p = random_params(rng, 40, 400)
    routes = [Route(small, most=100), Route(large, above=100)]
    levels = np.empty((len(p), LEVEL_VALUES))
    got = route(p, routes, levels)
    want = np.where(p.steps <= 100, 1.0, 2.0)
    assert np.array_equal(got, want) and np.array_equal(levels[:, 0], want)
    assert (small.seen[0].steps <= 100).all() and (large.seen[0].steps > 100).all()
    every = Tagged(3)       # one route taking every option gets params as they are, no copy
    assert np.array_equal(route(p, [Route(every, most=500)]),
                          np.full(len(p), 3.0)) and every.seen[0] is p
    with pytest.raises(ValueError, match="no engine route accepts"):
        route(p, [Route(small, most=100)])


def test_a_backend_registered_in_process_prices_through_the_python_api(rng):
    register("oracle-test", {("options", "lattice"): OracleEngine})
    try:
        assert "oracle-test" in backends() and resolve_backend("oracle-test") == "oracle-test"
        p = random_params(rng, 10, 300)
        engine = get_engine("oracle-test", t1=5)      # the run's GPU settings, ignored
        assert np.array_equal(engine.price(p), oracle_prices(p))
    finally:
        unregister("oracle-test")
    assert "oracle-test" not in backends()


def test_the_registry_is_keyed_by_family_and_method():
    """A backend names an engine per (family, method) it prices: asked for another it says so by
    name (InputError, exit 2 on a command line); an unknown family or method is refused at once."""
    from pricer.engines import backend
    from pricer.errors import InputError

    register("options-only", {("options", "lattice"): OracleEngine})
    try:
        known = backend("options-only")
        assert known.prices("options") and not known.prices("bonds")
        with pytest.raises(InputError, match="backend 'options-only' has no engine for bonds by "
                                             "lattice"):
            get_engine("options-only", "bonds")
    finally:
        unregister("options-only")
    with pytest.raises(ValueError, match="unknown \\(family, method\\)"):
        register("nope", {("baskets", "monte-carlo"): OracleEngine})
    assert "nope" not in backends()
    assert all(backend(name).prices("bonds") for name in ("serial", "cpu", "gpu", "hybrid",
                                                          "batch"))


def test_a_registered_backend_runs_through_pricer_price_under_mpiexec(tmp_path):
    """tests/data/oracle_backend.py adds `oracle` as a user would (one module, one register call)
    and runs the real command: 2 ranks, Greeks included, every option's price and Greeks within
    rounding of the serial backend's, the results naming the backend."""
    import subprocess
    import sys

    book = generate("random", 120, seed=11, min_steps=2, max_steps=300)
    write_portfolio(str(tmp_path / "book.h5"), book)
    script = str(ROOT / "tests" / "data" / "oracle_backend.py")
    runs = {}
    for backend, command in (("oracle", [mpiexec(), "-n", "2", sys.executable, script]),
                             ("serial", [sys.executable, "-m", "pricer"])):
        out = tmp_path / f"{backend}.h5"
        proc = subprocess.run(command + ["price", str(tmp_path / "book.h5"), "-o", str(out),
                                         "--backend", backend, "--greeks"],
                              capture_output=True, text=True, timeout=300, env=env())
        assert proc.returncode == 0, proc.stderr
        runs[backend] = read_results(str(out))
    oracle, serial = runs["oracle"], runs["serial"]
    assert oracle["attrs"]["backend"] == "oracle" and int(oracle["attrs"]["ranks"]) == 2
    assert list(oracle["run"]["options"]) == [60, 60] or sum(oracle["run"]["options"]) == 120
    for name in ("price",) + GREEKS:
        err = relative_error(oracle[name], serial[name], np.maximum(np.abs(serial[name]), 1.0))
        assert (err <= 1e-9).all(), (name, err.max())
    assert np.array_equal(oracle["id"], book.id)


def test_price_with_analytics_on_the_oracle_matches_serial(rng):
    """The analytics (bumped lattices, Richardson) work on any engine, the oracle included."""
    p_cols = dict(spot=np.full(6, 100.0), strike=np.linspace(90, 110, 6), maturity=np.ones(6),
                  rate=np.full(6, 0.03), dividend=np.zeros(6), volatility=np.full(6, 0.3),
                  steps=np.arange(50, 56), call=np.arange(6) % 2 == 0, american=np.ones(6, bool))
    ids = np.arange(6)
    analytics = Analytics(greeks=True, richardson=True)
    ours = price_with_analytics(get_engine("serial"), p_cols, "crr", ids, analytics)
    theirs = price_with_analytics(OracleEngine(), p_cols, "crr", ids, analytics)
    for name in analytics.outputs:
        assert np.allclose(ours[name], theirs[name], rtol=1e-9, atol=1e-9), name
    assert TREE_NAMES[0] == "crr"


def test_a_routes_range_decisions_agree_with_its_mask():
    """route() decides from the steps' range alone when a route takes none or all of a call's
    options; those decisions must be what the elementwise mask says, at every edge."""
    for above, most in [(0, None), (0, 5), (5, 5), (3, 9), (9, None), (0, 0)]:
        r = Route(None, most=most, above=above)
        for least in range(0, 12):
            for top in range(least, 12):
                mask = r.accepts(np.arange(least, top + 1))
                assert r.takes_any(least, top) == bool(mask.any()), (above, most, least, top)
                assert r.takes_all(least, top) == bool(mask.all()), (above, most, least, top)
