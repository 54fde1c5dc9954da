/*
 * test_matvec_cuda: the CUDA matvec kernels (kernels/cuda/matvec.h) against
 * their CPU twin (kernels/cpu/matvec.h) on fresh random data.
 *
 * For every supported type, weights are random f32 rows quantized with
 * quant_quantize_row (random blocks with finite scales for IQ4_NL, IQ4_XS,
 * Q2_K and Q3_K, which quant.c does not quantize; their decoders are also
 * checked on the host, tests/test_mv_types.cpp), uploaded as stored (aligned rows, rows at a 2-byte
 * offset with padded strides, short rows, long rows, and one case in mapped
 * pinned host memory). Every output buffer is poisoned with NaN bits first;
 * each result must be within 1e-5 of sum |w_i x_i| of the exact dot
 * product of the dequantized row (matvec_dot_ref: the kernels keep f32
 * activations; where one activation row meets Q4_0, Q8_0 or (unless LAMINA_CUDA_MVQ_K=0) Q4_K,
 * Q5_K or Q6_K weights
 * on the int8 products, mvq.cu, the exact dot of the activations rounded
 * as they round them, per block of 32) and within 1e-2 of the CPU twin's result (matvec_rows,
 * matvec_rows_batch, which may round the activations to int8 as llama.cpp
 * does; the largest difference is printed), and every element the kernel
 * must not write (stride padding, rows of pairs whose expert is NULL) must
 * still hold the poison. Checked: cuda_matvec, cuda_matmul for S = 1, 3,
 * 17, 64 (aligned and unaligned activation rows), cuda_sgemm_nt's tiles 32
 * and 64 (the same bytes), tile 32 split in four (the same bytes twice) and
 * its choice (one of those) on F32 products with edges in every dimension,
 * each against the CPU, cuda_matvec_experts with
 * 8 experts (two NULL, one misaligned, one in mapped host memory), top_k 2,
 * x_div 2 and 1. Then the decode kernel is timed in CUDA graphs on Q4_0
 * and Q8_0 matrices of 2048x8192, 8192x2048 and 151936x2048, Q4_K and Q6_K
 * on one shape each (rotating over copies that together exceed the L2
 * cache; median of 20, GB/s of weight bytes; sampled rows checked), routed
 * experts of a decode step, a 64-row matmul against 64 matvecs, and a
 * prefill router's F32 product (512 x 2048, S 512 and 4096) in each form.
 * Programmatic dependent launch (sm_90+): a chain of 32 small MoE-like
 * layers (norm, a Q4_0 product on the int8 path, one on the f32 path, an
 * F32 router, top-k, Q4_0 experts picked by it, combine) run as a graph with
 * LAMINA_CUDA_PDL=0, as a graph with PDL and launched one by one with PDL:
 * the three final rows must be equal bit for bit (a kernel that read before
 * its wait would show); both graphs are timed. The SiLU-gated down
 * products (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) are byte for byte silu_mul then
 * the product; the expert products' tiles by one bulk copy (tma) byte for
 * byte the lanes' own loads (the same types; experts 2-byte misaligned
 * too).
 */
#include "kernels/cuda/caps.h"
#include "kernels/cuda/matvec.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cuda/mvq.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sgemm.h"
#include "model/quant.h"
#include "tests/check.h"
#include "tests/gpu/gpu_check.h"
#include "tests/gpu/xq_check.h"

#define TOL 1e-5      /* allowed error against the exact dot, relative to sum |w_i x_i| */
#define TWIN_TOL 1e-2 /* against the CPU twin, which may round activations to int8 */
#define POISON 0xFFFFFFFFu /* NaN bits written over outputs before each run */

static const uint32_t types[] = {QUANT_TYPE_F32,  QUANT_TYPE_F16,    QUANT_TYPE_BF16,
                                 QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_0,   QUANT_TYPE_Q4_K,
                                 QUANT_TYPE_Q5_K, QUANT_TYPE_Q6_K,   QUANT_TYPE_Q4_1,
                                 QUANT_TYPE_Q5_0, QUANT_TYPE_Q5_1,   QUANT_TYPE_IQ4_NL,
                                 QUANT_TYPE_IQ4_XS, QUANT_TYPE_Q2_K, QUANT_TYPE_Q3_K};
#define N_TYPES (sizeof(types) / sizeof(types[0]))

/* A weight matrix in host memory as stored: row r at w + r * row_bytes. */
struct mat {
    uint32_t type;
    uint64_t rows, n;
    size_t row_bytes, bytes; /* bytes: (rows - 1) * row_bytes + row size */
    uint8_t *w;
};

/* A row of random blocks of a type quant.c does not quantize (IQ4_NL, IQ4_XS, Q2_K, Q3_K):
 * random bytes with finite half-precision scales of 0.02 to 0.2 (Q2_K's minimum too).
 * Returns false for the other types. */
static bool random_blocks(uint32_t type, uint8_t *w, uint64_t n, struct rng *r)
{
    size_t at[2] = {0, 0}, n_at = 1;
    switch (type) {
    case QUANT_TYPE_IQ4_NL:
    case QUANT_TYPE_IQ4_XS: break;
    case QUANT_TYPE_Q2_K: at[0] = 80, at[1] = 82, n_at = 2; break;
    case QUANT_TYPE_Q3_K: at[0] = 108; break;
    default: return false;
    }
    const size_t bb = quant_block_bytes(type), bytes = quant_row_size(type, n);
    for (size_t i = 0; i < bytes; i++)
        w[i] = (uint8_t)rng_next(r);
    for (size_t b = 0; b + bb <= bytes; b += bb)
        for (size_t k = 0; k < n_at; k++) {
            uint16_t d = quant_f32_to_f16(0.02f + 0.18f * fabsf(rng_float(r)));
            memcpy(w + b + at[k], &d, 2);
        }
    return true;
}

/* Random rows (varied sub-block magnitudes and offsets, so K-quant scales
 * and mins differ) quantized as stored, or random blocks (random_blocks),
 * with pad bytes of garbage. */
static struct mat mat_make(uint32_t type, uint64_t rows, uint64_t n, size_t pad, struct rng *r)
{
    struct mat m = {type, rows, n, quant_row_size(type, n) + pad, 0, NULL};
    m.bytes = rows ? (rows - 1) * m.row_bytes + quant_row_size(type, n) : 0;
    m.w = xmalloc(m.bytes);
    memset(m.w, 0xA5, m.bytes);
    float *f = xmalloc(n * sizeof(float));
    for (uint64_t i = 0; i < rows; i++) {
        if (random_blocks(type, m.w + i * m.row_bytes, n, r))
            continue;
        float shift = 0.3f * rng_float(r);
        for (uint64_t k = 0; k < n; k++)
            f[k] = rng_float(r) * (1.0f + 3.0f * (float)((k / 32) % 3 == 0)) + shift;
        int rc = quant_quantize_row(type, f, m.w + i * m.row_bytes, n);
        CHECK(rc == 0, "quantize %s rc %d", quant_type_name(type), rc);
    }
    free(f);
    return m;
}

/* Device copy of m at byte offset off of a fresh allocation (*base). */
static const void *mat_upload(const struct mat *m, size_t off, void **base)
{
    CU(cudaMalloc(base, m->bytes + off + 16));
    CU(cudaMemcpy((char *)*base + off, m->w, m->bytes, cudaMemcpyHostToDevice));
    return (const char *)*base + off;
}

/* sum |w_i x_i| of row r of m. */
static double abs_dot(const struct mat *m, uint64_t r, const float *x)
{
    float *w = xmalloc(m->n * sizeof(float));
    int rc = quant_dequantize_row(m->type, m->w + r * m->row_bytes, w, m->n);
    CHECK(rc == 0, "dequantize rc %d", rc);
    double s = 0.0;
    for (uint64_t i = 0; i < m->n; i++)
        s += fabs((double)w[i] * (double)x[i]);
    free(w);
    return s;
}

static bool is_poison(float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof(b));
    return b == POISON;
}

/* Largest differences seen from the CPU twin, over the whole test. */
struct twin_stats {
    double worst;
};

/* Checks got[r] for r < m->rows (activation x) against the exact dot of
 * the dequantized row (matvec_dot_ref, within TOL) and against the CPU
 * twin's twin[r] (within TWIN_TOL); returns the largest error relative to
 * sum |w x| against the exact dot. */
/* True when the GPU computes S activation rows of this type and length
 * with int8 activations (kernels/cuda/mvq.cu: one row of Q4_0, Q8_0, or
 * Q4_K, Q5_K or Q6_K of whole super-blocks): then the exact dot is that of the
 * rounded activations (matvec_dot_ref_xq; dot_ref_xq32 for the K types),
 * held to the same TOL. */
static bool gpu_rounds_x(uint32_t type, uint64_t n, uint64_t rows, uint32_t S)
{
    const char *env = getenv("LAMINA_CUDA_MVQ");
    const bool t = type == QUANT_TYPE_Q4_0 || type == QUANT_TYPE_Q8_0 ||
                   ((type == QUANT_TYPE_Q4_K || type == QUANT_TYPE_Q5_K ||
                     type == QUANT_TYPE_Q6_K) &&
                    n % 256 == 0 &&
                    cuda_mvq_k_on());
    return S == 1 && t && n % 32 == 0 && n <= 16384 && (n <= 2048 || rows >= 8 * n) &&
           !(env && env[0] == '0');
}

/* The exact dot of a row with x rounded as the GPU's int8 products round it,
 * whatever the weights' block: per block of 32 (xq_check.h's xq_round; the
 * CPU rounds a K-type's activations per 256, matvec_dot_ref_xq). */
static double dot_ref_xq32(uint32_t type, const uint8_t *row, const float *x, uint64_t n)
{
    float *w = xmalloc(n * sizeof(float));
    uint8_t *xq = xmalloc(n + 8 * (n / 32));
    CHECK(quant_dequantize_row(type, row, w, n) == 0, "dequantize %s", quant_type_name(type));
    xq_round(x, xq, (uint32_t)n);
    const float *d = (const float *)(xq + n);
    double sum = 0.0;
    for (uint64_t i = 0; i < n; i++)
        sum += (double)w[i] * ((double)(int8_t)xq[i] * (double)d[i / 32]);
    free(w);
    free(xq);
    return sum;
}

static double compare_rows(const char *what, const struct mat *m, const float *x, const float *got,
                           const float *twin, uint32_t S, struct twin_stats *ts)
{
    double worst = 0.0;
    int bad = 0;
    const bool xq = gpu_rounds_x(m->type, m->n, m->rows, S);
    for (uint64_t r = 0; r < m->rows; r++) {
        const uint8_t *row = m->w + r * m->row_bytes;
        double scale = abs_dot(m, r, x) + 1e-30;
        double exact = !xq ? matvec_dot_ref(m->type, row, x, m->n)
                       : quant_block_elems(m->type) == 256 ? dot_ref_xq32(m->type, row, x, m->n)
                                                           : matvec_dot_ref_xq(m->type, row, x, m->n);
        double err = fabs((double)got[r] - exact) / scale;
        double terr = fabs((double)got[r] - (double)twin[r]) / scale;
        if (!(err <= TOL && terr <= TWIN_TOL) && bad++ < 3)
            CHECK(err <= TOL && terr <= TWIN_TOL,
                  "%s %s %llux%llu row %llu: gpu %.9g exact %.9g cpu twin %.9g (rel %.3g, %.3g)",
                  what, quant_type_name(m->type), (unsigned long long)m->rows,
                  (unsigned long long)m->n, (unsigned long long)r, got[r], exact, twin[r], err,
                  terr);
        if (err > worst || err != err)
            worst = err != err ? INFINITY : err;
        if (terr > ts->worst || terr != terr)
            ts->worst = terr != terr ? INFINITY : terr;
    }
    return worst;
}

/* ---- cuda_matvec ----------------------------------------------------------- */

/* One matvec of m placed at byte offset off of its allocation (or in mapped
 * pinned host memory); returns the worst relative error. */
static double run_matvec(const struct mat *m, size_t off, bool mapped, struct rng *r,
                         struct twin_stats *ts)
{
    float *x = rand_floats(m->n, r), *ref = xmalloc(m->rows * sizeof(float));
    float *got = xmalloc((m->rows + 8) * sizeof(float));
    matvec_rows(m->type, m->w, m->row_bytes, x, m->n, ref, 0, m->rows);
    void *base = NULL, *h_base = NULL;
    const void *d_w;
    if (mapped) {
        CU(cudaHostAlloc(&h_base, m->bytes + off, cudaHostAllocMapped));
        memcpy((char *)h_base + off, m->w, m->bytes);
        void *dp;
        CU(cudaHostGetDevicePointer(&dp, h_base, 0));
        d_w = (const char *)dp + off;
    } else {
        d_w = mat_upload(m, off, &base);
    }
    float *d_x = dev_floats(x, m->n), *d_y;
    CU(cudaMalloc((void **)&d_y, (m->rows + 8) * sizeof(float)));
    CU(cudaMemset(d_y, 0xFF, (m->rows + 8) * sizeof(float)));
    int rc = cuda_matvec(m->type, d_w, m->row_bytes, m->rows, m->n, d_x, d_y, 0);
    CHECK(rc == 0, "cuda_matvec rc %d", rc);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, d_y, (m->rows + 8) * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = compare_rows(mapped ? "matvec (mapped host)" : "matvec", m, x, got, ref, 1,
                                ts);
    for (int i = 0; i < 8; i++)
        CHECK(is_poison(got[m->rows + i]), "matvec wrote past row %llu",
              (unsigned long long)m->rows);
    if (mapped)
        CU(cudaFreeHost(h_base));
    else
        CU(cudaFree(base));
    CU(cudaFree(d_x));
    CU(cudaFree(d_y));
    free(x);
    free(ref);
    free(got);
    return worst;
}

/* Row lengths per type for the shapes: [0] ordinary, [1] short, [2] long,
 * [3] one step. Plain types get lengths that end inside a lane's 8. */
static uint64_t shape_n(uint32_t type, int which)
{
    static const uint64_t k_n[] = {2304, 256, 8192, 512};
    static const uint64_t b32_n[] = {2304, 96, 8192, 512};
    static const uint64_t plain_n[] = {1000, 37, 8192, 515};
    uint32_t be = quant_block_elems(type);
    return be == 256 ? k_n[which] : be == 32 ? b32_n[which] : plain_n[which];
}

static void test_matvec(struct rng *r, struct twin_stats *ts)
{
    static const uint64_t rows[] = {67, 13, 5, 300};
    static const size_t pads[] = {0, 6, 0, 2};
    static const size_t offs[] = {0, 2, 16, 6};
    for (size_t t = 0; t < N_TYPES; t++) {
        double worst = 0.0;
        for (int s = 0; s < 4; s++) {
            struct mat m = mat_make(types[t], rows[s], shape_n(types[t], s), pads[s], r);
            double e = run_matvec(&m, offs[s], false, r, ts);
            worst = e > worst ? e : worst;
            free(m.w);
        }
        MEASURE("matvec %-4s max rel error %.3g (4 shapes)", quant_type_name(types[t]), worst);
    }
    struct mat m = mat_make(QUANT_TYPE_Q4_K, 70, 2048, 0, r);
    double e = run_matvec(&m, 0, true, r, ts);
    free(m.w);
    struct mat m2 = mat_make(QUANT_TYPE_Q4_0, 33, 96 * 3, 2, r);
    double e2 = run_matvec(&m2, 2, true, r, ts);
    free(m2.w);
    MEASURE("matvec from mapped pinned host memory: Q4_K rel error %.3g, Q4_0 (2-byte offset) "
            "%.3g",
            e, e2);
}

/* ---- cuda_matmul ------------------------------------------------------------- */

static double run_matmul(const struct mat *m, uint32_t S, size_t ldx, struct rng *r,
                         struct twin_stats *ts)
{
    const size_t ldy = m->rows + 5, ny = (S - 1) * ldy + m->rows + 8;
    float *X = rand_floats((S - 1) * ldx + m->n, r);
    float *ref = xmalloc(ny * sizeof(float)), *got = xmalloc(ny * sizeof(float));
    matvec_rows_batch(m->type, m->w, m->row_bytes, X, ldx, S, m->n, ref, ldy, 0, m->rows);
    void *base;
    const void *d_w = mat_upload(m, 0, &base);
    float *d_X = dev_floats(X, (S - 1) * ldx + m->n), *d_Y;
    CU(cudaMalloc((void **)&d_Y, ny * sizeof(float)));
    CU(cudaMemset(d_Y, 0xFF, ny * sizeof(float)));
    int rc = cuda_matmul(m->type, d_w, m->row_bytes, m->rows, m->n, d_X, ldx, S, d_Y, ldy, 0);
    CHECK(rc == 0, "cuda_matmul rc %d", rc);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, d_Y, ny * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (uint32_t s = 0; s < S; s++) {
        char what[64];
        snprintf(what, sizeof(what), "matmul S=%u s=%u", S, s);
        double e = compare_rows(what, m, X + s * ldx, got + s * ldy, ref + s * ldy, S, ts);
        worst = e > worst ? e : worst;
        for (size_t i = m->rows; i < (s + 1 < S ? ldy : m->rows + 8); i++)
            CHECK(is_poison(got[s * ldy + i]), "matmul S=%u wrote padding %zu of row %u", S, i, s);
    }
    CU(cudaFree(base));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    free(X);
    free(ref);
    free(got);
    return worst;
}

static void test_matmul(struct rng *r, struct twin_stats *ts)
{
    static const uint32_t Ss[] = {1, 3, 17, 64};
    for (size_t t = 0; t < N_TYPES; t++) {
        double worst = 0.0;
        for (int which = 0; which < 2; which++) {
            struct mat m = mat_make(types[t], which ? 13 : 67, shape_n(types[t], which), 0, r);
            for (size_t i = 0; i < sizeof(Ss) / sizeof(Ss[0]); i++) {
                /* odd strides make activation rows unaligned for 16-byte loads */
                size_t ldx = m.n + (i % 2 ? 3 : 4);
                double e = run_matmul(&m, Ss[i], ldx, r, ts);
                worst = e > worst ? e : worst;
            }
            free(m.w);
        }
        MEASURE("matmul %-4s S=1,3,17,64 max rel error %.3g", quant_type_name(types[t]), worst);
    }
}

/* ---- cuda_sgemm_nt's forms ---------------------------------------------------------- */

/* One F32 product through tile 32, tile 64, tile 32 split in four (twice) and the
 * launcher's choice: tiles 32 and 64 the same bytes (each output one chain of FMAs in k
 * order whatever the tile), the split's two runs the same bytes, the choice the bytes of
 * one of them, every form within TOL of the exact dot with the padding untouched. */
static void sgemm_case(uint64_t rows, uint64_t n, uint32_t S, size_t ldx, struct rng *r,
                       struct twin_stats *ts)
{
    struct mat m = mat_make(QUANT_TYPE_F32, rows, n, 0, r);
    const size_t ldy = rows + 3, ny = (S - 1) * ldy + rows + 8;
    float *X = rand_floats((S - 1) * ldx + n, r), *ref = xmalloc(ny * sizeof(float));
    enum { FORMS = 5 };
    static const uint32_t tiles[FORMS] = {32, 64, 32, 32, 0}, splits[FORMS] = {1, 1, 4, 4, 0};
    float *got[FORMS];
    matvec_rows_batch(m.type, m.w, m.row_bytes, X, ldx, S, n, ref, ldy, 0, rows);
    void *base;
    const float *d_w = mat_upload(&m, 0, &base);
    float *d_X = dev_floats(X, (S - 1) * ldx + n), *d_Y;
    CU(cudaMalloc((void **)&d_Y, ny * sizeof(float)));
    for (int t = 0; t < FORMS; t++) {
        got[t] = xmalloc(ny * sizeof(float));
        CU(cudaMemset(d_Y, 0xFF, ny * sizeof(float)));
        const int rc = cuda_sgemm_nt_form(tiles[t], splits[t], d_w, m.row_bytes, rows, n, d_X,
                                          ldx, S, d_Y, ldy, 0);
        CHECK(rc == 0, "sgemm tile %u split %u rc %d", tiles[t], splits[t], rc);
        CU(cudaDeviceSynchronize());
        CU(cudaMemcpy(got[t], d_Y, ny * sizeof(float), cudaMemcpyDeviceToHost));
    }
    CHECK(!memcmp(got[0], got[1], ny * sizeof(float)),
          "sgemm %llux%llu S=%u: tile 64 differs from tile 32", (unsigned long long)rows,
          (unsigned long long)n, S);
    CHECK(!memcmp(got[2], got[3], ny * sizeof(float)),
          "sgemm %llux%llu S=%u: two runs of the split differ", (unsigned long long)rows,
          (unsigned long long)n, S);
    CHECK(!memcmp(got[0], got[4], ny * sizeof(float)) ||
              !memcmp(got[2], got[4], ny * sizeof(float)),
          "sgemm %llux%llu S=%u: the launcher's choice is neither form's bytes",
          (unsigned long long)rows, (unsigned long long)n, S);
    for (int t = 0; t < FORMS; t += 2)
        for (uint32_t s = 0; s < S; s++) {
            char what[64];
            snprintf(what, sizeof(what), "sgemm split %u S=%u s=%u", splits[t], S, s);
            compare_rows(what, &m, X + s * ldx, got[t] + s * ldy, ref + s * ldy, S, ts);
            for (size_t i = rows; i < (s + 1 < S ? ldy : rows + 8); i++)
                CHECK(is_poison(got[t][s * ldy + i]),
                      "sgemm tile %u split %u S=%u wrote padding %zu of row %u", tiles[t],
                      splits[t], S, i, s);
        }
    for (int t = 0; t < FORMS; t++)
        free(got[t]);
    CU(cudaFree(base));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    free(X);
    free(ref);
    free(m.w);
}

static void test_sgemm(struct rng *r, struct twin_stats *ts)
{
    /* edges in every dimension, unaligned rows (scalar loads), a router's shape */
    sgemm_case(67, 1000, 17, 1000, r, ts);
    sgemm_case(130, 37, 65, 41, r, ts);
    sgemm_case(512, 2048, 200, 2048, r, ts);
    sgemm_case(96, 515, 33, 518, r, ts);
    CHECK(cuda_sgemm_nt_form(48, 1, (const float *)16, 64, 4, 16, (const float *)16, 16, 2,
                             (float *)16, 4, 0) == -EINVAL,
          "sgemm tile 48: not -EINVAL");
    CHECK(cuda_sgemm_nt_form(64, 4, (const float *)16, 64, 4, 16, (const float *)16, 16, 2,
                             (float *)16, 4, 0) == -EINVAL,
          "sgemm tile 64 split 4: not -EINVAL");
    CHECK(cuda_sgemm_nt_form(32, 3, (const float *)16, 64, 4, 16, (const float *)16, 16, 2,
                             (float *)16, 4, 0) == -EINVAL,
          "sgemm split 3: not -EINVAL");
}

/* ---- cuda_matvec_experts ----------------------------------------------------------- */

#define N_EXPERTS 8
#define TOP_K 2
#define N_TOK 5

/* Experts 2 and 5 are NULL (they run elsewhere), expert 3 sits at a 2-byte
 * offset, expert 6 in mapped pinned host memory. */
static double run_experts(uint32_t type, uint32_t x_div, struct rng *r, struct twin_stats *ts)
{
    const uint64_t rows = 40, n = shape_n(type, 3);
    const uint32_t n_pairs = N_TOK * TOP_K, n_xrows = n_pairs / x_div;
    const size_t ldx = n + 4, ldy = rows + 3, ny = (size_t)n_pairs * ldy;
    struct mat m[N_EXPERTS];
    void *bases[N_EXPERTS] = {0}, *h_base = NULL;
    const void *addr[N_EXPERTS];
    for (int e = 0; e < N_EXPERTS; e++) {
        m[e] = mat_make(type, rows, n, 0, r);
        if (e == 2 || e == 5) {
            addr[e] = NULL;
        } else if (e == 6) {
            void *dp;
            CU(cudaHostAlloc(&h_base, m[e].bytes, cudaHostAllocMapped));
            memcpy(h_base, m[e].w, m[e].bytes);
            CU(cudaHostGetDevicePointer(&dp, h_base, 0));
            addr[e] = dp;
        } else {
            addr[e] = mat_upload(&m[e], e == 3 ? 2 : 0, &bases[e]);
        }
    }
    int32_t ids[N_TOK * TOP_K];
    for (uint32_t p = 0; p < n_pairs; p++)
        ids[p] = (int32_t)(rng_next(r) % N_EXPERTS);
    ids[1] = 2, ids[4] = 5, ids[6] = 3, ids[7] = 6, ids[8] = 0;
    float *X = rand_floats((n_xrows - 1) * ldx + n, r), *got = xmalloc(ny * sizeof(float));
    float *d_X = dev_floats(X, (n_xrows - 1) * ldx + n), *d_Y;
    const void **d_addr;
    int32_t *d_ids;
    CU(cudaMalloc((void **)&d_addr, sizeof(addr)));
    CU(cudaMemcpy(d_addr, addr, sizeof(addr), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&d_ids, sizeof(ids)));
    CU(cudaMemcpy(d_ids, ids, sizeof(ids), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&d_Y, ny * sizeof(float)));
    CU(cudaMemset(d_Y, 0xFF, ny * sizeof(float)));
    int rc = cuda_matvec_experts(type, (const void *const *)d_addr, m[0].row_bytes, rows, n, d_ids,
                                 n_pairs, d_X, ldx, x_div, d_Y, ldy, 0);
    CHECK(rc == 0, "cuda_matvec_experts rc %d", rc);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, d_Y, ny * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0.0;
    float *ref = xmalloc(rows * sizeof(float));
    for (uint32_t p = 0; p < n_pairs; p++) {
        const int e = ids[p];
        const float *x = X + (p / x_div) * ldx;
        if (addr[e]) {
            matvec_rows(type, m[e].w, m[e].row_bytes, x, n, ref, 0, rows);
            double err = compare_rows("experts", &m[e], x, got + p * ldy, ref, 1, ts);
            worst = err > worst ? err : worst;
        }
        for (size_t i = addr[e] ? rows : 0; i < ldy; i++)
            CHECK(is_poison(got[p * ldy + i]), "experts x_div %u: pair %u (expert %d) element %zu "
                  "was written", x_div, p, e, i);
    }
    for (int e = 0; e < N_EXPERTS; e++) {
        if (bases[e])
            CU(cudaFree(bases[e]));
        free(m[e].w);
    }
    CU(cudaFreeHost(h_base));
    CU(cudaFree(d_addr));
    CU(cudaFree(d_ids));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    free(X);
    free(got);
    free(ref);
    return worst;
}

static void test_experts(struct rng *r, struct twin_stats *ts)
{
    for (size_t t = 0; t < N_TYPES; t++) {
        double e2 = run_experts(types[t], TOP_K, r, ts), e1 = run_experts(types[t], 1, r, ts);
        MEASURE("experts %-4s max rel error %.3g (x_div %d), %.3g (x_div 1)",
                quant_type_name(types[t]), e2, TOP_K, e1);
    }
}

/* ---- bad arguments ------------------------------------------------------------- */

static void test_rejects(void)
{
    float *d;
    CU(cudaMalloc((void **)&d, 4096));
    log_set_level(LOG_LEVEL_ERROR);
    CHECK(cuda_matvec(QUANT_TYPE_IQ2_XXS, d, 66, 1, 256, d, d, 0) == -EINVAL,
          "IQ2_XXS accepted");
    CHECK(cuda_matvec(QUANT_TYPE_Q4_0, d, 18, 1, 33, d, d, 0) == -EINVAL, "n=33 accepted");
    CHECK(cuda_matvec(QUANT_TYPE_Q4_0, d, 17, 1, 32, d, d, 0) == -EINVAL, "short rows accepted");
    CHECK(cuda_matvec(QUANT_TYPE_Q4_0, (char *)d + 1, 18, 1, 32, d, d, 0) == -EINVAL,
          "odd address accepted");
    CHECK(cuda_matmul(QUANT_TYPE_F32, d, 128, 4, 32, d, 31, 2, d, 4, 0) == -EINVAL,
          "ldx < n accepted");
    CHECK(cuda_matvec_experts(QUANT_TYPE_Q8_0, (const void *const *)d, 34, 2, 32, (int32_t *)d,
                              1, d, 32, 0, d, 2, 0) == -EINVAL,
          "x_div 0 accepted");
    CHECK(cuda_matvec_supports(QUANT_TYPE_Q6_K) && cuda_matvec_supports(QUANT_TYPE_Q3_K) &&
              cuda_matvec_supports(QUANT_TYPE_IQ4_XS) && !cuda_matvec_supports(QUANT_TYPE_IQ2_XXS),
          "supports");
    log_set_level(LOG_LEVEL_INFO);
    CU(cudaFree(d));
}

/* ---- timing ---------------------------------------------------------------------- */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Random blocks with sane fp16 scales (speed does not depend on values). */
static void fill_random_blocks(uint32_t type, uint8_t *w, size_t bytes, struct rng *r)
{
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v = rng_next(r);
        memcpy(w + i, &v, 8);
    }
    /* where each block keeps its fp16 scales */
    size_t at[2] = {0, 0}, n_at = 1;
    if (type == QUANT_TYPE_Q4_K || type == QUANT_TYPE_Q5_K)
        at[1] = 2, n_at = 2;
    if (type == QUANT_TYPE_Q6_K)
        at[0] = 208;
    size_t bb = quant_block_bytes(type);
    for (size_t b = 0; b + bb <= bytes; b += bb)
        for (size_t k = 0; k < n_at; k++) {
            uint16_t d = quant_f32_to_f16(0.001f + 0.01f * fabsf(rng_float(r)));
            memcpy(w + b + at[k], &d, 2);
        }
}

/* One timed launch: call i of a sequence on stream s. */
typedef int (*launch_fn)(const void *ctx, int i, cudaStream_t s);

/* Median seconds per launch: `reps` launches captured in a CUDA graph (as
 * a decode step runs them, without host launch gaps), the graph replayed
 * 20 times after a warm-up. */
static double time_graph(launch_fn fn, const void *ctx, int reps)
{
    cudaStream_t s;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaEvent_t e0, e1;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < reps; i++)
        CHECK(fn(ctx, i, s) == 0, "launch %d failed", i);
    CU(cudaStreamEndCapture(s, &graph));
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float ms[20];
    for (int k = -2; k < 20; k++) {
        CU(cudaEventRecord(e0, s));
        CU(cudaGraphLaunch(exec, s));
        CU(cudaEventRecord(e1, s));
        CU(cudaEventSynchronize(e1));
        if (k >= 0)
            CU(cudaEventElapsedTime(&ms[k], e0, e1));
    }
    qsort(ms, 20, sizeof(float), cmp_float);
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    CU(cudaGraphExecDestroy(exec));
    CU(cudaGraphDestroy(graph));
    CU(cudaStreamDestroy(s));
    return (ms[9] + ms[10]) * 0.5e-3 / reps;
}

/* cuda_matvec over rotating copies of one matrix. */
struct mv_ctx {
    uint32_t type;
    const uint8_t *d_w;
    size_t stride, rb;
    int copies;
    uint64_t rows, n;
    const float *d_x;
    float *d_y;
};

static int mv_launch(const void *ctx, int i, cudaStream_t s)
{
    const struct mv_ctx *c = ctx;
    return cuda_matvec(c->type, c->d_w + (size_t)(i % c->copies) * c->stride, c->rb, c->rows,
                       c->n, c->d_x, c->d_y, s);
}

static void bench_one(uint32_t type, uint64_t rows, uint64_t n, struct rng *r)
{
    const size_t rb = quant_row_size(type, n), bytes = rows * rb;
    const size_t stride = (bytes + 255) / 256 * 256;
    const int copies = (int)((256u << 20) / bytes + 1);
    uint8_t *h = xmalloc(bytes), *d_w;
    fill_random_blocks(type, h, bytes, r);
    CU(cudaMalloc((void **)&d_w, stride * copies));
    CU(cudaMemcpy(d_w, h, bytes, cudaMemcpyHostToDevice));
    for (int c = 1; c < copies; c++)
        CU(cudaMemcpy(d_w + c * stride, d_w, bytes, cudaMemcpyDeviceToDevice));
    float *x = rand_floats(n, r), *d_x = dev_floats(x, n), *d_y;
    float *got = xmalloc(rows * sizeof(float));
    CU(cudaMalloc((void **)&d_y, rows * sizeof(float)));
    CU(cudaMemset(d_y, 0xFF, rows * sizeof(float)));
    /* correctness on sampled rows of the big shape (the last copy) */
    int rc = cuda_matvec(type, d_w + (copies - 1) * stride, rb, rows, n, d_x, d_y, 0);
    CHECK(rc == 0, "bench matvec rc %d", rc);
    CU(cudaMemcpy(got, d_y, rows * sizeof(float), cudaMemcpyDeviceToHost));
    struct mat m = {type, 1, n, rb, rb, NULL};
    struct twin_stats ts = {0.0};
    for (int k = 0; k < 66; k++) {
        uint64_t row = k == 0 ? 0 : k == 1 ? rows - 1 : rng_next(r) % rows;
        float twin;
        matvec_rows(type, h + row * rb, rb, x, n, &twin, 0, 1);
        m.w = h + row * rb;
        char what[64];
        snprintf(what, sizeof(what), "bench row %llu", (unsigned long long)row);
        compare_rows(what, &m, x, &got[row], &twin, 1, &ts);
    }
    struct mv_ctx c = {type, d_w, stride, rb, copies, rows, n, d_x, d_y};
    double sec = time_graph(mv_launch, &c, copies < 16 ? (16 + copies - 1) / copies * copies
                                                       : copies);
    MEASURE("decode %-4s %6llu x %-5llu: %7.2f us, %6.0f GB/s (%.0f%% of 4.8 TB/s), %d copies",
            quant_type_name(type), (unsigned long long)rows, (unsigned long long)n, sec * 1e6,
            bytes / sec * 1e-9, bytes / sec / 4.8e12 * 100.0, copies);
    CU(cudaFree(d_w));
    CU(cudaFree(d_x));
    CU(cudaFree(d_y));
    free(h);
    free(x);
    free(got);
}

/* cuda_matvec_experts, launch i taking id set i. */
struct ex_ctx {
    uint32_t type;
    const void *const *d_addr;
    size_t rb;
    uint64_t rows, n;
    const int32_t *d_ids;
    uint32_t x_div;
    const float *d_X;
    float *d_Y;
};

static int ex_launch(const void *ctx, int i, cudaStream_t s)
{
    const struct ex_ctx *c = ctx;
    return cuda_matvec_experts(c->type, c->d_addr, c->rb, c->rows, c->n, c->d_ids + i * 8, 8,
                               c->d_X, c->n, c->x_div, c->d_Y, c->rows, s);
}

/* Routed experts of one decode step: 8 pairs over 128 experts of rows x n
 * (x_div 8: gate/up of one token; 1: down), a fresh expert choice each
 * launch so the weights come from memory, not L2. */
static void bench_experts(uint32_t type, uint64_t rows, uint64_t n, uint32_t x_div,
                          struct rng *r)
{
    enum { E = 128, PAIRS = 8, SETS = 32 };
    const size_t rb = quant_row_size(type, n), bytes = rows * rb;
    const size_t stride = (bytes + 255) / 256 * 256;
    uint8_t *h = xmalloc(bytes), *d_w;
    fill_random_blocks(type, h, bytes, r);
    CU(cudaMalloc((void **)&d_w, stride * E));
    CU(cudaMemcpy(d_w, h, bytes, cudaMemcpyHostToDevice));
    for (int e = 1; e < E; e++)
        CU(cudaMemcpy(d_w + e * stride, d_w, bytes, cudaMemcpyDeviceToDevice));
    const void *addr[E];
    for (int e = 0; e < E; e++)
        addr[e] = d_w + e * stride;
    int32_t ids[SETS][PAIRS];
    for (int k = 0; k < SETS; k++)
        for (int p = 0; p < PAIRS; p++)
            ids[k][p] = (int32_t)((k * PAIRS + p) * 37 % E);
    float *X = rand_floats(PAIRS * n, r), *d_X = dev_floats(X, PAIRS * n), *d_Y;
    const void **d_addr;
    int32_t *d_ids;
    CU(cudaMalloc((void **)&d_addr, sizeof(addr)));
    CU(cudaMemcpy(d_addr, addr, sizeof(addr), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&d_ids, sizeof(ids)));
    CU(cudaMemcpy(d_ids, ids, sizeof(ids), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&d_Y, PAIRS * rows * sizeof(float)));
    struct ex_ctx c = {type, (const void *const *)d_addr, rb, rows, n, d_ids, x_div, d_X, d_Y};
    double sec = time_graph(ex_launch, &c, SETS);
    MEASURE("experts %-4s 8 of 128 x (%llu x %llu), x_div %u: %6.2f us, %5.0f GB/s",
            quant_type_name(type), (unsigned long long)rows, (unsigned long long)n, x_div,
            sec * 1e6, PAIRS * bytes / sec * 1e-9);
    CU(cudaFree(d_w));
    CU(cudaFree(d_addr));
    CU(cudaFree(d_ids));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    free(h);
    free(X);
}

/* cuda_matmul of S rows (i == 0), or the S rows one cuda_matvec each
 * (launch i does row i). */
struct mm_ctx {
    const uint8_t *d_w;
    size_t rb;
    uint64_t rows, n;
    uint32_t S;
    const float *d_X;
    float *d_Y;
};

static int mm_launch(const void *ctx, int i, cudaStream_t s)
{
    const struct mm_ctx *c = ctx;
    (void)i;
    return cuda_matmul(QUANT_TYPE_Q4_0, c->d_w, c->rb, c->rows, c->n, c->d_X, c->n, c->S,
                       c->d_Y, c->rows, s);
}

static int mm_naive_launch(const void *ctx, int i, cudaStream_t s)
{
    const struct mm_ctx *c = ctx;
    return cuda_matvec(QUANT_TYPE_Q4_0, c->d_w, c->rb, c->rows, c->n, c->d_X + i * c->n,
                       c->d_Y + i * c->rows, s);
}

/* cuda_sgemm_nt_form on one shape (ctx), for time_graph. */
struct sg_ctx {
    uint32_t tile, split, S;
    uint64_t rows, n;
    const float *d_w, *d_X;
    float *d_Y;
};

static int sg_launch(const void *ctx, int i, cudaStream_t s)
{
    const struct sg_ctx *c = ctx;
    (void)i;
    return cuda_sgemm_nt_form(c->tile, c->split, c->d_w, c->n * 4, c->rows, c->n, c->d_X, c->n,
                              c->S, c->d_Y, c->rows, s);
}

/* A prefill router: 512 x 2048 F32 over S rows, each tile. */
static void bench_sgemm(struct rng *r)
{
    const uint64_t rows = 512, n = 2048;
    static const uint32_t Ss[] = {512, 4096};
    float *W = rand_floats(rows * n, r);
    float *d_w = dev_floats(W, rows * n), *d_X, *d_Y;
    CU(cudaMalloc((void **)&d_X, 4096 * n * sizeof(float)));
    CU(cudaMemset(d_X, 0, 4096 * n * sizeof(float)));
    CU(cudaMalloc((void **)&d_Y, 4096 * rows * sizeof(float)));
    for (int i = 0; i < 2; i++) {
        double us[4];
        static const uint32_t tiles[4] = {32, 64, 32, 0}, splits[4] = {1, 1, 4, 0};
        for (int t = 0; t < 4; t++) {
            const struct sg_ctx c = {tiles[t], splits[t], Ss[i], rows, n, d_w, d_X, d_Y};
            us[t] = 1e6 * time_graph(sg_launch, &c, 10);
        }
        MEASURE("prefill router F32 %llux%llu, S=%u: tile 32 %.1f us, tile 64 %.1f us, tile 32 "
                "split 4 %.1f us, chosen %.1f us (%.1f TFLOP/s)", (unsigned long long)rows,
                (unsigned long long)n, Ss[i], us[0], us[1], us[2], us[3],
                2.0 * rows * n * Ss[i] / (us[3] * 1e6));
    }
    CU(cudaFree(d_w));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    free(W);
}

/* A 64-row matmul against 64 single matvecs on 2048 x 8192 Q4_0. */
static void bench_matmul(struct rng *r)
{
    const uint32_t type = QUANT_TYPE_Q4_0, S = 64;
    const uint64_t rows = 2048, n = 8192;
    const size_t rb = quant_row_size(type, n), bytes = rows * rb;
    uint8_t *h = xmalloc(bytes), *d_w;
    fill_random_blocks(type, h, bytes, r);
    CU(cudaMalloc((void **)&d_w, bytes));
    CU(cudaMemcpy(d_w, h, bytes, cudaMemcpyHostToDevice));
    float *X = rand_floats(S * n, r), *d_X = dev_floats(X, S * n), *d_Y;
    CU(cudaMalloc((void **)&d_Y, S * rows * sizeof(float)));
    struct mm_ctx c = {d_w, rb, rows, n, S, d_X, d_Y};
    double t_mm = time_graph(mm_launch, &c, 1), t_mv = time_graph(mm_naive_launch, &c, S) * S;
    MEASURE("prefill Q4_0 2048 x 8192, S=64: matmul %.1f us, 64 matvecs %.1f us (%.2fx), "
            "%.2f TFLOP/s",
            t_mm * 1e6, t_mv * 1e6, t_mv / t_mm, 2.0 * S * rows * n / t_mm * 1e-12);
    CU(cudaFree(d_w));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    free(h);
    free(X);
}

/* The SiLU-gated down product (cuda_mvq_glu, cuda_mvq_experts_glu) against
 * cuda_silu_mul followed by the plain product: the same bits. */
static void test_glu(struct rng *r)
{
    const uint64_t rows = 2048, F = 512;
    const uint32_t E = 16, P = 10;
    static const uint32_t glu_types[] = {QUANT_TYPE_Q4_0, QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_K,
                                         QUANT_TYPE_Q5_K, QUANT_TYPE_Q6_K};
    for (int t = 0; t < 5; t++) {
        const uint32_t type = glu_types[t];
        const size_t rb = quant_row_size(type, F), bytes = rows * rb;
        uint8_t *h = xmalloc(bytes * E), *d_w;
        fill_random_blocks(type, h, bytes * E, r);
        CU(cudaMalloc((void **)&d_w, bytes * E));
        CU(cudaMemcpy(d_w, h, bytes * E, cudaMemcpyHostToDevice));
        float *gu = rand_floats(P * 2 * F, r), *d_gu = dev_floats(gu, P * 2 * F), *d_act;
        float *d_y1, *d_y2, *y1 = xmalloc(P * rows * 4), *y2 = xmalloc(P * rows * 4);
        CU(cudaMalloc((void **)&d_act, P * F * 4));
        CU(cudaMalloc((void **)&d_y1, P * rows * 4));
        CU(cudaMalloc((void **)&d_y2, P * rows * 4));
        CU(cudaMemset(d_y1, 0xFF, P * rows * 4));
        CU(cudaMemset(d_y2, 0xFF, P * rows * 4));
        /* dense: pair 0's gate|up row */
        CHECK(cuda_silu_mul(d_gu, (uint32_t)F, P, d_act, 0) == 0, "silu_mul");
        CHECK(cuda_matvec(type, d_w, rb, rows, F, d_act, d_y1, 0) == 0, "matvec");
        CHECK(cuda_mvq_glu(type, d_w, rb, rows, F, d_gu, true, d_y2, 0) == 0, "mvq_glu");
        CU(cudaMemcpy(y1, d_y1, rows * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(y2, d_y2, rows * 4, cudaMemcpyDeviceToHost));
        CHECK(!memcmp(y1, y2, rows * 4), "mvq_glu %s differs from silu_mul + matvec",
              quant_type_name(type));
        /* experts: P pairs over E experts, one absent */
        const void *addr[16];
        for (uint32_t e = 0; e < E; e++)
            addr[e] = e == 3 ? NULL : d_w + (size_t)e * bytes;
        int32_t ids[10];
        for (uint32_t p = 0; p < P; p++)
            ids[p] = (int32_t)(rng_next(r) % E);
        ids[4] = 3;
        void *d_addr = dev_bytes(addr, sizeof(addr));
        int32_t *d_ids = dev_bytes(ids, sizeof(ids));
        CU(cudaMemset(d_y1, 0xFF, P * rows * 4));
        CU(cudaMemset(d_y2, 0xFF, P * rows * 4));
        CHECK(cuda_matvec_experts(type, (const void *const *)d_addr, rb, rows, F, d_ids, P, d_act,
                                  F, 1, d_y1, rows, 0) == 0, "experts");
        CHECK(cuda_mvq_experts_glu(type, (const void *const *)d_addr, rb, rows, F, d_ids, P, d_gu,
                                   2 * F, 1, true, d_y2, rows, 0) == 0, "experts glu");
        CU(cudaMemcpy(y1, d_y1, P * rows * 4, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(y2, d_y2, P * rows * 4, cudaMemcpyDeviceToHost));
        CHECK(!memcmp(y1, y2, P * rows * 4), "mvq_experts_glu %s differs from silu_mul + experts",
              quant_type_name(type));
        CHECK(is_poison(y2[4 * rows]) && is_poison(y2[4 * rows + rows - 1]),
              "mvq_experts_glu wrote the pair of an absent expert");
        MEASURE("glu down %s %llu x %llu (dense and %u pairs): bit-identical to silu_mul + product",
                quant_type_name(type), (unsigned long long)rows, (unsigned long long)F, P);
        cudaFree(d_w), cudaFree(d_gu), cudaFree(d_act), cudaFree(d_y1), cudaFree(d_y2);
        cudaFree(d_addr), cudaFree(d_ids);
        free(h), free(gu), free(y1), free(y2);
    }
}

/* The expert products' tiles copied into shared memory by one bulk copy a
 * block (tma, sm_90; LAMINA_CUDA_TMA=all takes it for every expert product
 * without a tail, the default for Q6_K's, "poll" for none of these) against the lanes'
 * own loads (LAMINA_CUDA_TMA=0): the same
 * bits, with experts at offsets that are not 16-byte aligned, rows padded, an
 * absent expert and a skipped pair. On compute capability 9.0 the tma form
 * must have run where the shape allows it. */
struct tma_case {
    uint32_t type;
    uint64_t rows, n;
    size_t pad;
    bool want; /* tma expected on sm_90 */
};

static bool tma_run(const struct tma_case *c, const void *const *d_addr, const int32_t *d_ids,
                    const float *d_x, float *d_y, float *y, size_t ny, uint32_t pairs)
{
    const size_t rb = quant_row_size(c->type, c->n) + c->pad;
    CU(cudaMemset(d_y, 0xFF, ny * sizeof(float)));
    int rc = cuda_mvq_experts(c->type, d_addr, rb, c->rows, c->n, d_ids, pairs, d_x, c->n, 1,
                              d_y, c->rows, 0);
    CHECK(rc == 0, "tma case %s %llux%llu: rc %d", quant_type_name(c->type),
          (unsigned long long)c->rows, (unsigned long long)c->n, rc);
    const bool used = cuda_mvq_last_tma();
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(y, d_y, ny * sizeof(float), cudaMemcpyDeviceToHost));
    return used;
}

static void test_tma(struct rng *r)
{
    static const struct tma_case cases[] = {
        {QUANT_TYPE_Q4_0, 1024, 2048, 0, true}, /* 80b-a3b gate|up */
        {QUANT_TYPE_Q4_0, 2048, 512, 0, true},  /* 80b-a3b down */
        {QUANT_TYPE_Q8_0, 2048, 512, 0, true},
        {QUANT_TYPE_Q4_0, 700, 2048, 6, true},  /* rows of 1158 bytes, a partial tile */
        {QUANT_TYPE_Q4_0, 1026, 2048, 0, true}, /* a last tile of 2 rows: empty chunks */
        {QUANT_TYPE_Q4_0, 96, 8192, 0, true},   /* a row in one pass of 8 blocks a lane */
        {QUANT_TYPE_Q8_0, 1024, 2048, 0, false}, /* a tile over 48 KiB: lane loads */
        {QUANT_TYPE_Q4_0, 64, 16384, 0, false}, /* two passes a row: lane loads */
        {QUANT_TYPE_Q4_K, 1024, 2048, 0, true}, /* 80b-a3b gate|up of a Q4_K file */
        {QUANT_TYPE_Q4_K, 2048, 512, 0, true},
        {QUANT_TYPE_Q4_K, 700, 2048, 4, true},  /* rows of 1156 bytes, a partial tile */
        {QUANT_TYPE_Q4_K, 64, 16384, 0, false}, /* two passes a row: lane loads */
        {QUANT_TYPE_Q5_K, 1024, 2048, 0, true}, /* rows of 1408: 32 a tile, 47.6 KiB with x */
        {QUANT_TYPE_Q5_K, 2048, 512, 0, true},
        {QUANT_TYPE_Q6_K, 1024, 2048, 0, false}, /* rows of 1680 bytes: lane loads */
        {QUANT_TYPE_Q6_K, 2048, 512, 0, true},  /* rows of 420: super-blocks 2-byte aligned */
        {QUANT_TYPE_Q6_K, 700, 512, 2, true},   /* rows of 422 bytes, a partial tile */
    };
    const uint32_t E = 12, P = 11;
    const int major = cuda_caps_cc() / 10; /* LAMINA_CUDA_AS_SM may lower it (caps.h) */
    int n_tma = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct tma_case *c = &cases[i];
        const size_t rb = quant_row_size(c->type, c->n) + c->pad, bytes = c->rows * rb;
        const size_t stride = bytes + 32; /* expert e at e * stride + (6e mod 16) */
        /* each expert's rows of valid blocks (sane scales), the pads and gaps garbage */
        uint8_t *h = xmalloc(stride * E), *d_w;
        memset(h, 0xA5, stride * E);
        for (uint32_t e = 0; e < E; e++)
            for (uint64_t row = 0; row < c->rows; row++)
                fill_random_blocks(c->type, h + (size_t)e * stride + (6 * e) % 16 + row * rb,
                                   quant_row_size(c->type, c->n), r);
        CU(cudaMalloc((void **)&d_w, stride * E + 16));
        CU(cudaMemcpy(d_w, h, stride * E, cudaMemcpyHostToDevice));
        const void *addr[12];
        for (uint32_t e = 0; e < E; e++)
            addr[e] = e == 5 ? NULL : d_w + (size_t)e * stride + (6 * e) % 16;
        int32_t ids[11];
        for (uint32_t p = 0; p < P; p++) {
            ids[p] = (int32_t)(rng_next(r) % E);
            ids[p] = ids[p] == 5 ? 4 : ids[p];
        }
        ids[2] = 5;  /* absent */
        ids[7] = -1; /* skipped */
        void *d_addr = dev_bytes(addr, sizeof(addr));
        int32_t *d_ids = dev_bytes(ids, sizeof(ids));
        /* an activation row a pair (ldx n, x_div 1: pair p reads row p) */
        float *x = rand_floats(P * c->n, r), *d_x = dev_floats(x, P * c->n), *d_y;
        const size_t ny = P * c->rows + 8;
        float *y1 = xmalloc(ny * sizeof(float)), *y2 = xmalloc(ny * sizeof(float));
        CU(cudaMalloc((void **)&d_y, ny * sizeof(float)));
        const void *const *da = (const void *const *)d_addr;
        setenv("LAMINA_CUDA_TMA", "all", 1);
        const bool used = tma_run(c, da, d_ids, d_x, d_y, y1, ny, P);
        /* the default: tma for Q6_K's products (no ids polled here), "poll" for none */
        unsetenv("LAMINA_CUDA_TMA");
        const bool used_def = tma_run(c, da, d_ids, d_x, d_y, y2, ny, P);
        CHECK(!memcmp(y1, y2, ny * sizeof(float)), "tma case %zu: the default differs", i);
        CHECK(used_def == (major >= 9 && c->want && c->type == QUANT_TYPE_Q6_K),
              "tma case %zu (%s): tma %s by default", i, quant_type_name(c->type),
              used_def ? "used" : "not used");
        setenv("LAMINA_CUDA_TMA", "poll", 1);
        const bool used_poll = tma_run(c, da, d_ids, d_x, d_y, y2, ny, P);
        CHECK(!memcmp(y1, y2, ny * sizeof(float)), "tma case %zu: TMA=poll differs", i);
        CHECK(!used_poll, "tma case %zu: LAMINA_CUDA_TMA=poll copied tiles by tma", i);
        setenv("LAMINA_CUDA_TMA", "0", 1);
        const bool used_off = tma_run(c, da, d_ids, d_x, d_y, y2, ny, P);
        unsetenv("LAMINA_CUDA_TMA");
        if (memcmp(y1, y2, ny * sizeof(float))) { /* where, for the log */
            size_t nd = 0, first = 0;
            for (size_t k = 0; k < ny; k++)
                if (memcmp(&y1[k], &y2[k], sizeof(float)) && !nd++)
                    first = k;
            fprintf(stderr, "tma case %zu: %zu of %zu outputs differ, the first %zu (pair %zu "
                    "row %zu): %a against %a\n", i, nd, ny, first, first / c->rows,
                    first % c->rows, (double)y1[first], (double)y2[first]);
        }
        CHECK(!memcmp(y1, y2, ny * sizeof(float)),
              "tma case %zu (%s %llux%llu): tiles by tma differ from lane loads", i,
              quant_type_name(c->type), (unsigned long long)c->rows, (unsigned long long)c->n);
        CHECK(!used_off, "tma case %zu: LAMINA_CUDA_TMA=0 still copied tiles by tma", i);
        CHECK(used == (major >= 9 && c->want), "tma case %zu: tma %s on compute capability %d",
              i, used ? "used" : "not used", major);
        CHECK(is_poison(y1[2 * c->rows]) && is_poison(y1[7 * c->rows + c->rows - 1]),
              "tma case %zu: a pair of an absent expert or a skipped pair was written", i);
        for (uint32_t p = 0; p < P; p++)
            if (p != 2 && p != 7)
                CHECK(!is_poison(y1[p * c->rows]) && !is_poison(y1[p * c->rows + c->rows - 1]),
                      "tma case %zu: pair %u was not written", i, p);
        CHECK(is_poison(y1[P * c->rows]), "tma case %zu: written past the last pair", i);
        n_tma += used;
        cudaFree(d_w), cudaFree(d_addr), cudaFree(d_ids), cudaFree(d_x), cudaFree(d_y);
        free(h), free(x), free(y1), free(y2);
    }
    MEASURE("expert products, tiles by tma against lane loads: byte-identical in %zu cases (%d "
            "of them by tma on compute capability %d)",
            sizeof(cases) / sizeof(cases[0]), n_tma, major);
}

/* The PDL chain: per layer x = norm(h); a = Wa x (4096 x 2048, int8 path);
 * b = Wb a (2048 x 4096, f32 path); logits = Wr b (F32, 16 x 2048); top-2 of
 * them; Y = the two picked experts (2048 x 2048 Q4_0) times b; h += w Y. */
#define PC_N 2048
#define PC_E 16
#define PC_SETS 4 /* weight sets the layers rotate over */
struct pc_ctx {
    const uint8_t *d_wa[PC_SETS], *d_wb[PC_SETS];
    const float *d_wr[PC_SETS];
    const void *const *d_addr; /* PC_E expert addresses */
    float *d_h, *d_x, *d_a, *d_b, *d_lg, *d_w, *d_Y;
    int32_t *d_ids;
};

static int pc_layer(const void *ctx, int i, cudaStream_t s)
{
    const struct pc_ctx *c = ctx;
    const int k = i % PC_SETS;
    const size_t rb2 = quant_row_size(QUANT_TYPE_Q4_0, PC_N);
    const size_t rb4 = quant_row_size(QUANT_TYPE_Q4_0, 2 * PC_N);
    int rc = cuda_rmsnorm(c->d_x, PC_N, c->d_h, PC_N, NULL, PC_N, 1, 1e-6f, s);
    rc = rc ? rc : cuda_matvec(QUANT_TYPE_Q4_0, c->d_wa[k], rb2, 2 * PC_N, PC_N, c->d_x, c->d_a, s);
    rc = rc ? rc : cuda_matvec(QUANT_TYPE_Q4_0, c->d_wb[k], rb4, PC_N, 2 * PC_N, c->d_a, c->d_b, s);
    rc = rc ? rc : cuda_matvec(QUANT_TYPE_F32, c->d_wr[k], PC_N * 4, PC_E, PC_N, c->d_b, c->d_lg, s);
    rc = rc ? rc : cuda_router_topk(c->d_lg, PC_E, 2, 1, c->d_ids, c->d_w, s);
    rc = rc ? rc : cuda_matvec_experts(QUANT_TYPE_Q4_0, c->d_addr, rb2, PC_N, PC_N, c->d_ids, 2,
                                       c->d_b, PC_N, 2, c->d_Y, PC_N, s);
    return rc ? rc : cuda_moe_combine(c->d_h, c->d_Y, c->d_w, 2, NULL, NULL, NULL, PC_N, 1, s);
}

/* h0 through `layers` layers, as a graph or launched one by one; h into out. */
static void pc_run(const struct pc_ctx *c, const float *h0, int layers, bool graph, float *out)
{
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CU(cudaMemcpy(c->d_h, h0, PC_N * sizeof(float), cudaMemcpyHostToDevice));
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    if (graph)
        CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < layers; i++)
        CHECK(pc_layer(c, i, s) == 0, "pdl chain layer %d launched", i);
    if (graph) {
        CU(cudaStreamEndCapture(s, &g));
        CU(cudaGraphInstantiate(&ge, g, 0));
        CU(cudaGraphLaunch(ge, s));
    }
    CU(cudaStreamSynchronize(s));
    CU(cudaMemcpy(out, c->d_h, PC_N * sizeof(float), cudaMemcpyDeviceToHost));
    if (ge)
        CU(cudaGraphExecDestroy(ge));
    if (g)
        CU(cudaGraphDestroy(g));
    CU(cudaStreamDestroy(s));
}

static void test_pdl_chain(struct rng *r)
{
    enum { LAYERS = 32 };
    const size_t rb2 = quant_row_size(QUANT_TYPE_Q4_0, PC_N);
    const size_t rb4 = quant_row_size(QUANT_TYPE_Q4_0, 2 * PC_N);
    const size_t ba = 2 * PC_N * rb2, bb = PC_N * rb4, br = PC_E * PC_N * 4, be = PC_N * rb2;
    uint8_t *h = xmalloc(ba > be ? ba : be);
    struct pc_ctx c = {0};
    void *addr[PC_E];
    for (int k = 0; k < PC_SETS; k++) {
        uint8_t *d;
        CU(cudaMalloc((void **)&d, ba + bb + br));
        fill_random_blocks(QUANT_TYPE_Q4_0, h, ba, r);
        CU(cudaMemcpy(d, h, ba, cudaMemcpyHostToDevice));
        fill_random_blocks(QUANT_TYPE_Q4_0, h, bb, r);
        CU(cudaMemcpy(d + ba, h, bb, cudaMemcpyHostToDevice));
        float *wr = rand_floats(br / 4, r);
        CU(cudaMemcpy(d + ba + bb, wr, br, cudaMemcpyHostToDevice));
        free(wr);
        c.d_wa[k] = d, c.d_wb[k] = d + ba, c.d_wr[k] = (const float *)(d + ba + bb);
    }
    for (int e = 0; e < PC_E; e++) {
        CU(cudaMalloc(&addr[e], be));
        fill_random_blocks(QUANT_TYPE_Q4_0, h, be, r);
        CU(cudaMemcpy(addr[e], h, be, cudaMemcpyHostToDevice));
    }
    void **d_addr;
    CU(cudaMalloc((void **)&d_addr, sizeof(addr)));
    CU(cudaMemcpy(d_addr, addr, sizeof(addr), cudaMemcpyHostToDevice));
    c.d_addr = (const void *const *)d_addr;
    float **bufs[] = {&c.d_h, &c.d_x, &c.d_a, &c.d_b, &c.d_lg, &c.d_w, &c.d_Y};
    const size_t lens[] = {PC_N, PC_N, 2 * PC_N, PC_N, PC_E, 2, 2 * PC_N};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
        CU(cudaMalloc((void **)bufs[i], lens[i] * sizeof(float)));
    CU(cudaMalloc((void **)&c.d_ids, 2 * sizeof(int32_t)));
    float *h0 = rand_floats(PC_N, r), out[3][PC_N];
    setenv("LAMINA_CUDA_PDL", "0", 1);
    pc_run(&c, h0, LAYERS, true, out[0]);
    const double off = time_graph(pc_layer, &c, LAYERS);
    unsetenv("LAMINA_CUDA_PDL");
    pc_run(&c, h0, LAYERS, true, out[1]);
    pc_run(&c, h0, LAYERS, false, out[2]);
    const double on = time_graph(pc_layer, &c, LAYERS);
    bool finite = true;
    for (int i = 0; i < PC_N; i++)
        finite &= isfinite(out[0][i]) != 0;
    CHECK(finite, "pdl chain: the result is finite");
    CHECK(!memcmp(out[0], out[1], sizeof(out[0])), "pdl chain: graph with PDL differs");
    CHECK(!memcmp(out[0], out[2], sizeof(out[0])), "pdl chain: launches with PDL differ");
    MEASURE("pdl chain of %d layers (7 kernels each): graph %.2f us per layer with "
            "LAMINA_CUDA_PDL=0, %.2f us with PDL (as launched on this device)", LAYERS,
            off * 1e6, on * 1e6);
    for (int k = 0; k < PC_SETS; k++)
        CU(cudaFree((void *)c.d_wa[k]));
    for (int e = 0; e < PC_E; e++)
        CU(cudaFree(addr[e]));
    CU(cudaFree(d_addr));
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++)
        CU(cudaFree(*bufs[i]));
    CU(cudaFree(c.d_ids));
    free(h);
    free(h0);
}

int main(void)
{
    log_init("test", -1);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fprintf(stderr, "test_matvec_cuda: no CUDA device (%s); this test needs a GPU\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 1;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    struct rng r = {0x9E3779B97F4A7C15ull};
    struct twin_stats ts = {0.0};
    /* the int8 products' Q4_K, Q5_K and Q6_K forms (the default, said outright) */
    setenv("LAMINA_CUDA_MVQ_K", "1", 1);
    test_rejects();
    test_matvec(&r, &ts);
    test_matmul(&r, &ts);
    test_sgemm(&r, &ts);
    test_experts(&r, &ts);
    test_glu(&r);
    test_tma(&r);
    test_pdl_chain(&r);
    MEASURE("largest difference from the CPU twin (matvec_rows, matvec_rows_batch): %.3g of "
            "sum |w x| (it may round activations to int8; the exact dot is held to %.0e)",
            ts.worst, TOL);
    /* the 80b-a3b decode shapes too: DeltaNet input stack, output, lm head */
    static const uint64_t shapes[][2] = {{2048, 8192}, {8192, 2048}, {151936, 2048},
                                         {12352, 2048}, {2048, 4096}};
    for (int t = 0; t < 2; t++)
        for (int s = 0; s < 5; s++)
            bench_one(t ? QUANT_TYPE_Q8_0 : QUANT_TYPE_Q4_0, shapes[s][0], shapes[s][1], &r);
    for (int t = 0; t < 2; t++)
        bench_one(t ? QUANT_TYPE_Q6_K : QUANT_TYPE_Q4_K, shapes[t ? 2 : 0][0],
                  shapes[t ? 2 : 0][1], &r);
    for (int t = 0; t < 2; t++) {
        bench_experts(t ? QUANT_TYPE_Q4_K : QUANT_TYPE_Q4_0, 768, 2048, 8, &r);
        bench_experts(t ? QUANT_TYPE_Q4_K : QUANT_TYPE_Q4_0, 2048, 768, 1, &r);
    }
    bench_experts(QUANT_TYPE_Q4_0, 1024, 2048, 8, &r); /* 80b-a3b gate|up, down */
    bench_experts(QUANT_TYPE_Q4_0, 2048, 512, 1, &r);
    /* the K types there (Q4_K_M files: gate|up Q4_K, down Q4_K or Q6_K), on the int8
     * products and on the f32 ones (LAMINA_CUDA_MVQ_K=0) */
    for (int k = 0; k < 2; k++) {
        setenv("LAMINA_CUDA_MVQ_K", k ? "0" : "1", 1);
        printf("K types on the %s products:\n", k ? "f32" : "int8");
        bench_experts(QUANT_TYPE_Q4_K, 1024, 2048, 8, &r);
        bench_experts(QUANT_TYPE_Q4_K, 2048, 512, 1, &r);
        bench_experts(QUANT_TYPE_Q6_K, 2048, 512, 1, &r);
        bench_one(QUANT_TYPE_Q4_K, 8192, 2048, &r);
        bench_one(QUANT_TYPE_Q6_K, 151936, 2048, &r);
    }
    setenv("LAMINA_CUDA_MVQ_K", "1", 1);
    bench_matmul(&r);
    bench_sgemm(&r);
    return test_main_result("test_matvec_cuda");
}
