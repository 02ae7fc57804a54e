"""This process's place on its node, as the launcher says before MPI or CUDA start: its local
rank, and the one GPU it is shown (CUDA_VISIBLE_DEVICES); and CUDA's start (cuInit) on a thread of
its own beside the imports, which a run of a GPU backend would otherwise wait for. Standard
library only, so that the command line can call it before numpy, numba or MPI are imported."""

from __future__ import annotations

import glob
import importlib.util
import os
import threading

LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MPI_LOCAL_RANK",
                        "PMI_LOCAL_RANK", "SLURM_LOCALID")


def launcher_local_rank(environ=os.environ) -> int | None:
    """This process's rank on its node as the launcher (Open MPI, MPICH's hydra, Slurm) says, or None."""
    for var in LOCAL_RANK_VARIABLES:
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def show_each_rank_its_gpu(environ=os.environ, gpus: int | None = None) -> None:
    """On a node with several GPUs, where the launcher set no CUDA_VISIBLE_DEVICES, show this rank
    only GPU (local rank mod GPUs) -- the one GpuRuntime would pick -- before CUDA starts: otherwise
    every rank's CUDA start sets up every GPU of the node, and the ranks queue for the driver.
    PRICER_GPU_PIN=0 leaves the variable alone."""
    if "CUDA_VISIBLE_DEVICES" in environ or environ.get("PRICER_GPU_PIN", "1") == "0":
        return
    local = launcher_local_rank(environ)
    if gpus is None:   # the driver's list: counting the GPUs must not start CUDA
        gpus = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    if local is not None and gpus > 1:
        environ["CUDA_VISIBLE_DEVICES"] = str(local % gpus)


def start_cuda_beside() -> threading.Thread | None:
    """cuInit on a thread of its own, once this rank is shown its GPU: the driver's start takes
    ~0.1 s in one process and ~0.5 s when every rank of a node starts it at once, and pycuda
    releases the GIL for it, so it runs beside the imports and MPI's start rather than in the
    run's engine start. Nothing where pycuda is missing or PRICER_NO_GPU is set; a failure is
    left to the run's own checks (engines.gpu_available), which name it."""
    if os.environ.get("PRICER_NO_GPU", "") not in ("", "0") \
            or importlib.util.find_spec("pycuda") is None:
        return None
    show_each_rank_its_gpu()

    def init() -> None:
        try:
            import pycuda.driver as cuda
            cuda.init()
        except Exception:  # noqa: BLE001 - gpu_available() calls cuInit again and decides
            pass

    thread = threading.Thread(target=init, name="pricer-cuda-init", daemon=True)
    thread.start()
    return thread
