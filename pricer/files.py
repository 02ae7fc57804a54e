"""File helpers every layer uses: an atomic write, the per-user cache folders, and the checks that
an input can be read and an output written before any work."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from pricer.errors import InputError


def atomic_write(path: str | os.PathLike, write: Callable[[str], None] | bytes,
                 fsync: bool = False) -> None:
    """Make `path` appear whole or not at all: `write(tmp)` (or the bytes given) goes to a hidden
    temporary file beside it, which is then renamed over it. With fsync, the data reach the disk
    before the rename publishes them (a checkpoint must not name a file the disk does not hold).
    The temporary file is removed on any failure."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    data = isinstance(write, (bytes, bytearray, memoryview))
    with _CLAIMING:     # a cleanup that ends the process holds it for ever: no write starts after
        _LEFT_BEHIND.add(tmp)   # it, and bytes are written to a file it has seen or will see
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666) if data else None
        except BaseException:
            _LEFT_BEHIND.discard(tmp)
            raise
    try:
        if data:
            with os.fdopen(fd, "wb") as f:
                f.write(write)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        else:
            write(tmp)
            if fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
        with _CLAIMING:     # not while a cleanup that ends the process removes it (cleanup(final))
            os.replace(tmp, path)
            _LEFT_BEHIND.discard(tmp)
    finally:
        _LEFT_BEHIND.discard(tmp)
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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_input_file(path: str, what: str = "file") -> None:
    """InputError unless `path` is a regular file this process can read: a FIFO or a device
    (/dev/zero) would make a reader wait or read for ever, so they are refused before any read."""
    if not isinstance(path, str) or not path:
        raise InputError(f"{path!r}: a {what} name is needed")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: is {_kind(mode)}, not a regular {what}")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: the {what} is not readable (permission denied)")


def check_output_file(path: str, overwrite: bool, what: str = "output") -> None:
    """InputError unless a run may write `path`: a name is given; an existing path is a regular
    file and `overwrite` is set (a device, FIFO, socket or directory never is replaced); its folder
    exists and a file can be created in it (tried: permissions, read-only mounts and /proc)."""
    if not isinstance(path, str) or not path:
        raise InputError(f"{path!r}: an {what} file name is needed")
    if os.path.lexists(path):
        mode = os.stat(path).st_mode if os.path.exists(path) else os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{path}: is {_kind(mode)}; the {what} must be a regular file "
                             f"(never replaced, --overwrite or not)")
        if not overwrite:
            raise InputError(f"{path}: exists; pass --overwrite to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"{path}: folder {folder} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot write in folder {folder}: {exc.strerror}") from None


# Paths this process must not leave behind if it is stopped: temporary files being written, and
# the lock files of the outputs it claims (cleanup, called on SIGTERM and at exit). A claim is made
# under _CLAIMING, so that a cleanup from another thread (a signal's) never finds a lock file that
# exists and is not registered yet.
_LEFT_BEHIND: set = set()
_CLAIMING = threading.RLock()


def cleanup(final: bool = False) -> None:
    """Remove this process's temporary files and release its output claims (a handler for
    SIGTERM/SIGINT, which ends the process without running `finally` blocks, calls this).
    final: the process is about to end; no other thread renames a file or claims an output from
    now on (they would fail on what was just removed, and print a traceback before the end)."""
    _CLAIMING.acquire()
    try:
        _remove_left_behind(keep=final)
    finally:
        if not final:
            _CLAIMING.release()


CLEANUP_WAIT = 3.0   # seconds an ending process waits for its cleanup
ABORT_FLUSH = 0.5    # seconds between the last line and MPI_Abort: the launcher forwards a rank's
                     # stderr asynchronously and drops what is still in flight when Abort kills it
SWEEP_WAIT = 1.0     # seconds an ending process waits for its last look at its temporary files


def end_process(line: str, world=None) -> None:
    """End this process with exit 1 (never returns): its temporary files and claims removed
    (cleanup_before_exit), `line` on stderr, then, with `world` (an MPI communicator of several
    ranks), MPI_Abort, which ends every rank of the job."""
    try:
        cleanup_before_exit()
        sys.stdout.flush()
        os.write(2, f"{line}\n".encode())
        if world is not None and world.Get_size() > 1:
            time.sleep(ABORT_FLUSH)
            sweep_before_exit()
            world.Abort(1)
        sweep_before_exit()
    finally:
        os._exit(1)


def cleanup_before_exit(wait: float = CLEANUP_WAIT) -> None:
    """cleanup(final=True) for a process about to end (os._exit, MPI_Abort), waited for at most
    `wait` seconds: a removal can block on a hung file system — the very stall a watchdog may be
    reporting — and the end must not wait for it."""
    helper = threading.Thread(target=cleanup, kwargs={"final": True}, name="pricer-cleanup",
                              daemon=True)
    helper.start()
    helper.join(wait)


def sweep_before_exit(wait: float = SWEEP_WAIT) -> None:
    """The temporary files removed once more by a process about to end, after cleanup_before_exit
    (waited for at most `wait` seconds): a write that was creating its file while the cleanup ran
    made it after, and no rename publishes it any more (the cleanup holds _CLAIMING)."""
    helper = threading.Thread(target=_remove_left_behind, kwargs={"keep": True, "locks": False},
                              name="pricer-sweep", daemon=True)
    helper.start()
    helper.join(wait)


def _remove_left_behind(keep: bool = False, locks: bool = True) -> None:
    """keep: the temporary files' names stay registered (for sweep_before_exit)."""
    for item in list(_LEFT_BEHIND):
        if isinstance(item, OutputLock):
            if locks:
                item.release()
        else:
            try:
                os.remove(item)
            except OSError:
                pass
            if not keep:
                _LEFT_BEHIND.discard(item)


class OutputLock:
    """A claim on an output for the whole of a run: the file .NAME.lock beside it, held with a
    POSIX lock (fcntl.lockf), which the operating system drops when the holder dies however it
    dies, so a dead holder's claim is taken over, and the file says who holds it. A second run
    that finds the lock held is refused (InputError) naming the holder."""

    def __init__(self, target: str):
        folder, name = os.path.split(os.path.abspath(target))
        self.target = target
        self.path = os.path.join(folder, f".{name}.lock")
        self.fd = None

    def acquire(self) -> "OutputLock":
        with _CLAIMING:
            return self._acquire()

    def _acquire(self) -> "OutputLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:   # its folder is read-only, missing or not ours
                raise InputError(f"{self.target}: cannot claim it for this run: cannot create "
                                 f"{self.path} ({exc.strerror})") from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    # a file system without POSIX locks (a Lustre client mounted noflock): go on
                    # without the claim rather than refuse every run there
                    os.close(fd)
                    if os.path.getsize(self.path) == 0:
                        os.remove(self.path)
                    sys.stderr.write(f"pricer: warning: {self.target}: cannot claim it for this "
                                     f"run ({exc.strerror}); two runs could write it at once\n")
                    return self
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise InputError(f"{self.target}: another run is writing it ({holder}); wait for "
                                 f"it to end, or choose another output") from None
            try:    # its last holder may have removed the file between our open and our lock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        self.fd = fd
        _LEFT_BEHIND.add(self)
        return self

    def release(self) -> None:
        """Give the claim up and remove the lock file (while still holding it, so that a run
        waiting on this file sees it gone and claims a new one)."""
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        _LEFT_BEHIND.discard(self)


def claim(targets, recheck: Callable[[], None] | None = None) -> list:
    """Every path of `targets` claimed (OutputLock, in order), then `recheck()`: the outputs'
    checks made again under the claims, since a run that held one until now may have written it.
    Returns the locks, for the caller to release once its files are written; where a claim or the
    check fails, the claims taken so far are released and the error raised."""
    locks = []
    try:
        for target in targets:
            locks.append(OutputLock(os.path.normpath(target)).acquire())
        if recheck is not None:
            recheck()
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def expand_placeholders(path: str | None, environ=os.environ) -> str | None:
    """`path` with {array_task} replaced by the Slurm array task id (SLURM_ARRAY_TASK_ID), so that
    the tasks of a job array write one file each; InputError where the id is not set."""
    if not isinstance(path, str) or "{array_task}" not in path:
        return path
    task = environ.get("SLURM_ARRAY_TASK_ID", "")
    if not task:
        raise InputError(f"{path}: uses {{array_task}}, but SLURM_ARRAY_TASK_ID is not set (not "
                         f"a task of a Slurm job array)")
    return path.replace("{array_task}", task)
