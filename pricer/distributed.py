"""Stage 5: the MPI master–worker (SPMD): rank 0 reads, validates and partitions; the portfolio moves
as one float64 matrix (Bcast or Scatterv), or with --distribute read every rank reads and validates
its own rows of the input file (read-only), each rank computing the same partition from the file's
id and steps columns. Every rank prices its slice (with --greeks/--richardson through
pricer/greeks.py); one Gatherv of an (options, outputs) float64 matrix brings the prices and Greeks
back to rank 0, which writes the results. Single-process runs take the same path with size 1. Each
option's tree travels in the matrix as a code, resolved from the portfolio's `tree` column where it
has one, else from the run's tree.

Failure rules: rank 0 (with --distribute read, every rank for its own rows) checks everything it can
before any collective work, then every rank takes part in one verdict, so bad input makes every rank
exit 2 together with one message (rank 0 prints the lowest failing rank's); anything unexpected later
aborts the whole job (cli.py installs an excepthook that calls MPI Abort), so no rank is ever left
waiting.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from pricer import memory
from pricer.checkpoint import (CHUNK_NODES, CHUNK_ROWS, GPU_CHUNK_NODES, GPU_CHUNK_ROWS, Checkpoint,
                               chunk_grid, split_chunks)
from pricer.engines import get_engine, resolve_backend
from pricer.errors import InputError
from pricer.faults import FailureWatch, chunk_delay, inject, planned_faults, polite_barrier
from pricer.greeks import BUMP, Analytics, bumped, check, price_with_analytics, richardson_steps
from pricer.lattice import TREE_NAMES, lattice_parameters, tree_named
from pricer.partition import PARTITIONERS, assign
from pricer.portfolio import (MATRIX_COLUMNS, columns_from_matrix, lattice_nodes, read_index,
                              read_portfolio, read_portfolio_rows)
from pricer.progress import Progress
from pricer.results import check_output_path, sha256_of_file, utc_now, write_results

DISTRIBUTIONS = ("scatter", "bcast", "read")
STAGES = ("read", "distribute", "setup", "compute", "gather", "write")
ROOT = 0


@dataclass
class RunConfig:
    input: str
    output: str
    backend: str = "auto"
    tree: str = "crr"
    partition: str = "cost"
    distribute: str = "scatter"
    overwrite: bool = False
    threads: int | None = None
    t1: int | None = None   # GPU backends: tiled while a level is wider (None: calibrated/default)
    t2: int | None = None   # hybrid: CPU tail below this width (None: calibrated/default)
    greeks: bool = False      # also delta, gamma, theta, vega, rho (pricer/greeks.py)
    richardson: bool = False  # price extrapolated from the N- and a ~N/2-step lattice (greeks.py)
    checkpoint: str | None = None  # folder where each rank saves its finished chunks (checkpoint.py)
    resume: bool = False      # price only the chunks the checkpoint does not hold yet
    chunk_nodes: float | None = None  # lattice nodes per chunk (the unit of checkpoints and aborts;
                                      # None: by backend, see chunk_shape)
    progress: bool = True     # rank 0 shows the ranks' progress on stderr (progress.py; --quiet: off)

    def engine_overrides(self) -> dict:
        return {key: value for key, value in (("t1", self.t1), ("t2", self.t2)) if value is not None}

    def analytics(self) -> Analytics:
        return Analytics(greeks=self.greeks, richardson=self.richardson)


@dataclass
class RunSummary:
    options: int
    nodes: float
    ranks: int
    backend: str
    wall: float
    stages: dict = field(default_factory=dict)
    analytics: Analytics = Analytics()
    reused: int = 0  # options read back from the checkpoint instead of priced
    engine_start: float = 0.0  # rank 0's engine start (GPU context), beside its read
    notes: list = field(default_factory=list)  # e.g. chunks shrunk to fit the GPUs' memory

    def lines(self) -> list[str]:
        rate = self.nodes / self.wall if self.wall > 0 else float("nan")
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.stages.items())
        extras = [what for what, on in (("Greeks", self.analytics.greeks),
                                        ("Richardson extrapolation", self.analytics.richardson)) if on]
        extras = f" with {' and '.join(extras)}" if extras else ""
        if self.reused:
            extras += f" ({self.reused} of them from the checkpoint)"
        lines = [f"priced {self.options} options{extras} ({self.nodes:.4g} nodes) on {self.ranks} "
                 f"rank(s) with backend {self.backend} in {self.wall:.3f}s ({rate:.3g} nodes/s)",
                 f"stages: {stages}"]
        if self.engine_start >= 0.01:
            lines.append(f"engine started beside the read in {self.engine_start:.3f}s")
        return lines + list(self.notes)


class BadInput(SystemExit):
    """Raised on every rank after rank 0 broadcast a bad-input verdict: exit code 2, no traceback."""

    def __init__(self, code: int = 2):
        super().__init__(code)


def launcher_world_size() -> int | None:
    """The world size the launcher promised, where it says so (to catch silent singletons)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    if "SLURM_STEP_ID" in os.environ and os.environ.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        return int(os.environ["SLURM_STEP_NUM_TASKS"])
    return None


def configure_threads(comm, threads: int | None) -> int:
    """Give each rank its share of the node's cores, so ranks on one node don't oversubscribe."""
    import numba

    if threads is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_ranks = node.Get_size()
        node.Free()
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        if cpus and cpus.isdigit():
            threads = int(cpus)
        else:
            threads = max(1, len(os.sched_getaffinity(0)) // local_ranks)
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads


def _row_type(columns: int):
    row = MPI.DOUBLE.Create_contiguous(columns)
    row.Commit()
    return row


def _check_buffer(array: np.ndarray) -> None:
    # Explicit [buffer, counts, displs, type] specs are trusted blindly by MPI.
    assert array.dtype == np.float64 and array.flags.c_contiguous, (array.dtype, array.flags)


def _verdict(comm, status: int, message: str | None = None, own: "OwnRows | None" = None) -> int:
    """Every rank learns every rank's status, so that no rank is left waiting in a collective: 0
    go on; 2 bad input: rank 0 prints the message of the lowest rank that found some, every rank
    exits 2; 1 a bug: the ranks that hit it return (to re-raise it), the others exit 1. With
    --distribute read (`own`), the ranks' partitions must agree (same digest), and the return value
    is the union of the tree codes their rows use (a bit per code); else 0."""
    rank = comm.Get_rank()
    mine = np.array([status, own.digest if own else 0, own.trees if own else 0], dtype=np.int64)
    every = np.empty((comm.Get_size(), 3), dtype=np.int64)
    comm.Allgather(mine, every)
    statuses = every[:, 0].copy()
    if own is not None and not statuses.any() and (every[:, 1] != every[0, 1]).any():
        statuses[ROOT] = 2   # e.g. numpy builds that round the cost sums differently
        message = ("with --distribute read the ranks computed different partitions of the portfolio "
                   "(different numpy builds or processors?); use --distribute scatter")
    if (statuses == 1).any():
        if status == 1:
            return 0
        raise BadInput(1)
    if (statuses == 2).any():
        sender = int(np.flatnonzero(statuses == 2)[0])
        text = _bcast_text(comm, message if rank == sender else None, sender)
        if rank == ROOT:
            print(f"pricer: error: {'' if sender == ROOT else f'rank {sender}: '}{text}",
                  file=sys.stderr, flush=True)
        raise BadInput(2)
    return int(np.bitwise_or.reduce(every[:, 2]))


def _bcast_text(comm, text: str | None, root: int) -> str:
    """A message from rank `root` to every rank, as a byte buffer (its length first)."""
    data = np.frombuffer((text or "").encode(), dtype=np.uint8) if comm.Get_rank() == root else None
    length = np.array([data.size if data is not None else 0], dtype=np.int64)
    comm.Bcast(length, root=root)
    if data is None:
        data = np.empty(int(length[0]), dtype=np.uint8)
    comm.Bcast(data, root=root)
    return data.tobytes().decode()


def distribute(comm, matrix, bounds: np.ndarray, how: str) -> np.ndarray:
    """Each rank's slice of the portfolio matrix (rows bounds[r]:bounds[r+1])."""
    rank, ncols = comm.Get_rank(), len(MATRIX_COLUMNS)
    counts = np.diff(bounds)
    row = _row_type(ncols)
    try:
        if how == "bcast":
            if rank != ROOT:
                matrix = np.empty((int(bounds[-1]), ncols))
            _check_buffer(matrix)
            comm.Bcast([matrix, int(bounds[-1]), row], root=ROOT)
            return matrix[bounds[rank]:bounds[rank + 1]]
        local = np.empty((int(counts[rank]), ncols))
        if rank == ROOT:
            _check_buffer(matrix)
            send = [matrix, counts, bounds[:-1], row]
        else:
            send = None
        comm.Scatterv(send, [local, int(counts[rank]), row], root=ROOT)
        return local
    finally:
        row.Free()


def gather_rows(comm, values: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """Rank 0 gets the (bounds[-1], k) float64 matrix of every rank's (n_local, k) rows, in rank
    order: one Gatherv of contiguous k-double rows (as the portfolio matrix is scattered)."""
    _check_buffer(values)
    assert values.ndim == 2 and values.shape[0] == bounds[comm.Get_rank() + 1] - bounds[comm.Get_rank()]
    ncols = values.shape[1]
    row = _row_type(ncols)
    try:
        full = np.empty((int(bounds[-1]), ncols)) if comm.Get_rank() == ROOT else None
        recv = [full, np.diff(bounds), bounds[:-1], row] if full is not None else None
        comm.Gatherv([values, values.shape[0], row], recv, root=ROOT)
    finally:
        row.Free()
    return full


@dataclass
class Plan:
    """Rank 0's decisions before any work: the rows to price and how they are cut."""
    input_ids: np.ndarray   # every option's id, in input order (the results' id column)
    trees: list             # the names of the trees that price the run
    input_sha256: str
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

    def assemble(self, priced: np.ndarray) -> np.ndarray:
        """The whole (n, k) result: the gathered rows, and a resume's chunks from the checkpoint."""
        if self.todo is None:
            return priced
        full = np.empty((len(self.input_ids), priced.shape[1]))
        full[self.todo] = priced
        for (a, b), chunk in self.reuse:
            full[a:b] = self.checkpoint.load(chunk)
        return full


def _check_launcher(size: int) -> None:
    expected = launcher_world_size()
    if expected is not None and expected != size:
        raise InputError(f"the launcher started {expected} processes but MPI sees a world of "
                         f"{size}: mpi4py is linked to a different MPI than the launcher's")


def _plan(cfg: RunConfig, size: int, node_ranks: int, prepare) -> Plan:
    """Rank 0 only: every check, then the rows each rank prices, chunk by chunk."""
    _check_launcher(size)
    if prepare is not None:
        prepare()
    portfolio, matrix, input_sha256 = _read_and_check(cfg)
    _check_memory(cfg, len(portfolio), portfolio.steps, portfolio.tree is not None, size, node_ranks)
    trees = portfolio.trees_used(cfg.tree)
    if not cfg.checkpoint:
        return _plan_whole(cfg, portfolio.id, portfolio.steps, matrix, input_sha256, trees,
                           assign(portfolio.steps, size, cfg.partition))
    grid = chunk_grid(portfolio.steps, *chunk_shape(cfg))
    checkpoint = Checkpoint(cfg.checkpoint)
    checkpoint.open(input_sha256, _checkpoint_settings(cfg, grid), cfg.resume)
    outputs = len(cfg.analytics().outputs)
    done = checkpoint.done(grid, outputs) if cfg.resume else np.zeros(len(grid) - 1, bool)
    missing = np.flatnonzero(~done)
    todo = np.flatnonzero(np.repeat(~done, np.diff(grid)))
    lengths = np.diff(grid)[missing]
    cuts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    costs = np.add.reduceat(lattice_nodes(portfolio.steps), grid[:-1])[missing] if len(missing) \
        else np.zeros(0)
    bounds = cuts[split_chunks(costs, size)]
    reuse = [((int(grid[j]), int(grid[j + 1])), int(j)) for j in np.flatnonzero(done)]
    return Plan(portfolio.id, trees, input_sha256, np.ascontiguousarray(matrix[todo]),
                portfolio.steps[todo], portfolio.id[todo], todo, bounds, cuts,
                missing.astype(np.int64), reuse, checkpoint)


def _plan_whole(cfg: RunConfig, input_ids: np.ndarray, input_steps: np.ndarray,
                matrix: np.ndarray | None, input_sha256: str, trees: list, assignment) -> Plan:
    """Every row priced; each rank's rows as partition.assign placed them: contiguous slices, or
    whole options in another order (then rows travel in that order and Plan.assemble undoes it).
    `matrix` None: the ranks read their own rows (--distribute read)."""
    if assignment.in_input_order():
        todo, rows, ids, steps = None, matrix, input_ids, input_steps
    else:
        todo = assignment.order
        rows = None if matrix is None else np.ascontiguousarray(matrix[todo])
        ids, steps = input_ids[todo], input_steps[todo]
    cuts = _merge_cuts(chunk_grid(steps, *chunk_shape(cfg)), assignment.bounds)
    return Plan(input_ids, trees, input_sha256, rows, steps, ids, todo, assignment.bounds, cuts,
                np.full(len(cuts) - 1, -1), [], None)


@dataclass
class OwnRows:
    """--distribute read: the rows one rank read and checked for itself."""
    matrix: np.ndarray   # its rows of the portfolio matrix, in plan order
    ids: np.ndarray      # their ids
    digest: int          # of the partition it computed (every rank's must agree)
    trees: int           # the tree codes its rows use, a bit per code


def _plan_own_rows(cfg: RunConfig, size: int, rank: int, node_ranks: int):
    """--distribute read, on every rank: the partition from the file's id and steps columns (the
    same on every rank), then this rank's own rows, read and checked; rank 0 also makes the Plan
    (without the matrix) and does the whole-file checks. Returns (plan or None, OwnRows)."""
    if rank == ROOT:
        _check_launcher(size)
    _check_settings(cfg)
    if rank == ROOT:
        check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(sha256_of_file, cfg.input) if rank == ROOT else None
        index = read_index(cfg.input)
        assignment = assign(index.steps, size, cfg.partition)
        rows = assignment.order[assignment.bounds[rank]:assignment.bounds[rank + 1]]
        part = read_portfolio_rows(cfg.input, rows)   # a part's rows are in input order
        matrix = part.to_matrix(cfg.tree)
        _check_lattices(cfg, matrix, part.id)
        codes = np.unique(matrix[:, -1]).astype(np.int64)
        own = OwnRows(matrix, part.id, _assignment_digest(assignment),
                      int(np.bitwise_or.reduce(np.left_shift(1, codes))) if codes.size else 0)
        plan = None
        if rank == ROOT:
            _check_memory(cfg, len(index), index.steps, index.has_tree, size, node_ranks)
            plan = _plan_whole(cfg, index.id, index.steps, None, digest.result(), [], assignment)
    return plan, own


def _assignment_digest(assignment) -> int:
    """64 bits of a hash of the partition, to check that every rank computed the same one."""
    h = hashlib.sha256(assignment.bounds.astype(np.int64).tobytes())
    if not assignment.in_input_order():
        h.update(assignment.order.astype(np.int64).tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def _merge_cuts(grid: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The sorted union of the chunk grid and the ranks' bounds (both sorted). np.union1d hashes
    or sorts all of it: 0.25 s for the 370 000-chunk grid of a million large options on the CPU."""
    bounds = np.unique(bounds)           # a few numbers: ranks + 1
    at = np.searchsorted(grid, bounds)
    new = (at == grid.size) | (grid[np.minimum(at, grid.size - 1)] != bounds)
    return np.insert(grid, at[new], bounds[new]).astype(np.int64)


def chunk_shape(cfg: RunConfig) -> tuple[float, int]:
    """(nodes, rows) per chunk. Each chunk is one engine call: a GPU call pays a launch tail as
    long as its largest option and a few ms of set-up, so GPU backends take chunks ~4000x larger
    (about a second of one GPU's work; 2**28 nodes measured 10x slower end to end on the H200)."""
    gpu = resolve_backend(cfg.backend) in ("gpu", "hybrid", "batch")
    nodes = cfg.chunk_nodes if cfg.chunk_nodes is not None else (GPU_CHUNK_NODES if gpu else CHUNK_NODES)
    return nodes, GPU_CHUNK_ROWS if gpu else CHUNK_ROWS


def _checkpoint_settings(cfg: RunConfig, grid: np.ndarray) -> dict:
    """What changes the numbers in a chunk file, or which rows a chunk holds."""
    nodes, rows = chunk_shape(cfg)
    return {"tree": cfg.tree, "backend": resolve_backend(cfg.backend), "greeks": cfg.greeks,
            "richardson": cfg.richardson, "chunk_nodes": float(nodes),
            "chunk_rows": rows, "chunks": len(grid) - 1}


def _check_memory(cfg: RunConfig, options: int, steps: np.ndarray, has_tree: bool, size: int,
                  node_ranks: int) -> None:
    analytics = cfg.analytics()
    threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // node_ranks)
    est = memory.estimate(options, len(analytics.outputs), size, node_ranks, chunk_shape(cfg)[1],
                          int(steps.max()), 1 + 4 * analytics.greeks + analytics.richardson,
                          threads, has_tree, cfg.distribute == "bcast", cfg.distribute == "read")
    memory.check(est, cfg.input)


def _read_and_check(cfg: RunConfig):
    """Rank 0 only: everything that can be wrong with the input, found before any work."""
    _check_settings(cfg)
    check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
    # the file's hash (for the results and checkpoints) is read beside the parsing: hashlib and the
    # file reads release the GIL, and on a large input it is a fifth of rank 0's read stage
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(sha256_of_file, cfg.input)
        portfolio = read_portfolio(cfg.input)
        matrix = portfolio.to_matrix(cfg.tree)  # the tree column, or the run's tree, as codes
        _check_lattices(cfg, matrix, portfolio.id)
        input_sha256 = digest.result()
    return portfolio, matrix, input_sha256


# options whose lattices are checked at a time: the check builds every parameter of an option (~150
# bytes of temporaries), which for a whole book of 10 million options was a fifth of rank 0's peak
CHECK_ROWS = 1 << 20


def _check_lattices(cfg: RunConfig, matrix: np.ndarray, ids: np.ndarray) -> None:
    """Every option's lattice exists (p in (0, 1)), also those that --greeks/--richardson add;
    block by block (a message names the first block's bad options)."""
    for a in range(0, max(len(matrix), 1), CHECK_ROWS):
        block = slice(a, a + CHECK_ROWS)
        cols = columns_from_matrix(matrix[block])
        try:
            lattice_parameters(cols, cfg.tree, ids=ids[block])
            _check_analytics(cols, cfg, ids[block])
        except InputError as exc:
            raise InputError(f"{cfg.input}: {exc}") from None


def _check_analytics(cols: dict, cfg: RunConfig, ids: np.ndarray) -> None:
    """What --greeks/--richardson cannot price, refused by id on rank 0 (so that no rank fails
    later, alone): greeks.check's rules, then the extra lattices they price must exist too — the
    volatility- and rate-bumped copies (--greeks) and the coarse M ~ N/2-step one (--richardson) —
    since an option near the edge of p in (0, 1), or a joshi4 option at M = 1, can fail there only."""
    analytics = cfg.analytics()
    check(cols, analytics, ids)
    extra = []
    if analytics.greeks:
        extra += [(f"--greeks reprices each option with volatility and rate bumped by +-{BUMP}", c)
                  for c in bumped(cols)]
    if analytics.richardson:
        half = dict(cols)
        half["steps"] = richardson_steps(cols["steps"])
        extra.append(("--richardson also prices each option on M ~ N/2 steps", half))
    for what, part in extra:
        try:
            lattice_parameters(part, cfg.tree, ids=ids)
        except InputError as exc:
            raise InputError(f"{what}, and {exc}") from None


def _check_settings(cfg: RunConfig) -> None:
    """Settings can come from a job file, past argparse's choices: check them all by name."""
    tree_named(cfg.tree)
    resolve_backend(cfg.backend)
    for key, allowed in (("partition", PARTITIONERS), ("distribute", DISTRIBUTIONS)):
        if getattr(cfg, key) not in allowed:
            raise InputError(f"{key} must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")
    if cfg.threads is not None and (not _whole(cfg.threads) or cfg.threads < 1):
        raise InputError(f"threads must be a whole number >= 1, got {cfg.threads!r}")
    for key, value in cfg.engine_overrides().items():
        if not _whole(value) or value < 0:
            raise InputError(f"{key} must be a whole number >= 0, got {value!r}")
    if cfg.resume and not cfg.checkpoint:
        raise InputError("--resume needs --checkpoint DIR (the folder of the run to resume)")
    if cfg.checkpoint and cfg.distribute == "read":
        raise InputError("--checkpoint needs --distribute scatter or bcast (rank 0 reads the "
                         "checkpoint and hands out only the chunks still to price), not read")
    if cfg.chunk_nodes is not None and (not isinstance(cfg.chunk_nodes, (int, float))
                                        or isinstance(cfg.chunk_nodes, bool) or not cfg.chunk_nodes >= 1):
        raise InputError(f"chunk_nodes must be a number >= 1, got {cfg.chunk_nodes!r}")
    for key in ("greeks", "richardson", "resume"):
        if not isinstance(getattr(cfg, key), bool):
            raise InputError(f"{key} must be true or false, got {getattr(cfg, key)!r}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def run(cfg: RunConfig, comm=None, prepare=None) -> RunSummary | None:
    """Price cfg.input into cfg.output on every rank of comm; returns the summary on rank 0.
    `prepare`, if given, runs on rank 0 first (a job's portfolio generation)."""
    comm = comm or MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    stages = {}
    node_ranks = _node_ranks(comm)
    reading = cfg.distribute == "read"    # every rank reads its own rows
    if reading and prepare is not None:   # the input is made before anyone reads it
        _outcome(comm, prepare if rank == ROOT else None)
        prepare = None
    plan, own, status, message, failure = None, None, 0, None, None
    # the plan is made in a second thread (rank 0's, or with --distribute read every rank's own
    # rows) while every rank starts its engine (a GPU context: ~0.2 s that does not shrink with
    # more ranks, so it goes beside the read rather than after it)
    with ThreadPoolExecutor(max_workers=1) as pool:
        if reading:
            planned = pool.submit(_plan_own_rows, cfg, size, rank, node_ranks)
        else:
            planned = pool.submit(_plan, cfg, size, node_ranks, prepare) if rank == ROOT else None
        started = _start_engine(cfg)
        if planned is not None:
            result, status, message, failure = _attempt(planned.result)
            if status == 0:
                plan, own = result if reading else (result, None)
    polite_barrier(comm)  # the others sleep while rank 0 reads, rather than spin on its cores
    # every rank's GPU memory, measured now that every engine has started, to rank 0, which fits
    # every rank's share to it or refuses the run before the verdict (memory.py, device memory)
    infos = comm.gather(memory.device_info(started.engine), root=ROOT)
    fitted = None
    if rank == ROOT and status == 0:
        fitted, status, message, failure = _attempt(
            lambda: _fit_devices(cfg, plan, started.engine, infos))
    trees = _verdict(comm, status, message, own)
    if failure is not None:
        raise failure
    if reading and rank == ROOT:
        plan.trees = [name for code, name in enumerate(TREE_NAMES) if trees >> code & 1]
    threads = configure_threads(comm, cfg.threads)
    device = _bcast_array(comm, (fitted.settings if fitted is not None else np.zeros(size))
                          if rank == ROOT else None)

    bounds = _bcast_array(comm, plan.bounds if rank == ROOT else None)
    cuts = _bcast_array(comm, plan.cuts if rank == ROOT else None)
    chunk_ids = _bcast_array(comm, plan.chunk_ids if rank == ROOT else None)
    stages["read"] = time.perf_counter() - t_start

    t = time.perf_counter()
    if reading:
        local = own.matrix
    else:
        local = distribute(comm, plan.matrix if rank == ROOT else None, bounds, cfg.distribute)
    stages["distribute"] = time.perf_counter() - t

    t = time.perf_counter()
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    # ids only name options in messages: rank 0 has them, a reading rank its own; the others use
    # global row numbers (rank 0 checked every option already, so no message is expected from them)
    if reading:
        ids = own.ids
    else:
        ids = plan.ids[lo:hi] if rank == ROOT else np.arange(lo, hi, dtype=np.int64)
    mine = (cuts >= lo) & (cuts <= hi)
    chunks = [(int(a) - lo, int(b) - lo, int(c)) for a, b, c in
              zip(cuts[mine][:-1], cuts[mine][1:], chunk_ids[mine[:-1] & mine[1:]])]
    # every rank reports its finished chunks; rank 0 shows them against all the nodes to price
    tracker = Progress(comm, cfg.progress, cuts, bounds,
                       _nodes_priced(plan.steps, cfg.analytics()) if rank == ROOT else 0.0)
    values, engine_name, setup = _compute(comm, cfg, local, ids, chunks, started, int(device[rank]),
                                          progress=tracker)
    compute = time.perf_counter() - t - setup
    stages["setup"] = setup
    stages["compute"] = compute

    t = time.perf_counter()
    full = gather_rows(comm, values, bounds)
    stats = np.array([compute, local.shape[0],
                      _nodes_priced(local[:, MATRIX_COLUMNS.index("steps")], cfg.analytics()), threads],
                     dtype=np.float64)
    all_stats = np.empty((size, 4)) if rank == ROOT else None
    comm.Gather(stats, all_stats, root=ROOT)
    stages["gather"] = time.perf_counter() - t
    if rank != ROOT:
        return None

    t = time.perf_counter()
    full = plan.assemble(full)
    wall = time.perf_counter() - t_start
    analytics = cfg.analytics()
    attrs = {"backend": engine_name, "tree": ",".join(plan.trees), "ranks": size,
             "partition": cfg.partition, "distribute": cfg.distribute, "wall_seconds": wall,
             "utc_time": utc_now(), "input_sha256": plan.input_sha256,
             "input_path": os.path.abspath(cfg.input)}
    attrs["greeks"], attrs["richardson"] = bool(cfg.greeks), bool(cfg.richardson)
    run_stats = {"seconds": all_stats[:, 0], "options": all_stats[:, 1].astype(np.int64),
                 "nodes": all_stats[:, 2], "threads": all_stats[:, 3].astype(np.int64)}
    extra = {name: full[:, j] for j, name in enumerate(analytics.outputs) if name != "price"}
    write_results(cfg.output, plan.input_ids, full[:, 0], attrs, run_stats, extra=extra)
    stages["write"] = time.perf_counter() - t
    return RunSummary(options=len(plan.input_ids), nodes=float(all_stats[:, 2].sum()), ranks=size,
                      backend=engine_name, wall=time.perf_counter() - t_start, stages=stages,
                      analytics=analytics, reused=len(plan.input_ids) - int(bounds[-1]),
                      engine_start=started.seconds, notes=fitted.notes if fitted else [])


@dataclass
class StartedEngine:
    """An engine made before the input was read, or why it could not be made (raised only once
    pricing starts, so that a failure goes through FailureWatch like any other)."""
    engine: object = None
    error: Exception | None = None
    seconds: float = 0.0


def _start_engine(cfg: RunConfig) -> StartedEngine:
    """The engine, warmed up where it can be (BatchEngine.warm_up; PRICER_WARM_START=0 skips it,
    for measurements)."""
    start = time.perf_counter()
    try:
        engine = get_engine(cfg.backend, **cfg.engine_overrides())
        warm_up = getattr(engine, "warm_up", None)
        if warm_up is not None and os.environ.get("PRICER_WARM_START", "1") != "0":
            warm_up()
    except Exception as exc:  # noqa: BLE001 - bad settings are named by rank 0's checks instead
        return StartedEngine(error=exc, seconds=time.perf_counter() - start)
    return StartedEngine(engine=engine, seconds=time.perf_counter() - start)


def _compute(comm, cfg: RunConfig, local: np.ndarray, ids: np.ndarray, chunks: list,
             started: StartedEngine, device: int = 0, progress: Progress | None = None):
    """This rank's slice, chunk by chunk (each saved to the checkpoint, if any). A failure here is
    reported to rank 0, which names the rank and ends the job (pricer/faults.py). `device` is rank
    0's fit of this rank's GPU memory (0: as it is; batch: chunk_options; gpu/hybrid: the most
    bytes of batch-kernel arrays per engine call, so a chunk may be priced in several calls)."""
    rank = comm.Get_rank()
    watch, faults = FailureWatch(comm), planned_faults(rank)
    checkpoint = Checkpoint(cfg.checkpoint) if cfg.checkpoint else None
    analytics = cfg.analytics()
    values = np.empty((local.shape[0], len(analytics.outputs)))  # price, then the Greeks
    done, engine_name, setup = 0, resolve_backend(cfg.backend), 0.0
    progress = progress or Progress()
    try:
        if started.error is not None:
            raise started.error
        engine, engine_name = started.engine, started.engine.name
        profile = memory.device_profile(engine) if device else None
        if profile is not None and profile.backend == "batch":
            engine.runner.chunk_options = device   # before prepare() sizes the buffers
        setup = _prepare_engine(engine, cfg, local)
        progress.start()
        for a, b, chunk in chunks:
            inject(faults, rank, done)
            watch.poll()
            for c, d in _engine_calls(profile, device, local, a, b, analytics):
                outputs = price_with_analytics(engine, columns_from_matrix(local[c:d]), cfg.tree,
                                               ids[c:d], analytics)
                for j, name in enumerate(analytics.outputs):
                    values[c:d, j] = outputs[name]
            if checkpoint is not None:
                checkpoint.save(chunk, values[a:b])
            done += 1
            if progress.enabled:
                progress.chunk_done(_nodes_priced(local[a:b, MATRIX_COLUMNS.index("steps")], analytics))
            chunk_delay()
        inject(faults, rank, done)
    except Exception as exc:  # noqa: BLE001 - any failure must end the job, named by rank 0
        watch.failed(done, exc)
    # so that rank 0's "gather" is the gather, not the wait for the slowest rank (it shows the
    # progress meanwhile)
    watch.barrier(idle=progress.poll)
    progress.finish()
    return values, engine_name, setup


def _engine_calls(profile, budget: int, local: np.ndarray, a: int, b: int, analytics) -> list:
    """Rows a:b in one engine call, or for gpu/hybrid under a device budget in consecutive calls
    whose batch-kernel arrays fit it (an option's price does not depend on its call)."""
    if profile is None or profile.backend == "batch":
        return [(a, b)]
    steps = local[a:b, MATRIX_COLUMNS.index("steps")].astype(np.int64)
    cuts = a + memory.split_calls(memory.gpu_call_bytes(profile, steps, analytics), budget)
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def _fit_devices(cfg: RunConfig, plan: Plan, engine, infos: list):
    """Rank 0: memory.fit_devices for every rank's share, with rank 0's engine settings (every
    rank runs the same backend with the same settings); None where no rank measured a GPU."""
    profile = memory.device_profile(engine)
    if profile is None or all(info is None for info in infos):
        return None
    steps = plan.steps.astype(np.int64)
    shares = []
    for r in range(len(infos)):
        lo, hi = int(plan.bounds[r]), int(plan.bounds[r + 1])
        first, last = np.searchsorted(plan.cuts, [lo, hi])   # bounds are cuts
        cuts = plan.cuts[first:last + 1] - lo
        shares.append((steps[lo:hi], cuts, plan.ids[lo:hi]))
    return memory.fit_devices(profile, infos, shares, cfg.analytics(), cfg.input)


def _prepare_engine(engine, cfg: RunConfig, local: np.ndarray) -> float:
    """The rest of the engine's one-time set-up for this slice (the kernels and buffers it needs),
    timed apart from the pricing so that a scaling study shows what does not shrink with more ranks."""
    start = time.perf_counter()
    prepare = getattr(engine, "prepare", None)
    if prepare is not None and local.shape[0]:
        steps = local[:, MATRIX_COLUMNS.index("steps")].astype(np.int64)
        prepare(steps, levels=cfg.greeks)
    return time.perf_counter() - start


def _node_ranks(comm) -> int:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def _attempt(action):
    """(result, status, message, failure) of action() in _verdict's terms: status 0 and its
    result; 2 and the message of an InputError (bad input); 1 and the exception (a bug: every rank
    stops, this one re-raises it)."""
    try:
        return action(), 0, None, None
    except InputError as exc:
        return None, 2, str(exc), None
    except Exception as exc:  # noqa: BLE001 - a bug: see above
        return None, 1, None, exc


def _outcome(comm, action) -> None:
    """Rank 0 runs `action` (the others pass None) and everyone learns how it went: an InputError
    makes every rank exit 2 with its message, a bug every rank exit 1 (rank 0 re-raises it)."""
    _, status, message, failure = _attempt(action) if action is not None else (None, 0, None, None)
    _verdict(comm, status, message)
    if failure is not None:
        raise failure


def _bcast_array(comm, array: np.ndarray | None) -> np.ndarray:
    """An int64 array of rank 0's, on every rank (its length first, then the buffer)."""
    length = np.array([len(array) if comm.Get_rank() == ROOT else 0], dtype=np.int64)
    comm.Bcast(length, root=ROOT)
    out = np.ascontiguousarray(array, dtype=np.int64) if comm.Get_rank() == ROOT \
        else np.empty(int(length[0]), dtype=np.int64)
    comm.Bcast(out, root=ROOT)
    return out


def _nodes_priced(steps: np.ndarray, analytics: Analytics) -> float:
    """Lattice nodes a slice really costs: (N+1)(N+2)/2 per lattice — with --greeks the base and
    its four bumped copies, with --richardson also the coarse M ~ N/2-step lattice."""
    nodes = lattice_nodes(steps).sum() * (5 if analytics.greeks else 1)
    if analytics.richardson:
        nodes += lattice_nodes(richardson_steps(steps)).sum()
    return float(nodes)
