/*
 * router: the MoE router of S tokens on the GPU (twin: ops_router_topk in
 * kernels/cpu/ops.c).
 *
 * Maths, per token s with logits x[s][0..E-1]:
 *   p_e = expf(x_e - max x) * (float)(1 / sum_e expf(x_e - max x))  (sum in double)
 *   ids[s][0..k-1] = the k largest p_e, descending, ties lower id first
 *   w[s][i] = p_ids[i] / max(sum_{i<k} p_ids[i], 6.103515625e-5)  (sum in f32, in order)
 * Shapes: logits S x E f32; ids S x k int32; w S x k f32; E <= 512, k <= min(E, 16).
 *
 * Ownership: one warp per token (4 tokens per block). Lane L holds experts
 * L, L + 32, ... (up to 16) in registers. Max and sum are warp butterflies
 * (the sum in double, as on the CPU); the top-k runs k rounds of a warp
 * arg-max that prefers the lower id on equal values, and the winner's owner
 * retires it. Probabilities are computed by the CPU's formula, so equal
 * logits give equal probabilities and the same tie order as the CPU; expf
 * may differ from the CPU's by an ulp, so weights agree to ~1e-7 relative.
 */
#include "kernels/cuda/ops.h"

#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

enum { ROUTER_MAX_E = 512, ROUTER_MAX_K = 16, ROUTER_PER_LANE = ROUTER_MAX_E / 32 };

static __device__ __forceinline__ double router_warp_sum(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(OPS_FULL_MASK, v, o);
    return v;
}

static __global__ void router_topk_kernel(const float *logits, uint32_t E, uint32_t k,
                                          uint32_t S, int32_t *ids, float *w)
{
    pdl_wait(); /* the logits come from the router product */
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const uint32_t s = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (s >= S)
        return; /* the whole warp leaves together */
    const float *x = logits + (size_t)s * E;
    float p[ROUTER_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const uint32_t e = lane + 32 * i;
        p[i] = e < E ? x[e] : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    mx = ops_warp_max(mx);
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        if (lane + 32 * i < E) {
            p[i] = expf(p[i] - mx);
            sum += p[i];
        }
    }
    const float inv = (float)(1.0 / router_warp_sum(sum));
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++)
        p[i] = lane + 32 * i < E ? p[i] * inv : -INFINITY;

    float my_w = 0.0f; /* lane r keeps the r-th pick */
    int32_t my_id = 0;
    for (uint32_t r = 0; r < k; r++) {
        float bv = -INFINITY;
        int32_t bi = INT32_MAX;
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++) {
            if (p[i] > bv) { /* ids rise with i: strict keeps the lower id */
                bv = p[i];
                bi = lane + 32 * i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(OPS_FULL_MASK, bv, o);
            const int32_t oi = __shfl_xor_sync(OPS_FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++)
            if (lane + 32 * i == bi)
                p[i] = -INFINITY;
        if ((uint32_t)lane == r) {
            my_w = bv;
            my_id = bi;
        }
    }
    float wsum = 0.0f;
    for (uint32_t r = 0; r < k; r++)
        wsum += __shfl_sync(OPS_FULL_MASK, my_w, r);
    const float denom = wsum > 6.103515625e-5f ? wsum : 6.103515625e-5f;
    if ((uint32_t)lane < k) {
        ids[(size_t)s * k + lane] = my_id;
        w[(size_t)s * k + lane] = my_w / denom;
    }
}

extern "C" int cuda_router_topk(const float *d_logits, uint32_t E, uint32_t k, uint32_t S,
                                int32_t *d_ids, float *d_w, cudaStream_t stream)
{
    if (!d_logits || !d_ids || !d_w || E == 0 || E > ROUTER_MAX_E || k == 0 ||
        k > ROUTER_MAX_K || k > E) {
        log_error("cuda_router_topk: bad arguments (logits %p, ids %p, w %p, E %u (max %d), "
                  "k %u (max %d))",
                  (const void *)d_logits, (void *)d_ids, (void *)d_w, E, ROUTER_MAX_E, k,
                  ROUTER_MAX_K);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    const unsigned int per_block = 4;
    pdl_launch(router_topk_kernel, (S + per_block - 1) / per_block, per_block * 32, 0, stream,
               d_logits, E, k, S, d_ids, d_w);
    return OPS_LAUNCH_CHECK("cuda_router_topk");
}
