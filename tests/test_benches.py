"""The benches as a user of the README's environment runs them: one whose anchor (QuantLib, the
`bench` extra) is not installed says so in one line and times pricer alone, exit 0, no
traceback, its JSON without the anchor's figures. QuantLib is hidden from the command by a
package of that name first on its path whose import fails, as an uninstalled one's does."""

from __future__ import annotations

import json
import os

import pytest

from helpers import run_pricer


@pytest.fixture
def without_quantlib(tmp_path):
    hidden = tmp_path / "hide" / "QuantLib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'QuantLib'\", name='QuantLib')\n")
    return {"PYTHONPATH": f"{hidden.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PRICER_NO_GPU": "1"}


def _ran_without_anchor(proc, bench: str) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    assert f"pricer bench {bench}: QuantLib, its anchor, is not installed (pip install " \
           f"'pricer[bench]')" in proc.stderr, text
    assert "not measured (QuantLib is not installed" in proc.stdout, text


@pytest.mark.heavy
def test_bench_cpu_without_quantlib(tmp_path, without_quantlib):
    out = tmp_path / "bench.json"
    proc = run_pricer(["bench", "cpu", "--quick", "--out", out], timeout=600,
                      extra_env=without_quantlib)
    _ran_without_anchor(proc, "cpu")
    report = json.loads(out.read_text())
    assert report["machine"]["QuantLib"] == "not installed"
    assert report["price_check"]["QuantLib"] is None
    assert all("QuantLib" not in row["nodes_per_s"] and row["nodes_per_s"]["serial"] > 0
               for row in report["rows"])


def test_bench_trinomial_and_implied_vol_without_quantlib(tmp_path, without_quantlib):
    out = tmp_path / "trinomial.json"
    proc = run_pricer(["bench", "trinomial", "--datasets", "R1", "--count", "200", "--repeats",
                       "1", "--engines", "cpu", "--out", out], timeout=600,
                      extra_env=without_quantlib)
    _ran_without_anchor(proc, "trinomial")
    rows = json.loads(out.read_text())
    assert rows and all("quantlib_ratio" not in row for row in rows)
    out = tmp_path / "implied.json"
    proc = run_pricer(["bench", "implied-vol", "--count", "300", "--steps", "50", "--repeats",
                       "1", "--out", out], timeout=600, extra_env=without_quantlib)
    _ran_without_anchor(proc, "implied-vol")
    result = json.loads(out.read_text())
    assert result["rows"] and "per_core_ratio" not in result


def test_bench_plan_times_every_part_against_the_plain_read(tmp_path):
    """`pricer bench plan --quick`: the plain read, the whole plan, --distribute read at 1, 2 and
    4 ranks and the bond plan, each measured (positive seconds) and judged against its target;
    what it prints is what it writes."""
    out = tmp_path / "plan.json"
    proc = run_pricer(["bench", "plan", "--quick", "--out", out], timeout=600)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["options"] == record["bonds"] == 200_000
    seconds = [record[k] for k in ("plain_read_s", "plan_s", "bond_plain_read_s", "bond_plan_s")]
    assert all(s > 0 for s in seconds + list(record["own_rows_s"].values())), record
    assert sorted(record["own_rows_s"]) == ["1", "2", "4"]
    assert set(record["verdicts"]) == {"options_ns", "options_ratio", "bonds_ns"}
    ratio = record["plan_s"] / record["plain_read_s"]
    assert f"{ratio:5.1f}x the plain read" in proc.stdout, proc.stdout
    assert "verdicts: options_ns " in proc.stdout
