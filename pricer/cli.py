"""The `pricer` command: price books of options and bonds, solve implied volatilities, run job files, generate books, describe files, time benchmarks, study strong scaling, warm the kernel caches and calibrate the GPU (also `python -m pricer`).

Exit codes: 0 done, 2 bad input (message names the cause, nothing written), 1 anything else (SIGTERM
included). Under MPI an unexpected exception on any rank aborts the whole job rather than leaving the
others waiting.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from pricer import __version__
from pricer.devices import start_cuda_beside
from pricer.errors import InputError, OutputError
from pricer import ending
from pricer.files import cleanup


def _mpi_excepthook():
    """An uncaught exception on one rank must end every rank: print it, then MPI Abort."""
    from pricer.run.collectives import world

    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        cleanup()                  # temporary files and the output's claim, before the abort
        comm = world()
        if comm.Get_size() > 1:
            sys.stderr.write(f"pricer: rank {comm.Get_rank()} failed; aborting all ranks\n")
            sys.stderr.flush()
            comm.Abort(1)

    sys.excepthook = hook


def _add_pricing_options(p: argparse.ArgumentParser, job: bool, implied: bool = False) -> None:
    """The pricing flags of `price`, `run` and `implied-vol` (job: a job file's settings are
    overridden; implied: no Greeks or Richardson). Every flag's default is None, "not given": the
    defaults live in RunConfig alone."""
    from pricer.engines import backends
    from pricer.model.lattice import TREES
    from pricer.model.partition import PARTITIONERS
    from pricer.run.config import DISTRIBUTIONS, RunConfig

    default = {name: f.default for name, f in RunConfig.__dataclass_fields__.items()}
    p.add_argument("--backend", choices=backends(), default=None,
                   help=f"pricing engine (default: {default['backend']}, the fastest this machine "
                        f"has)")
    p.add_argument("--tree", choices=tuple(TREES), default=None,
                   help=f"binomial tree (default: {default['tree']}, the textbook CRR; the others "
                        f"are QuantLib's, docs/numerics.md); a portfolio's tree column, where "
                        f"present, wins")
    p.add_argument("--partition", choices=PARTITIONERS, default=None,
                   help=f"static split across ranks: equal Σ N² (cost) or equal counts (count); "
                        f"default {default['partition']}")
    p.add_argument("--distribute", choices=DISTRIBUTIONS, default=None,
                   help="how the ranks get the portfolio: rank 0 reads it and sends each rank its "
                        "slice by Scatterv (scatter) or everything by Bcast (bcast), or every rank "
                        "reads and checks its own rows of the file, read-only (read); default "
                        f"{default['distribute']}")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per rank (default: the node's cores / ranks on the node)")
    p.add_argument("--t1", type=int, default=None, metavar="N",
                   help="GPU backends: tiled kernel while a level is wider than N nodes "
                        "(default: `pricer calibrate`'s value for this GPU, else 200000)")
    p.add_argument("--t2", type=int, default=None, metavar="N",
                   help="hybrid/batch: CPU tail below N nodes (default: calibrated, else 500)")
    if not implied:
        from pricer.model.hw1f import SPACING, SPACINGS
        p.add_argument("--bond-spacing", choices=SPACINGS, default=None,
                       help=f"bond options: the Hull–White trees' node spacing: sqrt(3 V) of the "
                            f"step's exact variance V (variance, as QuantLib's tree), or Hull "
                            f"and White's first-order sigma sqrt(3 dt) (sqrt-dt); default "
                            f"{SPACING} (docs/numerics.md)")
    if not implied:
        _add_analytics_options(p, job)
        _add_scenario_options(p)
    _add_run_options(p)


def _add_analytics_options(p: argparse.ArgumentParser, job: bool) -> None:
    # --greeks/--no-greeks: `run` overrides the job file either way
    switch = argparse.BooleanOptionalAction if job else "store_true"
    from_job = "pricing.{}, else off" if job else "off"
    p.add_argument("--greeks", action=switch, default=None,
                   help="also write delta, gamma, theta (per year; from the lattice's first levels), "
                        "vega and rho (per unit of volatility / rate; central bumps of 1e-4) to "
                        "/results; needs steps >= 2, costs 5 lattices per option (docs/formats.md); "
                        f"default: {from_job.format('greeks')}")
    p.add_argument("--richardson", action=switch, default=None,
                   help="Richardson-extrapolated price (N V(N) - M V(M)) / (N - M) from a coarse "
                        "lattice M ~ N/2 of N's parity (2 V(N) - V(N/2) where 4 divides N); the "
                        "Greeks stay those of the N-step lattice; needs steps >= 3; default: "
                        f"{from_job.format('richardson')}")


def _add_scenario_options(p: argparse.ArgumentParser) -> None:
    for axis, what in (("spot", "relative spot shifts (-0.2: S0 x 0.8)"),
                       ("volatility", "absolute volatility shifts (0.05: sigma + 0.05)"),
                       ("rate", "absolute rate shifts"),
                       ("days", "days passed (T - days / 365)")):
        p.add_argument(f"--scenario-{axis}", default=None, metavar="FIRST:LAST:COUNT|x,y,...",
                       help=f"scenario grid axis: {what}; every option is also priced under "
                            f"every combination of the axes given, into /results/scenarios "
                            f"(docs/formats.md); a first value below 0 after '=': "
                            f"--scenario-{axis}=-0.2:0.2:9")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="replace an existing output file")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="save every finished chunk in DIR (seen by every rank); the same command "
                        "later prices only what DIR does not hold (a DIR of another input or "
                        "other settings is refused): docs/reliability.md")
    p.add_argument("--resume", action="store_true", default=None,
                   help="accepted with --checkpoint DIR, which resumes by itself")
    p.add_argument("--chunk-nodes", type=float, default=None, metavar="NODES",
                   help="lattice nodes per chunk, the unit of checkpoints and failure checks "
                        "(default: by backend, about a second of one rank's work)")
    p.add_argument("--invalid", choices=("refuse", "skip"), default=None,
                   help="options that fail a value check: refuse the whole book (default), or "
                        "skip them: price NaN and a status saying why (docs/formats.md)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="end the run, naming the rank, when a rank finishes no chunk or is not "
                        "heard from for SECONDS (default: 120 s plus each chunk's own work at a "
                        "slow rate; docs/reliability.md)")
    p.add_argument("--quiet", action="store_true",
                   help="print nothing but errors (no progress, no summary)")
    p.add_argument("--summary-json", default=None, metavar="FILE",
                   help="also write the run's summary as JSON to FILE (rank 0, at the end): "
                        "counts, wall, each stage's seconds, each rank's compute seconds and "
                        "threads (what `pricer scaling` reads)")


def build_parser() -> argparse.ArgumentParser:
    from pricer.tools.bond_datasets import DATASETS as BOND_DATASETS
    from pricer.tools.generate import DISTRIBUTIONS, EXERCISE

    parser = argparse.ArgumentParser(prog="pricer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pricer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("price", help="price a book of options and/or bond options (under mpiexec "
                                     "for several ranks)")
    p.add_argument("input", help="the book: HDF5 (.h5: /portfolio of options, /bond_options with "
                                 "/curves, or both), CSV (.csv) or Parquet (.parquet) of options "
                                 "(docs/formats.md)")
    p.add_argument("-o", "--output", required=True, help="results file to write: .h5, .csv or "
                                                         ".parquet, by its extension")
    _add_pricing_options(p, job=False)

    p = sub.add_parser("implied-vol", help="solve for each option's volatility from its market "
                                           "price, on its lattice (under mpiexec for several ranks)")
    p.add_argument("input", help="portfolio file with a market_price column (volatility, where "
                                 "given, is the search's start)")
    p.add_argument("-o", "--output", required=True, help="results file to write: id, "
                   "implied_volatility, status, iterations and the lattice price at the answer")
    _add_pricing_options(p, job=False, implied=True)

    p = sub.add_parser("run", help="run a TOML job spec (flags override the file)")
    p.add_argument("job", help="job spec, e.g. jobs/demo.toml")
    p.add_argument("-o", "--output", default=None, help="results file (overrides output.path)")
    _add_pricing_options(p, job=True)

    p = sub.add_parser("generate", help="write a synthetic portfolio (deterministic in its arguments)")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default=None,
                   help="a book of equity options of this distribution")
    p.add_argument("--bonds", choices=BOND_DATASETS, default=None,
                   help="instead, a book of bond options: one of the datasets of Pawlak et al. "
                        "(2021) (Hull–White trees of their widths and heights; --count, --seed)")
    p.add_argument("--count", type=int, required=True, help="number of options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000, help="N for uniform and scenarios (default 1000)")
    p.add_argument("--min-steps", type=int, default=16, help="smallest N for random (default 16)")
    p.add_argument("--max-steps", type=int, default=4096, help="largest N for random (default 4096)")
    p.add_argument("--exercise", choices=EXERCISE, default="mixed",
                   help="american, european or a random mix (default; scenarios are American puts)")
    p.add_argument("--market-prices", action="store_true",
                   help="a book for `pricer implied-vol`: market prices (each option's crr lattice "
                        "price at its drawn volatility, priced here on the CPU) instead of the "
                        "volatility column")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")

    p = sub.add_parser("info", help="describe a portfolio or results file")
    p.add_argument("file")

    p = sub.add_parser("bench", help="benchmarks (not tests): print and record measured tables")
    which = p.add_subparsers(dest="what", required=True)
    b = which.add_parser("cpu", help="serial and cpu engines beside QuantLib's CRR engine")
    b.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    b.add_argument("--out", default=None, help="also write the measurements as JSON here")
    b = which.add_parser("gpu", help="Cao (2025)'s Table 5 layout: GPU regimes and hybrid by N")
    from pricer.tools.bench_gpu import add_arguments
    add_arguments(b)
    b = which.add_parser("batch", help="the batch backend on U/R/S portfolios and NVIDIA's sample workload")
    from pricer.tools.bench_batch import add_arguments as batch_arguments
    batch_arguments(b)
    b = which.add_parser("implied-vol", help="American implied volatilities per second beside "
                                              "QuantLib's Brent on its binomial engine")
    from pricer.tools.bench_implied import add_arguments as implied_arguments
    implied_arguments(b)
    b = which.add_parser("scenarios", help="a scenario grid's nodes/s against the expanded book's")
    from pricer.tools.bench_scenarios import add_arguments as scenario_arguments
    scenario_arguments(b)
    b = which.add_parser("trinomial", help="the Hull–White trinomial engines on the seven datasets "
                                            "of Pawlak et al. (2021) beside QuantLib's tree engine")
    from pricer.tools.bench_trinomial import add_arguments as trinomial_arguments
    trinomial_arguments(b)
    b = which.add_parser("plan", help="rank 0's read, check and plan of a book against a plain "
                                       "read of its columns")
    from pricer.tools.bench_plan import add_arguments as plan_arguments
    plan_arguments(b)
    b = which.add_parser("accuracy", help="error against nodes per tree, with and without Richardson")
    from pricer.tools.bench_accuracy import add_arguments as accuracy_arguments
    accuracy_arguments(b)

    p = sub.add_parser("scaling", help="strong scaling of a job over rank counts, or (--simulate) "
                                       "partition quality at scale")
    from pricer.tools.scaling import add_arguments as scaling_arguments
    scaling_arguments(p)

    p = sub.add_parser("warm", help="compile every kernel a backend may run into the caches "
                                    "(numba's, the GPU's) before the first run")
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="a backend to warm (repeatable; default: every backend this machine "
                        "can run)")

    p = sub.add_parser("calibrate", help="time the GPU regimes here and cache T1/T2/VT/K for "
                       "gpu/hybrid and the bond family's GPU-FLAT rule")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a smoke run)")
    p.add_argument("--out", default=None, metavar="FILE.json",
                   help="also write the calibration (values and timings) here")
    return parser


def _price(args) -> int:
    from pricer.run.config import RunConfig
    return _run(args, RunConfig.from_args(args))   # checked by rank 0 before any work


def _implied_vol(args) -> int:
    from pricer.run.config import RunConfig
    return _run(args, RunConfig.from_args(args, task="implied-vol"))


def _run_job(args) -> int:
    from pricer.run.config import RunConfig
    from pricer.tools.generate import JobBook

    try:
        cfg, job = RunConfig.from_job(args.job, args)
    except InputError as exc:   # every rank finds the same fault: one message, every rank exits 2
        if _is_rank_0():
            print(f"pricer: error: {exc}", file=sys.stderr)
        return 2
    spec = job["portfolio"].get("generate")
    if not spec:
        return _run(args, cfg)
    book = JobBook(cfg, spec)
    try:
        return _run(args, cfg, book.make)
    except SystemExit as exc:    # every rank's verdict: a refused run leaves no book it made
        if exc.code == 2:
            book.discard()
        raise
    except InputError:
        book.discard()
        raise


def _run(args, cfg, prepare=None) -> int:
    _mpi_excepthook()
    from pricer import compiling
    from pricer.run.driver import run

    compiling.watch_numba()
    if not args.quiet and _is_rank_0():
        compiling.notify_first(_say_compiling)
    try:
        summary = run(cfg, prepare=prepare)
    finally:
        compiling.notify_first(None)
    if summary is not None and cfg.summary_json:
        import json
        from pricer.files import atomic_write
        try:
            atomic_write(cfg.summary_json, json.dumps(summary.record(), indent=1).encode())
        except OSError as exc:
            raise OutputError(f"{cfg.summary_json}: the results are written to {cfg.output}, "
                              f"but the summary could not be: {exc.strerror or exc}") from None
    if summary is not None and not args.quiet:
        print(f"wrote {cfg.output}")
        for line in summary.lines():
            print(line)
    return 0


def _is_rank_0() -> bool:
    from pricer.run.collectives import world
    return world().Get_rank() == 0


def _say_compiling() -> None:
    """The first compile of a run, on rank 0's stderr: a first run on a machine is otherwise
    silent for its compile (15-40 s on 2 cores)."""
    from pricer.engines import gpu_available
    from pricer.files import cache_dir
    from pricer.numba_cache import folder

    where = os.path.dirname(folder())
    if _may_use_a_gpu(sys.argv[1:]) and gpu_available():
        where += f" and {cache_dir('cuda', 'PRICER_CUDA_CACHE')}"
    print(f"pricer: compiling kernels (a first run of this pricer here; they are cached in "
          f"{where} for the runs after it, and `pricer warm` compiles them ahead)",
          file=sys.stderr, flush=True)


def _generate(args) -> int:
    """Rank 0 writes the file (under mpiexec the other ranks wait for its verdict): once, not
    once per rank."""
    from pricer.run.collectives import outcome, world
    from pricer.tools.generate import write_generated

    comm = world()
    if (args.dist is None) == (args.bonds is None):
        raise InputError("pricer generate: give --dist (equity options) or --bonds (bond "
                         "options), one of them")
    if args.bonds is not None:
        from pricer.tools.bond_datasets import write_dataset

        work = lambda: write_dataset(args.output, args.bonds, args.count, args.seed,  # noqa: E731
                                     args.overwrite)
    else:
        work = lambda: write_generated(args)  # noqa: E731
    outcome(comm, work if comm.Get_rank() == 0 else None)
    return 0


def _info(args) -> int:
    from pricer.tools.info import describe

    for line in describe(args.file):
        print(line)
    return 0


def _bench(args) -> int:
    if args.what in ("gpu", "batch"):
        from pricer.engines import gpu_available
        if not gpu_available():
            raise InputError(f"no usable GPU here: pricer bench {args.what} times the GPU kernels "
                             f"and needs pycuda, a visible CUDA device and nvcc (PRICER_NO_GPU "
                             f"unset)")
    if args.what == "gpu":
        from pricer.tools.bench_gpu import bench_gpu
        return bench_gpu(args)
    if args.what == "batch":
        from pricer.tools.bench_batch import bench_batch
        bench_batch(quick=args.quick, repeats=args.repeats, out=args.out,
                    min_seconds=args.min_seconds)
        return 0
    if args.what == "implied-vol":
        from pricer.tools.bench_implied import bench_implied
        bench_implied(args)
        return 0
    if args.what == "scenarios":
        from pricer.tools.bench_scenarios import bench_scenarios
        bench_scenarios(args)
        return 0
    if args.what == "trinomial":
        from pricer.tools.bench_trinomial import bench_trinomial
        bench_trinomial(args)
        return 0
    if args.what == "plan":
        from pricer.tools.bench_plan import bench_plan
        bench_plan(args)
        return 0
    if args.what == "accuracy":
        from pricer.tools.bench_accuracy import run as bench_accuracy
        bench_accuracy(args)
        return 0
    from pricer.tools.bench_cpu import bench_cpu
    bench_cpu(quick=args.quick, out=args.out)
    return 0


def _calibrate(args) -> int:
    from pricer.tools.calibrate import main
    return main(quick=args.quick, out=args.out)


def _warm(args) -> int:
    from pricer.engines import backends
    from pricer.tools.warm import caches, default_backends, warm

    names = args.backend or default_backends()
    unknown = [name for name in names if name not in backends()]
    if unknown:
        raise InputError(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(backends())}")
    warm(names)
    for line in caches():
        print(line)
    return 0


def _scaling(args) -> int:
    from pricer.tools.scaling import run
    return run(args)


# the commands that may compile or load numba kernels (generate --market-prices prices too)
COMPILING = ("price", "implied-vol", "run", "bench", "warm", "calibrate", "generate", "scaling")
COMMANDS = {"price": _price, "implied-vol": _implied_vol, "run": _run_job, "generate": _generate, "info": _info, "bench": _bench,
            "calibrate": _calibrate, "scaling": _scaling, "warm": _warm}


# the commands that start MPI under a launcher (pricer.run.collectives.world)
STARTING_MPI = ("price", "implied-vol", "run", "generate")


def _command(argv: list) -> str | None:
    """The command's name in a command line, read before the parser is built."""
    words = [word for word in argv if not word.startswith("-")]
    return words[0] if words else None


def _may_use_a_gpu(argv: list) -> bool:
    """Whether a command line may price on a GPU (`price` or `run`, without --backend cpu or
    serial), read before the parser is built: building it imports numpy and numba."""
    words = [word for word in argv if not word.startswith("-")]
    backend = None
    for k, word in enumerate(argv):
        if word == "--backend" and k + 1 < len(argv):
            backend = argv[k + 1]
        elif word.startswith("--backend="):
            backend = word.split("=", 1)[1]
    return bool(words) and words[0] in ("price", "implied-vol", "run") \
        and backend not in ("cpu", "serial")


def main(argv=None) -> int:
    if argv is None:   # a real command line (tests call main(argv) inside pytest): the signals
        ending.exit_1_on_signals()     # are handled before the imports that take the start's time
        ending.command_starts_mpi(_command(sys.argv[1:]) in STARTING_MPI)
    if _may_use_a_gpu(sys.argv[1:] if argv is None else list(argv)):
        start_cuda_beside()       # the driver's start beside the imports (pricer.devices)
    args = build_parser().parse_args(argv)
    if argv is None:
        if args.command in COMPILING:
            from pricer.compiling import prefer_full_width_vectors
            prefer_full_width_vectors()
    code = None
    try:
        code = COMMANDS[args.command](args)
    except InputError as exc:
        print(f"pricer: error: {exc}", file=sys.stderr)
        code = 2
    except OutputError as exc:
        print(f"pricer: error: {exc}", file=sys.stderr)
        code = 1
    except SystemExit as exc:   # every rank's verdict (BadInput): its code is decided too
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:    # a message: printed here, as the interpreter would, since leave() skips it
            print(exc.code, file=sys.stderr)
            code = 1
        raise
    except BrokenPipeError:  # `pricer info FILE | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except OSError as exc:   # what it printed could not be written (`> /dev/full`, a full disk)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"pricer: error: its output could not be written: {exc.strerror}", file=sys.stderr)
        code = 1
    finally:
        cleanup()                  # before the code is decided: a late signal exits at once
        ending.decided(code, command_line=argv is None)
    return code
