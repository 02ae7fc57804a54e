"""Issue 7's device memory guard (pricer/memory.py, "device memory"; docs/reliability.md section 4).

Everywhere (no GPU): the estimate against what the engines' own code allocates, counted through a
recording stand-in for pycuda under the real CudaBatchRunner / CudaKernels; the chunk shrinking,
the call splitting and the refusal as pure functions; and the whole path through real
`mpiexec -n 3` runs of the CLI with stand-in engines (a CPU-backed batch runner, the numpy kernel
emulation) and a stand-in measurement, so that the gather, rank 0's fit, the verdict and each
rank's setting are exercised here.

Marked `gpu` (they skip here with the reason; run them on the GPU machine, ../shared/device):
    source .device/setup.sh && python3 -m pytest -m gpu -q -s tests/test_memory_guard.py
a tiny PRICER_DEVICE_MEMORY_LIMIT makes `batch` stream in smaller chunks with bitwise the same
prices and `hybrid` price in smaller calls with bitwise the same prices; an impossible one with a
large-N option on `hybrid` exits 2 naming the numbers, nothing written; and the estimate is
compared with what cuMemGetInfo sees the engines take (printed, for docs/reliability.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import env, mpiexec
from pricer import memory
from pricer.checkpoint import chunk_grid
from pricer.engines.batch_plan import DEFAULT_CHUNK_OPTIONS, MAX_STEPS
from pricer.errors import InputError
from pricer.greeks import Analytics, price_with_analytics
from pricer.lattice import lattice_parameters
from pricer.portfolio import Portfolio, write_portfolio
from pricer.results import read_results
from test_gpu import needs_gpu

MIB = 1 << 20
ANALYTICS = [Analytics(), Analytics(greeks=True), Analytics(richardson=True),
             Analytics(greeks=True, richardson=True)]


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


# ------------------------------------------------------- a recording stand-in for pycuda.driver

class Tracker:
    def __init__(self):
        self.live = self.peak = 0
        self.sizes = []

    def add(self, n):
        self.live += n
        self.peak = max(self.peak, self.live)
        self.sizes.append(n)


class FakeAllocation:
    _next = 1 << 32

    def __init__(self, nbytes, tracker):
        self.nbytes, self.tracker, self.freed = int(nbytes), tracker, False
        self.address = FakeAllocation._next
        FakeAllocation._next += int(nbytes) + 4096
        tracker.add(self.nbytes)

    def __int__(self):
        return self.address

    def free(self):
        if not self.freed:
            self.freed = True
            self.tracker.live -= self.nbytes


class FakeStream:
    def synchronize(self):
        pass

    def wait_for_event(self, event):
        pass


class FakeEvent:
    def record(self, stream=None):
        pass

    def time_since(self, other):
        return 0.0


class FakeFunction:
    def prepare(self, signature):
        pass

    def prepared_async_call(self, *args, **kwargs):
        pass


class FakeModule:
    def get_function(self, name):
        return FakeFunction()


class FakeCuda:
    """pycuda.driver as the engines use it: allocations are counted, copies and launches do
    nothing (downloads give zeros)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.Stream, self.Event = FakeStream, FakeEvent

    def mem_alloc(self, nbytes):
        return FakeAllocation(nbytes, self.tracker)

    def pagelocked_empty(self, shape, dtype):
        return np.zeros(shape, dtype)

    def memcpy_htod(self, dst, src):
        pass

    def memcpy_dtoh(self, dst, src):
        dst[...] = 0.0

    def memcpy_htod_async(self, dst, src, stream=None):
        pass

    def memcpy_dtoh_async(self, dst, src, stream=None):
        dst[...] = 0.0


def fake_runtime(tracker):
    """A GpuRuntime whose alloc/free are the real methods, over the recording stand-in."""
    from pricer.engines.gpu import GpuRuntime
    rt = GpuRuntime.__new__(GpuRuntime)
    rt.cuda, rt.stream, rt.closed = FakeCuda(tracker), FakeStream(), False
    rt._allocations, rt._modules = [], {}
    rt.module = lambda defines, source="binomial.cu": FakeModule()
    return rt


def counted_batch_engine(tracker, chunk_options=DEFAULT_CHUNK_OPTIONS, cpu_max_nodes=0):
    from pricer.engines.batch import BatchEngine, CudaBatchRunner
    from pricer.engines.gpu import CudaKernels, GpuConfig, GpuEngine
    rt = fake_runtime(tracker)
    engine = BatchEngine(runner=CudaBatchRunner(runtime=rt, chunk_options=chunk_options),
                         cpu_max_nodes=cpu_max_nodes)
    config = GpuConfig(cpu_max_steps=500)
    engine._hybrid = GpuEngine("hybrid", config=config, kernels=CudaKernels(config, rt))
    return engine


def counted_gpu_engine(tracker, mode):
    from pricer.engines.gpu import CudaKernels, GpuConfig, GpuEngine
    config = GpuConfig(cpu_max_steps=300, t2=300)
    return GpuEngine(mode, config=config, kernels=CudaKernels(config, fake_runtime(tracker)))


def price_share(engine, p: Portfolio, cuts, analytics: Analytics):
    """As distributed._compute: prepare, then one engine call per chunk."""
    prepare = getattr(engine, "prepare", None)
    if prepare is not None:
        prepare(p.steps, levels=analytics.greeks)
    cols = columns(p)
    for a, b in zip(cuts[:-1], cuts[1:]):
        price_with_analytics(engine, take(cols, a, b), "crr", p.id[a:b], analytics)


# ------------------------------------------------------------------------------ the estimate

def test_sizes_are_the_engines():
    from pricer.engines.batch_plan import INPUT_BYTES_PER_OPTION
    from pricer.engines.serial import LEVEL_VALUES
    assert memory.batch_row_bytes(False) == INPUT_BYTES_PER_OPTION + 4 + 8 == 70   # 4: class key
    assert memory.batch_row_bytes(True) == INPUT_BYTES_PER_OPTION + 4 + 8 * (1 + LEVEL_VALUES) == 110
    assert memory.regime_bytes(100_000) == 32 * 100_002
    assert memory.regime_bytes(10) == 32 * 1024 and memory.regime_bytes(0) == 0
    assert memory.gpu_batch_bytes(100) == 16 * 101 + 56
    assert memory.gpu_batch_bytes(100, levels=True) == 16 * 101 + 56 + 8 * LEVEL_VALUES


def test_host_estimate_with_every_rank_reading():
    """--distribute read moves the columns as read from rank 0 to each rank's own rows, and every
    rank holds the book's id and steps columns: per rank, 16 bytes per option of the book plus
    the columns, matrix row and result of each of its own (docs/reliability.md, section 6)."""
    n, ranks = 10_000_000, 4
    scatter = memory.estimate(n, 1, ranks, ranks, 4096, 16, 1, 1, False, False)
    read = memory.estimate(n, 1, ranks, ranks, 4096, 16, 1, 1, False, False, read=True)
    share = n // ranks
    working = 4096 * memory.CHUNK_ARRAY_BYTES + memory.ENGINE_BYTES_PER_STEP * 17
    assert read.other == n * 16 + share * (2 * memory.COLUMN_BYTES + memory.MATRIX_BYTES + 8) + working
    assert read.root == read.other + n * (16 + 16)
    assert read.root < scatter.root and read.other > scatter.other


@pytest.mark.parametrize("analytics", ANALYTICS, ids=["price", "greeks", "richardson", "both"])
def test_batch_estimate_is_what_the_runner_allocates(analytics, rng):
    """The real CudaBatchRunner and hybrid regimes over counted allocations: after pricing, the
    engine holds exactly the estimate (its buffers and the widest hybrid option's arrays)."""
    steps = np.concatenate([rng.integers(3, 3000, 300), rng.integers(MAX_STEPS - 5, MAX_STEPS + 1, 5),
                            [MAX_STEPS + 1, 40_000, 25_001]])
    p = book(rng.permutation(steps))
    cuts = chunk_grid(p.steps, 3e8, 10**9)
    for chunk_options in (DEFAULT_CHUNK_OPTIONS, 37):
        tracker = Tracker()
        engine = counted_batch_engine(tracker, chunk_options)
        need = memory.device_need(memory.device_profile(engine), p.steps, cuts, analytics)
        price_share(engine, p, cuts, analytics)
        assert need.held_steps == 40_000 and p.steps[need.held_row] == 40_000
        assert tracker.live == tracker.peak == need.total, (tracker.live, tracker.peak, need)


def test_batch_estimate_counts_the_largest_call(rng):
    """Chunks priced one call each: the buffers grow to the largest call (five lattices per option
    with --greeks), not beyond chunk_options; `auto`'s CPU calls take none."""
    p = book(rng.integers(16, 200, 400))
    cuts = np.array([0, 10, 300, 400])
    tracker = Tracker()
    engine = counted_batch_engine(tracker, chunk_options=1000)
    greeks = Analytics(greeks=True)
    need = memory.device_need(memory.device_profile(engine), p.steps, cuts, greeks)
    assert need.streamed == 2 * 1000 * 110                      # 58 in, 4 key, 8 out, 40 levels
    assert need.held == 2 * 2 * 4 * (MAX_STEPS + 1)             # the GPU sort's counts and starts
    price_share(engine, p, cuts, greeks)
    assert tracker.live == need.total
    small = book(np.full(50, 20))
    auto = memory.DeviceProfile("batch", chunk_options=DEFAULT_CHUNK_OPTIONS, cpu_max_nodes=2e6)
    assert memory.device_need(auto, small.steps, np.array([0, 50]), Analytics()).total == 0


def test_batch_stats_sum_every_chunks_event_times(rng, monkeypatch):
    """The batch runner's last_stats: each chunk's copies and kernels as its events say (here
    1 ms between any two), summed over the chunks. A buffer's events are read before its next
    chunk records them again; the last two chunks' only when last_stats is read (once)."""
    reads = []
    monkeypatch.setattr(FakeEvent, "time_since", lambda self, other: reads.append(1) or 1.0)
    engine = counted_batch_engine(Tracker(), chunk_options=100)
    params = lattice_parameters(columns(book(rng.integers(16, 200, 450))))
    engine.price(params)                                    # 5 chunks on 2 buffers
    assert len(reads) == 3 * 3                              # chunks 0-2, before their reuse
    stats = engine.runner.last_stats
    assert len(reads) == 5 * 3 and stats["chunks"] == 5
    assert stats["copy_in"] == stats["kernels"] == stats["copy_out"] == pytest.approx(5e-3)
    assert engine.runner.last_stats == stats and len(reads) == 5 * 3


@pytest.mark.parametrize("mode", ["gpu", "hybrid"])
@pytest.mark.parametrize("analytics", ANALYTICS, ids=["price", "greeks", "richardson", "both"])
def test_gpu_estimate_is_what_the_kernels_allocate(mode, analytics, rng):
    """The real CudaKernels over counted allocations: the regime buffers of the widest option
    stay (32 bytes per node of N + 2), the batch kernel's arrays live for a call; the peak is
    within the estimate, and each part of the estimate is reached."""
    steps = np.concatenate([rng.integers(3, 8191, 200), [9000, 30_000, 8191, 300, 301]])
    p = book(rng.permutation(steps))
    cuts = chunk_grid(p.steps, 5e7, 10**9)
    tracker = Tracker()
    engine = counted_gpu_engine(tracker, mode)
    profile = memory.device_profile(engine)
    need = memory.device_need(profile, p.steps, cuts, analytics)
    price_share(engine, p, cuts, analytics)
    assert need.held == memory.regime_bytes(30_000) == tracker.live
    assert tracker.peak <= need.total
    calls = [memory.gpu_call_bytes(profile, p.steps[a:b], analytics).sum()
             for a, b in zip(cuts[:-1], cuts[1:])]
    assert need.streamed == max(calls) > 0


def test_one_call_allocates_exactly_the_estimate():
    """gpu/hybrid's batch kernel: 16 (N + 1) + 56 bytes per option, all freed after the call."""
    p = book([600, 700, 8191, 1000, 5])
    tracker = Tracker()
    engine = counted_gpu_engine(tracker, "hybrid")
    need = memory.device_need(memory.device_profile(engine), p.steps, np.array([0, 5]), Analytics())
    price_share(engine, p, [0, 5], Analytics())
    assert tracker.peak == need.streamed == sum(16 * (n + 1) + 56 for n in (600, 700, 8191, 1000))
    assert tracker.live == 0 and need.held == 0


# -------------------------------------------------------------------- shrinking and splitting

def test_batch_chunks_shrink_to_the_budget(rng):
    p = book(rng.integers(16, 4000, 5000))
    profile = memory.DeviceProfile("batch", chunk_options=DEFAULT_CHUNK_OPTIONS)
    cuts = np.array([0, 5000])
    need = memory.device_need(profile, p.steps, cuts, Analytics())
    sort = memory.BATCH_SETS * memory.BATCH_SORT_BYTES            # whatever the chunks
    assert need.total == 5000 * 2 * 70 + sort
    assert memory.fit(need, need.total) == 0                      # fits as it is
    budget = sort + 100_000
    chunk = memory.fit(need, budget)
    assert chunk == 100_000 // 140 == 714
    smaller = memory.DeviceProfile("batch", chunk_options=chunk)
    assert memory.device_need(smaller, p.steps, cuts, Analytics()).total <= budget
    assert memory.fit(need, sort + 139) is None                   # not even one option per chunk


def test_batch_shrink_keeps_the_wide_option_whole():
    p = book([100] * 1000 + [1_000_000])
    profile = memory.DeviceProfile("batch", chunk_options=DEFAULT_CHUNK_OPTIONS)
    need = memory.device_need(profile, p.steps, np.array([0, 1001]), Analytics())
    assert need.held == 32 * 1_000_002 + memory.BATCH_SETS * memory.BATCH_SORT_BYTES
    assert need.held_row == 1000
    assert memory.fit(need, need.held + 140 * 10) == 10
    assert memory.fit(need, need.held + 131) is None


def test_gpu_calls_split_to_the_budget(rng):
    profile = memory.DeviceProfile("hybrid", cpu_max_steps=500, batch_max_steps=8191)
    steps = rng.integers(1, 12000, 3000)
    row = memory.gpu_call_bytes(profile, steps, Analytics())
    assert (row[steps <= 500] == 0).all() and (row[steps > 8191] == 0).all()
    budget = 1 * MIB
    cuts = memory.split_calls(row, budget)
    assert cuts[0] == 0 and cuts[-1] == steps.size and (np.diff(cuts) > 0).all()
    sums = np.add.reduceat(row, cuts[:-1])
    assert (sums <= budget).all()
    # greedy: adding the next row to a call would pass the budget
    assert all(sums[j] + row[cuts[j + 1]] > budget for j in range(len(cuts) - 2))
    assert list(memory.split_calls(np.array([5.0, 3 * MIB, 5.0]), MIB)) == [0, 1, 2, 3]
    need = memory.device_need(profile, steps, np.array([0, steps.size]), Analytics())
    assert memory.fit(need, need.held + budget) == budget
    # with --greeks the batch kernel keeps the first levels: each option and its four bumped
    # copies, 40 bytes of levels each
    assert (memory.gpu_call_bytes(profile, steps, Analytics(greeks=True))
            == 5 * memory.gpu_call_bytes(profile, steps, Analytics()) + 5 * 40 * (row > 0)).all()


def _info(device="host:0000:01:00.0:", free=80 * (1 << 30)):
    return memory.DeviceInfo(free=float(free), total=float(free), device=device, name="Test GPU")


def test_refusal_names_option_steps_and_gib():
    profile = memory.DeviceProfile("hybrid", cpu_max_steps=500, batch_max_steps=8191)
    p = book([1000, 100_000_000, 20])
    shares = [(p.steps, np.array([0, 3]), p.id)]
    with pytest.raises(InputError) as err:
        memory.fit_devices(profile, [_info(free=2 << 30)], shares, Analytics(), "book.h5", environ={})
    text = str(err.value)
    for needle in ("book.h5: not enough GPU memory", "option id 501 (N = 100000000 steps)",
                   "needs 2.98 GiB on the device", "the GPU of rank 0 (Test GPU) has 2 GiB free",
                   "--backend cpu"):
        assert needle in text, (needle, text)
    fitted = memory.fit_devices(profile, [_info(free=4 << 30)], shares, Analytics(), "book.h5",
                                environ={})
    assert list(fitted.settings) == [0] and fitted.notes == []


def test_ranks_sharing_a_gpu_share_its_memory():
    profile = memory.DeviceProfile("batch", chunk_options=DEFAULT_CHUNK_OPTIONS)
    p = book(np.full(1000, 50))
    share = (p.steps, np.array([0, 1000]), p.id)
    sort = memory.BATCH_SETS * memory.BATCH_SORT_BYTES
    limit = {memory.DEVICE_LIMIT_VARIABLE: str(2 * (memory.DEVICE_ALLOWANCE + sort + 140 * 100))}
    shared = [_info("a"), _info("a"), _info("b"), None]
    fitted = memory.fit_devices(profile, shared, [share] * 4, Analytics(), "x.h5", environ=limit)
    # a: two ranks, 100 options' room each; b: alone, 2 * allowance + 200 options' room; None: unmeasured
    assert list(fitted.settings) == [100, 100, 0, 0], fitted.settings
    assert fitted.notes == ["GPU memory: batch chunks of 100 options (not 1048576) on ranks 0, 1, "
                            "to fit 0.5 GiB free per rank (less 0.5 GiB kept for CUDA)"], fitted.notes


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
    """pricer's CLI with the GPU backends on stand-ins (tests/test_memory_guard.py): `batch` with a
    runner that prices on the CPU and says its chunk_options, `hybrid` on the numpy emulation; every
    rank "measures" an 80 GiB GPU of its own."""
    import os, sys
    import numpy as np
    from mpi4py import MPI
    import pricer.distributed as d
    import pricer.memory as m
    from pricer.engines.batch import BatchEngine
    from pricer.engines.batch_plan import DEFAULT_CHUNK_OPTIONS, chunk_bounds
    from pricer.engines.cpu import CpuEngine
    from pricer.engines.gpu import GpuConfig, GpuEngine, NumpyKernels

    class CpuRunner:
        def __init__(self):
            self.chunk_options = DEFAULT_CHUNK_OPTIONS
        def function(self, cls):
            pass
        def _ensure_buffers(self, size, levels):
            pass
        def price(self, params, index=None, levels=None, one_wave=None):   # warm_up: one_wave
            rows = np.arange(len(params)) if index is None else index
            chunks = len(chunk_bounds(rows.size, self.chunk_options))
            print(f"stand-in rank {MPI.COMM_WORLD.Get_rank()}: chunk_options "
                  f"{self.chunk_options}, {chunks} chunks", file=sys.stderr, flush=True)
            return CpuEngine().price(params.take(rows), levels)

    class Counted(GpuEngine):
        def price(self, params, levels=None):
            print(f"stand-in call of {len(params)} lattices", file=sys.stderr, flush=True)
            return super().price(params, levels)

    def get_engine(name, **overrides):
        if name == "batch":
            return BatchEngine(runner=CpuRunner())
        config = GpuConfig(t1=300, t2=40, tiled_b=32, tiled_vt=4, tiled_k=50, warp_vt=4,
                           warp_k=30, mid_b=32, mid_vt=2, mid_k=25, fma=False, batch_max_steps=300)
        return Counted(name, config=config, kernels=NumpyKernels(config))

    d.resolve_backend = lambda name: name
    d.get_engine = get_engine
    rank = MPI.COMM_WORLD.Get_rank()
    m.measure_device = lambda engine: m.DeviceInfo(80.0 * (1 << 30), 80.0 * (1 << 30),
                                                   f"stand-in:{rank}", "Stand-in GPU")
    from pricer.cli import main
    raise SystemExit(main(sys.argv[1:]))
''')


def stand_in_run(tmp_path, args, limit, ranks=3, timeout=60):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    e = env()
    e[memory.DEVICE_LIMIT_VARIABLE] = str(limit)
    cmd = [sys.executable, str(script)] + [str(a) for a in args]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


def serial_prices(p: Portfolio):
    from pricer.engines.serial import SerialEngine
    return SerialEngine().price(lattice_parameters(columns(p)))


def test_stand_in_batch_streams_smaller_chunks_on_every_rank(tmp_path):
    """3 ranks, PRICER_DEVICE_MEMORY_LIMIT = allowance + the sort's + 37 options' buffers: every rank's runner
    is set to chunks of 37 options before it prices, rank 0 says so, the prices are the serial
    engine's bitwise."""
    p = book(np.random.default_rng(1).integers(3, 300, 240))
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = stand_in_run(tmp_path, ["price", src, "-o", out, "--backend", "batch", "--threads", "1"],
                        memory.DEVICE_ALLOWANCE + memory.BATCH_SETS * memory.BATCH_SORT_BYTES
                        + 140 * 37)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for rank in range(3):
        assert f"stand-in rank {rank}: chunk_options 37," in proc.stderr, text
    assert "GPU memory: batch chunks of 37 options (not 1048576) on all 3 ranks" in proc.stdout, text
    got = read_results(str(out))
    np.testing.assert_array_equal(got["id"], p.id)
    assert (got["price"].view(np.int64) == serial_prices(p).view(np.int64)).all()


def test_stand_in_refusal_exits_2_on_every_rank_nothing_written(tmp_path):
    """A hybrid option of N = 10**7 on a GPU with (allowance + 1 MiB) free: exit 2 before any
    pricing, rank 0 names the option, N and the GiB, no traceback, no file, every rank out."""
    steps = [50] * 30 + [10_000_000] + [400] * 30
    p = book(steps, first_id=7000)
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    start = time.perf_counter()
    proc = stand_in_run(tmp_path, ["price", src, "-o", out, "--backend", "hybrid"],
                        f"{memory.DEVICE_ALLOWANCE + MIB}")
    seconds = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert seconds < 10, seconds                          # every rank out (mpiexec returned)
    assert text.count("pricer: error:") == 1 and "Traceback" not in text, text
    for needle in ("not enough GPU memory: option id 7030 (N = 10000000 steps) needs 0.298 GiB",
                   "has 0.501 GiB free (PRICER_DEVICE_MEMORY_LIMIT)"):
        assert needle in proc.stderr, (needle, text)
    assert "stand-in call" not in text                      # nothing priced
    assert sorted(os.listdir(tmp_path)) == ["book.h5", "stand_in.py"]


def test_stand_in_hybrid_prices_a_chunk_in_several_calls(tmp_path):
    """One process, hybrid on the emulation with 12 KiB per call for the batch kernel's arrays:
    the chunk goes in several calls, the prices are the serial engine's (the emulation is exact)."""
    p = book(np.random.default_rng(2).integers(41, 300, 60))
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = stand_in_run(tmp_path, ["price", src, "-o", out, "--backend", "hybrid"],
                        memory.DEVICE_ALLOWANCE + 12 * 1024, ranks=0)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    calls = proc.stderr.count("stand-in call of")
    per_option = memory.gpu_batch_bytes(p.steps)
    assert calls >= per_option.sum() / (12 * 1024), text
    assert "GPU memory: chunks priced in engine calls of at most" in proc.stdout, text
    got = read_results(str(out))
    np.testing.assert_allclose(got["price"], serial_prices(p), rtol=1e-13, atol=1e-13)


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
    limit = 2 * (memory.DEVICE_ALLOWANCE + memory.BATCH_SETS * memory.BATCH_SORT_BYTES + 64 * 1024)
    tight = _cli(["price", src, "-o", tmp_path / "tight.h5", "--backend", "batch"], limit, ranks=2)
    assert tight.returncode == 0, tight.stdout + tight.stderr
    print(tight.stdout)
    assert "GPU memory: batch chunks of 468 options (not 1048576) on all 2 ranks" in tight.stdout, \
        tight.stdout
    a, b = read_results(str(tmp_path / "free.h5")), read_results(str(tmp_path / "tight.h5"))
    np.testing.assert_array_equal(a["id"], b["id"])
    assert _bitwise(a["price"], b["price"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_hybrid_refuses_an_option_too_wide_exit_2(tmp_path):
    """Real CLI, 2 ranks on one GPU, allowance + 1 MiB each: the option of N = 200 000 (6.1 MiB of
    device arrays) is refused before any pricing: exit 2, one message naming its id, N and the GiB,
    nothing written, both ranks out."""
    p = book([1000] * 20 + [200_000] + [600] * 20, first_id=9000)
    src, out = tmp_path / "book.h5", tmp_path / "out.h5"
    write_portfolio(str(src), p)
    proc = _cli(["price", src, "-o", out, "--backend", "hybrid"],
                2 * (memory.DEVICE_ALLOWANCE + MIB), ranks=2, timeout=120)
    text = proc.stdout + proc.stderr
    print(text)
    assert proc.returncode == 2, text
    assert text.count("pricer: error:") == 1 and "Traceback" not in text, text
    for needle in ("not enough GPU memory: option id 9020 (N = 200000 steps) needs 0.00596 GiB",
                   "GiB free (PRICER_DEVICE_MEMORY_LIMIT), shared by 2 ranks"):
        assert needle in proc.stderr, (needle, text)
    assert sorted(os.listdir(tmp_path)) == ["book.h5"]


@pytest.mark.gpu
@needs_gpu
def test_gpu_hybrid_streams_calls_same_prices(tmp_path):
    """Real CLI, one process, allowance + 1 MiB: hybrid prices its chunk in calls of at most 1 MiB
    of batch-kernel arrays; bitwise the prices without the limit."""
    p = book(np.random.default_rng(6).integers(2000, 8000, 300))   # above the CPU crossover
    src = tmp_path / "book.h5"
    write_portfolio(str(src), p)
    free = _cli(["price", src, "-o", tmp_path / "free.h5", "--backend", "hybrid"])
    assert free.returncode == 0, free.stdout + free.stderr
    tight = _cli(["price", src, "-o", tmp_path / "tight.h5", "--backend", "hybrid"],
                 memory.DEVICE_ALLOWANCE + MIB)
    assert tight.returncode == 0, tight.stdout + tight.stderr
    print(tight.stdout)
    assert "GPU memory: chunks priced in engine calls of at most 1 MiB" in tight.stdout
    a, b = read_results(str(tmp_path / "free.h5")), read_results(str(tmp_path / "tight.h5"))
    assert _bitwise(a["price"], b["price"])


@pytest.mark.gpu
@needs_gpu
def test_gpu_estimate_against_cuMemGetInfo(capsys):
    """What the engines take on the device (cuMemGetInfo before and after) against the estimate:
    never more than estimate + DEVICE_ALLOWANCE, and at least half the estimate. Prints both (the
    figures docs/reliability.md asks for)."""
    from pricer.engines.batch import BatchEngine
    from pricer.engines.gpu import GpuEngine, GpuRuntime
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
        batch = BatchEngine()
        batch.warm_up()                 # its kernels loaded: what is measured is the buffers
        need = memory.device_need(memory.device_profile(batch), steps, np.array([0, steps.size]),
                                  Analytics(greeks=greeks))
        took = used(lambda: batch.prepare(steps, levels=greeks))
        batch.runner._release()
        rows.append((f"batch prepare, 1.5M options, greeks={greeks}", need.total, took))
    hybrid = GpuEngine("hybrid")
    wide = np.array([5_000_000])
    need = memory.device_need(memory.device_profile(hybrid), wide, np.array([0, 1]), Analytics())
    took = used(lambda: hybrid.kernels.reserve(int(wide[0]) + 2))
    for buffer in hybrid.kernels._bufs:
        rt.free(buffer)
    rows.append(("hybrid regime buffers, N = 5e6", need.total, took))
    with capsys.disabled():
        for what, estimate, took in rows:
            print(f"\n{what}: estimate {estimate / MIB:.1f} MiB, cuMemGetInfo {took / MIB:.1f} MiB")
    for what, estimate, took in rows:
        assert took <= estimate + memory.DEVICE_ALLOWANCE and took >= estimate / 2, (what, estimate, took)
