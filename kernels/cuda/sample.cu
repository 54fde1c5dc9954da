/*
 * sample: the CPU sampler's chain (model/sampler.c) on one row of logits, in one block of 1024
 * threads and one launch.
 *
 * Maths. v_i = penalized logit (ids of the window: v <= 0 ? v * r : v / r, then - presence; NaN
 * counts as -inf). Each token has a 32-bit key, monotone in v (NaN lowest, -0 == +0), and a
 * 64-bit rank R_i = key_i << 32 | ~i: larger R ranks first, so R is the CPU's strict order
 * (higher logit, then lower id) and every token has its own R. M = max v. Greedy, or M not
 * finite: the token with the largest R. Otherwise the kept set is always a rank prefix
 * {R >= r_min}:
 *   top_k:  r_min = R of the k-th token in rank order;
 *   top_p:  r_min = R of the first token (rank order, within the prefix) whose cumulative
 *           weight reaches top_p * total, weight w = expf(v - M);
 *   min_p:  r_min = max(r_min, key(M + ln_min_p) << 32);
 *   draw:   the first token whose cumulative weight w' = expf((v - M) * inv_t) passes
 *           u * total', in rank order (top_k or top_p active) or in id order (neither).
 * Weights are integers, round(w * 2^43) (w <= 1, n <= 2^20: sums fit 64 bits), so every sum is
 * exact and independent of the order of the atomics: the kernel is deterministic. "Reaches G"
 * is cum >= ceil(top_p * T); "passes u * T" is cum >= floor(u * T) + 1, clamped to T (the last
 * token with weight, where the CPU falls back on rounding slack).
 *
 * Selection ("first token in rank order whose cumulative weight reaches G") is a radix descent
 * on R: six levels of 11/11/10 bits over the key, then over ~id (reached only through ties).
 * Each level builds, in shared memory, per-bucket weight sums, counts and lowest ids over the
 * tokens of the prefix whose R matches the digits chosen so far; a block scan over the buckets
 * (high to low) finds the bucket where the cumulation crosses G; a bucket holding one token
 * ends the descent. Tokens come from the key array in global memory (scratch), or, once the
 * kept prefix has at most SAMPLE_LIST_CAP tokens (after top_k 40, say), from a list in shared
 * memory. The id-order draw gives each thread a contiguous range of ids; a block scan finds the
 * range holding the crossing and the block then scans that range token by token.
 *
 * Passes: keys (and, without penalties, the best R) from the logits, as float4 when aligned; with
 * penalties, the window's keys are rewritten and a second pass finds the best R; then one pass
 * per radix level of each selection (three in the common case, six when ties reach the ids).
 *
 * Ownership: the single block owns everything; thread t handles tokens t, t + 1024, ... (as
 * uint4 of keys) in the passes, buckets 2047 - 2t and 2046 - 2t in the bucket scans, ids
 * [t * chunk, (t + 1) * chunk) in the id-order draw. Thread 0 (greedy) or the thread that finds
 * the crossing writes *token, exactly once.
 */
#include "kernels/cuda/sample.h"

#include <stdint.h>

#include "kernels/cuda/ops_device.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_BUCKETS 2048         /* buckets of the widest radix level (11 bits) */
#define SAMPLE_LIST_CAP 1024        /* tokens a prefix may have to move to shared memory */
#define SAMPLE_FIX 0x1p43f          /* weight 1 as an integer */
#define SAMPLE_KEY_NEG_INF 0x007FFFFFu /* key of -inf; key 0 is NaN */
#define SAMPLE_LEVELS 6

/* Digits of R, most significant first: key bits 31..0, then ~id bits 31..0. */
static __constant__ int sample_shift[SAMPLE_LEVELS] = {53, 42, 32, 21, 10, 0};
static __constant__ int sample_bits[SAMPLE_LEVELS] = {11, 11, 10, 11, 11, 10};

enum sample_goal { SAMPLE_GOAL_COUNT, SAMPLE_GOAL_TOP_P, SAMPLE_GOAL_DRAW };

struct sample_smem {
    unsigned long long mass[SAMPLE_BUCKETS]; /* weight per bucket of the current level */
    uint32_t count[SAMPLE_BUCKETS];          /* tokens per bucket */
    uint32_t min_id[SAMPLE_BUCKETS];         /* lowest id per bucket */
    uint32_t list_key[SAMPLE_LIST_CAP];      /* the kept prefix, when small: keys */
    uint32_t list_id[SAMPLE_LIST_CAP];       /* ... and ids, in no order */
    unsigned long long scan[32];             /* block scan and max: one per warp */
    unsigned long long pick_before;          /* crossing: weight before the chosen bucket */
    unsigned long long pick_n_before;        /* crossing: tokens before the chosen bucket */
    uint32_t pick_bucket;                    /* crossing: the chosen bucket, or thread */
    uint32_t list_n;                         /* tokens in the list; 0 = read global keys */
};

/* Where a pass reads tokens from: the key array in global memory or the shared list. */
struct sample_src {
    const uint32_t *keys; /* key of token i at keys[i] (always valid, for look-ups) */
    uint32_t n;           /* n_vocab */
    bool list;            /* read sm.list_* instead */
};

/* A selected token: its rank R and its position (1-based) in rank order within the prefix. */
struct sample_pick {
    unsigned long long r;
    unsigned long long rank;
};

static __device__ __forceinline__ uint32_t sample_key(float v)
{
    if (v != v)
        return 0;
    const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static __device__ __forceinline__ float sample_value(uint32_t key)
{
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

static __device__ __forceinline__ unsigned long long sample_rank(uint32_t key, uint32_t id)
{
    return ((unsigned long long)key << 32) | (0xFFFFFFFFu - id);
}

/* The CPU's penalize(), with the roundings spelled out so nothing is contracted into an FMA. */
static __device__ __forceinline__ float sample_penalize(float v, float r, float presence)
{
    if (v != v)
        v = -INFINITY;
    if (r != 0.0f && r != 1.0f)
        v = v <= 0.0f ? __fmul_rn(v, r) : __fdiv_rn(v, r);
    return __fsub_rn(v, presence);
}

/* round(expf((v - max) * scale) * 2^43): the CPU's weight as an integer; 0 for -inf and NaN. */
static __device__ __forceinline__ unsigned long long sample_weight(uint32_t key, float max,
                                                                   float scale)
{
    if (key <= SAMPLE_KEY_NEG_INF)
        return 0;
    const float w = expf(__fmul_rn(__fsub_rn(sample_value(key), max), scale));
    return __float2ull_rn(w * SAMPLE_FIX);
}

/* Exclusive prefix sum of v over the block in thread order; *total gets the sum. All threads
 * call it; s_tmp (32 entries) is free again on return. */
static __device__ unsigned long long sample_scan(unsigned long long v, unsigned long long *s_tmp,
                                                 unsigned long long *total)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(OPS_FULL_MASK, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        s_tmp[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned long long w = s_tmp[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long y = __shfl_up_sync(OPS_FULL_MASK, w, o);
            if (lane >= o)
                w += y;
        }
        s_tmp[lane] = w;
    }
    __syncthreads();
    const unsigned long long before = (warp ? s_tmp[warp - 1] : 0) + x - v;
    *total = s_tmp[31];
    __syncthreads();
    return before;
}

/* Largest of v over the block; every thread gets it. */
static __device__ unsigned long long sample_block_max(unsigned long long v,
                                                      unsigned long long *s_tmp)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long y = __shfl_xor_sync(OPS_FULL_MASK, v, o);
        v = y > v ? y : v;
    }
    if (lane == 0)
        s_tmp[warp] = v;
    __syncthreads();
    v = s_tmp[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long y = __shfl_xor_sync(OPS_FULL_MASK, v, o);
        v = y > v ? y : v;
    }
    __syncthreads();
    return v;
}

/* Calls f(key, id) for every token of src, spread over the block. */
template <class F>
static __device__ __forceinline__ void sample_visit(const sample_src &src, const sample_smem &sm,
                                                    F f)
{
    if (src.list) {
        for (uint32_t i = threadIdx.x; i < sm.list_n; i += SAMPLE_THREADS)
            f(sm.list_key[i], sm.list_id[i]);
        return;
    }
    const uint32_t n4 = src.n / 4;
    const uint4 *k4 = (const uint4 *)src.keys;
#pragma unroll 2
    for (uint32_t j = threadIdx.x; j < n4; j += SAMPLE_THREADS) {
        const uint4 q = k4[j];
        f(q.x, 4 * j);
        f(q.y, 4 * j + 1);
        f(q.z, 4 * j + 2);
        f(q.w, 4 * j + 3);
    }
    for (uint32_t i = 4 * n4 + threadIdx.x; i < src.n; i += SAMPLE_THREADS)
        f(src.keys[i], i);
}

/* The goal of a selection once the total weight T of the prefix is known (>= 1 token of
 * positive weight, so T >= 1): reached by the first token whose cumulation is >= the result. */
static __device__ unsigned long long sample_goal_of(int goal, double param, unsigned long long t)
{
    double g;
    if (goal == SAMPLE_GOAL_COUNT)
        g = param;
    else if (goal == SAMPLE_GOAL_TOP_P)
        g = ceil(param * (double)t);
    else
        g = floor(param * (double)t) + 1.0;
    unsigned long long G = g < 1.0 ? 1ull : (g >= (double)t ? t : (unsigned long long)g);
    return G > t ? t : G;
}

/* The first token in rank order among {R >= r_min} of src whose cumulative weight reaches the
 * goal (count: weight 1; else sample_weight with max, scale). Called by all threads. */
static __device__ sample_pick sample_select(sample_smem &sm, const sample_src &src,
                                            unsigned long long r_min, bool count, float max,
                                            float scale, int goal, double param)
{
    unsigned long long path = 0, acc = 0, acc_n = 0, G = 0;
    for (int lv = 0; lv < SAMPLE_LEVELS; lv++) {
        const int sh = sample_shift[lv], nb = sample_bits[lv], hi = sh + nb;
        for (int b = threadIdx.x; b < SAMPLE_BUCKETS; b += SAMPLE_THREADS) {
            sm.mass[b] = 0;
            sm.count[b] = 0;
            sm.min_id[b] = 0xFFFFFFFFu;
        }
        __syncthreads();
        sample_visit(src, sm, [&](uint32_t key, uint32_t id) {
            const unsigned long long r = sample_rank(key, id);
            if (r < r_min || (lv > 0 && (r >> hi) != path))
                return;
            const uint32_t b = (uint32_t)(r >> sh) & ((1u << nb) - 1);
            const unsigned long long w = count ? 1ull : sample_weight(key, max, scale);
            if (w)
                atomicAdd(&sm.mass[b], w);
            atomicAdd(&sm.count[b], 1u);
            atomicMin(&sm.min_id[b], id);
        });
        __syncthreads();
        const int b1 = SAMPLE_BUCKETS - 1 - 2 * (int)threadIdx.x, b0 = b1 - 1;
        const unsigned long long m1 = sm.mass[b1], mine = m1 + sm.mass[b0];
        const unsigned long long c1 = sm.count[b1], cmine = c1 + sm.count[b0];
        unsigned long long total, total_n;
        const unsigned long long before = sample_scan(mine, sm.scan, &total);
        const unsigned long long before_n = sample_scan(cmine, sm.scan, &total_n);
        if (lv == 0)
            G = sample_goal_of(goal, param, total);
        const unsigned long long rel = G - acc; /* >= 1: acc < G holds on every level */
        if (before < rel && before + mine >= rel) {
            const bool top = before + m1 >= rel;
            sm.pick_bucket = top ? b1 : b0;
            sm.pick_before = top ? before : before + m1;
            sm.pick_n_before = top ? before_n : before_n + c1;
        }
        __syncthreads();
        const uint32_t b = sm.pick_bucket;
        acc += sm.pick_before;
        acc_n += sm.pick_n_before;
        path = (path << nb) | b;
        const bool one = sm.count[b] == 1 || lv == SAMPLE_LEVELS - 1;
        const uint32_t id = sm.min_id[b];
        __syncthreads();
        if (one)
            return sample_pick{sample_rank(src.keys[id], id), acc_n + 1};
    }
    return sample_pick{0, 0}; /* not reached: the last level separates every token */
}

/* Moves the tokens of {R >= r_min} (at most SAMPLE_LIST_CAP) into the shared list. */
static __device__ void sample_compact(sample_smem &sm, sample_src &src, unsigned long long r_min)
{
    if (threadIdx.x == 0)
        sm.list_n = 0;
    __syncthreads();
    sample_visit(src, sm, [&](uint32_t key, uint32_t id) {
        if (sample_rank(key, id) < r_min)
            return;
        const uint32_t at = atomicAdd(&sm.list_n, 1u);
        if (at < SAMPLE_LIST_CAP) {
            sm.list_key[at] = key;
            sm.list_id[at] = id;
        }
    });
    __syncthreads();
    src.list = true;
}

/* The draw in id order over {R >= r_min}: the first id whose cumulative weight passes
 * u * total. Called by all threads; the thread that finds it writes *token. */
static __device__ void sample_draw_ids(sample_smem &sm, const sample_src &src,
                                       unsigned long long r_min, float max, float scale,
                                       double u, int32_t *token)
{
    const uint32_t chunk = (src.n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    uint32_t lo = threadIdx.x * chunk, hi = min(lo + chunk, src.n);
    unsigned long long sum = 0, total;
    for (uint32_t i = lo; i < hi; i++) {
        const uint32_t key = src.keys[i];
        if (sample_rank(key, i) >= r_min)
            sum += sample_weight(key, max, scale);
    }
    const unsigned long long before = sample_scan(sum, sm.scan, &total);
    const unsigned long long G = sample_goal_of(SAMPLE_GOAL_DRAW, u, total);
    if (before < G && before + sum >= G) {
        sm.pick_bucket = threadIdx.x;
        sm.pick_before = before;
    }
    __syncthreads();
    lo = sm.pick_bucket * chunk;
    hi = min(lo + chunk, src.n);
    const unsigned long long base = sm.pick_before;
    const uint32_t i = lo + threadIdx.x; /* chunk <= 1024 as n <= 2^20 */
    unsigned long long w = 0;
    if (i < hi && sample_rank(src.keys[i], i) >= r_min)
        w = sample_weight(src.keys[i], max, scale);
    const unsigned long long in = base + sample_scan(w, sm.scan, &total);
    if (i < hi && in < G && in + w >= G)
        *token = (int32_t)i;
}

static __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_kernel(const float *logits, uint32_t n, const cuda_sample_params *params,
                  const int32_t *recent, uint32_t n_recent, uint32_t *keys, int32_t *token)
{
    __shared__ sample_smem sm;
    const cuda_sample_params p = *params;
    const bool penalize = (p.repeat_penalty != 0.0f && p.repeat_penalty != 1.0f) ||
                          p.presence_penalty != 0.0f;
    unsigned long long best = 0; /* without penalties the key pass finds the best R too */
    uint32_t done = 0;
    if (((uintptr_t)logits & 15) == 0) {
        done = n / 4 * 4;
        for (uint32_t j = threadIdx.x; j < n / 4; j += SAMPLE_THREADS) {
            const float4 f = ((const float4 *)logits)[j];
            const uint4 q = {sample_key(f.x), sample_key(f.y), sample_key(f.z), sample_key(f.w)};
            ((uint4 *)keys)[j] = q;
            best = max(best, max(max(sample_rank(q.x, 4 * j), sample_rank(q.y, 4 * j + 1)),
                                 max(sample_rank(q.z, 4 * j + 2), sample_rank(q.w, 4 * j + 3))));
        }
    }
    for (uint32_t i = done + threadIdx.x; i < n; i += SAMPLE_THREADS) {
        keys[i] = sample_key(logits[i]);
        best = max(best, sample_rank(keys[i], i));
    }
    sample_src src = {keys, n, false};
    if (penalize) {
        __syncthreads();
        for (uint32_t j = threadIdx.x; j < n_recent; j += SAMPLE_THREADS) {
            const int32_t id = recent[j];
            if (id >= 0 && (uint32_t)id < n) /* repeats write the same value */
                keys[id] = sample_key(sample_penalize(logits[id], p.repeat_penalty,
                                                      p.presence_penalty));
        }
        __syncthreads();
        best = 0;
        sample_visit(src, sm, [&](uint32_t key, uint32_t id) {
            best = max(best, sample_rank(key, id));
        });
    }
    best = sample_block_max(best, sm.scan);
    const uint32_t max_key = (uint32_t)(best >> 32);
    const float max = sample_value(max_key);
    if (p.temperature == 0.0f || max_key <= SAMPLE_KEY_NEG_INF || isinf(max)) {
        if (threadIdx.x == 0)
            *token = (int32_t)(0xFFFFFFFFu - (uint32_t)best);
        return;
    }

    unsigned long long r_min = 0;
    const bool sorted = p.top_k > 0 && (uint32_t)p.top_k < n;
    const bool top_p = p.top_p > 0.0f && p.top_p < 1.0f;
    if (sorted) {
        const sample_pick k = sample_select(sm, src, 0, true, max, 1.0f, SAMPLE_GOAL_COUNT,
                                            (double)p.top_k);
        r_min = k.r;
        if (k.rank <= SAMPLE_LIST_CAP)
            sample_compact(sm, src, r_min);
    }
    if (top_p) {
        const sample_pick k = sample_select(sm, src, r_min, false, max, 1.0f, SAMPLE_GOAL_TOP_P,
                                            (double)p.top_p);
        r_min = k.r;
        if (!src.list && k.rank <= SAMPLE_LIST_CAP)
            sample_compact(sm, src, r_min);
    }
    if (p.min_p > 0.0f) {
        const unsigned long long r_floor = (unsigned long long)sample_key(
                                               __fadd_rn(max, p.ln_min_p))
                                           << 32;
        r_min = r_floor > r_min ? r_floor : r_min;
    }
    if (sorted || top_p) {
        const sample_pick k = sample_select(sm, src, r_min, false, max, p.inv_temperature,
                                            SAMPLE_GOAL_DRAW, p.uniform);
        if (threadIdx.x == 0)
            *token = (int32_t)(0xFFFFFFFFu - (uint32_t)k.r);
    } else {
        sample_draw_ids(sm, src, r_min, max, p.inv_temperature, p.uniform, token);
    }
}

extern "C" int cuda_sample_params_prepare(struct cuda_sample_params *p)
{
    const char *bad = NULL;
    if (!p)
        bad = "no parameters";
    else if (!(p->temperature >= 0 && isfinite(p->temperature)))
        bad = "temperature must be a finite value >= 0";
    else if (p->top_k < 0)
        bad = "top_k must be >= 0";
    else if (!(p->top_p >= 0 && p->top_p <= 1))
        bad = "top_p must be in [0, 1]";
    else if (!(p->min_p >= 0 && p->min_p <= 1))
        bad = "min_p must be in [0, 1]";
    else if (!(p->repeat_penalty >= 0 && isfinite(p->repeat_penalty)))
        bad = "repeat_penalty must be a finite value >= 0";
    else if (!isfinite(p->presence_penalty))
        bad = "presence_penalty must be finite";
    if (bad) {
        log_error("cuda_sample_params_prepare: bad parameters: %s", bad);
        return -EINVAL;
    }
    p->inv_temperature = p->temperature > 0 ? 1.0f / p->temperature : 0.0f;
    p->ln_min_p = p->min_p > 0 ? logf(p->min_p) : 0.0f;
    return 0;
}

extern "C" size_t cuda_sample_work_bytes(uint32_t n_vocab)
{
    return ((size_t)n_vocab * sizeof(uint32_t) + 255) & ~(size_t)255;
}

extern "C" int cuda_sample(const float *d_logits, uint32_t n_vocab,
                           const struct cuda_sample_params *d_params, const int32_t *d_recent,
                           uint32_t n_recent, void *d_work, int32_t *d_token, cudaStream_t stream)
{
    if (!d_logits || !d_params || !d_work || !d_token || (n_recent && !d_recent) ||
        n_vocab == 0 || n_vocab > CUDA_SAMPLE_MAX_VOCAB || ((uintptr_t)d_work & 15)) {
        log_error("cuda_sample: bad arguments (logits %p, params %p, recent %p of %u, work %p, "
                  "token %p, n_vocab %u of at most %u)", (const void *)d_logits,
                  (const void *)d_params, (const void *)d_recent, n_recent, d_work,
                  (void *)d_token, n_vocab, CUDA_SAMPLE_MAX_VOCAB);
        return -EINVAL;
    }
    sample_kernel<<<1, SAMPLE_THREADS, 0, stream>>>(d_logits, n_vocab, d_params, d_recent,
                                                    n_recent, (uint32_t *)d_work, d_token);
    return OPS_LAUNCH_CHECK("cuda_sample");
}
