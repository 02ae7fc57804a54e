"""The batch kernels' contract with Python, written once: the input layout of a chunk and the
constants cuda/batch.cu is compiled with (defines(): -D options, so the two cannot drift; the .cu
refuses to compile without them).

A chunk of n rows is one byte buffer: the lattice numbers column by column (FLOAT_FIELDS, column k
of row r at double k n + r; LatticeParams.packed's first rows, in this order), then n int32 steps,
n int32 `order` (the chunk's rows sorted by class key, descending), n bytes call, n bytes american.
Each column starts at its *_AT offset times n (input_views). Out: a float64 price per row, and with
levels LEVEL_VALUES float64 per row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.engines.cpu.kernels import node_tables
from pricer.model.lattice import FLOAT_ROWS, LEVEL_VALUES, PLAIN, LatticeParams

NODES_PER_LANE = 4                 # VT: consecutive nodes a lane holds per register group
WARPS = 16                         # the most warps per option (the widest kernel family)
MAX_GROUPS = 8                     # register groups of the largest class
MAX_STEPS = 32 * NODES_PER_LANE * WARPS * MAX_GROUPS - 1   # wider options go to the regimes
KEY_BINS = MAX_STEPS + 1           # the GPU's counting sort: rows counted per key 0 .. MAX_STEPS
WIDTH_MARGIN = 2                   # nodes kept above an option's last positive payoff (width keys)
SORT_THREADS = 1024                # batch_key_starts: one block of this many
SORT_BLOCK = 256                   # batch_width_keys, batch_sort_rows: threads a block, one row each
WORK_ORDER_THREADS = 1024          # batch_work_order: threads per block,
WORK_RANK_LANES = 8                # and threads that rank one row together

FLOAT_FIELDS = ("spot", "strike", "log_up", "log_down", "pu", "pd")
FLOAT_BYTES_PER_OPTION = 8 * len(FLOAT_FIELDS)
SPOT, LOG_UP, LOG_DOWN = FLOAT_ROWS["spot"], FLOAT_ROWS["log_up"], FLOAT_ROWS["log_down"]
STEPS_AT = FLOAT_BYTES_PER_OPTION          # byte offsets per row of the chunk
ORDER_AT = STEPS_AT + 4
CALL_AT = ORDER_AT + 4
AMERICAN_AT = CALL_AT + 1
INPUT_BYTES_PER_OPTION = AMERICAN_AT + 1


def defines() -> list[str]:
    """The -D options of cuda/batch.cu that state this contract."""
    fields = [f"-DIN_{name.upper()}={k}" for k, name in enumerate(FLOAT_FIELDS)]
    return [f"-DVT={NODES_PER_LANE}", *fields, f"-DIN_STEPS_AT={STEPS_AT}",
            f"-DIN_ORDER_AT={ORDER_AT}", f"-DIN_CALL_AT={CALL_AT}",
            f"-DIN_AMERICAN_AT={AMERICAN_AT}", f"-DSORT_THREADS={SORT_THREADS}",
            f"-DWORK_ORDER_THREADS={WORK_ORDER_THREADS}", f"-DWORK_RANK_LANES={WORK_RANK_LANES}",
            f"-DWIDTH_MARGIN={WIDTH_MARGIN}"]


def batch_row_bytes(levels: bool) -> int:
    """Device bytes of one row in one buffer set of the runner: its input, its class key (int32),
    its price, and with levels (Greeks) its first levels' values."""
    return INPUT_BYTES_PER_OPTION + 4 + 8 * (1 + (LEVEL_VALUES if levels else 0))


class InputViews(NamedTuple):
    floats: np.ndarray      # (6, n) float64: FLOAT_FIELDS
    steps: np.ndarray       # (n,) int32
    order: np.ndarray       # (n,) int32: rows of the chunk sorted by class key, descending
    call: np.ndarray        # (n,) bool
    american: np.ndarray    # (n,) bool


def order_span(n: int) -> tuple[int, int]:
    """Bytes [lo, hi) of the sorted order in the input of n rows (input_views): the runner sends
    the rest first, and the order once it is sorted."""
    return ORDER_AT * n, CALL_AT * n


def input_views(buffer: np.ndarray, n: int) -> InputViews:
    """The kernel's input for n rows as views into `buffer` (uint8, >= n * INPUT_BYTES_PER_OPTION)."""
    return InputViews(floats=buffer[:STEPS_AT * n].view(np.float64).reshape(len(FLOAT_FIELDS), n),
                      steps=buffer[STEPS_AT * n:ORDER_AT * n].view(np.int32),
                      order=buffer[ORDER_AT * n:CALL_AT * n].view(np.int32),
                      call=buffer[CALL_AT * n:AMERICAN_AT * n].view(np.bool_),
                      american=buffer[AMERICAN_AT * n:INPUT_BYTES_PER_OPTION * n].view(np.bool_))


def _put(dst: np.ndarray, src: np.ndarray, rows) -> None:
    """dst = src[rows] (a slice: a plain copy; an index array: a gather), cast to dst's type."""
    np.copyto(dst, src[rows] if isinstance(rows, slice) else np.take(src, rows), casting="unsafe")


def fill_floats(params, rows, views: InputViews) -> None:
    """The lattice numbers of `rows` of params: the input's float columns. A run of rows is one
    block of LatticeParams.packed (its first rows are these fields, in this order): one copy, on
    one thread (threads would make the slowest calls wait for them)."""
    if isinstance(rows, slice) and rows.step in (None, 1):
        lo, hi, _ = rows.indices(len(params))
        np.copyto(views.floats[:, :hi - lo], params.packed[:len(FLOAT_FIELDS), lo:hi])
        return
    for k, name in enumerate(FLOAT_FIELDS):
        _put(views.floats[k], getattr(params, name), rows)


def fill_flags(params, rows, views: InputViews) -> None:
    """The steps and the two flags of `rows` of params."""
    _put(views.steps, params.steps, rows)
    _put(views.call, params.call, rows)
    _put(views.american, params.american, rows)


def fill_input(params, rows, buffer: np.ndarray, views: InputViews) -> None:
    """fill_floats and fill_flags: the kernel's input for `rows` of params, all but the order,
    into `buffer` (views: input_views of it). `params` is a LatticeParams, or a SharedNumbers
    (pricer.model.scenarios: lattices read from shared numbers, their spots multiplied here). A
    run of rows is one numba pass over LatticeParams.packed (or over the shared numbers)."""
    run = isinstance(rows, slice) and rows.step in (None, 1)
    if not isinstance(params, LatticeParams):
        if run:
            lo, hi, _ = rows.indices(len(params))
            numbers = params.numbers
            _fill_shared_run(numbers.packed, numbers.steps, numbers.call, numbers.american,
                             params.spot, params.factors, params.sets, lo, hi, views.floats,
                             views.steps, views.call, views.american)
            return
        params, rows, run = params.take(rows), slice(0, len(rows)), True
    if run:
        lo, hi, _ = rows.indices(len(params))
        _fill_run(params.packed, params.steps, params.call, params.american, lo, hi,
                  views.floats, views.steps, views.call, views.american)
        return
    fill_floats(params, rows, views)
    fill_flags(params, rows, views)


@njit(cache=True, nogil=True, parallel=True)
def _fill_run(packed, steps_in, call_in, american_in, lo, hi, floats, steps, call, american):
    """Rows lo..hi - 1 of a LatticeParams (packed, and its steps and flags) into the input's views
    (input_views). On numba's threads: at short lattices the GPU prices a row faster than one
    thread copies it (docs/decisions.md)."""
    for r in prange(hi - lo):
        for k in range(len(FLOAT_FIELDS)):
            floats[k, r] = packed[k, lo + r]
        steps[r] = steps_in[lo + r]
        call[r] = call_in[lo + r]
        american[r] = american_in[lo + r]


@njit(cache=True, nogil=True, parallel=True)
def _fill_shared_run(packed, steps_in, call_in, american_in, spot, factors, sets, lo, hi, floats,
                     steps, call, american):
    """Lattices lo..hi - 1 of a SharedNumbers into the input's views (input_views), as _fill_run
    would write them from the lattices written out: lattice k m + i (m options) is row
    sets[k] m + i of its numbers (packed, and their steps and flags), its spot
    spot[i] * factors[k]. On numba's threads, as _fill_run."""
    m = spot.size
    for r in prange(hi - lo):
        k, i = divmod(lo + r, m)
        row = sets[k] * m + i
        for f in range(len(FLOAT_FIELDS)):
            floats[f, r] = packed[f, row]
        floats[SPOT, r] = spot[i] * factors[k]
        steps[r] = steps_in[row]
        call[r] = call_in[row]
        american[r] = american_in[row]


def shared_all_plain(shared) -> bool:
    """Whether every lattice of a SharedNumbers has PLAIN node tables (cpu/kernels.node_tables),
    the only ones the batch kernels build. A lattice's numbers fixed, its tables are PLAIN for
    the spots of one interval of ln S0 (node_tables: the spread and n |ln d| within
    NODE_LOG_LIMIT, and ln S0 between -NODE_LOG_LIMIT - n min(ln d, 0) and
    NODE_LOG_LIMIT - n max(ln u, 0); its first test's spots lie inside that interval), and a
    scenario's spot, S0 times its factor, grows with the factor: each set of numbers is checked
    at the least and the greatest spot factor of its scenarios only."""
    count = int(shared.sets.max()) + 1
    low, high = np.full(count, np.inf), np.full(count, -np.inf)
    np.minimum.at(low, shared.sets, shared.factors)
    np.maximum.at(high, shared.sets, shared.factors)
    numbers = shared.numbers
    return _all_plain(numbers.log_up, numbers.log_down, numbers.steps, shared.spot, low, high)


@njit(cache=True, parallel=True)
def _all_plain(log_up, log_down, steps, spot, low, high) -> bool:
    """Whether row s m + i of the numbers (m options) has PLAIN tables at spots spot[i] low[s]
    and spot[i] high[s], for every set s."""
    m = spot.size
    bad = 0
    for s in prange(low.size):
        for i in range(m):
            row = s * m + i
            for factor in (low[s], high[s]):
                if node_tables(spot[i] * factor, log_up[row], log_down[row],
                               steps[row])[0] != PLAIN:
                    bad += 1
    return bad == 0
