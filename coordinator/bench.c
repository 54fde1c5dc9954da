/*
 * bench: pp/tg throughput with median and spread, one sequence or several in
 * flight (see bench.h).
 */
#include "coordinator/bench.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/stats.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "coordinator/engine.h"
#include "coordinator/planner.h"
#include "kernels/cpu/threadpool.h"
#include "model/quant.h"
#include "model/sampler.h"
#include "worker/forward.h"
#include "worker/probe.h"


struct bench_job {
    const struct bench_config *cfg;
    struct engine *eng;
    const struct arch_model *m;
    float *logits;
    int32_t *ids;
    uint64_t rng;
};

static double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint32_t bench_rand(struct bench_job *j, uint32_t n)
{
    j->rng = j->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((j->rng >> 33) % n);
}

/* Bytes of weights one decoded token reads: every trunk tensor, top-k
 * experts per layer, the lm head and one embedding row. */
static double bench_bytes_per_token(const struct arch_model *m)
{
    double b = m->output.mat_bytes + m->tok_embd.row_bytes;
    for (uint32_t l = 0; l < m->hp.n_layer; l++)
        b += planner_layer_read_bytes(m, l);
    return b;
}

/* A fresh context holding n_depth random tokens (their prefill not timed). */
static int bench_fill(struct bench_job *j)
{
    const uint32_t d = j->cfg->n_depth, nv = j->m->hp.n_vocab;
    int rc = engine_reset(j->eng);
    if (rc || d == 0)
        return rc;
    for (uint32_t i = 0; i < d; i++)
        j->ids[i] = (int32_t)bench_rand(j, nv);
    return engine_eval(j->eng, j->ids, d, false, j->logits);
}

static int bench_pp(struct bench_job *j, double *tps)
{
    int rc = bench_fill(j);
    const uint32_t n = j->cfg->n_prompt, nv = j->m->hp.n_vocab;
    for (uint32_t i = 0; i < n; i++)
        j->ids[i] = (int32_t)bench_rand(j, nv);
    double t0 = bench_now();
    rc = rc ? rc : engine_eval(j->eng, j->ids, n, false, j->logits);
    *tps = n / (bench_now() - t0);
    return rc;
}

static int bench_tg(struct bench_job *j, double *tps)
{
    const uint32_t nv = j->m->hp.n_vocab;
    int rc = bench_fill(j);
    double t0 = bench_now();
    for (uint32_t i = 0; i < j->cfg->n_gen && !rc; i++) {
        int32_t id = (int32_t)bench_rand(j, nv);
        rc = engine_eval(j->eng, &id, 1, false, j->logits);
    }
    *tps = j->cfg->n_gen / (bench_now() - t0);
    return rc;
}

/* Median and half the min-max range of n samples (sorted in place). */
static void bench_stats(double *v, uint32_t n, double *median, double *spread)
{
    *median = stats_median(v, n);
    *spread = 0.5 * (v[n - 1] - v[0]);
}

static int bench_setup(struct bench_job *j)
{
    const struct bench_config *cfg = j->cfg;
    uint32_t ctx = cfg->n_prompt > cfg->n_gen ? cfg->n_prompt : cfg->n_gen;
    const uint32_t longest = ctx > cfg->n_depth ? ctx : cfg->n_depth; /* ids held at once */
    ctx += cfg->n_depth;
    struct engine_config ec = {.model_path = cfg->model_path, .n_threads = cfg->n_threads,
                               .n_ctx = ctx + 1, .n_batch = cfg->n_batch, .kv_f16 = cfg->kv_f16,
                               .progress = true, .cluster = cfg->cluster,
                               .backend = cfg->backend,
                               .on_cluster = cfg->on_cluster};
    j->eng = engine_create(&ec);
    if (!j->eng)
        return -EINVAL;
    j->m = engine_model(j->eng);
    if (j->m->hp.n_ctx_train && ctx > j->m->hp.n_ctx_train)
        log_warn("bench: %u positions (-d %u and the longest test) go past the model's trained "
                 "context of %u: the figures are for positions it was not trained on", ctx,
                 cfg->n_depth, j->m->hp.n_ctx_train);
    j->logits = engine_alloc_logits(j->eng, 1);
    j->ids = malloc(((size_t)longest + 1) * sizeof(int32_t));
    j->rng = cfg->seed;
    return j->logits && j->ids ? 0 : -ENOMEM;
}

/* The table's model column: "qwen3next 48 layers", with the file's mixture
 * where general.file_type names one ("Q4_K - Medium", as llama-bench shows it). */
static void bench_model_name(const struct gguf *g, const struct arch_model *m, char *buf,
                             size_t n)
{
    const struct gguf_kv *kv = g ? gguf_find_kv(g, "general.file_type") : NULL;
    const char *ft = kv && kv->type == GGUF_TYPE_UINT32 ? quant_ftype_name((uint32_t)kv->v.u64)
                                                        : NULL;
    snprintf(buf, n, "%s %u layers%s%s", m->hp.arch_name, m->hp.n_layer, ft ? " " : "",
             ft ? ft : "");
}

/* bw: GB/s of the memory the weights are read from (0: not measured); what: its name. */
static void bench_print(struct bench_job *j, double pp_med, double pp_spr, double tg_med,
                        double tg_spr, double bw, const char *what)
{
    const struct bench_config *cfg = j->cfg;
    const double bpt = bench_bytes_per_token(j->m);
    const double roof = bw > 0 ? bw * 1e9 / bpt : 0;
    const int nt = engine_n_threads(j->eng);
    const char *backend = cfg->cluster ? cfg->cluster->backends[0]
                          : cfg->backend ? cfg->backend : "cpu (in-process)";
    if (cfg->json) {
        printf("{\"model\":\"%s\",\"arch\":\"%s\",\"backend\":\"%s\",\"threads\":%d,"
               "\"pp\":%u,\"pp_tps\":%.3f,\"pp_spread\":%.3f,\"tg\":%u,\"tg_tps\":%.3f,"
               "\"tg_spread\":%.3f,\"depth\":%u,\"reps\":%u,\"bytes_per_token\":%.0f,"
               "\"membw_gbs\":%.2f,\"tg_roofline_tps\":%.3f,\"tg_fraction_of_roofline\":%.4f}\n",
               cfg->model_path, j->m->hp.arch_name, backend, nt, cfg->n_prompt, pp_med, pp_spr,
               cfg->n_gen, tg_med, tg_spr, cfg->n_depth, cfg->reps, bpt, bw, roof,
               roof > 0 ? tg_med / roof : 0.0);
        return;
    }
    printf("| model | size | backend | threads | test | t/s |\n");
    printf("| --- | ---: | --- | ---: | ---: | ---: |\n");
    const double gib = gguf_file_size(engine_gguf(j->eng)) / 1073741824.0;
    char at[32] = ""; /* llama-bench's " @ dN" */
    if (cfg->n_depth)
        snprintf(at, sizeof(at), " @ d%u", cfg->n_depth);
    char name[128];
    bench_model_name(engine_gguf(j->eng), j->m, name, sizeof(name));
    if (cfg->n_prompt)
        printf("| %s | %.2f GiB | %s | %d | pp%u%s | %.2f +- %.2f |\n", name, gib, backend, nt,
               cfg->n_prompt, at, pp_med, pp_spr);
    if (cfg->n_gen)
        printf("| %s | %.2f GiB | %s | %d | tg%u%s | %.2f +- %.2f |\n", name, gib, backend, nt,
               cfg->n_gen, at, tg_med, tg_spr);
    if (bw > 0)
        printf("\nweights read per generated token: %.1f MB; %s %.1f GB/s; roofline %.1f tok/s; "
               "tg at %.0f%% of it\n", bpt / 1e6, what, bw, roof, 100 * tg_med / roof);
    else
        printf("\nweights read per generated token: %.1f MB (%s not measured: no roofline)\n",
               bpt / 1e6, what);
    engine_print_summary(j->eng, stdout);
}

/* ---- --parallel: several sequences through the workers' pipeline ---- */

/* One sequence of a parallel run. */
struct bench_seq {
    uint64_t rng;          /* its prompt ids: seed + its index */
    uint32_t pos;          /* positions consumed */
    uint32_t fed;          /* prompt ids sent so far */
    uint32_t gen;          /* decode steps done */
    int32_t *tokens;       /* t0 (from the prefill) .. t_n_gen */
    float *logits;         /* n_vocab, when the coordinator samples */
    uint64_t fnv;          /* FNV-1a of every logits byte that came back */
    double t_done;         /* when its phase ended */
};

struct bench_par {
    const struct bench_config *cfg;
    struct gguf *g;
    struct arch_model *m;
    struct threadpool *pool;
    struct forward *fw;    /* embeddings only (one layer's scratch) */
    struct cluster *cl;
    struct cluster_config cc;
    struct sampler *smp;   /* greedy, for logits that come here */
    struct cluster_sample cs;
    bool logits_here;      /* --sample-on coordinator */
    float *h;              /* max_batch rows */
    int32_t *ids;          /* max_batch ids */
    struct bench_seq *seq; /* parallel entries */
};

static void bench_par_destroy(struct bench_par *b)
{
    if (b->cl && b->cfg->on_cluster)
        b->cfg->on_cluster(NULL);
    cluster_destroy(b->cl);
    for (uint32_t s = 0; b->seq && s < b->cfg->parallel; s++) {
        free(b->seq[s].tokens);
        free(b->seq[s].logits);
    }
    free(b->seq);
    free(b->h);
    free(b->ids);
    sampler_destroy(b->smp);
    forward_destroy(b->fw);
    threadpool_destroy(b->pool);
    arch_free(b->m);
    gguf_close(b->g);
}

static int bench_par_setup(struct bench_par *b)
{
    const struct bench_config *cfg = b->cfg;
    const uint32_t B = cfg->n_batch ? cfg->n_batch : 256, N = cfg->parallel;
    struct gguf_config gc = {.path = cfg->model_path};
    b->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = b->g};
    b->m = b->g ? arch_load(&ac) : NULL;
    if (!b->m)
        return -EINVAL;
    gguf_prefault(b->g, true);
    struct threadpool_config pc = {.n_threads = 1};
    b->pool = threadpool_create(&pc);
    const uint32_t ctx = cfg->n_prompt + cfg->n_gen + 1;
    struct forward_config fc = {.model = b->m, .pool = b->pool, .layer_end = 1, .n_ctx = ctx,
                                .kv_f16 = cfg->kv_f16, .max_batch = B};
    b->fw = b->pool ? forward_create(&fc) : NULL;
    struct sampler_config greedy = {0};
    b->smp = sampler_create(&greedy);
    b->h = malloc((size_t)B * b->m->hp.n_embd * sizeof(float));
    b->ids = malloc((size_t)B * sizeof(int32_t));
    b->seq = calloc(N, sizeof(*b->seq));
    if (!b->fw || !b->smp || !b->h || !b->ids || !b->seq)
        return -ENOMEM;
    b->cc = *cfg->cluster;
    b->logits_here = b->cc.coordinator_samples;
    for (uint32_t s = 0; s < N; s++) {
        b->seq[s].tokens = malloc(((size_t)cfg->n_gen + 1) * sizeof(int32_t));
        b->seq[s].logits = b->logits_here ? malloc(b->m->hp.n_vocab * sizeof(float)) : NULL;
        if (!b->seq[s].tokens || (b->logits_here && !b->seq[s].logits))
            return -ENOMEM;
    }
    b->cs = (struct cluster_sample){.cfg = greedy};
    b->cc.model_path = cfg->model_path;
    b->cc.gguf = b->g;
    b->cc.model = b->m;
    b->cc.n_ctx = ctx;
    b->cc.kv_f16 = cfg->kv_f16;
    b->cc.max_batch = B;
    b->cc.n_seq = N;
    b->cl = cluster_create(&b->cc);
    if (!b->cl)
        return -EIO;
    if (cfg->on_cluster)
        cfg->on_cluster(b->cl);
    return 0;
}

static uint32_t bench_seq_rand(struct bench_seq *q, uint32_t n)
{
    q->rng = q->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((q->rng >> 33) % n);
}

/* Sends sequence s's next step: the next chunk of its prompt, or its last token. */
static int bench_par_submit(struct bench_par *b, uint32_t s)
{
    struct bench_seq *q = &b->seq[s];
    const uint32_t nv = b->m->hp.n_vocab, B = b->cc.max_batch;
    uint32_t n = 1;
    if (q->fed < b->cfg->n_prompt) {
        n = b->cfg->n_prompt - q->fed < B ? b->cfg->n_prompt - q->fed : B;
        for (uint32_t i = 0; i < n; i++)
            b->ids[i] = (int32_t)bench_seq_rand(q, nv);
        q->fed += n;
    } else {
        b->ids[0] = q->tokens[q->gen];
    }
    int rc = forward_embed(b->fw, b->ids, n, b->h);
    rc = rc ? rc : cluster_submit(b->cl, s, b->h, n, q->pos, false,
                                  b->logits_here ? NULL : &b->cs, q->logits);
    q->pos += n;
    return rc;
}

/* The token a step of sequence s gave (sampled by the worker, or here from its logits). */
static int bench_par_token(struct bench_par *b, uint32_t s, int32_t worker_token, int32_t *t)
{
    struct bench_seq *q = &b->seq[s];
    if (!b->logits_here) {
        *t = worker_token;
        return 0;
    }
    const uint32_t nv = b->m->hp.n_vocab;
    const uint8_t *p = (const uint8_t *)q->logits;
    for (size_t i = 0; i < (size_t)nv * sizeof(float); i++)
        q->fnv = (q->fnv ^ p[i]) * 1099511628211ull;
    *t = sampler_sample_given(b->smp, q->logits, (int32_t)nv, 0.0, NULL, 0);
    return *t < 0 ? *t : 0;
}

/* Runs every sequence's prefill (generate false) or its n_gen decode steps, all in flight;
 * t_done of each when it ended. */
static int bench_par_phase(struct bench_par *b, bool generate)
{
    const uint32_t N = b->cfg->parallel, np = b->cfg->n_prompt, ng = b->cfg->n_gen;
    int rc = 0;
    for (uint32_t s = 0; s < N && !rc; s++) {
        if (!generate && np == 0) { /* no prompt: a random first token */
            b->seq[s].tokens[0] = (int32_t)bench_seq_rand(&b->seq[s], b->m->hp.n_vocab);
            b->seq[s].t_done = bench_now();
        } else if (!generate || ng) {
            rc = bench_par_submit(b, s);
        }
    }
    while (!rc && cluster_in_flight(b->cl)) {
        uint32_t s;
        int32_t wt = -1, t;
        rc = cluster_wait(b->cl, &s, &wt);
        rc = rc ? rc : bench_par_token(b, s, wt, &t);
        if (rc)
            break;
        struct bench_seq *q = &b->seq[s];
        const bool more = generate ? ++q->gen < ng : q->fed < np;
        if (generate || !more)
            q->tokens[q->gen] = t; /* the last prefill chunk gives t0 */
        if (more)
            rc = bench_par_submit(b, s);
        else
            q->t_done = bench_now();
    }
    return rc;
}

static int bench_par_dump(struct bench_par *b)
{
    FILE *f = fopen(b->cfg->dump_tokens, "w");
    if (!f) {
        log_error("cannot write %s: %s", b->cfg->dump_tokens, strerror(errno));
        return -EIO;
    }
    for (uint32_t s = 0; s < b->cfg->parallel; s++) {
        fprintf(f, "seq %u:", s);
        for (uint32_t i = 0; i <= b->cfg->n_gen; i++)
            fprintf(f, " %d", b->seq[s].tokens[i]);
        if (b->logits_here)
            fprintf(f, " logits %016llx", (unsigned long long)b->seq[s].fnv);
        fprintf(f, "\n");
    }
    return fclose(f) ? -EIO : 0;
}

/* One repetition: tok/s of prefill and generation, in total and per sequence (mean). */
static int bench_par_rep(struct bench_par *b, double *pp, double *pp_seq, double *tg,
                         double *tg_seq)
{
    const struct bench_config *cfg = b->cfg;
    const uint32_t N = cfg->parallel;
    for (uint32_t s = 0; s < N; s++)
        b->seq[s] = (struct bench_seq){.rng = cfg->seed + s, .tokens = b->seq[s].tokens,
                                       .logits = b->seq[s].logits,
                                       .fnv = 14695981039346656037ull};
    double t0 = bench_now();
    int rc = bench_par_phase(b, false);
    double t1 = bench_now(), ps = 0;
    for (uint32_t s = 0; s < N; s++)
        ps += cfg->n_prompt / (b->seq[s].t_done - t0 + 1e-9);
    *pp = N * cfg->n_prompt / (t1 - t0);
    *pp_seq = ps / N;
    rc = rc ? rc : bench_par_phase(b, true);
    double t2 = bench_now(), gs = 0;
    for (uint32_t s = 0; s < N; s++)
        gs += cfg->n_gen / (b->seq[s].t_done - t1 + 1e-9);
    *tg = N * cfg->n_gen / (t2 - t1);
    *tg_seq = gs / N;
    return rc;
}

static void bench_par_print(struct bench_par *b, double st[4][2])
{
    const struct bench_config *cfg = b->cfg;
    const struct arch_model *m = b->m;
    const char *backend = cfg->cluster->backends[0];
    const uint32_t N = cfg->parallel;
    if (cfg->json) {
        printf("{\"model\":\"%s\",\"arch\":\"%s\",\"backend\":\"%s\",\"workers\":%d,"
               "\"parallel\":%u,\"pp\":%u,\"pp_tps\":%.3f,\"pp_spread\":%.3f,"
               "\"pp_seq_tps\":%.3f,\"pp_seq_spread\":%.3f,\"tg\":%u,\"tg_tps\":%.3f,"
               "\"tg_spread\":%.3f,\"tg_seq_tps\":%.3f,\"tg_seq_spread\":%.3f,\"reps\":%u}\n",
               cfg->model_path, m->hp.arch_name, backend, cfg->cluster->n_workers, N,
               cfg->n_prompt, st[0][0], st[0][1], st[1][0], st[1][1], cfg->n_gen, st[2][0],
               st[2][1], st[3][0], st[3][1], cfg->reps);
        return;
    }
    printf("| model | size | backend | workers | test | t/s |\n");
    printf("| --- | ---: | --- | ---: | ---: | ---: |\n");
    const double gib = gguf_file_size(b->g) / 1073741824.0;
    const char *what[4] = {"pp", "pp", "tg", "tg"};
    char name[128];
    bench_model_name(b->g, m, name, sizeof(name));
    for (int k = 0; k < 4; k++) {
        const uint32_t len = k < 2 ? cfg->n_prompt : cfg->n_gen;
        if (len)
            printf("| %s | %.2f GiB | %s | %d | %s%u x%u%s | %.2f +- %.2f |\n", name, gib, backend,
                   cfg->cluster->n_workers, what[k], len, N, k % 2 ? " per seq" : "", st[k][0],
                   st[k][1]);
    }
    printf("\n");
    cluster_print_summary(b->cl, stdout);
}

static int bench_run_parallel(const struct bench_config *cfg)
{
    struct bench_par b = {.cfg = cfg};
    int rc = cfg->cluster && cfg->parallel && cfg->parallel <= CLUSTER_SEQ_MAX ? 0 : -EINVAL;
    if (rc)
        log_error("--parallel %u needs workers and 1..%d sequences", cfg->parallel,
                  CLUSTER_SEQ_MAX);
    rc = rc ? rc : bench_par_setup(&b);
    double *v[4];
    for (int k = 0; k < 4; k++)
        v[k] = calloc(cfg->reps + 1, sizeof(double));
    for (int k = 0; k < 4 && !rc; k++)
        rc = v[k] ? 0 : -ENOMEM;
    double x[4];
    if (!rc) /* warm-up: page in the weights, settle the caches */
        rc = bench_par_rep(&b, &x[0], &x[1], &x[2], &x[3]);
    for (uint32_t r = 0; r < cfg->reps && !rc; r++)
        rc = bench_par_rep(&b, &v[0][r], &v[1][r], &v[2][r], &v[3][r]);
    if (!rc && cfg->dump_tokens)
        rc = bench_par_dump(&b);
    if (!rc) {
        double st[4][2];
        for (int k = 0; k < 4; k++)
            bench_stats(v[k], cfg->reps, &st[k][0], &st[k][1]);
        bench_par_print(&b, st);
    }
    for (int k = 0; k < 4; k++)
        free(v[k]);
    bench_par_destroy(&b);
    return rc;
}

/* True when the layers run on a GPU: an in-process CUDA backend, or workers that are all
 * CUDA devices. */
static bool bench_on_gpu(const struct bench_config *cfg)
{
    if (cfg->cluster) {
        for (int i = 0; i < cfg->cluster->n_workers; i++)
            if (!cfg->cluster->backends[i] || strncmp(cfg->cluster->backends[i], "cuda:", 5))
                return false;
        return cfg->cluster->n_workers > 0;
    }
    return cfg->backend && !strncmp(cfg->backend, "cuda:", 5);
}

int bench_run(const struct bench_config *cfg)
{
    if (cfg->parallel)
        return bench_run_parallel(cfg);
    /* The roofline's bandwidth: for an in-process CUDA backend the card's own (a GEMV
     * probe, before the model is loaded: the probe leaves the card as it found it);
     * for CUDA workers it is not measured here (their cards may hold other experts'
     * misses too); else the host's read bandwidth, after the runs. */
    const bool gpu = bench_on_gpu(cfg);
    const char *bw_what = gpu ? "device memory bandwidth (GEMV probe)" : "host read bandwidth";
    double dev_bw = 0;
    if (cfg->membw && gpu && !cfg->cluster) {
        struct probe_result r;
        if (probe_device(cfg->backend, 0, QUANT_TYPE_Q4_0, &r) == 0)
            dev_bw = r.gemv_bw / 1e9;
    }
    struct bench_job j = {.cfg = cfg};
    int rc = cfg->reps ? bench_setup(&j) : -EINVAL;
    double *pp = calloc(cfg->reps + 1, sizeof(double)), *tg = calloc(cfg->reps + 1, sizeof(double));
    double pp_med = 0, pp_spr = 0, tg_med = 0, tg_spr = 0, bw = 0;
    if (!pp || !tg)
        rc = rc ? rc : -ENOMEM;
    double warm[2] = {0, 0};
    /* warm-up, one of each test as llama-bench does: page in the weights, settle the
     * caches, and grow what the first prompt of a backend loads and allocates (on an H100
     * the first pp512 of a 30b-a3b file ran at 8025 tok/s against the reps' 13928: without
     * its own warm-up it was the first rep and widened the spread to +- 1167) */
    if (!rc && cfg->n_prompt)
        rc = bench_pp(&j, &warm[0]);
    if (!rc && cfg->n_gen)
        rc = bench_tg(&j, &warm[1]);
    if (!rc)
        log_info("bench warm-up: pp %.2f tok/s, tg %.2f tok/s", warm[0], warm[1]);
    for (uint32_t r = 0; r < cfg->reps && !rc; r++) {
        if (cfg->n_prompt)
            rc = bench_pp(&j, &pp[r]);
        if (!rc && cfg->n_gen)
            rc = bench_tg(&j, &tg[r]);
        if (!rc)
            log_info("bench rep %u of %u: pp %.2f tok/s, tg %.2f tok/s", r + 1, cfg->reps,
                     cfg->n_prompt ? pp[r] : 0.0, cfg->n_gen ? tg[r] : 0.0);
    }
    if (!rc) {
        bench_stats(pp, cfg->reps, &pp_med, &pp_spr);
        bench_stats(tg, cfg->reps, &tg_med, &tg_spr);
        bw = !cfg->membw ? 0 : gpu ? dev_bw : planner_probe_host_bandwidth(cfg->n_threads) / 1e9;
        bench_print(&j, pp_med, pp_spr, tg_med, tg_spr, bw, bw_what);
    }
    free(pp);
    free(tg);
    if (j.eng)
        engine_free_logits(j.eng, j.logits);
    free(j.ids);
    engine_destroy(j.eng);
    return rc;
}
