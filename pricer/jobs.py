"""Job specs: a TOML file that says everything about a run (`pricer run JOB.toml`).

    [portfolio]            path = "book.h5"          (the input; relative paths are from the CWD)
    [portfolio.generate]   dist, count, seed, steps, exercise, min_steps, max_steps
                           (optional: rank 0 writes `path` from these first, unless it already holds
                           exactly this generated portfolio)
    [pricing]              backend, tree, partition, distribute, threads, t1, t2
    [output]               path, overwrite

Unknown tables and keys are refused by name; command-line flags override the file.
"""

from __future__ import annotations

import json
import os
import tomllib

import h5py

from pricer.errors import InputError
from pricer.generate import generate
from pricer.portfolio import GROUP, write_portfolio

KEYS = {
    "portfolio": {"path", "generate"},
    "portfolio.generate": {"dist", "count", "seed", "steps", "exercise", "min_steps", "max_steps"},
    "pricing": {"backend", "tree", "partition", "distribute", "threads", "t1", "t2"},
    "output": {"path", "overwrite"},
}
REQUIRED = (("portfolio", "path"), ("output", "path"))


def load_job(path: str) -> dict:
    """The job as a nested dict, checked for unknown or missing keys (InputError names them)."""
    try:
        with open(path, "rb") as f:
            job = tomllib.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: no such job file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid TOML: {exc}") from None
    _check_keys(path, job)
    for table, key in REQUIRED:
        if key not in job.get(table, {}):
            raise InputError(f"{path}: missing key {table}.{key}")
    return job


def _check_keys(path: str, job: dict) -> None:
    unknown = sorted(set(job) - {"portfolio", "pricing", "output"})
    if unknown:
        raise InputError(f"{path}: unknown table(s) {', '.join(unknown)}; known: portfolio, pricing, output")
    for table in ("portfolio", "pricing", "output"):
        section = job.get(table, {})
        if not isinstance(section, dict):
            raise InputError(f"{path}: {table} must be a table")
        for key in section:
            if key not in KEYS[table]:
                raise InputError(f"{path}: unknown key {table}.{key}; known: {', '.join(sorted(KEYS[table]))}")
    for key in job.get("portfolio", {}).get("generate", {}):
        if key not in KEYS["portfolio.generate"]:
            raise InputError(f"{path}: unknown key portfolio.generate.{key}; known: "
                             f"{', '.join(sorted(KEYS['portfolio.generate']))}")


def ensure_generated(portfolio_path: str, spec: dict) -> bool:
    """Write the generated portfolio unless the file already holds exactly this one. True if written."""
    missing = [key for key in ("dist", "count") if key not in spec]
    if missing:
        raise InputError(f"portfolio.generate: missing key(s) {', '.join(missing)}")
    stamp = json.dumps(spec, sort_keys=True)
    if os.path.exists(portfolio_path):
        try:
            with h5py.File(portfolio_path, "r") as f:
                if f[GROUP].attrs.get("generated_by") == stamp:
                    return False
        except (OSError, KeyError):
            pass
    try:
        portfolio = generate(**spec)
    except TypeError as exc:
        raise InputError(f"portfolio.generate: {exc}") from None
    write_portfolio(portfolio_path, portfolio, attrs={"generated_by": stamp})
    return True
