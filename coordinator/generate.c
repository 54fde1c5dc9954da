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
#include "coordinator/engine.h"
#include "ipc/shm.h"
#include "model/tokenizer.h"


struct generate_job {
    const struct generate_config *cfg;
    struct engine *eng;
    const struct arch_model *m;
    struct tokenizer *tok;
    struct sampler *smp;
    struct detok *dt;
    int32_t *ids;            /* prompt ids */
    size_t n_ids;
    float *logits;           /* n_ids x n_vocab when dumping, else n_vocab */
    int32_t first;           /* the token picked after the prompt */
    uint32_t cached;         /* prompt tokens the prompt cache gave (0: none) */
    bool cache_write;        /* write the prompt cache after the prompt */
};

#define PC_MAGIC "LMNPCACH"
#define PC_VERSION 2u /* 2: body_sum (1 had none: such a file is recomputed and replaced) */

struct pc_header {
    char magic[8];
    uint32_t version, kv_f16;
    uint64_t model_hash;
    uint32_t n_layer, n_tokens, n_vocab;
    uint32_t body_sum; /* pc_sum of the body (ids, logits, state): a damaged file is not used */
    uint64_t state_bytes;
};
_Static_assert(sizeof(struct pc_header) == 48, "prompt cache header layout");

/* A 64-bit multiply-xor over 8-byte words (a state of hundreds of MB in tens of ms), the
 * tail bytes one by one, continuing from h. */
static uint64_t pc_sum(const void *p, size_t bytes, uint64_t h)
{
    const uint8_t *b = p;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < bytes; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* The body's checksum (header body_sum): its three parts (ids, logits, state) summed in turn,
 * folded to 32 bits. */
static uint32_t pc_body_sum(const void *ids, size_t ids_bytes, const void *logits,
                            size_t logits_bytes, const void *state, size_t state_bytes)
{
    uint64_t h = pc_sum(ids, ids_bytes, 0xcbf29ce484222325ull);
    h = pc_sum(logits, logits_bytes, h);
    h = pc_sum(state, state_bytes, h);
    return (uint32_t)(h ^ h >> 32);
}

static double generate_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int generate_load(struct generate_job *job)
{
    const struct generate_config *cfg = job->cfg;
    struct engine_config ec = {.model_path = cfg->model_path, .n_threads = cfg->n_threads,
                               .n_ctx = cfg->n_ctx, .n_batch = cfg->n_batch,
                               .kv_f16 = cfg->kv_f16, .progress = true,
                               .cluster = cfg->cluster, .on_cluster = cfg->on_cluster,
                               .record_heat = cfg->record_heat, .backend = cfg->backend};
    job->eng = engine_create(&ec);
    if (!job->eng)
        return -EINVAL;
    job->m = engine_model(job->eng);
    struct tokenizer_config tc = {.gguf = engine_gguf(job->eng)};
    job->tok = tokenizer_create(&tc);
    if (!job->tok)
        return -EINVAL;
    if (tokenizer_n_vocab(job->tok) > (int32_t)job->m->hp.n_vocab)
        log_warn("tokenizer has %d tokens, more than the %u rows of token_embd",
                 tokenizer_n_vocab(job->tok), job->m->hp.n_vocab);
    job->smp = sampler_create(&cfg->sampler);
    struct detok_config dc = {.tok = job->tok};
    job->dt = detok_create(&dc);
    if (!job->smp || !job->dt)
        return -ENOMEM;
    log_info("model %s: %s, %u layers, %u experts (top-%u), vocab %u, %d threads, context %u",
             cfg->model_path, job->m->hp.arch_name, job->m->hp.n_layer, job->m->hp.n_expert,
             job->m->hp.n_expert_used, job->m->hp.n_vocab, engine_n_threads(job->eng),
             engine_n_ctx(job->eng));
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
    if (job->n_ids + (size_t)(cfg->n_predict > 0 ? cfg->n_predict : 0) > engine_n_ctx(job->eng))
        log_warn("prompt (%zu tokens) plus %d to generate exceed the context of %u; generation "
                 "stops when it is full", job->n_ids, cfg->n_predict, engine_n_ctx(job->eng));
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

/* Reads the prompt cache into *hdr and the malloc'd *body (tokens, logits, state). 1: a
 * usable cache of this model and KV type; 0: none or not usable (a warning says why; it is
 * recomputed and rewritten); < 0: a file that is not a prompt cache (refused). */
static int pc_read(struct generate_job *job, struct pc_header *hdr, uint8_t **body)
{
    const char *path = job->cfg->prompt_cache;
    const struct arch_hparams *hp = &job->m->hp;
    *body = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno != ENOENT) {
            log_error("prompt cache %s: %s", path, strerror(errno));
            return -errno;
        }
        log_info("prompt cache %s: none yet; it is written after the prompt", path);
        return 0;
    }
    const char *why = NULL;
    size_t got = fread(hdr, 1, sizeof(*hdr), f);
    if (got < sizeof(hdr->magic) || memcmp(hdr->magic, PC_MAGIC, sizeof(hdr->magic))) {
        fclose(f);
        log_error("%s is not a lamina prompt cache (no magic \"%s\"): refusing to use or "
                  "overwrite it", path, PC_MAGIC);
        return -EINVAL;
    }
    uint64_t body_bytes = 0;
    if (got != sizeof(*hdr))
        why = "it ends inside its header";
    else if (hdr->version != PC_VERSION)
        why = "it has another format version";
    else if (hdr->model_hash != shm_model_hash(engine_gguf(job->eng)) ||
             hdr->n_layer != hp->n_layer || hdr->n_vocab != hp->n_vocab)
        why = "it was made for another model file";
    else if (hdr->kv_f16 != (uint32_t)engine_kv_f16(job->eng))
        why = "it was made with another --kv-type";
    else if (hdr->n_tokens == 0 || hdr->n_tokens > engine_n_ctx(job->eng))
        why = "its token count is 0 or past the context";
    else if (hdr->state_bytes != engine_state_bytes(job->eng, hdr->n_tokens))
        why = "its state size does not match its token count";
    if (!why) {
        body_bytes = (uint64_t)hdr->n_tokens * 4 + (uint64_t)hdr->n_vocab * 4 + hdr->state_bytes;
        *body = malloc(body_bytes + 1);
        if (!*body) {
            fclose(f);
            log_error("prompt cache %s: no memory for %llu bytes", path,
                      (unsigned long long)body_bytes);
            return -ENOMEM;
        }
        if (fread(*body, 1, body_bytes + 1, f) != body_bytes)
            why = "its size does not match its header";
    }
    fclose(f);
    if (!why) {
        const size_t ids_bytes = (size_t)hdr->n_tokens * 4, lg = (size_t)hdr->n_vocab * 4;
        if (hdr->body_sum != pc_body_sum(*body, ids_bytes, *body + ids_bytes, lg,
                                         *body + ids_bytes + lg, hdr->state_bytes))
            why = "its contents do not match its checksum (the file is damaged)";
    }
    for (uint32_t i = 0; !why && i < hdr->n_tokens; i++) {
        int32_t id;
        memcpy(&id, *body + (size_t)i * 4, 4);
        if (id < 0 || (uint32_t)id >= hp->n_vocab)
            why = "it holds a token id outside the vocabulary";
    }
    if (why) {
        free(*body);
        *body = NULL;
        log_warn("prompt cache %s not used: %s; the prompt is run in full%s", path, why,
                 job->cfg->prompt_cache_ro ? "" : " and the file replaced");
        return 0;
    }
    return 1;
}

/* Loads the prompt cache when the prompt starts with its tokens: job->cached tokens are then
 * in the sequence, and when that is the whole prompt, their logits are in job->logits. */
static int pc_load(struct generate_job *job)
{
    const struct generate_config *cfg = job->cfg;
    struct pc_header hdr;
    uint8_t *body;
    int rc = pc_read(job, &hdr, &body);
    job->cache_write = !cfg->prompt_cache_ro && rc >= 0;
    if (rc <= 0)
        return rc;
    size_t same = 0;
    while (same < hdr.n_tokens && same < job->n_ids &&
           !memcmp(body + same * 4, &job->ids[same], 4))
        same++;
    if (same < hdr.n_tokens) {
        log_info("prompt cache %s: holds another prompt, not a start of this one (%zu of its "
                 "%u tokens match; a recurrent state cannot be cut back): the prompt is run in "
                 "full", cfg->prompt_cache, same, hdr.n_tokens);
        free(body);
        return 0;
    }
    const size_t nv = job->m->hp.n_vocab;
    rc = engine_state_load(job->eng, body + (size_t)hdr.n_tokens * 4 + nv * 4,
                           hdr.state_bytes, hdr.n_tokens);
    if (!rc) {
        memcpy(job->logits, body + (size_t)hdr.n_tokens * 4, nv * sizeof(float));
        job->cached = hdr.n_tokens;
        job->cache_write = job->cache_write && job->cached < job->n_ids;
        log_info("prompt cache %s: %u of the prompt's %zu tokens loaded", cfg->prompt_cache,
                 hdr.n_tokens, job->n_ids);
    }
    free(body);
    return rc;
}

/* Writes the prompt cache: the prompt, its last logits (job->logits) and the state after it;
 * through a temporary file renamed over the old one. */
static int pc_write(struct generate_job *job)
{
    const char *path = job->cfg->prompt_cache;
    const size_t nv = job->m->hp.n_vocab;
    void *state;
    size_t bytes;
    int rc = engine_state_save(job->eng, &state, &bytes);
    if (rc)
        return rc;
    struct pc_header hdr = {.version = PC_VERSION, .kv_f16 = engine_kv_f16(job->eng),
                            .model_hash = shm_model_hash(engine_gguf(job->eng)),
                            .n_layer = job->m->hp.n_layer, .n_tokens = (uint32_t)job->n_ids,
                            .n_vocab = (uint32_t)nv, .state_bytes = bytes};
    memcpy(hdr.magic, PC_MAGIC, sizeof(hdr.magic));
    hdr.body_sum = pc_body_sum(job->ids, job->n_ids * 4, job->logits, nv * sizeof(float), state,
                               bytes);
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof(tmp)) {
        log_error("cannot write the prompt cache %s: its name is too long", path);
        free(state);
        return -ENAMETOOLONG;
    }
    FILE *f = fopen(tmp, "wb");
    bool ok = f && fwrite(&hdr, sizeof(hdr), 1, f) == 1 &&
              fwrite(job->ids, 4, job->n_ids, f) == job->n_ids &&
              fwrite(job->logits, sizeof(float), nv, f) == nv &&
              fwrite(state, 1, bytes, f) == bytes;
    ok = (f && fclose(f) == 0) && ok;
    free(state);
    if (!ok || rename(tmp, path) != 0) {
        log_error("cannot write the prompt cache %s: %s", path, strerror(errno ? errno : EIO));
        unlink(tmp);
        return -EIO;
    }
    log_info("prompt cache %s: %zu tokens written (%.1f MiB of state)", path, job->n_ids,
             bytes / 1048576.0);
    return 0;
}

static int generate_prefill(struct generate_job *job, struct generate_stats *st)
{
    const struct generate_config *cfg = job->cfg;
    const struct arch_hparams *hp = &job->m->hp;
    const size_t n = job->n_ids;
    job->logits = engine_alloc_logits(job->eng, cfg->dump_logits ? n : 1);
    if (!job->logits)
        return -ENOMEM;
    if (cfg->echo_prompt)
        for (size_t i = 0; i < n; i++)
            generate_emit(job, job->ids[i]);
    for (size_t i = 0; i < n; i++) /* the window of the first pick holds the prompt */
        sampler_accept(job->smp, job->ids[i]);
    double t0 = generate_now();
    int rc = cfg->prompt_cache ? pc_load(job) : 0;
    if (rc)
        return rc;
    if (job->cached == n) { /* the whole prompt came from the cache, its logits too */
        job->first = cfg->n_predict <= 0 ? 0 : sampler_sample(job->smp, job->logits,
                                                                  (int32_t)hp->n_vocab);
    } else if (cfg->prompt_cache) { /* the logits stay here for the cache file */
        rc = engine_eval(job->eng, job->ids + job->cached, (uint32_t)(n - job->cached), false,
                         job->logits);
        job->first = rc || cfg->n_predict <= 0 ? 0 : sampler_sample(job->smp, job->logits,
                                                                     (int32_t)hp->n_vocab);
        rc = rc || !job->cache_write ? rc : pc_write(job);
    } else if (cfg->dump_logits || cfg->n_predict <= 0) {
        rc = engine_eval(job->eng, job->ids, (uint32_t)n, cfg->dump_logits != NULL,
                         job->logits);
        if (rc)
            return rc;
        if (cfg->dump_logits)
            rc = generate_write_npy(cfg->dump_logits, job->logits, (uint32_t)n, hp->n_vocab);
        const float *last = job->logits + (cfg->dump_logits ? n - 1 : 0) * hp->n_vocab;
        job->first = rc || cfg->n_predict <= 0 ? 0 : sampler_sample(job->smp, last,
                                                                     (int32_t)hp->n_vocab);
    } else { /* the first pick needs no logits here: the last worker may sample it */
        rc = engine_eval_sample(job->eng, job->ids, (uint32_t)n, job->smp, job->logits,
                                &job->first);
    }
    st->n_prompt = (uint32_t)n;
    st->n_cached = job->cached;
    st->prompt_s = generate_now() - t0;
    if (!rc && job->first < 0)
        rc = job->first;
    return rc;
}

static int generate_decode(struct generate_job *job, struct generate_stats *st)
{
    const struct generate_config *cfg = job->cfg;
    double t0 = generate_now();
    int32_t id = job->first;
    for (int32_t i = 0; i < cfg->n_predict; i++) {
        sampler_accept(job->smp, id);
        st->n_gen++;
        if (!cfg->ignore_eos && tokenizer_is_eog(job->tok, id))
            break;
        generate_emit(job, id);
        if (i + 1 == cfg->n_predict || engine_pos(job->eng) >= engine_n_ctx(job->eng))
            break;
        int rc = engine_eval_sample(job->eng, &id, 1, job->smp, job->logits, &id);
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
    rc = rc ? rc : engine_save_heat(job.eng);
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        st->peak_rss_kb = ru.ru_maxrss;
    if (job.eng)
        engine_free_logits(job.eng, job.logits);
    free(job.ids);
    detok_destroy(job.dt);
    sampler_destroy(job.smp);
    if (job.eng && !rc && log_is_enabled(LOG_LEVEL_INFO))
        engine_print_summary(job.eng, stderr);
    tokenizer_destroy(job.tok);
    engine_destroy(job.eng);
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
