"""A family registered from test code alone (tests/toy_family.py) priced through the run that
every family shares (pricer/run/pipeline.py): `pricer price` under `mpiexec -n 2` with a
checkpoint that a failed rank leaves behind, --invalid skip, a refusal by id, a file that holds
options too, and the Python API (pricer.price_file)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

import pricer
from pricer.io.results import read_results
from tests import toy_family
from tests.helpers import run_pricer

PLUGIN = {"PRICER_PLUGINS": "tests.toy_family"}


def _book(path, n=6000, seed=None, bad=()):
    rng = np.random.default_rng(seed)
    columns = {"spot": rng.uniform(10, 200, n), "strike": rng.uniform(10, 200, n),
               "rate": rng.uniform(-0.01, 0.08, n), "maturity": rng.uniform(0, 5, n)}
    for row, column, value in bad:
        columns[column][row] = value
    ids = rng.permutation(10 * n)[:n] + 1
    toy_family.write_book(path, ids, columns)
    return ids, columns


def test_a_plugin_family_runs_on_two_ranks_with_a_checkpoint_and_skips(tmp_path):
    book = tmp_path / "fw.h5"
    ids, columns = _book(book, bad=[(17, "spot", -1.0), (4000, "maturity", -0.5),
                                    (5999, "spot", np.nan)])
    out, ck = tmp_path / "out.h5", tmp_path / "ck"
    args = ["price", book, "-o", out, "--backend", "cpu", "--checkpoint", ck,
            "--chunk-nodes", "1000", "--invalid", "skip"]
    # rank 1 fails after two chunks: the job ends (exit 1), the finished chunks stay saved
    failed = run_pricer(args, ranks=2, extra_env={**PLUGIN, "PRICER_FAULT": "raise:1:2"})
    assert failed.returncode == 1, failed.stderr
    assert "rank 1" in failed.stderr and not out.exists()
    saved = sorted(p.name for p in ck.iterdir() if p.name.startswith("chunk-"))
    assert saved, "the failed run saved no chunk"
    resumed = run_pricer(args, ranks=2, extra_env=PLUGIN)
    assert resumed.returncode == 0, resumed.stderr
    assert "from the checkpoint" in resumed.stdout and "priced 5997 forwards" in resumed.stdout
    assert "--invalid skip: 3 of 6000 forwards not priced" in resumed.stdout
    got = read_results(out)["forwards"]
    np.testing.assert_array_equal(got["id"], ids)
    want = toy_family.oracle(columns)
    np.testing.assert_allclose(got["price"], want, rtol=1e-13, atol=1e-12)
    assert np.isnan(got["price"][[17, 4000, 5999]]).all()
    assert got["status"].tolist()[17] == 1 and got["status"][4000] == 2 and got["status"][5999] == 1
    assert (np.delete(got["status"], [17, 4000, 5999]) == 0).all()
    info = run_pricer(["info", out])
    assert info.returncode == 0, info.stderr
    assert "6000 forwards" in info.stdout and "2 (maturity must be >= 0) 1" in info.stdout
    # the same prices, bitwise, from one rank without a checkpoint
    one = run_pricer(["price", book, "-o", tmp_path / "one.h5", "--backend", "serial",
                      "--invalid", "skip"], extra_env=PLUGIN)
    assert one.returncode == 0, one.stderr
    assert read_results(tmp_path / "one.h5")["forwards"]["price"].tobytes() == \
        got["price"].tobytes()


def test_a_plugin_family_refuses_bad_rows_by_id_on_every_rank(tmp_path):
    book = tmp_path / "fw.h5"
    ids, _ = _book(book, n=3000, bad=[(2900, "spot", 0.0)])
    out = tmp_path / "out.h5"
    result = run_pricer(["price", book, "-o", out, "--backend", "cpu", "--chunk-nodes", "500"],
                        ranks=2, extra_env=PLUGIN)
    assert result.returncode == 2, result.stderr
    assert f"forward id(s) {ids[2900]}" in result.stderr and "spot must be > 0" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    # a plug-in that cannot be imported refuses the run by name
    missing = run_pricer(["price", book, "-o", out], extra_env={"PRICER_PLUGINS": "no.such"},
                         ranks=2)
    assert missing.returncode == 2 and "'no.such' could not be imported" in missing.stderr
    assert "Traceback" not in missing.stderr and not out.exists()


def test_a_plugin_family_beside_options_in_one_file(tmp_path):
    book = tmp_path / "both.h5"
    gen = run_pricer(["generate", "--dist", "random", "--count", "300", "--seed", "4",
                      "-o", tmp_path / "opts.h5"])
    assert gen.returncode == 0, gen.stderr
    ids, columns = _book(book, n=500)
    with h5py.File(tmp_path / "opts.h5", "r") as src, h5py.File(book, "a") as dst:
        src.copy("portfolio", dst)
    out = tmp_path / "out.h5"
    result = run_pricer(["price", book, "-o", out, "--backend", "cpu"], ranks=2,
                        extra_env=PLUGIN)
    assert result.returncode == 0, result.stderr
    got = read_results(out)
    assert got["id"].size == 300 and np.isfinite(got["price"]).all()
    np.testing.assert_allclose(got["forwards"]["price"], toy_family.oracle(columns),
                               rtol=1e-13, atol=1e-12)
    alone = run_pricer(["price", tmp_path / "opts.h5", "-o", tmp_path / "alone.h5",
                        "--backend", "cpu"])
    assert alone.returncode == 0, alone.stderr
    assert read_results(tmp_path / "alone.h5")["price"].tobytes() == got["price"].tobytes()


def test_a_plugin_family_through_the_python_api(tmp_path):
    book = tmp_path / "fw.h5"
    ids, columns = _book(book, n=2000, bad=[(5, "maturity", -1.0)])
    summary = pricer.price_file(book, tmp_path / "api.h5", backend="cpu", invalid="skip",
                                chunk_nodes=700, checkpoint=str(tmp_path / "ck"))
    assert summary.record()["family"] == "forwards" and summary.record()["instruments"] == 2000
    got = read_results(tmp_path / "api.h5")["forwards"]
    np.testing.assert_allclose(got["price"], toy_family.oracle(columns), rtol=1e-13, atol=1e-12)
    assert got["status"][5] == 2
    with pytest.raises(pricer.InputError, match=rf"forward id\(s\) {ids[5]}: maturity"):
        pricer.price_file(book, tmp_path / "refused.h5", backend="cpu")
    assert not (tmp_path / "refused.h5").exists()
    with pytest.raises(pricer.InputError, match="unknown setting"):
        pricer.price_file(book, tmp_path / "x.h5", greek=True)


def test_a_failure_or_a_setting_of_options_alone_is_named(tmp_path, monkeypatch):
    """A failing engine raises RuntimeError from the API (never SystemExit into the caller); a
    file of two families and no options refuses the options' settings (exit 2); the bond
    family's summary keeps its words."""
    from pricer.tools.bond_datasets import write_dataset
    book = tmp_path / "fw.h5"
    _book(book, n=300)

    def broken(self, columns):
        raise ArithmeticError("the toy engine broke")

    monkeypatch.setattr(toy_family.ForwardEngine, "price", broken)
    with pytest.raises(RuntimeError, match="failed"):
        pricer.price_file(book, tmp_path / "x.h5", backend="cpu")
    assert not (tmp_path / "x.h5").exists()
    monkeypatch.undo()
    both = tmp_path / "both.h5"
    write_dataset(str(both), "S1", 200, 0)
    _, columns = _book(tmp_path / "more.h5", n=100)
    with h5py.File(tmp_path / "more.h5", "r") as src, h5py.File(both, "a") as dst:
        src.copy("forwards", dst)
    result = run_pricer(["price", both, "-o", tmp_path / "g.h5", "--greeks"], extra_env=PLUGIN)
    assert result.returncode == 2 and "--greeks apply to options" in result.stderr, result.stderr
    result = run_pricer(["price", both, "-o", tmp_path / "b.h5", "--backend", "cpu"],
                        extra_env=PLUGIN)
    assert result.returncode == 0, result.stderr
    assert "bond stages:" in result.stdout and "forwards stages:" in result.stdout
    got = read_results(tmp_path / "b.h5")
    assert got["bonds"]["id"].size == 200 and (got["bonds"]["status"] == 0).all()
    np.testing.assert_allclose(got["forwards"]["price"], toy_family.oracle(columns),
                               rtol=1e-13, atol=1e-12)
