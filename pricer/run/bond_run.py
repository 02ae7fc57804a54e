"""A run over a book of bond options (the Hull–White family, pricer/model/hw1f.py): the option
run's shape (driver.py) for the second family, on the same collectives, chunk grid, checkpoint
files and failure handling. `pricer price` calls it for a file's /bond_options; the option run
then prices the file's /portfolio, if any, and writes both (results.write_results).

1. agree: rank 0 reads and checks the book (io/bonds.read_bond_book; with --invalid skip the rows
   that break a rule keep their status instead), checks the memory, cuts the book into chunks by
   tree nodes (checkpoint.chunk_grid over the trees' node counts, and at most CHUNK_STEPS tree
   steps a chunk: its per-step arrays bound a chunk's memory, on the host and on a GPU), reads back
   the chunks a checkpoint holds, and splits the others over the ranks by their nodes; one
   verdict, so that bad input makes every rank exit 2.
2. share: the rows to price as one float64 matrix (bond_book.matrix_of), by Scatterv; the
   curves, by a broadcast.
3. compute: each rank prices its chunks with its backend's engine of the family
   (engines.get_bond_engine), saving each to the checkpoint; a failure is reported to rank 0, which
   names the rank and ends the job (faults.FailureWatch).
4. gather: one Gatherv of the (price, status) rows to rank 0.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pricer import __version__
from pricer.engines import get_bond_engine, resolve_backend, set_local_rank
from pricer.errors import InputError, OutputError, first_ids
from pricer.io.checkpoint import Checkpoint, chunk_grid, split_chunks
from pricer.io.formats import HDF5, output_format
from pricer.io.results import sha256_beside, utc_now, write_results
from pricer.model import bond_book
from pricer.run import memory
from pricer.run.collectives import (ROOT, attempt, bcast_array, check_launcher, distribute,
                                    gather_rows, node_ranks, verdict)
from pricer.run.config import configure_threads, kept
from pricer.run.plan import claim
from pricer.run.faults import FailureWatch, chunk_delay, inject, planned_faults

CHUNK_STEPS = 1 << 24        # tree steps a chunk: 25 bytes each on the host, as many on a GPU
OUTPUTS = ("price", "status")


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

    def table(self) -> dict:
        """The results' columns (write_results' bonds)."""
        return {"id": self.ids, "price": self.price, "status": self.status}

    def lines(self) -> list[str]:
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        wall = sum(self.seconds.values())
        lines = [f"priced {int((self.status == 0).sum())} bond options ({self.nodes:.4g} tree "
                 f"nodes) on {self.ranks} rank(s) with backend {self.backend} in {wall:.3f}s"
                 + (f" ({self.reused} of them from the checkpoint)" if self.reused else ""),
                 f"bond stages: {stages}"]
        skipped = int((self.status != 0).sum())
        if skipped:
            codes, counts = np.unique(self.status[self.status != 0], return_counts=True)
            lines.append(f"--invalid skip: {skipped} of {self.status.size} bond options not "
                         "priced (" + "; ".join(f"{c} x {bond_book.REASONS[int(k)]}"
                                                for k, c in zip(codes, counts)) + ")")
        return lines


@dataclass
class _Plan:
    ids: np.ndarray             # every instrument's id, in the book's order
    status: np.ndarray          # every instrument's status (int8)
    matrix: np.ndarray          # the rows to price, in the book's order (the chunks not saved)
    todo: np.ndarray            # their row numbers in the book
    bounds: np.ndarray          # rank r prices matrix rows bounds[r]:bounds[r + 1]
    cuts: np.ndarray            # chunk boundaries in matrix rows (every bound is one)
    chunk_ids: np.ndarray       # each chunk's number in the checkpoint grid (-1: none)
    reuse: list                 # [((a, b), chunk)] book rows read back from the checkpoint
    checkpoint: Checkpoint | None
    curves: list
    nodes: np.ndarray           # tree nodes (one sweep) of the matrix's rows


def checkpoint_folder(cfg, with_options: bool) -> str | None:
    """The bond chunks' checkpoint: the run's folder, or beside it `FOLDER.bonds` where the file
    also holds options (whose chunks have the folder)."""
    if not cfg.checkpoint:
        return None
    return cfg.checkpoint.rstrip("/") + ".bonds" if with_options else cfg.checkpoint


def _make_plan(cfg, size: int, node_ranks: int, digest, folder: str | None) -> _Plan:
    from pricer.io.bonds import read_bond_book

    book = read_bond_book(cfg.input, invalid=cfg.invalid)
    cols, status = book.columns, book.status
    nodes = bond_book.tree_nodes(cols)
    nodes[status != 0] = 1.0
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        steps = bond_book.steps_of(np.asarray(cols["maturity"], np.float64),
                                   np.asarray(cols["steps_per_year"], np.float64))
    steps = np.where(status == 0, steps, 0.0)
    _check_memory(cfg, book, steps, node_ranks, size)
    chunk_nodes, chunk_rows = cfg.chunk_shape()
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
                    **({"invalid": "skip"} if cfg.invalid == "skip" else {})}
        if checkpoint.open(digest.result(), settings):
            done, failed = checkpoint.done(grid, len(OUTPUTS))
            if failed:
                notes.append(f"checkpoint: {failed} bond chunk file(s) failed their checks and "
                             "were priced again")
    missing = np.flatnonzero(~done)
    todo = np.flatnonzero(np.repeat(~done, np.diff(grid)))
    lengths = np.diff(grid)[missing]
    cuts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    costs = np.add.reduceat(nodes, grid[:-1])[missing] if missing.size else np.zeros(0)
    bounds = cuts[split_chunks(costs, size)]
    reuse = [((int(grid[j]), int(grid[j + 1])), int(j)) for j in np.flatnonzero(done)]
    matrix = bond_book.matrix_of({k: np.asarray(v)[todo] for k, v in cols.items()})
    return _Plan(book.id, status, matrix, todo, bounds, cuts, missing.astype(np.int64), reuse,
                 checkpoint, book.curves, nodes[todo])


def _check_memory(cfg, book, steps: np.ndarray, node_ranks: int, size: int) -> None:
    """Refuse a book whose read, matrix and largest chunk's trees exceed the node's memory."""
    n = len(book)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        widths = 2.0 * np.maximum(1.0, np.ceil(bond_book.JMAX_FACTOR / (
            np.asarray(book.columns["mean_reversion"], np.float64)
            * np.asarray(book.columns["maturity"], np.float64) / np.maximum(steps, 1.0)))) + 1.0
    widths = np.where(book.status == 0, widths, 0.0)      # a skipped row builds no tree
    threads = cfg.threads or 1
    chunk = min(float(steps.sum() + n), CHUNK_STEPS)
    working = (chunk * memory.BOND_BYTES_PER_STEP
               + threads * float(widths.max(initial=0.0)) * memory.BOND_BYTES_PER_ROW)
    share = -(-n // size)
    row = len(bond_book.BOND_COLUMNS) * 8
    other = share * (row + len(OUTPUTS) * 8) + working
    root = n * (3 * row + 2 * len(OUTPUTS) * 8) + other
    room, source = memory.available_memory(node_ranks=node_ranks)
    memory.check(memory.Estimate(float(root), float(other), room, node_ranks, source), cfg.input)


def run_bonds(cfg, comm, node_ranks: int, digest, folder: str | None) -> BondResults | None:
    """Price the book of cfg.input's /bond_options on every rank of comm (module doc); rank 0
    gets the results, the others None. Bad input makes every rank exit 2 (BadInput)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    seconds = {}
    t = time.perf_counter()
    plan, status, message, failure = attempt(
        lambda: _make_plan(cfg, size, node_ranks, digest, folder)) if rank == ROOT \
        else (None, 0, None, None)
    started, s_status, s_message, s_failure = attempt(lambda: get_bond_engine(cfg.backend))
    verdict(comm, status or s_status, message or s_message)
    if failure is not None or s_failure is not None:
        raise failure or s_failure
    bounds, cuts, chunk_ids = (bcast_array(comm, getattr(plan, name) if rank == ROOT else None)
                               for name in ("bounds", "cuts", "chunk_ids"))
    curves = comm.bcast(plan.curves if rank == ROOT else None, root=ROOT)
    seconds["read"] = time.perf_counter() - t

    t = time.perf_counter()
    local = distribute(comm, plan.matrix if rank == ROOT else None, bounds, "scatter",
                       len(bond_book.BOND_COLUMNS))
    seconds["distribute"] = time.perf_counter() - t

    t = time.perf_counter()
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    mine = (cuts >= lo) & (cuts <= hi)
    chunks = [(int(a) - lo, int(b) - lo, int(c)) for a, b, c in
              zip(cuts[mine][:-1], cuts[mine][1:], chunk_ids[mine[:-1] & mine[1:]])]
    values, nodes = _compute(comm, cfg, local, curves, chunks, started, folder)
    seconds["compute"] = time.perf_counter() - t

    t = time.perf_counter()
    full = gather_rows(comm, values, bounds)
    total = comm.reduce(nodes, root=ROOT)
    seconds["gather"] = time.perf_counter() - t
    if rank != ROOT:
        return None
    n = plan.ids.size
    price, result_status = np.full(n, np.nan), plan.status.copy()
    price[plan.todo] = full[:, 0]
    for (a, b), chunk in plan.reuse:
        saved = plan.checkpoint.load(chunk, b - a, len(OUTPUTS))
        price[a:b] = saved[:, 0]
    wrong = (result_status == 0) & ~np.isfinite(price)
    if wrong.any():         # the bounds of bond_book.check_columns should make this unreachable
        raise InputError(f"{cfg.input}: the Hull–White trees of bond option id(s) "
                         f"{first_ids(plan.ids, wrong)} gave no finite value", ids=plan.ids[wrong])
    reused = int(sum(b - a for (a, b), _ in plan.reuse))
    return BondResults(plan.ids, price, result_status, 2.0 * float(total), size,
                       resolve_backend(cfg.backend), seconds, reused)


def _compute(comm, cfg, local: np.ndarray, curves: list, chunks: list, engine,
             checkpoint: str | None) -> tuple[np.ndarray, float]:
    """This rank's rows, chunk by chunk: (rows, 2) of price and status, and the tree nodes it
    priced (one sweep). A failure ends the job, named by rank 0 (FailureWatch)."""
    rank = comm.Get_rank()
    watch, faults = FailureWatch(comm), planned_faults(rank)
    values = np.full((local.shape[0], len(OUTPUTS)), np.nan)
    cols = bond_book.columns_of_matrix(local)
    status = bond_book.statuses(cols, curves) if cfg.invalid == "skip" \
        else np.zeros(local.shape[0], dtype=np.int8)
    values[:, 1] = status
    done, nodes = 0, 0.0

    def prepared(k: int):
        a, b, _ = chunks[k]
        keep = np.flatnonzero(status[a:b] == 0) + a
        if not keep.size:
            return keep, None
        return keep, bond_book.tree_parameters({key: v[keep] for key, v in cols.items()}, curves)

    # the next chunk's trees are built on a thread while the engine prices this one
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pricer-bonds")
    try:
        if checkpoint is not None:
            checkpoint = Checkpoint(checkpoint).attach()
        inject(faults, rank, done)
        watch.poll()
        ahead = pool.submit(prepared, 0) if chunks else None
        for k, (a, b, chunk) in enumerate(chunks):
            keep, params = ahead.result()
            ahead = pool.submit(prepared, k + 1) if k + 1 < len(chunks) else None
            if params is not None:
                values[keep, 0] = engine.price(params)
                nodes += float(params.nodes().sum())
            if checkpoint is not None:
                checkpoint.save(chunk, values[a:b])
            done += 1
            chunk_delay()
            inject(faults, rank, done)
            if done < len(chunks):
                watch.poll()
    except Exception as exc:  # noqa: BLE001 - any failure must end the job, named by rank 0
        pool.shutdown(wait=False, cancel_futures=True)
        watch.failed(done, exc)
    pool.shutdown(wait=False)
    watch.barrier()
    return values, nodes


def price_file_bonds(cfg, comm, with_options: bool):
    """The file's bond options priced (run_bonds); rank 0 gets their results, or, for
    a file of bond options alone, writes them and gets the summary."""
    t_start = time.perf_counter()
    rank = comm.Get_rank()
    ranks_here, local_rank = node_ranks(comm)
    set_local_rank(local_rank)
    configure_threads(cfg.threads, ranks_here)
    locks, digest = [], None

    def refuse_options_only_settings():
        check_launcher(comm.Get_size())
        cfg.check()
        unsupported = [flag for flag, on in (("implied-vol", cfg.implied),
                                             ("--greeks", cfg.greeks),
                                             ("--richardson", cfg.richardson),
                                             ("scenarios", cfg.scenarios),
                                             ("--distribute read", cfg.distribute == "read"))
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
            return results
        t = time.perf_counter()
        _write_bonds(cfg, results, digest, comm.Get_size(), time.perf_counter() - t_start)
        results.seconds["write"] = time.perf_counter() - t
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
    return {"bond_backend": results.backend,
            "bond_status_reasons": json.dumps({str(k): v for k, v in bond_book.REASONS.items()})}
