"""`pricer bench accuracy`: error against nodes spent, per tree, with and without Richardson.

Options: the `scenarios` grid (270 American puts, K = 100: S0 = 90/100/110, sigma 0.1-0.6, T 0.25-5,
r 0/5/10 %). Reference: Leisen-Reimer with two-point Richardson (pricer.model.greeks) at
N = --reference-steps (default 100 001), on the `auto` engine (the GPU backends where there is a GPU:
minutes on a CPU). For each tree and N in STEPS, the same engine prices the grid plainly and with
Richardson; a method's error at N is the largest (and the root-mean-square) absolute error over the
grid (currency units, K = 100), its cost the lattice nodes per option (Richardson pays for both
lattices). Prints both tables, writes them as JSON (--out) and a log-log plot (--plot, needs
matplotlib: the `plot` extra; --replot draws it from a JSON file), and names the method that reaches
TARGET_ERROR at the fewest nodes (interpolated log-log between the measured points).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from pricer.tools.generate import generate
from pricer.model.greeks import Analytics, price_with_analytics, richardson_steps
from pricer.model.cost import lattice_nodes
from pricer.tools.tables import write_json

STEPS = (25, 51, 101, 201, 401, 801, 1601, 3201, 6401, 12801)
QUICK_STEPS = (25, 51, 101, 201, 401)
REFERENCE_STEPS = 100_001
QUICK_REFERENCE_STEPS = 4_001   # --quick: a smoke run of seconds on a CPU, errors down to ~1e-5
TARGET_ERROR = 1e-4


def scenario_columns(steps: int) -> dict:
    book = generate("scenarios", 270, steps=steps)
    return book.columns()


def prices(engine, cols: dict, tree: str, richardson: bool) -> np.ndarray:
    ids = np.arange(1, len(cols["spot"]) + 1)
    return price_with_analytics(engine, cols, tree, ids, Analytics(richardson=richardson))["price"]


def nodes_per_option(steps: int, richardson: bool) -> float:
    """Lattice nodes per option: the N-step lattice, plus with Richardson the coarse lattice that
    pricer.model.greeks really prices (richardson_steps: ~N/2 with N's parity, not N // 2)."""
    n = float(lattice_nodes(np.array([steps]))[0])
    if not richardson:
        return n
    return n + float(lattice_nodes(richardson_steps(np.array([steps])))[0])


def nodes_at(points: list[tuple[float, float]], target: float) -> float | None:
    """Nodes where the error first falls to `target`, interpolated log-log; None if it never does."""
    for (n0, e0), (n1, e1) in zip(points, points[1:]):
        if e1 <= target < e0:
            w = (math.log(target) - math.log(e0)) / (math.log(e1) - math.log(e0))
            return math.exp(math.log(n0) + w * (math.log(n1) - math.log(n0)))
    if points and points[0][1] <= target:
        return points[0][0]
    return None


METRICS = {"max": lambda e: float(np.max(e)), "rms": lambda e: float(np.sqrt(np.mean(e * e)))}


def bench_accuracy(quick: bool = False, out: str | None = None, plot: str | None = None,
                   reference_steps: int = REFERENCE_STEPS, backend: str = "auto") -> dict:
    from pricer.engines import get_engine
    from pricer.model.lattice import TREES
    engine = get_engine(backend)
    start = time.perf_counter()
    reference = prices(engine, scenario_columns(reference_steps), "lr", richardson=True)
    print(f"reference: lr + Richardson at N = {reference_steps:,} on {engine.name} "
          f"({time.perf_counter() - start:.1f} s)")
    steps_list = list(QUICK_STEPS if quick else STEPS)
    curves = {}
    for tree in TREES:
        for richardson in (False, True):
            label = f"{tree}{' + Richardson' if richardson else ''}"
            errors = [np.abs(prices(engine, scenario_columns(n), tree, richardson) - reference)
                      for n in steps_list]
            nodes = [nodes_per_option(n, richardson) for n in steps_list]
            curve = dict(tree=tree, richardson=richardson, steps=steps_list, nodes=nodes)
            for metric, f in METRICS.items():
                points = [(x, f(e)) for x, e in zip(nodes, errors)]
                curve[metric] = dict(points=points, nodes_to_target=nodes_at(points, TARGET_ERROR))
            curves[label] = curve
    result = dict(reference=dict(tree="lr", richardson=True, steps=reference_steps, backend=engine.name),
                  target_error=TARGET_ERROR, curves=curves, seconds=time.perf_counter() - start)
    report(result)
    write_json(out, result)
    if plot:
        _plot(result, plot)
        print(f"wrote {plot}")
    return result


def report(result: dict) -> None:
    for metric in METRICS:
        for line in _table(result["curves"], metric):
            print(line)
        print(verdict(result["curves"], metric))


def verdict(curves: dict, metric: str) -> str:
    reached = {k: v[metric]["nodes_to_target"] for k, v in curves.items() if v[metric]["nodes_to_target"]}
    if not reached:
        return f"{metric}: no method reached {TARGET_ERROR:g} at the sizes tried"
    best = min(reached, key=reached.get)
    return (f"{metric} error {TARGET_ERROR:g} at the fewest nodes: {best}, "
            f"{reached[best]:.3g} nodes per option")


def _table(curves: dict, metric: str) -> list[str]:
    steps = next(iter(curves.values()))["steps"]
    lines = [f"{metric} absolute error over the grid",
             "| method | " + " | ".join(f"N={n:,}" for n in steps) + f" | nodes to {TARGET_ERROR:g} |",
             "|---|" + "---|" * (len(steps) + 1)]
    for label, c in curves.items():
        errs = " | ".join(f"{e:.2e}" for _, e in c[metric]["points"])
        reach = c[metric]["nodes_to_target"]
        lines.append(f"| {label} | {errs} | {f'{reach:.3g}' if reach else '—'} |")
    return lines


def _plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, metric in zip(axes, METRICS):
        colours = {}
        for label, c in result["curves"].items():
            x, y = zip(*c[metric]["points"])
            colour = colours.setdefault(c["tree"], f"C{len(colours) % 10}")
            ax.loglog(x, y, "--" if c["richardson"] else "-", color=colour, marker="o", ms=3,
                      label=label)
        ax.axhline(TARGET_ERROR, color="grey", lw=0.8)
        ax.set_xlabel("lattice nodes per option")
        ax.set_ylabel(f"{metric} abs error over the scenarios grid (K = 100)")
        ax.set_title(f"American puts, {metric} error (dashed: Richardson)")
    axes[0].legend(fontsize=7, ncol=2)
    ref = result["reference"]
    fig.suptitle(f"reference: {ref['tree']} + Richardson at N = {ref['steps']:,}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pricer bench accuracy", description=__doc__.splitlines()[0])
    add_arguments(ap)
    run(ap.parse_args(argv))
    return 0


def add_arguments(ap) -> None:
    ap.add_argument("--quick", action="store_true", help="N up to 401 only")
    ap.add_argument("--reference-steps", type=int, default=None,
                    help=f"N of the lr + Richardson reference (default {REFERENCE_STEPS:,}; "
                         f"{QUICK_REFERENCE_STEPS:,} with --quick)")
    ap.add_argument("--backend", default="auto", help="engine (default auto)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a log-log plot (PNG) here; needs matplotlib")
    ap.add_argument("--replot", metavar="JSON", help="no pricing: print and plot a saved --out file")


def run(a) -> None:
    if a.replot:
        with open(a.replot) as fh:
            result = json.load(fh)
        report(result)
        if a.plot:
            _plot(result, a.plot)
            print(f"wrote {a.plot}")
        return
    reference_steps = a.reference_steps or (QUICK_REFERENCE_STEPS if a.quick else REFERENCE_STEPS)
    bench_accuracy(a.quick, a.out, a.plot, reference_steps, a.backend)


if __name__ == "__main__":
    sys.exit(main())
