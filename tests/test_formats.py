"""Books and results as users keep them: CSV and Parquet inputs and outputs beside HDF5, results
that carry their units and their provenance, `pricer generate` recording its arguments, and
`pricer info` on every kind of file — through the real `pricer` command (and mpiexec)."""

from __future__ import annotations

import json
from dataclasses import fields

import h5py
import numpy as np
import pandas as pd
import pytest

from helpers import run_pricer
from pricer.io.formats import KNOWN
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import UNITS, read_results

FORMATS = ("h5", "csv", "parquet")


def book(rng, n: int = 40) -> Portfolio:
    """A fresh random book with a tree column, ids out of order."""
    return Portfolio(
        id=rng.permutation(np.arange(100, 100 + 3 * n, 3, dtype=np.int64)),
        spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n),
        maturity=rng.uniform(0.25, 2, n), rate=rng.uniform(0, 0.08, n),
        dividend=rng.uniform(0, 0.04, n), volatility=rng.uniform(0.15, 0.5, n),
        steps=rng.integers(2, 500, n), call=rng.random(n) < 0.5, american=rng.random(n) < 0.5,
        tree=np.array(["crr", "lr", "tian", "jr"])[rng.integers(0, 4, n)])


def frame(p: Portfolio) -> pd.DataFrame:
    return pd.DataFrame({f.name: getattr(p, f.name) for f in fields(p)
                         if getattr(p, f.name) is not None})


def write(p: Portfolio, path) -> None:
    """The book as the file `path`'s extension names: HDF5 by pricer, CSV and Parquet by pandas
    (as a user's own tools would write them)."""
    suffix = str(path).rsplit(".", 1)[1]
    if suffix == "h5":
        write_portfolio(str(path), p)
    elif suffix == "csv":
        frame(p).to_csv(path, index=False)
    else:
        frame(p).to_parquet(path)


def ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc


def refused(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


@pytest.mark.parametrize("out", FORMATS)
def test_every_input_and_output_format_prices_the_same_bits(tmp_path, rng, out):
    """The same book as HDF5, CSV and Parquet, priced with --greeks into each output format:
    bitwise the same prices and Greeks, ids in input order; CSV input also under mpiexec -n 2."""
    p = book(rng)
    prices = {}
    for fmt in FORMATS:
        write(p, tmp_path / f"book.{fmt}")
        target = tmp_path / f"from-{fmt}.{out}"
        ok(run_pricer(["price", tmp_path / f"book.{fmt}", "-o", target, "--greeks",
                       "--backend", "cpu"]))
        prices[fmt] = read_results(str(target))
    target = tmp_path / f"mpi.{out}"
    ok(run_pricer(["price", tmp_path / "book.csv", "-o", target, "--greeks", "--backend", "cpu"],
                  ranks=2))
    prices["mpi"] = read_results(str(target))
    first = prices["h5"]
    assert np.array_equal(first["id"], p.id)
    for got in prices.values():
        for name in ("id", "price", "delta", "gamma", "theta", "vega", "rho"):
            assert np.array_equal(np.asarray(got[name]).view(np.int64),
                                  np.asarray(first[name]).view(np.int64)), name
    assert json.loads(prices["mpi"]["attrs"]["hosts"]) and prices["mpi"]["attrs"]["ranks"] in (2, "2")


@pytest.mark.parametrize("out", FORMATS)
def test_results_carry_units_and_provenance(tmp_path, rng, out):
    """Every column's unit; the command line, pricer's version, the libraries' versions, the
    hosts and GPUs, the input's hash, in each format."""
    write(book(rng), tmp_path / "book.h5")
    target = tmp_path / f"r.{out}"
    ok(run_pricer(["price", tmp_path / "book.h5", "-o", target, "--greeks", "--backend", "cpu"]))
    r = read_results(str(target))
    for name in ("id", "price", "delta", "gamma", "theta", "vega", "rho"):
        assert r["units"][name] == UNITS[name]
    assert r["units"]["theta"] == "currency per year"
    attrs = r["attrs"]
    assert "price" in attrs["command"] and str(target) in attrs["command"]
    assert attrs["pricer_version"] and attrs["schema"] == "pricer.results/1"
    libraries = json.loads(attrs["libraries"])
    assert {"numpy", "numba", "h5py", "mpi4py", "python"} <= set(libraries)
    assert libraries["numpy"] == np.__version__
    assert len(json.loads(attrs["hosts"])) == 1 and json.loads(attrs["gpus"]) == [""]
    assert len(attrs["input_sha256"]) == 64
    assert float(r["run"]["options"][0]) == 40


def test_unknown_formats_and_distribute_read_are_refused_by_name(tmp_path, rng):
    """A wrong or missing extension names the known formats; nothing is written; --distribute
    read needs HDF5; an HDF5 book with another extension is still read."""
    p = book(rng)
    write(p, tmp_path / "book.csv")
    refused(run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "out.txt"]),
            "out.txt", "unknown results format", KNOWN)
    refused(run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "out"]),
            "no extension", KNOWN)
    (tmp_path / "book.dat").write_text((tmp_path / "book.csv").read_text())
    refused(run_pricer(["price", tmp_path / "book.dat", "-o", tmp_path / "out.h5"]),
            "book.dat", "unknown file format", KNOWN)
    refused(run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "out.h5",
                        "--distribute", "read"]), "--distribute read needs an HDF5 portfolio")
    refused(run_pricer(["generate", "--dist", "random", "--count", "5", "-o",
                        tmp_path / "g.xlsx"]), "unknown portfolio format", KNOWN)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["book.csv", "book.dat"]
    write_portfolio(str(tmp_path / "book.data"), p)
    ok(run_pricer(["price", tmp_path / "book.data", "-o", tmp_path / "out.h5"]))


def _spoil(rows: dict):
    def edit(df: pd.DataFrame) -> pd.DataFrame:
        df = df.astype({name: object for name in rows})
        for name, (row, value) in rows.items():
            df.loc[row, name] = value
        return df
    return edit


HOSTILE_CSV = {
    "text-in-spot": (_spoil({"spot": (4, "abc")}), ["column spot", "'abc'", "option id 112",
                                                    "not a number"]),
    "empty-steps": (_spoil({"steps": (7, None)}), ["column steps is empty", "option id 121"]),
    "flag-word": (_spoil({"call": (2, "yes")}), ["column call", "'yes'", "true, false, 0 or 1"]),
    # a 2 among true/false words was read as false: a call priced as a put
    "flag-typo": (_spoil({"call": (2, 2)}), ["column call", "2", "true, false, 0 or 1"]),
    "negative-vol": (_spoil({"volatility": (3, -0.2)}), ["column volatility", "> 0",
                                                          "id(s) 109"]),
    "missing-column": (lambda df: df.drop(columns=["strike"]), ["missing column(s) strike"]),
    "unknown-column": (lambda df: df.assign(notional=1.0), ["unknown column(s) notional"]),
    "duplicate-ids": (lambda df: df.assign(id=np.r_[df.id[:1], df.id[:-1]]),
                      ["column id", "duplicate"]),
    "header-only": (lambda df: df.head(0), ["the portfolio is empty"]),
    "unknown-tree": (_spoil({"tree": (5, "binomial")}), ["unknown tree name(s) 'binomial'",
                                                         "id(s) 115"]),
}


@pytest.mark.parametrize("case", list(HOSTILE_CSV), ids=list(HOSTILE_CSV))
def test_hostile_csv_books_exit_2_naming_the_cell(tmp_path, case):
    spoil, needles = HOSTILE_CSV[case]
    p = book(np.random.default_rng(3))
    p.id = np.arange(100, 100 + 3 * len(p), 3, dtype=np.int64)   # row r has id 100 + 3 r
    spoil(frame(p)).to_csv(tmp_path / "book.csv", index=False)
    refused(run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "out.h5"]), *needles)
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("name", ["empty.csv", "binary.csv", "broken.parquet"])
def test_files_that_are_not_tables_exit_2(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"" if name == "empty.csv" else bytes(range(256)) * 40)
    proc = run_pricer(["price", path, "-o", tmp_path / "out.h5"])
    refused(proc, name)
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_records_its_arguments_and_info_reads_every_file(tmp_path, fmt):
    """`pricer generate` writes each format with its arguments in it; `pricer info` shows every
    column's range and the trees of a book, and reads the results of --invalid skip in each
    format with their units and status counts."""
    target = tmp_path / f"g.{fmt}"
    ok(run_pricer(["generate", "--dist", "skewed", "--count", "30", "--seed", "4", "-o", target]))
    info = ok(run_pricer(["info", target])).stdout
    for column in ("id", "steps N", "spot", "strike", "maturity", "rate", "dividend",
                   "volatility"):
        assert f"  {column}: min" in info, column
    assert '"dist": "skewed"' in info and '"seed": 4' in info and "generate" in info
    if fmt == "h5":
        with h5py.File(target) as f:
            assert json.loads(f["portfolio"].attrs["generate_args"])["count"] == 30
    p = book(np.random.default_rng(5))
    p.volatility[3] = np.nan
    write(p, tmp_path / f"bad.{fmt}")
    out = tmp_path / f"res.{fmt}"
    ok(run_pricer(["price", tmp_path / f"bad.{fmt}", "-o", out, "--invalid", "skip"]))
    info = ok(run_pricer(["info", out])).stdout
    assert "price: min" in info and "[currency of spot and strike]" in info
    assert "0 (priced) 39" in info and "1 (a value is NaN" in info
    assert "crr" in ok(run_pricer(["info", tmp_path / f"bad.{fmt}"])).stdout


def test_a_csv_book_from_a_spreadsheet(tmp_path):
    """Hand-written CSV: spaces after commas, true/false and 0/1 flags, no dividend or tree
    column; priced as the same book in HDF5."""
    (tmp_path / "book.csv").write_text(
        "id, spot, strike, maturity, rate, volatility, steps, call, american\n"
        "1, 100, 100, 1.0, 0.05, 0.2, 200, true, false\n"
        "2, 95.5, 100, 0.5, 0.03, 0.3, 101, 0, 1\n")
    ok(run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "csv.h5"]))
    write_portfolio(str(tmp_path / "book.h5"), Portfolio(
        id=np.array([1, 2]), spot=np.array([100.0, 95.5]), strike=np.array([100.0, 100.0]),
        maturity=np.array([1.0, 0.5]), rate=np.array([0.05, 0.03]), dividend=np.zeros(2),
        volatility=np.array([0.2, 0.3]), steps=np.array([200, 101]),
        call=np.array([True, False]), american=np.array([False, True])))
    ok(run_pricer(["price", tmp_path / "book.h5", "-o", tmp_path / "h5.h5"]))
    a, b = read_results(str(tmp_path / "csv.h5")), read_results(str(tmp_path / "h5.h5"))
    assert np.array_equal(a["price"], b["price"])


def test_a_row_that_starts_with_a_hash_is_named_not_dropped(tmp_path):
    """Only the leading `#` lines (a results file's provenance) are comments: a later row that
    starts with # is a fault (it was dropped, and the book priced without it)."""
    p = book(np.random.default_rng(8), n=6)
    text = frame(p).to_csv(index=False).splitlines()
    text[3] = "#" + text[3]
    (tmp_path / "book.csv").write_text("# a note\n" + "\n".join(text) + "\n")
    refused(run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "out.h5"]), "column id")
    assert not (tmp_path / "out.h5").exists()


def test_a_parquet_book_with_id_as_its_index(tmp_path):
    p = book(np.random.default_rng(9), n=8)
    frame(p).set_index("id").to_parquet(tmp_path / "book.parquet")
    write(p, tmp_path / "book.h5")
    for name in ("book.parquet", "book.h5"):
        ok(run_pricer(["price", tmp_path / name, "-o", tmp_path / f"{name}.h5"]))
    a, b = (read_results(str(tmp_path / f"{name}.h5")) for name in ("book.parquet", "book.h5"))
    assert np.array_equal(a["id"], p.id) and np.array_equal(a["price"], b["price"])


def test_a_job_never_replaces_a_book_made_by_pricer_generate(tmp_path):
    """`pricer generate` records generate_args; a job's portfolio.generate replaces only a book
    it made itself (generated_by), so a job pointed at a generated book is refused, not run."""
    book_path = tmp_path / "mine.h5"
    ok(run_pricer(["generate", "--dist", "random", "--count", "50", "--seed", "7", "-o",
                   book_path]))
    before = book_path.read_bytes()
    job = tmp_path / "job.toml"
    job.write_text(f'''[portfolio]
path = "{book_path}"
[portfolio.generate]
dist = "uniform"
count = 3
[output]
path = "{tmp_path / 'out.h5'}"
''')
    refused(run_pricer(["run", job]), "was not generated by pricer")
    assert book_path.read_bytes() == before
