"""The MPI side of a run, SPMD with buffer collectives: how the ranks agree (the verdict), and how
the portfolio and the results move (Scatterv/Bcast of float64 rows, Gatherv back to rank 0).

Failure rules: rank 0 (with --distribute read, every rank for its own rows) checks everything it can
before any collective work, then every rank takes part in one verdict, so bad input makes every rank
exit 2 together with one message (rank 0 prints the lowest failing rank's); anything unexpected later
aborts the whole job (the CLI installs an excepthook that calls MPI Abort), so no rank is ever left
waiting. Arrays move as MPI.DOUBLE rows of a committed contiguous type (counts stay far below 2^31
rows), C-contiguous float64 only: explicit buffer specs are trusted blindly by MPI.

A process that no launcher started (no mpiexec, mpirun or srun environment) is a run of one rank:
it never initialises MPI (world(): Open MPI's singleton MPI_Init alone took ~0.5 s of every such
command), and its communicator is Alone, which does what a world of one rank does.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import numpy as np

from pricer import ending
from pricer.errors import InputError

ROOT = 0
# what a launcher sets in each rank's environment: MPICH's hydra and Intel MPI (PMI_*), Open MPI
# (OMPI_*), PMIx launchers (PMIX_*), MVAPICH2 (MV2_*), HPE Cray PALS (PALS_*), Slurm's srun
# (SLURM_STEP_ID with SLURM_STEP_NUM_TASKS)
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "PMIX_SIZE",
                      "MV2_COMM_WORLD_SIZE", "PALS_RANKID", "MPI_LOCALNRANKS")


class BadInput(SystemExit):
    """Raised on every rank after rank 0 broadcast a bad-input verdict: exit code 2, no traceback."""

    def __init__(self, code: int = 2):
        super().__init__(code)


class _Done:
    """A nonblocking request that has completed."""

    def Test(self) -> bool:
        return True

    def Wait(self) -> None:
        pass


class Alone:
    """The communicator of a run of one rank that MPI was not started for: mpi4py's calls that a
    world of one rank answers without communicating (a collective is a copy, a barrier returns)
    and nothing else (a point-to-point call has no one to talk to, so it is absent: the run's
    code makes none at one rank)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Barrier(self) -> None:
        pass

    def Ibarrier(self) -> _Done:
        return _Done()

    def Bcast(self, buf, root: int = ROOT) -> None:
        pass

    def bcast(self, obj, root: int = ROOT):
        return obj

    def gather(self, obj, root: int = ROOT) -> list:
        return [obj]

    def allgather(self, obj) -> list:
        return [obj]

    def reduce(self, obj, op=None, root: int = ROOT):
        return obj

    def Allgather(self, sendbuf, recvbuf) -> None:
        recv = np.asarray(recvbuf)   # a view of the caller's buffer, written in place
        recv[...] = np.reshape(sendbuf, recv.shape)

    def Gather(self, sendbuf, recvbuf, root: int = ROOT) -> None:
        recv = np.asarray(recvbuf)   # a view of the caller's buffer, written in place
        recv[...] = np.reshape(sendbuf, recv.shape)

    def Split_type(self, split_type=None, key: int = 0, info=None) -> "Alone":
        return self

    def Dup(self) -> "Alone":
        return self

    def Free(self) -> None:
        pass

    def Abort(self, errorcode: int = 1) -> None:
        os._exit(errorcode)


ALONE = Alone()


def launched(environ=os.environ) -> bool:
    """Whether a launcher started this process as a rank of a job (its environment says so)."""
    return any(environ.get(var) for var in LAUNCHER_VARIABLES) or (
        "SLURM_STEP_ID" in environ and "SLURM_STEP_NUM_TASKS" in environ)


def world():
    """The run's communicator: MPI's COMM_WORLD where a launcher started this process or MPI is
    running already (a program of the user's that uses mpi4py), else ALONE, without starting MPI."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        if not launched():
            return ALONE
        from mpi4py import MPI
    ending.watch_job(MPI.COMM_WORLD)    # a signal to any rank ends the job through rank 0
    return MPI.COMM_WORLD


def launcher_world_size() -> int | None:
    """The world size the launcher promised, where it says so (to catch silent singletons)."""
    return ending.launcher_world_size()


def check_launcher(size: int) -> None:
    expected = launcher_world_size()
    if expected is not None and expected != size:
        raise InputError(f"the launcher started {expected} processes but MPI sees a world of "
                         f"{size}: mpi4py is linked to a different MPI than the launcher's")


def node_ranks(comm) -> tuple[int, int]:
    """(ranks on this rank's node, this rank's place among them)."""
    if comm.Get_size() == 1:
        return 1, 0
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size(), node.Get_rank()
    finally:
        node.Free()


def _row_type(columns: int):
    from mpi4py import MPI
    row = MPI.DOUBLE.Create_contiguous(columns)
    row.Commit()
    return row


def _check_buffer(array: np.ndarray) -> None:
    # Explicit [buffer, counts, displs, type] specs are trusted blindly by MPI.
    assert array.dtype == np.float64 and array.flags.c_contiguous, (array.dtype, array.flags)


def verdict(comm, status: int, message: str | None = None, own=None) -> int:
    """Every rank learns every rank's status, so that no rank is left waiting in a collective: 0
    go on; 2 bad input: rank 0 prints the message of the lowest rank that found some, every rank
    exits 2; 1 a bug: the ranks that hit it return (to re-raise it), the others exit 1. With
    --distribute read (`own`), the ranks' partitions must agree (same digest), and the return value
    is the union of the tree codes their rows use (a bit per code); else 0."""
    rank = comm.Get_rank()
    mine = np.array([status, own.digest if own else 0, own.trees if own else 0], dtype=np.int64)
    every = np.empty((comm.Get_size(), 3), dtype=np.int64)
    comm.Allgather(mine, every)
    statuses = every[:, 0].copy()
    if own is not None and not statuses.any() and (every[:, 1] != every[0, 1]).any():
        statuses[ROOT] = 2   # e.g. numpy builds that round the cost sums differently
        message = ("with --distribute read the ranks computed different partitions of the portfolio "
                   "(different numpy builds or processors?); use --distribute scatter")
    if (statuses == 1).any():
        if status == 1:
            return 0
        raise BadInput(1)
    if (statuses == 2).any():
        sender = int(np.flatnonzero(statuses == 2)[0])
        text = bcast_text(comm, message if rank == sender else None, sender)
        if rank == ROOT and _KEPT is not None:
            _KEPT.append(text)
        elif rank == ROOT:
            print(f"pricer: error: {'' if sender == ROOT else f'rank {sender}: '}{text}",
                  file=sys.stderr, flush=True)
        raise BadInput(2)
    return int(np.bitwise_or.reduce(every[:, 2]))


_KEPT: list | None = None    # keep_refusals': the refusals (InputError) and messages, not printed


@contextmanager
def keep_refusals():
    """Within it, a bad-input verdict's message is kept in the list it yields rather than printed,
    after the InputError that made it where this process raised it (the Python API raises that).
    The process's: one run at a time."""
    global _KEPT
    before, _KEPT = _KEPT, []
    try:
        yield _KEPT
    finally:
        _KEPT = before


def bcast_text(comm, text: str | None, root: int) -> str:
    """A message from rank `root` to every rank, as a byte buffer (its length first)."""
    data = np.frombuffer((text or "").encode(), dtype=np.uint8) if comm.Get_rank() == root else None
    length = np.array([data.size if data is not None else 0], dtype=np.int64)
    comm.Bcast(length, root=root)
    if data is None:
        data = np.empty(int(length[0]), dtype=np.uint8)
    comm.Bcast(data, root=root)
    return data.tobytes().decode()


def bcast_array(comm, array: np.ndarray | None) -> np.ndarray:
    """An int64 array of rank 0's, on every rank (its length first, then the buffer)."""
    length = np.array([len(array) if comm.Get_rank() == ROOT else 0], dtype=np.int64)
    comm.Bcast(length, root=ROOT)
    out = np.ascontiguousarray(array, dtype=np.int64) if comm.Get_rank() == ROOT \
        else np.empty(int(length[0]), dtype=np.int64)
    comm.Bcast(out, root=ROOT)
    return out


def distribute(comm, arrays: dict | None, bounds: np.ndarray, how: str) -> dict:
    """Each rank's rows bounds[r]:bounds[r+1] of rank 0's 1-D arrays (name -> array, one length;
    the others pass None), each in its own type: Scatterv of each (how="scatter"), or Bcast of
    all of it (how="bcast"). Rank 0's own rows stay where they are: views."""
    rank = comm.Get_rank()
    if comm.Get_size() == 1:
        return {name: array[bounds[0]:bounds[1]] for name, array in arrays.items()}
    from mpi4py import MPI
    # every rank learns the arrays' names and types (a few bytes), then the buffers travel
    kinds = comm.bcast([(name, array.dtype.str) for name, array in arrays.items()]
                       if rank == ROOT else None, root=ROOT)
    counts, n = np.diff(bounds), int(bounds[-1])
    out = {}
    for name, kind in kinds:
        dtype = np.dtype(kind)
        mpi_type = MPI.BYTE.Create_contiguous(dtype.itemsize)
        mpi_type.Commit()
        try:
            if how == "bcast":
                whole = np.ascontiguousarray(arrays[name]) if rank == ROOT \
                    else np.empty(n, dtype=dtype)
                comm.Bcast([whole, n, mpi_type], root=ROOT)
                out[name] = whole[bounds[rank]:bounds[rank + 1]]
            elif rank == ROOT:
                whole = np.ascontiguousarray(arrays[name])
                comm.Scatterv([whole, counts, bounds[:-1], mpi_type], MPI.IN_PLACE, root=ROOT)
                out[name] = whole[bounds[ROOT]:bounds[ROOT + 1]]
            else:
                local = np.empty(int(counts[rank]), dtype=dtype)
                comm.Scatterv(None, [local, int(counts[rank]), mpi_type], root=ROOT)
                out[name] = local
        finally:
            mpi_type.Free()
    return out


def gather_rows(comm, values: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """Rank 0 gets the (bounds[-1], k) float64 matrix of every rank's (n_local, k) rows, in rank
    order: one Gatherv of contiguous k-double rows (as the portfolio matrix is scattered)."""
    _check_buffer(values)
    assert values.ndim == 2 and values.shape[0] == bounds[comm.Get_rank() + 1] - bounds[comm.Get_rank()]
    if comm.Get_size() == 1:
        return values
    ncols = values.shape[1]
    row = _row_type(ncols)
    try:
        full = np.empty((int(bounds[-1]), ncols)) if comm.Get_rank() == ROOT else None
        recv = [full, np.diff(bounds), bounds[:-1], row] if full is not None else None
        comm.Gatherv([values, values.shape[0], row], recv, root=ROOT)
    finally:
        row.Free()
    return full


def attempt(action):
    """(result, status, message, failure) of action() in verdict's terms: status 0 and its
    result; 2 and the message of an InputError (bad input); 1 and the exception (a bug: every rank
    stops, this one re-raises it)."""
    try:
        return action(), 0, None, None
    except InputError as exc:
        if _KEPT is not None:       # keep_refusals: the refusal itself, its ids and column too
            _KEPT.append(exc)
        return None, 2, str(exc), None
    except Exception as exc:  # noqa: BLE001 - a bug: see above
        return None, 1, None, exc


def outcome(comm, action) -> None:
    """Rank 0 runs `action` (the others pass None) and everyone learns how it went: an InputError
    makes every rank exit 2 with its message, a bug every rank exit 1 (rank 0 re-raises it)."""
    _, status, message, failure = attempt(action) if action is not None else (None, 0, None, None)
    verdict(comm, status, message)
    if failure is not None:
        raise failure
