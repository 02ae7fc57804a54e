"""One chunk of a book priced: the step a run's ranks (driver.compute) and pricer.price share."""

from __future__ import annotations

import numpy as np

from pricer.io.portfolio import columns_from_matrix
from pricer.model.greeks import Analytics, price_with_analytics


def price_chunk(engine, matrix: np.ndarray, priced: np.ndarray, a: int, b: int, tree: str,
                ids: np.ndarray, analytics: Analytics, values: np.ndarray) -> None:
    """Rows a:b of the portfolio matrix that `priced` marks (all of them, unless --invalid skip
    skipped some), priced by `engine`; their outputs (Analytics.outputs, in that order) written
    into the same rows of `values`. The others are left as they are."""
    picked = priced[a:b]
    if not picked.any():
        return
    # every row priced (no --invalid skip, or none skipped here): a slice, not a copy of the rows
    rows = slice(a, b) if picked.all() else np.flatnonzero(picked) + a
    outputs = price_with_analytics(engine, columns_from_matrix(matrix[rows]), tree, ids[rows],
                                   analytics)
    for j, name in enumerate(analytics.outputs):
        values[rows, j] = outputs[name]
