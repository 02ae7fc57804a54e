"""The `batch` backend's schedule on one rank: which kernel class prices which option, in which
launch of which chunk. Pure numpy (no GPU), so it is tested on any machine.

Kernel classes (cuda/batch.cu): W warps per option (1 option per warp for W = 1, else one block of
W warps per option), G register groups of 32 lanes x VT = 4 nodes per warp; capacity 128 * W * G
nodes, i.e. options with steps + 1 <= capacity. Work follows the lattice's triangle (idle groups
are skipped), so a class is chosen for its registers, not its work: the smallest W whose largest G
holds the option, then the smallest G (fewer registers, more warps per SM). W = 1 keeps the whole
lattice in one warp (no barrier); W > 1 meets once per step. Classes with W > 1 and G <= 4 are
never chosen (the next smaller W holds those options) and are left out.

The schedule (seed 003's ideas): options sorted by steps, descending, so classes come largest
first and within a class the largest lattices start first (a launch's tail is short); the sorted list is cut into
chunks of at most `chunk_options` options, which move to the GPU and back while the neighbouring
chunk computes; each chunk runs one launch per class it contains. Prices come back in the sorted
order and are put back in input order with `order`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NODES_PER_LANE = 4                 # VT in cuda/batch.cu
WARPS = (1, 2, 4, 8, 16)
MAX_GROUPS = 8
CLASSES = tuple((w, g) for w in WARPS for g in range(1, MAX_GROUPS + 1)
                if w == 1 or g > MAX_GROUPS // 2)
CAPACITY = np.array([32 * NODES_PER_LANE * w * g for w, g in CLASSES], dtype=np.int64)
MAX_STEPS = int(CAPACITY[-1]) - 1  # wider options go through `hybrid`
ROW_FIELDS = ("spot", "strike", "log_up", "log_down", "pu", "pd", "steps", "flags")
CALL_FLAG, AMERICAN_FLAG = 1, 2
DEFAULT_CHUNK_OPTIONS = 1 << 20    # 1M options: 72 MB of rows and prices on the device per chunk


def options_per_block(warps: int) -> int:
    return 4 if warps == 1 else 1


def class_of(steps: np.ndarray) -> np.ndarray:
    """Index into CLASSES of the kernel class for each option (steps <= MAX_STEPS)."""
    steps = np.asarray(steps, dtype=np.int64)
    if steps.size and (steps.min() < 1 or steps.max() > MAX_STEPS):
        raise ValueError(f"batch classes hold 1 <= steps <= {MAX_STEPS}")
    return np.searchsorted(CAPACITY, steps + 1)


@dataclass(frozen=True)
class Launch:
    cls: int        # index into CLASSES
    lo: int         # options [lo, hi) of the chunk, in sorted order
    hi: int

    @property
    def warps(self) -> int:
        return CLASSES[self.cls][0]

    @property
    def groups(self) -> int:
        return CLASSES[self.cls][1]


@dataclass(frozen=True)
class Chunk:
    lo: int         # options [lo, hi) of the sorted list
    hi: int
    launches: tuple = field(default=())   # Launch offsets are relative to lo

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Plan:
    order: np.ndarray          # sorted position -> index into the options given
    classes: np.ndarray        # class of each option in sorted order
    chunks: tuple

    def restore(self, sorted_prices: np.ndarray) -> np.ndarray:
        """Prices in the order the options were given."""
        out = np.empty_like(sorted_prices)
        out[self.order] = sorted_prices
        return out


def plan(steps: np.ndarray, chunk_options: int = DEFAULT_CHUNK_OPTIONS) -> Plan:
    if chunk_options < 1:
        raise ValueError("chunk_options must be >= 1")
    steps = np.asarray(steps, dtype=np.int64)
    classes = class_of(steps)
    # steps <= MAX_STEPS < 2**15: a stable sort of int16 keys is a radix sort (linear time)
    order = np.argsort((MAX_STEPS - steps).astype(np.int16), kind="stable")
    sorted_classes = classes[order]
    chunks = []
    for lo in range(0, steps.size, chunk_options):
        hi = min(lo + chunk_options, steps.size)
        part = sorted_classes[lo:hi]
        starts = np.flatnonzero(np.r_[True, part[1:] != part[:-1]])
        ends = np.r_[starts[1:], part.size]
        chunks.append(Chunk(lo, hi, tuple(Launch(int(part[a]), int(a), int(b))
                                          for a, b in zip(starts, ends))))
    return Plan(order=order, classes=sorted_classes, chunks=tuple(chunks))


def fill_columns(params, index: np.ndarray, columns: np.ndarray) -> None:
    """columns[:, k] = the kernel's 8 numbers of option index[k] (columns: (8, len(index)) float64,
    C-contiguous: ROW_FIELDS, the flags as CALL_FLAG + AMERICAN_FLAG). Column by column, each a
    contiguous gather: numpy, not numba, since the batch path calls no other numba code and numba's
    first call in a process (0.15-0.35 s to load its compiler and cache) fell on every rank's
    start-up; rows of 8 (one strided write per field) took 3x as long on the H200's host."""
    index = np.asarray(index, dtype=np.int64)
    for k, name in enumerate(ROW_FIELDS[:6]):
        np.take(getattr(params, name), index, out=columns[k])
    columns[6] = params.steps[index]
    np.copyto(columns[7], np.where(params.call[index], CALL_FLAG, 0.0))
    columns[7] += np.where(params.american[index], AMERICAN_FLAG, 0.0)
