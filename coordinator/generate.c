/*
 * generate: the in-process generation job (see generate.h).
 */
#include "coordinator/generate.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "worker/forward.h"


struct generate_job {
    const struct generate_config *cfg;
    struct gguf *g;
    struct arch_model *m;
    struct tokenizer *tok;
    struct threadpool *pool;
    struct forward *fw;
    struct forward_seq *seq;
    struct cluster *cl;      /* multi-process mode, else NULL */
    uint32_t pos;            /* tokens consumed */
    struct sampler *smp;
    struct detok *dt;
    int32_t *ids;            /* prompt ids */
    size_t n_ids;
    float *h;                /* hidden rows, n_ids x n_embd */
    float *logits;           /* n_ids x n_vocab when dumping, else n_vocab */
};

static double generate_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int generate_load(struct generate_job *job)
{
    const struct generate_config *cfg = job->cfg;
    struct gguf_config gc = {.path = cfg->model_path};
    job->g = gguf_open(&gc);
    if (!job->g)
        return -EINVAL;
    struct arch_config ac = {.gguf = job->g};
    job->m = arch_load(&ac);
    if (!job->m)
        return -EINVAL;
    struct tokenizer_config tc = {.gguf = job->g};
    job->tok = tokenizer_create(&tc);
    if (!job->tok)
        return -EINVAL;
    if (tokenizer_n_vocab(job->tok) > (int32_t)job->m->hp.n_vocab)
        log_warn("tokenizer has %d tokens, more than the %u rows of token_embd",
                 tokenizer_n_vocab(job->tok), job->m->hp.n_vocab);
    gguf_prefault(job->g, true);
    struct threadpool_config pc = {.n_threads = cfg->n_threads, .pin = true};
    job->pool = threadpool_create(&pc);
    if (!job->pool)
        return -ENOMEM;
    struct forward_config fc = {.model = job->m, .pool = job->pool, .n_ctx = cfg->n_ctx,
                                .kv_f16 = cfg->kv_f16, .max_batch = cfg->n_batch};
    if (cfg->cluster) { /* the forward only embeds and names the context size */
        fc.layer_begin = 0;
        fc.layer_end = 1;
    }
    job->fw = forward_create(&fc);
    job->seq = job->fw && !cfg->cluster ? forward_seq_create(job->fw) : NULL;
    if (cfg->cluster && job->fw) {
        struct cluster_config *cc = cfg->cluster;
        cc->model_path = cfg->model_path;
        cc->gguf = job->g;
        cc->model = job->m;
        cc->n_ctx = forward_n_ctx(job->fw);
        cc->kv_f16 = cfg->kv_f16;
        cc->max_batch = cfg->n_batch ? cfg->n_batch : 256;
        job->cl = cluster_create(cc);
        if (!job->cl)
            return -EIO;
        if (cfg->on_cluster)
            cfg->on_cluster(job->cl);
    }
    job->smp = sampler_create(&cfg->sampler);
    struct detok_config dc = {.tok = job->tok};
    job->dt = detok_create(&dc);
    if ((!job->seq && !job->cl) || !job->smp || !job->dt)
        return -ENOMEM;
    log_info("model %s: %s, %u layers, %u experts (top-%u), vocab %u, %d threads, context %u",
             cfg->model_path, job->m->hp.arch_name, job->m->hp.n_layer, job->m->hp.n_expert,
             job->m->hp.n_expert_used, job->m->hp.n_vocab, threadpool_n_threads(job->pool),
             forward_n_ctx(job->fw));
    return 0;
}

static int generate_prompt_ids(struct generate_job *job)
{
    const struct generate_config *cfg = job->cfg;
    if (cfg->prompt_ids) {
        job->ids = malloc((cfg->n_prompt_ids + 1) * sizeof(int32_t));
        if (!job->ids)
            return -ENOMEM;
        memcpy(job->ids, cfg->prompt_ids, cfg->n_prompt_ids * sizeof(int32_t));
        job->n_ids = cfg->n_prompt_ids;
    } else {
        const char *p = cfg->prompt ? cfg->prompt : "";
        int rc = tokenizer_encode(job->tok, p, strlen(p), cfg->parse_special, &job->ids,
                                  &job->n_ids);
        if (rc)
            return rc;
        if (tokenizer_add_bos(job->tok) && tokenizer_bos(job->tok) >= 0) {
            int32_t *ids = realloc(job->ids, (job->n_ids + 1) * sizeof(int32_t));
            if (!ids)
                return -ENOMEM;
            memmove(ids + 1, ids, job->n_ids * sizeof(int32_t));
            ids[0] = tokenizer_bos(job->tok);
            job->ids = ids;
            job->n_ids++;
        }
    }
    if (job->n_ids == 0) {
        log_error("the prompt is empty: give -p TEXT, -f FILE or --prompt-ids");
        return -EINVAL;
    }
    if (job->n_ids + (size_t)(cfg->n_predict > 0 ? cfg->n_predict : 0) > forward_n_ctx(job->fw))
        log_warn("prompt (%zu tokens) plus %d to generate exceed the context of %u; generation "
                 "stops when it is full", job->n_ids, cfg->n_predict, forward_n_ctx(job->fw));
    return 0;
}

static void generate_emit(struct generate_job *job, int32_t id)
{
    const char *s;
    size_t len;
    if (detok_push(job->dt, id, &s, &len) == 0 && len) {
        fwrite(s, 1, len, job->cfg->out);
        fflush(job->cfg->out);
    }
}

/* Embeds n ids and runs them through every layer (here or on the workers);
 * logits of the last row, or of all rows when all is set, into out. */
static int generate_eval(struct generate_job *job, const int32_t *ids, uint32_t n, bool all,
                         float *out)
{
    const size_t w = job->m->hp.n_embd, nv = job->m->hp.n_vocab;
    const uint32_t B = job->cfg->n_batch ? job->cfg->n_batch : 256;
    if (job->pos + n > forward_n_ctx(job->fw)) {
        log_error("context full: %u tokens at position %u exceed the context of %u", n, job->pos,
                  forward_n_ctx(job->fw));
        return -ENOSPC;
    }
    int rc = forward_embed(job->fw, ids, n, job->h);
    if (rc)
        return rc;
    if (!job->cl) {
        rc = forward_layers(job->fw, job->seq, job->h, n);
        rc = rc ? rc : forward_logits(job->fw, all ? job->h : job->h + (size_t)(n - 1) * w,
                                      all ? n : 1, out);
        job->pos += rc ? 0 : n;
        return rc;
    }
    for (uint32_t s = 0; s < n && !rc; s += B) {
        const uint32_t c = n - s < B ? n - s : B;
        const bool last = s + c == n;
        if (!all && !last)
            rc = cluster_step(job->cl, job->h + (size_t)s * w, c, job->pos, false, out);
        else
            rc = cluster_step(job->cl, job->h + (size_t)s * w, c, job->pos, all,
                              all ? out + (size_t)s * nv : out);
        job->pos += rc ? 0 : c;
    }
    return rc;
}

static int generate_prefill(struct generate_job *job, struct generate_stats *st)
{
    const struct generate_config *cfg = job->cfg;
    const struct arch_hparams *hp = &job->m->hp;
    const size_t n = job->n_ids;
    job->h = malloc(n * hp->n_embd * sizeof(float));
    job->logits = malloc((cfg->dump_logits ? n : 1) * (size_t)hp->n_vocab * sizeof(float));
    if (!job->h || !job->logits)
        return -ENOMEM;
    if (cfg->echo_prompt)
        for (size_t i = 0; i < n; i++)
            generate_emit(job, job->ids[i]);
    double t0 = generate_now();
    int rc = generate_eval(job, job->ids, (uint32_t)n, cfg->dump_logits != NULL, job->logits);
    if (rc)
        return rc;
    if (cfg->dump_logits) {
        rc = generate_write_npy(cfg->dump_logits, job->logits, (uint32_t)n, hp->n_vocab);
        if (!rc)
            memmove(job->logits, job->logits + (n - 1) * hp->n_vocab, hp->n_vocab * sizeof(float));
    }
    st->n_prompt = (uint32_t)n;
    st->prompt_s = generate_now() - t0;
    for (size_t i = 0; i < n; i++)
        sampler_accept(job->smp, job->ids[i]);
    return rc;
}

static int generate_decode(struct generate_job *job, struct generate_stats *st)
{
    const struct generate_config *cfg = job->cfg;
    const uint32_t nv = job->m->hp.n_vocab;
    double t0 = generate_now();
    for (int32_t i = 0; i < cfg->n_predict; i++) {
        int32_t id = sampler_sample(job->smp, job->logits, (int32_t)nv);
        sampler_accept(job->smp, id);
        st->n_gen++;
        if (!cfg->ignore_eos && tokenizer_is_eog(job->tok, id))
            break;
        generate_emit(job, id);
        if (i + 1 == cfg->n_predict || job->pos >= forward_n_ctx(job->fw))
            break;
        int rc = generate_eval(job, &id, 1, false, job->logits);
        if (rc)
            return rc;
    }
    st->gen_s = generate_now() - t0;
    const char *s;
    size_t len;
    if (detok_flush(job->dt, &s, &len) == 0 && len)
        fwrite(s, 1, len, cfg->out);
    fputc('\n', cfg->out);
    fflush(cfg->out);
    return 0;
}

int generate_run(const struct generate_config *cfg, struct generate_stats *st)
{
    struct generate_job job = {.cfg = cfg};
    memset(st, 0, sizeof(*st));
    double t0 = generate_now();
    int rc = generate_load(&job);
    st->load_s = generate_now() - t0;
    rc = rc ? rc : generate_prompt_ids(&job);
    rc = rc ? rc : generate_prefill(&job, st);
    rc = rc ? rc : generate_decode(&job, st);
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        st->peak_rss_kb = ru.ru_maxrss;
    free(job.h);
    free(job.logits);
    free(job.ids);
    detok_destroy(job.dt);
    sampler_destroy(job.smp);
    if (job.cl && !rc && cfg->cluster && log_is_enabled(LOG_LEVEL_INFO))
        cluster_print_summary(job.cl, stderr);
    if (cfg->on_cluster)
        cfg->on_cluster(NULL);
    cluster_destroy(job.cl);
    forward_seq_destroy(job.seq);
    forward_destroy(job.fw);
    threadpool_destroy(job.pool);
    tokenizer_destroy(job.tok);
    arch_free(job.m);
    gguf_close(job.g);
    return rc;
}

int generate_write_npy(const char *path, const float *data, uint32_t rows, uint32_t cols)
{
    char hdr[128];
    int len = snprintf(hdr, sizeof(hdr),
                       "{'descr': '<f4', 'fortran_order': False, 'shape': (%u, %u), }", rows, cols);
    int total = 10 + len + 1;
    int pad = (64 - total % 64) % 64;
    FILE *f = fopen(path, "wb");
    if (!f) {
        log_error("cannot write logits to %s: %s", path, strerror(errno));
        return -errno;
    }
    uint16_t hl = (uint16_t)(len + pad + 1);
    fwrite("\x93NUMPY\x01\x00", 1, 8, f);
    fputc(hl & 0xff, f);
    fputc(hl >> 8, f);
    fwrite(hdr, 1, (size_t)len, f);
    for (int i = 0; i < pad; i++)
        fputc(' ', f);
    fputc('\n', f);
    size_t nw = fwrite(data, sizeof(float), (size_t)rows * cols, f);
    if (fclose(f) != 0 || nw != (size_t)rows * cols) {
        log_error("cannot write logits to %s: %s", path, strerror(errno ? errno : EIO));
        return -EIO;
    }
    return 0;
}
