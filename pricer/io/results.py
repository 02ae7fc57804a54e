"""The results file — schema, units, provenance, and an atomic write (temp file, then
rename); HDF5, CSV or Parquet by the output's extension (formats.py)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor

import h5py
import numpy as np

from pricer import __version__
from pricer.errors import InputError
from pricer.files import atomic_write, check_output_file
from pricer.io.formats import (HDF5, input_format, output_format, read_table, table_attributes,
                                table_bytes)

SCHEMA = "pricer.results/1"


def sha256_beside(path: str) -> Future:
    """sha256_of_file(path) on a thread of its own, which the caller need not wait for (the
    digest is written with the results, at the end of a run): hashlib and the reads release the
    GIL, so it runs beside the parsing and the pricing."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pricer-sha256")
    try:
        return pool.submit(sha256_of_file, path)
    finally:
        pool.shutdown(wait=False)


def sha256_of_file(path: str, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def check_output_path(path: str, overwrite: bool, protect: str | None = None) -> None:
    """Refuse before any work: an output that cannot be written (files.check_output_file), or the
    input itself (`protect`), which is never overwritten, --overwrite or not."""
    if protect is not None and isinstance(path, str) and path and os.path.exists(path) \
            and os.path.exists(protect) and os.path.samefile(path, protect):
        raise InputError(f"{path}: is the input portfolio; the input is never overwritten")
    check_output_file(path, overwrite, "results")
    output_format(path)


def results_bytes(options: int, outputs: int) -> float:
    """A results file's size, over-estimated: id and each output as float64 per option, and room
    for HDF5's metadata and the per-rank /run datasets."""
    return 1.1 * options * 8 * (1 + outputs) + (64 << 10)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# Each result's unit, written beside it (an HDF5 dataset's `unit` attribute; CSV and Parquet:
# formats.table_bytes). Greeks as pricer.model.greeks computes them.
UNITS = {
    "id": "the input's option id",
    "price": "currency of spot and strike",
    "delta": "currency per 1.00 of spot",
    "gamma": "currency per 1.00 of spot, squared",
    "theta": "currency per year",
    "vega": "currency per 1.00 of volatility (0.01 = one point)",
    "rho": "currency per 1.00 of rate (0.01 = one point)",
    "status": "code: 0 priced (implied volatilities: converged), else the reason in the "
              "status_reasons attribute",
    "implied_volatility": "per year, as the volatility column (NaN where status is not 0)",
    "iterations": "rounds of the search: lattices priced, and sigmas tried where the tree had "
                  "no lattice",
}


def write_results(path: str, ids: np.ndarray | None, prices: np.ndarray | None, attrs: dict,
                  run: dict, extra: dict | None = None, scenarios: tuple | None = None,
                  tables: dict | None = None) -> None:
    """Write the results (id, price in input order, provenance attributes, and the `extra`
    float64 datasets such as the Greeks, in the same order) and the per-rank stats to `path`,
    atomically, in the format its extension names (formats.py): HDF5's /results and /run, or a
    CSV or Parquet table. The file is built in memory and then written as plain bytes: a disk
    that fills during the write then raises OSError (and leaves nothing) where HDF5 writing to
    the disk itself failed its own clean-up. `scenarios`: (ScenarioGrid, (options, scenarios)
    prices), written as /results/scenarios (HDF5 only: RunConfig.check refuses the others).
    `tables`: {name: (columns, units)} of the other families' results (the bond options': id,
    price, status), each as /results/<name>; a file of one family alone (ids None) has its
    table as its only one (CSV and Parquet: the columns)."""
    columns = {} if ids is None else {"id": np.asarray(ids, dtype=np.int64),
                                      "price": np.asarray(prices, dtype=np.float64)}
    for name, values in (extra or {}).items():   # floats as float64; codes as they are
        values = np.asarray(values)
        columns[name] = values if values.dtype.kind in "iu" else values.astype(np.float64)
    attrs = {"schema": SCHEMA, "pricer_version": __version__, **attrs}
    fmt = output_format(path)
    tables = tables or {}
    if fmt != HDF5:
        units = UNITS
        if tables:
            if columns or len(tables) > 1:
                raise InputError(f"{path}: a book of several instrument families is written to "
                                 "HDF5 only (.h5), each in its own group")
            (table, units), = tables.values()
            columns = dict(table)
        table_attrs = dict(attrs, run=json.dumps({key: np.asarray(value).tolist()
                                                  for key, value in run.items()}))
        atomic_write(path, table_bytes(fmt, columns, table_attrs, units))
        return
    with h5py.File("results.h5", "w", driver="core", backing_store=False) as f:
        g = f.create_group("results")
        for name, values in columns.items():
            g.create_dataset(name, data=values)
            g[name].attrs["unit"] = UNITS.get(name, "")
        for key, value in attrs.items():
            g.attrs[key] = value
        if scenarios is not None:
            _write_scenarios(g.create_group("scenarios"), *scenarios)
        for family, (table, units) in tables.items():
            b = g.create_group(family)
            for name, values in table.items():
                b.create_dataset(name, data=values)
                b[name].attrs["unit"] = units.get(name, "")
        r = f.create_group("run")
        for key, value in run.items():
            r.create_dataset(key, data=value)
        f.flush()
        image = f.id.get_file_image()
    atomic_write(path, image)


def _write_scenarios(g, grid, prices: np.ndarray) -> None:
    """price (options, scenarios); each scenario's shift per axis (scenarios,); each axis's own
    values under axes/ (the grid is their Cartesian product, the last axis fastest)."""
    from pricer.model.scenarios import AXES

    g.create_dataset("price", data=np.ascontiguousarray(prices, dtype=np.float64))
    g["price"].attrs["unit"] = UNITS["price"]
    shifts = grid.shifts()
    axes = g.create_group("axes")
    for j, axis in enumerate(AXES):
        g.create_dataset(axis, data=shifts[:, j])
        axes.create_dataset(axis, data=np.asarray(getattr(grid, axis), dtype=np.float64))
        g[axis].attrs["unit"] = axes[axis].attrs["unit"] = SCENARIO_UNITS[axis]
    g.attrs["shape"] = np.asarray(grid.shape, dtype=np.int64)


SCENARIO_UNITS = {"spot": "relative shift of spot (S0 x (1 + shift))",
                  "volatility": "absolute shift of volatility", "rate": "absolute shift of rate",
                  "days": "days passed (maturity - days / 365)"}


def read_results(path: str) -> dict:
    """A results file as plain numpy arrays and attributes (for `pricer info` and tests): the
    columns by name, "attrs" (provenance), "units" and "run" (per-rank stats)."""
    fmt = input_format(path)
    if fmt == HDF5:
        with h5py.File(path, "r") as f:
            g = f["results"]
            columns = [k for k in g if isinstance(g[k], h5py.Dataset)]
            out = {"attrs": dict(g.attrs), "run": {k: f["run"][k][()] for k in f["run"]},
                   "units": {k: g[k].attrs.get("unit", "") for k in columns}}
            for key in columns:
                out[key] = g[key][()]
            if "scenarios" in g:
                s = g["scenarios"]
                out["scenarios"] = {k: s[k][()] for k in s if isinstance(s[k], h5py.Dataset)}
                out["scenarios"]["axes"] = {k: s["axes"][k][()] for k in s["axes"]}
            for name in g:          # the other families' tables (write_results' tables)
                if name != "scenarios" and isinstance(g[name], h5py.Group):
                    out[name] = {k: g[name][k][()] for k in g[name]}
        return out
    frame = read_table(path, fmt)
    attrs = table_attributes(path, fmt)
    units = {key[len("unit of "):]: value for key, value in attrs.items()
             if key.startswith("unit of ")}
    units.update({key[len("unit."):]: value for key, value in attrs.items()
                  if key.startswith("unit.")})
    attrs = {key: value for key, value in attrs.items()
             if not key.startswith(("unit of ", "unit."))}
    run = {key: np.asarray(value) for key, value in json.loads(attrs.pop("run", "{}")).items()}
    out = {"attrs": attrs, "run": run, "units": units}
    out.update({name: frame[name].to_numpy() for name in frame.columns})
    return out
