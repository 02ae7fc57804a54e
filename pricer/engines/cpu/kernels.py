"""The reference kernels of the CPU engines: numba-compiled backward induction, one level at a time.

Asset prices are never updated incrementally over the lattice: node (t, i) uses S0*exp(t*log_down) *
exp(i*(log_up - log_down)) from two tables whose entries are within a few ulp (see
power_tables_into), so the exercise value is as accurate at N = 1 000 000 as at N = 10. These
kernels are the building blocks of the `serial` and `cpu` backends (padded.py adds the vector
code of their hot loop) and of the GPU engines' CPU tail; all of them do exactly the same
floating-point operations per node, so every backend that uses them is bitwise equal to `serial`.
Nodes where those operations cannot change a bit are skipped (the exercise value where it cannot
win, nodes that stay +0.0: see "Which nodes of a level need which step").
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.cpu.exp_table import EXP_TABLE_MAX_ARGUMENT, exp_table
from pricer.model.lattice import CENTRED, CLAMP_SLACK, CLAMPED, NODE_LOG_LIMIT, PLAIN

# Option values below 2**-963 (~1e-290) are set to 0. Far out-of-the-money nodes of wide lattices
# otherwise decay into subnormal numbers, which x86 cores handle in microcode, many times slower
# than normal ones (docs/decisions.md), on up to a tenth of the nodes of such lattices. Values
# are never negative, so on the GPU the same test is an integer compare of the high word
# (< 0x03C00000), which keeps every backend bitwise equal; the prices move by less than 1e-280
# at most.
UNDERFLOW = 2.0 ** -963


# How node prices are built (node_tables), by the range of the lattice's node prices ln S(t, i) =
# ln S0 + t ln d + i ln(u/d), t, i <= N:
# - PLAIN: nodes, ln d^N and ln (u/d)^N all within +-NODE_LOG_LIMIT: level_base[t] = S0 d^t and
#   ratio[i] = (u/d)^i, one table each.
# - CENTRED: the nodes are within +-NODE_LOG_LIMIT but (u/d)^N or d^N alone is not (at N = 1 000 000
#   and sigma sqrt(T) = 0.63, (u/d)^N = e^1265 while the nodes span e^-628 to e^637): the factor
#   e^shift moves from one table to the other, level_base[t] = S0 e^{t ln d + shift} and ratio[i] =
#   e^{i ln(u/d) - shift}, shift chosen so that no entry of either table leaves +-NODE_LOG_LIMIT.
#   Same kernels, same products, no intermediate beyond FP64's range.
# - CLAMPED: node prices themselves leave the range (sigma sqrt(T N) beyond ~700, or an extreme
#   spot). Such a lattice is priced in blocks of levels (clamped_tables), each with its own shift,
#   which keeps level_base within e^{+-CLAMP_SLACK}, and with ratio's exponents clipped to
#   +-NODE_LOG_LIMIT: nodes within e^{+-(NODE_LOG_LIMIT - CLAMP_SLACK)} are exact, the others
#   clamped into FP64's normal range (a put's values there are the same bits either way; a call's
#   top nodes carry no weight: pricer/model/lattice.py refuses a lattice whose clamped nodes could
#   move its price by 2^-1074 K). Only the CPU kernels price in blocks; the GPU engines hand such
#   options to their CPU engine.
# PLAIN tables are the ones every lattice that fits them has always had: the same bits.


@njit(cache=True, nogil=True, _nrt=False)
def node_tables(spot, log_up, log_down, steps):
    """(kind, shift) of an option's node tables: PLAIN, CENTRED or CLAMPED (above), and CENTRED's
    shift (0.0 for the others)."""
    n = float(steps)
    spread = n * (log_up - log_down)
    # most lattices, without a logarithm: ln S0 within +-345 and every n ln factor within +-350
    if (spread <= NODE_LOG_LIMIT and n * max(abs(log_up), abs(log_down)) <= 350.0
            and 1e-150 < spot < 1e150):
        return PLAIN, 0.0
    log_spot = math.log(spot)
    top = log_spot + n * max(log_up, 0.0)
    bottom = log_spot + n * min(log_down, 0.0)
    if not (top <= NODE_LOG_LIMIT and bottom >= -NODE_LOG_LIMIT):
        return CLAMPED, 0.0
    if spread <= NODE_LOG_LIMIT and n * abs(log_down) <= NODE_LOG_LIMIT:
        return PLAIN, 0.0
    # level_base's exponents are ln S0 + t ln d + shift, ratio's i ln(u/d) - shift: the largest
    # magnitude among them is max(rising + shift, falling - shift), least at the shift below
    rising = max(log_spot, log_spot + n * log_down, 0.0)
    falling = max(spread, -log_spot, -(log_spot + n * log_down))
    if 0.5 * (rising + falling) <= NODE_LOG_LIMIT:
        return CENTRED, 0.5 * (falling - rising)
    return CLAMPED, 0.0


@njit(cache=True, parallel=True)
def table_kinds(spot, log_up, log_down, steps):
    """node_tables' kind of every option (int8), on numba's threads (every GPU engine call
    classifies all of its lattices: docs/decisions.md)."""
    out = np.empty(spot.size, dtype=np.int8)
    for k in prange(spot.size):
        out[k] = node_tables(spot[k], log_up[k], log_down[k], steps[k])[0]
    return out


@njit(cache=True, nogil=True)
def table_scratch_size(steps):
    """Length of the `scratch` argument of power_tables_into for `steps`."""
    return 2 * (int(math.sqrt(steps + 1)) + 1)


@njit(cache=True, nogil=True, _nrt=False)
def power_tables_into(spot, log_up, log_down, steps, level_base, ratio, scratch):
    """level_base[t] = S0*d^t (price of node (t, 0)); ratio[i] = (u/d)^i, for t, i <= steps: a
    PLAIN lattice's tables; a CENTRED one's carry its shift (node_tables), the products the same.
    (A CLAMPED lattice's entries are those of an unclamped range, and some inf or 0: its prices
    come from clamped_tables.)

    Each entry is the product of two exponentials, scale*exp(start*rate) * exp(j*rate), start a
    multiple of a block, so within a few ulp (plus the rounding of the argument, |t*log_down| ulp).
    Mostly in vector code, blocks of 8 (exp_table, measured faster than a C library exp per entry:
    docs/decisions.md); where an argument would pass EXP_TABLE_MAX_ARGUMENT (N in the
    millions at high volatility) through the C library, blocks of ~sqrt(steps), about
    4*sqrt(steps) calls to exp, the small factors in `scratch` (table_scratch_size(steps) long)."""
    count = steps + 1
    rate_base, rate_ratio = log_down, log_up - log_down
    kind, shift = node_tables(spot, log_up, log_down, steps)
    if kind == PLAIN and steps * max(abs(rate_base), abs(rate_ratio)) <= EXP_TABLE_MAX_ARGUMENT:
        exp_table(level_base, count, rate_base, spot)
        exp_table(ratio, count, rate_ratio, 1.0)
        return
    block = int(math.sqrt(count)) + 1
    for j in range(block):
        scratch[j] = math.exp(j * rate_base)
        scratch[block + j] = math.exp(j * rate_ratio)
    log_spot = math.log(spot) if kind == CENTRED else 0.0
    for start in range(0, count, block):
        if kind == CENTRED:   # ln S0 inside the exponent: S0 alone may be beyond e^shift's reach
            big_base = math.exp(log_spot + start * rate_base + shift)
            big_ratio = math.exp(start * rate_ratio - shift)
        else:
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
def clamp_block(log_down, t_to):
    """The lowest level of the block of a CLAMPED lattice whose top level is t_to: level_base stays
    within e^{+-CLAMP_SLACK} over it (t_to - t_from levels of |ln d| each, centred)."""
    levels = int(2.0 * CLAMP_SLACK / max(abs(log_down), 1e-300))
    return max(t_to - max(levels, 1), 0)


@njit(cache=True, nogil=True, _nrt=False)
def clamped_tables(spot, log_up, log_down, t_from, t_to, level_base, ratio):
    """A CLAMPED lattice's tables for levels t_from..t_to (level_base[t_from..t_to] and
    ratio[0..t_to]): level_base[t] = e^{ln S0 + t ln d + shift}, shift centring them on e^0 (within
    e^{+-CLAMP_SLACK} by clamp_block), and ratio[i] = e^{clip(i ln(u/d) - shift, +-NODE_LOG_LIMIT)},
    non-decreasing: node prices within e^{+-(NODE_LOG_LIMIT - CLAMP_SLACK)} exact, the others
    clamped into FP64's normal range. One exp per entry (these lattices are rare and wide)."""
    rate_ratio = log_up - log_down
    log_spot = math.log(spot)
    shift = -(log_spot + 0.5 * (t_from + t_to) * log_down)
    for t in range(t_from, t_to + 1):
        level_base[t] = math.exp(log_spot + t * log_down + shift)
    for i in range(t_to + 1):
        exponent = i * rate_ratio - shift
        ratio[i] = math.exp(min(max(exponent, -NODE_LOG_LIMIT), NODE_LOG_LIMIT))


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
    if steps * max(log_up - log_down, abs(log_down)) > NODE_LOG_LIMIT:
        return 0.0   # the bound's eta holds for PLAIN tables only (node_tables; a CLAMPED
                     # lattice is priced without a limit, options._price_clamped)
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
