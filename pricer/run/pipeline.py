"""A family's run (families.Family: the bond options, a plug-in's family) on every rank of a
communicator, on the collectives, chunk grid, checkpoint files and failure handling of every run.

1. plan: rank 0 reads the family's index (ids and a cost per row) while every rank starts its
   engine; checks the memory and the disk's room for the results and the checkpoint, cuts the
   book into chunks (Family.grid), finds the chunks a
   checkpoint holds, and splits the others over the ranks by cost; one verdict.
2. read: every rank reads and checks its own rows (Family.read of its span of the file; with
   --invalid skip the rows that break a rule keep their status instead); one verdict, so that bad
   input anywhere makes every rank exit 2, the lowest rank's message printed.
3. compute: each rank prices its chunks (Family.price), saving each chunk to the checkpoint; a
   failure is reported to rank 0, which names the rank and ends the job (chunk_loop.py); rank 0
   shows the ranks' progress.
4. judge and gather: one verdict on values that cannot be written (Family.judge), one Gatherv of
   the rows to rank 0, which puts a resume's chunks back from the checkpoint.

A rank's rows never travel: the file is read in parallel, and the run's serial part is rank 0's
index and the results. A file of this family alone is written here (price_file_part); a file with
options too is written with them (driver.py).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numba
import numpy as np

from pricer import __version__, compiling
from pricer.engines import resolve_backend, set_local_rank
from pricer.errors import InputError, OutputError
from pricer.io.checkpoint import Checkpoint
from pricer.io.formats import HDF5, output_format
from pricer.io.results import sha256_beside, utc_now, write_results
from pricer.model.validity import reasons_text
from pricer.run.checks import check_disk
from pricer.run.chunk_loop import ChunkLoop
from pricer.run.chunks import split_chunks
from pricer.run.collectives import (ROOT, attempt, bcast_array, check_launcher, gather_rows,
                                    node_ranks, verdict)
from pricer.run.config import configure_threads, kept, threads_text
from pricer.run.families import Family
from pricer.run.plan import claim
from pricer.run.progress import Progress


@dataclass
class FamilyResults:
    """Rank 0's results of a family's run, in the book's order."""
    family: Family
    ids: np.ndarray
    values: np.ndarray          # (rows, outputs) float64: Family.outputs, status last
    work: float                 # the family's work priced (Family.work: tree nodes, say)
    ranks: int
    backend: str
    seconds: dict = field(default_factory=dict)
    reused: int = 0             # read back from the checkpoint
    notes: list = field(default_factory=list)
    rank_seconds: list = field(default_factory=list)    # each rank's compute stage
    threads: list = field(default_factory=list)         # each rank's CPU threads
    attrs: dict = field(default_factory=dict)           # the results file's provenance of it
    elapsed: float | None = None    # the part's wall time, from its start to its write's end

    @property
    def status(self) -> np.ndarray:
        return self.values[:, -1].astype(np.int8)

    def table(self) -> dict:
        """The results' columns (write_results' family tables): id, then the outputs."""
        out = {"id": self.ids}
        for j, name in enumerate(self.family.outputs):
            out[name] = self.values[:, j].astype(np.int8) if name == "status" \
                else self.values[:, j]
        return out

    @property
    def wall(self) -> float:
        """The part's wall time: what passed, not only its stages (the claim and checks too)."""
        return self.elapsed if self.elapsed is not None else sum(self.seconds.values())

    def lines(self) -> list[str]:
        fam = self.family
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        lines = [f"priced {int((self.status == 0).sum())} {fam.noun} ({self.work:.4g} "
                 f"{fam.work}) on {self.ranks} rank(s){threads_text(self.threads)} with backend "
                 f"{self.backend} in {self.wall:.3f}s"
                 + (f" ({self.reused} of them from the checkpoint)" if self.reused else ""),
                 f"{fam.label} stages: {stages}"]
        skipped = int((self.status != 0).sum())
        if skipped:
            lines.append(f"--invalid skip: {skipped} of {self.status.size} {fam.noun} not "
                         f"priced ({reasons_text(self.status, fam.reasons)})")
        return lines + self.notes

    def record(self) -> dict:
        """The summary as data (driver.RunSummary.record's keys)."""
        return {"family": self.family.name, "task": "price", "instruments": int(self.ids.size),
                "nodes": self.work, "ranks": self.ranks, "backend": self.backend,
                "wall": self.wall, "stages": dict(self.seconds),
                "rank_seconds": list(self.rank_seconds), "threads": list(self.threads),
                "reused": self.reused}


@dataclass
class _Plan:
    """Rank 0's decisions: the chunks to price and which rank prices which."""
    ids: np.ndarray             # every row's id, in the book's order
    grid: np.ndarray            # chunk boundaries in book rows
    todo: np.ndarray            # the chunks to price (their numbers in the grid), in order
    bounds: np.ndarray          # rank r prices chunks todo[bounds[r]:bounds[r + 1]]
    reuse: np.ndarray           # the chunks read back from the checkpoint
    checkpoint: Checkpoint | None
    notes: list
    work: float = 0.0           # the chunks to price: their work


def checkpoint_folder(cfg, family: Family, with_options: bool) -> str | None:
    """A family's chunks' checkpoint: the run's folder, or beside it `FOLDER.<name>` where the
    file also holds options (whose chunks have the folder)."""
    if not cfg.checkpoint:
        return None
    return f"{cfg.checkpoint.rstrip('/')}.{family.name}" if with_options else cfg.checkpoint


def _make_plan(family: Family, cfg, size: int, node_ranks: int, digest,
               folder: str | None) -> _Plan:
    """Rank 0: the family's index, the memory check, the chunk grid, the checkpoint's chunks,
    the ranks' shares by cost."""
    index = family.index(cfg)
    if index.ids.size == 0:
        raise InputError(f"{cfg.input}: /{family.group} holds no {family.noun}")
    family.check_memory(cfg, index, node_ranks, size)
    grid = np.asarray(family.grid(cfg, index), dtype=np.int64)
    outputs = len(family.outputs)
    # room for the results and the checkpoint's chunks, before any pricing
    check_disk(cfg, index.ids.size, grid.size - 1 if folder else 0, outputs, folder)
    done = np.zeros(grid.size - 1, dtype=bool)
    checkpoint, notes = None, []
    if folder:
        checkpoint = Checkpoint(folder)
        chunk_nodes, chunk_rows = cfg.chunk_shape()
        settings = {"pricer": __version__, "family": family.group,
                    "backend": resolve_backend(cfg.backend), "chunks": int(grid.size - 1),
                    "chunk_nodes": float(chunk_nodes), "chunk_rows": int(chunk_rows),
                    **family.settings(cfg),
                    **({"invalid": "skip"} if cfg.invalid == "skip" else {})}
        if checkpoint.open(digest.result(), settings):
            done, failed = checkpoint.done(grid, outputs)
            if failed:
                notes.append(f"checkpoint: {failed} {family.label} chunk file(s) failed their "
                             "checks and were priced again")
            for j in np.flatnonzero(done):      # a saved chunk's values judged as a fresh one's
                a, b = int(grid[j]), int(grid[j + 1])
                family.judge(cfg, index.ids[a:b], checkpoint.load(int(j), b - a, outputs))
    todo = np.flatnonzero(~done).astype(np.int64)
    costs = np.add.reduceat(index.cost, grid[:-1])[todo] if todo.size else np.zeros(0)
    return _Plan(index.ids, grid, todo, split_chunks(costs, size),
                 np.flatnonzero(done).astype(np.int64), checkpoint, notes, float(costs.sum()))


def _own_rows(family: Family, cfg, grid: np.ndarray, chunks: np.ndarray):
    """This rank's rows (the chunks `chunks`, in order), read and checked by it: (the family's
    book of the span from its first chunk to its last, the chunks as (a, b, chunk) rows of it)."""
    if not chunks.size:
        return None, []
    lo, hi = int(grid[chunks[0]]), int(grid[chunks[-1] + 1])
    book = family.read(cfg, slice(lo, hi))
    return book, [(int(grid[j]) - lo, int(grid[j + 1]) - lo, int(j)) for j in chunks]


def run_family(family: Family, cfg, comm, node_ranks: int, digest,
               folder: str | None) -> FamilyResults | None:
    """Price the family's rows of cfg.input on every rank of comm (module doc); rank 0 gets the
    results, the others None. Bad input makes every rank exit 2 (BadInput)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    clock = compiling.StageClock()     # a first run's compile a stage of its own
    # rank 0 plans while every rank starts its engine (a GPU's context and kernels)
    with ThreadPoolExecutor(max_workers=1) as pool:
        planned = pool.submit(attempt, lambda: _make_plan(family, cfg, size, node_ranks, digest,
                                                          folder)) if rank == ROOT else None
        engine, status, message, failure = attempt(lambda: family.engine(cfg))
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
        lambda: _own_rows(family, cfg, grid, todo[bounds[rank]:bounds[rank + 1]]))
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    book, chunks = read
    clock.lap("read")
    # the ranks' chunks: rank r's are todo[bounds[r]:bounds[r + 1]] (the chunks as the "rows")
    tracker = Progress(comm, cfg.progress, np.arange(todo.size + 1), bounds,
                       plan.work if rank == ROOT else 0.0)
    values, work, waited = _compute(family, comm, cfg, book, chunks, engine, folder, tracker)
    compute_seconds = clock.lap("compute")
    # values that cannot be written: the rows skipped with their status, or the run refused by
    # every rank together (no rank left waiting)
    mine = np.concatenate([book.id[a:b] for a, b, _ in chunks]) if chunks else np.zeros(0, int)
    _, status, message, failure = attempt(lambda: family.judge(cfg, mine, values))
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
    total = comm.reduce(work, root=ROOT)
    clock.lap("gather")
    if rank != ROOT:
        return None
    outputs = len(family.outputs)
    out = np.full((plan.ids.size, outputs), np.nan)
    if todo.size:
        out[np.concatenate([np.arange(grid[j], grid[j + 1]) for j in todo])] = full
    for j in plan.reuse:
        a, b = int(grid[j]), int(grid[j + 1])
        out[a:b] = plan.checkpoint.load(int(j), b - a, outputs)
    reused = int(sum(int(grid[j + 1] - grid[j]) for j in plan.reuse))
    name = resolve_backend(cfg.backend)
    return FamilyResults(family, plan.ids, out, float(total), size, name, clock.result(), reused,
                         plan.notes + family.notes(engine, waits),
                         rank_seconds=[r[0] for r in ranks], threads=[r[1] for r in ranks],
                         attrs=family.attrs(cfg, name))


def _compute(family: Family, comm, cfg, book, chunks: list, engine, checkpoint: str | None,
             progress: Progress):
    """This rank's chunks of `book`: (rows, outputs) values, the work it priced and the seconds
    it waited for work beside the engine. A failure ends the job, named by rank 0; so does a
    rank that finishes no chunk within its limit (watchdog.py: each chunk's limit from its
    work)."""
    work, shown = family.chunk_work(cfg, book, chunks) if chunks else ([], [])
    loop = ChunkLoop(comm, cfg, work, shown, progress)
    values = np.full((sum(b - a for a, b, _ in chunks), len(family.outputs)), np.nan)
    priced, stats = 0.0, {"waited": 0.0}
    pricing = None
    try:
        loop.attach(checkpoint)
        loop.start()
        at = np.concatenate(([0], np.cumsum([b - a for a, b, _ in chunks]))).astype(np.int64)
        pricing = family.price(cfg, engine, book, chunks, values, stats)
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
    return values, priced, stats["waited"]


def price_file_part(family: Family, cfg, comm, with_options: bool):
    """The file's rows of `family` priced (run_family); rank 0 gets their results, or, for a
    file of the family alone, writes them and gets the results."""
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
        if not with_options:
            refuse_options_settings(cfg, [family])
        if with_options and output_format(cfg.output) != HDF5:
            raise InputError(f"{cfg.output}: a book of options and {family.noun} is written to "
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
        folder = checkpoint_folder(cfg, family, with_options)
        results = run_family(family, cfg, comm, ranks_here, digest, folder)
        if rank != ROOT:
            return None
        if with_options:
            results.elapsed = time.perf_counter() - t_start
            return results
        t = time.perf_counter()
        write_parts(cfg, [results], digest, comm.Get_size(), time.perf_counter() - t_start)
        results.seconds["write"] = time.perf_counter() - t
        results.elapsed = time.perf_counter() - t_start
        return results
    finally:
        for lock in locks:
            lock.release()


def refuse_options_settings(cfg, found: list) -> None:
    """InputError where the settings that apply to options alone (implied-vol, --greeks, ...)
    are given for a file of the families `found` and no options."""
    unsupported = [flag for flag, on in (("implied-vol", cfg.implied), ("--greeks", cfg.greeks),
                                         ("--richardson", cfg.richardson),
                                         ("scenarios", cfg.scenarios)) if on]
    if unsupported and any(family.options_only for family in found):
        raise InputError(f"{cfg.input}: holds {' and '.join(f.noun for f in found)} only; "
                         f"{', '.join(unsupported)} apply to options (/portfolio)")


def write_parts(cfg, parts: list, digest, size: int, wall: float) -> None:
    """Rank 0: a file of families other than options, their results written (write_results'
    tables, one group each)."""
    attrs = {}
    for part in parts:
        attrs.update(part.attrs)
    attrs.update({"backend": parts[0].backend, "ranks": size, "wall_seconds": wall,
                  "utc_time": utc_now(), "input_path": os.path.abspath(cfg.input),
                  "invalid": cfg.invalid, "task": cfg.task})
    try:
        attrs["input_sha256"] = digest.result()
        write_results(cfg.output, None, None, attrs, {"ranks": np.array([size])},
                      tables={p.family.name: (p.table(), p.family.units) for p in parts})
    except OSError as exc:
        raise OutputError(f"{cfg.output}: the results could not be written "
                          f"({exc.strerror or exc}); {kept(cfg)}") from None


@dataclass
class Parts:
    """Rank 0's summary of a file of several families other than options."""
    parts: list                 # FamilyResults

    def lines(self) -> list[str]:
        return [line for part in self.parts for line in part.lines()]

    def record(self) -> dict:
        """The first family's record, the others' under their names (RunSummary.record's)."""
        out = self.parts[0].record()
        out.update({part.family.name: part.record() for part in self.parts[1:]})
        return out
