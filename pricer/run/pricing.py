"""The lattice method of the option book: one chunk of a book's columns priced, the step a run's
ranks (option_family.py) and pricer.price share; and a whole checked book priced in one process,
chunk by chunk as a run cuts it (pricer.price, pricer warm). The method takes the options' own
columns (checks.CheckedRows) and folds them into lattice numbers itself
(greeks.prepare_lattices, a chunk at a time). An implied-volatility run (pricer.model.implied)
takes its chunks' options through one pool of searches instead (solve_chunks)."""

from __future__ import annotations

import numpy as np

from pricer.run.chunks import chunk_grid
from pricer.model.cost import lattice_nodes
from pricer.model.greeks import SCENARIO, SCENARIOS, Analytics, prepare_lattices, price_prepared
from pricer.model.validity import PRICED


def prepare_chunk(cols: dict, priced: np.ndarray, a: int, b: int, tree: str,
                  ids: np.ndarray, analytics: Analytics):
    """The host's side of rows a:b of the columns `cols` that `priced` marks (all of them,
    unless --invalid skip skipped some): (rows, PreparedLattices), or None where none is priced."""
    picked = priced[a:b]
    if not picked.any():
        return None
    # every row priced (no --invalid skip, or none skipped here): views, not copies of the rows
    rows = slice(a, b) if picked.all() else np.flatnonzero(picked) + a
    return rows, prepare_lattices({name: column[rows] for name, column in cols.items()}, tree,
                                  ids[rows], analytics)


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


def run_chunks(engine, cols: dict, priced: np.ndarray, chunks: list, tree: str,
               ids: np.ndarray, analytics: Analytics, values: np.ndarray):
    """Rows chunks[k] = (a, b, ...) of the columns `cols` computed into `values` (price_chunk's
    contract; an implied-volatility run's outputs, then each row's status in its last column):
    yields each k once its rows are done, in the order they finish. Pricing, each chunk's host
    side (prepare_chunk: checks, lattice parameters) is done on a thread while the engine prices
    the chunk before (its GPU, or its cores, then busy)."""
    if analytics.implied:
        yield from solve_chunks(engine, cols, priced, chunks, tree, values)
        return
    if not chunks:
        return
    from concurrent.futures import ThreadPoolExecutor

    def prepared(k: int):
        a, b, *_ = chunks[k]
        return prepare_chunk(cols, priced, a, b, tree, ids, analytics)

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


def solve_chunks(engine, cols: dict, priced: np.ndarray, chunks: list, tree: str,
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
    steps = cols["steps"]
    pool_rows = max(b - a for a, b, *_ in chunks)
    pool_nodes = max(float(lattice_nodes(steps[a:b]).sum()) for a, b, *_ in chunks)
    every = rows.size == last - first          # no row skipped: views, not copies
    mine = {name: column[first:last] if every else column[rows] for name, column in cols.items()}
    solver = Solver(engine, mine, mine["market_price"], tree, mine["volatility"], pool_rows,
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
    """A checked book's (checks.checked_rows) (n, outputs) values (cfg.outputs(); NaN where
    --invalid skip skipped a row) and each row's status (0: priced, or solved), by `engine` in
    this process, in the chunks a run would cut (chunk_grid bounds the working arrays)."""
    cols = checked.cols
    steps = cols["steps"]           # 0 where skipped
    status = checked.status if checked.status is not None \
        else np.zeros(len(steps), dtype=np.int8)
    analytics = cfg.analytics()
    priced = status == PRICED
    if priced.any():
        engine.prepare(steps[priced], levels=cfg.greeks)
    outputs = cfg.outputs()
    values = np.full((len(steps), len(outputs)), np.nan)
    if "status" in outputs:
        values[:, -1] = status
    cuts = chunk_grid(steps, *cfg.chunk_shape())
    chunks = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    for _ in run_chunks(engine, cols, priced, chunks, cfg.tree, ids, analytics, values):
        pass
    return values, values[:, -1].astype(np.int8) if analytics.implied else status
