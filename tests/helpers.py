"""Running the real `pricer` command (and `mpiexec`) from tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """The launcher beside this Python (the mpich extra installs one), else the one on PATH."""
    local = BIN / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise RuntimeError("no mpiexec: install the mpich extra (pip install '.[mpich]') or an MPI")
    return found


def pricer_command() -> list[str]:
    exe = BIN / "pricer"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pricer"]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    # MPICH busy-waits; with more ranks than cores (3 on a 2-core CI machine) a waiting rank then
    # takes the CPU from the one it waits for: heavy yield gives it back (the MPI suite at 3 ranks
    # 55 -> 44 s here)
    e.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return e


def run_pricer(args, ranks: int | None = None, timeout: float = 120, cwd=None,
               extra_env: dict | None = None):
    """Run `pricer ARGS` (under `mpiexec -n RANKS` if ranks is given, with `extra_env` set);
    returns CompletedProcess."""
    cmd = pricer_command() + [str(a) for a in args]
    if ranks is not None:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(env(), **(extra_env or {})), cwd=cwd)


@contextmanager
def launched(cmd: list[str], environ: dict):
    """`cmd` started in its own session (the job and every rank it launches one process group),
    text pipes for stdout and stderr; on leaving, the group is killed if the job still runs."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=environ, start_new_session=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
