"""Stage 6: the results file — schema, provenance, and an atomic write (temp file, then rename)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os

import h5py
import numpy as np

from pricer import __version__
from pricer.errors import InputError
from pricer.files import atomic_write, check_output_file

SCHEMA = "pricer.results/1"


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


def results_bytes(options: int, outputs: int) -> float:
    """A results file's size, over-estimated: id and each output as float64 per option, and room
    for HDF5's metadata and the per-rank /run datasets."""
    return 1.1 * options * 8 * (1 + outputs) + (64 << 10)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_results(path: str, ids: np.ndarray, prices: np.ndarray, attrs: dict, run: dict,
                  extra: dict | None = None) -> None:
    """Write /results (id, price in input order, provenance attributes, and the `extra` float64
    datasets such as the Greeks, in the same order) and /run (per-rank stats) to `path`,
    atomically. The file is built in memory and then written as plain bytes: a disk that fills
    during the write then raises OSError (and leaves nothing) where HDF5 writing to the disk
    itself failed its own clean-up."""
    with h5py.File("results.h5", "w", driver="core", backing_store=False) as f:
        g = f.create_group("results")
        g.create_dataset("id", data=np.asarray(ids, dtype=np.int64))
        g.create_dataset("price", data=np.asarray(prices, dtype=np.float64))
        for name, values in (extra or {}).items():   # floats as float64; codes as they are
            values = np.asarray(values)
            g.create_dataset(name, data=values if values.dtype.kind in "iu" else
                             values.astype(np.float64))
        g.attrs["schema"] = SCHEMA
        g.attrs["pricer_version"] = __version__
        for key, value in attrs.items():
            g.attrs[key] = value
        r = f.create_group("run")
        for key, value in run.items():
            r.create_dataset(key, data=value)
        f.flush()
        image = f.id.get_file_image()
    atomic_write(path, image)


def read_results(path: str) -> dict:
    """The results file as plain numpy arrays and attributes (for `pricer info` and tests)."""
    with h5py.File(path, "r") as f:
        g = f["results"]
        out = {"attrs": dict(g.attrs), "run": {k: f["run"][k][()] for k in f["run"]}}
        for key in g:
            out[key] = g[key][()]
    return out
