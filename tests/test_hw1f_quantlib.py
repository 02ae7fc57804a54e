"""Callable and puttable fixed-rate bonds against QuantLib's TreeCallableFixedRateBondEngine
(pricer/model/hw1f_ql.py, docs/numerics.md "Against QuantLib's tree"), on fresh random inputs:
QuantLib = hw1f_ql with QuantLib's conventions, and hw1f_ql with pricer's three conventions
(uniform grid, 0.184 branching bound, dr = sigma sqrt(3 dt)) = pricer's own tree, hw1f.price. So
every difference between pricer's tree and QuantLib's is one of those conventions, or of the
instrument (coupon day count, accrued interest, stub periods)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import numpy as np
import pytest

import pricer.model.hw1f as H
import pricer.model.hw1f_ql as Q
from test_hw1f import random_curve, random_instruments

ql = pytest.importorskip("QuantLib")


def qdate(day: dt.date):
    return ql.Date(day.day, day.month, day.year)


def quantlib_price(curve, a, sigma, steps, face, coupon, frequency, maturity, call_dates,
                   call_prices, put, today=Q.TODAY, clean=True):
    """QuantLib's own: the bond as hw1f_ql.quantlib_terms describes it, on the curve as a ZeroCurve
    of whole days (Actual/365 Fixed, Linear, Continuous), as pricer bench trinomial builds it."""
    ref = qdate(today)
    ql.Settings.instance().evaluationDate = ref
    days = np.rint(curve.times * 365).astype(int)
    zero = ql.ZeroCurve([ref] + [ref + int(d) for d in days],
                        [float(curve.rates[0])] + curve.rates.tolist(), ql.Actual365Fixed(),
                        ql.NullCalendar(), ql.Linear(), ql.Continuous)
    schedule = ql.Schedule(ref, qdate(maturity), ql.Period(12 // frequency, ql.Months),
                           ql.NullCalendar(), ql.Unadjusted, ql.Unadjusted,
                           ql.DateGeneration.Backward, False)
    rights = ql.CallabilitySchedule()
    for day, price in zip(call_dates, np.broadcast_to(call_prices, (len(call_dates),))):
        rights.append(ql.Callability(
            ql.BondPrice(float(price), ql.BondPrice.Clean if clean else ql.BondPrice.Dirty),
            ql.Callability.Put if put else ql.Callability.Call, qdate(day)))
    bond = ql.CallableFixedRateBond(0, face, schedule, [coupon], ql.Actual365Fixed(),
                                    ql.Unadjusted, 100.0, ref, rights)
    model = ql.HullWhite(ql.YieldTermStructureHandle(zero), float(a), float(sigma))
    bond.setPricingEngine(ql.TreeCallableFixedRateBondEngine(model, steps))
    return bond.NPV()


def random_bond(rng, today=Q.TODAY):
    """Coupon dates of any frequency (a short first period where the maturity is not a whole
    number of them), call dates anywhere (some a few days before a coupon, so snapped onto it,
    some on one), clean or dirty prices, one a date."""
    maturity = today + dt.timedelta(days=int(rng.integers(30, 12 * 365)))
    frequency = int(rng.choice([1, 2, 3, 4, 6, 12]))
    ends = Q.schedule(today, maturity, 12 // frequency)[1:]
    calls = {today + dt.timedelta(days=int(d))
             for d in rng.integers(-3, (maturity - today).days + 1, int(rng.integers(0, 12)))}
    for end in rng.choice(ends, min(len(ends), 3), replace=False):
        calls.add(end - dt.timedelta(days=int(rng.integers(0, 9))))
    calls = sorted(calls)
    return dict(face=float(rng.choice([100.0, 1000.0, 37.5])),
                coupon=float(rng.uniform(0.0, 0.09)) if rng.random() < 0.9 else 0.0,
                frequency=frequency, maturity=maturity, call_dates=calls,
                call_prices=rng.uniform(85.0, 115.0, len(calls)), put=bool(rng.random() < 0.5),
                clean=bool(rng.random() < 0.7))


def test_bonds_are_quantlibs(rng):
    """Measured within 1e-14 relative over thousands of bonds (docs/numerics.md)."""
    worst = 0.0
    for trial in range(60):
        today = (Q.TODAY, dt.date(2028, 2, 29), dt.date(2027, 1, 31))[trial % 3]
        curve = random_curve(rng, flat=trial % 4 == 0)
        a, sigma = rng.uniform(0.005, 0.5), rng.uniform(0.002, 0.03)
        steps = int(rng.integers(1, 200))
        bond = random_bond(rng, today)
        theirs = quantlib_price(curve, a, sigma, steps, today=today, **bond)
        terms = Q.quantlib_terms(**{k: v for k, v in bond.items() if k != "call_prices"},
                                 call_price=bond["call_prices"], curve=curve, today=today)
        ours = Q.price(terms, a, sigma, curve, steps)
        worst = max(worst, abs(ours / theirs - 1.0))
    assert worst <= 1e-12


def test_quantlibs_special_cases(rng):
    """The conventions found only by measuring (docs/numerics.md): QuantLib's grid; a step of
    under 1 % of the grid's longest keeps the widest spacing; a callability on a coupon date
    where another was snapped onto it is compared cum coupon; a zero rate still has its coupon
    dates on the grid; the price is per 100 of face."""
    curve = random_curve(rng)
    a, sigma = rng.uniform(0.02, 0.3), rng.uniform(0.005, 0.02)
    maturity = Q.add_months(Q.TODAY, 60)
    # between coupon dates, more than a week before the next
    first = Q.add_months(Q.TODAY, 6 * int(rng.integers(1, 4))) + dt.timedelta(
        days=int(rng.integers(10, 150)))
    coupon_date = Q.add_months(Q.TODAY, 36)
    cases = [dict(call_dates=[first, first + dt.timedelta(days=1)], call_prices=[100.0, 101.0]),
             dict(call_dates=[coupon_date - dt.timedelta(days=4), coupon_date],
                  call_prices=[90.0, 120.0]),
             dict(call_dates=[coupon_date - dt.timedelta(days=4), coupon_date],
                  call_prices=[120.0, 90.0]),
             dict(call_dates=[first, coupon_date], call_prices=[95.0, 96.0], coupon=0.0),
             dict(call_dates=[first, coupon_date], call_prices=[105.0, 103.0], face=1000.0)]
    for case in cases:
        for put in (False, True):
            bond = dict(dict(face=100.0, coupon=0.05, frequency=2, maturity=maturity, put=put,
                             clean=False), **case)
            terms = Q.quantlib_terms(**{k: v for k, v in bond.items() if k != "call_prices"},
                                     call_price=bond["call_prices"], curve=curve)
            times = Q.grid_of(terms, 10)
            grid = ql.TimeGrid([float(t) for t in terms.mandatory_times()], 10)
            assert np.array_equal(times, np.array(list(grid)))
            theirs = quantlib_price(curve, a, sigma, 10, **bond)
            assert abs(Q.price(terms, a, sigma, curve, 10) / theirs - 1.0) <= 1e-12
            if case is cases[0]:        # the day between the two calls is a floored step
                tree = Q.build(times, np.diff(times), a, sigma, curve)
                short = np.flatnonzero(np.diff(times) < Q.FLOOR_BELOW * np.diff(times).max())
                # sqrt(3 max V), the widest natural dx but for rounding
                assert short.size and np.allclose(tree.dx[short + 1], tree.dx[1:].max(),
                                                  rtol=1e-15, atol=0.0)


def test_pricers_conventions_give_pricers_tree(rng):
    """With the grid, the branching and the spacing pricer's, and the instrument as pricer's
    (hw1f_ql.terms_of), this is hw1f.price (measured within 3e-15)."""
    curve = random_curve(rng)
    instruments = random_instruments(rng, 60)
    for k, inst in enumerate(instruments):
        inst = replace(inst, product=("callable", "puttable")[k % 2])
        a, sigma = rng.uniform(0.02, 0.3), rng.uniform(0.003, 0.02)
        per_year = int(rng.choice([4, 12, 26, 52]))
        want = H.price(inst, a, sigma, per_year, curve)
        got = Q.price(Q.terms_of(inst, per_year), a, sigma, curve,
                      H.steps_of(inst.maturity, per_year), grid="uniform", branching="pricer",
                      spacing="pricer")
        assert abs(got / want - 1.0) <= 1e-12, (inst, a, sigma, per_year)


def test_each_convention_is_small_at_monthly_steps(rng):
    """Each of the three conventions moves a monthly tree's price by well under 1e-3 relative
    (docs/numerics.md: max 4e-4 over 300 random bonds), and pricer's branching least of all."""
    effects = {"grid": [], "branching": [], "spacing": []}
    for _ in range(12):
        curve = random_curve(rng)
        a, sigma = rng.uniform(0.02, 0.3), rng.uniform(0.005, 0.02)
        months = int(rng.integers(12, 121))
        maturity = Q.add_months(Q.TODAY, months)
        calls = [Q.add_months(Q.TODAY, m) for m in range(int(rng.integers(1, months)), months, 3)]
        terms = Q.quantlib_terms(100.0, float(rng.uniform(0.0, 0.08)), 2, maturity, calls,
                                 float(rng.uniform(95.0, 105.0)), bool(rng.random() < 0.5), curve)
        base = Q.price(terms, a, sigma, curve, months)
        effects["grid"].append(Q.price(terms, a, sigma, curve, months, grid="uniform") / base - 1)
        for name in ("branching", "spacing"):
            effects[name].append(Q.price(terms, a, sigma, curve, months, **{name: "pricer"})
                                 / base - 1)
    size = {name: np.abs(values) for name, values in effects.items()}
    assert all(np.max(values) < 1e-3 for values in size.values())
    assert np.median(size["branching"]) < np.median(size["spacing"])
