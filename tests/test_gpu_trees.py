"""Every tree on every GPU backend against QuantLib's BinomialVanillaEngine (issue 5), and the
Greeks on the batch backend against QuantLib. Marked `gpu`: skipped here with the reason, run on the
GPU machine (../shared/device)."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu import GPU
from test_trees import PARITY, QL_TREES, parity_book, quantlib_expected, quantlib_prices, relative_error

pytestmark = GPU


def gpu_engines():
    from pricer.engines.batch import BatchEngine
    from pricer.engines.gpu import GpuEngine
    return {"batch": BatchEngine(), "hybrid": GpuEngine("hybrid", t2=64, cpu_max_steps=16),
            "gpu": GpuEngine("gpu")}


@pytest.mark.parametrize("tree", list(QL_TREES))
def test_quantlib_parity_on_gpu_backends(rng, tree):
    cols, days = parity_book(rng, 60)
    theirs = quantlib_prices(cols, days, tree)
    for name, engine in gpu_engines().items():
        expected, _ = quantlib_expected(cols, tree, engine)
        error = relative_error(expected, theirs, cols["strike"])
        print(f"{tree} {name}: max relative error {error.max():.3g}")
        assert error.max() <= PARITY, (tree, name, error.max())


@pytest.mark.parametrize("tree", ["ql-crr", "lr"])
def test_greeks_on_the_batch_backend_match_quantlib(rng, tree):
    from pricer.engines.batch import BatchEngine
    from pricer.greeks import Analytics, price_with_analytics
    from test_greeks import quantlib_greeks
    from test_trees import quantlib_drops_terminal_payoff
    cols, days = parity_book(rng, 40)
    cols["steps"] = np.minimum(cols["steps"], 2000) | (1 if tree == "lr" else 0)
    keep = ~quantlib_drops_terminal_payoff(cols["maturity"], cols["steps"], cols["american"])
    cols, days = {k: v[keep] for k, v in cols.items()}, days[keep]
    ours = price_with_analytics(BatchEngine(), cols, tree, np.arange(len(days)), Analytics(greeks=True))
    theirs = quantlib_greeks(cols, days, tree)
    for col, name in enumerate(("price", "delta", "gamma", "theta")):
        ref = theirs[:, col]
        scale = {"price": cols["strike"], "delta": 1.0, "gamma": 1e2 / cols["spot"],
                 "theta": cols["strike"]}[name]
        err = np.abs(ours[name] - ref) / np.maximum(np.abs(ref), 1e-6 * scale)
        print(tree, name, f"{err.max():.2e}")
        assert err.max() <= 1e-8, (tree, name, err.max())
