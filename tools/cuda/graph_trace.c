/*
 * graph_trace: where a CUDA worker's decode step spends its time, kernel by kernel, inside its
 * CUDA graph: the timeline Nsight Systems would draw (the GPU machine has no nsys), from
 * CUPTI's activity records of every kernel node (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
 * which keeps kernels concurrent, so programmatic dependent launch still overlaps them).
 *
 *   graph_trace -m MODEL.gguf [-n STEPS] [-p PROMPT] [-o trace.csv] [--device N]
 *
 * Runs the model's layers on one card through the cuda worker backend (every expert
 * resident, as `lamina bench --inproc --backend cuda:N`): a prompt of PROMPT random ids
 * (default 32), 8 untimed decode steps (the graph is captured at the first), then STEPS
 * traced decode steps (default 16), each the layers plus the lm head's arg-max
 * (backend_layers_head, as a last worker or `lamina bench` runs them). Prints:
 *   - the wall time per step (host) and the span of its kernels (device);
 *   - the kernels of the median step in start order: short name, grid, start and end
 *     (us from the step's first start), duration, and the increment (its end minus the
 *     latest end before it: what it adds to the step's critical path);
 *   - a summary over all traced steps by (short name, grid, block; "#2" for a kernel that
 *     directly follows one of its own name and shape, as the down product follows the
 *     gate/up one): launches per step, median duration, median and total increment per
 *     step, sorted by total increment.
 * -o writes every record (step, index, name, grid, block, start, end) as CSV.
 * Timing with tracing on may differ a little from `lamina bench` (CUPTI's records); the
 * wall time per step shows by how much. Needs a CUDA device and libcupti.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <cupti.h>

#include "common/log.h"
#include "common/stats.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "worker/backend.h"

#define GT_BUF (8u << 20)   /* bytes per CUPTI activity buffer */
#define GT_MAX_REC (1u << 20)

struct gt_rec {
    uint64_t start, end;
    int32_t grid, block;
    char name[48];
};

static struct gt_rec *gt_recs;
static size_t gt_n;
static uint64_t gt_dropped;

/* The kernel's own identifier out of its (mangled) name: the last component of a nested
 * name, before its template arguments. */
static void gt_short(const char *m, char *out, size_t cap)
{
    const char *p = m;
    snprintf(out, cap, "%s", m ? m : "?");
    if (!m || strncmp(m, "_Z", 2))
        return;
    p += 2;
    const bool nested = *p == 'N';
    p += nested;
    const char *best = NULL;
    size_t best_len = 0;
    while (*p >= '0' && *p <= '9') {
        char *end;
        const unsigned long len = strtoul(p, &end, 10);
        if (strlen(end) < len)
            break;
        best = end, best_len = len;
        p = end + len;
        if (!nested)
            break;
    }
    if (best)
        snprintf(out, cap, "%.*s", (int)(best_len < cap - 1 ? best_len : cap - 1), best);
}

static void CUPTIAPI gt_buf_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
    *buf = aligned_alloc(8, GT_BUF);
    *size = *buf ? GT_BUF : 0;
    *max_records = 0;
}

static void CUPTIAPI gt_buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid)
{
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
            continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        if (gt_n == GT_MAX_REC) {
            gt_dropped++;
            continue;
        }
        struct gt_rec *o = &gt_recs[gt_n++];
        o->start = k->start, o->end = k->end;
        o->grid = k->gridX * k->gridY * k->gridZ;
        o->block = k->blockX * k->blockY * k->blockZ;
        gt_short(k->name, o->name, sizeof(o->name));
    }
    free(buf);
}

static int gt_cmp_start(const void *a, const void *b)
{
    const struct gt_rec *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

static double gt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct gt_key {
    char name[48];
    int32_t grid, block;
    size_t n;        /* launches over all steps */
    double *dur, *inc; /* per launch */
    double inc_sum;
};

static int gt_usage(void)
{
    fprintf(stderr, "usage: graph_trace -m MODEL.gguf [-n STEPS] [-p PROMPT] [-o trace.csv] "
                    "[--device N]\n");
    return 2;
}

static int gt_embed(const struct arch_model *m, int32_t id, float *h)
{
    const struct arch_matrix *te = &m->tok_embd;
    return quant_dequantize_row(te->type, te->data + (size_t)id * te->row_bytes, h,
                                m->hp.n_embd);
}

int main(int argc, char **argv)
{
    const char *model = NULL, *csv = NULL, *dev = "0";
    int steps = 16, prompt = 32;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "-m") && v)
            model = v, i++;
        else if (!strcmp(argv[i], "-n") && v)
            steps = atoi(v), i++;
        else if (!strcmp(argv[i], "-p") && v)
            prompt = atoi(v), i++;
        else if (!strcmp(argv[i], "-o") && v)
            csv = v, i++;
        else if (!strcmp(argv[i], "--device") && v)
            dev = v, i++;
        else
            return gt_usage();
    }
    if (!model || steps < 1 || steps > 4096 || prompt < 1 || prompt > 4096)
        return gt_usage();
    log_init("graph_trace", -1);
    setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1);
    setenv("LAMINA_CUDA_DEVICE", dev, 1);
    gt_recs = calloc(GT_MAX_REC, sizeof(*gt_recs));
    struct gguf_config gc = {.path = model};
    struct gguf *g = gguf_open(&gc);
    struct arch_config ac = {.gguf = g};
    struct arch_model *m = g ? arch_load(&ac) : NULL;
    if (!m || !gt_recs) {
        fprintf(stderr, "graph_trace: cannot load %s\n", model);
        return 1;
    }
    /* CUPTI before the first CUDA call, so that the graph's kernel nodes are traced */
    if (cuptiActivityRegisterCallbacks(gt_buf_requested, gt_buf_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "graph_trace: CUPTI activity tracing is not available\n");
        return 1;
    }
    struct backend_config bc = {.model = m, .layer_begin = 0, .layer_end = m->hp.n_layer,
                                .n_ctx = (uint32_t)prompt + 8 + (uint32_t)steps + 8,
                                .max_batch = (uint32_t)prompt, .lmhead = true,
                                .kv_f16 = true}; /* the engine's default cache */
    struct backend *b = backend_create("cuda", &bc);
    const size_t n = m->hp.n_embd;
    float *h = malloc((size_t)prompt * n * sizeof(float));
    double *t_step = calloc((size_t)steps + 1, sizeof(double));
    uint64_t *c_step = calloc((size_t)steps + 1, sizeof(uint64_t));
    int rc = b && h && t_step && c_step ? 0 : -ENOMEM;
    uint64_t rng = 1234;
    for (int i = 0; i < prompt && !rc; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        rc = gt_embed(m, (int32_t)((rng >> 33) % m->hp.n_vocab), h + (size_t)i * n);
    }
    rc = rc ? rc : backend_layers(b, h, (uint32_t)prompt);
    int32_t id = 0;
    rc = rc ? rc : backend_argmax(b, h + (size_t)(prompt - 1) * n, 1, &id);
    for (int s = -8; s < steps && !rc; s++) {
        if (s >= 0)
            cuptiGetTimestamp(&c_step[s]);
        const double t0 = gt_now();
        rc = gt_embed(m, id, h);
        rc = rc ? rc : backend_layers_head(b, h, 1, NULL, &id);
        if (s >= 0)
            t_step[s] = gt_now() - t0;
    }
    cuptiGetTimestamp(&c_step[steps]);
    cudaDeviceSynchronize();
    cuptiActivityFlushAll(1);
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (rc) {
        fprintf(stderr, "graph_trace: the run failed (%d)\n", rc);
        return 1;
    }
    qsort(gt_recs, gt_n, sizeof(*gt_recs), gt_cmp_start);
    FILE *out = csv ? fopen(csv, "w") : NULL;
    if (out)
        fprintf(out, "step,index,name,grid,block,start_ns,end_ns\n");
    struct gt_key *keys = calloc(4096, sizeof(*keys));
    size_t n_keys = 0, per_step = 0, median_step = 0;
    double *span = calloc((size_t)steps, sizeof(double)), *wall = malloc(steps * sizeof(double));
    size_t r = 0;
    for (int s = 0; s < steps && keys && span && wall; s++) {
        while (r < gt_n && gt_recs[r].start < c_step[s])
            r++;
        const size_t first = r;
        uint64_t latest = 0;
        int run = 0;
        for (; r < gt_n && gt_recs[r].start < c_step[s + 1]; r++) {
            const struct gt_rec *k = &gt_recs[r];
            const double inc = k->end > latest ? (latest ? k->end - latest : k->end - k->start)
                                               : 0;
            latest = k->end > latest ? k->end : latest;
            span[s] = (latest - gt_recs[first].start) * 1e-3;
            if (out)
                fprintf(out, "%d,%zu,%s,%d,%d,%llu,%llu\n", s, r - first, k->name, k->grid,
                        k->block, (unsigned long long)k->start, (unsigned long long)k->end);
            /* a kernel right after one of its own name and shape (the routed gate/up and
             * down products) is listed as its second (third, ...) in a row */
            const struct gt_rec *pk = r > first ? &gt_recs[r - 1] : NULL;
            run = pk && !strcmp(pk->name, k->name) && pk->grid == k->grid &&
                          pk->block == k->block
                      ? run + 1
                      : 1;
            char name[48];
            snprintf(name, sizeof(name), run > 1 ? "%.40s #%d" : "%.40s", k->name, run);
            size_t j = 0;
            while (j < n_keys && (strcmp(keys[j].name, name) || keys[j].grid != k->grid ||
                                  keys[j].block != k->block))
                j++;
            if (j == n_keys && n_keys < 4096) {
                snprintf(keys[j].name, sizeof(keys[j].name), "%s", name);
                keys[j].grid = k->grid, keys[j].block = k->block;
                keys[j].dur = malloc((size_t)steps * 1024 * sizeof(double));
                keys[j].inc = malloc((size_t)steps * 1024 * sizeof(double));
                n_keys++;
            }
            if (j < n_keys && keys[j].n < (size_t)steps * 1024) {
                keys[j].dur[keys[j].n] = (k->end - k->start) * 1e-3;
                keys[j].inc[keys[j].n++] = inc * 1e-3;
                keys[j].inc_sum += inc * 1e-3;
            }
        }
        per_step = r - first > per_step ? r - first : per_step;
        wall[s] = t_step[s] * 1e6;
    }
    if (out)
        fclose(out);
    double *sp = malloc(steps * sizeof(double));
    memcpy(sp, span, steps * sizeof(double));
    const double med_span = stats_median(sp, (size_t)steps);
    for (int s = 0; s < steps; s++)
        median_step = span[s] == med_span ? (size_t)s : median_step;
    printf("graph_trace: %s, %d traced decode steps, %zu kernels per step (%llu records "
           "dropped)\n", model, steps, per_step, (unsigned long long)gt_dropped);
    printf("step wall (host) median %.1f us; kernel span (device) median %.1f us\n",
           stats_median(wall, (size_t)steps), med_span);
    printf("\nkernels of step %zu in start order (us from its first start):\n", median_step);
    printf("%5s  %-32s %6s %5s %10s %10s %8s %8s\n", "#", "kernel", "grid", "block", "start",
           "end", "dur", "incr");
    r = 0;
    while (r < gt_n && gt_recs[r].start < c_step[median_step])
        r++;
    uint64_t t0 = r < gt_n ? gt_recs[r].start : 0, latest = 0;
    for (size_t i = 0; r < gt_n && gt_recs[r].start < c_step[median_step + 1]; r++, i++) {
        const struct gt_rec *k = &gt_recs[r];
        const double inc = k->end > latest ? (latest ? k->end - latest : k->end - k->start) : 0;
        latest = k->end > latest ? k->end : latest;
        printf("%5zu  %-32s %6d %5d %10.2f %10.2f %8.2f %8.2f\n", i, k->name, k->grid, k->block,
               (k->start - t0) * 1e-3, (k->end - t0) * 1e-3, (k->end - k->start) * 1e-3,
               inc * 1e-3);
    }
    /* summary by kernel, largest total increment first */
    for (size_t i = 0; i < n_keys; i++)
        for (size_t j = i + 1; j < n_keys; j++)
            if (keys[j].inc_sum > keys[i].inc_sum) {
                struct gt_key t = keys[i];
                keys[i] = keys[j], keys[j] = t;
            }
    printf("\nby kernel over %d steps (per step: launches, and the sum of their increments):\n",
           steps);
    printf("%-32s %6s %5s %8s %10s %10s %12s\n", "kernel", "grid", "block", "n/step",
           "med dur", "med incr", "incr/step");
    for (size_t i = 0; i < n_keys; i++) {
        const double inc_step = keys[i].inc_sum / steps;
        printf("%-32s %6d %5d %8.1f %10.2f %10.2f %12.1f\n", keys[i].name, keys[i].grid,
               keys[i].block, (double)keys[i].n / steps, stats_median(keys[i].dur, keys[i].n),
               stats_median(keys[i].inc, keys[i].n), inc_step);
        free(keys[i].dur);
        free(keys[i].inc);
    }
    free(keys), free(span), free(wall), free(sp), free(h), free(t_step), free(c_step);
    backend_destroy(b);
    arch_free(m);
    gguf_close(g);
    free(gt_recs);
    return 0;
}
