/*
 * forward: runs a model's layers on the CPU: embedding lookup, a contiguous
 * range of decoder layers (attention or gated DeltaNet, then the routed and
 * shared experts), and the output head, for a batch of S consecutive tokens
 * of one sequence (prefill) or one token (decode).
 *
 * A forward object owns the scratch for max_batch tokens and borrows the
 * model and the thread pool; a forward_seq owns one sequence's KV cache
 * (f32 or f16) and DeltaNet conv and recurrent state for the forward's layer
 * range. Calls on one forward object must come from one thread (the pool's
 * owner); the compute is spread over the pool. Results do not depend on the
 * number of threads: every sum has a fixed order.
 */
#ifndef WORKER_FORWARD_H
#define WORKER_FORWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/cpu/threadpool.h"
#include "model/arch.h"
#include "worker/expert_exec.h"

/* Routed experts this forward does not hold go elsewhere (the coordinator's
 * CPU pool) through these calls, made from the forward's thread once per
 * layer and step: submit() hands over the rows of each non-resident expert
 * group (experts[g] ascending, counts[g] rows each, grouped in X) and must
 * not block on the reply; collect() waits for the n_rows output rows, in the
 * same order. Either returns 0 or a negative errno that fails the step. The
 * forward computes its own experts between the two calls. */
struct forward_remote {
    void *ctx;
    int (*submit)(void *ctx, uint32_t layer, const uint32_t *experts, const uint32_t *counts,
                  uint32_t n_groups, const float *X, uint32_t n_rows);
    int (*collect)(void *ctx, uint32_t layer, float *Y, uint32_t n_rows);
};

struct forward_config {
    const struct arch_model *model; /* borrowed; outlives the forward */
    struct threadpool *pool;        /* borrowed; calls come from its owner thread */
    uint32_t layer_begin;           /* first layer this forward runs (default 0) */
    uint32_t layer_end;             /* one past the last; 0 means n_layer */
    uint32_t n_ctx;                 /* KV positions per sequence; 0 means min(train ctx, 4096) */
    bool kv_f16;                    /* store K and V as f16 (llama.cpp's default) */
    uint32_t max_batch;             /* tokens per internal pass; 0 means 256 */
    /* Per model layer (indexed by layer number, n_layer entries, borrowed): a
     * bitmap of the experts computed here (bit e of byte e/8); a NULL entry:
     * none of that layer. NULL: all experts of every layer. */
    const uint8_t *const *resident;
    /* Per model layer: n_expert references to where resident experts' weights
     * live (a copy in device memory). NULL, or a NULL entry: the model's own. */
    const struct expert_ref *const *expert_refs;
    struct forward_remote remote;   /* required when some expert is not resident */
    /* Incremented after every layer (a watchdog reads it from another
     * thread to tell a slow step from a hung one); NULL: none. */
    volatile uint64_t *progress;
    /* Routing counts: n_layer x n_expert counters (row-major, by model
     * layer), one added per (token, slot) the router picks in this forward's
     * layers, prompt and generated tokens alike (lamina run --record-heat);
     * NULL: not counted. Borrowed. */
    uint64_t *heat;
};

/* Wall time spent per stage since the last forward_stats_reset (seconds). */
struct forward_stats {
    double attn;          /* attention layers: projections, rope, attention, output */
    double deltanet;      /* DeltaNet layers: projections, conv, recurrence, output */
    double router;        /* router logits and top-k */
    double experts;       /* routed expert products computed here */
    double shared_expert; /* shared expert products */
    double remote_wait;   /* waiting for experts computed elsewhere */
    uint64_t tokens;      /* tokens run through the layers */
    uint64_t expert_rows; /* (token, expert) pairs computed here */
    uint64_t remote_rows; /* (token, expert) pairs sent elsewhere */
    uint64_t step_kernels; /* cuda: kernels the last one-token step launched (0: none yet) */
};

struct forward;
struct forward_seq;

/* Allocates scratch for max_batch tokens. NULL (logged) on bad config or no
 * memory. */
struct forward *forward_create(const struct forward_config *cfg);
void forward_destroy(struct forward *fw);

/* Allocates one sequence's state for the forward's layer range, zeroed.
 * NULL (logged) when out of memory. */
struct forward_seq *forward_seq_create(struct forward *fw);
void forward_seq_destroy(struct forward_seq *seq);

/* Clears the state: the next token is position 0. */
void forward_seq_reset(struct forward_seq *seq);

/* Sequence snapshots (the prompt cache): one sequence's state for a layer range as bytes,
 * the same on every backend. For each layer of [l0, l1) in order: a DeltaNet layer gives its
 * conv state (conv_dim x (ssm_conv - 1) f32, channel-major, oldest first) and its delta
 * state (ssm_nv x ssm_dv x ssm_dk f32, key index fastest; kernels/cpu/deltanet.h); an
 * attention layer gives K then V rows 0 .. pos-1 (n_head_kv * head_dim each, f16 when kv_f16,
 * else f32). No header: the position, the range and the KV type travel beside it. */
size_t forward_state_bytes(const struct arch_model *m, uint32_t l0, uint32_t l1, uint32_t pos,
                           bool kv_f16);

/* Writes seq's snapshot (forward_state_bytes at its position) into dst. */
void forward_seq_save(const struct forward_seq *seq, void *dst);

/* Makes seq the snapshot src of `pos` tokens (forward_state_bytes(.., pos, ..) bytes, from
 * forward_seq_save or a backend's state_save). -ENOSPC (logged) when pos exceeds the context. */
int forward_seq_load(struct forward_seq *seq, const void *src, uint32_t pos);

/* Context size and positions used so far. */
uint32_t forward_n_ctx(const struct forward *fw);
uint32_t forward_seq_pos(const struct forward_seq *seq);

/* h[s] = embedding of tokens[s] (f32 rows of n_embd). -EINVAL (logged) for an
 * id outside the vocabulary. */
int forward_embed(struct forward *fw, const int32_t *tokens, uint32_t n, float *h);

/* Runs the forward's layer range over n tokens at positions
 * seq_pos .. seq_pos+n-1, updating h (n rows of n_embd) in place and the
 * sequence state, then advances the sequence position by n. -ENOSPC (logged)
 * when the context would overflow. */
int forward_layers(struct forward *fw, struct forward_seq *seq, float *h, uint32_t n);

/* logits[s] = output(RMSNorm(h[s]) * output_norm) for n rows of h (h is not
 * modified); logits has n rows of n_vocab. */
int forward_logits(struct forward *fw, const float *h, uint32_t n, float *logits);

/* Stage timings. */
const struct forward_stats *forward_get_stats(const struct forward *fw);
void forward_stats_reset(struct forward *fw);

#endif
