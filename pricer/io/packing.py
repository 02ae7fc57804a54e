"""Columns packed into rows: the (n, k) float64 matrix a run sends its ranks (Portfolio.to_matrix).

NumPy writes a column into a row-major matrix element by element at the row's stride, converting
as it goes; the compiled loop here writes each row once, in order (a 2M-option book: 18 ms, where
NumPy's blocked column writes took 35 ms on one core). The values are NumPy's: every column is
first made float64 by NumPy (bool 0/1, int64 rounded to nearest, as an assignment converts), and
the loop only moves them. Imported by to_matrix when it is first called (numba's import is not
every command's).
"""

from __future__ import annotations

import numba
import numpy as np

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)


BLOCK_ROWS = 1 << 16     # rows converted at a time: the float64 copies stay small (and in cache)


def pack_rows(columns: list) -> np.ndarray:
    """The (n, len(columns)) C-contiguous float64 matrix whose column j is columns[j] (1-D, n
    values each, any real or bool dtype)."""
    arrays = [np.asarray(column) for column in columns]
    n = arrays[0].shape[0] if arrays else 0
    if any(column.shape != (n,) for column in arrays):    # the loop reads n values of each
        raise ValueError(f"columns of shapes {[c.shape for c in arrays]}: one length is needed")
    out = np.empty((n, len(arrays)))
    for a in range(0, n, BLOCK_ROWS):
        b = min(n, a + BLOCK_ROWS)
        # one array type for every column (the kernel's tuple is indexed by j): float64, C order,
        # writeable (np.array copies; a float64 column's block is copied too, ~1 % of the work)
        _pack(tuple(np.array(column[a:b], dtype=np.float64) for column in arrays), out[a:b])
    return out


@numba.njit(cache=True, nogil=True)
def _pack(columns, out):
    for i in range(out.shape[0]):
        for j in range(len(columns)):
            out[i, j] = columns[j][i]
