"""The batch runner: whole books per launch on the GPU (cuda/batch.cu), scheduled by batch_plan.py,
for options of at most MAX_STEPS steps; the GPU engines (engine.py) route those options here.

Data movement per chunk (batch_plan.chunk_bounds: runs of rows in the order given): the chunk's
rows are copied as they are into a page-locked input buffer (batch_layout.py:
INPUT_BYTES_PER_OPTION per option, with the chunk's sorted order) and on to the device
asynchronously. The rows are sorted by their class keys, descending, and one launch per class
prices them:
- in chunks of WIDTH_ROWS rows or more, on the GPU (cuda/batch.cu): a small kernel keys each
  American row by the width of its payoff (an option needs registers only for its nodes up to the
  last positive payoff, zero_clamp) and every other row by its steps, counts the rows per key, and
  two more write the sorted order in place; only the counts (64 KiB) come back, from which the host
  makes the launches (batch_plan.counted_schedule);
- in smaller ones, on the host by the steps (batch_plan.schedule) before the input, order
  included, goes in one copy; a one-class chunk of W >= 2 over a wave goes to the G of its
  widest payoff (widest_payoff) where that holds it in one wave
  (batch_plan.one_wave_by_width); where one launch holds the chunk in one wave with several
  blocks per SM, a small kernel then writes the order over the copied one, heaviest first by an
  estimate of each option's work, so that the SMs' shares even out (batch_plan.heaviest_first;
  cuda/batch.cu, batch_work_order).
The launches run side by side on their own streams (a lone launch on the chunk's own); each reads
its rows through the order and writes each price at its row, and the prices (8 bytes per option)
come back asynchronously, already in the order given. An option that the class of its width cannot
price comes back NaN and is priced again in the class of its steps. Two buffer sets and two streams
alternate, so the host fills chunk k + 1 while chunk k computes; a portfolio of any size streams
through 2 chunks of device memory. They alternate across calls too: start() returns once a call's
chunks are launched and finish() brings its prices home, so that the caller can fill and start its
next call between the two (the implied-volatility search's groups, pricer/model/implied_pool.py).

`last_stats` keeps the event times of the last finished call (seconds: copies in, kernels, copies
out, summed over chunks; and the wall time of the whole call) for `pricer bench batch`. The events
of the last two chunks are read only when `last_stats` is: three driver calls a chunk that a
pricing call does not need, and only the bench reads them.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pricer.engines.base import Engine, sample_params
from pricer.engines.gpu.batch_layout import (INPUT_BYTES_PER_OPTION, KEY_BINS, SORT_BLOCK,
                                             SORT_THREADS, WORK_ORDER_THREADS, WORK_RANK_LANES,
                                             defines, fill_input, input_views, order_span)
from pricer.engines.gpu.batch_plan import (DEFAULT_CHUNK_OPTIONS, KERNELS, WARPS, WIDTH_ROWS,
                                           Launch, chunk_bounds, check_steps, chunk_size,
                                           class_of, counted_schedule, heaviest_first,
                                           options_per_block, schedule, widest_payoff)
from pricer.engines.gpu.runtime import GpuRuntime, resident_blocks
from pricer.model.lattice import LEVEL_VALUES, LatticeParams

LAUNCH_STREAMS = 8     # streams the launches of one chunk spread over
WARM_UP_STEPS = 64     # the option every kernel prices once in warm_up


class CudaBatchRunner(Engine):
    """Prices options (all with steps <= MAX_STEPS) with the batch kernels on this rank's GPU."""

    name = "batch runner"
    uses_gpu = True

    def __init__(self, runtime=None, chunk_options: int = DEFAULT_CHUNK_OPTIONS):
        self.rt = runtime or GpuRuntime.get()
        self.chunk_options = int(chunk_options)
        self._defines = defines()
        self._modules: dict = {}
        self._functions: dict = {}
        self._sort_fns = None
        self._resident: dict = {}
        self._buffers = None
        self._streams = None
        self._launch_streams: list = []     # (stream, event its launches' end is recorded in)
        self._keep_levels = False
        self._stats: dict = {}
        self._unread: dict = {}     # buffer set -> (call's times, marks, ready) not read yet
        self._held: dict = {}       # buffer set -> (its call, its chunk) whose prices are out
        self._turn = 0              # the buffer set the next chunk takes

    def variants(self) -> list:
        """The (defines, source) of every module the runner may load: one per warp count."""
        return [([f"-DBATCH_W={warps}", *self._defines], "batch.cu") for warps in WARPS]

    def function(self, cls: int):
        """The kernel KERNELS[cls] (its module, one per warp count W, is compiled on first use)."""
        if cls not in self._functions:
            warps, groups = KERNELS[cls]
            module = self.rt.module([f"-DBATCH_W={warps}", *self._defines], "batch.cu")
            self._modules[warps] = module
            fn = module.get_function(f"batch_kernel_g{groups}")
            fn.prepare("PiiPPi")
            self._functions[cls] = fn
        return self._functions[cls]

    def resident(self, cls: int) -> int:
        """Options of kernel KERNELS[cls] that the GPU holds at once (0 where it cannot say)."""
        if cls not in self._resident:
            warps = KERNELS[cls][0]
            per_block = options_per_block(warps)
            try:
                held = resident_blocks(self.rt, self.function(cls), warps * per_block) * per_block
            except Exception:  # noqa: BLE001 -- a runtime without occupancy figures
                held = 0
            self._resident[cls] = held
        return self._resident[cls]

    @property
    def last_stats(self) -> dict:
        """The last finished call's event times and counts (see the module's docstring)."""
        for slot in list(self._unread):
            self._read_events(slot)
        return self._stats

    @last_stats.setter
    def last_stats(self, stats: dict) -> None:
        for slot in list(self._unread):
            self._read_events(slot)
        self._stats = stats

    def _read_events(self, slot: int) -> None:
        """The event times of the chunk last brought home from buffer set `slot` without them,
        into its call's times (before the set's events are recorded again)."""
        stats, marks, ready = self._unread.pop(slot)
        self._add_event_times(stats, marks, ready)

    @staticmethod
    def _add_event_times(stats: dict, marks, ready) -> None:
        seconds = lambda a, b: b.time_since(a) / 1e3  # noqa: E731
        stats["copy_in"] += seconds(marks[0], marks[1])
        stats["kernels"] += seconds(ready, marks[3])
        stats["copy_out"] += seconds(marks[3], marks[4])

    def _ensure_buffers(self, size: int, with_levels: bool):
        cuda = self.rt.cuda
        if (self._buffers is None or self._buffers[0]["capacity"] < size
                or (with_levels and self._buffers[0]["levels_d"] is None)):
            for slot in list(self._held):         # every chunk out on the old sets home first
                self._take_back(slot)
            self._release()
            self._buffers = [dict(capacity=size,
                                  input=cuda.pagelocked_empty(size * INPUT_BYTES_PER_OPTION, np.uint8),
                                  keys_d=self.rt.alloc(4 * size),
                                  counts=cuda.pagelocked_empty(KEY_BINS, np.int32),
                                  counts_d=self.rt.alloc(4 * KEY_BINS),
                                  starts_d=self.rt.alloc(4 * KEY_BINS),
                                  counted=cuda.Event(),
                                  prices=cuda.pagelocked_empty(size, np.float64),
                                  input_d=self.rt.alloc(INPUT_BYTES_PER_OPTION * size),
                                  prices_d=self.rt.alloc(8 * size),
                                  levels=(cuda.pagelocked_empty((size, LEVEL_VALUES), np.float64)
                                          if with_levels else None),
                                  levels_d=self.rt.alloc(8 * LEVEL_VALUES * size) if with_levels else None,
                                  # input copied from 0 to 1, (GPU sort to 2,) kernels to 3,
                                  # prices home at 4
                                  marks=[cuda.Event() for _ in range(5)],
                                  views=None)       # (n, input_views of the input for n rows)
                             for _ in range(2)]
            self._streams = [cuda.Stream(), cuda.Stream()]
        return self._buffers, self._streams

    def _release(self):
        if self._buffers:
            for b in self._buffers:
                for key in ("input_d", "keys_d", "counts_d", "starts_d", "prices_d", "levels_d"):
                    if b[key] is not None:
                        self.rt.free(b[key])
        self._buffers = None

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices of every option of params, in order (rows copied as they are, no gather)."""
        return self.finish(self._start(params, None, levels, narrowed=True))

    def price_rows(self, params: LatticeParams, rows: np.ndarray,
                   levels: np.ndarray | None = None) -> np.ndarray:
        """Prices of options `rows` of params, in that order (gathered into the input buffers)."""
        return self.finish(self._start(params, np.asarray(rows), levels, narrowed=True))

    def start(self, params: LatticeParams) -> "_Call":
        """Every chunk of `params` filled and launched; the last ones' prices still on their way
        (Engine.start). A chunk's buffer set is taken back from an unfinished call's chunk only
        once that chunk's prices are home, so calls may overlap: the host fills the next call's
        chunks, and its caller works, while the GPU prices this one. The caller keeps `params`
        as they are until finish(), which prices again from them the rows that a class chosen
        by their payoff's width refused."""
        return self._start(params, None, None, narrowed=True)

    def finish(self, call: "_Call") -> np.ndarray:
        """A started call's prices (and, where it was given levels, their values). Options that a
        class chosen by their payoff's width (chunks of WIDTH_ROWS rows or more, and chunks held
        in one wave) could not price (NaN: cuda/batch.cu zero_clamp) are priced again in the
        class of their steps, from the call's params."""
        prices, levels = self._collect_call(call), call.levels
        # one reduction (NaN propagates) before the search
        if call.narrowed and prices.size and math.isnan(prices.min()):
            again = np.flatnonzero(np.isnan(prices))
            stats = self.last_stats
            rows = again if call.index is None else call.index[again]
            kept = None if levels is None else np.empty((again.size, levels.shape[1]))
            turn = self._turn
            prices[again] = self._collect_call(self._start(call.params, rows, kept,
                                                           narrowed=False))
            self._turn = turn   # the pass's chunks are home: the next call takes the set it
                                # would have taken (not the one an unfinished call holds)
            if levels is not None:
                levels[again] = kept
            again_stats = self.last_stats   # both passes' times, the call's whole wall
            self.last_stats = {key: (value + again_stats[key]
                                     if key in ("copy_in", "kernels", "copy_out", "wall",
                                                "chunks", "launches") else value)
                               for key, value in stats.items()}
            self.last_stats["priced_again"] = int(again.size)
        return prices

    def warm_up(self) -> None:
        """Every kernel (KERNELS) launched once on a one-option chunk of WARM_UP_STEPS steps
        (each_kernel): CUDA loads a kernel at its first launch, and an idle GPU raises its clocks
        at its first work. Then a small call sorted on the host, so that the host's side of a
        call (numba's functions, loaded from its cache) is ready too; a chunk the GPU sorts needs
        none of them. The run does this while rank 0 reads the input, so none of it falls in the
        timed pricing. Each launch is a few steps' work: an option at the bottom of each class
        would keep one block busy with up to ~1e8 nodes. The buffers stay small: prepare() sizes
        them for the share (the memory guard counts the share's, not the warm-up's)."""
        self.rt.precompile(self.variants())
        self.each_kernel(sample_params([WARM_UP_STEPS]))
        self.price(sample_params([16, 40, WARM_UP_STEPS]))

    def each_kernel(self, params: LatticeParams) -> np.ndarray:
        """The first option of `params` priced by every kernel in turn, whatever its class: the
        (len(KERNELS),) prices, in KERNELS' order."""
        buffers, streams = self._ensure_buffers(1, False)
        self._take_back(0)
        buf, stream = buffers[0], streams[0]
        views = input_views(buf["input"], 1)
        fill_input(params, slice(0, 1), buf["input"], views)
        views.order[0] = 0
        self.rt.cuda.memcpy_htod_async(buf["input_d"], buf["input"][:INPUT_BYTES_PER_OPTION],
                                       stream)
        self._keep_levels = False
        prices = np.empty(len(KERNELS))
        for cls in range(len(KERNELS)):
            self._launch(Launch(cls, 0, 1), 1, buf, stream)
            self.rt.cuda.memcpy_dtoh_async(buf["prices"][:1], buf["prices_d"], stream)
            stream.synchronize()
            prices[cls] = buf["prices"][0]
        return prices

    def prepare(self, steps: np.ndarray, levels: bool = False) -> None:
        """The kernels of the classes of these options (steps <= MAX_STEPS) and the page-locked
        and device buffers of their largest chunk."""
        if steps.size:
            for cls in np.unique(class_of(steps)):
                self.function(int(cls))
            self._ensure_buffers(chunk_size(steps.size, self.chunk_options), levels)

    def _start(self, params: LatticeParams, index, levels, narrowed: bool) -> "_Call":
        """One pass over the chunks, every one launched; `narrowed`: classes by payoff width
        where that pays (else by steps only). The buffer sets alternate across calls."""
        index = None if index is None else np.asarray(index)
        count = len(params) if index is None else index.size
        call = _Call(params, index, levels, narrowed, np.empty(count))
        bounds = chunk_bounds(count, self.chunk_options)
        call.spent["chunks"] = len(bounds)
        if not bounds:
            return call
        buffers, streams = self._ensure_buffers(chunk_size(count, self.chunk_options),
                                                levels is not None)
        self._keep_levels = levels is not None
        cuda = self.rt.cuda
        for lo, hi in bounds:
            slot, self._turn = self._turn, 1 - self._turn
            buf, stream = buffers[slot], streams[slot]
            self._take_back(slot)          # the set's previous chunk must be home first
            if slot in self._unread:
                self._read_events(slot)
            n = hi - lo
            rows = slice(lo, hi) if index is None else index[lo:hi]
            if buf["views"] is None or buf["views"][0] != n:     # kept: remade only for a new n
                buf["views"] = (n, input_views(buf["input"], n))
            views = buf["views"][1]
            marks = buf["marks"]          # the slot's events, read before reuse
            fill_input(params, rows, buf["input"], views)
            if narrowed and n >= WIDTH_ROWS:
                ready, chunk_launches = self._sort_on_gpu(views, buf, n, stream, marks)
            else:
                ready, chunk_launches = self._sort_on_host(views, buf, n, stream, marks, narrowed)
            call.spent["launches"] += len(chunk_launches)
            self._launch_all(chunk_launches, n, buf, stream, ready)
            marks[3].record(stream)
            cuda.memcpy_dtoh_async(buf["prices"][:n], buf["prices_d"], stream)
            if levels is not None:
                cuda.memcpy_dtoh_async(buf["levels"][:n], buf["levels_d"], stream)
            marks[4].record(stream)
            self._held[slot] = (call, (lo, hi, buf, ready))
        return call

    def _take_back(self, slot: int, read_events: bool = True) -> None:
        """The chunk that holds buffer set `slot`, if any, home into its call; its event times
        read now, or (`read_events` False) when last_stats is read or the set is used again."""
        if slot not in self._held:
            return
        call, job = self._held.pop(slot)
        self._collect(job, call.prices, call.levels, self._streams[slot])
        self._unread[slot] = (call.spent, job[2]["marks"], job[3])
        if read_events:
            self._read_events(slot)

    def _collect_call(self, call: "_Call") -> np.ndarray:
        """The call's prices, its chunks still out brought home; last_stats becomes its. The
        events of the chunks brought home here are read only when last_stats is."""
        for slot in [s for s, (owner, _) in self._held.items() if owner is call]:
            self._take_back(slot, read_events=False)
        call.spent.update(wall=time.perf_counter() - call.began)
        self._stats = call.spent
        return call.prices

    def _sort_on_host(self, views, buf, n: int, stream, marks, narrowed: bool) -> tuple:
        """(the event the launches start from, the launches) of a chunk sorted here by the steps
        (batch_plan.schedule; `narrowed`: a one-class chunk of more than one wave may go to
        the G of its largest payoff width, widest_payoff). The whole input, order included, then
        goes to the device in one copy (marks 0 to 1). A chunk that one launch holds in one wave
        may then have its rows put heaviest first by the GPU (batch_plan.heaviest_first)."""
        max_width = None
        if narrowed:
            max_width = lambda: widest_payoff(views.floats, views.steps, views.call,  # noqa: E731
                                              views.american)
        chunk_launches = schedule(views.steps, views.order,
                                  self.resident, max_width)
        marks[0].record(stream)
        self.rt.cuda.memcpy_htod_async(buf["input_d"], buf["input"][:INPUT_BYTES_PER_OPTION * n],
                                       stream)
        marks[1].record(stream)
        if heaviest_first(chunk_launches, n, self.resident, self.rt.sms,
                                           views.american):
            # the GPU writes the order over the copied one; the launch's clock starts before it
            self._order_kernels()[3].prepared_async_call(
                (-(-n * WORK_RANK_LANES // WORK_ORDER_THREADS), 1), (WORK_ORDER_THREADS, 1, 1),
                stream, int(buf["input_d"]), np.int32(n), shared_size=4 * n)
        return marks[1], chunk_launches

    def _sort_on_gpu(self, views, buf, n: int, stream, marks) -> tuple:
        """(the event the launches start from, the launches) of a chunk whose rows the GPU keys
        and sorts from the input already there
        (cuda/batch.cu: batch_width_keys, the American rows by their payoff's width, the others
        by their steps; batch_key_starts and batch_sort_rows write the order in place). Only the
        rows per key come back (64 KiB), and the host waits for them alone: the keys' 4 bytes a
        row each way and the host's sort (measured slower on large chunks: docs/decisions.md)
        are gone. Behind another chunk's launches the small
        kernels can wait for a block slot."""
        cuda = self.rt.cuda
        keys_fn, starts_fn, sort_fn, _ = self._order_kernels()
        check_steps(views.steps)            # the keys (at most the steps) index KEY_BINS counters
        order_at, order_end = order_span(n)
        marks[0].record(stream)             # all but the order, which the sort writes
        cuda.memcpy_htod_async(buf["input_d"], buf["input"][:order_at], stream)
        cuda.memcpy_htod_async(int(buf["input_d"]) + order_end,
                               buf["input"][order_end:INPUT_BYTES_PER_OPTION * n], stream)
        marks[1].record(stream)
        rows_grid = ((n + SORT_BLOCK - 1) // SORT_BLOCK, 1)
        cuda.memset_d32_async(buf["counts_d"], 0, KEY_BINS, stream)
        keys_fn.prepared_async_call(rows_grid, (SORT_BLOCK, 1, 1), stream, int(buf["input_d"]),
                                    np.int32(n), int(buf["keys_d"]), int(buf["counts_d"]))
        cuda.memcpy_dtoh_async(buf["counts"], buf["counts_d"], stream)
        counted = buf["counted"]
        counted.record(stream)
        starts_fn.prepared_async_call((1, 1), (SORT_THREADS, 1, 1), stream, int(buf["counts_d"]),
                                      np.int32(KEY_BINS), int(buf["starts_d"]))
        sort_fn.prepared_async_call(rows_grid, (SORT_BLOCK, 1, 1), stream, int(buf["keys_d"]),
                                    np.int32(n), int(buf["starts_d"]),
                                    int(buf["input_d"]) + order_at)
        marks[2].record(stream)
        counted.synchronize()
        return marks[2], counted_schedule(buf["counts"],
                                          self.resident)

    def _order_kernels(self) -> tuple:
        """cuda/batch.cu's kernels that order a chunk's rows on the GPU (loaded on first use):
        batch_width_keys, batch_key_starts, batch_sort_rows and batch_work_order."""
        if self._sort_fns is None:
            module = self.rt.module(["-DBATCH_W=1", *self._defines], "batch.cu")
            names = ("batch_width_keys", "batch_key_starts", "batch_sort_rows", "batch_work_order")
            self._sort_fns = tuple(module.get_function(name) for name in names)
            for fn, args in zip(self._sort_fns, ("PiPP", "PiP", "PiPP", "Pi")):
                fn.prepare(args)
        return self._sort_fns

    def _launch_all(self, chunk_launches, n: int, buf, stream, input_ready):
        """One launch per class, each on its own stream so that they run side by side (a class's
        launch lasts as long as its largest option, and few options can leave most SMs idle);
        the largest classes come first in the schedule and start first. The chunk's stream waits
        for all of them."""
        if len(chunk_launches) == 1:    # the chunk's stream has the input in order before it
            self._launch(chunk_launches[0], n, buf, stream)
            return
        cuda = self.rt.cuda
        while len(self._launch_streams) < min(len(chunk_launches), LAUNCH_STREAMS):
            self._launch_streams.append((cuda.Stream(), cuda.Event()))
        sides = self._launch_streams[:min(len(chunk_launches), LAUNCH_STREAMS)]
        for side, _ in sides:
            side.wait_for_event(input_ready)
        for k, launch in enumerate(chunk_launches):        # largest class first
            self._launch(launch, n, buf, sides[k % LAUNCH_STREAMS][0])
        # (an event recorded again is safe to reuse: a wait takes its latest record at the call)
        for side, finished in sides:
            finished.record(side)
            stream.wait_for_event(finished)

    def _launch(self, launch, n: int, buf, stream):
        """One class's launch over positions [lo, hi) of the chunk's sorted order (n rows in all)."""
        per_block = options_per_block(launch.warps)
        count = launch.hi - launch.lo
        blocks = (count + per_block - 1) // per_block
        levels_d = int(buf["levels_d"]) if self._keep_levels else 0
        self.function(launch.cls).prepared_async_call(
            (blocks, 1), (32 * launch.warps * per_block, 1, 1), stream, int(buf["input_d"]),
            np.int32(n), np.int32(launch.lo), int(buf["prices_d"]), levels_d, np.int32(count))

    @staticmethod
    def _collect(job, prices, levels, stream):
        """A chunk's prices (and levels) home."""
        lo, hi, buf, _ = job
        stream.synchronize()
        prices[lo:hi] = buf["prices"][:hi - lo]
        if levels is not None:
            levels[lo:hi] = buf["levels"][:hi - lo]


class _Call:
    """A started call: its input, its prices as they come home, its event times (last_stats)."""

    def __init__(self, params, index, levels, narrowed: bool, prices: np.ndarray):
        self.params, self.index, self.levels, self.narrowed = params, index, levels, narrowed
        self.prices = prices
        self.began = time.perf_counter()
        self.spent = dict(copy_in=0.0, kernels=0.0, copy_out=0.0, chunks=0, launches=0,
                          priced_again=0)
