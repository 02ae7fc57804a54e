"""pricer.price, the Python API: a DataFrame, a dict of arrays or a structured array in, a
DataFrame out; bitwise the command line's prices on the same book; the command line's checks and
messages, raised as pricer.InputError with the column and the ids."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import pricer
from gpu_cases import needs_gpu
from helpers import run_pricer
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from pricer.tools.generate import generate


def columns(portfolio) -> dict:
    return {name: value for name, value in asdict(portfolio).items() if value is not None}


def structured(book: dict) -> np.ndarray:
    array = np.empty(len(book["id"]), dtype=[(name, np.asarray(v).dtype) for name, v in
                                                book.items()])
    for name, value in book.items():
        array[name] = value
    return array


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """A random book with a tree column, as a file and as columns in memory."""
    rng = np.random.default_rng()
    portfolio = generate("random", 400, seed=int(rng.integers(1 << 30)), max_steps=600)
    trees = np.array(["crr", "jr", "lr", "tian"])
    portfolio.tree = trees[rng.integers(0, 4, len(portfolio))]
    path = tmp_path_factory.mktemp("api") / "book.h5"
    write_portfolio(str(path), portfolio)
    return path, columns(portfolio)


def cli_results(tmp_path, path, *flags) -> dict:
    out = tmp_path / "out.h5"
    proc = run_pricer(["price", path, "-o", out, "--quiet", *flags])
    assert proc.returncode == 0, proc.stderr
    return read_results(str(out))


@pytest.mark.parametrize("kind", ["dataframe", "dict", "structured"])
@pytest.mark.parametrize("backend,greeks", [("cpu", False), ("serial", True)])
def test_price_is_bitwise_the_command_lines(tmp_path, book, kind, backend, greeks):
    path, cols = book
    given = {"dataframe": pd.DataFrame(cols), "dict": cols, "structured": structured(cols)}[kind]
    got = pricer.price(given, backend=backend, greeks=greeks)
    want = cli_results(tmp_path, path, "--backend", backend, *(["--greeks"] if greeks else []))
    names = ["price"] + (["delta", "gamma", "theta", "vega", "rho"] if greeks else [])
    assert list(got.columns) == ["id"] + names
    assert np.array_equal(got["id"].to_numpy(), cols["id"])
    for name in names:
        assert got[name].to_numpy().tobytes() == want[name].tobytes(), name


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["batch", "hybrid"])
def test_price_on_the_gpu_is_bitwise_the_command_lines(tmp_path, book, backend):
    path, cols = book
    got = pricer.price(pd.DataFrame(cols), backend=backend)
    want = cli_results(tmp_path, path, "--backend", backend)
    assert got["price"].to_numpy().tobytes() == want["price"].tobytes()


def _bad(cols, column, rows, value):
    bad = {name: np.array(v, copy=True) for name, v in cols.items()}
    bad[column][rows] = value
    return bad


@pytest.mark.parametrize("edit,column", [
    (lambda c: _bad(c, "volatility", [3, 9], -0.2), "volatility"),
    (lambda c: _bad(c, "spot", [5], np.nan), "spot"),
    (lambda c: _bad(c, "steps", [0, 1], 0), "steps"),
    (lambda c: _bad(c, "id", [7], c["id"][8]), "id"),
    (lambda c: _bad(c, "tree", [2], "crrr"), "tree"),
    (lambda c: _bad(_bad(c, "tree", [4], "crr"), "rate", [4], 40.0), None),  # p outside (0, 1)
])
def test_bad_books_raise_the_command_lines_message(tmp_path, book, edit, column):
    path, cols = book
    bad = edit(cols)
    with pytest.raises(pricer.InputError) as raised:
        pricer.price(bad)
    error = raised.value
    assert error.column == column
    assert error.ids is not None and len(error.ids) >= 1
    assert set(error.ids.tolist()) <= set(bad["id"].tolist())
    file = tmp_path / "bad.h5"
    from pricer.io.portfolio import Portfolio
    write_portfolio(str(file), Portfolio(**bad))
    proc = run_pricer(["price", file, "-o", tmp_path / "o.h5"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"pricer: error: {error}".replace("book", str(file), 1), \
        (proc.stderr, str(error))


@pytest.mark.parametrize("given,needle", [
    ({"id": np.arange(3)}, "book: missing column(s) spot"),
    ("no-such-book.h5", "no-such-book.h5: no such file"),
    (42, "a book is a file's path (str or pathlib.Path), a pandas DataFrame, a dict of arrays or "
         "a NumPy structured array, not int"),
])
def test_malformed_books_are_named(given, needle):
    with pytest.raises(pricer.InputError, match=None) as raised:
        pricer.price(given)
    assert needle in str(raised.value)


def test_unknown_and_mistyped_columns(book):
    _, cols = book
    with pytest.raises(pricer.InputError) as raised:
        pricer.price(dict(cols, colour=np.zeros(len(cols["id"]))))
    assert raised.value.column == "colour" and "unknown column(s) colour" in str(raised.value)
    with pytest.raises(pricer.InputError) as raised:
        pricer.price(dict(cols, steps=cols["steps"].astype(float)))
    assert raised.value.column == "steps" and "expected integers" in str(raised.value)


def test_settings_are_checked_by_name(book):
    _, cols = book
    with pytest.raises(pricer.InputError, match="backend must be one of"):
        pricer.price(cols, backend="fast")
    with pytest.raises(pricer.InputError, match="invalid must be one of refuse"):
        pricer.price(cols, invalid="ignore")


def test_the_readmes_example_runs():
    from helpers import ROOT

    text = (ROOT / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    results = scope["results"]
    assert list(results.columns) == ["id", "price", "delta", "gamma", "theta", "vega", "rho"]
    assert abs(results["price"][0] - 6.0896) < 1e-3      # QuantLib's CRR: 6.089622 at N = 1000


@pytest.mark.parametrize("fmt", ["h5", "csv", "parquet"])
@pytest.mark.parametrize("as_path", [str, Path])
def test_every_entry_point_takes_a_path_of_any_format(tmp_path, book, fmt, as_path):
    """price, implied_volatility and read_book take a book file's path, str or pathlib.Path, of
    every format: bitwise what the same book in memory gives (and `pricer price` on the file)."""
    path, cols = book
    file = tmp_path / f"book.{fmt}"
    if fmt == "h5":
        file = path
    else:
        frame = pd.DataFrame(cols)
        frame.to_csv(file, index=False, float_format="%.17g") if fmt == "csv" \
            else frame.to_parquet(file)
    read = pricer.read_book(as_path(file))
    assert list(read.columns) == list(cols)
    for name, values in cols.items():
        assert np.array_equal(read[name].to_numpy(), values), name
    got = pricer.price(as_path(file), backend="cpu")
    assert got["price"].to_numpy().tobytes() == \
        pricer.price(cols, backend="cpu")["price"].to_numpy().tobytes()
    market = dict(cols, market_price=got["price"].to_numpy(), volatility=cols["volatility"])
    if fmt == "h5":
        from pricer.io.portfolio import Portfolio
        write_portfolio(str(tmp_path / "market.h5"), Portfolio(**market))
        file = tmp_path / "market.h5"
    else:
        frame = pd.DataFrame(market)
        file = tmp_path / f"market.{fmt}"
        frame.to_csv(file, index=False, float_format="%.17g") if fmt == "csv" \
            else frame.to_parquet(file)
    vols = pricer.implied_volatility(as_path(file), backend="cpu")
    assert vols["implied_volatility"].to_numpy().tobytes() == \
        pricer.implied_volatility(market, backend="cpu")["implied_volatility"].to_numpy().tobytes()


def test_read_book_names_a_fault_as_the_command_line_does(tmp_path, book):
    """A bad file: InputError with the command line's message, the column and the ids; with
    invalid="skip" its rows come back to be judged one by one."""
    _, cols = book
    from pricer.io.portfolio import Portfolio
    file = tmp_path / "bad.h5"
    write_portfolio(str(file), Portfolio(**_bad(cols, "spot", [5], np.nan)))
    with pytest.raises(pricer.InputError) as raised:
        pricer.read_book(file)
    assert raised.value.column == "spot" and cols["id"][5] in raised.value.ids.tolist()
    proc = run_pricer(["price", file, "-o", tmp_path / "o.h5"])
    assert proc.returncode == 2 and proc.stderr.strip() == f"pricer: error: {raised.value}"
    assert np.isnan(pricer.read_book(file, invalid="skip")["spot"].to_numpy()[5])
    with pytest.raises(pricer.InputError, match="takes a file's path"):
        pricer.read_book(pd.DataFrame(cols))
    with pytest.raises(pricer.InputError, match="absent.csv: no such file"):
        pricer.read_book(tmp_path / "absent.csv", kind="bonds")
    pd.DataFrame(cols).to_csv(tmp_path / "table.csv", index=False)
    with pytest.raises(pricer.InputError, match=r"priced by price_bonds\(path, curves=...\)"):
        pricer.read_book(tmp_path / "table.csv", kind="bonds")


def test_bond_books_by_path_frame_and_table(tmp_path):
    """price_bonds takes the path (str or Path) of an HDF5 bond book; read_book gives its rows as
    a DataFrame that carries its curves, which price_bonds prices again, as it prices the same
    rows written to CSV or Parquet with those curves: bitwise the same prices every way, those of
    `pricer price` on the file. A table without curves is refused by name."""
    from pricer.tools.bond_datasets import write_dataset

    path = tmp_path / "bonds.h5"
    write_dataset(str(path), "R1", 60, 5, False)
    want = pricer.price_bonds(str(path))
    proc = run_pricer(["price", path, "-o", tmp_path / "out.h5", "--backend", "cpu", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    import h5py
    with h5py.File(tmp_path / "out.h5") as f:
        assert f["results/bonds/price"][()].tobytes() == want["price"].to_numpy().tobytes()
    frame = pricer.read_book(path)
    assert frame["id"].tolist() == want["id"].tolist() and set(frame.attrs["curves"]) == {"default"}
    assert frame["exercise"].isin(["european", "bermudan", "american"]).all()
    frame.to_csv(tmp_path / "bonds.csv", index=False, float_format="%.17g")
    frame.to_parquet(tmp_path / "bonds.parquet")
    for given, curves in ((Path(path), None), (frame, None),
                          (tmp_path / "bonds.csv", frame.attrs["curves"]),
                          (str(tmp_path / "bonds.parquet"), frame.attrs["curves"])):
        got = pricer.price_bonds(given, curves)
        assert got["price"].to_numpy().tobytes() == want["price"].to_numpy().tobytes(), given
    with pytest.raises(pricer.InputError, match="bonds.csv: a table of bond options needs its "
                                                "curves"):
        pricer.price_bonds(tmp_path / "bonds.csv")
