/*
 * expert_exec: computes routed experts for groups of tokens on the CPU:
 * for each group (one expert id, its rows of normalised hidden states),
 * Y = W_down[e] (silu(W_gate[e] X) * W_up[e] X).
 *
 * The same code runs in a worker (experts it holds) and in the
 * coordinator's CPU pool (experts it was sent), so an expert's output is
 * bit-identical wherever it runs: each group's products depend only on the
 * weights, the rows and the group size, never on the thread count.
 *
 * An expert_exec object owns scratch for max_rows rows and borrows a
 * thread pool; calls come from the pool's owner thread.
 */
#ifndef WORKER_EXPERT_EXEC_H
#define WORKER_EXPERT_EXEC_H

#include <stdint.h>

#include "kernels/cpu/threadpool.h"
#include "model/arch.h"

/* Where one expert's matrices live. For a fused gate_up stack, gate points at
 * the 2F-row matrix and up is NULL. */
struct expert_ref {
    const uint8_t *gate;
    const uint8_t *up;
    const uint8_t *down;
};

struct expert_exec_config {
    struct threadpool *pool; /* borrowed */
    uint32_t n_embd;         /* row width of X and Y */
    uint32_t n_ff;           /* expert width F */
    uint32_t max_rows;       /* most rows of one call */
};

struct expert_exec;

struct expert_exec *expert_exec_create(const struct expert_exec_config *cfg);
void expert_exec_destroy(struct expert_exec *x);

/* The reference of expert e of layer ly inside the model's own tensors. */
struct expert_ref expert_exec_model_ref(const struct arch_layer *ly, uint32_t e);

struct shm_segment;

/* Fills out[0..n_expert) with the references of layer's experts inside the
 * shared-memory expert segment (borrowed: valid while seg is mapped).
 * Returns 0, or -EPROTO (logged) when the segment lacks that layer's stacks. */
int expert_exec_shm_refs(const struct shm_segment *seg, uint32_t layer, uint32_t n_expert,
                         struct expert_ref *out);

/* Runs n_groups groups: group g is expert experts[g] over counts[g]
 * consecutive rows of X (n_embd floats each), writing as many rows of Y.
 * ly gives the matrix types and row sizes; refs[g] the weights of group g.
 * -EINVAL (logged) when the rows exceed max_rows. */
int expert_exec_run(struct expert_exec *x, const struct arch_layer *ly,
                    const struct expert_ref *refs, const uint32_t *counts, uint32_t n_groups,
                    const float *X, float *Y);

#endif
