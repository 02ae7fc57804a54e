"""`pricer info FILE`: a short description of a portfolio or a results file, in any of the formats
(pricer/io/formats.py): every column's range, the trees, and what the file records of its origin;
or of a book of bond options (pricer/io/bonds.py): its trees' widths and heights and its columns."""

from __future__ import annotations

import json

import h5py
import numpy as np

from pricer.errors import InputError
from pricer.files import check_input_file
from pricer.io.bonds import GROUP as BOND_GROUP, SCHEMA as BOND_SCHEMA, read_bond_book
from pricer.io.formats import HDF5, input_format, read_book, read_table, table_attributes
from pricer.io.portfolio import FLOAT_COLUMNS, GROUP, SCHEMA
from pricer.io.results import SCHEMA as RESULTS_SCHEMA, read_results
from pricer.model.greeks import GREEKS
from pricer.model.hw1f import EXERCISES, PRODUCTS
from pricer.model.scenarios import AXES

# attributes shown in full on their own lines, the rest after them
_LONG = ("command", "libraries", "hosts", "gpus", "status_reasons", "generated_by",
         "generate_args")


def describe(path: str) -> list[str]:
    check_input_file(path)
    fmt = input_format(path)
    try:
        groups = _groups(path, fmt)
        if BOND_GROUP in groups and GROUP not in groups:
            return _describe_bonds(path)
        if _is_results(path, fmt):
            return _describe_results(path)
        lines = _describe_portfolio(path, fmt)
        if BOND_GROUP in groups:      # a file of options and bond options: both
            lines += _describe_bonds(path, f"{path} /{BOND_GROUP}")
        return lines
    except InputError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as exc:   # cut short, or not pricer's
        raise InputError(f"{path}: cannot read it: {exc}") from None


def _is_results(path: str, fmt: str) -> bool:
    if fmt == HDF5:
        if not h5py.is_hdf5(path):
            raise InputError(f"{path}: not an HDF5 file")
        try:
            with h5py.File(path, "r") as f:
                return "results" in f
        except OSError as exc:
            raise InputError(f"{path}: cannot read it: {exc}") from None
    schema = table_attributes(path, fmt).get("schema")
    if schema is not None:
        return schema == RESULTS_SCHEMA
    columns = read_table(path, fmt, header_only=True).columns
    return "price" in columns and "spot" not in columns


def _groups(path: str, fmt: str) -> set:
    """The top-level groups of an HDF5 file (/portfolio, /bond_options, /results); none of
    another format's."""
    if fmt != HDF5 or not h5py.is_hdf5(path):
        return set()
    try:
        with h5py.File(path, "r") as f:
            return set(f.keys())
    except OSError as exc:
        raise InputError(f"{path}: cannot read it: {exc}") from None


def _describe_bonds(path: str, label: str | None = None) -> list[str]:
    """A book of bond options (`label`: what its first line names; the file's path alone): its
    instruments' trees (widths, heights, nodes) and columns."""
    book = read_bond_book(path)
    params = book.parameters()
    cols = book.columns
    lines = [f"{label or path}: bond options ({BOND_SCHEMA}), {len(book)} instruments, "
             f"{params.nodes().sum():.4g} tree nodes a sweep",
             _range("id", book.id), _range("tree width", 2 * params.jmax + 1),
             _range("tree height (steps)", params.steps)]
    lines += [_range(name, cols[name]) for name in ("maturity", "coupon", "strike",
                                                     "mean_reversion", "volatility")]
    for name, names in (("exercise", EXERCISES), ("product", PRODUCTS)):
        codes, counts = np.unique(cols[name], return_counts=True)
        lines.append(f"  {name}: " + ", ".join(f"{names[c]} {n}" for c, n in zip(codes, counts)))
    lines.append(f"  calls {int(cols['call'].sum())}, puts {int((~cols['call']).sum())}; "
                 f"curves: {', '.join(book.curve_names)}")
    return lines


def _range(name: str, values: np.ndarray) -> str:
    values = np.asarray(values)
    finite = values[np.isfinite(values)] if values.dtype.kind == "f" else values
    if finite.size == 0:
        return f"  {name}: no finite values"
    text = f"  {name}: min {finite.min():.6g}, median {np.median(finite):.6g}, max {finite.max():.6g}"
    missing = values.size - finite.size
    return text + (f" ({missing} NaN)" if missing else "")


def _describe_portfolio(path: str, fmt: str) -> list[str]:
    p = read_book(path, values=False)   # a book with bad values is shown as it is
    lines = [f"{path}: portfolio ({SCHEMA}, {fmt.upper() if fmt != 'parquet' else 'Parquet'}), "
             f"{len(p)} options, {p.nodes():.4g} lattice nodes",
             _range("id", p.id), _range("steps N", p.steps)]
    lines += [_range(name, getattr(p, name)) for name in FLOAT_COLUMNS]
    if p.market_price is not None:
        lines.append(_range("market_price", p.market_price))
    lines.append(f"  calls {int(p.call.sum())}, puts {int((~p.call).sum())}; "
                 f"american {int(p.american.sum())}, european {int((~p.american).sum())}")
    if p.tree is None:
        lines.append("  tree: no column (every option takes the run's --tree)")
    else:
        names, counts = np.unique(p.tree, return_counts=True)
        lines.append("  tree: " + ", ".join(f"{name} {count}" for name, count in zip(names, counts)))
    if fmt == HDF5:
        with h5py.File(path, "r") as f:
            attrs = dict(f[GROUP].attrs)
    else:
        attrs = table_attributes(path, fmt)
    lines += _attributes({k: v for k, v in attrs.items() if k != "schema"})
    return lines


def _describe_results(path: str) -> list[str]:
    r = read_results(path)
    attrs, units = dict(r["attrs"]), r.get("units", {})
    order = ("price",) + GREEKS + ("status",)
    # the other families' tables (write_results' tables: /results/bonds, a plug-in's)
    tables = {name: table for name, table in r.items() if isinstance(table, dict)
              and name not in ("attrs", "run", "units", "scenarios")}
    columns = sorted((name for name in r if name not in ("attrs", "run", "units", "id",
                                                          "scenarios", *tables)),
                     key=lambda name: order.index(name) if name in order else len(order))
    options = f"{r['price'].size} options" if "price" in r else "no options"
    others = "".join(f", {t['id'].size} {'bond options' if name == 'bonds' else name}"
                     for name, t in tables.items())
    lines = [f"{path}: results ({attrs.pop('schema', '?')}), {options}{others}"]
    for name in columns:
        unit = f" [{units[name]}]" if units.get(name) else ""
        if name == "status":
            lines.append(_statuses(f"status{unit}", r[name], attrs.get("status_reasons")))
        else:
            lines.append(_range(name, r[name]) + unit)
    for name, table in tables.items():
        reasons = attrs.pop("bond_status_reasons" if name == "bonds" else
                            f"{name}_status_reasons", None)
        if "price" in table:
            lines.append(_range(f"{name}: price", table["price"]))
        if "status" in table:
            lines.append(_statuses(f"{name}: status", table["status"], reasons))
    if "scenarios" in r:
        s = r["scenarios"]
        lines.append(f"  scenarios: {s['price'].shape[1]} ("
                     + " x ".join(f"{axis} {s['axes'][axis].size}" for axis in AXES)
                     + ")" + _range(" price", s["price"].ravel())[len("   price"):])
    lines += _attributes(attrs)
    run = r.get("run", {})
    if len(run.get("seconds", ())):
        for rank, (sec, opts, nodes) in enumerate(zip(run["seconds"], run["options"],
                                                      run["nodes"])):
            lines.append(f"  rank {rank}: {int(opts)} options, {float(nodes):.4g} nodes, "
                         f"{float(sec):.3f}s")
    return lines


def _statuses(label: str, status: np.ndarray, reasons) -> str:
    """'  LABEL: 0 (priced) 118; 13 (volatility must be ...) 2': the rows by status code, each
    with its reason (`reasons`: the file's JSON of them)."""
    reasons = json.loads(reasons or "{}")
    codes, counts = np.unique(status, return_counts=True)
    return f"  {label}: " + "; ".join(f"{int(code)} ({reasons.get(str(int(code)), '?')}) {count}"
                                      for code, count in zip(codes, counts))


def _attributes(attrs: dict) -> list[str]:
    def text(value):
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    short = [f"  {key}: {text(attrs[key])}" for key in sorted(attrs) if key not in _LONG]
    return short + [f"  {key}: {text(attrs[key])}" for key in _LONG if key in attrs]
