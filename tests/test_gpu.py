"""The GPU engines (`gpu`, `hybrid`, and the single-regime modes) against the serial engine.

Tests marked `gpu` need pycuda, a CUDA device and nvcc, and skip here with the reason; they run for
real on the GPU machine (../shared/device/README.md):
    source .device/setup.sh && python3 -m pytest -m gpu -q tests/test_gpu.py
PRICER_GPU_LARGE=1 adds N = 1 000 000 (compared with the `cpu` engine, bitwise equal to serial).
The emulation tests (numpy stand-ins for the kernels, same tiles and halos) run everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from dataclasses import replace

import numpy as np
import pytest

from pricer.engines import gpu_available
from pricer.engines.cpu import CpuEngine
from pricer.engines.gpu import MODES, GpuConfig, GpuEngine, NumpyKernels, batch_class, local_rank
from pricer.engines.serial import SerialEngine, power_tables
from pricer.lattice import lattice_parameters

# A small configuration whose thresholds and tile widths are cheap to straddle.
# SMALL runs the mid regime (tiled kernel, narrow shape) below t1; SMALL_WARP warp per block there.
# SMALL_PERS runs the persistent kernel there (tiles of 64 nodes, 48 owned, halos every 16 steps),
# and below level 100 its narrow shape (tiles of 32 nodes, 16 owned).
SMALL = GpuConfig(t1=300, t2=40, tiled_b=32, tiled_vt=4, tiled_k=50, warp_vt=4, warp_k=30,
                  mid_b=32, mid_vt=2, mid_k=25, pers_vt=0, fma=False, batch_max_steps=0)
SMALL_WARP = GpuConfig(t1=300, t2=40, tiled_b=32, tiled_vt=4, tiled_k=50, warp_vt=4, warp_k=30,
                       mid_b=0, pers_vt=0, fma=False, batch_max_steps=0)
SMALL_PERS = GpuConfig(t1=300, t2=40, tiled_b=32, tiled_vt=4, tiled_k=50, warp_vt=4, warp_k=30,
                       pers_vt=2, pers_k=16, pers_warps=2, pers_narrow_vt=1,
                       pers_narrow_below=100, fma=False, batch_max_steps=0)
# tiles the stand-in GPUs of the tests hold at once (NumpyKernels.pers_tiles, and a CudaKernels cut
# down to it), so that levels wider than that (tiled first) are cheap to reach
SMALL_PERS_TILES = 8
# the batch kernel's size-class edges
BATCH_EDGES = [1, 2, 3, 100, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2000, 2046, 2047, 2048,
               4095, 4096, 4097, 8190, 8191]


def _why_no_gpu() -> str:
    if importlib.util.find_spec("pycuda") is None:
        return "pycuda is not installed (it is in the GPU machine kit, ../shared/device)"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc not found (needed to build the kernels)"
    return "no usable CUDA device"


needs_gpu = pytest.mark.skipif(not gpu_available(), reason=_why_no_gpu() if not gpu_available() else "")
GPU = [pytest.mark.gpu, needs_gpu]


def options(rng, steps, call=None, american=None):
    n = len(steps)
    cols = dict(spot=rng.uniform(50, 150, n), strike=rng.uniform(50, 150, n),
                maturity=rng.uniform(0.05, 3.0, n), volatility=rng.uniform(0.05, 0.6, n),
                rate=rng.uniform(0.0, 0.08, n), dividend=rng.uniform(0.0, 0.05, n),
                steps=np.asarray(steps, dtype=np.int64),
                call=(rng.random(n) < 0.5) if call is None else np.full(n, call),
                american=(rng.random(n) < 0.6) if american is None else np.full(n, american))
    return lattice_parameters(keep_nodes_in_range(keep_p_inside(cols)))


def keep_nodes_in_range(cols: dict) -> dict:
    """Maturities shortened where the lattice's node prices would leave FP64's range (lattice.py
    refuses those): (u/d)^N = e^{2 sigma sqrt(T N)} (CRR) at most e^500."""
    most = (250.0 / (cols["volatility"] * np.sqrt(cols["steps"]))) ** 2
    cols["maturity"] = np.minimum(cols["maturity"], most)
    return cols


def keep_p_inside(cols: dict) -> dict:
    """Volatilities raised so that p stays inside (0, 1) at N = 1: it needs sigma > |r - q| sqrt(dt)
    (low volatility with a high rate, or a high dividend, can leave it; the dividend was missing
    here once, and a seed found it)."""
    drift = np.abs(cols["rate"] - cols["dividend"])
    cols["volatility"] = np.maximum(cols["volatility"], 2 * drift * np.sqrt(cols["maturity"]) + 0.05)
    return cols


def every_kind(rng, steps):
    """Each N as an American/European call/put."""
    steps = np.repeat(np.asarray(steps), 4)
    p = options(rng, steps)
    p.call[:] = np.tile([True, True, False, False], steps.size // 4)
    p.american[:] = np.tile([True, False, True, False], steps.size // 4)
    return p


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
    s = {1, 2, 3, 4, 5, 31, 32, 33, 100}
    for edge in (c.t2, c.t1, c.warp_w, c.tiled_w, c.t2 + c.warp_k, c.t1 + c.tiled_k,
                 c.t2 + c.warp_w, c.t1 + 2 * c.tiled_k, c.mid_w, c.t2 + c.mid_k, c.t2 + c.mid_w):
        s.update({edge - 1, edge, edge + 1})
    if c.pers_vt:   # the persistent kernel: tile and epoch edges, from T2 / 0, and its widest level
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


# ---------------------------------------------------------------------------------------------
# Everywhere: the schedule and the kernels' index logic, through the numpy emulation.

def small_numpy_kernels(config):
    kernels = NumpyKernels(config)
    kernels.pers_tiles = SMALL_PERS_TILES
    return kernels


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", [SMALL, SMALL_WARP, SMALL_PERS,
                                    GpuConfig(t1=2000, t2=100, tiled_b=64, tiled_vt=4,
                                              tiled_k=100, warp_vt=8, warp_k=64, mid_b=64,
                                              mid_vt=1, mid_k=40, pers_vt=0, batch_max_steps=0),
                                    GpuConfig(t1=2000, t2=100, tiled_b=64, tiled_vt=4,
                                              tiled_k=100, warp_vt=8, warp_k=64, mid_b=0,
                                              pers_vt=0, batch_max_steps=0),
                                    GpuConfig(t1=2000, t2=100, tiled_b=64, tiled_vt=4,
                                              tiled_k=100, pers_vt=3, pers_k=9, pers_warps=1,
                                              pers_narrow_vt=1, pers_narrow_below=700,
                                              batch_max_steps=0)],
                         ids=["small", "small-warp", "small-pers", "medium", "medium-warp",
                              "medium-pers"])
def test_emulated_kernels_equal_serial(mode, config, rng):
    if mode == "pers" and not config.pers_vt:
        config = replace(config, pers_vt=4, pers_k=32)
    p = options(rng, boundary_steps(config) + list(rng.integers(1, 2500, 6)))
    got = GpuEngine(mode, config=config, kernels=small_numpy_kernels(config)).price(p)
    ref = SerialEngine().price(p)
    # same tables, same operations in the same order: bitwise
    np.testing.assert_array_equal(got, ref)


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
    default where the wide tiles (48 owned nodes) fill half of the stand-in's 4 sub-partitions."""
    c = SMALL_PERS                      # t1 300, t2 40, wide 64-node tiles, narrow 32-node below 100
    cases = [(c, "gpu", 250, [(64, 250, 100), (32, 100, 0)]),
             (c, "hybrid", 250, [(64, 250, 100), (32, 100, 40)]),
             (c, "gpu", 90, [(32, 90, 0)]),
             (c, "hybrid", 41, [(32, 41, 40)]),
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
    """With the scaled arithmetic (fma), an American put's exercised tiles skip their epochs
    (pers_skip), and by default the narrow shape then takes over as high as its tiles hold (level
    127 here) rather than where the wide tiles fill half the sub-partitions (96); a call, or a put
    with pers_skip off, keeps the old hand-over."""
    from pricer.engines.gpu import pers_skip_limit
    config = replace(SMALL_PERS, pers_narrow_below=None, fma=True)
    top, half = [(64, 250, 127), (32, 127, 0)], [(64, 250, 96), (32, 96, 0)]
    for call, cfg, want in ((False, config, top), (True, config, half),
                            (False, replace(config, pers_skip=False), half)):
        p = options(rng, [250], call=call, american=True)
        assert call or not np.isnan(pers_skip_limit(p.strike[0], 250, p.pu[0], p.pd[0], p.log_up[0],
                                                    p.log_down[0]))
        kernels = LoggedPersKernels(cfg)
        got = GpuEngine("gpu", config=cfg, kernels=kernels).price(p)
        np.testing.assert_array_equal(got, SerialEngine().price(p))
        assert kernels.log == want, (call, cfg.pers_skip)


def test_pers_skip_limit():
    """No limit (NaN) where holding pays at least as much as exercising (no interest); below the
    serial engine's limit, whose rounding-error bounds it widens."""
    from pricer.engines.gpu import pers_skip_limit
    from pricer.engines.serial import exercise_limit
    from pricer.lattice import lattice_parameters
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


def test_stranded_persistent_kernel_falls_back(rng, capsys):
    """gpu/hybrid re-price the option on the launch-per-K regimes and stop using the persistent
    kernel (one warning); mode `pers` raises GpuError instead of returning a NaN price."""
    from pricer.engines.gpu import GpuError
    config = SMALL_PERS
    p = options(rng, [config.t2 + 3 * (config.pers_w - config.pers_k), config.t2 + 5, 700])
    for mode in ("gpu", "hybrid"):
        kernels = StrandedPersKernels(config)
        engine = GpuEngine(mode, config=config, kernels=kernels)
        np.testing.assert_array_equal(engine.price(p), SerialEngine().price(p))
        assert engine.pers_off and kernels.launches == 1
        assert capsys.readouterr().err.count("persistent GPU kernel gave up") == 1
    with pytest.raises(GpuError, match="gave up waiting"):
        GpuEngine("pers", config=config, kernels=StrandedPersKernels(config)).price(p)


def test_pers_pows():
    from pricer.engines.gpu import pers_pows
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


def test_emulated_batch_equals_serial(rng):
    p = options(rng, BATCH_EDGES[:10] + [700, 2048, 4097])
    rows = np.arange(len(p))
    np.testing.assert_array_equal(NumpyKernels(GpuConfig()).batch(p, rows), SerialEngine().price(p))
    # with `levels` (Greeks) the kernel also keeps levels 2 and 1, bitwise the serial engine's
    from pricer.engines.serial import LEVEL_VALUES
    ref_levels, levels = np.empty((len(p), LEVEL_VALUES)), np.full((len(p), LEVEL_VALUES), -1.0)
    np.testing.assert_array_equal(NumpyKernels(GpuConfig()).batch(p, rows, levels),
                                  SerialEngine().price(p, ref_levels))
    assert np.array_equal(levels, ref_levels, equal_nan=True)
    assert list(batch_class(np.array([1, 255, 256, 511, 512, 2047, 2048, 8191]))) == [0, 0, 1, 1, 2, 3, 4, 5]


def test_config_is_checked():
    with pytest.raises(ValueError):
        GpuConfig(tiled_k=GpuConfig().tiled_w).check()
    with pytest.raises(ValueError):
        GpuConfig(warp_k=0).check()
    with pytest.raises(ValueError):
        GpuConfig(mid_b=64, mid_vt=2, mid_k=128).check()
    with pytest.raises(ValueError):
        GpuConfig(mid_b=48).check()
    for bad in (dict(pers_k=60), dict(pers_k=256), dict(pers_vt=4, pers_k=8 * 32), dict(pers_warps=0),
                dict(pers_vt=33)):
        with pytest.raises(ValueError):
            GpuConfig(**bad).check()
    GpuConfig(pers_vt=0, pers_k=3).check()    # off: its shape is not looked at
    with pytest.raises(ValueError):
        GpuEngine("pers", config=GpuConfig(pers_vt=0), kernels=NumpyKernels(GpuConfig()))
    with pytest.raises(ValueError):
        GpuEngine("nope", kernels=NumpyKernels(GpuConfig()))


def test_local_rank_from_launcher(monkeypatch):
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MPI_LOCAL_RANK", "PMI_LOCAL_RANK",
                "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "mpi4py.MPI", None)
    assert local_rank() == 0
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_rank() == 3
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert local_rank() == 1


# ---------------------------------------------------------------------------------------------
# On a GPU.

@pytest.fixture(scope="module")
def engines():
    """Every option through the regimes (no batch kernel), default arithmetic."""
    return {mode: GpuEngine(mode, batch_max_steps=0) for mode in MODES}


@pytest.fixture(scope="module")
def exact_engines():
    """As `engines`, exact arithmetic (fma=False): bitwise equal to serial."""
    return {mode: GpuEngine(mode, batch_max_steps=0, fma=False) for mode in MODES}


def small_cuda_kernels(config):
    """CudaKernels whose persistent kernel acts as if only SMALL_PERS_TILES tiles fit at once."""
    from pricer.engines.gpu import CudaKernels
    kernels = CudaKernels(config)
    if config.pers_vt:
        assert kernels.pers_tiles() >= SMALL_PERS_TILES
        kernels._pers_tiles = SMALL_PERS_TILES
    return kernels


@pytest.fixture(scope="module")
def small_engines():
    kernels = {name: small_cuda_kernels(cfg) for name, cfg in
               (("mid", SMALL), ("warp", SMALL_WARP), ("pers", SMALL_PERS))}
    return {(mode, name): GpuEngine(mode, config=cfg, kernels=kernels[name]) for mode in MODES
            for name, cfg in (("mid", SMALL), ("warp", SMALL_WARP), ("pers", SMALL_PERS))
            if mode != "pers" or cfg.pers_vt}


@pytest.mark.gpu
@needs_gpu
def test_runtime_one_context():
    from pricer.engines.gpu import GpuRuntime
    rt = GpuRuntime.get()
    assert rt is GpuRuntime.get()
    assert rt.arch.startswith("sm_") and not rt.closed
    import pycuda.driver as cuda
    assert cuda.Context.get_current() is not None
    assert rt.device_index == local_rank() % cuda.Device.count()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("below_t1", ["mid", "warp", "pers"])
def test_gpu_small_config_boundaries(mode, below_t1, small_engines, rng):
    if (mode, below_t1) not in small_engines:
        pytest.skip("mode pers needs the persistent kernel")
    p = every_kind(rng, boundary_steps(dict(mid=SMALL, warp=SMALL_WARP, pers=SMALL_PERS)[below_t1]))
    got = small_engines[mode, below_t1].price(p)
    ref = SerialEngine().price(p)
    assert_close(got, ref, p, mode)
    if not SMALL.fma:
        np.testing.assert_array_equal(got, ref)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_default_config_small_n(mode, engines, rng):
    c = GpuConfig()
    steps = [1, 2, 3, 7, 64, c.t2 - 1, c.t2, c.t2 + 1, c.warp_w - 1, c.warp_w, c.warp_w + 1,
             c.t2 + c.warp_k, c.t2 + c.warp_k + 1, c.tiled_w - 1, c.tiled_w, c.tiled_w + 1,
             c.mid_w - 1, c.mid_w, c.mid_w + 1, c.t2 + c.mid_k, c.t2 + c.mid_k + 1, 5000]
    if mode == "wavefront":
        steps = steps[:-1]
    p = every_kind(rng, steps)
    assert_close(engines[mode].price(p), SerialEngine().price(p), p, mode)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["gpu", "hybrid", "tiled", "warp", "pers"])
def test_gpu_fresh_random_options(mode, engines, rng):
    p = options(rng, rng.integers(1, 10_001, 24))
    assert_close(engines[mode].price(p), SerialEngine().price(p), p, mode)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["gpu", "hybrid"])
def test_gpu_batch_kernel(mode, rng):
    """Portfolios mixing batch size classes, options wider than any class, and (hybrid) CPU ones."""
    steps = BATCH_EDGES + list(rng.integers(1, 8192, 30)) + [8192, 8193, 9000]
    p = every_kind(rng, steps)
    order = rng.permutation(len(p))
    p = p.take(order)
    assert_close(GpuEngine(mode).price(p), SerialEngine().price(p), p, mode)
    np.testing.assert_array_equal(GpuEngine(mode, fma=False).price(p), SerialEngine().price(p))


@pytest.mark.gpu
@needs_gpu
def test_gpu_t1_boundary_default(engines, rng):
    c = GpuConfig()
    steps = [c.t1 - 1, c.t1, c.t1 + 1, c.t1 + c.tiled_k + 1, 100_000]
    p = options(rng, steps)
    ref = CpuEngine().price(p)          # bitwise equal to serial, all cores
    for mode in ("hybrid", "gpu"):
        assert_close(engines[mode].price(p), ref, p, mode)


@pytest.mark.gpu
@needs_gpu
def test_gpu_fma_within_tolerance(rng):
    p = every_kind(rng, [1, 2, 499, 501, 3000, 10_000])
    ref = SerialEngine().price(p)
    for mode, extra in (("gpu", {}), ("hybrid", dict(t2=100)), ("gpu", dict(pers_vt=0)),
                        ("gpu", dict(mid_b=0, pers_vt=0)), ("pers", {})):
        got = GpuEngine(mode, fma=True, t1=2000, batch_max_steps=0, **extra).price(p)
        assert_close(got, ref, p, f"fma {mode} {extra}")
    assert_close(GpuEngine("hybrid", fma=True).price(p), ref, p, "fma batch")


@pytest.mark.gpu
@needs_gpu
def test_gpu_exact_mode_is_bitwise(exact_engines, rng):
    p = every_kind(rng, [1, 2, 600, 3000, 20_000])
    ref = SerialEngine().price(p)
    for mode in ("gpu", "hybrid", "tiled", "warp", "pers", "wavefront"):
        if mode == "wavefront":
            p, ref = p.take(np.arange(16)), ref[:16]
        np.testing.assert_array_equal(exact_engines[mode].price(p), ref, err_msg=mode)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fma", [True, False], ids=["fma", "exact"])
def test_gpu_persistent_kernel(fma, rng):
    """The persistent kernel (default shape) on fresh random American/European calls/puts: exact mode
    bitwise equal to serial, fma within tolerance; N around its tile and epoch edges, from T2 and
    from 0, tiny N, gpu/hybrid with T1 = 2000 (tiled above it); and in `pers` mode on a GPU cut
    down to SMALL_PERS_TILES tiles, so that levels wider than it holds go through tiled first. The
    default hand-over (~50 000 on a 132-SM GPU) lies above these N, so the default engines run the
    narrow shape alone; the wide shape runs alone with pers_narrow_vt = 0, and both with the
    hand-over at level 1000."""
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
    cut = small_cuda_kernels(GpuConfig(fma=fma, batch_max_steps=0))
    for label, engine in (("pers", GpuEngine("pers", fma=fma, batch_max_steps=0)),
                          ("gpu t1=2000", GpuEngine("gpu", fma=fma, batch_max_steps=0, t1=2000)),
                          ("hybrid t1=2000", GpuEngine("hybrid", fma=fma, batch_max_steps=0, t1=2000)),
                          ("pers, 8 tiles fit", GpuEngine("pers", config=cut.config, kernels=cut)),
                          ("pers, one shape", GpuEngine("pers", fma=fma, batch_max_steps=0,
                                                        pers_narrow_vt=0)),
                          ("gpu t1=2000, narrow below 1000",
                           GpuEngine("gpu", fma=fma, batch_max_steps=0, t1=2000,
                                     pers_narrow_below=below)),
                          ("hybrid, narrow below 1000",
                           GpuEngine("hybrid", fma=fma, batch_max_steps=0, pers_narrow_below=below))):
        got = engine.price(p)
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


@pytest.mark.gpu
@needs_gpu
def test_gpu_persistent_kernel_unscaled_fma(rng, monkeypatch):
    """fma mode where pd^pers_k is too small for the scaled arithmetic: the kernel's unscaled path."""
    import pricer.engines.gpu as gpu
    real = gpu.pers_pows
    monkeypatch.setattr(gpu, "pers_pows", lambda pd, k, out: real(pd, k, out) and False)
    p = every_kind(rng, [1, 63, 64, 65, 500, 3000])
    assert_close(GpuEngine("pers", fma=True).price(p), SerialEngine().price(p), p, "unscaled fma")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("feature", ["pers_eu_tiles", "pers_expipe", "pers_skip"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
def test_persistent_kernel_features_change_no_bit(feature, scaled, rng, monkeypatch):
    """American tiles that cannot exercise during an epoch take the European node (pers_eu_tiles),
    a scaled American step's exercise values are computed a step ahead (pers_expipe), and a put's
    tiles whose nodes all hold their exercise value skip the epoch (pers_skip): prices bitwise
    those of the kernel without the feature, in both shapes, with the scaled and the
    unscaled fma arithmetic, on calls and puts with dividends from deep in to far out of the money
    (exact mode: test_gpu_exact_mode_is_bitwise compares with serial)."""
    import pricer.engines.gpu as gpu
    if not scaled:
        real = gpu.pers_pows
        monkeypatch.setattr(gpu, "pers_pows", lambda pd, k, out: real(pd, k, out) and False)
    steps = [64, 500, 999, 1000, 1001, 3000, 20_000, 60_000, 120_000]
    p = every_kind(rng, np.repeat(steps, 3))
    p.strike[:] = p.spot * np.resize([0.5, 0.9, 1.0, 1.1, 2.0], len(p))
    # pers_skip moves a put's default hand-over to the narrow shape, and with it the epochs' bounds
    # (the scaled values' rounding): hybrid gets the same fixed hand-over on both sides
    hybrid = dict(pers_narrow_below=30_000) if feature == "pers_skip" else {}
    for mode, extra in (("pers", dict(pers_narrow_below=1000)), ("hybrid", hybrid)):
        on = GpuEngine(mode, batch_max_steps=0, **extra)
        off = GpuEngine(mode, batch_max_steps=0, **{feature: False}, **extra)
        assert getattr(on.config, feature) and not getattr(off.config, feature)
        np.testing.assert_array_equal(on.price(p), off.price(p), err_msg=mode)


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
    from pricer.results import read_results
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


@pytest.mark.parametrize("mode", MODES)
def test_emulated_regimes_keep_the_first_levels_bitwise(rng, mode):
    """With `levels` (Greeks) the GPU stops at level 2 and the host keeps levels 2 and 1: in exact
    mode the kept values and the prices are bitwise the serial engine's (numpy emulation)."""
    from pricer.engines.serial import LEVEL_VALUES
    p = options(rng, np.r_[1, 2, 3, rng.integers(4, 700, 12)])
    ref_levels = np.empty((len(p), LEVEL_VALUES))
    ref = SerialEngine().price(p, ref_levels)
    levels = np.full((len(p), LEVEL_VALUES), -1.0)
    config = SMALL_PERS if mode == "pers" else SMALL
    got = GpuEngine(mode, config=config, kernels=small_numpy_kernels(config)).price(p, levels)
    assert np.array_equal(got, ref)
    assert np.array_equal(levels, ref_levels, equal_nan=True)
