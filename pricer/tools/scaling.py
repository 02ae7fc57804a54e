"""`pricer scaling`: strong scaling of one job over rank counts, and partition quality at scale.

    pricer scaling JOB.toml|BOOK --ranks 1,2,4 [--repeats R] [--launcher CMD] --out DIR
        runs `pricer run JOB.toml -o WORK/ranks-K-rep-R.h5` (or, for a portfolio file BOOK that
        exists already, `pricer price BOOK -o ...`) under `srun --kill-on-bad-exit=1 -n K`
        (inside a Slurm allocation: SLURM_JOB_ID is set) or `mpiexec -n K` (else; `--launcher`
        overrides both) for each rank count K, R times (the median counts), after one untimed
        warm-up run (generation of the job's portfolio, numba's cache); writes DIR/scaling.csv,
        DIR/scaling.md, DIR/scaling.png. Each rank count's row names the stage that limits its
        efficiency: the one whose time is furthest above the first row's, scaled by its ranks.
    pricer scaling --simulate PORTFOLIO.h5 --ranks 1,...,4096 --out DIR
        no pricing: each partitioner's largest and mean rank cost per rank count against the bound
        max(mean, largest option); writes DIR/simulate.csv, .md, .png.
    --cost-model (with --simulate) also times the cpu engine per N: seconds per lattice node.

Exit codes: 0 done; 2 bad arguments or input (the message says which); 1 a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from pricer.errors import InputError
from pricer.files import check_input_file
from pricer.tools.tables import make_folders, pyplot, remove_made, write_outputs

# scaling.csv's columns: these, each stage's seconds between them (a run's stages come from its
# summary, --summary-json: an option run's read, distribute, setup, compute, gather and write,
# pricer/run/driver.py; a bond run's plan, read, compute, gather and write, pricer/run/pipeline.py;
# a first run's compile apart), then these
HEAD_COLUMNS = ("ranks", "runs", "wall", "wall_min", "wall_max", "launch_wall")
TAIL_COLUMNS = ("compute_min", "compute_mean", "compute_max", "imbalance", "instruments", "nodes",
                "speedup", "efficiency", "launch_efficiency", "limiting", "limiting_seconds")



def parse_ranks(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, unique); empty lists, non-numbers and counts < 1 refused."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"--ranks needs a comma-separated list of rank counts, "
                                         f"got {text!r}")
    ranks = []
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"rank counts must be whole numbers >= 1, got {item!r}")
        ranks.append(int(item))
    return sorted(set(ranks))


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("input", help="JOB.toml (a pricing job), a portfolio file to price as it is "
                                  "(BOOK.h5, .csv, .parquet), or with --simulate a PORTFOLIO.h5")
    ap.add_argument("--ranks", type=parse_ranks, required=True, metavar="K1,K2,...",
                    help="rank counts, e.g. 1,2,4,8")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="folder for the CSV, markdown table and PNG plot (made if missing)")
    ap.add_argument("--repeats", type=_positive, default=1, metavar="R",
                    help="timed runs per rank count; the median counts (default 1)")
    ap.add_argument("--launcher", default=None, metavar="CMD",
                    help="MPI launcher, called as CMD -n K ... (default: srun inside a Slurm "
                         "allocation, else mpiexec)")
    ap.add_argument("--work", default=None, metavar="DIR",
                    help="folder for each run's results file and log (default: OUT/runs)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed first run (it generates the job's portfolio and fills "
                         "numba's cache)")
    ap.add_argument("--backend", default=None, help="passed to pricer run (default: the job's)")
    ap.add_argument("--threads", type=_positive, default=None,
                    help="passed to pricer run: CPU threads per rank (default: cores / ranks)")
    ap.add_argument("--partition", choices=("cost", "count"), default=None,
                    help="passed to pricer run (default: the job's)")
    ap.add_argument("--distribute", choices=("scatter", "bcast", "read"), default=None,
                    help="passed to pricer run (default: the job's)")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds allowed per run (default 3600)")
    ap.add_argument("--simulate", action="store_true",
                    help="no pricing: evaluate the partitioners on PORTFOLIO.h5's cost model")
    ap.add_argument("--cost-model", action="store_true",
                    help="with --simulate: also time the cpu engine per N against (N+1)(N+2)/2")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pricer scaling", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return ap


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad arguments (message printed), 0 for --help
        return int(exc.code or 0)
    return run(args)


def run(args) -> int:
    try:
        if args.cost_model and not args.simulate:
            raise InputError("--cost-model goes with --simulate")
        if args.simulate:
            from pricer.tools.scaling_simulate import simulate
            return simulate(args)
        return strong_scaling(args)
    except InputError as exc:
        print(f"pricer: error: {exc}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------- strong scaling

def launcher_command(launcher: str | None = None, environ=None) -> list[str]:
    """The launcher as an argument list: --launcher, else srun inside Slurm, else mpiexec (the one
    beside this Python where there is one, as the mpich extra installs it)."""
    environ = os.environ if environ is None else environ
    if launcher:
        return shlex.split(launcher)
    if environ.get("SLURM_JOB_ID"):   # a rank that dies ends the step, not the time limit
        return ["srun", "--kill-on-bad-exit=1"]
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return [local]
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise InputError("no mpiexec or mpirun on the PATH; give --launcher")
    return [found]


def read_summary(path: str) -> dict:
    """A run's summary as `--summary-json` writes it (RunSummary.record, FamilyResults.record),
    flattened for a row: the wall, each stage's seconds, each rank's compute seconds, the
    instruments and nodes. A file of options and bond options counts both: the bond part's wall
    as a stage "bonds" before the options' stages, the ranks' compute seconds summed.
    RuntimeError, one line, for a summary that is missing or lacks these figures."""
    try:
        with open(path) as f:
            return _flatten(json.load(f))
    except OSError as exc:
        raise RuntimeError(f"{path}: the run's summary cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise RuntimeError(f"{path}: the run's summary is not JSON: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        what = f"no {exc.args[0]!r}" if isinstance(exc, KeyError) else f"a bad value ({exc})"
        raise RuntimeError(f"{path}: the run's summary has {what}: not one this pricer "
                           f"writes") from None


def _flatten(record: dict) -> dict:
    out = {"wall": float(record["wall"]), "ranks": int(record["ranks"]),
           "stages": {k: float(v) for k, v in record["stages"].items()},
           "rank_seconds": np.asarray(record["rank_seconds"], dtype=np.float64),
           "instruments": int(record["instruments"]), "nodes": float(record["nodes"])}
    for name, part in record.items():      # the file's other families (pipeline.py)
        if not (isinstance(part, dict) and "family" in part):
            continue
        out["stages"] = {name: float(part["wall"]), **out["stages"]}
        out["wall"] += float(part["wall"])
        out["rank_seconds"] = out["rank_seconds"] + np.asarray(part["rank_seconds"])
        out["instruments"] += int(part["instruments"])
        out["nodes"] += float(part["nodes"])
    return out


def _pricer_args(args, output: str, summary: str) -> list[str]:
    command = "run" if args.input.endswith(".toml") else "price"   # a job, or a book as it is
    cmd = [sys.executable, "-m", "pricer", command, args.input, "-o", output, "--overwrite",
           "--summary-json", summary, "--quiet"]
    for key in ("backend", "threads", "partition", "distribute"):
        if getattr(args, key) is not None:
            cmd += [f"--{key}", str(getattr(args, key))]
    return cmd


def run_once(args, launcher: list[str], ranks: int, output: str, log: str) -> dict:
    summary = os.path.splitext(output)[0] + ".json"
    if os.path.exists(summary):
        os.remove(summary)          # a failed run must not leave an earlier run's figures
    cmd = launcher + ["-n", str(ranks)] + _pricer_args(args, output, summary)
    env = dict(os.environ)  # the ranks import this very pricer
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{shlex.join(cmd)}: no result after {args.timeout:g}s") from None
    elapsed = time.perf_counter() - t
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n# exit {proc.returncode} after {elapsed:.3f}s\n")
        f.write(proc.stdout + proc.stderr)
    if proc.returncode == 2:     # the run refused its input: so does the study
        raise InputError(_refusal(proc.stderr or proc.stdout))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode} (log {log}):\n  "
                           + "\n  ".join(tail))
    figures = read_summary(summary)
    if figures["ranks"] != ranks:
        raise RuntimeError(f"{shlex.join(cmd)} ran on {figures['ranks']} rank(s), not {ranks}: "
                           f"does the launcher belong to mpi4py's MPI? (log {log})")
    figures["launch_wall"] = elapsed
    return figures


def _refusal(text: str) -> str:
    """The refusal's line of a run that exited 2, without its `pricer: error: `."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("pricer: error: ")]
    line = (errors or lines or ["pricer: error: the run exited 2 and said nothing"])[-1]
    return line.removeprefix("pricer: error: ")


def aggregate(ranks: int, runs: list[dict]) -> dict:
    """One CSV row: medians over the repeats (per column)."""
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    row = {"ranks": ranks, "runs": len(runs), "wall": med("wall"),
           "wall_min": min(r["wall"] for r in runs), "wall_max": max(r["wall"] for r in runs),
           "launch_wall": med("launch_wall")}
    row["stages"] = stages_of(runs)
    for stage in row["stages"]:
        row[stage] = statistics.median(r["stages"].get(stage, math.nan) for r in runs)
    row["compute_min"] = statistics.median(float(r["rank_seconds"].min()) for r in runs)
    row["compute_mean"] = statistics.median(float(r["rank_seconds"].mean()) for r in runs)
    row["compute_max"] = statistics.median(float(r["rank_seconds"].max()) for r in runs)
    row["imbalance"] = row["compute_max"] / row["compute_mean"] if row["compute_mean"] > 0 else math.nan
    row["instruments"], row["nodes"] = runs[0]["instruments"], runs[0]["nodes"]
    return row


def stages_of(runs: list[dict]) -> list[str]:
    """The stages the runs report (their summaries' "stages"; a row's "stages", the list
    aggregate gives it), in the order they first appear."""
    seen = {}
    for r in runs:
        for stage in r["stages"]:
            seen.setdefault(stage, None)
    return list(seen)


def add_speedup(rows: list[dict]) -> None:
    """Speedup against the smallest rank count K0 (K0 x its wall / wall), efficiency = speedup / K,
    the same of the whole launcher command (launch_efficiency: process start, imports and MPI
    set-up included), and the stage that limits the efficiency: the one with the most seconds
    beyond perfect scaling of K0's (stage_K - stage_K0 x K0 / K), with those seconds. None for the
    first row."""
    base = rows[0]
    for row in rows:
        row["speedup"] = base["ranks"] * base["wall"] / row["wall"] if row["wall"] > 0 else math.nan
        row["efficiency"] = row["speedup"] / row["ranks"]
        row["launch_efficiency"] = (base["ranks"] * base["launch_wall"]
                                    / (row["ranks"] * row["launch_wall"])
                                    if row["launch_wall"] > 0 else math.nan)
        if row is base:
            row["limiting"], row["limiting_seconds"] = "", math.nan
            continue
        scale = base["ranks"] / row["ranks"]
        excess = {stage: row[stage] - base[stage] * scale for stage in row["stages"]
                  if stage in base["stages"] and stage != "compile"   # not a scaling cost
                  and math.isfinite(row[stage]) and math.isfinite(base[stage])}
        stage = max(excess, key=excess.get)
        row["limiting"], row["limiting_seconds"] = stage, excess[stage]


def strong_scaling(args) -> int:
    from pricer.io.formats import input_format
    from pricer.io.jobs import load_job

    if args.input.endswith(".toml"):
        load_job(args.input)   # refuse a bad job file before launching anything
    else:
        check_input_file(args.input)
        input_format(args.input)   # a portfolio file of a known format
    launcher = launcher_command(args.launcher)
    work = args.work or os.path.join(args.out, "runs")
    made = make_folders([args.out, work])   # after the checks: a refused study makes nothing
    started = []        # the runs' paths less their extension (their results, summaries, logs)
    try:
        rows = _runs(args, launcher, work, started)
    except InputError:
        remove_made(made)
        for path in (stem + ext for stem in started for ext in (".h5", ".json", ".log")):
            if os.path.isfile(path):
                os.remove(path)
        raise
    except RuntimeError as exc:
        print(f"pricer: error: {exc}", file=sys.stderr)
        return 1
    add_speedup(rows)
    table = markdown_runs(rows, f"`{args.input}`, launcher `{launcher[0]}`, median of {args.repeats}")
    write_outputs(args.out, "scaling", rows, HEAD_COLUMNS + tuple(stages_of(rows)) + TAIL_COLUMNS,
                  table)
    plot_runs(rows, os.path.join(args.out, "scaling.png"))
    print("\n".join(table))
    return 0


def _runs(args, launcher: list[str], work: str, started: list) -> list[dict]:
    """The warm-up and the timed runs (each one's path less its extension in `started`); a row
    per rank count (aggregate)."""
    rows = []
    if not args.no_warmup:
        print(f"warm-up: {args.ranks[0]} rank(s)", flush=True)
        started.append(os.path.join(work, "warmup"))
        run_once(args, launcher, args.ranks[0], started[-1] + ".h5", started[-1] + ".log")
    for k in args.ranks:
        runs = []
        for rep in range(1, args.repeats + 1):
            started.append(os.path.join(work, f"ranks-{k}-rep-{rep}"))
            runs.append(run_once(args, launcher, k, started[-1] + ".h5", started[-1] + ".log"))
            print(f"{k} rank(s), run {rep}/{args.repeats}: {runs[-1]['wall']:.3f}s", flush=True)
        rows.append(aggregate(k, runs))
    return rows


def markdown_runs(rows: list[dict], title: str) -> list[str]:
    stages = stages_of(rows)
    lines = [f"Strong scaling: {title}", "",
             "| ranks | wall s | " + " | ".join(f"{s} s" for s in stages)
             + " | compute min/mean/max s | speedup | efficiency | limited by | launch s |"
             " launch efficiency |",
             "|---:|---:|" + "---:|" * len(stages) + "---:|---:|---:|---|---:|---:|"]
    for r in rows:
        limit = (f"{r['limiting']} (+{r['limiting_seconds']:.3f} s)" if r.get("limiting")
                 else "—")
        lines.append(f"| {r['ranks']} | {r['wall']:.3f} | "
                     + " | ".join(f"{r.get(s, math.nan):.3f}" for s in stages)
                     + f" | {r['compute_min']:.3f} / {r['compute_mean']:.3f} / {r['compute_max']:.3f}"
                     f" | {r['speedup']:.3f} | {r['efficiency']:.3f} | {limit}"
                     f" | {r['launch_wall']:.3f} | {r['launch_efficiency']:.3f} |")
    return lines


def plot_runs(rows: list[dict], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    ranks = [r["ranks"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax1.plot(ranks, [r["speedup"] for r in rows], "o-", label="measured")
    ax1.plot(ranks, ranks, "k--", lw=0.8, label="ideal")
    ax1.set_xlabel("MPI ranks")
    ax1.set_ylabel(f"speedup (vs {ranks[0]} rank{'s' if ranks[0] > 1 else ''})")
    ax2.plot(ranks, [r["efficiency"] for r in rows], "o-", label="measured")
    ax2.axhline(1.0, color="k", ls="--", lw=0.8, label="ideal")
    ax2.set_xlabel("MPI ranks")
    ax2.set_ylabel("parallel efficiency")
    ax2.set_ylim(0, max(1.1, max(r["efficiency"] for r in rows) * 1.05))
    for ax in (ax1, ax2):
        if len(ranks) > 1 and ranks[-1] / ranks[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
