"""The second lattice family: fixed-coupon bonds and options on them under the Hull–White
one-factor model (dr = (theta(t) - a r) dt + sigma dW), each instrument on its own bounded-width
trinomial tree, built as Hull and White (1994) build it and as Pawlak et al. (2021) and Pawlak &
Oancea (2019) follow it (docs/numerics.md, "Hull–White trinomial trees").

This module is the family's model and its plain NumPy reference, vectorised across the tree's
width: the engines of the family are checked against it, and it against closed forms (Jamshidian's
bond options) and QuantLib. A book of instruments as the engines take it, and its checks, are in
pricer/model/bond_book.py.

- YieldCurve: continuously compounded zero rates at given times, linear in between, flat beyond
  the ends (QuantLib's ZeroCurve with Linear interpolation, Continuous compounding).
- HullWhiteTree: one instrument's tree: Δt, the node spacing Δr (`spacing_of`: sqrt(3 V), V the
  exact variance of a step, by default; Hull and White's first-order sigma sqrt(3 Δt) by choice),
  j_max = ceil(0.184 / (a Δt)), the branching of every node and its probabilities
  (M = e^{-a Δt} - 1, the M of Pawlak et al. (2021)), and the displacements alpha_m fitted by forward induction
  of the Arrow–Debreu prices so that the tree reprices the curve's zero-coupon bonds at every
  step.
- BondOption: a fixed-coupon bond (face, coupon rate and frequency, maturity) with an option on it
  (call or put, strike, European / Bermudan / American exercise), priced either as an option on
  the bond (`product="option"`: payoff max(±(B - K), 0)) or as the bond with the option embedded
  (`"callable"`: the issuer may redeem at K, value min(B, K); `"puttable"`: the holder may sell at
  K, value max(B, K)). B is the bond's value after the coupon of the exercise date (ex-coupon, no
  accrued interest added).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError

JMAX_FACTOR = 0.184        # j_max = ceil(JMAX_FACTOR / (a dt)): Hull and White's bound (1994)
MAX_RATE = 1.0              # |zero rate| (and a bond's |coupon| and sigma) a year: e^{+-r t} in FP64
TODAY = 1e-12               # a date (years) at most this is today: one after it falls on a step
                            # after today (cuda/trinomial.cu's hw_fill takes it as -DHW_TODAY)
DATE_SLACK = 1e-9           # a count of dates or steps that is whole but for rounding rounds to it
                            # (-DHW_DATE_SLACK)
PRODUCTS = ("option", "callable", "puttable")
EXERCISES = ("european", "bermudan", "american")
# the node spacing Δr of a tree (spacing_of): "variance", sqrt(3 V) with V the exact variance of
# the short rate over a step, sigma^2 (1 - e^{-2 a Δt}) / (2 a), as QuantLib's HullWhite tree and
# Pawlak et al.'s (2021) reference code space it; "sqrt-dt", sigma sqrt(3 Δt), Hull and White's (1994)
# first-order variance sigma^2 Δt. The default is the exact one: at the same tree size (j_max does
# not depend on the spacing) it is closer to Jamshidian's closed form (docs/numerics.md,
# "The spacing").
SPACINGS = ("variance", "sqrt-dt")
SPACING = "variance"


@dataclass(frozen=True)
class YieldCurve:
    """Zero rates (continuously compounded) at increasing times > 0."""
    times: np.ndarray
    rates: np.ndarray

    def __post_init__(self):
        times = np.asarray(self.times, dtype=np.float64)
        rates = np.asarray(self.rates, dtype=np.float64)
        if times.ndim != 1 or times.size == 0 or times.shape != rates.shape:
            raise InputError("a yield curve needs one rate per time, at least one point")
        if not (np.all(np.isfinite(times)) and np.all(np.isfinite(rates))):
            raise InputError("a yield curve's times and rates must be finite")
        if times[0] <= 0.0 or np.any(np.diff(times) <= 0.0):
            raise InputError("a yield curve's times must be > 0 and increasing")
        if np.any(np.abs(rates) > MAX_RATE):
            raise InputError(f"a yield curve's zero rates must be within +-{MAX_RATE:g}")
        object.__setattr__(self, "times", times)
        object.__setattr__(self, "rates", rates)

    def zero_rate(self, t) -> np.ndarray:
        return np.interp(t, self.times, self.rates)

    def discount(self, t) -> np.ndarray:
        """P(0, t) = exp(-r(t) t)."""
        t = np.asarray(t, dtype=np.float64)
        return np.exp(-self.zero_rate(t) * t)


@dataclass(frozen=True)
class HullWhiteTree:
    """One instrument's tree of `steps` steps of dt (nodes j = -width_at(m) .. width_at(m) at step
    m, short rate alphas[m] + j dr). Built by `build`."""
    a: float
    sigma: float
    dt: float
    steps: int
    jmax: int
    dr: float
    alphas: np.ndarray        # (steps,): the displacement of step m, fitted to the curve
    state_prices: np.ndarray  # (steps + 1,): sum_j Q(m, j), = P(0, m dt) once fitted

    @property
    def width(self) -> int:
        """Nodes of the widest step, 2 j_max + 1."""
        return 2 * self.jmax + 1

    def width_at(self, m: int) -> int:
        """The highest j at step m."""
        return min(m, self.jmax)


def spacing_of(a, sigma, dt, spacing: str = SPACING):
    """The node spacing Δr of trees of steps dt (numbers or arrays alike; SPACINGS). With either,
    the branching probabilities (branching) are the same functions of j M: they match the step's
    mean j M Δr and a variance of Δr² / 3, which is the exact variance of the mean-reverting step
    with "variance" and its first-order value sigma² dt with "sqrt-dt". The exact variance is
    computed with expm1, accurate for any a dt > 0 (QuantLib's 1 - e^{-2 a dt} loses digits as
    a dt falls: ~1e-12 relative at 2 a dt = 1e-4)."""
    if spacing == "variance":
        a = np.asarray(a, dtype=np.float64)
        dr = np.sqrt(3.0 * (sigma * sigma) * (-np.expm1(-2.0 * a * dt)) / (2.0 * a))
    elif spacing == "sqrt-dt":
        dr = sigma * np.sqrt(3.0 * np.asarray(dt, dtype=np.float64))
    else:
        raise InputError(f"a Hull–White tree's spacing is one of {', '.join(SPACINGS)} "
                         f"(not {spacing!r})")
    return float(dr) if np.ndim(dr) == 0 else dr


def jmax_of(a, dt):
    """Hull and White's bound on |j|: ceil(0.184 / (a dt)), at least 1."""
    return np.maximum(1, np.ceil(JMAX_FACTOR / (np.asarray(a) * np.asarray(dt)))).astype(np.int64)


def branching(jmax: int, M: float):
    """(offset, pu, pm, pd) for j = -jmax .. jmax: node j's children are j + offset + 1 (pu),
    j + offset (pm), j + offset - 1 (pd). Normal branching (offset 0) inside, downward at
    j = jmax (offset -1: j, j - 1, j - 2), upward at j = -jmax (offset +1: j + 2, j + 1, j).
    The probabilities match the first two moments of the mean-reverting step, E[dj] = j M."""
    j = np.arange(-jmax, jmax + 1, dtype=np.float64)
    jm, jjmm = j * M, j * j * M * M
    offset = np.zeros(j.size, dtype=np.int64)
    pu = 1.0 / 6.0 + (jjmm + jm) / 2.0
    pm = 2.0 / 3.0 - jjmm
    pd = 1.0 / 6.0 + (jjmm - jm) / 2.0
    top, bottom = -1, 0
    offset[top], offset[bottom] = -1, 1
    pu[top] = 7.0 / 6.0 + (jjmm[top] + 3.0 * jm[top]) / 2.0
    pm[top] = -1.0 / 3.0 - jjmm[top] - 2.0 * jm[top]
    pd[top] = 1.0 / 6.0 + (jjmm[top] + jm[top]) / 2.0
    pu[bottom] = 1.0 / 6.0 + (jjmm[bottom] - jm[bottom]) / 2.0
    pm[bottom] = -1.0 / 3.0 - jjmm[bottom] + 2.0 * jm[bottom]
    pd[bottom] = 7.0 / 6.0 + (jjmm[bottom] - 3.0 * jm[bottom]) / 2.0
    return offset, pu, pm, pd


def _step_forward(q: np.ndarray, m: int, tree_jmax: int, offset, pu, pm, pd, weights):
    """Arrow–Debreu prices of step m + 1 from those of step m (q over j = -w .. w, w =
    min(m, jmax)), each node's price times its discount `weights` spread over its children."""
    w, w_next = min(m, tree_jmax), min(m + 1, tree_jmax)
    out = np.zeros(2 * w_next + 1)
    rows = np.arange(-w, w + 1) + tree_jmax              # rows of the branching table
    centre = np.arange(-w, w + 1) + offset[rows] + w_next  # index of the pm child in `out`
    value = q * weights
    np.add.at(out, centre + 1, value * pu[rows])
    np.add.at(out, centre, value * pm[rows])
    np.add.at(out, centre - 1, value * pd[rows])
    return out


def build(a: float, sigma: float, dt: float, steps: int, curve: YieldCurve,
          spacing: str = SPACING) -> HullWhiteTree:
    """The tree of one instrument, its nodes spaced by spacing_of(a, sigma, dt, spacing): the
    branching, then alpha_m step by step (forward induction):
    alpha_m = (ln sum_j Q(m, j) e^{-j dr dt} - ln P(0, (m + 1) dt)) / dt, and
    Q(m + 1, k) = sum_j Q(m, j) q(j, k) e^{-(alpha_m + j dr) dt}, from Q(0, 0) = 1."""
    if not (a > 0.0 and sigma > 0.0 and dt > 0.0 and steps >= 1):
        raise InputError(f"a Hull–White tree needs a > 0, sigma > 0, dt > 0 and steps >= 1 "
                         f"(a {a}, sigma {sigma}, dt {dt}, steps {steps})")
    jmax = int(jmax_of(a, dt))
    dr = spacing_of(a, sigma, dt, spacing)
    offset, pu, pm, pd = branching(jmax, math.expm1(-a * dt))
    alphas = np.empty(steps)
    sums = np.empty(steps + 1)
    q = np.ones(1)
    sums[0] = 1.0
    for m in range(steps):
        w = min(m, jmax)
        j = np.arange(-w, w + 1)
        local = np.exp(-j * dr * dt)
        alphas[m] = (math.log(float(np.dot(q, local))) - math.log(float(curve.discount((m + 1) * dt))
                                                              )) / dt
        q = _step_forward(q, m, jmax, offset, pu, pm, pd, local * math.exp(-alphas[m] * dt))
        sums[m + 1] = q.sum()
    return HullWhiteTree(a, sigma, dt, steps, jmax, dr, alphas, sums)


@dataclass(frozen=True)
class BondOption:
    """A fixed-coupon bond and an option on it (module doc). Times in years from today."""
    face: float
    coupon: float             # annual rate, paid face * coupon / frequency a period
    frequency: int            # coupons a year (0: a zero-coupon bond)
    maturity: float           # the bond's
    strike: float
    call: bool
    exercise: str = "european"          # EXERCISES
    first: float = 0.0                  # european: the expiry; else the first exercise date
    last: float = 0.0                   # bermudan and american: the last
    every: float = 1.0                  # bermudan: exercise dates a year, first + k / every
    product: str = "option"             # PRODUCTS

    def exercise_times(self) -> np.ndarray:
        """A european's expiry, or a bermudan's dates first, first + 1 / every, ... <= last."""
        if self.exercise == "european":
            return np.array([self.first])
        count = int(math.floor((self.last - self.first) * self.every + DATE_SLACK))
        return self.first + np.arange(count + 1) / self.every

    def coupon_times(self) -> np.ndarray:
        """Coupon dates, counted back from maturity by 1 / frequency, > 0."""
        if self.frequency <= 0 or self.coupon == 0.0:
            return np.empty(0)
        count = int(math.floor(self.maturity * self.frequency + DATE_SLACK))
        times = self.maturity - np.arange(count + 1) / self.frequency
        return np.sort(times[times > TODAY])


def steps_of(maturity, steps_per_year):
    """A tree's steps: the bond's maturity in steps of about 1 / steps_per_year, at least 1 (dt is
    maturity / steps, so the maturity is on the grid). An int for numbers; for arrays, a float64
    array (NaN where an input is: the book's checks refuse those rows before any tree is built)."""
    steps = np.maximum(1.0, np.rint(np.multiply(maturity, steps_per_year)))
    return int(steps) if np.ndim(steps) == 0 else steps


def price(instrument: BondOption, a: float, sigma: float, steps_per_year: float,
          curve: YieldCurve, tree: HullWhiteTree | None = None, spacing: str = SPACING) -> float:
    """The instrument's value today on its Hull–White tree (built here with `spacing` unless
    given): backward induction of the bond's cash flows and of the option. A date falls on the
    nearest step. Node (m, j) discounts by e^{-alpha_m dt} e^{-j dr dt}, the product the forward
    induction's weights use too (in the engines a table of e^{-j dr dt} a tree and one factor a
    step)."""
    steps = steps_of(instrument.maturity, steps_per_year)
    dt = instrument.maturity / steps
    tree = tree or build(a, sigma, dt, steps, curve, spacing)
    flows = cash_flows(instrument, dt, steps)
    exercise = exercise_steps(instrument, dt, steps)
    offset, pu, pm, pd = branching(tree.jmax, math.expm1(-a * dt))
    sign = 1.0 if instrument.call else -1.0
    jmax = tree.jmax
    w = tree.width_at(steps)
    bond = np.zeros(2 * w + 1)          # ex-coupon value at the last step: nothing left
    value = bond.copy()                 # the option's (or the bond-with-option's) value
    if exercise[steps]:
        value = _at_maturity(instrument, value, sign)
    for m in range(steps - 1, -1, -1):
        w_next, w = w, tree.width_at(m)
        j = np.arange(-w, w + 1)
        rows = j + jmax
        centre = j + offset[rows] + w_next
        disc = math.exp(-tree.alphas[m] * dt) * np.exp(-j * tree.dr * dt)
        bond_next = bond + flows[m + 1]
        carried = value + flows[m + 1] if instrument.product != "option" else value
        bond = disc * (pu[rows] * bond_next[centre + 1] + pm[rows] * bond_next[centre]
                       + pd[rows] * bond_next[centre - 1])
        value = disc * (pu[rows] * carried[centre + 1] + pm[rows] * carried[centre]
                        + pd[rows] * carried[centre - 1])
        if exercise[m]:
            value = _exercised(instrument, bond, value, sign)
    return float(value[0])


def _exercised(instrument: BondOption, bond, value, sign: float):
    """The value where the option may be exercised now (bond: the bond's ex-coupon value)."""
    if instrument.product == "option":
        return np.maximum(value, np.maximum(sign * (bond - instrument.strike), 0.0))
    if instrument.product == "callable":
        return np.minimum(value, instrument.strike)
    return np.maximum(value, instrument.strike)


def _at_maturity(instrument: BondOption, value, sign: float):
    """The value at the last step where the option may be exercised there: against the
    redemption F, which the last step's flows pay (so the bond-with-option products' value is
    what exercise changes, min(F, K) - F or max(F, K) - F; the option's, max(+-(F - K), 0))."""
    redemption = np.full(value.shape, instrument.face)
    if instrument.product == "option":
        return _exercised(instrument, redemption, value, sign)
    return _exercised(instrument, redemption, redemption, sign) - redemption


def cash_flows(instrument: BondOption, dt: float, steps: int) -> np.ndarray:
    """The bond's payments at each step 0 .. steps: coupons on their nearest steps after today
    (step 0 is today, whose payments are not in the value), the face at the last."""
    flows = np.zeros(steps + 1)
    for t in instrument.coupon_times():
        # a coupon after today on its nearest step after today (step 0's flows are not paid)
        flows[max(1, int(round(t / dt)))] += (instrument.face * instrument.coupon
                                              / instrument.frequency)
    flows[steps] += instrument.face
    return flows


def exercise_steps(instrument: BondOption, dt: float, steps: int) -> np.ndarray:
    """Whether the option may be exercised at each step 0 .. steps."""
    out = np.zeros(steps + 1, dtype=bool)
    if instrument.exercise == "american":
        lo = max(0, int(math.ceil(instrument.first / dt - DATE_SLACK)))
        hi = min(steps, int(math.floor(instrument.last / dt + DATE_SLACK)))
        if hi >= lo:
            out[lo:hi + 1] = True
    else:
        for t in instrument.exercise_times():
            # a date after today on its nearest step after today, as a coupon (cash_flows):
            # the bond it is exercised on is then ex that date's coupon
            out[min(steps, max(1 if t > TODAY else 0, int(round(t / dt))))] = True
    return out


def zero_bond_option(curve: YieldCurve, a: float, sigma: float, strike: float, expiry: float,
                     maturity: float, call: bool) -> float:
    """The Hull–White closed form of a European option on a zero-coupon bond of face 1
    (Jamshidian 1989; Brigo and Mercurio, eq. 3.40), on the model fitted to `curve`."""
    from math import erf, exp, log, sqrt

    def normal(x):
        return 0.5 * (1.0 + erf(x / sqrt(2.0)))

    p_t, p_s = float(curve.discount(expiry)), float(curve.discount(maturity))
    spread = sigma / a * (1.0 - exp(-a * (maturity - expiry))) * sqrt(
        (1.0 - exp(-2.0 * a * expiry)) / (2.0 * a))
    h = log(p_s / (p_t * strike)) / spread + spread / 2.0
    if call:
        return p_s * normal(h) - strike * p_t * normal(h - spread)
    return strike * p_t * normal(-h + spread) - p_s * normal(-h)


def zero_bond_price(curve: YieldCurve, a: float, sigma: float, t: float, maturity, x):
    """P(t, T) on the model fitted to `curve`, where x = r(t) - alpha(t) is the Ornstein–Uhlenbeck
    part of the short rate (x(0) = 0, dx = -a x dt + sigma dW): Brigo and Mercurio's eq. 3.39 with
    r = x + f(0, t) + sigma^2 / (2 a^2) (1 - e^{-a t})^2 (eq. 3.37), whose forward rate cancels:
    P(0, T) / P(0, t) e^{-B x - B^2 sigma^2 (1 - e^{-2 a t}) / (4 a) - B sigma^2 (1 - e^{-a t})^2
    / (2 a^2)}, B = (1 - e^{-a (T - t)}) / a."""
    maturity = np.asarray(maturity, dtype=np.float64)
    b = -np.expm1(-a * (maturity - t)) / a
    shift = (b * b * sigma * sigma * -math.expm1(-2.0 * a * t) / (4.0 * a)
             + b * sigma * sigma * math.expm1(-a * t) ** 2 / (2.0 * a * a))
    return curve.discount(maturity) / float(curve.discount(t)) * np.exp(-b * x - shift)


def coupon_bond_option(curve: YieldCurve, a: float, sigma: float, strike: float, expiry: float,
                       times, amounts, call: bool) -> float:
    """The Hull–White closed form of a European option at `expiry` on the cash flows `amounts`
    paid at `times` (all after the expiry): Jamshidian's (1989) decomposition. The bond's value at
    the expiry falls with x, so x* where it equals the strike is found by bisection; then the
    option is the sum of amount_i times options on the zero-coupon bonds of `times` at strikes
    P(expiry, t_i; x*) (zero_bond_option)."""
    times, amounts = np.asarray(times, dtype=np.float64), np.asarray(amounts, dtype=np.float64)
    if not (np.all(times > expiry) and np.all(amounts > 0.0) and strike > 0.0):
        raise InputError("Jamshidian's decomposition needs positive flows after the expiry and a "
                         "positive strike")

    def gap(x):
        return float(amounts @ zero_bond_price(curve, a, sigma, expiry, times, x)) - strike

    lo, hi = -1.0, 1.0
    while gap(lo) < 0.0:
        lo *= 2.0
    while gap(hi) > 0.0:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if gap(mid) > 0.0 else (lo, mid)
    strikes = zero_bond_price(curve, a, sigma, expiry, times, 0.5 * (lo + hi))
    return float(sum(c * zero_bond_option(curve, a, sigma, float(k), expiry, float(t), call)
                     for c, k, t in zip(amounts, strikes, times)))
