"""The Hull–White bond options (pricer/model/hw1f.py, pricer/io/bonds.py) as a family of the run
(families.Family; the run itself: pipeline.py). `pricer price` prices a file's /bond_options by
it; the option run then prices the file's /portfolio, if any, and one file holds both.

- index: the ids and the columns a tree's size follows from (io/bonds.read_bond_index); a row's
  cost is its tree's nodes, both sweeps (bond_book.tree_shapes);
- grid: chunks by tree nodes, and at most CHUNK_STEPS tree steps a chunk (its per-step arrays
  bound a chunk's memory, on the host and on a GPU);
- price: a GPU's next chunk's trees are built on a thread while it prices this one; a CPU engine
  has the cores itself, and its chunks' trees are built in turn.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from pricer.errors import InputError, first_ids
from pricer.model import bond_book
from pricer.run import memory
from pricer.run.chunks import chunk_grid
from pricer.run.config import rank_threads
from pricer.run.families import Family, Index, register_family

CHUNK_STEPS = 1 << 24        # tree steps a chunk: 25 bytes each on the host, as many on a GPU
TREE_THREADS = 4             # the threads that build a chunk's trees beside a GPU


class BondOptions(Family):
    name = "bonds"
    group = "bond_options"
    noun = "bond options"
    label = "bond"
    work = "tree nodes"
    reasons = bond_book.REASONS
    units = {"id": "the input's instrument id",
             "price": "currency of face and strike (NaN where status is not 0)",
             "status": "code: 0 priced, else the reason in /results' bond_status_reasons"}

    def index(self, cfg, size: int, node_ranks: int) -> Index:
        from pricer.io.bonds import read_bond_book, read_bond_index

        index = read_bond_index(cfg.input)
        read_bond_book(cfg.input, rows=slice(0, 0))     # the curves and the default, checked here
        steps, jmax, nodes = bond_book.tree_shapes(index)
        # a row's nodes as the option run counts them (one lattice's), against two sweeps a tree
        return Index(index["id"], 2.0 * nodes, {"steps": steps, "jmax": jmax, "nodes": nodes})

    def check_memory(self, cfg, index: Index, node_ranks: int, size: int) -> None:
        """Refuse a book whose index, a rank's rows and a chunk's trees exceed the node's memory."""
        steps, jmax = index.extra["steps"], index.extra["jmax"]
        n = steps.size
        threads = rank_threads(cfg.threads, node_ranks)     # capped at the cores, as the run's
        chunk = min(float(steps.sum() + n), CHUNK_STEPS)
        working = memory.bond_working_bytes(chunk, 2.0 * jmax.max(initial=0.0) + 1.0, threads)
        share = -(-n // size)
        row = len(bond_book.BOND_COLUMNS) * 8 + 3 * 16      # the columns, as read and as typed
        other = share * (2 * row + len(self.outputs) * 8) + working
        root = n * (4 * 8 + 3 * len(self.outputs) * 8) + other   # the index, gathered results
        room, source = memory.available_memory(node_ranks=node_ranks)
        memory.check(memory.Estimate(float(root), float(other), room, node_ranks, source),
                     cfg.input)

    def grid(self, cfg, index: Index) -> np.ndarray:
        steps, nodes = index.extra["steps"], index.extra["nodes"]
        chunk_nodes, chunk_rows = cfg.chunk_shape()
        return np.union1d(
            chunk_grid(nodes, chunk_nodes / 2.0, chunk_rows,
                       prefix=np.concatenate(([0.0], np.cumsum(nodes)))),
            chunk_grid(steps, CHUNK_STEPS, chunk_rows,
                       prefix=np.concatenate(([0.0], np.cumsum(steps + 1.0))))).astype(np.int64)

    def settings(self, cfg) -> dict:
        return {"spacing": cfg.bond_spacing}

    def read(self, cfg, rows: slice):
        from pricer.io.bonds import read_bond_book
        return read_bond_book(cfg.input, invalid=cfg.invalid, rows=rows)

    def chunk_work(self, cfg, book, chunks: list) -> tuple[list, list]:
        _, _, shapes = bond_book.tree_shapes(book.columns)
        tree = np.where(book.status == 0, shapes, 0.0)
        return ([2.0 * float(tree[a:b].sum()) for a, b, _ in chunks],
                [2.0 * float(shapes[a:b].sum()) for a, b, _ in chunks])

    def price(self, cfg, engine, book, chunks: list, values: np.ndarray, stats: dict):
        # the trees' builder: the rank's share of the cores (config.configure_threads); beside a
        # GPU, at most TREE_THREADS, which leave the engine's host work its cores
        threads = numba.get_num_threads()
        if engine.uses_gpu:
            threads = min(threads, TREE_THREADS)
        storage = bond_book.StepBuffers()     # one chunk's trees at a time (below)
        fills = getattr(engine, "fills_steps", False)   # a GPU fills the per-step arrays itself
        at = np.concatenate(([0], np.cumsum([b - a for a, b, _ in chunks]))).astype(np.int64)

        def prepared(k: int):
            numba.set_num_threads(threads)     # numba's count is per thread: this one's, set
            a, b, _ = chunks[k]
            keep = np.flatnonzero(book.status[a:b] == 0) + a
            if not keep.size:
                return keep, None
            return keep, bond_book.tree_parameters(
                {key: v[keep] for key, v in book.columns.items()}, book.curves, buffers=storage,
                fill=not fills, spacing=cfg.bond_spacing)

        def complete(k, keep, call):
            a, b, _ = chunks[k]
            mine = values[at[k]:at[k + 1]]
            mine[:, 1] = book.status[a:b]
            if call is None:
                return 0.0
            mine[keep - a, 0] = engine.finish(call[0])
            wrong = (mine[:, 1] == 0) & ~np.isfinite(mine[:, 0])
            mine[wrong, 1] = bond_book.NO_VALUE     # refused by judge, unless --invalid skip
            mine[wrong, 0] = np.nan
            return call[1]

        # a GPU's next chunk's trees are built on a thread while it prices this one
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pricer-bonds") \
            if engine.uses_gpu else _InTurn()
        try:
            ahead = pool.submit(prepared, 0) if chunks else None
            pending = None                  # the chunk started on the engine, not finished
            # chunk k is started on the engine before chunk k - 1 is finished (Engine.start): a
            # GPU copies k's trees while it prices k - 1's. Once start() returns, the engine
            # holds its own copy (or the prices): only then is chunk k + 1 built, in the same
            # storage
            for k in range(len(chunks)):
                t = time.perf_counter()
                keep, params = ahead.result()
                stats["waited"] += time.perf_counter() - t
                call = None if params is None else (engine.start(params),
                                                    2.0 * float(params.nodes().sum()))
                ahead = pool.submit(prepared, k + 1) if k + 1 < len(chunks) else None
                if pending is not None:
                    yield pending[0], complete(*pending)
                pending = (k, keep, call)
            if pending is not None:
                yield pending[0], complete(*pending)
        finally:        # a failure reports at once, without waiting for the next chunk's trees
            pool.shutdown(wait=False, cancel_futures=True)

    def judge(self, cfg, ids: np.ndarray, values: np.ndarray) -> None:
        """Without --invalid skip, InputError naming the rows whose tree gave no finite value
        (status bond_book.NO_VALUE; the bounds of check_columns should make it unreachable)."""
        wrong = values[:, -1] == bond_book.NO_VALUE
        if cfg.invalid != "skip" and wrong.any():
            raise InputError(f"{cfg.input}: the Hull–White trees of bond option id(s) "
                             f"{first_ids(ids, wrong)} gave no finite value", ids=ids[wrong])

    def attrs(self, cfg, backend: str) -> dict:
        return {"bond_backend": backend, "bond_spacing": cfg.bond_spacing,
                "bond_status_reasons": json.dumps({str(k): v for k, v in self.reasons.items()})}

    def notes(self, engine, waited: list) -> list:
        return [f"bond compute: the ranks waited {min(waited):.3f}-{max(waited):.3f}s for their "
                "chunks' trees (built beside the GPU)"] if engine.uses_gpu else []


class _InTurn:
    """ThreadPoolExecutor's submit and shutdown, the work done at once on the calling thread."""

    def submit(self, work, *args):
        from concurrent.futures import Future
        future = Future()
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            future.set_exception(exc)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


register_family(BondOptions())
