"""The `serial` backend: one core, numba-compiled backward induction — the reference engine.

Asset prices are never updated incrementally over the lattice: node (t, i) uses S0*exp(t*log_down) *
exp(i*(log_up - log_down)) from two tables whose entries are within a few ulp (see
power_tables_into), so the exercise value is as accurate at N = 1 000 000 as at N = 10. The kernels
below are also the building blocks of the `cpu` backend and of the GPU CPU tail; all of them do
exactly the same floating-point operations per node, so every backend that uses them is bitwise
equal to this one. Nodes where those operations cannot change a bit are skipped (the exercise
value where it cannot win, nodes that stay +0.0: see "Which nodes of a level need which step").

Options are priced two at a time (price_range): at small N a lattice's levels are short, each
waits on the one before, and a second, independent lattice in the same loop fills the wait.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pricer.engines.base import Engine
from pricer.engines.cpu.exp_table import EXP_TABLE_MAX_ARGUMENT, exp_table
from pricer.model.lattice import FLAGS_ROW, FLOAT_ROWS, LEVEL_VALUES, STEPS_ROW, LatticeParams

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


@njit(cache=True, nogil=True, _nrt=False)
def power_tables_into(spot, log_up, log_down, steps, level_base, ratio, scratch):
    """level_base[t] = S0*d^t (price of node (t, 0)); ratio[i] = (u/d)^i, for t, i <= steps.

    Each entry is the product of two exponentials, scale*exp(start*rate) * exp(j*rate), start a
    multiple of a block, so within a few ulp (plus the rounding of the argument, |t*log_down| ulp).
    Mostly in vector code, blocks of 8 (exp_table: both tables at N = 100 in 0.09 us, against 0.33
    us for the C library's exp); where an argument would pass EXP_TABLE_MAX_ARGUMENT (N in the
    millions at high volatility) through the C library, blocks of ~sqrt(steps), about
    4*sqrt(steps) calls to exp, the small factors in `scratch` (table_scratch_size(steps) long)."""
    count = steps + 1
    rate_base, rate_ratio = log_down, log_up - log_down
    if steps * max(abs(rate_base), abs(rate_ratio)) <= EXP_TABLE_MAX_ARGUMENT:
        exp_table(level_base, count, rate_base, spot)
        exp_table(ratio, count, rate_ratio, 1.0)
        return
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


@njit(cache=True, nogil=True, _nrt=False)
def terminal_values(values, steps, strike, sign, level_base, ratio):
    base = level_base[steps]
    for i in range(steps + 1):
        payoff = sign * (base * ratio[i] - strike)
        values[i] = payoff if payoff > 0.0 else 0.0


@njit(cache=True, nogil=True)
def american_nodes(values, count, pu, pd, signed_base, minus_strike, ratio):
    """Nodes 0..count of the next level in place, American: the larger of holding and exercising."""
    for i in range(count):
        hold = pu * values[i + 1] + pd * values[i]
        hold = hold if hold >= UNDERFLOW else 0.0
        # sign is +-1, so signed_base*ratio + minus_strike == sign*(S - strike) exactly
        exercise = signed_base * ratio[i] + minus_strike
        values[i] = exercise if exercise > hold else hold


@njit(cache=True, nogil=True)
def european_nodes(values, count, pu, pd):
    """Nodes 0..count of the next level in place, holding only."""
    for i in range(count):
        hold = pu * values[i + 1] + pd * values[i]
        values[i] = hold if hold >= UNDERFLOW else 0.0


# Which nodes of a level need which step. Hold values are never negative, so a node whose exercise
# value is <= 0 takes the hold (American max) and one whose two successors are +0.0 is +0.0 again
# (the floor maps 0, -0 and NaN products to +0.0), unless it may be exercised. With the ratio table
# non-decreasing, the exercise value sign*(S - K) is monotone in the node index: a put may be
# exercised exactly on the nodes below an edge, a call exactly from an edge up, and the nodes that
# stay +0.0 are the ones above (put) or below (call) a boundary that moves at most one node per
# level. So each level is two runs of nodes, one American and one European, and the zero nodes are
# left as they are: bitwise the values of the full American step, with fewer operations (about half
# the nodes of an at-the-money lattice need no exercise, and a quarter stay zero).


@njit(cache=True, nogil=True, _nrt=False)
def ratio_monotone(ratio, width):
    """ratio[0..width) finite and non-decreasing (always, barring rounding at extreme inputs)."""
    ok = True
    for i in range(width - 1):
        ok &= ratio[i] <= ratio[i + 1]
    return ok and ratio[width - 1] < math.inf


@njit(cache=True, nogil=True, inline="always")
def put_edge(edge, count, signed_base, minus_strike, ratio):
    """The nodes [0, edge) of a put's level of `count` nodes are the ones it may exercise (exercise
    value > 0); found by walking from the level before's edge (ratio non-decreasing)."""
    edge = min(edge, count)
    while edge > 0 and not signed_base * ratio[edge - 1] + minus_strike > 0.0:
        edge -= 1
    while edge < count and signed_base * ratio[edge] + minus_strike > 0.0:
        edge += 1
    return edge


@njit(cache=True, nogil=True, inline="always")
def call_edge(edge, count, signed_base, minus_strike, ratio):
    """The nodes [edge, count) of a call's level are the ones it may exercise."""
    edge = min(edge, count)
    while edge < count and not signed_base * ratio[edge] + minus_strike > 0.0:
        edge += 1
    while edge > 0 and signed_base * ratio[edge - 1] + minus_strike > 0.0:
        edge -= 1
    return edge


@njit(cache=True, nogil=True)
def _is_plus_zero(x):
    return x == 0.0 and math.copysign(1.0, x) > 0.0


@njit(cache=True, nogil=True, _nrt=False)
def zero_boundary(values, width, put):
    """put: the first index of the +0.0 nodes at the top of values[0..width); call: the number of
    +0.0 nodes at the bottom."""
    if put:
        top = width
        while top > 0 and _is_plus_zero(values[top - 1]):
            top -= 1
        return top
    bottom = 0
    while bottom < width and _is_plus_zero(values[bottom]):
        bottom += 1
    return bottom


@njit(cache=True, nogil=True)
def advance(values, width, t_from, levels, strike, sign, american, pu, pd, level_base, ratio,
            limit=0.0):
    """Take `levels` backward steps in place from level t_from, whose first `width` nodes are in
    values[0..width); each step leaves one node fewer. ratio may be offset (ratio[j] belongs to
    values[j]), which lets a chunk of a level advance on its own. Nodes that cannot be exercised
    take the European step and +0.0 nodes are left as they are (see above); where the ratio table
    is not monotone, every node takes the American step. An American put given its
    exercise_limit (`limit`, 0: none) leaves out the nodes that are surely exercised, as
    backward_padded does (here node by node, from a scan of the level's first nodes)."""
    minus_strike = -sign * strike
    if american and not ratio_monotone(ratio, width):
        for s in range(1, levels + 1):
            american_nodes(values, width - s, pu, pd, sign * level_base[t_from - s], minus_strike,
                           ratio)
    elif sign < 0:
        zeros = zero_boundary(values, width, True)
        edge = zeros
        # nodes [0, first) of the last level are exercised and not written; its first `known`
        # nodes hold their exercise value
        first = 0
        skipping = american and limit > 0.0
        known = _exercised_prefix(values, 0, width, -level_base[t_from], minus_strike,
                                  ratio) if skipping else 0
        for s in range(1, levels + 1):
            count, signed_base = width - s, sign * level_base[t_from - s]
            edge = put_edge(edge, count, signed_base, minus_strike, ratio) if american else 0
            zeros = max(zeros, edge)
            if skipping:
                below = max(known - 1, 0)   # these nodes' successors were exercised
                while below > 0 and not -signed_base * ratio[below - 1] < limit:
                    below -= 1
                # the last level's skipped nodes read now
                _exercise_run(values, ratio, below, first, sign * level_base[t_from - s + 1],
                              minus_strike)
                first = below
                american_nodes(values[first:], edge - first, pu, pd, signed_base, minus_strike,
                               ratio[first:])
                known = _exercised_prefix(values, first, count, signed_base, minus_strike, ratio)
            else:
                american_nodes(values, edge, pu, pd, signed_base, minus_strike, ratio)
            european_nodes(values[edge:], min(zeros, count) - edge, pu, pd)
        _exercise_run(values, ratio, 0, first, sign * level_base[t_from - levels], minus_strike)
    else:
        zeros = zero_boundary(values, width, False)
        edge = zeros
        for s in range(1, levels + 1):
            count, signed_base = width - s, sign * level_base[t_from - s]
            edge = call_edge(edge, count, signed_base, minus_strike, ratio) if american else count
            zeros = max(0, min(zeros - 1, edge))
            european_nodes(values[zeros:], edge - zeros, pu, pd)
            american_nodes(values[edge:], count - edge, pu, pd, signed_base, minus_strike,
                           ratio[edge:])


@njit(cache=True, nogil=True)
def backward_inplace(values, t_from, t_to, strike, sign, american, pu, pd, level_base, ratio,
                     limit=0.0):
    """From level t_from (values[0..t_from]) down to level t_to, in place (limit: advance's)."""
    advance(values, t_from + 1, t_from, t_from - t_to, strike, sign, american, pu, pd,
            level_base, ratio, limit)




@njit(cache=True, nogil=True)
def backward_keeping_levels(values, t_from, strike, sign, american, pu, pd, level_base, ratio,
                            levels, row, limit=0.0):
    """backward_inplace down to level 0, keeping levels 2 and 1 in levels[row] (if it has rows).
    The same steps in the same order, so the price is bitwise the one backward_inplace gives."""
    # levels as int64 values, not literals: each literal compiled its own copy of advance
    zero, one, two = np.int64(0), np.int64(1), np.int64(2)
    if levels.shape[0] == 0 or t_from < 2:
        if levels.shape[0] > 0:
            levels[row, :] = np.nan
        backward_inplace(values, t_from, zero, strike, sign, american, pu, pd, level_base, ratio,
                         limit)
        return
    backward_inplace(values, t_from, two, strike, sign, american, pu, pd, level_base, ratio, limit)
    levels[row, 2] = values[0]
    levels[row, 3] = values[1]
    levels[row, 4] = values[2]
    backward_inplace(values, two, one, strike, sign, american, pu, pd, level_base, ratio, limit)
    levels[row, 0] = values[0]
    levels[row, 1] = values[1]
    backward_inplace(values, one, zero, strike, sign, american, pu, pd, level_base, ratio, limit)


# Levels up to this index are advanced two lattices at a time (padded_pair); wider levels one
# lattice at a time, since one alone already keeps the vector units busy there.
PAIR_MAX_STEPS = 512
# The padded kernels (_vector_run) compute whole vectors of LANES nodes (512 bits), so they run up
# to LANES - 1 nodes past a level's last node and read the vector after that: price_range's work
# arrays have PAD zeroed nodes after the lattice's last. Nodes past a level's last one compute
# garbage from finite padding (zeros, table entries, stale values) that never flows back, since
# node i reads only nodes i and i + 1.
LANES = 8
PAD = 2 * LANES


def _vector_run(american: bool, floored: bool = True):
    """An intrinsic run(values, ratio, start, stop, pu, pd, signed_base, minus_strike) -> int:
    nodes start..stop of the next level in place (start a multiple of LANES), whole vectors, with
    advance's exact operations in each lane. Each vector's upper neighbours come from the next
    aligned vector by a lane shift (kept in a register for the next step) rather than from a load
    one node further on: such a load spans two of the previous level's stores, which the core
    cannot forward, and at small N each level waits on the one before. Returns how many of nodes
    start, start + 1, ... (up to LANES) now hold their exercise value (American runs; 0 for an
    empty run), from the registers: a load of the nodes just stored would wait for the vector
    store, and the next level with it. floored=False leaves out the UNDERFLOW floor, for lattices
    where it cannot change a bit (floor_needed)."""
    vector = ir.VectorType(ir.DoubleType(), LANES)
    lanes = ir.VectorType(ir.IntType(32), LANES)
    shift = ir.Constant(lanes, list(range(1, LANES + 1)))
    lane0 = ir.Constant(ir.IntType(32), 0)

    def load(builder, pointer):
        return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=8)

    def splat(builder, scalar):
        one = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar, lane0)
        return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                      ir.Constant(lanes, [0] * LANES))

    @intrinsic
    def run(typingctx, values, ratio, start, stop, pu, pd, signed_base, minus_strike):
        def codegen(context, builder, signature, args):
            values, ratio, start, stop, pu, pd, signed_base, minus_strike = args
            data = context.make_array(signature.args[0])(context, builder, values).data
            rdata = context.make_array(signature.args[1])(context, builder, ratio).data
            pu, pd = splat(builder, pu), splat(builder, pd)
            floor = splat(builder, ir.Constant(ir.DoubleType(), UNDERFLOW))
            zero = ir.Constant(vector, [0.0] * LANES)
            signed_base, minus_strike = splat(builder, signed_base), splat(builder, minus_strike)
            low_slot = cgutils.alloca_once(builder, vector)
            took_slot = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(64), 0))
            step = ir.Constant(start.type, LANES)

            def node_vector(i):
                """Nodes i..i+LANES of the next level; their exercise >= hold (American)."""
                at = builder.gep(data, [i])
                low = builder.load(low_slot)
                high = load(builder, builder.gep(at, [step]))
                up = builder.shuffle_vector(low, high, shift)
                hold = builder.fadd(builder.fmul(pu, up), builder.fmul(pd, low))
                if floored:
                    hold = builder.select(builder.fcmp_ordered(">=", hold, floor), hold, zero)
                took = None
                if american:
                    exercise = builder.fadd(
                        builder.fmul(signed_base, load(builder, builder.gep(rdata, [i]))),
                        minus_strike)
                    took = builder.fcmp_ordered(">=", exercise, hold)
                    hold = builder.select(builder.fcmp_ordered(">", exercise, hold), exercise,
                                          hold)
                builder.store(hold, builder.bitcast(at, vector.as_pointer()), align=8)
                builder.store(high, low_slot)
                return took

            with builder.if_then(builder.icmp_signed("<", start, stop)):
                builder.store(load(builder, builder.gep(data, [start])), low_slot)
                rest = start
                if american:
                    took = node_vector(start)   # peeled: its lanes answer the question
                    mask = builder.bitcast(took, ir.IntType(LANES))
                    cttz = builder.module.declare_intrinsic("llvm.cttz",
                                                            [mask.type, ir.IntType(1)])
                    lanes_taken = builder.call(cttz, [builder.not_(mask), cgutils.false_bit])
                    builder.store(builder.zext(lanes_taken, ir.IntType(64)), took_slot)
                    rest = builder.add(start, step)
                with cgutils.for_range_slice(builder, rest, stop, step) as (i, _):
                    node_vector(i)
            return builder.load(took_slot)

        return types.int64(values, ratio, start, stop, pu, pd, signed_base, minus_strike), codegen

    return run


@intrinsic
def _last_levels(typingctx, values, ratio, level_base, t_from, pu, pd, sign, minus_strike,
                 american, floored):
    """Levels t_from - 1 .. 0 (t_from <= LANES) of a lattice whose level t_from fills values[0..
    t_from] (every node written: no skipped ones): one vector kept in a register from level to
    level, each node the full step (American where `american`, floored where `floored`, as the
    runs'), so that the last levels do not wait on a store and a load each, nor on the runs' and
    edges' bookkeeping. Lanes past a level's last node compute garbage that never flows back."""
    def codegen(context, builder, signature, args):
        (values, ratio, level_base, t_from, pu, pd, sign, minus_strike, american,
         floored) = args
        f64, i32 = ir.DoubleType(), ir.IntType(32)
        vector = ir.VectorType(f64, LANES)
        lanes = ir.VectorType(i32, LANES)
        data = context.make_array(signature.args[0])(context, builder, values).data
        rdata = context.make_array(signature.args[1])(context, builder, ratio).data
        bdata = context.make_array(signature.args[2])(context, builder, level_base).data

        def load(pointer):
            return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=8)

        def splat(scalar):
            one = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar,
                                         ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                          ir.Constant(lanes, [0] * LANES))

        shift = ir.Constant(lanes, list(range(1, LANES + 1)))
        vpu, vpd, vms = splat(pu), splat(pd), splat(minus_strike)
        floor = splat(ir.Constant(f64, UNDERFLOW))
        zero = ir.Constant(vector, [0.0] * LANES)
        node_ratio = load(rdata)
        level = cgutils.alloca_once_value(builder, load(data))
        # node LANES of level t_from, for the first step; on later steps the lanes it feeds are
        # past the level's last node
        above = load(builder.gep(data, [ir.Constant(t_from.type, LANES)]))
        with cgutils.for_range(builder, t_from) as loop:
            t = builder.sub(builder.sub(t_from, loop.index), ir.Constant(t_from.type, 1))
            low = builder.load(level)
            up = builder.shuffle_vector(low, above, shift)
            hold = builder.fadd(builder.fmul(vpu, up), builder.fmul(vpd, low))
            floored_hold = builder.select(builder.fcmp_ordered(">=", hold, floor), hold, zero)
            hold = builder.select(floored, floored_hold, hold)
            base = builder.fmul(sign, builder.load(builder.gep(bdata, [t])))
            exercise = builder.fadd(builder.fmul(splat(base), node_ratio), vms)
            american_value = builder.select(builder.fcmp_ordered(">", exercise, hold), exercise,
                                            hold)
            builder.store(builder.select(american, american_value, hold), level)
        builder.store(builder.load(level), builder.bitcast(data, vector.as_pointer()), align=8)
        return context.get_dummy_value()

    return types.void(values, ratio, level_base, t_from, pu, pd, sign, minus_strike, american,
                      floored), codegen


@intrinsic
def _exercise_run(typingctx, values, ratio, start, stop, signed_base, minus_strike):
    """Nodes start..stop get their exercise values (advance's exact operations): a put's skipped
    nodes, needed again (see _put_skip). An intrinsic, like the runs: a numba loop here kept the
    arrays' reference counts in the level loop (an atomic add per array and level)."""
    def codegen(context, builder, signature, args):
        values, ratio, start, stop, signed_base, minus_strike = args
        data = context.make_array(signature.args[0])(context, builder, values).data
        rdata = context.make_array(signature.args[1])(context, builder, ratio).data
        with cgutils.for_range_slice(builder, start, stop, ir.Constant(start.type, 1)) as (i, _):
            exercise = builder.fadd(builder.fmul(signed_base, builder.load(builder.gep(rdata, [i]))),
                                    minus_strike)
            builder.store(exercise, builder.gep(data, [i]))
        return context.get_dummy_value()

    return types.void(values, ratio, start, stop, signed_base, minus_strike), codegen


_american_run = _vector_run(True)
_european_run = _vector_run(False)
_american_run_unfloored = _vector_run(True, floored=False)
_european_run_unfloored = _vector_run(False, floored=False)


@njit(cache=True, nogil=True)
def floor_needed(strike, steps, pu, pd):
    """False where no node of the lattice can hold a positive value below UNDERFLOW, so that the
    floor cannot change a bit: a positive payoff or exercise value sign*(S - K) of doubles is at
    least K 2^-54 (Sterbenz), and a positive hold is at least min(pu, pd) times a positive value
    of the level after (values are never negative), less a rounding: every positive value is at
    least K 2^-54 (min(pu, pd)(1 - 2^-52))^N. At N = 100 that is ~2^-150 K; past N ~ 800 the
    floor stays. Leaving it out spares a compare and a select per vector (N = 100: 0.18 us)."""
    low = min(pu, pd) * (1.0 - 2.0 ** -52)
    # low**steps (a product chain; an underflow to 0 keeps the floor) against 2^-950, 13 binades
    # above UNDERFLOW, which covers its rounding
    return not strike * 2.0 ** -54 * low ** steps >= 2.0 ** -950


@njit(cache=True, nogil=True, inline="always")
def _run(floored, values, ratio, start, stop, pu, pd, signed_base, minus_strike):
    """The American run, with or without the floor (floor_needed)."""
    if floored:
        return _american_run(values, ratio, start, stop, pu, pd, signed_base, minus_strike)
    return _american_run_unfloored(values, ratio, start, stop, pu, pd, signed_base, minus_strike)


@njit(cache=True, nogil=True, inline="always")
def _run_european(floored, values, ratio, start, stop, pu, pd):
    """The European run, with or without the floor (floor_needed)."""
    if floored:
        _european_run(values, ratio, start, stop, pu, pd, 0.0, 0.0)
    else:
        _european_run_unfloored(values, ratio, start, stop, pu, pd, 0.0, 0.0)


# backward_padded's ways through a level: every node American (the ratio table is not monotone),
# or the runs of a put or of a call (advance's, rounded out to whole vectors)
_FULL, _PUT, _CALL = 0, 1, 2

# Unit roundoff of float64, and the factor by which exercise_limit widens every rounding-error bound
# it uses (a safety margin on a margin: the skipped nodes' limit moves by ~1e-15 relative).
_ROUNDOFF = 2.0 ** -53
EXERCISE_SLACK = 4.0


@njit(cache=True, nogil=True)
def exercise_limit(strike, steps, pu, pd, log_up, log_down, slack=EXERCISE_SLACK):
    """A put's node (t, i) whose two successors were exercised (their value is their exercise value,
    bit for bit) is exercised itself — exercise value > hold value as computed, whatever the
    rounding — if level_base[t]*ratio[i] < the limit returned (0: no node is known to be).

    Why: with V(t+1, j) = K - S(t+1, j) for j = i, i + 1, exercise - hold = K(1 - pu - pd) -
    S(t, i)(1 - pu u - pd d) in exact arithmetic, where S(t+1, i) = S(t, i) d and S(t+1, i+1) =
    S(t, i) u. The tables only hold S within eta relative (the rounding of their exponents, which
    grows with N) and every operation rounds; bounding those errors by (num, den) below, each
    widened slack-fold, the difference is positive for S(t, i) < num/den. Without dividends den
    is only those errors, and every put node whose successors were exercised is (num ~ K r dt)."""
    up, down = math.exp(log_up), math.exp(log_down)
    discount = pu + pd
    growth = pu * up + pd * down                       # e^-q dt, up to rounding
    eta = (steps * (abs(log_down) + abs(log_up - log_down)) + 12.0) * 2.0 * _ROUNDOFF
    err = slack * _ROUNDOFF
    num = strike * ((1.0 - discount) - err * (2.0 + 4.0 * discount))
    den = (1.0 - growth) + slack * eta * growth + err * (4.0 + 3.0 * up * discount + 2.0 * growth)
    if not num > 0.0:
        return 0.0
    if not den > 0.0:
        return math.inf
    return num / den * (1.0 - err)


@njit(cache=True, nogil=True, _nrt=False)
def _exercised_prefix(values, start, count, signed_base, minus_strike, ratio):
    """The first node from `start` up (to `count`) that does not hold its exercise value bit for
    bit: with start 0, how many of a level's first nodes do."""
    known = start
    while known < count and values[known] == signed_base * ratio[known] + minus_strike:
        known += 1
    return known


@njit(cache=True, nogil=True, _nrt=False)
def _positives(values, count):
    """How many of values[0..count) are > 0 (a vector loop, where zero_boundary's scan branches on
    each node)."""
    positives = 0
    for i in range(count):
        positives += values[i] > 0.0
    return positives


@njit(cache=True, nogil=True, _nrt=False)
def _padded_start(values, ratio, level_base, t_from, sign, american, strike, steps, pu, pd,
                  log_up, log_down):
    """(way, edge, zeros, skip, limit, floored) of a lattice at level t_from for _padded_level.
    skip is an American put's (0, known, known + 1), known the number of its first nodes that hold
    their exercise value (so that its first level skips as _put_skip would with level t_from + 1's
    count); limit is exercise_limit's (0 for a call or a European option); floored floor_needed's.
    At t_from == steps, values must be terminal_values' payoffs."""
    floored = floor_needed(strike, steps, pu, pd)
    if american and not ratio_monotone(ratio, t_from + 1):
        return _FULL, 0, 0, (0, 0, 0), 0.0, floored
    if american and t_from == steps:   # payoffs, monotone: the positive ones are a run
        zeros = _positives(values, t_from + 1)
        zeros = zeros if sign < 0 else t_from + 1 - zeros
    else:
        zeros = zero_boundary(values, t_from + 1, sign < 0)
    if sign > 0 or not american:
        return _CALL if sign > 0 else _PUT, zeros, zeros, (0, 0, 0), 0.0, floored
    limit = exercise_limit(strike, steps, pu, pd, log_up, log_down)
    if t_from == steps:   # the payoffs: the nodes below the +0.0 ones hold their exercise value
        known = zeros
    else:
        known = _exercised_prefix(values, 0, t_from + 1, -level_base[t_from], strike, ratio)
    return _PUT, zeros, zeros, (0, known, known + 1), limit, floored


@njit(cache=True, nogil=True, inline="always")
def _put_skip(ratio, lagged, limit, base, next_base):
    """The whole vectors of a put's level t below which every node is surely exercised: the first
    node level t computes. `lagged` is how many of level t + 2's first nodes were exercised, so
    level t + 1's nodes [0, lagged - 1) were too where exercise_limit holds (their successors were),
    and level t's nodes [0, lagged - 2) where it holds again. Level t + 2's count, not level
    t + 1's: that one is known only once level t + 1's first vector is done, and the next level's
    loads would wait for it (at N = 100 the levels are short, and overlap). base, next_base:
    level_base[t], level_base[t + 1]."""
    first = max(lagged - 2, 0) & -LANES
    while first > 0 and not (next_base * ratio[first] < limit and base * ratio[first - 1] < limit):
        first -= LANES
    return first


@njit(cache=True, nogil=True, inline="always")
def _padded_level(values, ratio, t, way, american, edge, zeros, skip, limit, floored, pu, pd,
                  signed_base, next_base, minus_strike):
    """Level t from level t + 1 in whole vectors; returns the new (edge, zeros, skip). A put's
    skip: (its nodes [0, first) are exercised and not written, see _put_skip; how many of its first
    nodes are known to hold their exercise value on this level, and on the level before). floored:
    floor_needed's."""
    count = t + 1
    if way == _FULL:
        _run(floored, values, ratio, 0, count, pu, pd, signed_base, minus_strike)
    elif way == _PUT:
        edge = put_edge(edge, count, signed_base, minus_strike, ratio) if american else 0
        zeros = max(zeros, edge)
        unwritten, known, lagged = skip
        first = 0
        if american:
            first = _put_skip(ratio, lagged, limit, -signed_base, next_base)
            if first < unwritten:   # level t + 1's skipped nodes from `first` up are read now
                _exercise_run(values, ratio, first, unwritten, -next_base, minus_strike)
        took = _run(floored, values, ratio, first, edge, pu, pd, signed_base, minus_strike)
        _run_european(floored, values, ratio, max((edge + LANES - 1) & -LANES, first),
                      min(zeros, count), pu, pd)
        skip = (first, first + took, known)
    else:
        edge = call_edge(edge, count, signed_base, minus_strike, ratio) if american else count
        zeros = max(0, min(zeros - 1, edge))
        cut = edge & -LANES if american else count   # a European option has no American run
        _run_european(floored, values, ratio, zeros & -LANES, cut, pu, pd)
        _run(floored, values, ratio, cut, count, pu, pd, signed_base, minus_strike)
    return edge, zeros, skip


# The level loops (and the kernels that prepare a lattice) run without numba's reference counting
# (_nrt=False: they allocate nothing and let no array escape). With it, every array handed to the
# inlined per-level functions was counted up and down each level, an atomic add each: a fifth of
# the time of 1 000 N = 100 puts (pairs 1.7 -> 1.06 us per put). numba refuses to compile such a
# kernel if it ever allocates.
@njit(cache=True, nogil=True, _nrt=False)
def backward_padded(values, t_from, t_to, strike, sign, american, pu, pd, level_base, ratio,
                    steps, log_up, log_down):
    """backward_inplace on price_range's padded work arrays, in whole vectors (_vector_run), with
    advance's runs of nodes rounded out to whole vectors: at N = 100 a level is latency-bound, and
    LLVM's loops with their scalar remainders cost more there than the nodes they leave out. An
    American put's nodes that are surely exercised are not computed (_put_skip): bitwise the same
    values, about a third fewer nodes at the money. `steps` is the option's N (for the limit)."""
    minus_strike = -sign * strike
    way, edge, zeros, skip, limit, floored = _padded_start(values, ratio, level_base, t_from, sign,
                                                           american, strike, steps, pu, pd,
                                                           log_up, log_down)
    # the last LANES levels of a whole lattice in a register (_last_levels)
    t_runs = LANES if t_to == 0 and t_from > LANES else t_to
    for t in range(t_from - 1, t_runs - 1, -1):
        edge, zeros, skip = _padded_level(values, ratio, t, way, american, edge, zeros, skip,
                                          limit, floored, pu, pd, sign * level_base[t],
                                          level_base[t + 1], minus_strike)
    _exercise_run(values, ratio, 0, skip[0], sign * level_base[t_runs], minus_strike)
    if t_runs > t_to:
        _last_levels(values, ratio, level_base, t_runs, pu, pd, sign, minus_strike, american,
                     floored)


@njit(cache=True, nogil=True, _nrt=False)
def padded_pair(a, b, t_from, t_to):
    """Two lattices a and b, both at level t_from, down to level t_to, a level of one and then of
    the other in turn, so that the core overlaps their chains (see backward_padded). Each is a tuple
    (values, ratio, level_base, pu, pd, strike, sign, american, steps, log_up, log_down) of
    price_range's work arrays and the option's numbers."""
    va, ra, lba, pua, pda, ka, sa, ama, na, lua, lda = a
    vb, rb, lbb, pub, pdb, kb, sb, amb, nb, lub, ldb = b
    minus_ka, minus_kb = -sa * ka, -sb * kb
    way_a, edge_a, zeros_a, skip_a, limit_a, floored_a = _padded_start(
        va, ra, lba, t_from, sa, ama, ka, na, pua, pda, lua, lda)
    way_b, edge_b, zeros_b, skip_b, limit_b, floored_b = _padded_start(
        vb, rb, lbb, t_from, sb, amb, kb, nb, pub, pdb, lub, ldb)
    for t in range(t_from - 1, t_to - 1, -1):
        edge_a, zeros_a, skip_a = _padded_level(va, ra, t, way_a, ama, edge_a, zeros_a, skip_a,
                                                limit_a, floored_a, pua, pda, sa * lba[t],
                                                lba[t + 1], minus_ka)
        edge_b, zeros_b, skip_b = _padded_level(vb, rb, t, way_b, amb, edge_b, zeros_b, skip_b,
                                                limit_b, floored_b, pub, pdb, sb * lbb[t],
                                                lbb[t + 1], minus_kb)
    _exercise_run(va, ra, 0, skip_a[0], sa * lba[t_to], minus_ka)
    _exercise_run(vb, rb, 0, skip_b[0], sb * lbb[t_to], minus_kb)


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
    cross cache lines made the N = 100 lattice 0.85 or 1.05 us by the luck of the allocation.
    Inlined into its caller, so that the views are counted (or not) as the caller's own."""
    size = _array_size(width)
    at = (-(buf.ctypes.data >> 3)) & (LANES - 1)
    return (buf[at:at + size], buf[at + size:at + 2 * size], buf[at + 2 * size:at + 3 * size],
            buf[at + 3 * size:])


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
def _option(order, j):
    """The j-th option to price: order[j], or j itself where there is no order."""
    if order is None:
        return j
    return order[j]


@njit(cache=True, nogil=True)
def price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd, order, out, levels):
    """Price the options order[0..] (all of them, in turn, if order is None) into out, two at a
    time (_price_pair) reusing two sets of work arrays; `levels` is (len(out), LEVEL_VALUES) to keep
    the first levels' values, or (0, LEVEL_VALUES). Every price is bitwise the one the option gets
    alone."""
    count = out.size if order is None else order.size
    if count == 0:
        return
    width = 1
    for j in range(count):
        width = max(width, steps[_option(order, j)] + 1)
    first = _work(width)
    second = _work(width) if count > 1 else first
    j = np.int64(0)   # not a literal 0: that compiled a second copy of _price_pair
    while j + 1 < count:
        _price_pair(_option(order, j), _option(order, j + 1), spot, strike, steps, call, american,
                    log_up, log_down, pu, pd, out, levels, first, second)
        j += 2
    if j < count:
        _price_single(_option(order, j), spot, strike, steps, call, american, log_up, log_down, pu,
                      pd, out, levels, first)


_SPOT, _STRIKE = FLOAT_ROWS["spot"], FLOAT_ROWS["strike"]
_LOG_UP, _LOG_DOWN, _PU, _PD = (FLOAT_ROWS[name] for name in ("log_up", "log_down", "pu", "pd"))


@njit(cache=True, nogil=True)
def packed_arguments(packed):
    """kernel_arguments from LatticeParams.packed (see lattice.packed_views)."""
    n = packed.shape[1]
    flags = packed[FLAGS_ROW].view(np.bool_)
    return (packed[_SPOT], packed[_STRIKE], packed[STEPS_ROW].view(np.int64), flags[:n],
            flags[n:2 * n], packed[_LOG_UP], packed[_LOG_DOWN], packed[_PU], packed[_PD])


@njit(cache=True, nogil=True)
def _price_alone(spot, strike, steps, call, american, log_up, log_down, pu, pd):
    """One option's price, from scalars: the pair machinery's bookkeeping (arrays handed through
    four calls, each counting references) costs ~0.3 us, a sixth of an N = 100 option."""
    return _price_in(np.empty(_work_size(steps + 1)), spot, strike, steps, call, american, log_up,
                     log_down, pu, pd)


@njit(cache=True, nogil=True, _nrt=False)
def _price_in(buf, spot, strike, steps, call, american, log_up, log_down, pu, pd):
    """_price_alone in its work buffer, without reference counting (the views would be counted)."""
    values, level_base, ratio, scratch = _work_views(buf, steps + 1)
    sign = _prepare(values, level_base, ratio, scratch, spot, strike, steps, call, log_up,
                    log_down)
    # np.int64(0), not 0: a literal 0 compiled a second copy of backward_padded (~2 s, once)
    backward_padded(values, steps, np.int64(0), strike, sign, american, pu, pd, level_base, ratio,
                    steps, log_up, log_down)
    return values[0]


@intrinsic
def _bits(typingctx, x):
    """The 64 bits of a float64 as an int64 (LatticeParams.packed keeps steps and flags so)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@njit(cache=True, nogil=True)
def price_all(packed, out):
    """price_range over all the options of LatticeParams.packed, without their first levels: two
    array arguments, where the nine fields would cost numba's dispatch ~0.5 us more per call."""
    if out.size == 1:
        # from the numbers themselves: nine views of packed's rows, each reference-counted, were
        # ~0.05 us of an N = 100 call. The flags row holds call then american, a byte each
        # (packed_views; little-endian).
        flags = _bits(packed[FLAGS_ROW, 0])
        out[0] = _price_alone(packed[_SPOT, 0], packed[_STRIKE, 0], _bits(packed[STEPS_ROW, 0]),
                              (flags & 0xFF) != 0, (flags & 0xFF00) != 0, packed[_LOG_UP, 0],
                              packed[_LOG_DOWN, 0], packed[_PU, 0], packed[_PD, 0])
        return
    spot, strike, steps, call, american, log_up, log_down, pu, pd = packed_arguments(packed)
    if out.size > 0:
        price_range(spot, strike, steps, call, american, log_up, log_down, pu, pd, None, out,
                    np.empty((0, LEVEL_VALUES)))


def kernel_arguments(params: LatticeParams):
    return (params.spot, params.strike, params.steps, params.call, params.american,
            params.log_up, params.log_down, params.pu, params.pd)


# Shared and never written (it has no rows): allocating one per call costs as much as a small option.
_NO_LEVELS = np.empty((0, LEVEL_VALUES))


def level_array(levels: np.ndarray | None) -> np.ndarray:
    """The `levels` argument of the kernels: the caller's (n, LEVEL_VALUES) array, or no rows."""
    return _NO_LEVELS if levels is None else levels


class Direct:
    """A kernel called through its compiled entry point for one signature, without numba's type
    dispatch (~0.1 us of an N = 100 call's ~2 us). Only for arguments that always have exactly
    those types: LatticeParams.packed (always a C-contiguous float64 (PACKED_ROWS, n) array) and a
    fresh float64 `out`. Compiled (or loaded from numba's cache) on the first call."""

    def __init__(self, kernel, signature: str):
        self.kernel, self.signature = kernel, signature
        self.call = self._first_call

    def _first_call(self, *args):
        self.call = self.kernel.compile(self.signature)
        return self.call(*args)


price_packed = Direct(price_all, "void(float64[:, ::1], float64[::1])")


def price_here(params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
    """All the options on this thread, in one kernel call."""
    out = np.empty(len(params))
    if levels is None:
        price_packed.call(params.packed, out)
    else:
        price_range(*kernel_arguments(params), None, out, levels)
    return out


class SerialEngine(Engine):
    """One core, options one after another."""

    name = "serial"

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        if levels is not None:
            return price_here(params, levels)
        # price_here's path, inline: at N = 100 each Python call and lookup is ~2 % of the call
        out = np.empty(params.count)
        price_packed.call(params.packed, out)
        return out
