"""The padded vector kernels of the CPU engines' hot loop (options.py takes options through them).

Work arrays are padded so that every level runs in whole 512-bit vectors (LLVM IR written out:
_vector_run), with the reference kernels' exact operations in each lane (kernels.py), so prices
are bitwise those of advance. Two lattices can advance together (padded_pair): at small N a
lattice's levels are short, each waits on the one before, and a second, independent lattice in
the same loop fills the wait.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.cpu.kernels import (UNDERFLOW, _exercise_run, _exercised_prefix, call_edge,
                                        exercise_limit, put_edge, ratio_monotone, zero_boundary)

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
    floor stays. Leaving it out spares a compare and a select per vector (docs/decisions.md)."""
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
# inlined per-level functions would be counted up and down each level, an atomic add each: a large
# share of a small lattice's time (docs/decisions.md). numba refuses to compile such a
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
