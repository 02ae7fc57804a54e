"""The pool of implied-volatility searches (implied.py's Search): options enter it in order as
others finish, and take their rounds in groups, one engine call a group a round, each group's
lattice parameters built on a thread while the engine prices another's (Solver.rounds). An
option's answer depends on its own rounds only (implied.py's module doc)."""

from __future__ import annotations

import contextlib
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.model.implied import CONVERGED, Search, bounds_status, european_start
from pricer.model.lattice import lattice_parameters_where
from pricer.threads import threads_for


class Solver:
    """The implied volatilities of the options in `cols` (Portfolio.columns', tree codes in
    "tree") at market prices `market`, priced by `engine` on `tree`. `guess`: a start per option
    (NaN: none, the European implied volatility is taken). Options enter a pool of at most
    `pool_rows` options and `pool_nodes` lattice nodes (each of its groups, Solver.rounds, takes
    one option at least), in order, as others leave it.
    rounds() runs the search; results() is its outcome."""

    def __init__(self, engine, cols: dict, market: np.ndarray, tree: str,
                 guess: np.ndarray | None = None, pool_rows: int | None = None,
                 pool_nodes: float | None = None):
        from pricer.model.cost import lattice_nodes

        market = np.asarray(market, dtype=np.float64)
        # the columns a lattice needs, one contiguous row each (a round gathers its options'
        # from them in parallel: _take); the volatility is the search's
        self.table = np.stack([np.asarray(cols.get(name, np.full(market.shape, -1)), np.float64)
                               for name in TABLE])
        cols = {name: self.table[j] for j, name in enumerate(TABLE)}
        self.engine, self.cols, self.tree = engine, cols, tree
        status = bounds_status(cols, market)
        start = european_start(cols, market)
        if guess is not None:
            start = np.where(np.isfinite(guess) & (guess > 0.0), guess, start)
        self.search = Search(cols, market, start)
        self.search.status[status != CONVERGED] = status[status != CONVERGED]
        self.pool_rows = market.shape[0] if pool_rows is None else max(1, int(pool_rows))
        self.pool_nodes = math.inf if pool_nodes is None else float(pool_nodes)
        self.nodes = lattice_nodes(cols["steps"])

    def rounds(self):
        """Round after round until every search has ended: after each round of a group, yields
        how many of the first options are finished (every one before the first still searching).

        The pool is cut into at most GROUPS groups of at least GROUP_ROWS options, which take
        their rounds in turn without waiting for each other: a group's lattice parameters are
        built on a thread of the pool while the others' are priced, and its engine call is
        started (Engine.start) before the group ahead of it is finished and stepped, so that the
        host's work runs on several cores and beside the engine's (numpy and numba let the GIL
        go; a GPU engine prices while the host steps). After its step, a group's finished
        options make room for the next of the queue, in order."""
        search, nodes = self.search, self.nodes
        queue = np.flatnonzero(search.status < 0)       # in order
        n = search.status.shape[0]
        count = max(1, min(GROUPS, self.pool_rows // GROUP_ROWS))
        # the pool's rows shared out (together pool_rows), its nodes alike
        rows_each = [self.pool_rows // count + (g < self.pool_rows % count) for g in range(count)]
        nodes_each = self.pool_nodes / count
        groups = [np.empty(0, dtype=np.int64)] * count
        head = 0

        def refill(g: int) -> None:     # the queue's next options while the group has room
            nonlocal head
            active = groups[g]
            if head < queue.size and active.size < rows_each[g]:
                take = queue[head:head + rows_each[g] - active.size]
                room = nodes_each - float(nodes[active].sum())
                more = int(np.searchsorted(np.cumsum(nodes[take]), room, side="right"))
                more = max(more, 0 if active.size else 1)    # one option at least
                groups[g] = np.concatenate([active, take[:more]])
                head += more

        def finished() -> int:
            waiting = [int(queue[head])] if head < queue.size else []
            waiting += [int(active.min()) for active in groups if active.size]
            return min(waiting) if waiting else n

        # no more threads than the rank's share of the cores (driver.configure_threads); one
        # group builds its lattices itself (nothing to overlap them with)
        pool = (ThreadPoolExecutor(max_workers=min(count, numba.get_num_threads()))
                if count > 1 else None)

        def build(g: int):    # a future of the group's lattice parameters
            if pool is not None:
                return pool.submit(self._lattices, groups[g])
            return _Built(self._lattices(groups[g]))

        # beside a GPU the host's passes over a group (the step, the batch runner's fill) are
        # light: numba's threads on this thread capped by the group's rows for the whole search
        # (pricer/threads.py; resized from call to call, the team cost more than it saved); not
        # where the engine may price a call on the CPU (auto, Engine.sizes_by_call)
        beside = getattr(self.engine, "uses_gpu", False) and not self.engine.sizes_by_call
        try:
            with threads_for(rows_each[0]) if beside else contextlib.nullcontext():
                built, turns = {}, deque()
                for g in range(count):
                    refill(g)
                    if groups[g].size:
                        built[g] = build(g)
                        turns.append(g)
                ahead = None
                while turns or ahead is not None:
                    started = None
                    if turns:
                        g = turns.popleft()
                        started = (g, groups[g], *self._start(*built.pop(g).result()))
                    if ahead is not None:
                        g, rows, exists, call = ahead
                        self._step(rows, exists, call)
                        groups[g] = rows[search.status[rows] < 0]
                        refill(g)
                        if groups[g].size:
                            built[g] = build(g)
                            turns.append(g)
                        yield finished()
                    ahead = started
        finally:    # a search that stops (a failure, a fault) does not wait for the builds
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _lattices(self, rows: np.ndarray):
        """lattice_parameters_where of options `rows` at their x."""
        part = self.part(rows)
        part["volatility"] = self.search.x[rows]
        return lattice_parameters_where(part, self.tree)

    def _start(self, params, exists: np.ndarray) -> tuple:
        return exists, (self.engine.start(params) if exists.any() else None)

    def _step(self, rows: np.ndarray, exists: np.ndarray, started) -> None:
        values = np.full(rows.size, np.nan)
        if started is not None:
            values[exists] = self.engine.finish(started)
        self.search.step(rows, values, exists)

    def part(self, rows: np.ndarray) -> dict:
        """The columns of options `rows`, typed as Portfolio.columns types them."""
        table = _take(self.table, rows)
        part = {name: table[j] for j, name in enumerate(TABLE)}
        for name, kind in (("steps", np.int64), ("tree", np.int64), ("call", np.bool_),
                           ("american", np.bool_)):
            part[name] = part[name].astype(kind)
        return part

    def results(self, lo: int = 0, hi: int | None = None) -> dict:
        """Of options lo:hi (default all): implied_volatility (NaN where there is none), price
        (the lattice price at it), iterations (lattices priced), status (CONVERGED or a reason,
        REASONS)."""
        search, part = self.search, slice(lo, hi)
        status = search.status[part]
        return dict(implied_volatility=np.where(status == CONVERGED, search.x[part], np.nan),
                    price=search.price[part], iterations=search.rounds[part].astype(np.float64),
                    status=status)


class _Built:
    """Lattice parameters built in the caller's thread, read as a future's."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def solve(engine, cols: dict, market: np.ndarray, tree: str, guess: np.ndarray | None = None,
          pool_rows: int | None = None, pool_nodes: float | None = None) -> dict:
    """Solver's results, searched to the end."""
    solver = Solver(engine, cols, market, tree, guess, pool_rows, pool_nodes)
    for _ in solver.rounds():
        pass
    return solver.results()


GROUPS, GROUP_ROWS = 4, 1 << 16   # a pool of many options takes its rounds in groups

TABLE = ("spot", "strike", "maturity", "rate", "dividend", "steps", "call", "american", "tree")


@numba.njit(nogil=True, cache=True)
def _take(table, rows):
    """table[:, rows] (serial: it runs on the threads of Solver.rounds, and numba's default
    threading layer takes parallel kernels from one thread at a time)."""
    out = np.empty((table.shape[0], rows.shape[0]))
    for k in range(rows.shape[0]):
        for j in range(table.shape[0]):
            out[j, k] = table[j, rows[k]]
    return out
