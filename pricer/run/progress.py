"""Progress of a run, shown by rank 0 while the ranks price their slices chunk by chunk.

Every rank tells rank 0 how far it is: after a finished chunk it sends its running totals (chunks,
lattice nodes: two float64s) with a non-blocking send on PROGRESS_TAG, at most every SEND_EVERY
seconds and always after its last chunk, so a rank never waits for rank 0 and a run of thousands of
chunks sends a handful of messages per second at most. Rank 0 counts its own chunks as it finishes
them and takes in the others' messages between its chunks and while it waits for the slowest rank
(FailureWatch.barrier's polling loop), then, after the barrier, the last ones (each rank's final
message says it has priced all its chunks, whose number rank 0 knows from the chunk grid).

Rank 0 shows it on its stderr (stdout keeps the summary lines that `pricer scaling` parses):
  - a tqdm bar of nodes done / all nodes, with the rate, when stderr is a terminal — directly, or
    through the launcher (mpiexec hands its ranks pipes, so rank 0 looks for an `mpiexec`/`mpirun`
    among its parent processes whose stderr is a terminal; an `srun` step has none);
  - otherwise a line every PRICER_PROGRESS_SECONDS seconds (default 10), and a last one at 100 %
    if it wrote any:
      pricer: progress 37% (1.2e12 of 3.3e12 nodes, 412 of 1100 chunks, 9.1e11 nodes/s, eta 4 s)
  - nothing with --quiet (RunConfig.progress = False).
PRICER_PROGRESS=bar|log|off forces one of them (auto, the default, chooses as above). Rank 0 can
only report between its own chunks, so a line may come up to one chunk late (chunks are seconds
of a rank's work, pricer/run/chunks.py).
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

ROOT = 0
PROGRESS_TAG = 7718       # FailureWatch uses 7717
SEND_EVERY = 0.2          # seconds between one rank's messages (its last one always goes)
DEFAULT_PERIOD = 10.0     # seconds between log lines (PRICER_PROGRESS_SECONDS)
BAR_DELAY = 1.0           # seconds before a bar appears (no bar for runs shorter than that)
MODES = ("auto", "bar", "log", "off")


def _mpi():
    """mpi4py.MPI, for the messages of a run of several ranks (one of one rank sends none and
    never starts MPI: collectives.world)."""
    from mpi4py import MPI
    return MPI

LAUNCHERS = ("mpiexec", "mpirun", "mpiexec.hydra", "orterun", "prterun")


def period(environ=os.environ) -> float:
    """Seconds between log lines: PRICER_PROGRESS_SECONDS if it is a number > 0, else 10."""
    try:
        value = float(environ.get("PRICER_PROGRESS_SECONDS", "") or DEFAULT_PERIOD)
    except ValueError:
        return DEFAULT_PERIOD
    return value if value > 0 and math.isfinite(value) else DEFAULT_PERIOD


def choose_mode(stream, environ=os.environ) -> tuple[str, int | None]:
    """("bar", columns), ("log", None) or ("off", None) for rank 0's `stream`."""
    mode = environ.get("PRICER_PROGRESS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        mode = "auto"
    if mode in ("log", "off"):
        return mode, None
    columns = terminal_columns(stream)
    if mode == "bar":
        return "bar", columns or 80
    return ("bar", columns) if columns else ("log", None)


def terminal_columns(stream) -> int | None:
    """The width of the terminal `stream` ends up on, or None where it is no terminal: the stream
    itself, else the stderr of the MPI launcher that started this process (a parent, grandparent or
    great-grandparent named mpiexec/mpirun: mpiexec gives its ranks pipes and forwards them)."""
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, OSError, ValueError):
        return None
    path = _launcher_terminal()
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return 80
    try:
        return os.get_terminal_size(fd).columns or 80
    except OSError:
        return 80
    finally:
        os.close(fd)


def _launcher_terminal(levels: int = 4) -> str | None:
    """The terminal device the launcher's stderr is on, if one of our ancestors (psutil's
    parents, the nearest `levels`) is an MPI launcher: its fd 2 as Linux shows it in /proc (psutil
    lists a process's open regular files, not its terminal)."""
    import psutil

    try:
        for parent in psutil.Process().parents()[:levels]:
            if parent.name() in LAUNCHERS:
                target = os.readlink(f"/proc/{parent.pid}/fd/2")
                return target if target.startswith(("/dev/pts/", "/dev/tty")) else None
    except (OSError, psutil.Error):
        return None
    return None


# ----------------------------------------------------------------------------------- formatting

def _number(x: float) -> str:
    """1234 -> '1234', 1.23e12 -> '1.2e12'."""
    if x < 1e4:
        return f"{x:.0f}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, round(seconds))
    if seconds < 100:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(nodes: float, total_nodes: float, chunks: int, total_chunks: int,
                  elapsed: float) -> str:
    """The log line: percent of the nodes (100 only once every chunk is in), counts, rate, and
    the time left at that rate (or, once done, the time it took)."""
    finished = chunks >= total_chunks
    if finished:
        percent = 100
    elif total_nodes > 0:
        percent = min(99, int(100 * nodes / total_nodes))
    else:
        percent = min(99, int(100 * chunks / max(total_chunks, 1)))
    rate = nodes / elapsed if elapsed > 0 else 0.0
    if finished:
        when = f"in {elapsed:.1f} s"
    else:
        when = "eta " + _duration((total_nodes - nodes) / rate if rate > 0 else math.inf)
    return (f"pricer: progress {percent}% ({_number(nodes)} of {_number(total_nodes)} nodes, "
            f"{chunks} of {total_chunks} chunks, {_number(rate)} nodes/s, {when})")


class LogLines:
    """A line every `every` seconds, and a last one once done if any was written."""

    def __init__(self, stream, every: float, start: float):
        self.stream, self.every = stream, every
        self.due = start + every
        self.last = None

    def update(self, nodes, total_nodes, chunks, total_chunks, elapsed, now):
        if now >= self.due and chunks < total_chunks:   # the 100 % line is close()'s
            self._write(progress_line(nodes, total_nodes, chunks, total_chunks, elapsed))
            self.due = now + self.every

    def close(self, nodes, total_nodes, chunks, total_chunks, elapsed):
        if self.last is not None:
            self._write(progress_line(nodes, total_nodes, chunks, total_chunks, elapsed))

    def _write(self, line: str) -> None:
        self.last = line
        print(line, file=self.stream, flush=True)


class Bar:
    """A tqdm bar of nodes (shown after BAR_DELAY seconds), with the chunks as its postfix."""

    def __init__(self, stream, total_nodes: float, columns: int, delay: float):
        from tqdm import tqdm

        class _Tqdm(tqdm):
            monitor_interval = 0   # no monitor thread in an MPI process

        self.bar = _Tqdm(total=total_nodes, unit="node", unit_scale=True, file=stream, ncols=columns,
                         delay=delay, mininterval=0.2, desc="pricer", leave=True,
                         dynamic_ncols=False)

    def update(self, nodes, total_nodes, chunks, total_chunks, elapsed, now):
        if nodes == self.bar.n:
            return
        self.bar.set_postfix_str(f"{chunks}/{total_chunks} chunks", refresh=False)
        self.bar.update(nodes - self.bar.n)

    def close(self, nodes, total_nodes, chunks, total_chunks, elapsed):
        self.bar.set_postfix_str(f"{chunks}/{total_chunks} chunks", refresh=False)
        self.bar.update(nodes - self.bar.n)
        self.bar.close()


# ------------------------------------------------------------------------------------- tracking

class Progress:
    """One per rank for the compute stage. Every rank calls chunk_done(nodes) after each chunk,
    poll() while idle and finish() after the compute barrier; rank 0 shows the sum."""

    def __init__(self, comm=None, enabled: bool = False, cuts=None, bounds=None,
                 total_nodes: float = 0.0, stream=None, environ=os.environ):
        self.comm = comm
        self.enabled = bool(enabled) and comm is not None
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.stream = stream if stream is not None else sys.stderr
        self.environ = environ
        self.chunks, self.nodes = 0, 0.0      # this rank's own
        self.pending = []                     # a worker's sends in flight: (request, buffer)
        self.last_sent = -math.inf
        self.display = None
        self.t0 = time.monotonic()
        if not self.enabled:
            return
        cuts, bounds = np.asarray(cuts), np.asarray(bounds)
        # chunks per rank: the cuts from bounds[r] to bounds[r + 1] (every bound is a cut)
        self.expected = (np.searchsorted(cuts, bounds[1:]) - np.searchsorted(cuts, bounds[:-1]))
        self.mine = int(self.expected[self.rank])
        if self.rank == ROOT:
            self.total_chunks = int(self.expected.sum())
            self.total_nodes = float(total_nodes)
            self.seen = np.zeros((self.size, 2))          # each rank's latest (chunks, nodes)
            self.buffer = np.zeros(2)
            self.status = _mpi().Status() if self.size > 1 else None

    def start(self) -> None:
        """The pricing begins: the clock, and rank 0's display."""
        self.t0 = time.monotonic()
        if not self.enabled or self.rank != ROOT:
            return
        mode, columns = choose_mode(self.stream, self.environ)
        every = period(self.environ)
        if mode == "bar":
            self.display = Bar(self.stream, self.total_nodes, columns, min(BAR_DELAY, every))
        elif mode == "log":
            self.display = LogLines(self.stream, every, self.t0)

    def chunk_done(self, nodes: float) -> None:
        if not self.enabled:
            return
        self.chunks += 1
        self.nodes += nodes
        if self.rank == ROOT:
            self.seen[ROOT] = (self.chunks, self.nodes)
            self.poll()
            return
        now = time.monotonic()
        if self.chunks == self.mine or now - self.last_sent >= SEND_EVERY:
            buffer = np.array([self.chunks, self.nodes], dtype=np.float64)
            self.pending.append((self.comm.Isend([buffer, _mpi().DOUBLE], dest=ROOT, tag=PROGRESS_TAG),
                                 buffer))
            self.last_sent = now
        self.pending = [(r, b) for r, b in self.pending if not r.Test()]

    def poll(self) -> None:
        """Rank 0: take in what has arrived, and show it when due (cheap: one Iprobe when idle)."""
        if not self.enabled or self.rank != ROOT:
            return
        while self.size > 1 and self.comm.Iprobe(source=_mpi().ANY_SOURCE, tag=PROGRESS_TAG,
                                                  status=self.status):
            self._receive(self.status.Get_source())
        if self.display is not None:
            self.display.update(*self._totals(), time.monotonic())

    def finish(self) -> None:
        """After the compute barrier: rank 0 takes in every rank's last message (all sent by now)
        and closes its display; the others complete their sends."""
        if not self.enabled:
            return
        if self.rank != ROOT:
            _mpi().Request.Waitall([r for r, _ in self.pending])
            self.pending = []
            return
        for source in range(1, self.size):
            while self.seen[source, 0] < self.expected[source]:
                self._receive(source)
        if self.display is not None:
            nodes, total_nodes, chunks, total_chunks, elapsed = self._totals()
            self.display.close(nodes, total_nodes, chunks, total_chunks, elapsed)
            self.display = None

    def _receive(self, source: int) -> None:
        self.comm.Recv([self.buffer, _mpi().DOUBLE], source=source, tag=PROGRESS_TAG)
        self.seen[source] = self.buffer

    def _totals(self):
        chunks, nodes = self.seen.sum(axis=0)
        return float(nodes), self.total_nodes, int(chunks), self.total_chunks, \
            time.monotonic() - self.t0
