/*
 * test_backend_cuda: the "cuda" worker backend against the "cpu" one on the
 * conformance fixtures (../shared/fixtures/conformance/{qwen3moe,qwen3next,
 * qwen35moe}/ARCH-f32.gguf). For each architecture the prompt of refs.json is
 * prefilled (max_batch TBC_BATCH, so several passes) and then TBC_DECODE
 * tokens of the reference greedy continuation are decoded one by one.
 * The cuda backend runs the DeltaNet recurrence token by token also in a
 * prefill, the cpu backend in its chunked form (and token by token with
 * max_batch 1); all are exact in maths but round differently, and these tiny
 * random models amplify rounding at some positions (near-ties in routing).
 * As in test_conformance, a position is ill-conditioned when the cpu's own
 * two forms differ there by more than TBC_COND; the bound is the tolerance
 * at the others, tolerance + TBC_COND_FACTOR x that spread there.
 *   - each layer alone, cuda vs token-by-token cpu on the same input: within
 *     TBC_TOL_LAYER of the output's magnitude (locates a wrong layer);
 *   - cuda, every expert resident (decode through the CUDA graph): logits
 *     within the bound of both cpu forms; arg-max equal to refs.json top1 at
 *     every prompt position and to the greedy continuation at every decode
 *     step; a second run after reset() byte-identical;
 *   - the same with graphs off (LAMINA_CUDA_GRAPHS=0): byte-identical;
 *   - the local expert rows counted (timing dumps' hits) equal the cpu
 *     backend's with decode through the graph;
 *   - the same without programmatic dependent launch (LAMINA_CUDA_PDL=0; on
 *     sm_90 and later the default chains the kernels with PDL, elsewhere
 *     both runs launch alike): byte-identical, the kernels' maths is the same;
 *   - the same with the decode fusions off (LAMINA_CUDA_FUSE=0: conv and
 *     DeltaNet heads as two launches, the lm head's norm a launch of its
 *     own): byte-identical;
 *   - the same with no product tails (LAMINA_CUDA_TAIL=0: the residual
 *     norms and top-k as launches of their own) and with every tail
 *     (LAMINA_CUDA_TAIL=1: the combine too): byte-identical;
 *   - the same with the combine split over the down product's columns and
 *     each layer's norm inside its input product (LAMINA_CUDA_TAIL=
 *     norm,topk,cols), and with the down product and the combine as one
 *     launch cut by rows (norm,topk,rows), and with the decode combine in
 *     one block instead of a cluster (LAMINA_CUDA_COMBINE_CLUSTER=0):
 *     byte-identical;
 *   - the same without the down experts' L2 prefetch in the decode gate/up
 *     product (LAMINA_CUDA_PF=0) or with it asked for before each block's
 *     own rows instead of after them (LAMINA_CUDA_PF=before), and with the
 *     down product reading the router's ids after its PDL wait
 *     (LAMINA_CUDA_EARLY=0): byte-identical;
 *   - the same without the router marking the ids it picks and the decode
 *     gate/up product polling them before its PDL wait
 *     (LAMINA_CUDA_IDS_POLL=0): byte-identical;
 *   - the same with the router's top-k tail picking by k rounds of a warp
 *     arg-max instead of by counted places (LAMINA_CUDA_TOPK_ROUNDS=1):
 *     byte-identical;
 *   - the same with each DeltaNet head's decode in one block instead of a
 *     cluster (LAMINA_CUDA_DN_SPLIT=0): byte-identical;
 *   - the same with the driver's L1 / shared memory split instead of 50 %
 *     (LAMINA_CUDA_CARVEOUT=-1) and with all shared memory (100):
 *     byte-identical;
 *   - the same with the diagnostic marks of LAMINA_CUDA_PROBE=1: byte-identical;
 *   - the same with the down product rounding its SiLU-gated input itself
 *     instead of the gate/up product's clusters (LAMINA_CUDA_GQ=0): byte-identical;
 *   - the same with the combine summing the shared expert's gate instead of the
 *     router's launch (LAMINA_CUDA_GS=0): byte-identical;
 *   - the same with LAMINA_CUDA_OUT_ROUTER=1 (the output product and router in
 *     one launch, which extends the int8 products and declines f32 weights):
 *     byte-identical;
 *   - half the experts resident, the rest computed by a remote implemented
 *     here with expert_exec on the CPU: within the bound, rows really sent;
 *   - the layers split over two cuda backends: within the bound;
 *   - f16 KV cache, cuda vs token-by-token cpu with f16 KV: within the bound
 *     of TBC_TOL_F16 (the attention on tensor cores, the default), also on
 *     CUDA cores (LAMINA_CUDA_ATTN_MMA=0), and with the attention decode in one launch
 *     below LAMINA_CUDA_ATTN_FUSED_BELOW (the default, =0, and a threshold
 *     inside the run: both decode graphs; tbc_fused_below);
 *   - tiny synthetic qwen3next models of Q4_1, Q5_0 and Q5_1 weights fed
 *     the cpu's tokens: near the cpu's logits (tbc_more_types);
 *   - a device budget too small is refused;
 *   - sequence snapshots through the DeltaNet state's host copy and its fresh / ahead flags
 *     (two slots; the prompt and half the decode steps in slot 0, through the graph): the
 *     snapshot (a pull) is within TBC_TOL_SNAP of the cpu backend's at that point and not
 *     all zeros; loaded into slot 1 and saved again with no step between, the same bytes;
 *     continued in slot 1 (the push before its first step), the rest of the decode logits
 *     byte-identical to the run through; the cpu backend's snapshot loaded into slot 1 (a
 *     host-side state, then GPU steps) continues within the bound of the cpu's logits;
 *   - on tiny synthetic qwen3next models of Q8_0 and Q4_0 weights (6 prompt
 *     positions, 10 greedy decode steps): the shared expert as pair k of the
 *     routed decode products against its own branch (LAMINA_CUDA_SHPAIR=0):
 *     byte-identical; the DeltaNet input product, conv and heads in one
 *     launch (LAMINA_CUDA_DN_IN=1: clusters; =tail: each head's step in an
 *     owner block or, LAMINA_CUDA_DN_TAIL=last, in the block completing its
 *     rows) against two: byte-identical, and on sm_90 a kernel fewer a
 *     DeltaNet layer (it ran in each) and leaving the fused launch out
 *     changes the decode steps; the
 *     down product and combine by rows (LAMINA_CUDA_TAIL=norm,topk,rows):
 *     byte-identical, and one kernel a layer fewer than when it declines
 *     (LAMINA_CUDA_EARLY=0: it ran in every layer); the gate/up product's
 *     activations rounded after its PDL wait (LAMINA_CUDA_X_EARLY=0) instead
 *     of before: byte-identical; the output product with the router in one
 *     launch asked for (LAMINA_CUDA_OUT_ROUTER=1) where it declines (output
 *     rows the int8 products do not take): byte-identical, the same kernels;
 *   - an 80b-a3b-shaped Q4_0 qwen3next of four layers: the decode input
 *     products reading the rows the combine rounded (xq) against rounding
 *     xa themselves (LAMINA_CUDA_XQ=0): byte-identical; the split conv +
 *     heads reading the DeltaNet states before its PDL wait against after it
 *     (LAMINA_CUDA_DN_EARLY=0): byte-identical; the residual add + norm
 *     formed by its consumers (tail.h's cuda_norm_in) against the output
 *     product's tail (LAMINA_CUDA_NORM_IN=0) and, with LAMINA_CUDA_TAIL=topk,
 *     against the add + norm launch: byte-identical, one kernel a layer
 *     fewer than the launch (it ran); the decode steps through
 *     backend_layers_head (the head on the device right after the layers)
 *     byte-identical to the layers then backend_logits, and both ways with
 *     the profile (LAMINA_CUDA_PROFILE=1); the decode graph's kernel
 *     nodes as many as the kernels a step launched one by one counts
 *     (LAMINA_CUDA_GRAPHS=0, logits byte-identical); the DeltaNet output
 *     product over the y that conv + heads rounded (int8 kernels) against
 *     the f32 kernels over y (LAMINA_CUDA_YQ=0): the prompt's logits the
 *     same, the decode steps' changed (it ran), and no further from the
 *     cpu backend's (max |diff| within twice that of the f32 kernels' +
 *     1e-3 of the largest logit, over the rows whose arg-max agree); the
 *     output product with the router in one launch (LAMINA_CUDA_OUT_ROUTER=1,
 *     sm_90; the cpu's tokens fed): within twice the default's distance to
 *     the cpu + 1e-3 of the largest logit, a kernel fewer in every layer;
 *     decode kernels left out (LAMINA_CUDA_SKIP=moe.down,
 *     moe.combine): the prompt's logits unchanged, the decode steps' changed;
 *   - 80b-a3b-shaped Q4_K, Q6_K and Q4_K_M qwen3next models of four layers, the cpu's
 *     tokens fed: the int8 decode products' K-type forms (LAMINA_CUDA_MVQ_K=1, the default)
 *     against the f32 products (LAMINA_CUDA_MVQ_K=0): the decode steps' changed and fewer
 *     kernels, within twice that run's distance to the cpu + 1e-3 of the largest logit, the
 *     cpu's arg-max in 14 of 16 rows at least, two runs byte-identical, and byte-identical
 *     with the plain products on one block's registers (LAMINA_CUDA_PLAIN_LEAN=0), every
 *     type's on the experts' (=all), Q6_K's down products without tma (LAMINA_CUDA_TMA=
 *     poll) and the second input product waiting first (LAMINA_CUDA_BESIDE=0) (tbc_kq;
 *     Q4_K_M: its third layer's qkv is Q6_K, its z|beta|alpha Q4_K, one launch after it,
 *     beside it);
 *   - foreign experts (--experts-home any): a cuda backend of the first half of the layers
 *     holding every expert of the second half serves grouped rows of those layers (decode
 *     sized and prefill sized groups) within TBC_TOL_SERVE of expert_exec on the CPU, counts
 *     them as foreign, and refuses an expert it does not hold.
 * Decode time of backend_layers per token with and without graphs is printed
 * (tiny models: it measures launch overhead, not bandwidth). Needs a CUDA
 * device: exits 1 with a message when there is none.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "kernels/cuda/caps.h"
#include "kernels/cuda/ops.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/fixture.h"
#include "worker/backend.h"
#include "worker/expert_exec.h"
#include "worker/forward.h"

#define TBC_TOL 2e-3     /* max |cuda - token-by-token cpu| logit, f32 models and KV */
#define TBC_COND 1e-4     /* cpu's own spread above which a position is ill-conditioned */
#define TBC_COND_FACTOR 10.0 /* bound there: tolerance + factor x that spread */
#define TBC_TOL_LAYER 1e-5 /* one layer alone: max |cuda - cpu| / max |h| */
#define TBC_TIMED 32     /* decode steps timed after the checked ones */
#define TBC_TOL_F16 5e-3 /* the same with an f16 KV cache on both */
#define TBC_BATCH 32     /* max_batch: the 93-token prompt takes 3 passes */
#define TBC_DECODE 6     /* decode steps after the prompt */
#define TBC_CTX 256
#define TBC_TOL_SERVE 1e-4 /* served rows: max |cuda - expert_exec| / max |y| */
#define TBC_TOL_SNAP 1e-2  /* a snapshot: max |cuda - cpu| / max |value| (f32 KV and state) */

/* The expert pool a coordinator would run: expert_exec on the CPU. */
struct tbc_remote {
    const struct arch_model *m;
    struct expert_exec *xx;
    uint32_t layer, n_groups, n_rows;
    uint32_t *experts, *counts; /* n_expert each */
    struct expert_ref *refs;    /* n_expert */
    float *X;                   /* max rows x n_embd */
    uint64_t rows_sent;
};

static int tbc_submit(void *ctx, uint32_t layer, const uint32_t *experts, const uint32_t *counts,
                      uint32_t n_groups, const float *X, uint32_t n_rows)
{
    struct tbc_remote *r = ctx;
    r->layer = layer;
    r->n_groups = n_groups;
    r->n_rows = n_rows;
    memcpy(r->experts, experts, n_groups * sizeof(uint32_t));
    memcpy(r->counts, counts, n_groups * sizeof(uint32_t));
    memcpy(r->X, X, (size_t)n_rows * r->m->hp.n_embd * sizeof(float));
    r->rows_sent += n_rows;
    return 0;
}

static int tbc_collect(void *ctx, uint32_t layer, float *Y, uint32_t n_rows)
{
    struct tbc_remote *r = ctx;
    if (layer != r->layer || n_rows != r->n_rows)
        return -EPROTO;
    const struct arch_layer *ly = &r->m->layers[layer];
    for (uint32_t g = 0; g < r->n_groups; g++)
        r->refs[g] = expert_exec_model_ref(ly, r->experts[g]);
    return expert_exec_run(r->xx, ly, r->refs, r->counts, r->n_groups, r->X, Y);
}

/* One architecture's fixture and references. */
struct tbc_arch {
    const char *name;
    struct gguf *g;
    struct arch_model *m;
    int32_t ids[512], top1[512], greedy[64];
    int n, n_greedy;
    uint32_t V, n_embd;
    size_t rows; /* logit rows of a run: n + TBC_DECODE */
    double spread[512 + TBC_DECODE]; /* per row: |cpu chunked - cpu token by token| */
};

static int tbc_argmax(const float *x, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return (int)best;
}

static double tbc_maxdiff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        d = isnan(e) ? INFINITY : fmax(d, e);
    }
    return d;
}

static int tbc_embed(const struct tbc_arch *a, const int32_t *ids, int n, float *h)
{
    const struct arch_matrix *te = &a->m->tok_embd;
    for (int s = 0; s < n; s++)
        if (quant_dequantize_row(te->type, te->data + (size_t)ids[s] * te->row_bytes,
                                 h + (size_t)s * a->n_embd, a->n_embd))
            return -1;
    return 0;
}

/* Rows checked by backend_argmax against the first maximum of their logits. */
static int argmax_rows, argmax_bad;

/* Where the backend offers backend_argmax: the greedy ids of the n rows of h
 * must be the first maximum of their logits (out, n rows of V). */
static int tbc_check_argmax_rows(const struct tbc_arch *a, struct backend *b, const float *h,
                                 uint32_t n, const float *out)
{
    int32_t ids[512];
    if (n > 512)
        n = 512;
    const int rc = backend_argmax(b, h, n, ids);
    if (rc == -ENOTSUP)
        return 0;
    if (rc)
        return -1;
    for (uint32_t r = 0; r < n; r++) {
        const float *l = out + (size_t)r * a->V;
        int32_t best = 0;
        for (uint32_t i = 1; i < a->V; i++)
            best = l[i] > l[best] ? (int32_t)i : best;
        argmax_rows++;
        if (ids[r] != best) {
            argmax_bad++;
            CHECK(0, "%s: device arg-max of row %u is %d, the logits' first maximum %d",
                  a->name, r, ids[r], best);
        }
    }
    return 0;
}

/* Prefill then TBC_DECODE greedy tokens through a chain of backends (the
 * last one makes the logits); logits of every position into out. Returns 0
 * or -1. */
static int tbc_sequence(const struct tbc_arch *a, struct backend *const *bs, int nb, float *out)
{
    float *h = malloc((size_t)a->n * a->n_embd * sizeof(float));
    int rc = !h || tbc_embed(a, a->ids, a->n, h);
    for (int i = 0; i < nb && !rc; i++)
        rc = backend_layers(bs[i], h, (uint32_t)a->n);
    rc = rc || backend_logits(bs[nb - 1], h, (uint32_t)a->n, out);
    rc = rc || tbc_check_argmax_rows(a, bs[nb - 1], h, (uint32_t)a->n, out);
    for (int d = 0; d < TBC_DECODE && !rc; d++) {
        rc = tbc_embed(a, &a->greedy[d], 1, h);
        for (int i = 0; i < nb && !rc; i++)
            rc = backend_layers(bs[i], h, 1);
        float *o = out + (size_t)(a->n + d) * a->V;
        rc = rc || backend_logits(bs[nb - 1], h, 1, o);
        rc = rc || tbc_check_argmax_rows(a, bs[nb - 1], h, 1, o);
    }
    free(h);
    return rc ? -1 : 0;
}

/* Mean ms of backend_layers over TBC_TIMED more decode steps (after one untimed). */
static double tbc_decode_ms(const struct tbc_arch *a, struct backend *b)
{
    float *h = malloc(a->n_embd * sizeof(float));
    int rc = !h || tbc_embed(a, &a->greedy[0], 1, h) || backend_layers(b, h, 1);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int d = 0; d < TBC_TIMED && !rc; d++)
        rc = backend_layers(b, h, 1);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(h);
    if (rc)
        return -1;
    return ((t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6) / TBC_TIMED;
}

static struct backend_config tbc_config(const struct tbc_arch *a, uint32_t l0, uint32_t l1,
                                        uint32_t batch)
{
    return (struct backend_config){.model = a->m, .layer_begin = l0, .layer_end = l1,
                                   .n_threads = 2, .n_ctx = TBC_CTX, .max_batch = batch};
}

/* (token, expert) pairs the last tbc_run's first sequence computed locally,
 * and the kernels of its last decode step. */
static uint64_t tbc_last_rows, tbc_last_kernels;

/* One backend over all layers: a run, optionally a second after reset;
 * returns the decode ms per token (tbc_decode_ms) or -1. */
static double tbc_run(const struct tbc_arch *a, const char *kind, struct backend_config cfg,
                      float *out, float *again)
{
    struct backend *b = backend_create(kind, &cfg);
    CHECK(b != NULL, "%s: backend %s created", a->name, kind);
    if (!b)
        return -1;
    int rc = tbc_sequence(a, &b, 1, out);
    CHECK(rc == 0, "%s: %s sequence ran", a->name, kind);
    tbc_last_rows = backend_stats(b)->expert_rows;
    tbc_last_kernels = backend_stats(b)->step_kernels;
    if (again && !rc) {
        backend_reset(b);
        rc = tbc_sequence(a, &b, 1, again);
        CHECK(rc == 0, "%s: %s sequence after reset", a->name, kind);
    }
    double ms = rc ? -1 : tbc_decode_ms(a, b);
    backend_destroy(b);
    return ms;
}

/* Arg-max of the prompt positions equals top1, of decode step d the greedy token d + 1. */
static void tbc_check_argmax(const struct tbc_arch *a, const float *lg, const char *what)
{
    int agree = 0, dec = 0;
    for (int s = 0; s < a->n; s++)
        agree += tbc_argmax(lg + (size_t)s * a->V, a->V) == a->top1[s];
    for (int d = 0; d + 1 < TBC_DECODE && d + 1 < a->n_greedy; d++)
        dec += tbc_argmax(lg + (size_t)(a->n + d) * a->V, a->V) == a->greedy[d + 1];
    const int want_dec = TBC_DECODE - 1 < a->n_greedy - 1 ? TBC_DECODE - 1 : a->n_greedy - 1;
    CHECK(agree == a->n, "%s %s: argmax = top1 at %d of %d prompt positions", a->name, what, agree,
          a->n);
    CHECK(dec == want_dec, "%s %s: decode argmax = greedy at %d of %d steps", a->name, what, dec,
          want_dec);
}

/* Max |lg - ref| at well-conditioned positions (the cpu's own chunked vs
 * token-by-token spread <= TBC_COND) must be <= tol; at the others <= tol +
 * TBC_COND_FACTOR x that spread (the bound of test_conformance). */
static void tbc_compare(const struct tbc_arch *a, const float *ref, const float *lg,
                        const char *what, double tol)
{
    double good = 0, ill = 0;
    int bad = -1, n_ill = 0;
    for (size_t s = 0; s < a->rows; s++) {
        const double d = tbc_maxdiff(ref + s * a->V, lg + s * a->V, a->V);
        const bool cond = a->spread[s] <= TBC_COND;
        if (cond)
            good = fmax(good, d);
        else
            ill = fmax(ill, d), n_ill++;
        if (bad < 0 && d > tol + (cond ? 0.0 : TBC_COND_FACTOR * a->spread[s]))
            bad = (int)s;
    }
    MEASURE("%s %s: max |logit diff| %.3g at %zu well-conditioned positions (tolerance %.0e), "
            "%.3g at %d ill-conditioned ones", a->name, what, good, a->rows - n_ill, tol, ill,
            n_ill);
    CHECK(bad < 0, "%s %s: logit diff beyond the bound at position %d", a->name, what, bad);
}

/* Decode steps d0 .. d1-1 (tokens greedy[d]) through b, logits into rows n + d of out. */
static int tbc_steps(const struct tbc_arch *a, struct backend *b, int d0, int d1, float *out)
{
    float *h = malloc(a->n_embd * sizeof(float));
    int rc = h ? 0 : -1;
    for (int d = d0; d < d1 && !rc; d++) {
        rc = tbc_embed(a, &a->greedy[d], 1, h) || backend_layers(b, h, 1);
        rc = rc || backend_logits(b, h, 1, out + (size_t)(a->n + d) * a->V);
    }
    free(h);
    return rc ? -1 : 0;
}

/* The prompt and the first `half` decode steps through b (prompt logits into out). */
static int tbc_prefix(const struct tbc_arch *a, struct backend *b, int half, float *out)
{
    float *h = malloc((size_t)a->n * a->n_embd * sizeof(float));
    int rc = !h || tbc_embed(a, a->ids, a->n, h) || backend_layers(b, h, (uint32_t)a->n);
    rc = rc || backend_logits(b, h, (uint32_t)a->n, out);
    free(h);
    return rc || tbc_steps(a, b, 0, half, out) ? -1 : 0;
}

/* Sequence snapshots of the cuda backend (see the top of the file). gpu: the cuda run
 * through; tok: the token-by-token cpu's logits. */
static void tbc_snapshot(const struct tbc_arch *a, const float *gpu, const float *tok)
{
    const int half = TBC_DECODE / 2;
    const uint32_t pos = (uint32_t)a->n + half;
    const size_t sz = a->rows * a->V * sizeof(float);
    struct backend_config cfg = tbc_config(a, 0, a->m->hp.n_layer, TBC_BATCH);
    struct backend *c = backend_create("cpu", &cfg);
    cfg.n_seq = 2;
    struct backend *g = backend_create("cuda", &cfg);
    float *lg = malloc(sz), *lc = malloc(sz);
    const size_t sb = forward_state_bytes(a->m, 0, a->m->hp.n_layer, pos, false);
    float *sg = malloc(sb + 4), *sc = malloc(sb + 4), *again = malloc(sb + 4);
    int rc = g && c && lg && lc && sg && sc && again ? 0 : -1;
    rc = rc || tbc_prefix(a, g, half, lg) || tbc_prefix(a, c, half, lc);
    CHECK(rc || (backend_pos(g) == pos && backend_state_bytes(g) == sb), "%s: cuda snapshot at "
          "%u tokens of %zu bytes", a->name, pos, sb);
    rc = rc || backend_state_save(g, sg) || backend_state_save(c, sc);
    CHECK(rc == 0, "%s: snapshots of the cuda and cpu backends", a->name);
    if (!rc) {
        double d = 0, mag = 0;
        size_t nz = 0;
        for (size_t i = 0; i < sb / 4; i++) {
            d = fmax(d, fabs((double)sg[i] - sc[i]));
            mag = fmax(mag, fabs((double)sc[i]));
            nz += sg[i] != 0;
        }
        MEASURE("%s snapshot at %u tokens (%zu bytes): cuda vs cpu max |diff| %.3g of max "
                "|value| %.3g", a->name, pos, sb, d, mag);
        CHECK(nz > 0 && d <= TBC_TOL_SNAP * mag, "%s: the cuda snapshot is not the cpu's "
              "(%zu non-zero floats, max diff %.3g, max value %.3g)", a->name, nz, d, mag);
    }
    /* into slot 1; saved again at once: the host copy is current, nothing is pulled */
    rc = rc || backend_use_seq(g, 1) || backend_state_load(g, sg, sb, pos);
    rc = rc || backend_state_save(g, again);
    CHECK(rc == 0 && !memcmp(sg, again, sb), "%s: a snapshot loaded and saved again differs",
          a->name);
    /* continued in slot 1: the push, then the same bits as the run through */
    rc = rc || tbc_steps(a, g, half, TBC_DECODE, lg);
    CHECK(rc == 0 && !memcmp(lg, gpu, sz), "%s: cuda continued from its snapshot in another "
          "slot differs from the run through (max %.3g)", a->name,
          rc ? 0.0 : tbc_maxdiff(lg, gpu, a->rows * a->V));
    /* the cpu's snapshot (a state made on the host), then GPU steps */
    rc = rc || backend_reset_seq(g, 1) || backend_state_load(g, sc, sb, pos);
    rc = rc || tbc_steps(a, g, half, TBC_DECODE, lg);
    CHECK(rc == 0, "%s: cuda continued from the cpu's snapshot", a->name);
    if (!rc)
        tbc_compare(a, tok, lg, "cuda continuing from the cpu backend's snapshot vs "
                    "token-by-token cpu", TBC_TOL);
    backend_destroy(g);
    backend_destroy(c);
    free(lg), free(lc), free(sg), free(sc), free(again);
}

/* Half residency: even experts on the device, odd ones through the remote. */
static void tbc_half(const struct tbc_arch *a, const float *ref, float *lg)
{
    const uint32_t E = a->m->hp.n_expert, L = a->m->hp.n_layer;
    uint8_t *bits = calloc((E + 7) / 8, 1);
    const uint8_t **res = calloc(L, sizeof(*res));
    struct threadpool_config pc = {.n_threads = 2, .pin = false};
    struct threadpool *pool = threadpool_create(&pc);
    struct expert_exec_config xc = {.pool = pool, .n_embd = a->n_embd,
                                    .n_ff = a->m->hp.n_ff_exp,
                                    .max_rows = TBC_BATCH * a->m->hp.n_expert_used};
    struct tbc_remote r = {.m = a->m, .xx = pool ? expert_exec_create(&xc) : NULL};
    r.experts = calloc(E, sizeof(uint32_t));
    r.counts = calloc(E, sizeof(uint32_t));
    r.refs = calloc(E, sizeof(struct expert_ref));
    r.X = calloc(xc.max_rows * (size_t)a->n_embd, sizeof(float));
    if (!bits || !res || !r.xx || !r.experts || !r.counts || !r.refs || !r.X) {
        CHECK(false, "%s: half-residency setup", a->name);
        goto out;
    }
    for (uint32_t e = 0; e < E; e += 2)
        bits[e / 8] |= (uint8_t)(1u << (e % 8));
    for (uint32_t l = 0; l < L; l++)
        res[l] = bits;
    struct backend_config cfg = tbc_config(a, 0, L, TBC_BATCH);
    cfg.resident = res;
    cfg.remote = (struct forward_remote){.ctx = &r, .submit = tbc_submit, .collect = tbc_collect};
    struct backend *b = backend_create("cuda", &cfg);
    CHECK(b && b->resident_experts == L * ((E + 1) / 2), "%s: half-resident cuda backend", a->name);
    if (b) {
        CHECK(tbc_sequence(a, &b, 1, lg) == 0, "%s: half-resident sequence", a->name);
        const struct forward_stats *st = backend_stats(b);
        MEASURE("%s cuda half residency: %llu rows to the remote, %llu on the GPU", a->name,
                (unsigned long long)st->remote_rows, (unsigned long long)st->expert_rows);
        CHECK(st->remote_rows == r.rows_sent && r.rows_sent > 0, "%s: remote rows %llu sent %llu",
              a->name, (unsigned long long)st->remote_rows, (unsigned long long)r.rows_sent);
        tbc_compare(a, ref, lg, "cuda half residency + cpu remote", TBC_TOL);
        tbc_check_argmax(a, lg, "cuda half residency");
        backend_destroy(b);
    }
out:
    expert_exec_destroy(r.xx);
    threadpool_destroy(pool);
    free(r.experts), free(r.counts), free(r.refs), free(r.X), free(bits), free(res);
}

/* The layers split over two cuda backends, as two workers would run them. */
static void tbc_split(const struct tbc_arch *a, const float *ref, const float *full, float *lg)
{
    const uint32_t L = a->m->hp.n_layer;
    struct backend_config c0 = tbc_config(a, 0, L / 2, TBC_BATCH);
    struct backend_config c1 = tbc_config(a, L / 2, L, TBC_BATCH);
    struct backend *bs[2] = {backend_create("cuda", &c0), backend_create("cuda", &c1)};
    CHECK(bs[0] && bs[1], "%s: split cuda backends", a->name);
    if (bs[0] && bs[1]) {
        CHECK(tbc_sequence(a, bs, 2, lg) == 0, "%s: split sequence", a->name);
        tbc_compare(a, ref, lg, "cuda split over two backends", TBC_TOL);
        MEASURE("%s cuda split: %s the single backend's logits", a->name,
                memcmp(lg, full, a->rows * a->V * sizeof(float)) ? "differs from" : "equals");
    }
    backend_destroy(bs[0]);
    backend_destroy(bs[1]);
}

/* Layer by layer: each layer alone on cuda and on the token-by-token cpu,
 * fed the cpu's output of the layer before; relative max difference. */
static void tbc_layers(const struct tbc_arch *a)
{
    const size_t hn = (size_t)a->n * a->n_embd;
    float *h = malloc(hn * sizeof(float)), *hc = malloc(hn * sizeof(float));
    float *hg = malloc(hn * sizeof(float));
    if (!h || !hc || !hg || tbc_embed(a, a->ids, a->n, h))
        goto out;
    double worst = 0;
    for (uint32_t l = 0; l < a->m->hp.n_layer; l++) {
        struct backend_config cc = tbc_config(a, l, l + 1, 1);
        struct backend_config cg = tbc_config(a, l, l + 1, TBC_BATCH);
        struct backend *bc = backend_create("cpu", &cc), *bg = backend_create("cuda", &cg);
        memcpy(hc, h, hn * sizeof(float));
        memcpy(hg, h, hn * sizeof(float));
        int rc = !bc || !bg || backend_layers(bc, hc, (uint32_t)a->n) ||
                 backend_layers(bg, hg, (uint32_t)a->n);
        CHECK(rc == 0, "%s layer %u ran", a->name, l);
        double d = 0, mag = 0;
        for (size_t i = 0; i < hn && !rc; i++) {
            d = fmax(d, fabs((double)hc[i] - hg[i]));
            mag = fmax(mag, fabs((double)hc[i]));
        }
        worst = fmax(worst, d / mag);
        MEASURE("%s layer %u (%s): max |cuda - cpu| %.3g, relative to max |h| %.3g", a->name, l,
                a->m->layers[l].recurrent ? "deltanet" : "attention", d, d / mag);
        backend_destroy(bc);
        backend_destroy(bg);
        memcpy(h, hc, hn * sizeof(float));
    }
    CHECK(worst <= TBC_TOL_LAYER, "%s: a layer's output differs by %.3g of its magnitude", a->name,
          worst);
out:
    free(h), free(hc), free(hg);
}

static void tbc_budget(const struct tbc_arch *a)
{
    struct backend_config cfg = tbc_config(a, 0, a->m->hp.n_layer, TBC_BATCH);
    cfg.device_mem = 4096;
    log_set_level(LOG_LEVEL_ERROR);
    struct backend *b = backend_create("cuda", &cfg);
    CHECK(b == NULL, "%s: a 4 KiB device budget is refused", a->name);
    CHECK(strstr(log_last_error(), "too small") != NULL, "%s: refusal says why: %s", a->name,
          log_last_error());
    backend_destroy(b);
    log_set_level(LOG_LEVEL_INFO);
}

/* Foreign experts: the second half's experts on a backend of the first half. */
static void tbc_serve(const struct tbc_arch *a)
{
    const uint32_t E = a->m->hp.n_expert, L = a->m->hp.n_layer, n = a->n_embd;
    if (L < 2)
        return;
    const uint32_t P = TBC_BATCH * a->m->hp.n_expert_used; /* the most rows of one call */
    uint8_t *all = malloc((E + 7) / 8);
    const uint8_t **fg = calloc(L, sizeof(*fg));
    uint32_t *ex = calloc(E, sizeof(uint32_t)), *cn = calloc(E, sizeof(uint32_t));
    struct expert_ref *refs = calloc(E, sizeof(*refs));
    float *X = malloc((size_t)P * n * sizeof(float)), *Yg = malloc((size_t)P * n * sizeof(float));
    float *Yc = malloc((size_t)P * n * sizeof(float));
    struct threadpool_config pc = {.n_threads = 2, .pin = false};
    struct threadpool *pool = threadpool_create(&pc);
    struct expert_exec_config xc = {.pool = pool, .n_embd = n, .n_ff = a->m->hp.n_ff_exp,
                                    .max_rows = P};
    struct expert_exec *xx = pool ? expert_exec_create(&xc) : NULL;
    struct backend *b = NULL;
    if (!all || !fg || !ex || !cn || !refs || !X || !Yg || !Yc || !xx) {
        CHECK(false, "%s: serve setup", a->name);
        goto out;
    }
    memset(all, 0xff, (E + 7) / 8);
    if (E % 8)
        all[E / 8] = (uint8_t)((1u << (E % 8)) - 1);
    for (uint32_t l = L / 2; l < L; l++)
        fg[l] = all;
    struct backend_config cfg = tbc_config(a, 0, L / 2, TBC_BATCH);
    cfg.foreign = fg;
    b = backend_create("cuda", &cfg);
    CHECK(b && b->foreign_experts == (L - L / 2) * E && b->serve_max_rows == P,
          "%s: cuda backend with %u foreign experts (has %u, %u rows)", a->name,
          (L - L / 2) * E, b ? b->foreign_experts : 0, b ? b->serve_max_rows : 0);
    if (!b)
        goto out;
    uint64_t seed = 12345;
    for (size_t i = 0; i < (size_t)P * n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        X[i] = (float)((double)(seed >> 11) / 9007199254740992.0 - 0.5);
    }
    double worst = 0;
    for (uint32_t l = L / 2; l < L; l++) {
        for (int shape = 0; shape < 2; shape++) {
            /* decode sized: one row per expert of a few; prefill sized: every row, experts
             * descending with uneven counts */
            uint32_t g = 0, rows = 0;
            for (uint32_t e = 0; e < E && rows < P; e++) {
                const uint32_t want = shape ? 1 + (e * 7) % 13 : 1;
                ex[g] = shape ? E - 1 - e : (e * 3) % E;
                cn[g] = want < P - rows ? want : P - rows;
                rows += cn[g++];
                if (!shape && g == a->m->hp.n_expert_used)
                    break;
            }
            for (uint32_t k = 0; k < g; k++)
                refs[k] = expert_exec_model_ref(&a->m->layers[l], ex[k]);
            memset(Yg, 0xff, (size_t)rows * n * sizeof(float));
            int rc = backend_serve(b, l, ex, cn, g, X, Yg);
            rc = rc ? rc : expert_exec_run(xx, &a->m->layers[l], refs, cn, g, X, Yc);
            CHECK(rc == 0, "%s: serve layer %u shape %d: %d", a->name, l, shape, rc);
            double d = 0, mag = 0;
            for (size_t i = 0; i < (size_t)rows * n && !rc; i++) {
                d = fmax(d, fabs((double)Yg[i] - Yc[i]));
                mag = fmax(mag, fabs((double)Yc[i]));
            }
            worst = fmax(worst, mag > 0 ? d / mag : (isnan(d) ? 1 : d));
        }
    }
    MEASURE("%s cuda serve of foreign experts: max |cuda - expert_exec| / max |y| %.3g", a->name,
            worst);
    CHECK(worst <= TBC_TOL_SERVE, "%s: served rows differ by %.3g of their magnitude", a->name,
          worst);
    log_set_level(LOG_LEVEL_ERROR);
    ex[0] = 0;
    cn[0] = 1;
    CHECK(backend_serve(b, 0, ex, cn, 1, X, Yg) == -EINVAL, "%s: an expert of its own range "
          "(not foreign) is refused", a->name);
    log_set_level(LOG_LEVEL_INFO);
out:
    backend_destroy(b);
    expert_exec_destroy(xx);
    threadpool_destroy(pool);
    free(all), free(fg), free(ex), free(cn), free(refs), free(X), free(Yg), free(Yc);
}

/* The attention decode in one launch (cuda_attention_decode_fused) at positions below
 * LAMINA_CUDA_ATTN_FUSED_BELOW, as three launches at and past it, each decode form a graph
 * of its own, with an f16 cache (cfg): below 512 by default (every decode step here),
 * from the first position (=0), and from a decode step in the middle of the run (both
 * graphs captured in one run), each within the bound of the token-by-token cpu with f16
 * KV (ref). Where the fused launch ran (the default's last step has two kernels fewer an
 * attention layer than =0's: prep and merge), the rows before the middle step equal the
 * default's byte for byte and its last step counts =0's kernels; where it did not, all
 * three runs are the same bytes and the same kernels. buf, tmp: two rows x V buffers. */
static void tbc_fused_below(const struct tbc_arch *a, struct backend_config cfg,
                            const float *ref, float *buf, float *tmp)
{
    const size_t sz = a->rows * a->V * sizeof(float);
    const struct arch_hparams *hp = &a->m->hp;
    uint32_t n_attn = 0, n_stacked = 0;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct arch_layer *ly = &a->m->layers[l];
        n_attn += !ly->recurrent;
        n_stacked += !ly->recurrent && ly->wq.type == ly->wk.type &&
                     ly->wk.type == ly->wv.type && ly->wq.row_bytes == ly->wk.row_bytes &&
                     ly->wk.row_bytes == ly->wv.row_bytes;
    }
    /* where the fused kernel must run (cuda_attention_decode_fused's shapes, the
     * backend's q|k|v in one product): an f16 cache, hd 32 to 256, compute 8.0 on */
    int cc = 0, optin = 0;
    const uint32_t hd = hp->head_dim;
    const bool must = cfg.kv_f16 && (hd == 32 || hd == 64 || hd == 128 || hd == 256) &&
                      hp->n_head % hp->n_head_kv == 0 && hp->n_head / hp->n_head_kv <= 16 &&
                      !cuda_caps_get(&cc, &optin) && cc >= 80 && n_stacked > 0;
    unsetenv("LAMINA_CUDA_ATTN_FUSED"); /* it would override the threshold */
    unsetenv("LAMINA_CUDA_ATTN_FUSED_BELOW");
    tbc_run(a, "cuda", cfg, buf, NULL);
    const uint64_t k_fused = tbc_last_kernels;
    tbc_compare(a, ref, buf, "cuda f16 KV, attention in one launch (the default below 512), "
                "vs token-by-token cpu f16 KV", TBC_TOL_F16);
    setenv("LAMINA_CUDA_ATTN_FUSED_BELOW", "0", 1);
    tbc_run(a, "cuda", cfg, tmp, NULL);
    const uint64_t k_split = tbc_last_kernels;
    tbc_compare(a, ref, tmp, "cuda f16 KV, attention as three launches "
                "(LAMINA_CUDA_ATTN_FUSED_BELOW=0), vs token-by-token cpu f16 KV", TBC_TOL_F16);
    const bool ran = k_split != k_fused;
    CHECK(ran || !must, "%s: the attention decode in one launch did not run (hd %u, compute "
          "%d, %u of %u attention layers with q, k, v of one type)", a->name, hd, cc, n_stacked,
          n_attn);
    CHECK(!ran ? !memcmp(buf, tmp, sz) : k_split == k_fused + 2 * n_stacked,
          "%s: %llu kernels a decode step with the attention in one launch, %llu in three "
          "(%u attention layers)%s", a->name, (unsigned long long)k_fused,
          (unsigned long long)k_split, n_stacked, ran ? "" : ", and the logits differ");
    const uint32_t mid = (uint32_t)a->n + TBC_DECODE / 2;
    char at[16];
    snprintf(at, sizeof at, "%u", mid);
    setenv("LAMINA_CUDA_ATTN_FUSED_BELOW", at, 1);
    float *both = malloc(sz), *again = malloc(sz);
    CHECK(both != NULL && again != NULL, "%s: buffers", a->name);
    if (both && again) {
        /* again: after a reset, each form's graph replayed in turn (the fused one after
         * the split one) */
        tbc_run(a, "cuda", cfg, both, again);
        CHECK(!memcmp(both, again, sz), "%s: LAMINA_CUDA_ATTN_FUSED_BELOW=%u: the run after "
              "a reset (both graphs replayed) differs (max %.3g)", a->name, mid,
              tbc_maxdiff(both, again, a->rows * a->V));
        tbc_compare(a, ref, both, "cuda f16 KV, attention in one launch below a middle decode "
                    "step (two graphs in one run), vs token-by-token cpu f16 KV", TBC_TOL_F16);
        const size_t before = (size_t)mid * a->V * sizeof(float);
        CHECK(!memcmp(both, buf, before) && tbc_last_kernels == k_split &&
                  (ran || !memcmp(both, tmp, sz)),
              "%s: LAMINA_CUDA_ATTN_FUSED_BELOW=%u: rows before it %s the default's, %llu kernels "
              "in the last step (%llu expected)", a->name, mid,
              memcmp(both, buf, before) ? "differ from" : "equal",
              (unsigned long long)tbc_last_kernels, (unsigned long long)k_split);
        MEASURE("%s attention decode in one launch below a position: %s (%llu kernels a decode "
                "step, %llu as three launches); max |fused - three launches| %.3g", a->name,
                ran ? "ran" : "not taken", (unsigned long long)k_fused,
                (unsigned long long)k_split, tbc_maxdiff(buf, tmp, a->rows * a->V));
    }
    free(both), free(again);
    unsetenv("LAMINA_CUDA_ATTN_FUSED_BELOW");
}

static void tbc_arch_run(struct tbc_arch *a)
{
    const uint32_t L = a->m->hp.n_layer;
    a->V = a->m->hp.n_vocab;
    a->n_embd = a->m->hp.n_embd;
    a->rows = (size_t)a->n + TBC_DECODE;
    const size_t sz = a->rows * a->V * sizeof(float);
    float *chunk = malloc(sz), *tok = malloc(sz), *gpu = malloc(sz), *gpu2 = malloc(sz);
    float *tmp = malloc(sz);
    if (!chunk || !tok || !gpu || !gpu2 || !tmp)
        goto out;
    double ms_cpu = tbc_run(a, "cpu", tbc_config(a, 0, L, TBC_BATCH), chunk, NULL);
    const uint64_t rows_cpu = tbc_last_rows;
    tbc_run(a, "cpu", tbc_config(a, 0, L, 1), tok, NULL);
    tbc_check_argmax(a, chunk, "cpu");
    double ms_graph = tbc_run(a, "cuda", tbc_config(a, 0, L, TBC_BATCH), gpu, gpu2);
    /* graph replays count their expert rows as the captured step did */
    CHECK(tbc_last_rows == rows_cpu, "%s: cuda counted %llu local expert rows, cpu %llu",
          a->name, (unsigned long long)tbc_last_rows, (unsigned long long)rows_cpu);
    for (size_t s = 0; s < a->rows; s++)
        a->spread[s] = tbc_maxdiff(chunk + s * a->V, tok + s * a->V, a->V);
    tbc_compare(a, tok, gpu, "cuda full residency vs token-by-token cpu", TBC_TOL);
    tbc_compare(a, chunk, gpu, "cuda full residency vs chunked cpu prefill", TBC_TOL);
    tbc_check_argmax(a, gpu, "cuda");
    CHECK(!memcmp(gpu, gpu2, sz), "%s: second cuda run after reset differs (max %.3g)", a->name,
          tbc_maxdiff(gpu, gpu2, a->rows * a->V));
    /* each switch off alone: the same bits */
    static const struct {
        const char *env, *value, *what;
    } offs[] = {{"LAMINA_CUDA_GRAPHS", "0", "without graphs"},
                {"LAMINA_CUDA_PDL", "0", "without PDL"},
                {"LAMINA_CUDA_FUSE", "0", "without decode fusions"},
                {"LAMINA_CUDA_TAIL", "0", "without product tails"},
                {"LAMINA_CUDA_TAIL", "1", "with every product tail"},
                {"LAMINA_CUDA_PF", "0", "without expert prefetch"},
                {"LAMINA_CUDA_PF", "before", "with the expert prefetch first"},
                {"LAMINA_CUDA_DN_SPLIT", "0", "without DeltaNet head split"},
                {"LAMINA_CUDA_TAIL", "norm,topk,cols", "with the combine over columns"},
                {"LAMINA_CUDA_EARLY", "0", "without early expert ids"},
                {"LAMINA_CUDA_TAIL", "norm,topk,rows", "with down + combine by rows"},
                {"LAMINA_CUDA_COMBINE_CLUSTER", "0", "with the combine in one block"},
                {"LAMINA_CUDA_NORM_IN", "0", "with the add + norm as a tail"},
                {"LAMINA_CUDA_IDS_POLL", "0", "without the ids polled"},
                {"LAMINA_CUDA_TOPK_ROUNDS", "1", "with the top-k by rounds"},
                {"LAMINA_CUDA_CARVEOUT", "-1", "with the driver's carveout"},
                {"LAMINA_CUDA_CARVEOUT", "100", "with all shared memory"},
                {"LAMINA_CUDA_PROBE", "1", "with the probe's marks"},
                {"LAMINA_CUDA_GQ", "0", "with the down input rounded by the down product"},
                {"LAMINA_CUDA_GS", "0", "with the shared gate summed by the combine"}};
    enum { N_OFFS = sizeof(offs) / sizeof(offs[0]) };
    double ms_off[N_OFFS];
    for (int k = 0; k < N_OFFS; k++) {
        setenv(offs[k].env, offs[k].value, 1);
        ms_off[k] = tbc_run(a, "cuda", tbc_config(a, 0, L, TBC_BATCH), tmp, NULL);
        unsetenv(offs[k].env);
        CHECK(!memcmp(gpu, tmp, sz), "%s: cuda %s differs (max %.3g)", a->name,
              offs[k].what, tbc_maxdiff(gpu, tmp, a->rows * a->V));
    }
    /* the output product with the router in one launch (opt-in): the f32 products here
     * are not the int8 kernels it extends, so it declines: the default's bits */
    setenv("LAMINA_CUDA_OUT_ROUTER", "1", 1);
    tbc_run(a, "cuda", tbc_config(a, 0, L, TBC_BATCH), tmp, NULL);
    unsetenv("LAMINA_CUDA_OUT_ROUTER");
    CHECK(!memcmp(gpu, tmp, sz), "%s: cuda with LAMINA_CUDA_OUT_ROUTER=1 (declined over f32 "
          "weights) differs (max %.3g)", a->name, tbc_maxdiff(gpu, tmp, a->rows * a->V));
    char line[2048];
    int at = snprintf(line, sizeof(line), "%s decode ms/token (layers only, mean of %d): cpu %.3f, "
                      "cuda graph %.3f", a->name, TBC_TIMED, ms_cpu, ms_graph);
    for (int k = 0; k < N_OFFS && at > 0 && (size_t)at < sizeof(line); k++)
        at += snprintf(line + at, sizeof(line) - (size_t)at, ", %s %.3f", offs[k].what, ms_off[k]);
    MEASURE("%s", line);
    tbc_half(a, tok, tmp);
    tbc_split(a, tok, gpu, tmp);
    struct backend_config f16 = tbc_config(a, 0, L, 1);
    f16.kv_f16 = true;
    tbc_run(a, "cpu", f16, gpu2, NULL);
    f16.max_batch = TBC_BATCH;
    tbc_run(a, "cuda", f16, tmp, NULL);
    tbc_compare(a, gpu2, tmp, "cuda f16 KV vs token-by-token cpu f16 KV", TBC_TOL_F16);
    /* the attention on CUDA cores (the tensor-core kernels, kernels/cuda/attn_mma.cuh,
     * are the default with an f16 cache), the three launches at every position: the
     * one-launch form below 512 (the default) is neither */
    setenv("LAMINA_CUDA_ATTN_MMA", "0", 1);
    setenv("LAMINA_CUDA_ATTN_FUSED_BELOW", "0", 1);
    tbc_run(a, "cuda", f16, tmp, NULL);
    unsetenv("LAMINA_CUDA_ATTN_FUSED_BELOW");
    unsetenv("LAMINA_CUDA_ATTN_MMA");
    tbc_compare(a, gpu2, tmp, "cuda f16 KV, attention on CUDA cores (LAMINA_CUDA_ATTN_MMA=0), "
                "vs token-by-token cpu f16 KV", TBC_TOL_F16);
    tbc_snapshot(a, gpu, tok);
    tbc_fused_below(a, f16, gpu2, tok, tmp); /* tok is scratch from here on */
    tbc_layers(a);
    tbc_budget(a);
    tbc_serve(a);
out:
    free(chunk), free(tok), free(gpu), free(gpu2), free(tmp);
}

static bool tbc_load(struct tbc_arch *a, const char *json)
{
    a->n = fixture_refs_ints(json, a->name, "prompt_ids", a->ids, 512);
    int nt = fixture_refs_ints(json, a->name, "top1", a->top1, 512);
    a->n_greedy = fixture_refs_ints(json, a->name, "greedy", a->greedy, 64);
    CHECK(a->n > 0 && nt == a->n && a->n_greedy > TBC_DECODE, "%s: refs.json lists", a->name);
    if (a->n <= 0 || nt != a->n || a->n_greedy <= TBC_DECODE)
        return false;
    a->m = gpu_fixture_model(a->name, &a->g);
    return a->m != NULL;
}

/* Kernels of the last decode step of the last tbc_greedy16 (backend stats). */
static uint64_t tbc_step_kernels;

/* Where set, the 10 tokens the decode steps of tbc_greedy16* feed instead of
 * their own arg-max (teacher forcing: every row of two runs compares). */
static const int32_t *tbc_forced;

/* Logits of a prompt of 6 tokens and 10 greedy decode steps (graph on
 * cuda) of the backend `kind` on model m, into out (16 x vocab). */
static int tbc_greedy16_via(const char *kind, const struct arch_model *m, float *out, bool head)
{
    const uint32_t n = m->hp.n_embd, V = m->hp.n_vocab;
    struct backend_config bc = {.model = m, .layer_begin = 0, .layer_end = m->hp.n_layer,
                                .n_threads = 2, .n_ctx = 64, .max_batch = 8, .lmhead = head};
    struct backend *b = backend_create(kind, &bc);
    if (!b)
        return -1;
    float *h = malloc(6 * (size_t)n * sizeof(float));
    int32_t ids[6] = {3, 141, 59, 265, 35, 89};
    const struct arch_matrix *te = &m->tok_embd;
    int rc = h ? 0 : -ENOMEM;
    for (int i = 0; i < 6 && !rc; i++)
        rc = quant_dequantize_row(te->type, te->data + (size_t)ids[i] * te->row_bytes,
                                  h + (size_t)i * n, n);
    rc = rc ? rc : backend_layers(b, h, 6);
    for (int i = 0; i < 6 && !rc; i++)
        rc = backend_logits(b, h + (size_t)i * n, 1, out + (size_t)i * V);
    for (int d = 0; d < 10 && !rc; d++) {
        const float *last = out + (size_t)(5 + d) * V;
        int32_t tok = 0;
        for (uint32_t v = 1; v < V; v++)
            tok = last[v] > last[tok] ? (int32_t)v : tok;
        tok = tbc_forced ? tbc_forced[d] : tok;
        rc = quant_dequantize_row(te->type, te->data + (size_t)tok * te->row_bytes, h, n);
        if (head) { /* the layers and the head in one pass on the device, as a last worker */
            rc = rc ? rc : backend_layers_head(b, h, 1, out + (size_t)(6 + d) * V, NULL);
            continue;
        }
        rc = rc ? rc : backend_layers(b, h, 1);
        rc = rc ? rc : backend_logits(b, h, 1, out + (size_t)(6 + d) * V);
    }
    const struct forward_stats *st = backend_stats(b);
    tbc_step_kernels = st ? st->step_kernels : 0;
    free(h);
    backend_destroy(b);
    return rc;
}

static int tbc_greedy16_on(const char *kind, const struct arch_model *m, float *out)
{
    return tbc_greedy16_via(kind, m, out, false);
}

static int tbc_greedy16(const struct arch_model *m, float *out)
{
    return tbc_greedy16_on("cuda", m, out);
}

/* The 16 x V logits of m with env set to value (then unset) into b, checked
 * byte-identical to the default's a; what names the setting in messages. */
static void tbc_same_bits(const struct arch_model *m, uint32_t type, const float *a, float *b,
                          const char *env, const char *value, const char *what)
{
    const size_t n = 16 * (size_t)m->hp.n_vocab;
    setenv(env, value, 1);
    CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run, %s", what);
    unsetenv(env);
    CHECK(a && b && !memcmp(a, b, n * sizeof(float)), "%s: %s differs from the default (max %.3g)",
          quant_type_name(type), what, a && b ? tbc_maxdiff(a, b, n) : 0.0);
}

/* Rows of two 16 x V logit sets compared against a reference: up to and
 * including the first row where either's arg-max leaves the reference's
 * (the tokens fed after it may differ). */
static int tbc_rows_agreeing(const float *ref, const float *a, const float *b, uint32_t V)
{
    /* rows 0-4 are the prompt's: their arg-max feeds nothing, so a near tie
     * there (another product path, e.g. a card without int8 tensor cores)
     * parts no contexts; from row 5 on each row's arg-max is the next token */
    for (int r = 5; r < 16; r++)
        if (tbc_argmax(a + (size_t)r * V, V) != tbc_argmax(ref + (size_t)r * V, V) ||
            tbc_argmax(b + (size_t)r * V, V) != tbc_argmax(ref + (size_t)r * V, V))
            return r + 1;
    return 16;
}

/* Where set, tbc_synth writes llama-quantize's _K_M mixture of its type. */
static bool tbc_k_m;

/* A synthetic qwen3next model (synth_write) at path, loaded: the model, its
 * gguf in *g (both NULL on failure, which is CHECKed). */
static struct arch_model *tbc_synth(const char *shape, uint32_t layers, uint32_t type,
                                    uint64_t seed, const char *path, struct gguf **g)
{
    struct synth_config sc = {.arch = "qwen3next", .shape = shape, .layers = layers,
                              .type = type, .k_m = tbc_k_m, .seed = seed, .path = path,
                              .threads = 8};
    CHECK(synth_write(&sc) == 0, "synth %s %s", shape, quant_type_name(type));
    struct gguf_config gc = {.path = path};
    *g = gguf_open(&gc);
    struct arch_config ac = {.gguf = *g};
    struct arch_model *m = *g ? arch_load(&ac) : NULL;
    CHECK(m != NULL, "load the synth model (%s %s)", shape, quant_type_name(type));
    return m;
}

/* Weight types the cuda backend runs through the f32-activation products only (Q4_1, Q5_0,
 * Q5_1; the kernels' decoders: test_matvec_cuda, tests/test_mv_types.cpp; the tiny shape's
 * rows of 64 and 128 take no 256-element types): a tiny synthetic qwen3next model of each,
 * 6 prompt positions and 10 decode steps fed
 * the cpu backend's greedy tokens: the logits within 25 % of their largest magnitude of the
 * cpu's and the arg-max the cpu's in 12 of the 16 rows at least (the cpu rounds activations
 * to int8 where the cuda products keep f32, which may flip a near tie in the routing; a
 * wrong decoder is off by the logits' own size and picks other tokens), and two cuda runs
 * byte-identical. */
static void tbc_more_types(void)
{
    static const uint32_t types[] = {QUANT_TYPE_Q4_1, QUANT_TYPE_Q5_0, QUANT_TYPE_Q5_1};
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        char path[128];
        snprintf(path, sizeof(path), "/tmp/test_backend_cuda_t%d.gguf", (int)getpid());
        struct gguf *g = NULL;
        struct arch_model *m = tbc_synth("tiny", 0, types[t], 11 + t, path, &g);
        if (m) {
            const uint32_t V = m->hp.n_vocab;
            const size_t sz = 16 * (size_t)V * sizeof(float);
            float *cpu = malloc(sz), *a = malloc(sz), *b = malloc(sz);
            int32_t toks[10];
            CHECK(cpu && a && b && tbc_greedy16_on("cpu", m, cpu) == 0, "%s: cpu run",
                  quant_type_name(types[t]));
            for (int d = 0; d < 10; d++)
                toks[d] = cpu ? (int32_t)tbc_argmax(cpu + (size_t)(5 + d) * V, V) : 0;
            tbc_forced = toks;
            const int rc_a = a ? tbc_greedy16(m, a) : -1, rc_b = b ? tbc_greedy16(m, b) : -1;
            tbc_forced = NULL;
            CHECK(rc_a == 0 && rc_b == 0, "%s: cuda runs fed the cpu's tokens",
                  quant_type_name(types[t]));
            if (rc_a == 0 && rc_b == 0 && cpu) {
                double mag = 0.0;
                for (size_t i = 0; i < 16 * (size_t)V; i++)
                    mag = fmax(mag, fabs(cpu[i]));
                const double d = tbc_maxdiff(a, cpu, 16 * (size_t)V);
                int same = 0;
                for (int r = 0; r < 16; r++)
                    same += tbc_argmax(a + (size_t)r * V, V) == tbc_argmax(cpu + (size_t)r * V, V);
                CHECK(mag > 0 && d <= 0.25 * mag && same >= 12, "%s: max |cuda - cpu| %.3g over "
                      "16 rows (max |logit| %.3g), the cpu's arg-max in %d rows",
                      quant_type_name(types[t]), d, mag, same);
                CHECK(!memcmp(a, b, sz), "%s: two cuda runs differ", quant_type_name(types[t]));
                MEASURE("%s tiny qwen3next, 16 rows fed the cpu's tokens: max |cuda - cpu| %.3g "
                        "(max |logit| %.3g), the cpu's arg-max in %d of 16 rows, two cuda runs "
                        "byte-identical", quant_type_name(types[t]), d, mag, same);
            }
            free(cpu), free(a), free(b);
        }
        arch_free(m);
        gguf_close(g);
        unlink(path);
    }
}

/* The shared expert as pair k of the routed decode products (the default)
 * against its own graph branch (LAMINA_CUDA_SHPAIR=0), on a small qwen3next
 * model of Q8_0 and of Q4_0 weights (the int8 decode kernels compute each
 * row alike whatever the pair count): the same logits, byte for byte. */
static void tbc_shpair(void)
{
    static const uint32_t types[] = {QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_0};
    for (int t = 0; t < 2; t++) {
        char path[128];
        snprintf(path, sizeof(path), "/tmp/test_backend_cuda_%d.gguf", (int)getpid());
        struct gguf *g = NULL;
        struct arch_model *m = tbc_synth("tiny", 0, types[t], 5, path, &g);
        if (m) {
            const size_t sz = 16 * (size_t)m->hp.n_vocab * sizeof(float);
            float *a = malloc(sz), *b = malloc(sz);
            CHECK(a && b && tbc_greedy16(m, a) == 0, "cuda run, shared pair");
            const uint64_t k_default = tbc_step_kernels;
            uint32_t n_dn = 0; /* DeltaNet layers: a fused input takes a kernel off each */
            for (uint32_t l = 0; l < m->hp.n_layer; l++)
                n_dn += m->layers[l].recurrent;
            tbc_same_bits(m, types[t], a, b, "LAMINA_CUDA_SHPAIR", "0",
                          "the shared expert on its own branch (not as a pair)");
            MEASURE("shared expert as pair k (%s, tiny qwen3next, 6 prompt + 10 decode steps): "
                    "logits byte-identical to its own branch", quant_type_name(types[t]));
            /* the DeltaNet input product, conv and heads as one launch (sm_90,
             * LAMINA_CUDA_DN_IN=1: clusters, =tail: each head's step the tail of
             * the block completing its rows) against the product and conv + heads:
             * the same bits; skipping the fused launch changes the decode steps
             * where it runs */
            static const char *const forms[][3] = {
                {"1", "dn.in_heads", "clusters"},
                {"tail", "dn.in_tail", "tails in owner blocks"},
                {"tail", "dn.in_tail", "tails in completing blocks"}};
            const int major = cuda_caps_cc() / 10; /* as the kernels see it (caps.h) */
            for (int f = 0; f < 3; f++) {
                setenv("LAMINA_CUDA_DN_IN", forms[f][0], 1);
                if (f == 2)
                    setenv("LAMINA_CUDA_DN_TAIL", "last", 1);
                CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run, DeltaNet input fused (%s)",
                      forms[f][2]);
                const uint64_t k_fused = tbc_step_kernels;
                CHECK(a && b && !memcmp(a, b, sz), "%s: the fused DeltaNet input (%s) differs "
                      "from the product then conv + heads (max %.3g)",
                      quant_type_name(types[t]), forms[f][2],
                      a && b ? tbc_maxdiff(a, b, 16 * (size_t)m->hp.n_vocab) : 0.0);
                if (major >= 9) {
                    /* it ran in every DeltaNet layer: a kernel fewer in each (a
                     * declined launch falls back to the two it replaces) */
                    CHECK(k_fused + n_dn == k_default,
                          "%s: %llu kernels a decode step with the fused DeltaNet input (%s), "
                          "%llu without, %u DeltaNet layers: it did not run in every one",
                          quant_type_name(types[t]), (unsigned long long)k_fused, forms[f][2],
                          (unsigned long long)k_default, n_dn);
                    setenv("LAMINA_CUDA_SKIP", forms[f][1], 1);
                    CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run without the fused input");
                    unsetenv("LAMINA_CUDA_SKIP");
                    CHECK(a && b && memcmp(a + 6 * (size_t)m->hp.n_vocab,
                                           b + 6 * (size_t)m->hp.n_vocab,
                                           sz - 6 * (size_t)m->hp.n_vocab * sizeof(float)),
                          "%s: LAMINA_CUDA_SKIP=%s left the decode steps unchanged: the fused "
                          "DeltaNet input (%s) did not run", quant_type_name(types[t]),
                          forms[f][1], forms[f][2]);
                }
                unsetenv("LAMINA_CUDA_DN_IN");
                unsetenv("LAMINA_CUDA_DN_TAIL");
                MEASURE("fused DeltaNet input, %s (%s, tiny qwen3next): logits byte-identical to "
                        "the product then conv + heads; %llu kernels a decode step against "
                        "%llu%s", forms[f][2], quant_type_name(types[t]),
                        (unsigned long long)k_fused, (unsigned long long)k_default,
                        major >= 9 ? "; it ran in every DeltaNet layer (skipping it changes the "
                                     "decode steps)"
                                   : "");
            }
            /* the down product and the combine as one launch cut by rows
             * (LAMINA_CUDA_TAIL=norm,topk,rows) against the default: the same bits;
             * with the early reads off (LAMINA_CUDA_EARLY=0) it declines and the
             * combine launches again: one kernel a layer more, the same bits */
            setenv("LAMINA_CUDA_TAIL", "norm,topk,rows", 1);
            CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run, down + combine by rows");
            const uint64_t k_rows = tbc_step_kernels;
            CHECK(a && b && !memcmp(a, b, sz), "%s: the down product and combine by rows differ "
                  "from the default (max %.3g)", quant_type_name(types[t]),
                  a && b ? tbc_maxdiff(a, b, 16 * (size_t)m->hp.n_vocab) : 0.0);
            setenv("LAMINA_CUDA_EARLY", "0", 1);
            CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run, rows asked, early reads off");
            const uint64_t k_norows = tbc_step_kernels;
            unsetenv("LAMINA_CUDA_EARLY");
            unsetenv("LAMINA_CUDA_TAIL");
            CHECK(a && b && !memcmp(a, b, sz), "%s: rows asked with the early reads off differ "
                  "from the default (max %.3g)", quant_type_name(types[t]),
                  a && b ? tbc_maxdiff(a, b, 16 * (size_t)m->hp.n_vocab) : 0.0);
            CHECK(k_rows > 0 && k_rows + m->hp.n_layer == k_norows,
                  "%s: %llu kernels a step with the down product and combine by rows, %llu "
                  "without, %u layers: it did not run in every layer", quant_type_name(types[t]),
                  (unsigned long long)k_rows, (unsigned long long)k_norows, m->hp.n_layer);
            MEASURE("down + combine by rows (%s, tiny qwen3next, %u layers): logits "
                    "byte-identical to the default; %llu kernels a decode step against %llu "
                    "when it declines", quant_type_name(types[t]), m->hp.n_layer,
                    (unsigned long long)k_rows, (unsigned long long)k_norows);
            /* the output product with the router in one launch (LAMINA_CUDA_OUT_ROUTER=1):
             * the tiny shape's heads of 16 leave the output rows unrounded (f32 products),
             * which it does not extend: it declines in every layer, the default's bits and
             * kernels (the 80b shape's tbc_xq runs it) */
            setenv("LAMINA_CUDA_OUT_ROUTER", "1", 1);
            CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run, out + router asked");
            unsetenv("LAMINA_CUDA_OUT_ROUTER");
            CHECK(a && b && !memcmp(a, b, sz) && tbc_step_kernels == k_default,
                  "%s: out + router asked where it declines: other logits or %llu kernels a "
                  "step against %llu", quant_type_name(types[t]),
                  (unsigned long long)tbc_step_kernels, (unsigned long long)k_default);
            /* the gate/up product rounding its activations after its PDL wait instead
             * of before (LAMINA_CUDA_X_EARLY=0): the same bits */
            tbc_same_bits(m, types[t], a, b, "LAMINA_CUDA_X_EARLY", "0",
                          "the gate/up activations rounded after the wait");
            /* the gate/up product's expert tiles loaded lane by lane instead of by one
             * bulk copy a block (LAMINA_CUDA_TMA=0): the same bits */
            tbc_same_bits(m, types[t], a, b, "LAMINA_CUDA_TMA", "0",
                          "the gate/up tiles loaded lane by lane");
            /* LAMINA_CUDA_SKIP (timing experiments): the named decode kernels are not
             * launched, so the decode steps change and the prompt does not */
            setenv("LAMINA_CUDA_SKIP", "moe.down,moe.combine", 1);
            CHECK(a && b && tbc_greedy16(m, b) == 0, "cuda run with decode kernels skipped");
            unsetenv("LAMINA_CUDA_SKIP");
            const size_t prompt = 6 * (size_t)m->hp.n_vocab * sizeof(float);
            CHECK(a && b && !memcmp(a, b, prompt), "%s: LAMINA_CUDA_SKIP changed the prompt's "
                  "logits", quant_type_name(types[t]));
            CHECK(a && b && memcmp(a + 6 * (size_t)m->hp.n_vocab, b + 6 * (size_t)m->hp.n_vocab,
                               sz - prompt),
                  "%s: LAMINA_CUDA_SKIP=moe.down,moe.combine left the decode steps unchanged",
                  quant_type_name(types[t]));
            free(a);
            free(b);
        }
        arch_free(m);
        gguf_close(g);
        unlink(path);
    }
}

/* tbc_greedy16 of m with env set to value, into tmp, against ref (sz
 * bytes): whether it ran and gave the same bytes (both CHECKed, naming
 * what). */
static bool tbc_greedy16_same(const struct arch_model *m, const char *env, const char *value,
                              const float *ref, float *tmp, size_t sz, const char *what)
{
    setenv(env, value, 1);
    const int rc = tbc_greedy16(m, tmp);
    unsetenv(env);
    CHECK(rc == 0, "cuda run %s", what);
    const bool same = rc == 0 && !memcmp(ref, tmp, sz);
    CHECK(rc != 0 || same, "%s: other logits than the default (max %.3g)", what,
          rc ? 0.0 : tbc_maxdiff(ref, tmp, sz / sizeof(float)));
    return same;
}

/* The decode input products reading the rows the combine rounded (xq) on an
 * 80b-a3b-shaped qwen3next of four layers (three DeltaNet, one attention;
 * n_embd 2048, where the combine's one-round path and the int8 products
 * serve): the logits byte-identical with LAMINA_CUDA_XQ=0. */
static void tbc_xq(void)
{
    CHECK(cuda_moe_combine_xq_ok(2048, 10), "xq: the combine does not take n 2048, k 10");
    char path[128];
    snprintf(path, sizeof(path), "/tmp/test_backend_cuda_xq_%d.gguf", (int)getpid());
    struct gguf *g = NULL;
    struct arch_model *m = tbc_synth("80b-a3b", 4, QUANT_TYPE_Q4_0, 9, path, &g);
    if (m) {
        const size_t sz = 16 * (size_t)m->hp.n_vocab * sizeof(float);
        float *a = malloc(sz), *b = malloc(sz);
        CHECK(a && b && tbc_greedy16(m, a) == 0, "cuda run, xq");
        /* the graph's kernel nodes (what a replay runs) against the launches
         * counted one by one, the attention's split combine included */
        const uint64_t k_graph = tbc_step_kernels;
        if (a && b && tbc_greedy16_same(m, "LAMINA_CUDA_GRAPHS", "0", a, b, sz,
                                        "xq model without graphs")) {
            CHECK(k_graph > 0 && k_graph == tbc_step_kernels, "xq model: the decode graph holds "
                  "%llu kernels, a step launched one by one counted %llu",
                  (unsigned long long)k_graph, (unsigned long long)tbc_step_kernels);
            MEASURE("xq model (4 layers): %llu kernels a decode step, the graph's nodes and the "
                    "launches one by one alike", (unsigned long long)k_graph);
        }
        /* the input products rounding xa themselves instead of copying the
         * combine's rounded rows */
        if (a && b && tbc_greedy16_same(m, "LAMINA_CUDA_XQ", "0", a, b, sz, "without xq"))
            MEASURE("xq (Q4_0 80b-a3b shape, 4 layers, 6 prompt + 10 decode steps): logits "
                    "byte-identical to the input products rounding xa themselves");
        /* conv + heads split over clusters (32 heads of 128 here) reading the
         * states after their PDL wait instead of before */
        if (a && b)
            tbc_greedy16_same(m, "LAMINA_CUDA_DN_EARLY", "0", a, b, sz,
                              "DeltaNet states after the wait");
        /* the residual add + norm after each mixer formed by the router, the
         * gate/up product and the combine (tail.h's cuda_norm_in) against the
         * output product's tail; and, without that tail (LAMINA_CUDA_TAIL=topk),
         * against the add + norm launch, which it saves in every layer (it ran) */
        if (a && b)
            tbc_greedy16_same(m, "LAMINA_CUDA_NORM_IN", "0", a, b, sz,
                              "the add + norm as the output product's tail");
        setenv("LAMINA_CUDA_TAIL", "topk", 1);
        const int rc_nt = a && b ? tbc_greedy16(m, b) : -1;
        const uint64_t k_nin = tbc_step_kernels;
        CHECK(rc_nt == 0 && !memcmp(a, b, sz), "norm in without the norm tail: other logits "
              "than the default");
        if (rc_nt == 0 && a && b &&
            tbc_greedy16_same(m, "LAMINA_CUDA_NORM_IN", "0", a, b, sz,
                              "the add + norm as a launch")) {
            CHECK(tbc_step_kernels == k_nin + m->hp.n_layer, "norm in: %llu kernels a decode "
                  "step, %llu with the add + norm launch (%u layers)",
                  (unsigned long long)k_nin, (unsigned long long)tbc_step_kernels,
                  m->hp.n_layer);
            MEASURE("norm in (Q4_0 80b-a3b shape, 4 layers): logits byte-identical to the "
                    "add + norm as a tail or a launch; %llu kernels a step against %llu",
                    (unsigned long long)k_nin, (unsigned long long)tbc_step_kernels);
        }
        unsetenv("LAMINA_CUDA_TAIL");
        /* the decode steps' head right after the layers on the device
         * (backend_layers_head, as a last worker runs it): the same bits */
        const int rc_h = a && b ? tbc_greedy16_via("cuda", m, b, true) : -1;
        CHECK(rc_h == 0 && !memcmp(a, b, sz), "layers + head: other logits than the layers "
              "then the head (max %.3g)",
              rc_h == 0 ? tbc_maxdiff(a, b, sz / sizeof(float)) : 0.0);
        /* the profile (LAMINA_CUDA_PROFILE=1: kernels one by one, an event before
         * each, the pass's closing event after the head): both ways run and give
         * the same bits (its head once left an event unrecorded, and the next
         * step failed on the error that left behind) */
        if (a && b)
            tbc_greedy16_same(m, "LAMINA_CUDA_PROFILE", "1", a, b, sz, "with the profile");
        setenv("LAMINA_CUDA_PROFILE", "1", 1);
        const int rc_hp = a && b ? tbc_greedy16_via("cuda", m, b, true) : -1;
        unsetenv("LAMINA_CUDA_PROFILE");
        CHECK(rc_hp == 0 && !memcmp(a, b, sz), "layers + head with the profile: rc %d, other "
              "logits than the default (max %.3g)", rc_hp,
              rc_hp == 0 ? tbc_maxdiff(a, b, sz / sizeof(float)) : 0.0);
        /* yq: the DeltaNet output product over the rounded y of conv + heads,
         * and the attention output product (layer 3) over the combine's
         * rounded output (int8 kernels) where they had taken the f32 kernels
         * (rows of 4096, LAMINA_CUDA_YQ=0): other bits in the decode steps,
         * no further from the cpu backend than those. Both cuda runs are fed the
         * cpu's greedy tokens, so that all 16 rows compare: a near tie in a
         * row (the sm_75 path's prefill rounds otherwise) would else end the
         * comparison there. */
        const uint32_t V = m->hp.n_vocab;
        float *c = malloc(sz), *cpu = malloc(sz), *f = malloc(sz);
        int32_t toks[10];
        CHECK(cpu && tbc_greedy16_on("cpu", m, cpu) == 0, "cpu run");
        for (int d = 0; d < 10; d++)
            toks[d] = cpu ? (int32_t)tbc_argmax(cpu + (size_t)(5 + d) * V, V) : 0;
        tbc_forced = toks;
        CHECK(f && tbc_greedy16(m, f) == 0, "cuda run fed the cpu's tokens");
        const uint64_t k_f = tbc_step_kernels;
        /* the output product with the router in one launch (LAMINA_CUDA_OUT_ROUTER=1), fed
         * the same tokens: its logits summed in another order */
        float *rt = malloc(sz);
        setenv("LAMINA_CUDA_OUT_ROUTER", "1", 1);
        const int rc_rt = rt ? tbc_greedy16(m, rt) : -1;
        const uint64_t k_rt = tbc_step_kernels;
        unsetenv("LAMINA_CUDA_OUT_ROUTER");
        CHECK(rc_rt == 0, "cuda run fed the cpu's tokens, out + router in one launch");
        setenv("LAMINA_CUDA_YQ", "0", 1);
        CHECK(c && tbc_greedy16(m, c) == 0, "cuda run fed the cpu's tokens, without yq");
        unsetenv("LAMINA_CUDA_YQ");
        tbc_forced = NULL;
        if (a && c && cpu && f) {
            CHECK(!memcmp(f, c, 6 * (size_t)V * sizeof(float)) &&
                  memcmp(f + 6 * (size_t)V, c + 6 * (size_t)V, 10 * (size_t)V * sizeof(float)),
                  "yq: LAMINA_CUDA_YQ=0 should change the decode steps only (the product's "
                  "kernels), and it must change them");
            const int rows = tbc_rows_agreeing(cpu, a, a, V);
            double mag = 0.0;
            for (size_t i = 0; i < 16 * (size_t)V; i++)
                mag = fmax(mag, fabs(cpu[i]));
            const double d_yq = tbc_maxdiff(f, cpu, 16 * (size_t)V);
            const double d_off = tbc_maxdiff(c, cpu, 16 * (size_t)V);
            CHECK(d_yq <= 2.0 * d_off + 1e-3 * mag, "yq: max |cuda - cpu| %.3g against %.3g "
                  "with LAMINA_CUDA_YQ=0 (max |logit| %.3g)", d_yq, d_off, mag);
            MEASURE("yq (Q4_0 80b-a3b shape, 4 layers, 16 rows, the cpu's tokens fed): max "
                    "|cuda - cpu| %.3g, %.3g with LAMINA_CUDA_YQ=0 (max |logit| %.3g); run "
                    "freely the cuda tokens kept the cpu's for %d rows", d_yq, d_off, mag, rows);
            /* out + router (sm_90): as close to the cpu as the default, the prompt's rows
             * too, and a kernel fewer in every layer (it ran in each) */
            if (rc_rt == 0 && cuda_caps_cc() >= 90) {
                const double d_rt = tbc_maxdiff(rt, cpu, 16 * (size_t)V);
                CHECK(d_rt <= 2.0 * d_yq + 1e-3 * mag, "out + router: max |cuda - cpu| %.3g "
                      "against the default's %.3g (max |logit| %.3g)", d_rt, d_yq, mag);
                CHECK(k_rt + m->hp.n_layer == k_f, "out + router: %llu kernels a decode step, "
                      "the default %llu, %u layers: it did not run in every one",
                      (unsigned long long)k_rt, (unsigned long long)k_f, m->hp.n_layer);
                MEASURE("out + router in one launch (Q4_0 80b-a3b shape, 4 layers, the cpu's "
                        "tokens fed): max |cuda - cpu| %.3g against the default's %.3g, max "
                        "|logit - default| %.3g (max |logit| %.3g); %llu kernels a decode step "
                        "against %llu", d_rt, d_yq, tbc_maxdiff(rt, f, 16 * (size_t)V), mag,
                        (unsigned long long)k_rt, (unsigned long long)k_f);
            } else if (rc_rt == 0) { /* declined below sm_90: the default's bits */
                CHECK(!memcmp(rt, f, sz), "out + router below sm_90 (declined) differs");
            }
        }
        free(c), free(cpu), free(f), free(rt);
        free(a), free(b);
    }
    arch_free(m);
    gguf_close(g);
    unlink(path);
}

/* The int8 decode products on K-type weights (mvq.cu's units of 64; LAMINA_CUDA_MVQ_K=1,
 * the default): for Q4_K and Q6_K an 80b-a3b-shaped qwen3next of four layers (three
 * DeltaNet, one attention) of matrices of that type (every row of whole super-blocks
 * here), fed the cpu backend's greedy tokens, against the same run with the type left to
 * the f32-activation products (LAMINA_CUDA_MVQ_K=0): the decode steps' logits changed and
 * fewer kernels a step (the int8 forms ran, their norm-in and add/norm tails fused; the
 * prompt's rows change too, as the head's product of each is the int8 one), no further
 * from the cpu's than that run's (within twice its max |diff| + 1e-3 of the largest
 * logit), the cpu's arg-max in at least 14 of the 16 rows, and two runs byte-identical. */
static void tbc_kq(uint32_t type, bool k_m)
{
    const char *tn = k_m ? "Q4_K_M" : quant_type_name(type);
    char path[128];
    snprintf(path, sizeof(path), "/tmp/test_backend_cuda_kq_%d.gguf", (int)getpid());
    struct gguf *g = NULL;
    tbc_k_m = k_m;
    struct arch_model *m = tbc_synth("80b-a3b", 4, type, 13, path, &g);
    tbc_k_m = false;
    if (m) {
        const uint32_t V = m->hp.n_vocab;
        const size_t sz = 16 * (size_t)V * sizeof(float);
        float *cpu = malloc(sz), *a = malloc(sz), *b = malloc(sz), *f = malloc(sz);
        int32_t toks[10];
        CHECK(cpu && a && b && f && tbc_greedy16_on("cpu", m, cpu) == 0, "%s: cpu run", tn);
        for (int d = 0; d < 10; d++)
            toks[d] = cpu ? (int32_t)tbc_argmax(cpu + (size_t)(5 + d) * V, V) : 0;
        tbc_forced = toks;
        setenv("LAMINA_CUDA_MVQ_K", "1", 1); /* the default, said outright */
        const int rc_a = a ? tbc_greedy16(m, a) : -1, rc_b = b ? tbc_greedy16(m, b) : -1;
        const uint64_t k_a = tbc_step_kernels;
        /* the same bits with the plain products on one block's registers, every type's on
         * three blocks', Q6_K's down products loaded lane by lane (LAMINA_CUDA_TMA=poll), and
         * the second of two input products waiting first (LAMINA_CUDA_BESIDE=0) */
        static const char *const sw[][2] = {{"LAMINA_CUDA_PLAIN_LEAN", "0"},
                                            {"LAMINA_CUDA_PLAIN_LEAN", "all"},
                                            {"LAMINA_CUDA_TMA", "poll"},
                                            {"LAMINA_CUDA_BESIDE", "0"}};
        float *l = malloc(sz);
        for (int li = 0; a && l && rc_a == 0 && li < 4; li++) {
            setenv(sw[li][0], sw[li][1], 1);
            const int rc_l = tbc_greedy16(m, l);
            unsetenv(sw[li][0]);
            CHECK(rc_l == 0 && !memcmp(a, l, sz), "%s: %s=%s differs (max %.3g)", tn, sw[li][0],
                  sw[li][1], tbc_maxdiff(a, l, 16 * (size_t)V));
        }
        free(l);
        setenv("LAMINA_CUDA_MVQ_K", "0", 1);
        const int rc_f = f ? tbc_greedy16(m, f) : -1;
        const uint64_t k_f = tbc_step_kernels;
        unsetenv("LAMINA_CUDA_MVQ_K");
        tbc_forced = NULL;
        CHECK(rc_a == 0 && rc_b == 0 && rc_f == 0, "%s: cuda runs fed the cpu's tokens", tn);
        if (rc_a == 0 && rc_b == 0 && rc_f == 0 && cpu) {
            CHECK(!memcmp(a, b, sz), "%s: two cuda runs differ", tn);
            CHECK(memcmp(a + 6 * (size_t)V, f + 6 * (size_t)V, 10 * (size_t)V * sizeof(float)) &&
                      k_a < k_f,
                  "%s: the int8 forms did not run: the decode steps the same with "
                  "LAMINA_CUDA_MVQ_K=0, or %llu kernels a step against its %llu", tn,
                  (unsigned long long)k_a, (unsigned long long)k_f);
            double mag = 0.0;
            for (size_t i = 0; i < 16 * (size_t)V; i++)
                mag = fmax(mag, fabs(cpu[i]));
            const double d_k = tbc_maxdiff(a, cpu, 16 * (size_t)V);
            const double d_f = tbc_maxdiff(f, cpu, 16 * (size_t)V);
            int same = 0;
            for (int r = 0; r < 16; r++)
                same += tbc_argmax(a + (size_t)r * V, V) == tbc_argmax(cpu + (size_t)r * V, V);
            CHECK(mag > 0 && d_k <= 2.0 * d_f + 1e-3 * mag && same >= 14,
                  "%s: max |cuda - cpu| %.3g against %.3g with LAMINA_CUDA_MVQ_K=0 (max "
                  "|logit| %.3g), the cpu's arg-max in %d of 16 rows", tn, d_k, d_f, mag, same);
            MEASURE("%s (80b-a3b shape, 4 layers, 16 rows, the cpu's tokens fed): max |cuda - "
                    "cpu| %.3g, %.3g on the f32 products (max |logit| %.3g), the cpu's arg-max "
                    "in %d of 16 rows, two runs byte-identical; %llu kernels a decode step", tn,
                    d_k, d_f, mag, same, (unsigned long long)k_a);
        }
        free(cpu), free(a), free(b), free(f);
    }
    arch_free(m);
    gguf_close(g);
    unlink(path);
}

/* backend_host_alloc on a cuda backend: page-locked (the head's logits are copied straight
 * into it), plain memory with LAMINA_PINNED=0, both usable and freed by their allocator; with
 * LAMINA_PINNED=1 a buffer of half a MiB page-locked and one of 3 MiB plain, device copies
 * into and out of both whole. */
static void tbc_host_buffers(void)
{
    struct gguf *g = NULL;
    struct arch_model *m = gpu_fixture_model("qwen3moe", &g);
    struct backend_config bc = {.model = m, .layer_end = m ? m->hp.n_layer : 0, .n_ctx = 16};
    struct backend *b = m ? backend_create("cuda", &bc) : NULL;
    CHECK(b != NULL, "cuda backend for host buffers");
    for (int pinned = 1; b && pinned >= 0; pinned--) {
        if (!pinned)
            setenv("LAMINA_PINNED", "0", 1);
        float *p = backend_host_alloc(b, 4096 * sizeof(float));
        unsetenv("LAMINA_PINNED");
        struct cudaPointerAttributes at;
        const cudaError_t e = p ? cudaPointerGetAttributes(&at, p) : cudaErrorInvalidValue;
        (void)cudaGetLastError();
        const bool host = e == cudaSuccess && at.type == cudaMemoryTypeHost;
        CHECK(p && (uintptr_t)p % 16 == 0 && host == (pinned == 1),
              "host buffer (pinned %d): %p, page-locked %d", pinned, (void *)p, (int)host);
        for (int i = 0; p && i < 4096; i++)
            p[i] = (float)i;
        CHECK(!p || p[4095] == 4095.0f, "host buffer (pinned %d) not usable", pinned);
        backend_host_free(b, p);
    }
    /* LAMINA_PINNED=1: a buffer of half a MiB page-locked, one of 3 MiB plain (never partly:
     * a copy across a partly locked buffer fails), copies into and out of both whole */
    for (int big = 0; b && big < 2; big++) {
        const size_t n = big ? (size_t)3 << 18 : (size_t)1 << 17;
        setenv("LAMINA_PINNED", "1", 1);
        float *p = backend_host_alloc(b, n * sizeof(float));
        unsetenv("LAMINA_PINNED");
        float *src = malloc(n * sizeof(float)), *d = NULL;
        CHECK(p && src && cudaMalloc((void **)&d, n * sizeof(float)) == cudaSuccess,
              "host buffer of %zu floats", n);
        if (p && src && d) {
            struct cudaPointerAttributes a0, a1;
            const bool h0 = cudaPointerGetAttributes(&a0, p) == cudaSuccess &&
                            a0.type == cudaMemoryTypeHost;
            const bool h1 = cudaPointerGetAttributes(&a1, p + n - 1) == cudaSuccess &&
                            a1.type == cudaMemoryTypeHost;
            (void)cudaGetLastError();
            CHECK(h0 == !big && h1 == !big, "LAMINA_PINNED=1, %zu KiB: page-locked %d and %d",
                  n * sizeof(float) / 1024, (int)h0, (int)h1);
            for (size_t i = 0; i < n; i++)
                src[i] = (float)i;
            cudaError_t e = cudaMemcpy(d, src, n * sizeof(float), cudaMemcpyHostToDevice);
            memset(p, 0, n * sizeof(float));
            e = e ? e : cudaMemcpyAsync(p, d, n * sizeof(float), cudaMemcpyDeviceToHost, 0);
            e = e ? e : cudaStreamSynchronize(0);
            CHECK(!e && !memcmp(p, src, n * sizeof(float)), "a copy into a host buffer (%s)",
                  cudaGetErrorString(e));
            e = cudaMemset(d, 0, n * sizeof(float));
            e = e ? e : cudaMemcpy(d, p, n * sizeof(float), cudaMemcpyHostToDevice);
            e = e ? e : cudaMemcpy(src, d, n * sizeof(float), cudaMemcpyDeviceToHost);
            CHECK(!e && !memcmp(p, src, n * sizeof(float)), "a copy out of a host buffer (%s)",
                  cudaGetErrorString(e));
        }
        cudaFree(d);
        free(src);
        backend_host_free(b, p);
    }
    backend_destroy(b);
    arch_free(m);
    gguf_close(g);
}

int main(void)
{
    log_init("test", -1);
    setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1); /* before the first CUDA call */
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_backend_cuda: no CUDA device present\n");
        return 1;
    }
    char path[512];
    char *json = fixture_read_all(test_fixture(path, sizeof(path), "conformance/refs.json"), NULL);
    CHECK(json != NULL, "cannot read %s", path);
    const char *names[] = {"qwen3moe", "qwen3next", "qwen35moe"};
    for (int i = 0; i < 3 && json; i++) {
        struct tbc_arch a = {.name = names[i]};
        if (tbc_load(&a, json))
            tbc_arch_run(&a);
        arch_free(a.m);
        gguf_close(a.g);
    }
    free(json);
    tbc_shpair();
    tbc_more_types();
    tbc_xq();
    tbc_kq(QUANT_TYPE_Q4_K, false);
    tbc_kq(QUANT_TYPE_Q6_K, false);
    tbc_kq(QUANT_TYPE_Q4_K, true);
    tbc_host_buffers();
    MEASURE("backend_argmax (greedy ids on the device): %d rows, %d differ from the first "
            "maximum of the logits", argmax_rows, argmax_bad);
    CHECK(argmax_rows > 0, "backend_argmax was never checked");
    return test_main_result("test_backend_cuda");
}
