"""Stage 3: the cost model and the static partitioners.

A partition is an int64 array `bounds` of length parts + 1: part k owns the contiguous options
bounds[k]:bounds[k+1] in input order, so gathering the parts in rank order restores input order.
"""

from __future__ import annotations

import numpy as np

from pricer.portfolio import lattice_nodes

PARTITIONERS = ("cost", "count")


def option_cost(steps: np.ndarray) -> np.ndarray:
    """Work per option: its lattice nodes, (N+1)(N+2)/2 ≈ N²/2."""
    return lattice_nodes(steps)


def partition_by_count(n: int, parts: int) -> np.ndarray:
    """The seed's split: equal counts, the first n % parts parts one option larger."""
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


def partition_by_cost(steps: np.ndarray, parts: int) -> np.ndarray:
    """Contiguous parts with (nearly) equal Σ cost: each cut is placed at the prefix sum closest
    to k/parts of the total, so no part exceeds its share by more than one option's cost."""
    cost = option_cost(steps)
    prefix = np.concatenate(([0.0], np.cumsum(cost)))
    targets = prefix[-1] * np.arange(1, parts) / parts
    right = np.searchsorted(prefix, targets, side="left")
    left = np.maximum(right - 1, 0)
    right = np.minimum(right, cost.size)
    closer_left = (targets - prefix[left]) <= (prefix[right] - targets)
    cuts = np.where(closer_left, left, right)
    bounds = np.concatenate(([0], cuts, [cost.size])).astype(np.int64)
    return np.maximum.accumulate(bounds)


def partition(steps: np.ndarray, parts: int, method: str = "cost") -> np.ndarray:
    if method == "cost":
        return partition_by_cost(steps, parts)
    if method == "count":
        return partition_by_count(int(np.asarray(steps).size), parts)
    raise ValueError(f"unknown partition method {method!r}; known: {', '.join(PARTITIONERS)}")
