/*
 * backend: the device a worker runs its layer range on, behind one ops
 * table. `cpu` runs on the host with a settable amount of "device memory"
 * that it enforces and with injectable failures, so the whole multi-process
 * system runs and is tested without a GPU; `cuda` (issue 4) is the real one.
 *
 * A backend holds the trunk of its layers, the routed experts its plan made
 * resident (copied from the shared-memory expert stacks into its memory),
 * n_seq sequence slots (a KV cache and DeltaNet state each), and its
 * scratch. Experts it does not hold go to the coordinator through
 * cfg->remote. Calls come from the worker's main thread; layers() runs on the
 * slot backend_use_seq chose last (slot 0 at first), so steps of several
 * sequences interleave one whole step at a time.
 */
#ifndef WORKER_BACKEND_H
#define WORKER_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/arch.h"
#include "worker/forward.h"

/* Device-to-device hand-off of the hidden state between consecutive GPU
 * workers (NCCL). When recv is set, layers() takes its n input rows from
 * recv into the backend's device buffer (enqueued on its stream; h is not
 * read); when send is set, it gives its n output rows to send from that
 * buffer (h is not written). Both return 0 or a negative errno; `stream` is
 * the backend's cudaStream_t. Backends without device memory refuse them. */
struct backend_handoff {
    int (*recv)(void *ctx, void *d_buf, size_t bytes, void *stream);
    int (*send)(void *ctx, const void *d_buf, size_t bytes, void *stream);
    void *ctx;
};

struct backend_config {
    const struct arch_model *model;   /* borrowed; outlives the backend */
    uint32_t layer_begin, layer_end;  /* layer range [begin, end) */
    uint64_t device_mem;              /* bytes the backend may use; 0 = unlimited */
    int n_threads;                    /* compute threads (cpu); <= 0: physical cores */
    uint32_t n_ctx;                   /* KV positions */
    bool kv_f16;                      /* f16 KV cache */
    uint32_t max_batch;               /* tokens per pass */
    uint32_t n_seq;                   /* sequence slots, each its own KV cache and DeltaNet
                                         state, all charged to device_mem; 0 means 1 */
    /* Per model layer: bitmap of experts to hold (NULL entry: none; NULL: all). */
    const uint8_t *const *resident;
    /* Per model layer: n_expert references to the source of each expert's
     * weights (the shm segment); NULL: the model file. Resident experts are
     * copied from here. */
    const struct expert_ref *const *expert_src;
    /* Per model layer: whether its projections (trunk) and its shared expert
     * are charged to the device budget (the placement plan); NULL: all are.
     * The output projection is charged when lmhead is set. */
    const bool *trunk_on_device;
    const bool *shexp_on_device;
    bool lmhead;
    /* Per model layer: bitmap of routed experts of a layer OUTSIDE the range that this
     * backend holds for another worker (--experts-home any) and runs in serve(); NULL entry:
     * none; NULL: none at all. Copied from expert_src, charged to device_mem. */
    const uint8_t *const *foreign;
    struct forward_remote remote;     /* for the experts not held */
    struct backend_handoff handoff;   /* device hand-off (cuda only), or zeroes */
    volatile uint64_t *progress;      /* bumped per layer (watchdog), or NULL */
    /* cuda: time the GPU stages of each layer with CUDA events into stats() (attn, deltanet,
     * router, experts, shared_expert); off, those stay 0. The worker sets it from
     * LAMINA_CUDA_STAGE_TIMES=1 (docs/timings.md). The cpu backend always times them. */
    bool stage_times;
    const char *fail;                 /* failure injection spec (tests), or NULL:
                                         "step:N" fail the N-th layers call with -EIO,
                                         "hang:N" never return from it,
                                         "crash:N" abort() in it,
                                         "late:N" the worker holds back its timing line
                                         of that step (backend_injected_late) */
};

struct backend;

struct backend_ops {
    const char *name;
    int (*init)(struct backend *b, const struct backend_config *cfg);
    void (*fini)(struct backend *b);
    /* Makes slot seq (< n_seq, checked by the caller) the one later calls run on. */
    void (*use_seq)(struct backend *b, uint32_t seq);
    /* Starts the current slot's sequence over (position 0, zero state). */
    void (*reset)(struct backend *b);
    /* Runs the layer range over n hidden rows in place; see forward_layers. */
    int (*layers)(struct backend *b, float *h, uint32_t n);
    /* Final norm and lm head of n rows (last worker only). */
    int (*logits)(struct backend *b, const float *h, uint32_t n, float *out);
    /* Greedy tokens of n rows: ids[r] = the arg-max of the logits logits() computes for row r
     * (ties: the lowest id; NaN never wins), without bringing the logits back. NULL: not
     * offered (the caller takes logits() and samples them). */
    int (*argmax)(struct backend *b, const float *h, uint32_t n, int32_t *ids);
    /* layers() over n rows, then the head of the last row: its logits into logits (n_vocab
     * floats) or, with id, only its arg-max (as argmax()); h afterwards is unspecified. For
     * a backend that can run the two without a round trip through the host. NULL, or
     * -ENOTSUP before anything ran: the caller runs layers() and the head itself. */
    int (*layers_head)(struct backend *b, float *h, uint32_t n, float *logits, int32_t *id);
    /* Stage timings since creation. */
    const struct forward_stats *(*stats)(const struct backend *b);
    /* Runs foreign experts (cfg->foreign) over groups of rows, as expert_exec_run: group g is
     * experts[g] of `layer` over counts[g] consecutive rows of X, into as many rows of Y (host
     * memory both). NULL: the backend cannot hold foreign experts (a plan with any is
     * refused). The caller (backend_serve) has checked every expert is held. */
    int (*serve)(struct backend *b, uint32_t layer, const uint32_t *experts,
                 const uint32_t *counts, uint32_t n_groups, const float *X, float *Y);
    /* Tokens the current slot has consumed. */
    uint32_t (*pos)(const struct backend *b);
    /* Snapshot of the current slot (forward_state_bytes at pos() tokens, forward.h's layout)
     * into dst, host memory. */
    int (*state_save)(struct backend *b, void *dst);
    /* Makes the current slot the snapshot src of `pos` tokens (pos <= the context, checked
     * by the caller); the next layers() continues from it. */
    int (*state_load)(struct backend *b, const void *src, uint32_t pos);
    /* Host memory the backend copies into and out of at full speed (page-locked for a GPU
     * backend), or NULL (the caller falls back to malloc); freed by host_free. NULL ops:
     * plain malloc / free. */
    void *(*host_alloc)(struct backend *b, size_t bytes);
    void (*host_free)(struct backend *b, void *p);
};

struct backend {
    const struct backend_ops *ops;
    void *impl;                       /* the backend's own state */
    uint64_t mem_used;                /* device bytes held */
    uint32_t resident_experts;        /* (layer, expert) pairs held */
    uint32_t foreign_experts;         /* of them, experts of other workers' layers */
    uint32_t serve_max_rows;          /* most rows of one serve() call */
    const uint8_t *const *foreign;    /* cfg->foreign, borrowed (outlives the backend) */
    uint32_t n_layer, n_expert;       /* the model's */
    const struct arch_model *model;   /* cfg->model, borrowed */
    uint32_t l0, l1;                  /* the layer range */
    uint32_t n_ctx;                   /* KV positions (cfg->n_ctx) */
    bool kv_f16;                      /* cfg->kv_f16 */
    uint64_t calls;                   /* layers() calls so far */
    uint32_t n_seq;                   /* sequence slots (cfg->n_seq, at least 1) */
    uint32_t seq;                     /* the slot layers() runs on */
};

/* Makes a backend of kind "cpu" (or "cuda" when built). Returns an owned
 * backend or NULL after logging why (unknown kind, memory budget too small:
 * the message lists what each part needs). */
struct backend *backend_create(const char *kind, const struct backend_config *cfg);
void backend_destroy(struct backend *b);

/* Makes slot seq the one later layers() calls run on (and extend). -EINVAL
 * (logged, naming seq and n_seq) when seq >= n_seq. */
int backend_use_seq(struct backend *b, uint32_t seq);

/* Starts every slot's sequence over; the current slot stays chosen. */
void backend_reset(struct backend *b);

/* Starts slot seq's sequence over; -EINVAL (logged) when seq >= n_seq. */
int backend_reset_seq(struct backend *b, uint32_t seq);

/* Dispatch helpers; layers() applies failure injection first. */
int backend_layers(struct backend *b, float *h, uint32_t n);
int backend_logits(struct backend *b, const float *h, uint32_t n, float *out);
/* layers() over n rows and the head of the last row (backend_ops.layers_head, or layers()
 * then logits() / argmax() where it is not offered): exactly one of logits (n_vocab floats)
 * and id is given; h afterwards is unspecified. -ENOTSUP (nothing run) for id on a backend
 * without argmax(). Failure injection as backend_layers. */
int backend_layers_head(struct backend *b, float *h, uint32_t n, float *logits, int32_t *id);
/* backend_ops.argmax, or -ENOTSUP (nothing logged) where the backend does not offer it. */
int backend_argmax(struct backend *b, const float *h, uint32_t n, int32_t *ids);
const struct forward_stats *backend_stats(const struct backend *b);
/* Failure injection "late:N": whether the layers call just made was the N-th. */
bool backend_injected_late(const struct backend *b);

/* Runs foreign experts for another worker (backend_ops.serve). -EINVAL (logged, naming the
 * layer and expert) when cfg->foreign gave this backend no such foreign expert, or the rows
 * exceed serve_max_rows. */
int backend_serve(struct backend *b, uint32_t layer, const uint32_t *experts,
                  const uint32_t *counts, uint32_t n_groups, const float *X, float *Y);

/* Host buffers for what the backend returns (logits): page-locked where the backend is a
 * GPU's, so that its copies need no staging through a bounce buffer, up to LAMINA_PINNED MiB a
 * buffer (default 1024; 0: none), so that a long one (perplexity's logits of every position of
 * a long context) does not lock gigabytes of the host's memory; plain malloc elsewhere, for
 * longer buffers and where pinning fails. (A buffer is locked whole or not at all: a copy
 * across a partly locked one fails.) NULL only where malloc fails too. Freed with
 * backend_host_free on the same backend, before backend_destroy. */
void *backend_host_alloc(struct backend *b, size_t bytes);
void backend_host_free(struct backend *b, void *p);

/* Sequence snapshots of the current slot (the prompt cache; forward.h has the layout): its
 * position, the bytes of its snapshot there, and save / load. backend_state_load refuses
 * (-EINVAL, logged) a snapshot whose size is not forward_state_bytes(.., pos, ..) for this
 * range and KV type, and (-ENOSPC) a position past the context. */
uint32_t backend_pos(const struct backend *b);
size_t backend_state_bytes(const struct backend *b);
int backend_state_save(struct backend *b, void *dst);
int backend_state_load(struct backend *b, const void *src, size_t bytes, uint32_t pos);

#endif
