"""A numpy emulation of cuda/binomial.cu's single-option kernels, with the same tiles, halos and
guards (exact arithmetic, as the GPU's exact mode), so that GpuEngine.price_one's schedule and
the kernels' index logic can be checked on a machine without a GPU: GpuEngine(mode,
config=GpuConfig(fma=False, ...), kernels=NumpyKernels(config))."""

from __future__ import annotations

import numpy as np

from pricer.engines.cpu.kernels import UNDERFLOW


class NumpyKernels:
    """A numpy emulation of cuda/binomial.cu with the same tiles, halos and guards (exact
    arithmetic, as fma=False), so the schedule and the index logic can be checked without a GPU."""

    def __init__(self, config):
        self.config = config
        self._bufs = None
        self._narrow = None

    def narrow_kernels(self):
        """As CudaKernels.narrow_kernels: the same emulation (and stand-in tile count) in the
        narrow shape."""
        if self._narrow is None and self.config.narrow() is not None:
            self._narrow = type(self)(self.config.narrow())
            self._narrow.pers_tiles = self.pers_tiles
            self._narrow.sub_partitions_count = self.sub_partitions_count
        return self._narrow

    def reserve(self, nodes):
        if self._bufs is None or self._bufs[0].size < nodes:
            self._bufs = [np.zeros(nodes), np.zeros(nodes), np.zeros(2 * nodes)]
        return self._bufs

    @staticmethod
    def split_tables(tab, steps: int):
        return tab[:steps + 1], tab[steps + 1:2 * steps + 2]

    @staticmethod
    def pers_pows(host):
        return host.copy()

    @staticmethod
    def host_array(size: int) -> np.ndarray:
        return np.empty(size)

    def upload(self, dst, host):
        dst[:host.size] = host

    def download(self, host, src):
        host[:] = src[:host.size]

    def synchronize(self):
        pass

    def terminal(self, v, lb, r, steps, strike, sign):
        payoff = sign * (lb[steps] * r[:steps + 1] - strike)
        v[:steps + 1] = np.where(payoff > 0.0, payoff, 0.0)

    @staticmethod
    def _node(pu, pd, up, down, sbase, r, mstrike, american):
        hold = pu * up + pd * down
        hold = np.where(hold >= UNDERFLOW, hold, 0.0)
        if american:
            ex = sbase * r + mstrike
            return np.where(ex > hold, ex, hold)
        return hold

    def wavefront(self, vin, vout, lb, r, t, pu, pd, strike, sign, american):
        n = t + 1
        vout[:n] = self._node(pu, pd, vin[1:n + 1], vin[:n], sign * lb[t], r[:n], -sign * strike,
                              american)

    def _tiles(self, vin, vout, lb, r, t, k, pu, pd, strike, sign, american, width, vt, warp):
        out_w = width - k
        blocks = (t - k + 1 + out_w - 1) // out_w
        g = np.arange(blocks)[:, None] * out_w + np.arange(width)[None, :]
        inside = g <= t
        gi = np.where(inside, g, 0)
        v = np.where(inside, vin[gi], 0.0)
        rr = np.where(inside, r[gi], 0.0) if american else np.zeros_like(v)
        mstrike = -sign * strike
        exercised = american & self._may_exercise(lb, r, t, k, np.arange(blocks) * out_w, width,
                                                   strike, sign)[:, None]
        for s in range(1, k + 1):
            up = np.empty_like(v)
            up[:, :-1] = v[:, 1:]
            # the last node's neighbour: lane 31's own v[0] (shuffle) or the zeroed halo slot
            up[:, -1] = v[:, width - vt] if warp else 0.0
            hold = self._node(pu, pd, up, v, 0.0, rr, mstrike, False)
            v = (np.where(exercised, self._node(pu, pd, up, v, sign * lb[t - s], rr, mstrike, True),
                          hold) if american else hold)
        keep = (np.arange(width)[None, :] < out_w) & (g <= t - k)
        written = g[keep]
        # on the GPU the blocks run in any order: every output node written exactly once
        if written.size != t - k + 1 or not np.array_equal(np.sort(written), np.arange(t - k + 1)):
            raise AssertionError(f"tiles write {written.size} nodes for a level of {t - k + 1}")
        vout[written] = v[keep]

    @staticmethod
    def _may_exercise(lb, r, t, k, first, width, strike, sign):
        """cuda/binomial.cu may_exercise, per block: blocks that cannot exercise in these k steps
        run the European body there."""
        last = np.minimum(first + width - 1, t)
        inside = first <= t
        l_a, l_b = lb[max(t - 1, 0)], lb[max(t - k, 0)]
        r_a, r_b = r[np.where(inside, first, 0)], r[np.where(inside, last, 0)]
        if sign < 0.0:
            may = min(l_a, l_b) * np.minimum(r_a, r_b) < strike * (1.0 + 1e-9)
        else:
            may = max(l_a, l_b) * np.maximum(r_a, r_b) > strike * (1.0 - 1e-9)
        return inside & may

    def pers_top(self) -> int:
        """As CudaKernels.pers_top, for a stand-in GPU of `pers_tiles` tiles."""
        c = self.config
        return self.pers_tiles * (c.pers_w - c.pers_k) - 1

    pers_tiles = 64
    sub_partitions_count = 4     # the stand-in GPU's SM sub-partitions

    def sub_partitions(self) -> int:
        return self.sub_partitions_count

    def pers_failed(self) -> bool:
        return False

    def pers(self, vin, vout, lb, r, pows, t, stop, pu, pd, strike, sign, american, scaled,
             skip_lim=np.nan):
        """cuda/binomial.cu pers_steps (exact arithmetic, as every kernel here: `scaled` and the
        scaled arithmetic's skip_lim are ignored): tiles of W =
        32 * pers_vt nodes owning OUT = W - pers_k output nodes each, epochs of k <= pers_k steps,
        each tile's halo the right neighbour's first pers_k nodes of the epoch's start level."""
        c = self.config
        width, vt, kk = c.pers_w, c.pers_vt, c.pers_k
        out_w = width - kk
        tiles = (t - min(kk, t - stop) + out_w) // out_w
        assert tiles <= self.pers_tiles
        a0 = np.arange(tiles) * out_w
        g = a0[:, None] + np.arange(width)[None, :]
        inside = g <= t
        gi = np.where(inside, g, 0)
        v = np.where(inside, vin[gi], 0.0)
        rr = np.where(inside, r[gi], 0.0) if american else np.zeros_like(v)
        mstrike = -sign * strike
        e = 0
        while t > stop:
            k = min(kk, t - stop)
            if e > 0:
                # the halo: tile j+1's first pers_k nodes of level t where it has any (it computed
                # the last epoch), else zeros
                has = np.r_[a0[1:] <= t, False]
                halo = np.zeros((tiles, kk))
                halo[:-1] = v[1:, :kk]
                v[:, out_w:] = np.where(has[:, None], halo, 0.0)
            for s in range(1, k + 1):
                up = np.empty_like(v)
                up[:, :-1] = v[:, 1:]
                up[:, -1] = v[:, width - vt]          # lane 31's shuffle returns its own v[0]
                v = self._node(pu, pd, up, v, sign * lb[t - s], rr, mstrike, american)
            t -= k
            e += 1
        keep = (np.arange(width)[None, :] < out_w) & (g <= stop)
        written = g[keep]
        if written.size != stop + 1 or not np.array_equal(np.sort(written), np.arange(stop + 1)):
            raise AssertionError(f"tiles write {written.size} nodes for a level of {stop + 1}")
        vout[written] = v[keep]

    def tiled(self, vin, vout, lb, r, t, k, *args):
        c = self.config
        self._tiles(vin, vout, lb, r, t, k, *args, c.tiled_w, c.tiled_vt, warp=False)

    def warp(self, vin, vout, lb, r, t, k, *args):
        c = self.config
        self._tiles(vin, vout, lb, r, t, k, *args, c.warp_w, c.warp_vt, warp=True)

    def mid(self, vin, vout, lb, r, t, k, *args):
        c = self.config
        self._tiles(vin, vout, lb, r, t, k, *args, c.mid_w, c.mid_vt, warp=False)
