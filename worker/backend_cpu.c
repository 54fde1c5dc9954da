/*
 * backend_cpu: the worker backend that runs on the host (see backend.h).
 *
 * "Device memory" is a budget this backend enforces: the trunk tensors of its
 * layers, the copies of its resident experts, the KV cache and DeltaNet state
 * of every sequence slot and the scratch are charged to it at init, and a plan that does not fit is
 * refused with each part's size. Resident experts are copied out of the
 * shared-memory stacks into one buffer, as a GPU backend would upload them.
 * Foreign experts (cfg->foreign: experts of other workers' layers) are copied
 * and charged the same way and run by cpu_serve with expert_exec, the code the
 * coordinator's CPU pool runs, so their rows are bit-identical to the pool's.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "coordinator/planner.h"
#include "kernels/cpu/threadpool.h"
#include "worker/backend.h"

struct backend_cpu {
    struct threadpool *pool;
    struct forward *fw;
    struct forward_seq **seqs;       /* n_seq slots, each one sequence's KV and state */
    uint32_t n_seq;
    struct forward_seq *seq;         /* the current slot, one of seqs */
    uint8_t *expert_mem;             /* copies of the resident experts */
    struct expert_ref **refs;        /* per model layer: n_expert refs (NULL outside range) */
    uint32_t n_layer;                /* entries of refs */
    const struct arch_model *m;      /* borrowed */
    struct expert_exec *serve_x;     /* foreign experts' runner, or NULL when none */
    struct expert_ref *serve_refs;   /* refs of one serve call's groups */
};

static bool cpu_is_foreign(const struct backend_config *cfg, uint32_t l, uint32_t e)
{
    return cfg->foreign && cfg->foreign[l] && (cfg->foreign[l][e / 8] >> (e % 8)) & 1;
}

/* Held: resident in the range, or foreign outside it. */
static bool cpu_is_resident(const struct backend_config *cfg, uint32_t l, uint32_t e)
{
    if (l < cfg->layer_begin || l >= cfg->layer_end)
        return cpu_is_foreign(cfg, l, e);
    return !cfg->resident || (cfg->resident[l] && (cfg->resident[l][e / 8] >> (e % 8)) & 1);
}

static bool cpu_layer_held(const struct backend_config *cfg, uint32_t l)
{
    return (l >= cfg->layer_begin && l < cfg->layer_end) || (cfg->foreign && cfg->foreign[l]);
}

/* Trunk bytes of layer l charged to the device: what the plan placed there. */
static uint64_t cpu_trunk_bytes(const struct backend_config *cfg, uint32_t l)
{
    const struct arch_layer *ly = &cfg->model->layers[l];
    uint64_t b = 0;
    if (!cfg->trunk_on_device || cfg->trunk_on_device[l])
        b += planner_proj_bytes(ly);
    if (!cfg->shexp_on_device || cfg->shexp_on_device[l])
        b += planner_shexp_bytes(ly);
    return b;
}

/* Bytes of one sequence's KV cache and DeltaNet state over the range. */
static uint64_t cpu_state_bytes(const struct backend_config *cfg, uint32_t n_ctx)
{
    const struct arch_hparams *hp = &cfg->model->hp;
    uint64_t b = 0;
    for (uint32_t l = cfg->layer_begin; l < cfg->layer_end; l++) {
        if (cfg->model->layers[l].recurrent)
            b += ((uint64_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) +
                  (uint64_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk) * 4;
        else
            b += 2ull * n_ctx * hp->n_head_kv * hp->head_dim * (cfg->kv_f16 ? 2 : 4);
    }
    return b;
}

static int cpu_copy_experts(struct backend *b, struct backend_cpu *c,
                            const struct backend_config *cfg, uint64_t bytes)
{
    const struct arch_model *m = cfg->model;
    const uint32_t E = m->hp.n_expert;
    c->expert_mem = bytes ? malloc(bytes) : NULL;
    if (bytes && !c->expert_mem) {
        log_error("cannot allocate %llu bytes for resident experts", (unsigned long long)bytes);
        return -ENOMEM;
    }
    uint8_t *p = c->expert_mem;
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        if (!cpu_layer_held(cfg, l))
            continue;
        const struct arch_layer *ly = &m->layers[l];
        const bool fused = !ly->gate_exps.data;
        const size_t gb = fused ? ly->gate_up_exps.mat_bytes : ly->gate_exps.mat_bytes;
        const size_t ub = fused ? 0 : ly->up_exps.mat_bytes, db = ly->down_exps.mat_bytes;
        c->refs[l] = calloc(E, sizeof(struct expert_ref));
        if (!c->refs[l])
            return -ENOMEM;
        for (uint32_t e = 0; e < E; e++) {
            if (!cpu_is_resident(cfg, l, e))
                continue;
            struct expert_ref src = cfg->expert_src && cfg->expert_src[l]
                                        ? cfg->expert_src[l][e]
                                        : expert_exec_model_ref(ly, e);
            struct expert_ref *dst = &c->refs[l][e];
            dst->gate = memcpy(p, src.gate, gb), p += gb;
            dst->up = ub ? memcpy(p, src.up, ub) : NULL, p += ub;
            dst->down = memcpy(p, src.down, db), p += db;
            b->resident_experts++;
            b->foreign_experts += l < cfg->layer_begin || l >= cfg->layer_end;
        }
    }
    return 0;
}

static int cpu_check_budget(const struct backend_config *cfg, uint64_t experts, uint64_t trunk,
                            uint64_t state, uint64_t scratch)
{
    uint64_t total = experts + trunk + state + scratch;
    if (!cfg->device_mem || total <= cfg->device_mem)
        return 0;
    log_error("device memory budget of %.1f MiB is too small for layers %u-%u: resident experts "
              "%.1f MiB + trunk %.1f MiB + KV and state %.1f MiB + scratch %.1f MiB = %.1f MiB",
              cfg->device_mem / 1048576.0, cfg->layer_begin, cfg->layer_end - 1,
              experts / 1048576.0, trunk / 1048576.0, state / 1048576.0, scratch / 1048576.0,
              total / 1048576.0);
    return -ENOMEM;
}

static void cpu_fini(struct backend *b)
{
    struct backend_cpu *c = b->impl;
    if (!c)
        return;
    for (uint32_t i = 0; c->seqs && i < c->n_seq; i++)
        forward_seq_destroy(c->seqs[i]);
    free(c->seqs);
    forward_destroy(c->fw);
    threadpool_destroy(c->pool);
    for (uint32_t l = 0; c->refs && l < c->n_layer; l++)
        free(c->refs[l]);
    free(c->refs);
    free(c->expert_mem);
    expert_exec_destroy(c->serve_x);
    free(c->serve_refs);
    free(c);
    b->impl = NULL;
}

static int cpu_init(struct backend *b, const struct backend_config *cfg)
{
    const struct arch_model *m = cfg->model;
    if (cfg->handoff.recv || cfg->handoff.send) {
        log_error("the cpu backend has no device memory to hand hidden states off from");
        return -EINVAL;
    }
    struct backend_cpu *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    b->impl = c;
    c->m = m;
    c->n_layer = m->hp.n_layer;
    c->refs = calloc(c->n_layer, sizeof(*c->refs));
    if (!c->refs)
        goto out_fail;
    uint64_t experts = 0, trunk = 0;
    for (uint32_t l = cfg->layer_begin; l < cfg->layer_end; l++) {
        uint32_t held = 0;
        for (uint32_t e = 0; e < m->hp.n_expert; e++)
            held += cpu_is_resident(cfg, l, e);
        experts += held * planner_expert_bytes(&m->layers[l]);
        trunk += cpu_trunk_bytes(cfg, l);
    }
    uint32_t n_foreign = 0; /* experts of other workers' layers: charged like its own */
    for (uint32_t l = 0; cfg->foreign && l < m->hp.n_layer; l++) {
        if (l >= cfg->layer_begin && l < cfg->layer_end)
            continue;
        for (uint32_t e = 0; e < m->hp.n_expert; e++)
            if (cpu_is_foreign(cfg, l, e)) {
                experts += planner_expert_bytes(&m->layers[l]);
                n_foreign++;
            }
    }
    if (cfg->lmhead)
        trunk += m->output.mat_bytes;
    const uint32_t n_ctx = cfg->n_ctx ? cfg->n_ctx : 4096;
    const uint64_t scratch = planner_scratch_cpu(m, cfg->max_batch ? cfg->max_batch : 256);
    c->n_seq = b->n_seq;
    const uint64_t state = cpu_state_bytes(cfg, n_ctx) * c->n_seq;
    if (cpu_check_budget(cfg, experts, trunk, state, scratch))
        goto out_fail;
    if (cpu_copy_experts(b, c, cfg, experts))
        goto out_fail;
    struct threadpool_config pc = {.n_threads = cfg->n_threads, .pin = true};
    c->pool = threadpool_create(&pc);
    if (!c->pool)
        goto out_fail;
    if (n_foreign) {
        b->serve_max_rows = (cfg->max_batch ? cfg->max_batch : 256) * m->hp.n_expert_used;
        struct expert_exec_config xc = {.pool = c->pool, .n_embd = m->hp.n_embd,
                                        .n_ff = m->hp.n_ff_exp, .max_rows = b->serve_max_rows};
        c->serve_x = expert_exec_create(&xc);
        c->serve_refs = calloc(m->hp.n_expert, sizeof(*c->serve_refs));
        if (!c->serve_x || !c->serve_refs)
            goto out_fail;
    }
    struct forward_config fc = {.model = m, .pool = c->pool, .layer_begin = cfg->layer_begin,
                                .layer_end = cfg->layer_end, .n_ctx = n_ctx,
                                .kv_f16 = cfg->kv_f16, .max_batch = cfg->max_batch,
                                .expert_refs = (const struct expert_ref *const *)c->refs,
                                .remote = cfg->remote, .progress = cfg->progress};
    /* every expert not copied in goes to the remote pool */
    fc.resident = cfg->resident;
    c->fw = forward_create(&fc);
    c->seqs = c->fw ? calloc(c->n_seq, sizeof(*c->seqs)) : NULL;
    if (!c->seqs)
        goto out_fail;
    for (uint32_t i = 0; i < c->n_seq; i++)
        if (!(c->seqs[i] = forward_seq_create(c->fw)))
            goto out_fail;
    c->seq = c->seqs[0];
    b->mem_used = experts + trunk + state + scratch;
    return 0;
out_fail:
    cpu_fini(b);
    return -ENOMEM;
}

static void cpu_use_seq(struct backend *b, uint32_t seq)
{
    struct backend_cpu *c = b->impl;
    c->seq = c->seqs[seq];
}

static void cpu_reset(struct backend *b)
{
    struct backend_cpu *c = b->impl;
    forward_seq_reset(c->seq);
}

static int cpu_layers(struct backend *b, float *h, uint32_t n)
{
    struct backend_cpu *c = b->impl;
    return forward_layers(c->fw, c->seq, h, n);
}

static uint32_t cpu_pos(const struct backend *b)
{
    const struct backend_cpu *c = b->impl;
    return forward_seq_pos(c->seq);
}

static int cpu_state_save(struct backend *b, void *dst)
{
    struct backend_cpu *c = b->impl;
    forward_seq_save(c->seq, dst);
    return 0;
}

static int cpu_state_load(struct backend *b, const void *src, uint32_t pos)
{
    struct backend_cpu *c = b->impl;
    return forward_seq_load(c->seq, src, pos);
}

static int cpu_logits(struct backend *b, const float *h, uint32_t n, float *out)
{
    struct backend_cpu *c = b->impl;
    return forward_logits(c->fw, h, n, out);
}

static const struct forward_stats *cpu_stats(const struct backend *b)
{
    const struct backend_cpu *c = b->impl;
    return forward_get_stats(c->fw);
}

static int cpu_serve(struct backend *b, uint32_t layer, const uint32_t *experts,
                     const uint32_t *counts, uint32_t n_groups, const float *X, float *Y)
{
    struct backend_cpu *c = b->impl;
    if (!c->serve_x || n_groups > b->n_expert)
        return -EINVAL;
    for (uint32_t g = 0; g < n_groups; g++)
        c->serve_refs[g] = c->refs[layer][experts[g]];
    return expert_exec_run(c->serve_x, &c->m->layers[layer], c->serve_refs, counts,
                           n_groups, X, Y);
}

const struct backend_ops backend_cpu_ops = {
    .name = "cpu",
    .init = cpu_init,
    .fini = cpu_fini,
    .use_seq = cpu_use_seq,
    .reset = cpu_reset,
    .layers = cpu_layers,
    .logits = cpu_logits,
    .stats = cpu_stats,
    .serve = cpu_serve,
    .pos = cpu_pos,
    .state_save = cpu_state_save,
    .state_load = cpu_state_load,
};
