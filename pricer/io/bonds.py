"""Books of bond options (the Hull–White family, pricer/model/hw1f.py) in HDF5: the group
/bond_options (a column per dataset, a row per instrument) and the yield curves /curves/<name>
(datasets `times` and `rates`: continuously compounded zero rates), read and validated with named
reasons, or written atomically. docs/formats.md describes the schema.

Columns (bond_book.BOND_COLUMNS, with `id`): text columns hold names — exercise (european, bermudan,
american), product (option, callable, puttable; default option) and curve (a /curves name;
default the file's default curve: the attribute `default` of /curves, or its only curve);
exercise_frequency may be left out where no row is bermudan.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import h5py
import numpy as np

from pricer.errors import InputError, first_ids
from pricer.files import atomic_write, check_input_file
from pricer.io.portfolio import check_schema
from pricer.model import bond_book, hw1f

SCHEMA = "pricer.bond_options/1"
GROUP, CURVES = "bond_options", "curves"
TEXT = {"exercise": hw1f.EXERCISES, "product": hw1f.PRODUCTS}
INTEGER = ("frequency",)
FLAGS = ("call",)
OPTIONAL = {"product": "option", "exercise_frequency": 0.0, "curve": ""}


@dataclass
class BondBook:
    """A book of bond options: ids, the columns as hw1f takes them (text as codes, the curve as an
    index into `curves`), the curves with their names, and each row's status (0: to be priced;
    else, read with invalid="skip", the first rule it breaks: bond_book.REASONS)."""
    id: np.ndarray
    columns: dict
    curves: list
    curve_names: list
    status: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.id.size)

    def parameters(self, spacing: str = hw1f.SPACING) -> bond_book.HullWhiteParams:
        """The trees of the rows to be priced, spaced by `spacing` (hw1f.SPACINGS)."""
        if self.status is not None and self.status.any():
            keep = self.status == 0
            return bond_book.tree_parameters({k: v[keep] for k, v in self.columns.items()},
                                             self.curves, self.id[keep], spacing=spacing)
        return bond_book.tree_parameters(self.columns, self.curves, self.id, spacing=spacing)


def book_from_columns(columns: dict, curves: dict, default: str | None = None,
                      source: str = "book", invalid: str = "refuse") -> BondBook:
    """A BondBook from columns (a dict of 1-D arrays or a DataFrame: the file's columns, text as
    names) and curves ({name: (times, rates)} or {name: YieldCurve}), checked as a file is.
    invalid="skip": rows whose values break a rule of bond_book.check_columns are kept with their
    status instead of refusing the book (a column of the wrong type, names that are not known and
    duplicate ids still refuse it)."""
    if hasattr(columns, "to_dict") and hasattr(columns, "columns"):
        columns = {name: columns[name].to_numpy() for name in columns.columns}
    if not isinstance(columns, dict) or not isinstance(curves, dict):
        raise InputError(f"{source}: the columns and the curves must be tables (dicts)")
    names = [str(name) for name in curves]
    if not names:
        raise InputError(f"{source}: no yield curve")
    if len(set(names)) != len(names):
        raise InputError(f"{source}: curve names {names} repeat")
    order = sorted(range(len(names)), key=names.__getitem__)
    given = [curves[key] for key in curves]
    names, given = [names[k] for k in order], [given[k] for k in order]
    made = []
    for name, curve in zip(names, given):
        try:
            if isinstance(curve, hw1f.YieldCurve):
                made.append(curve)
                continue
            times, rates = curve
            if any(np.asarray(x).dtype.kind not in "iuf" for x in (times, rates)):
                raise InputError("its times and rates must be numbers")
            made.append(hw1f.YieldCurve(times, rates))
        except InputError as exc:
            raise InputError(f"{source}: curve {name!r}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise InputError(f"{source}: curve {name!r} must be (times, rates): {exc}") from None
    if default is not None and (not isinstance(default, str) or default not in names):
        raise InputError(f"{source}: the default curve {default!r} is not one of "
                         f"{', '.join(names)}")
    if default is None and len(names) == 1:
        default = names[0]
    _check_present(columns, source)
    _check_known(columns, source)
    ids = _ids(np.asarray(columns["id"]), source)
    n = ids.size
    import pandas as pd

    if not pd.Index(ids).is_unique:     # hashed: a sort of every id only where some repeat
        unique, counts = np.unique(ids, return_counts=True)
        raise InputError(f"{source}: duplicate id(s) {first_ids(unique, counts > 1)}",
                         column="id", ids=unique[counts > 1])
    cols = {}
    for name in bond_book.BOND_COLUMNS:
        raw = np.asarray(columns[name]) if name in columns else np.full(n, OPTIONAL[name])
        if raw.shape != (n,):
            raise InputError(f"{source}: column {name} must be 1-D with a value per id ({n}); "
                             f"it has shape {raw.shape}", column=name)
        cols[name] = _typed(raw, name, ids, source, names, default, invalid == "skip")
    if invalid == "skip":
        return BondBook(ids.astype(np.int64), cols, made, names, bond_book.statuses(cols, made))
    try:
        bond_book.check_columns(cols, made, ids)
    except InputError as exc:
        raise exc.prefixed(f"{source}: ") from None
    return BondBook(ids.astype(np.int64), cols, made, names, np.zeros(n, dtype=np.int8))


def _check_present(columns, source: str) -> None:
    """InputError naming the columns a book lacks (all but OPTIONAL's are needed)."""
    needed = [c for c in ("id",) + bond_book.BOND_COLUMNS if c not in columns and c not in OPTIONAL]
    if needed:
        raise InputError(f"{source}: missing column(s) {', '.join(needed)}", column=needed[0])


def _check_known(columns, source: str) -> None:
    """InputError naming the columns that are not the book's (a misspelt optional column would
    otherwise leave its default in force)."""
    unknown = sorted(set(map(str, columns)) - {"id", *bond_book.BOND_COLUMNS})
    if unknown:
        raise InputError(f"{source}: unknown column(s) {', '.join(unknown)}; known columns are "
                         f"id, {', '.join(bond_book.BOND_COLUMNS)}", column=unknown[0])


def _ids(ids: np.ndarray, source: str) -> np.ndarray:
    """The id column as int64: 1-D whole numbers within int64."""
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{source}: id must be a 1-D column of integers", column="id")
    if ids.dtype.kind == "u" and ids.size and ids.max() > np.iinfo(np.int64).max:
        big = ids > np.iinfo(np.int64).max
        raise InputError(f"{source}: id must be within int64; id(s) {first_ids(ids, big)}",
                         column="id", ids=ids[big])
    return ids.astype(np.int64)


def _factorize_short(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, uniques) of fixed-length byte strings of at most 8 bytes, as np.unique's inverse
    and values but in order of appearance: each string zero-padded to one 64-bit word and the
    words hashed (pandas.factorize), not sorted (a sort of millions of strings took most of a
    book's read). Trailing zero bytes are padding in a fixed-length string, so equal words are
    equal strings."""
    import pandas as pd

    width = raw.dtype.itemsize
    padded = np.zeros((raw.size, 8), dtype=np.uint8)
    padded[:, :width] = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.size, width)
    codes, words = pd.factorize(padded.view(np.uint64).ravel())
    uniques = np.ascontiguousarray(words, dtype=np.uint64).view(np.uint8).reshape(-1, 8)
    return codes, np.ascontiguousarray(uniques[:, :width]).view(raw.dtype).ravel()


def _typed(raw: np.ndarray, name: str, ids: np.ndarray, source: str, curves: list,
           default: str | None, skip: bool = False) -> np.ndarray:
    """A column as hw1f takes it: names as codes, flags as bool, numbers as float64 or int64.
    skip: a flag or whole-number column's values are kept as float64 for the rows' rules
    (bond_book.statuses) to judge, row by row."""
    if name in TEXT or name == "curve":
        import pandas as pd

        # a few names, many rows: each name decoded once
        if raw.dtype.kind == "S" and raw.dtype.itemsize <= 8:   # short bytes: hashed as words
            codes, uniques = _factorize_short(raw)
        elif raw.dtype.kind in "SU":    # fixed-length strings
            uniques, codes = np.unique(raw, return_inverse=True)
        else:                           # variable-length: Python objects, hashed
            codes, uniques = pd.factorize(raw, use_na_sentinel=False)
        decoded = []
        for k, v in enumerate(uniques):
            try:
                decoded.append(v.decode() if isinstance(v, bytes) else str(v))
            except UnicodeDecodeError:
                bad = codes == k
                raise InputError(f"{source}: column {name} holds text that is not UTF-8; "
                                 f"instrument id(s) {first_ids(ids, bad)}", column=name,
                                 ids=ids[bad]) from None
        text = np.array(decoded, dtype=object).astype(str)
        known = curves if name == "curve" else list(TEXT[name])
        if name == "curve":
            text = np.where(text == "", default if default is not None else "", text)
        bad = ~np.isin(text, known)[codes]
        if bad.any():
            what = "a curve of the file" if name == "curve" else f"one of {', '.join(known)}"
            raise InputError(f"{source}: {name} must name {what}; instrument id(s) "
                             f"{first_ids(ids, bad)} have {str(text[codes[bad][0]])!r}",
                             column=name, ids=ids[bad])
        return np.array([known.index(t) if t in known else -1 for t in text],
                        dtype=np.int64)[codes]
    if raw.dtype.kind not in "biuf":
        raise InputError(f"{source}: column {name} must be numbers, not {raw.dtype}",
                         column=name)
    if skip and (name in FLAGS or name in INTEGER):
        return (raw.view(np.uint8) if raw.dtype == np.bool_ else raw).astype(np.float64)
    if name in FLAGS:
        # a stored boolean is a byte: one other than 0 or 1 (a damaged file) is not read as true
        stored = raw.view(np.uint8) if raw.dtype == np.bool_ else raw
        flag = (stored == 0) | (stored == 1)
        if not flag.all():
            raise InputError(f"{source}: {name} must be true or false (1 or 0); instrument id(s) "
                             f"{first_ids(ids, ~flag)}", column=name, ids=ids[~flag])
        return raw.astype(bool)
    values = raw.astype(np.float64)
    if name in INTEGER:
        # within 2^53, where a float64 holds every whole number (and int64 holds it)
        whole = np.isfinite(values) & (values == np.rint(values)) & (np.abs(values) <= 2.0**53)
        if not whole.all():
            raise InputError(f"{source}: {name} must be whole numbers (at most 2^53); instrument "
                             f"id(s) {first_ids(ids, ~whole)} (first value "
                             f"{float(values[~whole][0])!r})", column=name, ids=ids[~whole])
        return values.astype(np.int64)
    return values


def read_bond_book(path: str, invalid: str = "refuse", rows: slice = slice(None)) -> BondBook:
    """Read and validate a book of bond options, or its rows `rows` (a run's rank reads its
    own); any problem raises InputError naming it (invalid="skip": see book_from_columns)."""
    columns, curves, default = _read(path, lambda f: {
        name: ds[rows] for name, ds in f[GROUP].items() if isinstance(ds, h5py.Dataset)})
    return book_from_columns(columns, curves, default, source=path, invalid=invalid)


# what a run's plan reads of every row: the ids, and what a tree's nodes follow from
INDEX_COLUMNS = ("id", "maturity", "steps_per_year", "mean_reversion")


def read_bond_index(path: str) -> dict:
    """The INDEX_COLUMNS of every row (numbers; float64 but the ids), with the book's shape
    checked: its groups, every column there with one value per id, ids whole and unique. The rows
    themselves are read and checked by read_bond_book."""
    def index(f):
        g = f[GROUP]
        _check_present(g, path)
        _check_known(g, path)
        shapes = {name: ds.shape for name, ds in g.items() if isinstance(ds, h5py.Dataset)}
        if len(shapes.get("id", ())) != 1:
            raise InputError(f"{path}: id must be a 1-D column of integers", column="id")
        n = shapes["id"][0]
        odd = [name for name, shape in shapes.items() if shape != (n,)]
        if odd:
            raise InputError(f"{path}: column {odd[0]} must be 1-D with a value per id ({n}); "
                             f"it has shape {shapes[odd[0]]}", column=odd[0])
        return {name: g[name][()] for name in INDEX_COLUMNS}

    out, _, _ = _read(path, index)
    ids = _ids(np.asarray(out["id"]), path)
    import pandas as pd

    if not pd.Index(ids).is_unique:     # hashed: a sort of every id only where some repeat
        unique, counts = np.unique(ids, return_counts=True)
        raise InputError(f"{path}: duplicate id(s) {first_ids(unique, counts > 1)}",
                         column="id", ids=unique[counts > 1])
    for name in INDEX_COLUMNS[1:]:
        if np.asarray(out[name]).dtype.kind not in "biuf":
            raise InputError(f"{path}: column {name} must be numbers, not {out[name].dtype}",
                             column=name)
        out[name] = np.asarray(out[name], dtype=np.float64)
    out["id"] = ids
    return out


def _read(path: str, columns):
    """(columns(f), curves, default curve name) of the book at path; InputError for a file
    that is not such a book."""
    check_input_file(path)
    if not h5py.is_hdf5(path):
        raise InputError(f"{path}: not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            if GROUP not in f or not isinstance(f[GROUP], h5py.Group):
                raise InputError(f"{path}: no /{GROUP} group")
            check_schema(path, f[GROUP], SCHEMA)
            if CURVES not in f or not isinstance(f[CURVES], h5py.Group):
                raise InputError(f"{path}: no /{CURVES} group (the yield curves)")
            read = columns(f)
            curves = {}
            for name, g in f[CURVES].items():
                if not (isinstance(g, h5py.Group) and "times" in g and "rates" in g):
                    raise InputError(f"{path}: /{CURVES}/{name} needs datasets times and rates")
                curves[name] = (g["times"][()], g["rates"][()])
            default = f[CURVES].attrs.get("default")
    except InputError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise InputError(f"{path}: cannot read the bond options: {exc}") from None
    if isinstance(default, bytes):
        try:
            default = default.decode()
        except UnicodeDecodeError:
            raise InputError(f"{path}: /{CURVES}'s default curve name is not UTF-8") from None
    return read, curves, default


def has_bond_options(path: str) -> tuple[bool, bool]:
    """(whether the file holds /bond_options, whether it holds /portfolio): what a run prices.
    A file that cannot be opened as HDF5 says (False, False), and the option run's read names
    the problem (a path that is not a regular file is never opened here: a FIFO never ends)."""
    import os

    try:
        if not isinstance(path, str) or not os.path.isfile(path) or not h5py.is_hdf5(path):
            return False, False
        with h5py.File(path, "r") as f:
            return GROUP in f, "portfolio" in f
    except (OSError, ValueError, RuntimeError):
        return False, False


def write_bond_book(path: str, ids, columns: dict, curves: dict, default: str | None = None) -> None:
    """Write a book (columns as bond_book.columns_of makes them: codes, a curve index into the sorted
    curve names of `curves` {name: YieldCurve}) in the schema above, atomically: the file is built
    in memory (bond_book_image) and written as plain bytes (files.atomic_write), so that a disk
    that fills during the write raises OSError and leaves nothing."""
    atomic_write(path, bond_book_image(ids, columns, curves, default))


def bond_book_image(ids, columns: dict, curves: dict, default: str | None = None) -> memoryview:
    """The bytes of the HDF5 file write_bond_book writes, made in memory (a view
    of its buffer, not a copy)."""
    names = sorted(curves)
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        g = f.create_group(GROUP)
        g.attrs["schema"] = SCHEMA
        g.create_dataset("id", data=np.asarray(ids, dtype=np.int64))
        for name in bond_book.BOND_COLUMNS:
            values = np.asarray(columns[name])
            if name in TEXT or name == "curve":   # fixed-length (UTF-8 bytes): one array
                known = np.array([t.encode() for t in (TEXT[name] if name in TEXT
                                                       else names)])
                g.create_dataset(name, data=known[values])
            else:
                g.create_dataset(name, data=values)
        c = f.create_group(CURVES)
        if default is not None:
            c.attrs["default"] = default
        for name in names:
            c.create_dataset(f"{name}/times", data=curves[name].times)
            c.create_dataset(f"{name}/rates", data=curves[name].rates)
    return image.getbuffer()
