"""Shared fixtures. MPI tests live in tests/mpi/ and run only under `mpiexec ... pytest --with-mpi`
(tests/test_mpi_suite.py starts those runs and fails if they ran no test)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent


def pytest_ignore_collect(collection_path, config):
    if collection_path.name == "mpi" and collection_path.is_dir():
        return not config.getoption("--with-mpi", default=False)
    return None


@pytest.fixture
def rng(request):
    """Fresh random inputs on every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("PRICER_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
    print(f"PRICER_TEST_SEED={seed}")
    return np.random.default_rng(seed)
