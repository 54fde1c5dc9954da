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
 * gets the r-th pick's key and id, or 0 and INT32_MAX where fewer than k
 * keys are > 0): key, the keys (router_topk_warp; 0 is no candidate); lk,
 * li: the lane's best key and its i. */
static __device__ __forceinline__ void router_pick_rounds(uint32_t (&key)[ROUTER_PER_LANE],
                                                          uint32_t lk, uint32_t li, uint32_t k,
                                                          uint32_t &my_key, int32_t &my_id)
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
            my_key = best;
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
    (void)lk;
    (void)li;
    for (uint32_t r = 0; r < k; r++) {
        uint32_t bv = 0u;
        int32_t bi = INT32_MAX;
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++) {
            if (key[i] > bv) { /* ids rise with i: strict keeps the lower id */
                bv = key[i];
                bi = lane + 32 * i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const uint32_t ov = __shfl_xor_sync(OPS_FULL_MASK, bv, o);
            const int32_t oi = __shfl_xor_sync(OPS_FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++)
            if (lane + 32 * i == bi)
                key[i] = 0u;
        if ((uint32_t)lane == r) {
            my_key = bv;
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
 * Lane r < k gets the r-th pick's key and id (or 0 and INT32_MAX where
 * fewer than k keys are > 0, as the rounds give). s: 32 entries of the warp's own.
 * Returns false, for the whole warp, when the keys are more than 32 (the
 * largest crowded into a few lanes): the caller runs the rounds. */
static __device__ __forceinline__ bool router_pick_ranked(const uint32_t (&key)[ROUTER_PER_LANE],
                                                          uint32_t lk, uint32_t li, uint32_t k,
                                                          uint64_t *s, uint32_t &my_key,
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
        my_key = pk;
        my_id = pk ? static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(p)) : INT32_MAX;
    }
    return true;
}

/* A logit's key: larger logits have larger keys, -0 and +0 the same one,
 * NaN the smallest (1: picked after every other logit, so that the ids stay
 * experts whatever the logits; kernels/cpu/ops.c's twin). */
static __device__ __forceinline__ uint32_t router_key(float x)
{
    const uint32_t b = __float_as_uint(x + 0.0f); /* -0 + 0 is +0 */
    return x != x ? 1u : (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

/* router_key's logit (key 1: a NaN). */
static __device__ __forceinline__ float router_unkey(uint32_t key)
{
    return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

/* The top-k of one token's E logits x by one whole warp: ids[0..k-1] and
 * w[0..k-1] (router.cu's maths). x is read through L2 (__ldcg): the router
 * kernel's logits and those another block of a product just wrote (cuda
 * tail) alike. s: 32 entries of shared memory of the warp's own. rounds:
 * the picks by router_pick_rounds only (the same picks). softmax (a
 * baseline for measurements): the picks and weights by the full softmax
 * first, as before 2026-12-04: the same ids where no two logits round to
 * one probability, weights within an ulp or two. CLK (timing only): lane 0
 * stores clock64() into clk[0..3] after the loads, the keys, the picks and
 * the stores. SHARED: x in the block's shared memory (plain loads). */
template <bool CLK = false, bool SHARED = false>
static __device__ __forceinline__ void router_topk_warp(const float *x, uint32_t E, uint32_t k,
                                                        int32_t *ids, float *w, uint64_t *s,
                                                        bool rounds, long long *clk = nullptr,
                                                        bool softmax = false)
{
    const int lane = threadIdx.x & 31;
    float p[ROUTER_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const uint32_t e = lane + 32 * i;
        p[i] = e < E ? (SHARED ? x[e] : __ldcg(x + e)) : -INFINITY;
    }
    if constexpr (CLK)
        if (lane == 0)
            clk[0] = clock64() + (p[0] != p[0]); /* after the loads (the term keeps the order) */
    uint32_t key[ROUTER_PER_LANE];
    if (softmax) { /* the probabilities' bits: >= 0 (or NaN, key 0) */
        float t[ROUTER_PER_LANE];
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++)
            t[i] = p[i];
#pragma unroll
        for (int w2 = 1; w2 < ROUTER_PER_LANE; w2 *= 2)
#pragma unroll
            for (int j = 0; j < ROUTER_PER_LANE; j += 2 * w2)
                t[j] = fmaxf(t[j], t[j + w2]);
        const float mx = ops_warp_max(t[0]);
        double ds[ROUTER_PER_LANE];
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++) {
            const bool in = lane + 32 * i < E;
            p[i] = in ? expf(p[i] - mx) : p[i];
            ds[i] = in ? (double)p[i] : 0.0;
        }
#pragma unroll
        for (int w2 = 1; w2 < ROUTER_PER_LANE; w2 *= 2)
#pragma unroll
            for (int j = 0; j < ROUTER_PER_LANE; j += 2 * w2)
                ds[j] += ds[j + w2];
        const float inv = (float)(1.0 / router_warp_sum(ds[0]));
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++) {
            p[i] = lane + 32 * i < E ? p[i] * inv : -INFINITY;
            key[i] = p[i] >= 0.0f ? __float_as_uint(p[i]) + 1u : 0u;
        }
    } else {
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++)
            key[i] = lane + 32 * i < E ? router_key(p[i]) : 0u;
    }
    if constexpr (CLK)
        if (lane == 0)
            clk[1] = clock64() + (key[0] == 1u);
    uint32_t my_key = 0u; /* lane r keeps the r-th pick */
    int32_t my_id = 0;
    /* each lane's best: the lowest i among equal keys */
    uint32_t lk, li;
    router_lane_best(key, lk, li);
    if (rounds || !router_pick_ranked(key, lk, li, k, s, my_key, my_id))
        router_pick_rounds(key, lk, li, k, my_key, my_id);
    if constexpr (CLK) {
        __syncwarp();
        if (lane == 0)
            clk[2] = clock64() + (my_id == INT32_MIN);
    }
    float v; /* the pick's weight before the sum: -INFINITY past the valid picks */
    if (softmax) {
        v = my_key ? __uint_as_float(my_key - 1u) : -INFINITY;
    } else {
        /* e = expf(x - max x): the first pick holds the max */
        const float xr = my_key ? router_unkey(my_key) : -INFINITY;
        const float mx = __shfl_sync(OPS_FULL_MASK, xr, 0);
        v = my_key ? expf(xr - mx) : -INFINITY;
    }
    float wsum = 0.0f; /* in pick order; the shuffles independent of the adds */
#pragma unroll
    for (uint32_t r = 0; r < ROUTER_MAX_K; r++) {
        const float u = __shfl_sync(OPS_FULL_MASK, v, r);
        if (r < k)
            wsum += u;
    }
    /* with the softmax: max(sum, 6.103515625e-5); without, sum >= 1 > 512 x
     * 6.103515625e-5 >= the clamp times the softmax's full sum (router.cu) */
    const float denom = !softmax ? wsum : wsum > 6.103515625e-5f ? wsum : 6.103515625e-5f;
    if ((uint32_t)lane < k) {
        ids[lane] = my_id;
        w[lane] = v / denom;
    }
    if constexpr (CLK) {
        __syncwarp();
        if (lane == 0)
            clk[3] = clock64();
    }
}

#endif
