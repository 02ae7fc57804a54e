"""The docs against the code, as a user reads them: every command block the README and docs/ mark
`<!-- runnable -->` runs, exit 0, in a fresh folder (the repository's jobs/ beside it); docs/jobs.md's
table of keys is the one pricer/io/jobs.py's SCHEMA makes, its example names every key, and the
messages it quotes are the ones a run prints; `pricer --help` and `pricer price -h` say what the
commands take."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import ROOT, env, run_pricer

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"^([ \t]*)<!-- runnable -->\n[ \t]*```[^\n]*\n(.*?)\n[ \t]*```", re.M | re.S)


def runnable_blocks() -> list:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in RUNNABLE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(textwrap.dedent(match.group(2)),
                                      id=f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_the_docs_mark_runnable_blocks():
    assert len(runnable_blocks()) >= 5


@pytest.mark.heavy
@pytest.mark.parametrize("code", runnable_blocks())
def test_a_runnable_block_runs(tmp_path, code):
    """The block as a user pastes it, in a shell whose PATH starts with this environment's bin
    (pricer, and mpiexec from the mpich extra)."""
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    e = env()
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{code}\n--- exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr


def _jobs_md() -> str:
    return (ROOT / "docs" / "jobs.md").read_text()


def test_the_jobs_key_table_is_the_schemas():
    from pricer.io.jobs import key_table

    text = _jobs_md()
    start = text.index("| key | type | default |")
    table = text[start:text.index("<!-- end of the keys -->", start)].rstrip("\n").splitlines()
    assert table == key_table(), "docs/jobs.md's table is stale: python -m pricer.io.jobs"


def test_the_jobs_example_names_every_key():
    """The TOML example at the top of docs/jobs.md sets every key of the schema in its table."""
    import tomllib

    from pricer.io.jobs import SCHEMA

    text = _jobs_md()
    example = tomllib.loads(text.split("```toml\n", 1)[1].split("```", 1)[0])
    for key in SCHEMA:
        section = example
        for part in key.table.split("."):
            section = section[part]
        assert key.key in section, f"docs/jobs.md's example lacks {key.name}"


SMALL = '[portfolio]\npath = "book.h5"\n[portfolio.generate]\ndist = "random"\ncount = 10\n' \
        '[output]\npath = "out.h5"\n'
QUOTED = {   # a job file -> the message docs/jobs.md quotes for it
    "colour": SMALL.replace('path = "book.h5"\n', 'path = "book.h5"\ncolour = "red"\n', 1),
    "outputs": SMALL + '[outputs]\npath = "x.h5"\n',
    "no output": '[portfolio]\npath = "book.h5"\n',
    "no count": SMALL.replace("count = 10\n", ""),
    "partition": SMALL + '[pricing]\npartition = "foo"\n',
    "threads": SMALL + '[pricing]\nthreads = "2"\n',
    "greeks": SMALL + "[pricing]\ngreeks = 1\n",
}


@pytest.mark.parametrize("case", list(QUOTED))
def test_the_messages_jobs_md_quotes_are_the_ones_printed(tmp_path, case):
    (tmp_path / "job.toml").write_text(QUOTED[case])
    proc = run_pricer(["run", "job.toml"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = [x for x in proc.stderr.splitlines() if x.startswith("pricer: error:")]
    assert len(line) == 1 and f"\n{line[0]}\n" in _jobs_md(), (line, "not quoted in docs/jobs.md")
    assert not (tmp_path / "out.h5").exists()


def test_the_help_says_what_the_commands_take():
    from pricer.cli import COMMANDS

    top = run_pricer(["--help"]).stdout
    for name in COMMANDS:                    # every command listed with its line of help
        assert re.search(rf"^    {re.escape(name)}\s+\S", top, re.M), (name, top)
    assert "warm the kernel caches" in " ".join(top.split())
    price = " ".join(run_pricer(["price", "-h"]).stdout.split())
    for needle in ("HDF5", "CSV", "Parquet", "/bond_options", ".csv or .parquet"):
        assert needle in price, (needle, price)


def test_performance_md_holds_the_current_numbers_only():
    """docs/performance.md is the current numbers, each with its command (history is in git): it
    stays short enough to read (300 lines) and names no commit."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 300
    commit = re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert commit is None, commit
