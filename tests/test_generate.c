/*
 * test_generate: generate_run, the in-process generation job, on a synthetic
 * qwen3next tiny model file (synth_write, Q8_0, with its byte-level BPE
 * vocabulary, in /tmp), output captured with open_memstream.
 *
 *   - sampling (temperature 0.9, top-k 40, top-p 0.95, min-p 0.05): the same
 *     seed gives byte-identical text twice, another seed different text;
 *   - greedy (a zeroed sampler config): the text equals the detokenized
 *     arg-max chain computed with the engine directly (prompt tokenized by
 *     the file's tokenizer, then one token at a time), plus the final
 *     newline; explicit prompt ids give the same text as the prompt string;
 *     echo_prompt prints the prompt first;
 *   - --dump-logits: the .npy file has the v1.0 header (magic, version,
 *     little-endian header length, dict with '<f4', C order and shape
 *     (n_prompt, n_vocab), padded with spaces to a multiple of 64 and ended
 *     by a newline) followed by exactly the engine's logits of every prompt
 *     position, bit for bit; generate_write_npy on its own likewise;
 *   - stats: prompt and generated token counts; n_predict 0 prints only the
 *     newline; a context that fills up stops generation without an error;
 *   - errors: a missing model, an empty prompt, a prompt longer than the
 *     context and an unwritable dump path return negative errnos with
 *     messages.
 */
#include "coordinator/generate.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "coordinator/engine.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "model/tokenizer.h"
#include "tests/check.h"
#include "tests/fixture.h"

#define GN_PREDICT 24
#define GN_PROMPT "def parse_args(argv):\n    return argv"

static char gn_model[128];

/* One generate_run into a string (caller frees); rc into *rc. */
static char *gn_run(struct generate_config *cfg, int *rc, struct generate_stats *st)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cfg->out = f;
    struct generate_stats local;
    *rc = generate_run(cfg, st ? st : &local);
    fclose(f);
    return buf;
}

static struct generate_config gn_config(void)
{
    return (struct generate_config){.model_path = gn_model, .prompt = GN_PROMPT,
                                    .n_predict = GN_PREDICT, .n_threads = 2, .n_ctx = 128,
                                    .kv_f16 = true, .parse_special = true, .ignore_eos = true};
}

static void gn_seeds(void)
{
    struct generate_config cfg = gn_config();
    cfg.sampler = (struct sampler_config){.temperature = 0.9f, .top_k = 40, .top_p = 0.95f,
                                          .min_p = 0.05f, .seed = 1234};
    int rc1, rc2, rc3;
    struct generate_stats st;
    char *a = gn_run(&cfg, &rc1, &st);
    char *b = gn_run(&cfg, &rc2, NULL);
    cfg.sampler.seed = 99;
    char *c = gn_run(&cfg, &rc3, NULL);
    CHECK(rc1 == 0 && rc2 == 0 && rc3 == 0, "sampled runs: %d %d %d", rc1, rc2, rc3);
    CHECK(a && b && strcmp(a, b) == 0, "same seed, different text:\n%s\n---\n%s", a, b);
    CHECK(a && c && strcmp(a, c) != 0, "seeds 1234 and 99 give the same text: %s", a);
    CHECK(st.n_gen == GN_PREDICT && st.n_prompt > 0 && st.prompt_s >= 0 && st.gen_s >= 0 &&
              st.load_s > 0 && st.peak_rss_kb > 0, "stats: %u generated, %u prompt", st.n_gen,
          st.n_prompt);
    MEASURE("sampling: seed 1234 twice identical (%zu bytes), seed 99 differs; %u prompt tokens",
            a ? strlen(a) : 0, st.n_prompt);
    free(a);
    free(b);
    free(c);
}

/* The greedy chain with the engine directly; returns the expected text. */
static char *gn_expected_greedy(int32_t **prompt_ids, size_t *n_prompt, float **prompt_logits)
{
    struct engine_config ec = {.model_path = gn_model, .n_threads = 2, .n_ctx = 128,
                               .kv_f16 = true};
    struct engine *e = engine_create(&ec);
    if (!e)
        return NULL;
    struct tokenizer_config tc = {.gguf = engine_gguf(e)};
    struct tokenizer *tok = tokenizer_create(&tc);
    struct detok_config dc = {.tok = tok};
    struct detok *dt = tok ? detok_create(&dc) : NULL;
    const int32_t V = (int32_t)engine_model(e)->hp.n_vocab;
    float *lg = malloc((size_t)V * sizeof(float));
    char *text = calloc(1, 4096);
    size_t tl = 0;
    int rc = dt && lg && text ? 0 : -ENOMEM;
    rc = rc ? rc : tokenizer_encode(tok, GN_PROMPT, strlen(GN_PROMPT), true, prompt_ids, n_prompt);
    CHECK(rc == 0 && !tokenizer_add_bos(tok), "prompt tokenized (no BOS for this vocabulary)");
    /* the logits of every prompt position, for the dump check */
    *prompt_logits = malloc(*n_prompt * (size_t)V * sizeof(float));
    rc = rc ? rc : engine_eval(e, *prompt_ids, (uint32_t)*n_prompt, true, *prompt_logits);
    rc = rc ? rc : engine_reset(e);
    rc = rc ? rc : engine_eval(e, *prompt_ids, (uint32_t)*n_prompt, false, lg);
    for (int i = 0; i < GN_PREDICT && !rc; i++) {
        int32_t best = 0;
        for (int32_t v = 1; v < V; v++)
            best = lg[v] > lg[best] ? v : best;
        const char *s;
        size_t len;
        if (detok_push(dt, best, &s, &len) == 0 && tl + len < 4000) {
            memcpy(text + tl, s, len);
            tl += len;
        }
        if (i + 1 < GN_PREDICT)
            rc = engine_eval(e, &best, 1, false, lg);
    }
    const char *s;
    size_t len;
    if (!rc && detok_flush(dt, &s, &len) == 0 && tl + len < 4000) {
        memcpy(text + tl, s, len);
        tl += len;
    }
    text[tl++] = '\n';
    free(lg);
    detok_destroy(dt);
    tokenizer_destroy(tok);
    engine_destroy(e);
    if (rc) {
        free(text);
        return NULL;
    }
    return text;
}

/* Checks the .npy at path holds rows x cols floats equal to want. */
static void gn_check_npy(const char *path, uint32_t rows, uint32_t cols, const float *want)
{
    size_t len = 0;
    char *buf = fixture_read_all(path, &len);
    CHECK(buf != NULL, "cannot read %s", path);
    if (!buf)
        return;
    const size_t hl = len >= 10 ? ((unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8) : 0;
    char shape[64];
    snprintf(shape, sizeof(shape), "'shape': (%u, %u)", rows, cols);
    CHECK(len >= 10 && memcmp(buf, "\x93NUMPY\x01\x00", 8) == 0, "npy magic/version");
    CHECK((10 + hl) % 64 == 0 && buf[10 + hl - 1] == '\n', "npy header of %zu bytes not padded "
          "to 64 or not ended by a newline", 10 + hl);
    CHECK(len == 10 + hl + (size_t)rows * cols * 4, "npy size %zu, want %zu", len,
          10 + hl + (size_t)rows * cols * 4);
    char *hdr = strndup(buf + 10, hl);
    CHECK(strstr(hdr, "'descr': '<f4'") && strstr(hdr, "'fortran_order': False") &&
              strstr(hdr, shape) && hdr[0] == '{', "npy header: %s", hdr);
    free(hdr);
    if (len == 10 + hl + (size_t)rows * cols * 4 && want)
        CHECK(memcmp(buf + 10 + hl, want, (size_t)rows * cols * 4) == 0,
              "npy data differ from the logits");
    int r = 0, c = 0;
    float *parsed = fixture_npy_f32(path, &r, &c);
    CHECK(parsed && r == (int)rows && c == (int)cols, "fixture reader: %d x %d", r, c);
    free(parsed);
    free(buf);
}

static void gn_greedy_and_dump(void)
{
    int32_t *pids = NULL;
    size_t np = 0;
    float *plog = NULL;
    char *want = gn_expected_greedy(&pids, &np, &plog);
    CHECK(want != NULL, "greedy chain through the engine");
    if (!want) {
        free(pids);
        free(plog);
        return;
    }
    struct generate_config cfg = gn_config(); /* zeroed sampler: greedy */
    int rc;
    struct generate_stats st;
    char *got = gn_run(&cfg, &rc, &st);
    CHECK(rc == 0 && got && strcmp(got, want) == 0, "greedy text differs from the engine's "
          "arg-max chain:\n%s\n--- want ---\n%s", got, want);
    CHECK(st.n_prompt == np && st.n_gen == GN_PREDICT, "stats %u prompt %u gen", st.n_prompt,
          st.n_gen);
    free(got);

    /* explicit ids give the same text */
    cfg.prompt = NULL;
    cfg.prompt_ids = pids;
    cfg.n_prompt_ids = (uint32_t)np;
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc == 0 && got && strcmp(got, want) == 0, "prompt ids give other text: %s", got);
    free(got);

    /* echo: the prompt, then the same continuation */
    cfg.echo_prompt = true;
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc == 0 && got && strncmp(got, GN_PROMPT, strlen(GN_PROMPT)) == 0 &&
              strcmp(got + strlen(GN_PROMPT), want) == 0, "echoed output: %s", got);
    free(got);
    cfg.echo_prompt = false;

    /* dump: every prompt position's logits */
    char npy[128];
    snprintf(npy, sizeof(npy), "/tmp/test_generate_%d.npy", (int)getpid());
    cfg.dump_logits = npy;
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc == 0, "generate with --dump-logits: %d", rc);
    gn_check_npy(npy, (uint32_t)np, 512, plog); /* the tiny shape's vocabulary */
    /* the dump path samples from the batched lm head's last row: measured */
    MEASURE("greedy text %s with --dump-logits (%zu bytes); matches the engine's arg-max chain "
            "without", got && !strcmp(got, want) ? "unchanged" : "CHANGED", strlen(want));
    free(got);
    unlink(npy);

    /* generate_write_npy alone: odd sizes, exact bytes */
    float small[3 * 5];
    for (int i = 0; i < 15; i++)
        small[i] = (float)i * 0.5f - 3.0f;
    CHECK(generate_write_npy(npy, small, 3, 5) == 0, "write_npy");
    gn_check_npy(npy, 3, 5, small);
    unlink(npy);
    int wrc = generate_write_npy("/nonexistent-dir/x.npy", small, 3, 5);
    CHECK(wrc < 0, "unwritable path: rc %d", wrc);
    CHECK(strstr(log_last_error(), "/nonexistent-dir/x.npy") != NULL, "message: %s",
          log_last_error());
    MEASURE("generate_write_npy to a missing directory returns %d (-ENOENT = %d)", wrc, -ENOENT);
    free(want);
    free(pids);
    free(plog);
}

static void gn_edges(void)
{
    struct generate_config cfg = gn_config();
    int rc;
    struct generate_stats st;
    cfg.n_predict = 0;
    char *got = gn_run(&cfg, &rc, &st);
    CHECK(rc == 0 && got && strcmp(got, "\n") == 0 && st.n_gen == 0, "n_predict 0 printed '%s'",
          got);
    free(got);

    /* a context that fills up: generation stops, no error */
    cfg = gn_config();
    cfg.n_predict = 50;
    cfg.n_ctx = 0;
    got = gn_run(&cfg, &rc, &st);
    const uint32_t np = st.n_prompt;
    free(got);
    cfg.n_ctx = np + 5;
    got = gn_run(&cfg, &rc, &st);
    CHECK(rc == 0 && st.n_gen == 6, "context of prompt + 5: rc %d, %u generated (want 6)", rc,
          st.n_gen);
    free(got);

    /* errors */
    cfg = gn_config();
    cfg.n_ctx = 4;
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc == -ENOSPC, "prompt longer than the context: rc %d", rc);
    free(got);
    cfg = gn_config();
    cfg.prompt = "";
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc == -EINVAL && strstr(log_last_error(), "prompt is empty"), "empty prompt: rc %d %s",
          rc, log_last_error());
    free(got);
    cfg = gn_config();
    cfg.model_path = "/nonexistent/model.gguf";
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc < 0, "missing model: rc %d", rc);
    free(got);
    cfg = gn_config();
    cfg.dump_logits = "/nonexistent-dir/logits.npy";
    got = gn_run(&cfg, &rc, NULL);
    CHECK(rc < 0 && strstr(log_last_error(), "/nonexistent-dir/logits.npy"),
          "unwritable dump: rc %d %s", rc, log_last_error());
    free(got);
}

int main(void)
{
    log_init("test", -1);
    log_set_level(LOG_LEVEL_WARN); /* generate_run logs an info summary per run */
    snprintf(gn_model, sizeof(gn_model), "/tmp/test_generate_%d.gguf", (int)getpid());
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 17, .path = gn_model, .threads = 1};
    CHECK(synth_write(&sc) == 0, "synth_write");
    gn_seeds();
    gn_greedy_and_dump();
    gn_edges();
    unlink(gn_model);
    return test_main_result("test_generate");
}
