/*
 * quant: the ggml type table, half-float conversions, and the block
 * dequantizers and reference quantizers of model-spec section 2.
 *
 * Blocks are read and written as bytes (multi-byte fields little-endian,
 * assembled byte by byte), so rows may sit at any alignment. Everything here
 * is pure and thread-safe; the only state is constant tables.
 *
 * Quantizers follow llama.cpp's reference rounding for the 32-element types
 * (Q8_0: d = amax/127 and round half away from zero; Q4_0/Q5_0: d = max/-8
 * or max/-16 with the signed extreme, truncation after +8.5/+16.5; Q4_1/Q5_1:
 * min/max affine). The K-quants use our own search: per sub-block an affine
 * (Q4_K, Q5_K) or symmetric (Q6_K) fit from the extremes, improved by one
 * least-squares step, then 6/8-bit scales relative to fp16 super scales,
 * then every element re-rounded against the scales as stored. Their loops
 * run over 8 independent lanes with branch-free rounding and clamping so the
 * compiler vectorizes them (a few hundred MB/s of output per core).
 */
#include "model/quant.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "common/log.h"

#define QK 32    /* elements of a 32-element block */
#define QK_K 256 /* elements of a K-quant super-block */

/* One row of the type table: name, elements per block, bytes per block. */
struct quant_type_info {
    const char *name;
    uint32_t block_elems;
    uint32_t block_bytes;
    bool supported; /* quant_dequantize_row handles it */
};

static const struct quant_type_info quant_types[QUANT_TYPE_COUNT] = {
    [QUANT_TYPE_F32] = {"F32", 1, 4, true},
    [QUANT_TYPE_F16] = {"F16", 1, 2, true},
    [QUANT_TYPE_Q4_0] = {"Q4_0", 32, 18, true},
    [QUANT_TYPE_Q4_1] = {"Q4_1", 32, 20, true},
    [QUANT_TYPE_Q5_0] = {"Q5_0", 32, 22, true},
    [QUANT_TYPE_Q5_1] = {"Q5_1", 32, 24, true},
    [QUANT_TYPE_Q8_0] = {"Q8_0", 32, 34, true},
    [QUANT_TYPE_Q8_1] = {"Q8_1", 32, 36, false},
    [QUANT_TYPE_Q2_K] = {"Q2_K", 256, 84, true},
    [QUANT_TYPE_Q3_K] = {"Q3_K", 256, 110, true},
    [QUANT_TYPE_Q4_K] = {"Q4_K", 256, 144, true},
    [QUANT_TYPE_Q5_K] = {"Q5_K", 256, 176, true},
    [QUANT_TYPE_Q6_K] = {"Q6_K", 256, 210, true},
    [QUANT_TYPE_Q8_K] = {"Q8_K", 256, 292, false},
    [QUANT_TYPE_IQ2_XXS] = {"IQ2_XXS", 256, 66, false},
    [QUANT_TYPE_IQ2_XS] = {"IQ2_XS", 256, 74, false},
    [QUANT_TYPE_IQ3_XXS] = {"IQ3_XXS", 256, 98, false},
    [QUANT_TYPE_IQ1_S] = {"IQ1_S", 256, 50, false},
    [QUANT_TYPE_IQ4_NL] = {"IQ4_NL", 32, 18, true},
    [QUANT_TYPE_IQ3_S] = {"IQ3_S", 256, 110, false},
    [QUANT_TYPE_IQ2_S] = {"IQ2_S", 256, 82, false},
    [QUANT_TYPE_IQ4_XS] = {"IQ4_XS", 256, 136, true},
    [QUANT_TYPE_I8] = {"I8", 1, 1, false},
    [QUANT_TYPE_I16] = {"I16", 1, 2, false},
    [QUANT_TYPE_I32] = {"I32", 1, 4, false},
    [QUANT_TYPE_I64] = {"I64", 1, 8, false},
    [QUANT_TYPE_F64] = {"F64", 1, 8, false},
    [QUANT_TYPE_IQ1_M] = {"IQ1_M", 256, 56, false},
    [QUANT_TYPE_BF16] = {"BF16", 1, 2, true},
    [QUANT_TYPE_TQ1_0] = {"TQ1_0", 256, 54, false},
    [QUANT_TYPE_TQ2_0] = {"TQ2_0", 256, 66, false},
    [QUANT_TYPE_MXFP4] = {"MXFP4", 32, 17, false},
    [QUANT_TYPE_NVFP4] = {"NVFP4", 64, 36, false},
    [QUANT_TYPE_Q1_0] = {"Q1_0", 128, 18, false},
    [QUANT_TYPE_Q2_0] = {"Q2_0", 64, 18, false},
};

/* kvalues_iq4nl: the 16 levels of IQ4_NL and IQ4_XS. */
static const int8_t quant_iq4nl_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                              1,    13,   25,  38,  53,  69,  89,  113};

static const struct quant_type_info *type_info(uint32_t type)
{
    if (type >= QUANT_TYPE_COUNT || !quant_types[type].name)
        return NULL;
    return &quant_types[type];
}

/* ---- scalar helpers ---------------------------------------------------- */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline void wr16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline float rd_f16(const uint8_t *p)
{
    return quant_f16_to_f32(rd16(p));
}

/* Round to nearest, ties to even, for |f| < 2^22 (the 1.5*2^23 trick). */
static inline int nearest_int(float f)
{
    float v = f + 12582912.0f;
    return (int)(f32_bits(v) & 0x007FFFFF) - 0x00400000;
}

/* The same rounding kept in float, clamped to the integers [lo, hi]. The
 * clamp is (|r - lo| - |r - hi| + lo + hi) / 2, exact for integer-valued
 * floats this small and free of branches, so that loops using it vectorize
 * even after full unrolling. */
static inline float nearest_clamp(float f, float lo, float hi)
{
    float r = (f + 12582912.0f) - 12582912.0f;
    return 0.5f * (fabsf(r - lo) - fabsf(r - hi) + (lo + hi));
}

/* roundf (ties away from zero) for |f| < 2^23, without a libm call. */
static inline int round_away(float f)
{
    int i = (int)f;
    float r = f - (float)i;
    return i + (r >= 0.5f) - (r <= -0.5f);
}

static inline float maxf(float a, float b)
{
    return a > b ? a : b;
}

static inline float minf(float a, float b)
{
    return a < b ? a : b;
}

static inline int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* ---- type table ------------------------------------------------------- */

const char *quant_ftype_name(uint32_t ftype)
{
    switch (ftype) {
    case 0: return "all F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 7: return "Q8_0";
    case 8: return "Q5_0";
    case 9: return "Q5_1";
    case 10: return "Q2_K - Medium";
    case 11: return "Q3_K - Small";
    case 12: return "Q3_K - Medium";
    case 13: return "Q3_K - Large";
    case 14: return "Q4_K - Small";
    case 15: return "Q4_K - Medium";
    case 16: return "Q5_K - Small";
    case 17: return "Q5_K - Medium";
    case 18: return "Q6_K";
    case 21: return "Q2_K - Small";
    case 25: return "IQ4_NL - 4.5 bpw";
    case 30: return "IQ4_XS - 4.25 bpw";
    case 32: return "BF16";
    default: return NULL;
    }
}

const char *quant_type_name(uint32_t type)
{
    const struct quant_type_info *t = type_info(type);
    return t ? t->name : NULL;
}

uint32_t quant_block_elems(uint32_t type)
{
    const struct quant_type_info *t = type_info(type);
    return t ? t->block_elems : 0;
}

uint32_t quant_block_bytes(uint32_t type)
{
    const struct quant_type_info *t = type_info(type);
    return t ? t->block_bytes : 0;
}

bool quant_is_supported(uint32_t type)
{
    const struct quant_type_info *t = type_info(type);
    return t && t->supported;
}

size_t quant_row_size(uint32_t type, uint64_t n)
{
    const struct quant_type_info *t = type_info(type);
    if (!t || n % t->block_elems)
        return 0;
    uint64_t blocks = n / t->block_elems;
    if (blocks > SIZE_MAX / t->block_bytes)
        return 0;
    return (size_t)blocks * t->block_bytes;
}

/* ---- half floats ------------------------------------------------------ */

float quant_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t mag = h & 0x7FFF;
    if (mag >= 0x7C00) /* inf or nan: all-ones exponent, payload kept */
        return bits_f32(sign | 0x7F800000 | (mag & 0x3FF) << 13);
    if (mag >= 0x0400) /* normal: rebias the exponent from 15 to 127 */
        return bits_f32(sign | ((mag << 13) + 0x38000000));
    /* Subnormal (or zero): mag * 2^-24, exact and normal in f32. */
    return bits_f32(sign | f32_bits((float)mag * 0x1p-24f));
}

uint16_t quant_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7FFFFFFF;
    if (ax > 0x7F800000) /* nan: quiet, top payload bits kept */
        return sign | 0x7E00 | (uint16_t)((ax >> 13) & 0x3FF);
    if (ax >= 0x477FF000) /* >= 65520 rounds to inf */
        return sign | 0x7C00;
    if (ax < 0x38800000) {
        /* Below 2^-14: the result is a multiple of 2^-24; adding 0.5f (whose
         * ulp is 2^-24) lets the FPU round to nearest even. */
        float t = bits_f32(ax) + 0.5f;
        return sign | (uint16_t)(f32_bits(t) - 0x3F000000);
    }
    /* Rebias the exponent (-112 << 23) and round the 13 dropped bits to
     * nearest even; a carry correctly bumps the exponent. */
    ax += 0xC8000FFF + ((ax >> 13) & 1);
    return sign | (uint16_t)(ax >> 13);
}

float quant_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t quant_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFF) > 0x7F800000) /* nan: keep sign and payload top, force quiet */
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7FFF + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* ---- dequantizers: one block each -------------------------------------- */

static void dequant_q4_0(const uint8_t *b, float *y)
{
    float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0x0F) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void dequant_q4_1(const uint8_t *b, float *y)
{
    float d = rd_f16(b), m = rd_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0x0F) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void dequant_q5_0(const uint8_t *b, float *y)
{
    float d = rd_f16(b);
    uint32_t h = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (int)((h >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

static void dequant_q5_1(const uint8_t *b, float *y)
{
    float d = rd_f16(b), m = rd_f16(b + 2);
    uint32_t h = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (int)((h >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((h >> (j + 16)) & 1) << 4;
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

static void dequant_q8_0(const uint8_t *b, float *y)
{
    float d = rd_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++)
        y[j] = (float)qs[j] * d;
}

static void dequant_iq4_nl(const uint8_t *b, float *y)
{
    float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)quant_iq4nl_levels[qs[j] & 0x0F];
        y[j + 16] = d * (float)quant_iq4nl_levels[qs[j] >> 4];
    }
}

/* get_scale_min_k4 of model-spec 2.3: the j-th 6-bit scale and min. */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dequant_q4_k(const uint8_t *b, float *y)
{
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int c = 0; c < 4; c++) {
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * c, scales, &sc1, &m1);
        scale_min_k4(2 * c + 1, scales, &sc2, &m2);
        float d1 = d * (float)sc1, o1 = dmin * (float)m1;
        float d2 = d * (float)sc2, o2 = dmin * (float)m2;
        const uint8_t *q = qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            y[64 * c + l] = d1 * (float)(q[l] & 0x0F) - o1;
            y[64 * c + 32 + l] = d2 * (float)(q[l] >> 4) - o2;
        }
    }
}

static void dequant_q5_k(const uint8_t *b, float *y)
{
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++) {
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * c, scales, &sc1, &m1);
        scale_min_k4(2 * c + 1, scales, &sc2, &m2);
        float d1 = d * (float)sc1, o1 = dmin * (float)m1;
        float d2 = d * (float)sc2, o2 = dmin * (float)m2;
        const uint8_t *q = qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            int lo = (q[l] & 0x0F) + (((qh[l] >> (2 * c)) & 1) << 4);
            int hi = (q[l] >> 4) + (((qh[l] >> (2 * c + 1)) & 1) << 4);
            y[64 * c + l] = d1 * (float)lo - o1;
            y[64 * c + 32 + l] = d2 * (float)hi - o2;
        }
    }
}

static void dequant_q6_k(const uint8_t *b, float *out)
{
    float d = rd_f16(b + 208);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        float *y = out + 128 * h;
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0x0F) | ((qh[l] >> 0) & 3) << 4) - 32;
            int q2 = ((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4) - 32;
            int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

/* Q2_K and Q3_K share the level layout: 16 groups of 16 outputs; group
 * g = 8h + 2t + s (half h, shift step t, second-16 flag s) takes bits
 * 2t..2t+1 of qs[32h + 16s + l], l = 0..15. */
static inline int q23_level(const uint8_t *qs, int g, int l)
{
    int h = g / 8, t = (g % 8) / 2, s = g % 2;
    return (qs[32 * h + 16 * s + l] >> (2 * t)) & 3;
}

static void dequant_q2_k(const uint8_t *b, float *y)
{
    const uint8_t *scales = b, *qs = b + 16;
    float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
    for (int g = 0; g < 16; g++) {
        float dl = d * (float)(scales[g] & 0x0F), ml = dmin * (float)(scales[g] >> 4);
        for (int l = 0; l < 16; l++)
            y[16 * g + l] = dl * (float)q23_level(qs, g, l) - ml;
    }
}

/* Q3_K: the level loses 4 unless bit 4h + t of hmask[16s + l] is set (the
 * mask bit advances once per shift step across both halves). */
static void dequant_q3_k(const uint8_t *b, float *y)
{
    const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
    float d = rd_f16(b + 108);
    for (int g = 0; g < 16; g++) {
        int low = g < 8 ? s[g] & 0x0F : s[g - 8] >> 4;
        int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        float dl = d * (float)((low | high << 4) - 32);
        int bit = 4 * (g / 8) + (g % 8) / 2, row = 16 * (g % 2);
        for (int l = 0; l < 16; l++) {
            int v = q23_level(qs, g, l) - (((hmask[row + l] >> bit) & 1) ? 0 : 4);
            y[16 * g + l] = dl * (float)v;
        }
    }
}

static void dequant_iq4_xs(const uint8_t *b, float *y)
{
    float d = rd_f16(b);
    unsigned scales_h = rd16(b + 2);
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        const uint8_t *q = qs + 16 * ib;
        for (int j = 0; j < 16; j++) {
            y[32 * ib + j] = dl * (float)quant_iq4nl_levels[q[j] & 0x0F];
            y[32 * ib + 16 + j] = dl * (float)quant_iq4nl_levels[q[j] >> 4];
        }
    }
}

typedef void (*dequant_block_fn)(const uint8_t *block, float *y);

static dequant_block_fn dequant_block_of(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return dequant_q4_0;
    case QUANT_TYPE_Q4_1: return dequant_q4_1;
    case QUANT_TYPE_Q5_0: return dequant_q5_0;
    case QUANT_TYPE_Q5_1: return dequant_q5_1;
    case QUANT_TYPE_Q8_0: return dequant_q8_0;
    case QUANT_TYPE_Q2_K: return dequant_q2_k;
    case QUANT_TYPE_Q3_K: return dequant_q3_k;
    case QUANT_TYPE_Q4_K: return dequant_q4_k;
    case QUANT_TYPE_Q5_K: return dequant_q5_k;
    case QUANT_TYPE_Q6_K: return dequant_q6_k;
    case QUANT_TYPE_IQ4_NL: return dequant_iq4_nl;
    case QUANT_TYPE_IQ4_XS: return dequant_iq4_xs;
    default: return NULL;
    }
}

int quant_dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n)
{
    if (!quant_is_supported(type)) {
        log_error("cannot dequantize tensor type %u (%s): not supported", type,
                  quant_type_name(type) ? quant_type_name(type) : "unknown");
        return -EINVAL;
    }
    if (n % quant_types[type].block_elems) {
        log_error("cannot dequantize %llu elements of %s: not a multiple of its block size %u",
                  (unsigned long long)n, quant_types[type].name, quant_types[type].block_elems);
        return -EINVAL;
    }
    const uint8_t *s = src;
    switch (type) {
    case QUANT_TYPE_F32:
        memcpy(dst, s, n * sizeof(float));
        return 0;
    case QUANT_TYPE_F16:
        for (uint64_t i = 0; i < n; i++)
            dst[i] = quant_f16_to_f32(rd16(s + 2 * i));
        return 0;
    case QUANT_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++)
            dst[i] = quant_bf16_to_f32(rd16(s + 2 * i));
        return 0;
    default:
        break;
    }
    dequant_block_fn fn = dequant_block_of(type);
    uint32_t be = quant_types[type].block_elems, bb = quant_types[type].block_bytes;
    for (uint64_t i = 0; i < n / be; i++)
        fn(s + i * bb, dst + i * be);
    return 0;
}

/* ---- quantizers: 32-element types -------------------------------------- */

/* Smallest and largest of n values, n a multiple of 8 (8 independent lanes,
 * which the compiler vectorizes). */
static void min_max(const float *x, int n, float *lo, float *hi)
{
    float mn[8], mx[8];
    for (int l = 0; l < 8; l++)
        mn[l] = mx[l] = x[l];
    for (int j = 8; j < n; j += 8)
        for (int l = 0; l < 8; l++) {
            mn[l] = minf(mn[l], x[j + l]);
            mx[l] = maxf(mx[l], x[j + l]);
        }
    for (int l = 1; l < 8; l++) {
        mn[0] = minf(mn[0], mn[l]);
        mx[0] = maxf(mx[0], mx[l]);
    }
    *lo = mn[0];
    *hi = mx[0];
}

/* Sum of n values, n a multiple of 8, in 8 lanes. */
static float sum8(const float *x, int n)
{
    float a[8] = {0};
    for (int j = 0; j < n; j += 8)
        for (int l = 0; l < 8; l++)
            a[l] += x[j + l];
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The element of largest magnitude, with its sign (the first one on ties). */
static float signed_absmax(const float *x, int n)
{
    float lo, hi;
    min_max(x, n, &lo, &hi);
    if (-lo != hi)
        return -lo > hi ? lo : hi;
    for (int j = 0; j < n; j++) /* both signs reach the magnitude: first wins */
        if (fabsf(x[j]) == hi)
            return x[j];
    return hi;
}

static void quant_q8_0(const float *x, uint8_t *b)
{
    float lo, hi;
    min_max(x, QK, &lo, &hi);
    float amax = maxf(-lo, hi);
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    wr16(b, quant_f32_to_f16(d));
    int8_t q[QK];
    for (int j = 0; j < QK; j++)
        q[j] = (int8_t)round_away(x[j] * id);
    memcpy(b + 2, q, QK);
}

/* Symmetric 4/5-bit: d = max/-half with the signed extreme; levels offset by
 * half; the +0.5 then truncation rounds like llama.cpp's reference. */
static inline void quant_sym(const float *x, float half, int qmax, float *d_out, uint8_t *q)
{
    float max = signed_absmax(x, QK);
    float d = max / -half, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < QK; j++) {
        int v = (int)(x[j] * id + half + 0.5f);
        q[j] = (uint8_t)(v > qmax ? qmax : v);
    }
    *d_out = d;
}

/* Affine 4/5-bit: x ~ q*d + min with d = (max-min)/qmax. */
static inline void quant_affine(const float *x, int qmax, float *d_out, float *m_out, uint8_t *q)
{
    float lo, hi;
    min_max(x, QK, &lo, &hi);
    float d = (hi - lo) / (float)qmax, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < QK; j++) {
        int v = (int)((x[j] - lo) * id + 0.5f);
        q[j] = (uint8_t)(v > qmax ? qmax : v);
    }
    *d_out = d;
    *m_out = lo;
}

static void pack_nibbles16(const uint8_t *q, uint8_t *qs)
{
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)((q[j] & 0x0F) | (q[j + 16] & 0x0F) << 4);
}

static void pack_high32(const uint8_t *q, uint8_t *qh)
{
    uint32_t h = 0;
    for (int j = 0; j < QK; j++)
        h |= (uint32_t)(q[j] >> 4) << j;
    for (int k = 0; k < 4; k++)
        qh[k] = (uint8_t)(h >> (8 * k));
}

static void quant_q4_0(const float *x, uint8_t *b)
{
    uint8_t q[QK];
    float d;
    quant_sym(x, 8.0f, 15, &d, q);
    wr16(b, quant_f32_to_f16(d));
    pack_nibbles16(q, b + 2);
}

static void quant_q4_1(const float *x, uint8_t *b)
{
    uint8_t q[QK];
    float d, m;
    quant_affine(x, 15, &d, &m, q);
    wr16(b, quant_f32_to_f16(d));
    wr16(b + 2, quant_f32_to_f16(m));
    pack_nibbles16(q, b + 4);
}

static void quant_q5_0(const float *x, uint8_t *b)
{
    uint8_t q[QK];
    float d;
    quant_sym(x, 16.0f, 31, &d, q);
    wr16(b, quant_f32_to_f16(d));
    pack_high32(q, b + 2);
    pack_nibbles16(q, b + 6);
}

static void quant_q5_1(const float *x, uint8_t *b)
{
    uint8_t q[QK];
    float d, m;
    quant_affine(x, 31, &d, &m, q);
    wr16(b, quant_f32_to_f16(d));
    wr16(b + 2, quant_f32_to_f16(m));
    pack_high32(q, b + 4);
    pack_nibbles16(q, b + 8);
}

/* ---- quantizers: K-quants ----------------------------------------------- */

/*
 * Affine fit of n values (a multiple of 8) to x ~ scale*q - min with q in
 * 0..qmax, scale >= 0 and min >= 0 (the K-quant offset is always
 * subtracted). Starts from the min/max fit, assigns nearest levels, then
 * takes the least-squares (scale, min) for that assignment, which can only
 * lower the squared error. (A second round gains about 1.5 % RMS error for
 * half the speed.)
 */
static void fit_affine(const float *x, int n, int qmax, float *scale_out, float *min_out)
{
    float lo, hi;
    min_max(x, n, &lo, &hi);
    if (lo > 0.0f)
        lo = 0.0f;
    if (hi <= lo) {
        *scale_out = 0.0f;
        *min_out = -lo;
        return;
    }
    float fmax = (float)qmax, scale = (hi - lo) / fmax, off = lo, iscale = 1.0f / scale;
    float aq[8] = {0}, aqq[8] = {0}, aqx[8] = {0};
    for (int j = 0; j < n; j += 8)
        for (int l = 0; l < 8; l++) {
            float q = nearest_clamp((x[j + l] - off) * iscale, 0.0f, fmax);
            aq[l] += q;
            aqq[l] += q * q;
            aqx[l] += q * x[j + l];
        }
    float sx = sum8(x, n), sq = sum8(aq, 8), sqq = sum8(aqq, 8), sqx = sum8(aqx, 8);
    float det = (float)n * sqq - sq * sq;
    if (det > 0.0f) {
        float s = ((float)n * sqx - sq * sx) / det;
        float o = (sqq * sx - sq * sqx) / det;
        if (o > 0.0f) { /* the offset may not be positive: refit the scale alone */
            o = 0.0f;
            s = sqx / sqq;
        }
        if (s > 0.0f) {
            scale = s;
            off = o;
        }
    }
    *scale_out = scale;
    *min_out = -off;
}

/* q[j] = nearest level of (x[j] + add) * mul in [lo, hi], minus lo; n a
 * multiple of 8. Rounds in a float buffer first so that the loop vectorizes. */
static void requant(const float *x, int n, float mul, float add, float lo, float hi, uint8_t *q)
{
    float t[32];
    for (int j0 = 0; j0 < n; j0 += 32) {
        int len = n - j0 < 32 ? n - j0 : 32;
        for (int j = 0; j < len; j++)
            t[j] = nearest_clamp((x[j0 + j] + add) * mul, lo, hi) - lo;
        for (int j = 0; j < len; j++)
            q[j0 + j] = (uint8_t)(int)t[j];
    }
}

/* 6-bit scales and mins of the 8 sub-blocks of a Q4_K/Q5_K block relative to
 * the fp16 super-scales written at b[0..3]; q receives the re-rounded levels. */
static void quant_k_affine(const float *x, int qmax, uint8_t *b, uint8_t *ls, uint8_t *lm,
                           uint8_t *q)
{
    float sc[8], mn[8], max_sc = 0.0f, max_mn = 0.0f;
    for (int j = 0; j < 8; j++) {
        fit_affine(x + 32 * j, 32, qmax, &sc[j], &mn[j]);
        max_sc = maxf(max_sc, sc[j]);
        max_mn = maxf(max_mn, mn[j]);
    }
    uint16_t dh = quant_f32_to_f16(max_sc / 63.0f), mh = quant_f32_to_f16(max_mn / 63.0f);
    wr16(b, dh);
    wr16(b + 2, mh);
    float d = quant_f16_to_f32(dh), dmin = quant_f16_to_f32(mh);
    float id = d > 0.0f ? 1.0f / d : 0.0f, idmin = dmin > 0.0f ? 1.0f / dmin : 0.0f;
    for (int j = 0; j < 8; j++) {
        ls[j] = (uint8_t)clampi(nearest_int(sc[j] * id), 0, 63);
        lm[j] = (uint8_t)clampi(nearest_int(mn[j] * idmin), 0, 63);
        float ds = d * (float)ls[j], dm = dmin * (float)lm[j];
        requant(x + 32 * j, 32, ds > 0.0f ? 1.0f / ds : 0.0f, dm, 0.0f, (float)qmax, q + 32 * j);
    }
}

/* Inverse of scale_min_k4: packs 8 six-bit scales and mins into 12 bytes. */
static void pack_scale_min_k4(const uint8_t *ls, const uint8_t *lm, uint8_t *s)
{
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(ls[j] | (ls[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)(lm[j] | (lm[j + 4] >> 4) << 6);
        s[j + 8] = (uint8_t)((ls[j + 4] & 0x0F) | (lm[j + 4] & 0x0F) << 4);
    }
}

static void quant_q4_k(const float *x, uint8_t *b)
{
    uint8_t ls[8], lm[8], q[QK_K];
    quant_k_affine(x, 15, b, ls, lm, q);
    pack_scale_min_k4(ls, lm, b + 4);
    uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            qs[32 * c + l] = (uint8_t)(q[64 * c + l] | q[64 * c + 32 + l] << 4);
}

static void quant_q5_k(const float *x, uint8_t *b)
{
    uint8_t ls[8], lm[8], q[QK_K];
    quant_k_affine(x, 31, b, ls, lm, q);
    pack_scale_min_k4(ls, lm, b + 4);
    uint8_t *qh = b + 16, *qs = b + 48;
    memset(qh, 0, 32);
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            uint8_t lo = q[64 * c + l], hi = q[64 * c + 32 + l];
            qs[32 * c + l] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
            qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
        }
    }
}

/* Symmetric fit of 16 values to x ~ scale*q with q in -32..31: the signed
 * extreme maps to -32, then one least-squares rescale. */
static float fit_sym6(const float *x)
{
    float max = signed_absmax(x, 16);
    if (max == 0.0f)
        return 0.0f;
    float scale = max / -32.0f, iscale = 1.0f / scale;
    float aqq[8] = {0}, aqx[8] = {0};
    for (int j = 0; j < 16; j += 8)
        for (int l = 0; l < 8; l++) {
            float q = nearest_clamp(x[j + l] * iscale, -32.0f, 31.0f);
            aqq[l] += q * q;
            aqx[l] += q * x[j + l];
        }
    float sqq = sum8(aqq, 8), sqx = sum8(aqx, 8);
    return sqq > 0.0f ? sqx / sqq : scale;
}

static void quant_q6_k(const float *x, uint8_t *b)
{
    float sc[16], max = 0.0f, amax = 0.0f;
    for (int g = 0; g < 16; g++) {
        sc[g] = fit_sym6(x + 16 * g);
        if (fabsf(sc[g]) > amax) {
            amax = fabsf(sc[g]);
            max = sc[g];
        }
    }
    float iscale = max != 0.0f ? -128.0f / max : 0.0f;
    uint16_t dh = quant_f32_to_f16(iscale != 0.0f ? 1.0f / iscale : 0.0f);
    wr16(b + 208, dh);
    float d = quant_f16_to_f32(dh);
    int8_t *scales = (int8_t *)(b + 192);
    uint8_t q[QK_K];
    for (int g = 0; g < 16; g++) {
        scales[g] = (int8_t)clampi(nearest_int(sc[g] * iscale), -128, 127);
        float ds = d * (float)scales[g], ids = ds != 0.0f ? 1.0f / ds : 0.0f;
        requant(x + 16 * g, 16, ids, 0.0f, -32.0f, 31.0f, q + 16 * g);
    }
    for (int h = 0; h < 2; h++) {
        uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const uint8_t *qq = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            uint8_t q1 = qq[l], q2 = qq[l + 32], q3 = qq[l + 64], q4 = qq[l + 96];
            ql[l] = (uint8_t)((q1 & 0x0F) | (q3 & 0x0F) << 4);
            ql[l + 32] = (uint8_t)((q2 & 0x0F) | (q4 & 0x0F) << 4);
            qh[l] = (uint8_t)((q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6);
        }
    }
}

typedef void (*quant_block_fn)(const float *x, uint8_t *block);

static quant_block_fn quant_block_of(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return quant_q4_0;
    case QUANT_TYPE_Q4_1: return quant_q4_1;
    case QUANT_TYPE_Q5_0: return quant_q5_0;
    case QUANT_TYPE_Q5_1: return quant_q5_1;
    case QUANT_TYPE_Q8_0: return quant_q8_0;
    case QUANT_TYPE_Q4_K: return quant_q4_k;
    case QUANT_TYPE_Q5_K: return quant_q5_k;
    case QUANT_TYPE_Q6_K: return quant_q6_k;
    default: return NULL;
    }
}

int quant_quantize_row(uint32_t type, const float *src, void *dst, uint64_t n)
{
    bool plain = type == QUANT_TYPE_F32 || type == QUANT_TYPE_F16 || type == QUANT_TYPE_BF16;
    quant_block_fn fn = quant_block_of(type);
    if (!plain && !fn) {
        log_error("cannot quantize to tensor type %u (%s): not supported", type,
                  quant_type_name(type) ? quant_type_name(type) : "unknown");
        return -EINVAL;
    }
    uint32_t be = quant_types[type].block_elems, bb = quant_types[type].block_bytes;
    if (n % be) {
        log_error("cannot quantize %llu elements to %s: not a multiple of its block size %u",
                  (unsigned long long)n, quant_types[type].name, be);
        return -EINVAL;
    }
    uint8_t *d = dst;
    switch (type) {
    case QUANT_TYPE_F32:
        memcpy(d, src, n * sizeof(float));
        return 0;
    case QUANT_TYPE_F16:
        for (uint64_t i = 0; i < n; i++)
            wr16(d + 2 * i, quant_f32_to_f16(src[i]));
        return 0;
    case QUANT_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++)
            wr16(d + 2 * i, quant_f32_to_bf16(src[i]));
        return 0;
    default:
        break;
    }
    for (uint64_t i = 0; i < n / be; i++)
        fn(src + i * be, d + i * bb);
    return 0;
}
