// pricer GPU kernels: backward induction on one binomial lattice, FP64 throughout.
//
// Level t holds nodes 0..t (node i = i up-moves).  One backward step:
//     hold      = pu * V[t+1][i+1] + pd * V[t+1][i]
//     exercise  = sign * (level_base[t] * ratio[i] - strike)        (American only)
//     V[t][i]   = exercise > hold ? exercise : hold
// level_base[t] = spot * exp(t * log_down) and ratio[i] = exp(i * (log_up - log_down)) are tables
// built once per option on the host (pricer.engines.serial.power_tables); asset prices are never
// updated incrementally.  Every kernel takes the
// per-option numbers as arguments (pu, pd, strike, sign, american, tables), so any tree type that
// produces them reuses these kernels unchanged.
//
// Arithmetic: with PRICER_FMA=0 (default) every product and sum is rounded on its own
// (__dmul_rn/__dadd_rn forbid contraction into FMA), the exact operation sequence of the serial CPU
// engine, so the prices are bitwise equal to it when the tables are the host's.  PRICER_FMA=1 lets
// hold and exercise use fused multiply-adds (fewer instructions, results differ by rounding only).
//
// Kernels:
//   terminal_values  payoff at maturity
//   wavefront_step   one launch per time step, one thread per node (baseline)
//   tiled_steps      K steps fused per launch; TILED_B threads x TILED_VT nodes per thread in
//                    registers, neighbour through a double-buffered shared-memory halo (one
//                    __syncthreads per step; shared memory holds only the halo); each block writes only its exact valid region
//   warp_steps       32-thread blocks, WARP_VT nodes per thread in registers, neighbour through
//                    __shfl_down_sync; no shared memory, no __syncthreads; many steps per launch
//   pers_steps       persistent: one launch for all the narrow levels, warp tiles exchanging
//                    PERS_K-node halos through memory every PERS_K steps (below)
// Level buffers are double-buffered (in -> out) because a block's halo overlaps the next block's
// output region.
//
// -D parameters (the GPU engine passes them from its configuration; the defaults below are its
// defaults): PRICER_FMA (0: the exact mode, 1: fused multiply-adds), TILED_B, TILED_VT, WARP_VT,
// PERS_VT, PERS_K, PERS_WARPS.

#ifndef PRICER_FMA
#define PRICER_FMA 0
#endif
#ifndef TILED_B
#define TILED_B 256
#endif
#ifndef TILED_VT
#define TILED_VT 4
#endif
#ifndef WARP_VT
#define WARP_VT 8
#endif

#define TILED_W (TILED_B * TILED_VT)
#define WARP_W (32 * WARP_VT)

// Values below 2^-963 become 0, as in the CPU engines (serial.UNDERFLOW: subnormals are slow there).
// hold >= 0 always, so comparing the high word as an integer is the same test without an FP64 op.
__device__ __forceinline__ double flush_tiny(double hold)
{
    return __double2hiint(hold) < 0x03C00000 ? 0.0 : hold;
}

__device__ __forceinline__ double hold_value(double pu, double pd, double v_up, double v_down)
{
#if PRICER_FMA
    return flush_tiny(fma(pu, v_up, pd * v_down));
#else
    return flush_tiny(__dadd_rn(__dmul_rn(pu, v_up), __dmul_rn(pd, v_down)));
#endif
}

// sbase = sign * level_base[t], mstrike = -sign * strike: sign is +-1, so
// sbase * r + mstrike == sign * (level_base[t] * r - strike) exactly (negation is exact).
__device__ __forceinline__ double exercise_value(double sbase, double r, double mstrike)
{
#if PRICER_FMA
    return fma(sbase, r, mstrike);
#else
    return __dadd_rn(__dmul_rn(sbase, r), mstrike);
#endif
}

template <bool AMERICAN>
__device__ __forceinline__ double node(double pu, double pd, double v_up, double v_down,
                                       double sbase, double r, double mstrike)
{
    double hold = hold_value(pu, pd, v_up, v_down);
    if (AMERICAN) {
        double exercise = exercise_value(sbase, r, mstrike);
        return exercise > hold ? exercise : hold;
    }
    return hold;
}

// ---------------------------------------------------------------------------------------------
// level_base for the fused steps, without a global load on every step's critical path: each warp
// keeps 32 consecutive entries in a register (lane j holds level_base[t - (s0 + 1 + j)]) and the
// next 32 in flight; step s reads its entry with a shuffle.  All 32 lanes must call next().

struct LevelBaseCache {
    const double* __restrict__ table;
    int t, lane;
    double cur, nxt;
    __device__ __forceinline__ double at(int idx) const { return idx >= 0 ? table[idx] : 0.0; }
    __device__ __forceinline__ LevelBaseCache(const double* __restrict__ tab, int t_, int lane_)
        : table(tab), t(t_), lane(lane_)
    {
        cur = at(t - 1 - lane);
        nxt = at(t - 33 - lane);
    }
    // level_base[t - s] for step s = 1, 2, ... (called once per step, in order)
    __device__ __forceinline__ double next(int s)
    {
        const int j = (s - 1) & 31;
        if (j == 0 && s > 1) {
            cur = nxt;
            nxt = at(t - s - 32 - lane);
        }
        return __shfl_sync(0xffffffffu, cur, j);
    }
};

// ---------------------------------------------------------------------------------------------
// Whether any node of a block can be worth exercising in the k steps of a launch from level t.
// The block's input nodes are [first, first + width) (those above t are halo and feed no stored
// output); step s computes level t - s with level_base[t - s].  Asset prices
// S = level_base[l] * ratio[i] are monotone in l and in i, so their extremes lie at the corners.  A
// put's exercise value K - S is negative where S > K, a call's S - K where S < K; there
// max(hold, exercise) is hold, bit for bit (hold >= 0), so such a block runs the European body and
// stores the same values with half the FP64 work per node.  The relative margin of 1e-9 covers the
// tables' few ulp.

// The test itself, on the extreme level bases (l_a, l_b: the first and last level) and ratios
// (r_lo <= r_hi) of the nodes in question; the persistent kernel calls it with those it holds.
__device__ __forceinline__ bool may_exercise_within(double l_a, double l_b, double r_lo, double r_hi,
                                                    double strike, double sign)
{
    if (sign < 0.0)
        return fmin(l_a, l_b) * r_lo < strike * (1.0 + 1e-9);
    return fmax(l_a, l_b) * r_hi > strike * (1.0 - 1e-9);
}

__device__ __forceinline__ bool may_exercise(const double* __restrict__ level_base,
                                             const double* __restrict__ ratio, int t, int k,
                                             long long first, int width, double strike, double sign)
{
    if (first > t) return false;   // halo only: nothing stored
    const long long last = min(first + width - 1, (long long)t);
    const double l_a = level_base[max(t - 1, 0)], l_b = level_base[max(t - k, 0)];
    const double r_a = ratio[first], r_b = ratio[last];
    return may_exercise_within(l_a, l_b, fmin(r_a, r_b), fmax(r_a, r_b), strike, sign);
}

// ---------------------------------------------------------------------------------------------
// Payoff.

extern "C" __global__ void terminal_values(double* __restrict__ values,
                                           const double* __restrict__ level_base,
                                           const double* __restrict__ ratio,
                                           int steps, double strike, double sign)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= steps) {
        double payoff = sign * __dadd_rn(__dmul_rn(level_base[steps], ratio[i]), -strike);
        values[i] = payoff > 0.0 ? payoff : 0.0;
    }
}

// ---------------------------------------------------------------------------------------------
// Wavefront: level t+1 (in) -> level t (out), one thread per node.

template <bool AMERICAN>
__device__ __forceinline__ void wavefront_body(const double* __restrict__ vin, double* __restrict__ vout,
                                               const double* __restrict__ level_base,
                                               const double* __restrict__ ratio, int t, double pu,
                                               double pd, double strike, double sign)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= t) {
        double r = AMERICAN ? ratio[i] : 0.0;
        vout[i] = node<AMERICAN>(pu, pd, vin[i + 1], vin[i], sign * level_base[t], r, -sign * strike);
    }
}

extern "C" __global__ void wavefront_step(const double* __restrict__ vin, double* __restrict__ vout,
                                          const double* __restrict__ level_base,
                                          const double* __restrict__ ratio, int t, double pu,
                                          double pd, double strike, double sign, int american)
{
    if (american)
        wavefront_body<true>(vin, vout, level_base, ratio, t, pu, pd, strike, sign);
    else
        wavefront_body<false>(vin, vout, level_base, ratio, t, pu, pd, strike, sign);
}

// ---------------------------------------------------------------------------------------------
// Tiled: level t (in, nodes 0..t) -> level t-k (out, nodes 0..t-k), 1 <= k <= TILED_W - 1.
// Block b reads nodes [b*(W-k), b*(W-k)+W) and writes its valid outputs [b*(W-k), b*(W-k)+W-k).
// Thread j holds nodes j*VT .. j*VT+VT-1 of the tile.  After s steps the local nodes < W-s are
// exact; the rest (the halo) is garbage that is never stored.

template <bool AMERICAN>
__device__ __forceinline__ void tiled_body(const double* __restrict__ vin, double* __restrict__ vout,
                                           const double* __restrict__ level_base,
                                           const double* __restrict__ ratio, int t, int k,
                                           double pu, double pd, double strike, double sign)
{
    __shared__ double halo[2][TILED_B + 1];
    const int tid = threadIdx.x;
    const int out_w = TILED_W - k;
    const long long start = (long long)blockIdx.x * out_w;
    const long long base = start + (long long)tid * TILED_VT;

    // Each thread loads its own strip of VT consecutive nodes (and their ratios); the warp's
    // requests cover one contiguous stretch, so the L1 serves the strided loads.
    double v[TILED_VT], r[TILED_VT];
#pragma unroll
    for (int q = 0; q < TILED_VT; ++q) {
        long long g = base + q;
        bool in = g <= (long long)t;
        v[q] = in ? vin[g] : 0.0;
        r[q] = (AMERICAN && in) ? ratio[g] : 0.0;
    }
    if (tid == 0) {
        halo[0][TILED_B] = 0.0;
        halo[1][TILED_B] = 0.0;
    }
    const double mstrike = -sign * strike;
    // The level base, off the per-step chain: lane l of each warp holds the pre-signed
    // sign * level_base[t - (c + 1 + l)] for the chunk of steps c+1 .. c+32 (cur) and the next chunk
    // (nxt); refilled once per chunk, outside the step loop (no per-step branch or address math),
    // and each step's base is shuffled out one step ahead, so the shuffle is not between the
    // barrier and the node.  sign is +-1, so the pre-signed value is the one the step used before.
    const int lane = tid & 31;
    double cur = 0.0, nxt = 0.0, sb = 0.0;
    if (AMERICAN) {
        const int i0 = t - 1 - lane, i1 = t - 33 - lane;
        cur = i0 >= 0 ? sign * level_base[i0] : 0.0;
        nxt = i1 >= 0 ? sign * level_base[i1] : 0.0;
        sb = __shfl_sync(0xffffffffu, cur, 0);
    }

    for (int c = 0; c < k; c += 32) {
        const int n = min(32, k - c);
        for (int j = 0; j < n; ++j) {
            const int s = c + j + 1;
            const double sbase = sb;
            if (AMERICAN)   // step s+1's base; after lane 31 of cur comes lane 0 of nxt
                sb = __shfl_sync(0xffffffffu, j < 31 ? cur : nxt, (j + 1) & 31);
            // Double-buffered halo: the write of step s+2 into the same buffer cannot overtake a
            // read of step s, because the barrier of step s+1 lies between them.
            halo[s & 1][tid] = v[0];
            __syncthreads();
            const double nb = halo[s & 1][tid + 1];
#pragma unroll
            for (int q = 0; q < TILED_VT - 1; ++q)
                v[q] = node<AMERICAN>(pu, pd, v[q + 1], v[q], sbase, r[q], mstrike);
            v[TILED_VT - 1] = node<AMERICAN>(pu, pd, nb, v[TILED_VT - 1], sbase, r[TILED_VT - 1], mstrike);
        }
        if (AMERICAN) {
            cur = nxt;
            const int i1 = t - c - 65 - lane;
            nxt = i1 >= 0 ? sign * level_base[i1] : 0.0;
        }
    }

    const long long last_out = (long long)t - k;
#pragma unroll
    for (int q = 0; q < TILED_VT; ++q) {
        int local = tid * TILED_VT + q;
        long long g = start + local;
        if (local < out_w && g <= last_out) vout[g] = v[q];
    }
}

extern "C" __global__ void __launch_bounds__(TILED_B)
tiled_steps(const double* __restrict__ vin, double* __restrict__ vout,
            const double* __restrict__ level_base, const double* __restrict__ ratio, int t, int k,
            double pu, double pd, double strike, double sign, int american)
{
    if (american && may_exercise(level_base, ratio, t, k, (long long)blockIdx.x * (TILED_W - k),
                                 TILED_W, strike, sign))
        tiled_body<true>(vin, vout, level_base, ratio, t, k, pu, pd, strike, sign);
    else
        tiled_body<false>(vin, vout, level_base, ratio, t, k, pu, pd, strike, sign);
}

// ---------------------------------------------------------------------------------------------
// Warp per block: the same tiling with one warp per block, W = 32 * WARP_VT, 1 <= k <= W - 1.
// The neighbour of a lane's last node is the next lane's first node, fetched with
// __shfl_down_sync; lane 31 gets its own value back (halo garbage, never stored).  A level that
// fits in one tile (t + 1 <= W) finishes all its remaining steps in one launch.

template <bool AMERICAN>
__device__ __forceinline__ void warp_body(const double* __restrict__ vin, double* __restrict__ vout,
                                          const double* __restrict__ level_base,
                                          const double* __restrict__ ratio, int t, int k,
                                          double pu, double pd, double strike, double sign)
{
    const int lane = threadIdx.x;
    const int out_w = WARP_W - k;
    const long long start = (long long)blockIdx.x * out_w;
    const long long base = start + lane * WARP_VT;
    double v[WARP_VT], r[WARP_VT];
#pragma unroll
    for (int q = 0; q < WARP_VT; ++q) {
        long long g = base + q;
        bool in = g <= (long long)t;
        v[q] = in ? vin[g] : 0.0;
        r[q] = (AMERICAN && in) ? ratio[g] : 0.0;
    }
    const double mstrike = -sign * strike;
    LevelBaseCache lbc(level_base, t, lane);
    for (int s = 1; s <= k; ++s) {
        const double nb = __shfl_down_sync(0xffffffffu, v[0], 1);
        const double sbase = AMERICAN ? sign * lbc.next(s) : 0.0;
#pragma unroll
        for (int q = 0; q < WARP_VT - 1; ++q)
            v[q] = node<AMERICAN>(pu, pd, v[q + 1], v[q], sbase, r[q], mstrike);
        v[WARP_VT - 1] = node<AMERICAN>(pu, pd, nb, v[WARP_VT - 1], sbase, r[WARP_VT - 1], mstrike);
    }
    const long long last_out = (long long)t - k;
#pragma unroll
    for (int q = 0; q < WARP_VT; ++q) {
        int local = lane * WARP_VT + q;
        long long g = start + local;
        if (local < out_w && g <= last_out) vout[g] = v[q];
    }
}

extern "C" __global__ void __launch_bounds__(32)
warp_steps(const double* __restrict__ vin, double* __restrict__ vout,
           const double* __restrict__ level_base, const double* __restrict__ ratio, int t, int k,
           double pu, double pd, double strike, double sign, int american)
{
    if (american && may_exercise(level_base, ratio, t, k, (long long)blockIdx.x * (WARP_W - k),
                                 WARP_W, strike, sign))
        warp_body<true>(vin, vout, level_base, ratio, t, k, pu, pd, strike, sign);
    else
        warp_body<false>(vin, vout, level_base, ratio, t, k, pu, pd, strike, sign);
}

// ---------------------------------------------------------------------------------------------
// Persistent narrow regime: ONE launch from level t (in) down to level t_stop (out), no launch
// gaps and no block barrier per step.
//
// Tile j = warp (blockIdx.x * PERS_WARPS + warp index) owns the output nodes [j*OUT, j*OUT + OUT),
// OUT = PERS_W - PERS_K, for the whole launch (node i of level t-1 sits above nodes i, i+1 of
// level t, so a node never moves); lane l keeps nodes j*OUT + l*VT .. + VT-1 in registers and
// takes its last node's upper neighbour from lane l+1 by __shfl_down_sync.  An epoch is
// k = min(PERS_K, t - t_stop) steps: at its start the tile needs level t on [j*OUT, j*OUT + PERS_W)
// -- its own OUT nodes (registers) and the first PERS_K nodes of tile j+1, which its top
// PERS_K/VT lanes load -- and after k steps its own nodes hold level t-k (the halo's garbage
// never reaches them).  So a tile depends only on its right neighbour's previous epoch.
//
// Exchange, LL style (as NCCL's low-latency protocol): after an epoch tile j stores its first
// PERS_K nodes into its ring slot e % PERS_D, each double as one 16-byte store {lo, flag, hi, flag}
// whose two 8-byte halves are each single-copy atomic, flag = gen << 20 | e.  The reader polls
// until both flags of a value match: no fence, no separate flag, one L2 round trip when the data
// is there.  Back-pressure: before overwriting slot e % PERS_D (epoch e - PERS_D's data) tile j
// waits until tile j-1 has published progress >= e - PERS_D + 1 (it stores that after reading).
// gen (1..4095) changes every launch, so words of earlier launches never match; the host zeroes
// the ring and progress words when gen wraps.  Epochs of one launch < 2^20 (host checks).
// Where tile j-1 is a warp of the same block, ring slots and progress word live in the block's
// shared memory instead (zeroed at the launch's start; the ring's words are then addressed
// generically); the global ones carry only the hops between blocks, the slowest link.  The whole
// warp polls, one vote per round, so that it never diverges around the wait.
//
// Never hangs: the host launches only as many blocks as fit on the GPU at once (registers,
// threads, blocks per SM), tiles that run out of nodes stop only when no neighbour needs them any
// more (tile j-1 waits for tile j at epoch e only if tile j has nodes at level t_e, i.e. computed
// epoch e-1), and every wait gives up after PERS_SPIN = 2^26 polls (each an L2 round trip, so
// seconds to tens of seconds): the tile then writes NaN over its output nodes and sets *status,
// so the host raises instead of returning a price.
//
// Arithmetic: PRICER_FMA=0 uses node() (bitwise the serial engine's operations); PRICER_FMA=1 with
// scaled != 0 works, inside an epoch, on X = V / pd^s (s = steps into the epoch):
//     X(i) = max(exercise(i) / pd^s, a * X(i+1) + X(i)),   a = pu / pd,
// one DFMA for the hold instead of DMUL + DFMA + the underflow flush (FP64 denormals cost the GPU
// nothing; values below 2^-963 differ from the CPU engines' zero by less than 2^-963), and
// V = X * pd^k at the epoch's end.  pows = pd^0..pd^PERS_K, then pd^-0..pd^-PERS_K (host, long
// double, rounded once).  The rounding of a acts as pu (1 + 2^-53): ~N/2 * 1.1e-16 relative at most.

#ifndef PERS_VT
#define PERS_VT 8
#endif
#ifndef PERS_K
#define PERS_K 64
#endif
#ifndef PERS_WARPS
#define PERS_WARPS 4
#endif
#define PERS_W (32 * PERS_VT)
#define PERS_OUT (PERS_W - PERS_K)
#define PERS_HL (PERS_K / PERS_VT)          // halo lanes (top) = publishing lanes (bottom)
#define PERS_D 4                             // ring slots per tile
#define PERS_KC ((PERS_K + 31) / 32)         // 32-step chunks of one epoch
#define PERS_SPIN (1 << 26)
#define PERS_PF 8                            // steps before an epoch's end its next halo is loaded
#define PERS_UNROLL 8                        // unroll of an epoch's steps

static_assert(PERS_K % PERS_VT == 0 && PERS_K >= PERS_VT && PERS_K < PERS_W,
              "PERS_K must be a multiple of PERS_VT in [PERS_VT, 32 * PERS_VT)");

// Neighbour tiles of one block (warps w and w+1) exchange halos and progress through a ring in the
// block's shared memory, the same protocol as the global ring; only the hops between blocks go
// through global memory (L2).  The words are therefore addressed generically (no state space in
// the volatile loads and stores below).
__device__ __forceinline__ void ll_store(uint4* p, double v, unsigned flag)
{
    asm volatile("st.volatile.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(__double2loint(v)), "r"(flag), "r"(__double2hiint(v)), "r"(flag)
                 : "memory");
}

__device__ __forceinline__ uint4 ll_load(const uint4* p)
{
    uint4 w;
    asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
    return w;
}

__device__ __forceinline__ unsigned ld_volatile_u32(const unsigned* p)
{
    unsigned x;
    asm volatile("ld.volatile.u32 %0, [%1];" : "=r"(x) : "l"(p) : "memory");
    return x;
}

// A ring slot holds the first PERS_K nodes of a level: node w * PERS_VT + q (publishing lane w,
// its node q) at word PERS_SLOT_WORD(w, q), q-major, so that the 8 lanes of one store or load
// touch 128 contiguous bytes (one line, no shared-memory bank conflicts) instead of 8 lines 128
// bytes apart.  Halo lane l reads publishing lane l - (32 - PERS_HL).
#define PERS_SLOT_WORD(w, q) ((q) * PERS_HL + (w))
#define PERS_HALO_WORD(lane, q) PERS_SLOT_WORD((lane) - (32 - PERS_HL), q)
// European tiles: an American tile whose nodes cannot be worth exercising during an epoch (the
// test of may_exercise, on the level_base and ratio values the steps use, over the epoch's extreme
// levels and the tile's extreme ratios) runs that epoch's steps with the European node, bit for
// bit the same values: there every computed exercise value is negative (the 1e-9 margin covers
// the roundings of level_base * sign / pd^s and -sign * strike / pd^s, a few ulps, and pd^-s > 0
// keeps the sign), hold >= +0, so the max is hold.  Such tiles (a put's above the strike, a
// call's below) take about a third of the American node's instructions a step.
//
// Exercised tiles: a put's tile whose W nodes all hold, bit for bit, the exercise value the last
// epoch gave them (its last step took the exercise value at each) skips the epoch's steps: each of its
// nodes is exercised at every step of the epoch, so its values at the epoch's end are the last
// step's exercise values, the same bits.  Why it is exercised: where both successors hold their
// exercise value, exercise - hold = K(1 - pu - pd) - S(1 - pu u - pd d) in exact arithmetic, and the
// host's skip_lim (pers_skip_limit) is an S below which that is positive whatever the rounding
// (NaN: never).  Scaled fma arithmetic only.  Deep in-the-money tiles then cost next to nothing,
// so that more, smaller tiles (the narrow shape) can share the SM sub-partitions from the top.

template <bool B>
struct BoolTag {
    static constexpr bool value = B;
};

// A scaled step's exercise value from its steps_sm entry {sign * level_base / pd^s,
// -sign * strike / pd^s}: every step, the step-ahead values and the exercised tiles take it so.
__device__ __forceinline__ double pers_exercise(double2 st, double r)
{
    return fma(st.x, r, st.y);
}

// The scaled American node's max (hold >= +0)
__device__ __forceinline__ double pers_max(double exercise, double hold)
{
    return exercise > hold ? exercise : hold;
}

template <bool AMERICAN, bool SCALED>
__device__ __forceinline__ double pers_node(double pu, double pd, double up, double down,
                                            double sbase, double r, double mstrike)
{
    if (SCALED) {   // pu is a = pu / pd here; no underflow flush (see above)
        const double hold = fma(pu, up, down);
        return AMERICAN ? pers_max(pers_exercise(make_double2(sbase, mstrike), r), hold) : hold;
    }
    return node<AMERICAN>(pu, pd, up, down, sbase, r, mstrike);
}

template <bool AMERICAN, bool SCALED>
__device__ __forceinline__ void pers_body(const double* __restrict__ vin, double* __restrict__ vout,
                                          const double* __restrict__ level_base,
                                          const double* __restrict__ ratio,
                                          const double* __restrict__ pows, uint4* ring,
                                          unsigned* progress, uint4* sring, unsigned* sprog,
                                          int* status, int t, int t_stop,
                                          double pu, double pd, double strike, double sign,
                                          double skip_lim, unsigned gen, double2* steps_sm)
{
    const unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const int tile = blockIdx.x * PERS_WARPS + (threadIdx.x >> 5);
    const long long a0 = (long long)tile * PERS_OUT;
    const long long base = a0 + (long long)lane * PERS_VT;
    const bool halo_lane = lane >= 32 - PERS_HL;
    double v[PERS_VT], r[PERS_VT];
#pragma unroll
    for (int q = 0; q < PERS_VT; ++q) {
        const long long g = base + q;
        const bool in = g <= (long long)t;
        v[q] = in ? vin[g] : 0.0;
        r[q] = (AMERICAN && in) ? ratio[g] : 0.0;
    }
    // Each step's exercise numbers {sign * level_base[t - s] (scaled: / pd^s), mstrike (scaled:
    // -sign * strike / pd^s)} sit in the warp's steps_sm[s - 1], written at the epoch's start
    // (lane l: steps 32c + l + 1) and read by every lane with one broadcast load per step.
    // level_base is loaded an epoch ahead into lbn.
    const double a = SCALED ? pu / pd : pu;
    double msr[PERS_KC], fac[PERS_KC], lbn[PERS_KC];
#pragma unroll
    for (int c = 0; c < PERS_KC; ++c) {
        const int s = 32 * c + lane + 1;
        const double inv = (SCALED && s <= PERS_K) ? pows[PERS_K + 1 + s] : 1.0;
        msr[c] = SCALED ? (-sign * strike) * inv : -sign * strike;
        fac[c] = SCALED ? sign * inv : sign;
        lbn[c] = AMERICAN ? level_base[max(t - s, 0)] : 0.0;   // levels below 0: never a step's
    }
    const double pd_k = SCALED ? pows[PERS_K] : 1.0;
    // the tile's least and greatest node ratios over the launch (the ratio table increases with i;
    // a tile with no node at level t leaves the loop before it reads them)
    const bool has_nodes = a0 <= (long long)t;
    const double r_lo = (AMERICAN && has_nodes) ? ratio[a0] : 0.0;
    const double r_hi = (AMERICAN && has_nodes) ? ratio[min(a0 + PERS_W - 1, (long long)t)] : 0.0;
    // this tile's ring (it publishes for tile j-1) and tile j+1's, and the progress words: in the
    // block's shared memory where the neighbour is a warp of this block, else in global memory
    const int warp = threadIdx.x >> 5;
    const bool left_local = warp > 0, right_local = warp + 1 < PERS_WARPS;
    uint4* const mine = left_local ? sring + warp * PERS_D * PERS_K
                                   : ring + (size_t)tile * PERS_D * PERS_K;
    const uint4* const right = right_local ? sring + (warp + 1) * PERS_D * PERS_K
                                           : ring + (size_t)(tile + 1) * PERS_D * PERS_K;
    unsigned* const my_progress = right_local ? sprog + warp : progress + tile;   // read by j+1
    const unsigned* const left_progress = left_local ? sprog + warp - 1 : progress + tile - 1;
    unsigned seen = 0;          // the left neighbour's progress last read
    uint4 w[PERS_VT] = {};      // halo lanes: the next epoch's halo words (prefetched)
    bool prefetched = false;
    bool failed = false;
    unsigned e = 0;
    while (t > t_stop) {
        const int k = min(PERS_K, t - t_stop);
        const int tn = t - k;
        if (a0 > (long long)tn) break;             // no node left at level tn (uniform per warp)
        bool may_ex = AMERICAN;
        bool may_skip = false;
        double2 last_ex = make_double2(0.0, 0.0);  // the last epoch's last step's exercise numbers
        if (AMERICAN) {
            // level_base[t - 1] and level_base[max(t - PERS_K, 0)]: the levels of this epoch's k
            // steps lie between them, and level_base is monotone (lbn holds level_base[max(t - s,
            // 0)] for s = 32 c + lane + 1 until it is refilled below)
            const double l_a = __shfl_sync(FULL, lbn[0], 0);
            const double l_b = __shfl_sync(FULL, lbn[PERS_KC - 1], (PERS_K - 1) & 31);
            may_ex = may_exercise_within(l_a, l_b, r_lo, r_hi, strike, sign);
            // an epoch e > 0 follows one of PERS_K steps; skip_lim NaN: the compare is false
            if (SCALED && e > 0 && sign < 0.0 && fmax(l_a, l_b) * r_hi < skip_lim) {
                may_skip = true;
                last_ex = steps_sm[PERS_K - 1];    // read before the refill below overwrites it
            }
            __syncwarp();                          // every lane is done with the last epoch's
#pragma unroll
            for (int c = 0; c < PERS_KC; ++c) {
                const int s = 32 * c + lane + 1;
                if (s <= PERS_K) steps_sm[s - 1] = make_double2(lbn[c] * fac[c], msr[c]);
                lbn[c] = level_base[max(tn - s, 0)];   // the next epoch's, an epoch ahead
            }
            __syncwarp();
        }
        if (e > 0) {
            if (a0 + PERS_OUT <= (long long)t) {  // tile j+1 has nodes at level t: its epoch e-1
                bool late = false;
                const unsigned want = (gen << 20) | (e - 1);
                const uint4* src = right + ((e - 1) % PERS_D) * PERS_K;
                // the whole warp polls, one vote per round, so that it never diverges around the
                // wait (lanes below the halo count as fresh)
                if (halo_lane && !prefetched) {
#pragma unroll
                    for (int q = 0; q < PERS_VT; ++q) w[q] = ll_load(src + PERS_HALO_WORD(lane, q));
                }
                for (int spin = 0;; ++spin) {
                    bool fresh = true;
#pragma unroll
                    for (int q = 0; q < PERS_VT; ++q) fresh = fresh && w[q].y == want && w[q].w == want;
                    if (__all_sync(FULL, fresh || !halo_lane)) break;
                    if (spin >= PERS_SPIN) { late = true; break; }
                    if (halo_lane) {
#pragma unroll
                        for (int q = 0; q < PERS_VT; ++q)
                            if (w[q].y != want || w[q].w != want)
                                w[q] = ll_load(src + PERS_HALO_WORD(lane, q));
                    }
                }
                if (late) { failed = true; break; }       // uniform: every lane saw the same votes
                if (halo_lane) {
#pragma unroll
                    for (int q = 0; q < PERS_VT; ++q) v[q] = __hiloint2double(w[q].z, w[q].x);
                }
                // every halo lane holds its words (the vote above read them) before this store
                if (lane == 0)
                    asm volatile("st.volatile.u32 [%0], %1;"
                                 :: "l"(my_progress), "r"((gen << 20) | e) : "memory");
            } else if (halo_lane) {               // above level t: nothing to read, keep it finite
#pragma unroll
                for (int q = 0; q < PERS_VT; ++q) v[q] = 0.0;
            }
            if (may_skip) {   // every node, the halo's too, holds the last epoch's exercise value
                bool exercised = true;
#pragma unroll
                for (int q = 0; q < PERS_VT; ++q)
                    exercised = exercised && v[q] == pers_exercise(last_ex, r[q]) * pd_k;
                may_skip = __all_sync(FULL, exercised);
            }
        }
        const double msc = -sign * strike;
        // tag: BoolTag<true> for the American node, BoolTag<false> for the European one
        // Scaled American steps: step s's exercise values ex[] were computed during
        // step s-1, so that a step issues its holds, compares and selects back to back instead of
        // waiting, in order, for its table load and exercise DFMAs first.
        double ex[PERS_VT];
        auto exercise_at = [&](int s) {
            const double2 st = steps_sm[min(s, PERS_K - 1)];   // s = k: unused, any entry will do
#pragma unroll
            for (int q = 0; q < PERS_VT; ++q) ex[q] = pers_exercise(st, r[q]);
        };
        auto step = [&](int s, auto tag) {
            constexpr bool AM = decltype(tag)::value;
            const double nb = __shfl_down_sync(FULL, v[0], 1);
            if (AM && SCALED) {
#pragma unroll
                for (int q = 0; q < PERS_VT; ++q) {
                    v[q] = pers_max(ex[q], fma(a, q < PERS_VT - 1 ? v[q + 1] : nb, v[q]));
                }
                exercise_at(s + 1);
                return;
            }
            double sbase = 0.0, mstrike = msc;
            if (AM) {
                const double2 st = steps_sm[s];
                sbase = st.x;
                mstrike = st.y;
            }
#pragma unroll
            for (int q = 0; q < PERS_VT - 1; ++q)
                v[q] = pers_node<AM, SCALED>(a, pd, v[q + 1], v[q], sbase, r[q], mstrike);
            v[PERS_VT - 1] = pers_node<AM, SCALED>(a, pd, nb, v[PERS_VT - 1], sbase,
                                                   r[PERS_VT - 1], mstrike);
        };
        // The next epoch's halo (tile j+1's output of this epoch) is loaded PERS_PF steps before
        // this epoch ends, so its L2 round trip overlaps the last steps; words that were not yet
        // there (flags of an older epoch) are polled again at the next epoch's start.
        const bool reads_next = tn > t_stop && a0 + PERS_OUT <= (long long)tn;
        const int split = (reads_next && k > PERS_PF) ? k - PERS_PF : k;
        prefetched = split < k;
        auto epoch_steps = [&](auto tag) {
            constexpr int unroll = PERS_UNROLL;
#pragma unroll unroll
            for (int s = 0; s < split; ++s) step(s, tag);
            if (prefetched) {
                if (halo_lane) {
                    const uint4* src = right + (e % PERS_D) * PERS_K;
#pragma unroll
                    for (int q = 0; q < PERS_VT; ++q) w[q] = ll_load(src + PERS_HALO_WORD(lane, q));
                }
                for (int s = split; s < k; ++s) step(s, tag);
            }
        };
        if (may_skip) {   // the epoch's last step's exercise values, as the step has them
            exercise_at(k - 1);
#pragma unroll
            for (int q = 0; q < PERS_VT; ++q) v[q] = ex[q];
            prefetched = false;
        } else if (may_ex) {
            if (SCALED) exercise_at(0);
            epoch_steps(BoolTag<AMERICAN>{});
        }
        else epoch_steps(BoolTag<false>{});
        if (SCALED) {
            const double back = k == PERS_K ? pd_k : pows[k];
#pragma unroll
            for (int q = 0; q < PERS_VT; ++q) v[q] *= back;
        }
        if (tn > t_stop && tile > 0) {             // publish level tn's first PERS_K nodes
            if (e >= PERS_D) {
                bool late = false;
                const unsigned need = e - PERS_D + 1;
                // every lane reads the same word with one load, so the loop stays converged
                for (int spin = 0; !((seen >> 20) == gen && (seen & 0xFFFFFu) >= need); ++spin) {
                    if (spin >= PERS_SPIN) { late = true; break; }
                    seen = ld_volatile_u32(left_progress);
                }
                if (__any_sync(FULL, late)) { failed = true; break; }
            }
            if (lane < PERS_HL) {
                const unsigned flag = (gen << 20) | e;
                uint4* dst = mine + (e % PERS_D) * PERS_K;
#pragma unroll
                for (int q = 0; q < PERS_VT; ++q) ll_store(dst + PERS_SLOT_WORD(lane, q), v[q], flag);
            }
        }
        t = tn;
        ++e;
    }
    if (failed) {
        if (lane == 0) atomicExch(status, 1);
#pragma unroll
        for (int q = 0; q < PERS_VT; ++q) v[q] = __longlong_as_double(0x7ff8000000000000LL);
    }
    if (t == t_stop || failed) {
#pragma unroll
        for (int q = 0; q < PERS_VT; ++q) {
            const int local = lane * PERS_VT + q;
            const long long g = a0 + local;
            if (local < PERS_OUT && g <= (long long)t_stop) vout[g] = v[q];
        }
    }
}

// min blocks 1: without it ptxas caps the registers at 96 on sm_80 and spills (fma builds)
extern "C" __global__ void __launch_bounds__(32 * PERS_WARPS, 1)
pers_steps(const double* __restrict__ vin, double* __restrict__ vout,
           const double* __restrict__ level_base, const double* __restrict__ ratio,
           const double* __restrict__ pows, uint4* ring, unsigned* progress, int* status,
           int t, int t_stop, int tiles, double pu, double pd, double strike, double sign,
           double skip_lim, int american, int scaled, unsigned gen)
{
    __shared__ double2 steps_sm[PERS_WARPS][PERS_K];
    // zeroed, so that no word of an earlier launch on this SM can carry this launch's flags
    __shared__ uint4 sring[PERS_WARPS * PERS_D * PERS_K];
    __shared__ unsigned sprog[PERS_WARPS];
    for (int i = threadIdx.x; i < PERS_WARPS * PERS_D * PERS_K; i += blockDim.x)
        sring[i] = make_uint4(0u, 0u, 0u, 0u);
    if (threadIdx.x < PERS_WARPS) sprog[threadIdx.x] = 0u;
    __syncthreads();
    if (blockIdx.x * PERS_WARPS + (threadIdx.x >> 5) >= tiles) return;   // whole warps
    double2* mine = steps_sm[threadIdx.x >> 5];
    // the four instantiations (American or not, scaled or not) take the same arguments
#define PERS_BODY(AMERICAN, SCALED)                                                              \
    pers_body<AMERICAN, SCALED>(vin, vout, level_base, ratio, pows, ring, progress, sring, sprog, \
                                status, t, t_stop, pu, pd, strike, sign, skip_lim, gen, mine)
#if PRICER_FMA
    if (scaled) {
        if (american) PERS_BODY(true, true);
        else PERS_BODY(false, true);
        return;
    }
#endif
    if (american) PERS_BODY(true, false);
    else PERS_BODY(false, false);
#undef PERS_BODY
}
