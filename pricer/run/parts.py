"""A run's results, family by family (pipeline.finish_family), and the one file rank 0 writes of
them: the top-level family's (the option book's) as /results' own columns, every other family's
as /results/<name> (io/results.write_results' tables)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from pricer.errors import InputError, OutputError
from pricer.io.results import utc_now, write_results
from pricer.model.validity import reasons_text
from pricer.run.config import kept, threads_text


@dataclass
class FamilyResults:
    """Rank 0's results of a family's run, in the book's order."""
    family: object              # families.Family
    ids: np.ndarray
    values: np.ndarray          # (rows, outputs) float64: `names`
    names: tuple                # Family.columns of the run: price, ..., status (if any) last
    work: float                 # the family's work priced (Family.work: tree nodes, say)
    ranks: int
    backend: str
    seconds: dict = field(default_factory=dict)
    reused: int = 0             # read back from the checkpoint
    notes: list = field(default_factory=list)
    rank_seconds: list = field(default_factory=list)    # each rank's compute stage
    threads: list = field(default_factory=list)         # each rank's CPU threads
    rank_rows: list = field(default_factory=list)       # each rank's rows priced
    rank_work: list = field(default_factory=list)       # each rank's work priced
    attrs: dict = field(default_factory=dict)           # the results file's provenance of it
    described: list = field(default_factory=list)       # Family.describe of each rank's book
    hosts: list | None = None
    gpus: list | None = None
    read_parts: dict = field(default_factory=dict)      # the plan stage's parts (seconds)
    elapsed: float | None = None    # the part's wall time, from its start to its write's end

    @property
    def status(self) -> np.ndarray:
        if "status" not in self.names:
            return np.zeros(self.ids.size, dtype=np.int8)
        return self.values[:, self.names.index("status")].astype(np.int8)

    def table(self) -> dict:
        """The results' columns (write_results' family tables): id, then the outputs."""
        out = {"id": self.ids}
        for j, name in enumerate(self.names):
            out[name] = self.values[:, j].astype(np.int8) if name == "status" \
                else self.values[:, j]
        return out

    @property
    def wall(self) -> float:
        """The part's wall time: what passed, not only its stages (the claim and checks too)."""
        return self.elapsed if self.elapsed is not None else sum(self.seconds.values())

    def lines(self) -> list[str]:
        fam = self.family
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.seconds.items())
        lines = [f"priced {int((self.status == 0).sum())} {fam.noun} ({self.work:.4g} "
                 f"{fam.work}) on {self.ranks} rank(s){threads_text(self.threads)} with backend "
                 f"{self.backend} in {self.wall:.3f}s"
                 + (f" ({self.reused} of them from the checkpoint)" if self.reused else ""),
                 f"{fam.label} stages: {stages}"]
        skipped = int((self.status != 0).sum())
        if skipped:
            lines.append(f"--invalid skip: {skipped} of {self.status.size} {fam.noun} not "
                         f"priced ({reasons_text(self.status, fam.reasons)})")
        return lines + self.notes

    def record(self) -> dict:
        """The summary as data (driver.RunSummary.record's keys)."""
        return {"family": self.family.name, "task": "price", "instruments": int(self.ids.size),
                "nodes": self.work, "ranks": self.ranks, "backend": self.backend,
                "wall": self.wall, "stages": dict(self.seconds),
                "rank_seconds": list(self.rank_seconds), "threads": list(self.threads),
                "reused": self.reused}


@dataclass
class Parts:
    """Rank 0's summary of a file of several families other than options."""
    parts: list                 # FamilyResults

    def lines(self) -> list[str]:
        return [line for part in self.parts for line in part.lines()]

    def record(self) -> dict:
        """The first family's record, the others' under their names (RunSummary.record's)."""
        out = self.parts[0].record()
        out.update({part.family.name: part.record() for part in self.parts[1:]})
        return out


def refuse_options_settings(cfg, found: list) -> None:
    """InputError where the settings that apply to options alone (implied-vol, --greeks, ...)
    are given for a file of the families `found` and no options."""
    unsupported = [flag for flag, on in (("implied-vol", cfg.implied), ("--greeks", cfg.greeks),
                                         ("--richardson", cfg.richardson),
                                         ("scenarios", cfg.scenarios)) if on]
    if unsupported and any(family.options_only for family in found):
        raise InputError(f"{cfg.input}: holds {' and '.join(f.noun for f in found)} only; "
                         f"{', '.join(unsupported)} apply to options (/portfolio)")


def write_file(cfg, results: list, digest, size: int, wall: float) -> None:
    """Rank 0: every family's results in one file (module doc), with the run's provenance. A
    failure says what was kept (OutputError)."""
    try:
        input_sha256 = digest.result()      # read beside the run (sha256_beside)
    except OSError as exc:
        raise OutputError(f"{cfg.input}: the input could not be read again for its sha256 "
                          f"({exc.strerror or exc}), so the results were not written; "
                          f"{kept(cfg)}") from None
    top = next((r for r in results if r.family.top_level), None)
    attrs = {}
    for part in results:
        if part is not top:
            attrs.update(part.attrs)
    if top is not None:
        written = top.family.written(cfg, top)
        attrs.update(written.pop("attrs"))
    else:
        written = {"ids": None, "prices": None, "run_stats": {"ranks": np.array([size])}}
        attrs["backend"] = results[0].backend
    attrs.update({"ranks": size, "wall_seconds": wall, "utc_time": utc_now(),
                  "input_sha256": input_sha256, "input_path": os.path.abspath(cfg.input),
                  "invalid": cfg.invalid, "task": cfg.task})
    tables = {r.family.name: (r.table(), r.family.units) for r in results if r is not top}
    try:
        write_results(cfg.output, written.pop("ids"), written.pop("prices"), attrs,
                      written.pop("run_stats"), tables=tables, **written)
    except OSError as exc:      # a disk that filled since the check, a quota, a lost mount
        raise OutputError(f"{cfg.output}: the results could not be written "
                          f"({exc.strerror or exc}); {kept(cfg)}") from None
