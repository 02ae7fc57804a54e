"""Chunks, checkpoints and resume (`--checkpoint DIR`, `--resume`).

Every run prices the portfolio in chunks: consecutive rows cut where the lattice nodes reach
CHUNK_NODES or the rows CHUNK_ROWS, a grid that depends only on the input's steps. With a
checkpoint, each rank writes every chunk it finishes to DIR/chunk-NNNNNNNN.npy (float64 rows of
price and Greeks) through a temporary file and a rename, so a file there is always whole. DIR also
holds manifest.json: the input's SHA-256 and the settings that change the numbers (tree, backend,
greeks, richardson, the chunk grid) with their hash; a resume with another input or other settings
is refused by name. `--resume` prices only the chunks whose files are missing (or unreadable); the
prices of a chunk do not depend on which rank or run priced it, so the result is bitwise the one an
uninterrupted run writes. DIR must be visible to every rank (rank 0 reads the chunks back).
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np

from pricer.errors import InputError
from pricer.files import atomic_write
from pricer.model.cost import lattice_nodes

FORMAT = "pricer.checkpoint/1"
MANIFEST = "manifest.json"
CHUNK_NODES = 2**28   # seconds of one CPU rank's work: the granularity of aborts and of resumes
CHUNK_ROWS = 2**17    # bounds the per-chunk working arrays for portfolios of small N
GPU_CHUNK_NODES = 2**40   # the GPU backends: ~1e12 nodes, seconds of one GPU's work (chunk_shape)
GPU_CHUNK_ROWS = 2**21


def chunk_grid(steps: np.ndarray, nodes: float = CHUNK_NODES, rows: int = CHUNK_ROWS) -> np.ndarray:
    """Row boundaries [0, ..., n] of the chunks: a new chunk starts where the nodes before a row
    reach another multiple of `nodes`, or its row number another multiple of `rows`."""
    n = len(steps)
    before = np.concatenate(([0.0], np.cumsum(lattice_nodes(steps))[:-1]))
    label = np.maximum(before // nodes, np.arange(n) // rows)
    cuts = np.flatnonzero(np.diff(label)) + 1
    return np.concatenate(([0], cuts, [n])).astype(np.int64)


def split_chunks(costs: np.ndarray, parts: int) -> np.ndarray:
    """Chunk boundaries [0, ..., len(costs)] of `parts` contiguous runs of near-equal total cost."""
    total = np.concatenate(([0.0], np.cumsum(costs)))
    targets = total[-1] * np.arange(1, parts) / parts
    inner = np.searchsorted(total, targets, side="left")
    return np.concatenate(([0], np.clip(inner, 0, len(costs)), [len(costs)])).astype(np.int64)


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


class Checkpoint:
    """The checkpoint folder of one run (rank 0 opens it; every rank saves its chunks)."""

    def __init__(self, folder: str):
        self.folder = folder

    def path(self, chunk: int) -> str:
        return os.path.join(self.folder, f"chunk-{chunk:08d}.npy")

    def open(self, input_sha256: str, settings: dict, resume: bool) -> None:
        """Rank 0, before any work: start a new checkpoint, or check that the one to resume was
        made from this input with these settings."""
        manifest = os.path.join(self.folder, MANIFEST)
        want = {"format": FORMAT, "input_sha256": input_sha256, "settings": settings,
                "settings_sha256": settings_hash(settings)}
        if resume:
            self._check(manifest, want)
            return
        if os.path.exists(manifest):
            raise InputError(f"{self.folder}: holds a checkpoint already; pass --resume to continue "
                             f"it, or give an empty folder")
        if os.path.isdir(self.folder) and os.listdir(self.folder):
            raise InputError(f"{self.folder}: the checkpoint folder is not empty")
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{self.folder}: cannot create the checkpoint folder: {exc}") from None
        atomic_write(manifest, json.dumps(want, indent=1, sort_keys=True).encode(), fsync=True)

    def _check(self, manifest: str, want: dict) -> None:
        try:
            with open(manifest) as f:
                have = json.load(f)
        except FileNotFoundError:
            raise InputError(f"{self.folder}: no checkpoint to resume (no {MANIFEST})") from None
        except (OSError, ValueError) as exc:
            raise InputError(f"{self.folder}: unreadable {MANIFEST}: {exc}") from None
        if have.get("format") != FORMAT:
            raise InputError(f"{self.folder}: {MANIFEST} format {have.get('format')!r}, "
                             f"expected {FORMAT!r}")
        if have.get("input_sha256") != want["input_sha256"]:
            raise InputError(f"{self.folder}: the checkpoint is of a different input: input hash "
                             f"{have.get('input_sha256')} there, {want['input_sha256']} now")
        if have.get("settings_sha256") != want["settings_sha256"]:
            old = have.get("settings") or {}
            diff = ", ".join(f"{key} {old.get(key)!r} there, {value!r} now"
                             for key, value in want["settings"].items() if old.get(key) != value)
            raise InputError(f"{self.folder}: the checkpoint was made with different settings: "
                             f"settings hash {have.get('settings_sha256')} there, "
                             f"{want['settings_sha256']} now ({diff})")

    def done(self, grid: np.ndarray, outputs: int) -> np.ndarray:
        """Which chunks have a whole file of the right shape (the others are priced again)."""
        return np.array([self._valid(j, int(grid[j + 1] - grid[j]), outputs)
                         for j in range(len(grid) - 1)], dtype=bool)

    def _valid(self, chunk: int, rows: int, outputs: int) -> bool:
        try:
            data = np.load(self.path(chunk), mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return False
        return data.dtype == np.float64 and data.shape == (rows, outputs)

    def save(self, chunk: int, values: np.ndarray) -> None:
        """Any rank: this chunk's rows, atomically (temp file, fsync, rename)."""
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(values, dtype=np.float64), allow_pickle=False)
        atomic_write(self.path(chunk), buffer.getvalue(), fsync=True)

    def load(self, chunk: int) -> np.ndarray:
        return np.load(self.path(chunk), allow_pickle=False)
