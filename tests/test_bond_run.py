"""`pricer price` on books of bond options (pricer/run/pipeline.py, pricer/run/bond_family.py): real files, the real CLI,
real `mpiexec` with several ranks; prices against pricer.price_bonds (the CPU engine in this
process), files with options and bond options together, bad input, --invalid skip, checkpoints
with a rank that fails, and the GPU backends (marked gpu)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from gpu_cases import needs_gpu
from helpers import run_pricer
from pricer.io.results import read_results


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """An R1-like book of 120 bond options, and its prices by pricer.price_bonds."""
    import pricer
    folder = tmp_path_factory.mktemp("bonds")
    path = folder / "r1.h5"
    gen = run_pricer(["generate", "--bonds", "R1", "--count", "120", "--seed", "5", "-o", path])
    assert gen.returncode == 0, gen.stderr
    return path, pricer.price_bonds(str(path))


def _mixed(tmp_path, bonds_path):
    """A file with a generated /portfolio and the book's /bond_options and /curves."""
    path = tmp_path / "mixed.h5"
    gen = run_pricer(["generate", "--dist", "random", "--count", "300", "--seed", "3", "-o", path])
    assert gen.returncode == 0, gen.stderr
    with h5py.File(bonds_path, "r") as src, h5py.File(path, "a") as dst:
        for group in ("bond_options", "curves"):
            src.copy(group, dst)
    return path


@pytest.mark.parametrize("ranks", [None, 2, 3])
def test_bond_book_priced_by_any_rank_count(tmp_path, book, ranks):
    path, want = book
    out = tmp_path / "out.h5"
    run = run_pricer(["price", path, "-o", out, "--chunk-nodes", "2e6", "--backend", "cpu"],
                     ranks=ranks, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "priced 120 bond options" in run.stdout
    got = read_results(out)
    np.testing.assert_array_equal(got["bonds"]["id"], want.id.to_numpy())
    np.testing.assert_array_equal(got["bonds"]["price"], want.price.to_numpy())   # bitwise
    assert (got["bonds"]["status"] == 0).all()
    assert int(got["attrs"]["ranks"]) == (ranks or 1) and got["attrs"]["bond_backend"] == "cpu"


def test_progress_of_every_rank(tmp_path, book):
    """Rank 0's progress lines count every rank's chunks and reach 100 % with all of them; the
    summary on stdout is untouched (--quiet: none, as test_progress.py checks for options)."""
    from test_progress import LINE
    path, want = book
    slow = dict(PRICER_PROGRESS="log", PRICER_PROGRESS_SECONDS="0.05", PRICER_CHUNK_DELAY="0.03")
    run = run_pricer(["price", path, "-o", tmp_path / "out.h5", "--chunk-nodes", "4e5",
                      "--backend", "cpu"], ranks=2, timeout=300, extra_env=slow)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [LINE.match(x) for x in run.stderr.splitlines() if x.startswith("pricer: progress")]
    assert len(lines) >= 2 and all(lines), run.stderr
    chunks = [int(m.group(4)) for m in lines]
    assert chunks == sorted(chunks) and int(lines[-1].group(1)) == 100
    assert chunks[-1] == int(lines[-1].group(5)) >= 6, run.stderr     # several chunks a rank
    assert "pricer: progress" not in run.stdout and "priced 120 bond options" in run.stdout
    np.testing.assert_array_equal(read_results(tmp_path / "out.h5")["bonds"]["price"],
                                  want.price.to_numpy())


def test_options_and_bond_options_in_one_file(tmp_path, book):
    path, want = book
    mixed = _mixed(tmp_path, path)
    alone = run_pricer(["price", mixed, "-o", tmp_path / "options.h5", "--backend", "cpu"],
                       timeout=300)
    assert alone.returncode == 0, alone.stderr
    # the option run alone: the same file with its bonds left out
    only = tmp_path / "only.h5"
    with h5py.File(mixed, "r") as src, h5py.File(only, "w") as dst:
        src.copy("portfolio", dst)
    ref = run_pricer(["price", only, "-o", tmp_path / "ref.h5", "--backend", "cpu"], timeout=300)
    assert ref.returncode == 0, ref.stderr
    both = read_results(tmp_path / "options.h5")
    options = read_results(tmp_path / "ref.h5")
    np.testing.assert_array_equal(both["id"], options["id"])
    np.testing.assert_array_equal(both["price"], options["price"])
    np.testing.assert_array_equal(both["bonds"]["price"], want.price.to_numpy())
    assert "priced 300 options" in alone.stdout and "priced 120 bond options" in alone.stdout
    # two groups need HDF5: refused before any work, nothing written
    csv = run_pricer(["price", mixed, "-o", tmp_path / "both.csv"], ranks=2, timeout=300)
    assert csv.returncode == 2 and "HDF5 only" in csv.stderr, csv.stderr
    assert "Traceback" not in csv.stderr and not (tmp_path / "both.csv").exists()


def test_a_mixed_file_is_checked_whole_before_any_work(tmp_path, book):
    """A bad option in a file of options and bond options is refused before the bond options are
    priced: exit 2 naming it, no bond chunk saved to the checkpoint, nothing written."""
    path, _ = book
    mixed = _mixed(tmp_path, path)
    with h5py.File(mixed, "a") as f:
        spot = f["portfolio/spot"]
        values = spot[()]
        values[7] = np.nan
        spot[...] = values
        bad_id = int(f["portfolio/id"][7])
    out, folder = tmp_path / "out.h5", tmp_path / "ck"
    run = run_pricer(["price", mixed, "-o", out, "--backend", "cpu", "--checkpoint", folder,
                      "--chunk-nodes", "2e6"], ranks=2, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"column spot is NaN or infinite for option id(s) {bad_id}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not out.exists()
    bonds = tmp_path / "ck.bonds"
    assert not bonds.exists() or not [p for p in bonds.iterdir() if p.name.startswith("chunk-")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.h5")]   # no claim left


def test_bond_book_to_csv(tmp_path, book):
    path, want = book
    run = run_pricer(["price", path, "-o", tmp_path / "b.csv", "--backend", "cpu"], timeout=300)
    assert run.returncode == 0, run.stderr
    got = read_results(tmp_path / "b.csv")
    np.testing.assert_array_equal(got["price"], want.price.to_numpy())


def _spoiled(tmp_path, path, bad: dict, name: str = "bad.h5"):
    """A copy of the book with rows of columns overwritten: {column: {row: value}}."""
    out = tmp_path / name
    with h5py.File(path, "r") as src, h5py.File(out, "w") as dst:
        for group in ("bond_options", "curves"):
            src.copy(group, dst)
        for column, rows in bad.items():
            values = dst["bond_options"][column][()]
            for row, value in rows.items():
                values[row] = value
            dst["bond_options"][column][...] = values
    return out


def test_bad_bond_rows_refused_on_every_rank_or_skipped(tmp_path, book):
    path, want = book
    bad = _spoiled(tmp_path, path, {"volatility": {7: -0.01}, "maturity": {30: np.nan}})
    ids = want.id.to_numpy()
    refused = run_pricer(["price", bad, "-o", tmp_path / "x.h5"], ranks=2, timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "maturity" in refused.stderr and str(ids[30]) in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "x.h5").exists()
    skipped = run_pricer(["price", bad, "-o", tmp_path / "s.h5", "--invalid", "skip",
                          "--backend", "cpu"], ranks=2,
                         timeout=300)
    assert skipped.returncode == 0, skipped.stderr
    got = read_results(tmp_path / "s.h5")["bonds"]
    assert got["status"][7] == 13 and got["status"][30] == 1     # bond_book.REASONS' codes
    assert np.isnan(got["price"][[7, 30]]).all()
    keep = np.setdiff1d(np.arange(ids.size), [7, 30])
    np.testing.assert_array_equal(got["price"][keep], want.price.to_numpy()[keep])
    assert "2 of 120 bond options not priced" in skipped.stdout
    info = run_pricer(["info", tmp_path / "s.h5"])
    assert info.returncode == 0 and "no options, 120 bond options" in info.stdout, info.stderr
    assert "(2 NaN)" in info.stdout and "13 (volatility must be > 0" in info.stdout
    # a row that only the last rank reads: refused by that rank, every rank exits 2
    late = _spoiled(tmp_path, path, {"coupon": {115: 3.0}}, "late.h5")
    refused = run_pricer(["price", late, "-o", tmp_path / "y.h5", "--chunk-nodes", "2e6"],
                         ranks=2, timeout=300)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "rank 1: " in refused.stderr and "coupon" in refused.stderr
    assert str(ids[115]) in refused.stderr and not (tmp_path / "y.h5").exists()
    # ids are checked whole by rank 0
    twice = _spoiled(tmp_path, path, {"id": {40: int(ids[3])}}, "twice.h5")
    refused = run_pricer(["price", twice, "-o", tmp_path / "z.h5"], ranks=2, timeout=300)
    assert refused.returncode == 2 and f"duplicate id(s) {ids[3]}" in refused.stderr, \
        refused.stderr


def _no_value(path, src):
    """A copy of the book whose row 140 keeps every bound yet its tree gives no finite value
    (a = 0.001, sigma = 1, a year a step over 500 years, on a curve of -100 %)."""
    import shutil
    shutil.copy(src, path)
    with h5py.File(path, "a") as f:
        g = f["bond_options"]
        for column, value in dict(mean_reversion=0.001, volatility=1.0, steps_per_year=1.0,
                                  maturity=500.0, first_exercise=0.0, last_exercise=500.0,
                                  coupon=0.0, strike=0.0, frequency=0).items():
            x = g[column][()]
            x[140] = value
            g[column][...] = x
        for column, value in (("exercise", b"european"), ("curve", b"neg")):
            x = g[column][()].astype("S8")
            x[140] = value
            del g[column]
            g.create_dataset(column, data=x)
        f["curves"].create_dataset("neg/times", data=[1.0])
        f["curves"].create_dataset("neg/rates", data=[-1.0])
    return path


def test_rows_no_tree_can_value_and_odd_files(tmp_path):
    """A tree that gives no finite value, in a file with options too, on 2 ranks: refused by
    every rank (exit 2, no rank left waiting), or skipped with its status; flags and whole
    numbers that break their rule are skipped row by row; ids beyond int64 and an empty book on
    a bad curve are refused."""
    book = tmp_path / "b.h5"
    assert run_pricer(["generate", "--bonds", "S2", "--count", "150", "--seed", "5", "-o",
                       book]).returncode == 0
    mixed = _no_value(tmp_path / "nf.h5", _mixed(tmp_path, book))
    refused = run_pricer(["price", mixed, "-o", tmp_path / "x.h5", "--backend", "cpu",
                          "--chunk-nodes", "2e5"], ranks=2, timeout=120)
    assert refused.returncode == 2 and "gave no finite value" in refused.stderr, refused.stderr
    assert "id(s) 141 " in refused.stderr and not (tmp_path / "x.h5").exists()
    skipped = run_pricer(["price", mixed, "-o", tmp_path / "s.h5", "--backend", "cpu",
                          "--chunk-nodes", "2e5", "--invalid", "skip"], ranks=2, timeout=120)
    assert skipped.returncode == 0, skipped.stderr
    got = read_results(tmp_path / "s.h5")
    reasons = json.loads(got["attrs"]["bond_status_reasons"])
    assert reasons[str(got["bonds"]["status"][140])] == "gives no finite value on its tree"
    flags = tmp_path / "flags.h5"
    with h5py.File(book, "r") as src, h5py.File(flags, "w") as dst:
        for group in ("bond_options", "curves"):
            src.copy(group, dst)
        g = dst["bond_options"]
        call, frequency = g["call"][()].astype(np.int64), g["frequency"][()].astype(float)
        call[3], frequency[4] = 2, 2.5
        for name, values in (("call", call), ("frequency", frequency)):
            del g[name]
            g.create_dataset(name, data=values)
    skipped = run_pricer(["price", flags, "-o", tmp_path / "f.h5", "--backend", "cpu",
                          "--invalid", "skip"], timeout=120)
    assert skipped.returncode == 0, skipped.stderr
    got = read_results(tmp_path / "f.h5")
    reasons = json.loads(got["attrs"]["bond_status_reasons"])
    assert reasons[str(got["bonds"]["status"][3])].startswith("call must be")
    assert reasons[str(got["bonds"]["status"][4])].startswith("frequency must be")
    assert (got["bonds"]["status"][5:] == 0).all()
    big = tmp_path / "big.h5"
    with h5py.File(book, "r") as src, h5py.File(big, "w") as dst:
        for group in ("bond_options", "curves"):
            src.copy(group, dst)
        ids = dst["bond_options"]["id"][()].astype(np.uint64)
        ids[0] = 2**64 - 1
        del dst["bond_options"]["id"]
        dst["bond_options"].create_dataset("id", data=ids)
    refused = run_pricer(["price", big, "-o", tmp_path / "y.h5", "--backend", "cpu"])
    assert refused.returncode == 2 and "within int64" in refused.stderr, refused.stderr
    empty = tmp_path / "empty.h5"
    with h5py.File(book, "r") as src, h5py.File(empty, "w") as dst:
        src.copy("curves", dst)
        g = dst.create_group("bond_options")
        g.attrs.update(src["bond_options"].attrs)
        for name, ds in src["bond_options"].items():
            g.create_dataset(name, data=ds[:0])
        dst["curves"].attrs["default"] = "nosuch"
    refused = run_pricer(["price", empty, "-o", tmp_path / "z.h5", "--backend", "cpu"],
                         ranks=2, timeout=120)
    assert refused.returncode == 2 and "nosuch" in refused.stderr, refused.stderr
    with h5py.File(empty, "r+") as f:       # its curves right: a book of no bond options
        f["curves"].attrs["default"] = next(iter(f["curves"]))
    refused = run_pricer(["price", empty, "-o", tmp_path / "z.h5", "--backend", "cpu"],
                         ranks=2, timeout=120)
    assert refused.returncode == 2 and "holds no bond options" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "z.h5").exists()


def test_bond_options_only_settings_refused(tmp_path, book):
    path, _ = book
    run = run_pricer(["price", path, "-o", tmp_path / "g.h5", "--greeks"], ranks=2, timeout=300)
    assert run.returncode == 2 and "--greeks" in run.stderr, run.stderr
    assert not (tmp_path / "g.h5").exists()


def test_a_failed_rank_keeps_its_chunks_and_the_resume_prices_the_rest(tmp_path, book):
    path, want = book
    ckpt = tmp_path / "ckpt"
    args = ["price", path, "-o", tmp_path / "c.h5", "--checkpoint", ckpt, "--chunk-nodes", "2e6",
            "--backend", "cpu"]
    failed = run_pricer(args, ranks=2, timeout=300, extra_env={"PRICER_FAULT": "raise:1:2"})
    assert failed.returncode != 0 and "rank 1 failed after 2 chunk(s)" in failed.stderr
    assert not (tmp_path / "c.h5").exists()
    saved = len(list(ckpt.glob("chunk-*.bin")))
    assert saved >= 2
    resumed = run_pricer(args, ranks=2, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "from the checkpoint" in resumed.stdout
    got = read_results(tmp_path / "c.h5")["bonds"]
    np.testing.assert_array_equal(got["price"], want.price.to_numpy())


def test_a_rank_that_stops_advancing_ends_the_run(tmp_path, book):
    """A rank whose main thread hangs (PRICER_FAULT=hang, as on a wedged GPU): the stall watchdog
    names it and every rank exits, nothing written."""
    path, _ = book
    out = tmp_path / "h.h5"
    run = run_pricer(["price", path, "-o", out, "--chunk-nodes", "2e6", "--backend", "cpu",
                      "--stall-timeout", "2"], ranks=2, timeout=120,
                     extra_env={"PRICER_FAULT": "hang:1:2"})   # past the first chunk's cold start
    assert run.returncode != 0 and "rank 1" in run.stderr and "has finished no chunk" in \
        run.stderr, run.stderr
    assert not out.exists()


@pytest.mark.gpu
@needs_gpu
def test_bond_book_on_the_gpu_under_mpi(tmp_path, book):
    path, want = book
    run = run_pricer(["price", path, "-o", tmp_path / "g.h5", "--backend", "batch"], ranks=2,
                     timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    got = read_results(tmp_path / "g.h5")
    assert got["attrs"]["bond_backend"] == "batch"
    ref = want.price.to_numpy()
    err = np.abs(got["bonds"]["price"] - ref) / np.maximum(np.abs(ref), 1.0)
    assert err.max() <= 1e-12


def test_the_trees_spacing_is_a_run_setting(tmp_path, book):
    """--bond-spacing (and a job's pricing.bond_spacing): the exact variance by default, Hull and
    White's sigma sqrt(3 dt) by choice, bitwise pricer.price_bonds' prices of the same spacing
    under mpiexec -n 2, recorded in the results; an unknown name is refused by name."""
    import pricer
    path, want = book
    old = pricer.price_bonds(str(path), spacing="sqrt-dt")
    assert not np.array_equal(old["price"].to_numpy(), want["price"].to_numpy())
    for flags, expected, name in (([], want, "variance"),
                                  (["--bond-spacing", "sqrt-dt"], old, "sqrt-dt")):
        out = tmp_path / f"{name}.h5"
        run = run_pricer(["price", path, "-o", out, "--backend", "cpu", "--quiet", *flags],
                         ranks=2, timeout=300)
        assert run.returncode == 0, run.stderr
        got = read_results(out)
        assert got["bonds"]["price"].tobytes() == expected["price"].to_numpy().tobytes()
        assert got["attrs"]["bond_spacing"] == name
    job = tmp_path / "job.toml"
    job.write_text(f'[portfolio]\npath = "{path}"\n[pricing]\nbackend = "cpu"\n'
                   f'bond_spacing = "sqrt-dt"\n[output]\npath = "{tmp_path / "job.h5"}"\n')
    assert run_pricer(["run", job, "--quiet"]).returncode == 0
    assert read_results(tmp_path / "job.h5")["bonds"]["price"].tobytes() == \
        old["price"].to_numpy().tobytes()
    job.write_text(job.read_text().replace('"sqrt-dt"', '"exact"'))
    bad = run_pricer(["run", job])
    assert bad.returncode == 2 and "pricing.bond_spacing must be one of variance, sqrt-dt, got " \
        "'exact'" in bad.stderr, bad.stderr
