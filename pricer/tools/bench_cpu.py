"""`pricer bench cpu`: nodes/s of the CPU engines beside QuantLib, timed in the same run.

Cases: one American put (S0 = K = 100, T = 1, r = 5 %, q = 0, sigma = 20 %) at N = 100, 1k, 10k, 100k
(`--quick`: up to 10k), a batch of 1 000 such puts at N = 100 in one call, and a 10k-option `random`
portfolio (N uniform in [16, 4096]; `--quick`: 1k options). Engines: `serial`,
`cpu` at 1 thread and at all of numba's threads, and QuantLib's BinomialVanillaEngine(process, "crr", N)
on one core. A lattice of N steps counts (N+1)(N+2)/2 nodes.

Timing: every engine is compiled first on small inputs (JIT warm-up, not timed). Then, per case, each
contestant is sampled in turn (round robin, so that load from other processes falls on all alike); a
sample is `number` calls in a row (so that it lasts >= MIN_SAMPLE_S; per-call overhead is included),
timed with time.perf_counter, and the median sample counts. The share of the machine that other
processes used while a case was timed is printed beside it: above BUSY the numbers are suspect.

QuantLib is too slow to run the big cases in full: above QL_MAX_STEPS it is timed at QL_MAX_STEPS, and
on QL_OPTIONS of the batch's and of the portfolio's options, evenly spaced; its nodes/s there is
extrapolated per node, and the output says so. Without QuantLib installed (the `bench` extra) the
engines are timed alone and the per-core verdict says it was not measured.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np

from pricer import __version__
from pricer.engines.cpu.parallel import CpuEngine
from pricer.engines.cpu.serial import SerialEngine
from pricer.tools.generate import generate
from pricer.model.lattice import lattice_parameters
from pricer.model.cost import lattice_nodes
from pricer.tools.anchors import have_quantlib, missing
from pricer.tools.tables import write_json

SINGLE_STEPS = (100, 1_000, 10_000, 100_000)
QUICK_STEPS = (100, 1_000, 10_000)
PUT = {"spot": 100.0, "strike": 100.0, "maturity": 1.0, "rate": 0.05, "dividend": 0.0,
       "volatility": 0.2, "call": False, "american": True}
PORTFOLIO_COUNT, QUICK_PORTFOLIO_COUNT, PORTFOLIO_SEED = 10_000, 1_000, 2026
SMALL_BATCH, SMALL_STEPS = 1_000, 100
QL_MAX_STEPS = 10_000   # QuantLib single options above this N are timed at this N
QL_OPTIONS = 50         # QuantLib prices this many of a many-option case's options, evenly spaced
MIN_SAMPLE_S, CASE_BUDGET_S, MIN_REPEATS, MAX_REPEATS = 0.02, 1.0, 3, 25
TARGET_PER_CORE, TARGET_SCALING = 30.0, 1.8
BUSY = 0.05             # share of the machine used by other processes above which a result is suspect
VERSIONED = ("pricer", "python", "numpy", "numba", "QuantLib")


@dataclass
class Case:
    name: str
    cols: dict          # the options, column name -> array (as the workers see them)
    ql_index: np.ndarray  # the options QuantLib prices
    ql_steps: int | None = None  # QuantLib's N where it differs from the case's
    ql_note: str = ""


@dataclass
class Contestant:
    threads: int        # numba threads while it runs
    call: Callable      # prices its options once
    nodes: float        # lattice nodes of one call


def _sample(c: Contestant, number: int) -> float:
    """Seconds per call, over `number` calls in a row."""
    numba.set_num_threads(c.threads)
    t0 = time.perf_counter()
    for _ in range(number):
        c.call()
    return (time.perf_counter() - t0) / number


def _median_rates(contestants: dict) -> tuple[dict, dict]:
    """nodes/s of each contestant from the median of its samples, and the samples (seconds per call).
    The samples are taken in turn (round robin), so that load from other processes falls on all
    contestants alike; calls shorter than MIN_SAMPLE_S are repeated within a sample, and each
    contestant gets CASE_BUDGET_S worth of samples, at least MIN_REPEATS, at most MAX_REPEATS."""
    plan, samples = {}, {}
    for name, c in contestants.items():
        first = _sample(c, 1)
        number = max(1, math.ceil(MIN_SAMPLE_S / max(first, 1e-9)))
        plan[name] = number, int(min(MAX_REPEATS, max(MIN_REPEATS, CASE_BUDGET_S // (first * number))))
        samples[name] = [first] if number == 1 else []
    for _ in range(max(repeats for _, repeats in plan.values())):
        for name, c in contestants.items():
            if len(samples[name]) < plan[name][1]:
                samples[name].append(_sample(c, plan[name][0]))
    return {name: c.nodes / statistics.median(samples[name]) for name, c in contestants.items()}, samples


def _single_put(steps: int) -> dict:
    cols = {k: np.array([v]) for k, v in PUT.items()}
    cols["steps"] = np.array([steps], dtype=np.int64)
    return cols


def _cases(quick: bool) -> list[Case]:
    cases = []
    for n in QUICK_STEPS if quick else SINGLE_STEPS:
        over = n > QL_MAX_STEPS
        cases.append(Case(f"put N={n:,}", _single_put(n), np.array([0]),
                          QL_MAX_STEPS if over else None,
                          f"QuantLib timed at N={QL_MAX_STEPS:,}, extrapolated per node" if over else ""))
    # One N = 100 put per call measures the call as well as the option (at small N the call's
    # overhead is a large share of it: docs/performance.md); a batch of them per call
    # shows the per-node rate at small N.
    batch = {k: np.repeat(v, SMALL_BATCH) for k, v in _single_put(SMALL_STEPS).items()}
    index = np.arange(0, SMALL_BATCH, SMALL_BATCH // QL_OPTIONS)
    cases.append(Case(f"{SMALL_BATCH:,} puts N={SMALL_STEPS}", batch, index,
                      ql_note=f"QuantLib timed on {index.size} of the {SMALL_BATCH:,} puts"))
    count = QUICK_PORTFOLIO_COUNT if quick else PORTFOLIO_COUNT
    book = generate("random", count, seed=PORTFOLIO_SEED)
    stride = count // QL_OPTIONS
    index = np.arange(0, count, stride)
    cases.append(Case(f"portfolio {count:,}", book.columns(), index,
                      ql_note=f"QuantLib timed on {index.size} of {count:,} options "
                              f"(every {stride}th), extrapolated per node"))
    return cases


def _engine_configs() -> list[tuple[str, object, int]]:
    threads = numba.config.NUMBA_NUM_THREADS
    configs = [("serial", SerialEngine(), 1), ("cpu 1t", CpuEngine(), 1)]
    if threads > 1:
        configs.append((f"cpu {threads}t", CpuEngine(), threads))
    return configs


def _warm_up(configs) -> None:
    """Compile every kernel each config will use (the wide-level one needs a large N)."""
    cols = _single_put(30_000)
    for _, engine, threads in configs:
        numba.set_num_threads(threads)
        engine.price(lattice_parameters(_single_put(10)))
        engine.price(lattice_parameters(cols))


def _contestants(case: Case, configs, quantlib: bool) -> dict:
    params = lattice_parameters(case.cols)
    nodes = float(lattice_nodes(case.cols["steps"]).sum())
    # functools.partial calls engine.price itself; a lambda's own Python frame would add a
    # measurable share to a small call
    out = {name: Contestant(threads, functools.partial(engine.price, params), nodes)
           for name, engine, threads in configs}
    if not quantlib:
        return out
    options = _ql_options(case.cols, case.ql_index, case.ql_steps)
    steps = case.cols["steps"][case.ql_index] if case.ql_steps is None else case.ql_steps
    ql_nodes = float(np.sum(lattice_nodes(np.broadcast_to(steps, case.ql_index.shape))))
    out["QuantLib"] = Contestant(1, functools.partial(_reprice, options), ql_nodes)
    return out


# --- QuantLib ------------------------------------------------------------------------------------

def _ql_options(cols: dict, index: np.ndarray, steps: int | None):
    """QuantLib instruments with a CRR engine for the options `index` (built outside the timing)."""
    import QuantLib as ql

    today = ql.Date(15, 1, 2026)
    ql.Settings.instance().evaluationDate = today
    dc = ql.Actual365Fixed()

    def curve(rate):
        return ql.YieldTermStructureHandle(ql.FlatForward(today, float(rate), dc))

    options = []
    for k in index:
        process = ql.BlackScholesMertonProcess(
            ql.QuoteHandle(ql.SimpleQuote(float(cols["spot"][k]))), curve(cols["dividend"][k]),
            curve(cols["rate"][k]),
            ql.BlackVolTermStructureHandle(ql.BlackConstantVol(today, ql.NullCalendar(),
                                                               float(cols["volatility"][k]), dc)))
        expiry = today + max(1, round(float(cols["maturity"][k]) * 365))
        kind = ql.Option.Call if cols["call"][k] else ql.Option.Put
        exercise = ql.AmericanExercise(today, expiry) if cols["american"][k] else ql.EuropeanExercise(expiry)
        option = ql.VanillaOption(ql.PlainVanillaPayoff(kind, float(cols["strike"][k])), exercise)
        option.setPricingEngine(ql.BinomialVanillaEngine(process, "crr", int(steps or cols["steps"][k])))
        options.append(option)
    return options


def _reprice(options) -> list[float]:
    prices = []
    for option in options:
        option.recalculate()  # QuantLib caches NPV; force the lattice to be rebuilt every time
        prices.append(option.NPV())
    return prices


def _price_check(quantlib: bool, steps: int = 1_000) -> tuple[float, float | None]:
    """Both prices of the N = 1000 put: the trees differ (QuantLib's CRR uses another p), so
    they agree to about 1e-4, not bitwise; a larger gap would mean the two price different things.
    QuantLib's is None where it is not installed."""
    cols = _single_put(steps)
    ours = SerialEngine().price(lattice_parameters(cols))[0]
    if not quantlib:
        return float(ours), None
    return float(ours), _reprice(_ql_options(cols, np.array([0]), None))[0]


# --- machine, load and report ----------------------------------------------------------------------

def machine(quantlib: bool = True) -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
        model = f"{info.get('model name', 'unknown')} (family {info.get('cpu family', '?')}, " \
                f"model {info.get('model', '?')})"
    except OSError:
        pass
    version = "not installed"
    if quantlib:
        import QuantLib
        version = QuantLib.__version__
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)),
            "numba_threads": numba.config.NUMBA_NUM_THREADS, "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__, "QuantLib": version,
            "pricer": __version__}


def _cpu_seconds() -> tuple[float, float, float]:
    """(busy seconds of the whole machine, steal seconds, this process's CPU seconds)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return math.nan, math.nan, time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick, time.process_time()


def _background(before, after, wall: float, cores: int) -> dict:
    busy, steal, own = (b - a for a, b in zip(before, after))
    capacity = wall * cores
    return {"other_processes_share": max(0.0, busy - own) / capacity, "steal_share": steal / capacity}


def _row(case: Case, configs, cores: int, quantlib: bool) -> dict:
    print(f"timing {case.name} ...", file=sys.stderr, flush=True)
    before, t0 = _cpu_seconds(), time.perf_counter()
    rates, samples = _median_rates(_contestants(case, configs, quantlib))
    load = _background(before, _cpu_seconds(), time.perf_counter() - t0, cores)
    return {"case": case.name, "options": int(case.cols["steps"].size),
            "nodes": float(lattice_nodes(case.cols["steps"]).sum()), "nodes_per_s": rates,
            "note": case.ql_note if quantlib else "", "load": load, "samples_s": samples}


def _ratios(row: dict, configs) -> dict:
    r = row["nodes_per_s"]
    out = {"serial/QL": r["serial"] / r["QuantLib"], "cpu 1t/QL": r["cpu 1t"] / r["QuantLib"]} \
        if "QuantLib" in r else {}
    if len(configs) > 2:
        out[f"{configs[2][0]}/1t"] = r[configs[2][0]] / r["cpu 1t"]
    return out


def _table(rows: list[dict], configs) -> list[str]:
    names = list(rows[0]["nodes_per_s"])
    ratio_names = list(_ratios(rows[0], configs))
    head = f"{'case':<18}{'nodes':>10}" + "".join(f"{n:>12}" for n in names) + \
        "".join(f"{n:>12}" for n in ratio_names) + f"{'others':>8}"
    lines = ["nodes/s (median), per-core speedup vs QuantLib (where it is installed), thread scaling "
             "of the cpu engine, and the share of the machine other processes used while the row "
             "was timed", head]
    for row in rows:
        ratios = _ratios(row, configs)
        lines.append(f"{row['case']:<18}{row['nodes']:>10.3g}"
                     + "".join(f"{row['nodes_per_s'][n]:>12.3g}" for n in names)
                     + "".join(f"{ratios[n]:>11.1f}x" for n in ratio_names)
                     + f"{row['load']['other_processes_share']:>8.0%}")
    lines += [f"  {row['case']}: {row['note']}" for row in rows if row["note"]]
    return lines


def _caveat(rows: list[dict]) -> str:
    busy = max(row["load"]["other_processes_share"] for row in rows)
    if busy <= BUSY:
        return ""
    return f" (unreliable: other processes used up to {busy:.0%} of the machine meanwhile)"


def _verdicts(rows: list[dict], configs) -> tuple[list[str], dict]:
    if "QuantLib" not in rows[0]["nodes_per_s"]:
        lines, verdict = [missing("per core vs QuantLib")], {}
    else:
        per_core = {row["case"]: _ratios(row, configs)["cpu 1t/QL"] for row in rows}
        worst = min(per_core, key=per_core.get)
        met_core = per_core[worst] >= TARGET_PER_CORE
        lines = [f"per core vs QuantLib (cpu engine, 1 thread): {per_core[worst]:.1f}x at worst "
                 f"({worst}), {per_core[rows[-1]['case']]:.1f}x on the portfolio; target >= "
                 f"{TARGET_PER_CORE:.0f}x: {'met' if met_core else 'NOT met'}{_caveat(rows)}"]
        verdict = {"per_core_vs_quantlib": per_core, "per_core_target_met": met_core}
    if len(configs) > 2:
        name = configs[2][0]
        scaling = _ratios(rows[-1], configs)[f"{name}/1t"]
        verdict.update(portfolio_scaling=scaling, scaling_target_met=scaling >= TARGET_SCALING)
        lines.append(f"cpu engine 1 -> {configs[2][2]} threads on the portfolio: {scaling:.2f}x; target >= "
                     f"{TARGET_SCALING}x: {'met' if scaling >= TARGET_SCALING else 'NOT met'}"
                     f"{_caveat(rows[-1:])}")
    else:
        lines.append("cpu engine thread scaling: not measured (numba has one thread here)")
    return lines, verdict


def _header(info: dict, quick: bool) -> list[str]:
    return [f"pricer bench cpu{' --quick' if quick else ''} — {info['date']}",
            f"machine: {info['cpu']}, {info['cores']} core(s), numba threads {info['numba_threads']}",
            "versions: " + ", ".join(f"{k} {info[k]}" for k in VERSIONED)]


def _footer(load: dict, wall: float, check: tuple[float, float | None]) -> list[str]:
    theirs = (f"QuantLib {check[1]:.6f} (different CRR p, so ~1e-4 apart)" if check[1] is not None
              else "QuantLib not installed")
    lines = [f"price check, American put N=1000: pricer {check[0]:.6f}, {theirs}",
             f"wall {wall:.0f}s; other processes used {load['other_processes_share']:.0%} of the machine "
             f"during the run, hypervisor steal {load['steal_share']:.0%}"]
    if load["other_processes_share"] > BUSY or load["steal_share"] > BUSY:
        lines.append("WARNING: the machine was not idle; the numbers above are lower than it can do")
    return lines


def bench_cpu(quick: bool = False, out: str | None = None) -> dict:
    """Time every case, print the table and the verdicts, and write JSON to `out` if given."""
    quantlib = have_quantlib("cpu")
    info = machine(quantlib) | {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(
        timespec="seconds")}
    configs = _engine_configs()
    before, t0 = _cpu_seconds(), time.perf_counter()
    _warm_up(configs)
    rows = [_row(case, configs, info["cores"], quantlib) for case in _cases(quick)]
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    check = _price_check(quantlib)
    wall = time.perf_counter() - t0
    load = _background(before, _cpu_seconds(), wall, info["cores"])
    verdict_lines, verdicts = _verdicts(rows, configs)
    blocks = (_header(info, quick), _table(rows, configs), verdict_lines + _footer(load, wall, check))
    print("\n\n".join("\n".join(block) for block in blocks))
    report = {"machine": info, "quick": quick, "rows": rows, "verdicts": verdicts, "load": load,
              "wall_seconds": wall, "price_check": {"pricer": check[0], "QuantLib": check[1]}}
    write_json(out, report, indent=2)
    if out:
        print(f"wrote {out}")
    return report
