"""RunConfig: everything a pricing run is told, with its defaults and checks in one place.

It is built from `pricer price`'s flags (from_args), or from a job file and the flags that override
it (from_job: pricer.io.jobs reads the file); tests and the Python API build it directly. check()
refuses, by name, any value of the wrong type or outside its choices (exit 2), on rank 0 before
any work: a job file's values arrive without argparse's checks, so every key is checked here.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from dataclasses import dataclass, fields

from pricer.engines import backend, backends, resolve_backend
from pricer.errors import InputError
from pricer.files import expand_placeholders
from pricer.io.formats import HDF5, extension_format
from pricer.model.greeks import Analytics
from pricer.model.lattice import tree_named
from pricer.model.partition import PARTITIONERS
from pricer.run.chunks import CHUNK_NODES, CHUNK_ROWS, GPU_CHUNK_NODES, GPU_CHUNK_ROWS
from pricer.run.watchdog import MINIMUM

DISTRIBUTIONS = ("scatter", "bcast", "read")
TASKS = ("price", "implied-vol")   # pricer price / run, pricer implied-vol
INVALID = ("refuse", "skip")


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
    t1: int | None = None     # GPU backends: tiled while a level is wider (None: calibrated/default)
    t2: int | None = None     # hybrid/batch: CPU tail below this width (None: calibrated/default)
    greeks: bool = False      # also delta, gamma, theta, vega, rho (pricer.model.greeks)
    richardson: bool = False  # price extrapolated from the N- and a ~N/2-step lattice
    checkpoint: str | None = None  # folder where each rank saves its finished chunks
    resume: bool = False      # accepted for scripts that pass it: a checkpoint resumes by itself
    chunk_nodes: float | None = None  # lattice nodes per chunk (the unit of checkpoints and aborts;
                                      # None: by backend, chunk_shape)
    invalid: str = "refuse"   # refuse: one bad option refuses the book; skip: it is not priced
                              # (NaN, its status says why: pricer/model/validity.py)
    stall_timeout: float | None = None  # seconds a rank may go without progress (None: by
                                        # each chunk's size, pricer/run/watchdog.py)
    progress: bool = True     # rank 0 shows the ranks' progress on stderr (--quiet: off)
    task: str = "price"       # price, or implied-vol: solve for each option's volatility from its
                              # market price (pricer.model.implied)
    scenarios: dict | None = None  # axis -> shifts (pricer.model.scenarios): every option also
                                   # priced under every combination
    bond_spacing: str = "variance"  # bond options: the Hull–White trees' node spacing
                                    # (pricer.model.hw1f.SPACINGS)
    summary_json: str | None = None  # where rank 0 writes the run's summary as JSON at its end

    # ---- derived settings
    def engine_overrides(self) -> dict:
        return {key: value for key, value in (("t1", self.t1), ("t2", self.t2)) if value is not None}

    @property
    def implied(self) -> bool:
        return self.task == "implied-vol"

    def analytics(self) -> Analytics:
        if self.implied:
            from pricer.model.implied import ImpliedVolatility
            return ImpliedVolatility()
        from pricer.model.scenarios import grid_of
        return Analytics(greeks=self.greeks, richardson=self.richardson,
                         scenarios=grid_of(self.scenarios))

    def outputs(self) -> tuple:
        """What a run computes per option, as the columns of its values: price and the Greeks,
        then, with --invalid skip, each option's status; an implied-volatility run's outputs
        (pricer.model.implied.OUTPUTS), then always the status."""
        status = self.invalid == "skip" or self.implied
        return self.analytics().outputs + (("status",) if status else ())

    def chunk_shape(self) -> tuple[float, int]:
        """(nodes, rows) per chunk. Each chunk is one engine call: a GPU call pays a launch tail as
        long as its largest option and some set-up, so the GPU backends take chunks of about a
        second of one GPU's work, ~4000x the CPU's."""
        gpu = backend(resolve_backend(self.backend)).needs_gpu
        analytics = self.analytics()
        # a chunk is about the same work whatever the run computes per option (an implied
        # volatility's rounds and a scenario grid's lattices shrink it), and one engine call of a
        # scenario grid about the same number of lattices (its rows shrink with the scenarios)
        lattices = 1 + (analytics.scenarios.count if analytics.scenarios is not None else 0)
        nodes = self.chunk_nodes if self.chunk_nodes is not None else (
            GPU_CHUNK_NODES if gpu else CHUNK_NODES) / (analytics.rounds * lattices)
        return nodes, max(1, (GPU_CHUNK_ROWS if gpu else CHUNK_ROWS) // lattices)

    def expand_placeholders(self) -> "RunConfig":
        """{array_task} in the input, output and checkpoint paths replaced by the Slurm array task's
        id (pricer.files.expand_placeholders), on every rank alike."""
        for key in ("input", "output", "checkpoint", "summary_json"):
            setattr(self, key, expand_placeholders(getattr(self, key)))
        return self

    # ---- checks
    def check(self, names: dict | None = None) -> "RunConfig":
        """Every setting's type and range, by name (`names`: field -> the name a message gives it,
        e.g. a job file's key); raises InputError."""
        def name(key):
            return (names or {}).get(key, key)

        for key in ("input", "output"):
            _require(isinstance(getattr(self, key), str) and getattr(self, key), name(key),
                     getattr(self, key), "a file name")
        for key, allowed in (("backend", backends()), ("partition", PARTITIONERS),
                             ("distribute", DISTRIBUTIONS), ("invalid", INVALID),
                             ("task", TASKS)):
            value = getattr(self, key)
            if not isinstance(value, str) or value not in allowed:
                raise InputError(f"{name(key)} must be one of {', '.join(allowed)}, got "
                                 f"{_shown(value)}")
        tree_named(self.tree)   # "unknown tree ...; known trees: ..."
        from pricer.model.hw1f import SPACINGS
        if not isinstance(self.bond_spacing, str) or self.bond_spacing not in SPACINGS:
            raise InputError(f"{name('bond_spacing')} must be one of {', '.join(SPACINGS)}, got "
                             f"{_shown(self.bond_spacing)}")
        for key in ("overwrite", "greeks", "richardson", "resume", "progress"):
            _require(isinstance(getattr(self, key), bool), name(key), getattr(self, key),
                     "true or false")
        _require(self.threads is None or (_whole(self.threads) and self.threads >= 1),
                 name("threads"), self.threads, "a whole number >= 1")
        for key in ("t1", "t2"):
            value = getattr(self, key)
            _require(value is None or (_whole(value) and value >= 0), name(key), value,
                     "a whole number >= 0")
        _require(self.checkpoint is None or (isinstance(self.checkpoint, str) and self.checkpoint),
                 name("checkpoint"), self.checkpoint, "a folder name")
        _require(self.summary_json is None or (isinstance(self.summary_json, str)
                                               and self.summary_json),
                 name("summary_json"), self.summary_json, "a file name")
        if self.summary_json and os.path.abspath(self.summary_json) in {
                os.path.abspath(p) for p in (self.input, self.output) if isinstance(p, str)}:
            raise InputError(f"{self.summary_json}: --summary-json must name a file of its own, "
                             f"not the input or the output")
        _require(self.chunk_nodes is None or (isinstance(self.chunk_nodes, numbers.Real)
                                              and not isinstance(self.chunk_nodes, bool)
                                              and self.chunk_nodes >= 1),
                 name("chunk_nodes"), self.chunk_nodes, "a number >= 1")
        _require(self.stall_timeout is None or (isinstance(self.stall_timeout, numbers.Real)
                                                and not isinstance(self.stall_timeout, bool)
                                                and MINIMUM <= self.stall_timeout < math.inf),
                 name("stall_timeout"), self.stall_timeout, f"a number of seconds >= {MINIMUM:g}")
        if self.implied and (self.greeks or self.richardson or self.scenarios):
            raise InputError("implied volatilities are solved on the option's own lattice: "
                             "--greeks, --richardson and scenarios are for pricing runs")
        if self.scenarios:
            from pricer.model.scenarios import grid_of
            grid_of(self.scenarios)             # the axes, by name
            if self.richardson:
                raise InputError("scenarios are priced on each option's N-step lattice: "
                                 "--richardson (an extrapolated price) does not take them")
            if extension_format(self.output) not in (None, HDF5):
                raise InputError(f"{self.output}: scenario prices are an (options, scenarios) "
                                 f"dataset, written to HDF5 results only: give the output an "
                                 f".h5 extension")
        if self.resume and not self.checkpoint:
            raise InputError("--resume needs --checkpoint DIR (the folder of the run to resume; "
                             "a run given --checkpoint DIR resumes by itself)")
        if self.checkpoint and self.distribute == "read":
            raise InputError("--checkpoint needs --distribute scatter or bcast (rank 0 reads the "
                             "checkpoint and hands out only the chunks still to price), not read")
        if self.distribute == "read" and extension_format(self.input) not in (None, HDF5):
            raise InputError(f"{self.input}: --distribute read needs an HDF5 portfolio (every rank "
                             f"reads its own rows of it); a CSV or Parquet book is read by rank 0: "
                             f"use --distribute scatter or bcast")
        resolve_backend(self.backend)   # a GPU backend without a usable GPU is refused by name
        return self

    # ---- builders
    @classmethod
    def from_args(cls, args, **given) -> "RunConfig":
        """From `pricer price`'s or `pricer run`'s parsed flags (None: not given) over `given`
        (a job file's settings) over the defaults."""
        settings = dict(given)
        for f in fields(cls):
            value = getattr(args, f.name, None)
            if value is not None:
                settings[f.name] = value
        if getattr(args, "quiet", False):
            settings["progress"] = False
        given = {axis: getattr(args, f"scenario_{axis}") for axis in ("spot", "volatility",
                                                                       "rate", "days")
                 if getattr(args, f"scenario_{axis}", None) is not None}
        if given:        # flags override the job file's [scenarios] axis by axis
            settings["scenarios"] = {**(settings.get("scenarios") or {}), **given}
        return cls(**settings)

    @classmethod
    def from_job(cls, path: str, args) -> tuple["RunConfig", dict]:
        """A job file's settings (pricer.io.jobs), the flags in `args` overriding them, each
        setting checked (a job file's named by its key); and the job as read."""
        from pricer.io.jobs import JOB_KEYS, load_job

        job = load_job(path)
        given = {field: job[table][key] for field, (table, key) in JOB_KEYS.items()
                 if key in job.get(table, {})}
        if job.get("scenarios"):
            given["scenarios"] = dict(job["scenarios"])
        config = cls.from_args(args, **given)
        return config.check({field: f"{path}: {table}.{key}" for field, (table, key)
                             in JOB_KEYS.items() if key in job.get(table, {})
                             and getattr(args, field, None) is None}), job


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    """A value as a message shows it: its repr and its type."""
    return f"{value!r} ({type(value).__name__})"


def _require(ok: bool, name: str, value, what: str) -> None:
    if not ok:
        raise InputError(f"{name} must be {what}, got {_shown(value)}")


def kept(cfg: RunConfig) -> str:
    """What a run that cannot write its results keeps of its prices."""
    if cfg.checkpoint:
        return (f"every chunk's prices are kept in the checkpoint {cfg.checkpoint}: `pricer "
                f"{cfg.task} {cfg.input} -o OTHER.h5 --checkpoint {cfg.checkpoint}` (with this "
                f"run's other settings) writes them elsewhere without pricing again")
    return ("the prices are lost; run with --checkpoint DIR to keep them on disk as they "
            "are priced, so that a run that cannot write its results can be finished")


def configure_threads(threads: int | None, ranks_here: int, warn: bool = False) -> int:
    """Give each rank its share of the node's cores, so ranks on one node don't oversubscribe:
    `threads`, else SLURM_CPUS_PER_TASK, else the cores this process may run on (its CPU affinity:
    what taskset, cgroups or the launcher's binding leave it) / the ranks on this node. With
    `warn`, a warning on stderr (once a process) where the binding leaves the rank fewer threads
    than its share of the cores the node gives the job (binding_warning)."""
    import numba

    global _warned
    if threads is None and not _slurm_cpus() and warn and not _warned:
        allowed = len(os.sched_getaffinity(0))
        message = binding_warning(allowed, node_cores(), ranks_here)
        if message:
            _warned = True
            print(f"pricer: warning: {message}", file=sys.stderr, flush=True)
    threads = rank_threads(threads, ranks_here)
    numba.set_num_threads(threads)
    return threads


def rank_threads(threads: int | None, ranks_here: int) -> int:
    """The CPU threads a rank runs (configure_threads; the memory checks count them): `threads`,
    else SLURM_CPUS_PER_TASK, else the cores this process may run on / the ranks on this node;
    at most numba's pool (NUMBA_NUM_THREADS, the cores), which a larger --threads is capped at."""
    import numba

    if threads is None:
        threads = _slurm_cpus() or max(1, len(os.sched_getaffinity(0)) // ranks_here)
    return max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))


def _slurm_cpus() -> int | None:
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    return int(cpus) if cpus and cpus.isdigit() else None


_warned = False


def node_cores() -> int:
    """The cores the node gives this job: its cgroup's cpuset (a container's or a Slurm job's)
    where readable, else every core of the machine."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
        count = 0
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            count += int(hi or lo) - int(lo) + 1
        if count > 0:
            return count
    except (OSError, ValueError):
        pass
    return os.cpu_count() or 1


def binding_warning(allowed: int, cores: int, ranks_here: int) -> str | None:
    """Why a rank runs fewer threads than its share of the node (cores / ranks_here): it may run
    on `allowed` cores only (its CPU affinity); None where the affinity leaves it its share."""
    share = max(1, cores // ranks_here)
    threads = max(1, allowed // ranks_here)
    if threads >= share:
        return None
    return (f"this process may run on {allowed} of the node's {cores} cores (its CPU affinity: "
            f"taskset, a cgroup, or the launcher's binding, e.g. Open MPI's default, a rank to a "
            f"core at up to 2 ranks and to a socket above), so each of the node's {ranks_here} "
            f"rank(s) runs {threads} thread(s) where {share} would be its share; unbind the "
            f"ranks (mpirun --bind-to none, srun --cpu-bind=none or --cpus-per-task) or give "
            f"--threads")


def threads_text(threads) -> str:
    """' (2 threads each)' or ' (1-4 threads)': the ranks' CPU threads, for a run's summary."""
    if not len(threads):
        return ""
    least, most = int(min(threads)), int(max(threads))
    if least == most:
        return f" ({least} thread{'s' if least > 1 else ''} each)"
    return f" ({least}-{most} threads)"
