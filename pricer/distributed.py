"""Stage 5: the MPI master–worker (SPMD): rank 0 reads, validates and partitions; the portfolio moves
as one float64 matrix (Bcast or Scatterv); every rank prices its slice (with --greeks/--richardson
through pricer/greeks.py); one Gatherv of an (options, outputs) float64 matrix brings the prices and
Greeks back to rank 0, which writes the results. Single-process runs take the same path with size 1.
Each option's tree travels in the matrix as a code, resolved on rank 0 from the portfolio's `tree`
column where it has one, else from the run's tree.

Failure rules: rank 0 checks everything it can before any collective work and broadcasts a verdict,
so bad input makes every rank exit 2 together; anything unexpected later aborts the whole job
(cli.py installs an excepthook that calls MPI Abort), so no rank is ever left waiting.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from pricer.engines import get_engine, resolve_backend
from pricer.errors import InputError
from pricer.greeks import BUMP, Analytics, bumped, check, price_with_analytics, richardson_steps
from pricer.lattice import lattice_parameters, tree_named
from pricer.partition import PARTITIONERS, partition
from pricer.portfolio import MATRIX_COLUMNS, columns_from_matrix, lattice_nodes, read_portfolio
from pricer.results import check_output_path, sha256_of_file, utc_now, write_results

DISTRIBUTIONS = ("scatter", "bcast")
STAGES = ("read", "distribute", "compute", "gather", "write")
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

    def lines(self) -> list[str]:
        rate = self.nodes / self.wall if self.wall > 0 else float("nan")
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.stages.items())
        extras = [what for what, on in (("Greeks", self.analytics.greeks),
                                        ("Richardson extrapolation", self.analytics.richardson)) if on]
        extras = f" with {' and '.join(extras)}" if extras else ""
        return [f"priced {self.options} options{extras} ({self.nodes:.4g} nodes) on {self.ranks} "
                f"rank(s) with backend {self.backend} in {self.wall:.3f}s ({rate:.3g} nodes/s)",
                f"stages: {stages}"]


class BadInput(SystemExit):
    """Raised on every rank after rank 0 broadcast a bad-input verdict: exit code 2, no traceback."""

    def __init__(self):
        super().__init__(2)


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


def _verdict(comm, message: str | None) -> None:
    """Rank 0 tells everyone whether to go on; a refusal ends every rank with exit code 2."""
    status = np.array([0 if message is None else 2], dtype=np.int64)
    comm.Bcast(status, root=ROOT)
    if status[0]:
        raise BadInput()


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


def _read_and_check(cfg: RunConfig):
    """Rank 0 only: everything that can be wrong with the input, found before any work."""
    _check_settings(cfg)
    check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
    portfolio = read_portfolio(cfg.input)
    input_sha256 = sha256_of_file(cfg.input)
    matrix = portfolio.to_matrix(cfg.tree)  # the tree column, or the run's tree, as codes
    cols = columns_from_matrix(matrix)
    try:
        lattice_parameters(cols, cfg.tree, ids=portfolio.id)
        _check_analytics(cols, cfg, portfolio.id)
    except InputError as exc:
        raise InputError(f"{cfg.input}: {exc}") from None
    return portfolio, matrix, input_sha256


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
    for key in ("greeks", "richardson"):
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
    expected = launcher_world_size()
    message = None
    portfolio = matrix = bounds = input_sha256 = None
    if rank == ROOT:
        try:
            if expected is not None and expected != size:
                raise InputError(f"the launcher started {expected} processes but MPI sees a world of "
                                 f"{size}: mpi4py is linked to a different MPI than the launcher's")
            if prepare is not None:
                prepare()
            portfolio, matrix, input_sha256 = _read_and_check(cfg)
        except InputError as exc:
            message = str(exc)
            print(f"pricer: error: {message}", file=sys.stderr, flush=True)
    _verdict(comm, message)
    threads = configure_threads(comm, cfg.threads)

    n = np.array([len(portfolio) if rank == ROOT else 0], dtype=np.int64)
    comm.Bcast(n, root=ROOT)
    bounds = np.empty(size + 1, dtype=np.int64)
    if rank == ROOT:
        bounds[:] = partition(portfolio.steps, size, cfg.partition)
    comm.Bcast(bounds, root=ROOT)
    stages["read"] = time.perf_counter() - t_start

    t = time.perf_counter()
    local = distribute(comm, matrix, bounds, cfg.distribute)
    stages["distribute"] = time.perf_counter() - t

    t = time.perf_counter()
    columns = columns_from_matrix(local)  # its tree codes were resolved on rank 0
    engine = get_engine(cfg.backend, **cfg.engine_overrides())
    analytics = cfg.analytics()
    # ids only name options in messages: rank 0 has them; the others use global row numbers (rank 0
    # checked every option already, so no message is expected from them)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    ids = portfolio.id[lo:hi] if rank == ROOT else np.arange(lo, hi, dtype=np.int64)
    outputs = price_with_analytics(engine, columns, cfg.tree, ids, analytics)
    values = np.empty((hi - lo, len(analytics.outputs)))  # price, then the Greeks, one row per option
    for j, name in enumerate(analytics.outputs):
        values[:, j] = outputs[name]
    compute = time.perf_counter() - t
    comm.Barrier()  # so that rank 0's "gather" is the gather, not the wait for the slowest rank
    stages["compute"] = time.perf_counter() - t

    t = time.perf_counter()
    full = gather_rows(comm, values, bounds)
    stats = np.array([compute, local.shape[0], _nodes_priced(columns["steps"], analytics), threads],
                     dtype=np.float64)
    all_stats = np.empty((size, 4)) if rank == ROOT else None
    comm.Gather(stats, all_stats, root=ROOT)
    stages["gather"] = time.perf_counter() - t
    if rank != ROOT:
        return None

    t = time.perf_counter()
    wall = time.perf_counter() - t_start
    attrs = {"backend": engine.name, "tree": ",".join(portfolio.trees_used(cfg.tree)), "ranks": size,
             "partition": cfg.partition, "distribute": cfg.distribute, "wall_seconds": wall,
             "utc_time": utc_now(), "input_sha256": input_sha256,
             "input_path": os.path.abspath(cfg.input)}
    attrs["greeks"], attrs["richardson"] = bool(cfg.greeks), bool(cfg.richardson)
    run_stats = {"seconds": all_stats[:, 0], "options": all_stats[:, 1].astype(np.int64),
                 "nodes": all_stats[:, 2], "threads": all_stats[:, 3].astype(np.int64)}
    extra = {name: full[:, j] for j, name in enumerate(analytics.outputs) if name != "price"}
    write_results(cfg.output, portfolio.id, full[:, 0], attrs, run_stats, extra=extra)
    stages["write"] = time.perf_counter() - t
    return RunSummary(options=int(n[0]), nodes=float(all_stats[:, 2].sum()), ranks=size,
                      backend=engine.name, wall=time.perf_counter() - t_start, stages=stages,
                      analytics=analytics)


def _nodes_priced(steps: np.ndarray, analytics: Analytics) -> float:
    """Lattice nodes a slice really costs: (N+1)(N+2)/2 per lattice — with --greeks the base and
    its four bumped copies, with --richardson also the coarse M ~ N/2-step lattice."""
    nodes = lattice_nodes(steps).sum() * (5 if analytics.greeks else 1)
    if analytics.richardson:
        nodes += lattice_nodes(richardson_steps(steps)).sum()
    return float(nodes)
