"""A book of Hull–White instruments as the family's engines take it (HullWhiteParams: struct of
arrays and the per-step flat arrays of Pawlak et al. (2021)), built in one vectorised pass from
its columns (BOND_COLUMNS: the file's /bond_options, docs/formats.md) after the columns' checks
(check_columns, with the bounds that keep every tree within FP64 and memory). The trees and the
instruments themselves are pricer/model/hw1f.py's; the reference prices each instrument from the
same definitions (hw1f.cash_flows, hw1f.exercise_steps)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.errors import InputError, first_ids
from pricer.model.hw1f import (DATE_SLACK, EXERCISES, JMAX_FACTOR, MAX_RATE, PRODUCTS, SPACING,
                               TODAY, jmax_of, spacing_of, steps_of)

MAX_TREE_STEPS = 1_000_000  # bounds on one instrument's tree (its per-step arrays, its scratch)
MAX_JMAX = 50_000
# bounds that keep every product of the induction within FP64 (a curve's discounts, the flows)
MAX_MATURITY = 500.0        # years: e^{+-MAX_RATE * MAX_MATURITY} within FP64
MAX_AMOUNT = 1e15           # face and |strike|
MAX_MEAN_REVERSION = 100.0
PRODUCT_CODES = {name: k for k, name in enumerate(PRODUCTS)}


@dataclass(frozen=True)
class HullWhiteParams:
    """Everything the family's engines need per instrument (struct of arrays), and per step of
    each instrument's tree in flat arrays: instrument k's steps 0 .. steps[k] are entries
    starts[k] .. starts[k] + steps[k] of `flows`, `exercise` and `discount` (Pawlak et al. (2021)'s
    expanded arrays, offsets by an exclusive scan of the heights)."""
    a: np.ndarray
    sigma: np.ndarray
    dt: np.ndarray
    steps: np.ndarray       # int64: the tree's height
    jmax: np.ndarray        # int64: width 2 jmax + 1
    dr: np.ndarray          # the node spacing, hw1f.spacing_of(a, sigma, dt, spacing)
    strike: np.ndarray
    face: np.ndarray        # the redemption, which an exercise at maturity is compared with
    sign: np.ndarray        # +1 call, -1 put
    product: np.ndarray     # int64: PRODUCT_CODES
    starts: np.ndarray      # int64
    flows: np.ndarray | None     # the bond's payments at each step
    exercise: np.ndarray | None  # bool: whether the option may be exercised at each step
    discount: np.ndarray | None  # P(0, m dt) from the instrument's curve
    schedule: tuple = ()    # fill_steps' arguments after dt: what the per-step arrays follow from
                            # (None above where tree_parameters left them to the engine)
    spacing: str = SPACING  # the book's hw1f.SPACINGS, which dr follows (for the provenance)

    @property
    def total_steps(self) -> int:
        """Entries of the per-step arrays: every instrument's steps + 1."""
        return int(self.starts[-1] + self.steps[-1] + 1) if self.steps.size else 0

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


INTEGER_COLUMNS = ("frequency", "exercise", "product", "curve")


def parameters(instruments, a, sigma, steps_per_year, curves,
               spacing: str = SPACING) -> HullWhiteParams:
    """The HullWhiteParams of a list of BondOption (columns_of) on one curve or a list of them
    (one per instrument), the trees spaced by `spacing` (hw1f.SPACINGS)."""
    if isinstance(curves, (list, tuple)):
        return tree_parameters(columns_of(instruments, a, sigma, steps_per_year,
                                          np.arange(len(instruments))), list(curves),
                               spacing=spacing)
    return tree_parameters(columns_of(instruments, a, sigma, steps_per_year), [curves],
                           spacing=spacing)


def tree_shapes(cols: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, j_max, tree nodes a sweep) of each instrument (float64) from the columns it
    follows from (maturity, steps_per_year, mean_reversion) without building the trees: the
    run's cost model. A row whose tree breaks a bound (check_columns) or is not a number gets
    0 steps and 1 node: the rows' own checks refuse or skip it."""
    maturity = np.asarray(cols["maturity"], dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        steps = steps_of(maturity, np.asarray(cols["steps_per_year"], dtype=np.float64))
        jmax = np.maximum(1.0, np.ceil(JMAX_FACTOR / (np.asarray(cols["mean_reversion"],
                                                                  np.float64) * (maturity / steps))))
        levels = steps + 1.0
        growing = np.minimum(levels, jmax)
        nodes = growing * growing + (levels - growing) * (2.0 * jmax + 1.0)
        ok = (np.isfinite(nodes) & (maturity > 0.0) & (steps >= 1.0) & (steps <= MAX_TREE_STEPS)
              & (jmax <= MAX_JMAX))
    return np.where(ok, steps, 0.0), np.where(ok, jmax, 0.0), np.where(ok, nodes, 1.0)


def _exclusive(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _each(counts: np.ndarray):
    """(owner, k): for every instrument i, counts[i] entries (i, 0 .. counts[i] - 1)."""
    owner = np.repeat(np.arange(counts.size), counts)
    return owner, np.arange(owner.size) - np.repeat(_exclusive(counts), counts)


def _rules(cols: dict, curves: list) -> list:
    """Every rule a book's columns (BOND_COLUMNS) must keep: (column, rows that break it, why),
    in the order check_columns applies them; a row's status (statuses) is its first broken
    rule's number, counted from 1."""
    def col(name):
        return np.asarray(cols[name], dtype=np.float64)

    kind = np.asarray(cols["exercise"])
    first, last, maturity = col("first_exercise"), col("last_exercise"), col("maturity")
    dated = kind != EXERCISES.index("european")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        steps = steps_of(maturity, col("steps_per_year"))
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
            ("call", ~np.isin(np.asarray(cols["call"], dtype=np.float64), (0.0, 1.0)),
             "must be true or false (1 or 0)"),
        ]
    return [(column, np.asarray(bad, dtype=bool), why) for column, bad, why in rules]


# a row's status: 0 priced; skipped (--invalid skip), the number of the first rule it breaks
# (_rules' order)
REASONS = {0: "priced", **{k + 1: f"{column} {why}" for k, (column, _, why) in enumerate(_rules(
    {name: np.zeros(0, dtype=np.int64 if name in INTEGER_COLUMNS else np.float64)
     for name in BOND_COLUMNS}, []))}}


# a row whose tree gave no finite value (a run refuses it, or skips it with --invalid skip)
NO_VALUE = max(REASONS) + 1
REASONS[NO_VALUE] = "gives no finite value on its tree"


def statuses(cols: dict, curves: list) -> np.ndarray:
    """Each row's status (int8): 0 where no rule is broken, else its first broken rule's code
    (REASONS)."""
    n = int(np.shape(cols["maturity"])[0])
    out = np.zeros(n, dtype=np.int8)
    for code, (_, bad, _) in reversed(list(enumerate(_rules(cols, curves), start=1))):
        out[bad] = code
    return out


def check_columns(cols: dict, curves: list, ids: np.ndarray | None = None) -> None:
    """A book's columns (BOND_COLUMNS) that no tree can price, refused by column and ids
    (InputError), rule by rule."""
    n = int(np.shape(cols["maturity"])[0])
    ids = np.arange(n) if ids is None else np.asarray(ids)
    for column, bad, why in _rules(cols, curves):
        if bad.any():
            raise InputError(f"bond_options: {column} {why}; instrument id(s) "
                             f"{first_ids(ids, bad)} (first value "
                             f"{np.asarray(cols[column])[bad][0].tolist()!r})", column=column,
                             ids=ids[bad])


BERMUDAN, AMERICAN = EXERCISES.index("bermudan"), EXERCISES.index("american")


@njit(cache=True, parallel=True, nogil=True)
def fill_steps(starts, steps, dt, curve, times, rates, bounds, face, coupon, frequency,
               maturity, kind, first, last, every, flows, exercise, discount):
    """Every instrument's per-step arrays (HullWhiteParams), an instrument a thread at a time:
    the discounts P(0, m dt) of its curve (YieldCurve.discount: zero rates interpolated linearly,
    flat beyond the ends), its cash flows (coupons on their nearest steps after today, summed
    where two meet, then the face at maturity: hw1f.cash_flows) and its exercise steps
    (hw1f.exercise_steps)."""
    for i in prange(starts.size):
        lo, n, h = starts[i], steps[i], dt[i]
        c = curve[i]
        xs, ys = times[bounds[c]:bounds[c + 1]], rates[bounds[c]:bounds[c + 1]]
        last_point, j = xs.size - 1, 0
        for m in range(n + 1):
            t = m * h
            # np.interp's arithmetic, its segment found by walking (t grows with m)
            while j < last_point and xs[j + 1] <= t:
                j += 1
            if t < xs[0]:
                r = ys[0]
            elif j == last_point:
                r = ys[last_point]
            else:
                r = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (t - xs[j]) + ys[j]
            discount[lo + m] = np.exp(-r * t)
            flows[lo + m] = 0.0
            exercise[lo + m] = False
        f = frequency[i]
        if f > 0 and coupon[i] != 0.0:
            amount = face[i] * coupon[i] / f
            for k in range(int(np.floor(maturity[i] * f + DATE_SLACK)) + 1):
                t = maturity[i] - k / f
                if t > TODAY:
                    flows[lo + max(1, int(np.rint(t / h)))] += amount   # after today
        flows[lo + n] += face[i]
        if kind[i] == AMERICAN:
            a = max(int(np.ceil(first[i] / h - DATE_SLACK)), 0)
            b = min(int(np.floor(last[i] / h + DATE_SLACK)), n)
            for m in range(a, b + 1):
                exercise[lo + m] = True
        else:
            dates = int(np.floor((last[i] - first[i]) * every[i] + DATE_SLACK)) + 1 \
                if kind[i] == BERMUDAN else 1
            for k in range(dates):
                t = first[i] + (k / every[i] if k > 0 else 0.0)
                # a date after today on its nearest step after today, as a coupon
                after = 1 if t > TODAY else 0
                exercise[lo + min(max(int(np.rint(t / h)), after), n)] = True


class StepBuffers:
    """Per-step arrays reused from one tree_parameters call to the next (grown, never shrunk):
    a run's chunks fill the same pages instead of fresh ones (whose first touch, a page fault a
    page, costs as much as the fill). A call's HullWhiteParams hold views of them, valid until
    the next call."""

    def __init__(self):
        self.flows = self.exercise = self.discount = np.empty(0)

    def arrays(self, total: int):
        if self.flows.size < total:
            size = total * 5 // 4
            self.flows, self.discount = np.empty(size), np.empty(size)
            self.exercise = np.empty(size, dtype=np.bool_)
        return self.flows[:total], self.exercise[:total], self.discount[:total]


def tree_parameters(cols: dict, curves: list, ids: np.ndarray | None = None,
                    buffers: StepBuffers | None = None, fill: bool = True,
                    spacing: str = SPACING) -> HullWhiteParams:
    """The trees of a book given as columns (BOND_COLUMNS; the dates and flows as `price` places
    them: each on its nearest step, one after today on its nearest after today), vectorised over
    the book; bad columns refused first (check_columns). `buffers`: the per-step arrays' storage
    (StepBuffers), else new arrays; fill=False leaves them to the engine (the `schedule`: a GPU
    fills them in its memory, cuda/trinomial.cu's hw_fill, as fill_steps does here). `spacing`:
    the trees' node spacing dr (hw1f.SPACINGS, hw1f.spacing_of), one for the whole book; the
    engines take dr as given."""
    spacing_of(0.1, 0.01, 0.1, spacing)     # an unknown spacing refused before any work
    check_columns(cols, curves, ids)
    maturity = np.asarray(cols["maturity"], dtype=np.float64)
    n = maturity.size
    steps = steps_of(maturity, np.asarray(cols["steps_per_year"], np.float64)).astype(np.int64)
    dt = maturity / steps
    starts = _exclusive(steps + 1)
    total = int(steps.sum()) + n
    index = np.asarray(cols["curve"], dtype=np.int64)
    used = np.unique(index)
    points = [curves[int(c)] for c in used]
    curve_at = np.zeros(len(curves), dtype=np.int64)    # a used curve's slot among `points`
    curve_at[used] = np.arange(used.size)
    bounds = _exclusive(np.array([c.times.size for c in points] + [0], dtype=np.int64))
    schedule = (curve_at[index], np.concatenate([c.times for c in points] + [np.zeros(0)]),
                np.concatenate([c.rates for c in points] + [np.zeros(0)]), bounds,
                np.asarray(cols["face"], np.float64), np.asarray(cols["coupon"], np.float64),
                np.asarray(cols["frequency"], dtype=np.int64), maturity,
                np.asarray(cols["exercise"], dtype=np.int64),
                np.asarray(cols["first_exercise"], np.float64),
                np.asarray(cols["last_exercise"], np.float64),
                np.asarray(cols["exercise_frequency"], np.float64))
    flows = exercise = discount = None
    if fill:
        flows, exercise, discount = (buffers or StepBuffers()).arrays(total)
        fill_steps(starts, steps, dt, *schedule, flows, exercise, discount)
    a = np.asarray(cols["mean_reversion"], dtype=np.float64)
    sigma = np.asarray(cols["volatility"], dtype=np.float64)
    return HullWhiteParams(
        a=a, sigma=sigma, dt=dt, steps=steps, jmax=jmax_of(a, dt),
        dr=np.asarray(spacing_of(a, sigma, dt, spacing), dtype=np.float64),
        strike=np.asarray(cols["strike"], dtype=np.float64),
        face=np.asarray(cols["face"], dtype=np.float64),
        sign=np.where(np.asarray(cols["call"], dtype=np.bool_), 1.0, -1.0),
        product=np.asarray(cols["product"], dtype=np.int64), starts=starts, flows=flows,
        exercise=exercise, discount=discount, schedule=schedule, spacing=spacing)
