/*
 * test_dn_in_cuda: the fused DeltaNet decode inputs (the layer's stacked
 * q|k|v|z|beta|alpha product, conv and heads in one launch: the cluster form
 * cuda_deltanet_in_conv_heads and the tail form cuda_deltanet_in_tail)
 * against the two launches they replace, the int8 decode product
 * (cuda_matvec, which takes mvq for these rows) and cuda_deltanet_conv_heads,
 * on fresh random Q4_0 and Q8_0 weights, activations and states.
 *   - shapes: the 80b one (nk/nv 16/32, dk = dv = 128, rows of 2048: 32
 *     lanes a row), tiled key heads, dk != dv, four value heads a key head,
 *     rows of 1024 and 256 (16 and 8 lanes a row), conv taps 2 to 4, one
 *     value head a key head with dv 16 (clusters of one block);
 *   - TDN_STEPS decode steps per case with every way's conv and delta states
 *     carried, new activations each step, dec, y and yq poisoned before every
 *     launch: the product rows (dec), y, the conv state and the delta state
 *     bit for bit equal after every step; the tail form reads the row as
 *     floats on even steps and rounded (the host's rounding, mvq's layout) on
 *     odd ones, and where dv is a multiple of 32 also writes y rounded (yq),
 *     which must equal the host's rounding of the reference y byte for byte;
 *     its two ways of running the heads' steps (in owner blocks that wait for
 *     the rows, the default; in the blocks that complete them,
 *     LAMINA_CUDA_DN_TAIL=last) on four of the shapes (which block ran a step
 *     is not observable here: the bits are the same);
 *   - shapes for the tail form's edges besides: dv 96 (a second pass of 32
 *     rows), and eight value heads over six blocks (owners of two heads); the
 *     80b shapes again with 4 and 0 steps' weights loaded before the PDL wait
 *     (LAMINA_CUDA_DN_TAIL_PRE; default 1), timed with 0, 1, 2 and 4;
 *   - on a device of compute capability 9.0 or later the fused launches must
 *     take the 80b shape, the cluster form the clusters of one block (returns
 *     0, not -ENOTSUP); a row length the int8
 *     kernels do not take (4096 over 5152 rows) returns -ENOTSUP with
 *     nothing written (both forms); LAMINA_CUDA_DN_SPLIT=0 (one block a head)
 *     -ENOTSUP for the cluster form; a yq asked for at dv 16 -ENOTSUP; bad
 *     arguments -EINVAL;
 *   - timed at the 80b shape (median of 5 x 200 steps after warm-up, CUDA
 *     events, eager launches chained with PDL): both fused forms against the
 *     two launches.
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
#include "kernels/cuda/mvq.h"
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

#define TDN_WAYS 3 /* 0: product then conv_heads, 1: fused (clusters), 2: fused (tails) */

/* The case's device buffers: weights, activations (and rounded: xq), conv
 * taps, per-head vectors, the ways, and the tail form's rounded y (yq, or
 * NULL where dv is not a multiple of 32); xq_on: the tail form reads xq. */
struct tdn_bufs {
    const struct tdn_case *c;
    size_t rows, row_bytes, cd, vd, csn, stn;
    void *w;
    float *x, *cw, *a, *dt, *nw;
    int8_t *xq, *yq;
    bool xq_on;
    struct tdn_way way[TDN_WAYS];
};

/* mvq's rounding of a row of n (a multiple of 32) on the host, in its
 * layout (mvq.h's cuda_mvq_xq: n levels, n/32 scales, n/32 scale x level
 * sums): the device's round_levels, the same single-rounding operations. */
static void tdn_round(const float *x, size_t n, int8_t *out)
{
    float *d = (float *)(out + n), *sm = d + n / 32;
    for (size_t b = 0; b < n / 32; b++) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int qs = 0;
        for (int j = 0; j < 32; j++) {
            const int q = (int)rintf(x[b * 32 + j] * id);
            out[b * 32 + j] = (int8_t)q;
            qs += q;
        }
        d[b] = amax / 127.0f;
        sm[b] = d[b] * (float)qs;
    }
}

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
         tdn_ok(cudaMalloc((void **)&b->xq, cuda_mvq_xq_bytes(c->n)), "malloc") &&
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
    if (ok && c->dv % 32 == 0)
        ok = tdn_ok(cudaMalloc((void **)&b->yq, cuda_mvq_xq_bytes(b->vd)), "malloc");
    for (int k = 0; k < TDN_WAYS && ok; k++) {
        struct tdn_way *v = &b->way[k];
        ok = tdn_ok(cudaMalloc((void **)&v->dec, b->rows * sizeof(float)), "malloc") &&
             tdn_ok(cudaMalloc((void **)&v->cs, (b->csn + 1) * sizeof(float)), "malloc") &&
             tdn_ok(cudaMalloc((void **)&v->st, b->stn * sizeof(float)), "malloc") &&
             tdn_ok(cudaMalloc((void **)&v->y, b->vd * sizeof(float)), "malloc");
    }
    if (ok) { /* every way starts from the same states */
        tdn_fill(r, tmp, b->csn, -1.0f, 1.0f);
        for (int k = 0; k < TDN_WAYS && ok; k++)
            ok = tdn_upload(b->way[k].cs, tmp, b->csn);
        tdn_fill(r, tmp, b->stn, -0.5f, 0.5f);
        for (int k = 0; k < TDN_WAYS && ok; k++)
            ok = tdn_upload(b->way[k].st, tmp, b->stn);
    }
    free(tmp);
    free(w);
    return ok;
}

static void tdn_free(struct tdn_bufs *b)
{
    cudaFree(b->w), cudaFree(b->x), cudaFree(b->cw), cudaFree(b->a), cudaFree(b->dt);
    cudaFree(b->nw), cudaFree(b->xq), cudaFree(b->yq);
    for (int k = 0; k < TDN_WAYS; k++)
        cudaFree(b->way[k].dec), cudaFree(b->way[k].cs), cudaFree(b->way[k].st),
            cudaFree(b->way[k].y);
}

/* One decode step one way on stream s (3 and 4: way 0's two launches alone, 5: the
 * backend's default pair, the product from the rounded row and conv + heads writing yq
 * with the states read before the wait: timing only). */
static int tdn_step(const struct tdn_bufs *b, int k, cudaStream_t s)
{
    const struct tdn_case *c = b->c;
    const struct tdn_way *v = &b->way[k < TDN_WAYS ? k : 0];
    float *z = v->dec + b->cd, *beta = z + b->vd, *alpha = beta + c->nv;
    if (k == 3) /* timing only: the product alone */
        return cuda_matvec(c->type, b->w, b->row_bytes, b->rows, c->n, b->x, v->dec, s);
    if (k == 5) {
        const int rc = cuda_mvq_xq(c->type, b->w, b->row_bytes, b->rows, c->n, b->xq, v->dec, s);
        return rc ? rc
                  : cuda_deltanet_conv_heads_yq(v->cs, b->cw, c->K, v->dec, v->st, beta, alpha,
                                                b->a, b->dt, z, b->nw, v->y, b->yq, c->nk, c->nv,
                                                c->dk, c->dv, c->tiled, 1e-6f, true, s);
    }
    if (k == 2)
        return cuda_deltanet_in_tail(c->type, b->w, b->row_bytes, c->n, b->xq_on ? NULL : b->x,
                                     b->xq_on ? b->xq : NULL, v->dec, v->cs, b->cw, c->K, v->st,
                                     b->a, b->dt, b->nw, v->y, b->yq, c->nk, c->nv, c->dk, c->dv,
                                     c->tiled, 1e-6f, s);
    if (k == 4) /* timing only: conv + heads alone */
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

/* Whether device yq (the tail form's rounded y) holds the host's rounding
 * of the reference y (way 0's) byte for byte. */
static bool tdn_yq_same(const struct tdn_bufs *b)
{
    const size_t bytes = cuda_mvq_xq_bytes(b->vd);
    float *y = malloc(b->vd * sizeof(float));
    int8_t *want = calloc(1, bytes), *got = calloc(1, bytes);
    bool same = y && want && got &&
                tdn_ok(cudaMemcpy(y, b->way[0].y, b->vd * sizeof(float), cudaMemcpyDeviceToHost),
                       "dl") &&
                tdn_ok(cudaMemcpy(got, b->yq, bytes, cudaMemcpyDeviceToHost), "dl");
    if (same) {
        tdn_round(y, b->vd, want);
        /* levels, scales and sums; the padding past them is not written */
        same = !memcmp(want, got, b->vd + 8 * (b->vd / 32));
    }
    free(y), free(want), free(got);
    return same;
}

/* Way k against way 0 after a step: dec, y, conv state and delta state bit
 * for bit (and the tail form's yq where it writes one). */
static bool tdn_compare(const struct tdn_bufs *b, int k, int step)
{
    const struct tdn_case *c = b->c;
    double dd, dy, dc, ds;
    const bool s1 = tdn_same(b->way[0].dec, b->way[k].dec, b->rows, &dd);
    const bool s2 = tdn_same(b->way[0].y, b->way[k].y, b->vd, &dy);
    const bool s3 = tdn_same(b->way[0].cs, b->way[k].cs, b->csn, &dc);
    const bool s4 = tdn_same(b->way[0].st, b->way[k].st, b->stn, &ds);
    const bool s5 = k != 2 || !b->yq || tdn_yq_same(b);
    CHECK(s1 && s2 && s3 && s4 && s5,
          "nk/nv %u/%u dk %u dv %u n %u %s %s K %u step %d: the %s form differs from product + "
          "conv_heads (max |diff| rows %.3g, y %.3g, conv state %.3g, state %.3g; yq %s)",
          c->nk, c->nv, c->dk, c->dv, c->n, quant_type_name(c->type),
          c->tiled ? "tiled" : "grouped", c->K, step, k == 1 ? "cluster" : "tail", dd, dy, dc,
          ds, s5 ? "equal" : "differs");
    return s1 && s2 && s3 && s4 && s5;
}

/* must: which fused forms must be taken (bit 1: clusters, bit 2: tails). */
static void tdn_run(const struct tdn_case *c, uint64_t seed, unsigned must, bool timed)
{
    struct rng r = {seed};
    struct tdn_bufs b;
    bool ok = tdn_alloc(&b, c, &r);
    float *x = malloc(c->n * sizeof(float));
    int8_t *xq = malloc(cuda_mvq_xq_bytes(c->n));
    ok = ok && x && xq;
    int equal[TDN_WAYS] = {0}, fused[TDN_WAYS] = {0}, rc[TDN_WAYS] = {0};
    bool taken[TDN_WAYS] = {true, true, true};
    for (int step = 0; step < TDN_STEPS && ok; step++) {
        tdn_fill(&r, x, c->n, -2.0f, 2.0f);
        tdn_round(x, c->n, xq);
        b.xq_on = step % 2 == 1;
        ok = tdn_upload(b.x, x, c->n) &&
             tdn_ok(cudaMemcpy(b.xq, xq, cuda_mvq_xq_bytes(c->n), cudaMemcpyHostToDevice),
                    "upload");
        for (int k = 0; k < TDN_WAYS && ok; k++)
            ok = tdn_ok(cudaMemset(b.way[k].dec, 0xff - k, b.rows * 4), "poison") &&
                 tdn_ok(cudaMemset(b.way[k].y, 0xff - k, b.vd * 4), "poison");
        if (ok && b.yq)
            ok = tdn_ok(cudaMemset(b.yq, 0xfd, cuda_mvq_xq_bytes(b.vd)), "poison");
        for (int k = 0; k < TDN_WAYS && ok; k++) {
            if (!taken[k])
                continue;
            rc[k] = tdn_step(&b, k, 0);
            const bool must_k = k == 0 || (must >> k & 1u);
            CHECK(rc[k] == 0 || (rc[k] == -ENOTSUP && !must_k),
                  "nk/nv %u/%u dk %u dv %u n %u: way %d returned %d", c->nk, c->nv, c->dk, c->dv,
                  c->n, k, rc[k]);
            ok = rc[k] == 0 || (rc[k] == -ENOTSUP && k > 0);
            taken[k] = rc[k] == 0;
        }
        ok = ok && tdn_ok(cudaDeviceSynchronize(), "step");
        for (int k = 1; k < TDN_WAYS && ok; k++) {
            if (!taken[k])
                continue;
            fused[k]++;
            equal[k] += tdn_compare(&b, k, step);
        }
        /* way 0 stays the reference: the others' states were compared, so
         * they continue from equal states */
    }
    CHECK(ok, "nk/nv %u/%u dk %u dv %u n %u: comparison did not run", c->nk, c->nv, c->dk, c->dv,
          c->n);
    MEASURE("dn_in nk/nv=%u/%u dk=%u dv=%u n=%u %s %s K=%u: clusters %s, %d of %d steps bit for "
            "bit equal; tails %s, %d of %d steps equal (floats and rounded rows alternating; yq "
            "%s)", c->nk, c->nv, c->dk, c->dv, c->n, quant_type_name(c->type),
            c->tiled ? "tiled" : "grouped", c->K,
            fused[1] ? "taken" : "not taken (-ENOTSUP)", equal[1], fused[1],
            fused[2] ? "taken" : "not taken (-ENOTSUP)", equal[2], fused[2],
            b.yq ? "checked" : "not asked (dv % 32)");
    if (ok && timed && (fused[1] || fused[2])) {
        b.xq_on = true;
        const double t0 = tdn_time(&b, 0), t1 = fused[1] ? tdn_time(&b, 1) : -1.0;
        const double t2 = fused[2] ? tdn_time(&b, 2) : -1.0;
        setenv("LAMINA_CUDA_DN_TAIL", "last", 1); /* the completing blocks run the steps */
        const double t2l = fused[2] ? tdn_time(&b, 2) : -1.0;
        unsetenv("LAMINA_CUDA_DN_TAIL");
        /* the tail form with 0, 2 and 4 steps' weights loaded before the wait (default 1) */
        double tp[3] = {-1.0, -1.0, -1.0};
        static const char *const pres[3] = {"0", "2", "4"};
        for (int i = 0; i < 3 && fused[2]; i++) {
            setenv("LAMINA_CUDA_DN_TAIL_PRE", pres[i], 1);
            tp[i] = tdn_time(&b, 2);
        }
        unsetenv("LAMINA_CUDA_DN_TAIL_PRE");
        MEASURE("dn_in 80b shape, tails (owners) by steps loaded before the wait: 0 %.2f, 1 "
                "(default) %.2f, 2 %.2f, 4 %.2f us per step", tp[0], t2, tp[1], tp[2]);
        const double t3 = tdn_time(&b, 3), t4 = tdn_time(&b, 4);
        const double t5 = b.yq ? tdn_time(&b, 5) : -1.0;
        MEASURE("dn_in 80b shape: product + conv_heads %.2f us (product alone %.2f, conv_heads "
                "alone %.2f; the backend's pair, rounded row in, yq out, early states: %.2f), "
                "fused with clusters %.2f us, fused with tails (rounded row in, yq out) %.2f us "
                "(owners), %.2f us (completing blocks) per step (median of 5 x 200 eager steps; "
                "-1: not taken)", t0, t3, t4, t5, t1, t2, t2l);
    }
    free(x);
    free(xq);
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
    cudaMemset(b.way[2].y, 0xfe, b.vd * 4);
    const int rt = tdn_step(&b, 2, 0);
    same = tdn_ok(cudaDeviceSynchronize(), "sync") && tdn_same(poison, b.way[2].y, b.vd, &d);
    CHECK(rt == -ENOTSUP && same, "tails, rows of 4096 over %zu rows: %d (want -ENOTSUP), y %s",
          b.rows, rt, same ? "untouched" : "written");
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
        /* the tail form: a yq at dv 16, then bad arguments */
        int8_t *yq = NULL;
        const bool have = tdn_ok(cudaMalloc((void **)&yq, cuda_mvq_xq_bytes(s.vd)), "malloc");
        const int t1 = have ? cuda_deltanet_in_tail(QUANT_TYPE_Q4_0, s.w, s.row_bytes, 256, s.x,
                                                    NULL, s.way[2].dec, s.way[2].cs, s.cw, 4,
                                                    s.way[2].st, s.a, s.dt, s.nw, s.way[2].y, yq,
                                                    2, 4, 16, 16, false, 1e-6f, 0)
                            : -1;
        const int t2 = cuda_deltanet_in_tail(QUANT_TYPE_Q4_0, s.w, s.row_bytes, 250, s.x, NULL,
                                             s.way[2].dec, s.way[2].cs, s.cw, 4, s.way[2].st,
                                             s.a, s.dt, s.nw, s.way[2].y, NULL, 2, 4, 16, 16,
                                             false, 1e-6f, 0);
        const int t3 = cuda_deltanet_in_tail(QUANT_TYPE_Q4_0, s.w, s.row_bytes, 256, NULL, NULL,
                                             s.way[2].dec, s.way[2].cs, s.cw, 4, s.way[2].st,
                                             s.a, s.dt, s.nw, s.way[2].y, NULL, 2, 4, 16, 16,
                                             false, 1e-6f, 0);
        const int t4 = cuda_deltanet_in_tail(QUANT_TYPE_Q4_0, s.w, s.row_bytes, 256, s.x, NULL,
                                             s.way[2].dec, s.way[2].cs, s.cw, 4, s.way[2].st,
                                             s.a, s.dt, s.nw, s.way[2].y, NULL, 3, 4, 16, 16,
                                             false, 1e-6f, 0);
        CHECK(t1 == -ENOTSUP && t2 == -EINVAL && t3 == -EINVAL && t4 == -EINVAL,
              "tails: yq at dv 16 %d (want -ENOTSUP); bad row length, no row, bad heads %d %d %d "
              "(want -EINVAL)", t1, t2, t3, t4);
        cudaFree(yq);
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
        {4, 8, 64, 96, 1024, 4, QUANT_TYPE_Q8_0, false},     /* tails: a second pass of 32 */
        {2, 8, 16, 16, 256, 4, QUANT_TYPE_Q4_0, true},       /* tails: 8 heads, 6 blocks */
        {4, 4, 16, 16, 256, 4, QUANT_TYPE_Q4_0, false},      /* clusters of one block */
    };
    const size_t n_cases = sizeof(cases) / sizeof(cases[0]);
    /* on sm_90 both fused forms must take the 80b shape (the tail form its
     * tiled Q8_0 twin too), the cluster form the clusters of one block (one
     * value head a key head, dv 16: one block a head) */
    for (size_t i = 0; i < n_cases; i++) {
        const unsigned must = !sm90 ? 0u : i == 0 ? 6u : i == 1 ? 4u : i == n_cases - 1 ? 2u : 0u;
        tdn_run(&cases[i], 1000 + i, must, i == 0);
    }
    /* the tail form's other way: each head's step in the block that completes
     * its rows (LAMINA_CUDA_DN_TAIL=last) instead of in its owner */
    setenv("LAMINA_CUDA_DN_TAIL", "last", 1);
    tdn_run(&cases[0], 2000, sm90 ? 4u : 0u, false);
    tdn_run(&cases[3], 2003, 0u, false);
    tdn_run(&cases[n_cases - 3], 2008, 0u, false);
    tdn_run(&cases[n_cases - 2], 2009, 0u, false);
    unsetenv("LAMINA_CUDA_DN_TAIL");
    /* the same bits whatever the weights loaded before the wait */
    setenv("LAMINA_CUDA_DN_TAIL_PRE", "4", 1);
    tdn_run(&cases[0], 2010, sm90 ? 4u : 0u, false);
    tdn_run(&cases[1], 2011, sm90 ? 4u : 0u, false);
    setenv("LAMINA_CUDA_DN_TAIL_PRE", "0", 1);
    tdn_run(&cases[0], 2012, sm90 ? 4u : 0u, false);
    unsetenv("LAMINA_CUDA_DN_TAIL_PRE");
    tdn_refusals();
    return test_main_result("test_dn_in_cuda");
}
