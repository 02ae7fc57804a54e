"""The stall watchdog: a run whose ranks stop making progress ends, named, instead of hanging.

A rank has stalled when its main thread has finished no chunk for longer than its current chunk's
limit (a wedged GPU, a kernel or a file system that never returns), or when nothing at all has
been heard from its process for longer than the silence limit (SIGSTOP, a lost node). The limits
are `--stall-timeout SECONDS` (job file: pricing.stall_timeout) when given, both of them; else a
chunk's limit is FLOOR + its lattice nodes / RATE, a rate far below what one CPU core prices, so
that only a rank that has really stopped reaches it, and the silence limit is FLOOR. A rank's first
chunk has COLD_START more (the engine's kernels compile at their first call). Neither limit is
ever infinite.

Every rank runs a thread beside its pricing (the engines release the GIL while they price), on a
communicator of the watchdog's own:
  - ranks 1..: every BEAT seconds, send rank 0 how long ago their main thread finished its last
    chunk, their current chunk's limit, their chunks done and whether they are done; end the job,
    naming rank 0, when rank 0's beats have stopped for longer than the silence limit;
  - rank 0: every BEAT seconds, send each other rank a beat, and check every rank, itself included:
    a rank's time without progress is the age it last reported plus the time since that report.
The first rank to see a stall prints `pricer: error: rank K (host H, pid P) has finished no chunk
for S s ...; aborting all ranks` and calls MPI_Abort (exit 1). The chunks saved to a checkpoint
before are whole (each was written to a temporary file and renamed): the same command continues.
The watchdog needs MPI_THREAD_MULTIPLE (MPICH and Open MPI give it to mpi4py by default); without
it, only a rank's check of itself runs.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time

import numpy as np

ROOT = 0
BEAT_TAG = 7719      # FailureWatch uses 7717, Progress 7718
BEAT = 0.25          # seconds between beats, and between a thread's checks
FLOOR = 120.0        # seconds: the silence limit, and every chunk's limit beyond its own work
RATE = 1e8           # lattice nodes per second a stalled-or-not rank is held to (default limits)
MINIMUM = 1.0        # the smallest --stall-timeout: several beats must fit in it
COLD_START = 600.0   # seconds more for a rank's first chunk: numba compiles the CPU kernels at
                     # their first call, 30-50 s per process on a cold cache, more with many ranks
                     # compiling at once on one node (its process stays heard from meanwhile)
SILENT_BEATS = 4     # a rank whose beats stopped for this many periods is named as not heard from
FIELDS = 5           # a beat of rank k: age, limit, chunks done, done?, last chunk's number


def chunk_limit(nodes: float, stall_timeout: float | None) -> float:
    """Seconds a rank may spend on a chunk of `nodes` lattice nodes before it counts as stalled."""
    if stall_timeout is not None:
        return float(stall_timeout)
    return FLOOR + float(nodes) / RATE


def chunk_limits(nodes, stall_timeout: float | None) -> list[float]:
    """Each of a rank's chunks' limits, in order; the first has COLD_START more, for the kernels
    the engine compiles at its first call where the compile caches are cold."""
    limits = [chunk_limit(n, stall_timeout) for n in nodes]
    if limits:
        limits[0] += COLD_START
    return limits


def silence_limit(stall_timeout: float | None) -> float:
    return float(stall_timeout) if stall_timeout is not None else FLOOR


class StallWatch:
    """One per rank for the compute stage. The main thread calls begin(limit) before each chunk,
    done(chunk) after it, finished() after its last, and stop() once every rank is past the
    compute barrier (stop is collective)."""

    def __init__(self, comm, stall_timeout: float | None, abort, clock=time.monotonic):
        from mpi4py import MPI   # here, not at import: RunConfig reads this module's limits
        self.MPI = MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stall_timeout = stall_timeout
        self.silence = silence_limit(stall_timeout)
        self.abort = abort               # abort(message): ends the job (faults.abort_job)
        self.clock = clock
        self.multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.comm = comm.Dup() if self.size > 1 else None
        where = (socket.gethostname(), os.getpid())
        self.where = self.comm.allgather(where) if self.comm is not None else [where]
        now = clock()
        # this rank's main thread (written by it, read by the thread)
        self.progress_at, self.limit, self.chunks, self.last_chunk, self.over = now, math.inf, 0, -1, False
        # rank 0: every rank's last beat, as (arrival, age, limit, chunks, over, last chunk)
        self.seen = [[now, 0.0, math.inf, 0, False, -1] for _ in range(self.size)]
        self.sent = np.zeros(self.size, dtype=np.int64)
        self.received = np.zeros(self.size, dtype=np.int64)
        self.pending = []
        self.heard_root = now
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="pricer-stall-watch", daemon=True)
        self.thread.start()

    # ---- the main thread
    def begin(self, limit: float) -> None:
        """A chunk starts, with `limit` seconds to finish it (chunk_limit)."""
        self.limit = limit
        self.progress_at = self.clock()

    def done(self, chunk: int) -> None:
        self.chunks += 1
        self.last_chunk = int(chunk)
        self.progress_at = self.clock()

    def finished(self) -> None:
        self.over = True

    def stop(self) -> None:
        """Every rank, after the compute barrier: end the thread and take in every beat sent on
        the watchdog's communicator, so that none is left in flight when it is freed."""
        self.stopping.set()
        self.thread.join()
        if self.comm is None:
            return
        MPI = self.MPI
        MPI.Request.Waitall(self.pending)
        expected = np.empty_like(self.sent)
        self.comm.Alltoall(self.sent, expected)
        buffer = np.empty(FIELDS)
        for source in range(self.size):
            for _ in range(int(expected[source] - self.received[source])):
                self.comm.Recv([buffer, MPI.DOUBLE], source=source, tag=BEAT_TAG)
        self.comm.Free()
        self.comm = None

    # ---- the thread
    def _watch(self) -> None:
        while not self.stopping.wait(BEAT):
            now = self.clock()
            if self.comm is None or not self.multiple:
                self._check(self.rank, self._own(now), now)
                continue
            if self.rank == ROOT:
                self._take_beats(now)
                self.seen[ROOT] = self._own(now)
                for rank in range(self.size):
                    self._check(rank, self.seen[rank], now)
                for rank in range(1, self.size):
                    self._send(np.zeros(FIELDS), rank)
            else:
                self._send(np.array(self._own(now)[1:], dtype=np.float64), ROOT)
                self._take_beats(now)
                silent = now - self.heard_root
                if silent > self.silence and not self.stopping.is_set():
                    self.abort(self._stalled_text(
                        ROOT, None, f"has not been heard from for {silent:.1f} s (stopped, or "
                                    f"its node lost; limit {self.silence:g} s)"))
                self._check(self.rank, self._own(now), now)

    def _own(self, now: float) -> list:
        return [now, now - self.progress_at, self.limit, self.chunks, self.over, self.last_chunk]

    def _send(self, beat: np.ndarray, dest: int) -> None:
        self.pending.append(self.comm.Isend([beat, self.MPI.DOUBLE], dest=dest, tag=BEAT_TAG))
        self.sent[dest] += 1
        self.pending = [r for r in self.pending if not r.Test()]

    def _take_beats(self, now: float) -> None:
        MPI = self.MPI
        status, buffer = MPI.Status(), np.empty(FIELDS)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=BEAT_TAG, status=status):
            source = status.Get_source()
            self.comm.Recv([buffer, MPI.DOUBLE], source=source, tag=BEAT_TAG)
            self.received[source] += 1
            if self.rank == ROOT:
                age, limit, chunks, over, last = buffer
                self.seen[source] = [now, age, limit, int(chunks), bool(over), int(last)]
            else:
                self.heard_root = now

    def _check(self, rank: int, seen: list, now: float) -> None:
        if self.stopping.is_set():
            return
        arrival, age, limit, chunks, over, last = seen
        silent, stuck = now - arrival, now - arrival + age
        everyone_over = all(item[4] for item in self.seen) if self.rank == ROOT else False
        if (silent <= self.silence or everyone_over) and (over or stuck <= limit):
            return
        if silent > SILENT_BEATS * BEAT:     # its thread has stopped beating too
            what = f"has not been heard from for {silent:.1f} s (stopped, or its node lost"
            what += f"; limit {self.silence:g} s)" if over else \
                f"; no chunk finished for {stuck:.1f} s, limit {limit:.3g} s)"
        else:
            what = (f"has finished no chunk for {stuck:.1f} s (a stuck engine, device or file "
                    f"system; limit {limit:.3g} s)")
        self.abort(self._stalled_text(rank, seen, what))

    def _stalled_text(self, rank: int, seen: list | None, what: str) -> str:
        host, pid = self.where[rank]
        setting = (f"--stall-timeout {self.stall_timeout:g}" if self.stall_timeout is not None
                   else f"by default {FLOOR:g} s + the chunk's lattice nodes at {RATE:g} nodes/s; "
                        f"--stall-timeout SECONDS sets it")
        done = ""
        if seen is not None:
            chunks, last = seen[3], seen[5]
            done = f"; it had finished {chunks} chunk(s)" + (
                f", the last chunk number {last} of the run's chunk grid" if last >= 0 else "")
        return (f"stalled: rank {rank} (host {host}, pid {pid}) {what} ({setting}){done}; "
                f"the chunks saved to a checkpoint are kept")
