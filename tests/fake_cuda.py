"""A recording stand-in for pycuda.driver and the GPU runtime, under which the real CudaBatchRunner
(pricer/engines/gpu/batch_runner.py) and CudaKernels (pricer/engines/gpu/regimes.py) run on a
machine without a GPU: every device allocation is counted (live and peak bytes), copies, memsets
and launches do nothing (copies to the host give zeros), events take no time.

FakeRuntime is a GpuRuntime whose alloc, free and sms are the real methods, over FakeCuda. With
`occupancy` it also gives an H100's per-SM figures and the kernels' registers, so that the
runner's schedule and the persistent kernel see a GPU that holds their blocks; without, the
occupancy queries fail as on a runtime that cannot say (the runner then schedules without
residency figures and the regimes use the launch-per-step-block fallback)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pricer.engines.gpu.runtime import GpuRuntime

SMS = 132
H100 = dict(MAX_REGISTERS_PER_MULTIPROCESSOR=65536, MAX_THREADS_PER_MULTIPROCESSOR=2048,
            MAX_BLOCKS_PER_MULTIPROCESSOR=32, MAX_SHARED_MEMORY_PER_MULTIPROCESSOR=228 << 10)


class Tracker:
    """Device bytes allocated and not freed (live), their most at any time (peak), each size."""

    def __init__(self):
        self.live = self.peak = 0
        self.sizes = []

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)
        self.sizes.append(n)


class FakeAllocation:
    _next = 1 << 32     # distinct addresses, as int(allocation) gives them

    def __init__(self, nbytes, tracker: Tracker):
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

    def synchronize(self):
        pass

    def time_since(self, other):
        return 0.0


class FakeFunction:
    def __init__(self, occupancy: bool):
        if occupancy:                       # what resident_blocks reads of a kernel
            self.num_regs, self.shared_size_bytes = 64, 0

    def prepare(self, signature):
        pass

    def prepared_async_call(self, *args, **kwargs):
        pass


class FakeModule:
    def __init__(self, occupancy: bool):
        self.occupancy = occupancy

    def get_function(self, name):
        return FakeFunction(self.occupancy)


class FakeDevice:
    def __init__(self, occupancy: bool):
        self.figures = dict(MULTIPROCESSOR_COUNT=SMS, **(H100 if occupancy else {}))

    def get_attribute(self, attribute):
        if attribute not in self.figures:
            raise RuntimeError(f"the stand-in GPU does not say {attribute}")
        return self.figures[attribute]


class FakeCuda:
    """pycuda.driver as the engines use it."""

    device_attribute = SimpleNamespace(**{name: name for name in ("MULTIPROCESSOR_COUNT", *H100)})

    def __init__(self, tracker: Tracker, free: float, total: float):
        self.tracker, self.free, self.total = tracker, free, total
        self.Stream, self.Event = FakeStream, FakeEvent

    def mem_alloc(self, nbytes):
        return FakeAllocation(nbytes, self.tracker)

    def mem_get_info(self):
        return self.free - self.tracker.live, self.total

    def pagelocked_empty(self, shape, dtype):
        return np.zeros(shape, dtype)

    def memcpy_htod(self, dst, src):
        pass

    def memcpy_dtoh(self, dst, src):
        dst[...] = 0

    def memcpy_htod_async(self, dst, src, stream=None):
        pass

    def memcpy_dtoh_async(self, dst, src, stream=None):
        dst[...] = 0

    def memset_d32(self, dst, value, count):
        pass

    def memset_d32_async(self, dst, value, count, stream=None):
        pass


class FakeRuntime(GpuRuntime):
    """A GpuRuntime over FakeCuda (no context; nothing to close)."""

    def __init__(self, tracker: Tracker | None = None, occupancy: bool = False,
                 free: float = 80.0 * (1 << 30), total: float = 80.0 * (1 << 30)):
        self.tracker = tracker if tracker is not None else Tracker()
        self.occupancy = occupancy
        self.cuda = FakeCuda(self.tracker, free, total)
        self.device = FakeDevice(occupancy)
        self.device_index, self.local_rank = 0, 0
        self.name, self.arch, self.pci_bus_id = "Stand-in GPU", "sm_90", "0000:01:00.0"
        self._allocations, self._modules = [], {}
        self.stream, self.closed = FakeStream(), False

    def module(self, defines, source="binomial.cu"):
        return FakeModule(self.occupancy)

    def precompile(self, variants):
        self.tracker.precompiled = list(variants)

    def close(self):
        self.closed = True
