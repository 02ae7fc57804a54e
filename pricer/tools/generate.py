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
from contextlib import contextmanager
from dataclasses import fields

import h5py

import numpy as np

from pricer import __version__
from pricer.errors import InputError, OutputError
from pricer.files import atomic_write, check_output_file, claim
from pricer.io.formats import HDF5, extension_format, output_format, table_bytes
from pricer.io.portfolio import GROUP, SCHEMA, Portfolio, portfolio_image

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


def check_settings(dist: str, count: int, seed: int = 0, steps: int = 1000,
                   exercise: str = "mixed", min_steps: int = 16, max_steps: int = 4096,
                   named=lambda key: f"--{key.replace('_', '-')}") -> None:
    """InputError unless generate can make this book; `named(key)` says a setting as the user gave
    it (the command's flag, a job file's key)."""
    if dist not in DISTRIBUTIONS:
        raise InputError(f"unknown distribution {dist!r}; known: {', '.join(DISTRIBUTIONS)}")
    if exercise not in EXERCISE:
        raise InputError(f"unknown exercise {exercise!r}; known: {', '.join(EXERCISE)}")
    if count < 1:
        raise InputError(f"{named('count')} must be >= 1, got {count}")
    if seed < 0:
        raise InputError(f"{named('seed')} must be >= 0, got {seed}")
    if steps < 1 or min_steps < 1 or max_steps < min_steps:
        raise InputError(f"steps must be >= 1 and min_steps <= max_steps "
                         f"(got {steps}, {min_steps}, {max_steps})")


def generate(dist: str, count: int, seed: int = 0, steps: int = 1000, exercise: str = "mixed",
             min_steps: int = 16, max_steps: int = 4096) -> Portfolio:
    check_settings(dist, count, seed, steps, exercise, min_steps, max_steps)
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
    """A job's [portfolio.generate]: write the generated portfolio unless the file already holds
    exactly this one. True if written. The checks of `pricer generate` (check_settings,
    check_memory, the output's, claimed, write_image), each naming the job file's key."""
    missing = [key for key in ("dist", "count") if key not in spec]
    if missing:
        raise InputError(f"portfolio.generate: missing key(s) {', '.join(missing)}")
    if extension_format(portfolio_path) not in (None, HDF5):
        raise InputError(f"portfolio.path {portfolio_path}: portfolio.generate writes HDF5; give "
                         f"the path an .h5 extension")
    try:
        check_settings(**spec, named=lambda key: f"portfolio.generate.{key}")
    except TypeError as exc:
        raise InputError(f"portfolio.generate: {exc}") from None
    stamp = json.dumps(spec, sort_keys=True)
    # a device, FIFO or directory is refused before anything opens it (a FIFO's open would wait)
    check_output_file(portfolio_path, True, "portfolio")
    if _holds(portfolio_path, stamp):
        return False
    check_memory(spec["count"], GENERATE_BYTES_PER_OPTION, "portfolio.generate.count")
    with claimed(portfolio_path, True, "portfolio"):
        if _holds(portfolio_path, stamp):   # another run wrote it between the look and the claim
            return False
        write_image(portfolio_path, portfolio_image(generate(**spec),
                                                    attrs={"generated_by": stamp}), "portfolio")
    return True


def _holds(path: str, stamp: str) -> bool:
    """Whether `path` is the portfolio of this generate block (stamp); False where there is none
    or it was generated from another block; InputError for a file pricer did not generate."""
    if not os.path.exists(path):
        return False
    made_by = _generated_by(path)
    if made_by is None:  # a portfolio of the user's own: never replaced
        raise InputError(f"portfolio.path {path} exists and was not generated by pricer; "
                         f"remove portfolio.generate to price it, or point portfolio.path "
                         f"elsewhere")
    return made_by == stamp


def _generated_by(path: str) -> str | None:
    """The generate block a portfolio file was made from, or None for any other file."""
    try:
        with h5py.File(path, "r") as f:
            stamp = f[GROUP].attrs.get("generated_by")
    except (OSError, KeyError):
        return None
    return stamp.decode() if isinstance(stamp, bytes) else stamp


class JobBook:
    """The book of a job's [portfolio.generate], made on rank 0 before the run reads it (make: the
    run's `prepare`, at cfg.input as the run expanded it: {array_task}) and removed again where
    the run is then refused (discard): a refused run leaves nothing it wrote, the book it
    generated included."""

    def __init__(self, cfg, spec: dict):
        self.cfg, self.spec, self.written = cfg, spec, None

    def make(self) -> None:
        if ensure_generated(self.cfg.input, self.spec):
            self.written = self.cfg.input

    def discard(self) -> None:
        path, self.written = self.written, None
        if path is not None and _generated_by(path) == json.dumps(self.spec, sort_keys=True):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


# bytes of memory per generated option at the peak: its columns, the arrays they are drawn from,
# and the file made in memory (write_image)
GENERATE_BYTES_PER_OPTION = 200


def check_memory(count: int, per_row: int, name: str = "--count") -> None:
    """InputError unless `count` rows of `per_row` bytes each fit the memory available."""
    from pricer.run.memory import GIB, available_bytes

    need, have = count * per_row, available_bytes()
    if need > have:
        raise InputError(f"{name} {count}: generating it needs ~{need / GIB:.2f} GiB of "
                         f"memory, this machine has {have / GIB:.2f} GiB available")


@contextmanager
def claimed(path: str, overwrite: bool, what: str):
    """`path` claimed for the block (files.claim, the claim a run takes on its output), its checks
    made before and again under the claim; released when the block ends. Another run or
    generation writing it meanwhile is refused by name."""
    check_output_file(path, overwrite, what)
    locks = claim([path], lambda: check_output_file(path, overwrite, what))
    try:
        yield
    finally:
        for lock in locks:
            lock.release()


def check_room(path: str, nbytes: int, what: str) -> None:
    """InputError unless the file system of `path` has room for `nbytes` more (the new file is
    written beside an old one it replaces, so the old one's room does not count)."""
    from pricer.run.memory import size_text

    folder = os.path.dirname(os.path.abspath(path))
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if nbytes > free:
        raise InputError(f"{path}: not enough disk space in {folder}: the {what} needs "
                         f"~{size_text(nbytes)}, {size_text(free)} is free")


def write_image(path: str, image, what: str) -> None:
    """The file's bytes (`image`) written to `path` atomically, its room checked first
    (check_room: exit 2, nothing written); a write that fails all the same (the disk filled
    meanwhile, a quota, a lost mount) is an OutputError (exit 1) and leaves no file
    (files.atomic_write)."""
    check_room(path, len(image), what)
    try:
        atomic_write(path, image)
    except OSError as exc:
        raise OutputError(f"{path}: the {what} could not be written ({exc.strerror or exc}); "
                          f"no part of it was left on disk") from None


def book_image(fmt: str, portfolio: Portfolio, attrs: dict):
    """A portfolio's file in any of the formats (pricer/io/formats.py), `attrs` recorded in it:
    HDF5's /portfolio attributes, a CSV's leading `# key: value` lines, Parquet's metadata."""
    if fmt == HDF5:
        return portfolio_image(portfolio, attrs=attrs)
    columns = {f.name: getattr(portfolio, f.name) for f in fields(portfolio)
               if getattr(portfolio, f.name) is not None}
    return table_bytes(fmt, columns, {"schema": SCHEMA, **attrs}, {})


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
    """`pricer generate`: the book of args, checked before any work (settings, output path,
    memory), its output claimed until it is written (claimed), its room checked before the
    write; prints what it wrote."""
    check_output_file(args.output, args.overwrite, "portfolio")
    fmt = output_format(args.output, "portfolio")
    check_settings(args.dist, args.count, args.seed, args.steps, args.exercise, args.min_steps,
                   args.max_steps)
    check_memory(args.count, GENERATE_BYTES_PER_OPTION)
    spec = {"dist": args.dist, "count": args.count, "seed": args.seed, "steps": args.steps,
            "exercise": args.exercise, "min_steps": args.min_steps, "max_steps": args.max_steps}
    market_prices = getattr(args, "market_prices", False)
    if market_prices:
        spec["market_prices"] = True
    # the arguments that decide the book, not the command line: the same book is the same bytes
    # under any name
    # (generate_args, not a job's generated_by: a job replaces only the books it made itself)
    attrs = {"generate_args": json.dumps(spec, sort_keys=True), "pricer_version": __version__}
    with claimed(args.output, args.overwrite, "portfolio"):
        portfolio = generate(args.dist, args.count, args.seed, steps=args.steps,
                             exercise=args.exercise, min_steps=args.min_steps,
                             max_steps=args.max_steps)
        if market_prices:    # the pricing is the long part: the room is checked before it
            check_room(args.output, len(book_image(fmt, portfolio, attrs)), "portfolio")
            with_market_prices(portfolio)
        write_image(args.output, book_image(fmt, portfolio, attrs), "portfolio")
    print(f"wrote {args.output}: {len(portfolio)} options ({args.dist}, seed {args.seed}), "
          f"{portfolio.nodes():.4g} nodes", flush=True)
