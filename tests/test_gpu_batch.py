"""The `batch` backend (cuda/batch.cu through pricer.engines.gpu.batch_runner, GpuEngine("batch"))
against the `cpu` engine (bitwise equal to serial) on fresh random options: every class edge, mixed
portfolios, N = 1, a portfolio of many chunks, the launches the schedule chooses (a split last
wave, a narrower G, heaviest first, the GPU's sort), the re-pricing of refused options, the
Greeks' levels, options wider than every class (through the regimes), gpu and hybrid routing
options to the batch runner, and two MPI ranks on one GPU.
Marked `gpu`: they skip here with the reason and run on the GPU machine (../shared/device)."""

from __future__ import annotations


import numpy as np
import pytest

from pricer.engines import gpu_available, resolve_backend
from pricer.engines.cpu.parallel import CpuEngine
from pricer.engines.gpu.batch_layout import (INPUT_BYTES_PER_OPTION, KEY_BINS, fill_flags,
                                             fill_floats, input_views, order_span)
from pricer.engines.gpu.batch_plan import (CAPACITY, CLASSES, KERNELS, MAX_STEPS, WIDTH_ROWS,
                                           class_of, width_keys)
from pricer.model.lattice import LEVEL_VALUES, lattice_parameters

from gpu_cases import GPU, every_kind, keep_p_inside, needs_gpu, options

# relative; absolute, scaled by the strike, for prices below 1e-8 of the strike
TOLERANCE = 1e-11            # the batch runner (steps <= MAX_STEPS)
REGIME_TOLERANCE = 1e-9      # options wider than every class, through the single-option regimes


pytestmark = GPU


def assert_close(got, ref, p, label=""):
    """Prices within TOLERANCE of ref's (REGIME_TOLERANCE for options wider than every class); a
    NaN is off."""
    scale = np.where(np.abs(ref) < 1e-8 * p.strike, p.strike, np.abs(ref))
    err = np.abs(got - ref) / scale
    bad = ~(err <= np.where(p.steps <= MAX_STEPS, TOLERANCE, REGIME_TOLERANCE))
    worst = int(np.argmax(np.where(np.isnan(err), np.inf, err))) if err.size else 0
    assert not bad.any(), (f"{label}: {bad.sum()} off; N={p.steps[worst]} call={p.call[worst]} "
                           f"american={p.american[worst]} got {got[worst]!r} "
                           f"ref {ref[worst]!r} err {err[worst]:.2e}")


def assert_levels_close(levels, ref, p, label=""):
    """The first levels' values (pricer.model.greeks) within the prices' tolerance of ref's, NaN
    exactly where ref's are (N = 1)."""
    np.testing.assert_array_equal(np.isnan(levels), np.isnan(ref), err_msg=f"{label}: NaN levels")
    rows = np.flatnonzero(~np.isnan(ref).any(axis=1))
    q = p.take(rows)
    for col in range(LEVEL_VALUES):
        assert_close(levels[rows, col], ref[rows, col], q, f"{label} level value {col}")


def assert_sample_close(rng, got, p, label, count=40, levels=None, always=()):
    """`count` random rows of a book priced on the GPU (and `always`'s rows), against the cpu
    engine's prices (and levels) of those rows alone."""
    pick = np.unique(np.r_[np.asarray(always, dtype=np.int64),
                           rng.choice(len(p), min(count, len(p)), replace=False)])
    q = p.take(pick)
    ref_levels = None if levels is None else np.empty((pick.size, LEVEL_VALUES))
    assert_close(got[pick], CpuEngine().price(q, ref_levels), q, label)
    if levels is not None:
        assert_levels_close(levels[pick], ref_levels, q, label)


def cpu_levels(p):
    """The cpu engine's prices and first levels' values of p."""
    levels = np.empty((len(p), LEVEL_VALUES))
    return CpuEngine().price(p, levels), levels


def new_levels(p):
    return np.full((len(p), LEVEL_VALUES), -1.0)


def gpu_engine(mode="batch", **kw):
    from pricer.engines.gpu.engine import GpuEngine
    return GpuEngine(mode, **kw)


def batch_runner(**kw):
    from pricer.engines.gpu.batch_runner import CudaBatchRunner
    return CudaBatchRunner(**kw)


def runner_built_with(name: str, value: int):
    """A CudaBatchRunner whose kernels are built with -D{name}={value} in place of the value
    batch_layout.defines() gives (a deliberately wrong contract, to provoke the runner's
    fallbacks)."""
    runner = batch_runner()
    flag = f"-D{name}="
    assert any(d.startswith(flag) for d in runner._defines), (name, runner._defines)
    runner._defines = [d for d in runner._defines if not d.startswith(flag)] + [f"{flag}{value}"]
    return runner


def test_every_class_edge_every_kind(rng):
    # the top of every class (steps = capacity: the top node fed in as a neighbour) and the bottom
    # of the next
    edges = sorted({1, 2, 3, *(CAPACITY - 1).tolist(), *CAPACITY[:-1].tolist(),
                    *(CAPACITY[:-1] + 1).tolist()})
    p = every_kind(rng, edges)
    assert_close(gpu_engine().price(p), CpuEngine().price(p), p, "class edges")


def test_mixed_portfolio_with_options_wider_than_every_class(rng):
    steps = np.r_[rng.integers(1, 4097, 300), rng.integers(4097, MAX_STEPS + 1, 12),
                  [MAX_STEPS + 1, 20_000]]
    p = options(rng, rng.permutation(steps))
    got, ref = gpu_engine(t2=200).price(p), CpuEngine().price(p)
    batch = p.steps <= MAX_STEPS
    assert_close(got[batch], ref[batch], p.take(np.flatnonzero(batch)), "batch part")
    wide = np.flatnonzero(~batch)
    np.testing.assert_allclose(got[wide], ref[wide], rtol=REGIME_TOLERANCE)


def test_gpu_and_hybrid_price_up_to_max_steps_with_the_batch_runner(rng):
    """gpu and hybrid send every option of at most MAX_STEPS steps (above hybrid's cpu_max_steps)
    to the batch runner, as batch does: the runner gets exactly those rows, and their prices and
    levels are bitwise batch's; hybrid's options of at most cpu_max_steps are the cpu engine's,
    bitwise; wider options go through the regimes, within REGIME_TOLERANCE of the cpu engine."""
    from pricer.engines.gpu.batch_runner import CudaBatchRunner

    class Recording(CudaBatchRunner):
        """The batch runner, noting the steps of the rows each call gets."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def price(self, params, levels=None):
            self.seen.append(np.array(params.steps))
            return super().price(params, levels)

        def price_rows(self, params, rows, levels=None):
            self.seen.append(params.steps[rows])
            return super().price_rows(params, rows, levels)

    cpu_max = 500
    steps = np.r_[1, 2, cpu_max - 1, cpu_max, cpu_max + 1, cpu_max + 2, MAX_STEPS - 1, MAX_STEPS,
                  rng.integers(1, cpu_max + 1, 20), rng.integers(cpu_max + 1, MAX_STEPS + 1, 40),
                  MAX_STEPS + 1, rng.integers(MAX_STEPS + 2, 20_000, 2)]
    p = options(rng, rng.permutation(steps))
    ref, ref_levels = cpu_levels(p)
    got, levels, runners = {}, {}, {}
    for mode, kw in (("batch", {}), ("gpu", {}), ("hybrid", dict(cpu_max_steps=cpu_max))):
        runners[mode] = Recording()
        levels[mode] = new_levels(p)
        got[mode] = gpu_engine(mode, runner=runners[mode], **kw).price(p, levels[mode])
        assert_close(got[mode], ref, p, mode)
        assert_levels_close(levels[mode], ref_levels, p, mode)
    on_runner = p.steps <= MAX_STEPS
    runner_only = on_runner & (p.steps > cpu_max)
    for mode, rows in (("batch", on_runner), ("gpu", on_runner), ("hybrid", runner_only)):
        seen = np.concatenate(runners[mode].seen) if runners[mode].seen else np.array([], int)
        np.testing.assert_array_equal(np.sort(seen), np.sort(p.steps[rows]), err_msg=mode)
    for mode, rows in (("gpu", on_runner), ("hybrid", runner_only)):
        np.testing.assert_array_equal(got[mode][rows], got["batch"][rows], err_msg=mode)
        np.testing.assert_array_equal(levels[mode][rows], levels["batch"][rows], err_msg=mode)
    on_cpu = p.steps <= cpu_max
    np.testing.assert_array_equal(got["hybrid"][on_cpu], ref[on_cpu])
    wide = ~on_runner
    for mode in got:
        np.testing.assert_allclose(got[mode][wide], ref[wide], rtol=REGIME_TOLERANCE,
                                   err_msg=mode)


def test_warm_up_launches_every_class_and_leaves_prices_alone(rng):
    """The run warms the engine up while rank 0 reads: every kernel once (the classes and the
    split last waves' kernels), on a small option, then real work."""
    engine = gpu_engine()
    engine.warm_up()
    assert sorted(engine.runner()._functions) == list(range(len(KERNELS)))
    p = options(rng, rng.integers(1, MAX_STEPS + 1, 64))
    assert_close(engine.price(p), CpuEngine().price(p), p, "after warm_up")


def test_every_kernel_prices_the_warm_up_option():
    """warm_up launches every kernel, whatever its class, on one option of WARM_UP_STEPS steps:
    each prices it as the cpu engine does, so those launches are ones the kernels are made for."""
    from pricer.engines.base import sample_params
    from pricer.engines.gpu.batch_runner import WARM_UP_STEPS

    for put in (True, False):
        p = sample_params([WARM_UP_STEPS])
        p.call[0] = not put
        got = batch_runner().each_kernel(p)
        want = CpuEngine().price(p)[0]
        assert got.shape == (len(KERNELS),)
        np.testing.assert_allclose(got, want, rtol=TOLERANCE, err_msg=f"put={put}")


def fill_the_lattice(p, row: int) -> None:
    """Row `row` of p made a put whose payoff is positive on every node of the last level (its
    payoff's width is its steps: no narrower G holds it)."""
    p.call[row] = False
    p.strike[row] = 2 * p.spot[row] * np.exp(p.steps[row] * p.log_up[row])


def test_a_split_last_wave_prices_within_tolerance(rng):
    """A one-class chunk a quarter wave over one whose widest payoff fills the lattice (so
    batch_plan.one_wave_by_width cannot narrow it): its last partial wave goes to twice the warps
    per option (batch_plan.split_last_wave), two launches; prices within the tolerance of the cpu
    engine."""
    for steps in (1100, 3000):                  # W = 2 to W = 4; W = 4 to W = 8
        runner = batch_runner()
        at_once = runner.resident(int(class_of([steps])[0]))
        assert at_once > 0
        p = options(rng, [steps] * (at_once + at_once // 4))
        wide = int(np.argmin(p.log_up))         # the smallest strike that fills the lattice
        fill_the_lattice(p, wide)
        got = gpu_engine(runner=runner).price(p)
        assert runner.last_stats["launches"] == 2, runner.last_stats
        assert runner.last_stats["priced_again"] == 0
        assert_sample_close(rng, got, p, f"split, N = {steps}", always=[wide])


def test_a_chunk_over_a_wave_in_the_g_of_its_widest_payoff(rng):
    """A one-class chunk over a wave that the G of its widest payoff holds at once
    (batch_plan.one_wave_by_width): one launch of that narrower class, nothing priced again;
    prices and the Greeks' levels within the tolerance of the cpu engine."""
    for steps in (2048, 1500):                  # (2, 8) to (2, 5); (2, 6) to (2, 3)
        runner = batch_runner()
        cls = int(class_of([steps])[0])
        p = options(rng, [steps] * (runner.resident(cls) + 40))
        p.strike[:] = p.spot            # at the money on CRR trees: widths about half the steps
        levels = new_levels(p)
        got = gpu_engine(runner=runner).price(p, levels)
        stats = runner.last_stats
        assert stats["launches"] == 1 and stats["priced_again"] == 0, (steps, len(p), stats)
        used = [KERNELS[c] for c in runner._functions]
        assert any(g < KERNELS[cls][1] and w == KERNELS[cls][0] for w, g in used), used
        assert_sample_close(rng, got, p, f"one wave, N = {steps}", levels=levels)


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


def test_a_one_wave_launch_runs_heaviest_first(rng):
    """A one-class chunk in one wave with several blocks per SM (batch_plan.heaviest_first): the
    GPU writes its order heaviest first (cuda/batch.cu, batch_work_order), a permutation of the
    rows, descending in the work estimate computed here, in one launch; prices and the Greeks'
    levels within the tolerance of the cpu engine."""
    runner = batch_runner()
    held = runner.resident(int(class_of([2048])[0]))    # (2, 8)
    p = options(rng, [2048] * (held - 8))               # 99 % of a wave
    levels = new_levels(p)
    got = gpu_engine(runner=runner).price(p, levels)
    n = len(p)
    order = np.empty(n, dtype=np.int32)
    runner.rt.cuda.memcpy_dtoh(order, int(runner._buffers[0]["input_d"]) + order_span(n)[0])
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    estimates = work_estimates(p)[order]
    assert np.all(np.diff(estimates) <= 1e-4 * estimates.max()), "not heaviest first"
    assert not np.array_equal(order, np.arange(n))      # not the rows' order by steps
    assert runner.last_stats["launches"] == 1
    assert_sample_close(rng, got, p, "heaviest first", levels=levels)


def test_one_step_options(rng):
    p = every_kind(rng, [1] * 8)
    assert_close(gpu_engine().price(p), CpuEngine().price(p), p, "N = 1")


def test_many_chunks_keep_the_input_order(rng):
    p = options(rng, rng.integers(1, 1500, 1000))
    engine = gpu_engine(chunk_options=37)
    got = engine.price(p)
    assert engine.runner().last_stats["chunks"] == 28
    assert_close(got, CpuEngine().price(p), p, "chunked")
    again = gpu_engine(chunk_options=10**6).price(p)             # one chunk: the same kernels
    np.testing.assert_array_equal(got, again)


def test_kept_levels_for_greeks_on_every_gpu_backend(rng):
    """The first levels' values (pricer.model.greeks) from the batch kernels, and from the regimes
    for options wider than every class (GPU down to level 2, the host keeps the last two), on
    batch, hybrid and gpu, against the cpu engine's."""
    steps = np.r_[1, 2, 3, 4, 5, rng.integers(6, 3000, 40), rng.integers(9000, 12000, 2),
                  rng.integers(MAX_STEPS + 1, 18_000, 2)]
    p = options(rng, steps)
    ref, ref_levels = cpu_levels(p)
    engines = {"batch": gpu_engine(), "hybrid": gpu_engine("hybrid", t2=64),
               "gpu": gpu_engine("gpu")}
    for name, engine in engines.items():
        levels = new_levels(p)
        assert_close(engine.price(p, levels), ref, p, f"{name} price")
        assert np.isnan(levels[0]).all() and np.isnan(ref_levels[0]).all()
        assert_levels_close(levels, ref_levels, p, name)


def test_richardson_and_greeks_on_every_gpu_backend(rng):
    """--richardson and --greeks (pricer.model.greeks: the extra and bumped lattices in the same
    engine call) on batch, hybrid and gpu against the cpu engine's, on fresh random options."""
    from pricer.model.greeks import Analytics, price_with_analytics
    n = 40
    cols = dict(spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n),
                maturity=rng.uniform(0.1, 2.0, n), rate=rng.uniform(0.0, 0.06, n),
                dividend=rng.uniform(0.0, 0.04, n), volatility=rng.uniform(0.15, 0.5, n),
                steps=rng.integers(10, 5000, n), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.5)
    ids = np.arange(1, n + 1)
    what = Analytics(greeks=True, richardson=True)
    ref = price_with_analytics(CpuEngine(), cols, "crr", ids, what)
    engines = {"batch": gpu_engine(), "hybrid": gpu_engine("hybrid", t2=64),
               "gpu": gpu_engine("gpu")}
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
    from pricer.io.results import read_results
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
    from pricer.model.greeks import GREEKS
    from pricer.io.results import read_results
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
    from pricer.model.lattice import lattice_parameters
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
def test_skip_books_within_tolerance(rng, tree):
    """American options where the batch kernels skip groups of surely exercised nodes
    (cuda/batch.cu, skip_check), and where the margin is thin or missing: prices and the Greeks'
    levels within the tolerance of the cpu engine."""
    p = skip_book(rng, 400, tree)
    levels = new_levels(p)
    got = gpu_engine().price(p, levels)
    ref, ref_levels = cpu_levels(p)
    assert_close(got, ref, p, f"skip book, {tree}")
    assert_levels_close(levels, ref_levels, p, f"skip book, {tree}")


def zero_region_book(rng, n, rates=(0.0, 0.05, 0.3), drift_steps=(10, 20, 50, 100),
                     steps=None, drift_vol=0.05):
    """Options whose zero region (above the last positive payoff) ranges from nothing (deep in the
    money) to the whole lattice (no positive payoff), with JR trees whose d exceeds 1 for some puts
    (no clamp for those American puts; drift_steps and drift_vol theirs), every class, calls and puts, American
    and European; steps by default the class edges' bottom and random ones."""
    from pricer.model.lattice import TREE_NAMES, lattice_parameters
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


def test_zero_units_left_out_within_tolerance(rng):
    """The batch kernels never compute the units above an option's last positive payoff
    (cuda/batch.cu, zero_clamp; calls on the mirrored lattice): on edge cases, prices and the
    Greeks' levels within the tolerance of the cpu engine, even where the device buffers first
    held another book's levels (none may stay); and on the bench's books (pricer bench batch),
    American and European, a sample of them."""
    from pricer.tools.bench_batch import params_of
    p = zero_region_book(rng, 300)
    levels = new_levels(p)
    engine = gpu_engine()
    engine.price(options(rng, rng.integers(3, 3000, len(p))), np.empty((len(p), LEVEL_VALUES)))
    got = engine.price(p, levels)
    ref, ref_levels = cpu_levels(p)
    assert_close(got, ref, p, "zero region book")
    assert_levels_close(levels, ref_levels, p, "zero region book")
    for spec in (dict(dist="uniform", count=10_000, steps=1000), dict(dist="random", count=5_000)):
        for exercise in ("american", "european"):
            q = params_of(spec, exercise, False)
            assert_sample_close(rng, engine.price(q), q, f"bench {spec['dist']} {exercise}",
                                count=100)


def test_negligible_units_left_out_within_tolerance(rng):
    """The batch kernels stop computing the units whose values a bound puts below K 2^-70
    (cuda/batch.cu, tail_table): on books from deep in the money to far out of it (JR puts with
    d > 1 among them, rates up to 30 % and below zero), every class, calls and puts, American and
    European, prices and the Greeks' levels within the tolerance of the cpu engine."""
    p = zero_region_book(rng, 300, rates=(-0.03, 0.0, 0.05, 0.3), drift_steps=(512, 600, 1000, 2000),
                         steps=rng.integers(512, MAX_STEPS + 1, 300), drift_vol=0.008)   # the tail's range
    levels = new_levels(p)
    got = gpu_engine().price(p, levels)
    ref, ref_levels = cpu_levels(p)
    assert_close(got, ref, p, "tail book")
    assert_levels_close(levels, ref_levels, p, "tail book")


def test_european_two_levels_a_step_within_tolerance(rng):
    """European options step two levels at a time (cuda/batch.cu, twice_steps) down to level 3 or
    4, calls that keep the Greeks' levels one level at a time: on every class edge and N = 1 .. 8
    (where the two meet), calls and puts, American and European, prices with and without the
    levels, and the levels, within the tolerance of the cpu engine."""
    steps = np.r_[np.arange(1, 9), CAPACITY, CAPACITY[:-1] + 1, rng.integers(9, MAX_STEPS + 1, 60)]
    p = every_kind(rng, steps)
    ref, ref_levels = cpu_levels(p)
    assert_close(gpu_engine().price(p), ref, p, "two levels a step")
    levels = new_levels(p)
    assert_close(gpu_engine().price(p, levels), ref, p, "two levels a step, with levels")
    assert_levels_close(levels, ref_levels, p, "two levels a step")


def test_levels_without_a_positive_payoff_are_zeros(rng):
    """Options with no positive payoff (deep out of the money; the clamp leaves every unit out, so
    no step writes the Greeks' levels): prices and levels exactly zero for N >= 2, NaN levels for
    N = 1, even where the device buffers still hold another call's levels."""
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
    engine = gpu_engine()
    engine.price(options(rng, rng.integers(2, 3000, 200)), np.empty((200, LEVEL_VALUES)))
    levels = np.full((n, LEVEL_VALUES), 7.0)
    np.testing.assert_array_equal(engine.price(p, levels), np.zeros(n))
    np.testing.assert_array_equal(levels[steps >= 2], 0.0)
    assert np.isnan(levels[steps == 1]).all()


def test_options_refused_by_the_class_of_their_width_are_priced_again(rng):
    """American options of large chunks go to the kernel class of their payoff's width
    (cuda/batch.cu batch_width_keys; fewer registers where the zero units leave the top of the
    lattice empty), none priced again. Where the width is underestimated (a build whose keys
    leave out 300 nodes), the kernel refuses the option (NaN) and the runner prices it again in
    the class of its steps: prices and the Greeks' levels bitwise those of the class of its
    width, and within the tolerance of the cpu engine."""
    small = zero_region_book(rng, 300)
    big = options(rng, rng.integers(1, 6000, WIDTH_ROWS + 200))
    short = runner_built_with("WIDTH_MARGIN", -300)
    for book, edges in ((big, ()), (small_in_a_big_chunk(small, big), np.arange(len(small)))):
        runner = batch_runner()
        levels = new_levels(book)
        got = gpu_engine(runner=runner).price(book, levels)
        assert runner.last_stats["priced_again"] == 0
        short_levels = new_levels(book)
        np.testing.assert_array_equal(gpu_engine(runner=short).price(book, short_levels), got)
        np.testing.assert_array_equal(short_levels, levels)
        assert_sample_close(rng, got, book, "by width", levels=levels, always=edges)
    assert short.last_stats["priced_again"] > 0


def test_the_gpu_sorts_large_chunks_by_key_descending(rng):
    """Chunks of WIDTH_ROWS rows or more are keyed and sorted on the GPU (cuda/batch.cu,
    batch_width_keys, batch_key_starts, batch_sort_rows): the order on the device is a permutation
    of the rows with keys descending, American rows keyed at most by their steps and the others
    by their steps, the counts those of the keys; prices within the tolerance of the cpu engine.
    In chunks of WIDTH_ROWS (two sorted on the GPU through both buffer sets, the last on the
    host) prices are bitwise those of one chunk."""
    runner = batch_runner()
    p = options(rng, rng.integers(1, MAX_STEPS + 1, WIDTH_ROWS + 500))
    got = gpu_engine(runner=runner).price(p)
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
    assert_sample_close(rng, got, p, "sorted on the GPU")
    q = options(rng, rng.integers(1, 3000, 2 * WIDTH_ROWS + 700))
    chunked = batch_runner(chunk_options=WIDTH_ROWS)
    np.testing.assert_array_equal(gpu_engine(runner=chunked).price(q), gpu_engine().price(q))
    assert chunked.last_stats["chunks"] == 3


def small_in_a_big_chunk(small, big):
    """The edge cases of `small` (its rows first) among the options of `big`, one chunk of more
    than WIDTH_ROWS."""
    from pricer.model.lattice import LatticeParams, PACKED_FIELDS
    return LatticeParams(*(np.concatenate([getattr(small, f), getattr(big, f)])
                           for f in PACKED_FIELDS))


def test_started_calls_overlap_and_keep_their_prices(rng):
    """Engine.start / finish on the batch runner: calls started before the one ahead of them is
    finished (two out at once, chunks of several sizes, one call growing the buffers, one priced
    again after the class of its width refused rows, finished out of order) give every price
    bitwise as a call priced alone."""
    books = [options(rng, rng.integers(1, 3000, n)) for n in (WIDTH_ROWS + 300, 700, 50,
                                                              3 * WIDTH_ROWS)]
    small = zero_region_book(rng, 300)
    books.append(small_in_a_big_chunk(small, options(rng, rng.integers(1, 6000, WIDTH_ROWS))))
    alone = [gpu_engine(runner=runner_built_with("WIDTH_MARGIN", -300)).price(b) for b in books]
    runner = runner_built_with("WIDTH_MARGIN", -300)
    runner.chunk_options = WIDTH_ROWS + 100        # the first and fourth books in several chunks
    engine = gpu_engine(runner=runner)
    runner.prepare(np.array([2, 3]))               # buffers of a small chunk, grown on the way
    got = [None] * len(books)
    ahead = None
    for k, book in enumerate(books):
        started = (k, engine.start(book))
        assert not isinstance(started[1], np.ndarray)          # out on the GPU, not priced
        if ahead is not None:
            got[ahead[0]] = engine.finish(ahead[1])
        ahead = started
    got[ahead[0]] = engine.finish(ahead[1])
    first, second = engine.start(books[1]), engine.start(books[3])     # finished out of order
    got.append(engine.finish(second))
    got.append(engine.finish(first))
    for k, want in enumerate(alone + [alone[3], alone[1]]):
        np.testing.assert_array_equal(got[k], want, err_msg=str(k))
    assert runner.last_stats["chunks"] == 1
