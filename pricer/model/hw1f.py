"""The second lattice family: fixed-coupon bonds and options on them under the Hull–White
one-factor model (dr = (theta(t) - a r) dt + sigma dW), each instrument on its own bounded-width
trinomial tree, built as Hull and White (1994) build it and as seeds 000 and 003 follow it
(docs/numerics.md, "Hull–White trinomial trees").

This module is the family's model and its plain NumPy reference, vectorised across the tree's
width: the engines of the family are checked against it, and it against closed forms (Jamshidian's
bond options) and QuantLib.

- YieldCurve: continuously compounded zero rates at given times, linear in between, flat beyond
  the ends (QuantLib's ZeroCurve with Linear interpolation, Continuous compounding).
- HullWhiteTree: one instrument's tree: Δt, Δr = sigma sqrt(3 Δt), j_max = ceil(0.184 / (a Δt)),
  the branching of every node and its probabilities (M = e^{-a Δt} - 1, the papers' M), and the
  displacements alpha_m fitted by forward induction of the Arrow–Debreu prices so that the tree
  reprices the curve's zero-coupon bonds at every step.
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

from pricer.errors import InputError, first_ids

JMAX_FACTOR = 0.184        # j_max = ceil(JMAX_FACTOR / (a dt)): Hull and White's bound (1994)
MAX_TREE_STEPS = 1_000_000  # bounds on one instrument's tree (its per-step arrays, its scratch)
MAX_JMAX = 50_000
# bounds that keep every product of the induction within FP64 (a curve's discounts, the flows)
MAX_MATURITY = 500.0        # years: e^{+-MAX_RATE * MAX_MATURITY} within FP64
MAX_AMOUNT = 1e15           # face and |strike|
MAX_RATE = 1.0              # |coupon|, |zero rate| and sigma, a year
MAX_MEAN_REVERSION = 100.0
PRODUCTS = ("option", "callable", "puttable")
EXERCISES = ("european", "bermudan", "american")


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


def build(a: float, sigma: float, dt: float, steps: int, curve: YieldCurve) -> HullWhiteTree:
    """The tree of one instrument: the branching, then alpha_m step by step (forward induction):
    alpha_m = (ln sum_j Q(m, j) e^{-j dr dt} - ln P(0, (m + 1) dt)) / dt, and
    Q(m + 1, k) = sum_j Q(m, j) q(j, k) e^{-(alpha_m + j dr) dt}, from Q(0, 0) = 1."""
    if not (a > 0.0 and sigma > 0.0 and dt > 0.0 and steps >= 1):
        raise InputError(f"a Hull–White tree needs a > 0, sigma > 0, dt > 0 and steps >= 1 "
                         f"(a {a}, sigma {sigma}, dt {dt}, steps {steps})")
    jmax = int(jmax_of(a, dt))
    dr = sigma * math.sqrt(3.0 * dt)
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
        count = int(math.floor((self.last - self.first) * self.every + 1e-9))
        return self.first + np.arange(count + 1) / self.every

    def coupon_times(self) -> np.ndarray:
        """Coupon dates, counted back from maturity by 1 / frequency, > 0."""
        if self.frequency <= 0 or self.coupon == 0.0:
            return np.empty(0)
        count = int(math.floor(self.maturity * self.frequency + 1e-9))
        times = self.maturity - np.arange(count + 1) / self.frequency
        return np.sort(times[times > 1e-12])


def steps_of(maturity: float, steps_per_year: float) -> int:
    """A tree's steps: the bond's maturity in steps of about 1 / steps_per_year, at least 1 (dt is
    maturity / steps, so the maturity is on the grid)."""
    return max(1, int(round(maturity * steps_per_year)))


def price(instrument: BondOption, a: float, sigma: float, steps_per_year: float,
          curve: YieldCurve, tree: HullWhiteTree | None = None) -> float:
    """The instrument's value today on its Hull–White tree (built here unless given): backward
    induction of the bond's cash flows and of the option. A date falls on the nearest step. Node
    (m, j) discounts by e^{-alpha_m dt} e^{-j dr dt}, the product the forward induction's
    weights use too (one exponential a step and a table of one a node, in the engines)."""
    steps = steps_of(instrument.maturity, steps_per_year)
    dt = instrument.maturity / steps
    tree = tree or build(a, sigma, dt, steps, curve)
    flows = cash_flows(instrument, dt, steps)
    exercise = exercise_steps(instrument, dt, steps)
    offset, pu, pm, pd = branching(tree.jmax, math.expm1(-a * dt))
    sign = 1.0 if instrument.call else -1.0
    jmax = tree.jmax
    w = tree.width_at(steps)
    bond = np.zeros(2 * w + 1)          # ex-coupon value at the last step: nothing left
    value = bond.copy()                 # the option's (or the bond-with-option's) value
    if exercise[steps]:
        value = _exercised(instrument, bond, value, sign)
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


def cash_flows(instrument: BondOption, dt: float, steps: int) -> np.ndarray:
    """The bond's payments at each step 0 .. steps: coupons on their nearest steps, the face at
    the last."""
    flows = np.zeros(steps + 1)
    for t in instrument.coupon_times():
        flows[int(round(t / dt))] += instrument.face * instrument.coupon / instrument.frequency
    flows[steps] += instrument.face
    return flows


def exercise_steps(instrument: BondOption, dt: float, steps: int) -> np.ndarray:
    """Whether the option may be exercised at each step 0 .. steps."""
    out = np.zeros(steps + 1, dtype=bool)
    if instrument.exercise == "american":
        lo = max(0, int(math.ceil(instrument.first / dt - 1e-9)))
        hi = min(steps, int(math.floor(instrument.last / dt + 1e-9)))
        if hi >= lo:
            out[lo:hi + 1] = True
    else:
        for t in instrument.exercise_times():
            out[min(steps, max(0, int(round(t / dt))))] = True
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


# ------------------------------------------------------------------ a portfolio's tree parameters

PRODUCT_CODES = {name: k for k, name in enumerate(PRODUCTS)}


@dataclass(frozen=True)
class HullWhiteParams:
    """Everything the family's engines need per instrument (struct of arrays), and per step of
    each instrument's tree in flat arrays: instrument k's steps 0 .. steps[k] are entries
    starts[k] .. starts[k] + steps[k] of `flows`, `exercise` and `discount` (the seeds' expanded
    arrays, offsets by an exclusive scan of the heights)."""
    a: np.ndarray
    sigma: np.ndarray
    dt: np.ndarray
    steps: np.ndarray       # int64: the tree's height
    jmax: np.ndarray        # int64: width 2 jmax + 1
    dr: np.ndarray
    strike: np.ndarray
    sign: np.ndarray        # +1 call, -1 put
    product: np.ndarray     # int64: PRODUCT_CODES
    starts: np.ndarray      # int64
    flows: np.ndarray       # the bond's payments at each step
    exercise: np.ndarray    # bool: whether the option may be exercised at each step
    discount: np.ndarray    # P(0, m dt) from the instrument's curve

    def __len__(self) -> int:
        return int(self.steps.size)

    def nodes(self) -> np.ndarray:
        """Tree nodes per instrument (one sweep): the sum of the steps' widths."""
        levels = self.steps.astype(np.float64) + 1.0
        j = self.jmax.astype(np.float64)
        growing = np.minimum(levels, j)     # steps 0 .. jmax - 1: 2 m + 1 nodes each
        return growing * growing + (levels - growing) * (2.0 * j + 1.0)


# A book of instruments as columns (the portfolio file's /bond_options, docs/formats.md): every
# array has one entry per instrument; `curve` indexes a list of YieldCurve.
BOND_COLUMNS = ("face", "coupon", "frequency", "maturity", "strike", "call", "exercise",
                "first_exercise", "last_exercise", "exercise_frequency", "product",
                "mean_reversion", "volatility", "steps_per_year", "curve")


def columns_of(instruments, a, sigma, steps_per_year, curve=0) -> dict:
    """The columns (BOND_COLUMNS) of a list of BondOption with their model's a, sigma and steps a
    year (scalars apply to all) and curve index."""
    n = len(instruments)

    def each(name, dtype=np.float64):
        return np.array([getattr(inst, name) for inst in instruments], dtype=dtype)

    def every(value, dtype=np.float64):
        return np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=dtype), (n,)))

    return dict(face=each("face"), coupon=each("coupon"), frequency=each("frequency", np.int64),
                maturity=each("maturity"), strike=each("strike"), call=each("call", np.bool_),
                exercise=np.array([EXERCISES.index(i.exercise) for i in instruments],
                                  dtype=np.int64),
                first_exercise=each("first"), last_exercise=each("last"),
                exercise_frequency=each("every"),
                product=np.array([PRODUCT_CODES[i.product] for i in instruments], dtype=np.int64),
                mean_reversion=every(a), volatility=every(sigma),
                steps_per_year=every(steps_per_year), curve=every(curve, np.int64))


def parameters(instruments, a, sigma, steps_per_year, curves) -> HullWhiteParams:
    """The HullWhiteParams of a list of BondOption (columns_of) on one curve or a list of them
    (one per instrument)."""
    if isinstance(curves, (list, tuple)):
        return tree_parameters(columns_of(instruments, a, sigma, steps_per_year,
                                          np.arange(len(instruments))), list(curves))
    return tree_parameters(columns_of(instruments, a, sigma, steps_per_year), [curves])


def _exclusive(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _each(counts: np.ndarray):
    """(owner, k): for every instrument i, counts[i] entries (i, 0 .. counts[i] - 1)."""
    owner = np.repeat(np.arange(counts.size), counts)
    return owner, np.arange(owner.size) - np.repeat(_exclusive(counts), counts)


def check_columns(cols: dict, curves: list, ids: np.ndarray | None = None) -> None:
    """A book's columns (BOND_COLUMNS) that no tree can price, refused by column and ids
    (InputError), rule by rule."""
    n = int(np.shape(cols["maturity"])[0])
    ids = np.arange(n) if ids is None else np.asarray(ids)

    def col(name):
        return np.asarray(cols[name], dtype=np.float64)

    kind = np.asarray(cols["exercise"])
    first, last, maturity = col("first_exercise"), col("last_exercise"), col("maturity")
    dated = kind != EXERCISES.index("european")
    with np.errstate(invalid="ignore", over="ignore"):
        steps = np.maximum(1.0, np.rint(maturity * col("steps_per_year")))
        rules = [
            ("maturity", ~((maturity > 0.0) & (maturity <= MAX_MATURITY)),
             f"must be > 0 and at most {MAX_MATURITY:g} years"),
            ("face", ~((col("face") > 0.0) & (col("face") <= MAX_AMOUNT)),
             f"must be > 0 and at most {MAX_AMOUNT:g}"),
            ("coupon", ~(np.abs(col("coupon")) <= MAX_RATE),
             f"must be within +-{MAX_RATE:g} (a rate a year)"),
            ("frequency", ~np.isin(cols["frequency"], (0, 1, 2, 3, 4, 6, 12)),
             "must be 0 (no coupons), 1, 2, 3, 4, 6 or 12 a year"),
            ("strike", ~(np.abs(col("strike")) <= MAX_AMOUNT), f"must be within +-{MAX_AMOUNT:g}"),
            ("exercise", ~np.isin(kind, range(len(EXERCISES))),
             f"must be one of {', '.join(EXERCISES)}"),
            ("product", ~np.isin(cols["product"], range(len(PRODUCTS))),
             f"must be one of {', '.join(PRODUCTS)}"),
            ("first_exercise", ~(first >= 0.0) | ~(first <= maturity),
             "must be within [0, maturity]"),
            ("last_exercise", dated & (~(last >= first) | ~(last <= maturity)),
             "must be within [first_exercise, maturity]"),
            ("exercise_frequency", (kind == EXERCISES.index("bermudan"))
             & ~(col("exercise_frequency") > 0.0), "must be > 0 for a bermudan"),
            ("exercise_frequency", (kind == EXERCISES.index("bermudan"))
             & ~((last - first) * col("exercise_frequency") <= MAX_TREE_STEPS),
             f"gives a bermudan more than {MAX_TREE_STEPS} exercise dates"),
            ("mean_reversion", ~((col("mean_reversion") > 0.0)
                                 & (col("mean_reversion") <= MAX_MEAN_REVERSION)),
             f"must be > 0 and at most {MAX_MEAN_REVERSION:g}"),
            ("volatility", ~((col("volatility") > 0.0) & (col("volatility") <= MAX_RATE)),
             f"must be > 0 and at most {MAX_RATE:g} (a short rate's volatility)"),
            ("steps_per_year", ~((col("steps_per_year") > 0.0) & (steps <= MAX_TREE_STEPS)),
             f"must be > 0 and give a tree of at most {MAX_TREE_STEPS} steps"),
            ("curve", ~np.isin(cols["curve"], range(len(curves))), "names no curve given"),
            ("mean_reversion", ~(JMAX_FACTOR * steps / (col("mean_reversion") * maturity)
                                 <= MAX_JMAX),
             f"gives a tree wider than {2 * MAX_JMAX + 1} nodes (j_max = 0.184 / (a dt))"),
        ]
    for column, bad, why in rules:
        bad = np.asarray(bad, dtype=bool)
        if bad.any():
            raise InputError(f"bond_options: {column} {why}; instrument id(s) "
                             f"{first_ids(ids, bad)} (first value "
                             f"{np.asarray(cols[column])[bad][0].tolist()!r})", column=column,
                             ids=ids[bad])


def tree_parameters(cols: dict, curves: list, ids: np.ndarray | None = None) -> HullWhiteParams:
    """The trees of a book given as columns (BOND_COLUMNS; the dates and flows as `price` places
    them: each on its nearest step), vectorised over the book; bad columns refused first
    (check_columns)."""
    check_columns(cols, curves, ids)
    maturity = np.asarray(cols["maturity"], dtype=np.float64)
    n = maturity.size
    steps = np.maximum(1, np.rint(maturity * cols["steps_per_year"])).astype(np.int64)
    dt = maturity / steps
    starts = _exclusive(steps + 1)
    total = int(steps.sum()) + n
    owner, m = _each(steps + 1)
    discount = np.empty(total)
    curve = np.asarray(cols["curve"], dtype=np.int64)[owner]
    for c in np.unique(curve):
        rows = curve == c
        discount[rows] = curves[int(c)].discount(m[rows] * dt[owner[rows]])
    face, coupon = np.asarray(cols["face"], np.float64), np.asarray(cols["coupon"], np.float64)
    frequency = np.asarray(cols["frequency"], dtype=np.int64)
    paying = (frequency > 0) & (coupon != 0.0)
    counts = np.where(paying, np.floor(maturity * np.maximum(frequency, 1) + 1e-9) + 1,
                      0).astype(np.int64)
    who, k = _each(counts)
    times = maturity[who] - k / frequency[who]
    who, times = who[times > 1e-12], times[times > 1e-12]
    flows = np.zeros(total)
    np.add.at(flows, starts[who] + np.rint(times / dt[who]).astype(np.int64),
              face[who] * coupon[who] / frequency[who])
    flows[starts + steps] += face
    exercise = np.zeros(total, dtype=np.bool_)
    kind = np.asarray(cols["exercise"], dtype=np.int64)
    first = np.asarray(cols["first_exercise"], np.float64)
    last = np.asarray(cols["last_exercise"], np.float64)
    dated = kind != EXERCISES.index("american")
    counts = np.where(kind == EXERCISES.index("bermudan"),
                      np.floor((last - first) * np.asarray(cols["exercise_frequency"], np.float64)
                               + 1e-9) + 1, 1)
    counts = np.where(dated, counts, 0).astype(np.int64)
    who, k = _each(counts)
    every = np.asarray(cols["exercise_frequency"], np.float64)[who]
    with np.errstate(divide="ignore", invalid="ignore"):   # a european's k is 0, its every any
        times = first[who] + np.where(k > 0, k / every, 0.0)
    exercise[starts[who] + np.clip(np.rint(times / dt[who]).astype(np.int64), 0, steps[who])] = True
    ranged = np.flatnonzero(~dated)
    lo = np.maximum(np.ceil(first[ranged] / dt[ranged] - 1e-9), 0).astype(np.int64)
    hi = np.minimum(np.floor(last[ranged] / dt[ranged] + 1e-9), steps[ranged]).astype(np.int64)
    marks = np.zeros(total + 1, dtype=np.int64)
    np.add.at(marks, starts[ranged] + lo, (hi >= lo).astype(np.int64))
    np.add.at(marks, starts[ranged] + hi + 1, -(hi >= lo).astype(np.int64))
    exercise |= np.cumsum(marks[:-1]) > 0
    a = np.asarray(cols["mean_reversion"], dtype=np.float64)
    sigma = np.asarray(cols["volatility"], dtype=np.float64)
    return HullWhiteParams(
        a=a, sigma=sigma, dt=dt, steps=steps, jmax=jmax_of(a, dt), dr=sigma * np.sqrt(3.0 * dt),
        strike=np.asarray(cols["strike"], dtype=np.float64),
        sign=np.where(np.asarray(cols["call"], dtype=np.bool_), 1.0, -1.0),
        product=np.asarray(cols["product"], dtype=np.int64), starts=starts, flows=flows,
        exercise=exercise, discount=discount)
