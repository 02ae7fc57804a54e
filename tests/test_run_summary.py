"""What a run tells its user about itself, through real commands: a first run on a machine says
that it compiles kernels and counts the compile as a stage of its own (outside the read and the
nodes per second); the summary names each rank's threads, and a CPU binding that leaves a rank
fewer threads than its share of the node is warned about; `--summary-json` writes the summary as
data; a command that no launcher started does not start MPI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, env, run_pricer
from pricer.io.portfolio import write_portfolio
from pricer.run.config import node_cores
from pricer.tools.generate import generate

STAGES = re.compile(r"^stages: (.*)$", re.M)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    path = tmp_path_factory.mktemp("summary") / "book.h5"
    write_portfolio(str(path), generate("random", 300, seed=8, max_steps=400))
    return path


def _stages(stdout: str) -> dict:
    found = STAGES.search(stdout)
    assert found, stdout
    return {name: float(seconds) for name, seconds in
            re.findall(r"(\w+) ([\d.]+)s", found.group(1))}


@pytest.mark.heavy
def test_a_first_run_says_it_compiles_and_times_the_compile_apart(tmp_path, book):
    """A cold kernel cache (NUMBA_CACHE_DIR of its own): one line on stderr as the compile
    begins, a `compile` stage first in the summary and in --summary-json, the nodes per second
    without it; the next run on the same cache compiles nothing and says nothing of it. --quiet
    prints nothing either way."""
    cache = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    args = ["price", book, "-o", tmp_path / "a.h5", "--backend", "serial", "--summary-json",
            tmp_path / "a.json"]
    cold = run_pricer(args, extra_env=cache, timeout=600)
    assert cold.returncode == 0, cold.stderr
    assert "pricer: compiling kernels (a first run of this pricer here; they are cached in " \
        in cold.stderr and "`pricer warm` compiles them ahead" in cold.stderr, cold.stderr
    stages = _stages(cold.stdout)
    assert list(stages)[0] == "compile" and stages["compile"] > 0, cold.stdout
    assert "nodes/s, compile excluded)" in cold.stdout, cold.stdout
    record = json.loads((tmp_path / "a.json").read_text())
    assert record["stages"]["compile"] == pytest.approx(stages["compile"], abs=1e-3)
    # the summary is a file of the run's like its output: replaced with --overwrite only
    again = run_pricer(args[:3] + [tmp_path / "b.h5"] + args[4:], extra_env=cache)
    assert again.returncode == 2 and "a.json: exists; pass --overwrite" in again.stderr, \
        again.stderr
    assert not (tmp_path / "b.h5").exists()
    warm = run_pricer(args[:3] + [tmp_path / "b.h5"] + args[4:] + ["--overwrite"],
                      extra_env=cache)
    assert warm.returncode == 0, warm.stderr
    assert "compiling" not in warm.stderr and "compile" not in _stages(warm.stdout), warm.stdout
    shutil.rmtree(tmp_path / "cache")
    quiet = run_pricer(["price", book, "-o", tmp_path / "c.h5", "--backend", "serial", "--quiet"],
                       extra_env=cache, timeout=600)
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == "", quiet.stderr


def _unset_threads() -> dict:
    """The environment without what would give the threads (not the affinity) their count."""
    return {k: v for k, v in env().items() if k not in ("SLURM_CPUS_PER_TASK",
                                                        "NUMBA_NUM_THREADS")}


def test_the_summary_names_the_ranks_threads(tmp_path, book, monkeypatch):
    for name in ("SLURM_CPUS_PER_TASK", "NUMBA_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cores = len(os.sched_getaffinity(0))
    proc = run_pricer(["price", book, "-o", tmp_path / "a.h5", "--backend", "cpu",
                       "--summary-json", tmp_path / "s.json"])
    assert proc.returncode == 0, proc.stderr
    assert f"on 1 rank(s) ({cores} thread{'s' if cores > 1 else ''} each)" in proc.stdout
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["threads"] == [cores] and record["ranks"] == 1 and record["instruments"] == 300
    assert set(record["stages"]) >= {"read", "compute", "write"}
    # two ranks: each its share of the cores it may run on, which the launcher's binding decides
    # (MPICH's hydra binds nothing, Open MPI's mpirun a rank to a core): warned where it is less
    # than its share of the node
    proc = run_pricer(["price", book, "-o", tmp_path / "b.h5", "--backend", "cpu",
                       "--summary-json", tmp_path / "t.json"], ranks=2)
    assert proc.returncode == 0, proc.stderr
    threads = json.loads((tmp_path / "t.json").read_text())["threads"]
    assert len(threads) == 2 and min(threads) >= 1
    shown = f"{threads[0]} thread{'s' if threads[0] > 1 else ''} each" \
        if threads[0] == threads[1] else f"{min(threads)}-{max(threads)} threads"
    assert f"on 2 rank(s) ({shown})" in proc.stdout, proc.stdout
    share = max(1, node_cores() // 2)
    assert ("pricer: warning: this process may run on" in proc.stderr) == (min(threads) < share), \
        (threads, share, proc.stderr)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                    reason="needs taskset and two cores to bind a run to one of them")
def test_a_binding_to_fewer_cores_is_warned_about(tmp_path, book):
    """taskset -c 0 on a host of several cores (as Open MPI's default --bind-to core does to each
    rank): one thread, said in the summary, and a warning naming the cause and the way out."""
    e = _unset_threads()
    cpu = min(os.sched_getaffinity(0))
    cmd = ["taskset", "-c", str(cpu), sys.executable, "-m", "pricer", "price", str(book), "-o",
           str(tmp_path / "a.h5"), "--backend", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "on 1 rank(s) (1 thread each)" in proc.stdout, proc.stdout
    cores = node_cores()
    assert f"pricer: warning: this process may run on 1 of the node's {cores} cores (its CPU " \
           f"affinity" in proc.stderr and "--bind-to none" in proc.stderr, proc.stderr
    given = subprocess.run(cmd + ["--threads", "1", "-o", str(tmp_path / "b.h5")],
                           capture_output=True, text=True, env=e, timeout=120)
    assert given.returncode == 0 and "warning" not in given.stderr, given.stderr


def test_a_command_no_launcher_started_does_not_start_mpi(tmp_path, book):
    """Without mpiexec, mpirun or srun the run is one rank and never imports mpi4py.MPI (whose
    MPI_Init is ~0.5 s of every command under Open MPI); its results are bitwise those of
    `mpiexec -n 1`."""
    code = ("import sys; from pricer.cli import main; "
            f"code = main(['price', {str(book)!r}, '-o', {str(tmp_path / 'a.h5')!r}, "
            "'--backend', 'cpu', '--quiet']); "
            "print(code, 'mpi4py.MPI' in sys.modules)")
    e = {k: v for k, v in env().items()
         if not k.startswith(("PMI_", "PMIX_", "OMPI_", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "False"], proc.stdout + proc.stderr
    launched = run_pricer(["price", book, "-o", tmp_path / "b.h5", "--backend", "cpu", "--quiet"],
                          ranks=1)
    assert launched.returncode == 0, launched.stderr
    import h5py
    with h5py.File(tmp_path / "a.h5") as a, h5py.File(tmp_path / "b.h5") as b:
        assert a["results/price"][()].tobytes() == b["results/price"][()].tobytes()
