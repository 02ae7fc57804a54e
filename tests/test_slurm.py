"""The slurm/ scripts on a real single-host Slurm cluster, and the shipped job specs.

The shipped job specs, docs/jobs.md and the scripts' syntax are checked everywhere (no cluster).

The cluster tests are opt-in: they run only with PRICER_TEST_SLURM=1 (`.ci/run` sets it), and skip
otherwise, naming the variable, before anything is installed or started — where Slurm is
installed too. With it: Debian's slurm-wlm (which brings slurmctld and slurmd) and munge,
installed here with `apt-get` as root when `slurmctld` is missing (CI's machine is a fresh root
Debian with apt), munged + slurmctld + slurmd on localhost with every file (slurm.conf, gres.conf,
key, state, spool, logs) under a temporary directory and free ports, started by the module
fixture and stopped (by process id) at its teardown. One real node of 2 CPUs (`cpu` partition,
default) runs the CPU scripts for real with `sbatch`; a `gpu` partition of two power-saved CLOUD
nodes of 4 fake GPUs each (never started) lets `sbatch --test-only` check the GPU scripts'
requests against a gres configuration. Once opted in, if Slurm cannot be installed or started,
the tests fail with the reason (never skip).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import BIN, ROOT, env as base_env, run_pricer

SLURM = ROOT / "slurm"
JOBS = ROOT / "jobs"
APT_PACKAGES = ["slurm-wlm", "munge"]
OPT_IN = "PRICER_TEST_SLURM"
SKIP_REASON = (f"real-Slurm tests are opt-in: set {OPT_IN}=1 to run them (they start munged, "
               f"slurmctld and slurmd on this host and, where slurmctld is missing, install "
               f"{' and '.join(APT_PACKAGES)} (slurmctld, slurmd) with apt-get as root)")


def _opted_in() -> bool:
    return os.environ.get(OPT_IN, "") not in ("", "0")


def _require_opt_in() -> None:
    """Skip a cluster test unless PRICER_TEST_SLURM is set: decided before anything is installed
    or started, whether Slurm is installed or not."""
    if not _opted_in():
        pytest.skip(SKIP_REASON)
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
        "DEADLINE", "PREEMPTED"}

SMALL_JOB = """\
[portfolio]
path = "book.h5"

[portfolio.generate]
dist = "random"
count = 400
seed = 11
min_steps = 16
max_steps = 512

[pricing]
backend = "cpu"

[output]
path = "results.h5"
overwrite = true
"""


# ------------------------------------------------------------------------------------------------
# The shipped job specs and docs/jobs.md (no cluster needed)

@pytest.mark.parametrize("name", ["demo.toml", "large.toml", "scaling.toml", "scaling-gpu.toml",
                                  "scaling-realistic.toml"])
def test_shipped_job_specs_load(name):
    from pricer.io.jobs import load_job

    job = load_job(str(JOBS / name))
    assert job["portfolio"]["generate"]["dist"] == "random"
    if name == "large.toml":
        assert job["portfolio"]["generate"]["count"] == 1_000_000
    if name == "scaling.toml":  # one thread per rank: the rank count is the scaling variable
        assert job["pricing"]["threads"] == 1 and job["pricing"]["backend"] == "cpu"
    if name == "scaling-gpu.toml":  # one rank per GPU, the batch backend
        assert job["pricing"]["backend"] == "batch"
        assert job["portfolio"]["generate"]["count"] == 1_000_000
    if name == "scaling-realistic.toml":  # short lattices, every rank reading its own rows
        assert job["pricing"]["backend"] == "batch" and job["pricing"]["distribute"] == "read"
        assert job["portfolio"]["generate"]["max_steps"] == 2048


def test_docs_jobs_lists_every_shipped_job():
    text = (ROOT / "docs" / "jobs.md").read_text()
    for path in sorted(JOBS.glob("*.toml")):
        assert f"| `jobs/{path.name}` |" in text, f"docs/jobs.md's table of shipped jobs lacks {path.name}"


@pytest.mark.parametrize("table,key", [("portfolio", "colour"), ("portfolio.generate", "size"),
                                       ("pricing", "engine"), ("output", "compress")])
def test_unknown_job_keys_refused_by_name(tmp_path, table, key):
    from pricer.errors import InputError
    from pricer.io.jobs import load_job

    text = SMALL_JOB.replace(f"[{table}]\n", f"[{table}]\n{key} = 1\n")
    assert text != SMALL_JOB
    (tmp_path / "job.toml").write_text(text)
    with pytest.raises(InputError, match=rf"unknown key {re.escape(table)}\.{key}; known: "):
        load_job(str(tmp_path / "job.toml"))


def test_unknown_job_table_refused_by_name(tmp_path):
    from pricer.errors import InputError
    from pricer.io.jobs import load_job

    (tmp_path / "job.toml").write_text(SMALL_JOB + "\n[outputs]\npath = 'x.h5'\n")
    with pytest.raises(InputError, match="unknown table.s. outputs; known: portfolio, pricing, output"):
        load_job(str(tmp_path / "job.toml"))


@pytest.mark.parametrize("script", sorted(p.name for p in SLURM.glob("*.sbatch")))
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(SLURM / script, os.X_OK), f"{script} is not executable"


def _cluster_tests() -> list[str]:
    """This module's tests that need the cluster (they take the `cluster` fixture)."""
    import inspect

    return [name for name, f in sorted(globals().items()) if name.startswith("test_")
            and callable(f) and "cluster" in inspect.signature(f).parameters]


@pytest.mark.parametrize("slurm", ["missing", "installed"])
def test_cluster_tests_are_opt_in(tmp_path, slurm):
    """Without PRICER_TEST_SLURM the cluster tests skip, naming it, and nothing is installed or
    started: with Slurm missing, no apt-get; with Slurm installed, no daemon. The cluster tests
    alone in a pytest of their own, with stand-ins first on PATH (apt-get; and slurmctld,
    slurmd, munged, sbatch where Slurm is "installed") that record every call, and any real
    Slurm off PATH."""
    names = _cluster_tests()
    assert len(names) >= 10, names
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    slurm_commands = ["slurmctld", "slurmd", "munged", "sbatch"]
    for name in ["apt-get"] + (slurm_commands if slurm == "installed" else []):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        stub.chmod(0o755)
    path = [str(bin_dir)] + [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and
                             not any(os.path.exists(os.path.join(d, c)) for c in slurm_commands)]
    environ = {k: v for k, v in os.environ.items() if k != OPT_IN and not k.startswith("PYTEST_")}
    environ["PATH"] = os.pathsep.join(path)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-q", "-p", "no:cacheprovider",
                           *(f"tests/test_slurm.py::{name}" for name in names)],
                          capture_output=True, text=True, timeout=300, env=environ, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = re.search(r"^(\d+) skipped in ", proc.stdout, re.M)   # and nothing else
    assert summary and int(summary.group(1)) >= len(names), out
    assert SKIP_REASON in " ".join(out.split()), out          # -rs may wrap the reason
    assert not calls.exists(), calls.read_text()


# ------------------------------------------------------------------------------------------------
# The cluster

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc})"


def _install(log) -> None:
    """apt-get the packages when slurmctld is missing (CI's fresh machine); fail with the reason."""
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail(f"Slurm is not installed and cannot be: apt-get install {' '.join(APT_PACKAGES)} "
                    f"needs root and apt-get (uid {os.geteuid()}, apt-get {shutil.which('apt-get')})")
    apt_env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    t0 = time.perf_counter()
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=apt_env, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                        f"{proc.stderr[-3000:]}")
    log(f"apt-get update + install {' '.join(APT_PACKAGES)}: {time.perf_counter() - t0:.1f}s")
    missing = [exe for exe in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(exe)]
    if missing:
        pytest.fail(f"installed {' '.join(APT_PACKAGES)} but {', '.join(missing)} not found")


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = {k: v for k, v in base_env().items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = str(root / "slurm.conf")

    def start(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        out.close()
        self.procs.append((name, proc))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{_tail(p)}" for p in sorted((self.root / "log").iterdir()))

    def slurm(self, *args, check=True, timeout=60, cwd=None, extra_env=None) -> subprocess.CompletedProcess:
        env = dict(self.env, **(extra_env or {}))
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))}: rc {proc.returncode}\n{proc.stdout}\n"
                                 f"{proc.stderr}")
        return proc

    def sbatch(self, *args, cwd, extra_env=None) -> str:
        proc = self.slurm("sbatch", "--parsable", *args, cwd=cwd, extra_env=extra_env)
        return proc.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout: float = 180) -> dict:
        """The job's final record (JobState, ExitCode, ...) once it has ended."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.slurm("scontrol", "show", "job", "-o", job_id, check=False)
            fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
            if fields.get("JobState") in DONE:
                return fields
            if time.monotonic() > deadline:
                self.slurm("scancel", job_id, check=False)
                raise AssertionError(f"job {job_id} still {fields.get('JobState')} after {timeout}s:\n"
                                     f"{proc.stdout}{proc.stderr}\n{self.logs()}")
            time.sleep(0.3)

    def stop(self) -> None:
        self.slurm("scancel", "--full", "--user", str(os.getuid()), check=False, timeout=30)
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


def _write_config(root: Path) -> None:
    ctld_port, slurmd_port = _free_port(), _free_port()
    (root / "slurm.conf").write_text(f"""\
# written by tests/test_slurm.py: one real node (localnode, 2 CPUs) and two powered-down
# CLOUD nodes of 4 GPUs (gres) that are never started, so sbatch --test-only can check GPU requests.
ClusterName=pricertest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=600
MailProg=/bin/true
GresTypes=gpu
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=3600
ResumeTimeout=600
SuspendExcNodes=localnode
NodeName=localnode NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=gpunode[1-2] NodeAddr=127.0.0.[2-3] CPUs=32 Gres=gpu:4 RealMemory=64000 State=CLOUD
PartitionName=cpu Nodes=localnode Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=localnode MaxTime=INFINITE State=UP PriorityTier=2
PartitionName=gpu Nodes=gpunode[1-2] MaxTime=INFINITE State=UP
""")
    (root / "gres.conf").write_text("NodeName=gpunode[1-2] Name=gpu Count=4\n")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require_opt_in()              # first: no apt-get, no daemon without the opt-in
    report = []
    log = report.append
    t0 = time.perf_counter()
    _install(log)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool/localnode", "log", "munge"):
        (root / sub).mkdir(parents=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    _write_config(root)
    c = Cluster(root)
    try:
        c.start("munged", ["munged", "-F", "--force", f"--key-file={key}",
                           f"--socket={root}/munge/munge.socket", f"--pid-file={root}/munge/munged.pid",
                           f"--seed-file={root}/munge/seed", f"--log-file={root}/log/munged.log"])
        _wait_for(lambda: (root / "munge" / "munge.socket").exists(), 120, c, "munged's socket")
        c.start("slurmctld", ["slurmctld", "-D", "-c", "-i"])
        _wait_for(lambda: c.slurm("scontrol", "ping", check=False).returncode == 0, 120, c,
                  "slurmctld to answer `scontrol ping`")
        c.start("slurmd", ["slurmd", "-D", "-N", "localnode"])
        _wait_for(lambda: c.slurm("sinfo", "-h", "-n", "localnode", "-o", "%T",
                                  check=False).stdout.strip() == "idle", 120, c, "localnode to be idle")
        log(f"cluster up (install included) in {time.perf_counter() - t0:.1f}s")
        c.report = report
        yield c
    finally:
        c.stop()
        print("\n".join(["", "test_slurm:", *report, f"whole fixture {time.perf_counter() - t0:.1f}s"]),
              file=sys.stderr)


def _wait_for(predicate, timeout: float, c: Cluster, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for name, proc in c.procs:
            if proc.poll() is not None:
                pytest.fail(f"Slurm could not start here: {name} exited with {proc.returncode} while "
                            f"waiting for {what}\n{c.logs()}")
        if time.monotonic() > deadline:
            pytest.fail(f"Slurm could not start here: no {what} after {timeout}s\n{c.logs()}")
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------
# The scripts, submitted for real on the CPU node

def _venv_env() -> dict:
    if not (BIN / "pricer").exists():
        pytest.fail(f"no {BIN / 'pricer'}: install the package into this Python's venv (tests/run.sh)")
    return {"PRICER_VENV": str(BIN.parent)}


def _prices(path: Path) -> np.ndarray:
    from pricer.io.results import read_results

    return read_results(str(path))["price"]


@pytest.fixture
def job_dirs(tmp_path):
    """A job spec in job/ and a separate submit/ directory (the .out files land there)."""
    (tmp_path / "job").mkdir()
    (tmp_path / "submit").mkdir()
    (tmp_path / "job" / "job.toml").write_text(SMALL_JOB)
    return tmp_path / "job", tmp_path / "submit"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """SMALL_JOB priced by the serial engine on one process, without Slurm (for the cluster
    tests: opt-in too)."""
    _require_opt_in()
    d = tmp_path_factory.mktemp("reference")
    (d / "job.toml").write_text(SMALL_JOB)
    proc = run_pricer(["run", "job.toml", "--backend", "serial"], cwd=d)
    assert proc.returncode == 0, proc.stderr
    return _prices(d / "results.h5")


def _finished(c: Cluster, job_id: str, submit: Path, state="COMPLETED", code="0:0") -> str:
    record = c.wait(job_id)
    outs = list(submit.glob(f"*-{job_id}.out"))
    text = outs[0].read_text() if outs else "(no .out file in the submit directory)"
    assert (record["JobState"], record["ExitCode"]) == (state, code), (record, text, c.logs())
    return text


def test_cpu_script_srun(cluster, job_dirs, reference):
    """srun --mpi=pmi2 starts the venv's mpich ranks; the job spec's relative paths are taken from
    the submit directory (as `pricer run`'s from where it starts), results bitwise serial."""
    job, submit = job_dirs
    jid = cluster.sbatch(SLURM / "cpu.sbatch", "../job/job.toml", cwd=submit, extra_env=_venv_env())
    text = _finished(cluster, jid, submit)
    assert "launcher srun" in text and "priced 400 options" in text and "on 2 rank(s)" in text, text
    assert sorted(p.name for p in job.iterdir()) == ["job.toml"]
    assert {"book.h5", "results.h5"} <= {p.name for p in submit.iterdir()}
    assert np.array_equal(_prices(submit / "results.h5"), reference)


def test_cpu_script_mpiexec_and_flag_overrides(cluster, job_dirs, reference):
    """PRICER_LAUNCHER=mpiexec (hydra inside the allocation); flags after the job spec override it."""
    job, submit = job_dirs
    jid = cluster.sbatch(SLURM / "cpu.sbatch", job / "job.toml", "--partition", "count", "-o", "counted.h5",
                         cwd=submit, extra_env=dict(_venv_env(), PRICER_LAUNCHER="mpiexec"))
    text = _finished(cluster, jid, submit)
    assert "launcher mpiexec" in text and "wrote counted.h5" in text and "on 2 rank(s)" in text, text
    assert not (submit / "results.h5").exists() and not (job / "counted.h5").exists()
    assert np.array_equal(_prices(submit / "counted.h5"), reference)


def _cpu_job(cluster, tmp_path, job_toml: str) -> str:
    """tmp_path/job/job.toml (the book already in tmp_path/submit, where its relative paths are
    taken from) submitted with cpu.sbatch from tmp_path/submit; its output once it completed."""
    (tmp_path / "job" / "job.toml").write_text(job_toml)
    jid = cluster.sbatch(SLURM / "cpu.sbatch", "../job/job.toml", cwd=tmp_path / "submit",
                         extra_env=_venv_env())
    return _finished(cluster, jid, tmp_path / "submit")


def test_implied_vol_job_under_srun(cluster, tmp_path):
    """pricing.task = "implied-vol": the job's implied volatilities are the Python API's, bitwise."""
    import pricer
    from pricer.io.portfolio import write_portfolio
    from pricer.io.results import read_results
    from pricer.tools.generate import generate, with_market_prices

    (tmp_path / "job").mkdir()
    (tmp_path / "submit").mkdir()
    book = generate("random", 300, seed=12, min_steps=16, max_steps=400)
    with_market_prices(book)
    write_portfolio(str(tmp_path / "submit" / "book.h5"), book)
    text = _cpu_job(cluster, tmp_path,
                    '[portfolio]\npath = "book.h5"\n\n[pricing]\nbackend = "cpu"\n'
                    'task = "implied-vol"\n\n[output]\npath = "iv.h5"\n')
    assert "solved the implied volatilities of 300 options" in text and "on 2 rank(s)" in text
    got = read_results(str(tmp_path / "submit" / "iv.h5"))
    columns = {name: getattr(book, name) for name in ("id", "spot", "strike", "maturity", "rate",
                                                      "dividend", "steps", "call", "american",
                                                      "market_price")}
    want = pricer.implied_volatility(columns, backend="cpu")
    assert np.array_equal(got["implied_volatility"], want["implied_volatility"].to_numpy(),
                          equal_nan=True)
    assert (got["status"] == 0).sum() > 280


def test_scenario_grid_job_under_srun(cluster, tmp_path):
    """A job's [scenarios] table: every option under every combination on the job's 2 ranks,
    bitwise the Python API's grid, the base prices unchanged."""
    import pricer
    from pricer.io.portfolio import write_portfolio
    from pricer.io.results import read_results
    from pricer.tools.generate import generate

    (tmp_path / "job").mkdir()
    (tmp_path / "submit").mkdir()
    book = generate("random", 120, seed=13, min_steps=16, max_steps=300)
    write_portfolio(str(tmp_path / "submit" / "book.h5"), book)
    text = _cpu_job(cluster, tmp_path,
                    '[portfolio]\npath = "book.h5"\n\n[pricing]\nbackend = "cpu"\n\n'
                    '[output]\npath = "grid.h5"\n\n[scenarios]\nspot = "-0.1:0.1:3"\n'
                    'volatility = [-0.02, 0.05]\ndays = [0, 7]\n')
    assert "12 scenarios" in text and "on 2 rank(s)" in text, text
    got = read_results(str(tmp_path / "submit" / "grid.h5"))
    columns = {name: getattr(book, name) for name in ("id", "spot", "strike", "maturity", "rate",
                                                      "dividend", "volatility", "steps", "call",
                                                      "american")}
    want = pricer.price(columns, backend="cpu",
                        scenarios=dict(spot=[-0.1, 0.0, 0.1], volatility=[-0.02, 0.05],
                                       days=[0, 7]))
    names = [f"scenario:{k}" for k in range(12)]
    assert np.array_equal(got["scenarios"]["price"], want[names].to_numpy())
    assert np.array_equal(got["price"], want["price"].to_numpy())


def test_bond_book_job_under_srun(cluster, tmp_path):
    """A job whose book is a file of bond options: priced on the job's 2 ranks, bitwise the
    Python API's."""
    import pricer
    from pricer.io.results import read_results
    from pricer.tools.bond_datasets import write_dataset

    (tmp_path / "job").mkdir()
    (tmp_path / "submit").mkdir()
    write_dataset(str(tmp_path / "submit" / "bonds.h5"), "S2", 200, seed=4)
    text = _cpu_job(cluster, tmp_path, '[portfolio]\npath = "bonds.h5"\n\n[pricing]\n'
                    'backend = "cpu"\n\n[output]\npath = "b.h5"\n')
    assert "priced 200 bond options" in text and "on 2 rank(s)" in text
    got = read_results(str(tmp_path / "submit" / "b.h5"))["bonds"]
    want = pricer.price_bonds(str(tmp_path / "submit" / "bonds.h5"))
    assert np.array_equal(got["price"], want["price"].to_numpy())


def test_cpu_script_bad_job_exits_2(cluster, job_dirs):
    """A job spec pricer refuses fails the Slurm job with pricer's exit code 2 and its message."""
    job, submit = job_dirs
    (job / "job.toml").write_text(SMALL_JOB.replace("[pricing]\n", "[pricing]\nengine = 'cpu'\n"))
    jid = cluster.sbatch(SLURM / "cpu.sbatch", job / "job.toml", cwd=submit, extra_env=_venv_env())
    text = _finished(cluster, jid, submit, state="FAILED", code="2:0")
    assert "unknown key pricing.engine" in text, text
    assert sorted(p.name for p in job.iterdir()) == ["job.toml"]


def test_srun_without_pmi_is_refused(cluster, job_dirs):
    """srun --mpi=none starts singletons: pricer sees SLURM_STEP_NUM_TASKS != its world and stops."""
    job, submit = job_dirs
    jid = cluster.sbatch(SLURM / "cpu.sbatch", job / "job.toml", cwd=submit,
                         extra_env=dict(_venv_env(), PRICER_SRUN_MPI="none"))
    text = _finished(cluster, jid, submit, state="FAILED", code="2:0")
    assert "the launcher started 2 processes but MPI sees a world of 1" in text, text


def test_scaling_script(cluster, tmp_path):
    """The shipped scaling job over 1 and 2 ranks: a table, and bitwise-equal results per rank count."""
    shutil.copy(JOBS / "scaling.toml", tmp_path / "scaling.toml")
    jid = cluster.sbatch("-n", "2", SLURM / "scaling.sbatch", "scaling.toml", "--ranks", "1,2",
                         cwd=tmp_path, extra_env=_venv_env())
    text = _finished(cluster, jid, tmp_path)
    rows = (tmp_path / "scaling_results.scaling.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["ranks", "nodes", "step_s", "pricer_s", "speedup", "efficiency"], rows
    assert [r.split("\t")[0] for r in rows[1:]] == ["1", "2"], rows
    assert all(float(x) > 0 for r in rows[1:] for x in r.split("\t")[2:]), rows
    assert text.count("priced 10000 options") == 2, text
    assert np.array_equal(_prices(tmp_path / "scaling_results.ranks1.h5"),
                          _prices(tmp_path / "scaling_results.ranks2.h5"))
    assert not list(tmp_path.glob(".pricer-warmup-*")), "the warm-up folder was left behind"


@pytest.mark.parametrize("launcher,how", [("srun", "requeue"), ("mpiexec", "requeue"),
                                          ("srun", "preempt")])
def test_a_requeued_job_continues_from_its_checkpoint(cluster, job_dirs, reference, launcher, how):
    """sbatch --requeue, then `scontrol requeue` while the job prices, or a job of a partition of
    a higher priority tier that preempts it (PreemptMode=REQUEUE): Slurm kills the first attempt
    and starts the same script again; one command serves both attempts (the checkpoint resumes
    by itself), the log keeps both, and the results are bitwise the serial ones."""
    job, submit = job_dirs
    folder = job / "ck"
    jid = cluster.sbatch("--requeue", SLURM / "cpu.sbatch", job / "job.toml", "--checkpoint",
                         folder, "--chunk-nodes", "2e5", cwd=submit,
                         extra_env=dict(_venv_env(), PRICER_LAUNCHER=launcher,
                                        PRICER_CHUNK_DELAY="0.2", PRICER_PROGRESS="off"))
    deadline = time.monotonic() + 120
    chunks = lambda: len(list(folder.glob("chunk-*"))) if folder.exists() else 0  # noqa: E731
    while chunks() < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chunks() >= 4, cluster.logs()
    if how == "requeue":
        cluster.slurm("scontrol", "requeue", jid)
    else:   # both of the node's CPUs, at once: pricer's job is preempted and requeued
        urgent = cluster.sbatch("-p", "urgent", "-n", "2", "--wrap", "sleep 1", cwd=submit)
    # Slurm holds a requeued job back for two minutes (its BeginTime); the test does not wait
    deadline = time.monotonic() + 60
    while _attempts(submit, jid) < 2 and time.monotonic() < deadline:
        state = cluster.slurm("squeue", "-h", "-j", jid, "-o", "%T", check=False).stdout.strip()
        if state == "PENDING":
            cluster.slurm("scontrol", "update", f"JobId={jid}", "StartTime=now", check=False)
        time.sleep(0.3)
    text = _finished(cluster, jid, submit)
    record = cluster.wait(jid)
    assert record["Restarts"] == "1", record
    if how == "preempt":
        assert cluster.wait(urgent)["JobState"] == "COMPLETED"
        assert "DUE TO PREEMPTION" in text, text
    assert text.count("pricer-slurm: job") == 2, text           # both attempts in one log
    assert "from the checkpoint)" in text, text
    assert "Traceback" not in text, text
    assert np.array_equal(_prices(submit / "results.h5"), reference)


def _attempts(submit: Path, job_id: str) -> int:
    outs = list(submit.glob(f"*-{job_id}.out"))
    return outs[0].read_text().count("pricer-slurm: job") if outs else 0


# ------------------------------------------------------------------------------------------------
# The GPU scripts: no GPU here, so sbatch --test-only against the fake gres nodes

def _test_only(c: Cluster, *args, cwd) -> subprocess.CompletedProcess:
    return c.slurm("sbatch", "--test-only", "-p", "gpu", *args, check=False, cwd=cwd)


@pytest.mark.parametrize("script,nodes,cpus", [("gpu-node.sbatch", "gpunode1", 32),
                                               ("gpu-multinode.sbatch", "gpunode[1-2]", 64)])
def test_gpu_scripts_test_only(cluster, tmp_path, script, nodes, cpus):
    (tmp_path / "job.toml").write_text(SMALL_JOB)
    proc = _test_only(cluster, SLURM / script, "job.toml", cwd=tmp_path)
    assert proc.returncode == 0 and re.search(rf"to start at .* using {cpus} processors on nodes {re.escape(nodes)} "
                                              r"in partition gpu", proc.stderr), proc.stderr
    # the request is really checked against the gres: 5 GPUs on a node of 4 is refused
    proc = _test_only(cluster, "--ntasks-per-node=5", SLURM / script, "job.toml", cwd=tmp_path)
    assert proc.returncode != 0 and "Requested node configuration is not available" in proc.stderr, proc.stderr
    # the --gres variant the script's header describes
    text = (SLURM / script).read_text()
    assert "#SBATCH --gpus-per-task=1\n" in text
    (tmp_path / script).write_text(text.replace("#SBATCH --gpus-per-task=1\n", "#SBATCH --gres=gpu:4\n"))
    proc = _test_only(cluster, tmp_path / script, "job.toml", cwd=tmp_path)
    assert proc.returncode == 0 and f"on nodes {nodes} in partition gpu" in proc.stderr, proc.stderr
