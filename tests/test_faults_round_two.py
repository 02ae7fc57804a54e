"""Faults of the second hostile sweep (docs/reliability.md): a signal to any rank of a real
`mpiexec -n 2` job at any moment; `pricer scaling`'s refusals; the messages of odd input (threads,
CSV cells, Parquet nulls, scenario grids, `pricer info` of a mixed file)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import env, launched, mpiexec, pricer_command, run_pricer
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from test_reliability import (HANG_TIMEOUT, _chunks, _stopped, leftover_processes, make_book,
                              rank_pid, wait_while)
from test_reliability import book  # noqa: F401  (the fixture of its book, shared)

REPEATS = 3     # the signal tests' runs each: what they catch was intermittent


def _job(book_path, folder, extra_env=None, checkpoint=True):
    out = folder / "prices.h5"
    e = env()
    e.update({"PRICER_CHUNK_DELAY": "0.2", "PRICER_PROGRESS": "off", **(extra_env or {})})
    cmd = [mpiexec(), "-n", "2"] + pricer_command() + [
        "price", str(book_path), "-o", str(out), "--chunk-nodes", "2e4", "--threads", "1"]
    if checkpoint:
        cmd += ["--checkpoint", str(folder / "ck")]
    return cmd, e, out


def _ranks(out) -> list[int]:
    return [rank_pid(str(out), rank) for rank in (0, 1)]


def _mapped(pid: int, name: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:
        return False


def _signal_mask(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _nothing_left(folder, out):
    """No output, no lock file, no temporary file (in the folder or the checkpoint), no process."""
    left = sorted(os.listdir(folder))
    assert left in (["ck"], []), left
    if (folder / "ck").exists():
        assert [n for n in os.listdir(folder / "ck") if n.startswith(".")] == []
    assert leftover_processes(str(out)) == []


def _signalled_rank_1(book_path, folder, signum, moment):
    """One run of the job, `signum` to rank 1 at `moment`: (exit code, stderr)."""
    cmd, e, out = _job(book_path, folder)
    with launched(cmd, e) as job:
        pid = rank_pid(str(out), 1)
        if moment == "importing":
            wait_while(job, lambda: not _mapped(pid, "_multiarray_umath"))
        elif moment == "claimed":
            wait_while(job, lambda: not (folder / ".prices.h5.lock").exists())
        else:
            wait_while(job, lambda: _chunks(folder / "ck") < 4)
        assert job.poll() is None, job.communicate()
        os.kill(pid, signum)
        _, stderr = job.communicate(timeout=HANG_TIMEOUT)
    _nothing_left(folder, out)
    return job.returncode, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("moment", ["importing", "claimed", "pricing"])
def test_a_signal_to_rank_1_ends_the_job_with_exit_1_and_no_claim_left(tmp_path, book, signum,
                                                                       moment):
    """SIGTERM or SIGINT to rank 1 (not the claim's holder) of `mpiexec -n 2 pricer price
    --checkpoint`: while its interpreter imports numpy (before MPI has started), as soon as rank
    0 holds the claims, and while chunks are priced. Exit 1, one `pricer: terminated` line, no
    traceback, no output, and neither the output's nor the checkpoint's lock file left (MPI_Abort
    kills rank 0 outright: rank 0 removes them before the abort)."""
    name = signal.Signals(signum).name
    for attempt in range(REPEATS):
        folder = tmp_path / f"run-{attempt}"
        folder.mkdir()
        code, stderr = _signalled_rank_1(book[0], folder, signum, moment)
        assert code == 1, (attempt, code, stderr)
        assert f"pricer: terminated ({name})" in stderr and "Traceback" not in stderr, stderr


def test_sigterm_to_rank_0_before_mpi_has_started_ends_the_job_with_exit_1(tmp_path, book):
    """SIGTERM to rank 0 while its interpreter imports numpy: held until its command has started
    MPI, then the job's end (exit 1, nothing left) — a rank 0 that exited alone there left rank 1
    in MPI_Init for ever (seen: a hang), one killed by the signal made the launcher's 15."""
    for attempt in range(REPEATS):
        folder = tmp_path / f"run-{attempt}"
        folder.mkdir()
        cmd, e, out = _job(book[0], folder)
        with launched(cmd, e) as job:
            pid = rank_pid(str(out), 0)
            wait_while(job, lambda pid=pid: not _mapped(pid, "_multiarray_umath"))
            assert job.poll() is None, job.communicate()
            os.kill(pid, signal.SIGTERM)
            _, stderr = job.communicate(timeout=HANG_TIMEOUT)
        assert job.returncode == 1, (attempt, job.returncode, stderr)
        assert "pricer: terminated (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
        _nothing_left(folder, out)


def _signalled_launcher(book_path, folder):
    cmd, e, out = _job(book_path, folder)
    with launched(cmd, e) as job:
        pids = _ranks(out)
        wait_while(job, lambda: not all(_mapped(p, "_multiarray_umath") for p in pids))
        assert job.poll() is None, job.communicate()
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=HANG_TIMEOUT)
    _nothing_left(folder, out)
    return job.returncode, stderr


def test_sigterm_to_mpiexec_while_the_ranks_import_exits_1(tmp_path, book):
    """SIGTERM to the launcher while both ranks' interpreters import numpy (the command's first
    second, before its argument parser is built): the launcher forwards it, each rank ends with 1
    (not killed by the signal: the launcher's 15), nothing written."""
    for attempt in range(REPEATS):
        folder = tmp_path / f"run-{attempt}"
        folder.mkdir()
        code, stderr = _signalled_launcher(book[0], folder)
        assert code == 1, (attempt, code, stderr)
        assert "pricer: terminated (SIGTERM)" in stderr and "Traceback" not in stderr, stderr


def _late_signal(book_path, folder):
    cmd, e, out = _job(book_path, folder, {"PRICER_FAULT": "stop:0:write",
                                           "PRICER_CHUNK_DELAY": "0"}, checkpoint=False)
    term, interrupt = 1 << (signal.SIGTERM - 1), 1 << (signal.SIGINT - 1)
    with launched(cmd, e) as job:
        root, other = _ranks(out)
        wait_while(job, lambda: not _stopped(root))
        # rank 1's command has returned once it ignores SIGTERM (ending.decided)
        wait_while(job, lambda: not _signal_mask(other, "SigIgn") & term)
        assert job.poll() is None, job.communicate()
        os.kill(other, signal.SIGINT)
        wait_while(job, lambda: (_signal_mask(other, "SigPnd") | _signal_mask(other, "ShdPnd"))
                   & interrupt)
        time.sleep(0.5)     # rank 1's signal thread has acted on it by then, if it exits
        os.kill(root, signal.SIGCONT)
        _, stderr = job.communicate(timeout=HANG_TIMEOUT)
    assert leftover_processes(str(out)) == []
    return job.returncode, stderr


def test_a_late_signal_to_a_rank_that_has_returned_keeps_the_run(tmp_path, book):
    """SIGINT to rank 1 once its command has returned (it waits in MPI_Finalize) while rank 0
    has still to write the results (PRICER_FAULT=stop:0:write stops rank 0 there until SIGCONT):
    the job is rank 0's to end, so it finishes, exit 0, the results whole, no lock left — an exit
    of rank 1 would have had the launcher kill rank 0 and report 0 with no results written."""
    path, portfolio = book
    for attempt in range(REPEATS):
        folder = tmp_path / f"run-{attempt}"
        folder.mkdir()
        code, stderr = _late_signal(path, folder)
        assert code == 0, (attempt, code, stderr)
        assert sorted(os.listdir(folder)) == ["prices.h5"], os.listdir(folder)
        assert read_results(str(folder / "prices.h5"))["id"].size == len(portfolio.id)


# ------------------------------------------------------------------------------ pricer scaling

def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("pricer: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_scaling_refusals_are_one_line_and_make_nothing(tmp_path, capsys):
    """`pricer scaling`'s refusals (exit 2, one line) come before it makes any folder: a FIFO as
    the book, an --out or --work that is a file or lies under one, and a book that `pricer price`
    refuses (its runs' exit 2: the refusal's line, and the folders it made removed)."""
    from pricer.tools.scaling import main

    book, market = tmp_path / "book.h5", tmp_path / "market.h5"
    write_portfolio(str(book), make_book(20))
    proc = run_pricer(["generate", "--dist", "random", "--count", "20", "--max-steps", "50",
                       "--market-prices", "-o", market])
    assert proc.returncode == 0, proc.stderr
    os.mkfifo(tmp_path / "fifo.h5")
    (tmp_path / "file").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    common = ["--ranks", "1", "--launcher", mpiexec(), "--no-warmup", "--backend", "cpu"]
    cases = [([str(tmp_path / "fifo.h5"), "--out", str(tmp_path / "o")], "FIFO"),
             ([str(book), "--out", str(tmp_path / "file")], "file: exists and is not a folder"),
             ([str(book), "--out", str(tmp_path / "file" / "o")], "exists and is not a folder"),
             ([str(book), "--out", str(tmp_path / "o"), "--work", str(tmp_path / "file")],
              "file: exists and is not a folder"),
             ([str(book), "--simulate", "--out", str(tmp_path / "file")], "not a folder"),
             ([str(market), "--out", str(tmp_path / "o" / "deep")], "column volatility is NaN")]
    for argv, message in cases:
        assert main(argv + common) == 2, argv
        assert message in _one_line(capsys), argv
        assert sorted(os.listdir(tmp_path)) == before, argv
    assert (tmp_path / "file").read_text() == "mine"


def test_a_run_summary_without_its_figures_is_one_line(tmp_path, capsys, monkeypatch):
    """A run whose summary lacks a figure scaling reads (here a launcher that drops
    `rank_seconds`, as a pricer of another version would write it): exit 1, one line naming the
    file and the figure, not a KeyError."""
    import sys
    from pricer.tools.scaling import main

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    book = tmp_path / "book.h5"
    write_portfolio(str(book), make_book(20))
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import json, subprocess, sys\n"
        f"code = subprocess.call([{mpiexec()!r}] + sys.argv[1:])\n"
        "path = sys.argv[sys.argv.index('--summary-json') + 1]\n"
        "record = json.load(open(path))\n"
        "del record['rank_seconds']\n"
        "json.dump(record, open(path, 'w'))\n"
        "sys.exit(code)\n")
    argv = [str(book), "--ranks", "1", "--out", str(tmp_path / "o"), "--no-warmup",
            "--backend", "cpu", "--launcher", f"{sys.executable} {launcher}"]
    assert main(argv) == 1
    assert "ranks-1-rep-1.json: the run's summary has no 'rank_seconds'" in _one_line(capsys)


# ------------------------------------------------------------------------------ messages

def test_threads_beyond_the_cores_are_capped_before_the_memory_check(tmp_path):
    """--threads far beyond the cores (an 8-option book and a bond book): the run's threads are
    capped at the cores (numba's pool), so is its memory estimate; priced, the summary saying
    how many threads ran, where the estimate of 10^8 threads' buffers refused it."""
    import numba

    options, bonds = tmp_path / "options.h5", tmp_path / "bonds.h5"
    write_portfolio(str(options), make_book(8))
    proc = run_pricer(["generate", "--bonds", "R1", "--count", "20", "-o", bonds])
    assert proc.returncode == 0, proc.stderr
    cores = numba.config.NUMBA_NUM_THREADS
    for book in (options, bonds):
        out = tmp_path / f"{book.stem}-out.h5"
        proc = run_pricer(["price", book, "-o", out, "--backend", "cpu", "--threads",
                           "100000000"])
        assert proc.returncode == 0, proc.stderr
        assert f"({cores} threads each)" in proc.stdout or cores == 1, proc.stdout
        assert out.exists()


def _csv(path, frame, header=None):
    text = frame.to_csv(index=False, float_format="%.17g")
    if header is not None:
        text = header + "\n" + text.split("\n", 1)[1]
    path.write_text(text)


def test_whitespace_around_csv_cells_and_headers_is_no_part_of_them(tmp_path):
    """A CSV book whose header names and cells have whitespace after them (spaces, a tab, a
    no-break space; a tree name `jr `) is read as the same book without it, bitwise; a cell that
    is not a number still names its column and option id."""
    import numpy as np
    import pandas as pd
    from pricer.errors import InputError
    from pricer.io.formats import read_book

    book = make_book(6)
    frame = pd.DataFrame({name: getattr(book, name) for name in
                          ("id", "spot", "strike", "maturity", "rate", "dividend", "volatility",
                           "steps", "call", "american")})
    frame["tree"] = ["crr", "jr", "tian", "crr", "jr", "lr"]
    _csv(tmp_path / "clean.csv", frame)
    spaced = frame.astype(str)
    spaced["strike"] = [f"{float(v)!r}\t" for v in frame["strike"]]
    spaced["spot"] = [f"{float(v)!r}\xa0" for v in frame["spot"]]
    spaced["steps"] = [f"{v}  " for v in frame["steps"]]
    spaced["volatility"] = [f"{float(v)!r}  " for v in frame["volatility"]]
    spaced["tree"] = [f"{v} " for v in frame["tree"]]
    spaced["call"] = [f"{v} " for v in frame["call"]]
    _csv(tmp_path / "spaced.csv", spaced, header=",".join(f"{name}  " for name in frame.columns))
    clean, read = read_book(tmp_path / "clean.csv"), read_book(tmp_path / "spaced.csv")
    for name in ("id", "spot", "strike", "maturity", "volatility", "steps", "call", "tree"):
        a, b = np.asarray(getattr(clean, name)), np.asarray(getattr(read, name))
        assert a.dtype == b.dtype and (a == b).all(), name
    spaced.loc[3, "strike"] = "101.5 x"
    _csv(tmp_path / "bad.csv", spaced)
    with pytest.raises(InputError, match=rf"column strike holds '101.5 x' for option id "
                                         rf"{frame['id'][3]}, not a number"):
        read_book(tmp_path / "bad.csv")


def test_an_empty_tree_cell_or_a_parquet_null_is_named_by_its_option_id(tmp_path):
    """An empty cell of a CSV book's tree column, a null in a Parquet book's: refused naming the
    column and the option, not as the column's dtype (object)."""
    import pandas as pd
    from pricer.errors import InputError
    from pricer.io.formats import read_book

    book = make_book(5)
    frame = pd.DataFrame({name: getattr(book, name) for name in
                          ("id", "spot", "strike", "maturity", "rate", "dividend", "volatility",
                           "steps", "call", "american")})
    frame["tree"] = ["crr", None, "jr", "crr", None]
    _csv(tmp_path / "book.csv", frame)
    frame.to_parquet(tmp_path / "book.parquet", index=False)
    for name in ("book.csv", "book.parquet"):
        with pytest.raises(InputError, match=rf"column tree is empty for option id "
                                             rf"{frame['id'][1]}$"):
            read_book(tmp_path / name)
    proc = run_pricer(["price", tmp_path / "book.csv", "-o", tmp_path / "out.h5"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "column tree is empty for option id" in proc.stderr


@pytest.mark.parametrize("axis", ['"0:inf:3"', '"-1e308:1e308:3"', '"nan:1:2"', "[0, inf]"])
def test_a_scenario_axis_that_is_not_finite_is_one_line(tmp_path, axis):
    """A job file's scenario axis with a value that is not finite, or whose points' spacing
    overflows: exit 2 with one line, no NumPy warning before it."""
    write_portfolio(str(tmp_path / "book.h5"), make_book(5))
    (tmp_path / "job.toml").write_text(
        f'[portfolio]\npath = "book.h5"\n[pricing]\nbackend = "cpu"\n[scenarios]\nspot = {axis}\n'
        f'[output]\npath = "out.h5"\n')
    proc = run_pricer(["run", "job.toml"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("pricer: error: scenarios: spot has a value that is not "
                                  "finite") and proc.stderr.count("\n") == 1, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["book.h5", "job.toml"]


def test_info_on_a_file_of_options_and_bond_options_shows_both(tmp_path):
    """`pricer info` on a file with /portfolio and /bond_options describes both parts."""
    import h5py

    mixed, bonds = tmp_path / "mixed.h5", tmp_path / "bonds.h5"
    write_portfolio(str(mixed), make_book(7))
    proc = run_pricer(["generate", "--bonds", "R1", "--count", "12", "-o", bonds])
    assert proc.returncode == 0, proc.stderr
    with h5py.File(bonds, "r") as src, h5py.File(mixed, "a") as dst:
        for group in ("bond_options", "curves"):
            src.copy(group, dst)
    proc = run_pricer(["info", mixed])
    assert proc.returncode == 0, proc.stderr
    assert "portfolio (pricer.portfolio/1, HDF5), 7 options" in proc.stdout, proc.stdout
    assert f"{mixed} /bond_options: bond options (pricer.bond_options/1), 12 instruments" \
        in proc.stdout, proc.stdout
