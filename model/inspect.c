/*
 * inspect: formatting of the `lamina inspect` report (see inspect.h).
 *
 * Everything printed comes from the validated gguf; strings from the file are
 * escaped (control bytes, quotes) and cut to a readable length, so a hostile
 * file cannot garble the terminal.
 */
#include "model/inspect.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "model/quant.h"

#define INSPECT_MAX_LAYERS 65536 /* blk.N with N at or above this is "other" */
#define INSPECT_ARRAY_SHOWN 8    /* array elements printed before "..." */
#define INSPECT_STR_SHOWN 64     /* string bytes printed before "..." */

static const char *const inspect_category_names[INSPECT_CATEGORY_COUNT] = {
    "embeddings", "output", "layer trunk", "routed experts", "shared experts", "other",
};

/* Writes n bytes as "v.vv UNIT" (binary units) into buf. */
static const char *inspect_human(uint64_t n, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", n);
    else
        snprintf(buf, len, "%.2f %s", v, units[u]);
    return buf;
}

static bool inspect_has_prefix(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* The segment of a blk.N.SEG[.suffix] name is routed-expert weight. */
static bool inspect_is_routed(const char *seg, size_t len)
{
    static const char *const names[] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                        "ffn_gate_up_exps"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strlen(names[i]) == len && memcmp(seg, names[i], len) == 0)
            return true;
    return false;
}

enum inspect_category inspect_categorize(const char *name, int32_t *layer)
{
    if (layer)
        *layer = -1;
    if (inspect_has_prefix(name, "token_embd"))
        return INSPECT_CATEGORY_EMBEDDINGS;
    if (inspect_has_prefix(name, "output.") || inspect_has_prefix(name, "output_norm"))
        return INSPECT_CATEGORY_OUTPUT;
    if (!inspect_has_prefix(name, "blk."))
        return INSPECT_CATEGORY_OTHER;
    const char *p = name + 4;
    int32_t n = 0;
    int digits = 0;
    for (; *p >= '0' && *p <= '9' && n < INSPECT_MAX_LAYERS; p++, digits++)
        n = n * 10 + (*p - '0');
    if (digits == 0 || *p != '.' || n >= INSPECT_MAX_LAYERS)
        return INSPECT_CATEGORY_OTHER;
    if (layer)
        *layer = n;
    const char *seg = p + 1;
    const char *dot = strchr(seg, '.');
    size_t len = dot ? (size_t)(dot - seg) : strlen(seg);
    if (inspect_is_routed(seg, len))
        return INSPECT_CATEGORY_EXPERTS;
    if (len >= 6 && memcmp(seg + len - 6, "_shexp", 6) == 0)
        return INSPECT_CATEGORY_SHARED;
    return INSPECT_CATEGORY_TRUNK;
}

const char *inspect_category_name(enum inspect_category c)
{
    return c < INSPECT_CATEGORY_COUNT ? inspect_category_names[c] : "?";
}

void inspect_count_bytes(const struct gguf *g, struct inspect_bytes *out)
{
    memset(out, 0, sizeof(*out));
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        int32_t layer;
        enum inspect_category c = inspect_categorize(t->name, &layer);
        out->by_category[c] += t->nbytes;
        out->total += t->nbytes;
        if (layer >= 0 && (uint32_t)layer + 1 > out->n_layers)
            out->n_layers = (uint32_t)layer + 1;
    }
}

/* Prints a file string quoted, escaped and cut at INSPECT_STR_SHOWN bytes. */
static void inspect_put_str(FILE *out, const struct gguf_str *s)
{
    fputc('"', out);
    uint64_t shown = s->len < INSPECT_STR_SHOWN ? s->len : INSPECT_STR_SHOWN;
    for (uint64_t i = 0; i < shown; i++) {
        unsigned char c = (unsigned char)s->ptr[i];
        if (c == '"' || c == '\\')
            fprintf(out, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            fprintf(out, "\\x%02x", c);
        else
            fputc(c, out);
    }
    fputc('"', out);
    if (shown < s->len)
        fprintf(out, "... (%" PRIu64 " bytes)", s->len);
}

/* True when s is 1..max-1 printable ASCII bytes without spaces: safe to
 * print bare and to use as a key prefix. */
static bool inspect_is_word(const struct gguf_str *s, size_t max)
{
    if (s->len == 0 || s->len >= max)
        return false;
    for (uint64_t i = 0; i < s->len; i++)
        if ((unsigned char)s->ptr[i] <= 0x20 || (unsigned char)s->ptr[i] >= 0x7f)
            return false;
    return true;
}

static void inspect_put_scalar(FILE *out, const struct gguf_kv *kv)
{
    switch (kv->type) {
    case GGUF_TYPE_FLOAT32: case GGUF_TYPE_FLOAT64: fprintf(out, "%.9g", kv->v.f64); break;
    case GGUF_TYPE_BOOL: fputs(kv->v.u64 ? "true" : "false", out); break;
    case GGUF_TYPE_STRING: inspect_put_str(out, &kv->str); break;
    case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: case GGUF_TYPE_INT64:
        fprintf(out, "%" PRId64, kv->v.i64);
        break;
    default: fprintf(out, "%" PRIu64, kv->v.u64); break;
    }
}

/* An array: element type and length; then its first elements unless it is a
 * tokenizer array, which is only summarised. */
static void inspect_put_array(FILE *out, const struct gguf_kv *kv)
{
    fprintf(out, "[%s x %" PRIu64 "]", gguf_type_name(kv->arr_type), kv->n);
    if (inspect_has_prefix(kv->key, "tokenizer.") || kv->n == 0)
        return;
    uint64_t shown = kv->n < INSPECT_ARRAY_SHOWN ? kv->n : INSPECT_ARRAY_SHOWN;
    fputs(" {", out);
    for (uint64_t i = 0; i < shown; i++) {
        fputs(i ? ", " : "", out);
        if (kv->arr_type == GGUF_TYPE_STRING)
            inspect_put_str(out, &kv->strs[i]);
        else if (kv->arr_type == GGUF_TYPE_FLOAT32 || kv->arr_type == GGUF_TYPE_FLOAT64)
            fprintf(out, "%.9g", gguf_arr_f64(kv, i));
        else if (kv->arr_type == GGUF_TYPE_UINT64)
            fprintf(out, "%" PRIu64, (uint64_t)gguf_arr_i64(kv, i));
        else if (kv->arr_type == GGUF_TYPE_BOOL)
            fputs(gguf_arr_i64(kv, i) ? "true" : "false", out);
        else
            fprintf(out, "%" PRId64, gguf_arr_i64(kv, i));
    }
    fputs(shown < kv->n ? ", ...}" : "}", out);
}

static void inspect_put_kv(FILE *out, const struct gguf_kv *kv)
{
    fprintf(out, "  %-48s %-8s ", kv->key, gguf_type_name(kv->type));
    if (kv->type == GGUF_TYPE_ARRAY)
        inspect_put_array(out, kv);
    else
        inspect_put_scalar(out, kv);
    const char *ft = !strcmp(kv->key, "general.file_type") && kv->type == GGUF_TYPE_UINT32
                         ? quant_ftype_name((uint32_t)kv->v.u64)
                         : NULL;
    if (ft) /* llama.cpp's name of the mixture */
        fprintf(out, " (%s)", ft);
    fputc('\n', out);
}

/* Metadata in three groups: general.*, {arch}.*, everything else. */
static void inspect_put_metadata(FILE *out, const struct gguf *g, const char *arch_prefix)
{
    fprintf(out, "\nmetadata (%" PRIu64 " keys):\n", gguf_n_kv(g));
    for (int group = 0; group < 3; group++) {
        for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
            const struct gguf_kv *kv = gguf_kv_at(g, i);
            bool general = inspect_has_prefix(kv->key, "general.");
            bool arch = arch_prefix[0] && inspect_has_prefix(kv->key, arch_prefix);
            int in = general ? 0 : arch ? 1 : 2;
            if (in == group)
                inspect_put_kv(out, kv);
        }
    }
}

static void inspect_put_tensors(FILE *out, const struct gguf *g)
{
    fprintf(out, "\ntensors (%" PRIu64 "):\n", gguf_n_tensors(g));
    fprintf(out, "  %5s  %-40s %-8s %-20s %12s %14s\n", "#", "name", "type", "ne", "bytes",
            "file offset");
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        char ne[96];
        int len = 0;
        for (uint32_t d = 0; d < t->n_dims; d++)
            len += snprintf(ne + len, sizeof(ne) - (size_t)len, "%s%" PRId64, d ? " x " : "",
                            t->ne[d]);
        const char *type = quant_type_name(t->type);
        fprintf(out, "  %5" PRIu64 "  %-40s %-8s %-20s %12" PRIu64 " %14" PRIu64 "\n", i,
                t->name, type ? type : "?", ne, t->nbytes, gguf_data_offset(g) + t->offset);
    }
}

/* Per-layer bytes of the trunk, routed and shared experts: n_layers rows. */
static int inspect_put_layers(FILE *out, const struct gguf *g, uint32_t n_layers)
{
    if (n_layers == 0)
        return 0;
    uint64_t(*rows)[3] = calloc(n_layers, sizeof(*rows));
    if (!rows) {
        log_error("inspect: out of memory for a table of %u layers", n_layers);
        return -ENOMEM;
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        int32_t layer;
        enum inspect_category c = inspect_categorize(t->name, &layer);
        int col = c == INSPECT_CATEGORY_TRUNK ? 0 : c == INSPECT_CATEGORY_EXPERTS ? 1 : 2;
        if (layer >= 0)
            rows[layer][col] += t->nbytes;
    }
    fprintf(out, "\nbytes per layer:\n  %5s %14s %14s %14s\n", "layer", "trunk", "routed",
            "shared");
    for (uint32_t l = 0; l < n_layers; l++)
        fprintf(out, "  %5u %14" PRIu64 " %14" PRIu64 " %14" PRIu64 "\n", l, rows[l][0],
                rows[l][1], rows[l][2]);
    free(rows);
    return 0;
}

/* One line per category: label, exact bytes, human units, share of the total. */
static void inspect_put_categories(FILE *out, const struct gguf *g,
                                   const struct inspect_bytes *b, const char *arch)
{
    char h[32];
    fprintf(out, "\nbytes by category:\n");
    for (int c = 0; c < INSPECT_CATEGORY_COUNT; c++) {
        uint64_t n = b->by_category[c];
        double pct = b->total ? 100.0 * (double)n / (double)b->total : 0.0;
        fprintf(out, "  %-16s %14" PRIu64 " bytes  %12s  %5.1f%%\n", inspect_category_names[c],
                n, inspect_human(n, h, sizeof(h)), pct);
    }
    fprintf(out, "  %-16s %14" PRIu64 " bytes  %12s\n", "total", b->total,
            inspect_human(b->total, h, sizeof(h)));
    char key[96];
    uint32_t experts = 0;
    snprintf(key, sizeof(key), "%s.expert_count", arch);
    uint64_t routed = b->by_category[INSPECT_CATEGORY_EXPERTS];
    const struct gguf_kv *kv = arch[0] ? gguf_find_kv(g, key) : NULL;
    if (b->n_layers && routed && kv && gguf_type_is_int(kv->type) &&
        gguf_get_u32(g, key, &experts) == 0 && experts > 0)
        fprintf(out, "  routed experts: %u per layer, %s per expert per layer on average\n",
                experts, inspect_human(routed / b->n_layers / experts, h, sizeof(h)));
}

int inspect_print(const struct gguf *g, FILE *out)
{
    char h[32];
    fprintf(out, "GGUF version %u, %s (%" PRIu64 " bytes), alignment %u, data section at byte "
            "%" PRIu64 "\n", gguf_version(g), inspect_human(gguf_file_size(g), h, sizeof(h)),
            gguf_file_size(g), gguf_alignment(g), gguf_data_offset(g));
    char arch[64] = "";
    const struct gguf_kv *kv = gguf_find_kv(g, "general.architecture");
    if (kv && kv->type == GGUF_TYPE_STRING && inspect_is_word(&kv->str, sizeof(arch)))
        snprintf(arch, sizeof(arch), "%.*s", (int)kv->str.len, kv->str.ptr);
    fputs("architecture: ", out);
    if (arch[0])
        fputs(arch, out);
    else if (kv && kv->type == GGUF_TYPE_STRING)
        inspect_put_str(out, &kv->str);
    else
        fputs("(none)", out);
    fputc('\n', out);
    char prefix[80] = "";
    if (arch[0])
        snprintf(prefix, sizeof(prefix), "%s.", arch);
    inspect_put_metadata(out, g, prefix);
    inspect_put_tensors(out, g);
    struct inspect_bytes b;
    inspect_count_bytes(g, &b);
    inspect_put_categories(out, g, &b, arch);
    int rc = inspect_put_layers(out, g, b.n_layers);
    if (rc)
        return rc;
    if (fflush(out) != 0 || ferror(out)) {
        log_error("inspect: writing the report failed");
        return -EIO;
    }
    return 0;
}
