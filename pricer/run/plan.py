"""The plan of a run, made before any pricing: which rows each rank prices, cut into which
chunks, and which (with --resume) come back from the checkpoint instead.

- whole: every row; each rank's rows as partition.assign placed them (contiguous slices, or whole
  options in another order, which travel in that order and Plan.assemble puts back);
- resume: the checkpoint's chunk grid, only the chunks not yet saved, split over the ranks by cost;
- own rows (--distribute read): every rank computes the same partition from the file's id and steps
  columns, then reads and checks only its own rows; rank 0 makes the Plan without the matrix.
Chunk boundaries always include the ranks' bounds, so a chunk belongs to one rank.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from pricer.files import OutputLock, check_input_file, check_output_file
from pricer.io.checkpoint import Checkpoint
from pricer.io.portfolio import priced_steps, read_index, read_portfolio_rows
from pricer.io.results import check_output_path, sha256_beside
from pricer import __version__
from pricer.engines import resolve_backend
from pricer.model.cost import lattice_nodes
from pricer.model.partition import assign
from pricer.run.checks import check_disk, check_memory, checked_matrix, read_and_check
from pricer.run.chunks import chunk_grid, split_chunks
from pricer.run.collectives import ROOT, check_launcher
from pricer.run.config import RunConfig


@dataclass
class Plan:
    """Rank 0's decisions before any work: the rows to price and how they are cut."""
    input_ids: np.ndarray   # every option's id, in input order (the results' id column)
    trees: list             # the names of the trees that price the run
    digest: Future          # of the input's sha256 (hex), read beside the run (sha256_beside)
    matrix: np.ndarray | None  # rows to price (all, or a resume's missing chunks), in plan order;
                               # None with --distribute read (every rank reads its own)
    steps: np.ndarray       # their steps (int64)
    ids: np.ndarray         # their ids
    todo: np.ndarray | None  # their row numbers in the portfolio (None: all rows in input order)
    bounds: np.ndarray      # rank r prices matrix rows bounds[r]:bounds[r+1]
    cuts: np.ndarray        # chunk boundaries in matrix rows (every bound is one)
    chunk_ids: np.ndarray   # each chunk's number in the checkpoint grid (-1 without checkpoint)
    reuse: list             # [(rows, checkpoint chunk)] read back instead of priced
    checkpoint: Checkpoint | None
    notes: list = field(default_factory=list)   # for the run's summary
    locks: list = field(default_factory=list)    # rank 0's claims (OutputLock), until written

    @property
    def input_sha256(self) -> str:
        return self.digest.result()

    def assemble(self, priced: np.ndarray) -> np.ndarray:
        """The whole (n, k) result: the gathered rows, and a resume's chunks from the checkpoint."""
        if self.todo is None:
            return priced
        full = np.empty((len(self.input_ids), priced.shape[1]))
        full[self.todo] = priced
        for (a, b), chunk in self.reuse:
            full[a:b] = self.checkpoint.load(chunk, b - a, priced.shape[1])
        return full


def make_plan(cfg: RunConfig, size: int, node_ranks: int, prepare) -> Plan:
    """Rank 0 only: every check, then the rows each rank prices, chunk by chunk. The output (and
    the checkpoint folder) are claimed (OutputLock) once the checks pass and before the checkpoint
    folder is written, so that a refused run writes nothing and two runs never share them."""
    check_launcher(size)
    if prepare is not None:
        prepare()
    portfolio, checked, digest = read_and_check(cfg, size, node_ranks)
    matrix, trees = checked.matrix, checked.tree_names()
    grid = chunk_grid(portfolio.steps, *cfg.chunk_shape()) if cfg.checkpoint else None
    check_disk(cfg, len(portfolio), len(grid) - 1 if grid is not None else 0)
    locks = claim(cfg)
    try:
        if grid is None:
            plan = plan_whole(cfg, portfolio.id, portfolio.steps, matrix, digest, trees,
                              assign(portfolio.steps, size, cfg.partition))
        else:
            plan = _plan_checkpoint(cfg, size, portfolio, matrix, digest, trees, grid)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    plan.locks = locks
    return plan


# targets this process holds for a whole run of several parts (held): a part's claim skips them
_HELD: set = set()


def claim(cfg: RunConfig) -> list:
    """The output, and the checkpoint folder if any, claimed for this run (but for those held for
    the whole run already: held); the output's checks made again under the claim, since a run
    that held it until now may have written it."""
    locks = []
    try:
        for target in filter(None, (cfg.output, cfg.checkpoint)):
            if os.path.normpath(target) not in _HELD:
                locks.append(OutputLock(os.path.normpath(target)).acquire())
        check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
        if cfg.summary_json:     # written at the end: refused now rather than after the work
            check_output_file(cfg.summary_json, cfg.overwrite, "summary")
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


@contextmanager
def held(cfg: RunConfig):
    """Rank 0: the run's claim (claim) held across its parts, a file's bond options and its
    options, which claim nothing again: no other run can take the output between them."""
    locks = claim(cfg)
    targets = {os.path.normpath(t) for t in (cfg.output, cfg.checkpoint) if t}
    _HELD.update(targets)
    try:
        yield
    finally:
        _HELD.difference_update(targets)
        for lock in locks:
            lock.release()


def _plan_checkpoint(cfg, size, portfolio, matrix, digest, trees, grid) -> Plan:
    """The chunks a checkpoint does not hold yet, split over the ranks by cost (the checkpoint's
    manifest binds them to the input's digest: waited for here)."""
    checkpoint = Checkpoint(cfg.checkpoint)
    resumed = checkpoint.open(digest.result(), checkpoint_settings(cfg, grid))
    done, failed = checkpoint.done(grid, len(cfg.outputs())) if resumed \
        else (np.zeros(len(grid) - 1, bool), 0)
    missing = np.flatnonzero(~done)
    todo = np.flatnonzero(np.repeat(~done, np.diff(grid)))
    lengths = np.diff(grid)[missing]
    cuts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    costs = np.add.reduceat(lattice_nodes(portfolio.steps), grid[:-1])[missing] if len(missing) \
        else np.zeros(0)
    bounds = cuts[split_chunks(costs, size)]
    reuse = [((int(grid[j]), int(grid[j + 1])), int(j)) for j in np.flatnonzero(done)]
    notes = [f"checkpoint: {failed} chunk file(s) failed their checks (cut short, changed, or "
             f"another chunk's or run's) and were priced again"] if failed else []
    return Plan(portfolio.id, trees, digest, np.ascontiguousarray(matrix[todo]),
                portfolio.steps[todo], portfolio.id[todo], todo, bounds, cuts,
                missing.astype(np.int64), reuse, checkpoint, notes)


def plan_whole(cfg: RunConfig, input_ids: np.ndarray, input_steps: np.ndarray,
               matrix: np.ndarray | None, digest: Future, trees: list, assignment) -> Plan:
    """Every row priced; each rank's rows as partition.assign placed them: contiguous slices, or
    whole options in another order (then rows travel in that order and Plan.assemble undoes it).
    `matrix` None: the ranks read their own rows (--distribute read)."""
    if assignment.in_input_order():
        todo, rows, ids, steps = None, matrix, input_ids, input_steps
    else:
        todo = assignment.order
        rows = None if matrix is None else np.ascontiguousarray(matrix[todo])
        ids, steps = input_ids[todo], input_steps[todo]
    prefix = assignment.prefix if todo is None else None    # the partition's, in input order
    cuts = _merge_cuts(chunk_grid(steps, *cfg.chunk_shape(), prefix=prefix), assignment.bounds)
    return Plan(input_ids, trees, digest, rows, steps, ids, todo, assignment.bounds, cuts,
                np.full(len(cuts) - 1, -1), [], None)


@dataclass
class OwnRows:
    """--distribute read: the rows one rank read and checked for itself."""
    matrix: np.ndarray   # its rows of the portfolio matrix, in plan order
    ids: np.ndarray      # their ids
    digest: int          # of the partition it computed (every rank's must agree)
    trees: int           # the tree codes its rows use, a bit per code


def plan_own_rows(cfg: RunConfig, size: int, rank: int, node_ranks: int):
    """--distribute read, on every rank: the partition from the file's id and steps columns (the
    same on every rank), then this rank's own rows, read and checked; rank 0 also makes the Plan
    (without the matrix) and does the whole-file checks. Returns (plan or None, OwnRows)."""
    if rank == ROOT:
        check_launcher(size)
    cfg.check()
    check_input_file(cfg.input)   # before any read: a FIFO or a device never ends
    if rank == ROOT:
        check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
        if cfg.summary_json:
            check_output_file(cfg.summary_json, cfg.overwrite, "summary")
    digest = sha256_beside(cfg.input) if rank == ROOT else None
    skip = cfg.invalid == "skip"
    index = read_index(cfg.input, values=not skip)
    if skip:            # every rank alike, from the steps alone
        index.steps = priced_steps(index.steps)
    if rank == ROOT:      # before the rows are read, as read_and_check does
        check_memory(cfg, len(index), max(int(index.steps.max()), 1), index.has_tree, size,
                     node_ranks)
    assignment = assign(index.steps, size, cfg.partition)
    rows = assignment.order[assignment.bounds[rank]:assignment.bounds[rank + 1]]
    # rows in input order; without --invalid skip, their ids and steps are the index's
    part = read_portfolio_rows(cfg.input, rows, values=not skip, index=None if skip else index)
    checked = checked_matrix(cfg, part)
    own = OwnRows(checked.matrix, part.id, _assignment_digest(assignment), checked.trees)
    plan = None
    if rank == ROOT:
        plan = plan_whole(cfg, index.id, index.steps, None, digest, [], assignment)
        check_disk(cfg, len(index), 0)
        plan.locks = claim(cfg)
    return plan, own


def _assignment_digest(assignment) -> int:
    """64 bits of a hash of the partition, to check that every rank computed the same one."""
    h = hashlib.sha256(assignment.bounds.astype(np.int64).tobytes())
    if not assignment.in_input_order():
        h.update(assignment.order.astype(np.int64).tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def _merge_cuts(grid: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The sorted union of the chunk grid and the ranks' bounds (both sorted). np.union1d hashes
    or sorts all of it, where the grid can hold hundreds of thousands of chunks."""
    bounds = np.unique(bounds)           # a few numbers: ranks + 1
    at = np.searchsorted(grid, bounds)
    new = (at == grid.size) | (grid[np.minimum(at, grid.size - 1)] != bounds)
    return np.insert(grid, at[new], bounds[new]).astype(np.int64)


def checkpoint_settings(cfg: RunConfig, grid: np.ndarray) -> dict:
    """What changes the numbers in a chunk file, or which rows a chunk holds."""
    nodes, rows = cfg.chunk_shape()
    return {"pricer": __version__, "tree": cfg.tree, "backend": resolve_backend(cfg.backend),
            "greeks": cfg.greeks,
            "richardson": cfg.richardson, "chunk_nodes": float(nodes),
            "chunk_rows": rows, "chunks": len(grid) - 1,
            **({"invalid": "skip"} if cfg.invalid == "skip" else {}),  # its chunks hold statuses
            **({"task": cfg.task} if cfg.implied else {}),
            **({"scenarios": cfg.analytics().scenarios.settings()} if cfg.scenarios else {})}
