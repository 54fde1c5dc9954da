/*
 * cuda deltanet: the gated DeltaNet conv and per-head recurrence on the GPU
 * (see deltanet.h). CPU twins: deltanet_conv_channel, deltanet_head_step and
 * deltanet_gated_norm of kernels/cpu/deltanet.c with the per-head glue of
 * fw_dn_head_task (worker/forward.c). f32 throughout.
 *
 * dn_conv_kernel: causal depthwise conv + SiLU, C channels, S tokens.
 *   u[s][c] = silu(sum_{t<K} w[c][t] * in(s - (K-1) + t)), in(s) = x[s][c] for
 *   s >= 0 and the state st[c][s + K - 1] (K-1 floats, oldest first) for s < 0;
 *   afterwards st[c] holds in(S-K+1 .. S-1).
 *   Grid (ceil(C / 128), ceil(S / DN_CONV_TOK)): a thread owns one channel and
 *   DN_CONV_TOK consecutive tokens; it loads its window of DN_MAX_K - 1 +
 *   DN_CONV_TOK inputs into registers (all loads issued together) and a warp
 *   reads 32 consecutive channels of a token row (coalesced). Only the threads
 *   of token tile 0 read and then rewrite the state, so no tile sees a new
 *   state. K <= DN_MAX_K; zero taps beyond K add exact zeros.
 *
 * dn_heads_kernel<DK>: one block owns one value head h (grid nv) for all S
 * tokens, in order. The head's state, dv rows j of DK floats (key i fastest,
 * S[j][i]), is loaded once into registers, updated token by token and stored
 * once. 4 * dv threads (dv % 16 == 0, dv <= 128): thread t owns row j = t / 4
 * and, for sub = t % 4, the float4 key chunks c = sub + 4 * m (m < DK / 16) of
 * that row: DK / 4 state floats. Per token s:
 *   warp 0: q = l2norm(u[s][g*DK ..]) / sqrt(DK) into shared memory;
 *           lane 0: beta = sigmoid(b[s][h]), decay = exp(a[h] * softplus(alpha[s][h] + dt[h]));
 *   warp 1: k = l2norm(u[s][nk*DK + g*DK ..]) into shared memory;
 *   every thread: v_j = u[s][2*nk*DK + h*dv + j], z_j;
 *   (the global reads of token s + 1 are issued here, before token s's work)
 *   barrier A;
 *   S[j][:] *= decay; mem_j = S[j][:] . k (4-lane shuffle sum);
 *   d_j = (v_j - mem_j) * beta; S[j][:] += k * d_j; o_j = S[j][:] . q;
 *   sum of o_j^2 over the head: warp shuffle sums, one float per warp in
 *   shared memory, barrier B, every thread adds the (<= 16) warp sums;
 *   y[s][h*dv + j] = o_j / sqrt(mean + eps) * norm_w[j] * silu(z_j) (sub 0).
 * Two barriers per token suffice: q, k and the warp sums of token s are only
 * read between A(s) and the start of token s + 1's writes, which come after
 * B(s) (q, k) or after A(s + 1) (warp sums).
 * The key head of h is g = tiled ? h % nk : h / (nv / nk).
 * Sums differ in order from the CPU (4 partial sums per row, tree
 * reductions, fused multiply-adds): results agree to rounding, not bitwise.
 *
 * dn_conv_heads_kernel<DK> (decode, S = 1): dn_conv_kernel and
 * dn_heads_kernel in one launch, the per-token body shared (dn_step). The
 * threads compute the conv outputs they read: warps 0 and 1 the q and k
 * channels of key head g, lane 4j of row j the v_j channel (shuffled to its
 * row's other three lanes), with dn_conv_kernel's fused multiply-adds in its
 * order, so every output and state equals the two launches' bit for bit.
 * Block h rewrites the conv state of its v channels; the q and k channels
 * of g are read by the nv / nk blocks of g, and the last of them to have
 * read (an atomic counter per key head, dn_conv_readers, set back to 0 by
 * that block) rewrites their state: no block reads a rewritten state.
 *
 * DN_SPLIT (sm_90 and later): dn_heads_split_kernel and
 * dn_conv_heads_split_kernel spread a head over a thread block cluster of nb
 * blocks (grid nv * nb, 4 * dv / nb threads), so that more SMs load and store
 * the state: one block per head leaves most SMs idle on a decode step (32 of
 * 132 on an H200 at nv = 32) and waits on its own 64 KiB of state. Rows are
 * independent in the delta rule; block b of a head's cluster holds the
 * head's warps b * W .. b * W + W - 1 (W = dv / 8 / nb), so thread t of the
 * head still owns row t / 4 and chunks sub = t % 4 and every warp covers the
 * same 8 rows as in the one-block kernels. What couples the rows:
 *   - q and k: each block's warps 0 and 1 compute them (W >= 2);
 *   - the norm's sum of o_j^2: every warp writes its warp sum into its slot
 *     of `red` in every block of the cluster (distributed shared memory),
 *     one cluster barrier (which also serves as barrier B), then every
 *     thread adds the dv / 8 sums in warp order, as the one-block kernels do;
 *     the token-by-token kernel alternates two `red` arrays, so that one
 *     barrier per token keeps a block from overwriting sums that another
 *     still reads; a cluster barrier right after start (arrive at once, wait
 *     before the first remote write) makes sure every block of the cluster
 *     runs before its shared memory is written, and no block reads another's
 *     after the last barrier, so blocks may exit;
 *   - the q and k conv state: warps 0 and 1 of every block read it; each
 *     counts itself at once (dn_conv_qk_readers: nv / nk * nb readers of a
 *     key head's q, as many of its k) and the last warp 0 and the last warp
 *     1 rewrite the state at the end, with no block barrier on the count.
 * Same sums in the same order: y, delta state and conv state equal the
 * one-block kernels' bit for bit. nb (dn_split_blocks): a power of two up to
 * DN_SPLIT_MAX that keeps at least two whole warps per block, the one that
 * leaves the fewest state rows on the busiest SM, ceil(nv * nb / SMs) * dv /
 * nb, the smallest of equals (4 at nv = 32, dv = 128 on 132 SMs: 128 blocks
 * of 128 threads). LAMINA_CUDA_DN_SPLIT=0 (read at each launch): one block
 * per head; "2", "4" or "8": that nb where dv allows it.
 *
 * Chunked prefill (cuda_deltanet_heads_chunked, S >= DN_CHUNK_MIN_S, dk = dv
 * in {64, 128}, sm_80 and later): the WY form of deltanet_chunk_head
 * (transformers' chunk_gated_delta_rule), chunks of DN_CH = 64 tokens, in
 * three kernels. Per value head h and chunk c (tokens s0 .. s0+n-1; rows
 * t >= n are zero, which adds exact zeros as the HF padding does), with
 * q = l2norm(q) / sqrt(dk), k = l2norm(k), beta_t, gdec_t as in the step
 * kernel, g_t = gdec_0 + .. + gdec_t (in order), gl = g_{n-1}:
 *   dn_prep_kernel (grid n_chunks x nv, 256 threads, everything that does not
 *   depend on the state, all chunks in parallel):
 *     at  = (q k^T) * exp(g_t - g_u) for u <= t, else 0          (64 x 64)
 *     L   = -(beta_t (k k^T) * exp(g_t - g_u)) for u < t, else 0
 *     A   = (I - L)^-1 (what the CPU's row-by-row solve builds): the four
 *           16 x 16 diagonal blocks by forward substitution (a lane per
 *           column), then block rows i = 1..3: X_ij = X_ii sum_{k=j}^{i-1}
 *           L_ik X_kj, written over L_ij;
 *     Wm  = A @ (k * beta * exp(g)), U = A @ (v * beta),
 *     Qg  = q * exp(g), Kw = k * exp(gl - g), decay = exp(gl)
 *   into the caller's work buffer (dn_chunk_floats per head and chunk).
 *   dn_state_kernel (grid dv / 32 x nv, 256 threads): value columns are
 *   independent in the delta rule, so a block owns 32 columns j0.. of head h
 *   and walks the chunks in order with its slice of the state (dk x 32,
 *   key-major) in shared memory:
 *     vn = U - Wm @ St;  o = Qg @ St + at @ vn  (into y);
 *     St = St * decay + Kw^T @ vn.
 *   Warps own 16 x 16 output tiles; where the card has the shared memory
 *   (161 KiB at dk 128: sm_80 and sm_90) each part of a chunk's record is
 *   copied there by cp.async and read as wmma fragments from it, the next
 *   chunk's part of a step copied once this chunk's step that reads it is
 *   done (dn_state_staged_kernel; LAMINA_CUDA_DN_STAGE=0 or a smaller card:
 *   the fragments read straight from global memory, each part of the next
 *   record prefetched into L1 instead). The same bits either way.
 *   dn_gnorm_kernel: a warp per (token, head) row of y: the gated RMSNorm in
 *   place, y = o / sqrt(mean(o^2) + eps) * norm_w * silu(z).
 * Every 16 x 16 product runs on tensor cores (wmma m16n16k8, inputs rounded to
 * tf32, f32 accumulators); the solve, norms and scalings are f32. tf32 keeps
 * 10 mantissa bits, so results match the CPU twin to about 1e-3 relative
 * (L2), not to f32 rounding. Older GPUs take the token-by-token kernel.
 */
#include "kernels/cuda/deltanet.h"

#include <errno.h>
#include <string.h>

#include <mutex>

#include <cooperative_groups.h>
#include <mma.h>

#include "kernels/cuda/cp_async.cuh"
#include "kernels/cuda/mvq.cuh"
#include "kernels/cuda/mvq.h"
#include "kernels/cuda/pdl.cuh"

extern "C" {
#include "common/log.h"
#include "kernels/cpu/deltanet.h"
}

#define DN_MAX_K 8        /* most conv taps dn_conv_kernel handles */
#define DN_CONV_THREADS 128
#define DN_CONV_TOK 16    /* tokens per conv thread */
#define DN_CH 64          /* tokens per chunk of the chunked prefill */
#define DN_SLICE 32       /* value columns per block of dn_state_kernel */
#define DN_CK_THREADS 256 /* threads per block of the chunked kernels */
#define DN_CHUNK_MIN_S 16 /* fewest tokens that take the chunked path */
#define DN_SPLIT_MAX 8    /* most blocks per head of the split decode kernels (a cluster) */

static_assert(DN_CH == DELTANET_CHUNK, "the CPU twin's chunk");
static_assert(DN_CK_THREADS == 32 * 4 * (DN_SLICE / 16), "dn_state_kernel: a warp per o tile");

__device__ __forceinline__ float dn_silu(float x)
{
    return x / (1.0f + expf(-x));
}

__device__ __forceinline__ float dn_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float dn_softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float dn_warp_sum(float x)
{
    for (int o = 16; o > 0; o /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* One input of the conv window: token s of channel ch (s < 0: the state). */
__device__ __forceinline__ float dn_conv_in(const float *state, const float *x, uint32_t K,
                                            uint32_t C, uint32_t ch, int64_t s, uint32_t S)
{
    if (s >= (int64_t)S || s < -(int64_t)(K - 1))
        return 0.0f;
    return s >= 0 ? x[(size_t)s * C + ch] : state[(size_t)ch * (K - 1) + (size_t)(s + K - 1)];
}

__global__ void dn_conv_kernel(float *state, const float *w, uint32_t K, const float *x,
                               float *u, uint32_t C, uint32_t S)
{
    constexpr int W = DN_MAX_K - 1 + DN_CONV_TOK; /* window: tokens s0 - DN_MAX_K + 1 .. */
    pdl_wait(); /* x and the state come from the kernels before */
    pdl_trigger();
    const uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t s0 = (int64_t)blockIdx.y * DN_CONV_TOK;
    if (ch >= C)
        return;
    float wr[DN_MAX_K], win[W];
    /* wr[d]: the tap of the input d tokens back */
#pragma unroll
    for (uint32_t d = 0; d < DN_MAX_K; d++)
        wr[d] = d < K ? w[(size_t)ch * K + K - 1 - d] : 0.0f;
#pragma unroll
    for (int i = 0; i < W; i++)
        win[i] = dn_conv_in(state, x, K, C, ch, s0 - (DN_MAX_K - 1) + i, S);
#pragma unroll
    for (int tt = 0; tt < DN_CONV_TOK; tt++) {
        /* oldest tap first, as the CPU sums */
        float acc = 0.0f;
#pragma unroll
        for (int d = DN_MAX_K - 1; d >= 0; d--)
            acc = __fmaf_rn(wr[d], win[tt + DN_MAX_K - 1 - d], acc);
        if (s0 + tt < (int64_t)S)
            u[(size_t)(s0 + tt) * C + ch] = dn_silu(acc);
    }
    if (blockIdx.y != 0 || K < 2)
        return;
    /* the new state: inputs S-K+1 .. S-1, read before any is written */
    float st[DN_MAX_K - 1];
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        st[t] = t + 1 < K ? dn_conv_in(state, x, K, C, ch, (int64_t)S - (K - 1) + t, S) : 0.0f;
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        if (t + 1 < K)
            state[(size_t)ch * (K - 1) + t] = st[t];
}

/* Per-head parameters of dn_heads_kernel, passed by value. */
struct dn_heads_args {
    float *state;
    const float *u, *b, *alpha, *a, *dt, *z, *norm_w;
    float *y;
    uint32_t nk, nv, dv, S;
    bool tiled;
    float eps;
    int8_t *yq; /* decode (S = 1): y also rounded for the int8 products (dn_out_q), or NULL */
    bool early; /* conv + heads split decode: the states were written two or more launches
                 * back (the caller's promise), so they are read before the PDL wait */
};

/* The inputs of one token that the threads read from global memory: fetched
 * one token ahead so that their latency overlaps the previous token's work. */
template <int DK>
struct dn_tok {
    float qk[DK >= 32 ? DK / 32 : 1]; /* warps 0 and 1: raw q or k values of this lane */
    float b, alpha;                   /* warp 0 lane 0: raw beta and alpha inputs */
    float ah, dth;                    /* warp 0 lane 0: the head's a and dt bias */
    float v, z;                       /* every thread: v_j and z_j */
};

template <int DK>
__device__ __forceinline__ void dn_fetch(const struct dn_heads_args &p, uint32_t s, uint32_t g,
                                         uint32_t h, uint32_t j, struct dn_tok<DK> &tk)
{
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t kd = (size_t)p.nk * DK, vd = (size_t)p.nv * p.dv;
    const float *us = p.u + (size_t)s * (2 * kd + vd);
    tk.v = us[2 * kd + (size_t)h * p.dv + j];
    tk.z = p.z[(size_t)s * vd + (size_t)h * p.dv + j];
    if (warp > 1)
        return;
    const float *src = us + (warp == 0 ? 0 : kd) + (size_t)g * DK;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        tk.qk[m] = lane + 32 * m < DK ? src[lane + 32 * m] : 0.0f;
    if (warp == 0 && lane == 0) {
        tk.b = p.b[(size_t)s * p.nv + h];
        tk.alpha = p.alpha[(size_t)s * p.nv + h];
        tk.ah = p.a[h];
        tk.dth = p.dt[h];
    }
}

/* Warp 0 writes q = l2norm(raw q) / sqrt(DK) to qs, warp 1 k = l2norm(raw k)
 * to ks; warp 0 lane 0 writes beta and the decay factor to sc. */
template <int DK>
__device__ __forceinline__ void dn_norm_qk(const struct dn_heads_args &p,
                                           const struct dn_tok<DK> &tk, float *qs, float *ks,
                                           float *sc)
{
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp > 1)
        return;
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        ss += tk.qk[m] * tk.qk[m];
    ss = dn_warp_sum(ss);
    const float scale = 1.0f / sqrtf(ss + p.eps);
    const float qscale = 1.0f / sqrtf((float)DK);
    float *dst = warp == 0 ? qs : ks;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        if (lane + 32 * m < DK)
            dst[lane + 32 * m] = warp == 0 ? tk.qk[m] * scale * qscale : tk.qk[m] * scale;
    if (warp == 0 && lane == 0) {
        sc[0] = dn_sigmoid(tk.b);
        sc[1] = expf(tk.ah * dn_softplus(tk.alpha + tk.dth));
    }
}

/* The delta rule of one token on the thread's state chunks st of its row,
 * after barrier A (q, k, beta and decay in shared memory); returns o_j,
 * equal in the row's four lanes. */
template <int DK>
__device__ __forceinline__ float dn_rule(const struct dn_tok<DK> &cur, float4 (&st)[DK / 16],
                                         const float4 *qs, const float4 *ks, const float *sc)
{
    constexpr int NC = DK / 16; /* float4 chunks of one row a thread owns */
    const uint32_t sub = threadIdx.x % 4;
    const float beta = sc[0], decay = sc[1];
    float mem = 0.0f;
#pragma unroll
    for (int m = 0; m < NC; m++) {
        const float4 k4 = ks[sub + 4 * m];
        st[m].x *= decay;
        st[m].y *= decay;
        st[m].z *= decay;
        st[m].w *= decay;
        mem += st[m].x * k4.x + st[m].y * k4.y + st[m].z * k4.z + st[m].w * k4.w;
    }
    mem += __shfl_xor_sync(0xffffffffu, mem, 1);
    mem += __shfl_xor_sync(0xffffffffu, mem, 2);
    const float d = (cur.v - mem) * beta;
    float o = 0.0f;
#pragma unroll
    for (int m = 0; m < NC; m++) {
        const float4 k4 = ks[sub + 4 * m], q4 = qs[sub + 4 * m];
        st[m].x += k4.x * d;
        st[m].y += k4.y * d;
        st[m].z += k4.z * d;
        st[m].w += k4.w * d;
        o += st[m].x * q4.x + st[m].y * q4.y + st[m].z * q4.z + st[m].w * q4.w;
    }
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);
    return o;
}

/* A token of a head for the threads of a block of dn_heads_kernel (or of a
 * split block): q, k, beta and decay into shared memory, barrier A, the
 * delta rule (dn_rule); returns o_j. */
template <int DK>
__device__ __forceinline__ float dn_rows(const struct dn_heads_args &p,
                                         const struct dn_tok<DK> &cur, float4 (&st)[DK / 16],
                                         float4 *qs, float4 *ks, float *sc)
{
    dn_norm_qk<DK>(p, cur, reinterpret_cast<float *>(qs), reinterpret_cast<float *>(ks), sc);
    __syncthreads(); /* A */
    return dn_rule<DK>(cur, st, qs, ks, sc);
}

/* The sum of o_j^2 over the 8 rows of the calling warp, in all its lanes
 * (the xor butterfly adds the same two values in every lane of a pair, so
 * every lane ends with the same bits). */
__device__ __forceinline__ float dn_warp_sq(float o)
{
    return dn_warp_sum(threadIdx.x % 4 == 0 ? o * o : 0.0f);
}

/* y[s][h*dv + j] = o_j / sqrt(total / dv + eps) * norm_w[j] * silu(z_j),
 * written by lane sub 0 of the row, which gets it back (the others 0);
 * total: the head's sum of o^2. */
__device__ __forceinline__ float dn_out(const struct dn_heads_args &p, uint32_t h, uint32_t s,
                                        uint32_t j, float o, float total, float z, float wj)
{
    if (threadIdx.x % 4 != 0)
        return 0.0f;
    const float scale = 1.0f / sqrtf(total / (float)p.dv + p.eps);
    const float yj = o * scale * wj * dn_silu(z);
    p.y[(size_t)s * p.nv * p.dv + (size_t)h * p.dv + j] = yj;
    return yj;
}

/* Rows of y a block may hold for dn_out_q. */
#define DN_YQ_ROWS 128

/* The block's rows of y (one token) also into p.yq, rounded as mvq.cu's
 * products round an activation row of nv * dv (mvq::round_block per block
 * of 32, the mvq::xq_row_bytes layout: levels, scales, sums), so that the
 * output product copies them (cuda_mvq_xq_tail) instead of rounding y in
 * each of its blocks. The block holds `rows` rows of head h from j0 (both
 * multiples of 32, rows <= DN_YQ_ROWS); yj: dn_out's value (lane sub 0 of
 * row j0 + threadIdx.x / 4). Every thread of the block calls it. */
__device__ __forceinline__ void dn_out_q(const struct dn_heads_args &p, uint32_t h, uint32_t j0,
                                         uint32_t rows, float yj)
{
    __shared__ float s_y[DN_YQ_ROWS];
    if (threadIdx.x % 4 == 0)
        s_y[threadIdx.x / 4] = yj;
    __syncthreads();
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp * 32 < rows) {
        const size_t n = (size_t)p.nv * p.dv;
        float *d = reinterpret_cast<float *>(p.yq + n);
        mvq::round_block(s_y[warp * 32 + lane], (uint32_t)(((size_t)h * p.dv + j0) / 32) + warp,
                         true, p.yq, d, d + n / 32);
    }
}

/* Token s of head h for the threads of dn_heads_kernel: the delta rule on
 * the thread's state chunks st and its output y[s][h*dv + j] (the per-token
 * body shared by the plain and the conv-fused kernels). */
template <int DK>
__device__ __forceinline__ void dn_step(const struct dn_heads_args &p, uint32_t h, uint32_t s,
                                        const struct dn_tok<DK> &cur, float4 (&st)[DK / 16],
                                        float4 *qs, float4 *ks, float *sc, float *red, float wj)
{
    const uint32_t t = threadIdx.x, n_warps = blockDim.x / 32;
    const float o = dn_rows<DK>(p, cur, st, qs, ks, sc);
    const float ss = dn_warp_sq(o);
    if (t % 32 == 0)
        red[t / 32] = ss;
    __syncthreads(); /* B */
    float total = 0.0f;
    for (uint32_t w = 0; w < n_warps; w++)
        total += red[w];
    const float yj = dn_out(p, h, s, t / 4, o, total, cur.z, wj);
    if (p.yq) /* one token, the head's dv rows in this block */
        dn_out_q(p, h, 0, p.dv, yj);
}

template <int DK>
__global__ void __launch_bounds__(512) dn_heads_kernel(const struct dn_heads_args p)
{
    constexpr int NC = DK / 16; /* float4 chunks of one row a thread owns */
    __shared__ float4 qs[DK / 4], ks[DK / 4];
    __shared__ float sc[2];
    __shared__ float red[16];
    const uint32_t h = blockIdx.x, t = threadIdx.x, j = t / 4, sub = t % 4;
    const uint32_t g = p.tiled ? h % p.nk : h / (p.nv / p.nk);
    float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);
    pdl_wait(); /* u, z, b, alpha and the state come from the kernels before */
    pdl_trigger();
    struct dn_tok<DK> next;
    dn_fetch<DK>(p, 0, g, h, j, next);
    float4 st[NC];
#pragma unroll
    for (int m = 0; m < NC; m++)
        st[m] = srow[sub + 4 * m];
    const float wj = p.norm_w[j];
    for (uint32_t s = 0; s < p.S; s++) {
        const struct dn_tok<DK> cur = next;
        if (s + 1 < p.S)
            dn_fetch<DK>(p, s + 1, g, h, j, next);
        dn_step<DK>(p, h, s, cur, st, qs, ks, sc, red, wj);
    }
#pragma unroll
    for (int m = 0; m < NC; m++)
        srow[sub + 4 * m] = st[m];
}

/* The conv part of dn_conv_heads_kernel, passed by value. */
struct dn_conv_args {
    float *state;                 /* C x (K-1), oldest first */
    const float *w;               /* C x K */
    const float *x;               /* one token's C inputs */
    uint32_t K;
};

/* The block's 1/gridDim.x share of the layer's conv taps asked for in L2
 * (one thread calls it). */
template <int DK>
__device__ __forceinline__ void dn_prefetch_taps(const struct dn_heads_args &p,
                                                 const struct dn_conv_args &c)
{
    const size_t bytes = ((size_t)2 * p.nk * DK + (size_t)p.nv * p.dv) * c.K * sizeof(float);
    const size_t share = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~(size_t)15;
    const size_t off = (size_t)blockIdx.x * share;
    if (off < bytes)
        pdl_prefetch_l2(reinterpret_cast<const uint8_t *>(c.w) + off,
                        bytes - off < share ? bytes - off : share);
}

/* Asks for what the decode kernels read after their PDL wait in L2: the
 * layer's conv taps (a 1/gridDim.x share per block), in block 0 the decay
 * and dt-bias vectors, and the block's rows of the delta state (blockDim.x
 * / 4 rows from srow, thread 0's; a hint: L2 holds the current bits
 * whoever writes them, the loads wait). Every thread calls it before the
 * wait; thread 0 asks. */
template <int DK>
__device__ __forceinline__ void dn_prefetch(const struct dn_heads_args &p,
                                           const struct dn_conv_args &c, const float4 *srow)
{
    if (threadIdx.x)
        return;
    pdl_prefetch_l2(srow, (size_t)blockDim.x / 4 * DK * sizeof(float));
    dn_prefetch_taps<DK>(p, c);
    if (blockIdx.x == 0 && p.a)
        pdl_prefetch_l2(p.a, p.nv * sizeof(float));
    if (blockIdx.x == 0 && p.dt)
        pdl_prefetch_l2(p.dt, p.nv * sizeof(float));
}

/* Key heads of the counters dn_conv_heads_kernel keeps (nk at most). */
#define DN_MAX_NK 1024

/* Per key head: blocks of the current dn_conv_heads_kernel launch that have
 * read the head's q and k conv state; the last one rewrites that state and
 * sets the counter back to 0, so it is 0 between launches. One launch at a
 * time per device (the backend runs DeltaNet layers on one stream). */
__device__ unsigned int dn_conv_readers[DN_MAX_NK];

/* What a decode step's conv reads of one channel besides its input: the K-1
 * state inputs (through L2: the early split kernel reads them before its
 * PDL wait) and the K taps; zeros past K. */
struct dn_conv_ch {
    float in[DN_MAX_K - 1];
    float w[DN_MAX_K];
};

__device__ __forceinline__ void dn_conv_fetch(const struct dn_conv_args &c, size_t ch,
                                              struct dn_conv_ch &cc)
{
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        cc.in[t] = t + 1 < c.K ? __ldcg(c.state + ch * (c.K - 1) + t) : 0.0f;
#pragma unroll
    for (uint32_t t = 0; t < DN_MAX_K; t++)
        cc.w[t] = t < c.K ? c.w[ch * c.K + t] : 0.0f;
}

/* One token of a channel: u = silu(sum_t w[t] in_t), in_t the K-1 state
 * inputs then x (dn_conv_kernel's sum for S = 1: the same fused
 * multiply-adds in the same order, its extra zero taps add exact zeros);
 * nst: the new state, in_1 .. in_{K-1}. */
__device__ __forceinline__ float dn_conv_sum(const struct dn_conv_ch &cc, float x, uint32_t K,
                                             float (&nst)[DN_MAX_K - 1])
{
    float in[DN_MAX_K];
#pragma unroll
    for (uint32_t t = 0; t < DN_MAX_K; t++)
        in[t] = t + 1 < K ? cc.in[t] : t + 1 == K ? x : 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (uint32_t t = 0; t < DN_MAX_K; t++)
        if (t < K)
            acc = __fmaf_rn(cc.w[t], in[t], acc);
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        nst[t] = in[t + 1];
    return dn_silu(acc);
}

__device__ __forceinline__ void dn_conv_store(const struct dn_conv_args &c, size_t ch,
                                              const float (&nst)[DN_MAX_K - 1])
{
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        if (t + 1 < c.K)
            c.state[ch * (c.K - 1) + t] = nst[t];
}

/* What the threads of a block of head h, thread row j, read for the conv
 * part of a decode step besides the step's inputs (dn_conv_in): lane 4j the
 * v_j channel's state and taps, warps 0 and 1 those of the q and k channels
 * of key head g, warp 0 lane 0 the head's a and dt bias. */
template <int DK>
struct dn_conv_pre {
    struct dn_conv_ch v;
    struct dn_conv_ch qk[DK >= 32 ? DK / 32 : 1];
    float ah, dth;
};

template <int DK>
__device__ __forceinline__ void dn_conv_fetch_pre(const struct dn_heads_args &p,
                                                  const struct dn_conv_args &c, uint32_t h,
                                                  uint32_t g, uint32_t j,
                                                  struct dn_conv_pre<DK> &pre)
{
    const uint32_t t = threadIdx.x, warp = t / 32, lane = t % 32;
    const size_t kd = (size_t)p.nk * DK;
    if (t % 4 == 0)
        dn_conv_fetch(c, 2 * kd + (size_t)h * p.dv + j, pre.v);
    if (warp > 1)
        return;
    const size_t ch0 = (warp == 0 ? 0 : kd) + (size_t)g * DK;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        if (lane + 32 * m < DK)
            dn_conv_fetch(c, ch0 + lane + 32 * m, pre.qk[m]);
    if (warp == 0 && lane == 0) {
        pre.ah = p.a[h];
        pre.dth = p.dt[h];
    }
}

/* The conv part of a decode step for the threads of a block of head h,
 * thread row j (dn_conv_heads_kernel and its split form): the conv outputs
 * the threads would have read from u into cur (warps 0 and 1 q and k of key
 * head g, lane 4j of row j its v_j, shared with lanes 4j + 1 .. 4j + 3 by a
 * shuffle), z_j and (warp 0 lane 0) the beta, alpha, a and dt inputs. The
 * step's inputs (x, z, beta, alpha) are loaded first; the channels' states
 * and taps come from *pre with PRE (the caller read them: dn_conv_fetch_pre),
 * else each is read just before its sum (fewer registers live). Lane 4j
 * rewrites the v_j conv state; warps 0 and 1 keep the new q and k conv
 * state in nqk for dn_conv_store_qk. After pdl_wait. */
template <int DK, bool PRE>
__device__ __forceinline__ void dn_conv_in(const struct dn_heads_args &p,
                                           const struct dn_conv_args &c, uint32_t h, uint32_t g,
                                           uint32_t j, const struct dn_conv_pre<DK> *pre,
                                           struct dn_tok<DK> &cur,
                                           float (&nqk)[DK >= 32 ? DK / 32 : 1][DN_MAX_K - 1])
{
    constexpr int NQ = DK >= 32 ? DK / 32 : 1;
    const uint32_t t = threadIdx.x, warp = t / 32, lane = t % 32;
    const size_t kd = (size_t)p.nk * DK, vch = 2 * kd + (size_t)h * p.dv + j;
    const size_t ch0 = (warp == 0 ? 0 : kd) + (size_t)g * DK;
    const float xv = t % 4 == 0 ? c.x[vch] : 0.0f;
    float xqk[NQ];
#pragma unroll
    for (int m = 0; m < NQ; m++)
        xqk[m] = warp <= 1 && lane + 32 * m < DK ? c.x[ch0 + lane + 32 * m] : 0.0f;
    cur.z = p.z[(size_t)h * p.dv + j];
    if (warp == 0 && lane == 0) {
        cur.b = p.b[h];
        cur.alpha = p.alpha[h];
        cur.ah = PRE ? pre->ah : p.a[h];
        cur.dth = PRE ? pre->dth : p.dt[h];
    }
    float v = 0.0f;
    if (t % 4 == 0) {
        struct dn_conv_ch cc;
        if constexpr (PRE)
            cc = pre->v;
        else
            dn_conv_fetch(c, vch, cc);
        float nst[DN_MAX_K - 1];
        v = dn_conv_sum(cc, xv, c.K, nst);
        dn_conv_store(c, vch, nst);
    }
    cur.v = __shfl_sync(0xffffffffu, v, lane & ~3u);
    if (warp > 1)
        return;
#pragma unroll
    for (int m = 0; m < NQ; m++) {
        if (lane + 32 * m >= DK) {
            cur.qk[m] = 0.0f;
            continue;
        }
        struct dn_conv_ch cc;
        if constexpr (PRE)
            cc = pre->qk[m];
        else
            dn_conv_fetch(c, ch0 + lane + 32 * m, cc);
        cur.qk[m] = dn_conv_sum(cc, xqk[m], c.K, nqk[m]);
    }
}

/* Warps 0 and 1: the new q and k conv state of key head g (from dn_conv_in). */
template <int DK>
__device__ __forceinline__ void dn_conv_store_qk(const struct dn_heads_args &p,
                                                 const struct dn_conv_args &c, uint32_t g,
                                                 const float (&nqk)[DK >= 32 ? DK / 32 : 1]
                                                                   [DN_MAX_K - 1])
{
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp > 1)
        return;
    const size_t ch0 = (warp == 0 ? 0 : (size_t)p.nk * DK) + (size_t)g * DK;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        if (lane + 32 * m < DK)
            dn_conv_store(c, ch0 + lane + 32 * m, nqk[m]);
}

/* Thread 0 of a block that has read key head g's q and k conv state (after a
 * barrier behind the reading warps' fences): counts it in dn_conv_readers[g];
 * whether it is the last of `readers` (then the counter is set back to 0). */
__device__ __forceinline__ bool dn_conv_count(uint32_t g, uint32_t readers)
{
    __threadfence();
    const bool last = atomicAdd(&dn_conv_readers[g], 1u) == readers - 1;
    if (last)
        atomicExch(&dn_conv_readers[g], 0u);
    __threadfence();
    return last;
}

/* dn_conv_kernel and dn_heads_kernel for one token (S = 1) in one launch:
 * the threads compute the conv outputs they would have read from u
 * (dn_conv_in). The v conv state of head h is rewritten by its block; q and
 * k channels are read by the nv / nk blocks of their key head, and
 * rewritten by the last of them to have read them (dn_conv_readers).
 * Outputs and states equal the two launches' bit for bit. */
template <int DK>
__global__ void __launch_bounds__(512)
    dn_conv_heads_kernel(const struct dn_heads_args p, const struct dn_conv_args c)
{
    constexpr int NC = DK / 16, NQ = DK >= 32 ? DK / 32 : 1;
    __shared__ float4 qs[DK / 4], ks[DK / 4];
    __shared__ float sc[2];
    __shared__ float red[16];
    __shared__ bool s_last;
    const uint32_t h = blockIdx.x, t = threadIdx.x, j = t / 4, sub = t % 4;
    const uint32_t r = p.nv / p.nk, g = p.tiled ? h % p.nk : h / r;
    float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);
    const float wj = p.norm_w[j];
    dn_prefetch<DK>(p, c, srow);
    pdl_wait(); /* x, z, b, alpha and the states come from the kernels before */
    pdl_trigger();
    struct dn_tok<DK> cur;
    float nqk[NQ][DN_MAX_K - 1];
    dn_conv_in<DK, false>(p, c, h, g, j, nullptr, cur, nqk);
    bool last = true;
    if (r > 1) { /* q and k inputs are read (and used) by warps 0 and 1 above */
        if (t < 64)
            __threadfence(); /* their reads are done before the count says so */
        __syncthreads();
        if (t == 0)
            s_last = dn_conv_count(g, r);
        __syncthreads();
        last = s_last;
    }
    if (last)
        dn_conv_store_qk<DK>(p, c, g, nqk);
    float4 st[NC];
#pragma unroll
    for (int m = 0; m < NC; m++)
        st[m] = srow[sub + 4 * m];
    dn_step<DK>(p, h, 0, cur, st, qs, ks, sc, red, wj);
#pragma unroll
    for (int m = 0; m < NC; m++)
        srow[sub + 4 * m] = st[m];
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace cg = cooperative_groups;

/* The head's sum of o^2 in a split block (its cluster's blocks hold the
 * head's warps in rank order): the calling warp's sum ss goes into slot w,
 * the warp's index in the head, of red in every block of the cluster (lane
 * q writes block q's), a cluster barrier (which is also barrier B), then
 * every thread adds red[0 .. n_warps) in order, as dn_step adds its warp
 * sums: the same bits. Every block of the cluster must have started before
 * the first call (a cluster barrier after start), and red is written again
 * at the earliest two calls later, by which time every block has read it.
 * dn_cluster_sum_at: the same for a head whose hb blocks start at cluster
 * rank `first` (the fused input kernel's clusters hold r heads), the warp's
 * slot widx, only the `act` threads writing; every thread of the cluster
 * arrives. */
__device__ __forceinline__ float dn_cluster_sum_at(float ss, float *red, uint32_t n_warps,
                                                   uint32_t first, uint32_t hb, uint32_t widx,
                                                   bool act)
{
    const uint32_t lane = threadIdx.x % 32;
    if (act && lane < hb)
        cg::this_cluster().map_shared_rank(red, (int)(first + lane))[widx] = ss;
    cg::this_cluster().sync();
    float total = 0.0f;
    for (uint32_t i = 0; i < n_warps; i++)
        total += red[i];
    return total;
}

__device__ __forceinline__ float dn_cluster_sum(float ss, float *red, uint32_t n_warps)
{
    const uint32_t w = cg::this_cluster().block_rank() * (blockDim.x / 32) + threadIdx.x / 32;
    return dn_cluster_sum_at(ss, red, n_warps, 0, cg::this_cluster().num_blocks(), w, true);
}
#endif

/* dn_heads_kernel split over a cluster of nb blocks per head (DN_SPLIT in
 * the file comment), grid nv * nb of 4 * dv / nb threads. One cluster
 * barrier per token replaces barrier B; the warp sums alternate between two
 * slots of red. sm_90 and later; empty elsewhere (never launched there). */
template <int DK>
__global__ void __launch_bounds__(256) dn_heads_split_kernel(const struct dn_heads_args p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int NC = DK / 16;
    __shared__ float4 qs[DK / 4], ks[DK / 4];
    __shared__ float sc[2];
    __shared__ float red[2][16];
    cg::this_cluster().barrier_arrive(); /* waited for before the first write to red */
    const uint32_t nb = cg::this_cluster().num_blocks(), h = blockIdx.x / nb, sub = threadIdx.x % 4;
    const uint32_t j = (cg::this_cluster().block_rank() * blockDim.x + threadIdx.x) / 4;
    const uint32_t g = p.tiled ? h % p.nk : h / (p.nv / p.nk);
    float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);
    pdl_wait(); /* u, z, b, alpha and the state come from the kernels before */
    pdl_trigger();
    struct dn_tok<DK> next;
    dn_fetch<DK>(p, 0, g, h, j, next);
    float4 st[NC];
#pragma unroll
    for (int m = 0; m < NC; m++)
        st[m] = srow[sub + 4 * m];
    const float wj = p.norm_w[j];
    cg::this_cluster().barrier_wait();
    for (uint32_t s = 0; s < p.S; s++) {
        const struct dn_tok<DK> cur = next;
        if (s + 1 < p.S)
            dn_fetch<DK>(p, s + 1, g, h, j, next);
        const float o = dn_rows<DK>(p, cur, st, qs, ks, sc);
        const float total = dn_cluster_sum(dn_warp_sq(o), red[s % 2], p.dv / 8);
        dn_out(p, h, s, j, o, total, cur.z, wj);
    }
#pragma unroll
    for (int m = 0; m < NC; m++)
        srow[sub + 4 * m] = st[m];
#else
    __trap(); /* launched on sm_90 and later only (caps.h): never silently nothing */
#endif
}

/* Per key head g, q (2g) and k (2g + 1): warps of the current
 * dn_conv_heads_split_kernel launch that have read the head's q or k conv
 * state (warp 0 or 1 of each block of g's value heads); the last one
 * rewrites that state and sets the counter back to 0, so it is 0 between
 * launches (one launch at a time per device, as dn_conv_readers). */
__device__ unsigned int dn_conv_qk_readers[2 * DN_MAX_NK];

/* Warp 0 or 1 of a split block, once its lanes have read their q or k conv
 * state: counts the warp in dn_conv_qk_readers[i]; lane 0 gets the count
 * before it (its ticket), the other lanes 0. */
__device__ __forceinline__ unsigned dn_conv_ticket(uint32_t i)
{
    __threadfence(); /* this lane's reads are done before the count says so */
    __syncwarp();
    return threadIdx.x % 32 == 0 ? atomicAdd(&dn_conv_qk_readers[i], 1u) : 0u;
}

/* Whether the warp that took `ticket` (lane 0's) from dn_conv_qk_readers[i]
 * was the last of `readers`; that one sets the counter back to 0 and then
 * may rewrite the state. */
__device__ __forceinline__ bool dn_conv_is_last(uint32_t i, unsigned ticket, uint32_t readers)
{
    const bool last = __shfl_sync(0xffffffffu, ticket, 0) == readers - 1;
    if (last) {
        if (threadIdx.x % 32 == 0)
            atomicExch(&dn_conv_qk_readers[i], 0u);
        __threadfence();
        __syncwarp();
    }
    return last;
}

/* dn_conv_heads_kernel split over a cluster of nb blocks per head (DN_SPLIT
 * in the file comment), grid nv * nb of 4 * dv / nb threads. Each block
 * computes q and k itself; its warps 0 and 1 count themselves as readers of
 * their key head's q and k conv state (nv / nk * nb each,
 * dn_conv_qk_readers) right after reading it, and the last warp 0 and the
 * last warp 1 rewrite that state at the end: no block barrier waits on the
 * count. The state rows are loaded before the conv. With p.early (the
 * caller's promise that the delta and conv states were written two or more
 * launches back, kernels/cuda/pdl.cuh) the state rows, the conv states and
 * taps, a and dt are read, and warps 0 and 1 count themselves, before the
 * PDL wait (the counters are this kernel's alone, back at 0 when the
 * launch before it completed), so that after the wait only the step's
 * inputs (x, z, beta, alpha) are read, in one round. sm_90 and later; empty
 * elsewhere (never launched there). */
template <int DK>
__global__ void __launch_bounds__(256)
    dn_conv_heads_split_kernel(const struct dn_heads_args p, const struct dn_conv_args c)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int NC = DK / 16, NQ = DK >= 32 ? DK / 32 : 1;
    __shared__ float4 qs[DK / 4], ks[DK / 4];
    __shared__ float sc[2];
    __shared__ float red[16];
    cg::this_cluster().barrier_arrive(); /* waited for before the first write to red */
    const uint32_t nb = cg::this_cluster().num_blocks(), h = blockIdx.x / nb;
    const uint32_t t = threadIdx.x, sub = t % 4, warp = t / 32;
    const uint32_t j = (cg::this_cluster().block_rank() * blockDim.x + t) / 4;
    const uint32_t g = p.tiled ? h % p.nk : h / (p.nv / p.nk), readers = p.nv / p.nk * nb;
    float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);
    const float wj = p.norm_w[j];
    float4 st[NC];
    struct dn_conv_pre<DK> pre;
    unsigned ticket = 0u;
    if (p.early) { /* the states, written two or more launches back, through L2 */
#pragma unroll
        for (int m = 0; m < NC; m++)
            st[m] = __ldcg(srow + sub + 4 * m);
        dn_conv_fetch_pre<DK>(p, c, h, g, j, pre);
        if (warp <= 1)
            ticket = dn_conv_ticket(2 * g + warp);
    } else {
        dn_prefetch<DK>(p, c, srow);
    }
    pdl_wait(); /* x, z, b, alpha (and without early the states) from the kernels before */
    pdl_trigger();
    if (!p.early) {
#pragma unroll
        for (int m = 0; m < NC; m++)
            st[m] = srow[sub + 4 * m];
    }
    struct dn_tok<DK> cur;
    float nqk[NQ][DN_MAX_K - 1];
    if (p.early)
        dn_conv_in<DK, true>(p, c, h, g, j, &pre, cur, nqk);
    else
        dn_conv_in<DK, false>(p, c, h, g, j, nullptr, cur, nqk);
    if (!p.early && warp <= 1)
        ticket = dn_conv_ticket(2 * g + warp);
    const float o = dn_rows<DK>(p, cur, st, qs, ks, sc);
    cg::this_cluster().barrier_wait();
    const float total = dn_cluster_sum(dn_warp_sq(o), red, p.dv / 8);
    const float yj = dn_out(p, h, 0, j, o, total, cur.z, wj);
    if (p.yq)
        dn_out_q(p, h, cg::this_cluster().block_rank() * (blockDim.x / 4), blockDim.x / 4, yj);
    if (warp <= 1 && dn_conv_is_last(2 * g + warp, ticket, readers))
        dn_conv_store_qk<DK>(p, c, g, nqk);
#pragma unroll
    for (int m = 0; m < NC; m++)
        srow[sub + 4 * m] = st[m];
#else
    __trap(); /* launched on sm_90 and later only (caps.h): never silently nothing */
#endif
}

/* Arguments of the chunked kernels, passed by value. */
struct dn_chunk_args {
    float *state;
    const float *u, *b, *alpha, *a, *dt, *z, *norm_w;
    float *y;
    float *work;                   /* dn_chunk_floats per (head, chunk), head-major */
    uint32_t nk, nv, S, n_chunks;
    bool tiled;
    float eps;
};

/* Floats of one (head, chunk) record in the work buffer: Qg, Kw, Wm (DN_CH x
 * dk each), U (DN_CH x dv), at (DN_CH x DN_CH), decay (8, for alignment). */
__host__ __device__ constexpr size_t dn_chunk_floats(uint32_t dk, uint32_t dv)
{
    return (size_t)DN_CH * (3 * dk + dv + DN_CH) + 8;
}

/* Shared memory of dn_prep_kernel: q/v rows, k rows, the 64 x 64 matrix, the
 * solve's temporaries, and g, exp(g), beta. */
__host__ __device__ constexpr size_t dn_prep_smem_floats(uint32_t dk, uint32_t dv)
{
    return (size_t)DN_CH * ((dk > dv ? dk : dv) + 4) + (size_t)DN_CH * (dk + 4) +
           (size_t)DN_CH * (DN_CH + 4) + 3 * 256 + 3 * DN_CH;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DN_HAVE_TF32 1

using namespace nvcuda;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> dn_fa_row;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major> dn_fa_col;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> dn_fb_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> dn_fb_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> dn_fc;

template <typename F>
__device__ __forceinline__ void dn_to_tf32(F &f)
{
#pragma unroll
    for (int i = 0; i < f.num_elements; i++)
        f.x[i] = wmma::__float_to_tf32(f.x[i]);
}

/* c += A (16 x 8*n8) @ B (8*n8 x 16). Step s reads the A tile at a + s*a_step
 * (leading dimension lda) and the B tile at b + s*b_step; the fragment types
 * say whether each is row- or column-major. Pointers 32-byte aligned, leading
 * dimensions multiples of 4 floats (wmma's rules); global or shared memory. */
template <typename FA, typename FB>
__device__ __forceinline__ void dn_mma(dn_fc &c, const float *a, unsigned lda, size_t a_step,
                                       const float *b, unsigned ldb, size_t b_step, int n8)
{
#pragma unroll 8
    for (int s = 0; s < n8; s++) {
        FA fa;
        FB fb;
        wmma::load_matrix_sync(fa, a + s * a_step, lda);
        wmma::load_matrix_sync(fb, b + s * b_step, ldb);
        dn_to_tf32(fa);
        dn_to_tf32(fb);
        wmma::mma_sync(c, fa, fb, c);
    }
}

/* Asks for the n floats at x in this SM's L1 (a 128-byte line per thread and
 * step): parts of dn_state_kernel's next chunk record, read as wmma fragments,
 * fetched as the current chunk's copies stop being needed. */
__device__ __forceinline__ void dn_prefetch_l1(const float *x, size_t n)
{
    for (size_t i = (size_t)threadIdx.x * 32; i < n; i += (size_t)blockDim.x * 32)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(x + i));
}

/* The same for DN_CH rows of DN_SLICE floats, row stride ld (both ends of a
 * row: it may straddle two lines). */
__device__ __forceinline__ void dn_prefetch_l1_rows(const float *x, size_t ld)
{
    if (threadIdx.x < DN_CH) {
        asm volatile("prefetch.global.L1 [%0];" ::"l"(x + threadIdx.x * ld));
        asm volatile("prefetch.global.L1 [%0];" ::"l"(x + threadIdx.x * ld + DN_SLICE - 1));
    }
}

/* Dynamic shared memory of dn_prep_kernel. */
__device__ __forceinline__ float *dn_dyn_smem()
{
    extern __shared__ __align__(128) float dn_smem[];
    return dn_smem;
}

/* Per token of the chunk (threads 0..63): beta, g (the in-order prefix sum of
 * gdec, as the CPU sums) and exp(g); rows past n get beta 0 and g = g_{n-1}. */
__device__ __forceinline__ void dn_prep_scalars(const struct dn_chunk_args &p, uint32_t h,
                                                uint32_t s0, uint32_t n, float *g, float *eg,
                                                float *beta)
{
    const uint32_t t = threadIdx.x;
    if (t < DN_CH) {
        float bb = 0.0f, gd = 0.0f;
        if (t < n) {
            const size_t i = (size_t)(s0 + t) * p.nv + h;
            bb = dn_sigmoid(p.b[i]);
            gd = p.a[h] * dn_softplus(p.alpha[i] + p.dt[h]);
        }
        beta[t] = bb;
        g[t] = gd;
    }
    __syncthreads();
    if (t == 0) {
        float acc = 0.0f;
        for (int i = 0; i < DN_CH; i++) {
            acc += g[i];
            g[i] = acc;
        }
    }
    __syncthreads();
    if (t < DN_CH)
        eg[t] = expf(g[t]);
}

/* Normalised q (times 1/sqrt(DK)) and k of the chunk's tokens into qs and ks
 * (zero rows past n); Qg = qs * exp(g) and Kw = k * exp(gl - g) to the work
 * record. A warp per token. */
template <int DK, int DV>
__device__ __forceinline__ void dn_prep_qk(const struct dn_chunk_args &p, uint32_t gk,
                                           uint32_t s0, uint32_t n, const float *g, float *qs,
                                           unsigned ql, float *ks, unsigned kl, float *Qg,
                                           float *Kw)
{
    constexpr int M = DK / 32;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float qscale = (float)(1.0 / sqrt((double)DK)), gl = g[n - 1];
    const size_t kd = (size_t)p.nk * DK, ud = 2 * kd + (size_t)p.nv * DV;
    /* the warp's tokens' rows loaded first, all in flight at once */
    constexpr int TW = DN_CH / (DN_CK_THREADS / 32);
    float qa[TW][M], ka[TW][M];
#pragma unroll
    for (int i = 0; i < TW; i++) {
        const uint32_t t = warp + i * (DN_CK_THREADS / 32);
        const float *us = p.u + (size_t)(s0 + t) * ud + (size_t)gk * DK;
#pragma unroll
        for (int m = 0; m < M; m++) {
            qa[i][m] = t < n ? us[lane + 32 * m] : 0.0f;
            ka[i][m] = t < n ? us[kd + lane + 32 * m] : 0.0f;
        }
    }
#pragma unroll
    for (int i = 0; i < TW; i++) {
        const uint32_t t = warp + i * (DN_CK_THREADS / 32);
        const float *qv = qa[i], *kv = ka[i];
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int m = 0; m < M; m++) {
            sq += qv[m] * qv[m];
            sk += kv[m] * kv[m];
        }
        sq = 1.0f / sqrtf(dn_warp_sum(sq) + p.eps);
        sk = 1.0f / sqrtf(dn_warp_sum(sk) + p.eps);
        const float e = expf(g[t]), w = expf(gl - g[t]);
#pragma unroll
        for (int m = 0; m < M; m++) {
            const uint32_t col = lane + 32 * m;
            const float q = qv[m] * sq * qscale, k = kv[m] * sk;
            qs[t * ql + col] = q;
            ks[t * kl + col] = k;
            Qg[t * DK + col] = q * e;
            Kw[t * DK + col] = k * w;
        }
    }
}

/* c (64 x 64 in shared memory, leading dimension DN_CH + 4) = x @ y^T on the
 * tiles at or below the diagonal; x and y are DN_CH rows of DK floats. */
template <int DK>
__device__ __forceinline__ void dn_prep_gram(const float *x, unsigned xl, const float *y,
                                             unsigned yl, float *c)
{
    constexpr unsigned CL = DN_CH + 4;
    const uint32_t warp = threadIdx.x / 32;
    for (uint32_t tile = warp; tile < 16; tile += DN_CK_THREADS / 32) {
        const uint32_t r = tile / 4, cc = tile % 4;
        if (cc > r)
            continue;
        dn_fc acc;
        wmma::fill_fragment(acc, 0.0f);
        dn_mma<dn_fa_row, dn_fb_col>(acc, x + 16 * r * xl, xl, 8, y + 16 * cc * yl, yl, 8,
                                     DK / 8);
        wmma::store_matrix_sync(c + 16 * r * CL + 16 * cc, acc, CL, wmma::mem_row_major);
    }
}

/* la = (I - L)^-1 in place (L strictly lower, zero elsewhere; the result is
 * unit lower triangular). pt: 3 blocks of 16 x 16 floats. */
__device__ __forceinline__ void dn_prep_solve(float *la, float *pt)
{
    constexpr unsigned AL = DN_CH + 4;
    const uint32_t t = threadIdx.x, warp = t / 32, lane = t % 32;
    if (warp < 2) {
        /* diagonal block blk: lane owns column u, forward substitution
         * x_t = sum_{m<t} L_tm x_m with x_u = 1 and x_m = 0 for m < u */
        const uint32_t blk = warp * 2 + lane / 16, u = lane % 16;
        float *lb = la + 16 * blk * AL + 16 * blk;
        float x[16];
#pragma unroll
        for (uint32_t r = 0; r < 16; r++) {
            float acc = 0.0f;
#pragma unroll
            for (uint32_t m = 0; m < r; m++)
                acc += lb[r * AL + m] * x[m];
            x[r] = r < u ? 0.0f : (r == u ? 1.0f : acc);
        }
        __syncwarp();
#pragma unroll
        for (uint32_t r = 0; r < 16; r++)
            lb[r * AL + u] = x[r];
    }
    __syncthreads();
    const uint32_t r = t / 16, c = t % 16;
    for (uint32_t i = 1; i < 4; i++) {
        /* P_j = sum_{k=j}^{i-1} L_ik X_kj for j < i (L_ik is still L) */
        const float *li = la + (16 * i + r) * AL;
        for (uint32_t j = 0; j < i; j++) {
            float acc = 0.0f;
            for (uint32_t m = 16 * j; m < 16 * i; m++)
                acc += li[m] * la[m * AL + 16 * j + c];
            pt[j * 256 + r * 16 + c] = acc;
        }
        __syncthreads();
        /* X_ij = X_ii P_j over L_ij */
        for (uint32_t j = 0; j < i; j++) {
            float acc = 0.0f;
            for (uint32_t m = 0; m <= r; m++)
                acc += li[16 * i + m] * pt[j * 256 + m * 16 + c];
            la[(16 * i + r) * AL + 16 * j + c] = acc;
        }
        __syncthreads();
    }
}

/* out (DN_CH x D, global, leading dimension D) = A @ x with A the unit lower
 * triangular matrix in la and x DN_CH rows of D floats (leading dimension xl):
 * the tiles of block row r only sum k < 16 (r + 1). */
template <int D>
__device__ __forceinline__ void dn_prep_lower_mul(const float *la, const float *x, unsigned xl,
                                                  float *out)
{
    constexpr unsigned AL = DN_CH + 4;
    const uint32_t warp = threadIdx.x / 32;
    for (uint32_t tile = warp; tile < 4 * (D / 16); tile += DN_CK_THREADS / 32) {
        const uint32_t r = tile / (D / 16), cc = tile % (D / 16);
        dn_fc acc;
        wmma::fill_fragment(acc, 0.0f);
        dn_mma<dn_fa_row, dn_fb_row>(acc, la + 16 * r * AL, AL, 8, x + 16 * cc, xl, 8 * xl,
                                     2 * (r + 1));
        wmma::store_matrix_sync(out + 16 * r * D + 16 * cc, acc, D, wmma::mem_row_major);
    }
}
#endif

/* Everything of one chunk of one value head that does not depend on the
 * state (see the top of the file); grid (n_chunks, nv), DN_CK_THREADS threads,
 * dn_prep_smem_floats(DK, DV) floats of dynamic shared memory. */
template <int DK, int DV>
__global__ void __launch_bounds__(DN_CK_THREADS) dn_prep_kernel(const struct dn_chunk_args p)
{
#ifdef DN_HAVE_TF32
    constexpr unsigned RL = (DK > DV ? DK : DV) + 4, KL = DK + 4, AL = DN_CH + 4;
    const uint32_t c = blockIdx.x, h = blockIdx.y, t = threadIdx.x, s0 = c * DN_CH;
    const uint32_t n = p.S - s0 < DN_CH ? p.S - s0 : DN_CH;
    const uint32_t gk = p.tiled ? h % p.nk : h / (p.nv / p.nk);
    float *qs = dn_dyn_smem();     /* DN_CH x RL: q * scale, later v * beta */
    float *ks = qs + DN_CH * RL;   /* DN_CH x KL: k, later k * beta * exp(g) */
    float *la = ks + DN_CH * KL;   /* DN_CH x AL: q k^T, then L, then A */
    float *pt = la + DN_CH * AL;   /* 3 x 16 x 16: the solve's block products */
    float *g = pt + 3 * 256, *eg = g + DN_CH, *beta = eg + DN_CH;
    float *rec = p.work + ((size_t)h * p.n_chunks + c) * dn_chunk_floats(DK, DV);
    float *Qg = rec, *Kw = Qg + DN_CH * DK, *Wm = Kw + DN_CH * DK, *U = Wm + DN_CH * DK;
    float *at = U + DN_CH * DV, *decay = at + DN_CH * DN_CH;
    dn_prep_scalars(p, h, s0, n, g, eg, beta);
    dn_prep_qk<DK, DV>(p, gk, s0, n, g, qs, RL, ks, KL, Qg, Kw);
    __syncthreads();
    dn_prep_gram<DK>(qs, RL, ks, KL, la);
    __syncthreads();
    for (uint32_t e = t; e < DN_CH * DN_CH; e += DN_CK_THREADS) {
        const uint32_t r = e / DN_CH, u = e % DN_CH;
        at[e] = u <= r ? la[r * AL + u] * expf(g[r] - g[u]) : 0.0f;
    }
    __syncthreads();
    dn_prep_gram<DK>(ks, KL, ks, KL, la);
    __syncthreads();
    for (uint32_t e = t; e < DN_CH * DN_CH; e += DN_CK_THREADS) {
        const uint32_t r = e / DN_CH, u = e % DN_CH;
        la[r * AL + u] = u < r ? -((la[r * AL + u] * beta[r]) * expf(g[r] - g[u])) : 0.0f;
    }
    for (uint32_t e = t; e < DN_CH * DK; e += DN_CK_THREADS) {
        const uint32_t r = e / DK, i = e % DK;
        ks[r * KL + i] = ks[r * KL + i] * beta[r] * eg[r];
    }
    const size_t kd = (size_t)p.nk * DK, vd = (size_t)p.nv * DV;
#pragma unroll 8
    for (uint32_t e = t; e < DN_CH * DV; e += DN_CK_THREADS) {
        const uint32_t r = e / DV, j = e % DV;
        const float v = r < n ? p.u[(size_t)(s0 + r) * (2 * kd + vd) + 2 * kd + (size_t)h * DV + j]
                              : 0.0f;
        qs[r * RL + j] = v * beta[r];
    }
    __syncthreads();
    dn_prep_solve(la, pt);
    dn_prep_lower_mul<DK>(la, ks, KL, Wm);
    dn_prep_lower_mul<DV>(la, qs, RL, U);
    if (t == 0)
        decay[0] = expf(g[n - 1]);
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

constexpr unsigned kDnSL = DN_SLICE + 4; /* floats a row of the state pass's slices */

#ifdef DN_HAVE_TF32
/* The steps of the state pass over one chunk, shared by its two kernels. A
 * block owns DN_SLICE value columns of a head; ss is the key-major state slice
 * (DK x SL), vn and os DN_CH x SL, all in shared memory; the record's matrices
 * are read as wmma fragments from wherever the kernel keeps them (leading
 * dimensions given). Warp (r, cc) = (warp / 2, warp % 2) owns one 16 x 16 tile
 * of vn and of o. */
/* vn tile = U - Wm @ St (u: U's slice, its column 0). */
template <int DK>
__device__ __forceinline__ void dn_state_vn(const float *wm, unsigned wl, const float *u,
                                            unsigned ul, const float *ss, float *vn)
{
    const uint32_t warp = threadIdx.x / 32, r = warp / 2, cc = warp % 2;
    dn_fc acc, uf;
    wmma::fill_fragment(acc, 0.0f);
    dn_mma<dn_fa_row, dn_fb_row>(acc, wm + 16 * r * wl, wl, 8, ss + 16 * cc, kDnSL, 8 * kDnSL,
                                 DK / 8);
    wmma::load_matrix_sync(uf, u + 16 * r * ul + 16 * cc, ul, wmma::mem_row_major);
#pragma unroll
    for (int i = 0; i < uf.num_elements; i++)
        uf.x[i] -= acc.x[i];
    wmma::store_matrix_sync(vn + 16 * r * kDnSL + 16 * cc, uf, kDnSL, wmma::mem_row_major);
}

/* o tile = Qg @ St + at @ vn (at is lower triangular). */
template <int DK>
__device__ __forceinline__ void dn_state_o(const float *qg, unsigned ql, const float *at,
                                           unsigned al, const float *ss, const float *vn,
                                           float *os)
{
    const uint32_t warp = threadIdx.x / 32, r = warp / 2, cc = warp % 2;
    dn_fc acc;
    wmma::fill_fragment(acc, 0.0f);
    dn_mma<dn_fa_row, dn_fb_row>(acc, qg + 16 * r * ql, ql, 8, ss + 16 * cc, kDnSL, 8 * kDnSL,
                                 DK / 8);
    dn_mma<dn_fa_row, dn_fb_row>(acc, at + 16 * r * al, al, 8, vn + 16 * cc, kDnSL, 8 * kDnSL,
                                 2 * (r + 1));
    wmma::store_matrix_sync(os + 16 * r * kDnSL + 16 * cc, acc, kDnSL, wmma::mem_row_major);
}

/* The chunk's o rows (tokens s0..) of the block's columns into y. */
template <int DV>
__device__ __forceinline__ void dn_state_y(const struct dn_chunk_args &p, const float *os,
                                           uint32_t s0, uint32_t h, uint32_t j0)
{
    const size_t vd = (size_t)p.nv * DV;
    for (uint32_t e = threadIdx.x; e < DN_CH * DN_SLICE; e += DN_CK_THREADS) {
        const uint32_t row = e / DN_SLICE, jj = e % DN_SLICE;
        if (s0 + row < p.S)
            p.y[(size_t)(s0 + row) * vd + (size_t)h * DV + j0 + jj] = os[row * kDnSL + jj];
    }
}

/* St = St * decay + Kw^T @ vn, each warp on its own tiles. */
template <int DK>
__device__ __forceinline__ void dn_state_update(const float *kw, unsigned kl, const float *vn,
                                                float *ss, float dec)
{
    const uint32_t warp = threadIdx.x / 32;
    for (uint32_t tile = warp; tile < 2 * (DK / 16); tile += DN_CK_THREADS / 32) {
        const uint32_t ri = tile / 2, ci = tile % 2;
        float *sp = ss + 16 * ri * kDnSL + 16 * ci;
        dn_fc acc;
        wmma::load_matrix_sync(acc, sp, kDnSL, wmma::mem_row_major);
#pragma unroll
        for (int i = 0; i < acc.num_elements; i++)
            acc.x[i] *= dec;
        dn_mma<dn_fa_col, dn_fb_row>(acc, kw + 16 * ri, kl, 8 * kl, vn + 16 * ci, kDnSL,
                                     8 * kDnSL, DN_CH / 8);
        wmma::store_matrix_sync(sp, acc, kDnSL, wmma::mem_row_major);
    }
}

/* The block's state slice (DK x DN_SLICE at st, value-major) into or out of ss. */
template <int DK>
__device__ __forceinline__ void dn_state_slice(float *st, float *ss, bool load)
{
    for (uint32_t e = threadIdx.x; e < DK * DN_SLICE; e += DN_CK_THREADS) {
        if (load)
            ss[(e % DK) * kDnSL + e / DK] = st[e];
        else
            st[e] = ss[(e % DK) * kDnSL + e / DK];
    }
}
#endif

/* The state pass: a block owns DN_SLICE value columns of head h (grid
 * (DV / DN_SLICE, nv), DN_CK_THREADS threads) and walks the chunks in order;
 * raw outputs o go to y (normalised afterwards by dn_gnorm_kernel). */
template <int DK, int DV>
__global__ void __launch_bounds__(DN_CK_THREADS) dn_state_kernel(const struct dn_chunk_args p)
{
#ifdef DN_HAVE_TF32
    __shared__ __align__(128) float ss[DK * kDnSL];     /* St[i][jj]: key-major state slice */
    __shared__ __align__(128) float vn[DN_CH * kDnSL];  /* v_new of the chunk */
    __shared__ __align__(128) float os[DN_CH * kDnSL];  /* o of the chunk, before the copy out */
    const uint32_t h = blockIdx.y, j0 = blockIdx.x * DN_SLICE;
    float *st = p.state + ((size_t)h * DV + j0) * DK;
    const float *rec0 = p.work + (size_t)h * p.n_chunks * dn_chunk_floats(DK, DV);
    dn_prefetch_l1(rec0, 3 * DN_CH * DK);
    dn_prefetch_l1_rows(rec0 + 3 * DN_CH * DK + j0, DV);
    dn_prefetch_l1(rec0 + 3 * DN_CH * DK + DN_CH * DV, DN_CH * DN_CH);
    dn_state_slice<DK>(st, ss, true);
    __syncthreads();
    for (uint32_t c = 0; c < p.n_chunks; c++) {
        const float *rec = p.work + ((size_t)h * p.n_chunks + c) * dn_chunk_floats(DK, DV);
        const float *Qg = rec, *Kw = Qg + DN_CH * DK, *Wm = Kw + DN_CH * DK;
        const float *U = Wm + DN_CH * DK, *at = U + DN_CH * DV, *decay = at + DN_CH * DN_CH;
        /* the next record's part of each step once this chunk's step that reads it is done */
        const size_t next = c + 1 < p.n_chunks ? dn_chunk_floats(DK, DV) : 0;
        dn_state_vn<DK>(Wm, DK, U + j0, DV, ss, vn);
        __syncthreads();
        if (next) {
            dn_prefetch_l1(Wm + next, DN_CH * DK);
            dn_prefetch_l1_rows(U + next + j0, DV);
        }
        dn_state_o<DK>(Qg, DK, at, DN_CH, ss, vn, os);
        __syncthreads();
        if (next) {
            dn_prefetch_l1(Qg + next, DN_CH * DK);
            dn_prefetch_l1(at + next, DN_CH * DN_CH);
        }
        dn_state_y<DV>(p, os, c * DN_CH, h, j0);
        dn_state_update<DK>(Kw, DK, vn, ss, decay[0]);
        __syncthreads();
        if (next)
            dn_prefetch_l1(Kw + next, DN_CH * DK);
    }
    dn_state_slice<DK>(st, ss, false);
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

/* Floats of dynamic shared memory of dn_state_staged_kernel: the state slice,
 * vn and o as in dn_state_kernel, and a chunk record's Wm, U slice, Qg, at
 * and Kw with padded rows. */
__host__ __device__ constexpr size_t dn_staged_smem_floats(uint32_t dk)
{
    return (size_t)dk * kDnSL + 3 * (size_t)DN_CH * kDnSL +
           3 * (size_t)DN_CH * (dk + 4) + (size_t)DN_CH * (DN_CH + 4);
}

#ifdef DN_HAVE_TF32
/* rows x cols floats (cols a multiple of 4, both ends 16-byte aligned) from
 * src (leading dimension sld) into shared dst (dld), by the block's threads. */
__device__ __forceinline__ void dn_cp_rows(float *dst, unsigned dld, const float *src, size_t sld,
                                           unsigned rows, unsigned cols)
{
    const unsigned q = cols / 4;
    for (unsigned i = threadIdx.x; i < rows * q; i += DN_CK_THREADS) {
        const unsigned r = i / q, c4 = i - r * q;
        cp16(dst + r * dld + 4 * c4, src + r * sld + 4 * c4);
    }
}
#endif

/* dn_state_kernel with each chunk record's parts staged in shared memory by
 * cp.async (every wmma fragment then read from shared memory), the next
 * chunk's part of a step copied while the steps after it run: Wm and U after
 * the vn step, Qg and at after the o step, Kw after the state step (three
 * copy groups in flight, each waited for before its step). The same
 * fragments in the same order: the same bits as dn_state_kernel. grid
 * (DV / DN_SLICE, nv), DN_CK_THREADS threads, dn_staged_smem_floats(DK)
 * floats of dynamic shared memory. */
template <int DK, int DV>
__global__ void __launch_bounds__(DN_CK_THREADS, 1)
    dn_state_staged_kernel(const struct dn_chunk_args p)
{
#ifdef DN_HAVE_TF32
    constexpr unsigned SL = kDnSL, KL = DK + 4, AL = DN_CH + 4;
    float *ss = dn_dyn_smem();        /* DK x SL: St[i][jj], key-major state slice */
    float *vn = ss + DK * SL;         /* DN_CH x SL: v_new of the chunk */
    float *os = vn + DN_CH * SL;      /* DN_CH x SL: o of the chunk, before the copy out */
    float *us = os + DN_CH * SL;      /* DN_CH x SL: U's slice */
    float *wm = us + DN_CH * SL;      /* DN_CH x KL */
    float *qg = wm + DN_CH * KL;      /* DN_CH x KL */
    float *kw = qg + DN_CH * KL;      /* DN_CH x KL */
    float *as = kw + DN_CH * KL;      /* DN_CH x AL */
    const uint32_t h = blockIdx.y, j0 = blockIdx.x * DN_SLICE;
    const size_t rf = dn_chunk_floats(DK, DV);
    float *st = p.state + ((size_t)h * DV + j0) * DK;
    const float *rec0 = p.work + (size_t)h * p.n_chunks * rf;
    /* a record: Qg, Kw, Wm (DN_CH x DK each), U (DN_CH x DV), at (DN_CH x DN_CH) */
    auto copy_a = [&](const float *rec) {
        dn_cp_rows(wm, KL, rec + 2 * DN_CH * DK, DK, DN_CH, DK);
        dn_cp_rows(us, SL, rec + 3 * DN_CH * DK + j0, DV, DN_CH, DN_SLICE);
        cp_commit();
    };
    auto copy_b = [&](const float *rec) {
        dn_cp_rows(qg, KL, rec, DK, DN_CH, DK);
        dn_cp_rows(as, AL, rec + 3 * DN_CH * DK + DN_CH * DV, DN_CH, DN_CH, DN_CH);
        cp_commit();
    };
    auto copy_c = [&](const float *rec) {
        dn_cp_rows(kw, KL, rec + DN_CH * DK, DK, DN_CH, DK);
        cp_commit();
    };
    copy_a(rec0);
    copy_b(rec0);
    copy_c(rec0);
    dn_state_slice<DK>(st, ss, true);
    for (uint32_t c = 0; c < p.n_chunks; c++) {
        const float *rec = rec0 + c * rf;
        const float *next = c + 1 < p.n_chunks ? rec + rf : nullptr;
        cp_wait<2>();
        __syncthreads();
        dn_state_vn<DK>(wm, KL, us, SL, ss, vn);
        __syncthreads();
        if (next)
            copy_a(next);
        else
            cp_commit();
        cp_wait<2>();
        __syncthreads();
        dn_state_o<DK>(qg, KL, as, AL, ss, vn, os);
        __syncthreads();
        if (next)
            copy_b(next);
        else
            cp_commit();
        dn_state_y<DV>(p, os, c * DN_CH, h, j0);
        const float dec = rec[3 * DN_CH * DK + DN_CH * DV + DN_CH * DN_CH];
        cp_wait<2>();
        __syncthreads();
        dn_state_update<DK>(kw, KL, vn, ss, dec);
        __syncthreads();
        if (next)
            copy_c(next);
        else
            cp_commit();
    }
    dn_state_slice<DK>(st, ss, false);
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

/* The gated RMSNorm of the chunked path, in place on y: a warp per (token,
 * head) row of DV floats. */
template <int DV>
__global__ void __launch_bounds__(DN_CK_THREADS) dn_gnorm_kernel(const struct dn_chunk_args p)
{
    constexpr int M = DV / 32;
    const uint32_t lane = threadIdx.x % 32;
    const size_t row = (size_t)blockIdx.x * (DN_CK_THREADS / 32) + threadIdx.x / 32;
    if (row >= (size_t)p.S * p.nv)
        return;
    const size_t off = row * DV; /* rows (s, h) are consecutive: y[s][h * DV ..] */
    float o[M], ss = 0.0f;
#pragma unroll
    for (int m = 0; m < M; m++) {
        o[m] = p.y[off + lane + 32 * m];
        ss += o[m] * o[m];
    }
    const float scale = 1.0f / sqrtf(dn_warp_sum(ss) / (float)DV + p.eps);
#pragma unroll
    for (int m = 0; m < M; m++) {
        const uint32_t j = lane + 32 * m;
        p.y[off + j] = o[m] * scale * p.norm_w[j] * dn_silu(p.z[off + j]);
    }
}

static int dn_check_launch(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return 0;
    log_error("%s launch failed: %s", what, cudaGetErrorString(e));
    return -EIO;
}

extern "C" int cuda_deltanet_conv(float *d_state, const float *d_w, uint32_t K, const float *d_x,
                                  float *d_u, uint32_t C, uint32_t S, cudaStream_t stream)
{
    const uint32_t tiles = (uint32_t)(((uint64_t)S + DN_CONV_TOK - 1) / DN_CONV_TOK);
    if (K == 0 || K > DN_MAX_K || C == 0 || (K > 1 && !d_state) || !d_w ||
        (S && (!d_x || !d_u)) || tiles > 65535) {
        log_error("cuda_deltanet_conv: bad arguments (K %u, max %d; C %u; S %u, max %d)", K,
                  DN_MAX_K, C, S, 65535 * DN_CONV_TOK);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    const dim3 grid((C + DN_CONV_THREADS - 1) / DN_CONV_THREADS, tiles);
    pdl_launch(dn_conv_kernel, grid, DN_CONV_THREADS, 0, stream, d_state, d_w, K, d_x, d_u, C, S);
    return dn_check_launch("cuda_deltanet_conv");
}

static bool dn_heads_args_ok(const float *d_state, const float *d_u, const float *d_b,
                             const float *d_alpha, const float *d_a, const float *d_dt,
                             const float *d_z, const float *d_norm_w, const float *d_y,
                             uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv, uint32_t S)
{
    const bool dk_ok = dk == 16 || dk == 32 || dk == 64 || dk == 128;
    return dk_ok && dv >= 16 && dv <= 128 && dv % 16 == 0 && nk && nv && nv % nk == 0 &&
           nv <= 65535 && d_state && ((uintptr_t)d_state & 15) == 0 && d_a && d_dt && d_norm_w &&
           (!S || (d_u && d_b && d_alpha && d_z && d_y));
}

/* Whether the split kernels can take dv: whole warps per block, at least
 * the two that compute q and k. */
static bool dn_split_fits(uint32_t dv, uint32_t nb)
{
    const uint32_t n_warps = dv / 8;
    return n_warps % nb == 0 && n_warps / nb >= 2;
}

/* The current device's compute capability (10 x major + minor, caps.h) and
 * its multiprocessor count into *sms; -EIO (logged with what) when a query
 * fails, caps.h's codes where it refuses. */
static int dn_device(const char *what, int *cc, int *sms)
{
    const int rc = cuda_caps_get(cc, nullptr);
    if (rc)
        return rc;
    *sms = cuda_caps_sms();
    if (*sms <= 0) {
        log_error("%s: the device's multiprocessors cannot be read", what);
        return -EIO;
    }
    return 0;
}

/* Whether the split conv + heads may read the states before its PDL wait
 * where its caller allows it: LAMINA_CUDA_DN_EARLY not "0" (read at each
 * launch; a measurement's and a test's switch, the same bits either way). */
static bool dn_early_on()
{
    const char *env = getenv("LAMINA_CUDA_DN_EARLY");
    return !(env && env[0] == '0');
}

/* Blocks per value head of the decode kernels into *nb (DN_SPLIT in the file
 * comment), for the current device: 1 below compute capability 9.0, where
 * LAMINA_CUDA_DN_SPLIT is "0" or where dv cannot be split; "2", "4" or "8"
 * ask for that many where dv allows (a test's and a measurement's switch:
 * results are the same bits); otherwise the nb in {1, 2, 4, 8} that leaves
 * the fewest rows on the busiest SM, ceil(nv * nb / SMs) * dv / nb, the
 * smallest of equals. Read at each launch. -EIO when the device query
 * fails. */
static int dn_split_blocks(uint32_t nv, uint32_t dv, const char *what, uint32_t *nb)
{
    *nb = 1;
    const char *env = getenv("LAMINA_CUDA_DN_SPLIT");
    if (env && env[0] == '0')
        return 0;
    int cc = 0, sms = 0;
    const int rc = dn_device(what, &cc, &sms);
    if (rc)
        return rc;
    if (sms <= 0) {
        log_error("%s: the device reports %d multiprocessors", what, sms);
        return -EIO;
    }
    if (cc < 90)
        return 0;
    const uint32_t want = env ? (uint32_t)atoi(env) : 0;
    if (want == 2 || want == 4 || want == 8) {
        *nb = dn_split_fits(dv, want) ? want : 1;
        return 0;
    }
    uint64_t best = ((uint64_t)nv + sms - 1) / sms * dv;
    for (uint32_t n = 2; n <= DN_SPLIT_MAX; n *= 2) {
        const uint64_t rows = ((uint64_t)nv * n + sms - 1) / sms * (dv / n);
        if (dn_split_fits(dv, n) && rows < best) {
            best = rows;
            *nb = n;
        }
    }
    return 0;
}

template <int DK>
static void dn_heads_launch(const struct dn_heads_args &p, uint32_t nb, cudaStream_t stream)
{
    if (nb > 1)
        pdl_launch_cluster(dn_heads_split_kernel<DK>, dim3(p.nv * nb), dim3(4 * p.dv / nb), nb, 0,
                           stream, p);
    else
        pdl_launch(dn_heads_kernel<DK>, dim3(p.nv), dim3(4 * p.dv), 0, stream, p);
}

extern "C" int cuda_deltanet_heads(float *d_state, const float *d_u, const float *d_b,
                                   const float *d_alpha, const float *d_a, const float *d_dt,
                                   const float *d_z, const float *d_norm_w, float *d_y,
                                   uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv, bool tiled,
                                   uint32_t S, float eps, cudaStream_t stream)
{
    if (!dn_heads_args_ok(d_state, d_u, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w, d_y, nk, nv, dk,
                          dv, S)) {
        log_error("cuda_deltanet_heads: bad arguments (dk %u: 16, 32, 64 or 128; dv %u: a multiple "
                  "of 16 up to 128; nk %u, nv %u: nv a multiple of nk; state 16-byte aligned)",
                  dk, dv, nk, nv);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    uint32_t nb = 1;
    const int rc = dn_split_blocks(nv, dv, "cuda_deltanet_heads", &nb);
    if (rc)
        return rc;
    /* several tokens: one block per head unless a split is forced (an H200,
     * 80b shape: split 1.09x faster at S = 1, 0.94-0.96x from S = 16 up) */
    const char *force = getenv("LAMINA_CUDA_DN_SPLIT");
    if (S > 1 && !(force && force[0] >= '2' && force[0] <= '8'))
        nb = 1;
    const struct dn_heads_args p = {d_state, d_u,   d_b, d_alpha, d_a, d_dt, d_z, d_norm_w,
                                    d_y,     nk,    nv,  dv,      S,   tiled, eps};
    switch (dk) {
    case 16:
        dn_heads_launch<16>(p, nb, stream);
        break;
    case 32:
        dn_heads_launch<32>(p, nb, stream);
        break;
    case 64:
        dn_heads_launch<64>(p, nb, stream);
        break;
    default:
        dn_heads_launch<128>(p, nb, stream);
        break;
    }
    return dn_check_launch("cuda_deltanet_heads");
}

template <int DK>
static void dn_conv_heads_launch(const struct dn_heads_args &p, const struct dn_conv_args &c,
                                 uint32_t nb, cudaStream_t stream)
{
    if (nb > 1)
        pdl_launch_cluster(dn_conv_heads_split_kernel<DK>, dim3(p.nv * nb), dim3(4 * p.dv / nb),
                           nb, 0, stream, p, c);
    else
        pdl_launch(dn_conv_heads_kernel<DK>, dim3(p.nv), dim3(4 * p.dv), 0, stream, p, c);
}

/* cuda_deltanet_conv_heads, and with d_yq the rounded y too (-ENOTSUP,
 * nothing launched, where the blocks do not hold whole blocks of 32 rows). */
static int dn_conv_heads(float *d_conv_state, const float *d_conv_w, uint32_t K, const float *d_x,
                         float *d_state, const float *d_b, const float *d_alpha, const float *d_a,
                         const float *d_dt, const float *d_z, const float *d_norm_w, float *d_y,
                         int8_t *d_yq, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                         bool tiled, float eps, bool early, cudaStream_t stream,
                         const char *what)
{
    if (!dn_heads_args_ok(d_state, d_x, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w, d_y, nk, nv, dk,
                          dv, 1) ||
        K == 0 || K > DN_MAX_K || (K > 1 && !d_conv_state) || !d_conv_w || nk > DN_MAX_NK) {
        log_error("%s: bad arguments (K %u, max %d; dk %u: 16, 32, 64 or 128; dv %u: a multiple "
                  "of 16 up to 128; nk %u (max %d), nv %u: nv a multiple of nk; state 16-byte "
                  "aligned)",
                  what, K, DN_MAX_K, dk, dv, nk, DN_MAX_NK, nv);
        return -EINVAL;
    }
    uint32_t nb = 1;
    const int rc = dn_split_blocks(nv, dv, what, &nb);
    if (rc)
        return rc;
    if (d_yq && ((uintptr_t)d_yq % 16 || (dv / nb) % 32 || dv / nb > DN_YQ_ROWS))
        return -ENOTSUP;
    struct dn_heads_args p = {d_state, d_x, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w,
                              d_y,     nk,  nv,  dv,      1,   tiled, eps};
    p.yq = d_yq;
    p.early = early && nb > 1 && dn_early_on();
    const struct dn_conv_args c = {d_conv_state, d_conv_w, d_x, K};
    switch (dk) {
    case 16:
        dn_conv_heads_launch<16>(p, c, nb, stream);
        break;
    case 32:
        dn_conv_heads_launch<32>(p, c, nb, stream);
        break;
    case 64:
        dn_conv_heads_launch<64>(p, c, nb, stream);
        break;
    default:
        dn_conv_heads_launch<128>(p, c, nb, stream);
        break;
    }
    return dn_check_launch(what);
}

extern "C" int cuda_deltanet_conv_heads(float *d_conv_state, const float *d_conv_w, uint32_t K,
                                        const float *d_x, float *d_state, const float *d_b,
                                        const float *d_alpha, const float *d_a, const float *d_dt,
                                        const float *d_z, const float *d_norm_w, float *d_y,
                                        uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                                        bool tiled, float eps, cudaStream_t stream)
{
    return dn_conv_heads(d_conv_state, d_conv_w, K, d_x, d_state, d_b, d_alpha, d_a, d_dt, d_z,
                         d_norm_w, d_y, NULL, nk, nv, dk, dv, tiled, eps, false, stream,
                         "cuda_deltanet_conv_heads");
}

extern "C" int cuda_deltanet_conv_heads_yq(float *d_conv_state, const float *d_conv_w,
                                           uint32_t K, const float *d_x, float *d_state,
                                           const float *d_b, const float *d_alpha,
                                           const float *d_a, const float *d_dt, const float *d_z,
                                           const float *d_norm_w, float *d_y, int8_t *d_yq,
                                           uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                                           bool tiled, float eps, bool early,
                                           cudaStream_t stream)
{
    return dn_conv_heads(d_conv_state, d_conv_w, K, d_x, d_state, d_b, d_alpha, d_a, d_dt, d_z,
                         d_norm_w, d_y, d_yq, nk, nv, dk, dv, tiled, eps, early, stream,
                         "cuda_deltanet_conv_heads_yq");
}

/*
 * The DeltaNet decode input fused with conv + heads (cuda_deltanet_in_conv_heads):
 * one launch does what the layer's stacked input product (mvq.cu) and
 * dn_conv_heads_split_kernel do in two. A thread block cluster per key head g
 * (r = nv / nk value heads of hb blocks each, r * hb <= 8) first computes the
 * rows of the stacked matrix that g's heads read: q and k of g, then per value
 * head v, z, beta and alpha (dn_in_row), rows_g in all, a consecutive share of
 * `per` rows per block, each row with mvq's maths (the activation rounded to
 * int8 per block of 32 in shared memory, lanes_per_row lanes a row taking
 * blocks sub, sub + G, ... in order, the same butterfly): the same bits as
 * the unfused product, written to the same place of dec. A cluster barrier
 * (release / acquire) makes the rows visible to the cluster; then the first
 * ht = 4 * dv / hb threads of each block run dn_conv_heads_split_kernel's
 * step for their head (the head's sum of o^2 over its hb blocks through
 * distributed shared memory, dn_cluster_sum's order), and after that
 * barrier every block of g has read the q and k conv state, so rank 0
 * rewrites it: no counter. Outputs and states equal the two launches' bit
 * for bit.
 * Before the PDL wait each block asks for its rows, its delta state rows
 * and a share of the conv taps in L2 (a thread a row) and loads its first
 * DN_IN_NBUF passes of weight words into registers (tiles of R rows per
 * group of G lanes, U blocks a lane a pass); after it each pass is summed
 * while the others' loads are in flight. Registers for two blocks an SM,
 * so that clusters of 8 find their SMs in a GPC.
 */
#define DN_IN_THREADS 256 /* threads per block of the fused input kernel */
#define DN_IN_U 2         /* weight blocks per lane per pass */
#define DN_IN_R 2         /* rows per lane group per pass */
/* passes of weight registers in flight: four of Q4_0 (5 words a block), two of Q8_0 (9) */
#define DN_IN_NBUF(type) ((type) == QUANT_TYPE_Q4_0 ? 4 : 2)

struct dn_in_args {
    const uint8_t *w;     /* stacked input matrix: q | k | v | z | beta | alpha rows */
    size_t row_bytes;
    const float *x;       /* the normalised activation row, n floats */
    float *dec;           /* one float per row of w (the unfused product's output) */
    uint32_t nbx;         /* blocks of 32 in a row */
    uint32_t rows_g, per; /* rows of a key head's group; rows per block */
    uint32_t hb, ht;      /* blocks per value head; heads threads per block */
};

/* What the tail form (cuda_deltanet_in_tail) adds. */
struct dn_tail_args {
    const int8_t *xq;     /* the row already rounded (mvq::xq_row_bytes layout) or NULL */
    uint32_t rows_all;    /* nk * rows_g */
    bool owners;          /* each head's step in a block named in advance (dn_tail_owner),
                           * which waits for the head's rows; else in the block that
                           * completes them */
    uint32_t pre;         /* product steps whose weights load before the PDL wait */
};

/* Row vi of key head g's group, as its index in the stacked matrix. */
template <int DK>
__device__ __forceinline__ uint32_t dn_in_row(const struct dn_heads_args &p, uint32_t g,
                                              uint32_t vi)
{
    const uint32_t kd = p.nk * DK, vd = p.nv * p.dv, cd = 2 * kd + vd;
    if (vi < DK)
        return g * DK + vi;
    if (vi < 2 * DK)
        return kd + g * DK + (vi - DK);
    const uint32_t t = vi - 2 * DK, per_head = 2 * p.dv + 2, i = t / per_head, o = t % per_head;
    const uint32_t h = p.tiled ? g + i * p.nk : g * (p.nv / p.nk) + i;
    if (o < p.dv)
        return 2 * kd + h * p.dv + o;
    if (o < 2 * p.dv)
        return cd + h * p.dv + (o - p.dv);
    return cd + vd + (o == 2 * p.dv ? 0u : p.nv) + h;
}

/* The rows of pass s of this lane's group (~0u past the block's share),
 * from the block's table of its rows' indices. */
template <int G>
__device__ __forceinline__ void dn_in_rows(const uint32_t *s_rows, uint32_t nr, uint32_t passes,
                                           uint32_t s, uint32_t (&rows)[DN_IN_R])
{
    const uint32_t grp = threadIdx.x / G, tile = s / passes;
    const uint32_t lr0 = (tile * (DN_IN_THREADS / G) + grp) * DN_IN_R;
#pragma unroll
    for (int r = 0; r < DN_IN_R; r++)
        rows[r] = lr0 + r < nr ? s_rows[lr0 + r] : ~0u;
}

template <int TYPE, int G>
__device__ __forceinline__ void dn_in_issue(const struct dn_in_args &a,
                                            const uint32_t (&rows)[DN_IN_R], uint32_t pass,
                                            uint32_t (&v)[DN_IN_U][DN_IN_R][9],
                                            uint32_t (&sh)[DN_IN_U][DN_IN_R])
{
    const uint32_t sub = threadIdx.x % G;
#pragma unroll
    for (int u = 0; u < DN_IN_U; u++)
#pragma unroll
        for (int r = 0; r < DN_IN_R; r++) {
            const uint32_t b = (pass * DN_IN_U + u) * G + sub;
            if (b < a.nbx && rows[r] != ~0u)
                mvq::load_block<TYPE>(a.w + (size_t)rows[r] * a.row_bytes, b, v[u][r], &sh[u][r]);
        }
}

/* Adds pass `pass` of the rows to acc (mvq_kernel's order: blocks in
 * increasing order per lane); after the row's last pass the butterfly over
 * the G lanes, lane r of the group writes row r, acc starts again at 0. */
template <int TYPE, int G>
__device__ __forceinline__ void dn_in_sum(const struct dn_in_args &a,
                                          const uint32_t (&rows)[DN_IN_R], uint32_t pass,
                                          uint32_t passes, const uint32_t (&v)[DN_IN_U][DN_IN_R][9],
                                          const uint32_t (&sh)[DN_IN_U][DN_IN_R],
                                          const int8_t *s_q, const float *s_d, const float *s_s,
                                          float (&acc)[DN_IN_R])
{
    const uint32_t sub = threadIdx.x % G;
#pragma unroll
    for (int u = 0; u < DN_IN_U; u++) {
        const uint32_t b = (pass * DN_IN_U + u) * G + sub;
        if (b >= a.nbx)
            break;
        const int4 *xq = reinterpret_cast<const int4 *>(s_q + b * 32);
        const int4 xa = xq[0], xb = xq[1];
        const float dx = s_d[b], sx = s_s[b];
#pragma unroll
        for (int r = 0; r < DN_IN_R; r++)
            if (rows[r] != ~0u)
                acc[r] += mvq::block_dot<TYPE>(v[u][r], sh[u][r], xa, xb, dx, sx);
    }
    if (pass + 1 < passes)
        return;
#pragma unroll
    for (int r = 0; r < DN_IN_R; r++) {
#pragma unroll
        for (int o = G / 2; o > 0; o >>= 1)
            acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], o);
    }
    if (sub < DN_IN_R) {
        float out = acc[0];
        uint32_t row = rows[0];
#pragma unroll
        for (int r = 1; r < DN_IN_R; r++) {
            out = sub == (uint32_t)r ? acc[r] : out;
            row = sub == (uint32_t)r ? rows[r] : row;
        }
        if (row != ~0u)
            a.dec[row] = out;
    }
#pragma unroll
    for (int r = 0; r < DN_IN_R; r++)
        acc[r] = 0.0f;
}


/* The fused input kernels' dynamic shared memory: the rounded row (levels,
 * scales, sums: mvq's layout) and the block's row indices. */
struct dn_in_smem {
    int8_t *q;
    float *d, *s;
    uint32_t *rows;
};

__device__ __forceinline__ struct dn_in_smem dn_in_carve(int4 *s_dyn, uint32_t nbx)
{
    struct dn_in_smem m;
    m.q = reinterpret_cast<int8_t *>(s_dyn);
    m.d = reinterpret_cast<float *>(m.q + nbx * 32);
    m.s = m.d + nbx;
    m.rows = reinterpret_cast<uint32_t *>(m.s + nbx);
    return m;
}

/* Passes a row takes (DN_IN_U blocks a lane each) and steps (tiles x
 * passes) for nr rows. */
template <int G>
__device__ __forceinline__ uint32_t dn_in_steps(uint32_t nbx, uint32_t nr, uint32_t *passes)
{
    *passes = (nbx + DN_IN_U * G - 1) / (DN_IN_U * G);
    const uint32_t tile_rows = (DN_IN_THREADS / G) * DN_IN_R;
    return (nr + tile_rows - 1) / tile_rows * *passes;
}

/* passes of weight registers in flight per lane group (DN_IN_NBUF) */
template <int TYPE>
__host__ __device__ constexpr int dn_in_nb()
{
    return DN_IN_NBUF(TYPE);
}

/* Steps k0 .. k1 - 1 of the first NB (their rows and weight words into
 * registers): all of them before the PDL wait, or some before and the rest
 * after it. */
template <int TYPE, int G>
__device__ __forceinline__ void dn_in_first(const struct dn_in_args &a, const uint32_t *s_rows,
                                            uint32_t nr, uint32_t passes, uint32_t steps,
                                            uint32_t (&v)[dn_in_nb<TYPE>()][DN_IN_U][DN_IN_R][9],
                                            uint32_t (&sh)[dn_in_nb<TYPE>()][DN_IN_U][DN_IN_R],
                                            uint32_t (&rw)[dn_in_nb<TYPE>()][DN_IN_R],
                                            uint32_t k0 = 0, uint32_t k1 = dn_in_nb<TYPE>())
{
#pragma unroll
    for (int k = 0; k < dn_in_nb<TYPE>(); k++)
        if ((uint32_t)k < steps && (uint32_t)k >= k0 && (uint32_t)k < k1) {
            dn_in_rows<G>(s_rows, nr, passes, k, rw[k]);
            dn_in_issue<TYPE, G>(a, rw[k], k % passes, v[k], sh[k]);
        }
}

/* The activation row into shared memory as mvq_kernel holds it: copied
 * where it comes rounded (xq: levels, scales, sums, the layout of s_q,
 * s_d, s_s), else rounded from a.x (mvq_kernel's maths), eight blocks'
 * loads in flight a warp. After the PDL wait; a barrier follows. */
__device__ __forceinline__ void dn_in_row_in(const struct dn_in_args &a, const int8_t *xq,
                                             int4 *s_dyn, int8_t *s_q, float *s_d, float *s_s)
{
    const uint32_t t = threadIdx.x, warp = t / 32;
    if (xq) {
        const uint2 *src = reinterpret_cast<const uint2 *>(xq);
        uint2 *dst = reinterpret_cast<uint2 *>(s_dyn);
        for (uint32_t k = t; k < a.nbx * 5; k += DN_IN_THREADS)
            dst[k] = __ldcg(src + k);
        return;
    }
    constexpr uint32_t n_warps = DN_IN_THREADS / 32, XB = 8;
    for (uint32_t b0 = warp; b0 < a.nbx; b0 += XB * n_warps) {
        float xv[XB];
#pragma unroll
        for (uint32_t k = 0; k < XB; k++) {
            const uint32_t b = b0 + k * n_warps;
            xv[k] = b < a.nbx ? a.x[b * 32 + t % 32] : 0.0f;
        }
        uint32_t bb[XB];
        bool st[XB];
#pragma unroll
        for (uint32_t k = 0; k < XB; k++) {
            bb[k] = b0 + k * n_warps;
            st[k] = bb[k] < a.nbx;
        }
        mvq::round_blocks<XB>(xv, bb, st, s_q, s_d, s_s);
    }
}

/* The block's rows: every step summed while the next NB steps' loads are
 * in flight (dn_in_sum writes each row at its last pass). */
template <int TYPE, int G>
__device__ __forceinline__ void dn_in_products(const struct dn_in_args &a,
                                               const uint32_t *s_rows, uint32_t nr,
                                               uint32_t passes, uint32_t steps,
                                               uint32_t (&v)[dn_in_nb<TYPE>()][DN_IN_U][DN_IN_R][9],
                                               uint32_t (&sh)[dn_in_nb<TYPE>()][DN_IN_U][DN_IN_R],
                                               uint32_t (&rw)[dn_in_nb<TYPE>()][DN_IN_R],
                                               const int8_t *s_q, const float *s_d,
                                               const float *s_s)
{
    constexpr int NB = dn_in_nb<TYPE>();
    float acc[DN_IN_R];
#pragma unroll
    for (int r = 0; r < DN_IN_R; r++)
        acc[r] = 0.0f;
    for (uint32_t s0 = 0; s0 < steps; s0 += NB) {
#pragma unroll
        for (int k = 0; k < NB; k++) {
            const uint32_t s1 = s0 + k;
            if (s1 >= steps)
                break;
            dn_in_sum<TYPE, G>(a, rw[k], s1 % passes, passes, v[k], sh[k], s_q, s_d, s_s, acc);
            if (s1 + NB < steps) {
                dn_in_rows<G>(s_rows, nr, passes, s1 + NB, rw[k]);
                dn_in_issue<TYPE, G>(a, rw[k], (s1 + NB) % passes, v[k], sh[k]);
            }
        }
    }
}

template <int DK, int TYPE, int G>
__global__ void __launch_bounds__(DN_IN_THREADS, 2)
    dn_in_conv_heads_kernel(const struct dn_heads_args p, const struct dn_conv_args c,
                            const struct dn_in_args a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int NC = DK / 16, NQ = DK >= 32 ? DK / 32 : 1;
    extern __shared__ int4 s_dyn[];
    const struct dn_in_smem sm = dn_in_carve(s_dyn, a.nbx);
    int8_t *s_q = sm.q;
    float *s_d = sm.d, *s_s = sm.s;
    uint32_t *s_rows = sm.rows;
    __shared__ float4 qs[DK / 4], ks[DK / 4];
    __shared__ float sc[2];
    __shared__ float red[16];
    const uint32_t C = cg::this_cluster().num_blocks(), rank = cg::this_cluster().block_rank();
    const uint32_t g = blockIdx.x / C, i = rank / a.hb, bsub = rank % a.hb;
    const uint32_t h = p.tiled ? g + i * p.nk : g * (p.nv / p.nk) + i;
    const uint32_t t = threadIdx.x, warp = t / 32, sub = t % 4;
    const bool act = t < a.ht;
    const uint32_t j = act ? (bsub * a.ht + t) / 4 : 0;
    const uint32_t r0 = rank * a.per;
    const uint32_t nr = r0 < a.rows_g ? min(a.per, a.rows_g - r0) : 0;
    uint32_t passes;
    const uint32_t steps = dn_in_steps<G>(a.nbx, nr, &passes);
    float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);

    /* before the wait: the block's rows and state rows in L2 (a thread a
     * row), the conv taps' share, decay and dt; NB passes of weights in
     * registers */
    for (uint32_t lr = t; lr < nr; lr += DN_IN_THREADS) {
        const uint32_t row = dn_in_row<DK>(p, g, r0 + lr);
        s_rows[lr] = row;
        pdl_prefetch_l2(a.w + (size_t)row * a.row_bytes, a.row_bytes);
    }
    if (act && t % 4 == 0)
        pdl_prefetch_l2(srow, DK * sizeof(float));
    if (t == 0) {
        dn_prefetch_taps<DK>(p, c);
        if (blockIdx.x == 0)
            pdl_prefetch_l2(p.a, p.nv * sizeof(float)), pdl_prefetch_l2(p.dt, p.nv * sizeof(float));
    }
    /* NB passes of registers (the heads' phase needs more registers than
     * the product's two-row passes, so the product may hold several) */
    __syncthreads(); /* s_rows */
    constexpr int NB = dn_in_nb<TYPE>();
    uint32_t v[NB][DN_IN_U][DN_IN_R][9], sh[NB][DN_IN_U][DN_IN_R], rw[NB][DN_IN_R];
    dn_in_first<TYPE, G>(a, s_rows, nr, passes, steps, v, sh, rw);
    pdl_wait(); /* x comes from the kernel before; dec and y may still be read */
    pdl_trigger();
    dn_in_row_in(a, nullptr, s_dyn, s_q, s_d, s_s);
    __syncthreads();
    dn_in_products<TYPE, G>(a, s_rows, nr, passes, steps, v, sh, rw, s_q, s_d, s_s);
    /* the cluster's rows written (release) and visible here (acquire); every
     * block of the cluster runs from here on (distributed shared memory) */
    cg::this_cluster().sync();

    /* conv + heads: dn_conv_heads_split_kernel's step for head h */
    float4 st[NC];
#pragma unroll
    for (int m = 0; m < NC; m++)
        st[m] = act ? srow[sub + 4 * m] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float wj = act ? p.norm_w[j] : 0.0f;
    struct dn_tok<DK> cur = {};
    float nqk[NQ][DN_MAX_K - 1];
    if (act)
        dn_conv_in<DK, false>(p, c, h, g, j, nullptr, cur, nqk);
    const float o = dn_rows<DK>(p, cur, st, qs, ks, sc);
    const float total = dn_cluster_sum_at(act ? dn_warp_sq(o) : 0.0f, red, p.dv / 8, i * a.hb,
                                          a.hb, bsub * (a.ht / 32) + warp, act);
    if (!act)
        return;
    dn_out(p, h, 0, j, o, total, cur.z, wj);
    if (rank == 0) /* every block of g has read the q and k conv state */
        dn_conv_store_qk<DK>(p, c, g, nqk);
#pragma unroll
    for (int m = 0; m < NC; m++)
        srow[sub + 4 * m] = st[m];
#else
    __trap(); /* launched on sm_90 and later only (caps.h): never silently nothing */
#endif
}

/* Blocks per value head of the fused input kernel for this device and shape
 * (0: the fused kernel does not take it): the largest hb with r * hb <= 8
 * blocks a cluster, whole warps of at least two per head block
 * (dn_split_fits), at most DN_IN_THREADS heads threads, nv * hb at most the
 * SM count and every cluster resident at once. */
template <int DK, int TYPE, int G>
static uint32_t dn_in_blocks(uint32_t nk, uint32_t nv, uint32_t dv, size_t smem, int sms)
{
    /* the clusters of cs blocks resident at once, per device, cluster size and
     * shared memory (asked once; backends on several threads share it) */
    static std::mutex lock;
    static struct {
        int dev;
        uint32_t csize;
        size_t smem;
        int clusters;
    } seen[16];
    static int n_seen = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    const uint32_t r = nv / nk;
    for (uint32_t hb = 8; hb >= 1; hb /= 2) {
        if (r * hb > 8 || !dn_split_fits(dv, hb) || 4 * dv / hb > DN_IN_THREADS ||
            (hb > 1 && (uint64_t)nv * hb > (uint64_t)sms))
            continue;
        const uint32_t cs = r * hb;
        int clusters = -1;
        std::lock_guard<std::mutex> guard(lock);
        for (int k = 0; k < n_seen; k++)
            if (seen[k].dev == dev && seen[k].csize == cs && seen[k].smem == smem)
                clusters = seen[k].clusters;
        if (clusters < 0) {
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = cs;
            attr.val.clusterDim.y = 1;
            attr.val.clusterDim.z = 1;
            cfg.gridDim = dim3(nk * cs);
            cfg.blockDim = dim3(DN_IN_THREADS);
            cfg.dynamicSmemBytes = smem;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            int n = 0;
            const cudaError_t e =
                cudaOccupancyMaxActiveClusters(&n, dn_in_conv_heads_kernel<DK, TYPE, G>, &cfg);
            if (e != cudaSuccess)
                (void)cudaGetLastError();
            clusters = e == cudaSuccess ? n : 0;
            if (n_seen < 16)
                seen[n_seen++] = {dev, cs, smem, clusters};
        }
        if ((uint32_t)clusters >= nk)
            return hb;
    }
    return 0;
}

template <int DK, int TYPE, int G>
static int dn_in_launch(const struct dn_heads_args &p, const struct dn_conv_args &c,
                        struct dn_in_args a, int sms, cudaStream_t stream)
{
    /* shared memory: the rounded row, its scales, and the row table (at
     * most rows_g: one block a cluster) */
    const uint32_t rows_g = 2 * DK + p.nv / p.nk * (2 * p.dv + 2);
    const size_t smem = (size_t)a.nbx * 32 + 2 * sizeof(float) * a.nbx;
    const uint32_t hb = dn_in_blocks<DK, TYPE, G>(p.nk, p.nv, p.dv,
                                                  smem + (size_t)rows_g * sizeof(uint32_t), sms);
    if (!hb)
        return -ENOTSUP;
    const uint32_t cs = p.nv / p.nk * hb;
    a.hb = hb;
    a.ht = 4 * p.dv / hb;
    a.rows_g = rows_g;
    a.per = (a.rows_g + cs - 1) / cs;
    const size_t smem_all = smem + (size_t)a.per * sizeof(uint32_t);
    pdl_launch_cluster(dn_in_conv_heads_kernel<DK, TYPE, G>, dim3(p.nk * cs), dim3(DN_IN_THREADS),
                       cs, smem_all, stream, p, c, a);
    return dn_check_launch("cuda_deltanet_in_conv_heads");
}

template <int DK, int TYPE, int G>
static int dn_tail_launch(const struct dn_heads_args &p, const struct dn_conv_args &c,
                          struct dn_in_args a, struct dn_tail_args ta, int sms,
                          cudaStream_t stream);

/* The fused input's launch for G lanes a row: the cluster form, or with ta
 * the tail form. */
template <int DK, int TYPE, int G>
static int dn_in_form(const struct dn_heads_args &p, const struct dn_conv_args &c,
                      const struct dn_in_args &a, const struct dn_tail_args *ta, int sms,
                      cudaStream_t stream)
{
    return ta ? dn_tail_launch<DK, TYPE, G>(p, c, a, *ta, sms, stream)
              : dn_in_launch<DK, TYPE, G>(p, c, a, sms, stream);
}

template <int DK, int TYPE>
static int dn_in_go(const struct dn_heads_args &p, const struct dn_conv_args &c,
                    const struct dn_in_args &a, const struct dn_tail_args *ta, int sms,
                    cudaStream_t stream)
{
    switch (mvq::lanes_per_row(a.nbx)) {
    case 32: return dn_in_form<DK, TYPE, 32>(p, c, a, ta, sms, stream);
    case 16: return dn_in_form<DK, TYPE, 16>(p, c, a, ta, sms, stream);
    default: return dn_in_form<DK, TYPE, 8>(p, c, a, ta, sms, stream);
    }
}

template <int TYPE>
static int dn_in_dk(uint32_t dk, const struct dn_heads_args &p, const struct dn_conv_args &c,
                    const struct dn_in_args &a, const struct dn_tail_args *ta, int sms,
                    cudaStream_t stream)
{
    switch (dk) {
    case 16: return dn_in_go<16, TYPE>(p, c, a, ta, sms, stream);
    case 32: return dn_in_go<32, TYPE>(p, c, a, ta, sms, stream);
    case 64: return dn_in_go<64, TYPE>(p, c, a, ta, sms, stream);
    default: return dn_in_go<128, TYPE>(p, c, a, ta, sms, stream);
    }
}

/*
 * The DeltaNet decode input with conv + heads as tails of the product
 * (cuda_deltanet_in_tail): the product of the fused kernel above without
 * its clusters. The key heads' rows (dn_in_row's order within a key head,
 * the key heads one after another) are cut into consecutive shares of `per`
 * rows, one a block, `per` a whole number of the block's row tiles and as
 * many blocks as two an SM hold: the product runs as wide as the plain
 * int8 product. Value head i of key head g reads g's q and k rows and its
 * own v, z, beta and alpha rows; each block, once its rows are written and
 * fenced, counts itself in dn_in_arrived of every value head whose rows it
 * wrote, and the head's conv + heads step (dn_tail_head:
 * dn_conv_heads_split_kernel's step, the head's rows in passes of 64, its
 * sum of o^2 over the head's warps in order) runs in one block of the
 * launch: no cluster, no launch of its own. Which block:
 *   - owners (the default): head h's owner, dn_tail_owner, the heads spread
 *     over the grid, after its own rows waits (thread 0 polling with
 *     acquire loads) until the count reaches the number of blocks that write
 *     h's rows (dn_tail_want), at most DN_TAIL_WAIT_NS, then counts itself as
 *     one arrival more; the arrival that completes the count (the owner's,
 *     unless it stopped waiting first) sets it back to 0 and its block runs
 *     the step: one head a block while the heads are no more than the
 *     blocks, and no block waits without bound for one that may not be
 *     resident;
 *   - completing blocks (LAMINA_CUDA_DN_TAIL=last): the block whose arrival
 *     completes the head's count sets it back to 0 and runs the step. No
 *     block waits, but a block that completes several heads runs their
 *     steps one after another (a block of g's q and k rows that ends last
 *     completes all of g's heads).
 * The q and k conv state of g is rewritten by the last of g's value heads'
 * steps to have read it (dn_conv_qk_readers, r readers). Outputs and states
 * equal the product then cuda_deltanet_conv_heads(_yq) bit for bit, either
 * way. Opt-in: on an H200 it took 42.7 us a DeltaNet layer in the decode
 * graph against 9.9 for the product and the split kernel (tg 309 against
 * 517 tok/s, docs/perf.md): a head's step in one block is several times the
 * split kernel's critical path, whose cluster spreads a head over four
 * blocks and reads the state before its PDL wait.
 */

/* Value heads of the arrival counters (nv at most). */
#define DN_TAIL_MAX_NV 4096
/* (key head, value head) pairs one block may count itself in */
#define DN_TAIL_MAX_PAIRS 64

/* Per value head: blocks of the current dn_in_tail_kernel launch that have
 * written rows the head reads; the last one sets it back to 0 (one launch
 * at a time per device, as dn_conv_readers). */
__device__ unsigned int dn_in_arrived[DN_TAIL_MAX_NV];

/* Whether the rows [lo, hi) of a key head's group (hi > lo) hold rows that
 * value head i of it reads: q and k, or i's v, z, beta and alpha. */
template <int DK>
__device__ __forceinline__ bool dn_tail_reads(const struct dn_heads_args &p, uint32_t lo,
                                              uint32_t hi, uint32_t i)
{
    const uint32_t ph = 2 * p.dv + 2, h0 = 2 * DK + i * ph;
    return lo < 2 * DK || (lo < h0 + ph && hi > h0);
}

/* Block b's rows of key head g's group, [*lo, *hi) in the group's order
 * (empty: *lo == *hi). */
__device__ __forceinline__ void dn_tail_span(const struct dn_in_args &a,
                                             const struct dn_tail_args &ta, uint32_t b,
                                             uint32_t g, uint32_t *lo, uint32_t *hi)
{
    const uint32_t b0 = b * a.per, b1 = min(b0 + a.per, ta.rows_all);
    const uint32_t g0 = g * a.rows_g, g1 = g0 + a.rows_g;
    const uint32_t l = max(b0, g0), u = min(b1, g1);
    *lo = l < u ? l - g0 : 0;
    *hi = l < u ? u - g0 : 0;
}

/* How many blocks write rows that value head i of key head g reads. */
template <int DK>
__device__ __forceinline__ uint32_t dn_tail_want(const struct dn_heads_args &p,
                                                 const struct dn_in_args &a,
                                                 const struct dn_tail_args &ta, uint32_t g,
                                                 uint32_t i)
{
    const uint32_t first = g * a.rows_g / a.per, last = ((g + 1) * a.rows_g - 1) / a.per;
    uint32_t n = 0;
    for (uint32_t b = first; b <= last; b++) {
        uint32_t lo, hi;
        dn_tail_span(a, ta, b, g, &lo, &hi);
        n += lo < hi && dn_tail_reads<DK>(p, lo, hi, i);
    }
    return n;
}

/* Value head i of key head g: its conv + heads step by the whole block
 * (DN_IN_THREADS threads, the head's rows in passes of DN_IN_THREADS / 4,
 * at most two), dn_conv_heads_split_kernel's maths in its order: the same
 * bits. After the block's last arrival (the other blocks' rows seen
 * through L2). */
template <int DK>
__device__ __noinline__ void dn_tail_head(const struct dn_heads_args &p,
                                             const struct dn_conv_args &c, uint32_t g, uint32_t i,
                                             float4 *qs, float4 *ks, float *sc, float *red)
{
    constexpr int NC = DK / 16, NQ = DK >= 32 ? DK / 32 : 1, PR = DN_IN_THREADS / 4;
    const uint32_t t = threadIdx.x, warp = t / 32, sub = t % 4;
    const uint32_t h = p.tiled ? g + i * p.nk : g * (p.nv / p.nk) + i;
    const uint32_t np = (p.dv + PR - 1) / PR; /* 1 or 2 (dv <= 128) */
    float ov[2] = {0.0f, 0.0f}, zv[2] = {0.0f, 0.0f}, wv[2] = {0.0f, 0.0f};
    /* warps 0 and 1: the new q and k conv state, kept here over the step (registers) */
    __shared__ float s_nqk[64][NQ][DN_MAX_K - 1];
#pragma unroll
    for (uint32_t ps = 0; ps < 2; ps++) {
        if (ps >= np)
            break;
        const uint32_t jj = ps * PR + t / 4;
        const bool act = jj < p.dv;
        const uint32_t j = act ? jj : 0;
        float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);
        struct dn_tok<DK> cur = {};
        if (act) {
            float nqk[NQ][DN_MAX_K - 1];
            dn_conv_in<DK, false>(p, c, h, g, j, nullptr, cur, nqk);
            if (warp <= 1 && ps + 1 == np)
#pragma unroll
                for (int m = 0; m < NQ; m++)
#pragma unroll
                    for (int k = 0; k + 1 < DN_MAX_K; k++)
                        s_nqk[t][m][k] = nqk[m][k];
        }
        float4 st[NC];
#pragma unroll
        for (int m = 0; m < NC; m++)
            st[m] = act ? __ldcg(srow + sub + 4 * m) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float o = dn_rows<DK>(p, cur, st, qs, ks, sc);
        const float ss = dn_warp_sq(act ? o : 0.0f);
        if (act && t % 32 == 0)
            red[ps * (PR / 8) + warp] = ss;
        if (act) {
#pragma unroll
            for (int m = 0; m < NC; m++)
                srow[sub + 4 * m] = st[m];
        }
        ov[ps] = o;
        zv[ps] = cur.z;
        wv[ps] = act ? p.norm_w[j] : 0.0f;
        __syncthreads(); /* qs, ks and sc read; red written */
    }
    /* warps 0 and 1 have read g's q and k conv state (every pass) */
    unsigned ticket = 0u;
    if (warp <= 1)
        ticket = dn_conv_ticket(2 * g + warp);
    float total = 0.0f;
    for (uint32_t w = 0; w < p.dv / 8; w++)
        total += red[w];
#pragma unroll
    for (int ps = 0; ps < 2; ps++) {
        if ((uint32_t)ps >= np)
            break;
        const uint32_t jj = ps * PR + t / 4;
        const bool act = jj < p.dv;
        const float yj = act ? dn_out(p, h, 0, jj, ov[ps], total, zv[ps], wv[ps]) : 0.0f;
        if (p.yq)
            dn_out_q(p, h, ps * PR, min((uint32_t)PR, p.dv - ps * PR), yj);
        __syncthreads(); /* dn_out_q's rows read; red read */
    }
    if (warp <= 1 && dn_conv_is_last(2 * g + warp, ticket, p.nv / p.nk)) {
        float nqk[NQ][DN_MAX_K - 1];
#pragma unroll
        for (int m = 0; m < NQ; m++)
#pragma unroll
            for (int k = 0; k + 1 < DN_MAX_K; k++)
                nqk[m][k] = s_nqk[t][m][k];
        dn_conv_store_qk<DK>(p, c, g, nqk);
    }
}

/* The block that runs value head h's step with owners: spread over the
 * grid (nv heads over `blocks` blocks, in order). */
__device__ __forceinline__ uint32_t dn_tail_owner(uint32_t h, uint32_t nv, uint32_t blocks)
{
    return (uint32_t)((uint64_t)h * blocks / nv);
}

__device__ __forceinline__ uint32_t dn_ld_acquire(const unsigned int *p)
{
    uint32_t v;
    const size_t g = __cvta_generic_to_global(p);
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(g) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long dn_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* How long an owner waits for a head's rows before it counts itself and
 * leaves the step to the block that completes the count (ns). */
#define DN_TAIL_WAIT_NS 100000ull

/* Thread 0 of head h's owner: waits (acquire loads) until the `want` blocks
 * that write the head's rows have counted themselves, or DN_TAIL_WAIT_NS
 * have passed, then counts itself as one more arrival; whether that
 * completed the count (want + 1): then the owner runs the step, else the
 * block whose arrival completes it does. So no block waits for one that
 * may not be resident (a grid wider than the SMs hold, an SM's shared
 * memory split, MPS): at worst the wait is spent and the completing block
 * runs the step, as with LAMINA_CUDA_DN_TAIL=last. */
__device__ __forceinline__ bool dn_tail_wait(uint32_t h, uint32_t want)
{
    const unsigned long long t0 = dn_ns();
    while (dn_ld_acquire(&dn_in_arrived[h]) < want && dn_ns() - t0 < DN_TAIL_WAIT_NS)
        ;
    if (atomicAdd(&dn_in_arrived[h], 1u) != want)
        return false;
    atomicExch(&dn_in_arrived[h], 0u); /* every arrival of this launch is in */
    __threadfence();
    return true;
}

/* Owner form: the block's heads (those dn_tail_owner gives it), each after
 * its rows are in (its state rows were asked for in L2 before the PDL wait). */
template <int DK>
__device__ __forceinline__ void dn_tail_owned(const struct dn_heads_args &p,
                                              const struct dn_conv_args &c,
                                              const struct dn_in_args &a,
                                              const struct dn_tail_args &ta, float4 *qs,
                                              float4 *ks, float *sc, float *red)
{
    const uint32_t b = blockIdx.x, blocks = gridDim.x, r = p.nv / p.nk;
    /* heads h with dn_tail_owner(h) == b: from ceil(b nv / blocks) */
    __shared__ bool s_run;
    for (uint32_t h = (uint32_t)(((uint64_t)b * p.nv + blocks - 1) / blocks);
         h < p.nv && dn_tail_owner(h, p.nv, blocks) == b; h++) {
        const uint32_t g = p.tiled ? h % p.nk : h / r, i = p.tiled ? h / p.nk : h % r;
        if (threadIdx.x == 0)
            s_run = dn_tail_wait(h, dn_tail_want<DK>(p, a, ta, g, i));
        __syncthreads();
        const bool run = s_run;
        __syncthreads(); /* s_run read before the next head's wait writes it */
        if (!run)
            continue; /* a later arrival completes the count and runs the step */
        __threadfence(); /* the other blocks' rows, read through L2 */
        dn_tail_head<DK>(p, c, g, i, qs, ks, sc, red);
    }
}

template <int DK, int TYPE, int G>
__global__ void __launch_bounds__(DN_IN_THREADS, 2)
    dn_in_tail_kernel(const struct dn_heads_args p, const struct dn_conv_args c,
                      const struct dn_in_args a, const struct dn_tail_args ta)
{
    extern __shared__ int4 s_dyn[];
    const struct dn_in_smem sm = dn_in_carve(s_dyn, a.nbx);
    __shared__ uint32_t s_pairs[DN_TAIL_MAX_PAIRS]; /* (g, i) this block completes */
    __shared__ uint32_t s_n_pairs;
    __shared__ float4 qs[DK / 4], ks[DK / 4]; /* the heads' step's */
    __shared__ float sc[2], red[16];
    const uint32_t t = threadIdx.x, r = p.nv / p.nk;
    const uint32_t r0 = blockIdx.x * a.per;
    const uint32_t nr = r0 < ta.rows_all ? min(a.per, ta.rows_all - r0) : 0;
    uint32_t passes;
    const uint32_t steps = dn_in_steps<G>(a.nbx, nr, &passes);

    /* before the wait: the block's rows in L2 (a thread a row), its share of
     * the delta state and of the conv taps, decay and dt; NB passes of
     * weights in registers */
    for (uint32_t lr = t; lr < nr; lr += DN_IN_THREADS) {
        const uint32_t gr = r0 + lr, row = dn_in_row<DK>(p, gr / a.rows_g, gr % a.rows_g);
        sm.rows[lr] = row;
        pdl_prefetch_l2(a.w + (size_t)row * a.row_bytes, a.row_bytes);
    }
    if (t == 0) {
        const size_t bytes = (size_t)p.nv * p.dv * DK * sizeof(float);
        const size_t share = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~(size_t)15;
        const size_t off = (size_t)blockIdx.x * share;
        if (off < bytes)
            pdl_prefetch_l2(reinterpret_cast<const uint8_t *>(p.state) + off,
                            bytes - off < share ? bytes - off : share);
        dn_prefetch_taps<DK>(p, c);
        if (blockIdx.x == 0)
            pdl_prefetch_l2(p.a, p.nv * sizeof(float)), pdl_prefetch_l2(p.dt, p.nv * sizeof(float));
        s_n_pairs = 0;
    }
    __syncthreads(); /* s_rows */
    constexpr int NB = dn_in_nb<TYPE>();
    uint32_t v[NB][DN_IN_U][DN_IN_R][9], sh[NB][DN_IN_U][DN_IN_R], rw[NB][DN_IN_R];
    /* ta.pre steps' weights before the wait (loads in flight there slow the
     * kernel running beside this one), the others' after it */
    dn_in_first<TYPE, G>(a, sm.rows, nr, passes, steps, v, sh, rw, 0, ta.pre);
    pdl_wait(); /* x comes from the kernel before; dec and y may still be read */
    pdl_trigger();
    dn_in_first<TYPE, G>(a, sm.rows, nr, passes, steps, v, sh, rw, ta.pre);
    dn_in_row_in(a, ta.xq, s_dyn, sm.q, sm.d, sm.s);
    __syncthreads();
    dn_in_products<TYPE, G>(a, sm.rows, nr, passes, steps, v, sh, rw, sm.q, sm.d, sm.s);

    /* the block's arrival at every value head whose rows it wrote */
    __threadfence(); /* this thread's rows before the block's count */
    __syncthreads();
    if (nr) {
        const uint32_t g0 = r0 / a.rows_g, g1 = (r0 + nr - 1) / a.rows_g;
        for (uint32_t q = t; q < (g1 - g0 + 1) * r; q += DN_IN_THREADS) {
            const uint32_t g = g0 + q / r, i = q % r;
            uint32_t lo, hi;
            dn_tail_span(a, ta, blockIdx.x, g, &lo, &hi);
            if (lo >= hi || !dn_tail_reads<DK>(p, lo, hi, i))
                continue;
            const uint32_t h = p.tiled ? g + i * p.nk : g * r + i;
            /* owners: the owner counts as one arrival more (dn_tail_wait), and a
             * block runs the step only where the owner stopped waiting before it */
            const uint32_t want = dn_tail_want<DK>(p, a, ta, g, i) + (ta.owners ? 1u : 0u);
            if (atomicAdd(&dn_in_arrived[h], 1u) == want - 1) {
                atomicExch(&dn_in_arrived[h], 0u);
                __threadfence(); /* the acquire side, before the block's barrier */
                s_pairs[atomicAdd(&s_n_pairs, 1u)] = g * r + i;
            }
        }
    }
    __syncthreads();
    const uint32_t n_pairs = s_n_pairs;
    if (n_pairs)
        __threadfence(); /* the other blocks' rows, read through L2 */
    for (uint32_t k = 0; k < n_pairs; k++)
        dn_tail_head<DK>(p, c, s_pairs[k] / r, s_pairs[k] % r, qs, ks, sc, red);
    if (ta.owners)
        dn_tail_owned<DK>(p, c, a, ta, qs, ks, sc, red);
}

template <int DK, int TYPE, int G>
static int dn_tail_launch(const struct dn_heads_args &p, const struct dn_conv_args &c,
                          struct dn_in_args a, struct dn_tail_args ta, int sms,
                          cudaStream_t stream)
{
    const uint32_t rows_g = 2 * DK + p.nv / p.nk * (2 * p.dv + 2);
    const uint32_t tile_rows = (DN_IN_THREADS / G) * DN_IN_R;
    const uint64_t rows_all = (uint64_t)p.nk * rows_g;
    /* shares of whole tiles, as many blocks as two an SM hold */
    const uint64_t slots = 2 * (uint64_t)sms;
    uint64_t per = (rows_all + slots - 1) / slots;
    per = (per + tile_rows - 1) / tile_rows * tile_rows;
    const uint64_t blocks = (rows_all + per - 1) / per;
    /* the (key head, value head) pairs a block may count itself in */
    const uint64_t groups = (per + rows_g - 1) / rows_g + 1;
    if (rows_all > UINT32_MAX || per > 4096 || groups * (p.nv / p.nk) > DN_TAIL_MAX_PAIRS)
        return -ENOTSUP;
    a.rows_g = rows_g;
    a.per = (uint32_t)per;
    ta.rows_all = (uint32_t)rows_all;
    const size_t smem = (size_t)a.nbx * 32 + 2 * sizeof(float) * a.nbx + per * sizeof(uint32_t);
    const int rc = cuda_caps_allow_smem((const void *)dn_in_tail_kernel<DK, TYPE, G>, smem,
                                        "cuda_deltanet_in_tail");
    if (rc)
        return rc;
    /* owners (LAMINA_CUDA_DN_TAIL=last, read at each launch: the completing
     * blocks run the steps) */
    const char *form = getenv("LAMINA_CUDA_DN_TAIL");
    ta.owners = !(form && !strcmp(form, "last"));
    /* LAMINA_CUDA_DN_TAIL_PRE=N (read at each launch): the first N steps' weights
     * into registers before the PDL wait (default 1, as the plain products hold
     * one tile; at most the registers' dn_in_nb) */
    const char *pre = getenv("LAMINA_CUDA_DN_TAIL_PRE");
    const long pv = pre ? strtol(pre, NULL, 10) : 1;
    ta.pre = pv < 0 ? 0u : pv > dn_in_nb<TYPE>() ? (uint32_t)dn_in_nb<TYPE>() : (uint32_t)pv;
    pdl_launch(dn_in_tail_kernel<DK, TYPE, G>, dim3((uint32_t)blocks), dim3(DN_IN_THREADS), smem,
               stream, p, c, a, ta);
    return dn_check_launch("cuda_deltanet_in_tail");
}

/* Both fused inputs' entry: the cluster form (tail false: no rounded row
 * in or y out) or the tail form. */
static int dn_in_fused(uint32_t type, const void *d_w, size_t row_bytes, uint32_t n,
                       const float *d_x, const int8_t *d_xq, float *d_dec, float *d_conv_state,
                       const float *d_conv_w, uint32_t K, float *d_state, const float *d_a,
                       const float *d_dt, const float *d_norm_w, float *d_y, int8_t *d_yq,
                       uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv, bool tiled, float eps,
                       bool tail, cudaStream_t stream)
{
    const char *what = tail ? "cuda_deltanet_in_tail" : "cuda_deltanet_in_conv_heads";
    const size_t kd = (size_t)nk * dk, vd = (size_t)nv * dv, cd = 2 * kd + vd;
    float *z = d_dec ? d_dec + cd : NULL, *beta = z ? z + vd : NULL;
    float *alpha = beta ? beta + nv : NULL;
    if (!dn_heads_args_ok(d_state, d_dec, beta, alpha, d_a, d_dt, z, d_norm_w, d_y, nk, nv, dk,
                          dv, 1) ||
        K == 0 || K > DN_MAX_K || (K > 1 && !d_conv_state) || !d_conv_w || !d_w ||
        (!d_x && !d_xq) || n == 0 || n % 32 || row_bytes == 0) {
        log_error("%s: bad arguments (K %u, max %d; dk %u, dv %u, nk %u, nv %u; n %u: a "
                  "multiple of 32; the row as floats%s)", what, K, DN_MAX_K, dk, dv, nk, nv, n,
                  tail ? " or rounded" : "");
        return -EINVAL;
    }
    const char *split = getenv("LAMINA_CUDA_DN_SPLIT");
    const uint64_t rows = cd + vd + 2 * (uint64_t)nv;
    /* the tail form's device counters: key heads and value heads at most */
    if ((!tail && split && split[0] == '0') || (tail && (nk > DN_MAX_NK || nv > DN_TAIL_MAX_NV)) ||
        (type != QUANT_TYPE_Q4_0 && type != QUANT_TYPE_Q8_0) || n > 16384 ||
        (!d_xq && ((uintptr_t)d_x & 3)) || ((uintptr_t)d_xq & 15) || ((uintptr_t)d_yq & 15) ||
        (d_yq && dv % 32) || !cuda_mvq_pays(n, rows))
        return -ENOTSUP;
    int cc = 0, sms = 0;
    const int rc = dn_device(what, &cc, &sms);
    if (rc)
        return rc;
    if (cc < 90 || sms <= 0)
        return -ENOTSUP;
    struct dn_heads_args p = {d_state, d_dec, beta, alpha, d_a, d_dt, z, d_norm_w,
                              d_y,     nk,    nv,   dv,    1,   tiled, eps};
    p.yq = d_yq;
    const struct dn_conv_args c = {d_conv_state, d_conv_w, d_dec, K};
    struct dn_in_args a = {};
    a.w = static_cast<const uint8_t *>(d_w);
    a.row_bytes = row_bytes;
    a.x = d_x;
    a.dec = d_dec;
    a.nbx = n / 32;
    struct dn_tail_args ta = {};
    ta.xq = d_xq;
    const struct dn_tail_args *tp = tail ? &ta : nullptr;
    return type == QUANT_TYPE_Q4_0 ? dn_in_dk<QUANT_TYPE_Q4_0>(dk, p, c, a, tp, sms, stream)
                                   : dn_in_dk<QUANT_TYPE_Q8_0>(dk, p, c, a, tp, sms, stream);
}

extern "C" int cuda_deltanet_in_conv_heads(uint32_t type, const void *d_w, size_t row_bytes,
                                           uint32_t n, const float *d_x, float *d_dec,
                                           float *d_conv_state, const float *d_conv_w,
                                           uint32_t K, float *d_state, const float *d_a,
                                           const float *d_dt, const float *d_norm_w, float *d_y,
                                           uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                                           bool tiled, float eps, cudaStream_t stream)
{
    if (!d_x) {
        log_error("cuda_deltanet_in_conv_heads: bad arguments (no activation row)");
        return -EINVAL;
    }
    return dn_in_fused(type, d_w, row_bytes, n, d_x, NULL, d_dec, d_conv_state, d_conv_w, K,
                       d_state, d_a, d_dt, d_norm_w, d_y, NULL, nk, nv, dk, dv, tiled, eps, false,
                       stream);
}

extern "C" int cuda_deltanet_in_tail(uint32_t type, const void *d_w, size_t row_bytes,
                                     uint32_t n, const float *d_x, const int8_t *d_xq,
                                     float *d_dec, float *d_conv_state, const float *d_conv_w,
                                     uint32_t K, float *d_state, const float *d_a,
                                     const float *d_dt, const float *d_norm_w, float *d_y,
                                     int8_t *d_yq, uint32_t nk, uint32_t nv, uint32_t dk,
                                     uint32_t dv, bool tiled, float eps, cudaStream_t stream)
{
    return dn_in_fused(type, d_w, row_bytes, n, d_x, d_xq, d_dec, d_conv_state, d_conv_w, K,
                       d_state, d_a, d_dt, d_norm_w, d_y, d_yq, nk, nv, dk, dv, tiled, eps, true,
                       stream);
}

static bool dn_chunk_dims_ok(uint32_t dk, uint32_t dv)
{
    return dk == dv && (dk == 64 || dk == 128);
}

extern "C" size_t cuda_deltanet_work_bytes(uint32_t nv, uint32_t dk, uint32_t dv, uint32_t S)
{
    if (S < DN_CHUNK_MIN_S || !dn_chunk_dims_ok(dk, dv))
        return 0;
    const size_t n_chunks = ((size_t)S + DN_CH - 1) / DN_CH;
    return (size_t)nv * n_chunks * dn_chunk_floats(dk, dv) * sizeof(float);
}

/* *ok: whether the current device runs the chunked kernels (tensor cores of
 * sm_80 or later, smem bytes of shared memory per block). */
static int dn_chunk_device(size_t smem, bool *ok)
{
    int cc = 0, optin = 0;
    const int rc = cuda_caps_get(&cc, &optin);
    *ok = !rc && cc >= 80 && (size_t)optin >= smem;
    return rc;
}

/* LAMINA_CUDA_DN_CHUNK_ONLY=prep, state or norm (read at each launch): only
 * that kernel of the chunked prefill, for timing each (the results are
 * wrong); unset, all three. */
static bool dn_chunk_only(const char *kernel)
{
    const char *only = getenv("LAMINA_CUDA_DN_CHUNK_ONLY");
    return !only || !*only || !strcmp(only, kernel);
}

template <int D>
static int dn_chunk_launch(const struct dn_chunk_args &p, cudaStream_t stream)
{
    const size_t smem = dn_prep_smem_floats(D, D) * sizeof(float);
    int rc = cuda_caps_allow_smem((const void *)dn_prep_kernel<D, D>, smem,
                                  "cuda_deltanet_heads_chunked");
    if (rc)
        return rc;
    if (dn_chunk_only("prep")) {
        dn_prep_kernel<D, D><<<dim3(p.n_chunks, p.nv), DN_CK_THREADS, smem, stream>>>(p);
        rc = dn_check_launch("cuda_deltanet_heads_chunked (prep)");
        if (rc)
            return rc;
    }
    if (dn_chunk_only("state")) {
        /* the records staged in shared memory where the card has room for them */
        const char *staged = getenv("LAMINA_CUDA_DN_STAGE");
        const size_t ssm = dn_staged_smem_floats(D) * sizeof(float);
        int cc = 0, optin = 0;
        rc = cuda_caps_get(&cc, &optin);
        if (rc)
            return rc;
        if (!(staged && !strcmp(staged, "0")) && (size_t)optin >= ssm) {
            rc = cuda_caps_allow_smem((const void *)dn_state_staged_kernel<D, D>, ssm,
                                      "cuda_deltanet_heads_chunked");
            if (rc)
                return rc;
            dn_state_staged_kernel<D, D>
                <<<dim3(D / DN_SLICE, p.nv), DN_CK_THREADS, ssm, stream>>>(p);
        } else {
            dn_state_kernel<D, D><<<dim3(D / DN_SLICE, p.nv), DN_CK_THREADS, 0, stream>>>(p);
        }
        rc = dn_check_launch("cuda_deltanet_heads_chunked (state)");
        if (rc)
            return rc;
    }
    if (!dn_chunk_only("norm"))
        return 0;
    const size_t rows = (size_t)p.S * p.nv, per_block = DN_CK_THREADS / 32;
    dn_gnorm_kernel<D><<<(unsigned)((rows + per_block - 1) / per_block), DN_CK_THREADS, 0,
                         stream>>>(p);
    return dn_check_launch("cuda_deltanet_heads_chunked (norm)");
}

extern "C" int cuda_deltanet_heads_chunked(float *d_state, const float *d_u, const float *d_b,
                                           const float *d_alpha, const float *d_a,
                                           const float *d_dt, const float *d_z,
                                           const float *d_norm_w, float *d_y, uint32_t nk,
                                           uint32_t nv, uint32_t dk, uint32_t dv, bool tiled,
                                           uint32_t S, float eps, void *d_work, size_t work_bytes,
                                           cudaStream_t stream)
{
    const size_t need = cuda_deltanet_work_bytes(nv, dk, dv, S);
    if (need == 0)
        return cuda_deltanet_heads(d_state, d_u, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w, d_y, nk,
                                   nv, dk, dv, tiled, S, eps, stream);
    if (!dn_heads_args_ok(d_state, d_u, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w, d_y, nk, nv, dk,
                          dv, S) ||
        !d_work || work_bytes < need || ((uintptr_t)d_work & 31)) {
        log_error("cuda_deltanet_heads_chunked: bad arguments (dk %u, dv %u, nk %u, nv %u, S %u; "
                  "work %zu bytes, need %zu, 32-byte aligned)",
                  dk, dv, nk, nv, S, work_bytes, need);
        return -EINVAL;
    }
    bool dev_ok = false;
    int rc = dn_chunk_device(dn_prep_smem_floats(dk, dv) * sizeof(float), &dev_ok);
    if (rc)
        return rc;
    if (!dev_ok)
        return cuda_deltanet_heads(d_state, d_u, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w, d_y, nk,
                                   nv, dk, dv, tiled, S, eps, stream);
    const struct dn_chunk_args p = {d_state, d_u, d_b, d_alpha, d_a, d_dt, d_z, d_norm_w, d_y,
                                    (float *)d_work, nk, nv, S, (S + DN_CH - 1) / DN_CH, tiled,
                                    eps};
    return dk == 64 ? dn_chunk_launch<64>(p, stream) : dn_chunk_launch<128>(p, stream);
}
