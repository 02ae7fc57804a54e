"""GpuConfig: the shapes and thresholds of the single-option GPU regimes (cuda/binomial.cu).

Per option, as the level narrows (t = steps still to take = level width - 1):
- tiled       while t > t1: tiled_k steps fused per launch, tiled_b threads x tiled_vt nodes each;
- persistent  below that, ONE launch down to t2 (hybrid, batch) or 0 (gpu): warp tiles of
              32 x pers_vt nodes in registers exchanging pers_k-node halos every pers_k steps, and
              below pers_narrow_below a second launch with tiles of 32 x pers_narrow_vt nodes;
- CPU tail    (hybrid, batch) the last level of <= t2 + 1 nodes on the host.
If the persistent kernel gives up waiting for a neighbour (its blocks were not all resident), the
engine falls back to the tiled kernel in a narrow shape (mid_b threads x mid_vt nodes, mid_k steps
per launch). warp_vt and warp_k shape the warp-per-block kernel, which only `pricer bench gpu`
runs (Cao (2025), Table 5). fma=False is the exact mode: every product and sum rounded on its own,
in the serial engine's order, so prices are bitwise the CPU engines'.
hw_flat_rows and hw_flat_threads are the Hull-White family's rule between its two GPU strategies
and GPU-FLAT's block (pricer/engines/gpu/trinomial.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GpuConfig:
    t1: int = 200_000         # tiled while t > t1
    t2: int = 500             # hybrid/batch: the CPU tail below this width
    tiled_b: int = 256        # threads per tiled block
    tiled_vt: int = 8         # nodes per thread (tiled)
    tiled_k: int = 256        # steps fused per tiled launch (< tiled_b * tiled_vt)
    warp_vt: int = 8          # nodes per lane (warp per block; `pricer bench gpu` only)
    warp_k: int = 64          # steps per warp launch while the level is wider than one tile
    mid_b: int = 256          # the fallback below t1: the tiled kernel in a narrow shape (mid_b
    mid_vt: int = 2           # threads x mid_vt nodes, mid_k steps per launch, the whole rest in
    mid_k: int = 256          # one launch once the level fits one tile)
    pers_vt: int = 8          # the persistent kernel: warp tiles of 32 x pers_vt nodes exchanging
    pers_k: int = 64          # pers_k-node halos every pers_k steps, pers_warps warps per block
    pers_warps: int = 4
    pers_narrow_vt: int = 4   # levels t <= pers_narrow_below: tiles of 32 x pers_narrow_vt nodes
    pers_narrow_below: int | None = None  # (same pers_k), more and smaller tiles where the wide
                              # ones leave SM sub-partitions idle; None: where the wide tiles fill
                              # half of them; 0: one shape
    wavefront_block: int = 256   # `pricer bench gpu` only: threads per block, one launch a step
    fma: bool = True          # fused multiply-adds (False: the exact mode, bitwise equal to serial)
    cpu_max_steps: int | None = None  # hybrid: options with steps <= this on the CPU (None: t2)
    # the Hull-White family (cuda/trinomial.cu, pricer/engines/gpu/trinomial.py), under `auto`:
    hw_flat_rows: int = 1024    # trees of at most this many rows by GPU-FLAT, wider by GPU-OUTER
    hw_flat_threads: int = 128  # GPU-FLAT's block (more where a tree needs it; two rows a thread)

    @property
    def tiled_w(self) -> int:
        return self.tiled_b * self.tiled_vt

    @property
    def warp_w(self) -> int:
        return 32 * self.warp_vt

    @property
    def mid_w(self) -> int:
        return self.mid_b * self.mid_vt

    @property
    def pers_w(self) -> int:
        return 32 * self.pers_vt

    def check(self) -> "GpuConfig":
        if not (1 <= self.tiled_k < self.tiled_w):
            raise ValueError(f"tiled_k must be in [1, {self.tiled_w - 1}], got {self.tiled_k}")
        if not (1 <= self.warp_k < self.warp_w):
            raise ValueError(f"warp_k must be in [1, {self.warp_w - 1}], got {self.warp_k}")
        if self.mid_b % 32 or not (32 <= self.mid_b <= 1024) or self.mid_vt < 1:
            raise ValueError("mid_b must be a multiple of 32 in [32, 1024], mid_vt >= 1")
        if not (1 <= self.mid_k < self.mid_w):
            raise ValueError(f"mid_k must be in [1, {self.mid_w - 1}], got {self.mid_k}")
        if not (1 <= self.pers_vt <= 32 and self.pers_k % self.pers_vt == 0
                and 2 <= self.pers_k < self.pers_w and 1 <= self.pers_warps <= 32):
            raise ValueError("persistent kernel: pers_vt in [1, 32], pers_k a multiple of pers_vt "
                             f"in [2, {self.pers_w - 1}], pers_warps in [1, 32]; got "
                             f"{self.pers_vt}/{self.pers_k}/{self.pers_warps}")
        if self.pers_narrow_vt and not (
                1 <= self.pers_narrow_vt <= 32 and self.pers_k % self.pers_narrow_vt == 0
                and self.pers_k < 32 * self.pers_narrow_vt
                and (self.pers_narrow_below is None or self.pers_narrow_below >= 0)):
            raise ValueError("persistent kernel's narrow shape: pers_narrow_vt in [1, 32] (or 0: "
                             "off) dividing pers_k, with pers_k < 32 * pers_narrow_vt, and "
                             f"pers_narrow_below >= 0 (or None); got {self.pers_narrow_vt}, pers_k "
                             f"{self.pers_k}, {self.pers_narrow_below}")
        if self.t1 < 0 or self.t2 < 0:
            raise ValueError("t1 and t2 must be >= 0")
        if self.tiled_b % 32 or not (32 <= self.tiled_b <= 1024):
            raise ValueError("tiled_b must be a multiple of 32 in [32, 1024]")
        if not 0 <= self.hw_flat_rows <= 1024:
            raise ValueError("hw_flat_rows must be in [0, 1024]")
        if self.hw_flat_threads % 32 or not (32 <= self.hw_flat_threads <= 512):
            raise ValueError("hw_flat_threads must be a multiple of 32 in [32, 512]")
        return self

    def defines(self) -> list[str]:
        """The -D options of cuda/binomial.cu for this configuration."""
        return [f"-DPRICER_FMA={int(self.fma)}", f"-DTILED_B={self.tiled_b}",
                f"-DTILED_VT={self.tiled_vt}", f"-DWARP_VT={self.warp_vt}",
                f"-DPERS_VT={self.pers_vt}", f"-DPERS_K={self.pers_k}",
                f"-DPERS_WARPS={self.pers_warps}"]

    def narrow(self) -> "GpuConfig | None":
        """The configuration of the persistent kernel's narrow shape (None: one shape only)."""
        if not (self.pers_narrow_vt and self.pers_narrow_below != 0):
            return None
        return replace(self, pers_vt=self.pers_narrow_vt, pers_narrow_vt=0)

    def mid_defines(self) -> list[str]:
        """The module whose tiled_steps runs the fallback (TILED_B/VT = mid_b/mid_vt)."""
        return [f"-DPRICER_FMA={int(self.fma)}", f"-DTILED_B={self.mid_b}",
                f"-DTILED_VT={self.mid_vt}", f"-DWARP_VT={self.warp_vt}"]
