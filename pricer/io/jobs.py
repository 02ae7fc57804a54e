"""Job specs: a TOML file that says everything about a run (`pricer run JOB.toml`).

    [portfolio]            path = "book.h5"          (the input; relative paths are from the CWD)
    [portfolio.generate]   dist, count, seed, steps, exercise, min_steps, max_steps
                           (optional: rank 0 writes `path` from these first, unless it already holds
                           exactly this generated portfolio, with the checks and the claim of
                           `pricer generate`; a run then refused removes it: pricer.tools.generate)
    [pricing]              backend, tree, partition, distribute, threads, t1, t2, greeks, richardson,
                           invalid, stall_timeout, task ("price", or "implied-vol": solve for
                           the volatilities of a book with market prices)
    [output]               path, overwrite
    [scenarios]            spot, volatility, rate, days: each "FIRST:LAST:COUNT", "x,y,z" or an
                           array of numbers (pricer.model.scenarios)

Unknown tables and keys are refused by name here; the values' types and ranges are checked by
pricer.run.config.RunConfig (the one place they live), naming the key; command-line flags override
the file. SCHEMA lists every key once: the checks here, RunConfig.from_job's mapping and
docs/jobs.md's table (key_table) come from it. The checks stay written out rather than in a schema
library (pydantic, jsonschema): RunConfig checks the same settings from the command line and the
API with the same messages, naming the file and the key, and a run imports no more than it needs.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

from pricer.errors import InputError
from pricer.files import check_input_file

@dataclass(frozen=True)
class Key:
    """One key of a job file: where it goes (the RunConfig field, or a generator setting), and what
    docs/jobs.md says of it (its table is made from these: key_table)."""
    name: str                 # "table.key"
    kind: str                 # the value's type, as the docs say it
    default: str              # the default, as the docs say it
    flag: str = "—"           # the command-line flag that overrides it
    same: str = ""            # what it is in `pricer price` / `pricer generate`
    field: str | None = None  # the RunConfig field it sets (None: not a run setting)
    python: type | None = None  # portfolio.generate: the type checked here

    @property
    def table(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def key(self) -> str:
        return self.name.rsplit(".", 1)[1]


_REQUIRED = "— (required)"
_IN_TABLE = "— (required if the table is there)"
_TASK = "string (`{array_task}`: the Slurm array task's id)"
_AXIS = "string `FIRST:LAST:COUNT` or `x,y,z`, or an array of numbers"
SCHEMA = (
    Key("portfolio.path", _TASK, _REQUIRED, same="the `IN.h5` argument", field="input"),
    Key("portfolio.generate.dist", "string", _IN_TABLE, same="`generate --dist`", python=str),
    Key("portfolio.generate.count", "integer", _IN_TABLE, same="`generate --count`", python=int),
    Key("portfolio.generate.seed", "integer", "0", same="`generate --seed`", python=int),
    Key("portfolio.generate.steps", "integer", "1000", same="`generate --steps`", python=int),
    Key("portfolio.generate.exercise", "string", '`"mixed"`', same="`generate --exercise`",
        python=str),
    Key("portfolio.generate.min_steps", "integer", "16", same="`generate --min-steps`",
        python=int),
    Key("portfolio.generate.max_steps", "integer", "4096", same="`generate --max-steps`",
        python=int),
    Key("pricing.backend", "string", '`"auto"`', "`--backend`", "`price --backend`", "backend"),
    Key("pricing.tree", "string", '`"crr"`', "`--tree`", "`price --tree`", "tree"),
    Key("pricing.partition", "string", '`"cost"`', "`--partition`", "`price --partition`",
        "partition"),
    Key("pricing.distribute", "string", '`"scatter"`', "`--distribute`", "`price --distribute`",
        "distribute"),
    Key("pricing.threads", "integer", "per rank: `SLURM_CPUS_PER_TASK`, else the cores this rank "
        "may run on (its CPU affinity) ÷ ranks on the node (at least 1)", "`--threads`",
        "`price --threads`", "threads"),
    Key("pricing.t1", "integer ≥ 0", "the GPU's cached calibration, else 200000", "`--t1`",
        "`price --t1`", "t1"),
    Key("pricing.t2", "integer ≥ 0", "the GPU's cached calibration, else 500", "`--t2`",
        "`price --t2`", "t2"),
    Key("pricing.greeks", "boolean", "`false`", "`--greeks` / `--no-greeks`", "`price --greeks`",
        "greeks"),
    Key("pricing.richardson", "boolean", "`false`", "`--richardson` / `--no-richardson`",
        "`price --richardson`", "richardson"),
    Key("pricing.invalid", "string", '`"refuse"`', "`--invalid`", "`price --invalid`",
        "invalid"),
    Key("pricing.task", "string", '`"price"`', "—", "`pricer implied-vol` (for `\"implied-vol\"`)",
        "task"),
    Key("pricing.stall_timeout", "number of seconds ≥ 1",
        "120 s + each chunk's lattice nodes ÷ 10⁸ per second", "`--stall-timeout`",
        "`price --stall-timeout`", "stall_timeout"),
    Key("pricing.bond_spacing", "string", '`"variance"`', "`--bond-spacing`",
        "`price --bond-spacing`", "bond_spacing"),
    Key("scenarios.spot", _AXIS, "`[0]`", "`--scenario-spot`", "`price --scenario-spot`"),
    Key("scenarios.volatility", "the same", "`[0]`", "`--scenario-volatility`",
        "`price --scenario-volatility`"),
    Key("scenarios.rate", "the same", "`[0]`", "`--scenario-rate`", "`price --scenario-rate`"),
    Key("scenarios.days", "the same", "`[0]`", "`--scenario-days`", "`price --scenario-days`"),
    Key("output.path", _TASK, _REQUIRED, "`-o` / `--output`", "`price -o`", "output"),
    Key("output.overwrite", "boolean (`true`/`false` only: a string or number is refused)",
        "`false`", "`--overwrite`", "`price --overwrite`", "overwrite"),
)
TABLES = ("portfolio", "pricing", "output", "scenarios")
KEYS = {table: {k.key for k in SCHEMA if k.table == table}
        for table in ("portfolio.generate", *TABLES)}
KEYS["portfolio"].add("generate")
REQUIRED = tuple((k.table, k.key) for k in SCHEMA
                 if k.default == _REQUIRED)
GENERATE_TYPES = {k.key: k.python for k in SCHEMA if k.table == "portfolio.generate"}
# RunConfig field -> (table, key) of the job file (pricer.run.config.RunConfig.from_job)
JOB_KEYS = {k.field: (k.table, k.key) for k in SCHEMA if k.field is not None}


def key_table() -> list[str]:
    """docs/jobs.md's table of the keys (`python -m pricer.io.jobs` prints it)."""
    lines = ["| key | type | default | command-line flag | same as in `pricer price` / "
             "`pricer generate` |", "|---|---|---|---|---|"]
    return lines + [f"| `{k.name}` | {k.kind} | {k.default} | {k.flag} | {k.same or '—'} |"
                    for k in SCHEMA]


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
    tables = TABLES
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


if __name__ == "__main__":
    print("\n".join(key_table()))
