/*
 * test_stage_times_cuda: the "cuda" worker backend's stage timings
 * (backend_config.stage_times, the worker's LAMINA_CUDA_STAGE_TIMES=1) on
 * the conformance fixtures (../shared/fixtures/conformance/{qwen3moe,
 * qwen3next,qwen35moe}/ARCH-f32.gguf). For each architecture, every expert
 * resident, the prompt of refs.json is prefilled (max_batch TST_BATCH: several
 * eager passes) and TST_DECODE tokens of the greedy continuation are decoded
 * (decode through the CUDA graph, captured with the events), then TST_TIMED
 * more decode steps are timed on the host:
 *   - logits with stage timings on are byte-identical to those with them off,
 *     through the graph and with LAMINA_CUDA_GRAPHS=0 (events only observe);
 *   - after the prefill and after the timed decode steps, the stages the
 *     model has are > 0: attn where it has attention layers, deltanet where
 *     it has DeltaNet layers, router, experts, shared_expert where it has a
 *     shared expert;
 *   - their sums fit the host wall time of the same backend_layers calls:
 *     attn + deltanet + router + experts (stages of the main stream, disjoint
 *     in time) and shared_expert (on the side stream, overlapping router and
 *     experts) each at most TST_SLACK x the wall time. The sum of all five
 *     is printed beside the wall time, not checked: the overlap may take it
 *     past the wall time;
 *   - with stage timings off the five stay 0.
 * Prints a [measure] line per architecture with the per-stage split of the
 * timed decode steps and the decode ms/token with timings off and on (the
 * event nodes cost some). Needs a CUDA device: exits 1 with a message when
 * there is none.
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "tests/check.h"
#include "tests/gpu/gpu_fixture.h"
#include "tests/fixture.h"
#include "worker/backend.h"

#define TST_BATCH 32  /* max_batch: the prompt takes several passes */
#define TST_DECODE 6  /* checked decode steps after the prompt */
#define TST_TIMED 32  /* timed decode steps after them */
#define TST_CTX 256
#define TST_SLACK 1.1 /* stage sums may exceed the wall time by 10 % (event resolution) */

struct tst_arch {
    const char *name;
    struct gguf *g;
    struct arch_model *m;
    int32_t ids[512], greedy[64];
    int n, n_greedy;
    uint32_t V, n_embd;
    bool has_attn, has_dn, has_sh;
};

/* One run's outputs: the logits of every position, the stats and wall times. */
struct tst_run {
    float *logits;            /* (n + TST_DECODE) rows of V */
    struct forward_stats pre; /* stats after the prefill */
    struct forward_stats dec; /* stats of the timed decode steps alone */
    double pre_s, dec_s;      /* host wall time of the prefill and of the timed steps */
};

static double tst_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int tst_embed(const struct tst_arch *a, const int32_t *ids, int n, float *h)
{
    const struct arch_matrix *te = &a->m->tok_embd;
    for (int s = 0; s < n; s++)
        if (quant_dequantize_row(te->type, te->data + (size_t)ids[s] * te->row_bytes,
                                 h + (size_t)s * a->n_embd, a->n_embd))
            return -1;
    return 0;
}

static double tst_stage_sum(const struct forward_stats *s)
{
    return s->attn + s->deltanet + s->router + s->experts;
}

static void tst_sub(struct forward_stats *d, const struct forward_stats *a,
                    const struct forward_stats *b)
{
    d->attn = a->attn - b->attn;
    d->deltanet = a->deltanet - b->deltanet;
    d->router = a->router - b->router;
    d->experts = a->experts - b->experts;
    d->shared_expert = a->shared_expert - b->shared_expert;
}

/* Prefill, TST_DECODE checked decode steps, TST_TIMED timed ones. Returns 0 or -1. */
static int tst_run(const struct tst_arch *a, bool stage_times, struct tst_run *r)
{
    struct backend_config cfg = {.model = a->m, .layer_begin = 0,
                                 .layer_end = a->m->hp.n_layer, .n_threads = 2,
                                 .n_ctx = TST_CTX, .max_batch = TST_BATCH,
                                 .stage_times = stage_times};
    struct backend *b = backend_create("cuda", &cfg);
    CHECK(b != NULL, "%s: cuda backend created (stage times %d)", a->name, stage_times);
    float *h = malloc((size_t)a->n * a->n_embd * sizeof(float));
    int rc = !b || !h || tst_embed(a, a->ids, a->n, h);
    double t0 = tst_now();
    rc = rc || backend_layers(b, h, (uint32_t)a->n);
    r->pre_s = tst_now() - t0;
    if (!rc)
        r->pre = *backend_stats(b);
    rc = rc || backend_logits(b, h, (uint32_t)a->n, r->logits);
    for (int d = 0; d < TST_DECODE && !rc; d++) {
        rc = tst_embed(a, &a->greedy[d], 1, h) || backend_layers(b, h, 1);
        rc = rc || backend_logits(b, h, 1, r->logits + (size_t)(a->n + d) * a->V);
    }
    struct forward_stats s0 = {0};
    if (!rc)
        s0 = *backend_stats(b);
    rc = rc || tst_embed(a, &a->greedy[0], 1, h);
    t0 = tst_now();
    for (int d = 0; d < TST_TIMED && !rc; d++)
        rc = backend_layers(b, h, 1);
    r->dec_s = tst_now() - t0;
    if (!rc)
        tst_sub(&r->dec, backend_stats(b), &s0);
    CHECK(rc == 0, "%s: sequence ran (stage times %d)", a->name, stage_times);
    free(h);
    backend_destroy(b);
    return rc ? -1 : 0;
}

/* The stages the model has are > 0; the sums fit the wall time. */
static void tst_check_stats(const struct tst_arch *a, const struct forward_stats *s, double wall,
                            const char *what)
{
    CHECK(!a->has_attn || s->attn > 0, "%s %s: attn %.3g s", a->name, what, s->attn);
    CHECK(!a->has_dn || s->deltanet > 0, "%s %s: deltanet %.3g s", a->name, what, s->deltanet);
    CHECK(s->router > 0, "%s %s: router %.3g s", a->name, what, s->router);
    CHECK(s->experts > 0, "%s %s: experts %.3g s", a->name, what, s->experts);
    CHECK(!a->has_sh || s->shared_expert > 0, "%s %s: shared_expert %.3g s", a->name, what,
          s->shared_expert);
    CHECK(tst_stage_sum(s) <= TST_SLACK * wall,
          "%s %s: attn + deltanet + router + experts %.3f ms > %.1f x wall %.3f ms", a->name,
          what, 1e3 * tst_stage_sum(s), TST_SLACK, 1e3 * wall);
    CHECK(s->shared_expert <= TST_SLACK * wall, "%s %s: shared_expert %.3f ms > %.1f x wall "
          "%.3f ms", a->name, what, 1e3 * s->shared_expert, TST_SLACK, 1e3 * wall);
}

static void tst_arch_run(struct tst_arch *a)
{
    a->V = a->m->hp.n_vocab;
    a->n_embd = a->m->hp.n_embd;
    for (uint32_t l = 0; l < a->m->hp.n_layer; l++) {
        a->has_dn |= a->m->layers[l].recurrent;
        a->has_attn |= !a->m->layers[l].recurrent;
    }
    a->has_sh = a->m->hp.n_ff_shexp > 0;
    const size_t sz = (size_t)(a->n + TST_DECODE) * a->V * sizeof(float);
    struct tst_run off = {.logits = malloc(sz)}, on = {.logits = malloc(sz)};
    struct tst_run plain = {.logits = malloc(sz)};
    if (!off.logits || !on.logits || !plain.logits)
        goto out;
    if (tst_run(a, false, &off) || tst_run(a, true, &on))
        goto out;
    CHECK(!memcmp(off.logits, on.logits, sz), "%s: logits with stage times differ", a->name);
    const struct forward_stats *o = &off.pre;
    CHECK(o->attn == 0 && o->deltanet == 0 && o->router == 0 && o->experts == 0 &&
          o->shared_expert == 0, "%s: stages timed with stage times off", a->name);
    tst_check_stats(a, &on.pre, on.pre_s, "prefill");
    tst_check_stats(a, &on.dec, on.dec_s, "decode graph");
    setenv("LAMINA_CUDA_GRAPHS", "0", 1);
    const int rc = tst_run(a, true, &plain);
    unsetenv("LAMINA_CUDA_GRAPHS");
    if (rc)
        goto out;
    CHECK(!memcmp(off.logits, plain.logits, sz), "%s: logits with stage times, no graph, differ",
          a->name);
    tst_check_stats(a, &plain.dec, plain.dec_s, "decode without graph");
    const struct forward_stats *d = &on.dec;
    const double ms = 1e3 / TST_TIMED;
    MEASURE("%s decode stage ms/token (graph, mean of %d): attn %.4f, deltanet %.4f, router "
            "%.4f, experts %.4f, shared_expert %.4f (overlaps); main-stream sum %.4f, all five "
            "%.4f, wall %.4f; wall with stage times off %.4f", a->name, TST_TIMED,
            ms * d->attn, ms * d->deltanet, ms * d->router, ms * d->experts,
            ms * d->shared_expert, ms * tst_stage_sum(d), ms * (tst_stage_sum(d) +
            d->shared_expert), ms * on.dec_s, ms * off.dec_s);
    d = &on.pre;
    MEASURE("%s prefill stage ms (%d tokens, passes of %d): attn %.3f, deltanet %.3f, router "
            "%.3f, experts %.3f, shared_expert %.3f; wall %.3f, with stage times off %.3f",
            a->name, a->n, TST_BATCH, 1e3 * d->attn, 1e3 * d->deltanet, 1e3 * d->router,
            1e3 * d->experts, 1e3 * d->shared_expert, 1e3 * on.pre_s, 1e3 * off.pre_s);
out:
    free(off.logits), free(on.logits), free(plain.logits);
}

static bool tst_load(struct tst_arch *a, const char *json)
{
    a->n = fixture_refs_ints(json, a->name, "prompt_ids", a->ids, 512);
    a->n_greedy = fixture_refs_ints(json, a->name, "greedy", a->greedy, 64);
    CHECK(a->n > 0 && a->n_greedy > TST_DECODE, "%s: refs.json lists", a->name);
    if (a->n <= 0 || a->n_greedy <= TST_DECODE)
        return false;
    a->m = gpu_fixture_model(a->name, &a->g);
    return a->m != NULL;
}

int main(void)
{
    log_init("test", -1);
    setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1); /* before the first CUDA call */
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_stage_times_cuda: no CUDA device present\n");
        return 1;
    }
    char path[512];
    char *json = fixture_read_all(test_fixture(path, sizeof(path), "conformance/refs.json"), NULL);
    CHECK(json != NULL, "cannot read %s", path);
    const char *names[] = {"qwen3moe", "qwen3next", "qwen35moe"};
    for (int i = 0; i < 3 && json; i++) {
        struct tst_arch a = {.name = names[i]};
        if (tst_load(&a, json))
            tst_arch_run(&a);
        arch_free(a.m);
        gguf_close(a.g);
    }
    free(json);
    return test_main_result("test_stage_times_cuda");
}
