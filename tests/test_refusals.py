"""Inputs and outputs a run must refuse before any work: exit 2, one `pricer: error:` line naming
the cause, no traceback, nothing written or replaced, and no wait on an input that never ends
(docs/reliability.md, "Refused before any work"). No test bounds how long a run takes (a busy
host is no failure: tests/test_suite_rules.py): a run must end within HANG_TIMEOUT, and what it
did shows the rest."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import env, mpiexec, run_pricer
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from pricer.tools.generate import generate

BAD_INPUT = 2
HANG_TIMEOUT = 120   # seconds: a run, or a wait on one, that has not ended by then has hung
# a run that reaches its pricing fails there at once (exit 1, InjectedFault): with it, a
# refusal (exit 2, its message) shows that the run was refused before any pricing
NO_PRICING = {"PRICER_FAULT": "raise:0:0"}


def refused(proc, *needles) -> str:
    assert proc.returncode == BAD_INPUT, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stderr.count("pricer: error:") == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


@pytest.fixture
def book(tmp_path):
    path = tmp_path / "book.h5"
    write_portfolio(str(path), generate("random", 12, seed=3, max_steps=200))
    return path


def test_an_output_that_is_not_a_regular_file_is_never_replaced(tmp_path, book):
    """/dev/null, a FIFO and a directory stay what they are, --overwrite or not."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for target, kind in (("/dev/null", "a character device"), (fifo, "a FIFO"),
                         (tmp_path, "a directory")):
        for extra in ([], ["--overwrite"]):
            refused(run_pricer(["price", book, "-o", target] + extra), str(target), kind)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("target,needle", [("", "file name"), ("/proc/results.h5", "cannot write"),
                                           ("missing/results.h5", "does not exist")])
def test_an_output_that_cannot_be_written_is_refused_before_pricing(tmp_path, book, target, needle):
    refused(run_pricer(["price", book, "-o", target], cwd=tmp_path), needle)


def test_an_input_that_never_ends_is_refused_at_once(tmp_path):
    """A FIFO or /dev/zero as the portfolio: refused without reading it (a read would never end),
    by one process and by every rank of an mpiexec job reading its own rows."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for source, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        refused(run_pricer(["price", source, "-o", tmp_path / "out.h5"], timeout=HANG_TIMEOUT),
                kind)
        refused(run_pricer(["price", source, "-o", tmp_path / "out.h5", "--distribute", "read"],
                           ranks=2, timeout=HANG_TIMEOUT), kind)
    refused(run_pricer(["run", fifo], timeout=HANG_TIMEOUT), "a FIFO", "job file")
    refused(run_pricer(["run", tmp_path], timeout=HANG_TIMEOUT), "a directory")
    refused(run_pricer(["info", fifo], timeout=HANG_TIMEOUT), "a FIFO")
    assert not (tmp_path / "out.h5").exists()


JOB = """[portfolio]
path = "book.h5"
[pricing]
backend = "serial"
[output]
path = "out.h5"
"""


@pytest.mark.parametrize("line,needle", [
    ('overwrite = "false"', "output.overwrite must be true or false, got 'false' (str)"),
    ('overwrite = "no"', "output.overwrite must be true or false, got 'no' (str)"),
    ("overwrite = 1", "output.overwrite must be true or false, got 1 (int)"),
])
def test_a_job_files_overwrite_must_be_a_boolean(tmp_path, book, line, needle):
    """overwrite = "false", "no" or 1 (each true as a truth value, so each would replace an existing
    result) is refused by key, value and type, and the result is intact."""
    os.rename(book, tmp_path / "book.h5")
    (tmp_path / "job.toml").write_text(JOB.replace('path = "out.h5"', f'path = "out.h5"\n{line}'))
    (tmp_path / "out.h5").write_bytes(b"the earlier result")
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), needle)
    assert (tmp_path / "out.h5").read_bytes() == b"the earlier result"


@pytest.mark.parametrize("edit,needle", [
    (('path = "book.h5"', "path = 42"), "portfolio.path must be a file name, got 42 (int)"),
    (('path = "book.h5"', 'path = "book.h5"\n[portfolio.generate]\ndist = "random"\ncount = 10\n'
                          'steps = 1.5'),
     "portfolio.generate.steps must be a whole number, got 1.5 (float)"),
    (('path = "book.h5"', 'path = "book.h5"\n[portfolio.generate]\ndist = "random"\ncount = "9"'),
     "portfolio.generate.count must be a whole number, got '9' (str)"),
    (('backend = "serial"', "backend = 3"), "pricing.backend must be one of"),
    (('backend = "serial"', 'backend = "serial"\nthreads = true'),
     "pricing.threads must be a whole number >= 1, got True (bool)"),
    (('backend = "serial"', 'backend = "serial"\nstall_timeout = "60"'),
     "pricing.stall_timeout must be a number of seconds >= 1, got '60' (str)"),
    (('backend = "serial"', 'backend = "serial"\nstall_timeout = 0.5'),
     "pricing.stall_timeout must be a number of seconds >= 1, got 0.5 (float)"),
    (('backend = "serial"', 'backend = "serial"\nstall_timeout = inf'),
     "pricing.stall_timeout must be a number of seconds >= 1, got inf (float)"),
])
def test_every_job_file_key_is_type_checked(tmp_path, edit, needle):
    (tmp_path / "job.toml").write_text(JOB.replace(*edit))
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), needle)
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "book.h5").exists()


def test_info_on_a_truncated_file_is_refused(tmp_path, book):
    cut = tmp_path / "cut.h5"
    cut.write_bytes(book.read_bytes()[:3000])
    refused(run_pricer(["info", cut]), str(cut), "cannot read")


def test_a_file_with_corrupted_metadata_is_refused_by_every_rank(tmp_path, book):
    """libhdf5's RuntimeError on a damaged symbol table (its signature overwritten) is bad input
    like any unreadable file: exit 2 from every rank, the file named, nothing written."""
    data = book.read_bytes()
    at = data.index(b"SNOD")
    bad = tmp_path / "bad.h5"
    bad.write_bytes(data[:at] + b"XXXX" + data[at + 4:])
    refused(run_pricer(["price", bad, "-o", tmp_path / "o.h5", "--backend", "cpu"], ranks=2),
            str(bad), "cannot read the file", "bad symbol table node signature")
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("args,needle", [
    (["--count", "10", "--seed", "-1"], "--seed must be >= 0"),
    (["--count", str(10**12)], "GiB of memory"),
])
def test_generate_refuses_before_any_work(tmp_path, args, needle):
    refused(run_pricer(["generate", "--dist", "random", "-o", tmp_path / "g.h5"] + args),
            needle)
    assert not (tmp_path / "g.h5").exists()


def test_generate_refuses_an_output_it_cannot_write(tmp_path):
    refused(run_pricer(["generate", "--dist", "random", "--count", "5", "-o",
                        tmp_path / "missing" / "g.h5"]), "does not exist")
    refused(run_pricer(["generate", "--dist", "random", "--count", "5", "-o", "/dev/null",
                        "--overwrite"]), "a character device")


def test_generate_under_mpiexec_writes_its_file_once(tmp_path):
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "pricer", "generate",
                           "--dist", "random", "--count", "20", "-o", str(tmp_path / "g.h5")],
                          capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0 and proc.stdout.count("wrote ") == 1, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["g.h5"]
    refused(subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "pricer", "generate",
                            "--dist", "random", "--count", "20", "-o", str(tmp_path / "g.h5")],
                           capture_output=True, text=True, timeout=120, env=env()), "exists")


# ------------------------------------------------------------------------- one output, one run

def _books(tmp_path):
    paths = []
    for seed in (1, 2):
        book = generate("random", 40, seed=seed, max_steps=400)
        book.id[:] = np.arange(len(book)) + 1000 * seed      # whose results these are
        paths.append(tmp_path / f"book{seed}.h5")
        write_portfolio(str(paths[-1]), book)
    return paths


def test_two_runs_writing_one_output_one_is_refused(tmp_path):
    """Two real runs, different inputs, the same -o, no --overwrite, the second started 0.3 s after
    the first: the second exits 2 naming the first as the holder; the first's results are whole
    and its own; no lock or temporary file is left."""
    first, second = _books(tmp_path)
    out = tmp_path / "shared.h5"
    slow = dict(env(), PRICER_CHUNK_DELAY="0.3")
    cmd = [sys.executable, "-m", "pricer", "price"]
    a = subprocess.Popen(cmd + [str(first), "-o", str(out), "--chunk-nodes", "1e5",
                                "--backend", "serial"], env=slow, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    while not any(n.endswith(".lock") for n in os.listdir(tmp_path)) and a.poll() is None:
        time.sleep(0.05)                                   # the first run has claimed it
    b = subprocess.run(cmd + [str(second), "-o", str(out), "--backend", "serial"], env=env(),
                       capture_output=True, text=True, timeout=120)
    stdout, stderr = a.communicate(timeout=120)
    assert a.returncode == 0, stderr
    refused(b, "shared.h5", "another run is writing it", f'"pid": {a.pid}')
    assert list(read_results(str(out))["id"]) == list(range(1000, 1040))
    assert sorted(os.listdir(tmp_path)) == ["book1.h5", "book2.h5", "shared.h5"]


def test_a_dead_holders_claim_is_taken_over(tmp_path):
    """A lock file whose holder died (kill -9 leaves it; the operating system drops the lock
    itself): the next run claims it, writes, and removes it."""
    first, _ = _books(tmp_path)
    (tmp_path / ".out.h5.lock").write_text('{"host": "gone", "pid": 999999}')
    proc = run_pricer(["price", first, "-o", tmp_path / "out.h5", "--backend", "serial"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["book1.h5", "book2.h5", "out.h5"]


def test_sigterm_leaves_no_lock_or_temporary_file(tmp_path):
    first, _ = _books(tmp_path)
    slow = dict(env(), PRICER_CHUNK_DELAY="0.5")
    job = subprocess.Popen([sys.executable, "-m", "pricer", "price", str(first), "-o",
                            str(tmp_path / "out.h5"), "--chunk-nodes", "1e5", "--backend",
                            "serial"], env=slow, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    while not any(n.endswith(".lock") for n in os.listdir(tmp_path)) and job.poll() is None:
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=HANG_TIMEOUT)
    assert job.returncode == 1 and "terminated" in stderr and "Traceback" not in stderr, stderr
    assert sorted(os.listdir(tmp_path)) == ["book1.h5", "book2.h5"]


def test_array_tasks_write_one_file_each(tmp_path):
    """-o and a job file's output.path take {array_task}, the Slurm array task's id."""
    first, _ = _books(tmp_path)
    for task in ("3", "4"):
        proc = run_pricer(["price", first, "-o", tmp_path / "res-{array_task}.h5", "--backend",
                           "serial"], extra_env={"SLURM_ARRAY_TASK_ID": task})
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "res-3.h5").exists() and (tmp_path / "res-4.h5").exists()
    proc = run_pricer(["price", first, "-o", tmp_path / "res-{array_task}.h5"],
                      extra_env={"SLURM_ARRAY_TASK_ID": ""})
    refused(proc, "{array_task}", "SLURM_ARRAY_TASK_ID is not set")


def test_the_array_job_writes_its_tasks_own_files(tmp_path):
    """jobs/array.toml as two tasks of an array would run it: each its own book and results."""
    from helpers import ROOT
    (tmp_path / "array.toml").write_text((ROOT / "jobs" / "array.toml").read_text()
                                         .replace("count = 1000", "count = 50"))
    for task in ("0", "1"):
        proc = run_pricer(["run", "array.toml", "--backend", "serial"], cwd=tmp_path,
                          extra_env={"SLURM_ARRAY_TASK_ID": task})
        assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["array-book-0.h5", "array-book-1.h5",
                                            "array-results-0.h5", "array-results-1.h5",
                                            "array.toml"]


# --------------------------------------------------------------------------------- a full disk

@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB file system (tmpfs), where this machine lets the tests mount one."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_an_output_on_a_disk_too_small_is_refused_before_pricing(tmp_path, small_disk):
    """Refused before pricing: under NO_PRICING a run that had started to price would have
    failed there (exit 1, InjectedFault), not with the refusal's exit 2 and message."""
    book = tmp_path / "book.h5"
    write_portfolio(str(book), generate("uniform", 200_000, seed=1, steps=2))
    stderr = refused(run_pricer(["price", book, "-o", small_disk / "out.h5", "--backend", "serial"],
                                extra_env=NO_PRICING),
                     "not enough disk space", "the results need", "free")
    assert "InjectedFault" not in stderr and os.listdir(small_disk) == []


def test_a_bond_book_on_a_disk_too_small_is_refused_before_pricing(tmp_path, small_disk):
    """Every family's run checks the disk before pricing (pipeline.py): the results, or the
    checkpoint's chunks, that do not fit are refused with exit 2 on every rank, nothing written."""
    from pricer.tools.bond_datasets import write_dataset
    book = tmp_path / "bonds.h5"
    write_dataset(str(book), "S1", 100_000, 0)
    for args in (["-o", small_disk / "out.h5"], ["-o", small_disk / "out.csv"],
                 ["-o", tmp_path / "out.h5", "--checkpoint", small_disk / "ck",
                  "--chunk-nodes", "2e5"]):
        stderr = refused(run_pricer(["price", book, *args, "--backend", "cpu"], ranks=2,
                                    extra_env=NO_PRICING),
                         "not enough disk space", "free")
        assert "InjectedFault" not in stderr and os.listdir(small_disk) == []
    assert not (tmp_path / "out.h5").exists()


def test_a_write_that_fails_says_what_was_kept(tmp_path, small_disk):
    """The disk fills while the run prices (after its checks passed): exit 1, one message, no
    traceback, no temporary file; with a checkpoint, the command it names writes the results
    elsewhere without pricing again, bitwise those of an uninterrupted run."""
    book = tmp_path / "book.h5"
    portfolio = generate("random", 4000, seed=5, max_steps=200)
    write_portfolio(str(book), portfolio)
    folder = tmp_path / "ck"
    slow = dict(env(), PRICER_CHUNK_DELAY="0.3")
    job = subprocess.Popen([sys.executable, "-m", "pricer", "price", str(book), "-o",
                            str(small_disk / "out.h5"), "--backend", "serial", "--chunk-nodes",
                            "2e6", "--checkpoint", str(folder)], env=slow,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # pricing has begun (the checks, the disk's included, passed): its first chunk is saved
    while not (folder.is_dir() and any(n.startswith("chunk-") for n in os.listdir(folder))) \
            and job.poll() is None:
        time.sleep(0.05)
    filler = small_disk / "filler"
    with open(filler, "wb") as f:                      # leave ~16 KiB free
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        f.write(bytes(max(0, free - (16 << 10))))
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 1, stderr
    assert "Traceback" not in stderr and stderr.count("pricer: error:") == 1, stderr
    assert "the results could not be written" in stderr and str(folder) in stderr, stderr
    assert sorted(os.listdir(small_disk)) == ["filler"]
    other = tmp_path / "elsewhere.h5"
    proc = run_pricer(["price", book, "-o", other, "--backend", "serial", "--chunk-nodes", "2e6",
                       "--checkpoint", folder])
    assert proc.returncode == 0 and "(4000 of them from the checkpoint)" in proc.stdout, proc.stderr
    from pricer.engines.cpu.serial import SerialEngine
    from pricer.model.lattice import lattice_parameters
    want = SerialEngine().price(lattice_parameters(portfolio.columns()))
    got = read_results(str(other))["price"]
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("what", ["gpu", "batch"])
def test_gpu_benches_without_a_gpu_are_refused(what):
    proc = run_pricer(["bench", what, "--quick"], extra_env={"PRICER_NO_GPU": "1"})
    refused(proc, "no usable GPU here", f"pricer bench {what}")


# ----------------------------------------------------------------------------------- signals

def _long_book(tmp_path):
    """One American put of 1 500 000 steps: tens of seconds in one kernel call on this machine."""
    book = generate("uniform", 1, seed=1, steps=1_500_000, exercise="american")
    book.volatility[:] = 0.2
    book.maturity[:] = 1.0
    path = tmp_path / "long.h5"
    write_portfolio(str(path), book)
    return path


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, all threads) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_honoured_at_once_during_a_long_lattice(tmp_path, signum):
    """SIGTERM or Ctrl-C (SIGINT) while one kernel call prices a lattice of 1.5 M steps: exit 1,
    one line naming the signal, no traceback, nothing written, no lock left — and the kernel call
    did not run on to its end first: the process used less CPU after the signal than before it
    (its start and 2 s of the kernel), where the rest of the lattice needs several times that
    (~18 s of one core here). CPU time, not wall time: a busy host slows the run, it does not
    make it compute more. The job must end within HANG_TIMEOUT."""
    path = _long_book(tmp_path)
    job = subprocess.Popen([sys.executable, "-m", "pricer", "price", str(path), "-o",
                            str(tmp_path / "out.h5"), "--backend", "serial"], env=env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not any(n.endswith(".lock") for n in os.listdir(tmp_path)) and job.poll() is None:
        time.sleep(0.05)
    time.sleep(2.0)                           # inside the kernel by now
    assert job.poll() is None, job.communicate()
    reaped = _children_cpu_seconds()
    before = _cpu_seconds(job.pid)            # its start and the kernel so far
    job.send_signal(signum)
    try:
        _, stderr = job.communicate(timeout=HANG_TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    after = _children_cpu_seconds() - reaped - before     # from the signal to its end
    assert job.returncode == 1, (job.returncode, stderr)
    assert after < before, (f"the kernel ran on after the signal: {after:.2f} s of CPU after it, "
                            f"{before:.2f} s before")
    assert f"terminated ({signal.Signals(signum).name})" in stderr, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert sorted(os.listdir(tmp_path)) == ["long.h5"]


def test_a_read_only_checkpoint_folder_is_refused_before_pricing(tmp_path, small_disk):
    """A checkpoint folder on a read-only file system — a new one (its claim cannot be made), an
    empty one, or one holding this run's checkpoint with chunks still to price — exit 2 before any
    pricing, one line, nothing written; the checkpoint there is unchanged."""
    book = tmp_path / "book.h5"
    write_portfolio(str(book), generate("random", 300, seed=2, max_steps=100))
    args = ["price", book, "-o", tmp_path / "out.h5", "--backend", "serial", "--chunk-nodes", "1e4"]
    folder = small_disk / "ck"
    assert run_pricer(args + ["--checkpoint", folder]).returncode == 0
    chunks = sorted(folder.glob("chunk-*"))
    for path in chunks[1::2]:                 # chunks still to price
        path.unlink()
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    os.remove(tmp_path / "out.h5")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    for target in (folder, small_disk / "new", folder / "sub"):
        refused(run_pricer(args + ["--checkpoint", target]), str(target), "Read-only file system")
        assert not (tmp_path / "out.h5").exists()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
