"""Scenario grids (pricer/model/scenarios.py): every option priced under every combination of
spot, volatility, rate and time shifts, bitwise the explicitly expanded book's prices, under MPI,
from job files, with the Greeks, --invalid skip and checkpoints; hostile grids refused."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

import pricer
from gpu_cases import needs_gpu
from helpers import run_pricer
from pricer.engines.cpu.kernels import table_kinds
from pricer.engines.gpu.batch_layout import (INPUT_BYTES_PER_OPTION, fill_input, input_views,
                                             shared_all_plain)
from pricer.io.portfolio import Portfolio, write_portfolio
from pricer.io.results import read_results
from pricer.model.greeks import concatenate
from pricer.model.lattice import PACKED_FIELDS, PLAIN, TREE_NAMES, lattice_parameters
from pricer.model.scenarios import ScenarioGrid, ScenarioLattices

AXES = {"spot": [-0.1, 0.0, 0.1], "volatility": [-0.05, 0.1], "rate": [0.0, 0.01],
        "days": [0.0, 10.0]}
FLAGS = ["--scenario-spot=-0.1:0.1:3", "--scenario-volatility=-0.05,0.1",
         "--scenario-rate", "0,0.01", "--scenario-days", "0,10"]


def book(rng, n: int, trees=("crr", "lr", "jr", "tian")) -> dict:
    strike = rng.uniform(80.0, 120.0, n)
    return dict(id=np.arange(n) * 2 + 5, spot=strike * rng.uniform(0.8, 1.25, n), strike=strike,
                maturity=rng.uniform(0.2, 2.0, n), rate=rng.uniform(0.0, 0.06, n),
                dividend=rng.uniform(0.0, 0.03, n), volatility=rng.uniform(0.1, 0.5, n),
                steps=rng.integers(16, 300, n), call=rng.random(n) < 0.5,
                american=rng.random(n) < 0.6,
                tree=np.array(trees)[rng.integers(0, len(trees), n)])


def expanded_prices(cols: dict, backend: str) -> np.ndarray:
    """(options, scenarios): each scenario's shifted book priced as a book of its own."""
    out = []
    for spot, vol, rate, days in itertools.product(*AXES.values()):
        shifted = dict(cols, spot=cols["spot"] * (1.0 + spot), volatility=cols["volatility"] + vol,
                       rate=cols["rate"] + rate, maturity=cols["maturity"] - days / 365.0)
        out.append(pricer.price(shifted, backend=backend)["price"].to_numpy())
    return np.stack(out, axis=1)


def write(path, cols: dict) -> None:
    write_portfolio(str(path), Portfolio(**cols))


def lattice_columns(cols: dict) -> dict:
    """cols as pricing sees them: the tree column as codes (pricer.model.lattice.TREE_NAMES)."""
    return dict({key: value for key, value in cols.items() if key != "id"},
                tree=np.array([TREE_NAMES.index(t) for t in cols["tree"]]))


def same(a, b) -> bool:
    """Whether two LatticeParams hold the same bits in every field."""
    return all(np.array_equal(np.asarray(getattr(a, name)).view(np.uint8),
                              np.asarray(getattr(b, name)).view(np.uint8)) for name in PACKED_FIELDS)


@pytest.mark.parametrize("trees", [("crr", "jr", "tian", "ql-crr"), ("crr", "lr")])
def test_scenario_lattices_are_the_expanded_books_rows_and_fill_the_batch_input_alike(rng, trees):
    """ScenarioLattices written out, and a SharedNumbers read in place by the batch runner's fill
    (any run of lattices, or a gather), are bitwise the expanded book's lattice parameters."""
    cols = lattice_columns(book(rng, 37, trees))
    grid = ScenarioGrid(**{axis: tuple(values) for axis, values in AXES.items()})
    lattices = ScenarioLattices(cols, grid, "crr", np.arange(37))
    want = lattice_parameters(concatenate(grid.columns(cols)), "crr")
    assert (lattices.shared is not None) == ("lr" not in trees)
    assert same(lattices.build(0, grid.count), want)
    assert same(lattices.build(5, 9), want.take(np.arange(5 * 37, 9 * 37)))
    if lattices.shared is None:
        return
    shared = lattices.shared
    assert len(shared) == len(want) and len(shared.numbers) == 37 * 2 * 2 * 2  # vol x rate x days
    for rows in (slice(0, len(want)), slice(40, 41), slice(100, 333),
                 rng.permutation(len(want))[:200]):
        n = len(range(len(want))[rows]) if isinstance(rows, slice) else rows.size
        got, expect = (np.zeros(n * INPUT_BYTES_PER_OPTION, np.uint8) for _ in range(2))
        fill_input(shared, rows, got, input_views(got, n))
        fill_input(want, rows, expect, input_views(expect, n))
        assert np.array_equal(got, expect)
    assert shared_all_plain(shared)
    # one option's spot so large that some or all of its lattices' top nodes leave the range of
    # PLAIN tables (ln S0 + N ln u > 700): shared_all_plain checks each set of numbers at its
    # extreme spot factors only, and must agree with every lattice's own node_tables
    rows = np.arange(3, len(shared.numbers), 37)          # option 3's row in each set of numbers
    top = float((shared.numbers.steps[rows] * shared.numbers.log_up[rows]).max())
    mixed = 0
    for spot in (1e306, np.exp(700.0 - top) / 1.05, np.exp(700.0 - top) / 1.1 * 0.999):
        far = replace(shared, spot=np.where(np.arange(37) == 3, spot, shared.spot))
        expanded = far.take(np.arange(len(far)))
        kinds = table_kinds(expanded.spot, expanded.log_up, expanded.log_down, expanded.steps)
        mixed += 0 < (kinds != PLAIN).sum() < grid.count
        assert shared_all_plain(far) == bool((kinds == PLAIN).all())
    assert mixed


# trees that ignore the spot share their numbers among the spot shifts (greeks._scenario_prices);
# lr is centred on the strike, and a book with it takes every scenario's own numbers
@pytest.mark.parametrize("trees", [("crr", "jr", "tian", "ql-crr"), ("crr", "lr", "jr", "tian")])
def test_scenarios_are_the_expanded_books_prices_under_mpiexec(tmp_path, rng, trees):
    cols = book(rng, 120, trees)
    write(tmp_path / "book.h5", cols)
    want = expanded_prices(cols, "cpu")
    base = pricer.price(cols, backend="cpu", greeks=True)
    for ranks, distribute in ((1, "scatter"), (3, "read")):
        out = tmp_path / f"o{ranks}.h5"
        done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(out), "--backend", "cpu",
                           "--greeks", "--distribute", distribute, *FLAGS], ranks=ranks)
        assert done.returncode == 0, done.stderr
        assert "with Greeks and 24 scenarios" in done.stdout
        got = read_results(str(out))
        assert got["scenarios"]["price"].shape == (120, 24)
        assert np.array_equal(got["scenarios"]["price"], want)
        for name in ("price", "delta", "gamma", "theta", "vega", "rho"):
            assert np.array_equal(got[name], base[name].to_numpy()), name
        shifts = np.array(list(itertools.product(*AXES.values())))
        for j, axis in enumerate(AXES):
            assert np.array_equal(got["scenarios"][axis], shifts[:, j])
            assert np.array_equal(got["scenarios"]["axes"][axis], AXES[axis])


def test_job_file_table_and_flags_override_it(tmp_path, rng):
    cols = book(rng, 40)
    write(tmp_path / "book.h5", cols)
    (tmp_path / "job.toml").write_text(
        '[portfolio]\npath = "book.h5"\n[pricing]\nbackend = "cpu"\n[output]\npath = "o.h5"\n'
        '[scenarios]\nspot = "-0.1:0.1:3"\nvolatility = [-0.05, 0.1]\nrate = "0,0.01"\n'
        'days = [0, 10]\n')
    done = run_pricer(["run", "job.toml"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(read_results(str(tmp_path / "o.h5"))["scenarios"]["price"],
                          expanded_prices(cols, "cpu"))
    done = run_pricer(["run", "job.toml", "-o", "p.h5", "--scenario-days", "5"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = read_results(str(tmp_path / "p.h5"))["scenarios"]
    assert got["price"].shape == (40, 12) and set(got["days"]) == {5.0}


def test_a_scenario_without_a_lattice_is_refused_or_skipped(tmp_path, rng):
    cols = book(rng, 30)
    cols["volatility"][[4, 7]] = 0.04        # volatility - 0.05 < 0 in a scenario
    write(tmp_path / "book.h5", cols)
    out = tmp_path / "o.h5"
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(out), "--backend", "cpu",
                       *FLAGS], ranks=2)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "option id(s) 13, 19" in done.stderr and "scenario" in done.stderr, done.stderr
    assert not out.exists()
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(out), "--backend", "cpu",
                       "--invalid", "skip", *FLAGS], ranks=2)
    assert done.returncode == 0, done.stderr
    got = read_results(str(out))
    assert list(np.flatnonzero(got["status"])) == [4, 7] and set(got["status"][[4, 7]]) == {6}
    assert np.isnan(got["scenarios"]["price"][[4, 7]]).all()
    assert np.isfinite(got["scenarios"]["price"][np.arange(30) % 30 > 7]).all()


@pytest.mark.parametrize("flags, message", [
    (["--scenario-spot", "a:b:c"], "scenarios: spot must be FIRST:LAST:COUNT"),
    (["--scenario-days", "0:10:0"], "scenarios: days must be FIRST:LAST:COUNT"),
    (["--scenario-rate", "nan"], "scenarios: rate has a value that is not finite"),
    (["--scenario-spot=-0.5:0.5:101", "--scenario-volatility=-0.1:0.1:101"],
     "10201 scenarios (101 x 101 x 1 x 1); at most 10000"),
])
def test_hostile_grids_exit_2(tmp_path, rng, flags, message):
    write(tmp_path / "book.h5", book(rng, 5))
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "o.h5"),
                       "--backend", "cpu", *flags])
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "o.h5").exists()


def test_csv_results_and_implied_vol_refuse_scenarios(tmp_path, rng):
    write(tmp_path / "book.h5", book(rng, 5))
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "o.csv"),
                       "--backend", "cpu", "--scenario-spot", "0.1"])
    assert done.returncode == 2 and "written to HDF5 results only" in done.stderr
    (tmp_path / "job.toml").write_text(
        '[portfolio]\npath = "book.h5"\n[pricing]\ntask = "implied-vol"\n[output]\npath = "o.h5"\n'
        '[scenarios]\nspot = [0.1]\n')
    done = run_pricer(["run", "job.toml"], cwd=tmp_path)
    assert done.returncode == 2 and "scenarios are for pricing runs" in done.stderr


def test_checkpoint_of_another_grid_is_refused(tmp_path, rng):
    write(tmp_path / "book.h5", book(rng, 50))
    base = ["price", str(tmp_path / "book.h5"), "--backend", "cpu", "--checkpoint",
            str(tmp_path / "ck"), "--overwrite"]
    done = run_pricer(base + ["-o", str(tmp_path / "a.h5"), *FLAGS])
    assert done.returncode == 0, done.stderr
    again = run_pricer(base + ["-o", str(tmp_path / "b.h5"), "--scenario-spot", "0.2"])
    assert again.returncode == 2 and "checkpoint" in again.stderr


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("trees", [("crr", "jr"), ("crr", "lr")])
def test_gpu_scenarios_are_the_expanded_books_prices(tmp_path, rng, trees):
    cols = book(rng, 200, trees)
    write(tmp_path / "book.h5", cols)
    out = tmp_path / "o.h5"
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(out), "--backend", "batch",
                       *FLAGS], ranks=2)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(read_results(str(out))["scenarios"]["price"],
                          expanded_prices(cols, "batch"))


def test_richardson_with_scenarios_is_refused_and_many_scenarios_fit_a_small_book(tmp_path, rng):
    write(tmp_path / "book.h5", book(rng, 50, ("crr",)))
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "o.h5"),
                       "--backend", "cpu", "--richardson", "--scenario-spot", "0.1"])
    assert done.returncode == 2 and "--richardson" in done.stderr and "Traceback" not in done.stderr
    # 861 scenarios of 50 small options: the memory guard counts the book's rows, not a chunk's
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "o.h5"),
                       "--backend", "cpu", "--scenario-spot=-0.2:0.2:41",
                       "--scenario-volatility=-0.05:0.1:21"])
    assert done.returncode == 0, done.stderr
    assert read_results(str(tmp_path / "o.h5"))["scenarios"]["price"].shape == (50, 861)
    done = run_pricer(["price", str(tmp_path / "book.h5"), "-o", str(tmp_path / "p.h5"),
                       "--backend", "cpu", "--scenario-spot=0:1:100000000000"])
    assert done.returncode == 2 and "at most 10000" in done.stderr and "Traceback" not in done.stderr


def test_api_prices_scenarios_as_columns_with_their_shifts(rng):
    cols = book(rng, 40, ("crr", "lr", "jr"))
    out = pricer.price(cols, backend="cpu", scenarios=AXES)
    count = len(list(itertools.product(*AXES.values())))
    names = [f"scenario:{k}" for k in range(count)]
    assert list(out.columns) == ["id", "price", *names]
    assert np.array_equal(out[names].to_numpy(), expanded_prices(cols, "cpu"))
    assert np.array_equal(out["price"].to_numpy(),
                          pricer.price(cols, backend="cpu")["price"].to_numpy())
    shifts = out.attrs["scenarios"]
    assert list(shifts.columns) == ["spot", "volatility", "rate", "days"]
    assert np.array_equal(shifts.to_numpy(), np.array(list(itertools.product(*AXES.values()))))
    with pytest.raises(pricer.InputError, match="unknown axis"):
        pricer.price(cols, backend="cpu", scenarios={"vol": [0.1]})


@pytest.mark.parametrize("trees", [("crr", "jr"), ("crr", "lr")])
def test_an_engine_that_sizes_by_call_prices_the_options_own_lattices_alone(rng, trees):
    """auto picks CPU or GPU by a call's size: there the options' own lattices are priced in a
    call of their own (ScenarioLattices.without_base), with the same prices as the grid's own."""
    from pricer.engines.cpu.parallel import CpuEngine
    from pricer.model.greeks import SCENARIOS, Analytics, price_with_analytics

    class Sizing(CpuEngine):
        sizes_by_call = True
        calls = []

        def price(self, params, levels=None):
            self.calls.append(len(params))
            return super().price(params, levels)

    cols = lattice_columns(book(rng, 50, trees))
    grid = ScenarioGrid(**{axis: tuple(values) for axis, values in AXES.items()})
    what = Analytics(scenarios=grid)
    want = price_with_analytics(CpuEngine(), cols, "crr", np.arange(50), what)
    sizing = Sizing()
    got = price_with_analytics(sizing, cols, "crr", np.arange(50), what)
    assert sizing.calls[0] == 50 and sum(sizing.calls) == 50 * (1 + grid.count)
    assert np.array_equal(got["price"], want["price"])
    assert np.array_equal(got[SCENARIOS], want[SCENARIOS])
    assert np.array_equal(got["price"], pricer.price(dict(cols, id=np.arange(50), tree=np.array(
        [TREE_NAMES[c] for c in cols["tree"]])), backend="cpu")["price"].to_numpy())


@needs_gpu
@pytest.mark.gpu
def test_gpu_auto_base_prices_keep_their_bits_with_a_grid(rng):
    """auto: a small book's own lattices (~1e6 nodes) go to the CPU alone, its grid's (24 times
    as many) to the GPU; the base prices are those of the book priced without a grid, bit for
    bit, and each scenario's within 1e-11 of its shifted book's (priced on the CPU)."""
    cols = book(rng, 60, ("crr", "jr"))
    alone = pricer.price(cols, backend="auto")["price"].to_numpy()
    gridded = pricer.price(cols, backend="auto", scenarios=AXES)
    assert np.array_equal(gridded["price"].to_numpy(), alone)
    names = [c for c in gridded.columns if c.startswith("scenario:")]
    assert np.allclose(gridded[names].to_numpy(), expanded_prices(cols, "auto"), rtol=1e-11,
                       atol=0.0)
