"""price_range: the serial engine's way through many options, on the padded kernels (padded.py).

Options are priced two at a time (_price_pair): at small N a lattice's levels are short, each
waits on the one before, and a second, independent lattice in the same loop fills the wait. Each
option has its work arrays (values and the two node tables, padded) in one of two reused buffers.
A CLAMPED lattice (kernels.node_tables) goes alone, a block of levels at a time (_price_clamped),
in a kernel of its own (price_clamped) that price_options calls only where price_range left one:
a book without CLAMPED lattices never compiles it (seconds on a cold cache).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.cpu.kernels import (CLAMPED, backward_inplace, backward_keeping_levels,
                                        clamp_block,
                                        clamped_tables, node_tables, power_tables_into,
                                        table_scratch_size, terminal_values)
from pricer.engines.cpu.padded import (LANES, PAD, PAIR_MAX_STEPS, backward_padded,
                                       padded_pair)


@njit(cache=True, nogil=True, _nrt=False)
def _prepare(values, level_base, ratio, scratch, spot, strike, steps, call, log_up, log_down):
    """Tables and terminal values of one option in padded work arrays (zeros past node `steps`)."""
    sign = 1.0 if call else -1.0
    power_tables_into(spot, log_up, log_down, steps, level_base, ratio, scratch)
    terminal_values(values, steps, strike, sign, level_base, ratio)
    values[steps + 1:steps + 1 + PAD] = 0.0
    ratio[steps + 1:steps + 1 + PAD] = 0.0
    return sign


@njit(cache=True, nogil=True, _nrt=False)
def _array_size(width):
    """Length of each padded work array (values, level_base, ratio) for up to width - 1 steps."""
    return (width + PAD + LANES - 1) & -LANES


@njit(cache=True, nogil=True, _nrt=False)
def _work_size(width):
    """Length of the buffer that holds the work arrays of one option of up to width - 1 steps."""
    return 3 * _array_size(width) + table_scratch_size(width - 1) + LANES


@njit(cache=True, nogil=True, inline="always")
def _work_views(buf, width):
    """Padded work arrays in buf (_work_size(width) long): values, level_base, ratio, scratch.
    Each starts on a 64-byte line (numba's allocations are only 32-byte aligned): vectors that
    cross cache lines made a small lattice's time depend on the luck of the allocation.
    Inlined into its caller, so that the views are counted (or not) as the caller's own."""
    size = _array_size(width)
    at = (-(buf.ctypes.data >> 3)) & (LANES - 1)
    return (buf[at:at + size], buf[at + size:at + 2 * size], buf[at + 2 * size:at + 3 * size],
            buf[at + 3 * size:])


@njit(cache=True, nogil=True, _nrt=False)
def _widest(steps, order):
    """The width (steps + 1) of the widest lattice among the options order[0..], at least 1."""
    width = 1
    for j in range(order.size):
        width = max(width, steps[order[j]] + 1)
    return width


@njit(cache=True, nogil=True)
def _work(width):
    """_work_views of a new buffer, for one option of up to width - 1 steps."""
    return _work_views(np.empty(_work_size(width)), width)


@njit(cache=True, nogil=True)
def _price_pair(k, m, spot, strike, steps, call, american, log_up, log_down, pu, pd, out, levels,
                wa, wb):
    """Options k and m: each alone down to level PAIR_MAX_STEPS, then both together (padded_pair)
    down to the last levels, which each finishes alone (keeping the first levels' values)."""
    va, lba, ra, sca = wa
    vb, lbb, rb, scb = wb
    sa = _prepare(va, lba, ra, sca, spot[k], strike[k], steps[k], call[k], log_up[k], log_down[k])
    sb = _prepare(vb, lbb, rb, scb, spot[m], strike[m], steps[m], call[m], log_up[m], log_down[m])
    floor = 2 if levels.shape[0] > 0 else 0
    joint = max(min(steps[k], steps[m], PAIR_MAX_STEPS), floor)
    ta, tb = steps[k], steps[m]
    if ta > joint:
        backward_padded(va, ta, joint, strike[k], sa, american[k], pu[k], pd[k], lba, ra, steps[k],
                        log_up[k], log_down[k])
        ta = joint
    if tb > joint:
        backward_padded(vb, tb, joint, strike[m], sb, american[m], pu[m], pd[m], lbb, rb, steps[m],
                        log_up[m], log_down[m])
        tb = joint
    if ta == tb and ta > floor:
        padded_pair((va, ra, lba, pu[k], pd[k], strike[k], sa, american[k], steps[k], log_up[k],
                     log_down[k]),
                    (vb, rb, lbb, pu[m], pd[m], strike[m], sb, american[m], steps[m], log_up[m],
                     log_down[m]), ta, floor)
        ta = tb = floor
    backward_keeping_levels(va, ta, strike[k], sa, american[k], pu[k], pd[k], lba, ra, levels, k,
                            0.0)
    backward_keeping_levels(vb, tb, strike[m], sb, american[m], pu[m], pd[m], lbb, rb, levels, m,
                            0.0)
    out[k] = va[0]
    out[m] = vb[0]


@njit(cache=True, nogil=True)
def _price_single(k, spot, strike, steps, call, american, log_up, log_down, pu, pd, out, levels,
                  work):
    values, level_base, ratio, scratch = work
    sign = _prepare(values, level_base, ratio, scratch, spot[k], strike[k], steps[k], call[k],
                    log_up[k], log_down[k])
    t = steps[k]
    floor = 2 if levels.shape[0] > 0 else 0
    if t > floor:
        backward_padded(values, t, floor, strike[k], sign, american[k], pu[k], pd[k], level_base,
                        ratio, steps[k], log_up[k], log_down[k])
        t = floor
    backward_keeping_levels(values, t, strike[k], sign, american[k], pu[k], pd[k],
                            level_base, ratio, levels, k, 0.0)
    out[k] = values[0]


@njit(cache=True, nogil=True)
def _price_clamped(k, spot, strike, steps, call, american, log_up, log_down, pu, pd, out, levels,
                   work):
    """A CLAMPED lattice (kernels.node_tables), a block of levels at a time, each block with its
    own tables (kernels.clamped_tables), through the reference kernels (kernels.advance)."""
    values, level_base, ratio, scratch = work
    n = steps[k]
    sign = 1.0 if call[k] else -1.0
    low = clamp_block(log_down[k], n)
    clamped_tables(spot[k], log_up[k], log_down[k], low, n, level_base, ratio)
    terminal_values(values, n, strike[k], sign, level_base, ratio)
    values[n + 1:n + 1 + PAD] = 0.0
    ratio[n + 1:n + 1 + PAD] = 0.0
    floor = 2 if levels.shape[0] > 0 else 0
    t = n
    while t > floor:
        stop = max(low, floor)
        # no exercise limit: its bound assumes PLAIN tables (kernels.exercise_limit)
        backward_inplace(values, t, stop, strike[k], sign, american[k], pu[k], pd[k], level_base,
                         ratio, 0.0)
        t = stop
        if t > floor:
            low = clamp_block(log_down[k], t)
            clamped_tables(spot[k], log_up[k], log_down[k], low, t, level_base, ratio)
    clamped_tables(spot[k], log_up[k], log_down[k], 0, t, level_base, ratio)
    backward_keeping_levels(values, t, strike[k], sign, american[k], pu[k], pd[k],
                            level_base, ratio, levels, k, 0.0)
    out[k] = values[0]


@njit(cache=True, nogil=True, _nrt=False)
def is_clamped(spot, log_up, log_down, steps):
    return node_tables(spot, log_up, log_down, steps)[0] == CLAMPED


@njit(cache=True, nogil=True)
def price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out, levels):
    """Price the options order[0..] (row numbers, int64) into out, two at a time (_price_pair)
    reusing two sets of work arrays; `levels` is (len(out), LEVEL_VALUES) to keep the first
    levels' values, or (0, LEVEL_VALUES). Every price is bitwise the one the option gets alone.
    CLAMPED lattices are left as they are: returns how many there were (price_clamped prices
    them). Callers pass an array for all rows too (np.arange), never None: each type of `order`
    compiles the kernel again (~2.5 s on a cold cache)."""
    count = order.size
    if count == 0:
        return 0
    width = _widest(steps, order)
    first = _work(width)
    second = _work(width) if count > 1 else first
    # pairs of the options that are not CLAMPED, in order
    waiting = np.int64(-1)   # not a literal: that compiled a second copy of _price_pair
    clamped = 0
    for j in range(count):
        k = order[j]
        if is_clamped(spot[k], log_up[k], log_down[k], steps[k]):
            clamped += 1
        elif waiting < 0:
            waiting = k
        else:
            _price_pair(waiting, k, spot, strike, steps, call, american, log_up, log_down, pu, pd,
                        out, levels, first, second)
            waiting = -1
    if waiting >= 0:
        _price_single(waiting, spot, strike, steps, call, american, log_up, log_down, pu, pd, out,
                      levels, first)
    return clamped


@njit(cache=True, nogil=True)
def price_clamped(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out,
                  levels):
    """The CLAMPED lattices among the options order[0..], as price_range would price them."""
    work = _work(_widest(steps, order))
    for j in range(order.size):
        k = order[j]
        if is_clamped(spot[k], log_up[k], log_down[k], steps[k]):
            _price_clamped(k, spot, strike, steps, call, american, log_up, log_down, pu, pd, out,
                           levels, work)


def price_options(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out,
                  levels) -> None:
    """price_range, then the CLAMPED lattices it left (price_clamped)."""
    args = (spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out, levels)
    if price_range(*args):
        price_clamped(*args)
