"""`pricer bench gpu`: the layout of Table 5 of Cao (2025) on the GPU at hand.

One American put (S = K = 100, T = 1, sigma = 0.2, r = 0.05) at N = 1k ... 1M, priced by the
wavefront, tiled, warp-per-block and hybrid regimes (and the CPU `serial`/`cpu` engines where they
finish in reasonable time). GPU times come from CUDA events around one whole option (tables,
upload, kernels, download and, for hybrid, the CPU tail), after each size has been priced
untimed for WARMUP_S (at least once); the median of the repeats is reported, with nodes/s and
the share of the FP64 FMA peak measured in the same run (an American node costs about 4 FP64
instructions, so the node bound is peak / 4).

Usage: pricer bench gpu [--quick] [--out FILE.json] (or python -m pricer.tools.bench_gpu ...)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from pricer.model.lattice import lattice_parameters
from pricer.tools.tables import write_json

SIZES = (1_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000)
KERNELS = ("wavefront", "tiled", "warp", "hybrid")
SEED_RTX2080_HYBRID_MS = {1_000: 0.63, 100_000: 358.6, 1_000_000: 28_600.0}


def american_put(steps: int):
    one = lambda v: np.array([v], dtype=np.float64)  # noqa: E731
    cols = dict(spot=one(100.0), strike=one(100.0), maturity=one(1.0), volatility=one(0.2),
                rate=one(0.05), dividend=one(0.0), steps=np.array([steps], dtype=np.int64),
                call=np.array([False]), american=np.array([True]))
    return lattice_parameters(cols)


def nodes(n: int) -> int:
    """Backward-induction node updates of an N-step tree (levels N-1 .. 0)."""
    return n * (n + 1) // 2


def fp64_fma_peak(rt, repeats: int = 5) -> float:
    """FP64 FMA/s of this GPU, measured with cuda/fp64_peak.cu."""
    cuda = rt.cuda
    fn = rt.module(["-DCHAINS=8"], "fp64_peak.cu").get_function("fma_peak")
    fn.prepare("Pidd")
    blocks, threads, iters = rt.sms * 8, 256, 1 << 14
    out = rt.alloc(8 * blocks * threads)
    start, end = cuda.Event(), cuda.Event()
    times = []
    for _ in range(repeats + 1):
        start.record(rt.stream)
        fn.prepared_async_call((blocks, 1), (threads, 1, 1), rt.stream, out, np.int32(iters),
                               0.999999, 1e-7)
        end.record(rt.stream)
        end.synchronize()
        times.append(end.time_since(start) / 1e3)
    rt.free(out)
    return blocks * threads * 8 * iters / statistics.median(times[1:])


WARMUP_S = 0.05     # untimed pricing of each size first, for at least this long (and once)


def time_gpu(engine, params, repeats: int, cap_s: float):
    """Median seconds (CUDA events) of pricing the one option, and the price. The option is first
    priced untimed for WARMUP_S (at least once): buffers grown to its size, and the GPU's clocks up
    from idle (an idle GPU runs at a low clock, and the smallest sizes' timed repeats last under a
    millisecond)."""
    rt = engine.kernels.rt
    warm_until = time.perf_counter() + WARMUP_S
    engine.price_one(params, 0)
    while time.perf_counter() < warm_until:
        engine.price_one(params, 0)
    rt.stream.synchronize()
    start, end = rt.cuda.Event(), rt.cuda.Event()
    times, price = [], None
    for i in range(repeats):
        start.record(rt.stream)
        price = engine.price_one(params, 0)
        end.record(rt.stream)
        end.synchronize()
        times.append(end.time_since(start) / 1e3)
        if sum(times) > cap_s:
            break
    return statistics.median(times), price, len(times)


def time_cpu(engine, params, repeats: int, cap_s: float):
    times, price = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        price = float(engine.price(params)[0])
        times.append(time.perf_counter() - t)
        if sum(times) > cap_s:
            break
    return statistics.median(times), price, len(times)


class OneRegime:
    """One option through one of Cao (2025)'s regimes all the way down (Table 5's columns): the
    wavefront (one launch a step), the tiled kernel (tiled_k steps a launch) or the warp-per-block
    kernel (warp_k steps a launch, the whole rest in one once the level fits one tile); the
    production schedule is GpuEngine.price_one."""

    def __init__(self, regime: str, config=None, kernels=None, **overrides):
        from pricer.engines.gpu.calibration import effective_config
        from pricer.engines.gpu.regimes import CudaKernels
        from pricer.engines.gpu.runtime import GpuRuntime

        if regime not in ("wavefront", "tiled", "warp"):
            raise ValueError(f"unknown regime {regime!r}; known: wavefront, tiled, warp")
        self.regime, self.name = regime, regime
        if config is None:
            self.config = effective_config(GpuRuntime.get().name, overrides)[0]
        else:
            self.config = replace(config, **overrides).check()
        self.kernels = kernels if kernels is not None else CudaKernels(self.config)

    def price(self, params) -> np.ndarray:
        """Every option of params, one after another."""
        return np.array([self.price_one(params, k) for k in range(len(params))])

    def price_one(self, p, k: int = 0) -> float:
        from pricer.engines.cpu.kernels import power_tables

        K, c = self.kernels, self.config
        n = int(p.steps[k])
        a, b, tab_d = K.reserve(n + 2)
        tab = K.host_array(2 * n + 2)
        lb, ratio = tab[:n + 1], tab[n + 1:]
        sign = 1.0 if p.call[k] else -1.0
        scalars = (float(p.pu[k]), float(p.pd[k]), float(p.strike[k]), sign, bool(p.american[k]))
        power_tables(float(p.spot[k]), float(p.log_up[k]), float(p.log_down[k]), n, lb, ratio)
        K.upload(tab_d, tab)
        lb_d, r_d = K.split_tables(tab_d, n)
        K.terminal(a, lb_d, r_d, n, scalars[2], sign)
        src, dst, t = a, b, n
        while t > 0:
            if self.regime == "wavefront":
                K.wavefront(src, dst, lb_d, r_d, t - 1, *scalars)
                step = 1
            elif self.regime == "tiled":
                step = min(c.tiled_k, t)
                K.tiled(src, dst, lb_d, r_d, t, step, *scalars)
            else:
                step = t if t + 1 <= c.warp_w else min(c.warp_k, t)
                K.warp(src, dst, lb_d, r_d, t, step, *scalars)
            src, dst = dst, src
            t -= step
        price = np.empty(1)
        K.download(price, src)        # level 0: one node
        return float(price[0])


def regime(name: str, **overrides):
    """Cao (2025)'s regime `name`, or `hybrid`: the production GPU engine's single-option path."""
    if name == "hybrid":
        from pricer.engines.gpu.engine import GpuEngine
        return GpuEngine("hybrid", **overrides)
    return OneRegime(name, **overrides)


def run(sizes=SIZES, kernels=KERNELS, repeats: int = 5, cap_s: float = 20.0, cpu: bool = True,
        cpu_max=(10_000, 50_000), overrides: dict | None = None, log=print) -> dict:
    from pricer.engines.gpu.runtime import GpuRuntime

    rt = GpuRuntime.get()
    peak = fp64_fma_peak(rt)
    log(f"# {rt.name} ({rt.arch}), FP64 FMA peak measured {peak:.3g}/s -> American node bound "
        f"{peak / 4:.3g} nodes/s")
    rows = []
    engines = {}
    for k in kernels:
        eng = regime(k, **(overrides or {}))
        eng.price_one(american_put(1000), 0)                    # warm-up: compile, numba, first launch
        engines[k] = eng
    for n in sizes:
        p = american_put(n)
        for k in kernels:
            # the wavefront pays one launch per step: cap it at one run beyond 100k
            reps = 1 if (k == "wavefront" and n > 100_000) else repeats
            sec, price, done = time_gpu(engines[k], p, reps, cap_s)
            rows.append(dict(n=n, kernel=k, seconds=sec, repeats=done, price=price,
                             nodes_per_s=nodes(n) / sec, peak_share=nodes(n) / sec / (peak / 4)))
            log(f"N={n:>8} {k:>9}: {sec * 1e3:10.3f} ms  {nodes(n) / sec:9.3g} nodes/s  "
                f"price {price!r}  ({done} runs)")
        if cpu:
            from pricer.engines.cpu.parallel import CpuEngine
            from pricer.engines.cpu.serial import SerialEngine
            for name, eng, limit in (("serial", SerialEngine(), cpu_max[0]), ("cpu", CpuEngine(), cpu_max[1])):
                if n > limit:
                    continue
                eng.price(american_put(200))
                sec, price, done = time_cpu(eng, p, min(repeats, 3), cap_s)
                rows.append(dict(n=n, kernel=name, seconds=sec, repeats=done, price=price,
                                 nodes_per_s=nodes(n) / sec, peak_share=None))
                log(f"N={n:>8} {name:>9}: {sec * 1e3:10.3f} ms  {nodes(n) / sec:9.3g} nodes/s  "
                    f"price {price:.12f}  ({done} runs)")
    return dict(device=rt.name, arch=rt.arch, fp64_fma_peak=peak, option="American put S=K=100 T=1 "
                "sigma=0.2 r=0.05 q=0", config=dict((overrides or {})), rows=rows)


def crossover(sizes=(100, 500, 1_000, 2_000, 5_000, 10_000), count: int = 128, log=print,
              repeats: int = 1, config=None) -> list:
    """A portfolio of `count` options at one N: hybrid (every option through the GPU) against the
    all-cores `cpu` engine, wall time (median of `repeats`); where the GPU stops losing informs
    AUTO_CPU_MAX_NODES (pricer/engines/__init__.py) and `pricer calibrate`'s cpu_max_steps.
    `config`: the GpuConfig to use (default: the engine's own, calibrated where a calibration is
    cached)."""
    from pricer.engines.cpu.parallel import CpuEngine
    from pricer.engines.gpu.engine import GpuEngine

    gpu, cpu = GpuEngine("hybrid", config=config, cpu_max_steps=0), CpuEngine()
    rows = []
    for n in sizes:
        rng = np.random.default_rng(n)
        cols = dict(spot=rng.uniform(80, 120, count), strike=rng.uniform(80, 120, count),
                    maturity=rng.uniform(0.25, 2, count), volatility=rng.uniform(0.1, 0.4, count),
                    rate=np.full(count, 0.03), dividend=np.zeros(count),
                    steps=np.full(count, n, dtype=np.int64), call=rng.random(count) < 0.5,
                    american=np.ones(count, dtype=bool))
        p = lattice_parameters(cols)
        gpu.price(p.take(np.arange(2)))
        cpu.price(p.take(np.arange(2)))
        tgs, tcs = [], []
        for _ in range(repeats):
            t = time.perf_counter(); a = gpu.price(p); tgs.append(time.perf_counter() - t)
            t = time.perf_counter(); b = cpu.price(p); tcs.append(time.perf_counter() - t)
        tg, tc = statistics.median(tgs), statistics.median(tcs)
        worst = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-8 * p.strike)))
        rows.append(dict(n=n, count=count, gpu_s=tg, cpu_s=tc, max_relative_difference=worst))
        log(f"crossover N={n:>6} x{count}: hybrid {tg * 1e3:9.2f} ms ({count * nodes(n) / tg:.3g} nodes/s)"
            f"  cpu {tc * 1e3:9.2f} ms ({count * nodes(n) / tc:.3g} nodes/s)  max relative difference {worst:.2g}")
    return rows


def markdown(result: dict) -> str:
    rows = result["rows"]
    sizes = sorted({r["n"] for r in rows})
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    cell = {(r["n"], r["kernel"]): r for r in rows}
    head = "| N | " + " | ".join(kernels) + " | Cao (2025) RTX 2080 hybrid |"
    lines = [f"{result['device']} ({result['arch']}), FP64 FMA peak {result['fp64_fma_peak']:.3g}/s; "
             f"times in ms (median, CUDA events), nodes/s in brackets", "", head,
             "|" + "---|" * (len(kernels) + 2)]
    for n in sizes:
        parts = []
        for k in kernels:
            r = cell.get((n, k))
            parts.append("—" if r is None else f"{r['seconds'] * 1e3:.3f} ({r['nodes_per_s']:.2g})")
        seed = SEED_RTX2080_HYBRID_MS.get(n)
        lines.append(f"| {n:,} | " + " | ".join(parts) + f" | {seed if seed else '—'} |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="N up to 100k, 3 repeats")
    ap.add_argument("--sizes", default=None, help="comma-separated N")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="GpuConfig override, e.g. --set t1=40000 --set fma=1")
    ap.add_argument("--out", default=None, help="write the measurements as JSON here")
    ap.add_argument("--crossover", action="store_true",
                    help="only: portfolios of one N, hybrid against the cpu engine")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pricer bench gpu")
    add_arguments(ap)
    return bench_gpu(ap.parse_args(argv))


def bench_gpu(args) -> int:
    if args.crossover:
        rows = crossover()
        write_json(args.out, rows)
        return 0
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else (
        SIZES[:5] if args.quick else SIZES)
    from dataclasses import fields
    from pricer.engines.gpu.config import GpuConfig
    flags = {f.name for f in fields(GpuConfig) if isinstance(f.default, bool)}
    overrides = {}
    for kv in args.set:
        key, value = kv.split("=", 1)
        overrides[key] = bool(int(value)) if key in flags else int(value)
    result = run(sizes, tuple(args.kernels.split(",")), 3 if args.quick else args.repeats,
                 cpu=not args.no_cpu, overrides=overrides)
    print(markdown(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
