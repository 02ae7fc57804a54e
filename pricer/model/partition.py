"""The cost model and the static partitioners.

A partition is an int64 array `bounds` of length parts + 1: part k owns the contiguous options
bounds[k]:bounds[k+1] in input order, so gathering the parts in rank order restores input order.
That is what a run uses (`partition`, pricer/run/option_family.py).

`partition_by_cost` places the cuts so that the largest part is as small as any contiguous split can
make it (the exact min-max bottleneck, found by bisection), and within that bottleneck each cut as
close as possible to k/parts of the total cost. Contiguous parts cannot always get near the bound
max(mean, largest option) that no split of whole options can beat: a few large options that sit
next to each other must share a part (skewed books at hundreds to thousands of ranks: up to ~16 %
over the bound, docs/scaling.md). `assign_by_cost` drops contiguity: each rank gets any set of whole
options (longest-processing-time-first for the large ones, the small ones filling the gaps), returned
as an `Assignment` — a permutation `order` of the options plus `bounds` into it — which is within
~0.5 % of the bound on the generated books.

`assign` is what a run uses (pricer/run/option_family.py): `count` and `cost` as contiguous slices, except
that `cost` switches to `assign_by_cost` where the best contiguous split's largest part is more
than LPT_GAIN over the largest part of that assignment. The caller sends rows `order` to the ranks
and puts the gathered rows back with `Assignment.restore`, so results stay in input order either
way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pricer.model.cost import option_cost

PARTITIONERS = ("cost", "count")
# Small options (cost <= SMALL * mean part cost) are not placed one by one by assign_by_cost but
# poured, in input order, into the parts below the water level: each part then exceeds its level by
# less than one small option.
SMALL = 0.002
# `cost` leaves input order only for a clear gain: a contiguous split is kept unless whole options
# placed by assign_by_cost make the largest part more than 1 % smaller.
LPT_GAIN = 1.01


def part_costs(steps: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Σ cost of each contiguous part bounds[k]:bounds[k+1]."""
    prefix = np.concatenate(([0.0], np.cumsum(option_cost(steps))))
    bounds = np.asarray(bounds)
    return prefix[bounds[1:]] - prefix[bounds[:-1]]


def lower_bound(steps: np.ndarray, parts: int) -> float:
    """max(mean part cost, largest option): no split of whole options into `parts` beats it."""
    cost = option_cost(steps)
    return _lower_bound(cost, cost.sum(), parts)


def _lower_bound(cost: np.ndarray, total: float, parts: int) -> float:
    """lower_bound from the options' costs and their total."""
    return float(max(total / parts, cost.max(initial=0.0)))


def whole_option_bound(steps: np.ndarray, parts: int, total: float | None = None) -> float:
    """A tighter bound for whole options: with costs sorted c1 >= c2 >= ..., some part holds k + 1
    of the k·parts + 1 largest, so the largest part costs at least (k + 1)·c[k·parts + 1] for every
    k (for n equal options: ceil(n / parts)·c); and at least the mean. `total`: the options' total
    cost, where the caller has it."""
    steps = np.asarray(steps, dtype=np.int64)
    if steps.size == 0:
        return 0.0
    total = option_cost(steps).sum() if total is None else total
    # cost grows with steps, so the sorted costs are runs of equal steps; within a run the bound
    # is largest at the run's last k·parts: one term per distinct value rather than per k
    values, ends = _descending_runs(steps)
    last = (ends - 1) // parts
    starts = np.concatenate(([0], ends[:-1]))
    hit = last * parts >= starts                  # runs that hold some k·parts
    return float(max(total / parts, ((last[hit] + 1) * option_cost(values[hit])).max()))


def _descending_runs(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct steps, largest first, and where each one's run ends in the steps sorted in
    descending order. Steps are whole numbers, mostly far fewer distinct ones than options:
    counting them is linear where a sort of a large book dominated rank 0's partition time."""
    if steps.min() < 0 or steps.max() > 4 * steps.size + 65_536:
        values, counts = np.unique(steps, return_counts=True)
    else:
        counts = np.bincount(steps)
        values = np.flatnonzero(counts)
        counts = counts[values]
    return values[::-1], np.cumsum(counts[::-1])


def partition_by_count(n: int, parts: int) -> np.ndarray:
    """Cao (2025)'s static split: equal counts, the first n % parts parts one option larger."""
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


def _parts_needed(prefix: np.ndarray, limit: float, parts: int) -> int:
    """Greedy: how many contiguous parts of cost <= limit cover everything (stops past `parts`)."""
    n, i, k = prefix.size - 1, 0, 0
    while i < n and k <= parts:
        i = int(np.searchsorted(prefix, prefix[i] + limit, side="right")) - 1
        k += 1
    return k if i >= n else parts + 1


def _closest_cuts(prefix: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """For each target, the index whose prefix sum is closest to it (the lower one on ties)."""
    right = np.searchsorted(prefix, targets, side="left")
    left = np.maximum(right - 1, 0)
    right = np.minimum(right, prefix.size - 1)
    return np.where((targets - prefix[left]) <= (prefix[right] - targets), left, right)


def min_bottleneck(steps: np.ndarray, parts: int, upper: float | None = None) -> float:
    """The smallest possible cost of the largest part over all contiguous splits into `parts`.
    Costs are whole numbers ((N+1)(N+2) is even) and prefix sums exact below 2^53, so the
    bisection runs on whole numbers from `whole_option_bound` up to the largest part of a known
    split (`upper`) or that bound plus the largest option (always feasible: greedy parts then each
    exceed the mean)."""
    cost = option_cost(steps)
    return _min_bottleneck(steps, parts, cost, _prefix(cost), upper)


def _prefix(cost: np.ndarray) -> np.ndarray:
    """[0, c0, c0 + c1, ...]: the prefix sums of the costs (exact below 2^53)."""
    prefix = np.empty(cost.size + 1)
    prefix[0] = 0.0
    np.cumsum(cost, out=prefix[1:])
    return prefix


def _min_bottleneck(steps, parts: int, cost, prefix, upper: float | None) -> float:
    """min_bottleneck with the options' costs and their prefix sums given."""
    if cost.size == 0:
        return 0.0
    lo = np.ceil(whole_option_bound(steps, parts, prefix[-1]))
    hi = lo + cost.max() if upper is None else min(float(upper), lo + cost.max())
    if hi <= lo or _parts_needed(prefix, lo, parts) <= parts:
        return float(min(lo, hi))
    while hi - lo > 1:   # invariant: lo infeasible, hi feasible
        mid = np.floor((lo + hi) / 2)
        if _parts_needed(prefix, mid, parts) <= parts:
            hi = mid
        else:
            lo = mid
    return float(hi)


def partition_by_cost(steps: np.ndarray, parts: int) -> np.ndarray:
    """Contiguous parts with the smallest possible largest part (`min_bottleneck`), each cut as
    close to k/parts of the total as that allows. Where the plain closest-to-target cuts already
    reach the bottleneck (uniform and most random books), they are the answer; so no part exceeds
    its equal share by more than one option's cost, and equal options get equal counts."""
    if parts == 1:
        return np.array([0, len(steps)], dtype=np.int64)
    cost = option_cost(steps)
    return _partition_by_cost(steps, parts, cost, _prefix(cost))


def _partition_by_cost(steps, parts: int, cost, prefix) -> np.ndarray:
    """partition_by_cost with the options' costs and their prefix sums given."""
    n = cost.size
    targets = prefix[-1] * np.arange(1, parts) / parts
    cuts = _closest_cuts(prefix, targets)
    bounds = np.maximum.accumulate(np.concatenate(([0], cuts, [n])).astype(np.int64))
    if n == 0 or parts == 1:
        return bounds
    largest = (prefix[bounds[1:]] - prefix[bounds[:-1]]).max()
    limit = _min_bottleneck(steps, parts, cost, prefix, upper=largest)
    if largest <= limit:
        return bounds
    # latest[k]: the smallest cut k from which the rest fits in parts - k parts of cost <= limit
    # (greedy from the right); each cut is then the target's closest index within
    # [latest[k], furthest index whose part from the previous cut still fits], a non-empty range
    # whenever the previous cut respected its own lower end.
    latest = np.zeros(parts + 1, dtype=np.int64)
    latest[parts] = n
    for k in range(parts, 0, -1):
        latest[k - 1] = int(np.searchsorted(prefix, prefix[latest[k]] - limit, side="left"))
    bounds = np.empty(parts + 1, dtype=np.int64)
    bounds[0], bounds[parts] = 0, n
    for k in range(1, parts):
        furthest = int(np.searchsorted(prefix, prefix[bounds[k - 1]] + limit, side="right")) - 1
        bounds[k] = min(max(int(cuts[k - 1]), int(latest[k])), furthest)
    return bounds


def partition(steps: np.ndarray, parts: int, method: str = "cost") -> np.ndarray:
    if method == "cost":
        return partition_by_cost(steps, parts)
    if method == "count":
        return partition_by_count(int(np.asarray(steps).size), parts)
    raise ValueError(f"unknown partition method {method!r}; known: {', '.join(PARTITIONERS)}")


@dataclass
class Assignment:
    """Whole options on parts, not necessarily contiguous: part k owns the options
    order[bounds[k]:bounds[k+1]] (each part's options in input order)."""
    order: np.ndarray    # a permutation of range(n), int64
    bounds: np.ndarray   # parts + 1 non-decreasing int64 bounds into `order`
    identity: bool = False   # order is known to be range(n)

    @classmethod
    def contiguous(cls, bounds: np.ndarray) -> "Assignment":
        return cls(order=np.arange(int(bounds[-1]), dtype=np.int64),
                   bounds=np.asarray(bounds, np.int64), identity=True)

    def in_input_order(self) -> bool:
        """True when every part is a contiguous slice in input order (no permutation to undo)."""
        return self.identity or bool(np.array_equal(self.order, np.arange(self.order.size)))

    def owner(self) -> np.ndarray:
        """The part of each option, in input order."""
        owner = np.empty(self.order.size, dtype=np.int64)
        owner[self.order] = np.repeat(np.arange(self.bounds.size - 1), np.diff(self.bounds))
        return owner

    def costs(self, steps: np.ndarray) -> np.ndarray:
        return np.bincount(self.owner(), weights=option_cost(steps), minlength=self.bounds.size - 1)

    def restore(self, rows: np.ndarray) -> np.ndarray:
        """Rows gathered part after part (row i belongs to option order[i]) back in input order."""
        out = np.empty_like(rows)
        out[self.order] = rows
        return out


def _lpt(cost: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Longest processing time first: each option (costs in decreasing order) to the part with the
    least load so far (`load` is updated). Done in rounds: the next m options go to the m least
    loaded parts at once as long as LPT one by one would choose the same parts."""
    n, parts = cost.size, load.size
    owner = np.empty(n, dtype=np.int64)
    i = 0
    while i < n:
        rank = np.argsort(load, kind="stable")
        block = cost[i:i + parts]
        m = block.size
        after = np.minimum.accumulate(load[rank[:m]] + block)
        # option i + j goes to rank[j] while that part is still the least loaded one
        stop = np.flatnonzero(load[rank[1:m]] > after[:m - 1])
        m = m if stop.size == 0 else int(stop[0]) + 1
        owner[i:i + m] = rank[:m]
        load[rank[:m]] += block[:m]
        i += m
    return owner


def assign_by_cost(steps: np.ndarray, parts: int, small: float = SMALL) -> Assignment:
    """Whole options on `parts` parts with a largest part near max(mean, largest option): the
    options costing more than `small` x the mean part by LPT, then the others, in input order,
    poured into the parts below the common level they can fill (each part within one small option
    of it)."""
    cost = option_cost(steps)
    n = cost.size
    owner = np.zeros(n, dtype=np.int64)
    load = np.zeros(parts)
    if n:
        large = cost > small * cost.sum() / parts
        big = np.flatnonzero(large)
        big = big[np.argsort(-cost[big], kind="stable")]
        owner[big] = _lpt(cost[big], load)
        rest = np.flatnonzero(~large)
        if rest.size:
            owner[rest] = _pour(cost[rest], load)
    order = np.argsort(owner, kind="stable").astype(np.int64)
    bounds = np.concatenate(([0], np.cumsum(np.bincount(owner, minlength=parts)))).astype(np.int64)
    return Assignment(order=order, bounds=bounds)


def assign(steps: np.ndarray, parts: int, method: str = "cost",
           cost: np.ndarray | None = None, prefix: np.ndarray | None = None) -> Assignment:
    """The options each of `parts` ranks prices (module docstring): `count` and `cost` contiguous,
    `cost` leaving input order where assign_by_cost does better by more than LPT_GAIN. `cost`:
    the options' option_cost, `prefix` its prefix sums (cost.lattice_costs), where the caller has
    them."""
    if method != "cost" or parts == 1 or len(steps) == 0:
        return Assignment.contiguous(partition(steps, parts, method))
    cost = option_cost(steps) if cost is None else cost   # once, for the split and the bound
    prefix = _prefix(cost) if prefix is None else prefix
    contiguous = Assignment.contiguous(_partition_by_cost(steps, parts, cost, prefix))
    largest = (prefix[contiguous.bounds[1:]] - prefix[contiguous.bounds[:-1]]).max()
    if largest <= LPT_GAIN * _lower_bound(cost, prefix[-1], parts):
        return contiguous    # no assignment of whole options can gain LPT_GAIN here
    lpt = assign_by_cost(steps, parts)
    return lpt if largest > LPT_GAIN * lpt.costs(steps).max() else contiguous


def _pour(cost: np.ndarray, load: np.ndarray) -> np.ndarray:
    """The parts of small options (in input order) that raise the least loaded parts to one level."""
    parts = load.size
    total = cost.sum()
    low = np.sort(load)
    # the level L with Σ max(0, L - load) = total: the first k parts below it, L = (total + Σ)/k
    levels = (total + np.cumsum(low)) / np.arange(1, parts + 1)
    fits = np.append(levels[:-1] <= low[1:], True)
    level = levels[int(np.argmax(fits))]
    rank = np.argsort(load, kind="stable")
    edges = np.cumsum(np.maximum(level - load[rank], 0.0))[:-1]
    prefix = np.concatenate(([0.0], np.cumsum(cost)))
    cuts = np.concatenate(([0], _closest_cuts(prefix, edges), [cost.size]))
    cuts = np.maximum.accumulate(cuts)
    return rank[np.repeat(np.arange(parts), np.diff(cuts))]
