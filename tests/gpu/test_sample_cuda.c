/*
 * test_sample_cuda: the GPU sampler (kernels/cuda/sample.h) against the CPU sampler
 * (model/sampler.h) on fresh random logits.
 *
 * For vocabularies of 151936 (and 1, 7, 100, 1031, 20000) and several kinds of logits (flat,
 * peaked like a language model's, coarse values with many ties, a third -inf and some NaN,
 * wide), every parameter set (greedy, temperature alone, min_p, top_k 1 / 40 / 1000 / 5000 /
 * n / n + 5, top_p alone, the llama.cpp chain, penalties over a window of 64 accepted ids with
 * repeats and ids past the vocabulary) runs several draws (logits 16-byte aligned, and at a
 * 4-byte offset for the 20000 vocabulary): one CPU sampler samples, a second
 * with the same seed and history gives its uniform number (sampler_next_uniform) to the
 * kernel, whose output was poisoned first. The tokens must be equal, except where equality is
 * impossible in principle: the weights come from different expf and are summed differently, so
 * a difference is tolerated only when a double-precision reference says the top_p cutoff or
 * the draw lies within 1e-5 (relative to the total weight) of a cumulative sum, and the GPU's
 * token is one of those the boundary allows; greedy and the degenerate rows (all -inf, NaN,
 * +inf) must be exact. The launch is also replayed from a CUDA graph with a new uniform number
 * each time, and bad arguments are refused. Then it is timed (cudaEvents, median of 50 after
 * warm-up) on 151936 peaked logits: greedy, cuda_argmax for comparison, top_k 40 / top_p 0.95
 * / temperature 0.8, the llama.cpp chain with penalties, top_p 0.95 alone, temperature alone.
 *
 * Needs a CUDA device: without one it says so and exits 1.
 */
#include "kernels/cuda/sample.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cuda/ops.h"
#include "model/sampler.h"
#include "tests/check.h"
#include "tests/gpu/gpu_check.h"

#define BIG 151936
#define EPS 1e-5      /* boundary tolerance, relative to the total weight */
#define WINDOW 80     /* d_recent slots: the 64 of the window, then padding */
#define POISON 0xFF   /* byte written over the token before each run: -1 */

/* Uniform in [0, 1). */
static double rng_unit(struct rng *r)
{
    return (double)(rng_next(r) >> 11) * 0x1.0p-53;
}

enum dist { DIST_FLAT, DIST_PEAKED, DIST_TIES, DIST_HOLES, DIST_WIDE, DIST_ALL_NEG_INF,
            DIST_NAN, DIST_POS_INF, N_DIST };
static const char *const dist_name[N_DIST] = {"flat", "peaked", "ties", "-inf/NaN holes", "wide",
                                              "all -inf", "all NaN but one -inf", "+inf"};

/* Roughly normal (sum of 4 uniforms), unit variance. */
static double rng_normal(struct rng *r)
{
    return (rng_unit(r) + rng_unit(r) + rng_unit(r) + rng_unit(r) - 2.0) * 1.7320508;
}

static void fill(float *l, uint32_t n, enum dist d, struct rng *r)
{
    for (uint32_t i = 0; i < n; i++) {
        switch (d) {
        case DIST_FLAT: l[i] = (float)(rng_unit(r) * 2 - 1); break;
        case DIST_PEAKED:
        case DIST_HOLES: l[i] = (float)(3 * rng_normal(r)); break;
        case DIST_TIES: l[i] = (float)floor(rng_unit(r) * 9) * 0.5f - 2.0f; break;
        case DIST_WIDE: l[i] = (float)(rng_unit(r) * 60 - 30); break;
        case DIST_ALL_NEG_INF: l[i] = -INFINITY; break;
        case DIST_NAN: l[i] = NAN; break;
        case DIST_POS_INF: l[i] = (float)rng_normal(r); break;
        default: break;
        }
    }
    if (d == DIST_PEAKED || d == DIST_HOLES)
        for (int k = 0; k < 6; k++) /* a few tokens well above the rest */
            l[rng_next(r) % n] = (float)(12 + 4 * rng_unit(r));
    if (d == DIST_HOLES)
        for (uint32_t i = 0; i < n; i++) {
            uint64_t x = rng_next(r) % 100;
            l[i] = x < 30 ? -INFINITY : x < 33 ? NAN : l[i];
        }
    if (d == DIST_TIES && n > 3)
        l[n / 3] = l[n / 2] = l[n - 1] = 2.5f; /* tied maximum */
    if (d == DIST_NAN)
        l[n / 2] = -INFINITY;
    if (d == DIST_POS_INF) {
        l[(n * 2) / 3] = INFINITY;
        if (n > 2)
            l[n / 3 + 1] = INFINITY;
    }
}

/* ---- the reference: which tokens a boundary within EPS allows ---- */

struct ref {
    uint32_t n;
    float *v;      /* penalized logits, NaN as -inf */
    uint32_t *ord; /* ids in rank order */
    uint32_t *pos; /* rank position of each id */
    double *w;     /* scratch, per rank position */
};

static const struct ref *sort_ctx;

static int cmp_rank(const void *pa, const void *pb)
{
    uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
    float x = sort_ctx->v[a], y = sort_ctx->v[b];
    if (x != y)
        return x > y ? -1 : 1;
    return a < b ? -1 : a > b;
}

static void ref_build(struct ref *rf, const float *l, uint32_t n, const struct sampler_config *c,
                      const int32_t *win, size_t n_win)
{
    rf->n = n;
    rf->v = xmalloc(n * sizeof(float));
    rf->ord = xmalloc(n * sizeof(uint32_t));
    rf->pos = xmalloc(n * sizeof(uint32_t));
    rf->w = xmalloc(n * sizeof(double));
    for (uint32_t i = 0; i < n; i++)
        rf->v[i] = l[i] != l[i] ? -INFINITY : l[i];
    bool pen = (c->repeat_penalty != 0 && c->repeat_penalty != 1) || c->presence_penalty != 0;
    for (size_t j = 0; pen && j < n_win; j++) {
        int32_t id = win[j];
        if (id < 0 || (uint32_t)id >= n)
            continue;
        float v = l[id] != l[id] ? -INFINITY : l[id], r = c->repeat_penalty;
        if (r != 0 && r != 1)
            v = v <= 0 ? v * r : v / r;
        rf->v[id] = v - c->presence_penalty;
    }
    for (uint32_t i = 0; i < n; i++)
        rf->ord[i] = i;
    sort_ctx = rf;
    qsort(rf->ord, n, sizeof(uint32_t), cmp_rank);
    for (uint32_t i = 0; i < n; i++)
        rf->pos[rf->ord[i]] = i;
}

static void ref_free(struct ref *rf)
{
    free(rf->v);
    free(rf->ord);
    free(rf->pos);
    free(rf->w);
}

/* True when the draw at u over the kept rank prefix [0, end) (and min_p) may give token. */
static bool ref_draw_allows(const struct ref *rf, const struct sampler_config *c, bool rank_order,
                            uint32_t end, double u, int32_t token)
{
    float max = rf->v[rf->ord[0]], inv_t = 1.0f / c->temperature;
    float floor = c->min_p > 0 ? max + logf(c->min_p) : -INFINITY;
    double total = 0, cum = 0;
    for (uint32_t k = 0; k < rf->n; k++) {
        uint32_t id = rank_order ? rf->ord[k] : k;
        bool in = rf->pos[id] < end && rf->v[id] >= floor;
        rf->w[k] = in ? exp((double)((rf->v[id] - max) * inv_t)) : 0;
        total += rf->w[k];
    }
    double target = u * total, slack = EPS * total;
    for (uint32_t k = 0; k < rf->n; k++) {
        uint32_t id = rank_order ? rf->ord[k] : k;
        double next = cum + rf->w[k];
        if (rf->w[k] > 0 && cum < target + slack && next > target - slack && (int32_t)id == token)
            return true;
        cum = next;
    }
    return false;
}

/* True when token is one the boundaries within EPS allow for this draw. */
static bool ref_allows(const struct ref *rf, const struct sampler_config *c, double u,
                       int32_t token)
{
    float max = rf->v[rf->ord[0]];
    if (c->temperature == 0 || !isfinite(max) || token < 0 || (uint32_t)token >= rf->n)
        return false; /* greedy and degenerate rows must be exact */
    bool sorted = c->top_k > 0 && (uint32_t)c->top_k < rf->n;
    bool top_p = c->top_p > 0 && c->top_p < 1;
    uint32_t end = sorted ? (uint32_t)c->top_k : rf->n;
    if (!top_p)
        return ref_draw_allows(rf, c, sorted, end, u, token);
    double total = 0, cum = 0;
    for (uint32_t k = 0; k < end; k++)
        total += exp((double)(rf->v[rf->ord[k]] - max));
    double goal = c->top_p * (double)total, slack = EPS * total;
    for (uint32_t k = 0; k < end; k++) { /* every cutoff the slack allows */
        cum += exp((double)(rf->v[rf->ord[k]] - max));
        if (cum >= goal - slack && ref_draw_allows(rf, c, true, k + 1, u, token))
            return true;
        if (cum >= goal + slack)
            break;
    }
    return false;
}

/* ---- the comparison ---- */

struct dev {
    float *base, *logits; /* logits = base + an offset of 0 or 1 float */
    struct cuda_sample_params *params;
    int32_t *recent, *token;
    void *work;
};

static void dev_alloc(struct dev *d, uint32_t n, uint32_t off)
{
    CU(cudaMalloc((void **)&d->base, ((size_t)n + 1) * sizeof(float)));
    d->logits = d->base + off;
    CU(cudaMalloc((void **)&d->params, sizeof(*d->params)));
    CU(cudaMalloc((void **)&d->recent, WINDOW * sizeof(int32_t)));
    CU(cudaMalloc((void **)&d->token, sizeof(int32_t)));
    CU(cudaMalloc(&d->work, cuda_sample_work_bytes(n)));
}

static void dev_free(struct dev *d)
{
    CU(cudaFree(d->base));
    CU(cudaFree(d->params));
    CU(cudaFree(d->recent));
    CU(cudaFree(d->token));
    CU(cudaFree(d->work));
}

static struct cuda_sample_params params_of(const struct sampler_config *c)
{
    struct cuda_sample_params p = {
        .temperature = c->temperature, .top_k = c->top_k, .top_p = c->top_p, .min_p = c->min_p,
        .repeat_penalty = c->repeat_penalty, .presence_penalty = c->presence_penalty};
    int rc = cuda_sample_params_prepare(&p);
    CHECK(rc == 0, "cuda_sample_params_prepare rc %d", rc);
    return p;
}

/* The penalty window of s, padded with -1 and two ids cuda_sample must ignore, uploaded. */
static size_t upload_window(const struct dev *d, const struct sampler *s, uint32_t n,
                            int32_t *win)
{
    for (int i = 0; i < WINDOW; i++)
        win[i] = -1;
    size_t k = sampler_window(s, win, WINDOW - 2);
    CHECK(k <= WINDOW - 2, "window of %zu ids", k);
    win[WINDOW - 2] = (int32_t)n + 3;
    win[WINDOW - 1] = -5;
    CU(cudaMemcpy(d->recent, win, WINDOW * sizeof(int32_t), cudaMemcpyHostToDevice));
    return k;
}

/* One GPU sample at u; the token comes back (poisoned before the run). */
static int32_t gpu_sample(const struct dev *d, uint32_t n, struct cuda_sample_params *p, double u)
{
    p->uniform = u;
    CU(cudaMemcpy(d->params, p, sizeof(*p), cudaMemcpyHostToDevice));
    CU(cudaMemset(d->token, POISON, sizeof(int32_t)));
    int rc = cuda_sample(d->logits, n, d->params, d->recent, WINDOW, d->work, d->token, 0);
    CHECK(rc == 0, "cuda_sample rc %d", rc);
    int32_t t;
    CU(cudaMemcpy(&t, d->token, sizeof(t), cudaMemcpyDeviceToHost));
    return t;
}

struct tally {
    long runs, equal, tolerated;
};

static const struct sampler_config configs[] = {
    {.temperature = 0},
    {.temperature = 1.0f},
    {.temperature = 0.8f, .min_p = 0.05f},
    {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f},
    {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f},
    {.temperature = 1.0f, .top_k = 40},
    {.temperature = 0.5f, .top_k = 1},
    {.temperature = 1.5f, .top_k = 1000},
    {.temperature = 1.0f, .top_k = 5000, .top_p = 0.9f},
    {.temperature = 0.7f, .top_p = 0.95f},
    {.temperature = 1.0f, .top_p = 0.5f, .min_p = 0.1f},
    {.temperature = 2.0f, .top_p = 0.99f},
    {.temperature = 1.0f, .top_k = -1, .top_p = 0.9f},    /* top_k = n */
    {.temperature = 1.0f, .top_k = -2},                   /* top_k = n + 5 */
    {.temperature = 0, .repeat_penalty = 1.5f, .presence_penalty = 0.2f},
    {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.3f,
     .presence_penalty = 0.5f},
    {.temperature = 1.0f, .top_p = 0.9f, .repeat_penalty = 1.1f},
    {.temperature = 1.0f, .presence_penalty = 1.0f},
};
#define N_CONFIGS (sizeof(configs) / sizeof(configs[0]))

/* A window of 64 accepted ids: repeats, ids past n, and the best ids (so penalties bite). */
static void accept_window(struct sampler *a, struct sampler *b, const float *l, uint32_t n,
                          struct rng *r)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        best = l[i] > l[best] ? i : best;
    for (int i = 0; i < 64; i++) {
        int32_t id = i % 8 == 0 ? (int32_t)best : i % 8 == 1 ? (int32_t)(n + rng_next(r) % 50)
                                                          : (int32_t)(rng_next(r) % n);
        if (i % 8 == 2)
            id = (int32_t)(rng_next(r) % (n < 16 ? n : 16)); /* repeats among few ids */
        CHECK(sampler_accept(a, id) == 0 && sampler_accept(b, id) == 0, "accept");
    }
}

static void run_case(const struct dev *d, const float *l, uint32_t n, enum dist dist,
                     size_t ci, int draws, struct rng *r, struct tally *t)
{
    struct sampler_config c = configs[ci];
    if (c.top_k == -1)
        c.top_k = (int32_t)n;
    else if (c.top_k == -2)
        c.top_k = (int32_t)n + 5;
    c.seed = rng_next(r);
    struct sampler *a = sampler_create(&c), *b = sampler_create(&c);
    CHECK(a && b, "sampler_create");
    if (!a || !b)
        exit(1);
    bool pen = c.repeat_penalty != 0 || c.presence_penalty != 0;
    if (pen)
        accept_window(a, b, l, n, r);
    int32_t win[WINDOW];
    size_t n_win = upload_window(d, b, n, win);
    struct cuda_sample_params p = params_of(&c);
    struct ref rf = {0};
    for (int k = 0; k < draws; k++) {
        int32_t want = sampler_sample(a, l, (int32_t)n);
        double u = sampler_next_uniform(b);
        int32_t got = gpu_sample(d, n, &p, u);
        t->runs++;
        if (got == want) {
            t->equal++;
            continue;
        }
        if (!rf.v)
            ref_build(&rf, l, n, &c, win, n_win);
        bool ok = ref_allows(&rf, &c, u, got) && ref_allows(&rf, &c, u, want);
        t->tolerated += ok;
        CHECK(ok, "n %u, %s logits, config %zu (temp %g top_k %d top_p %g min_p %g repeat %g "
              "presence %g), draw %d, u %.17g: gpu %d, cpu %d", n, dist_name[dist], ci,
              (double)c.temperature, c.top_k, (double)c.top_p, (double)c.min_p,
              (double)c.repeat_penalty, (double)c.presence_penalty, k, u, got, want);
    }
    if (rf.v)
        ref_free(&rf);
    sampler_destroy(a);
    sampler_destroy(b);
}

static void test_against_cpu(struct rng *r)
{
    static const uint32_t sizes[] = {BIG, 1, 7, 100, 1031, 20000};
    struct tally t = {0};
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        uint32_t n = sizes[s];
        float *l = xmalloc(n * sizeof(float));
        struct dev d;
        dev_alloc(&d, n, n == 20000); /* misaligned logits once */
        for (int dist = 0; dist < N_DIST; dist++) {
            fill(l, n, (enum dist)dist, r);
            CU(cudaMemcpy(d.logits, l, n * sizeof(float), cudaMemcpyHostToDevice));
            for (size_t ci = 0; ci < N_CONFIGS; ci++)
                run_case(&d, l, n, (enum dist)dist, ci, n == BIG ? 12 : 24, r, &t);
            float *back = xmalloc(n * sizeof(float));
            CU(cudaMemcpy(back, d.logits, n * sizeof(float), cudaMemcpyDeviceToHost));
            CHECK(!memcmp(back, l, n * sizeof(float)), "logits modified (n %u, %s)", n,
                  dist_name[dist]);
            free(back);
        }
        dev_free(&d);
        free(l);
    }
    MEASURE("cuda_sample vs sampler_sample: %ld draws, %ld equal, %ld differ at a boundary "
            "within %g of the total weight", t.runs, t.equal, t.tolerated, EPS);
    CHECK(t.tolerated * 100 <= t.runs, "%ld of %ld draws differ (boundary cases should be rare)",
          t.tolerated, t.runs);
}

/* The launch captured once in a graph, replayed with a new uniform number each time. */
static void test_graph(struct rng *r)
{
    const uint32_t n = BIG;
    float *l = xmalloc(n * sizeof(float));
    fill(l, n, DIST_PEAKED, r);
    struct dev d;
    dev_alloc(&d, n, 0);
    CU(cudaMemcpy(d.logits, l, n * sizeof(float), cudaMemcpyHostToDevice));
    struct sampler_config c = {.temperature = 1.2f, .top_k = 200, .top_p = 0.98f, .seed = 5};
    struct sampler *a = sampler_create(&c), *b = sampler_create(&c);
    int32_t win[WINDOW];
    upload_window(&d, b, n, win);
    struct cuda_sample_params p = params_of(&c);
    cudaStream_t st;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    int rc = cuda_sample(d.logits, n, d.params, d.recent, WINDOW, d.work, d.token, st);
    CU(cudaStreamEndCapture(st, &g));
    CHECK(rc == 0, "cuda_sample in capture rc %d", rc);
    CU(cudaGraphInstantiate(&ge, g, 0));
    int equal = 0, distinct = 0;
    int32_t last = -1;
    for (int k = 0; k < 40; k++) {
        int32_t want = sampler_sample(a, l, (int32_t)n), got;
        p.uniform = sampler_next_uniform(b);
        CU(cudaMemcpyAsync(d.params, &p, sizeof(p), cudaMemcpyHostToDevice, st));
        CU(cudaMemsetAsync(d.token, POISON, sizeof(int32_t), st));
        CU(cudaGraphLaunch(ge, st));
        CU(cudaMemcpyAsync(&got, d.token, sizeof(got), cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
        equal += got == want;
        distinct += got != last;
        last = got;
    }
    MEASURE("graph replays: %d of 40 equal to the CPU, %d changes of token", equal, distinct);
    CHECK(equal >= 39 && distinct > 5, "graph: %d of 40 equal, %d changes", equal, distinct);
    CU(cudaGraphExecDestroy(ge));
    CU(cudaGraphDestroy(g));
    CU(cudaStreamDestroy(st));
    sampler_destroy(a);
    sampler_destroy(b);
    dev_free(&d);
    free(l);
}

static void test_bad_args(void)
{
    struct dev d;
    dev_alloc(&d, 16, 0);
    CHECK(cuda_sample(NULL, 16, d.params, NULL, 0, d.work, d.token, 0) == -EINVAL, "NULL logits");
    CHECK(cuda_sample(d.logits, 0, d.params, NULL, 0, d.work, d.token, 0) == -EINVAL, "n 0");
    CHECK(cuda_sample(d.logits, CUDA_SAMPLE_MAX_VOCAB + 1, d.params, NULL, 0, d.work, d.token,
                      0) == -EINVAL, "n too large");
    CHECK(cuda_sample(d.logits, 16, d.params, NULL, 3, d.work, d.token, 0) == -EINVAL,
          "recent NULL with a count");
    CHECK(cuda_sample(d.logits, 16, d.params, NULL, 0, (char *)d.work + 4, d.token, 0) ==
          -EINVAL, "misaligned work");
    CHECK(cuda_sample(d.logits, 16, NULL, NULL, 0, d.work, d.token, 0) == -EINVAL, "no params");
    struct cuda_sample_params bad[] = {{.temperature = -1}, {.temperature = NAN}, {.top_k = -1},
                                       {.top_p = 1.5f}, {.min_p = -0.5f}, {.repeat_penalty = -1},
                                       {.presence_penalty = INFINITY}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(cuda_sample_params_prepare(&bad[i]) == -EINVAL, "bad params %zu accepted", i);
    CU(cudaGetLastError());
    dev_free(&d);
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median us of 50 launches (after 5) of cuda_sample, or cuda_argmax when argmax. */
static float time_us(const struct dev *d, uint32_t n, const struct sampler_config *c, bool argmax)
{
    struct cuda_sample_params p = params_of(c);
    p.uniform = 0.37;
    CU(cudaMemcpy(d->params, &p, sizeof(p), cudaMemcpyHostToDevice));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float ms[55];
    for (int i = 0; i < 55; i++) {
        CU(cudaEventRecord(e0, 0));
        int rc = argmax ? cuda_argmax(d->logits, n, 1, d->token, 0)
                        : cuda_sample(d->logits, n, d->params, d->recent, WINDOW, d->work,
                                      d->token, 0);
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        CU(cudaEventElapsedTime(&ms[i], e0, e1));
        CHECK(rc == 0, "timed launch rc %d", rc);
    }
    qsort(ms + 5, 50, sizeof(float), cmp_float);
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    return (ms[29] + ms[30]) / 2 * 1000;
}

static void test_timing(struct rng *r)
{
    const uint32_t n = BIG;
    float *l = xmalloc(n * sizeof(float));
    struct dev d;
    dev_alloc(&d, n, 0);
    int32_t win[WINDOW];
    for (int i = 0; i < WINDOW; i++)
        win[i] = i < 64 ? (int32_t)(rng_next(r) % n) : -1;
    CU(cudaMemcpy(d.recent, win, sizeof(win), cudaMemcpyHostToDevice));
    static const struct {
        enum dist dist;
        struct sampler_config c;
        bool argmax;
        const char *what;
    } cases[] = {
        {DIST_PEAKED, {.temperature = 0}, true, "cuda_argmax (for comparison)"},
        {DIST_PEAKED, {.temperature = 0}, false, "greedy"},
        {DIST_PEAKED, {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f}, false,
         "top_k 40, top_p 0.95, temp 0.8"},
        {DIST_PEAKED, {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f,
                       .repeat_penalty = 1.1f}, false, "llama.cpp chain, repeat 1.1 over 64"},
        {DIST_PEAKED, {.temperature = 0.8f, .top_p = 0.95f}, false, "top_p 0.95 alone"},
        {DIST_FLAT, {.temperature = 0.8f, .top_p = 0.95f}, false,
         "top_p 0.95 alone, flat logits"},
        {DIST_PEAKED, {.temperature = 1.0f}, false, "temperature 1 alone"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        fill(l, n, cases[i].dist, r);
        CU(cudaMemcpy(d.logits, l, n * sizeof(float), cudaMemcpyHostToDevice));
        float us = time_us(&d, n, &cases[i].c, cases[i].argmax);
        MEASURE("sample %u logits (%s), %s: %.1f us", n, dist_name[cases[i].dist],
                cases[i].what, (double)us);
    }
    dev_free(&d);
    free(l);
}

int main(void)
{
    log_init("test", -1);
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_sample_cuda: no CUDA device present (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 1;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("test_sample_cuda: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    struct rng r = {0x5A3B1E5EEDull};
    test_against_cpu(&r);
    test_graph(&r);
    test_bad_args();
    test_timing(&r);
    CU(cudaGetLastError());
    return test_main_result("test_sample_cuda");
}
