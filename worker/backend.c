/*
 * backend: kind lookup, failure injection and dispatch (see backend.h).
 */
#include "worker/backend.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"

extern const struct backend_ops backend_cpu_ops;
#ifdef LAMINA_CUDA
extern const struct backend_ops backend_cuda_ops;
#endif

struct backend_fail {
    char kind[8];   /* "step", "hang", "crash", "late" or "" */
    uint64_t at;    /* 1-based layers() call */
};

static struct backend_fail backend_parse_fail(const char *spec)
{
    struct backend_fail f = {0};
    if (!spec || !*spec)
        return f;
    unsigned long long at;
    char kind[8];
    if (sscanf(spec, "%7[a-z]:%llu", kind, &at) == 2 &&
        (!strcmp(kind, "step") || !strcmp(kind, "hang") || !strcmp(kind, "crash") ||
         !strcmp(kind, "late"))) {
        snprintf(f.kind, sizeof(f.kind), "%s", kind);
        f.at = at;
    } else {
        log_warn("ignoring failure injection spec '%s' (expected step:N, hang:N, crash:N or "
                 "late:N)", spec);
    }
    return f;
}

struct backend_holder {
    struct backend b;
    struct backend_fail fail;
};

struct backend *backend_create(const char *kind, const struct backend_config *cfg)
{
    const struct backend_ops *ops = NULL;
    if (!strcmp(kind, "cpu"))
        ops = &backend_cpu_ops;
#ifdef LAMINA_CUDA
    if (!strcmp(kind, "cuda"))
        ops = &backend_cuda_ops;
    const char *available = "cpu, cuda";
#else
    const char *available = "cpu";
#endif
    if (!ops) {
        log_error("backend '%s' is not available in this build (available: %s)", kind, available);
        return NULL;
    }
    struct backend_holder *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    h->b.ops = ops;
    h->fail = backend_parse_fail(cfg->fail);
    h->b.n_seq = cfg->n_seq ? cfg->n_seq : 1;
    bool foreign = false;
    for (uint32_t l = 0; cfg->foreign && l < cfg->model->hp.n_layer; l++)
        foreign |= cfg->foreign[l] != NULL;
    if (foreign && !ops->serve) {
        log_error("backend '%s' cannot hold experts of other workers' layers "
                  "(--experts-home any)", kind);
        free(h);
        return NULL;
    }
    h->b.foreign = foreign ? cfg->foreign : NULL;
    h->b.n_layer = cfg->model->hp.n_layer;
    h->b.n_expert = cfg->model->hp.n_expert;
    h->b.model = cfg->model;
    h->b.l0 = cfg->layer_begin, h->b.l1 = cfg->layer_end;
    h->b.n_ctx = cfg->n_ctx ? cfg->n_ctx : 4096, h->b.kv_f16 = cfg->kv_f16; /* the backends' default */
    if (ops->init(&h->b, cfg)) {
        free(h);
        return NULL;
    }
    return &h->b;
}

void backend_destroy(struct backend *b)
{
    if (!b)
        return;
    b->ops->fini(b);
    free(b);
}

int backend_use_seq(struct backend *b, uint32_t seq)
{
    if (seq >= b->n_seq) {
        log_error("sequence %u refused: this backend has %u sequence slot%s (0-%u)", seq,
                  b->n_seq, b->n_seq == 1 ? "" : "s", b->n_seq - 1);
        return -EINVAL;
    }
    if (seq != b->seq)
        b->ops->use_seq(b, seq);
    b->seq = seq;
    return 0;
}

void backend_reset(struct backend *b)
{
    const uint32_t cur = b->seq;
    for (uint32_t s = 0; s < b->n_seq; s++) {
        backend_use_seq(b, s);
        b->ops->reset(b);
    }
    backend_use_seq(b, cur);
}

int backend_reset_seq(struct backend *b, uint32_t seq)
{
    const uint32_t cur = b->seq;
    int rc = backend_use_seq(b, seq);
    if (rc)
        return rc;
    b->ops->reset(b);
    return backend_use_seq(b, cur);
}

/* Failure injection (cfg->fail) for the layers call now counted: 0 or -EIO. */
static int backend_inject(struct backend *b)
{
    const struct backend_fail *f = &((struct backend_holder *)b)->fail;
    b->calls++;
    if (f->at && b->calls == f->at && strcmp(f->kind, "late")) {
        if (!strcmp(f->kind, "step")) {
            log_error("injected failure at step %llu", (unsigned long long)b->calls);
            return -EIO;
        }
        if (!strcmp(f->kind, "hang")) {
            log_warn("injected hang at step %llu", (unsigned long long)b->calls);
            for (;;)
                pause();
        }
        log_error("injected crash at step %llu", (unsigned long long)b->calls);
        abort();
    }
    return 0;
}

bool backend_injected_late(const struct backend *b)
{
    const struct backend_fail *f = &((const struct backend_holder *)b)->fail;
    return f->at && b->calls == f->at && !strcmp(f->kind, "late");
}

int backend_layers(struct backend *b, float *h, uint32_t n)
{
    int rc = backend_inject(b);
    return rc ? rc : b->ops->layers(b, h, n);
}

int backend_layers_head(struct backend *b, float *h, uint32_t n, float *logits, int32_t *id)
{
    if ((!logits) == (!id) || n == 0 || (id && !b->ops->argmax))
        return -ENOTSUP;
    int rc = backend_inject(b);
    if (rc)
        return rc;
    rc = b->ops->layers_head ? b->ops->layers_head(b, h, n, logits, id) : -ENOTSUP;
    if (rc != -ENOTSUP)
        return rc;
    rc = b->ops->layers(b, h, n);
    const float *last = h + (size_t)(n - 1) * b->model->hp.n_embd;
    if (rc)
        return rc;
    return id ? b->ops->argmax(b, last, 1, id) : b->ops->logits(b, last, 1, logits);
}

/* Buffers of host_alloc carry a header in front: whether the backend's allocator made them,
 * so that backend_host_free returns each to its own allocator. */
struct backend_host_hdr {
    uint64_t pinned;
    uint64_t pad; /* keeps the buffer 16-byte aligned */
};

/* The longest host buffer to page-lock: LAMINA_PINNED MiB (read at each allocation). */
static size_t backend_pin_limit(void)
{
    const char *e = getenv("LAMINA_PINNED");
    if (!e || !*e)
        return (size_t)1024 << 20;
    char *end = NULL;
    const unsigned long long mib = strtoull(e, &end, 10);
    if (*end || mib > ((size_t)-1 >> 21)) {
        log_warn("LAMINA_PINNED=%s is not a number of MiB: buffers up to 1024 MiB page-locked",
                 e);
        return (size_t)1024 << 20;
    }
    return (size_t)mib << 20;
}

void *backend_host_alloc(struct backend *b, size_t bytes)
{
    const size_t total = bytes + sizeof(struct backend_host_hdr);
    struct backend_host_hdr *p = NULL;
    if (total < bytes)
        return NULL;
    if (b && b->ops->host_alloc && total <= backend_pin_limit())
        p = b->ops->host_alloc(b, total);
    if (p) {
        p->pinned = 1;
    } else {
        p = malloc(total);
        if (!p)
            return NULL;
        p->pinned = 0;
    }
    return p + 1;
}

void backend_host_free(struct backend *b, void *ptr)
{
    if (!ptr)
        return;
    struct backend_host_hdr *p = (struct backend_host_hdr *)ptr - 1;
    if (p->pinned && b && b->ops->host_free)
        b->ops->host_free(b, p);
    else
        free(p);
}

int backend_logits(struct backend *b, const float *h, uint32_t n, float *out)
{
    return b->ops->logits(b, h, n, out);
}

int backend_argmax(struct backend *b, const float *h, uint32_t n, int32_t *ids)
{
    return b->ops->argmax ? b->ops->argmax(b, h, n, ids) : -ENOTSUP;
}

const struct forward_stats *backend_stats(const struct backend *b)
{
    return b->ops->stats(b);
}

int backend_serve(struct backend *b, uint32_t layer, const uint32_t *experts,
                  const uint32_t *counts, uint32_t n_groups, const float *X, float *Y)
{
    const uint32_t E = b->n_expert;
    const uint8_t *bm = b->foreign && layer < b->n_layer ? b->foreign[layer] : NULL;
    uint64_t rows = 0;
    for (uint32_t g = 0; g < n_groups; g++) {
        const uint32_t e = experts[g];
        if (!bm || e >= E || !((bm[e / 8] >> (e % 8)) & 1)) {
            log_error("asked to serve expert %u of layer %u, which this worker does not hold",
                      e, layer);
            return -EINVAL;
        }
        rows += counts[g];
    }
    if (!b->ops->serve || rows > b->serve_max_rows) {
        log_error("asked to serve %llu rows of layer %u (at most %u)", (unsigned long long)rows,
                  layer, b->serve_max_rows);
        return -EINVAL;
    }
    return b->ops->serve(b, layer, experts, counts, n_groups, X, Y);
}

uint32_t backend_pos(const struct backend *b)
{
    return b->ops->pos(b);
}

size_t backend_state_bytes(const struct backend *b)
{
    return forward_state_bytes(b->model, b->l0, b->l1, b->ops->pos(b), b->kv_f16);
}

int backend_state_save(struct backend *b, void *dst)
{
    return b->ops->state_save(b, dst);
}

int backend_state_load(struct backend *b, const void *src, size_t bytes, uint32_t pos)
{
    const size_t want = forward_state_bytes(b->model, b->l0, b->l1, pos, b->kv_f16);
    if (bytes != want) {
        log_error("sequence snapshot refused: %zu bytes, layers %u-%u at %u tokens (KV %s) take "
                  "%zu", bytes, b->l0, b->l1 - 1, pos, b->kv_f16 ? "f16" : "f32", want);
        return -EINVAL;
    }
    if (pos > b->n_ctx) {
        log_error("sequence snapshot of %u tokens refused: the context holds %u", pos, b->n_ctx);
        return -ENOSPC;
    }
    return b->ops->state_load(b, src, pos);
}
