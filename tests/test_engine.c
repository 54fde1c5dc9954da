/*
 * test_engine: the in-process engine (no cluster) on a synthetic qwen3next
 * tiny model file (synth_write, Q8_0, in /tmp).
 *
 *   - create: accessors report the model, context, threads and position 0;
 *     a missing file and a file that is not a model give NULL;
 *   - eval: one call over a 20-token prompt equals a forward run directly
 *     (bit for bit, all positions); with n_batch 4, one call of 20 equals 5
 *     calls of 4 (same passes, position carried) bit for bit, and calls of
 *     12 + 8 are within 1e-4 of one call (chunk boundaries change the
 *     DeltaNet rounding); all = false gives the last row of all = true;
 *     positions advance by the tokens evaluated;
 *   - engine_reset starts over: the same logits as a fresh engine, bits;
 *   - the context end: filling it exactly works, one token more is -ENOSPC
 *     and leaves the position; an id outside the vocabulary is an error that
 *     leaves the position;
 *   - engine_print_summary prints the stage shares.
 */
#include "coordinator/engine.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"
#include "worker/forward.h"

#define EN_N 20
#define EN_CTX 24

static char en_path[128];

static const int32_t en_ids[EN_CTX] = {3,   14,  159, 265, 358, 97,  93,  238,
                                       462, 64,  338, 327, 95,  28,  84,  197,
                                       169, 399, 375, 105, 82,  97,  494, 459};

static struct engine *en_create(uint32_t n_ctx, uint32_t n_batch)
{
    struct engine_config ec = {.model_path = en_path, .n_threads = 2, .n_ctx = n_ctx,
                               .n_batch = n_batch};
    return engine_create(&ec);
}

static double en_maxdiff(const float *a, const float *b, size_t n, double *scale)
{
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs(a[i]));
    }
    *scale = s;
    return d;
}

/* Logits of every prompt position through a forward of the engine's model. */
static void en_forward_ref(const struct arch_model *m, float *out)
{
    struct threadpool_config tc = {.n_threads = 1, .pin = false};
    struct threadpool *pool = threadpool_create(&tc);
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = 64};
    struct forward *fw = forward_create(&fc);
    struct forward_seq *seq = fw ? forward_seq_create(fw) : NULL;
    float *h = malloc(EN_N * m->hp.n_embd * sizeof(float));
    CHECK(seq && forward_embed(fw, en_ids, EN_N, h) == 0 &&
              forward_layers(fw, seq, h, EN_N) == 0 && forward_logits(fw, h, EN_N, out) == 0,
          "forward reference");
    free(h);
    forward_seq_destroy(seq);
    forward_destroy(fw);
    threadpool_destroy(pool);
}

static void en_eval(void)
{
    struct engine *e = en_create(64, 0);
    CHECK(e != NULL, "engine_create: %s", log_last_error());
    if (!e)
        return;
    const struct arch_model *m = engine_model(e);
    const size_t V = m->hp.n_vocab;
    CHECK(engine_gguf(e) != NULL && m->hp.n_layer == 4 && engine_n_ctx(e) == 64 &&
              engine_pos(e) == 0 && engine_n_threads(e) == 2, "accessors");
    float *all = malloc(EN_N * V * sizeof(float)), *ref = malloc(EN_N * V * sizeof(float));
    float *alt = malloc(EN_N * V * sizeof(float)), *last = malloc(V * sizeof(float));
    en_forward_ref(m, ref);
    CHECK(engine_eval(e, en_ids, EN_N, true, all) == 0 && engine_pos(e) == EN_N, "eval all");
    CHECK(memcmp(all, ref, EN_N * V * sizeof(float)) == 0,
          "engine logits differ from a direct forward");

    /* reset: a fresh start, the last row only */
    CHECK(engine_reset(e) == 0 && engine_pos(e) == 0, "reset");
    CHECK(engine_eval(e, en_ids, EN_N, false, last) == 0, "eval last");
    /* all = false runs the lm head on one row (matvec_rows), all = true on
     * 20 (matvec_rows_batch): the same up to the last bits */
    double scale, d = en_maxdiff(all + (EN_N - 1) * V, last, V, &scale);
    CHECK(d <= 1e-5 * scale, "all = false is not the last row of all = true (or reset does not "
          "start over): %g", d);
    MEASURE("last-token logits with all = false vs the last row of all = true: max diff %.3g "
            "(%s)", d, d == 0 ? "identical" : "one-row vs batched lm head");

    /* two calls: 12 then 8, the position carried */
    CHECK(engine_reset(e) == 0, "reset");
    CHECK(engine_eval(e, en_ids, 12, true, alt) == 0 && engine_pos(e) == 12, "first 12");
    CHECK(engine_eval(e, en_ids + 12, 8, true, alt + 12 * V) == 0 && engine_pos(e) == EN_N,
          "next 8");
    d = en_maxdiff(all, alt, EN_N * V, &scale);
    CHECK(d <= 1e-4 * scale, "12 + 8 differs from one call by %g (scale %g)", d, scale);
    MEASURE("engine: one 20-token call bit-identical to a direct forward; 12 + 8 calls within "
            "%.2g of it (relative %.2g)", d, d / scale);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    engine_print_summary(e, f);
    fclose(f);
    CHECK(buf && strstr(buf, "stages:") && strstr(buf, "deltanet"), "summary: %s", buf);
    free(buf);
    engine_destroy(e);

    /* n_batch 4: one call is five passes of 4, the same as five calls of 4 */
    e = en_create(64, 4);
    struct engine *e2 = en_create(64, 4);
    CHECK(e && e2, "engines with n_batch 4");
    if (e && e2) {
        CHECK(engine_eval(e, en_ids, EN_N, true, all) == 0, "batched one call");
        for (uint32_t s = 0; s < EN_N; s += 4)
            CHECK(engine_eval(e2, en_ids + s, 4, true, alt + s * V) == 0 &&
                      engine_pos(e2) == s + 4, "call at %u", s);
        CHECK(memcmp(all, alt, EN_N * V * sizeof(float)) == 0,
              "one call in passes of 4 differs from calls of 4");
        d = en_maxdiff(ref, all, EN_N * V, &scale);
        CHECK(d <= 1e-4 * scale, "passes of 4 differ from one pass by %g", d);
        /* reset equals a fresh engine */
        CHECK(engine_reset(e2) == 0, "reset");
        CHECK(engine_eval(e2, en_ids, EN_N, true, alt) == 0, "after reset");
        CHECK(memcmp(all, alt, EN_N * V * sizeof(float)) == 0, "reset differs from fresh");
    }
    engine_destroy(e);
    engine_destroy(e2);
    engine_destroy(NULL);
    free(all);
    free(ref);
    free(alt);
    free(last);
}

static void en_context(void)
{
    struct engine *e = en_create(24, 8);
    CHECK(e != NULL, "engine n_ctx 24");
    if (!e)
        return;
    const size_t V = engine_model(e)->hp.n_vocab;
    float *out = malloc(24 * V * sizeof(float));
    CHECK(engine_n_ctx(e) == 24, "n_ctx %u", engine_n_ctx(e));
    CHECK(engine_eval(e, en_ids, EN_N, false, out) == 0 && engine_pos(e) == 20, "20 tokens");
    CHECK(engine_eval(e, en_ids, 5, false, out) == -ENOSPC, "25 > 24 not -ENOSPC");
    CHECK(engine_pos(e) == 20, "position moved on -ENOSPC: %u", engine_pos(e));
    const int32_t bad[2] = {7, (int32_t)V};
    CHECK(engine_eval(e, bad, 2, false, out) == -EINVAL, "id n_vocab accepted");
    CHECK(engine_pos(e) == 20, "position moved on a bad id: %u", engine_pos(e));
    CHECK(engine_eval(e, en_ids, 4, false, out) == 0 && engine_pos(e) == 24, "fill to 24");
    CHECK(engine_eval(e, en_ids, 1, false, out) == -ENOSPC, "one past the end");
    CHECK(engine_eval(e, en_ids, 0, false, out) != 0, "an empty eval is not refused");
    CHECK(engine_reset(e) == 0 && engine_eval(e, en_ids, EN_CTX, true, out) == 0 &&
              engine_pos(e) == EN_CTX, "the full context in one call after reset");
    free(out);
    engine_destroy(e);
}

static void en_bad_files(void)
{
    struct engine_config ec = {.model_path = "/nonexistent/model.gguf", .n_threads = 1};
    CHECK(engine_create(&ec) == NULL, "missing file accepted");
    char junk[128];
    snprintf(junk, sizeof(junk), "/tmp/test_engine_%d.junk", (int)getpid());
    FILE *f = fopen(junk, "wb");
    fputs("GGUF but not really", f);
    fclose(f);
    ec.model_path = junk;
    CHECK(engine_create(&ec) == NULL, "junk file accepted");
    unlink(junk);
}

int main(void)
{
    log_init("test", -1);
    snprintf(en_path, sizeof(en_path), "/tmp/test_engine_%d.gguf", (int)getpid());
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 13, .path = en_path, .threads = 1};
    CHECK(synth_write(&sc) == 0, "synth_write");
    en_eval();
    en_context();
    en_bad_files();
    unlink(en_path);
    return test_main_result("test_engine");
}
