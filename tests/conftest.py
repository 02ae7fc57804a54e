"""Shared fixtures. MPI tests live in tests/mpi/ and run only under `mpiexec ... pytest --with-mpi`
(tests/test_mpi_suite.py starts those runs and fails if they ran no test)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def _numba_cache_dir() -> str:
    """A numba cache keyed by the pricer sources. Numba invalidates a cached kernel only when its own
    file changes, so after an edit of engines/serial.py the cached cpu/gpu kernels that inline the
    serial building blocks would still run the old code (and stop being bitwise equal to serial).
    One directory per source hash (under NUMBA_CACHE_DIR if set, else the temp dir) rules that out
    for the tests and their subprocesses, and still reuses compiled kernels between runs."""
    digest = hashlib.sha256()
    for path in sorted((HERE.parent / "pricer").rglob("*.py")):
        digest.update(path.relative_to(HERE.parent).as_posix().encode() + b"\0" + path.read_bytes())
    tag = f"pricer-numba-{digest.hexdigest()[:16]}"
    base = os.environ.get("NUMBA_CACHE_DIR") or tempfile.gettempdir()
    return base if Path(base).name == tag else os.path.join(base, tag)


os.environ["NUMBA_CACHE_DIR"] = _numba_cache_dir()

# The cpu engine's parallel paths need at least two numba threads; numba reads this at import, so
# set it before anything imports numba (threads beyond the cores are allowed, just not faster).
if (os.cpu_count() or 1) < 2:
    os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only with PRICER_SLOW=1 (setup.cfg's addopts are shared, so not there)."""
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
