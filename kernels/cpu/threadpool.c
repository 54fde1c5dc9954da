/*
 * threadpool: pinned worker threads with a spin-then-futex job handoff
 * (see threadpool.h).
 *
 * A job is published by bumping `generation` (the futex word). Tasks are
 * claimed from `work`, one 64-bit word holding the job's generation (high
 * half) and its next task index (low half), with a compare-and-swap that
 * fails once the word belongs to another job; each finished task counts in
 * `completed`. The owner runs tasks too and returns when `completed` reaches
 * the job's task count, then closes the word (index THREADPOOL_CLOSED).
 * So a job never waits for a worker that has not woken up or was descheduled
 * (a core shared with another process's busy thread): only for tasks
 * actually claimed; a worker that comes late finds the job closed or gone.
 */
#include "kernels/cpu/threadpool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"

#define THREADPOOL_SPINS 20000 /* polls before a worker sleeps */
#define THREADPOOL_CLOSED UINT32_MAX /* task index of a finished job */
#define THREADPOOL_MAX_CPUS 1024

struct threadpool_worker {
    struct threadpool *pool; /* back pointer */
    pthread_t thread;        /* the worker thread */
    int id;                  /* 1..n_threads-1; the owner is 0 */
};

struct threadpool {
    int n_threads;                     /* workers + owner */
    struct threadpool_worker *workers; /* n_threads - 1 entries */
    int cpus[THREADPOOL_MAX_CPUS];     /* logical cpu per physical core */
    int n_cpus;                        /* entries of cpus */
    _Atomic uint32_t generation;       /* bumped per job (futex word) */
    _Atomic uint64_t work;             /* generation << 32 | next task index */
    _Atomic int64_t completed;         /* tasks of the current job finished */
    _Atomic int stop;                  /* set at destroy */
    threadpool_fn fn;                  /* current job (read only under a claimed task) */
    void *ctx;                         /* current job's context */
    _Atomic int64_t n_tasks;           /* current job's size */
};

static long threadpool_futex(_Atomic uint32_t *addr, int op, uint32_t val)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static int threadpool_read_int(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int v = -1;
    if (fscanf(f, "%d", &v) != 1)
        v = -1;
    fclose(f);
    return v;
}

/* The CPUs the process was allowed at start, read once before main() runs
 * and never written again: a later pool must not mistake a pinned owner
 * thread's single CPU for the machine. */
static cpu_set_t threadpool_start_mask;

__attribute__((constructor)) static void threadpool_read_start_mask(void)
{
    if (sched_getaffinity(0, sizeof(threadpool_start_mask), &threadpool_start_mask) != 0)
        CPU_ZERO(&threadpool_start_mask);
}

/* One logical CPU per (package, core) pair among the CPUs the process may run on. */
static int threadpool_list_cores(int *cpus, int cap)
{
    cpu_set_t allowed = threadpool_start_mask;
    int n = 0;
    int seen_pkg[THREADPOOL_MAX_CPUS], seen_core[THREADPOOL_MAX_CPUS];
    for (int c = 0; c < CPU_SETSIZE && n < cap; c++) {
        if (!CPU_ISSET(c, &allowed))
            continue;
        char p[128];
        snprintf(p, sizeof(p), "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
        int core = threadpool_read_int(p);
        snprintf(p, sizeof(p), "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
        int pkg = threadpool_read_int(p);
        bool dup = false;
        for (int i = 0; i < n && core >= 0; i++)
            dup |= seen_core[i] == core && seen_pkg[i] == pkg;
        if (dup)
            continue;
        seen_core[n] = core;
        seen_pkg[n] = pkg;
        cpus[n++] = c;
    }
    return n;
}

int threadpool_physical_cores(void)
{
    int cpus[THREADPOOL_MAX_CPUS];
    int n = threadpool_list_cores(cpus, THREADPOOL_MAX_CPUS);
    return n > 0 ? n : 1;
}

/* Runs tasks of job gen until none is left to claim. A task claimed here
 * keeps the job open (the owner waits for it), so fn and ctx stay that job's
 * while it runs. */
static void threadpool_work(struct threadpool *pool, int thread, uint32_t gen)
{
    uint64_t w = atomic_load_explicit(&pool->work, memory_order_acquire);
    for (;;) {
        const uint32_t i = (uint32_t)w;
        if ((uint32_t)(w >> 32) != gen ||
            (int64_t)i >= atomic_load_explicit(&pool->n_tasks, memory_order_relaxed))
            return; /* another job's word, closed, or every task claimed */
        if (!atomic_compare_exchange_weak_explicit(&pool->work, &w, w + 1, memory_order_acquire,
                                                   memory_order_acquire))
            continue; /* w now holds the word as it is */
        pool->fn(pool->ctx, i, thread);
        atomic_fetch_add_explicit(&pool->completed, 1, memory_order_release);
        w = atomic_load_explicit(&pool->work, memory_order_acquire);
    }
}

static void *threadpool_main(void *arg)
{
    struct threadpool_worker *w = arg;
    struct threadpool *pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen) {
            if (++spins < THREADPOOL_SPINS)
                continue;
            threadpool_futex(&pool->generation, FUTEX_WAIT_PRIVATE, seen);
            spins = 0;
        }
        seen = gen;
        if (atomic_load(&pool->stop))
            return NULL;
        threadpool_work(pool, w->id, gen);
    }
}

static void threadpool_pin(const struct threadpool *pool, pthread_t t, int id)
{
    if (pool->n_cpus <= 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(pool->cpus[id % pool->n_cpus], &set);
    int rc = pthread_setaffinity_np(t, sizeof(set), &set);
    if (rc != 0)
        log_warn("cannot pin thread %d to cpu %d: %s", id, pool->cpus[id % pool->n_cpus],
                 strerror(rc));
}

struct threadpool *threadpool_create(const struct threadpool_config *cfg)
{
    struct threadpool *pool = calloc(1, sizeof(*pool));
    if (!pool)
        return NULL;
    pool->n_cpus = threadpool_list_cores(pool->cpus, THREADPOOL_MAX_CPUS);
    pool->n_threads = cfg->n_threads > 0 ? cfg->n_threads : (pool->n_cpus > 0 ? pool->n_cpus : 1);
    if (pool->n_threads > 1) {
        pool->workers = calloc((size_t)pool->n_threads - 1, sizeof(*pool->workers));
        if (!pool->workers)
            goto out_free;
    }
    if (!cfg->pin)
        pool->n_cpus = 0;
    /* The owner thread is not pinned: threads it creates later (other pools,
     * copy threads) would inherit a single CPU. Workers take cores 1..n-1 and
     * leave the first to the owner. */
    for (int i = 1; i < pool->n_threads; i++) {
        struct threadpool_worker *w = &pool->workers[i - 1];
        w->pool = pool;
        w->id = i;
        int rc = pthread_create(&w->thread, NULL, threadpool_main, w);
        if (rc != 0) {
            log_error("cannot start compute thread %d of %d: %s", i, pool->n_threads,
                      strerror(rc));
            pool->n_threads = i;
            threadpool_destroy(pool);
            return NULL;
        }
        threadpool_pin(pool, w->thread, i);
    }
    return pool;
out_free:
    free(pool);
    return NULL;
}

void threadpool_destroy(struct threadpool *pool)
{
    if (!pool)
        return;
    atomic_store(&pool->stop, 1);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    threadpool_futex(&pool->generation, FUTEX_WAKE_PRIVATE, INT32_MAX);
    for (int i = 1; i < pool->n_threads; i++)
        pthread_join(pool->workers[i - 1].thread, NULL);
    free(pool->workers);
    free(pool);
}

int threadpool_n_threads(const struct threadpool *pool)
{
    return pool->n_threads;
}

void threadpool_run(struct threadpool *pool, threadpool_fn fn, void *ctx, int64_t n_tasks)
{
    if (n_tasks <= 0)
        return;
    if (pool->n_threads == 1 || n_tasks == 1) {
        for (int64_t i = 0; i < n_tasks; i++)
            fn(ctx, i, 0);
        return;
    }
    ASSERT(n_tasks < THREADPOOL_CLOSED);
    /* the previous job's word is closed: no worker claims from it while
     * these change */
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&pool->completed, 0, memory_order_relaxed);
    const uint32_t gen = atomic_load_explicit(&pool->generation, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool->work, (uint64_t)gen << 32, memory_order_release);
    atomic_store_explicit(&pool->generation, gen, memory_order_release);
    threadpool_futex(&pool->generation, FUTEX_WAKE_PRIVATE, INT32_MAX);
    threadpool_work(pool, 0, gen);
    while (atomic_load_explicit(&pool->completed, memory_order_acquire) < n_tasks)
        ;
    atomic_store_explicit(&pool->work, (uint64_t)gen << 32 | THREADPOOL_CLOSED,
                          memory_order_release);
}
