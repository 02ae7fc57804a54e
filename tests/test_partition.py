"""The static partitioners: contiguous parts in input order that cover every option once; `count`
gives equal counts (differing by at most one), `cost` gives parts whose Σ (N+1)(N+2)/2 is within one
option's cost of total/parts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pricer.partition import (PARTITIONERS, option_cost, partition, partition_by_cost,
                              partition_by_count)


def check_bounds(bounds: np.ndarray, n: int, parts: int) -> None:
    """A valid partition: parts + 1 non-decreasing int bounds from 0 to n (so the parts are
    contiguous, disjoint, in input order, and cover every option exactly once)."""
    assert bounds.shape == (parts + 1,)
    assert np.issubdtype(bounds.dtype, np.integer)
    assert bounds[0] == 0 and bounds[-1] == n
    assert (np.diff(bounds) >= 0).all()
    owner = np.repeat(np.arange(parts), np.diff(bounds))
    assert owner.size == n and (np.diff(owner) >= 0).all()


def check_cost_balance(steps: np.ndarray, bounds: np.ndarray, parts: int) -> None:
    cost = option_cost(steps)
    share = cost.sum() / parts
    prefix = np.concatenate(([0.0], np.cumsum(cost)))
    part_cost = prefix[bounds[1:]] - prefix[bounds[:-1]]
    slack = cost.max() * (1 + 1e-12)
    assert (np.abs(part_cost - share) <= slack).all(), (part_cost, share, cost.max())
    # and each cut sits at the prefix sum closest to its target k/parts of the total
    targets = prefix[-1] * np.arange(1, parts) / parts
    best = np.abs(prefix[None, :] - targets[:, None]).min(axis=1)
    got = np.abs(prefix[bounds[1:-1]] - targets)
    assert (got <= best + 1e-9 * prefix[-1]).all(), (bounds, got, best)


def test_option_cost_is_lattice_nodes():
    assert option_cost(np.array([1, 2, 10, 20_000])).tolist() == [3, 6, 66, 20001 * 20002 / 2]


@pytest.mark.parametrize("n,parts", [(10, 3), (9, 3), (1, 1), (7, 7), (100, 8)])
def test_count_equal_sizes(n, parts):
    bounds = partition_by_count(n, parts)
    check_bounds(bounds, n, parts)
    sizes = np.diff(bounds)
    assert sizes.max() - sizes.min() <= 1
    assert (sizes[:-1] >= sizes[1:]).all()  # the first n % parts parts carry the extra option


def test_count_more_parts_than_options():
    bounds = partition_by_count(2, 5)
    check_bounds(bounds, 2, 5)
    assert np.diff(bounds).tolist() == [1, 1, 0, 0, 0]


def test_cost_balances_heterogeneous_sizes():
    # one huge option and many small ones: the huge one gets (nearly) a part of its own
    steps = np.array([10_000] + [100] * 300)
    bounds = partition_by_cost(steps, 2)
    check_bounds(bounds, steps.size, 2)
    assert bounds[1] == 1
    check_cost_balance(steps, bounds, 2)


def test_cost_equal_sizes_is_equal_counts():
    steps = np.full(12, 500)
    assert np.array_equal(np.diff(partition_by_cost(steps, 4)), [3, 3, 3, 3])


def test_cost_differs_from_count():
    steps = np.array([4000, 4000, 10, 10, 10, 10, 10, 10])
    count, cost = partition(steps, 2, "count"), partition(steps, 2, "cost")
    assert count.tolist() == [0, 4, 8]
    assert cost.tolist() == [0, 1, 8]


@pytest.mark.parametrize("n,parts", [(1, 3), (2, 3), (3, 8), (5, 64)])
def test_cost_more_parts_than_options(n, parts, rng):
    steps = rng.integers(1, 5000, n)
    bounds = partition_by_cost(steps, parts)
    check_bounds(bounds, n, parts)
    check_cost_balance(steps, bounds, parts)
    # equal options: one per part, the rest of the parts empty
    bounds = partition_by_cost(np.full(n, int(steps[0])), parts)
    check_bounds(bounds, n, parts)
    assert (np.diff(bounds) <= 1).all() and (np.diff(bounds) == 1).sum() == n


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown partition method 'random'"):
        partition(np.array([1, 2, 3]), 2, "random")
    assert set(PARTITIONERS) == {"cost", "count"}


steps_lists = st.lists(st.integers(min_value=1, max_value=1_000_000), min_size=1, max_size=300)


@settings(max_examples=300, deadline=None)
@given(steps=steps_lists, parts=st.integers(min_value=1, max_value=70))
def test_cost_properties(steps, parts):
    steps = np.array(steps, dtype=np.int64)
    bounds = partition(steps, parts, "cost")
    check_bounds(bounds, steps.size, parts)
    check_cost_balance(steps, bounds, parts)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=1, max_value=10_000), parts=st.integers(min_value=1, max_value=200))
def test_count_properties(n, parts):
    bounds = partition(np.ones(n, dtype=np.int64), parts, "count")
    check_bounds(bounds, n, parts)
    sizes = np.diff(bounds)
    assert sizes.max() - sizes.min() <= 1
