"""The static partitioners: contiguous parts in input order that cover every option once; `count`
gives equal counts (differing by at most one), `cost` the smallest largest part any contiguous split
has (checked against a brute-force DP), never over total/parts by more than one option's cost, with
the closest-to-target cuts wherever those reach it. `assign_by_cost` (whole options, any order) is a
permutation plus bounds that restores input order, within 2 % of max(mean, largest option) on the
generated books."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pricer.run.chunks import chunk_grid
from pricer.model.cost import COST_ROWS, EXACT_SUMS, lattice_costs, lattice_nodes
from pricer.tools.generate import generate
from pricer.model.partition import (LPT_GAIN, PARTITIONERS, assign, assign_by_cost, lower_bound,
                              min_bottleneck, option_cost, part_costs, partition,
                              partition_by_cost, partition_by_count, whole_option_bound)


def check_bounds(bounds: np.ndarray, n: int, parts: int) -> None:
    """A valid partition: parts + 1 non-decreasing int bounds from 0 to n (so the parts are
    contiguous, disjoint, in input order, and cover every option exactly once)."""
    assert bounds.shape == (parts + 1,)
    assert np.issubdtype(bounds.dtype, np.integer)
    assert bounds[0] == 0 and bounds[-1] == n
    assert (np.diff(bounds) >= 0).all()
    owner = np.repeat(np.arange(parts), np.diff(bounds))
    assert owner.size == n and (np.diff(owner) >= 0).all()


def closest_cuts(steps: np.ndarray, parts: int) -> np.ndarray:
    """The former partitioner: each cut at the prefix sum closest to k/parts of the total."""
    prefix = np.concatenate(([0.0], np.cumsum(option_cost(steps))))
    targets = prefix[-1] * np.arange(1, parts) / parts
    cuts = np.abs(prefix[None, :] - targets[:, None]).argmin(axis=1)
    return np.maximum.accumulate(np.concatenate(([0], cuts, [steps.size])))


def best_contiguous(steps: np.ndarray, parts: int) -> float:
    """Brute force: the smallest largest part over all contiguous splits (DP over prefixes)."""
    prefix = np.concatenate(([0.0], np.cumsum(option_cost(steps))))
    n = steps.size
    seg = prefix[None, :] - prefix[:, None]           # seg[i, j] = cost of options i:j
    seg[np.tril_indices(n + 1, -1)] = np.inf
    best = seg[0].copy()                              # one part: options 0:j
    for _ in range(parts - 1):
        best = np.minimum(best, np.min(np.maximum(best[:, None], seg), axis=0))
    return float(best[n])


def check_cost_balance(steps: np.ndarray, bounds: np.ndarray, parts: int) -> None:
    cost = option_cost(steps)
    share = cost.sum() / parts
    part_cost = part_costs(steps, bounds)
    slack = cost.max() * (1 + 1e-12)
    assert (part_cost - share <= slack).all(), (part_cost, share, cost.max())
    # the largest part is the smallest any contiguous split reaches, never above the former cuts'
    old = part_costs(steps, closest_cuts(steps, parts)).max()
    assert part_cost.max() == min_bottleneck(steps, parts) <= old
    assert part_cost.max() >= whole_option_bound(steps, parts) >= lower_bound(steps, parts)
    if old == part_cost.max():  # the closest-to-target cuts were optimal: they are kept
        assert np.array_equal(bounds, closest_cuts(steps, parts)), bounds


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


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=40),
       parts=st.integers(min_value=1, max_value=12))
def test_cost_is_the_best_contiguous_split(steps, parts):
    steps = np.array(steps, dtype=np.int64)
    bounds = partition_by_cost(steps, parts)
    check_bounds(bounds, steps.size, parts)
    assert part_costs(steps, bounds).max() == best_contiguous(steps, parts)


def test_cost_beats_closest_cuts_on_skewed_books():
    # the closest cuts put a large option with the small ones; [10 10 10 10] [100] [100] is best
    steps = np.array([10, 10, 10, 10, 100, 100])
    old = part_costs(steps, closest_cuts(steps, 3)).max()
    new = part_costs(steps, partition_by_cost(steps, 3))
    assert new.max() < old and new.max() == best_contiguous(steps, 3)
    assert partition_by_cost(steps, 3).tolist() == [0, 4, 5, 6]
    # a generated skewed book at 256 ranks: the former cuts were 1.06x the bound, these ~1.03x
    steps = generate("skewed", 100_000, seed=0).steps
    bounds = partition_by_cost(steps, 256)
    check_bounds(bounds, steps.size, 256)
    assert part_costs(steps, bounds).max() < part_costs(steps, closest_cuts(steps, 256)).max()


def check_assignment(steps: np.ndarray, parts: int):
    a = assign_by_cost(steps, parts)
    n = steps.size
    assert np.array_equal(np.sort(a.order), np.arange(n))
    check_bounds(a.bounds, n, parts)
    for k in range(parts):  # each part's options in input order
        assert (np.diff(a.order[a.bounds[k]:a.bounds[k + 1]]) > 0).all()
    owner = a.owner()
    assert np.array_equal(owner[a.order], np.repeat(np.arange(parts), np.diff(a.bounds)))
    rows = np.column_stack([a.order, a.order * 2.0])          # gathered part after part
    assert np.array_equal(a.restore(rows)[:, 0], np.arange(n))
    loads = a.costs(steps)
    cost = option_cost(steps)
    assert np.isclose(loads.sum(), cost.sum())
    assert loads.max() <= cost.sum() / parts + cost.max() * (1 + 1e-12)
    return loads


@settings(max_examples=200, deadline=None)
@given(steps=steps_lists, parts=st.integers(min_value=1, max_value=70))
def test_assign_properties(steps, parts):
    check_assignment(np.array(steps, dtype=np.int64), parts)


@pytest.mark.parametrize("dist", ["uniform", "random", "skewed"])
def test_assign_within_two_percent_of_the_bound(dist):
    steps = generate(dist, 250_000, seed=1).steps
    for parts in (1, 3, 16, 128, 1024, 4096):
        loads = check_assignment(steps, parts) if parts <= 128 else assign_by_cost(steps, parts).costs(steps)
        assert loads.max() <= 1.02 * lower_bound(steps, parts), (dist, parts)


def test_whole_option_bound():
    assert whole_option_bound(np.full(10, 1), 4) == 3 * option_cost(np.array([1]))[0]
    steps = np.array([9, 8, 7, 1])
    assert whole_option_bound(steps, 4) == option_cost(steps).max() == lower_bound(steps, 4)


@pytest.mark.parametrize("seed", range(6))
def test_whole_option_bound_is_its_definition(seed):
    """One term per distinct steps value gives the bound's definition, max over k of
    (k + 1)·c[k·parts + 1] of the costs sorted in descending order, and the mean: on books of
    few and of many distinct values (the counting and the sorting path)."""
    rng = np.random.default_rng(seed)
    for _ in range(30):
        n, parts = int(rng.integers(1, 2000)), int(rng.integers(1, 80))
        high = int(rng.choice([2, 60, 10**7]))
        steps = rng.integers(1, high, n)
        cost = np.sort(option_cost(steps))[::-1]
        k = np.arange((n - 1) // parts + 1)
        expected = max(option_cost(steps).sum() / parts, ((k + 1) * cost[k * parts]).max())
        assert whole_option_bound(steps, parts) == expected, (n, parts, high)


def test_assign_keeps_input_order_unless_it_pays():
    """A run's partition (partition.assign): count and cost stay contiguous where cost's best
    contiguous split is near the bound, and cost leaves input order for a > LPT_GAIN gain."""
    uniform = generate("uniform", 10_000, seed=2).steps
    for method in PARTITIONERS:
        a = assign(uniform, 64, method)
        assert a.in_input_order() and np.array_equal(a.bounds, partition(uniform, 64, method))
    skewed = np.full(200, 40)
    skewed[-3:] = 1000                    # the 3 large options side by side, at the end
    a = assign(skewed, 3, "cost")
    assert not a.in_input_order()
    best_contiguous = part_costs(skewed, partition(skewed, 3, "cost")).max()
    assert a.costs(skewed).max() * LPT_GAIN < best_contiguous
    assert a.costs(skewed).max() <= 1.02 * lower_bound(skewed, 3)
    assert assign(skewed, 3, "count").in_input_order()


@pytest.mark.parametrize("dist", ["random", "skewed"])
def test_assign_cost_within_two_percent_of_the_bound(dist):
    steps = generate(dist, 250_000, seed=4).steps
    for parts in (2, 64, 512, 4096):
        a = assign(steps, parts, "cost")
        assert a.costs(steps).max() <= 1.02 * lower_bound(steps, parts), (dist, parts)


def _chunk_grid_by_definition(steps, nodes, rows):
    """chunk_grid's docstring, row by row: a chunk starts where the label max(nodes before the row
    // nodes, row // rows) grows."""
    before = np.concatenate(([0.0], np.cumsum(option_cost(steps))[:-1]))
    label = np.maximum(before // nodes, np.arange(len(steps)) // rows)
    return np.concatenate(([0], np.flatnonzero(np.diff(label)) + 1, [len(steps)]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300),
       st.floats(5.0, 1e7), st.integers(1, 60))
def test_chunk_grid_is_its_definition(steps, nodes, rows):
    """The checkpoint grid (which rows a chunk file holds) judged only at the rows where a chunk
    can start is the grid the definition gives row by row: a resume must find the same chunks."""
    steps = np.array(steps, dtype=np.int64)
    assert np.array_equal(chunk_grid(steps, nodes, rows),
                          _chunk_grid_by_definition(steps, nodes, rows))


@pytest.mark.parametrize("dist", ["random", "skewed"])
def test_lattice_costs_are_the_serial_sums_and_give_the_same_grid(dist):
    """A run's plan sums the lattice nodes a block at a time (cost.lattice_costs) and hands the
    sums to the partition and to chunk_grid: bitwise np.cumsum's sums (across the blocks' edges
    too), the same partition, and the same grid as chunk_grid's own, for both chunk shapes."""
    steps = generate(dist, 50_000 + COST_ROWS // 3, seed=3).steps
    nodes, prefix = lattice_costs(steps)
    assert np.array_equal(nodes, lattice_nodes(steps))
    assert prefix[0] == 0.0 and np.array_equal(prefix[1:], np.cumsum(lattice_nodes(steps)))
    a, b = assign(steps, 4, "cost"), assign(steps, 4, "cost", cost=nodes, prefix=prefix)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.bounds, b.bounds)
    for shape in ((2.0**28, 2**17), (1e8, 1000), (2.0**40, 2**21)):
        assert np.array_equal(chunk_grid(steps, *shape, prefix=prefix), chunk_grid(steps, *shape))


def test_lattice_costs_beyond_exact_sums_are_summed_serially():
    """Nodes whose total reaches 2^53 (where float sums round) are summed as np.cumsum sums
    them, not a block at a time."""
    steps = np.full(3 * COST_ROWS + 5, 3_000_000, dtype=np.int64)    # ~4.5e12 nodes each
    steps[::7] = 12_345
    nodes, prefix = lattice_costs(steps)
    assert prefix[-1] >= EXACT_SUMS
    assert np.array_equal(prefix[1:], np.cumsum(lattice_nodes(steps)))
