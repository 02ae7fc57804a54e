"""Chunks and checkpoints (`--checkpoint DIR`).

Every run prices the portfolio in chunks (pricer/run/chunks.py: a grid that depends only on the
input's steps). With a checkpoint, each rank writes every chunk it finishes to DIR/chunk-NNNNNNNN.bin (float64 rows of
price and Greeks, with a checksum bound to the run: Checkpoint) through a temporary file and a
rename. DIR also holds manifest.json: the input's SHA-256 and the settings that change the numbers
(tree, backend, greeks, richardson, the chunk grid) with their hash. The same command serves the
first run and every restart: a DIR that holds this run's checkpoint is continued (only the chunks
without a file that passes its checks are priced), an empty or new DIR starts one, and a DIR that
holds another input's or other settings' checkpoint is refused by name. The prices of a chunk do
not depend on which rank or run priced it, so the result is bitwise the one an uninterrupted run
writes. DIR must be visible to every rank (rank 0 reads the chunks back).

Every entry of DIR is read as an input is: the manifest and the run's chunk names must be regular
files (a link, FIFO, device, socket or directory there is no file a run wrote: the run is refused,
naming it, before anything is opened, followed or replaced), opened without following a link or
waiting for a writer, and read no further than what a whole one holds (MANIFEST_BYTES; a chunk's
header and the rows the grid gives it): a larger file fails its checks unread.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat

import numpy as np

from pricer.errors import InputError, OutputError
from pricer.files import _kind, atomic_write

FORMAT = "pricer.checkpoint/2"
MANIFEST = "manifest.json"
MANIFEST_BYTES = 1 << 20    # a manifest's size at most (the settings' few hundred bytes)
HEADER_BYTES = 1024         # a chunk file's first line at most (its JSON header: ~250 bytes)


class NotAnEntry(OSError):
    """A checkpoint entry that is not a regular file, or larger than a whole one."""


def read_entry(path: str, limit: int) -> bytes:
    """The bytes of the checkpoint entry `path`, a regular file of at most `limit` bytes, read as
    an input is: opened without following a link (O_NOFOLLOW) or waiting for a FIFO's writer
    (O_NONBLOCK), judged by what was opened (fstat), never more than `limit` + 1 bytes read.
    NotAnEntry where it is no such file, OSError where it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAnEntry(f"{path}: is {_kind(info.st_mode)}")
        if info.st_size > limit:
            raise NotAnEntry(f"{path}: holds {info.st_size} bytes, more than {limit}")
        data = f.read(limit + 1)
    if len(data) > limit:         # it grew while it was read
        raise NotAnEntry(f"{path}: holds more than {limit} bytes")
    return data


def entry_kind(path: str) -> str | None:
    """What `path` is where it is not a regular file (not followed if it is a link): "a symbolic
    link (to T)", "a FIFO (named pipe)", "a directory", ...; None for a regular file or none."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    return _kind(mode)


def checkpoint_bytes(options: int, outputs: int, chunks: int) -> float:
    """A whole checkpoint's size: the values, a header line per chunk, the manifest."""
    return options * 8 * outputs + 512.0 * chunks + 4096


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


class Checkpoint:
    """The checkpoint folder of one run: rank 0 opens it (open), every rank that saves chunks
    attaches to it (attach), rank 0 reads the chunks back (done, load).

    A chunk file is one line of JSON, then the chunk's values (float64, rows x outputs, C order):
    {"chunk": j, "rows": n, "outputs": k, "run": the run's id, "sha256": digest}, where the run's
    id binds it to the input and the settings (manifest.json) and the digest covers the run's id,
    j, n, k and the values. A file that fails any of it (cut short, bytes flipped, another
    chunk's or another run's file copied over it) is never used: its chunk is priced again."""

    def __init__(self, folder: str):
        self.folder = folder
        self.run = None          # the run's id: the manifest's input and settings hashes

    def path(self, chunk: int) -> str:
        return os.path.join(self.folder, f"chunk-{chunk:08d}.bin")

    def open(self, input_sha256: str, settings: dict) -> bool:
        """Rank 0, before any work: continue the checkpoint DIR holds if it was made from this input
        with these settings (True), or start one in an empty or new DIR (False); InputError for a
        DIR that holds another run's checkpoint (naming the difference) or other files."""
        manifest = os.path.join(self.folder, MANIFEST)
        want = {"format": FORMAT, "input_sha256": input_sha256, "settings": settings,
                "settings_sha256": settings_hash(settings)}
        if os.path.lexists(manifest):
            blob = self._manifest(manifest)
            self._check(blob, want)
            self._remove_leftovers()
            try:   # the chunks still to price must be writable there: rewritten as it is
                atomic_write(manifest, blob, fsync=True)
            except OSError as exc:
                raise InputError(f"{self.folder}: cannot write the checkpoint folder: "
                                 f"{exc.strerror or exc}") from None
            self.run = f"{input_sha256}:{want['settings_sha256']}"
            return True
        if os.path.isdir(self.folder) and os.listdir(self.folder):
            raise InputError(f"{self.folder}: the checkpoint folder is not empty and holds no "
                             f"checkpoint ({MANIFEST}); give an empty or new folder")
        try:
            os.makedirs(self.folder, exist_ok=True)
            atomic_write(manifest, json.dumps(want, indent=1, sort_keys=True).encode(), fsync=True)
        except OSError as exc:
            raise InputError(f"{self.folder}: cannot write the checkpoint folder: "
                             f"{exc.strerror or exc}") from None
        self.run = f"{input_sha256}:{want['settings_sha256']}"
        return False

    def _remove_leftovers(self) -> None:
        """The temporary files of an attempt that was killed while it wrote a chunk (its rank
        died before it could remove them): the folder is claimed by this run alone now."""
        for name in os.listdir(self.folder):
            if name.startswith(".") and ".tmp-" in name and \
                    (name.startswith(".chunk-") or name.startswith(f".{MANIFEST}")):
                try:
                    os.remove(os.path.join(self.folder, name))
                except OSError:
                    pass

    def attach(self) -> "Checkpoint":
        """Any rank, once rank 0 has opened the folder: the run's id, from its manifest."""
        have = json.loads(read_entry(os.path.join(self.folder, MANIFEST), MANIFEST_BYTES))
        self.run = f"{have['input_sha256']}:{have['settings_sha256']}"
        return self

    def _manifest(self, manifest: str) -> bytes:
        """The manifest's bytes, or InputError where it is no regular file of at most
        MANIFEST_BYTES (a FIFO there would never end a read, a link may lead anywhere)."""
        kind = entry_kind(manifest)
        if kind is not None:
            raise InputError(f"{manifest}: is {kind}, not the regular file a run writes; the "
                             f"checkpoint cannot be continued: give an empty or new folder")
        try:
            return read_entry(manifest, MANIFEST_BYTES)
        except OSError as exc:
            raise InputError(f"{self.folder}: unreadable {MANIFEST}: "
                             f"{exc.strerror or exc}") from None

    def _check(self, blob: bytes, want: dict) -> None:
        try:
            have = json.loads(blob)
        except ValueError as exc:
            raise InputError(f"{self.folder}: unreadable {MANIFEST}: {exc}") from None
        if not isinstance(have, dict) or have.get("format") != FORMAT:
            found = have.get("format") if isinstance(have, dict) else None
            raise InputError(f"{self.folder}: holds a checkpoint of format {found!r}, not "
                             f"{FORMAT!r}; give an empty or new folder")
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

    def _digest(self, chunk: int, rows: int, outputs: int, data: bytes) -> str:
        h = hashlib.sha256(f"{self.run}:{chunk}:{rows}:{outputs}:".encode())
        h.update(data)
        return h.hexdigest()

    def save(self, chunk: int, values: np.ndarray) -> None:
        """Any rank: this chunk's rows, atomically (temp file, fsync, rename)."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        rows, outputs = values.shape
        data = values.tobytes()
        header = {"chunk": int(chunk), "rows": int(rows), "outputs": int(outputs), "run": self.run,
                  "sha256": self._digest(chunk, rows, outputs, data)}
        atomic_write(self.path(chunk), json.dumps(header).encode() + b"\n" + data, fsync=True)

    def _read(self, chunk: int, rows: int, outputs: int) -> np.ndarray | None:
        """The chunk's values if its file passes every check, else None; never more read than
        a whole one holds."""
        try:
            blob = read_entry(self.path(chunk), HEADER_BYTES + 8 * rows * outputs)
            line, data = blob.split(b"\n", 1)
            header = json.loads(line)
        except (OSError, ValueError):
            return None
        if not isinstance(header, dict) or len(data) != 8 * rows * outputs:
            return None
        expected = {"chunk": chunk, "rows": rows, "outputs": outputs, "run": self.run,
                    "sha256": self._digest(chunk, rows, outputs, data)}
        if any(header.get(key) != value for key, value in expected.items()):
            return None
        return np.frombuffer(data, dtype=np.float64).reshape(rows, outputs).copy()

    def check_entries(self, chunks: int) -> None:
        """InputError naming the first of the names of the run's `chunks` chunk files that is
        not a regular file (module doc): it is left as it is, never opened or replaced."""
        with os.scandir(self.folder) as entries:
            odd = sorted(entry.name for entry in entries
                         if entry.name.startswith("chunk-") and
                         not entry.is_file(follow_symlinks=False))
        names = {os.path.basename(self.path(j)) for j in range(chunks)} if odd else set()
        for name in odd:
            path = os.path.join(self.folder, name)
            kind = entry_kind(path) if name in names else None
            if kind is not None:
                raise InputError(f"{path}: is {kind}, not a chunk file (a checkpoint holds the "
                                 f"regular files its runs write); remove it, and its chunk is "
                                 f"priced again")

    def done(self, grid: np.ndarray, outputs: int, judge=None) -> tuple[np.ndarray, int]:
        """Which chunks have a file that passes every check, and how many files there fail one
        (their chunks are priced again); `judge(chunk, values)`, if given, sees each whole
        chunk's values as they are read. InputError for an entry that is not a regular file
        (check_entries)."""
        self.check_entries(len(grid) - 1)
        ok = np.zeros(len(grid) - 1, dtype=bool)
        failed = 0
        for j in range(len(grid) - 1):
            values = self._read(j, int(grid[j + 1] - grid[j]), outputs)
            ok[j] = values is not None
            if ok[j] and judge is not None:
                judge(j, values)
            failed += not ok[j] and os.path.lexists(self.path(j))
        return ok, failed

    def load(self, chunk: int, rows: int, outputs: int) -> np.ndarray:
        """A chunk that done() found whole, checked again; OutputError (nothing is written) if
        it has changed since."""
        values = self._read(chunk, rows, outputs)
        if values is None:
            raise OutputError(f"{self.path(chunk)}: changed while this run was using it (a "
                              f"checkpoint folder serves one run at a time: something else "
                              f"wrote there); no results were written: run the same command "
                              f"again, which reads back the chunks that pass their checks and "
                              f"prices this one again")
        return values
