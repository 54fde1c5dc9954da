/*
 * engine: a model plus the in-process forward or the cluster (see engine.h).
 */
#include "coordinator/engine.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "coordinator/planner.h"
#include "kernels/cpu/threadpool.h"
#include "worker/backend.h"
#include "worker/forward.h"

struct engine {
    struct engine_config cfg;
    struct gguf *g;
    struct arch_model *m;
    struct threadpool *pool;
    struct forward *fw;        /* every layer here (inproc), or only the embedding */
    struct forward_seq *seq;   /* inproc only */
    struct cluster *cl;        /* workers, or NULL */
    struct backend *be;        /* in-process backend (--inproc --backend), or NULL */
    uint32_t pos;
    uint32_t B;
    float *h;                  /* B rows of n_embd */
    int32_t *window;           /* cluster: CLUSTER_WINDOW_MAX penalty ids for a sampling step */
    uint64_t *heat;            /* cfg.record_heat: n_layer x n_expert routing counts */
    uint64_t heat_tokens;      /* tokens those counts come from */
};

static int engine_build(struct engine *e)
{
    const struct engine_config *cfg = &e->cfg;
    struct threadpool_config pc = {.n_threads = cfg->n_threads, .pin = true};
    e->pool = threadpool_create(&pc);
    if (!e->pool)
        return -ENOMEM;
    struct forward_config fc = {.model = e->m, .pool = e->pool, .n_ctx = cfg->n_ctx,
                                .kv_f16 = cfg->kv_f16, .max_batch = e->B};
    if (cfg->cluster || cfg->backend) /* only embeds here: a one-layer range keeps it small */
        fc.layer_end = 1;
    if (cfg->record_heat) {
        if (cfg->cluster || cfg->backend) {
            log_error("--record-heat counts the routing of the in-process CPU engine: run with "
                      "--inproc and without --backend");
            return -EINVAL;
        }
        e->heat = calloc((size_t)e->m->hp.n_layer * e->m->hp.n_expert, sizeof(uint64_t));
        if (!e->heat)
            return -ENOMEM;
        fc.heat = e->heat;
    }
    e->fw = forward_create(&fc);
    if (!e->fw)
        return -ENOMEM;
    e->h = malloc((size_t)e->B * e->m->hp.n_embd * sizeof(float));
    if (!e->h)
        return -ENOMEM;
    if (!cfg->cluster && cfg->backend) {
        const char *kind = cfg->backend;
        if (!strncmp(kind, "cuda:", 5)) {
            setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1);
            setenv("LAMINA_CUDA_DEVICE", kind + 5, 1);
            kind = "cuda";
        }
        struct backend_config bc = {.model = e->m, .layer_begin = 0,
                                    .layer_end = e->m->hp.n_layer, .n_threads = cfg->n_threads,
                                    .n_ctx = forward_n_ctx(e->fw), .kv_f16 = cfg->kv_f16,
                                    .max_batch = e->B, .lmhead = true,
                                    .fail = getenv("LAMINA_FAIL")};
        const char *st = getenv("LAMINA_CUDA_STAGE_TIMES"); /* as a worker reads it */
        bc.stage_times = st && !strcmp(st, "1");
        e->be = backend_create(kind, &bc);
        return e->be ? 0 : -EIO;
    }
    if (!cfg->cluster) {
        e->seq = forward_seq_create(e->fw);
        return e->seq ? 0 : -ENOMEM;
    }
    struct cluster_config *cc = cfg->cluster;
    cc->model_path = cfg->model_path;
    cc->gguf = e->g;
    cc->model = e->m;
    cc->n_ctx = forward_n_ctx(e->fw);
    cc->kv_f16 = cfg->kv_f16;
    cc->max_batch = e->B;
    e->window = malloc(CLUSTER_WINDOW_MAX * sizeof(*e->window));
    if (!e->window)
        return -ENOMEM;
    e->cl = cluster_create(cc);
    if (!e->cl)
        return -EIO;
    if (cfg->on_cluster)
        cfg->on_cluster(e->cl);
    return 0;
}

struct engine *engine_create(const struct engine_config *cfg)
{
    struct engine *e = calloc(1, sizeof(*e));
    if (!e)
        return NULL;
    e->cfg = *cfg;
    e->B = cfg->n_batch ? cfg->n_batch : 256;
    struct gguf_config gc = {.path = cfg->model_path};
    e->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = e->g};
    e->m = e->g ? arch_load(&ac) : NULL;
    if (!e->m)
        goto out_fail;
    gguf_prefault(e->g, cfg->progress);
    if (engine_build(e))
        goto out_fail;
    return e;
out_fail:
    engine_destroy(e);
    return NULL;
}

float *engine_alloc_logits(struct engine *e, size_t rows)
{
    const size_t nv = e->m->hp.n_vocab;
    if (rows && nv > SIZE_MAX / sizeof(float) / rows)
        return NULL;
    return backend_host_alloc(e->be, rows * nv * sizeof(float));
}

void engine_free_logits(struct engine *e, float *p)
{
    backend_host_free(e->be, p);
}

void engine_destroy(struct engine *e)
{
    if (!e)
        return;
    if (e->cl && e->cfg.on_cluster)
        e->cfg.on_cluster(NULL);
    cluster_destroy(e->cl);
    backend_destroy(e->be);
    forward_seq_destroy(e->seq);
    forward_destroy(e->fw);
    threadpool_destroy(e->pool);
    free(e->h);
    free(e->window);
    free(e->heat);
    arch_free(e->m);
    gguf_close(e->g);
    free(e);
}

int engine_save_heat(struct engine *e)
{
    if (!e->heat)
        return 0;
    const struct planner_heat h = {.n_layer = e->m->hp.n_layer, .n_expert = e->m->hp.n_expert,
                                   .tokens = e->heat_tokens, .counts = e->heat};
    int rc = planner_heat_save(e->cfg.record_heat, &h, "recorded");
    if (!rc)
        log_info("routing counts of %llu tokens x %u layers x %u experts written to %s",
                 (unsigned long long)e->heat_tokens, h.n_layer, h.n_expert, e->cfg.record_heat);
    return rc;
}

const struct gguf *engine_gguf(const struct engine *e)
{
    return e->g;
}

const struct arch_model *engine_model(const struct engine *e)
{
    return e->m;
}

uint32_t engine_n_ctx(const struct engine *e)
{
    return forward_n_ctx(e->fw);
}

uint32_t engine_pos(const struct engine *e)
{
    return e->pos;
}

int engine_n_threads(const struct engine *e)
{
    return threadpool_n_threads(e->pool);
}

/* One pass of at most B tokens. */
static int engine_pass(struct engine *e, const int32_t *ids, uint32_t c, bool all, bool last,
                       float *out)
{
    const size_t w = e->m->hp.n_embd;
    int rc = forward_embed(e->fw, ids, c, e->h);
    if (rc)
        return rc;
    if (e->cl)
        return cluster_step(e->cl, e->h, c, e->pos, all, out);
    if (e->be) {
        if (last && !all) /* the head right after the layers, on the device */
            return backend_layers_head(e->be, e->h, c, out, NULL);
        rc = backend_layers(e->be, e->h, c);
        if (rc || (!all && !last))
            return rc;
        return backend_logits(e->be, all ? e->h : e->h + (size_t)(c - 1) * w, all ? c : 1, out);
    }
    rc = forward_layers(e->fw, e->seq, e->h, c);
    if (rc || (!all && !last))
        return rc;
    return forward_logits(e->fw, all ? e->h : e->h + (size_t)(c - 1) * w, all ? c : 1, out);
}

int engine_eval(struct engine *e, const int32_t *ids, uint32_t n, bool all, float *out)
{
    const size_t nv = e->m->hp.n_vocab;
    if (n == 0 || (uint64_t)e->pos + n > engine_n_ctx(e)) {
        log_error("context full: %u tokens at position %u exceed the context of %u", n, e->pos,
                  engine_n_ctx(e));
        return -ENOSPC;
    }
    int rc = 0;
    for (uint32_t s = 0; s < n && !rc; s += e->B) {
        const uint32_t c = n - s < e->B ? n - s : e->B;
        rc = engine_pass(e, ids + s, c, all, s + c == n, all ? out + (size_t)s * nv : out);
        e->pos += rc ? 0 : c;
        e->heat_tokens += rc || !e->heat ? 0 : c;
    }
    return rc;
}

int engine_eval_sample(struct engine *e, const int32_t *ids, uint32_t n, struct sampler *s,
                       float *logits, int32_t *token)
{
    const uint32_t last = n > e->B ? (n - 1) / e->B * e->B : 0; /* the last pass's first id */
    size_t n_window = 0;
    bool here = !e->cl || e->cfg.cluster->coordinator_samples;
    if (!here && sampler_penalizes(s)) {
        n_window = sampler_window(s, e->window, CLUSTER_WINDOW_MAX);
        here = n_window > CLUSTER_WINDOW_MAX;
    }
    if (here || n == 0) {
        int rc = engine_eval(e, ids, n, false, logits);
        if (rc)
            return rc;
        int32_t id = sampler_sample(s, logits, (int32_t)e->m->hp.n_vocab);
        if (id < 0)
            return id;
        *token = id;
        return 0;
    }
    if ((uint64_t)e->pos + n > engine_n_ctx(e))
        return engine_eval(e, ids, n, false, logits); /* logs -ENOSPC */
    int rc = last ? engine_eval(e, ids, last, false, logits) : 0; /* passes before the last */
    if (rc)
        return rc;
    const uint32_t c = n - last;
    rc = forward_embed(e->fw, ids + last, c, e->h);
    if (rc)
        return rc;
    /* drawn only now that the step will run, as sampler_sample() draws once per pick */
    const struct cluster_sample cs = {.cfg = *sampler_get_config(s),
                                      .uniform = sampler_next_uniform(s),
                                      .window = e->window, .n_window = n_window};
    rc = cluster_step_sample(e->cl, e->h, c, e->pos, &cs, token);
    e->pos += rc ? 0 : c;
    return rc;
}

bool engine_kv_f16(const struct engine *e)
{
    return e->cfg.kv_f16;
}

size_t engine_state_bytes(const struct engine *e, uint32_t pos)
{
    return forward_state_bytes(e->m, 0, e->m->hp.n_layer, pos, e->cfg.kv_f16);
}

int engine_state_save(struct engine *e, void **blob, size_t *bytes)
{
    if (e->cl) {
        uint32_t pos;
        int rc = cluster_state_save(e->cl, 0, blob, bytes, &pos);
        if (!rc && pos != e->pos) {
            log_error("the workers' snapshot is at %u tokens, the sequence at %u", pos, e->pos);
            free(*blob);
            return -EPROTO;
        }
        return rc;
    }
    const size_t n = engine_state_bytes(e, e->pos);
    void *p = malloc(n ? n : 1);
    if (!p) {
        log_error("no memory for a sequence snapshot of %zu bytes", n);
        return -ENOMEM;
    }
    int rc = 0;
    if (e->be)
        rc = backend_state_save(e->be, p);
    else
        forward_seq_save(e->seq, p);
    if (rc) {
        free(p);
        return rc;
    }
    *blob = p, *bytes = n;
    return 0;
}

int engine_state_load(struct engine *e, const void *blob, size_t bytes, uint32_t pos)
{
    const size_t want = engine_state_bytes(e, pos);
    if (bytes != want) {
        log_error("sequence snapshot refused: %zu bytes, the model's layers take %zu at %u "
                  "tokens", bytes, want, pos);
        return -EINVAL;
    }
    if (pos > engine_n_ctx(e)) {
        log_error("sequence snapshot of %u tokens refused: the context holds %u", pos,
                  engine_n_ctx(e));
        return -ENOSPC;
    }
    int rc;
    if (e->cl)
        rc = cluster_state_load(e->cl, 0, blob, bytes, pos);
    else if (e->be)
        rc = backend_state_load(e->be, blob, bytes, pos);
    else
        rc = forward_seq_load(e->seq, blob, pos);
    if (!rc)
        e->pos = pos;
    return rc;
}

int engine_reset(struct engine *e)
{
    e->pos = 0;
    if (e->cl)
        return cluster_reset(e->cl);
    if (e->be) {
        backend_reset(e->be);
        return 0;
    }
    forward_seq_reset(e->seq);
    return 0;
}

void engine_print_summary(const struct engine *e, FILE *out)
{
    if (e->cl) {
        cluster_print_summary(e->cl, out);
        return;
    }
    const struct forward_stats *st = e->be ? backend_stats(e->be) : forward_get_stats(e->fw);
    double tot = st->attn + st->deltanet + st->router + st->experts + st->shared_expert;
    if (tot > 0)
        fprintf(out, "stages: attention %.0f%%, deltanet %.0f%%, router %.0f%%, routed experts "
                     "%.0f%%, shared expert %.0f%%\n", 100 * st->attn / tot,
                100 * st->deltanet / tot, 100 * st->router / tot, 100 * st->experts / tot,
                100 * st->shared_expert / tot);
    else if (e->be)
        fprintf(out, "stages: not timed (a CUDA backend times its stages with events when "
                     "LAMINA_CUDA_STAGE_TIMES=1, about 1 %% slower)\n");
}
