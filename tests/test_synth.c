/*
 * test_synth: synthetic model files have exactly llama.cpp's tensor names,
 * types and shapes and metadata (checked against a table written here from
 * model-spec sections 4-7, not from synth.c), a consistent byte-level BPE
 * vocabulary, sane weight values, load through arch_load, are reproducible
 * byte for byte (also across thread counts), follow the requested expert
 * heat, fail cleanly on bad configs and a full disk, and are written fast
 * (measured on an 80B-shaped file cut to 2 layers).
 */
#include "model/synth.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "tests/check.h"

/* tiny shape (synth.h / the brief): n 64, 4 layers, 4/2 heads of 16, rope 8,
 * DeltaNet nk 2 nv 4 dk dv 16 conv 4, 8 experts top-2 of 32, shared 32, vocab 512. */
enum { N = 64, HEADS = 4, KVH = 2, HD = 16, NK = 2, NV = 4, DK = 16, DV = 16, KC = 4, E = 8,
       TOPK = 2, F = 32, FS = 32, V = 512, LAYERS = 4 };

static char ts_dir[64];

static void ts_path(char *buf, size_t len, const char *tag)
{
    snprintf(buf, len, "%s_%s.gguf", ts_dir, tag);
}

static int ts_write(const char *arch, const char *shape, uint32_t layers, uint32_t type,
                    float heat, uint64_t seed, uint32_t threads, const char *path,
                    struct synth_report *rep)
{
    struct synth_config cfg = {
        .arch = arch, .shape = shape, .layers = layers, .type = type, .heat = heat,
        .seed = seed, .path = path, .threads = threads, .report = rep,
        .heat_measure = rep != NULL,
    };
    return synth_write(&cfg);
}

/* ---- expected tensors ----------------------------------------------------- */

struct ts_expect {
    char name[64];
    bool f32;        /* always F32 (norms, routers, ssm vectors, conv) */
    uint32_t n_dims;
    int64_t ne[3];
};

static int ts_n;
static struct ts_expect ts_list[128];

static void ts_add(bool f32, uint32_t n_dims, int64_t ne0, int64_t ne1, int64_t ne2,
                   const char *fmt, int layer)
{
    struct ts_expect *x = &ts_list[ts_n++];
    snprintf(x->name, sizeof(x->name), fmt, layer);
    x->f32 = f32;
    x->n_dims = n_dims;
    x->ne[0] = ne0;
    x->ne[1] = ne1;
    x->ne[2] = ne2;
}

static void ts_expected(const char *arch)
{
    bool hybrid = strcmp(arch, "qwen3moe") != 0, q35 = strcmp(arch, "qwen35moe") == 0;
    ts_n = 0;
    ts_add(false, 2, N, V, 1, "token_embd.weight", 0);
    ts_add(true, 1, N, 1, 1, "output_norm.weight", 0);
    ts_add(false, 2, N, V, 1, "output.weight", 0);
    for (int l = 0; l < LAYERS; l++) {
        ts_add(true, 1, N, 1, 1, "blk.%d.attn_norm.weight", l);
        ts_add(true, 1, N, 1, 1, hybrid ? "blk.%d.post_attention_norm.weight"
                                        : "blk.%d.ffn_norm.weight", l);
        ts_add(true, 2, N, E, 1, "blk.%d.ffn_gate_inp.weight", l);
        ts_add(false, 3, N, F, E, "blk.%d.ffn_gate_exps.weight", l);
        ts_add(false, 3, N, F, E, "blk.%d.ffn_up_exps.weight", l);
        ts_add(false, 3, F, N, E, "blk.%d.ffn_down_exps.weight", l);
        if (hybrid) {
            ts_add(true, 2, N, 1, 1, "blk.%d.ffn_gate_inp_shexp.weight", l);
            ts_add(false, 2, N, FS, 1, "blk.%d.ffn_gate_shexp.weight", l);
            ts_add(false, 2, N, FS, 1, "blk.%d.ffn_up_shexp.weight", l);
            ts_add(false, 2, FS, N, 1, "blk.%d.ffn_down_shexp.weight", l);
        }
        if (hybrid && (l + 1) % 4 != 0) {
            ts_add(false, 2, N, 2 * NK * DK + NV * DV, 1, "blk.%d.attn_qkv.weight", l);
            ts_add(false, 2, N, NV * DV, 1, "blk.%d.attn_gate.weight", l);
            if (q35) {
                ts_add(false, 2, N, NV, 1, "blk.%d.ssm_beta.weight", l);
                ts_add(false, 2, N, NV, 1, "blk.%d.ssm_alpha.weight", l);
            } else {
                ts_add(false, 2, N, 2 * NV, 1, "blk.%d.ssm_ba.weight", l);
            }
            ts_add(true, 2, KC, 2 * NK * DK + NV * DV, 1, "blk.%d.ssm_conv1d.weight", l);
            ts_add(true, 1, NV, 1, 1, "blk.%d.ssm_a", l);
            ts_add(true, 1, NV, 1, 1, "blk.%d.ssm_dt.bias", l);
            ts_add(true, 1, DV, 1, 1, "blk.%d.ssm_norm.weight", l);
            ts_add(false, 2, NV * DV, N, 1, "blk.%d.ssm_out.weight", l);
        } else {
            ts_add(false, 2, N, (hybrid ? 2 : 1) * HEADS * HD, 1, "blk.%d.attn_q.weight", l);
            ts_add(false, 2, N, KVH * HD, 1, "blk.%d.attn_k.weight", l);
            ts_add(false, 2, N, KVH * HD, 1, "blk.%d.attn_v.weight", l);
            ts_add(false, 2, HEADS * HD, N, 1, "blk.%d.attn_output.weight", l);
            ts_add(true, 1, HD, 1, 1, "blk.%d.attn_q_norm.weight", l);
            ts_add(true, 1, HD, 1, 1, "blk.%d.attn_k_norm.weight", l);
        }
    }
}

static void ts_check_tensors(const struct gguf *g, const char *arch, uint32_t type)
{
    ts_expected(arch);
    CHECK(gguf_n_tensors(g) == (uint64_t)ts_n, "%s: %llu tensors, want %d", arch,
          (unsigned long long)gguf_n_tensors(g), ts_n);
    for (int i = 0; i < ts_n; i++) {
        const struct ts_expect *x = &ts_list[i];
        const struct gguf_tensor *t = gguf_find_tensor(g, x->name);
        CHECK(t != NULL, "%s: tensor %s missing", arch, x->name);
        if (!t)
            continue;
        uint32_t want = x->f32 ? (uint32_t)QUANT_TYPE_F32 : type;
        CHECK(t->type == want, "%s %s: type %s want %s", arch, x->name,
              quant_type_name(t->type), quant_type_name(want));
        CHECK(t->n_dims == x->n_dims, "%s %s: n_dims %u want %u", arch, x->name, t->n_dims,
              x->n_dims);
        for (int d = 0; d < 3; d++)
            CHECK(t->ne[d] == x->ne[d], "%s %s: ne[%d] %lld want %lld", arch, x->name, d,
                  (long long)t->ne[d], (long long)x->ne[d]);
    }
}

/* ---- expected metadata ------------------------------------------------------ */

static void ts_u32(const struct gguf *g, const char *arch, const char *suffix, uint32_t want)
{
    char key[128];
    snprintf(key, sizeof(key), "%s%s", suffix[0] == '.' ? arch : "", suffix);
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    CHECK(kv && kv->type == GGUF_TYPE_UINT32 && kv->v.u64 == want, "%s: %s want uint32 %u", arch,
          key, want);
}

static void ts_f32(const struct gguf *g, const char *arch, const char *suffix, float want)
{
    char key[128];
    snprintf(key, sizeof(key), "%s%s", arch, suffix);
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    CHECK(kv && kv->type == GGUF_TYPE_FLOAT32 && (float)kv->v.f64 == want, "%s: %s want %g", arch,
          key, want);
}

static bool ts_str_is(const struct gguf_str *s, const char *want)
{
    return s->len == strlen(want) && memcmp(s->ptr, want, s->len) == 0;
}

static void ts_check_meta(const struct gguf *g, const char *arch, uint32_t ftype)
{
    bool hybrid = strcmp(arch, "qwen3moe") != 0, q35 = strcmp(arch, "qwen35moe") == 0;
    struct gguf_str s;
    CHECK(gguf_get_str(g, "general.architecture", &s) == 0 && ts_str_is(&s, arch), "arch");
    ts_u32(g, arch, ".block_count", LAYERS);
    ts_u32(g, arch, ".context_length", 4096);
    ts_u32(g, arch, ".embedding_length", N);
    ts_u32(g, arch, ".attention.head_count", HEADS);
    ts_u32(g, arch, ".attention.head_count_kv", KVH);
    ts_u32(g, arch, ".attention.key_length", HD);
    ts_u32(g, arch, ".attention.value_length", HD);
    ts_u32(g, arch, ".expert_count", E);
    ts_u32(g, arch, ".expert_used_count", TOPK);
    ts_u32(g, arch, ".expert_feed_forward_length", F);
    ts_f32(g, arch, ".attention.layer_norm_rms_epsilon", 1e-6f);
    ts_f32(g, arch, ".rope.freq_base", 1e6f);
    ts_u32(g, arch, "general.file_type", ftype);
    ts_u32(g, arch, "general.quantization_version", 2);
    ts_u32(g, arch, "general.alignment", 32);
    char key[128];
    snprintf(key, sizeof(key), "%s.rope.dimension_count", arch);
    if (hybrid) {
        ts_u32(g, arch, ".rope.dimension_count", 8);
        ts_u32(g, arch, ".expert_shared_feed_forward_length", FS);
        ts_u32(g, arch, ".ssm.conv_kernel", KC);
        ts_u32(g, arch, ".ssm.state_size", DK);
        ts_u32(g, arch, ".ssm.group_count", NK);
        ts_u32(g, arch, ".ssm.time_step_rank", NV);
        ts_u32(g, arch, ".ssm.inner_size", NV * DV);
        ts_u32(g, arch, ".full_attention_interval", 4);
    } else {
        CHECK(gguf_find_kv(g, key) == NULL, "qwen3moe has %s (converter omits it)", key);
    }
    const struct gguf_kv *kv = gguf_find_kv(g, "qwen35moe.rope.dimension_sections");
    CHECK(q35 == (kv != NULL), "%s: rope.dimension_sections presence", arch);
    if (kv) {
        bool ok = kv->type == GGUF_TYPE_ARRAY && kv->arr_type == GGUF_TYPE_INT32 && kv->n == 4;
        ok = ok && gguf_arr_i64(kv, 0) == 2 && gguf_arr_i64(kv, 1) == 1 &&
             gguf_arr_i64(kv, 2) == 1 && gguf_arr_i64(kv, 3) == 0;
        CHECK(ok, "rope.dimension_sections is not INT32[4] {2,1,1,0}");
    }
}

/* ---- tokenizer -------------------------------------------------------------- */

/* Index of token text s (len bytes), or -1. */
static int64_t ts_find_token(const struct gguf_kv *tok, const char *s, size_t len)
{
    for (uint64_t i = 0; i < tok->n; i++)
        if (tok->strs[i].len == len && memcmp(tok->strs[i].ptr, s, len) == 0)
            return (int64_t)i;
    return -1;
}

static void ts_check_merges(const struct gguf *g, const struct gguf_kv *tok,
                            const struct gguf_kv *types)
{
    const struct gguf_kv *m = gguf_find_kv(g, "tokenizer.ggml.merges");
    CHECK(m && m->type == GGUF_TYPE_ARRAY && m->arr_type == GGUF_TYPE_STRING, "merges");
    if (!m || m->arr_type != GGUF_TYPE_STRING)
        return;
    CHECK(m->n >= 200 && m->n <= V - 256 - 3, "%llu merges", (unsigned long long)m->n);
    int bad = 0, multi = 0;
    for (uint64_t i = 0; i < m->n; i++) {
        const char *p = m->strs[i].ptr, *sp = memchr(p + 1, ' ', m->strs[i].len - 1);
        if (!sp) {
            bad++;
            continue;
        }
        size_t ll = (size_t)(sp - p), rl = m->strs[i].len - ll - 1;
        char joined[128];
        if (ll + rl >= sizeof(joined)) {
            bad++;
            continue;
        }
        memcpy(joined, p, ll);
        memcpy(joined + ll, sp + 1, rl);
        int64_t id = ts_find_token(tok, joined, ll + rl);
        bad += ts_find_token(tok, p, ll) < 0 || ts_find_token(tok, sp + 1, rl) < 0 || id < 0 ||
               gguf_arr_i64(types, (uint64_t)id) != 1;
        multi += ll + rl >= 4;
    }
    CHECK(bad == 0, "%d merges whose parts or result are not NORMAL tokens", bad);
    CHECK(multi > 50, "only %d merges make pieces of 4+ bytes", multi);
    CHECK(ts_find_token(tok, "\xc4\xa0the", 5) >= 0, "no token for \" the\"");
}

static void ts_check_vocab(const struct gguf *g, const char *arch)
{
    struct gguf_str s;
    CHECK(gguf_get_str(g, "tokenizer.ggml.model", &s) == 0 && ts_str_is(&s, "gpt2"), "model");
    const char *pre = strcmp(arch, "qwen35moe") == 0 ? "qwen35" : "qwen2";
    CHECK(gguf_get_str(g, "tokenizer.ggml.pre", &s) == 0 && ts_str_is(&s, pre), "pre");
    const struct gguf_kv *tok = gguf_find_kv(g, "tokenizer.ggml.tokens");
    const struct gguf_kv *ty = gguf_find_kv(g, "tokenizer.ggml.token_type");
    CHECK(tok && tok->arr_type == GGUF_TYPE_STRING && tok->n == V, "tokens");
    CHECK(ty && ty->arr_type == GGUF_TYPE_INT32 && ty->n == V, "token_type");
    if (!tok || tok->n != V || !ty || ty->n != V || ty->arr_type != GGUF_TYPE_INT32)
        return;
    /* Byte tokens in GPT-2 byte-to-unicode form, id = byte value. */
    CHECK(ts_str_is(&tok->strs[65], "A") && ts_str_is(&tok->strs[32], "\xc4\xa0") &&
          ts_str_is(&tok->strs[10], "\xc4\x8a") && ts_str_is(&tok->strs[0], "\xc4\x80") &&
          ts_str_is(&tok->strs[127], "\xc4\xa1") && ts_str_is(&tok->strs[173], "\xc5\x83") &&
          ts_str_is(&tok->strs[255], "\xc3\xbf"), "byte tokens not in GPT-2 form");
    uint32_t eos = 0, pad = 0;
    bool bos = true;
    CHECK(gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &eos) == 0 && eos < V &&
          ts_str_is(&tok->strs[eos], "<|im_end|>"), "eos %u", eos);
    CHECK(gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &pad) == 0 && pad < V &&
          ts_str_is(&tok->strs[pad], "<|endoftext|>"), "padding %u", pad);
    CHECK(gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &bos) == 0 && !bos, "add_bos");
    CHECK(pad + 2 == eos && ts_str_is(&tok->strs[pad + 1], "<|im_start|>"), "special order");
    int wrong = 0;
    for (uint64_t i = 0; i < V; i++) {
        int64_t t = gguf_arr_i64(ty, i);
        int64_t want = i < pad ? 1 : i <= eos ? 3 : 5;
        wrong += t != want;
        if (i > eos) {
            char buf[32];
            snprintf(buf, sizeof(buf), "[PAD%llu]", (unsigned long long)i);
            wrong += !ts_str_is(&tok->strs[i], buf);
        }
    }
    CHECK(wrong == 0, "%d token types or PAD names wrong", wrong);
    CHECK(eos + 1 < V, "no [PAD] tokens");
    ts_check_merges(g, tok, ty);
}

/* ---- weight values ------------------------------------------------------------ */

/* Mean and std of a tensor, dequantized. */
static void ts_stats(const struct gguf_tensor *t, double *mean, double *sd, double *lo, double *hi)
{
    uint64_t rows = (uint64_t)(t->ne[1] * t->ne[2] * t->ne[3]), n = (uint64_t)t->ne[0];
    size_t rb = quant_row_size(t->type, n);
    float *row = malloc(n * sizeof(float));
    double s = 0, ss = 0;
    *lo = INFINITY;
    *hi = -INFINITY;
    for (uint64_t r = 0; r < rows; r++) {
        quant_dequantize_row(t->type, (const uint8_t *)t->data + r * rb, row, n);
        for (uint64_t i = 0; i < n; i++) {
            s += row[i];
            ss += (double)row[i] * row[i];
            *lo = row[i] < *lo ? row[i] : *lo;
            *hi = row[i] > *hi ? row[i] : *hi;
        }
    }
    free(row);
    double cnt = (double)(rows * n);
    *mean = s / cnt;
    *sd = sqrt(ss / cnt - *mean * *mean);
}

static void ts_check_values(const struct gguf *g, const char *arch)
{
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        double mean, sd, lo, hi;
        ts_stats(t, &mean, &sd, &lo, &hi);
        CHECK(isfinite(mean) && isfinite(sd), "%s %s: not finite", arch, t->name);
        const char *n = t->name;
        if (strstr(n, "norm.weight") && !strstr(n, "ssm_norm")) {
            CHECK(lo > 0.95 && hi < 1.05, "%s %s: norm weights in [%g, %g]", arch, n, lo, hi);
        } else if (strstr(n, "ssm_norm")) {
            CHECK(lo > 0.95 && hi < 1.05, "%s %s: [%g, %g]", arch, n, lo, hi);
        } else if (strlen(n) > 6 && strcmp(n + strlen(n) - 6, ".ssm_a") == 0) {
            CHECK(lo >= -1.0001 && hi <= -0.135, "%s %s: ssm_a in [%g, %g]", arch, n, lo, hi);
        } else if (strstr(n, "ssm_dt")) {
            CHECK(fabs(lo) < 0.2 && fabs(hi) < 0.2, "%s %s: dt bias [%g, %g]", arch, n, lo, hi);
        } else if (strstr(n, "ssm_conv1d")) {
            CHECK(fabs(sd - 0.5) < 0.05, "%s %s: conv std %g want 1/sqrt(4)", arch, n, sd);
        } else if (strstr(n, "attn_q.") || strstr(n, "attn_k.") || strstr(n, "attn_qkv") ||
                   strstr(n, "gate_exps") || strstr(n, "up_exps")) {
            double want = 1.0 / sqrt((double)t->ne[0]);
            CHECK(fabs(sd / want - 1.0) < 0.1, "%s %s: std %g want %g", arch, n, sd, want);
        } else if (strstr(n, "down_exps") || strstr(n, "attn_output") || strstr(n, "ssm_out")) {
            double want = 1.0 / sqrt((double)t->ne[0]) / sqrt(2.0 * LAYERS);
            CHECK(fabs(sd / want - 1.0) < 0.1, "%s %s: std %g want %g", arch, n, sd, want);
        }
    }
}

/* ---- tests ------------------------------------------------------------------ */

/* type: what synth is asked for; matrix_type: what the matrices must be
 * (Q8_0 where a K-quant's 256-blocks do not fit ne[0] = 64 or 32). */
static void test_tiny(const char *arch, uint32_t type, uint32_t matrix_type, uint32_t ftype)
{
    char path[128], err[256] = "";
    ts_path(path, sizeof(path), arch);
    int rc = ts_write(arch, "tiny", 0, type, 0.0f, 7, 2, path, NULL);
    CHECK(rc == 0, "%s %s: synth_write rc %d", arch, quant_type_name(type), rc);
    struct gguf_config gc = {.path = path, .err = err, .err_len = sizeof(err)};
    struct gguf *g = gguf_open(&gc);
    CHECK(g != NULL, "%s: gguf_open: %s", arch, err);
    if (g) {
        ts_check_tensors(g, arch, matrix_type);
        ts_check_meta(g, arch, ftype);
        ts_check_vocab(g, arch);
        ts_check_values(g, arch);
        struct arch_config ac = {.gguf = g};
        struct arch_model *m = arch_load(&ac);
        CHECK(m != NULL, "%s %s: arch_load rejects the file: %s", arch, quant_type_name(type),
              log_last_error());
        arch_free(m);
    }
    gguf_close(g);
    unlink(path);
}

static bool ts_same_file(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
        if (ca == EOF)
            break;
    }
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    return same;
}

static void test_determinism(void)
{
    char a[128], b[128], c[128];
    ts_path(a, sizeof(a), "det_a");
    ts_path(b, sizeof(b), "det_b");
    ts_path(c, sizeof(c), "det_c");
    CHECK(ts_write("qwen3next", "tiny", 0, QUANT_TYPE_Q4_0, 1.2f, 99, 1, a, NULL) == 0, "a");
    CHECK(ts_write("qwen3next", "tiny", 0, QUANT_TYPE_Q4_0, 1.2f, 99, 3, b, NULL) == 0, "b");
    CHECK(ts_write("qwen3next", "tiny", 0, QUANT_TYPE_Q4_0, 1.2f, 100, 2, c, NULL) == 0, "c");
    CHECK(ts_same_file(a, b), "same seed, 1 vs 3 threads: files differ");
    CHECK(!ts_same_file(a, c), "different seeds: files identical");
    unlink(a);
    unlink(b);
    unlink(c);
}

static void test_heat(const char *arch, float s, struct synth_report *rep)
{
    char path[128];
    ts_path(path, sizeof(path), "heat");
    memset(rep, 0, sizeof(*rep));
    int rc = ts_write(arch, "tiny", 0, QUANT_TYPE_Q8_0, s, 5, 2, path, rep);
    CHECK(rc == 0, "heat %g: rc %d", s, rc);
    const struct synth_heat_report *h = &rep->heat;
    CHECK(h->n_expert == E && h->top_k == TOPK && h->layers == LAYERS && h->tokens == 1024,
          "heat report shape: %u experts, top %u, %u layers, %u tokens", h->n_expert, h->top_k,
          h->layers, h->tokens);
    double sum = 0;
    for (uint32_t r = 0; r < h->n_expert; r++)
        sum += h->share[r];
    CHECK(fabs(sum - 1.0) < 1e-3, "shares sum to %g", sum);
    MEASURE("%s %s", arch, h->summary);
    unlink(path);
}

static void test_heat_all(void)
{
    struct synth_report rep;
    for (int i = 0; i < 3; i++) {
        const char *arch = i == 0 ? "qwen3moe" : i == 1 ? "qwen3next" : "qwen35moe";
        test_heat(arch, 1.2f, &rep);
        /* target top share 42.9% against 12.5% for uniform routing */
        CHECK(rep.heat.share[0] > 0.33f && rep.heat.share[0] < 0.5f, "%s S=1.2: top share %g",
              arch, rep.heat.share[0]);
        CHECK(rep.heat.fitted_s > 0.9f && rep.heat.fitted_s < 1.6f, "%s S=1.2: fitted %g", arch,
              rep.heat.fitted_s);
        CHECK(fabsf(rep.heat.target[0] - 0.4289f) < 1e-3f, "target %g", rep.heat.target[0]);
        test_heat(arch, 0.0f, &rep);
        CHECK(rep.heat.share[0] < 0.18f, "%s S=0: top share %g", arch, rep.heat.share[0]);
        CHECK(rep.heat.share[E - 1] > 0.07f, "%s S=0: bottom share %g", arch,
              rep.heat.share[E - 1]);
        CHECK(rep.heat.fitted_s < 0.3f, "%s S=0: fitted %g", arch, rep.heat.fitted_s);
    }
}

static void test_errors(void)
{
    char path[128];
    ts_path(path, sizeof(path), "err");
    CHECK(ts_write("llama", "tiny", 0, QUANT_TYPE_F32, 0, 1, 2, path, NULL) == -EINVAL, "arch");
    CHECK(ts_write("qwen3moe", "7b", 0, QUANT_TYPE_F32, 0, 1, 2, path, NULL) == -EINVAL, "shape");
    CHECK(ts_write("qwen3moe", "tiny", 0, QUANT_TYPE_IQ2_XS, 0, 1, 2, path, NULL) == -EINVAL,
          "type");
    CHECK(ts_write("qwen3moe", "tiny", 0, QUANT_TYPE_F32, -1, 1, 2, path, NULL) == -EINVAL,
          "heat");
    CHECK(access(path, F_OK) != 0, "a rejected config left a file");
    int rc = ts_write("qwen3moe", "tiny", 0, QUANT_TYPE_Q8_0, 0, 1, 2, "/dev/full", NULL);
    CHECK(rc == -ENOSPC, "full disk: rc %d", rc);
    rc = ts_write("qwen3moe", "tiny", 0, QUANT_TYPE_Q8_0, 0, 1, 2, "/nonexistent/x.gguf", NULL);
    CHECK(rc < 0, "missing directory accepted");

    uint32_t type = 0;
    float s = -1;
    CHECK(synth_parse_type("q4_0", &type, NULL) == 0 && type == QUANT_TYPE_Q4_0, "parse q4_0");
    CHECK(synth_parse_type("Q4_K", &type, NULL) == 0 && type == QUANT_TYPE_Q4_K, "parse Q4_K");
    CHECK(synth_parse_type("f16", &type, NULL) == 0 && type == QUANT_TYPE_F16, "parse f16");
    CHECK(synth_parse_type("q3_k", &type, NULL) == -EINVAL, "parse q3_k");
    bool k_m = true;
    CHECK(synth_parse_type("Q4_K_M", &type, &k_m) == 0 && type == QUANT_TYPE_Q4_K && k_m,
          "parse Q4_K_M");
    CHECK(synth_parse_type("q5_k_m", &type, &k_m) == 0 && type == QUANT_TYPE_Q5_K && k_m,
          "parse q5_k_m");
    CHECK(synth_parse_type("q4_k", &type, &k_m) == 0 && type == QUANT_TYPE_Q4_K && !k_m,
          "parse q4_k after q5_k_m");
    CHECK(synth_parse_type("q4_k_m", &type, NULL) == -EINVAL, "q4_k_m where no mixture is taken");
    CHECK(synth_parse_type("q6_k_m", &type, &k_m) == -EINVAL, "parse q6_k_m");
    CHECK(synth_parse_heat("zipf:1.2", &s) == 0 && fabsf(s - 1.2f) < 1e-6f, "parse zipf:1.2");
    CHECK(synth_parse_heat("none", &s) == 0 && s == 0.0f, "parse none");
    CHECK(synth_parse_heat("zipf:", &s) == -EINVAL, "parse zipf:");
    CHECK(synth_parse_heat("zipf:1.2x", &s) == -EINVAL, "parse zipf:1.2x");
    CHECK(synth_parse_heat("zipf:-1", &s) == -EINVAL, "parse zipf:-1");
    CHECK(synth_parse_heat("1.2", &s) == -EINVAL, "parse 1.2");
}

/* An 80B-A3B-shaped qwen3next cut to 2 layers, q4_0: 2.2 GB. */
/* The _K_M mixtures' types, as llama-quantize chooses them (its use_more_bits over
 * the count of each kind of matrix): written out for the 80b-a3b (48 layers, a
 * shared expert: 96 ffn_down matrices) and 30b-a3b (48 ffn_down) shapes, then a
 * tiny file of the mixture, whose rows of 64 fall back to Q8_0. */
static void test_k_m(void)
{
    struct synth_config c = {.arch = "qwen3next", .shape = "80b-a3b", .type = QUANT_TYPE_Q4_K,
                             .k_m = true, .seed = 1, .path = "/dev/null"};
    const uint32_t K4 = QUANT_TYPE_Q4_K, K6 = QUANT_TYPE_Q6_K;
    CHECK(synth_matrix_type_of(&c, "output.weight", 0, 2048) == K6, "lm head");
    int n_down = 0, n_v = 0;
    for (uint32_t il = 0; il < 48; il++) {
        /* down: i < 96/8 = 12 or (i - 12) % 3 == 2; value-like: i < 6, i >= 42 or
         * (i - 6) % 3 == 2 */
        const bool down6 = il < 12 || (il - 12) % 3 == 2;
        const bool v6 = il < 6 || il >= 42 || (il - 6) % 3 == 2;
        const char *v = il % 4 == 3 ? "attn_v.weight" : "attn_qkv.weight";
        const uint32_t de = synth_matrix_type_of(&c, "ffn_down_exps.weight", il, 512);
        const uint32_t ds = synth_matrix_type_of(&c, "ffn_down_shexp.weight", il, 512);
        const uint32_t vt = synth_matrix_type_of(&c, v, il, 2048);
        CHECK(de == (down6 ? K6 : K4) && ds == de, "80b layer %u: ffn_down %s, shexp %s", il,
              quant_type_name(de), quant_type_name(ds));
        CHECK(vt == (v6 ? K6 : K4), "80b layer %u: %s %s", il, v, quant_type_name(vt));
        CHECK(synth_matrix_type_of(&c, "ffn_gate_exps.weight", il, 2048) == K4 &&
              synth_matrix_type_of(&c, "attn_gate.weight", il, 2048) == K4 &&
              synth_matrix_type_of(&c, "ssm_out.weight", il, 4096) == K4,
              "80b layer %u: the others Q4_K", il);
        n_down += de == K6;
        n_v += vt == K6;
    }
    CHECK(n_down == 24 && n_v == 24, "80b: %d ffn_down and %d value-like layers of Q6_K", n_down,
          n_v);
    c.arch = "qwen3moe", c.shape = "30b-a3b"; /* 48 ffn_down: the value-like rule */
    for (uint32_t il = 0; il < 48; il++) {
        const bool six = il < 6 || il >= 42 || (il - 6) % 3 == 2;
        CHECK(synth_matrix_type_of(&c, "ffn_down_exps.weight", il, 768) == (six ? K6 : K4),
              "30b layer %u: ffn_down", il);
    }
    c.k_m = false;
    CHECK(synth_matrix_type_of(&c, "output.weight", 0, 2048) == K4 &&
          synth_matrix_type_of(&c, "ffn_down_exps.weight", 0, 768) == K4, "pure Q4_K");
    c.type = QUANT_TYPE_Q4_0, c.k_m = true;
    CHECK(synth_matrix_type_of(&c, "output.weight", 0, 2048) == 0, "Q4_0 with a mixture");

    char path[128], err[256] = "";
    ts_path(path, sizeof(path), "k_m");
    struct synth_config t = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q5_K,
                             .k_m = true, .seed = 2, .path = path, .threads = 2};
    CHECK(synth_write(&t) == 0, "tiny q5_k_m");
    struct gguf_config gc = {.path = path, .err = err, .err_len = sizeof(err)};
    struct gguf *g = gguf_open(&gc);
    CHECK(g != NULL, "tiny q5_k_m: gguf_open: %s", err);
    if (g) {
        ts_u32(g, "general", ".file_type", 17); /* Q5_K_M */
        const struct gguf_tensor *o = gguf_find_tensor(g, "output.weight");
        CHECK(o && o->type == QUANT_TYPE_Q8_0, "tiny q5_k_m: rows of 64 fall back to Q8_0");
        struct arch_config ac = {.gguf = g};
        struct arch_model *m = arch_load(&ac);
        CHECK(m != NULL, "tiny q5_k_m: arch_load: %s", log_last_error());
        arch_free(m);
    }
    gguf_close(g);
    unlink(path);
}

static void test_throughput(void)
{
    char path[128], err[256] = "";
    ts_path(path, sizeof(path), "big");
    struct synth_report rep = {0};
    struct synth_config cfg = {
        .arch = "qwen3next", .shape = "80b-a3b", .layers = 2, .type = QUANT_TYPE_Q4_0,
        .seed = 3, .path = "/dev/null", .threads = 2, .report = &rep,
    };
    int rc = synth_write(&cfg);
    CHECK(rc == 0, "80b to /dev/null: rc %d", rc);
    MEASURE("qwen3next 80b-a3b 2 layers q4_0 generated (to /dev/null): %.2f GB in %.2f s = "
            "%.0f MB/s", rep.bytes / 1e9, rep.seconds, rep.mb_per_s);
    cfg.path = path;
    rc = synth_write(&cfg);
    CHECK(rc == 0, "80b to %s: rc %d", path, rc);
    MEASURE("qwen3next 80b-a3b 2 layers q4_0 written to %s: %.2f GB in %.2f s = %.0f MB/s "
            "(O_DIRECT)", path, rep.bytes / 1e9, rep.seconds,
            rep.mb_per_s);
    CHECK(rep.mb_per_s > 50, "%.0f MB/s", rep.mb_per_s);
    struct gguf_config gc = {.path = path, .err = err, .err_len = sizeof(err)};
    struct gguf *g = gguf_open(&gc);
    CHECK(g != NULL, "gguf_open: %s", err);
    if (g) {
        CHECK(gguf_file_size(g) == rep.bytes && rep.bytes > 2000000000ull, "size %llu",
              (unsigned long long)rep.bytes);
        CHECK(gguf_n_tensors(g) == 39, "%llu tensors", (unsigned long long)gguf_n_tensors(g));
        const struct gguf_tensor *t = gguf_find_tensor(g, "blk.1.ffn_down_exps.weight");
        CHECK(t && t->type == QUANT_TYPE_Q4_0 && t->ne[0] == 512 && t->ne[1] == 2048 &&
              t->ne[2] == 512, "blk.1.ffn_down_exps.weight");
        double mean, sd, lo, hi;
        if (t) { /* pooled blocks: same distribution as quantized rows */
            struct gguf_tensor one = *t;
            one.ne[2] = 1;
            ts_stats(&one, &mean, &sd, &lo, &hi);
            double want = 1.0 / sqrt(512.0) / 2.0;
            CHECK(fabs(sd / want - 1.0) < 0.1 && fabs(mean) < 0.1 * want, "down_exps std %g "
                  "want %g, mean %g", sd, want, mean);
        }
    }
    gguf_close(g);
    unlink(path);
}

int main(void)
{
    log_init("test", -1);
    snprintf(ts_dir, sizeof(ts_dir), "/tmp/test_synth_%d", (int)getpid());
    static const char *const archs[] = {"qwen3moe", "qwen3next", "qwen35moe"};
    static const uint32_t types[] = {QUANT_TYPE_F32, QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_0};
    static const uint32_t ftypes[] = {0, 7, 2}; /* llama_ftype ALL_F32, Q8_0, Q4_0 */
    for (int a = 0; a < 3; a++)
        for (int t = 0; t < 3; t++)
            test_tiny(archs[a], types[t], types[t], ftypes[t]);
    test_tiny("qwen3next", QUANT_TYPE_F16, QUANT_TYPE_F16, 1);
    test_tiny("qwen35moe", QUANT_TYPE_Q4_K, QUANT_TYPE_Q8_0, 14); /* Q4_K_S */
    test_determinism();
    test_heat_all();
    test_errors();
    test_k_m();
    test_throughput();
    return test_main_result("test_synth");
}
