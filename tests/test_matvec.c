/*
 * test_matvec: every dot path (AVX2, portable C) against the references on
 * fresh random rows of every supported type, for many lengths and
 * misaligned pointers; matvec_rows and matvec_rows_batch (both paths)
 * against them, including untouched neighbours; exact integer cases; split
 * invariance; and single-thread weight streaming speed per type (4096 x
 * 4096, and Q4_0 from a matrix larger than the caches).
 *
 * Tolerances, per path. Let S = sum_i |w_i x_i| and, for block types,
 * B = sum_i |w_i| * dx_i / 2 with dx_i = amax/127 of element i's activation
 * block (32 values for the Q8_0 form, 256 for Q8_K; B = 0 for plain types):
 *   - against matvec_dot_ref_xq (activations rounded as the kernels do):
 *     |got - ref_xq| <= TOL * (S + B), f32 accumulation only;
 *   - against matvec_dot_ref (true f32 activations): |got - ref| <=
 *     B * (1 + 1e-5) + TOL * (S + B), the activation rounding's worst case;
 *     the largest |got - ref| / S seen is reported (about 1e-3).
 * Random rows are random bytes with every fp16 scale field replaced by a
 * sane value, so all level and sub-scale bit patterns occur.
 */
#include "kernels/cpu/matvec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "model/quant.h"
#include "tests/check.h"

#define TOL 2e-6

static uint64_t rng_state = 0x853C49E6748FEA9Bull;

static uint64_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* Roughly N(0,1): the sum of four uniforms (cheap; the shape hardly matters). */
static float rng_gauss(void)
{
    uint64_t r = rng_next();
    int s = (int)(r & 0xFFFF) + (int)((r >> 16) & 0xFFFF) + (int)((r >> 32) & 0xFFFF) +
            (int)(r >> 48);
    return (float)(s - 2 * 65535) * (1.7320508f / 65536.0f);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The supported types and where their fp16 scale fields sit in a block. */
static const struct tinfo {
    uint32_t type;
    int halves[2]; /* byte offsets of fp16 fields, -1 for none */
    bool signed_second; /* the second field is an offset that may be negative */
} types[] = {
    {QUANT_TYPE_F32, {-1, -1}, false},   {QUANT_TYPE_F16, {-1, -1}, false},
    {QUANT_TYPE_BF16, {-1, -1}, false},  {QUANT_TYPE_Q8_0, {0, -1}, false},
    {QUANT_TYPE_Q4_0, {0, -1}, false},   {QUANT_TYPE_Q4_1, {0, 2}, true},
    {QUANT_TYPE_Q5_0, {0, -1}, false},   {QUANT_TYPE_Q5_1, {0, 2}, true},
    {QUANT_TYPE_IQ4_NL, {0, -1}, false}, {QUANT_TYPE_Q2_K, {80, 82}, false},
    {QUANT_TYPE_Q3_K, {108, -1}, false}, {QUANT_TYPE_Q4_K, {0, 2}, false},
    {QUANT_TYPE_Q5_K, {0, 2}, false},    {QUANT_TYPE_Q6_K, {208, -1}, false},
    {QUANT_TYPE_IQ4_XS, {0, -1}, false},
};
#define NTYPES (sizeof(types) / sizeof(types[0]))

/* Fills n elements of a random row of type ti at dst. */
static void random_row(const struct tinfo *ti, uint8_t *dst, uint64_t n)
{
    uint32_t t = ti->type;
    if (t == QUANT_TYPE_F32 || t == QUANT_TYPE_F16 || t == QUANT_TYPE_BF16) {
        for (uint64_t i = 0; i < n; i++) {
            float f = rng_gauss();
            if (t == QUANT_TYPE_F32) {
                memcpy(dst + 4 * i, &f, 4);
            } else {
                uint16_t h = t == QUANT_TYPE_F16 ? quant_f32_to_f16(f) : quant_f32_to_bf16(f);
                dst[2 * i] = (uint8_t)h;
                dst[2 * i + 1] = (uint8_t)(h >> 8);
            }
        }
        return;
    }
    size_t bytes = quant_row_size(t, n);
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t r = rng_next();
        memcpy(dst + i, &r, bytes - i < 8 ? bytes - i : 8);
    }
    uint32_t bb = quant_block_bytes(t);
    for (size_t b = 0; b < bytes / bb; b++)
        for (int k = 0; k < 2; k++) {
            if (ti->halves[k] < 0)
                continue;
            /* about 2^-8 .. 2^-2, sometimes negative for offsets */
            uint16_t h = (uint16_t)(0x1C00 + rng_next() % 0x1800);
            if (k == 1 && ti->signed_second && (rng_next() & 1))
                h |= 0x8000;
            dst[b * bb + ti->halves[k]] = (uint8_t)h;
            dst[b * bb + ti->halves[k] + 1] = (uint8_t)(h >> 8);
        }
}

/* The scales of one product: S = sum |w_i x_i| and B, the bound on what
 * the activation rounding can add (see the file comment). */
struct scales {
    double s, b;
};

static struct scales case_scales(uint32_t t, const uint8_t *row, const float *x, uint64_t n,
                                 float *scratch)
{
    struct scales sc = {NAN, 0};
    if (quant_dequantize_row(t, row, scratch, n))
        return sc;
    uint32_t xt = matvec_x_type(t);
    uint64_t bl = xt == QUANT_TYPE_Q8_0 ? 32 : xt == QUANT_TYPE_Q8_K ? 256 : 0;
    sc.s = 0;
    for (uint64_t i = 0; i < n; i++)
        sc.s += fabs((double)scratch[i] * x[i]);
    for (uint64_t b0 = 0; bl && b0 < n; b0 += bl) {
        double amax = 0, wsum = 0;
        for (uint64_t i = b0; i < b0 + bl; i++) {
            amax = fmax(amax, fabs(x[i]));
            wsum += fabs(scratch[i]);
        }
        sc.b += wsum * amax / 127.0 / 2.0;
    }
    return sc;
}

/* Whether got is within both tolerances of the file comment; *eq and *et
 * receive |got - ref_xq| / (S + B) and |got - ref| / S. */
static bool within(double got, double ref_xq, double ref, struct scales sc, double *eq,
                   double *et)
{
    *eq = fabs(got - ref_xq) / (sc.s + sc.b + 1e-300);
    *et = fabs(got - ref) / (sc.s + 1e-300);
    return *eq <= TOL && fabs(got - ref) <= sc.b * (1 + 1e-5) + TOL * (sc.s + sc.b);
}

static void fill_x(float *x, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        x[i] = rng_gauss();
}

/* ---- dot products ------------------------------------------------------------------ */

static void test_dots(void)
{
    static const uint64_t plain_n[] = {0,   1,   3,   7,    8,    9,    15,   16,   17,
                                       31,  32,  33,  63,   64,   65,   100,  255,  256,
                                       257, 1000, 1023, 1024, 1025, 2049, 4096, 4103};
    /* the largest lengths cross the 8192-element activation segment */
    static const uint64_t blocks32[] = {0,  1,  2,  3,  4,  5,  7,   8,  9,
                                        16, 31, 32, 33, 64, 65, 129, 257};
    static const uint64_t blocks256[] = {0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 40};
    enum { MAXN = 10240 };
    uint8_t *rowbuf = malloc(MAXN * 4 + 64);
    float *xbuf = malloc((MAXN + 16) * sizeof(float)), *scratch = malloc(MAXN * sizeof(float));
    for (size_t k = 0; k < NTYPES; k++) {
        const struct tinfo *ti = &types[k];
        uint32_t t = ti->type, be = quant_block_elems(t);
        const uint64_t *ns = be == 1 ? plain_n : be == 32 ? blocks32 : blocks256;
        size_t cnt = be == 1 ? sizeof(plain_n) / 8 : be == 32 ? sizeof(blocks32) / 8
                                                              : sizeof(blocks256) / 8;
        double worst_q[2] = {0, 0}, worst_t[2] = {0, 0};
        int bad = 0;
        for (size_t i = 0; i < cnt; i++) {
            uint64_t n = be == 1 ? ns[i] : ns[i] * be;
            for (int trial = 0; trial < 4; trial++) {
                uint8_t *row = rowbuf + rng_next() % 8;
                float *x = xbuf + rng_next() % 8;
                random_row(ti, row, n);
                fill_x(x, n);
                double ref = matvec_dot_ref(t, row, x, n), refq = matvec_dot_ref_xq(t, row, x, n);
                struct scales sc = case_scales(t, row, x, n, scratch);
                float got[2] = {matvec_dot(t, row, x, n), matvec_dot_portable(t, row, x, n)};
                double eq[2], et[2];
                bool ok = true;
                for (int p = 0; p < 2; p++) {
                    ok &= within(got[p], refq, ref, sc, &eq[p], &et[p]);
                    worst_q[p] = fmax(worst_q[p], eq[p]);
                    if (n >= 256) /* the typical error; tiny dots are noisier */
                        worst_t[p] = fmax(worst_t[p], et[p]);
                }
                /* the rounded reference itself is within the rounding bound */
                ok &= fabs(refq - ref) <= sc.b * (1 + 1e-5) + 1e-6 * sc.s;
                if (!ok && bad++ < 3)
                    fprintf(stderr, "%s n=%llu: rel errors vs ref_xq fast %.3g portable %.3g; "
                            "vs ref %.3g %.3g (rounding bound %.3g)\n", quant_type_name(t),
                            (unsigned long long)n, eq[0], eq[1], et[0], et[1], sc.b / sc.s);
            }
        }
        CHECK(bad == 0, "%s: %d dot products outside tolerance", quant_type_name(t), bad);
        if (matvec_x_type(t) == QUANT_TYPE_F32)
            MEASURE("dot %-6s (f32 x) max |err|/sum|w*x|: fast %.2e, portable %.2e",
                    quant_type_name(t), worst_q[0], worst_q[1]);
        else
            MEASURE("dot %-6s (%s x) max |err| / sum|w*xq|: fast %.2e, portable %.2e; against "
                    "f32 x, n >= 256: %.2e, %.2e", quant_type_name(t),
                    quant_type_name(matvec_x_type(t)), worst_q[0], worst_q[1], worst_t[0],
                    worst_t[1]);
    }
    free(rowbuf);
    free(xbuf);
    free(scratch);
}

/* Cases whose exact result a float holds, so any loss or wrong lane shows:
 * F32 with integers; Q8_0 and Q4_0 with unit scales and integer activations
 * whose every block reaches 127 (so they round to themselves); all-zero
 * activations (a block with amax 0 must give 0, not NaN). */
static void test_exact(void)
{
    enum { N = 1024 };
    uint8_t *row = malloc(N * 4);
    float *x = malloc(2 * N * sizeof(float));
    for (uint64_t i = 0; i < N; i++) {
        float w = (float)((int)(i % 17) - 8);
        memcpy(row + 4 * i, &w, 4);
        x[i] = (float)((int)(i % 13) - 6);
    }
    double exact = matvec_dot_ref(QUANT_TYPE_F32, row, x, N);
    CHECK(matvec_dot(QUANT_TYPE_F32, row, x, N) == (float)exact, "f32 integer dot");
    CHECK(matvec_dot_portable(QUANT_TYPE_F32, row, x, N) == (float)exact,
          "f32 integer dot, portable");

    for (uint64_t i = 0; i < N; i++)
        x[i] = i % 32 == 5 ? (i % 64 ? 127.0f : -127.0f) : (float)((int)(rng_next() % 255) - 127);
    static const uint32_t exact_types[] = {QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_0};
    for (size_t k = 0; k < 2; k++) {
        uint32_t t = exact_types[k], bb = quant_block_bytes(t);
        for (uint64_t b = 0; b < N / 32; b++) {
            uint8_t *blk = row + b * bb;
            uint16_t one = quant_f32_to_f16(1.0f);
            memcpy(blk, &one, 2);
            for (uint32_t j = 2; j < bb; j++)
                blk[j] = (uint8_t)rng_next();
        }
        exact = matvec_dot_ref(t, row, x, N);
        CHECK(exact == matvec_dot_ref_xq(t, row, x, N), "%s: integer x rounds to itself",
              quant_type_name(t));
        CHECK(matvec_dot(t, row, x, N) == (float)exact, "%s integer dot: %.1f, exact %.1f",
              quant_type_name(t), matvec_dot(t, row, x, N), exact);
        CHECK(matvec_dot_portable(t, row, x, N) == (float)exact,
              "%s integer dot, portable: %.1f, exact %.1f", quant_type_name(t),
              matvec_dot_portable(t, row, x, N), exact);
    }

    memset(x, 0, 2 * N * sizeof(float));
    for (size_t k = 0; k < NTYPES; k++) {
        uint32_t t = types[k].type;
        random_row(&types[k], row, N);
        float y = 1.0f, yb[2] = {1.0f, 1.0f};
        matvec_rows(t, row, quant_row_size(t, N), x, N, &y, 0, 1);
        matvec_rows_batch(t, row, quant_row_size(t, N), x, N, 2, N, yb, 1, 0, 1);
        CHECK(y == 0.0f && yb[0] == 0.0f && yb[1] == 0.0f &&
                  matvec_dot_portable(t, row, x, N) == 0.0f,
              "%s: zero activations give %g, %g, %g", quant_type_name(t), y, yb[0], yb[1]);
    }
    free(row);
    free(x);
}

/* ---- rows and batches --------------------------------------------------------------- */

static uint64_t test_n(uint32_t t)
{
    /* crosses the 1024-element decode chunk of plain types, and the 2048- and
     * 8192-element activation segments of block types, without being a
     * multiple of any */
    uint32_t be = quant_block_elems(t);
    return be == 1 ? 1029 : be == 32 ? 32 * 259 : 256 * 33;
}

static void test_rows(void)
{
    enum { R = 11, R0 = 2, R1 = 9 };
    for (size_t k = 0; k < NTYPES; k++) {
        const struct tinfo *ti = &types[k];
        uint32_t t = ti->type;
        uint64_t n = test_n(t);
        size_t row_bytes = quant_row_size(t, n) + k % 6; /* padded, so rows misalign */
        uint8_t *w = malloc(R * row_bytes + 8), *w0 = w + 1 + k % 7;
        float *x = malloc(n * sizeof(float)), *scratch = malloc(n * sizeof(float));
        float y[R];
        for (int r = 0; r < R; r++)
            random_row(ti, w0 + r * row_bytes, n);
        fill_x(x, n);
        for (int r = 0; r < R; r++)
            y[r] = -12345.0f;
        matvec_rows(t, w0, row_bytes, x, n, y, R0, R1);
        int bad = 0;
        for (int r = 0; r < R; r++) {
            const uint8_t *row = w0 + r * row_bytes;
            if (r < R0 || r >= R1) {
                bad += y[r] != -12345.0f;
                continue;
            }
            double eq, et;
            bad += !within(y[r], matvec_dot_ref_xq(t, row, x, n), matvec_dot_ref(t, row, x, n),
                           case_scales(t, row, x, n, scratch), &eq, &et);
        }
        CHECK(bad == 0, "%s matvec_rows: %d rows wrong", quant_type_name(t), bad);
        free(w);
        free(x);
        free(scratch);
    }
}

typedef void (*batch_fn)(uint32_t type, const void *w, size_t row_bytes, const float *X,
                         size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy, uint64_t r0,
                         uint64_t r1);

static void test_batch_one(const struct tinfo *ti, batch_fn fn, const char *name, uint64_t S)
{
    enum { R = 11, R0 = 1, R1 = 10, LDY = R + 2 };
    uint32_t t = ti->type;
    uint64_t n = test_n(t);
    size_t ldx = n + 3, row_bytes = quant_row_size(t, n) + 3;
    uint8_t *w = malloc(R * row_bytes + 8), *w0 = w + 5;
    float *X = malloc(S * ldx * sizeof(float)), *Y = malloc(S * LDY * sizeof(float));
    float *scratch = malloc(n * sizeof(float));
    for (int r = 0; r < R; r++)
        random_row(ti, w0 + r * row_bytes, n);
    fill_x(X, S * ldx);
    for (uint64_t i = 0; i < S * LDY; i++)
        Y[i] = -777.0f;
    fn(t, w0, row_bytes, X, ldx, S, n, Y, LDY, R0, R1);
    int bad = 0;
    double worst = 0;
    for (uint64_t s = 0; s < S; s++)
        for (int r = 0; r < LDY; r++) {
            float got = Y[s * LDY + r];
            if (r < R0 || r >= R1) {
                bad += got != -777.0f;
                continue;
            }
            const uint8_t *row = w0 + r * row_bytes;
            const float *x = X + s * ldx;
            double eq, et;
            bad += !within(got, matvec_dot_ref_xq(t, row, x, n), matvec_dot_ref(t, row, x, n),
                           case_scales(t, row, x, n, scratch), &eq, &et);
            worst = fmax(worst, eq);
        }
    CHECK(bad == 0, "%s %s S=%llu: %d outputs wrong (worst rel to ref_xq %.3g)",
          quant_type_name(t), name, (unsigned long long)S, bad, worst);
    free(w);
    free(X);
    free(Y);
    free(scratch);
}

static void test_batches(void)
{
    static const uint64_t Ss[] = {1, 2, 3, 5};
    for (size_t k = 0; k < NTYPES; k++)
        for (size_t i = 0; i < sizeof(Ss) / sizeof(Ss[0]); i++) {
            test_batch_one(&types[k], matvec_rows_batch, "batch", Ss[i]);
            test_batch_one(&types[k], matvec_rows_batch_portable, "batch_portable", Ss[i]);
        }
}

/* Results do not depend on how a caller splits rows or batches: every row
 * of matvec_rows equals matvec_dot bit for bit, and batch outputs are the
 * same bits whether computed in one call or row by row, S at a time. */
static void test_split_invariance(void)
{
    enum { R = 7, S = 6 }; /* batches of 4 + 2, 4 + 1 and 2 + 2 + 2 rows */
    for (size_t k = 0; k < NTYPES; k++) {
        const struct tinfo *ti = &types[k];
        uint32_t t = ti->type;
        uint64_t n = test_n(t);
        size_t rb = quant_row_size(t, n);
        uint8_t *w = malloc(R * rb);
        float *X = malloc(S * n * sizeof(float)), y[R], one[R], Y[S * R], Y1[S * R], Y3[S * R];
        for (int r = 0; r < R; r++)
            random_row(ti, w + r * rb, n);
        fill_x(X, S * n);
        matvec_rows(t, w, rb, X, n, y, 0, R);
        int bad = 0;
        for (int r = 0; r < R; r++) {
            matvec_rows(t, w, rb, X, n, one, (uint64_t)r, (uint64_t)r + 1);
            float d = matvec_dot(t, w + r * rb, X, n);
            bad += memcmp(&one[r], &y[r], 4) != 0 || memcmp(&d, &y[r], 4) != 0;
        }
        matvec_rows_batch(t, w, rb, X, n, S, n, Y, R, 0, R);
        matvec_rows_batch(t, w, rb, X, n, S - 1, n, Y3, R, 0, R);
        for (int r = 0; r < R; r++)
            for (int s0 = 0; s0 < S; s0 += 2)
                matvec_rows_batch(t, w, rb, X + s0 * n, n, 2, n, Y1 + s0 * R, R, (uint64_t)r,
                                  (uint64_t)r + 1);
        bad += memcmp(Y, Y1, sizeof(Y)) != 0;
        bad += memcmp(Y, Y3, (S - 1) * R * sizeof(float)) != 0;
        CHECK(bad == 0, "%s: results depend on the row or batch split (%d differences)",
              quant_type_name(t), bad);
        free(w);
        free(X);
    }
}

/* ---- speed ------------------------------------------------------------------------------ */

static void measure_speed(void)
{
    static const uint32_t fast[] = {
        QUANT_TYPE_F32,    QUANT_TYPE_F16,  QUANT_TYPE_BF16, QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_0,
        QUANT_TYPE_Q4_1,   QUANT_TYPE_Q5_0, QUANT_TYPE_Q5_1, QUANT_TYPE_IQ4_NL, QUANT_TYPE_Q4_K,
        QUANT_TYPE_Q5_K,   QUANT_TYPE_Q6_K, QUANT_TYPE_Q2_K, QUANT_TYPE_Q3_K, QUANT_TYPE_IQ4_XS};
    enum { N = 4096, R = 4096, S = 8 };
    float *x = malloc(N * S * sizeof(float)), *y = malloc(R * S * sizeof(float));
    fill_x(x, N * S);
    MEASURE("cpu %s the AVX2/FMA/F16C paths", matvec_has_simd() ? "runs" : "lacks");
    for (size_t i = 0; i < sizeof(fast) / sizeof(fast[0]); i++) {
        const struct tinfo *ti = NULL;
        for (size_t k = 0; k < NTYPES; k++)
            if (types[k].type == fast[i])
                ti = &types[k];
        size_t rb = quant_row_size(ti->type, N);
        uint8_t *w = malloc(R * rb);
        random_row(ti, w, (uint64_t)N * R); /* one long row: same bytes */
        double best = 1e9, best_b = 1e9;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now_s();
            matvec_rows(ti->type, w, rb, x, N, y, 0, R);
            best = fmin(best, now_s() - t0);
        }
        for (int rep = 0; rep < 2; rep++) {
            double t0 = now_s();
            matvec_rows_batch(ti->type, w, rb, x, N, S, N, y, R, 0, R);
            best_b = fmin(best_b, now_s() - t0);
        }
        MEASURE("matvec %-6s 4096x4096 single thread: %.1f GB/s of weights; batch S=%d %.1f "
                "GFLOP/s", quant_type_name(ti->type), (double)(R * rb) / best / 1e9, S,
                2.0 * N * R * S / best_b / 1e9);
        free(w);
    }
    free(x);
    free(y);
}

/* Q4_0, the decode case: 2048-element rows streamed from a matrix larger
 * than the last-level cache (260 MiB on the development machine). */
static void measure_memory_speed(void)
{
    enum { N = 2048 };
    const struct tinfo *ti = NULL;
    for (size_t k = 0; k < NTYPES; k++)
        if (types[k].type == QUANT_TYPE_Q4_0)
            ti = &types[k];
    size_t rb = quant_row_size(ti->type, N), R = (384u << 20) / rb;
    uint8_t *w = malloc(R * rb);
    float *x = malloc(N * sizeof(float)), *y = malloc(R * sizeof(float));
    if (!w || !x || !y) {
        MEASURE("matvec from memory: skipped, no memory for 384 MiB");
    } else {
        random_row(ti, w, (uint64_t)N * R);
        fill_x(x, N);
        double best = 1e9;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now_s();
            matvec_rows(ti->type, w, rb, x, N, y, 0, R);
            best = fmin(best, now_s() - t0);
        }
        MEASURE("matvec Q4_0   %dx%zu (%.0f MB, from memory) single thread: %.1f GB/s of weights",
                N, R, R * rb / 1e6, (double)(R * rb) / best / 1e9);
    }
    free(w);
    free(x);
    free(y);
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

    test_dots();
    test_exact();
    test_rows();
    test_batches();
    test_split_invariance();
    measure_speed();
    measure_memory_speed();
    return test_main_result("test_matvec");
}
