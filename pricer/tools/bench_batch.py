"""`pricer bench batch`: the `batch` backend on Pawlak & Oancea (2019)-style portfolios, on the GPU at hand.

Portfolios (`pricer.tools.generate`, fixed seeds), each all-American and all-European:
  U1  1 024 options x N = 2 048          U2  100 000 options x N = 1 000
  R   100 000 options, N uniform in [16, 4096]
  S   100 000 options, N in [64, 256] and 1 % of them 10-50x larger
and NVIDIA's CUDA sample workload (binomialOptions: 1 024 European calls x 2 048 steps, here in FP64).

Each case is priced end to end from Python (lattice numbers in host memory -> prices in host memory:
rows filled, copies both ways, kernels), once to warm up (kernel compilation, buffers), then
`repeats` times and for at least `min_seconds` (as timeit's autorange: a few calls of a small
book last milliseconds, on a host whose speed drifts over seconds); the median wall time counts
(time.perf_counter), and the JSON keeps the calls timed and their 10th and 90th percentiles.
Reported: backward-induction node updates (N(N+1)/2 per option) per second; that rate as a share
of the FP64 bound measured in the same run (FMA peak / 4 per American node, / 2 per European
node: the FP64 instructions a node needs, as in `pricer bench gpu`); the event-timed copies in and
out as a share of the wall time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pricer.tools.generate import generate
from pricer.model.lattice import lattice_parameters
from pricer.tools.tables import write_json

TARGETS = {"American": 2.5e12, "European": 4.0e12, "American S": 2.0e12}
FP64_PER_NODE = {"American": 4, "European": 2}


def portfolios(quick: bool):
    scale = 10 if quick else 1
    cases = [("U1 1,024 x N=2,048", dict(dist="uniform", count=1024, steps=2048)),
             (f"U2 {100_000 // scale:,} x N=1,000", dict(dist="uniform", count=100_000 // scale, steps=1000)),
             (f"R {100_000 // scale:,} x N in [16, 4096]", dict(dist="random", count=100_000 // scale)),
             (f"S {100_000 // scale:,} skewed", dict(dist="skewed", count=100_000 // scale))]
    for name, spec in cases:
        for exercise in ("american", "european"):
            yield name, exercise.capitalize(), spec, exercise, False
    yield ("NVIDIA sample: 1,024 European calls x N=2,048", "European",
           dict(dist="uniform", count=1024, steps=2048), "european", True)


def params_of(spec: dict, exercise: str, calls_only: bool):
    book = generate(seed=2026, exercise=exercise, **spec)
    cols = book.columns()
    if calls_only:
        cols["call"] = np.ones_like(cols["call"])
    return lattice_parameters(cols)


def time_case(engine, params, repeats: int, min_seconds: float = 0.0):
    """(median wall, that call's runner stats, the walls of all timed calls)."""
    engine.price(params)                    # warm-up: compilation, buffers
    walls, stats = [], []
    started = time.perf_counter()
    while len(walls) < repeats or time.perf_counter() - started < min_seconds:
        t0 = time.perf_counter()
        engine.price(params)
        walls.append(time.perf_counter() - t0)
        stats.append(dict(engine.runner().last_stats))
    k = int(np.argsort(walls)[len(walls) // 2])
    return walls[k], stats[k], np.array(walls)


def bench_batch(quick: bool = False, repeats: int = 5, out: str | None = None,
                min_seconds: float = 0.2) -> dict:
    from pricer.engines.gpu.engine import GpuEngine
    from pricer.tools.bench_gpu import fp64_fma_peak
    engine = GpuEngine("batch")
    rt = engine.runner().rt
    peak = fp64_fma_peak(rt)
    print(f"GPU: {rt.name} ({rt.arch}); FP64 FMA peak measured now: {peak:.3e} FMA/s")
    print("| portfolio | exercise | nodes | wall ms | nodes/s | share of FP64 bound | copies / wall | chunks, launches |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, kind, spec, exercise, calls_only in portfolios(quick):
        params = params_of(spec, exercise, calls_only)
        nodes = float((params.steps * (params.steps + 1) // 2).sum())
        wall, stats, walls = time_case(engine, params, repeats, min_seconds)
        rate = nodes / wall
        share = rate * FP64_PER_NODE[kind] / peak
        copies = (stats.get("copy_in", 0.0) + stats.get("copy_out", 0.0)) / wall
        row = dict(portfolio=name, exercise=kind, options=len(params), nodes=nodes, wall_s=wall,
                   nodes_per_s=rate, share_of_fp64_bound=share, copy_share=copies, stats=stats,
                   calls=int(walls.size), wall_p10_p90_s=np.percentile(walls, [10, 90]).tolist())
        rows.append(row)
        print(f"| {name} | {kind} | {nodes:.3e} | {wall * 1e3:.2f} | {rate:.3e} | {share:.0%} | "
              f"{copies:.1%} | {stats.get('chunks')}, {stats.get('launches')} |", flush=True)
    result = dict(gpu=rt.name, arch=rt.arch, fp64_fma_peak=peak, repeats=repeats,
                  min_seconds=min_seconds, rows=rows, verdicts=verdicts(rows))
    for line in result["verdicts"]:
        print(line)
    write_json(out, result)
    return result


def verdicts(rows) -> list[str]:
    lines = []
    for kind, target, names in (("American", TARGETS["American"], ("U1", "U2", "R")),
                                ("European", TARGETS["European"], ("U1", "U2", "R")),
                                ("American", TARGETS["American S"], ("S",))):
        got = [r for r in rows if r["exercise"] == kind and r["portfolio"].split()[0] in names]
        worst = min(got, key=lambda r: r["nodes_per_s"])
        ok = worst["nodes_per_s"] >= target
        lines.append(f"{kind} on {'/'.join(names)}: worst {worst['nodes_per_s']:.3e} nodes/s "
                     f"({worst['portfolio']}), target {target:.1e}: {'met' if ok else 'NOT met'}")
    return lines


def add_arguments(ap) -> None:
    ap.add_argument("--quick", action="store_true", help="U2, R and S with 10x fewer options")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed calls per portfolio, at least (the median counts)")
    ap.add_argument("--min-seconds", type=float, default=0.2,
                    help="time each portfolio for at least this long (default 0.2 s)")
    ap.add_argument("--out", default=None, help="also write the measurements as JSON here")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pricer bench batch", description=__doc__.splitlines()[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    bench_batch(a.quick, a.repeats, a.out, a.min_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
