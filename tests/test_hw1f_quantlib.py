"""Callable and puttable fixed-rate bonds against QuantLib's TreeCallableFixedRateBondEngine
(tests/hw1f_ql.py, docs/numerics.md "Against QuantLib's tree"), on fresh random inputs:
QuantLib = hw1f_ql with QuantLib's conventions, and hw1f_ql with pricer's grid (uniform) and
branching (0.184 bound) and either spacing (QuantLib's exact variance, or sigma sqrt(3 dt)) =
pricer's own tree of that spacing (hw1f.price, the CPU engine). So every difference between
pricer's tree and QuantLib's is one of those conventions, or of the instrument (coupon day count,
accrued interest, stub periods); where none applies, pricer's engine is QuantLib's to rounding."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import numpy as np
import pytest

import pricer.model.bond_book as B
import pricer.model.hw1f as H
import hw1f_ql as Q
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


@pytest.mark.parametrize("ours, theirs", [("variance", "quantlib"), ("sqrt-dt", "sqrt-dt")])
def test_pricers_conventions_give_pricers_tree(rng, ours, theirs):
    """With the grid and the branching pricer's, the spacing QuantLib's exact variance (or
    sigma sqrt(3 dt)), and the instrument as pricer's (hw1f_ql.terms_of), this is hw1f.price and
    the CPU engine with spacing "variance" (or "sqrt-dt"): measured within 3e-15."""
    from pricer.engines.cpu.trinomial import HullWhiteCpuEngine

    curve = random_curve(rng)
    instruments = [replace(inst, product=("callable", "puttable")[k % 2])
                   for k, inst in enumerate(random_instruments(rng, 60))]
    a, sigma = rng.uniform(0.02, 0.3, 60), rng.uniform(0.003, 0.02, 60)
    per_year = rng.choice([4, 12, 26, 52], 60)
    engine = HullWhiteCpuEngine().price(B.parameters(instruments, a, sigma, per_year, curve,
                                                     spacing=ours))
    for k, inst in enumerate(instruments):
        want = H.price(inst, a[k], sigma[k], per_year[k], curve, spacing=ours)
        got = Q.price(Q.terms_of(inst, per_year[k]), a[k], sigma[k], curve,
                      H.steps_of(inst.maturity, per_year[k]), grid="uniform",
                      branching="pricer", spacing=theirs)
        case = (inst, a[k], sigma[k], per_year[k])
        assert abs(got / want - 1.0) <= 1e-12, case
        assert abs(engine[k] / got - 1.0) <= 1e-12, case


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
            pricers = {"branching": "pricer", "spacing": "sqrt-dt"}[name]
            effects[name].append(Q.price(terms, a, sigma, curve, months, **{name: pricers})
                                 / base - 1)
    size = {name: np.abs(values) for name, values in effects.items()}
    assert all(np.max(values) < 1e-3 for values in size.values())
    assert np.median(size["branching"]) < np.median(size["spacing"])


def test_pricers_engine_is_quantlibs_where_the_conventions_coincide(rng):
    """Where the grid and the branching cannot differ, pricer's engine with its default spacing
    (the exact variance) is QuantLib's TreeCallableFixedRateBondEngine to rounding: every date
    (coupons, calls, maturity) a whole number of months from today on a 30/360 day count (the
    curve's and the coupons': times k / 12 years), steps a multiple of 12 a year (so QuantLib's
    TimeGrid through those dates is pricer's uniform grid and every date is on a step), and
    a T <= 0.184 (the tree has at most j_max = ceil(0.184 / (a dt)) steps, so no node reaches
    j_max, where Hull and White's branching and QuantLib's nearest-node branching differ). Dirty
    call prices on a face of 100 (no accrued interest), none a week or less before a coupon date
    (QuantLib would move it onto the coupon date). Through the CPU engine (bond_book.parameters,
    and pricer.price_bonds, which takes the default spacing); sigma sqrt(3 dt) differs by far
    more (the measure of the test)."""
    import pricer
    from pricer.engines.cpu.trinomial import HullWhiteCpuEngine

    dc = ql.Thirty360(ql.Thirty360.BondBasis)
    today = ql.Date(15, int(rng.integers(1, 13)), int(rng.integers(2025, 2031)))
    ql.Settings.instance().evaluationDate = today
    months = np.array([3, 12, 36, 84, 180, 360])
    curve = random_curve(rng)
    curve = H.YieldCurve(months / 12.0, curve.rates)
    zero = ql.ZeroCurve([today] + [today + ql.Period(int(m), ql.Months) for m in months],
                        [float(curve.rates[0])] + curve.rates.tolist(), dc, ql.NullCalendar(),
                        ql.Linear(), ql.Continuous)
    assert [dc.yearFraction(today, today + ql.Period(int(m), ql.Months)) for m in months] \
        == (months / 12.0).tolist()
    cases, theirs, by_sqrt_dt = [], [], []
    for k in range(24):
        frequency = int(rng.choice([1, 2, 4, 12]))
        period = 12 // frequency
        periods = int(rng.integers(1, max(2, 120 // period) + 1))
        n = periods * period                        # months to maturity
        per_year = 12 * int(rng.integers(1, 5))
        steps = n * per_year // 12
        a = float(rng.uniform(0.005, 0.99 * 0.184 * 12 / n))
        sigma = float(rng.uniform(0.003, 0.025))
        coupon = float(rng.uniform(0.0, 0.08))
        every = int(rng.choice([1, 3, 6, 12]))      # months between call dates
        first = int(rng.integers(1, n + 1))
        last = int(rng.integers(first, n + 1))
        last = first + (last - first) // every * every
        strike = float(rng.uniform(95.0, 105.0))
        put = k % 2 == 1
        inst = H.BondOption(100.0, coupon, frequency, n / 12.0, strike, not put, "bermudan",
                            first=first / 12.0, last=last / 12.0, every=12.0 / every,
                            product="puttable" if put else "callable")
        calls = [first + every * c for c in range((last - first) // every + 1)]
        assert np.allclose(inst.exercise_times() * 12.0, calls, rtol=0.0, atol=1e-9)
        rights = ql.CallabilitySchedule()
        for m in calls:
            rights.append(ql.Callability(ql.BondPrice(strike, ql.BondPrice.Dirty),
                                         ql.Callability.Put if put else ql.Callability.Call,
                                         today + ql.Period(m, ql.Months)))
        schedule = ql.Schedule(today, today + ql.Period(n, ql.Months),
                               ql.Period(period, ql.Months), ql.NullCalendar(), ql.Unadjusted,
                               ql.Unadjusted, ql.DateGeneration.Backward, False)
        bond = ql.CallableFixedRateBond(0, 100.0, schedule, [coupon], dc, ql.Unadjusted, 100.0,
                                        today, rights)
        model = ql.HullWhite(ql.YieldTermStructureHandle(zero), a, sigma)
        bond.setPricingEngine(ql.TreeCallableFixedRateBondEngine(model, steps))
        theirs.append(bond.NPV())
        cases.append((inst, a, sigma, per_year))
    instruments = [c[0] for c in cases]
    a, sigma, per_year = (np.array([c[i] for c in cases]) for i in (1, 2, 3))
    params = B.parameters(instruments, a, sigma, per_year, curve)
    assert params.spacing == "variance" and np.all(params.steps <= params.jmax)
    assert np.array_equal(params.steps, np.rint([c[0].maturity * c[3] for c in cases]))
    engine = HullWhiteCpuEngine()
    ours, theirs = engine.price(params), np.array(theirs)
    worst = np.max(np.abs(ours / theirs - 1.0))
    assert worst <= 1e-12, (worst, cases[int(np.argmax(np.abs(ours / theirs - 1.0)))])
    columns = dict(B.columns_of(instruments, a, sigma, per_year), id=np.arange(len(cases)))
    columns.update(exercise=np.array(["bermudan"] * len(cases)),
                   product=np.array([i.product for i in instruments]),
                   curve=np.array(["c"] * len(cases)))
    public = pricer.price_bonds(columns, {"c": curve})["price"].to_numpy()
    assert np.max(np.abs(public / theirs - 1.0)) <= 1e-12
    old = engine.price(B.parameters(instruments, a, sigma, per_year, curve, spacing="sqrt-dt"))
    print(f"worst {worst:.2e}, sqrt-dt median {np.median(np.abs(old / theirs - 1.0)):.2e}")
    assert np.median(np.abs(old / theirs - 1.0)) > 100 * worst
