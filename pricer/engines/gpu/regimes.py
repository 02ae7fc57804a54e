"""The single-option GPU regimes' launchers (cuda/binomial.cu), one module per kernel shape.

CudaKernels compiles binomial.cu for a GpuConfig (config.defines()) and launches its kernels on the
runtime's stream: terminal_values; tiled_steps (K steps fused per launch, shared-memory tiles);
pers_steps, the persistent kernel (one launch from a level down to another: warp tiles in registers
that exchange halos through shared memory within a block and through a ring in global memory
between blocks, so every block must be resident: pers_tiles counts what fits); the fallback's
tiled_steps in the mid shape; and, for `pricer bench gpu` only, wavefront_step (one launch a step)
and warp_steps (warp per block). The schedule that strings them together is GpuEngine.price_one
(engine.py). Arithmetic: the power tables (S0 d^t, (u/d)^i) are built on the host by the CPU
engines' power_tables (pricer/engines/cpu/kernels.py) and uploaded; with fma the hold and
exercise values use fused multiply-adds (prices differ from the serial engine's by rounding
only), without (the exact mode) every product and sum rounds on its own, in the serial engine's
order, bitwise.
"""

from __future__ import annotations

import numpy as np

from pricer.engines.cpu.kernels import exercise_limit, EXERCISE_SLACK
from pricer.engines.gpu.config import GpuConfig
from pricer.engines.gpu.runtime import GpuRuntime, resident_blocks

PERS_SLOTS = 4            # cuda/binomial.cu PERS_D: ring slots per tile


_POWS_CACHE: dict = {}


def pers_pows(pd: float, k: int, out: np.ndarray) -> bool:
    """out[:k+1] = pd^s and out[k+1:2k+2] = pd^-s for s = 0..k, each rounded once from long
    double; whether the persistent kernel may use its scaled arithmetic with them (pd^k >= 2^-600,
    so X = V / pd^s stays far from overflow)."""
    key = (pd, k)
    hit = _POWS_CACHE.get(key)
    if hit is None:
        powers = np.cumprod(np.r_[np.longdouble(1.0), np.full(k, np.longdouble(pd))])
        ok = bool(0.0 < pd < 1.0 and powers[-1] >= np.longdouble(2.0) ** -600)
        hit = (np.r_[powers.astype(np.float64), (1 / powers).astype(np.float64)] if ok
               else np.ones(2 * k + 2), ok)
        if len(_POWS_CACHE) > 64:
            _POWS_CACHE.clear()
        _POWS_CACHE[key] = hit
    out[:2 * k + 2] = hit[0]
    return hit[1]


def pers_skip_limit(strike, steps, pu, pd, log_up, log_down) -> float:
    """cuda/binomial.cu PERS_SKIP: an S below which a put's node whose two successors hold their
    exercise value (bit for bit) is exercised too, whatever the rounding, in the persistent kernel's
    scaled arithmetic; NaN: none is known to be.  The serial engine's exercise_limit, each rounding
    error bound widened four times more: the scaled steps round a few more times than the serial
    engine's (a = pu/pd, the pd^-s factors and the exercise numbers scaled by them)."""
    limit = exercise_limit(strike, steps, pu, pd, log_up, log_down, 4.0 * EXERCISE_SLACK)
    return limit if limit > 0.0 else np.nan


class CudaKernels:
    """The launch interface the schedule uses, backed by pycuda (tests/numpy_kernels.py emulates it
    in numpy, so that the schedule runs on machines without a GPU)."""

    @staticmethod
    def variants(config: GpuConfig) -> list:
        """The (defines, source) of every module the regimes may load under `config`."""
        configs = [config] + ([config.narrow()] if config.narrow() is not None else [])
        return [(defines, "binomial.cu") for c in configs
                for defines in (c.defines(), c.mid_defines())]

    def __init__(self, config: GpuConfig, runtime: GpuRuntime | None = None):
        self.config = config
        self.rt = runtime or GpuRuntime.get()
        mod = self.rt.module(config.defines())
        self._terminal = mod.get_function("terminal_values")
        self._terminal.prepare("PPPidd")   # values, level_base, ratio, steps, strike, sign
        self._wave = mod.get_function("wavefront_step")
        self._wave.prepare("PPPPiddddi")
        self._tiled = mod.get_function("tiled_steps")
        self._tiled.prepare("PPPPiiddddi")
        self._warp = mod.get_function("warp_steps")
        self._warp.prepare("PPPPiiddddi")
        self._mid = self.rt.module(config.mid_defines()).get_function("tiled_steps")
        self._mid.prepare("PPPPiiddddi")
        self._pers = mod.get_function("pers_steps")
        # vin, vout, level_base, ratio, pows, ring, progress, status, t, t_stop, tiles, pu, pd,
        # strike, sign, skip_lim, american, scaled, gen
        self._pers.prepare("PPPPPPPPiiidddddiiI")
        self._pers_ring = None      # ring, progress, status, tiles, pows, allocation (_pers_alloc)
        self._pers_gen = 0
        self._pers_tiles = None
        self._narrow = None         # the narrow shape's kernels (narrow_kernels)
        self._capacity = 0
        self._bufs = None

    # The persistent kernel: how many of its tiles (warps) fit on the GPU at once.  Its blocks wait
    # on each other, so every block must be resident: count blocks per SM from the kernel's
    # registers (allocated per warp in units of 256, per SM sub-partition), threads, shared memory
    # and the blocks-per-SM limit, times the SMs.
    def pers_tiles(self) -> int:
        """0 where the runtime cannot say (no such figures, e.g. a stand-in): then the persistent
        kernel is not used."""
        if self._pers_tiles is None:
            try:
                self._pers_tiles = self._count_pers_tiles()
            except Exception:  # noqa: BLE001 -- a runtime without occupancy figures
                self._pers_tiles = 0
        return self._pers_tiles

    def _count_pers_tiles(self) -> int:
        warps = self.config.pers_warps
        return resident_blocks(self.rt, self._pers, warps) * warps

    def pers_top(self) -> int:
        """The widest level (t) the persistent kernel may start on: its tiles all fit at once."""
        c = self.config
        return self.pers_tiles() * (c.pers_w - c.pers_k) - 1

    def sub_partitions(self) -> int:
        """The GPU's SM sub-partitions (warp schedulers): 4 per SM since Volta."""
        return 4 * self.rt.sms

    def narrow_kernels(self) -> "CudaKernels | None":
        """The persistent kernel in its narrow shape (config.narrow(): its own module, ring and
        tile count, this runtime), built at first use; None where there is none."""
        if self._narrow is None and self.config.narrow() is not None:
            self._narrow = CudaKernels(self.config.narrow(), self.rt)
        return self._narrow

    def _pers_alloc(self):
        """The ring (tiles x PERS_SLOTS x pers_k 16-byte words), the progress words, the status
        word and the pd^s / pd^-s table: one allocation, made at the first persistent launch and
        kept (a few MiB, sized by the tiles that fit; outside the engine's per-node estimate,
        inside pricer/run/memory.py's DEVICE_ALLOWANCE)."""
        if self._pers_ring is None:
            k, tiles = self.config.pers_k, self.pers_tiles() + 1
            ring_b, prog_b = 16 * PERS_SLOTS * k * tiles, -(-4 * tiles // 16) * 16
            block = self.rt.alloc(ring_b + prog_b + 16 + 16 * (k + 1))
            base = int(block)
            self._pers_ring = (base, base + ring_b, base + ring_b + prog_b, tiles,
                               base + ring_b + prog_b + 16, block)
            self._pers_gen = 4095           # zeroed at the first launch
            self._pows_key = None
        return self._pers_ring

    def pers_pows(self, host: np.ndarray):
        """Device copy of the pd^s / pd^-s table (copied only when it changes)."""
        pows = self._pers_alloc()[4]
        key = host.tobytes()
        if key != self._pows_key:
            self.rt.cuda.memcpy_htod(pows, host)
            self._pows_key = key
        return pows

    def _pers_buffers(self):
        cuda = self.rt.cuda
        ring, progress, status, tiles = self._pers_alloc()[:4]
        self._pers_gen += 1
        if self._pers_gen >= 4096:          # flags carry 12 bits of it: zero the words, start again
            cuda.memset_d32(ring, 0, 4 * PERS_SLOTS * self.config.pers_k * tiles)
            cuda.memset_d32(progress, 0, tiles)
            cuda.memset_d32(status, 0, 1)
            self._pers_gen = 1
        return ring, progress, status

    def pers(self, vin, vout, lb, r, pows, t, stop, pu, pd, strike, sign, american, scaled,
             skip_lim=np.nan):
        """Level t -> level stop in one launch of the persistent kernel (skip_lim: pers_skip_limit)."""
        c = self.config
        out_w = c.pers_w - c.pers_k
        tiles = (t - min(c.pers_k, t - stop) + out_w) // out_w
        if tiles > self.pers_tiles() or -(-(t - stop) // c.pers_k) >= 1 << 20:
            raise ValueError(f"level {t} is too wide for the persistent kernel ({tiles} tiles, "
                             f"{self.pers_tiles()} fit)")
        ring, progress, status = self._pers_buffers()
        blocks = -(-tiles // c.pers_warps)
        self._pers.prepared_async_call((blocks, 1), (32 * c.pers_warps, 1, 1), self.rt.stream,
                                       vin, vout, lb, r, pows, ring, progress, status,
                                       np.int32(t), np.int32(stop), np.int32(tiles), pu, pd, strike,
                                       sign, skip_lim, np.int32(american), np.int32(scaled),
                                       np.uint32(self._pers_gen))

    def pers_failed(self) -> bool:
        """Whether a persistent launch gave up waiting (its outputs are NaN); clears the flag."""
        if self._pers_ring is None:
            return False
        flag = np.zeros(1, dtype=np.int32)
        self.rt.cuda.memcpy_dtoh(flag, self._pers_ring[2])
        self.rt.cuda.memset_d32(self._pers_ring[2], 0, 1)
        return bool(flag[0])

    # buffers: two level buffers and one table buffer (level_base then ratio, 2 * (N + 1) entries),
    # grown to the largest option seen
    def reserve(self, nodes: int):
        if nodes > self._capacity:
            if self._bufs is not None:
                for b in self._bufs:
                    self.rt.free(b)
            cap = max(nodes, 1024)
            self._bufs = [self.rt.alloc(8 * cap), self.rt.alloc(8 * cap), self.rt.alloc(16 * cap)]
            self._capacity = cap
        return self._bufs

    @staticmethod
    def split_tables(tab, steps: int):
        """Device addresses of level_base and ratio inside the table buffer."""
        return int(tab), int(tab) + 8 * (steps + 1)

    def host_array(self, size: int) -> np.ndarray:
        """A float64 host buffer in page-locked memory (its uploads measured faster than
        from pageable memory: docs/decisions.md)."""
        return self.rt.cuda.pagelocked_empty(size, np.float64)

    def upload(self, dst, host: np.ndarray):
        self.rt.cuda.memcpy_htod(dst, host)

    def download(self, host: np.ndarray, src):
        self.rt.cuda.memcpy_dtoh(host, src)

    def terminal(self, v, lb, r, steps, strike, sign):
        block = 256
        grid = ((steps + 1 + block - 1) // block, 1)
        self._terminal.prepared_async_call(grid, (block, 1, 1), self.rt.stream, v, lb, r,
                                           np.int32(steps), strike, sign)

    def wavefront(self, vin, vout, lb, r, t, pu, pd, strike, sign, american):
        """Level t+1 -> level t."""
        block = self.config.wavefront_block
        grid = ((t + 1 + block - 1) // block, 1)
        self._wave.prepared_async_call(grid, (block, 1, 1), self.rt.stream, vin, vout, lb, r,
                                       np.int32(t), pu, pd, strike, sign, np.int32(american))

    def tiled(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american):
        """Level t -> level t-k."""
        out_w = self.config.tiled_w - k
        grid = ((t - k + 1 + out_w - 1) // out_w, 1)
        self._tiled.prepared_async_call(grid, (self.config.tiled_b, 1, 1), self.rt.stream, vin, vout,
                                        lb, r, np.int32(t), np.int32(k), pu, pd, strike, sign,
                                        np.int32(american))

    def warp(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american):
        """Level t -> level t-k."""
        out_w = self.config.warp_w - k
        grid = ((t - k + 1 + out_w - 1) // out_w, 1)
        self._warp.prepared_async_call(grid, (32, 1, 1), self.rt.stream, vin, vout, lb, r,
                                       np.int32(t), np.int32(k), pu, pd, strike, sign,
                                       np.int32(american))

    def mid(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american):
        """Level t -> level t-k through the tiled kernel in the mid shape."""
        out_w = self.config.mid_w - k
        grid = ((t - k + 1 + out_w - 1) // out_w, 1)
        self._mid.prepared_async_call(grid, (self.config.mid_b, 1, 1), self.rt.stream, vin, vout,
                                      lb, r, np.int32(t), np.int32(k), pu, pd, strike, sign,
                                      np.int32(american))

    def synchronize(self):
        self.rt.stream.synchronize()
