"""The GPU backends `gpu`, `hybrid` and `batch` (and `auto` on a GPU machine): one engine, three
routes (pricer.engines.base.route), each option to the first route that takes it:

1. hybrid: options with steps <= cpu_max_steps (default T2) on the CPU (the `cpu` engine);
2. every option up to the batch kernels' limit (MAX_STEPS) through the batch runner (whole books
   per launch, cuda/batch.cu; pricer/engines/gpu/batch_runner.py), except in the exact mode
   (fma=False), whose prices must be bitwise the CPU engines';
3. the rest one at a time through the single-option regimes (cuda/binomial.cu; config.py): tiled
   while a level is wider than T1, then the persistent kernel down to level 0 (`gpu`) or T2
   (`hybrid`, `batch`), whose last level the CPU finishes (kernels.backward_keeping_levels).
Lattices whose node tables are not PLAIN (kernels.node_tables) skip route 2 (the batch kernels
build their node prices from PLAIN factors), and CLAMPED ones, priced a block of levels at a time,
go to the CPU engine.
`auto` is `batch` whose rank's share of at most cpu_max_nodes lattice nodes runs on the CPU.

Configuration: an explicit `config` is taken as it is; without one, GpuConfig() <- `defaults` <-
the cached calibration of this GPU (calibration.py) <- nothing else. `overrides` (GpuConfig fields,
e.g. t1=..., t2=...) win in both cases. The calibration is looked up by `device_name`, else by the
name of the GPU the engine runs on (none with given kernels).

Device memory (device_need): the batch runner's two buffer sets of one chunk (chunk_options rows at
most, shrunk by fit_device to a budget) and its sort counts, and the regimes' buffers of the widest
option they price (REGIME_BYTES_PER_NODE per node of max(N + 2, REGIME_MIN_NODES)), kept across
calls.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import replace

import numpy as np

from pricer.engines.base import DeviceInfo, DeviceNeed, Engine, Route, route, sole_engine
from pricer.engines.cpu.kernels import backward_keeping_levels, power_tables, table_kinds
from pricer.engines.cpu.serial import level_array
from pricer.engines.gpu.batch_layout import KEY_BINS, batch_row_bytes, shared_all_plain
from pricer.engines.gpu.batch_plan import DEFAULT_CHUNK_OPTIONS, MAX_STEPS, chunk_size
from pricer.engines.gpu.calibration import effective_config
from pricer.engines.gpu.config import GpuConfig
from pricer.engines.gpu.regimes import CudaKernels, pers_pows, pers_skip_limit
from pricer.engines.gpu.runtime import GpuRuntime
from pricer.model.cost import lattice_nodes
from pricer.model.lattice import CENTRED, CLAMPED, PLAIN, LatticeParams

MODES = ("gpu", "hybrid", "batch")
REGIME_BYTES_PER_NODE = 32   # CudaKernels.reserve: two level buffers and the two power tables
REGIME_MIN_NODES = 1024      # ... of max(N + 2, 1024) nodes, kept (grown only) across calls
BATCH_SETS = 2               # the batch runner's page-locked/device buffer sets, alternating
BATCH_SORT_BYTES = 2 * 4 * KEY_BINS   # and each set's GPU sort counts and starts, int32 a key


def regime_bytes(steps) -> np.ndarray:
    """Device bytes an option of `steps` holds while the regimes price it; 0 for steps <= 0."""
    n = np.asarray(steps, dtype=np.float64)
    return np.where(n > 0, REGIME_BYTES_PER_NODE * np.maximum(n + 2, REGIME_MIN_NODES), 0.0)


class GpuEngine(Engine):
    """`gpu`, `hybrid` or `batch` (see the module doc)."""

    uses_gpu = True

    def __init__(self, mode: str = "gpu", config: GpuConfig | None = None, kernels=None,
                 runner=None, device_name: str | None = None, defaults: dict | None = None,
                 chunk_options: int | None = None, cpu_max_nodes: float = 0,
                 **overrides):
        if mode not in MODES:
            raise ValueError(f"unknown GPU mode {mode!r}; known: {', '.join(MODES)}")
        self.mode = self.name = mode
        runtime = None
        self.calibration = None      # the calibration file the configuration came from, if any
        if config is None:
            if device_name is None and kernels is None:
                runtime = GpuRuntime.get()
                device_name = runtime.name
            self.config, self.calibration = effective_config(device_name, overrides, defaults)
        else:
            self.config = replace(config, **overrides).check()
        c = self.config
        self.cpu_max_steps = ((c.t2 if c.cpu_max_steps is None else c.cpu_max_steps)
                              if mode == "hybrid" else 0)
        self.cpu_max_nodes = cpu_max_nodes
        self._kernels, self._runtime = kernels, runtime
        # options per chunk of the runner's buffers: as given, else a given runner's, else the default
        if runner is not None and chunk_options is not None:
            runner.chunk_options = int(chunk_options)
        self._runner = runner
        self._chunk_options = int(chunk_options or DEFAULT_CHUNK_OPTIONS)
        self._cpu = None
        self._host = None
        # set once a persistent launch gave up waiting (its blocks were not all resident, e.g. a
        # GPU shared with other processes' kernels under MPS): the launch-per-K fallback from then on
        self.pers_off = False
        below = self.cpu_max_steps
        regimes = _Regimes(self)
        self._on_cpu = Route(self.cpu, most=below)
        self._on_runner = Route(self.runner, most=MAX_STEPS if c.fma else below, above=below)
        self._on_regimes = Route(regimes, above=max(below, MAX_STEPS) if c.fma else below)
        # Lattices whose node tables are not PLAIN (kernels.node_tables): CLAMPED ones are priced
        # a block of levels at a time, by the CPU kernels only; the batch kernels build node prices
        # from PLAIN factors only, so CENTRED ones of their sizes take the regimes
        self._routes = [self._on_cpu, Route(self.cpu, kinds=(CLAMPED,)),
                        Route(regimes, above=below, kinds=(CENTRED,)), self._on_runner,
                        self._on_regimes]

    # the parts, made at first use
    @property
    def kernels(self) -> CudaKernels:
        if self._kernels is None:
            self._kernels = CudaKernels(self.config, self._runtime)
        return self._kernels

    def runner(self):
        if self._runner is None:
            from pricer.engines.gpu.batch_runner import CudaBatchRunner
            self._runner = CudaBatchRunner(self._runtime, chunk_options=self._chunk_options)
        return self._runner

    def cpu(self) -> Engine:
        if self._cpu is None:
            from pricer.engines.cpu.parallel import CpuEngine
            self._cpu = CpuEngine()
        return self._cpu

    # ---- the Engine interface
    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        """Prices; with `levels` ((n, LEVEL_VALUES) float64) also the first levels' values."""
        if self._cpu_takes(params.steps):
            return self.cpu().price(params, levels)
        kinds = table_kinds(params.spot, params.log_up, params.log_down, params.steps)
        return route(params, self._routes, levels, kinds if (kinds != PLAIN).any() else None)

    def start(self, params: LatticeParams):
        """A call whose options all go to the batch runner as they are starts there without
        waiting for the GPU (Engine.start; the caller keeps `params` as they are until finish,
        CudaBatchRunner.start); any other is priced here, as price() routes it."""
        if self._cpu_takes(params.steps):
            return self.cpu().price(params)
        kinds = table_kinds(params.spot, params.log_up, params.log_down, params.steps)
        plain = bool((kinds == PLAIN).all())
        if plain and sole_engine(params.steps, self._routes) is self._runner:
            return self._runner.start(params)
        return route(params, self._routes, None, None if plain else kinds)

    def _cpu_takes(self, steps: np.ndarray, lattices: int = 1) -> bool:
        """auto's rule: a call of at most cpu_max_nodes lattice nodes (`lattices` lattices of
        each of these steps) goes to the CPU."""
        return bool(self.cpu_max_nodes) and \
            lattice_nodes(steps).sum() * lattices <= self.cpu_max_nodes

    def finish(self, started) -> np.ndarray:
        return started if isinstance(started, np.ndarray) else self.runner().finish(started)

    @property
    def sizes_by_call(self) -> bool:
        return bool(self.cpu_max_nodes)

    def price_lattices(self, lattices) -> np.ndarray:
        """Prices of lattices made on demand (Engine.price_lattices). Where they share their
        numbers (pricer.model.scenarios.SharedNumbers) and the batch runner takes every one of
        them (steps in its route, PLAIN node tables, not left to the CPU), it reads them in place
        in one call: no lattice is written out on the host but in the runner's input buffers."""
        shared = lattices.shared
        if shared is not None and self._runner_takes_all(shared):
            return self.runner().price(shared)
        return super().price_lattices(lattices)

    def _runner_takes_all(self, shared) -> bool:
        steps = shared.numbers.steps[:shared.spot.size]
        if steps.size == 0 or self._cpu_takes(steps, len(shared.sets)):
            return False
        return (self._on_runner.takes_all(int(steps.min()), int(steps.max()))
                and shared_all_plain(shared))

    def warm_up(self) -> None:
        """Before the input is read: every kernel the engine may launch compiled where the cache
        lacks it (all at once, GpuRuntime.precompile), then the batch kernels loaded and the GPU's
        clocks raised."""
        if self._kernels is None:       # not an emulation (tests): compile on the real GPU
            variants = CudaKernels.variants(self.config)
            if self.config.fma:
                variants += self.runner().variants()
            (self._runtime or GpuRuntime.get()).precompile(variants)
        if self.config.fma:
            self.runner().warm_up()

    def prepare(self, steps: np.ndarray, levels: bool = False) -> None:
        """The kernels of the classes these options need and the batch runner's buffers for the
        share's largest chunk, before pricing (the run's `setup` stage)."""
        if self._cpu_takes(steps):
            return
        narrow = steps[self._on_runner.accepts(steps)]
        if narrow.size:
            self.runner().prepare(narrow, levels)
        if self._on_regimes.accepts(steps).any():
            self.kernels

    def device_need(self, steps: np.ndarray, cuts: np.ndarray, analytics) -> DeviceNeed:
        """Device bytes of a share whose options have `steps`, priced in engine calls of rows
        cuts[j]:cuts[j+1] (the run's chunks), with the lattices `analytics` adds."""
        steps = np.asarray(steps, dtype=np.int64)
        if steps.size == 0:
            return DeviceNeed()
        starts = np.asarray(cuts[:-1], dtype=np.int64)
        kinds = analytics.lattices(steps)
        on_gpu = None            # every chunk goes to the GPU (no cpu_max_nodes: the common case)
        if self.cpu_max_nodes:
            row_nodes = sum(count * lattice_nodes(s) for s, count in kinds)
            on_gpu = np.repeat(np.add.reduceat(row_nodes, starts) > self.cpu_max_nodes,
                               np.diff(cuts))
        narrow = np.zeros(steps.size, dtype=np.int64)
        widest = 0
        for s, count in kinds:
            narrow += count * self._on_runner.accepts(s)
            wide = self._on_regimes.accepts(s)
            if on_gpu is not None:
                wide &= on_gpu
            if wide.any():
                widest = np.maximum(widest, np.where(wide, s, 0))
        # a call's rows go through the runner's buffers in chunks; prepare() sizes them for the
        # share's own options, a call for its lattices: one chunk of the larger
        rows = int(np.add.reduceat(narrow if on_gpu is None else np.where(on_gpu, narrow, 0),
                                   starts).max())
        if not self._cpu_takes(steps):
            rows = max(rows, int(self._on_runner.accepts(steps).sum()))
        unit = BATCH_SETS * batch_row_bytes(analytics.greeks)
        rows = chunk_size(rows, self.chunk_options) if rows else 0
        need = DeviceNeed(held=BATCH_SETS * BATCH_SORT_BYTES if rows else 0.0,
                          streamed=rows * unit, unit=unit)
        if np.max(widest) > 0:
            need.held_row = int(np.argmax(widest))
            need.held_steps = int(widest[need.held_row])
            need.held += float(regime_bytes(need.held_steps))
            need.held_what = (f"{REGIME_BYTES_PER_NODE} bytes per node of its widest level: two "
                              f"level buffers and the power tables"
                              + (", and the batch runner's sort counts" if rows else ""))
        return need

    def device_info(self) -> DeviceInfo:
        """This rank's GPU, measured in its CUDA context (cuMemGetInfo)."""
        rt = self.kernels.rt if self._kernels is not None else (
            self._runner.rt if self._runner is not None else GpuRuntime.get())
        free, total = rt.cuda.mem_get_info()
        where = rt.pci_bus_id if rt.pci_bus_id != "?" else f"?{rt.device_index}"
        return DeviceInfo(float(free), float(total), f"{socket.gethostname()}:{where}",
                          str(rt.name))

    @property
    def chunk_options(self) -> int:
        return self._runner.chunk_options if self._runner is not None else self._chunk_options

    def fit_device(self, setting: int) -> None:
        """Batch runner chunks of `setting` options (0: as they are)."""
        if setting:
            self._chunk_options = int(setting)
            if self._runner is not None:
                self._runner.chunk_options = int(setting)

    # ---- the regimes, one option at a time
    def _host_buffers(self, nodes):
        if self._host is None or self._host[0].size < nodes:
            self._host = [self.kernels.host_array(nodes), self.kernels.host_array(2 * nodes)]
        return self._host

    def _pers_phases(self, K, stop: int, skips: bool = False) -> list:
        """The persistent launches down to level `stop`, as [(kernels, level it stops at)]: the
        wide shape while the level is above pers_narrow_below (or above the widest level the narrow
        shape's tiles hold at once, if that is lower), then the narrow shape, whose more and smaller
        tiles keep more SM sub-partitions busy on narrow levels. Where the option's exercised tiles
        skip their epochs (`skips`), the narrow shape by default takes over as soon as its tiles
        hold the level: the tiles that skip leave their sub-partitions to the others."""
        narrow = K.narrow_kernels()
        if narrow is None or narrow.pers_top() < 0:
            return [(K, stop)]
        c = self.config
        below = c.pers_narrow_below
        if below is None and skips:
            below = narrow.pers_top()
        elif below is None:   # where the wide tiles fill half of the SM sub-partitions
            below = K.sub_partitions() * (c.pers_w - c.pers_k) // 2
        mid = max(stop, min(below, narrow.pers_top()))
        return [(K, mid), (narrow, stop)]

    def price_one(self, p: LatticeParams, k: int, bufs=None, host=None, levels=None,
                  row: int | None = None) -> float:
        """Option k of p through the regimes; levels[row] (row: k unless given) receives its first
        levels' values if levels is given (the GPU then stops at level 2 at the latest and the
        host takes the last two steps)."""
        n = int(p.steps[k])
        if n < 1:
            raise ValueError("steps must be >= 1")
        K, c = self.kernels, self.config
        if bufs is None:
            bufs = K.reserve(n + 2)
        if host is None:
            host = self._host_buffers(n + 2)
        a, b, tab_d = bufs
        values, tab = host
        lb, ratio = tab[:n + 1], tab[n + 1:2 * n + 2]
        sign = 1.0 if p.call[k] else -1.0
        american = bool(p.american[k])
        strike, pu, pd = float(p.strike[k]), float(p.pu[k]), float(p.pd[k])
        power_tables(float(p.spot[k]), float(p.log_up[k]), float(p.log_down[k]), n, lb, ratio)
        floor = 2 if levels is not None else 0    # levels 2 and 1 are kept on the host
        use_pers = not self.pers_off and K.pers_top() >= 0   # occupancy known
        last = max(floor, 0 if self.mode == "gpu" else c.t2)   # where the GPU regimes stop
        scaled, pows = False, None
        skip_lim = np.nan               # a put's tiles below it skip exercised epochs
        if use_pers:                    # pd^s, pd^-s (both shapes have the same pers_k)
            pows = np.empty(2 * c.pers_k + 2)
            # scaled: values, exercise numbers and the level factors over pd^s, kept in range
            big = max(abs(lb[0]), abs(lb[n]), abs(lb[n] * ratio[n]), strike)
            scaled = (c.fma and pers_pows(pd, c.pers_k, pows)
                      and big * pows[2 * c.pers_k + 1] < 2.0 ** 1000)
            if scaled and american and sign < 0:
                skip_lim = pers_skip_limit(strike, n, pu, pd, float(p.log_up[k]),
                                           float(p.log_down[k]))
        phases = self._pers_phases(K, last, not np.isnan(skip_lim)) if use_pers else []
        K.upload(tab_d, tab[:2 * n + 2])           # both tables in one copy
        lb_d, r_d = K.split_tables(tab_d, n)
        K.terminal(a, lb_d, r_d, n, strike, sign)
        src, dst = a, b
        t = n
        scalars = (pu, pd, strike, sign, american)
        # tiled while t > T1, or while the level is too wide for all the persistent kernel's
        # tiles to be resident at once
        tiled_to = max(floor, min(c.t1, K.pers_top()) if use_pers else c.t1)
        while t > tiled_to:
            step = min(c.tiled_k, t - tiled_to)
            K.tiled(src, dst, lb_d, r_d, t, step, *scalars)
            src, dst = dst, src
            t -= step
        if use_pers:
            for kernels, until in phases:      # each shape's levels in one launch
                if t > until:
                    kernels.pers(src, dst, lb_d, r_d, kernels.pers_pows(pows), t, until,
                                 *scalars, scaled, skip_lim)
                    src, dst = dst, src
                    t = until
        else:
            while t > last:
                # mid_k steps per launch; once the level fits one tile, the whole rest in one
                step = t - last if t + 1 <= c.mid_w else min(c.mid_k, t - last)
                K.mid(src, dst, lb_d, r_d, t, step, *scalars)
                src, dst = dst, src
                t -= step
        level = values[:t + 1]
        K.download(level, src)
        if use_pers and np.isnan(level).any() and any([k.pers_failed() for k, _ in phases]):
            print("pricer: warning: the persistent GPU kernel gave up waiting for a neighbour tile "
                  "(its blocks were not all resident: a GPU shared with other processes' kernels?); "
                  "this and later options use the launch-per-step-block regimes instead",
                  file=sys.stderr, flush=True)
            self.pers_off = True
            return self.price_one(p, k, bufs, host, levels, row)
        if t > 0 or levels is not None:
            backward_keeping_levels(values, t, strike, sign, american, pu, pd, lb, ratio,
                                    level_array(levels), k if row is None else row, 0.0)
        return float(values[0])


class _Regimes(Engine):
    """The last route: options one after another through GpuEngine.price_one."""

    def __init__(self, engine: GpuEngine):
        self.engine = engine
        self.name = f"{engine.name} regimes"

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        return self.price_rows(params, np.arange(len(params)), levels)

    def price_rows(self, params, rows, levels=None) -> np.ndarray:
        e = self.engine
        out = np.empty(len(rows))
        if len(rows) == 0:
            return out
        top = int(params.steps[rows].max()) + 2
        bufs, host = e.kernels.reserve(top), e._host_buffers(top)
        for j, k in enumerate(rows):
            out[j] = e.price_one(params, int(k), bufs, host, levels, j)
        return out
