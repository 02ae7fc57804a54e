"""Job specs: a TOML file that says everything about a run (`pricer run JOB.toml`).

    [portfolio]            path = "book.h5"          (the input; relative paths are from the CWD)
    [portfolio.generate]   dist, count, seed, steps, exercise, min_steps, max_steps
                           (optional: rank 0 writes `path` from these first, unless it already holds
                           exactly this generated portfolio: pricer.tools.generate)
    [pricing]              backend, tree, partition, distribute, threads, t1, t2, greeks, richardson,
                           invalid, stall_timeout, task ("price", or "implied-vol": solve for
                           the volatilities of a book with market prices)
    [output]               path, overwrite
    [scenarios]            spot, volatility, rate, days: each "FIRST:LAST:COUNT", "x,y,z" or an
                           array of numbers (pricer.model.scenarios)

Unknown tables and keys are refused by name here; the values' types and ranges are checked by
pricer.run.config.RunConfig (the one place they live), naming the key; command-line flags override
the file.
"""

from __future__ import annotations

import tomllib

from pricer.errors import InputError
from pricer.files import check_input_file

KEYS = {
    "portfolio": {"path", "generate"},
    "portfolio.generate": {"dist", "count", "seed", "steps", "exercise", "min_steps", "max_steps"},
    "pricing": {"backend", "tree", "partition", "distribute", "threads", "t1", "t2", "greeks",
                "richardson", "invalid", "stall_timeout", "task"},
    "output": {"path", "overwrite"},
    "scenarios": {"spot", "volatility", "rate", "days"},
}
REQUIRED = (("portfolio", "path"), ("output", "path"))
GENERATE_TYPES = {"dist": str, "count": int, "seed": int, "steps": int, "exercise": str,
                  "min_steps": int, "max_steps": int}
# RunConfig field -> (table, key) of the job file (pricer.run.config.RunConfig.from_job)
JOB_KEYS = {"input": ("portfolio", "path"), "output": ("output", "path"),
            "overwrite": ("output", "overwrite"),
            **{key: ("pricing", key) for key in ("backend", "tree", "partition", "distribute",
                                                 "threads", "t1", "t2", "greeks", "richardson",
                                                 "invalid", "stall_timeout", "task")}}


def load_job(path: str) -> dict:
    """The job as a nested dict, checked for unknown or missing keys (InputError names them)."""
    check_input_file(path, "job file")
    try:
        with open(path, "rb") as f:
            job = tomllib.load(f)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the job file: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid TOML: {exc}") from None
    _check_keys(path, job)
    for table, key in REQUIRED:
        if key not in job.get(table, {}):
            raise InputError(f"{path}: missing key {table}.{key}")
    for key, value in job["portfolio"].get("generate", {}).items():
        kind = GENERATE_TYPES[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InputError(f"{path}: portfolio.generate.{key} must be "
                             f"{'a whole number' if kind is int else 'a string'}, got {value!r} "
                             f"({type(value).__name__})")
    return job


def _check_keys(path: str, job: dict) -> None:
    tables = ("portfolio", "pricing", "output", "scenarios")
    unknown = sorted(set(job) - set(tables))
    if unknown:
        raise InputError(f"{path}: unknown table(s) {', '.join(unknown)}; known: "
                         f"{', '.join(tables)}")
    for table in tables:
        section = job.get(table, {})
        if not isinstance(section, dict):
            raise InputError(f"{path}: {table} must be a table")
        for key in section:
            if key not in KEYS[table]:
                raise InputError(f"{path}: unknown key {table}.{key}; known: {', '.join(sorted(KEYS[table]))}")
    spec = job.get("portfolio", {}).get("generate", {})
    if not isinstance(spec, dict):
        raise InputError(f"{path}: portfolio.generate must be a table")
    for key in spec:
        if key not in KEYS["portfolio.generate"]:
            raise InputError(f"{path}: unknown key portfolio.generate.{key}; known: "
                             f"{', '.join(sorted(KEYS['portfolio.generate']))}")
