"""Every QuantLib tree on every GPU backend against QuantLib 1.44's BinomialVanillaEngine:
prices of a few hundred fresh options per tree, and price, delta, gamma and theta of the lattice's
first levels. Marked `gpu`: skipped here with the reason; run on the GPU machine (../shared/device),
where the kit does not install QuantLib: without it every test here skips, saying so. Its wheel
(QuantLib 1.44, abi3, manylinux_2_28 x86_64: `pip download QuantLib==1.44 --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d dist/quantlib`) goes
along as an ignored path (carry [".device", "dist/quantlib"]):
    source .device/setup.sh; python3 -m pip install -q --no-index --no-deps --target /tmp/site
    dist/quantlib/*.whl; python3 -m pytest -m gpu -q -s -rs tests/test_gpu_trees.py   (one line)

Backends: `batch`; `hybrid` and `gpu` as they run by default (options up to MAX_STEPS = 16383 steps,
so all of these, go through the batch runner as in `batch`, hybrid's N <= 16 on the CPU), and the
same two with every option through the single-option regimes (`hybrid-regimes`, `gpu-regimes`:
test_gpu.ThroughRegimes, GpuEngine.price_one per option, the first levels finished on the host),
so both paths meet QuantLib with fma.

Each test prints one greppable line per tree and backend, e.g. (made-up numbers):
    PARITY tree=lr backend=hybrid n=300 max_rel=1.2e-11 trapped=4
    GREEKS tree=lr backend=batch n=117 max_rel_price=1.5e-11 delta=1.2e-11 gamma=1.4e-11 theta=2.1e-10
(max_rel: |ours - QuantLib| / max(|QuantLib|, floor), the floors of tests/test_trees.py for prices and
of tests/test_greeks.py for the Greeks.) Run with -s to see them.
"""

from __future__ import annotations

import numpy as np
import pytest

from pricer.model.lattice import TREE_NAMES
from gpu_cases import GPU

pytestmark = GPU

QUANTLIB_TREES = [t for t in TREE_NAMES if t != "crr"]   # test_trees.QL_TREES (it checks the two agree)
PARITY_OPTIONS = 300
PARITY_MIN_STEPS, PARITY_MAX_STEPS = 10, 5000
GREEK_OPTIONS = 120


def quantlib():
    """QuantLib, or a skip that says it is missing (the GPU machine kit does not install it)."""
    return pytest.importorskip("QuantLib", reason="QuantLib is not installed (pip install QuantLib==1.44; "
                                                  "on the GPU machine: tests/test_gpu_trees.py's docstring)")


def gpu_engines() -> dict:
    from pricer.engines.gpu.engine import GpuEngine
    from gpu_cases import ThroughRegimes
    hybrid, gpu = GpuEngine("hybrid", t2=64, cpu_max_steps=16), GpuEngine("gpu")
    return {"batch": GpuEngine("batch"),
            "hybrid": hybrid,
            "gpu": gpu,
            "hybrid-regimes": ThroughRegimes(hybrid),
            "gpu-regimes": ThroughRegimes(gpu)}


def parity_options(rng, n: int):
    """test_trees.parity_book's options (calls and puts, American and European, q != 0 of either sign,
    30 days to 3 years) with N log-uniform from 10 to 5000 and one at 5000: every octave of N
    from 256 to 4096 gets ~33 options, N 4096-5000 ~10, and half lie below 256, so the batch
    runner's size classes from narrow to wide all meet QuantLib. QuantLib prices them once per tree, one at a time,
    single-threaded: ~1e6 nodes per option on average, 3.1e8 per tree, measured 1.3-1.4 s per tree
    (ql-crr, jr, eqp, trigeorgis) and 3.9-5.5 s (tian, lr, joshi4, which take a pow per node) on the
    2-core development machine; 21 s for all QuantLib work in this file. parity_book's own N (mostly
    <= 1000: 5.8e7 nodes per tree) would cost a fifth of that but leave ~6 options to the classes
    wider than 1024 nodes."""
    from test_trees import parity_book
    cols, days = parity_book(rng, n)
    steps = np.exp(rng.uniform(np.log(PARITY_MIN_STEPS), np.log(PARITY_MAX_STEPS), n)).round()
    steps[rng.integers(n)] = PARITY_MAX_STEPS
    cols["steps"] = steps.astype(np.int64)
    return cols, days


@pytest.mark.parametrize("tree", QUANTLIB_TREES)
def test_quantlib_parity_on_gpu_backends(rng, tree):
    """300 fresh options per tree, QuantLib's prices computed once and every GPU backend compared
    with them to test_trees.PARITY = 1e-9 relative; American options in QuantLib's maturity trap are
    compared with our lattice without its terminal level, as on the CPU (nothing is skipped)."""
    quantlib()
    from test_trees import PARITY, QL_TREES, quantlib_expected, quantlib_prices, relative_error
    assert set(QUANTLIB_TREES) == set(QL_TREES)
    cols, days = parity_options(rng, PARITY_OPTIONS)
    theirs = quantlib_prices(cols, days, tree)
    failures = {}
    for name, engine in gpu_engines().items():
        expected, trap = quantlib_expected(cols, tree, engine)
        error = relative_error(expected, theirs, cols["strike"])
        worst = int(error.argmax())
        print(f"PARITY tree={tree} backend={name} n={len(days)} max_rel={error.max():.2g} "
              f"trapped={int(trap.sum())}")
        if not error.max() <= PARITY:
            failures[name] = (float(error.max()), {c: cols[c][worst] for c in cols}, int(days[worst]),
                              float(theirs[worst]), float(expected[worst]))
    assert not failures, failures


@pytest.mark.parametrize("tree", QUANTLIB_TREES)
def test_greeks_on_gpu_backends_match_quantlib(rng, tree):
    """Price, delta, gamma, theta on every GPU backend against QuantLib, with the CPU test's options
    (test_greeks.greeks_book: N <= 2000, odd for lr/joshi4, the maturity trap's cases left out) and
    its bar: GREEK_RTOL = 1e-8 relative to max(|QuantLib|, floor), floors from
    test_greeks.greek_floors. QuantLib's Greeks are computed once per tree."""
    quantlib()
    from pricer.model.greeks import Analytics, price_with_analytics
    from test_greeks import GREEK_RTOL, greek_errors, greeks_book, quantlib_greeks
    cols, days, _ = greeks_book(rng, GREEK_OPTIONS, tree)
    theirs = quantlib_greeks(cols, days, tree)
    failures = {}
    for name, engine in gpu_engines().items():
        ours = price_with_analytics(engine, cols, tree, np.arange(len(days)), Analytics(greeks=True))
        errors, floored = greek_errors(ours, theirs, cols)
        worst = {k: float(v.max()) for k, v in errors.items()}
        print(f"GREEKS tree={tree} backend={name} n={len(days)} max_rel_price={worst['price']:.2g} "
              f"delta={worst['delta']:.2g} gamma={worst['gamma']:.2g} theta={worst['theta']:.2g} "
              f"floored={floored}")
        if not max(worst.values()) <= GREEK_RTOL:
            failures[name] = worst
    assert not failures, failures
