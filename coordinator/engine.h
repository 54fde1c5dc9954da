/*
 * engine: one loaded model and the machinery that runs its layers for one
 * sequence, either in this process (the --inproc reference path: a forward
 * over every layer on the CPU) or on workers (a cluster of lamina-worker
 * processes, one per device). generate, bench and perplexity all evaluate
 * tokens through it, so every command runs both paths the same way.
 *
 * Called from the coordinator's main thread only.
 */
#ifndef COORDINATOR_ENGINE_H
#define COORDINATOR_ENGINE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "coordinator/cluster.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/sampler.h"

struct engine_config {
    const char *model_path;          /* GGUF file */
    int n_threads;                   /* compute threads here; <= 0: physical cores */
    uint32_t n_ctx;                  /* 0: min(train ctx, 4096) */
    uint32_t n_batch;                /* tokens per pass / step; 0: 256 */
    bool kv_f16;                     /* f16 KV cache */
    bool progress;                   /* progress bar while paging in a large file */
    struct cluster_config *cluster;  /* workers to start (model fields filled in here); NULL:
                                        every layer in this process */
    const char *backend;             /* in this process without workers: a worker backend
                                        ("cuda:0") runs every layer; NULL: the CPU forward */
    void (*on_cluster)(struct cluster *c); /* told the live cluster, and NULL before it goes */
    const char *record_heat;         /* count the router's picks per (layer, expert) over every
                                        token run and write them as a heat file here at
                                        engine_save_heat (in-process CPU engine only); NULL */
};

struct engine;

/* Opens and validates the model, pages it in, and builds the in-process
 * forward or the cluster. NULL after logging why. */
struct engine *engine_create(const struct engine_config *cfg);
void engine_destroy(struct engine *e);

/* A buffer for rows x n_vocab logits that engine_eval fills at full speed: page-locked host
 * memory where the layers run on an in-process GPU backend (its copies then need no staging),
 * plain memory otherwise. NULL when out of memory. Freed with engine_free_logits before
 * engine_destroy. */
float *engine_alloc_logits(struct engine *e, size_t rows);
void engine_free_logits(struct engine *e, float *p);

/* Writes the routing counts to cfg->record_heat (see planner_heat_save; the
 * token count is every token run through the layers). 0 when nothing was
 * asked; -EIO (logged) when the file cannot be written. */
int engine_save_heat(struct engine *e);

/* Borrowed views, valid until destroy. */
const struct gguf *engine_gguf(const struct engine *e);
const struct arch_model *engine_model(const struct engine *e);
uint32_t engine_n_ctx(const struct engine *e);
uint32_t engine_pos(const struct engine *e);       /* tokens consumed so far */
int engine_n_threads(const struct engine *e);

/* Runs n tokens at the current position (prefill in passes of n_batch, or
 * one decode token) and writes the logits of the last token, or of all n when
 * all is set, into out (n_vocab floats per row). -ENOSPC when the context
 * would overflow; other errors as the cluster or forward report them. */
int engine_eval(struct engine *e, const int32_t *ids, uint32_t n, bool all, float *out);

/* Runs n tokens as engine_eval (without all) and picks the next token from the last one's
 * logits with s into *token, as sampler_sample(s, those logits) would, drawing from s's PRNG
 * the same way. With workers the last worker samples and sends only the token (its uniform
 * and penalty window come from s: cluster_step_sample), unless the cluster config says
 * coordinator_samples or the window is longer than a step can carry; then the logits come
 * here and s samples them. logits (n_vocab floats) is scratch: its content is unspecified
 * afterwards. Does not call sampler_accept. Errors as engine_eval, or -ENOMEM. */
int engine_eval_sample(struct engine *e, const int32_t *ids, uint32_t n, struct sampler *s,
                       float *logits, int32_t *token);

/* Sequence snapshots (the prompt cache; layout in worker/forward.h, over every layer in
 * order, so the same bytes whichever path or layer split made them): the sequence's state
 * after engine_pos() tokens, as a malloc'd *blob of *bytes (engine_state_bytes(e, pos));
 * and back, after which the sequence continues at pos. The load refuses (-EINVAL, logged) a
 * blob of another size and (-ENOSPC) a position past the context; errors of the path as
 * engine_eval. */
size_t engine_state_bytes(const struct engine *e, uint32_t pos);
int engine_state_save(struct engine *e, void **blob, size_t *bytes);
int engine_state_load(struct engine *e, const void *blob, size_t bytes, uint32_t pos);
bool engine_kv_f16(const struct engine *e);

/* Starts the sequence over at position 0. */
int engine_reset(struct engine *e);

/* Per-stage summary (the cluster's per-worker table, or this process's
 * stage shares). */
void engine_print_summary(const struct engine *e, FILE *out);

#endif
