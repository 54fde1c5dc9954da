/*
 * expert_pool: the coordinator's CPU fallback for routed experts. Workers
 * send the rows of the experts they do not hold (one request per layer and
 * step); the pool computes them from the shared-memory expert stacks with
 * threads pinned to the host's cores, with the same code a worker uses
 * (worker/expert_exec), so a result does not depend on where it ran.
 *
 * Called from the coordinator's main thread only.
 */
#ifndef COORDINATOR_EXPERT_POOL_H
#define COORDINATOR_EXPERT_POOL_H

#include <stdint.h>

#include "model/arch.h"
#include "worker/expert_exec.h"

struct expert_pool_config {
    const struct arch_model *model;            /* borrowed */
    const struct expert_ref *const *refs;      /* per layer, n_expert refs (shm); NULL: model's */
    int n_threads;                             /* <= 0: physical cores */
    uint32_t max_rows;                         /* most rows of one request */
};

struct expert_pool;

struct expert_pool *expert_pool_create(const struct expert_pool_config *cfg);
void expert_pool_destroy(struct expert_pool *p);

/* Computes one request: n_groups groups (experts[g] over counts[g] rows of
 * X, grouped) into Y. Checks layer, ids and row counts against the model
 * (-EINVAL, logged: requests come from another process). */
int expert_pool_run(struct expert_pool *p, uint32_t layer, const uint32_t *experts,
                    const uint32_t *counts, uint32_t n_groups, const float *X, float *Y);

/* Seconds spent computing and rows computed since creation. */
double expert_pool_busy_s(const struct expert_pool *p);
uint64_t expert_pool_rows(const struct expert_pool *p);

#endif
