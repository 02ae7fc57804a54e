"""A toy family registered from test code alone (pricer/run/families.py): forward contracts,
priced in closed form, S - K e^{-rT}. Its rows are
the HDF5 group /forwards (id, spot, strike, rate, maturity); a row with a spot <= 0 or a negative
maturity breaks a rule (refused by id, or skipped with its status under --invalid skip).

Loaded by `pricer price` through PRICER_PLUGINS=tests.toy_family (the repository on PYTHONPATH),
or by importing it (the Python API). Its engines are the backends cpu and serial's, under
(forwards, closed) in the backend registry."""

from __future__ import annotations

import h5py
import numpy as np

from pricer.engines.base import add_engines
from pricer.errors import InputError, first_ids
from pricer.run.families import Family, Index, register_family

COLUMNS = ("spot", "strike", "rate", "maturity")
RULES = ((1, "spot must be > 0", lambda c: ~(c["spot"] > 0)),
         (2, "maturity must be >= 0", lambda c: ~(c["maturity"] >= 0)))


class Book:
    def __init__(self, ids, columns, status):
        self.id, self.columns, self.status = ids, columns, status


class ForwardEngine:
    uses_gpu = False

    def price(self, columns: dict) -> np.ndarray:
        return columns["spot"] - columns["strike"] * np.exp(-columns["rate"] * columns["maturity"])


class Forwards(Family):
    name = "forwards"
    group = "forwards"
    noun = "forwards"
    work = "evaluations"
    method = "closed"
    reasons = {0: "priced", **{code: text for code, text, _ in RULES}}
    units = {"id": "the input's id", "price": "currency of spot", "status": "code"}

    def index(self, cfg, size: int, node_ranks: int) -> Index:
        with h5py.File(cfg.input, "r") as f:
            ids = f[self.group]["id"][()].astype(np.int64)
        return Index(ids, np.ones(ids.size))

    def read(self, cfg, rows: slice):
        with h5py.File(cfg.input, "r") as f:
            g = f[self.group]
            ids = g["id"][rows].astype(np.int64)
            columns = {name: g[name][rows].astype(np.float64) for name in COLUMNS}
        status = np.zeros(ids.size, dtype=np.int8)
        for code, text, broken in RULES:
            wrong = broken(columns) & (status == 0)
            if wrong.any() and cfg.invalid != "skip":
                raise InputError(f"{cfg.input}: forward id(s) {first_ids(ids, wrong)}: {text}",
                                 ids=ids[wrong])
            status[wrong] = code
        return Book(ids, columns, status)

    def chunk_work(self, cfg, book, chunks):
        work = [float(b - a) for a, b, _ in chunks]
        return work, work

    def price(self, cfg, engine, book, chunks, values, stats):
        at = 0
        for k, (a, b, _) in enumerate(chunks):
            mine = values[at:at + b - a]
            at += b - a
            keep = book.status[a:b] == 0
            mine[:, 0] = np.nan
            mine[keep, 0] = engine.price({n: v[a:b][keep] for n, v in book.columns.items()})
            mine[:, 1] = book.status[a:b]
            yield k, float(keep.sum())


def write_book(path, ids, columns: dict) -> None:
    with h5py.File(path, "w") as f:
        g = f.create_group("forwards")
        g.create_dataset("id", data=np.asarray(ids, dtype=np.int64))
        for name in COLUMNS:
            g.create_dataset(name, data=np.asarray(columns[name], dtype=np.float64))


def oracle(columns: dict) -> np.ndarray:
    """The forwards' values, by NumPy apart from the engine (NaN where a rule is broken)."""
    spot, strike = np.asarray(columns["spot"]), np.asarray(columns["strike"])
    rate, maturity = np.asarray(columns["rate"]), np.asarray(columns["maturity"])
    ok = (spot > 0) & (maturity >= 0)
    return np.where(ok, spot - strike / np.exp(rate * maturity), np.nan)


register_family(Forwards())
add_engines("cpu", {("forwards", "closed"): lambda **_: ForwardEngine()})
add_engines("serial", {("forwards", "closed"): lambda **_: ForwardEngine()})
