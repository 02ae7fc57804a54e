"""The `serial` backend: one core, numba-compiled backward induction — the reference engine.

Asset prices are never updated incrementally over the lattice: node (t, i) uses S0*exp(t*log_down) *
exp(i*(log_up - log_down)) from two tables whose entries are within a few ulp (see
power_tables_into), so the exercise value is as accurate at N = 1 000 000 as at N = 10. The kernels
below are also the building blocks of the `cpu` backend and of the GPU CPU tail; all of them do
exactly the same floating-point operations per node, so every backend that uses them is bitwise
equal to this one.

Options are priced two at a time (price_range): at small N a lattice's levels are short, each
waits on the one before, and a second, independent lattice in the same loop fills the wait.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from pricer.lattice import LatticeParams

# Option values below 2**-963 (~1e-290) are set to 0. Far out-of-the-money nodes of wide lattices
# otherwise decay into subnormal numbers, which x86 cores handle in microcode: a 7x slow-down on a
# tenth of the nodes of such lattices. Values are never negative, so on the GPU the same test is an
# integer compare of the high word (< 0x03C00000), which keeps every backend bitwise equal; the
# prices move by less than 1e-280 at most.
UNDERFLOW = 2.0 ** -963


@njit(cache=True, nogil=True)
def table_scratch_size(steps):
    """Length of the `scratch` argument of power_tables_into for `steps`."""
    return 2 * (int(math.sqrt(steps + 1)) + 1)


@njit(cache=True, nogil=True)
def power_tables_into(spot, log_up, log_down, steps, level_base, ratio, scratch):
    """level_base[t] = S0*d^t (price of node (t, 0)); ratio[i] = (u/d)^i, for t, i <= steps.

    Each entry is one product of two correctly rounded exponentials, scale*exp(start*rate) *
    exp(j*rate) with start a multiple of block ~ sqrt(steps), so it is within a few ulp and the
    tables cost about 4*sqrt(steps) calls to exp. Both tables are built in the same loops (their
    blocks coincide), with the small factors in `scratch` (table_scratch_size(steps) long): at
    N = 100, 0.35 us against 0.44 us for two loops with their own allocations."""
    count = steps + 1
    rate_base, rate_ratio = log_down, log_up - log_down
    block = int(math.sqrt(count)) + 1
    for j in range(block):
        scratch[j] = math.exp(j * rate_base)
        scratch[block + j] = math.exp(j * rate_ratio)
    for start in range(0, count, block):
        big_base = spot * math.exp(start * rate_base)
        big_ratio = math.exp(start * rate_ratio)   # scale 1
        for j in range(min(block, count - start)):
            level_base[start + j] = big_base * scratch[j]
            ratio[start + j] = big_ratio * scratch[block + j]


@njit(cache=True, nogil=True)
def power_tables(spot, log_up, log_down, steps, level_base, ratio):
    """power_tables_into with its own scratch."""
    power_tables_into(spot, log_up, log_down, steps, level_base, ratio,
                      np.empty(table_scratch_size(steps)))


@njit(cache=True, nogil=True)
def terminal_values(values, steps, strike, sign, level_base, ratio):
    base = level_base[steps]
    for i in range(steps + 1):
        payoff = sign * (base * ratio[i] - strike)
        values[i] = payoff if payoff > 0.0 else 0.0


@njit(cache=True, nogil=True)
def advance(values, width, t_from, levels, strike, sign, american, pu, pd, level_base, ratio):
    """Take `levels` backward steps in place from level t_from, whose first `width` nodes are in
    values[0..width); each step leaves one node fewer. ratio may be offset (ratio[j] belongs to
    values[j]), which lets a chunk of a level advance on its own."""
    minus_strike = -sign * strike
    for s in range(1, levels + 1):
        signed_base = sign * level_base[t_from - s]
        count = width - s
        if american:
            # sign is +-1, so signed_base*ratio + minus_strike == sign*(S - strike) exactly
            for i in range(count):
                hold = pu * values[i + 1] + pd * values[i]
                hold = hold if hold >= UNDERFLOW else 0.0
                exercise = signed_base * ratio[i] + minus_strike
                values[i] = exercise if exercise > hold else hold
        else:
            for i in range(count):
                hold = pu * values[i + 1] + pd * values[i]
                values[i] = hold if hold >= UNDERFLOW else 0.0


@njit(cache=True, nogil=True)
def backward_inplace(values, t_from, t_to, strike, sign, american, pu, pd, level_base, ratio):
    """From level t_from (values[0..t_from]) down to level t_to, in place."""
    advance(values, t_from + 1, t_from, t_from - t_to, strike, sign, american, pu, pd,
            level_base, ratio)


# Greeks need the option values of the lattice's first levels: LEVEL_VALUES numbers per option,
# V(1, 0), V(1, 1), V(2, 0), V(2, 1), V(2, 2) (NaN for an option with fewer than 2 steps).
LEVEL_VALUES = 5


@njit(cache=True, nogil=True)
def backward_keeping_levels(values, t_from, strike, sign, american, pu, pd, level_base, ratio,
                            levels, row):
    """backward_inplace down to level 0, keeping levels 2 and 1 in levels[row] (if it has rows).
    The same steps in the same order, so the price is bitwise the one backward_inplace gives."""
    if levels.shape[0] == 0 or t_from < 2:
        if levels.shape[0] > 0:
            levels[row, :] = np.nan
        backward_inplace(values, t_from, 0, strike, sign, american, pu, pd, level_base, ratio)
        return
    backward_inplace(values, t_from, 2, strike, sign, american, pu, pd, level_base, ratio)
    levels[row, 2] = values[0]
    levels[row, 3] = values[1]
    levels[row, 4] = values[2]
    backward_inplace(values, 2, 1, strike, sign, american, pu, pd, level_base, ratio)
    levels[row, 0] = values[0]
    levels[row, 1] = values[1]
    backward_inplace(values, 1, 0, strike, sign, american, pu, pd, level_base, ratio)


# Levels up to this index are advanced two lattices at a time (advance_pair); wider levels one
# lattice at a time, since one alone already keeps the vector units busy there.
PAIR_MAX_STEPS = 512
# advance_pair computes whole vectors of LANES nodes (512 bits), so it runs up to LANES - 1 nodes
# past a level's last node and reads one further: price_range's work arrays have PAD nodes of
# padding after the lattice's last node.
LANES = 8
PAD = LANES


def _vector_nodes(american: bool):
    """An intrinsic nodes(values, ratio, i, pu, pd, signed_base, minus_strike): nodes i..i+7 of the
    next level in place, as explicit 8-wide vector code with advance's exact operations in each
    lane. Explicit because LLVM's loop vectoriser leaves advance_pair's loop scalar: the loop writes
    two arrays that it cannot prove disjoint."""
    vector = ir.VectorType(ir.DoubleType(), LANES)
    lanes = ir.VectorType(ir.IntType(32), LANES)

    def load(builder, pointer):
        return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=8)

    def splat(builder, scalar):
        one = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar,
                                     ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                      ir.Constant(lanes, [0] * LANES))

    @intrinsic
    def nodes(typingctx, values, ratio, i, pu, pd, signed_base, minus_strike):
        def codegen(context, builder, signature, args):
            values, ratio, i, pu, pd, signed_base, minus_strike = args
            at = builder.gep(context.make_array(signature.args[0])(context, builder, values).data,
                             [i])
            low = load(builder, at)
            up = load(builder, builder.gep(at, [ir.Constant(ir.IntType(64), 1)]))
            hold = builder.fadd(builder.fmul(splat(builder, pu), up),
                                builder.fmul(splat(builder, pd), low))
            floor = splat(builder, ir.Constant(ir.DoubleType(), UNDERFLOW))
            hold = builder.select(builder.fcmp_ordered(">=", hold, floor), hold,
                                  ir.Constant(vector, [0.0] * LANES))
            if american:
                ratio = context.make_array(signature.args[1])(context, builder, ratio).data
                exercise = builder.fadd(
                    builder.fmul(splat(builder, signed_base), load(builder, builder.gep(ratio, [i]))),
                    splat(builder, minus_strike))
                hold = builder.select(builder.fcmp_ordered(">", exercise, hold), exercise, hold)
            builder.store(hold, builder.bitcast(at, vector.as_pointer()), align=8)
            return context.get_dummy_value()

        return types.void(values, ratio, i, pu, pd, signed_base, minus_strike), codegen

    return nodes


_american_nodes = _vector_nodes(True)
_european_nodes = _vector_nodes(False)


@njit(cache=True, nogil=True)
def _level_nodes(values, ratio, i, pu, pd, signed_base, minus_strike, american):
    """Nodes i..i+7 of the next level (advance's operations, 8 lanes at a time)."""
    if american:
        _american_nodes(values, ratio, i, pu, pd, signed_base, minus_strike)
    else:
        _european_nodes(values, ratio, i, pu, pd, signed_base, minus_strike)


@njit(cache=True, nogil=True)
def advance_pair(a, b, t_from, t_to):
    """Two lattices a and b, both at level t_from, down to level t_to, a vector of one and then of
    the other in turn.

    At small N one lattice's levels are short and each depends on the one before (a chain of ~30
    cycles per level through memory); interleaving two independent lattices lets the core overlap
    them (N = 100: ~1.05 us per option against 1.39 us alone). Each option is a tuple (values,
    ratio, level_base, pu, pd, strike, sign, american) of price_range's padded work arrays. Nodes
    past a level's last one compute garbage from finite padding (zeros, table entries, stale
    values) that never flows back, since node i reads only nodes i and i + 1."""
    va, ra, lba, pua, pda, ka, sa, ama = a
    vb, rb, lbb, pub, pdb, kb, sb, amb = b
    minus_ka, minus_kb = -sa * ka, -sb * kb
    for t in range(t_from - 1, t_to - 1, -1):
        base_a, base_b = sa * lba[t], sb * lbb[t]
        for i in range(0, t + 1, LANES):
            _level_nodes(va, ra, i, pua, pda, base_a, minus_ka, ama)
            _level_nodes(vb, rb, i, pub, pdb, base_b, minus_kb, amb)


@njit(cache=True, nogil=True)
def _prepare(values, level_base, ratio, scratch, spot, strike, steps, call, log_up, log_down):
    """Tables and terminal values of one option in padded work arrays (zeros past node `steps`)."""
    sign = 1.0 if call else -1.0
    power_tables_into(spot, log_up, log_down, steps, level_base, ratio, scratch)
    terminal_values(values, steps, strike, sign, level_base, ratio)
    values[steps + 1:steps + 1 + PAD] = 0.0
    ratio[steps + 1:steps + 1 + PAD] = 0.0
    return sign


@njit(cache=True, nogil=True)
def _work(width):
    """Padded work arrays for one option of up to width - 1 steps: values, level_base, ratio,
    scratch (one allocation). Each array starts a whole number of 64-byte lines after the first, so
    vectors of values and ratio cross cache lines alike (a misaligned ratio slowed N = 3000 by 7 %)."""
    size = (width + PAD + LANES - 1) & -LANES
    scratch = table_scratch_size(width - 1)
    buf = np.empty(3 * size + scratch)
    return buf[:size], buf[size:2 * size], buf[2 * size:3 * size], buf[3 * size:]


@njit(cache=True, nogil=True)
def _price_pair(k, m, spot, strike, steps, call, american, log_up, log_down, pu, pd, out, levels,
                wa, wb):
    """Options k and m: each alone down to level PAIR_MAX_STEPS, then both together (advance_pair)
    down to the last levels, which each finishes alone (keeping the first levels' values)."""
    va, lba, ra, sca = wa
    vb, lbb, rb, scb = wb
    sa = _prepare(va, lba, ra, sca, spot[k], strike[k], steps[k], call[k], log_up[k], log_down[k])
    sb = _prepare(vb, lbb, rb, scb, spot[m], strike[m], steps[m], call[m], log_up[m], log_down[m])
    floor = 2 if levels.shape[0] > 0 else 0
    joint = max(min(steps[k], steps[m], PAIR_MAX_STEPS), floor)
    ta, tb = steps[k], steps[m]
    if ta > joint:
        backward_inplace(va, ta, joint, strike[k], sa, american[k], pu[k], pd[k], lba, ra)
        ta = joint
    if tb > joint:
        backward_inplace(vb, tb, joint, strike[m], sb, american[m], pu[m], pd[m], lbb, rb)
        tb = joint
    if ta == tb and ta > floor:
        advance_pair((va, ra, lba, pu[k], pd[k], strike[k], sa, american[k]),
                     (vb, rb, lbb, pu[m], pd[m], strike[m], sb, american[m]), ta, floor)
        ta = tb = floor
    backward_keeping_levels(va, ta, strike[k], sa, american[k], pu[k], pd[k], lba, ra, levels, k)
    backward_keeping_levels(vb, tb, strike[m], sb, american[m], pu[m], pd[m], lbb, rb, levels, m)
    out[k] = va[0]
    out[m] = vb[0]


@njit(cache=True, nogil=True)
def _price_single(k, spot, strike, steps, call, american, log_up, log_down, pu, pd, out, levels,
                  work):
    values, level_base, ratio, scratch = work
    sign = _prepare(values, level_base, ratio, scratch, spot[k], strike[k], steps[k], call[k],
                    log_up[k], log_down[k])
    backward_keeping_levels(values, steps[k], strike[k], sign, american[k], pu[k], pd[k],
                            level_base, ratio, levels, k)
    out[k] = values[0]


@njit(cache=True, nogil=True)
def price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out, levels):
    """Price the options order[0..] into out, two at a time (_price_pair) reusing two sets of work
    arrays; `levels` is (len(out), LEVEL_VALUES) to keep the first levels' values, or (0,
    LEVEL_VALUES). Every price is bitwise the one the option gets alone."""
    if order.size == 0:
        return
    width = 1
    for k in order:
        width = max(width, steps[k] + 1)
    first = _work(width)
    second = _work(width) if order.size > 1 else first
    j = 0
    while j + 1 < order.size:
        _price_pair(order[j], order[j + 1], spot, strike, steps, call, american, log_up, log_down,
                    pu, pd, out, levels, first, second)
        j += 2
    if j < order.size:
        _price_single(order[j], spot, strike, steps, call, american, log_up, log_down, pu, pd, out,
                      levels, first)


@njit(cache=True, nogil=True)
def price_all(spot, strike, steps, call, american, log_up, log_down, pu, pd, out):
    """price_range over all the options in order, without their first levels."""
    price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd,
                np.arange(spot.size), out, np.empty((0, LEVEL_VALUES)))


def kernel_arguments(params: LatticeParams):
    return (params.spot, params.strike, params.steps, params.call, params.american,
            params.log_up, params.log_down, params.pu, params.pd)


# Shared and never written (it has no rows): allocating one per call costs as much as a small option.
_NO_LEVELS = np.empty((0, LEVEL_VALUES))


def level_array(levels: np.ndarray | None) -> np.ndarray:
    """The `levels` argument of the kernels: the caller's (n, LEVEL_VALUES) array, or no rows."""
    return _NO_LEVELS if levels is None else levels


def price_here(params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
    """All the options on this thread, in one kernel call. Without levels it is price_all, with
    the fewest arguments: numba's dispatch costs ~0.1 us per array argument, and an N = 100 option
    only ~2 us of work."""
    out = np.empty(params.spot.size)
    if levels is None:
        price_all(*kernel_arguments(params), out)
    else:
        price_range(*kernel_arguments(params), np.arange(out.size), out, levels)
    return out


class SerialEngine:
    """One core, options one after another."""

    name = "serial"

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        return price_here(params, levels)
