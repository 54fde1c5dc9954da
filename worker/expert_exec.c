/*
 * expert_exec: grouped routed-expert products on the CPU (see expert_exec.h).
 *
 * Two parallel jobs per call: gate and up products of every group (output
 * rows cut into chunks), then the down products. Each chunk is one
 * matvec_rows / matvec_rows_batch call whose result does not depend on how
 * rows are split.
 */
#include "worker/expert_exec.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "ipc/shm.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/ops.h"

/* One product of a job: rows [r0, r1) of W times the group's S rows of X. */
struct expert_task {
    const uint8_t *w;
    uint32_t type;
    size_t row_bytes;
    uint64_t n_in;
    const float *X;
    size_t ldx;
    uint32_t S;
    float *Y;
    size_t ldy;
    uint64_t r0, r1;
};

struct expert_exec {
    struct threadpool *pool;
    uint32_t n_embd, n_ff, max_rows;
    float *gu;                 /* [max_rows][2F]: gate | up */
    float *act;                /* [max_rows][F] */
    struct expert_task *tasks; /* cap_tasks */
    size_t n_tasks, cap_tasks;
};

struct expert_exec *expert_exec_create(const struct expert_exec_config *cfg)
{
    struct expert_exec *x = calloc(1, sizeof(*x));
    if (!x)
        return NULL;
    x->pool = cfg->pool;
    x->n_embd = cfg->n_embd;
    x->n_ff = cfg->n_ff;
    x->max_rows = cfg->max_rows;
    x->gu = malloc((size_t)cfg->max_rows * 2 * cfg->n_ff * sizeof(float));
    x->act = malloc((size_t)cfg->max_rows * cfg->n_ff * sizeof(float));
    x->cap_tasks = 4096;
    x->tasks = malloc(x->cap_tasks * sizeof(*x->tasks));
    if (!x->gu || !x->act || !x->tasks) {
        log_error("out of memory for expert scratch of %u rows", cfg->max_rows);
        expert_exec_destroy(x);
        return NULL;
    }
    return x;
}

void expert_exec_destroy(struct expert_exec *x)
{
    if (!x)
        return;
    free(x->gu);
    free(x->act);
    free(x->tasks);
    free(x);
}

struct expert_ref expert_exec_model_ref(const struct arch_layer *ly, uint32_t e)
{
    struct expert_ref r = {0};
    if (ly->gate_exps.data) {
        r.gate = arch_matrix_expert(&ly->gate_exps, e);
        r.up = arch_matrix_expert(&ly->up_exps, e);
    } else {
        r.gate = arch_matrix_expert(&ly->gate_up_exps, e);
    }
    r.down = arch_matrix_expert(&ly->down_exps, e);
    return r;
}

int expert_exec_shm_refs(const struct shm_segment *seg, uint32_t layer, uint32_t n_expert,
                         struct expert_ref *out)
{
    const bool fused = shm_entry(seg, layer, SHM_KIND_GATE) == NULL;
    for (uint32_t e = 0; e < n_expert; e++) {
        struct expert_ref *r = &out[e];
        r->gate = shm_expert(seg, layer, fused ? SHM_KIND_GATE_UP : SHM_KIND_GATE, e, NULL, NULL);
        r->up = fused ? NULL : shm_expert(seg, layer, SHM_KIND_UP, e, NULL, NULL);
        r->down = shm_expert(seg, layer, SHM_KIND_DOWN, e, NULL, NULL);
        if (!r->gate || !r->down || (!fused && !r->up)) {
            log_error("shm segment lacks the experts of layer %u", layer);
            return -EPROTO;
        }
    }
    return 0;
}

static void expert_task_run(void *ctx, int64_t i, int thread)
{
    (void)thread;
    const struct expert_task *t = &((const struct expert_task *)ctx)[i];
    if (t->S == 1)
        matvec_rows(t->type, t->w, t->row_bytes, t->X, t->n_in, t->Y, t->r0, t->r1);
    else
        matvec_rows_batch(t->type, t->w, t->row_bytes, t->X, t->ldx, t->S, t->n_in, t->Y, t->ldy,
                          t->r0, t->r1);
}

/* Appends the chunks of one product; grows the task list when needed. */
static int expert_add(struct expert_exec *x, const struct arch_matrix *m, const uint8_t *w,
                      uint64_t rows, const float *X, size_t ldx, uint32_t S, float *Y, size_t ldy,
                      uint64_t chunk)
{
    for (uint64_t r0 = 0; r0 < rows; r0 += chunk) {
        if (x->n_tasks == x->cap_tasks) {
            struct expert_task *p = realloc(x->tasks, 2 * x->cap_tasks * sizeof(*p));
            if (!p)
                return -ENOMEM;
            x->tasks = p;
            x->cap_tasks *= 2;
        }
        x->tasks[x->n_tasks++] = (struct expert_task){
            .w = w, .type = m->type, .row_bytes = m->row_bytes, .n_in = m->n_in, .X = X,
            .ldx = ldx, .S = S, .Y = Y, .ldy = ldy, .r0 = r0,
            .r1 = r0 + chunk < rows ? r0 + chunk : rows};
    }
    return 0;
}

static uint64_t expert_chunk(const struct expert_exec *x, uint64_t total_rows)
{
    uint64_t chunk = total_rows / (8 * (uint64_t)threadpool_n_threads(x->pool));
    return chunk < 16 ? 16 : (chunk + 7) / 8 * 8;
}

int expert_exec_run(struct expert_exec *x, const struct arch_layer *ly,
                    const struct expert_ref *refs, const uint32_t *counts, uint32_t n_groups,
                    const float *X, float *Y)
{
    const size_t n = x->n_embd, F = x->n_ff;
    uint64_t rows = 0;
    for (uint32_t g = 0; g < n_groups; g++)
        rows += counts[g];
    if (rows > x->max_rows) {
        log_error("expert batch of %llu rows exceeds the scratch of %u rows",
                  (unsigned long long)rows, x->max_rows);
        return -EINVAL;
    }
    const bool fused = ly->gate_exps.data == NULL;
    uint64_t chunk = expert_chunk(x, (uint64_t)n_groups * 2 * F);
    int rc = 0;
    x->n_tasks = 0;
    for (uint32_t g = 0, a = 0; g < n_groups && !rc; a += counts[g++]) {
        const float *Xg = X + (size_t)a * n;
        float *G = x->gu + (size_t)a * 2 * F;
        if (fused) {
            rc = expert_add(x, &ly->gate_up_exps, refs[g].gate, 2 * F, Xg, n, counts[g], G, 2 * F,
                            chunk);
        } else {
            rc = expert_add(x, &ly->gate_exps, refs[g].gate, F, Xg, n, counts[g], G, 2 * F, chunk);
            rc = rc ? rc : expert_add(x, &ly->up_exps, refs[g].up, F, Xg, n, counts[g], G + F,
                                      2 * F, chunk);
        }
    }
    if (rc)
        return rc;
    threadpool_run(x->pool, expert_task_run, x->tasks, (int64_t)x->n_tasks);
    for (uint64_t a = 0; a < rows; a++)
        for (size_t j = 0; j < F; j++)
            x->act[a * F + j] = ops_silu(x->gu[a * 2 * F + j]) * x->gu[a * 2 * F + F + j];
    chunk = expert_chunk(x, (uint64_t)n_groups * n);
    x->n_tasks = 0;
    for (uint32_t g = 0, a = 0; g < n_groups && !rc; a += counts[g++])
        rc = expert_add(x, &ly->down_exps, refs[g].down, n, x->act + (size_t)a * F, F, counts[g],
                        Y + (size_t)a * n, n, chunk);
    if (rc)
        return rc;
    threadpool_run(x->pool, expert_task_run, x->tasks, (int64_t)x->n_tasks);
    return 0;
}
