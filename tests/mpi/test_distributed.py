"""The MPI master–worker, called collectively under `mpiexec -n K python -m pytest --with-mpi tests/mpi`
(tests/test_mpi_suite.py runs this at 2 and 3 ranks).

Every check that could fail on one rank only is decided on rank 0 and broadcast, so all ranks pass or
fail the same test together and no rank is left waiting in the next test's collectives.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from pricer.run.collectives import BadInput
from pricer.run.config import RunConfig
from pricer.run.driver import run
from pricer.engines.cpu.serial import SerialEngine
from pricer.model.greeks import GREEKS, Analytics, price_with_analytics
from pricer.model.lattice import TREE_NAMES, lattice_parameters
from pricer.model.partition import assign
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results

comm = MPI.COMM_WORLD
RANK, SIZE = comm.Get_rank(), comm.Get_size()
ROOT = 0

pytestmark = pytest.mark.mpi(min_size=2)


def verdict(errors) -> None:
    """Rank 0's list of problems, on every rank."""
    errors = comm.bcast(errors if RANK == ROOT else None, root=ROOT)
    assert not errors, errors


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


def make_book(seed: int, n: int) -> Portfolio:
    rng = np.random.default_rng(seed)
    return Portfolio(
        id=rng.permutation(np.arange(500, 500 + 3 * n, 3, dtype=np.int64)),
        spot=rng.uniform(80, 120, n), strike=rng.uniform(80, 120, n), maturity=rng.uniform(0.25, 2, n),
        rate=rng.uniform(0, 0.08, n), dividend=rng.uniform(0, 0.04, n),
        volatility=rng.uniform(0.15, 0.5, n), steps=rng.integers(1, 700, n),
        call=rng.random(n) < 0.5, american=rng.random(n) < 0.5)


def serial_reference(portfolio: Portfolio) -> np.ndarray:
    """The one-process reference: the serial engine on the whole portfolio, no MPI involved."""
    cols = portfolio.columns()
    return SerialEngine().price(lattice_parameters(cols, ids=portfolio.id))


@pytest.fixture(scope="module")
def shared_dir():
    path = tempfile.mkdtemp(prefix="pricer-mpi-") if RANK == ROOT else None
    path = comm.bcast(path, root=ROOT)
    yield path
    comm.Barrier()
    if RANK == ROOT:
        shutil.rmtree(path, ignore_errors=True)


def write_book(shared_dir: str, name: str, portfolio: Portfolio | None) -> str:
    """Rank 0 writes the file; every rank gets its path (only rank 0 ever reads it)."""
    path = os.path.join(shared_dir, name)
    if RANK == ROOT:
        write_portfolio(path, portfolio)
    comm.Barrier()
    return path


@pytest.fixture(scope="module")
def seed():
    """Fresh random books on every run, the same on every rank; printed so a failure can be replayed."""
    value = int(os.environ.get("PRICER_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    value = comm.bcast(value, root=ROOT)
    print(f"PRICER_TEST_SEED={value}")
    return value


@pytest.fixture(scope="module")
def book(shared_dir, seed):
    portfolio = make_book(seed, 41) if RANK == ROOT else None
    path = write_book(shared_dir, "book.h5", portfolio)
    reference = serial_reference(portfolio) if RANK == ROOT else None
    return path, portfolio, reference


def output_path(shared_dir: str, request) -> str:
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)
    return os.path.join(shared_dir, f"{name}.h5")


def check_results(out: str, portfolio: Portfolio, reference, cfg: RunConfig, summary) -> list:
    """Rank 0: what is wrong with the results file (an empty list if nothing)."""
    errors = []
    r = read_results(out)
    if not np.array_equal(r["id"], portfolio.id):
        errors.append("ids not in input order")
    if not bitwise_equal(r["price"], reference):
        errors.append(f"prices differ from the one-process reference at rows "
                      f"{np.flatnonzero(r['price'] != reference)[:10].tolist()}")
    attrs = r["attrs"]
    for key, want in (("ranks", SIZE), ("partition", cfg.partition), ("distribute", cfg.distribute),
                      ("schema", "pricer.results/1")):
        if attrs.get(key) != want:
            errors.append(f"attribute {key} = {attrs.get(key)!r}, expected {want!r}")
    run_group = r["run"]
    expected = np.diff(assign(portfolio.steps, SIZE, cfg.partition).bounds)
    if run_group["options"].shape != (SIZE,) or run_group["seconds"].shape != (SIZE,) \
            or run_group["nodes"].shape != (SIZE,):
        errors.append(f"/run does not have one row per rank: {run_group}")
    elif not np.array_equal(run_group["options"], expected):
        errors.append(f"/run options {run_group['options']} != partition {expected}")
    elif run_group["nodes"].sum() != portfolio.nodes() or (run_group["seconds"] < 0).any():
        errors.append(f"/run nodes {run_group['nodes']} do not add up to {portfolio.nodes()}")
    if summary is None or summary.options != len(portfolio) or summary.ranks != SIZE:
        errors.append(f"summary on rank 0: {summary}")
    return errors


@pytest.mark.parametrize("distribute", ["scatter", "bcast", "read"])
@pytest.mark.parametrize("method", ["cost", "count"])
def test_bitwise_equal_to_one_process(book, shared_dir, request, method, distribute):
    path, portfolio, reference = book
    cfg = RunConfig(input=path, output=output_path(shared_dir, request), backend="cpu",
                    partition=method, distribute=distribute, threads=1)
    summary = run(cfg)
    nonroot_summary = comm.gather(summary is None, root=ROOT)
    errors = None
    if RANK == ROOT:
        errors = check_results(cfg.output, portfolio, reference, cfg, summary)
        if not all(nonroot_summary[1:]):
            errors.append("a rank other than 0 returned a summary")
    verdict(errors)


@pytest.mark.parametrize("distribute", ["scatter", "read"])
def test_cost_partition_out_of_input_order(shared_dir, request, distribute):
    """A book whose SIZE largest options sit side by side: no contiguous split gives each its own
    rank with a share of the small ones, so `cost` places whole options out of input order
    (partition.assign); the results still come back bitwise equal and in input order (with
    --distribute read each rank reads its scattered rows itself)."""
    portfolio = None
    if RANK == ROOT:
        portfolio = make_book(77, 200)
        portfolio.steps[:] = 40
        portfolio.steps[-SIZE:] = 1000
    path = write_book(shared_dir, "skewed.h5", portfolio)
    cfg = RunConfig(input=path, output=output_path(shared_dir, request), backend="cpu", threads=1,
                    distribute=distribute)
    summary = run(cfg)
    errors = None
    if RANK == ROOT:
        errors = check_results(cfg.output, portfolio, serial_reference(portfolio), cfg, summary)
        if assign(portfolio.steps, SIZE, "cost").in_input_order():
            errors.append("this book was meant to leave input order")
    verdict(errors)


def test_serial_backend(book, shared_dir, request):
    path, portfolio, reference = book
    cfg = RunConfig(input=path, output=output_path(shared_dir, request), backend="serial", threads=1)
    summary = run(cfg)
    errors = None
    if RANK == ROOT:
        errors = check_results(cfg.output, portfolio, reference, cfg, summary)
        if read_results(cfg.output)["attrs"]["backend"] != "serial":
            errors.append("backend attribute is not serial")
    verdict(errors)


@pytest.mark.parametrize("method", ["cost", "count"])
@pytest.mark.parametrize("count", [1, 2])
def test_fewer_options_than_ranks(shared_dir, request, count, method):
    portfolio = make_book(1234 + count, count) if RANK == ROOT else None
    path = write_book(shared_dir, f"few{count}.h5", portfolio)
    for distribute in ("scatter", "bcast", "read"):
        cfg = RunConfig(input=path, output=output_path(shared_dir, request) + f".{distribute}.h5",
                        partition=method, distribute=distribute, threads=1)
        summary = run(cfg)
        errors = None
        if RANK == ROOT:
            errors = check_results(cfg.output, portfolio, serial_reference(portfolio), cfg, summary)
            options = read_results(cfg.output)["run"]["options"]
            if (options == 0).sum() != SIZE - count:
                errors.append(f"expected {SIZE - count} idle ranks, /run options {options}")
        verdict(errors)


def test_run_group_rows(book, shared_dir, request):
    """/run: one row per rank; options and nodes add up to the portfolio's."""
    path, portfolio, _ = book
    cfg = RunConfig(input=path, output=output_path(shared_dir, request), threads=1)
    run(cfg)
    errors = None
    if RANK == ROOT:
        with h5py.File(cfg.output, "r") as f:
            rows = {key: f["run"][key][()] for key in f["run"]}
        errors = []
        for key in ("seconds", "options", "nodes"):
            if rows[key].shape != (SIZE,):
                errors.append(f"/run/{key} has shape {rows[key].shape}, expected ({SIZE},)")
        if rows["options"].sum() != len(portfolio):
            errors.append(f"options {rows['options']} do not add up to {len(portfolio)}")
        if not np.isclose(rows["nodes"].sum(), portfolio.nodes(), rtol=0, atol=0.5):
            errors.append(f"nodes {rows['nodes']} do not add up to {portfolio.nodes()}")
    verdict(errors)


def spoiled(shared_dir: str, name: str, column: str, row: int, value):
    portfolio = None
    if RANK == ROOT:
        portfolio = make_book(77, 12)
        getattr(portfolio, column)[row] = value
    path = write_book(shared_dir, name, portfolio)
    bad_id = comm.bcast(int(portfolio.id[row]) if RANK == ROOT else None, root=ROOT)
    return path, bad_id


@pytest.mark.parametrize("distribute", ["scatter", "read"])
@pytest.mark.parametrize("row", [4, 11])   # rank 0's rows, the last rank's
@pytest.mark.parametrize("column,value,needle", [
    ("spot", np.nan, "column spot"),
    ("steps", 0, "column steps"),
    ("rate", 0.9, "not arbitrage-free"),  # p > 1 at N = 1 with a 90 % rate
])
def test_bad_input_every_rank_exits_2(shared_dir, request, capsys, column, value, needle, row,
                                      distribute):
    """One message, on rank 0, naming the option, whichever rank's rows hold it."""
    path, bad_id = spoiled(shared_dir, f"bad_{column}_{row}_{distribute}.h5", column, row, value)
    if column == "rate":
        if RANK == ROOT:  # one step, low volatility: p = (e^{r dt} - d)/(u - d) > 1
            with h5py.File(path, "a") as f:
                f["portfolio"]["steps"][row] = 1
                f["portfolio"]["volatility"][row] = 0.05
        comm.Barrier()
    out = output_path(shared_dir, request)
    with pytest.raises(BadInput) as info:
        run(RunConfig(input=path, output=out, threads=1, partition="count", distribute=distribute))
    code = info.value.code
    err = capsys.readouterr().err
    reports = comm.gather((code, err), root=ROOT)
    errors = None
    if RANK == ROOT:
        errors = []
        if [c for c, _ in reports] != [2] * SIZE:
            errors.append(f"exit codes {[c for c, _ in reports]}")
        if needle not in reports[0][1] or str(bad_id) not in reports[0][1]:
            errors.append(f"rank 0 message does not name {needle!r} and id {bad_id}: {reports[0][1]!r}")
        if any(e for _, e in reports[1:]):
            errors.append(f"other ranks printed: {[e for _, e in reports[1:]]}")
        if os.path.exists(out) or any(n.startswith(f".{os.path.basename(out)}")
                                      for n in os.listdir(shared_dir)):
            errors.append("an output or temporary file was written")
    verdict(errors)


def test_existing_output_refused_on_every_rank(book, shared_dir, request):
    path, _, _ = book
    out = output_path(shared_dir, request)
    if RANK == ROOT:
        with open(out, "wb") as f:
            f.write(b"earlier results")
    comm.Barrier()
    with pytest.raises(BadInput):
        run(RunConfig(input=path, output=out, threads=1))
    errors = None
    if RANK == ROOT:
        with open(out, "rb") as f:
            errors = [] if f.read() == b"earlier results" else ["the existing output was changed"]
    verdict(errors)
    # and with overwrite it is replaced by real results
    run(RunConfig(input=path, output=out, overwrite=True, threads=1))
    if RANK == ROOT:
        errors = [] if read_results(out)["price"].size == 41 else ["not replaced"]
    verdict(errors)


@pytest.mark.parametrize("distribute", ["scatter", "read"])
def test_missing_input_every_rank_exits_2(shared_dir, request, distribute):
    with pytest.raises(BadInput) as info:
        run(RunConfig(input=os.path.join(shared_dir, "absent.h5"),
                      output=output_path(shared_dir, request), threads=1, distribute=distribute))
    codes = comm.gather(info.value.code, root=ROOT)
    verdict(None if RANK != ROOT else ([] if codes == [2] * SIZE else [f"codes {codes}"]))


def tree_book() -> Portfolio:
    """A book with a tree column holding every tree (N >= 50 keeps every tree valid here)."""
    portfolio = make_book(4321, 37)
    portfolio.tree = np.array([TREE_NAMES[k % len(TREE_NAMES)] for k in range(37)])
    portfolio.steps = np.maximum(portfolio.steps, 50)
    return portfolio


@pytest.mark.parametrize("distribute", ["scatter", "bcast", "read"])
def test_tree_column_bitwise_equal_to_one_process(shared_dir, request, distribute):
    """Each option's tree travels to its rank as a code in the matrix; the prices are those of the
    one-process reference, and the column wins over the run's tree."""
    portfolio = tree_book() if RANK == ROOT else None
    path = write_book(shared_dir, f"trees_{distribute}.h5", portfolio)
    cfg = RunConfig(input=path, output=output_path(shared_dir, request), backend="cpu", tree="lr",
                    distribute=distribute, threads=1)
    summary = run(cfg)
    errors = None
    if RANK == ROOT:
        errors = check_results(cfg.output, portfolio, serial_reference(portfolio), cfg, summary)
        tree = read_results(cfg.output)["attrs"]["tree"]
        if tree != ",".join(TREE_NAMES):
            errors.append(f"attribute tree = {tree!r}")
    verdict(errors)


@pytest.mark.parametrize("distribute", ["scatter", "read"])
def test_bad_tree_name_every_rank_exits_2(shared_dir, request, capsys, distribute):
    portfolio = bad_id = None
    if RANK == ROOT:
        portfolio = tree_book()
        portfolio.tree[30] = "cox-ross"
        bad_id = int(portfolio.id[30])
    path = write_book(shared_dir, f"bad_tree_{distribute}.h5", portfolio)
    out = output_path(shared_dir, request)
    with pytest.raises(BadInput) as info:
        run(RunConfig(input=path, output=out, threads=1, partition="count", distribute=distribute))
    reports = comm.gather((info.value.code, capsys.readouterr().err), root=ROOT)
    errors = None
    if RANK == ROOT:
        errors = []
        if [c for c, _ in reports] != [2] * SIZE:
            errors.append(f"exit codes {[c for c, _ in reports]}")
        message = reports[0][1]
        if not all(needle in message for needle in ("column tree", "'cox-ross'", str(bad_id))):
            errors.append(f"rank 0 message: {message!r}")
        if any(e for _, e in reports[1:]):
            errors.append(f"other ranks printed: {[e for _, e in reports[1:]]}")
        if os.path.exists(out):
            errors.append("an output file was written")
    verdict(errors)


def greeks_book(seed: int, n: int = 29) -> Portfolio:
    portfolio = make_book(seed, n)
    portfolio.steps = np.clip(portfolio.steps, 3, 500)  # --richardson needs N >= 3
    return portfolio


@pytest.mark.parametrize("distribute", ["scatter", "bcast", "read"])
def test_greeks_and_richardson_bitwise_equal_to_one_process(seed, shared_dir, request, distribute):
    """Price and the five Greeks travel back in one Gatherv of (n_local, 6) rows: the file holds
    pricer/greeks.py's one-process serial values, bitwise, and /run counts the lattices priced."""
    portfolio = greeks_book(seed + 1) if RANK == ROOT else None
    path = write_book(shared_dir, f"greeks_{distribute}.h5", portfolio)
    cfg = RunConfig(input=path, output=output_path(shared_dir, request), backend="cpu",
                    distribute=distribute, threads=1, greeks=True, richardson=True)
    summary = run(cfg)
    errors = None
    if RANK == ROOT:
        analytics = Analytics(greeks=True, richardson=True)
        cols = portfolio.columns()
        want = price_with_analytics(SerialEngine(), cols, "crr", portfolio.id, analytics)
        r = read_results(cfg.output)
        errors = [f"{name} differs from the one-process reference at rows "
                  f"{np.flatnonzero(r[name] != want[name])[:10].tolist()}"
                  for name in ("price",) + GREEKS if not bitwise_equal(r[name], want[name])]
        if not (bool(r["attrs"]["greeks"]) and bool(r["attrs"]["richardson"])):
            errors.append(f"attributes greeks/richardson: {r['attrs']}")
        options = r["run"]["options"]
        if options.shape != (SIZE,) or options.sum() != len(portfolio) or (options == 0).any():
            errors.append(f"/run options {options}")
        # greeks.py's coarse lattice M: N // 2 of N's parity (N // 2 itself where 4 divides N)
        coarse = portfolio.steps // 2
        coarse = np.where(coarse % 2 == portfolio.steps % 2, coarse, coarse + 1)
        nodes = 5 * portfolio.nodes() + ((coarse + 1) * (coarse + 2) // 2).sum()
        if r["run"]["nodes"].sum() != nodes or summary.nodes != nodes:
            errors.append(f"/run nodes {r['run']['nodes']} (summary {summary.nodes}) != {nodes}")
    verdict(errors)


@pytest.mark.parametrize("greeks,richardson,steps,needle", [
    (True, False, 1, "--greeks needs steps >= 2"),
    (False, True, 2, "--richardson needs steps >= 3"),
])
@pytest.mark.parametrize("distribute", ["scatter", "read"])
def test_analytics_bad_input_every_rank_exits_2(shared_dir, request, capsys, greeks, richardson,
                                                steps, needle, distribute):
    """The option that cannot be priced is the last one (the last rank's): rank 0 refuses it first
    (with --distribute read the last rank finds it, and rank 0 prints its message)."""
    path, bad_id = spoiled(shared_dir, f"bad_analytics_{steps}_{distribute}.h5", "steps", 11, steps)
    out = output_path(shared_dir, request)
    with pytest.raises(BadInput) as info:
        run(RunConfig(input=path, output=out, threads=1, partition="count", greeks=greeks,
                      richardson=richardson, distribute=distribute))
    reports = comm.gather((info.value.code, capsys.readouterr().err), root=ROOT)
    errors = None
    if RANK == ROOT:
        errors = []
        if [c for c, _ in reports] != [2] * SIZE:
            errors.append(f"exit codes {[c for c, _ in reports]}")
        if needle not in reports[0][1] or str(bad_id) not in reports[0][1]:
            errors.append(f"rank 0 message does not name {needle!r} and id {bad_id}: {reports[0][1]!r}")
        if any(e for _, e in reports[1:]):
            errors.append(f"other ranks printed: {[e for _, e in reports[1:]]}")
        if os.path.exists(out):
            errors.append("an output file was written")
    verdict(errors)


def test_read_refuses_checkpoint_on_every_rank(book, shared_dir, request, capsys):
    path, _, _ = book
    out = output_path(shared_dir, request)
    with pytest.raises(BadInput) as info:
        run(RunConfig(input=path, output=out, threads=1, distribute="read",
                      checkpoint=os.path.join(shared_dir, "ckpt-read")))
    reports = comm.gather((info.value.code, capsys.readouterr().err), root=ROOT)
    errors = None
    if RANK == ROOT:
        errors = [] if [c for c, _ in reports] == [2] * SIZE else [f"codes {reports}"]
        if "--checkpoint needs --distribute scatter or bcast" not in reports[0][1]:
            errors.append(f"rank 0 message: {reports[0][1]!r}")
        if any(e for _, e in reports[1:]) or os.path.exists(out):
            errors.append(f"other ranks printed or an output was written: {reports}")
    verdict(errors)


def test_read_with_duplicate_ids_in_different_ranks_rows(shared_dir, request, capsys):
    """Ids are checked across the whole file, not only within each rank's rows."""
    portfolio = None
    if RANK == ROOT:
        portfolio = make_book(99, 12)
        portfolio.id[11] = portfolio.id[0]
    path = write_book(shared_dir, "dup_read.h5", portfolio)
    dup = comm.bcast(int(portfolio.id[0]) if RANK == ROOT else None, root=ROOT)
    with pytest.raises(BadInput) as info:
        run(RunConfig(input=path, output=output_path(shared_dir, request), threads=1,
                      partition="count", distribute="read"))
    reports = comm.gather((info.value.code, capsys.readouterr().err), root=ROOT)
    errors = None
    if RANK == ROOT:
        errors = [] if [c for c, _ in reports] == [2] * SIZE else [f"codes {reports}"]
        if "duplicate ids" not in reports[0][1] or str(dup) not in reports[0][1]:
            errors.append(f"rank 0 message: {reports[0][1]!r}")
    verdict(errors)
