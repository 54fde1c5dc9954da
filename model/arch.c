/*
 * arch: hyper-parameters and tensor binding of qwen3moe, qwen3next and
 * qwen35moe (see arch.h). Every check names the key or tensor it rejects.
 */
#include "model/arch.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "model/quant.h"

#define ARCH_MAX_DIM (1u << 24) /* sanity bound on any width or count */

struct arch_loader {
    const struct gguf *g;   /* the file */
    struct arch_model *m;   /* model being built */
    const char *prefix;     /* "qwen3moe." etc. */
};

const char *arch_kind_name(enum arch_kind kind)
{
    switch (kind) {
    case ARCH_KIND_QWEN3MOE: return "qwen3moe";
    case ARCH_KIND_QWEN3NEXT: return "qwen3next";
    case ARCH_KIND_QWEN35MOE: return "qwen35moe";
    }
    return "?";
}

uint32_t arch_conv_dim(const struct arch_hparams *hp)
{
    return 2 * hp->ssm_nk * hp->ssm_dk + hp->ssm_nv * hp->ssm_dv;
}

const uint8_t *arch_matrix_expert(const struct arch_matrix *m, uint32_t e)
{
    ASSERT(e < m->n_mat);
    return m->data + (size_t)e * m->mat_bytes;
}

/* Reads {prefix}key as u32 (scalar, or a per-layer array whose entries are all
 * equal). Returns 0, -ENOENT if absent, -EINVAL (logged) otherwise. */
static int arch_get(struct arch_loader *ld, const char *key, uint32_t *out, bool required)
{
    char full[160];
    snprintf(full, sizeof(full), "%s%s", ld->prefix, key);
    const struct gguf_kv *kv = gguf_find_kv(ld->g, full);
    if (!kv) {
        if (required)
            log_error("model metadata: required key %s is missing", full);
        return required ? -EINVAL : -ENOENT;
    }
    if (kv->type == GGUF_TYPE_ARRAY) {
        if (!gguf_type_is_int(kv->arr_type) || kv->n == 0) {
            log_error("model metadata: key %s at offset %llu is an array of %s, expected integers",
                      full, (unsigned long long)kv->file_offset, gguf_type_name(kv->arr_type));
            return -EINVAL;
        }
        int64_t v0 = gguf_arr_i64(kv, 0);
        for (uint64_t i = 1; i < kv->n; i++) {
            if (gguf_arr_i64(kv, i) != v0) {
                log_error("model metadata: key %s has different values per layer (layer %llu: "
                          "%lld, layer 0: %lld); per-layer sizes are not supported",
                          full, (unsigned long long)i, (long long)gguf_arr_i64(kv, i),
                          (long long)v0);
                return -EINVAL;
            }
        }
        if (v0 < 0 || v0 > UINT32_MAX) {
            log_error("model metadata: key %s value %lld out of range", full, (long long)v0);
            return -EINVAL;
        }
        *out = (uint32_t)v0;
        return 0;
    }
    return gguf_get_u32(ld->g, full, out) ? -EINVAL : 0;
}

static int arch_get_f32(struct arch_loader *ld, const char *key, float *out, bool required)
{
    char full[160];
    snprintf(full, sizeof(full), "%s%s", ld->prefix, key);
    int rc = gguf_get_f32(ld->g, full, out);
    if (rc == -ENOENT && required)
        log_error("model metadata: required key %s is missing", full);
    if (rc == -ENOENT && !required)
        return -ENOENT;
    return rc ? -EINVAL : 0;
}

/* Checks that v is in [lo, hi]; names the key when not. */
static int arch_range(const char *key, uint32_t v, uint32_t lo, uint32_t hi)
{
    if (v >= lo && v <= hi)
        return 0;
    log_error("model metadata: %s = %u is out of range [%u, %u]", key, v, lo, hi);
    return -EINVAL;
}

static int arch_read_attn(struct arch_loader *ld, struct arch_hparams *hp)
{
    int rc = 0;
    rc |= arch_get(ld, "attention.head_count", &hp->n_head, true);
    if (rc)
        return -EINVAL;
    hp->n_head_kv = hp->n_head;
    if (arch_get(ld, "attention.head_count_kv", &hp->n_head_kv, false) == -EINVAL)
        return -EINVAL;
    if (arch_range("attention.head_count", hp->n_head, 1, 4096) ||
        arch_range("attention.head_count_kv", hp->n_head_kv, 1, hp->n_head))
        return -EINVAL;
    if (hp->n_head % hp->n_head_kv) {
        log_error("model metadata: attention.head_count %u is not a multiple of head_count_kv %u",
                  hp->n_head, hp->n_head_kv);
        return -EINVAL;
    }
    hp->head_dim = hp->n_embd / hp->n_head;
    if (arch_get(ld, "attention.key_length", &hp->head_dim, false) == -EINVAL)
        return -EINVAL;
    uint32_t vlen = hp->head_dim;
    if (arch_get(ld, "attention.value_length", &vlen, false) == -EINVAL)
        return -EINVAL;
    if (arch_range("attention.key_length", hp->head_dim, 2, 4096))
        return -EINVAL;
    if (vlen != hp->head_dim) {
        log_error("model metadata: attention.value_length %u differs from key_length %u; "
                  "not supported", vlen, hp->head_dim);
        return -EINVAL;
    }
    hp->n_rot = hp->head_dim;
    if (arch_get(ld, "rope.dimension_count", &hp->n_rot, false) == -EINVAL)
        return -EINVAL;
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2) {
        log_error("model metadata: rope.dimension_count %u must be even and <= key_length %u",
                  hp->n_rot, hp->head_dim);
        return -EINVAL;
    }
    hp->rope_base = 10000.0f;
    if (arch_get_f32(ld, "rope.freq_base", &hp->rope_base, false) == -EINVAL)
        return -EINVAL;
    if (!(hp->rope_base > 0.0f) || isinf(hp->rope_base)) { /* NaN fails the first test */
        log_error("model metadata: rope.freq_base %g must be a finite number above 0",
                  hp->rope_base);
        return -EINVAL;
    }
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    float scale;
    rc = arch_get_f32(ld, "attention.scale", &scale, false);
    if (rc == -EINVAL)
        return rc;
    if (rc == 0 && scale != 0.0f && (!(scale > 0.0f) || isinf(scale))) {
        log_error("model metadata: attention.scale %g must be a finite number above 0 (or 0: "
                  "1/sqrt(key_length))", scale);
        return -EINVAL;
    }
    if (rc == 0 && scale != 0.0f)
        hp->attn_scale = scale;
    if (arch_get_f32(ld, "attention.layer_norm_rms_epsilon", &hp->eps, true))
        return -EINVAL;
    if (!(hp->eps > 0.0f && hp->eps < 1.0f)) {
        log_error("model metadata: layer_norm_rms_epsilon %g out of range (0, 1)", hp->eps);
        return -EINVAL;
    }
    return 0;
}

static int arch_read_sections(struct arch_loader *ld, struct arch_hparams *hp)
{
    char full[160];
    snprintf(full, sizeof(full), "%srope.dimension_sections", ld->prefix);
    const struct gguf_kv *kv = gguf_find_kv(ld->g, full);
    if (!kv) {
        if (hp->kind == ARCH_KIND_QWEN35MOE) {
            log_error("model metadata: required key %s is missing", full);
            return -EINVAL;
        }
        return 0;
    }
    if (kv->type != GGUF_TYPE_ARRAY || !gguf_type_is_int(kv->arr_type) || kv->n > 4) {
        log_error("model metadata: key %s at offset %llu must be an integer array of at most 4",
                  full, (unsigned long long)kv->file_offset);
        return -EINVAL;
    }
    int64_t sum = 0;
    for (uint64_t i = 0; i < kv->n; i++) {
        int64_t v = gguf_arr_i64(kv, i);
        if (v < 0 || v > hp->n_rot) {
            log_error("model metadata: %s[%llu] = %lld out of range", full,
                      (unsigned long long)i, (long long)v);
            return -EINVAL;
        }
        hp->rope_sections[i] = (int32_t)v;
        sum += v;
    }
    if (sum * 2 > hp->n_rot) {
        log_error("model metadata: %s sums to %lld pairs, more than rope.dimension_count/2 = %u",
                  full, (long long)sum, hp->n_rot / 2);
        return -EINVAL;
    }
    return 0;
}

static int arch_read_moe(struct arch_loader *ld, struct arch_hparams *hp)
{
    if (arch_get(ld, "expert_count", &hp->n_expert, true) ||
        arch_get(ld, "expert_used_count", &hp->n_expert_used, true))
        return -EINVAL;
    if (arch_range("expert_count", hp->n_expert, 1, 65536) ||
        arch_range("expert_used_count", hp->n_expert_used, 1, hp->n_expert))
        return -EINVAL;
    int rc = arch_get(ld, "expert_feed_forward_length", &hp->n_ff_exp, false);
    if (rc == -ENOENT) {
        uint32_t ff;
        if (arch_get(ld, "feed_forward_length", &ff, true))
            return -EINVAL;
        hp->n_ff_exp = ff / hp->n_expert_used;
    } else if (rc) {
        return rc;
    }
    if (arch_range("expert_feed_forward_length", hp->n_ff_exp, 1, ARCH_MAX_DIM))
        return -EINVAL;
    rc = arch_get(ld, "expert_shared_feed_forward_length", &hp->n_ff_shexp, false);
    return rc == -EINVAL ? rc : 0;
}

static int arch_read_ssm(struct arch_loader *ld, struct arch_hparams *hp)
{
    uint32_t inner;
    if (arch_get(ld, "ssm.conv_kernel", &hp->ssm_conv, true) ||
        arch_get(ld, "ssm.state_size", &hp->ssm_dk, true) ||
        arch_get(ld, "ssm.group_count", &hp->ssm_nk, true) ||
        arch_get(ld, "ssm.time_step_rank", &hp->ssm_nv, true) ||
        arch_get(ld, "ssm.inner_size", &inner, true))
        return -EINVAL;
    if (arch_range("ssm.conv_kernel", hp->ssm_conv, 1, 64) ||
        arch_range("ssm.state_size", hp->ssm_dk, 1, 4096) ||
        arch_range("ssm.group_count", hp->ssm_nk, 1, 4096) ||
        arch_range("ssm.time_step_rank", hp->ssm_nv, 1, 4096) ||
        arch_range("ssm.inner_size", inner, 1, ARCH_MAX_DIM))
        return -EINVAL;
    if (hp->ssm_nv % hp->ssm_nk || inner % hp->ssm_nv) {
        log_error("model metadata: ssm.time_step_rank %u must be a multiple of ssm.group_count "
                  "%u and divide ssm.inner_size %u", hp->ssm_nv, hp->ssm_nk, inner);
        return -EINVAL;
    }
    hp->ssm_dv = inner / hp->ssm_nv;
    hp->full_attn_interval = 4;
    if (arch_get(ld, "full_attention_interval", &hp->full_attn_interval, false) == -EINVAL ||
        arch_range("full_attention_interval", hp->full_attn_interval, 1, 1024))
        return -EINVAL;
    hp->ssm_tiled = hp->kind == ARCH_KIND_QWEN35MOE;
    return 0;
}

static int arch_read_hparams(struct arch_loader *ld)
{
    struct arch_hparams *hp = &ld->m->hp;
    uint32_t blocks;
    if (arch_get(ld, "block_count", &blocks, true) ||
        arch_get(ld, "embedding_length", &hp->n_embd, true) ||
        arch_get(ld, "context_length", &hp->n_ctx_train, true))
        return -EINVAL;
    if (arch_range("block_count", blocks, 1, 4096) ||
        arch_range("embedding_length", hp->n_embd, 1, ARCH_MAX_DIM))
        return -EINVAL;
    if (arch_get(ld, "nextn_predict_layers", &hp->n_nextn, false) == -EINVAL ||
        arch_range("nextn_predict_layers", hp->n_nextn, 0, blocks - 1))
        return -EINVAL;
    hp->n_layer = blocks - hp->n_nextn;
    if (hp->n_nextn)
        log_info("skipping %u multi-token-prediction block(s) after layer %u", hp->n_nextn,
                 hp->n_layer - 1);
    if (arch_read_attn(ld, hp) || arch_read_moe(ld, hp))
        return -EINVAL;
    hp->attn_gated = hp->kind != ARCH_KIND_QWEN3MOE;
    if (hp->kind != ARCH_KIND_QWEN3MOE && arch_read_ssm(ld, hp))
        return -EINVAL;
    return arch_read_sections(ld, hp);
}

/* Binds a matrix stack {n_in, n_out, n_mat}; a missing optional tensor leaves
 * m->data NULL. */
static int arch_bind(struct arch_loader *ld, struct arch_matrix *m, const char *name,
                     uint64_t n_in, uint64_t n_out, uint64_t n_mat, bool required)
{
    const struct gguf_tensor *t = gguf_find_tensor(ld->g, name);
    memset(m, 0, sizeof(*m));
    if (!t) {
        if (required)
            log_error("model: required tensor %s is missing", name);
        return required ? -EINVAL : 0;
    }
    if (t->ne[0] != (int64_t)n_in || t->ne[1] != (int64_t)n_out || t->ne[2] != (int64_t)n_mat ||
        t->ne[3] != 1) {
        log_error("model: tensor %s at offset %llu has shape {%lld, %lld, %lld, %lld}, "
                  "expected {%llu, %llu, %llu}", name, (unsigned long long)t->file_offset,
                  (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                  (long long)t->ne[3], (unsigned long long)n_in, (unsigned long long)n_out,
                  (unsigned long long)n_mat);
        return -EINVAL;
    }
    if (!quant_is_supported(t->type)) {
        const char *tn = quant_type_name(t->type);
        log_error("model: tensor %s has type %s, not supported", name, tn ? tn : "unknown");
        return -EINVAL;
    }
    m->data = t->data;
    m->type = t->type;
    m->n_in = n_in;
    m->n_out = n_out;
    m->n_mat = n_mat;
    m->row_bytes = quant_row_size(t->type, n_in);
    m->mat_bytes = m->row_bytes * n_out;
    m->name = t->name;
    return 0;
}

/* Dequantizes a small tensor of exactly n elements into an owned f32 array. */
static int arch_vector(struct arch_loader *ld, const float **out, const char *name, uint64_t n,
                       bool required)
{
    struct arch_matrix m;
    const struct gguf_tensor *t = gguf_find_tensor(ld->g, name);
    *out = NULL;
    if (!t) {
        if (required)
            log_error("model: required tensor %s is missing", name);
        return required ? -EINVAL : 0;
    }
    uint64_t rows = (uint64_t)t->ne[1] * (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
    if ((uint64_t)t->ne[0] * rows != n) {
        log_error("model: tensor %s at offset %llu has %llu elements, expected %llu", name,
                  (unsigned long long)t->file_offset,
                  (unsigned long long)((uint64_t)t->ne[0] * rows), (unsigned long long)n);
        return -EINVAL;
    }
    if (arch_bind(ld, &m, name, (uint64_t)t->ne[0], (uint64_t)t->ne[1], (uint64_t)t->ne[2], true))
        return -EINVAL;
    struct arch_model *mod = ld->m;
    if (mod->n_owned == mod->cap_owned) {
        size_t cap = mod->cap_owned ? 2 * mod->cap_owned : 64;
        float **p = realloc(mod->owned, cap * sizeof(*p));
        if (!p)
            return -ENOMEM;
        mod->owned = p;
        mod->cap_owned = cap;
    }
    float *v = malloc(n * sizeof(float));
    if (!v)
        return -ENOMEM;
    mod->owned[mod->n_owned++] = v;
    for (uint64_t r = 0; r < rows; r++)
        if (quant_dequantize_row(m.type, m.data + r * m.row_bytes, v + r * m.n_in, m.n_in))
            return -EINVAL;
    *out = v;
    return 0;
}

#define ARCH_NAME(buf, l, suffix) snprintf(buf, sizeof(buf), "blk.%u." suffix, l)

static int arch_bind_attn(struct arch_loader *ld, uint32_t l, struct arch_layer *ly)
{
    const struct arch_hparams *hp = &ld->m->hp;
    char nm[96];
    uint64_t n = hp->n_embd, hd = hp->head_dim;
    uint64_t q_out = hp->n_head * hd * (hp->attn_gated ? 2 : 1);
    int rc = 0;
    rc |= arch_bind(ld, &ly->wq, (ARCH_NAME(nm, l, "attn_q.weight"), nm), n, q_out, 1, true);
    rc |= arch_bind(ld, &ly->wk, (ARCH_NAME(nm, l, "attn_k.weight"), nm), n, hp->n_head_kv * hd, 1,
                    true);
    rc |= arch_bind(ld, &ly->wv, (ARCH_NAME(nm, l, "attn_v.weight"), nm), n, hp->n_head_kv * hd, 1,
                    true);
    rc |= arch_bind(ld, &ly->wo, (ARCH_NAME(nm, l, "attn_output.weight"), nm), hp->n_head * hd, n,
                    1, true);
    rc |= arch_vector(ld, &ly->q_norm, (ARCH_NAME(nm, l, "attn_q_norm.weight"), nm), hd, true);
    rc |= arch_vector(ld, &ly->k_norm, (ARCH_NAME(nm, l, "attn_k_norm.weight"), nm), hd, true);
    return rc ? -EINVAL : 0;
}

static int arch_bind_ssm(struct arch_loader *ld, uint32_t l, struct arch_layer *ly)
{
    const struct arch_hparams *hp = &ld->m->hp;
    char nm[96];
    uint64_t n = hp->n_embd, key_dim = (uint64_t)hp->ssm_nk * hp->ssm_dk;
    uint64_t value_dim = (uint64_t)hp->ssm_nv * hp->ssm_dv, conv_dim = arch_conv_dim(hp);
    int rc = 0;
    rc |= arch_bind(ld, &ly->wqkv, (ARCH_NAME(nm, l, "attn_qkv.weight"), nm), n, conv_dim, 1,
                    false);
    if (ly->wqkv.data)
        rc |= arch_bind(ld, &ly->wz, (ARCH_NAME(nm, l, "attn_gate.weight"), nm), n, value_dim, 1,
                        true);
    else if (!rc)
        rc |= arch_bind(ld, &ly->win, (ARCH_NAME(nm, l, "ssm_in.weight"), nm), n,
                        2 * key_dim + 2 * value_dim, 1, true);
    if (hp->kind == ARCH_KIND_QWEN35MOE) {
        rc |= arch_bind(ld, &ly->wbeta, (ARCH_NAME(nm, l, "ssm_beta.weight"), nm), n, hp->ssm_nv,
                        1, true);
        rc |= arch_bind(ld, &ly->walpha, (ARCH_NAME(nm, l, "ssm_alpha.weight"), nm), n,
                        hp->ssm_nv, 1, true);
    } else {
        rc |= arch_bind(ld, &ly->wba, (ARCH_NAME(nm, l, "ssm_ba.weight"), nm), n, 2 * hp->ssm_nv,
                        1, true);
    }
    rc |= arch_bind(ld, &ly->wout, (ARCH_NAME(nm, l, "ssm_out.weight"), nm), value_dim, n, 1, true);
    rc |= arch_vector(ld, &ly->conv, (ARCH_NAME(nm, l, "ssm_conv1d.weight"), nm),
                      conv_dim * hp->ssm_conv, true);
    rc |= arch_vector(ld, &ly->ssm_a, (ARCH_NAME(nm, l, "ssm_a"), nm), hp->ssm_nv, true);
    rc |= arch_vector(ld, &ly->dt_bias, (ARCH_NAME(nm, l, "ssm_dt.bias"), nm), hp->ssm_nv, true);
    rc |= arch_vector(ld, &ly->ssm_norm, (ARCH_NAME(nm, l, "ssm_norm.weight"), nm), hp->ssm_dv,
                      true);
    return rc ? -EINVAL : 0;
}

static int arch_bind_ffn(struct arch_loader *ld, uint32_t l, struct arch_layer *ly)
{
    struct arch_hparams *hp = &ld->m->hp;
    char nm[96];
    uint64_t n = hp->n_embd, F = hp->n_ff_exp, E = hp->n_expert;
    int rc = 0;
    rc |= arch_bind(ld, &ly->router, (ARCH_NAME(nm, l, "ffn_gate_inp.weight"), nm), n, E, 1, true);
    rc |= arch_bind(ld, &ly->gate_exps, (ARCH_NAME(nm, l, "ffn_gate_exps.weight"), nm), n, F, E,
                    false);
    if (ly->gate_exps.data)
        rc |= arch_bind(ld, &ly->up_exps, (ARCH_NAME(nm, l, "ffn_up_exps.weight"), nm), n, F, E,
                        true);
    else if (!rc)
        rc |= arch_bind(ld, &ly->gate_up_exps, (ARCH_NAME(nm, l, "ffn_gate_up_exps.weight"), nm),
                        n, 2 * F, E, true);
    rc |= arch_bind(ld, &ly->down_exps, (ARCH_NAME(nm, l, "ffn_down_exps.weight"), nm), F, n, E,
                    true);
    if (rc)
        return -EINVAL;
    const struct gguf_tensor *sh = gguf_find_tensor(ld->g, (ARCH_NAME(nm, l, "ffn_gate_shexp.weight"), nm));
    if (!sh)
        return 0;
    if (hp->n_ff_shexp == 0)
        hp->n_ff_shexp = (uint32_t)(sh->ne[1] > 0 && sh->ne[1] < ARCH_MAX_DIM ? sh->ne[1] : 0);
    uint64_t Fs = hp->n_ff_shexp;
    rc |= arch_bind(ld, &ly->gate_sh, nm, n, Fs, 1, true);
    rc |= arch_bind(ld, &ly->up_sh, (ARCH_NAME(nm, l, "ffn_up_shexp.weight"), nm), n, Fs, 1, true);
    rc |= arch_bind(ld, &ly->down_sh, (ARCH_NAME(nm, l, "ffn_down_shexp.weight"), nm), Fs, n, 1,
                    true);
    rc |= arch_vector(ld, &ly->shexp_gate, (ARCH_NAME(nm, l, "ffn_gate_inp_shexp.weight"), nm), n,
                      false);
    return rc ? -EINVAL : 0;
}

static int arch_bind_layer(struct arch_loader *ld, uint32_t l)
{
    struct arch_model *m = ld->m;
    const struct arch_hparams *hp = &m->hp;
    struct arch_layer *ly = &m->layers[l];
    char nm[96];
    ly->recurrent = hp->kind != ARCH_KIND_QWEN3MOE && (l + 1) % hp->full_attn_interval != 0;
    const char *post = hp->kind == ARCH_KIND_QWEN3MOE ? "ffn_norm.weight"
                                                       : "post_attention_norm.weight";
    int rc = arch_vector(ld, &ly->attn_norm, (ARCH_NAME(nm, l, "attn_norm.weight"), nm), hp->n_embd,
                         true);
    snprintf(nm, sizeof(nm), "blk.%u.%s", l, post);
    rc |= arch_vector(ld, &ly->ffn_norm, nm, hp->n_embd, true);
    if (rc)
        return -EINVAL;
    rc = ly->recurrent ? arch_bind_ssm(ld, l, ly) : arch_bind_attn(ld, l, ly);
    return rc ? rc : arch_bind_ffn(ld, l, ly);
}

static int arch_detect(struct arch_loader *ld)
{
    struct gguf_str s;
    if (gguf_get_str(ld->g, "general.architecture", &s)) {
        log_error("model metadata: general.architecture is missing or not a string");
        return -EINVAL;
    }
    static const char *const names[] = {"qwen3moe", "qwen3next", "qwen35moe"};
    for (int k = 0; k < 3; k++) {
        if (s.len == strlen(names[k]) && memcmp(s.ptr, names[k], s.len) == 0) {
            ld->m->hp.kind = (enum arch_kind)k;
            ld->m->hp.arch_name = names[k];
            ld->prefix = k == 0 ? "qwen3moe." : k == 1 ? "qwen3next." : "qwen35moe.";
            return 0;
        }
    }
    log_error("model: architecture '%.*s' is not supported (supported: qwen3moe, qwen3next, "
              "qwen35moe)", (int)(s.len > 64 ? 64 : s.len), s.ptr);
    return -EINVAL;
}

static int arch_bind_globals(struct arch_loader *ld)
{
    struct arch_model *m = ld->m;
    const struct gguf_tensor *te = gguf_find_tensor(ld->g, "token_embd.weight");
    if (!te) {
        log_error("model: required tensor token_embd.weight is missing");
        return -EINVAL;
    }
    if (te->ne[1] < 1 || te->ne[1] > INT32_MAX) {
        log_error("model: token_embd.weight has %lld rows", (long long)te->ne[1]);
        return -EINVAL;
    }
    m->hp.n_vocab = (uint32_t)te->ne[1];
    if (arch_bind(ld, &m->tok_embd, "token_embd.weight", m->hp.n_embd, m->hp.n_vocab, 1, true) ||
        arch_bind(ld, &m->output, "output.weight", m->hp.n_embd, m->hp.n_vocab, 1, false) ||
        arch_vector(ld, &m->output_norm, "output_norm.weight", m->hp.n_embd, true))
        return -EINVAL;
    if (!m->output.data)
        m->output = m->tok_embd;
    return 0;
}

/* A tensor of a layer past block_count means the metadata and the tensors disagree (a file
 * cut or edited by hand): refused rather than run as a shallower model. */
static int arch_check_layers(const struct arch_loader *ld)
{
    for (uint64_t i = 0; i < gguf_n_tensors(ld->g); i++) {
        const char *name = gguf_tensor_at(ld->g, i)->name;
        char *end;
        if (strncmp(name, "blk.", 4) || name[4] < '0' || name[4] > '9')
            continue;
        unsigned long l = strtoul(name + 4, &end, 10);
        if (*end == '.' && l >= ld->m->hp.n_layer) {
            log_error("model: tensor %s belongs to layer %lu, but %sblock_count is %u: the "
                      "file's metadata and tensors disagree", name, l, ld->prefix,
                      ld->m->hp.n_layer);
            return -EINVAL;
        }
    }
    return 0;
}

struct arch_model *arch_load(const struct arch_config *cfg)
{
    struct arch_model *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    struct arch_loader ld = {.g = cfg->gguf, .m = m};
    if (arch_detect(&ld) || arch_read_hparams(&ld) || arch_bind_globals(&ld) ||
        arch_check_layers(&ld))
        goto out_free;
    m->layers = calloc(m->hp.n_layer, sizeof(*m->layers));
    if (!m->layers)
        goto out_free;
    for (uint32_t l = 0; l < m->hp.n_layer; l++)
        if (arch_bind_layer(&ld, l))
            goto out_free;
    return m;
out_free:
    arch_free(m);
    return NULL;
}

void arch_free(struct arch_model *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_owned; i++)
        free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m);
}
