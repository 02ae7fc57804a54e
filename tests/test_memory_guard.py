"""The memory guard (pricer/run/memory.py; docs/reliability.md): the host estimate, and the device
guard that fits every rank's share to its GPU by the engine's own sizing (GpuEngine.device_need).

Everywhere (no GPU): device_need against what the engines' own code allocates, counted through a
recording stand-in for pycuda (tests/fake_cuda.py) under the real CudaBatchRunner / CudaKernels;
the chunk shrinking and the refusal through memory.fit_devices; and the whole path through real
`mpiexec -n 3` runs of the CLI with stand-in GPU backends (a CPU-backed batch runner, a stand-in
measurement of an 80 GiB GPU), so that the gather, rank 0's fit, the verdict and each rank's
setting are exercised here.

Marked `gpu` (they skip here with the reason; run them on the GPU machine):
    python3 -m pytest -m gpu -q -s tests/test_memory_guard.py
a tiny PRICER_DEVICE_MEMORY_LIMIT makes `batch` and `hybrid` stream in smaller chunks with bitwise
the same prices; an impossible one with a large-N option on `hybrid` exits 2 naming the numbers,
nothing written; and device_need is compared with what cuMemGetInfo sees the engines take
(printed, for docs/reliability.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fake_cuda import FakeEvent, FakeRuntime, Tracker
from helpers import env, mpiexec
from pricer.engines import AUTO_CPU_MAX_NODES
from pricer.engines.base import DeviceInfo
from pricer.engines.cpu.parallel import CpuEngine
from pricer.engines.gpu.batch_layout import INPUT_BYTES_PER_OPTION, KEY_BINS, batch_row_bytes
from pricer.engines.gpu.batch_plan import DEFAULT_CHUNK_OPTIONS, MAX_STEPS
from pricer.engines.gpu.batch_runner import CudaBatchRunner
from pricer.engines.gpu.config import GpuConfig
from pricer.engines.gpu.engine import (BATCH_SETS, BATCH_SORT_BYTES, REGIME_BYTES_PER_NODE,
                                       GpuEngine, regime_bytes)
from pricer.engines.gpu.regimes import CudaKernels
from pricer.errors import InputError
from pricer.run.chunks import chunk_grid
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results
from pricer.model.greeks import Analytics, price_with_analytics
from pricer.model.lattice import LEVEL_VALUES, lattice_parameters
from pricer.run import memory

from gpu_cases import needs_gpu

MIB = 1 << 20
ANALYTICS = [Analytics(), Analytics(greeks=True), Analytics(richardson=True),
             Analytics(greeks=True, richardson=True)]
ANALYTICS_IDS = ["price", "greeks", "richardson", "both"]
SORT = BATCH_SETS * BATCH_SORT_BYTES      # the runner's GPU sort counts, whatever its chunks
ROW = BATCH_SETS * batch_row_bytes(False)  # a chunk row in both buffer sets: 140 bytes




def book(steps, seed: int = 3, first_id: int = 500) -> Portfolio:
    steps = np.asarray(steps, dtype=np.int64)
    n, rng = steps.size, np.random.default_rng(seed)
    p = Portfolio(id=np.arange(first_id, first_id + n, dtype=np.int64),
                  spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n),
                  maturity=rng.uniform(0.25, 2, n), rate=rng.uniform(0, 0.05, n),
                  dividend=rng.uniform(0, 0.02, n), volatility=rng.uniform(0.2, 0.5, n),
                  steps=steps, call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)
    # maturities short enough that the lattices' node prices stay in FP64's range (lattice.py
    # refuses wider ones): (u/d)^N = e^{2 sigma sqrt(T N)} at most e^500
    p.maturity = np.minimum(p.maturity, (250.0 / (p.volatility * np.sqrt(steps))) ** 2)
    return p


def columns(p: Portfolio) -> dict:
    return dict(spot=p.spot, strike=p.strike, maturity=p.maturity, rate=p.rate, dividend=p.dividend,
                volatility=p.volatility, steps=p.steps, call=p.call, american=p.american)


def take(cols: dict, a: int, b: int) -> dict:
    return {k: v[a:b] for k, v in cols.items()}


# GpuEngine's configuration in these tests: the defaults, with hybrid's CPU share up to 500 steps
CONFIG = GpuConfig(cpu_max_steps=500)


def sizing_engine(mode: str = "batch", config: GpuConfig = CONFIG, **kw) -> GpuEngine:
    """A GpuEngine for its device_need alone (its kernels and runner are never made)."""
    return GpuEngine(mode, config=config, **kw)


def counted_engine(tracker: Tracker, mode: str = "batch", config: GpuConfig = CONFIG,
                   occupancy: bool = False, **kw) -> GpuEngine:
    """The real GpuEngine, CudaBatchRunner and CudaKernels over counted allocations."""
    rt = FakeRuntime(tracker, occupancy=occupancy)
    return GpuEngine(mode, config=config, kernels=CudaKernels(config, rt),
                     runner=CudaBatchRunner(runtime=rt), **kw)


def price_share(engine, p: Portfolio, cuts, analytics: Analytics, chunk_options: int = 0,
                warm_up: bool = True):
    """As the run's driver (start_engine, compute): warm up, the device fit, prepare, then one
    engine call per chunk."""
    if warm_up:
        engine.warm_up()
    engine.fit_device(chunk_options)
    engine.prepare(p.steps, levels=analytics.greeks)
    cols = columns(p)
    for a, b in zip(cuts[:-1], cuts[1:]):
        price_with_analytics(engine, take(cols, a, b), "crr", p.id[a:b], analytics)


def _info(device="host:0000:01:00.0", free=80 * (1 << 30)):
    return DeviceInfo(free=float(free), total=float(free), device=device, name="Test GPU")


# ------------------------------------------------------------------------------ the sizes

def test_sizes_are_the_engines():
    assert batch_row_bytes(False) == INPUT_BYTES_PER_OPTION + 4 + 8 == 70   # 4: the class key
    assert batch_row_bytes(True) == INPUT_BYTES_PER_OPTION + 4 + 8 * (1 + LEVEL_VALUES) == 110
    assert BATCH_SORT_BYTES == 2 * 4 * KEY_BINS == 2 * 4 * (MAX_STEPS + 1)
    assert regime_bytes(100_000) == REGIME_BYTES_PER_NODE * 100_002 == 32 * 100_002
    assert regime_bytes(10) == 32 * 1024 and regime_bytes(0) == 0


def test_host_estimate_with_every_rank_reading():
    """--distribute read moves the columns as read from rank 0 to each rank's own rows, and every
    rank holds the book's id and steps columns: per rank, 16 bytes per option of the book plus
    the columns, matrix row and result of each of its own (docs/reliability.md)."""
    n, ranks = 10_000_000, 4
    scatter = memory.estimate(n, 1, ranks, ranks, 4096, 16, 1, 1, False, False)
    read = memory.estimate(n, 1, ranks, ranks, 4096, 16, 1, 1, False, False, read=True)
    share = n // ranks
    working = 4096 * memory.CHUNK_ARRAY_BYTES + memory.ENGINE_BYTES_PER_STEP * 17
    assert read.other == n * 16 + share * (2 * memory.COLUMN_BYTES + memory.MATRIX_BYTES + 8) + working
    assert read.root == read.other + n * (16 + 16)
    assert read.root < scatter.root and read.other > scatter.other


def test_host_estimate_refusal_names_the_numbers(monkeypatch):
    monkeypatch.setenv("PRICER_MEMORY_LIMIT", "1M")
    est = memory.estimate(1_000_000, 1, 2, 2, 4096, 100, 1, 1, False, False)
    assert est.available == MIB and not est.fits()
    with pytest.raises(InputError, match=r"book.h5: not enough memory: .* GiB on rank 0 .* for the "
                                         r"2 rank\(s\) on rank 0's node, which has 0.00 GiB"):
        memory.check(est, "book.h5")
    monkeypatch.setenv("PRICER_MEMORY_LIMIT", "64G")
    memory.check(memory.estimate(1_000_000, 1, 2, 2, 4096, 100, 1, 1, False, False), "book.h5")


# ----------------------------------------------- device_need against the real allocations

MODES = [("batch", CONFIG), ("hybrid", CONFIG), ("gpu", CONFIG),
         ("hybrid-exact", GpuConfig(cpu_max_steps=500, fma=False))]


@pytest.mark.parametrize("mode,config", MODES, ids=[m for m, _ in MODES])
@pytest.mark.parametrize("analytics", ANALYTICS, ids=ANALYTICS_IDS)
def test_device_need_is_what_the_engine_allocates(mode, config, analytics, rng):
    """The real CudaBatchRunner and CudaKernels over counted allocations, driven as the run drives
    them: after pricing, the engine holds exactly what its device_need says (the runner's two
    buffer sets of one chunk and its sort counts, and the widest regime option's arrays), and
    never held more; with the default chunks and with chunks fitted down to 37 options."""
    mode = mode.split("-")[0]
    steps = np.concatenate([rng.integers(3, 3000, 300), rng.integers(MAX_STEPS - 5, MAX_STEPS + 1, 5),
                            [MAX_STEPS + 1, 40_000, 25_001]])
    if not config.fma:   # every option through the regimes, one launch sequence each: fewer
        steps = np.concatenate([rng.integers(3, 3000, 20), [MAX_STEPS, 9000, 40_000]])
    p = book(rng.permutation(steps))
    cuts = chunk_grid(p.steps, 3e8, 10**9)
    for chunk_options in (0, 37):
        tracker = Tracker()
        engine = counted_engine(tracker, mode, config)
        engine.fit_device(chunk_options)
        need = engine.device_need(p.steps, cuts, analytics)
        price_share(engine, p, cuts, analytics, chunk_options)
        assert need.held_steps == 40_000 and p.steps[need.held_row] == 40_000
        assert tracker.live == tracker.peak == need.total, (tracker.live, tracker.peak, need)
        if config.fma:
            assert need.streamed > 0 and need.unit == BATCH_SETS * batch_row_bytes(analytics.greeks)
        else:
            assert need.streamed == 0 and need.held == regime_bytes(40_000)


def test_device_need_counts_the_largest_call(rng):
    """Chunks priced one call each: the buffers grow to the largest call (five lattices per option
    with --greeks), not beyond the chunk options."""
    p = book(rng.integers(16, 200, 400))
    cuts = np.array([0, 10, 300, 400])
    tracker = Tracker()
    engine = counted_engine(tracker)
    engine.fit_device(1000)
    greeks = Analytics(greeks=True)
    need = engine.device_need(p.steps, cuts, greeks)
    assert need.streamed == 2 * 1000 * 110                  # 58 in, 4 key, 8 out, 40 levels
    assert need.held == SORT and need.held_row == -1        # no regime option
    price_share(engine, p, cuts, greeks)
    assert tracker.live == tracker.peak == need.total


def test_auto_small_share_on_the_cpu_needs_no_device_memory(rng):
    """`auto` is batch whose share of at most AUTO_CPU_MAX_NODES nodes runs on the CPU: its device
    need is 0, it allocates nothing for that share, and memory.fit_devices passes it on a GPU with
    nothing free beyond DEVICE_ALLOWANCE."""
    small = book(np.full(50, 20))
    cuts = np.array([0, 50])
    tracker = Tracker()
    auto = counted_engine(tracker, cpu_max_nodes=AUTO_CPU_MAX_NODES)
    need = auto.device_need(small.steps, cuts, Analytics())
    assert need.total == 0
    price_share(auto, small, cuts, Analytics(), warm_up=False)
    assert tracker.peak == 0
    nothing_more = _info(free=memory.DEVICE_ALLOWANCE)      # the allowance and not a byte more
    fitted = memory.fit_devices(auto, [nothing_more], [(small.steps, cuts, small.id)], Analytics(),
                                "x.h5", environ={})
    assert list(fitted.chunk_options) == [0] and fitted.notes == []
    # a share above the threshold is batch's
    big = book(np.full(500, 2000))
    assert auto.device_need(big.steps, np.array([0, 500]), Analytics()).total == SORT + 500 * ROW


def test_warm_up_buffers_are_inside_the_allowance():
    """warm_up prices one option of each kernel class before the share is known: its buffers (a
    few rows and the sort counts) stay, outside device_need, far inside DEVICE_ALLOWANCE."""
    tracker = Tracker()
    counted_engine(tracker).warm_up()
    assert 0 < tracker.live < memory.DEVICE_ALLOWANCE / 100


def test_persistent_ring_is_inside_the_allowance(rng):
    """On a runtime with occupancy figures the regimes run the persistent kernel, whose ring (kept
    from its first launch, sized by the tiles the GPU holds) is outside device_need and inside
    DEVICE_ALLOWANCE; everything else is device_need exactly."""
    p = book([300, 2000, 40_000, MAX_STEPS + 1])
    cuts = np.array([0, 4])
    tracker = Tracker()
    engine = counted_engine(tracker, "gpu", occupancy=True)
    need = engine.device_need(p.steps, cuts, Analytics())
    price_share(engine, p, cuts, Analytics())
    assert engine.kernels.pers_top() > 40_000            # the persistent kernel took it
    assert need.total < tracker.live < need.total + memory.DEVICE_ALLOWANCE / 4


def test_batch_stats_sum_every_chunks_event_times(rng, monkeypatch):
    """The batch runner's last_stats: each chunk's copies and kernels as its events say (here
    1 ms between any two), summed over the chunks. A buffer's events are read before its next
    chunk records them again; the last two chunks' only when last_stats is read (once)."""
    reads = []
    monkeypatch.setattr(FakeEvent, "time_since", lambda self, other: reads.append(1) or 1.0)
    engine = counted_engine(Tracker())
    engine.fit_device(100)
    params = lattice_parameters(columns(book(rng.integers(16, 200, 450))))
    engine.price(params)                                    # 5 chunks on 2 buffers
    assert len(reads) == 3 * 3                              # chunks 0-2, before their reuse
    stats = engine.runner().last_stats
    assert len(reads) == 5 * 3 and stats["chunks"] == 5
    assert stats["copy_in"] == stats["kernels"] == stats["copy_out"] == pytest.approx(5e-3)
    assert engine.runner().last_stats == stats and len(reads) == 5 * 3


def test_device_info_is_the_engines_measurement():
    """memory.device_info: the engine's measurement in its context (free and total bytes, host and
    PCI bus id, name); None for an engine without a GPU or one that cannot say."""
    tracker = Tracker()
    engine = counted_engine(tracker)
    info = memory.device_info(engine)
    assert info.free == info.total == 80.0 * (1 << 30) and info.name == "Stand-in GPU"
    assert info.device.endswith(":0000:01:00.0")
    assert memory.device_info(CpuEngine()) is None and memory.device_info(None) is None

    class Broken(GpuEngine):
        def device_info(self):
            raise RuntimeError("no context")

    assert memory.device_info(Broken("batch", config=CONFIG)) is None


# ------------------------------------------------------------------ every GPU backend alike

def test_gpu_and_hybrid_stream_through_the_runner_as_batch(rng):
    """gpu and hybrid price options up to MAX_STEPS with the batch runner: the same chunk buffers
    as batch (hybrid less its CPU share), no per-call arrays; above MAX_STEPS the regimes' arrays.
    In the exact mode (fma=False) every option goes through the regimes: nothing streams."""
    steps = rng.integers(1, MAX_STEPS + 1, 3000)
    cuts = np.array([0, 1000, 3000])
    a = Analytics()
    # prepare() sizes the buffers for the share's runner options: one chunk of them all here
    batch = sizing_engine("batch").device_need(steps, cuts, a)
    assert (batch.held, batch.streamed, batch.held_row) == (SORT, 3000 * ROW, -1)
    assert sizing_engine("gpu").device_need(steps, cuts, a) == batch
    on_runner = np.count_nonzero(steps > CONFIG.cpu_max_steps)
    hybrid = sizing_engine("hybrid").device_need(steps, cuts, a)
    assert (hybrid.held, hybrid.streamed, hybrid.held_row) == (SORT, on_runner * ROW, -1)
    assert on_runner < 3000
    exact = sizing_engine("gpu", GpuConfig(fma=False)).device_need(steps, cuts, a)
    assert exact.streamed == 0 and exact.held == regime_bytes(steps.max())
    assert steps[exact.held_row] == steps.max()


@pytest.mark.parametrize("mode", ["batch", "hybrid", "gpu"])
def test_chunks_shrink_to_the_budget(mode, rng):
    """DeviceNeed.fit: 0 where the engine fits as it is, else the options per chunk that fit the
    budget (fit_device then makes device_need fit it), None where one option per chunk does not."""
    p = book(rng.integers(501, 4000, 5000))
    cuts = np.array([0, 5000])
    engine = sizing_engine(mode)
    need = engine.device_need(p.steps, cuts, Analytics())
    assert need.total == 5000 * ROW + SORT
    assert need.fit(need.total) == 0
    budget = SORT + 100_000
    chunk = need.fit(budget)
    assert chunk == 100_000 // 140 == 714
    engine.fit_device(chunk)
    assert engine.chunk_options == 714
    assert engine.device_need(p.steps, cuts, Analytics()).total <= budget
    assert need.fit(SORT + 139) is None                      # not even one option per chunk


def test_shrink_keeps_the_wide_option_whole():
    p = book([100] * 1000 + [1_000_000])
    need = sizing_engine("batch").device_need(p.steps, np.array([0, 1001]), Analytics())
    assert need.held == 32 * 1_000_002 + SORT and need.held_row == 1000
    assert need.held_steps == 1_000_000 and need.held_what.startswith("32 bytes per node")
    assert need.fit(need.held + 140 * 10) == 10
    assert need.fit(need.held + 139) is None


# ------------------------------------------------------------------------- memory.fit_devices

def test_refusal_names_option_steps_and_gib():
    engine = sizing_engine("hybrid")
    p = book([1000, 100_000_000, 20])
    shares = [(p.steps, np.array([0, 3]), p.id)]
    with pytest.raises(InputError) as err:
        memory.fit_devices(engine, [_info(free=2 << 30)], shares, Analytics(), "book.h5", environ={})
    text = str(err.value)
    for needle in ("book.h5: not enough GPU memory", "option id 501 (N = 100000000 steps)",
                   "needs 2.98 GiB on the device (32 bytes per node",
                   "the GPU of rank 0 (Test GPU) has 2 GiB free", "the hybrid backend",
                   "--backend cpu"):
        assert needle in text, (needle, text)
    fitted = memory.fit_devices(engine, [_info(free=4 << 30)], shares, Analytics(), "book.h5",
                                environ={})
    assert list(fitted.chunk_options) == [0] and fitted.notes == []


def test_refusal_without_a_wide_option_names_the_least():
    """No regime option, but not even one option per chunk fits: the backend's least need."""
    engine = sizing_engine("batch")
    p = book(np.full(10, 100))
    limit = {memory.DEVICE_LIMIT_VARIABLE: str(memory.DEVICE_ALLOWANCE + SORT + 100)}
    with pytest.raises(InputError) as err:
        memory.fit_devices(engine, [_info()], [(p.steps, np.array([0, 10]), p.id)], Analytics(),
                           "book.h5", environ=limit)
    text = str(err.value)
    for needle in ("book.h5: not enough GPU memory: the batch backend needs at least "
                   f"{memory.gib(SORT + ROW + memory.DEVICE_ALLOWANCE)} on rank 0's GPU",
                   "(PRICER_DEVICE_MEMORY_LIMIT)", "--backend cpu"):
        assert needle in text, (needle, text)


@pytest.mark.parametrize("mode", ["batch", "hybrid", "gpu"])
def test_ranks_sharing_a_gpu_share_its_memory(mode):
    """PRICER_DEVICE_MEMORY_LIMIT replaces every GPU's free memory; ranks on one GPU split it; an
    unmeasured rank is not checked. The note is the same for every GPU backend."""
    engine = sizing_engine(mode)
    p = book(np.full(1000, 600))
    share = (p.steps, np.array([0, 1000]), p.id)
    per_rank = memory.DEVICE_ALLOWANCE + SORT + ROW * 100
    limit = {memory.DEVICE_LIMIT_VARIABLE: str(2 * per_rank)}
    shared = [_info("a"), _info("a"), _info("b"), None]
    fitted = memory.fit_devices(engine, shared, [share] * 4, Analytics(), "x.h5", environ=limit)
    # a: two ranks, 100 options' room each; b: alone, twice that and an allowance; None: unmeasured
    assert list(fitted.chunk_options) == [100, 100, 0, 0], fitted.chunk_options
    assert fitted.notes == [f"GPU memory: chunks of 100 options on the GPU (not "
                            f"{DEFAULT_CHUNK_OPTIONS}) on ranks 0, 1, to fit "
                            f"{memory.size_text(per_rank)} free per rank (less "
                            f"{memory.size_text(memory.DEVICE_ALLOWANCE)} kept for CUDA)"], fitted.notes
    assert memory.size_text(per_rank) == memory.size_text(memory.DEVICE_ALLOWANCE) == "0.5 GiB"
    # without the variable each GPU's own measurement: 80 GiB fits
    fitted = memory.fit_devices(engine, shared, [share] * 4, Analytics(), "x.h5", environ={})
    assert list(fitted.chunk_options) == [0, 0, 0, 0] and fitted.notes == []


@pytest.mark.parametrize("text,value", [("1024", 1024), ("64K", 65536), ("1.5G", 1.5 * (1 << 30)),
                                        ("2m", 2 * MIB)])
def test_device_limit_variable(text, value):
    assert memory.device_limit({memory.DEVICE_LIMIT_VARIABLE: text}) == value
    assert memory.device_limit({}) is None


@pytest.mark.parametrize("text", ["lots", "-5", "G", "nan"])
def test_bad_device_limit_is_refused(text):
    with pytest.raises(InputError, match="PRICER_DEVICE_MEMORY_LIMIT must be a number of bytes"):
        memory.device_limit({memory.DEVICE_LIMIT_VARIABLE: text})


# --------------------------------------- the whole path with stand-in engines, real mpiexec

STAND_IN = textwrap.dedent('''
    """pricer's CLI with the GPU backends on stand-ins (tests/test_memory_guard.py): GpuEngine with
    a batch runner that prices on the CPU and says its chunk options, the regimes on the numpy
    emulation; every rank "measures" an 80 GiB GPU of its own."""
    import sys
    sys.path.insert(0, sys.argv.pop(1))          # tests/, for numpy_kernels
    from mpi4py import MPI
    from numpy_kernels import NumpyKernels
    from pricer.engines.base import DeviceInfo, Engine, register
    from pricer.engines.cpu.parallel import CpuEngine
    from pricer.engines.gpu.batch_plan import DEFAULT_CHUNK_OPTIONS, chunk_bounds
    from pricer.engines.gpu.config import GpuConfig
    from pricer.engines.gpu.engine import GpuEngine

    RANK = MPI.COMM_WORLD.Get_rank()

    class CpuRunner(Engine):
        name, uses_gpu = "batch runner", True

        def __init__(self):
            self.chunk_options = DEFAULT_CHUNK_OPTIONS

        def price(self, params, levels=None):
            chunks = len(chunk_bounds(len(params), self.chunk_options))
            print(f"stand-in rank {RANK}: chunk_options {self.chunk_options}, {chunks} chunks",
                  file=sys.stderr, flush=True)
            return CpuEngine().price(params, levels)

    class StandIn(GpuEngine):
        def price(self, params, levels=None):
            print(f"stand-in call of {len(params)} lattices", file=sys.stderr, flush=True)
            return super().price(params, levels)

        def device_info(self):
            return DeviceInfo(80.0 * (1 << 30), 80.0 * (1 << 30), f"stand-in:{RANK}",
                              "Stand-in GPU")

    def factory(mode):
        def make(**overrides):
            config = GpuConfig(t1=300, t2=40, tiled_b=32, tiled_vt=4, tiled_k=50, mid_b=32,
                               mid_vt=2, mid_k=25, pers_vt=2, pers_k=16, pers_warps=2)
            return StandIn(mode, config=config, kernels=NumpyKernels(config), runner=CpuRunner(),
                           **overrides)
        return make

    for mode in ("gpu", "hybrid", "batch"):
        register(mode, {("options", "lattice"): factory(mode)}, help="a stand-in")
    from pricer.cli import main
    raise SystemExit(main(sys.argv[1:]))
''')


def stand_in_run(tmp_path, args, limit, ranks=3, timeout=120):
    """The stand-in script's run (under `mpiexec -n RANKS` where ranks is not 0); `timeout` is a
    bound against hangs, not on speed."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    e = env()
    e[memory.DEVICE_LIMIT_VARIABLE] = str(limit)
    cmd = [sys.executable, str(script), os.path.dirname(os.path.abspath(__file__))]
    cmd += [str(a) for a in args]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


def serial_prices(p: Portfolio):
    from pricer.engines.cpu.serial import SerialEngine
    return SerialEngine().price(lattice_parameters(columns(p)))


@pytest.mark.parametrize("backend", ["batch", "hybrid"])
def test_stand_in_streams_smaller_chunks_on_every_rank(backend, tmp_path):
    """3 ranks, PRICER_DEVICE_MEMORY_LIMIT = allowance + the sort's counts + 37 options' buffers:
    every rank's runner is set to chunks of 37 options before it prices, rank 0 says so (the same
    note for every GPU backend), the prices are the serial engine's bitwise (hybrid's options of
    at most 40 steps on the CPU engine, the rest on the stand-in runner's)."""
    p = book(np.random.default_rng(1).integers(3, 300, 240))
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = stand_in_run(tmp_path, ["price", src, "-o", out, "--backend", backend, "--threads", "1"],
                        memory.DEVICE_ALLOWANCE + SORT + ROW * 37)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for rank in range(3):
        assert f"stand-in rank {rank}: chunk_options 37," in proc.stderr, text
    assert (f"GPU memory: chunks of 37 options on the GPU (not {DEFAULT_CHUNK_OPTIONS}) on all 3 "
            f"ranks") in proc.stdout, text
    got = read_results(str(out))
    np.testing.assert_array_equal(got["id"], p.id)
    assert (got["price"].view(np.int64) == serial_prices(p).view(np.int64)).all()


def test_stand_in_refusal_exits_2_on_every_rank_nothing_written(tmp_path):
    """A hybrid option of N = 10**7 on a GPU with (allowance + 1 MiB) free: exit 2 before any
    pricing (no stand-in call), rank 0 names the option, N and the GiB, no traceback, no file,
    every rank out (mpiexec returned, within stand_in_run's timeout against hangs)."""
    steps = [50] * 30 + [10_000_000] + [400] * 30
    p = book(steps, first_id=7000)
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = stand_in_run(tmp_path, ["price", src, "-o", out, "--backend", "hybrid"],
                        f"{memory.DEVICE_ALLOWANCE + MIB}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text                     # every rank out: mpiexec returned
    assert text.count("pricer: error:") == 1 and "Traceback" not in text, text
    for needle in ("not enough GPU memory: option id 7030 (N = 10000000 steps) needs 0.298 GiB",
                   "has 0.501 GiB free (PRICER_DEVICE_MEMORY_LIMIT)"):
        assert needle in proc.stderr, (needle, text)
    assert "stand-in call" not in text                      # nothing priced
    assert sorted(os.listdir(tmp_path)) == ["book.h5", "stand_in.py"]


def test_stand_in_fits_without_a_note(tmp_path):
    """One process, the same book on a GPU with room: no shrink, no note, the default chunks."""
    p = book(np.random.default_rng(2).integers(41, 300, 60))
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = stand_in_run(tmp_path, ["price", src, "-o", out, "--backend", "gpu"],
                        memory.DEVICE_ALLOWANCE + SORT + ROW * 60, ranks=0)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert f"stand-in rank 0: chunk_options {DEFAULT_CHUNK_OPTIONS}, 1 chunks" in proc.stderr, text
    assert "GPU memory" not in proc.stdout, text
    got = read_results(str(out))
    assert (got["price"].view(np.int64) == serial_prices(p).view(np.int64)).all()


# ------------------------------------------------------------------------ on a real GPU

def _cli(args, limit=None, ranks=None, timeout=300):
    e = env()
    e.pop(memory.DEVICE_LIMIT_VARIABLE, None)
    # the ranks of these tests share one GPU (the first visible), whatever the machine has
    e["CUDA_VISIBLE_DEVICES"] = e.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if limit is not None:
        e[memory.DEVICE_LIMIT_VARIABLE] = str(limit)
    cmd = [sys.executable, "-m", "pricer"] + [str(a) for a in args]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


def _bitwise(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


@pytest.mark.gpu
@needs_gpu
def test_gpu_batch_streams_smaller_chunks_same_prices(tmp_path):
    """Real CLI, 2 ranks on one GPU, PRICER_DEVICE_MEMORY_LIMIT = 2 x (allowance + the GPU sort's
    counts + 64 KiB): each rank streams chunks of 468 options (64 KiB / 140 B) instead of 2**20;
    bitwise the prices of the same run without the limit (each option's kernel is the same
    whatever its chunk)."""
    p = book(np.random.default_rng(4).integers(16, 3000, 4000))
    src = tmp_path / "book.h5"
    write_portfolio(str(src), p)
    free = _cli(["price", src, "-o", tmp_path / "free.h5", "--backend", "batch"], ranks=2)
    assert free.returncode == 0, free.stdout + free.stderr
    assert "GPU memory" not in free.stdout, free.stdout
    limit = 2 * (memory.DEVICE_ALLOWANCE + SORT + 64 * 1024)
    tight = _cli(["price", src, "-o", tmp_path / "tight.h5", "--backend", "batch"], limit, ranks=2)
    assert tight.returncode == 0, tight.stdout + tight.stderr
    print(tight.stdout)
    assert (f"GPU memory: chunks of 468 options on the GPU (not {DEFAULT_CHUNK_OPTIONS}) on all 2 "
            f"ranks") in tight.stdout, tight.stdout
    a, b = read_results(str(tmp_path / "free.h5")), read_results(str(tmp_path / "tight.h5"))
    np.testing.assert_array_equal(a["id"], b["id"])
    assert _bitwise(a["price"], b["price"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_hybrid_refuses_an_option_too_wide_exit_2(tmp_path):
    """Real CLI, 2 ranks on one GPU, allowance + 1 MiB each: the option of N = 200 000 (6.1 MiB of
    regime arrays, with the runner's sort counts where other options use it) is refused before any
    pricing: exit 2, one message naming its id, N and the GiB, nothing written, both ranks out."""
    p = book([1000] * 20 + [200_000] + [600] * 20, first_id=9000)
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = _cli(["price", src, "-o", out, "--backend", "hybrid"],
                2 * (memory.DEVICE_ALLOWANCE + MIB), ranks=2, timeout=120)
    text = proc.stdout + proc.stderr
    print(text)
    assert proc.returncode == 2, text
    assert text.count("pricer: error:") == 1 and "Traceback" not in text, text
    said = re.search(r"not enough GPU memory: option id 9020 \(N = 200000 steps\) needs "
                     r"([0-9.e-]+) GiB", proc.stderr)
    assert said, text
    # the regime arrays, and the sort counts if this rank's other options go through the runner
    assert float(said[1]) in (float(memory.gib(regime_bytes(200_000)).split()[0]),
                              float(memory.gib(regime_bytes(200_000) + SORT).split()[0])), text
    assert "GiB free (PRICER_DEVICE_MEMORY_LIMIT), shared by 2 ranks" in proc.stderr, text
    assert sorted(os.listdir(tmp_path)) == ["book.h5"]


@pytest.mark.gpu
@needs_gpu
def test_gpu_hybrid_streams_smaller_chunks_same_prices(tmp_path):
    """Real CLI, one process, allowance + the sort's counts + 50 options' buffers: hybrid's options
    up to MAX_STEPS stream through the batch runner in chunks of 50 (the note as batch's);
    bitwise the prices without the limit."""
    p = book(np.random.default_rng(6).integers(9000, MAX_STEPS + 1, 300))   # above the CPU's share
    src = tmp_path / "book.h5"
    write_portfolio(str(src), p)
    free = _cli(["price", src, "-o", tmp_path / "free.h5", "--backend", "hybrid"])
    assert free.returncode == 0, free.stdout + free.stderr
    tight = _cli(["price", src, "-o", tmp_path / "tight.h5", "--backend", "hybrid"],
                 memory.DEVICE_ALLOWANCE + SORT + ROW * 50)
    assert tight.returncode == 0, tight.stdout + tight.stderr
    print(tight.stdout)
    assert (f"GPU memory: chunks of 50 options on the GPU (not {DEFAULT_CHUNK_OPTIONS}) on "
            f"rank 0") in tight.stdout, tight.stdout
    a, b = read_results(str(tmp_path / "free.h5")), read_results(str(tmp_path / "tight.h5"))
    assert _bitwise(a["price"], b["price"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_device_need_against_cuMemGetInfo(capsys):
    """What the engines take on the device (cuMemGetInfo before and after) against their
    device_need: never more than it + DEVICE_ALLOWANCE, and at least half of it. Prints both (the
    figures docs/reliability.md asks for)."""
    from pricer.engines.gpu.runtime import GpuRuntime
    rt = GpuRuntime.get()
    rows = []

    def used(action):
        rt.context.synchronize()
        before = rt.cuda.mem_get_info()[0]
        action()
        rt.context.synchronize()
        return before - rt.cuda.mem_get_info()[0]

    steps = np.random.default_rng(8).integers(16, 2000, 1_500_000)
    for greeks in (False, True):
        batch = GpuEngine("batch")
        batch.warm_up()                 # its kernels loaded: what is measured is the buffers
        need = batch.device_need(steps, np.array([0, steps.size]), Analytics(greeks=greeks))
        took = used(lambda: batch.prepare(steps, levels=greeks))
        batch.runner()._release()       # the next engine's buffers are measured alone
        rows.append((f"batch prepare, 1.5M options, greeks={greeks}", need.total, took))
    hybrid = GpuEngine("hybrid")
    kernels = hybrid.kernels            # loaded before the measurement
    wide = np.array([5_000_000])
    need = hybrid.device_need(wide, np.array([0, 1]), Analytics())
    took = used(lambda: kernels.reserve(int(wide[0]) + 2))
    for buffer in kernels.reserve(int(wide[0]) + 2):
        rt.free(buffer)
    rows.append(("hybrid regime buffers, N = 5e6", need.total, took))
    with capsys.disabled():
        for what, estimate, took in rows:
            print(f"\n{what}: device_need {estimate / MIB:.1f} MiB, cuMemGetInfo {took / MIB:.1f} MiB")
    for what, estimate, took in rows:
        assert took <= estimate + memory.DEVICE_ALLOWANCE and took >= estimate / 2, (what, estimate, took)
