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

/* The largest of a lane's keys and its index, the lowest index among equal
 * keys, by a tree of depth 4 (a pair's left half holds the lower indices, so
 * the right is taken only when strictly larger): the serial scan's result
 * in a quarter of its dependent steps. */
static __device__ __forceinline__ void router_lane_best(const uint32_t (&key)[ROUTER_PER_LANE],
                                                        uint32_t &best, uint32_t &idx)
{
    uint32_t k[ROUTER_PER_LANE], i[ROUTER_PER_LANE];
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; j++)
        k[j] = key[j], i[j] = (uint32_t)j;
#pragma unroll
    for (int w = 1; w < ROUTER_PER_LANE; w *= 2)
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; j += 2 * w)
            if (k[j + w] > k[j]) {
                k[j] = k[j + w];
                i[j] = i[j + w];
            }
    best = k[0];
    idx = i[0];
}

/* The k picks in k rounds of a warp arg-max, whatever the keys (lane r < k
 * gets the r-th pick): p, the probabilities (-INFINITY past E); key, their
 * keys (router_topk_warp); lk, li: the lane's best key and its i. */
static __device__ __forceinline__ void router_pick_rounds(float (&p)[ROUTER_PER_LANE],
                                                          uint32_t (&key)[ROUTER_PER_LANE],
                                                          uint32_t lk, uint32_t li, uint32_t k,
                                                          float &my_w, int32_t &my_id)
{
    const int lane = threadIdx.x & 31;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    /* two warp reductions a round: each lane keeps its best and rescans only
     * when it gave the pick; among equal values the lowest id wins */
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
            router_lane_best(key, lk, li);
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
}

/* A key's place in the pick order as one number: the larger comes first (the
 * larger key, then the lower id among equal keys). */
static __device__ __forceinline__ uint64_t router_order(uint32_t key, uint32_t id)
{
    return (static_cast<uint64_t>(key) << 32) | (0xFFFFFFFFu - id);
}

/* How many of the first n entries of s (at most 32, all lanes reading the
 * same entry at a time) come before c in the pick order. */
static __device__ __forceinline__ uint32_t router_rank(const uint64_t *s, uint32_t n, uint64_t c)
{
    uint32_t r = 0;
#pragma unroll
    for (uint32_t m = 0; m < 32; m++)
        r += m < n && s[m] > c;
    return r;
}

/* router_pick_rounds' picks without the rounds: the lane bests
 * (lk, li: the lane's best key and its i) hold k distinct keys at or above
 * the lane best placed k-1 among them, so the top k are among the keys at
 * or above it; when those (the keys > 0 among them) are at most 32, each
 * counts its place against the others and the first k take their slots.
 * Lane r < k gets the r-th pick (or -INFINITY and INT32_MAX where fewer
 * than k keys are > 0, as the rounds give). s: 32 entries of the warp's own.
 * Returns false, for the whole warp, when the keys are more than 32 (the
 * largest crowded into a few lanes): the caller runs the rounds. */
static __device__ __forceinline__ bool router_pick_ranked(const uint32_t (&key)[ROUTER_PER_LANE],
                                                          uint32_t lk, uint32_t li, uint32_t k,
                                                          uint64_t *s, float &my_w,
                                                          int32_t &my_id)
{
    const uint32_t lane = threadIdx.x & 31;
    const uint64_t best = router_order(lk, lane + 32u * li);
    s[lane] = best;
    __syncwarp();
    /* ids differ, so the places are 0..31 and one lane holds place k - 1 */
    const uint32_t at = __ballot_sync(OPS_FULL_MASK, router_rank(s, 32, best) == k - 1);
    const uint64_t floor = s[__ffs(at) - 1];
    __syncwarp(); /* every read of s before it is written again */
    const uint32_t below = (1u << lane) - 1u;
    uint32_t n = 0; /* keys taken so far, in the order of i, then lane */
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const uint64_t c = router_order(key[i], lane + 32u * i);
        const bool take = key[i] != 0u && c >= floor;
        const uint32_t mask = __ballot_sync(OPS_FULL_MASK, take);
        const uint32_t pos = n + __popc(mask & below);
        if (take && pos < 32u)
            s[pos] = c;
        n += __popc(mask);
    }
    if (n > 32u)
        return false;
    __syncwarp();
    const uint64_t c = lane < n ? s[lane] : 0u;
    const uint32_t place = router_rank(s, n, c);
    __syncwarp();
    if (lane < n && place < k)
        s[place] = c;
    __syncwarp();
    if (lane < k) {
        const uint64_t p = lane < n ? s[lane] : 0u;
        const uint32_t pk = static_cast<uint32_t>(p >> 32);
        my_w = pk ? __uint_as_float(pk - 1u) : -INFINITY;
        my_id = pk ? static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(p)) : INT32_MAX;
    }
    return true;
}

/* The top-k of one token's E logits x by one whole warp: ids[0..k-1] and
 * w[0..k-1]. x is read through L2 (__ldcg): the router kernel's logits and
 * those another block of a product just wrote (cuda tail) alike. s: 32
 * entries of shared memory of the warp's own. rounds: the picks by
 * router_pick_rounds only (the same picks). CLK (timing only): lane 0
 * stores clock64() into clk[0..3] after the max, the softmax's scale, the
 * picks and the stores. */
template <bool CLK = false>
static __device__ __forceinline__ void router_topk_warp(const float *x, uint32_t E, uint32_t k,
                                                        int32_t *ids, float *w, uint64_t *s,
                                                        bool rounds, long long *clk = nullptr)
{
    const int lane = threadIdx.x & 31;
    /* the lane's max and sum as trees (depth 4, not a chain of 16) */
    float p[ROUTER_PER_LANE], t[ROUTER_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const uint32_t e = lane + 32 * i;
        p[i] = t[i] = e < E ? __ldcg(x + e) : -INFINITY;
    }
#pragma unroll
    for (int w = 1; w < ROUTER_PER_LANE; w *= 2)
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; j += 2 * w)
            t[j] = fmaxf(t[j], t[j + w]);
    const float mx = ops_warp_max(t[0]);
    if constexpr (CLK)
        if (lane == 0)
            clk[0] = clock64() + (mx != mx); /* after mx (the term keeps the order) */
    double ds[ROUTER_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const bool in = lane + 32 * i < E;
        p[i] = in ? expf(p[i] - mx) : p[i];
        ds[i] = in ? (double)p[i] : 0.0;
    }
#pragma unroll
    for (int w = 1; w < ROUTER_PER_LANE; w *= 2)
#pragma unroll
        for (int j = 0; j < ROUTER_PER_LANE; j += 2 * w)
            ds[j] += ds[j + w];
    const float inv = (float)(1.0 / router_warp_sum(ds[0]));
    if constexpr (CLK)
        if (lane == 0)
            clk[1] = clock64() + (inv != inv);
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++)
        p[i] = lane + 32 * i < E ? p[i] * inv : -INFINITY;

    float my_w = 0.0f; /* lane r keeps the r-th pick */
    int32_t my_id = 0;
    /* the probabilities are >= 0 (or NaN, never picked: key 0, and the
     * rounds' comparisons never pick it), so their bits order as they do;
     * key 0 is no candidate. Each lane's best: the lowest i among equal
     * values. */
    uint32_t key[ROUTER_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++)
        key[i] = p[i] >= 0.0f ? __float_as_uint(p[i]) + 1u : 0u;
    uint32_t lk, li;
    router_lane_best(key, lk, li);
    if (rounds || !router_pick_ranked(key, lk, li, k, s, my_w, my_id))
        router_pick_rounds(p, key, lk, li, k, my_w, my_id);
    if constexpr (CLK) {
        __syncwarp();
        if (lane == 0)
            clk[2] = clock64() + (my_id == INT32_MIN);
    }
    float wsum = 0.0f; /* in pick order; the shuffles independent of the adds */
#pragma unroll
    for (uint32_t r = 0; r < ROUTER_MAX_K; r++) {
        const float v = __shfl_sync(OPS_FULL_MASK, my_w, r);
        if (r < k)
            wsum += v;
    }
    const float denom = wsum > 6.103515625e-5f ? wsum : 6.103515625e-5f;
    if ((uint32_t)lane < k) {
        ids[lane] = my_id;
        w[lane] = my_w / denom;
    }
    if constexpr (CLK) {
        __syncwarp();
        if (lane == 0)
            clk[3] = clock64();
    }
}

#endif
