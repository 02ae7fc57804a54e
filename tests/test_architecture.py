"""The architecture, held against the code (README.md, "What it does"): the packages' layers and
what each may import, no import cycle, modules one can read in a sitting, and code that says what
and why rather than when."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pricer"
# What each layer may import (besides itself and the standard library / third-party packages):
# io -> model -> engines -> run -> cli, the tools beside the run, off the production path.
BASE = {"pricer", "pricer.compiling", "pricer.devices", "pricer.ending", "pricer.errors",
        "pricer.files", "pricer.numba_cache", "pricer.threads"}
ALLOWED = {
    "base": set(),
    "model": {"base"},
    "io": {"base", "model"},
    "engines": {"base", "model"},
    "run": {"base", "model", "io", "engines"},
    "tools": {"base", "model", "io", "engines", "run"},
    "cli": {"base", "model", "io", "engines", "run", "tools"},
}
MAX_LINES = 500
# The entry points, on top of everything: the command line and the Python API (pricer.price, which
# the package's __init__ names lazily: the one import upwards, made at first use)
ENTRY_POINTS = ("pricer.cli", "pricer.__main__", "pricer.api")
LAZY = {("pricer", "pricer.api")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in ENTRY_POINTS:
        return "cli"
    return module.split(".")[1]


def imports(path: Path) -> set[str]:
    """Every pricer module that `path` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            for alias in node.names:     # `from pricer.run import memory` imports a module
                if (PACKAGE.parent / f"{node.module}.{alias.name}".replace(".", "/")).with_suffix(
                        ".py").exists():
                    found.add(f"{node.module}.{alias.name}")
    return {name for name in found if name == "pricer" or name.startswith("pricer.")}


def graph() -> dict[str, set[str]]:
    edges = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}
    for module, target in LAZY:
        assert target in edges[module], f"{module} no longer imports {target}: drop it from LAZY"
        edges[module].discard(target)
    return edges


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            if layer(target) != layer(module) and layer(target) not in ALLOWED[layer(module)]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(module, stack):
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target in edges and not state.get(target):
                visit(target, stack + [target])
        state[module] = 2

    for module in sorted(edges):
        if not state.get(module):
            visit(module, [module])
    assert not cycles, cycles


def test_engines_never_see_mpi_files_or_ids():
    for path in (PACKAGE / "engines").rglob("*.py"):
        names = {alias.name for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.Import, ast.ImportFrom))
                 for alias in node.names} | {node.module for node in ast.walk(ast.parse(
                     path.read_text())) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {"mpi4py", "mpi4py.MPI", "h5py"} & names, path


def test_modules_can_be_read_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_code_says_what_and_why_not_when():
    """No session, run or issue numbers in the code's comments and docstrings (history is in git)."""
    pattern = re.compile(r"\bsessions? \d+|\bruns? \d+\b|\bissues? \d+", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in [*PACKAGE.rglob("*.py"), *(ROOT / "cuda").glob("*.cu")]
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
