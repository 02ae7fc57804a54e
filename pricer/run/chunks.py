"""The chunks of a run: consecutive rows cut where the lattice nodes reach CHUNK_NODES or the rows
CHUNK_ROWS (the GPU backends: GPU_CHUNK_NODES, GPU_CHUNK_ROWS; RunConfig.chunk_shape), a grid that
depends only on the input's steps, so that a chunk is the same in every run of a book (the unit of
progress, of an abort, of a checkpoint's file and of a resume: pricer/io/checkpoint.py); and the
split of a list of chunks over the ranks by cost.
"""

from __future__ import annotations

import numpy as np

from pricer.model.cost import lattice_nodes

CHUNK_NODES = 2**28   # seconds of one CPU rank's work: the granularity of aborts and of resumes
CHUNK_ROWS = 2**17    # bounds the per-chunk working arrays for portfolios of small N
GPU_CHUNK_NODES = 2**40   # the GPU backends: ~1e12 nodes, seconds of one GPU's work (chunk_shape)
GPU_CHUNK_ROWS = 2**21


def chunk_grid(steps: np.ndarray, nodes: float = CHUNK_NODES, rows: int = CHUNK_ROWS,
               prefix: np.ndarray | None = None) -> np.ndarray:
    """Row boundaries [0, ..., n] of the chunks: a new chunk starts where the nodes before a row
    reach another multiple of `nodes`, or its row number another multiple of `rows`. `prefix`:
    the rows' lattice nodes' prefix sums [0, n0, n0 + n1, ...], where the caller has them.

    A row's label is max(nodes before it // nodes, row // rows), and a chunk starts where the
    label grows, which only a row where either part grows can do: those rows alone are judged.
    The first row at or past each multiple of `nodes` is found by bisection: the nodes before a
    row are whole numbers that grow by at least 1 a row (a lattice has at least one node), so the
    rounding of the multiple and of the division put it at most one row off, and the rows beside
    it are judged too."""
    n = len(steps)
    if n == 0:
        return np.zeros(2, dtype=np.int64)
    if prefix is not None:
        before = prefix[:-1]
    else:
        before = np.empty(n)
        before[0] = 0.0
        np.cumsum(lattice_nodes(steps[:-1]), out=before[1:])
    count = int(before[-1] // nodes)
    if count <= n:
        near = np.searchsorted(before, np.arange(1, count + 1) * nodes)
        grown = np.concatenate((near - 1, near, near + 1))
    else:        # more multiples than rows (tiny chunks): every row where the division grows
        by_nodes = before // nodes
        grown = np.flatnonzero(by_nodes[1:] != by_nodes[:-1]) + 1
    candidates = _sorted_unique(np.concatenate((grown, np.arange(rows, n, rows, dtype=np.int64))))
    candidates = candidates[(candidates >= 1) & (candidates < n)]
    label = np.maximum(before[candidates] // nodes, candidates // rows)
    previous = np.maximum(before[candidates - 1] // nodes, (candidates - 1) // rows)
    cuts = candidates[label != previous]
    return np.concatenate(([0], cuts, [n])).astype(np.int64)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of integers by a sort (NumPy 2's np.unique hashes them first: 20x slower on the
    ~3 candidates per chunk of a large book)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if values.size else values


def split_chunks(costs: np.ndarray, parts: int) -> np.ndarray:
    """Chunk boundaries [0, ..., len(costs)] of `parts` contiguous runs of near-equal total cost."""
    total = np.concatenate(([0.0], np.cumsum(costs)))
    targets = total[-1] * np.arange(1, parts) / parts
    inner = np.searchsorted(total, targets, side="left")
    return np.concatenate(([0], np.clip(inner, 0, len(costs)), [len(costs)])).astype(np.int64)
