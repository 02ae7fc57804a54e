"""The `cpu` backend: all cores of the rank, numba-parallel, static schedule.

Two kinds of parallelism, as Cao (2025)'s OpenMP version found best (static, one parallel region per
block of levels rather than per level):
- across options: the options are cut into one contiguous group per thread with equal total cost
  (Σ N², the same cost partitioner MPI uses) and each thread prices its group serially;
- within a level, for options larger than one thread's share: the level is cut into one chunk per
  thread (fewer as it narrows, at least MIN_CHUNK_NODES each) and each chunk advances `BLOCK_STEPS`
  levels on its own, reading a halo of that many extra nodes, so the threads meet once per block
  instead of once per level. Narrow levels finish on one core.
Every node is computed with the serial engine's exact operations, so the prices are bitwise equal.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numba
import numpy as np
from numba import njit, prange

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.base import Engine, sample_params
from pricer.engines.cpu.kernels import (CLAMPED, advance, backward_keeping_levels,
                                        exercise_limit, power_tables, table_kinds,
                                        terminal_values)
from pricer.engines.cpu.options import is_clamped, price_options
from pricer.engines.cpu.serial import (_LOG_DOWN, _LOG_UP, _SPOT, _bits, _price_one, Direct,
                                       kernel_arguments, level_array)
from pricer.model.lattice import STEPS_ROW, LatticeParams
from pricer.model.cost import option_cost
from pricer.model.partition import partition_by_cost

# Options with at least this many steps (and more than a thread's share of the work) are priced one
# at a time with all threads on each level. The level-parallel chunks run the unpadded kernels
# (advance), which cost more per node than the one-thread path: two threads first beat one at N
# of a few tens of thousands, later for a put, whose one-thread path skips its exercised nodes
# (docs/decisions.md).
LEVEL_PARALLEL_MIN_STEPS = 32_768
# Levels advanced per parallel block, and the fewest nodes per thread worth splitting a level for.
BLOCK_STEPS = 64
MIN_CHUNK_NODES = 2_048


# The groups run on Python threads, each one call of the nogil kernel price_range (and of
# price_clamped where its group has CLAMPED lattices): a numba parallel region here cost seconds
# more of compiling on a cold cache, for the same schedule
@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    """The executor of `threads` threads (one a group), made once per thread count."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pricer-cpu")


def _price_groups(args: tuple, order: np.ndarray, bounds: np.ndarray, out: np.ndarray,
                  levels: np.ndarray, threads: int) -> None:
    """Group g (options order[bounds[g]:bounds[g + 1]]) on thread g of the run's `threads`
    (>= the groups), all at once."""
    pool = _pool(threads)
    done = [pool.submit(price_options, *args, order[bounds[g]:bounds[g + 1]], out, levels)
            for g in range(bounds.size - 1)]
    for future in done:
        future.result()


@njit(cache=True, nogil=True)
def _advance_chunk(src, dst, a, b, t_top, block, strike, sign, american, pu, pd, level_base, ratio,
                   limit):
    """Nodes [a, b) of level t_top - block, from nodes [a, b + block) of level t_top."""
    local = src[a:b + block].copy()
    advance(local, b - a + block, t_top, block, strike, sign, american, pu, pd, level_base,
            ratio[a:], limit)
    dst[a:b] = local[:b - a]


@njit(cache=True, parallel=True)
def _price_wide(spot, strike, steps, call, american, log_up, log_down, pu, pd, chunks, levels, row):
    sign = 1.0 if call else -1.0
    level_base = np.empty(steps + 1)
    ratio = np.empty(steps + 1)
    power_tables(spot, log_up, log_down, steps, level_base, ratio)
    src = np.empty(steps + 1)
    dst = np.empty(steps + 1)
    terminal_values(src, steps, strike, sign, level_base, ratio)
    limit = exercise_limit(strike, steps, pu, pd, log_up, log_down) if american and not call else 0.0
    t = steps
    while True:
        width = t - BLOCK_STEPS + 1
        parts = min(chunks, width // MIN_CHUNK_NODES)
        if parts < 2:
            break
        size = (width + parts - 1) // parts
        for c in prange(parts):
            a = c * size
            b = min(a + size, width)
            if a < b:
                _advance_chunk(src, dst, a, b, t, BLOCK_STEPS, strike, sign, american,
                               pu, pd, level_base, ratio, limit)
        src, dst = dst, src
        t -= BLOCK_STEPS
    backward_keeping_levels(src, t, strike, sign, american, pu, pd, level_base, ratio, levels, row,
                            limit)
    return src[0]


@njit(cache=True, nogil=True)
def _price_if_one_narrow(packed, out):
    """Prices and returns True if the call is one option too narrow to share its levels at the
    default LEVEL_PARALLEL_MIN_STEPS (and not CLAMPED)."""
    steps = _bits(packed[STEPS_ROW, 0])
    if out.size != 1 or steps >= LEVEL_PARALLEL_MIN_STEPS or is_clamped(
            packed[_SPOT, 0], packed[_LOG_UP, 0], packed[_LOG_DOWN, 0], steps):
        return False
    out[0] = _price_one(packed)
    return True


# The check and the serial kernel in one call: from Python, the check alone is a measurable share
# of a small option's time. A call of several options never makes it, so that a book's first call
# does not compile the one-option kernel (seconds on a cold cache) beside price_range.
price_if_one_narrow = Direct(_price_if_one_narrow, "boolean(float64[:, ::1], float64[::1])")


class CpuEngine(Engine):
    """All the rank's cores (numba's thread count, set per rank by pricer/run/driver.py). Options
    of at least `level_parallel_min_steps` steps may share their levels among the threads."""

    name = "cpu"

    def __init__(self, level_parallel_min_steps: int = LEVEL_PARALLEL_MIN_STEPS):
        self.level_parallel_min_steps = level_parallel_min_steps
        # the one-narrow-option check inside the kernel call knows only the default
        self._narrow_in_kernel = level_parallel_min_steps == LEVEL_PARALLEL_MIN_STEPS

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        # One option too narrow to share its levels, or one thread: the serial kernels, called
        # straight away (the first case checked inside the kernel call). A small option is
        # hardly more work than asking numba for its thread count, and the cost model and
        # partition below cost more still. Several options on one thread take price_range, as
        # each thread's group does: a book compiles one kernel, whatever the thread count.
        out = np.empty(params.count)
        if levels is None and self._narrow_in_kernel and params.count == 1 and \
                price_if_one_narrow.call(params.packed, out):
            return out
        lv = level_array(levels)
        one_small = params.steps.size == 1 and params.steps[0] < self.level_parallel_min_steps
        threads = 1 if one_small else numba.get_num_threads()
        if threads < 2:
            price_options(*kernel_arguments(params), np.arange(params.count, dtype=np.int64), out,
                          lv)
            return out
        wide = self.level_parallel(params.steps, threads)
        if wide.any():   # a CLAMPED lattice is priced a block of levels at a time, on one thread
            wide &= table_kinds(params.spot, params.log_up, params.log_down,
                                params.steps) != CLAMPED
        narrow = np.flatnonzero(~wide).astype(np.int64)
        groups = min(threads, narrow.size)
        if groups == 1:  # no parallel region (and no partition) for one option
            price_options(*kernel_arguments(params), narrow, out, lv)
        elif groups > 1:
            bounds = partition_by_cost(params.steps[narrow], groups)
            _price_groups(kernel_arguments(params), narrow, bounds.astype(np.int64), out, lv,
                          threads)
        for k in np.flatnonzero(wide):
            out[k] = _price_wide(params.spot[k], params.strike[k], params.steps[k], params.call[k],
                                 params.american[k], params.log_up[k], params.log_down[k],
                                 params.pu[k], params.pd[k], threads, lv, k)
        return out

    def warm_up(self) -> None:
        """A small book priced as a book's chunks are, so that their kernels are compiled (or
        loaded from numba's cache) beside the read rather than in the first chunk."""
        self.price(sample_params([16, 24, 32, 40]))

    def level_parallel(self, steps: np.ndarray, threads: int) -> np.ndarray:
        """Options that get all threads on each level: wide enough to split, and larger than one
        thread's fair share of the work (so grouping them by option would leave threads idle)."""
        if threads < 2:
            return np.zeros(steps.size, bool)
        cost = option_cost(steps)
        return (steps >= self.level_parallel_min_steps) & (cost * threads > cost.sum())
