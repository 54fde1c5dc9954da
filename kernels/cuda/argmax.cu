/*
 * argmax: greedy sampling on the GPU: out[s] = the index of the largest of
 * logits[s][0..n_vocab-1], the lowest such index on ties (NaNs never win; a
 * row of NaNs gives 0). Twin: a plain first-maximum scan on the CPU.
 *
 * Ownership: one block of 1024 threads per row. Thread i scans elements i,
 * i + 1024, ... keeping the first maximum it sees; warps then merge
 * (value, index) pairs by butterfly, preferring the larger value and, on
 * equal values, the lower index, and warp 0 merges the 32 warp winners.
 */
#include "kernels/cuda/ops.h"

#include "kernels/cuda/ops_device.cuh"

static __device__ __forceinline__ void argmax_merge(float &bv, int32_t &bi, float ov, int32_t oi)
{
    if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
    }
}

static __device__ __forceinline__ void argmax_warp(float &bv, int32_t &bi)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(OPS_FULL_MASK, bv, o);
        const int32_t oi = __shfl_xor_sync(OPS_FULL_MASK, bi, o);
        argmax_merge(bv, bi, ov, oi);
    }
}

static __global__ void argmax_kernel(const float *logits, uint32_t n, int32_t *out)
{
    __shared__ float s_v[32];
    __shared__ int32_t s_i[32];
    const float *x = logits + (size_t)blockIdx.x * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        if (v > bv || (v == bv && bi == INT32_MAX)) {
            bv = v;
            bi = (int32_t)i;
        }
    }
    argmax_warp(bv, bi);
    if (lane == 0) {
        s_v[warp] = bv;
        s_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const bool have = lane < (int)(blockDim.x >> 5);
        bv = have ? s_v[lane] : -INFINITY;
        bi = have ? s_i[lane] : INT32_MAX;
        argmax_warp(bv, bi);
        if (lane == 0)
            out[blockIdx.x] = bi == INT32_MAX ? 0 : bi;
    }
}

extern "C" int cuda_argmax(const float *d_logits, uint32_t n_vocab, uint32_t S, int32_t *d_out,
                           cudaStream_t stream)
{
    if (!d_logits || !d_out || n_vocab == 0 || n_vocab > INT32_MAX) {
        log_error("cuda_argmax: bad arguments (logits %p, out %p, n_vocab %u)",
                  (const void *)d_logits, (void *)d_out, n_vocab);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    argmax_kernel<<<S, 1024, 0, stream>>>(d_logits, n_vocab, d_out);
    return OPS_LAUNCH_CHECK("cuda_argmax");
}
