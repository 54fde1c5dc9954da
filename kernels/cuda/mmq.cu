/*
 * cuda mmq: GGUF weight rows times int8-rounded activations on int8 tensor
 * cores, for prefill (see mmq.h; matvec.cu is the f32 path it falls back
 * to).
 *
 * Maths: activations are cut into blocks of 32; block b of row s becomes
 * q in [-127, 127] with scale dx = amax/127 (q = round(x/dx), halves to
 * even) and sx = dx * sum(q). A weight block of 32 is w = dw * v + mw with
 * v a small integer: Q4_0 v = nibble - 8, dw = d, mw = 0; Q8_0 v = q,
 * dw = d; Q4_K/Q5_K sub-block j: v = 4/5-bit level, dw = d * sc_j,
 * mw = -dmin * m_j; Q6_K: v = 6-bit level - 32, a scale d * sc per 16
 * elements, so its blocks of 32 take two m16n8k16 products, one a half.
 * So a block adds dw * dx * sum(v q) + mw * sx, with
 * sum(v q) an exact int32 from mma.sync m16n8k32 s8.s8.s32 (|sum| < 2^22,
 * turned into f32 exactly by a magic number, added by the mma as its
 * accumulator input, and one subtraction instead of a slow I2F)
 * and the rest in f32.
 *
 * Work layout (d_work): xq, rows of n int8 (rounded activations); xds,
 * rows of n/32 float2 (dx, sx). Experts put in front: tiles (int4:
 * expert, first index into sorted, pairs) for at most n_pairs tiles,
 * sorted (pair indices grouped by expert), and the number of tiles used.
 *
 * Shapes and ownership (mmq_kernel): a block of 4 warps owns a tile of
 * kBM = 64 weight rows x BN = 16, 32 or 64 activation columns. By default
 * warp w owns rows 16*w.. (one m16 tile) and all BN columns (BN/8 n8
 * tiles), so each weight fragment is decoded once a block (the decoding,
 * not the memory, bounds these products at prefill's few columns an
 * expert); with LAMINA_CUDA_MMQ_WARPS=2 warp (wm, wn) owns rows 32*wm..
 * (two m16 tiles) and columns BN/2*wn.., and both column warps decode the
 * same fragments. Each output is the same chain of block sums either way.
 * The row is
 * walked in stages of 256 elements: the 64 weight rows (as stored: 144,
 * 272 or 176 bytes each; a Q6_K row's 210 bytes from the 16-byte boundary
 * at or before them, 224 staged, the block at its offset inside), the BN
 * int8 activation rows (256 bytes each,
 * padded to 272 so the B fragment reads are conflict-free) and their
 * scales are staged with cp.async into one of two buffers while the other
 * is multiplied. Lanes decode their A fragments straight from the staged
 * blocks (rows g and g+8 of an m tile, k = 4t..4t+3 and 16+4t..16+4t+3:
 * for Q4_0 the low and high nibbles of the same 4 bytes). Each thread's
 * copy offsets are computed once a block and move by a constant a stage
 * (LAMINA_CUDA_MMQ_PRE=0: at every copy). Weights not 16-byte aligned
 * (rare; decided per block for experts) are staged with 2-byte loads
 * instead; Q6_K rows of a multiple of 4 bytes (rows of 512 elements: 420)
 * by 4-byte cp.async. Columns past the tile's count repeat its last column and are
 * not stored. A dense product's rows may go to up to four buffers
 * (cuda_mmq_parts: each output row picks its part in the store).
 *
 * The rounding (quantize_kernel) may take gate/up rows and round
 * silu(gate) * up (cuda_mmq_experts_glu: the down product's input), and
 * that product may reuse the grouping its gate/up product left in d_work.
 *
 * Experts: group_kernel (one block of 1024 threads) counts the pairs per
 * expert in shared memory, scans the counts and the tiles per expert
 * (ceil(count/BN)), scatters the pair indices into sorted and writes one
 * descriptor per tile; the multiply's grid has an upper bound of tiles
 * (min(n_pairs, n_pairs/BN + n_expert)) and blocks past the count exit.
 * The order of pairs inside an expert depends on atomics, but each output
 * depends only on its own weight row and activation row, so results do
 * not.
 */
#include "kernels/cuda/mmq.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_fp16.h>

#include <type_traits>

extern "C" {
#include "common/log.h"
#include "model/quant.h"
}

#include "kernels/cuda/caps.h"
#include "kernels/cuda/cp_async.cuh"

namespace {

constexpr int kThreads = 128;              /* 4 warps: 2 along weight rows x 2 along columns */
constexpr int kBM = 64;                    /* weight rows per tile */
constexpr int kStep = 256;                 /* elements per pipeline stage */
constexpr int kBlocks = kStep / 32;        /* activation blocks per stage */
constexpr int kXRow = kStep + 16;          /* staged bytes per activation row */
constexpr int kQuantWarps = 8;             /* warps per block of the rounding kernel */
constexpr int kGroupThreads = 1024;        /* threads of the grouping kernel */
constexpr uint32_t kMaxExperts = 8192;     /* grouping counts live in shared memory */
constexpr uint64_t kMaxN = 1ull << 28;     /* longest row */
constexpr int kParts = CUDA_MMQ_MAX_PARTS;  /* destinations of a dense product */
constexpr unsigned kMaxGridY = 65535u;     /* grid y limit: weight row tiles */
constexpr int kMagicI = 0x4B400000;        /* bits of 1.5 * 2^23 */
constexpr float kMagicF = 12582912.0f;     /* 1.5 * 2^23 */

/* ---- device helpers ---------------------------------------------------- */

/* Before sm_80 (sm_75) mmq_kernel compiles to an empty body (no cp.async, no int8 mma; the
 * launchers decline there), so the helpers and tile types below go unreferenced in that pass:
 * nvcc's note of it (diagnostic 177) is left out there only. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#pragma nv_diag_suppress 177
#endif

__device__ __forceinline__ uint32_t ld32(const uint8_t *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}

__device__ __forceinline__ float f16(uint32_t h)
{
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

/* Bytes 0..15 each minus 8, as int8. */
__device__ __forceinline__ uint32_t sub8(uint32_t v)
{
    return (v + 0x78787878u) ^ 0x80808080u;
}

/* Bytes 0..63 each minus 32, as int8 (Q6_K's levels). */
__device__ __forceinline__ uint32_t sub32(uint32_t v)
{
    return (v + 0x60606060u) ^ 0x80808080u;
}

/* Exact float of c - kMagicI, an int32 below 2^22 in magnitude that the
 * product below has added to the magic number's bits. */
__device__ __forceinline__ float i2f(int c)
{
    return __int_as_float(c) - kMagicF;
}

/* d = A (16x32, rows g and g+8 in a0/a2 and a1/a3) times B (32x8), plus
 * kMagicI: the bits of 1.5 * 2^23 + sum as a float (i2f), the integer add
 * done by the tensor core. */
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(kMagicI));
#else
    d[0] = d[1] = d[2] = d[3] = kMagicI;
#endif
}

/* The same for a k16 half (Q6_K's blocks): A rows g and g+8 in a0, a1, B in b. */
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
        "{%4, %5}, {%6}, {%7, %7, %7, %7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(kMagicI));
#else
    d[0] = d[1] = d[2] = d[3] = kMagicI;
#endif
}

/* ---- the types ------------------------------------------------------------
 * Each type: SB bytes per row per stage (256 elements), SS of them staged a
 * row (SB, or a Q6_K row's 16-byte chunks around its 210), EE/EB its block;
 * MIN: blocks have an offset term mw; SPLIT: a scale per 16 elements (mw is
 * then the second half's scale, no offset term); Head: what a lane reads
 * once per row and stage; decode(r, h, kb, t, lo, hi, dw, mw): lane t's 8
 * values of block kb (0..7) of the staged row r (k = 4t.. in lo, 16+4t.. in
 * hi, int8 each), its scale and offset. kb is a constant after unrolling, so
 * the parity tests fold away. r is 2-byte aligned (Q6_K) or 16-byte. */

struct TQ4_0 {
    static constexpr int EE = 32, EB = 18, SB = 144;
    static constexpr int SS = SB;
    static constexpr bool SPLIT = false;
    static constexpr bool MIN = false;
    struct Head {};
    __device__ static void head(const uint8_t *, int, Head &) {}
    __device__ static void decode(const uint8_t *r, const Head &, int kb, int t, uint32_t &lo,
                                  uint32_t &hi, float &dw, float &mw)
    {
        const uint8_t *b = r + 18 * kb;
        /* qs start 2 bytes into the block: 4-byte aligned for odd blocks */
        const uint32_t v = kb % 2 ? ld32(b + 2 + 4 * t)
                                  : __byte_perm(ld32(b + 4 * t), ld32(b + 4 * t + 4), 0x5432);
        lo = sub8(v & 0x0F0F0F0Fu);
        hi = sub8((v >> 4) & 0x0F0F0F0Fu);
        dw = f16(*reinterpret_cast<const uint16_t *>(b));
        mw = 0.0f;
    }
};

struct TQ8_0 {
    static constexpr int EE = 32, EB = 34, SB = 272;
    static constexpr int SS = SB;
    static constexpr bool SPLIT = false;
    static constexpr bool MIN = false;
    struct Head {};
    __device__ static void head(const uint8_t *, int, Head &) {}
    __device__ static void decode(const uint8_t *r, const Head &, int kb, int t, uint32_t &lo,
                                  uint32_t &hi, float &dw, float &mw)
    {
        const uint8_t *b = r + 34 * kb;
        if (kb % 2) {
            lo = ld32(b + 2 + 4 * t);
            hi = ld32(b + 18 + 4 * t);
        } else {
            lo = __byte_perm(ld32(b + 4 * t), ld32(b + 4 * t + 4), 0x5432);
            hi = __byte_perm(ld32(b + 16 + 4 * t), ld32(b + 20 + 4 * t), 0x5432);
        }
        dw = f16(*reinterpret_cast<const uint16_t *>(b));
        mw = 0.0f;
    }
};

/* get_scale_min_k4 (model-spec 2.3) of sub-block j from the 12 scale
 * bytes as little-endian words s0, s1, s2. */
__device__ __forceinline__ void scale_min_k4(uint32_t s0, uint32_t s1, uint32_t s2, int j,
                                             uint32_t *sc, uint32_t *m)
{
    const uint32_t sh = (j & 3) * 8, b0 = s0 >> sh, b1 = s1 >> sh, b2 = s2 >> sh;
    if (j < 4) {
        *sc = b0 & 63u;
        *m = b1 & 63u;
    } else {
        *sc = (b2 & 0x0Fu) | ((b0 >> 2) & 0x30u);
        *m = ((b2 >> 4) & 0x0Fu) | ((b1 >> 2) & 0x30u);
    }
}

/* Q4_K {d, dmin, scales[12], qs[128]}: sub-block j = 2c + h is nibble h
 * of qs[32c + l]. */
struct TQ4_K {
    static constexpr int EE = 256, EB = 144, SB = 144;
    static constexpr int SS = SB;
    static constexpr bool SPLIT = false;
    static constexpr bool MIN = true;
    struct Head {
        float d, dmin;
        uint32_t s0, s1, s2;
    };
    __device__ static void head(const uint8_t *r, int, Head &h)
    {
        const uint32_t dd = ld32(r);
        h.d = f16(dd & 0xFFFFu);
        h.dmin = f16(dd >> 16);
        h.s0 = ld32(r + 4);
        h.s1 = ld32(r + 8);
        h.s2 = ld32(r + 12);
    }
    __device__ static void decode(const uint8_t *r, const Head &h, int kb, int t, uint32_t &lo,
                                  uint32_t &hi, float &dw, float &mw)
    {
        const uint8_t *q = r + 16 + 32 * (kb >> 1) + 4 * t;
        const int sh = 4 * (kb & 1);
        lo = (ld32(q) >> sh) & 0x0F0F0F0Fu;
        hi = (ld32(q + 16) >> sh) & 0x0F0F0F0Fu;
        uint32_t sc, m;
        scale_min_k4(h.s0, h.s1, h.s2, kb, &sc, &m);
        dw = h.d * static_cast<float>(sc);
        mw = -h.dmin * static_cast<float>(m);
    }
};

/* Q5_K {d, dmin, scales[12], qh[32], qs[128]}: as Q4_K plus bit j of
 * qh[l] as the fifth bit of element l of sub-block j. */
struct TQ5_K {
    static constexpr int EE = 256, EB = 176, SB = 176;
    static constexpr int SS = SB;
    static constexpr bool SPLIT = false;
    static constexpr bool MIN = true;
    struct Head {
        float d, dmin;
        uint32_t s0, s1, s2, h0, h1;
    };
    __device__ static void head(const uint8_t *r, int t, Head &h)
    {
        const uint32_t dd = ld32(r);
        h.d = f16(dd & 0xFFFFu);
        h.dmin = f16(dd >> 16);
        h.s0 = ld32(r + 4);
        h.s1 = ld32(r + 8);
        h.s2 = ld32(r + 12);
        h.h0 = ld32(r + 16 + 4 * t);
        h.h1 = ld32(r + 32 + 4 * t);
    }
    __device__ static void decode(const uint8_t *r, const Head &h, int kb, int t, uint32_t &lo,
                                  uint32_t &hi, float &dw, float &mw)
    {
        const uint8_t *q = r + 48 + 32 * (kb >> 1) + 4 * t;
        const int sh = 4 * (kb & 1);
        lo = ((ld32(q) >> sh) & 0x0F0F0F0Fu) | (((h.h0 >> kb) & 0x01010101u) << 4);
        hi = ((ld32(q + 16) >> sh) & 0x0F0F0F0Fu) | (((h.h1 >> kb) & 0x01010101u) << 4);
        uint32_t sc, m;
        scale_min_k4(h.s0, h.s1, h.s2, kb, &sc, &m);
        dw = h.d * static_cast<float>(sc);
        mw = -h.dmin * static_cast<float>(m);
    }
};

/* The word at p, 2-byte aligned: mis (p & 2, uniform) reads it from the two
 * aligned words around it. */
__device__ __forceinline__ uint32_t ld32_2(const uint8_t *p, bool mis)
{
    return mis ? __byte_perm(ld32(p - 2), ld32(p + 2), 0x5432) : ld32(p);
}

/* Q6_K {ql[128], qh[64], scales[16] int8, d} (model-spec): block kb = 4n + q
 * (half n, quarter q) is nibble q >> 1 of ql[64n + 32(q & 1) + l] with bits
 * 2q, 2q + 1 of qh[32n + l] above it, minus 32; its halves l < 16 and l >= 16
 * take scales[2kb] and scales[2kb + 1]. */
struct TQ6_K {
    static constexpr int EE = 256, EB = 210, SB = 210;
    static constexpr int SS = 224; /* 14 chunks hold 210 bytes at an even offset */
    static constexpr bool SPLIT = true;
    static constexpr bool MIN = false;
    struct Head {
        float d;
        uint32_t s[4];
        bool mis;
    };
    __device__ static void head(const uint8_t *r, int, Head &h)
    {
        h.mis = (reinterpret_cast<uintptr_t>(r) & 2) != 0;
        h.d = f16(*reinterpret_cast<const uint16_t *>(r + 208));
#pragma unroll
        for (int i = 0; i < 4; i++)
            h.s[i] = ld32_2(r + 192 + 4 * i, h.mis);
    }
    __device__ static void decode(const uint8_t *r, const Head &h, int kb, int t, uint32_t &lo,
                                  uint32_t &hi, float &dw, float &mw)
    {
        const int n = kb >> 2, q = kb & 3;
        const uint8_t *ql = r + 64 * n + 32 * (q & 1) + 4 * t, *qh = r + 128 + 32 * n + 4 * t;
        const int sl = 4 * (q >> 1), sh = 2 * q;
        const uint32_t l0 = (ld32_2(ql, h.mis) >> sl) & 0x0F0F0F0Fu;
        const uint32_t l1 = (ld32_2(ql + 16, h.mis) >> sl) & 0x0F0F0F0Fu;
        const uint32_t h0 = (ld32_2(qh, h.mis) >> sh) & 0x03030303u;
        const uint32_t h1 = (ld32_2(qh + 16, h.mis) >> sh) & 0x03030303u;
        lo = sub32(l0 | (h0 << 4));
        hi = sub32(l1 | (h1 << 4));
        const uint32_t sc = h.s[kb >> 1] >> (16 * (kb & 1));
        dw = h.d * static_cast<float>(static_cast<int8_t>(sc & 0xFFu));
        mw = h.d * static_cast<float>(static_cast<int8_t>((sc >> 8) & 0xFFu));
    }
};

/* ---- rounding the activations ------------------------------------------------ */

/* One warp per 256 elements of a row: lane l rounds elements 8l..8l+7
 * (4 lanes per block of 32). GLU: row r of x holds a gate (n) then an up
 * half (n), and the rounded element is silu(gate) * up as cuda_silu_mul
 * computes it (combine.cu), so the rounding is that of its output. */
template <bool GLU>
__global__ void __launch_bounds__(kQuantWarps * 32)
    quantize_kernel(const float *x, size_t ldx, uint64_t n, uint64_t rows, int8_t *xq,
                    float2 *xds)
{
    const int lane = threadIdx.x & 31;
    const uint64_t nch = n / kStep;
    const uint64_t wid = static_cast<uint64_t>(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
    if (wid >= rows * nch)
        return;
    const uint64_t row = wid / nch, ch = wid - row * nch;
    const float *src = x + row * ldx + ch * kStep + lane * 8;
    float v[8], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (GLU) {
            const float g = __ldg(src + i), u = __ldg(src + n + i);
            v[i] = __fmul_rn(g / (1.0f + expf(-g)), u);
        } else {
            v[i] = __ldg(src + i);
        }
        amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    uint32_t packed[2] = {0, 0};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = __float2int_rn(v[i] * id);
        sum += q;
        packed[i / 4] |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * (i % 4));
    }
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    *reinterpret_cast<uint2 *>(xq + row * n + ch * kStep + lane * 8) =
        make_uint2(packed[0], packed[1]);
    if ((lane & 3) == 0)
        xds[row * (n / 32) + ch * kBlocks + lane / 4] = make_float2(d, d * static_cast<float>(sum));
}

/* ---- grouping pairs by expert -------------------------------------------------- */

__device__ __forceinline__ bool pair_valid(const int32_t *ids, const void *const *addr,
                                           uint32_t n_expert, uint32_t p, int *e)
{
    *e = ids[p];
    return *e >= 0 && static_cast<uint32_t>(*e) < n_expert && addr[*e] != nullptr;
}

__global__ void __launch_bounds__(kGroupThreads)
    group_kernel(const int32_t *ids, const void *const *addr, uint32_t n_pairs,
                 uint32_t n_expert, int bn, int4 *tiles, int32_t *sorted, int32_t *n_tiles)
{
    extern __shared__ int gsm[]; /* cnt, off (then end), toff: n_expert each */
    __shared__ int2 wsum[kGroupThreads / 32];
    int *cnt = gsm, *off = gsm + n_expert, *toff = off + n_expert;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (uint32_t e = tid; e < n_expert; e += kGroupThreads)
        cnt[e] = 0;
    __syncthreads();
    for (uint32_t p = tid; p < n_pairs; p += kGroupThreads) {
        int e;
        if (pair_valid(ids, addr, n_expert, p, &e))
            atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    /* exclusive scan of pairs and tiles, each thread a run of experts */
    const uint32_t per = (n_expert + kGroupThreads - 1) / kGroupThreads;
    const uint32_t e0 = min(tid * per, n_expert), e1 = min(e0 + per, n_expert);
    int sp = 0, st = 0;
    for (uint32_t e = e0; e < e1; e++) {
        sp += cnt[e];
        st += (cnt[e] + bn - 1) / bn;
    }
    int ip = sp, it = st;
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(0xFFFFFFFFu, ip, o), b = __shfl_up_sync(0xFFFFFFFFu, it, o);
        if (lane >= o)
            ip += a, it += b;
    }
    if (lane == 31)
        wsum[warp] = make_int2(ip, it);
    __syncthreads();
    if (warp == 0) {
        int2 v = wsum[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xFFFFFFFFu, v.x, o);
            const int b = __shfl_up_sync(0xFFFFFFFFu, v.y, o);
            if (lane >= o)
                v.x += a, v.y += b;
        }
        wsum[lane] = v;
    }
    __syncthreads();
    int bp = ip - sp + (warp ? wsum[warp - 1].x : 0), bt = it - st + (warp ? wsum[warp - 1].y : 0);
    for (uint32_t e = e0; e < e1; e++) {
        off[e] = bp;
        toff[e] = bt;
        bp += cnt[e];
        bt += (cnt[e] + bn - 1) / bn;
    }
    if (tid == 0)
        *n_tiles = wsum[kGroupThreads / 32 - 1].y;
    __syncthreads();
    for (uint32_t p = tid; p < n_pairs; p += kGroupThreads) {
        int e;
        if (pair_valid(ids, addr, n_expert, p, &e))
            sorted[atomicAdd(&off[e], 1)] = static_cast<int32_t>(p);
    }
    __syncthreads();
    for (uint32_t e = e0; e < e1; e++) {
        const int c = cnt[e], start = off[e] - c;
        for (int j = 0; j * bn < c; j++)
            tiles[toff[e] + j] = make_int4(static_cast<int>(e), start + j * bn,
                                           min(bn, c - j * bn), 0);
    }
}

/* ---- the multiply ------------------------------------------------------------ */

struct Args {
    const uint8_t *w;          /* dense: weights */
    const void *const *addr;   /* experts: weights of each expert */
    const int4 *tiles;         /* experts: (expert, first index into sorted, pairs) */
    const int32_t *sorted;     /* experts: pair indices grouped by expert */
    const int32_t *n_tiles;    /* experts: tiles in use */
    const int8_t *xq;          /* rounded activations: rows of n */
    const float2 *xds;         /* (dx, sx) per block: rows of n/32 */
    /* the output: weight rows from pbeg[q] (consecutive, pbeg[0] = 0; unused parts
     * UINT64_MAX) go to yp[q] + s * ldp[q] + (row - pbeg[q]); experts: part 0 only */
    float *yp[kParts];
    size_t ldp[kParts];
    uint64_t pbeg[kParts];
    size_t row_bytes;
    uint64_t n_rows, n;
    uint32_t S;                /* dense: activation rows */
    uint32_t x_div;            /* experts: pairs per activation row */
    bool aligned;              /* dense: weights staged with cp.async */
    uint64_t x_rows;           /* rows of xq (the PRE launcher's check) */
};

/* Columns of a tile whose WM warps along its rows (4 / WM along its columns) take NT n8
 * tiles each. */
template <int WM, int NT>
constexpr int kTileN = 8 * NT * (4 / WM);

template <class T, int BN_>
struct Tile {
    static constexpr int BN = BN_;
    static constexpr int W = kBM * T::SS, X = BN * kXRow, D = kBlocks * BN * 8;
    static constexpr int STAGE = W + X + D;
    static constexpr int SMEM = 2 * STAGE;
};

/* Stage s of the tile into buffer sm: weight rows (clamped to the
 * matrix), activation rows cols[] and their scales. */
template <class T, int BN>
__device__ __forceinline__ void issue(uint8_t *sm, const Args &a, const uint8_t *w, bool aligned,
                                      uint64_t row0, const int *cols, uint32_t s, int tid)
{
    using TL = Tile<T, BN>;
    uint8_t *sw = sm, *sx = sm + TL::W;
    float2 *sd = reinterpret_cast<float2 *>(sm + TL::W + TL::X);
    const size_t sb = static_cast<size_t>(s) * T::SB; /* the stage's first byte in a row */
    if (aligned) { /* from the 16-byte boundary at or before it (stage_offset) */
        const uint8_t *ws = w + (sb & ~static_cast<size_t>(15));
        constexpr int WC = T::SS / 16;
        for (int i = tid; i < kBM * WC; i += kThreads) {
            const int r = i / WC, c = i - r * WC;
            const uint64_t row = min(row0 + r, a.n_rows - 1);
            cp16(sw + r * T::SS + c * 16, ws + row * a.row_bytes + c * 16);
        }
    } else if (T::SS != T::SB && ((reinterpret_cast<uintptr_t>(w) | a.row_bytes) & 3) == 0) {
        /* Q6_K rows of whole words: the words around the stage's bytes (offset sb & 3) */
        const uint8_t *ws = w + (sb & ~static_cast<size_t>(3));
        constexpr int WC = (T::SB + 2 + 3) / 4;
        for (int i = tid; i < kBM * WC; i += kThreads) {
            const int r = i / WC, c = i - r * WC;
            const uint64_t row = min(row0 + r, a.n_rows - 1);
            cp4(sw + r * T::SS + c * 4, ws + row * a.row_bytes + c * 4);
        }
    } else {
        const uint8_t *ws = w + sb;
        constexpr int WC = T::SB / 2;
        for (int i = tid; i < kBM * WC; i += kThreads) {
            const int r = i / WC, c = i - r * WC;
            const uint64_t row = min(row0 + r, a.n_rows - 1);
            *reinterpret_cast<uint16_t *>(sw + r * T::SS + c * 2) =
                *reinterpret_cast<const uint16_t *>(ws + row * a.row_bytes + c * 2);
        }
    }
    for (int i = tid; i < TL::BN * (kStep / 16); i += kThreads) {
        const int c = i >> 4, k = i & 15;
        cp16(sx + c * kXRow + k * 16,
             a.xq + static_cast<size_t>(cols[c]) * a.n + static_cast<size_t>(s) * kStep + k * 16);
    }
    for (int i = tid; i < TL::BN * kBlocks; i += kThreads) {
        const int c = i >> 3, kb = i & 7;
        cp8(sd + kb * TL::BN + c,
            a.xds + static_cast<size_t>(cols[c]) * (a.n / 32) + static_cast<size_t>(s) * kBlocks +
                kb);
    }
}

/* A thread's copies of every stage, their source offsets computed once a
 * block (issue() computes them at every copy: a division by the row's
 * chunks, a clamp and 64-bit products, about 20 instructions a copy). The
 * weights' from the tile's first row (64 rows fit 32 bits: the launcher's
 * check), the activations' and scales' from xq and xds (x_rows x n fits 32
 * bits). A stage moves them by SB bytes (Q6_K: to the 16-byte boundary at
 * or before s * SB), 256 bytes and 8 scales. The destinations follow from
 * the copy's index: a weight chunk i of a stage lands at 16 i (SS / 16
 * chunks a row), as in issue(). */
template <class T, int BN>
struct Pre {
    static constexpr int WCH = kBM * T::SS / 16;               /* weight chunks a stage */
    static constexpr int CW = (WCH + kThreads - 1) / kThreads;
    static constexpr int CA = BN * (kStep / 16) / kThreads;   /* activation chunks */
    static constexpr int CS = BN * kBlocks / kThreads;        /* scale pairs */
    static_assert(T::SS % 16 == 0 && CA * kThreads == BN * (kStep / 16) &&
                      CS * kThreads == BN * kBlocks,
                  "copies a thread");
    uint32_t w[CW], x[CA], d[CS];
};

template <class T, int BN>
__device__ __forceinline__ void pre_offsets(Pre<T, BN> &p, const Args &a, uint64_t row0,
                                            const int *cols, int tid)
{
    constexpr int WC = T::SS / 16;
    const uint64_t last = a.n_rows - 1 - row0; /* the tile's last row that exists */
#pragma unroll
    for (int j = 0; j < Pre<T, BN>::CW; j++) {
        const int i = min(tid + j * kThreads, Pre<T, BN>::WCH - 1), r = i / WC, c = i - r * WC;
        const uint64_t rr = min(static_cast<uint64_t>(r), last);
        p.w[j] = static_cast<uint32_t>(rr * a.row_bytes) + c * 16;
    }
#pragma unroll
    for (int j = 0; j < Pre<T, BN>::CA; j++) {
        const int i = tid + j * kThreads;
        p.x[j] = static_cast<uint32_t>(cols[i >> 4]) * static_cast<uint32_t>(a.n) + (i & 15) * 16;
    }
#pragma unroll
    for (int j = 0; j < Pre<T, BN>::CS; j++) {
        const int i = tid + j * kThreads;
        p.d[j] = static_cast<uint32_t>(cols[i >> 3]) * static_cast<uint32_t>(a.n / 32) + (i & 7);
    }
}

/* issue() for aligned weights with the offsets of pre_offsets: the same
 * copies. wt: the tile's first weight row. */
template <class T, int BN>
__device__ __forceinline__ void issue_pre(uint8_t *sm, const Args &a, const uint8_t *wt,
                                          const Pre<T, BN> &p, uint32_t s, int tid)
{
    using TL = Tile<T, BN>;
    uint8_t *sw = sm, *sx = sm + TL::W;
    float2 *sd = reinterpret_cast<float2 *>(sm + TL::W + TL::X);
    const uint8_t *ws = wt + (static_cast<size_t>(s) * T::SB & ~static_cast<size_t>(15));
#pragma unroll
    for (int j = 0; j < Pre<T, BN>::CW; j++) {
        const int i = tid + j * kThreads;
        if (j + 1 < Pre<T, BN>::CW || i < Pre<T, BN>::WCH)
            cp16(sw + i * 16, ws + p.w[j]);
    }
    const int8_t *xs = a.xq + static_cast<size_t>(s) * kStep;
#pragma unroll
    for (int j = 0; j < Pre<T, BN>::CA; j++) {
        const int i = tid + j * kThreads;
        cp16(sx + (i >> 4) * kXRow + (i & 15) * 16, xs + p.x[j]);
    }
    const float2 *ds = a.xds + static_cast<size_t>(s) * kBlocks;
#pragma unroll
    for (int j = 0; j < Pre<T, BN>::CS; j++) {
        const int i = tid + j * kThreads;
        cp8(sd + (i & 7) * BN + (i >> 3), ds + p.d[j]);
    }
}

struct NoPre {};

/* Stage s: issue_pre where PRE and the weights are aligned, else issue. */
template <class T, int BN, bool PRE, class P>
__device__ __forceinline__ void stage(uint8_t *sm, const Args &a, const uint8_t *w,
                                      const uint8_t *wt, bool aligned, uint64_t row0,
                                      const int *cols, const P &pre, uint32_t s, int tid)
{
    if constexpr (PRE) {
        if (aligned) {
            issue_pre<T, BN>(sm, a, wt, pre, s, tid);
            return;
        }
    } else {
        (void)wt;
        (void)pre;
    }
    issue<T, BN>(sm, a, w, aligned, row0, cols, s, tid);
}

/* Where stage s's bytes of a row begin in its staged copy (issue()'s
 * layouts): past the 16-byte or 4-byte boundary they were copied from, or 0
 * (2-byte copies, and types whose stages are whole chunks). Uniform. */
template <class T>
__device__ __forceinline__ int stage_offset(const Args &a, const uint8_t *w, bool aligned,
                                            uint32_t s)
{
    if constexpr (T::SS == T::SB) {
        (void)a, (void)w, (void)aligned, (void)s;
        return 0;
    } else {
        const uint32_t sb = s * static_cast<uint32_t>(T::SB);
        if (aligned)
            return static_cast<int>(sb & 15u);
        return ((reinterpret_cast<uintptr_t>(w) | a.row_bytes) & 3) == 0 ? static_cast<int>(sb & 3u)
                                                                        : 0;
    }
}

/* The warp's MT x NT mma tiles (MT = 4 / WM) over one staged step of 256
 * elements, its rows' bytes from off in their staged copies. */
template <class T, int WM, int NT>
__device__ __forceinline__ void compute(const uint8_t *sm, int off, int wm, int wn, int lane,
                                        float (&acc)[4 / WM][NT][4])
{
    constexpr int MT = 4 / WM;
    using TL = Tile<T, kTileN<WM, NT>>;
    const int g = lane >> 2, t = lane & 3;
    const uint8_t *sx = sm + TL::W;
    const float2 *sd = reinterpret_cast<const float2 *>(sm + TL::W + TL::X);
    const uint8_t *ra[MT][2];
    typename T::Head hd[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            ra[mt][h] = sm + (wm * 16 * MT + mt * 16 + h * 8 + g) * T::SS + off;
            T::head(ra[mt][h], t, hd[mt][h]);
        }
#pragma unroll
    for (int kb = 0; kb < kBlocks; kb++) {
        uint32_t A[MT][4];
        float dw[MT][2], mw[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                T::decode(ra[mt][h], hd[mt][h], kb, t, A[mt][h], A[mt][2 + h], dw[mt][h],
                          mw[mt][h]);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int c = wn * 8 * NT + nt * 8;
            const uint8_t *xb = sx + (c + g) * kXRow + kb * 32 + 4 * t;
            const uint32_t b0 = ld32(xb), b1 = ld32(xb + 16);
            /* (dx, sx) of columns c + 2t and c + 2t + 1 */
            const float4 ds = *reinterpret_cast<const float4 *>(sd + kb * TL::BN + c + 2 * t);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                float *o = acc[mt][nt];
                if constexpr (T::SPLIT) { /* halves apart: dw the first's scale, mw the second's */
                    int cl[4], ch[4];
                    mma_s8_k16(cl, A[mt][0], A[mt][1], b0);
                    mma_s8_k16(ch, A[mt][2], A[mt][3], b1);
                    o[0] = fmaf(i2f(cl[0]), dw[mt][0] * ds.x, o[0]);
                    o[1] = fmaf(i2f(cl[1]), dw[mt][0] * ds.z, o[1]);
                    o[2] = fmaf(i2f(cl[2]), dw[mt][1] * ds.x, o[2]);
                    o[3] = fmaf(i2f(cl[3]), dw[mt][1] * ds.z, o[3]);
                    o[0] = fmaf(i2f(ch[0]), mw[mt][0] * ds.x, o[0]);
                    o[1] = fmaf(i2f(ch[1]), mw[mt][0] * ds.z, o[1]);
                    o[2] = fmaf(i2f(ch[2]), mw[mt][1] * ds.x, o[2]);
                    o[3] = fmaf(i2f(ch[3]), mw[mt][1] * ds.z, o[3]);
                    continue;
                }
                int ci[4];
                mma_s8(ci, A[mt], b0, b1);
                o[0] = fmaf(i2f(ci[0]), dw[mt][0] * ds.x, o[0]);
                o[1] = fmaf(i2f(ci[1]), dw[mt][0] * ds.z, o[1]);
                o[2] = fmaf(i2f(ci[2]), dw[mt][1] * ds.x, o[2]);
                o[3] = fmaf(i2f(ci[3]), dw[mt][1] * ds.z, o[3]);
                if (T::MIN) {
                    o[0] = fmaf(mw[mt][0], ds.y, o[0]);
                    o[1] = fmaf(mw[mt][0], ds.w, o[1]);
                    o[2] = fmaf(mw[mt][1], ds.y, o[2]);
                    o[3] = fmaf(mw[mt][1], ds.w, o[3]);
                }
            }
        }
    }
}

/* EXPERTS: blockIdx.x is a tile of the grouping; else a run of BN
 * activation rows. blockIdx.y: 64 weight rows. WM warps along the rows
 * (2: two m16 tiles each, 4: one), 4 / WM along the columns, NT n8 tiles
 * each: BN = 8 NT (4 / WM) columns. */
template <class T, int WM, int NT, bool EXPERTS, bool PRE>
__global__ void __launch_bounds__(kThreads, 3) mmq_kernel(const Args a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int MT = 4 / WM;
    using TL = Tile<T, kTileN<WM, NT>>;
    extern __shared__ __align__(16) uint8_t smem[];
    __shared__ int cols[TL::BN], outs[TL::BN];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WM, wn = warp / WM;
    const uint64_t row0 = static_cast<uint64_t>(blockIdx.y) * kBM;
    const uint8_t *w;
    int n_cols;
    bool aligned;
    if (EXPERTS) {
        if (static_cast<int>(blockIdx.x) >= *a.n_tiles)
            return;
        const int4 tile = a.tiles[blockIdx.x];
        w = static_cast<const uint8_t *>(a.addr[tile.x]);
        n_cols = tile.z;
        if (tid < TL::BN) {
            const int p = a.sorted[tile.y + min(tid, n_cols - 1)];
            cols[tid] = static_cast<int>(static_cast<uint32_t>(p) / a.x_div);
            outs[tid] = p;
        }
        aligned = ((reinterpret_cast<uintptr_t>(w) | a.row_bytes) & 15) == 0;
    } else {
        w = a.w;
        const uint32_t s0 = blockIdx.x * TL::BN;
        n_cols = static_cast<int>(min(static_cast<uint32_t>(TL::BN), a.S - s0));
        if (tid < TL::BN)
            cols[tid] = outs[tid] = static_cast<int>(s0 + min(tid, n_cols - 1));
        aligned = a.aligned;
    }
    __syncthreads();
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[mt][nt][i] = 0.0f;
    const uint32_t nst = static_cast<uint32_t>(a.n / kStep);
    /* PRE: the copies' offsets once (aligned weights; a misaligned expert's block stages
     * as issue() does) */
    std::conditional_t<PRE, Pre<T, TL::BN>, NoPre> pre;
    const uint8_t *wt = w + row0 * a.row_bytes;
    if constexpr (PRE) {
        if (aligned)
            pre_offsets<T, TL::BN>(pre, a, row0, cols, tid);
    }
    stage<T, TL::BN, PRE>(smem, a, w, wt, aligned, row0, cols, pre, 0, tid);
    cp_commit();
    for (uint32_t s = 0; s < nst; s++) {
        if (s + 1 < nst)
            stage<T, TL::BN, PRE>(smem + ((s + 1) & 1) * TL::STAGE, a, w, wt, aligned, row0, cols,
                                  pre, s + 1, tid);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        compute<T, WM, NT>(smem + (s & 1) * TL::STAGE, stage_offset<T>(a, w, aligned, s), wm, wn,
                           lane, acc);
        __syncthreads();
    }
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            /* the row's part (static indices: selects, not local memory) */
            const uint64_t row = row0 + wm * 16 * MT + mt * 16 + g + h * 8;
            float *y = a.yp[0] + row;
            size_t ld = a.ldp[0];
#pragma unroll
            for (int q = 1; q < kParts; q++)
                if (row >= a.pbeg[q]) {
                    y = a.yp[q] + (row - a.pbeg[q]);
                    ld = a.ldp[q];
                }
            if (row >= a.n_rows)
                continue;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int col = wn * 8 * NT + nt * 8 + 2 * t + j;
                    if (col < n_cols)
                        y[static_cast<size_t>(outs[col]) * ld] = acc[mt][nt][2 * h + j];
                }
        }
#else
    (void)a;
    __trap(); /* launched on sm_80 and later only (device_check, caps.h) */
#endif
}

/* ---- launchers --------------------------------------------------------------- */

/* Elements and bytes per block of a handled type, else false.
 * LAMINA_CUDA_MMQ_Q6K=0 leaves Q6_K to the f32 products (read at each call, for
 * measurements). */
bool block_shape(uint32_t type, uint32_t *ee, uint32_t *eb)
{
    if (type == QUANT_TYPE_Q6_K) {
        const char *env = getenv("LAMINA_CUDA_MMQ_Q6K");
        if (env && env[0] == '0')
            return false;
    }
    switch (type) {
    case QUANT_TYPE_Q4_0: *ee = TQ4_0::EE, *eb = TQ4_0::EB; return true;
    case QUANT_TYPE_Q8_0: *ee = TQ8_0::EE, *eb = TQ8_0::EB; return true;
    case QUANT_TYPE_Q4_K: *ee = TQ4_K::EE, *eb = TQ4_K::EB; return true;
    case QUANT_TYPE_Q5_K: *ee = TQ5_K::EE, *eb = TQ5_K::EB; return true;
    case QUANT_TYPE_Q6_K: *ee = TQ6_K::EE, *eb = TQ6_K::EB; return true;
    default: return false;
    }
}

/* 0 on sm_80 and later (with the SM count), -ENOTSUP before, -EIO when
 * the device cannot be asked. */
int device_check(const char *what, int *n_sm)
{
    int dev, cc = 0;
    const int rc = cuda_caps_get(&cc, nullptr);
    if (rc)
        return rc;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(n_sm, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) {
        log_error("%s: device query failed: %s", what, cudaGetErrorString(err));
        return -EIO;
    }
    return cc >= 80 ? 0 : -ENOTSUP;
}

/* -ENOTSUP (not logged: the caller falls back) for what the kernels do not
 * handle, -EINVAL (logged) for weights that cannot be valid, else 0. */
int check_weights(const char *what, uint32_t type, size_t row_bytes, uint64_t n, int *n_sm)
{
    uint32_t ee, eb;
    if (!block_shape(type, &ee, &eb) || n % kStep || n == 0)
        return -ENOTSUP;
    if (n > kMaxN || row_bytes < n / ee * eb || row_bytes & 1) {
        log_error("%s: %llu elements of type %u do not fit rows of %zu bytes", what,
                  (unsigned long long)n, type, row_bytes);
        return -EINVAL;
    }
    return device_check(what, n_sm);
}

int launch_check(const char *what)
{
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        log_error("%s: launch failed: %s", what, cudaGetErrorString(err));
        return -EIO;
    }
    return 0;
}

/* Rounds `rows` activation rows into xq/xds. */
int quantize(const char *what, const float *d_X, size_t ldx, uint64_t n, uint64_t rows,
             int8_t *xq, float2 *xds, cudaStream_t stream, bool glu = false)
{
    const uint64_t warps = rows * (n / kStep);
    const uint64_t blocks = (warps + kQuantWarps - 1) / kQuantWarps;
    if (blocks > 0x7FFFFFFFull) {
        log_error("%s: %llu activation rows of %llu are too many", what, (unsigned long long)rows,
                  (unsigned long long)n);
        return -EINVAL;
    }
    if (glu)
        quantize_kernel<true><<<static_cast<unsigned>(blocks), kQuantWarps * 32, 0, stream>>>(
            d_X, ldx, n, rows, xq, xds);
    else
        quantize_kernel<false><<<static_cast<unsigned>(blocks), kQuantWarps * 32, 0, stream>>>(
            d_X, ldx, n, rows, xq, xds);
    return launch_check(what);
}

template <class T, int WM, int NT, bool EXPERTS, bool PRE = false>
int launch_mm(const char *what, const Args &a, unsigned grid_x, cudaStream_t stream)
{
    constexpr int smem = Tile<T, kTileN<WM, NT>>::SMEM;
    auto kernel = mmq_kernel<T, WM, NT, EXPERTS, PRE>;
    const int rc = cuda_caps_allow_smem((const void *)kernel, smem, what);
    if (rc)
        return rc;
    const dim3 grid(grid_x, static_cast<unsigned>((a.n_rows + kBM - 1) / kBM));
    kernel<<<grid, kThreads, smem, stream>>>(a);
    return launch_check(what);
}

/* LAMINA_CUDA_MMQ_WARPS=2: two warps along a tile's 64 rows and two along its
 * columns (each weight fragment decoded by both column warps), else four along
 * the rows. The same sums in the same order either way. Read at each call, for
 * measurements. */
bool tall()
{
    const char *env = getenv("LAMINA_CUDA_MMQ_WARPS");
    return !(env && strcmp(env, "2") == 0);
}

/* With the default layout, each thread's copy offsets computed once a block (Pre),
 * where 64 weight rows and the rounded activations fit 32-bit offsets (else issue()
 * at every copy); LAMINA_CUDA_MMQ_PRE=0: issue() always, for measurements. The same
 * bits. Read at each call. */
bool pre(const Args &a)
{
    const char *env = getenv("LAMINA_CUDA_MMQ_PRE");
    return !(env && strcmp(env, "0") == 0) && kBM * a.row_bytes < (1ull << 32) &&
           a.x_rows * a.n < (1ull << 32);
}

template <class T, bool EXPERTS>
int launch_nt(const char *what, int nt, const Args &a, uint64_t cols, cudaStream_t stream)
{
    const uint64_t bn = 16ull * nt;
    const uint64_t gx = EXPERTS ? cols : (cols + bn - 1) / bn;
    if (gx > 0x7FFFFFFFull) {
        log_error("%s: %llu column tiles are too many", what, (unsigned long long)gx);
        return -EINVAL;
    }
    const unsigned g = static_cast<unsigned>(gx);
    if (tall() && pre(a)) /* and the copies' offsets computed once a block */
        switch (nt) {
        case 4: return launch_mm<T, 4, 8, EXPERTS, true>(what, a, g, stream);
        case 2: return launch_mm<T, 4, 4, EXPERTS, true>(what, a, g, stream);
        default: return launch_mm<T, 4, 2, EXPERTS, true>(what, a, g, stream);
        }
    if (tall()) /* the four warps along the rows: each weight fragment decoded once */
        switch (nt) {
        case 4: return launch_mm<T, 4, 8, EXPERTS>(what, a, g, stream);
        case 2: return launch_mm<T, 4, 4, EXPERTS>(what, a, g, stream);
        default: return launch_mm<T, 4, 2, EXPERTS>(what, a, g, stream);
        }
    switch (nt) {
    case 4: return launch_mm<T, 2, 4, EXPERTS>(what, a, g, stream);
    case 2: return launch_mm<T, 2, 2, EXPERTS>(what, a, g, stream);
    default: return launch_mm<T, 2, 1, EXPERTS>(what, a, g, stream);
    }
}

template <bool EXPERTS>
int launch(const char *what, uint32_t type, int nt, const Args &a, uint64_t cols,
           cudaStream_t stream)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return launch_nt<TQ4_0, EXPERTS>(what, nt, a, cols, stream);
    case QUANT_TYPE_Q8_0: return launch_nt<TQ8_0, EXPERTS>(what, nt, a, cols, stream);
    case QUANT_TYPE_Q4_K: return launch_nt<TQ4_K, EXPERTS>(what, nt, a, cols, stream);
    case QUANT_TYPE_Q5_K: return launch_nt<TQ5_K, EXPERTS>(what, nt, a, cols, stream);
    case QUANT_TYPE_Q6_K: return launch_nt<TQ6_K, EXPERTS>(what, nt, a, cols, stream);
    default: return -ENOTSUP;
    }
}

size_t align16(size_t v)
{
    return (v + 15) & ~static_cast<size_t>(15);
}

/* Bytes of the rounded activations of `rows` rows. */
size_t act_bytes(uint64_t n, uint64_t rows)
{
    return align16(rows * n) + rows * (n / 32) * sizeof(float2);
}

/* Bytes of the grouping in front of the experts' activations. */
size_t group_bytes(uint32_t n_pairs)
{
    return static_cast<size_t>(n_pairs) * sizeof(int4) + align16(n_pairs * sizeof(int32_t)) + 16;
}

} /* namespace */

extern "C" bool cuda_mmq_supports(uint32_t type)
{
    uint32_t ee, eb;
    return block_shape(type, &ee, &eb);
}

extern "C" size_t cuda_mmq_work_bytes(uint64_t n, uint32_t S)
{
    return act_bytes(n, S);
}

extern "C" int cuda_mmq_parts(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n,
                              const float *d_X, size_t ldx, uint32_t S,
                              const struct cuda_mmq_part *parts, uint32_t n_parts, void *d_work,
                              cudaStream_t stream)
{
    const char *what = "cuda mmq";
    int n_sm = 0;
    int rc = check_weights(what, type, row_bytes, n, &n_sm);
    if (rc)
        return rc;
    if (!parts || n_parts == 0 || n_parts > kParts) {
        log_error("%s: %u destinations (1 to %d)", what, n_parts, kParts);
        return -EINVAL;
    }
    Args a = {};
    uint64_t n_rows = 0;
    for (uint32_t q = 0; q < kParts; q++) {
        a.yp[q] = q < n_parts ? parts[q].d_Y : nullptr;
        a.ldp[q] = q < n_parts ? parts[q].ldy : 0;
        a.pbeg[q] = q < n_parts ? n_rows : UINT64_MAX;
        if (q >= n_parts)
            continue;
        if (!parts[q].d_Y || parts[q].rows == 0 || parts[q].ldy < parts[q].rows ||
            reinterpret_cast<uintptr_t>(parts[q].d_Y) & 3 || parts[q].rows > kMaxGridY * kBM) {
            log_error("%s: bad destination %u (y %p ldy %zu for %llu rows)", what, q,
                      static_cast<void *>(parts[q].d_Y), parts[q].ldy,
                      (unsigned long long)parts[q].rows);
            return -EINVAL;
        }
        n_rows += parts[q].rows;
    }
    if (S == 0)
        return 0;
    if (!d_w || !d_X || !d_work || ldx < n || reinterpret_cast<uintptr_t>(d_w) & 1 ||
        reinterpret_cast<uintptr_t>(d_X) & 3 || reinterpret_cast<uintptr_t>(d_work) & 15) {
        log_error("%s: bad buffers (w %p x %p ldx %zu work %p for %llu x %llu)", what, d_w,
                  static_cast<const void *>(d_X), ldx, d_work, (unsigned long long)n_rows,
                  (unsigned long long)n);
        return -EINVAL;
    }
    if ((n_rows + kBM - 1) / kBM > kMaxGridY) {
        log_error("%s: %llu rows are too many", what, (unsigned long long)n_rows);
        return -EINVAL;
    }
    int8_t *xq = static_cast<int8_t *>(d_work);
    float2 *xds = reinterpret_cast<float2 *>(xq + align16(static_cast<size_t>(S) * n));
    rc = quantize(what, d_X, ldx, n, S, xq, xds, stream);
    if (rc)
        return rc;
    a.w = static_cast<const uint8_t *>(d_w);
    a.xq = xq;
    a.xds = xds;
    a.row_bytes = row_bytes;
    a.n_rows = n_rows;
    a.n = n;
    a.S = S;
    a.x_div = 1;
    a.x_rows = S;
    a.aligned = ((reinterpret_cast<uintptr_t>(d_w) | row_bytes) & 15) == 0;
    /* the widest tiles that still give every SM a block */
    const uint64_t row_tiles = (n_rows + kBM - 1) / kBM;
    int nt = 4;
    while (nt > 1 && (S <= 8u * nt || row_tiles * ((S + 16u * nt - 1) / (16u * nt)) <
                                          static_cast<uint64_t>(n_sm)))
        nt /= 2;
    return launch<false>(what, type, nt, a, S, stream);
}

extern "C" int cuda_mmq(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                        uint64_t n, const float *d_X, size_t ldx, uint32_t S, float *d_Y,
                        size_t ldy, void *d_work, cudaStream_t stream)
{
    if (n_rows == 0) {
        int n_sm = 0;
        return check_weights("cuda mmq", type, row_bytes, n, &n_sm);
    }
    const struct cuda_mmq_part p = {d_Y, ldy, n_rows};
    return cuda_mmq_parts(type, d_w, row_bytes, n, d_X, ldx, S, &p, 1, d_work, stream);
}

extern "C" size_t cuda_mmq_experts_work_bytes(uint64_t n, uint32_t n_pairs, uint32_t n_expert)
{
    (void)n_expert;
    return group_bytes(n_pairs) + act_bytes(n, n_pairs);
}

namespace {

/* cuda_mmq_experts; glu: X's rows are gate | up (x_div 1), rounded as
 * silu(gate) * up; grouped: d_work holds the grouping already. */
int experts(const char *what, uint32_t type, const void *const *d_addr, uint32_t n_expert,
            size_t row_bytes, uint64_t n_rows, uint64_t n, const int32_t *d_ids,
            uint32_t n_pairs, const float *d_X, size_t ldx, uint32_t x_div, bool glu,
            bool grouped, float *d_Y, size_t ldy, void *d_work, size_t work_bytes,
            cudaStream_t stream)
{
    int n_sm = 0;
    int rc = check_weights(what, type, row_bytes, n, &n_sm);
    if (rc)
        return rc;
    if (n_rows == 0 || n_pairs == 0)
        return 0;
    if (!d_addr || !d_ids || !d_X || !d_Y || !d_work || x_div == 0 || ldx < n || ldy < n_rows ||
        n_expert == 0 || n_expert > kMaxExperts || n_pairs > 0x7FFFFFFFu ||
        work_bytes < cuda_mmq_experts_work_bytes(n, n_pairs, n_expert) ||
        (reinterpret_cast<uintptr_t>(d_X) | reinterpret_cast<uintptr_t>(d_Y)) & 3 ||
        reinterpret_cast<uintptr_t>(d_work) & 15) {
        log_error("%s: bad arguments (addr %p of %u experts, ids %p, x %p ldx %zu x_div %u, "
                  "y %p ldy %zu, work %p of %zu bytes for %u pairs of %llu x %llu)",
                  what, static_cast<const void *>(d_addr), n_expert,
                  static_cast<const void *>(d_ids), static_cast<const void *>(d_X), ldx, x_div,
                  static_cast<void *>(d_Y), ldy, d_work, work_bytes, n_pairs,
                  (unsigned long long)n_rows, (unsigned long long)n);
        return -EINVAL;
    }
    if ((n_rows + kBM - 1) / kBM > kMaxGridY) {
        log_error("%s: %llu rows are too many", what, (unsigned long long)n_rows);
        return -EINVAL;
    }
    uint8_t *base = static_cast<uint8_t *>(d_work);
    int4 *tiles = reinterpret_cast<int4 *>(base);
    int32_t *sorted = reinterpret_cast<int32_t *>(base + static_cast<size_t>(n_pairs) * 16);
    int32_t *n_tiles = reinterpret_cast<int32_t *>(
        reinterpret_cast<uint8_t *>(sorted) + align16(n_pairs * sizeof(int32_t)));
    const uint64_t x_rows = (n_pairs - 1) / x_div + 1;
    int8_t *xq = reinterpret_cast<int8_t *>(base + group_bytes(n_pairs));
    float2 *xds = reinterpret_cast<float2 *>(xq + align16(x_rows * n));
    /* tile width from the mean pairs per expert (memory-bound: fewer
     * re-reads of an expert's weights beat idle columns) */
    const uint32_t mean = n_pairs / n_expert;
    const int nt = mean >= 24 ? 4 : mean >= 12 ? 2 : 1;
    const uint32_t bn = 16u * nt;
    if (!grouped) {
        const size_t gsmem = 3ull * n_expert * sizeof(int);
        rc = cuda_caps_allow_smem((const void *)group_kernel, gsmem, what);
        if (rc)
            return rc;
        group_kernel<<<1, kGroupThreads, gsmem, stream>>>(d_ids, d_addr, n_pairs, n_expert,
                                                          static_cast<int>(bn), tiles, sorted,
                                                          n_tiles);
        rc = launch_check(what);
        if (rc)
            return rc;
    }
    rc = quantize(what, d_X, ldx, n, x_rows, xq, xds, stream, glu);
    if (rc)
        return rc;
    Args a = {};
    a.addr = d_addr;
    a.tiles = tiles;
    a.sorted = sorted;
    a.n_tiles = n_tiles;
    a.xq = xq;
    a.xds = xds;
    a.yp[0] = d_Y;
    a.ldp[0] = ldy;
    for (int q = 1; q < kParts; q++)
        a.pbeg[q] = UINT64_MAX;
    a.row_bytes = row_bytes;
    a.n_rows = n_rows;
    a.n = n;
    a.x_div = x_div;
    a.x_rows = x_rows;
    const uint64_t bound = (n_pairs + bn - 1) / bn + n_expert;
    return launch<true>(what, type, nt, a, bound < n_pairs ? bound : n_pairs, stream);
}

} /* namespace */

extern "C" int cuda_mmq_experts(uint32_t type, const void *const *d_addr, uint32_t n_expert,
                                size_t row_bytes, uint64_t n_rows, uint64_t n,
                                const int32_t *d_ids, uint32_t n_pairs, const float *d_X,
                                size_t ldx, uint32_t x_div, float *d_Y, size_t ldy, void *d_work,
                                size_t work_bytes, cudaStream_t stream)
{
    return experts("cuda mmq_experts", type, d_addr, n_expert, row_bytes, n_rows, n, d_ids,
                   n_pairs, d_X, ldx, x_div, false, false, d_Y, ldy, d_work, work_bytes, stream);
}

extern "C" int cuda_mmq_experts_glu(uint32_t type, const void *const *d_addr, uint32_t n_expert,
                                    size_t row_bytes, uint64_t n_rows, uint64_t n,
                                    const int32_t *d_ids, uint32_t n_pairs, const float *d_GU,
                                    size_t ldgu, bool grouped, float *d_Y, size_t ldy,
                                    void *d_work, size_t work_bytes, cudaStream_t stream)
{
    if (ldgu < 2 * n) {
        log_error("cuda mmq_experts_glu: rows of %zu floats hold no gate and up of %llu", ldgu,
                  (unsigned long long)n);
        return -EINVAL;
    }
    return experts("cuda mmq_experts_glu", type, d_addr, n_expert, row_bytes, n_rows, n, d_ids,
                   n_pairs, d_GU, ldgu, 1, true, grouped, d_Y, ldy, d_work, work_bytes, stream);
}
