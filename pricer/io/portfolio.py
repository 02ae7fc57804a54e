"""The portfolio — its HDF5 schema, reading, writing and validation with named reasons.

With `--distribute scatter|bcast` only rank 0 calls `read_portfolio`; the other ranks receive the
validated columns (`Portfolio.columns`, each in its own type), so they never open the input file.
With `--distribute read` every rank opens the file read-only: `read_index` (the id and steps
columns, enough to partition) and `read_portfolio_rows` (its own rows). The optional `tree` column
(tree names, strings in the file) travels as each name's code, its index in
`pricer.model.lattice.TREE_NAMES`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, fields

import h5py
import numpy as np

from pricer.errors import InputError, first_ids
from pricer.files import atomic_write, check_input_file
from pricer.model import option_rules
from pricer.model.cost import lattice_nodes
from pricer.model.lattice import TREE_NAMES, tree_codes

SCHEMA = "pricer.portfolio/1"
GROUP = "portfolio"

# Columns that travel to the workers, in matrix order. `id` stays on rank 0.
FLOAT_COLUMNS = ("spot", "strike", "maturity", "rate", "dividend", "volatility")
INT_COLUMNS = ("steps",)
FLAG_COLUMNS = ("call", "american")
TREE_COLUMN = "tree"
_COLUMN_TYPES = {"steps": np.int64, "call": bool, "american": bool}   # the others: float64
METHOD_COLUMNS = FLOAT_COLUMNS + INT_COLUMNS + FLAG_COLUMNS + (TREE_COLUMN,)
# An implied-volatility run's matrix (pricer implied-vol) has the market price before the tree.
MARKET_COLUMN = "market_price"
IMPLIED_METHOD_COLUMNS = METHOD_COLUMNS[:-1] + (MARKET_COLUMN, TREE_COLUMN)
OPTIONAL_DEFAULTS = {"dividend": 0.0}
# Optional columns: dividend (default 0), tree (absent: every option takes the run's --tree) and
# market_price (what `pricer implied-vol` solves for; a book with it may leave volatility out, a
# start where given: NaN where not).
OPTIONAL_COLUMNS = ("dividend", TREE_COLUMN, MARKET_COLUMN)
ALL_COLUMNS = ("id",) + METHOD_COLUMNS + (MARKET_COLUMN,)
# The tree code in the matrix of an option that takes the run's tree (no tree column, no default).
RUN_TREE = -1

# Working set of one option on the CPU engine: two value levels and two power tables of N+1 doubles.
BYTES_PER_STEP = 4 * 8


@dataclass
class Portfolio:
    id: np.ndarray
    spot: np.ndarray
    strike: np.ndarray
    maturity: np.ndarray
    rate: np.ndarray
    dividend: np.ndarray
    volatility: np.ndarray
    steps: np.ndarray
    call: np.ndarray
    american: np.ndarray
    tree: np.ndarray | None = None   # tree names (str), or None: the column is absent
    market_price: np.ndarray | None = None   # None: the column is absent

    def __len__(self) -> int:
        return int(self.id.shape[0])

    def tree_codes(self, default: str | None = None, unknown: int | None = None) -> np.ndarray:
        """Each option's tree as its code in TREE_NAMES: from the tree column where there is one,
        else `default`'s code (RUN_TREE, -1, if no default is given: the engines' caller decides);
        `unknown`: the code of a tree name that is not known (None: validate refused it)."""
        if self.tree is not None:
            return tree_codes(self.tree, unknown)
        code = RUN_TREE if default is None else TREE_NAMES.index(default)
        return np.full(len(self), code, dtype=np.int64)

    def trees_used(self, default: str) -> list[str]:
        """The names of the trees that price this portfolio when the run's tree is `default`."""
        return [TREE_NAMES[code] for code in np.unique(self.tree_codes(default))]

    def columns(self, default_tree: str | None = None, *, codes: np.ndarray | None = None,
                implied: bool = False) -> dict:
        """The columns an option method takes (name -> C-contiguous, writeable array, the book's
        own where it is one of the method's type already; one kind of array for every book, so
        that the compiled kernels are the same whatever the book came from, a read-only pandas
        column included): float64 values, steps int64, call and american bool, `codes`
        (tree_codes(default_tree), where the caller has not them) as the tree column, and with
        `implied` the market prices."""
        if codes is None:
            codes = self.tree_codes(default_tree)

        def typed(values, dtype):
            return np.require(np.asarray(values, dtype=dtype), requirements=["C", "W"])

        cols = {name: typed(getattr(self, name), _COLUMN_TYPES.get(name, float))
                for name in method_columns(implied)[:-1]}
        cols[TREE_COLUMN] = typed(codes, np.int64)
        return cols

    def take(self, index) -> "Portfolio":
        return Portfolio(**{f.name: None if getattr(self, f.name) is None
                            else getattr(self, f.name)[index] for f in fields(self)})

    def nodes(self) -> int:
        return int(lattice_nodes(self.steps).sum())


def method_columns(implied: bool = False) -> tuple:
    """The columns of the portfolio matrix, in order: an implied-volatility run's has the market
    prices too."""
    return IMPLIED_METHOD_COLUMNS if implied else METHOD_COLUMNS


def max_steps_for_memory() -> int:
    """The largest N whose per-option working set fits in half of this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(total // 2 // BYTES_PER_STEP) - 1


def write_portfolio(path: str, portfolio: Portfolio, attrs: dict | None = None) -> None:
    """Write a portfolio in the `pricer.portfolio/1` schema (atomically: temp file, then rename).
    The file is built in memory (portfolio_image) and written as plain bytes: a disk that fills
    during the write raises OSError and leaves nothing (files.atomic_write)."""
    atomic_write(path, portfolio_image(portfolio, attrs))


def portfolio_image(portfolio: Portfolio, attrs: dict | None = None) -> memoryview:
    """The bytes of the HDF5 file write_portfolio writes, made in memory (a view
    of its buffer, not a copy)."""
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        g = f.create_group(GROUP)
        g.attrs["schema"] = SCHEMA
        g.attrs.update(attrs or {})
        g.create_dataset("id", data=portfolio.id.astype(np.int64))
        for c in FLOAT_COLUMNS:
            if c == "volatility" and portfolio.market_price is not None \
                    and np.isnan(portfolio.volatility).all():
                continue          # a book of market prices without volatilities
            g.create_dataset(c, data=getattr(portfolio, c).astype(np.float64))
        g.create_dataset("steps", data=portfolio.steps.astype(np.int64))
        for c in FLAG_COLUMNS:
            g.create_dataset(c, data=getattr(portfolio, c).astype(bool))
        if portfolio.market_price is not None:
            g.create_dataset(MARKET_COLUMN, data=portfolio.market_price.astype(np.float64))
        if portfolio.tree is not None:
            g.create_dataset(TREE_COLUMN, data=np.asarray(portfolio.tree, dtype=object),
                             dtype=h5py.string_dtype("utf-8"))
    return image.getbuffer()


def read_portfolio(path: str, values: bool = True) -> Portfolio:
    """Read and validate a portfolio file; any problem raises InputError naming the cause.
    values=False: the structure only (--invalid skip judges the values option by option)."""
    return read_portfolio_rows(path, None, values)


def read_portfolio_rows(path: str, rows: np.ndarray | None, values: bool = True,
                        index: "PortfolioIndex | None" = None) -> Portfolio:
    """The options at row numbers `rows` (increasing; None: all), read and validated. Ids are
    checked for uniqueness among these rows only (read_index checks the whole column). `index`:
    the file's read_index (with values), whose id and steps are taken rather than read again."""
    known = ("id", "steps") if index is not None else ()
    raw = _with_file(path, lambda f: _read_columns(path, f, rows, known))
    if index is not None:
        every = rows is None or rows.size == len(index)     # increasing: then every row, in order
        raw["id"] = index.id if every else index.id[rows]
        raw["steps"] = index.steps if every else index.steps[rows]
    portfolio = Portfolio(**raw)
    validate(portfolio, path, values, indexed=index is not None)
    return portfolio


def portfolio_from_columns(book, source: str = "book", values: bool = True) -> Portfolio:
    """A book held in memory — a pandas DataFrame, a dict of 1-D arrays or a NumPy structured
    array with the file's columns — checked as read_portfolio checks a file, with the same
    messages (`source` where they name the file)."""
    if hasattr(book, "dtype") and getattr(book.dtype, "names", None):
        names, column = list(book.dtype.names), lambda name: book[name]
    elif hasattr(book, "columns") and hasattr(book, "__getitem__"):        # a DataFrame
        names, column = [str(c) for c in book.columns], lambda name: book[name].to_numpy()
    elif isinstance(book, dict):
        names, column = [str(c) for c in book], lambda name: book[name]
    else:
        raise InputError(f"{source}: a book is a file's path (str or pathlib.Path), a pandas "
                         f"DataFrame, a dict of arrays or a NumPy structured array, not "
                         f"{type(book).__name__}")
    unknown = sorted(set(names) - set(ALL_COLUMNS))
    if unknown:
        raise InputError(f"{source}: unknown column(s) {', '.join(unknown)}; known columns are "
                         f"{', '.join(ALL_COLUMNS)}", column=unknown[0])
    missing = _missing(names)
    if missing:
        raise InputError(f"{source}: missing column(s) {_named(missing)}", column=missing[0])
    raw, length = {}, None
    for name in (c for c in ALL_COLUMNS if c in names):
        data = np.asarray(column(name))
        if data.ndim != 1:
            raise InputError(f"{source}: column {name} has shape {data.shape}, expected 1-D",
                             column=name)
        if length is None:
            length = data.shape[0]
        elif data.shape[0] != length:
            raise InputError(f"{source}: column {name} has {data.shape[0]} rows, column id has "
                             f"{length}", column=name)
        raw[name] = _typed_column(source, name, data, None)
    if length == 0:
        raise InputError(f"{source}: the portfolio is empty (0 options)")
    _defaults(raw, length)
    portfolio = Portfolio(**raw)
    validate(portfolio, source, values)
    return portfolio


@dataclass
class PortfolioIndex:
    """What every rank needs to partition a portfolio without reading it: its id and steps
    columns, checked (ids unique, steps in range), and whether it has a tree column."""
    id: np.ndarray
    steps: np.ndarray
    has_tree: bool

    def __len__(self) -> int:
        return int(self.id.shape[0])


def read_index(path: str, values: bool = True) -> PortfolioIndex:
    """The file's structure checked as read_portfolio does, then only its id and steps columns
    (values=False: the steps column's rules are left to the caller: --invalid skip's statuses,
    or a run's checked_rows)."""
    def read(f):
        g, names = _checked_group(path, f)
        return PortfolioIndex(id=_typed_column(path, "id", g["id"], None),
                              steps=_typed_column(path, "steps", g["steps"], None),
                              has_tree=TREE_COLUMN in names)
    index = _with_file(path, read)
    _check_unique(index.id, path)
    if values:
        _check_steps(index.id, index.steps, path)
    return index


def _with_file(path: str, read):
    """read(f) on the open file, with a missing, unreadable or non-HDF5 file named."""
    check_input_file(path)
    if not h5py.is_hdf5(path):
        raise InputError(f"{path}: not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            return read(f)
    except InputError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        # RuntimeError: libhdf5 on corrupted metadata (e.g. "bad symbol table node signature")
        raise InputError(f"{path}: cannot read the file: {exc}") from None


def check_schema(path: str, group: h5py.Group, expected: str) -> None:
    """InputError unless `group`'s attribute schema is the string `expected`."""
    schema = group.attrs.get("schema")
    if isinstance(schema, bytes):
        schema = schema.decode("utf-8", "replace")
    # compare only a plain string: an array attribute would compare element-wise (found by fuzzing)
    if not isinstance(schema, str) or schema != expected:
        if isinstance(schema, np.ndarray):
            schema = f"an array of shape {schema.shape}"
        raise InputError(f"{path}: {group.name} attribute schema is {schema!r}, expected "
                         f"{expected!r}")


def _checked_group(path: str, f: h5py.File):
    """The /portfolio group and its column names, once the schema and the columns' names, shapes
    and lengths are right."""
    if GROUP not in f or not isinstance(f[GROUP], h5py.Group):
        raise InputError(f"{path}: no group /{GROUP} (expected schema {SCHEMA!r})")
    g = f[GROUP]
    check_schema(path, g, SCHEMA)
    unknown = sorted(set(g.keys()) - set(ALL_COLUMNS))
    if unknown:
        raise InputError(f"{path}: /{GROUP} has unknown column(s) {', '.join(unknown)}; "
                         f"known columns are {', '.join(ALL_COLUMNS)}")
    missing = _missing(g)
    if missing:
        raise InputError(f"{path}: /{GROUP} is missing column(s) {_named(missing)}")
    length = None
    names = [name for name in ALL_COLUMNS if name in g]
    for name in names:
        ds = g[name]
        if not isinstance(ds, h5py.Dataset):
            raise InputError(f"{path}: /{GROUP}/{name} is a group, expected a 1-D dataset")
        if ds.ndim != 1:
            raise InputError(f"{path}: column {name} has shape {ds.shape}, expected a 1-D dataset")
        if length is None:
            length = ds.shape[0]
        elif ds.shape[0] != length:
            raise InputError(f"{path}: column {name} has {ds.shape[0]} rows, column id has {length}")
    if length == 0:
        raise InputError(f"{path}: the portfolio is empty (0 options)")
    return g, names


def _read_columns(path: str, f: h5py.File, rows: np.ndarray | None, known=()) -> dict:
    """The columns at `rows`, typed and checked, but for the `known` ones (the caller has them)."""
    g, names = _checked_group(path, f)
    raw = {name: _typed_column(path, name, g[name], rows) for name in names if name not in known}
    _defaults(raw, g["id"].shape[0] if rows is None else rows.size)
    return raw


def _missing(names) -> list:
    """The required columns not in `names`: all but the optional ones, and volatility where the
    market price is given (it is then only a start for the implied volatility)."""
    return [c for c in ALL_COLUMNS if c not in names and c not in OPTIONAL_COLUMNS
            and not (c == "volatility" and MARKET_COLUMN in names)]


def _named(missing: list) -> str:
    """The missing columns, as a message names them."""
    names = ", ".join(missing)
    return names + (" (or market_price, whose volatilities `pricer implied-vol` solves for)"
                    if "volatility" in missing else "")


def _defaults(raw: dict, count: int) -> None:
    """The optional columns' defaults, where absent; a volatility left out (a book of market
    prices) is NaN, no start."""
    for name, default in {**OPTIONAL_DEFAULTS, "volatility": np.nan}.items():
        if name not in raw:
            raw[name] = np.full(count, default)


def _rows_of(ds, rows: np.ndarray | None, text: bool = False) -> np.ndarray:
    """ds's values at `rows` (increasing row numbers; None: all): one read of the stretch they
    span, then a take where they are not contiguous."""
    source = ds.asstr(errors="backslashreplace") if text else ds
    if rows is None:
        return source[()]
    if rows.size == 0:
        return source[0:0]
    first, last = int(rows[0]), int(rows[-1]) + 1
    data = source[first:last]
    return data if last - first == rows.size else data[rows - first]


def _typed_column(path: str, name: str, ds: h5py.Dataset, rows: np.ndarray | None) -> np.ndarray:
    kind = ds.dtype.kind
    if name == TREE_COLUMN and isinstance(ds, np.ndarray):    # a book in memory (pricer.price)
        if kind not in "USO" or kind == "O" and not all(isinstance(v, str) for v in ds.tolist()):
            raise InputError(f"{path}: column tree has dtype {ds.dtype}, expected strings "
                             f"(tree names: {', '.join(TREE_NAMES)})", column=TREE_COLUMN)
        return np.asarray(ds, dtype=str)
    if name == TREE_COLUMN:
        if h5py.check_string_dtype(ds.dtype) is None:
            raise InputError(f"{path}: column tree has dtype {ds.dtype}, expected strings "
                             f"(tree names: {', '.join(TREE_NAMES)})")
        # undecodable bytes become escapes, so validate() names them as unknown tree names
        return np.array(np.asarray(_rows_of(ds, rows, text=True)).tolist(), dtype=str)
    if name in ("id", "steps"):
        if kind not in "iu":
            raise InputError(f"{path}: column {name} has dtype {ds.dtype}, expected integers",
                             column=name)
        data = _rows_of(ds, rows)
        if kind == "u" and data.size and data.max() > np.iinfo(np.int64).max:
            raise InputError(f"{path}: column {name} has values beyond int64", column=name)
        return data.astype(np.int64, copy=False)
    if name in FLAG_COLUMNS:
        if kind not in "biu":
            raise InputError(f"{path}: column {name} has dtype {ds.dtype}, expected bool or 0/1",
                             column=name)
        data = _rows_of(ds, rows)
        # a stored boolean is a byte: one other than 0 or 1 (a damaged file) is not read as true
        values = data.view(np.uint8) if kind == "b" else data
        # integers: all 0 or 1 where they lie in [0, 1] (two reductions, not np.isin's compares)
        if values.size and not (values.min() >= 0 and values.max() <= 1):
            raise InputError(f"{path}: column {name} holds values other than 0/1: "
                             f"{np.unique(values[~np.isin(values, (0, 1))])[:5].tolist()}",
                             column=name)
        return data.astype(bool, copy=False)
    if kind not in "iuf":
        raise InputError(f"{path}: column {name} has dtype {ds.dtype}, expected float64",
                         column=name)
    return _rows_of(ds, rows).astype(np.float64, copy=False)   # a copy only to convert


def _check_unique(ids: np.ndarray, source: str) -> None:
    # ids in increasing order (as generated books have them) are unique without np.unique's sort
    # or hash, a sizeable share of rank 0's read of a large book
    if (ids[1:] > ids[:-1]).all():
        return
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = unique[counts > 1]
        raise InputError(f"{source}: column id has duplicate ids: "
                         f"{first_ids(dup, np.ones(dup.size, bool))}", column="id", ids=dup)


def validate(p: Portfolio, source: str = "portfolio", values: bool = True,
             indexed: bool = False) -> None:
    """Value checks with named reasons: the book's rules of pricer/model/option_rules.py's table,
    the first one broken refused (those of the run's task, the market prices, are judged once
    the task is known: checks.checked_rows; lattice arbitrage, p in (0,1), in
    pricer/model/lattice.py). values=False: unique ids only (--invalid skip). `indexed`: the id
    and steps columns come from a read_index, which checked them whole."""
    if not indexed:
        _check_unique(p.id, source)
    if values:
        cols = vars(p)
        option_rules.refuse(cols, p.id, source, option_rules.rules(
            cols, None, without=("steps",) if indexed else ()), max_steps_for_memory())


def priced_steps(steps: np.ndarray) -> np.ndarray:
    """Steps where they can be priced, 0 where they cannot (they break a rule of the steps column:
    < 1, or beyond the memory): what a run with --invalid skip partitions and sizes by (its other
    faults it finds once it has the rows)."""
    cols = {"steps": np.asarray(steps).astype(np.int64, copy=False)}
    bad = option_rules.broken(cols, option_rules.rules(cols, None, columns=("steps",)),
                              max_steps_for_memory())
    return np.where(bad, 0, cols["steps"])


def _check_steps(ids: np.ndarray, steps: np.ndarray, source: str) -> None:
    """The rules of the steps column (option_rules), the first one broken refused."""
    cols = {"steps": steps}
    option_rules.refuse(cols, ids, source, option_rules.rules(cols, None, columns=("steps",)),
                        max_steps_for_memory())
