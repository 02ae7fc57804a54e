"""The `batch` backend's schedule (pricer.engines.batch_plan), without a GPU: classes, sorting,
chunks, launches and the order the prices go back in."""

from __future__ import annotations

import numpy as np
import pytest

from pricer.engines.batch_plan import (AMERICAN_FLAG, CALL_FLAG, CAPACITY, CLASSES, MAX_STEPS,
                                       class_of, fill_columns, plan)
from pricer.lattice import lattice_parameters


def test_classes_grow_and_every_width_has_the_smallest_fitting_class():
    assert np.all(np.diff(CAPACITY) > 0)
    steps = np.arange(1, MAX_STEPS + 1)
    cls = class_of(steps)
    assert np.all(CAPACITY[cls] >= steps + 1)                      # holds the option
    assert np.all((cls == 0) | (CAPACITY[np.maximum(cls - 1, 0)] < steps + 1))  # the smallest that does


@pytest.mark.parametrize("steps, expected", [(1, (1, 1)), (127, (1, 1)), (128, (1, 2)), (1023, (1, 8)),
                                             (1024, (2, 5)), (2047, (2, 8)), (2048, (4, 5)),
                                             (8191, (8, 8)), (8192, (16, 5)), (MAX_STEPS, (16, 8))])
def test_class_edges(steps, expected):
    assert CLASSES[int(class_of([steps])[0])] == expected


def test_steps_outside_the_classes_are_refused():
    for bad in (0, MAX_STEPS + 1):
        with pytest.raises(ValueError):
            class_of([5, bad])


def test_plan_sorts_by_steps_descending_and_restores_order(rng):
    steps = rng.integers(1, MAX_STEPS + 1, 5000)
    p = plan(steps, chunk_options=700)
    assert sorted(p.order.tolist()) == list(range(steps.size))     # a permutation
    sorted_steps = steps[p.order]
    assert np.all(np.diff(sorted_steps) <= 0)                      # largest lattices first
    assert np.all(np.diff(p.classes) <= 0)                         # so classes largest first
    np.testing.assert_array_equal(p.classes, class_of(sorted_steps))
    ties = np.flatnonzero(np.diff(sorted_steps) == 0)              # stable: equal N keep input order
    assert np.all(p.order[ties] < p.order[ties + 1])
    prices = rng.random(steps.size)
    np.testing.assert_array_equal(p.restore(prices[p.order]), prices)


def test_chunks_cover_everything_once_and_launches_cover_each_chunk(rng):
    steps = rng.integers(1, 3000, 2345)
    p = plan(steps, chunk_options=500)
    assert [c.size for c in p.chunks] == [500, 500, 500, 500, 345]
    assert p.chunks[0].lo == 0 and p.chunks[-1].hi == steps.size
    assert all(a.hi == b.lo for a, b in zip(p.chunks, p.chunks[1:]))
    for c in p.chunks:
        covered = [(ln.lo, ln.hi) for ln in c.launches]
        assert covered[0][0] == 0 and covered[-1][1] == c.size
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
        for ln in c.launches:                                       # one class per launch
            assert set(p.classes[c.lo + ln.lo:c.lo + ln.hi].tolist()) == {ln.cls}
        assert len({ln.cls for ln in c.launches}) == len(c.launches)


def test_one_chunk_when_it_fits_and_empty_portfolio():
    p = plan(np.array([5, 500, 50]), chunk_options=10)
    assert len(p.chunks) == 1 and p.chunks[0].size == 3
    assert plan(np.array([], dtype=np.int64)).chunks == ()
    with pytest.raises(ValueError):
        plan(np.array([5]), chunk_options=0)


def test_columns_carry_the_lattice_numbers_and_flags(rng):
    n = 6
    cols = dict(spot=rng.uniform(50, 150, n), strike=rng.uniform(50, 150, n), maturity=np.ones(n),
                volatility=np.full(n, 0.3), rate=np.full(n, 0.02), dividend=np.zeros(n),
                steps=np.arange(1, n + 1) * 10, call=np.array([1, 0, 1, 0, 1, 0], bool),
                american=np.array([1, 1, 0, 0, 1, 0], bool))
    params = lattice_parameters(cols)
    index = np.array([4, 0, 3])
    columns = np.full((8, 3), np.nan)
    fill_columns(params, index, columns)
    for k, name in enumerate(("spot", "strike", "log_up", "log_down", "pu", "pd")):
        np.testing.assert_array_equal(columns[k], getattr(params, name)[index])
    np.testing.assert_array_equal(columns[6], [50, 10, 40])
    np.testing.assert_array_equal(columns[7], [CALL_FLAG + AMERICAN_FLAG, CALL_FLAG + AMERICAN_FLAG, 0])
