"""`pricer bench scenarios`: a scenario grid's throughput against the expanded book's.

The book: `count` American options of N = `steps` (`pricer generate --dist uniform --exercise
american`, a fixed seed) under a grid of `spot` relative spot shifts in [-0.2, 0.2] by
`volatility` volatility shifts in [-0.05, 0.05]. Timed, median of `repeats` after a warm-up:

- expanded: the book with every scenario's rows written out (base rows first), as lattice
  parameters built beforehand, priced by one engine call (what `pricer bench batch` times: lattice
  numbers in host memory to prices in host memory);
- grid, engine call: the same lattices as the grid holds them (pricer.model.scenarios.
  ScenarioLattices, base first: for the spot-free trees one set of numbers per volatility shift),
  built beforehand, priced by one engine call (Engine.price_lattices) -- the GPU's throughput on a
  grid against the expanded book's, each from its lattice numbers in host memory (the target);
- grid, compute stage: `pricer price --scenario-spot ... --scenario-volatility ...` on the checked
  book (run/pricing.price_checked: the checks, the grid's lattice numbers, the engine calls in the
  chunks a run cuts, the results' columns) -- what a run's compute stage takes.

All count the same lattice nodes, N(N+1)/2 per lattice; the grid's prices must be bitwise the
expanded book's.
"""

from __future__ import annotations

import time

import numpy as np

from pricer.tools.tables import write_json

TARGET = 0.9   # the grid's nodes/s against the expanded book's


def add_arguments(ap) -> None:
    ap.add_argument("--backend", default=None,
                    help="default: batch where a GPU is usable, else cpu")
    ap.add_argument("--count", type=int, default=10_000, help="options (default 10,000)")
    ap.add_argument("--steps", type=int, default=1000, help="N of every option (default 1000)")
    ap.add_argument("--spot", type=int, default=9, help="spot shifts (default 9)")
    ap.add_argument("--volatility", type=int, default=9, help="volatility shifts (default 9)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the measurements as JSON here")


def _median_seconds(call, repeats: int):
    call()
    walls, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        walls.append(time.perf_counter() - start)
    return float(np.median(walls)), result


def bench_scenarios(args) -> dict:
    from pricer.engines import get_engine, gpu_available
    from pricer.model.greeks import concatenate
    from pricer.model.lattice import lattice_parameters
    from pricer.model.scenarios import ScenarioLattices
    from pricer.run.checks import checked_rows
    from pricer.run.config import RunConfig
    from pricer.run.pricing import price_checked
    from pricer.tools.generate import generate

    backend = args.backend or ("batch" if gpu_available() else "cpu")
    scenarios = {"spot": f"-0.2:0.2:{args.spot}", "volatility": f"-0.05:0.05:{args.volatility}"}
    cfg = RunConfig(input="bench", output="bench.h5", backend=backend,
                    scenarios=scenarios).check()
    grid = cfg.analytics().scenarios
    book = generate("uniform", args.count, seed=2026, steps=args.steps, exercise="american")
    engine = get_engine(backend)
    engine.warm_up()
    cols = book.columns("crr")
    params = lattice_parameters(concatenate([cols] + grid.columns(cols)), "crr")
    nodes = float((params.steps * (params.steps + 1) // 2).sum())
    expanded, prices = _median_seconds(lambda: engine.price(params), args.repeats)
    lattices = ScenarioLattices({key: np.ascontiguousarray(value) for key, value in cols.items()},
                                grid, "crr", book.id, base=True)
    called, in_call = _median_seconds(lambda: engine.price_lattices(lattices), args.repeats)
    checked = checked_rows(cfg, book)
    gridded, (values, _) = _median_seconds(
        lambda: price_checked(engine, cfg, checked, book.id), args.repeats)
    n = len(book)
    bitwise = (np.array_equal(values[:, 1:1 + grid.count], prices[n:].reshape(grid.count, n).T)
               and np.array_equal(values[:, 0], prices[:n]) and np.array_equal(in_call, prices))
    ratio, stage = expanded / called, expanded / gridded
    print(f"{n:,} American options x N = {args.steps}, {grid.count} scenarios ({args.spot} spot x "
          f"{args.volatility} volatility), backend {backend}: {nodes:.3e} nodes, median of "
          f"{args.repeats}")
    print("| | seconds | nodes/s |")
    print("|---|---|---|")
    print(f"| expanded book, one engine call | {expanded:.3f} | {nodes / expanded:.3e} |")
    print(f"| scenario grid, engine call | {called:.3f} | {nodes / called:.3e} |")
    print(f"| scenario grid, compute stage | {gridded:.3f} | {nodes / gridded:.3e} |")
    print(f"grid / expanded, engine call: {ratio:.1%} (target {TARGET:.0%}: "
          f"{'met' if ratio >= TARGET else 'NOT met'}); compute stage: {stage:.1%}; prices "
          f"bitwise the expanded book's: {bitwise}")
    result = dict(backend=backend, options=n, steps=args.steps, scenarios=grid.count, nodes=nodes,
                  expanded_seconds=expanded, call_seconds=called, grid_seconds=gridded,
                  ratio=ratio, stage_ratio=stage, bitwise=bitwise)
    write_json(args.out, result)
    return result
