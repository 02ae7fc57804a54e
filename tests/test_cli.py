"""The real `pricer` command (and `python -m pricer`) on real files: generate, info, price, run, the
refusals with exit code 2, and bad input under `mpiexec -n 3`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from helpers import ROOT, env, pricer_command, run_pricer
from pricer import __version__
from pricer.engines.cpu.serial import SerialEngine
from pricer.tools.generate import SCENARIO_MATURITIES, SCENARIO_RATES, SCENARIO_SPOTS, SCENARIO_VOLS
from pricer.model.greeks import GREEKS, Analytics, price_with_analytics
from pricer.model.lattice import lattice_parameters
from pricer.io.portfolio import Portfolio, read_portfolio, write_portfolio
from pricer.io.results import SCHEMA as RESULTS_SCHEMA
from pricer.io.results import read_results

BAD_INPUT = 2


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one `pricer: error:` line naming every needle, no traceback."""
    assert proc.returncode == BAD_INPUT, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    assert proc.stderr.count("pricer: error:") == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


def reference_prices(portfolio: Portfolio) -> np.ndarray:
    cols = portfolio.columns()
    return SerialEngine().price(lattice_parameters(cols, ids=portfolio.id))


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


def small_book(seed: int = 7, n: int = 30) -> Portfolio:
    """A small heterogeneous book whose ids are not in sorted order (so input order is visible)."""
    rng = np.random.default_rng(seed)
    return Portfolio(
        id=rng.permutation(np.arange(1000, 1000 + 5 * n, 5, dtype=np.int64)),
        spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n), maturity=rng.uniform(0.25, 2, n),
        rate=rng.uniform(0, 0.08, n), dividend=rng.uniform(0, 0.04, n),
        volatility=rng.uniform(0.15, 0.5, n), steps=rng.integers(1, 600, n),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    path = tmp_path_factory.mktemp("book") / "book.h5"
    portfolio = small_book()
    write_portfolio(str(path), portfolio)
    return path, portfolio


# ------------------------------------------------------------------------------------------ help

@pytest.mark.parametrize("sub", [None, "price", "run", "generate", "info", "bench"])
def test_help(sub):
    args = [sys.executable, "-m", "pricer"] + ([sub] if sub else []) + ["--help"]
    proc = ok(subprocess.run(args, capture_output=True, text=True, timeout=60, env=env()))
    assert proc.stdout.startswith("usage: pricer" + (f" {sub}" if sub else ""))
    if sub is None:
        for command in ("price", "run", "generate", "info", "bench"):
            assert command in proc.stdout


def test_help_names_the_analytics_flags():
    price = ok(run_pricer(["price", "--help"])).stdout
    assert "--greeks" in price and "--richardson" in price and "--no-greeks" not in price
    run = ok(run_pricer(["run", "--help"])).stdout
    assert "--greeks, --no-greeks" in run and "--richardson, --no-richardson" in run


def test_version():
    proc = ok(run_pricer(["--version"]))
    assert __version__ in proc.stdout


# -------------------------------------------------------------------------------------- generate

@pytest.mark.parametrize("dist", ["uniform", "random", "skewed", "scenarios"])
def test_generate_each_distribution(tmp_path, dist):
    out = tmp_path / f"{dist}.h5"
    count = 300
    proc = ok(run_pricer(["generate", "--dist", dist, "--count", count, "--seed", 3, "--steps", 128,
                          "--min-steps", 20, "--max-steps", 90, "-o", out]))
    assert str(out) in proc.stdout and f"{count} options" in proc.stdout
    p = read_portfolio(str(out))  # a valid portfolio file
    assert len(p) == count and np.array_equal(p.id, np.arange(1, count + 1))
    if dist == "uniform":
        assert (p.steps == 128).all()
    elif dist == "random":
        assert p.steps.min() >= 20 and p.steps.max() <= 90 and np.unique(p.steps).size > 10
    elif dist == "skewed":
        assert p.steps.min() >= 64 and np.median(p.steps) <= 256 and p.steps.max() > 256
    else:
        assert (p.steps == 128).all() and (p.strike == 100.0).all()
        assert p.american.all() and not p.call.any() and (p.dividend == 0).all()
        assert set(p.spot) == set(SCENARIO_SPOTS) and set(p.volatility) == set(SCENARIO_VOLS)
        assert set(p.maturity) == set(SCENARIO_MATURITIES) and set(p.rate) == set(SCENARIO_RATES)
        assert len({tuple(row) for row in zip(p.spot[:270], p.volatility[:270], p.maturity[:270],
                                              p.rate[:270])}) == 270


def test_generate_is_deterministic(tmp_path):
    paths = [tmp_path / name for name in ("a.h5", "b.h5", "c.h5")]
    for path, seed in zip(paths, (11, 11, 12)):
        ok(run_pricer(["generate", "--dist", "random", "--count", 50, "--seed", seed, "-o", path]))
    assert paths[0].read_bytes() == paths[1].read_bytes()
    a, c = read_portfolio(str(paths[0])), read_portfolio(str(paths[2]))
    assert not np.array_equal(a.spot, c.spot) and not np.array_equal(a.steps, c.steps)


def test_generate_refuses_existing_output(tmp_path):
    out = tmp_path / "g.h5"
    out.write_bytes(b"keep me")
    refused(run_pricer(["generate", "--dist", "uniform", "--count", 5, "-o", out]), str(out),
            "--overwrite")
    assert out.read_bytes() == b"keep me"
    ok(run_pricer(["generate", "--dist", "uniform", "--count", 5, "-o", out, "--overwrite"]))
    assert len(read_portfolio(str(out))) == 5


# ------------------------------------------------------------------------------------ price, info

def test_price_single_process(tmp_path, book):
    path, portfolio = book
    out = tmp_path / "prices.h5"
    proc = ok(run_pricer(["price", path, "-o", out, "--backend", "cpu", "--threads", 2]))
    assert f"priced {len(portfolio)} options" in proc.stdout
    r = read_results(str(out))
    attrs = r["attrs"]
    assert attrs["schema"] == RESULTS_SCHEMA == "pricer.results/1"
    assert np.array_equal(r["id"], portfolio.id)  # input order, not sorted
    assert r["id"].dtype == np.int64 and r["price"].dtype == np.float64
    assert bitwise_equal(r["price"], reference_prices(portfolio))
    assert attrs["pricer_version"] == __version__
    assert attrs["backend"] == "cpu" and attrs["tree"] == "crr" and int(attrs["ranks"]) == 1
    assert 0 < float(attrs["wall_seconds"]) < 120
    assert str(attrs["utc_time"]).endswith("+00:00")
    assert attrs["input_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    run = r["run"]
    assert {"seconds", "options", "nodes"} <= set(run)
    assert run["seconds"].shape == run["options"].shape == run["nodes"].shape == (1,)
    assert run["options"][0] == len(portfolio)
    assert run["nodes"][0] == portfolio.nodes()
    assert sorted(os.listdir(tmp_path)) == ["prices.h5"]  # no temporary file left


def test_price_serial_backend_and_count_partition(tmp_path, book):
    path, portfolio = book
    out = tmp_path / "prices.h5"
    ok(run_pricer(["price", path, "-o", out, "--backend", "serial", "--partition", "count",
                   "--distribute", "bcast", "--quiet"]))
    r = read_results(str(out))
    assert r["attrs"]["backend"] == "serial"
    assert bitwise_equal(r["price"], reference_prices(portfolio))


def test_price_under_mpiexec_matches_one_process(tmp_path, book):
    path, portfolio = book
    out = tmp_path / "prices.h5"
    ok(run_pricer(["price", path, "-o", out, "--threads", 1], ranks=2))
    r = read_results(str(out))
    assert int(r["attrs"]["ranks"]) == 2 and r["run"]["options"].shape == (2,)
    assert r["run"]["options"].sum() == len(portfolio)
    assert np.array_equal(r["id"], portfolio.id)
    assert bitwise_equal(r["price"], reference_prices(portfolio))


def test_info_on_portfolio_and_results(tmp_path, book):
    path, portfolio = book
    proc = ok(run_pricer(["info", path]))
    assert "portfolio" in proc.stdout and f"{len(portfolio)} options" in proc.stdout
    assert f"max {portfolio.steps.max()}" in proc.stdout
    out = tmp_path / "prices.h5"
    ok(run_pricer(["price", path, "-o", out, "--quiet"]))
    proc = ok(run_pricer(["info", out]))
    assert "results (pricer.results/1)" in proc.stdout
    assert f"{len(portfolio)} options" in proc.stdout and "rank 0:" in proc.stdout
    assert "  price: min" in proc.stdout and "[currency of spot and strike]" in proc.stdout
    assert hashlib.sha256(path.read_bytes()).hexdigest() in proc.stdout
    refused(run_pricer(["info", tmp_path / "absent.h5"]), "no such file")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_that_cannot_be_written_is_an_error_not_a_traceback(book):
    """`pricer info FILE > /dev/full`: what it prints is lost (ENOSPC), so exit 1 with one line
    naming why; a reader that left (`| head`) is no error."""
    path, _ = book
    with open("/dev/full", "w") as full:
        proc = subprocess.run(pricer_command() + ["info", str(path)], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("pricer: error: its output could not be written: No space left on "
                           "device\n"), proc.stderr
    line = " ".join(pricer_command() + ["info", str(path)]) + " | head -c 1; exit ${PIPESTATUS[0]}"
    head = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env(),
                          timeout=120)
    assert head.returncode == 0 and "Traceback" not in head.stderr, head.stderr


def test_existing_output_needs_overwrite(tmp_path, book):
    path, portfolio = book
    out = tmp_path / "prices.h5"
    out.write_bytes(b"an older result")
    before = os.stat(out)
    refused(run_pricer(["price", path, "-o", out]), str(out), "--overwrite")
    assert out.read_bytes() == b"an older result" and os.stat(out).st_mtime_ns == before.st_mtime_ns
    assert sorted(os.listdir(tmp_path)) == ["prices.h5"]
    ok(run_pricer(["price", path, "-o", out, "--overwrite", "--quiet"]))
    assert bitwise_equal(read_results(str(out))["price"], reference_prices(portfolio))


# ------------------------------------------------------------------------------------- bad input

def _drop(column):
    def edit(f):
        del f["portfolio"][column]
    return edit


def _set(column, index, value):
    def edit(f):
        data = f["portfolio"][column][()]
        data[index] = value
        del f["portfolio"][column]
        f["portfolio"][column] = data
    return edit


def _text_file(path):
    path.write_text("not an HDF5 file\n")


BAD_INPUTS = {
    # name: (how to spoil the file, what the message must name)
    "missing-file": (lambda path: path.unlink(), ["no such file"]),
    "not-hdf5": (_text_file, ["not an HDF5 file"]),
    "missing-column": (_drop("volatility"), ["missing column", "volatility"]),
    "nan-spot": (_set("spot", [3, 8], np.nan), ["column spot", "NaN", "<id3>", "<id8>"]),
    "negative-maturity": (_set("maturity", 5, -1.0), ["column maturity", "> 0", "<id5>"]),
    "zero-steps": (_set("steps", 2, 0), ["column steps", ">= 1", "<id2>"]),
    "steps-too-large": (_set("steps", 4, 10**15), ["column steps", "memory", "<id4>"]),
    "duplicate-ids": (_set("id", 6, 1005), ["column id", "duplicate", "1005"]),
    # p > 1: a 60 % rate with 1 % volatility over a single step
    "p-outside-0-1": (lambda f: (_set("rate", 9, 0.6)(f), _set("volatility", 9, 0.01)(f),
                                  _set("steps", 9, 1)(f)), ["not arbitrage-free", "<id9>", "(0, 1)"]),
    # nodes from e^-80 to e^1414: the paths reach the clamped nodes beyond e^692
    "nodes-beyond-fp64": (lambda f: (_set("volatility", 7, 3.0)(f), _set("maturity", 7, 3.0)(f),
                                     _set("steps", 7, 20_000)(f), _set("spot", 7, 1e295)(f)),
                          ["FP64 range", "<id7>", "20000 steps", "check the inputs"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_exit_2_nothing_written(tmp_path, case):
    spoil, needles = BAD_INPUTS[case]
    portfolio = small_book(n=12)
    path = tmp_path / "book.h5"
    write_portfolio(str(path), portfolio)
    if case in ("missing-file", "not-hdf5"):
        spoil(path)
    else:
        with h5py.File(path, "a") as f:
            spoil(f)
    needles = [str(portfolio.id[int(n[3:-1])]) if n.startswith("<id") else n for n in needles]
    before = sorted(os.listdir(tmp_path))
    out = tmp_path / "prices.h5"
    refused(run_pricer(["price", path, "-o", out]), *needles)
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary file


def test_bad_input_under_mpiexec_3_ranks(tmp_path):
    """Every rank exits 2 (no hang waiting in a collective), the message is printed once."""
    portfolio = small_book(n=12)
    portfolio.volatility[7] = -0.2
    path = tmp_path / "book.h5"
    write_portfolio(str(path), portfolio)
    out = tmp_path / "prices.h5"
    try:
        proc = run_pricer(["price", path, "-o", out], ranks=3, timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec -n 3 with bad input hung: {exc}")
    refused(proc, "column volatility", str(portfolio.id[7]))
    assert sorted(os.listdir(tmp_path)) == ["book.h5"]


def test_output_folder_missing(tmp_path, book):
    path, _ = book
    refused(run_pricer(["price", path, "-o", tmp_path / "nowhere" / "prices.h5"]), "does not exist")


# ------------------------------------------------------------------------------------------- jobs

JOB = """
[portfolio]
path = "book.h5"

[portfolio.generate]
dist = "random"
count = 40
seed = 99
min_steps = 8
max_steps = 300

[pricing]
backend = "cpu"
partition = "count"
distribute = "bcast"
threads = 1

[output]
path = "out/results.h5"
overwrite = true
"""


def test_run_job(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "job.toml").write_text(JOB)
    proc = ok(run_pricer(["run", "job.toml"], cwd=tmp_path))
    assert "priced 40 options" in proc.stdout
    portfolio = read_portfolio(str(tmp_path / "book.h5"))
    assert len(portfolio) == 40 and portfolio.steps.max() <= 300
    r = read_results(str(tmp_path / "out" / "results.h5"))
    assert r["attrs"]["backend"] == "cpu" and r["attrs"]["partition"] == "count"
    assert r["attrs"]["distribute"] == "bcast"
    assert np.array_equal(r["id"], portfolio.id)
    assert bitwise_equal(r["price"], reference_prices(portfolio))
    # a command-line flag overrides the file; the generated portfolio is kept as it is
    stamp = os.stat(tmp_path / "book.h5").st_mtime_ns
    ok(run_pricer(["run", "job.toml", "--backend", "serial", "-o", "again.h5"], cwd=tmp_path))
    assert read_results(str(tmp_path / "again.h5"))["attrs"]["backend"] == "serial"
    assert os.stat(tmp_path / "book.h5").st_mtime_ns == stamp


@pytest.mark.parametrize("table,key", [("pricing", "engine"), ("portfolio.generate", "size"),
                                       ("output", "compress")])
def test_run_job_unknown_key(tmp_path, table, key):
    text = JOB.replace(f"[{table}]\n", f"[{table}]\n{key} = 1\n")
    assert text != JOB
    (tmp_path / "job.toml").write_text(text)
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), f"unknown key {table}.{key}")
    assert sorted(os.listdir(tmp_path)) == ["job.toml"]


def test_demo_job_file_is_valid():
    from pricer.io.jobs import load_job

    job = load_job(str(ROOT / "jobs" / "demo.toml"))
    assert job["portfolio"]["generate"]["dist"] in ("uniform", "random", "skewed", "scenarios")


@pytest.mark.parametrize("key,value,needle", [("partition", '"sizes"', "partition must be one of"),
                                              ("distribute", '"p2p"', "distribute must be one of"),
                                              ("threads", "0", "threads must be a whole number"),
                                              ("threads", '"4"', "threads must be a whole number")])
def test_run_job_bad_setting_value(tmp_path, key, value, needle):
    """Values from a job file skip argparse's choices: they are checked by name all the same."""
    text = JOB.replace("[pricing]\n", f"[pricing]\n{key} = {value}\n")
    text = "\n".join(line for line in text.splitlines()
                     if not (line.startswith(f"{key} =") and line != f"{key} = {value}"))
    (tmp_path / "out").mkdir()
    (tmp_path / "job.toml").write_text(text)
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), needle)
    assert not os.path.exists(tmp_path / "out" / "results.h5")


def test_run_job_generate_block_needs_dist_and_count(tmp_path):
    text = "\n".join(line for line in JOB.splitlines() if not line.startswith("count ="))
    (tmp_path / "out").mkdir()
    (tmp_path / "job.toml").write_text(text)
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), "portfolio.generate", "count")


def test_input_is_never_the_output(tmp_path, book):
    path, _ = book
    before = path.read_bytes()
    refused(run_pricer(["price", path, "-o", path, "--overwrite"]), "is the input portfolio")
    assert path.read_bytes() == before


def test_run_job_never_replaces_a_portfolio_it_did_not_generate(tmp_path, book):
    """A [portfolio.generate] block regenerates only files pricer generated; a user's file stays."""
    path, _ = book
    (tmp_path / "out").mkdir()
    mine = tmp_path / "book.h5"
    mine.write_bytes(path.read_bytes())
    (tmp_path / "job.toml").write_text(JOB)
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), "book.h5", "not generated by pricer")
    assert mine.read_bytes() == path.read_bytes()
    assert not os.path.exists(tmp_path / "out" / "results.h5")



@pytest.mark.parametrize("key,value,needle", [("greeks", "1", "greeks must be true or false, got 1"),
                                              ("richardson", '"yes"', "richardson must be true or false")])
def test_run_job_analytics_must_be_booleans(tmp_path, key, value, needle):
    (tmp_path / "out").mkdir()
    (tmp_path / "job.toml").write_text(JOB.replace("[pricing]\n", f"[pricing]\n{key} = {value}\n"))
    refused(run_pricer(["run", "job.toml"], cwd=tmp_path), needle)
    assert not os.path.exists(tmp_path / "out" / "results.h5")


def test_run_job_with_greeks(tmp_path):
    """`greeks = true` in [pricing] writes the Greeks; --no-greeks on the command line wins."""
    (tmp_path / "out").mkdir()
    (tmp_path / "job.toml").write_text(JOB.replace("[pricing]\n", "[pricing]\ngreeks = true\n"))
    proc = ok(run_pricer(["run", "job.toml"], cwd=tmp_path))
    assert "priced 40 options with Greeks" in proc.stdout
    portfolio = read_portfolio(str(tmp_path / "book.h5"))
    r = read_results(str(tmp_path / "out" / "results.h5"))
    assert r["attrs"]["greeks"] and not r["attrs"]["richardson"]
    want = analytics_reference(portfolio, Analytics(greeks=True))
    for name in ("price",) + GREEKS:
        assert bitwise_equal(r[name], want[name]), name
    assert r["run"]["nodes"].sum() == 5 * portfolio.nodes()
    ok(run_pricer(["run", "job.toml", "--no-greeks", "-o", "plain.h5"], cwd=tmp_path))
    plain = read_results(str(tmp_path / "plain.h5"))
    assert not plain["attrs"]["greeks"] and not set(GREEKS) & set(plain)
    assert bitwise_equal(plain["price"], r["price"])


# ------------------------------------------------------------------------ Greeks and Richardson

def analytics_reference(portfolio: Portfolio, analytics: Analytics) -> dict:
    """One process, no MPI, the serial engine: pricer/greeks.py on the whole portfolio."""
    cols = portfolio.columns()
    return price_with_analytics(SerialEngine(), cols, "crr", portfolio.id, analytics)


def greeks_book(n: int = 24) -> Portfolio:
    portfolio = small_book(seed=11, n=n)
    portfolio.steps = np.clip(portfolio.steps, 2, 500)
    return portfolio


@pytest.fixture(scope="module")
def greeks_one_process(tmp_path_factory):
    """A book priced with --greeks by one process (cpu backend, 2 threads)."""
    folder = tmp_path_factory.mktemp("greeks")
    path, out = folder / "book.h5", folder / "one.h5"
    portfolio = greeks_book()
    write_portfolio(str(path), portfolio)
    proc = ok(run_pricer(["price", path, "-o", out, "--greeks", "--backend", "cpu", "--threads", 2]))
    assert f"priced {len(portfolio)} options with Greeks" in proc.stdout
    return path, portfolio, read_results(str(out)), out


def test_greeks_one_process(greeks_one_process):
    path, portfolio, r, out = greeks_one_process
    assert np.array_equal(r["id"], portfolio.id)
    assert r["attrs"]["greeks"] is not None and bool(r["attrs"]["greeks"])
    assert not bool(r["attrs"]["richardson"])
    want = analytics_reference(portfolio, Analytics(greeks=True))
    for name in ("price",) + GREEKS:
        assert r[name].dtype == np.float64 and np.isfinite(r[name]).all(), name
        assert bitwise_equal(r[name], want[name]), name
    assert bitwise_equal(r["price"], reference_prices(portfolio))  # the price is left alone
    assert r["run"]["nodes"][0] == 5 * portfolio.nodes()  # the base lattice and 4 bumped ones
    info = ok(run_pricer(["info", out])).stdout
    assert all(f"  {name}: min " in info for name in ("delta", "gamma", "theta", "vega", "rho"))
    assert "[currency per year]" in info
    assert "greeks: True" in info and "richardson: False" in info


@pytest.mark.parametrize("method", ["cost", "count"])
def test_greeks_under_mpiexec_3_bitwise_equal_to_one_process(tmp_path, greeks_one_process, method):
    path, portfolio, one, _ = greeks_one_process
    out = tmp_path / "three.h5"
    ok(run_pricer(["price", path, "-o", out, "--greeks", "--backend", "cpu", "--threads", 1,
                   "--partition", method], ranks=3))
    r = read_results(str(out))
    assert int(r["attrs"]["ranks"]) == 3 and r["attrs"]["partition"] == method
    assert np.array_equal(r["id"], portfolio.id)
    for name in ("price",) + GREEKS:
        assert bitwise_equal(r[name], one[name]), name
    assert (r["run"]["options"] > 0).all() and r["run"]["nodes"].sum() == 5 * portfolio.nodes()


def test_richardson_is_2_p_n_minus_p_half_n(tmp_path):
    """--richardson from two plain runs of the same options with N and N/2 steps (4 divides N, so
    the coarse lattice is N/2 exactly); with --greeks too, the Greeks stay those of N steps."""
    n_steps, count = 200, 16
    paths = {}
    for steps in (n_steps, n_steps // 2):
        paths[steps] = tmp_path / f"book{steps}.h5"
        ok(run_pricer(["generate", "--dist", "uniform", "--count", count, "--seed", 5, "--steps",
                       steps, "-o", paths[steps]]))
        ok(run_pricer(["price", paths[steps], "-o", tmp_path / f"plain{steps}.h5", "--backend", "cpu",
                       "--quiet"]))
    fine, coarse = (read_results(str(tmp_path / f"plain{s}.h5"))["price"] for s in (n_steps, n_steps // 2))
    rich = tmp_path / "rich.h5"
    proc = ok(run_pricer(["price", paths[n_steps], "-o", rich, "--richardson", "--greeks",
                          "--backend", "cpu", "--threads", 1], ranks=2))
    assert "with Greeks and Richardson extrapolation" in proc.stdout
    r = read_results(str(rich))
    assert bool(r["attrs"]["richardson"]) and bool(r["attrs"]["greeks"])
    assert not np.allclose(r["price"], fine, rtol=1e-6, atol=0)  # the extrapolation did something
    np.testing.assert_allclose(r["price"], 2.0 * fine - coarse, rtol=1e-12, atol=1e-12)
    portfolio = read_portfolio(str(paths[n_steps]))
    greeks = analytics_reference(portfolio, Analytics(greeks=True))  # N steps, no extrapolation
    for name in GREEKS:
        assert bitwise_equal(r[name], greeks[name]), name
    nodes = count * ((n_steps + 1) * (n_steps + 2) / 2 * 5 + (n_steps // 2 + 1) * (n_steps // 2 + 2) / 2)
    assert r["run"]["nodes"].sum() == nodes


def _one_step(portfolio, row):
    portfolio.steps[row] = 1


def _p_edge_when_bumped(portfolio, row):
    """p < 1 at (r, sigma) but > 1 at sigma - 1e-4: r = 0.0995 < sigma sqrt(N / T) = 0.1."""
    portfolio.steps[row], portfolio.maturity[row], portfolio.dividend[row] = 100, 1.0, 0.0
    portfolio.rate[row], portfolio.volatility[row] = 0.0995, 0.01


def _p_edge_at_half_steps(portfolio, row):
    """p < 1 at N = 100 steps but > 1 at N/2 = 50: sigma sqrt(50) < r = 0.08 < sigma sqrt(100)."""
    portfolio.steps[row], portfolio.maturity[row], portfolio.dividend[row] = 100, 1.0, 0.0
    portfolio.rate[row], portfolio.volatility[row] = 0.08, 0.01


ANALYTICS_BAD = {
    # name: (flag, how to spoil one option, what the message must name)
    "greeks-one-step": ("--greeks", _one_step, ["--greeks needs steps >= 2"]),
    "greeks-bumped-lattice": ("--greeks", _p_edge_when_bumped, ["--greeks", "bumped", "arbitrage-free"]),
    "richardson-one-step": ("--richardson", _one_step, ["--richardson needs steps >="]),
    "richardson-coarse-lattice": ("--richardson", _p_edge_at_half_steps,
                                  ["--richardson", "N/2", "arbitrage-free", "steps 50"]),
}


@pytest.mark.parametrize("ranks", [None, 3])
@pytest.mark.parametrize("case", list(ANALYTICS_BAD), ids=list(ANALYTICS_BAD))
def test_analytics_bad_input_exit_2_nothing_written(tmp_path, case, ranks):
    """Refused by id on rank 0 before any work: every rank exits 2 (the spoilt option is the last
    one, priced by the last rank, which would otherwise fail alone), no output."""
    flag, spoil, needles = ANALYTICS_BAD[case]
    portfolio = greeks_book(n=12)
    portfolio.steps[:] = np.maximum(portfolio.steps, 3)
    spoil(portfolio, 11)
    path, out = tmp_path / "book.h5", tmp_path / "prices.h5"
    write_portfolio(str(path), portfolio)
    lattice_parameters(portfolio.columns(), ids=portfolio.id)  # valid without it
    try:
        proc = run_pricer(["price", path, "-o", out, flag, "--partition", "count"], ranks=ranks,
                          timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{flag} with bad input hung: {exc}")
    refused(proc, str(path), str(portfolio.id[11]), *needles)
    assert sorted(os.listdir(tmp_path)) == ["book.h5"]


def test_bench_batch_times_each_portfolio_for_at_least_min_seconds(monkeypatch):
    """`pricer bench batch` times `repeats` calls and, past those, calls for `min_seconds` (the
    a few sub-millisecond calls would see only a moment of a host whose speed drifts);
    the median call's wall and stats come back. A stand-in engine whose calls sleep 1 ms; then
    one whose calls each advance a stand-in clock by exactly one tick, so that how many calls
    `time_case` makes for `min_seconds` is exact, whatever the host's load."""
    import time
    from types import SimpleNamespace
    from pricer.tools import bench_batch
    from pricer.tools.bench_batch import time_case

    class Sleeper:
        def __init__(self):
            self.calls, self._runner = 0, SimpleNamespace(last_stats={})

        def runner(self):
            return self._runner

        def price(self, params):
            self.calls += 1
            self._runner.last_stats = dict(call=self.calls)
            time.sleep(0.001)

    engine = Sleeper()
    wall, stats, walls = time_case(engine, None, repeats=5, min_seconds=0.0)
    assert walls.size == 5 and engine.calls == 6                  # a warm-up, then 5
    assert wall == np.sort(walls)[2] and stats["call"] == 2 + int(np.argsort(walls)[2])

    tick = 2.0 ** -10                        # binary: the clock's sums are exact
    clock = SimpleNamespace(now=0.0)

    class Ticker(Sleeper):
        def price(self, params):
            self.calls += 1
            self._runner.last_stats = dict(call=self.calls)
            clock.now += tick                 # the call takes one tick; nothing else does

    monkeypatch.setattr(bench_batch, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    for repeats, min_ticks, timed in ((5, 48, 48), (60, 48, 60), (5, 0, 5)):
        engine = Ticker()
        _, _, walls = time_case(engine, None, repeats=repeats, min_seconds=min_ticks * tick)
        # calls until both `repeats` are timed and the timed calls' walls reach min_seconds
        assert walls.size == timed and engine.calls == timed + 1, (repeats, min_ticks, walls.size)
        assert (walls == tick).all() and walls.sum() == max(repeats, min_ticks) * tick


@pytest.mark.heavy
@pytest.mark.parametrize("what", ["cpu", "accuracy"])
def test_every_cpu_bench_quick_mode_runs_end_to_end(tmp_path, what):
    """`pricer bench cpu|accuracy --quick` as a user runs them (the GPU ones: test_gpu_benches)."""
    out = tmp_path / "bench.json"
    proc = run_pricer(["bench", what, "--quick", "--out", out], timeout=600,
                      extra_env={"PRICER_NO_GPU": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(out.read_text())
