/*
 * matvec: dot products of GGUF weight rows with f32 activations (see
 * matvec.h for the contract).
 *
 * Maths: for a row of blocks, sum_i w_i x_i with w_i the dequantized value of
 * model-spec 2.2/2.3. Every block type is written once as blk_NAME(), which
 * turns its bytes into groups of 16 or 32 float levels q with a scale s and
 * a min m (w = s*q - m) and hands each group to emit(): the dot path adds
 * s * sum(q*x) in 8 f32 lanes (mins are added once per block from sums of x
 * made beforehand, x_sums, or on the spot for Q4_1/Q5_1), the decode path
 * stores w. So the only differences from the reference are f32 rounding.
 *
 * Paths: rows_simd (AVX2, fused, one row at a time; K-quants with mins walk
 * rows in segments of MV_SEG elements so the sums of x are made once per
 * segment), rows_batch (tiles of MV_TILE rows x MV_CHUNK elements decoded
 * into a stack buffer once, then multiplied with activation rows two at a
 * time), and the portable C path (scalar dequantization into a stack buffer,
 * then an 8-lane dot). Stack use stays under 20 KiB per call.
 *
 * The AVX2 functions carry __attribute__((target)) and are only called after
 * matvec_has_simd() says yes; the rest of the file is plain C11. Everything
 * here is pure and reentrant.
 */
#include "kernels/cpu/matvec.h"

#include <string.h>

#include "common/check.h"
#include "model/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MATVEC_X86 1
#else
#define MATVEC_X86 0
#endif

#define MV_CHUNK 1024 /* elements decoded into a stack buffer at once (multiple of 256) */
#define MV_TILE 4     /* weight rows per tile of the batch path */
#define MV_SEG 8192   /* elements per row segment of the dots that use sums of x */

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
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

/* ---- AVX2 path ------------------------------------------------------------ */

#if MATVEC_X86
#define SIMD __attribute__((target("avx2,fma,f16c")))
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

/* The fp16 at p (x86 is little-endian: one 16-bit load). */
static inline SIMD float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

/* 8 bytes at p, zero- or sign-extended to 8 x i32. */
static inline SIMD __m256i u8x8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

static inline SIMD __m256i i8x8(const uint8_t *p)
{
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

static inline SIMD __m256 ld8(const float *p)
{
    return _mm256_loadu_ps(p);
}

static inline SIMD __m256 cvt8(__m256i v)
{
    return _mm256_cvtepi32_ps(v);
}

/*
 * The one place where levels meet activations. A group of nv*8 elements has
 * float levels q[0..nv) and values w = s*q - m (s and m broadcast in sv and
 * mv). In dot mode (acc given, y NULL) adds s * sum(q*x) to acc[0], x taken
 * from x + off; the m part is the caller's (from sums of x). In decode mode
 * (acc NULL, x NULL) stores w to y + off. acc is either a local array or the
 * literal NULL and nv (2 or 4) a constant, so the branches fold away.
 */
static inline SIMD void emit(int nv, const __m256 *q, __m256 sv, __m256 mv, const float *x,
                             float *y, size_t off, __m256 *acc)
{
    if (!acc) {
        UNROLL
        for (int v = 0; v < nv; v++)
            _mm256_storeu_ps(y + off + 8 * v, _mm256_fmsub_ps(q[v], sv, mv));
        return;
    }
    x += off;
    __m256 p = _mm256_mul_ps(q[0], ld8(x)), r = _mm256_mul_ps(q[1], ld8(x + 8));
    if (nv == 4) {
        p = _mm256_fmadd_ps(q[2], ld8(x + 16), p);
        r = _mm256_fmadd_ps(q[3], ld8(x + 24), r);
    }
    acc[0] = _mm256_fmadd_ps(sv, _mm256_add_ps(p, r), acc[0]);
}

static inline SIMD __m256 sum32(const float *x)
{
    __m256 a = _mm256_add_ps(ld8(x), ld8(x + 8));
    return _mm256_add_ps(a, _mm256_add_ps(ld8(x + 16), ld8(x + 24)));
}

/* 32 nibbles of 16 bytes (low nibbles are elements 0..15) as 4 x 8 i32. */
static inline SIMD void nib32(const uint8_t *qs, __m256i v[4])
{
    const __m256i m = _mm256_set1_epi32(0x0F);
    __m256i a = u8x8(qs), b = u8x8(qs + 8);
    v[0] = _mm256_and_si256(a, m);
    v[1] = _mm256_and_si256(b, m);
    v[2] = _mm256_srli_epi32(a, 4);
    v[3] = _mm256_srli_epi32(b, 4);
}

/* Q5_0/Q5_1 levels plus bias: nibbles, plus 16 * bit j of the
 * little-endian qh word for element j. */
static inline SIMD void q5_levels(const uint8_t *qh, const uint8_t *qs, int bias, __m256 q[4])
{
    uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 |
                 (uint32_t)qh[3] << 24;
    __m256i v[4], hv = _mm256_set1_epi32((int)h), one = _mm256_set1_epi32(1);
    __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    nib32(qs, v);
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(hv, sh), one);
        v[k] = _mm256_add_epi32(_mm256_or_si256(v[k], _mm256_slli_epi32(bit, 4)),
                                _mm256_set1_epi32(bias));
        q[k] = cvt8(v[k]);
        sh = _mm256_add_epi32(sh, _mm256_set1_epi32(8));
    }
}

/* IQ4_NL / IQ4_XS: 32 table levels (kvalues_iq4nl) of 16 nibble bytes. */
static inline SIMD void iq4_levels(const uint8_t *qs, __m256 q[4])
{
    const __m128i tbl = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                      53, 69, 89, 113);
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_shuffle_epi8(tbl, _mm_and_si128(raw, mask));
    __m128i hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    q[0] = cvt8(_mm256_cvtepi8_epi32(lo));
    q[1] = cvt8(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = cvt8(_mm256_cvtepi8_epi32(hi));
    q[3] = cvt8(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/*
 * One block of each type: blk_NAME(b, x, xs, y, acc) emits the block's
 * groups (see emit). In dot mode (acc given) the types with mins also add
 * m * sum(x) to acc[1]: Q4_K/Q5_K and Q2_K from xs, the precomputed sums of
 * x over their 32- or 16-element groups; Q4_1/Q5_1 by summing x directly.
 */
static inline SIMD void blk_q8_0(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    __m256 q[4];
    UNROLL
    for (int k = 0; k < 4; k++)
        q[k] = cvt8(i8x8(b + 2 + 8 * k));
    emit(4, q, _mm256_set1_ps(f16_at(b)), _mm256_setzero_ps(), x, y, 0, acc);
}

static inline SIMD void blk_q4_0(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    /* nibbles minus 8 as 32 signed bytes (low nibbles first), then widened */
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2));
    __m128i m4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, m4), eight);
    __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), eight);
    __m256 q[4] = {cvt8(_mm256_cvtepi8_epi32(lo)), cvt8(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                   cvt8(_mm256_cvtepi8_epi32(hi)), cvt8(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
    emit(4, q, _mm256_set1_ps(f16_at(b)), _mm256_setzero_ps(), x, y, 0, acc);
}

/* Q4_1/Q5_1: w = d*q + m, so the "min" subtracted is -m. */
static inline SIMD void affine32(const __m256 *q, const uint8_t *b, const float *x, float *y,
                                 __m256 *acc)
{
    __m256 mv = _mm256_set1_ps(-f16_at(b + 2));
    emit(4, q, _mm256_set1_ps(f16_at(b)), mv, x, y, 0, acc);
    if (acc)
        acc[1] = _mm256_fmadd_ps(mv, sum32(x), acc[1]);
}

static inline SIMD void blk_q4_1(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    __m256i v[4];
    __m256 q[4];
    nib32(b + 4, v);
    UNROLL
    for (int k = 0; k < 4; k++)
        q[k] = cvt8(v[k]);
    affine32(q, b, x, y, acc);
}

static inline SIMD void blk_q5_0(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    __m256 q[4];
    q5_levels(b + 2, b + 6, -16, q);
    emit(4, q, _mm256_set1_ps(f16_at(b)), _mm256_setzero_ps(), x, y, 0, acc);
}

static inline SIMD void blk_q5_1(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    __m256 q[4];
    q5_levels(b + 4, b + 8, 0, q);
    affine32(q, b, x, y, acc);
}

static inline SIMD void blk_iq4_nl(const uint8_t *b, const float *x, const float *xs, float *y,
                                   __m256 *acc)
{
    (void)xs;
    __m256 q[4];
    iq4_levels(b + 2, q);
    emit(4, q, _mm256_set1_ps(f16_at(b)), _mm256_setzero_ps(), x, y, 0, acc);
}

static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The 8 scales (times d) and mins (times dmin) of a Q4_K/Q5_K block, all at
 * once: get_scale_min_k4 of model-spec 2.3 done on 32-bit words, bytes k of
 * the words holding sub-blocks k (low words) and 4 + k (high words). */
static inline SIMD void k4_scales(const uint8_t *s, float d, float dmin, float sc[8], float mn[8])
{
    uint32_t u0 = rd32(s), u1 = rd32(s + 4), u2 = rd32(s + 8);
    uint32_t sc_lo = u0 & 0x3F3F3F3F, m_lo = u1 & 0x3F3F3F3F;
    uint32_t sc_hi = (u2 & 0x0F0F0F0F) | ((u0 & 0xC0C0C0C0) >> 2);
    uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0F) | ((u1 & 0xC0C0C0C0) >> 2);
    __m128i v = _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)m_lo, (int)m_hi);
    _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(d), cvt8(_mm256_cvtepu8_epi32(v))));
    _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(dmin),
                                       cvt8(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
}

/* Q4_K (qh NULL) or Q5_K: chunk c of 64 elements is sub-blocks 2c (low
 * nibbles of qs[32c..]) and 2c+1 (high nibbles); Q5_K's fifth bits are bits
 * 2c and 2c+1 of qh[l]. */
static inline SIMD void blk_k45(const uint8_t *b, const uint8_t *qh, const uint8_t *qs,
                                const float *x, const float *xs, float *y, __m256 *acc)
{
    const __m256i m4 = _mm256_set1_epi32(0x0F), b4 = _mm256_set1_epi32(16);
    float sc[8], mn[8];
    k4_scales(b + 4, f16_at(b), f16_at(b + 2), sc, mn);
    __m256i h[4];
    UNROLL
    for (int k = 0; k < 4; k++)
        h[k] = qh ? u8x8(qh + 8 * k) : _mm256_setzero_si256();
    UNROLL
    for (int c = 0; c < 4; c++) {
        __m256 lo[4], hi[4];
        UNROLL
        for (int k = 0; k < 4; k++) {
            __m256i v = u8x8(qs + 32 * c + 8 * k);
            __m256i l = _mm256_and_si256(v, m4), u = _mm256_srli_epi32(v, 4);
            if (qh) { /* h[k] is shifted right by 2 per chunk: bits 0 and 1 are current */
                l = _mm256_or_si256(l, _mm256_and_si256(_mm256_slli_epi32(h[k], 4), b4));
                u = _mm256_or_si256(u, _mm256_and_si256(_mm256_slli_epi32(h[k], 3), b4));
                h[k] = _mm256_srli_epi32(h[k], 2);
            }
            lo[k] = cvt8(l);
            hi[k] = cvt8(u);
        }
        emit(4, lo, _mm256_set1_ps(sc[2 * c]), _mm256_set1_ps(mn[2 * c]), x, y, 64 * c, acc);
        emit(4, hi, _mm256_set1_ps(sc[2 * c + 1]), _mm256_set1_ps(mn[2 * c + 1]), x, y,
             64 * c + 32, acc);
    }
    if (acc)
        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(mn), ld8(xs), acc[1]);
}

static inline SIMD void blk_q4_k(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    blk_k45(b, NULL, b + 16, x, xs, y, acc);
}

static inline SIMD void blk_q5_k(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    blk_k45(b, b + 16, b + 48, x, xs, y, acc);
}

/* Q6_K levels (minus 32) of lanes l = 8i..8i+7 of one half: q[k] are the
 * outputs at l + 32k of model-spec 2.3 (k = 0..3). */
static inline SIMD void q6_levels(const uint8_t *ql, const uint8_t *qh, int i, __m256 q[4])
{
    const __m256i m4 = _mm256_set1_epi32(0x0F), m30 = _mm256_set1_epi32(0x30);
    const __m256i off = _mm256_set1_epi32(32);
    __m256i l0 = u8x8(ql + 8 * i), l1 = u8x8(ql + 32 + 8 * i), h = u8x8(qh + 8 * i);
    __m256i v[4];
    v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi32(h, 4), m30));
    v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi32(h, 2), m30));
    v[2] = _mm256_or_si256(_mm256_srli_epi32(l0, 4), _mm256_and_si256(h, m30));
    v[3] = _mm256_or_si256(_mm256_srli_epi32(l1, 4), _mm256_and_si256(_mm256_srli_epi32(h, 2), m30));
    UNROLL
    for (int k = 0; k < 4; k++)
        q[k] = cvt8(_mm256_sub_epi32(v[k], off));
}

/* Q6_K: groups of 16 elements (lanes 16is.. of output k of half h), group
 * 8h + is + 2k with int8 scale scales[8h + is + 2k]. */
static inline SIMD void blk_q6_k(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    float sc[16];
    __m256 dv = _mm256_set1_ps(f16_at(b + 208)), zero = _mm256_setzero_ps();
    _mm256_storeu_ps(sc, _mm256_mul_ps(dv, cvt8(i8x8(b + 192))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(dv, cvt8(i8x8(b + 200))));
    UNROLL
    for (int h = 0; h < 2; h++) {
        UNROLL
        for (int is = 0; is < 2; is++) {
            __m256 qa[4], qb[4];
            q6_levels(b + 64 * h, b + 128 + 32 * h, 2 * is, qa);
            q6_levels(b + 64 * h, b + 128 + 32 * h, 2 * is + 1, qb);
            UNROLL
            for (int k = 0; k < 4; k++) {
                __m256 g[2] = {qa[k], qb[k]};
                emit(2, g, _mm256_set1_ps(sc[8 * h + is + 2 * k]), zero, x, y,
                     128 * h + 32 * k + 16 * is, acc);
            }
        }
    }
}

/* Q2_K and Q3_K: in half h and shift step t, the 16-element groups
 * 128h + 32t + 16s (s = 0, 1) take bits 2t..2t+1 of qs[32h + 16s + l]; group
 * index 8h + 2t + s selects the scale. */
static inline SIMD void q23_levels(const __m256i *q, int s, int t, __m256i v[2])
{
    const __m256i m3 = _mm256_set1_epi32(3), sh = _mm256_set1_epi32(2 * t);
    v[0] = _mm256_and_si256(_mm256_srlv_epi32(q[2 * s], sh), m3);
    v[1] = _mm256_and_si256(_mm256_srlv_epi32(q[2 * s + 1], sh), m3);
}

static inline SIMD void blk_q2_k(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    float sc[16], mn[16];
    __m128i raw = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    __m256 dv = _mm256_set1_ps(f16_at(b + 80)), mv = _mm256_set1_ps(f16_at(b + 82));
    _mm256_storeu_ps(sc, _mm256_mul_ps(dv, cvt8(_mm256_cvtepu8_epi32(lo))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(dv, cvt8(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_storeu_ps(mn, _mm256_mul_ps(mv, cvt8(_mm256_cvtepu8_epi32(hi))));
    _mm256_storeu_ps(mn + 8, _mm256_mul_ps(mv, cvt8(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))));
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m256i q[4];
        UNROLL
        for (int i = 0; i < 4; i++)
            q[i] = u8x8(b + 16 + 32 * h + 8 * i);
        UNROLL
        for (int g = 0; g < 8; g++) { /* g = 2t + s */
            __m256i v[2];
            q23_levels(q, g % 2, g / 2, v);
            __m256 f[2] = {cvt8(v[0]), cvt8(v[1])};
            emit(2, f, _mm256_set1_ps(sc[8 * h + g]), _mm256_set1_ps(mn[8 * h + g]), x, y,
                 128 * h + 16 * g, acc);
        }
    }
    if (acc) {
        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(mn), ld8(xs), acc[1]);
        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8), ld8(xs + 8), acc[1]);
    }
}

/* Q3_K scales times d: 16 signed 6-bit values, low 4 bits in the nibbles of
 * s[0..7] (low nibbles first), high 2 bits of scale j at bit 2*(j/4) of
 * s[8 + j%4]; built as 16 bytes on 64-bit words. */
static inline SIMD void q3_scales(const uint8_t *s, float d, float sc[16])
{
    uint64_t l = (uint64_t)rd32(s) | (uint64_t)rd32(s + 4) << 32;
    uint32_t u = rd32(s + 8);
    uint64_t h_lo = (uint64_t)(u & 0x03030303) | (uint64_t)((u >> 2) & 0x03030303) << 32;
    uint64_t h_hi = (uint64_t)((u >> 4) & 0x03030303) | (uint64_t)((u >> 6) & 0x03030303) << 32;
    uint64_t lo = (l & 0x0F0F0F0F0F0F0F0Full) | h_lo << 4;
    uint64_t hi = ((l >> 4) & 0x0F0F0F0F0F0F0F0Full) | h_hi << 4;
    __m128i v = _mm_sub_epi8(_mm_set_epi64x((long long)hi, (long long)lo), _mm_set1_epi8(32));
    __m256 dv = _mm256_set1_ps(d);
    _mm256_storeu_ps(sc, _mm256_mul_ps(dv, cvt8(_mm256_cvtepi8_epi32(v))));
    _mm256_storeu_ps(sc + 8, _mm256_mul_ps(dv, cvt8(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
}

/* Q3_K: level - 4, plus 4 where hmask bit 4h + t of hmask[16s + l] is set;
 * hm[] is shifted right once per step t so that bit 0 is current. */
static inline SIMD void blk_q3_k(const uint8_t *b, const float *x, const float *xs, float *y,
                                 __m256 *acc)
{
    (void)xs;
    const __m256i four = _mm256_set1_epi32(4), m3 = _mm256_set1_epi32(3);
    const __m256 zero = _mm256_setzero_ps();
    float sc[16];
    q3_scales(b + 96, f16_at(b + 108), sc);
    __m256i hm[4];
    UNROLL
    for (int i = 0; i < 4; i++)
        hm[i] = _mm256_slli_epi32(u8x8(b + 8 * i), 2); /* bit 0 of the mask as value 4 */
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m256i q[4];
        UNROLL
        for (int i = 0; i < 4; i++)
            q[i] = u8x8(b + 32 + 32 * h + 8 * i);
        UNROLL
        for (int t = 0; t < 4; t++) {
            __m256 f[4];
            UNROLL
            for (int i = 0; i < 4; i++) {
                __m256i lv = _mm256_and_si256(q[i], m3), hb = _mm256_and_si256(hm[i], four);
                f[i] = cvt8(_mm256_sub_epi32(_mm256_add_epi32(lv, hb), four));
                q[i] = _mm256_srli_epi32(q[i], 2);
                hm[i] = _mm256_srli_epi32(hm[i], 1);
            }
            emit(2, f, _mm256_set1_ps(sc[8 * h + 2 * t]), zero, x, y, 128 * h + 32 * t, acc);
            emit(2, f + 2, _mm256_set1_ps(sc[8 * h + 2 * t + 1]), zero, x, y,
                 128 * h + 32 * t + 16, acc);
        }
    }
}

/* IQ4_XS: sub-block ib has scale d * (ls - 32) with the 6-bit ls of
 * model-spec 2.3 and its 32 levels in qs[16ib..]. */
static inline SIMD void blk_iq4_xs(const uint8_t *b, const float *x, const float *xs, float *y,
                                   __m256 *acc)
{
    (void)xs;
    float d = f16_at(b);
    int sh = rd16(b + 2);
    UNROLL
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
        __m256 q[4];
        iq4_levels(b + 8 + 16 * ib, q);
        emit(4, q, _mm256_set1_ps(d * (float)(ls - 32)), _mm256_setzero_ps(), x, y, 32 * ib,
             acc);
    }
}

/* dot_NAME(w, x, xs, nb) and decode_NAME(w, nb, y) over nb blocks of a block
 * type, from its blk_NAME; a block's sums of x start at xs + block * nxs. */
#define BLOCK_KERNELS(name, elems, bytes, nxs)                                                     \
    static SIMD float dot_##name(const uint8_t *w, const float *x, const float *xs, uint64_t nb)  \
    {                                                                                              \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                               \
        for (uint64_t i = 0; i < nb; i++)                                                          \
            blk_##name(w + i * (bytes), x + i * (elems), (nxs) ? xs + i * (nxs) : NULL, NULL,   \
                       acc);                                                                       \
        return hsum8(_mm256_sub_ps(acc[0], acc[1]));                                               \
    }                                                                                              \
    static SIMD void decode_##name(const uint8_t *w, uint64_t nb, float *y)                        \
    {                                                                                              \
        for (uint64_t i = 0; i < nb; i++)                                                          \
            blk_##name(w + i * (bytes), NULL, NULL, y + i * (elems), NULL);                        \
    }

BLOCK_KERNELS(q8_0, 32, 34, 0)
BLOCK_KERNELS(q4_0, 32, 18, 0)
BLOCK_KERNELS(q4_1, 32, 20, 0)
BLOCK_KERNELS(q5_0, 32, 22, 0)
BLOCK_KERNELS(q5_1, 32, 24, 0)
BLOCK_KERNELS(iq4_nl, 32, 18, 0)
BLOCK_KERNELS(q2_k, 256, 84, 16)
BLOCK_KERNELS(q3_k, 256, 110, 0)
BLOCK_KERNELS(q4_k, 256, 144, 8)
BLOCK_KERNELS(q5_k, 256, 176, 8)
BLOCK_KERNELS(q6_k, 256, 210, 0)
BLOCK_KERNELS(iq4_xs, 256, 136, 0)

/* Sums of x over groups of g (16 or 32) elements, n a multiple of g. */
static SIMD void x_sums(const float *x, uint64_t n, int g, float *xs)
{
    for (uint64_t i = 0; i < n; i += (uint64_t)g) {
        __m256 s = _mm256_add_ps(ld8(x + i), ld8(x + i + 8));
        if (g == 32)
            s = _mm256_add_ps(s, _mm256_add_ps(ld8(x + i + 16), ld8(x + i + 24)));
        xs[i / (uint64_t)g] = hsum8(s);
    }
}

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
static inline SIMD float dot_plain(uint32_t type, const uint8_t *w, const float *x, uint64_t n)
{
    uint32_t es = quant_block_bytes(type);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    uint64_t i = 0;
    for (; i + 32 <= n; i += 32) {
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

static SIMD float dot_f32(const uint8_t *w, const float *x, uint64_t n)
{
    return dot_plain(QUANT_TYPE_F32, w, x, n);
}

static SIMD float dot_f16(const uint8_t *w, const float *x, uint64_t n)
{
    return dot_plain(QUANT_TYPE_F16, w, x, n);
}

static SIMD float dot_bf16(const uint8_t *w, const float *x, uint64_t n)
{
    return dot_plain(QUANT_TYPE_BF16, w, x, n);
}

static SIMD void decode_plain(uint32_t type, const uint8_t *w, uint64_t n, float *y)
{
    uint32_t es = quant_block_bytes(type);
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, load_plain8(type, w + es * i));
    for (; i < n; i++)
        y[i] = plain_at(type, w, i);
}

/* One row segment; xs as made by x_sums for the types of xs_group. */
static SIMD float dot_seg(uint32_t type, const uint8_t *w, const float *x, const float *xs,
                          uint64_t n)
{
    switch (type) {
    case QUANT_TYPE_F32: return dot_f32(w, x, n);
    case QUANT_TYPE_F16: return dot_f16(w, x, n);
    case QUANT_TYPE_BF16: return dot_bf16(w, x, n);
    case QUANT_TYPE_Q8_0: return dot_q8_0(w, x, xs, n / 32);
    case QUANT_TYPE_Q4_0: return dot_q4_0(w, x, xs, n / 32);
    case QUANT_TYPE_Q4_1: return dot_q4_1(w, x, xs, n / 32);
    case QUANT_TYPE_Q5_0: return dot_q5_0(w, x, xs, n / 32);
    case QUANT_TYPE_Q5_1: return dot_q5_1(w, x, xs, n / 32);
    case QUANT_TYPE_IQ4_NL: return dot_iq4_nl(w, x, xs, n / 32);
    case QUANT_TYPE_Q2_K: return dot_q2_k(w, x, xs, n / 256);
    case QUANT_TYPE_Q3_K: return dot_q3_k(w, x, xs, n / 256);
    case QUANT_TYPE_Q4_K: return dot_q4_k(w, x, xs, n / 256);
    case QUANT_TYPE_Q5_K: return dot_q5_k(w, x, xs, n / 256);
    case QUANT_TYPE_Q6_K: return dot_q6_k(w, x, xs, n / 256);
    case QUANT_TYPE_IQ4_XS: return dot_iq4_xs(w, x, xs, n / 256);
    default: ASSERT(!"type without an AVX2 dot"); return 0.0f;
    }
}

/* len elements from element k of row into buf (or the row itself when it is
 * F32 at 4-byte alignment); returns where the floats are. */
static SIMD const float *decode_simd(uint32_t type, const uint8_t *row, uint64_t k, uint64_t len,
                                     float *buf)
{
    const uint8_t *w = row + elem_offset(type, k);
    switch (type) {
    case QUANT_TYPE_F32:
        if (((uintptr_t)w & 3) == 0)
            return (const float *)(const void *)w;
        decode_plain(type, w, len, buf);
        break;
    case QUANT_TYPE_F16:
    case QUANT_TYPE_BF16: decode_plain(type, w, len, buf); break;
    case QUANT_TYPE_Q8_0: decode_q8_0(w, len / 32, buf); break;
    case QUANT_TYPE_Q4_0: decode_q4_0(w, len / 32, buf); break;
    case QUANT_TYPE_Q4_1: decode_q4_1(w, len / 32, buf); break;
    case QUANT_TYPE_Q5_0: decode_q5_0(w, len / 32, buf); break;
    case QUANT_TYPE_Q5_1: decode_q5_1(w, len / 32, buf); break;
    case QUANT_TYPE_IQ4_NL: decode_iq4_nl(w, len / 32, buf); break;
    case QUANT_TYPE_Q2_K: decode_q2_k(w, len / 256, buf); break;
    case QUANT_TYPE_Q3_K: decode_q3_k(w, len / 256, buf); break;
    case QUANT_TYPE_Q4_K: decode_q4_k(w, len / 256, buf); break;
    case QUANT_TYPE_Q5_K: decode_q5_k(w, len / 256, buf); break;
    case QUANT_TYPE_Q6_K: decode_q6_k(w, len / 256, buf); break;
    case QUANT_TYPE_IQ4_XS: decode_iq4_xs(w, len / 256, buf); break;
    default: ASSERT(!"type without an AVX2 decoder");
    }
    return buf;
}

/* Group size of the sums of x that a type's fused dot uses, 0 for none. */
static int xs_group(uint32_t type)
{
    if (type == QUANT_TYPE_Q2_K)
        return 16;
    return type == QUANT_TYPE_Q4_K || type == QUANT_TYPE_Q5_K ? 32 : 0;
}

/* y[r] = W[r] . x for r in [r0, r1). Types with mins go segment by segment
 * (segments outside, rows inside) so that the sums of x of a segment are
 * made once for all rows; a row's result is the same whatever the range. */
static SIMD void rows_simd(uint32_t type, const uint8_t *w, size_t row_bytes, const float *x,
                           uint64_t n, float *y, uint64_t r0, uint64_t r1)
{
    int g = xs_group(type);
    if (!g) {
        for (uint64_t r = r0; r < r1; r++)
            y[r] = dot_seg(type, w + r * row_bytes, x, NULL, n);
        return;
    }
    float xs[MV_SEG / 16];
    for (uint64_t k = 0; k == 0 || k < n; k += MV_SEG) {
        uint64_t len = n - k < MV_SEG ? n - k : MV_SEG;
        x_sums(x + k, len, g, xs);
        for (uint64_t r = r0; r < r1; r++) {
            float v = dot_seg(type, w + r * row_bytes + elem_offset(type, k), x + k, xs, len);
            y[r] = k ? y[r] + v : v;
        }
    }
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

/* ---- batch path -------------------------------------------------------------- */

/* Points wr[0..MV_TILE) at elements [k, k + len) of rows r .. r + nr - 1,
 * decoded into buf; a short last tile repeats its first row. */
static void decode_tile(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes, uint64_t r,
                        int nr, uint64_t k, uint64_t len, float buf[][MV_CHUNK],
                        const float *wr[MV_TILE])
{
    for (int i = 0; i < MV_TILE; i++) {
        const uint8_t *row = w + (r + (i < nr ? i : 0)) * row_bytes;
#if MATVEC_X86
        if (simd) {
            wr[i] = decode_simd(type, row, k, len, buf[i]);
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

/* The batch loop of both paths: tiles of MV_TILE rows x MV_CHUNK elements,
 * each decoded once, times all S activation rows two at a time. */
static void rows_batch(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes,
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

float matvec_dot(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
#if MATVEC_X86
    if (matvec_has_simd()) {
        float y;
        rows_simd(type, row, 0, x, n, &y, 0, 1);
        return y;
    }
#endif
    return matvec_dot_portable(type, row, x, n);
}

float matvec_dot_portable(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
    float buf[MV_CHUNK];
    float sum = 0.0f;
    for (uint64_t k = 0; k < n; k += MV_CHUNK) {
        uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
        decode_scalar(type, row, k, len, buf);
        sum += dot_f32_portable(buf, x + k, len);
    }
    return sum;
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
    const uint8_t *base = w;
#if MATVEC_X86
    if (matvec_has_simd()) {
        rows_simd(type, base, row_bytes, x, n, y, r0, r1);
        return;
    }
#endif
    for (uint64_t r = r0; r < r1; r++)
        y[r] = matvec_dot_portable(type, base + r * row_bytes, x, n);
}

void matvec_rows_batch(uint32_t type, const void *w, size_t row_bytes, const float *X,
                       size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy, uint64_t r0,
                       uint64_t r1)
{
    check_batch_args(type, row_bytes, ldx, n, ldy, r0, r1);
    if (S == 1)
        matvec_rows(type, w, row_bytes, X, n, Y, r0, r1);
    else
        rows_batch(matvec_has_simd(), type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
}

void matvec_rows_batch_portable(uint32_t type, const void *w, size_t row_bytes, const float *X,
                                size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy,
                                uint64_t r0, uint64_t r1)
{
    check_batch_args(type, row_bytes, ldx, n, ldy, r0, r1);
    rows_batch(false, type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
}
