"""Failures during a run: test-only fault injection, and how a failed rank ends the whole job.

Fault injection (tests only; docs/reliability.md): `PRICER_FAULT="KIND:RANK:CHUNKS"` (several
comma-separated) makes rank RANK fail once it has priced CHUNKS chunks of its slice. KIND is
  raise  an exception (RuntimeError) in the pricing loop
  gpu    the GPU engine's error type (GpuUnavailable), as a lost device would raise it
  exit   os._exit(70): the process vanishes without MPI_Finalize
  kill   SIGKILL to itself
  hang   the main thread sleeps for ever, as in a kernel that never returns (watchdog.py)
  stop   SIGSTOP to itself (the whole process stopped: watchdog.py)
CHUNKS may be `end`: once the rank has priced all its chunks, on its way to the others; or
`plan` (rank 0): in its plan of the run, before it reads the input's index (pipeline.make_plan);
or `write`: rank 0 once the results are gathered, before it writes them (the other ranks' commands
have returned by then: they wait in MPI_Finalize).
`PRICER_CHUNK_DELAY=SECONDS` sleeps after every chunk (gives a kill -9 test a window).

A rank whose pricing raises sends its cause (a fixed-size byte buffer) to rank 0, which polls for
such messages between its own chunks and while it waits for the others; rank 0 prints
"rank K failed after C chunk(s): CAUSE" and calls MPI Abort, which ends every rank. If rank 0 does
not answer within GRACE seconds (stuck in a long chunk), the failed rank aborts the job itself.
A rank that dies outright (exit, kill) cannot say why: the launcher ends the job and names it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import numpy as np

from pricer.files import cleanup, end_process

ROOT = 0
FAIL_TAG = 7717
MESSAGE_BYTES = 2048
GRACE = 5.0       # seconds a failed rank waits for rank 0 to abort the job before doing it itself
POLL = 0.002      # seconds between polls: waiting ranks sleep instead of spinning on the cores
HARD_EXIT = 70
KINDS = ("raise", "gpu", "exit", "kill", "hang", "stop")


END = "end"
PLAN = "plan"
WRITE = "write"


class InjectedFault(RuntimeError):
    """What `PRICER_FAULT=raise:...` raises."""


def planned_faults(rank: int, environ=os.environ) -> dict[int, str]:
    """{chunks: kind} for this rank from PRICER_FAULT (empty when unset)."""
    plan = {}
    for item in filter(None, environ.get("PRICER_FAULT", "").split(",")):
        kind, who, after = item.strip().split(":")
        if kind not in KINDS:
            raise ValueError(f"PRICER_FAULT kind {kind!r} is not one of {', '.join(KINDS)}")
        if int(who) == rank:
            plan[after if after in (END, PLAN, WRITE) else int(after)] = kind
    return plan


def inject(plan: dict, rank: int, done) -> None:
    """Fail as planned once `done` chunks are priced (called before each chunk, after the last,
    and with END once the rank is done)."""
    kind = plan.get(done)
    if kind is None:
        return
    where = f"injected by PRICER_FAULT after {done} chunk(s) on rank {rank}"
    if kind == "raise":
        raise InjectedFault(where)
    if kind == "gpu":
        from pricer.engines.gpu.runtime import GpuUnavailable
        raise GpuUnavailable(f"CUDA error: device lost ({where})")
    sys.stderr.flush()
    if kind == "exit":
        os._exit(HARD_EXIT)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os.kill(os.getpid(), signal.SIGKILL)


def chunk_delay() -> None:
    delay = float(os.environ.get("PRICER_CHUNK_DELAY", "0") or 0)
    if delay > 0:
        time.sleep(delay)


def polite_wait(comm, request) -> None:
    """Wait for a nonblocking request, sleeping between tests: with more ranks than cores, ranks
    spinning in a blocking collective would starve the rank they wait for."""
    while not request.Test():
        time.sleep(POLL)


def polite_barrier(comm) -> None:
    if comm.Get_size() > 1:
        polite_wait(comm, comm.Ibarrier())




class FailureWatch:
    """Rank 0 listens for failure notices from the other ranks during the compute stage."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.buffer = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
        self.request = None
        if self.rank == ROOT and comm.Get_size() > 1:
            from mpi4py import MPI
            self.request = comm.Irecv([self.buffer, MPI.BYTE], source=MPI.ANY_SOURCE, tag=FAIL_TAG)

    def poll(self) -> None:
        """Rank 0: if another rank reported a failure, name it and end the job."""
        if self.request is not None and self.request.Test():
            self._abort(_decode(self.buffer))

    def barrier(self, idle=None) -> None:
        """Everyone finished computing; rank 0 keeps listening while it waits (and calls `idle`,
        if given, between polls: progress.Progress.poll)."""
        if self.comm.Get_size() == 1:
            return
        request = self.comm.Ibarrier()
        while not request.Test():
            self.poll()
            if idle is not None:
                idle()
            time.sleep(POLL)
        if self.request is not None:  # no rank failed: nothing will come any more
            self.request.Cancel()
            self.request.Wait()
            self.request = None

    def failed(self, done: int, exc: BaseException) -> None:
        """This rank's pricing raised: have rank 0 name it and end the job (never returns)."""
        traceback.print_exc()
        message = f"rank {self.rank} failed after {done} chunk(s): {type(exc).__name__}: {exc}"
        if self.rank == ROOT or self.comm.Get_size() == 1:
            self._abort(message)
        data = np.frombuffer(message.encode("utf-8")[:MESSAGE_BYTES - 1], dtype=np.uint8)
        self.buffer[:] = 0
        self.buffer[:data.size] = data
        from mpi4py import MPI
        self.comm.Send([self.buffer, MPI.BYTE], dest=ROOT, tag=FAIL_TAG)
        time.sleep(GRACE)  # rank 0 aborts the job meanwhile; if it is stuck, abort it from here
        self._abort(message)

    def _abort(self, message: str) -> None:
        abort_job(self.comm, message)


def abort_job(comm, message: str, in_thread: bool = False) -> None:
    """End the whole job for `message` (never returns): this process's temporary files and
    output claims removed, one line on stderr, then MPI_Abort (exit 1 on every rank); alone, exit 1
    (SystemExit from the main thread, os._exit from another: files.end_process)."""
    line = f"pricer: error: {message}; aborting all ranks"
    if comm.Get_size() > 1 or in_thread:
        end_process(line, comm)
    cleanup()       # alone, in the main thread: the process goes on to its exit by SystemExit
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(1)


def _decode(buffer: np.ndarray) -> str:
    return bytes(buffer).split(b"\0", 1)[0].decode("utf-8", "replace")
