"""The run: SPMD over the ranks of a communicator (size 1 without mpiexec), one pipeline
(pipeline.py) for every instrument family the input holds (families.py: its option book, its bond
options, a plug-in's family), written to one file.

1. agree: every rank expands the paths and loads the plug-in families; rank 0 finds the file's
   families, checks the settings and claims the output (held until it is written) and reads the
   input's hash beside the run; one verdict.
2. prepare: every family is planned and every rank's rows of it read and checked, before any of
   them is priced (a bad row of one family refuses the file before any work).
3. finish: every family is priced, judged and gathered to rank 0, which writes one results file
   (parts.py) and returns the summary.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from pricer.errors import InputError
from pricer.files import check_input_file, check_output_file, claim as claim_outputs
from pricer.io.checkpoint import entry_kind
from pricer.io.formats import HDF5, output_format
from pricer.io.results import check_output_path, sha256_beside
from pricer.model.greeks import Analytics
from pricer.model.validity import PRICED, reasons_text
from pricer.engines import resolve_backend, set_local_rank
from pricer.run import bond_family, option_family  # noqa: F401 - they register their families
from pricer.run.collectives import (ROOT, attempt, check_launcher, node_ranks, outcome, verdict,
                                    world)
from pricer.run.config import RunConfig, configure_threads, threads_text
from pricer.run.families import families, families_in, family
from pricer.run.faults import WRITE, inject, planned_faults
from pricer.run.parts import Parts, refuse_options_settings, write_file
from pricer.run.pipeline import checkpoint_folder, finish_family, prepare_family

STAGES = ("read", "distribute", "setup", "compute", "gather", "write")


@dataclass
class RunSummary:
    options: int
    nodes: float
    ranks: int
    backend: str
    wall: float
    stages: dict = field(default_factory=dict)
    analytics: Analytics = Analytics()
    reused: int = 0  # options read back from the checkpoint instead of priced
    read_parts: dict = field(default_factory=dict)  # rank 0's read stage, part by part
                                                    # (pipeline.prepare_family)
    notes: list = field(default_factory=list)  # e.g. chunks shrunk to fit the GPUs' memory
    rank_seconds: list = field(default_factory=list)   # each rank's compute stage
    threads: list = field(default_factory=list)        # each rank's CPU threads
    parts: list = field(default_factory=list)   # the file's other families' results
                                                # (parts.FamilyResults), if any

    @property
    def compile(self) -> float:
        """Rank 0's seconds of kernel compilation (pricer/compiling.py), apart from its stages."""
        return self.stages.get("compile", 0.0)

    def lines(self) -> list[str]:
        # nodes per second of the pricing, not of a first run's compile
        seconds = self.wall - self.compile
        rate = self.nodes / seconds if seconds > 0 else float("nan")
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in self.stages.items())
        grid = self.analytics.scenarios
        extras = [what for what, on in (("Greeks", self.analytics.greeks),
                                        ("Richardson extrapolation", self.analytics.richardson),
                                        (f"{grid.count if grid else 0} scenarios", grid)) if on]
        extras = f" with {' and '.join(extras)}" if extras else ""
        if self.reused:
            extras += f" ({self.reused} of them from the checkpoint)"
        what = "solved the implied volatilities of" if self.analytics.implied else "priced"
        lines = [f"{what} {self.options} options{extras} ({self.nodes:.4g} nodes) on {self.ranks} "
                 f"rank(s){threads_text(self.threads)} with backend {self.backend} in "
                 f"{self.wall:.3f}s ({rate:.3g} nodes/s"
                 f"{', compile excluded' if self.compile else ''})",
                 f"stages: {stages}"]
        if self.read_parts:
            parts = self.read_parts
            lines.append(f"read stage: plan {parts['plan']:.3f}s beside the engine start "
                         f"{parts['engine']:.3f}s, device fit {parts['fit']:.3f}s, the ranks' "
                         f"agreement {parts['agree']:.3f}s")
        return lines + list(self.notes)

    def record(self) -> dict:
        """The summary as data (`--summary-json`, pricer scaling): the family, the counts, the
        wall, every stage's seconds on rank 0 (compile apart from the others) and each rank's
        compute seconds; a file's other families, where it has them, under their names
        ("bonds")."""
        out = {"family": "options", "task": "implied-vol" if self.analytics.implied else "price",
               "instruments": self.options, "nodes": self.nodes, "ranks": self.ranks,
               "backend": self.backend, "wall": self.wall, "stages": dict(self.stages),
               "rank_seconds": list(self.rank_seconds), "threads": list(self.threads),
               "reused": self.reused}
        for part in self.parts:
            out[part.family.name] = part.record()
        return out


def run(cfg: RunConfig, comm=None, prepare=None):
    """Price cfg.input into cfg.output on every rank of comm; returns the summary on rank 0
    (RunSummary where the file has options; else its family's results, parts.Parts for
    several). `prepare`, if given, runs on rank 0 first (a job's portfolio generation).
    Implied volatilities are the options' alone: a file's other families are then left out."""
    comm = comm or world()
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    ranks_here, local_rank = node_ranks(comm)
    set_local_rank(local_rank)            # the GPU of this rank, where the launcher says nothing
    # every rank expands the paths alike ({array_task}) and loads the plug-in families
    # (families.PRICER_PLUGINS): one verdict if it cannot
    _, status, message, failure = attempt(lambda: (cfg.expand_placeholders(), families()))
    verdict(comm, status, message)
    if failure is not None:
        raise failure
    if prepare is not None:     # the input is made before anyone reads it
        outcome(comm, prepare if rank == ROOT else None)
    names = [f.name for f in families_in(cfg.input)] if rank == ROOT else None
    found = [family(name) for name in comm.bcast(names, root=ROOT)] or [family("options")]
    notes = []
    if cfg.implied and found[0].top_level and len(found) > 1:
        notes.append(f"{cfg.input}'s {' and '.join(f.noun for f in found[1:])} (/"
                     f"{', /'.join(f.group for f in found[1:])}) were not priced: implied "
                     "volatilities are solved for its options")
        found = found[:1]
    locks = []

    def agree():
        check_launcher(size)
        cfg.check()
        if not found[0].top_level:
            refuse_options_settings(cfg, found)
        if len(found) > 1 and output_format(cfg.output) != HDF5:
            what = f"options and {' and '.join(f.noun for f in found[1:])}" \
                if found[0].top_level else "several instrument families"
            raise InputError(f"{cfg.output}: a book of {what} is written to HDF5 only (.h5), "
                             "each in its own group")
        check_input_file(cfg.input)   # before the hash is read beside the run: a FIFO never ends
        check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
        check_checkpoint_paths(cfg, [checkpoint_folder(cfg, fam, fam is found[0])
                                     for fam in found])
        locks.extend(claim(cfg))
        # the file's hash (for the results and checkpoints), read beside the parsing and beyond
        return sha256_beside(cfg.input)

    digest, status, message, failure = attempt(agree) if rank == ROOT else (None, 0, None, None)
    try:
        verdict(comm, status, message)
        if failure is not None:
            raise failure
        # a GPU run's threads only feed its GPU: warned of where the CPU prices
        configure_threads(cfg.threads, ranks_here, warn=rank == ROOT and cfg.progress
                          and resolve_backend(cfg.backend) == "cpu")
        ready = [prepare_family(fam, cfg, comm, ranks_here, digest,
                                checkpoint_folder(cfg, fam, fam is found[0])) for fam in found]
        results = [finish_family(part, cfg, comm) for part in ready]
        if rank != ROOT:
            return None
        inject(planned_faults(rank), rank, WRITE)
        t = time.perf_counter()
        write_file(cfg, results, digest, size, t - t_start)
        written = time.perf_counter()
        for part in results:
            part.seconds["write"] = written - t
            part.elapsed = written - t_start
        return _summary(cfg, results, notes)
    finally:
        for lock in locks:
            lock.release()


def check_checkpoint_paths(cfg: RunConfig, folders: list) -> None:
    """InputError unless each checkpoint folder (one per family: pipeline.checkpoint_folder) is a
    path of its own — not the input, not the output, nor a folder the output is in (the run
    would price everything, then fail to write or refuse its own folder) — and is a folder or
    can be made one: its parent exists, and it is a directory where it exists."""
    where = os.path.realpath
    for folder in filter(None, folders):
        if where(folder) == where(cfg.input):
            raise InputError(f"{folder}: --checkpoint names the input; give the checkpoint a "
                             f"folder of its own")
        if where(folder) == where(cfg.output):
            raise InputError(f"{folder}: --checkpoint names the output (-o {cfg.output}); give "
                             f"the checkpoint a folder of its own")
        if where(cfg.output).startswith(where(folder).rstrip(os.sep) + os.sep):
            raise InputError(f"{cfg.output}: the output is inside the checkpoint folder "
                             f"{folder}; write it elsewhere")
        parent = os.path.dirname(os.path.abspath(folder))
        if not os.path.isdir(parent):
            raise InputError(f"{folder}: folder {parent} does not exist")
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise InputError(f"{folder}: is {entry_kind(folder) or 'a regular file'}; "
                             f"--checkpoint names a folder (a new one, an empty one, or one that "
                             f"holds this run's checkpoint)")


def claim(cfg: RunConfig) -> list:
    """The output, and the checkpoint folder if any, claimed for this run (files.claim); the
    output's checks made again under the claim, since a run that held it until now may have
    written it."""
    def recheck() -> None:
        check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
        if cfg.summary_json:     # written at the end: refused now rather than after the work
            check_output_file(cfg.summary_json, cfg.overwrite, "summary")

    return claim_outputs(filter(None, (cfg.output, cfg.checkpoint)), recheck)


def _summary(cfg: RunConfig, results: list, notes: list):
    """Rank 0's summary of the run's results (run's doc)."""
    top = results[0] if results[0].family.top_level else None
    if top is None:
        return results[0] if len(results) == 1 else Parts(results)
    parts = results[1:]
    lines = top.notes + [line for part in parts for line in part.lines()]
    status = top.status
    if cfg.implied:
        from pricer.model.implied import statuses_text
        lines.append(f"statuses: {statuses_text(status)}")
    elif cfg.invalid == "skip":
        skipped = int((status != PRICED).sum())
        lines.append(f"--invalid skip: {skipped} of {len(status)} options not priced"
                     + (f" ({reasons_text(status)})" if skipped else ""))
    lines += notes
    return RunSummary(options=int(top.ids.size), nodes=top.work, ranks=top.ranks,
                      backend=top.backend, wall=top.wall, stages=top.seconds,
                      analytics=cfg.analytics(), reused=top.reused, read_parts=top.read_parts,
                      notes=lines, rank_seconds=list(top.rank_seconds),
                      threads=[int(t) for t in top.threads], parts=parts)


