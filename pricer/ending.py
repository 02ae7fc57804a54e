"""How a `pricer` process ends: SIGTERM and SIGINT honoured at once with exit code 1 on any rank,
and a finished command's exit code kept whatever comes after (a late signal, the teardown).
pricer/cli.py's main() installs the one and reports the other (decided).

A job of several ranks ends as one, its claims removed whichever rank got the signal. Rank 0 holds
the run's claims (the output's lock file, the checkpoint's) and MPI_Abort ends the other ranks by
SIGKILL, which no cleanup survives; so a rank other than 0 that gets a signal has rank 0 end the
job: it removes its own temporary files, sends rank 0 a notice (SIGNAL_TAG on COMM_WORLD), which a
thread of rank 0 listens for from MPI's start (watch_job) to the command's end, and rank 0 removes
its files and claims and calls MPI_Abort. Where rank 0 takes no notice (it is not listening, or
stopped), the rank aborts the job itself after NOTICE_WAIT seconds. A rank whose command has not
started MPI yet (its imports, its parser) ends the job once it has (watch_job): one that exited
alone would leave the others waiting in MPI_Init for ever (hydra ends a job only for a rank that
dies by a signal or leaves after MPI_Init); a command that returns without starting it exits 1."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

from pricer.files import (ABORT_FLUSH, CLEANUP_WAIT, cleanup_before_exit, end_process,
                          sweep_before_exit)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
SIGNAL_TAG = 7720    # FailureWatch's tag is 7717, Progress's 7718, the watchdog's 7719
LISTEN_POLL = 0.05   # seconds between rank 0's looks for a notice
NOTICE_WAIT = 5.0    # seconds a rank waits for rank 0 to take its notice, and then for the abort
                     # beyond rank 0's own cleanup and flush
PENDING_WAIT = 60.0  # seconds a signal waits for the command to start MPI before the process ends
                     # alone (a second signal ends it at once)
_decided: int | None = None      # the command's exit code, once it has returned
_ending = threading.Lock()
_installed = False               # exit_1_on_signals has run: this process is the pricer command
_state = threading.Lock()        # _started and _pending, between the signal thread and the main
_started = False                 # the command has started MPI (watch_job)
_pending: int | None = None      # a signal that came before it did, to a rank of several
_may_start = True                # the command may start MPI (command_starts_mpi)
_not_rank_0 = False              # a rank other than 0 of a job whose rank 0 listens (watch_job)
_listener: tuple | None = None   # rank 0: (its thread, the event that stops it)

# what a launcher sets in each rank's environment to the job's rank count (pricer.run.collectives
# names the launchers)
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def launcher_world_size(environ=os.environ) -> int | None:
    """The world size the launcher promised, where it says so."""
    for var in SIZE_VARIABLES:
        if environ.get(var, "").isdigit():
            return int(environ[var])
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_STEP_NUM_TASKS", "").isdigit():
        return int(environ["SLURM_STEP_NUM_TASKS"])
    return None


def _terminated(signum: int) -> None:
    """End the process for a signal: exit 1 with one line (the temporary files and the output's
    lock removed first), or, once the command has returned, with the code it decided. A rank of
    a job of several ends the whole job (MPI_Abort): a signal to one rank alone would otherwise
    leave the others waiting for it, and the launcher's exit code would depend on how it ended
    them (hydra: 1 at -n 2, 9 at -n 3); with the abort it is 1 whichever rank got the signal."""
    global _pending
    if _decided is not None:
        if _not_rank_0:
            return     # it waits in MPI_Finalize for rank 0, whose run is not over: an exit now
                       # would have the launcher kill rank 0 and report this rank's code
        os._exit(_decided)
    with _state:
        if not _started and _pending is None and _may_start and (launcher_world_size() or 1) > 1:
            _pending = signum      # ended by watch_job, decided, or the timer
            timer = threading.Timer(PENDING_WAIT, _end, (signum,))
            timer.daemon = True
            timer.start()
            return
    _end(signum)


def _end(signum: int) -> None:
    """_terminated's end: alone, or the job's (through rank 0 from another rank)."""
    _ending.acquire()      # two signals may both get here: the first ends the run
    line = f"pricer: terminated ({signal.Signals(signum).name})"
    world = _mpi_world()
    if world is not None and _not_rank_0:
        cleanup_before_exit()          # this rank's files: MPI_Abort's SIGKILL leaves them
        if _tell_rank_0(world, signum):
            sweep_before_exit()    # a file a write was making meanwhile; rank 0 ends the job now
            time.sleep(CLEANUP_WAIT + ABORT_FLUSH + NOTICE_WAIT)
            line += "; rank 0 did not end the job"
        else:
            line += "; rank 0 did not answer"
        _abort(line, world)
    end_process(line, world)


def _tell_rank_0(world, signum: int) -> bool:
    """Send rank 0 the notice of `signum`; whether it took it within NOTICE_WAIT seconds (a
    synchronous send: complete once rank 0's listener has received it)."""
    from mpi4py import MPI

    request = world.Issend([bytearray(signum.to_bytes(4, "little")), MPI.BYTE], dest=0,
                           tag=SIGNAL_TAG)
    deadline = time.monotonic() + NOTICE_WAIT
    while time.monotonic() < deadline:
        if request.Test():
            return True
        time.sleep(0.01)
    return False


def _abort(line: str, world) -> None:
    """files.end_process's end, for a process whose cleanup has been made (never returns)."""
    try:
        sys.stdout.flush()
        os.write(2, f"{line}\n".encode())
        time.sleep(ABORT_FLUSH)
        sweep_before_exit()
        world.Abort(1)
    finally:
        os._exit(1)


def command_starts_mpi(starts: bool) -> None:
    """Whether the command will start MPI (under a launcher); one that will not ends for a signal
    at once, a signal that came before included."""
    global _may_start
    with _state:
        _may_start = starts
        pending = None if starts or _started else _pending
    if pending is not None:
        _end(pending)


def watch_job(world) -> None:
    """Called where the command has started MPI (collectives.world): in a job of several ranks
    whose MPI serves threads (MPI_THREAD_MULTIPLE), rank 0 listens for the other ranks' signals
    until the command has decided its code (_listen); the others send theirs there (_end). A
    signal that came before ends the job now. Nothing where this process is not the pricer
    command (its signals are its program's)."""
    global _listener, _not_rank_0, _started
    if not _installed or _started:
        return
    from mpi4py import MPI
    if world.Get_size() > 1 and MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        _not_rank_0 = world.Get_rank() != 0
        if not _not_rank_0:
            stop = threading.Event()
            thread = threading.Thread(target=_listen, args=(world, stop),
                                      name="pricer-rank-signals", daemon=True)
            _listener = (thread, stop)
            thread.start()
            atexit.register(_stop_listening)   # before MPI_Finalize, which mpi4py calls last
    with _state:
        _started = True
        pending = _pending
    if pending is not None:
        _end(pending)


def _listen(world, stop: threading.Event) -> None:
    """Rank 0: wait for a notice; end the job for it (files and claims removed, MPI_Abort)."""
    from mpi4py import MPI

    notice, status = bytearray(4), MPI.Status()
    request = world.Irecv([notice, MPI.BYTE], source=MPI.ANY_SOURCE, tag=SIGNAL_TAG)
    while not stop.wait(LISTEN_POLL):
        if request.Test(status):
            if _decided is None:
                _ending.acquire()
                name = signal.Signals(int.from_bytes(notice, "little")).name
                end_process(f"pricer: terminated ({name}) on rank {status.Get_source()}", world)
            return     # the command is over: the rank aborts the job itself (NOTICE_WAIT)
    request.Cancel()
    request.Wait()


def _stop_listening() -> None:
    global _listener
    if _listener is not None:
        thread, stop = _listener
        _listener = None
        stop.set()
        thread.join()


def _mpi_world():
    """COMM_WORLD if this process has started MPI in a job of several ranks, else None (MPI is
    not imported just to look: a command that never started it has no one else to end)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() > 1 else None


def exit_1_on_signals() -> None:
    """SIGTERM and SIGINT (Ctrl-C) end pricer with exit code 1 (anything else), no traceback,
    rather than death by the signal (143) or a KeyboardInterrupt. `srun --kill-on-bad-exit=1`
    (slurm/) terminates a step's other ranks once one exits non-zero and reports the largest of
    the ranks' codes: a slower rank terminated on its way out must not turn the job's 2 into 143,
    hence the decided code wins once the command has returned.
    The signals are honoured at once whatever the main thread is doing: a Python handler runs only
    between the main thread's bytecodes (a kernel pricing one option of millions of steps held it
    for minutes), so the handler's C part, which runs in whichever thread the signal reaches,
    writes the signal's number to a pipe (signal.set_wakeup_fd) that a thread of ours waits on and
    ends the run from; the Python handler itself does nothing (it could run in the middle of an
    output's claim, whose cleanup must wait for it)."""
    global _installed
    if _installed:
        return
    _installed = True
    for signum in SIGNALS:   # caught (not the default, death), and handled by the thread below
        signal.signal(signum, lambda number, frame: None)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch():
        while True:
            got = os.read(read_end, 1)
            if got and got[0] in SIGNALS:
                _terminated(got[0])

    threading.Thread(target=watch, name="pricer-signals", daemon=True).start()


def decided(code: int | None, command_line: bool) -> None:
    """The command has returned `code` (None: an uncaught exception, left to the excepthook). A
    signal from now on exits with it; one that came before MPI was started ends it with 1 now.
    On a real command line (not main(argv) in a test) SIGTERM is ignored from here (the teardown
    that follows runs without Python's handlers, where it would still turn the code into 143),
    and SIGINT too on a rank other than 0 of a job (it waits for rank 0 in MPI_Finalize: its end
    would have the launcher kill rank 0); a command that did not start MPI ends now (leave)."""
    global _decided
    with _state:
        pending = None if _started else _pending
        _decided = code
    if pending is not None:      # it came before the command's end, which never started MPI
        _end(pending)
    _stop_listening()
    if not command_line:
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _not_rank_0:            # _terminated's reason; the interpreter's end restores SIGINT's
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # default handler, not SIG_IGN
    MPI = sys.modules.get("mpi4py.MPI")
    if code is not None and (MPI is None or not MPI.Is_initialized()):
        leave(code)


def leave(code: int) -> None:
    """End a command that did not start MPI with `code` now that it has finished: its output
    flushed and the exit handlers run (the GPU context's release), but not the interpreter's
    teardown, which frees numba's compiled code and every module one by one (~0.25 s of every
    command on 2 cores, and nothing a finished command needs). A rank of an MPI job ends the
    ordinary way, MPI_Finalize last: MPICH's hydra can kill (exit 9) a rank that ends by os._exit
    right after MPI_Finalize, at 3 and 4 ranks on a loaded 2-core host."""
    import atexit

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):   # a reader that left (`| head`), a closed stream
            pass
        except OSError:   # output lost (a full disk): not a success, as Python's own exit says
            code = code or 120
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(code)
