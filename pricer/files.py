"""Two file helpers every layer uses: an atomic write, and the per-user cache folders."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[str], None] | bytes,
                 fsync: bool = False) -> None:
    """Make `path` appear whole or not at all: `write(tmp)` (or the bytes given) goes to a hidden
    temporary file beside it, which is then renamed over it. With fsync, the data reach the disk
    before the rename publishes them (a checkpoint must not name a file the disk does not hold).
    The temporary file is removed on any failure."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        if isinstance(write, (bytes, bytearray, memoryview)):
            with open(tmp, "wb") as f:
                f.write(write)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        else:
            write(tmp)
            if fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def cache_dir(what: str, variable: str | None = None) -> Path:
    """The folder where pricer caches `what` (numba, cuda, calibration): $`variable` if that is
    set, else $XDG_CACHE_HOME/pricer/WHAT, else ~/.cache/pricer/WHAT. On clusters whose home
    folders are shared, point the variable at node-local storage."""
    if variable and os.environ.get(variable):
        return Path(os.environ[variable])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pricer" / what
