"""How a `pricer` process ends: SIGTERM and SIGINT honoured at once with exit code 1 on any rank,
and a finished command's exit code kept whatever comes after (a late signal, the teardown).
pricer/cli.py's main() installs the one and reports the other (decided)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from pricer.files import end_process

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_decided: int | None = None      # the command's exit code, once it has returned
_ending = threading.Lock()


def _terminated(signum: int) -> None:
    """End the process for a signal: exit 1 with one line (the temporary files and the output's
    lock removed first), or, once the command has returned, with the code it decided. A rank of
    a job of several ends the whole job (MPI_Abort): a signal to one rank alone would otherwise
    leave the others waiting for it, and the launcher's exit code would depend on how it ended
    them (hydra: 1 at -n 2, 9 at -n 3); with the abort it is 1 whichever rank got the signal."""
    if _decided is not None:
        os._exit(_decided)
    _ending.acquire()      # two signals may both get here: the first ends the run
    end_process(f"pricer: terminated ({signal.Signals(signum).name})", _mpi_world())


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
    signal from now on exits with it. On a real command line (not main(argv) in a test) SIGTERM
    is ignored from here (the teardown that follows runs without Python's handlers, where it would
    still turn the code into 143), and a command that did not start MPI ends now (leave)."""
    global _decided
    _decided = code
    if not command_line:
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
