"""pricer's numba kernels are cached in a folder keyed by its kernel sources, chosen by a locator of
its own (pricer/numba_cache.py), while numba's configuration is left as a program set it: a
program that imports pricer and has numba kernels of its own finds them cached where numba caches
them without pricer, and its code generation (CPU name and features) unchanged."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, env

PACKAGE = ROOT / "pricer"


def test_every_module_with_cached_kernels_imports_the_locator_first():
    """A kernel decorated before pricer.numba_cache is imported would be cached wherever numba's
    own locators say (beside its source, or in a folder not keyed by the sources it calls)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if "cache=True" not in text or path.name == "numba_cache.py":
            continue
        tree = ast.parse(text)
        imported = decorated = None
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "pricer" \
                    and any(a.name == "numba_cache" for a in node.names):
                imported = imported or node.lineno
            if isinstance(node, ast.FunctionDef) and any(
                    "cache=True" in ast.unparse(d) for d in node.decorator_list):
                decorated = decorated or node.lineno
        assert imported is not None and (decorated is None or imported < decorated), \
            f"{path.relative_to(ROOT)}: import pricer.numba_cache before its first cached kernel"


def test_a_program_keeps_its_numba_configuration_and_cache(tmp_path):
    program = tmp_path / "mine.py"
    program.write_text(
        "import numba, os, sys\n"
        "before = (numba.config.CACHE_DIR, numba.config.CPU_NAME, numba.config.CPU_FEATURES)\n"
        "import numpy as np, pricer, pricer.api, pricer.engines, pricer.engines.cpu.kernels\n"
        "from pricer.model.implied import _normal_cdf\n"      # a pricer kernel: compiled, cached
        "assert _normal_cdf(0.0) == 0.5\n"
        "@numba.njit(cache=True)\n"
        "def mine(x):\n"
        "    return x + 1\n"
        "assert mine(1) == 2\n"
        "after = (numba.config.CACHE_DIR, numba.config.CPU_NAME, numba.config.CPU_FEATURES)\n"
        "print(before == after, before, after)\n")
    cache = tmp_path / "cache"
    e = dict(env(), NUMBA_CACHE_DIR=str(cache))
    for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        e.pop(name, None)
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=e,
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True "), proc.stdout
    entries = sorted(p.name for p in cache.iterdir())
    kernels = [name for name in entries if name.startswith("kernels-")]
    assert len(kernels) == 1, entries        # pricer's, in its keyed folder
    ours = list(Path(cache, kernels[0]).rglob("*.nbi"))
    assert ours and all("mine" not in p.name for p in ours)
    theirs = [p for p in cache.rglob("mine.mine-*.nbi")]
    assert theirs and all(kernels[0] not in str(p) for p in theirs), entries


def test_an_unwritable_cache_folder_falls_back_to_a_keyed_temporary_one(tmp_path):
    """No writable cache folder (XDG_CACHE_HOME in /proc, no NUMBA_CACHE_DIR): pricer's kernels
    go to the temporary folder, keyed by their sources, never beside the sources (numba's own
    fallback, which is not keyed)."""
    before = sorted(PACKAGE.rglob("*.nbi"))
    e = {k: v for k, v in env().items() if k != "NUMBA_CACHE_DIR"}
    e.update(XDG_CACHE_HOME="/proc/pricer-no-cache", TMPDIR=str(tmp_path))
    code = ("from pricer.model.implied import _normal_cdf\n"
            "print(_normal_cdf(0.0))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "0.5", proc.stderr
    cached = list(tmp_path.glob("pricer-numba-*/kernels-*/**/*.nbi"))
    assert cached, sorted(str(p) for p in tmp_path.rglob("*"))
    assert sorted(PACKAGE.rglob("*.nbi")) == before
