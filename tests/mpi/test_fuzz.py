"""Fuzzed bad input, collectively under `mpiexec -n K python -m pytest --with-mpi tests/mpi`:
rank 0 draws ~1000 malformed portfolio files from hypothesis (tests/fuzz_portfolios.py), and for
each one every rank calls the real entry point, `pricer.cli.main(["price", ...])`, in-process — the
code `mpiexec -n 3 pricer price` runs, without paying a launch per case; every other case with
`--distribute read`, where each rank reads and checks its own rows. Every rank must exit 2 (return
from the command: a rank that never did would hold the gather after each case, and the MPI
suite's 600 s mpiexec timeout in tests/test_mpi_suite.py ends such a hang), rank 0 alone prints
one message naming the cause, the input is unchanged and nothing is written. The slowest exit of
any rank is recorded (PRICER_FUZZ_REPORT: docs/reliability.md's figures), not bounded: a busy host
is no failure. (tests/test_fuzz_cli.py runs a few dozen of the same cases through real launches.)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fuzz_portfolios import draw_cases, message_problems  # noqa: E402

from pricer.cli import main  # noqa: E402

comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()
ROOT = 0
DISTRIBUTIONS = ("scatter", "read")

pytestmark = pytest.mark.mpi(min_size=2)


def _digest(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _call_cli(argv: list[str]):
    """The CLI on this rank, as `pricer` would run it: (exit code, stderr, seconds)."""
    hook = sys.excepthook
    err = io.StringIO()
    start = time.perf_counter()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - a bug, reported per case below
        code = f"raised {exc!r}"
    finally:
        sys.excepthook = hook  # main() installs the MPI abort hook each call
    return code, err.getvalue(), time.perf_counter() - start


def fuzz(count: int, seed: int) -> dict:
    """Run `count` cases on every rank; rank 0 returns the figures and the problems found."""
    folder = comm.bcast(tempfile.mkdtemp(prefix="pricer-fuzz-") if RANK == ROOT else None)
    cases = draw_cases(count, seed) if RANK == ROOT else None
    total = comm.bcast(len(cases) if RANK == ROOT else None)
    problems, worst, kinds = [], 0.0, {}
    try:
        for i in range(total):
            path, out = os.path.join(folder, f"case{i}.h5"), os.path.join(folder, f"out{i}.h5")
            before = None
            if RANK == ROOT:
                cases[i].write(path)
                before = (sorted(os.listdir(folder)), _digest(path))
                kinds[cases[i].name] = kinds.get(cases[i].name, 0) + 1
            comm.Barrier()
            # every other case with --distribute read: every rank checks its own rows
            code, err, seconds = _call_cli(["price", path, "-o", out, "--quiet", "--threads", "1",
                                            "--distribute", DISTRIBUTIONS[i % 2]])
            reports = comm.gather((code, err, seconds), root=ROOT)
            if RANK == ROOT:
                worst = max(worst, max(s for _, _, s in reports))
                problems += [f"case {i} {cases[i]!r}: {p}"
                             for p in _case_problems(cases[i], path, folder, before, reports)]
                _remove(path)
    finally:
        comm.Barrier()
        if RANK == ROOT:
            shutil.rmtree(folder, ignore_errors=True)
    return {"cases": total, "seed": seed, "slowest_exit_s": worst, "kinds": kinds,
            "problems": problems} if RANK == ROOT else {}


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _case_problems(case, path, folder, before, reports) -> list[str]:
    problems = []
    codes = [code for code, _, _ in reports]
    if codes != [2] * len(reports):
        problems.append(f"exit codes {codes} (stderr {reports[0][1]!r})")
    problems += message_problems(case, path, reports[0][1])
    if any(err for _, err, _ in reports[1:]):
        problems.append(f"ranks other than 0 printed {[e for _, e, _ in reports[1:]]}")
    if (sorted(os.listdir(folder)), _digest(path)) != before:
        problems.append(f"files changed: {before[0]} -> {sorted(os.listdir(folder))}, or the input")
    return problems


def _seed() -> int:
    value = int(os.environ.get("PRICER_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    return comm.bcast(value, root=ROOT)


def _check(count: int) -> None:
    seed = _seed()
    print(f"PRICER_TEST_SEED={seed}")
    start = time.perf_counter()
    figures = fuzz(count, seed)
    errors = None
    if RANK == ROOT:
        figures["ranks"], figures["seconds"] = SIZE, round(time.perf_counter() - start, 1)
        report = os.environ.get("PRICER_FUZZ_REPORT")  # docs/reliability.md's figures come from here
        if report:
            Path(f"{report}.{SIZE}").write_text(json.dumps(figures, indent=1))
        print(json.dumps({k: v for k, v in figures.items() if k != "problems"}))
        errors = figures["problems"][:20]
        if figures["cases"] < count:
            errors.append(f"hypothesis drew only {figures['cases']} cases")
    errors = comm.bcast(errors, root=ROOT)
    assert not errors, "\n".join(errors)


def test_fuzzed_bad_input_every_rank_exits_2():
    """~1000 cases at 3 ranks (the required count), 100 at 2 ranks (the same code, another size);
    the long run (PRICER_SLOW=1) draws 10 000 at 3 ranks. (One test, not a `slow`-marked second
    one: tests/test_mpi_suite.py fails on any skipped MPI test.)"""
    slow = os.environ.get("PRICER_SLOW", "") not in ("", "0")
    default = (10000 if slow else 1000) if SIZE == 3 else (1000 if slow else 100)
    _check(int(os.environ.get("PRICER_FUZZ_CASES", default)))
