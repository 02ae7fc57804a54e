"""`pricer warm`: on an empty numba cache it compiles every CPU kernel a book can need (options'
and bond options'), so that the runs after it, in fresh processes, compile nothing (numba's
compile events, which a cache load does not raise); prices are those of a run on a cold cache."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import ROOT, env, run_pricer

# a fresh process prices books that take every CPU path (pairs and singles, Greeks, one option,
# centred and clamped tables, --richardson, a tree column) and lists what numba compiled; with the
# code generation of a `pricer` command (numba's cache keeps a kernel per CPU feature set: a
# program of its own compiles its own once)
AFTER = r"""
import sys
import numpy as np
from numba.core import event
import pricer
from pricer.compiling import prefer_full_width_vectors
prefer_full_width_vectors()       # a command's code generation, as `pricer warm` compiled for
from pricer.tools.generate import generate
import pricer.tools.warm
from pricer.tools.warm import warm_books

rng = np.random.default_rng(int(sys.argv[1]))
book = generate("random", 300, seed=int(rng.integers(1 << 30)), min_steps=1, max_steps=3000)
cols = {name: getattr(book, name) for name in ("id", "spot", "strike", "maturity", "rate",
        "dividend", "volatility", "steps", "call", "american")}
cols["tree"] = rng.choice(["crr", "jr", "tian", "lr", "joshi4", "trigeorgis", "eqp"], 300)
cols["steps"] = np.maximum(cols["steps"], 3)
compiled = set()
with event.install_recorder("numba:compile") as rec:
    for backend in ("cpu", "serial"):
        prices = pricer.price(cols, backend=backend, greeks=True, invalid="skip")
        pricer.price({k: v[:1] for k, v in cols.items()}, backend=backend, tree="crr")
        pricer.price(cols, backend=backend, richardson=True, invalid="skip")
        pricer.price(warm_books()[3][1], backend=backend)
        market = dict(cols, market_price=prices["price"].fillna(1.0).to_numpy())
        pricer.implied_volatility(market, backend=backend, invalid="skip")
        print(backend, np.isfinite(prices["price"]).sum())
    bonds = pricer.tools.warm.warm_bond_book()
    for backend in ("cpu", "serial"):
        from pricer.engines import get_engine
        assert np.isfinite(get_engine(backend, "bonds").price(bonds)).all()
compiled = sorted({ev.data["dispatcher"].py_func.__qualname__ for _, ev in rec.buffer})
print("compiled:", ",".join(compiled))
"""


@pytest.mark.heavy
def test_warm_compiles_what_a_later_run_needs(tmp_path, rng):
    cache = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    warmed = run_pricer(["warm", "--backend", "cpu", "--backend", "serial"], timeout=600,
                        extra_env=cache)
    assert warmed.returncode == 0 and "Traceback" not in warmed.stderr, warmed.stderr
    assert "cpu:" in warmed.stdout and "serial:" in warmed.stdout
    assert str(tmp_path / "numba") in warmed.stdout          # where the kernels went
    after = subprocess.run([sys.executable, "-c", AFTER, str(int(rng.integers(1 << 30)))],
                           capture_output=True, text=True, timeout=600, env=dict(env(), **cache),
                           cwd=ROOT)
    assert after.returncode == 0, after.stderr
    lines = after.stdout.splitlines()
    assert lines[-1] == "compiled: ", lines               # nothing compiled after the warm-up
    assert int(lines[0].split()[1]) > 250                  # most options priced


def test_warm_refuses_an_unknown_backend():
    proc = run_pricer(["warm", "--backend", "nope"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown backend(s) nope" in proc.stderr
