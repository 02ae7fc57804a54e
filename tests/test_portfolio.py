"""The portfolio file: write/read round trip, what is accepted, and every validation error
(each must be an InputError whose message names the column and the first offending option ids)."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from pricer.errors import InputError
from pricer.model.lattice import TREE_NAMES
from pricer.io.portfolio import (ALL_COLUMNS, FLOAT_COLUMNS, METHOD_COLUMNS, OPTIONAL_COLUMNS, RUN_TREE,
                              SCHEMA, Portfolio, max_steps_for_memory,
                              read_portfolio, write_portfolio)

# ids that cannot be mistaken for anything else in a message (row numbers, counts, values)
IDS = np.array([7000101, 7000205, 7000307, 7000411, 7000513, 7000617, 7000719, 7000823], np.int64)
N = IDS.size


def valid_columns() -> dict:
    return {
        "id": IDS.copy(),
        "spot": np.linspace(90.0, 110.0, N),
        "strike": np.full(N, 100.0),
        "maturity": np.linspace(0.25, 2.0, N),
        "rate": np.full(N, 0.05),
        "dividend": np.full(N, 0.01),
        "volatility": np.linspace(0.1, 0.5, N),
        "steps": np.arange(100, 100 + N, dtype=np.int64),
        "call": np.arange(N) % 2 == 0,
        "american": np.arange(N) % 3 == 0,
    }


def write_raw(path, columns: dict, schema=SCHEMA, group="portfolio") -> str:
    """A portfolio file written directly with h5py, so it can be wrong in any way."""
    with h5py.File(path, "w") as f:
        g = f.create_group(group)
        if schema is not None:
            g.attrs["schema"] = schema
        for name, value in columns.items():
            g.create_dataset(name, data=value)
    return str(path)


def error_of(path) -> str:
    with pytest.raises(InputError) as info:
        read_portfolio(str(path))
    return str(info.value)


def message_without_path(path, message: str) -> str:
    return message.replace(str(path), "<file>")


def random_portfolio(rng, n: int, trees: bool = True) -> Portfolio:
    return Portfolio(
        id=rng.permutation(np.arange(10 * n, dtype=np.int64))[:n],
        spot=rng.uniform(50, 150, n), strike=rng.uniform(50, 150, n), maturity=rng.uniform(0.1, 5, n),
        rate=rng.uniform(-0.01, 0.1, n), dividend=rng.uniform(0, 0.05, n),
        volatility=rng.uniform(0.05, 1.0, n), steps=rng.integers(1, 100_000, n),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5,
        tree=rng.choice(TREE_NAMES, n) if trees else None)


# ----------------------------------------------------------------------------------------- round trip

def test_write_read_round_trip(tmp_path, rng):
    original = random_portfolio(rng, 257)
    original.market_price = rng.uniform(0.0, 50.0, 257)
    path = tmp_path / "book.h5"
    write_portfolio(str(path), original, attrs={"note": "round trip"})
    assert os.listdir(tmp_path) == ["book.h5"]  # no temporary file left beside it
    with h5py.File(path, "r") as f:
        assert f["portfolio"].attrs["schema"] == SCHEMA
        assert f["portfolio"].attrs["note"] == "round trip"
        assert set(f["portfolio"]) == set(ALL_COLUMNS)
    back = read_portfolio(str(path))
    for name in ALL_COLUMNS:
        got, want = getattr(back, name), getattr(original, name)
        assert np.array_equal(got, want), name
    assert back.id.dtype == np.int64 and back.steps.dtype == np.int64
    assert back.call.dtype == bool and back.american.dtype == bool
    assert all(getattr(back, c).dtype == np.float64 for c in FLOAT_COLUMNS)
    assert len(back) == 257 and back.nodes() == pytest.approx(
        float(((original.steps + 1.0) * (original.steps + 2.0) / 2).sum()), rel=1e-15)


def test_write_read_round_trip_without_tree_column(tmp_path, rng):
    original = random_portfolio(rng, 31, trees=False)
    path = tmp_path / "book.h5"
    write_portfolio(str(path), original)
    with h5py.File(path, "r") as f:
        assert set(f["portfolio"]) == set(ALL_COLUMNS) - {"tree", "market_price"}
    back = read_portfolio(str(path))
    assert back.tree is None and back.market_price is None
    assert np.array_equal(back.spot, original.spot) and back.take(np.arange(3)).tree is None


def test_method_columns(rng):
    """What a method receives: the book's columns, typed (steps int64, flags bool, floats
    float64), C-contiguous and writeable whatever the book's arrays were (a strided view, a
    read-only pandas column); the tree column as codes (positions in TREE_NAMES)."""
    p = random_portfolio(rng, 50)
    p.spot = np.repeat(p.spot, 2)[::2]          # a strided view
    p.strike.flags.writeable = False
    cols = p.columns()
    assert tuple(cols) == METHOD_COLUMNS == ("spot", "strike", "maturity", "rate", "dividend",
                                              "volatility", "steps", "call", "american", "tree")
    for name in METHOD_COLUMNS:
        assert cols[name].flags.c_contiguous and cols[name].flags.writeable, name
        if name != "tree":
            assert np.array_equal(cols[name], getattr(p, name)), name
    assert cols["steps"].dtype == np.int64 and cols["call"].dtype == bool
    assert cols["tree"].dtype == np.int64 and cols["spot"].dtype == np.float64
    assert [TREE_NAMES[code] for code in cols["tree"]] == p.tree.tolist()
    # the column wins over the run's tree
    assert np.array_equal(p.columns("lr")["tree"], cols["tree"])


def test_matrix_tree_codes_without_tree_column(rng):
    p = random_portfolio(rng, 20, trees=False)
    assert (p.columns()["tree"] == RUN_TREE).all()
    assert (p.columns("tian")["tree"] == TREE_NAMES.index("tian")).all()
    assert p.trees_used("jr") == ["jr"]
    p.tree = np.array(["lr", "crr"] * 10)
    assert p.trees_used("jr") == ["crr", "lr"]


def test_other_dtypes_accepted_and_converted(tmp_path):
    cols = valid_columns()
    cols["id"] = IDS.astype(np.uint32)
    cols["spot"] = cols["spot"].astype(np.float32)
    cols["strike"] = np.full(N, 100, dtype=np.int32)
    cols["steps"] = cols["steps"].astype(np.uint16)
    cols["call"] = cols["call"].astype(np.int8)
    cols["american"] = cols["american"].astype(np.uint8)
    p = read_portfolio(write_raw(tmp_path / "b.h5", cols))
    assert np.array_equal(p.id, IDS) and p.id.dtype == np.int64
    assert np.array_equal(p.spot, cols["spot"].astype(np.float64)) and p.spot.dtype == np.float64
    assert np.array_equal(p.strike, np.full(N, 100.0))
    assert p.steps.dtype == np.int64 and np.array_equal(p.steps, valid_columns()["steps"])
    assert np.array_equal(p.call, valid_columns()["call"]) and p.call.dtype == bool
    assert np.array_equal(p.american, valid_columns()["american"])


def test_dividend_is_optional_and_defaults_to_zero(tmp_path):
    cols = valid_columns()
    del cols["dividend"]
    p = read_portfolio(write_raw(tmp_path / "b.h5", cols))
    assert p.dividend.dtype == np.float64 and p.dividend.shape == (N,)
    assert (p.dividend == 0.0).all()
    assert np.array_equal(p.spot, cols["spot"])


def test_schema_as_bytes_and_negative_rates_accepted(tmp_path):
    cols = valid_columns()
    cols["rate"] = np.full(N, -0.01)      # any finite rate and dividend yield is allowed
    cols["dividend"] = np.full(N, -0.02)
    p = read_portfolio(write_raw(tmp_path / "b.h5", cols, schema=np.bytes_(SCHEMA.encode())))
    assert (p.rate == -0.01).all() and (p.dividend == -0.02).all()


# ---------------------------------------------------------------------------- file-level problems

def test_missing_file(tmp_path):
    path = tmp_path / "absent.h5"
    message = error_of(path)
    assert str(path) in message and "no such file" in message


def test_directory(tmp_path):
    (tmp_path / "dir.h5").mkdir()
    message = error_of(tmp_path / "dir.h5")
    assert "directory" in message


def test_not_hdf5(tmp_path):
    path = tmp_path / "book.h5"
    path.write_text("id,spot\n1,100\n")
    assert "not an HDF5 file" in error_of(path)


def test_no_portfolio_group(tmp_path):
    path = write_raw(tmp_path / "b.h5", valid_columns(), group="book")
    message = error_of(path)
    assert "/portfolio" in message and "no group" in message


def test_portfolio_is_a_dataset(tmp_path):
    path = tmp_path / "b.h5"
    with h5py.File(path, "w") as f:
        f["portfolio"] = np.arange(3)
    assert "no group /portfolio" in error_of(path)


@pytest.mark.parametrize("schema", ["pricer.portfolio/0", "pricer.results/1", None])
def test_wrong_or_missing_schema(tmp_path, schema):
    message = error_of(write_raw(tmp_path / "b.h5", valid_columns(), schema=schema))
    assert "schema" in message and repr(schema) in message


# ---------------------------------------------------------------------------- column-level problems

def test_unknown_column(tmp_path):
    cols = valid_columns()
    cols["delta"] = np.zeros(N)
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert "unknown column" in message and "delta" in message


@pytest.mark.parametrize("column", [c for c in ALL_COLUMNS if c not in OPTIONAL_COLUMNS])
def test_missing_column(tmp_path, column):
    cols = valid_columns()
    del cols[column]
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert "missing column" in message and column in message


@pytest.mark.parametrize("column", ["spot", "steps", "id", "call"])
def test_column_not_one_dimensional(tmp_path, column):
    cols = valid_columns()
    cols[column] = cols[column].reshape(N, 1)
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert f"column {column}" in message and "1-D" in message and f"({N}, 1)" in message


def test_scalar_column(tmp_path):
    cols = valid_columns()
    cols["volatility"] = np.float64(0.2)
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert "column volatility" in message and "1-D" in message


def test_column_is_a_group(tmp_path):
    path = tmp_path / "b.h5"
    cols = valid_columns()
    del cols["strike"]
    write_raw(path, cols)
    with h5py.File(path, "a") as f:
        f["portfolio"].create_group("strike")
    message = error_of(path)
    assert "strike" in message and "group" in message


@pytest.mark.parametrize("column", ["strike", "steps", "american", "dividend"])
def test_unequal_lengths(tmp_path, column):
    cols = valid_columns()
    cols[column] = cols[column][:-1]
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert f"column {column}" in message and f"{N - 1} rows" in message


@pytest.mark.parametrize("column,data", [
    ("spot", np.array([b"100.0"] * N)),
    ("volatility", np.array(["0.2"] * N, dtype=h5py.string_dtype())),
    ("id", IDS.astype(np.float64)),
    ("steps", np.full(N, 100.0)),
    ("call", np.zeros(N)),
    ("american", np.array([b"yes"] * N)),
], ids=["spot-bytes", "volatility-str", "id-float", "steps-float", "call-float", "american-bytes"])
def test_wrong_dtype(tmp_path, column, data):
    cols = valid_columns()
    cols[column] = data
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert f"column {column}" in message and "dtype" in message


def test_unsigned_ids_beyond_int64(tmp_path):
    cols = valid_columns()
    cols["id"] = np.array([2**63 + 5] + list(range(1, N)), dtype=np.uint64)
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert "column id" in message and "int64" in message


@pytest.mark.parametrize("column", ["call", "american"])
def test_flags_not_zero_or_one(tmp_path, column):
    cols = valid_columns()
    flags = cols[column].astype(np.int64)
    flags[3] = 2
    flags[5] = -1
    cols[column] = flags
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert f"column {column}" in message and "0/1" in message and "2" in message


@pytest.mark.parametrize("column", ["call", "american"])
def test_stored_booleans_other_than_0_or_1_are_refused(tmp_path, column):
    """An HDF5 boolean is a byte: a damaged one (7) is refused, not read as true."""
    cols = valid_columns()
    raw = cols[column].astype(np.uint8)
    raw[4] = 7
    cols[column] = raw.view(np.bool_)
    message = error_of(write_raw(tmp_path / "b.h5", cols))
    assert f"column {column}" in message and "0/1" in message and "7" in message


def test_empty_portfolio(tmp_path):
    cols = {name: value[:0] for name, value in valid_columns().items()}
    assert "empty" in error_of(write_raw(tmp_path / "b.h5", cols))


# ----------------------------------------------------------------------------- value-level problems

def check_names_ids(path, message: str, column: str, bad_rows) -> None:
    text = message_without_path(path, message)
    assert f"column {column}" in text, text
    for row in bad_rows:
        assert str(IDS[row]) in text, (row, text)
    for row in set(range(N)) - set(bad_rows):
        assert str(IDS[row]) not in text, (row, text)


def test_duplicate_ids(tmp_path):
    cols = valid_columns()
    cols["id"][5] = cols["id"][2]
    cols["id"][7] = cols["id"][0]
    path = write_raw(tmp_path / "b.h5", cols)
    message = error_of(path)
    assert "duplicate" in message
    check_names_ids(path, message, "id", [0, 2])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("column", FLOAT_COLUMNS)
def test_non_finite_values(tmp_path, column, bad):
    cols = valid_columns()
    cols[column][[2, 6]] = bad
    path = write_raw(tmp_path / "b.h5", cols)
    message = error_of(path)
    assert "NaN or infinite" in message
    check_names_ids(path, message, column, [2, 6])


@pytest.mark.parametrize("bad", [0.0, -1.5], ids=["zero", "negative"])
@pytest.mark.parametrize("column", ["spot", "strike", "maturity", "volatility"])
def test_non_positive_values(tmp_path, column, bad):
    cols = valid_columns()
    cols[column][[1, 4]] = bad
    path = write_raw(tmp_path / "b.h5", cols)
    message = error_of(path)
    assert "> 0" in message and repr(bad) in message
    check_names_ids(path, message, column, [1, 4])


@pytest.mark.parametrize("bad", [0, -5])
def test_steps_below_one(tmp_path, bad):
    cols = valid_columns()
    cols["steps"][[3, 7]] = bad
    path = write_raw(tmp_path / "b.h5", cols)
    message = error_of(path)
    assert ">= 1" in message
    check_names_ids(path, message, "steps", [3, 7])


def test_steps_too_large_for_memory(tmp_path):
    limit = max_steps_for_memory()
    cols = valid_columns()
    cols["steps"][0] = limit  # the largest accepted N: read, not priced, so no memory is used
    assert read_portfolio(write_raw(tmp_path / "ok.h5", cols)).steps[0] == limit
    cols["steps"][[0, 6]] = [limit + 1, 2**40]
    path = write_raw(tmp_path / "b.h5", cols)
    message = error_of(path)
    assert "memory" in message and str(limit) in message
    check_names_ids(path, message, "steps", [0, 6])


def test_many_bad_ids_are_summarised(tmp_path):
    cols = valid_columns()
    cols["maturity"][:] = -1.0
    path = write_raw(tmp_path / "b.h5", cols)
    message = message_without_path(path, error_of(path))
    assert "column maturity" in message
    assert all(str(i) in message for i in IDS[:5])
    assert f"and {N - 5} more" in message
    assert str(IDS[5]) not in message


# ----------------------------------------------------------------------------------- the tree column

def with_trees(trees) -> dict:
    cols = valid_columns()
    cols["tree"] = trees
    return cols


@pytest.mark.parametrize("dtype", ["vlen-str", "fixed-bytes", "vlen-bytes"])
def test_tree_column_accepted_as_strings(tmp_path, dtype):
    names = [TREE_NAMES[k % len(TREE_NAMES)] for k in range(N)]
    data = {"vlen-str": np.array(names, dtype=h5py.string_dtype("utf-8")),
            "fixed-bytes": np.array([n.encode() for n in names], dtype="S12"),
            "vlen-bytes": np.array([n.encode() for n in names], dtype=h5py.string_dtype("ascii")),
            }[dtype]
    p = read_portfolio(write_raw(tmp_path / "b.h5", with_trees(data)))
    assert p.tree.tolist() == names
    assert [TREE_NAMES[c] for c in p.columns()["tree"]] == names


def test_tree_column_write_read_round_trip(tmp_path):
    cols = valid_columns()
    p = Portfolio(**cols, tree=np.array(["joshi4", "crr", "ql-crr", "lr"] * 2))
    write_portfolio(str(tmp_path / "b.h5"), p)
    with h5py.File(tmp_path / "b.h5", "r") as f:
        assert h5py.check_string_dtype(f["portfolio"]["tree"].dtype).encoding == "utf-8"
    assert read_portfolio(str(tmp_path / "b.h5")).tree.tolist() == p.tree.tolist()


@pytest.mark.parametrize("data", [np.arange(N), np.zeros(N), np.ones(N, bool)],
                         ids=["int", "float", "bool"])
def test_tree_column_of_numbers_refused(tmp_path, data):
    message = error_of(write_raw(tmp_path / "b.h5", with_trees(data)))
    assert "column tree" in message and "dtype" in message and "strings" in message
    assert "ql-crr" in message  # the known names are listed


def test_tree_column_unequal_length(tmp_path):
    message = error_of(write_raw(tmp_path / "b.h5", with_trees(np.array(["crr"] * (N - 1), dtype="S3"))))
    assert "column tree" in message and f"{N - 1} rows" in message


@pytest.mark.parametrize("bad", ["CRR", "", "crr ", "quantlib", "binomial-lr"])
def test_unknown_tree_names_refused(tmp_path, bad):
    trees = np.array(["jr"] * N, dtype=object)
    trees[[1, 6]] = bad
    path = write_raw(tmp_path / "b.h5", with_trees(np.array(trees, dtype=h5py.string_dtype())))
    message = error_of(path)
    check_names_ids(path, message, "tree", [1, 6])
    assert "unknown tree name" in message and repr(bad) in message
    assert all(name in message for name in TREE_NAMES)


def test_unknown_tree_names_are_listed_once_and_summarised(tmp_path):
    trees = np.array([f"t{k % 7}" for k in range(N)], dtype=object)
    trees[0] = "lr"
    path = write_raw(tmp_path / "b.h5", with_trees(np.array(trees, dtype=h5py.string_dtype())))
    message = message_without_path(path, error_of(path))
    assert "'t1', 't2', 't3', 't4', 't5' and 2 more" in message, message
    assert str(IDS[0]) not in message and all(str(i) in message for i in IDS[1:6])
    assert f"and {N - 1 - 5} more" in message


def test_undecodable_tree_name_is_named(tmp_path):
    trees = np.array([b"crr"] * N, dtype="S6")
    trees[3] = b"l\xffr"
    path = write_raw(tmp_path / "b.h5", with_trees(trees))
    message = error_of(path)
    check_names_ids(path, message, "tree", [3])
    assert "\\\\xff" in message or "\\xff" in message


def test_lattice_check_names_the_bad_options_beyond_its_first_block(rng, monkeypatch):
    """Rank 0's lattice check goes block by block (BLOCK_ROWS, for the cache); its refusal still
    names every bad option of the MESSAGE_ROWS from the first bad block on, not of one block. The
    columns it passes on are the book's, typed as Portfolio.columns types them."""
    from pricer.errors import InputError
    from pricer.run import checks
    from pricer.run.config import RunConfig

    monkeypatch.setattr(checks, "BLOCK_ROWS", 4)
    monkeypatch.setattr(checks, "MESSAGE_ROWS", 16)
    cfg = RunConfig(input="book.h5", output="out.h5", backend="cpu")
    p = random_portfolio(rng, 40, trees=False)
    p.steps[:] = 50
    good = checks.checked_rows(cfg, p)
    want = p.columns("crr")
    assert good.cols.keys() == want.keys() and good.tree_names() == ["crr"]
    for name, column in want.items():
        assert good.cols[name].dtype == column.dtype and np.array_equal(good.cols[name], column)
    assert good.status is None
    bad = [5, 9, 14, 30]            # p > 1 on crr: a rate far above the volatility, one step
    p.rate[bad], p.volatility[bad], p.steps[bad] = 0.9, 0.01, 1
    with pytest.raises(InputError) as caught:
        checks.checked_rows(cfg, p)
    assert list(caught.value.ids) == list(p.id[[5, 9, 14]])     # row 30 is beyond the window
    assert str(caught.value).startswith("book.h5: the crr lattice is not arbitrage-free")
