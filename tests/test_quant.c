/*
 * test_quant: the type table, half-float conversions, every dequantizer on
 * hand-built blocks (expected values computed here from the model-spec
 * formulas, by encoding chosen levels and scales into bytes), and the
 * quantizers' round-trip error on random data.
 */
#include "model/quant.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "tests/check.h"

/* ---- small deterministic generator ---------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static int rng_int(int lo, int hi) /* inclusive */
{
    return lo + (int)(rng_next() % (uint64_t)(hi - lo + 1));
}

static float rng_unit(void) /* [-1, 1) */
{
    return (float)((double)(rng_next() >> 11) * 0x1p-52 - 1.0);
}

static float rng_gauss(void)
{
    double u = ((double)(rng_next() >> 11) + 0.5) * 0x1p-53;
    double v = ((double)(rng_next() >> 11) + 0.5) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- independent half decoders (ldexp, no bit tricks) ------------------------ */

static double half_value(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    double v = exp == 0 ? ldexp(mant, -24) : ldexp(1024 + mant, exp - 25);
    return sign ? -v : v;
}

static double bf16_value(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 7) & 0xFF, mant = h & 0x7F;
    double v = exp == 0 ? ldexp(mant, -133) : ldexp(128 + mant, exp - 134);
    return sign ? -v : v;
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A random half with a moderate positive value (for block scales). */
static uint16_t rand_scale_half(void)
{
    return (uint16_t)(rng_int(0x1800, 0x3C00)); /* about 2^-9 .. 1 */
}

/* ---- type table ------------------------------------------------------------------ */

static void test_type_table(void)
{
    static const struct {
        uint32_t id;
        const char *name;
        uint32_t elems, bytes;
        bool supported;
    } want[] = {
        {0, "F32", 1, 4, true},         {1, "F16", 1, 2, true},
        {2, "Q4_0", 32, 18, true},      {3, "Q4_1", 32, 20, true},
        {6, "Q5_0", 32, 22, true},      {7, "Q5_1", 32, 24, true},
        {8, "Q8_0", 32, 34, true},      {9, "Q8_1", 32, 36, false},
        {10, "Q2_K", 256, 84, true},    {11, "Q3_K", 256, 110, true},
        {12, "Q4_K", 256, 144, true},   {13, "Q5_K", 256, 176, true},
        {14, "Q6_K", 256, 210, true},   {15, "Q8_K", 256, 292, false},
        {16, "IQ2_XXS", 256, 66, false}, {17, "IQ2_XS", 256, 74, false},
        {18, "IQ3_XXS", 256, 98, false}, {19, "IQ1_S", 256, 50, false},
        {20, "IQ4_NL", 32, 18, true},   {21, "IQ3_S", 256, 110, false},
        {22, "IQ2_S", 256, 82, false},  {23, "IQ4_XS", 256, 136, true},
        {24, "I8", 1, 1, false},        {25, "I16", 1, 2, false},
        {26, "I32", 1, 4, false},       {27, "I64", 1, 8, false},
        {28, "F64", 1, 8, false},       {29, "IQ1_M", 256, 56, false},
        {30, "BF16", 1, 2, true},       {34, "TQ1_0", 256, 54, false},
        {35, "TQ2_0", 256, 66, false},  {39, "MXFP4", 32, 17, false},
        {40, "NVFP4", 64, 36, false},   {41, "Q1_0", 128, 18, false},
        {42, "Q2_0", 64, 18, false},
    };
    int known = 0;
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        uint32_t id = want[i].id;
        const char *name = quant_type_name(id);
        CHECK(name && strcmp(name, want[i].name) == 0, "type %u name %s", id, name ? name : "NULL");
        CHECK(quant_block_elems(id) == want[i].elems, "type %u elems %u", id, quant_block_elems(id));
        CHECK(quant_block_bytes(id) == want[i].bytes, "type %u bytes %u", id, quant_block_bytes(id));
        CHECK(quant_is_supported(id) == want[i].supported, "type %u supported", id);
        CHECK(quant_row_size(id, 4ull * want[i].elems) == 4ull * want[i].bytes, "type %u row", id);
        known++;
    }
    /* Ids that are not ggml types. */
    static const uint32_t unknown[] = {4, 5, 31, 32, 33, 36, 37, 38, 43, 44, 1000, 0xFFFFFFFFu};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        uint32_t id = unknown[i];
        CHECK(quant_type_name(id) == NULL, "id %u has a name", id);
        CHECK(quant_block_elems(id) == 0 && quant_block_bytes(id) == 0, "id %u has sizes", id);
        CHECK(!quant_is_supported(id), "id %u supported", id);
        CHECK(quant_row_size(id, 256) == 0, "id %u row size", id);
    }
    /* Every id below QUANT_TYPE_COUNT is either named or in the list above. */
    int named = 0;
    for (uint32_t id = 0; id < QUANT_TYPE_COUNT; id++)
        named += quant_type_name(id) != NULL;
    CHECK(named == known, "%d named ids, %d expected", named, known);

    /* Row sizes: multiples only, and no overflow. */
    CHECK(quant_row_size(QUANT_TYPE_Q4_0, 31) == 0, "q4_0 n=31");
    CHECK(quant_row_size(QUANT_TYPE_Q4_0, 33) == 0, "q4_0 n=33");
    CHECK(quant_row_size(QUANT_TYPE_Q4_K, 128) == 0, "q4_k n=128");
    CHECK(quant_row_size(QUANT_TYPE_Q4_K, 4096) == 16 * 144, "q4_k n=4096");
    CHECK(quant_row_size(QUANT_TYPE_F16, 7) == 14, "f16 n=7");
    CHECK(quant_row_size(QUANT_TYPE_Q8_0, 0) == 0, "n=0");
    CHECK(quant_row_size(QUANT_TYPE_F32, UINT64_MAX / 2) == 0, "f32 overflow");
    CHECK(quant_row_size(QUANT_TYPE_F16, (uint64_t)1 << 63) == 0, "f16 overflow");
    CHECK(quant_row_size(QUANT_TYPE_I64, (uint64_t)1 << 61) == 0, "i64 overflow");
    CHECK(quant_row_size(QUANT_TYPE_I64, (uint64_t)1 << 60) == (size_t)1 << 63, "i64 2^60");
}

/* ---- half floats --------------------------------------------------------------- */

static void test_f16(void)
{
    int bad_dec = 0, bad_trip = 0, bad_nan = 0, bad_mid = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = quant_f16_to_f32((uint16_t)h);
        int exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
        if (exp == 0x1F) {
            bool ok = mant ? isnan(f) : isinf(f);
            ok = ok && (signbit(f) != 0) == ((h >> 15) != 0);
            if (mant)
                ok = ok && (quant_f32_to_f16(f) & 0x7C00) == 0x7C00 && (quant_f32_to_f16(f) & 0x3FF);
            else
                ok = ok && quant_f32_to_f16(f) == h;
            bad_nan += !ok;
            continue;
        }
        bad_dec += (double)f != half_value((uint16_t)h) || (bits_of(f) >> 31) != (h >> 15);
        bad_trip += quant_f32_to_f16(f) != h;
        /* Midpoint to the next half up in magnitude rounds to even; just
         * above or below it rounds to the nearer neighbour. */
        if ((h & 0x7FFF) < 0x7BFF) {
            double a = half_value((uint16_t)h), b = half_value((uint16_t)(h + 1));
            float mid = (float)((a + b) / 2); /* exact: 12 significant bits */
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            bad_mid += quant_f32_to_f16(mid) != even;
            float above = nextafterf(mid, (h >> 15) ? -INFINITY : INFINITY);
            float below = nextafterf(mid, (h >> 15) ? INFINITY : -INFINITY);
            bad_mid += quant_f32_to_f16(above) != (uint16_t)(h + 1);
            bad_mid += quant_f32_to_f16(below) != (uint16_t)h;
        }
    }
    CHECK(bad_dec == 0, "%d halves decode wrongly", bad_dec);
    CHECK(bad_trip == 0, "%d halves do not round-trip", bad_trip);
    CHECK(bad_nan == 0, "%d inf/nan halves wrong", bad_nan);
    CHECK(bad_mid == 0, "%d midpoint roundings wrong", bad_mid);

    /* Named cases. */
    CHECK(quant_f32_to_f16(65504.0f) == 0x7BFF, "max half");
    CHECK(quant_f32_to_f16(65519.99f) == 0x7BFF, "below overflow threshold");
    CHECK(quant_f32_to_f16(65520.0f) == 0x7C00, "65520 rounds to inf");
    CHECK(quant_f32_to_f16(1e10f) == 0x7C00 && quant_f32_to_f16(-1e10f) == 0xFC00, "overflow");
    CHECK(quant_f32_to_f16(INFINITY) == 0x7C00 && quant_f32_to_f16(-INFINITY) == 0xFC00, "inf");
    uint16_t qn = quant_f32_to_f16(NAN);
    CHECK((qn & 0x7C00) == 0x7C00 && (qn & 0x3FF) != 0, "nan -> %04x", qn);
    CHECK(quant_f32_to_f16(-0.0f) == 0x8000 && quant_f32_to_f16(0.0f) == 0, "signed zero");
    CHECK(quant_f32_to_f16(0x1p-24f) == 0x0001, "smallest subnormal");
    CHECK(quant_f32_to_f16(0x1p-25f) == 0x0000, "half of smallest subnormal ties to 0");
    CHECK(quant_f32_to_f16(0x1.000002p-25f) == 0x0001, "just above rounds up");
    CHECK(quant_f32_to_f16(0x3p-25f) == 0x0002, "1.5 ulp ties to even 2");
    CHECK(quant_f32_to_f16(0x1p-30f) == 0x0000, "tiny flushes to zero");
    CHECK(quant_f32_to_f16(float_of(1)) == 0x0000, "f32 subnormal");
    CHECK(quant_f32_to_f16(0x1p-14f - 0x1p-25f) == 0x0400, "tie at the normal boundary");
    CHECK(quant_f32_to_f16(1.0f + 0x1p-11f) == 0x3C00, "1 + half ulp ties to 1");
    CHECK(quant_f32_to_f16(1.0f + 0x3p-11f) == 0x3C02, "1 + 1.5 ulp ties to even");
    CHECK(quant_f16_to_f32(0x0001) == 0x1p-24f && quant_f16_to_f32(0x03FF) == 0x3FFp-24f,
          "subnormal decode");
    CHECK(quant_f16_to_f32(0xC000) == -2.0f && quant_f16_to_f32(0x3555) == 0x1.554p-2f, "decode");

    /* Random f32: the result is a nearest half. */
    int bad_rand = 0;
    for (int i = 0; i < 200000; i++) {
        float f = float_of((uint32_t)rng_next());
        if (!isfinite(f) || fabsf(f) >= 65504.0f)
            continue;
        uint16_t h = quant_f32_to_f16(f);
        double err = fabs((double)f - half_value(h));
        if ((h & 0x7FFF) < 0x7BFF)
            bad_rand += err > fabs((double)f - half_value((uint16_t)(h + 1)));
        if ((h & 0x7FFF) > 0)
            bad_rand += err > fabs((double)f - half_value((uint16_t)(h - 1)));
    }
    CHECK(bad_rand == 0, "%d random f32 not rounded to nearest half", bad_rand);
}

static void test_bf16(void)
{
    int bad = 0, bad_mid = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = quant_bf16_to_f32((uint16_t)h);
        CHECK(bits_of(f) == h << 16, "bf16 %04x decodes to %08x", h, bits_of(f));
        if (((h >> 7) & 0xFF) == 0xFF) {
            if (h & 0x7F) {
                uint16_t r = quant_f32_to_bf16(f);
                bad += (r & 0x7F80) != 0x7F80 || (r & 0x7F) == 0 || (r & 0x8000) != (h & 0x8000);
            } else {
                bad += quant_f32_to_bf16(f) != h;
            }
            continue;
        }
        bad += (double)f != bf16_value((uint16_t)h);
        bad += quant_f32_to_bf16(f) != h;
        if ((h & 0x7FFF) < 0x7F7F) {
            float mid = float_of((h << 16) | 0x8000); /* exactly between h and h+1 */
            uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            bad_mid += quant_f32_to_bf16(mid) != even;
            bad_mid += quant_f32_to_bf16(float_of((h << 16) | 0x8001)) != (uint16_t)(h + 1);
            bad_mid += quant_f32_to_bf16(float_of((h << 16) | 0x7FFF)) != (uint16_t)h;
        }
    }
    CHECK(bad == 0, "%d bf16 values wrong", bad);
    CHECK(bad_mid == 0, "%d bf16 roundings wrong", bad_mid);
    CHECK(quant_f32_to_bf16(float_of(0x7F7FFFFF)) == 0x7F80, "largest float rounds to inf");
    CHECK(quant_f32_to_bf16(float_of(0x7F7F7FFF)) == 0x7F7F, "just below stays finite");
    CHECK(quant_f32_to_bf16(float_of(0x00008000)) == 0x0000, "subnormal tie to even 0");
    CHECK(quant_f32_to_bf16(float_of(0x00018000)) == 0x0002, "subnormal tie to even 2");
    CHECK(quant_f32_to_bf16(1.0f + 0x1p-8f) == 0x3F80, "1 + half ulp ties to 1");
    CHECK(quant_f32_to_bf16(1.0f + 0x3p-8f) == 0x3F82, "1 + 1.5 ulp ties to 2");
    CHECK(quant_f32_to_bf16(-INFINITY) == 0xFF80, "-inf");
    uint16_t n = quant_f32_to_bf16(float_of(0x7F800001)); /* signalling nan, low payload */
    CHECK((n & 0x7F80) == 0x7F80 && (n & 0x7F) != 0, "snan stays nan: %04x", n);
}

/* ---- hand-built blocks -------------------------------------------------------------- */

/*
 * Each builder picks random levels and scales, encodes them into one block
 * following the layout of model-spec 2.2/2.3 (element -> byte and bit
 * positions written out here), and stores the expected value of every
 * element computed in double from the same spec formula.
 */
static const int iq4nl_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void build_q8_0(uint8_t *b, double *e)
{
    uint16_t dh = rand_scale_half();
    put16(b, dh);
    for (int j = 0; j < 32; j++) {
        int q = rng_int(-128, 127);
        b[2 + j] = (uint8_t)(int8_t)q;
        e[j] = half_value(dh) * q;
    }
}

/* 32 four-bit levels: element j < 16 in the low nibble of byte j, element
 * j >= 16 in the high nibble of byte j - 16. */
static void put_nibbles32(uint8_t *qs, const int *q)
{
    memset(qs, 0, 16);
    for (int j = 0; j < 32; j++)
        qs[j % 16] |= (uint8_t)((q[j] & 0xF) << (j < 16 ? 0 : 4));
}

static void build_q4_0(uint8_t *b, double *e)
{
    int q[32];
    uint16_t dh = rand_scale_half();
    put16(b, dh);
    for (int j = 0; j < 32; j++) {
        q[j] = rng_int(0, 15);
        e[j] = half_value(dh) * (q[j] - 8);
    }
    put_nibbles32(b + 2, q);
}

static void build_q4_1(uint8_t *b, double *e)
{
    int q[32];
    uint16_t dh = rand_scale_half(), mh = (uint16_t)(rand_scale_half() | (rng_next() & 0x8000));
    put16(b, dh);
    put16(b + 2, mh);
    for (int j = 0; j < 32; j++) {
        q[j] = rng_int(0, 15);
        e[j] = half_value(dh) * q[j] + half_value(mh);
    }
    put_nibbles32(b + 4, q);
}

/* 5-bit levels: low 4 bits as put_nibbles32, bit 4 of element j is bit j of
 * the little-endian 32-bit qh. */
static void put_q5(uint8_t *qh, uint8_t *qs, const int *q)
{
    uint32_t h = 0;
    for (int j = 0; j < 32; j++)
        h |= (uint32_t)(q[j] >> 4) << j;
    for (int k = 0; k < 4; k++)
        qh[k] = (uint8_t)(h >> (8 * k));
    put_nibbles32(qs, q);
}

static void build_q5_0(uint8_t *b, double *e)
{
    int q[32];
    uint16_t dh = rand_scale_half();
    put16(b, dh);
    for (int j = 0; j < 32; j++) {
        q[j] = rng_int(0, 31);
        e[j] = half_value(dh) * (q[j] - 16);
    }
    put_q5(b + 2, b + 6, q);
}

static void build_q5_1(uint8_t *b, double *e)
{
    int q[32];
    uint16_t dh = rand_scale_half(), mh = (uint16_t)(rand_scale_half() | (rng_next() & 0x8000));
    put16(b, dh);
    put16(b + 2, mh);
    for (int j = 0; j < 32; j++) {
        q[j] = rng_int(0, 31);
        e[j] = half_value(dh) * q[j] + half_value(mh);
    }
    put_q5(b + 4, b + 8, q);
}

static void build_iq4_nl(uint8_t *b, double *e)
{
    int q[32];
    uint16_t dh = rand_scale_half();
    put16(b, dh);
    for (int j = 0; j < 32; j++) {
        q[j] = rng_int(0, 15);
        e[j] = half_value(dh) * iq4nl_levels[q[j]];
    }
    put_nibbles32(b + 2, q);
}

/* Packs 8 six-bit scales and mins the way get_scale_min_k4 reads them: for
 * j < 4, sc in bits 0-5 of s[j] and m in bits 0-5 of s[j+4]; for j >= 4, the
 * low 4 bits of sc and m in the low and high nibble of s[j+4] and their top
 * 2 bits in bits 6-7 of s[j-4] (sc) and s[j] (m). */
static void put_scale_min_k4(uint8_t *s, const int *sc, const int *m)
{
    memset(s, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] |= (uint8_t)sc[j];
            s[j + 4] |= (uint8_t)m[j];
        } else {
            s[j + 4] |= (uint8_t)((sc[j] & 0xF) | (m[j] & 0xF) << 4);
            s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            s[j] |= (uint8_t)((m[j] >> 4) << 6);
        }
    }
}

/* Q4_K / Q5_K: element e is in chunk c = e/64 at l = e%32, in the low
 * nibble of qs[32c + l] for the first 32 of the chunk, high for the rest;
 * its sub-block is e/32; for Q5_K its fifth bit is bit e/32 of qh[l]. */
static void build_k45(uint8_t *b, double *e, bool five)
{
    int sc[8], m[8];
    uint16_t dh = rand_scale_half(), mh = rand_scale_half();
    put16(b, dh);
    put16(b + 2, mh);
    for (int j = 0; j < 8; j++) {
        sc[j] = rng_int(0, 63);
        m[j] = rng_int(0, 63);
    }
    put_scale_min_k4(b + 4, sc, m);
    uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    memset(qs, 0, 128);
    if (five)
        memset(qh, 0, 32);
    for (int i = 0; i < 256; i++) {
        int q = rng_int(0, five ? 31 : 15), c = i / 64, l = i % 32, upper = (i % 64) / 32;
        qs[32 * c + l] |= (uint8_t)((q & 0xF) << (4 * upper));
        if (five)
            qh[l] |= (uint8_t)((q >> 4) << (i / 32));
        e[i] = half_value(dh) * sc[i / 32] * q - half_value(mh) * m[i / 32];
    }
}

static void build_q4_k(uint8_t *b, double *e)
{
    build_k45(b, e, false);
}

static void build_q5_k(uint8_t *b, double *e)
{
    build_k45(b, e, true);
}

/* Q6_K: element e is in half h = e/128 at r = e%128, k = r/32, l = r%32; its
 * low 4 bits are in ql[64h + l + 32*(k%2)], low nibble for k < 2, high
 * nibble for k >= 2; its top 2 bits are bits 2k..2k+1 of qh[32h + l]; its
 * scale is scales[e/16]. */
static void build_q6_k(uint8_t *b, double *e)
{
    memset(b, 0, 210);
    int8_t sc[16];
    for (int g = 0; g < 16; g++) {
        sc[g] = (int8_t)rng_int(-128, 127);
        b[192 + g] = (uint8_t)sc[g];
    }
    uint16_t dh = rand_scale_half();
    put16(b + 208, dh);
    for (int i = 0; i < 256; i++) {
        int q = rng_int(0, 63), h = i / 128, r = i % 128, k = r / 32, l = r % 32;
        b[64 * h + l + 32 * (k % 2)] |= (uint8_t)((q & 0xF) << (k >= 2 ? 4 : 0));
        b[128 + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * k));
        e[i] = half_value(dh) * sc[i / 16] * (q - 32);
    }
}

/* Q2_K and Q3_K share the level layout: element e is in half h = e/128 at
 * shift t = (e%128)/32, second-16 flag s = (e%32)/16 and l = e%16, in bits
 * 2t..2t+1 of qs[32h + 16s + l]; its scale index is e/16. Q3_K's high bit is
 * bit 4h + t of hmask[16s + l]. */
static int q23_byte(int i)
{
    return 32 * (i / 128) + 16 * ((i % 32) / 16) + i % 16;
}

static int q23_shift(int i)
{
    return 2 * ((i % 128) / 32);
}

static void build_q2_k(uint8_t *b, double *e)
{
    memset(b, 0, 84);
    for (int j = 0; j < 16; j++)
        b[j] = (uint8_t)rng_int(0, 255);
    uint16_t dh = rand_scale_half(), mh = rand_scale_half();
    put16(b + 80, dh);
    put16(b + 82, mh);
    for (int i = 0; i < 256; i++) {
        int q = rng_int(0, 3), sc = b[i / 16];
        b[16 + q23_byte(i)] |= (uint8_t)(q << q23_shift(i));
        e[i] = half_value(dh) * (sc & 0xF) * q - half_value(mh) * (sc >> 4);
    }
}

static void build_q3_k(uint8_t *b, double *e)
{
    memset(b, 0, 110);
    int sc[16];
    uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
    for (int j = 0; j < 16; j++) {
        sc[j] = rng_int(-32, 31);
        int u = sc[j] + 32; /* 6 bits: low 4 in a nibble, high 2 in s[8 + j%4] */
        s[j % 8] |= (uint8_t)((u & 0xF) << (j < 8 ? 0 : 4));
        s[8 + j % 4] |= (uint8_t)((u >> 4) << (2 * (j / 4)));
    }
    uint16_t dh = rand_scale_half();
    put16(b + 108, dh);
    for (int i = 0; i < 256; i++) {
        int q = rng_int(0, 3), hbit = rng_int(0, 1);
        qs[q23_byte(i)] |= (uint8_t)(q << q23_shift(i));
        int step = 4 * (i / 128) + (i % 128) / 32;
        hmask[16 * ((i % 32) / 16) + i % 16] |= (uint8_t)(hbit << step);
        e[i] = half_value(dh) * sc[i / 16] * (q - (hbit ? 0 : 4));
    }
}

/* IQ4_XS: sub-block ib = e/32 has the 6-bit ls with low 4 bits in nibble
 * ib%2 of scales_l[ib/2] and top 2 bits at bits 2ib of scales_h; element e
 * is nibble (e%32)/16 of qs[16ib + e%16]. */
static void build_iq4_xs(uint8_t *b, double *e)
{
    memset(b, 0, 136);
    uint16_t dh = rand_scale_half();
    put16(b, dh);
    int ls[8];
    uint16_t sh = 0;
    for (int ib = 0; ib < 8; ib++) {
        ls[ib] = rng_int(0, 63);
        b[4 + ib / 2] |= (uint8_t)((ls[ib] & 0xF) << (4 * (ib % 2)));
        sh |= (uint16_t)((ls[ib] >> 4) << (2 * ib));
    }
    put16(b + 2, sh);
    for (int i = 0; i < 256; i++) {
        int q = rng_int(0, 15), ib = i / 32;
        b[8 + 16 * ib + i % 16] |= (uint8_t)(q << (4 * ((i % 32) / 16)));
        e[i] = half_value(dh) * (ls[ib] - 32) * iq4nl_levels[q];
    }
}

static void test_hand_blocks(void)
{
    static const struct {
        uint32_t type;
        void (*build)(uint8_t *b, double *e);
    } cases[] = {
        {QUANT_TYPE_Q8_0, build_q8_0},   {QUANT_TYPE_Q4_0, build_q4_0},
        {QUANT_TYPE_Q4_1, build_q4_1},   {QUANT_TYPE_Q5_0, build_q5_0},
        {QUANT_TYPE_Q5_1, build_q5_1},   {QUANT_TYPE_IQ4_NL, build_iq4_nl},
        {QUANT_TYPE_Q4_K, build_q4_k},   {QUANT_TYPE_Q5_K, build_q5_k},
        {QUANT_TYPE_Q6_K, build_q6_k},   {QUANT_TYPE_Q2_K, build_q2_k},
        {QUANT_TYPE_Q3_K, build_q3_k},   {QUANT_TYPE_IQ4_XS, build_iq4_xs},
    };
    enum { NB = 3 };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        uint32_t t = cases[c].type, be = quant_block_elems(t), bb = quant_block_bytes(t);
        uint8_t raw[3 * 292 + 8];
        double want[NB * 256];
        float got[NB * 256];
        int bad = 0;
        for (int trial = 0; trial < 50; trial++) {
            uint8_t *row = raw + trial % 7; /* any alignment */
            for (int k = 0; k < NB; k++)
                cases[c].build(row + k * bb, want + k * be);
            int rc = quant_dequantize_row(t, row, got, NB * be);
            CHECK(rc == 0, "%s dequantize rc %d", quant_type_name(t), rc);
            for (uint32_t i = 0; i < NB * be; i++) {
                double tol = 1e-6 * fabs(want[i]) + 1e-30;
                if (fabs(got[i] - want[i]) > tol && bad++ < 3)
                    fprintf(stderr, "%s element %u: got %.9g want %.9g\n", quant_type_name(t),
                            i, got[i], want[i]);
            }
        }
        CHECK(bad == 0, "%s: %d elements differ from the spec formula", quant_type_name(t), bad);
    }
}

/* A few blocks with fully fixed bytes, values worked out by hand. */
static void test_known_values(void)
{
    /* Q4_0, d = 0.5: byte 0 = 0x9F -> x[0] = (15-8)*0.5 = 3.5, x[16] = (9-8)*0.5 = 0.5. */
    uint8_t q40[18] = {0x00, 0x38, 0x9F};
    float y[256];
    CHECK(quant_dequantize_row(QUANT_TYPE_Q4_0, q40, y, 32) == 0, "q4_0");
    CHECK(y[0] == 3.5f && y[16] == 0.5f && y[1] == -4.0f && y[17] == -4.0f,
          "q4_0 values %g %g %g %g", y[0], y[16], y[1], y[17]);

    /* Q8_0, d = 2: qs[3] = -3 -> -6. */
    uint8_t q80[34] = {0x00, 0x40};
    q80[2 + 3] = 0xFD;
    CHECK(quant_dequantize_row(QUANT_TYPE_Q8_0, q80, y, 32) == 0 && y[3] == -6.0f && y[0] == 0.0f,
          "q8_0 %g", y[3]);

    /* Q4_K, d = 1, dmin = 0.5, sub-block 5 scale 33 (0b100001) min 18
     * (0b010010): s[9] = 0x21 (low nibbles 1 and 2), s[1] bit 6-7 = 2 (sc
     * top), s[5] bits 6-7 = 1 (m top). qs[32*2 + 7] = 0xA0 -> element
     * 64*2 + 32 + 7 = 167 has level 10: 1*33*10 - 0.5*18 = 321. */
    uint8_t q4k[144] = {0x00, 0x3C, 0x00, 0x38};
    q4k[4 + 9] = 0x21;
    q4k[4 + 1] = 0x80;
    q4k[4 + 5] = 0x40;
    q4k[16 + 64 + 7] = 0xA0;
    CHECK(quant_dequantize_row(QUANT_TYPE_Q4_K, q4k, y, 256) == 0, "q4_k");
    CHECK(y[167] == 321.0f && y[160] == -9.0f && y[0] == 0.0f, "q4_k %g %g %g", y[167], y[160],
          y[0]);

    /* Q6_K, d = 0.25, scales[5] = -4: element 80 (half 0, k = 2, l = 16)
     * takes the high nibble of ql[16] and bits 4-5 of qh[16]; level 0x2A =
     * 42 -> 0.25 * -4 * (42 - 32) = -10. Zero bytes elsewhere give -32. */
    uint8_t q6k[210] = {0};
    q6k[16] = 0xA0;
    q6k[128 + 16] = 0x20;
    q6k[192 + 5] = 0xFC;
    q6k[208] = 0x00;
    q6k[209] = 0x34;
    CHECK(quant_dequantize_row(QUANT_TYPE_Q6_K, q6k, y, 256) == 0, "q6_k");
    CHECK(y[80] == -10.0f && y[81] == 32.0f && y[0] == 0.0f, "q6_k %g %g %g", y[80], y[81], y[0]);

    /* IQ4_XS, d = 1, sub-block 1 ls = 34 (low nibble 2 in the high half of
     * scales_l[0], top bits 2 at bits 2-3 of scales_h): element 32+16 is the
     * high nibble of qs[16], index 15 -> 2 * 113 = 226. */
    uint8_t iq4xs[136] = {0x00, 0x3C, 0x08, 0x00, 0x20};
    iq4xs[8 + 16] = 0xF0;
    CHECK(quant_dequantize_row(QUANT_TYPE_IQ4_XS, iq4xs, y, 256) == 0, "iq4_xs");
    CHECK(y[48] == 226.0f && y[32] == 2.0f * -127.0f, "iq4_xs %g %g", y[48], y[32]);
}

static void test_rejects(void)
{
    float y[64];
    uint8_t b[64] = {0};
    CHECK(quant_dequantize_row(QUANT_TYPE_IQ2_XXS, b, y, 256) == -EINVAL, "iq2_xxs dequant");
    CHECK(strstr(log_last_error(), "IQ2_XXS") != NULL, "error names the type: %s",
          log_last_error());
    CHECK(quant_dequantize_row(QUANT_TYPE_Q8_0, b, y, 33) == -EINVAL, "bad n");
    CHECK(quant_dequantize_row(77, b, y, 32) == -EINVAL, "unknown type");
    CHECK(quant_quantize_row(QUANT_TYPE_Q2_K, y, b, 256) == -EINVAL, "q2_k has no quantizer");
    CHECK(quant_quantize_row(QUANT_TYPE_Q4_0, y, b, 48) == -EINVAL, "bad n");
    CHECK(quant_quantize_row(1234, y, b, 32) == -EINVAL, "unknown type");
    CHECK(quant_dequantize_row(QUANT_TYPE_Q4_0, b, y, 0) == 0, "empty row");
}

/* ---- quantizer round trips ------------------------------------------------------------- */

/* Per-type expectations: RMS error over RMS value on N(0,1) data, and on any
 * data the largest error over the largest |x| of its quant block (32
 * elements for the plain types), after subtracting slack: an absolute error
 * allowed where block scales fall into fp16's subnormal range and lose
 * relative precision (levels x 2^-25). */
struct qcase {
    uint32_t type;
    double max_rel_rmse;
    double max_err_per_amax;
    double slack;
};

static void check_round_trip(const struct qcase *c, const float *x, float *y, uint8_t *q, int n,
                             const char *what)
{
    CHECK(quant_quantize_row(c->type, x, q, (uint64_t)n) == 0, "%s quantize", what);
    CHECK(quant_dequantize_row(c->type, q, y, (uint64_t)n) == 0, "%s dequantize", what);
    int be = quant_block_elems(c->type) > 1 ? (int)quant_block_elems(c->type) : 32;
    double se = 0, sx = 0, worst = 0;
    for (int b = 0; b < n / be; b++) {
        float amax = 0;
        for (int j = 0; j < be; j++)
            amax = fmaxf(amax, fabsf(x[be * b + j]));
        for (int j = 0; j < be; j++) {
            double e = (double)y[be * b + j] - x[be * b + j];
            se += e * e;
            sx += (double)x[be * b + j] * x[be * b + j];
            double over = fmax(fabs(e) - c->slack, 0.0);
            worst = fmax(worst, amax > 0 ? over / amax : over * 1e30);
        }
    }
    double rel = sx > 0 ? sqrt(se / sx) : sqrt(se);
    if (strcmp(what, "gauss") == 0) {
        CHECK(rel <= c->max_rel_rmse, "%s %s: relative rms error %.5f > %.5f",
              quant_type_name(c->type), what, rel, c->max_rel_rmse);
        MEASURE("quant %-5s gaussian: rel rms error %.5f, max err/amax %.5f",
                quant_type_name(c->type), rel, worst);
    }
    CHECK(worst <= c->max_err_per_amax, "%s %s: max error / block amax %.5f > %.5f",
          quant_type_name(c->type), what, worst, c->max_err_per_amax);
}

static void test_round_trips(void)
{
    /* Bounds: rms from measurement with ~15 % margin; max error from the
     * step size (Q8_0: d/2 + fp16 rounding of d; Q4_0/Q5_0: one step at
     * the clipped end; affine and K types: about one step of the range). */
    static const struct qcase cases[] = {
        {QUANT_TYPE_F32, 0.0, 0.0, 0.0},
        {QUANT_TYPE_F16, 0.0004, 0.0005, 0x1p-25},
        {QUANT_TYPE_BF16, 0.003, 0.004, 0.0},
        {QUANT_TYPE_Q8_0, 0.0062, 0.5 / 127 + 0.0005, 0x1p-18},
        {QUANT_TYPE_Q4_0, 0.099, 1.0 / 8 + 0.001, 0x1p-21},
        {QUANT_TYPE_Q4_1, 0.090, 1.0 / 15 + 0.002, 0x1p-20},
        {QUANT_TYPE_Q5_0, 0.049, 1.0 / 16 + 0.001, 0x1p-20},
        {QUANT_TYPE_Q5_1, 0.044, 1.0 / 31 + 0.002, 0x1p-19},
        {QUANT_TYPE_Q4_K, 0.087, 0.15, 0x1p-14},
        {QUANT_TYPE_Q5_K, 0.043, 0.08, 0x1p-13},
        {QUANT_TYPE_Q6_K, 0.021, 0.05, 0x1p-12},
    };
    enum { N = 256 * 64 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    uint8_t *q = malloc(N * sizeof(float) + 8);
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const struct qcase *qc = &cases[c];
        for (int i = 0; i < N; i++)
            x[i] = rng_gauss();
        check_round_trip(qc, x, y, q + 1, N, "gauss");
        /* Blocks of very different scales, and blocks offset from zero. */
        for (int i = 0; i < N; i++)
            x[i] = rng_unit() * ldexpf(1.0f, (i / 256) % 20 - 10) + ((i / 512) % 2 ? 0.7f : 0.0f);
        check_round_trip(qc, x, y, q + 3, N, "scaled");
        /* Zeros stay exact zeros; constants stay close. */
        memset(x, 0, N * sizeof(float));
        check_round_trip(qc, x, y, q, N, "zeros");
        for (int i = 0; i < N; i++)
            CHECK(y[i] == 0.0f, "%s zero row gives %g", quant_type_name(qc->type), y[i]);
        for (int i = 0; i < N; i++)
            x[i] = (i / 256) % 2 ? -1.25f : 3.0f;
        check_round_trip(qc, x, y, q, N, "constant");
        /* One outlier per block. */
        for (int i = 0; i < N; i++)
            x[i] = (i % 97 == 5) ? 40.0f * rng_unit() : 0.01f * rng_gauss();
        check_round_trip(qc, x, y, q, N, "outliers");
    }
    /* F16/BF16 quantize exactly as the scalar conversions do. */
    for (int i = 0; i < 1024; i++)
        x[i] = rng_gauss() * 1000.0f;
    quant_quantize_row(QUANT_TYPE_F16, x, q + 1, 1024);
    quant_dequantize_row(QUANT_TYPE_F16, q + 1, y, 1024);
    int bad = 0;
    for (int i = 0; i < 1024; i++) {
        uint16_t h = (uint16_t)(q[1 + 2 * i] | q[2 + 2 * i] << 8);
        bad += h != quant_f32_to_f16(x[i]) || bits_of(y[i]) != bits_of(quant_f16_to_f32(h));
    }
    quant_quantize_row(QUANT_TYPE_BF16, x, q + 1, 1024);
    quant_dequantize_row(QUANT_TYPE_BF16, q + 1, y, 1024);
    for (int i = 0; i < 1024; i++) {
        uint16_t h = (uint16_t)(q[1 + 2 * i] | q[2 + 2 * i] << 8);
        bad += h != quant_f32_to_bf16(x[i]) || bits_of(y[i]) != bits_of(quant_bf16_to_f32(h));
    }
    CHECK(bad == 0, "%d f16/bf16 elements differ from the scalar conversions", bad);
    free(x);
    free(y);
    free(q);
}

/* Q8_0 and Q4_0 follow llama.cpp's reference rounding exactly. */
static void test_reference_rounding(void)
{
    float x[32];
    uint8_t b[34];
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j - 16) * 0.25f;
    x[7] = 127.0f / 254.0f * 2.0f; /* exact ties after scaling */
    x[31] = -12.7f;
    quant_quantize_row(QUANT_TYPE_Q8_0, x, b, 32);
    float d = 12.7f / 127.0f, id = 1.0f / d;
    CHECK((b[0] | b[1] << 8) == quant_f32_to_f16(d), "q8_0 d");
    int bad = 0;
    for (int j = 0; j < 32; j++)
        bad += (int8_t)b[2 + j] != (int8_t)roundf(x[j] * id);
    CHECK(bad == 0, "q8_0: %d levels differ from roundf(x / d)", bad);

    /* Q4_0: the signed extreme maps to level 0 (value -8 d). */
    for (int j = 0; j < 32; j++)
        x[j] = 0.1f * (float)j;
    x[20] = -5.0f;
    quant_quantize_row(QUANT_TYPE_Q4_0, x, b, 32);
    float d4 = -5.0f / -8.0f;
    CHECK((b[0] | b[1] << 8) == quant_f32_to_f16(d4), "q4_0 d");
    CHECK((b[2 + 4] >> 4) == 0, "q4_0 extreme level %d", b[2 + 4] >> 4);
    bad = 0;
    for (int j = 0; j < 32; j++) {
        int want = (int)(x[j] * (1.0f / d4) + 8.5f);
        want = want > 15 ? 15 : want;
        int got = j < 16 ? b[2 + j] & 0xF : b[2 + j - 16] >> 4;
        bad += got != want;
    }
    CHECK(bad == 0, "q4_0: %d levels differ from the reference rounding", bad);
}

static void measure_speed(void)
{
    static const uint32_t types[] = {QUANT_TYPE_F16,  QUANT_TYPE_BF16, QUANT_TYPE_Q8_0,
                                     QUANT_TYPE_Q4_0, QUANT_TYPE_Q4_1, QUANT_TYPE_Q5_0,
                                     QUANT_TYPE_Q5_1, QUANT_TYPE_Q4_K, QUANT_TYPE_Q5_K,
                                     QUANT_TYPE_Q6_K};
    enum { N = 1 << 19 };
    float *x = malloc(N * sizeof(float));
    uint8_t *q = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++)
        x[i] = rng_gauss();
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        double best = 1e9;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now_s();
            quant_quantize_row(types[t], x, q, N);
            best = fmin(best, now_s() - t0);
        }
        double mb = (double)quant_row_size(types[t], N) / 1e6;
        MEASURE("quantize %-5s %.0f MB/s output, single thread", quant_type_name(types[t]),
                mb / best);
    }
    free(x);
    free(q);
}

int main(void)
{
    log_init("test", -1);
    uint64_t seed = (uint64_t)time(NULL);
    const char *env = getenv("TEST_SEED");
    if (env)
        seed = strtoull(env, NULL, 0);
    printf("seed %llu (set TEST_SEED to repeat)\n", (unsigned long long)seed);
    rng_state ^= seed * 0x9E3779B97F4A7C15ull;
    if (!rng_state)
        rng_state = 1;

    test_type_table();
    test_f16();
    test_bf16();
    test_hand_blocks();
    test_known_values();
    test_rejects();
    test_round_trips();
    test_reference_rounding();
    measure_speed();
    return test_main_result("test_quant");
}
