"""The Hull–White family's GPU engine (cuda/trinomial.cu, pricer/engines/gpu/trinomial.py): the
host layouts of both strategies (here), and GPU-OUTER, GPU-FLAT and `auto` against the CPU engine
to 1e-12 on fresh random books and the datasets of Pawlak et al. (2021) (marked gpu)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import pricer.model.bond_book as B
from gpu_cases import needs_gpu
from helpers import run_pricer
from pricer.engines.cpu.trinomial import HullWhiteCpuEngine
from pricer.engines.gpu.trinomial import (FLAT_MAX_ROWS, OUTER_ARRAYS, flat_bins, outer_layout,
                                          sorted_order)
from pricer.tools.bond_datasets import CURVE, dataset_columns
from test_hw1f import random_curve, random_instruments


def scale(prices):
    """What a difference is relative to: the price, or 1 % of the face (100) where the price is
    smaller. An option worth little beside its bond carries the bond's rounding (a difference of
    two of the tree's values), so its own size is no measure of the engines' agreement."""
    return np.maximum(np.abs(prices), 1.0)


def random_columns(rng, n: int):
    """(columns, curves) of a book whose trees go from 3 rows (j_max = 1) to over FLAT_MAX_ROWS
    rows, mixed products and rights, on a curve per instrument."""
    instruments = random_instruments(rng, n, maturity=(0.5, 12.0))
    # every fifth with its last exercise date at maturity (against the redemption:
    # hw1f._at_maturity; a bermudan's dates may stop short of it)
    instruments = [replace(x, last=x.maturity) if x.exercise != "european" else
                   replace(x, first=x.maturity) for x in instruments[::5]] + \
        [x for k, x in enumerate(instruments) if k % 5]
    a = rng.choice([0.01, 0.05, 0.2, 1.0, 60.0], n) * rng.uniform(0.9, 1.1, n)
    sigma = rng.uniform(0.003, 0.02, n)
    per_year = rng.choice([2, 12, 52], n)
    curves = [random_curve(rng, flat=bool(k % 2)) for k in range(n)]
    return B.columns_of(instruments, a, sigma, per_year, np.arange(n)), curves


def random_book(rng, n: int):
    return B.tree_parameters(*random_columns(rng, n))


def test_flat_bins_keep_trees_whole_and_within_warps(rng):
    rows = np.sort(rng.choice([3, 7, 31, 33, 64, 129, 259, 511], 500))[::-1].astype(np.int32)
    steps = rng.integers(1, 1200, 500).astype(np.int32)
    for threads in (512, 1024):
        first, seg, tallest = flat_bins(rows, steps, threads)
        assert first[0] == 0 and first[-1] == rows.size and np.all(np.diff(first) > 0)
        for b in range(first.size - 1):
            ks = np.arange(first[b], first[b + 1])
            lo, hi = seg[ks], seg[ks] + rows[ks]
            assert np.all(lo >= 0) and np.all(hi <= threads)
            assert np.all(lo[1:] >= hi[:-1])                       # no overlap, in order
            narrow = rows[ks] <= 32
            assert np.all(lo[narrow] // 32 == (hi[narrow] - 1) // 32)   # within one warp
            assert np.all(lo[~narrow] % 32 == 0)                    # wide trees start a warp
            assert tallest[b] == steps[ks].max()


def test_outer_layout_pads_each_warp_to_its_widest_tree():
    rows = np.array([101] * 33 + [7] * 40)
    base, width, total = outer_layout(rows)
    assert width.tolist() == [101, 101, 7]
    assert base.tolist() == [0, 101 * 32 * OUTER_ARRAYS, 2 * 101 * 32 * OUTER_ARRAYS]
    assert total == (2 * 101 + 7) * 32 * OUTER_ARRAYS


def test_sorted_order_is_widest_then_tallest(rng):
    params = random_book(rng, 60)
    order = sorted_order(params)
    key = list(zip(-params.jmax[order], -params.steps[order]))
    assert key == sorted(key)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("strategy", ["outer", "flat", "auto"])
def test_gpu_engine_is_the_cpu_engine(rng, strategy):
    from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
    cols, curves = random_columns(rng, 300)
    params = B.tree_parameters(cols, curves)
    rows = 2 * params.jmax + 1
    assert rows.min() == 3 and rows.max() > FLAT_MAX_ROWS
    want = HullWhiteCpuEngine().price(params)
    engine = HullWhiteGpuEngine(strategy, flat_rows=257)
    flat, outer = engine.split(params)
    assert flat.size + outer.size == len(params)
    got = engine.price(params)
    # two calls in flight, on the engine's two slots (Engine.start, Engine.finish), and a third
    # started in the first's slot once it is finished
    other = random_book(rng, 40)
    alone = engine.price(other)
    first, second = engine.start(params), engine.start(other)
    np.testing.assert_array_equal(engine.finish(first), got)
    third = engine.start(params)
    np.testing.assert_array_equal(engine.finish(second), alone)
    np.testing.assert_array_equal(engine.finish(third), got)
    # the per-step arrays filled on the GPU (hw_fill) rather than on the host (fill_steps): the
    # discounts' exp may differ in the last bit, so the prices to rounding
    filled = engine.price(B.tree_parameters(cols, curves, fill=False))
    assert np.max(np.abs(filled - want) / scale(want)) <= 1e-12
    err = np.abs(got - want) / scale(want)
    worst = int(np.argmax(err))
    assert err.max() <= 1e-12, (strategy, float(err.max()), want[worst], got[worst],
                                int(params.jmax[worst]), int(params.steps[worst]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["U1", "R1", "R2", "R3", "S1", "S2"])
def test_gpu_engine_on_the_datasets(name):
    from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
    cols = dataset_columns(name, 1500)
    params = B.tree_parameters(cols, [CURVE])
    unfilled = B.tree_parameters(cols, [CURVE], fill=False)     # the GPU fills the steps (hw_fill)
    want = HullWhiteCpuEngine().price(params)
    for strategy in ("outer", "flat"):
        engine = HullWhiteGpuEngine(strategy)
        for given in (params, unfilled):
            got = engine.price(given)
            err = np.abs(got - want) / scale(want)
            assert err.max() <= 1e-12, (name, strategy, given is params, float(err.max()))


def test_bench_trinomial_on_the_cpu(tmp_path):
    """`pricer bench trinomial` on the cpu engine with its QuantLib anchor: a row a dataset, the
    anchor's ratio, its JSON."""
    pytest.importorskip("QuantLib")
    out = tmp_path / "bench.json"
    r = run_pricer(["bench", "trinomial", "--engines", "cpu", "--datasets", "S1,S2", "--count",
                    "40", "--repeats", "1", "--quantlib", "3", "--out", out])
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [(row["dataset"], row["engine"]) for row in rows] == [("S1", "cpu"), ("S2", "cpu")]
    assert all(row["quantlib_ratio"] > 1 and row["gflops_spec"] > 0 for row in rows)
    assert "cpu engine per core against QuantLib's tree engine" in r.stdout


@pytest.mark.gpu
@needs_gpu
def test_bench_trinomial_on_the_gpu(tmp_path):
    """Every GPU strategy in the bench (the per-step arrays filled on the GPU) agrees with the cpu
    engine to 1e-12 and reports its kernels' time."""
    out = tmp_path / "bench.json"
    r = run_pricer(["bench", "trinomial", "--engines", "cpu,outer,flat,auto", "--datasets",
                    "R1,S2", "--count", "500", "--repeats", "1", "--quantlib", "0", "--out", out])
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 8
    gpu = [row for row in rows if row["engine"] != "cpu"]
    assert all(row["max_rel_difference"] <= 1e-12 and row["kernel_seconds"] > 0 for row in gpu)


@pytest.mark.gpu
@needs_gpu
def test_flat_price_does_not_depend_on_the_book(rng):
    """GPU-FLAT: an instrument's price is bitwise the same in its book, in half of it in another
    order and alone: its block, its warp's neighbours and the rows beside its own change, its
    arithmetic does not."""
    from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
    cols, curves = random_columns(rng, 300)
    engine = HullWhiteGpuEngine("flat")
    params = B.tree_parameters(cols, curves)
    book = engine.price(params)
    keep = np.flatnonzero(2 * params.jmax + 1 <= FLAT_MAX_ROWS)
    picked = rng.permutation(keep)[: keep.size // 2]
    half = engine.price(B.tree_parameters({k: v[picked] for k, v in cols.items()}, curves))
    np.testing.assert_array_equal(half, book[picked])
    for k in picked[:8]:
        alone = engine.price(B.tree_parameters({key: v[[k]] for key, v in cols.items()}, curves))
        np.testing.assert_array_equal(alone, book[[k]])
