/*
 * matvec: dot products of GGUF weight rows with f32 activations (see
 * matvec.h for the contract).
 *
 * Maths: for a row of blocks, sum_i w_i x_i where w_i is the dequantized
 * value of model-spec 2.2/2.3. The fused paths factor the block scales out:
 * per block (or sub-block) they form p = sum q_i x_i in 8 f32 lanes from the
 * integer levels q_i, then accumulate d * p (and subtract m * sum x_i for the
 * affine types), so the only differences from the reference are f32
 * rounding. Tails of F32/F16/BF16 rows shorter than 8 are done in scalar.
 *
 * The AVX2 functions carry __attribute__((target)) and are only called after
 * matvec_has_simd() says yes; the rest of the file is plain C11.
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

bool matvec_has_simd(void)
{
#if MATVEC_X86
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return false;
#endif
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

static inline SIMD float f16_at(const uint8_t *p)
{
    return _cvtsh_ss(rd16(p));
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

static inline SIMD __m256 dot32(const __m256 q[4], const float *x)
{
    __m256 p = _mm256_mul_ps(q[0], ld8(x));
    __m256 r = _mm256_mul_ps(q[1], ld8(x + 8));
    p = _mm256_fmadd_ps(q[2], ld8(x + 16), p);
    r = _mm256_fmadd_ps(q[3], ld8(x + 24), r);
    return _mm256_add_ps(p, r);
}

static inline SIMD __m256 sum32(const float *x)
{
    __m256 a = _mm256_add_ps(ld8(x), ld8(x + 8));
    __m256 b = _mm256_add_ps(ld8(x + 16), ld8(x + 24));
    return _mm256_add_ps(a, b);
}

/* Elements 8k..8k+7 of a 32-element block of nibbles (low nibbles first). */
static inline SIMD void nib32(const uint8_t *qs, __m256i q[4])
{
    const __m256i m = _mm256_set1_epi32(0x0F);
    __m256i a = u8x8(qs), b = u8x8(qs + 8);
    q[0] = _mm256_and_si256(a, m);
    q[1] = _mm256_and_si256(b, m);
    q[2] = _mm256_srli_epi32(a, 4);
    q[3] = _mm256_srli_epi32(b, 4);
}

/* Adds the fifth bits of Q5_0/Q5_1 (bit j of the little-endian qh word). */
static inline SIMD void fifth_bits(const uint8_t *qh, __m256i q[4])
{
    uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 |
                 (uint32_t)qh[3] << 24;
    __m256i hv = _mm256_set1_epi32((int)h), one = _mm256_set1_epi32(1);
    __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(hv, sh), one);
        q[k] = _mm256_or_si256(q[k], _mm256_slli_epi32(bit, 4));
        sh = _mm256_add_epi32(sh, eight);
    }
}

/* IQ4_NL / IQ4_XS: 32 table levels (kvalues_iq4nl) from 16 bytes of
 * nibbles, low nibbles first. */
static inline SIMD void iq4_unpack(const uint8_t *qs, __m256 q[4])
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

/* Levels of one block of a 32-element type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * IQ4_NL) as floats, with the block's d and m such that w = d*q + m (m is 0
 * for the symmetric types). */
static inline SIMD void unpack32(uint32_t type, const uint8_t *b, __m256 q[4], float *d, float *m)
{
    __m256i v[4];
    *d = f16_at(b);
    *m = 0.0f;
    switch (type) {
    case QUANT_TYPE_Q8_0:
        UNROLL
        for (int k = 0; k < 4; k++)
            q[k] = cvt8(i8x8(b + 2 + 8 * k));
        return;
    case QUANT_TYPE_Q4_0:
        nib32(b + 2, v);
        UNROLL
        for (int k = 0; k < 4; k++)
            q[k] = cvt8(_mm256_sub_epi32(v[k], _mm256_set1_epi32(8)));
        return;
    case QUANT_TYPE_Q4_1:
        *m = f16_at(b + 2);
        nib32(b + 4, v);
        break;
    case QUANT_TYPE_Q5_0:
        nib32(b + 6, v);
        fifth_bits(b + 2, v);
        UNROLL
        for (int k = 0; k < 4; k++)
            q[k] = cvt8(_mm256_sub_epi32(v[k], _mm256_set1_epi32(16)));
        return;
    case QUANT_TYPE_Q5_1:
        *m = f16_at(b + 2);
        nib32(b + 8, v);
        fifth_bits(b + 4, v);
        break;
    default: /* IQ4_NL */
        iq4_unpack(b + 2, q);
        return;
    }
    UNROLL
    for (int k = 0; k < 4; k++)
        q[k] = cvt8(v[k]);
}

/* One 32-element type, specialized per call site by inlining with a
 * constant type. */
static inline SIMD float dot_blocks32(uint32_t type, const uint8_t *w, const float *x,
                                      uint64_t nb)
{
    uint32_t bb = quant_block_bytes(type);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (uint64_t i = 0; i < nb; i++, w += bb, x += 32) {
        __m256 q[4];
        float d, m;
        unpack32(type, w, q, &d, &m);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), dot32(q, x), acc);
        if (type == QUANT_TYPE_Q4_1 || type == QUANT_TYPE_Q5_1)
            accm = _mm256_fmadd_ps(_mm256_set1_ps(m), sum32(x), accm);
    }
    return hsum8(_mm256_add_ps(acc, accm));
}

static SIMD float dot_q8_0_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_blocks32(QUANT_TYPE_Q8_0, w, x, nb);
}

static SIMD float dot_q4_0_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_blocks32(QUANT_TYPE_Q4_0, w, x, nb);
}

static SIMD float dot_q4_1_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_blocks32(QUANT_TYPE_Q4_1, w, x, nb);
}

static SIMD float dot_q5_0_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_blocks32(QUANT_TYPE_Q5_0, w, x, nb);
}

static SIMD float dot_q5_1_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_blocks32(QUANT_TYPE_Q5_1, w, x, nb);
}

static SIMD float dot_iq4_nl_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_blocks32(QUANT_TYPE_IQ4_NL, w, x, nb);
}

/* Scale and min of Q4_K/Q5_K sub-block j (get_scale_min_k4 of model-spec 2.3). */
static inline void scale_min_k4(int j, const uint8_t *s, float *sc, float *m)
{
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Levels of chunk c (64 elements) of a Q4_K or Q5_K block: lo[k] are
 * elements 8k.. of sub-block 2c, hi[k] of sub-block 2c+1. For Q5_K, qh[k]
 * holds qh bytes 8k..8k+7 shifted right by 2c and is advanced here. */
static inline SIMD void unpack_k_chunk(const uint8_t *qs, __m256i *qh, __m256 lo[4], __m256 hi[4])
{
    const __m256i m4 = _mm256_set1_epi32(0x0F), b4 = _mm256_set1_epi32(16);
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m256i v = u8x8(qs + 8 * k);
        __m256i l = _mm256_and_si256(v, m4), h = _mm256_srli_epi32(v, 4);
        if (qh) {
            l = _mm256_or_si256(l, _mm256_and_si256(_mm256_slli_epi32(qh[k], 4), b4));
            h = _mm256_or_si256(h, _mm256_and_si256(_mm256_slli_epi32(qh[k], 3), b4));
            qh[k] = _mm256_srli_epi32(qh[k], 2);
        }
        lo[k] = cvt8(l);
        hi[k] = cvt8(h);
    }
}

/* Q4_K (qs at byte 16) or Q5_K (five: qh at byte 16, qs at 48). */
static inline SIMD float dot_k45(const uint8_t *w, const float *x, uint64_t nb, bool five)
{
    uint32_t bb = five ? 176 : 144;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (uint64_t i = 0; i < nb; i++, w += bb, x += 256) {
        float d = f16_at(w), dmin = f16_at(w + 2);
        const uint8_t *s = w + 4, *qs = w + (five ? 48 : 16);
        __m256i qh[4];
        if (five)
            UNROLL
            for (int k = 0; k < 4; k++)
                qh[k] = u8x8(w + 16 + 8 * k);
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256 lo[4], hi[4];
            float sc1, m1, sc2, m2;
            unpack_k_chunk(qs + 32 * c, five ? qh : NULL, lo, hi);
            scale_min_k4(2 * c, s, &sc1, &m1);
            scale_min_k4(2 * c + 1, s, &sc2, &m2);
            const float *xc = x + 64 * c;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1), dot32(lo, xc), acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc2), dot32(hi, xc + 32), acc);
            accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin * m1), sum32(xc), accm);
            accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin * m2), sum32(xc + 32), accm);
        }
    }
    return hsum8(_mm256_sub_ps(acc, accm));
}

static SIMD float dot_q4_k_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_k45(w, x, nb, false);
}

static SIMD float dot_q5_k_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    return dot_k45(w, x, nb, true);
}

/* Q6_K levels (already minus 32) of lanes 8i..8i+7 of one half: q[0..3] are
 * the outputs at l, l+32, l+64, l+96 of model-spec 2.3. */
static inline SIMD void unpack_q6_k(const uint8_t *ql, const uint8_t *qh, int i, __m256 q[4])
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

static SIMD float dot_q6_k_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (uint64_t b = 0; b < nb; b++, w += 210, x += 256) {
        float d = f16_at(w + 208);
        UNROLL
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *sc = (const int8_t *)(w + 192 + 8 * h);
            const float *xh = x + 128 * h;
            UNROLL
            for (int is = 0; is < 2; is++) {
                __m256 p[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                               _mm256_setzero_ps()};
                UNROLL
                for (int i = 2 * is; i < 2 * is + 2; i++) {
                    __m256 q[4];
                    unpack_q6_k(ql, qh, i, q);
                    UNROLL
                    for (int k = 0; k < 4; k++)
                        p[k] = _mm256_fmadd_ps(q[k], ld8(xh + 32 * k + 8 * i), p[k]);
                }
                UNROLL
                for (int k = 0; k < 4; k++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[is + 2 * k]), p[k], acc);
            }
        }
    }
    return hsum8(acc);
}

/* IQ4_XS sub-block scale: d * (ls - 32) with the 6-bit ls of model-spec 2.3. */
static inline float iq4_xs_scale(const uint8_t *b, float d, int ib)
{
    int sh = rd16(b + 2);
    int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
    return d * (float)(ls - 32);
}

static SIMD float dot_iq4_xs_simd(const uint8_t *w, const float *x, uint64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (uint64_t b = 0; b < nb; b++, w += 136, x += 256) {
        float d = f16_at(w);
        UNROLL
        for (int ib = 0; ib < 8; ib++) {
            __m256 q[4];
            iq4_unpack(w + 8 + 16 * ib, q);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(iq4_xs_scale(w, d, ib)), dot32(q, x + 32 * ib),
                                  acc);
        }
    }
    return hsum8(acc);
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

static SIMD float dot_f32_simd(const uint8_t *w, const float *x, uint64_t n)
{
    return dot_plain(QUANT_TYPE_F32, w, x, n);
}

static SIMD float dot_f16_simd(const uint8_t *w, const float *x, uint64_t n)
{
    return dot_plain(QUANT_TYPE_F16, w, x, n);
}

static SIMD float dot_bf16_simd(const uint8_t *w, const float *x, uint64_t n)
{
    return dot_plain(QUANT_TYPE_BF16, w, x, n);
}

/* Decoders of the batch path: len elements of a row into buf. */
static inline SIMD void decode_blocks32(uint32_t type, const uint8_t *w, uint64_t nb, float *y)
{
    uint32_t bb = quant_block_bytes(type);
    for (uint64_t i = 0; i < nb; i++, w += bb, y += 32) {
        __m256 q[4];
        float d, m;
        unpack32(type, w, q, &d, &m);
        __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
        UNROLL
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(y + 8 * k, _mm256_fmadd_ps(q[k], dv, mv));
    }
}

static SIMD void decode_k45(const uint8_t *w, uint64_t nb, float *y, bool five)
{
    uint32_t bb = five ? 176 : 144;
    for (uint64_t i = 0; i < nb; i++, w += bb, y += 256) {
        float d = f16_at(w), dmin = f16_at(w + 2);
        const uint8_t *s = w + 4, *qs = w + (five ? 48 : 16);
        __m256i qh[4];
        if (five)
            UNROLL
            for (int k = 0; k < 4; k++)
                qh[k] = u8x8(w + 16 + 8 * k);
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256 lo[4], hi[4];
            float sc1, m1, sc2, m2;
            unpack_k_chunk(qs + 32 * c, five ? qh : NULL, lo, hi);
            scale_min_k4(2 * c, s, &sc1, &m1);
            scale_min_k4(2 * c + 1, s, &sc2, &m2);
            __m256 d1 = _mm256_set1_ps(d * sc1), o1 = _mm256_set1_ps(dmin * m1);
            __m256 d2 = _mm256_set1_ps(d * sc2), o2 = _mm256_set1_ps(dmin * m2);
            UNROLL
            for (int k = 0; k < 4; k++) {
                _mm256_storeu_ps(y + 64 * c + 8 * k, _mm256_fmsub_ps(lo[k], d1, o1));
                _mm256_storeu_ps(y + 64 * c + 32 + 8 * k, _mm256_fmsub_ps(hi[k], d2, o2));
            }
        }
    }
}

static SIMD void decode_q6_k(const uint8_t *w, uint64_t nb, float *y)
{
    for (uint64_t b = 0; b < nb; b++, w += 210, y += 256) {
        float d = f16_at(w + 208);
        UNROLL
        for (int h = 0; h < 2; h++) {
            const int8_t *sc = (const int8_t *)(w + 192 + 8 * h);
            __m256 s[8];
            UNROLL
            for (int g = 0; g < 8; g++)
                s[g] = _mm256_set1_ps(d * (float)sc[g]);
            UNROLL
            for (int i = 0; i < 4; i++) {
                __m256 q[4];
                unpack_q6_k(w + 64 * h, w + 128 + 32 * h, i, q);
                UNROLL
                for (int k = 0; k < 4; k++)
                    _mm256_storeu_ps(y + 128 * h + 32 * k + 8 * i,
                                     _mm256_mul_ps(q[k], s[i / 2 + 2 * k]));
            }
        }
    }
}

static SIMD void decode_iq4_xs(const uint8_t *w, uint64_t nb, float *y)
{
    for (uint64_t b = 0; b < nb; b++, w += 136, y += 256) {
        float d = f16_at(w);
        UNROLL
        for (int ib = 0; ib < 8; ib++) {
            __m256 q[4], dl = _mm256_set1_ps(iq4_xs_scale(w, d, ib));
            iq4_unpack(w + 8 + 16 * ib, q);
            UNROLL
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(y + 32 * ib + 8 * k, _mm256_mul_ps(q[k], dl));
        }
    }
}

/* Q2_K and Q3_K: in half h, shift step t, the 32 outputs y[128h + 32t + l]
 * take bits 2t..2t+1 of qs[32h + l]; outputs l < 16 and l >= 16 have their
 * own scale. */
static SIMD void decode_q2_k(const uint8_t *w, uint64_t nb, float *y)
{
    const __m256i m3 = _mm256_set1_epi32(3);
    for (uint64_t b = 0; b < nb; b++, w += 84, y += 256) {
        float d = f16_at(w + 80), dmin = f16_at(w + 82);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            UNROLL
            for (int i = 0; i < 4; i++)
                q[i] = u8x8(w + 16 + 32 * h + 8 * i);
            UNROLL
            for (int t = 0; t < 4; t++) {
                __m256i sh = _mm256_set1_epi32(2 * t);
                UNROLL
                for (int i = 0; i < 4; i++) {
                    int sc = w[8 * h + 2 * t + i / 2];
                    __m256 v = cvt8(_mm256_and_si256(_mm256_srlv_epi32(q[i], sh), m3));
                    __m256 dl = _mm256_set1_ps(d * (float)(sc & 0x0F));
                    __m256 ml = _mm256_set1_ps(dmin * (float)(sc >> 4));
                    _mm256_storeu_ps(y + 128 * h + 32 * t + 8 * i, _mm256_fmsub_ps(v, dl, ml));
                }
            }
        }
    }
}

static SIMD void decode_q3_k(const uint8_t *w, uint64_t nb, float *y)
{
    const __m256i m3 = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
    const __m256i four = _mm256_set1_epi32(4);
    for (uint64_t b = 0; b < nb; b++, w += 110, y += 256) {
        const uint8_t *s = w + 96;
        float d = f16_at(w + 108), dl[16];
        for (int j = 0; j < 16; j++) {
            int low = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4;
            int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            dl[j] = d * (float)((low | high << 4) - 32);
        }
        __m256i hm[4];
        UNROLL
        for (int i = 0; i < 4; i++)
            hm[i] = u8x8(w + 8 * i);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            UNROLL
            for (int i = 0; i < 4; i++)
                q[i] = u8x8(w + 32 + 32 * h + 8 * i);
            UNROLL
            for (int t = 0; t < 4; t++) {
                __m256i sh = _mm256_set1_epi32(2 * t), hs = _mm256_set1_epi32(4 * h + t);
                UNROLL
                for (int i = 0; i < 4; i++) {
                    /* level - 4, plus 4 where the hmask bit is set */
                    __m256i lv = _mm256_and_si256(_mm256_srlv_epi32(q[i], sh), m3);
                    __m256i hb = _mm256_and_si256(_mm256_srlv_epi32(hm[i], hs), one);
                    lv = _mm256_add_epi32(_mm256_sub_epi32(lv, four), _mm256_slli_epi32(hb, 2));
                    __m256 v = _mm256_mul_ps(cvt8(lv), _mm256_set1_ps(dl[8 * h + 2 * t + i / 2]));
                    _mm256_storeu_ps(y + 128 * h + 32 * t + 8 * i, v);
                }
            }
        }
    }
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
    case QUANT_TYPE_Q8_0: decode_blocks32(QUANT_TYPE_Q8_0, w, len / 32, buf); break;
    case QUANT_TYPE_Q4_0: decode_blocks32(QUANT_TYPE_Q4_0, w, len / 32, buf); break;
    case QUANT_TYPE_Q4_1: decode_blocks32(QUANT_TYPE_Q4_1, w, len / 32, buf); break;
    case QUANT_TYPE_Q5_0: decode_blocks32(QUANT_TYPE_Q5_0, w, len / 32, buf); break;
    case QUANT_TYPE_Q5_1: decode_blocks32(QUANT_TYPE_Q5_1, w, len / 32, buf); break;
    case QUANT_TYPE_IQ4_NL: decode_blocks32(QUANT_TYPE_IQ4_NL, w, len / 32, buf); break;
    case QUANT_TYPE_Q4_K: decode_k45(w, len / 256, buf, false); break;
    case QUANT_TYPE_Q5_K: decode_k45(w, len / 256, buf, true); break;
    case QUANT_TYPE_Q6_K: decode_q6_k(w, len / 256, buf); break;
    case QUANT_TYPE_IQ4_XS: decode_iq4_xs(w, len / 256, buf); break;
    case QUANT_TYPE_Q2_K: decode_q2_k(w, len / 256, buf); break;
    case QUANT_TYPE_Q3_K: decode_q3_k(w, len / 256, buf); break;
    default: decode_scalar(type, row, k, len, buf); break;
    }
    return buf;
}

/* Types without a fused kernel (Q2_K, Q3_K): decode chunks of MV_CHUNK
 * elements into a stack buffer, then dot. */
static SIMD float dot_decoded_simd(uint32_t type, const uint8_t *row, const float *x, uint64_t n)
{
    _Alignas(32) float buf[MV_CHUNK];
    float sum = 0.0f;
    for (uint64_t k = 0; k < n; k += MV_CHUNK) {
        uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
        const float *p = decode_simd(type, row, k, len, buf);
        sum += dot_f32_simd((const uint8_t *)p, x + k, len);
    }
    return sum;
}

static SIMD float dot_simd(uint32_t type, const uint8_t *w, const float *x, uint64_t n)
{
    switch (type) {
    case QUANT_TYPE_F32: return dot_f32_simd(w, x, n);
    case QUANT_TYPE_F16: return dot_f16_simd(w, x, n);
    case QUANT_TYPE_BF16: return dot_bf16_simd(w, x, n);
    case QUANT_TYPE_Q8_0: return dot_q8_0_simd(w, x, n / 32);
    case QUANT_TYPE_Q4_0: return dot_q4_0_simd(w, x, n / 32);
    case QUANT_TYPE_Q4_1: return dot_q4_1_simd(w, x, n / 32);
    case QUANT_TYPE_Q5_0: return dot_q5_0_simd(w, x, n / 32);
    case QUANT_TYPE_Q5_1: return dot_q5_1_simd(w, x, n / 32);
    case QUANT_TYPE_IQ4_NL: return dot_iq4_nl_simd(w, x, n / 32);
    case QUANT_TYPE_Q4_K: return dot_q4_k_simd(w, x, n / 256);
    case QUANT_TYPE_Q5_K: return dot_q5_k_simd(w, x, n / 256);
    case QUANT_TYPE_Q6_K: return dot_q6_k_simd(w, x, n / 256);
    case QUANT_TYPE_IQ4_XS: return dot_iq4_xs_simd(w, x, n / 256);
    default: return dot_decoded_simd(type, w, x, n);
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

/* ---- dispatch -------------------------------------------------------------- */

float matvec_dot(uint32_t type, const void *row, const float *x, uint64_t n)
{
    check_args(type, n);
#if MATVEC_X86
    if (matvec_has_simd())
        return dot_simd(type, row, x, n);
#endif
    return matvec_dot_portable(type, row, x, n);
}

void matvec_rows(uint32_t type, const void *w, size_t row_bytes, const float *x, uint64_t n,
                 float *y, uint64_t r0, uint64_t r1)
{
    check_args(type, n);
    ASSERT(row_bytes >= quant_row_size(type, n) && r0 <= r1);
    const uint8_t *base = w;
#if MATVEC_X86
    if (matvec_has_simd()) {
        for (uint64_t r = r0; r < r1; r++)
            y[r] = dot_simd(type, base + r * row_bytes, x, n);
        return;
    }
#endif
    for (uint64_t r = r0; r < r1; r++)
        y[r] = matvec_dot_portable(type, base + r * row_bytes, x, n);
}

/* Portable twin of tile_simd. */
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

/* The batch loop shared by both paths: tiles of 4 rows x MV_CHUNK elements,
 * each decoded once, times all S activation rows two at a time. */
static void rows_batch(bool simd, uint32_t type, const uint8_t *w, size_t row_bytes,
                       const float *X, size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy,
                       uint64_t r0, uint64_t r1)
{
    _Alignas(32) float buf[MV_TILE][MV_CHUNK];
    for (uint64_t r = r0; r < r1; r += MV_TILE) {
        int nr = r1 - r < MV_TILE ? (int)(r1 - r) : MV_TILE;
        for (uint64_t k = 0; k < n; k += MV_CHUNK) {
            uint64_t len = n - k < MV_CHUNK ? n - k : MV_CHUNK;
            const float *wr[MV_TILE];
            for (int i = 0; i < MV_TILE; i++) {
                if (i >= nr) { /* pad the last tile with its first row */
                    wr[i] = wr[0];
                    continue;
                }
                const uint8_t *row = w + (r + i) * row_bytes;
#if MATVEC_X86
                if (simd) {
                    wr[i] = decode_simd(type, row, k, len, buf[i]);
                    continue;
                }
#endif
                decode_scalar(type, row, k, len, buf[i]);
                wr[i] = buf[i];
            }
            for (uint64_t s = 0; s < S; s += 2) {
                const float *x0 = X + s * ldx + k;
                const float *x1 = s + 1 < S ? x0 + ldx : x0;
                float out[8];
#if MATVEC_X86
                if (simd)
                    tile_simd(wr, x0, x1, len, out);
                else
#endif
                    tile_portable(wr, x0, x1, len, out);
                for (int i = 0; i < nr; i++) {
                    float *y0 = Y + s * ldy + r + i;
                    *y0 = k ? *y0 + out[2 * i] : out[2 * i];
                    if (s + 1 < S)
                        y0[ldy] = k ? y0[ldy] + out[2 * i + 1] : out[2 * i + 1];
                }
            }
        }
    }
}

static void check_batch_args(uint32_t type, size_t row_bytes, size_t ldx, uint64_t n, size_t ldy,
                             uint64_t r0, uint64_t r1)
{
    check_args(type, n);
    ASSERT(row_bytes >= quant_row_size(type, n) && r0 <= r1);
    ASSERT(ldx >= n && ldy >= r1);
}

void matvec_rows_batch(uint32_t type, const void *w, size_t row_bytes, const float *X,
                       size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy, uint64_t r0,
                       uint64_t r1)
{
    check_batch_args(type, row_bytes, ldx, n, ldy, r0, r1);
    if (S == 1) {
        matvec_rows(type, w, row_bytes, X, n, Y, r0, r1);
        return;
    }
    if (n == 0) {
        for (uint64_t s = 0; s < S; s++)
            for (uint64_t r = r0; r < r1; r++)
                Y[s * ldy + r] = 0.0f;
        return;
    }
    rows_batch(matvec_has_simd(), type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
}

void matvec_rows_batch_portable(uint32_t type, const void *w, size_t row_bytes, const float *X,
                                size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy,
                                uint64_t r0, uint64_t r1)
{
    check_batch_args(type, row_bytes, ldx, n, ldy, r0, r1);
    if (n == 0) {
        for (uint64_t s = 0; s < S; s++)
            for (uint64_t r = r0; r < r1; r++)
                Y[s * ldy + r] = 0.0f;
        return;
    }
    rows_batch(false, type, w, row_bytes, X, ldx, S, n, Y, ldy, r0, r1);
}
