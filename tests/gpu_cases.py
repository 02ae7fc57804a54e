"""What the GPU tests share: why they skip here, their marks, and fresh random options whose
lattices exist (p inside (0, 1), node prices inside FP64's range)."""

from __future__ import annotations

import importlib.util
import os
import shutil

import numpy as np
import pytest

from pricer.engines import gpu_available
from pricer.engines.base import Engine
from pricer.model.lattice import lattice_parameters


def why_no_gpu() -> str:
    if importlib.util.find_spec("pycuda") is None:
        return "pycuda is not installed (it is in the GPU machine kit, ../shared/device)"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc not found (needed to build the kernels)"
    return "no usable CUDA device"


needs_gpu = pytest.mark.skipif(not gpu_available(), reason=why_no_gpu() if not gpu_available() else "")
GPU = [pytest.mark.gpu, needs_gpu]


def options(rng, steps, call=None, american=None):
    n = len(steps)
    cols = dict(spot=rng.uniform(50, 150, n), strike=rng.uniform(50, 150, n),
                maturity=rng.uniform(0.05, 3.0, n), volatility=rng.uniform(0.05, 0.6, n),
                rate=rng.uniform(0.0, 0.08, n), dividend=rng.uniform(0.0, 0.05, n),
                steps=np.asarray(steps, dtype=np.int64),
                call=(rng.random(n) < 0.5) if call is None else np.full(n, call),
                american=(rng.random(n) < 0.6) if american is None else np.full(n, american))
    return lattice_parameters(keep_nodes_in_range(keep_p_inside(cols)))


def keep_nodes_in_range(cols: dict) -> dict:
    """Maturities shortened where the lattice's node prices would leave FP64's range (lattice.py
    refuses those): (u/d)^N = e^{2 sigma sqrt(T N)} (CRR) at most e^500."""
    most = (250.0 / (cols["volatility"] * np.sqrt(cols["steps"]))) ** 2
    cols["maturity"] = np.minimum(cols["maturity"], most)
    return cols


def keep_p_inside(cols: dict) -> dict:
    """Volatilities raised so that p stays inside (0, 1) at N = 1: it needs sigma > |r - q| sqrt(dt)
    (low volatility with a high rate, or a high dividend, can leave it; the dividend was missing
    here once, and a seed found it)."""
    drift = np.abs(cols["rate"] - cols["dividend"])
    cols["volatility"] = np.maximum(cols["volatility"], 2 * drift * np.sqrt(cols["maturity"]) + 0.05)
    return cols


def every_kind(rng, steps):
    """Each N as an American/European call/put."""
    steps = np.repeat(np.asarray(steps), 4)
    p = options(rng, steps)
    p.call[:] = np.tile([True, True, False, False], steps.size // 4)
    p.american[:] = np.tile([True, False, True, False], steps.size // 4)
    return p


class ThroughRegimes(Engine):
    """Every option of a GpuEngine through its regimes (GpuEngine.price_one: tiled, persistent
    kernel, CPU tail), whatever its steps: the route the engine itself takes only in the exact mode
    or above MAX_STEPS. With fma this is how the regimes meet options narrower than that."""

    def __init__(self, engine):
        self.engine = engine
        self.name = f"{engine.name}-regimes"

    def price(self, params, levels=None) -> np.ndarray:
        return np.array([self.engine.price_one(params, k, levels=levels)
                         for k in range(len(params))])
