"""One chunk of a book priced, the step a run's ranks (driver.compute) and pricer.price share; and
a whole checked book priced in one process, chunk by chunk as a run cuts it (pricer.price,
pricer warm)."""

from __future__ import annotations

import numpy as np

from pricer.io.checkpoint import chunk_grid
from pricer.io.portfolio import MATRIX_COLUMNS, columns_from_matrix
from pricer.model.greeks import Analytics, price_with_analytics
from pricer.model.validity import PRICED


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


def price_checked(engine, cfg, checked, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A checked book's (checks.checked_matrix) (n, outputs) values (cfg.analytics().outputs; NaN
    where --invalid skip skipped a row) and each row's status (0: priced), by `engine` in this
    process, in the chunks a run would cut (chunk_grid bounds the working arrays)."""
    matrix = checked.matrix
    status = checked.status if checked.status is not None \
        else np.zeros(len(matrix), dtype=np.int8)
    analytics = cfg.analytics()
    priced = status == PRICED
    steps = matrix[:, MATRIX_COLUMNS.index("steps")].astype(np.int64)   # 0 where skipped
    if priced.any():
        engine.prepare(steps[priced], levels=cfg.greeks)
    values = np.full((len(matrix), len(analytics.outputs)), np.nan)
    cuts = chunk_grid(steps, *cfg.chunk_shape())
    for a, b in zip(cuts[:-1], cuts[1:]):
        price_chunk(engine, matrix, priced, a, b, cfg.tree, ids, analytics, values)
    return values, status
