"""What a results file records about the run that wrote it: the command line, pricer's version
(and git commit, run from a checkout), the libraries' versions, and each rank's host and GPU."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np

from pricer import __version__

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit() -> str | None:
    """The checkout's commit (with -dirty for uncommitted changes) where pricer runs from a git
    checkout; None otherwise, or where git cannot say within two seconds."""
    if not os.path.exists(os.path.join(_ROOT, ".git")):
        return None
    try:
        done = subprocess.run(["git", "-C", _ROOT, "describe", "--always", "--dirty",
                               "--abbrev=40"], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def library_versions() -> dict:
    """numpy, numba, h5py, mpi4py (and its MPI library, where the run started MPI), and pycuda with
    the CUDA driver where the run loaded them."""
    import h5py
    import numba

    versions = {"python": sys.version.split()[0], "numpy": np.__version__,
                "numba": numba.__version__, "h5py": h5py.__version__}
    import mpi4py   # the package alone: its MPI library is loaded only by a run that started MPI

    versions["mpi4py"] = mpi4py.__version__
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized():
        # Open MPI ends its string with a NUL
        versions["mpi"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    else:
        versions["mpi"] = "not started (one rank, no launcher)"
    if "pycuda.driver" in sys.modules:
        import pycuda
        import pycuda.driver as cuda
        versions["pycuda"] = pycuda.VERSION_TEXT
        try:
            driver = cuda.get_driver_version()
            versions["cuda_driver"] = f"{driver // 1000}.{driver % 1000 // 10}"
        except Exception:   # noqa: BLE001 - a driver that cannot say is left out
            pass
    return versions


def provenance(hosts: list[str], gpus: list[str]) -> dict:
    """The results file's provenance attributes (strings; lists and mappings as JSON)."""
    attrs = {"command": shlex.join(sys.argv), "pricer_version": __version__,
             "libraries": json.dumps(library_versions(), sort_keys=True),
             "hosts": json.dumps(hosts), "gpus": json.dumps(gpus)}
    commit = git_commit()
    if commit:
        attrs["pricer_commit"] = commit
    return attrs
