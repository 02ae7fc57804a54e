"""`pricer warm`: every kernel a backend may run, compiled into the caches before the first run.

A run compiles what its book needs at its start (numba's CPU kernels, the GPU's cubins) and caches
it (NUMBA_CACHE_DIR, PRICER_CUDA_CACHE; docs/gpu.md): the first run on a fresh machine spends tens
of seconds there, and a cluster's jobs spend them once per node and user unless the caches are
shared. `pricer warm` prices a few small books on each backend, chosen so that together they take
every path a book can: lattices of 16 to 2 048 steps in pairs and alone, American and European
calls and puts, with and without the Greeks; one option alone; lattices whose node tables are
centred or clamped (kernels.node_tables); one wide enough to share its levels among the threads;
and the implied volatilities of the first book (pricer.model.implied's kernels); and a few bond
options on Hull–White trees (warm_bond_book) on the backend's engine of that family. Run it once per
machine type, at install time or before a job, pointed at the caches the runs will use.
"""

from __future__ import annotations

import time

import numpy as np

from pricer.engines import backend, backends, get_engine, gpu_available
from pricer.engines.cpu.parallel import LEVEL_PARALLEL_MIN_STEPS
from pricer.io.portfolio import portfolio_from_columns
from pricer.run.checks import checked_rows
from pricer.run.config import RunConfig
from pricer.run.pricing import price_checked
from pricer.tools.generate import generate


def _columns(**values) -> dict:
    """A book as the Python API takes it (pricer.price), ids 1..n."""
    count = max(np.size(v) for v in values.values())
    book = {name: np.broadcast_to(np.asarray(v), (count,)).copy() for name, v in values.items()}
    return {"id": np.arange(1, count + 1, dtype=np.int64), "dividend": np.zeros(count), **book}


def warm_books() -> list[tuple[str, dict, bool]]:
    """(what, book, greeks): the books `pricer warm` prices on each backend (greeks None: solves
    for the implied volatilities of its market prices)."""
    mixed = generate("random", 64, seed=1, min_steps=16, max_steps=2048)
    book = {name: getattr(mixed, name) for name in ("id", "spot", "strike", "maturity", "rate",
                                                    "dividend", "volatility", "steps", "call",
                                                    "american")}
    one = {name: values[:1] for name, values in book.items()}
    # sigma = 3 over 3 years: plain, centred and clamped node tables (docs/numerics.md)
    wide_tables = _columns(spot=100.0, strike=100.0, maturity=3.0, rate=0.02, volatility=3.0,
                           steps=[4000, 6000, 8000, 20_000], call=[True, False, True, False],
                           american=False)
    shared = _columns(spot=100.0, strike=100.0, maturity=1.0, rate=0.02, volatility=0.2,
                      steps=[LEVEL_PARALLEL_MIN_STEPS, 16], call=False, american=True)
    implied = dict(book, market_price=np.maximum(book["spot"] - book["strike"], 0.0) + 5.0)
    return [("64 options, N 16-2048", book, False), ("the same, with Greeks", book, True),
            ("one option", one, False), ("centred and clamped tables", wide_tables, False),
            ("one option sharing its levels", shared, False),
            ("implied volatilities", implied, None)]


def default_backends() -> list[str]:
    """Every backend this machine can run (the GPU ones where a GPU is usable); `auto` is one of
    them under another name."""
    gpu = gpu_available()
    return [name for name in backends() if name != "auto" and (gpu or not backend(name).needs_gpu)]


def caches() -> list[str]:
    """Where the compiled kernels went, for the report."""
    from pricer.files import cache_dir
    from pricer.numba_cache import folder
    return [f"numba's cache: {folder()}",
            f"the GPU's cubins: {cache_dir('cuda', 'PRICER_CUDA_CACHE')}"]


def warm(names: list[str], report=print) -> list[tuple[str, float]]:
    """Each backend's books priced once, as pricer.price prices them (checked, then chunk by chunk
    as a run cuts them), its seconds reported; returns them."""
    spent = []
    for name in names:
        start = time.perf_counter()
        engine = get_engine(name)
        engine.warm_up()
        for what, book, greeks in warm_books():
            cfg = RunConfig(input=f"pricer warm ({what})", output="-", backend=name,
                            greeks=bool(greeks),
                            task="implied-vol" if greeks is None else "price").check()
            portfolio = portfolio_from_columns(book, cfg.input)
            price_checked(engine, cfg, checked_rows(cfg, portfolio), portfolio.id)
        if backend(name).prices("bonds"):
            get_engine(name, "bonds").price(warm_bond_book())
        spent.append((name, time.perf_counter() - start))
        report(f"{name}: {spent[-1][1]:.1f} s")
    return spent


def warm_bond_book():
    """The trees of a few bond options that take every path of the Hull–White engines: each
    exercise style and product, coupons and none, a narrow and a wide tree."""
    from pricer.model import bond_book, hw1f

    curve = hw1f.YieldCurve(np.array([1.0, 10.0]), np.array([0.02, 0.03]))
    instruments = [hw1f.BondOption(face=100.0, coupon=c, frequency=f, maturity=5.0, strike=100.0,
                                   call=call, exercise=e, first=1.0, last=4.0, every=1.0,
                                   product=p)
                   for c, f, call, e, p in ((0.04, 2, True, "european", "option"),
                                            (0.0, 0, False, "bermudan", "callable"),
                                            (0.03, 4, True, "american", "puttable"))]
    return bond_book.parameters(instruments * 2, np.array([0.5, 0.5, 0.5, 0.02, 0.02, 0.02]),
                                0.01, 12, curve)
