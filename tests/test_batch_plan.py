"""The `batch` backend's schedule (pricer.engines.gpu.batch_plan), without a GPU: classes, chunks,
the sorted order and its launches, the kernel's input as the host lays it out
(pricer.engines.gpu.batch_layout), and the -D options that state that layout to cuda/batch.cu."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pricer.engines.gpu import batch_layout
from pricer.engines.gpu.batch_layout import (FLOAT_FIELDS, INPUT_BYTES_PER_OPTION, KEY_BINS,
                                             MAX_STEPS, NODES_PER_LANE, WIDTH_MARGIN, defines,
                                             fill_flags, fill_floats, fill_input, input_views,
                                             order_span)
from pricer.engines.gpu.batch_plan import (CAPACITY, CLASSES, KERNELS, WORK_ORDER_ROWS, Launch,
                                           chunk_bounds, chunk_size, class_of, counted_schedule,
                                           heaviest_first, schedule, widest_payoff, width_keys)
from pricer.engines.gpu.runtime import cuda_source_dir
from pricer.model.lattice import FLOAT_ROWS, lattice_parameters


def test_classes_grow_and_every_width_has_the_smallest_fitting_class():
    assert np.all(np.diff(CAPACITY) > 0)
    steps = np.arange(1, MAX_STEPS + 1)
    cls = class_of(steps)
    assert np.all(CAPACITY[cls] >= steps)                          # holds the option
    assert np.all((cls == 0) | (CAPACITY[np.maximum(cls - 1, 0)] < steps))  # the smallest that does


@pytest.mark.parametrize("steps, expected", [(1, (1, 1)), (128, (1, 1)), (129, (1, 2)), (1024, (1, 8)),
                                             (1025, (2, 5)), (2048, (2, 8)), (2049, (4, 5)),
                                             (8192, (8, 8)), (8193, (16, 5)), (MAX_STEPS, (16, 8))])
def test_class_edges(steps, expected):
    assert CLASSES[int(class_of([steps])[0])] == expected


def test_steps_outside_the_classes_are_refused():
    for bad in (0, -3, MAX_STEPS + 1):
        with pytest.raises(ValueError):
            class_of([5, bad])


@pytest.mark.parametrize("least, most", [(1, MAX_STEPS), (1000, 1100), (1025, 1028), (2048, 2049),
                                         (MAX_STEPS - 1, MAX_STEPS)])
def test_schedule_sorts_by_steps_descending_and_launches_cover_it_by_class(rng, least, most):
    edges = np.r_[CAPACITY[:-1], CAPACITY[:-1] + 1, MAX_STEPS]    # the top of each class, the next's bottom
    edges = edges[(edges >= least) & (edges <= most)]               # (the sort counts over [least, most])
    steps = rng.permutation(np.r_[rng.integers(least, most + 1, 5000), edges, least, most]).astype(np.int32)
    order = np.full(steps.size, -1, dtype=np.int32)
    launches = schedule(steps, order)
    assert sorted(order.tolist()) == list(range(steps.size))       # a permutation of the rows
    sorted_steps = steps[order]
    assert np.all(np.diff(sorted_steps) <= 0)                      # largest lattices first
    ties = np.flatnonzero(np.diff(sorted_steps) == 0)              # stable: equal N keep their order
    assert np.all(order[ties] < order[ties + 1])
    assert launches[0].lo == 0 and launches[-1].hi == steps.size
    assert all(a.hi == b.lo for a, b in zip(launches, launches[1:]))
    for ln in launches:                                            # one class per launch
        assert set(class_of(sorted_steps[ln.lo:ln.hi]).tolist()) == {ln.cls}
    assert [ln.cls for ln in launches] == sorted({ln.cls for ln in launches}, reverse=True)


def test_one_n_is_one_launch_in_row_order():
    steps = np.full(1000, 1000, dtype=np.int32)
    order = np.full(steps.size, -1, dtype=np.int32)
    launches = schedule(steps, order)
    np.testing.assert_array_equal(order, np.arange(steps.size))
    assert [(ln.cls, ln.lo, ln.hi) for ln in launches] == [(int(class_of([1000])[0]), 0, 1000)]
    assert schedule(np.array([], dtype=np.int32), np.array([], dtype=np.int32)) == ()


def kernels_of(launches):
    return [(KERNELS[ln.cls], ln.lo, ln.hi) for ln in launches]


def sorted_schedule(steps, resident):
    steps = np.asarray(steps, dtype=np.int32)
    order = np.full(steps.size, -1, dtype=np.int32)
    return steps, order, schedule(steps, order, resident)


def test_a_one_class_chunk_sends_its_last_partial_wave_to_twice_the_warps():
    """U1 on an H200: 1 024 options of N = 2 048, 792 of class (2, 8) at once: the last 232 go to
    (4, 4), which holds them (docs/decisions.md, split_last_wave)."""
    _, _, launches = sorted_schedule([2048] * 1024, lambda cls: 792 if KERNELS[cls] == (2, 8) else 0)
    assert kernels_of(launches) == [((2, 8), 0, 792), ((4, 4), 792, 1024)]
    _, _, launches = sorted_schedule([5000] * 300, lambda cls: 264 if KERNELS[cls] == (8, 5) else 0)
    assert kernels_of(launches) == [((8, 5), 0, 264), ((16, 3), 264, 300)]


def test_the_tail_kernel_holds_the_largest_of_its_options(rng):
    """Steps of one class, sorted descending: the tail is the smallest options, its G that of its
    largest; every option of a launch fits its kernel."""
    for _ in range(20):
        k = int(rng.integers(len(CLASSES)))
        w, g = CLASSES[k]
        if w in (1, 16):
            continue
        bottom = int(CAPACITY[k - 1]) + 1 if k > 0 else 1
        count = int(rng.integers(150, 400))
        steps = rng.integers(bottom, int(CAPACITY[k]) + 1, count)
        # more than one wave, the last at most half of one
        at_once = int(rng.integers(-(-2 * count // 3), count))
        s, order, launches = sorted_schedule(steps, lambda cls, c=(w, g), a=at_once:
                                             a if KERNELS[cls] == c else 0)
        assert [KERNELS[ln.cls][0] for ln in launches] == [w, 2 * w]
        assert launches[0].hi - launches[0].lo == at_once
        for ln in launches:
            assert s[order[ln.lo:ln.hi]].max() <= 128 * ln.warps * ln.groups
        tail = s[order[launches[1].lo:]]
        assert 128 * ln.warps * (ln.groups - 1) < tail.max()        # the smallest G that holds it


@pytest.mark.parametrize("steps, at_once", [
    ([2048] * 1200, 792),                   # a last wave over half: as it is
    ([2048] * 792 * 2, 792),                # whole waves
    ([2048] * 700, 792),                    # one wave
    ([MAX_STEPS] * 300, 132),               # W = 16: no wider kernel
    ([1000] * 100_000, 1584),               # W = 1: U2's tail is too short to gain
    ([2048] * 900 + [100] * 10, 792),       # two classes: their launches fill each other's tails
])
def test_no_split_where_it_would_not_pay(steps, at_once):
    s, _, launches = sorted_schedule(steps, lambda cls: at_once)
    _, _, plain = sorted_schedule(steps, None)
    assert launches == plain


def test_launches_from_the_gpu_sorts_counts_are_those_of_the_host_sort(rng):
    """counted_schedule (rows sorted on the GPU; the host has only the rows per key) gives the
    launches schedule gives for the same keys: many classes, one class with and without its last
    wave split, class edges."""
    books = [rng.integers(1, MAX_STEPS + 1, 3000), np.r_[CAPACITY[:-1], CAPACITY[:-1] + 1],
             rng.integers(1025, 2049, 1024), np.full(1024, 2048), rng.integers(1793, 2049, 1000),
             rng.integers(2049, 4097, 500), np.array([7])]
    for steps in books:
        for resident in (None, lambda cls: 792, lambda cls: 390, lambda cls: 0):
            _, _, expected = sorted_schedule(steps, resident)
            counts = np.bincount(steps, minlength=KEY_BINS).astype(np.int32)
            assert counted_schedule(counts, resident) == expected
    assert counted_schedule(np.zeros(KEY_BINS, np.int32)) == ()
    with pytest.raises(ValueError):
        counted_schedule(np.bincount([0, 5], minlength=KEY_BINS))


def test_no_split_where_the_gpu_cannot_say():
    _, _, launches = sorted_schedule([2048] * 1024, lambda cls: 0)
    assert kernels_of(launches) == [((2, 8), 0, 1024)]


def u1_resident(cls):
    """Options held at once, as on an H100 (132 SMs) for W = 2 (their registers there)."""
    return {(2, 8): 792, (2, 6): 792, (2, 5): 1056, (2, 4): 1056, (4, 4): 660}.get(KERNELS[cls], 0)


def test_a_chunk_of_one_class_over_a_wave_goes_to_the_g_of_its_widest_payoff():
    """U1 (1 024 x N = 2 048, widths up to 1 145): (2, 5) holds them all at once, one launch in
    row order; the widest payoff's G is asked for only where it may pay."""
    steps, order, launches = sorted_schedule_by_width([2048] * 1024, u1_resident, 1145)
    assert kernels_of(launches) == [((2, 5), 0, 1024)]
    np.testing.assert_array_equal(order, np.arange(1024))
    _, _, launches = sorted_schedule_by_width([2048] * 1024, u1_resident, 1000)   # (2, 4)
    assert kernels_of(launches) == [((2, 4), 0, 1024)]


@pytest.mark.parametrize("steps, widest", [
    ([2048] * 1024, 1300),            # G = 6 holds 792 of 1 024: the split of the last wave
    ([2048] * 1024, 2049),            # no narrower G
    ([2048] * 1100, 1145),            # more than G = 5 holds
])
def test_no_narrower_g_where_it_would_not_hold_the_chunk_at_once(steps, widest):
    _, _, launches = sorted_schedule_by_width(steps, u1_resident, widest)
    _, _, split = sorted_schedule(steps, u1_resident)
    assert launches == split and len(split) == 2


def w1_resident(cls):
    return 1584 if KERNELS[cls] == (1, 8) else 5000


@pytest.mark.parametrize("steps, resident", [
    ([2048] * 700, u1_resident),                   # one wave
    ([2048] * 900 + [100] * 10, u1_resident),      # two classes
    ([2048] * 1100, u1_resident),                  # no narrower G holds 1 100
    ([1000] * 2000, w1_resident),                  # W = 1
])
def test_the_widest_payoff_is_not_asked_where_it_cannot_pay(steps, resident):
    def refuse():
        raise AssertionError("max_width called")
    _, _, launches = sorted_schedule_by_width(steps, resident, refuse)
    assert launches == sorted_schedule(steps, resident)[2]


H100_SMS = 132


def held_at_once(cls):
    """Options held at once, as on an H100 (132 SMs)."""
    return {(2, 8): 792, (2, 5): 1056, (1, 4): 2112}[KERNELS[cls]]


@pytest.mark.parametrize("launches, rows, american, expected", [
    ([((2, 5), 0, 1024)], 1024, True, True),        # U1 American: 7.8 blocks per SM, one wave
    ([((2, 5), 0, 1024)], 1024, False, False),      # all European
    ([((2, 8), 0, 300)], 300, True, False),         # 2.3 blocks per SM
    ([((2, 8), 0, 700)], 700, True, False),         # 88 % of what (2, 8) holds at once
    ([((2, 8), 0, 720)], 720, True, True),          # 91 %, 5.5 blocks per SM
    ([((1, 4), 0, 1200)], 1200, True, False),       # W = 1: 4 options a block, 300 blocks
    ([((2, 8), 0, 1024)], 1024, True, False),       # more than one wave
    ([((2, 5), 0, 600), ((1, 8), 600, 1024)], 1024, True, False),   # two launches
    ([((2, 5), 0, 1000)], 1024, True, False),       # a launch over part of the chunk
])
def test_a_one_wave_launch_with_several_blocks_per_sm_runs_heaviest_first(launches, rows,
                                                                          american, expected):
    launches = tuple(Launch(KERNELS.index(shape), lo, hi) for shape, lo, hi in launches)
    flags = np.zeros(rows, dtype=bool)
    flags[rows // 2] = american                     # one American row is enough
    assert heaviest_first(launches, rows, held_at_once, H100_SMS, flags) is expected


def test_no_order_by_work_without_the_sms_or_past_the_shared_memory():
    american = np.ones(WORK_ORDER_ROWS + 1, dtype=bool)
    u1 = (Launch(KERNELS.index((2, 5)), 0, 1024),)
    assert not heaviest_first(u1, 1024, held_at_once, 0, american[:1024])
    for rows, expected in ((WORK_ORDER_ROWS, True), (WORK_ORDER_ROWS + 1, False)):
        launch = (Launch(KERNELS.index((1, 1)), 0, rows),)
        assert heaviest_first(launch, rows, lambda cls: rows, 1, american[:rows]) is expected


def sorted_schedule_by_width(steps, resident, widest):
    steps = np.asarray(steps, dtype=np.int32)
    order = np.full(steps.size, -1, dtype=np.int32)
    max_width = widest if callable(widest) else (lambda: widest)
    return steps, order, schedule(steps, order, resident, max_width)


def test_width_keys_hold_every_positive_payoff_of_the_last_level(rng):
    """width_keys against the last level's payoffs counted here, on the unmirrored lattice: at
    least the nodes with a positive payoff, at most 3 more (the kernel's margin of 2 and the
    ceiling), never more than the steps (at steps = capacity the kernel feeds the top node in as
    a neighbour)."""
    n = 3000
    cols = dict(spot=rng.uniform(50, 150, n), strike=rng.uniform(50, 150, n),
                maturity=rng.uniform(0.05, 3.0, n), volatility=rng.uniform(0.05, 0.6, n),
                rate=rng.uniform(0.0, 0.08, n), dividend=rng.uniform(0.0, 0.05, n),
                steps=rng.integers(1, 4000, n), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.5)
    params = lattice_parameters(cols)
    views = input_views(np.zeros(n * INPUT_BYTES_PER_OPTION, dtype=np.uint8), n)
    fill_floats(params, slice(0, n), views)
    fill_flags(params, slice(0, n), views)
    keys = width_keys(views.floats, views.steps, views.call, views.american,
                      np.empty(n, dtype=np.int32))
    for r in range(n):
        i = np.arange(params.steps[r] + 1)
        log_price = i * params.log_up[r] + (params.steps[r] - i) * params.log_down[r]
        price = params.spot[r] * np.exp(log_price)
        payoff = price - params.strike[r] if params.call[r] else params.strike[r] - price
        positive = min(int(np.count_nonzero(payoff > 0)), params.steps[r])  # the top: a neighbour
        assert positive <= keys[r] <= min(positive + 3, params.steps[r]), (r, positive, keys[r])
    assert (keys < params.steps).mean() > 0.5
    assert widest_payoff(views.floats, views.steps, views.call, views.american) == keys.max()


def test_chunks_are_runs_of_rows_within_the_memory_cap():
    assert chunk_bounds(2345, chunk_options=500) == [(0, 500), (500, 1000), (1000, 1500),
                                                     (1500, 2000), (2000, 2345)]
    assert chunk_bounds(3, chunk_options=10) == [(0, 3)]
    assert chunk_bounds(0) == []
    with pytest.raises(ValueError):
        chunk_size(5, chunk_options=0)


def test_a_call_within_the_memory_cap_is_one_chunk():
    """One chunk, sorted as a whole: the largest options of the whole call start first."""
    assert chunk_bounds(100_000) == [(0, 100_000)]
    assert chunk_size(100_000, chunk_options=1000) == 1000


def book(rng, n):
    cols = dict(spot=rng.uniform(50, 150, n), strike=rng.uniform(50, 150, n), maturity=np.ones(n),
                volatility=np.full(n, 0.3), rate=np.full(n, 0.02), dividend=np.zeros(n),
                steps=rng.integers(1, MAX_STEPS + 1, n), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.5)
    return lattice_parameters(cols)


def test_the_float_fields_are_the_packed_rows_in_order():
    """fill_floats copies a run of rows as one block of LatticeParams.packed."""
    assert {name: k for k, name in enumerate(FLOAT_FIELDS)} == FLOAT_ROWS


def test_a_run_of_many_rows_is_copied_whole(rng):
    params = book(rng, 40_010)
    rows = slice(5, 40_005)
    n = rows.stop - rows.start
    views = input_views(np.zeros(n * INPUT_BYTES_PER_OPTION, dtype=np.uint8), n)
    fill_floats(params, rows, views)
    for k, name in enumerate(FLOAT_FIELDS):
        np.testing.assert_array_equal(views.floats[k], getattr(params, name)[rows])


@pytest.mark.parametrize("rows", [slice(0, 3000), slice(7, 2007), slice(2999, 3000),
                                  np.array([7, 0, 3, 3, 11])], ids=["all", "run", "last", "index"])
def test_fill_input_writes_the_bytes_of_fill_floats_and_fill_flags(rng, rows):
    """fill_input's numba pass over a run of LatticeParams.packed (and its gather of an index)
    against the numpy copies, byte for byte; the order's bytes are left alone."""
    params = book(rng, 3000)
    n = np.arange(3000)[rows].size
    by_numpy = np.full(n * INPUT_BYTES_PER_OPTION + 5, 7, dtype=np.uint8)
    by_pass = by_numpy.copy()
    views = input_views(by_numpy, n)
    fill_floats(params, rows, views)
    fill_flags(params, rows, views)
    fill_input(params, rows, by_pass, input_views(by_pass, n))
    np.testing.assert_array_equal(by_pass, by_numpy)


@pytest.mark.parametrize("rows", [slice(3, 9), np.array([7, 0, 3, 3, 11])], ids=["slice", "index"])
def test_input_carries_the_rows_as_given_at_the_kernels_offsets(rng, rows):
    params = book(rng, 12)
    picked = np.arange(12)[rows]
    n = picked.size
    buffer = np.zeros(n * INPUT_BYTES_PER_OPTION + 16, dtype=np.uint8)
    views = input_views(buffer, n)
    fill_floats(params, rows, views)
    fill_flags(params, rows, views)
    launches = schedule(views.steps, views.order)          # as the runner sorts a small chunk
    # the offsets cuda/batch.cu's load_option reads, from the raw bytes
    raw = buffer[:n * INPUT_BYTES_PER_OPTION]
    for k, name in enumerate(FLOAT_FIELDS):
        np.testing.assert_array_equal(raw[8 * k * n:8 * (k + 1) * n].view(np.float64),
                                      getattr(params, name)[picked])
    np.testing.assert_array_equal(raw[48 * n:52 * n].view(np.int32), params.steps[picked])
    order = raw[52 * n:56 * n].view(np.int32)
    np.testing.assert_array_equal(raw[56 * n:57 * n], params.call[picked])
    np.testing.assert_array_equal(raw[57 * n:58 * n], params.american[picked])
    expect = np.empty(n, dtype=np.int32)
    assert schedule(params.steps[picked].astype(np.int32), expect) == launches
    np.testing.assert_array_equal(order, expect)
    assert not buffer[n * INPUT_BYTES_PER_OPTION:].any()           # nothing written past the input


def defined() -> dict:
    """batch_layout.defines() as {macro: value}: each a distinct -DNAME=integer."""
    pairs = [re.fullmatch(r"-D([A-Z_][A-Z0-9_]*)=(-?\d+)", flag) for flag in defines()]
    assert all(pairs), defines()
    values = {m.group(1): int(m.group(2)) for m in pairs}
    assert len(values) == len(pairs), "a macro defined twice"
    return values


def test_the_defines_state_the_layout_of_input_views(rng):
    """cuda/batch.cu reads the input at the offsets the -D options give it, the host writes it
    through input_views: the two must be one layout. Each column's byte offset in a buffer of n
    rows is its *_AT value times n (float column k at 8 k n), the columns tile the row's
    INPUT_BYTES_PER_OPTION bytes without a gap, the float columns are FLOAT_FIELDS in the order of
    LatticeParams.packed's rows, and the kernels' shared constants are the host's."""
    d = defined()
    assert {name: d[f"IN_{name.upper()}"] for name in FLOAT_FIELDS} == FLOAT_ROWS
    assert [d[f"IN_{name.upper()}"] for name in FLOAT_FIELDS] == list(range(len(FLOAT_FIELDS)))
    assert d["VT"] == NODES_PER_LANE and d["WIDTH_MARGIN"] == WIDTH_MARGIN
    for name in ("SORT_THREADS", "WORK_ORDER_THREADS", "WORK_RANK_LANES"):
        assert d[name] == getattr(batch_layout, name), name
    for n in (1, 7, 1000):
        buffer = np.zeros(n * INPUT_BYTES_PER_OPTION, dtype=np.uint8)
        views = input_views(buffer, n)
        base = buffer.__array_interface__["data"][0]

        def span(view):
            start = view.__array_interface__["data"][0] - base
            return start, start + view.nbytes

        columns = [(span(views.floats[d[f"IN_{name.upper()}"]]), 8 * n) for name in FLOAT_FIELDS]
        columns += [(span(getattr(views, field)), size * n)
                    for field, size in (("steps", 4), ("order", 4), ("call", 1), ("american", 1))]
        for name in FLOAT_FIELDS:
            assert span(views.floats[d[f"IN_{name.upper()}"]])[0] == 8 * d[f"IN_{name.upper()}"] * n
        for field in ("steps", "order", "call", "american"):
            assert span(getattr(views, field))[0] == d[f"IN_{field.upper()}_AT"] * n, field
        assert span(views.order) == order_span(n)
        # every column as wide as its type, one after another from byte 0 to the row's end
        assert all(hi - lo == size for (lo, hi), size in columns)
        bounds = sorted(bound for bound, _ in columns)
        assert bounds[0][0] == 0 and bounds[-1][1] == n * INPUT_BYTES_PER_OPTION
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    # the bytes fill_input writes, read back where the kernel reads them
    n = 9
    params = book(rng, n)
    buffer = np.zeros(n * INPUT_BYTES_PER_OPTION, dtype=np.uint8)
    fill_input(params, slice(0, n), buffer, input_views(buffer, n))
    floats = buffer[:d["IN_STEPS_AT"] * n].view(np.float64)
    for name in FLOAT_FIELDS:
        k = d[f"IN_{name.upper()}"]
        np.testing.assert_array_equal(floats[k * n:(k + 1) * n], getattr(params, name))
    at = {field: d[f"IN_{field.upper()}_AT"] * n for field in ("steps", "call", "american")}
    np.testing.assert_array_equal(buffer[at["steps"]:at["steps"] + 4 * n].view(np.int32),
                                  params.steps)
    np.testing.assert_array_equal(buffer[at["call"]:at["call"] + n].view(np.bool_), params.call)
    np.testing.assert_array_equal(buffer[at["american"]:at["american"] + n].view(np.bool_),
                                  params.american)


def test_batch_cu_requires_every_define():
    """cuda/batch.cu has no default for any macro of the layout's contract: each one defines()
    gives is guarded by `#ifndef NAME` / `#error`, so a build without it fails rather than reading
    another layout, and every macro it guards so is one that defines() gives (a build with the
    runner's options compiles)."""
    source = (cuda_source_dir() / "batch.cu").read_text()
    guarded = set(re.findall(r"^[ \t]*#[ \t]*ifndef[ \t]+(\w+)[ \t]*\n[ \t]*#[ \t]*error\b",
                             source, flags=re.MULTILINE))
    given = set(defined())
    assert given - guarded == set(), f"not required by cuda/batch.cu: {sorted(given - guarded)}"
    assert guarded - given == set(), f"required but not given: {sorted(guarded - given)}"
