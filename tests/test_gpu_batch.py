"""The `batch` backend (cuda/batch.cu through pricer.engines.batch) against the `cpu` engine (bitwise
equal to serial) on fresh random options: every class edge, mixed portfolios, N = 1, a portfolio
of many chunks, options wider than every class (through hybrid), and two MPI ranks on one GPU.
Marked `gpu`: they skip here with the reason and run on the GPU machine (../shared/device)."""

from __future__ import annotations

import numpy as np
import pytest

from pricer.engines import gpu_available, resolve_backend
from pricer.engines.batch_plan import CAPACITY, MAX_STEPS
from pricer.engines.cpu import CpuEngine
from test_gpu import GPU, every_kind, keep_p_inside, needs_gpu, options

pytestmark = GPU
TOLERANCE = 1e-11   # issue 4: relative, absolute scaled by the strike below 1e-8 of the strike


def assert_close(got, ref, p, label=""):
    scale = np.where(np.abs(ref) < 1e-8 * p.strike, p.strike, np.abs(ref))
    err = np.abs(got - ref) / scale
    worst = int(np.argmax(err))
    assert err[worst] <= TOLERANCE, (f"{label}: N={p.steps[worst]} call={p.call[worst]} "
                                     f"american={p.american[worst]} got {got[worst]!r} "
                                     f"ref {ref[worst]!r} err {err[worst]:.2e}")


def batch_engine(**kw):
    from pricer.engines.batch import BatchEngine
    return BatchEngine(**kw)


def runner_built_with(define: str):
    """A CudaBatchRunner whose kernels are built with one more -D option (cuda/batch.cu's
    BATCH_* switches), for comparisons with the default build."""
    from pricer.engines.batch import CudaBatchRunner
    runner = CudaBatchRunner()
    runner._defines = [*runner._defines, define]
    return runner


def test_every_class_edge_every_kind(rng):
    # the top of every class (steps = capacity: the top node fed in as a neighbour) and the bottom
    # of the next
    edges = sorted({1, 2, 3, *(CAPACITY - 1).tolist(), *CAPACITY[:-1].tolist(),
                    *(CAPACITY[:-1] + 1).tolist()})
    p = every_kind(rng, edges)
    assert_close(batch_engine().price(p), CpuEngine().price(p), p, "class edges")


def test_mixed_portfolio_with_options_wider_than_every_class(rng):
    steps = np.r_[rng.integers(1, 4097, 300), rng.integers(4097, MAX_STEPS + 1, 12),
                  [MAX_STEPS + 1, 20_000]]
    p = options(rng, rng.permutation(steps))
    got, ref = batch_engine(t2=200).price(p), CpuEngine().price(p)
    batch = p.steps <= MAX_STEPS
    assert_close(got[batch], ref[batch], p.take(np.flatnonzero(batch)), "batch part")
    wide = np.flatnonzero(~batch)
    np.testing.assert_allclose(got[wide], ref[wide], rtol=1e-9)      # hybrid's own tolerance (issue 3)


def test_warm_up_launches_every_class_and_leaves_prices_alone(rng):
    """distributed.py warms the engine up while rank 0 reads: every class once, then real work."""
    from pricer.engines.batch_plan import CLASSES
    engine = batch_engine()
    engine.warm_up()
    assert sorted(engine.runner._functions) == list(range(len(CLASSES)))
    p = options(rng, rng.integers(1, MAX_STEPS + 1, 64))
    assert_close(engine.price(p), CpuEngine().price(p), p, "after warm_up")


def test_a_split_last_wave_changes_no_bit(rng):
    """A one-class chunk a quarter wave over one (batch_plan.split_last_wave): two launches, the
    prices bitwise those of one launch, and the CPU engine's."""
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.batch_plan import class_of
    split = BatchEngine(runner=CudaBatchRunner(one_wave=False))      # not one_wave_by_width
    whole = BatchEngine(runner=CudaBatchRunner(split_waves=False))
    for steps in (1100, 3000):                  # W = 2 to W = 4; W = 4 to W = 8
        at_once = split.runner.resident(int(class_of([steps])[0]))
        assert at_once > 0
        p = options(rng, [steps] * (at_once + at_once // 4))
        got = split.price(p)
        assert split.runner.last_stats["launches"] == 2
        np.testing.assert_array_equal(got, whole.price(p))
        assert whole.runner.last_stats["launches"] == 1
        pick = rng.choice(len(p), 40, replace=False)
        assert_close(got[pick], CpuEngine().price(p.take(pick)), p.take(pick), f"split, N = {steps}")


def test_a_chunk_over_a_wave_in_the_g_of_its_widest_payoff_changes_no_bit(rng):
    """A one-class chunk over a wave that the G of its widest payoff holds at once
    (batch_plan.one_wave_by_width): one launch of that narrower class; prices and the Greeks'
    levels bitwise those of the classes of the steps (and its split last wave), and the CPU
    engine's."""
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.batch_plan import KERNELS, class_of
    from pricer.engines.serial import LEVEL_VALUES
    narrow, by_steps = CudaBatchRunner(), CudaBatchRunner(one_wave=False)
    for steps in (2048, 1500):                  # (2, 8) to (2, 5); (2, 6) to (2, 3)
        cls = int(class_of([steps])[0])
        p = options(rng, [steps] * (narrow.resident(cls) + 40))
        p.strike[:] = p.spot            # at the money on CRR trees: widths about half the steps
        levels, ref_levels = np.empty((len(p), LEVEL_VALUES)), np.empty((len(p), LEVEL_VALUES))
        got = BatchEngine(runner=narrow).price(p, levels)
        stats = narrow.last_stats
        assert stats["launches"] == 1 and stats["priced_again"] == 0, (steps, len(p), stats)
        np.testing.assert_array_equal(got, BatchEngine(runner=by_steps).price(p, ref_levels))
        np.testing.assert_array_equal(levels, ref_levels)
        assert by_steps.last_stats["launches"] == 2
        used = [KERNELS[c] for c in narrow._functions]
        assert any(g < KERNELS[cls][1] and w == KERNELS[cls][0] for w, g in used)
        pick = rng.choice(len(p), 40, replace=False)
        assert_close(got[pick], CpuEngine().price(p.take(pick)), p.take(pick),
                     f"one wave, N = {steps}")


def work_estimates(p):
    """cuda/batch.cu's work_estimate in numpy (FP64 here, FP32 there): the nodes between the
    surely exercised prefix and the strike index plus 5 sqrt(n - t + 1), at 8 levels."""
    log_up = np.where(p.call, p.log_down, p.log_up)            # calls mirrored
    log_down = np.where(p.call, p.log_up, p.log_down)
    n, log_strike = p.steps.astype(float), np.log(p.strike / p.spot)
    discount, growth = p.pu + p.pd, p.pu * np.exp(p.log_up) + p.pd * np.exp(p.log_down)
    bounded = p.american & (growth < 1) & (discount < 1)
    log_bound = log_strike + np.log(np.where(bounded, (1 - discount) / (1 - growth), 1.0))
    nodes = np.zeros(len(p))
    for k in range(8):
        t = (k + 0.5) * n / 8
        hi = np.minimum(t + 1, np.maximum((log_strike - t * log_down) / (log_up - log_down)
                                          + 5 * np.sqrt(n - t + 1), 0))
        lo = np.where(bounded, np.maximum((log_bound - t * log_down) / (log_up - log_down), 0), 0)
        nodes += np.maximum(hi - lo, 0)
    return nodes


def test_a_one_wave_launch_heaviest_first_changes_no_bit(rng):
    """A one-class chunk in one wave with several blocks per SM (batch_plan.heaviest_first): the
    GPU writes its order heaviest first (cuda/batch.cu, batch_work_order), a permutation of the
    rows, descending in the work estimate computed here; prices and the Greeks' levels bitwise
    those of the order by steps, and the CPU engine's."""
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.batch_plan import class_of, order_span
    from pricer.engines.serial import LEVEL_VALUES
    by_work, by_steps = CudaBatchRunner(), CudaBatchRunner(by_work=False)
    held = by_work.resident(int(class_of([2048])[0]))   # (2, 8): 792 on an H100
    p = options(rng, [2048] * (held - 8))               # 99 % of a wave
    levels, ref_levels = np.empty((len(p), LEVEL_VALUES)), np.empty((len(p), LEVEL_VALUES))
    got = BatchEngine(runner=by_work).price(p, levels)
    n = len(p)
    order = np.empty(n, dtype=np.int32)
    by_work.rt.cuda.memcpy_dtoh(order, int(by_work._buffers[0]["input_d"]) + order_span(n)[0])
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    estimates = work_estimates(p)[order]
    assert np.all(np.diff(estimates) <= 1e-4 * estimates.max()), "not heaviest first"
    assert not np.array_equal(order, np.arange(n))      # not the rows' order by steps
    np.testing.assert_array_equal(got, BatchEngine(runner=by_steps).price(p, ref_levels))
    np.testing.assert_array_equal(levels, ref_levels)
    assert by_work.last_stats["launches"] == by_steps.last_stats["launches"] == 1
    pick = rng.choice(n, 40, replace=False)
    assert_close(got[pick], CpuEngine().price(p.take(pick)), p.take(pick), "heaviest first")


def test_the_mixed_american_max_changes_no_bit(rng):
    """cuda/batch.cu compares nodes 1 and 3 of each lane's four as doubles, the others as integers
    (BATCH_MAX_MIX): prices bitwise those of the integer compare on every node, in every class."""
    from pricer.engines.batch import BatchEngine
    integer = runner_built_with("-DBATCH_MAX_MIX=0")
    p = every_kind(rng, rng.integers(1, MAX_STEPS + 1, 60))
    np.testing.assert_array_equal(batch_engine().price(p), BatchEngine(runner=integer).price(p))


def test_one_step_options(rng):
    p = every_kind(rng, [1] * 8)
    assert_close(batch_engine().price(p), CpuEngine().price(p), p, "N = 1")


def test_many_chunks_keep_the_input_order(rng):
    p = options(rng, rng.integers(1, 1500, 1000))
    engine = batch_engine(chunk_options=37)
    got = engine.price(p)
    assert engine.runner.last_stats["chunks"] == 28
    assert_close(got, CpuEngine().price(p), p, "chunked")
    again = batch_engine(chunk_options=10**6).price(p)             # one chunk: the same kernels
    np.testing.assert_array_equal(got, again)


def test_kept_levels_for_greeks_on_every_gpu_backend(rng):
    """The first levels' values (pricer.greeks) from the batch kernels, and from gpu/hybrid (GPU down
    to level 2, the host keeps the last two), against the cpu engine's."""
    from pricer.engines.gpu import GpuEngine
    from pricer.engines.serial import LEVEL_VALUES
    steps = np.r_[1, 2, 3, 4, 5, rng.integers(6, 3000, 40), rng.integers(9000, 12000, 2)]
    p = options(rng, steps)
    ref_levels = np.empty((len(p), LEVEL_VALUES))
    ref = CpuEngine().price(p, ref_levels)
    engines = {"batch": batch_engine(), "hybrid": GpuEngine("hybrid", t2=64),
               "gpu": GpuEngine("gpu")}
    for name, engine in engines.items():
        levels = np.full((len(p), LEVEL_VALUES), -1.0)
        assert_close(engine.price(p, levels), ref, p, f"{name} price")
        assert np.isnan(levels[0]).all() and np.isnan(ref_levels[0]).all()
        for col in range(LEVEL_VALUES):
            assert_close(levels[1:, col], ref_levels[1:, col], p.take(np.arange(1, len(p))),
                         f"{name} level value {col}")


def test_richardson_and_greeks_on_every_gpu_backend(rng):
    """--richardson and --greeks (pricer.greeks: the extra and bumped lattices in the same engine
    call) on batch, hybrid and gpu against the cpu engine's, on fresh random options."""
    from pricer.engines.gpu import GpuEngine
    from pricer.greeks import Analytics, price_with_analytics
    n = 40
    cols = dict(spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n),
                maturity=rng.uniform(0.1, 2.0, n), rate=rng.uniform(0.0, 0.06, n),
                dividend=rng.uniform(0.0, 0.04, n), volatility=rng.uniform(0.15, 0.5, n),
                steps=rng.integers(10, 5000, n), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.5)
    ids = np.arange(1, n + 1)
    what = Analytics(greeks=True, richardson=True)
    ref = price_with_analytics(CpuEngine(), cols, "crr", ids, what)
    engines = {"batch": batch_engine(), "hybrid": GpuEngine("hybrid", t2=64),
               "gpu": GpuEngine("gpu")}
    # Greeks are difference quotients of lattice values, so their rounding grows as the CPU test's
    # floors say (test_greeks.greek_floors; the same 1e-8 bar); vega and rho divide differences of
    # prices (~1e-15 of the price apart on GPU and CPU) by 2 BUMP = 2e-4, so 5e-12 of the price
    from test_greeks import greek_floors
    floors = greek_floors(cols, np.column_stack([ref[k] for k in ("price", "delta", "gamma", "theta")]))
    floors["vega"] = floors["rho"] = 1e-3 * np.abs(ref["price"]) + 1e-8 * cols["strike"]
    for name, engine in engines.items():
        got = price_with_analytics(engine, cols, "crr", ids, what)
        for output in what.outputs:
            err = np.abs(got[output] - ref[output]) / np.maximum(np.abs(ref[output]), floors[output])
            print(f"RICHARDSON+GREEKS backend={name} {output} max_rel={err.max():.2g}")
            assert err.max() <= 1e-8, (name, output, float(err.max()))


def test_auto_is_batch_on_a_gpu_machine():
    assert gpu_available() and resolve_backend("auto") == "batch"


@pytest.mark.gpu
@needs_gpu
def test_mpirun_two_ranks_one_gpu_batch_cli(tmp_path):
    from helpers import run_pricer
    from pricer.results import read_results
    src = tmp_path / "p.h5"
    gen = run_pricer(["generate", "--dist", "skewed", "--count", "400", "--seed", "11", "-o", src])
    assert gen.returncode == 0, gen.stderr
    bat = run_pricer(["price", src, "-o", tmp_path / "b.h5", "--backend", "batch"], ranks=2, timeout=300)
    assert bat.returncode == 0, bat.stdout + bat.stderr
    cpu = run_pricer(["price", src, "-o", tmp_path / "c.h5", "--backend", "cpu"])
    assert cpu.returncode == 0, cpu.stderr
    b, c = read_results(tmp_path / "b.h5"), read_results(tmp_path / "c.h5")
    assert b["attrs"]["backend"] == "batch" and int(b["attrs"]["ranks"]) == 2
    np.testing.assert_array_equal(b["id"], c["id"])
    np.testing.assert_allclose(b["price"], c["price"], rtol=1e-11, atol=1e-8 * 80)


@pytest.mark.gpu
@needs_gpu
def test_mpirun_two_ranks_batch_greeks_and_richardson_cli(tmp_path):
    """--greeks --richardson with a QuantLib tree through the real CLI on 2 ranks sharing one GPU,
    against the cpu backend on one process."""
    from helpers import run_pricer
    from pricer.greeks import GREEKS
    from pricer.results import read_results
    src = tmp_path / "p.h5"
    gen = run_pricer(["generate", "--dist", "random", "--count", "120", "--seed", "5", "--min-steps", "3",
                      "--max-steps", "3001", "-o", src])
    assert gen.returncode == 0, gen.stderr
    flags = ["--greeks", "--richardson", "--tree", "ql-crr"]
    bat = run_pricer(["price", src, "-o", tmp_path / "b.h5", "--backend", "batch", *flags], ranks=2,
                     timeout=300)
    assert bat.returncode == 0, bat.stdout + bat.stderr
    cpu = run_pricer(["price", src, "-o", tmp_path / "c.h5", "--backend", "cpu", *flags])
    assert cpu.returncode == 0, cpu.stderr
    b, c = read_results(tmp_path / "b.h5"), read_results(tmp_path / "c.h5")
    assert b["attrs"]["backend"] == "batch" and bool(b["attrs"]["greeks"]) and bool(b["attrs"]["richardson"])
    np.testing.assert_allclose(b["price"], c["price"], rtol=1e-10, atol=1e-9)
    for name in ("delta", "gamma", "theta"):
        np.testing.assert_allclose(b[name], c[name], rtol=1e-8, atol=1e-9, err_msg=name)
    for name in ("vega", "rho"):   # central differences over 2e-4: price rounding x 5e3
        np.testing.assert_allclose(b[name], c[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert set(GREEKS) <= set(b)


def skip_book(rng, n, tree="crr"):
    """American options where whole groups of nodes are surely exercised, and where the margin is
    thin or missing: spot 0.3-1.7 of the strike, r from 0 (no put skips) through 1e-13 (too little
    for the rounding) to 12 %, q from -2 % (no call skips) to 20 %, N across the batch classes
    (mostly those that skip: W > 1, N < 10 240)."""
    from pricer.lattice import lattice_parameters
    strike = rng.uniform(50, 150, n)
    rate = rng.choice([0.0, 1e-13, 1e-9], n, p=[0.5, 0.25, 0.25])
    rate = np.where(rng.random(n) < 0.2, rate, rng.uniform(0.0, 0.12, n))
    cols = dict(spot=strike * rng.uniform(0.3, 1.7, n), strike=strike,
                maturity=rng.uniform(0.05, 3.0, n), rate=rate,
                dividend=rng.uniform(-0.02, 0.2, n), volatility=rng.uniform(0.05, 0.6, n),
                steps=np.where(rng.random(n) < 0.8, rng.integers(1024, 10240, n),  # classes that skip
                               rng.integers(129, 16384, n)),
                call=rng.random(n) < 0.5,
                american=np.ones(n, bool))
    return lattice_parameters(keep_p_inside(cols), tree)


@pytest.mark.parametrize("tree", ["crr", "jr", "lr"])
def test_skipped_groups_change_no_bit(rng, tree):
    """The batch kernels skip groups of surely exercised nodes (cuda/batch.cu, skip_check): prices
    and the Greeks' levels bitwise those of the same kernels built without it, and the skip does
    happen (group-step counters of a count build)."""
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.serial import LEVEL_VALUES
    p = skip_book(rng, 400, tree)
    full = BatchEngine(runner=CudaBatchRunner(skip=False))
    counting = CudaBatchRunner(count=True)
    skipping = BatchEngine(runner=counting)
    levels_full = np.empty((len(p), LEVEL_VALUES))
    levels_skip = np.empty((len(p), LEVEL_VALUES))
    np.testing.assert_array_equal(skipping.price(p, levels_skip), full.price(p, levels_full))
    np.testing.assert_array_equal(levels_skip, levels_full)
    counting.group_steps(reset=True)
    got = skipping.price(p)
    computed, every = counting.group_steps()
    print(f"SKIP tree={tree} group-steps computed {computed} of {every} ({computed / every:.1%})")
    assert 0 < computed < 0.85 * every          # about 65 % measured
    assert_close(got, CpuEngine().price(p), p, f"skip book, {tree}")


def test_skip_on_the_bench_books_changes_no_bit():
    """The bench's American U2 and R books (pricer bench batch), skip against no skip, bitwise."""
    from pricer.bench_batch import params_of
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    full = BatchEngine(runner=CudaBatchRunner(skip=False))
    for spec in (dict(dist="uniform", count=10_000, steps=1000), dict(dist="random", count=5_000)):
        p = params_of(spec, "american", False)
        np.testing.assert_array_equal(batch_engine().price(p), full.price(p))


def zero_region_book(rng, n, rates=(0.0, 0.05, 0.3), drift_steps=(10, 20, 50, 100),
                     steps=None, drift_vol=0.05):
    """Options whose zero region (above the last positive payoff) ranges from nothing (deep in the
    money) to the whole lattice (no positive payoff), with JR trees whose d exceeds 1 for some puts
    (no clamp for those American puts; drift_steps and drift_vol theirs), every class, calls and puts, American
    and European; steps by default the class edges' bottom and random ones."""
    from pricer.lattice import TREE_NAMES, lattice_parameters
    strike = rng.uniform(50, 150, n)
    moneyness = np.exp(rng.choice([-3.0, -0.5, 0.0, 0.5, 3.0], n) + rng.normal(0, 0.1, n))
    if steps is None:
        steps = np.r_[1, 2, 3, 127, 128, 129, rng.integers(1, MAX_STEPS + 1, n - 6)]
    cols = dict(spot=strike * moneyness, strike=strike, maturity=rng.uniform(0.05, 3.0, n),
                rate=rng.choice(rates, n), dividend=rng.uniform(-0.02, 0.1, n),
                volatility=rng.uniform(0.02, 0.6, n), steps=steps,
                call=rng.random(n) < 0.5, american=rng.random(n) < 0.7,
                tree=rng.integers(0, 3, n))
    cols = keep_p_inside(cols)
    drifting = slice(n - 4, n)   # JR puts whose d exceeds 1: a strong drift, a low volatility
    cols["tree"][drifting] = TREE_NAMES.index("jr")
    cols["rate"][drifting], cols["dividend"][drifting] = 0.3, 0.0
    cols["volatility"][drifting], cols["maturity"][drifting] = drift_vol, 3.0
    cols["steps"][drifting] = drift_steps
    cols["call"][drifting], cols["american"][drifting] = False, True
    p = lattice_parameters(cols)
    assert (p.log_down[drifting] > 0).all()
    return p


def test_zero_units_left_out_change_no_bit(rng):
    """The batch kernels never compute the units above an option's last positive payoff
    (cuda/batch.cu, zero_clamp; calls on the mirrored lattice): prices and the Greeks' levels
    bitwise those of the same kernels built without it (levels of options with no positive payoff
    are zeros, which no step writes), on edge cases and on the bench's books, and within the
    tolerance of the cpu engine."""
    from pricer.bench_batch import params_of
    from pricer.engines.batch import BatchEngine
    from pricer.engines.serial import LEVEL_VALUES
    unclamped = runner_built_with("-DBATCH_CLAMP=0")
    full = BatchEngine(runner=unclamped)
    p = zero_region_book(rng, 300)
    levels, levels_full = (np.empty((len(p), LEVEL_VALUES)) for _ in range(2))
    engine = batch_engine()   # its buffers first hold another book's levels: none may stay
    engine.price(options(rng, rng.integers(3, 3000, len(p))), np.empty((len(p), LEVEL_VALUES)))
    got = engine.price(p, levels)
    np.testing.assert_array_equal(got, full.price(p, levels_full))
    np.testing.assert_array_equal(levels, levels_full)
    assert_close(got, CpuEngine().price(p), p, "zero region book")
    for spec in (dict(dist="uniform", count=2_000, steps=1000), dict(dist="random", count=2_000)):
        for exercise in ("american", "european"):
            q = params_of(spec, exercise, False)
            np.testing.assert_array_equal(batch_engine().price(q), full.price(q))


def test_negligible_units_left_out_move_prices_by_rounding_only(rng):
    """The batch kernels stop computing the units whose values a bound puts below K 2^-70
    (cuda/batch.cu, tail_table): prices and the Greeks' levels within K 2^-60 of the same kernels
    built without it (BATCH_TAIL=0), on books from deep in the money to far out of it (JR puts
    with d > 1 among them, rates up to 30 % and below zero), every class, calls and puts, American
    and European; within the tolerance of the cpu engine; and the kernels do leave work out (a
    count build's group-steps)."""
    from pricer.bench_batch import params_of
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.serial import LEVEL_VALUES
    without = BatchEngine(runner=runner_built_with("-DBATCH_TAIL=0"))
    p = zero_region_book(rng, 300, rates=(-0.03, 0.0, 0.05, 0.3), drift_steps=(512, 600, 1000, 2000),
                         steps=rng.integers(512, MAX_STEPS + 1, 300), drift_vol=0.008)   # the tail's range
    levels, levels_without = (np.empty((len(p), LEVEL_VALUES)) for _ in range(2))
    got = batch_engine().price(p, levels)
    ref = without.price(p, levels_without)
    assert np.abs(got - ref).max() <= 2.0 ** -60 * p.strike.max()
    assert np.abs(levels - levels_without).max() <= 2.0 ** -60 * p.strike.max()
    assert_close(got, CpuEngine().price(p), p, "tail book")
    counting = CudaBatchRunner(count=True)
    counting_without = runner_built_with("-DBATCH_TAIL=0")
    counting_without._defines.append("-DBATCH_COUNT")
    u1 = params_of(dict(dist="uniform", count=256, steps=2048), "american", False)
    spent = []
    for runner in (counting, counting_without):
        runner.group_steps(reset=True)
        priced = BatchEngine(runner=runner).price(u1)
        spent.append(runner.group_steps()[0])
    print(f"TAIL U1 (256 options) group-steps computed {spent[0]} against {spent[1]} without")
    assert spent[0] < 0.9 * spent[1]           # ~0.74 counted in numpy
    assert np.abs(priced - batch_engine().price(u1)).max() <= 2.0 ** -60 * u1.strike.max()


def test_european_two_levels_a_step_differ_by_rounding_only(rng):
    """European options step two levels at a time (cuda/batch.cu, twice_steps) down to level 3 or
    4: prices within rounding of the build that steps one level at a time (BATCH_TWICE=0), on every
    class edge and N = 1 .. 8 (where the two meet), calls and puts, and within the tolerance of the
    cpu engine; American prices bitwise the same. Calls that keep the Greeks' levels step one
    level at a time: prices and levels bitwise those of that build."""
    from pricer.engines.batch import BatchEngine
    from pricer.engines.serial import LEVEL_VALUES
    once = runner_built_with("-DBATCH_TWICE=0")
    steps = np.r_[np.arange(1, 9), CAPACITY, CAPACITY[:-1] + 1, rng.integers(9, MAX_STEPS + 1, 60)]
    p = every_kind(rng, steps)
    got = batch_engine().price(p)
    ref = BatchEngine(runner=once).price(p)
    american = p.american
    np.testing.assert_array_equal(got[american], ref[american])
    scale = np.maximum(np.abs(ref), 1e-8 * p.strike)
    assert (np.abs(got - ref) / scale).max() <= 1e-12
    assert (got[~american] != ref[~american]).any()        # the European steps did change
    assert_close(got, CpuEngine().price(p), p, "two levels a step")
    levels, levels_once = (np.empty((len(p), LEVEL_VALUES)) for _ in range(2))
    np.testing.assert_array_equal(batch_engine().price(p, levels),
                                  BatchEngine(runner=once).price(p, levels_once))
    np.testing.assert_array_equal(levels, levels_once)


def test_levels_without_a_positive_payoff_are_zeros(rng):
    """Options with no positive payoff (deep out of the money; the clamp leaves every unit out, so
    no step writes the Greeks' levels): prices and levels exactly zero for N >= 2, NaN levels for
    N = 1, even where the device buffers still hold another call's levels (N = 2 once kept
    them, found by the width test's seed 907071604)."""
    from pricer.engines.serial import LEVEL_VALUES
    from pricer.lattice import lattice_parameters
    steps = np.repeat([1, 2, 3, 4, 130, 1500, 5000], 4)
    n = steps.size
    call = np.tile([True, True, False, False], n // 4)
    strike = rng.uniform(80, 120, n)
    cols = dict(spot=strike * np.where(call, np.exp(-4.0), np.exp(4.0)), strike=strike,
                maturity=np.full(n, 0.5), rate=np.full(n, 0.02), dividend=np.full(n, 0.02),
                volatility=np.full(n, 0.02), steps=steps, call=call,   # at most e^1 from spot
                american=np.tile([True, False], n // 2))
    p = lattice_parameters(cols)
    assert (CpuEngine().price(p) == 0.0).all()
    engine = batch_engine()
    engine.price(options(rng, rng.integers(2, 3000, 200)), np.empty((200, LEVEL_VALUES)))
    levels = np.full((n, LEVEL_VALUES), 7.0)
    np.testing.assert_array_equal(engine.price(p, levels), np.zeros(n))
    np.testing.assert_array_equal(levels[steps >= 2], 0.0)
    assert np.isnan(levels[steps == 1]).all()


def test_classes_by_payoff_width_change_no_bit(rng):
    """American options of large chunks go to the kernel class of their payoff's width
    (cuda/batch.cu batch_width_keys; fewer registers where the zero units leave the top of the lattice empty):
    prices and the Greeks' levels bitwise those of classes by steps. Where the width is
    underestimated (a build whose keys leave out 300 nodes), the kernel refuses the option and the
    runner prices it again by its steps: bitwise the same again."""
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.batch_plan import WIDTH_ROWS
    from pricer.engines.serial import LEVEL_VALUES
    small = zero_region_book(rng, 300)
    big = options(rng, rng.integers(1, 6000, WIDTH_ROWS + 200))
    by_steps = BatchEngine(runner=CudaBatchRunner(by_width=False, one_wave=False))
    short = runner_built_with("-DBATCH_WIDTH_MARGIN=-300")
    for book in (big, small_in_a_big_chunk(small, big)):
        ref_levels = np.empty((len(book), LEVEL_VALUES))
        ref = by_steps.price(book, ref_levels)
        for runner in (CudaBatchRunner(), short):
            levels = np.empty((len(book), LEVEL_VALUES))
            np.testing.assert_array_equal(BatchEngine(runner=runner).price(book, levels), ref)
            np.testing.assert_array_equal(levels, ref_levels)
            assert runner.last_stats["priced_again"] == 0 or runner is short
    assert short.last_stats["priced_again"] > 0


def test_the_gpu_sorts_large_chunks_by_key_descending(rng):
    """Chunks of WIDTH_ROWS rows or more are keyed and sorted on the GPU (cuda/batch.cu,
    batch_width_keys, batch_key_starts, batch_sort_rows): the order on the device is a permutation
    of the rows with keys descending, American rows keyed at most by their steps and the others
    by their steps, the counts those of the keys; in chunks of WIDTH_ROWS (two sorted on the GPU
    through both buffer sets, the last on the host) prices are bitwise those of one chunk by
    steps."""
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.batch_plan import (INPUT_BYTES_PER_OPTION, KEY_BINS, WIDTH_ROWS,
                                           fill_flags, fill_floats, input_views, order_span,
                                           width_keys)
    runner = CudaBatchRunner()
    p = options(rng, rng.integers(1, MAX_STEPS + 1, WIDTH_ROWS + 500))
    got = BatchEngine(runner=runner).price(p)
    n, buf = len(p), runner._buffers[0]
    order, keys = np.empty(n, np.int32), np.empty(n, np.int32)
    runner.rt.cuda.memcpy_dtoh(order, int(buf["input_d"]) + order_span(n)[0])
    runner.rt.cuda.memcpy_dtoh(keys, buf["keys_d"])
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    assert np.all(np.diff(keys[order]) <= 0)
    np.testing.assert_array_equal(buf["counts"], np.bincount(keys, minlength=KEY_BINS))
    np.testing.assert_array_equal(keys[~p.american], p.steps[~p.american])
    assert np.all(keys[p.american] <= p.steps[p.american]) and (keys < p.steps).any()
    # the host's width_keys (one_wave_by_width) are the GPU's for American rows; an asset price
    # rounded apart by an ulp may move a ceiling by one
    views = input_views(np.zeros(n * INPUT_BYTES_PER_OPTION, dtype=np.uint8), n)
    fill_floats(p, slice(0, n), views)
    fill_flags(p, slice(0, n), views)
    host = width_keys(views.floats, views.steps, views.call, views.american, np.empty(n, np.int32))
    apart = np.abs(host[p.american].astype(int) - keys[p.american])
    assert apart.max() <= 1 and np.count_nonzero(apart) <= n // 1000
    by_steps = BatchEngine(runner=CudaBatchRunner(by_width=False)).price(p)
    np.testing.assert_array_equal(got, by_steps)
    q = options(rng, rng.integers(1, 3000, 2 * WIDTH_ROWS + 700))
    chunked = CudaBatchRunner(chunk_options=WIDTH_ROWS)
    np.testing.assert_array_equal(BatchEngine(runner=chunked).price(q),
                                  BatchEngine(runner=CudaBatchRunner(by_width=False)).price(q))
    assert chunked.last_stats["chunks"] == 3


def small_in_a_big_chunk(small, big):
    """The edge cases of `small` among the options of `big`, one chunk of more than WIDTH_ROWS."""
    from pricer.lattice import LatticeParams, PACKED_FIELDS
    return LatticeParams(*(np.concatenate([getattr(small, f), getattr(big, f)])
                           for f in PACKED_FIELDS))
