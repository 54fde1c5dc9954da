/*
 * test_inspect: the `lamina inspect` report of the qwen3next conformance
 * fixture, printed into memory, shows every tensor and key group, and its
 * byte breakdown adds up: categories sum to the total, and the routed-expert
 * figure equals the *_exps tensor sizes summed independently here.
 */
#include "model/inspect.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "model/gguf.h"
#include "tests/check.h"

/* The exact byte count printed on the category line starting with label. */
static uint64_t printed_bytes(const char *report, const char *label)
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\n  %s ", label);
    const char *p = strstr(report, pat);
    if (!p)
        return UINT64_MAX;
    p += strlen(pat);
    unsigned long long n;
    char unit[8];
    if (sscanf(p, " %llu %7s", &n, unit) != 2 || strcmp(unit, "bytes") != 0)
        return UINT64_MAX;
    return n;
}

/* Sums independently: every tensor whose name contains "_exps" or "_shexp". */
static void independent_sums(const struct gguf *g, uint64_t *exps, uint64_t *shexp,
                             uint64_t *total)
{
    *exps = *shexp = *total = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        const char *tail = strrchr(t->name, '.');
        size_t len = tail ? (size_t)(tail - t->name) : strlen(t->name);
        if (len > 5 && memcmp(t->name + len - 5, "_exps", 5) == 0)
            *exps += t->nbytes;
        if (strstr(t->name, "_shexp"))
            *shexp += t->nbytes;
        *total += t->nbytes;
    }
}

static void check_report(const struct gguf *g, const char *report)
{
    uint64_t exps, shexp, total;
    independent_sums(g, &exps, &shexp, &total);
    uint64_t sum = 0;
    for (int c = 0; c < INSPECT_CATEGORY_COUNT; c++) {
        uint64_t n = printed_bytes(report, inspect_category_name((enum inspect_category)c));
        CHECK(n != UINT64_MAX, "no line for '%s'", inspect_category_name((enum inspect_category)c));
        sum += n;
    }
    uint64_t printed_total = printed_bytes(report, "total");
    uint64_t routed = printed_bytes(report, "routed experts");
    uint64_t shared = printed_bytes(report, "shared experts");
    CHECK(sum == printed_total && printed_total == total, "categories %" PRIu64 ", total %" PRIu64
          ", tensors %" PRIu64, sum, printed_total, total);
    CHECK(routed == exps && exps > 0, "routed %" PRIu64 " vs *_exps %" PRIu64, routed, exps);
    CHECK(shared == shexp && shexp > 0, "shared %" PRIu64 " vs *_shexp %" PRIu64, shared, shexp);
    MEASURE("inspect qwen3next-f32: %" PRIu64 " tensor bytes = sum of 6 categories; routed "
            "experts %" PRIu64 " (%.1f%%), shared %" PRIu64, total, routed,
            100.0 * (double)routed / (double)total, shared);
}

/* Every tensor name and the container facts appear; tokenizer arrays are
 * summarised without their contents. */
static void check_contents(const struct gguf *g, const char *report)
{
    int missing = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++)
        missing += !strstr(report, gguf_tensor_at(g, i)->name);
    CHECK(missing == 0, "%d tensor names missing from the report", missing);
    CHECK(strstr(report, "GGUF version 3,") && strstr(report, "alignment 32"), "header line");
    CHECK(strstr(report, "architecture: qwen3next\n"), "architecture line");
    CHECK(strstr(report, "qwen3next.expert_count"), "hyper-parameter keys");
    const char *general = strstr(report, "general.name");
    const char *hparam = strstr(report, "qwen3next.block_count");
    const char *tok = strstr(report, "tokenizer.ggml.tokens");
    CHECK(general && hparam && tok && general < hparam && hparam < tok, "key groups in order");
    CHECK(tok && strncmp(strchr(tok, '['), "[string x 1024]\n", 16) == 0, "tokens summarised");
    const struct gguf_kv *tokens = gguf_find_kv(g, "tokenizer.ggml.tokens");
    CHECK(tokens && tokens->n == 1024, "tokens kv");
    CHECK(strstr(report, "routed experts: 16 per layer"), "experts per layer line");
    CHECK(strstr(report, "bytes per layer:"), "per-layer table");
}

/* Categories of names, including the edge cases of the blk.N. parser. */
static void test_categorize(void)
{
    int32_t layer;
    CHECK(inspect_categorize("token_embd.weight", &layer) == INSPECT_CATEGORY_EMBEDDINGS &&
          layer == -1, "token_embd");
    CHECK(inspect_categorize("output.weight", NULL) == INSPECT_CATEGORY_OUTPUT, "output");
    CHECK(inspect_categorize("output_norm.weight", NULL) == INSPECT_CATEGORY_OUTPUT, "norm");
    CHECK(inspect_categorize("blk.12.ffn_gate_up_exps.weight", &layer) ==
          INSPECT_CATEGORY_EXPERTS && layer == 12, "gate_up_exps");
    CHECK(inspect_categorize("blk.3.ffn_down_exps.weight", &layer) == INSPECT_CATEGORY_EXPERTS,
          "down_exps");
    CHECK(inspect_categorize("blk.0.ffn_gate_inp_shexp.weight", &layer) ==
          INSPECT_CATEGORY_SHARED && layer == 0, "gate_inp_shexp");
    CHECK(inspect_categorize("blk.0.ffn_gate_inp.weight", &layer) == INSPECT_CATEGORY_TRUNK,
          "router is trunk");
    CHECK(inspect_categorize("blk.x.attn_q.weight", &layer) == INSPECT_CATEGORY_OTHER &&
          layer == -1, "blk.x");
    CHECK(inspect_categorize("blk.99999999999.attn_q", &layer) == INSPECT_CATEGORY_OTHER,
          "huge layer number");
    CHECK(inspect_categorize("rope_freqs.weight", NULL) == INSPECT_CATEGORY_OTHER, "other");
}

/* A file without tensors (the vocab-only tokenizer) reports zero bytes. */
static void test_no_tensors(void)
{
    char path[512];
    struct gguf_config cfg = {.path = test_fixture(path, sizeof(path),
                                                   "tokenizer/qwen2-vocab.gguf")};
    struct gguf *g = gguf_open(&cfg);
    CHECK(g, "open %s", path);
    if (!g)
        return;
    char *report = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&report, &len);
    CHECK(mem && inspect_print(g, mem) == 0, "inspect_print failed");
    if (mem)
        fclose(mem);
    CHECK(report && printed_bytes(report, "total") == 0 && !strstr(report, "bytes per layer"),
          "vocab-only report");
    CHECK(report && strstr(report, "architecture: qwen2\n") &&
          strstr(report, "tokenizer.ggml.merges") && strstr(report, "[string x 151387]\n"),
          "vocab-only metadata");
    free(report);
    gguf_close(g);
}

int main(void)
{
    log_init("test", -1);
    test_categorize();
    test_no_tensors();
    char path[512];
    char err[512] = "";
    struct gguf_config cfg = {.path = test_fixture(path, sizeof(path),
                                                   "conformance/qwen3next/qwen3next-f32.gguf"),
                              .err = err, .err_len = sizeof(err)};
    struct gguf *g = gguf_open(&cfg);
    CHECK(g, "open %s: %s", path, err);
    if (g) {
        char *report = NULL;
        size_t len = 0;
        FILE *mem = open_memstream(&report, &len);
        CHECK(mem && inspect_print(g, mem) == 0, "inspect_print failed");
        if (mem)
            fclose(mem);
        if (report) {
            check_report(g, report);
            check_contents(g, report);
            size_t lines = 0;
            for (size_t i = 0; i < len; i++)
                lines += report[i] == '\n';
            MEASURE("inspect report: %zu bytes, %zu lines", len, lines);
        }
        if (getenv("TEST_INSPECT_SHOW") && report)
            fputs(report, stdout);
        free(report);
    }
    gguf_close(g);
    return test_main_result("test_inspect");
}
