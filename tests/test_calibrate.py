"""`pricer calibrate` and its cache (pricer.engines.gpu.calibration): the file's name and key, the
atomic JSON round trip, files of older calibrations (their warp shape is ignored), the precedence
GpuConfig() < defaults < calibration < overrides (a fake device name, no GPU needed, the kernels
emulated), the --t1/--t2 options of price/run, the CLI without a GPU (exit 2), and a real quick
calibration on a GPU (marked `gpu`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import run_pricer
from numpy_kernels import NumpyKernels
from pricer import __version__
from pricer.engines import gpu_available
from pricer.engines.cpu.serial import SerialEngine
from pricer.engines.gpu.calibration import (CALIBRATED, RETIRED, SCHEMA, calibration_path,
                                            effective_config, load_calibration, sanitise,
                                            store_calibration)
from pricer.engines.gpu.config import GpuConfig
from pricer.engines.gpu.engine import GpuEngine
from pricer.io.portfolio import write_portfolio
from pricer.io.results import read_results
from pricer.model.lattice import lattice_parameters
from pricer.tools.generate import generate

FAKE = "Fake GPU 9000 (80GB) / PCIe"
VALUES = dict(t1=20_000, t2=128, tiled_vt=4, tiled_k=128, cpu_max_steps=700, hw_flat_rows=256,
              hw_flat_threads=512)
# the warp shape an older calibration also stored (GpuConfig's defaults are 8 and 64)
OLD_WARP = dict(warp_vt=4, warp_k=32)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PRICER_CALIBRATION", raising=False)
    return tmp_path / "xdg" / "pricer" / "calibration"


def record(values=VALUES, device=FAKE, version=__version__):
    return dict(schema=SCHEMA, device=device, arch="sm_90", version=version, values=dict(values),
                timings={"t1": {"rows": []}})


def test_path_and_key(cache, monkeypatch):
    assert sanitise("NVIDIA H200") == "NVIDIA_H200"
    assert sanitise(FAKE) == "Fake_GPU_9000_80GB_PCIe"
    assert calibration_path(FAKE) == cache / f"Fake_GPU_9000_80GB_PCIe-{__version__}.json"
    assert calibration_path(FAKE, "9.9").name == "Fake_GPU_9000_80GB_PCIe-9.9.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert calibration_path("NVIDIA H200", "1.0") == \
        Path("/home/someone/.cache/pricer/calibration/NVIDIA_H200-1.0.json")


def test_round_trip_is_atomic_and_keyed(cache):
    assert load_calibration(FAKE) is None                      # nothing cached yet
    path = store_calibration(record())
    assert path == calibration_path(FAKE) and path.exists()
    assert [p.name for p in cache.iterdir()] == [path.name]   # no temporary file left behind
    assert json.loads(path.read_text())["timings"] == {"t1": {"rows": []}}
    values, source = load_calibration(FAKE)
    assert values == VALUES and source == path
    assert load_calibration("Another GPU") is None              # keyed by the device name
    assert load_calibration(FAKE, "0.0.1") is None             # and by the pricer version
    # a second calibration replaces the first
    store_calibration(record(dict(VALUES, t1=40_000)))
    assert load_calibration(FAKE)[0]["t1"] == 40_000


def test_bad_files_are_ignored_with_a_warning(cache):
    path = calibration_path(FAKE)
    cache.mkdir(parents=True)
    for text in ("{not json", json.dumps(dict(record(), schema="other")),
                 json.dumps(record(device="Another GPU")),          # copied from another GPU
                 json.dumps(record(version="0.0.1")),
                 json.dumps(record(dict(VALUES, tiled_k=4 * 256))), # tiled_k must be < 256 * tiled_vt
                 json.dumps(record(dict(VALUES, tiled_vt=1.5))),
                 json.dumps(record(dict(VALUES, t1=-1))),
                 json.dumps(record(dict(VALUES, fma=True))),
                 json.dumps(record(dict(VALUES, hw_flat_rows=2000))),     # a block's 1 024
                 json.dumps(record(dict(VALUES, hw_flat_threads=100))),   # whole warps
                 json.dumps(record(dict(VALUES, hw_flat_threads=1024)))):  # 2 rows a thread
        path.write_text(text)
        with pytest.warns(RuntimeWarning, match="ignoring the calibration"):
            assert load_calibration(FAKE) is None
    with pytest.raises(ValueError):
        store_calibration(record(dict(VALUES, tiled_k=0)))


def test_retired_keys_are_ignored(cache):
    """A file from a calibration that also chose the warp shape (warp_vt, warp_k: a regime outside
    the production path) still loads: those keys are dropped, whatever their values, and the
    engine keeps GpuConfig's warp shape. A new calibration cannot store them."""
    assert set(RETIRED) == set(OLD_WARP) and not set(RETIRED) & set(CALIBRATED)
    cache.mkdir(parents=True)
    path = calibration_path(FAKE)
    for old in (OLD_WARP, dict(warp_vt=4, warp_k=4 * 32)):    # the second would not check out
        path.write_text(json.dumps(record(dict(VALUES, **old))))
        values, source = load_calibration(FAKE)
        assert values == VALUES and source == path
        e = GpuEngine("hybrid", kernels=NumpyKernels(GpuConfig()), device_name=FAKE)
        assert e.calibration == path
        assert {k: getattr(e.config, k) for k in CALIBRATED} == VALUES
        assert (e.config.warp_vt, e.config.warp_k) == (GpuConfig().warp_vt, GpuConfig().warp_k)
    with pytest.raises(ValueError, match="unknown key"):
        store_calibration(record(dict(VALUES, **OLD_WARP)))


def test_a_calibration_without_the_bond_rule_loads(cache):
    """A file written before the Hull-White family's rule was calibrated: its values load, the
    rule is GpuConfig's."""
    old = {k: v for k, v in VALUES.items() if not k.startswith("hw_")}
    cache.mkdir(parents=True)
    calibration_path(FAKE).write_text(json.dumps(record(old)))
    assert load_calibration(FAKE)[0] == old
    config, _ = effective_config(FAKE)
    assert (config.hw_flat_rows, config.hw_flat_threads) == (GpuConfig().hw_flat_rows,
                                                             GpuConfig().hw_flat_threads)


def test_precedence(cache, monkeypatch):
    kernels = NumpyKernels(GpuConfig())
    # no calibration: GpuConfig() <- defaults <- overrides
    e = GpuEngine("hybrid", kernels=kernels, device_name=FAKE, defaults={"cpu_max_steps": 500}, t1=7)
    assert e.calibration is None
    assert (e.config.t1, e.config.t2, e.config.cpu_max_steps) == (7, GpuConfig().t2, 500)
    store_calibration(record())
    # the calibration replaces the defaults
    e = GpuEngine("hybrid", kernels=kernels, device_name=FAKE, defaults={"cpu_max_steps": 500})
    assert e.calibration == calibration_path(FAKE)
    assert {k: getattr(e.config, k) for k in CALIBRATED} == VALUES
    # explicit overrides win over the calibration
    e = GpuEngine("hybrid", kernels=kernels, device_name=FAKE, t1=90_000, t2=0)
    assert (e.config.t1, e.config.t2, e.config.tiled_vt) == (90_000, 0, VALUES["tiled_vt"])
    # another GPU, an explicit config, given kernels without a name, or PRICER_CALIBRATION=off: none
    assert GpuEngine("gpu", kernels=kernels, device_name="Another GPU").config == GpuConfig()
    assert GpuEngine("gpu", config=GpuConfig(), kernels=kernels, device_name=FAKE).config == GpuConfig()
    assert GpuEngine("gpu", kernels=kernels).config == GpuConfig()
    monkeypatch.setenv("PRICER_CALIBRATION", "off")
    assert effective_config(FAKE) == (GpuConfig(), None)
    # overrides are still checked, against the calibrated shape (tiled_k < 256 * tiled_vt = 1024
    # with the calibration, 2048 without)
    monkeypatch.delenv("PRICER_CALIBRATION")
    GpuEngine("gpu", kernels=kernels, device_name="Another GPU", tiled_k=VALUES["tiled_vt"] * 256)
    with pytest.raises(ValueError):
        GpuEngine("gpu", kernels=kernels, device_name=FAKE, tiled_k=VALUES["tiled_vt"] * 256)


def random_american(rng, steps):
    """Fresh random American options, one per entry of `steps`."""
    n = len(steps)
    return lattice_parameters(dict(spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n),
                                   maturity=rng.uniform(0.25, 2, n),
                                   volatility=rng.uniform(0.15, 0.5, n), rate=np.full(n, 0.03),
                                   dividend=np.zeros(n), steps=np.array(steps),
                                   call=rng.random(n) < 0.5, american=np.ones(n, dtype=bool)))


def test_calibrated_config_prices_like_serial(cache, rng):
    """The cached (non-default) tile shapes and thresholds through the emulated kernels, in the
    exact mode (every option through the regimes, hybrid's up to cpu_max_steps on the CPU)."""
    store_calibration(record())
    resolved = GpuEngine("hybrid", kernels=NumpyKernels(GpuConfig()), device_name=FAKE, t1=600,
                         fma=False)
    assert resolved.calibration == calibration_path(FAKE)
    assert resolved.cpu_max_steps == VALUES["cpu_max_steps"]
    # the resolved configuration on kernels emulated in its shapes
    engine = GpuEngine("hybrid", config=resolved.config, kernels=NumpyKernels(resolved.config))
    assert engine.config.tiled_w == 256 * VALUES["tiled_vt"] and engine.cpu_max_steps == 700
    steps = [1, 2, 127, 128, 129, 700, 701, 1500]
    p = random_american(rng, steps)
    np.testing.assert_array_equal(engine.price(p), SerialEngine().price(p))


# ----------------------------------------------------------------------------------------- CLI

def test_cli_without_gpu_exits_2(tmp_path, monkeypatch):
    monkeypatch.setenv("PRICER_NO_GPU", "1")                    # run_pricer passes os.environ on
    proc = run_pricer(["calibrate", "--quick", "--out", tmp_path / "c.json"], timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "pricer: error: no usable GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c.json").exists()


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    path = tmp_path_factory.mktemp("book") / "book.h5"
    write_portfolio(str(path), generate("random", 12, seed=5, min_steps=1, max_steps=300))
    return path


def test_price_and_run_take_t1_t2(tmp_path, book):
    """The CPU backends ignore them; bad values are refused with exit 2 before any work."""
    out = tmp_path / "r.h5"
    proc = run_pricer(["price", book, "-o", out, "--backend", "cpu", "--t1", 1000, "--t2", 10])
    assert proc.returncode == 0, proc.stderr
    assert read_results(out)["attrs"]["backend"] == "cpu"
    proc = run_pricer(["price", book, "-o", tmp_path / "x.h5", "--backend", "cpu", "--t2", -1])
    assert proc.returncode == 2 and "t2 must be a whole number >= 0" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.h5").exists()
    job = tmp_path / "job.toml"
    job.write_text(f'[portfolio]\npath = "{book}"\n[pricing]\nbackend = "serial"\nt1 = 5000\nt2 = 64\n'
                   f'[output]\npath = "{tmp_path / "j.h5"}"\n')
    proc = run_pricer(["run", job])
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(read_results(tmp_path / "j.h5")["price"], read_results(out)["price"])
    job.write_text(job.read_text().replace("t1 = 5000", 't1 = "big"'))
    proc = run_pricer(["run", job, "-o", tmp_path / "k.h5", "--t2", 3])
    assert proc.returncode == 2 and "t1 must be a whole number >= 0" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs pycuda, a CUDA device and nvcc (../shared/device)")
def test_quick_calibration_on_the_gpu(tmp_path, monkeypatch, rng):
    from pricer.engines.gpu.runtime import GpuRuntime
    from pricer.files import cache_dir
    from pricer.tools.calibrate import calibrate
    # keep the compiled kernels' cache where it is
    monkeypatch.setenv("PRICER_CUDA_CACHE", str(cache_dir("cuda", "PRICER_CUDA_CACHE")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PRICER_CALIBRATION", raising=False)
    name = GpuRuntime.get().name
    out = tmp_path / "copy.json"
    rec = calibrate(quick=True, out=str(out))
    path = calibration_path(name)
    assert path.exists() and json.loads(out.read_text()) == json.loads(path.read_text())
    saved = json.loads(path.read_text())
    assert saved["device"] == name and saved["version"] == __version__ and saved["quick"] is True
    assert saved["values"] == rec["values"] and set(saved["values"]) == set(CALIBRATED)
    assert {"tiled", "t1", "t2", "cpu_max_steps"} <= set(saved["timings"])
    assert "warp" not in saved["timings"]           # the warp shape is not calibrated
    engine = GpuEngine("hybrid")
    assert engine.calibration == path
    assert {k: getattr(engine.config, k) for k in CALIBRATED} == saved["values"]
    assert "hw" in saved["timings"] and 2 <= saved["values"]["hw_flat_rows"] <= 1024
    from pricer.engines.gpu.trinomial import HullWhiteGpuEngine
    bonds = HullWhiteGpuEngine()
    assert bonds.calibration == path
    assert (bonds.flat_rows, bonds.flat_threads) == (saved["values"]["hw_flat_rows"],
                                                     saved["values"]["hw_flat_threads"])
    assert HullWhiteGpuEngine(flat_threads=512).flat_threads == 512
    override = GpuEngine("hybrid", t1=saved["values"]["t1"] + 1, t2=0)
    assert (override.config.t1, override.config.t2) == (saved["values"]["t1"] + 1, 0)
    assert override.config.tiled_vt == saved["values"]["tiled_vt"]
    # the calibrated engine prices bitwise like serial in the exact mode (every option through the
    # regimes) across its thresholds, within 1e-11 with fma (the batch runner); a second one with a
    # low T1 crosses T1 too, with the calibrated tile shapes
    v = saved["values"]
    steps = sorted(x for x in {1, 2, v["cpu_max_steps"], v["cpu_max_steps"] + 1, v["t2"], v["t2"] + 1,
                               3000, 9000, 12_000} if x >= 1)
    p = random_american(rng, steps)
    ref = SerialEngine().price(p)
    exact = GpuEngine("hybrid", fma=False)
    assert exact.calibration == path
    np.testing.assert_array_equal(exact.price(p), ref)
    np.testing.assert_allclose(engine.price(p), ref, rtol=1e-11, atol=0)
    np.testing.assert_array_equal(GpuEngine("hybrid", t1=5000, fma=False).price(p), ref)
