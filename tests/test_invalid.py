"""--invalid skip (pricing.invalid = "skip", pricer.price(..., invalid="skip")): a book with a few
bad rows is priced; each bad row gets NaN and a status saying why; the priced rows are bitwise what
a run on the book without the bad rows gives — with one process and under mpiexec with every
distribution, with Greeks, and through a kill -9 and the checkpoint's resume."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import pricer
from gpu_cases import needs_gpu
from helpers import run_pricer
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results
from pricer.model.validity import (NO_ANALYTICS, NO_LATTICE, NOT_FINITE, NOT_POSITIVE,
                                   BAD_STEPS, PRICED, REASONS, UNKNOWN_TREE)
from pricer.tools.generate import generate

# row -> (column, value, status): one bad row per reason
BAD = {
    3: ("volatility", np.nan, NOT_FINITE),
    8: ("spot", -1.0, NOT_POSITIVE),
    13: ("steps", 0, BAD_STEPS),
    21: ("steps", 2**62, BAD_STEPS),
    34: ("tree", "crrr", UNKNOWN_TREE),
    55: ("rate", 40.0, NO_LATTICE),           # p > 1 on the crr tree
    89: ("spot", 1e300, NO_LATTICE),          # with sigma below: weighty nodes beyond FP64
}


def books(seed: int):
    """(the book with its bad rows, the expected statuses, the book without them)."""
    portfolio = generate("random", 240, seed=seed, max_steps=400)
    portfolio.tree = np.array(["crr", "jr", "lr", "tian"])[np.arange(240) % 4]
    cols = {name: np.array(value, copy=True) for name, value in vars(portfolio).items()
            if value is not None}
    cols["tree"] = cols["tree"].astype(object)
    status = np.zeros(240, dtype=np.int8)
    for row, (column, value, code) in BAD.items():
        cols[column][row] = value
        status[row] = code
    cols["tree"][55] = "crr"
    # ... over enough steps that the walk reaches them with weight (at N ~ 20 it does not: priced)
    cols["volatility"][89], cols["maturity"][89], cols["steps"][89] = 3.0, 10.0, 400
    clean = Portfolio(**{name: value[status == PRICED] for name, value in cols.items()})
    return Portfolio(**cols), status, clean


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("invalid")
    bad, status, clean = books(int(np.random.default_rng().integers(1 << 30)))
    write_portfolio(str(d / "bad.h5"), bad)
    write_portfolio(str(d / "clean.h5"), clean)
    return d, bad, status


def price_file(path, out, *flags, ranks=None):
    proc = run_pricer(["price", path, "-o", out, "--overwrite", *flags], ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    return read_results(str(out)), proc


def test_skip_prices_the_rest_bitwise(files):
    d, bad, status = files
    got, proc = price_file(d / "bad.h5", d / "skip.h5", "--invalid", "skip", "--backend", "cpu")
    want, _ = price_file(d / "clean.h5", d / "clean-out.h5", "--backend", "cpu")
    assert np.array_equal(got["id"], bad.id)                 # every input id, in input order
    assert np.array_equal(got["status"], status) and got["status"].dtype == np.int8
    priced = status == PRICED
    assert got["price"][priced].tobytes() == want["price"].tobytes()
    assert np.isnan(got["price"][~priced]).all()
    assert json.loads(got["attrs"]["status_reasons"]) == {str(k): v for k, v in REASONS.items()}
    assert f"--invalid skip: {(~priced).sum()} of {len(status)} options not priced" in proc.stdout
    assert "2 with status 3" in proc.stdout
    refused = run_pricer(["price", d / "bad.h5", "-o", d / "refused.h5"])
    assert refused.returncode == 2 and not (d / "refused.h5").exists()


@pytest.mark.parametrize("distribute", ["scatter", "bcast", "read"])
def test_skip_under_mpiexec_is_the_same(files, distribute):
    d, _, status = files
    one, _ = price_file(d / "bad.h5", d / "one.h5", "--invalid", "skip", "--backend", "cpu")
    got, _ = price_file(d / "bad.h5", d / f"mpi-{distribute}.h5", "--invalid", "skip",
                        "--backend", "cpu", "--distribute", distribute, "--threads", "1",
                        ranks=3)
    assert np.array_equal(got["status"], status)
    assert got["price"].tobytes() == one["price"].tobytes()


def test_skip_with_greeks_and_a_resumed_checkpoint(files, tmp_path):
    from test_reliability import kill_9_after_chunks

    d, bad, status = files
    greeks_bad = Portfolio(**{k: (np.array(v, copy=True) if v is not None else None)
                              for k, v in vars(bad).items()})
    greeks_bad.steps[100] = 1                       # priced, but no Greeks at N = 1
    path = tmp_path / "greeks.h5"
    write_portfolio(str(path), greeks_bad)
    want_status = status.copy()
    want_status[100] = NO_ANALYTICS
    args = ["price", path, "-o", tmp_path / "g.h5", "--invalid", "skip", "--greeks",
            "--backend", "cpu", "--threads", "1", "--chunk-nodes", "2e5",
            "--checkpoint", tmp_path / "ck"]
    kill_9_after_chunks(args, tmp_path / "ck", 3)
    proc = run_pricer(args, ranks=3)
    assert proc.returncode == 0 and "from the checkpoint" in proc.stdout, proc.stderr
    got = read_results(str(tmp_path / "g.h5"))
    assert np.array_equal(got["status"], want_status)
    priced = want_status == PRICED
    clean = Portfolio(**{k: (v[priced] if v is not None else None) for k, v in vars(greeks_bad).items()})
    write_portfolio(str(tmp_path / "clean.h5"), clean)
    want, _ = price_file(tmp_path / "clean.h5", tmp_path / "clean-out.h5", "--greeks",
                         "--backend", "cpu")
    for name in ("price", "delta", "gamma", "theta", "vega", "rho"):
        assert got[name][priced].tobytes() == want[name].tobytes(), name
        assert np.isnan(got[name][~priced]).all(), name


def test_the_job_file_key_and_its_check(files, tmp_path):
    d, _, status = files
    job = tmp_path / "job.toml"
    job.write_text(f'[portfolio]\npath = "{d / "bad.h5"}"\n[pricing]\nbackend = "cpu"\n'
                   f'invalid = "skip"\n[output]\npath = "out.h5"\n')
    proc = run_pricer(["run", job], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(read_results(str(tmp_path / "out.h5"))["status"], status)
    job.write_text(job.read_text().replace('invalid = "skip"', 'invalid = "yes"'))
    proc = run_pricer(["run", job, "-o", "other.h5"], cwd=tmp_path)
    assert proc.returncode == 2 and "pricing.invalid must be one of refuse, skip" in proc.stderr


def test_the_python_api_skips_alike(files):
    d, bad, status = files
    cols = {k: v for k, v in vars(bad).items() if v is not None}
    got = pricer.price(pd.DataFrame(cols), backend="cpu", invalid="skip")
    want = read_results(str(d / "skip.h5")) if (d / "skip.h5").exists() else \
        price_file(d / "bad.h5", d / "skip2.h5", "--invalid", "skip", "--backend", "cpu")[0]
    assert list(got.columns) == ["id", "price", "status"]
    assert np.array_equal(got["status"].to_numpy(), status)
    assert got["price"].to_numpy().tobytes() == want["price"].tobytes()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["batch", "hybrid"])
def test_skip_on_the_gpu_prices_the_rest_bitwise(files, backend):
    d, _, status = files
    got, _ = price_file(d / "bad.h5", d / f"skip-{backend}.h5", "--invalid", "skip",
                        "--backend", backend)
    want, _ = price_file(d / "clean.h5", d / f"clean-{backend}.h5", "--backend", backend)
    assert np.array_equal(got["status"], status)
    assert got["price"][status == PRICED].tobytes() == want["price"].tobytes()
