"""Hypothesis strategies for malformed portfolio files: each case is a real file on disk
holding exactly one defect that pricer must refuse with exit code 2, plus the words its message must
contain. Shared by tests/mpi/test_fuzz.py (in-process on every rank) and tests/test_fuzz_cli.py
(real `mpiexec -n 3 pricer price` runs).

Every case starts from a valid book (random size, ids, accepted dtype variants, optional columns)
and breaks it one way, so the expected message is known: the test fails if pricer accepts the
file, exits with any other code, prints a traceback, or does not name the cause.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import h5py
import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from pricer.model.lattice import TREE_NAMES
from pricer.io.portfolio import ALL_COLUMNS, FLOAT_COLUMNS, OPTIONAL_COLUMNS, max_steps_for_memory

REQUIRED = [c for c in ALL_COLUMNS if c not in OPTIONAL_COLUMNS]
POSITIVE = ("spot", "strike", "maturity", "volatility")
INT_DTYPES = ("int16", "int32", "int64", "uint32", "uint64")
FLOAT_DTYPES = ("float32", "float64", "int32", "int64")  # integer types are accepted for floats


@dataclass
class Case:
    """One malformed input: `write(path)` makes the file; the message must contain every needle
    (a tuple of needles means: one of them)."""
    name: str
    write: Callable[[str], None]
    needles: list = field(default_factory=list)

    def __repr__(self) -> str:  # what a failure report shows
        return f"Case({self.name!r}, needles={self.needles!r})"


def base_columns(rng: np.random.Generator, n: int, tree: bool, dividend: bool) -> dict:
    """A valid book (every crr/lr/... lattice arbitrage-free at these inputs), as numpy columns."""
    cols = {
        "id": rng.permutation(np.arange(7, 7 + 13 * n, 13, dtype=np.int64)),
        "spot": rng.uniform(80, 120, n), "strike": rng.uniform(80, 120, n),
        "maturity": rng.uniform(0.25, 2, n), "rate": rng.uniform(0, 0.06, n),
        "volatility": rng.uniform(0.15, 0.5, n), "steps": rng.integers(20, 60, n),
        "call": rng.random(n) < 0.5, "american": rng.random(n) < 0.5}
    if dividend:
        cols["dividend"] = rng.uniform(0, 0.03, n)
    if tree:
        cols["tree"] = np.array([TREE_NAMES[k] for k in rng.integers(0, 3, n)], dtype=object)
    return cols


def write_columns(path: str, cols: dict, dtypes: dict, schema="pricer.portfolio/1",
                  group: str = "portfolio", extra=None) -> None:
    """Write `cols` as /GROUP datasets with the chosen dtypes; `extra(f, g)` spoils it further."""
    with h5py.File(path, "w") as f:
        g = f.create_group(group)
        if schema is not None:
            g.attrs["schema"] = schema
        for name, data in cols.items():
            if name == "tree" and np.asarray(data).dtype == object:
                g.create_dataset(name, data=data, dtype=h5py.string_dtype("utf-8"))
            else:
                g.create_dataset(name, data=np.asarray(data).astype(dtypes.get(name, None)
                                                                   or np.asarray(data).dtype))
        if extra is not None:
            extra(f, g)


@st.composite
def books(draw):
    """A valid book: (columns, dtypes) with random size, ids and accepted dtype variants."""
    n = draw(st.integers(1, 20))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cols = base_columns(rng, n, tree=draw(st.booleans()), dividend=draw(st.booleans()))
    dtypes = {"id": draw(st.sampled_from(INT_DTYPES)), "steps": draw(st.sampled_from(INT_DTYPES))}
    for name in FLOAT_COLUMNS:
        if name in cols and name in ("spot", "strike"):  # whole-number-safe columns only
            dtypes[name] = draw(st.sampled_from(FLOAT_DTYPES[:2]))
    for name in ("call", "american"):
        dtypes[name] = draw(st.sampled_from(("bool", "int8", "uint8", "int64")))
    return cols, dtypes


def _id(cols, row) -> str:
    return str(int(cols["id"][row]))


def _set(cols, name, row, value, dtype=None):
    data = np.array(cols[name], dtype=dtype or np.asarray(cols[name]).dtype)
    data[row] = value
    cols[name] = data


# ------------------------------------------------------------------- one defect per strategy

@st.composite
def missing_column(draw, cols, dtypes):
    name = draw(st.sampled_from(REQUIRED))
    del cols[name]
    return "missing-column", [f"missing column(s) {name}"], {}


@st.composite
def extra_column(draw, cols, dtypes):
    name = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True)
                .filter(lambda s: s not in ALL_COLUMNS))
    as_group = draw(st.booleans())
    n = len(cols["id"])
    extra = (lambda f, g: g.create_group(name)) if as_group else \
        (lambda f, g: g.create_dataset(name, data=np.zeros(n)))
    return "extra-column", ["unknown column(s)", name], {"extra": extra}


@st.composite
def column_is_group(draw, cols, dtypes):
    name = draw(st.sampled_from(REQUIRED))
    del cols[name]
    return "column-is-group", [f"/portfolio/{name} is a group"], \
        {"extra": lambda f, g: g.create_group(name)}


@st.composite
def no_group(draw, cols, dtypes):
    how = draw(st.sampled_from(("other-name", "dataset", "empty-file")))
    if how == "other-name":
        return "no-group", ["no group /portfolio"], {"group": "book"}
    if how == "dataset":
        def write(path):
            with h5py.File(path, "w") as f:
                f["portfolio"] = np.arange(3)
        return "portfolio-is-dataset", ["no group /portfolio"], {"write": write}

    def write_empty(path):
        h5py.File(path, "w").close()
    return "empty-hdf5", ["no group /portfolio"], {"write": write_empty}


@st.composite
def bad_schema(draw, cols, dtypes):
    schema = draw(st.one_of(st.none(), st.sampled_from(("pricer.portfolio/0", "pricer.portfolio/2",
                                                        "", "PRICER.PORTFOLIO/1")),
                            st.integers(-5, 5), st.just(np.array([b"pricer.portfolio/1"] * 2))))
    return "bad-schema", ["attribute schema"], {"schema": schema}


@st.composite
def wrong_dtype(draw, cols, dtypes):
    name = draw(st.sampled_from(ALL_COLUMNS))
    n = len(cols["id"])
    if name in ("id", "steps"):
        cols[name] = np.asarray(cols[name], dtype=np.float64)
        dtypes[name] = draw(st.sampled_from(("float32", "float64")))
        return "float-integers", [f"column {name} has dtype", "expected integers"], {}
    if name in ("call", "american"):
        if draw(st.booleans()):
            dtypes[name] = "float64"
            return "float-flags", [f"column {name} has dtype", "bool or 0/1"], {}
        row = draw(st.integers(0, n - 1))
        value = draw(st.sampled_from((2, -1, 7, 255)))
        _set(cols, name, row, value, dtype=np.int64)
        dtypes[name] = "int64"
        return "flag-not-0-1", [f"column {name} holds values other than 0/1", str(value)], {}
    if name == "tree":
        cols[name] = np.zeros(n, dtype=np.int64)
        return "numeric-tree", ["column tree has dtype", "expected strings"], {}
    kind = draw(st.sampled_from(("S8", "complex128", "compound")))
    if kind == "compound":
        cols[name] = np.zeros(n, dtype=[("a", "f8"), ("b", "i4")])
    else:
        cols[name] = np.asarray(cols.get(name, np.ones(n))).astype(kind)
    dtypes[name] = None
    return "wrong-float-dtype", [f"column {name} has dtype", "expected float64"], {}


@st.composite
def wrong_shape(draw, cols, dtypes):
    name = draw(st.sampled_from([c for c in cols if c != "tree"]))
    n = len(cols["id"])
    how = draw(st.sampled_from(("2d", "scalar", "length")))
    if how == "2d":
        cols[name] = np.repeat(np.asarray(cols[name])[:, None], draw(st.integers(1, 3)), axis=1)
        return "2d-column", [f"column {name} has shape", "expected a 1-D dataset"], {}
    if how == "scalar":
        cols[name] = np.asarray(cols[name])[0]
        return "scalar-column", [f"column {name} has shape ()"], {}
    if name == "id":  # the other columns are compared with id: shorten one of them instead
        name = "spot"
    other = draw(st.integers(0, n + 5).filter(lambda k: k != n))
    data = np.asarray(cols[name])
    cols[name] = np.resize(data, other) if other else data[:0]
    return "wrong-length", [f"column {name} has {other} rows"], {}


@st.composite
def non_finite(draw, cols, dtypes):
    name = draw(st.sampled_from(FLOAT_COLUMNS))
    row = draw(st.integers(0, len(cols["id"]) - 1))
    if name not in cols:
        cols[name] = np.zeros(len(cols["id"]))
    dtypes[name] = draw(st.sampled_from(("float32", "float64")))
    _set(cols, name, row, draw(st.sampled_from((np.nan, np.inf, -np.inf))), dtype=np.float64)
    return "non-finite", [f"column {name} is NaN or infinite", _id(cols, row)], {}


@st.composite
def not_positive(draw, cols, dtypes):
    name = draw(st.sampled_from(POSITIVE))
    row = draw(st.integers(0, len(cols["id"]) - 1))
    value = draw(st.one_of(st.just(0.0), st.floats(-1e300, -1e-300)))
    dtypes[name] = "float64"
    _set(cols, name, row, value, dtype=np.float64)
    return "not-positive", [f"column {name} must be > 0", _id(cols, row)], {}


@st.composite
def bad_steps(draw, cols, dtypes):
    row = draw(st.integers(0, len(cols["id"]) - 1))
    how = draw(st.sampled_from(("low", "absurd", "beyond-int64")))
    if how == "low":
        _set(cols, "steps", row, draw(st.integers(-2**63, 0)), dtype=np.int64)
        dtypes["steps"] = "int64"
        return "steps-below-1", ["column steps must be >= 1", _id(cols, row)], {}
    if how == "absurd":
        _set(cols, "steps", row, draw(st.integers(max_steps_for_memory() + 1, 2**63 - 1)),
             dtype=np.int64)
        dtypes["steps"] = "int64"
        return "absurd-steps", ["column steps is too large", "memory", _id(cols, row)], {}
    _set(cols, "steps", row, draw(st.integers(2**63, 2**64 - 1)), dtype=np.uint64)
    dtypes["steps"] = "uint64"
    return "steps-beyond-int64", ["column steps has values beyond int64"], {}


@st.composite
def duplicate_ids(draw, cols, dtypes):
    n = len(cols["id"])
    if n == 1:
        for name in cols:
            cols[name] = np.repeat(np.asarray(cols[name]), 2)
        n = 2
    a = draw(st.integers(0, n - 1))
    b = draw(st.integers(0, n - 1).filter(lambda k: k != a))
    _set(cols, "id", b, cols["id"][a])
    return "duplicate-ids", ["column id has duplicate ids", _id(cols, a)], {}


@st.composite
def empty_book(draw, cols, dtypes):
    draw(st.just(None))  # nothing to choose: every column loses its rows
    for name in cols:
        cols[name] = np.asarray(cols[name])[:0]
    return "empty", ["the portfolio is empty (0 options)"], {}


@st.composite
def unknown_tree(draw, cols, dtypes):
    n = len(cols["id"])
    name = draw(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                        max_size=12).filter(lambda s: s not in TREE_NAMES))
    row = draw(st.integers(0, n - 1))
    trees = np.array(list(cols.get("tree", ["crr"] * n)), dtype=object)
    trees[row] = name
    cols["tree"] = trees
    return "unknown-tree", ["column tree has unknown tree name(s)", _id(cols, row)], {}


@st.composite
def not_arbitrage_free(draw, cols, dtypes):
    row = draw(st.integers(0, len(cols["id"]) - 1))
    if "tree" in cols:
        del cols["tree"]
    _set(cols, "rate", row, draw(st.floats(0.5, 5.0)))
    _set(cols, "volatility", row, 0.01)
    _set(cols, "steps", row, 1)
    dtypes.update(rate="float64", volatility="float64")
    return "not-arbitrage-free", ["lattice is not arbitrage-free", _id(cols, row)], {}


def _valid_file(path, cols, dtypes):
    write_columns(path, cols, dtypes)


@st.composite
def truncated(draw, cols, dtypes):
    fraction = draw(st.floats(0.0, 0.999))

    def write(path):
        _valid_file(path, cols, dtypes)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(int(size * fraction))
    return "truncated", [("not an HDF5 file", "cannot read the file")], {"write": write}


@st.composite
def not_hdf5(draw, cols, dtypes):
    data = draw(st.one_of(st.binary(max_size=2048), st.text(max_size=200).map(
        lambda s: s.encode("utf-8", "surrogatepass"))))

    def write(path):
        with open(path, "wb") as f:
            f.write(data)
    return "not-hdf5", ["not an HDF5 file"], {"write": write}


@st.composite
def not_a_file(draw, cols, dtypes):
    if draw(st.booleans()):
        return "directory", ["is a directory"], {"write": os.mkdir}
    return "missing-file", ["no such file"], {"write": lambda path: None}


DEFECTS = (missing_column, extra_column, column_is_group, no_group, bad_schema, wrong_dtype,
           wrong_shape, non_finite, not_positive, bad_steps, duplicate_ids, empty_book,
           unknown_tree, not_arbitrage_free, truncated, not_hdf5, not_a_file)


@st.composite
def bad_portfolios(draw) -> Case:
    cols, dtypes = draw(books())
    defect = draw(st.sampled_from(DEFECTS))
    name, needles, how = draw(defect(cols, dtypes))
    write = how.get("write")
    if write is None:
        def write(path, cols=cols, dtypes=dtypes, how=how):
            write_columns(path, cols, dtypes, schema=how.get("schema", "pricer.portfolio/1"),
                          group=how.get("group", "portfolio"), extra=how.get("extra"))
    return Case(name, write, needles)


def draw_cases(count: int, seed_value: int) -> list[Case]:
    """`count` cases from hypothesis's generator (no shrinking: the cases run afterwards, under
    MPI, where only rank 0 draws); the seed makes the list reproducible."""
    cases: list[Case] = []

    @seed(seed_value)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(bad_portfolios())
    def collect(case):
        cases.append(case)

    collect()
    return cases


def message_problems(case: Case, path: str, stderr: str) -> list[str]:
    """What is wrong with rank 0's stderr for this case (empty: it names the cause)."""
    problems = []
    if stderr.count("pricer: error:") != 1 or "Traceback" in stderr:
        problems.append(f"stderr is not one error line: {stderr!r}")
    if path not in stderr:
        problems.append(f"message does not name the file {path}")
    for needle in case.needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        if not any(option in stderr for option in options):
            problems.append(f"message does not name {needle!r}: {stderr!r}")
    return problems
