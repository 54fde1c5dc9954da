/*
 * argmax: greedy sampling on the GPU: out[s] = the index of the largest of
 * logits[s][0..n_vocab-1], the lowest such index on ties (NaNs never win; a
 * row of NaNs gives 0). Twin: a plain first-maximum scan on the CPU.
 *
 * Ownership: per row, a thread block cluster of ARGMAX_CLUSTER blocks of 1024
 * threads on sm_90 and later where the row is long (one block elsewhere);
 * block b scans a contiguous slice of the row. Each thread keeps the first
 * maximum of the elements it scans in ascending order, four float4 loads in
 * flight (scalar loads where the row is not 16-byte aligned); warps then merge
 * (value, index) pairs by butterfly, preferring the larger value and, on
 * equal values, the lower index; warp 0 merges the 32 warp winners, and block
 * 0 of the cluster merges the blocks' winners from their shared memory. The
 * merge order cannot change the result: the rule picks the lowest index of
 * the largest value whatever the order. Launched with programmatic dependent
 * launch where the kernels are (pdl.cuh): it waits before reading the logits.
 * (One block with one load in flight per thread read 151936 logits in 51 us,
 * 12 GB/s: latency-bound.)
 */
#include "kernels/cuda/ops.h"

#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

#include <cooperative_groups.h>

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

#define ARGMAX_THREADS 1024
#define ARGMAX_CLUSTER 8          /* blocks per row on sm_90 and later */
#define ARGMAX_CLUSTER_MIN 32768  /* shortest row split over a cluster */

/* The first maximum of x[i] over i in [lo, hi) that this thread scans (i = lo + its share, in
 * ascending order), merged into (bv, bi). */
static __device__ __forceinline__ void argmax_scan(const float *x, uint32_t lo, uint32_t hi,
                                                   float &bv, int32_t &bi)
{
    const auto take = [&](float v, uint32_t i) {
        if (v > bv || (v == bv && bi == INT32_MAX)) {
            bv = v;
            bi = (int32_t)i;
        }
    };
    const uint32_t t = threadIdx.x, T = blockDim.x;
    if ((reinterpret_cast<uintptr_t>(x + lo) & 15) == 0) {
        /* thread t takes float4 number t, t + T, ... of the slice: ascending for it */
        const uint32_t n4 = (hi - lo) / 4;
        const float4 *x4 = reinterpret_cast<const float4 *>(x + lo);
        uint32_t j = t;
        for (; j + 3 * T < n4; j += 4 * T) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                v[u] = __ldcg(x4 + j + u * T);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const uint32_t i = lo + 4 * (j + u * T);
                take(v[u].x, i), take(v[u].y, i + 1), take(v[u].z, i + 2), take(v[u].w, i + 3);
            }
        }
        for (; j < n4; j += T) {
            const float4 v = __ldcg(x4 + j);
            const uint32_t i = lo + 4 * j;
            take(v.x, i), take(v.y, i + 1), take(v.z, i + 2), take(v.w, i + 3);
        }
        /* the last hi - lo - 4 n4 elements: after everything else, as they are the highest */
        for (uint32_t i = lo + 4 * n4 + t; i < hi; i += T)
            take(x[i], i);
        return;
    }
    for (uint32_t i = lo + t; i < hi; i += 4 * T) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            v[u] = i + u * T < hi ? __ldcg(x + i + u * T) : NAN;
#pragma unroll
        for (int u = 0; u < 4; u++)
            take(v[u], i + u * T);
    }
}

/* Row blockIdx.y; its slice blockIdx.x of gridDim.x (a cluster of them on sm_90+). */
static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_kernel(const float *logits, uint32_t n, int32_t *out)
{
    __shared__ float s_v[32];
    __shared__ int32_t s_i[32];
    const float *x = logits + (size_t)blockIdx.y * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t per = (n / gridDim.x + 3) & ~3u;
    const uint32_t lo = min(n, blockIdx.x * per), hi = min(n, lo + per);
    pdl_wait();
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    argmax_scan(x, lo, blockIdx.x + 1 == gridDim.x ? n : hi, bv, bi);
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
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (gridDim.x > 1) {
        namespace cg = cooperative_groups;
        cg::cluster_group cl = cg::this_cluster();
        if (threadIdx.x == 0)
            s_v[0] = bv, s_i[0] = bi;
        cl.sync(); /* every block's winner is in its s_v[0], s_i[0] */
        if (blockIdx.x == 0 && warp == 0) {
            const bool have = lane < (int)gridDim.x;
            bv = have ? *cl.map_shared_rank(&s_v[0], lane) : -INFINITY;
            bi = have ? *cl.map_shared_rank(&s_i[0], lane) : INT32_MAX;
            argmax_warp(bv, bi);
        }
        cl.sync(); /* block 0 has read them before any block exits */
    }
#else
    if (gridDim.x > 1) /* clusters are launched on sm_90 and later only (caps.h) */
        __trap();
#endif
    if (blockIdx.x == 0 && threadIdx.x == 0)
        out[blockIdx.y] = bi == INT32_MAX ? 0 : bi;
}

/* Blocks per row: a cluster on sm_90 and later for long rows. */
static unsigned argmax_blocks(uint32_t n_vocab)
{
    return n_vocab >= ARGMAX_CLUSTER_MIN && device_sm90() ? ARGMAX_CLUSTER : 1;
}

extern "C" int cuda_argmax(const float *d_logits, uint32_t n_vocab, uint32_t S, int32_t *d_out,
                           cudaStream_t stream)
{
    if (!d_logits || !d_out || n_vocab == 0 || n_vocab > INT32_MAX || S > 65535) {
        log_error("cuda_argmax: bad arguments (logits %p, out %p, n_vocab %u, rows %u)",
                  (const void *)d_logits, (void *)d_out, n_vocab, S);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    const unsigned nb = argmax_blocks(n_vocab);
    pdl_launch_cluster(argmax_kernel, dim3(nb, S), dim3(ARGMAX_THREADS), nb, 0, stream,
                       d_logits, n_vocab, d_out);
    return OPS_LAUNCH_CHECK("cuda_argmax");
}
