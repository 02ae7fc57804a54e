"""`pricer.price`: a book priced in this process, for notebooks and services (no MPI).

    import pricer
    results = pricer.price(book, backend="auto", tree="crr", greeks=False)
    results = pricer.price("book.csv")             # a path (str or pathlib.Path) of any format
    frame = pricer.read_book("book.h5")            # the book itself, checked, as a DataFrame

With scenarios={...} (the scenario grid of `pricer price --scenario-*`), each option is also priced
under every scenario (pricer/model/scenarios.py), one column each.

`book` is the path of a book file (HDF5, CSV or Parquet, by extension: docs/formats.md), or a
pandas DataFrame, a dict of 1-D NumPy arrays or a NumPy structured array with the portfolio file's
columns (docs/formats.md: id, spot, strike, maturity, rate, volatility, steps,
call, american; dividend and tree optional). The result is a DataFrame with the columns id and
price, then delta, gamma, theta, vega and rho with greeks=True, in the book's order, then with
invalid="skip" the status of each option (0 priced; else why not, pricer/model/validity.py
REASONS: NaN prices), where invalid="refuse" (the default) refuses the whole book for one. The book goes
through the checks of `pricer price` (the same rules and messages, the book called "book"), and
bad input raises pricer.InputError, whose `column` and `ids` name the column and the offending
options' ids where the fault is in the book. Prices are bitwise those of `pricer price` on the
same book with the same backend and tree (an option's price does not depend on its chunk).
"""

from __future__ import annotations

import os

import numpy as np

from pricer.engines import get_engine
from pricer.errors import InputError, first_ids
from pricer.io.portfolio import ALL_COLUMNS, portfolio_from_columns
from pricer.model.scenarios import AXES
from pricer.run.checks import checked_rows
from pricer.run.config import RunConfig
from pricer.run.pricing import price_checked


_engines: dict = {}     # one engine per backend and overrides for the process: a GPU context, once


def price(book, backend: str = "auto", tree: str = "crr", greeks: bool = False,
          richardson: bool = False, invalid: str = "refuse", threads: int | None = None,
          source: str = "book", scenarios: dict | None = None):
    """The book's prices (and Greeks), as a pandas DataFrame; InputError for bad input. With
    `scenarios` (axis -> shifts, as a job file's [scenarios] table: {"spot": "-0.2:0.2:9",
    "volatility": [-0.05, 0.05]}), also each scenario's price, in columns "scenario:0",
    "scenario:1", ... after the others, and the scenarios' shifts as a DataFrame (spot,
    volatility, rate, days; a row per scenario) in the result's attrs["scenarios"]."""
    import pandas as pd

    source = _source(book, source)
    cfg = RunConfig(input=source, output=source, backend=backend, tree=tree, greeks=greeks,
                    richardson=richardson, threads=threads, invalid=invalid,
                    scenarios=scenarios).check()
    portfolio, values, status = _computed(cfg, book, source)
    analytics = cfg.analytics()
    out = pd.DataFrame({"id": portfolio.id,
                        **{name: values[:, j] for j, name in enumerate(analytics.outputs)},
                        **({"status": status} if cfg.invalid == "skip" else {})})
    if analytics.scenarios is not None:
        out.attrs["scenarios"] = pd.DataFrame(analytics.scenarios.shifts().copy(),
                                              columns=list(AXES))
    return out


def implied_volatility(book, backend: str = "auto", tree: str = "crr", invalid: str = "refuse",
                       threads: int | None = None, source: str = "book"):
    """Each option's implied volatility from its market price, on its lattice (the `pricer
    implied-vol` command's search, pricer/model/implied.py), as a pandas DataFrame: id,
    implied_volatility (NaN where the status is not 0), status (0 converged, else the reason:
    pricer.model.implied.REASONS, and with invalid="skip" pricer.model.validity.REASONS),
    iterations and price (the lattice price at the answer). `book` as for price(), with a
    market_price column; its volatility column, where given, is the search's start (NaN: none)."""
    import pandas as pd

    source = _source(book, source)
    cfg = RunConfig(input=source, output=source, backend=backend, tree=tree, threads=threads,
                    invalid=invalid, task="implied-vol").check()
    portfolio, values, _ = _computed(cfg, book, source)
    outputs = cfg.outputs()
    column = {name: values[:, j] for j, name in enumerate(outputs)}
    return pd.DataFrame({"id": portfolio.id, "implied_volatility": column["implied_volatility"],
                         "status": column["status"].astype(np.int8),
                         "iterations": np.nan_to_num(column["iterations"]).astype(np.int64),
                         "price": column["price"]})


def price_bonds(book, curves: dict | None = None, default: str | None = None,
                backend: str = "cpu", threads: int | None = None, source: str = "book",
                spacing: str = "variance"):
    """A book of bond options priced on their Hull–White trees (pricer/model/hw1f.py), as a pandas
    DataFrame of id and price in the book's order. `book`: the path (str or pathlib.Path) of an
    HDF5 book (its curves with it; `curves` given as well replace them), or of a CSV or Parquet
    table of the /bond_options columns, or such a DataFrame or dict of 1-D arrays (text columns as
    names: docs/formats.md); a table needs `curves`: {name: (times, zero rates)} or
    {name: hw1f.YieldCurve} (read_book's DataFrame of a bond book carries its own in
    attrs["curves"]), `default` the curve of rows that name none (the only one, where there is
    one). Bad input raises InputError naming the column and ids. `backend`: as for
    options (serial and cpu: the CPU engine; gpu, batch, hybrid: the GPU's; auto: the GPU's where
    one is usable). `spacing`: the trees' node spacing (pricer.model.hw1f.SPACINGS; `pricer price
    --bond-spacing`)."""
    import pandas as pd

    from pricer.engines import get_engine
    from pricer.io.bonds import book_from_columns, read_bond_book

    engine = get_engine(backend, "bonds")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise InputError(f"threads must be a whole number >= 1, got {threads!r}")
    source = _source(book, source)
    if _is_path(book) and curves is None and _format(book) == "hdf5":
        bonds = read_bond_book(source)
    else:
        if _is_path(book):
            book = _bond_table(source, curves)
        if curves is None and hasattr(book, "attrs") and "curves" in book.attrs:
            curves = book.attrs["curves"]
        if curves is None:
            raise InputError(f"{source}: a table of bond options needs its curves (curves="
                             f"{{name: (times, rates)}}); an HDF5 book carries them in /curves")
        bonds = book_from_columns(book, curves, default, source)
    _check_bond_memory(bonds, source)
    if threads is not None:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    prices = engine.price(bonds.parameters(spacing=spacing))
    wrong = ~np.isfinite(prices)
    if wrong.any():     # the bounds of bond_book.check_columns should make this unreachable
        raise InputError(f"{source}: the Hull–White trees of instrument id(s) "
                         f"{first_ids(bonds.id, wrong)} gave no finite value", ids=bonds.id[wrong])
    return pd.DataFrame({"id": bonds.id, "price": prices})


def price_file(input, output, backend: str = "auto", progress: bool = False, **settings):
    """The run of `pricer price INPUT -o OUTPUT` in this process: every family the file holds
    (its /portfolio of options, its /bond_options, a plug-in family's group: pricer/run/
    families.py) priced and written to `output` (HDF5, CSV or Parquet) as the command writes it.
    `settings`: the command's, by RunConfig's names (greeks, tree, invalid, checkpoint,
    overwrite, threads, ...). Returns the run's summary (its `record()`: the data of
    --summary-json); bad input raises InputError naming the cause, and nothing is written."""
    import dataclasses

    from pricer.run.collectives import BadInput, keep_refusals
    from pricer.run.driver import run

    known = {f.name for f in dataclasses.fields(RunConfig)} - {"input", "output"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise InputError(f"price_file: unknown setting(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    cfg = RunConfig(input=str(input), output=str(output), backend=backend, progress=progress,
                    **settings)
    with keep_refusals() as refusals:
        try:
            return run(cfg.check())
        except SystemExit as exc:   # the run's verdict: bad input (2) or a failure (1)
            if isinstance(exc, BadInput) and exc.code == 2 and refusals:
                found = [r for r in refusals if isinstance(r, InputError)]
                raise (found[-1] if found else InputError(refusals[-1])) from None
            raise RuntimeError(f"the run of {input} failed (its message is above, on stderr); "
                               f"nothing was written to {output}") from None


def read_book(path, kind: str | None = None, invalid: str = "refuse"):
    """The book in the file at `path` (str or pathlib.Path; HDF5, CSV or Parquet by extension),
    checked as `pricer price` checks it (InputError naming the column and ids), as a pandas
    DataFrame of its columns in the file's order of rows. `kind`: "options" (/portfolio, or a
    CSV/Parquet book), "bonds" (/bond_options: text columns as names, every row's curve named,
    the curves in attrs["curves"] as {name: (times, rates)}, so that price_bonds(frame) prices
    it), or None: the options where the
    file has them, else its bonds. invalid="skip": rows whose values break a rule are kept (their
    prices would be NaN with a status), as `--invalid skip` reads them."""
    import pandas as pd

    from pricer.files import check_input_file
    from pricer.io.bonds import has_bond_options
    from pricer.io.formats import read_book as read_options

    if not _is_path(path):
        raise InputError(f"read_book takes a file's path (str or pathlib.Path), not "
                         f"{type(path).__name__}")
    if invalid not in ("refuse", "skip"):
        raise InputError(f"invalid must be 'refuse' or 'skip', got {invalid!r}")
    source = os.fspath(path)
    if kind not in (None, "options", "bonds"):
        raise InputError(f"kind must be 'options', 'bonds' or None, got {kind!r}")
    check_input_file(source)      # a missing file, a FIFO, a folder: named before its kind
    bonds, options = has_bond_options(source)
    if kind == "bonds" or (kind is None and bonds and not options):
        if not bonds and _format(source) != "hdf5":
            raise InputError(f"{source}: read_book reads bond options from an HDF5 book, which "
                             f"holds their curves; a CSV or Parquet table of them is priced by "
                             f"price_bonds(path, curves=...) (docs/formats.md)")
        if not bonds:
            raise InputError(f"{source}: no /bond_options group (a book of bond options is an "
                             f"HDF5 file: docs/formats.md)")
        return _bond_frame(source, invalid)
    portfolio = read_options(source, values=invalid != "skip")
    return pd.DataFrame({name: getattr(portfolio, name) for name in ALL_COLUMNS
                         if getattr(portfolio, name) is not None})


def _is_path(book) -> bool:
    return isinstance(book, (str, os.PathLike))


def _source(book, source: str) -> str:
    """The name messages give the book: its path where it is one."""
    return os.fspath(book) if _is_path(book) else source


def _format(path) -> str:
    from pricer.io.formats import input_format
    return input_format(os.fspath(path))


def _bond_table(source: str, curves) -> "object":
    """A CSV or Parquet table of bond options, or an HDF5 book's /bond_options, as columns."""
    from pricer.io.formats import HDF5, read_table

    fmt = _format(source)
    if fmt == HDF5:
        return _bond_frame(source, "skip")
    return read_table(source, fmt)


def _bond_frame(source: str, invalid: str):
    """An HDF5 bond book's rows as a DataFrame (names for codes), its curves in attrs."""
    import pandas as pd

    from pricer.io.bonds import TEXT, read_bond_book
    from pricer.model.bond_book import BOND_COLUMNS

    bonds = read_bond_book(source, invalid=invalid)
    frame = pd.DataFrame({"id": bonds.id})
    for name in BOND_COLUMNS:
        values = bonds.columns[name]
        if name in TEXT or name == "curve":
            known = np.array(TEXT[name] if name in TEXT else bonds.curve_names, dtype=object)
            values = known[values]
        frame[name] = values
    # lists, not arrays: a DataFrame's attrs are kept by to_parquet only where JSON holds them
    frame.attrs["curves"] = {name: (curve.times.tolist(), curve.rates.tolist())
                             for name, curve in zip(bonds.curve_names, bonds.curves)}
    return frame


def _check_bond_memory(bonds, source: str) -> None:
    """InputError where the book's trees need more memory than this machine has available."""
    import numba

    from pricer.model.bond_book import tree_shapes
    from pricer.run.memory import GIB, available_bytes, bond_working_bytes

    steps, jmax, _ = tree_shapes(bonds.columns)
    need = bond_working_bytes(steps.sum() + steps.size, 2.0 * jmax.max(initial=0.0) + 1.0,
                              numba.get_num_threads())
    have = available_bytes()
    if need > have:
        raise InputError(f"{source}: its trees need ~{need / GIB:.2f} GiB of memory, this "
                         f"machine has {have / GIB:.2f} GiB available")


def _computed(cfg: RunConfig, book, source: str):
    """(portfolio, values, status) of `book` under `cfg` in this process: checked first (bad input
    is refused before any engine starts), then run/pricing.price_checked."""
    if _is_path(book):
        from pricer.io.formats import read_book as read_options
        portfolio = read_options(source, values=cfg.invalid != "skip")
    else:
        portfolio = portfolio_from_columns(book, source, values=cfg.invalid != "skip")
    checked = checked_rows(cfg, portfolio)
    engine = _engine(cfg)
    if cfg.threads is not None:
        import numba
        numba.set_num_threads(min(cfg.threads, numba.config.NUMBA_NUM_THREADS))
    values, status = price_checked(engine, cfg, checked, portfolio.id)
    return portfolio, values, status


def _engine(cfg: RunConfig):
    key = (cfg.backend, tuple(sorted(cfg.engine_overrides().items())))
    if key not in _engines:
        engine = get_engine(cfg.backend, **cfg.engine_overrides())
        engine.warm_up()
        _engines[key] = engine
    return _engines[key]
