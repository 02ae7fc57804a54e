"""Fault handling on the GPU backends: an injected fault (an exception, a GPU error, a hard kill) in a rank
pricing on the GPU ends the whole job (each run under a 120 s timeout against hangs; the seconds it
took printed, not bounded), named by rank 0, with nothing written and no rank left; kill -9 and
a restart with the `batch` backend give bitwise the prices and Greeks of an uninterrupted `batch`
run (a price does not depend on the chunk or launch that priced it). Real `mpirun -n 2` runs of
the real command, both ranks on one GPU. Marked `gpu`: skipped here with the reason, run on the
GPU machine (../shared/device)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from helpers import env, mpiexec, pricer_command
from pricer.io.results import read_results
from gpu_cases import GPU
from test_reliability import (CHUNK, HANG_TIMEOUT, _chunks, bitwise_equal,  # noqa: F401 (book)
                              book, kill_9_after_chunks, leftover_processes)

pytestmark = GPU
RANKS = 2


def run(args, extra_env: dict | None = None, timeout: float = HANG_TIMEOUT):
    e = env()
    e.update(extra_env or {})
    cmd = [mpiexec(), "-n", str(RANKS)] + pricer_command() + [str(a) for a in args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("backend", ["batch", "gpu"])   # hybrid would price these small N on the CPU
@pytest.mark.parametrize("fault,needles", [
    ("raise:1:1", ["pricer: error: rank 1 failed after 1 chunk(s)", "InjectedFault"]),
    ("gpu:0:2", ["pricer: error: rank 0 failed after 2 chunk(s)", "GpuUnavailable"]),
    ("kill:1:1", []),     # vanishes without a word: the launcher ends the job with its status
])
def test_gpu_fault_ends_job_named_nothing_written(tmp_path, book, backend, fault, needles):
    path, _ = book
    out = tmp_path / f"prices-{backend}.h5"
    # a first run compiles and caches the kernels, so that the timed one measures the abort
    warm, _ = run(["price", path, "-o", tmp_path / "warm.h5", "--backend", backend])
    assert warm.returncode == 0, warm.stdout + warm.stderr
    os.remove(tmp_path / "warm.h5")
    proc, seconds = run(["price", path, "-o", out, "--backend", backend, "--chunk-nodes", CHUNK],
                        {"PRICER_FAULT": fault, "PRICER_CHUNK_DELAY": "0.05"})
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    for needle in needles:
        assert needle in text, (needle, text)
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)   # no result, no temp file
    assert leftover_processes(str(out)) == []
    print(f"GPU FAULT backend={backend} fault={fault} exit={proc.returncode} seconds={seconds:.2f}")


def test_batch_kill_9_and_resume_bitwise_equal(tmp_path, book):
    path, _ = book
    whole, out, folder = tmp_path / "whole.h5", tmp_path / "prices.h5", tmp_path / "ck"
    common = ["--backend", "batch", "--chunk-nodes", CHUNK, "--greeks"]
    proc, _ = run(["price", path, "-o", whole] + common)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = ["price", path, "-o", out, "--checkpoint", folder] + common
    kill_9_after_chunks(args, folder, 6, ranks=RANKS)
    assert leftover_processes(str(out)) == []
    assert not out.exists()
    saved = _chunks(folder)
    assert 0 < saved
    proc, _ = run(args)                  # the same command resumes by itself
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, want = read_results(str(out)), read_results(str(whole))
    for name in ("price", "delta", "gamma", "theta", "vega", "rho"):
        assert bitwise_equal(got[name], want[name]), name
    assert "from the checkpoint" in proc.stdout, proc.stdout
    print(f"GPU RESUME chunks saved before the kill {saved} of {_chunks(folder)}; bitwise equal")


def test_ranks_on_a_cold_kernel_cache_compile_each_kernel_once(tmp_path, book):
    """Two ranks starting at once on an empty kernel cache (both on one GPU, as ranks of a node
    share a cache): each kernel module is compiled once — nvcc's compiles counted by a wrapper on
    PATH that runs the real nvcc — both price, and the next run compiles nothing."""
    path, _ = book
    real = shutil.which("nvcc")
    assert real, "nvcc not on PATH"
    bin_dir, log, cache = tmp_path / "bin", tmp_path / "nvcc.log", tmp_path / "cache"
    bin_dir.mkdir()
    wrapper = bin_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    extra = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PRICER_CUDA_CACHE": str(cache)}

    def compiles() -> int:
        return sum("cubin" in line for line in log.read_text().splitlines()) if log.exists() else 0

    for attempt in ("cold", "warm"):
        proc, seconds = run(["price", path, "-o", tmp_path / f"{attempt}.h5", "--backend", "batch"],
                            extra, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        print(f"GPU CACHE {attempt}: {compiles()} nvcc compiles, {seconds:.1f} s")
        if attempt == "cold":
            cubins = len(list(cache.glob("*.cubin")))
            assert cubins >= 5 and compiles() == cubins, (cubins, log.read_text())
    assert compiles() == cubins
