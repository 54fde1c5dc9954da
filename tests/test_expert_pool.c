/*
 * test_expert_pool: the coordinator's CPU expert fallback on a synthetic
 * qwen3next tiny model (synth_write, Q8_0, in /tmp).
 *
 *   - requests another process could send wrong are refused with -EINVAL and
 *     a message, and leave Y untouched: layer >= n_layer, more groups than
 *     experts, an expert id >= n_expert, ids unsorted or repeated, a group of
 *     zero rows, more rows than max_rows;
 *   - valid requests (1..8 groups of 1..5 rows, every layer) equal
 *     expert_exec_run on the same groups bit for bit, from the model's
 *     tensors and from a refs table pointing at copies of them (as the shm
 *     segment is; a NULL layer entry falls back to the model), and a table
 *     that points expert e at e+1's weights is what the pool computes; a
 *     request of max_rows rows, and one of no groups, are accepted;
 *   - rows and busy time count valid requests only.
 */
#include "coordinator/expert_pool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"

#define EP_MAX_ROWS 24

struct ep_model {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
};

static int ep_open(struct ep_model *em)
{
    snprintf(em->path, sizeof(em->path), "/tmp/test_expert_pool_%d.gguf", (int)getpid());
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 8, .path = em->path, .threads = 1};
    if (synth_write(&sc))
        return -1;
    struct gguf_config gc = {.path = em->path};
    em->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = em->g};
    em->m = em->g ? arch_load(&ac) : NULL;
    return em->m ? 0 : -1;
}

static void ep_close(struct ep_model *em)
{
    arch_free(em->m);
    gguf_close(em->g);
    unlink(em->path);
}

/* A request as the wire delivers it. */
struct ep_req {
    const char *name;
    uint32_t layer;
    uint32_t n_groups;
    uint32_t experts[10];
    uint32_t counts[10];
};

static const struct ep_req ep_bad[] = {
    {"layer out of range", 4, 1, {0}, {1}},
    {"layer far out of range", 0xffffffffu, 1, {0}, {1}},
    {"more groups than experts", 0, 9, {0, 1, 2, 3, 4, 5, 6, 7, 7}, {1, 1, 1, 1, 1, 1, 1, 1, 1}},
    {"expert id = n_expert", 1, 2, {3, 8}, {1, 1}},
    {"expert id huge", 1, 1, {0x80000000u}, {1}},
    {"unsorted ids", 2, 3, {1, 5, 4}, {1, 2, 1}},
    {"duplicate ids", 2, 3, {1, 4, 4}, {1, 2, 1}},
    {"zero rows", 3, 3, {0, 2, 6}, {2, 0, 1}},
    {"first group zero rows", 3, 2, {0, 2}, {0, 1}},
    {"too many rows", 0, 3, {1, 2, 3}, {10, 10, 5}},
    {"row count overflow", 0, 2, {1, 2}, {0x80000000u, 0x80000000u}},
};

static const struct ep_req ep_good[] = {
    {"one row", 0, 1, {5}, {1}},
    {"one group of 5", 1, 1, {0}, {5}},
    {"five groups", 2, 5, {0, 1, 3, 6, 7}, {1, 2, 3, 4, 5}},
    {"all experts", 3, 8, {0, 1, 2, 3, 4, 5, 6, 7}, {3, 1, 4, 1, 5, 2, 6, 2}},
    {"last expert", 3, 1, {7}, {2}},
};

static uint64_t ep_rng = 4242;

static float ep_uniform(void)
{
    uint64_t z = (ep_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void ep_rejects(struct expert_pool *p, const struct arch_model *m)
{
    const size_t n = m->hp.n_embd;
    float *X = calloc(64 * n, sizeof(float)), *Y = malloc(64 * n * sizeof(float));
    for (size_t i = 0; i < 64 * n; i++)
        Y[i] = 777.0f;
    const uint64_t rows0 = expert_pool_rows(p);
    for (size_t i = 0; i < sizeof(ep_bad) / sizeof(ep_bad[0]); i++) {
        const struct ep_req *r = &ep_bad[i];
        int rc = expert_pool_run(p, r->layer, r->experts, r->counts, r->n_groups, X, Y);
        CHECK(rc == -EINVAL, "%s: rc %d, want -EINVAL", r->name, rc);
        CHECK(strstr(log_last_error(), "expert request") != NULL, "%s: message '%s'", r->name,
              log_last_error());
        int touched = 0;
        for (size_t k = 0; k < 64 * n; k++)
            touched += Y[k] != 777.0f;
        CHECK(touched == 0, "%s: %d outputs written", r->name, touched);
    }
    CHECK(expert_pool_rows(p) == rows0, "rejected requests counted as rows");
    free(X);
    free(Y);
}

static void ep_valid(struct expert_pool *p, const struct arch_model *m, struct expert_exec *xx,
                     const char *what)
{
    const size_t n = m->hp.n_embd;
    int exact = 0;
    const int n_good = (int)(sizeof(ep_good) / sizeof(ep_good[0]));
    for (int i = 0; i < n_good; i++) {
        const struct ep_req *r = &ep_good[i];
        uint32_t rows = 0;
        struct expert_ref er[10];
        for (uint32_t g = 0; g < r->n_groups; g++) {
            rows += r->counts[g];
            er[g] = expert_exec_model_ref(&m->layers[r->layer], r->experts[g]);
        }
        float *X = malloc(rows * n * sizeof(float)), *Y = malloc(rows * n * sizeof(float));
        float *R = malloc(rows * n * sizeof(float));
        for (size_t k = 0; k < rows * n; k++)
            X[k] = ep_uniform();
        const uint64_t before = expert_pool_rows(p);
        CHECK(expert_pool_run(p, r->layer, r->experts, r->counts, r->n_groups, X, Y) == 0,
              "%s %s: refused: %s", what, r->name, log_last_error());
        CHECK(expert_pool_rows(p) == before + rows, "%s %s: rows counted %llu", what, r->name,
              (unsigned long long)(expert_pool_rows(p) - before));
        CHECK(expert_exec_run(xx, &m->layers[r->layer], er, r->counts, r->n_groups, X, R) == 0,
              "reference run");
        bool same = memcmp(Y, R, rows * n * sizeof(float)) == 0;
        CHECK(same, "%s %s: differs from expert_exec", what, r->name);
        exact += same;
        free(X);
        free(Y);
        free(R);
    }
    MEASURE("%s: %d of %d valid requests bit-identical to expert_exec_run", what, exact, n_good);
}

int main(void)
{
    log_init("test", -1);
    struct ep_model em = {0};
    CHECK(ep_open(&em) == 0, "tiny model: %s", log_last_error());
    if (!em.m) {
        ep_close(&em);
        return test_main_result("test_expert_pool");
    }
    const struct arch_model *m = em.m;
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    struct threadpool_config tc = {.n_threads = 1, .pin = false};
    struct threadpool *rp = threadpool_create(&tc);
    struct expert_exec_config xc = {.pool = rp, .n_embd = m->hp.n_embd, .n_ff = m->hp.n_ff_exp,
                                    .max_rows = 64};
    struct expert_exec *xx = expert_exec_create(&xc);

    struct expert_pool_config pc = {.model = m, .n_threads = 2, .max_rows = EP_MAX_ROWS};
    struct expert_pool *p = expert_pool_create(&pc);
    CHECK(p != NULL, "expert_pool_create");
    if (p && xx) {
        CHECK(expert_pool_rows(p) == 0 && expert_pool_busy_s(p) == 0.0, "fresh counters");
        ep_valid(p, m, xx, "model tensors");
        ep_rejects(p, m);
        /* exactly max_rows */
        uint32_t ex[3] = {1, 2, 3}, cnt[3] = {10, 10, 4};
        float *X = calloc(EP_MAX_ROWS * m->hp.n_embd, sizeof(float));
        float *Y = malloc(EP_MAX_ROWS * m->hp.n_embd * sizeof(float));
        CHECK(expert_pool_run(p, 0, ex, cnt, 3, X, Y) == 0, "max_rows request refused");
        /* no groups: nothing to do */
        CHECK(expert_pool_run(p, 0, ex, cnt, 0, X, Y) == 0, "empty request refused");
        free(X);
        free(Y);
        CHECK(expert_pool_busy_s(p) > 0.0 && expert_pool_busy_s(p) < 10.0, "busy %g s",
              expert_pool_busy_s(p));
        MEASURE("pool: %llu rows in %.3f ms busy", (unsigned long long)expert_pool_rows(p),
                expert_pool_busy_s(p) * 1e3);
    }
    expert_pool_destroy(p);
    expert_pool_destroy(NULL);

    /* a refs table pointing at copies of the weights (the shm segment) */
    struct expert_ref *tab = calloc((size_t)L * E, sizeof(*tab));
    const struct expert_ref *refs[16];
    uint8_t *copy = NULL;
    size_t per = 0;
    for (uint32_t l = 0; l < L; l++)
        per += E * (2 * m->layers[l].gate_exps.mat_bytes + m->layers[l].down_exps.mat_bytes);
    copy = malloc(per);
    uint8_t *q = copy;
    for (uint32_t l = 0; l < L; l++) {
        const struct arch_layer *ly = &m->layers[l];
        const size_t gb = ly->gate_exps.mat_bytes, db = ly->down_exps.mat_bytes;
        for (uint32_t e = 0; e < E; e++) {
            struct expert_ref mr = expert_exec_model_ref(ly, e);
            tab[l * E + e] = (struct expert_ref){.gate = memcpy(q, mr.gate, gb),
                                                 .up = memcpy(q + gb, mr.up, gb),
                                                 .down = memcpy(q + 2 * gb, mr.down, db)};
            q += 2 * gb + db;
        }
        refs[l] = l == 2 ? NULL : tab + l * E; /* a NULL layer entry: the model's own */
    }
    pc.refs = refs;
    p = expert_pool_create(&pc);
    CHECK(p != NULL, "expert_pool_create with refs");
    if (p && xx)
        ep_valid(p, m, xx, "copied refs");
    expert_pool_destroy(p);
    /* the table is what the pool reads: expert e of layer 0 at e+1's weights */
    struct expert_ref shifted[16];
    for (uint32_t e = 0; e < E; e++)
        shifted[e] = tab[(e + 1) % E];
    refs[0] = shifted;
    p = expert_pool_create(&pc);
    if (p && xx) {
        const size_t n = m->hp.n_embd;
        float *X = malloc(2 * n * sizeof(float)), *Y = malloc(2 * n * sizeof(float));
        float *R = malloc(2 * n * sizeof(float));
        for (size_t k = 0; k < 2 * n; k++)
            X[k] = ep_uniform();
        const uint32_t e5 = 5, e6 = 6, two = 2;
        struct expert_ref r6 = expert_exec_model_ref(&m->layers[0], 6);
        CHECK(expert_pool_run(p, 0, &e5, &two, 1, X, Y) == 0, "shifted run");
        CHECK(expert_exec_run(xx, &m->layers[0], &r6, &two, 1, X, R) == 0, "reference run");
        CHECK(memcmp(Y, R, 2 * n * sizeof(float)) == 0,
              "expert 5 through the shifted table is not expert 6's output");
        CHECK(expert_pool_run(p, 0, &e6, &two, 1, X, Y) == 0 &&
                  memcmp(Y, R, 2 * n * sizeof(float)) != 0, "refs table ignored");
        free(X);
        free(Y);
        free(R);
    }
    expert_pool_destroy(p);
    free(copy);
    free(tab);
    expert_exec_destroy(xx);
    threadpool_destroy(rp);
    ep_close(&em);
    return test_main_result("test_expert_pool");
}
