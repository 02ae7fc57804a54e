"""numba's threads for light parallel passes over rows: a pass of ~100 ns a row (an implied-vol
search's step, the batch runner's input fill) gains nothing from a thread with fewer than
ROWS_PER_THREAD rows, and a team as large as a big host's cores costs more to start and spins
longer than such a pass lasts, beside the threads that work next to it (docs/decisions.md). Set
once for a run of such passes: a team resized from pass to pass costs more than it saves."""

from __future__ import annotations

from contextlib import contextmanager

import numba

ROWS_PER_THREAD = 1 << 14


@contextmanager
def threads_for(rows: int):
    """numba's threads on this thread, for the block, at most one per ROWS_PER_THREAD rows (one
    at least, and no more than were set)."""
    before = numba.get_num_threads()
    numba.set_num_threads(max(1, min(before, int(rows) // ROWS_PER_THREAD)))
    try:
        yield
    finally:
        numba.set_num_threads(before)
