"""The run: SPMD over the ranks of a communicator (size 1 without mpiexec).

1. agree: rank 0 makes the plan (plan.py: reads and checks the input, partitions it) while every
   rank starts its engine beside the read; every rank's GPU is measured and fitted (memory.py);
   one verdict (collectives.py) lets every rank go on, or exit 2 together on bad input.
2. share: each rank gets its rows (Scatterv or Bcast from rank 0, or its own read).
3. compute: each rank prices its rows chunk by chunk (checkpointed, failures reported to rank 0,
   progress shown by rank 0: faults.py, progress.py).
4. finish: one Gatherv of an (options, outputs) float64 matrix brings the prices and Greeks to
   rank 0, which writes the results file. Each option's tree travels in the matrix as a code.
"""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from pricer import compiling
from pricer.engines import get_engine, resolve_backend, set_local_rank
from pricer.errors import InputError, OutputError
from pricer.io.formats import HDF5, output_format
from pricer.io.portfolio import MATRIX_COLUMNS, matrix_columns
from pricer.io.results import sha256_beside, utc_now, write_results
from pricer.model.cost import lattice_nodes, nodes_priced
from pricer.model.greeks import SCENARIO, Analytics
from pricer.model.validity import PRICED, REASONS, reasons_text, status_of
from pricer.run import bond_family, memory, pipeline  # noqa: F401 - bond_family registers
from pricer.run.checks import read_and_check, tree_names
from pricer.run.chunk_loop import ChunkLoop
from pricer.run.collectives import (ROOT, attempt, bcast_array, distribute, gather_rows,
                                    node_ranks, outcome, verdict, world)
from pricer.run.config import RunConfig, configure_threads, kept, threads_text
from pricer.run.families import families, families_in, family
from pricer.run.faults import polite_barrier
from pricer.run.plan import Plan, held, make_plan, plan_own_rows
from pricer.run.pricing import run_chunks
from pricer.run.progress import Progress
from pricer.run.provenance import provenance

STAGES = ("read", "distribute", "setup", "compute", "gather", "write")
STEPS = MATRIX_COLUMNS.index("steps")


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
    read_parts: dict = field(default_factory=dict)  # rank 0's read stage, part by part (_agree)
    notes: list = field(default_factory=list)  # e.g. chunks shrunk to fit the GPUs' memory
    rank_seconds: list = field(default_factory=list)   # each rank's compute stage
    threads: list = field(default_factory=list)        # each rank's CPU threads
    parts: list = field(default_factory=list)   # the file's other families' results
                                                # (pipeline.FamilyResults), if any

    @property
    def compile(self) -> float:
        """Rank 0's seconds of kernel compilation (pricer/compiling.py), apart from its stages."""
        return self.stages.get("compile", 0.0)

    def lines(self) -> list[str]:
        # nodes per second of the pricing, not of a first run's compile
        seconds = self.wall - self.compile
        rate = self.nodes / seconds if seconds > 0 else float("nan")
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.stages.items())
        grid = self.analytics.scenarios
        extras = [what for what, on in (("Greeks", self.analytics.greeks),
                                        ("Richardson extrapolation", self.analytics.richardson),
                                        (f"{grid.count if grid else 0} scenarios", grid)) if on]
        extras = f" with {' and '.join(extras)}" if extras else ""
        if self.reused:
            extras += f" ({self.reused} of them from the checkpoint)"
        what = "solved the implied volatilities of" if self.analytics.implied else "priced"
        lines = [f"{what} {self.options} options{extras} ({self.nodes:.4g} nodes) on {self.ranks} "
                 f"rank(s){threads_text(self.threads)} with backend {self.backend} in "
                 f"{self.wall:.3f}s ({rate:.3g} nodes/s"
                 f"{', compile excluded' if self.compile else ''})",
                 f"stages: {stages}"]
        if self.read_parts:
            parts = self.read_parts
            lines.append(f"read stage: plan {parts['plan']:.3f}s beside the engine start "
                         f"{parts['engine']:.3f}s, device fit {parts['fit']:.3f}s, the ranks' "
                         f"agreement {parts['agree']:.3f}s")
        return lines + list(self.notes)

    def record(self) -> dict:
        """The summary as data (`--summary-json`, pricer scaling): the family, the counts, the
        wall, every stage's seconds on rank 0 (compile apart from the others) and each rank's
        compute seconds; a file's other families, where it has them, under their names
        ("bonds")."""
        out = {"family": "options", "task": "implied-vol" if self.analytics.implied else "price",
               "instruments": self.options, "nodes": self.nodes, "ranks": self.ranks,
               "backend": self.backend, "wall": self.wall, "stages": dict(self.stages),
               "rank_seconds": list(self.rank_seconds), "threads": list(self.threads),
               "reused": self.reused}
        for part in self.parts:
            out[part.family.name] = part.record()
        return out


@dataclass
class StartedEngine:
    """An engine made before the input was read, or why it could not be made (raised only once
    pricing starts, so that a failure goes through FailureWatch like any other)."""
    engine: object = None
    error: Exception | None = None
    seconds: float = 0.0


@dataclass
class Agreed:
    """What every rank knows once the verdict let the run go on."""
    plan: Plan | None       # rank 0's
    own: object             # --distribute read: this rank's OwnRows
    started: StartedEngine
    chunk_options: int      # this rank's device fit (0: the engine as it is)
    notes: list
    threads: int
    bounds: np.ndarray      # rank r prices plan rows bounds[r]:bounds[r+1]
    cuts: np.ndarray        # chunk boundaries in plan rows
    chunk_ids: np.ndarray   # each chunk's number in the checkpoint grid (-1: none)
    hosts: list | None = None   # rank 0: each rank's host
    gpus: list | None = None    # rank 0: each rank's GPU ("" for none)
    parts: dict = field(default_factory=dict)   # seconds of the plan, engine start, fit, agreement


def run(cfg: RunConfig, comm=None, prepare=None) -> RunSummary | None:
    """Price cfg.input into cfg.output on every rank of comm; returns the summary on rank 0.
    `prepare`, if given, runs on rank 0 first (a job's portfolio generation). A file's rows of
    another family (families.py: its /bond_options, say) are priced first (pipeline.py), then
    its options, if any; one file holds both (implied volatilities are the options' alone)."""
    comm = comm or world()
    notes = []
    if prepare is None:
        # every rank expands the paths alike ({array_task}) and loads the plug-in families
        # (families.PRICER_PLUGINS): one verdict if it cannot
        _, status, message, failure = attempt(lambda: (cfg.expand_placeholders(), families()))
        verdict(comm, status, message)
        if failure is not None:
            raise failure
        if comm.Get_rank() == ROOT:
            found, options = families_in(cfg.input)
            names = [f.name for f in found]
        names, options = comm.bcast((names, options) if comm.Get_rank() == ROOT else None,
                                    root=ROOT)
        found = [family(name) for name in names]
        if found and cfg.implied and options:
            notes.append(f"{cfg.input}'s {' and '.join(f.noun for f in found)} (/"
                         f"{', /'.join(f.group for f in found)}) were not priced: implied "
                         "volatilities are solved for its options")
        elif len(found) == 1 and not options:
            return pipeline.price_file_part(found[0], cfg, comm, with_options=False)
        elif found:
            return _run_mixed(cfg, comm, found, options)
    summary = _run_options(cfg, comm, prepare, [])
    if summary is not None:
        summary.notes += notes
    return summary


def _run_mixed(cfg: RunConfig, comm, found: list, options: bool) -> RunSummary | None:
    """A file of several families (options and bond options, say): its options checked too
    before any other family is priced (a bad option refused before any work), and rank 0's claim
    on the output held from then until all are written (no other run can take it between the
    parts)."""
    ranks_here, _ = node_ranks(comm)
    t_start = time.perf_counter()
    with ExitStack() as hold:
        def check():
            if options:
                read_and_check(cfg, comm.Get_size(), ranks_here)
            else:
                pipeline.refuse_options_settings(cfg, found)
                if output_format(cfg.output) != HDF5:
                    raise InputError(f"{cfg.output}: a book of several instrument families is "
                                     "written to HDF5 only (.h5), each in its own group")
            hold.enter_context(held(cfg))

        _, status, message, failure = attempt(check) if comm.Get_rank() == ROOT \
            else (None, 0, None, None)
        polite_barrier(comm)      # the others sleep while rank 0 reads, rather than spin
        verdict(comm, status, message)
        if failure is not None:
            raise failure
        parts = [pipeline.price_file_part(family, cfg, comm, with_options=True)
                 for family in found]
        if options:
            return _run_options(cfg, comm, None, parts)
        if comm.Get_rank() != ROOT:
            return None
        pipeline.write_parts(cfg, parts, sha256_beside(cfg.input), comm.Get_size(),
                             time.perf_counter() - t_start)
        return pipeline.Parts(parts)


def _run_options(cfg: RunConfig, comm, prepare, parts: list) -> RunSummary | None:
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    # a first run's compile (in the engine's start, beside the plan) is a stage of its own
    clock = compiling.StageClock()
    agreed = _agree(cfg, comm, prepare)
    clock.lap("read", beside=agreed.parts.get("plan", 0.0))
    local, ids = _share(cfg, comm, agreed)
    clock.lap("distribute")
    lo, hi = int(agreed.bounds[rank]), int(agreed.bounds[rank + 1])
    mine = (agreed.cuts >= lo) & (agreed.cuts <= hi)
    chunks = [(int(a) - lo, int(b) - lo, int(c)) for a, b, c in
              zip(agreed.cuts[mine][:-1], agreed.cuts[mine][1:],
                  agreed.chunk_ids[mine[:-1] & mine[1:]])]
    # every rank reports its finished chunks; rank 0 shows them against all the nodes to price
    total = nodes_priced(agreed.plan.steps, cfg.analytics()) if rank == ROOT else 0.0
    tracker = Progress(comm, cfg.progress, agreed.cuts, agreed.bounds, total)
    values, engine_name, setup, local_nodes = compute(comm, cfg, local, ids, chunks,
                                                      agreed.started, agreed.chunk_options,
                                                      tracker)
    clock.stages["setup"] = setup
    compute_seconds = clock.lap("compute", less=setup)

    full = gather_rows(comm, values, agreed.bounds)
    stats = np.array([compute_seconds, local.shape[0], local_nodes, agreed.threads])
    all_stats = np.empty((size, 4)) if rank == ROOT else None
    comm.Gather(stats, all_stats, root=ROOT)
    clock.lap("gather")
    if rank != ROOT:
        return None

    plan = agreed.plan
    values = plan.assemble(full)
    _write(cfg, plan, values, all_stats, engine_name, size, time.perf_counter() - t_start,
           provenance(agreed.hosts, agreed.gpus), parts)
    for lock in plan.locks:
        lock.release()
    clock.lap("write")
    notes = plan.notes + agreed.notes + [line for part in parts for line in part.lines()]
    if cfg.implied:
        status = values[:, -1].astype(np.int8)
        from pricer.model.implied import statuses_text
        notes.append(f"statuses: {statuses_text(status)}")
    elif cfg.invalid == "skip":
        status = values[:, -1].astype(np.int8)
        skipped = int((status != PRICED).sum())
        notes.append(f"--invalid skip: {skipped} of {len(status)} options not priced"
                     + (f" ({reasons_text(status)})" if skipped else ""))
    return RunSummary(options=len(plan.input_ids), nodes=float(all_stats[:, 2].sum()), ranks=size,
                      backend=engine_name, wall=time.perf_counter() - t_start,
                      stages=clock.result(),
                      analytics=cfg.analytics(), reused=len(plan.input_ids) - int(agreed.bounds[-1]),
                      read_parts=agreed.parts, notes=notes, rank_seconds=all_stats[:, 0].tolist(),
                      threads=all_stats[:, 3].astype(int).tolist(), parts=parts)


def _agree(cfg: RunConfig, comm, prepare) -> Agreed:
    """Plan (rank 0, or with --distribute read every rank for its own rows) beside every rank's
    engine start, the device fit, and the verdict; then what every rank needs of the plan."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ranks_here, local_rank = node_ranks(comm)
    set_local_rank(local_rank)            # the GPU of this rank, where the launcher says nothing
    # every rank expands the paths alike ({array_task}): one verdict if it cannot
    _, status, message, failure = attempt(cfg.expand_placeholders)
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    reading = cfg.distribute == "read"    # every rank reads its own rows
    if reading and prepare is not None:   # the input is made before anyone reads it
        outcome(comm, prepare if rank == ROOT else None)
        prepare = None
    plan, own = None, None
    start = time.perf_counter()
    parts = dict(plan=0.0, fit=0.0)

    def timed(make, *args):
        try:
            return make(*args)
        finally:
            parts["plan"] = time.perf_counter() - start

    # the plan is made in a second thread while every rank starts its engine (a GPU context does not
    # shrink with more ranks, so it goes beside the read rather than after it)
    with ThreadPoolExecutor(max_workers=1) as pool:
        if reading:
            planned = pool.submit(timed, plan_own_rows, cfg, size, rank, ranks_here)
        else:
            planned = pool.submit(timed, make_plan, cfg, size, ranks_here, prepare) \
                if rank == ROOT else None
        started = start_engine(cfg)
        if planned is not None:
            result, status, message, failure = attempt(planned.result)
            if status == 0:
                plan, own = result if reading else (result, None)
    parts["engine"] = started.seconds
    joined = time.perf_counter()
    polite_barrier(comm)  # the others sleep while rank 0 reads, rather than spin on its cores
    # every rank's GPU, measured now that every engine has started, to rank 0, which fits every
    # rank's share to it or refuses the run before the verdict
    gathered = comm.gather((memory.device_info(started.engine), socket.gethostname()), root=ROOT)
    infos = [info for info, _ in gathered] if rank == ROOT else None
    hosts = [host for _, host in gathered] if rank == ROOT else None
    fitted = None
    if rank == ROOT and status == 0:
        t = time.perf_counter()
        fitted, status, message, failure = attempt(
            lambda: fit_devices(cfg, plan, started.engine, infos))
        parts["fit"] = time.perf_counter() - t
    try:
        trees = verdict(comm, status, message, own)
    except BaseException:          # another rank refused the run: rank 0 gives its claim up
        for lock in plan.locks if plan is not None else []:
            lock.release()
        raise
    if failure is not None:
        raise failure
    if reading and rank == ROOT:
        plan.trees = tree_names(trees)
    fit = bcast_array(comm, (fitted.chunk_options if fitted is not None else np.zeros(size))
                      if rank == ROOT else None)
    bounds, cuts, chunk_ids = (bcast_array(comm, getattr(plan, name) if rank == ROOT else None)
                               for name in ("bounds", "cuts", "chunk_ids"))
    gpus = [f"{info.name} ({info.device})" if info is not None else ""
            for info in infos] if rank == ROOT else None
    # a GPU run's threads only feed its GPU: warned of where the CPU prices
    threads = configure_threads(cfg.threads, ranks_here, warn=rank == ROOT and cfg.progress
                                and resolve_backend(cfg.backend) == "cpu")
    parts["agree"] = time.perf_counter() - joined - parts["fit"]
    return Agreed(plan, own, started, int(fit[rank]), fitted.notes if fitted else [], threads,
                  bounds, cuts, chunk_ids, hosts, gpus, parts)


def _share(cfg: RunConfig, comm, agreed: Agreed) -> tuple[np.ndarray, np.ndarray]:
    """This rank's rows of the portfolio matrix, and their ids. Ids only name options in messages:
    rank 0 has them, a reading rank its own; the others use global row numbers (rank 0 checked
    every option already, so no message is expected from them)."""
    if cfg.distribute == "read":
        return agreed.own.matrix, agreed.own.ids
    rank = comm.Get_rank()
    plan = agreed.plan
    local = distribute(comm, plan.matrix if rank == ROOT else None, agreed.bounds, cfg.distribute,
                       len(matrix_columns(cfg.implied)))
    lo, hi = int(agreed.bounds[rank]), int(agreed.bounds[rank + 1])
    return local, plan.ids[lo:hi] if rank == ROOT else np.arange(lo, hi, dtype=np.int64)


def _write(cfg: RunConfig, plan: Plan, full: np.ndarray, all_stats: np.ndarray, engine_name: str,
           size: int, wall: float, origin: dict, parts: list = ()) -> None:
    """Rank 0: the results file, with its provenance (`origin`: provenance.provenance) and the
    ranks' stats. A failure says what was kept (OutputError)."""
    try:
        input_sha256 = plan.input_sha256     # read beside the run (sha256_beside)
    except OSError as exc:
        raise OutputError(f"{cfg.input}: the input could not be read again for its sha256 "
                          f"({exc.strerror or exc}), so the results were not written; "
                          f"{kept(cfg)}") from None
    attrs = {**origin, "backend": engine_name, "tree": ",".join(plan.trees), "ranks": size,
             "partition": cfg.partition, "distribute": cfg.distribute, "wall_seconds": wall,
             "utc_time": utc_now(), "input_sha256": input_sha256,
             "input_path": os.path.abspath(cfg.input), "greeks": bool(cfg.greeks),
             "richardson": bool(cfg.richardson), "invalid": cfg.invalid, "task": cfg.task}
    if cfg.invalid == "skip" or cfg.implied:
        attrs["status_reasons"] = json.dumps({str(code): text
                                              for code, text in status_reasons(cfg).items()})
    run_stats = {"seconds": all_stats[:, 0], "options": all_stats[:, 1].astype(np.int64),
                 "nodes": all_stats[:, 2], "threads": all_stats[:, 3].astype(np.int64)}
    outputs = cfg.outputs()
    scenario = np.array([name.startswith(SCENARIO) for name in outputs])
    extra = {name: full[:, j] for j, name in enumerate(outputs)
             if name != "price" and not scenario[j]}
    scenarios = (cfg.analytics().scenarios, full[:, scenario]) if scenario.any() else None
    if scenarios is not None:
        attrs["scenarios"] = json.dumps(scenarios[0].settings())
    if "status" in extra:
        extra["status"] = extra["status"].astype(np.int8)
    if "iterations" in extra:
        extra["iterations"] = np.nan_to_num(extra["iterations"]).astype(np.int64)   # 0 skipped
    for part in parts:
        attrs.update(part.attrs)
    try:
        write_results(cfg.output, plan.input_ids, full[:, 0], attrs, run_stats, extra=extra,
                      scenarios=scenarios,
                      tables={p.family.name: (p.table(), p.family.units) for p in parts})
    except OSError as exc:      # a disk that filled since the check, a quota, a lost mount
        raise OutputError(f"{cfg.output}: the results could not be written "
                          f"({exc.strerror or exc}); {kept(cfg)}") from None


def status_reasons(cfg: RunConfig) -> dict:
    """What each status code of the run's results means."""
    if not cfg.implied:
        return REASONS
    from pricer.model.implied import REASONS as SEARCH

    return {**REASONS, 0: "converged", **SEARCH}


def start_engine(cfg: RunConfig) -> StartedEngine:
    """The engine, warmed up (Engine.warm_up; PRICER_WARM_START=0 skips it, for measurements)."""
    start = time.perf_counter()
    try:
        engine = get_engine(cfg.backend, **cfg.engine_overrides())
        if os.environ.get("PRICER_WARM_START", "1") != "0":
            engine.warm_up()
    except Exception as exc:  # noqa: BLE001 - bad settings are named by rank 0's checks instead
        return StartedEngine(error=exc, seconds=time.perf_counter() - start)
    return StartedEngine(engine=engine, seconds=time.perf_counter() - start)


def fit_devices(cfg: RunConfig, plan: Plan, engine, infos: list):
    """Rank 0: memory.fit_devices for every rank's share; None where no rank measured a GPU."""
    if engine is None or all(info is None for info in infos):
        return None
    steps = plan.steps.astype(np.int64)
    shares = []
    for r in range(len(infos)):
        lo, hi = int(plan.bounds[r]), int(plan.bounds[r + 1])
        first, last = np.searchsorted(plan.cuts, [lo, hi])   # bounds are cuts
        shares.append((steps[lo:hi], plan.cuts[first:last + 1] - lo, plan.ids[lo:hi]))
    return memory.fit_devices(engine, infos, shares, cfg.analytics(), cfg.input)


def compute(comm, cfg: RunConfig, local: np.ndarray, ids: np.ndarray, chunks: list,
            started: StartedEngine, chunk_options: int = 0, progress: Progress | None = None):
    """This rank's rows, chunk by chunk (each saved to the checkpoint, if any), as
    (values, engine name, set-up seconds, lattice nodes). A failure here is reported to rank 0,
    which names the rank and ends the job (faults.py); a rank that stops advancing is named and
    ends it too (watchdog.py). `chunk_options`: rank 0's fit of this rank's GPU memory."""
    steps = local[:, STEPS].astype(np.int64)     # one pass over the matrix's strided column
    nodes = [nodes_priced(steps[a:b], cfg.analytics()) for a, b, _ in chunks]
    loop = ChunkLoop(comm, cfg, nodes, progress=progress)
    analytics = cfg.analytics()
    # price, then the Greeks, then with --invalid skip each option's status (model/validity.py)
    values = np.empty((local.shape[0], len(cfg.outputs())))
    priced = np.ones(local.shape[0], dtype=bool)
    if cfg.implied:         # the solver writes each solved row's status
        values[:, -1] = PRICED
    if cfg.invalid == "skip":
        values[:, -1] = status_of(local)
        priced = values[:, -1] == PRICED
        values[~priced, :len(analytics.outputs)] = np.nan
    engine_name, setup = resolve_backend(cfg.backend), 0.0
    try:
        if started.error is not None:
            raise started.error
        engine, engine_name = started.engine, started.engine.name
        loop.attach(cfg.checkpoint)
        engine.fit_device(chunk_options)       # before prepare() sizes the buffers
        t, compiled = time.perf_counter(), compiling.seconds()
        if priced.any():
            engine.prepare(steps if priced.all() else steps[priced], levels=cfg.greeks)
        # a compile inside the set-up is the run's compile stage's (StageClock), not the set-up's
        setup = max(0.0, time.perf_counter() - t - (compiling.seconds() - compiled))
        loop.start()
        for k in run_chunks(engine, local, priced, chunks, cfg.tree, ids, analytics, values):
            a, b, chunk = chunks[k]
            loop.finished(k, chunk, values[a:b])
    except Exception as exc:  # noqa: BLE001 - any failure must end the job, named by rank 0
        loop.failed(exc)
    except BaseException:     # an interrupt (the API's caller's): no watchdog outlives the run
        loop.abandon()
        raise
    loop.end()
    if cfg.implied:      # the lattices the searches priced, not the cost model's estimate
        iterations = values[:, analytics.outputs.index("iterations")]
        return values, engine_name, setup, float(np.nansum(iterations * lattice_nodes(steps)))
    return values, engine_name, setup, float(sum(nodes))
