"""`pricer scaling --simulate PORTFOLIO.h5 --ranks ... --out DIR`: partition quality at scale,
no pricing: each partitioner's largest and mean rank cost per rank count against the bound
max(mean, largest option) (DIR/simulate.csv, .md, .png); with --cost-model, the cpu engine timed
per N against the cost model's (N+1)(N+2)/2 nodes (pricer/tools/scaling.py has the command)."""

from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np

from pricer.tools.tables import make_folders, pyplot, write_outputs

SIM_COLUMNS = ("ranks", "partitioner", "options", "max_cost", "mean_cost", "largest_option",
               "bound", "whole_bound", "max_over_bound", "max_over_whole_bound", "empty_ranks")
# cost: what --partition cost runs (partition.assign); contiguous: its best contiguous split alone;
# lpt: assign_by_cost alone; count: equal counts (--partition count)
SIM_PARTITIONERS = ("cost", "contiguous", "count", "lpt")
TARGET = 0.02
COST_MODEL_STEPS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 12800)


# ----------------------------------------------------------------------------- simulation

def simulate_rows(steps: np.ndarray, ranks: list[int]) -> list[dict]:
    """Per rank count and partitioner: largest and mean rank cost against the bounds."""
    from pricer.model.cost import option_cost
    from pricer.model.partition import (assign, assign_by_cost, lower_bound, part_costs,
                                  partition, whole_option_bound)

    cost = option_cost(steps)
    rows = []
    for k in ranks:
        bound, whole = lower_bound(steps, k), whole_option_bound(steps, k)
        for name in SIM_PARTITIONERS:
            if name == "lpt":
                loads = assign_by_cost(steps, k).costs(steps)
            elif name == "cost":
                loads = assign(steps, k, "cost").costs(steps)
            else:
                loads = part_costs(steps, partition(steps, k, "cost" if name == "contiguous" else name))
            top = float(loads.max())
            rows.append({"ranks": k, "partitioner": name, "options": int(cost.size),
                         "max_cost": top, "mean_cost": float(cost.sum() / k),
                         "largest_option": float(cost.max()), "bound": bound, "whole_bound": whole,
                         "max_over_bound": top / bound, "max_over_whole_bound": top / whole,
                         "empty_ranks": int((loads == 0).sum())})
    return rows


def markdown_simulate(rows: list[dict], title: str) -> list[str]:
    ranks = sorted({r["ranks"] for r in rows})
    by = {(r["ranks"], r["partitioner"]): r for r in rows}
    lines = [f"Partition quality: {title}. Largest rank cost / max(mean, largest option) "
             f"(* misses {TARGET:.0%}; in brackets: / the whole-option bound where that is higher)",
             "", "| ranks | mean / largest option | " + " | ".join(SIM_PARTITIONERS) + " |",
             "|---:|---:|" + "---:|" * len(SIM_PARTITIONERS)]
    for k in ranks:
        first = by[(k, SIM_PARTITIONERS[0])]
        cells = []
        for name in SIM_PARTITIONERS:
            r = by[(k, name)]
            cell = f"{r['max_over_bound']:.4f}" + ("*" if r["max_over_bound"] > 1 + TARGET else "")
            if r["whole_bound"] > r["bound"] * (1 + 1e-9):
                cell += f" ({r['max_over_whole_bound']:.4f})"
            cells.append(cell)
        lines.append(f"| {k} | {first['mean_cost'] / first['largest_option']:.3g} | "
                     + " | ".join(cells) + " |")
    return lines


def plot_simulate(rows: list[dict], path: str, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in SIM_PARTITIONERS:
        pts = [(r["ranks"], r["max_over_bound"]) for r in rows if r["partitioner"] == name]
        ax.plot(*zip(*pts), "o-", ms=3, label=name)
    ax.axhline(1.0, color="k", lw=0.8, label="bound max(mean, largest)")
    ax.axhline(1.0 + TARGET, color="grey", ls="--", lw=0.8, label=f"+{TARGET:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("largest rank cost / bound")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def simulate(args) -> int:
    from pricer.io.portfolio import read_portfolio

    portfolio = read_portfolio(args.input)
    make_folders([args.out])       # after the checks: a refused study makes nothing
    rows = simulate_rows(portfolio.steps, args.ranks)
    title = f"`{os.path.basename(args.input)}`, {len(portfolio):,} options"
    table = markdown_simulate(rows, title)
    if args.cost_model:
        model = cost_model_check()
        write_outputs(args.out, "cost_model", model, ("steps", "options", "nodes", "seconds",
                                                      "ns_per_node", "relative"),
                      markdown_cost_model(model))
        table += [""] + markdown_cost_model(model)
    write_outputs(args.out, "simulate", rows, SIM_COLUMNS, table)
    plot_simulate(rows, os.path.join(args.out, "simulate.png"), title.replace("`", ""))
    print("\n".join(table))
    return 0


# ----------------------------------------------------------------------------- cost model

def cost_model_check(steps_list=COST_MODEL_STEPS, nodes_per_point: float = 3e8, repeats: int = 3,
                     backend: str = "cpu") -> list[dict]:
    """Time `backend` on batches of generated options of one N each (about `nodes_per_point`
    lattice nodes per batch, best of `repeats`): seconds per node should not depend on N if the
    partitioners' cost model, (N+1)(N+2)/2, is right."""
    from pricer.engines import get_engine
    from pricer.tools.generate import generate
    from pricer.model.greeks import price_with_analytics
    from pricer.model.cost import lattice_nodes

    engine = get_engine(backend)
    warm = generate("uniform", 8, steps=64).columns("crr")
    price_with_analytics(engine, warm, "crr", np.arange(8))   # compile / load the kernels
    rows = []
    for n in steps_list:
        count = max(4, int(nodes_per_point / float(lattice_nodes(n))))
        cols = generate("uniform", count, seed=n, steps=n).columns("crr")
        ids = np.arange(count)
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            price_with_analytics(engine, cols, "crr", ids)
            best = min(best, time.perf_counter() - t)
        nodes = float(lattice_nodes(np.full(count, n)).sum())
        rows.append({"steps": n, "options": count, "nodes": nodes, "seconds": best,
                     "ns_per_node": best / nodes * 1e9})
    ref = statistics.median(r["ns_per_node"] for r in rows)
    for r in rows:
        r["relative"] = r["ns_per_node"] / ref
    return rows


def markdown_cost_model(rows: list[dict]) -> list[str]:
    lines = ["Cost model check: seconds per lattice node of the cpu engine by N "
             "(relative: to the median over N; 1.00 everywhere = cost ∝ (N+1)(N+2)/2 exactly)", "",
             "| N | options | nodes | seconds | ns / node | relative |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['steps']} | {r['options']} | {r['nodes']:.3g} | {r['seconds']:.3f} | "
                     f"{r['ns_per_node']:.3f} | {r['relative']:.2f} |")
    return lines
