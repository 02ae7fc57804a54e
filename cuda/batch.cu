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
// Work left out (prices bitwise those of computing every node): units above an option's last
// positive payoff stay zero and are never computed (zero_clamp; calls run on the mirrored lattice,
// load_option, so that every option's zeros lie at the top), and American units that are surely
// exercised are skipped (skip_check).
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
// Input: one byte buffer per chunk of n rows (pricer/engines/gpu/batch_layout.py, input_views): columns
// of n doubles (column k of row r at double index k * n + r; k = IN_SPOT, IN_STRIKE, IN_LOG_UP,
// IN_LOG_DOWN, IN_PU, IN_PD), then the n int32 steps from byte IN_STEPS_AT * n, the n int32 `order`
// (the chunk's rows sorted by class key, descending) from IN_ORDER_AT * n, n bytes call from
// IN_CALL_AT * n and n bytes American from IN_AMERICAN_AT * n.
// A launch prices the rows order[first .. first + count - 1] (one class); each is read and priced
// where it lies, so the host copies rows as given and gets prices back in that order.  Output:
// out[r], the price of row r, and, if `levels` is not null, levels[5 r .. 5 r + 4] = V(1,0), V(1,1),
// V(2,0), V(2,1), V(2,2) (NaN for N < 2), for Greeks.  Steps must not exceed the kernel's capacity
// 32 * VT * G * W (the scheduler picks the class): at steps = capacity the payoff's top node lies
// above the registers, and only the first step reads it (as the top lane's neighbour).
//
// Kernels: batch_kernel_g{G}, G = 1..8, for the W of this build (-DBATCH_W=1, 2, 4, 8 or 16);
// batch_width_keys, batch_key_starts and batch_sort_rows (the chunk's rows sorted on the GPU) and
// batch_work_order (a one-wave launch's rows, heaviest first).
//
// Required -D flags: the input layout and the constants the host's launches and buffers use. They
// come from pricer's batch layout module, which writes them once for both sides, so none has a
// default here: a build without one fails instead of reading another layout.
//   VT                       nodes per lane (4)
//   IN_SPOT .. IN_PD         the float64 column of each lattice number (see Input above)
//   IN_STEPS_AT, IN_ORDER_AT, IN_CALL_AT, IN_AMERICAN_AT
//                            byte offset per row of the chunk at which each column starts
//   SORT_THREADS             threads of batch_key_starts' one block
//   WORK_ORDER_THREADS       threads per block of batch_work_order
//   WORK_RANK_LANES          threads that rank one row together in batch_work_order
//   WIDTH_MARGIN             nodes added to an American payoff's width (batch_width_keys)

#ifndef BATCH_W
#define BATCH_W 1
#endif

#ifndef VT
#error "VT must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_SPOT
#error "IN_SPOT must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_STRIKE
#error "IN_STRIKE must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_LOG_UP
#error "IN_LOG_UP must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_LOG_DOWN
#error "IN_LOG_DOWN must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_PU
#error "IN_PU must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_PD
#error "IN_PD must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_STEPS_AT
#error "IN_STEPS_AT must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_ORDER_AT
#error "IN_ORDER_AT must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_CALL_AT
#error "IN_CALL_AT must be given (-D), from pricer's batch layout module"
#endif
#ifndef IN_AMERICAN_AT
#error "IN_AMERICAN_AT must be given (-D), from pricer's batch layout module"
#endif
#ifndef SORT_THREADS
#error "SORT_THREADS must be given (-D), from pricer's batch layout module"
#endif
#ifndef WORK_ORDER_THREADS
#error "WORK_ORDER_THREADS must be given (-D), from pricer's batch layout module"
#endif
#ifndef WORK_RANK_LANES
#error "WORK_RANK_LANES must be given (-D), from pricer's batch layout module"
#endif
#ifndef WIDTH_MARGIN
#error "WIDTH_MARGIN must be given (-D), from pricer's batch layout module"
#endif

// the columns must not overlap: six float64 columns below the int32 steps and order, then one byte
// each for call and American
static_assert(IN_SPOT >= 0 && IN_STRIKE >= 0 && IN_LOG_UP >= 0 && IN_LOG_DOWN >= 0 && IN_PU >= 0 &&
              IN_PD >= 0 && 8 * (IN_SPOT + 1) <= IN_STEPS_AT && 8 * (IN_STRIKE + 1) <= IN_STEPS_AT &&
              8 * (IN_LOG_UP + 1) <= IN_STEPS_AT && 8 * (IN_LOG_DOWN + 1) <= IN_STEPS_AT &&
              8 * (IN_PU + 1) <= IN_STEPS_AT && 8 * (IN_PD + 1) <= IN_STEPS_AT,
              "the float64 columns must lie below the steps column");
static_assert(IN_STEPS_AT % 4 == 0 && IN_ORDER_AT % 4 == 0 &&
              (IN_STEPS_AT + 4 <= IN_ORDER_AT || IN_ORDER_AT + 4 <= IN_STEPS_AT) &&
              IN_CALL_AT >= IN_STEPS_AT + 4 && IN_CALL_AT >= IN_ORDER_AT + 4 &&
              IN_AMERICAN_AT >= IN_STEPS_AT + 4 && IN_AMERICAN_AT >= IN_ORDER_AT + 4 &&
              IN_CALL_AT != IN_AMERICAN_AT,
              "the int32 columns must be aligned and below the flags, which must differ");
static_assert(WORK_ORDER_THREADS % WORK_RANK_LANES == 0 && WORK_RANK_LANES <= 32 &&
              (WORK_RANK_LANES & (WORK_RANK_LANES - 1)) == 0,
              "WORK_RANK_LANES must be a power of two <= 32 dividing WORK_ORDER_THREADS");
#define FULL_MASK 0xffffffffu
#define OPTIONS_PER_BLOCK (BATCH_W == 1 ? 4 : 1)
#define BLOCK_THREADS (32 * BATCH_W * OPTIONS_PER_BLOCK)
// blocks per SM the register allocation must allow: about 12 warps per SM (3 per scheduler) to
// hide the FP64 and shuffle latencies; ptxas fits the largest class (G = 8) without spilling
#define MIN_BLOCKS (BATCH_W == 1 ? 3 : BATCH_W == 2 ? 6 : BATCH_W == 4 ? 3 : 1)
// W = 2 up to G = 5: 8 blocks (16 warps) per SM, which ptxas fits in 120 registers without spills:
// one wave then holds a third more such options than at 6, so that a book of ~1 000 options of
// N = 2 048, whose payoffs' widths fit G = 5, runs in one wave on a GPU of ~130 SMs
// (one_wave_by_width in pricer/engines/gpu/batch_plan.py)
#define KERNEL_MIN_BLOCKS(G) (BATCH_W == 2 && (G) <= 5 ? 8 : MIN_BLOCKS)

struct Option {
    double spot, strike, log_up, log_down, pu, pd;
    int steps;
    bool call, american;
};

// Calls are priced on the mirrored lattice (node i' = t - i: log_up and log_down swapped, pu and
// pd swapped; the same nodes, so the same price to rounding). Every option's lattice then has its
// exercise region at the bottom (low i) and its zero region at the top, which is what the skip of
// surely exercised units (a prefix) and the clamp of zero units (a suffix) rely on.

__device__ __forceinline__ Option load_option(const unsigned char* __restrict__ input, int n, int row)
{
    const double* col = reinterpret_cast<const double*>(input) + row;
    const int* steps = reinterpret_cast<const int*>(input + IN_STEPS_AT * (size_t)n);
    const unsigned char* call = input + IN_CALL_AT * (size_t)n;
    Option x;
    x.spot = col[IN_SPOT * (size_t)n];
    x.strike = col[IN_STRIKE * (size_t)n];
    x.log_up = col[IN_LOG_UP * (size_t)n];
    x.log_down = col[IN_LOG_DOWN * (size_t)n];
    x.pu = col[IN_PU * (size_t)n];
    x.pd = col[IN_PD * (size_t)n];
    x.steps = steps[row];
    x.call = call[row] != 0;
    x.american = call[(ptrdiff_t)(IN_AMERICAN_AT - IN_CALL_AT) * n + row] != 0;   // from call's
    if (x.call) {
        const double log_up = x.log_up, pu = x.pu;
        x.log_up = x.log_down;
        x.log_down = log_up;
        x.pu = x.pd;
        x.pd = pu;
    }
    return x;
}

// row of the chunk at position k of its sorted order
__device__ __forceinline__ int sorted_row(const unsigned char* __restrict__ input, int n, int k)
{
    return reinterpret_cast<const int*>(input + IN_ORDER_AT * (size_t)n)[k];
}

// sign * spot * exp(level * log_down), the pre-signed price of node (level, 0)
__device__ __forceinline__ double signed_level_base(const Option& op, double sign, int level)
{
    return sign * (op.spot * exp((double)level * op.log_down));
}

// What one warp carries from step to step besides its nodes.
// An option's numbers that the steps read only every 32 steps (and the skip checks): in shared
// memory, one copy per option, so that the largest classes keep every node in registers.
struct OptionConsts {
    double sign, log_down, spot;
    double log_ratio;
    double log_limit;                   // skip margin (exercise_bound)
    int clamp;                          // units from clamp up are not computed (zero_clamp; the
                                        // tail clamps below it: window_clamp)
    int steps;                          // n (read where the windows are found)
};

// The tail clamp of each window of each option of the block, in units (tail_table, below)
#define TAIL_WINDOWS 512                  // windows of an option of up to 16 384 steps
__shared__ unsigned char tail_units[OPTIONS_PER_BLOCK][TAIL_WINDOWS];

// the block's slot of this thread's option
__device__ __forceinline__ int option_slot() { return BATCH_W == 1 ? (int)(threadIdx.x >> 5) : 0; }

struct StepState {
    double pu, pd, minus_strike;
    const OptionConsts* oc;
    double chunk_now, chunk_next;   // level factors of this and the next chunk of 32 steps
    int j;                          // step within the chunk
    int lane, warp;
    int lo;                         // groups skipped below: slot s holds group lo + s (skip_check)
    bool topx;                      // the slot above the computed ones carries its node 0's exercise value
};

__device__ __forceinline__ int first_node(int g, int W, int warp) { return (g * W + warp) * 32 * VT; }

// A node's exercise value, as every step computes it (skip_check compares and refills with the same
// bits); level_g = the level factor times the node's group ratio, r its node ratio.
__device__ __forceinline__ double exercise_value(const StepState& st, double level_g, double r)
{
    return fma(level_g, r, st.minus_strike);
}

// A group's nodes set to their exercise values.
__device__ __forceinline__ void exercise_group(double (&vg)[VT], const StepState& st, double level_g,
                                               const double (&node_ratio)[VT])
{
#pragma unroll
    for (int q = 0; q < VT; ++q) vg[q] = exercise_value(st, level_g, node_ratio[q]);
}

// The American max: as integers (hold >= 0, so comparing the bit patterns as integers orders them
// as doubles; a negative exercise value is a negative integer) on the integer units, except for
// nodes q = 1 and 3 of each lane's four, which compare as doubles (DSETP) on the FP64 pipe: the
// two halves of the node's work then load the two pipes more evenly (integer max on every node:
// 4 integer and 3 FP64 instructions; this mix 3 and 3.5 on average). Prices are bitwise the same
// either way. The W = 16, G = 8 kernel keeps the integer max on every node, as the mix spills there.
template <int W, int G>
__device__ __forceinline__ constexpr bool mixed_max() { return !(W == 16 && G == 8); }

template <bool AMERICAN, bool MIXED = false>
__device__ __forceinline__ double node_value(const StepState& st, double v_up, double v_down,
                                             double level_g, double r, int q = 0)
{
    const double hold = fma(st.pu, v_up, st.pd * v_down);
    if (!AMERICAN) return hold;
    const double exercise = exercise_value(st, level_g, r);
    if (MIXED && (q & 1)) return exercise > hold ? exercise : hold;
    return __double_as_longlong(exercise) > __double_as_longlong(hold) ? exercise : hold;
}

// W = 1: what lane 0 offers lane 31 for group g's neighbours, node q of its next group (the top
// group's: node 32 VT G and above, zero where steps exceed the capacity, zero_clamp; else above
// the level from the second step on, and the first step's is set in price_lattice)
template <int G>
__device__ __forceinline__ double next_group_node(const double (&v)[G][VT], int g, int q)
{
    return g + 1 < G ? v[g + 1 < G ? g + 1 : g][q] : 0.0;
}

// The neighbour above each group's last node for the next step, sent as soon as node 0 of every
// group is new: lane l < 31 takes lane l+1's node 0; lane 31 takes lane 0's next group (W = 1, the
// same shuffle) or the next warp's node 0 from shared memory after the next step's barrier (W > 1,
// published here by lane 0).  Groups >= GA are idle and keep older values, which only feed nodes
// above the level (never read back into it).
template <int W, int G>
__device__ __forceinline__ void send_neighbour(const double (&v)[G][VT], double (&up)[G],
                                               const StepState& st, double (*xch)[G * W + 1],
                                               int level, int g)
{
    double offer = v[g][0];
    if (W == 1 && st.lane == 0) offer = next_group_node<G>(v, g, 0);
    up[g] = __shfl_sync(FULL_MASK, offer, (st.lane + 1) & 31);
    if (W > 1 && st.lane == 0) xch[level & 1][(st.lo + g) * W + st.warp] = v[g][0];
}

template <int W, int G, int GA>
__device__ __forceinline__ void send_neighbours(const double (&v)[G][VT], double (&up)[G],
                                                const StepState& st, double (*xch)[G * W + 1],
                                                int level)
{
#pragma unroll
    for (int g = 0; g < GA; ++g) send_neighbour<W, G>(v, up, st, xch, level, g);
    // a skipped suffix's lowest group: its node 0 is the next warp's neighbour (W = 1: lane 0's
    // offer above already takes it)
    if (W > 1 && GA < G && st.topx && st.lane == 0)
        xch[level & 1][GA * W + st.warp] = v[GA < G ? GA : 0][0];
}

// Steps from level t_hi down to level t_lo (t_hi > t_lo >= 0) computing GA groups in slots [0, GA):
// slot g holds group st.lo + g (st.lo > 0: groups skipped below, American puts, skip_check); the
// computed ones are active (their first node is a node of every output level of these steps).
// GA is a compile-time number, so the groups' shuffles and FP64 chains are independent straight-line code that the compiler
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
                const OptionConsts& oc = *st.oc;
                st.chunk_next = oc.sign * (oc.spot * exp((double)(t - 33 - st.lane) * oc.log_down));
            }
            level = __shfl_sync(FULL_MASK, st.chunk_now, st.j);
        }
        if (W > 1) {
            __syncthreads();   // the next warp's node 0 of level t is in xch[t & 1]
            if (st.lane == 31) {
#pragma unroll
                for (int g = 0; g < GA; ++g) up[g] = xch[t & 1][(st.lo + g) * W + st.warp + 1];
            }
        }
        double level_g[GA > 0 ? GA : 1], up_now[GA > 0 ? GA : 1];
#pragma unroll
        for (int g = 0; g < GA; ++g) {
            level_g[g] = AMERICAN ? level * group_ratio[g] : 0.0;
            up_now[g] = up[g];
            v[g][0] = node_value<AMERICAN>(st, v[g][1], v[g][0], level_g[g], node_ratio[0]);
        }
        if (AMERICAN && GA < G && st.topx) {   // surely exercised: the exercise value itself
            constexpr int X = GA < G ? GA : 0;
            v[X][0] = exercise_value(st, level * group_ratio[X], node_ratio[0]);
        }
        send_neighbours<W, G, GA>(v, up, st, xch, t - 1);   // for the step from level t - 1
#pragma unroll
        for (int g = 0; g < GA; ++g) {
#pragma unroll
            for (int q = 1; q < VT; ++q) {
                const double v_up = q + 1 < VT ? v[g][q + 1 < VT ? q + 1 : 0] : up_now[g];
                v[g][q] = node_value<AMERICAN, mixed_max<W, G>()>(st, v_up, v[g][q], level_g[g],
                                                                  node_ratio[q], q);
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

// ---- European options: two levels per step ----
//
// V(t - 2, i) = pd^2 V(t, i) + 2 pu pd V(t, i + 1) + pu^2 V(t, i + 2): 3 FP64 instructions a node
// per two levels instead of 4, and one exchange (two values: the next lane's nodes 0 and 1) and
// one barrier per two levels. Every class steps through the same levels (n, n - 2, ... down to 3
// or 4, then one at a time), so prices stay bitwise the same whatever the class (but W = 16,
// G = 8, below); they differ from one level at a time by rounding only: the three coefficients are
// rounded once, and that bias adds up over the steps (a few 1e-13 of the price at most). Calls that keep levels for Greeks step one level at a time, as before: theta divides a
// difference of levels by 2 dt, which at N = 5 000 can carry that rounding to ~1e-8 of theta, the
// Greeks test's bar (estimated: with two-level steps such calls fail the Greeks test).
// American options need the max at every level and step one at a time.

// not W = 16, G = 8, whose European path then spills on sm_80; on every GPU alike, so that prices
// do not depend on the GPU
template <int W, int G>
__device__ __forceinline__ constexpr bool twice_class() { return !(W == 16 && G == 8); }

struct TwiceCoef {
    double a, b, c;                       // pd^2, 2 pu pd, pu^2
};

// As send_neighbour, for two levels a step: up1[g], up2[g] = the next lane's nodes 0 and 1 (lane
// 31: W = 1 lane 0's next group's, the same shuffles; W > 1 the next warp's, through xch2[parity
// of level / 2], published here by lane 0 and read after the next step's barrier).
template <int W, int G>
__device__ __forceinline__ void send_pair(const double (&v)[G][VT], double (&up1)[G], double (&up2)[G],
                                          const StepState& st, double (*xch2)[2][G * W + 1],
                                          int level, int g)
{
    double offer1 = v[g][0], offer2 = v[g][1];
    if (W == 1 && st.lane == 0) {
        offer1 = next_group_node<G>(v, g, 0);
        offer2 = next_group_node<G>(v, g, 1);
    }
    up1[g] = __shfl_sync(FULL_MASK, offer1, (st.lane + 1) & 31);
    up2[g] = __shfl_sync(FULL_MASK, offer2, (st.lane + 1) & 31);
    if (W > 1 && st.lane == 0) {
        xch2[(level >> 1) & 1][0][g * W + st.warp] = v[g][0];
        xch2[(level >> 1) & 1][1][g * W + st.warp] = v[g][1];
    }
}

// European steps from level t_hi down to t_lo, two levels each (t_hi - t_lo even), computing GA
// groups (as steps_with_groups; European options skip none, so slot g holds group g). On entry
// and exit up1, up2 hold the neighbours as send_pair leaves them.
template <int W, int G, int GA>
__device__ __forceinline__ void twice_steps(double (&v)[G][VT], double (&up1)[G], double (&up2)[G],
                                            const TwiceCoef& k, const StepState& st,
                                            double (*xch2)[2][G * W + 1], int t_hi, int t_lo)
{
    static_assert(VT == 4, "two levels a step are written for four nodes a lane");
    for (int t = t_hi; t > t_lo; t -= 2) {
        if (W > 1) {
            __syncthreads();   // the next warp's nodes 0 and 1 of level t are in xch2
            if (st.lane == 31) {
#pragma unroll
                for (int g = 0; g < GA; ++g) {
                    up1[g] = xch2[(t >> 1) & 1][0][g * W + st.warp + 1];
                    up2[g] = xch2[(t >> 1) & 1][1][g * W + st.warp + 1];
                }
            }
        }
        double u1[GA > 0 ? GA : 1], u2[GA > 0 ? GA : 1];
#pragma unroll
        for (int g = 0; g < GA; ++g) {    // nodes 0 and 1 first: their exchange travels meanwhile
            u1[g] = up1[g];
            u2[g] = up2[g];
            const double n0 = fma(k.c, v[g][2], fma(k.b, v[g][1], k.a * v[g][0]));
            const double n1 = fma(k.c, v[g][3], fma(k.b, v[g][2], k.a * v[g][1]));
            v[g][0] = n0;
            v[g][1] = n1;
        }
#pragma unroll
        for (int g = 0; g < GA; ++g) send_pair<W, G>(v, up1, up2, st, xch2, t - 2, g);
#pragma unroll
        for (int g = 0; g < GA; ++g) {
            const double n2 = fma(k.c, u1[g], fma(k.b, v[g][3], k.a * v[g][2]));
            const double n3 = fma(k.c, u2[g], fma(k.b, u1[g], k.a * v[g][3]));
            v[g][2] = n2;
            v[g][3] = n3;
        }
    }
}

// ---- Surely exercised groups are skipped (American options) ----
//
// A node whose two successors hold their exercise values takes the exercise value itself wherever
// exercise - hold = K (1 - pu - pd) - S (1 - pu u - pd d) (put; the negative for a call) exceeds
// every rounding of the computed values by a margin: exercise_bound says where, from pu, pd, u, d
// and a bound eta on the relative error of a computed asset price (level factor, group and node
// ratios, each from exp()), all widened 4-fold. Such nodes then need no computing: the kernel
// stops computing whole groups (32 lanes x VT nodes of one warp, "units" u = g * W + warp in node
// order) and writes their exercise values back when it needs them again. Prices are bitwise those
// of a kernel that computes every node.
//
// Every SKIP_WINDOW steps, at level t, skip_check looks at which nodes hold their exercise value
// (v == the exercise value the step would compute, bit for bit) and decides the next window: for
// a put, and a call on the mirrored lattice (exercise region below the boundary), units [0, U) are
// skipped when all their nodes and the first SKIP_WINDOW nodes of unit U hold exercise values: the
// run of such nodes loses at most one node at its top per step, so units [0, U) stay exercised
// through the window; and the margin must hold at the price of the nodes the window relies on (both window ends, as
// S(t, i) is monotone in t). Groups that leave the skipped set get their exercise values at level
// t. Below level SKIP_MIN_LEVEL nothing is skipped, so the last steps (and the Greeks' levels) run
// as before. The check costs about as much as one step of the warp's groups every 32 steps.

#define BATCH_W1_SKIP_G 6                   // W = 1 kernels skip up to this G (price_lattice)
#define SKIP_WINDOW 32
#define SKIP_MIN_LEVEL 96
#define UNIT_NODES (32 * VT)
#define MAX_UNITS 128                       // G * W <= 8 * 16
#define SKIP_NONE 0
#define SKIP_PUT 1                          // skipped: units [0, U); exercise where S <= limit
// A call on the lattice as given would skip a suffix, units [U, top), where S >= limit (SKIP_CALL;
// the lowest skipped group's node 0 then carries its exercise value, `topx`). Calls are always
// mirrored, so exercise_bound never chooses it; its branches stay because the kernels' code is laid
// out with them (without them the compiled steps differ).
#define SKIP_CALL 2
#define SKIP_MCALL 3                        // mirrored call: units [0, U); exercise where S >= limit

__device__ __forceinline__ bool skips_prefix(int mode) { return mode != SKIP_CALL; }

struct SkipState {
    int mode;
    int hi;                     // SKIP_CALL: groups [hi, G) of this warp skipped (put: st.lo)
};

// A bound on the relative error of a computed asset price: arguments of exp rounded (|t log_down|,
// |i log_ratio| ulps), three exps of <= 1 ulp, three products. The skip's margin (exercise_bound)
// and the clamp's (clamps) are taken far above it.
__device__ __forceinline__ double asset_price_eta(const Option& op)
{
    const double n = (double)op.steps;
    return 0x1p-52 * (n * fabs(op.log_down) + 2.0 * n * fabs(op.log_up - op.log_down) + 16.0);
}

// Exercise is sure at asset price S where S lim_b <= lim_a (put), S lim_b >= lim_a (call), i.e. at
// node (t, i) where t log_down + i log_ratio <= log_limit (put), >= log_limit (call). Sets
// oc.log_limit.
__device__ __forceinline__ void exercise_bound(const Option& op, SkipState& sk, OptionConsts& oc)
{
    const double SLACK = 0x1p-48;
    const double eta = asset_price_eta(op);
    const double a = (1.0 - op.pu) - op.pd;                                    // 1 - discount
    const double b = (1.0 - op.pu * exp(op.log_up)) - op.pd * exp(op.log_down); // 1 - e^{-q dt}
    const double ALWAYS = 1e300;            // finite, so that margin_holds' slack stays finite
    if (!op.call) {
        const double lim_a = op.strike * (a - 12.0 * eta - SLACK), lim_b = b + SLACK;
        sk.mode = lim_a > 0.0 ? SKIP_PUT : SKIP_NONE;
        oc.log_limit = lim_b > 0.0 ? log(lim_a / (op.spot * lim_b)) : ALWAYS;
    } else {
        const double lim_a = op.strike * (a + SLACK), lim_b = b - 12.0 * eta - SLACK;
        sk.mode = lim_b > 0.0 ? SKIP_MCALL : SKIP_NONE;
        oc.log_limit = lim_a > 0.0 ? log(lim_a / (op.spot * lim_b)) : -ALWAYS;
    }
}

// whether the margin holds for node i over the window's levels [t - SKIP_WINDOW, t - 1]
__device__ __forceinline__ bool margin_holds(const SkipState& sk, const StepState& st, int t, int i)
{
    const OptionConsts& oc = *st.oc;
    const double e1 = (double)(t - 1) * oc.log_down + (double)i * oc.log_ratio;
    const double e2 = (double)(t - SKIP_WINDOW) * oc.log_down + (double)i * oc.log_ratio;
    // far above the roundings of e1, e2 and log_limit (a few ulps of each)
    const double slack = 0x1p-40 * (fabs(e1) + fabs(e2) + fabs(oc.log_limit) + 1.0);
    if (sk.mode == SKIP_PUT) return fmax(e1, e2) + slack <= oc.log_limit;
    return fmin(e1, e2) - slack >= oc.log_limit;
}

template <int G>
__device__ __forceinline__ double node0(const double (&v)[G][VT], int s)
{
    double x = v[0][0];
#pragma unroll
    for (int k = 1; k < G; ++k) x = k == s ? v[k][0] : x;
    return x;
}

// The check at level t (see above): flags per unit (bit 0 every node exercised, bit 1 its first 32),
// one decision per block, then this warp's groups skipped or brought back. `last`: bring all back.
template <int W, int G>
__device__ __forceinline__ void skip_check(double (&v)[G][VT], double (&up)[G], double (&group_ratio)[G],
                                           const double (&node_ratio)[VT], StepState& st,
                                           SkipState& sk, double (*xch)[G * W + 1],
                                           unsigned char* flags, int t, bool last)
{
    const OptionConsts& oc = *st.oc;
    const double level = oc.sign * (oc.spot * exp((double)t * oc.log_down));   // as the steps took it
    const int units = G * W;
    const int in_level = min(t / UNIT_NODES + 1, units);     // units with a node at level t
#pragma unroll
    for (int s = 0; s < G; ++s) {                            // slot s: group st.lo + s
        const int g = st.lo + s;
        if (g >= G) break;
        unsigned char f = 3;                                 // skipped or above the level: exercised
        if (g < sk.hi && first_node(g, W, st.warp) <= t) {
            const double level_g = level * group_ratio[s];
            bool all = true;
#pragma unroll
            for (int q = 0; q < VT; ++q) {
                const int i = first_node(g, W, st.warp) + st.lane * VT + q;
                all &= i > t || v[s][q] == exercise_value(st, level_g, node_ratio[q]);
            }
            const unsigned took = __ballot_sync(FULL_MASK, all);
            f = (took == FULL_MASK ? 1 : 0) | ((took & 0xffu) == 0xffu ? 2 : 0);
        }
        if (st.lane == 0) flags[g * W + st.warp] = f;
    }
    if (st.lane == 0)
        for (int g = 0; g < st.lo; ++g) flags[g * W + st.warp] = 3;
    if (W > 1) __syncthreads(); else __syncwarp();
    // the first unit not wholly exercised (from below), and where the exercised suffix starts
    int first_open = units, suffix_from = 0;
#pragma unroll
    for (int k = 0; k < (MAX_UNITS + 31) / 32; ++k) {
        if (32 * k >= units) break;
        const int u = 32 * k + st.lane;
        const unsigned open = __ballot_sync(FULL_MASK, u < units && !(flags[u] & 1));
        if (open) {
            if (first_open == units) first_open = 32 * k + __ffs(open) - 1;
            suffix_from = 32 * k + 32 - __clz(open);
        }
    }
    int skip_units;                       // put: units [0, skip_units); call: [skip_units, top)
    if (skips_prefix(sk.mode)) {
        skip_units = first_open < in_level && !(flags[first_open] & 2) ? first_open - 1 : first_open;
        skip_units = last ? 0 : max(0, min(skip_units, in_level - 1));
        while (skip_units > 0 && !margin_holds(sk, st, t, skip_units * UNIT_NODES + SKIP_WINDOW))
            --skip_units;
    } else {
        skip_units = last ? units : max(suffix_from, 1);
        while (skip_units < in_level && !margin_holds(sk, st, t, skip_units * UNIT_NODES))
            ++skip_units;
    }
    if (W > 1) __syncthreads(); else __syncwarp();           // flags read before they are rewritten
    // this warp's groups below the boundary unit; groups that stop being skipped get the exercise
    // values of level t (they hold them: they were skipped through level t)
    const int below = skip_units > st.warp ? min(G, (skip_units - st.warp + W - 1) / W) : 0;
    if (skips_prefix(sk.mode)) {
        for (; st.lo < below; ++st.lo) {                     // slot 0 is skipped: the slots move down
#pragma unroll
            for (int s = 0; s + 1 < G; ++s) {
                group_ratio[s] = group_ratio[s + 1];
#pragma unroll
                for (int q = 0; q < VT; ++q) v[s][q] = v[s + 1][q];
            }
            // the slot freed at the top holds the zeros above the registers (W = 1: lane 0
            // offers its node 0 to the top group's lane 31)
            if (W == 1) {
#pragma unroll
                for (int q = 0; q < VT; ++q) v[G - 1][q] = 0.0;
            }
        }
        for (; st.lo > below; --st.lo) {                     // group lo - 1 comes back into slot 0
#pragma unroll
            for (int s = G - 1; s > 0; --s) {
                group_ratio[s] = group_ratio[s - 1];
#pragma unroll
                for (int q = 0; q < VT; ++q) v[s][q] = v[s - 1][q];
            }
            group_ratio[0] = exp((double)(first_node(st.lo - 1, W, st.warp) + st.lane * VT) *
                                 oc.log_ratio);              // as price_lattice computed it
            exercise_group(v[0], st, level * group_ratio[0], node_ratio);
        }
    } else {
        const int back_lo = sk.hi;
        sk.hi = below;
        st.topx = sk.hi < G;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            // the lowest skipped group carries its node 0's exercise value (the steps keep it)
            if ((g >= back_lo && g < below) || g == sk.hi)
                exercise_group(v[g], st, level * group_ratio[g], node_ratio);
        }
    }
    // neighbours for the step from level t, as send_neighbours (up[] of slots computed again must
    // be fresh)
    const int slots = skips_prefix(sk.mode) ? G - st.lo : sk.hi;
#pragma unroll
    for (int s = 0; s < G; ++s) {
        if (s >= slots) break;
        send_neighbour<W, G>(v, up, st, xch, t, s);
    }
    if (W > 1 && st.topx && st.lane == 0) xch[t & 1][sk.hi * W + st.warp] = node0(v, sk.hi);
}

// ---- Units that stay zero are never computed ----
//
// With calls mirrored, every option's payoff is positive on a prefix of the last level's nodes and
// zero above it. A node (t, i) depends on the payoffs of nodes i .. i + n - t, so above the last
// positive payoff (node `top`) every node of every level holds zero: its hold is pu * 0 + pd * 0 =
// +0, and its exercise value is negative: for t < n, S(t, i) = S(n, i) / d^(n - t) lies beyond the
// strike by at least the factor 1 / d (put; u for a mirrored call, whose d is the original u), and
// S(n, i) >= S(n, top + 1), whose computed payoff is not positive. That holds bit for bit where
// |log d| exceeds every rounding of a computed asset price by far (asset_price_eta). So
// the units above the one holding `top` keep their payoff zeros and are never computed, bit for
// bit what computing them gives: typically about a quarter of all node updates, European and
// American alike. Returns the first node of the first unit never computed.
//
// So an option needs registers only for its nodes up to `top`: one with more steps than the
// kernel's capacity is priced where its payoff at node `capacity` is negative by far (all above
// it then are too), and the clamp holds; otherwise it gets CLAMP_FAILED (its price NaN, and the
// host prices it again in the class of its steps). The host picks classes by that width, which
// batch_width_keys estimates.
#define CLAMP_FAILED (-1)

// whether the option's zero units may be left out (see above)
__device__ __forceinline__ bool clamps(const Option& op)
{
    const double sign = op.call ? 1.0 : -1.0;
    const double eta = asset_price_eta(op);
    // (calls mirrored, so every option's zeros lie above) American: put d < 1 - mu, mirrored call
    // d (the original u) > 1 + mu
    return !op.american || -sign * op.log_down < -(0x1p-20 + 64.0 * eta);
}

__device__ __forceinline__ int zero_clamp(const Option& op, double sign, int top, int capacity,
                                          double base_n, double log_ratio)
{
    const int n = op.steps;
    const int first_zero_unit = (top + UNIT_NODES) / UNIT_NODES * UNIT_NODES;   // top = -1: 0
    if (n <= capacity) return clamps(op) ? first_zero_unit : n + UNIT_NODES;
    const double beyond = sign * fma(base_n, exp((double)capacity * log_ratio), -op.strike);
    return clamps(op) && beyond < -0x1p-20 * op.strike ? first_zero_unit : CLAMP_FAILED;
}

// The real i where S(n, i) = K at the last level (calls mirrored: the payoff is positive below it)
__device__ __forceinline__ double strike_index(const Option& op)
{
    return (log(op.strike / op.spot) - op.steps * op.log_down) / (op.log_up - op.log_down);
}

// The class key of each row of a chunk (its payoff's width, see above), and the rows per key
// (counts, zeroed by the host; batch_key_starts and batch_sort_rows below sort by the keys): for
// an American option, the nodes of the last level with a positive payoff and WIDTH_MARGIN more
// (the host's width_keys computes the same keys), at most the steps; the steps where the clamp is
// refused, and for European options.

extern "C" __global__ void batch_width_keys(const unsigned char* __restrict__ input, int n,
                                            int* __restrict__ keys, int* __restrict__ counts)
{
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n) return;
    const Option op = load_option(input, n, row);   // calls mirrored
    int key = op.steps;
    // European options keep their steps: their kernels gain next to nothing by width
    if (op.american && clamps(op)) {
        // the payoff is positive below node x (put S < K, mirrored call S > K)
        const double x = strike_index(op);
        const double width = ceil(fmin(fmax(x, -1.0), (double)op.steps)) + WIDTH_MARGIN;
        key = max(1, (int)fmin(width, (double)op.steps));
    }
    keys[row] = key;
    atomicAdd(&counts[key], 1);
}

// The chunk's rows sorted by key on the GPU, descending (a counting sort; rows of one key in no
// particular order, which changes no price): batch_width_keys counts the rows of each key,
// batch_key_starts turns the counts into each key's first position, batch_sort_rows puts each
// row there. The order then never travels, and the host needs only the counts for its launches.

// starts[k] = the rows with a key above k (keys 0 .. bins - 1; one block of SORT_THREADS)
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    batch_key_starts(const int* __restrict__ counts, int bins, int* __restrict__ starts)
{
    __shared__ int above[SORT_THREADS];
    const int per = (bins + SORT_THREADS - 1) / SORT_THREADS;
    const int hi = bins - (int)threadIdx.x * per;           // this thread's keys: [hi - per, hi)
    const int lo = max(hi - per, 0);
    int sum = 0;
    for (int k = hi - 1; k >= lo; --k) sum += counts[k];
    above[threadIdx.x] = sum;
    __syncthreads();
    for (int d = 1; d < SORT_THREADS; d <<= 1) {            // inclusive scan over the threads
        const int add = threadIdx.x >= d ? above[threadIdx.x - d] : 0;
        __syncthreads();
        above[threadIdx.x] += add;
        __syncthreads();
    }
    int start = above[threadIdx.x] - sum;                   // rows of the keys above this thread's
    for (int k = hi - 1; k >= lo; --k) {
        starts[k] = start;
        start += counts[k];
    }
}

// order[p] = row for the n rows, p from its key's next free position (starts, advanced)
extern "C" __global__ void batch_sort_rows(const int* __restrict__ keys, int n,
                                           int* __restrict__ starts, int* __restrict__ order)
{
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < n) order[atomicAdd(&starts[keys[row]], 1)] = row;
}

// ---- A one-wave launch's rows, heaviest first (batch_work_order) ----
//
// When a launch's options all fit on the GPU at once, each SM gets the blocks dispatched to it at
// the start, and a nearly full SM finishes when the sum of its blocks' work is done. The blocks
// go round the SMs in order, so the rows sorted by their work, heaviest first, spread the heavy
// options evenly and no SM is left with more than its share. Prices do not depend on the order.
// batch_plan.heaviest_first says when the host launches it.
//
// work_estimate: a rough count of the nodes the kernel computes, at 8 levels t: those between the
// surely exercised prefix (American: below the one-step bound, where exercise beats holding for
// one step; calls mirrored) and the strike index plus 5 sqrt(n - t + 1) (the tail clamp cuts
// near there). An estimate to order by: it only has to rank the rows' work roughly.
#define WORK_LEVELS 8

// in FP32: an estimate to order by, never a price
__device__ float work_estimate(const Option& op)
{
    const float n = (float)op.steps, log_down = (float)op.log_down;
    const float per_node = 1.0f / (float)(op.log_up - op.log_down);
    const float log_strike = __logf((float)(op.strike / op.spot));
    // the one-step bound's 1 - discount and 1 - growth are ~r dt: in FP64 (growth is the same on
    // the mirrored lattice)
    const double discount = op.pu + op.pd;
    const double growth = op.pu * exp(op.log_up) + op.pd * exp(op.log_down);
    const bool bounded = op.american && growth < 1.0 && discount < 1.0;
    const float log_bound =
        bounded ? log_strike + __logf((float)((1.0 - discount) / (1.0 - growth))) : 0.0f;
    float nodes = 0.0f;
    for (int k = 0; k < WORK_LEVELS; ++k) {
        const float t = (k + 0.5f) * n / WORK_LEVELS;
        const float strike_at = (log_strike - t * log_down) * per_node;
        const float hi = fminf(t + 1.0f, fmaxf(strike_at + 5.0f * sqrtf(n - t + 1.0f), 0.0f));
        const float lo = bounded ? fmaxf((log_bound - t * log_down) * per_node, 0.0f) : 0.0f;
        nodes += fmaxf(hi - lo, 0.0f);
    }
    return nodes;
}

// order[p] = the row of rank p, heaviest first, for the n rows of the input. Each block
// estimates every row's work into shared memory (n ints: the floats' bits) and ranks its own
// WORK_ORDER_THREADS / WORK_RANK_LANES rows against them, WORK_RANK_LANES threads a row: a row's
// rank is the number of rows with more work, or the same work and a lower row, so the ranks are
// a permutation whatever the estimates (compared as integers, NaN included).
extern "C" __global__ void __launch_bounds__(WORK_ORDER_THREADS)
    batch_work_order(unsigned char* __restrict__ input, int n)
{
    extern __shared__ int work_bits[];
    for (int r = threadIdx.x; r < n; r += blockDim.x)
        work_bits[r] = __float_as_int(work_estimate(load_option(input, n, r)));
    __syncthreads();
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / WORK_RANK_LANES;
    const int part = threadIdx.x % WORK_RANK_LANES;
    const int mine = row < n ? work_bits[row] : 0;
    int rank = 0;
#pragma unroll 4
    for (int r = part; r < n; r += WORK_RANK_LANES) {
        const int other = work_bits[r];
        rank += other > mine || (other == mine && r < row);
    }
    for (int d = 1; d < WORK_RANK_LANES; d <<= 1) rank += __shfl_xor_sync(FULL_MASK, rank, d);
    if (row < n && part == 0)
        reinterpret_cast<int*>(input + IN_ORDER_AT * (size_t)n)[rank] = row;   // the order (input_views)
}

// ---- Units whose values are negligible are left out ----
//
// Far above the strike (a put's high asset prices; a mirrored call's high i) the values are tiny,
// and the zero clamp still computes them down to the last level. A bound says which are below
// eps = K 2^-70 / g^2 (g = max(1, pu + pd)^n, the most a value can grow by going back a level at a
// time): with y = i - j(t) the node's distance above the strike index j(t) (the i where S(t, i)
// = K; j(t - 1) = j(t) - delta, delta = -log_down / log_ratio > 0), and any theta >= |log_ratio|,
//     V(t, i) <= B(t, i) = K exp(-theta y) rho^(n - t),
//     rho = max(1, exp(theta delta) (pu exp(-theta) + pd)),
// since B bounds the payoff and every exercise value (a put's K - S <= K; a mirrored call's S - K
// <= K exp(|log_ratio| |y|) where y < 0), and pu B(t + 1, i + 1) + pd B(t + 1, i) <= B(t, i) when
// pu, pd >= 0 (the lattice's step is then monotone). So V(t, i) <= eps where
//     i >= j(n) + (L + m log rho) / theta - m delta,   m = n - t,   L = log(K / eps),
// a line in m for each theta; TAIL_LINES of them, theta chosen for m = n, n / 4, n / 16, n / 64
// (theta = sqrt(2 L / (m q (1 - q))), q = pu / (pu + pd): the walk's variance), and the least
// holds. At each window level (every SKIP_WINDOW levels from the top, where the skip checks are;
// every class reaches each exactly) the clamp moves down to the first unit whose nodes all lie
// above the least line, and never up: a region of tiny values stays tiny going back (its nodes'
// exercise values are negative, and a hold is a weighted mean of tinier values, times at most
// pu + pd). The units above the clamp become zeros (stop_units), which the unit below then reads
// as its neighbour's, where the values were below eps g. Each node's error then stays below
// 2 eps g^2 = K 2^-69 from level to level (a step is a mean: errors do not add up), so a price
// moves by at most ~2e-21 K from the full lattice's: far below the 1e-11 relative bar, or 1e-19 K
// for prices below 1e-8 K. Unit 0 is always computed, so the price is the root's.
//
// The clamp of each window is found once, at the start, by the option's threads together
// (tail_table: one byte per window, the clamp in units), so a window costs a shared-memory byte
// and every class finds the same numbers. Options below TAIL_MIN_STEPS leave out too few nodes to
// pay for the table; European options below TAIL_MIN_STEPS_EU too few to pay for the windows,
// which cut their long two-level phases.
#define TAIL_LINES 4
#define TAIL_MIN_STEPS 512
#define TAIL_MIN_STEPS_EU 1024
__device__ __forceinline__ constexpr int tail_min_steps(bool american)
{
    return american ? TAIL_MIN_STEPS : TAIL_MIN_STEPS_EU;
}
#define WINDOW_MIN_LEVEL (2 * SKIP_WINDOW)   // windows (skip checks, tail clamps) at levels >= this
#define TAIL_NONE 255                     // a window whose clamp stays (above every unit)
#define TAIL_LOG_EPS 48.52030263919617    // 70 log 2: eps = K 2^-70 / g^2

// Whether the bound holds (pu, pd > 0, delta > 0), and if so its lines a[k] + b[k] m (a node
// index, m = n - t levels from the top) above which every node's value is below eps.
__device__ __forceinline__ bool tail_lines(const Option& op, double (&a)[TAIL_LINES],
                                           double (&b)[TAIL_LINES])
{
    const double log_ratio = op.log_up - op.log_down;
    const double delta = -op.log_down / log_ratio;
    // (calls mirrored: every option's tiny values lie above the strike index)
    if (!(op.pu > 0.0 && op.pd > 0.0 && delta > 0.0 && op.steps >= tail_min_steps(op.american)))
        return false;
    const double n = (double)op.steps;
    const double log_k_eps = TAIL_LOG_EPS + 2.0 * n * fmax(0.0, log(op.pu + op.pd));
    const double q = op.pu / (op.pu + op.pd);
    const double top = strike_index(op);   // j(n)
    double m = n;
#pragma unroll
    for (int k = 0; k < TAIL_LINES; ++k, m *= 0.25) {
        const double theta = fmax(sqrt(2.0 * log_k_eps / (m * q * (1.0 - q))),
                                  2.0 * fabs(log_ratio));
        const double log_rho = fmax(0.0, theta * delta + log(fma(op.pu, exp(-theta), op.pd)));
        // far above the roundings of these few operations (a few ulps of numbers below ~n)
        const double slack = 2.0 + 0x1p-30 * (fabs(top) + log_k_eps / theta + n);
        a[k] = top + log_k_eps / theta + slack;
        b[k] = log_rho / theta - delta + 0x1p-30;
    }
    return true;
}

// units[k] = the clamp, in units, for the steps from the window level n - SKIP_WINDOW (k + 1)
// down: the first unit above the least line at this window or an earlier one, at least 1 (unit
// 0 is always computed); TAIL_NONE where the bound does not hold. Filled by the option's threads
// (thread < threads).
__device__ __noinline__ void tail_table(const unsigned char* __restrict__ input, int rows, int row,
                                        unsigned char* units, int thread, int threads)
{
    const Option op = load_option(input, rows, row);
    double a[TAIL_LINES], b[TAIL_LINES];
    const bool on = tail_lines(op, a, b);
    const int windows = min(TAIL_WINDOWS, op.steps / SKIP_WINDOW);
    for (int k = thread; k < windows; k += threads) {
        // the least of the lines over every window so far: a line's least over m in
        // [SKIP_WINDOW, m_k] lies at an end, so the table never rises (a clamp only moves down)
        const double m = (double)(SKIP_WINDOW * (k + 1));
        double node = fma(b[0], b[0] < 0.0 ? m : SKIP_WINDOW, a[0]);
#pragma unroll
        for (int j = 1; j < TAIL_LINES; ++j)
            node = fmin(node, fma(b[j], b[j] < 0.0 ? m : SKIP_WINDOW, a[j]));
        const double unit = ceil(node * (1.0 / UNIT_NODES));
        units[k] = on && unit < (double)TAIL_NONE ? (unsigned char)fmax(1.0, unit) : TAIL_NONE;
    }
}

// The clamp after window k (k < 0: before the first), from the zero clamp and the table
__device__ __forceinline__ int window_clamp(int zero_clamp, int k)
{
    return k < 0 ? zero_clamp : min(zero_clamp, tail_units[option_slot()][k] * UNIT_NODES);
}

// the last window at or above level t (windows stop below WINDOW_MIN_LEVEL)
__device__ __forceinline__ int last_window(int n, int t)
{
    return min(n - t, n - WINDOW_MIN_LEVEL) / SKIP_WINDOW - 1;
}

// The units [from, to) stop at a window: their nodes become zeros, and so does what the unit
// below reads of unit `from` (W = 1: lane 31's neighbours, from lane 0's next group; W > 1: its
// shared slots of both parities, which the next step reads after its barrier). Every class then
// reads the same numbers: W > 1 would otherwise read one of the last two levels' values, by
// parity. (The units above `from` are read by stopped units only; the skip check sends their
// zeros.)
template <int W, int G>
__device__ __forceinline__ void stop_units(double (&v)[G][VT], double (&up)[G], double (&up2)[G],
                                           const StepState& st, double (*xch)[G * W + 1],
                                           double (*xch2)[2][G * W + 1], int from, int to)
{
#pragma unroll
    for (int s = 0; s < G; ++s) {
        const int first = first_node(st.lo + s, W, st.warp);
        if (first >= from && first < to) {
#pragma unroll
            for (int q = 0; q < VT; ++q) v[s][q] = 0.0;
        }
        if (W == 1 && st.lane == 31 && first + UNIT_NODES == from) up[s] = up2[s] = 0.0;
    }
    const int unit = from / UNIT_NODES;
    if (W > 1 && st.lane == 0 && unit % W == st.warp) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            xch[p][unit] = 0.0;
            xch2[p][0][unit] = 0.0;
            xch2[p][1][unit] = 0.0;
        }
    }
}

template <int W, int G, bool AMERICAN>
__device__ __forceinline__ double price_lattice(const Option& op, double (*xch)[G * W + 1],
                                                double (*xch2)[2][G * W + 1],
                                                unsigned char* skip_flags, OptionConsts* consts,
                                                int* top_shared, int warp, int lane,
                                                double* __restrict__ kept)
{
    const int n = op.steps;
    const double sign = op.call ? 1.0 : -1.0;
    const double log_ratio = op.log_up - op.log_down;

    double v[G][VT], group_ratio[G], node_ratio[VT];
    node_ratio[0] = 1.0;                  // exp(0 * log_ratio), known to the compiler
#pragma unroll
    for (int q = 1; q < VT; ++q)
        node_ratio[q] = exp((double)q * log_ratio);
    const double base_n = op.spot * exp((double)n * op.log_down);
    int top = -1;                         // the highest node with a positive payoff (zero_clamp)
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int i0 = ((g * W + warp) * 32 + lane) * VT;
        group_ratio[g] = exp((double)i0 * log_ratio);
#pragma unroll
        for (int q = 0; q < VT; ++q) {
            const double payoff = sign * fma(base_n, group_ratio[g] * node_ratio[q], -op.strike);
            const bool positive = i0 + q <= n && payoff > 0.0;
            v[g][q] = positive ? payoff : 0.0;
            top = positive ? i0 + q : top;
        }
    }
    top = __reduce_max_sync(FULL_MASK, top);
    if (W > 1) {
        if (lane == 0) atomicMax(top_shared, top);
        __syncthreads();
        top = *top_shared;
    }

    StepState st;
    st.pu = op.pu;
    st.pd = op.pd;
    st.minus_strike = -sign * op.strike;
    st.j = 0;
    st.lane = lane;
    st.warp = warp;
    st.lo = 0;
    st.topx = false;
    SkipState sk;
    sk.mode = SKIP_NONE;
    sk.hi = G;
    OptionConsts c;
    c.sign = sign;
    c.log_down = op.log_down;
    c.spot = op.spot;
    c.log_limit = 0.0;
    c.log_ratio = log_ratio;
    constexpr int CAPACITY = 32 * VT * G * W;
    c.steps = n;
    if (warp == 0 && lane == 0)
        c.clamp = zero_clamp(op, sign, top, CAPACITY, base_n, log_ratio);
    // only where the check fits the registers without spills: not W = 16 from G = 6, nor G = 8
    // for sm_80's allocation, nor W = 1 above BATCH_W1_SKIP_G (since the classes follow the
    // payoff's width, W = 1's options mostly run at G <= 6)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    constexpr bool ARCH_OK = G < 8;
#else
    constexpr bool ARCH_OK = true;
#endif
    constexpr bool CAN_SKIP = AMERICAN && (W > 1 || G <= BATCH_W1_SKIP_G) &&
                              !(W == 16 && G >= 6) && ARCH_OK;
    if (CAN_SKIP && n > SKIP_MIN_LEVEL + SKIP_WINDOW) exercise_bound(op, sk, c);
    if (warp == 0 && lane == 0) *consts = c;
    if (W > 1) __syncthreads(); else __syncwarp();   // read from the first chunk refresh on
    st.oc = consts;
    if (consts->clamp == CLAMP_FAILED) return __longlong_as_double(0x7ff8000000000000LL);   // NaN
    if (kept != nullptr && n >= 2 && consts->clamp == 0 && warp == 0 && lane == 0) {
#pragma unroll   // no positive payoff: every level is zero, and no step computes (or keeps) them
        for (int k = 0; k < 5; ++k) kept[k] = 0.0;
    }
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
        st.chunk_now = signed_level_base(op, sign, n - 1 - lane);
        st.chunk_next = signed_level_base(op, sign, n - 33 - lane);
    }
    double up[G], up2[G];
    // European: two levels a step down to level 3 or 4 (twice_steps)
    const bool twice = !AMERICAN && twice_class<W, G>() && n > 4 && kept == nullptr;
    const TwiceCoef coef = {op.pd * op.pd, 2.0 * op.pu * op.pd, op.pu * op.pu};
    if (twice) {
#pragma unroll
        for (int g = 0; g < G; ++g) send_pair<W, G>(v, up, up2, st, xch2, n, g);
    } else {
        send_neighbours<W, G, G>(v, up, st, xch, n);   // for the first step, from level n
    }
    if (n == CAPACITY && lane == 31 && warp == W - 1) {   // the top node, neighbour of the top lane
        const double top = sign * fma(base_n, exp((double)CAPACITY * log_ratio), -op.strike);
        const double payoff = top > 0.0 ? top : 0.0;
        if (W == 1) up[G - 1] = payoff;
        else if (twice) xch2[(n >> 1) & 1][0][G * W] = payoff;   // read after the first barrier
        else xch[n & 1][G * W] = payoff;
    }
    int t = n;
    while (t > 0) {
        // windows: the levels of the skip checks and of the tail clamp, every SKIP_WINDOW from the
        // top down to WINDOW_MIN_LEVEL (the last phase must start above level 3, where the steps
        // that keep the Greeks' levels begin); every class reaches each exactly (phases end
        // there), so all see the same clamps. The steps are read again here (volatile), not held
        // in a register through the steps: the largest classes have none to spare.
        const int steps = *reinterpret_cast<const volatile int*>(&st.oc->steps);
        const bool windows = sk.mode != SKIP_NONE || steps >= tail_min_steps(AMERICAN);
        if (windows && t < steps && ((steps - t) & (SKIP_WINDOW - 1)) == 0 &&
            t >= WINDOW_MIN_LEVEL) {
            // the last check (all groups back) at the window in [SKIP_MIN_LEVEL, + SKIP_WINDOW)
            if (CAN_SKIP && sk.mode != SKIP_NONE && t >= SKIP_MIN_LEVEL) {
                const bool last = t - SKIP_WINDOW < SKIP_MIN_LEVEL;
                skip_check<W, G>(v, up, group_ratio, node_ratio, st, sk, xch, skip_flags, t, last);
            }
            const int k = (steps - t) / SKIP_WINDOW - 1;
            const int clamp = window_clamp(st.oc->clamp, k);
            const int before = window_clamp(st.oc->clamp, k - 1);
            if (clamp < before) {                      // the same in every warp of the block
                if (W > 1) __syncthreads();   // the last step's neighbours read before zeroing
                stop_units<W, G>(v, up, up2, st, xch, xch2, clamp, before);
            }
        }
        const int window_below = t - SKIP_WINDOW + ((steps - t) & (SKIP_WINDOW - 1));
        const int next_window = windows && window_below >= WINDOW_MIN_LEVEL ? window_below : -1;
        // active groups for the step from level t: first node <= t - 1, and below the units left
        // out (zero_clamp, tail_clamp)
        const int top_node = min(t - 1, window_clamp(st.oc->clamp, last_window(steps, t)) - 1);
        int active = 0;
#pragma unroll
        for (int g = 0; g < G; ++g) active += first_node(g, W, warp) <= top_node;
        // the phase lasts while its last active group stays active: down to level first_node,
        // or to the next window
        int t_lo = max(active > 0 ? first_node(active - 1, W, warp) : 0, next_window);
        // two levels a step: an even distance (one level further only computes nodes above the
        // level, as idle groups' do), down to level 3 or 4 (the same for every warp)
        const bool twice_now = twice && t > 4;
        if (twice_now) t_lo = max(t_lo - ((t - t_lo) & 1), 3 + ((t - 3) & 1));
        // computed slots: the active groups less those skipped
        const int computed = !CAN_SKIP ? active
                           : skips_prefix(sk.mode) ? max(active - st.lo, 0)
                           : min(active, sk.hi);
        if (twice_now) {
            switch (computed) {
            case 0: twice_steps<W, G, 0>(v, up, up2, coef, st, xch2, t, t_lo); break;
#define TWICE(K) case K: if (K <= G) twice_steps<W, G, (K <= G ? K : G)>(v, up, up2, coef, st, xch2, t, t_lo); break;
            TWICE(1) TWICE(2) TWICE(3) TWICE(4) TWICE(5) TWICE(6) TWICE(7) TWICE(8)
#undef TWICE
            }
            t = t_lo;
            // the last levels one at a time: their neighbours as steps_with_groups takes them
            if (t <= 4) send_neighbours<W, G, G>(v, up, st, xch, t);
            continue;
        }
        switch (computed) {
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
__device__ __forceinline__ void batch_price(const unsigned char* __restrict__ input, int n, int first,
                                            double* __restrict__ out, double* __restrict__ levels,
                                            int count)
{
    __shared__ double xch[2][G * W + 1];
    __shared__ double xch2[W > 1 ? 2 : 1][2][G * W + 1];   // twice_steps (W > 1 only)
    __shared__ unsigned char skip_flags[OPTIONS_PER_BLOCK][G * W];
    __shared__ OptionConsts consts[OPTIONS_PER_BLOCK];
    __shared__ int top_shared;            // W > 1: the option's highest positive payoff node
    const int lane = threadIdx.x & 31;
    const int warp_in_block = threadIdx.x >> 5;
    const int o = W == 1 ? blockIdx.x * OPTIONS_PER_BLOCK + warp_in_block : blockIdx.x;
    const int warp = W == 1 ? 0 : warp_in_block;
    if (W > 1) {
        for (int k = threadIdx.x; k < 2 * (G * W + 1); k += blockDim.x)
            (&xch[0][0])[k] = 0.0;
        for (int k = threadIdx.x; k < 4 * (G * W + 1); k += blockDim.x)
            (&xch2[0][0][0])[k] = 0.0;
        if (threadIdx.x == 0) top_shared = -1;
        __syncthreads();
    }
    if (o >= count) return;   // uniform: the whole warp (W = 1) or the whole block (W > 1)
    const int row = sorted_row(input, n, first + o);
    // its own load of the option's numbers, in its own function: with op's numbers used here for
    // it, ptxas keeps pu and pd in extra registers through the steps' loops (register copies)
    const int slot = option_slot();
    tail_table(input, n, row, tail_units[slot], warp * 32 + lane, 32 * W);   // read after a barrier
    const Option op = load_option(input, n, row);
    double* kept = levels != nullptr ? levels + 5 * (size_t)row : nullptr;
    const double price = op.american
        ? price_lattice<W, G, true>(op, xch, xch2, skip_flags[slot], &consts[slot],
                                    &top_shared, warp, lane, kept)
        : price_lattice<W, G, false>(op, xch, xch2, skip_flags[slot], &consts[slot],
                                     &top_shared, warp, lane, kept);
    if (warp == 0 && lane == 0) {
        out[row] = price;
        if (op.call && kept != nullptr) {   // levels 1 and 2 back in node order
            const double v10 = kept[0], v20 = kept[2];
            kept[0] = kept[1];
            kept[1] = v10;
            kept[2] = kept[4];
            kept[4] = v20;
        }
    }
}

#define BATCH_KERNEL(G)                                                                           \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS, KERNEL_MIN_BLOCKS(G))             \
        batch_kernel_g##G(const unsigned char* __restrict__ input, int n, int first,             \
                          double* __restrict__ out, double* __restrict__ levels, int count)       \
    {                                                                                             \
        batch_price<BATCH_W, G>(input, n, first, out, levels, count);                             \
    }

BATCH_KERNEL(1)
BATCH_KERNEL(2)
BATCH_KERNEL(3)
BATCH_KERNEL(4)
BATCH_KERNEL(5)
BATCH_KERNEL(6)
BATCH_KERNEL(7)
BATCH_KERNEL(8)
