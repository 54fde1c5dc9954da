/*
 * threadpool: a fixed set of compute threads, pinned one per physical core,
 * that run parallel-for jobs for the CPU kernels.
 *
 * Worker i is pinned to the (i)-th physical core; the owner thread is left
 * unpinned (threads it creates would inherit its affinity) and the scheduler
 * keeps it on the first core, which no worker takes.
 * One owner thread (the one that created the pool) submits jobs with
 * threadpool_run(); the call blocks until every task has finished, and the
 * owner thread takes part in the work. Jobs must not submit nested jobs.
 * Workers spin briefly after a job, then sleep on a futex, so back-to-back
 * small jobs (one decode step is hundreds of them) cost little.
 */
#ifndef KERNELS_CPU_THREADPOOL_H
#define KERNELS_CPU_THREADPOOL_H

#include <stdbool.h>
#include <stdint.h>

/* One task: index in [0, n_tasks), the job's context, and the id (0..n_threads-1) of
 * the thread running it, for per-thread scratch. */
typedef void (*threadpool_fn)(void *ctx, int64_t task, int thread);

struct threadpool_config {
    int n_threads; /* total threads including the caller; <= 0 means one per physical core */
    bool pin;      /* pin thread i to the i-th physical core (default true via threadpool_default) */
};

struct threadpool;

/* Starts n_threads - 1 workers. Returns an owned pool or NULL (logged). */
struct threadpool *threadpool_create(const struct threadpool_config *cfg);

/* Stops and joins the workers; accepts NULL. */
void threadpool_destroy(struct threadpool *pool);

/* Number of threads that run tasks (workers plus the caller). */
int threadpool_n_threads(const struct threadpool *pool);

/* Runs fn(ctx, i, thread) for every i in [0, n_tasks) across the pool and
 * returns when all are done. Tasks are handed out dynamically in order. */
void threadpool_run(struct threadpool *pool, threadpool_fn fn, void *ctx, int64_t n_tasks);

/* Physical cores of this machine (one logical CPU per core), at least 1. */
int threadpool_physical_cores(void);

#endif
