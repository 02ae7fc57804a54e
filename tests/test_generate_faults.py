"""`pricer generate` and a job's [portfolio.generate] under faults (docs/reliability.md, "Refused
before any work", "A full disk", "One output, one run"): the output claimed as a run claims its
own, so that two writers of one path never both succeed; a disk too small refused before the
write and a write that fails all the same leaving nothing; a job's generate block checked as the
command checks it, and a refused job leaving no book behind. Real processes, run concurrently
where the fault is a race, a real small tmpfs, a real file-size limit."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import h5py
import pytest

from helpers import env, launched, run_pricer
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from pricer.tools.generate import generate
from test_refusals import HANG_TIMEOUT, refused, small_disk  # noqa: F401 - a fixture

PRICER = [sys.executable, "-m", "pricer"]


def _generate_args(path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f["portfolio"].attrs["generate_args"])


def _leftovers(folder, *kept) -> list:
    """What a folder holds beyond `kept`: a partial, temporary or lock file."""
    return sorted(set(os.listdir(folder)) - set(kept))


# ------------------------------------------------------------------------ one output, one writer

def test_two_generates_of_one_path_started_together_one_is_refused(tmp_path):
    """Two real generates of one path, started together, each long enough (--market-prices
    prices the book) that neither has written when the other starts: one writes its book, the
    other exits 2 with one line (the claim is held, or the book exists), never both exit 0 with
    the last one's book replacing the first's."""
    out = tmp_path / "g.h5"
    cmd = PRICER + ["generate", "--dist", "uniform", "--count", "1000", "--steps", "1000",
                    "--market-prices", "-o", str(out), "--seed"]
    jobs = [subprocess.Popen(cmd + [seed], env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    ends = [job.communicate(timeout=HANG_TIMEOUT) for job in jobs]
    codes = [job.returncode for job in jobs]
    assert sorted(codes) == [0, 2], (codes, ends)
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    stderr = ends[loser][1]
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert "another run is writing it" in stderr or "exists" in stderr, stderr
    assert _generate_args(out)["seed"] == winner + 1
    assert _leftovers(tmp_path, "g.h5") == []


JOB = """
[portfolio]
path = "{path}"
[portfolio.generate]
dist = "uniform"
count = {count}
steps = {steps}
[pricing]
backend = "serial"
[output]
path = "job-out.h5"
"""


def test_generate_while_a_run_writes_that_path_is_refused(tmp_path):
    """A price run that has begun pricing into X.h5 holds its claim (stopped by SIGSTOP in the
    middle, so that the window is the test's, not the clock's): `pricer generate -o X.h5` and a
    job that generates X.h5 are refused naming the holder, and the run, once continued, writes
    its own results there."""
    book = tmp_path / "slow.h5"
    write_portfolio(str(book), generate("random", 4000, seed=5, max_steps=200))
    out, folder = tmp_path / "X.h5", tmp_path / "ck"
    (tmp_path / "job.toml").write_text(JOB.format(path=out, count=10, steps=16))
    slow = dict(env(), PRICER_CHUNK_DELAY="0.3")
    with launched(PRICER + ["price", str(book), "-o", str(out), "--backend", "serial",
                            "--chunk-nodes", "2e6", "--checkpoint", str(folder)], slow) as run:
        # pricing has begun (the claim is taken before it): its first chunk is saved
        while not (folder.is_dir() and any(n.startswith("chunk-") for n in os.listdir(folder))) \
                and run.poll() is None:
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGSTOP)
        try:
            for args in (["generate", "--dist", "uniform", "--count", "10", "-o", out],
                         ["run", "job.toml"]):
                refused(run_pricer(args, cwd=tmp_path), str(out), "another run is writing it",
                        f'"pid": {run.pid}')
                assert not out.exists()
        finally:
            os.killpg(run.pid, signal.SIGCONT)
        _, stderr = run.communicate(timeout=HANG_TIMEOUT)
    assert run.returncode == 0, stderr
    assert read_results(str(out))["id"].size == 4000
    assert _leftovers(tmp_path, "slow.h5", "X.h5", "ck", "job.toml") == []


# ---------------------------------------------------------------------------------- a full disk

@pytest.mark.parametrize("args,name", [
    (["--dist", "random", "--count", "400000"], "g.h5"),
    (["--bonds", "R1", "--count", "100000"], "b.h5"),
    (["--dist", "random", "--count", "400000"], "g.csv"),
])
def test_generate_onto_a_disk_too_small_is_refused(small_disk, args, name):  # noqa: F811
    """A real 2 MiB tmpfs: exit 2, one line with the numbers, nothing on the disk (no partial,
    temporary or lock file)."""
    proc = run_pricer(["generate", *args, "-o", small_disk / name])
    refused(proc, f"{small_disk / name}: not enough disk space", "needs", "free")
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert os.listdir(small_disk) == []


def _file_size_limit(nbytes: int):
    def limit() -> None:      # Python ignores SIGXFSZ: the write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


@pytest.mark.parametrize("args,name", [
    (["--dist", "random", "--count", "400000"], "g.h5"),
    (["--bonds", "R1", "--count", "100000"], "b.h5"),
    (["--dist", "random", "--count", "400000"], "g.parquet"),
])
def test_a_generate_whose_write_fails_leaves_nothing(tmp_path, args, name):
    """The disk has room, but the write fails all the same (a file-size limit of 1 MiB, as a
    quota or a disk that fills meanwhile would): exit 1, one line saying so, no traceback, no
    partial, temporary or lock file."""
    proc = subprocess.run(PRICER + ["generate", *args, "-o", str(tmp_path / name)], env=env(),
                          capture_output=True, text=True, timeout=HANG_TIMEOUT,
                          preexec_fn=_file_size_limit(1 << 20))
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{tmp_path / name}: the " in proc.stderr and "could not be written" in proc.stderr
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ a job's [portfolio.generate]

@pytest.mark.parametrize("path,count,steps,ranks,needles", [
    ("gen.h5", 100_000_000_000, 100, None,
     ("portfolio.generate.count 100000000000", "GiB of memory")),
    ("nodir/gen.h5", 10, 100, None, ("nodir/gen.h5", "does not exist")),
    ("gen.h5", 10, 1_000_000_000_000, None, ("gen.h5", "column steps is too large")),
    ("gen.h5", 10, 1_000_000_000_000, 2, ("gen.h5", "column steps is too large")),
    ("gen.h5", -3, 100, None, ("portfolio.generate.count must be >= 1",)),
])
def test_a_jobs_generate_block_is_checked_as_generate_is(tmp_path, path, count, steps, ranks,
                                                         needles):
    """Exit 2, one line, nothing left behind: the book a refused job generated is removed too."""
    (tmp_path / "job.toml").write_text(JOB.format(path=path, count=count, steps=steps))
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path, ranks=ranks), *needles)
    assert os.listdir(tmp_path) == ["job.toml"]


def test_a_jobs_generated_book_onto_a_disk_too_small_is_refused(tmp_path, small_disk):  # noqa: F811
    (tmp_path / "job.toml").write_text(JOB.format(path=small_disk / "gen.h5", count=400_000,
                                                  steps=16))
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), "not enough disk space")
    assert os.listdir(small_disk) == [] and sorted(os.listdir(tmp_path)) == ["job.toml", "small"]
