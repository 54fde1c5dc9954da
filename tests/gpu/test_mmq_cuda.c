/*
 * test_mmq_cuda: the int8 tensor-core prefill products (kernels/cuda/mmq.h)
 * against an f64 CPU reference on fresh random data.
 *
 * Weights are random valid blocks (random bytes, finite fp16 scales) of
 * Q4_0, Q8_0, Q4_K, Q5_K and Q6_K; activations random in [-1, 1). The reference
 * dequantizes each row with quant_dequantize_row and rounds the
 * activations exactly as the kernels do (blocks of 32, d = amax/127,
 * q = round-half-even(x * (127/amax)), all in f32), then sums in double.
 * Every output element must be within TOL_Q of sum |w_i xq_i| of that dot
 * (the kernels' only rounding left is f32 scaling and summation); the
 * relative L2 error of each product against the dot with the true
 * activations must stay under TOL_X (int8 activations cost about 1e-3
 * of it); every element the kernels must not write (stride padding, rows
 * of skipped pairs) must still hold the NaN poison written before each
 * run. Dense: odd row counts, S = 1, 7, 33, 64, 512, n = 512, 2048, 4096,
 * weights misaligned (2-byte offset and stride: the plain-load staging),
 * shapes that pick each tile width. Stacked matrices through
 * cuda_mmq_parts (1 to 4 parts, odd sizes): byte for byte the product of
 * the whole and of each part alone. The down product's form with the SiLU
 * gate in its rounding (cuda_mmq_experts_glu), grouping itself and reusing
 * a grouping: byte for byte cuda_silu_mul then cuda_mmq_experts. Experts: 512 experts top-10 with NULL
 * and misaligned experts, x_div 10 and 1, and fewer, busier experts
 * (several tiles per expert, each tile width). All of it in each form:
 * the default (copy offsets once a block; misaligned experts take the
 * per-copy path inside it), LAMINA_CUDA_MMQ_WARPS=2 (the older warp layout)
 * and LAMINA_CUDA_MMQ_PRE=0 (offsets at every copy). Then [measure] lines:
 * median of 25 timed calls after warm-up (cudaEvents) for a dense
 * 2048 x 8192 Q4_0 product at S = 512, routed experts 512 x (512 x 2048)
 * and 512 x (1024 x 2048) Q4_0 with 5120 pairs (x_div 10, gate- and
 * gate/up-like) and 20480 pairs, and 512 x (2048 x 512) with 5120 pairs
 * (down-like), each in the three forms (byte for byte equal) and beside
 * cuda_matmul / cuda_matvec_experts on the same data; and Q6_K's dense
 * 8192 x 2048 and down-like experts (a Q4_K_M file's).
 */
#include "kernels/cuda/caps.h"
#include "kernels/cuda/mmq.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/ops.h"
#include "model/quant.h"
#include "tests/check.h"
#include "tests/gpu/gpu_check.h"

#define TOL_Q 1e-4 /* against the dot with the rounded activations, of sum |w_i xq_i| */
#define TOL_X 1e-2 /* relative L2 error against the dot with the true activations */
#define POISON 0xFFFFFFFFu /* NaN bits written over outputs before each run */

static const uint32_t types[] = {QUANT_TYPE_Q4_0, QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_K,
                                 QUANT_TYPE_Q5_K, QUANT_TYPE_Q6_K};
#define N_TYPES (sizeof(types) / sizeof(types[0]))

static bool is_poison(float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof(b));
    return b == POISON;
}

/* ---- data ------------------------------------------------------------------ */

/* Random bytes, then each block's fp16 scales set finite (d and, for
 * Q4_K and Q5_K, dmin at byte 2; Q6_K's d is its last 2 bytes, beside its
 * int8 scales, which any bytes are). */
static void fill_blocks(uint32_t type, uint8_t *row, size_t row_size, struct rng *r)
{
    for (size_t i = 0; i < row_size; i++)
        row[i] = (uint8_t)rng_next(r);
    const size_t bb = quant_block_bytes(type);
    const bool k = type == QUANT_TYPE_Q4_K || type == QUANT_TYPE_Q5_K;
    const size_t at = type == QUANT_TYPE_Q6_K ? 208 : 0;
    for (size_t b = 0; b + bb <= row_size; b += bb)
        for (int j = 0; j < (k ? 2 : 1); j++) {
            uint16_t d = quant_f32_to_f16((0.002f + 0.02f * fabsf(rng_float(r))) * (j ? 0.5f : 1) *
                                          (at ? 0.01f : 1.0f)); /* Q6_K: levels x scales to 4096 */
            memcpy(row + b + at + 2 * j, &d, 2);
        }
}

/* A weight matrix as stored (row r at w + r * row_bytes, pad bytes of
 * garbage) and its dequantized rows. */
struct mat {
    uint32_t type;
    uint64_t rows, n;
    size_t row_bytes, bytes;
    uint8_t *w;
    float *deq; /* rows x n, NULL until mat_dequantize */
};

static struct mat mat_make(uint32_t type, uint64_t rows, uint64_t n, size_t pad, struct rng *r)
{
    const size_t rs = quant_row_size(type, n);
    struct mat m = {type, rows, n, rs + pad, (rows - 1) * (rs + pad) + rs, NULL, NULL};
    m.w = xmalloc(m.bytes);
    memset(m.w, 0xA5, m.bytes);
    for (uint64_t i = 0; i < rows; i++)
        fill_blocks(type, m.w + i * m.row_bytes, rs, r);
    return m;
}

static void mat_dequantize(struct mat *m)
{
    m->deq = xmalloc(m->rows * m->n * sizeof(float));
    for (uint64_t i = 0; i < m->rows; i++) {
        int rc = quant_dequantize_row(m->type, m->w + i * m->row_bytes, m->deq + i * m->n, m->n);
        CHECK(rc == 0, "dequantize %s rc %d", quant_type_name(m->type), rc);
    }
}

static void mat_free(struct mat *m)
{
    free(m->w);
    free(m->deq);
}

/* Device copy of m at byte offset off of a fresh allocation (*base). */
static const void *mat_upload(const struct mat *m, size_t off, void **base)
{
    CU(cudaMalloc(base, m->bytes + off + 16));
    CU(cudaMemcpy((char *)*base + off, m->w, m->bytes, cudaMemcpyHostToDevice));
    return (const char *)*base + off;
}

static float *dev_poison(size_t count)
{
    float *d;
    CU(cudaMalloc((void **)&d, count * sizeof(float) + 16));
    CU(cudaMemset(d, 0xFF, count * sizeof(float)));
    return d;
}

/* The kernels' rounding of one activation row: xq[i] = q_i * d_b as the
 * exact double, blocks of 32, all f32 arithmetic as on the GPU. */
static void round_row(const float *x, uint64_t n, double *xq)
{
    for (uint64_t b = 0; b < n; b += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(x[b + i]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; i++)
            xq[b + i] = (double)nearbyintf(x[b + i] * id) * (double)d;
    }
}

/* Accumulates one product into the error statistics of a whole check. */
struct errs {
    double worst_q;      /* largest |got - ref_q| / sum |w xq| */
    double l2_num, l2_den; /* sums of (got - ref_x)^2 and ref_x^2 */
    int bad;
};

/* Compares got with row r of m times activation x (and its rounding xq). */
static void check_dot(const char *what, const struct mat *m, uint64_t r, const float *x,
                      const double *xq, float got, struct errs *e)
{
    const float *w = m->deq + r * m->n;
    double dq = 0.0, aq = 0.0, dx = 0.0;
    for (uint64_t i = 0; i < m->n; i++) {
        dq += (double)w[i] * xq[i];
        aq += fabs((double)w[i] * xq[i]);
        dx += (double)w[i] * (double)x[i];
    }
    const double err = fabs((double)got - dq) / (aq + 1e-30);
    if (!(err <= TOL_Q) && e->bad++ < 3)
        CHECK(err <= TOL_Q, "%s %s %llux%llu row %llu: gpu %.9g reference %.9g (rel %.3g)", what,
              quant_type_name(m->type), (unsigned long long)m->rows, (unsigned long long)m->n,
              (unsigned long long)r, got, dq, err);
    if (err > e->worst_q || err != err)
        e->worst_q = err != err ? INFINITY : err;
    e->l2_num += ((double)got - dx) * ((double)got - dx);
    e->l2_den += dx * dx;
}

static double errs_l2(const struct errs *e)
{
    return sqrt(e->l2_num / (e->l2_den + 1e-300));
}

/* ---- dense ------------------------------------------------------------------ */

/* One cuda_mmq of m (placed at byte offset off) with S rows; returns the
 * relative L2 error against the true activations. */
static double run_dense(struct mat *m, size_t off, uint32_t S, size_t ldx, struct errs *e,
                        struct rng *r)
{
    const size_t ldy = m->rows + 5, ny = (S - 1) * ldy + m->rows + 8, nx = (S - 1) * ldx + m->n;
    float *X = rand_floats(nx, r), *got = xmalloc(ny * sizeof(float));
    void *base, *d_work;
    const void *d_w = mat_upload(m, off, &base);
    float *d_X = dev_floats(X, nx), *d_Y = dev_poison(ny);
    CU(cudaMalloc(&d_work, cuda_mmq_work_bytes(m->n, S)));
    int rc = cuda_mmq(m->type, d_w, m->row_bytes, m->rows, m->n, d_X, ldx, S, d_Y, ldy, d_work, 0);
    CHECK(rc == 0, "cuda_mmq %s rc %d", quant_type_name(m->type), rc);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, d_Y, ny * sizeof(float), cudaMemcpyDeviceToHost));
    struct errs one = {0};
    double *xq = xmalloc(m->n * sizeof(double));
    char what[64];
    snprintf(what, sizeof(what), "dense S=%u", S);
    for (uint32_t s = 0; s < S; s++) {
        round_row(X + s * ldx, m->n, xq);
        for (uint64_t i = 0; i < m->rows; i++)
            check_dot(what, m, i, X + s * ldx, xq, got[s * ldy + i], &one);
        for (size_t i = m->rows; i < (s + 1 < S ? ldy : m->rows + 8); i++)
            CHECK(is_poison(got[s * ldy + i]), "%s wrote padding %zu of row %u", what, i, s);
    }
    e->worst_q = fmax(e->worst_q, one.worst_q);
    e->bad += one.bad;
    const double l2 = errs_l2(&one);
    CHECK(l2 <= TOL_X, "%s %s %llux%llu: relative L2 error %.3g against true activations", what,
          quant_type_name(m->type), (unsigned long long)m->rows, (unsigned long long)m->n, l2);
    CU(cudaFree(base));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    CU(cudaFree(d_work));
    free(X);
    free(got);
    free(xq);
    return l2;
}

static void test_dense(struct rng *r)
{
    /* rows, n, S, pad/offset of misaligned weights */
    static const struct {
        uint64_t rows, n;
        uint32_t S;
        size_t mis;
    } cases[] = {
        {67, 2048, 1, 0},   {67, 2048, 7, 0},   {67, 2048, 64, 0},  {67, 2048, 64, 2},
        {129, 4096, 7, 0},  {129, 4096, 33, 0}, {37, 512, 512, 0},  {4300, 512, 64, 0},
        {1100, 512, 512, 0}, {33, 256, 5, 2},
    };
    for (size_t t = 0; t < N_TYPES; t++) {
        struct errs e = {0};
        double l2 = 0.0;
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
            struct mat m = mat_make(types[t], cases[c].rows, cases[c].n, cases[c].mis, r);
            mat_dequantize(&m);
            /* odd strides: activation rows at any 4-byte alignment */
            l2 = fmax(l2, run_dense(&m, cases[c].mis, cases[c].S, m.n + (c % 2 ? 3 : 4), &e, r));
            mat_free(&m);
        }
        MEASURE("mmq dense %-4s: max rel error %.3g against rounded activations (bound %.0e), "
                "relative L2 %.3g against true ones (bound %.0e), %zu shapes",
                quant_type_name(types[t]), e.worst_q, TOL_Q, l2, TOL_X,
                sizeof(cases) / sizeof(cases[0]));
    }
}

/* Stacked matrices through cuda_mmq_parts: each part's outputs byte for byte
 * those of cuda_mmq over the whole matrix and of cuda_mmq over the part's own
 * rows (another tile width where it has fewer row tiles), the parts' padding
 * untouched. */
static void test_parts(struct rng *r)
{
    static const struct {
        uint32_t n_parts, S;
        uint64_t rows[4], n;
        size_t mis;
    } cases[] = {
        {4, 33, {37, 64, 5, 130}, 2048, 0},
        {4, 512, {256, 128, 32, 32}, 512, 0},
        {3, 7, {1, 200, 3, 0}, 256, 2},
        {1, 64, {300, 0, 0, 0}, 1024, 0},
    };
    for (size_t t = 0; t < N_TYPES; t++)
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
            const uint32_t np = cases[c].n_parts, S = cases[c].S;
            uint64_t total = 0;
            for (uint32_t q = 0; q < np; q++)
                total += cases[c].rows[q];
            struct mat m = mat_make(types[t], total, cases[c].n, cases[c].mis, r);
            const size_t ldx = m.n + 1, nx = (S - 1) * ldx + m.n;
            float *X = rand_floats(nx, r);
            void *base, *d_work;
            const void *d_w = mat_upload(&m, cases[c].mis, &base);
            float *d_X = dev_floats(X, nx), *d_all = dev_poison((size_t)S * total);
            CU(cudaMalloc(&d_work, cuda_mmq_work_bytes(m.n, S)));
            CHECK(cuda_mmq(m.type, d_w, m.row_bytes, total, m.n, d_X, ldx, S, d_all, total,
                           d_work, 0) == 0,
                  "parts: the whole matrix");
            float *all = xmalloc((size_t)S * total * sizeof(float));
            CU(cudaDeviceSynchronize());
            CU(cudaMemcpy(all, d_all, (size_t)S * total * sizeof(float),
                          cudaMemcpyDeviceToHost));
            struct cuda_mmq_part p[4];
            float *d_own[4];
            for (uint32_t q = 0; q < np; q++) {
                const size_t ld = cases[c].rows[q] + 3;
                p[q] = (struct cuda_mmq_part){dev_poison(S * ld), ld, cases[c].rows[q]};
                d_own[q] = dev_poison(S * ld);
            }
            CHECK(cuda_mmq_parts(m.type, d_w, m.row_bytes, m.n, d_X, ldx, S, p, np, d_work, 0) ==
                      0,
                  "cuda_mmq_parts %s case %zu", quant_type_name(m.type), c);
            uint64_t r0 = 0;
            for (uint32_t q = 0; q < np; q++) {
                const uint64_t rows = cases[c].rows[q];
                const size_t ld = p[q].ldy;
                CHECK(cuda_mmq(m.type, (const uint8_t *)d_w + r0 * m.row_bytes, m.row_bytes,
                               rows, m.n, d_X, ldx, S, d_own[q], ld, d_work, 0) == 0,
                      "parts: part %u alone", q);
                float *got = xmalloc(S * ld * sizeof(float)), *own = xmalloc(S * ld * sizeof(float));
                CU(cudaDeviceSynchronize());
                CU(cudaMemcpy(got, p[q].d_Y, S * ld * sizeof(float), cudaMemcpyDeviceToHost));
                CU(cudaMemcpy(own, d_own[q], S * ld * sizeof(float), cudaMemcpyDeviceToHost));
                CHECK(memcmp(got, own, S * ld * sizeof(float)) == 0,
                      "parts %s case %zu: part %u differs from cuda_mmq over its rows",
                      quant_type_name(m.type), c, q);
                for (uint32_t s2 = 0; s2 < S; s2++) {
                    CHECK(memcmp(got + s2 * ld, all + s2 * total + r0, rows * sizeof(float)) == 0,
                          "parts %s case %zu: part %u row %u differs from the whole product",
                          quant_type_name(m.type), c, q, s2);
                    for (size_t i = rows; i < ld; i++)
                        CHECK(is_poison(got[s2 * ld + i]), "parts: part %u wrote padding %zu",
                              q, i);
                }
                r0 += rows;
                free(got);
                free(own);
                CU(cudaFree(p[q].d_Y));
                CU(cudaFree(d_own[q]));
            }
            CU(cudaFree(base));
            CU(cudaFree(d_X));
            CU(cudaFree(d_all));
            CU(cudaFree(d_work));
            free(X);
            free(all);
            mat_free(&m);
        }
}

/* ---- experts ------------------------------------------------------------------- */

struct ex_case {
    uint32_t n_expert, top_k, n_tok, x_div;
    uint64_t rows, n;
    int skew; /* every skew-th pair goes to expert 1 (several tiles there); 0: none */
};

/* Distinct random experts per token (pairs p = tok * top_k + k). */
static void make_ids(int32_t *ids, const struct ex_case *c, struct rng *r)
{
    for (uint32_t tok = 0; tok < c->n_tok; tok++)
        for (uint32_t k = 0; k < c->top_k; k++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(rng_next(r) % c->n_expert);
                dup = false;
                for (uint32_t j = 0; j < k; j++)
                    dup |= ids[tok * c->top_k + j] == e;
            } while (dup);
            ids[tok * c->top_k + k] = e;
        }
    if (c->skew)
        for (uint32_t p = 0; p < c->n_tok * c->top_k; p += (uint32_t)c->skew)
            ids[p] = 1;
}

/* A row per pair (x_div 1): cuda_mmq_experts_glu over random gate/up rows,
 * byte for byte cuda_silu_mul then cuda_mmq_experts (its outputs and the
 * rows it leaves alone), grouping itself and reusing the grouping that call
 * left in d_work. */
static void check_glu(uint32_t type, const struct ex_case *c, size_t row_bytes,
                      const void *const *d_addr, const int32_t *d_ids, void *d_work, size_t wb,
                      struct rng *r)
{
    const uint32_t E = c->n_expert, n_pairs = c->n_tok * c->top_k;
    const size_t ldy = c->rows + 3, ny = (size_t)n_pairs * ldy, ngu = (size_t)n_pairs * 2 * c->n;
    float *GU = rand_floats(ngu, r), *ref = xmalloc(ny * sizeof(float));
    float *got = xmalloc(ny * sizeof(float));
    float *d_GU = dev_floats(GU, ngu), *d_act = dev_poison((size_t)n_pairs * c->n);
    float *d_ref = dev_poison(ny), *d_Y = dev_poison(ny);
    CHECK(cuda_silu_mul(d_GU, (uint32_t)c->n, n_pairs, d_act, 0) == 0, "cuda_silu_mul");
    CHECK(cuda_mmq_experts(type, d_addr, E, row_bytes, c->rows, c->n, d_ids, n_pairs, d_act, c->n,
                           1, d_ref, ldy, d_work, wb, 0) == 0,
          "glu reference");
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(ref, d_ref, ny * sizeof(float), cudaMemcpyDeviceToHost));
    for (int grouped = 1; grouped >= 0; grouped--) {
        CU(cudaMemset(d_Y, 0xFF, ny * sizeof(float)));
        CHECK(cuda_mmq_experts_glu(type, d_addr, E, row_bytes, c->rows, c->n, d_ids, n_pairs,
                                   d_GU, 2 * c->n, grouped, d_Y, ldy, d_work, wb, 0) == 0,
              "cuda_mmq_experts_glu");
        CU(cudaDeviceSynchronize());
        CU(cudaMemcpy(got, d_Y, ny * sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(memcmp(got, ref, ny * sizeof(float)) == 0,
              "glu %s %u experts top %u (grouped %d): not the bits of cuda_silu_mul + "
              "cuda_mmq_experts", quant_type_name(type), E, c->top_k, grouped);
    }
    CU(cudaFree(d_GU));
    CU(cudaFree(d_act));
    CU(cudaFree(d_ref));
    CU(cudaFree(d_Y));
    free(GU);
    free(ref);
    free(got);
}

/* Experts 0 (if more than 8), 3 and the last are NULL; expert 2 sits at a
 * 2-byte offset. Returns the relative L2 error. */
static double run_experts(uint32_t type, const struct ex_case *c, struct errs *e, struct rng *r)
{
    const uint32_t E = c->n_expert, n_pairs = c->n_tok * c->top_k;
    const uint32_t x_rows = (n_pairs - 1) / c->x_div + 1;
    const size_t ldx = c->n + 4, ldy = c->rows + 3, ny = (size_t)n_pairs * ldy;
    struct mat *m = xmalloc(E * sizeof(*m));
    void **bases = xmalloc(E * sizeof(void *));
    const void **addr = xmalloc(E * sizeof(void *));
    for (uint32_t k = 0; k < E; k++) {
        m[k] = mat_make(type, c->rows, c->n, 0, r);
        bases[k] = NULL;
        addr[k] = (k == 0 && E > 8) || k == 3 || k == E - 1
                      ? NULL
                      : mat_upload(&m[k], k == 2 ? 2 : 0, &bases[k]);
    }
    int32_t *ids = xmalloc(n_pairs * sizeof(int32_t));
    make_ids(ids, c, r);
    float *X = rand_floats((x_rows - 1) * ldx + c->n, r), *got = xmalloc(ny * sizeof(float));
    float *d_X = dev_floats(X, (x_rows - 1) * ldx + c->n), *d_Y = dev_poison(ny);
    const void **d_addr;
    int32_t *d_ids;
    void *d_work;
    const size_t wb = cuda_mmq_experts_work_bytes(c->n, n_pairs, E);
    CU(cudaMalloc((void **)&d_addr, E * sizeof(void *)));
    CU(cudaMemcpy(d_addr, addr, E * sizeof(void *), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&d_ids, n_pairs * sizeof(int32_t)));
    CU(cudaMemcpy(d_ids, ids, n_pairs * sizeof(int32_t), cudaMemcpyHostToDevice));
    CU(cudaMalloc(&d_work, wb));
    int rc = cuda_mmq_experts(type, (const void *const *)d_addr, E, m[0].row_bytes, c->rows, c->n,
                              d_ids, n_pairs, d_X, ldx, c->x_div, d_Y, ldy, d_work, wb, 0);
    CHECK(rc == 0, "cuda_mmq_experts %s rc %d", quant_type_name(type), rc);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(got, d_Y, ny * sizeof(float), cudaMemcpyDeviceToHost));
    struct errs one = {0};
    double *xq = xmalloc(c->n * sizeof(double));
    char what[64];
    snprintf(what, sizeof(what), "experts %u top %u x_div %u", E, c->top_k, c->x_div);
    for (uint32_t p = 0; p < n_pairs; p++) {
        const uint32_t k = (uint32_t)ids[p];
        const float *x = X + (p / c->x_div) * ldx;
        if (addr[k]) {
            if (!m[k].deq)
                mat_dequantize(&m[k]);
            round_row(x, c->n, xq);
            for (uint64_t i = 0; i < c->rows; i++)
                check_dot(what, &m[k], i, x, xq, got[p * ldy + i], &one);
        }
        for (size_t i = addr[k] ? c->rows : 0; i < ldy; i++)
            CHECK(is_poison(got[p * ldy + i]), "%s: pair %u (expert %u) element %zu was written",
                  what, p, k, i);
    }
    e->worst_q = fmax(e->worst_q, one.worst_q);
    e->bad += one.bad;
    const double l2 = errs_l2(&one);
    CHECK(l2 <= TOL_X, "%s %s: relative L2 error %.3g against true activations", what,
          quant_type_name(type), l2);
    if (c->x_div == 1)
        check_glu(type, c, m[0].row_bytes, (const void *const *)d_addr, d_ids, d_work, wb, r);
    for (uint32_t k = 0; k < E; k++) {
        if (bases[k])
            CU(cudaFree(bases[k]));
        mat_free(&m[k]);
    }
    CU(cudaFree(d_addr));
    CU(cudaFree(d_ids));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    CU(cudaFree(d_work));
    free(m);
    free(bases);
    free(addr);
    free(ids);
    free(X);
    free(got);
    free(xq);
    return l2;
}

static void test_experts(struct rng *r)
{
    static const struct ex_case cases[] = {
        {512, 10, 64, 10, 67, 512, 0},  /* gate-like: about 1 pair per expert */
        {512, 10, 64, 1, 67, 512, 0},   /* down-like: a row per pair */
        {8, 2, 200, 2, 67, 2048, 3},    /* 50 pairs per expert, expert 1 over 64 */
        {32, 4, 128, 4, 67, 512, 0},    /* 16 pairs per expert */
        {64, 6, 200, 6, 131, 256, 5},   /* 18 per expert, expert 1 over 2 tiles */
        {32, 4, 128, 1, 67, 512, 3},    /* down-like, expert 1 over several tiles */
    };
    for (size_t t = 0; t < N_TYPES; t++) {
        struct errs e = {0};
        double l2 = 0.0;
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
            l2 = fmax(l2, run_experts(types[t], &cases[c], &e, r));
        MEASURE("mmq experts %-4s: max rel error %.3g against rounded activations (bound %.0e), "
                "relative L2 %.3g against true ones (bound %.0e), %zu cases",
                quant_type_name(types[t]), e.worst_q, TOL_Q, l2, TOL_X,
                sizeof(cases) / sizeof(cases[0]));
    }
}

/* ---- bad arguments ------------------------------------------------------------- */

static void test_rejects(void)
{
    float *d;
    CU(cudaMalloc((void **)&d, 1 << 20));
    log_set_level(LOG_LEVEL_ERROR);
    CHECK(cuda_mmq(QUANT_TYPE_Q3_K, d, 110, 1, 256, d, 256, 2, d, 4, d, 0) == -ENOTSUP,
          "Q3_K not refused with -ENOTSUP");
    CHECK(cuda_mmq(QUANT_TYPE_Q4_0, d, 18 * 3, 1, 96, d, 96, 2, d, 4, d, 0) == -ENOTSUP,
          "n=96 not refused with -ENOTSUP");
    CHECK(cuda_mmq(QUANT_TYPE_Q4_0, d, 144, 4, 256, d, 255, 2, d, 4, d, 0) == -EINVAL,
          "ldx < n accepted");
    CHECK(cuda_mmq(QUANT_TYPE_Q4_0, d, 143, 4, 256, d, 256, 2, d, 4, d, 0) == -EINVAL,
          "short rows accepted");
    CHECK(cuda_mmq(QUANT_TYPE_Q4_0, d, 144, 4, 256, d, 256, 2, d, 4, (char *)d + 4, 0) ==
              -EINVAL,
          "misaligned work accepted");
    CHECK(cuda_mmq_experts(QUANT_TYPE_Q8_0, (const void *const *)d, 4, 272, 2, 256, (int32_t *)d,
                           1, d, 256, 0, d, 2, d, 1 << 20, 0) == -EINVAL,
          "x_div 0 accepted");
    CHECK(cuda_mmq_experts(QUANT_TYPE_Q8_0, (const void *const *)d, 4, 272, 2, 256, (int32_t *)d,
                           4, d, 256, 1, d, 2, d, 64, 0) == -EINVAL,
          "small work accepted");
    CHECK(cuda_mmq_experts(QUANT_TYPE_Q8_0, (const void *const *)d, 0, 272, 2, 256, (int32_t *)d,
                           1, d, 256, 1, d, 2, d, 1 << 20, 0) == -EINVAL,
          "0 experts accepted");
    const struct cuda_mmq_part bad[5] = {{d, 4, 4}, {d, 4, 4}, {d, 4, 4}, {d, 4, 4}, {d, 4, 4}};
    CHECK(cuda_mmq_parts(QUANT_TYPE_Q4_0, d, 144, 256, d, 256, 2, bad, 0, d, 0) == -EINVAL,
          "0 parts accepted");
    CHECK(cuda_mmq_parts(QUANT_TYPE_Q4_0, d, 144, 256, d, 256, 2, bad, 5, d, 0) == -EINVAL,
          "5 parts accepted");
    const struct cuda_mmq_part empty[2] = {{d, 4, 4}, {d, 4, 0}}, short_ld[2] = {{d, 4, 4},
                                                                                 {d, 3, 4}};
    CHECK(cuda_mmq_parts(QUANT_TYPE_Q4_0, d, 144, 256, d, 256, 2, empty, 2, d, 0) == -EINVAL,
          "a part of 0 rows accepted");
    CHECK(cuda_mmq_parts(QUANT_TYPE_Q4_0, d, 144, 256, d, 256, 2, short_ld, 2, d, 0) == -EINVAL,
          "a part's ldy < its rows accepted");
    CHECK(cuda_mmq_experts_glu(QUANT_TYPE_Q8_0, (const void *const *)d, 4, 272, 2, 256,
                               (int32_t *)d, 1, d, 511, false, d, 2, d, 1 << 20, 0) == -EINVAL,
          "glu rows shorter than gate and up accepted");
    CHECK(cuda_mmq_supports(QUANT_TYPE_Q6_K) && !cuda_mmq_supports(QUANT_TYPE_Q3_K), "supports");
    log_set_level(LOG_LEVEL_INFO);
    CU(cudaDeviceSynchronize());
    CU(cudaFree(d));
}

/* ---- timing ---------------------------------------------------------------------- */

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef int (*call_fn)(const void *ctx, cudaStream_t s);

/* Median seconds of 25 calls timed one by one with events, after 3. */
static double time_calls(call_fn fn, const void *ctx)
{
    enum { WARM = 3, REPS = 25 };
    cudaStream_t s;
    cudaEvent_t e0, e1;
    float ms[REPS];
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    for (int k = -WARM; k < REPS; k++) {
        CU(cudaEventRecord(e0, s));
        CHECK(fn(ctx, s) == 0, "timed call failed");
        CU(cudaEventRecord(e1, s));
        CU(cudaEventSynchronize(e1));
        if (k >= 0)
            CU(cudaEventElapsedTime(&ms[k], e0, e1));
    }
    qsort(ms, REPS, sizeof(float), cmp_float);
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    CU(cudaStreamDestroy(s));
    return ms[REPS / 2] * 1e-3;
}

/* The forms a product can take, each by one setting: the default, then
 * LAMINA_CUDA_MMQ_WARPS=2 (the older warp layout), then LAMINA_CUDA_MMQ_PRE=0 (the copies'
 * offsets computed at every copy). */
static const char *const form_env[3][2] = {
    {NULL, NULL}, {"LAMINA_CUDA_MMQ_WARPS", "2"}, {"LAMINA_CUDA_MMQ_PRE", "0"}};

static void set_form(int f)
{
    unsetenv("LAMINA_CUDA_MMQ_WARPS");
    unsetenv("LAMINA_CUDA_MMQ_PRE");
    if (form_env[f][0])
        CHECK(setenv(form_env[f][0], form_env[f][1], 1) == 0, "setenv");
}

/* The product in each form: median seconds of each in t, every form's n_out floats of d_Y
 * byte for byte the default's. */
static void time_forms(const char *what, call_fn fn, const void *ctx, float *d_Y,
                         size_t n_out, double t[3])
{
    float *first = xmalloc(n_out * sizeof(float)), *got = xmalloc(n_out * sizeof(float));
    for (int f = 0; f < 3; f++) {
        set_form(f);
        CU(cudaMemset(d_Y, 0xFF, n_out * sizeof(float)));
        t[f] = time_calls(fn, ctx);
        CU(cudaMemcpy(f ? got : first, d_Y, n_out * sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(!f || memcmp(got, first, n_out * sizeof(float)) == 0,
              "%s: %s=%s does not give the default's bytes", what, form_env[f][0],
              form_env[f][1]);
    }
    set_form(0);
    /* the default's output left in d_Y for the caller's checks */
    CU(cudaMemcpy(d_Y, first, n_out * sizeof(float), cudaMemcpyHostToDevice));
    free(first);
    free(got);
}

struct dense_ctx {
    uint32_t type;
    const void *d_w;
    size_t rb;
    uint64_t rows, n;
    uint32_t S;
    const float *d_X;
    float *d_Y;
    void *d_work;
};

static int dense_mmq(const void *ctx, cudaStream_t s)
{
    const struct dense_ctx *c = ctx;
    return cuda_mmq(c->type, c->d_w, c->rb, c->rows, c->n, c->d_X, c->n, c->S, c->d_Y, c->rows,
                    c->d_work, s);
}

static int dense_matmul(const void *ctx, cudaStream_t s)
{
    const struct dense_ctx *c = ctx;
    return cuda_matmul(c->type, c->d_w, c->rb, c->rows, c->n, c->d_X, c->n, c->S, c->d_Y, c->rows,
                       s);
}

/* Sampled outputs of a benchmark against the reference. */
static void check_samples(const char *what, uint32_t type, const uint8_t *w_host, size_t rb,
                          uint64_t n, const float *X, const float *got, uint64_t rows,
                          uint32_t n_out, const uint32_t *x_row_of, const uint32_t *mat_of,
                          size_t mat_bytes, struct rng *r)
{
    struct mat m = {type, 1, n, rb, rb, NULL, NULL};
    double *xq = xmalloc(n * sizeof(double));
    struct errs e = {0};
    for (int k = 0; k < 64; k++) {
        const uint32_t o = (uint32_t)(rng_next(r) % n_out);
        const uint64_t row = rng_next(r) % rows;
        m.w = (uint8_t *)w_host + (mat_of ? mat_of[o] : 0) * mat_bytes + row * rb;
        mat_dequantize(&m);
        const float *x = X + (size_t)(x_row_of ? x_row_of[o] : o) * n;
        round_row(x, n, xq);
        check_dot(what, &m, 0, x, xq, got[(size_t)o * rows + row], &e);
        free(m.deq);
        m.deq = NULL;
    }
    free(xq);
}

static void bench_dense(uint32_t type, uint64_t rows, uint64_t n, uint32_t S, struct rng *r)
{
    const size_t rb = quant_row_size(type, n), bytes = rows * rb;
    uint8_t *h = xmalloc(bytes), *d_w;
    for (uint64_t i = 0; i < rows; i++)
        fill_blocks(type, h + i * rb, rb, r);
    CU(cudaMalloc((void **)&d_w, bytes));
    CU(cudaMemcpy(d_w, h, bytes, cudaMemcpyHostToDevice));
    float *X = rand_floats((size_t)S * n, r), *d_X = dev_floats(X, (size_t)S * n);
    float *d_Y = dev_poison((size_t)S * rows), *got = xmalloc((size_t)S * rows * sizeof(float));
    void *d_work;
    CU(cudaMalloc(&d_work, cuda_mmq_work_bytes(n, S)));
    struct dense_ctx c = {type, d_w, rb, rows, n, S, d_X, d_Y, d_work};
    double tl[3];
    time_forms("bench dense", dense_mmq, &c, d_Y, (size_t)S * rows, tl);
    const double t_mmq = tl[0];
    CU(cudaMemcpy(got, d_Y, (size_t)S * rows * sizeof(float), cudaMemcpyDeviceToHost));
    check_samples("bench dense", type, h, rb, n, X, got, rows, S, NULL, NULL, 0, r);
    const double t_mm = time_calls(dense_matmul, &c), flop = 2.0 * S * rows * n;
    MEASURE("mmq dense %-4s %llu x %llu, S=%u: %.1f us, %.1f TFLOP/s, %.0f GB/s of weights "
            "(LAMINA_CUDA_MMQ_WARPS=2 %.1f us, LAMINA_CUDA_MMQ_PRE=0 %.1f us); cuda_matmul "
            "%.1f us, %.1f TFLOP/s (mmq %.2fx)",
            quant_type_name(type), (unsigned long long)rows, (unsigned long long)n, S,
            t_mmq * 1e6, flop / t_mmq * 1e-12, bytes / t_mmq * 1e-9, tl[1] * 1e6, tl[2] * 1e6,
            t_mm * 1e6, flop / t_mm * 1e-12, t_mm / t_mmq);
    CU(cudaFree(d_w));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    CU(cudaFree(d_work));
    free(h);
    free(X);
    free(got);
}

struct ex_ctx {
    uint32_t type, E;
    const void *const *d_addr;
    size_t rb;
    uint64_t rows, n;
    const int32_t *d_ids;
    uint32_t n_pairs, x_div;
    const float *d_X;
    float *d_Y;
    void *d_work;
    size_t work_bytes;
};

static int ex_mmq(const void *ctx, cudaStream_t s)
{
    const struct ex_ctx *c = ctx;
    return cuda_mmq_experts(c->type, c->d_addr, c->E, c->rb, c->rows, c->n, c->d_ids, c->n_pairs,
                            c->d_X, c->n, c->x_div, c->d_Y, c->rows, c->d_work, c->work_bytes, s);
}

static int ex_matvec(const void *ctx, cudaStream_t s)
{
    const struct ex_ctx *c = ctx;
    return cuda_matvec_experts(c->type, c->d_addr, c->rb, c->rows, c->n, c->d_ids, c->n_pairs,
                               c->d_X, c->n, c->x_div, c->d_Y, c->rows, s);
}

/* n_tok tokens, top_k distinct random experts each, over E experts of
 * rows x n: the weights of every used expert come once from memory. */
static void bench_experts(uint32_t type, uint32_t E, uint32_t top_k, uint32_t n_tok,
                          uint32_t x_div, uint64_t rows, uint64_t n, struct rng *r)
{
    const size_t rb = quant_row_size(type, n), bytes = rows * rb;
    const uint32_t n_pairs = n_tok * top_k, x_rows = (n_pairs - 1) / x_div + 1;
    uint8_t *h = xmalloc(bytes * E), *d_w;
    for (uint64_t i = 0; i < rows * E; i++)
        fill_blocks(type, h + i * rb, rb, r);
    CU(cudaMalloc((void **)&d_w, bytes * E));
    CU(cudaMemcpy(d_w, h, bytes * E, cudaMemcpyHostToDevice));
    const void **addr = xmalloc(E * sizeof(void *));
    for (uint32_t k = 0; k < E; k++)
        addr[k] = d_w + k * bytes;
    struct ex_case ec = {E, top_k, n_tok, x_div, rows, n, 0};
    int32_t *ids = xmalloc(n_pairs * sizeof(int32_t));
    make_ids(ids, &ec, r);
    uint32_t used = 0, *x_row_of = xmalloc(n_pairs * sizeof(uint32_t));
    uint8_t *seen = calloc(E, 1);
    for (uint32_t p = 0; p < n_pairs; p++) {
        used += !seen[ids[p]];
        seen[ids[p]] = 1;
        x_row_of[p] = p / x_div;
    }
    float *X = rand_floats((size_t)x_rows * n, r), *d_X = dev_floats(X, (size_t)x_rows * n);
    float *d_Y = dev_poison((size_t)n_pairs * rows);
    float *got = xmalloc((size_t)n_pairs * rows * sizeof(float));
    const void **d_addr;
    int32_t *d_ids;
    void *d_work;
    const size_t wb = cuda_mmq_experts_work_bytes(n, n_pairs, E);
    CU(cudaMalloc((void **)&d_addr, E * sizeof(void *)));
    CU(cudaMemcpy(d_addr, addr, E * sizeof(void *), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&d_ids, n_pairs * sizeof(int32_t)));
    CU(cudaMemcpy(d_ids, ids, n_pairs * sizeof(int32_t), cudaMemcpyHostToDevice));
    CU(cudaMalloc(&d_work, wb));
    struct ex_ctx c = {type, E, (const void *const *)d_addr, rb, rows, n, d_ids,
                       n_pairs, x_div, d_X, d_Y, d_work, wb};
    double tl[3];
    time_forms("bench experts", ex_mmq, &c, d_Y, (size_t)n_pairs * rows, tl);
    const double t_mmq = tl[0];
    CU(cudaMemcpy(got, d_Y, (size_t)n_pairs * rows * sizeof(float), cudaMemcpyDeviceToHost));
    check_samples("bench experts", type, h, rb, n, X, got, rows, n_pairs, x_row_of,
                  (const uint32_t *)ids, bytes, r);
    const double t_mv = time_calls(ex_matvec, &c), flop = 2.0 * n_pairs * rows * n;
    MEASURE("mmq experts %-4s %u tokens top-%u of %u x (%llu x %llu), x_div %u: %.1f us, "
            "%.1f TFLOP/s, %.0f GB/s of the %u experts used (LAMINA_CUDA_MMQ_WARPS=2 %.1f us, "
            "LAMINA_CUDA_MMQ_PRE=0 %.1f us, %.0f GB/s); cuda_matvec_experts %.1f us, "
            "%.2f TFLOP/s (mmq %.2fx)",
            quant_type_name(type), n_tok, top_k, E, (unsigned long long)rows,
            (unsigned long long)n, x_div, t_mmq * 1e6, flop / t_mmq * 1e-12,
            (double)used * bytes / t_mmq * 1e-9, used, tl[1] * 1e6, tl[2] * 1e6,
            (double)used * bytes / tl[2] * 1e-9, t_mv * 1e6, flop / t_mv * 1e-12, t_mv / t_mmq);
    CU(cudaFree(d_w));
    CU(cudaFree(d_addr));
    CU(cudaFree(d_ids));
    CU(cudaFree(d_X));
    CU(cudaFree(d_Y));
    CU(cudaFree(d_work));
    free(h);
    free(addr);
    free(ids);
    free(x_row_of);
    free(seen);
    free(X);
    free(got);
}

int main(void)
{
    log_init("test", -1);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fprintf(stderr, "test_mmq_cuda: no CUDA device (%s); this test needs a GPU\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 1;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    const int cc = cuda_caps_cc(); /* LAMINA_CUDA_AS_SM may lower it (caps.h) */
    printf("device: %s, %d SMs, sm_%d%d, as sm_%d\n", prop.name, prop.multiProcessorCount,
           prop.major, prop.minor, cc);
    if (cc < 80) {
        CHECK(cuda_mmq(QUANT_TYPE_Q4_0, NULL, 144, 1, 256, NULL, 256, 1, NULL, 1, NULL, 0) ==
                  -ENOTSUP,
              "mmq before sm_80 must answer -ENOTSUP");
        return test_main_result("test_mmq_cuda");
    }
    struct rng r = {0x9E3779B97F4A7C15ull};
    test_rejects();
    /* against the reference in every form */
    for (int f = 0; f < 3; f++) {
        set_form(f);
        test_dense(&r);
        test_parts(&r);
        test_experts(&r);
    }
    set_form(0);
    bench_dense(QUANT_TYPE_Q4_0, 2048, 8192, 512, &r);
    bench_dense(QUANT_TYPE_Q8_0, 2048, 8192, 512, &r);
    bench_dense(QUANT_TYPE_Q4_0, 8192, 2048, 512, &r);
    bench_experts(QUANT_TYPE_Q4_0, 512, 10, 512, 10, 512, 2048, &r);
    bench_experts(QUANT_TYPE_Q4_0, 512, 10, 512, 10, 1024, 2048, &r);
    bench_experts(QUANT_TYPE_Q4_0, 512, 10, 2048, 10, 512, 2048, &r);
    bench_experts(QUANT_TYPE_Q4_0, 512, 10, 512, 1, 2048, 512, &r);
    /* a Q4_K_M file's Q6_K: a DeltaNet qkv stack (rows of 16-byte chunks) and the
     * experts' down product (rows of 420 bytes: 4-byte copies) */
    bench_dense(QUANT_TYPE_Q6_K, 8192, 2048, 512, &r);
    bench_experts(QUANT_TYPE_Q6_K, 512, 10, 512, 1, 2048, 512, &r);
    return test_main_result("test_mmq_cuda");
}
