"""A run over a book of bond options (the Hull–White family, pricer/model/hw1f.py): the option
run's shape (driver.py) for the second family, on the same collectives, chunk grid, checkpoint
files and failure handling. `pricer price` calls it for a file's /bond_options; the option run
then prices the file's /portfolio, if any, and writes both (results.write_results).

1. plan: rank 0 reads the book's index (io/bonds.read_bond_index: the ids, and the columns a
   tree's size follows from) while every rank starts its engine; checks the memory, cuts the
   book into chunks by tree nodes (chunks.chunk_grid over bond_book.tree_shapes' node
   counts, and at most CHUNK_STEPS tree steps a chunk: its per-step arrays bound a chunk's
   memory, on the host and on a GPU), finds the chunks a checkpoint holds, and splits the others
   over the ranks by their nodes; one verdict.
2. read: every rank reads and checks its own rows (io/bonds.read_bond_book of its span of the
   file; with --invalid skip the rows that break a rule keep their status instead); one verdict,
   so that bad input anywhere makes every rank exit 2, the lowest rank's message printed.
3. compute: each rank prices its chunks with its backend's engine of the family
   (engines.get_engine(backend, "bonds")), the next chunk's trees built on a thread meanwhile,
   saving each chunk to the checkpoint; a failure is reported to rank 0, which names the rank and ends the
   job (faults.FailureWatch). Rank 0 shows the ranks' progress as the option run does
   (progress.py: tree nodes of both sweeps).
4. gather: one Gatherv of the (price, status) rows to rank 0.

A rank's rows never travel: the file is read in parallel, and the run's serial part is rank 0's
index (4 numbers a row) and the results.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numba
import numpy as np

from pricer import __version__, compiling
from pricer.engines import get_engine, resolve_backend, set_local_rank
from pricer.errors import InputError, OutputError, first_ids
from pricer.io.checkpoint import Checkpoint
from pricer.io.formats import HDF5, output_format
from pricer.io.results import sha256_beside, utc_now, write_results
from pricer.model import bond_book
from pricer.model.validity import reasons_text
from pricer.run import memory
from pricer.run.chunk_loop import ChunkLoop
from pricer.run.chunks import chunk_grid, split_chunks
from pricer.run.collectives import (ROOT, attempt, bcast_array, check_launcher, gather_rows,
                                    node_ranks, verdict)
from pricer.run.config import configure_threads, kept, threads_text
from pricer.run.plan import claim
from pricer.run.progress import Progress

CHUNK_STEPS = 1 << 24        # tree steps a chunk: 25 bytes each on the host, as many on a GPU
OUTPUTS = ("price", "status")
TREE_THREADS = 4             # the threads that build a chunk's trees beside a GPU


@dataclass
class BondResults:
    """Rank 0's results of a bond run, in the book's order."""
    ids: np.ndarray
    price: np.ndarray
    status: np.ndarray          # int8: 0 priced, else bond_book.REASONS' code
    nodes: float                # tree nodes priced (both sweeps)
    ranks: int
    backend: str
    seconds: dict = field(default_factory=dict)
    reused: int = 0             # read back from the checkpoint
    notes: list = field(default_factory=list)
    rank_seconds: list = field(default_factory=list)    # each rank's compute stage
    threads: list = field(default_factory=list)         # each rank's CPU threads
    spacing: str = "variance"   # the trees' node spacing (hw1f.SPACINGS)
    elapsed: float | None = None    # the bond part's wall time, from its start to its write's end

    def table(self) -> dict:
        """The results' columns (write_results' bonds)."""
        return {"id": self.ids, "price": self.price, "status": self.status}

    @property
    def wall(self) -> float:
        """The part's wall time: what passed, not only its stages (the claim and checks too)."""
        return self.elapsed if self.elapsed is not None else sum(self.seconds.values())

    def lines(self) -> list[str]:
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        lines = [f"priced {int((self.status == 0).sum())} bond options ({self.nodes:.4g} tree "
                 f"nodes) on {self.ranks} rank(s){threads_text(self.threads)} with backend "
                 f"{self.backend} in {self.wall:.3f}s"
                 + (f" ({self.reused} of them from the checkpoint)" if self.reused else ""),
                 f"bond stages: {stages}"]
        skipped = int((self.status != 0).sum())
        if skipped:
            lines.append(f"--invalid skip: {skipped} of {self.status.size} bond options not "
                         f"priced ({reasons_text(self.status, bond_book.REASONS)})")
        return lines + self.notes

    def record(self) -> dict:
        """The summary as data (RunSummary.record's keys)."""
        return {"family": "bonds", "task": "price", "instruments": int(self.ids.size),
                "nodes": self.nodes, "ranks": self.ranks, "backend": self.backend,
                "wall": self.wall, "stages": dict(self.seconds),
                "rank_seconds": list(self.rank_seconds), "threads": list(self.threads),
                "reused": self.reused}


@dataclass
class _Plan:
    """Rank 0's decisions: the chunks to price and which rank prices which."""
    ids: np.ndarray             # every instrument's id, in the book's order
    grid: np.ndarray            # chunk boundaries in book rows
    todo: np.ndarray            # the chunks to price (their numbers in the grid), in order
    bounds: np.ndarray          # rank r prices chunks todo[bounds[r]:bounds[r + 1]]
    reuse: np.ndarray           # the chunks read back from the checkpoint
    checkpoint: Checkpoint | None
    notes: list
    nodes: float = 0.0          # the chunks to price: their trees' nodes, both sweeps


def checkpoint_folder(cfg, with_options: bool) -> str | None:
    """The bond chunks' checkpoint: the run's folder, or beside it `FOLDER.bonds` where the file
    also holds options (whose chunks have the folder)."""
    if not cfg.checkpoint:
        return None
    return cfg.checkpoint.rstrip("/") + ".bonds" if with_options else cfg.checkpoint


def _make_plan(cfg, size: int, node_ranks: int, digest, folder: str | None) -> _Plan:
    """Rank 0: the book's index (read_bond_index: ids, and what each tree's size follows from),
    the memory check, the chunk grid, the checkpoint's chunks, the ranks' shares by nodes."""
    from pricer.io.bonds import read_bond_book, read_bond_index

    index = read_bond_index(cfg.input)
    read_bond_book(cfg.input, rows=slice(0, 0))     # the curves and the default, checked here
    if index["id"].size == 0:
        raise InputError(f"{cfg.input}: /bond_options holds no bond options")
    steps, jmax, nodes = bond_book.tree_shapes(index)
    _check_memory(cfg, steps, jmax, node_ranks, size)
    chunk_nodes, chunk_rows = cfg.chunk_shape()
    # a chunk's nodes as the option run counts them (one lattice's), against two sweeps a tree
    grid = np.union1d(
        chunk_grid(nodes, chunk_nodes / 2.0, chunk_rows,
                   prefix=np.concatenate(([0.0], np.cumsum(nodes)))),
        chunk_grid(steps, CHUNK_STEPS, chunk_rows,
                   prefix=np.concatenate(([0.0], np.cumsum(steps + 1.0))))).astype(np.int64)
    done = np.zeros(grid.size - 1, dtype=bool)
    checkpoint, notes = None, []
    if folder:
        checkpoint = Checkpoint(folder)
        settings = {"pricer": __version__, "family": "bond_options",
                    "backend": resolve_backend(cfg.backend), "chunks": int(grid.size - 1),
                    "chunk_nodes": float(chunk_nodes), "chunk_rows": int(chunk_rows),
                    "spacing": cfg.bond_spacing,
                    **({"invalid": "skip"} if cfg.invalid == "skip" else {})}
        if checkpoint.open(digest.result(), settings):
            done, failed = checkpoint.done(grid, len(OUTPUTS))
            if failed:
                notes.append(f"checkpoint: {failed} bond chunk file(s) failed their checks and "
                             "were priced again")
            for j in np.flatnonzero(done):      # a saved tree that gave no finite value
                a, b = int(grid[j]), int(grid[j + 1])
                _no_finite_value(cfg, index["id"][a:b],
                                 checkpoint.load(int(j), b - a, len(OUTPUTS))[:, 1])
    todo = np.flatnonzero(~done).astype(np.int64)
    costs = np.add.reduceat(nodes, grid[:-1])[todo] if todo.size else np.zeros(0)
    return _Plan(index["id"], grid, todo, split_chunks(costs, size),
                 np.flatnonzero(done).astype(np.int64), checkpoint, notes,
                 2.0 * float(costs.sum()))


def _check_memory(cfg, steps: np.ndarray, jmax: np.ndarray, node_ranks: int, size: int) -> None:
    """Refuse a book whose index, a rank's rows and a chunk's trees exceed the node's memory."""
    n = steps.size
    threads = cfg.threads or 1
    chunk = min(float(steps.sum() + n), CHUNK_STEPS)
    working = memory.bond_working_bytes(chunk, 2.0 * jmax.max(initial=0.0) + 1.0, threads)
    share = -(-n // size)
    row = len(bond_book.BOND_COLUMNS) * 8 + 3 * 16      # the columns, as read and as typed
    other = share * (2 * row + len(OUTPUTS) * 8) + working
    root = n * (4 * 8 + 3 * len(OUTPUTS) * 8) + other   # the index, the gathered results
    room, source = memory.available_memory(node_ranks=node_ranks)
    memory.check(memory.Estimate(float(root), float(other), room, node_ranks, source), cfg.input)


def _own_rows(cfg, grid: np.ndarray, chunks: np.ndarray):
    """This rank's rows (the chunks `chunks`, in order), read and checked by it: (the BondBook
    of the span from its first chunk to its last, the chunks as (a, b, chunk) rows of it)."""
    from pricer.io.bonds import read_bond_book

    if not chunks.size:
        return None, []
    lo, hi = int(grid[chunks[0]]), int(grid[chunks[-1] + 1])
    book = read_bond_book(cfg.input, invalid=cfg.invalid, rows=slice(lo, hi))
    return book, [(int(grid[j]) - lo, int(grid[j + 1]) - lo, int(j)) for j in chunks]


def run_bonds(cfg, comm, node_ranks: int, digest, folder: str | None) -> BondResults | None:
    """Price the book of cfg.input's /bond_options on every rank of comm (module doc); rank 0
    gets the results, the others None. Bad input makes every rank exit 2 (BadInput)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    clock = compiling.StageClock()     # a first run's compile a stage of its own
    # rank 0 plans while every rank starts its engine (a GPU's context and kernels)
    with ThreadPoolExecutor(max_workers=1) as pool:
        planned = pool.submit(attempt, lambda: _make_plan(cfg, size, node_ranks, digest, folder)) \
            if rank == ROOT else None
        engine, status, message, failure = attempt(lambda: get_engine(cfg.backend, "bonds"))
        if planned is not None:
            plan, p_status, p_message, p_failure = planned.result()
            if p_status:
                status, message, failure = p_status, p_message, p_failure
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    grid, todo, bounds = (bcast_array(comm, getattr(plan, name) if rank == ROOT else None)
                          for name in ("grid", "todo", "bounds"))
    clock.lap("plan")
    read, status, message, failure = attempt(
        lambda: _own_rows(cfg, grid, todo[bounds[rank]:bounds[rank + 1]]))
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    book, chunks = read
    clock.lap("read")
    # the ranks' chunks: rank r's are todo[bounds[r]:bounds[r + 1]] (the chunks as the "rows")
    tracker = Progress(comm, cfg.progress, np.arange(todo.size + 1), bounds,
                       plan.nodes if rank == ROOT else 0.0)
    values, nodes, waited = _compute(comm, cfg, book, chunks, engine, folder, tracker)
    compute_seconds = clock.lap("compute")
    # a tree that gives no finite value (the bounds of check_columns should make it unreachable):
    # skipped with its status, or the run refused by every rank together (no rank left waiting)
    mine = np.concatenate([book.id[a:b] for a, b, _ in chunks]) if chunks else np.zeros(0, int)
    _, status, message, failure = attempt(lambda: _no_finite_value(cfg, mine, values[:, 1]))
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    waits = comm.gather(waited, root=ROOT)
    threads = numba.get_num_threads()
    ranks = comm.gather((compute_seconds, threads), root=ROOT)
    clock.restart()
    lengths = np.diff(grid)[todo]
    rows = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)[bounds]
    full = gather_rows(comm, values, rows)
    total = comm.reduce(nodes, root=ROOT)
    clock.lap("gather")
    if rank != ROOT:
        return None
    n = plan.ids.size
    out = np.full((n, len(OUTPUTS)), np.nan)
    if todo.size:
        out[np.concatenate([np.arange(grid[j], grid[j + 1]) for j in todo])] = full
    for j in plan.reuse:
        a, b = int(grid[j]), int(grid[j + 1])
        out[a:b] = plan.checkpoint.load(int(j), b - a, len(OUTPUTS))
    status = out[:, 1].astype(np.int8)
    reused = int(sum(int(grid[j + 1] - grid[j]) for j in plan.reuse))
    notes = plan.notes + ([f"bond compute: the ranks waited {min(waits):.3f}-{max(waits):.3f}s "
                           "for their chunks' trees (built beside the GPU)"]
                          if engine.uses_gpu else [])
    return BondResults(plan.ids, out[:, 0], status, 2.0 * float(total), size,
                       resolve_backend(cfg.backend), clock.result(), reused, notes,
                       rank_seconds=[r[0] for r in ranks], threads=[r[1] for r in ranks],
                       spacing=cfg.bond_spacing)


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


def _no_finite_value(cfg, ids: np.ndarray, status: np.ndarray) -> None:
    """Without --invalid skip, InputError naming the rows whose tree gave no finite value
    (status bond_book.NO_VALUE, which a chunk's rows get as it is finished and saved)."""
    wrong = status == bond_book.NO_VALUE
    if cfg.invalid != "skip" and wrong.any():
        raise InputError(f"{cfg.input}: the Hull–White trees of bond option id(s) "
                         f"{first_ids(ids, wrong)} gave no finite value", ids=ids[wrong])


def _compute(comm, cfg, book, chunks: list, engine, checkpoint: str | None, progress: Progress):
    """This rank's chunks of `book`: (rows, 2) of price and status, the tree nodes it priced (one
    sweep) and the seconds it waited for a chunk's trees. A failure ends the job, named by rank 0
    (FailureWatch); so does a rank that finishes no chunk within its limit (watchdog.py: each
    chunk's limit from its nodes, both sweeps)."""
    if chunks:
        _, _, shapes = bond_book.tree_shapes(book.columns)
        tree = np.where(book.status == 0, shapes, 0.0)
        work = [2.0 * float(tree[a:b].sum()) for a, b, _ in chunks]
        # progress counts a chunk's nodes as the plan does (rows --invalid skip leaves out too)
        counted = [2.0 * float(shapes[a:b].sum()) for a, b, _ in chunks]
    else:
        work = counted = []
    loop = ChunkLoop(comm, cfg, work, counted, progress)
    rows = sum(b - a for a, b, _ in chunks)
    values = np.full((rows, len(OUTPUTS)), np.nan)
    at = np.concatenate(([0], np.cumsum([b - a for a, b, _ in chunks]))).astype(np.int64)
    nodes = 0.0

    # the trees' builder: the rank's share of the cores (config.configure_threads); beside a GPU,
    # at most TREE_THREADS, which leave the engine's host work its cores (docs/decisions.md)
    threads = numba.get_num_threads()
    if engine.uses_gpu:
        threads = min(threads, TREE_THREADS)
    waited = 0.0
    storage = bond_book.StepBuffers()     # one chunk's trees at a time (below)
    fills = getattr(engine, "fills_steps", False)   # a GPU fills the per-step arrays itself

    def prepared(k: int):
        numba.set_num_threads(threads)     # numba's count is per thread: this one's, set
        a, b, _ = chunks[k]
        keep = np.flatnonzero(book.status[a:b] == 0) + a
        if not keep.size:
            return keep, None
        return keep, bond_book.tree_parameters({key: v[keep] for key, v in book.columns.items()},
                                               book.curves, buffers=storage, fill=not fills,
                                               spacing=cfg.bond_spacing)

    # a GPU's next chunk's trees are built on a thread while it prices this one (a CPU engine
    # has the cores itself: its chunks' trees are built in turn, on the same thread)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pricer-bonds") \
        if engine.uses_gpu else _InTurn()
    try:
        loop.attach(checkpoint)
        loop.start()
        ahead = pool.submit(prepared, 0) if chunks else None
        pending = None                  # the chunk started on the engine, not finished

        def complete(k, keep, call):
            nonlocal nodes
            a, b, chunk = chunks[k]
            mine = values[at[k]:at[k + 1]]
            mine[:, 1] = book.status[a:b]
            if call is not None:
                mine[keep - a, 0] = engine.finish(call[0])
                nodes += call[1]
                wrong = (mine[:, 1] == 0) & ~np.isfinite(mine[:, 0])
                mine[wrong, 1] = bond_book.NO_VALUE     # refused after the compute stage,
                mine[wrong, 0] = np.nan                 # unless --invalid skip
            loop.finished(k, chunk, mine)

        # chunk k is started on the engine before chunk k - 1 is finished (Engine.start): a GPU
        # copies k's trees while it prices k - 1's. Once start() returns, the engine holds its
        # own copy (or the prices): only then is chunk k + 1 built, in the same storage
        for k in range(len(chunks)):
            t = time.perf_counter()
            keep, params = ahead.result()
            waited += time.perf_counter() - t
            call = None if params is None else (engine.start(params),
                                                float(params.nodes().sum()))
            ahead = pool.submit(prepared, k + 1) if k + 1 < len(chunks) else None
            if pending is not None:
                complete(*pending)
            pending = (k, keep, call)
        if pending is not None:
            complete(*pending)
    except Exception as exc:  # noqa: BLE001 - any failure must end the job, named by rank 0
        pool.shutdown(wait=False, cancel_futures=True)
        loop.failed(exc)
    pool.shutdown(wait=False)
    loop.end()
    return values, nodes, waited


def price_file_bonds(cfg, comm, with_options: bool):
    """The file's bond options priced (run_bonds); rank 0 gets their results, or, for
    a file of bond options alone, writes them and gets the summary."""
    t_start = time.perf_counter()
    rank = comm.Get_rank()
    ranks_here, local_rank = node_ranks(comm)
    set_local_rank(local_rank)
    configure_threads(cfg.threads, ranks_here, warn=rank == ROOT and cfg.progress
                      and resolve_backend(cfg.backend) == "cpu")
    locks, digest = [], None

    def refuse_options_only_settings():
        check_launcher(comm.Get_size())
        cfg.check()
        unsupported = [flag for flag, on in (("implied-vol", cfg.implied),
                                             ("--greeks", cfg.greeks),
                                             ("--richardson", cfg.richardson),
                                             ("scenarios", cfg.scenarios))
                       if on]
        if unsupported and not with_options:
            raise InputError(f"{cfg.input}: holds bond options only; {', '.join(unsupported)} "
                             "apply to options (/portfolio)")
        if with_options and output_format(cfg.output) != HDF5:
            raise InputError(f"{cfg.output}: a book of options and bond options is written to "
                             "HDF5 only (.h5), each in its own group")
        locks.extend(claim(cfg))
        return sha256_beside(cfg.input)

    if rank == ROOT:
        digest, status, message, failure = attempt(refuse_options_only_settings)
    else:
        status, message, failure = 0, None, None
    try:
        verdict(comm, status, message)
        if failure is not None:
            raise failure
        folder = checkpoint_folder(cfg, with_options)
        results = run_bonds(cfg, comm, ranks_here, digest, folder)
        if rank != ROOT:
            return None
        if with_options:
            results.elapsed = time.perf_counter() - t_start
            return results
        t = time.perf_counter()
        _write_bonds(cfg, results, digest, comm.Get_size(), time.perf_counter() - t_start)
        results.seconds["write"] = time.perf_counter() - t
        results.elapsed = time.perf_counter() - t_start
        return results
    finally:
        for lock in locks:
            lock.release()


def _write_bonds(cfg, results, digest, size: int, wall: float) -> None:
    """Rank 0: a file of bond options alone, its results written (write_results' bonds)."""
    attrs = {**bond_attrs(results), "backend": results.backend, "ranks": size,
             "wall_seconds": wall, "utc_time": utc_now(), "input_path": os.path.abspath(cfg.input),
             "invalid": cfg.invalid, "task": cfg.task}
    try:
        attrs["input_sha256"] = digest.result()
        write_results(cfg.output, None, None, attrs, {"ranks": np.array([size])},
                      bonds=results.table())
    except OSError as exc:
        raise OutputError(f"{cfg.output}: the results could not be written "
                          f"({exc.strerror or exc}); {kept(cfg)}") from None


def bond_attrs(results) -> dict:
    """The provenance a results file adds for its bond options."""
    return {"bond_backend": results.backend, "bond_spacing": results.spacing,
            "bond_status_reasons": json.dumps({str(k): v for k, v in bond_book.REASONS.items()})}
