"""The stall watchdog: a run whose ranks stop making progress ends, named, instead of hanging.

A rank has stalled when its main thread has finished no chunk for longer than its current chunk's
limit (a wedged GPU, a kernel or a file system that never returns), or when nothing at all has
been heard from its process for longer than the silence limit (SIGSTOP, a lost node). The limits
are `--stall-timeout SECONDS` (job file: pricing.stall_timeout) when given, both of them; else a
chunk's limit is FLOOR + its lattice nodes / RATE, a rate far below what one CPU core prices, so
that only a rank that has really stopped reaches it, and the silence limit is FLOOR. A rank's first
chunk has COLD_START more (the engine's kernels compile at their first call). Neither limit is
ever infinite.

The opening stages (pipeline.prepare_family: rank 0's plan, with its reads of the input and the
checkpoint, every rank's engine start and read of its rows) are watched the same way, a watch of
their own (`stage`): a rank in them for longer than their limit (--stall-timeout, else FLOOR + the
input's size at READ_RATE; its kernel compiles not counted), or silent for longer than the silence
limit, ends the job, so that no rank waits for ever for a rank 0 stuck in a read.

Every rank runs a thread beside its pricing (the engines release the GIL while they price), on a
communicator of the watchdog's own: every BEAT seconds it tells its peers (rank 0: every rank; the
others: rank 0) how long ago its main thread finished its last chunk, that chunk's limit, its
chunks done and whether it is done, and checks itself and its peers: a rank's time without
progress is the age it last reported plus the time since that report, its silence the time since
its last beat. So rank 0 watches every rank, and every rank watches rank 0.
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

from pricer import compiling

ROOT = 0
BEAT_TAG = 7719      # FailureWatch uses 7717, Progress 7718
BEAT = 0.25          # seconds between beats, and between a thread's checks
FLOOR = 120.0        # seconds: the silence limit, and every chunk's limit beyond its own work
RATE = 1e8           # lattice nodes per second a stalled-or-not rank is held to (default limits)
MINIMUM = 1.0        # the smallest --stall-timeout: several beats must fit in it
READ_RATE = 1e6      # bytes of the input per second an opening stage is held to (default limits):
                     # far below what a file system reads and the checks judge
COLD_START = 600.0   # seconds more for a rank's first chunk: numba compiles the CPU kernels at
                     # their first call, 30-50 s per process on a cold cache, more with many ranks
                     # compiling at once on one node (its process stays heard from meanwhile)
SILENT_BEATS = 4     # a rank whose beats stopped for this many periods is named as not heard from
FIELDS = 6           # a beat: age, limit, chunks done, done?, last chunk's number, BYE?


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


def opening_limit(input_bytes: float, stall_timeout: float | None) -> float:
    """Seconds a rank may spend in an opening stage of a run whose input holds `input_bytes`
    (its kernel compiles not counted: StallWatch's `stage`)."""
    if stall_timeout is not None:
        return float(stall_timeout)
    return FLOOR + float(input_bytes) / READ_RATE


class StallWatch:
    """One per rank for the compute stage. The main thread calls begin(limit) before each chunk,
    done(chunk) after it, finished() after its last, and, once past the compute barrier, stop()
    (every rank; it returns when every peer has said goodbye) — or abandon() where the run ends
    otherwise (an exception on the way out of this rank alone).

    With `stage` (its words in the messages, e.g. "the run's opening stages"), one for stages
    that are no chunk loop: begin(limit) as the rank's own work starts, finished() as it waits
    for the others (then only its silence is watched, until the next begin); a rank's time in the
    stage leaves out its kernel compiles (compiling.seconds(): a cold cache's 30-50 s).

    Ending: stop() makes the thread send each peer (rank 0: every rank; the others: rank 0) a last
    beat, BYE, after which it sends nothing more, and keep taking in beats and checking silence
    until BYE has come from every peer. Messages from one sender arrive in order, so then nothing
    is left in flight and the communicator can be freed; and a rank that stops before it says BYE
    (lost while it waits in the barrier) is still caught by its silence."""

    def __init__(self, comm, stall_timeout: float | None, abort, clock=time.monotonic,
                 stage: str | None = None):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.MPI = None     # a run of one rank has no peers to hear (and may run without MPI)
        if self.size > 1:
            from mpi4py import MPI   # here, not at import: RunConfig reads this module's limits
            self.MPI = MPI
        self.stall_timeout = stall_timeout
        self.silence = silence_limit(stall_timeout)
        self.abort = abort               # abort(message): ends the job (faults.abort_job)
        self.clock = clock
        self.stage = stage
        self.compiled = compiling.seconds() if stage else 0.0   # as the stage's work began
        self.talking = self.size > 1 and self.MPI.Query_thread() >= self.MPI.THREAD_MULTIPLE
        self.comm = comm.Dup() if self.size > 1 else None
        where = (socket.gethostname(), os.getpid())
        self.where = self.comm.allgather(where) if self.comm is not None else [where]
        now = clock()
        # this rank's main thread (written by it, read by the thread)
        self.progress_at, self.limit, self.chunks, self.last_chunk, self.over = now, math.inf, 0, -1, False
        # every rank's last beat as this rank saw it: (arrival, age, limit, chunks, over, last)
        self.seen = [[now, 0.0, math.inf, 0, False, -1] for _ in range(self.size)]
        self.peers = set(range(1, self.size)) if self.rank == ROOT else {ROOT}
        self.gone = set()                # peers whose BYE has come
        self.pending = []
        self.stopping = threading.Event()
        self.abandoned = False
        self.thread = threading.Thread(target=self._watch, name="pricer-stall-watch", daemon=True)
        self.thread.start()

    # ---- the main thread
    def begin(self, limit: float) -> None:
        """A chunk (or the rank's work in its stage) starts, with `limit` seconds to finish it
        (chunk_limit, opening_limit)."""
        self.limit = limit
        if self.stage:
            self.compiled = compiling.seconds()
        self.progress_at = self.clock()
        self.over = False

    def done(self, chunk: int) -> None:
        self.chunks += 1
        self.last_chunk = int(chunk)
        self.progress_at = self.clock()

    def finished(self) -> None:
        self.over = True

    def stop(self) -> None:
        """Every rank, past the compute barrier: BYE to the peers, and back once every peer's
        BYE has come (meanwhile a silent peer still ends the job); then the communicator is
        freed."""
        self.stopping.set()
        self.thread.join()
        if self.comm is not None:
            self.MPI.Request.Waitall(self.pending)
            self.comm.Free()
            self.comm = None

    def abandon(self) -> None:
        """This rank leaves the run on its own (its failure ends the job): the thread ends now,
        says nothing more and checks nothing more; the communicator is left as it is."""
        self.abandoned = True
        self.stopping.set()
        self.thread.join()

    # ---- the thread
    def _watch(self) -> None:
        said_bye = False
        while True:
            stopping = self.stopping.wait(BEAT)
            if self.abandoned:
                return
            now = self.clock()
            self.seen[self.rank] = self._own(now)
            if not self.talking:
                if stopping:
                    return
                self._check(self.rank, now)
                continue
            self._take_beats(now)
            if stopping and not said_bye:
                for peer in self.peers:
                    self._send(np.array([0, 0, 0, 1, -1, 1], dtype=np.float64), peer)
                said_bye = True
            elif not said_bye:
                beat = np.array(self.seen[self.rank][1:] + [0], dtype=np.float64)
                for peer in self.peers:
                    self._send(beat, peer)
            if said_bye and self.gone == self.peers:
                return
            for rank in ([self.rank] if not said_bye else []) + sorted(self.peers - self.gone):
                self._check(rank, now)

    def _own(self, now: float) -> list:
        age = now - self.progress_at
        if self.stage:
            age = max(0.0, age - (compiling.seconds() - self.compiled))
        return [now, age, self.limit, self.chunks, self.over, self.last_chunk]

    def _send(self, beat: np.ndarray, dest: int) -> None:
        self.pending.append(self.comm.Isend([beat, self.MPI.DOUBLE], dest=dest, tag=BEAT_TAG))
        self.pending = [r for r in self.pending if not r.Test()]

    def _take_beats(self, now: float) -> None:
        MPI = self.MPI
        status, buffer = MPI.Status(), np.empty(FIELDS)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=BEAT_TAG, status=status):
            source = status.Get_source()
            self.comm.Recv([buffer, MPI.DOUBLE], source=source, tag=BEAT_TAG)
            age, limit, chunks, over, last, bye = buffer
            if bye:
                self.gone.add(source)
            else:
                self.seen[source] = [now, age, limit, int(chunks), bool(over), int(last)]

    def _check(self, rank: int, now: float) -> None:
        arrival, age, limit, chunks, over, last = seen = self.seen[rank]
        silent, stuck = now - arrival, now - arrival + age
        if silent <= self.silence and (over or stuck <= limit):
            return
        if silent > SILENT_BEATS * BEAT:     # its thread has stopped beating too
            what = f"has not been heard from for {silent:.1f} s (stopped, or its node lost"
            what += f"; limit {self.silence:g} s)" if over or self.stage else \
                f"; no chunk finished for {stuck:.1f} s, limit {limit:.3g} s)"
            what += f" in {self.stage}" if self.stage else ""
        elif self.stage:
            what = (f"has been in {self.stage} for {stuck:.1f} s (a stuck device or file "
                    f"system; limit {limit:.3g} s, kernel compiles not counted)")
        else:
            what = (f"has finished no chunk for {stuck:.1f} s (a stuck engine, device or file "
                    f"system; limit {limit:.3g} s)")
        self.abort(self._stalled_text(rank, seen, what))

    def _stalled_text(self, rank: int, seen: list | None, what: str) -> str:
        host, pid = self.where[rank]
        work = f"the input's size at {READ_RATE:g} bytes/s" if self.stage else \
            f"the chunk's lattice nodes at {RATE:g} nodes/s"
        setting = (f"--stall-timeout {self.stall_timeout:g}" if self.stall_timeout is not None
                   else f"by default {FLOOR:g} s + {work}; --stall-timeout SECONDS sets it")
        done = ""
        if seen is not None and not self.stage:
            chunks, last = seen[3], seen[5]
            done = f"; it had finished {chunks} chunk(s)" + (
                f", the last chunk number {last} of the run's chunk grid" if last >= 0 else "")
        return (f"stalled: rank {rank} (host {host}, pid {pid}) {what} ({setting}){done}; "
                f"the chunks saved to a checkpoint are kept")
