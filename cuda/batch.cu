// pricer batch kernels: whole portfolios per launch, every option's lattice in registers, FP64.
//
// One option per warp (BATCH_W = 1; 4 warps, i.e. 4 options, per block) or per block of BATCH_W warps.
// All N steps run in one launch; nothing but the option's 8 input numbers and its price moves
// between the GPU's memory and the SMs.
//
// Node layout ("cyclic groups"): lane `l` of warp `w` holds, for each group g < G, the VT = 4
// consecutive nodes i = ((g * W + w) * 32 + l) * VT + q, q < VT.  A group of a warp (32 * VT nodes)
// whose first node lies above the level being computed is skipped as a whole (a warp-uniform
// branch), so the work follows the triangle of the lattice: a level of t nodes costs
// ceil(t / (32 * VT)) group-steps, not the capacity 32 * VT * G * W.  Neighbour node i + 1 is in
// the next lane (one 64-bit shuffle per group per step); lane 31 gets it from lane 0's next group
// (W = 1: the same shuffle, with lane 0 offering its next group's node) or, for W > 1, from the
// next warp through a double-buffered shared-memory slot (one __syncthreads per step).
//
// Asset prices are never updated incrementally: node (t, i) has
//     S = spot * exp(t * log_down) * exp(i * (log_up - log_down)),
// the level factor sign * spot * exp(t * log_down) computed 32 levels at a time (one exp per lane,
// shuffled out one per step) and the node factor exp(i * lr) = exp(i0 * lr) * exp(q * lr) held in
// registers (G + VT numbers per lane).  Every factor is within an ulp or two of exact, at every
// step, so the exercise value is as accurate at N = 16 000 as at N = 10.
//
// Arithmetic: fused multiply-adds (hold = fma(pu, V[i+1], pd * V[i]), exercise = fma(level, r, -sign K));
// no flush of tiny values (subnormal FP64 is full speed on the GPU).  Prices equal the CPU engine's
// to rounding, not bitwise.
//
// Input: `rows`, 8 columns of `stride` doubles (column k of option o at rows[k * stride + o]): spot,
// strike, log_up, log_down, pu, pd, steps, flags (bit 0 call, bit 1 American); column by column so
// that the host fills them with contiguous gathers.  Output: out[o], the price of row o, and, if `levels` is not
// null, levels[5 o .. 5 o + 4] = V(1,0), V(1,1), V(2,0), V(2,1), V(2,2) (NaN for N < 2), for Greeks.  Steps + 1 must not exceed
// the kernel's capacity 32 * VT * G * W (the scheduler picks the class).
//
// Kernels: batch_kernel_g{G}, G = 1..8, for the W of this build (-DBATCH_W=1, 2, 4, 8 or 16).

#ifndef BATCH_W
#define BATCH_W 1
#endif

#define VT 4
#define FULL_MASK 0xffffffffu
#define OPTIONS_PER_BLOCK (BATCH_W == 1 ? 4 : 1)
#define BLOCK_THREADS (32 * BATCH_W * OPTIONS_PER_BLOCK)
// blocks per SM the register allocation must allow: about 12 warps per SM (3 per scheduler) to
// hide the FP64 and shuffle latencies; ptxas fits the largest class (G = 8) without spilling
#define MIN_BLOCKS (BATCH_W == 1 ? 3 : BATCH_W == 2 ? 6 : BATCH_W == 4 ? 3 : 1)

struct Option {
    double spot, strike, log_up, log_down, pu, pd;
    int steps;
    bool call, american;
};

__device__ __forceinline__ Option load_option(const double* __restrict__ rows, int stride, int o)
{
    const double* p = rows + o;
    Option x;
    x.spot = p[0];
    x.strike = p[(size_t)stride];
    x.log_up = p[2 * (size_t)stride];
    x.log_down = p[3 * (size_t)stride];
    x.pu = p[4 * (size_t)stride];
    x.pd = p[5 * (size_t)stride];
    x.steps = (int)p[6 * (size_t)stride];
    const int flags = (int)p[7 * (size_t)stride];
    x.call = (flags & 1) != 0;
    x.american = (flags & 2) != 0;
    return x;
}

// sign * spot * exp(level * log_down), the pre-signed price of node (level, 0)
__device__ __forceinline__ double signed_level_base(const Option& op, double sign, int level)
{
    return sign * (op.spot * exp((double)level * op.log_down));
}

// What one warp carries from step to step besides its nodes.
struct StepState {
    double pu, pd, minus_strike, sign, log_down, spot;
    double chunk_now, chunk_next;   // level factors of this and the next chunk of 32 steps
    int j;                          // step within the chunk
    int lane, warp;
};

__device__ __forceinline__ int first_node(int g, int W, int warp) { return (g * W + warp) * 32 * VT; }

template <bool AMERICAN>
__device__ __forceinline__ double node_value(const StepState& st, double v_up, double v_down,
                                             double level_g, double r)
{
    const double hold = fma(st.pu, v_up, st.pd * v_down);
    if (!AMERICAN) return hold;
    // hold >= 0, so comparing the bit patterns as integers orders them as doubles (a negative
    // exercise value is a negative integer): the compare runs on the integer units and leaves the
    // FP64 pipe to the three FP64 operations of the node
    const double exercise = fma(level_g, r, st.minus_strike);
    return __double_as_longlong(exercise) > __double_as_longlong(hold) ? exercise : hold;
}

// The neighbour above each group's last node for the next step, sent as soon as node 0 of every
// group is new: lane l < 31 takes lane l+1's node 0; lane 31 takes lane 0's next group (W = 1, the
// same shuffle) or the next warp's node 0 from shared memory after the next step's barrier (W > 1,
// published here by lane 0).  Groups >= GA are idle and keep older values, which only feed nodes
// above the level (never read back into it).
template <int W, int G, int GA>
__device__ __forceinline__ void send_neighbours(const double (&v)[G][VT], double (&up)[G],
                                                const StepState& st, double (*xch)[G * W + 1],
                                                int level)
{
#pragma unroll
    for (int g = 0; g < GA; ++g) {
        double offer = v[g][0];
        if (W == 1 && g + 1 < G && st.lane == 0) offer = v[g + 1 < G ? g + 1 : g][0];
        up[g] = __shfl_sync(FULL_MASK, offer, (st.lane + 1) & 31);
        if (W > 1 && st.lane == 0) xch[level & 1][g * W + st.warp] = v[g][0];
    }
}

// Steps from level t_hi down to level t_lo (t_hi > t_lo >= 0) with exactly GA active groups (those
// whose first node is a node of every output level of these steps).  GA is a compile-time number,
// so the groups' shuffles and FP64 chains are independent straight-line code that the compiler
// interleaves; the levels at which GA drops are the phase boundaries (price_lattice).  On entry
// up[g] (g < GA) holds the neighbour above group g's last node at level t_hi (lane 31 of a W > 1
// warp: in xch, read after the barrier); on exit the same for level t_lo.  KEEP (only for the last
// steps of warp 0, so that the check stays out of the long loops): lane 0 stores levels 2 and 1 in
// kept = V(1,0), V(1,1), V(2,0), V(2,1), V(2,2).
template <int W, int G, int GA, bool AMERICAN, bool KEEP = false>
__device__ __forceinline__ void steps_with_groups(double (&v)[G][VT], double (&up)[G],
                                                  const double (&group_ratio)[G],
                                                  const double (&node_ratio)[VT], StepState& st,
                                                  double (*xch)[G * W + 1], int t_hi, int t_lo,
                                                  double* __restrict__ kept = nullptr)
{
    for (int t = t_hi; t > t_lo; --t, ++st.j) {
        double level = 0.0;
        if (AMERICAN) {
            if (st.j == 32) {
                st.j = 0;
                st.chunk_now = st.chunk_next;
                st.chunk_next = st.sign * (st.spot * exp((double)(t - 33 - st.lane) * st.log_down));
            }
            level = __shfl_sync(FULL_MASK, st.chunk_now, st.j);
        }
        if (W > 1) {
            __syncthreads();   // the next warp's node 0 of level t is in xch[t & 1]
            if (st.lane == 31) {
#pragma unroll
                for (int g = 0; g < GA; ++g) up[g] = xch[t & 1][g * W + st.warp + 1];
            }
        }
        double level_g[GA > 0 ? GA : 1], up_now[GA > 0 ? GA : 1];
#pragma unroll
        for (int g = 0; g < GA; ++g) {
            level_g[g] = AMERICAN ? level * group_ratio[g] : 0.0;
            up_now[g] = up[g];
            v[g][0] = node_value<AMERICAN>(st, v[g][1], v[g][0], level_g[g], node_ratio[0]);
        }
        send_neighbours<W, G, GA>(v, up, st, xch, t - 1);   // for the step from level t - 1
#pragma unroll
        for (int g = 0; g < GA; ++g) {
#pragma unroll
            for (int q = 1; q < VT; ++q) {
                const double v_up = q + 1 < VT ? v[g][q + 1 < VT ? q + 1 : 0] : up_now[g];
                v[g][q] = node_value<AMERICAN>(st, v_up, v[g][q], level_g[g], node_ratio[q]);
            }
        }
        // levels 2 and 1 for Greeks: nodes 0..2 are lane 0's group 0 of warp 0
        if (KEEP && GA > 0 && st.lane == 0) {
            if (t == 3) {
                kept[2] = v[0][0];
                kept[3] = v[0][1];
                kept[4] = v[0][VT > 2 ? 2 : 0];
            } else if (t == 2) {
                kept[0] = v[0][0];
                kept[1] = v[0][1];
            }
        }
    }
}

template <int W, int G, bool AMERICAN>
__device__ __forceinline__ double price_lattice(const Option& op, double (*xch)[G * W + 1],
                                                int warp, int lane, double* __restrict__ kept)
{
    const int n = op.steps;
    const double sign = op.call ? 1.0 : -1.0;
    const double log_ratio = op.log_up - op.log_down;

    double v[G][VT], group_ratio[G], node_ratio[VT];
#pragma unroll
    for (int q = 0; q < VT; ++q)
        node_ratio[q] = exp((double)q * log_ratio);
    const double base_n = op.spot * exp((double)n * op.log_down);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int i0 = ((g * W + warp) * 32 + lane) * VT;
        group_ratio[g] = exp((double)i0 * log_ratio);
#pragma unroll
        for (int q = 0; q < VT; ++q) {
            const double payoff = sign * fma(base_n, group_ratio[g] * node_ratio[q], -op.strike);
            v[g][q] = (i0 + q <= n && payoff > 0.0) ? payoff : 0.0;
        }
    }

    StepState st;
    st.pu = op.pu;
    st.pd = op.pd;
    st.minus_strike = -sign * op.strike;
    st.sign = sign;
    st.log_down = op.log_down;
    st.spot = op.spot;
    st.j = 0;
    st.lane = lane;
    st.warp = warp;
    if (kept != nullptr && n <= 2 && warp == 0 && lane == 0) {
        if (n < 2) {
#pragma unroll
            for (int k = 0; k < 5; ++k) kept[k] = __longlong_as_double(0x7ff8000000000000LL);   // NaN
        } else {   // level 2 is the payoff
            kept[2] = v[0][0];
            kept[3] = v[0][1];
            kept[4] = v[0][VT > 2 ? 2 : 0];
        }
    }
    // lane j holds the level factor of the j-th step of the chunk (the step from level t to t - 1
    // needs level t - 1); the next chunk is computed one chunk ahead
    st.chunk_now = st.chunk_next = 0.0;
    if (AMERICAN) {
        st.chunk_now = sign * (op.spot * exp((double)(n - 1 - lane) * op.log_down));
        st.chunk_next = sign * (op.spot * exp((double)(n - 33 - lane) * op.log_down));
    }
    double up[G];
    send_neighbours<W, G, G>(v, up, st, xch, n);   // for the first step, from level n
    int t = n;
    while (t > 0) {
        // active groups for the step from level t: first node <= t - 1
        int active = 0;
#pragma unroll
        for (int g = 0; g < G; ++g) active += first_node(g, W, warp) <= t - 1;
        // the phase lasts while its last active group stays active: down to level first_node
        const int t_lo = active > 0 ? first_node(active - 1, W, warp) : 0;
        switch (active) {
        case 0: steps_with_groups<W, G, 0, AMERICAN>(v, up, group_ratio, node_ratio, st, xch, t, t_lo); break;
        case 1:
            // warp 0's last phase ends at level 0: its last 3 steps keep levels 2 and 1 if asked
            if (kept != nullptr && t_lo == 0 && warp == 0) {
                const int t_keep = t < 3 ? t : 3;
                steps_with_groups<W, G, 1, AMERICAN>(v, up, group_ratio, node_ratio, st, xch, t, t_keep);
                steps_with_groups<W, G, 1, AMERICAN, true>(v, up, group_ratio, node_ratio, st, xch, t_keep, 0, kept);
            } else {
                steps_with_groups<W, G, 1, AMERICAN>(v, up, group_ratio, node_ratio, st, xch, t, t_lo);
            }
            break;
#define PHASE(K) case K: if (K <= G) steps_with_groups<W, G, (K <= G ? K : G), AMERICAN>(v, up, group_ratio, node_ratio, st, xch, t, t_lo); break;
        PHASE(2) PHASE(3) PHASE(4) PHASE(5) PHASE(6) PHASE(7) PHASE(8)
#undef PHASE
        }
        t = t_lo;
    }
    return v[0][0];
}

template <int W, int G>
__device__ __forceinline__ void batch_price(const double* __restrict__ rows, int stride,
                                            double* __restrict__ out, double* __restrict__ levels,
                                            int count)
{
    __shared__ double xch[2][G * W + 1];
    const int lane = threadIdx.x & 31;
    const int warp_in_block = threadIdx.x >> 5;
    const int o = W == 1 ? blockIdx.x * OPTIONS_PER_BLOCK + warp_in_block : blockIdx.x;
    const int warp = W == 1 ? 0 : warp_in_block;
    if (W > 1) {
        for (int k = threadIdx.x; k < 2 * (G * W + 1); k += blockDim.x)
            (&xch[0][0])[k] = 0.0;
        __syncthreads();
    }
    if (o >= count) return;   // uniform: the whole warp (W = 1) or the whole block (W > 1)
    const Option op = load_option(rows, stride, o);
    double* kept = levels != nullptr ? levels + 5 * (size_t)o : nullptr;
    const double price = op.american ? price_lattice<W, G, true>(op, xch, warp, lane, kept)
                                     : price_lattice<W, G, false>(op, xch, warp, lane, kept);
    if (warp == 0 && lane == 0) out[o] = price;
}

#define BATCH_KERNEL(G)                                                                           \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, MIN_BLOCKS)                                   \
        batch_kernel_g##G(const double* __restrict__ rows, int stride, double* __restrict__ out, \
                          double* __restrict__ levels, int count)                                 \
    {                                                                                             \
        batch_price<BATCH_W, G>(rows, stride, out, levels, count);                                \
    }

BATCH_KERNEL(1)
BATCH_KERNEL(2)
BATCH_KERNEL(3)
BATCH_KERNEL(4)
BATCH_KERNEL(5)
BATCH_KERNEL(6)
BATCH_KERNEL(7)
BATCH_KERNEL(8)
