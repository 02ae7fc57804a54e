"""The option book (/portfolio, or a CSV or Parquet table: pricer/io/portfolio.py) as a family of
the run (families.Family; the run itself: pipeline.py), priced by its lattice method
(run/pricing.py) on the binomial engines.

- index: with --distribute scatter or bcast (the default), rank 0 reads and checks the whole book
  (checks.read_and_check); with --distribute read, only its id and steps columns, every rank
  reading and checking its own rows. A row's cost is its lattice's nodes (model/cost.py);
- layout: without a checkpoint, the rows are partitioned by partition.assign (contiguous, or whole
  options in another order where that balances the ranks better), the chunk grid cut within each
  rank's rows; with one, the chunk grid of the book's order, as every family's;
- fit: every rank's chunks sized to its GPU's memory (memory.fit_devices);
- share: rank 0 sends each rank its rows, column by column (collectives.distribute), or every
  rank reads its own;
- price: a chunk's lattice numbers are folded from its columns on a thread while the engine prices
  the chunk before (pricing.run_chunks), or the implied volatilities solved by one pool of
  searches (pricing.solve_chunks).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from pricer.engines import get_engine
from pricer.files import check_input_file
from pricer.io.portfolio import priced_steps, read_index, read_portfolio_rows
from pricer.model.cost import lattice_costs, lattice_nodes, nodes_priced
from pricer.model.greeks import SCENARIO
from pricer.model.partition import assign
from pricer.model.validity import PRICED, REASONS
from pricer.run import memory
from pricer.run.checks import check_memory, checked_rows, read_and_check, tree_names
from pricer.run.chunks import chunk_grid
from pricer.run.collectives import ROOT, distribute
from pricer.run.families import Family, Index, register_family
from pricer.run.pricing import run_chunks
from pricer.run.provenance import provenance


@dataclass
class OptionRows:
    """A rank's rows of the book: the method's columns (checks.CheckedRows.cols), ids, statuses."""
    cols: dict
    id: np.ndarray
    status: np.ndarray          # int8: 0 to price, else --invalid skip's reason
    trees: int = 0              # the trees its rows use, a bit per code (rank 0: the book's)

    def arrays(self, rows) -> dict:
        """Its rows `rows` (a slice: views) as one dict of 1-D arrays (collectives.distribute)."""
        out = {f"col.{name}": column[rows] for name, column in self.cols.items()}
        out["id"], out["status"] = self.id[rows], self.status[rows]
        return out

    @classmethod
    def from_arrays(cls, arrays: dict) -> "OptionRows":
        cols = {name[4:]: array for name, array in arrays.items() if name.startswith("col.")}
        return cls(cols, arrays["id"], arrays["status"])


@dataclass
class StartedEngine:
    """An engine made before the input was read, or why it could not be made (raised only once
    pricing starts, so that a failure goes through FailureWatch like any other)."""
    engine: object = None
    error: Exception | None = None


def start_engine(cfg) -> StartedEngine:
    """The engine, warmed up (Engine.warm_up; PRICER_WARM_START=0 skips it, for measurements)."""
    try:
        engine = get_engine(cfg.backend, **cfg.engine_overrides())
        if os.environ.get("PRICER_WARM_START", "1") != "0":
            engine.warm_up()
    except Exception as exc:  # noqa: BLE001 - bad settings are named by rank 0's checks instead
        return StartedEngine(error=exc)
    return StartedEngine(engine=engine)


class OptionBook(Family):
    name = "options"
    group = "portfolio"
    noun = "options"
    label = "option"
    reasons = REASONS
    outputs = ("price",)
    options_only = False
    top_level = True
    stage_names = ("read", "distribute")
    timed_setup = True

    def columns(self, cfg) -> tuple:
        return tuple(cfg.outputs())

    def index(self, cfg, size: int, node_ranks: int) -> Index:
        if cfg.distribute != "read":
            portfolio, checked = read_and_check(cfg, size, node_ranks)
            status = checked.status if checked.status is not None \
                else np.zeros(len(portfolio), dtype=np.int8)
            book = OptionRows(checked.cols, portfolio.id, status, checked.trees)
            steps = checked.cols["steps"]
            cost, prefix = lattice_costs(steps)
            return Index(portfolio.id, cost, {"steps": steps, "book": book}, prefix)
        cfg.check()
        check_input_file(cfg.input)     # before any read: a FIFO or a device never ends
        skip = cfg.invalid == "skip"
        index = read_index(cfg.input, values=not skip)
        steps = priced_steps(index.steps) if skip else index.steps   # the rows judge the rest
        check_memory(cfg, len(index), max(int(steps.max(initial=0)), 1), index.has_tree, size,
                     node_ranks)
        cost, prefix = lattice_costs(steps)
        return Index(index.id, cost, {"steps": steps}, prefix)

    def layout(self, cfg, index: Index, size: int):
        """partition.assign's parts, each cut by the run's chunk shape."""
        steps = index.extra["steps"]
        assignment = assign(steps, size, cfg.partition, cost=index.cost, prefix=index.prefix)
        if assignment.in_input_order():
            order, grid = None, chunk_grid(steps, *cfg.chunk_shape(), prefix=index.prefix)
        else:
            order = assignment.order
            grid = chunk_grid(steps[order], *cfg.chunk_shape())
        grid = _merge_cuts(grid, assignment.bounds)
        return order, grid, np.searchsorted(grid, assignment.bounds).astype(np.int64)

    def checkpoint_settings(self, cfg, grid: np.ndarray) -> dict:
        from pricer import __version__
        from pricer.engines import resolve_backend

        nodes, rows = cfg.chunk_shape()
        return {"pricer": __version__, "tree": cfg.tree, "backend": resolve_backend(cfg.backend),
                "greeks": cfg.greeks, "richardson": cfg.richardson, "chunk_nodes": float(nodes),
                "chunk_rows": rows, "chunks": len(grid) - 1,
                **({"invalid": "skip"} if cfg.invalid == "skip" else {}),  # chunks hold statuses
                **({"task": cfg.task} if cfg.implied else {}),
                **({"scenarios": cfg.analytics().scenarios.settings()} if cfg.scenarios else {})}

    def engine(self, cfg) -> StartedEngine:
        return start_engine(cfg)

    def device(self, engine):
        return engine.engine

    def fit(self, cfg, plan, engine, infos: list) -> tuple:
        if engine is None or all(info is None for info in infos):
            return None, []
        steps, ids = plan.index.extra["steps"], plan.index.ids
        shares = []
        for r in range(len(infos)):
            chunks = plan.rank_chunks(r)
            rows = plan.rows(chunks)
            cuts = np.array([0] + [b for _, b, _ in plan.relative(chunks)], dtype=np.int64)
            shares.append((steps[rows], cuts, ids[rows]))
        fitted = memory.fit_devices(engine, infos, shares, cfg.analytics(), cfg.input)
        return fitted.chunk_options, fitted.notes

    def share(self, cfg, comm, plan, chunks: np.ndarray) -> tuple:
        if cfg.distribute == "read":
            return (self.read(cfg, plan.rows(chunks)) if chunks.size else None,
                    plan.relative(chunks))
        arrays = None
        if comm.Get_rank() == ROOT:
            book = plan.index.extra["book"]
            arrays = book.arrays(plan.rows(plan.todo))   # every rank's, rank after rank
        lengths = np.diff(plan.grid)[plan.todo]
        bounds = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)[plan.bounds]
        mine = OptionRows.from_arrays(distribute(comm, arrays, bounds, cfg.distribute))
        if comm.Get_rank() == ROOT:
            mine.trees = plan.index.extra["book"].trees
        return mine, plan.relative(chunks)

    def read(self, cfg, rows):
        if isinstance(rows, slice):
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        part = read_portfolio_rows(cfg.input, rows, values=False)    # judged with the lattices
        checked = checked_rows(cfg, part, book_rules=cfg.invalid != "skip")
        status = checked.status if checked.status is not None \
            else np.zeros(len(part), dtype=np.int8)
        return OptionRows(checked.cols, part.id, status, checked.trees)

    def chunk_work(self, cfg, book, chunks: list) -> tuple[list, list]:
        steps, analytics = book.cols["steps"], cfg.analytics()
        nodes = [nodes_priced(steps[a:b], analytics) for a, b, _ in chunks]
        return nodes, nodes

    def setup(self, cfg, started, book, chunks: list, values: np.ndarray, stats: dict) -> None:
        # price, then the Greeks, then with --invalid skip each option's status; an implied
        # volatility's solver writes each solved row's status
        if cfg.implied:
            values[:, -1] = PRICED
        if book is not None and cfg.invalid == "skip":
            values[:, -1] = book.status
        if started.error is not None:
            raise started.error
        engine = started.engine
        stats["backend"] = engine.name
        engine.fit_device(stats["fit"])       # before prepare() sizes the buffers
        if book is None:
            return
        priced = book.status == PRICED
        if priced.any():
            steps = book.cols["steps"]
            engine.prepare(steps if priced.all() else steps[priced], levels=cfg.greeks)

    def price(self, cfg, started, book, chunks: list, values: np.ndarray, stats: dict):
        if book is None:
            return
        analytics = cfg.analytics()
        steps = book.cols["steps"]
        for k in run_chunks(started.engine, book.cols, book.status == PRICED, chunks, cfg.tree,
                            book.id, analytics, values):
            a, b, _ = chunks[k]
            if cfg.implied:    # the lattices the searches priced, not the cost model's estimate
                iterations = values[a:b, analytics.outputs.index("iterations")]
                yield k, float(np.nansum(iterations * lattice_nodes(steps[a:b])))
            else:
                yield k, nodes_priced(steps[a:b], analytics)

    def describe(self, book) -> int:
        return book.trees if book is not None else 0

    def attrs(self, cfg, backend: str) -> dict:
        return {}

    def written(self, cfg, results) -> dict:
        """write_results' arguments for the book's results (parts.write_file)."""
        full, outputs = results.values, results.names
        trees = int(np.bitwise_or.reduce(np.array(results.described, dtype=np.int64))) \
            if results.described else 0
        attrs = {**provenance(results.hosts, results.gpus), "backend": results.backend,
                 "tree": ",".join(tree_names(trees)), "partition": cfg.partition,
                 "distribute": cfg.distribute, "greeks": bool(cfg.greeks),
                 "richardson": bool(cfg.richardson)}
        if cfg.invalid == "skip" or cfg.implied:
            attrs["status_reasons"] = json.dumps({str(code): text
                                                  for code, text in status_reasons(cfg).items()})
        run_stats = {"seconds": np.asarray(results.rank_seconds, dtype=float),
                     "options": np.asarray(results.rank_rows, dtype=np.int64),
                     "nodes": np.asarray(results.rank_work, dtype=float),
                     "threads": np.asarray(results.threads, dtype=np.int64)}
        scenario = np.array([name.startswith(SCENARIO) for name in outputs])
        extra = {name: full[:, j] for j, name in enumerate(outputs)
                 if name != "price" and not scenario[j]}
        scenarios = (cfg.analytics().scenarios, full[:, scenario]) if scenario.any() else None
        if scenarios is not None:
            attrs["scenarios"] = json.dumps(scenarios[0].settings())
        if "status" in extra:
            extra["status"] = extra["status"].astype(np.int8)
        if "iterations" in extra:
            extra["iterations"] = np.nan_to_num(extra["iterations"]).astype(np.int64)  # 0 skipped
        return {"ids": results.ids, "prices": full[:, 0], "attrs": attrs, "run_stats": run_stats,
                "extra": extra, "scenarios": scenarios}


def status_reasons(cfg) -> dict:
    """What each status code of the run's results means."""
    if not cfg.implied:
        return REASONS
    from pricer.model.implied import REASONS as SEARCH

    return {**REASONS, 0: "converged", **SEARCH}


def _merge_cuts(grid: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The sorted union of the chunk grid and the ranks' bounds (both sorted). np.union1d hashes
    or sorts all of it, where the grid can hold hundreds of thousands of chunks."""
    bounds = np.unique(bounds)           # a few numbers: ranks + 1
    at = np.searchsorted(grid, bounds)
    new = (at == grid.size) | (grid[np.minimum(at, grid.size - 1)] != bounds)
    return np.insert(grid, at[new], bounds[new]).astype(np.int64)


register_family(OptionBook())
