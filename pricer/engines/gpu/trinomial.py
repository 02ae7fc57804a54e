"""The GPU engine of the Hull–White trinomial family: the seeds' two strategies (cuda/trinomial.cu,
whose header describes the kernels) behind one Engine.

- GPU-OUTER (`outer`): one thread per instrument; the layout here sorts the book by width, then
  height, pads each warp's working rows to its widest tree and places the warps' transposed
  scratch one after the other (outer_layout).
- GPU-FLAT (`flat`): bins of instruments, one thread per tree row, packed first fit into blocks
  (flat_bins) with no tree of at most 32 rows crossing a warp and every wider tree starting at
  one. Trees wider than FLAT_MAX_ROWS rows go to GPU-OUTER.
- `auto`: each instrument by the rule `flat_rows` (the widest tree GPU-FLAT takes), the same for
  every chunk and rank count, so that an instrument's price never depends on its neighbours.

A call's wall time, as the papers measure it, is everything here: the sort and the packing, the
copies both ways and the kernels. Prices agree with the CPU engine (its reference) to rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pricer.engines.base import Engine
from pricer.model.bond_book import HullWhiteParams

STRATEGIES = ("auto", "outer", "flat")
OUTER_ARRAYS = 8              # cuda/trinomial.cu: the rows each GPU-OUTER thread keeps
OUTER_THREADS = 128
FLAT_MAX_ROWS = 1024          # a block's threads: GPU-FLAT's widest tree
FLAT_THREADS = 512            # GPU-FLAT's block, unless a tree needs more


def flat_shared_bytes(threads: int) -> int:
    """GPU-FLAT's shared memory (cuda/trinomial.cu): 6 doubles a thread, 2 x 32 for the parts."""
    return (6 * threads + 64) * 8
SCRATCH_BYTES = 1 << 30       # GPU-OUTER's working rows per launch (a book is cut into launches)


def sorted_order(params: HullWhiteParams) -> np.ndarray:
    """The book widest first, then tallest first (stable): the order both strategies take."""
    return np.lexsort((-params.steps, -params.jmax)).astype(np.int32)


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
    """First-fit packing of trees of `rows` rows (in this order) into blocks of `threads`
    threads: (block_first (blocks + 1), seg (each tree's first thread in its block), block_steps
    (each block's tallest tree)). A tree of at most 32 rows stays within a warp; a wider one
    starts at a warp and takes whole warps."""
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

    def __init__(self, strategy: str = "auto", flat_rows: int = FLAT_MAX_ROWS, runtime=None,
                 flat_threads: int = FLAT_THREADS):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        if not 1 <= flat_rows <= FLAT_MAX_ROWS:
            raise ValueError(f"flat_rows must be within [1, {FLAT_MAX_ROWS}]")
        from pricer.engines.gpu.runtime import GpuRuntime
        self.strategy, self.flat_rows = strategy, int(flat_rows)
        self.flat_threads = int(flat_threads)
        self.rt = runtime or GpuRuntime.get()
        module = self.rt.module([], "trinomial.cu")
        self._outer, self._flat = module.get_function("hw_outer"), module.get_function("hw_flat")
        self._flat.set_attribute(self.rt.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 flat_shared_bytes(FLAT_MAX_ROWS))
        self.kernel_seconds = 0.0    # the last call's kernels (CUDA events), for the bench

    def split(self, params: HullWhiteParams) -> tuple[np.ndarray, np.ndarray]:
        """(GPU-FLAT's instruments, GPU-OUTER's), each in the sorted order."""
        order = sorted_order(params)
        rows = 2 * params.jmax[order] + 1
        limit = {"outer": 0, "flat": FLAT_MAX_ROWS, "auto": self.flat_rows}[self.strategy]
        flat = rows <= limit
        return order[flat], order[~flat]

    def price(self, params: HullWhiteParams, levels=None) -> np.ndarray:
        import pycuda.gpuarray as ga

        n = len(params)
        if n == 0:
            return np.empty(0)
        flat, outer = self.split(params)
        p = params
        dev = [ga.to_gpu(np.ascontiguousarray(x)) for x in (
            p.a, p.dt, p.steps, p.jmax, p.dr, p.strike, p.sign, p.product, p.starts, p.flows,
            p.exercise.view(np.uint8), p.discount)]
        shifts = ga.empty(p.flows.size, np.float64)
        out = ga.empty(n, np.float64)
        stream = self.rt.stream
        keep = []                   # the launches' arguments, alive until the stream is done
        cuda = self.rt.cuda
        started, ended = cuda.Event(), cuda.Event()
        self.kernel_seconds = 0.0
        if flat.size:
            rows = (2 * p.jmax[flat] + 1).astype(np.int32)
            threads = int(min(FLAT_MAX_ROWS, max(self.flat_threads,
                                                 -(-int(rows.max()) // 32) * 32)))
            first, seg, tallest = flat_bins(rows, p.steps[flat].astype(np.int32), threads)
            keep += [ga.to_gpu(x) for x in (first, seg, tallest, flat)]
            started.record(stream)
            self._flat(*keep[-4:], *dev, shifts, out, block=(threads, 1, 1),
                       grid=(int(tallest.size), 1), shared=flat_shared_bytes(threads),
                       stream=stream)
            ended.record(stream)
            ended.synchronize()
            self.kernel_seconds += ended.time_since(started) / 1e3
        if outer.size:
            base, width, total = outer_layout(2 * p.jmax[outer] + 1)
            # launches of whole warps whose scratch fits SCRATCH_BYTES (at least one warp each)
            ends = np.append(base[1:], total)
            lo = 0
            while lo < base.size:
                hi = max(int(np.searchsorted(ends, base[lo] + SCRATCH_BYTES // 8, side="right")),
                         lo + 1)
                inst = outer[lo * 32:hi * 32]
                args = [ga.to_gpu(inst), ga.to_gpu(base[lo:hi] - base[lo]),
                        ga.to_gpu(width[lo:hi]), ga.empty(int(ends[hi - 1] - base[lo]), np.float64)]
                started.record(stream)
                self._outer(np.int32(inst.size), *args[:3], *dev, shifts, args[3], out,
                            block=(OUTER_THREADS, 1, 1),
                            grid=(-(-inst.size // OUTER_THREADS), 1), stream=stream)
                ended.record(stream)
                ended.synchronize()         # frees this launch's scratch before the next's
                self.kernel_seconds += ended.time_since(started) / 1e3
                lo = hi
        result = out.get(stream=stream)
        stream.synchronize()
        del keep
        return result
