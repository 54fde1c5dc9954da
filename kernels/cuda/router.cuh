/*
 * router.cuh: the router's top-k of one token by one warp, shared by the
 * router kernel (router.cu) and the tail of the router product (tail.cuh).
 * Private to the .cu files of kernels/cuda. Maths and ownership: router.cu.
 */
#ifndef KERNELS_CUDA_ROUTER_CUH
#define KERNELS_CUDA_ROUTER_CUH

#include "kernels/cuda/ops_device.cuh"

enum { ROUTER_MAX_E = 512, ROUTER_MAX_K = 16, ROUTER_PER_LANE = ROUTER_MAX_E / 32 };

static __device__ __forceinline__ double router_warp_sum(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(OPS_FULL_MASK, v, o);
    return v;
}

/* The top-k of one token's E logits x by one whole warp: ids[0..k-1] and
 * w[0..k-1]. x is read through L2 (__ldcg): the router kernel's logits and
 * those another block of a product just wrote (cuda tail) alike. */
static __device__ __forceinline__ void router_topk_warp(const float *x, uint32_t E, uint32_t k,
                                                        int32_t *ids, float *w)
{
    const int lane = threadIdx.x & 31;
    float p[ROUTER_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const uint32_t e = lane + 32 * i;
        p[i] = e < E ? __ldcg(x + e) : -INFINITY;
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    /* the same picks with two warp reductions a round: the probabilities
     * are >= 0 (or NaN, never picked, as the comparisons below never pick
     * it), so their bits order as they do; key 0 is no candidate. Each lane
     * keeps its best (the lowest i among equal values) and rescans only when
     * it gave the pick; among equal values the lowest id wins. */
    uint32_t key[ROUTER_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++)
        key[i] = p[i] >= 0.0f ? __float_as_uint(p[i]) + 1u : 0u;
    uint32_t lk = 0, li = 0;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++)
        if (key[i] > lk) {
            lk = key[i];
            li = (uint32_t)i;
        }
    for (uint32_t r = 0; r < k; r++) {
        const uint32_t best = __reduce_max_sync(OPS_FULL_MASK, lk);
        const uint32_t id = __reduce_min_sync(
            OPS_FULL_MASK, best && lk == best ? (uint32_t)lane + 32u * li : 0xFFFFFFFFu);
        if ((uint32_t)lane == r) {
            my_w = best ? __uint_as_float(best - 1u) : -INFINITY;
            my_id = best ? (int32_t)id : INT32_MAX;
        }
        if (best && (uint32_t)lane == id % 32u) { /* the pick's lane: its next best */
#pragma unroll
            for (int i = 0; i < ROUTER_PER_LANE; i++)
                if ((uint32_t)i == li)
                    key[i] = 0u;
            lk = 0, li = 0;
#pragma unroll
            for (int i = 0; i < ROUTER_PER_LANE; i++)
                if (key[i] > lk) {
                    lk = key[i];
                    li = (uint32_t)i;
                }
        }
    }
#else
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
#endif
    float wsum = 0.0f;
    for (uint32_t r = 0; r < k; r++)
        wsum += __shfl_sync(OPS_FULL_MASK, my_w, r);
    const float denom = wsum > 6.103515625e-5f ? wsum : 6.103515625e-5f;
    if ((uint32_t)lane < k) {
        ids[lane] = my_id;
        w[lane] = my_w / denom;
    }
}

#endif
