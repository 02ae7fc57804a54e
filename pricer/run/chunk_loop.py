"""The harness of a rank's chunk loop, whatever the chunks price (options' lattices, bond
options' trees): each finished chunk saved to the checkpoint, counted by the stall watchdog and
the progress display, the injected faults' points passed; a failure reported to rank 0, which
names the rank and ends the job (faults.py); the ranks' meeting once every chunk is done.

    loop = ChunkLoop(comm, cfg, limits_nodes, shown_nodes, progress)
    try:
        loop.attach(folder)            # the checkpoint, if any
        ...set-up...
        loop.start()
        for k in ...:
            ...price chunk k...
            loop.finished(k, chunk, values)
    except Exception as exc:
        loop.failed(exc)
    loop.end()
"""

from __future__ import annotations

from pricer.io.checkpoint import Checkpoint
from pricer.run.faults import END, FailureWatch, abort_job, chunk_delay, inject, planned_faults
from pricer.run.progress import Progress
from pricer.run.watchdog import StallWatch, chunk_limit, chunk_limits


class ChunkLoop:
    """One rank's loop over its chunks. `work`: each chunk's nodes as the watchdog's limits count
    them; `shown`: as the progress display counts them (None: `work`)."""

    def __init__(self, comm, cfg, work: list, shown: list | None = None,
                 progress: Progress | None = None):
        self.rank = comm.Get_rank()
        self.watch, self.faults = FailureWatch(comm), planned_faults(self.rank)
        self.stall = StallWatch(comm, cfg.stall_timeout,
                                lambda message: abort_job(comm, message, in_thread=True))
        self.limits = chunk_limits(work, cfg.stall_timeout)
        self.stall.begin(self.limits[0] if self.limits else chunk_limit(0, cfg.stall_timeout))
        self.shown = work if shown is None else shown
        self.progress = progress or Progress()
        self.checkpoint = None
        self.done = 0

    def attach(self, folder: str | None) -> None:
        """Save the chunks to the checkpoint in `folder` (None: none)."""
        if folder:
            self.checkpoint = Checkpoint(folder).attach()

    def start(self) -> None:
        """The pricing begins (after the set-up): the progress clock, the first fault point, a
        look at the other ranks' failures."""
        self.progress.start()
        inject(self.faults, self.rank, self.done)
        self.watch.poll()

    def finished(self, k: int, chunk: int, values) -> None:
        """The rank's chunk k (the checkpoint's chunk `chunk`) is priced, its rows `values`."""
        if self.checkpoint is not None:
            self.checkpoint.save(chunk, values)
        self.done += 1
        self.stall.done(chunk)
        self.progress.chunk_done(self.shown[k])
        chunk_delay()
        inject(self.faults, self.rank, self.done)
        if self.done < len(self.limits):
            self.watch.poll()
            self.stall.begin(self.limits[self.done])

    def failed(self, exc: BaseException) -> None:
        """Report `exc` to rank 0, which ends the job (FailureWatch.failed raises SystemExit)."""
        try:
            self.watch.failed(self.done, exc)
        finally:              # alone, failed() raises SystemExit: the watchdog must not outlive it
            self.stall.abandon()

    def abandon(self) -> None:
        """The loop left by an interrupt (not a failure to report): its watchdog stopped."""
        self.stall.abandon()

    def end(self) -> None:
        """Every chunk done: the last fault point, then the ranks meet, so that rank 0's gather
        is the gather, not the wait for the slowest rank (it shows the progress meanwhile)."""
        self.stall.finished()
        inject(self.faults, self.rank, END)
        self.watch.barrier(idle=self.progress.poll)
        self.stall.stop()
        self.progress.finish()
