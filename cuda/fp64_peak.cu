// FP64 FMA throughput probe for `pricer bench gpu`: each thread runs CHAINS independent FMA chains
// for `iters` iterations; FMA/s = threads * CHAINS * iters / time.  The result is stored so the
// compiler cannot drop the work.
#ifndef CHAINS
#define CHAINS 8
#endif

extern "C" __global__ void fma_peak(double* __restrict__ out, int iters, double a, double b)
{
    double x[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) x[c] = (double)(threadIdx.x + c);
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) x[c] = fma(x[c], a, b);
    }
    double s = 0.0;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += x[c];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
