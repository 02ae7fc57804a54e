"""Faults through real `mpiexec -n 3 pricer price` runs on real files: injected faults end the job,
named by rank 0, with nothing written and no rank left; kill -9 of the whole job and
--resume give bitwise the prices of an uninterrupted run; checkpoints of another input or other
settings are refused by name; the memory guard refuses a run that would not fit, with the numbers.

No test bounds how long a job takes (a busy host is no failure: tests/test_suite_rules.py): each
must end within HANG_TIMEOUT (a job that did not has hung), and what ended it is shown by what it
did — its exit code and message, the chunks it had priced, the files it left; the seconds it took
are recorded (PRICER_RELIABILITY_REPORT, docs/reliability.md's figures).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from helpers import env, launched, mpiexec, pricer_command, run_pricer
from pricer.engines.cpu.serial import SerialEngine
from pricer.files import OutputLock
from pricer.model.greeks import Analytics, price_with_analytics
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results
from pricer.tools.generate import generate

RANKS = 3
HANG_TIMEOUT = 120   # seconds: a job, or a wait on one, that has not ended by then has hung
# a run that reaches its pricing fails there at once, on every rank (exit 1, InjectedFault):
# with it, a refusal (exit 2, its message) shows that the run was refused before any pricing
NO_PRICING = {"PRICER_FAULT": ",".join(f"raise:{rank}:0" for rank in range(RANKS))}
CHUNK = "2e4"      # lattice nodes per chunk: ~40 chunks for the book below
FIGURES = os.environ.get("PRICER_RELIABILITY_REPORT")  # docs/reliability.md's figures


def record(name: str, value) -> None:
    if FIGURES:
        data = json.loads(open(FIGURES).read()) if os.path.exists(FIGURES) else {}
        data[name] = value
        with open(FIGURES, "w") as f:
            json.dump(data, f, indent=1)


def make_book(n: int = 150, seed: int = 11) -> Portfolio:
    rng = np.random.default_rng(seed)
    return Portfolio(
        id=rng.permutation(np.arange(100, 100 + 3 * n, 3, dtype=np.int64)),
        spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n), maturity=rng.uniform(0.25, 2, n),
        rate=rng.uniform(0, 0.06, n), dividend=rng.uniform(0, 0.03, n),
        volatility=rng.uniform(0.15, 0.5, n), steps=rng.integers(3, 200, n),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    path = tmp_path_factory.mktemp("book") / "book.h5"
    portfolio = make_book()
    write_portfolio(str(path), portfolio)
    return path, portfolio


def reference(portfolio: Portfolio, analytics: Analytics = Analytics()) -> dict:
    cols = portfolio.columns()
    return price_with_analytics(SerialEngine(), cols, "crr", portfolio.id, analytics)


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


def leftover_processes(marker: str, grace: float = 30.0) -> list[str]:
    """Processes whose command line names `marker` (a unique output path) still there after
    `grace` seconds (the launcher may return while its killed ranks are being reaped)."""
    deadline = time.monotonic() + grace
    while (found := _processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _processes(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def wait_while(job, condition, timeout: float = HANG_TIMEOUT) -> None:
    """Poll until `condition()` is false, the job has ended, or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while condition() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def take_over(target, timeout: float = HANG_TIMEOUT) -> None:
    """Claim and release `target` as the next run would: a killed holder's lock goes with its
    process, a moment after its command line has gone from /proc (the kernel releases the
    process's memory before its files)."""
    from pricer.errors import InputError

    deadline = time.monotonic() + timeout
    while True:
        try:
            OutputLock(str(target)).acquire().release()
            return
        except InputError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def timed_run(args, extra_env: dict, timeout: float = HANG_TIMEOUT):
    e = env()
    e.update(extra_env)
    cmd = [mpiexec(), "-n", str(RANKS)] + pricer_command() + [str(a) for a in args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    return proc, time.perf_counter() - start


# ----------------------------------------------------------------------------------- faults

FAULTS = {
    # kind: (rank, chunks, what the output must name)
    "raise": (1, 2, ["pricer: error: rank 1 failed after 2 chunk(s)", "InjectedFault"]),
    "gpu": (2, 1, ["pricer: error: rank 2 failed after 1 chunk(s)", "GpuUnavailable",
                   "CUDA error"]),
    "raise-rank0": (0, 3, ["pricer: error: rank 0 failed after 3 chunk(s)", "InjectedFault"]),
    "exit": (1, 2, []),   # vanishes without a word: the launcher ends the job with its status
    "kill": (2, 1, [("BAD TERMINATION", "exited on signal 9"), "signal 9"]),  # MPICH, Open MPI
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_ends_job_named_nothing_written(tmp_path, book, fault):
    path, _ = book
    rank, chunks, needles = FAULTS[fault]
    kind = fault.split("-")[0]
    out = tmp_path / f"prices-{fault}.h5"
    proc, seconds = timed_run(["price", path, "-o", out, "--chunk-nodes", CHUNK, "--threads", "1"],
                              {"PRICER_FAULT": f"{kind}:{rank}:{chunks}",
                               "PRICER_CHUNK_DELAY": "0.05"})
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    if kind == "exit":
        # MPICH's mpiexec reports the rank's status (70), or 9 when its cleanup kill of the other
        # ranks is what it sees first (a race inside the launcher)
        assert proc.returncode in (70, 9), text
    for needle in needles:
        assert any(n in text for n in ((needle,) if isinstance(needle, str) else needle)), \
            (needle, text)
    left = sorted(os.listdir(tmp_path))                 # no result, no temporary file
    if kind in ("exit", "kill"):
        # the launcher kills rank 0 outright, so the output's lock file may stay; the operating
        # system released its lock with the process: the next run takes the claim over
        assert left in ([], [f".{out.name}.lock"]), left
        take_over(out)
        left = sorted(os.listdir(tmp_path))
    assert left == [], left
    assert leftover_processes(str(out)) == []
    record(f"fault {fault}", {"exit": proc.returncode, "seconds": round(seconds, 2)})


# ------------------------------------------------------------------------- stalls and signals

STALL = 2.0     # --stall-timeout of the stall tests (seconds)


def rank_pid(marker: str, rank: int, timeout: float = HANG_TIMEOUT) -> int:
    """The process id of rank `rank` of the job whose command line names `marker` (the launcher
    gives every rank its number in the environment: PMI_RANK for MPICH, OMPI_COMM_WORLD_RANK)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in _processes(marker):
            pid = int(line.split(":", 1)[0])
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if f"PMI_RANK={rank}".encode() in environ or \
                    f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} of {marker} found")


@pytest.mark.parametrize("how,rank", [("stop", 1), ("stop", 0), ("hang", 2), ("stop-at-end", 1)])
def test_a_stalled_rank_ends_the_job_named(tmp_path, book, how, rank):
    """kill -STOP of a rank (its process silent), or a rank whose pricing never returns (its main
    thread stuck, as on a wedged GPU; PRICER_FAULT=hang): the job ends (the stopped or hung rank
    would otherwise hold it for ever: HANG_TIMEOUT on the launcher), non-zero, naming the rank,
    its host and its chunks — the hung rank's job before its chunks were all priced; nothing is
    written, no process is left, and the same command then finishes from the checkpoint,
    bitwise. The seconds from the stall to the end are recorded."""
    path, portfolio = book
    out, folder = tmp_path / "prices.h5", tmp_path / "ck"
    args = ["price", path, "-o", out, "--chunk-nodes", CHUNK, "--threads", "1",
            "--checkpoint", folder, "--stall-timeout", STALL]
    e = env()
    e.update({"PRICER_CHUNK_DELAY": "0.1", "PRICER_PROGRESS": "off"})
    if how == "hang":
        e["PRICER_FAULT"] = f"hang:{rank}:3"
    if how == "stop-at-end":   # done with its chunks, stopped on its way to the barrier
        e["PRICER_FAULT"] = f"stop:{rank}:end"
    cmd = [mpiexec(), "-n", str(RANKS)] + pricer_command() + [str(a) for a in args]
    with launched(cmd, e) as job:
        pid = rank_pid(str(out), rank)
        wait_while(job, lambda: _chunks(folder) < 6)
        if how == "stop-at-end":    # wait for the stop, then time from it
            wait_while(job, lambda: not _stopped(pid))
        stopped = time.monotonic()
        if how == "stop":
            os.kill(pid, signal.SIGSTOP)
        stdout, stderr = job.communicate(timeout=HANG_TIMEOUT)
        seconds = time.monotonic() - stopped
    assert job.returncode != 0, stdout + stderr
    host = os.uname().nodename
    assert f"pricer: error: stalled: rank {rank} (host " in stderr, stderr
    assert host.split(".")[0] in stderr, stderr
    assert ("has finished no chunk" if how == "hang" else "has not been heard from") in stderr
    assert "Traceback" not in stderr, stderr
    assert not out.exists()
    assert leftover_processes(str(out)) == []
    saved = _chunks(folder)
    proc, _ = timed_run([a for a in args if a != STALL and a != "--stall-timeout"], {})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = read_results(str(out))
    assert bitwise_equal(r["price"], reference(portfolio)["price"])
    if how == "hang":     # its rank priced 3 of its chunks, then never another: the watchdog ended it
        assert saved < _chunks(folder), (saved, _chunks(folder))
    record(f"stall {how} rank {rank}", {"exit": job.returncode, "seconds after the stall":
                                        round(seconds, 2), "chunks kept": saved})


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


@pytest.mark.parametrize("ranks,rank", [(2, 0), (3, 0), (3, 2)])
def test_a_signal_to_any_rank_ends_the_job_with_exit_1(tmp_path, book, ranks, rank):
    """SIGTERM to one rank, whichever: the whole job ends (the other ranks do not wait for it:
    HANG_TIMEOUT) with the launcher's exit code 1 (rank 0 calls MPI_Abort, for a signal to another
    rank once that rank has told it; without it hydra's code would depend on the rank count, 1 at
    -n 2 and 9 at -n 3), nothing written — the signal was honoured before the run's end (a
    signal after it exits with the run's code) — nothing left, the lock files included. The
    seconds it took are recorded."""
    path, _ = book
    out = tmp_path / "prices.h5"
    e = env()
    e.update({"PRICER_CHUNK_DELAY": "0.2", "PRICER_PROGRESS": "off"})
    folder = tmp_path / "ck"          # its chunk files show that every rank is pricing
    cmd = [mpiexec(), "-n", str(ranks)] + pricer_command() + [
        "price", str(path), "-o", str(out), "--chunk-nodes", CHUNK, "--threads", "1",
        "--checkpoint", str(folder)]
    with launched(cmd, e) as job:
        pid = rank_pid(str(out), rank)
        wait_while(job, lambda: _chunks(folder) < 2 * ranks)
        assert job.poll() is None, job.communicate()
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=HANG_TIMEOUT)
        seconds = time.monotonic() - sent
    assert job.returncode == 1, (job.returncode, stderr)
    assert "pricer: terminated (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
    assert leftover_processes(str(out)) == []
    left = sorted(set(os.listdir(tmp_path)) - {"ck"})
    assert left == [], left      # rank 0 removes its claims before it aborts, whichever rank
    record(f"SIGTERM to rank {rank} of {ranks}", {"exit": job.returncode,
                                                  "seconds": round(seconds, 2)})


def test_stall_limits_are_never_infinite():
    from pricer.run.watchdog import (COLD_START, FLOOR, RATE, chunk_limit, chunk_limits,
                                     silence_limit)

    assert chunk_limit(0, None) == FLOOR and silence_limit(None) == FLOOR
    assert chunk_limit(3e12, None) == FLOOR + 3e12 / RATE
    assert chunk_limit(3e12, 7.5) == 7.5 and silence_limit(7.5) == 7.5
    assert chunk_limits([1e8, 1e8], None) == [FLOOR + 1 + COLD_START, FLOOR + 1]
    assert chunk_limits([1e8, 1e8], 7.5) == [7.5 + COLD_START, 7.5] and chunk_limits([], 7.5) == []


# ------------------------------------------------------------------------- checkpoint, resume

def test_kill_9_and_resume_bitwise_equal(tmp_path, book, rng):
    """kill -9 of the whole job (launcher and ranks) at a random moment while chunks are being
    saved, then the same command again: only the missing chunks are priced, and the prices are bitwise those of
    an uninterrupted run (here the one-process serial reference)."""
    path, portfolio = book
    out, folder = tmp_path / "prices.h5", tmp_path / "ck"
    args = ["price", path, "-o", out, "--chunk-nodes", CHUNK, "--threads", "1", "--greeks",
            "--checkpoint", folder]
    kill_9_after_chunks(args, folder, int(rng.integers(3, 25)))  # the random moment
    assert leftover_processes(str(out)) == []
    assert not out.exists()
    saved = _chunks(folder)
    assert 0 < saved, saved
    proc, seconds = timed_run(args, {})       # the same command resumes by itself
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = read_results(str(out))
    want = reference(portfolio, Analytics(greeks=True))
    for name in want:
        assert bitwise_equal(r[name], want[name]), name
    priced = int(r["run"]["options"].sum())
    total = _chunks(folder)
    assert priced < len(portfolio) and f"{len(portfolio) - priced} of them from the checkpoint" \
        in proc.stdout, proc.stdout
    record("kill -9 and resume", {"chunks saved before kill": saved, "chunks in all": total,
                                  "options priced on resume": priced,
                                  "options": len(portfolio), "bitwise equal": True,
                                  "resume seconds": round(seconds, 2)})


def kill_9_after_chunks(args, folder, wanted: int, ranks: int = RANKS) -> None:
    """Start `pricer ARGS` (with --checkpoint folder) under mpiexec -n RANKS, slowed per chunk, and
    SIGKILL the launcher's whole process group once `wanted` chunk files are saved."""
    e = env()
    e["PRICER_CHUNK_DELAY"] = "0.1"
    cmd = [mpiexec(), "-n", str(ranks)] + pricer_command() + [str(a) for a in args]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=e,
                           start_new_session=True)
    wait_while(job, lambda: _chunks(folder) < wanted)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=HANG_TIMEOUT)
    time.sleep(0.5)


def _chunks(folder) -> int:
    return len([n for n in os.listdir(folder) if n.startswith("chunk-")]) if folder.exists() else 0


@pytest.mark.parametrize("change,needle", [
    ("input", "different input: input hash"),
    ("tree", "different settings: settings hash"),
    ("greeks", "different settings: settings hash"),
])
def test_resume_refuses_other_input_or_settings(tmp_path, book, change, needle):
    path, portfolio = book
    folder = tmp_path / "ck"
    base = ["--chunk-nodes", CHUNK, "--threads", "1", "--checkpoint", folder]
    assert run_pricer(["price", path, "-o", tmp_path / "a.h5"] + base).returncode == 0
    other = path
    extra = []
    if change == "input":
        other = tmp_path / "other.h5"
        changed = make_book()
        changed.spot[0] += 1.0
        write_portfolio(str(other), changed)
    elif change == "tree":
        extra = ["--tree", "jr"]
    else:
        extra = ["--greeks"]
    proc = run_pricer(["price", other, "-o", tmp_path / "b.h5"] + base + extra)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "b.h5").exists()


def test_the_same_command_starts_and_resumes_a_checkpoint(tmp_path, book):
    """One command serves the first run and every restart (a requeued job): --checkpoint DIR
    starts in a new or empty DIR, and continues the checkpoint DIR holds; --resume is accepted on
    a first run. A DIR with other files and no checkpoint is refused."""
    path, portfolio = book
    folder = tmp_path / "ck"
    args = ["--chunk-nodes", CHUNK, "--threads", "1", "--checkpoint", folder]
    first = run_pricer(["price", path, "-o", tmp_path / "a.h5", "--resume"] + args)
    assert first.returncode == 0 and "from the checkpoint" not in first.stdout, first.stderr
    leftover = folder / ".chunk-00000003.bin.tmp-4194303"   # a killed attempt's, half written
    leftover.write_bytes(b'{"chunk": 3')
    again = run_pricer(["price", path, "-o", tmp_path / "b.h5"] + args)
    assert again.returncode == 0, again.stderr
    assert not leftover.exists()
    assert f"({len(portfolio)} of them from the checkpoint)" in again.stdout, again.stdout
    assert bitwise_equal(read_results(str(tmp_path / "a.h5"))["price"],
                         read_results(str(tmp_path / "b.h5"))["price"])
    proc = run_pricer(["price", path, "-o", tmp_path / "c.h5", "--resume"])
    assert proc.returncode == 2 and "--resume needs --checkpoint" in proc.stderr, proc.stderr
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    proc = run_pricer(["price", path, "-o", tmp_path / "d.h5", "--checkpoint", stray])
    assert proc.returncode == 2 and "not empty and holds no checkpoint" in proc.stderr, proc.stderr
    assert (stray / "notes.txt").read_text() == "mine" and not (tmp_path / "d.h5").exists()


def _corrupt(folder, how: str, rng) -> str:
    """Damage one chunk file of a finished checkpoint, as a disk, a person or a script might."""
    files = sorted(p for p in folder.iterdir() if p.name.startswith("chunk-"))
    victim = files[len(files) // 2]
    blob = bytearray(victim.read_bytes())
    body = blob.index(b"\n") + 1
    if how == "random-bytes":
        blob[body:body + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    elif how == "one-bit":
        blob[body + int(rng.integers(0, len(blob) - body))] ^= 1 << int(rng.integers(0, 8))
    elif how == "zeros":
        blob[body:] = bytes(len(blob) - body)
    elif how == "nan":
        blob[body:] = np.full((len(blob) - body) // 8, np.nan).tobytes()
    elif how == "empty":
        blob = bytearray()
    elif how == "truncated":
        blob = blob[:len(blob) - 8]
    elif how == "other-chunk":    # another chunk's whole file (same rows where the grid allows)
        donor = next(p for p in files if p != victim and p.stat().st_size == victim.stat().st_size)
        blob = bytearray(donor.read_bytes())
    victim.write_bytes(bytes(blob))
    return victim.name


@pytest.mark.parametrize("how", ["random-bytes", "one-bit", "zeros", "nan", "empty", "truncated",
                                 "other-chunk"])
def test_a_damaged_chunk_is_priced_again_never_used(tmp_path, rng, how):
    """A chunk file that fails its checksum (bound to the run, the chunk and its rows) is priced
    again, and the summary says so; the results are bitwise those of an uninterrupted run."""
    book = make_book()
    book.steps[:] = 60            # every chunk the same size, so another chunk's file fits
    path = tmp_path / "book.h5"
    write_portfolio(str(path), book)
    folder = tmp_path / "ck"
    args = ["price", path, "--chunk-nodes", 2e4, "--threads", "1", "--checkpoint", folder]
    assert run_pricer(args + ["-o", tmp_path / "a.h5"]).returncode == 0
    _corrupt(folder, how, rng)
    proc = run_pricer(args + ["-o", tmp_path / "b.h5"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "1 chunk file(s) failed their checks" in proc.stdout, proc.stdout
    want = reference(book)
    assert bitwise_equal(read_results(str(tmp_path / "b.h5"))["price"], want["price"])


def test_a_chunk_of_another_run_is_never_used(tmp_path):
    """Two checkpoints of different inputs with the same grid: a chunk file copied from one into
    the other fails its check (the run's id is in its checksum) and is priced again."""
    first, second = make_book(), make_book()
    second.spot[:] *= 1.01
    for book, name in ((first, "one"), (second, "two")):
        write_portfolio(str(tmp_path / f"{name}.h5"), book)
        assert run_pricer(["price", tmp_path / f"{name}.h5", "-o", tmp_path / f"{name}-out.h5",
                           "--chunk-nodes", CHUNK, "--threads", "1", "--checkpoint",
                           tmp_path / name]).returncode == 0
    chunk = sorted(p.name for p in (tmp_path / "one").iterdir() if p.name.startswith("chunk-"))[0]
    (tmp_path / "two" / chunk).write_bytes((tmp_path / "one" / chunk).read_bytes())
    proc = run_pricer(["price", tmp_path / "two.h5", "-o", tmp_path / "again.h5", "--chunk-nodes",
                       CHUNK, "--threads", "1", "--checkpoint", tmp_path / "two"])
    assert proc.returncode == 0 and "1 chunk file(s) failed their checks" in proc.stdout, proc.stdout
    assert bitwise_equal(read_results(str(tmp_path / "again.h5"))["price"],
                         reference(second)["price"])


# ------------------------------------------------------------------------------- memory guard

def test_memory_guard_refuses_with_the_numbers(tmp_path, book):
    """Refused before any pricing (NO_PRICING: a run that priced would fail differently), exit 2,
    with the numbers, nothing written."""
    path, _ = book
    out = tmp_path / "prices.h5"
    e = dict(NO_PRICING, PRICER_MEMORY_LIMIT="64K")
    proc, _ = timed_run(["price", path, "-o", out], e)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not enough memory" in proc.stderr and "GiB on rank 0" in proc.stderr \
        and "0.00 GiB available" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "InjectedFault" not in proc.stderr and "chunk(s)" not in proc.stderr, proc.stderr
    assert not out.exists()


def _memory_cgroup_v1() -> str | None:
    """This process's cgroup v1 memory folder, where a child with a limit can be made (root)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    folder = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
                    return folder if os.access(folder, os.W_OK) else None
    except OSError:
        pass
    return None


def test_memory_guard_sees_a_cgroup_limit(tmp_path):
    """Under a 450 MiB cgroup memory limit (what `sbatch --mem` gives with task/cgroup) a
    3 000 000-option book is refused with the numbers, exit 2, before it is read, where it used
    to be read until the kernel killed rank 0 (exit 9, no message)."""
    parent = _memory_cgroup_v1()
    if parent is None:
        pytest.skip("no writable cgroup v1 memory hierarchy here (needs root)")
    path = tmp_path / "big.h5"
    write_portfolio(str(path), generate("uniform", 3_000_000, seed=1, steps=8))
    child = os.path.join(parent, f"pricer-test-{os.getpid()}")
    os.mkdir(child)
    try:
        with open(os.path.join(child, "memory.limit_in_bytes"), "w") as f:
            f.write(str(450 << 20))
        command = " ".join(pricer_command() + ["price", str(path), "-o", str(tmp_path / "o.h5")])
        proc = subprocess.run(["sh", "-c", f"echo $$ > {child}/cgroup.procs && exec {command}"],
                              capture_output=True, text=True, timeout=120, env=env())
    finally:
        os.rmdir(child)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "not enough memory" in proc.stderr and "cgroup memory limit" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o.h5").exists()


# ------------------------------------------------------------------------- input never modified

def test_input_unchanged_by_a_run(tmp_path, book):
    path, _ = book
    before = (path.read_bytes(), os.stat(path).st_mtime_ns)
    assert run_pricer(["price", path, "-o", tmp_path / "a.h5", "--quiet"], ranks=2).returncode == 0
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before
    with h5py.File(tmp_path / "a.h5") as f:
        assert f["results/price"].shape == (150,)


# ------------------------------------------------------------------------------------- SIGTERM

def test_sigterm_exits_1(tmp_path, book):
    """SIGTERM (as srun --kill-on-bad-exit=1 sends the other ranks once one exits non-zero) ends
    pricer with exit code 1, not death by the signal (143, which srun would report over a 2)."""
    path, _ = book
    folder = tmp_path / "ck"
    e = env()
    e["PRICER_CHUNK_DELAY"] = "30"
    job = subprocess.Popen(pricer_command() + ["price", str(path), "-o", str(tmp_path / "p.h5"),
                                               "--chunk-nodes", CHUNK, "--threads", "1",
                                               "--checkpoint", str(folder)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    wait_while(job, lambda: _chunks(folder) < 1)
    job.send_signal(signal.SIGTERM)    # it sleeps 30 s after each of its ~40 chunks
    stdout, stderr = job.communicate(timeout=HANG_TIMEOUT)
    assert job.returncode == 1 and "pricer: terminated (SIGTERM)" in stderr, (job.returncode, stderr)


def test_a_checkpoint_folder_serves_one_run_at_a_time(tmp_path):
    """Two runs with one --checkpoint DIR and different outputs: the second is refused while the
    first holds DIR (their chunks would otherwise carry each other's run id); and a run refused
    before pricing writes nothing into DIR (no manifest to refuse the next run with)."""
    path = tmp_path / "book.h5"
    write_portfolio(str(path), make_book())
    folder = tmp_path / "ck"
    slow = dict(env(), PRICER_CHUNK_DELAY="0.2")
    cmd = pricer_command() + ["price", str(path), "--chunk-nodes", CHUNK, "--threads", "1",
                              "--checkpoint", str(folder)]
    first = subprocess.Popen(cmd + ["-o", str(tmp_path / "a.h5")], env=slow,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / ".ck.lock").exists() and first.poll() is None:
        time.sleep(0.05)
    second = subprocess.run(cmd + ["-o", str(tmp_path / "b.h5")], env=env(), capture_output=True,
                            text=True, timeout=120)
    first.communicate(timeout=120)
    assert first.returncode == 0
    assert second.returncode == 2 and "another run is writing it" in second.stderr, second.stderr
    assert not (tmp_path / "b.h5").exists()
    empty = tmp_path / "empty"
    proc = run_pricer(["price", path, "-o", tmp_path / "a.h5", "--checkpoint", empty])  # exists
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert not empty.exists() or os.listdir(empty) == []
