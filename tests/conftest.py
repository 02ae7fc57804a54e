"""Shared fixtures. MPI tests live in tests/mpi/ and run only under `mpiexec ... pytest --with-mpi`
(tests/test_mpi_suite.py starts those runs and fails if they ran no test)."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).parent


# The cpu engine's parallel paths need at least two numba threads; numba reads this at import, so
# set it before anything imports numba (threads beyond the cores are allowed, just not faster).
if (os.cpu_count() or 1) < 2:
    os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`heavy` tests first (the suite's longest: under pytest-xdist's two workers they start
    first, so that neither worker is left with one at the end); `slow` tests run only with
    PRICER_SLOW=1 (setup.cfg's addopts are shared, so not there)."""
    items.sort(key=lambda item: "heavy" not in item.keywords)     # stable: the order otherwise
    if os.environ.get("PRICER_SLOW", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow: set PRICER_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
