"""The memory guard: before any work, rank 0 estimates the host memory each rank needs for this
portfolio and refuses a run that would not fit in the node's available memory, with the numbers.

The estimate (bytes; n options, k outputs per option, R ranks, N the largest steps):
- rank 0: the columns as read (2x: h5py's arrays and their converted copies, ~66 B per option, more
  with a tree column), the 10-double matrix that travels to the ranks, the gathered (n, k) result
  and its copy in the file write, plus its own slice;
- every rank: its slice of the matrix and of the results (the whole matrix with --distribute bcast),
  plus one chunk's working set: ~30 float64 arrays per lattice priced (5 per option with --greeks,
  +1 with --richardson) and the engine's 4 arrays of N + 1 doubles per thread.
Pricing streams through chunks (pricer/checkpoint.py), so a rank's working set does not grow with
the portfolio beyond these per-option arrays. GPU backends also stream chunk by chunk; their
device memory is not checked here (docs/reliability.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pricer.errors import InputError

COLUMN_BYTES = 8 * 8 + 2      # id, spot, strike, maturity, rate, dividend, volatility, steps, 2 flags
TREE_BYTES = 64               # a tree name as read (object + str) and its code
MATRIX_BYTES = 10 * 8         # one row of the matrix that travels to the ranks
CHUNK_ARRAY_BYTES = 30 * 8    # lattice parameters and engine inputs of one lattice
ENGINE_BYTES_PER_STEP = 4 * 8
GIB = float(1 << 30)


@dataclass
class Estimate:
    root: float      # bytes on rank 0
    other: float     # bytes on each other rank
    available: float
    node_ranks: int

    def fits(self) -> bool:
        return self.root + (self.node_ranks - 1) * self.other <= self.available


def available_bytes(environ=os.environ) -> float:
    """PRICER_MEMORY_LIMIT (bytes, or with a K/M/G suffix) if set, else the kernel's MemAvailable."""
    limit = environ.get("PRICER_MEMORY_LIMIT", "").strip().upper()
    if limit:
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(limit[-1], 1)
        return float(limit.rstrip("KMG")) * scale
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def estimate(n: int, outputs: int, ranks: int, node_ranks: int, chunk_rows: int, max_steps: int,
             lattices: int, threads: int, tree: bool, bcast: bool) -> Estimate:
    share = -(-n // ranks)
    working = (chunk_rows * lattices * CHUNK_ARRAY_BYTES
               + threads * ENGINE_BYTES_PER_STEP * (max_steps + 1))
    matrix = (n if bcast else share) * MATRIX_BYTES
    other = matrix + share * outputs * 8 + working
    root = (n * (2 * COLUMN_BYTES + (TREE_BYTES if tree else 0) + MATRIX_BYTES + 2 * outputs * 8)
            + other)
    return Estimate(root=float(root), other=float(other), available=available_bytes(),
                    node_ranks=node_ranks)


def check(est: Estimate, what: str) -> None:
    """Refuse, naming the numbers, a run whose estimate exceeds the node's available memory."""
    if est.fits():
        return
    raise InputError(
        f"{what}: not enough memory: this run needs an estimated {est.root / GIB:.2f} GiB on rank 0 "
        f"and {est.other / GIB:.2f} GiB on each other rank, {(est.root + (est.node_ranks - 1) * est.other) / GIB:.2f} GiB "
        f"for the {est.node_ranks} rank(s) on rank 0's node, which has {est.available / GIB:.2f} GiB "
        f"available; use more nodes, fewer ranks per node, or split the portfolio")
