"""Every cuda/*.cu compiles with nvcc for sm_80 and sm_90 (no GPU needed), and with every set of
-D flags the engines pass for sm_90, so a kernel that does not compile fails CI. Without nvcc this
skips with the reason, unless CI is set: then it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pricer.engines.gpu.trinomial import defines as trinomial_defines

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "cuda"
SOURCES = sorted(CUDA.glob("*.cu"))

# batch.cu's required -D flags: its input layout and the constants the host's launches use. The
# values come from pricer's batch layout module (the engine passes them); these copies only let
# the kernels compile here, and the GPU tests check the real ones against the kernels' results.
BATCH_LAYOUT = ["-DVT=4", "-DIN_SPOT=0", "-DIN_STRIKE=1", "-DIN_LOG_UP=2", "-DIN_LOG_DOWN=3",
                "-DIN_PU=4", "-DIN_PD=5", "-DIN_STEPS_AT=48", "-DIN_ORDER_AT=52", "-DIN_CALL_AT=56",
                "-DIN_AMERICAN_AT=57", "-DSORT_THREADS=1024", "-DWORK_ORDER_THREADS=1024",
                "-DWORK_RANK_LANES=8", "-DWIDTH_MARGIN=2"]

# trinomial.cu's: the numbers it shares with the host, as its engine passes them
TRINOMIAL_LAYOUT = trinomial_defines()

# (source, flags): the builds the engines ask for (architectures: _archs)
VARIANTS = [
    # the batch kernels, one module per warp count W: the default W = 1 and the widest family
    # (W = 2 and 4 are the same code with a W between those two; the GPU tests build every W)
    ("batch.cu", BATCH_LAYOUT),
    ("batch.cu", ["-DBATCH_W=16", *BATCH_LAYOUT]),
    # the lattice kernels: the defaults (exact mode), the production fma module, the persistent
    # kernel's narrow shape, the exact mode with it, the mid-regime module, a wide tiled block
    ("binomial.cu", []),
    ("binomial.cu", ["-DPRICER_FMA=1", "-DTILED_B=256", "-DTILED_VT=8", "-DWARP_VT=8", "-DPERS_VT=8",
                     "-DPERS_K=64", "-DPERS_WARPS=4"]),
    ("binomial.cu", ["-DPRICER_FMA=1", "-DTILED_B=512", "-DTILED_VT=4", "-DWARP_VT=16",
                     "-DPERS_VT=4", "-DPERS_K=64", "-DPERS_WARPS=4"]),
    ("binomial.cu", ["-DPRICER_FMA=0", "-DTILED_B=256", "-DTILED_VT=8", "-DWARP_VT=8", "-DPERS_VT=4",
                     "-DPERS_K=64", "-DPERS_WARPS=4"]),
    ("binomial.cu", ["-DPRICER_FMA=1", "-DTILED_B=256", "-DTILED_VT=2", "-DWARP_VT=8"]),
    ("binomial.cu", ["-DTILED_B=1024", "-DTILED_VT=8"]),
    ("fp64_peak.cu", ["-DCHAINS=8"]),
    ("trinomial.cu", TRINOMIAL_LAYOUT),
]


def _nvcc() -> str:
    found = shutil.which("nvcc") or next(
        (str(p) for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",
                          Path("/usr/local/bin/nvcc")) if p.exists()), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc not found, and CI is set: the CUDA sources must be compiled in CI")
        pytest.skip("nvcc not found (install the CUDA toolkit, or set CI=1 to make this fail)")
    return found


def test_sources_exist():
    assert SOURCES, "no cuda/*.cu found"


def test_every_source_has_variants():
    assert {s.name for s in SOURCES} == {name for name, _ in VARIANTS}


def _variant_id(variant) -> str:
    name, flags = variant
    shown = [f.removeprefix("-D") for f in flags if f not in BATCH_LAYOUT + TRINOMIAL_LAYOUT]
    return f"{name}[{' '.join(shown)}]"


# the architectures a source's first build is compiled for (one nvcc call, the architectures on
# nvcc's own threads: --threads); its other builds, the same code under other -D flags, for sm_90
# alone, which takes half of ptxas's time
ARCHS = ("sm_80", "sm_90")


def _archs(variant) -> tuple:
    first = next(v for v in VARIANTS if v[0] == variant[0])
    return ARCHS if tuple(variant) == first else ("sm_90",)


@pytest.mark.heavy
@pytest.mark.parametrize("variant", VARIANTS, ids=[_variant_id(v) for v in VARIANTS])
def test_compiles(variant, tmp_path):
    nvcc = _nvcc()
    name, flags = variant
    source = CUDA / name
    out = tmp_path / f"{source.stem}.fatbin"
    archs = _archs(variant)
    targets = [f"-gencode=arch=compute_{arch[3:]},code={arch}" for arch in archs]
    cmd = [nvcc, "--fatbin", *targets, f"--threads={len(archs)}", "-O3", "-Xptxas", "-v",
           "-Werror", "all-warnings", *flags, "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    assert out.stat().st_size > 0
    # every architecture compiled (ptxas reports each), and no register spills in any kernel
    for arch in archs:
        assert f"for '{arch}'" in proc.stderr, (arch, proc.stderr)
    spills = [line for line in proc.stderr.splitlines() if "spill stores" in line]
    assert spills and all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), proc.stderr


@pytest.mark.parametrize("missing", [None, *BATCH_LAYOUT],
                         ids=["all", *(f.removeprefix("-D").split("=")[0] for f in BATCH_LAYOUT)])
def test_batch_layout_is_required(missing, tmp_path):
    """batch.cu has no default for its layout: a build without one of its flags (or without any)
    fails with the #error that names it, so the contract with the host cannot silently go."""
    nvcc = _nvcc()
    flags = [] if missing is None else [f for f in BATCH_LAYOUT if f != missing]
    want = (BATCH_LAYOUT[0] if missing is None else missing).removeprefix("-D").split("=")[0]
    # preprocessing alone reaches the #error (a fraction of a second)
    cmd = [nvcc, "-arch=sm_90", "-E", *flags, "-o", str(tmp_path / "batch.ii"),
           str(CUDA / "batch.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, f"{' '.join(cmd)} succeeded without {want}"
    assert f"{want} must be given (-D)" in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.parametrize("missing", TRINOMIAL_LAYOUT,
                         ids=[f.removeprefix("-D").split("=")[0] for f in TRINOMIAL_LAYOUT])
def test_trinomial_layout_is_required(missing, tmp_path):
    """trinomial.cu takes its product and exercise codes, today, the dates' slack and its layout
    from the host (pricer/engines/gpu/trinomial.py, defines): a build without one of them fails."""
    nvcc = _nvcc()
    flags = [f for f in TRINOMIAL_LAYOUT if f != missing]
    cmd = [nvcc, "-arch=sm_90", "-E", *flags, "-o", str(tmp_path / "trinomial.ii"),
           str(CUDA / "trinomial.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, f"{' '.join(cmd)} succeeded without {missing}"
    assert "trinomial.cu's layout must be given (-D)" in proc.stdout + proc.stderr, proc.stderr


def test_a_cubin_is_compiled_under_its_lock_and_a_stuck_holder_is_outwaited(tmp_path, monkeypatch):
    """Ranks on one kernel cache: a process compiles a cubin only while it holds the cubin's
    flock (another that holds it makes it wait, or with wait=False pass it by), and one that holds
    it past LOCK_WAIT_SECONDS (a hung nvcc) does not hold the others' start: they compile without
    it, once they have waited LOCK_WAIT_SECONDS (patched to 0.2 s: the default, 300 s, is past the
    120 s this waits before calling it a hang)."""
    import fcntl
    import threading
    import time

    from pricer.engines.gpu import runtime

    path = tmp_path / "batch-key-sm_90.cubin"
    holder = open(path.with_suffix(".lock"), "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    entered = []

    def compile_it():
        with runtime._compiling(path):
            entered.append(time.monotonic())

    with runtime._compiling(path, wait=False) as held:
        assert held is False                  # busy: left to the holder for now
    waiting = threading.Thread(target=compile_it)
    waiting.start()
    time.sleep(0.3)
    assert entered == []                      # waits for the holder
    released = time.monotonic()
    holder.close()                            # releases the lock
    waiting.join(120)                         # against a hang, not on speed
    assert entered and entered[0] >= released

    holder = open(path.with_suffix(".lock"), "a")
    fcntl.flock(holder, fcntl.LOCK_EX)        # a holder that never lets go
    monkeypatch.setattr(runtime, "LOCK_WAIT_SECONDS", 0.2)
    outwaited = []

    def outwait():
        start = time.monotonic()
        with runtime._compiling(path) as held:
            outwaited.append((held, time.monotonic() - start))

    thread = threading.Thread(target=outwait, daemon=True)
    thread.start()
    thread.join(120)                          # against a hang: still waiting then is one
    holder.close()
    assert outwaited, "still waiting for the stuck holder after 120 s"
    held, waited = outwaited[0]
    assert held is True and 0.2 <= waited     # compiles without the lock, after the wait
