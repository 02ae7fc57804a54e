"""`pricer bench trinomial`: the Hull–White family's engines on the seven datasets of Pawlak et al.
(2021) (pricer/tools/bond_datasets.py), as they measure them, beside QuantLib.

For each dataset: the trees' parameters are built (bond_book.tree_parameters, reported, not
timed; for a GPU engine without the per-step arrays, which it fills in its own memory as the bond
run has it do), then each engine prices the whole dataset `repeats` times after a warm-up; the
median wall time counts.
Reported per engine: seconds, tree nodes per second (the forward and the backward sweep each
count every node of the tree: 2 x HullWhiteParams.nodes()), and GFLOP^SPEC/s.

GFLOP^SPEC counts the floating-point operations of the algorithm's specification per node, as
Pawlak et al. (2021) count those of their Listing 2 (whose per-node functions g1 and g3 are the two
three-term updates below; an exp counts as one operation):
- forward (Listing 2's g1 and the reduce): the node's weight e^{-j dr dt} (2 multiplications,
  1 exp), its term of the level's sum (1 multiplication, 1 addition), its discounted state price
  (2 multiplications), its three children's shares (3 multiplications, 3 additions): 13;
- backward (g3): the node's discount e^{-(alpha + j dr) dt} (2 multiplications, 1 addition,
  1 exp), the cash flow added to the bond's and the instrument's three children (2 additions,
  counted once a node), the two three-term expectations (6 multiplications, 4 additions) and
  their discounting (2 multiplications): 18 (an exercise's comparison is not counted).

The QuantLib anchor: the first `quantlib` instruments of the dataset as callable (a call) or
puttable (a put) bonds, priced one at a time by QuantLib's TreeCallableFixedRateBondEngine with
the same a, sigma, curve and steps on one core, against the cpu engine on one thread on the same
instruments (product callable / puttable), REPLICAS times over in one call so that the call's
fixed cost is spread as over a book; each side the median of `repeats` runs taken in turns.
QuantLib's tree is wider (its branching bounds |j M| by 1/2, not 0.184: docs/numerics.md), so
both instruments/s and nodes/s are printed.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from pricer.tools.bond_datasets import CURVE, DATASETS, dataset, dataset_columns
from pricer.tools.tables import write_json

FLOPS_FORWARD, FLOPS_BACKWARD = 13, 18
TARGET_QUANTLIB = 30.0
REPLICAS = 20     # the anchor's sample priced this many times over in one call of the cpu engine


def add_arguments(ap) -> None:
    ap.add_argument("--datasets", default=",".join(DATASETS),
                    help=f"comma-separated (default all: {','.join(DATASETS)})")
    ap.add_argument("--count", type=int, default=None,
                    help="instruments per dataset (default Pawlak et al.'s (2021): 3 000 for U1, "
                         "else 100 000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantlib", type=int, default=20,
                    help="instruments of each dataset for the QuantLib anchor (0: none)")
    ap.add_argument("--engines", default="default",
                    help="comma-separated: cpu, outer (GPU-OUTER), flat (GPU-FLAT), auto (the "
                         "GPU's rule); default: cpu, and the GPU's three where a GPU is usable")
    ap.add_argument("--flat-rows", type=int, default=None,
                    help="auto's widest tree for GPU-FLAT (default the engine's)")
    ap.add_argument("--flat-threads", type=int, default=None,
                    help="GPU-FLAT's block (default the engine's)")
    ap.add_argument("--out", default=None, help="also write the measurements as JSON here")


def _median(call, repeats: int) -> tuple[float, np.ndarray]:
    result = call()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        walls.append(time.perf_counter() - start)
    return float(np.median(walls)), result


def _quantlib_seconds(instruments, a, sigma, curve) -> float:
    """QuantLib's seconds for these instruments as callable / puttable bonds, one at a time."""
    import QuantLib as ql

    today = ql.Date(27, 11, 2026)
    ql.Settings.instance().evaluationDate = today
    dates = [today + int(round(t * 365)) for t in curve.times]
    zero = ql.ZeroCurve([today] + dates, [float(curve.rates[0])] + curve.rates.tolist(),
                        ql.Actual365Fixed(), ql.NullCalendar(), ql.Linear(), ql.Continuous)
    handle = ql.YieldTermStructureHandle(zero)
    start = time.perf_counter()
    for inst, x, s in zip(instruments, a, sigma):
        months = int(round(inst.maturity * 12))
        schedule = ql.Schedule(today, today + ql.Period(months, ql.Months),
                               ql.Period(ql.Semiannual), ql.NullCalendar(), ql.Unadjusted,
                               ql.Unadjusted, ql.DateGeneration.Backward, False)
        rights = ql.CallabilitySchedule()
        for t in inst.exercise_times():
            rights.append(ql.Callability(
                ql.BondPrice(inst.strike, ql.BondPrice.Clean),
                ql.Callability.Call if inst.call else ql.Callability.Put,
                today + ql.Period(int(round(t * 12)), ql.Months)))
        bond = ql.CallableFixedRateBond(0, inst.face, schedule, [inst.coupon],
                                        ql.Actual365Fixed(), ql.Unadjusted, inst.face, today,
                                        rights)
        bond.setPricingEngine(ql.TreeCallableFixedRateBondEngine(
            ql.HullWhite(handle, float(x), float(s)), months))
        bond.NPV()
    return time.perf_counter() - start


def _engines(names: str, flat_rows: int | None, flat_threads: int | None):
    """The engines asked for (`cpu`, `outer`, `flat`, `auto`; `default`: cpu, and the GPU's
    three where a GPU is usable), by name."""
    from pricer.engines.cpu.trinomial import HullWhiteCpuEngine
    from pricer.engines.gpu.runtime import gpu_available

    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if wanted == ["default"]:
        wanted = ["cpu", *(["outer", "flat", "auto"] if gpu_available() else [])]
    out = {}
    for name in wanted:
        if name == "cpu":
            out[name] = HullWhiteCpuEngine()
        else:
            from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
            out[name] = HullWhiteGpuEngine(name, flat_rows=flat_rows,
                                           flat_threads=flat_threads)
    return out


def bench_trinomial(args) -> list[dict]:
    import numba

    from pricer.model import bond_book

    from pricer.tools.anchors import have_quantlib, missing

    if args.quantlib and not have_quantlib("trinomial"):
        args.quantlib = 0
        print(missing("cpu engine per core against QuantLib's tree engine"), flush=True)
    engines = _engines(args.engines, args.flat_rows, args.flat_threads)
    cpu = engines.get("cpu")
    threads = numba.get_num_threads()
    bound = None
    if any(e.uses_gpu for e in engines.values()):
        from pricer.engines.gpu.runtime import GpuRuntime
        from pricer.tools.bench_gpu import fp64_fma_peak
        rt = GpuRuntime.get()
        peak = 2.0 * fp64_fma_peak(rt)
        bound = peak / (FLOPS_FORWARD + FLOPS_BACKWARD)       # nodes (both sweeps) a second
        print(f"{rt.name}: FP64 peak {peak / 1e12:.1f} TFLOP/s measured (fma chains), so at most "
              f"{2 * bound:.3e} nodes/s (both sweeps) at {FLOPS_FORWARD + FLOPS_BACKWARD} "
              "GFLOP^SPEC a node")
    print(f"cpu engine on {threads} thread(s); GFLOP^SPEC: {FLOPS_FORWARD} forward + "
          f"{FLOPS_BACKWARD} backward per node; GPU seconds include the sort, the packing, the "
          "per-step arrays' fill and the copies both ways")
    print("| dataset | instruments | nodes (one sweep) | engine | s | nodes/s (both sweeps) "
          "| GFLOP^SPEC/s | share of FP64 bound | QuantLib, one core: instruments/s "
          "| cpu, one thread | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        t0 = time.perf_counter()
        cols = dataset_columns(name, args.count)
        unfilled = bond_book.tree_parameters(cols, [CURVE], fill=False)
        # the per-step arrays built on the host only for an engine that does not fill them
        params = bond_book.tree_parameters(cols, [CURVE]) if not all(
            getattr(e, "fills_steps", False) for e in engines.values()) else unfilled
        setup = time.perf_counter() - t0
        nodes = float(unfilled.nodes().sum())
        faces = cols["face"]
        flops = nodes * (FLOPS_FORWARD + FLOPS_BACKWARD)
        reference = None
        for label, engine in engines.items():
            given = unfilled if getattr(engine, "fills_steps", False) else params
            seconds, prices = _median(lambda: engine.price(given), args.repeats)
            if reference is None:
                reference = prices
            # relative to the price, or to 1 % of the face where the price is smaller (an option
            # worth little beside its bond carries the bond's rounding)
            agree = float(np.max(np.abs(prices - reference)
                                 / np.maximum(np.abs(reference), 0.01 * faces)))
            row = dict(dataset=name, engine=label, instruments=len(faces), nodes=nodes,
                       setup_seconds=setup, seconds=seconds, nodes_per_second=2.0 * nodes / seconds,
                       gflops_spec=flops / seconds / 1e9, threads=threads,
                       max_rel_difference=agree)
            share, kernel = "—", ""
            if engine.uses_gpu and bound:
                row["share_of_bound"] = nodes / seconds / bound
                row["kernel_seconds"] = engine.kernel_seconds
                share = f"{row['share_of_bound']:.1%}"
                kernel = (f" (kernels {engine.kernel_seconds:.4f} s: "
                          f"{flops / engine.kernel_seconds / 1e9:.0f})")
            anchor = "— | — | — |"
            if label == "cpu" and args.quantlib:
                row.update(_anchor(cpu, *dataset(name, args.count), args, threads))
                anchor = (f"{row['quantlib_per_second']:.3g} | "
                          f"{row['cpu_one_thread_per_second']:.3g} | "
                          f"{row['quantlib_ratio']:.0f}x |")
            print(f"| {name} | {len(faces):,} | {nodes:.3e} | {label} | {seconds:.4f} | "
                  f"{2.0 * nodes / seconds:.3e} | {flops / seconds / 1e9:.1f}{kernel} | {share} | {anchor}",
                  flush=True)
            rows.append(row)
        worst = max(r["max_rel_difference"] for r in rows if r["dataset"] == name)
        if worst > 1e-12:
            print(f"WARNING: {name}: the engines differ by {worst:.2e} relative (more than 1e-12)")
    anchored = [r["quantlib_ratio"] for r in rows if "quantlib_ratio" in r]
    if anchored:
        worst = min(anchored)
        print(f"cpu engine per core against QuantLib's tree engine: at least {worst:.0f}x "
              f"(target {TARGET_QUANTLIB:.0f}x: {'met' if worst >= TARGET_QUANTLIB else 'NOT met'})")
    write_json(args.out, rows)
    return rows


def _anchor(engine, instruments, a, sigma, per_year, curve, args, threads) -> dict:
    """QuantLib on one core against the cpu engine on one thread, on the dataset's first
    `args.quantlib` instruments as callable / puttable bonds."""
    import numba

    from pricer.model import bond_book

    k = min(args.quantlib, len(instruments))
    sample = [replace(inst, product="callable" if inst.call else "puttable")
              for inst in instruments[:k]]
    # the sample REPLICAS times over in one call: a call's fixed cost spread as a book's
    ours = bond_book.parameters(sample * REPLICAS, np.tile(a[:k], REPLICAS),
                                np.tile(sigma[:k], REPLICAS), per_year, curve)
    # both sides the median of as many runs, taken in turns: a shared host's speed drifts, and
    # then moves both sides alike
    ones, theirs = [], []
    numba.set_num_threads(1)
    try:
        engine.price(ours)                      # its start-up (a cache load), not timed
        for _ in range(max(1, args.repeats)):
            start = time.perf_counter()
            engine.price(ours)
            ones.append((time.perf_counter() - start) / REPLICAS)
            theirs.append(_quantlib_seconds(sample, a[:k], sigma[:k], curve))
    finally:
        numba.set_num_threads(threads)
    one, theirs = float(np.median(ones)), float(np.median(theirs))
    return dict(quantlib_per_second=k / theirs, cpu_one_thread_per_second=k / one,
                quantlib_ratio=theirs / one)
