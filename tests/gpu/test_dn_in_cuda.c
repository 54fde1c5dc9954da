/*
 * test_dn_in_cuda: the fused DeltaNet decode input (cuda_deltanet_in_conv_heads:
 * the layer's stacked q|k|v|z|beta|alpha product, conv and heads in one
 * launch) against the two launches it replaces, the int8 decode product
 * (cuda_matvec, which takes mvq for these rows) and cuda_deltanet_conv_heads,
 * on fresh random Q4_0 and Q8_0 weights, activations and states.
 *   - shapes: the 80b one (nk/nv 16/32, dk = dv = 128, rows of 2048: 32
 *     lanes a row), tiled key heads, dk != dv, four value heads a key head,
 *     rows of 1024 and 256 (16 and 8 lanes a row), conv taps 2 to 4, one
 *     value head a key head with dv 16 (clusters of one block);
 *   - TDN_STEPS decode steps per case with both ways' conv and delta states
 *     carried, new activations each step, dec and y poisoned before every
 *     launch: the product rows (dec), y, the conv state and the delta state
 *     bit for bit equal after every step;
 *   - on a device of compute capability 9.0 or later the fused launch must
 *     take the 80b shape and the clusters of one block (returns 0, not
 *     -ENOTSUP); a row length the int8
 *     kernels do not take (4096 over 5152 rows) returns -ENOTSUP with
 *     nothing written; LAMINA_CUDA_DN_SPLIT=0 (one block a head) returns
 *     -ENOTSUP; bad arguments -EINVAL;
 *   - timed at the 80b shape (median of 5 x 200 steps after warm-up, CUDA
 *     events, eager launches chained with PDL): fused against the two.
 * Needs a CUDA device: exits 1 with a message when there is none.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "kernels/cuda/caps.h"
#include "kernels/cuda/deltanet.h"
#include "kernels/cuda/matvec.h"
#include "model/quant.h"
#include "tests/check.h"
#include "tests/gpu/gpu_check.h"

#define TDN_STEPS 3 /* decode steps per case, states carried */

struct tdn_case {
    uint32_t nk, nv, dk, dv, n, K, type;
    bool tiled;
};

/* Uniform in [lo, hi) from the tests' shared generator. */
static float tdn_uniform(struct rng *r, float lo, float hi)
{
    return lo + (hi - lo) * 0.5f * (rng_float(r) + 1.0f);
}

static void tdn_fill(struct rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tdn_uniform(r, lo, hi);
}

static bool tdn_ok(cudaError_t e, const char *what)
{
    CHECK(e == cudaSuccess, "%s: %s", what, cudaGetErrorString(e));
    return e == cudaSuccess;
}

/* One way's device buffers: product rows, conv state, delta state, output. */
struct tdn_way {
    float *dec, *cs, *st, *y;
};

/* The case's device buffers: weights, activations, conv taps, per-head
 * vectors and the two ways (0: product then conv_heads, 1: fused). */
struct tdn_bufs {
    const struct tdn_case *c;
    size_t rows, row_bytes, cd, vd, csn, stn;
    void *w;
    float *x, *cw, *a, *dt, *nw;
    struct tdn_way way[2];
};

static bool tdn_upload(float *d, const float *h, size_t n)
{
    return tdn_ok(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice), "upload");
}

static bool tdn_alloc(struct tdn_bufs *b, const struct tdn_case *c, struct rng *r)
{
    memset(b, 0, sizeof(*b));
    b->c = c;
    b->cd = 2 * (size_t)c->nk * c->dk + (size_t)c->nv * c->dv;
    b->vd = (size_t)c->nv * c->dv;
    b->rows = b->cd + b->vd + 2 * (size_t)c->nv;
    b->row_bytes = quant_row_size(c->type, c->n);
    b->csn = b->cd * (c->K - 1);
    b->stn = b->vd * c->dk;
    const size_t wf = (size_t)c->n, big = b->stn > b->cd * c->K ? b->stn : b->cd * c->K;
    float *tmp = malloc((big > wf ? big : wf) * sizeof(float));
    uint8_t *w = malloc(b->rows * b->row_bytes);
    bool ok = tmp && w && b->row_bytes;
    for (size_t i = 0; i < b->rows && ok; i++) {
        tdn_fill(r, tmp, c->n, -0.08f, 0.08f);
        ok = quant_quantize_row(c->type, tmp, w + i * b->row_bytes, c->n) == 0;
    }
    ok = ok && tdn_ok(cudaMalloc(&b->w, b->rows * b->row_bytes), "malloc") &&
         tdn_ok(cudaMemcpy(b->w, w, b->rows * b->row_bytes, cudaMemcpyHostToDevice), "upload");
    ok = ok && tdn_ok(cudaMalloc((void **)&b->x, c->n * sizeof(float)), "malloc") &&
         tdn_ok(cudaMalloc((void **)&b->cw, b->cd * c->K * sizeof(float)), "malloc") &&
         tdn_ok(cudaMalloc((void **)&b->a, c->nv * sizeof(float)), "malloc") &&
         tdn_ok(cudaMalloc((void **)&b->dt, c->nv * sizeof(float)), "malloc") &&
         tdn_ok(cudaMalloc((void **)&b->nw, c->dv * sizeof(float)), "malloc");
    if (ok) {
        tdn_fill(r, tmp, b->cd * c->K, -0.6f, 0.6f);
        ok = tdn_upload(b->cw, tmp, b->cd * c->K);
        tdn_fill(r, tmp, c->nv, -2.0f, -0.1f);
        ok = ok && tdn_upload(b->a, tmp, c->nv);
        tdn_fill(r, tmp, c->nv, -1.0f, 1.0f);
        ok = ok && tdn_upload(b->dt, tmp, c->nv);
        tdn_fill(r, tmp, c->dv, 0.5f, 1.5f);
        ok = ok && tdn_upload(b->nw, tmp, c->dv);
    }
    for (int k = 0; k < 2 && ok; k++) {
        struct tdn_way *v = &b->way[k];
        ok = tdn_ok(cudaMalloc((void **)&v->dec, b->rows * sizeof(float)), "malloc") &&
             tdn_ok(cudaMalloc((void **)&v->cs, (b->csn + 1) * sizeof(float)), "malloc") &&
             tdn_ok(cudaMalloc((void **)&v->st, b->stn * sizeof(float)), "malloc") &&
             tdn_ok(cudaMalloc((void **)&v->y, b->vd * sizeof(float)), "malloc");
    }
    if (ok) { /* both ways start from the same states */
        tdn_fill(r, tmp, b->csn, -1.0f, 1.0f);
        ok = tdn_upload(b->way[0].cs, tmp, b->csn) && tdn_upload(b->way[1].cs, tmp, b->csn);
        tdn_fill(r, tmp, b->stn, -0.5f, 0.5f);
        ok = ok && tdn_upload(b->way[0].st, tmp, b->stn) && tdn_upload(b->way[1].st, tmp, b->stn);
    }
    free(tmp);
    free(w);
    return ok;
}

static void tdn_free(struct tdn_bufs *b)
{
    cudaFree(b->w), cudaFree(b->x), cudaFree(b->cw), cudaFree(b->a), cudaFree(b->dt);
    cudaFree(b->nw);
    for (int k = 0; k < 2; k++)
        cudaFree(b->way[k].dec), cudaFree(b->way[k].cs), cudaFree(b->way[k].st),
            cudaFree(b->way[k].y);
}

/* One decode step one way on stream s (2 and 3: way 0's two launches alone, for timing). */
static int tdn_step(const struct tdn_bufs *b, int k, cudaStream_t s)
{
    const struct tdn_case *c = b->c;
    const struct tdn_way *v = &b->way[k % 2];
    float *z = v->dec + b->cd, *beta = z + b->vd, *alpha = beta + c->nv;
    if (k == 2) /* timing only: the product alone */
        return cuda_matvec(c->type, b->w, b->row_bytes, b->rows, c->n, b->x, v->dec, s);
    if (k == 3) /* timing only: conv + heads alone */
        return cuda_deltanet_conv_heads(v->cs, b->cw, c->K, v->dec, v->st, beta, alpha, b->a,
                                        b->dt, z, b->nw, v->y, c->nk, c->nv, c->dk, c->dv,
                                        c->tiled, 1e-6f, s);
    if (k == 1)
        return cuda_deltanet_in_conv_heads(c->type, b->w, b->row_bytes, c->n, b->x, v->dec,
                                           v->cs, b->cw, c->K, v->st, b->a, b->dt, b->nw, v->y,
                                           c->nk, c->nv, c->dk, c->dv, c->tiled, 1e-6f, s);
    const int rc = cuda_matvec(c->type, b->w, b->row_bytes, b->rows, c->n, b->x, v->dec, s);
    return rc ? rc
              : cuda_deltanet_conv_heads(v->cs, b->cw, c->K, v->dec, v->st, beta, alpha, b->a,
                                         b->dt, z, b->nw, v->y, c->nk, c->nv, c->dk, c->dv,
                                         c->tiled, 1e-6f, s);
}

/* Whether device buffers a and b of n floats hold the same bytes; *diff:
 * the largest difference. */
static bool tdn_same(const float *d_a, const float *d_b, size_t n, double *diff)
{
    float *ha = malloc(n * sizeof(float)), *hb = malloc(n * sizeof(float));
    bool same = ha && hb &&
                tdn_ok(cudaMemcpy(ha, d_a, n * sizeof(float), cudaMemcpyDeviceToHost), "dl") &&
                tdn_ok(cudaMemcpy(hb, d_b, n * sizeof(float), cudaMemcpyDeviceToHost), "dl") &&
                !memcmp(ha, hb, n * sizeof(float));
    *diff = 0.0;
    for (size_t i = 0; ha && hb && i < n; i++) {
        const double e = fabs((double)ha[i] - hb[i]);
        *diff = isnan(e) ? INFINITY : fmax(*diff, e);
    }
    free(ha), free(hb);
    return same;
}

static float tdn_median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            const float t = v[j];
            v[j] = v[j - 1], v[j - 1] = t;
        }
    return v[n / 2];
}

/* us per step of way k: median of 5 runs of 200 steps after warm-up. */
static double tdn_time(const struct tdn_bufs *b, int k)
{
    cudaStream_t s;
    cudaEvent_t e0, e1;
    if (!tdn_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"))
        return -1.0;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float ms[5];
    int rc = 0;
    for (int i = 0; i < 20 && !rc; i++)
        rc = tdn_step(b, k, s);
    for (int run = 0; run < 5 && !rc; run++) {
        cudaEventRecord(e0, s);
        for (int i = 0; i < 200 && !rc; i++)
            rc = tdn_step(b, k, s);
        cudaEventRecord(e1, s);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms[run], e0, e1);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(s);
    return rc ? -1.0 : tdn_median(ms, 5) * 1e3 / 200;
}

static void tdn_run(const struct tdn_case *c, uint64_t seed, bool must_fuse, bool timed)
{
    struct rng r = {seed};
    struct tdn_bufs b;
    bool ok = tdn_alloc(&b, c, &r);
    float *x = malloc(c->n * sizeof(float));
    ok = ok && x;
    int equal = 0, fused = 0;
    for (int step = 0; step < TDN_STEPS && ok; step++) {
        tdn_fill(&r, x, c->n, -2.0f, 2.0f);
        ok = tdn_upload(b.x, x, c->n);
        for (int k = 0; k < 2 && ok; k++)
            ok = tdn_ok(cudaMemset(b.way[k].dec, k ? 0xfe : 0xff, b.rows * 4), "poison") &&
                 tdn_ok(cudaMemset(b.way[k].y, k ? 0xfe : 0xff, b.vd * 4), "poison");
        const int r0 = ok ? tdn_step(&b, 0, 0) : -1;
        const int r1 = ok ? tdn_step(&b, 1, 0) : -1;
        CHECK(r0 == 0, "nk/nv %u/%u dk %u dv %u n %u: product + conv_heads returned %d", c->nk,
              c->nv, c->dk, c->dv, c->n, r0);
        CHECK(r1 == 0 || (r1 == -ENOTSUP && !must_fuse),
              "nk/nv %u/%u dk %u dv %u n %u: the fused launch returned %d", c->nk, c->nv, c->dk,
              c->dv, c->n, r1);
        ok = ok && r0 == 0 && (r1 == 0 || r1 == -ENOTSUP) &&
             tdn_ok(cudaDeviceSynchronize(), "step");
        if (!ok || r1 == -ENOTSUP)
            break;
        fused++;
        double dd, dy, dc, ds;
        const bool s1 = tdn_same(b.way[0].dec, b.way[1].dec, b.rows, &dd);
        const bool s2 = tdn_same(b.way[0].y, b.way[1].y, b.vd, &dy);
        const bool s3 = tdn_same(b.way[0].cs, b.way[1].cs, b.csn, &dc);
        const bool s4 = tdn_same(b.way[0].st, b.way[1].st, b.stn, &ds);
        CHECK(s1 && s2 && s3 && s4,
              "nk/nv %u/%u dk %u dv %u n %u %s %s K %u step %d: fused differs from product + "
              "conv_heads (max |diff| rows %.3g, y %.3g, conv state %.3g, state %.3g)",
              c->nk, c->nv, c->dk, c->dv, c->n, quant_type_name(c->type),
              c->tiled ? "tiled" : "grouped", c->K, step, dd, dy, dc, ds);
        equal += s1 && s2 && s3 && s4;
    }
    CHECK(ok, "nk/nv %u/%u dk %u dv %u n %u: comparison did not run", c->nk, c->nv, c->dk, c->dv,
          c->n);
    MEASURE("dn_in nk/nv=%u/%u dk=%u dv=%u n=%u %s %s K=%u: %s, %d of %d steps bit for bit "
            "equal to product + conv_heads", c->nk, c->nv, c->dk, c->dv, c->n,
            quant_type_name(c->type), c->tiled ? "tiled" : "grouped", c->K,
            fused ? "fused" : "not taken (-ENOTSUP)", equal, fused);
    if (ok && timed && fused) {
        const double t0 = tdn_time(&b, 0), t1 = tdn_time(&b, 1);
        const double t2 = tdn_time(&b, 2), t3 = tdn_time(&b, 3);
        MEASURE("dn_in 80b shape: product + conv_heads %.2f us (product alone %.2f, conv_heads "
                "alone %.2f), fused %.2f us per step (median of 5 x 200 eager steps)", t0, t2, t3,
                t1);
    }
    free(x);
    tdn_free(&b);
}

/* -ENOTSUP and -EINVAL: nothing launched, nothing written. */
static void tdn_refusals(void)
{
    const struct tdn_case big = {2, 4, 128, 128, 4096, 4, QUANT_TYPE_Q4_0, false};
    struct rng r = {99};
    struct tdn_bufs b;
    if (!tdn_alloc(&b, &big, &r))
        return;
    cudaMemset(b.way[1].y, 0xfe, b.vd * 4);
    const int r1 = tdn_step(&b, 1, 0);
    double d = 0.0;
    float *poison = NULL;
    bool same = tdn_ok(cudaMalloc((void **)&poison, b.vd * 4), "malloc") &&
                tdn_ok(cudaMemset(poison, 0xfe, b.vd * 4), "poison") &&
                tdn_ok(cudaDeviceSynchronize(), "sync") &&
                tdn_same(poison, b.way[1].y, b.vd, &d);
    CHECK(r1 == -ENOTSUP && same, "rows of 4096 over %zu rows: %d (want -ENOTSUP), y %s", b.rows,
          r1, same ? "untouched" : "written");
    setenv("LAMINA_CUDA_DN_SPLIT", "0", 1);
    const struct tdn_case small = {2, 4, 16, 16, 256, 4, QUANT_TYPE_Q4_0, false};
    struct tdn_bufs s;
    if (tdn_alloc(&s, &small, &r)) {
        const int r2 = tdn_step(&s, 1, 0);
        CHECK(r2 == -ENOTSUP, "LAMINA_CUDA_DN_SPLIT=0: %d (want -ENOTSUP)", r2);
        unsetenv("LAMINA_CUDA_DN_SPLIT");
        const int r3 = cuda_deltanet_in_conv_heads(QUANT_TYPE_Q4_0, s.w, s.row_bytes, 250, s.x,
                                                   s.way[1].dec, s.way[1].cs, s.cw, 4,
                                                   s.way[1].st, s.a, s.dt, s.nw, s.way[1].y, 2, 4,
                                                   16, 16, false, 1e-6f, 0);
        const int r4 = cuda_deltanet_in_conv_heads(QUANT_TYPE_Q4_0, s.w, s.row_bytes, 256, s.x,
                                                   s.way[1].dec, s.way[1].cs, s.cw, 9,
                                                   s.way[1].st, s.a, s.dt, s.nw, s.way[1].y, 2, 4,
                                                   16, 16, false, 1e-6f, 0);
        const int r5 = cuda_deltanet_in_conv_heads(QUANT_TYPE_Q4_0, NULL, s.row_bytes, 256, s.x,
                                                   s.way[1].dec, s.way[1].cs, s.cw, 4,
                                                   s.way[1].st, s.a, s.dt, s.nw, s.way[1].y, 3, 4,
                                                   16, 16, false, 1e-6f, 0);
        CHECK(r3 == -EINVAL && r4 == -EINVAL && r5 == -EINVAL,
              "bad row length, conv taps, weights and heads refused: %d %d %d", r3, r4, r5);
        tdn_free(&s);
    }
    unsetenv("LAMINA_CUDA_DN_SPLIT");
    cudaFree(poison);
    tdn_free(&b);
}

int main(void)
{
    log_init("test", -1);
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_dn_in_cuda: no CUDA device present\n");
        return 1;
    }
    const bool sm90 = cuda_caps_cc() >= 90; /* LAMINA_CUDA_AS_SM may lower it (caps.h) */
    const struct tdn_case cases[] = {
        {16, 32, 128, 128, 2048, 4, QUANT_TYPE_Q4_0, false}, /* qwen3next 80b-a3b */
        {16, 32, 128, 128, 2048, 4, QUANT_TYPE_Q8_0, true},  /* qwen35moe: tiled */
        {8, 16, 128, 64, 2048, 3, QUANT_TYPE_Q4_0, false},   /* dk != dv */
        {2, 8, 32, 64, 512, 3, QUANT_TYPE_Q4_0, true},       /* four value heads a key head */
        {4, 4, 64, 64, 1024, 2, QUANT_TYPE_Q8_0, false},     /* 16 lanes a row */
        {2, 4, 16, 16, 256, 4, QUANT_TYPE_Q4_0, false},      /* 8 lanes a row */
        {4, 8, 64, 128, 256, 4, QUANT_TYPE_Q8_0, true},
        {4, 4, 16, 16, 256, 4, QUANT_TYPE_Q4_0, false},      /* clusters of one block */
    };
    const size_t n_cases = sizeof(cases) / sizeof(cases[0]);
    /* the fused launch must be taken on sm_90 at the 80b shape and at the
     * clusters of one block (one value head a key head, dv 16: one block a head) */
    for (size_t i = 0; i < n_cases; i++)
        tdn_run(&cases[i], 1000 + i, sm90 && (i == 0 || i == n_cases - 1), i == 0);
    tdn_refusals();
    return test_main_result("test_dn_in_cuda");
}
