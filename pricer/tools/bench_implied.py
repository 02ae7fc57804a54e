"""`pricer bench implied-vol`: American implied volatilities per second, against QuantLib.

The book: `count` American options (calls and puts, `pricer generate --dist uniform
--exercise american` with a fixed seed) of N = `steps` on QuantLib's CRR tree (`ql-crr`), their
market prices the backend's own lattice prices at the generated volatilities (not timed), no
volatility column (the search starts from the Black–Scholes implied volatility).

Timed: the compute stage of `pricer implied-vol` (run/pricing.price_checked on the checked book:
every round's lattice parameters, engine calls and search steps, in the chunks a run cuts), once
to warm up and then `repeats` times; the median counts. Reported per backend: implied
volatilities per second, lattices priced per option, lattice nodes per second, and the largest
error in sigma among the options whose lattice vega is above 1e-4 K.

The anchor, timed in the same run: QuantLib's Brent (accuracy 1e-12) on BinomialVanillaEngine's
NPV ("crr", the same N), option by option on one core, over the first `quantlib` options; and the
cpu backend on one thread over as many options, so that the per-core ratio compares one core with
one core. Each side is the median of `repeats` runs. Every round of a search has a cost on the host
that does not grow with its options (their lattice parameters, the step), which a sample of a few
options pays in full: the ratio rises with the sample (docs/performance.md gives 20 and 100).
"""

from __future__ import annotations

import time

import numpy as np

from pricer.tools.tables import write_json

TARGET_GPU = 1e6        # American implied volatilities per second per GPU at N = 500
TARGET_PER_CORE = 30.0  # the cpu backend on one core against QuantLib on one core


def add_arguments(ap) -> None:
    ap.add_argument("--count", type=int, default=None,
                    help="options in the book (default: 1,000,000 with a GPU backend, else 20,000)")
    ap.add_argument("--steps", type=int, default=500, help="N of every option (default 500)")
    ap.add_argument("--backend", action="append", default=None, metavar="NAME",
                    help="backend to time (repeatable; default: batch where a GPU is usable, "
                         "and cpu)")
    ap.add_argument("--quantlib", type=int, default=100, metavar="OPTIONS",
                    help="options QuantLib solves for the anchor (default 100)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per backend (default 3)")
    ap.add_argument("--out", default=None, help="also write the measurements as JSON here")


def book(count: int, steps: int, seed: int = 2026):
    from pricer.tools.generate import generate
    return generate("uniform", count, seed=seed, steps=steps, exercise="american")


def solve_timed(backend: str, portfolio, repeats: int, threads: int | None = None):
    """(median seconds, values, status, the run config) of the compute stage on `portfolio`."""
    import numba

    from pricer.engines import get_engine
    from pricer.io.portfolio import Portfolio
    from pricer.run.checks import checked_rows
    from pricer.run.config import RunConfig
    from pricer.run.pricing import price_checked

    if threads is not None:
        numba.set_num_threads(threads)
    cfg = RunConfig(input="bench", output="bench", backend=backend, tree="ql-crr",
                    task="implied-vol").check()
    engine = get_engine(backend)
    engine.warm_up()
    priced = RunConfig(input="bench", output="bench", backend=backend, tree="ql-crr").check()
    market = price_checked(engine, priced, checked_rows(priced, portfolio), portfolio.id)[0][:, 0]
    given = Portfolio(**{**vars(portfolio), "market_price": market,
                         "volatility": np.full(len(portfolio), np.nan)})
    checked = checked_rows(cfg, given)
    head = np.arange(min(len(given), 256))
    price_checked(engine, cfg, checked_rows(cfg, given.take(head)), given.id[head])   # warm-up
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        values, status = price_checked(engine, cfg, checked, given.id)
        walls.append(time.perf_counter() - start)
    if threads is not None:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    return float(np.median(walls)), values, status, market


def quantlib_timed(portfolio, market: np.ndarray, count: int):
    """(seconds per option, QuantLib's implied volatilities) over the first `count` options."""
    import QuantLib as ql

    today = ql.Date(15, 1, 2025)
    ql.Settings.instance().evaluationDate = today
    dc = ql.Actual365Fixed()
    out = np.empty(count)
    start = time.perf_counter()
    for k in range(count):
        vol = ql.SimpleQuote(0.2)
        days = int(round(float(portfolio.maturity[k]) * 365))    # whole days (whole_days)
        process = ql.BlackScholesMertonProcess(
            ql.QuoteHandle(ql.SimpleQuote(float(portfolio.spot[k]))),
            ql.YieldTermStructureHandle(ql.FlatForward(today, float(portfolio.dividend[k]), dc)),
            ql.YieldTermStructureHandle(ql.FlatForward(today, float(portfolio.rate[k]), dc)),
            ql.BlackVolTermStructureHandle(ql.BlackConstantVol(today, ql.NullCalendar(),
                                                               ql.QuoteHandle(vol), dc)))
        kind = ql.Option.Call if portfolio.call[k] else ql.Option.Put
        option = ql.VanillaOption(ql.PlainVanillaPayoff(kind, float(portfolio.strike[k])),
                                  ql.AmericanExercise(today, today + days))
        option.setPricingEngine(ql.BinomialVanillaEngine(process, "crr",
                                                         int(portfolio.steps[k])))

        def error(sigma, option=option, vol=vol, target=float(market[k])):
            vol.setValue(sigma)
            return option.NPV() - target

        sigma = float(portfolio.volatility[k])
        try:
            out[k] = ql.Brent().solve(error, 1e-12, sigma, 0.5 * sigma, 2.0 * sigma)
        except RuntimeError:        # no root in QuantLib's bracket (its maturity differs by days)
            out[k] = np.nan
    return (time.perf_counter() - start) / count, out


def whole_days(maturity: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Maturities moved to whole days (QuantLib's year fraction D/365 is then the maturity exactly)
    where fl(T/N) N = T: QuantLib's American lattice otherwise drops its terminal payoff
    (docs/numerics.md, its maturity trap)."""
    out = np.empty_like(maturity)
    for k, (t, n) in enumerate(zip(maturity, steps)):
        days = max(1, int(round(t * 365)))
        while (days / 365.0) / n * n != days / 365.0:
            days += 1
        out[k] = days / 365.0
    return out


def sigma_errors(portfolio, values, status) -> list:
    """|sigma - truth| over the converged options (the truth: the generated volatility) at the
    median, the 99.9th percentile and the largest. The largest is an option whose price is
    nearly flat in sigma (deep in the money, near its payoff), where a band of sigmas gives the
    price within the tolerance; tests/test_implied.py checks sigma where vega > 1e-4 K."""
    ok = status == 0
    if not ok.any():
        return [np.nan] * 3
    error = np.abs(values[ok, 1] - portfolio.volatility[ok])
    return np.percentile(error, [50, 99.9, 100]).tolist()


def bench_implied(args) -> dict:
    from pricer.engines import backend, gpu_available

    backends = args.backend or (["batch", "cpu"] if gpu_available() else ["cpu"])
    gpu = any(backend(name).needs_gpu for name in backends)
    count = args.count or (1_000_000 if gpu else 20_000)
    portfolio = book(count, args.steps)
    nodes = (args.steps + 1) * (args.steps + 2) / 2
    rows = []
    print(f"{count:,} American options, N = {args.steps}, tree ql-crr; compute stage, median of "
          f"{args.repeats}")
    print("| backend | seconds | implied vols/s | lattices per option | nodes/s | converged | "
          "sigma error: median / 99.9 % / largest |")
    print("|---|---|---|---|---|---|---|")
    for name in backends:
        wall, values, status, _ = solve_timed(name, portfolio, args.repeats)
        lattices = float(np.nanmean(values[:, 2]))
        row = dict(backend=name, options=count, seconds=wall, per_second=count / wall,
                   lattices_per_option=lattices, nodes_per_second=count * lattices * nodes / wall,
                   converged=int((status == 0).sum()),
                   sigma_errors=sigma_errors(portfolio, values, status))
        rows.append(row)
        print(f"| {name} | {wall:.3f} | {row['per_second']:.4g} | {lattices:.2f} | "
              f"{row['nodes_per_second']:.3g} | {row['converged']:,} | "
              f"{' / '.join(f'{e:.1g}' for e in row['sigma_errors'])} |", flush=True)
    from pricer.tools.anchors import have_quantlib, missing

    result = dict(rows=rows, steps=args.steps)
    if have_quantlib("implied-vol"):
        result.update(_anchor(args))
    else:
        print(missing("cpu backend per core against QuantLib's Brent"), flush=True)
    for row in rows:
        if backend(row["backend"]).needs_gpu:
            ok = row["per_second"] >= TARGET_GPU
            print(f"{row['backend']}: {row['per_second']:.4g} American implied vols/s on one GPU "
                  f"at N = {args.steps}, target {TARGET_GPU:.0e}: {'met' if ok else 'NOT met'}")
    write_json(args.out, result)
    return result


def _anchor(args) -> dict:
    """QuantLib's Brent on one core against the cpu backend on one thread, over `args.quantlib`
    options of the bench's kind (their maturities in whole days), both the median of
    `args.repeats` runs."""
    sample = book(args.quantlib, args.steps, seed=2027)
    sample.maturity = whole_days(sample.maturity, sample.steps)
    one_wall, one_values, _, market = solve_timed("cpu", sample, args.repeats, threads=1)
    # both sides of the ratio the median of as many runs: on a shared host either one moves
    timings = [quantlib_timed(sample, market, args.quantlib) for _ in range(args.repeats)]
    per_option, theirs = float(np.median([seconds for seconds, _ in timings])), timings[0][1]
    ours_per_core = args.quantlib / one_wall
    ratio = ours_per_core * per_option
    agree = float(np.nanmax(np.abs(one_values[:, 1] - theirs)))
    print(f"anchor: QuantLib Brent on BinomialVanillaEngine, one core: {1 / per_option:.4g} "
          f"implied vols/s; cpu backend on one thread: {ours_per_core:.4g}/s, {ratio:.0f}x "
          f"(target {TARGET_PER_CORE:.0f}x: {'met' if ratio >= TARGET_PER_CORE else 'NOT met'}); "
          f"largest |sigma - QuantLib's| {agree:.2g} over {args.quantlib} options")
    return dict(quantlib_per_second=1 / per_option, cpu_one_thread_per_second=ours_per_core,
                per_core_ratio=ratio, quantlib_agreement=agree)
