/*
 * perplexity: chunked negative log-likelihood of a text (see perplexity.h).
 */
#include "coordinator/perplexity.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "coordinator/engine.h"
#include "model/tokenizer.h"

static char *ppl_read(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        log_error("cannot read %s: %s", path, strerror(errno));
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (!buf)
        log_error("cannot read %s", path);
    else
        buf[n] = 0, *len = (size_t)n;
    return buf;
}

/* -log softmax(logits)[target], in double. */
static double ppl_nll(const float *logits, uint32_t n, int32_t target)
{
    float mx = logits[0];
    for (uint32_t i = 1; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (uint32_t i = 0; i < n; i++)
        sum += exp((double)logits[i] - mx);
    return log(sum) - ((double)logits[target] - mx);
}

struct ppl_job {
    struct engine *eng;
    const struct arch_model *m;
    struct tokenizer *tok;
    int32_t *ids;
    size_t n_ids;
    float *logits;
};

static int ppl_chunk(struct ppl_job *j, const int32_t *ids, uint32_t n_ctx, double *nll,
                     double *nll2, uint64_t *count)
{
    const uint32_t nv = j->m->hp.n_vocab;
    int rc = engine_reset(j->eng);
    rc = rc ? rc : engine_eval(j->eng, ids, n_ctx, true, j->logits);
    const uint32_t first = n_ctx / 2;
    for (uint32_t p = first; !rc && p + 1 < n_ctx; p++) {
        double v = ppl_nll(j->logits + (size_t)p * nv, nv, ids[p + 1]);
        *nll += v;
        *nll2 += v * v;
        (*count)++;
    }
    return rc;
}

static int ppl_setup(struct ppl_job *j, const struct perplexity_config *cfg)
{
    size_t len;
    char *text = ppl_read(cfg->text_path, &len);
    if (!text)
        return -EIO;
    struct engine_config ec = {.model_path = cfg->model_path, .n_threads = cfg->n_threads,
                               .n_ctx = cfg->n_ctx, .n_batch = cfg->n_ctx, .kv_f16 = false,
                               .cluster = cfg->cluster, .record_heat = cfg->record_heat};
    j->eng = engine_create(&ec);
    j->m = j->eng ? engine_model(j->eng) : NULL;
    struct tokenizer_config tc = {.gguf = j->eng ? engine_gguf(j->eng) : NULL};
    j->tok = j->eng ? tokenizer_create(&tc) : NULL;
    int rc = j->tok ? tokenizer_encode(j->tok, text, len, false, &j->ids, &j->n_ids) : -EINVAL;
    free(text);
    if (rc)
        return rc;
    if (j->n_ids < 2 * (size_t)cfg->n_ctx) {
        log_error("%s has %zu tokens: need at least %u for two chunks of %u", cfg->text_path,
                  j->n_ids, 2 * cfg->n_ctx, cfg->n_ctx);
        return -EINVAL;
    }
    j->logits = engine_alloc_logits(j->eng, cfg->n_ctx);
    return j->logits ? 0 : -ENOMEM;
}

int perplexity_run(const struct perplexity_config *cfg, struct perplexity_result *out)
{
    struct ppl_job j = {0};
    memset(out, 0, sizeof(*out));
    int rc = cfg->n_ctx >= 4 ? ppl_setup(&j, cfg) : -EINVAL;
    double nll = 0, nll2 = 0;
    uint64_t count = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint32_t n_chunks = rc ? 0 : (uint32_t)(j.n_ids / cfg->n_ctx);
    if (cfg->max_chunks && n_chunks > cfg->max_chunks)
        n_chunks = cfg->max_chunks;
    for (uint32_t c = 0; c < n_chunks && !rc; c++) {
        rc = ppl_chunk(&j, j.ids + (size_t)c * cfg->n_ctx, cfg->n_ctx, &nll, &nll2, &count);
        if (!rc && cfg->print_chunks)
            printf("[%u]%.4f%s", c + 1, exp(nll / count), c + 1 == n_chunks ? "\n" : ",");
        fflush(stdout);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!rc) {
        double mean = nll / count, var = nll2 / count - mean * mean;
        out->ppl = exp(mean);
        out->ppl_err = out->ppl * sqrt(var > 0 ? var / (count - 1) : 0);
        out->n_chunks = n_chunks;
        out->n_scored = count;
        out->seconds = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
        rc = engine_save_heat(j.eng);
    }
    if (j.eng)
        engine_free_logits(j.eng, j.logits);
    free(j.ids);
    tokenizer_destroy(j.tok);
    engine_destroy(j.eng);
    return rc;
}
