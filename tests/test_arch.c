/*
 * test_arch: arch_load on the conformance fixtures and on broken copies.
 *
 * Acceptance: each *-f32.gguf and *-q8_0.gguf fixture loads, and its
 * hyper-parameters equal the values of refs.json[arch].config (hidden size,
 * layers, heads, kv heads, head dim, rotated dims from partial_rotary_factor,
 * rope base, eps, experts, top-k, expert widths, vocab, context, the linear
 * attention sizes, qwen35moe's rope sections); the layers marked
 * linear_attention in layer_types are exactly the recurrent ones, with the
 * DeltaNet tensors bound and no attention tensors (and the reverse for
 * attention layers); matrix stacks have their expected shapes and types.
 *
 * Rejection: a copy of the qwen3next q8_0 fixture with one thing changed
 * (written with gguf_writer: every key and tensor copied, one dropped or
 * altered) must make arch_load return NULL with an error (read through
 * log_last_error) naming the key or tensor: missing required keys, top-k
 * above the expert count, kv heads not dividing heads, odd rope dims,
 * DeltaNet head counts that do not divide, per-layer arrays with different
 * values, an unknown architecture, a missing tensor, a matrix and a vector
 * of the wrong shape, and tensors of unsupported types (Q8_1, MXFP4, I32;
 * IQ2_XXS needs rows of 256 and no tensor here has them). An unedited copy
 * loads with the same hyper-parameters (the copier itself is faithful).
 */
#include "model/arch.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/quant.h"
#include "tests/check.h"
#include "tests/fixture.h"

/* ---- refs.json config values ---- */

/* The config section of arch in refs.json: [begin, end). */
static bool ta_section(const char *json, const char *arch, const char **b, const char **e)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\": {", arch);
    const char *p = strstr(json, pat);
    if (!p)
        return false;
    *b = strstr(p, "\"config\": {");
    *e = *b ? strstr(*b, "\"prompt\":") : NULL;
    return *b && *e;
}

/* A number of the config section, or NAN when the key is absent. */
static double ta_num(const char *json, const char *arch, const char *key)
{
    const char *b, *e;
    if (!ta_section(json, arch, &b, &e))
        return NAN;
    char pat[96];
    snprintf(pat, sizeof(pat), "\"%s\": ", key);
    const char *p = strstr(b, pat);
    if (!p || p > e)
        return NAN;
    char *end;
    double v = strtod(p + strlen(pat), &end);
    return end == p + strlen(pat) ? NAN : v;
}

/* layer_types: 1 for "linear_attention", 0 for others; count or -1. */
static int ta_layer_types(const char *json, const char *arch, int *out, int cap)
{
    const char *b, *e;
    if (!ta_section(json, arch, &b, &e))
        return -1;
    const char *p = strstr(b, "\"layer_types\": [");
    if (!p || p > e)
        return -1;
    const char *end = strchr(p, ']');
    int n = 0;
    p += strlen("\"layer_types\": [");
    while (n < cap) {
        const char *q = strchr(p, '"');
        if (!q || q > end)
            break;
        out[n++] = strncmp(q + 1, "linear_attention\"", 17) == 0;
        p = strchr(q + 1, '"');
        if (!p)
            break;
        p++;
    }
    return n;
}

/* ---- model open ---- */

struct ta_model {
    struct gguf *g;
    struct arch_model *m;
};

static int ta_open(struct ta_model *tm, const char *path)
{
    struct gguf_config gc = {.path = path};
    tm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = tm->g};
    tm->m = tm->g ? arch_load(&ac) : NULL;
    return tm->m ? 0 : -1;
}

static void ta_close(struct ta_model *tm)
{
    arch_free(tm->m);
    gguf_close(tm->g);
    tm->m = NULL;
    tm->g = NULL;
}

/* ---- acceptance ---- */

#define TA_EQ(what, got, want)                                                                     \
    CHECK((double)(got) == (double)(want), "%s %s: %s = %g, config says %g", arch, file, what,     \
          (double)(got), (double)(want))

static void ta_check_matrix(const char *arch, const char *file, const struct arch_matrix *m,
                            const char *what, uint64_t n_in, uint64_t n_out, uint64_t n_mat)
{
    CHECK(m->data && m->n_in == n_in && m->n_out == n_out && m->n_mat == n_mat &&
              m->row_bytes == quant_row_size(m->type, n_in) && m->mat_bytes == m->row_bytes * n_out,
          "%s %s: %s is %llux%llux%llu (data %p), expected %llux%llux%llu", arch, file, what,
          (unsigned long long)m->n_in, (unsigned long long)m->n_out, (unsigned long long)m->n_mat,
          (const void *)m->data, (unsigned long long)n_in, (unsigned long long)n_out,
          (unsigned long long)n_mat);
}

static void ta_check_layers(const char *arch, const char *file, const struct arch_model *m,
                            const int *linear, int n_types)
{
    const struct arch_hparams *hp = &m->hp;
    CHECK(n_types == (int)hp->n_layer || hp->kind == ARCH_KIND_QWEN3MOE,
          "%s: %d layer types for %u layers", arch, n_types, hp->n_layer);
    const uint64_t n = hp->n_embd, hd = hp->head_dim, E = hp->n_expert, F = hp->n_ff_exp;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct arch_layer *ly = &m->layers[l];
        const bool want = hp->kind != ARCH_KIND_QWEN3MOE && (int)l < n_types && linear[l];
        CHECK(ly->recurrent == want, "%s %s: layer %u recurrent %d, config says %d", arch, file, l,
              ly->recurrent, want);
        CHECK(ly->attn_norm && ly->ffn_norm, "%s: layer %u norms", arch, l);
        if (ly->recurrent) {
            CHECK(!ly->wq.data && !ly->wk.data && ly->conv && ly->ssm_a && ly->dt_bias &&
                      ly->ssm_norm, "%s: layer %u DeltaNet tensors", arch, l);
            ta_check_matrix(arch, file, &ly->wqkv, "attn_qkv", n, arch_conv_dim(hp), 1);
            ta_check_matrix(arch, file, &ly->wz, "attn_gate", n,
                            (uint64_t)hp->ssm_nv * hp->ssm_dv, 1);
            ta_check_matrix(arch, file, &ly->wout, "ssm_out", (uint64_t)hp->ssm_nv * hp->ssm_dv,
                            n, 1);
            if (hp->kind == ARCH_KIND_QWEN35MOE) {
                ta_check_matrix(arch, file, &ly->wbeta, "ssm_beta", n, hp->ssm_nv, 1);
                ta_check_matrix(arch, file, &ly->walpha, "ssm_alpha", n, hp->ssm_nv, 1);
            } else {
                ta_check_matrix(arch, file, &ly->wba, "ssm_ba", n, 2 * hp->ssm_nv, 1);
            }
            /* ssm_a = -exp(A_log) < 0 */
            for (uint32_t h = 0; h < hp->ssm_nv; h++)
                CHECK(ly->ssm_a[h] < 0.0f, "%s: layer %u ssm_a[%u] = %g", arch, l, h,
                      ly->ssm_a[h]);
        } else {
            CHECK(!ly->wqkv.data && !ly->conv && ly->q_norm && ly->k_norm,
                  "%s: layer %u attention tensors", arch, l);
            ta_check_matrix(arch, file, &ly->wq, "attn_q", n,
                            hp->n_head * hd * (hp->attn_gated ? 2 : 1), 1);
            ta_check_matrix(arch, file, &ly->wk, "attn_k", n, hp->n_head_kv * hd, 1);
            ta_check_matrix(arch, file, &ly->wv, "attn_v", n, hp->n_head_kv * hd, 1);
            ta_check_matrix(arch, file, &ly->wo, "attn_output", hp->n_head * hd, n, 1);
        }
        ta_check_matrix(arch, file, &ly->router, "ffn_gate_inp", n, E, 1);
        ta_check_matrix(arch, file, &ly->gate_exps, "ffn_gate_exps", n, F, E);
        ta_check_matrix(arch, file, &ly->up_exps, "ffn_up_exps", n, F, E);
        ta_check_matrix(arch, file, &ly->down_exps, "ffn_down_exps", F, n, E);
        CHECK(arch_matrix_expert(&ly->down_exps, 3) ==
                  ly->down_exps.data + 3 * ly->down_exps.mat_bytes, "%s: expert pointer", arch);
        if (hp->n_ff_shexp) {
            ta_check_matrix(arch, file, &ly->gate_sh, "ffn_gate_shexp", n, hp->n_ff_shexp, 1);
            ta_check_matrix(arch, file, &ly->down_sh, "ffn_down_shexp", hp->n_ff_shexp, n, 1);
            CHECK(ly->shexp_gate != NULL, "%s: layer %u shared-expert gate", arch, l);
        } else {
            CHECK(!ly->gate_sh.data && !ly->shexp_gate, "%s: layer %u has a shared expert", arch,
                  l);
        }
    }
}

static void ta_check_hparams(const char *json, const char *arch, const char *file,
                             const struct arch_model *m)
{
    const struct arch_hparams *hp = &m->hp;
    CHECK(!strcmp(hp->arch_name, arch) && !strcmp(arch_kind_name(hp->kind), arch),
          "%s: arch name %s", arch, hp->arch_name);
    TA_EQ("n_embd", hp->n_embd, ta_num(json, arch, "hidden_size"));
    TA_EQ("n_layer", hp->n_layer, ta_num(json, arch, "num_hidden_layers"));
    TA_EQ("n_head", hp->n_head, ta_num(json, arch, "num_attention_heads"));
    TA_EQ("n_head_kv", hp->n_head_kv, ta_num(json, arch, "num_key_value_heads"));
    TA_EQ("head_dim", hp->head_dim, ta_num(json, arch, "head_dim"));
    TA_EQ("n_vocab", hp->n_vocab, ta_num(json, arch, "vocab_size"));
    TA_EQ("n_ctx_train", hp->n_ctx_train, ta_num(json, arch, "max_position_embeddings"));
    TA_EQ("eps", hp->eps, (float)ta_num(json, arch, "rms_norm_eps"));
    TA_EQ("rope_base", hp->rope_base, (float)ta_num(json, arch, "rope_theta"));
    TA_EQ("n_expert_used", hp->n_expert_used, ta_num(json, arch, "num_experts_per_tok"));
    TA_EQ("n_ff_exp", hp->n_ff_exp, ta_num(json, arch, "moe_intermediate_size"));
    TA_EQ("n_nextn", hp->n_nextn, 0);
    TA_EQ("attn_scale", hp->attn_scale, 1.0f / sqrtf((float)hp->head_dim));
    double ne = ta_num(json, arch, "num_experts");
    TA_EQ("n_expert", hp->n_expert, isnan(ne) ? ta_num(json, arch, "num_local_experts") : ne);
    double prf = ta_num(json, arch, "partial_rotary_factor");
    TA_EQ("n_rot", hp->n_rot, isnan(prf) ? hp->head_dim : hp->head_dim * prf);
    int linear[64] = {0}, nt = 0;
    if (hp->kind == ARCH_KIND_QWEN3MOE) {
        CHECK(!hp->attn_gated && hp->n_ff_shexp == 0, "%s: qwen3moe gate/shared expert", arch);
    } else {
        CHECK(hp->attn_gated, "%s: hybrid attention is gated", arch);
        TA_EQ("n_ff_shexp", hp->n_ff_shexp, ta_num(json, arch, "shared_expert_intermediate_size"));
        TA_EQ("ssm_conv", hp->ssm_conv, ta_num(json, arch, "linear_conv_kernel_dim"));
        TA_EQ("ssm_dk", hp->ssm_dk, ta_num(json, arch, "linear_key_head_dim"));
        TA_EQ("ssm_dv", hp->ssm_dv, ta_num(json, arch, "linear_value_head_dim"));
        TA_EQ("ssm_nk", hp->ssm_nk, ta_num(json, arch, "linear_num_key_heads"));
        TA_EQ("ssm_nv", hp->ssm_nv, ta_num(json, arch, "linear_num_value_heads"));
        TA_EQ("ssm_tiled", hp->ssm_tiled, hp->kind == ARCH_KIND_QWEN35MOE);
        TA_EQ("conv_dim", arch_conv_dim(hp), 2 * hp->ssm_nk * hp->ssm_dk + hp->ssm_nv * hp->ssm_dv);
        nt = ta_layer_types(json, arch, linear, 64);
        CHECK(nt == (int)hp->n_layer, "%s: layer_types has %d entries", arch, nt);
    }
    if (hp->kind == ARCH_KIND_QWEN35MOE) {
        int32_t sec[4] = {0};
        const char *b, *e;
        ta_section(json, arch, &b, &e);
        int ns = fixture_refs_ints(b, "rope_parameters", "mrope_section", sec, 4);
        CHECK(ns == 3, "%s: mrope_section entries %d", arch, ns);
        for (int i = 0; i < 4; i++)
            CHECK(hp->rope_sections[i] == sec[i], "%s: rope section %d = %d, config %d", arch, i,
                  hp->rope_sections[i], sec[i]);
    } else {
        CHECK(!hp->rope_sections[0] && !hp->rope_sections[1], "%s: rope sections set", arch);
    }
    CHECK(m->tok_embd.n_in == hp->n_embd && m->tok_embd.n_out == hp->n_vocab && m->output.data &&
              m->output.n_out == hp->n_vocab && m->output_norm, "%s: globals", arch);
    ta_check_layers(arch, file, m, linear, nt);
}

static void ta_accept(const char *json, const char *arch)
{
    static const char *const kinds[] = {"f32", "q8_0"};
    for (int k = 0; k < 2; k++) {
        char rel[160], path[512], file[64];
        snprintf(file, sizeof(file), "%s-%s.gguf", arch, kinds[k]);
        snprintf(rel, sizeof(rel), "conformance/%s/%s", arch, file);
        struct ta_model tm = {0};
        CHECK(ta_open(&tm, test_fixture(path, sizeof(path), rel)) == 0, "%s does not load: %s",
              path, log_last_error());
        if (tm.m) {
            ta_check_hparams(json, arch, file, tm.m);
            const uint32_t want = k == 0 ? QUANT_TYPE_F32 : QUANT_TYPE_Q8_0;
            CHECK(tm.m->layers[0].gate_exps.type == want && tm.m->tok_embd.type == want,
                  "%s: matrix types %u %u", file, tm.m->layers[0].gate_exps.type,
                  tm.m->tok_embd.type);
        }
        ta_close(&tm);
    }
}

/* ---- broken copies ---- */

/* One change to a copied file. */
struct ta_edit {
    const char *name;           /* case name */
    const char *drop_key;       /* omit this key */
    const char *set_key;        /* write this key as uint32 set_val (added if absent) */
    uint32_t set_val;
    const char *arr_key;        /* write this key as a uint32 array of arr_n values */
    uint32_t arr_vals[8];
    uint32_t arr_n;
    const char *str_key;        /* write this key as string str_val */
    const char *str_val;
    const char *f32_key;        /* write this key as float32 f32_val (added if absent) */
    float f32_val;
    const char *drop_tensor;    /* omit this tensor */
    const char *tensor;         /* give this tensor new dims and/or type (data zeroed) */
    uint32_t n_dims;            /* 0: keep */
    int64_t ne[4];
    int32_t type;               /* -1: keep */
    const char *expect[3];      /* substrings the error must contain */
};

static size_t ta_elem_size(uint32_t type)
{
    switch (type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    default: return 8;
    }
}

static char *ta_strdup(struct gguf_str s)
{
    char *p = malloc(s.len + 1);
    memcpy(p, s.ptr, s.len);
    p[s.len] = 0;
    return p;
}

/* Copies one KV record as it is. */
static int ta_copy_kv(struct gguf_writer *w, const struct gguf_kv *kv)
{
    switch (kv->type) {
    case GGUF_TYPE_UINT8: return gguf_writer_add_u8(w, kv->key, (uint8_t)kv->v.u64);
    case GGUF_TYPE_INT8: return gguf_writer_add_i8(w, kv->key, (int8_t)kv->v.i64);
    case GGUF_TYPE_UINT16: return gguf_writer_add_u16(w, kv->key, (uint16_t)kv->v.u64);
    case GGUF_TYPE_INT16: return gguf_writer_add_i16(w, kv->key, (int16_t)kv->v.i64);
    case GGUF_TYPE_UINT32: return gguf_writer_add_u32(w, kv->key, (uint32_t)kv->v.u64);
    case GGUF_TYPE_INT32: return gguf_writer_add_i32(w, kv->key, (int32_t)kv->v.i64);
    case GGUF_TYPE_UINT64: return gguf_writer_add_u64(w, kv->key, kv->v.u64);
    case GGUF_TYPE_INT64: return gguf_writer_add_i64(w, kv->key, kv->v.i64);
    case GGUF_TYPE_FLOAT32: return gguf_writer_add_f32(w, kv->key, (float)kv->v.f64);
    case GGUF_TYPE_FLOAT64: return gguf_writer_add_f64(w, kv->key, kv->v.f64);
    case GGUF_TYPE_BOOL: return gguf_writer_add_bool(w, kv->key, kv->v.u64 != 0);
    case GGUF_TYPE_STRING: {
        char *s = ta_strdup(kv->str);
        int rc = gguf_writer_add_str(w, kv->key, s);
        free(s);
        return rc;
    }
    case GGUF_TYPE_ARRAY:
        break;
    default:
        return -1;
    }
    int rc;
    if (kv->arr_type == GGUF_TYPE_STRING) {
        char **strs = calloc(kv->n ? kv->n : 1, sizeof(char *));
        for (uint64_t i = 0; i < kv->n; i++)
            strs[i] = ta_strdup(kv->strs[i]);
        rc = gguf_writer_add_array_str(w, kv->key, (const char *const *)strs, kv->n);
        for (uint64_t i = 0; i < kv->n; i++)
            free(strs[i]);
        free(strs);
        return rc;
    }
    const size_t bytes = ta_elem_size(kv->arr_type) * kv->n;
    void *vals = malloc(bytes ? bytes : 1);
    memcpy(vals, kv->arr, bytes); /* elements in the mapping may be unaligned */
    rc = gguf_writer_add_array(w, kv->key, kv->arr_type, vals, kv->n);
    free(vals);
    return rc;
}

static int ta_write_meta(struct gguf_writer *w, const struct gguf *g, const struct ta_edit *ed)
{
    int rc = 0;
    bool set_done = false, arr_done = false, str_done = false, f32_done = false;
    for (uint64_t i = 0; i < gguf_n_kv(g) && !rc; i++) {
        const struct gguf_kv *kv = gguf_kv_at(g, i);
        if (ed->drop_key && !strcmp(kv->key, ed->drop_key))
            continue;
        if (ed->set_key && !strcmp(kv->key, ed->set_key)) {
            rc = gguf_writer_add_u32(w, kv->key, ed->set_val);
            set_done = true;
        } else if (ed->arr_key && !strcmp(kv->key, ed->arr_key)) {
            rc = gguf_writer_add_array(w, kv->key, GGUF_TYPE_UINT32, ed->arr_vals, ed->arr_n);
            arr_done = true;
        } else if (ed->str_key && !strcmp(kv->key, ed->str_key)) {
            rc = gguf_writer_add_str(w, kv->key, ed->str_val);
            str_done = true;
        } else if (ed->f32_key && !strcmp(kv->key, ed->f32_key)) {
            rc = gguf_writer_add_f32(w, kv->key, ed->f32_val);
            f32_done = true;
        } else {
            rc = ta_copy_kv(w, kv);
        }
    }
    if (!rc && ed->set_key && !set_done)
        rc = gguf_writer_add_u32(w, ed->set_key, ed->set_val);
    if (!rc && ed->arr_key && !arr_done)
        rc = gguf_writer_add_array(w, ed->arr_key, GGUF_TYPE_UINT32, ed->arr_vals, ed->arr_n);
    if (!rc && ed->str_key && !str_done)
        rc = gguf_writer_add_str(w, ed->str_key, ed->str_val);
    if (!rc && ed->f32_key && !f32_done)
        rc = gguf_writer_add_f32(w, ed->f32_key, ed->f32_val);
    return rc;
}

/* Writes src with the edit applied to path. Returns 0 or -1. */
static int ta_write_copy(const struct gguf *g, const struct ta_edit *ed, const char *path)
{
    struct gguf_writer_config wc = {.path = path, .alignment = gguf_alignment(g),
                                    .buffer_bytes = 1 << 20};
    struct gguf_writer *w = gguf_writer_create(&wc);
    if (!w)
        return -1;
    int rc = ta_write_meta(w, g, ed);
    for (uint64_t i = 0; i < gguf_n_tensors(g) && !rc; i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        if (ed->drop_tensor && !strcmp(t->name, ed->drop_tensor))
            continue;
        if (ed->tensor && !strcmp(t->name, ed->tensor))
            rc = gguf_writer_add_tensor(w, t->name, ed->type >= 0 ? (uint32_t)ed->type : t->type,
                                        ed->n_dims ? ed->n_dims : t->n_dims,
                                        ed->n_dims ? ed->ne : t->ne);
        else
            rc = gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne);
    }
    rc = rc ? rc : gguf_writer_write_header(w);
    uint64_t k = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(g) && !rc; i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        if (ed->drop_tensor && !strcmp(t->name, ed->drop_tensor))
            continue;
        const uint64_t nb = gguf_writer_tensor_nbytes(w, k++);
        if (nb == t->nbytes) {
            rc = gguf_writer_write_data(w, t->data, nb);
        } else {
            void *z = calloc(1, nb);
            rc = gguf_writer_write_data(w, z, nb);
            free(z);
        }
    }
    rc = rc ? rc : gguf_writer_finish(w);
    gguf_writer_destroy(w);
    return rc ? -1 : 0;
}

#define TA_KEEP -1

static const struct ta_edit ta_cases[] = {
    {.name = "missing block_count", .drop_key = "qwen3next.block_count", .type = TA_KEEP,
     .expect = {"qwen3next.block_count", "missing"}},
    {.name = "missing embedding_length", .drop_key = "qwen3next.embedding_length",
     .type = TA_KEEP, .expect = {"qwen3next.embedding_length", "missing"}},
    {.name = "missing head_count", .drop_key = "qwen3next.attention.head_count", .type = TA_KEEP,
     .expect = {"qwen3next.attention.head_count", "missing"}},
    {.name = "missing rms eps", .drop_key = "qwen3next.attention.layer_norm_rms_epsilon",
     .type = TA_KEEP, .expect = {"layer_norm_rms_epsilon", "missing"}},
    {.name = "missing expert_count", .drop_key = "qwen3next.expert_count", .type = TA_KEEP,
     .expect = {"qwen3next.expert_count", "missing"}},
    {.name = "missing expert_used_count", .drop_key = "qwen3next.expert_used_count",
     .type = TA_KEEP, .expect = {"qwen3next.expert_used_count", "missing"}},
    {.name = "missing ssm.state_size", .drop_key = "qwen3next.ssm.state_size", .type = TA_KEEP,
     .expect = {"qwen3next.ssm.state_size", "missing"}},
    {.name = "missing architecture", .drop_key = "general.architecture", .type = TA_KEEP,
     .expect = {"general.architecture"}},
    {.name = "unknown architecture", .str_key = "general.architecture", .str_val = "llama",
     .type = TA_KEEP, .expect = {"llama", "not supported"}},
    {.name = "top-k above experts", .set_key = "qwen3next.expert_used_count", .set_val = 17,
     .type = TA_KEEP, .expect = {"expert_used_count", "17", "[1, 16]"}},
    {.name = "zero experts", .set_key = "qwen3next.expert_count", .set_val = 0, .type = TA_KEEP,
     .expect = {"expert_count", "0"}},
    {.name = "kv heads not dividing", .set_key = "qwen3next.attention.head_count_kv",
     .set_val = 3, .type = TA_KEEP, .expect = {"head_count", "not a multiple", "3"}},
    {.name = "kv heads above heads", .set_key = "qwen3next.attention.head_count_kv",
     .set_val = 8, .type = TA_KEEP, .expect = {"head_count_kv", "8"}},
    {.name = "odd rope dims", .set_key = "qwen3next.rope.dimension_count", .set_val = 5,
     .type = TA_KEEP, .expect = {"rope.dimension_count", "5"}},
    {.name = "ssm heads not dividing", .set_key = "qwen3next.ssm.time_step_rank", .set_val = 3,
     .type = TA_KEEP, .expect = {"ssm.time_step_rank", "3", "ssm.group_count"}},
    {.name = "per-layer array", .arr_key = "qwen3next.expert_used_count",
     .arr_vals = {4, 4, 4, 2, 4, 4, 4, 4}, .arr_n = 8, .type = TA_KEEP,
     .expect = {"expert_used_count", "per layer", "layer 3"}},
    {.name = "NaN rope base", .f32_key = "qwen3next.rope.freq_base", .f32_val = NAN,
     .type = TA_KEEP, .expect = {"rope.freq_base", "nan", "finite"}},
    {.name = "negative rope base", .f32_key = "qwen3next.rope.freq_base", .f32_val = -1.0f,
     .type = TA_KEEP, .expect = {"rope.freq_base", "-1", "above 0"}},
    {.name = "infinite attention scale", .f32_key = "qwen3next.attention.scale",
     .f32_val = INFINITY, .type = TA_KEEP, .expect = {"attention.scale", "inf", "finite"}},
    {.name = "block_count below the file's layers", .set_key = "qwen3next.block_count",
     .set_val = 4, .type = TA_KEEP,
     .expect = {"belongs to layer", "qwen3next.block_count is 4", "disagree"}},
    {.name = "missing tensor", .drop_tensor = "blk.5.ffn_down_exps.weight", .type = TA_KEEP,
     .expect = {"blk.5.ffn_down_exps.weight", "missing"}},
    {.name = "missing attention tensor", .drop_tensor = "blk.3.attn_k_norm.weight",
     .type = TA_KEEP, .expect = {"blk.3.attn_k_norm.weight", "missing"}},
    {.name = "wrong matrix shape", .tensor = "blk.3.attn_q.weight", .n_dims = 2,
     .ne = {96, 64, 1, 1}, .type = TA_KEEP,
     .expect = {"blk.3.attn_q.weight", "{96, 64, 1, 1}", "expected {96, 128, 1}"}},
    {.name = "wrong expert count", .tensor = "blk.6.ffn_up_exps.weight", .n_dims = 3,
     .ne = {96, 32, 15, 1}, .type = TA_KEEP, .expect = {"blk.6.ffn_up_exps.weight", "15"}},
    {.name = "wrong vector length", .tensor = "output_norm.weight", .n_dims = 1,
     .ne = {95, 1, 1, 1}, .type = TA_KEEP, .expect = {"output_norm.weight", "95", "96"}},
    {.name = "Q8_1 router", .tensor = "blk.2.ffn_gate_inp.weight", .type = QUANT_TYPE_Q8_1,
     .expect = {"blk.2.ffn_gate_inp.weight", "Q8_1", "not supported"}},
    {.name = "MXFP4 experts", .tensor = "blk.7.ffn_gate_exps.weight", .type = QUANT_TYPE_MXFP4,
     .expect = {"blk.7.ffn_gate_exps.weight", "MXFP4", "not supported"}},
    {.name = "I32 norm vector", .tensor = "blk.0.attn_norm.weight", .type = QUANT_TYPE_I32,
     .expect = {"blk.0.attn_norm.weight", "I32", "not supported"}},
};

static void ta_reject(void)
{
    char path[512], out[256];
    struct gguf_config gc = {
        .path = test_fixture(path, sizeof(path), "conformance/qwen3next/qwen3next-q8_0.gguf")};
    struct gguf *src = gguf_open(&gc);
    CHECK(src != NULL, "cannot open %s", path);
    if (!src)
        return;
    snprintf(out, sizeof(out), "/tmp/test_arch_%d.gguf", (int)getpid());
    struct ta_model ref = {0}, tm = {0};
    ta_open(&ref, path);

    /* the copier is faithful: an unedited copy loads with equal hparams */
    const struct ta_edit none = {.type = TA_KEEP};
    CHECK(ta_write_copy(src, &none, out) == 0, "unedited copy written");
    CHECK(ta_open(&tm, out) == 0, "unedited copy loads: %s", log_last_error());
    if (tm.m && ref.m) {
        struct arch_hparams a = tm.m->hp, b = ref.m->hp;
        CHECK(memcmp(&a, &b, sizeof(a)) == 0, "unedited copy has other hparams");
        CHECK(tm.m->layers[7].down_exps.mat_bytes == ref.m->layers[7].down_exps.mat_bytes &&
                  memcmp(tm.m->layers[7].down_exps.data, ref.m->layers[7].down_exps.data,
                         ref.m->layers[7].down_exps.mat_bytes * 16) == 0,
              "unedited copy's expert bytes differ");
    }
    ta_close(&tm);
    ta_close(&ref);

    int passed = 0;
    const int n_cases = (int)(sizeof(ta_cases) / sizeof(ta_cases[0]));
    for (int c = 0; c < n_cases; c++) {
        const struct ta_edit *ed = &ta_cases[c];
        if (ta_write_copy(src, ed, out) != 0) {
            CHECK(0, "%s: cannot write the broken copy", ed->name);
            continue;
        }
        int rc = ta_open(&tm, out);
        const char *msg = log_last_error();
        bool named = tm.g != NULL; /* the file itself must be a valid GGUF */
        for (int i = 0; i < 3 && ed->expect[i]; i++)
            named = named && strstr(msg, ed->expect[i]) != NULL;
        CHECK(rc != 0 && tm.m == NULL, "%s: arch_load accepted the broken file", ed->name);
        CHECK(named, "%s: error '%s' does not name '%s' (gguf opened: %d)", ed->name, msg,
              ed->expect[0], tm.g != NULL);
        passed += rc != 0 && named;
        ta_close(&tm);
    }
    unlink(out);
    gguf_close(src);
    MEASURE("arch_load rejected %d of %d broken copies with a message naming the key or tensor",
            passed, n_cases);
}

int main(void)
{
    log_init("test", -1);
    char path[512];
    char *json = fixture_read_all(test_fixture(path, sizeof(path), "conformance/refs.json"), NULL);
    CHECK(json != NULL, "cannot read %s", path);
    if (json) {
        ta_accept(json, "qwen3moe");
        ta_accept(json, "qwen3next");
        ta_accept(json, "qwen35moe");
    }
    free(json);
    arch_free(NULL);
    ta_reject();
    return test_main_result("test_arch");
}
