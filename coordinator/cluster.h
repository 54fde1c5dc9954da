/*
 * cluster: the coordinator's side of the multi-process system. It copies
 * every routed expert into a POSIX shared-memory segment, binds the
 * coordinator's ROUTER socket in a private runtime directory (or on tcp://
 * with CURVE when asked), starts one lamina-worker per device (fork+exec,
 * parent-death signal) or waits for workers started elsewhere, splits the
 * layers between them, tells each its plan, and then runs steps: hidden
 * states to worker 0, expert requests answered from the CPU pool, logits back
 * from the last worker (or only the token it sampled, cluster_step_sample). It
 * notices a worker that dies (its exit) or stops answering (no heartbeat for
 * 2 s, or no progress for hang_timeout), fails the step with an error naming
 * it, and on destroy shuts every worker down, kills what is left, unlinks the
 * segment and removes the runtime directory.
 *
 * Hand-off of hidden states between consecutive workers (cfg.handoff): "zmq" sends them in
 * the Step message; "nccl" hands them device to device over an NCCL pair for every two
 * consecutive workers on different CUDA devices of this host (workers this coordinator
 * starts), ZeroMQ elsewhere, and is refused when there is no such pair or NCCL does not load;
 * "auto" is "nccl" where it can be and "zmq" otherwise, saying so in the log. The coordinator
 * makes one NCCL unique id per pair and sends it in both workers' plans (ipc/nccl.h); the
 * pair's bootstrap then runs on a thread of this process until both have joined. NCCL sends
 * and receives of a pair match in the order they are posted, not by sequence: with several
 * steps in flight this stays correct only because every worker runs its steps FIFO in the
 * order the previous one handed them on (one ordered ZeroMQ stream per pair), so the n-th
 * send of worker i meets the n-th receive of worker i + 1. No worker may reorder steps.
 *
 * Several sequences (cfg.n_seq slots on every worker) can have a step in flight at once:
 * cluster_submit sends sequence s's next step to worker 0 and returns; cluster_wait serves
 * the workers (CPU-pool expert requests of any step in flight, timings, heartbeats) until one
 * comes back and names its sequence. Each worker runs the steps it receives one at a time, in
 * order, and hands each on as it finishes, so the workers form a pipeline: worker 0 runs
 * sequence B's step while worker 1 runs sequence A's. One sequence has at most one step in
 * flight (its next step needs the previous result). cluster_step and cluster_step_sample are
 * one step of sequence 0 with nothing else in flight.
 *
 * Called from the coordinator's main thread only; it owns the ZeroMQ
 * context it creates.
 */
#ifndef COORDINATOR_CLUSTER_H
#define COORDINATOR_CLUSTER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "ipc/wire.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/sampler.h"

#define CLUSTER_MAX_WORKERS 64
#define CLUSTER_WINDOW_MAX WIRE_WINDOW_MAX /* longest penalty window a step can carry, ids */
#define CLUSTER_SEQ_MAX WIRE_SEQ_MAX       /* most sequences in flight at once */

struct cluster_config {
    const char *model_path;        /* GGUF path the workers open */
    const struct gguf *gguf;       /* borrowed: the coordinator's view of it */
    const struct arch_model *model;/* borrowed */
    int n_workers;                 /* 1..CLUSTER_MAX_WORKERS */
    const char *backends[CLUSTER_MAX_WORKERS]; /* "cpu" per worker */
    uint64_t device_mem[CLUSTER_MAX_WORKERS];  /* budget per worker, bytes; 0 = unlimited */
    const char *layers;            /* "auto" (default) or "0-19,20-39" */
    const char *resident;          /* "all" (default), "none", "fit", or "P%" per layer; used
                                      when there is no placement plan (see place) */
    const char *place;             /* placement plan (coordinator/planner.h): "auto", "off" or a
                                      list; used when given or when every worker has a
                                      device_mem budget; NULL otherwise */
    const char *heat_path;         /* expert heat profile (heat.json) for the plan, or NULL */
    const char *experts_home;      /* "range" (NULL) or "any": experts of a worker's layers
                                      may be held by another worker, which serves them through
                                      the coordinator (planner.h step 5); needs the planner */
    uint32_t n_ctx;                /* KV positions */
    bool kv_f16;
    uint32_t max_batch;            /* tokens per step */
    int worker_threads;            /* compute threads per worker; <= 0: cores / workers */
    int pool_threads;              /* CPU expert pool threads; <= 0: physical cores */
    const char *listen;            /* tcp://HOST:PORT to bind with CURVE, or NULL for ipc */
    bool spawn;                    /* start the workers (default); false: wait for them */
    const char *worker_bin;        /* lamina-worker path; NULL: next to this executable */
    const char *timings_path;      /* JSON lines of every step, or NULL */
    double hang_timeout_s;         /* no layer progress for this long in a step: hung (30) */
    const char *handoff;           /* "zmq" (default when NULL), "nccl" or "auto" (above) */
    bool coordinator_samples;      /* --sample-on coordinator: never ask the last worker to
                                      sample (engine.h); default false: it samples when the
                                      coordinator needs no logits */
    uint32_t n_seq;                /* sequence slots (KV cache and DeltaNet state each, charged
                                      to every worker's budget), 0..CLUSTER_SEQ_MAX; 0 means 1 */
};

/* What the last worker needs to sample a step's last row as the coordinator's sampler would
 * (model/sampler.h, sampler_sample_given): the sampler's values, the number it drew and the
 * ids its penalties look back over. */
struct cluster_sample {
    struct sampler_config cfg; /* seed and penalty_last_n play no part */
    double uniform;            /* sampler_next_uniform() of the sequence's sampler, [0, 1) */
    const int32_t *window;     /* sampler_window() ids, borrowed for the call */
    size_t n_window;           /* <= CLUSTER_WINDOW_MAX */
};

struct cluster;

/* Builds everything and waits until every worker is ready. Returns an owned
 * cluster or NULL after logging why; nothing (process, segment, directory)
 * is left behind on failure. */
struct cluster *cluster_create(const struct cluster_config *cfg);

/* Shuts the workers down (SHUTDOWN, bounded wait, SIGKILL), unlinks the
 * segment, removes the runtime directory; accepts NULL. */
void cluster_destroy(struct cluster *c);

/* One step: n rows of hidden states h (positions pos..pos+n-1 of sequence
 * 0) through every worker; logits of the last row (or all n rows) into
 * logits. n <= max_batch. Returns 0, or a negative errno after logging an
 * error that names the worker (-ECONNRESET: a worker died; -ETIMEDOUT: it
 * stopped answering; -EIO: it reported a failure; -EINTR: interrupted). */
int cluster_step(struct cluster *c, const float *h, uint32_t n, uint32_t pos, bool all_logits,
                 float *logits);

/* As cluster_step without all_logits, but the last worker samples the last row with smp
 * (borrowed for the call) and returns only the token, into *token; no logits come back. */
int cluster_step_sample(struct cluster *c, const float *h, uint32_t n, uint32_t pos,
                        const struct cluster_sample *smp, int32_t *token);

/* Sends step n rows of hidden states h (positions pos..pos+n-1 of sequence seq) to worker
 * 0 and returns without waiting; h and smp's window are borrowed for the call only. With smp
 * the last worker samples the last row (as cluster_step_sample) and cluster_wait gives the
 * token; else the logits of the last row (all n rows with all_logits) are written into
 * logits, borrowed until cluster_wait names seq. Position 0 starts the slot over. Returns 0,
 * -EINVAL (logged) for seq >= n_seq or n outside 1..max_batch, -EBUSY (logged) when seq has
 * a step in flight, or a send failure. */
int cluster_submit(struct cluster *c, uint32_t seq, const float *h, uint32_t n, uint32_t pos,
                   bool all_logits, const struct cluster_sample *smp, float *logits);

/* Waits for any step in flight to come back, serving the workers meanwhile; *seq gets its
 * sequence and, for a sampling step, *token its token (token may be NULL otherwise). Errors
 * as cluster_step, or -EINVAL (logged) when nothing is in flight. After an error the cluster
 * is to be destroyed. */
int cluster_wait(struct cluster *c, uint32_t *seq, int32_t *token);

/* Steps in flight now; sequence slots of the cluster. */
uint32_t cluster_in_flight(const struct cluster *c);
uint32_t cluster_n_seq(const struct cluster *c);

/* Starts every sequence over on every worker. */
int cluster_reset(struct cluster *c);

/* Sequence snapshots of slot seq (the prompt cache), with no step in flight. Save: every
 * worker's snapshot of its range (worker/forward.h's layout), back to back in layer order,
 * into a malloc'd *blob of *bytes, at *pos tokens (the workers must agree). Load: a blob of
 * that form (forward_state_bytes over every layer at pos; -EINVAL, logged, otherwise), cut
 * at the workers' ranges; each worker then continues slot seq from pos. Errors as
 * cluster_step (a worker's refusal: -EIO). */
int cluster_state_save(struct cluster *c, uint32_t seq, void **blob, size_t *bytes,
                       uint32_t *pos);
int cluster_state_load(struct cluster *c, uint32_t seq, const void *blob, size_t bytes,
                       uint32_t pos);

/* Prints the per-worker summary table of the steps so far (after the timing lines of the
 * steps that came back have arrived: bounded wait). */
void cluster_print_summary(struct cluster *c, FILE *out);

/* Sets the flag the step loop checks (from a signal handler: async-signal-safe). */
void cluster_interrupt(struct cluster *c);

/* The segment name, for a signal handler that must unlink it. */
const char *cluster_shm_name(const struct cluster *c);

#endif
