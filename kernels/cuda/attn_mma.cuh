/*
 * attn_mma: attention's kernels on tensor cores, the split decode's per-split kernel
 * (attn_mma_kernel) and the prefill's (attn_mma_prefill_kernel), included by
 * attention.cu only (they use that file's attn_args, split plans, cp.async helpers and
 * warp merge). The default where they take the shape; LAMINA_CUDA_ATTN_MMA=0 turns
 * them off (attention.cu's attn_mma_takes); the
 * splits' triples are those the CUDA-core kernels write, so attn_combine_kernel merges
 * them unchanged.
 *
 * Why: the CUDA-core decode kernel spends about 160 warp instructions a position
 * and kv head (f16 -> f32 conversions, a 31-shuffle reduce-scatter a sub-step, one
 * FMA per head, position and dimension, twice) at 8 warps an SM; at 65536
 * positions it read the cache at 1.6 TB/s on an H200 (docs/perf.md). Here a warp
 * takes 16 positions a step in 64 mma.sync instructions and 32 ldmatrix.
 *
 * Maths, per block (split, kv head j, its NG <= 8 query heads h0 ..): with the
 * scores transposed, S^T = K Q^T (16 positions x 8 heads, m16n8k16: A = K rows
 * from shared memory by ldmatrix, B = the heads' q), the online softmax per head
 * (column) as the file comment of attention.cu says (base 2, q pre-scaled), and
 * O^T += V^T P^T (16 dims x 8 heads a tile: A = V by ldmatrix.trans, B = the
 * weights, whose accumulator layout movmatrix.trans turns into the B operand).
 * Exactness: K and V are f16 in the cache, so only q and the weights p are
 * rounded to f16 for the products; each goes in two parts, hi = f16(x) and
 * lo = f16((x - hi) 4096), with their own accumulators (lo's scaled back by
 * 1/4096), which keeps 22 bits of each (about f32's error); products of f16s
 * are exact in the f32 accumulators. Heads past NG have q = 0 and are never
 * written; positions past the split's end are masked to -inf (their rows are
 * the last valid row again, so no NaN enters).
 *
 * Ownership: a block of nw warps (4, or 2 / 1 where the card's shared memory is
 * smaller) for one split; warp w takes the 16-position tiles c0 + 16 (w + nw i).
 * Each warp stages its tiles through a ring of its own of S slots (cp.async, S - 1
 * tiles ahead: S = 2, or 3 with LAMINA_CUDA_ATTN_MMA_STAGES=3 at hd 128 and 256, a
 * measurement switch; K then V, rows padded by 16 bytes so that ldmatrix's eight rows hit
 * distinct banks); the q fragments (hi and lo, per 16 dims and lane) are in shared
 * memory, shared by the warps. Lane (g, t) = (lane / 4, lane % 4) holds the
 * scores of positions g and g + 8 for heads 2t and 2t + 1, the running max and
 * sum of those two heads, and O^T's dims 16 m + g (+ 8) of them. At the end the
 * warps' triples go through shared memory and attn_merge_warps (ascending warp
 * order), to the output (one split) or the split's workspace row. Every reduction
 * has a fixed order: bit-identical run to run. Compute capability 8.0 or later
 * (mma.sync m16n8k16 f16); hd 16, 32, 64, 128 or 256.
 *
 * Prefill (attn_mma_prefill_kernel): the grid and rows of attn_prefill_kernel (a block
 * owns 64 rows, 64 / NG tokens x NG heads of one kv head, and a split of the positions),
 * 4 warps of 16 rows. Not transposed here: S = Q K^T (A = the rows' q, hi and lo, from
 * shared memory, each lane its own fragments; B = K by ldmatrix), and O += P V with P
 * straight from S's accumulators (the m16n8 accumulator of two position tiles is the A
 * operand of 16 positions) and V by ldmatrix.trans. O has one accumulator (16 rows x hd:
 * 128 registers at hd 256), so the weights' lo part is not scaled: it goes into O beside
 * hi, and below 2^-2 it is an f16 subnormal (absolute error <= 2^-25 a weight). The
 * block's threads stage K/V tiles of 32 positions in two stages; a warp skips tiles past
 * its rows' last position, and masks each row at its own (causal) limit. 130 KiB of shared
 * memory a block at hd 256; where a block may have less (sm_86, sm_89: 99 KiB), tiles of 16
 * positions (97 KiB).
 *
 * tools/attn_mma_sim.py emulates these fragment layouts with numpy and runs both kernels'
 * index arithmetic on the CPU: a change to the lane or address expressions here should
 * be mirrored there and checked before a device call.
 */
#ifndef KERNELS_CUDA_ATTN_MMA_CUH
#define KERNELS_CUDA_ATTN_MMA_CUH

#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ATTN_HAVE_MMA 1
#else
#define ATTN_HAVE_MMA 0
#endif

enum {
    AM_TILE = 16,      /* positions a warp step */
    AM_PAD = 16,       /* bytes past each staged row (banks) */
    AM_MAX_WARPS = 4,  /* warps a block, at most */
    AM_MIN_CHUNK = 64, /* positions a split, at least: one tile for each of 4 warps */
    AM_MAX_BLOCKS = 128, /* blocks of a split decode, at most: one wave of one an SM */
    AMP_TILE = 32,     /* prefill: positions of a K/V tile (16 where that does not fit) */
    AMP_WARPS = 4,     /* prefill: warps a block, 16 rows each */
};

/* q's second part is scaled up by this before rounding (and its sums down) */
constexpr float kAmLo = 4096.0f, kAmLoInv = 1.0f / 4096.0f;

template <int HD>
struct attn_mma_cfg {
    static constexpr int KC = HD / 16;             /* 16-dim chunks */
    static constexpr int PR = HD / 8;              /* 16-byte pieces of a row */
    static constexpr int ROW = HD * 2 + AM_PAD;    /* bytes of a staged row */
    static constexpr int TILE_BYTES = AM_TILE * ROW;
    static constexpr int SLOT = 2 * TILE_BYTES;    /* K rows, then V rows */
    static constexpr int Q_BYTES = KC * 32 * 16;   /* a uint4 a chunk and lane */
    /* after the loop the rings (two slots or more) hold the warps' accumulators, 8 heads x
     * HD floats each */
    static_assert(8 * HD * 4 <= 2 * SLOT, "accumulators fit a warp's ring");
};

/* Shared memory of the decode kernel: the q fragments and nw rings of S slots. */
template <int HD, int S>
static inline size_t attn_mma_smem(int nw)
{
    return (size_t)attn_mma_cfg<HD>::Q_BYTES + (size_t)nw * S * attn_mma_cfg<HD>::SLOT;
}

#if ATTN_HAVE_MMA

static __device__ __forceinline__ uint32_t am_u32(__half2 h)
{
    return *reinterpret_cast<uint32_t *>(&h);
}

static __device__ __forceinline__ void am_ldsm(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void am_ldsm_t(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* The 8 x 8 matrix of 16-bit pairs the warp holds in accumulator (and ldmatrix)
 * layout, transposed in the same layout. */
static __device__ __forceinline__ uint32_t am_trans(uint32_t x)
{
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

/* c += A B, m16n8k16, f16 operands, f32 accumulators */
static __device__ __forceinline__ void am_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x as f16 hi and scaled lo parts (see the file comment) */
static __device__ __forceinline__ void am_split(float x0, float x1, uint32_t *hi, uint32_t *lo)
{
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 f = __half22float2(h);
    *hi = am_u32(h);
    *lo = am_u32(__floats2half2_rn((x0 - f.x) * kAmLo, (x1 - f.y) * kAmLo));
}

/* The B fragments of the block's q (Q^T: 16 dims x 8 heads a chunk) into s_q:
 * entry (chunk, lane) = {hi b0b1, hi b2b3, lo b0b1, lo b2b3} of head lane / 4,
 * dims 16 chunk + 2 (lane % 4) (+ 1, + 8, + 9), pre-scaled; zeros past NG. */
template <int HD>
static __device__ __forceinline__ void am_load_q(const struct attn_args &a, uint32_t h0,
                                                 uint4 *s_q)
{
    for (uint32_t e = threadIdx.x; e < (uint32_t)HD / 16 * 32; e += blockDim.x) {
        const uint32_t kc = e / 32, head = e % 32 / 4, t = e % 4;
        const float *qrow = a.q + (size_t)(h0 + head) * a.q_head_stride;
        uint32_t w[4];
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const uint32_t d = kc * 16 + 2 * t + 8 * half;
            const bool on = head < a.NG;
            const float x0 = on ? qrow[d] * a.scale_log2 : 0.0f;
            const float x1 = on ? qrow[d + 1] * a.scale_log2 : 0.0f;
            am_split(x0, x1, &w[half], &w[2 + half]);
        }
        s_q[e] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

/* One warp's state: O^T's tiles (hi and lo weights' sums), the running max and
 * sum of heads 2t, 2t + 1 (this lane's share of the sum: positions g, g + 8). */
template <int HD>
struct am_state {
    float oh[HD / 16][4], ol[HD / 16][4];
    float m[2], l[2];
};

/* Copies positions p .. p + 15 of K and V (rows past c1 - 1: row c1 - 1 again)
 * into a slot, each lane its share of 16-byte pieces, and commits a group. */
template <int HD>
static __device__ __forceinline__ void am_issue(char *slot, const char *kh, const char *vh,
                                                size_t row_bytes, uint32_t p, uint32_t c1,
                                                int lane)
{
    using C = attn_mma_cfg<HD>;
#pragma unroll
    for (int i = 0; i < AM_TILE * C::PR / 32; i++) {
        const int q = lane + 32 * i, row = q / C::PR, col = q % C::PR;
        const size_t at = (size_t)min(p + row, c1 - 1) * row_bytes + col * 16;
        attn_cp_async<16>(slot + row * C::ROW + col * 16, kh + at);
        attn_cp_async<16>(slot + C::TILE_BYTES + row * C::ROW + col * 16, vh + at);
    }
}

/* One tile of 16 positions from p (K rows at ks, V rows at vs, shared memory). */
template <int HD>
static __device__ __forceinline__ void am_tile(am_state<HD> &st, const char *ks, const char *vs,
                                               const uint4 *s_q, uint32_t p, uint32_t c1,
                                               int lane)
{
    using C = attn_mma_cfg<HD>;
    const uint32_t g = lane >> 2;
    /* S^T: hi and lo, even and odd chunks apart (four short chains) */
    float sa[4][4] = {};
    const uint32_t kb = (uint32_t)__cvta_generic_to_shared(ks) +
                        ((lane & 7) + 8 * ((lane >> 3) & 1)) * C::ROW + 16 * (lane >> 4);
#pragma unroll
    for (int kc = 0; kc < C::KC; kc++) {
        uint32_t ka[4];
        am_ldsm(ka, kb + kc * 32);
        const uint4 q = s_q[kc * 32 + lane];
        am_mma(sa[kc & 1], ka, q.x, q.y);
        am_mma(sa[2 + (kc & 1)], ka, q.z, q.w);
    }
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        s[i] = (sa[0][i] + sa[1][i]) + (sa[2][i] + sa[3][i]) * kAmLoInv;
    if (p + g >= c1)
        s[0] = s[1] = -INFINITY;
    if (p + g + 8 >= c1)
        s[2] = s[3] = -INFINITY;
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(OPS_FULL_MASK, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(OPS_FULL_MASK, mx1, o));
    }
    /* position p is below c1: both maxima are finite */
    const float mn0 = fmaxf(st.m[0], mx0), mn1 = fmaxf(st.m[1], mx1);
    const float cr0 = exp2f(st.m[0] - mn0), cr1 = exp2f(st.m[1] - mn1);
    const float e0 = exp2f(s[0] - mn0), e1 = exp2f(s[1] - mn1);
    const float e2 = exp2f(s[2] - mn0), e3 = exp2f(s[3] - mn1);
    st.l[0] = st.l[0] * cr0 + (e0 + e2);
    st.l[1] = st.l[1] * cr1 + (e1 + e3);
    st.m[0] = mn0;
    st.m[1] = mn1;
    if (__any_sync(OPS_FULL_MASK, cr0 != 1.0f || cr1 != 1.0f)) {
#pragma unroll
        for (int mt = 0; mt < C::KC; mt++) {
            st.oh[mt][0] *= cr0, st.oh[mt][1] *= cr1, st.oh[mt][2] *= cr0, st.oh[mt][3] *= cr1;
            st.ol[mt][0] *= cr0, st.ol[mt][1] *= cr1, st.ol[mt][2] *= cr0, st.ol[mt][3] *= cr1;
        }
    }
    /* P^T (positions x heads) in accumulator layout -> P^T as B (k positions, n heads) */
    uint32_t h01, h23, l01, l23;
    am_split(e0, e1, &h01, &l01);
    am_split(e2, e3, &h23, &l23);
    const uint32_t bh0 = am_trans(h01), bh1 = am_trans(h23);
    const uint32_t bl0 = am_trans(l01), bl1 = am_trans(l23);
    const uint32_t vb = (uint32_t)__cvta_generic_to_shared(vs) +
                        ((lane & 7) + 8 * (lane >> 4)) * C::ROW + 16 * ((lane >> 3) & 1);
#pragma unroll
    for (int mt = 0; mt < C::KC; mt++) {
        uint32_t va[4];
        am_ldsm_t(va, vb + mt * 32);
        am_mma(st.oh[mt], va, bh0, bh1);
        am_mma(st.ol[mt], va, bl0, bl1);
    }
}

/* This warp's tiles of [c0, c1) of kv head (kh, vh) through its ring of S slots, S - 1
 * tiles ahead (a group committed for each, empty past the last tile). */
template <int HD, int S>
static __device__ __forceinline__ void am_run(am_state<HD> &st, char *ring, const uint4 *s_q,
                                              const char *kh, const char *vh, size_t row_bytes,
                                              uint32_t c0, uint32_t c1, int warp, int nw,
                                              int lane)
{
    using C = attn_mma_cfg<HD>;
    const uint32_t first = c0 + warp * AM_TILE, step = nw * AM_TILE;
    const uint32_t n_tiles = first < c1 ? (c1 - first + step - 1) / step : 0;
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if ((uint32_t)s < n_tiles)
            am_issue<HD>(ring + s * C::SLOT, kh, vh, row_bytes, first + s * step, c1, lane);
        attn_cp_commit();
    }
    for (uint32_t i = 0; i < n_tiles; i++) {
        const uint32_t nx = i + S - 1;
        if (nx < n_tiles)
            am_issue<HD>(ring + (nx % S) * C::SLOT, kh, vh, row_bytes, first + nx * step, c1,
                         lane);
        attn_cp_commit();
        attn_cp_wait<S - 1>(); /* tile i has landed (this lane's pieces) */
        __syncwarp();          /* and every lane's */
        const char *slot = ring + (i % S) * C::SLOT;
        am_tile<HD>(st, slot, slot + C::TILE_BYTES, s_q, first + i * step, c1, lane);
        __syncwarp(); /* the slot is free for tile i + S */
    }
    attn_cp_wait<0>();
}

/* ---- prefill ---- */

/* This warp's q as A fragments (rows (token, head): g and g + 8 of the warp's 16, dims
 * 16 chunk + 2t (+ 1, + 8, + 9)), hi then lo, at s_q[2 (chunk 32 + lane) + 0 / 1]; each lane
 * writes and later reads only its own entries. Rows not valid: zeros. */
template <int HD>
static __device__ __forceinline__ void amp_load_q(const struct attn_args &a, const float *qr0,
                                                  const float *qr1, uint4 *s_q, int lane)
{
    const uint32_t t = lane & 3;
#pragma unroll 4
    for (int kc = 0; kc < HD / 16; kc++) {
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            /* register i: rows g (i even) or g + 8, dims + 8 from register 2 on */
            const float *qr = i & 1 ? qr1 : qr0;
            const uint32_t d = kc * 16 + 2 * t + 8 * (i >> 1);
            const float x0 = qr ? qr[d] * a.scale_log2 : 0.0f;
            const float x1 = qr ? qr[d + 1] * a.scale_log2 : 0.0f;
            am_split(x0, x1, &hi[i], &lo[i]);
        }
        s_q[2 * (kc * 32 + lane)] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        s_q[2 * (kc * 32 + lane) + 1] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
}

/* Positions t0 .. t0 + T - 1 of K and V into a stage by the block's threads (rows past
 * end - 1: row end - 1 again). */
template <int HD, int T>
static __device__ __forceinline__ void amp_issue(char *stage, const char *kh, const char *vh,
                                                 size_t row_bytes, uint32_t t0, uint32_t end)
{
    using C = attn_mma_cfg<HD>;
    for (uint32_t q = threadIdx.x; q < T * C::PR; q += blockDim.x) {
        const uint32_t row = q / C::PR, col = q % C::PR;
        const size_t at = (size_t)min(t0 + row, end - 1) * row_bytes + col * 16;
        attn_cp_async<16>(stage + row * C::ROW + col * 16, kh + at);
        attn_cp_async<16>(stage + T * C::ROW + row * C::ROW + col * 16, vh + at);
    }
}

/* One warp's running state: O (16 rows x HD: tile nd's columns 8 nd + 2t (+ 1) of rows
 * g, g + 8), and the max and this lane's share of the sum of rows g, g + 8. */
template <int HD>
struct amp_state {
    float o[HD / 8][4];
    float m[2], l[2];
};

/* One K/V tile of T positions (K rows at ks, V rows at vs) for this warp's rows; position
 * t0 + x counts for row e when below lim[e]. */
template <int HD, int T>
static __device__ __forceinline__ void amp_tile(amp_state<HD> &st, const char *ks,
                                                const char *vs, const uint4 *s_q, uint32_t t0,
                                                const uint32_t (&lim)[2], int lane)
{
    using C = attn_mma_cfg<HD>;
    constexpr int NT = T / 8;
    const uint32_t t = lane & 3;
    float sh[NT][4] = {}, sl[NT][4] = {};
    const uint32_t kb = (uint32_t)__cvta_generic_to_shared(ks) +
                        ((lane & 7) + 8 * (lane >> 4)) * C::ROW + 16 * ((lane >> 3) & 1);
#pragma unroll
    for (int kc = 0; kc < C::KC; kc++) {
        const uint4 qh = s_q[2 * (kc * 32 + lane)], ql = s_q[2 * (kc * 32 + lane) + 1];
        const uint32_t ah[4] = {qh.x, qh.y, qh.z, qh.w}, al[4] = {ql.x, ql.y, ql.z, ql.w};
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            am_ldsm(b, kb + np * 16 * C::ROW + kc * 32);
            am_mma(sh[2 * np], ah, b[0], b[1]);
            am_mma(sh[2 * np + 1], ah, b[2], b[3]);
            am_mma(sl[2 * np], al, b[0], b[1]);
            am_mma(sl[2 * np + 1], al, b[2], b[3]);
        }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t p = t0 + nt * 8 + 2 * t + (i & 1);
            const float v = sh[nt][i] + sl[nt][i] * kAmLoInv;
            sh[nt][i] = p < lim[i >> 1] ? v : -INFINITY; /* sh holds the scores now */
            mx[i >> 1] = fmaxf(mx[i >> 1], sh[nt][i]);
        }
    float cr[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(OPS_FULL_MASK, mx[e], 1));
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(OPS_FULL_MASK, mx[e], 2));
        const float mn = fmaxf(st.m[e], mx[e]);
        cr[e] = mn == -INFINITY ? 1.0f : exp2f(st.m[e] - mn);
        st.m[e] = mn;
        st.l[e] *= cr[e];
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float mn = st.m[i >> 1];
            sh[nt][i] = mn == -INFINITY ? 0.0f : exp2f(sh[nt][i] - mn); /* the weights */
            st.l[i >> 1] += sh[nt][i];
        }
    if (__any_sync(OPS_FULL_MASK, cr[0] != 1.0f || cr[1] != 1.0f)) {
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
            st.o[nd][0] *= cr[0], st.o[nd][1] *= cr[0], st.o[nd][2] *= cr[1], st.o[nd][3] *= cr[1];
    }
    const uint32_t vb = (uint32_t)__cvta_generic_to_shared(vs) +
                        ((lane & 7) + 8 * ((lane >> 3) & 1)) * C::ROW + 16 * (lane >> 4);
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        /* P (rows x 16 positions) as A: the score tiles 2kk, 2kk + 1 in accumulator layout,
         * hi and lo (lo not scaled: it shares O with hi) */
        uint32_t ah[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float *w = &sh[2 * kk + (r >> 1)][2 * (r & 1)];
            const __half2 hh = __floats2half2_rn(w[0], w[1]);
            const float2 f = __half22float2(hh);
            ah[r] = am_u32(hh);
            al[r] = am_u32(__floats2half2_rn(w[0] - f.x, w[1] - f.y));
        }
#pragma unroll
        for (int ndp = 0; ndp < HD / 16; ndp++) {
            uint32_t b[4];
            am_ldsm_t(b, vb + kk * 16 * C::ROW + ndp * 32);
            am_mma(st.o[2 * ndp], ah, b[0], b[1]);
            am_mma(st.o[2 * ndp + 1], ah, b[2], b[3]);
            am_mma(st.o[2 * ndp], al, b[0], b[1]);
            am_mma(st.o[2 * ndp + 1], al, b[2], b[3]);
        }
    }
}

#endif /* ATTN_HAVE_MMA */

/* Shared memory of the prefill kernel: four warps' q fragments, two stages of T K and V
 * rows. */
template <int HD, int T>
static inline size_t attn_mma_pf_smem()
{
    using C = attn_mma_cfg<HD>;
    return (size_t)AMP_WARPS * 2 * C::Q_BYTES + (size_t)2 * 2 * T * C::ROW;
}

/* The prefill's tensor-core kernel: the grid of attn_prefill_kernel (token tile of
 * 64 / NG tokens x NG heads = 64 rows, unit, split) with 4 warps of 16 rows, K/V tiles of T
 * positions; see the file comment. */
template <int HD, int T>
static __global__ void __launch_bounds__(AMP_WARPS * 32, 1)
    attn_mma_prefill_kernel(const struct attn_args a)
{
#if ATTN_HAVE_MMA
    using C = attn_mma_cfg<HD>;
    extern __shared__ uint4 am_dyn[]; /* q fragments a warp, then two stages */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint32_t j = blockIdx.y / a.n_groups, split = blockIdx.z;
    const uint32_t h0 = j * a.G + (blockIdx.y % a.n_groups) * a.NG;
    const uint32_t bq = AMP_WARPS * 16 / a.NG, tok0 = blockIdx.x * bq;
    const uint32_t c0 = split * a.chunk, c1 = min(a.pos0 + a.n_tok, c0 + a.chunk);
    const size_t row_bytes = (size_t)a.n_head_kv * HD * 2;
    const char *kh = a.k + (size_t)j * HD * 2, *vh = a.v + (size_t)j * HD * 2;
    uint4 *s_q = am_dyn + warp * (2 * C::Q_BYTES / 16);
    char *stages = reinterpret_cast<char *>(am_dyn) + AMP_WARPS * 2 * C::Q_BYTES;

    /* rows g, g + 8 of the warp: (token, head), their limits, their q */
    uint32_t tok[2], hh[2], lim[2];
    const float *qr[2];
    uint32_t warp_lim = 0;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const uint32_t r = warp * 16 + (lane >> 2) + 8 * e;
        tok[e] = tok0 + r / a.NG, hh[e] = h0 + r % a.NG;
        const bool valid = r < bq * a.NG && tok[e] < a.n_tok;
        lim[e] = valid ? min(a.pos0 + tok[e] + 1, c1) : 0;
        qr[e] = valid ? a.q + (size_t)tok[e] * a.q_tok_stride + (size_t)hh[e] * a.q_head_stride
                      : nullptr;
        warp_lim = max(warp_lim, lim[e]);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1)
        warp_lim = max(warp_lim, __shfl_xor_sync(OPS_FULL_MASK, warp_lim, o));
    amp_load_q<HD>(a, qr[0], qr[1], s_q, lane);

    amp_state<HD> st;
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            st.o[nd][i] = 0.0f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.0f;
    const uint32_t end = min(c1, a.pos0 + min(tok0 + bq, a.n_tok)); /* the block's last + 1 */
    const uint32_t n_tiles = end > c0 ? (end - c0 + T - 1) / T : 0;
    const int stage_bytes = 2 * T * C::ROW;
    if (n_tiles)
        amp_issue<HD, T>(stages, kh, vh, row_bytes, c0, end);
    attn_cp_commit();
    for (uint32_t i = 0; i < n_tiles; i++) {
        if (i + 1 < n_tiles)
            amp_issue<HD, T>(stages + ((i + 1) & 1) * stage_bytes, kh, vh, row_bytes,
                             c0 + (i + 1) * T, end);
        attn_cp_commit();
        attn_cp_wait<1>();
        __syncthreads(); /* tile i has landed, every thread's pieces */
        const uint32_t t0 = c0 + i * T;
        const char *stage = stages + (i & 1) * stage_bytes;
        if (t0 < warp_lim)
            amp_tile<HD, T>(st, stage, stage + T * C::ROW, s_q, t0, lim, lane);
        __syncthreads(); /* the stage is free for tile i + 2 */
    }
    attn_cp_wait<0>();

    const uint32_t t = lane & 3;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        st.l[e] += __shfl_xor_sync(OPS_FULL_MASK, st.l[e], 1);
        st.l[e] += __shfl_xor_sync(OPS_FULL_MASK, st.l[e], 2);
        if (!qr[e])
            continue;
        const size_t row = attn_ws_row(a, split, tok[e], hh[e]);
        float *o = a.ws_acc ? a.ws_acc + row * HD
                            : a.out + ((size_t)tok[e] * a.n_head + hh[e]) * HD;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const uint32_t d = nd * 8 + 2 * t + x;
                const float v = st.o[nd][2 * e + x];
                o[d] = a.ws_acc ? v : attn_gate(a, qr[e], d, v / st.l[e]);
            }
        if (a.ws_acc && t == 0) {
            a.ws_ml[2 * row] = st.m[e];
            a.ws_ml[2 * row + 1] = st.l[e];
        }
    }
#endif
}

template <int HD, int S>
static __global__ void __launch_bounds__(AM_MAX_WARPS * 32, 1)
    attn_mma_kernel(const struct attn_args a)
{
#if ATTN_HAVE_MMA
    using C = attn_mma_cfg<HD>;
    extern __shared__ uint4 am_dyn[]; /* q fragments, then the warps' rings */
    __shared__ float s_m[AM_MAX_WARPS][8], s_l[AM_MAX_WARPS][8];
    pdl_wait(); /* q, the cache rows and the position come from the kernels before */
    pdl_trigger();
    const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint32_t split, j, h0, c0, c1;
    attn_decode_block(a, &split, &j, &h0, &c0, &c1);
    const size_t row_bytes = (size_t)a.n_head_kv * HD * 2;
    const char *kh = a.k + (size_t)j * HD * 2, *vh = a.v + (size_t)j * HD * 2;
    uint4 *s_q = am_dyn;
    char *rings = reinterpret_cast<char *>(am_dyn) + C::Q_BYTES;
    am_load_q<HD>(a, h0, s_q);
    __syncthreads();

    am_state<HD> st;
#pragma unroll
    for (int mt = 0; mt < C::KC; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            st.oh[mt][i] = st.ol[mt][i] = 0.0f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.0f;
    am_run<HD, S>(st, rings + warp * S * C::SLOT, s_q, kh, vh, row_bytes, c0, c1, warp, nw,
                  lane);

    /* the whole sums of heads 2t, 2t + 1 over the lanes g */
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        st.l[0] += __shfl_xor_sync(OPS_FULL_MASK, st.l[0], o);
        st.l[1] += __shfl_xor_sync(OPS_FULL_MASK, st.l[1], o);
    }
    __syncthreads(); /* the rings are free: the accumulators go there */
    float *s_acc = reinterpret_cast<float *>(rings); /* [warp][head 8][HD] */
    const uint32_t g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < C::KC; mt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t head = 2 * t + (i & 1), d = 16 * mt + g + 8 * (i >> 1);
            if (head < a.NG)
                s_acc[((size_t)warp * 8 + head) * HD + d] = st.oh[mt][i] + st.ol[mt][i] * kAmLoInv;
        }
    if (g == 0) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            s_m[warp][2 * t + e] = st.m[e];
            s_l[warp][2 * t + e] = st.l[e];
        }
    }
    __syncthreads();
    attn_merge_warps(a, split, h0, nw, &s_m[0][0], &s_l[0][0], 8, s_acc, (size_t)8 * HD, HD);
#endif
}

#endif
