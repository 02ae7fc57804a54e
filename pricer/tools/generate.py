"""Synthetic portfolios, deterministic in (dist, count, seed, options): for demos, tests and benchmarks.

- uniform:   every option has the same N (the U portfolios of Pawlak & Oancea (2019)).
- random:    N uniform in [min_steps, max_steps] (R portfolios; default [16, 4096]).
- skewed:    N uniform in [64, 256], and 1% of the options 10-50x larger (S portfolios).
- scenarios: Cao (2025)'s validation grid of American puts, K = 100: moneyness S0 = 90/100/110
             (ITM/ATM/OTM), sigma 0.1-0.6, T 0.25-5, r 0/5/10 %, q = 0; repeated to `count`.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import fields

import h5py

import numpy as np

from pricer import __version__
from pricer.errors import InputError
from pricer.files import atomic_write, check_output_file
from pricer.io.formats import HDF5, extension_format, output_format, table_bytes
from pricer.io.portfolio import GROUP, SCHEMA, Portfolio, write_portfolio

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
    if seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")
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


def ensure_generated(portfolio_path: str, spec: dict) -> bool:
    """Write the generated portfolio unless the file already holds exactly this one. True if written."""
    missing = [key for key in ("dist", "count") if key not in spec]
    if missing:
        raise InputError(f"portfolio.generate: missing key(s) {', '.join(missing)}")
    if extension_format(portfolio_path) not in (None, HDF5):
        raise InputError(f"portfolio.path {portfolio_path}: portfolio.generate writes HDF5; give "
                         f"the path an .h5 extension")
    stamp = json.dumps(spec, sort_keys=True)
    if os.path.exists(portfolio_path):
        made_by = _generated_by(portfolio_path)
        if made_by == stamp:
            return False
        if made_by is None:  # a portfolio of the user's own: never replaced
            raise InputError(f"portfolio.path {portfolio_path} exists and was not generated by pricer; "
                             f"remove portfolio.generate to price it, or point portfolio.path elsewhere")
    try:
        portfolio = generate(**spec)
    except TypeError as exc:
        raise InputError(f"portfolio.generate: {exc}") from None
    write_portfolio(portfolio_path, portfolio, attrs={"generated_by": stamp})
    return True


def _generated_by(path: str) -> str | None:
    """The generate block a portfolio file was made from, or None for any other file."""
    try:
        with h5py.File(path, "r") as f:
            stamp = f[GROUP].attrs.get("generated_by")
    except (OSError, KeyError):
        return None
    return stamp.decode() if isinstance(stamp, bytes) else stamp


# bytes of memory per generated option: its columns and the arrays they are drawn from
GENERATE_BYTES_PER_OPTION = 200


def write_book(path: str, fmt: str, portfolio: Portfolio, attrs: dict) -> None:
    """A portfolio in any of the formats (pricer/io/formats.py), `attrs` recorded in it: HDF5's
    /portfolio attributes, a CSV's leading `# key: value` lines, Parquet's metadata."""
    if fmt == HDF5:
        write_portfolio(path, portfolio, attrs=attrs)
        return
    columns = {f.name: getattr(portfolio, f.name) for f in fields(portfolio)
               if getattr(portfolio, f.name) is not None}
    atomic_write(path, table_bytes(fmt, columns, {"schema": SCHEMA, **attrs}, {}))


def with_market_prices(portfolio: Portfolio) -> None:
    """A book for `pricer implied-vol`: each option's market price its crr lattice price at the
    drawn volatility (the cpu backend), the volatility column then left out (NaN), so that the
    implied volatilities should give the drawn ones back."""
    from pricer.engines import get_engine
    from pricer.run.checks import checked_rows
    from pricer.run.config import RunConfig
    from pricer.run.pricing import price_checked

    cfg = RunConfig(input="pricer generate --market-prices", output="-", backend="cpu").check()
    values, _ = price_checked(get_engine("cpu"), cfg, checked_rows(cfg, portfolio), portfolio.id)
    portfolio.market_price = values[:, 0]
    portfolio.volatility = np.full(len(portfolio), np.nan)


def write_generated(args) -> None:
    """`pricer generate`: the book of args, checked before any work (output path, memory), then
    written; prints what it wrote."""
    from pricer.run.memory import GIB, available_bytes

    check_output_file(args.output, args.overwrite, "portfolio")
    fmt = output_format(args.output, "portfolio")
    need, have = args.count * GENERATE_BYTES_PER_OPTION, available_bytes()
    if need > have:
        raise InputError(f"--count {args.count}: generating it needs ~{need / GIB:.2f} GiB of "
                         f"memory, this machine has {have / GIB:.2f} GiB available")
    portfolio = generate(args.dist, args.count, args.seed, steps=args.steps,
                         exercise=args.exercise, min_steps=args.min_steps,
                         max_steps=args.max_steps)
    spec = {"dist": args.dist, "count": args.count, "seed": args.seed, "steps": args.steps,
            "exercise": args.exercise, "min_steps": args.min_steps, "max_steps": args.max_steps}
    if getattr(args, "market_prices", False):
        with_market_prices(portfolio)
        spec["market_prices"] = True
    # the arguments that decide the book, not the command line: the same book is the same bytes
    # under any name
    # (generate_args, not a job's generated_by: a job replaces only the books it made itself)
    attrs = {"generate_args": json.dumps(spec, sort_keys=True), "pricer_version": __version__}
    write_book(args.output, fmt, portfolio, attrs)
    print(f"wrote {args.output}: {len(portfolio)} options ({args.dist}, seed {args.seed}), "
          f"{portfolio.nodes():.4g} nodes", flush=True)
