"""Under mpiexec every rank runs this suite: give each rank its own junit report (PATH.rankN)."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from mpi4py import MPI

    if getattr(config.option, "xmlpath", None):
        config.option.xmlpath = f"{config.option.xmlpath}.rank{MPI.COMM_WORLD.Get_rank()}"
