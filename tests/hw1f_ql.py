"""QuantLib's Hull–White tree for callable and puttable fixed-rate bonds, in plain NumPy: what
`TreeCallableFixedRateBondEngine` of QuantLib 1.44 computes, step by step, so that pricer's own
tree (pricer/model/hw1f.py) can be compared with it one convention at a time (docs/numerics.md,
"Against QuantLib's tree"). Prices agree with QuantLib's within ~1e-14 relative.

What QuantLib does (lballabio/QuantLib), and so what this module does:
- the instrument (ql/experimental/callablebonds/callablebond.cpp, `CallableFixedRateBond`):
  coupons face x rate x yearFraction(start, end) on a backward schedule from maturity (a zero
  rate still has its dates); a callability price is per 100 of face, and a clean one gets the
  accrued interest at its date added (`accrued`: zero on a coupon date);
- `DiscretizedCallableFixedRateBond` (discretizedcallablefixedratebond.cpp): a callability up to
  a week (1/52 year) before a coupon date moves onto that date, its price times P(call date) /
  P(coupon date), and that coupon becomes "pre": added before the date's exercises (the exercise
  happened before the payment); a callability on that coupon date itself then gets the coupon
  added to its price (so it still caps the ex-coupon value). Other coupons are "post": the
  exercise first, then the coupon. The redemption is the value at maturity before its date's
  exercise and coupon;
- the grid (ql/timegrid.hpp, `TimeGrid(begin, end, steps)`): the mandatory times (redemption,
  coupons, callabilities) sorted and merged where close_enough, dtMax = last / steps, each
  interval between them cut into max(1, round(length / dtMax)) equal steps;
- the tree (ql/methods/lattices/trinomialtree.cpp, `TrinomialTree` on the Ornstein–Uhlenbeck
  process x of `HullWhite::Dynamics`, x0 = 0): step i spaces the nodes of step i + 1 by
  dx = sqrt(3 V(dt_i)), V the exact variance sigma^2 (1 - e^{-2 a dt}) / (2 a), except that a
  step shorter than 1 % of the grid's longest takes the grid's largest such dx; node j
  (x = j dx_i) has its middle child k = round(E[x] / dx_{i+1}), E[x] = x e^{-a dt_i}, and with
  e = E[x] - k dx_{i+1} the probabilities matching mean and variance; the next step's nodes run
  from min k - 1 to max k + 1, so the tree stops growing where |j (e^{-a dt} - 1)| > 1/2;
- the fit (ql/models/shortrate/onefactormodels/hullwhite.cpp, `HullWhite::tree`): the short rate
  at node (i, j) is x + phi_i, phi_i = ln(sum_j Q(i, j) e^{-x_j dt_i} / P(0, t_{i+1})) / dt_i from
  the Arrow–Debreu prices Q, so the tree reprices the curve at every grid time; each node
  discounts by e^{-(x + phi_i) dt_i} (`ShortRateTree::discount`);
- the induction (`TreeLattice1D::stepback`, `DiscretizedAsset::rollback`): the children's values
  times their probabilities, times the node's discount, then the step's adjustments, the first
  and last steps included; the price is the value at the root.

Each of the three places where pricer's tree may differ can be switched to pricer's convention,
so that the effect of each can be measured: `grid="uniform"` (time_steps equal steps over the
redemption time, a date on its nearest step), `branching="pricer"` (Hull and White's
j_max = ceil(0.184 / (a dt)): the middle child is j, one node in at +-j_max), `spacing="sqrt-dt"`
(dx = sigma sqrt(3 dt), variance sigma^2 dt, no floor: pricer's hw1f.spacing_of "sqrt-dt"). On a
uniform grid QuantLib's spacing is pricer's "variance" one (the floor needs a step under 1 % of
the longest). With the grid and the branching pricer's, the spacing QuantLib's (or "sqrt-dt"),
and pricer's instrument (`terms_of`), this is pricer's tree, hw1f.price with spacing "variance"
(or "sqrt-dt").
"""

from __future__ import annotations

import calendar
import datetime as _dt
import math
from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError
from pricer.model import hw1f
from pricer.model.hw1f import YieldCurve

TODAY = _dt.date(2026, 11, 27)      # the valuation date of the QuantLib-side instruments
DAYS_A_YEAR = 365.0                 # Actual/365 (Fixed): the curve's and the coupons' day count
WEEK = 1.0 / 52                     # DiscretizedCallableFixedRateBond's snapping window
FLOOR_BELOW = 0.01                  # TrinomialTree: a step below this x the longest is floored
CONVENTIONS = ("quantlib", "pricer")      # the branching's
SPACINGS = ("quantlib", "sqrt-dt")
GRIDS = ("quantlib", "uniform")


@dataclass(frozen=True)
class BondTerms:
    """What DiscretizedCallableFixedRateBond sees: times in years from today, amounts in currency.
    `pre[c]`: coupon c is added before the exercises of its date; `call_prices` are what the
    value is compared with (dirty, after the snapping's adjustments)."""
    redemption_time: float
    redemption: float
    coupon_times: np.ndarray
    coupon_amounts: np.ndarray
    pre: np.ndarray
    call_times: np.ndarray
    call_prices: np.ndarray
    put: bool

    def mandatory_times(self) -> np.ndarray:
        return np.concatenate(([self.redemption_time], self.coupon_times, self.call_times))


def add_months(day: _dt.date, months: int) -> _dt.date:
    """QuantLib's Date + Period(months, Months): the day of the month kept, clipped to the month's
    length (no end-of-month rule)."""
    year, month = divmod(day.year * 12 + day.month - 1 + months, 12)
    return _dt.date(year, month + 1, min(day.day, calendar.monthrange(year, month + 1)[1]))


def year_fraction(start: _dt.date, end: _dt.date) -> float:
    return (end - start).days / DAYS_A_YEAR


def schedule(start: _dt.date, maturity: _dt.date, months: int) -> list:
    """QuantLib's Schedule(start, maturity, Period(months, Months), NullCalendar, Unadjusted,
    Unadjusted, Backward, endOfMonth=False): maturity - k periods (each counted from the maturity)
    while not before `start`, then `start` if not already there (a short first period)."""
    dates, k = [maturity], 1
    while (day := add_months(maturity, -k * months)) >= start:
        if day != dates[-1]:
            dates.append(day)
        k += 1
    if dates[-1] != start:
        dates.append(start)
    return dates[::-1]


def quantlib_terms(face: float, coupon: float, frequency: int, maturity: _dt.date, call_dates,
                   call_price, put: bool, curve: YieldCurve, today: _dt.date = TODAY,
                   clean: bool = True) -> BondTerms:
    """The terms that QuantLib's CallableFixedRateBond(0, face, schedule, [coupon],
    Actual365Fixed(), Unadjusted, 100, today, callabilities) hands its tree engine: the schedule
    of `schedule` (`frequency` coupons a year, today to maturity), one callability (a put's if
    `put`) on each date at `call_price` per 100 of face (one price, or one a date), clean unless
    `clean` is False; the curve's day count Actual/365 (Fixed), settlement today."""
    if frequency <= 0 or 12 % frequency:
        raise InputError(f"a coupon frequency divides 12 (not {frequency})")
    dates = schedule(today, maturity, 12 // frequency)
    periods, ends = list(zip(dates[:-1], dates[1:])), dates[1:]
    coupon_times = np.array([year_fraction(today, end) for end in ends])
    # FixedRateCoupon: nominal x (compound factor - 1), simple compounding
    amounts = np.array([face * ((1.0 + coupon * year_fraction(s, e)) - 1.0) for s, e in periods])

    def accrued(day):
        """Per 100 of face: the first coupon paid after `day`, accrued from its start to `day`."""
        start, end = next(((s, e) for s, e in periods if e > day), (day, day))
        return face * ((1.0 + coupon * year_fraction(start, day)) - 1.0) / face * 100.0 \
            if day > start else 0.0

    quoted = np.broadcast_to(np.asarray(call_price, dtype=np.float64), (len(call_dates),))
    # one on or before today has occurred
    rights = sorted((d, float(k)) for d, k in zip(call_dates, quoted) if d > today)
    days = [d for d, _ in rights]
    times = [year_fraction(today, d) for d in days]
    prices = [(k + (accrued(d) if clean else 0.0)) * face / 100.0 for d, k in rights]
    pre = np.zeros(len(periods), dtype=bool)
    for c, day in enumerate(days):
        for j, t in enumerate(coupon_times):
            if times[c] <= t <= times[c] + WEEK and day < ends[j]:
                # onto the coupon date, the price carried there at the curve's forward rate
                prices[c] *= float(curve.discount(times[c])) / float(curve.discount(t))
                times[c], pre[j] = t, True
                break
    for c, day in enumerate(days):      # on a "pre" coupon's date: compared cum coupon
        if day in ends and pre[ends.index(day)]:
            prices[c] += amounts[ends.index(day)]
    return BondTerms(year_fraction(today, maturity), face, coupon_times, amounts, pre,
                     np.array(times), np.array(prices), put)


def terms_of(instrument: hw1f.BondOption, steps_per_year: float) -> BondTerms:
    """A callable or puttable instrument of pricer's family as these terms, on its uniform grid
    of hw1f.steps_of(maturity, steps_per_year) steps: the face as the redemption (an exercise at
    maturity is compared with it, as QuantLib compares one), the coupons as hw1f.cash_flows puts
    them, all "post" (pricer's B is ex-coupon), the prices K."""
    if instrument.product not in ("callable", "puttable"):
        raise InputError("only callable and puttable bonds have QuantLib's tree engine")
    steps = hw1f.steps_of(instrument.maturity, steps_per_year)
    dt = instrument.maturity / steps
    flows = hw1f.cash_flows(instrument, dt, steps)
    flows[steps] -= instrument.face             # the redemption, apart
    paid = np.flatnonzero(flows[1:]) + 1        # one on step 0 (today) is not in the value
    exercise = np.flatnonzero(hw1f.exercise_steps(instrument, dt, steps))
    return BondTerms(steps * dt, float(instrument.face), paid * dt, flows[paid],
                     np.zeros(paid.size, dtype=bool),
                     exercise * dt, np.full(exercise.size, float(instrument.strike)),
                     instrument.product == "puttable")


def time_grid(mandatory, steps: int) -> np.ndarray:
    """QuantLib's TimeGrid(begin, end, steps) (module doc)."""
    merged = []
    for t in np.sort(np.asarray(mandatory, dtype=np.float64)):
        if t < 0.0:
            raise InputError("a time grid's mandatory times must be >= 0")
        if not merged or not _close_enough(t, merged[-1]):
            merged.append(float(t))
    dt_max = merged[-1] / steps
    out, begin = [0.0], 0.0
    for end in merged:
        if end != 0.0:
            n = max(1, int((end - begin) / dt_max + 0.5))
            out.extend(begin + k * ((end - begin) / n) for k in range(1, n + 1))
        begin = end
    return np.array(out)


def _close_enough(x: float, y: float, n: int = 42) -> bool:
    """QuantLib's close_enough: |x - y| within n epsilons of x or of y."""
    diff, eps = abs(x - y), n * np.finfo(np.float64).eps
    return x == y or diff <= eps * abs(x) or diff <= eps * abs(y)


def grid_of(terms: BondTerms, time_steps: int, grid: str = "quantlib") -> np.ndarray:
    """QuantLib's grid through the terms' dates, or pricer's: time_steps steps of T / time_steps."""
    if grid == "quantlib":
        return time_grid(terms.mandatory_times(), time_steps)
    if grid == "uniform":
        return np.arange(time_steps + 1) * (terms.redemption_time / time_steps)
    raise InputError(f"a grid is one of {GRIDS}")


@dataclass(frozen=True)
class Tree:
    """A one-factor tree on a grid: step i has nodes x = (jmin[i] + index) dx[i]; node `index`
    has the children middle[i][index] - 1, + 0, + 1 of step i + 1 with probabilities
    probs[i][:, index] (down, middle, up) and discounts by disc[i][index] over dts[i]."""
    times: np.ndarray
    dts: np.ndarray
    dx: np.ndarray
    jmin: np.ndarray
    jmax: np.ndarray
    middle: list
    probs: list
    disc: list
    phi: np.ndarray

    def size(self, i: int) -> int:
        return int(self.jmax[i] - self.jmin[i] + 1)


def build(times, dts, a: float, sigma: float, curve: YieldCurve, branching: str = "quantlib",
          spacing: str = "quantlib") -> Tree:
    """HullWhite::tree(grid) (module doc), its branching QuantLib's or pricer's (CONVENTIONS), its
    spacing QuantLib's or sigma sqrt(3 dt) (SPACINGS); then phi_i step by step, by forward
    induction of the Arrow–Debreu prices."""
    if branching not in CONVENTIONS:
        raise InputError(f"a branching is one of {CONVENTIONS}")
    if spacing not in SPACINGS:
        raise InputError(f"a spacing is one of {SPACINGS}")
    times, dts = np.asarray(times, dtype=np.float64), np.asarray(dts, dtype=np.float64)
    n = dts.size
    if spacing == "sqrt-dt" or a < math.sqrt(np.finfo(np.float64).eps):
        v2s = sigma * sigma * dts
    else:                               # OrnsteinUhlenbeckProcess::variance (libm's exp, as C++)
        v2s = np.array([0.5 * sigma * sigma / a * (1.0 - math.exp(-2.0 * a * dt)) for dt in dts])
    dx_floor, floor_below = math.sqrt(3.0 * float(v2s.max())), FLOOR_BELOW * float(dts.max())
    dx, jmin, jmax = np.zeros(n + 1), np.zeros(n + 1, np.int64), np.zeros(n + 1, np.int64)
    middle, probs = [], []
    for i in range(n):
        dt, v2 = float(dts[i]), float(v2s[i])
        v = math.sqrt(v2)
        natural = v * math.sqrt(3.0)
        if spacing == "sqrt-dt":
            dx[i + 1] = sigma * math.sqrt(3.0 * dt)
        else:       # a very short step keeps the grid's widest spacing (no fan of empty nodes)
            dx[i + 1] = max(natural, dx_floor) if dt < floor_below else natural
        floored = spacing == "quantlib" and dx[i + 1] > natural
        j = np.arange(jmin[i], jmax[i] + 1)
        mean = (j * dx[i]) * math.exp(-a * dt)
        if branching == "quantlib":     # the node nearest the mean
            k = np.floor(mean / dx[i + 1] + 0.5).astype(np.int64)
        else:                           # Hull and White's: j, one node in at +-j_max
            bound = int(hw1f.jmax_of(a, dt)) - 1
            k = np.clip(j, -bound, bound)
        # mean (e from the middle child) and variance v2 of the step matched
        e = mean - k * dx[i + 1]
        e2 = e * e
        if floored:                     # any spacing (weights may dip below 0: QuantLib's)
            dx2 = dx[i + 1] * dx[i + 1]
            p = [(v2 + e2 - e * dx[i + 1]) / (2.0 * dx2), 1.0 - (v2 + e2) / dx2,
                 (v2 + e2 + e * dx[i + 1]) / (2.0 * dx2)]
        elif spacing == "quantlib":     # dx = v sqrt(3), in QuantLib's form
            e3 = e * math.sqrt(3.0)
            p = [(1.0 + e2 / v2 - e3 / v) / 6.0, (2.0 - e2 / v2) / 3.0,
                 (1.0 + e2 / v2 + e3 / v) / 6.0]
        else:                           # sqrt-dt, in pricer's form: eta = e / dr, as hw1f.branching
            eta = e / dx[i + 1]
            p = [1.0 / 6.0 + (eta * eta - eta) / 2.0, 2.0 / 3.0 - eta * eta,
                 1.0 / 6.0 + (eta * eta + eta) / 2.0]
        jmin[i + 1], jmax[i + 1] = k.min() - 1, k.max() + 1
        middle.append(k - jmin[i + 1])
        probs.append(np.vstack(p))
    phi, disc, q = np.empty(n), [], np.ones(1)
    for i in range(n):
        x = (jmin[i] + np.arange(q.size)) * dx[i]
        phi[i] = math.log(float(np.dot(q, np.exp(-x * dts[i])))
                          / float(curve.discount(times[i + 1]))) / dts[i]
        disc.append(np.exp(-(x + phi[i]) * dts[i]))
        nxt = np.zeros(jmax[i + 1] - jmin[i + 1] + 1)
        for b in range(3):
            np.add.at(nxt, middle[i] - 1 + b, q * disc[i] * probs[i][b])
        q = nxt
    return Tree(times, dts, dx, jmin, jmax, middle, probs, disc, phi)


def _nearest(times: np.ndarray, t: float) -> int:
    """TimeGrid::closestIndex: the grid time nearest t (the earlier on a tie)."""
    i = int(np.searchsorted(times, t))
    if i == 0 or i == times.size:
        return min(i, times.size - 1)
    return i if times[i] - t < t - times[i - 1] else i - 1


def rollback(terms: BondTerms, tree: Tree) -> float:
    """DiscretizedCallableFixedRateBond on the tree: the redemption at its step, then back to the
    root; on each step, those of its dates that fall on it (QuantLib's isOnTime: the nearest grid
    time): the "pre" coupons, the exercises, the "post" coupons."""
    coupon_at = np.array([_nearest(tree.times, t) for t in terms.coupon_times], dtype=np.int64)
    call_at = np.array([_nearest(tree.times, t) for t in terms.call_times], dtype=np.int64)
    extreme = np.maximum if terms.put else np.minimum

    def adjust(i, values):
        for c in np.flatnonzero((coupon_at == i) & terms.pre):
            values = values + terms.coupon_amounts[c]
        for c in np.flatnonzero(call_at == i):
            values = extreme(values, terms.call_prices[c])
        for c in np.flatnonzero((coupon_at == i) & ~terms.pre):
            values = values + terms.coupon_amounts[c]
        return values

    last = _nearest(tree.times, terms.redemption_time)
    values = adjust(last, np.full(tree.size(last), float(terms.redemption)))
    for i in range(last - 1, -1, -1):
        k, p = tree.middle[i], tree.probs[i]
        values = adjust(i, (p[0] * values[k - 1] + p[1] * values[k] + p[2] * values[k + 1])
                        * tree.disc[i])
    return float(values[0])


def price(terms: BondTerms, a: float, sigma: float, curve: YieldCurve, time_steps: int,
          grid: str = "quantlib", branching: str = "quantlib", spacing: str = "quantlib") -> float:
    """The bond's value today: TreeCallableFixedRateBondEngine(HullWhite(curve, a, sigma),
    time_steps) where every convention is QuantLib's; `grid="uniform"`, `branching="pricer"`,
    `spacing="sqrt-dt"` take pricer's instead (module doc)."""
    if not (a > 0.0 and sigma > 0.0 and time_steps >= 1):
        raise InputError(f"a Hull–White tree needs a > 0, sigma > 0 and time_steps >= 1 "
                         f"(a {a}, sigma {sigma}, time_steps {time_steps})")
    times = grid_of(terms, time_steps, grid)
    return rollback(terms, build(times, np.diff(times), a, sigma, curve, branching, spacing))


def price_bond(face: float, coupon: float, frequency: int, maturity: _dt.date, call_dates,
               call_price, put: bool, a: float, sigma: float, curve: YieldCurve,
               time_steps: int, today: _dt.date = TODAY, clean: bool = True,
               **conventions) -> float:
    """A callable (or, `put`, puttable) fixed-rate bond as QuantLib prices it (quantlib_terms,
    then price); `conventions`: price's grid, branching, spacing."""
    terms = quantlib_terms(face, coupon, frequency, maturity, call_dates, call_price, put, curve,
                           today, clean)
    return price(terms, a, sigma, curve, time_steps, **conventions)
