/*
 * forward: the CPU execution of decoder layers (see forward.h).
 *
 * Every matrix product goes through one job list (fw_mm_*): a set of
 * (matrix, activation rows, output rows) items whose output rows are cut
 * into chunks and spread over the pool, so that independent products (q, k
 * and v; all selected experts of a layer) form one parallel job. Routed
 * experts are grouped by id: the tokens that chose expert e are gathered into
 * one block so each expert's rows are read once per batch; their outputs are
 * added back per token in ascending top-k slot order.
 */
#include "worker/forward.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/log.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/deltanet.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/ops.h"
#include "model/quant.h"

/* One matrix product of a job: Y[s][r] = W[r] . X[s] for s < S, all rows r. */
struct fw_mm_item {
    const uint8_t *w;     /* first row */
    uint32_t type;        /* quant type */
    size_t row_bytes;     /* bytes per row */
    uint64_t n_in;        /* row length */
    uint64_t n_out;       /* rows */
    const float *X;       /* activations, S rows of ldx */
    size_t ldx;
    uint32_t S;
    float *Y;             /* outputs, S rows of ldy */
    size_t ldy;
    uint64_t first_task;  /* index of this item's first chunk in the job */
};

struct fw_mm_job {
    struct fw_mm_item *items; /* cap_items entries */
    size_t n_items, cap_items;
    uint64_t chunk;           /* output rows per task */
    uint64_t n_tasks;
};

struct forward_seq {
    struct forward *fw;   /* owner of the layout */
    uint32_t pos;         /* tokens consumed */
    void **k, **v;        /* per layer of the range: KV cache (attention layers) */
    float **conv;         /* per layer: conv state (DeltaNet layers) */
    float **ssm;          /* per layer: delta state nv x dv x dk */
};

struct forward {
    const struct arch_model *m;
    const struct arch_hparams *hp;
    struct threadpool *pool;
    uint32_t l0, l1;          /* layer range */
    uint32_t n_ctx;
    bool kv_f16;
    uint32_t B;               /* max tokens per pass */
    int nt;                   /* threads */
    struct fw_mm_job job;
    struct forward_stats stats;
    /* scratch, B rows each */
    float *xa;                /* normed input [B][n] */
    float *mix;               /* mixer / ffn output [B][n] */
    float *q, *kx, *vx;       /* projections [B][q_out], [B][kv] */
    float *att;               /* attention heads [B][n_head*hd] */
    float *qkv, *u, *z, *tin; /* DeltaNet [B][conv], [B][conv], [B][value], [B][2k+2v] */
    float *ba, *beta, *alpha; /* [B][2nv], [B][nv], [B][nv] */
    float *y;                 /* gated norm output [B][value] */
    float *rl;                /* router logits [B][E] */
    int32_t *ids;             /* [B][k] */
    float *wts;               /* [B][k] */
    uint32_t *slot_of;        /* [B][k]: assignment index of (token, slot) */
    uint32_t *cnt, *off;      /* [E] tokens per expert, first assignment */
    uint32_t *grp_expert;     /* [2E]: local groups from 0, remote groups from E */
    uint32_t *grp_count;      /* [2E]: rows of each group */
    struct expert_ref *grp_ref; /* [E]: weights of each local group */
    uint32_t n_local, n_remote; /* groups of this layer and step */
    uint32_t rows_total;      /* (token, slot) pairs of this layer and step */
    float *xg;                /* gathered expert inputs [B*k][n] */
    float *yg;                /* expert outputs [B*k][n] */
    struct expert_exec *xx;   /* routed-expert products */
    const uint8_t *const *resident;          /* borrowed, see forward_config */
    const struct expert_ref *const *expert_refs; /* borrowed */
    struct forward_remote remote;
    volatile uint64_t *progress;  /* borrowed, see forward_config */
    uint64_t *heat;               /* borrowed, see forward_config */
    float *sg;                /* shared gate|up [B][2Fs] */
    float *sact;              /* [B][Fs] */
    float *so;                /* shared out [B][n] */
    float *tscratch;          /* per thread: tstride floats */
    size_t tstride;
};

static double fw_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- matrix product jobs ---- */

static void fw_mm_reset(struct forward *fw)
{
    fw->job.n_items = 0;
}

static void fw_mm_add(struct forward *fw, const struct arch_matrix *m, const uint8_t *w,
                      const float *X, size_t ldx, uint32_t S, float *Y, size_t ldy)
{
    struct fw_mm_job *job = &fw->job;
    ASSERT(job->n_items < job->cap_items);
    job->items[job->n_items++] = (struct fw_mm_item){
        .w = w, .type = m->type, .row_bytes = m->row_bytes, .n_in = m->n_in, .n_out = m->n_out,
        .X = X, .ldx = ldx, .S = S, .Y = Y, .ldy = ldy};
}

static void fw_mm_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    struct fw_mm_job *job = ctx;
    size_t lo = 0, hi = job->n_items;
    while (hi - lo > 1) { /* last item whose first_task <= task */
        size_t mid = (lo + hi) / 2;
        if (job->items[mid].first_task <= (uint64_t)task)
            lo = mid;
        else
            hi = mid;
    }
    const struct fw_mm_item *it = &job->items[lo];
    uint64_t r0 = ((uint64_t)task - it->first_task) * job->chunk;
    uint64_t r1 = r0 + job->chunk < it->n_out ? r0 + job->chunk : it->n_out;
    if (it->S == 1)
        matvec_rows(it->type, it->w, it->row_bytes, it->X, it->n_in, it->Y, r0, r1);
    else
        matvec_rows_batch(it->type, it->w, it->row_bytes, it->X, it->ldx, it->S, it->n_in, it->Y,
                          it->ldy, r0, r1);
}

static void fw_mm_run(struct forward *fw)
{
    struct fw_mm_job *job = &fw->job;
    if (job->n_items == 0)
        return;
    uint64_t rows = 0;
    for (size_t i = 0; i < job->n_items; i++)
        rows += job->items[i].n_out;
    uint64_t chunk = rows / (uint64_t)(8 * fw->nt);
    chunk = chunk < 16 ? 16 : (chunk + 7) / 8 * 8;
    job->chunk = chunk;
    uint64_t t = 0;
    for (size_t i = 0; i < job->n_items; i++) {
        job->items[i].first_task = t;
        t += (job->items[i].n_out + chunk - 1) / chunk;
    }
    job->n_tasks = t;
    threadpool_run(fw->pool, fw_mm_task, job, (int64_t)t);
}

/* Y = W X for one matrix, as a job of its own. */
static void fw_matmul(struct forward *fw, const struct arch_matrix *m, const float *X, size_t ldx,
                      uint32_t S, float *Y, size_t ldy)
{
    fw_mm_reset(fw);
    fw_mm_add(fw, m, m->data, X, ldx, S, Y, ldy);
    fw_mm_run(fw);
}

/* ---- attention ---- */

struct fw_attn_ctx {
    struct forward *fw;
    struct forward_seq *seq;
    uint32_t layer;     /* index in the model */
    uint32_t S, pos0;
};

static size_t fw_kv_dim(const struct arch_hparams *hp)
{
    return (size_t)hp->n_head_kv * hp->head_dim;
}

/* Per token: split query and gate, q/k norms, rope, store K and V. */
static void fw_attn_prep_task(void *ctx, int64_t s, int thread)
{
    (void)thread;
    struct fw_attn_ctx *c = ctx;
    struct forward *fw = c->fw;
    const struct arch_hparams *hp = fw->hp;
    const struct arch_layer *ly = &fw->m->layers[c->layer];
    const uint32_t hd = hp->head_dim, nh = hp->n_head;
    const size_t qstride = (size_t)nh * hd * (hp->attn_gated ? 2 : 1), kvd = fw_kv_dim(hp);
    const int64_t pos = (int64_t)c->pos0 + s;
    float *qs = fw->q + s * qstride;
    for (uint32_t h = 0; h < nh; h++) {
        float *qh = qs + (size_t)h * hd * (hp->attn_gated ? 2 : 1);
        ops_rmsnorm(qh, qh, ly->q_norm, hd, hp->eps);
        ops_rope_neox(qh, hp->n_rot, pos, hp->rope_base);
    }
    float *ks = fw->kx + s * kvd, *vs = fw->vx + s * kvd;
    for (uint32_t h = 0; h < hp->n_head_kv; h++) {
        ops_rmsnorm(ks + (size_t)h * hd, ks + (size_t)h * hd, ly->k_norm, hd, hp->eps);
        ops_rope_neox(ks + (size_t)h * hd, hp->n_rot, pos, hp->rope_base);
    }
    const uint32_t li = c->layer - fw->l0;
    if (fw->kv_f16) {
        uint16_t *kc = (uint16_t *)c->seq->k[li] + (size_t)pos * kvd;
        uint16_t *vc = (uint16_t *)c->seq->v[li] + (size_t)pos * kvd;
        for (size_t i = 0; i < kvd; i++) {
            kc[i] = quant_f32_to_f16(ks[i]);
            vc[i] = quant_f32_to_f16(vs[i]);
        }
    } else {
        memcpy((float *)c->seq->k[li] + (size_t)pos * kvd, ks, kvd * sizeof(float));
        memcpy((float *)c->seq->v[li] + (size_t)pos * kvd, vs, kvd * sizeof(float));
    }
}

/* One (token, head): attention over the cache, then the output gate. */
static void fw_attn_head_task(void *ctx, int64_t task, int thread)
{
    struct fw_attn_ctx *c = ctx;
    struct forward *fw = c->fw;
    const struct arch_hparams *hp = fw->hp;
    const uint32_t hd = hp->head_dim, nh = hp->n_head;
    const uint32_t s = (uint32_t)(task / nh), h = (uint32_t)(task % nh);
    const uint32_t g = hp->attn_gated ? 2 : 1;
    const size_t kvd = fw_kv_dim(hp), esz = fw->kv_f16 ? 2 : 4;
    const uint32_t kvh = h / (nh / hp->n_head_kv), li = c->layer - fw->l0;
    const float *qh = fw->q + (size_t)s * nh * hd * g + (size_t)h * hd * g;
    float *out = fw->att + (size_t)s * nh * hd + (size_t)h * hd;
    float *scores = fw->tscratch + (size_t)thread * fw->tstride;
    attention_head(qh, (const char *)c->seq->k[li] + kvh * hd * esz,
                   (const char *)c->seq->v[li] + kvh * hd * esz, fw->kv_f16, kvd,
                   c->pos0 + s + 1, hd, hp->attn_scale, out, scores);
    if (hp->attn_gated)
        for (uint32_t i = 0; i < hd; i++)
            out[i] *= ops_sigmoid(qh[hd + i]);
}

static void fw_attention(struct forward *fw, struct forward_seq *seq, uint32_t l, uint32_t S,
                         uint32_t pos0)
{
    const struct arch_hparams *hp = fw->hp;
    const struct arch_layer *ly = &fw->m->layers[l];
    const size_t n = hp->n_embd, kvd = fw_kv_dim(hp);
    const size_t qstride = (size_t)hp->n_head * hp->head_dim * (hp->attn_gated ? 2 : 1);
    fw_mm_reset(fw);
    fw_mm_add(fw, &ly->wq, ly->wq.data, fw->xa, n, S, fw->q, qstride);
    fw_mm_add(fw, &ly->wk, ly->wk.data, fw->xa, n, S, fw->kx, kvd);
    fw_mm_add(fw, &ly->wv, ly->wv.data, fw->xa, n, S, fw->vx, kvd);
    fw_mm_run(fw);
    struct fw_attn_ctx c = {.fw = fw, .seq = seq, .layer = l, .S = S, .pos0 = pos0};
    threadpool_run(fw->pool, fw_attn_prep_task, &c, S);
    threadpool_run(fw->pool, fw_attn_head_task, &c, (int64_t)S * hp->n_head);
    fw_matmul(fw, &ly->wo, fw->att, (size_t)hp->n_head * hp->head_dim, S, fw->mix, n);
}

/* ---- gated DeltaNet ---- */

struct fw_dn_ctx {
    struct forward *fw;
    struct forward_seq *seq;
    uint32_t layer;
    uint32_t S;
    uint64_t chunk; /* channels per conv task */
};

static void fw_dn_conv_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    struct fw_dn_ctx *c = ctx;
    struct forward *fw = c->fw;
    const struct arch_hparams *hp = fw->hp;
    const uint32_t K = hp->ssm_conv, cd = arch_conv_dim(hp);
    const struct arch_layer *ly = &fw->m->layers[c->layer];
    float *state = c->seq->conv[c->layer - fw->l0];
    uint64_t c0 = (uint64_t)task * c->chunk, c1 = c0 + c->chunk < cd ? c0 + c->chunk : cd;
    for (uint64_t ch = c0; ch < c1; ch++)
        deltanet_conv_channel(state + ch * (K - 1), ly->conv + ch * K, K, fw->qkv + ch, cd,
                              fw->u + ch, cd, c->S);
}

/* Normalised q and k of key head g for token s into q, k (dk each). */
static void fw_dn_qk(const struct forward *fw, const float *us, uint32_t g, float *q, float *k)
{
    const struct arch_hparams *hp = fw->hp;
    const uint32_t dk = hp->ssm_dk;
    const size_t key_dim = (size_t)hp->ssm_nk * dk;
    memcpy(q, us + (size_t)g * dk, dk * sizeof(float));
    memcpy(k, us + key_dim + (size_t)g * dk, dk * sizeof(float));
    ops_l2norm(q, dk, hp->eps);
    ops_l2norm(k, dk, hp->eps);
}

/* One value head over all S tokens: normalise q and k of its key head, run
 * the delta rule (token by token for decode, chunked for prefill), gated
 * norm into y. */
static void fw_dn_head_task(void *ctx, int64_t task, int thread)
{
    struct fw_dn_ctx *c = ctx;
    struct forward *fw = c->fw;
    const struct arch_hparams *hp = fw->hp;
    const struct arch_layer *ly = &fw->m->layers[c->layer];
    const uint32_t h = (uint32_t)task, dk = hp->ssm_dk, dv = hp->ssm_dv, nv = hp->ssm_nv;
    const uint32_t g = hp->ssm_tiled ? h % hp->ssm_nk : h / (nv / hp->ssm_nk), S = c->S;
    const size_t cd = arch_conv_dim(hp), key_dim = (size_t)hp->ssm_nk * dk, vd = (size_t)nv * dv;
    float *state = c->seq->ssm[c->layer - fw->l0] + (size_t)h * dk * dv;
    float *qn = fw->tscratch + (size_t)thread * fw->tstride, *kn = qn + (size_t)S * dk;
    float *bb = kn + (size_t)S * dk, *gg = bb + S, *oo = gg + S, *cs = oo + (size_t)S * dv;
    for (uint32_t s = 0; s < S; s++) {
        fw_dn_qk(fw, fw->u + s * cd, g, qn + (size_t)s * dk, kn + (size_t)s * dk);
        bb[s] = ops_sigmoid(fw->beta[(size_t)s * nv + h]);
        gg[s] = ly->ssm_a[h] * ops_softplus(fw->alpha[(size_t)s * nv + h] + ly->dt_bias[h]);
    }
    const float *v = fw->u + 2 * key_dim + (size_t)h * dv;
    if (S == 1) {
        const float qscale = 1.0f / sqrtf((float)dk);
        for (uint32_t i = 0; i < dk; i++)
            qn[i] *= qscale;
        deltanet_head_step(state, qn, kn, v, bb[0], gg[0], dk, dv, oo);
    } else {
        deltanet_chunk_head(state, qn, dk, kn, dk, v, cd, bb, gg, S, dk, dv, oo, dv, cs);
    }
    for (uint32_t s = 0; s < S; s++)
        deltanet_gated_norm(fw->y + s * vd + (size_t)h * dv, oo + (size_t)s * dv,
                            fw->z + s * vd + (size_t)h * dv, ly->ssm_norm, dv, hp->eps);
}

/* Legacy ssm_in rows are nk groups of [q dk | k dk | v r*dv | z r*dv]. */
static void fw_dn_unpack_legacy(struct forward *fw, uint32_t S)
{
    const struct arch_hparams *hp = fw->hp;
    const size_t dk = hp->ssm_dk, dv = hp->ssm_dv, nk = hp->ssm_nk, r = hp->ssm_nv / nk;
    const size_t key_dim = nk * dk, vd = (size_t)hp->ssm_nv * dv, cd = arch_conv_dim(hp);
    const size_t gsz = 2 * dk + 2 * r * dv, tw = 2 * key_dim + 2 * vd;
    for (uint32_t s = 0; s < S; s++) {
        const float *t = fw->tin + s * tw;
        float *qkv = fw->qkv + s * cd, *z = fw->z + s * vd;
        for (size_t g = 0; g < nk; g++) {
            const float *ch = t + g * gsz;
            memcpy(qkv + g * dk, ch, dk * sizeof(float));
            memcpy(qkv + key_dim + g * dk, ch + dk, dk * sizeof(float));
            memcpy(qkv + 2 * key_dim + g * r * dv, ch + 2 * dk, r * dv * sizeof(float));
            memcpy(z + g * r * dv, ch + 2 * dk + r * dv, r * dv * sizeof(float));
        }
    }
}

/* Splits ssm_ba (grouped: per key group, r betas then r alphas). */
static void fw_dn_split_ba(struct forward *fw, uint32_t S)
{
    const struct arch_hparams *hp = fw->hp;
    const uint32_t nv = hp->ssm_nv, r = nv / hp->ssm_nk;
    for (uint32_t s = 0; s < S; s++) {
        const float *ba = fw->ba + (size_t)s * 2 * nv;
        for (uint32_t h = 0; h < nv; h++) {
            const uint32_t g = h / r, j = h % r;
            fw->beta[(size_t)s * nv + h] = ba[g * 2 * r + j];
            fw->alpha[(size_t)s * nv + h] = ba[g * 2 * r + r + j];
        }
    }
}

static void fw_deltanet(struct forward *fw, struct forward_seq *seq, uint32_t l, uint32_t S)
{
    const struct arch_hparams *hp = fw->hp;
    const struct arch_layer *ly = &fw->m->layers[l];
    const size_t n = hp->n_embd, cd = arch_conv_dim(hp), nv = hp->ssm_nv;
    const size_t vd = nv * hp->ssm_dv, key_dim = (size_t)hp->ssm_nk * hp->ssm_dk;
    fw_mm_reset(fw);
    if (ly->wqkv.data) {
        fw_mm_add(fw, &ly->wqkv, ly->wqkv.data, fw->xa, n, S, fw->qkv, cd);
        fw_mm_add(fw, &ly->wz, ly->wz.data, fw->xa, n, S, fw->z, vd);
    } else {
        fw_mm_add(fw, &ly->win, ly->win.data, fw->xa, n, S, fw->tin, 2 * key_dim + 2 * vd);
    }
    if (ly->wba.data) {
        fw_mm_add(fw, &ly->wba, ly->wba.data, fw->xa, n, S, fw->ba, 2 * nv);
    } else {
        fw_mm_add(fw, &ly->wbeta, ly->wbeta.data, fw->xa, n, S, fw->beta, nv);
        fw_mm_add(fw, &ly->walpha, ly->walpha.data, fw->xa, n, S, fw->alpha, nv);
    }
    fw_mm_run(fw);
    if (!ly->wqkv.data)
        fw_dn_unpack_legacy(fw, S);
    if (ly->wba.data)
        fw_dn_split_ba(fw, S);
    struct fw_dn_ctx c = {.fw = fw, .seq = seq, .layer = l, .S = S};
    c.chunk = (cd + 4 * (uint64_t)fw->nt - 1) / (4 * (uint64_t)fw->nt);
    threadpool_run(fw->pool, fw_dn_conv_task, &c, (int64_t)((cd + c.chunk - 1) / c.chunk));
    threadpool_run(fw->pool, fw_dn_head_task, &c, (int64_t)nv);
    fw_matmul(fw, &ly->wout, fw->y, vd, S, fw->mix, n);
}

/* ---- experts ---- */

static bool fw_is_resident(const struct forward *fw, uint32_t l, uint32_t e)
{
    return !fw->resident || (fw->resident[l] && (fw->resident[l][e / 8] >> (e % 8)) & 1);
}

/* Routes each token, then orders the (token, slot) pairs by expert: the
 * groups of resident experts first (ascending id), then the others. Returns
 * the rows of resident groups; fills fw->grp_* lists. */
static uint32_t fw_route(struct forward *fw, uint32_t l, uint32_t S)
{
    const struct arch_hparams *hp = fw->hp;
    const struct arch_layer *ly = &fw->m->layers[l];
    const uint32_t E = hp->n_expert, k = hp->n_expert_used;
    fw_matmul(fw, &ly->router, fw->xa, hp->n_embd, S, fw->rl, E);
    memset(fw->cnt, 0, E * sizeof(uint32_t));
    for (uint32_t s = 0; s < S; s++) {
        ops_router_topk(fw->rl + (size_t)s * E, E, k, fw->ids + (size_t)s * k,
                        fw->wts + (size_t)s * k);
        for (uint32_t i = 0; i < k; i++)
            fw->cnt[fw->ids[(size_t)s * k + i]]++;
    }
    for (uint32_t e = 0; fw->heat && e < E; e++)
        fw->heat[(size_t)l * E + e] += fw->cnt[e];
    uint32_t total = 0, local_rows = 0;
    fw->n_local = fw->n_remote = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t e = 0; e < E; e++) {
            if (!fw->cnt[e] || fw_is_resident(fw, l, e) != (pass == 0))
                continue;
            fw->off[e] = total;
            total += fw->cnt[e];
            uint32_t g = pass == 0 ? fw->n_local++ : E + fw->n_remote++;
            fw->grp_expert[g] = e;
            fw->grp_count[g] = fw->cnt[e];
        }
        if (pass == 0)
            local_rows = total;
    }
    memset(fw->cnt, 0, E * sizeof(uint32_t));
    const size_t n = hp->n_embd;
    for (uint32_t s = 0; s < S; s++) {
        for (uint32_t i = 0; i < k; i++) {
            const uint32_t e = (uint32_t)fw->ids[(size_t)s * k + i];
            const uint32_t a = fw->off[e] + fw->cnt[e]++;
            fw->slot_of[(size_t)s * k + i] = a;
            memcpy(fw->xg + a * n, fw->xa + (size_t)s * n, n * sizeof(float));
        }
    }
    fw->rows_total = total;
    return local_rows;
}

static int fw_local_experts(struct forward *fw, uint32_t l)
{
    const struct arch_layer *ly = &fw->m->layers[l];
    const struct expert_ref *table = fw->expert_refs ? fw->expert_refs[l] : NULL;
    for (uint32_t g = 0; g < fw->n_local; g++) {
        uint32_t e = fw->grp_expert[g];
        fw->grp_ref[g] = table ? table[e] : expert_exec_model_ref(ly, e);
    }
    return expert_exec_run(fw->xx, ly, fw->grp_ref, fw->grp_count, fw->n_local, fw->xg, fw->yg);
}

static void fw_shared_expert(struct forward *fw, const struct arch_layer *ly, uint32_t S)
{
    const size_t n = fw->hp->n_embd, Fs = fw->hp->n_ff_shexp;
    fw_mm_reset(fw);
    fw_mm_add(fw, &ly->gate_sh, ly->gate_sh.data, fw->xa, n, S, fw->sg, 2 * Fs);
    fw_mm_add(fw, &ly->up_sh, ly->up_sh.data, fw->xa, n, S, fw->sg + Fs, 2 * Fs);
    fw_mm_run(fw);
    for (size_t a = 0; a < S; a++)
        for (size_t j = 0; j < Fs; j++)
            fw->sact[a * Fs + j] = ops_silu(fw->sg[a * 2 * Fs + j]) * fw->sg[a * 2 * Fs + Fs + j];
    fw_matmul(fw, &ly->down_sh, fw->sact, Fs, S, fw->so, n);
}

/* out[s] = sum over slots (ascending) of w * expert output, + gated shared. */
static void fw_moe_combine(struct forward *fw, const struct arch_layer *ly, uint32_t S)
{
    const size_t n = fw->hp->n_embd, k = fw->hp->n_expert_used;
    for (uint32_t s = 0; s < S; s++) {
        float *out = fw->mix + (size_t)s * n;
        memset(out, 0, n * sizeof(float));
        for (size_t i = 0; i < k; i++) {
            const float w = fw->wts[s * k + i];
            const float *ye = fw->yg + (size_t)fw->slot_of[s * k + i] * n;
            for (size_t j = 0; j < n; j++)
                out[j] += w * ye[j];
        }
        if (!ly->gate_sh.data)
            continue;
        float gs = 1.0f;
        if (ly->shexp_gate) {
            float d = 0.0f;
            const float *f = fw->xa + (size_t)s * n;
            for (size_t j = 0; j < n; j++)
                d += ly->shexp_gate[j] * f[j];
            gs = ops_sigmoid(d);
        }
        const float *so = fw->so + (size_t)s * n;
        for (size_t j = 0; j < n; j++)
            out[j] += gs * so[j];
    }
}

static int fw_moe(struct forward *fw, uint32_t l, uint32_t S)
{
    const struct arch_layer *ly = &fw->m->layers[l];
    const size_t n = fw->hp->n_embd, E = fw->hp->n_expert;
    double t0 = fw_now();
    const uint32_t local_rows = fw_route(fw, l, S);
    const uint32_t remote_rows = fw->rows_total - local_rows;
    double t1 = fw_now();
    int rc = 0;
    if (fw->n_remote) {
        if (!fw->remote.submit) {
            log_error("layer %u: %u experts are not resident and no remote pool is set", l,
                      fw->n_remote);
            return -EINVAL;
        }
        rc = fw->remote.submit(fw->remote.ctx, l, fw->grp_expert + E, fw->grp_count + E,
                               fw->n_remote, fw->xg + (size_t)local_rows * n, remote_rows);
    }
    rc = rc ? rc : fw_local_experts(fw, l);
    double t2 = fw_now();
    if (!rc && ly->gate_sh.data)
        fw_shared_expert(fw, ly, S);
    double t3 = fw_now();
    if (!rc && fw->n_remote)
        rc = fw->remote.collect(fw->remote.ctx, l, fw->yg + (size_t)local_rows * n, remote_rows);
    double t4 = fw_now();
    if (rc)
        return rc;
    fw_moe_combine(fw, ly, S);
    fw->stats.router += t1 - t0;
    fw->stats.experts += t2 - t1;
    fw->stats.shared_expert += t3 - t2;
    fw->stats.remote_wait += t4 - t3;
    fw->stats.expert_rows += local_rows;
    fw->stats.remote_rows += remote_rows;
    return 0;
}

/* ---- public ---- */

static void fw_residual(float *h, const float *d, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h[i] += d[i];
}

static int fw_layers_pass(struct forward *fw, struct forward_seq *seq, float *h, uint32_t S)
{
    const struct arch_hparams *hp = fw->hp;
    const size_t n = hp->n_embd;
    const uint32_t pos0 = seq->pos;
    for (uint32_t l = fw->l0; l < fw->l1; l++) {
        const struct arch_layer *ly = &fw->m->layers[l];
        for (uint32_t s = 0; s < S; s++)
            ops_rmsnorm(fw->xa + s * n, h + s * n, ly->attn_norm, (uint32_t)n, hp->eps);
        double t0 = fw_now();
        if (ly->recurrent)
            fw_deltanet(fw, seq, l, S);
        else
            fw_attention(fw, seq, l, S, pos0);
        *(ly->recurrent ? &fw->stats.deltanet : &fw->stats.attn) += fw_now() - t0;
        fw_residual(h, fw->mix, (size_t)S * n);
        for (uint32_t s = 0; s < S; s++)
            ops_rmsnorm(fw->xa + s * n, h + s * n, ly->ffn_norm, (uint32_t)n, hp->eps);
        int rc = fw_moe(fw, l, S);
        if (rc)
            return rc;
        fw_residual(h, fw->mix, (size_t)S * n);
        if (fw->progress)
            __atomic_add_fetch(fw->progress, 1, __ATOMIC_RELAXED);
    }
    seq->pos += S;
    fw->stats.tokens += S;
    return 0;
}

int forward_layers(struct forward *fw, struct forward_seq *seq, float *h, uint32_t n)
{
    if ((uint64_t)seq->pos + n > fw->n_ctx) {
        log_error("context full: %u tokens at position %u exceed the context of %u", n, seq->pos,
                  fw->n_ctx);
        return -ENOSPC;
    }
    for (uint32_t s = 0; s < n; s += fw->B) {
        uint32_t S = n - s < fw->B ? n - s : fw->B;
        int rc = fw_layers_pass(fw, seq, h + (size_t)s * fw->hp->n_embd, S);
        if (rc)
            return rc;
    }
    return 0;
}

int forward_embed(struct forward *fw, const int32_t *tokens, uint32_t n, float *h)
{
    const struct arch_matrix *te = &fw->m->tok_embd;
    for (uint32_t s = 0; s < n; s++) {
        if (tokens[s] < 0 || (uint32_t)tokens[s] >= fw->hp->n_vocab) {
            log_error("token id %d at position %u is outside the vocabulary of %u", tokens[s], s,
                      fw->hp->n_vocab);
            return -EINVAL;
        }
        if (quant_dequantize_row(te->type, te->data + (size_t)tokens[s] * te->row_bytes,
                                 h + (size_t)s * te->n_in, te->n_in))
            return -EINVAL;
    }
    return 0;
}

int forward_logits(struct forward *fw, const float *h, uint32_t n, float *logits)
{
    const size_t ne = fw->hp->n_embd;
    for (uint32_t s = 0; s < n; s += fw->B) {
        uint32_t S = n - s < fw->B ? n - s : fw->B;
        for (uint32_t i = 0; i < S; i++)
            ops_rmsnorm(fw->xa + i * ne, h + (s + i) * ne, fw->m->output_norm, (uint32_t)ne,
                        fw->hp->eps);
        fw_matmul(fw, &fw->m->output, fw->xa, ne, S, logits + (size_t)s * fw->hp->n_vocab,
                  fw->hp->n_vocab);
    }
    return 0;
}

const struct forward_stats *forward_get_stats(const struct forward *fw)
{
    return &fw->stats;
}

void forward_stats_reset(struct forward *fw)
{
    memset(&fw->stats, 0, sizeof(fw->stats));
}

uint32_t forward_n_ctx(const struct forward *fw)
{
    return fw->n_ctx;
}

/* ---- lifecycle ---- */

static int fw_alloc(void **p, size_t bytes)
{
    *p = bytes ? calloc(1, bytes) : NULL;
    if (bytes && !*p) {
        log_error("out of memory allocating %zu bytes of forward scratch", bytes);
        return -ENOMEM;
    }
    return 0;
}

#define FW_ALLOC(ptr, count) fw_alloc((void **)&(ptr), (size_t)(count) * sizeof(*(ptr)))

static int fw_alloc_scratch(struct forward *fw)
{
    const struct arch_hparams *hp = fw->hp;
    const size_t B = fw->B, n = hp->n_embd, hd = hp->head_dim;
    const size_t q_out = (size_t)hp->n_head * hd * 2, kvd = fw_kv_dim(hp);
    const size_t cd = hp->kind == ARCH_KIND_QWEN3MOE ? 0 : arch_conv_dim(hp);
    const size_t vd = (size_t)hp->ssm_nv * hp->ssm_dv, kd = (size_t)hp->ssm_nk * hp->ssm_dk;
    const size_t E = hp->n_expert, k = hp->n_expert_used, F = hp->n_ff_exp;
    const size_t Fs = hp->n_ff_shexp;
    size_t ts = fw->n_ctx + 64;
    if (cd) {
        size_t dn = B * (2 * (size_t)hp->ssm_dk + hp->ssm_dv + 2) +
                    deltanet_chunk_scratch(hp->ssm_dk, hp->ssm_dv) + 64;
        ts = ts > dn ? ts : dn;
    }
    fw->tstride = (ts + 15) / 16 * 16;
    int rc = 0;
    rc |= FW_ALLOC(fw->xa, B * n) | FW_ALLOC(fw->mix, B * n) | FW_ALLOC(fw->q, B * q_out);
    rc |= FW_ALLOC(fw->kx, B * kvd) | FW_ALLOC(fw->vx, B * kvd);
    rc |= FW_ALLOC(fw->att, B * hp->n_head * hd);
    rc |= FW_ALLOC(fw->qkv, B * cd) | FW_ALLOC(fw->u, B * cd) | FW_ALLOC(fw->z, B * vd);
    rc |= FW_ALLOC(fw->tin, cd ? B * (2 * kd + 2 * vd) : 0);
    rc |= FW_ALLOC(fw->ba, B * 2 * hp->ssm_nv) | FW_ALLOC(fw->beta, B * hp->ssm_nv);
    rc |= FW_ALLOC(fw->alpha, B * hp->ssm_nv) | FW_ALLOC(fw->y, B * vd);
    rc |= FW_ALLOC(fw->rl, B * E) | FW_ALLOC(fw->ids, B * k) | FW_ALLOC(fw->wts, B * k);
    rc |= FW_ALLOC(fw->slot_of, B * k) | FW_ALLOC(fw->cnt, E) | FW_ALLOC(fw->off, E);
    rc |= FW_ALLOC(fw->grp_expert, 2 * E) | FW_ALLOC(fw->grp_count, 2 * E);
    rc |= FW_ALLOC(fw->grp_ref, E);
    rc |= FW_ALLOC(fw->xg, B * k * n) | FW_ALLOC(fw->yg, B * k * n);
    rc |= FW_ALLOC(fw->sg, B * 2 * Fs) | FW_ALLOC(fw->sact, B * Fs) | FW_ALLOC(fw->so, B * n);
    rc |= FW_ALLOC(fw->tscratch, (size_t)fw->nt * fw->tstride);
    fw->job.cap_items = 16;
    rc |= FW_ALLOC(fw->job.items, fw->job.cap_items);
    if (rc)
        return -ENOMEM;
    struct expert_exec_config xc = {.pool = fw->pool, .n_embd = (uint32_t)n, .n_ff = (uint32_t)F,
                                    .max_rows = (uint32_t)(B * k)};
    fw->xx = expert_exec_create(&xc);
    return fw->xx ? 0 : -ENOMEM;
}

struct forward *forward_create(const struct forward_config *cfg)
{
    const struct arch_model *m = cfg->model;
    struct forward *fw = calloc(1, sizeof(*fw));
    if (!fw)
        return NULL;
    fw->m = m;
    fw->hp = &m->hp;
    fw->pool = cfg->pool;
    fw->nt = threadpool_n_threads(cfg->pool);
    fw->l0 = cfg->layer_begin;
    fw->l1 = cfg->layer_end ? cfg->layer_end : m->hp.n_layer;
    fw->kv_f16 = cfg->kv_f16;
    fw->B = cfg->max_batch ? cfg->max_batch : 256;
    fw->n_ctx = cfg->n_ctx;
    fw->resident = cfg->resident;
    fw->expert_refs = cfg->expert_refs;
    fw->remote = cfg->remote;
    fw->progress = cfg->progress;
    fw->heat = cfg->heat;
    if (!fw->n_ctx)
        fw->n_ctx = m->hp.n_ctx_train && m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096;
    if (fw->l0 >= fw->l1 || fw->l1 > m->hp.n_layer) {
        log_error("bad layer range %u-%u for a model of %u layers", fw->l0, fw->l1,
                  m->hp.n_layer);
        goto out_free;
    }
    if (fw_alloc_scratch(fw))
        goto out_free;
    return fw;
out_free:
    forward_destroy(fw);
    return NULL;
}

void forward_destroy(struct forward *fw)
{
    if (!fw)
        return;
    void *bufs[] = {fw->xa, fw->mix, fw->q, fw->kx, fw->vx, fw->att, fw->qkv, fw->u, fw->z,
                    fw->tin, fw->ba, fw->beta, fw->alpha, fw->y, fw->rl, fw->ids, fw->wts,
                    fw->slot_of, fw->cnt, fw->off, fw->grp_expert, fw->grp_count, fw->grp_ref,
                    fw->xg, fw->yg, fw->sg, fw->sact, fw->so, fw->tscratch, fw->job.items};
    expert_exec_destroy(fw->xx);
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        free(bufs[i]);
    free(fw);
}

struct forward_seq *forward_seq_create(struct forward *fw)
{
    const struct arch_hparams *hp = fw->hp;
    const uint32_t nl = fw->l1 - fw->l0;
    struct forward_seq *seq = calloc(1, sizeof(*seq));
    if (!seq)
        return NULL;
    seq->fw = fw;
    int rc = FW_ALLOC(seq->k, nl) | FW_ALLOC(seq->v, nl) | FW_ALLOC(seq->conv, nl) |
             FW_ALLOC(seq->ssm, nl);
    const size_t kv_bytes = (size_t)fw->n_ctx * fw_kv_dim(hp) * (fw->kv_f16 ? 2 : 4);
    for (uint32_t i = 0; i < nl && !rc; i++) {
        if (fw->m->layers[fw->l0 + i].recurrent) {
            rc |= FW_ALLOC(seq->conv[i], (size_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) + 1);
            rc |= FW_ALLOC(seq->ssm[i], (size_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk);
        } else {
            rc |= fw_alloc(&seq->k[i], kv_bytes) | fw_alloc(&seq->v[i], kv_bytes);
        }
    }
    if (rc) {
        forward_seq_destroy(seq);
        return NULL;
    }
    return seq;
}

void forward_seq_destroy(struct forward_seq *seq)
{
    if (!seq)
        return;
    const uint32_t nl = seq->fw->l1 - seq->fw->l0;
    for (uint32_t i = 0; i < nl; i++) {
        if (seq->k)
            free(seq->k[i]);
        if (seq->v)
            free(seq->v[i]);
        if (seq->conv)
            free(seq->conv[i]);
        if (seq->ssm)
            free(seq->ssm[i]);
    }
    free(seq->k);
    free(seq->v);
    free(seq->conv);
    free(seq->ssm);
    free(seq);
}

void forward_seq_reset(struct forward_seq *seq)
{
    const struct forward *fw = seq->fw;
    const struct arch_hparams *hp = fw->hp;
    for (uint32_t i = 0; i < fw->l1 - fw->l0; i++) {
        if (seq->conv[i])
            memset(seq->conv[i], 0, (size_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) * sizeof(float));
        if (seq->ssm[i])
            memset(seq->ssm[i], 0, (size_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk * sizeof(float));
    }
    seq->pos = 0;
}

size_t forward_state_bytes(const struct arch_model *m, uint32_t l0, uint32_t l1, uint32_t pos,
                           bool kv_f16)
{
    const struct arch_hparams *hp = &m->hp;
    const size_t dn = ((size_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) +
                       (size_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk) * sizeof(float);
    const size_t kv = 2 * (size_t)pos * fw_kv_dim(hp) * (kv_f16 ? 2 : 4);
    size_t bytes = 0;
    for (uint32_t l = l0; l < l1; l++)
        bytes += m->layers[l].recurrent ? dn : kv;
    return bytes;
}

/* Copies seq's state to (save) or from (load) the snapshot at p. */
static void fw_seq_copy(struct forward_seq *seq, uint8_t *p, bool save)
{
    const struct forward *fw = seq->fw;
    const struct arch_hparams *hp = fw->hp;
    const size_t conv = (size_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) * sizeof(float);
    const size_t ssm = (size_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk * sizeof(float);
    const size_t kv = (size_t)seq->pos * fw_kv_dim(hp) * (fw->kv_f16 ? 2 : 4);
    for (uint32_t i = 0; i < fw->l1 - fw->l0; i++) {
        void *part[2] = {seq->k[i], seq->v[i]};
        size_t size[2] = {kv, kv};
        if (fw->m->layers[fw->l0 + i].recurrent) {
            part[0] = seq->conv[i], part[1] = seq->ssm[i];
            size[0] = conv, size[1] = ssm;
        }
        for (int j = 0; j < 2; j++) {
            if (save)
                memcpy(p, part[j], size[j]);
            else
                memcpy(part[j], p, size[j]);
            p += size[j];
        }
    }
}

void forward_seq_save(const struct forward_seq *seq, void *dst)
{
    fw_seq_copy((struct forward_seq *)seq, dst, true);
}

int forward_seq_load(struct forward_seq *seq, const void *src, uint32_t pos)
{
    if (pos > seq->fw->n_ctx) {
        log_error("snapshot of %u tokens does not fit the context of %u", pos, seq->fw->n_ctx);
        return -ENOSPC;
    }
    seq->pos = pos;
    fw_seq_copy(seq, (uint8_t *)src, false);
    return 0;
}

uint32_t forward_seq_pos(const struct forward_seq *seq)
{
    return seq->pos;
}
