"""Portfolio and results files by their extension: HDF5 (.h5, .hdf5), CSV (.csv, a header row)
and Parquet (.parquet, through pyarrow: the `parquet` extra).

HDF5 is the default and the format for MPI-scale runs: its ranks can read their own rows
(--distribute read), and a results file carries its provenance as attributes. CSV and Parquet
books hold the same columns as /portfolio (docs/formats.md) and are checked by the same rules,
with the same messages; they are read whole by rank 0. A CSV results file starts with its
provenance as `# key: value` lines (pandas.read_csv(path, comment="#") skips them); a Parquet one
carries it as the table's key-value metadata.
"""

from __future__ import annotations

import importlib.util
import io
import os
import warnings

import numpy as np

from pricer.errors import InputError
from pricer.files import check_input_file

HDF5, CSV, PARQUET = "hdf5", "csv", "parquet"
EXTENSIONS = {".h5": HDF5, ".hdf5": HDF5, ".csv": CSV, ".parquet": PARQUET}
KNOWN = ".h5 or .hdf5 (HDF5), .csv (CSV with a header row), .parquet (Parquet)"
FLAG_WORDS = ("true", "1", "1.0", "false", "0", "0.0")   # a CSV flag cell, lower case: true first


def extension_format(path) -> str | None:
    """The format a file name's extension names, or None."""
    return EXTENSIONS.get(os.path.splitext(str(path))[1].lower())


def input_format(path) -> str:
    """The format of a portfolio (or results) file to read: by its extension; a file whose
    extension names none is still read as HDF5 if it is one."""
    found = extension_format(path)
    if found is not None:
        return found
    check_input_file(str(path))
    import h5py
    if h5py.is_hdf5(str(path)):
        return HDF5
    raise InputError(f"{path}: unknown file format ({_extension(path)}); known formats: {KNOWN}")


def output_format(path, what: str = "results") -> str:
    """The format of a file to write, by its extension; InputError naming the known ones."""
    found = extension_format(path)
    if found is None:
        raise InputError(f"{path}: unknown {what} format ({_extension(path)}); known formats: "
                         f"{KNOWN}")
    return found


def _extension(path) -> str:
    ext = os.path.splitext(str(path))[1]
    return f"extension {ext!r}" if ext else "no extension"


def read_table(path, fmt: str, header_only: bool = False):
    """A CSV or Parquet file as a pandas DataFrame (header_only: its columns, no rows); any fault
    as InputError naming the file."""
    import pandas

    check_input_file(str(path))
    try:
        if fmt == CSV:
            # round_trip: with pandas' default parser a CSV book and the same book in HDF5 were
            # priced apart (the H100 host's pandas), with round_trip bitwise equal; pandas 3
            # deprecates the argument
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                # only the leading `# key: value` lines are skipped: a later row that starts
                # with # is a fault to name, not a row to drop
                return pandas.read_csv(path, skiprows=_leading_comments(path),
                                       skipinitialspace=True, float_precision="round_trip",
                                       nrows=0 if header_only else None)
        if importlib.util.find_spec("pyarrow") is None:   # pandas' own message names no extra
            raise InputError(f"{path}: reading Parquet needs pyarrow: pip install "
                             f"'pricer[parquet]'")
        if header_only:
            import pyarrow.parquet
            return pandas.DataFrame(columns=pyarrow.parquet.read_schema(path).names)
        frame = pandas.read_parquet(path)
        # a column kept as the index (DataFrame.to_parquet with id set as the index)
        return frame.reset_index() if frame.index.name is not None else frame
    except InputError:
        raise
    except pandas.errors.EmptyDataError:
        raise InputError(f"{path}: the portfolio is empty (no header, no rows)") from None
    except (ValueError, OSError, UnicodeDecodeError, pandas.errors.ParserError) as exc:
        raise InputError(f"{path}: cannot read it as {fmt.upper() if fmt == CSV else 'Parquet'}: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from None


def _leading_comments(path) -> int:
    """How many of a CSV file's first lines start with #."""
    count = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.startswith(b"#"):
                break
            count += 1
    return count


def table_bytes(fmt: str, columns: dict, attrs: dict, units: dict) -> bytes:
    """A results table (column name -> 1-D array, in order) as the bytes of a CSV or Parquet file,
    with `attrs` (provenance) and `units` (column -> unit) in it."""
    import pandas

    frame = pandas.DataFrame({name: np.asarray(values) for name, values in columns.items()})
    if fmt == CSV:
        lines = [f"# {key}: {_one_line(value)}" for key, value in attrs.items()]
        lines += [f"# unit of {name}: {unit}" for name, unit in units.items() if name in columns]
        text = io.StringIO()
        text.write("\n".join(lines) + "\n")
        frame.to_csv(text, index=False, float_format="%.17g")
        return text.getvalue().encode("utf-8")
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise InputError("writing Parquet needs pyarrow: pip install 'pricer[parquet]'") from None
    table = pyarrow.Table.from_pandas(frame, preserve_index=False)
    metadata = {f"pricer.{key}": _one_line(value) for key, value in attrs.items()}
    metadata.update({f"pricer.unit.{name}": unit for name, unit in units.items()
                     if name in columns})
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           **{k.encode(): v.encode() for k, v in metadata.items()}})
    sink = pyarrow.BufferOutputStream()
    pyarrow.parquet.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def table_attributes(path, fmt: str) -> dict:
    """The `attrs` table_bytes recorded in a CSV or Parquet file (strings; units under
    "unit of NAME" in a CSV, "unit.NAME" in Parquet)."""
    if fmt == CSV:
        attrs = {}
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.startswith("# "):
                    break
                key, _, value = line[2:].rstrip("\n").partition(": ")
                attrs[key] = value
        return attrs
    import pyarrow.parquet
    meta = pyarrow.parquet.read_schema(path).metadata or {}
    return {k.decode()[len("pricer."):]: v.decode() for k, v in meta.items()
            if k.decode().startswith("pricer.")}


def _one_line(value) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        value = value.decode("utf-8", "replace")
    return str(value).replace("\n", " ")


def read_book(path, values: bool = True):
    """A portfolio file of any of the formats, read and validated (portfolio.read_portfolio's
    checks and messages; values=False: the structure only, for --invalid skip)."""
    from pricer.io.portfolio import portfolio_from_columns, read_portfolio

    fmt = input_format(path)
    if fmt == HDF5:
        return read_portfolio(str(path), values)
    frame = read_table(path, fmt)
    if len(frame) == 0:
        raise InputError(f"{path}: the portfolio is empty (0 options)")
    _name_unparsable(frame, path)
    return portfolio_from_columns(frame, source=str(path), values=values)


def _name_unparsable(frame, path) -> None:
    """A numeric column that came back as text (a cell that is not a number) named with the
    first such cell's option id and value; flag columns of true/false and 0/1 mixed made bool.
    Whitespace around a header or a cell is no part of it (a tab or a no-break space after a
    number, as a space is; `jr ` names the tree jr); an empty cell of id, steps, call, american or
    tree (a Parquet null) is named with its option id."""
    import pandas

    from pricer.io.portfolio import TREE_COLUMN

    numeric = pandas.api.types.is_numeric_dtype   # bool columns too
    _strip_header(frame, path)

    def where(row: int) -> str:
        if "id" in frame.columns and numeric(frame["id"].dtype) and frame["id"].notna().all():
            return f"option id {frame['id'].iloc[row]}"
        return f"data row {row + 1}"

    for name in frame.columns:
        column = frame[name]
        if name in ("id", "steps", "call", "american", TREE_COLUMN) and column.isna().any():
            row = int(column.isna().to_numpy().nonzero()[0][0])
            raise InputError(f"{path}: column {name} is empty for {where(row)}", column=str(name))
        if name == TREE_COLUMN:
            if not numeric(column.dtype) and all(isinstance(v, str) for v in column):
                frame[name] = column.str.strip()
            continue
        if numeric(column.dtype):
            continue
        flag = name in ("call", "american")
        if flag:     # only these: a 2 or a 0.5 among words is a typo, not a put
            text = column.astype(str).str.strip().str.lower()
            bad = ~text.isin(FLAG_WORDS)
        else:
            text = _numbers(column, whole=name in ("id", "steps"))
            bad = text.isna() & column.notna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            what = "true, false, 0 or 1" if flag else \
                "a whole number (of int64's range)" if name in ("id", "steps") else "a number"
            raise InputError(f"{path}: column {name} holds {column.iloc[row]!r} for {where(row)}, "
                             f"not {what}", column=str(name))
        # words and digits mixed in one column: pandas leaves them as text
        frame[name] = text.isin(FLAG_WORDS[:3]).to_numpy() if flag else text


def _strip_header(frame, path) -> None:
    """The header's names without the whitespace around them; InputError where two are then one
    name."""
    names = [str(name).strip() for name in frame.columns]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InputError(f"{path}: column {twice[0]} appears more than once in the header",
                         column=twice[0])
    frame.columns = names


def _numbers(column, whole: bool):
    """A text column's cells as numbers, parsed as the CSV reader does (correctly rounded, as
    round_trip's), whitespace around them aside; NaN (None for `whole`) where a cell is none."""
    import pandas

    def parse(cell):
        if not isinstance(cell, str) or "_" in cell:   # Python's literals take 1_000; a book not
            return None if whole else np.nan           # (an empty cell is NaN: no string)
        try:
            value = int(cell.strip()) if whole else float(cell.strip())
        except ValueError:
            return None if whole else np.nan
        return value if not whole or -2**63 <= value < 2**63 else None

    table = {cell: parse(cell) for cell in pandas.unique(column)}
    values = column.map(table)
    if whole:
        return values.astype(np.int64) if values.notna().all() else values
    return values.astype(np.float64)
