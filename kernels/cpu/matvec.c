/*
 * matvec: dot products of GGUF weight rows with f32 activations (see
 * matvec.h for the contract).
 *
 * Maths of the block types (every quantized type; llama.cpp's CPU scheme,
 * model-spec 2.4). The activation row is rounded once per call to int8 in
 * blocks: q = round-half-even(x * 127/amax) with the f32 scale
 * dx = amax/127 of the block's largest |x|. The "Q8_0 form" (Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, IQ4_NL) has blocks of 32 and keeps ds = dx * sum q; the
 * "Q8_K form" (Q2_K..Q6_K, IQ4_XS) has blocks of 256 and keeps the sums of
 * each 16 q (bsums). A weight block is then integer levels l, and for the
 * Q8_K form integer scales sc and mins mn per group of 16, plus floats d
 * and dm:
 *     Q8_0 form:  w = d*l + dm        dot = d*dx * sum(l*q) + dm * ds
 *     Q8_K form:  w = d*sc*l + dm*mn  dot = d*dx * sum_g sc_g sum(l*q)
 *                                          + dm*dx * sum_g mn_g bsum_g
 * Offsets of unsigned levels (Q4_0's -8, Q6_K's -32, Q3_K's -4) are such
 * mins, so the byte multiply (unsigned times signed) sees levels 0..63; the
 * signed levels of Q8_0 and the IQ4 tables go in as |l| with the sign moved
 * onto q (the sign trick). Integer sums are exact: what differs from the f32
 * product of the dequantized row is the activation rounding (at most
 * dx/2 per element, about 1e-3 of sum |w x| in practice) and f32 rounding.
 * Plain types (F32, F16, BF16) never quantize x and multiply in f32.
 *
 * Paths: AVX2 integer dots (maddubs + madd per 32 values, one FMA per
 * block; row32/rowk take one weight row at a time, row32 converting the
 * scales of 8 blocks at once; batch32/batchk take one weight row times up
 * to MV_BACT activation rows, each weight block unpacked once), AVX2
 * plain-type dots (fused; batch tiles of MV_TILE rows x MV_CHUNK elements
 * decoded into a stack buffer), and the portable C path, which is the
 * scalar reference of the same integer dot (bit-identical activation
 * rounding, exact integer sums, 8 partial f32 sums) and the plain types'
 * dequantize-then-dot. Scratch: one struct xquant (11.3 KiB) or the plain
 * tile buffer (16 KiB) on the stack.
 *
 * Split invariance: activations are quantized per block, which depends on
 * nothing but the block's values, and rows of n > MV_SEG (batch: MV_BSEG)
 * add their segments in order, so a row's result depends only on n, the
 * row and its activations. The batch kernels treat each activation row
 * with the same operations whatever the number of rows beside it.
 *
 * The AVX2 functions carry __attribute__((target)) and are only called after
 * matvec_has_simd() says yes; the rest of the file is plain C11. Everything
 * here is pure and reentrant.
 */
#include "kernels/cpu/matvec.h"

#include <math.h>
#include <string.h>

#include "common/check.h"
#include "model/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MATVEC_X86 1
#else
#define MATVEC_X86 0
#endif

#define MV_CHUNK 1024 /* plain types: elements decoded into a stack buffer at once */
#define MV_TILE 4     /* plain types: weight rows per tile of the batch path */
#define MV_SEG 8192   /* activations quantized at once (a multiple of 256) */
#define MV_BACT 4     /* integer batch path: activation rows quantized together */
#define MV_BSEG (MV_SEG / MV_BACT) /* integer batch path: elements per activation row */
#define MV_PREFETCH 4096 /* bytes of a weight row stream asked for ahead of use */

_Static_assert(MV_BSEG % 256 == 0, "batch segments hold whole Q8_K blocks");
_Static_assert(MV_BACT == 4, "the batch kernels load the scales of 4 rows as one __m128");

/* kvalues_iq4nl of model-spec 2.2 */
static const int8_t iq4_table[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline float f16(const uint8_t *p)
{
    return quant_f16_to_f32(rd16(p));
}

/* Byte offset of element k (a multiple of the block size) inside a row. */
static inline size_t elem_offset(uint32_t type, uint64_t k)
{
    return (size_t)(k / quant_block_elems(type)) * quant_block_bytes(type);
}

static void check_args(uint32_t type, uint64_t n)
{
    ASSERT(quant_is_supported(type));
    ASSERT(n % quant_block_elems(type) == 0);
}

static void check_batch_args(uint32_t type, size_t row_bytes, size_t ldx, uint64_t n, size_t ldy,
                             uint64_t r0, uint64_t r1)
{
    check_args(type, n);
    ASSERT(row_bytes >= quant_row_size(type, n) && r0 <= r1);
    ASSERT(ldx >= n && ldy >= r1);
}

/* ---- quantized activations ------------------------------------------------ */

enum xform { XFORM_F32, XFORM_Q8_0, XFORM_Q8_K };

static enum xform x_form(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_Q4_0:
    case QUANT_TYPE_Q4_1:
    case QUANT_TYPE_Q5_0:
    case QUANT_TYPE_Q5_1:
    case QUANT_TYPE_Q8_0:
    case QUANT_TYPE_IQ4_NL: return XFORM_Q8_0;
    case QUANT_TYPE_Q2_K:
    case QUANT_TYPE_Q3_K:
    case QUANT_TYPE_Q4_K:
    case QUANT_TYPE_Q5_K:
    case QUANT_TYPE_Q6_K:
    case QUANT_TYPE_IQ4_XS: return XFORM_Q8_K;
    case QUANT_TYPE_F32:
    case QUANT_TYPE_F16:
    case QUANT_TYPE_BF16: return XFORM_F32;
    default: ASSERT(!"type without matvec kernels"); return XFORM_F32;
    }
}

static inline uint32_t form_block(enum xform f)
{
    return f == XFORM_Q8_0 ? 32 : 256;
}

/*
 * Activations in the Q8_0 or Q8_K form: na rows (1, or MV_BACT in the batch
 * path) of len values. Row s's values are qs[s * len + i]; its block b has
 * scale d[b * na + s] and, in the Q8_0 form, ds[b * na + s] = d * (sum of
 * the block's values), in the Q8_K form the sums of each 16 values at
 * bsums[(b * na + s) * 16 + j]. The scales of one block of all rows are
 * adjacent so that the batch kernels load them at once; rows past the
 * caller's have zero scales.
 */
struct xquant {
    _Alignas(32) int8_t qs[MV_SEG];
    _Alignas(32) int16_t bsums[MV_SEG / 16];
    _Alignas(16) float d[MV_SEG / 32];
    _Alignas(16) float ds[MV_SEG / 32];
    uint64_t len;
    uint32_t na;
};

/* The scale of a block whose largest |x| is amax; *id the factor to round by. */
static inline float xq_scale(float amax, float *id)
{
    *id = amax > 0.0f ? 127.0f / amax : 0.0f;
    return amax / 127.0f;
}

/* Stores block b of row s (bl = 32 or 256 activations at x) into xq. */
static void xq_block_portable(struct xquant *xq, const float *x, uint32_t bl, uint64_t b,
                              uint32_t s)
{
    float amax = 0.0f;
    for (uint32_t i = 0; i < bl; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    float id, d = xq_scale(amax, &id);
    int8_t *q = xq->qs + s * xq->len + b * bl;
    int sum = 0;
    for (uint32_t i = 0; i < bl; i++) {
        q[i] = (int8_t)lrintf(x[i] * id);
        sum += q[i];
    }
    size_t k = b * xq->na + s;
    xq->d[k] = d;
    if (bl == 32) {
        xq->ds[k] = d * (float)sum;
        return;
    }
    for (int j = 0; j < 16; j++) {
        int t = 0;
        for (int i = 0; i < 16; i++)
            t += q[16 * j + i];
        xq->bsums[k * 16 + j] = (int16_t)t;
    }
}

/* ---- portable path ------------------------------------------------------ */

/* f32 dot in 8 independent partial sums; w and x 4-byte aligned. */
static float dot_f32_portable(const float *w, const float *x, uint64_t n)
{
    float acc[8] = {0};
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += w[i + l] * x[i + l];
    float tail = 0.0f;
    for (; i < n; i++)
        tail += w[i] * x[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) +
           tail;
}

/* Dequantizes len elements starting at element k of row into buf. */
static void decode_scalar(uint32_t type, const uint8_t *row, uint64_t k, uint64_t len, float *buf)
{
    int rc = quant_dequantize_row(type, row + elem_offset(type, k), buf, len);
    ASSERT(rc == 0);
}

/* out[2i + j] = w[i][0..len) . xj[0..len) for 4 rows and 2 activations,
 * each in 8 partial sums. */
static void tile_portable(const float *const w[MV_TILE], const float *x0, const float *x1,
                          uint64_t len, float out[8])
{
    float a[8][8] = {{0}};
    uint64_t j = 0;
    for (; j + 8 <= len; j += 8)
        for (int i = 0; i < MV_TILE; i++)
            for (int l = 0; l < 8; l++) {
                a[2 * i][l] += w[i][j + l] * x0[j + l];
                a[2 * i + 1][l] += w[i][j + l] * x1[j + l];
            }
    for (int k = 0; k < 8; k++)
        out[k] = ((a[k][0] + a[k][1]) + (a[k][2] + a[k][3])) +
                 ((a[k][4] + a[k][5]) + (a[k][6] + a[k][7]));
    for (; j < len; j++)
        for (int i = 0; i < MV_TILE; i++) {
            out[2 * i] += w[i][j] * x0[j];
            out[2 * i + 1] += w[i][j] * x1[j];
        }
}

/* A weight block as integers (see the file comment): levels l, and in the
 * Q8_K form scales and mins per group of 16. */
struct lblk {
    int8_t l[256];
    int16_t sc[16], mn[16];
    float d, dm;
};

/* Sub-block j's 6-bit scale and min of a Q4_K/Q5_K block (model-spec 2.3). */
static void k4_scale_min(const uint8_t *s, int j, int16_t *sc, int16_t *mn)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (int16_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *mn = (int16_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Q4_0/Q4_1/IQ4_NL nibbles (low nibbles first) through tbl, or raw. */
static void nibbles_portable(const uint8_t *qs, const int8_t *tbl, int8_t *l)
{
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
        l[j] = (int8_t)(tbl ? tbl[lo] : lo);
        l[j + 16] = (int8_t)(tbl ? tbl[hi] : hi);
    }
}

/* Q5_0/Q5_1: nibbles plus 16 * bit j of the little-endian qh word. */
static void q5_portable(const uint8_t *qh, const uint8_t *qs, int8_t *l)
{
    uint32_t h = rd32(qh);
    nibbles_portable(qs, NULL, l);
    for (int j = 0; j < 32; j++)
        l[j] = (int8_t)(l[j] | ((h >> j) & 1) << 4);
}

/* Q4_K (qh NULL) and Q5_K levels, scales and mins. */
static void k45_portable(const uint8_t *b, const uint8_t *qh, const uint8_t *qs, struct lblk *u)
{
    u->d = f16(b);
    u->dm = -f16(b + 2);
    for (int j = 0; j < 8; j++) {
        k4_scale_min(b + 4, j, &u->sc[2 * j], &u->mn[2 * j]);
        u->sc[2 * j + 1] = u->sc[2 * j];
        u->mn[2 * j + 1] = u->mn[2 * j];
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int h = qh ? qh[l] : 0;
            u->l[64 * c + l] = (int8_t)((qs[32 * c + l] & 0x0F) | ((h >> (2 * c)) & 1) << 4);
            u->l[64 * c + 32 + l] = (int8_t)((qs[32 * c + l] >> 4) | ((h >> (2 * c + 1)) & 1) << 4);
        }
}

/* Q3_K's 16 signed 6-bit scales (model-spec 2.3). */
static int16_t q3_scale(const uint8_t *s, int j)
{
    int lo = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4;
    int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (int16_t)((lo | hi << 4) - 32);
}

/* Block b of a type as integers: the model-spec 2.2/2.3 formulas with each
 * level's offset moved into dm (Q8_0 form) or mn (Q8_K form). */
static void lblk_unpack(uint32_t type, const uint8_t *b, struct lblk *u)
{
    u->d = f16(b);
    u->dm = 0.0f;
    switch (type) {
    case QUANT_TYPE_Q8_0: memcpy(u->l, b + 2, 32); break;
    case QUANT_TYPE_Q4_0:
        nibbles_portable(b + 2, NULL, u->l);
        u->dm = -8.0f * u->d;
        break;
    case QUANT_TYPE_Q4_1:
        nibbles_portable(b + 4, NULL, u->l);
        u->dm = f16(b + 2);
        break;
    case QUANT_TYPE_Q5_0:
        q5_portable(b + 2, b + 6, u->l);
        u->dm = -16.0f * u->d;
        break;
    case QUANT_TYPE_Q5_1:
        q5_portable(b + 4, b + 8, u->l);
        u->dm = f16(b + 2);
        break;
    case QUANT_TYPE_IQ4_NL: nibbles_portable(b + 2, iq4_table, u->l); break;
    case QUANT_TYPE_Q2_K:
        u->d = f16(b + 80);
        u->dm = -f16(b + 82);
        for (int g = 0; g < 16; g++) {
            u->sc[g] = b[g] & 0x0F;
            u->mn[g] = b[g] >> 4;
        }
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++)
                    u->l[128 * h + 32 * t + l] = (int8_t)((b[16 + 32 * h + l] >> (2 * t)) & 3);
        break;
    case QUANT_TYPE_Q3_K:
        u->d = f16(b + 108);
        u->dm = -4.0f * u->d;
        for (int g = 0; g < 16; g++)
            u->mn[g] = u->sc[g] = q3_scale(b + 96, g);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int l = 0; l < 32; l++)
                    u->l[128 * h + 32 * t + l] =
                        (int8_t)(((b[32 + 32 * h + l] >> (2 * t)) & 3) +
                                 4 * ((b[l] >> (4 * h + t)) & 1));
        break;
    case QUANT_TYPE_Q4_K: k45_portable(b, NULL, b + 16, u); break;
    case QUANT_TYPE_Q5_K: k45_portable(b, b + 16, b + 48, u); break;
    case QUANT_TYPE_Q6_K:
        u->d = f16(b + 208);
        u->dm = -32.0f * u->d;
        for (int g = 0; g < 16; g++)
            u->mn[g] = u->sc[g] = (int8_t)b[192 + g];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            int8_t *y = u->l + 128 * h;
            for (int l = 0; l < 32; l++) {
                y[l] = (int8_t)((ql[l] & 0x0F) | (qh[l] & 3) << 4);
                y[l + 32] = (int8_t)((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4);
                y[l + 64] = (int8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
                y[l + 96] = (int8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
            }
        }
        break;
    case QUANT_TYPE_IQ4_XS: {
        int sh = rd16(b + 2);
        for (int ib = 0; ib < 8; ib++) {
            int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | ((sh >> (2 * ib)) & 3) << 4;
            u->sc[2 * ib] = u->sc[2 * ib + 1] = (int16_t)(ls - 32);
            u->mn[2 * ib] = u->mn[2 * ib + 1] = 0;
            nibbles_portable(b + 8 + 16 * ib, iq4_table, u->l + 32 * ib);
        }
        break;
    }
    default: ASSERT(!"type without integer levels");
    }
}

/* Integer dot of len elements of a row with the quantized row 0 of xq. */
static float dot_int_portable(uint32_t type, const uint8_t *w, const struct xquant *xq,
                              uint64_t len)
{
    enum xform f = x_form(type);
    uint32_t bl = form_block(f), bytes = quant_block_bytes(type);
    float part[8] = {0};
    for (uint64_t b = 0; b < len / bl; b++) {
        struct lblk u;
        lblk_unpack(type, w + b * bytes, &u);
        const int8_t *q = xq->qs + b * bl;
        float dx = xq->d[b], v;
        if (f == XFORM_Q8_0) {
            int32_t s = 0;
            for (int i = 0; i < 32; i++)
                s += u.l[i] * q[i];
            v = u.d * dx * (float)s + u.dm * xq->ds[b];
        } else {
            int32_t s = 0, m = 0;
            for (int g = 0; g < 16; g++) {
                int32_t t = 0;
                for (int i = 0; i < 16; i++)
                    t += u.l[16 * g + i] * q[16 * g + i];
                s += u.sc[g] * t;
                m += u.mn[g] * xq->bsums[16 * b + (uint64_t)g];
            }
            v = u.d * dx * (float)s + u.dm * dx * (float)m;
        }
        part[b % 8] += v;
    }
    return ((part[0] + part[1]) + (part[2] + part[3])) +
           ((part[4] + part[5]) + (part[6] + part[7]));
}

/* ---- AVX2 path ------------------------------------------------------------ */

#if MATVEC_X86
#define SIMD __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
/* Fixed-count loops over registers must be unrolled so that their arrays of
 * vectors become registers; -O2 alone keeps them in memory. */
#define UNROLL _Pragma("GCC unroll 8")

static inline SIMD float hsum8(__m256 v)
{
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static inline SIMD float hmax8(__m256 v)
{
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

static inline SIMD int32_t hsum8i(__m256i v)
{
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    return _mm_cvtsi128_si32(a);
}

/* The fp16 at p (x86 is little-endian: one 16-bit load). */
static inline SIMD float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

static inline SIMD __m256 ld8(const float *p)
{
    return _mm256_loadu_ps(p);
}

static inline SIMD __m256i ld32(const void *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}

/* Asks for len bytes of a weight stream MV_PREFETCH bytes ahead of p. With
 * this much work per byte the hardware prefetcher alone leaves a core at
 * about 60% of its streaming bandwidth (measured: Q4_0 rows from memory
 * 6.6 GB/s without, 11 GB/s with, plain reads 13 GB/s). Prefetches past the
 * end of the weights are harmless hints. */
INLINE SIMD void prefetch_ahead(const uint8_t *p, uint32_t len)
{
    for (uint32_t o = 0; o < len; o += 64)
        _mm_prefetch((const char *)p + MV_PREFETCH + o, _MM_HINT_T0);
}

/* 32 activations of xq (32-byte aligned). */
static inline SIMD __m256i ldq(const int8_t *p)
{
    return _mm256_load_si256((const __m256i *)(const void *)p);
}

/* Same rules as xq_block_portable, with the same bits: max is exact, the
 * scale is computed in scalar, and cvtps rounds half to even like lrintf. */
static SIMD void xq_block_simd(struct xquant *xq, const float *x, uint32_t bl, uint64_t b,
                               uint32_t s)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 m = _mm256_setzero_ps();
    for (uint32_t i = 0; i < bl; i += 8)
        m = _mm256_max_ps(m, _mm256_and_ps(abs_mask, ld8(x + i)));
    float id, d = xq_scale(hmax8(m), &id);
    __m256 iv = _mm256_set1_ps(id);
    int8_t *q = xq->qs + s * xq->len + b * bl;
    size_t k = b * xq->na + s;
    __m256i tot = _mm256_setzero_si256();
    for (uint32_t i = 0; i < bl; i += 32) {
        __m256i v[4];
        UNROLL
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(ld8(x + i + 8 * j), iv));
        /* packs interleave the 128-bit lanes; the permute puts them back */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                       _mm256_packs_epi32(v[2], v[3]));
        _mm256_store_si256((__m256i *)(void *)(q + i), _mm256_permutevar8x32_epi32(p, perm));
        __m256i lo = _mm256_add_epi32(v[0], v[1]), hi = _mm256_add_epi32(v[2], v[3]);
        if (bl == 32) {
            tot = _mm256_add_epi32(lo, hi);
        } else {
            xq->bsums[k * 16 + i / 16] = (int16_t)hsum8i(lo);
            xq->bsums[k * 16 + i / 16 + 1] = (int16_t)hsum8i(hi);
        }
    }
    xq->d[k] = d;
    if (bl == 32)
        xq->ds[k] = d * (float)hsum8i(tot);
}

/* The 32 nibbles of 16 bytes as bytes: low nibbles (elements 0..15) in the
 * low lane, high nibbles (16..31) in the high lane. */
static inline SIMD __m256i nibbles32(const uint8_t *p)
{
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    v = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Bit j of the little-endian 32-bit word at p as 16 in byte j (the fifth
 * bits of Q5_0/Q5_1). */
static inline SIMD __m256i bits32_x16(const uint8_t *p)
{
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(p)), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* IQ4 table values of 32 nibbles: magnitudes in *mag, signed values returned. */
static inline SIMD __m256i iq4_values(__m256i nib, __m256i *mag)
{
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_table));
    __m256i v = _mm256_shuffle_epi8(tbl, nib);
    *mag = _mm256_abs_epi8(v);
    return v;
}

/* Bit k (constant after inlining) of every byte moved to bit 4, or to bit 2
 * with to = 2; other bits cleared. Shifting 16-bit lanes is safe: bit `to`
 * of each byte comes from bit k of the same byte. */
static inline SIMD __m256i bit_to(__m256i v, int k, int to)
{
    v = k <= to ? _mm256_slli_epi16(v, to - k) : _mm256_srli_epi16(v, k - to);
    return _mm256_and_si256(v, _mm256_set1_epi8((char)(1 << to)));
}

/* ---- Q8_0 form ---- */

/* A Q8_0-form block ready for the byte multiply: lv the 32 levels, unsigned
 * (with sg unused) or, for signed types, their magnitudes with the signs in
 * sg; w = d * level + off * m (off per type, see off32). */
struct blk32 {
    __m256i lv, sg;
    float d, m;
};

INLINE bool signed32(uint32_t type)
{
    return type == QUANT_TYPE_Q8_0 || type == QUANT_TYPE_IQ4_NL;
}

INLINE float off32(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return -8.0f;
    case QUANT_TYPE_Q5_0: return -16.0f;
    case QUANT_TYPE_Q4_1:
    case QUANT_TYPE_Q5_1: return 1.0f;
    default: return 0.0f;
    }
}

INLINE uint32_t bytes_of(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return 18;
    case QUANT_TYPE_Q4_1: return 20;
    case QUANT_TYPE_Q5_0: return 22;
    case QUANT_TYPE_Q5_1: return 24;
    case QUANT_TYPE_Q8_0: return 34;
    case QUANT_TYPE_IQ4_NL: return 18;
    case QUANT_TYPE_Q2_K: return 84;
    case QUANT_TYPE_Q3_K: return 110;
    case QUANT_TYPE_Q4_K: return 144;
    case QUANT_TYPE_Q5_K: return 176;
    case QUANT_TYPE_Q6_K: return 210;
    case QUANT_TYPE_IQ4_XS: return 136;
    default: return 0;
    }
}

INLINE SIMD void unpack32(uint32_t type, const uint8_t *b, struct blk32 *u)
{
    u->d = f16_at(b);
    u->m = u->d;
    switch (type) {
    case QUANT_TYPE_Q4_0: u->lv = nibbles32(b + 2); break;
    case QUANT_TYPE_Q4_1:
        u->lv = nibbles32(b + 4);
        u->m = f16_at(b + 2);
        break;
    case QUANT_TYPE_Q5_0: u->lv = _mm256_or_si256(nibbles32(b + 6), bits32_x16(b + 2)); break;
    case QUANT_TYPE_Q5_1:
        u->lv = _mm256_or_si256(nibbles32(b + 8), bits32_x16(b + 4));
        u->m = f16_at(b + 2);
        break;
    case QUANT_TYPE_Q8_0:
        u->sg = ld32(b + 2);
        u->lv = _mm256_abs_epi8(u->sg);
        break;
    case QUANT_TYPE_IQ4_NL: u->sg = iq4_values(nibbles32(b + 2), &u->lv); break;
    }
}

/* 8 lanes summing to sum(level * q) of a block and the 32 activations at q. */
INLINE SIMD __m256i idot32(uint32_t type, const struct blk32 *u, const int8_t *q)
{
    __m256i xv = ldq(q);
    if (signed32(type))
        xv = _mm256_sign_epi8(xv, u->sg);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u->lv, xv), _mm256_set1_epi16(1));
}

INLINE SIMD void step32(uint32_t type, const uint8_t *blk, const struct xquant *xq, uint64_t b,
                        __m256 *acc, float *cor)
{
    struct blk32 u;
    unpack32(type, blk, &u);
    __m256i p = idot32(type, &u, xq->qs + 32 * b);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(u.d * xq->d[b]), *acc);
    if (off32(type) != 0.0f)
        *cor += u.m * xq->ds[b];
}

/* The fp16 at byte off of 8 blocks bytes apart, as floats. */
INLINE SIMD __m256 f16x8(const uint8_t *b, uint32_t bytes, uint32_t off)
{
    __m128i h = _mm_cvtsi32_si128(rd16(b + off));
    h = _mm_insert_epi16(h, rd16(b + bytes + off), 1);
    h = _mm_insert_epi16(h, rd16(b + 2 * bytes + off), 2);
    h = _mm_insert_epi16(h, rd16(b + 3 * bytes + off), 3);
    h = _mm_insert_epi16(h, rd16(b + 4 * bytes + off), 4);
    h = _mm_insert_epi16(h, rd16(b + 5 * bytes + off), 5);
    h = _mm_insert_epi16(h, rd16(b + 6 * bytes + off), 6);
    h = _mm_insert_epi16(h, rd16(b + 7 * bytes + off), 7);
    return _mm256_cvtph_ps(h);
}

/* nb blocks of nr (1 or 2, a constant) rows w[i] times row 0 of xq (na = 1)
 * into out[i]. Groups of 8 blocks get their scales (and mins' terms) as
 * vectors; blocks alternate between two accumulators so that the FMA
 * latency is hidden. Each row sees the same operations whatever nr is; two
 * rows at once share the activation loads and the loop overhead. */
INLINE SIMD void rows32(uint32_t type, const uint8_t *const *w, int nr, const struct xquant *xq,
                        uint64_t nb, float *out)
{
    const uint32_t bytes = bytes_of(type);
    const bool affine = type == QUANT_TYPE_Q4_1 || type == QUANT_TYPE_Q5_1;
    __m256 a0[2], a1[2], c8[2];
    float c0[2] = {0.0f, 0.0f}, c1[2] = {0.0f, 0.0f};
    UNROLL
    for (int i = 0; i < nr; i++)
        a0[i] = a1[i] = c8[i] = _mm256_setzero_ps();
    uint64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        _Alignas(32) float sc[2][8];
        UNROLL
        for (int i = 0; i < nr; i++) {
            const uint8_t *blk = w[i] + b * bytes;
            prefetch_ahead(blk, 8 * bytes);
            __m256 dw = f16x8(blk, bytes, 0);
            _mm256_store_ps(sc[i], _mm256_mul_ps(dw, _mm256_loadu_ps(xq->d + b)));
            if (off32(type) != 0.0f)
                c8[i] = _mm256_fmadd_ps(affine ? f16x8(blk, bytes, 2) : dw,
                                        _mm256_loadu_ps(xq->ds + b), c8[i]);
        }
        UNROLL
        for (int j = 0; j < 8; j += 2)
            UNROLL
            for (int i = 0; i < nr; i++) {
                const uint8_t *blk = w[i] + b * bytes;
                struct blk32 u0, u1;
                unpack32(type, blk + j * bytes, &u0);
                unpack32(type, blk + (j + 1) * bytes, &u1);
                __m256i p0 = idot32(type, &u0, xq->qs + 32 * (b + j));
                __m256i p1 = idot32(type, &u1, xq->qs + 32 * (b + j + 1));
                a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(sc[i] + j),
                                        a0[i]);
                a1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                        _mm256_broadcast_ss(sc[i] + j + 1), a1[i]);
            }
    }
    for (; b < nb; b++)
        UNROLL
        for (int i = 0; i < nr; i++)
            step32(type, w[i] + b * bytes, xq, b, b % 2 ? &a1[i] : &a0[i],
                   b % 2 ? &c1[i] : &c0[i]);
    UNROLL
    for (int i = 0; i < nr; i++) {
        float r = hsum8(_mm256_add_ps(a0[i], a1[i]));
        out[i] = off32(type) != 0.0f ? r + off32(type) * (hsum8(c8[i]) + (c0[i] + c1[i])) : r;
    }
}

/* Block b of batch32 with the block's unpacked levels, scale dw and min m. */
INLINE SIMD void bstep32(uint32_t type, const struct blk32 *u, float dw, float m,
                         const struct xquant *xq, uint64_t b, uint32_t ns, __m256 *acc,
                         __m128 *cor)
{
    __m128 d4 = _mm_mul_ps(_mm_set1_ps(dw), _mm_load_ps(xq->d + MV_BACT * b));
    __m256 s4 = _mm256_castps128_ps256(d4);
    if (off32(type) != 0.0f)
        *cor = _mm_fmadd_ps(_mm_set1_ps(m), _mm_load_ps(xq->ds + MV_BACT * b), *cor);
    UNROLL
    for (uint32_t s = 0; s < ns; s++) {
        __m256i p = idot32(type, u, xq->qs + s * xq->len + 32 * b);
        __m256 sc = _mm256_permutevar8x32_ps(s4, _mm256_set1_epi32((int)s));
        acc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[s]);
    }
}

/* nb blocks of a row times rows 0..ns-1 of xq (na = MV_BACT) into out;
 * scales and mins are converted 8 blocks at a time. */
INLINE SIMD void batch32(uint32_t type, const uint8_t *w, const struct xquant *xq, uint64_t nb,
                         uint32_t ns, float *out)
{
    const uint32_t bytes = bytes_of(type);
    const bool affine = type == QUANT_TYPE_Q4_1 || type == QUANT_TYPE_Q5_1;
    __m256 acc[MV_BACT];
    __m128 cor = _mm_setzero_ps();
    UNROLL
    for (uint32_t s = 0; s < ns; s++)
        acc[s] = _mm256_setzero_ps();
    uint64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const uint8_t *blk = w + b * bytes;
        prefetch_ahead(blk, 8 * bytes);
        _Alignas(32) float dw[8], m[8];
        _mm256_store_ps(dw, f16x8(blk, bytes, 0));
        if (affine)
            _mm256_store_ps(m, f16x8(blk, bytes, 2));
        for (int j = 0; j < 8; j++) {
            struct blk32 u;
            unpack32(type, blk + j * bytes, &u);
            bstep32(type, &u, dw[j], affine ? m[j] : dw[j], xq, b + j, ns, acc, &cor);
        }
    }
    for (; b < nb; b++) {
        struct blk32 u;
        unpack32(type, w + b * bytes, &u);
        bstep32(type, &u, u.d, u.m, xq, b, ns, acc, &cor);
    }
    float c[MV_BACT];
    _mm_storeu_ps(c, cor);
    for (uint32_t s = 0; s < ns; s++) {
        float r = hsum8(acc[s]);
        out[s] = off32(type) != 0.0f ? r + off32(type) * c[s] : r;
    }
}

/* ---- Q8_K form ---- */

/* A Q8_K-form block ready for the byte multiply: lv[v] the levels of
 * elements 32v.. (unsigned, or magnitudes with signs in sg[v] for IQ4_XS),
 * sc[v] their group scales as 16 x i16 (the 16 pair sums of maddubs: lanes
 * 0..7 are group 2v, 8..15 group 2v+1), mn the 16 group mins (unused for
 * IQ4_XS). */
struct blkk {
    __m256i lv[8], sg[8], sc[8], mn;
    float d, dm;
};

/* sc[v] from the 16 group scales as i16 (group g in lane g). */
static inline SIMD void group_scales(__m256i g16, __m256i sc[8])
{
    __m256i lo = _mm256_permute2x128_si256(g16, g16, 0x00);
    __m256i hi = _mm256_permute2x128_si256(g16, g16, 0x11);
    UNROLL
    for (int v = 0; v < 8; v++) {
        int a = (2 * v) % 8, c = (2 * v + 1) % 8; /* i16 lanes within the source half */
        __m256i pick = _mm256_setr_epi8(
            (char)(2 * a), (char)(2 * a + 1), (char)(2 * a), (char)(2 * a + 1), (char)(2 * a),
            (char)(2 * a + 1), (char)(2 * a), (char)(2 * a + 1), (char)(2 * a), (char)(2 * a + 1),
            (char)(2 * a), (char)(2 * a + 1), (char)(2 * a), (char)(2 * a + 1), (char)(2 * a),
            (char)(2 * a + 1), (char)(2 * c), (char)(2 * c + 1), (char)(2 * c), (char)(2 * c + 1),
            (char)(2 * c), (char)(2 * c + 1), (char)(2 * c), (char)(2 * c + 1), (char)(2 * c),
            (char)(2 * c + 1), (char)(2 * c), (char)(2 * c + 1), (char)(2 * c), (char)(2 * c + 1),
            (char)(2 * c), (char)(2 * c + 1));
        sc[v] = _mm256_shuffle_epi8(v < 4 ? lo : hi, pick);
    }
}

/* Q4_K/Q5_K: the 8 sub-block scales and mins (get_scale_min_k4 on 32-bit
 * words), each used for the two groups of 16 of its sub-block. */
static inline SIMD void k4_scales(const uint8_t *s, struct blkk *u)
{
    uint32_t u0 = rd32(s), u1 = rd32(s + 4), u2 = rd32(s + 8);
    uint32_t sc_lo = u0 & 0x3F3F3F3F, m_lo = u1 & 0x3F3F3F3F;
    uint32_t sc_hi = (u2 & 0x0F0F0F0F) | ((u0 & 0xC0C0C0C0) >> 2);
    uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0F) | ((u1 & 0xC0C0C0C0) >> 2);
    /* bytes: scale 0..7 twice each, then min 0..7 twice each */
    __m128i v = _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)m_lo, (int)m_hi);
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m256i g16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, twice));
    group_scales(g16, u->sc);
    u->mn = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_si128(v, 8), twice));
}

/* Q3_K scales: 16 signed 6-bit values, low 4 bits in the nibbles of s[0..7]
 * (low nibbles first), high 2 bits of scale j at bit 2*(j/4) of s[8 + j%4];
 * built as 16 bytes on 64-bit words. */
static inline SIMD __m256i q3_scales(const uint8_t *s)
{
    uint64_t l = (uint64_t)rd32(s) | (uint64_t)rd32(s + 4) << 32;
    uint32_t w = rd32(s + 8);
    uint64_t h_lo = (uint64_t)(w & 0x03030303) | (uint64_t)((w >> 2) & 0x03030303) << 32;
    uint64_t h_hi = (uint64_t)((w >> 4) & 0x03030303) | (uint64_t)((w >> 6) & 0x03030303) << 32;
    uint64_t lo = (l & 0x0F0F0F0F0F0F0F0Full) | h_lo << 4;
    uint64_t hi = ((l >> 4) & 0x0F0F0F0F0F0F0F0Full) | h_hi << 4;
    __m128i v = _mm_sub_epi8(_mm_set_epi64x((long long)hi, (long long)lo), _mm_set1_epi8(32));
    return _mm256_cvtepi8_epi16(v);
}

INLINE SIMD void unpackk(uint32_t type, const uint8_t *b, struct blkk *u)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    switch (type) {
    case QUANT_TYPE_Q2_K: {
        __m128i raw = _mm_loadu_si128((const __m128i *)b), k4 = _mm_set1_epi8(0x0F);
        group_scales(_mm256_cvtepu8_epi16(_mm_and_si128(raw, k4)), u->sc);
        u->mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), k4));
        u->d = f16_at(b + 80);
        u->dm = -f16_at(b + 82);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i q = ld32(b + 16 + 32 * h);
            UNROLL
            for (int t = 0; t < 4; t++)
                u->lv[4 * h + t] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * t), m3);
        }
        break;
    }
    case QUANT_TYPE_Q3_K: {
        u->mn = q3_scales(b + 96);
        group_scales(u->mn, u->sc);
        u->d = f16_at(b + 108);
        u->dm = -4.0f * u->d;
        __m256i hm = ld32(b);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i q = ld32(b + 32 + 32 * h);
            UNROLL
            for (int t = 0; t < 4; t++)
                u->lv[4 * h + t] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(q, 2 * t), m3), bit_to(hm, 4 * h + t, 2));
        }
        break;
    }
    case QUANT_TYPE_Q4_K:
    case QUANT_TYPE_Q5_K: {
        const uint8_t *qs = b + (type == QUANT_TYPE_Q4_K ? 16 : 48);
        k4_scales(b + 4, u);
        u->d = f16_at(b);
        u->dm = -f16_at(b + 2);
        __m256i qh = type == QUANT_TYPE_Q5_K ? ld32(b + 16) : _mm256_setzero_si256();
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256i q = ld32(qs + 32 * c);
            u->lv[2 * c] = _mm256_and_si256(q, m4);
            u->lv[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (type == QUANT_TYPE_Q5_K) {
                u->lv[2 * c] = _mm256_or_si256(u->lv[2 * c], bit_to(qh, 2 * c, 4));
                u->lv[2 * c + 1] = _mm256_or_si256(u->lv[2 * c + 1], bit_to(qh, 2 * c + 1, 4));
            }
        }
        break;
    }
    case QUANT_TYPE_Q6_K: {
        u->mn = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        group_scales(u->mn, u->sc);
        u->d = f16_at(b + 208);
        u->dm = -32.0f * u->d;
        const __m256i m30 = _mm256_set1_epi8(0x30);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i l0 = ld32(b + 64 * h), l1 = ld32(b + 64 * h + 32), qh = ld32(b + 128 + 32 * h);
            __m256i *lv = u->lv + 4 * h;
            lv[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            lv[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            lv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                    _mm256_and_si256(qh, m30));
            lv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        }
        break;
    }
    case QUANT_TYPE_IQ4_XS: {
        u->d = f16_at(b);
        u->dm = 0.0f;
        int sh = rd16(b + 2);
        UNROLL
        for (int ib = 0; ib < 8; ib++) {
            int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | ((sh >> (2 * ib)) & 3) << 4;
            u->sc[ib] = _mm256_set1_epi16((short)(ls - 32));
            u->sg[ib] = iq4_values(nibbles32(b + 8 + 16 * ib), &u->lv[ib]);
        }
        break;
    }
    }
}

/* 8 lanes summing to sum_g sc_g sum(level * q) of a block and the 256
 * activations at q. */
INLINE SIMD __m256i idotk(uint32_t type, const struct blkk *u, const int8_t *q)
{
    __m256i ia = _mm256_setzero_si256();
    UNROLL
    for (int v = 0; v < 8; v++) {
        __m256i xv = ldq(q + 32 * v);
        if (type == QUANT_TYPE_IQ4_XS)
            xv = _mm256_sign_epi8(xv, u->sg[v]);
        ia = _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(u->lv[v], xv), u->sc[v]));
    }
    return ia;
}

/* Block b's part of a dot with xq row s: the levels term into *acc, the
 * mins term (from the bsums) into *accm. */
INLINE SIMD void stepk(uint32_t type, const struct blkk *u, const struct xquant *xq, uint64_t b,
                       uint32_t s, __m256 *acc, __m256 *accm)
{
    size_t k = b * xq->na + s;
    float dx = xq->d[k];
    __m256i ia = idotk(type, u, xq->qs + s * xq->len + 256 * b);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(u->d * dx), *acc);
    if (type != QUANT_TYPE_IQ4_XS) {
        __m256i bs = _mm256_load_si256((const __m256i *)(const void *)(xq->bsums + 16 * k));
        __m256i im = _mm256_madd_epi16(bs, u->mn);
        *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(u->dm * dx), *accm);
    }
}

/* nb blocks of nr rows w[i] times row 0 of xq into out[i], a row at a time
 * (a K-quant block has enough work to hide the loop). */
INLINE SIMD void rowsk(uint32_t type, const uint8_t *const *w, int nr, const struct xquant *xq,
                       uint64_t nb, float *out)
{
    const uint32_t bytes = bytes_of(type);
    for (int i = 0; i < nr; i++) {
        __m256 acc = _mm256_setzero_ps(), accm = acc;
        for (uint64_t b = 0; b < nb; b++) {
            struct blkk u;
            prefetch_ahead(w[i] + b * bytes, bytes);
            unpackk(type, w[i] + b * bytes, &u);
            stepk(type, &u, xq, b, 0, &acc, &accm);
        }
        out[i] = hsum8(_mm256_add_ps(acc, accm));
    }
}

INLINE SIMD void batchk(uint32_t type, const uint8_t *w, const struct xquant *xq, uint64_t nb,
                        uint32_t ns, float *out)
{
    const uint32_t bytes = bytes_of(type);
    __m256 acc[MV_BACT], accm[MV_BACT];
    for (uint32_t s = 0; s < ns; s++)
        acc[s] = accm[s] = _mm256_setzero_ps();
    for (uint64_t b = 0; b < nb; b++) {
        struct blkk u;
        prefetch_ahead(w + b * bytes, bytes);
        unpackk(type, w + b * bytes, &u);
        for (uint32_t s = 0; s < ns; s++)
            stepk(type, &u, xq, b, s, &acc[s], &accm[s]);
    }
    for (uint32_t s = 0; s < ns; s++)
        out[s] = hsum8(_mm256_add_ps(acc[s], accm[s]));
}

/* dotr_NAME(w, nr, xq, nb, out): nb blocks of rows w[0..nr) (nr = 1 or 2)
 * times row 0 of xq; dotb_NAME(w, xq, nb, ns, out): nb blocks of row w
 * times rows 0..ns-1 (ns <= MV_BACT). Each row and activation row gets the
 * same operations whatever nr or ns is. */
#define INT_KERNELS(name, type, rows, batch)                                                       \
    static SIMD void dotr_##name(const uint8_t *const *w, int nr, const struct xquant *xq,         \
                                 uint64_t nb, float *out)                                          \
    {                                                                                              \
        if (nr == 2)                                                                               \
            rows(type, w, 2, xq, nb, out);                                                         \
        else                                                                                       \
            rows(type, w, 1, xq, nb, out);                                                         \
    }                                                                                              \
    static SIMD void dotb_##name(const uint8_t *w, const struct xquant *xq, uint64_t nb,           \
                                 uint32_t ns, float *out)                                          \
    {                                                                                              \
        switch (ns) {                                                                              \
        case 1: batch(type, w, xq, nb, 1, out); break;                                             \
        case 2: batch(type, w, xq, nb, 2, out); break;                                             \
        case 3: batch(type, w, xq, nb, 3, out); break;                                             \
        default: batch(type, w, xq, nb, 4, out); break;                                            \
        }                                                                                          \
    }

INT_KERNELS(q4_0, QUANT_TYPE_Q4_0, rows32, batch32)
INT_KERNELS(q4_1, QUANT_TYPE_Q4_1, rows32, batch32)
INT_KERNELS(q5_0, QUANT_TYPE_Q5_0, rows32, batch32)
INT_KERNELS(q5_1, QUANT_TYPE_Q5_1, rows32, batch32)
INT_KERNELS(q8_0, QUANT_TYPE_Q8_0, rows32, batch32)
INT_KERNELS(iq4_nl, QUANT_TYPE_IQ4_NL, rows32, batch32)
INT_KERNELS(q2_k, QUANT_TYPE_Q2_K, rowsk, batchk)
INT_KERNELS(q3_k, QUANT_TYPE_Q3_K, rowsk, batchk)
INT_KERNELS(q4_k, QUANT_TYPE_Q4_K, rowsk, batchk)
INT_KERNELS(q5_k, QUANT_TYPE_Q5_K, rowsk, batchk)
INT_KERNELS(q6_k, QUANT_TYPE_Q6_K, rowsk, batchk)
INT_KERNELS(iq4_xs, QUANT_TYPE_IQ4_XS, rowsk, batchk)

/* The integer kernels of a block type. */
struct int_kernels {
    void (*rows)(const uint8_t *const *w, int nr, const struct xquant *xq, uint64_t nb,
                 float *out);
    void (*batch)(const uint8_t *w, const struct xquant *xq, uint64_t nb, uint32_t ns, float *out);
};

static struct int_kernels int_kernels_of(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return (struct int_kernels){dotr_q4_0, dotb_q4_0};
    case QUANT_TYPE_Q4_1: return (struct int_kernels){dotr_q4_1, dotb_q4_1};
    case QUANT_TYPE_Q5_0: return (struct int_kernels){dotr_q5_0, dotb_q5_0};
    case QUANT_TYPE_Q5_1: return (struct int_kernels){dotr_q5_1, dotb_q5_1};
    case QUANT_TYPE_Q8_0: return (struct int_kernels){dotr_q8_0, dotb_q8_0};
    case QUANT_TYPE_IQ4_NL: return (struct int_kernels){dotr_iq4_nl, dotb_iq4_nl};
    case QUANT_TYPE_Q2_K: return (struct int_kernels){dotr_q2_k, dotb_q2_k};
    case QUANT_TYPE_Q3_K: return (struct int_kernels){dotr_q3_k, dotb_q3_k};
    case QUANT_TYPE_Q4_K: return (struct int_kernels){dotr_q4_k, dotb_q4_k};
    case QUANT_TYPE_Q5_K: return (struct int_kernels){dotr_q5_k, dotb_q5_k};
    case QUANT_TYPE_Q6_K: return (struct int_kernels){dotr_q6_k, dotb_q6_k};
    case QUANT_TYPE_IQ4_XS: return (struct int_kernels){dotr_iq4_xs, dotb_iq4_xs};
    default: ASSERT(!"type without integer kernels"); return (struct int_kernels){NULL, NULL};
    }
}

/* ---- plain types ---- */

/* Plain types: 8 values of type at p as floats. */
static inline SIMD __m256 load_plain8(uint32_t type, const uint8_t *p)
{
    if (type == QUANT_TYPE_F32)
        return _mm256_loadu_ps((const float *)(const void *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == QUANT_TYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float plain_at(uint32_t type, const uint8_t *p, uint64_t i)
{
    if (type == QUANT_TYPE_F32) {
        float f;
        memcpy(&f, p + 4 * i, sizeof(f));
        return f;
    }
    uint16_t h = rd16(p + 2 * i);
    return type == QUANT_TYPE_F16 ? quant_f16_to_f32(h) : quant_bf16_to_f32(h);
}

/* F32/F16/BF16 row of any alignment: 4 x 8 partial sums. */
INLINE SIMD float dot_plain(uint32_t type, const uint8_t *w, const float *x, uint64_t n)
{
    uint32_t es = type == QUANT_TYPE_F32 ? 4 : 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    uint64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead(w + es * i, 32 * es);
        a0 = _mm256_fmadd_ps(load_plain8(type, w + es * i), ld8(x + i), a0);
        a1 = _mm256_fmadd_ps(load_plain8(type, w + es * (i + 8)), ld8(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(load_plain8(type, w + es * (i + 16)), ld8(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(load_plain8(type, w + es * (i + 24)), ld8(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(load_plain8(type, w + es * i), ld8(x + i), a0);
    float tail = 0.0f;
    for (; i < n; i++)
        tail += plain_at(type, w, i) * x[i];
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail;
}

static SIMD float dot_plain_simd(uint32_t type, const uint8_t *w, const float *x, uint64_t n)
{
    switch (type) {
    case QUANT_TYPE_F32: return dot_plain(QUANT_TYPE_F32, w, x, n);
    case QUANT_TYPE_F16: return dot_plain(QUANT_TYPE_F16, w, x, n);
    default: return dot_plain(QUANT_TYPE_BF16, w, x, n);
    }
}

/* len elements from element k of a plain row into buf (or the row itself
 * when it is F32 at 4-byte alignment); returns where the floats are. */
static SIMD const float *decode_plain_simd(uint32_t type, const uint8_t *row, uint64_t k,
                                           uint64_t len, float *buf)
{
    uint32_t es = type == QUANT_TYPE_F32 ? 4 : 2;
    const uint8_t *w = row + es * k;
    if (type == QUANT_TYPE_F32 && ((uintptr_t)w & 3) == 0)
        return (const float *)(const void *)w;
    uint64_t i = 0;
    for (; i + 8 <= len; i += 8)
        _mm256_storeu_ps(buf + i, load_plain8(type, w + es * i));
    for (; i < len; i++)
        buf[i] = plain_at(type, w, i);
    return buf;
}

/* out[2i + j] = w[i][0..len) . xj[0..len) for 4 rows and 2 activations. */
static SIMD void tile_simd(const float *const w[MV_TILE], const float *x0, const float *x1,
                           uint64_t len, float out[8])
{
    __m256 a[8];
    UNROLL
    for (int k = 0; k < 8; k++)
        a[k] = _mm256_setzero_ps();
    uint64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 xa = ld8(x0 + j), xb = ld8(x1 + j);
        UNROLL
        for (int i = 0; i < MV_TILE; i++) {
            __m256 wv = ld8(w[i] + j);
            a[2 * i] = _mm256_fmadd_ps(wv, xa, a[2 * i]);
            a[2 * i + 1] = _mm256_fmadd_ps(wv, xb, a[2 * i + 1]);
        }
    }
    /* Eight horizontal sums at once: hadd pairs, then fold the 128-bit halves. */
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                             _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, s);
    for (; j < len; j++)
        for (int i = 0; i < MV_TILE; i++) {
            out[2 * i] += w[i][j] * x0[j];
            out[2 * i + 1] += w[i][j] * x1[j];
        }
}
#endif /* MATVEC_X86 */

/* ---- drivers ---------------------------------------------------------------- */

/* Quantizes rows s < nrows (row s at x + s * ldx, len values each) into
 * rows of xq, which has na rows; rows nrows..na-1 get zero scales. */
static void xq_fill(bool simd, enum xform f, const float *x, size_t ldx, uint32_t nrows,
                    uint32_t na, uint64_t len, struct xquant *xq)
{
    (void)simd; /* unused without x86 */
    uint32_t bl = form_block(f);
    ASSERT(na * len <= MV_SEG && len % bl == 0);
    xq->len = len;
    xq->na = na;
    for (uint64_t b = 0; b < len / bl; b++)
        for (uint32_t s = 0; s < na; s++) {
            if (s >= nrows) {
                xq->d[b * na + s] = xq->ds[b * na + s] = 0.0f;
                continue;
            }
            const float *xb = x + s * ldx + b * bl;
#if MATVEC_X86
            if (simd) {
                xq_block_simd(xq, xb, bl, b, s);
                continue;
            }
#endif
            xq_block_portable(xq, xb, bl, b, s);
        }
}

/* y[r] = W[r] . x for r in [r0, r1), x quantized once per segment of
 * MV_SEG values; segments add up in order. */
static void rows_int(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes,
                     const float *x, uint64_t n, float *y, uint64_t r0, uint64_t r1)
{
    enum xform f = x_form(type);
    struct xquant xq;
#if MATVEC_X86
    struct int_kernels kern = {NULL, NULL};
    if (simd)
        kern = int_kernels_of(type);
#endif
    for (uint64_t k = 0; k == 0 || k < n; k += MV_SEG) {
        uint64_t len = n - k < MV_SEG ? n - k : MV_SEG;
        xq_fill(simd, f, x + k, 0, 1, 1, len, &xq);
        for (uint64_t r = r0; r < r1;) {
            const uint8_t *row[2] = {w + r * row_bytes + elem_offset(type, k), NULL};
            float v[2];
            int nr = 1;
#if MATVEC_X86
            if (simd) {
                nr = r + 1 < r1 ? 2 : 1;
                row[1] = row[0] + row_bytes;
                kern.rows(row, nr, &xq, len / form_block(f), v);
            } else
#endif
                v[0] = dot_int_portable(type, row[0], &xq, len);
            for (int i = 0; i < nr; i++, r++)
                y[r] = k ? y[r] + v[i] : v[i];
        }
    }
}

/* Plain types: y[r] = W[r] . x for r in [r0, r1). */
static void rows_plain(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes,
                       const float *x, uint64_t n, float *y, uint64_t r0, uint64_t r1)
{
    (void)simd; /* unused without x86 */
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
#if MATVEC_X86
        if (simd) {
            y[r] = dot_plain_simd(type, row, x, n);
            continue;
        }
#endif
        float buf[MV_CHUNK];
        float sum = 0.0f;
        for (uint64_t k = 0; k < n; k += MV_CHUNK) {
            uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
            decode_scalar(type, row, k, len, buf);
            sum += dot_f32_portable(buf, x + k, len);
        }
        y[r] = sum;
    }
}

static void rows_any(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes,
                     const float *x, uint64_t n, float *y, uint64_t r0, uint64_t r1)
{
    if (x_form(type) == XFORM_F32)
        rows_plain(simd, type, w, row_bytes, x, n, y, r0, r1);
    else
        rows_int(simd, type, w, row_bytes, x, n, y, r0, r1);
}

#if MATVEC_X86
/* Integer batch path (AVX2): per segment of MV_BSEG values, MV_BACT
 * activation rows are quantized together and every weight row is unpacked
 * once for them. */
static void batch_int_simd(uint32_t type, const uint8_t *w, size_t row_bytes, const float *X,
                           size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy, uint64_t r0,
                           uint64_t r1)
{
    enum xform f = x_form(type);
    struct int_kernels kern = int_kernels_of(type);
    struct xquant xq;
    for (uint64_t k = 0; k == 0 || k < n; k += MV_BSEG) {
        uint64_t len = n - k < MV_BSEG ? n - k : MV_BSEG;
        for (uint64_t s0 = 0; s0 < S; s0 += MV_BACT) {
            uint32_t ns = S - s0 < MV_BACT ? (uint32_t)(S - s0) : MV_BACT;
            xq_fill(true, f, X + s0 * ldx + k, ldx, ns, MV_BACT, len, &xq);
            for (uint64_t r = r0; r < r1; r++) {
                float out[MV_BACT];
                kern.batch(w + r * row_bytes + elem_offset(type, k), &xq, len / form_block(f), ns,
                           out);
                for (uint32_t i = 0; i < ns; i++) {
                    float *y = Y + (s0 + i) * ldy + r;
                    *y = k ? *y + out[i] : out[i];
                }
            }
        }
    }
}
#endif

/* Points wr[0..MV_TILE) at elements [k, k + len) of plain rows r .. r + nr
 * - 1, decoded into buf; a short last tile repeats its first row. */
static void decode_tile(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes, uint64_t r,
                        int nr, uint64_t k, uint64_t len, float buf[][MV_CHUNK],
                        const float *wr[MV_TILE])
{
    (void)simd; /* unused without x86 */
    for (int i = 0; i < MV_TILE; i++) {
        const uint8_t *row = w + (r + (i < nr ? i : 0)) * row_bytes;
#if MATVEC_X86
        if (simd) {
            wr[i] = decode_plain_simd(type, row, k, len, buf[i]);
            continue;
        }
#endif
        decode_scalar(type, row, k, len, buf[i]);
        wr[i] = buf[i];
    }
}

/* Multiplies a decoded tile with activation rows s and s + 1 (or s alone
 * when it is the last) and adds the results into Y (k == 0: stores them). */
static void multiply_tile(bool simd, const float *const wr[MV_TILE], int nr, const float *X,
                          size_t ldx, uint64_t S, uint64_t s, uint64_t k, uint64_t len, float *Y,
                          size_t ldy, uint64_t r)
{
    (void)simd; /* unused without x86 */
    const float *x0 = X + s * ldx + k;
    const float *x1 = s + 1 < S ? x0 + ldx : x0;
    int ns = s + 1 < S ? 2 : 1;
    float out[8];
#if MATVEC_X86
    if (simd)
        tile_simd(wr, x0, x1, len, out);
    else
#endif
        tile_portable(wr, x0, x1, len, out);
    for (int j = 0; j < ns; j++)
        for (int i = 0; i < nr; i++) {
            float *y = Y + (s + (uint64_t)j) * ldy + r + (uint64_t)i;
            *y = k ? *y + out[2 * i + j] : out[2 * i + j];
        }
}

/* The plain-type batch loop of both paths: tiles of MV_TILE rows x MV_CHUNK
 * elements, each decoded once, times all S activation rows two at a time. */
static void batch_plain(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes,
                        const float *X, size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy,
                        uint64_t r0, uint64_t r1)
{
    _Alignas(32) float buf[MV_TILE][MV_CHUNK];
    for (uint64_t r = r0; r < r1; r += MV_TILE) {
        int nr = r1 - r < MV_TILE ? (int)(r1 - r) : MV_TILE;
        for (uint64_t k = 0; k == 0 || k < n; k += MV_CHUNK) {
            uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
            const float *wr[MV_TILE];
            decode_tile(simd, type, w, row_bytes, r, nr, k, len, buf, wr);
            for (uint64_t s = 0; s < S; s += 2)
                multiply_tile(simd, wr, nr, X, ldx, S, s, k, len, Y, ldy, r);
        }
    }
}

/* ---- public functions ------------------------------------------------------------ */

uint32_t matvec_x_type(uint32_t type)
{
    ASSERT(quant_is_supported(type));
    switch (x_form(type)) {
    case XFORM_Q8_0: return QUANT_TYPE_Q8_0;
    case XFORM_Q8_K: return QUANT_TYPE_Q8_K;
    default: return QUANT_TYPE_F32;
    }
}

float matvec_dot(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
    float y;
    rows_any(matvec_has_simd(), type, row, 0, x, n, &y, 0, 1);
    return y;
}

float matvec_dot_portable(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
    float y;
    rows_any(false, type, row, 0, x, n, &y, 0, 1);
    return y;
}

double matvec_dot_ref(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
    float buf[MV_CHUNK];
    double sum = 0.0;
    for (uint64_t k = 0; k < n; k += MV_CHUNK) {
        uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
        decode_scalar(type, row, k, len, buf);
        for (uint64_t i = 0; i < len; i++)
            sum += (double)buf[i] * (double)x[k + i];
    }
    return sum;
}

double matvec_dot_ref_xq(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
    enum xform f = x_form(type);
    if (f == XFORM_F32)
        return matvec_dot_ref(type, row, x, n);
    uint32_t bl = form_block(f);
    float buf[MV_CHUNK];
    struct xquant xq;
    double sum = 0.0;
    for (uint64_t k = 0; k < n; k += MV_CHUNK) {
        uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
        decode_scalar(type, row, k, len, buf);
        xq_fill(false, f, x + k, 0, 1, 1, len, &xq);
        for (uint64_t i = 0; i < len; i++)
            sum += (double)buf[i] * ((double)xq.qs[i] * (double)xq.d[i / bl]);
    }
    return sum;
}

bool matvec_has_simd(void)
{
#if MATVEC_X86 && defined(__clang__)
    /* clang's builtin does not know "f16c"; no AVX2 CPU lacks it */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#elif MATVEC_X86
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

void matvec_rows(uint32_t type, const void *w, size_t row_bytes, const float *x, uint64_t n,
                 float *y, uint64_t r0, uint64_t r1)
{
    check_args(type, n);
    ASSERT(row_bytes >= quant_row_size(type, n) && r0 <= r1);
    rows_any(matvec_has_simd(), type, w, row_bytes, x, n, y, r0, r1);
}

void matvec_rows_batch(uint32_t type, const void *w, size_t row_bytes, const float *X,
                       size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy, uint64_t r0,
                       uint64_t r1)
{
    check_batch_args(type, row_bytes, ldx, n, ldy, r0, r1);
    bool simd = matvec_has_simd();
    if (S == 1) {
        rows_any(simd, type, w, row_bytes, X, n, Y, r0, r1);
        return;
    }
    if (!simd) {
        matvec_rows_batch_portable(type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
        return;
    }
    if (x_form(type) == XFORM_F32)
        batch_plain(true, type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
#if MATVEC_X86
    else
        batch_int_simd(type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
#endif
}

void matvec_rows_batch_portable(uint32_t type, const void *w, size_t row_bytes, const float *X,
                                size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy,
                                uint64_t r0, uint64_t r1)
{
    check_batch_args(type, row_bytes, ldx, n, ldy, r0, r1);
    if (x_form(type) == XFORM_F32) {
        batch_plain(false, type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
        return;
    }
    for (uint64_t s = 0; s < S; s++)
        rows_int(false, type, w, row_bytes, X + s * ldx, n, Y + s * ldy, r0, r1);
}
