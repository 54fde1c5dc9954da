/*
 * test_out_router_cuda: the decode output product with the router in the
 * same launch (cuda_mvq_xq_router, tail.h) against the two launches it
 * replaces: cuda_mvq_xq_tail (the product over the rounded mixer output),
 * then cuda_matvec_tail_norm_in (the F32 router over rmsnorm(h + y) * g with
 * its top-k tail and the shared expert's gate).
 *
 * On fresh random data (outputs poisoned before each run):
 *   - the product's rows, the normalised row, its rounding and the shared
 *     expert's gate byte for byte;
 *   - the logits, summed in another order, within 2e-5 of the largest
 *     logit's magnitude of the router's, and both within 1e-4 of the host's
 *     float64 logits over the normalised row;
 *   - the ids equal to the router's (where no two logits at the k-th place
 *     are within the tolerance: then the picks are checked to be logits that
 *     close), the weights within 1e-5;
 *   - three fused launches in a row byte-identical (the counter back at 0),
 *     the first with the router's columns read from the router, the others
 *     from its transposed copy (d_rwt);
 * at Q4_0 and Q8_0, product rows of 64 to 4096 (32, 16 and 8 lanes a row;
 * one pass and two a lane), 512 down to 16 experts, with and without the
 * gate and the norm weights, hidden sizes whose tiles leave blocks of the
 * last cluster without rows (1056, 96), and the ids marked for a polling
 * product. Arguments it does not take give
 * -ENOTSUP or -EINVAL with nothing launched.
 * Then, timed: the 80b-a3b shape's product and router as two launches and
 * as one, each as a CUDA graph of 48 copies replayed (median of 20 replays
 * after warm-up), then over eight layers' weights in turn (from memory, as in
 * the decode): [measure] lines in us per layer; the fused graph's last
 * outputs (48 launches chained by programmatic dependent launch) byte-identical
 * to an eager launch's.
 * Needs compute capability 9.0 (thread block clusters); elsewhere the
 * launcher must decline (-ENOTSUP), which is what is checked there.
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

static void *host_copy(const void *d, size_t bytes)
{
    void *h = xmalloc(bytes ? bytes : 1);
    CU(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* Byte comparison of two device buffers (CHECKed); true when equal. */
static bool same(const void *a, const void *b, size_t bytes, const char *what)
{
    const size_t first = dev_first_diff(a, b, bytes);
    CHECK(first == bytes, "%s: differs from byte %zu of %zu", what, first, bytes);
    return first == bytes;
}

/* One launch's outputs: [0] the two launches, [1.. ] the fused ones. */
struct outs {
    float *y, *xa, *lg, *w, *gs;
    int8_t *xq;
    int32_t *ids;
};

static void outs_alloc(struct outs *o, uint32_t n, uint32_t E, uint32_t k)
{
    CU(cudaMalloc((void **)&o->y, n * sizeof(float)));
    CU(cudaMalloc((void **)&o->xa, n * sizeof(float)));
    CU(cudaMalloc((void **)&o->lg, E * sizeof(float)));
    CU(cudaMalloc((void **)&o->w, k * sizeof(float)));
    CU(cudaMalloc((void **)&o->gs, sizeof(float)));
    CU(cudaMalloc((void **)&o->xq, cuda_mvq_xq_bytes(n)));
    CU(cudaMalloc((void **)&o->ids, k * sizeof(int32_t)));
}

static void outs_poison(struct outs *o, uint32_t n, uint32_t E, uint32_t k)
{
    dev_poison_bytes(o->y, n * sizeof(float));
    dev_poison_bytes(o->xa, n * sizeof(float));
    dev_poison_bytes(o->lg, E * sizeof(float));
    dev_poison_bytes(o->w, k * sizeof(float));
    dev_poison_bytes(o->gs, sizeof(float));
    dev_poison_bytes(o->xq, cuda_mvq_xq_bytes(n));
    dev_poison_bytes(o->ids, k * sizeof(int32_t));
}

static void outs_free(struct outs *o)
{
    cudaFree(o->y);
    cudaFree(o->xa);
    cudaFree(o->lg);
    cudaFree(o->w);
    cudaFree(o->gs);
    cudaFree(o->xq);
    cudaFree(o->ids);
}

/* The inputs of one case: the output product W (n rows of n_in, type), the mixer's output
 * rounded (xq), h, the norm's weights g (or none), the router Wr (E x n F32), the gate (or
 * none), the counter and the scratch. */
struct inputs {
    uint32_t type, n, n_in, E, k;
    void *W;
    float *Wr, *Wrt, *h, *g, *gate, *part; /* Wrt: Wr transposed (n rows of E) */
    int8_t *xq;
    size_t part_floats;
    unsigned int *ctr;
    float *hWr;
};

/* form 0: the two launches; 1: the fused launch; 2: the fused launch reading the router's
 * columns from its transposed copy */
static int launch(const struct inputs *in, const struct outs *o, int form, bool mark,
                  cudaStream_t st)
{
    const bool fused = form > 0;
    const size_t rb = quant_row_size(in->type, in->n_in);
    const struct cuda_norm_in ni = {.h = in->h, .add = o->y, .w = in->g, .eps = 1e-6f,
                                    .gate = in->gate, .gs = in->gate ? o->gs : NULL};
    const struct cuda_tail t = {.kind = CUDA_TAIL_TOPK, .counter = in->ctr, .k = in->k,
                                .ids = o->ids, .w = o->w, .mark_ids = mark};
    if (fused)
        return cuda_mvq_xq_router(in->type, in->W, rb, in->n, in->n_in, in->xq, o->y, in->Wr,
                                  in->n * sizeof(float), form == 2 ? in->Wrt : NULL, in->E,
                                  &ni, o->xa, o->xq, o->lg,
                                  in->part, in->part_floats, &t, st);
    int rc = cuda_mvq_xq_tail(in->type, in->W, rb, in->n, in->n_in, in->xq, o->y, NULL, st);
    return rc ? rc
              : cuda_matvec_tail_norm_in(QUANT_TYPE_F32, in->Wr, in->n * sizeof(float), in->E,
                                         in->n, &ni, o->xa, o->xq, o->lg, &t, st);
}

static void inputs_make(struct inputs *in, uint32_t type, uint32_t n, uint32_t n_in, uint32_t E,
                        uint32_t k, bool g, bool gate, unsigned int *ctr, struct rng *r)
{
    *in = (struct inputs){.type = type, .n = n, .n_in = n_in, .E = E, .k = k, .ctr = ctr};
    in->W = dev_quant_rows(type, n, n_in, r);
    float *hx = rand_floats(n_in, r), *hv = rand_floats(3 * (size_t)n, r);
    uint8_t *row = xmalloc(cuda_mvq_xq_bytes(n_in));
    xq_round(hx, row, n_in);
    in->xq = dev_bytes(row, cuda_mvq_xq_bytes(n_in));
    in->hWr = rand_floats((size_t)E * n, r);
    in->Wr = dev_floats(in->hWr, (size_t)E * n);
    float *ht = xmalloc((size_t)E * n * sizeof(float));
    for (uint32_t e = 0; e < E; e++)
        for (uint32_t j = 0; j < n; j++)
            ht[(size_t)j * E + e] = in->hWr[(size_t)e * n + j];
    in->Wrt = dev_floats(ht, (size_t)E * n);
    free(ht);
    in->h = dev_floats(hv, n);
    for (uint32_t j = 0; j < n; j++) /* norm weights around 1, as trained ones are */
        hv[n + j] = 1.0f + 0.25f * hv[n + j];
    in->g = g ? dev_floats(hv + n, n) : NULL;
    in->gate = gate ? dev_floats(hv + 2 * (size_t)n, n) : NULL;
    in->part_floats = cuda_mvq_router_part_floats(n, E);
    CU(cudaMalloc((void **)&in->part, in->part_floats * sizeof(float)));
    free(hx);
    free(hv);
    free(row);
}

static void inputs_free(struct inputs *in)
{
    cudaFree(in->W);
    cudaFree(in->xq);
    cudaFree(in->Wr);
    cudaFree(in->Wrt);
    cudaFree(in->h);
    cudaFree(in->g);
    cudaFree(in->gate);
    cudaFree(in->part);
    free(in->hWr);
}

static void test_case(uint32_t type, uint32_t n, uint32_t n_in, uint32_t E, uint32_t k, bool g,
                      bool gate, bool mark, unsigned int *ctr, struct rng *r)
{
    char what[160];
    snprintf(what, sizeof(what), "%s n %u n_in %u E %u k %u%s%s%s",
             type == QUANT_TYPE_Q4_0 ? "Q4_0" : "Q8_0", n, n_in, E, k, g ? " g" : "",
             gate ? " gate" : "", mark ? " marked" : "");
    struct inputs in;
    inputs_make(&in, type, n, n_in, E, k, g, gate, ctr, r);
    struct outs o[4];
    for (int i = 0; i < 4; i++)
        outs_alloc(&o[i], n, E, k);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int rc = 0;
    for (int i = 0; i < 4 && rc == 0; i++) {
        outs_poison(&o[i], n, E, k);
        rc = launch(&in, &o[i], i > 1 ? 2 : i, mark, st); /* two, fused, transposed twice */
        CU(cudaStreamSynchronize(st));
    }
    CU(cudaGetLastError());
    CHECK(rc == 0, "%s: rc %d", what, rc);
    CHECK(dev_counter(ctr) == 0, "%s: the counter is %u after the launches", what,
          dev_counter(ctr));
    char w2[200];
    bool ok = true;
    const size_t xb = cuda_mvq_xq_bytes(n);
    snprintf(w2, sizeof(w2), "%s: product rows", what);
    ok &= same(o[0].y, o[1].y, n * sizeof(float), w2);
    snprintf(w2, sizeof(w2), "%s: normalised row", what);
    ok &= same(o[0].xa, o[1].xa, n * sizeof(float), w2);
    snprintf(w2, sizeof(w2), "%s: rounded row", what);
    ok &= same(o[0].xq, o[1].xq, xb, w2);
    if (gate) {
        snprintf(w2, sizeof(w2), "%s: shared expert gate", what);
        ok &= same(o[0].gs, o[1].gs, sizeof(float), w2);
    }
    /* the fused launches among themselves (the columns from the router or its transposed
     * copy): every output byte for byte */
    for (int i = 2; i < 4; i++) {
        snprintf(w2, sizeof(w2), "%s: fused run %d logits", what, i);
        ok &= same(o[1].lg, o[i].lg, E * sizeof(float), w2);
        snprintf(w2, sizeof(w2), "%s: fused run %d ids", what, i);
        ok &= same(o[1].ids, o[i].ids, k * sizeof(int32_t), w2);
        snprintf(w2, sizeof(w2), "%s: fused run %d weights", what, i);
        ok &= same(o[1].w, o[i].w, k * sizeof(float), w2);
        snprintf(w2, sizeof(w2), "%s: fused run %d rows", what, i);
        ok &= same(o[1].y, o[i].y, n * sizeof(float), w2);
        snprintf(w2, sizeof(w2), "%s: fused run %d rounded row", what, i);
        ok &= same(o[1].xq, o[i].xq, xb, w2);
    }
    /* the logits: against the router's and the host's over the normalised row */
    float *l0 = host_copy(o[0].lg, E * sizeof(float)), *l1 = host_copy(o[1].lg, E * sizeof(float));
    float *xa = host_copy(o[0].xa, n * sizeof(float));
    double lmax = 0.0, d01 = 0.0, dh = 0.0;
    for (uint32_t e = 0; e < E; e++) {
        double want = 0.0;
        for (uint32_t j = 0; j < n; j++)
            want += (double)in.hWr[(size_t)e * n + j] * xa[j];
        lmax = fmax(lmax, fabs(want));
        d01 = fmax(d01, fabs((double)l1[e] - l0[e]));
        dh = fmax(dh, fmax(fabs(l1[e] - want), fabs(l0[e] - want)));
        CHECK(isfinite(l1[e]), "%s: logit %u is %g", what, e, l1[e]);
    }
    const double tol01 = 2e-5 * lmax, tolh = 1e-4 * lmax;
    CHECK(d01 <= tol01, "%s: logits differ by %.3g from the router's (tolerance %.3g)", what,
          d01, tol01);
    CHECK(dh <= tolh, "%s: logits differ by %.3g from the host's (tolerance %.3g)", what, dh,
          tolh);
    /* the picks: the router's, or logits within the tolerance of each other */
    int32_t *i0 = host_copy(o[0].ids, k * sizeof(int32_t)), *i1 = host_copy(o[1].ids, k * 4);
    float *w0 = host_copy(o[0].w, k * sizeof(float)), *w1 = host_copy(o[1].w, k * sizeof(float));
    int moved = 0;
    for (uint32_t j = 0; j < k; j++) {
        CHECK(i1[j] >= 0 && (uint32_t)i1[j] < E, "%s: pick %u is %d", what, j, i1[j]);
        if (i1[j] < 0 || (uint32_t)i1[j] >= E)
            continue;
        if (i0[j] != i1[j]) {
            moved++;
            CHECK(fabs((double)l0[i0[j]] - l0[i1[j]]) <= 2 * tol01,
                  "%s: pick %u is %d (logit %.7g), the router's %d (%.7g)", what, j, i1[j],
                  l0[i1[j]], i0[j], l0[i0[j]]);
        } else {
            CHECK(fabsf(w0[j] - w1[j]) <= 1e-5f, "%s: weight %u %.7g, the router's %.7g", what,
                  j, w1[j], w0[j]);
        }
    }
    printf("%s: rows, row, rounding%s %s; logits within %.2g of the router's, %.2g of the "
           "host's (max |logit| %.3g); picks %s\n",
           what, gate ? ", gate" : "", ok ? "identical" : "DIFFERENT", d01, dh, lmax,
           moved ? "reordered among near ties" : "the router's");
    free(l0);
    free(l1);
    free(xa);
    free(i0);
    free(i1);
    free(w0);
    free(w1);
    CU(cudaStreamDestroy(st));
    for (int i = 0; i < 4; i++)
        outs_free(&o[i]);
    inputs_free(&in);
}

/* What the launcher declines: -ENOTSUP where the kernels do not take the shape, -EINVAL
 * for bad arguments; nothing launched either way (the outputs keep their poison). */
static void test_refusals(unsigned int *ctr, struct rng *r)
{
    struct inputs in;
    inputs_make(&in, QUANT_TYPE_Q4_0, 2048, 4096, 512, 10, true, true, ctr, r);
    struct outs o;
    outs_alloc(&o, 2048, 512, 10);
    outs_poison(&o, 2048, 512, 10);
    const size_t rb = quant_row_size(QUANT_TYPE_Q4_0, 4096);
    const struct cuda_norm_in ni = {.h = in.h, .add = o.y, .w = in.g, .eps = 1e-6f,
                                    .gate = in.gate, .gs = o.gs};
    const struct cuda_tail t = {.kind = CUDA_TAIL_TOPK, .counter = ctr, .k = 10, .ids = o.ids,
                                .w = o.w};
    cudaStream_t st = 0;
    /* 500 experts: not whole eighths */
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), NULL, 500, &ni, o.xa, o.xq, o.lg, in.part,
                             in.part_floats, &t, st) == -ENOTSUP,
          "refusals: 500 experts taken");
    /* rows of 8192 (past the built forms); rows of 512 (8 lanes a row: 32-row tiles) with
     * 512 experts (their columns past the shared memory asked for) */
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, quant_row_size(QUANT_TYPE_Q4_0, 512), 2048,
                             512, in.xq, o.y, in.Wr, 2048 * sizeof(float), NULL, 512, &ni, o.xa, o.xq,
                             o.lg, in.part, in.part_floats, &t, st) == -ENOTSUP,
          "refusals: rows of 512 with 512 experts taken");
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, quant_row_size(QUANT_TYPE_Q4_0, 8192), 1024,
                             8192, in.xq, o.y, in.Wr, 2048 * sizeof(float), NULL, 512, &ni, o.xa,
                             o.xq, o.lg, in.part, in.part_floats, &t, st) == -ENOTSUP,
          "refusals: rows of 8192 taken");
    /* an F16 output product, an unaligned router */
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_F16, in.W, 8192, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), NULL, 512, &ni, o.xa, o.xq, o.lg, in.part,
                             in.part_floats, &t, st) == -ENOTSUP,
          "refusals: an F16 product taken");
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr + 1,
                             2048 * sizeof(float), NULL, 512, &ni, o.xa, o.xq, o.lg, in.part,
                             in.part_floats, &t, st) == -ENOTSUP,
          "refusals: an unaligned router taken");
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), in.Wrt + 1, 512, &ni, o.xa, o.xq, o.lg,
                             in.part, in.part_floats, &t, st) == -ENOTSUP,
          "refusals: an unaligned transposed router taken");
    /* the mixer's output not the product's, no tail, scratch too short, a gate without gs */
    const struct cuda_norm_in other = {.h = in.h, .add = o.xa, .w = in.g, .eps = 1e-6f};
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), NULL, 512, &other, o.xa, o.xq, o.lg, in.part,
                             in.part_floats, &t, st) == -EINVAL,
          "refusals: another added row taken");
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), NULL, 512, &ni, o.xa, o.xq, o.lg, in.part,
                             in.part_floats, NULL, st) == -EINVAL,
          "refusals: no tail taken");
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), NULL, 512, &ni, o.xa, o.xq, o.lg, in.part,
                             in.part_floats - 1, &t, st) == -EINVAL,
          "refusals: short scratch taken");
    const struct cuda_norm_in nogs = {.h = in.h, .add = o.y, .w = in.g, .eps = 1e-6f,
                                      .gate = in.gate};
    CHECK(cuda_mvq_xq_router(QUANT_TYPE_Q4_0, in.W, rb, 2048, 4096, in.xq, o.y, in.Wr,
                             2048 * sizeof(float), NULL, 512, &nogs, o.xa, o.xq, o.lg, in.part,
                             in.part_floats, &t, st) == -EINVAL,
          "refusals: a gate without gs taken");
    CU(cudaDeviceSynchronize());
    uint32_t *hy = host_copy(o.y, 2048 * sizeof(float));
    int touched = 0;
    for (int j = 0; j < 2048; j++)
        touched += hy[j] != 0xC3C3C3C3u;
    CHECK(touched == 0, "refusals: %d product rows written", touched);
    CHECK(dev_counter(ctr) == 0, "refusals: the counter moved");
    printf("refusals: declined, nothing written\n");
    free(hy);
    outs_free(&o);
    inputs_free(&in);
}

struct bench {
    const struct inputs *in; /* n_in sets, the launches taking them in turn */
    int n_in, next;
    const struct outs *o;
    int form; /* launch()'s */
};

static void bench_call(void *arg, cudaStream_t s)
{
    struct bench *b = arg;
    const struct inputs *in = &b->in[b->n_in > 1 ? b->next++ % b->n_in : 0];
    if (launch(in, b->o, b->form, true, s))
        failures++;
}

/* The same chains with the weights, routers and rows of kColdSets layers in turn (about 100
 * MB, twice the L2), so that each launch reads them from memory as the decode does: two
 * launches against one. */
enum { kColdSets = 8 };

static void bench_cold(unsigned int *ctr, const struct outs *o, struct rng *r)
{
    struct inputs in[kColdSets];
    for (int i = 0; i < kColdSets; i++)
        inputs_make(&in[i], QUANT_TYPE_Q4_0, 2048, 4096, 512, 10, true, true, ctr, r);
    struct bench two = {.in = in, .n_in = kColdSets, .o = o, .form = 0},
                 one = {.in = in, .n_in = kColdSets, .o = o, .form = 1},
                 one_t = {.in = in, .n_in = kColdSets, .o = o, .form = 2};
    const float t2 = graph_median_us(bench_call, &two, 48),
                t1 = graph_median_us(bench_call, &one, 48),
                tt = graph_median_us(bench_call, &one_t, 48);
    CHECK(dev_counter(ctr) == 0, "bench: the counter is %u after the cold graphs",
          dev_counter(ctr));
    printf("[measure] out product + router, 80b shape, graph of 48 over %d layers' weights "
           "(from memory): two launches %.2f us; one launch %.2f, the columns from the "
           "transposed router %.2f us a layer\n",
           kColdSets, t2, t1, tt);
    for (int i = 0; i < kColdSets; i++)
        inputs_free(&in[i]);
}

/* The 80b-a3b decode layer's DeltaNet output product (4096 -> 2048, Q4_0) and router
 * (512 x 2048 F32, top 10, the gate): two launches against one. */
static void bench(unsigned int *ctr, struct rng *r)
{
    struct inputs in;
    inputs_make(&in, QUANT_TYPE_Q4_0, 2048, 4096, 512, 10, true, true, ctr, r);
    struct outs o;
    outs_alloc(&o, 2048, 512, 10);
    struct bench two = {.in = &in, .n_in = 1, .o = &o, .form = 0},
                 one = {.in = &in, .n_in = 1, .o = &o, .form = 1},
                 one_t = {.in = &in, .n_in = 1, .o = &o, .form = 2};
    /* an eager fused launch's outputs, then the graphs': 48 launches in a PDL chain, each
     * reading h, the router and its columns before its wait while the one before runs,
     * must leave the same bytes */
    struct outs ref;
    outs_alloc(&ref, 2048, 512, 10);
    outs_poison(&ref, 2048, 512, 10);
    CHECK(launch(&in, &ref, 1, true, 0) == 0, "bench: the eager fused launch");
    CU(cudaDeviceSynchronize());
    const float t2 = graph_median_us(bench_call, &two, 48),
                t1 = graph_median_us(bench_call, &one, 48),
                t2b = graph_median_us(bench_call, &two, 48),
                t1b = graph_median_us(bench_call, &one, 48),
                tt = graph_median_us(bench_call, &one_t, 48);
    bool ok = same(ref.y, o.y, 2048 * sizeof(float), "bench: graph chain rows");
    ok &= same(ref.lg, o.lg, 512 * sizeof(float), "bench: graph chain logits");
    ok &= same(ref.ids, o.ids, 10 * sizeof(int32_t), "bench: graph chain ids");
    ok &= same(ref.w, o.w, 10 * sizeof(float), "bench: graph chain weights");
    ok &= same(ref.xq, o.xq, cuda_mvq_xq_bytes(2048), "bench: graph chain rounded row");
    ok &= same(ref.gs, o.gs, sizeof(float), "bench: graph chain gate");
    CHECK(dev_counter(ctr) == 0, "bench: the counter is %u after the graphs",
          dev_counter(ctr));
    printf("graph chains of 48 fused launches: outputs %s the eager launch's\n",
           ok ? "byte-identical to" : "DIFFERENT from");
    outs_free(&ref);
    /* where the one launch's time goes (LAMINA_CUDA_RT_SKIP: timing only, the outputs
     * wrong): without the columns' copies (1), the cluster's adds (2), the last block (4),
     * launched without clusters (8, with 2); of the last block's: the pick (16), the row,
     * its rounding and the gate (32), the partial sums' loads (64) */
    static const char *const skips[] = {"1", "2", "4", "6", "7", "16", "32", "48", "64", "112"};
    char line[768];
    int at = snprintf(line, sizeof(line),
                      "[measure] one launch with parts left out (us a layer; transposed columns "
                      "in brackets):");
    for (size_t i = 0; i < sizeof(skips) / sizeof(skips[0]); i++) {
        setenv("LAMINA_CUDA_RT_SKIP", skips[i], 1);
        const float ts = graph_median_us(bench_call, &one, 48),
                    tst = graph_median_us(bench_call, &one_t, 48);
        at += snprintf(line + at, sizeof(line) - (size_t)at, " skip %s %.2f (%.2f)", skips[i],
                       ts, tst);
    }
    unsetenv("LAMINA_CUDA_RT_SKIP");
    printf("%s\n", line);
    printf("[measure] out product + router, 80b shape, graph of 48: two launches %.2f, %.2f us; "
           "one launch %.2f, %.2f us a layer; one launch, the columns from the transposed "
           "router %.2f us\n",
           t2, t2b, t1, t1b, tt);
    bench_cold(ctr, &o, r);
    outs_free(&o);
    inputs_free(&in);
}

int main(void)
{
    CU(cudaSetDevice(0));
    struct rng r = {0x5eed0a7e2b17ull};
    unsigned int *ctr;
    CU(cudaMalloc((void **)&ctr, sizeof(*ctr)));
    CU(cudaMemset(ctr, 0, sizeof(*ctr)));
    if (cuda_caps_cc() < 90) { /* the card's, or LAMINA_CUDA_AS_SM's */
        /* no clusters: the launcher declines, nothing launched */
        const bool ok = !cuda_mvq_router_ok(QUANT_TYPE_Q4_0, 2048, 4096, 512, 2048 * 4);
        CHECK(ok, "compute capability below 9.0: the fused form is offered");
        printf("test_out_router_cuda: below compute capability 9.0 the form is declined: %s\n",
               ok ? "yes" : "NO");
        cudaFree(ctr);
        return failures ? 1 : 0;
    }
    /* the 80b shape (Q4_0 rows of 4096 in one pass a lane; Q8_0 in two), rows of 2048
     * (one pass of two blocks a lane), of 1024 and 3072, of 512 and 96 (16 and 8 lanes a
     * row: 16- and 32-row tiles), 128 and 16 experts (one a thread), no norm weights or
     * gate, tiles that leave the last cluster's blocks without rows (1056 rows: 66 tiles;
     * 96 rows: 3 tiles of 32 in a cluster of 8) */
    test_case(QUANT_TYPE_Q4_0, 2048, 4096, 512, 10, true, true, false, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 2048, 4096, 512, 10, true, true, true, ctr, &r);
    test_case(QUANT_TYPE_Q8_0, 2048, 4096, 512, 10, true, true, true, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 2048, 2048, 512, 8, true, false, false, ctr, &r);
    test_case(QUANT_TYPE_Q8_0, 1024, 2048, 128, 8, false, true, false, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 1056, 4096, 64, 4, true, true, true, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 512, 3072, 256, 16, true, false, true, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 2048, 1024, 512, 10, true, true, false, ctr, &r);
    test_case(QUANT_TYPE_Q8_0, 2048, 1024, 512, 10, true, true, true, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 1024, 512, 256, 8, true, true, true, ctr, &r);
    test_case(QUANT_TYPE_Q8_0, 96, 128, 16, 4, true, true, true, ctr, &r);
    test_case(QUANT_TYPE_Q4_0, 96, 64, 16, 4, false, false, false, ctr, &r);
    test_refusals(ctr, &r);
    bench(ctr, &r);
    cudaFree(ctr);
    if (failures) {
        fprintf(stderr, "test_out_router_cuda: %d failures\n", failures);
        return 1;
    }
    printf("test_out_router_cuda: all passed\n");
    return 0;
}
