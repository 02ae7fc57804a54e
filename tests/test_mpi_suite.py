"""Runs the pytest-mpi suite (tests/mpi) under `mpiexec -n 2` and `-n 3`, with a timeout, and fails
if it failed, hung, or ran no MPI test at all (pytest-mpi skips MPI tests silently without --with-mpi)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers import ROOT, env, mpiexec


@pytest.mark.heavy
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_suite(ranks, tmp_path):
    report = tmp_path / "junit.xml"
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "pytest", "--with-mpi", "-q",
           "-p", "no:cacheprovider", f"--junitxml={report}", str(ROOT / "tests" / "mpi")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"MPI suite at {ranks} ranks hung (600 s): {exc.stdout}")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    for rank in range(ranks):
        suite = ET.parse(f"{report}.rank{rank}").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
        failed = int(suite.get("failures")) + int(suite.get("errors"))
        assert tests >= 5 and skipped == 0 and failed == 0, (rank, tests, skipped, failed,
                                                            proc.stdout[-3000:])
