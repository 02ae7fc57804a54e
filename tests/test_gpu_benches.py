"""`pricer bench gpu|batch --quick` end to end on a real GPU, as a user runs them (marked gpu:
skipped without one; without a GPU they are refused, tests/test_refusals.py)."""

from __future__ import annotations

import json

import pytest

from gpu_cases import GPU
from helpers import run_pricer

pytestmark = GPU


@pytest.mark.parametrize("what", ["gpu", "batch"])
def test_gpu_bench_quick_mode_runs_end_to_end(tmp_path, what):
    out = tmp_path / "bench.json"
    proc = run_pricer(["bench", what, "--quick", "--out", out], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(out.read_text())
