"""The instrument families a run prices (pipeline.py), and what a family says to it. A family is
a plug-in: a subclass of Family, registered with register_family (the option book:
option_family.py; the Hull–White bond options: bond_family.py; a test's toy family:
tests/toy_family.py), prices the rows of one group of an HDF5 input, e.g. /bond_options. Its
engines come from the backend registry under (family name, method) (pricer/engines/base.py:
register, add_engines).

What the pipeline asks of a family, in the order it asks:

1. rank 0: `index(cfg, size, node_ranks)` reads what the partition needs of every row (ids, a
   cost per row, the whole file's checks), `check_memory`, `grid` cuts the rows into chunks (or,
   where no checkpoint binds them, `layout` partitions the rows its own way); the chunks a
   checkpoint holds come back from it (their values judged by `judge`), the others are split
   over the ranks by cost; `fit` sizes every rank's chunks to its GPU;
2. every rank: `share` gets its own rows, read and checked (by default `read(cfg, rows)` of a
   slice of the input), with --invalid skip giving a row that breaks a rule its status instead;
3. every rank: `setup`, then `price(cfg, engine, book, chunks, values, stats)` prices its chunks,
   yielding each chunk's number once its rows of `values` (`columns(cfg)`: price, ..., status)
   are set;
4. every rank: `judge(cfg, ids, values)` refuses (InputError) rows whose values cannot be
   written; rank 0 gathers the rows and writes them as /results/<name> (the option book, whose
   `top_level` is set: as /results' own columns).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import h5py
import numpy as np

from pricer.engines import base
from pricer.errors import InputError


@dataclass
class Index:
    """Rank 0's read of every row: what the chunks and the partition follow from."""
    ids: np.ndarray       # int64, in the book's order
    cost: np.ndarray      # float64 per row: the work (engine nodes, say) for partition and chunks
    extra: dict = field(default_factory=dict)   # what the family's grid needs besides
    prefix: np.ndarray | None = None    # the costs' prefix sums [0, c0, c0 + c1, ...], if made


class Family:
    """A family of instruments, priced from one group of an HDF5 input (module doc)."""
    name = ""                   # the registry's, the results' group and the summary's key
    group = ""                  # the input's group of its rows
    noun = "instruments"        # the summary's word for its rows
    label = ""                  # the summary's word for its stages (default: name)
    work = "nodes"              # and for its costs' unit
    method = "lattice"          # the engines' method (the backend registry's key)
    outputs = ("price", "status")   # the values a row gets; status int8, 0 priced
    reasons: dict = {0: "priced"}   # each status code's meaning, written with the results
    units: dict = {}            # each output's unit, written beside it
    options_only = True         # the option run's settings (--greeks, implied-vol, ...) refused
    top_level = False           # results as /results' own columns (the option book's)
    stage_names = ("plan", "read")  # the summary's words for the first two stages
    timed_setup = False         # the summary times `setup` as a stage of its own

    def columns(self, cfg) -> tuple:
        """The values a row gets in this run (`outputs` by default); status, if any, last."""
        return tuple(self.outputs)

    def index(self, cfg, size: int, node_ranks: int) -> Index:
        """Rank 0's read of every row (`size` ranks, `node_ranks` of them on this node)."""
        raise NotImplementedError

    def check_memory(self, cfg, index: Index, node_ranks: int, size: int) -> None:
        """Refuse (InputError) a book the node's memory cannot hold: nothing checked by default."""

    def grid(self, cfg, index: Index) -> np.ndarray:
        """Chunk boundaries in rows (0 first, the row count last): by default the run's chunk
        shape (RunConfig.chunk_shape) over the rows' costs."""
        from pricer.run.chunks import chunk_grid
        prefix = index.prefix if index.prefix is not None \
            else np.concatenate(([0.0], np.cumsum(index.cost)))
        return chunk_grid(index.cost, *cfg.chunk_shape(), prefix=prefix)

    def layout(self, cfg, index: Index, size: int):
        """Where no checkpoint binds the chunks: (order, grid, bounds) of the family's own
        partition (plan row i is book row order[i], None for the book's order; chunk boundaries
        in plan rows; rank r prices chunks bounds[r]:bounds[r + 1]), or None for the grid split
        by cost."""
        return None

    def checkpoint_settings(self, cfg, grid: np.ndarray) -> dict | None:
        """What a checkpoint's chunks depend on, the family's own way; None: the pipeline's
        (the grid, the backend, `settings`)."""
        return None

    def settings(self, cfg) -> dict:
        """What besides the grid changes a checkpoint's chunk files (the backend, a tree's
        spacing...): a checkpoint made with other settings is not resumed."""
        return {}

    def engine(self, cfg):
        from pricer.engines import get_engine
        return get_engine(cfg.backend, self.name, self.method)

    def device(self, engine):
        """The engine whose GPU the run measures (memory.device_info)."""
        return engine

    def fit(self, cfg, plan, engine, infos: list) -> tuple:
        """Rank 0: (each rank's chunk size on its GPU, or None; the summary's notes), the ranks'
        GPUs `infos` (None where unmeasured); InputError for a share that cannot fit."""
        return None, []

    def share(self, cfg, comm, plan, chunks: np.ndarray) -> tuple:
        """This rank's rows (the chunks `chunks` of `plan`, in order), read and checked by it:
        (the family's book of the span from its first chunk to its last, the chunks as (a, b,
        chunk) rows of it). Every rank calls it (a family may send rows from rank 0)."""
        if not chunks.size:
            return None, []
        grid = plan.grid
        lo, hi = int(grid[chunks[0]]), int(grid[chunks[-1] + 1])
        book = self.read(cfg, slice(lo, hi))
        return book, [(int(grid[j]) - lo, int(grid[j + 1]) - lo, int(j)) for j in chunks]

    def read(self, cfg, rows: slice):
        """The rows `rows` of the input, read and checked: an object with, per row, `id` and
        `status` (int8; 0: to price)."""
        raise NotImplementedError

    def setup(self, cfg, engine, book, chunks: list, values: np.ndarray, stats: dict) -> None:
        """Before the first chunk: the engine sized for the rank's chunks (`stats["fit"]`: rank
        0's fit of its GPU), `values` given what is known before pricing."""

    def describe(self, book):
        """What rank 0 learns of each rank's book for the results (a small picklable value)."""
        return None

    def chunk_work(self, cfg, book, chunks: list) -> tuple[list, list]:
        """Each chunk's work as the stall watchdog's limits count it, and as the progress
        display does (the plan's count, rows --invalid skip leaves out included)."""
        raise NotImplementedError

    def price(self, cfg, engine, book, chunks: list, values: np.ndarray, stats: dict):
        """Price `chunks` ((a, b, chunk) rows of `book`) into `values` (their rows one after
        another); yield (k, work priced) as chunk k's rows are set. `stats["waited"]`: the
        seconds the engine waited for its inputs (notes' `waited`)."""
        raise NotImplementedError

    def judge(self, cfg, ids: np.ndarray, values: np.ndarray) -> None:
        """Refuse (InputError) rows whose values are not to be written; nothing by default."""

    def attrs(self, cfg, backend: str) -> dict:
        """The provenance a results file adds for the family."""
        import json
        return {f"{self.name}_backend": backend,
                f"{self.name}_status_reasons": json.dumps({str(k): v
                                                          for k, v in self.reasons.items()})}

    def notes(self, engine, waited: list) -> list:
        """The summary's lines on the compute, from the ranks' seconds `waited` (price's)."""
        return []


_FAMILIES: dict[str, Family] = {}
# names a family cannot have: the option run's, and keys of the results and the summary
RESERVED = frozenset({"options", "attrs", "run", "units", "scenarios", "id", "price", "status",
                      "delta", "gamma", "theta", "vega", "rho", "implied_volatility",
                      "iterations", "family", "task", "instruments", "nodes", "ranks",
                      "backend", "wall", "stages", "rank_seconds", "threads", "reused"})


def register_family(family: Family) -> None:
    """Make `family` a run's: a file holding its group is priced by it (pipeline.py), and
    backends may register engines for it (engines.base.add_engines)."""
    if not family.name or not family.group or \
            (family.name in RESERVED and not family.top_level) or not family.name.isidentifier():
        raise ValueError(f"a family needs a name and an input group ({family.name!r}, "
                         f"{family.group!r}); the name a Python identifier, not one of "
                         f"{', '.join(sorted(RESERVED))} (the option run's and the results' "
                         "own keys)")
    if _FAMILIES.get(family.name, family) is not family:
        raise ValueError(f"a family {family.name!r} is registered already")
    if family.top_level and any(other.top_level and other is not family
                                for other in _FAMILIES.values()):
        raise ValueError("one family's results are /results' own columns (the option book's)")
    if tuple(family.outputs[-1:]) != ("status",) and not family.top_level:
        raise ValueError(f"family {family.name!r}: its outputs end with status (int8, 0 "
                         f"priced), not {family.outputs!r}")
    family.label = family.label or family.name
    base.add_family(family.name)
    base.add_method(family.method)
    _FAMILIES[family.name] = family


def family(name: str) -> Family:
    """The registered family `name`."""
    return _FAMILIES[name]


def unregister_family(name: str) -> None:
    _FAMILIES.pop(name, None)


def families() -> list[Family]:
    """The registered families: the built-in ones (registered as driver.py imports them), then
    those of the modules PRICER_PLUGINS names (comma-separated; each registers its families as
    it is imported)."""
    load_plugins()
    return list(_FAMILIES.values())


def load_plugins(environ=os.environ) -> None:
    """Import the modules PRICER_PLUGINS names (once each); InputError naming one that cannot be
    imported, so that every rank exits 2 rather than price the file without its family."""
    import importlib

    for name in filter(None, (item.strip() for item in environ.get(PLUGINS, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of a plug-in's import is named
            raise InputError(f"{PLUGINS}: the plug-in module {name!r} could not be imported "
                             f"({type(exc).__name__}: {exc})") from None


PLUGINS = "PRICER_PLUGINS"


def families_in(path: str) -> list[Family]:
    """The registered families whose group the file holds, the top-level one (the option book)
    first. A file that is not HDF5 holds none (the option book's read names a problem, or reads
    its CSV or Parquet table); a path that is not a regular file is never opened here (a FIFO
    never ends)."""
    known = sorted(families(), key=lambda fam: not fam.top_level)
    try:
        if not isinstance(path, str) or not os.path.isfile(path) or not h5py.is_hdf5(path):
            return []
        with h5py.File(path, "r") as f:
            return [fam for fam in known if fam.group in f]
    except (OSError, ValueError, RuntimeError):
        return []
