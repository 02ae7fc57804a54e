"""The GPU engines (`gpu`, `hybrid`, `batch`) and the single regimes of `pricer bench gpu`
(pricer.tools.bench_gpu.OneRegime: wavefront, tiled, warp) against the serial engine.

Tests marked `gpu` need pycuda, a CUDA device and nvcc, and skip here with the reason; they run for
real on the GPU machine (../shared/device/README.md):
    source .device/setup.sh && python3 -m pytest -m gpu -q tests/test_gpu.py
PRICER_GPU_LARGE=1 adds N = 1 000 000 (compared with the `cpu` engine, bitwise equal to serial).
The emulation tests (tests/numpy_kernels.py: numpy stand-ins for the kernels, same tiles and halos,
exact arithmetic) run everywhere. They use exact-mode configurations (fma=False), where the engine
sends every option to the regimes (GpuEngine.price_one): with fma, options up to the batch kernels'
MAX_STEPS go to the batch runner, which only a GPU (or a stand-in runner) can run.

What is compared how: the exact mode (fma=False) is bitwise the serial engine's; with fma, the
regimes and the batch runner are within `tolerance` (1e-11 relative up to 10 000 steps) of it, and
gpu/hybrid price options up to MAX_STEPS bitwise as `batch` does (the same runner).
"""

from __future__ import annotations

import os

from dataclasses import replace

import numpy as np
import pytest

from numpy_kernels import NumpyKernels
from pricer.engines.cpu.kernels import power_tables, table_kinds
from pricer.engines.cpu.parallel import CpuEngine
from pricer.engines.cpu.serial import SerialEngine
from pricer.engines.gpu.batch_plan import MAX_STEPS
from pricer.engines.gpu.config import GpuConfig
from pricer.engines.gpu.engine import MODES, GpuEngine
from pricer.engines.gpu.runtime import local_rank
from pricer.model.lattice import (CENTRED, CLAMPED, LEVEL_VALUES, PACKED_FIELDS, LatticeParams,
                                  lattice_parameters)
from pricer.tools.bench_gpu import OneRegime

from gpu_cases import ThroughRegimes, every_kind, needs_gpu, options

# The single regimes `pricer bench gpu` runs (Cao (2025), Table 5), each all the way down.
REGIMES = ("wavefront", "tiled", "warp")

# A small configuration whose thresholds and tile widths are cheap to straddle, exact arithmetic:
# tiled above t1 = 300 (tiles of 128 nodes, 50 steps a launch), the persistent kernel below (tiles of
# 64 nodes, 48 owned, halos every 16 steps), below level 100 its narrow shape (tiles of 32 nodes, 16
# owned); where the persistent kernel gives up (engine.pers_off), the mid fallback instead (the
# tiled kernel in tiles of 64 nodes, 25 steps a launch). The warp shape (128-node tiles, 30 steps a
# launch) is OneRegime("warp")'s.
SMALL_PERS = GpuConfig(t1=300, t2=40, tiled_b=32, tiled_vt=4, tiled_k=50, warp_vt=4, warp_k=30,
                       mid_b=32, mid_vt=2, mid_k=25, pers_vt=2, pers_k=16, pers_warps=2,
                       pers_narrow_vt=1, pers_narrow_below=100, fma=False)
# Wider tiles, an odd persistent shape (tiles of 96 nodes, halos every 9 steps), its narrow shape
# below level 700, and a mid fallback of one node per thread.
MEDIUM_PERS = GpuConfig(t1=2000, t2=100, tiled_b=64, tiled_vt=4, tiled_k=100, warp_vt=8, warp_k=64,
                        mid_b=64, mid_vt=1, mid_k=40, pers_vt=3, pers_k=9, pers_warps=1,
                        pers_narrow_vt=1, pers_narrow_below=700, fma=False)
CONFIGS = {"small-pers": SMALL_PERS, "medium-pers": MEDIUM_PERS}
# tiles the stand-in GPUs of the tests hold at once (NumpyKernels.pers_tiles, and a CudaKernels cut
# down to it), so that levels wider than that (tiled first) are cheap to reach
SMALL_PERS_TILES = 8


def error(got, ref, strike):
    """Relative error; absolute scaled by the strike where the price is below 1e-8 of the strike."""
    scale = np.where(np.abs(ref) < 1e-8 * strike, strike, np.abs(ref))
    return np.abs(got - ref) / scale


def tolerance(steps):
    return np.where(np.asarray(steps) <= 10_000, 1e-11, 1e-9)


def assert_close(got, ref, p, label=""):
    err = error(got, ref, p.strike)
    bad = ~(err <= tolerance(p.steps))     # a NaN or inf price is off too
    assert not bad.any(), (f"{label}: {bad.sum()} prices off; worst N={p.steps[np.argmax(err)]} "
                           f"err={err.max():.3g} got={got[np.argmax(err)]!r} ref={ref[np.argmax(err)]!r}")


def boundary_steps(c: GpuConfig, pers_tiles: int = SMALL_PERS_TILES):
    """N on either side of every threshold and tile edge of `c`: the regimes' (T1, T2), the tiled,
    warp and mid shapes' widths and launch steps, the persistent kernel's tile and epoch edges (from
    T2 and from 0) and widest level, and its narrow shape's edges and hand-over."""
    s = {1, 2, 3, 4, 5, 31, 32, 33, 100}
    for edge in (c.t2, c.t1, c.warp_w, c.tiled_w, c.t2 + c.warp_k, c.t1 + c.tiled_k,
                 c.t2 + c.warp_w, c.t1 + 2 * c.tiled_k, c.mid_w, c.t2 + c.mid_k, c.t2 + c.mid_w,
                 c.warp_k, c.tiled_k, c.mid_k):
        s.update({edge - 1, edge, edge + 1})
    own = c.pers_w - c.pers_k
    for edge in (c.pers_k, own, c.pers_w, 2 * own, 2 * own + c.pers_k, c.t2 + c.pers_k,
                 c.t2 + own, c.t2 + 2 * c.pers_k, pers_tiles * own):
        s.update({edge - 1, edge, edge + 1})
    if c.narrow():  # its shape's edges, and where it takes over (below the widest level it holds)
        n = c.narrow()
        own = n.pers_w - n.pers_k
        below = c.pers_narrow_below
        if below is None:               # as GpuEngine._pers_phases, on the stand-in GPU
            below = NumpyKernels.sub_partitions_count * (c.pers_w - c.pers_k) // 2
        mid = min(below, pers_tiles * own - 1)
        for edge in (own, n.pers_w, 2 * own, mid, mid + c.pers_k, mid + own, pers_tiles * own):
            s.update({edge - 1, edge, edge + 1})
    return sorted(x for x in s if x >= 1)


def through_regimes(engine, p, levels=None) -> np.ndarray:
    """Prices of p through engine's regimes: GpuEngine.price_one per option, or OneRegime's own."""
    if isinstance(engine, OneRegime):
        return engine.price(p)
    return ThroughRegimes(engine).price(p, levels)


# ---------------------------------------------------------------------------------------------
# Everywhere: the schedule and the kernels' index logic, through the numpy emulation.

def small_numpy_kernels(config):
    kernels = NumpyKernels(config)
    kernels.pers_tiles = SMALL_PERS_TILES
    return kernels


def emulated(mode, config, pers_off=False, **kw):
    """GpuEngine(mode) on the emulated kernels; pers_off: as after the persistent kernel gave up,
    so the mid fallback runs below T1 instead."""
    engine = GpuEngine(mode, config=config, kernels=small_numpy_kernels(config), **kw)
    engine.pers_off = pers_off
    return engine


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("below_t1", ["pers", "mid"])
def test_emulated_kernels_equal_serial(mode, config, below_t1, rng):
    """GpuEngine's schedule in the exact mode (every option through the regimes) across every edge
    of the configuration, with the persistent kernel below T1 or (pers_off) the mid fallback."""
    p = options(rng, boundary_steps(config) + list(rng.integers(1, 2500, 6)))
    got = emulated(mode, config, pers_off=below_t1 == "mid").price(p)
    ref = SerialEngine().price(p)
    # same tables, same operations in the same order: bitwise
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_emulated_one_regime_equals_serial(regime, config, rng):
    """`pricer bench gpu`'s single regimes (OneRegime), each all the way down to level 0, bitwise
    the serial engine's on the configuration's edges (exact arithmetic)."""
    steps = boundary_steps(config)
    if regime == "wavefront":      # one launch a step: the narrower half is enough
        steps = [s for s in steps if s <= 700]
    p = options(rng, steps + list(rng.integers(1, 1500, 4)))
    engine = OneRegime(regime, config=config, kernels=NumpyKernels(config))
    np.testing.assert_array_equal(engine.price(p), SerialEngine().price(p))
    assert engine.price_one(p, 1) == SerialEngine().price(p.take([1]))[0]


class RecordingRunner(SerialEngine):
    """A stand-in for the batch runner (GpuEngine(runner=...)): the serial engine, noting the steps
    of each call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def price(self, params, levels=None):
        self.seen.extend(int(s) for s in params.steps)
        return super().price(params, levels)


@pytest.mark.parametrize("mode", MODES)
def test_routes(mode, rng):
    """Each option to the first route that takes it: hybrid's N <= cpu_max_steps to the CPU; with
    fma, N <= MAX_STEPS to the batch runner; the rest to the regimes. The exact mode never uses
    the runner. Levels (Greeks) come back from every route in the input's order."""
    config = replace(SMALL_PERS, fma=True)
    cpu_max = config.t2 if mode == "hybrid" else 0
    steps = np.array([MAX_STEPS + 1, 1, config.t2, config.t2 + 1, 500, MAX_STEPS, 2])
    p = options(rng, steps)
    ref_levels = np.empty((len(p), LEVEL_VALUES))
    ref = SerialEngine().price(p, ref_levels)
    for fma in (True, False):
        # the exact mode without the two widest options: it sends them to the regimes too, whose
        # emulation costs seconds an option of that size
        rows = np.arange(len(p)) if fma else np.flatnonzero(steps < MAX_STEPS)
        q = p.take(rows)
        runner = RecordingRunner()
        engine = GpuEngine(mode, config=replace(config, fma=fma),
                           kernels=small_numpy_kernels(replace(config, fma=fma)), runner=runner)
        assert engine.cpu_max_steps == cpu_max
        levels = np.full((len(q), LEVEL_VALUES), -1.0)
        got = engine.price(q, levels)
        # the regimes' emulation is exact (NumpyKernels ignores fma), the stand-in runner serial
        np.testing.assert_array_equal(got, ref[rows])
        assert np.array_equal(levels, ref_levels[rows], equal_nan=True)
        want = sorted(int(s) for s in steps if cpu_max < s <= MAX_STEPS) if fma else []
        assert sorted(runner.seen) == want, (fma, runner.seen)


def wide_lattices(rng, n: int = 9):
    """American and European calls and puts whose node tables are CENTRED (sigma sqrt(T N) from 380
    to 650: (u/d)^N beyond e^700; N from 600 to 1 500) or CLAMPED (720 to 900, N from 4 000 to
    6 000, so that sigma sqrt(T) stays below 15: their clamped nodes carry no weight) (crr)."""
    clamped = np.arange(n) % 3 == 2
    steps = np.where(clamped, rng.integers(4000, 6000, n), rng.integers(600, 1500, n))
    reach = np.where(clamped, rng.uniform(720, 900, n), rng.uniform(380, 650, n))
    cols = dict(spot=np.full(n, 100.0), strike=rng.uniform(60, 140, n),
                maturity=np.full(n, 10.0), rate=rng.uniform(0.0, 0.08, n),
                dividend=rng.uniform(0.0, 0.04, n), volatility=reach / np.sqrt(10.0 * steps),
                steps=steps, call=rng.random(n) < 0.5, american=rng.random(n) < 0.6)
    return lattice_parameters(cols)


@pytest.mark.parametrize("mode", MODES)
def test_wide_lattices_skip_the_runner_and_clamped_ones_take_the_cpu(mode, rng):
    """CENTRED lattices take the regimes even at the batch kernels' sizes (those build node prices
    from PLAIN factors); CLAMPED ones take the CPU engine; bitwise the serial engine's in the exact
    mode and through the stand-in runner, which sees only the PLAIN option."""
    p = wide_lattices(rng)
    kinds = table_kinds(p.spot, p.log_up, p.log_down, p.steps)
    assert set(kinds) == {CENTRED, CLAMPED}
    plain = options(rng, [700])
    p = LatticeParams(*(np.r_[getattr(p, f), getattr(plain, f)] for f in PACKED_FIELDS))
    ref_levels = np.empty((len(p), LEVEL_VALUES))
    ref = SerialEngine().price(p, ref_levels)
    config = replace(SMALL_PERS, fma=True)
    runner = RecordingRunner()
    engine = GpuEngine(mode, config=config, kernels=small_numpy_kernels(config), runner=runner)
    levels = np.empty((len(p), LEVEL_VALUES))
    np.testing.assert_array_equal(engine.price(p, levels), ref)
    assert np.array_equal(levels, ref_levels, equal_nan=True)
    assert runner.seen == [700]


def test_auto_prices_a_small_share_on_the_cpu(rng):
    """`auto` (batch with cpu_max_nodes): a call of at most that many lattice nodes goes to the CPU
    engine whole, a larger one through the routes."""
    from pricer.model.cost import lattice_nodes
    config = replace(SMALL_PERS, fma=True)
    p = options(rng, [10, 300, 2000])
    nodes = int(lattice_nodes(p.steps).sum())
    for limit, runner_steps in ((nodes, []), (nodes - 1, [10, 300, 2000])):
        runner = RecordingRunner()
        engine = GpuEngine("batch", config=config, kernels=small_numpy_kernels(config),
                           runner=runner, cpu_max_nodes=limit)
        np.testing.assert_array_equal(engine.price(p), SerialEngine().price(p))
        assert sorted(runner.seen) == runner_steps


class LoggedPersKernels(NumpyKernels):
    """The emulation, noting each persistent launch as (tile width, from level, to level)."""
    pers_tiles = SMALL_PERS_TILES

    def __init__(self, config, log=None):
        super().__init__(config)
        self.log = [] if log is None else log

    def narrow_kernels(self):
        if self._narrow is None and self.config.narrow() is not None:
            self._narrow = LoggedPersKernels(self.config.narrow(), self.log)
        return self._narrow

    def pers(self, vin, vout, lb, r, pows, t, stop, *args):
        self.log.append((self.config.pers_w, t, stop))
        super().pers(vin, vout, lb, r, pows, t, stop, *args)


def test_persistent_shapes_take_turns(rng):
    """The wide tiles down to pers_narrow_below, the narrow ones from there, each shape one launch;
    the narrow shape alone where the option starts below; one shape with pers_narrow_vt = 0; the
    narrow shape starts no higher than its tiles hold (8 tiles x 16 owned nodes: level 127); by
    default where the wide tiles (48 owned nodes) fill half of the stand-in's 4 sub-partitions.
    hybrid and batch stop at T2 (the CPU takes the rest), gpu at 0."""
    c = SMALL_PERS                      # t1 300, t2 40, wide 64-node tiles, narrow 32-node below 100
    cases = [(c, "gpu", 250, [(64, 250, 100), (32, 100, 0)]),
             (c, "hybrid", 250, [(64, 250, 100), (32, 100, 40)]),
             (c, "batch", 250, [(64, 250, 100), (32, 100, 40)]),
             (c, "gpu", 90, [(32, 90, 0)]),
             (c, "hybrid", 41, [(32, 41, 40)]),
             (c, "batch", 41, [(32, 41, 40)]),
             (c, "batch", 40, []),
             (replace(c, pers_narrow_vt=0), "gpu", 250, [(64, 250, 0)]),
             (replace(c, pers_narrow_below=200), "gpu", 250, [(64, 250, 127), (32, 127, 0)]),
             (replace(c, pers_narrow_below=None), "gpu", 250, [(64, 250, 96), (32, 96, 0)])]
    for config, mode, n, want in cases:
        kernels = LoggedPersKernels(config)
        p = options(rng, [n])
        got = GpuEngine(mode, config=config, kernels=kernels).price(p)
        np.testing.assert_array_equal(got, SerialEngine().price(p))
        assert kernels.log == want, (mode, n, config.pers_narrow_vt, config.pers_narrow_below)


def test_put_whose_tiles_skip_goes_narrow_from_the_top(rng):
    """With the scaled arithmetic (fma), an American put's exercised tiles skip their epochs, and by
    default the narrow shape then takes over as high as its tiles hold (level 127 here) rather than
    where the wide tiles fill half the sub-partitions (96); a call keeps the latter. Through
    price_one: with fma, the engine's own routes would send these N to the batch runner."""
    from pricer.engines.gpu.regimes import pers_skip_limit
    config = replace(SMALL_PERS, pers_narrow_below=None, fma=True)
    top, half = [(64, 250, 127), (32, 127, 0)], [(64, 250, 96), (32, 96, 0)]
    for call, want in ((False, top), (True, half)):
        p = lattice_parameters(dict(
            spot=np.array([100.0]), strike=np.array([rng.uniform(90, 130)]), maturity=np.array([1.0]),
            volatility=np.array([rng.uniform(0.15, 0.4)]), rate=np.array([0.05]),
            dividend=np.array([0.0]), steps=np.array([250]), call=np.array([call]),
            american=np.array([True])))
        assert call or not np.isnan(pers_skip_limit(p.strike[0], 250, p.pu[0], p.pd[0], p.log_up[0],
                                                    p.log_down[0]))
        kernels = LoggedPersKernels(config)
        got = GpuEngine("gpu", config=config, kernels=kernels).price_one(p, 0)
        assert got == SerialEngine().price(p)[0]
        assert kernels.log == want, call


def test_pers_skip_limit():
    """No limit (NaN) where holding pays at least as much as exercising (no interest); below the
    serial engine's limit, whose rounding-error bounds it widens."""
    from pricer.engines.cpu.kernels import exercise_limit
    from pricer.engines.gpu.regimes import pers_skip_limit
    cols = dict(spot=np.full(3, 100.0), strike=np.full(3, 100.0), maturity=np.full(3, 1.0),
                volatility=np.full(3, 0.2), rate=np.array([0.0, 0.05, 0.05]),
                dividend=np.array([0.0, 0.0, 0.08]), steps=np.array([1000, 1000, 100_000]),
                call=np.zeros(3, bool), american=np.ones(3, bool))
    p = lattice_parameters(cols)
    args = [(p.strike[j], int(p.steps[j]), p.pu[j], p.pd[j], p.log_up[j], p.log_down[j]) for j in range(3)]
    assert np.isnan(pers_skip_limit(*args[0]))
    for a in args[1:]:
        assert 0.0 < pers_skip_limit(*a) < exercise_limit(*a)
    # with dividends above the rate, a put is surely exercised only below about K r / q
    assert 0.5 * 100 * 0.05 / 0.08 < pers_skip_limit(*args[2]) < 100 * 0.05 / 0.08


class StrandedPersKernels(NumpyKernels):
    """As a GPU whose persistent launch cannot get all its blocks resident: the launch gives up,
    writes NaN over its outputs and raises the status flag."""
    pers_tiles = SMALL_PERS_TILES
    launches = 0

    def pers(self, vin, vout, *args):
        stop = args[4]    # (level_base, ratio, pows, t, stop, ...)
        vout[:stop + 1] = np.nan
        self.launches += 1
        self._failed = True

    def pers_failed(self) -> bool:
        failed, self._failed = getattr(self, "_failed", False), False
        return failed


@pytest.mark.parametrize("mode", MODES)
def test_stranded_persistent_kernel_falls_back(mode, rng, capsys):
    """Where the persistent kernel gives up, the engine re-prices the option on the mid fallback
    and stops using the persistent kernel (pers_off; one warning): no NaN price comes out."""
    config = SMALL_PERS
    p = options(rng, [config.t2 + 3 * (config.pers_w - config.pers_k), config.t2 + 5, 700])
    kernels = StrandedPersKernels(config)
    engine = GpuEngine(mode, config=config, kernels=kernels)
    np.testing.assert_array_equal(engine.price(p), SerialEngine().price(p))
    assert engine.pers_off and kernels.launches == 1
    assert capsys.readouterr().err.count("persistent GPU kernel gave up") == 1


def test_pers_pows():
    from pricer.engines.gpu.regimes import pers_pows
    out = np.empty(2 * 64 + 2)
    assert pers_pows(0.5, 64, out)
    assert out[0] == 1.0 and out[64] == 0.5 ** 64 and out[65] == 1.0 and out[129] == 2.0 ** 64
    pd = 0.4987654321
    assert pers_pows(pd, 64, out)
    exact = [float(np.longdouble(pd) ** s) for s in (1, 17, 64)]
    assert abs(out[17] / exact[1] - 1) < 2e-16 and abs(out[64] * out[129] - 1) < 3e-16
    assert not pers_pows(0.001, 64, out)      # pd^64 < 2^-600: the kernel keeps V unscaled
    assert not pers_pows(1.0, 64, out)


def test_blocks_skipped_for_exercise_never_exercise(rng):
    """may_exercise (cuda/binomial.cu, mirrored by NumpyKernels) lets a tile run the European body
    only where no stored node of its k steps has a positive exercise value; and it does skip
    (about half the tiles of an at-the-money option lie beyond the strike)."""
    width, k = 128, 50
    skipped = 0
    for j in range(40):
        p = options(rng, [int(rng.integers(k + 1, 3000))], american=True)
        n, sign, strike = int(p.steps[0]), (1.0 if p.call[0] else -1.0), float(p.strike[0])
        lb, r = np.empty(n + 1), np.empty(n + 1)
        power_tables(p.spot[0], p.log_up[0], p.log_down[0], n, lb, r)
        t = int(rng.integers(k, n + 1))
        out_w = width - k
        first = np.arange((t - k + 1 + out_w - 1) // out_w) * out_w
        may = NumpyKernels._may_exercise(lb, r, t, k, first, width, strike, sign)
        for b in np.flatnonzero(~may):
            for s in range(1, k + 1):
                nodes = np.arange(first[b], min(first[b] + width - s, t - s + 1))  # feed the stored ones
                exercise = sign * lb[t - s] * r[nodes] - sign * strike
                assert (exercise <= 0.0).all(), (j, b, s)
        skipped += int((~may).sum())
    assert skipped > 0


def test_config_is_checked():
    with pytest.raises(ValueError):
        GpuConfig(tiled_k=GpuConfig().tiled_w).check()
    with pytest.raises(ValueError):
        GpuConfig(warp_k=0).check()
    with pytest.raises(ValueError):
        GpuConfig(mid_b=64, mid_vt=2, mid_k=128).check()
    # every shape is always in use: no 0 to turn the persistent kernel or the mid shape off
    for bad in (dict(mid_b=48), dict(mid_b=0), dict(mid_b=16), dict(pers_vt=0), dict(pers_vt=0, pers_k=3),
                dict(pers_k=60), dict(pers_k=256), dict(pers_vt=4, pers_k=8 * 32), dict(pers_warps=0),
                dict(pers_vt=33)):
        with pytest.raises(ValueError):
            GpuConfig(**bad).check()
    SMALL_PERS.check()
    MEDIUM_PERS.check()
    # the single regimes are `pricer bench gpu`'s (OneRegime), not the engine's modes
    for mode in ("wavefront", "tiled", "warp", "pers", "nope"):
        with pytest.raises(ValueError, match="unknown GPU mode"):
            GpuEngine(mode, kernels=NumpyKernels(GpuConfig()))
    for regime in ("gpu", "hybrid", "pers", "nope"):
        with pytest.raises(ValueError, match="unknown regime"):
            OneRegime(regime, config=GpuConfig(), kernels=NumpyKernels(GpuConfig()))


def test_local_rank(monkeypatch):
    """The launcher's variables first, else the run's word (set_local_rank), else 0; no MPI call
    (it could wait on a rank that failed before asking)."""
    import sys

    from pricer.engines import set_local_rank as engines_set_local_rank
    from pricer import devices
    from pricer.engines.gpu import runtime
    for var in devices.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(runtime, "_run_local_rank", None)     # restored after the test
    monkeypatch.setitem(sys.modules, "mpi4py", None)          # an MPI query would fail
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    assert local_rank() == 0
    runtime.set_local_rank(2)
    assert local_rank() == 2
    engines_set_local_rank(5)                                 # the run's entry point
    assert local_rank() == 5
    monkeypatch.setenv("SLURM_LOCALID", "x")                  # not a number: not a word
    assert local_rank() == 5
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_rank() == 3
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert local_rank() == 1
    runtime.set_local_rank(None)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    monkeypatch.delenv("SLURM_LOCALID")
    assert local_rank() == 0
    assert devices.launcher_local_rank({"MPI_LOCALRANKID": "4"}) == 4
    assert devices.launcher_local_rank({}) is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("below_t1", ["pers", "mid"])
def test_emulated_regimes_keep_the_first_levels_bitwise(rng, mode, below_t1):
    """With `levels` (Greeks) the GPU stops at level 2 and the host keeps levels 2 and 1: in exact
    mode the kept values and the prices are bitwise the serial engine's (numpy emulation)."""
    p = options(rng, np.r_[1, 2, 3, rng.integers(4, 700, 12)])
    ref_levels = np.empty((len(p), LEVEL_VALUES))
    ref = SerialEngine().price(p, ref_levels)
    levels = np.full((len(p), LEVEL_VALUES), -1.0)
    got = emulated(mode, SMALL_PERS, pers_off=below_t1 == "mid").price(p, levels)
    assert np.array_equal(got, ref)
    assert np.array_equal(levels, ref_levels, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# On a GPU.

@pytest.fixture(scope="module")
def engines():
    """The GPU engines as they run by default (fma), and the single regimes."""
    made = {mode: GpuEngine(mode) for mode in MODES}
    made.update({regime: OneRegime(regime) for regime in REGIMES})
    return made


@pytest.fixture(scope="module")
def exact_engines():
    """As `engines`, exact arithmetic (fma=False): bitwise equal to serial."""
    made = {mode: GpuEngine(mode, fma=False) for mode in MODES}
    made.update({regime: OneRegime(regime, fma=False) for regime in REGIMES})
    return made


def small_cuda_kernels(config):
    """CudaKernels whose persistent kernel acts as if only SMALL_PERS_TILES tiles fit at once."""
    from pricer.engines.gpu.regimes import CudaKernels
    kernels = CudaKernels(config)
    assert kernels.pers_tiles() >= SMALL_PERS_TILES
    kernels._pers_tiles = SMALL_PERS_TILES
    return kernels


@pytest.fixture(scope="module")
def small_kernels():
    return small_cuda_kernels(SMALL_PERS)


@pytest.mark.gpu
@needs_gpu
def test_runtime_one_context():
    import pycuda.driver as cuda

    from pricer.engines.gpu.runtime import GpuRuntime
    rt = GpuRuntime.get()
    assert rt is GpuRuntime.get()
    assert rt.arch.startswith("sm_") and not rt.closed and rt.sms > 0
    assert cuda.Context.get_current() is not None
    assert rt.device_index == rt.local_rank % cuda.Device.count()
    assert rt.local_rank == local_rank()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("below_t1", ["pers", "mid"])
def test_gpu_small_config_boundaries(mode, below_t1, small_kernels, rng):
    """SMALL_PERS's edges on the GPU (exact mode: every option through the regimes), on a GPU cut
    down to SMALL_PERS_TILES persistent tiles; `mid`: the fallback after the persistent kernel gave
    up (pers_off). Bitwise the serial engine's."""
    engine = GpuEngine(mode, config=SMALL_PERS, kernels=small_kernels)
    engine.pers_off = below_t1 == "mid"
    p = every_kind(rng, boundary_steps(SMALL_PERS))
    got = engine.price(p)
    ref = SerialEngine().price(p)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("regime", REGIMES)
def test_gpu_small_config_one_regime(regime, small_kernels, rng):
    """The single regimes with SMALL_PERS's small tiles (exact mode), all the way down: bitwise."""
    steps = boundary_steps(SMALL_PERS)
    p = every_kind(rng, steps)
    got = OneRegime(regime, config=SMALL_PERS, kernels=small_kernels).price(p)
    np.testing.assert_array_equal(got, SerialEngine().price(p))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES + REGIMES)
def test_gpu_default_config_small_n(mode, engines, rng):
    """The default configuration's edges (fma): through the regimes (and, for gpu/hybrid/batch,
    through the engine's own routes: the batch runner) within tolerance of serial."""
    c = GpuConfig()
    steps = [1, 2, 3, 7, 64, c.t2 - 1, c.t2, c.t2 + 1, c.warp_w - 1, c.warp_w, c.warp_w + 1,
             c.t2 + c.warp_k, c.t2 + c.warp_k + 1, c.tiled_w - 1, c.tiled_w, c.tiled_w + 1,
             c.mid_w - 1, c.mid_w, c.mid_w + 1, c.t2 + c.mid_k, c.t2 + c.mid_k + 1, 5000]
    if mode == "wavefront":
        steps = steps[:-1]
    assert_regimes_and_routes_close(engines, mode, every_kind(rng, steps))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES + ("tiled", "warp"))
def test_gpu_fresh_random_options(mode, engines, rng):
    assert_regimes_and_routes_close(engines, mode, options(rng, rng.integers(1, 10_001, 24)))


def assert_regimes_and_routes_close(engines, mode, p):
    """`p` through the mode's regimes, and (gpu/hybrid/batch) through the engine's own routes,
    within tolerance of the serial engine."""
    ref = SerialEngine().price(p)
    assert_close(through_regimes(engines[mode], p), ref, p, f"{mode} regimes")
    if mode in MODES:
        assert_close(engines[mode].price(p), ref, p, mode)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_routes(mode, rng):
    """Portfolios mixing the batch runner's options (N <= MAX_STEPS), options wider than that (the
    regimes) and (hybrid) the CPU's, shuffled: within tolerance of the CPU engines with fma, bitwise
    in the exact mode (every option through the regimes, hybrid's small ones on the CPU)."""
    steps = ([1, 2, 3, 100, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 4095, 4096,
              8191, 8192, MAX_STEPS - 1, MAX_STEPS, MAX_STEPS + 1, MAX_STEPS + 600]
             + list(rng.integers(1, MAX_STEPS + 1, 30)))
    p = every_kind(rng, steps)
    p = p.take(rng.permutation(len(p)))
    ref = CpuEngine().price(p)          # bitwise equal to serial, all cores
    assert_close(GpuEngine(mode).price(p), ref, p, mode)
    np.testing.assert_array_equal(GpuEngine(mode, fma=False).price(p), ref)


@pytest.mark.gpu
@needs_gpu
def test_gpu_and_hybrid_price_like_batch(rng):
    """With fma, gpu and hybrid send their options up to MAX_STEPS (above hybrid's cpu_max_steps)
    through the batch runner, as `batch` does: bitwise the same prices and kept levels (Greeks).
    hybrid's options up to cpu_max_steps are the cpu engine's, bitwise."""
    steps = [1, 2, 3, 16, 17, 499, 500, 501, 1000, 4096, 8191, MAX_STEPS] + \
        list(rng.integers(1, MAX_STEPS + 1, 40))
    p = every_kind(rng, steps)
    p = p.take(rng.permutation(len(p)))
    want_levels = np.empty((len(p), LEVEL_VALUES))
    want = GpuEngine("batch").price(p, want_levels)
    assert_close(want, CpuEngine().price(p), p, "batch")
    for mode, extra in (("gpu", {}), ("hybrid", {}), ("hybrid", dict(cpu_max_steps=16))):
        engine = GpuEngine(mode, **extra)
        levels = np.full((len(p), LEVEL_VALUES), -1.0)
        got = engine.price(p, levels)
        on_runner = p.steps > engine.cpu_max_steps
        label = f"{mode} {extra}"
        np.testing.assert_array_equal(got[on_runner], want[on_runner], err_msg=label)
        assert np.array_equal(levels[on_runner], want_levels[on_runner], equal_nan=True), label
        if (~on_runner).any():
            cpu_levels = np.empty((int((~on_runner).sum()), LEVEL_VALUES))
            cpu = CpuEngine().price(p.take(np.flatnonzero(~on_runner)), cpu_levels)
            np.testing.assert_array_equal(got[~on_runner], cpu, err_msg=label)
            assert np.array_equal(levels[~on_runner], cpu_levels, equal_nan=True), label


@pytest.mark.gpu
@needs_gpu
def test_gpu_t1_boundary_default(engines, rng):
    c = GpuConfig()
    steps = [c.t1 - 1, c.t1, c.t1 + 1, c.t1 + c.tiled_k + 1, 100_000]
    p = options(rng, steps)
    ref = CpuEngine().price(p)          # bitwise equal to serial, all cores
    for mode in MODES:
        assert_close(engines[mode].price(p), ref, p, mode)


@pytest.mark.gpu
@needs_gpu
def test_gpu_fma_within_tolerance(rng):
    """fma through the regimes with T1 = 2000 (tiled above), the persistent kernel or (pers_off) the
    mid fallback below, and through each engine's routes (the batch runner)."""
    p = every_kind(rng, [1, 2, 499, 501, 3000, 10_000])
    ref = SerialEngine().price(p)
    for mode, extra, pers_off in (("gpu", {}, False), ("hybrid", dict(t2=100), False),
                                  ("batch", {}, False), ("gpu", {}, True), ("hybrid", {}, True)):
        engine = GpuEngine(mode, fma=True, t1=2000, **extra)
        engine.pers_off = pers_off
        label = f"fma {mode} {extra} pers_off={pers_off}"
        assert_close(through_regimes(engine, p), ref, p, label + " regimes")
        assert_close(engine.price(p), ref, p, label)


@pytest.mark.gpu
@needs_gpu
def test_gpu_exact_mode_is_bitwise(exact_engines, rng):
    p = every_kind(rng, [1, 2, 600, 3000, 20_000])
    ref = SerialEngine().price(p)
    for mode in MODES + ("tiled", "warp", "wavefront"):
        if mode == "wavefront":
            p, ref = p.take(np.arange(16)), ref[:16]
        np.testing.assert_array_equal(exact_engines[mode].price(p), ref, err_msg=mode)
    mid = GpuEngine("gpu", fma=False, t1=2000)   # the mid fallback below T1
    mid.pers_off = True
    np.testing.assert_array_equal(mid.price(p), ref, err_msg="mid")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fma", [True, False], ids=["fma", "exact"])
def test_gpu_persistent_kernel(fma, rng):
    """The persistent kernel (default shape) on fresh random American/European calls/puts, through
    the regimes: exact mode bitwise equal to serial, fma within tolerance; N around its tile and
    epoch edges, from T2 and from 0, tiny N; from the top of each option (the default T1 lies above
    these N), with T1 = 2000 (tiled above it), and on a GPU cut down to SMALL_PERS_TILES tiles, so
    that levels wider than it holds go through tiled first. The default hand-over (~50 000 on a
    132-SM GPU) lies above these N, so the default engines run the narrow shape alone; the wide
    shape runs alone with pers_narrow_vt = 0, and both with the hand-over at level 1000."""
    c = GpuConfig()
    own = c.pers_w - c.pers_k
    below = 1000
    steps = {1, 2, 3, 5, 64, 499, 2000, 2001, 2257, 3000, 10_000}
    for edge in (c.pers_k, own, c.pers_w, 2 * own, 2 * own + c.pers_k, c.t2, c.t2 + c.pers_k,
                 c.t2 + own, SMALL_PERS_TILES * own, below, below + c.pers_k, below + own,
                 below + 2 * own):
        steps.update({edge - 1, edge, edge + 1})
    p = every_kind(rng, sorted(steps) + list(rng.integers(1, 10_001, 6)))
    ref = SerialEngine().price(p)
    cut = small_cuda_kernels(GpuConfig(fma=fma))
    for label, engine in (("gpu", GpuEngine("gpu", fma=fma)),
                          ("batch", GpuEngine("batch", fma=fma)),
                          ("gpu t1=2000", GpuEngine("gpu", fma=fma, t1=2000)),
                          ("hybrid t1=2000", GpuEngine("hybrid", fma=fma, t1=2000)),
                          ("gpu, 8 tiles fit", GpuEngine("gpu", config=cut.config, kernels=cut)),
                          ("gpu, one shape", GpuEngine("gpu", fma=fma, pers_narrow_vt=0)),
                          ("gpu t1=2000, narrow below 1000",
                           GpuEngine("gpu", fma=fma, t1=2000, pers_narrow_below=below)),
                          ("hybrid, narrow below 1000",
                           GpuEngine("hybrid", fma=fma, pers_narrow_below=below))):
        got = through_regimes(engine, p)
        assert_close(got, ref, p, label)
        if not fma:
            np.testing.assert_array_equal(got, ref, err_msg=label)


@pytest.mark.gpu
@needs_gpu
def test_gpu_persistent_kernel_repeats(rng):
    """One wide option again and again: a race between the tiles would move the price."""
    p = options(rng, [100_000, 37_003], american=True)
    ref = CpuEngine().price(p)
    for fma in (True, False):
        engine = GpuEngine("gpu", fma=fma)
        got = [engine.price(p) for _ in range(4)]
        for g in got:
            np.testing.assert_array_equal(g, got[0])
        assert_close(got[0], ref, p, f"fma={fma}")
        if not fma:
            np.testing.assert_array_equal(got[0], ref)


def unscaled(monkeypatch):
    """fma without the persistent kernel's scaled arithmetic (as where pd^pers_k is too small)."""
    import pricer.engines.gpu.engine as engine_module
    real = engine_module.pers_pows
    monkeypatch.setattr(engine_module, "pers_pows", lambda pd, k, out: real(pd, k, out) and False)


@pytest.mark.gpu
@needs_gpu
def test_gpu_persistent_kernel_unscaled_fma(rng, monkeypatch):
    """fma mode where pd^pers_k is too small for the scaled arithmetic: the kernel's unscaled path."""
    unscaled(monkeypatch)
    p = every_kind(rng, [1, 63, 64, 65, 500, 3000])
    assert_close(through_regimes(GpuEngine("gpu", fma=True), p), SerialEngine().price(p), p,
                 "unscaled fma")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_gpu_persistent_kernel_money_range(scaled, rng, monkeypatch):
    """The persistent kernel's fma paths on calls and puts with dividends from deep in to far out of
    the money, in both shapes: the European body of tiles that cannot exercise, the exercise values
    computed a step ahead, and (scaled) a put's tiles skipping the epochs where all their nodes hold
    their exercise value, which also moves the default hand-over to the narrow shape up: within
    tolerance of the cpu engine, through the regimes (exact mode: test_gpu_exact_mode_is_bitwise)."""
    if not scaled:
        unscaled(monkeypatch)
    steps = [64, 500, 999, 1000, 1001, 3000, 20_000]
    p = every_kind(rng, np.repeat(steps, 3))
    p.strike[:] = p.spot * np.resize([0.5, 0.9, 1.0, 1.1, 2.0], len(p))
    ref = CpuEngine().price(p)
    for mode, extra in (("gpu", dict(pers_narrow_below=1000)), ("gpu", {}), ("hybrid", {}),
                        ("hybrid", dict(pers_narrow_below=10_000))):
        got = through_regimes(GpuEngine(mode, fma=True, **extra), p)
        assert_close(got, ref, p, f"{mode} {extra}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not os.environ.get("PRICER_GPU_LARGE"), reason="N = 1e6 takes ~25 s of 16-core CPU "
                    "reference time: set PRICER_GPU_LARGE=1")
def test_gpu_one_million_steps(engines, rng):
    p = options(rng, [1_000_000])
    p.call[:] = False
    p.american[:] = True
    ref = CpuEngine().price(p)
    assert_close(engines["hybrid"].price(p), ref, p, "hybrid")


@pytest.mark.gpu
@needs_gpu
def test_mpirun_two_ranks_one_gpu_cli(tmp_path):
    from helpers import run_pricer
    from pricer.io.results import read_results
    src = tmp_path / "p.h5"
    gen = run_pricer(["generate", "--dist", "random", "--count", "40", "--seed", "7", "--min-steps", "1",
                      "--max-steps", "3000", "-o", src])
    assert gen.returncode == 0, gen.stderr
    hyb = run_pricer(["price", src, "-o", tmp_path / "h.h5", "--backend", "hybrid"], ranks=2, timeout=300)
    assert hyb.returncode == 0, hyb.stdout + hyb.stderr
    ser = run_pricer(["price", src, "-o", tmp_path / "s.h5", "--backend", "serial"])
    assert ser.returncode == 0, ser.stderr
    h, s = read_results(tmp_path / "h.h5"), read_results(tmp_path / "s.h5")
    assert h["attrs"]["backend"] == "hybrid" and int(h["attrs"]["ranks"]) == 2
    np.testing.assert_array_equal(h["id"], s["id"])
    np.testing.assert_allclose(h["price"], s["price"], rtol=1e-11, atol=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_wide_lattices(mode, engines, exact_engines, rng):
    """CENTRED and CLAMPED lattices on the GPU engines: bitwise serial in the exact mode, within
    tolerance with fma."""
    p = wide_lattices(rng, 12)
    ref = SerialEngine().price(p)
    np.testing.assert_array_equal(exact_engines[mode].price(p), ref)
    assert_close(engines[mode].price(p), ref, p, mode)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("steps", [100_000, 500_000])
def test_gpu_the_seeds_option_at_every_n_it_prices(steps, engines):
    """Cao (2025)'s benchmark option (American put, S = K = 100, r = 5 %, sigma = 20 %, T = 10) at
    N = 100 000 (PLAIN tables) and 500 000 (CENTRED: (u/d)^N = e^894) on cpu, gpu, hybrid and batch
    (whose options of this size take the regimes and the CPU tail, as hybrid's do), within 1e-9
    of the independent oracle (oracle.crr_wide). Cao's code prices 11.211412 at N = 500 000."""
    from oracle import crr_wide
    cols = dict(spot=np.array([100.0]), strike=np.array([100.0]), maturity=np.array([10.0]),
                rate=np.array([0.05]), dividend=np.array([0.0]), volatility=np.array([0.2]),
                steps=np.array([steps]), call=np.array([False]), american=np.array([True]))
    p = lattice_parameters(cols)
    ref = crr_wide(100.0, 100.0, 10.0, 0.05, 0.0, 0.2, steps, False, True)
    for name, engine in [("cpu", CpuEngine())] + [(mode, engines[mode]) for mode in MODES]:
        got = float(engine.price(p)[0])
        assert abs(got - ref) <= 1e-9 * ref, (name, got, ref)
    if steps == 500_000:
        assert round(ref, 6) == 11.211412


def test_cuda_starts_beside_the_imports_only_where_it_can(monkeypatch):
    """devices.start_cuda_beside: no thread with PRICER_NO_GPU or without pycuda; and the command
    line asks for it only where a GPU may price (`price`/`run`, not --backend cpu or serial)."""
    import importlib.util

    from pricer import devices
    from pricer.cli import _may_use_a_gpu
    monkeypatch.setenv("PRICER_NO_GPU", "1")
    assert devices.start_cuda_beside() is None
    monkeypatch.delenv("PRICER_NO_GPU")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pycuda" else real(name, *a))
    assert devices.start_cuda_beside() is None
    for argv, expected in ((["price", "b.h5", "-o", "r.h5"], True),
                           (["price", "b.h5", "--backend", "cpu"], False),
                           (["run", "job.toml", "--backend=serial"], False),
                           (["run", "job.toml", "--backend", "batch"], True),
                           (["generate", "--count", "5", "-o", "b.h5"], False),
                           (["--version"], False), ([], False)):
        assert _may_use_a_gpu(argv) is expected, argv


@pytest.mark.gpu
@needs_gpu
def test_cuda_started_beside_is_the_runs_cuda():
    """The thread's cuInit leaves the driver started for the process: the run's context comes up
    on it, on the rank's GPU."""
    import pycuda.driver as cuda

    from pricer import devices
    from pricer.engines.gpu.runtime import GpuRuntime
    thread = devices.start_cuda_beside()
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive() and cuda.Device.count() > 0
    rt = GpuRuntime.get()
    assert rt.device_index == rt.local_rank % cuda.Device.count()


class StartingRunner(RecordingRunner):
    """The stand-in runner, noting the calls started through it."""

    def start(self, params):
        self.started = getattr(self, "started", 0) + 1
        return ("out", self.price(params))

    def finish(self, started):
        return started[1]


def test_start_goes_to_the_runner_only_with_every_option(rng):
    """GpuEngine.start hands a call to the batch runner's start (its prices come back at
    finish) only where every option goes there as it is; a call split between routes is priced
    at start. Both finish with the prices a price call gives."""
    config = replace(SMALL_PERS, fma=True)
    runner = StartingRunner()
    engine = GpuEngine("batch", config=config, kernels=small_numpy_kernels(config), runner=runner)
    narrow = options(rng, rng.integers(1, 300, 20))
    mixed = options(rng, [5, MAX_STEPS + 1, 40])
    started = engine.start(narrow)
    assert not isinstance(started, np.ndarray) and runner.started == 1
    np.testing.assert_array_equal(engine.finish(started), SerialEngine().price(narrow))
    started = engine.start(mixed)
    assert isinstance(started, np.ndarray) and runner.started == 1
    np.testing.assert_array_equal(engine.finish(started), SerialEngine().price(mixed))
