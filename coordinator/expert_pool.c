/*
 * expert_pool: the coordinator's CPU expert fallback (see expert_pool.h).
 */
#include "coordinator/expert_pool.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "common/check.h"
#include "common/log.h"
#include "kernels/cpu/threadpool.h"

struct expert_pool {
    const struct arch_model *model;
    const struct expert_ref *const *refs;
    struct threadpool *pool;
    struct expert_exec *xx;
    struct expert_ref *grp;   /* [n_expert] refs of one request's groups */
    uint32_t max_rows;
    double busy_s;
    uint64_t rows;
};

struct expert_pool *expert_pool_create(const struct expert_pool_config *cfg)
{
    struct expert_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->model = cfg->model;
    p->refs = cfg->refs;
    p->max_rows = cfg->max_rows;
    struct threadpool_config tc = {.n_threads = cfg->n_threads, .pin = true};
    p->pool = threadpool_create(&tc);
    p->grp = calloc(cfg->model->hp.n_expert, sizeof(*p->grp));
    if (!p->pool || !p->grp)
        goto out_fail;
    struct expert_exec_config xc = {.pool = p->pool, .n_embd = cfg->model->hp.n_embd,
                                    .n_ff = cfg->model->hp.n_ff_exp, .max_rows = cfg->max_rows};
    p->xx = expert_exec_create(&xc);
    if (!p->xx)
        goto out_fail;
    return p;
out_fail:
    expert_pool_destroy(p);
    return NULL;
}

void expert_pool_destroy(struct expert_pool *p)
{
    if (!p)
        return;
    expert_exec_destroy(p->xx);
    threadpool_destroy(p->pool);
    free(p->grp);
    free(p);
}

int expert_pool_run(struct expert_pool *p, uint32_t layer, const uint32_t *experts,
                    const uint32_t *counts, uint32_t n_groups, const float *X, float *Y)
{
    const struct arch_hparams *hp = &p->model->hp;
    if (layer >= hp->n_layer || n_groups > hp->n_expert) {
        log_error("expert request for layer %u with %u groups rejected (model: %u layers, %u "
                  "experts)", layer, n_groups, hp->n_layer, hp->n_expert);
        return -EINVAL;
    }
    uint64_t rows = 0;
    for (uint32_t g = 0; g < n_groups; g++) {
        if (experts[g] >= hp->n_expert || counts[g] == 0 || (g && experts[g] <= experts[g - 1])) {
            log_error("expert request for layer %u: group %u (expert %u, %u rows) is invalid",
                      layer, g, experts[g], counts[g]);
            return -EINVAL;
        }
        rows += counts[g];
    }
    if (rows > p->max_rows) {
        log_error("expert request for layer %u has %llu rows, more than %u", layer,
                  (unsigned long long)rows, p->max_rows);
        return -EINVAL;
    }
    const struct arch_layer *ly = &p->model->layers[layer];
    for (uint32_t g = 0; g < n_groups; g++)
        p->grp[g] = p->refs && p->refs[layer] ? p->refs[layer][experts[g]]
                                              : expert_exec_model_ref(ly, experts[g]);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = expert_exec_run(p->xx, ly, p->grp, counts, n_groups, X, Y);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    p->busy_s += (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    p->rows += rows;
    return rc;
}

double expert_pool_busy_s(const struct expert_pool *p)
{
    return p->busy_s;
}

uint64_t expert_pool_rows(const struct expert_pool *p)
{
    return p->rows;
}
