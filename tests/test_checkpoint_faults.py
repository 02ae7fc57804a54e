"""A checkpoint folder damaged in ways no run makes, through real `mpiexec -n 2 pricer price` runs
on real files (docs/reliability.md, section 3): a FIFO, a link (to /dev/zero, to a file outside the
folder or inside it) or a directory where a chunk file or the manifest should be is refused before
anything is opened, followed or replaced (exit 2, one line naming it, nothing written, no wait);
a chunk file larger than a whole one is priced again, never read; a chunk changed during a resume
ends the run with one line that says what to do; a rank 0 stuck in the run's opening stages ends
the job, named; checkpoint paths that cannot work (a missing parent, the output's path, the
input's, a folder the output is in) are refused before any work.

No test bounds how long a run takes (tests/test_suite_rules.py): each must end within
HANG_TIMEOUT (a run that did not has hung), and what it did shows the rest.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
import subprocess
import time

import pytest

from helpers import env, mpiexec, pricer_command
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from test_reliability import bitwise_equal, leftover_processes, make_book, take_over

RANKS = 2
HANG_TIMEOUT = 120   # seconds: a run, or a wait on one, that has not ended by then has hung
# every rank fails at its first chunk (exit 1, InjectedFault): a refusal (exit 2) under it shows
# that the run was refused before any pricing
NO_PRICING = {"PRICER_FAULT": ",".join(f"raise:{rank}:0" for rank in range(RANKS))}
# each process's address space: a run that read an endless or huge entry whole fails with a
# MemoryError (exit 1) rather than take the machine's memory (a rank uses ~0.8 GiB)
MEMORY = 4 << 30
CHUNK = {"options": "2e4", "bonds": "5e5"}    # ~50 option chunks, 6 bond chunks


def start(args, extra_env: dict | None = None, memory: int | None = None) -> subprocess.Popen:
    """`mpiexec -n RANKS pricer ARGS` in a session of its own (its every process one group), each
    process's address space limited to `memory` bytes if given."""
    def limit():
        if memory:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cmd = [mpiexec(), "-n", str(RANKS)] + pricer_command() + [str(a) for a in args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env(), **(extra_env or {})), start_new_session=True,
                            preexec_fn=limit)


def finish(job: subprocess.Popen) -> subprocess.CompletedProcess:
    """The job's end; one still running after HANG_TIMEOUT has hung: its group is killed and the
    test fails."""
    try:
        stdout, stderr = job.communicate(timeout=HANG_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"the run hung ({HANG_TIMEOUT} s): {stderr[-2000:]}")
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def run(args, extra_env: dict | None = None, memory: int | None = None):
    return finish(start(args, extra_env, memory))


def refused(proc, *needles) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stderr.count("pricer: error:") == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """family -> (book, its finished checkpoint, the results of the run that made it, the
    arguments of a run of it): an option book priced with --greeks, a book of bond options."""
    from pricer.tools.bond_datasets import write_dataset
    folder = tmp_path_factory.mktemp("books")
    write_portfolio(str(folder / "options.h5"), make_book())
    write_dataset(str(folder / "bonds.h5"), "S1", 300, 0)
    made = {}
    for family, extra in (("options", ["--greeks"]), ("bonds", [])):
        book, ck, out = folder / f"{family}.h5", folder / f"{family}-ck", folder / f"{family}-out.h5"
        args = ["--backend", "cpu", "--threads", "1", "--chunk-nodes", CHUNK[family]] + extra
        proc = run(["price", book, "-o", out, "--checkpoint", ck] + args)
        assert proc.returncode == 0, proc.stderr
        made[family] = (book, ck, out, args)
    return made


def damaged(tmp_path, books, family: str):
    """A copy of the family's finished checkpoint in tmp_path/ck (its links copied as links), the
    book and the arguments of a run of it with that checkpoint."""
    book, ck, out, args = books[family]
    folder = tmp_path / "ck"
    shutil.copytree(ck, folder, symlinks=True)
    return book, folder, out, args + ["--checkpoint", folder]


def left_in(tmp_path) -> list:
    """What a refused run left in tmp_path besides the checkpoint folder and the test's files."""
    return sorted(set(os.listdir(tmp_path)) - {"ck", "outside.bin"})


# -------------------------------------------------------------- entries that are no regular file

@pytest.mark.parametrize("family", ["options", "bonds"])
@pytest.mark.parametrize("entry", ["chunk-00000002.bin", "manifest.json"])
def test_a_fifo_in_a_checkpoint_is_refused_never_opened(tmp_path, books, family, entry):
    """A FIFO in place of a chunk file or the manifest of a valid checkpoint: a read would wait
    for a writer for ever (rank 0 in its plan, the others in the verdict). Refused before any
    pricing, exit 2, one line naming it; the FIFO is left as it is, nothing written."""
    book, folder, _, args = damaged(tmp_path, books, family)
    (folder / entry).unlink()
    os.mkfifo(folder / entry)
    proc = run(["price", book, "-o", tmp_path / "out.h5"] + args, NO_PRICING)
    refused(proc, f"{folder / entry}: is a FIFO")
    assert stat.S_ISFIFO(os.lstat(folder / entry).st_mode)
    assert left_in(tmp_path) == [], left_in(tmp_path)


@pytest.mark.parametrize("target", ["/dev/zero", "outside", "inside"])
def test_a_link_in_a_checkpoint_is_refused_never_followed(tmp_path, books, target):
    """A chunk file that is a symbolic link — to /dev/zero (read to its end, it never ends: the
    process is killed for memory), to a file outside the folder, or to another chunk file inside
    it — is refused before any pricing, exit 2, one line naming it and its target; the link and
    its target are left as they are. Each process's memory is limited (MEMORY), so that a run
    that reads /dev/zero fails rather than take the machine's."""
    book, folder, _, args = damaged(tmp_path, books, "options")
    victim = folder / "chunk-00000002.bin"
    if target == "outside":
        (tmp_path / "outside.bin").write_bytes(victim.read_bytes())
        target = str(tmp_path / "outside.bin")
    elif target == "inside":
        target = "chunk-00000003.bin"
    victim.unlink()
    victim.symlink_to(target)
    proc = run(["price", book, "-o", tmp_path / "out.h5"] + args, NO_PRICING, memory=MEMORY)
    refused(proc, f"{victim}: is a symbolic link (to {target})")
    assert os.readlink(victim) == target
    assert left_in(tmp_path) == [], left_in(tmp_path)


@pytest.mark.parametrize("family", ["options", "bonds"])
def test_a_directory_named_like_a_chunk_is_refused_before_pricing(tmp_path, books, family):
    """A directory where a chunk file should be (its chunk's file could never be renamed over it,
    so the run would price, then fail at the save): refused before any pricing, exit 2, one
    line naming it; the directory and what it holds are left as they are."""
    book, folder, _, args = damaged(tmp_path, books, family)
    victim = folder / "chunk-00000002.bin"
    victim.unlink()
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    proc = run(["price", book, "-o", tmp_path / "out.h5"] + args, NO_PRICING)
    refused(proc, f"{victim}: is a directory", "remove it")
    assert (victim / "notes.txt").read_text() == "mine"
    assert left_in(tmp_path) == [], left_in(tmp_path)


def test_a_chunk_file_larger_than_a_whole_one_is_priced_again_unread(tmp_path, books):
    """A chunk file of 64 GiB (sparse: no disk used): never read (each process's memory is
    limited, MEMORY, below its size), its chunk priced again, the summary says so, and the
    results are bitwise those of the run that made the checkpoint; the file is replaced by the
    chunk's."""
    book, folder, out, args = damaged(tmp_path, books, "options")
    victim = folder / "chunk-00000002.bin"
    with open(victim, "r+b") as f:
        f.truncate(64 << 30)
    proc = run(["price", book, "-o", tmp_path / "out.h5"] + args, memory=MEMORY)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "checkpoint: 1 chunk file(s) failed their checks" in proc.stdout, proc.stdout
    got, want = read_results(str(tmp_path / "out.h5")), read_results(str(out))
    for name in ("price", "delta", "gamma", "theta", "vega", "rho"):
        assert bitwise_equal(got[name], want[name]), name
    assert victim.stat().st_size < 1 << 20


# ----------------------------------------------------------------- a chunk changed during a resume

def _chunks(folder) -> set:
    return {name for name in os.listdir(folder) if name.startswith("chunk-")}


def test_a_chunk_changed_during_a_resume_ends_it_in_one_line(tmp_path, books):
    """A resume reads a saved chunk in its plan and again at the end: a chunk file changed in
    between (another process writing the folder) ends the run with exit 1 (the run's fault, not
    its input's) and one line that names it and says what to do, no traceback, nothing written,
    no claim left; the same command then prices that chunk again and writes the results, bitwise
    those of the run that made the checkpoint."""
    book, folder, out, args = damaged(tmp_path, books, "bonds")
    names = sorted(_chunks(folder))
    for name in names[2:]:                     # 4 chunks to price, 2 a rank: seconds apart
        (folder / name).unlink()
    kept = _chunks(folder)
    target = tmp_path / "out.h5"
    job = start(["price", book, "-o", target] + args, {"PRICER_CHUNK_DELAY": "2"})
    deadline = time.monotonic() + HANG_TIMEOUT
    while _chunks(folder) == kept and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)            # until the pricing has saved a chunk (after the plan)
    victim = folder / names[0]
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    proc = finish(job)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("pricer: error:") == 1, \
        proc.stderr
    assert f"{victim}: changed while this run was using it" in proc.stderr, proc.stderr
    assert "run the same command again" in proc.stderr, proc.stderr
    assert left_in(tmp_path) == [], left_in(tmp_path)
    again = run(["price", book, "-o", target] + args)
    assert again.returncode == 0, again.stderr
    assert "checkpoint: 1 bond chunk file(s) failed their checks" in again.stdout, again.stdout
    got, want = read_results(str(target)), read_results(str(out))
    assert bitwise_equal(got["bonds"]["price"], want["bonds"]["price"])


# -------------------------------------------------------------------- a stuck opening stage

@pytest.mark.parametrize("how", ["hang", "stop"])
def test_a_rank_0_stuck_in_the_opening_stages_ends_the_job_named(tmp_path, books, how):
    """Rank 0 stuck in its plan of the run, where it reads the input and opens the checkpoint —
    its planning thread never returning (PRICER_FAULT=hang:0:plan, as a read on a hung file
    system) or its process stopped (stop:0:plan, SIGSTOP) — while rank 1 waits for it: the
    watchdog of the opening stages ends the job (without it, both would wait for ever), exit 1,
    naming rank 0 and the stage, no traceback, nothing written, no process left; the same
    command then finishes from the checkpoint."""
    book, folder, out, args = damaged(tmp_path, books, "bonds")
    target = tmp_path / "out.h5"
    command = ["price", book, "-o", target] + args
    proc = run(command + ["--stall-timeout", "2"], {"PRICER_FAULT": f"{how}:0:plan"})
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "pricer: error: stalled: rank 0 (host " in proc.stderr, proc.stderr
    assert "in the run's opening stages" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr
    assert not target.exists() and leftover_processes(str(target)) == []
    take_over(target)           # a stopped rank 0 is killed by the launcher: its claims go with it
    take_over(folder)
    again = run(command)
    assert again.returncode == 0, again.stderr
    assert bitwise_equal(read_results(str(target))["bonds"]["price"],
                         read_results(str(out))["bonds"]["price"])


# --------------------------------------------------------------- checkpoint paths that cannot work

def test_a_missing_parent_folder_is_refused_by_the_disk_check(tmp_path):
    """check_disk (rank 0, before pricing) names a checkpoint folder whose parent does not exist
    (InputError: exit 2, one line), whoever calls it."""
    from pricer.errors import InputError
    from pricer.run.checks import check_disk
    from pricer.run.config import RunConfig

    missing = tmp_path / "missing" / "parent" / "ck"
    cfg = RunConfig(input=str(tmp_path / "book.h5"), output=str(tmp_path / "out.h5"),
                    checkpoint=str(missing))
    with pytest.raises(InputError, match="does not exist"):
        check_disk(cfg, 100, 3)


@pytest.mark.parametrize("case", ["missing-parent", "the-output", "the-input",
                                  "output-inside", "a-file"])
def test_a_checkpoint_path_that_cannot_work_is_refused_up_front(tmp_path, books, case):
    """`--checkpoint missing/parent/ck`, `-o x.h5 --checkpoint x.h5` (which priced everything,
    then failed to write the output over the folder it had made), the checkpoint the input
    itself, an output inside the checkpoint folder, a checkpoint path that is a regular file:
    each refused before any pricing, exit 2, one line naming it, nothing made or changed."""
    book, _, _, args = books["bonds"]
    out, folder = tmp_path / "x.h5", tmp_path / "ck"
    needle = {"missing-parent": "does not exist", "the-output": "--checkpoint names the output",
              "the-input": "--checkpoint names the input",
              "output-inside": "the output is inside the checkpoint folder",
              "a-file": "is a regular file"}[case]
    if case == "missing-parent":
        folder = tmp_path / "missing" / "parent" / "ck"
    elif case == "the-output":
        folder = out
    elif case == "the-input":
        folder = tmp_path / "book.h5"
        shutil.copy(book, folder)
        book = folder
    elif case == "output-inside":
        folder.mkdir()
        out = folder / "x.h5"
    elif case == "a-file":
        folder.write_text("mine")
    before = sorted(os.listdir(tmp_path))
    proc = run(["price", book, "-o", out, "--checkpoint", folder] + args, NO_PRICING)
    refused(proc, needle)
    assert sorted(os.listdir(tmp_path)) == before
    if folder.is_dir():
        assert os.listdir(folder) == []
