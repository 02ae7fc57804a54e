"""The run of one instrument family (families.Family: the option book, the bond options, a
plug-in's family) on every rank of a communicator, on the collectives, chunk grid, checkpoint
files and failure handling of every run. In two halves, so that a file of several families is
checked whole before any of it is priced (driver.py):

prepare (every family before any pricing):
1. plan: rank 0 reads the family's index (ids and a cost per row; the option book with
   --distribute scatter or bcast reads and checks all of it) while every rank starts its engine;
   checks the disk's room for the results and the checkpoint, cuts the book into chunks
   (Family.grid, or Family.layout's partition), finds the chunks a checkpoint holds, and splits
   the others over the ranks by cost; every rank's GPU is fitted (Family.fit); one verdict.
2. share: every rank gets its own rows, read and checked (Family.share: by default its own read
   of its span of the file; with --invalid skip the rows that break a rule keep their status
   instead); one verdict, so that bad input anywhere makes every rank exit 2, the lowest rank's
   message printed.
Both under a stall watchdog of their own (watchdog.py, OPENING): a rank stuck in its part of them
(rank 0 in a read of the input or the checkpoint that never returns) ends the job, named.

finish:
3. compute: each rank prices its chunks (Family.setup, then Family.price), saving each chunk to
   the checkpoint; a failure is reported to rank 0, which names the rank and ends the job
   (chunk_loop.py); rank 0 shows the ranks' progress.
4. judge and gather: one verdict on values that cannot be written (Family.judge), one Gatherv of
   the rows to rank 0, which puts them back in the book's order and a resume's chunks back from
   the checkpoint. Rank 0 writes every family's results to one file (parts.py).
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numba
import numpy as np

from pricer import __version__, compiling
from pricer.engines import resolve_backend
from pricer.errors import InputError
from pricer.io.checkpoint import Checkpoint
from pricer.run import memory
from pricer.run.checks import check_disk
from pricer.run.chunk_loop import ChunkLoop
from pricer.run.chunks import split_chunks
from pricer.run.collectives import ROOT, attempt, bcast_array, gather_rows, verdict
from pricer.run.faults import PLAN, abort_job, inject, planned_faults, polite_barrier
from pricer.run.families import Family
from pricer.run.parts import FamilyResults
from pricer.run.progress import Progress
from pricer.run.watchdog import StallWatch, opening_limit


@dataclass
class Plan:
    """The chunks to price and which rank prices which (every rank's, once shared); rank 0's
    has the rest."""
    grid: np.ndarray            # chunk boundaries in plan rows
    todo: np.ndarray            # the chunks to price (their numbers in the grid), in order
    bounds: np.ndarray          # rank r prices chunks todo[bounds[r]:bounds[r + 1]]
    order: np.ndarray | None    # plan row i is book row order[i] (None: the book's order)
    numbered: bool = True       # the chunks are the checkpoint grid's (else chunk number -1)
    index: object = None        # rank 0: the family's Index
    reuse: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # read back
    checkpoint: Checkpoint | None = None
    notes: list = field(default_factory=list)

    def rows(self, chunks: np.ndarray):
        """The book rows of `chunks` (numbers in the grid), one chunk after another: a slice where
        they are consecutive rows of the book, else an int64 array."""
        starts, ends = self.grid[chunks], self.grid[chunks + 1]
        if chunks.size and self.order is None and (starts[1:] == ends[:-1]).all():
            return slice(int(starts[0]), int(ends[-1]))
        rows = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in zip(starts, ends)]) \
            if chunks.size else np.zeros(0, np.int64)
        return rows if self.order is None else self.order[rows]

    def rank_chunks(self, rank: int) -> np.ndarray:
        return self.todo[self.bounds[rank]:self.bounds[rank + 1]]

    def relative(self, chunks: np.ndarray) -> list:
        """`chunks` as (a, b, chunk) rows of the book of their rows one after another (rows())."""
        lengths = self.grid[chunks + 1] - self.grid[chunks]
        at = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64).tolist()
        numbers = chunks.tolist() if self.numbered else [-1] * chunks.size
        return list(zip(at[:-1], at[1:], numbers))


@dataclass
class Ready:
    """A family prepared on this rank: its plan, engine and own rows, checked."""
    family: Family
    plan: Plan
    engine: object
    book: object
    chunks: list                # (a, b, chunk) rows of book; their values one after another
    fit: int                    # rank 0's fit of this rank's GPU (0: the engine as it is)
    folder: str | None          # the checkpoint of its chunks
    clock: compiling.StageClock
    parts: dict                 # rank 0: the plan stage's parts (seconds)
    hosts: list | None = None   # rank 0: each rank's host
    gpus: list | None = None    # rank 0: each rank's GPU ("" for none)
    notes: list = field(default_factory=list)


def checkpoint_folder(cfg, family: Family, primary: bool) -> str | None:
    """A family's chunks' checkpoint: the run's folder for the file's first family (its option
    book, where it has one), beside it `FOLDER.<name>` for the others."""
    if not cfg.checkpoint:
        return None
    return cfg.checkpoint if primary else f"{cfg.checkpoint.rstrip('/')}.{family.name}"


def _settings(family: Family, cfg, grid: np.ndarray) -> dict:
    """What a checkpoint's chunk files depend on: a checkpoint made otherwise is not resumed."""
    own = family.checkpoint_settings(cfg, grid)
    if own is not None:
        return own
    chunk_nodes, chunk_rows = cfg.chunk_shape()
    return {"pricer": __version__, "family": family.group,
            "backend": resolve_backend(cfg.backend), "chunks": int(grid.size - 1),
            "chunk_nodes": float(chunk_nodes), "chunk_rows": int(chunk_rows),
            **family.settings(cfg), **({"invalid": "skip"} if cfg.invalid == "skip" else {})}


def make_plan(family: Family, cfg, size: int, node_ranks: int, digest,
              folder: str | None) -> Plan:
    """Rank 0: the family's index, the memory check, the chunk grid (or the family's partition
    where no checkpoint binds the chunks), the disk check, the checkpoint's chunks, the ranks'
    shares by cost."""
    inject(planned_faults(ROOT), ROOT, PLAN)
    index = family.index(cfg, size, node_ranks)
    n = index.ids.size
    if n == 0 and not family.top_level:
        raise InputError(f"{cfg.input}: /{family.group} holds no {family.noun}")
    family.check_memory(cfg, index, node_ranks, size)
    outputs = len(family.columns(cfg))
    layout = None if folder else family.layout(cfg, index, size)
    if layout is not None:          # the family's own partition; chunks numbered by nothing
        order, grid, bounds = layout
        check_disk(cfg, n, 0, outputs, folder)
        return Plan(grid, np.arange(grid.size - 1, dtype=np.int64), bounds, order, False, index)
    grid = np.asarray(family.grid(cfg, index), dtype=np.int64)
    # room for the results and the checkpoint's chunks, before any pricing
    check_disk(cfg, n, grid.size - 1 if folder else 0, outputs, folder)
    done = np.zeros(grid.size - 1, dtype=bool)
    checkpoint, notes = None, []
    if folder:
        checkpoint = Checkpoint(folder)
        if checkpoint.open(digest.result(), _settings(family, cfg, grid)):
            def judge(j: int, values: np.ndarray) -> None:   # as a fresh chunk's values
                family.judge(cfg, index.ids[int(grid[j]):int(grid[j + 1])], values)

            done, failed = checkpoint.done(grid, outputs, judge)
            if failed:
                what = "" if family.top_level else f"{family.label} "
                notes.append(f"checkpoint: {failed} {what}chunk file(s) failed their checks (cut "
                             "short, changed, or another chunk's or run's) and were priced again")
    todo = np.flatnonzero(~done).astype(np.int64)
    costs = np.add.reduceat(index.cost, grid[:-1])[todo] if todo.size else np.zeros(0)
    return Plan(grid, todo, split_chunks(costs, size), None, True, index,
                np.flatnonzero(done).astype(np.int64), checkpoint, notes)


OPENING = "the run's opening stages (its plan, the reads of the input and the checkpoint)"


def prepare_family(family: Family, cfg, comm, node_ranks: int, digest,
                   folder: str | None) -> Ready:
    """Plan and share (module doc) on every rank of comm. Bad input makes every rank exit 2
    (BadInput). Watched (watchdog.StallWatch of the OPENING stage): a rank stuck in its part (rank
    0 in a read of the input or the checkpoint that never returns, a device that never starts)
    or silent ends the job, named, rather than leave the others waiting for it for ever."""
    watch = StallWatch(comm, cfg.stall_timeout,
                       lambda message: abort_job(comm, message, in_thread=True), stage=OPENING)
    try:
        ready = _prepare(family, cfg, comm, node_ranks, digest, folder, watch)
    except BaseException:
        watch.abandon()      # stopped already where every rank ends at a verdict (_agree)
        raise
    watch.stop()
    return ready


def _agree(comm, watch: StallWatch, status: int, message: str | None, failure) -> None:
    """One verdict (collectives.verdict); where it ends the run, every rank ends at it, so each
    stops its watch with the others (their goodbyes) before it leaves."""
    try:
        verdict(comm, status, message)
    except BaseException:
        watch.stop()
        raise
    if failure is not None:
        watch.stop()
        raise failure


def _input_bytes(cfg) -> float:
    try:
        return float(os.path.getsize(cfg.input))
    except OSError:
        return 0.0


def _prepare(family: Family, cfg, comm, node_ranks: int, digest, folder: str | None,
             watch: StallWatch) -> Ready:
    rank, size = comm.Get_rank(), comm.Get_size()
    limit = opening_limit(_input_bytes(cfg), cfg.stall_timeout)
    watch.begin(limit)
    clock = compiling.StageClock()     # a first run's compile a stage of its own
    parts = {"plan": 0.0, "fit": 0.0}
    start = time.perf_counter()

    def planned():
        try:
            return make_plan(family, cfg, size, node_ranks, digest, folder)
        finally:
            parts["plan"] = time.perf_counter() - start

    # rank 0 plans in a second thread while every rank starts its engine (a GPU context does not
    # shrink with more ranks, so it goes beside the read rather than after it)
    with ThreadPoolExecutor(max_workers=1) as pool:
        planning = pool.submit(attempt, planned) if rank == ROOT else None
        t = time.perf_counter()
        engine, status, message, failure = attempt(lambda: family.engine(cfg))
        parts["engine"] = time.perf_counter() - t
        plan = None
        if planning is not None:
            plan, p_status, p_message, p_failure = planning.result()
            if p_status:
                status, message, failure = p_status, p_message, p_failure
    joined = time.perf_counter()
    watch.finished()       # this rank's part done: only its silence is watched while it waits
    polite_barrier(comm)   # the others sleep while rank 0 reads, rather than spin on its cores
    watch.begin(limit)
    # every rank's GPU, measured now that every engine has started, to rank 0, which fits every
    # rank's share to it or refuses the run before the verdict
    gathered = comm.gather((memory.device_info(family.device(engine)), socket.gethostname()),
                           root=ROOT)
    fits, notes = None, []
    if rank == ROOT and status == 0:
        t = time.perf_counter()
        fitted, status, message, failure = attempt(
            lambda: family.fit(cfg, plan, family.device(engine), [g[0] for g in gathered]))
        fits, notes = fitted if fitted is not None else (None, [])
        parts["fit"] = time.perf_counter() - t
    _agree(comm, watch, status, message, failure)
    fit = bcast_array(comm, np.asarray(fits if fits is not None else np.zeros(size), np.int64)
                      if rank == ROOT else None)
    shared = [bcast_array(comm, getattr(plan, name) if rank == ROOT else None)
              for name in ("grid", "todo", "bounds")]
    flags = comm.bcast((plan.order is not None, plan.numbered) if rank == ROOT else None,
                       root=ROOT)
    order = bcast_array(comm, plan.order if rank == ROOT else None) if flags[0] else None
    if rank != ROOT:
        plan = Plan(*shared, order, flags[1])
    parts["agree"] = time.perf_counter() - joined - parts["fit"]
    clock.lap(family.stage_names[0], beside=parts["plan"])
    shared, status, message, failure = attempt(
        lambda: family.share(cfg, comm, plan, plan.rank_chunks(rank)))
    watch.finished()
    _agree(comm, watch, status, message, failure)
    book, chunks = shared
    clock.lap(family.stage_names[1])
    hosts = [host for _, host in gathered] if rank == ROOT else None
    gpus = [f"{info.name} ({info.device})" if info is not None else ""
            for info, _ in gathered] if rank == ROOT else None
    return Ready(family, plan, engine, book, chunks, int(fit[rank]), folder, clock, parts,
                 hosts, gpus, list(notes))


def finish_family(ready: Ready, cfg, comm) -> FamilyResults | None:
    """Compute, judge and gather (module doc); rank 0 gets the results, the others None."""
    family, plan, clock = ready.family, ready.plan, ready.clock
    rank, size = comm.Get_rank(), comm.Get_size()
    stats = {"waited": 0.0, "fit": ready.fit, "setup": 0.0}
    work, shown = family.chunk_work(cfg, ready.book, ready.chunks) if ready.chunks else ([], [])
    total = comm.reduce(float(sum(shown)), root=ROOT)
    # the ranks' chunks: rank r's are todo[bounds[r]:bounds[r + 1]] (the chunks as the "rows")
    tracker = Progress(comm, cfg.progress, np.arange(plan.todo.size + 1), plan.bounds,
                       total if rank == ROOT else 0.0)
    values, priced = _compute(family, comm, cfg, ready, work, shown, tracker, stats)
    setup = stats["setup"] if family.timed_setup else 0.0
    if family.timed_setup:
        clock.stages["setup"] = setup
    compute_seconds = clock.lap("compute", less=setup)
    # values that cannot be written: the rows skipped with their status, or the run refused by
    # every rank together (no rank left waiting)
    ids = np.concatenate([ready.book.id[a:b] for a, b, _ in ready.chunks]) if ready.chunks \
        else np.zeros(0, np.int64)
    _, status, message, failure = attempt(lambda: family.judge(cfg, ids, values))
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    mine = (compute_seconds, numba.get_num_threads(), values.shape[0], priced, stats["waited"],
            stats.get("backend"), family.describe(ready.book))
    ranks = comm.gather(mine, root=ROOT)
    clock.restart()
    lengths = np.diff(plan.grid)[plan.todo]
    rows = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)[plan.bounds]
    full = gather_rows(comm, values, rows)
    clock.lap("gather")
    if rank != ROOT:
        return None
    index = plan.index
    n = index.ids.size
    names = family.columns(cfg)
    if plan.order is None and plan.todo.size == plan.grid.size - 1:
        out = full                  # every chunk priced, in the book's order
    else:
        out = np.full((n, len(names)), np.nan)
        if plan.todo.size:
            out[plan.rows(plan.todo)] = full
        for j in plan.reuse:
            a, b = int(plan.grid[j]), int(plan.grid[j + 1])
            out[a:b] = plan.checkpoint.load(int(j), b - a, len(names))
    reused = int(sum(int(plan.grid[j + 1] - plan.grid[j]) for j in plan.reuse))
    backend = next((r[5] for r in ranks if r[5]), resolve_backend(cfg.backend))
    return FamilyResults(family, index.ids, out, names, float(sum(r[3] for r in ranks)), size,
                         backend, clock.result(), reused,
                         plan.notes + ready.notes + family.notes(ready.engine,
                                                                 [r[4] for r in ranks]),
                         rank_seconds=[r[0] for r in ranks], threads=[r[1] for r in ranks],
                         rank_rows=[r[2] for r in ranks], rank_work=[r[3] for r in ranks],
                         attrs=family.attrs(cfg, backend), described=[r[6] for r in ranks],
                         hosts=ready.hosts, gpus=ready.gpus, read_parts=ready.parts)


def _compute(family: Family, comm, cfg, ready: Ready, work: list, shown: list,
             progress: Progress, stats: dict):
    """This rank's chunks of its book: (rows, outputs) values and the work it priced. A failure
    ends the job, named by rank 0; so does a rank that finishes no chunk within its limit
    (watchdog.py: each chunk's limit from its work)."""
    chunks = ready.chunks
    loop = ChunkLoop(comm, cfg, work, shown, progress)
    values = np.full((sum(b - a for a, b, _ in chunks), len(family.columns(cfg))), np.nan)
    priced = 0.0
    pricing = None
    at = np.concatenate(([0], np.cumsum([b - a for a, b, _ in chunks]))).astype(np.int64)
    try:
        loop.attach(ready.folder)
        t, compiled = time.perf_counter(), compiling.seconds()
        family.setup(cfg, ready.engine, ready.book, chunks, values, stats)
        # a compile inside the set-up is the run's compile stage's (StageClock), not the set-up's
        stats["setup"] = max(0.0, time.perf_counter() - t - (compiling.seconds() - compiled))
        loop.start()
        pricing = family.price(cfg, ready.engine, ready.book, chunks, values, stats)
        for k, done in pricing:
            priced += done
            loop.finished(k, chunks[k][2], values[at[k]:at[k + 1]])
    except Exception as exc:  # noqa: BLE001 - any failure must end the job, named by rank 0
        try:
            if pricing is not None:
                pricing.close()
        finally:
            loop.failed(exc)
    except BaseException:     # an interrupt (the API's caller's): no watchdog outlives the run
        if pricing is not None:
            pricing.close()
        loop.abandon()
        raise
    loop.end()
    return values, priced
