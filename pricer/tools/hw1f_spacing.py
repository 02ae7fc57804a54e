"""The Hull–White trees' two node spacings (hw1f.SPACINGS) against Jamshidian's closed form, at
the same tree sizes (the steps and j_max = ceil(0.184 / (a dt)) do not depend on the spacing):
European options on zero-coupon and coupon bonds (hw1f.zero_bond_option,
hw1f.coupon_bond_option), priced by the CPU engine on trees of each spacing at each number of
steps a year. docs/numerics.md ("The spacing") has the table this prints, and its command:

    python -m pricer.tools.hw1f_spacing --seed 2026 --count 200

`measure` is the function (tests/test_hw1f.py uses it on a small random set)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from pricer.model import bond_book
from pricer.model import hw1f
from pricer.tools.tables import write_json

STEPS_PER_YEAR = (12, 52, 250)


def random_cases(rng, count: int) -> list:
    """`count` European options (half on zero-coupon bonds, half on coupon bonds of 1 or 2
    coupons a year, coupon 1-8 %), a in [0.03, 0.3], sigma in [0.005, 0.02], expiry 1-5 years,
    the bond 1-9 years later (whole years: every date on a step at 12, 52 and 250 steps a year),
    the strike within 3 % of the bond's forward value, on a sloped curve (zero rates from -0.5 %
    to 6 %) of each case's own. Each: (instrument, a, sigma, curve, closed form)."""
    days = np.array([91, 365, 1095, 2555, 5475, 10950]) / 365.0
    out = []
    for k in range(count):
        curve = hw1f.YieldCurve(days, np.sort(rng.uniform(-0.005, 0.06, days.size)))
        a, sigma = float(rng.uniform(0.03, 0.3)), float(rng.uniform(0.005, 0.02))
        expiry = float(rng.integers(1, 6))
        maturity = expiry + float(rng.integers(1, 10))
        zero = k % 2 == 0
        coupon, frequency = (0.0, 0) if zero else (float(rng.uniform(0.01, 0.08)),
                                                   int(rng.choice([1, 2])))
        call = bool(rng.random() < 0.5)
        bond = hw1f.BondOption(100.0, coupon, frequency, maturity, 0.0, call)
        times = bond.coupon_times()
        times = times[times > expiry + 1e-9]           # paid after the expiry: the option's bond
        amounts = np.full(times.size, 100.0 * coupon / frequency) if not zero else np.zeros(0)
        times, amounts = np.append(times, maturity), np.append(amounts, 0.0)
        amounts[-1] += 100.0
        forward = float(amounts @ hw1f.zero_bond_price(curve, a, sigma, 0.0, times, 0.0)
                        / curve.discount(expiry))
        strike = forward * float(rng.uniform(0.97, 1.03))
        instrument = hw1f.BondOption(100.0, coupon, frequency, maturity, strike, call,
                                     first=expiry)
        exact = hw1f.coupon_bond_option(curve, a, sigma, strike, expiry, times, amounts, call)
        out.append((instrument, a, sigma, curve, exact))
    return out


def measure(cases: list, steps_per_year=STEPS_PER_YEAR, engine=None) -> dict:
    """{steps a year: {spacing: relative errors |tree / closed form - 1| of the cases}} on the
    CPU engine (or `engine`), every spacing on the same trees' sizes."""
    if engine is None:
        from pricer.engines.cpu.trinomial import HullWhiteCpuEngine
        engine = HullWhiteCpuEngine()
    instruments = [c[0] for c in cases]
    a, sigma = np.array([c[1] for c in cases]), np.array([c[2] for c in cases])
    curves = [c[3] for c in cases]
    exact = np.array([c[4] for c in cases])
    out = {}
    for per_year in steps_per_year:
        out[per_year] = {}
        for spacing in hw1f.SPACINGS:
            params = bond_book.parameters(instruments, a, sigma, per_year, curves, spacing)
            out[per_year][spacing] = np.abs(engine.price(params) / exact - 1.0)
    return out


def summary(errors: dict) -> list:
    """Rows: steps a year, and for each spacing the median and 90th percentile of the errors,
    then the median over the cases of variance's error / sqrt-dt's and the share of cases where
    variance's is the smaller."""
    rows = []
    for per_year, by in errors.items():
        row = {"steps_per_year": per_year}
        for spacing, e in by.items():
            row[spacing] = {"median": float(np.median(e)), "p90": float(np.quantile(e, 0.9)),
                            "max": float(np.max(e))}
        ratio = by["variance"] / np.maximum(by["sqrt-dt"], 1e-300)
        row["median_ratio"] = float(np.median(ratio))
        row["variance_smaller"] = float(np.mean(by["variance"] < by["sqrt-dt"]))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pricer.tools.hw1f_spacing",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--steps", type=int, nargs="+", default=list(STEPS_PER_YEAR))
    parser.add_argument("--out", help="the rows as JSON")
    args = parser.parse_args(argv)
    cases = random_cases(np.random.default_rng(args.seed), args.count)
    rows = summary(measure(cases, args.steps))
    print(f"{args.count} European bond options (half zero-coupon, half coupon), seed {args.seed}: "
          "relative error against Jamshidian's closed form")
    print("| steps a year | sqrt-dt median | sqrt-dt 90th pct. | variance median "
          "| variance 90th pct. | median ratio variance / sqrt-dt | variance smaller |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['steps_per_year']} | {r['sqrt-dt']['median']:.2e} | {r['sqrt-dt']['p90']:.2e} "
              f"| {r['variance']['median']:.2e} | {r['variance']['p90']:.2e} "
              f"| {r['median_ratio']:.2f} | {100 * r['variance_smaller']:.0f} % |")
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
