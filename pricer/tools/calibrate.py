"""`pricer calibrate`: time the GPU regimes on the GPU at hand and cache the thresholds they choose.

What is chosen, and how (every time from pricer.tools.bench_gpu: CUDA events around one whole option,
median of the repeats, or wall time of a portfolio for the CPU crossover):
- tiled VT/K: `gpu` mode on one wide option, tiled down to a fifth of its width, for a few (VT, K).
  A candidate replaces the default only where it is faster by more than 3 % (PAYS).
- T1: for bands of level widths [lo, hi] (doubling), one option of N = hi through `gpu` mode with
  T1 = lo (tiled over the band) and with T1 = hi (the persistent kernel over the band, "pers" in
  the log and the timings); both finish with the same levels below lo, so the difference is the
  band's. Level widths do not depend on N, so the bands add up: T1 is the band edge that minimises
  the summed (tiled - pers) of the bands above it.
- T2: likewise for narrow bands, `hybrid` with T2 = lo (the persistent kernel over the band, the
  CPU tail below) against T2 = hi (the CPU tail, kernels.backward_inplace, over the band as well);
  T2 is the edge that minimises the summed (CPU - pers) of the bands below it.
- cpu_max_steps: bench_gpu.crossover (portfolios of one N: hybrid, every option on the GPU, against
  the all-cores `cpu` engine); the largest N kept on the CPU that minimises the summed time.
- hw_flat_threads, hw_flat_rows (the Hull-White family; wall time of the engine's whole call, the
  per-step arrays filled on the GPU as in a run). hw_flat_threads: GPU-FLAT in blocks of 128 and
  of 256 threads (two tree rows a thread; a launch's blocks are larger where its widest tree
  needs it) on the datasets U2, R1 and S1 (their trees' shapes; pricer/tools/bond_datasets.py),
  books of about `hw_steps` tree steps (a bond run's chunks are at most 2^24); 128 unless 256 is
  faster in sum by more than 3 % (PAYS). Then, for bands of tree widths [lo, hi) (rows,
  doubling), a book of `hw_count` instruments of widths uniform in the band and heights uniform
  in [13, 1 200] monthly steps, priced by GPU-OUTER and by GPU-FLAT in the chosen blocks;
  hw_flat_rows is the band edge below which GPU-FLAT and above which GPU-OUTER minimise the
  summed time (the highest such edge on a tie).
The values go to the calibration cache (pricer/engines/gpu/calibration.py), which the GPU engines
read.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from pricer import __version__
from pricer.engines.gpu.calibration import CALIBRATED, SCHEMA, check_values, store_calibration
from pricer.engines.gpu.config import GpuConfig
from pricer.errors import InputError

PAYS = 0.97   # a VT/K candidate replaces the default only if at most 97 % of its time

FULL = dict(
    tiled_n=500_000, tiled=((4, 128), (4, 256), (8, 128), (8, 256), (8, 512), (16, 512), (16, 1024)),
    t1_edges=(10_000, 20_000, 40_000, 80_000, 160_000, 320_000, 640_000),
    t2_edges=(0, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    cpu_sizes=(100, 200, 300, 500, 750, 1000, 1500, 2000, 3000),
    repeats=5, band_repeats=21, count=128,
    hw_edges=(3, 33, 65, 129, 257, 513, 1025), hw_count=4000, hw_steps=1 << 23)
QUICK = dict(
    tiled_n=200_000, tiled=((4, 256), (8, 256), (16, 512)),
    t1_edges=(10_000, 20_000, 40_000, 80_000, 160_000),
    t2_edges=(0, 64, 128, 256, 512, 1024, 2048),
    cpu_sizes=(100, 300, 500, 1000, 2000),
    repeats=3, band_repeats=11, count=128,
    hw_edges=(3, 33, 129, 513, 1025), hw_count=2000, hw_steps=1 << 22)
HW_THREADS = (128, 256)            # GPU-FLAT's blocks tried, the default first
HW_DATASETS = ("U2", "R1", "S1")  # the shapes of trees they are tried on


def _best_edge(edges, diffs, above: bool, top_on_tie: bool | None = None
               ) -> tuple[int, list[float]]:
    """Index j into edges minimising the summed diffs of the bands above edge j (above=True: bands
    j.. ; index len(edges)-1 sums nothing) or below it (above=False: bands ..j-1; index 0 sums
    nothing); ties go to the edge that changes least (the top for T1, the bottom for T2), or to
    the top or the bottom as `top_on_tie` says."""
    m = len(diffs)
    sums = [sum(diffs[j:]) if above else sum(diffs[:j]) for j in range(m + 1)]
    order = range(m, -1, -1) if (above if top_on_tie is None else top_on_tie) else range(m + 1)
    best = min(order, key=lambda j: sums[j])
    return best, sums


def calibrate(quick: bool = False, out: str | None = None, store: bool = True, log=print) -> dict:
    """Measure, choose, print, and (store=True) write the cache; returns the record."""
    from pricer.engines.gpu.engine import GpuEngine
    from pricer.engines.gpu.regimes import CudaKernels
    from pricer.engines.gpu.runtime import GpuRuntime
    from pricer.tools.bench_gpu import american_put, crossover, time_gpu

    plan = QUICK if quick else FULL
    reps, band_reps = plan["repeats"], plan["band_repeats"]
    t_start = time.perf_counter()
    rt = GpuRuntime.get()
    base = GpuConfig()
    log(f"# pricer {__version__} calibrate{' --quick' if quick else ''} on {rt.name} ({rt.arch}); "
        f"one American put S=K=100 T=1 sigma=0.2 r=0.05; GPU times: CUDA events, median of "
        f"{reps} (bands: {band_reps}), one warm-up run not counted")
    kernels_by_shape: dict = {}

    def engine(mode: str, cfg: GpuConfig) -> GpuEngine:
        # explicit config: the cache plays no part; kernels shared by configs of one tile shape
        shape = (cfg.tiled_b, cfg.tiled_vt, cfg.warp_vt, cfg.fma)
        if shape not in kernels_by_shape:
            kernels_by_shape[shape] = CudaKernels(cfg, rt)
        return GpuEngine(mode, config=cfg, kernels=kernels_by_shape[shape])

    def measure(mode: str, cfg: GpuConfig, n: int, repeats: int) -> float:
        eng, p = engine(mode, cfg), american_put(n)
        eng.price_one(p, 0)                       # warm-up: module load, buffers, numba
        return time_gpu(eng, p, repeats, cap_s=10.0)[0]

    timings: dict = {}

    # tiled VT/K
    n = plan["tiled_n"]
    log(f"\n## tiled VT/K: `gpu` mode, N = {n}, tiled down to {n // 5} (persistent below)")
    rows = []
    for vt, k in plan["tiled"]:
        cfg = replace(base, tiled_vt=vt, tiled_k=k, t1=n // 5).check()
        sec = measure("gpu", cfg, n, reps)
        rows.append(dict(vt=vt, k=k, seconds=sec))
        log(f"tiled VT={vt:>2} K={k:>4}: {sec * 1e3:9.3f} ms")
    tiled_vt, tiled_k, why = _pick_shape(rows, base.tiled_vt, base.tiled_k)
    log(f"-> tiled VT={tiled_vt} K={tiled_k} ({why})")
    timings["tiled"] = dict(n=n, mode="gpu", t1=n // 5, rows=rows)

    shape = replace(base, tiled_vt=tiled_vt, tiled_k=tiled_k).check()

    # T1
    edges = plan["t1_edges"]
    log("\n## T1: band [lo, hi] of level widths, one option of N = hi in `gpu` mode, tiled over the "
        "band (T1 = lo) or the persistent kernel over it (T1 = hi); that kernel below lo in both")
    rows, diffs = [], []
    for lo, hi in zip(edges, edges[1:]):
        tiled = measure("gpu", replace(shape, t1=lo), hi, reps)
        pers = measure("gpu", replace(shape, t1=hi), hi, reps)
        rows.append(dict(lo=lo, hi=hi, tiled_s=tiled, pers_s=pers))
        diffs.append(tiled - pers)
        log(f"band [{lo:>7}, {hi:>7}]: tiled {tiled * 1e3:9.3f} ms  pers {pers * 1e3:9.3f} ms  "
            f"tiled - pers {(tiled - pers) * 1e3:+8.3f} ms")
    j, sums = _best_edge(edges, diffs, above=True)
    t1 = edges[j]
    log(f"-> T1 = {t1} (summed tiled - pers above each edge, ms: "
        + ", ".join(f"{e}: {s * 1e3:+.3f}" for e, s in zip(edges, sums)) + ")")
    timings["t1"] = dict(mode="gpu", rows=rows, sums_s=dict(zip(map(str, edges), sums)))

    # T2
    edges = plan["t2_edges"]
    assert t1 >= edges[-1]
    log("\n## T2: band [lo, hi], one option of N = hi in `hybrid` mode, the persistent kernel over the band and the "
        "CPU tail below (T2 = lo) or the CPU tail (serial.backward_inplace) over it (T2 = hi)")
    rows, diffs = [], []
    for lo, hi in zip(edges, edges[1:]):
        pers = measure("hybrid", replace(shape, t1=t1, t2=lo), hi, band_reps)
        cpu = measure("hybrid", replace(shape, t1=t1, t2=hi), hi, band_reps)
        rows.append(dict(lo=lo, hi=hi, pers_s=pers, cpu_s=cpu))
        diffs.append(cpu - pers)
        log(f"band [{lo:>5}, {hi:>5}]: pers {pers * 1e6:9.1f} us  CPU tail {cpu * 1e6:9.1f} us  "
            f"CPU - pers {(cpu - pers) * 1e6:+8.1f} us")
    j, sums = _best_edge(edges, diffs, above=False)
    t2 = edges[j]
    log(f"-> T2 = {t2} (summed CPU - pers below each edge, us: "
        + ", ".join(f"{e}: {s * 1e6:+.1f}" for e, s in zip(edges, sums)) + ")")
    timings["t2"] = dict(mode="hybrid", rows=rows, sums_s=dict(zip(map(str, edges), sums)))

    # cpu_max_steps
    sizes, count = plan["cpu_sizes"], plan["count"]
    log(f"\n## cpu_max_steps: {count} American options of one N, hybrid (every option on the GPU, "
        f"batch kernel) against the cpu engine, wall time, median of {reps}")
    rows = crossover(sizes, count, log=log, repeats=reps, config=replace(shape, t1=t1, t2=t2))
    cost = [sum(r["cpu_s"] for r in rows[:j]) + sum(r["gpu_s"] for r in rows[j:])
            for j in range(len(rows) + 1)]
    j = min(range(len(rows) + 1), key=lambda i: cost[i])
    cpu_max = rows[j - 1]["n"] if j else 0
    log(f"-> cpu_max_steps = {cpu_max} (summed time with the CPU up to each N, ms: 0: "
        f"{cost[0] * 1e3:.2f}, " + ", ".join(f"{r['n']}: {c * 1e3:.2f}" for r, c in zip(rows, cost[1:]))
        + ")")
    timings["cpu_max_steps"] = dict(count=count, rows=rows)

    hw_flat_rows, hw_flat_threads, timings["hw"] = _calibrate_trinomial(plan, log)

    values = dict(t1=t1, t2=t2, tiled_vt=tiled_vt, tiled_k=tiled_k,
                  cpu_max_steps=cpu_max, hw_flat_rows=hw_flat_rows,
                  hw_flat_threads=hw_flat_threads)
    seconds = time.perf_counter() - t_start
    record = dict(schema=SCHEMA, device=rt.name, arch=rt.arch, version=__version__,
                  created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), quick=quick,
                  seconds=seconds, values=check_values(values),
                  defaults={k: v for k, v in asdict(base).items() if k in CALIBRATED},
                  timings=timings)
    log("\nchosen: " + ", ".join(f"{k}={v}" for k, v in values.items())
        + "  (defaults: " + ", ".join(f"{k}={record['defaults'][k]}" for k in CALIBRATED) + ")")
    if store:
        log(f"wrote {store_calibration(record)}")
    if out:
        store_calibration(record, Path(out))
        log(f"wrote {out}")
    log(f"calibration took {seconds:.1f} s")
    return record


def _calibrate_trinomial(plan: dict, log) -> tuple[int, int, dict]:
    """hw_flat_rows and hw_flat_threads (module doc), and their timings."""
    import numpy as np

    from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
    from pricer.model import bond_book
    from pricer.tools.bond_datasets import (CURVE, HEIGHTS, columns_of_shapes, dataset_columns,
                                             shapes)

    reps = plan["repeats"]

    def seconds(engine, params) -> float:
        engine.price(params)                      # warm-up: module load, buffers
        walls = []
        for _ in range(reps):
            start = time.perf_counter()
            engine.price(params)
            walls.append(time.perf_counter() - start)
        return float(np.median(walls))

    rng = np.random.default_rng(2026)
    log(f"\n## hw_flat_threads: GPU-FLAT's block on books of about {plan['hw_steps']} tree steps "
        "of the datasets' shapes")
    engines = {t: HullWhiteGpuEngine("flat", flat_threads=t) for t in HW_THREADS}
    books = []
    for name in HW_DATASETS:
        heights = shapes(name, 10_000, rng)[1]                        # the mean height's sample
        cols = dataset_columns(name, max(1, int(plan["hw_steps"] / heights.mean())))
        params = bond_book.tree_parameters(cols, [CURVE], fill=False)
        books.append(dict(dataset=name, instruments=len(params),
                          **{f"flat{t}_s": seconds(e, params) for t, e in engines.items()}))
        log(f"{name} ({len(params)} instruments): " + "  ".join(
            f"{t} threads {books[-1][f'flat{t}_s'] * 1e3:8.2f} ms" for t in HW_THREADS))
    spent = {t: sum(b[f"flat{t}_s"] for b in books) for t in HW_THREADS}
    threads, other = HW_THREADS
    if spent[other] <= PAYS * spent[threads]:
        threads = other
    log(f"-> hw_flat_threads = {threads} (summed ms: "
        + ", ".join(f"{t}: {v * 1e3:.2f}" for t, v in spent.items()) + ")")
    edges, count = plan["hw_edges"], plan["hw_count"]
    log(f"\n## hw_flat_rows: {count} Hull-White instruments a band of tree widths [lo, hi), "
        f"heights uniform in {list(HEIGHTS)}, GPU-OUTER and GPU-FLAT, wall time of the whole "
        f"call, median of {reps}")
    outer = HullWhiteGpuEngine("outer")
    flat = HullWhiteGpuEngine("flat", flat_threads=threads)
    bands = []
    for lo, hi in zip(edges, edges[1:]):
        widths = rng.integers(lo // 2, (hi - 1) // 2, count) * 2 + 1      # odd, in [lo, hi)
        heights = rng.integers(HEIGHTS[0], HEIGHTS[1] + 1, count)
        params = bond_book.tree_parameters(columns_of_shapes(widths, heights, rng), [CURVE],
                                           fill=False)
        bands.append(dict(lo=lo, hi=hi, outer_s=seconds(outer, params),
                          flat_s=seconds(flat, params)))
        log(f"band [{lo:>4}, {hi:>4}): outer {bands[-1]['outer_s'] * 1e3:9.2f} ms  flat "
            f"{bands[-1]['flat_s'] * 1e3:8.2f} ms")
    # the highest edge on a tie: the default takes every band
    j, sums = _best_edge(edges, [b["flat_s"] - b["outer_s"] for b in bands], above=False,
                         top_on_tie=True)
    flat_rows = edges[j] - 1
    log(f"-> hw_flat_rows = {flat_rows} (summed flat - outer below each edge, ms: "
        + ", ".join(f"{e}: {s * 1e3:+.2f}" for e, s in zip(edges, sums)) + ")")
    return flat_rows, threads, dict(bands=bands, sums_s=dict(zip(map(str, edges), sums)),
                                    books=books)


def _pick_shape(rows, default_vt, default_k):
    default = next((r for r in rows if (r["vt"], r["k"]) == (default_vt, default_k)), None)
    best = min(rows, key=lambda r: r["seconds"])
    if default is None:
        return best["vt"], best["k"], "the default was not measured: fastest"
    if best is default:
        return default_vt, default_k, "the default is the fastest"
    gain = 1 - best["seconds"] / default["seconds"]
    if best["seconds"] <= PAYS * default["seconds"]:
        return best["vt"], best["k"], f"{gain:.1%} faster than the default VT={default_vt} K={default_k}"
    return default_vt, default_k, (f"default kept: the fastest, VT={best['vt']} K={best['k']}, is only "
                                   f"{gain:.1%} faster (needs {1 - PAYS:.0%})")


def main(quick: bool = False, out: str | None = None) -> int:
    """`pricer calibrate`: exit 2 with a message where no GPU can be used."""
    from pricer.engines import gpu_available
    from pricer.engines.gpu.runtime import GpuUnavailable

    if not gpu_available():
        raise InputError("no usable GPU here: pricer calibrate times the GPU regimes and needs pycuda, "
                         "a visible CUDA device and nvcc (PRICER_NO_GPU unset)")
    try:
        calibrate(quick=quick, out=out)
    except GpuUnavailable as exc:
        raise InputError(f"no usable GPU here: {exc}") from None
    sys.stdout.flush()
    return 0

