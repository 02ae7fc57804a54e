"""Fuzzed bad input through real launches: cases from tests/fuzz_portfolios.py's
generator, each run as `mpiexec -n 3 pricer price BAD.h5 -o OUT.h5`: exit 2, one message naming
the cause, no traceback, nothing written, the input unchanged. Each launch must end (a 120 s
timeout against hangs); how long it took is printed, not bounded (a busy host is no failure). The
bulk of the cases run in-process on every rank (tests/mpi/test_fuzz.py); a launch per case costs
~1.5 s here.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from fuzz_portfolios import draw_cases, message_problems
from helpers import run_pricer

HANG_TIMEOUT = 120   # seconds: a launch still running then has hung


def _digest(path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _run_cases(tmp_path, count: int) -> None:
    seed = int(os.environ.get("PRICER_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"PRICER_TEST_SEED={seed}")
    problems, slowest = [], 0.0
    for i, case in enumerate(draw_cases(count, seed)):
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        path, out = folder / "book.h5", folder / "prices.h5"
        case.write(str(path))
        before = (sorted(os.listdir(folder)), _digest(path))
        start = time.perf_counter()
        proc = run_pricer(["price", path, "-o", out], ranks=3, timeout=HANG_TIMEOUT)
        slowest = max(slowest, time.perf_counter() - start)
        found = [] if proc.returncode == 2 else [f"exit code {proc.returncode}"]
        found += message_problems(case, str(path), proc.stderr)
        if (sorted(os.listdir(folder)), _digest(path)) != before:
            found.append("files changed")
        problems += [f"case {i} {case!r}: {p}" for p in found]
    print(f"{count} launches, the slowest {slowest:.1f} s")
    assert not problems, "\n".join(problems)


@pytest.mark.heavy
def test_fuzzed_bad_input_mpiexec_3(tmp_path):
    _run_cases(tmp_path, int(os.environ.get("PRICER_FUZZ_CLI_CASES", 12)))


@pytest.mark.slow
def test_fuzzed_bad_input_mpiexec_3_long(tmp_path):
    _run_cases(tmp_path, int(os.environ.get("PRICER_FUZZ_CLI_LONG_CASES", 200)))
