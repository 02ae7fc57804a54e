// pricer's Hull–White trinomial kernels: whole books of bond options, one tree per instrument, FP64.
// The plain reference beside them is pricer/engines/cpu/trinomial.py (value_one), whose arithmetic
// they follow step for step (GPU-OUTER takes a step's factor e^{-alpha_m dt} as the NumPy reference
// hw1f.price does, by ln and exp; GPU-FLAT as the CPU engine does, P / sum): the forward
// induction of the Arrow–Debreu prices q (fitting the displacement alpha_m of each step to the
// curve's discount P(0, (m + 1) dt)), then the backward induction of the bond (for an option on
// it) and of the instrument, with one e^{-alpha_m dt} a step (written by the forward sweep to
// `shifts`, read back by the backward one) and e^{-j dr dt} per row.
//
// Tree geometry (docs/numerics.md): level m has the rows |j| <= w = min(m, jmax); a normal row j
// branches to j + 1, j, j - 1 with pu, pm, pd; the edge rows +-jmax (present once w = jmax) branch
// to jmax, jmax - 1, jmax - 2 (the top) and -jmax + 2, -jmax + 1, -jmax (the bottom) with their
// own probabilities (hw1f.branching; here `probabilities`).
//
// The two strategies of Pawlak et al. (2021); pricer/engines/gpu/trinomial.py lays out their inputs:
//
// hw_outer ("GPU-OUTER"): one thread per instrument, the whole induction in the thread, as the CPU
//   engine does it (its step factor the reference's). The instruments are sorted by width, then
//   height (descending), so that a warp's 32 trees are alike; each warp's working rows are padded
//   to its widest tree and transposed (row i of array a of lane l at
//   scratch[base + (a * width + i) * 32 + l]), so that the warp's loads and stores coalesce. Any
//   width.
//
// hw_flat ("GPU-FLAT"): a block prices a bin of instruments, two tree rows a thread (rows 2u and
//   2u + 1 of instrument k are thread seg[k] + u of its block: their weights and e^{-j dr dt} stay in
//   registers, and a step's fixed work is shared by two rows), the levels' values in shared memory,
//   each row's new value a weighted sum of the five slots around it. Bins are packed on the host
//   (first fit, in the sorted order, in threads); a tree of at most 32 threads never crosses a
//   warp, a wider one starts at a warp, so that each level's sum sum_j q_j e^{-j dr dt} is a
//   segmented warp reduction (shuffles) and, past one warp, a sum of the warps' parts. The block
//   runs to its tallest tree: the forward sweeps start together at m = 0, the backward sweeps end
//   together at m = 0. Widths up to 2 blockDim.x rows.
//
// Prices agree with the CPU engine to rounding (sums in another order; fused multiply-adds). An
// instrument's price does not depend on the other instruments of its call.

#define FULL_MASK 0xffffffffu

// The host's numbers, given as -D options by pricer/engines/gpu/trinomial.py (defines()): the
// product and exercise codes (pricer.model.hw1f.PRODUCTS, EXERCISES), today and the dates' slack
// (hw1f.TODAY, DATE_SLACK), GPU-OUTER's arrays a thread, GPU-FLAT's rows a thread, pad and widest
// tree.
#if !defined(HW_OPTION) || !defined(HW_CALLABLE) || !defined(HW_PUTTABLE) || !defined(HW_AMERICAN) \
    || !defined(HW_BERMUDAN) || !defined(HW_TODAY) || !defined(HW_DATE_SLACK) \
    || !defined(OUTER_ARRAYS) || !defined(FLAT_ROWS) || !defined(FLAT_PAD) || !defined(FLAT_MAX_ROWS)
#error "trinomial.cu's layout must be given (-D), from pricer/engines/gpu/trinomial.py's defines()"
#endif

enum { OPTION = HW_OPTION, CALLABLE = HW_CALLABLE, PUTTABLE = HW_PUTTABLE };

struct Row {          // one row's branching (hw1f.branching)
    double pu, pm, pd;
    int offset;       // +1 bottom edge, -1 top edge, 0 normal
};

__device__ __forceinline__ Row probabilities(int j, int jmax, double M)
{
    Row p;
    const double jm = j * M, jjmm = jm * jm;
    if (j == jmax) {
        p.offset = -1;
        p.pu = 7.0 / 6.0 + (jjmm + 3.0 * jm) / 2.0;
        p.pm = -1.0 / 3.0 - jjmm - 2.0 * jm;
        p.pd = 1.0 / 6.0 + (jjmm + jm) / 2.0;
    } else if (j == -jmax) {
        p.offset = 1;
        p.pu = 1.0 / 6.0 + (jjmm - jm) / 2.0;
        p.pm = -1.0 / 3.0 - jjmm + 2.0 * jm;
        p.pd = 7.0 / 6.0 + (jjmm - 3.0 * jm) / 2.0;
    } else {
        p.offset = 0;
        p.pu = 1.0 / 6.0 + (jjmm + jm) / 2.0;
        p.pm = 2.0 / 3.0 - jjmm;
        p.pd = 1.0 / 6.0 + (jjmm - jm) / 2.0;
    }
    return p;
}

__device__ __forceinline__ void exercise_node(double bond, double& value, double strike,
                                              double sign, int product)
{
    // comparisons, not fmax / fmin, whose NaN handling costs instructions: the same values for
    // every finite input (and a NaN value is replaced as fmax replaces it)
    if (product == OPTION) {
        const double x = sign * (bond - strike), gain = x > 0.0 ? x : 0.0;
        value = value > gain ? value : gain;
    } else if (product == CALLABLE) {
        value = value < strike ? value : strike;
    } else {
        value = value > strike ? value : strike;
    }
}

// The value at the last step where the option may be exercised there: against the redemption F,
// which the last step's flows pay (hw1f._at_maturity): the bond-with-option products' value is
// what exercise changes, min(F, K) - F or max(F, K) - F; the option's max(+-(F - K), 0).
__device__ __forceinline__ double at_maturity(double F, double strike, double sign, int product)
{
    if (product == OPTION)
        return fmax(0.0, fmax(sign * (F - strike), 0.0));
    if (product == CALLABLE)
        return fmin(F, strike) - F;
    return fmax(F, strike) - F;
}

// ---------------------------------------------------------------------------------------------
// GPU-OUTER
// Thread s prices instrument inst[s] (s < n); warp s / 32's rows start at
// scratch[base[s / 32] - base0] and hold width[s / 32] rows in each of its 8 arrays (a launch of
// a book's warps from the one whose rows start at base0).

enum { PU = 0, PM = 1, PD = 2, LOCAL = 3, Q0 = 4, Q1 = 5, V0 = 6, V1 = 7 };

extern "C" __global__ void hw_outer(
    int n, const int* __restrict__ inst, const long long* __restrict__ base,
    const int* __restrict__ warp_width,
    const double* __restrict__ a, const double* __restrict__ dt, const long long* __restrict__ steps,
    const long long* __restrict__ jmax_of, const double* __restrict__ dr,
    const double* __restrict__ strike, const double* __restrict__ sign,
    const long long* __restrict__ product_of, const long long* __restrict__ starts,
    const double* __restrict__ face, const double* __restrict__ flows,
    const unsigned char* __restrict__ exercise,
    const double* __restrict__ discount, double* __restrict__ shifts, double* __restrict__ scratch,
    double* __restrict__ out, long long base0)
{
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= n)
        return;
    const int i = inst[s];
    const int lane = s & 31;
    const int W = warp_width[s >> 5];
    double* S = scratch + (base[s >> 5] - base0) + lane;
#define AT(arr, row) S[((arr) * W + (row)) * 32]
    const int jmax = (int)jmax_of[i], width = 2 * jmax + 1, N = (int)steps[i];
    const double h = dt[i], step_dr = dr[i], M = expm1(-a[i] * h);
    const long long at = starts[i];
    for (int row = 0; row < width; ++row) {
        const Row p = probabilities(row - jmax, jmax, M);
        AT(PU, row) = p.pu;
        AT(PM, row) = p.pm;
        AT(PD, row) = p.pd;
        AT(LOCAL, row) = exp(-(row - jmax) * step_dr * h);
    }
    // forward: level m's node j at index j + min(m, jmax) of q
    int q = Q0, qn = Q1;
    AT(q, 0) = 1.0;
    for (int m = 0; m < N; ++m) {
        const int w = min(m, jmax), wn = min(m + 1, jmax);
        double total = 0.0;
        for (int k = 0; k <= 2 * w; ++k)
            total += AT(q, k) * AT(LOCAL, k - w + jmax);
        const double alpha = (log(total) - log(discount[at + m + 1])) / h;
        const double shift = exp(-alpha * h);
        shifts[at + m] = shift;
        for (int k = 0; k <= 2 * wn; ++k)
            AT(qn, k) = 0.0;
        for (int k = 0; k <= 2 * w; ++k) {
            const int row = k - w + jmax;
            const int offset = row == 0 ? 1 : (row == 2 * jmax ? -1 : 0);
            const int centre = k - w + offset + wn;
            const double v = AT(q, k) * (AT(LOCAL, row) * shift);
            AT(qn, centre + 1) += v * AT(PU, row);
            AT(qn, centre) += v * AT(PM, row);
            AT(qn, centre - 1) += v * AT(PD, row);
        }
        const int t = q; q = qn; qn = t;
    }
    // backward: the bond in Q0/Q1 (an option's alone), the instrument in V0/V1
    const double K = strike[i], sg = sign[i];
    const int product = (int)product_of[i];
    // the bond apart is only an option's exercise value: a callable's or puttable's value
    // carries the bond's flows itself, so its thread leaves the bond's rows alone
    const bool with_bond = product == OPTION;
    int b = Q0, bn = Q1, v = V0, vn = V1;
    int w = min(N, jmax);
    const double value_N = exercise[at + N] ? at_maturity(face[i], K, sg, product) : 0.0;
    for (int k = 0; k <= 2 * w; ++k) {       // ex-coupon at maturity: nothing left
        AT(b, k) = 0.0;
        AT(v, k) = value_N;
    }
    for (int m = N - 1; m >= 0; --m) {
        const int wn = w;
        w = min(m, jmax);
        const double flow = flows[at + m + 1];
        const double carried = with_bond ? 0.0 : flow;
        { int t = b; b = bn; bn = t; t = v; v = vn; vn = t; }
        for (int k = 0; k <= 2 * wn; ++k) {
            if (with_bond)
                AT(bn, k) += flow;
            AT(vn, k) += carried;
        }
        const double shift = shifts[at + m];
        const bool ex = exercise[at + m];
        for (int k = 0; k <= 2 * w; ++k) {
            const int row = k - w + jmax;
            const int offset = row == 0 ? 1 : (row == 2 * jmax ? -1 : 0);
            const int centre = k - w + offset + wn;
            const double disc = shift * AT(LOCAL, row);
            const double pu = AT(PU, row), pm = AT(PM, row), pd = AT(PD, row);
            const double bond = with_bond ? disc * (pu * AT(bn, centre + 1) + pm * AT(bn, centre)
                                                    + pd * AT(bn, centre - 1)) : 0.0;
            double value = disc * (pu * AT(vn, centre + 1) + pm * AT(vn, centre)
                                   + pd * AT(vn, centre - 1));
            if (ex)
                exercise_node(bond, value, K, sg, product);
            if (with_bond)
                AT(b, k) = bond;
            AT(v, k) = value;
        }
    }
    out[i] = AT(v, 0);
#undef AT
}

// ---------------------------------------------------------------------------------------------
// GPU-FLAT
// Block b prices the instruments inst[block_first[b] .. block_first[b + 1] - 1]; instrument k's
// rows are those of threads seg[k] .. seg[k] + jmax (row r at slot 2 seg[k] + r of the block's
// 2 blockDim.x row slots: thread t holds slots 2t and 2t + 1); block_steps[b] is its tallest tree.
// A level is one buffer of the row slots with FLAT_PAD zero slots at each end, which no thread
// writes: a row's new value is a weighted sum over the five slots around its own (two rows a
// thread: six slots, three 16-byte loads), the weights fixed per row and zero for a slot outside
// its tree, so no step needs a branch on the tree's edges or on the level's width (a row the
// level does not reach holds 0 forward; backward its value is finite and never read). Forward,
// w[d] is the probability that row j - 2 + d branches to row j (the edge rows' own branching
// included: hw1f.branching); backward, c[d] is row j's probability of branching to row j - 2 + d,
// times e^{-j dr dt}. One barrier a step in each sweep: the buffers are double-buffered by the
// step's parity (a thread writes step m + 1's buffer while another may still read step m's; it
// cannot write step m + 2's before every thread has passed step m + 1's barrier, after its reads
// of step m). Every thread of a tree computes the level's sum and its shift itself (the same
// numbers in the same order), so no second barrier hands them out. Every thread writes its slots
// every step (a finished or empty one its last, finite, values), so that the zero weights of a
// neighbouring tree's rows never meet a NaN.
// Shared memory (flat_shared_bytes): four buffers of 2 blockDim.x + 2 FLAT_PAD doubles (forward
// the level by parity; backward the bond and the value by parity), then 2 x 32 doubles for the
// warps' parts of the forward sums. Two rows a thread, not one or four (docs/decisions.md).

// FLAT_ROWS: rows a thread, even; FLAT_PAD: zero slots at each end of a buffer (the reach of a
// row's five slots); FLAT_MAX_ROWS: the widest tree
#define FLAT_WINDOW (FLAT_ROWS + 2 * FLAT_PAD)     // the slots a thread's rows read

// the probability that row `from` of a tree of half-width jmax branches to row `to` (0 if never)
__device__ __forceinline__ double branch_to(int from, int to, int jmax, double M)
{
    if (from < -jmax || from > jmax)
        return 0.0;
    const Row p = probabilities(from, jmax, M);
    const int centre = from + p.offset;
    return to == centre + 1 ? p.pu : to == centre ? p.pm : to == centre - 1 ? p.pd : 0.0;
}

__device__ __forceinline__ double2 load2(const double* at)
{
    return *reinterpret_cast<const double2*>(at);
}

// sum_d k[d] L[d], d = 0 .. 4, in this order (a row's new value, its weights and its window)
__device__ __forceinline__ double window_sum(const double (&k)[5], const double* L)
{
    return fma(k[4], L[4], fma(k[3], L[3], fma(k[2], L[2], fma(k[1], L[1], k[0] * L[0]))));
}

extern "C" __global__ void __launch_bounds__(FLAT_MAX_ROWS / FLAT_ROWS) hw_flat(
    const int* __restrict__ block_first, const int* __restrict__ seg,
    const int* __restrict__ block_steps, const int* __restrict__ inst,
    const double* __restrict__ a, const double* __restrict__ dt, const long long* __restrict__ steps,
    const long long* __restrict__ jmax_of, const double* __restrict__ dr,
    const double* __restrict__ strike, const double* __restrict__ sign,
    const long long* __restrict__ product_of, const long long* __restrict__ starts,
    const double* __restrict__ face, const double* __restrict__ flows,
    const unsigned char* __restrict__ exercise,
    const double* __restrict__ discount, double* __restrict__ shifts, double* __restrict__ out)
{
    extern __shared__ double shared[];
    const int T = blockDim.x, t = threadIdx.x, lane = t & 31;
    const int S = FLAT_ROWS * T + 2 * FLAT_PAD;       // a buffer
    double* const parts = shared + 4 * S;             // 2 x 32: the warps' parts by parity
    const int own = FLAT_PAD + FLAT_ROWS * t;         // this thread's first slot in a buffer

    const int lo = block_first[blockIdx.x], hi = block_first[blockIdx.x + 1];
    int k = -1;
    for (int x = lo; x < hi && seg[x] <= t; ++x)
        k = x;
    int i = 0, jmax = 0, N = 0, first = t, rows = 1;
    if (k >= 0) {
        i = inst[k];
        jmax = (int)jmax_of[i];
        first = seg[k];
        rows = 2 * jmax + 1;
        N = (int)steps[i];
    }
    const int threads = (rows + FLAT_ROWS - 1) / FLAT_ROWS;    // the tree's
    const bool wide = threads > 32;
    const bool mine = k >= 0 && t - first < threads;
    if (!mine) {
        first = t;
        rows = 1;
        N = 0;
        jmax = 0;
    }
    const double h = mine ? dt[i] : 1.0, M = mine ? expm1(-a[i] * h) : 0.0;
    const double step_dr = mine ? dr[i] : 0.0;
    const long long at = mine ? starts[i] : 0;
    bool has[FLAT_ROWS];
    int j[FLAT_ROWS];
    double local[FLAT_ROWS], q[FLAT_ROWS], w[FLAT_ROWS][5];
#pragma unroll
    for (int e = 0; e < FLAT_ROWS; ++e) {
        const int r = (t - first) * FLAT_ROWS + e;
        has[e] = mine && r < rows;
        j[e] = r - jmax;
        local[e] = has[e] ? exp(-j[e] * step_dr * h) : 0.0;
        q[e] = has[e] && j[e] == 0 ? 1.0 : 0.0;
#pragma unroll
        for (int d = 0; d < 5; ++d)
            w[e][d] = has[e] ? branch_to(j[e] - 2 + d, j[e], jmax, M) : 0.0;
    }
    if (t < 4 * FLAT_PAD * 2) {     // the four buffers' pads
        const int buffer = t / (2 * FLAT_PAD), x = t % (2 * FLAT_PAD);
        shared[buffer * S + (x < FLAT_PAD ? x : S - 2 * FLAT_PAD + x)] = 0.0;
    }
    const int end = min(32, first + threads - (t & ~31));
    const int first_warp = first >> 5, nparts = (threads + 31) >> 5;
    // the segmented sum's reach: its warp's most threads a tree (a lane's tree never exceeds it)
    const int span = __reduce_max_sync(FULL_MASK, wide ? 0 : threads);
    const int tallest = block_steps[blockIdx.x];

    double disc_next = (mine && N > 0) ? discount[at + 1] : 1.0;
    for (int m = 0; m < tallest; ++m) {
        double* Y = shared + (m & 1) * S;
        double* P = parts + (m & 1) * 32;
        const bool live = mine && m < N;
        const double disc = disc_next;
        if (live && m + 1 < N)
            disc_next = discount[at + m + 2];
        double y[FLAT_ROWS], x = 0.0;
#pragma unroll
        for (int e = 0; e < FLAT_ROWS; ++e) {
            y[e] = q[e] * local[e];
            x += y[e];
        }
#pragma unroll
        for (int e = 0; e < FLAT_ROWS; e += 2)
            *reinterpret_cast<double2*>(Y + own + e) = make_double2(y[e], y[e + 1]);
        double total = 0.0;
        if (wide) {
            for (int d = 16; d >= 1; d >>= 1)
                x += __shfl_xor_sync(FULL_MASK, x, d);
            if (lane == 0)
                P[t >> 5] = x;
        } else {
            for (int d = 1; d < span; d <<= 1) {
                const double below = __shfl_down_sync(FULL_MASK, x, d);
                if (lane + d < end)
                    x += below;
            }
            total = __shfl_sync(FULL_MASK, x, first & 31);
        }
        __syncthreads();
        if (live) {
            double L[FLAT_WINDOW], sum[FLAT_ROWS];
#pragma unroll
            for (int v = 0; v < FLAT_WINDOW; v += 2) {
                const double2 z = load2(Y + own - FLAT_PAD + v);
                L[v] = z.x;
                L[v + 1] = z.y;
            }
#pragma unroll
            for (int e = 0; e < FLAT_ROWS; ++e)
                sum[e] = window_sum(w[e], L + e);
            if (wide) {
                total = P[first_warp];
                for (int part = 1; part < nparts; ++part)
                    total += P[first_warp + part];
            }
            const double shift = disc / total;
            if (t == first)
                shifts[at + m] = shift;
#pragma unroll
            for (int e = 0; e < FLAT_ROWS; ++e)
                q[e] = shift * sum[e];
        }
    }
    __syncthreads();     // the shifts, written by each tree's first thread, read by all of it

    // backward: c[e][d], row j's branching towards row j - 2 + d, with e^{-j dr dt}
    double c[FLAT_ROWS][5];
#pragma unroll
    for (int e = 0; e < FLAT_ROWS; ++e)
#pragma unroll
        for (int d = 0; d < 5; ++d)
            c[e][d] = has[e] ? local[e] * branch_to(j[e], j[e] - 2 + d, jmax, M) : 0.0;
    const double K = mine ? strike[i] : 0.0, sg = mine ? sign[i] : 0.0;
    const int product = mine ? (int)product_of[i] : OPTION;
    // the bond apart is only an option's exercise value: a callable's or puttable's value carries
    // the bond's flows itself, so its rows skip the bond's sums (its slots are still written,
    // zero plus the flows, so that a neighbour's zero weight never meets a stale slot)
    const bool with_bond = product == OPTION;
    const double value_N = (mine && exercise[at + N]) ? at_maturity(face[i], K, sg, product) : 0.0;
    double bond[FLAT_ROWS], value[FLAT_ROWS];
#pragma unroll
    for (int e = 0; e < FLAT_ROWS; ++e) {
        bond[e] = 0.0;                   // ex-coupon at maturity: nothing left
        value[e] = value_N;
    }
    double flow = 0.0, shift = 0.0;
    bool ex = false;
    if (mine && N > 0) {
        flow = flows[at + N];
        shift = shifts[at + N - 1];
        ex = exercise[at + N - 1];
    }
    for (int m = tallest - 1; m >= 0; --m) {
        double* Bn = shared + (m & 1) * 2 * S;
        double* Vn = Bn + S;
        const bool live = mine && m < N;
        const double f = flow, s = shift, carried = with_bond ? 0.0 : f;
        const bool ex_m = ex;
#pragma unroll
        for (int e = 0; e < FLAT_ROWS; e += 2) {
            *reinterpret_cast<double2*>(Bn + own + e) = make_double2(bond[e] + f, bond[e + 1] + f);
            *reinterpret_cast<double2*>(Vn + own + e) = make_double2(value[e] + carried,
                                                                     value[e + 1] + carried);
        }
        if (live && m > 0) {
            flow = flows[at + m];
            shift = shifts[at + m - 1];
            ex = exercise[at + m - 1];
        }
        __syncthreads();
        if (live) {
            double LB[FLAT_WINDOW], LV[FLAT_WINDOW];
#pragma unroll
            for (int v = 0; v < FLAT_WINDOW; v += 2) {
                const double2 zb = load2(Bn + own - FLAT_PAD + v);
                const double2 zv = load2(Vn + own - FLAT_PAD + v);
                LB[v] = zb.x;
                LB[v + 1] = zb.y;
                LV[v] = zv.x;
                LV[v + 1] = zv.y;
            }
#pragma unroll
            for (int e = 0; e < FLAT_ROWS; ++e) {
                if (with_bond)
                    bond[e] = s * window_sum(c[e], LB + e);
                value[e] = s * window_sum(c[e], LV + e);
            }
            if (ex_m) {
#pragma unroll
                for (int e = 0; e < FLAT_ROWS; ++e)
                    exercise_node(bond[e], value[e], K, sg, product);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < FLAT_ROWS; ++e)
        if (has[e] && j[e] == 0)
            out[i] = value[e];
}

// ---------------------------------------------------------------------------------------------
// The per-step arrays, filled on the GPU from what they follow from (pricer/model/bond_book.py's
// fill_steps, the same arithmetic): thread i writes instrument i's steps starts[i] ..
// starts[i] + steps[i] of discount (P(0, m dt): its curve's zero rate at m dt, np.interp's
// formula, flat beyond the ends), flows (coupons on their nearest steps after today, summed
// where two meet, then the face at maturity) and exercise (its exercise steps). A book's copies
// are then its instruments' numbers only, not 17 bytes a step.

enum { AMERICAN = HW_AMERICAN, BERMUDAN = HW_BERMUDAN };

extern "C" __global__ void hw_fill(
    int n, const long long* __restrict__ starts, const long long* __restrict__ steps,
    const double* __restrict__ dt, const long long* __restrict__ curve,
    const double* __restrict__ times, const double* __restrict__ rates,
    const long long* __restrict__ bounds, const double* __restrict__ face,
    const double* __restrict__ coupon, const long long* __restrict__ frequency,
    const double* __restrict__ maturity, const long long* __restrict__ kind,
    const double* __restrict__ first, const double* __restrict__ last,
    const double* __restrict__ every, double* __restrict__ flows,
    unsigned char* __restrict__ exercise, double* __restrict__ discount)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    const long long lo = starts[i];
    const int N = (int)steps[i];
    const double h = dt[i];
    const double* xs = times + bounds[curve[i]];
    const double* ys = rates + bounds[curve[i]];
    const int last_point = (int)(bounds[curve[i] + 1] - bounds[curve[i]]) - 1;
    int j = 0;
    for (int m = 0; m <= N; ++m) {
        const double t = m * h;
        while (j < last_point && xs[j + 1] <= t)
            ++j;
        double r;
        if (t < xs[0])
            r = ys[0];
        else if (j == last_point)
            r = ys[last_point];
        else
            r = __dadd_rn(__dmul_rn(__ddiv_rn(ys[j + 1] - ys[j], xs[j + 1] - xs[j]), t - xs[j]),
                          ys[j]);
        discount[lo + m] = exp(-r * t);
        flows[lo + m] = 0.0;
        exercise[lo + m] = 0;
    }
    const long long f = frequency[i];
    if (f > 0 && coupon[i] != 0.0) {
        const double amount = face[i] * coupon[i] / (double)f;
        const int count = (int)floor(__dmul_rn(maturity[i], (double)f) + HW_DATE_SLACK) + 1;
        for (int k = 0; k < count; ++k) {
            const double t = maturity[i] - (double)k / (double)f;
            if (t > HW_TODAY)
                flows[lo + max(1LL, (long long)rint(t / h))] += amount;   // after today
        }
    }
    flows[lo + N] += face[i];
    if (kind[i] == AMERICAN) {
        const int a = max((int)ceil(first[i] / h - HW_DATE_SLACK), 0);
        const int b = min((int)floor(last[i] / h + HW_DATE_SLACK), N);
        for (int m = a; m <= b; ++m)
            exercise[lo + m] = 1;
    } else {
        const int dates = kind[i] == BERMUDAN
            ? (int)floor(__dmul_rn(last[i] - first[i], every[i]) + HW_DATE_SLACK) + 1 : 1;
        for (int k = 0; k < dates; ++k) {
            const double t = first[i] + (k > 0 ? (double)k / every[i] : 0.0);
            exercise[lo + min(max((int)rint(t / h), t > HW_TODAY ? 1 : 0), N)] = 1;
        }
    }
}
