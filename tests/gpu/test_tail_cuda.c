/*
 * test_tail_cuda: the cuda tails (kernels/cuda/tail.h) give the bits of the
 * stand-alone kernels they replace.
 *
 * On fresh random data (outputs poisoned before each run), each fused
 * launch is compared byte for byte with the two launches it replaces:
 *   - ADD_NORM: cuda_matvec_tail of a Q4_0 product (rows of n_in 1024: the
 *     int8 kernel; 4096: the f32 kernel) against cuda_matvec then
 *     cuda_add_rmsnorm: y, h and the normalised row;
 *   - TOPK: an F32 router product against cuda_matvec then cuda_router_topk:
 *     logits, ids and weights; the tail picking by rounds (topk_rounds)
 *     against the kernel's counted places: ids and weights;
 *   - COMBINE: the SiLU-gated Q4_0 expert down product of one token's k
 *     pairs (cuda_mvq_experts_glu_tail) against cuda_mvq_experts_glu then
 *     cuda_moe_combine_norm / cuda_moe_combine, with and without the gated
 *     shared expert and the next norm: Y, h and the normalised row;
 *   - COMBINE_COLS: the same down product with the combine split over the
 *     grid's columns against cuda_mvq_experts_glu then cuda_moe_combine,
 *     the shared expert absent, beside (its own output) or as pair k (row
 *     k of Y), gated or not, twice in a row on the same h: Y and h, and
 *     every column counter back at 0;
 *   - down + combine by rows (cuda_moe_down_combine, Q4_0 and Q8_0) against
 *     cuda_mvq_experts_glu then cuda_moe_combine, the shared expert as pair
 *     k or absent, gated or not, twice in a row on the same h: Y and h;
 *   - cuda_mvq_xq_tail (the product over a row its producer rounded) over x
 *     rounded on the host against cuda_mvq_tail over x, Q4_0 and Q8_0, rows
 *     of 1024 to 8192, with the ADD_NORM tail and without: y, h and the
 *     normalised row; an unaligned row and a combine tail refused;
 *   - cuda_matvec_norm (the norm inside the input product) against
 *     cuda_rmsnorm_wide then cuda_matvec, Q4_0 and Q8_0, with and without
 *     norm weights: y; -ENOTSUP where the kernels do not take it;
 *   - cuda_mvq_experts_prefetch (the decode gate/up product) against
 *     cuda_mvq_experts, tables of 64 to 1100 entries, the ids read after
 *     the wait or polled, a second table's L2 prefetch off, before or after
 *     each block's rows: the rows byte for byte, a pair of id -1 untouched;
 *   - the shared expert's gate summed by a block of the router's norm-in
 *     launch (cuda_norm_in.gate) and read by the early combine against the
 *     combine summing it: the router's outputs and the combine's h, next norm
 *     and its rounding byte for byte, combine clusters of 8, 4, 2 and one
 *     block; the gate against the host's; a gate without its output refused;
 * at hidden sizes whose stand-alone block widths differ (32 up to 1024
 * threads), each fused launch three times in a row (the counter must come
 * back to 0, checked after). Bad tails are refused (-EINVAL).
 * Then, timed: the three boundaries of a decode layer of the 80b-a3b shape
 * fused and unfused, each as a CUDA graph of 48 copies replayed (median of
 * 20 replays after warm-up), and the MoE after the router (gate/up, down,
 * combine) with the down and combine as two launches or one: [measure]
 * lines in us per layer.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "kernels/cuda/caps.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/mvq.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/tail.h"
#include "model/quant.h"
#include "tests/gpu/gpu_check.h"
#include "tests/gpu/xq_check.h"

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                   \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

static void *dev_q4_0(uint64_t rows, uint64_t n, struct rng *r)
{
    return dev_quant_rows(QUANT_TYPE_Q4_0, rows, n, r);
}

/* Byte comparison of two device buffers (CHECKed); true when equal. */
static bool same(const void *a, const void *b, size_t bytes, const char *what)
{
    const size_t first = dev_first_diff(a, b, bytes);
    CHECK(first == bytes, "%s: differs from byte %zu of %zu", what, first, bytes);
    return first == bytes;
}

/* ---- ADD_NORM -------------------------------------------------------------- */

/* The reference's [0] and the fused launch's [1] residual row h, product
 * output y and norm output, each from the host row hh of n (y and the norm
 * output poisoned). */
struct norm_pair {
    float *h[2], *y[2], *out[2];
};

static void norm_pair_make(struct norm_pair *p, const float *hh, uint32_t n)
{
    for (int i = 0; i < 2; i++) {
        p->h[i] = dev_floats(hh, n);
        p->y[i] = dev_floats(hh, n);
        p->out[i] = dev_floats(hh, n);
        dev_poison_bytes(p->y[i], n * sizeof(float));
        dev_poison_bytes(p->out[i], n * sizeof(float));
    }
}

static void norm_pair_free(struct norm_pair *p)
{
    for (int i = 0; i < 2; i++) {
        cudaFree(p->h[i]);
        cudaFree(p->y[i]);
        cudaFree(p->out[i]);
    }
}

static void test_add_norm(uint32_t n, uint32_t n_in, unsigned int *ctr, struct rng *r)
{
    char what[96];
    void *W = dev_q4_0(n, n_in, r);
    const size_t rb = quant_row_size(QUANT_TYPE_Q4_0, n_in);
    float *hx = rand_floats(n_in, r), *hh = rand_floats(n, r), *hw = rand_floats(n, r);
    float *x = dev_floats(hx, n_in), *nw = dev_floats(hw, n);
    struct norm_pair p;
    norm_pair_make(&p, hh, n);
    float *const *h = p.h, *const *y = p.y, *const *out = p.out;
    const float eps = 1e-6f;
    int rc = cuda_matvec(QUANT_TYPE_Q4_0, W, rb, n, n_in, x, y[0], 0);
    rc = rc ? rc : cuda_add_rmsnorm(h[0], y[0], out[0], nw, n, 1, eps, 0);
    CHECK(rc == 0, "add_norm n %u: unfused rc %d", n, rc);
    const struct cuda_tail t = {.kind = CUDA_TAIL_ADD_NORM, .counter = ctr, .n = n, .eps = eps,
                                .h = h[1], .norm_w = nw, .out = out[1]};
    rc = cuda_matvec_tail(QUANT_TYPE_Q4_0, W, rb, n, n_in, x, y[1], &t, 0);
    CHECK(rc == 0, "add_norm n %u: fused rc %d", n, rc);
    CU(cudaDeviceSynchronize());
    snprintf(what, sizeof(what), "add_norm n %u n_in %u: y", n, n_in);
    bool ok = same(y[0], y[1], n * sizeof(float), what);
    snprintf(what, sizeof(what), "add_norm n %u n_in %u: h", n, n_in);
    ok &= same(h[0], h[1], n * sizeof(float), what);
    snprintf(what, sizeof(what), "add_norm n %u n_in %u: norm", n, n_in);
    ok &= same(out[0], out[1], n * sizeof(float), what);
    /* twice more: the counter must have come back to 0 each time */
    for (int rep = 0; rep < 2; rep++) {
        rc = cuda_matvec(QUANT_TYPE_Q4_0, W, rb, n, n_in, x, y[0], 0);
        rc = rc ? rc : cuda_add_rmsnorm(h[0], y[0], out[0], nw, n, 1, eps, 0);
        rc = rc ? rc : cuda_matvec_tail(QUANT_TYPE_Q4_0, W, rb, n, n_in, x, y[1], &t, 0);
        CHECK(rc == 0, "add_norm n %u: repeat rc %d", n, rc);
    }
    CU(cudaDeviceSynchronize());
    snprintf(what, sizeof(what), "add_norm n %u n_in %u: h after 3 launches", n, n_in);
    ok &= same(h[0], h[1], n * sizeof(float), what);
    snprintf(what, sizeof(what), "add_norm n %u n_in %u: norm after 3 launches", n, n_in);
    ok &= same(out[0], out[1], n * sizeof(float), what);
    CHECK(dev_counter(ctr) == 0, "add_norm n %u: counter %u after the launches", n,
          dev_counter(ctr));
    printf("add_norm n %u n_in %u (%s): %s\n", n, n_in, n_in <= 2048 ? "int8 kernel" : "f32 kernel",
           ok ? "identical" : "DIFFERENT");
    norm_pair_free(&p);
    cudaFree(W);
    cudaFree(x);
    cudaFree(nw);
    free(hx);
    free(hh);
    free(hw);
}

/* ---- the product over a row its producer rounded (cuda_mvq_xq_tail) -------- */

/* cuda_mvq_xq_tail over x rounded here (tests/gpu/xq_check.h) against
 * cuda_mvq_tail over x, with an ADD_NORM tail or none: y, h and the
 * normalised row byte for byte, twice (the counter back at 0). */
static void test_xq_tail(uint32_t type, uint32_t n, uint32_t n_in, bool tail, unsigned int *ctr,
                         struct rng *r)
{
    char what[112];
    void *W = dev_quant_rows(type, n, n_in, r);
    const size_t rb = quant_row_size(type, n_in), xb = cuda_mvq_xq_bytes(n_in);
    float *hx = rand_floats(n_in, r), *hh = rand_floats(n, r), *hw = rand_floats(n, r);
    for (uint32_t j = 0; j < n_in; j += 97)
        hx[j] *= 40.0f; /* a few large values: blocks of unequal scales */
    uint8_t *hq = xmalloc(xb);
    xq_round(hx, hq, n_in);
    float *x = dev_floats(hx, n_in), *nw = dev_floats(hw, n);
    int8_t *xq;
    CU(cudaMalloc((void **)&xq, xb));
    CU(cudaMemcpy(xq, hq, xb, cudaMemcpyHostToDevice));
    struct norm_pair p;
    norm_pair_make(&p, hh, n);
    float *const *h = p.h, *const *y = p.y, *const *out = p.out;
    struct cuda_tail t[2];
    for (int i = 0; i < 2; i++)
        t[i] = (struct cuda_tail){.kind = CUDA_TAIL_ADD_NORM, .counter = ctr, .n = n,
                                  .eps = 1e-6f, .h = h[i], .norm_w = nw, .out = out[i]};
    int rc0 = 0, rc1 = 0;
    for (int rep = 0; rep < 2; rep++) {
        rc0 = rc0 ? rc0 : cuda_mvq_tail(type, W, rb, n, n_in, x, y[0], tail ? &t[0] : NULL, 0);
        rc1 = rc1 ? rc1 : cuda_mvq_xq_tail(type, W, rb, n, n_in, xq, y[1], tail ? &t[1] : NULL, 0);
    }
    CU(cudaDeviceSynchronize());
    CHECK(rc0 == 0 && rc1 == 0, "xq_tail %s %u x %u: rc %d (over x) %d (over xq)",
          quant_type_name(type), n, n_in, rc0, rc1);
    snprintf(what, sizeof(what), "xq_tail %s %u x %u%s: y", quant_type_name(type), n, n_in,
             tail ? " + add_norm" : "");
    bool ok = same(y[0], y[1], n * sizeof(float), what);
    if (tail) {
        snprintf(what, sizeof(what), "xq_tail %s %u x %u: h", quant_type_name(type), n, n_in);
        ok &= same(h[0], h[1], n * sizeof(float), what);
        snprintf(what, sizeof(what), "xq_tail %s %u x %u: norm", quant_type_name(type), n, n_in);
        ok &= same(out[0], out[1], n * sizeof(float), what);
    }
    CHECK(dev_counter(ctr) == 0, "xq_tail: counter %u after the launches", dev_counter(ctr));
    printf("xq_tail %s %u x %u%s: %s\n", quant_type_name(type), n, n_in,
           tail ? " + add_norm" : "", ok && rc0 == 0 && rc1 == 0 ? "identical" : "DIFFERENT");
    /* refused: an unaligned row (-ENOTSUP), a combine tail (-EINVAL) */
    rc1 = cuda_mvq_xq_tail(type, W, rb, n, n_in, xq + 8, y[1], NULL, 0);
    CHECK(rc1 == -ENOTSUP, "xq_tail: an unaligned row gave %d", rc1);
    const struct cuda_tail bad = {.kind = CUDA_TAIL_COMBINE, .counter = ctr, .n = n};
    rc1 = cuda_mvq_xq_tail(type, W, rb, n, n_in, xq, y[1], &bad, 0);
    CHECK(rc1 == -EINVAL, "xq_tail: a combine tail gave %d", rc1);
    norm_pair_free(&p);
    cudaFree(W);
    cudaFree(x);
    cudaFree(xq);
    cudaFree(nw);
    free(hx);
    free(hh);
    free(hw);
    free(hq);
}

/* ---- TOPK ------------------------------------------------------------------ */

static void test_topk(uint32_t E, uint32_t k, uint32_t n, unsigned int *ctr, struct rng *r)
{
    char what[96];
    float *hW = rand_floats((size_t)E * n, r), *hx = rand_floats(n, r);
    if (E >= 8) /* planted ties: equal rows give equal logits */
        memcpy(hW + (size_t)5 * n, hW + (size_t)2 * n, n * sizeof(float));
    float *W = dev_floats(hW, (size_t)E * n), *x = dev_floats(hx, n);
    float *lg[3], *w[3];
    int32_t *ids[3];
    for (int i = 0; i < 3; i++) {
        CU(cudaMalloc((void **)&lg[i], E * sizeof(float)));
        CU(cudaMalloc((void **)&w[i], k * sizeof(float)));
        CU(cudaMalloc((void **)&ids[i], k * sizeof(int32_t)));
        dev_poison_bytes(lg[i], E * sizeof(float));
        dev_poison_bytes(w[i], k * sizeof(float));
        dev_poison_bytes(ids[i], k * sizeof(int32_t));
    }
    int rc = cuda_matvec(QUANT_TYPE_F32, W, n * sizeof(float), E, n, x, lg[0], 0);
    rc = rc ? rc : cuda_router_topk(lg[0], E, k, 1, ids[0], w[0], 0);
    CHECK(rc == 0, "topk E %u: unfused rc %d", E, rc);
    const struct cuda_tail t = {.kind = CUDA_TAIL_TOPK, .counter = ctr, .k = k, .ids = ids[1],
                                .w = w[1]};
    for (int rep = 0; rep < 3 && rc == 0; rep++)
        rc = cuda_matvec_tail(QUANT_TYPE_F32, W, n * sizeof(float), E, n, x, lg[1], &t, 0);
    CHECK(rc == 0, "topk E %u: fused rc %d", E, rc);
    /* the tail picking by rounds (topk_rounds) against the kernel's counted places */
    const struct cuda_tail tr = {.kind = CUDA_TAIL_TOPK, .counter = ctr, .k = k, .ids = ids[2],
                                 .w = w[2], .topk_rounds = true};
    rc = cuda_matvec_tail(QUANT_TYPE_F32, W, n * sizeof(float), E, n, x, lg[2], &tr, 0);
    CHECK(rc == 0, "topk E %u: fused by rounds rc %d", E, rc);
    CU(cudaDeviceSynchronize());
    snprintf(what, sizeof(what), "topk E %u k %u: logits", E, k);
    bool ok = same(lg[0], lg[1], E * sizeof(float), what);
    snprintf(what, sizeof(what), "topk E %u k %u: ids", E, k);
    ok &= same(ids[0], ids[1], k * sizeof(int32_t), what);
    snprintf(what, sizeof(what), "topk E %u k %u: weights", E, k);
    ok &= same(w[0], w[1], k * sizeof(float), what);
    snprintf(what, sizeof(what), "topk E %u k %u: ids by rounds", E, k);
    ok &= same(ids[0], ids[2], k * sizeof(int32_t), what);
    snprintf(what, sizeof(what), "topk E %u k %u: weights by rounds", E, k);
    ok &= same(w[0], w[2], k * sizeof(float), what);
    CHECK(dev_counter(ctr) == 0, "topk: counter %u after the launches", dev_counter(ctr));
    printf("topk E %u k %u n %u: %s\n", E, k, n, ok ? "identical" : "DIFFERENT");
    for (int i = 0; i < 3; i++) {
        cudaFree(lg[i]);
        cudaFree(w[i]);
        cudaFree(ids[i]);
    }
    cudaFree(W);
    cudaFree(x);
    free(hW);
    free(hx);
}

/* ---- COMBINE --------------------------------------------------------------- */

struct experts {
    uint32_t E, n, F;
    size_t rb;
    void **d_w;         /* per expert: n x F of the type */
    const void **d_tab; /* device table of their addresses */
};

static struct experts make_experts_of(uint32_t type, uint32_t E, uint32_t n, uint32_t F,
                                      struct rng *r)
{
    struct experts x = {E, n, F, quant_row_size(type, F), NULL, NULL};
    x.d_w = xmalloc(E * sizeof(void *));
    for (uint32_t e = 0; e < E; e++)
        x.d_w[e] = dev_quant_rows(type, n, F, r);
    CU(cudaMalloc((void **)&x.d_tab, E * sizeof(void *)));
    CU(cudaMemcpy(x.d_tab, x.d_w, E * sizeof(void *), cudaMemcpyHostToDevice));
    return x;
}

static struct experts make_experts(uint32_t E, uint32_t n, uint32_t F, struct rng *r)
{
    return make_experts_of(QUANT_TYPE_Q4_0, E, n, F, r);
}

static void free_experts(struct experts *x)
{
    for (uint32_t e = 0; e < x->E; e++)
        cudaFree(x->d_w[e]);
    free(x->d_w);
    cudaFree((void *)x->d_tab);
}

/* k (<= 17) distinct ids of E, uploaded. */
static int32_t *dev_ids(uint32_t E, uint32_t k, struct rng *r)
{
    int32_t h[17];
    for (uint32_t i = 0; i < k; i++) {
        bool dup;
        do {
            h[i] = (int32_t)(rng_next(r) % E);
            dup = false;
            for (uint32_t j = 0; j < i; j++)
                dup |= h[j] == h[i];
        } while (dup);
    }
    int32_t *d;
    CU(cudaMalloc((void **)&d, k * sizeof(int32_t)));
    CU(cudaMemcpy(d, h, k * sizeof(int32_t), cudaMemcpyHostToDevice));
    return d;
}

static void test_combine(uint32_t n, uint32_t F, uint32_t k, bool shared, bool gated, bool norm,
                         unsigned int *ctr, struct rng *r)
{
    char what[128];
    const uint32_t E = 24;
    struct experts X = make_experts(E, n, F, r);
    int32_t *ids = dev_ids(E, k, r);
    float *hgu = rand_floats((size_t)k * 2 * F, r), *hwt = rand_floats(k, r);
    float *hh = rand_floats(n, r), *hso = rand_floats(n, r), *hg = rand_floats(n, r);
    float *hf = rand_floats(n, r), *hnw = rand_floats(n, r);
    float *gu = dev_floats(hgu, (size_t)k * 2 * F), *wt = dev_floats(hwt, k);
    float *so = dev_floats(hso, n), *gate = dev_floats(hg, n), *nw = dev_floats(hnw, n);
    float *h[2], *xa[2], *Y[2];
    for (int i = 0; i < 2; i++) {
        h[i] = dev_floats(hh, n);
        xa[i] = dev_floats(hf, n); /* the gate's input, overwritten by the norm */
        CU(cudaMalloc((void **)&Y[i], (size_t)k * n * sizeof(float)));
        dev_poison_bytes(Y[i], (size_t)k * n * sizeof(float));
    }
    const float eps = 1e-6f;
    int rc = cuda_mvq_experts_glu(QUANT_TYPE_Q4_0, X.d_tab, X.rb, n, F, ids, k, gu, 2 * F, 1,
                                  true, Y[0], n, 0);
    if (norm)
        rc = rc ? rc : cuda_moe_combine_norm(h[0], Y[0], wt, k, shared ? so : NULL,
                                             gated ? gate : NULL, xa[0], n, 1, nw, eps, xa[0], 0);
    else
        rc = rc ? rc : cuda_moe_combine(h[0], Y[0], wt, k, shared ? so : NULL,
                                        gated ? gate : NULL, xa[0], n, 1, 0);
    CHECK(rc == 0, "combine n %u: unfused rc %d", n, rc);
    const struct cuda_tail t = {.kind = CUDA_TAIL_COMBINE, .counter = ctr, .n = n, .eps = eps,
                                .h = h[1], .norm_w = norm ? nw : NULL, .out = xa[1], .k = k,
                                .w = wt, .so = shared ? so : NULL,
                                .shexp_gate = gated ? gate : NULL, .f = xa[1]};
    rc = cuda_mvq_experts_glu_tail(QUANT_TYPE_Q4_0, X.d_tab, X.rb, n, F, ids, 0, k, gu, 2 * F,
                                   true, Y[1], &t, 0);
    CHECK(rc == 0, "combine n %u: fused rc %d", n, rc);
    CU(cudaDeviceSynchronize());
    const char *shape = shared ? (gated ? "gated shared" : "shared") : "no shared";
    snprintf(what, sizeof(what), "combine n %u k %u %s%s: Y", n, k, shape, norm ? " norm" : "");
    bool ok = same(Y[0], Y[1], (size_t)k * n * sizeof(float), what);
    snprintf(what, sizeof(what), "combine n %u k %u %s%s: h", n, k, shape, norm ? " norm" : "");
    ok &= same(h[0], h[1], n * sizeof(float), what);
    snprintf(what, sizeof(what), "combine n %u k %u %s%s: xa", n, k, shape, norm ? " norm" : "");
    ok &= same(xa[0], xa[1], n * sizeof(float), what);
    CHECK(dev_counter(ctr) == 0, "combine: counter %u after the launch", dev_counter(ctr));
    printf("combine n %u F %u k %u, %s%s (%u threads stand-alone): %s\n", n, F, k, shape,
           norm ? ", next norm" : "", cuda_norm_wide_threads(n), ok ? "identical" : "DIFFERENT");
    for (int i = 0; i < 2; i++) {
        cudaFree(h[i]);
        cudaFree(xa[i]);
        cudaFree(Y[i]);
    }
    cudaFree(gu);
    cudaFree(wt);
    cudaFree(so);
    cudaFree(gate);
    cudaFree(nw);
    cudaFree(ids);
    free_experts(&X);
    free(hgu);
    free(hwt);
    free(hh);
    free(hso);
    free(hg);
    free(hf);
    free(hnw);
}

/* shared: 0 none, 1 its own output, 2 pair k of the product (row k of Y).
 * early: the fused launch reads the ids and the gate's input before its
 * PDL wait (they were written long before). */
static void test_combine_cols(uint32_t n, uint32_t F, uint32_t k, int shared, bool gated,
                              bool early, unsigned int *cols, struct rng *r)
{
    char what[128];
    const uint32_t E = 24, P = k + (shared == 2);
    struct experts X = make_experts(E, n, F, r);
    int32_t *ids = dev_ids(E, P, r);
    float *hgu = rand_floats((size_t)P * 2 * F, r), *hwt = rand_floats(k, r);
    float *hh = rand_floats(n, r), *hso = rand_floats(n, r), *hg = rand_floats(n, r);
    float *hf = rand_floats(n, r);
    float *gu = dev_floats(hgu, (size_t)P * 2 * F), *wt = dev_floats(hwt, k);
    float *sob = dev_floats(hso, n), *gate = dev_floats(hg, n), *f = dev_floats(hf, n);
    float *h[2], *Y[2];
    for (int i = 0; i < 2; i++) {
        h[i] = dev_floats(hh, n);
        CU(cudaMalloc((void **)&Y[i], (size_t)P * n * sizeof(float)));
        dev_poison_bytes(Y[i], (size_t)P * n * sizeof(float));
    }
    int rc = 0;
    for (int rep = 0; rep < 2 && !rc; rep++) {
        const float *so0 = shared == 2 ? Y[0] + (size_t)k * n : shared ? sob : NULL;
        rc = cuda_mvq_experts_glu(QUANT_TYPE_Q4_0, X.d_tab, X.rb, n, F, ids, P, gu, 2 * F, 1,
                                  true, Y[0], n, 0);
        rc = rc ? rc : cuda_moe_combine(h[0], Y[0], wt, k, so0, gated ? gate : NULL, f, n, 1, 0);
    }
    CHECK(rc == 0, "combine cols n %u: unfused rc %d", n, rc);
    const struct cuda_tail t = {.kind = CUDA_TAIL_COMBINE_COLS, .counter = cols, .n = n,
                                .h = h[1], .k = k, .w = wt,
                                .so = shared == 2 ? Y[1] + (size_t)k * n : shared ? sob : NULL,
                                .shexp_gate = gated ? gate : NULL, .f = f};
    for (int rep = 0; rep < 2 && !rc; rep++)
        rc = cuda_mvq_experts_glu_tail(QUANT_TYPE_Q4_0, X.d_tab, X.rb, n, F, ids, early ? E : 0,
                                       P, gu, 2 * F, true, Y[1], &t, 0);
    CHECK(rc == 0, "combine cols n %u: fused rc %d", n, rc);
    CU(cudaDeviceSynchronize());
    const char *shape = shared == 2 ? "shared pair" : shared ? "shared" : "no shared";
    snprintf(what, sizeof(what), "combine cols n %u k %u %s%s: Y", n, k, shape,
             gated ? " gated" : "");
    bool ok = same(Y[0], Y[1], (size_t)P * n * sizeof(float), what);
    snprintf(what, sizeof(what), "combine cols n %u k %u %s%s: h", n, k, shape,
             gated ? " gated" : "");
    ok &= same(h[0], h[1], n * sizeof(float), what);
    unsigned int *hc = xmalloc(CUDA_TAIL_COLS_MAX * sizeof(unsigned int));
    CU(cudaMemcpy(hc, cols, CUDA_TAIL_COLS_MAX * sizeof(unsigned int), cudaMemcpyDeviceToHost));
    uint32_t left = 0;
    for (uint32_t i = 0; i < CUDA_TAIL_COLS_MAX; i++)
        left += hc[i] != 0;
    CHECK(left == 0, "combine cols: %u column counters not 0 after the launches", left);
    free(hc);
    printf("combine cols n %u F %u k %u, %s%s%s, twice: %s\n", n, F, k, shape,
           gated ? " gated" : "", early ? ", early ids" : "", ok ? "identical" : "DIFFERENT");
    for (int i = 0; i < 2; i++) {
        cudaFree(h[i]);
        cudaFree(Y[i]);
    }
    cudaFree(gu);
    cudaFree(wt);
    cudaFree(sob);
    cudaFree(gate);
    cudaFree(f);
    cudaFree(ids);
    free_experts(&X);
    free(hgu);
    free(hwt);
    free(hh);
    free(hso);
    free(hg);
    free(hf);
}

/* ---- down + combine by rows ------------------------------------------------- */

/* cuda_moe_down_combine against cuda_mvq_experts_glu then cuda_moe_combine
 * (shared: the shared expert as pair k, row k of Y), twice in a row on the
 * same h: Y and h byte for byte. */
static void test_down_combine(uint32_t type, uint32_t n, uint32_t F, uint32_t k, bool shared,
                              bool gated, struct rng *r)
{
    char what[160];
    const uint32_t E = 24, P = k + shared;
    struct experts X = make_experts_of(type, E, n, F, r);
    int32_t *ids = dev_ids(E, P, r);
    float *hgu = rand_floats((size_t)P * 2 * F, r), *hwt = rand_floats(k, r);
    float *hh = rand_floats(n, r), *hg = rand_floats(n, r), *hf = rand_floats(n, r);
    float *gu = dev_floats(hgu, (size_t)P * 2 * F), *wt = dev_floats(hwt, k);
    float *gate = dev_floats(hg, n), *f = dev_floats(hf, n);
    float *h[2], *Y[2];
    for (int i = 0; i < 2; i++) {
        h[i] = dev_floats(hh, n);
        CU(cudaMalloc((void **)&Y[i], (size_t)P * n * sizeof(float)));
        dev_poison_bytes(Y[i], (size_t)P * n * sizeof(float));
    }
    int rc = 0;
    for (int rep = 0; rep < 2 && !rc; rep++) {
        rc = cuda_mvq_experts_glu(type, X.d_tab, X.rb, n, F, ids, P, gu, 2 * F, 1, true, Y[0], n,
                                  0);
        rc = rc ? rc : cuda_moe_combine(h[0], Y[0], wt, k, shared ? Y[0] + (size_t)k * n : NULL,
                                        gated ? gate : NULL, f, n, 1, 0);
    }
    CHECK(rc == 0, "down combine n %u: unfused rc %d", n, rc);
    /* h is read before the PDL wait: written two launches back at least, so a
     * launch goes between the two runs (as the gate/up product does in a layer) */
    float *between;
    CU(cudaMalloc((void **)&between, (size_t)F * sizeof(float)));
    for (int rep = 0; rep < 2 && !rc; rep++) {
        rc = rep ? cuda_silu_mul(gu, F, 1, between, 0) : 0;
        rc = rc ? rc : cuda_moe_down_combine(type, X.d_tab, E, X.rb, n, F, ids, P, k, gu, 2 * F,
                                             wt, gated ? gate : NULL, f, h[1], Y[1], 0);
    }
    CHECK(rc == 0, "down combine n %u F %u k %u: fused rc %d", n, F, k, rc);
    CU(cudaDeviceSynchronize());
    const char *shape = shared ? (gated ? "gated shared pair" : "shared pair") : "no shared";
    snprintf(what, sizeof(what), "down combine %s n %u F %u k %u %s: Y", quant_type_name(type),
             n, F, k, shape);
    bool ok = same(Y[0], Y[1], (size_t)P * n * sizeof(float), what);
    snprintf(what, sizeof(what), "down combine %s n %u F %u k %u %s: h", quant_type_name(type),
             n, F, k, shape);
    ok &= same(h[0], h[1], n * sizeof(float), what);
    printf("down + combine by rows %s n %u F %u k %u, %s, twice: %s\n", quant_type_name(type), n,
           F, k, shape, ok ? "identical" : "DIFFERENT");
    for (int i = 0; i < 2; i++) {
        cudaFree(h[i]);
        cudaFree(Y[i]);
    }
    cudaFree(between);
    cudaFree(gu);
    cudaFree(wt);
    cudaFree(gate);
    cudaFree(f);
    cudaFree(ids);
    free_experts(&X);
    free(hgu);
    free(hwt);
    free(hh);
    free(hg);
    free(hf);
}

/* ---- the norm inside the input product ------------------------------------ */

static void test_matvec_norm(uint32_t type, uint32_t rows, uint32_t n, bool weights,
                             struct rng *r)
{
    char what[96];
    const size_t rb = quant_row_size(type, n);
    uint8_t *hw = xmalloc((size_t)rows * rb);
    float *row = rand_floats(n, r);
    for (uint32_t i = 0; i < rows; i++) {
        for (uint32_t j = 0; j < n; j++)
            row[j] = rng_float(r) * (1.0f + (float)(j % 5));
        if (quant_quantize_row(type, row, hw + (size_t)i * rb, n)) {
            fprintf(stderr, "quantize failed\n");
            exit(1);
        }
    }
    void *W;
    CU(cudaMalloc(&W, (size_t)rows * rb + 16));
    CU(cudaMemcpy(W, hw, (size_t)rows * rb, cudaMemcpyHostToDevice));
    float *hh = rand_floats(n, r), *hnw = rand_floats(n, r);
    for (uint32_t j = 0; j < n; j++)
        hh[j] *= 3.0f + (float)(j % 11);
    float *h = dev_floats(hh, n), *nw = dev_floats(hnw, n), *xa, *y[2];
    CU(cudaMalloc((void **)&xa, n * sizeof(float)));
    for (int i = 0; i < 2; i++) {
        CU(cudaMalloc((void **)&y[i], rows * sizeof(float)));
        dev_poison_bytes(y[i], rows * sizeof(float));
    }
    const float eps = 1e-6f;
    CHECK(cuda_matvec_norm_ok(type, rows, n), "matvec_norm %ux%u: not taken", rows, n);
    int rc = cuda_rmsnorm_wide(xa, h, weights ? nw : NULL, n, 1, eps, 0);
    rc = rc ? rc : cuda_matvec(type, W, rb, rows, n, xa, y[0], 0);
    CHECK(rc == 0, "matvec_norm %ux%u: unfused rc %d", rows, n, rc);
    rc = cuda_matvec_norm(type, W, rb, rows, n, h, weights ? nw : NULL, eps, y[1], 0);
    CHECK(rc == 0, "matvec_norm %ux%u: fused rc %d", rows, n, rc);
    CU(cudaDeviceSynchronize());
    snprintf(what, sizeof(what), "matvec_norm %s %ux%u%s: y", quant_type_name(type), rows, n,
             weights ? "" : " no weights");
    const bool ok = same(y[0], y[1], rows * sizeof(float), what);
    printf("matvec_norm %s %u x %u%s (norm width %u): %s\n", quant_type_name(type), rows, n,
           weights ? "" : ", no weights", cuda_norm_wide_threads(n),
           ok ? "identical" : "DIFFERENT");
    for (int i = 0; i < 2; i++)
        cudaFree(y[i]);
    cudaFree(xa);
    cudaFree(h);
    cudaFree(nw);
    cudaFree(W);
    free(hw);
    free(row);
    free(hh);
    free(hnw);
}

/* ---- the decode gate/up product's address table ---------------------------- */

/* cuda_mvq_experts_prefetch (the decode gate/up product: ids after the wait, the table of
 * E entries asked for in L2 before it) over k pairs of one activation row against
 * cuda_mvq_experts: the same rows, byte for byte; the pair of id -1 left alone. With
 * pf (0: none), each pair's expert of a second table (the same experts, as the down
 * product's would be) asked for in L2 too, before (1) or after (2) each block's rows. */
static void test_experts_table(uint32_t type, uint32_t E, uint32_t n, uint32_t F, uint32_t k,
                               bool poll, int pf, struct rng *r)
{
    char what[128];
    static const char *pfs[] = {"", ", down prefetch before", ", down prefetch after"};
    snprintf(what, sizeof(what), "experts table %s E %u n %u F %u k %u%s%s",
             quant_type_name(type), E, n, F, k, poll ? ", ids polled" : "", pfs[pf]);
    struct experts x = make_experts_of(type, E, 2 * F, n, r);
    int32_t *ids = dev_ids(E, k, r);
    const int32_t none = -1, mark = INT32_MIN;
    CU(cudaMemcpy(ids + k - 1, &none, sizeof(none), cudaMemcpyHostToDevice));
    /* polled: pair k - 2 keeps a router's mark that no router clears (the
     * poll gives up, the read after the wait skips the pair, as the plain
     * product does) */
    if (poll)
        CU(cudaMemcpy(ids + k - 2, &mark, sizeof(mark), cudaMemcpyHostToDevice));
    float *hx = rand_floats(n, r), *X = dev_floats(hx, n), *Y[2];
    const size_t bytes = (size_t)k * 2 * F * sizeof(float);
    for (int i = 0; i < 2; i++) {
        CU(cudaMalloc((void **)&Y[i], bytes));
        dev_poison_bytes(Y[i], bytes);
    }
    int rc = cuda_mvq_experts(type, (const void *const *)x.d_tab, x.rb, 2 * F, n, ids, k, X, n,
                              k, Y[0], 2 * F, 0);
    const void *const *next = pf ? (const void *const *)x.d_tab : NULL;
    rc = rc ? rc : cuda_mvq_experts_prefetch(type, (const void *const *)x.d_tab, x.rb, 2 * F, n,
                                             ids, k, X, n, k, Y[1], 2 * F, next,
                                             pf ? (size_t)2 * F * x.rb : 0, E, false, NULL,
                                             poll, pf == 2, 0);
    CHECK(rc == 0, "%s: rc %d", what, rc);
    CU(cudaDeviceSynchronize());
    const bool ok = same(Y[0], Y[1], bytes, what);
    uint32_t left = 0; /* the skipped pair's row still poisoned */
    float *hy = xmalloc(2 * F * sizeof(float));
    CU(cudaMemcpy(hy, Y[1] + (size_t)(k - 1) * 2 * F, 2 * F * sizeof(float),
                  cudaMemcpyDeviceToHost));
    for (uint32_t j = 0; j < 2 * F; j++) {
        uint32_t u;
        memcpy(&u, &hy[j], sizeof(u));
        left += u == 0xC3C3C3C3u;
    }
    CHECK(left == 2 * F, "%s: the pair of id -1 was written (%u of %u left)", what, left, 2 * F);
    printf("%s: %s\n", what, ok && left == 2 * F ? "identical" : "DIFFERENT");
    free(hy);
    for (int i = 0; i < 2; i++)
        cudaFree(Y[i]);
    cudaFree(X), cudaFree(ids);
    free(hx);
    free_experts(&x);
}

/* cuda_mvq_experts_prefetch_gq (the decode gate/up product that also writes the down
 * product's input rounded, a gate tile and its up tile a cluster) then
 * cuda_mvq_experts_xq_tail over those rows, against cuda_mvq_experts_prefetch then
 * cuda_mvq_experts_glu_tail (the SiLU and the rounding in the down product): the gate/up
 * rows and the down rows byte for byte, twice in a row, the pair of id -1 (the last)
 * skipped by both (its rounded row left as it was). gq false: a case the form declines
 * (-ENOTSUP, nothing written): tiles other than 32 rows, or not copied by tma. */
static void test_gate_up_gq(uint32_t type, uint32_t dtype, uint32_t E, uint32_t n, uint32_t F,
                            uint32_t k, bool poll, bool gq, struct rng *r)
{
    gq = gq && cuda_caps_cc() >= 90; /* the form is sm_90's (caps.h) */
    char what[128];
    snprintf(what, sizeof(what), "gate/up gq %s, down %s, E %u n %u F %u k %u%s",
             quant_type_name(type), quant_type_name(dtype), E, n, F, k,
             poll ? ", ids polled" : "");
    struct experts X = make_experts_of(type, E, 2 * F, n, r);
    struct experts D = make_experts_of(dtype, E, n, F, r);
    int32_t *ids = dev_ids(E, k, r);
    const int32_t none = -1;
    CU(cudaMemcpy(ids + k - 1, &none, sizeof(none), cudaMemcpyHostToDevice));
    float *hx = rand_floats(n, r), *x = dev_floats(hx, n), *gu[2], *Y[2];
    const size_t gbytes = (size_t)k * 2 * F * sizeof(float), ybytes = (size_t)k * n * sizeof(float);
    const size_t qrow = cuda_mvq_xq_bytes(F), qbytes = k * qrow;
    int8_t *q;
    CU(cudaMalloc((void **)&q, qbytes));
    dev_poison_bytes(q, qbytes);
    for (int i = 0; i < 2; i++) {
        CU(cudaMalloc((void **)&gu[i], gbytes));
        CU(cudaMalloc((void **)&Y[i], ybytes));
        dev_poison_bytes(gu[i], gbytes);
        dev_poison_bytes(Y[i], ybytes);
    }
    const void *const *gt = (const void *const *)X.d_tab, *const *dt = (const void *const *)D.d_tab;
    const size_t dbytes = (size_t)n * D.rb;
    int rc = 0, rq = 0;
    for (int rep = 0; rep < 2 && !rc && !rq; rep++) {
        rc = cuda_mvq_experts_prefetch(type, gt, X.rb, 2 * F, n, ids, k, x, n, k, gu[0], 2 * F,
                                       dt, dbytes, E, false, NULL, poll, true, 0);
        rc = rc ? rc : cuda_mvq_experts_glu_tail(dtype, dt, D.rb, n, F, ids, E, k, gu[0], 2 * F,
                                                 true, Y[0], NULL, 0);
        rq = cuda_mvq_experts_prefetch_gq(type, gt, X.rb, 2 * F, n, ids, k, x, n, k, gu[1], 2 * F,
                                          dt, dbytes, E, false, NULL, poll, true, q, 0);
        rq = rq ? rq : cuda_mvq_experts_xq_tail(dtype, dt, D.rb, n, F, ids, E, k, q, Y[1], NULL, 0);
    }
    CHECK(rc == 0, "%s: rc %d", what, rc);
    CU(cudaDeviceSynchronize());
    bool ok = true;
    if (!gq) {
        CHECK(rq == -ENOTSUP, "%s: rc %d where the form should decline", what, rq);
        int8_t *hq = xmalloc(qbytes);
        CU(cudaMemcpy(hq, q, qbytes, cudaMemcpyDeviceToHost));
        size_t left = 0;
        for (size_t i = 0; i < qbytes; i++)
            left += (uint8_t)hq[i] == 0xC3;
        CHECK(left == qbytes, "%s: declined, yet %zu bytes written", what, qbytes - left);
        free(hq);
        printf("%s: declined\n", what);
    } else {
        CHECK(rq == 0, "%s: gq rc %d", what, rq);
        char w2[160];
        snprintf(w2, sizeof(w2), "%s: gate/up rows", what);
        ok &= same(gu[0], gu[1], gbytes, w2);
        snprintf(w2, sizeof(w2), "%s: down rows", what);
        ok &= same(Y[0], Y[1], ybytes, w2);
        /* the skipped pair: neither its rounded row nor its down row written */
        uint8_t *hq = xmalloc(qrow);
        CU(cudaMemcpy(hq, q + (size_t)(k - 1) * qrow, qrow, cudaMemcpyDeviceToHost));
        size_t left = 0;
        for (size_t i = 0; i < qrow; i++)
            left += hq[i] == 0xC3;
        CHECK(left == qrow, "%s: the pair of id -1 has %zu bytes of its rounded row written",
              what, qrow - left);
        free(hq);
        printf("%s, twice: %s\n", what, ok && left == qrow ? "identical" : "DIFFERENT");
    }
    for (int i = 0; i < 2; i++) {
        cudaFree(gu[i]);
        cudaFree(Y[i]);
    }
    cudaFree(q), cudaFree(x), cudaFree(ids);
    free(hx);
    free_experts(&X);
    free_experts(&D);
}

/* The router's top-k tail marking the ids (cuda_tail.mark_ids) and the
 * decode gate/up product polling them (ids_poll), launched back to back on
 * one stream as a decode layer does, against the same two launches without
 * mark and poll: ids, weights and the gate/up rows byte for byte, launch
 * after launch on new rows (a poll that took the launch before's ids would
 * have asked for that launch's experts first, then again after its wait);
 * the router F32 (the norm-in product marks) or quantized (the int8 product's
 * tail marks). In a build with LAMINA_MVQ_PROBE the router's probe marks and
 * the gate/up product's are all there and in order (without it, none). */
static void test_ids_poll(uint32_t type, uint32_t rtype, uint32_t E, uint32_t k, uint32_t n,
                          uint32_t F, unsigned int *ctr, struct rng *r)
{
    char what[112];
    enum { REPS = 4 };
    float *hW = rand_floats((size_t)E * n, r), *hh = rand_floats((REPS + 2) * n, r);
    float *W = dev_floats(hW, (size_t)E * n), *h = dev_floats(hh, n);
    /* a quantized router (rtype not F32): the int8 product's tail marks, over the rows
     * of add as they are (no norm in), the gate/up product rounding them itself */
    void *rW = rtype == QUANT_TYPE_F32 ? NULL : dev_quant_rows(rtype, E, n, r);
    float *nw = dev_floats(hh + n, n), *add = dev_floats(hh + 2 * n, REPS * n);
    struct experts X = make_experts_of(type, E, 2 * F, n, r);
    float *lg, *xa, *w[2], *Y[2];
    int32_t *ids[2];
    int8_t *xq;
    const size_t ybytes = (size_t)k * 2 * F * sizeof(float);
    CU(cudaMalloc((void **)&lg, E * sizeof(float)));
    CU(cudaMalloc((void **)&xa, n * sizeof(float)));
    CU(cudaMalloc((void **)&xq, cuda_mvq_xq_bytes(n)));
    for (int i = 0; i < 2; i++) {
        CU(cudaMalloc((void **)&w[i], k * sizeof(float)));
        CU(cudaMalloc((void **)&ids[i], k * sizeof(int32_t)));
        CU(cudaMalloc((void **)&Y[i], ybytes));
        CU(cudaMemset(ids[i], 0, k * sizeof(int32_t)));
    }
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    bool ok = true;
    int rc = 0;
    /* the marked launches also leave the router's marks (cuda_norm_in.probe): the same
     * outputs, and every block's marks in order */
    const size_t pbytes = (size_t)CUDA_PROBE_BLOCKS * CUDA_PROBE_SLOTS * sizeof(uint64_t);
    unsigned long long *probe;
    uint64_t *hp = malloc(pbytes);
    CU(cudaMalloc((void **)&probe, pbytes));
    uint32_t probed = 0, unordered = 0;
    /* and the gate/up product's (cuda_mvq_probe_next) */
    const size_t qbytes = (size_t)CUDA_PROBE_MVQ_BLOCKS * CUDA_PROBE_SLOTS * sizeof(uint64_t);
    unsigned long long *qprobe;
    uint64_t *hq = malloc(qbytes);
    CU(cudaMalloc((void **)&qprobe, qbytes));
    uint32_t qprobed = 0, qunordered = 0, qmissing = 0;
    for (int rep = 0; rep < REPS && rc == 0; rep++) {
        CU(cudaMemset(probe, 0, pbytes));
        CU(cudaMemset(qprobe, 0, qbytes));
        for (int i = 0; i < 2 && rc == 0; i++) { /* 0: plain, 1: marked and polled */
            const struct cuda_norm_in ni = {.h = h, .add = add + (size_t)rep * n, .w = nw,
                                            .eps = 1e-6f, .probe = i == 1 ? probe : NULL};
            dev_poison_bytes(w[i], k * sizeof(float));
            dev_poison_bytes(Y[i], ybytes);
            const struct cuda_tail t = {.kind = CUDA_TAIL_TOPK, .counter = ctr, .k = k,
                                        .ids = ids[i], .w = w[i], .mark_ids = i == 1};
            const float *x = rW ? add + (size_t)rep * n : xa;
            rc = rW ? cuda_matvec_tail(rtype, rW, quant_row_size(rtype, n), E, n, x, lg, &t, st)
                    : cuda_matvec_tail_norm_in(QUANT_TYPE_F32, W, n * sizeof(float), E, n, &ni,
                                               xa, xq, lg, &t, st);
            cuda_mvq_probe_next(i == 1 ? qprobe : NULL);
            rc = rc ? rc
                    : cuda_mvq_experts_prefetch(type, (const void *const *)X.d_tab, X.rb, 2 * F,
                                                n, ids[i], k, x, n, k, Y[i], 2 * F, NULL, 0, E,
                                                false, rW ? NULL : xq, i == 1, true, st);
        }
        CU(cudaStreamSynchronize(st));
        CHECK(rc == 0, "ids_poll E %u: rc %d", E, rc);
        CU(cudaMemcpy(hp, probe, pbytes, cudaMemcpyDeviceToHost));
        for (uint32_t b = 0; !rW && b < CUDA_PROBE_BLOCKS; b++) {
            const uint64_t *m = hp + (size_t)b * CUDA_PROBE_SLOTS;
            if (!m[0])
                continue;
            probed++;
            for (int j = 1; j < 5; j++)
                unordered += m[j] < m[j - 1] || m[8 + j] < m[8 + j - 1];
        }
        CU(cudaMemcpy(hq, qprobe, qbytes, cudaMemcpyDeviceToHost));
        for (uint32_t b = 0; b < CUDA_PROBE_MVQ_BLOCKS; b++) {
            const uint64_t *m = hq + (size_t)b * CUDA_PROBE_SLOTS;
            if (!m[CUDA_PROBE_MVQ_START])
                continue;
            qprobed++;
            /* every slot but the tile's (tma only) is reached, in this order */
            const int order[] = {CUDA_PROBE_MVQ_START, CUDA_PROBE_MVQ_POLLED,
                                 CUDA_PROBE_MVQ_WAITED, CUDA_PROBE_MVQ_X, CUDA_PROBE_MVQ_DATA,
                                 CUDA_PROBE_MVQ_STORED, CUDA_PROBE_MVQ_END};
            uint64_t last = 0;
            for (size_t j = 0; j < sizeof(order) / sizeof(order[0]); j++) {
                const uint64_t v = m[order[j]];
                if (!v) {
                    qmissing += order[j] != CUDA_PROBE_MVQ_DATA;
                    continue;
                }
                qunordered += v < last;
                last = v;
            }
        }
        snprintf(what, sizeof(what), "ids_poll %s router %s E %u k %u launch %d: ids",
                 quant_type_name(type), quant_type_name(rtype), E, k, rep);
        ok &= same(ids[0], ids[1], k * sizeof(int32_t), what);
        snprintf(what, sizeof(what), "ids_poll %s E %u k %u launch %d: weights",
                 quant_type_name(type), E, k, rep);
        ok &= same(w[0], w[1], k * sizeof(float), what);
        snprintf(what, sizeof(what), "ids_poll %s E %u k %u launch %d: gate/up rows",
                 quant_type_name(type), E, k, rep);
        ok &= same(Y[0], Y[1], ybytes, what);
    }
    CHECK(dev_counter(ctr) == 0, "ids_poll: counter %u after the launches", dev_counter(ctr));
    /* a build without LAMINA_MVQ_PROBE leaves both buffers as they were */
    if (cuda_mvq_probe_built())
        CHECK(rW || probed > 0, "ids_poll E %u: the router left no marks", E);
    else
        CHECK(probed == 0, "ids_poll E %u: %u router blocks marked in a build without marks",
              E, probed);
    CHECK(unordered == 0, "ids_poll E %u: %u of the router's marks out of order", E, unordered);
    if (cuda_mvq_probe_built())
        CHECK(qprobed >= REPS * k,
              "ids_poll E %u: %u blocks of the gate/up products marked, %u pairs", E, qprobed,
              REPS * k);
    else
        CHECK(qprobed == 0, "ids_poll E %u: %u gate/up blocks marked in a build without marks",
              E, qprobed);
    CHECK(qmissing == 0 && qunordered == 0,
          "ids_poll E %u: gate/up marks: %u missing, %u out of order", E, qmissing, qunordered);
    cudaFree(probe);
    cudaFree(qprobe);
    free(hp);
    free(hq);
    printf("ids_poll %s router %s E %u k %u n %u F %u: %s over %d launches\n",
           quant_type_name(type), quant_type_name(rtype), E, k, n, F,
           ok ? "identical" : "DIFFERENT", REPS);
    CU(cudaStreamDestroy(st));
    for (int i = 0; i < 2; i++) {
        cudaFree(w[i]);
        cudaFree(ids[i]);
        cudaFree(Y[i]);
    }
    cudaFree(lg), cudaFree(xa), cudaFree(xq);
    cudaFree(W), cudaFree(h), cudaFree(nw), cudaFree(add), cudaFree(rW);
    free_experts(&X);
    free(hW);
    free(hh);
}

/* The shared expert's gate summed by a block of the router's norm-in launch
 * (cuda_norm_in.gate, .gs) and read by the early combine (d_gs), against the
 * combine summing it from the row: the router's logits, ids, weights, row and
 * rounded row, and the combine's h and next norm (with xq), byte for byte; the
 * gate within 1e-5 of the host's sigmoid of the row's dot. cluster: the combine
 * as a cluster a token (sm_90) or one block (LAMINA_CUDA_COMBINE_CLUSTER=0). */
static void test_gate_sum(uint32_t E, uint32_t k, uint32_t n, bool cluster, unsigned int *ctr,
                          struct rng *r)
{
    char what[128];
    if (!cluster)
        setenv("LAMINA_CUDA_COMBINE_CLUSTER", "0", 1);
    float *hW = rand_floats((size_t)E * n, r), *hv = rand_floats(4 * n, r);
    float *hY = rand_floats((size_t)(k + 1) * n, r);
    float *W = dev_floats(hW, (size_t)E * n), *h0 = dev_floats(hv, n);
    float *add = dev_floats(hv + n, n), *nw = dev_floats(hv + 2 * n, n);
    float *gate = dev_floats(hv + 3 * n, n), *Y = dev_floats(hY, (size_t)(k + 1) * n);
    const size_t xb = cuda_mvq_xq_bytes(n);
    float *lg[2], *xa[2], *w[2], *h[2], *y[2], *gs;
    int8_t *xq[2], *yq[2];
    int32_t *ids[2];
    CU(cudaMalloc((void **)&gs, sizeof(float)));
    for (int i = 0; i < 2; i++) {
        CU(cudaMalloc((void **)&lg[i], E * sizeof(float)));
        CU(cudaMalloc((void **)&xa[i], n * sizeof(float)));
        CU(cudaMalloc((void **)&w[i], k * sizeof(float)));
        CU(cudaMalloc((void **)&y[i], n * sizeof(float)));
        CU(cudaMalloc((void **)&ids[i], k * sizeof(int32_t)));
        CU(cudaMalloc((void **)&xq[i], xb));
        CU(cudaMalloc((void **)&yq[i], xb));
        h[i] = dev_floats(hv, n);
    }
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) { /* 0: the combine sums it, 1: the router */
        dev_poison_bytes(lg[i], E * sizeof(float));
        dev_poison_bytes(xa[i], n * sizeof(float));
        dev_poison_bytes(xq[i], xb);
        dev_poison_bytes(y[i], n * sizeof(float));
        dev_poison_bytes(yq[i], xb);
        dev_poison_bytes(gs, sizeof(float));
        const struct cuda_norm_in ni = {.h = h0, .add = add, .w = nw, .eps = 1e-6f,
                                        .gate = i ? gate : NULL, .gs = i ? gs : NULL};
        const struct cuda_tail t = {.kind = CUDA_TAIL_TOPK, .counter = ctr, .k = k,
                                    .ids = ids[i], .w = w[i]};
        rc = cuda_matvec_tail_norm_in(QUANT_TYPE_F32, W, n * sizeof(float), E, n, &ni, xa[i],
                                      xq[i], lg[i], &t, st);
        /* the combine reads the router's outputs before its wait: launches apart */
        CU(cudaStreamSynchronize(st));
        rc = rc ? rc
                : cuda_moe_combine_early_mix(h[i], add, Y, w[i], k, Y + (size_t)k * n, gate,
                                             xa[i], n, 1, nw, 1e-6f, y[i],
                                             cuda_moe_combine_xq_ok(n, k) ? yq[i] : NULL,
                                             i ? gs : NULL, st);
        CU(cudaStreamSynchronize(st));
    }
    CHECK(rc == 0, "gate sum E %u n %u: rc %d", E, n, rc);
    const char *form = cluster ? "cluster" : "one block";
    bool ok = true;
    const struct {
        void *a, *b;
        size_t bytes;
        const char *name;
    } outs[] = {{lg[0], lg[1], E * sizeof(float), "logits"},
                {ids[0], ids[1], k * sizeof(int32_t), "ids"},
                {w[0], w[1], k * sizeof(float), "weights"},
                {xa[0], xa[1], n * sizeof(float), "row"},
                {xq[0], xq[1], xb, "rounded row"},
                {h[0], h[1], n * sizeof(float), "h"},
                {y[0], y[1], n * sizeof(float), "next norm"},
                {yq[0], yq[1], cuda_moe_combine_xq_ok(n, k) ? xb : 0, "next norm rounded"}};
    for (size_t o = 0; o < sizeof(outs) / sizeof(outs[0]); o++) {
        snprintf(what, sizeof(what), "gate sum E %u n %u (%s): %s", E, n, form, outs[o].name);
        ok &= same(outs[o].a, outs[o].b, outs[o].bytes, what);
    }
    float g = 0.0f, *hx = xmalloc(n * sizeof(float));
    CU(cudaMemcpy(&g, gs, sizeof(float), cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hx, xa[1], n * sizeof(float), cudaMemcpyDeviceToHost));
    double d = 0.0;
    for (uint32_t j = 0; j < n; j++)
        d += (double)hv[3 * n + j] * hx[j];
    const double want = 1.0 / (1.0 + exp(-d));
    CHECK(fabs(g - want) <= 1e-5, "gate sum E %u n %u: gate %.7g, host %.7g", E, n, g, want);
    /* a gate without its output is refused, nothing launched */
    const struct cuda_norm_in bad = {.h = h0, .add = add, .w = nw, .eps = 1e-6f, .gate = gate};
    CHECK(cuda_matvec_tail_norm_in(QUANT_TYPE_F32, W, n * sizeof(float), E, n, &bad, xa[0], NULL,
                                   lg[0], NULL, st) == -EINVAL,
          "gate sum: a gate without gs accepted");
    printf("gate sum E %u k %u n %u, combine %s: %s, gate %.6f (host %.6f)\n", E, k, n, form,
           ok ? "identical" : "DIFFERENT", g, want);
    CU(cudaStreamDestroy(st));
    for (int i = 0; i < 2; i++) {
        cudaFree(lg[i]);
        cudaFree(xa[i]);
        cudaFree(w[i]);
        cudaFree(y[i]);
        cudaFree(ids[i]);
        cudaFree(xq[i]);
        cudaFree(yq[i]);
        cudaFree(h[i]);
    }
    cudaFree(gs);
    cudaFree(W);
    cudaFree(h0);
    cudaFree(add);
    cudaFree(nw);
    cudaFree(gate);
    cudaFree(Y);
    free(hW);
    free(hv);
    free(hY);
    free(hx);
    unsetenv("LAMINA_CUDA_COMBINE_CLUSTER");
}

static void test_refusals(unsigned int *ctr)
{
    float *d;
    CU(cudaMalloc((void **)&d, 4096 * sizeof(float)));
    struct cuda_tail t = {.kind = CUDA_TAIL_ADD_NORM, .counter = ctr, .n = 64, .h = d, .out = d};
    /* n must equal the product's rows */
    int rc = cuda_matvec_tail(QUANT_TYPE_F32, d, 32 * sizeof(float), 32, 32, d, d, &t, 0);
    CHECK(rc == -EINVAL, "add_norm with n 64 after 32 rows: rc %d, want -EINVAL", rc);
    t.counter = NULL;
    t.n = 32;
    rc = cuda_matvec_tail(QUANT_TYPE_F32, d, 32 * sizeof(float), 32, 32, d, d, &t, 0);
    CHECK(rc == -EINVAL, "a tail without a counter: rc %d, want -EINVAL", rc);
    t = (struct cuda_tail){.kind = CUDA_TAIL_TOPK, .counter = ctr, .k = 17, .ids = (int32_t *)d,
                           .w = d};
    rc = cuda_matvec_tail(QUANT_TYPE_F32, d, 32 * sizeof(float), 32, 32, d, d, &t, 0);
    CHECK(rc == -EINVAL, "top-17: rc %d, want -EINVAL", rc);
    t.k = 4;
    rc = cuda_matvec_tail(QUANT_TYPE_F32, d, 32 * sizeof(float), 600, 32, d, d, &t, 0);
    CHECK(rc == -EINVAL, "top-k of 600 logits: rc %d, want -EINVAL", rc);
    t = (struct cuda_tail){.kind = CUDA_TAIL_COMBINE, .counter = ctr, .n = 32, .h = d, .w = d,
                           .k = 2};
    rc = cuda_matvec_tail(QUANT_TYPE_F32, d, 32 * sizeof(float), 32, 32, d, d, &t, 0);
    CHECK(rc == -EINVAL, "a combine after a plain product: rc %d, want -EINVAL", rc);
    t.kind = CUDA_TAIL_COMBINE_COLS;
    rc = cuda_matvec_tail(QUANT_TYPE_F32, d, 32 * sizeof(float), 32, 32, d, d, &t, 0);
    CHECK(rc == -EINVAL, "a column combine after a plain product: rc %d, want -EINVAL", rc);
    /* down + combine by rows: pairs neither k nor k + 1, no h: -EINVAL; F32
     * experts, more than 16 routed pairs: -ENOTSUP (the caller's two steps) */
    const void **tab = (const void **)d;
    int32_t *ids = (int32_t *)d;
    rc = cuda_moe_down_combine(QUANT_TYPE_Q4_0, tab, 4, 18, 64, 32, ids, 6, 4, d, 64, d, NULL,
                               NULL, d, NULL, 0);
    CHECK(rc == -EINVAL, "down combine of 6 pairs for k 4: rc %d, want -EINVAL", rc);
    rc = cuda_moe_down_combine(QUANT_TYPE_Q4_0, tab, 4, 18, 64, 32, ids, 4, 4, d, 64, d, NULL,
                               NULL, NULL, NULL, 0);
    CHECK(rc == -EINVAL, "down combine without h: rc %d, want -EINVAL", rc);
    rc = cuda_moe_down_combine(QUANT_TYPE_F32, tab, 4, 128, 64, 32, ids, 4, 4, d, 64, d, NULL,
                               NULL, d, NULL, 0);
    CHECK(rc == -ENOTSUP, "down combine of F32 experts: rc %d, want -ENOTSUP", rc);
    rc = cuda_moe_down_combine(QUANT_TYPE_Q4_0, tab, 4, 18, 64, 32, ids, 17, 17, d, 64, d, NULL,
                               NULL, d, NULL, 0);
    CHECK(rc == -ENOTSUP, "down combine of 17 routed pairs: rc %d, want -ENOTSUP", rc);
    /* the norm inside the product: only the int8 kernels take it */
    CHECK(!cuda_matvec_norm_ok(QUANT_TYPE_F32, 64, 32), "matvec_norm takes F32");
    rc = cuda_matvec_norm(QUANT_TYPE_F32, d, 32 * sizeof(float), 64, 32, d, NULL, 1e-6f, d, 0);
    CHECK(rc == -ENOTSUP, "matvec_norm of F32: rc %d, want -ENOTSUP", rc);
    CU(cudaDeviceSynchronize());
    CHECK(dev_counter(ctr) == 0, "refusals touched the counter (%u)", dev_counter(ctr));
    cudaFree(d);
    printf("bad tails refused\n");
}

/* ---- timing ---------------------------------------------------------------- */

/* The three boundaries of one 80b-a3b decode layer (n 2048, DeltaNet output
 * 4096 -> 2048 Q4_0, F32 router 512 x 2048 top-10, 10 experts of 512 -> 2048
 * Q4_0 with the shared expert gated and the next norm). */
struct bench {
    bool fused;
    void *Wo, *Wr;
    struct experts X;
    int32_t *ids;
    float *x4096, *mix, *h, *xa, *nw, *rl, *w, *gu, *Y, *so, *gate;
    unsigned int *ctr;
};

static void bench_layer(void *arg, cudaStream_t s)
{
    struct bench *b = arg;
    const uint32_t n = 2048, E = 512, k = 10, F = 512;
    const size_t rbo = quant_row_size(QUANT_TYPE_Q4_0, 4096);
    int rc;
    if (!b->fused) {
        rc = cuda_matvec(QUANT_TYPE_Q4_0, b->Wo, rbo, n, 4096, b->x4096, b->mix, s);
        rc |= cuda_add_rmsnorm(b->h, b->mix, b->xa, b->nw, n, 1, 1e-6f, s);
        rc |= cuda_matvec(QUANT_TYPE_F32, b->Wr, n * sizeof(float), E, n, b->xa, b->rl, s);
        rc |= cuda_router_topk(b->rl, E, k, 1, b->ids, b->w, s);
        rc |= cuda_mvq_experts_glu(QUANT_TYPE_Q4_0, b->X.d_tab, b->X.rb, n, F, b->ids, k, b->gu,
                                   2 * F, 1, true, b->Y, n, s);
        rc |= cuda_moe_combine_norm(b->h, b->Y, b->w, k, b->so, b->gate, b->xa, n, 1, b->nw, 1e-6f,
                                    b->xa, s);
    } else {
        const struct cuda_tail tn = {.kind = CUDA_TAIL_ADD_NORM, .counter = b->ctr, .n = n,
                                     .eps = 1e-6f, .h = b->h, .norm_w = b->nw, .out = b->xa};
        const struct cuda_tail tk = {.kind = CUDA_TAIL_TOPK, .counter = b->ctr, .k = k,
                                     .ids = b->ids, .w = b->w};
        const struct cuda_tail tc = {.kind = CUDA_TAIL_COMBINE, .counter = b->ctr, .n = n,
                                     .eps = 1e-6f, .h = b->h, .norm_w = b->nw, .out = b->xa,
                                     .k = k, .w = b->w, .so = b->so, .shexp_gate = b->gate,
                                     .f = b->xa};
        rc = cuda_matvec_tail(QUANT_TYPE_Q4_0, b->Wo, rbo, n, 4096, b->x4096, b->mix, &tn, s);
        rc |= cuda_matvec_tail(QUANT_TYPE_F32, b->Wr, n * sizeof(float), E, n, b->xa, b->rl, &tk,
                               s);
        rc |= cuda_mvq_experts_glu_tail(QUANT_TYPE_Q4_0, b->X.d_tab, b->X.rb, n, F, b->ids, 0,
                                        k, b->gu, 2 * F, true, b->Y, &tc, s);
    }
    if (rc) {
        fprintf(stderr, "bench launch failed\n");
        exit(1);
    }
}

/* The MoE of one 80b-a3b decode layer after the router: the gate/up
 * product of 11 pairs (10 routed + the shared expert as pair 10), then the
 * down product and the combine as two launches or as one
 * (cuda_moe_down_combine). Copy i of the graph takes its own 11 of 128
 * experts, so that the weights come from memory, not L2. */
struct dc_bench {
    bool fused;
    uint32_t copy;
    struct experts GU, D;
    int32_t *ids; /* 48 x 11 */
    float *xa, *gu, *Y, *h, *w, *gate;
};

static void bench_dc_layer(void *arg, cudaStream_t s)
{
    struct dc_bench *b = arg;
    const uint32_t n = 2048, F = 512, k = 10, P = 11, E = 128;
    const int32_t *ids = b->ids + (size_t)(b->copy++ % 48) * P;
    int rc = cuda_mvq_experts(QUANT_TYPE_Q4_0, b->GU.d_tab, b->GU.rb, 2 * F, n, ids, P, b->xa, n,
                              P, b->gu, 2 * F, s);
    if (!b->fused) {
        rc |= cuda_mvq_experts_glu_tail(QUANT_TYPE_Q4_0, b->D.d_tab, b->D.rb, n, F, ids, E, P,
                                        b->gu, 2 * F, true, b->Y, NULL, s);
        rc |= cuda_moe_combine_early(b->h, b->Y, b->w, k, b->Y + (size_t)k * n, b->gate, b->xa,
                                     n, 1, NULL, 0.0f, NULL, NULL, s);
    } else {
        rc |= cuda_moe_down_combine(QUANT_TYPE_Q4_0, b->D.d_tab, E, b->D.rb, n, F, ids, P, k,
                                    b->gu, 2 * F, b->w, b->gate, b->xa, b->h, NULL, s);
    }
    if (rc) {
        fprintf(stderr, "down combine bench launch failed\n");
        exit(1);
    }
}

static void bench_down_combine(struct rng *r)
{
    const uint32_t n = 2048, F = 512, E = 128, P = 11;
    struct dc_bench b = {0};
    b.GU = make_experts(E, 2 * F, n, r);
    b.D = make_experts(E, n, F, r);
    int32_t *hid = xmalloc(48 * P * sizeof(int32_t));
    for (uint32_t c = 0; c < 48; c++)
        for (uint32_t i = 0; i < P; i++)
            hid[c * P + i] = (int32_t)((c * 37 + i * 11) % E);
    CU(cudaMalloc((void **)&b.ids, 48 * P * sizeof(int32_t)));
    CU(cudaMemcpy(b.ids, hid, 48 * P * sizeof(int32_t), cudaMemcpyHostToDevice));
    float *hx = rand_floats(4 * n, r);
    b.xa = dev_floats(hx, n);
    b.gate = dev_floats(hx + n, n);
    b.w = dev_floats(hx + 2 * n, 16);
    CU(cudaMalloc((void **)&b.gu, P * 2 * F * sizeof(float)));
    CU(cudaMalloc((void **)&b.Y, P * n * sizeof(float)));
    float us[2];
    for (int f = 0; f < 2; f++) {
        b.fused = f == 1;
        b.h = dev_floats(hx + 3 * n, n);
        us[f] = graph_median_us(bench_dc_layer, &b, 48);
        cudaFree(b.h);
    }
    printf("[measure] 80b-a3b MoE after the router (gate/up of 11 pairs, down, combine), graph "
           "of 48 layers, median of 20: down then combine %.2f us/layer (3 kernels), down + "
           "combine by rows %.2f us/layer (2 kernels)\n",
           us[0], us[1]);
    free_experts(&b.GU);
    free_experts(&b.D);
    cudaFree(b.ids);
    cudaFree(b.xa);
    cudaFree(b.gate);
    cudaFree(b.w);
    cudaFree(b.gu);
    cudaFree(b.Y);
    free(hid);
    free(hx);
}

static void bench_boundaries(unsigned int *ctr, struct rng *r)
{
    const uint32_t n = 2048, E = 512, F = 512;
    struct bench b = {0};
    b.ctr = ctr;
    b.Wo = dev_q4_0(n, 4096, r);
    float *hWr = rand_floats((size_t)E * n, r);
    b.Wr = dev_floats(hWr, (size_t)E * n);
    b.X = make_experts(E, n, F, r);
    CU(cudaMalloc((void **)&b.ids, 16 * sizeof(int32_t)));
    float *hx = rand_floats(8192, r);
    b.x4096 = dev_floats(hx, 4096);
    b.mix = dev_floats(hx, n);
    b.h = dev_floats(hx + 4096, n);
    b.xa = dev_floats(hx, n);
    b.nw = dev_floats(hx + 2048, n);
    b.rl = dev_floats(hx, E);
    b.w = dev_floats(hx, 16);
    float *hgu = rand_floats(10 * 2 * F, r);
    b.gu = dev_floats(hgu, 10 * 2 * F);
    CU(cudaMalloc((void **)&b.Y, 10 * n * sizeof(float)));
    b.so = dev_floats(hx + 1024, n);
    b.gate = dev_floats(hx + 3072, n);
    float us[2];
    for (int f = 0; f < 2; f++) {
        b.fused = f == 1;
        /* keep h bounded: start each timing from the same row */
        CU(cudaMemcpy(b.h, hx + 4096, n * sizeof(float), cudaMemcpyHostToDevice));
        us[f] = graph_median_us(bench_layer, &b, 48);
    }
    printf("[measure] 80b-a3b layer boundaries (out+add_norm, router+top-k, down+combine+norm), "
           "graph of 48 layers, median of 20: unfused %.2f us/layer (6 kernels), fused %.2f "
           "us/layer (3 kernels)\n",
           us[0], us[1]);
    CHECK(dev_counter(ctr) == 0, "bench: counter %u after the runs", dev_counter(ctr));
    free_experts(&b.X);
    free(hWr);
    free(hx);
    free(hgu);
}

int main(void)
{
    int dev_count = 0;
    if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
        fprintf(stderr, "test_tail_cuda: no CUDA device\n");
        return 1;
    }
    struct rng r = {0x7A11C0DEull};
    unsigned int *ctr;
    CU(cudaMalloc((void **)&ctr, sizeof(*ctr)));
    CU(cudaMemset(ctr, 0, sizeof(*ctr)));
    /* hidden sizes: stand-alone norm widths 32, 128, 256 (capped) and combine
     * widths 32, 256, 768, 1024 */
    const uint32_t ns[] = {64, 512, 1536, 2048, 3072};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        test_add_norm(ns[i], 1024, ctr, &r);
        test_add_norm(ns[i], 4096, ctr, &r);
    }
    /* the DeltaNet output product of the 80b shape and others (row lengths
     * the f32 kernels would otherwise take, and shorter) */
    test_xq_tail(QUANT_TYPE_Q4_0, 2048, 4096, true, ctr, &r);
    test_xq_tail(QUANT_TYPE_Q8_0, 2048, 4096, true, ctr, &r);
    test_xq_tail(QUANT_TYPE_Q4_0, 3072, 8192, true, ctr, &r);
    test_xq_tail(QUANT_TYPE_Q4_0, 512, 1024, true, ctr, &r);
    test_xq_tail(QUANT_TYPE_Q8_0, 1000, 4096, false, ctr, &r);
    test_topk(8, 2, 64, ctr, &r);
    test_topk(64, 8, 1024, ctr, &r);
    test_topk(128, 8, 2048, ctr, &r);
    test_topk(512, 10, 2048, ctr, &r);
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        test_combine(ns[i], 512, 8, true, true, true, ctr, &r);
        test_combine(ns[i], 256, 4, false, false, true, ctr, &r);
        test_combine(ns[i], 512, 10, true, false, false, ctr, &r);
    }
    test_combine(2048, 512, 10, true, true, false, ctr, &r);
    unsigned int *cols;
    CU(cudaMalloc((void **)&cols, CUDA_TAIL_COLS_MAX * sizeof(*cols)));
    CU(cudaMemset(cols, 0, CUDA_TAIL_COLS_MAX * sizeof(*cols)));
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        test_combine_cols(ns[i], 512, 8, 1, true, false, cols, &r);
        test_combine_cols(ns[i], 256, 4, 0, false, true, cols, &r);
        test_combine_cols(ns[i], 512, 10, 2, true, true, cols, &r);
    }
    test_combine_cols(2048, 512, 10, 2, false, false, cols, &r);
    test_combine_cols(2048, 512, 10, 2, true, false, cols, &r);
    test_combine_cols(4096, 256, 16, 1, false, true, cols, &r);
    cudaFree(cols);
    /* down + combine by rows: rows of 8 (PL 1), 16, 24 (PL 3) and 48 blocks
     * (16 lanes a row), hidden sizes not a multiple of the block's rows */
    test_down_combine(QUANT_TYPE_Q4_0, 2048, 512, 10, true, true, &r);
    test_down_combine(QUANT_TYPE_Q8_0, 2048, 512, 10, true, true, &r);
    test_down_combine(QUANT_TYPE_Q4_0, 2048, 512, 10, false, false, &r);
    test_down_combine(QUANT_TYPE_Q4_0, 1000, 768, 8, true, false, &r);
    test_down_combine(QUANT_TYPE_Q8_0, 1536, 768, 8, true, true, &r);
    test_down_combine(QUANT_TYPE_Q4_0, 4096, 1536, 8, true, true, &r);
    test_down_combine(QUANT_TYPE_Q8_0, 4096, 1536, 8, false, false, &r);
    test_down_combine(QUANT_TYPE_Q4_0, 64, 256, 4, true, true, &r);
    test_down_combine(QUANT_TYPE_Q4_0, 3072, 256, 15, true, true, &r);
    /* norm widths 32 (n 64), 256 (n 512), 1024 over two, three and four rounds */
    test_matvec_norm(QUANT_TYPE_Q4_0, 1024, 64, true, &r);
    test_matvec_norm(QUANT_TYPE_Q4_0, 3000, 512, true, &r);
    test_matvec_norm(QUANT_TYPE_Q8_0, 2048, 2048, false, &r);
    test_matvec_norm(QUANT_TYPE_Q4_0, 12352, 2048, true, &r);
    test_matvec_norm(QUANT_TYPE_Q8_0, 24576, 3072, true, &r);
    test_matvec_norm(QUANT_TYPE_Q4_0, 32768, 4096, true, &r);
    /* tables of 64, 513 (the 80b shape's experts and shared expert), 1024 and 1100
     * entries; the second table's L2 prefetch off, before and after each block's rows */
    for (int poll = 0; poll < 2; poll++)
        for (int pf = 0; pf < 3; pf++) {
            test_experts_table(QUANT_TYPE_Q4_0, 513, 2048, 512, 11, poll, pf, &r);
            test_experts_table(QUANT_TYPE_Q8_0, 64, 1024, 256, 9, poll, pf, &r);
            test_experts_table(QUANT_TYPE_Q4_0, 1024, 512, 128, 16, poll, pf, &r);
            test_experts_table(QUANT_TYPE_Q4_0, 1100, 512, 128, 8, poll, pf, &r);
        }
    /* the gate/up product writing the down product's input rounded: tiles of 32 rows
     * with 32, 16 and 8 lanes a row (n 2048, 1024, 512); 16-row tiles (n 4096) and tiles
     * not copied by tma (ids not polled; Q8_0 tiles of 32 rows of 2048 past 48 KiB) declined */
    test_gate_up_gq(QUANT_TYPE_Q4_0, QUANT_TYPE_Q4_0, 513, 2048, 512, 11, true, true, &r);
    test_gate_up_gq(QUANT_TYPE_Q4_0, QUANT_TYPE_Q4_0, 513, 2048, 512, 11, false, false, &r);
    test_gate_up_gq(QUANT_TYPE_Q8_0, QUANT_TYPE_Q8_0, 64, 1024, 512, 10, true, true, &r);
    test_gate_up_gq(QUANT_TYPE_Q8_0, QUANT_TYPE_Q8_0, 64, 2048, 512, 10, true, false, &r);
    test_gate_up_gq(QUANT_TYPE_Q4_0, QUANT_TYPE_Q8_0, 128, 2048, 768, 9, true, true, &r);
    test_gate_up_gq(QUANT_TYPE_Q4_0, QUANT_TYPE_Q4_0, 1024, 512, 128, 16, true, true, &r);
    test_gate_up_gq(QUANT_TYPE_Q4_0, QUANT_TYPE_Q4_0, 64, 4096, 256, 8, true, false, &r);
    test_ids_poll(QUANT_TYPE_Q4_0, QUANT_TYPE_F32, 512, 10, 2048, 512, ctr, &r);
    test_ids_poll(QUANT_TYPE_Q8_0, QUANT_TYPE_F32, 128, 8, 1024, 256, ctr, &r);
    test_ids_poll(QUANT_TYPE_Q4_0, QUANT_TYPE_F32, 64, 16, 512, 128, ctr, &r);
    test_ids_poll(QUANT_TYPE_Q4_0, QUANT_TYPE_Q8_0, 512, 10, 2048, 512, ctr, &r);
    /* the shared gate by the router's launch: combine widths 1024 (a cluster of 8), 512
     * (4), 256 (2) and 32 (one block), and one block at 2048 */
    test_gate_sum(512, 10, 2048, true, ctr, &r);
    test_gate_sum(512, 10, 2048, false, ctr, &r);
    test_gate_sum(128, 8, 1024, true, ctr, &r);
    test_gate_sum(64, 16, 512, true, ctr, &r);
    test_gate_sum(60, 4, 64, true, ctr, &r);
    test_refusals(ctr);
    bench_boundaries(ctr, &r);
    bench_down_combine(&r);
    cudaFree(ctr);
    if (failures) {
        fprintf(stderr, "test_tail_cuda: %d failures\n", failures);
        return 1;
    }
    printf("test_tail_cuda: all passed\n");
    return 0;
}
