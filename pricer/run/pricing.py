"""One chunk of a book priced, the step a run's ranks (driver.compute) and pricer.price share; and
a whole checked book priced in one process, chunk by chunk as a run cuts it (pricer.price,
pricer warm). An implied-volatility run (pricer.model.implied) takes its chunks' options through
one pool of searches instead (solve_chunks)."""

from __future__ import annotations

import numpy as np

from pricer.run.chunks import chunk_grid
from pricer.io.portfolio import MATRIX_COLUMNS, columns_from_matrix
from pricer.model.cost import lattice_nodes
from pricer.model.greeks import SCENARIO, SCENARIOS, Analytics, prepare_lattices, price_prepared
from pricer.model.validity import PRICED


def prepare_chunk(matrix: np.ndarray, priced: np.ndarray, a: int, b: int, tree: str,
                  ids: np.ndarray, analytics: Analytics):
    """The host's side of rows a:b of the portfolio matrix that `priced` marks (all of them,
    unless --invalid skip skipped some): (rows, PreparedLattices), or None where none is priced."""
    picked = priced[a:b]
    if not picked.any():
        return None
    # every row priced (no --invalid skip, or none skipped here): a slice, not a copy of the rows
    rows = slice(a, b) if picked.all() else np.flatnonzero(picked) + a
    return rows, prepare_lattices(columns_from_matrix(matrix[rows]), tree, ids[rows], analytics)


def price_chunk(engine, prepared, values: np.ndarray) -> None:
    """A chunk's prepare_chunk priced by `engine`: its rows' outputs (Analytics.outputs, in that
    order) written into the same rows of `values`. The others are left as they are."""
    if prepared is None:
        return
    rows, lattices = prepared
    analytics = lattices.analytics
    outputs = price_prepared(engine, lattices)
    for j, name in enumerate(analytics.outputs):
        if not name.startswith(SCENARIO):
            values[rows, j] = outputs[name]
    if SCENARIOS in outputs:        # one block: the scenarios' columns follow the named outputs
        first = analytics.outputs.index(f"{SCENARIO}0")
        values[rows, first:first + outputs[SCENARIOS].shape[1]] = outputs[SCENARIOS]


def run_chunks(engine, matrix: np.ndarray, priced: np.ndarray, chunks: list, tree: str,
               ids: np.ndarray, analytics: Analytics, values: np.ndarray):
    """Rows chunks[k] = (a, b, ...) of the portfolio matrix computed into `values` (price_chunk's
    contract; an implied-volatility run's outputs, then each row's status in its last column):
    yields each k once its rows are done, in the order they finish. Pricing, each chunk's host
    side (prepare_chunk: checks, lattice parameters) is done on a thread while the engine prices
    the chunk before (its GPU, or its cores, then busy)."""
    if analytics.implied:
        yield from solve_chunks(engine, matrix, priced, chunks, tree, values)
        return
    if not chunks:
        return
    from concurrent.futures import ThreadPoolExecutor

    def prepared(k: int):
        a, b, *_ = chunks[k]
        return prepare_chunk(matrix, priced, a, b, tree, ids, analytics)

    ahead = ThreadPoolExecutor(max_workers=1)
    try:
        following = ahead.submit(prepared, 0)
        for k in range(len(chunks)):
            chunk = following.result()
            if k + 1 < len(chunks):
                following = ahead.submit(prepared, k + 1)
            price_chunk(engine, chunk, values)
            yield k
    finally:     # a run that stops (a failure, a fault) reports it without waiting for the next
        ahead.shutdown(wait=False, cancel_futures=True)


def solve_chunks(engine, matrix: np.ndarray, priced: np.ndarray, chunks: list, tree: str,
                 values: np.ndarray):
    """The implied volatilities of the `priced` rows of `chunks` (contiguous, in order), through
    one pool of searches as large as the largest chunk (in rows and in lattice nodes): the next
    chunk's options take the places of those that finish. A chunk is yielded once all of its rows
    are, its values written: OUTPUTS, then the status (CONVERGED or why not) in the last column."""
    from pricer.model.implied import OUTPUTS
    from pricer.model.implied_pool import Solver

    if not chunks:
        return
    first, last = chunks[0][0], chunks[-1][1]
    rows = np.flatnonzero(priced[first:last]) + first
    steps = matrix[:, MATRIX_COLUMNS.index("steps")]
    pool_rows = max(b - a for a, b, *_ in chunks)
    pool_nodes = max(float(lattice_nodes(steps[a:b]).sum()) for a, b, *_ in chunks)
    every = rows.size == last - first          # no row skipped: a view, not a copy
    cols = columns_from_matrix(matrix[first:last] if every else matrix[rows])
    solver = Solver(engine, cols, cols["market_price"], tree, cols["volatility"], pool_rows,
                    pool_nodes)
    ends = np.array([b for _, b, *_ in chunks])
    starts = np.searchsorted(rows, [a for a, *_ in chunks])    # each chunk's first of `rows`
    yielded = 0

    def finished_chunks(count: int) -> int:   # the first `count` of `rows` are finished
        if count >= rows.size:
            return len(chunks)
        return int(np.searchsorted(ends, rows[count], side="right"))

    def store(k: int) -> int:
        lo = starts[k]
        hi = starts[k + 1] if k + 1 < len(chunks) else rows.size
        mine = rows[lo:hi]
        results = solver.results(lo, hi)
        for j, name in enumerate(OUTPUTS):
            values[mine, j] = results[name]
        values[mine, -1] = results["status"]
        return k

    for count in solver.rounds():
        ready = finished_chunks(count)
        for k in range(yielded, ready):
            yield store(k)
        yielded = max(yielded, ready)
    for k in range(yielded, len(chunks)):   # the chunks left: their rows settled by the bounds
        yield store(k)


def price_checked(engine, cfg, checked, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A checked book's (checks.checked_matrix) (n, outputs) values (cfg.outputs(); NaN where
    --invalid skip skipped a row) and each row's status (0: priced, or solved), by `engine` in
    this process, in the chunks a run would cut (chunk_grid bounds the working arrays)."""
    matrix = checked.matrix
    status = checked.status if checked.status is not None \
        else np.zeros(len(matrix), dtype=np.int8)
    analytics = cfg.analytics()
    priced = status == PRICED
    steps = matrix[:, MATRIX_COLUMNS.index("steps")].astype(np.int64)   # 0 where skipped
    if priced.any():
        engine.prepare(steps[priced], levels=cfg.greeks)
    outputs = cfg.outputs()
    values = np.full((len(matrix), len(outputs)), np.nan)
    if "status" in outputs:
        values[:, -1] = status
    cuts = chunk_grid(steps, *cfg.chunk_shape())
    chunks = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    for _ in run_chunks(engine, matrix, priced, chunks, cfg.tree, ids, analytics, values):
        pass
    return values, values[:, -1].astype(np.int8) if analytics.implied else status
