/*
 * bench: pp/tg throughput with median and spread (see bench.h).
 */
#include "coordinator/bench.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "coordinator/engine.h"
#include "coordinator/planner.h"
#include "model/quant.h"


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

static int bench_pp(struct bench_job *j, double *tps)
{
    const uint32_t n = j->cfg->n_prompt, nv = j->m->hp.n_vocab;
    for (uint32_t i = 0; i < n; i++)
        j->ids[i] = (int32_t)bench_rand(j, nv);
    int rc = engine_reset(j->eng);
    double t0 = bench_now();
    rc = rc ? rc : engine_eval(j->eng, j->ids, n, false, j->logits);
    *tps = n / (bench_now() - t0);
    return rc;
}

static int bench_tg(struct bench_job *j, double *tps)
{
    const uint32_t nv = j->m->hp.n_vocab;
    int rc = engine_reset(j->eng);
    double t0 = bench_now();
    for (uint32_t i = 0; i < j->cfg->n_gen && !rc; i++) {
        int32_t id = (int32_t)bench_rand(j, nv);
        rc = engine_eval(j->eng, &id, 1, false, j->logits);
    }
    *tps = j->cfg->n_gen / (bench_now() - t0);
    return rc;
}

static int bench_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median and half the min-max range of n samples (sorted in place). */
static void bench_stats(double *v, uint32_t n, double *median, double *spread)
{
    qsort(v, n, sizeof(double), bench_cmp);
    *median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    *spread = 0.5 * (v[n - 1] - v[0]);
}

static int bench_setup(struct bench_job *j)
{
    const struct bench_config *cfg = j->cfg;
    uint32_t ctx = cfg->n_prompt > cfg->n_gen ? cfg->n_prompt : cfg->n_gen;
    struct engine_config ec = {.model_path = cfg->model_path, .n_threads = cfg->n_threads,
                               .n_ctx = ctx + 1, .n_batch = cfg->n_batch, .kv_f16 = cfg->kv_f16,
                               .progress = true, .cluster = cfg->cluster,
                               .backend = cfg->backend,
                               .on_cluster = cfg->on_cluster};
    j->eng = engine_create(&ec);
    if (!j->eng)
        return -EINVAL;
    j->m = engine_model(j->eng);
    j->logits = malloc(j->m->hp.n_vocab * sizeof(float));
    j->ids = malloc(((size_t)ctx + 1) * sizeof(int32_t));
    j->rng = cfg->seed;
    return j->logits && j->ids ? 0 : -ENOMEM;
}

static void bench_print(struct bench_job *j, double pp_med, double pp_spr, double tg_med,
                        double tg_spr, double bw)
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
               "\"tg_spread\":%.3f,\"reps\":%u,\"bytes_per_token\":%.0f,\"membw_gbs\":%.2f,"
               "\"tg_roofline_tps\":%.3f,\"tg_fraction_of_roofline\":%.4f}\n",
               cfg->model_path, j->m->hp.arch_name, backend, nt, cfg->n_prompt, pp_med, pp_spr,
               cfg->n_gen, tg_med, tg_spr, cfg->reps, bpt, bw, roof,
               roof > 0 ? tg_med / roof : 0.0);
        return;
    }
    printf("| model | size | backend | threads | test | t/s |\n");
    printf("| --- | ---: | --- | ---: | ---: | ---: |\n");
    const double gib = gguf_file_size(engine_gguf(j->eng)) / 1073741824.0;
    if (cfg->n_prompt)
        printf("| %s %u layers | %.2f GiB | %s | %d | pp%u | %.2f +- %.2f |\n",
               j->m->hp.arch_name, j->m->hp.n_layer, gib, backend, nt, cfg->n_prompt, pp_med,
               pp_spr);
    if (cfg->n_gen)
        printf("| %s %u layers | %.2f GiB | %s | %d | tg%u | %.2f +- %.2f |\n",
               j->m->hp.arch_name, j->m->hp.n_layer, gib, backend, nt, cfg->n_gen, tg_med,
               tg_spr);
    printf("\nweights read per generated token: %.1f MB; host read bandwidth %.1f GB/s; "
           "roofline %.1f tok/s; tg at %.0f%% of it\n",
           bpt / 1e6, bw, roof, roof > 0 ? 100 * tg_med / roof : 0.0);
    engine_print_summary(j->eng, stdout);
}

int bench_run(const struct bench_config *cfg)
{
    struct bench_job j = {.cfg = cfg};
    int rc = cfg->reps ? bench_setup(&j) : -EINVAL;
    double *pp = calloc(cfg->reps + 1, sizeof(double)), *tg = calloc(cfg->reps + 1, sizeof(double));
    double pp_med = 0, pp_spr = 0, tg_med = 0, tg_spr = 0, bw = 0;
    if (!pp || !tg)
        rc = rc ? rc : -ENOMEM;
    double warm;
    if (!rc && cfg->n_gen) /* warm-up: page in the weights, settle the caches */
        rc = bench_tg(&j, &warm);
    for (uint32_t r = 0; r < cfg->reps && !rc; r++) {
        if (cfg->n_prompt)
            rc = bench_pp(&j, &pp[r]);
        if (!rc && cfg->n_gen)
            rc = bench_tg(&j, &tg[r]);
    }
    if (!rc) {
        bench_stats(pp, cfg->reps, &pp_med, &pp_spr);
        bench_stats(tg, cfg->reps, &tg_med, &tg_spr);
        bw = cfg->membw ? planner_probe_host_bandwidth(cfg->n_threads) / 1e9 : 0;
        bench_print(&j, pp_med, pp_spr, tg_med, tg_spr, bw);
    }
    free(pp);
    free(tg);
    free(j.logits);
    free(j.ids);
    engine_destroy(j.eng);
    return rc;
}
