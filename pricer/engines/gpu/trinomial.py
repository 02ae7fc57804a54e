"""The GPU engine of the Hull–White trinomial family: the two strategies of Pawlak et al. (2021)
(cuda/trinomial.cu, whose header describes the kernels) behind one Engine.

- GPU-OUTER (`outer`): one thread per instrument; the layout here sorts the book by width, then
  height, pads each warp's working rows to its widest tree and places the warps' transposed
  scratch one after the other (outer_layout).
- GPU-FLAT (`flat`): bins of instruments, two tree rows a thread (FLAT_ROWS_PER_THREAD), packed
  first fit into blocks (flat_bins, in threads) with no tree of at most 32 threads crossing a
  warp and every wider tree starting at one. Trees wider than FLAT_MAX_ROWS rows go to GPU-OUTER.
- `auto`: each instrument by the rule `flat_rows` (the widest tree GPU-FLAT takes: this GPU's
  `pricer calibrate`, else GpuConfig.hw_flat_rows), the same for every chunk and rank count, so
  that an instrument's price never depends on its neighbours.

A call's wall time, as Pawlak et al. (2021) measure it, is everything here: the sort and the packing, the
copies both ways and the kernels. Prices agree with the CPU engine (its reference) to rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.base import Engine
from pricer.model.bond_book import HullWhiteParams

STRATEGIES = ("auto", "outer", "flat")
OUTER_ARRAYS = 8              # the rows each GPU-OUTER thread keeps (cuda/trinomial.cu: defines)
OUTER_THREADS = 128
FLAT_ROWS_PER_THREAD = 2      # GPU-FLAT's rows a thread (the kernel's FLAT_ROWS), even
FLAT_PAD = 2                  # zero slots at each end of a GPU-FLAT buffer
FLAT_MAX_ROWS = 1024          # GPU-FLAT's widest tree: a block of 512 threads (its launch bound)
FILL_THREADS = 128
SCRATCH_BYTES = 1 << 30       # GPU-OUTER's working rows per launch (a book is cut into launches)
# the kernels' per-instrument arguments (HullWhiteParams' fields), in their order
INSTRUMENT_ARRAYS = ("a", "dt", "steps", "jmax", "dr", "strike", "sign", "product", "starts",
                     "face")


def defines() -> list[str]:
    """The -D options of cuda/trinomial.cu: the numbers it shares with the host."""
    from pricer.model.hw1f import DATE_SLACK, EXERCISES, PRODUCTS, TODAY

    codes = {f"HW_{name.upper()}": k for names in (PRODUCTS, EXERCISES)
             for k, name in enumerate(names)}
    return [*(f"-D{name}={k}" for name, k in codes.items() if name != "HW_EUROPEAN"),
            f"-DHW_TODAY={TODAY!r}", f"-DHW_DATE_SLACK={DATE_SLACK!r}",
            f"-DOUTER_ARRAYS={OUTER_ARRAYS}", f"-DFLAT_ROWS={FLAT_ROWS_PER_THREAD}",
            f"-DFLAT_PAD={FLAT_PAD}", f"-DFLAT_MAX_ROWS={FLAT_MAX_ROWS}"]


def flat_shared_bytes(threads: int) -> int:
    """GPU-FLAT's shared memory (cuda/trinomial.cu) for blocks of `threads`: four buffers of the
    block's row slots and their pads, 2 x 32 doubles for the warps' parts."""
    return (4 * (FLAT_ROWS_PER_THREAD * threads + 2 * FLAT_PAD) + 64) * 8


def sorted_order(params: HullWhiteParams) -> np.ndarray:
    """The book widest first, then tallest first (stable): the order both strategies take."""
    return _widest_then_tallest(params.jmax, params.steps)


@njit(cache=True)
def _widest_then_tallest(jmax, steps):
    """np.lexsort((-steps, -jmax)) as two stable counting sorts (by steps, then by jmax): linear in
    the book, ~8x faster than the comparison sort on 100 000 instruments. check_columns bounds
    both keys (steps <= 1e6, j_max <= 50 000), which bounds the counts' arrays."""
    n = jmax.size
    by_steps = np.empty(n, dtype=np.int64)
    out = np.empty(n, dtype=np.int32)
    if n:
        _descending(steps, np.arange(n), by_steps)
        _descending(jmax, by_steps, out)
    return out


@njit(cache=True)
def _descending(key, source, target):
    """target: the indices `source` stably ordered by key[index], largest first."""
    top = key.max()
    start = np.zeros(top + 2, dtype=np.int64)       # key k's first slot: start[top - k]
    for i in range(key.size):
        start[top - key[i] + 1] += 1
    for b in range(1, top + 2):
        start[b] += start[b - 1]
    for i in source:
        b = top - key[i]
        target[start[b]] = i
        start[b] += 1


def outer_layout(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """For threads with trees of `rows` rows (descending), warp by warp: each warp's first scratch
    double (int64), its width (the widest of its trees, int32) and the doubles in all."""
    warps = -(-rows.size // 32)
    width = rows[::32][:warps].astype(np.int32)       # descending: a warp's first is its widest
    size = width.astype(np.int64) * (OUTER_ARRAYS * 32)
    base = np.zeros(warps, dtype=np.int64)
    np.cumsum(size[:-1], out=base[1:])
    return base, width, int(size.sum())


@njit(cache=True)
def flat_bins(rows, steps, threads):
    """First-fit packing of trees that take `rows` threads each (in this order) into blocks of
    `threads` threads: (block_first (blocks + 1), seg (each tree's first thread in its block),
    block_steps (each block's tallest tree)). A tree of at most 32 threads stays within a warp; a
    wider one starts at a warp and takes whole warps."""
    n = rows.size
    seg = np.empty(n, dtype=np.int32)
    first = [0]
    tallest = [0]
    used = 0
    for k in range(n):
        r = rows[k]
        if r > 32:
            start = (used + 31) // 32 * 32
            need = (r + 31) // 32 * 32
        else:
            start = used
            if used // 32 != (used + r - 1) // 32:
                start = (used + 31) // 32 * 32
            need = r
        if start + need > threads and k > first[-1]:
            first.append(k)
            tallest.append(0)
            start = 0
        seg[k] = start
        used = start + need
        tallest[-1] = max(tallest[-1], steps[k])
    first.append(n)
    return (np.array(first, dtype=np.int32), seg,
            np.array(tallest, dtype=np.int32))


class HullWhiteGpuEngine(Engine):
    """The family's GPU engine (see the module doc); strategy `auto`, `outer` or `flat`."""

    name = "gpu"
    uses_gpu = True
    fills_steps = True      # takes tree_parameters(..., fill=False): fills the steps itself

    def __init__(self, strategy: str = "auto", flat_rows: int | None = None, runtime=None,
                 flat_threads: int | None = None):
        """flat_rows and flat_threads: `auto`'s rule and GPU-FLAT's block; None takes them from
        this GPU's calibration (`pricer calibrate`), else GpuConfig's defaults."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        from pricer.engines.gpu.calibration import effective_config
        from pricer.engines.gpu.runtime import GpuRuntime
        self.rt = runtime or GpuRuntime.get()
        overrides = {key: int(value) for key, value in (("hw_flat_rows", flat_rows),
                                                        ("hw_flat_threads", flat_threads))
                     if value is not None}
        config, self.calibration = effective_config(self.rt.name, overrides)
        self.strategy = strategy
        self.flat_rows, self.flat_threads = config.hw_flat_rows, config.hw_flat_threads
        module = self.rt.module(defines(), "trinomial.cu")
        self._outer, self._flat = module.get_function("hw_outer"), module.get_function("hw_flat")
        self._fill = module.get_function("hw_fill")
        self._flat.set_attribute(self.rt.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 flat_shared_bytes(FLAT_MAX_ROWS // FLAT_ROWS_PER_THREAD))
        self.kernel_seconds = 0.0    # the last call's kernels (CUDA events), for the bench
        self._slots, self._slot = [_Slot(self.rt), _Slot(self.rt)], 0

    def split(self, params: HullWhiteParams) -> tuple[np.ndarray, np.ndarray]:
        """(GPU-FLAT's instruments, GPU-OUTER's), each in the sorted order."""
        order = sorted_order(params)
        rows = 2 * params.jmax[order] + 1
        limit = {"outer": 0, "flat": FLAT_MAX_ROWS, "auto": self.flat_rows}[self.strategy]
        flat = rows <= limit
        return order[flat], order[~flat]

    def price(self, params: HullWhiteParams, levels=None) -> np.ndarray:
        return self.finish(self.start(params))

    def start(self, params: HullWhiteParams) -> "_Call":
        """Sort, pack, copy and launch (module doc) on the stream of one of two slots, and return
        without waiting for the kernels: a caller that starts the next call before it finishes
        this one has that call's copies run beside these kernels (the slots' streams do not wait
        for each other). At most two calls may be started and not finished."""
        self._slot ^= 1
        slot = self._slots[self._slot]
        call = _Call(slot, len(params))
        if call.n == 0:
            return call
        p = params
        fill = p.flows is None      # the per-step arrays filled here (tree_parameters, fill=False)
        inputs = dict(zip(INSTRUMENT_ARRAYS, (p.a, p.dt, p.steps, p.jmax, p.dr, p.strike, p.sign,
                                              p.product, p.starts, p.face)))
        if fill:
            inputs.update((f"schedule{k}", x) for k, x in enumerate(p.schedule))
        else:
            inputs.update(flows=p.flows, exercise=p.exercise.view(np.uint8), discount=p.discount)
        dev = slot.put(inputs)
        instruments = [dev[name] for name in INSTRUMENT_ARRAYS]
        total = p.total_steps
        if fill:
            steps = [slot.buffer("flows", 8 * total), slot.buffer("exercise", total),
                     slot.buffer("discount", 8 * total)]
            slot.started.record(slot.stream)    # the kernels' time includes the fill
            self._fill(np.int32(call.n), dev["starts"], dev["steps"], dev["dt"],
                       *(dev[f"schedule{k}"] for k in range(len(p.schedule))), *steps,
                       block=(FILL_THREADS, 1, 1), grid=(-(-call.n // FILL_THREADS), 1),
                       stream=slot.stream)
        else:
            steps = [dev["flows"], dev["exercise"], dev["discount"]]
            slot.started.record(slot.stream)
        slot.filled.record(slot.stream)
        # the order and the blocks, made on the host while the GPU copies and fills
        flat, outer = self.split(params)
        layout = {}
        if flat.size:
            rows = (2 * p.jmax[flat] + 1).astype(np.int32)
            need = -(-rows // FLAT_ROWS_PER_THREAD)      # a tree's threads
            # blocks of flat_threads, or of the widest tree's warps where it needs more
            threads = int(min(FLAT_MAX_ROWS // FLAT_ROWS_PER_THREAD,
                              max(self.flat_threads, -(-int(need.max()) // 32) * 32)))
            layout["first"], layout["seg"], layout["tallest"] = flat_bins(
                need, p.steps[flat].astype(np.int32), threads)
            layout["flat"] = flat
        if outer.size:
            base, width, scratch_total = outer_layout(2 * p.jmax[outer] + 1)
            layout.update(outer=outer, base=base, width=width)
        dev.update(slot.put(layout))
        slot.launched.record(slot.stream)
        instruments += steps
        shifts = slot.buffer("shifts", total * 8)
        out = slot.buffer("out", call.n * 8)
        call.out = out
        if flat.size:
            self._flat(dev["first"], dev["seg"], dev["tallest"], dev["flat"], *instruments,
                       shifts, out, block=(threads, 1, 1), grid=(int(layout["tallest"].size), 1),
                       shared=flat_shared_bytes(threads), stream=slot.stream)
        if outer.size:
            # launches of whole warps whose scratch fits SCRATCH_BYTES (at least one warp each),
            # one after the other on the slot's stream, in the slot's one scratch buffer
            ends = np.append(base[1:], scratch_total)
            lo, launches = 0, []
            while lo < base.size:
                hi = max(int(np.searchsorted(ends, base[lo] + SCRATCH_BYTES // 8, side="right")),
                         lo + 1)
                launches.append((lo, hi))
                lo = hi
            scratch = slot.buffer("scratch", 8 * max(int(ends[hi - 1] - base[lo]) for lo, hi
                                                     in launches))
            for lo, hi in launches:
                count = min(hi * 32, outer.size) - lo * 32
                self._outer(np.int32(count), np.uintp(int(dev["outer"]) + 4 * lo * 32),
                            np.uintp(int(dev["base"]) + 8 * lo),
                            np.uintp(int(dev["width"]) + 4 * lo),
                            *instruments, shifts, scratch, out,
                            np.int64(base[lo]), block=(OUTER_THREADS, 1, 1),
                            grid=(-(-count // OUTER_THREADS), 1), stream=slot.stream)
        slot.ended.record(slot.stream)
        return call

    def finish(self, call: "_Call") -> np.ndarray:
        """The prices of a started call (start), once its kernels are done; the host waits
        asleep, not spinning."""
        result = np.empty(call.n)
        if call.n == 0:
            return result
        slot = call.slot
        slot.ended.synchronize()
        # the fill and the pricing kernels, not the host's work between them
        self.kernel_seconds = (slot.filled.time_since(slot.started)
                               + slot.ended.time_since(slot.launched)) / 1e3
        self.rt.cuda.memcpy_dtoh(result, call.out)
        return result


class _Call:
    """A started call: its slot, its size, its prices' device buffer."""

    def __init__(self, slot, n: int):
        self.slot, self.n, self.out = slot, n, None


class _Slot:
    """One of the engine's two sets of device buffers (grown, never shrunk) and its stream,
    which does not wait for the other slot's (CU_STREAM_NON_BLOCKING)."""

    def __init__(self, rt):
        cuda = rt.cuda
        self.rt = rt
        self.stream = cuda.Stream(flags=1)
        self.started, self.filled, self.launched = cuda.Event(), cuda.Event(), cuda.Event()
        self.ended = cuda.Event(cuda.event_flags.BLOCKING_SYNC)
        self.buffers: dict = {}

    def buffer(self, name: str, nbytes: int):
        """Device buffer `name` of at least nbytes (grown by a quarter more than asked, so that
        chunks of about one size allocate once)."""
        have = self.buffers.get(name)
        if have is None or have[1] < nbytes:
            if have is not None:
                self.rt.free(have[0])
            size = max(nbytes, 8) * 5 // 4
            have = self.buffers[name] = (self.rt.alloc(size), size)
        return have[0]

    def put(self, arrays: dict) -> dict:
        """The arrays ({name: ndarray}) copied into the slot's buffers of their names on its
        stream: {name: device buffer}. From pageable memory (numpy's) CUDA returns once the bytes
        are staged, so the host arrays may then be reused, as Engine.start promises its caller."""
        out = {}
        for name, x in arrays.items():
            x = np.ascontiguousarray(x)
            out[name] = self.buffer(name, x.nbytes)
            if x.nbytes:
                self.rt.cuda.memcpy_htod_async(out[name], x, self.stream)
        return out
