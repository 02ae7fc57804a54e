"""The `batch` backend's schedule on one rank: which rows go to the GPU together (chunks), and
which kernel class prices which option of a chunk in which launch. numpy and numba (no GPU), so it
is tested on any machine.

Kernel classes (cuda/batch.cu): W warps per option (1 option per warp for W = 1, else one block of
W warps per option), G register groups of 32 lanes x VT = 4 nodes per warp; capacity 128 * W * G
nodes, which hold options with steps <= capacity (at steps = capacity the payoff's top node is fed
in as the first step's neighbour: N = 1 024, 2 048, 4 096 stay in the classes whose G = 8 holds
them, measured faster than the next W's G = 5: docs/decisions.md). Work follows the
lattice's triangle (idle groups are skipped), so a class is chosen for its registers, not its
work: the smallest W whose largest G holds the option, then the smallest G (fewer registers, more
warps per SM). W = 1 keeps the whole lattice in one warp (no barrier); W > 1 meets once per
step. Classes with W > 1 and G <= 4 are never chosen (the next smaller W holds those options) and
are left out.

A chunk of one class (a uniform book) is one launch, or, for W = 2, 4 and 8, two where its last
wave would leave most of the GPU idle: those options then take twice the warps each
(split_last_wave). Before that, a chunk sorted on the host whose options all fit one wave of the
same W at the G of its widest payoff (width_keys: the kernels never compute the zero units above
the last positive payoff) is priced so, in one launch (one_wave_by_width). A launch that holds its
whole chunk in one wave, with several blocks on each SM and some American options, runs its rows
heaviest first (heaviest_first: the GPU orders them by an estimate of their work), so that the SMs'
shares even out.

A call's rows go to the GPU in one chunk, as they are (input layout below), with `order`: the rows
sorted by steps, descending (Pawlak & Oancea (2019)), so classes come largest first and within a
class the largest lattices start first (a launch's tail is short). Each class is one launch over a run of
`order`; the kernel reads row order[k] and writes its price at that row, so prices come back in the
order given (no gather or scatter on the host). A call of more than `chunk_options` rows (device
memory) goes in chunks of that many consecutive rows, each sorted on its own. Chunks smaller than
the call to overlap the host's work with the kernels were measured and not kept
(docs/decisions.md): a chunk's largest options then start only after the previous chunk's, and
on skewed books those set the launch's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.gpu.batch_layout import MAX_STEPS, NODES_PER_LANE, WIDTH_MARGIN

WARPS = (1, 2, 4, 8, 16)
MAX_GROUPS = 8
CLASSES = tuple((w, g) for w in WARPS for g in range(1, MAX_GROUPS + 1)
                if w == 1 or g > MAX_GROUPS // 2)
# every kernel a launch may use: the classes, then those left out of them, which price only the
# last partial wave of a one-launch chunk (split_last_wave); indices into CLASSES stay the same
KERNELS = CLASSES + tuple((w, g) for w in WARPS[1:] for g in range(1, MAX_GROUPS // 2 + 1))
_KERNEL_OF = {shape: k for k, shape in enumerate(KERNELS)}     # (W, G) -> index into KERNELS
CAPACITY = np.array([32 * NODES_PER_LANE * w * g for w, g in CLASSES], dtype=np.int64)
assert MAX_STEPS == int(CAPACITY[-1]) - 1   # the layout's bound is the largest class's
DEFAULT_CHUNK_OPTIONS = 1 << 20    # 1M options: 66 MB of input and prices on the device per chunk


# class of every steps value 0..MAX_STEPS (a table lookup: cheaper than searchsorted on large
# chunks)
_CLASS_OF_STEPS = np.searchsorted(CAPACITY, np.arange(MAX_STEPS + 1)).astype(np.int8)


def options_per_block(warps: int) -> int:
    return 4 if warps == 1 else 1


def _check_range(least: int, most: int) -> None:
    if least < 1 or most > MAX_STEPS:
        raise ValueError(f"batch classes hold 1 <= steps <= {MAX_STEPS}")


def check_steps(steps: np.ndarray) -> None:
    """ValueError unless every option's steps lie in the classes (1 .. MAX_STEPS)."""
    if steps.size:
        _check_range(steps.min(), steps.max())


def class_of(steps: np.ndarray) -> np.ndarray:
    """Index into CLASSES of the kernel class for each option (steps <= MAX_STEPS)."""
    steps = np.asarray(steps)
    check_steps(steps)
    return _CLASS_OF_STEPS[steps]


@dataclass(frozen=True)
class Launch:
    cls: int        # index into KERNELS (a class's index into CLASSES is the same)
    lo: int         # positions [lo, hi) of the chunk's sorted order
    hi: int

    @property
    def warps(self) -> int:
        return KERNELS[self.cls][0]

    @property
    def groups(self) -> int:
        return KERNELS[self.cls][1]


def chunk_size(options: int, chunk_options: int = DEFAULT_CHUNK_OPTIONS) -> int:
    """Rows per chunk of a call of `options` rows (the runner's buffers hold this many)."""
    if chunk_options < 1:
        raise ValueError("chunk_options must be >= 1")
    return max(1, min(chunk_options, options))


def chunk_bounds(options: int, chunk_options: int = DEFAULT_CHUNK_OPTIONS) -> list:
    """[(lo, hi)] of the chunks of a call of `options` rows, in order."""
    size = chunk_size(options, chunk_options)
    return [(lo, min(lo + size, options)) for lo in range(0, options, size)]


def split_last_wave(launch: Launch, key_at, resident) -> tuple:
    """A launch over a chunk's rows sorted by key (key_at(p): the key at sorted position p), as
    it runs best when nothing runs beside it. The GPU holds resident(cls) of a class's options
    at once; past the first wave, a last wave of at most half of that would leave most of the
    GPU idle, so its options (the smallest, at the end of the sorted order) go to twice the
    warps per option and finish sooner (measured on the U1 book: docs/decisions.md). Only for
    W = 2, 4, 8: W = 16 has no wider kernel, and W = 1's tails (a few hundred of the U2 book's
    options) are too short to gain (measured slightly slower)."""
    warps = launch.warps
    held = int(resident(launch.cls)) if 1 < warps < WARPS[-1] else 0
    count = launch.hi - launch.lo
    tail = count % held if held > 0 else 0
    if count <= held or tail == 0 or tail > held // 2:
        return (launch,)
    wide = 2 * warps
    tail_steps = int(key_at(launch.hi - tail))               # the tail's largest
    groups = -(-tail_steps // (32 * NODES_PER_LANE * wide))
    tail_cls = _KERNEL_OF[wide, groups]
    split = launch.hi - tail
    return (Launch(launch.cls, launch.lo, split), Launch(tail_cls, split, launch.hi))


def schedule(steps: np.ndarray, order_out: np.ndarray, resident=None, max_width=None) -> tuple:
    """The chunk's rows sorted by steps, descending and stable, into order_out (int32, as many as
    steps); returns its launches, one per class, largest class first. With `resident` (options
    of kernel cls the GPU holds at once, a function of cls), a chunk of one class that the GPU
    holds in one wave at the G of its largest payoff width (max_width(), called only then) is
    priced so (one_wave_by_width), else has its last partial wave split off
    (split_last_wave); chunks of several classes run their launches side by side, which fill
    each other's tails."""
    launches = _launches(steps, order_out)
    if resident is None or len(launches) != 1:
        return launches
    if max_width is not None:
        narrowed = one_wave_by_width(launches[0], max_width, resident)
        if narrowed is not None:
            return narrowed
    return split_last_wave(launches[0], lambda k: steps[order_out[k]], resident)


def one_wave_by_width(launch: Launch, max_width, resident) -> tuple | None:
    """A one-class launch of W >= 2 that the GPU holds in more than one wave, as one launch of
    the same W at the G of the largest payoff width among its options (max_width():
    width_keys' largest; the kernels leave the zero units above it out, so fewer registers hold
    them, and more options fit at once), if the GPU holds that in one wave; else None. One wave
    at the narrower G measured faster than the wider G with its last wave split off (the U1
    book: docs/decisions.md). max_width() is a pass over every row on the host, on the call's
    critical path, so it is asked only where a narrower G could hold the launch; W = 1's
    partial waves gained nothing (kernels as long either way)."""
    count = launch.hi - launch.lo
    held = resident(launch.cls)
    warps = launch.warps
    if warps == 1 or held <= 0 or count <= held:
        return None
    widest_held = next((g for g in range(launch.groups - 1, 0, -1)
                        if resident(_KERNEL_OF[warps, g]) >= count), 0)
    if not widest_held:
        return None
    groups = max(1, -(-int(max_width()) // (32 * NODES_PER_LANE * warps)))
    if groups > widest_held:
        return None
    return (Launch(_KERNEL_OF[warps, groups], launch.lo, launch.hi),)


# rows a chunk may have for its order to be made by work (cuda/batch.cu, batch_work_order: a
# 4-byte estimate per row in a block's shared memory, at most 48 KiB)
WORK_ORDER_ROWS = 12288
# A one-wave launch runs heaviest first where it fills the GPU: at least this share of the
# options the GPU holds at once, and at least this many blocks per SM. An SM that is nearly full
# finishes when the sum of its blocks' work is done, which the order evens out; one with room
# finishes with its heaviest block, whatever the order. Measured (docs/decisions.md): a nearly
# full launch of several blocks per SM gained; launches well short of full gained nothing and
# paid for the ordering.
WORK_ORDER_FILL = 0.9
WORK_ORDER_BLOCKS_PER_SM = 4


def heaviest_first(launches: tuple, rows: int, resident, sms: int, american: np.ndarray) -> bool:
    """Whether a chunk of `rows` rows with these launches runs them heaviest first (the GPU
    orders them by an estimate of their work, cuda/batch.cu's batch_work_order): where one
    launch prices them all in one wave that fills the GPU (WORK_ORDER_FILL of what it holds at
    once, WORK_ORDER_BLOCKS_PER_SM blocks on each of its `sms` SMs), so that each SM's share of
    the work evens out, and some are American (`american`, the rows' flags: European options'
    work varies too little to gain)."""
    if len(launches) != 1 or not 0 < rows <= WORK_ORDER_ROWS or sms <= 0:
        return False
    launch = launches[0]
    held = resident(launch.cls)
    blocks = -(-rows // options_per_block(launch.warps))
    return (launch.lo == 0 and launch.hi == rows and WORK_ORDER_FILL * held <= rows <= held
            and blocks >= WORK_ORDER_BLOCKS_PER_SM * sms and bool(american.any()))


def _launches(steps: np.ndarray, order_out: np.ndarray) -> tuple:
    least, most = _steps_range(steps)
    _check_range(least, most)
    if least == most:                   # one N (U books): already sorted, one launch
        _row_order(order_out)
        return (Launch(int(_CLASS_OF_STEPS[most]), 0, steps.size),) if steps.size else ()
    # a counting sort over [least, most]: linear, and its counts give the classes' runs
    greater = _sort_by_steps_descending(steps, order_out, least, most)
    at = np.minimum(CAPACITY, MAX_STEPS)
    return _class_runs(np.where(at < least, steps.size, greater[np.clip(at, least, most) - least]),
                       steps.size)


@njit(cache=True, nogil=True)
def _steps_range(steps):
    """(least, most) of the steps, (1, 1) for none: one pass, where numpy's min and max take two
    calls, each with its own overhead (a small chunk's schedule is on the call's critical path)."""
    if steps.size == 0:
        return 1, 1
    least = most = steps[0]
    for s in steps:
        least, most = min(least, s), max(most, s)
    return int(least), int(most)


@njit(cache=True, nogil=True)
def _row_order(order_out):
    for k in range(order_out.size):
        order_out[k] = k


def _class_runs(above: np.ndarray, rows: int) -> tuple:
    """One launch per class of the rows sorted by key, descending (each class is then one run),
    largest class first: above[c] rows lie above class c."""
    below_or_at = np.r_[rows, above[:-1]]
    return tuple(Launch(c, int(above[c]), int(below_or_at[c]))
                 for c in range(len(CLASSES) - 1, -1, -1) if below_or_at[c] > above[c])




def counted_schedule(counts: np.ndarray, resident=None) -> tuple:
    """The launches of a chunk whose rows the GPU sorted by key, descending (cuda/batch.cu,
    batch_sort_rows), from its rows per key (counts[k], k < KEY_BINS): the same launches as
    schedule() gives for those keys."""
    at_least = np.cumsum(counts[::-1])[::-1]          # at_least[k]: rows with a key >= k
    rows = int(at_least[0])
    if rows == 0:
        return ()
    keys = np.flatnonzero(counts)
    _check_range(int(keys[0]), int(keys[-1]))
    greater = np.r_[at_least[1:], 0]                  # rows with a key > k
    launches = _class_runs(greater[np.minimum(CAPACITY, MAX_STEPS)], rows)
    if resident is None or len(launches) != 1:
        return launches
    # the key at sorted position p: the largest k with more than p rows at or above it
    return split_last_wave(launches[0], lambda p: np.count_nonzero(at_least > p) - 1, resident)


@njit(cache=True, nogil=True)
def _width_key(log_moneyness, log_up, log_down, steps, call, american):
    """One row's payoff width (width_keys), from log(strike / spot)."""
    up, down = (log_down, log_up) if call else (log_up, log_down)         # calls mirrored
    sign = 1.0 if call else -1.0
    n = float(steps)
    eta = 2.0 ** -52 * (n * abs(down) + 2.0 * n * abs(up - down) + 16.0)
    refused = american and not -sign * down < -(2.0 ** -20 + 64.0 * eta)
    x = (log_moneyness - n * down) / (up - down)
    width = np.ceil(min(max(x, -1.0), n)) + WIDTH_MARGIN
    return n if refused else max(1.0, min(width, n))


@njit(cache=True, nogil=True)
def width_keys(floats, steps, call, american, keys_out):
    """Each row's payoff width: on the mirrored lattice, the nodes of the last level with a
    positive payoff and WIDTH_MARGIN more, at most the steps; the steps where the kernel refuses
    the zero clamp (clamps). For American rows these are cuda/batch.cu's batch_width_keys; the GPU
    keys European rows by their steps, and a class too narrow for a row prices it as NaN, which
    the runner prices again by its steps. floats, steps, call and american as in InputViews."""
    for r in range(steps.size):
        keys_out[r] = int(_width_key(np.log(floats[1, r] / floats[0, r]), floats[2, r],
                                     floats[3, r], steps[r], call[r], american[r]))
    return keys_out


def widest_payoff(floats, steps, call, american) -> int:
    """The largest of width_keys (1 for no rows), with no array of keys. numpy takes the logs
    (its vectorised log measured faster than numba's scalar loop)."""
    log_moneyness = np.divide(floats[1], floats[0])
    np.log(log_moneyness, out=log_moneyness)
    return _widest_key(log_moneyness, floats, steps, call, american)


@njit(cache=True, nogil=True)
def _widest_key(log_moneyness, floats, steps, call, american):
    widest = 1.0
    for r in range(steps.size):
        widest = max(widest, _width_key(log_moneyness[r], floats[2, r], floats[3, r], steps[r],
                                        call[r], american[r]))
    return int(widest)


@njit(cache=True, nogil=True)
def _sort_by_steps_descending(steps, order_out, least, most):
    """Rows sorted by steps (least <= steps <= most), descending and stable, into order_out;
    returns greater[s - least], how many rows have more than s steps (least <= s <= most). A
    counting sort is linear: numpy's argsort, take and searchsorted cost more than this pass on
    large chunks. Counts over [least, most] only,
    not over every steps value up to MAX_STEPS whatever the rows."""
    greater = np.zeros(most - least + 1, dtype=np.int64)
    for r in range(steps.size):
        if steps[r] > least:                  # counted at s = steps - 1, summed downwards below
            greater[steps[r] - 1 - least] += 1
    for k in range(most - least - 1, -1, -1):
        greater[k] += greater[k + 1]
    # rows with steps = s go to positions greater[s] ... greater[s - 1] - 1, in row order
    next_at = greater.copy()
    for r in range(steps.size):
        k = steps[r] - least
        order_out[next_at[k]] = r
        next_at[k] += 1
    return greater


# Chunks of at least this many rows are keyed and sorted on the GPU, American options by their
# payoffs' widths (cuda/batch.cu, batch_width_keys; counted_schedule), the rest by their steps;
# smaller chunks are sorted on the host by their steps (schedule). A chunk of a few waves lasts as
# long as its longest option, which fewer warps per option lengthen, and the keys' round trip is
# a fixed cost that only large chunks repay (measured on the U1 and U2 books: docs/decisions.md).
# Keys from the host for small chunks were measured and not kept (docs/decisions.md).
WIDTH_ROWS = 16384
