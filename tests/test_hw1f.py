"""The Hull–White trinomial family (pricer/model/hw1f.py, pricer/engines/cpu/trinomial.py):
curves and the closed form against QuantLib, the tree's fit to the curve, convergence to
Jamshidian's bond options, the CPU engine against the NumPy reference, and the model's
no-arbitrage relations, on fresh random inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest

import pricer.model.bond_book as B
import pricer.model.hw1f as H
from pricer.engines.cpu.trinomial import HullWhiteCpuEngine
from pricer.errors import InputError

ENGINE = HullWhiteCpuEngine()


def random_curve(rng, flat: bool = False) -> H.YieldCurve:
    days = np.array([91, 365, 1095, 2555, 5475, 10950])      # whole days: QuantLib's times alike
    rates = np.full(6, rng.uniform(0.0, 0.05)) if flat else np.sort(rng.uniform(-0.005, 0.06, 6))
    return H.YieldCurve(days / 365.0, rates)


def random_instruments(rng, n: int, maturity=(1.0, 15.0)) -> list:
    out = []
    for k in range(n):
        mat = float(rng.uniform(*maturity))
        out.append(H.BondOption(face=100.0, coupon=float(rng.uniform(0.0, 0.08)),
                                frequency=int(rng.choice([0, 1, 2, 4, 12])), maturity=mat,
                                strike=float(rng.uniform(80.0, 110.0)), call=bool(rng.random() < 0.5),
                                exercise=H.EXERCISES[k % 3], first=mat * float(rng.uniform(0, .5)),
                                last=mat * float(rng.uniform(.5, 1)),
                                every=float(rng.choice([0.5, 1.0, 2.0, 12.0])),
                                product=H.PRODUCTS[int(rng.integers(0, 3))]))
    return out


def test_curve_and_closed_form_are_quantlibs(rng):
    ql = pytest.importorskip("QuantLib")
    today = ql.Date(27, 11, 2026)
    ql.Settings.instance().evaluationDate = today
    for flat in (True, False):
        curve = random_curve(rng, flat)
        days = np.rint(curve.times * 365).astype(int)
        zero = ql.ZeroCurve([today] + [today + int(d) for d in days],
                            [float(curve.rates[0])] + curve.rates.tolist(), ql.Actual365Fixed(),
                            ql.NullCalendar(), ql.Linear(), ql.Continuous)
        for t in rng.uniform(0.01, 29.0, 20):
            assert abs(float(curve.discount(t)) / zero.discount(float(t)) - 1.0) < 1e-14
        model = ql.HullWhite(ql.YieldTermStructureHandle(zero), 0.1, 0.01)
        for _ in range(10):
            a, sigma = rng.uniform(0.02, 0.5), rng.uniform(0.002, 0.03)
            model = ql.HullWhite(ql.YieldTermStructureHandle(zero), float(a), float(sigma))
            expiry = float(rng.uniform(0.5, 10.0))
            maturity = expiry + float(rng.uniform(0.5, 15.0))
            strike = float(curve.discount(maturity) / curve.discount(expiry)) * rng.uniform(0.9, 1.1)
            for call in (True, False):
                ours = H.zero_bond_option(curve, a, sigma, strike, expiry, maturity, call)
                theirs = model.discountBondOption(ql.Option.Call if call else ql.Option.Put,
                                                  float(strike), expiry, maturity)
                # face 1: the two normal CDFs differ by ~1e-16, which a deep option cancels
                assert abs(ours - theirs) <= 1e-11 * abs(theirs) + 1e-14


def test_the_tree_reprices_the_curve(rng):
    """The forward induction's alphas make sum_j Q(m, j) = P(0, m dt) at every step; a bond
    without options (a call at an unreachable strike) is worth its discounted flows."""
    for flat in (True, False):
        curve = random_curve(rng, flat)
        for _ in range(5):
            a, sigma, dt = rng.uniform(0.01, 0.5), rng.uniform(0.002, 0.03), rng.uniform(0.004, 0.1)
            steps = int(rng.integers(13, 600))
            tree = H.build(a, sigma, dt, steps, curve)
            want = curve.discount(np.arange(steps + 1) * dt)
            assert np.max(np.abs(tree.state_prices / want - 1.0)) < 1e-12
            assert tree.jmax == max(1, int(np.ceil(0.184 / (a * dt))))
        bonds = [H.BondOption(100.0, c, f, m, 1e12, True, "american", first=0.0, last=m,
                              product="callable")
                 for c, f, m in ((0.05, 2, 7.0), (0.0, 0, 3.5), (0.03, 4, 12.25))]
        for bond in bonds:
            steps = H.steps_of(bond.maturity, 24)
            dt = bond.maturity / steps
            flows = H.cash_flows(bond, dt, steps)
            exact = float(flows @ curve.discount(np.arange(steps + 1) * dt))
            assert abs(H.price(bond, 0.1, 0.01, 24, curve) / exact - 1.0) < 1e-12
            assert abs(ENGINE.price(B.parameters([bond], 0.1, 0.01, 24, curve))[0] / exact - 1.0) \
                < 1e-12


def test_bond_options_converge_to_jamshidian(rng):
    """European options on zero-coupon bonds, strikes within 3 % of the forward: the tree's error
    falls with the steps (first order, oscillating with the strike's place among the nodes).
    Measured (docs/numerics.md, the default spacing "variance"): median relative error ~7e-3 at
    monthly steps, ~4e-4 at 250 a year."""
    errors = {12: [], 400: []}
    for trial in range(2):
        curve = random_curve(rng, flat=trial == 0)
        for _ in range(8):
            a, sigma = rng.uniform(0.03, 0.3), rng.uniform(0.005, 0.02)
            expiry = int(rng.integers(1, 6))
            maturity = expiry + int(rng.integers(1, 10))
            forward = float(curve.discount(maturity) / curve.discount(expiry))
            strike, call = forward * rng.uniform(0.97, 1.03), bool(rng.random() < 0.5)
            exact = H.zero_bond_option(curve, a, sigma, strike, expiry, maturity, call)
            option = H.BondOption(1.0, 0.0, 0, float(maturity), strike, call,
                                  first=float(expiry))
            for per_year in errors:
                tree = ENGINE.price(B.parameters([option], a, sigma, per_year, curve))[0]
                errors[per_year].append(abs(tree / exact - 1.0))
    assert np.median(errors[12]) < 0.05 and np.max(errors[12]) < 0.5
    assert np.median(errors[400]) < 2e-3 and np.max(errors[400]) < 2e-2
    assert np.median(errors[400]) < np.median(errors[12]) / 5


def test_coupon_bond_options_closed_form(rng):
    """Jamshidian's decomposition (hw1f.coupon_bond_option): one flow is the zero-coupon bond's
    option, call - put = the flows' value less K P(0, T), and the bond's price at the expiry as
    a function of the state (hw1f.zero_bond_price) is QuantLib's HullWhite.discountBond at the
    short rate x + alpha(t) (a flat curve: alpha from its forward rate, Brigo and Mercurio
    eq. 3.37)."""
    ql = pytest.importorskip("QuantLib")
    curve = random_curve(rng)
    for _ in range(6):
        a, sigma = rng.uniform(0.02, 0.5), rng.uniform(0.003, 0.03)
        expiry = float(rng.uniform(0.5, 5.0))
        times = expiry + np.cumsum(rng.uniform(0.1, 1.0, int(rng.integers(1, 12))))
        amounts = np.append(np.full(times.size - 1, rng.uniform(0.5, 5.0)), 100.0)
        value = float(amounts @ curve.discount(times))
        strike = value / float(curve.discount(expiry)) * rng.uniform(0.9, 1.1)
        call, put = (H.coupon_bond_option(curve, a, sigma, strike, expiry, times, amounts, c)
                     for c in (True, False))
        assert abs((call - put) - (value - strike * float(curve.discount(expiry)))) \
            <= 1e-12 * value
        strike = float(curve.discount(times[-1]) / curve.discount(expiry)) * rng.uniform(0.9, 1.1)
        one = H.coupon_bond_option(curve, a, sigma, strike, expiry, times[-1:], [1.0], call=True)
        want = H.zero_bond_option(curve, a, sigma, strike, expiry, times[-1], True)
        assert abs(one - want) <= 1e-13 * strike      # a deep option carries the strike's rounding
    today = ql.Date(27, 11, 2026)
    ql.Settings.instance().evaluationDate = today
    rate = float(rng.uniform(0.0, 0.05))
    flat = H.YieldCurve(np.array([1.0]), np.array([rate]))
    for _ in range(10):
        a, sigma = float(rng.uniform(0.02, 0.5)), float(rng.uniform(0.003, 0.03))
        model = ql.HullWhite(ql.YieldTermStructureHandle(
            ql.FlatForward(today, rate, ql.Actual365Fixed(), ql.Continuous)), a, sigma)
        t, x = float(rng.uniform(0.2, 5.0)), float(rng.uniform(-0.03, 0.03))
        maturity = t + float(rng.uniform(0.1, 10.0))
        alpha = rate + sigma * sigma / (2.0 * a * a) * (1.0 - np.exp(-a * t)) ** 2
        ours = float(H.zero_bond_price(flat, a, sigma, t, maturity, x))
        assert abs(ours / model.discountBond(t, maturity, x + alpha) - 1.0) < 1e-10


def test_exact_variance_spacing_is_closer_to_jamshidian(rng):
    """At the same trees' sizes, the spacing sqrt(3 V) (hw1f.SPACINGS' "variance", the default)
    is closer to Jamshidian's closed form than sigma sqrt(3 dt): on 40 random European options on
    zero-coupon and coupon bonds (pricer.tools.hw1f_spacing), at 12 and 52 steps a year, the
    median over the options of its error / sqrt-dt's is below 0.8 and it is the smaller for
    over 60 % of them. Measured (docs/numerics.md, "The spacing"): a median ratio of 0.59 at
    12, 52 and 250 steps a year, smaller for ~90 %; over 600 sets of 40, the largest median
    ratio 0.66, the smallest share 70 %."""
    from pricer.tools.hw1f_spacing import measure, random_cases

    assert H.SPACING == "variance"
    errors = measure(random_cases(rng, 40), (12, 52), engine=ENGINE)
    for per_year, by in errors.items():
        ratio = by["variance"] / by["sqrt-dt"]
        assert np.median(ratio) < 0.8, (per_year, np.median(ratio))
        assert np.mean(ratio < 1.0) > 0.6, (per_year, np.mean(ratio < 1.0))
        assert np.median(by["variance"]) < np.median(by["sqrt-dt"])
    for spacing in H.SPACINGS:      # both first order: 52 steps a year well below 12's error
        assert np.median(errors[52][spacing]) < np.median(errors[12][spacing]) / 2


def test_spacings(rng):
    """The spacings' dr (hw1f.spacing_of): sqrt(3 V) with V = sigma^2 (1 - e^{-2 a dt}) / (2 a),
    below sigma sqrt(3 dt) by ~a dt / 2 relative; the same on the book's arrays as on one tree;
    one not known refused."""
    a, sigma = rng.uniform(0.01, 0.5, 50), rng.uniform(0.002, 0.03, 50)
    dt = rng.uniform(1e-3, 0.1, 50)
    variance = H.spacing_of(a, sigma, dt, "variance")
    exact = np.sqrt(3.0 * sigma ** 2 * (1.0 - np.exp(-2.0 * a * dt)) / (2.0 * a))
    assert np.allclose(variance, exact, rtol=1e-12, atol=0.0)
    assert np.array_equal(H.spacing_of(a, sigma, dt, "sqrt-dt"), sigma * np.sqrt(3.0 * dt))
    assert np.all(np.abs(variance / (sigma * np.sqrt(3.0 * dt)) - (1.0 - a * dt / 2.0))
                  < (a * dt) ** 2)
    tree = H.build(float(a[0]), float(sigma[0]), float(dt[0]), 5, random_curve(rng))
    assert tree.dr == variance[0]
    inst = random_instruments(rng, 1)[0]
    for spacing in H.SPACINGS:
        params = B.parameters([inst], a[0], sigma[0], 12, random_curve(rng), spacing=spacing)
        assert params.spacing == spacing
        assert params.dr[0] == H.spacing_of(a[0], sigma[0], params.dt[0], spacing)
    with pytest.raises(InputError, match="spacing is one of variance, sqrt-dt"):
        H.build(0.1, 0.01, 0.1, 10, random_curve(rng), spacing="pricer")
    with pytest.raises(InputError, match="spacing is one of"):
        B.parameters([inst], 0.1, 0.01, 12, random_curve(rng), spacing="exact")


@pytest.mark.parametrize("spacing", H.SPACINGS)
def test_cpu_engine_is_the_numpy_reference(rng, spacing):
    curve = random_curve(rng)
    instruments = random_instruments(rng, 40)
    a, sigma = rng.uniform(0.02, 0.3, 40), rng.uniform(0.003, 0.02, 40)
    per_year = rng.choice([4, 12, 26, 52], 40)
    want = np.array([H.price(i, x, s, p, curve, spacing=spacing)
                     for i, x, s, p in zip(instruments, a, sigma, per_year)])
    params = B.parameters(instruments, a, sigma, per_year, curve, spacing=spacing)
    for k, inst in enumerate(instruments):   # the vectorised layout is the reference's, row by row
        rows = slice(params.starts[k], params.starts[k] + params.steps[k] + 1)
        dt, steps = float(params.dt[k]), int(params.steps[k])
        assert steps == H.steps_of(inst.maturity, per_year[k])
        assert np.array_equal(params.flows[rows], H.cash_flows(inst, dt, steps))
        assert np.array_equal(params.exercise[rows], H.exercise_steps(inst, dt, steps))
    got = ENGINE.price(params)
    assert np.all(np.abs(got - want) <= 1e-12 * np.maximum(np.abs(want), 1e-3))


def test_an_exercise_at_maturity_is_against_the_redemption(rng):
    """At the last step the option is exercised against the bond's redemption F (its value
    ex-coupon just before it is repaid), as QuantLib's engine compares a call price with the
    redemption: puttable max(F, K), callable min(F, K), options max(+-(F - K), 0), all paid with
    the last coupon at maturity. On every engine of the CPU and the reference alike."""
    import hw1f_ql
    curve = random_curve(rng)
    mat, face, per_year = float(rng.uniform(2.0, 8.0)), 100.0, 12
    coupon = float(rng.uniform(0.0, 0.06))
    tree = H.build(0.1, 0.01, mat / H.steps_of(mat, per_year), H.steps_of(mat, per_year), curve)
    zero = float(curve.discount(mat))

    def value(product, strike, call=False, **dates):
        inst = H.BondOption(face=face, coupon=coupon, frequency=2, maturity=mat, strike=strike,
                            call=call, product=product, **dates)
        return inst, H.price(inst, 0.1, 0.01, per_year, curve, tree)

    _, straight = value("callable", 1e9, first=mat)             # a call that never binds
    at_maturity = [dict(first=mat), dict(exercise="bermudan", first=mat - 2.0, last=mat),
                   dict(exercise="american", first=mat / 2, last=mat)]
    cases = []              # (instrument, reference price) exercisable at maturity
    for dates in at_maturity:
        cases += [value("puttable", face + 5.0, **dates), value("callable", face + 5.0, **dates),
                  value("option", face - 5.0, call=True, **dates)]
    european = dict(first=mat)
    for (inst, price), want in ((value("puttable", face, **european), straight),  # was F + K
                                (value("puttable", face + 5.0, **european), straight + 5 * zero),
                                (value("callable", face - 5.0, **european), straight - 5 * zero),
                                (value("option", face - 5.0, call=True, **european), 5 * zero),
                                (value("option", face + 5.0, **european), 5 * zero),
                                (value("option", face - 5.0, **european), 0.0),
                                (value("option", face + 5.0, call=True, **european), 0.0)):
        assert abs(price - want) <= 1e-9 * face, (inst, price, want)
    # the CPU engine as the reference, and QuantLib's engine's arithmetic on pricer's grid and
    # branching (its own spacing: the exact variance, pricer's default)
    instruments = [inst for inst, _ in cases]
    params = B.parameters(instruments, np.full(len(instruments), 0.1),
                          np.full(len(instruments), 0.01), per_year, curve)
    want = np.array([price for _, price in cases])
    assert np.all(np.abs(ENGINE.price(params) - want) <= 1e-12 * np.maximum(np.abs(want), 1e-3))
    for inst, price in (case for case in cases if case[0].product != "option"):
        theirs = hw1f_ql.price(hw1f_ql.terms_of(inst, per_year), 0.1, 0.01, curve,
                               H.steps_of(mat, per_year), grid="uniform", branching="pricer",
                               spacing="quantlib")
        assert abs(theirs - price) <= 1e-12 * price, (inst, theirs, price)


def test_a_coupon_due_within_half_a_step_is_paid(rng):
    """A coupon due before the first step's midpoint falls on step 1, not on step 0 (today, whose
    payments are not in the value): a zero-coupon bond plus that coupon's value at step 1, on
    the reference, the CPU engine and the per-step arrays alike."""
    curve = random_curve(rng)
    per_year, steps = 12, 60
    mat = steps / per_year + 0.01                # 5 years and ~4 days: a coupon due in ~4 days
    coupon = H.BondOption(face=100.0, coupon=0.04, frequency=1, maturity=mat, strike=1e9,
                          call=True, product="callable", first=mat)
    zero = H.BondOption(face=100.0, coupon=0.0, frequency=0, maturity=mat, strike=1e9,
                        call=True, product="callable", first=mat)
    dt = mat / H.steps_of(mat, per_year)
    assert coupon.coupon_times()[0] < dt / 2 and H.cash_flows(coupon, dt, steps)[1] == 4.0
    prices = [H.price(x, 0.1, 0.01, per_year, curve) for x in (coupon, zero)]
    annuity = sum(4.0 * float(curve.discount(max(1, round(t / dt)) * dt))
                  for t in coupon.coupon_times())
    assert abs(prices[0] - prices[1] - annuity) <= 1e-9 * prices[0]
    params = B.parameters([coupon, zero], np.full(2, 0.1), np.full(2, 0.01), per_year, curve)
    assert params.flows[params.starts[0] + 1] == 4.0
    np.testing.assert_allclose(ENGINE.price(params), prices, rtol=1e-12)


def test_dates_within_half_a_step_of_today_fall_after_it(rng):
    """An exercise date and a coupon date on one day within half a step of today both fall on
    step 1 (the exercise is against the bond ex that coupon, as on every other step), so a price
    does not jump by a coupon as the date crosses half a step; a date of 0 is today's step."""
    curve = random_curve(rng)
    prices = {}
    for d in (0.4, 0.49, 0.51, 0.6):                   # the date, in steps of 1 / 12 year
        mat = 5.0 + d / 12.0
        for product, call, strike in (("callable", True, 100.0), ("option", True, 100.0),
                                      ("option", False, 110.0)):
            inst = H.BondOption(face=100.0, coupon=0.04, frequency=1, maturity=mat,
                                strike=strike, call=call, first=d / 12.0, product=product)
            dt = mat / H.steps_of(mat, 12)
            assert H.exercise_steps(inst, dt, H.steps_of(mat, 12))[1]
            prices.setdefault((product, call), []).append(H.price(inst, 0.1, 0.01, 12, curve))
    for key, (p40, p49, p51, _) in prices.items():   # across half a step: no jump of a coupon (4)
        assert abs(p51 - p49) <= 3.0 * abs(p49 - p40) + 0.01, (key, prices[key])
    today = H.BondOption(face=100.0, coupon=0.04, frequency=1, maturity=3.0, strike=100.0,
                         call=True, first=0.0, product="option")
    assert H.exercise_steps(today, 0.25, 12)[0]


def test_parity_and_the_order_of_exercise_rights(rng):
    """European call - put on a coupon bond = the bond's forward value less K P(0, T) (exact on a
    tree that reprices the curve); rights only add value: American >= Bermudan >= European;
    a callable bond <= the bond <= a puttable one."""
    curve = random_curve(rng)
    for _ in range(6):
        a, sigma = rng.uniform(0.03, 0.3), rng.uniform(0.005, 0.02)
        maturity = float(rng.integers(3, 12))
        expiry = float(rng.integers(1, int(maturity)))
        coupon, strike = float(rng.uniform(0.01, 0.07)), float(rng.uniform(85.0, 110.0))
        bond = dict(face=100.0, coupon=coupon, frequency=2, maturity=maturity, strike=strike)
        call, put = (H.price(H.BondOption(**bond, call=c, first=expiry), a, sigma, 24, curve)
                     for c in (True, False))
        steps = H.steps_of(maturity, 24)
        dt = maturity / steps
        flows = H.cash_flows(H.BondOption(**bond, call=True), dt, steps)
        after = np.arange(steps + 1) * dt > expiry + 1e-9
        forward = float(flows[after] @ curve.discount(np.arange(steps + 1)[after] * dt))
        assert abs((call - put) - (forward - strike * float(curve.discount(expiry)))) < 1e-10
        for product in ("option", "puttable"):
            european, bermudan, american = (
                H.price(H.BondOption(**bond, call=False, exercise=kind, first=expiry,
                                     last=maturity - 0.5, every=2.0, product=product),
                        a, sigma, 24, curve)
                for kind in ("european", "bermudan", "american"))
            assert american >= bermudan - 1e-12 >= european - 2e-12
        plain = H.price(H.BondOption(**dict(bond, strike=1e12), call=True, exercise="american",
                                     first=0.0, last=maturity, product="callable"),
                        a, sigma, 24, curve)
        callable_, puttable = (
            H.price(H.BondOption(**bond, call=True, exercise="american", first=expiry,
                                 last=maturity, product=p), a, sigma, 24, curve)
            for p in ("callable", "puttable"))
        assert callable_ <= plain + 1e-9 <= puttable + 2e-9


@pytest.mark.parametrize("column, value, message", [
    ("maturity", -1.0, "maturity must be > 0"), ("last_exercise", 0.01, "within [first_exercise"),
    ("exercise_frequency", 0.0, "must be > 0 for a bermudan"), ("frequency", 5, "12 a year"),
    ("first_exercise", -0.5, "within [0, maturity]"), ("volatility", np.nan, "volatility"),
    ("curve", 3, "names no curve"), ("steps_per_year", 1e9, "at most 1000000 steps"),
    ("mean_reversion", 1e-9, "wider than"), ("exercise_frequency", 1e12, "exercise dates")])
def test_bad_columns_are_refused_by_column_and_id(rng, column, value, message):
    instruments = [H.BondOption(100.0, 0.05, 2, 5.0, 100.0, True, "bermudan", first=1.0,
                                last=4.0, every=1.0) for _ in range(6)]
    cols = B.columns_of(instruments, 0.1, 0.01, 12)
    cols[column] = cols[column].astype(np.float64) if column == "frequency" else cols[column]
    cols[column][[2, 4]] = value
    with pytest.raises(InputError, match=re.escape(message)) as caught:
        B.tree_parameters(cols, [random_curve(rng)], ids=np.arange(6) + 100)
    assert caught.value.column == column and list(caught.value.ids) == [102, 104]


def test_bad_trees_and_curves_are_refused():
    with pytest.raises(InputError, match="increasing"):
        H.YieldCurve(np.array([1.0, 0.5]), np.array([0.01, 0.02]))
    with pytest.raises(InputError, match="a > 0"):
        H.build(0.0, 0.01, 0.1, 10, H.YieldCurve(np.array([1.0]), np.array([0.01])))


@pytest.mark.parametrize("name", ["U1", "R2", "R3", "S1", "S2"])
def test_the_papers_datasets_have_their_widths_and_heights(name):
    from pricer.tools.bond_datasets import dataset

    instruments, a, sigma, per_year, curve = dataset(name, count=400, seed=11)
    params = B.parameters(instruments, a, sigma, per_year, curve)
    widths, heights = 2 * params.jmax + 1, params.steps
    if name == "U1":
        assert set(widths) == {259} and set(heights) == {606}
        return
    assert widths.min() >= 7 and widths.max() <= 511 and np.all(widths % 2 == 1)
    assert heights.min() >= 12 and heights.max() <= 1200
    if name.startswith("S"):
        wide, tall = widths >= 461, heights >= 1082
        assert wide.sum() == tall.sum() == 4 and np.all(widths[~wide] <= 57)
        assert np.array_equal(wide, tall) == (name == "S1")
    assert np.all(np.isin([p.exercise for p in instruments], ["bermudan"]))


def test_a_book_file_round_trips_and_prices_as_the_reference(tmp_path, rng):
    """pricer generate --bonds writes a book (/bond_options, /curves), read back it prices as the
    NumPy reference does; pricer.price_bonds takes the same columns from memory."""
    import h5py

    import pricer
    from helpers import run_pricer
    from pricer.io.bonds import read_bond_book
    from pricer.tools.bond_datasets import CURVE, dataset

    path = tmp_path / "bonds.h5"
    done = run_pricer(["generate", "--bonds", "S2", "--count", "30", "--seed", "5", "-o",
                       str(path)])
    assert done.returncode == 0, done.stderr
    book = read_bond_book(str(path))
    instruments, a, sigma, per_year, _ = dataset("S2", 30, seed=5)
    want = np.array([H.price(i, x, s, per_year, CURVE) for i, x, s in zip(instruments, a, sigma)])
    assert np.allclose(ENGINE.price(book.parameters()), want, rtol=1e-12, atol=0.0)
    assert np.array_equal(pricer.price_bonds(str(path))["price"].to_numpy(),
                          ENGINE.price(book.parameters()))
    with h5py.File(path) as f:
        columns = {name: f["bond_options"][name][()] for name in f["bond_options"]}
    shown = run_pricer(["info", str(path)])
    assert shown.returncode == 0 and "30 instruments" in shown.stdout and "tree width" in shown.stdout
    columns["curve"] = np.array([""] * 30)          # the default curve, the book's only one
    out = pricer.price_bonds(columns, {"flat": (np.array([1.0, 30.0]), np.array([0.03, 0.03]))})
    flat = H.YieldCurve(np.array([1.0, 30.0]), np.array([0.03, 0.03]))
    again = np.array([H.price(i, x, s, per_year, flat) for i, x, s in zip(instruments, a, sigma)])
    assert list(out["id"]) == list(range(1, 31))
    assert np.allclose(out["price"].to_numpy(), again, rtol=1e-12, atol=0.0)


def _store_bool_byte(group, name: str, row: int, byte: int) -> None:
    """Column `name` rewritten as HDF5 booleans whose row `row` holds the byte `byte` (a damaged
    file: h5py reads it back as a bool array with that byte)."""
    raw = np.asarray(group[name][()]).astype(np.uint8)
    raw[row] = byte
    del group[name]
    group.create_dataset(name, data=raw.view(np.bool_))


def _store_float(group, name: str, row: int, value: float) -> None:
    """Column `name` rewritten as float64 with `value` at row `row`."""
    column = np.asarray(group[name][()], dtype=np.float64)
    column[row] = value
    del group[name]
    group.create_dataset(name, data=column)


def test_hostile_book_files_are_refused_by_name(tmp_path, rng):
    import h5py

    from helpers import run_pricer
    from pricer.io.bonds import read_bond_book

    path = tmp_path / "bonds.h5"
    assert run_pricer(["generate", "--bonds", "R1", "--count", "8", "-o", str(path)]).returncode == 0
    cases = [
        (lambda f: f["bond_options"]["exercise"].__setitem__(3, "asian"), "exercise must name",
         "exercise"),
        (lambda f: f["bond_options"]["curve"].__setitem__(2, "eur"), "curve must name", "curve"),
        (lambda f: f["bond_options"]["maturity"].__setitem__(1, -2.0), "maturity must be > 0",
         "maturity"),
        (lambda f: f["bond_options"]["id"].__setitem__(5, 1), "duplicate id", "id"),
        (lambda f: f["bond_options"].__delitem__("strike"), "missing column(s) strike", "strike"),
        (lambda f: f["curves"]["default"].__delitem__("rates"), "needs datasets times", None),
        (lambda f: f["bond_options"].move("product", "products"), "unknown column(s) products",
         "products"),
        (lambda f: _store_bool_byte(f["bond_options"], "call", 3, 7), "call must be true or false",
         "call"),
        (lambda f: f["bond_options"].attrs.__delitem__("schema"),
         "/bond_options attribute schema is None, expected 'pricer.bond_options/1'", None),
        (lambda f: _store_float(f["bond_options"], "frequency", 4, 1e300),
         "frequency must be whole numbers (at most 2^53); instrument id(s) 5 (first value 1e+300)",
         "frequency"),
        (lambda f: f["bond_options"]["exercise"].__setitem__(6, b"\xff\xfe"),
         "exercise holds text that is not UTF-8; instrument id(s) 7", "exercise"),
    ]
    for k, (spoil, message, column) in enumerate(cases):
        bad = tmp_path / f"bad{k}.h5"
        bad.write_bytes(path.read_bytes())
        with h5py.File(bad, "r+") as f:
            spoil(f)
        with pytest.raises(InputError, match=re.escape(message)) as caught:
            read_bond_book(str(bad))
        assert caught.value.column == column and str(bad) in str(caught.value)
    (tmp_path / "cut.h5").write_bytes(path.read_bytes()[:2000])
    with pytest.raises(InputError, match="cut.h5"):
        read_bond_book(str(tmp_path / "cut.h5"))


def test_short_text_columns_are_factorized_as_np_unique_does(rng):
    """Fixed-length byte strings of up to 8 bytes are hashed as 64-bit words (io/bonds.py,
    _factorize_short): every row's string comes back from its code, one code a distinct string,
    as np.unique's values, empty strings and strings of every length among them."""
    from pricer.io.bonds import _factorize_short

    words = np.array([b"", b"a", b"ab", b"abc", b"european", b"american", b"bermudan", b"x\x01"])
    for width in (1, 3, 8):
        raw = words[rng.integers(0, words.size, 5000)].astype(f"S{width}")
        codes, uniques = _factorize_short(raw)
        assert np.array_equal(uniques[codes], raw)
        assert sorted(uniques.tolist()) == np.unique(raw).tolist()


def test_hostile_columns_and_curves_in_memory_are_refused(rng):
    """Beyond the columns' rules: curves that are not (times, rates) of numbers, rates beyond
    +-100 % a year, a default naming no curve, text that is not UTF-8, flags other than 0 and 1,
    thread counts below 1."""
    import pricer

    instruments = [H.BondOption(100.0, 0.05, 2, 5.0, 100.0, True, "american", first=1.0,
                                last=4.0) for _ in range(4)]
    cols = dict(B.columns_of(instruments, 0.1, 0.01, 12), id=np.arange(4))
    cols["exercise"] = np.array(["american"] * 4)
    cols["product"] = np.array(["option"] * 4)
    cols["curve"] = np.array(["c"] * 4)
    good = {"c": (np.array([1.0, 10.0]), np.array([0.02, 0.03]))}
    assert np.all(np.isfinite(pricer.price_bonds(cols, good)["price"]))
    for curves, message in (({"c": (np.array(["1", "2"]), np.array([0.1, 0.2]))}, "numbers"),
                            ({"c": "flat"}, "must be (times, rates)"),
                            ({"c": (np.array([1.0, 2.0]), np.array([30.0, 30.0]))}, "within +-1"),
                            ({"c": (np.array([2.0, 1.0]), np.array([0.1, 0.1]))}, "increasing")):
        with pytest.raises(InputError, match=re.escape(message)):
            pricer.price_bonds(cols, curves)
    with pytest.raises(InputError, match="default curve"):
        pricer.price_bonds(cols, good, default="d")
    with pytest.raises(InputError, match="UTF-8"):
        pricer.price_bonds(dict(cols, exercise=np.array([b"\xff\xfe"] * 4, dtype=object)), good)
    with pytest.raises(InputError, match="true or false") as caught:
        pricer.price_bonds(dict(cols, call=np.array([1.0, np.nan, 0.5, 0.0])), good)
    assert list(caught.value.ids) == [1, 2]
    with pytest.raises(InputError, match="threads"):
        pricer.price_bonds(cols, good, threads=0)
