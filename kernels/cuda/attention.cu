/*
 * attention: causal GQA attention of query rows over a layer's KV cache on
 * the GPU (twin: attention_head in kernels/cpu/attention.c, driven per token
 * and head as in fw_attn_head_task of worker/forward.c, output gate included).
 *
 * Maths, per query row (token t, head h; kv head j = h / G, G = n_head /
 * n_head_kv), with n = pos0 + t + 1 visible positions:
 *   s_p = scale * q . K[p][j],  a = softmax(s_0 .. s_{n-1}),  o = sum_p a_p V[p][j]
 *   o *= sigmoid(gate) when gated (gate = the hd floats after q).
 * Shapes: q f32, row (t, h) at q + t*q_tok_stride + h*q_head_stride; cache
 * rows of kv_dim = n_head_kv*hd elements (f16 or f32) per position, head j at
 * element j*hd; out f32 (t, h) at out + (t*n_head + h)*hd. hd <= 256, hd % 8 == 0.
 *
 * The exponentials use base 2 (q is pre-multiplied by scale*log2(e)) and the
 * softmax is online: each worker keeps a running max m, a running sum l of
 * 2^(s - m) and an accumulator sum 2^(s - m) V, rescaled by 2^(m_old - m_new)
 * when the max grows; partial (m, l, acc) triples combine as
 *   M = max m_i, L = sum 2^(m_i - M) l_i, A = sum 2^(m_i - M) acc_i, o = A / L.
 *
 * Warp ownership (both kernels): a warp owns NR <= 8 query rows that share a
 * KV head. Lane L owns dims [L*DPL, L*DPL + DPL) of every row (DPL = hd/32
 * rounded up to 1, 2, 4 or 8; lanes past hd hold zeros): it keeps those dims
 * of q and of the accumulators in registers. A sub-step consumes P = 32/NR
 * positions: each lane forms the NR*P partial dot products over its dims, a
 * butterfly reduce-scatter (31 shuffles) leaves lane L the full score of row
 * L/P at position L%P, the softmax bookkeeping runs one score per lane, the
 * weights go through shared memory, and every lane adds weight * V over its
 * dims. A step is U sub-steps (U = 2 gives two independent shuffle chains).
 * Every reduction has a fixed order, so results are bit-identical run to run.
 *
 * Decode (n_tok = 1), flash-decoding: grid (split, kv head x head group); the
 * block's 4 warps share the group's rows (all NG query heads of one KV head,
 * so K and V are read once per group) and interleave over the split's
 * positions a step at a time. On sm_80+ each lane stages its own piece of
 * the step's K and V rows through a per-warp cp.async ring 1..2 steps ahead
 * (attn_ring; 8 rows of f16: 3 stages of U = 2 sub-steps, else 2 stages of
 * 1; at most 96 KiB a block, launched with the driver's carveout so that two
 * fit an SM, attn_carveout); else it loads them straight from global
 * memory. (Splitting the 8 heads of a group over two warps, for 3 blocks
 * per SM instead of 2, measured slower.) The warps' triples combine in
 * shared memory; with one split that is the output, else each block writes
 * its triple per row to a workspace and attn_combine_kernel merges the
 * splits in ascending order. Splits follow from the shape alone (the same
 * on every GPU): chunks of >= 32 positions (one step of each warp of a
 * block at 8 rows of f16: short contexts spread over more blocks), at most
 * 512 blocks. The graph-stable form (cuda_attention_decode_at: the position
 * in device memory) launches the most splits any position up to its max_kv
 * plans (attn_decode_splits_most), the blocks past a position's own plan idle.
 *
 * The tensor-core kernels (kernels/cuda/attn_mma.cuh; the default where they take the
 * shape, LAMINA_CUDA_ATTN_MMA=0 turns them off):
 * the split decode (attn_mma_kernel, its own plan, attn_mma_limits: chunks of >= 64
 * positions, at most 128 blocks) and the prefill (attn_mma_prefill_kernel, the grid
 * below) write the same splits' triples for attn_combine_kernel from mma.sync
 * products (f16 cache, hd 16 to 256, compute capability 8.0 or later), with q and the
 * softmax weights in two f16 parts each.
 *
 * The fused decode (cuda_attention_decode_fused, attn_fused_kernel below): the
 * prep, the decode and the merge of one token in one launch, a warp per query
 * head, the cached rows read before the PDL wait, the splits merged by the
 * block that completes a kv head (its comment has the details). In the
 * decode graph on an H200 its first form took 26 us a layer against 14 for
 * the three launches; this form (a lane per position, the rope's sines in
 * shared memory, smaller code) takes 12.9 against 14.3 and decodes 1.3 %
 * faster at an empty context, but 3 % slower with 4096 tokens in it and 2.4
 * times slower an attention step at 70000 (docs/perf.md): at most 32 splits
 * a kv head (LAMINA_CUDA_ATTN_SPLITS=N, up to 128) where the split decode
 * spreads a long context over 512 blocks. So the CUDA backend takes it for
 * positions below LAMINA_CUDA_ATTN_FUSED_BELOW only (a decode graph of its
 * own); LAMINA_CUDA_ATTN_FUSED=0 refuses it here.
 *
 * Prefill (n_tok > 1): grid (token tile, kv head x head group, split). The
 * block's 8 warps own 64 rows (BQ = 64/NG tokens x NG heads); the block loads
 * tiles of T positions of K and V (<= 32 KiB) into shared memory once and all
 * warps consume them, each masking its rows causally (positions <= pos0 + t)
 * and skipping tiles past its last row. Long contexts are split over blocks
 * and merged by the same combine kernel. CUDA cores in f32 throughout (the
 * tensor-core form is attn_mma_prefill_kernel): about 17 TFLOP/s on an H200.
 *
 * Workspace: the split paths keep n_splits x n_tok x n_head x (hd + 2) floats
 * of stream-ordered memory (cudaMallocAsync / cudaFreeAsync on `stream`; at
 * most ~4 MiB for a decode step). With the default pool's release threshold
 * of 0 the first allocation after each synchronisation maps memory again
 * (~60 us): the process should raise cudaMemPoolAttrReleaseThreshold.
 */
#include "kernels/cuda/ops.h"

#include <cuda_fp16.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/mvq.cuh"
#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

enum {
    ATTN_ROWS = 8,            /* query rows per warp, at most */
    ATTN_DECODE_WARPS = 4,    /* warps per decode block */
    ATTN_PREFILL_WARPS = 8,   /* warps per prefill block */
    ATTN_MAX_SPLITS = 512,    /* KV splits per row, at most */
    ATTN_MAX_BLOCKS = 512,    /* target grid size of the split decode */
    ATTN_MIN_CHUNK = 32,      /* positions per decode split, at least */
    ATTN_TILE_BYTES = 32768,  /* prefill K + V tile in shared memory */
    ATTN_MAX_HD = 256,
};

struct attn_args {
    const float *q;
    size_t q_tok_stride, q_head_stride;
    const char *k, *v;  /* caches, bytes */
    uint32_t n_head, n_head_kv, hd, n_tok, pos0;
    uint32_t G, NG, n_groups;  /* heads per kv head, heads per block, groups per kv head */
    float scale_log2;          /* scale * log2(e) */
    bool gated;
    float *out;
    float *ws_acc;  /* [split][row][hd] (NULL: one split) */
    float *ws_ml;   /* [split][row][2]: m, l */
    uint32_t n_splits, chunk, tile;
    /* decode with the position in device memory (graphs replayed unchanged):
     * pos0 = *pos_ptr, and the splits of attn_plan_splits follow from it in
     * the kernels; the grid has cap_splits blocks per unit, the surplus ones
     * return an empty triple */
    const uint32_t *pos_ptr;
    uint32_t units;
    /* decode: the output row (n_head * hd) also rounded for the int8 decode
     * products (mvq::xq_row_bytes layout) by the combine kernel, or NULL */
    int8_t *outq;
    uint32_t min_chunk; /* decode: positions per split, at least (attn_min_chunk) */
    uint32_t max_blocks; /* decode: blocks of the split decode, at most (attn_max_blocks) */
};

/* DPL consecutive elements of a K or V row (f16 or f32) as floats; zeros
 * for lanes that own no dims. row + off must be DPL-element aligned. */
template <int DPL, bool F16>
static __device__ __forceinline__ void attn_load(const char *row, size_t off, bool own,
                                                 float (&f)[DPL])
{
    if (!own) {
#pragma unroll
        for (int d = 0; d < DPL; d++)
            f[d] = 0.0f;
        return;
    }
    if constexpr (F16) {
        const __half *p = (const __half *)row + off;
        if constexpr (DPL == 1) {
            f[0] = __half2float(*p);
        } else {
            /* DPL halves: 1, 2 or 4 words of two */
            __half2 h[DPL / 2];
            if constexpr (DPL == 8)
                *(uint4 *)h = *(const uint4 *)p;
            else if constexpr (DPL == 4)
                *(uint2 *)h = *(const uint2 *)p;
            else
                *(unsigned int *)h = *(const unsigned int *)p;
#pragma unroll
            for (int i = 0; i < DPL / 2; i++) {
                const float2 t = __half22float2(h[i]);
                f[2 * i] = t.x;
                f[2 * i + 1] = t.y;
            }
        }
    } else {
        const float *p = (const float *)row + off;
        if constexpr (DPL == 1) {
            f[0] = *p;
        } else if constexpr (DPL == 2) {
            const float2 t = *(const float2 *)p;
            f[0] = t.x;
            f[1] = t.y;
        } else {
#pragma unroll
            for (int i = 0; i < DPL / 4; i++) {
                const float4 t = ((const float4 *)p)[i];
                f[4 * i] = t.x;
                f[4 * i + 1] = t.y;
                f[4 * i + 2] = t.z;
                f[4 * i + 3] = t.w;
            }
        }
    }
}

/* One butterfly stage: lanes pair across bit O; each keeps the half of its
 * 2*O values selected by that bit and adds the partner's copy of it. */
template <int O>
static __device__ __forceinline__ void attn_scatter_stage(float (&v)[32], bool hi)
{
#pragma unroll
    for (int i = 0; i < O; i++) {
        const float lo_v = v[i], hi_v = v[i + O];
        const float send = hi ? lo_v : hi_v;
        const float keep = hi ? hi_v : lo_v;
        v[i] = keep + __shfl_xor_sync(OPS_FULL_MASK, send, O);
    }
}

/* Butterfly reduce-scatter: on return lane L holds the sum over all lanes of
 * v[L]. 16 + 8 + 4 + 2 + 1 shuffles. */
static __device__ __forceinline__ float attn_reduce_scatter(float (&v)[32], int lane)
{
    attn_scatter_stage<16>(v, lane & 16);
    attn_scatter_stage<8>(v, lane & 8);
    attn_scatter_stage<4>(v, lane & 4);
    attn_scatter_stage<2>(v, lane & 2);
    attn_scatter_stage<1>(v, lane & 1);
    return v[0];
}

/* The online-softmax state of one warp (see the file comment). */
template <int DPL, int NR>
struct attn_warp {
    float q[NR][DPL];
    float acc[NR][DPL];
    float m; /* running max (log2 units) of row lane / P */
    float l; /* this lane's share of that row's running sum */
};

template <int DPL, int NR>
static __device__ __forceinline__ void attn_warp_init(attn_warp<DPL, NR> &st)
{
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int d = 0; d < DPL; d++)
            st.acc[r][d] = 0.0f;
    st.m = -INFINITY;
    st.l = 0.0f;
}

/* One step over positions pos .. pos + U*P - 1, whose K and V rows start at
 * k and v (`stride` elements apart; only the first n_load rows may be read,
 * later ones are clamped to the last). Sub-step u (positions pos + u*P ..)
 * has its own reduce-scatter; U = 2 gives the scheduler two independent
 * shuffle chains. Position pos + u*P + L%P counts for lane L when below
 * `lim`. sw: this warp's (U + 1) * 32 floats of shared memory. FROM_GLOBAL:
 * issue the V loads together with the K loads, to have more in flight. */
template <int DPL, int NR, int U, bool F16, bool FROM_GLOBAL>
static __device__ __forceinline__ void attn_step(attn_warp<DPL, NR> &st, const char *k,
                                                 const char *v, size_t stride, int n_load,
                                                 uint32_t pos, uint32_t lim, bool own, int lane,
                                                 float *sw)
{
    constexpr int P = 32 / NR, PU = P * U;
    constexpr bool PREFETCH_V = FROM_GLOBAL && PU * DPL <= 32;
    const size_t off = (size_t)lane * DPL;
    float vf[PREFETCH_V ? PU : 1][DPL];
    if constexpr (PREFETCH_V) {
#pragma unroll
        for (int p = 0; p < PU; p++)
            attn_load<DPL, F16>(v, (size_t)(p < n_load ? p : n_load - 1) * stride + off, own,
                                vf[p]);
    }
    float s[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        float sc[32];
#pragma unroll
        for (int p = 0; p < P; p++) {
            float kf[DPL];
            const int row = u * P + p;
            attn_load<DPL, F16>(k, (size_t)(row < n_load ? row : n_load - 1) * stride + off,
                                own, kf);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float acc = 0.0f;
#pragma unroll
                for (int d = 0; d < DPL; d++)
                    acc = fmaf(st.q[r][d], kf[d], acc);
                sc[r * P + p] = acc;
            }
        }
        s[u] = attn_reduce_scatter(sc, lane);
    }
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < U; u++) {
        s[u] = pos + (uint32_t)(u * P + lane % P) < lim ? s[u] : -INFINITY;
        mx = fmaxf(mx, s[u]);
    }
#pragma unroll
    for (int o = P / 2; o > 0; o >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(OPS_FULL_MASK, mx, o));
    const float m_new = fmaxf(st.m, mx);
    float c = 1.0f, esum = 0.0f;
#pragma unroll
    for (int u = 0; u < U; u++) {
        const float e = m_new != -INFINITY ? exp2f(s[u] - m_new) : 0.0f;
        sw[u * 32 + lane] = e;
        esum += e;
    }
    if (m_new != -INFINITY)
        c = exp2f(st.m - m_new);
    st.l = st.l * c + esum;
    st.m = m_new;
    sw[U * 32 + lane] = c;
    __syncwarp();
    if (__any_sync(OPS_FULL_MASK, c != 1.0f)) {
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float cr = sw[U * 32 + r * P];
#pragma unroll
            for (int d = 0; d < DPL; d++)
                st.acc[r][d] *= cr;
        }
    }
#pragma unroll
    for (int p = 0; p < PU; p++) {
        float vl[DPL];
        if constexpr (PREFETCH_V) {
#pragma unroll
            for (int d = 0; d < DPL; d++)
                vl[d] = vf[p][d];
        } else {
            attn_load<DPL, F16>(v, (size_t)(p < n_load ? p : n_load - 1) * stride + off, own,
                                vl);
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float w = sw[(p / P) * 32 + r * P + p % P];
#pragma unroll
            for (int d = 0; d < DPL; d++)
                st.acc[r][d] = fmaf(w, vl[d], st.acc[r][d]);
        }
    }
    __syncwarp();
}

/* Loads row r's q (dims of this lane, pre-scaled), zeros when !valid. */
template <int DPL, int NR>
static __device__ __forceinline__ void attn_load_q(attn_warp<DPL, NR> &st, int r,
                                                   const float *qrow, bool valid, bool own,
                                                   int lane, float scale)
{
#pragma unroll
    for (int d = 0; d < DPL; d++)
        st.q[r][d] = valid && own ? qrow[lane * DPL + d] * scale : 0.0f;
}

/* Sum of l over the P lanes of each row; every lane of the row gets it. */
template <int NR>
static __device__ __forceinline__ float attn_row_sum(float l)
{
#pragma unroll
    for (int o = 16 / NR; o > 0; o >>= 1)
        l += __shfl_xor_sync(OPS_FULL_MASK, l, o);
    return l;
}

static __device__ __forceinline__ float attn_gate_of(float g)
{
    return 1.0f / (1.0f + expf(-g));
}

static __device__ __forceinline__ float attn_gate(const struct attn_args &a, const float *qrow,
                                                  uint32_t d, float o)
{
    return a.gated ? o * attn_gate_of(qrow[a.hd + d]) : o;
}

static __device__ __forceinline__ uint32_t attn_dev_div_up(uint32_t a, uint32_t b)
{
    return (a + b - 1) / b;
}

/* pos0, chunk and split count of a decode step: from the arguments, or with
 * pos_ptr set from the position in device memory exactly as
 * attn_plan_splits(n_kv, units, min_chunk, max_blocks, 16) plans. */
static __device__ __forceinline__ void attn_decode_plan(const struct attn_args &a,
                                                        uint32_t *pos0, uint32_t *chunk,
                                                        uint32_t *n_splits)
{
    if (!a.pos_ptr) {
        *pos0 = a.pos0, *chunk = a.chunk, *n_splits = a.n_splits;
        return;
    }
    *pos0 = __ldcg(a.pos_ptr); /* through L2: the combine reads it before its wait */
    const uint32_t n_kv = *pos0 + 1, want = attn_dev_div_up(n_kv, a.min_chunk);
    uint32_t cap = a.max_blocks / a.units;
    cap = cap < 1 ? 1 : cap > ATTN_MAX_SPLITS ? ATTN_MAX_SPLITS : cap;
    const uint32_t n = want < cap ? want : cap;
    *chunk = attn_dev_div_up(attn_dev_div_up(n_kv, n), 16) * 16;
    *n_splits = attn_dev_div_up(n_kv, *chunk);
}

/* A split decode block's split, kv head j, first query head h0 and positions [c0, c1)
 * (empty past the last split of the step's plan). */
static __device__ __forceinline__ void attn_decode_block(const struct attn_args &a,
                                                         uint32_t *split, uint32_t *j,
                                                         uint32_t *h0, uint32_t *c0,
                                                         uint32_t *c1)
{
    *split = blockIdx.x, *j = blockIdx.y / a.n_groups;
    *h0 = *j * a.G + (blockIdx.y % a.n_groups) * a.NG;
    uint32_t pos0, chunk, n_splits;
    attn_decode_plan(a, &pos0, &chunk, &n_splits);
    const uint32_t n_kv = pos0 + 1;
    *c0 = min(*split * chunk, n_kv);
    *c1 = min(n_kv, *c0 + chunk);
}

static __device__ __forceinline__ size_t attn_ws_row(const struct attn_args &a, uint32_t split,
                                                     uint32_t t, uint32_t h)
{
    return ((size_t)split * a.n_tok + t) * a.n_head + h;
}

/* Merges the triples of a decode block's nw warps for its rows h0 .. h0 + NG - 1
 * (warp w's row r: max m[w mr + r], sum l[w mr + r], accumulator acc + w acc_warp
 * + r acc_row) in ascending warp order, into the output (one split: normalised and
 * gated) or the split's workspace row. Every thread of the block takes part. */
static __device__ __forceinline__ void attn_merge_warps(const struct attn_args &a,
                                                        uint32_t split, uint32_t h0, int nw,
                                                        const float *m, const float *l, int mr,
                                                        const float *acc, size_t acc_warp,
                                                        size_t acc_row)
{
    for (uint32_t i = threadIdx.x; i < a.NG * a.hd; i += blockDim.x) {
        const uint32_t r = i / a.hd, d = i % a.hd, h = h0 + r;
        float M = -INFINITY;
#pragma unroll 4
        for (int w = 0; w < nw; w++)
            M = fmaxf(M, m[w * mr + r]);
        float L = 0.0f, A = 0.0f;
#pragma unroll 4
        for (int w = 0; w < nw; w++) {
            const float mw = m[w * mr + r];
            const float wt = mw == -INFINITY ? 0.0f : exp2f(mw - M);
            L += wt * l[w * mr + r];
            A += wt * acc[w * acc_warp + r * acc_row + d];
        }
        if (!a.ws_acc) {
            const float *qrow = a.q + (size_t)h * a.q_head_stride;
            a.out[(size_t)h * a.hd + d] = attn_gate(a, qrow, d, A / L);
            continue;
        }
        const size_t row = attn_ws_row(a, split, 0, h);
        a.ws_acc[row * a.hd + d] = A;
        if (d == 0) {
            a.ws_ml[2 * row] = M;
            a.ws_ml[2 * row + 1] = L;
        }
    }
}

/* The per-warp staging ring of the decode kernel on sm_80+: each lane copies
 * its own PIECE bytes of the step's P K rows and P V rows into slot
 * (step % STAGES) with cp.async, STAGES - 1 steps ahead, and later reads back
 * only what it copied itself, so the ring needs no barrier. Used when a slot
 * is small (P * DPL <= 32) and pieces are whole cp.async sizes. */
template <int DPL, int NR, bool F16, bool LEAN = false>
struct attn_ring {
    /* sub-steps per step (attn_step); LEAN: one, a third less ring (attn_ring_lean) */
    static constexpr int U = F16 && NR == 8 && !LEAN ? 2 : 1;
    static constexpr int P = 32 / NR * U, ESZ = F16 ? 2 : 4; /* positions per step */
    static constexpr int PIECE = DPL * ESZ;   /* bytes of one row one lane copies */
    static constexpr int ROW = 32 * PIECE;    /* bytes of one staged row */
    static constexpr int SLOT = 2 * P * ROW;  /* K rows, then V rows */
    static constexpr int STAGES = F16 && NR == 8 ? 3 : 2;
    static constexpr size_t BYTES = (size_t)ATTN_DECODE_WARPS * STAGES * SLOT;
    static constexpr bool ON = P / U * DPL <= 64 && PIECE >= 4 && BYTES <= 96 * 1024;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ATTN_HAVE_CP_ASYNC 1
#else
#define ATTN_HAVE_CP_ASYNC 0
#endif

template <int PIECE>
static __device__ __forceinline__ void attn_cp_async(char *dst, const char *src)
{
#if ATTN_HAVE_CP_ASYNC
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    if constexpr (PIECE >= 16) {
#pragma unroll
        for (int i = 0; i < PIECE / 16; i++)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d + 16 * i),
                         "l"(src + 16 * i)
                         : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src),
                     "n"(PIECE)
                     : "memory");
    }
#else
    (void)dst, (void)src;
#endif
}

template <int UNUSED = 0>
static __device__ __forceinline__ void attn_cp_commit()
{
#if ATTN_HAVE_CP_ASYNC
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
static __device__ __forceinline__ void attn_cp_wait()
{
#if ATTN_HAVE_CP_ASYNC
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* Stages step i of this warp (positions first + i*step ..) into its slot and
 * commits a group (an empty one past the last step, to keep counts even). */
template <int DPL, int NR, bool F16, bool LEAN>
static __device__ __forceinline__ void attn_ring_issue(char *ring, const char *k, const char *v,
                                                       size_t row_bytes, uint32_t first,
                                                       uint32_t step, uint32_t n_steps,
                                                       uint32_t c1, uint32_t i, int lane,
                                                       bool own)
{
    using R = attn_ring<DPL, NR, F16, LEAN>;
    if (i < n_steps && own) {
        const uint32_t p = first + i * step;
        char *slot = ring + (i % R::STAGES) * R::SLOT + lane * R::PIECE;
#pragma unroll
        for (int r = 0; r < R::P; r++) {
            const size_t at = (size_t)min(p + r, c1 - 1) * row_bytes + lane * R::PIECE;
            attn_cp_async<R::PIECE>(slot + r * R::ROW, k + at);
            attn_cp_async<R::PIECE>(slot + (R::P + r) * R::ROW, v + at);
        }
    }
    attn_cp_commit();
}

/* This warp's positions of [c0, c1) through the ring (see attn_ring). */
template <int DPL, int NR, bool F16, bool LEAN>
static __device__ __forceinline__ void attn_decode_ring(attn_warp<DPL, NR> &st, char *ring,
                                                        const char *k, const char *v,
                                                        size_t row_bytes, uint32_t c0,
                                                        uint32_t c1, int warp, int lane,
                                                        bool own, float *sw)
{
    using R = attn_ring<DPL, NR, F16, LEAN>;
    const uint32_t first = c0 + warp * R::P, step = ATTN_DECODE_WARPS * R::P;
    const uint32_t n_steps = first < c1 ? (c1 - first + step - 1) / step : 0;
#pragma unroll
    for (int i = 0; i < R::STAGES - 1; i++)
        attn_ring_issue<DPL, NR, F16, LEAN>(ring, k, v, row_bytes, first, step, n_steps, c1, i,
                                            lane, own);
    for (uint32_t i = 0; i < n_steps; i++) {
        attn_ring_issue<DPL, NR, F16, LEAN>(ring, k, v, row_bytes, first, step, n_steps, c1,
                                            i + R::STAGES - 1, lane, own);
        attn_cp_wait<R::STAGES - 1>(); /* step i has landed */
        const char *slot = ring + (i % R::STAGES) * R::SLOT;
        attn_step<DPL, NR, R::U, F16, false>(st, slot, slot + R::P * R::ROW, 32 * DPL, R::P,
                                             first + i * step, c1, own, lane, sw);
    }
    attn_cp_wait<0>();
}

template <int DPL, int NR, bool F16, bool LEAN = false>
static __global__ void __launch_bounds__(ATTN_DECODE_WARPS * 32, NR >= 8 ? 2 : 3)
    attn_decode_kernel(const struct attn_args a)
{
    constexpr int P = 32 / NR, NW = ATTN_DECODE_WARPS, ESZ = F16 ? 2 : 4;
    extern __shared__ uint4 s_dyn[]; /* the rings, then the warps' accumulators */
    __shared__ float s_sw[NW][96];
    __shared__ float s_m[NW][NR], s_l[NW][NR];
    pdl_wait(); /* q, the cache rows and the position come from the kernels before */
    pdl_trigger();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool own = (uint32_t)lane * DPL < a.hd;
    uint32_t split, j, h0, c0, c1;
    attn_decode_block(a, &split, &j, &h0, &c0, &c1);
    const size_t kv_dim = (size_t)a.n_head_kv * a.hd;
    const char *kh = a.k + (size_t)j * a.hd * ESZ, *vh = a.v + (size_t)j * a.hd * ESZ;

    attn_warp<DPL, NR> st;
    attn_warp_init(st);
#pragma unroll
    for (int r = 0; r < NR; r++)
        attn_load_q(st, r, a.q + (size_t)(h0 + r) * a.q_head_stride, (uint32_t)r < a.NG, own,
                    lane, a.scale_log2);
    if constexpr (ATTN_HAVE_CP_ASYNC && attn_ring<DPL, NR, F16, LEAN>::ON) {
        using R = attn_ring<DPL, NR, F16, LEAN>;
        attn_decode_ring<DPL, NR, F16, LEAN>(st, (char *)s_dyn + warp * R::STAGES * R::SLOT, kh,
                                             vh, kv_dim * ESZ, c0, c1, warp, lane, own,
                                             s_sw[warp]);
    } else {
        for (uint32_t p = c0 + warp * P; p < c1; p += NW * P) {
            const size_t at = (size_t)p * kv_dim * ESZ;
            attn_step<DPL, NR, 1, F16, true>(st, kh + at, vh + at, kv_dim, (int)(c1 - p), p,
                                             c1, own, lane, s_sw[warp]);
        }
    }
    float(*s_acc)[NR][DPL * 32] = (float(*)[NR][DPL * 32])s_dyn;
    const float l = attn_row_sum<NR>(st.l);
    __syncthreads(); /* the rings are free: reuse them for the accumulators */
    if (lane % P == 0) {
        s_m[warp][lane / P] = st.m;
        s_l[warp][lane / P] = l;
    }
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int d = 0; d < DPL; d++)
            s_acc[warp][r][lane * DPL + d] = st.acc[r][d];
    __syncthreads();

    attn_merge_warps(a, split, h0, NW, &s_m[0][0], &s_l[0][0], NR, &s_acc[0][0][0],
                     (size_t)NR * DPL * 32, DPL * 32);
}

#include "kernels/cuda/attn_mma.cuh"

/* Copies positions [t0, t0 + tile) of kv head j into the shared tiles, zeros
 * past `end`. Rows are hd*ESZ bytes, a multiple of 16. */
template <bool F16>
static __device__ __forceinline__ void attn_load_tile(const struct attn_args &a, uint32_t j,
                                                      uint32_t t0, uint32_t end, uint4 *s_k,
                                                      uint4 *s_v)
{
    constexpr int ESZ = F16 ? 2 : 4;
    const uint32_t vpr = a.hd * ESZ / 16; /* 16-byte vectors per row */
    const size_t kv_dim = (size_t)a.n_head_kv * a.hd;
    for (uint32_t i = threadIdx.x; i < a.tile * vpr; i += blockDim.x) {
        const uint32_t row = i / vpr, col = i % vpr, p = t0 + row;
        uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
        if (p < end) {
            const size_t at = ((size_t)p * kv_dim + (size_t)j * a.hd) * ESZ + (size_t)col * 16;
            kx = *(const uint4 *)(a.k + at);
            vx = *(const uint4 *)(a.v + at);
        }
        s_k[i] = kx;
        s_v[i] = vx;
    }
}

template <int DPL, bool F16>
static __global__ void __launch_bounds__(ATTN_PREFILL_WARPS * 32)
    attn_prefill_kernel(const struct attn_args a)
{
    constexpr int NR = ATTN_ROWS, P = 32 / NR, ESZ = F16 ? 2 : 4;
    extern __shared__ uint4 s_tiles[];
    __shared__ float s_sw[ATTN_PREFILL_WARPS][64];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool own = (uint32_t)lane * DPL < a.hd;
    const uint32_t j = blockIdx.y / a.n_groups, split = blockIdx.z;
    const uint32_t h0 = j * a.G + (blockIdx.y % a.n_groups) * a.NG;
    const uint32_t bq = ATTN_PREFILL_WARPS * NR / a.NG, tok0 = blockIdx.x * bq;
    const uint32_t c0 = split * a.chunk;
    const uint32_t c1 = min(a.pos0 + a.n_tok, c0 + a.chunk);
    uint4 *s_k = s_tiles, *s_v = s_tiles + a.tile * (a.hd * ESZ / 16);

    attn_warp<DPL, NR> st;
    attn_warp_init(st);
    uint32_t lim = 0, warp_lim = 0; /* lane's row limit, the warp's largest */
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const uint32_t idx = warp * NR + r, t = tok0 + idx / a.NG, h = h0 + idx % a.NG;
        const bool valid = idx < bq * a.NG && t < a.n_tok;
        const uint32_t rl = valid ? min(a.pos0 + t + 1, c1) : 0;
        attn_load_q(st, r, a.q + (size_t)t * a.q_tok_stride + (size_t)h * a.q_head_stride,
                    valid, own, lane, a.scale_log2);
        lim = r == lane / P ? rl : lim;
        warp_lim = max(warp_lim, rl);
    }
    const uint32_t block_end = min(c1, a.pos0 + min(tok0 + bq, a.n_tok));
    const size_t row_bytes = (size_t)a.hd * ESZ;
    for (uint32_t t0 = c0; t0 < block_end; t0 += a.tile) {
        __syncthreads();
        attn_load_tile<F16>(a, j, t0, block_end, s_k, s_v);
        __syncthreads();
        const uint32_t stop = min(t0 + a.tile, warp_lim);
        for (uint32_t p = t0; p < stop; p += P) {
            const size_t at = (size_t)(p - t0) * row_bytes;
            attn_step<DPL, NR, 1, F16, false>(st, (const char *)s_k + at,
                                              (const char *)s_v + at, a.hd, P, p, lim, own,
                                              lane, s_sw[warp]);
        }
    }

    const float l = attn_row_sum<NR>(st.l);
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const uint32_t idx = warp * NR + r, t = tok0 + idx / a.NG, h = h0 + idx % a.NG;
        const float m_r = __shfl_sync(OPS_FULL_MASK, st.m, r * P);
        const float l_r = __shfl_sync(OPS_FULL_MASK, l, r * P);
        if (idx >= bq * a.NG || t >= a.n_tok || !own)
            continue;
        const float *qrow = a.q + (size_t)t * a.q_tok_stride + (size_t)h * a.q_head_stride;
        if (!a.ws_acc) {
            float *o = a.out + ((size_t)t * a.n_head + h) * a.hd;
#pragma unroll
            for (int d = 0; d < DPL; d++)
                o[lane * DPL + d] = attn_gate(a, qrow, lane * DPL + d, st.acc[r][d] / l_r);
            continue;
        }
        const size_t row = attn_ws_row(a, split, t, h);
#pragma unroll
        for (int d = 0; d < DPL; d++)
            a.ws_acc[row * a.hd + lane * DPL + d] = st.acc[r][d];
        if (lane == 0) {
            a.ws_ml[2 * row] = m_r;
            a.ws_ml[2 * row + 1] = l_r;
        }
    }
}

/* Grid (row (t, h), 32-dim slice): merges the n_splits partial triples of
 * the row. 256 threads: thread (sl, q) sums splits sl, sl + 64, ... of dims
 * 4q .. 4q + 3 and 16 + 4q .. 16 + 4q + 3 of the slice (float4 loads), then
 * the 64 partial sums of each dim are added in ascending sl and the gate
 * applied; with outq, the slice's first warp rounds its 32 outputs there
 * (hd a multiple of 32, one token). */
static __global__ void __launch_bounds__(256) attn_combine_kernel(const struct attn_args a)
{
    __shared__ float s_w[ATTN_MAX_SPLITS];
    __shared__ float s_tmp[32];
    __shared__ float4 s_part[64][8];
    /* before the wait (through L2, pdl.cuh): the position and the gate are
     * inputs of the kernel that produced the partial triples, complete when
     * this one starts */
    const uint32_t t = blockIdx.x / a.n_head, h = blockIdx.x % a.n_head;
    const uint32_t dd = blockIdx.y * 32 + threadIdx.x;
    const float *qrow = a.q + (size_t)t * a.q_tok_stride + (size_t)h * a.q_head_stride;
    uint32_t n_splits = a.n_splits;
    if (a.pos_ptr) {
        uint32_t pos0, chunk;
        attn_decode_plan(a, &pos0, &chunk, &n_splits);
    }
    const float gf =
        a.gated && threadIdx.x < 32 && dd < a.hd ? attn_gate_of(__ldcg(qrow + a.hd + dd)) : 1.0f;
    pdl_wait();
    pdl_trigger();
    float mx = -INFINITY;
    for (uint32_t s = threadIdx.x; s < n_splits; s += blockDim.x)
        mx = fmaxf(mx, a.ws_ml[2 * attn_ws_row(a, s, t, h)]);
    const float M = ops_block_max(mx, s_tmp);
    float lsum = 0.0f;
    for (uint32_t s = threadIdx.x; s < n_splits; s += blockDim.x) {
        const size_t row = attn_ws_row(a, s, t, h);
        const float m = a.ws_ml[2 * row];
        const float w = m == -INFINITY ? 0.0f : exp2f(m - M);
        s_w[s] = w;
        lsum += w * a.ws_ml[2 * row + 1];
    }
    const float L = ops_block_sum(lsum, s_tmp); /* its barriers publish s_w too */
    const uint32_t q = threadIdx.x % 4, sl = threadIdx.x / 4;
#pragma unroll
    for (uint32_t half = 0; half < 2; half++) {
        const uint32_t d = blockIdx.y * 32 + 16 * half + 4 * q;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (d < a.hd) {
#pragma unroll 4
            for (uint32_t s = sl; s < n_splits; s += 64) {
                const float w = s_w[s];
                const float4 x = *(const float4 *)&a.ws_acc[attn_ws_row(a, s, t, h) * a.hd + d];
                acc.x += w * x.x;
                acc.y += w * x.y;
                acc.z += w * x.z;
                acc.w += w * x.w;
            }
        }
        s_part[sl][4 * half + q] = acc;
    }
    __syncthreads();
    if (threadIdx.x >= 32)
        return;
    float o = 0.0f;
    if (dd < a.hd) {
        float A = 0.0f; /* the partials past n_splits are zeros: adding them changes nothing */
        const uint32_t parts = n_splits < 64 ? n_splits : 64;
        for (uint32_t i = 0; i < parts; i++)
            A += ((const float *)&s_part[i][threadIdx.x / 4])[threadIdx.x % 4];
        o = a.gated ? A / L * gf : A / L; /* attn_gate's product */
        a.out[((size_t)t * a.n_head + h) * a.hd + dd] = o;
    }
    if (a.outq) { /* one token, hd % 32 == 0: the warp's 32 outputs are one block */
        const size_t n = (size_t)a.n_head * a.hd;
        float *sc = reinterpret_cast<float *>(a.outq + n);
        mvq::round_block(o, (uint32_t)(((size_t)h * a.hd + blockIdx.y * 32) / 32), true, a.outq,
                         sc, sc + n / 32);
    }
}

/*
 * The fused decode (cuda_attention_decode_fused): attn_prep_kernel,
 * attn_decode_kernel and attn_combine_kernel of one token in one launch, for
 * an f16 cache and hd a multiple of 32 (at most 256). Grid (split, kv head
 * j), a block of NG warps, warp w owning query head h = j * NG + w (NG =
 * n_head / n_head_kv, at most AF_MAX_NG). Splits: chunks of AF_T positions
 * or a multiple of them, at most `cap` a kv head (AF_MAX_SPLITS), planned
 * from the position in device memory (af_plan); blocks past the position's
 * splits return at once.
 *   - Before the PDL wait (nothing there comes from the kernels before): the
 *     position, the plan, the block's first two tiles of cached K and V rows
 *     (positions below the current one, written by earlier steps) into a
 *     ring of two tiles in shared memory by cp.async, the norm weights and
 *     the rope's sines and cosines of the lane's elements.
 *   - After it: each warp normalises its head's q as attn_prep_kernel does
 *     (lane L holds elements L, L + 32, ...: the same warp butterflies per
 *     32 elements and the same butterfly over their sums as its block of hd
 *     threads, the same expressions), ropes it through shared memory and
 *     keeps q * scale * log2(e) with lane L owning dims L * DPL .. (the
 *     decode kernel's layout). The block whose split holds the position
 *     forms k (warp 0) and v (warp 1, or 0) the same way, stores them in the
 *     cache and keeps their f16 rows, which stand in for the cache's row of
 *     the position: q, k, v, caches are the prep's bits.
 *   - Per tile of AF_T positions each warp forms the AF_T partial dot
 *     products over its dims, one butterfly reduce-scatter leaves lane p the
 *     score of position t0 + p, the online softmax runs one score a lane (m
 *     warp-uniform, l a lane's share), and every lane adds the weights
 *     (shuffled from their lanes) times V over its dims.
 *   - One split: the output (gate applied) straight to out. Several: the
 *     triple to the workspace ([split][head][hd], [split][head][m, l]), and
 *     the block that completes kv head j (af_ctr[j], set back to 0 by it)
 *     merges that head's splits per warp: M = max m, L = sum 2^(m - M) l,
 *     A = sum 2^(m - M) acc, o = A / L (times the gate).
 *   - outq: the output row also rounded per block of 32 (mvq::round_block)
 *     for the output product, as attn_combine_kernel writes it.
 * The scores and the merge add in another order than the three kernels (the
 * per-tile softmax, a warp's 32 positions at a time): results agree to f32
 * rounding, not bitwise; run to run they are the same bits.
 */
enum {
    AF_T = 32,           /* positions per tile (one score a lane) */
    AF_MAX_SPLITS = 128, /* splits a kv head, at most (af_splits: 32 unless asked) */
    AF_MAX_NG = 16,      /* query heads (warps) a block, at most */
    AF_MAX_KV = 64,      /* kv heads, at most (af_ctr) */
    AF_ROUND = 4,        /* splits whose triples the merge loads in its first round */
};

struct af_args {
    const float *q;      /* query head h at q + h * q_head_stride (its gate after hd) */
    size_t q_head_stride;
    const float *k, *v;  /* this token's raw k and v, kv head j at + j * hd */
    const float *q_norm, *k_norm; /* NULL: no norm */
    float eps, base;
    uint32_t half;       /* n_rot / 2 */
    __half *kc, *vc;
    uint32_t n_head, n_head_kv, hd, NG, cap;
    const uint32_t *pos_ptr;
    float scale_log2;
    bool gated;
    float *out;
    int8_t *outq;        /* or NULL */
    float *ws_acc, *ws_ml;
};

/* Per kv head: blocks of the current fused launch that have written their
 * triple; the last sets it back to 0 (one launch at a time per device, as
 * the backend runs a layer's kernels on one stream). */
__device__ unsigned int af_ctr[AF_MAX_KV];

/* Chunk and split count of n_kv positions, at most cap splits. */
static __device__ __forceinline__ void af_plan(uint32_t n_kv, uint32_t cap, uint32_t *chunk,
                                               uint32_t *n_splits)
{
    const uint32_t want = attn_dev_div_up(n_kv, AF_T), n = want < cap ? want : cap;
    *chunk = attn_dev_div_up(attn_dev_div_up(n_kv, n), AF_T) * AF_T;
    *n_splits = attn_dev_div_up(n_kv, *chunk);
}

/* Tile i of positions [t0, t1) (t1: the first not read from the cache) of
 * kv head j into ring slot i % 2 (K rows, then V rows, hd halves each, 16
 * bytes apart so that lanes reading one row each hit distinct banks) by
 * cp.async, one group committed (empty past the rows). */
static __device__ __forceinline__ void af_issue(const struct af_args &a, char *ring, uint32_t j,
                                                uint32_t t0, uint32_t t1, uint32_t i)
{
    const uint32_t rb = a.hd * 2, cpr = rb / 16, rs = rb + 16; /* bytes, pieces, stride */
    const uint32_t rows = t1 > t0 ? min(t1 - t0, (uint32_t)AF_T) : 0;
    char *slot = ring + (size_t)(i % 2) * 2 * AF_T * rs;
    const size_t kv_row = (size_t)a.n_head_kv * rb;
    for (uint32_t c = threadIdx.x; c < 2 * rows * cpr; c += blockDim.x) {
        const uint32_t kv = c / (rows * cpr), r = c % (rows * cpr) / cpr, p = c % cpr;
        const char *src = (const char *)(kv ? a.vc : a.kc) + (size_t)(t0 + r) * kv_row +
                          (size_t)j * rb + p * 16;
        attn_cp_async<16>(slot + ((size_t)kv * AF_T + r) * rs + p * 16, src);
    }
    attn_cp_commit();
}

/* One head row (raw: x, lane L's elements L + 32 m) as attn_prep_kernel leaves it: the
 * RMSNorm with weights wn (lane L's elements L + 32 m; NULL: none; the
 * block sum replayed as its warps and its final butterfly), then the rope
 * of the first 2 * half elements through s (hd floats of the warp's own);
 * returns with s holding the row. sc: the pairs' sines and cosines. */
template <int DPL>
static __device__ __forceinline__ void af_prep_row(const struct af_args &a, float (&x)[DPL],
                                                   const float (&wn)[DPL], bool norm,
                                                   const float *sc, float *s)
{
    const int lane = threadIdx.x & 31;
    if (norm) {
        float v = 0.0f;
#pragma unroll
        for (int m = 0; m < DPL; m++) {
            const float ws = ops_warp_sum(x[m] * x[m]);
            v = lane == m ? ws : v;
        }
        const float sum = ops_warp_sum(v);
        const float scale = 1.0f / sqrtf(sum / (float)a.hd + a.eps);
#pragma unroll
        for (int m = 0; m < DPL; m++)
            x[m] = x[m] * scale * wn[m];
    }
#pragma unroll
    for (int m = 0; m < DPL; m++)
        s[32 * m + lane] = x[m];
    __syncwarp();
#pragma unroll
    for (int m = 0; m < DPL; m++) {
        const uint32_t i = 32 * m + lane;
        if (i < a.half)
            x[m] = s[i] * sc[2 * i + 1] - s[i + a.half] * sc[2 * i];
        else if (i < 2 * a.half)
            x[m] = s[i - a.half] * sc[2 * (i - a.half)] + s[i] * sc[2 * (i - a.half) + 1];
    }
    __syncwarp();
#pragma unroll
    for (int m = 0; m < DPL; m++)
        s[32 * m + lane] = x[m];
    __syncwarp();
}

/* The output of head h (dims lane * DPL ..: o) to out and, with outq, rounded
 * per block of 32 through s (hd floats of the warp's own). */
template <int DPL>
static __device__ __forceinline__ void af_out(const struct af_args &a, uint32_t h,
                                              const float (&o)[DPL], float *s)
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 0; d < DPL; d++)
        s[lane * DPL + d] = o[d];
    __syncwarp();
    const size_t n = (size_t)a.n_head * a.hd;
    float x[DPL];
#pragma unroll
    for (int m = 0; m < DPL; m++) {
        x[m] = s[32 * m + lane];
        a.out[(size_t)h * a.hd + 32 * m + lane] = x[m];
    }
    if (!a.outq)
        return;
    float *sc = reinterpret_cast<float *>(a.outq + n);
    uint32_t bb[DPL];
    bool st[DPL];
#pragma unroll
    for (int m = 0; m < DPL; m++) {
        bb[m] = (uint32_t)(((size_t)h * a.hd) / 32) + m;
        st[m] = true;
    }
    mvq::round_blocks<DPL>(x, bb, st, a.outq, sc, sc + n / 32);
}

/* The merge's step for one split: its triple (m, l in ml, its lane's dims in x) weighed by
 * 2^(m - M) into L and A (a split with no position, m -inf, weighs 0). */
template <int DPL>
static __device__ __forceinline__ void af_merge_add(float2 ml, const float (&x)[DPL], float M,
                                                    float &L, float (&A)[DPL])
{
    const float w = ml.x == -INFINITY ? 0.0f : exp2f(ml.x - M);
    L += w * ml.y;
#pragma unroll
    for (int d = 0; d < DPL; d++)
        A[d] += w * x[d];
}

template <int DPL>
static __global__ void __launch_bounds__(AF_MAX_NG * 32)
    attn_fused_kernel(const struct af_args a)
{
#if defined(__CUDA_ARCH__) && !ATTN_HAVE_CP_ASYNC
    __trap(); /* launched on sm_80 and later only (af_takes, caps.h): its ring is cp.async */
#endif
    extern __shared__ uint4 s_dyn[]; /* ring (2 tiles), the warps' rows, new k and v */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t split = blockIdx.x, j = blockIdx.y, h = j * a.NG + warp;
    const uint32_t rs = a.hd * 2 + 16; /* ring row stride, bytes */
    char *ring = (char *)s_dyn;
    float *s_row = (float *)(ring + (size_t)4 * AF_T * rs) + (size_t)warp * a.hd;
    __half *s_kn = (__half *)((float *)(ring + (size_t)4 * AF_T * rs) + (size_t)a.NG * a.hd);
    __half *s_vn = s_kn + a.hd;
    float *s_sc = (float *)(s_vn + a.hd); /* sin, cos of rope pair i0 at 2 i0, 2 i0 + 1 */
    __shared__ unsigned int s_last;

    /* before the wait: the plan, the cached rows, weights, sines and cosines */
    const uint32_t pos = __ldcg(a.pos_ptr), n_kv = pos + 1;
    uint32_t chunk, n_splits;
    af_plan(n_kv, a.cap, &chunk, &n_splits);
    if (split >= n_splits)
        return;
    const uint32_t c0 = split * chunk, c1 = min(n_kv, c0 + chunk);
    const uint32_t cached = min(c1, pos); /* rows read from the cache: below the position */
    const bool mine = pos < c1;           /* this block forms k and v of the position */
    const uint32_t n_tiles = attn_dev_div_up(c1 - c0, AF_T);
    af_issue(a, ring, j, c0, cached, 0);
    af_issue(a, ring, j, c0 + AF_T, cached, 1);
    float qn[DPL], kn[DPL];
#pragma unroll
    for (int m = 0; m < DPL; m++) {
        const uint32_t i = 32 * m + lane;
        qn[m] = a.q_norm ? a.q_norm[i] : 1.0f;
        kn[m] = a.k_norm ? a.k_norm[i] : 1.0f;
    }
    /* the rope's sines and cosines, pair i0 by thread i0 (one sincosf in the code) */
    for (uint32_t i0 = threadIdx.x; i0 < a.half; i0 += blockDim.x) { /* attn_prep's theta */
        const float theta = (float)pos * powf(a.base, -(float)(2 * i0) / (float)(2 * a.half));
        sincosf(theta, &s_sc[2 * i0], &s_sc[2 * i0 + 1]);
    }
    __syncthreads(); /* s_sc */
    pdl_wait(); /* q, k and v come from the kernel before */
    pdl_trigger();

    /* every load of the step's inputs at once: q, its gate, k and v */
    const float *qrow = a.q + (size_t)h * a.q_head_stride;
    const bool do_k = mine && warp == 0, do_v = mine && warp == (a.NG > 1 ? 1 : 0);
    float xq[DPL], xk[DPL], xv[DPL], gf[DPL];
#pragma unroll
    for (int m = 0; m < DPL; m++) {
        xq[m] = qrow[32 * m + lane];
        xk[m] = do_k ? a.k[(size_t)j * a.hd + 32 * m + lane] : 0.0f;
        xv[m] = do_v ? a.v[(size_t)j * a.hd + 32 * m + lane] : 0.0f;
        gf[m] = a.gated ? qrow[a.hd + lane * DPL + m] : 0.0f;
    }
#pragma unroll
    for (int d = 0; d < DPL; d++)
        gf[d] = a.gated ? attn_gate_of(gf[d]) : 1.0f;
    const size_t at = (size_t)pos * a.n_head_kv * a.hd + (size_t)j * a.hd;
    if (do_k) { /* k (warp 0) and v (warp 1, or 0) of the position: cache and s_kn, s_vn */
        af_prep_row<DPL>(a, xk, kn, a.k_norm != nullptr, s_sc, s_row);
#pragma unroll
        for (int m = 0; m < DPL; m++) {
            const __half x = __float2half_rn(s_row[32 * m + lane]);
            a.kc[at + 32 * m + lane] = x;
            s_kn[32 * m + lane] = x;
        }
        __syncwarp();
    }
    if (do_v) {
#pragma unroll
        for (int m = 0; m < DPL; m++) {
            const __half x = __float2half_rn(xv[m]);
            a.vc[at + 32 * m + lane] = x;
            s_vn[32 * m + lane] = x;
        }
    }
    af_prep_row<DPL>(a, xq, qn, a.q_norm != nullptr, s_sc, s_row);
    /* q * scale * log2(e) in s_row (the decode kernel's product), read as float4s */
#pragma unroll
    for (int m = 0; m < DPL; m++)
        s_row[32 * m + lane] *= a.scale_log2;
    __syncwarp();
    float acc[DPL];
#pragma unroll
    for (int d = 0; d < DPL; d++)
        acc[d] = 0.0f;
    float m_run = -INFINITY, l = 0.0f;
    const size_t off = (size_t)lane * DPL;
    const float4 *q4 = (const float4 *)s_row;
    for (uint32_t i = 0; i < n_tiles; i++) {
        attn_cp_wait<1>(); /* this thread's copies of tile i */
        __syncthreads();   /* everyone's, and s_kn / s_vn */
        const uint32_t t0 = c0 + i * AF_T, nv = min((uint32_t)AF_T, c1 - t0);
        const char *sk = ring + (size_t)(i % 2) * 2 * AF_T * rs, *sv = sk + (size_t)AF_T * rs;
        /* lane p: the score of position t0 + p over the whole row (loops, not unrolled
         * over positions: the kernel's code stays small) */
        float s = -INFINITY;
        if ((uint32_t)lane < nv) {
            const uint4 *kr = (const uint4 *)(t0 + lane == pos ? (const char *)s_kn
                                                               : sk + (size_t)lane * rs);
            /* hd up to 128 (DPL 4): four chains of hd / 4 multiply-adds, not one of hd (the
             * score's latency); hd 256 keeps one chain (its registers: four were not faster) */
            constexpr int NA = DPL <= 4 ? 4 : 1;
            float d[NA];
#pragma unroll
            for (int i = 0; i < NA; i++)
                d[i] = 0.0f;
#pragma unroll(NA == 4 ? 4 : 2)
            for (uint32_t c = 0; c < a.hd / 8; c++) {
                const uint4 k8 = kr[c];
                const float4 qa = q4[2 * c], qb = q4[2 * c + 1];
                const __half2 *kh = (const __half2 *)&k8;
                const float2 k0 = __half22float2(kh[0]), k1 = __half22float2(kh[1]);
                const float2 k2 = __half22float2(kh[2]), k3 = __half22float2(kh[3]);
                d[0] = fmaf(qa.x, k0.x, d[0]);
                d[1 % NA] = fmaf(qa.y, k0.y, d[1 % NA]);
                d[2 % NA] = fmaf(qa.z, k1.x, d[2 % NA]);
                d[3 % NA] = fmaf(qa.w, k1.y, d[3 % NA]);
                d[0] = fmaf(qb.x, k2.x, d[0]);
                d[1 % NA] = fmaf(qb.y, k2.y, d[1 % NA]);
                d[2 % NA] = fmaf(qb.z, k3.x, d[2 % NA]);
                d[3 % NA] = fmaf(qb.w, k3.y, d[3 % NA]);
            }
            s = NA == 4 ? (d[0] + d[1 % NA]) + (d[2 % NA] + d[3 % NA]) : d[0];
        }
        const float m_new = fmaxf(m_run, ops_warp_max(s));
        const float e = m_new != -INFINITY ? exp2f(s - m_new) : 0.0f;
        const float c = m_new != -INFINITY ? exp2f(m_run - m_new) : 1.0f;
        l = l * c + e;
        m_run = m_new;
#pragma unroll
        for (int d = 0; d < DPL; d++)
            acc[d] *= c;
#pragma unroll 4
        for (uint32_t p = 0; p < nv; p++) {
            const float w = __shfl_sync(OPS_FULL_MASK, e, p);
            const char *row = t0 + p == pos ? (const char *)s_vn : sv + (size_t)p * rs;
            float vf[DPL];
            attn_load<DPL, true>(row, off, true, vf);
#pragma unroll
            for (int d = 0; d < DPL; d++)
                acc[d] = fmaf(w, vf[d], acc[d]);
        }
        __syncthreads(); /* slot i % 2 read by every warp */
        af_issue(a, ring, j, c0 + (i + 2) * AF_T, cached, i + 2);
    }
    attn_cp_wait<0>();
    const float lsum = ops_warp_sum(l);
    float o[DPL];
    if (n_splits == 1) {
#pragma unroll
        for (int d = 0; d < DPL; d++)
            o[d] = a.gated ? acc[d] / lsum * gf[d] : acc[d] / lsum;
        af_out<DPL>(a, h, o, s_row);
        return;
    }
    const size_t row = (size_t)split * a.n_head + h;
#pragma unroll
    for (int d = 0; d < DPL; d++)
        a.ws_acc[row * a.hd + off + d] = acc[d];
    if (lane == 0) {
        a.ws_ml[2 * row] = m_run;
        a.ws_ml[2 * row + 1] = lsum;
    }
    __threadfence(); /* this thread's triple before the block's arrival */
    __syncthreads();
    if (threadIdx.x == 0) {
        s_last = atomicAdd(&af_ctr[j], 1u) + 1u == n_splits;
        if (s_last)
            af_ctr[j] = 0; /* every split of j has arrived: ready for the next launch */
    }
    __syncthreads();
    if (!s_last)
        return;
    __threadfence(); /* the other blocks' triples, read through L2 */
    /* the first AF_ROUND splits' triples in one round of loads, their m by every lane,
     * before M (the loads after it, past them; a round a split saved where a context has
     * few splits); the same values and order, so the same bits */
    float2 mlp[AF_ROUND];
    float xp[AF_ROUND][DPL];
#pragma unroll
    for (uint32_t sp = 0; sp < AF_ROUND; sp++) {
        const size_t r = (size_t)sp * a.n_head + h;
        const bool in = sp < n_splits;
        mlp[sp] = in ? __ldcg((const float2 *)(a.ws_ml + 2 * r)) : make_float2(-INFINITY, 0.0f);
#pragma unroll
        for (int d = 0; d < DPL; d++)
            xp[sp][d] = in ? __ldcg(a.ws_acc + r * a.hd + off + d) : 0.0f;
    }
    float M = -INFINITY;
    if (n_splits > AF_ROUND) {
        for (uint32_t sp = AF_ROUND + lane; sp < n_splits; sp += 32)
            M = fmaxf(M, __ldcg(a.ws_ml + 2 * ((size_t)sp * a.n_head + h)));
        M = ops_warp_max(M);
    }
#pragma unroll
    for (uint32_t sp = 0; sp < AF_ROUND; sp++)
        M = fmaxf(M, mlp[sp].x);
    float L = 0.0f, A[DPL];
#pragma unroll
    for (int d = 0; d < DPL; d++)
        A[d] = 0.0f;
#pragma unroll
    for (uint32_t sp = 0; sp < AF_ROUND; sp++) {
        if (sp >= n_splits)
            break;
        af_merge_add<DPL>(mlp[sp], xp[sp], M, L, A);
    }
#pragma unroll 4
    for (uint32_t sp = AF_ROUND; sp < n_splits; sp++) {
        const size_t r = (size_t)sp * a.n_head + h;
        const float2 ml = __ldcg((const float2 *)(a.ws_ml + 2 * r));
        float x[DPL];
#pragma unroll
        for (int d = 0; d < DPL; d++)
            x[d] = __ldcg(a.ws_acc + r * a.hd + off + d);
        af_merge_add<DPL>(ml, x, M, L, A);
    }
#pragma unroll
    for (int d = 0; d < DPL; d++)
        o[d] = a.gated ? A[d] / L * gf[d] : A[d] / L;
    af_out<DPL>(a, h, o, s_row);
}

/* ---- host side ---- */

static int attn_dpl(uint32_t hd)
{
    return hd <= 32 ? 1 : hd <= 64 ? 2 : hd <= 128 ? 4 : 8;
}

static uint32_t attn_div_up(uint64_t a, uint64_t b)
{
    return (uint32_t)((a + b - 1) / b);
}

/* The shared memory carveout of the decode kernel's launches: the driver's
 * choice (-1), not every other launch's (pdl_carveout: 50 % on an H200, a
 * 132 KB split, where one block of the f16 ring at hd 256, 96 KiB, fits an SM
 * and a long context's blocks run one an SM). Measured on the H200
 * (docs/perf.md, thirty-third session): one step of hd 256 at 65536
 * positions 84.1 us against 109.5 with the split, at 4096 27.4 against 33.0,
 * tg128 at depth 4096 479.13 against 465.06 and 466.75 tok/s, tg128 at an
 * empty context unchanged (509.03 against 510.97 and 508.58).
 * LAMINA_CUDA_ATTN_CARVEOUT=N (0-100; -1 the driver's choice) sets it, for
 * this kernel alone. Read at each launch. */
static int attn_carveout()
{
    const char *env = getenv("LAMINA_CUDA_ATTN_CARVEOUT");
    if (!env || !*env)
        return -1;
    char *end = nullptr;
    const long v = strtol(env, &end, 10);
    return *end || v < -1 || v > 100 ? -1 : static_cast<int>(v);
}

/* LAMINA_CUDA_ATTN_RING=lean: the f16 ring at eight heads a block (hd 256's)
 * stages one sub-step a step instead of two, 48 KiB a block instead of 96, so
 * that two blocks fit an SM even in a 50 % split: the other cure for what the
 * carveout above cures, measured as fast, not faster (docs/perf.md,
 * thirty-third session), so opt-in. Read at each launch. */
static bool attn_ring_lean()
{
    const char *env = getenv("LAMINA_CUDA_ATTN_RING");
    return env && strcmp(env, "lean") == 0;
}

/* Launches one decode instance: with the cp.async ring where the device has
 * it (compute capability >= 8) and the instance uses one. */
template <int DPL, int NR, bool F16, bool LEAN>
static int attn_decode_go_ring(const struct attn_args &a, dim3 grid, bool cp_async,
                               cudaStream_t stream)
{
    using R = attn_ring<DPL, NR, F16, LEAN>;
    const bool ring = R::ON && cp_async; /* as the device code decides */
    const size_t acc = (size_t)ATTN_DECODE_WARPS * NR * DPL * 32 * sizeof(float);
    const size_t smem = ring && R::BYTES > acc ? R::BYTES : acc;
    if (smem > 40 * 1024) { /* past 48 KiB with the static arrays: opt in */
        const int rc = cuda_caps_allow_smem(
            (const void *)attn_decode_kernel<DPL, NR, F16, LEAN>, smem, "cuda_attention");
        if (rc)
            return rc;
    }
    pdl_launch_cv(attn_decode_kernel<DPL, NR, F16, LEAN>, grid, ATTN_DECODE_WARPS * 32, 1,
                  attn_carveout(), smem, stream, a);
    return 0;
}

template <int DPL, int NR, bool F16>
static int attn_decode_go(const struct attn_args &a, dim3 grid, bool cp_async,
                          cudaStream_t stream)
{
    if constexpr (F16 && NR == 8 && DPL == 8 && attn_ring<DPL, NR, F16, true>::ON) {
        if (cp_async && attn_ring_lean())
            return attn_decode_go_ring<DPL, NR, F16, true>(a, grid, cp_async, stream);
    }
    return attn_decode_go_ring<DPL, NR, F16, false>(a, grid, cp_async, stream);
}

template <int DPL, bool F16>
static int attn_launch_decode_nr(const struct attn_args &a, int nr, dim3 grid, bool cp_async,
                                 cudaStream_t stream)
{
    switch (nr) {
    case 1: return attn_decode_go<DPL, 1, F16>(a, grid, cp_async, stream);
    case 2: return attn_decode_go<DPL, 2, F16>(a, grid, cp_async, stream);
    case 4: return attn_decode_go<DPL, 4, F16>(a, grid, cp_async, stream);
    default: return attn_decode_go<DPL, 8, F16>(a, grid, cp_async, stream);
    }
}

template <bool F16>
static int attn_launch_decode(const struct attn_args &a, int dpl, int nr, dim3 grid,
                              bool cp_async, cudaStream_t stream)
{
    switch (dpl) {
    case 1: return attn_launch_decode_nr<1, F16>(a, nr, grid, cp_async, stream);
    case 2: return attn_launch_decode_nr<2, F16>(a, nr, grid, cp_async, stream);
    case 4: return attn_launch_decode_nr<4, F16>(a, nr, grid, cp_async, stream);
    default: return attn_launch_decode_nr<8, F16>(a, nr, grid, cp_async, stream);
    }
}

template <bool F16>
static void attn_launch_prefill(const struct attn_args &a, int dpl, dim3 grid, size_t smem,
                                cudaStream_t stream)
{
    const dim3 block(ATTN_PREFILL_WARPS * 32);
    switch (dpl) {
    case 1: attn_prefill_kernel<1, F16><<<grid, block, smem, stream>>>(a); break;
    case 2: attn_prefill_kernel<2, F16><<<grid, block, smem, stream>>>(a); break;
    case 4: attn_prefill_kernel<4, F16><<<grid, block, smem, stream>>>(a); break;
    default: attn_prefill_kernel<8, F16><<<grid, block, smem, stream>>>(a); break;
    }
}

/* Heads per block: the largest divisor of G not above cap. */
static uint32_t attn_group_heads(uint32_t G, uint32_t cap)
{
    uint32_t ng = G < cap ? G : cap;
    while (G % ng)
        ng--;
    return ng;
}

/* The split count attn_plan_splits aims at for n_kv positions: one per
 * min_chunk positions, at most max_blocks / units (and ATTN_MAX_SPLITS). */
static uint32_t attn_split_bound(uint32_t n_kv, uint32_t units, uint32_t min_chunk,
                                 uint32_t max_blocks)
{
    uint32_t want = attn_div_up(n_kv, min_chunk), cap = max_blocks / units;
    cap = cap < 1 ? 1 : cap > ATTN_MAX_SPLITS ? ATTN_MAX_SPLITS : cap;
    return want < cap ? want : cap;
}

/* Splits of n_kv positions for `units` blocks per split: chunks of at least
 * min_chunk positions (a multiple of `align`), at most max_blocks blocks. */
static void attn_plan_splits(struct attn_args *a, uint32_t n_kv, uint32_t units,
                             uint32_t min_chunk, uint32_t max_blocks, uint32_t align)
{
    const uint32_t n = attn_split_bound(n_kv, units, min_chunk, max_blocks);
    a->chunk = attn_div_up(attn_div_up(n_kv, n), align) * align;
    a->n_splits = attn_div_up(n_kv, a->chunk);
}

/* The most splits attn_plan_splits(n, units, min_chunk, max_blocks, 16) (a's)
 * plans for any n up to max_kv (at least two: see cuda_attention_decode_at).
 * Not the plan of max_kv itself: the chunk's rounding makes the count fall
 * as n grows (65536 positions at 256 splits a kv head plan 256 splits of 256,
 * 68536 plan 252 of 272). A plan's count is at most attn_split_bound's n (its
 * chunk is at least n_kv / n), which never falls as n_kv grows. */
static uint32_t attn_decode_splits_most(const struct attn_args &a, uint32_t max_kv)
{
    const uint32_t n = attn_split_bound(max_kv, a.units, a.min_chunk, a.max_blocks);
    return n < 2 ? 2 : n;
}

static int attn_check(const float *d_q, size_t q_head_stride, const void *d_kcache,
                      const void *d_vcache, uint32_t n_head, uint32_t n_head_kv, uint32_t hd,
                      uint32_t n_tok, uint32_t pos0, bool gated, const float *d_out)
{
    const bool bad_ptr = !d_q || !d_kcache || !d_vcache || !d_out ||
                         (uintptr_t)d_kcache % 16 || (uintptr_t)d_vcache % 16;
    const bool bad_shape = n_head == 0 || n_head_kv == 0 || n_head % n_head_kv || hd == 0 ||
                           hd > ATTN_MAX_HD || hd % 8 || (n_head > 1 && q_head_stride < hd) ||
                           (gated && q_head_stride < 2 * (size_t)hd && n_head > 1) ||
                           (uint64_t)pos0 + n_tok > (1u << 30) ||
                           (uint64_t)n_head * n_tok > (1u << 31);
    if (bad_ptr || bad_shape) {
        log_error("cuda_attention: bad arguments (q %p, kcache %p, vcache %p, out %p, n_head %u, "
                  "n_head_kv %u, hd %u, q_head_stride %zu, n_tok %u, pos0 %u, gated %d)",
                  (const void *)d_q, d_kcache, d_vcache, (const void *)d_out, n_head, n_head_kv,
                  hd, q_head_stride, n_tok, pos0, (int)gated);
        return -EINVAL;
    }
    return 0;
}

static int attn_ws_alloc(struct attn_args *a, cudaStream_t stream)
{
    const size_t rows = (size_t)a->n_splits * a->n_tok * a->n_head;
    void *ws = nullptr;
    const cudaError_t e = cudaMallocAsync(&ws, rows * (a->hd + 2) * sizeof(float), stream);
    if (e != cudaSuccess) {
        log_error("cuda_attention: workspace of %zu bytes for %u splits: %s",
                  rows * (a->hd + 2) * sizeof(float), a->n_splits, cudaGetErrorString(e));
        return e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
    }
    a->ws_acc = (float *)ws; /* first: its rows stay 16-byte aligned */
    a->ws_ml = a->ws_acc + rows * a->hd;
    return 0;
}

/* Positions per decode split, at least: dflt (ATTN_MIN_CHUNK, AM_MIN_CHUNK), or
 * LAMINA_CUDA_ATTN_CHUNK (16 to 4096, a multiple of 16; read at each call,
 * for measurements: other splits give other roundings). */
static uint32_t attn_min_chunk(uint32_t dflt)
{
    const char *env = getenv("LAMINA_CUDA_ATTN_CHUNK");
    const long v = env ? strtol(env, nullptr, 10) : 0;
    return v >= 16 && v <= 4096 && v % 16 == 0 ? static_cast<uint32_t>(v) : dflt;
}

/* Blocks of the split decode, at most: dflt (ATTN_MAX_BLOCKS, AM_MAX_BLOCKS), or
 * LAMINA_CUDA_ATTN_BLOCKS (16 to 4096; read at each call, for measurements:
 * other splits give other roundings). */
static uint32_t attn_max_blocks(uint32_t dflt)
{
    const char *env = getenv("LAMINA_CUDA_ATTN_BLOCKS");
    const long v = env ? strtol(env, nullptr, 10) : 0;
    return v >= 16 && v <= 4096 ? static_cast<uint32_t>(v) : dflt;
}

/* Whether the last attention the calling thread launched here ran a tensor-core
 * kernel (cuda_attention_last_mma; tests). */
static thread_local bool attn_last_mma = false;

/* Whether an attention of these arguments runs attn_mma_kernel (one token) or
 * attn_mma_prefill_kernel (where its shared memory fits the card, below): not
 * refused (LAMINA_CUDA_ATTN_MMA=0, read at each call), an f16 cache, hd 16, 32,
 * 64, 128 or 256 and compute capability 8.0 or later. On an H200 (docs/perf.md,
 * thirty-sixth session) the decode as fast at 4096 positions at hd 256 (1.4 times
 * faster at hd 128) and 1.4 to 1.6 times faster at 16384 and 65536, the prefill 3.8
 * to 5.0 times. */
static bool attn_mma_takes(const struct attn_args &a, bool f16)
{
    const char *env = getenv("LAMINA_CUDA_ATTN_MMA");
    const bool hd = a.hd == 16 || a.hd == 32 || a.hd == 64 || a.hd == 128 || a.hd == 256;
    return !(env && strcmp(env, "0") == 0) && f16 && hd && cuda_caps_cc() >= 80;
}

/* The tensor-core kernel's splits: longer chunks (one tile for each of its 4
 * warps) and fewer blocks (one wave of one an SM at hd 256), unless
 * LAMINA_CUDA_ATTN_CHUNK / _BLOCKS say (then the same as the default plan's).
 * So never more splits than the default plan: cuda_attention_decode_ws_bytes
 * holds either. */
static void attn_mma_limits(struct attn_args *a)
{
    static_assert((int)AM_MIN_CHUNK >= (int)ATTN_MIN_CHUNK &&
                      (int)AM_MAX_BLOCKS <= (int)ATTN_MAX_BLOCKS,
                  "the tensor-core plan has at most the default plan's splits");
    a->min_chunk = attn_min_chunk(AM_MIN_CHUNK);
    a->max_blocks = attn_max_blocks(AM_MAX_BLOCKS);
}

/* The arguments every path shares. */
static struct attn_args attn_setup(const float *d_q, size_t q_tok_stride, size_t q_head_stride,
                                   const void *d_kcache, const void *d_vcache, uint32_t n_head,
                                   uint32_t n_head_kv, uint32_t hd, uint32_t n_tok,
                                   uint32_t pos0, float scale, bool gated, float *d_out)
{
    struct attn_args a = {};
    a.q = d_q;
    a.q_tok_stride = q_tok_stride;
    a.q_head_stride = q_head_stride;
    a.k = (const char *)d_kcache;
    a.v = (const char *)d_vcache;
    a.n_head = n_head;
    a.n_head_kv = n_head_kv;
    a.hd = hd;
    a.n_tok = n_tok;
    a.pos0 = pos0;
    a.G = n_head / n_head_kv;
    a.NG = attn_group_heads(a.G, ATTN_ROWS);
    a.n_groups = a.G / a.NG;
    a.units = n_head_kv * a.n_groups;
    a.scale_log2 = scale * 1.4426950408889634f;
    a.gated = gated;
    a.out = d_out;
    a.min_chunk = attn_min_chunk(ATTN_MIN_CHUNK);
    a.max_blocks = attn_max_blocks(ATTN_MAX_BLOCKS);
    return a;
}

/* Launches attn_mma_kernel<HD, S>: 4 warps a block, fewer where the card's shared
 * memory a block holds less. */
template <int HD, int S>
static int attn_mma_go_s(const struct attn_args &a, dim3 grid, cudaStream_t stream)
{
    int cc = 0, optin = 0;
    int rc = cuda_caps_get(&cc, &optin);
    int nw = AM_MAX_WARPS;
    while (!rc && nw > 1 && attn_mma_smem<HD, S>(nw) > (size_t)optin - 1024)
        nw /= 2;
    const size_t smem = attn_mma_smem<HD, S>(nw);
    if (!rc && smem > 40 * 1024)
        rc = cuda_caps_allow_smem((const void *)attn_mma_kernel<HD, S>, smem, "cuda_attention");
    if (rc)
        return rc;
    pdl_launch_cv(attn_mma_kernel<HD, S>, grid, nw * 32, 1, attn_carveout(), smem, stream, a);
    return 0;
}

/* LAMINA_CUDA_ATTN_MMA_STAGES=3: the decode's rings of three slots (two tiles ahead; 211 KiB
 * of shared memory a block at hd 256 with 4 warps), at hd 128 and 256; else two. Read at
 * each call, for measurements. */
template <int HD>
static int attn_mma_go(const struct attn_args &a, dim3 grid, cudaStream_t stream)
{
    if constexpr (HD >= 128) {
        const char *env = getenv("LAMINA_CUDA_ATTN_MMA_STAGES");
        if (env && strcmp(env, "3") == 0)
            return attn_mma_go_s<HD, 3>(a, grid, stream);
    }
    return attn_mma_go_s<HD, 2>(a, grid, stream);
}

/* f.template run<HD>() for the head dims the tensor-core kernels take (16 .. 256;
 * attn_mma_takes has checked it). */
template <typename F>
static auto attn_mma_hd(uint32_t hd, const F &f) -> decltype(f.template run<16>())
{
    switch (hd) {
    case 16: return f.template run<16>();
    case 32: return f.template run<32>();
    case 64: return f.template run<64>();
    case 128: return f.template run<128>();
    default: return f.template run<256>();
    }
}

/* The K/V tile of the prefill kernel at HD on this card: AMP_TILE positions where its
 * shared memory fits a block, else 16 at hd 256 (sm_86 and sm_89 give a block 99 KiB, the
 * tiles of 32 take 130), else 0: the CUDA-core kernel runs. */
template <int HD>
static int attn_mma_pf_tile()
{
    int cc = 0, optin = 0;
    if (cuda_caps_get(&cc, &optin))
        return 0;
    if (attn_mma_pf_smem<HD, AMP_TILE>() + 1024 <= (size_t)optin)
        return AMP_TILE;
    return HD == 256 && attn_mma_pf_smem<HD, 16>() + 1024 <= (size_t)optin ? 16 : 0;
}

struct attn_mma_pf_tiles {
    template <int HD>
    int run() const
    {
        return attn_mma_pf_tile<HD>();
    }
};

static bool attn_mma_pf_fits(uint32_t hd)
{
    return attn_mma_hd(hd, attn_mma_pf_tiles{}) > 0;
}

template <int HD, int T>
static int attn_mma_pf_go_t(const struct attn_args &a, dim3 grid, cudaStream_t stream)
{
    const size_t smem = attn_mma_pf_smem<HD, T>();
    if (smem > 40 * 1024) {
        const int rc = cuda_caps_allow_smem((const void *)attn_mma_prefill_kernel<HD, T>, smem,
                                            "cuda_attention");
        if (rc)
            return rc;
    }
    attn_mma_prefill_kernel<HD, T><<<grid, AMP_WARPS * 32, smem, stream>>>(a);
    return 0;
}

template <int HD>
static int attn_mma_pf_go(const struct attn_args &a, dim3 grid, cudaStream_t stream)
{
    if constexpr (HD == 256) {
        if (attn_mma_pf_tile<HD>() == 16)
            return attn_mma_pf_go_t<HD, 16>(a, grid, stream);
    }
    return attn_mma_pf_go_t<HD, AMP_TILE>(a, grid, stream);
}

/* The launch of either tensor-core kernel for attn_mma_hd. */
struct attn_mma_launch {
    const struct attn_args &a;
    dim3 grid;
    cudaStream_t stream;
    bool prefill;
    template <int HD>
    int run() const
    {
        return prefill ? attn_mma_pf_go<HD>(a, grid, stream) : attn_mma_go<HD>(a, grid, stream);
    }
};

static int attn_decode(const struct attn_args &a, bool f16, bool mma, cudaStream_t stream)
{
    const int nr = a.NG <= 1 ? 1 : a.NG <= 2 ? 2 : a.NG <= 4 ? 4 : 8;
    const bool cp_async = cuda_caps_cc() >= 80;
    const dim3 grid(a.n_splits, a.units);
    const int dpl = attn_dpl(a.hd);
    attn_last_mma = mma;
    int rc = mma ? attn_mma_hd(a.hd, attn_mma_launch{a, grid, stream, false})
             : f16 ? attn_launch_decode<true>(a, dpl, nr, grid, cp_async, stream)
                   : attn_launch_decode<false>(a, dpl, nr, grid, cp_async, stream);
    rc = rc ? rc : OPS_LAUNCH_CHECK("cuda_attention");
    if (!rc && a.n_splits > 1) {
        pdl_launch(attn_combine_kernel, dim3(a.n_head, attn_div_up(a.hd, 32)), 256, 0, stream, a);
        rc = OPS_LAUNCH_CHECK("cuda_attention (combine)");
    }
    return rc;
}

extern "C" bool cuda_attention_last_mma(void)
{
    return attn_last_mma;
}

extern "C" size_t cuda_attention_decode_ws_bytes(uint32_t n_head, uint32_t n_head_kv,
                                                 uint32_t hd, uint32_t max_kv)
{
    if (!n_head || !n_head_kv || n_head % n_head_kv || !max_kv)
        return 0;
    struct attn_args a = attn_setup(nullptr, 0, 0, nullptr, nullptr, n_head, n_head_kv, hd, 1,
                                    0, 1.0f, false, nullptr);
    const size_t splits = attn_decode_splits_most(a, max_kv);
    return splits * n_head * (hd + 2) * sizeof(float);
}

extern "C" int cuda_attention_decode_at(const float *d_q, size_t q_head_stride,
                                        const void *d_kcache, const void *d_vcache, bool f16,
                                        uint32_t n_head, uint32_t n_head_kv, uint32_t hd,
                                        const uint32_t *d_pos, uint32_t max_kv, float scale,
                                        bool gated, float *d_out, float *d_ws, size_t ws_bytes,
                                        cudaStream_t stream)
{
    return cuda_attention_decode_at_xq(d_q, q_head_stride, d_kcache, d_vcache, f16, n_head,
                                       n_head_kv, hd, d_pos, max_kv, scale, gated, d_out, NULL,
                                       d_ws, ws_bytes, stream);
}

extern "C" int cuda_attention_decode_at_xq(const float *d_q, size_t q_head_stride,
                                           const void *d_kcache, const void *d_vcache, bool f16,
                                           uint32_t n_head, uint32_t n_head_kv, uint32_t hd,
                                           const uint32_t *d_pos, uint32_t max_kv, float scale,
                                           bool gated, float *d_out, int8_t *d_outq,
                                           float *d_ws, size_t ws_bytes, cudaStream_t stream)
{
    int rc = attn_check(d_q, q_head_stride, d_kcache, d_vcache, n_head, n_head_kv, hd, 1,
                        max_kv ? max_kv - 1 : 0, gated, d_out);
    const size_t need = cuda_attention_decode_ws_bytes(n_head, n_head_kv, hd, max_kv);
    if (!rc && (!d_pos || !max_kv || !d_ws || ws_bytes < need || (uintptr_t)d_ws % 16)) {
        log_error("cuda_attention_decode_at: bad arguments (pos %p, max_kv %u, workspace %p of "
                  "%zu bytes, %zu needed)", (const void *)d_pos, max_kv, (void *)d_ws, ws_bytes,
                  need);
        rc = -EINVAL;
    }
    if (rc)
        return rc;
    if (d_outq && (hd % 32 || (uintptr_t)d_outq % 16))
        return -ENOTSUP;
    struct attn_args a = attn_setup(d_q, 0, q_head_stride, d_kcache, d_vcache, n_head,
                                    n_head_kv, hd, 1, 0, scale, gated, d_out);
    a.pos_ptr = d_pos;
    a.outq = d_outq;
    const bool mma = attn_mma_takes(a, f16);
    if (mma)
        attn_mma_limits(&a);
    /* grid: the most splits any position up to max_kv plans, at least two so
     * that the combine always runs (one split through the combine gives the
     * direct path's result bit for bit: weight 1, sums of zeros); the blocks
     * past a position's own plan have empty ranges */
    a.n_splits = attn_decode_splits_most(a, max_kv);
    a.ws_acc = d_ws;
    a.ws_ml = d_ws + (size_t)a.n_splits * n_head * hd;
    return attn_decode(a, f16, mma, stream);
}

extern "C" int cuda_attention(const float *d_q, size_t q_tok_stride, size_t q_head_stride,
                              const void *d_kcache, const void *d_vcache, bool f16,
                              uint32_t n_head, uint32_t n_head_kv, uint32_t hd, uint32_t n_tok,
                              uint32_t pos0, float scale, bool gated, float *d_out,
                              cudaStream_t stream)
{
    int rc = attn_check(d_q, q_head_stride, d_kcache, d_vcache, n_head, n_head_kv, hd, n_tok,
                        pos0, gated, d_out);
    if (rc || n_tok == 0)
        return rc;
    struct attn_args a = attn_setup(d_q, q_tok_stride, q_head_stride, d_kcache, d_vcache, n_head,
                                    n_head_kv, hd, n_tok, pos0, scale, gated, d_out);
    const int dpl = attn_dpl(hd);
    const uint32_t esz = f16 ? 2 : 4;
    if (n_tok == 1) {
        const bool mma = attn_mma_takes(a, f16);
        if (mma)
            attn_mma_limits(&a);
        attn_plan_splits(&a, pos0 + 1, a.units, a.min_chunk, a.max_blocks, 16);
        if (a.n_splits > 1 && (rc = attn_ws_alloc(&a, stream)))
            return rc;
        rc = attn_decode(a, f16, mma, stream);
    } else {
        uint32_t tile = ATTN_TILE_BYTES / (2 * hd * esz);
        a.tile = tile > 64 ? 64 : tile / 4 * 4;
        const size_t smem = (size_t)2 * a.tile * hd * esz;
        const uint32_t tiles = attn_div_up(n_tok, ATTN_PREFILL_WARPS * ATTN_ROWS / a.NG);
        attn_plan_splits(&a, pos0 + n_tok, tiles * a.units, 512, 256, a.tile);
        const dim3 grid(tiles, a.units, a.n_splits);
        if (a.n_splits > 1 && (rc = attn_ws_alloc(&a, stream)))
            return rc;
        /* the tensor-core kernel's blocks are 4 warps of 16 rows: the same 64 rows */
        static_assert((int)AMP_WARPS * 16 == (int)ATTN_PREFILL_WARPS * (int)ATTN_ROWS,
                      "both prefill kernels' blocks own 64 rows");
        attn_last_mma = attn_mma_takes(a, f16) && attn_mma_pf_fits(hd);
        if (attn_last_mma)
            rc = attn_mma_hd(hd, attn_mma_launch{a, grid, stream, true});
        else if (f16)
            attn_launch_prefill<true>(a, dpl, grid, smem, stream);
        else
            attn_launch_prefill<false>(a, dpl, grid, smem, stream);
        rc = rc ? rc : OPS_LAUNCH_CHECK("cuda_attention");
        if (!rc && a.n_splits > 1) {
            attn_combine_kernel<<<dim3(n_tok * n_head, attn_div_up(hd, 32)), 256, 0, stream>>>(a);
            rc = OPS_LAUNCH_CHECK("cuda_attention (combine)");
        }
    }
    if (a.ws_acc) {
        const cudaError_t e = cudaFreeAsync(a.ws_acc, stream);
        if (e != cudaSuccess) {
            log_error("cuda_attention: workspace free failed: %s", cudaGetErrorString(e));
            rc = rc ? rc : -EIO;
        }
    }
    return rc;
}

/* ---- the fused decode (af_*, attn_fused_kernel) ---- */

/* Splits a kv head at most: 32, or LAMINA_CUDA_ATTN_SPLITS=N (1 .. AF_MAX_SPLITS,
 * read at each call: the workspace's size and the launch must read the same). */
static uint32_t af_splits()
{
    const char *env = getenv("LAMINA_CUDA_ATTN_SPLITS");
    const long n = env ? strtol(env, nullptr, 10) : 0;
    return n >= 1 && n <= AF_MAX_SPLITS ? (uint32_t)n : 32u;
}

static uint32_t af_cap(uint32_t max_kv)
{
    const uint32_t cap = attn_div_up(max_kv, AF_T), most = af_splits();
    return cap < most ? cap : most;
}

static size_t af_smem(uint32_t hd, uint32_t ng)
{
    return (size_t)4 * AF_T * (hd * 2 + 16) + (size_t)ng * hd * sizeof(float) +
           (size_t)2 * hd * 2 + (size_t)hd * sizeof(float);
}

extern "C" size_t cuda_attention_fused_ws_bytes(uint32_t n_head, uint32_t n_head_kv, uint32_t hd,
                                                uint32_t max_kv)
{
    if (!n_head || !n_head_kv || n_head % n_head_kv || !max_kv)
        return 0;
    return (size_t)af_cap(max_kv) * n_head * (hd + 2) * sizeof(float);
}

/* Whether the fused decode is not refused (LAMINA_CUDA_ATTN_FUSED=0, read at
 * each call) and takes the shape on this device. */
static bool af_takes(bool f16, uint32_t n_head, uint32_t n_head_kv, uint32_t hd, size_t smem)
{
    const char *env = getenv("LAMINA_CUDA_ATTN_FUSED");
    if (env && !strcmp(env, "0"))
        return false;
    if (!f16 || (hd != 32 && hd != 64 && hd != 128 && hd != 256) || n_head % n_head_kv ||
        n_head / n_head_kv > AF_MAX_NG || n_head_kv > AF_MAX_KV)
        return false;
    int cc = 0, optin = 0;
    return !cuda_caps_get(&cc, &optin) && cc >= 80 && smem + 1024 <= (size_t)optin;
}

template <int DPL>
static int af_launch(const struct af_args &a, size_t smem, cudaStream_t stream)
{
    const int rc = cuda_caps_allow_smem((const void *)attn_fused_kernel<DPL>, smem,
                                        "cuda_attention_decode_fused");
    if (rc)
        return rc;
    pdl_launch(attn_fused_kernel<DPL>, dim3(a.cap, a.n_head_kv), a.NG * 32, smem, stream, a);
    return OPS_LAUNCH_CHECK("cuda_attention_decode_fused");
}

extern "C" int cuda_attention_decode_fused(const float *d_q, size_t q_head_stride,
                                           const float *d_k, const float *d_v,
                                           const float *d_q_norm, const float *d_k_norm,
                                           float eps, uint32_t n_rot, float base, void *d_kcache,
                                           void *d_vcache, bool f16, uint32_t n_head,
                                           uint32_t n_head_kv, uint32_t hd,
                                           const uint32_t *d_pos, uint32_t max_kv, float scale,
                                           bool gated, float *d_out, int8_t *d_outq,
                                           float *d_ws, size_t ws_bytes, cudaStream_t stream)
{
    int rc = attn_check(d_q, q_head_stride, d_kcache, d_vcache, n_head, n_head_kv, hd, 1,
                        max_kv ? max_kv - 1 : 0, gated, d_out);
    const size_t need = cuda_attention_fused_ws_bytes(n_head, n_head_kv, hd, max_kv);
    if (!rc && (!d_k || !d_v || !d_pos || !max_kv || n_rot > hd || n_rot % 2 ||
                !(base > 0.0f) || !d_ws || ws_bytes < need || (uintptr_t)d_ws % 16)) {
        log_error("cuda_attention_decode_fused: bad arguments (k %p, v %p, pos %p, max_kv %u, "
                  "n_rot %u, base %g, workspace %p of %zu bytes, %zu needed)",
                  (const void *)d_k, (const void *)d_v, (const void *)d_pos, max_kv, n_rot,
                  (double)base, (void *)d_ws, ws_bytes, need);
        rc = -EINVAL;
    }
    if (rc)
        return rc;
    const uint32_t ng = n_head / n_head_kv;
    const size_t smem = af_smem(hd, ng);
    if (!af_takes(f16, n_head, n_head_kv, hd, smem) || (d_outq && (uintptr_t)d_outq % 16))
        return -ENOTSUP;
    struct af_args a = {};
    a.q = d_q;
    a.q_head_stride = q_head_stride;
    a.k = d_k;
    a.v = d_v;
    a.q_norm = d_q_norm;
    a.k_norm = d_k_norm;
    a.eps = eps;
    a.base = base;
    a.half = n_rot / 2;
    a.kc = (__half *)d_kcache;
    a.vc = (__half *)d_vcache;
    a.n_head = n_head;
    a.n_head_kv = n_head_kv;
    a.hd = hd;
    a.NG = ng;
    a.cap = af_cap(max_kv);
    a.pos_ptr = d_pos;
    a.scale_log2 = scale * 1.4426950408889634f;
    a.gated = gated;
    a.out = d_out;
    a.outq = d_outq;
    a.ws_acc = d_ws;
    a.ws_ml = d_ws + (size_t)a.cap * n_head * hd;
    switch (hd / 32) {
    case 1: return af_launch<1>(a, smem, stream);
    case 2: return af_launch<2>(a, smem, stream);
    case 4: return af_launch<4>(a, smem, stream);
    case 8: return af_launch<8>(a, smem, stream);
    default: return -ENOTSUP;
    }
}
