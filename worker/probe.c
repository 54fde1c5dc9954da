/*
 * probe: device speed measurements (see probe.h).
 */
#include "worker/probe.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef LAMINA_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/caps.h"
#include "kernels/cuda/matvec.h"
#endif

#include "common/check.h"
#include "common/log.h"
#include "common/stats.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/threadpool.h"
#include "model/quant.h"

/* The matrix bytes: f16 0x3c3c is 1.06 and f32/bf16 patterns of 0x3c are
 * about 0.0115, so every scale is finite and normal (no slow denormals). */
#define PROBE_FILL 0x3c
#define PROBE_TASK_BYTES (1u << 20) /* CPU rows per task: about this many bytes */

_Static_assert(PROBE_COPY_BYTES <= PROBE_GPU_BYTES, "the copy lands in the GEMV matrix");

/* One CPU GEMV over the matrix, split into row tasks. */
struct probe_gemv {
    uint32_t type;
    uint8_t *w;            /* n_rows x row_bytes */
    size_t row_bytes;
    uint64_t n_rows, rows_per_task;
    const float *x;        /* PROBE_ROW_ELEMS */
    float *y;              /* n_rows */
    bool fill;             /* this pass writes the pattern (first touch) instead */
};

static double probe_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void probe_gemv_task(void *ctx, int64_t task, int thread)
{
    (void)thread;
    struct probe_gemv *g = ctx;
    const uint64_t r0 = (uint64_t)task * g->rows_per_task;
    const uint64_t r1 = r0 + g->rows_per_task < g->n_rows ? r0 + g->rows_per_task : g->n_rows;
    if (g->fill)
        memset(g->w + r0 * g->row_bytes, PROBE_FILL, (r1 - r0) * g->row_bytes);
    else
        matvec_rows(g->type, g->w, g->row_bytes, g->x, PROBE_ROW_ELEMS, g->y, r0, r1);
}

/* Times the passes of g on pool; fills *bw with bytes/s (median). */
static void probe_cpu_passes(struct threadpool *pool, struct probe_gemv *g, int64_t tasks,
                             double *bw)
{
    double t[PROBE_REPEATS];
    g->fill = true; /* each thread touches the rows it reads, then one warm-up pass */
    threadpool_run(pool, probe_gemv_task, g, tasks);
    g->fill = false;
    threadpool_run(pool, probe_gemv_task, g, tasks);
    for (int r = 0; r < PROBE_REPEATS; r++) {
        const double t0 = probe_now();
        threadpool_run(pool, probe_gemv_task, g, tasks);
        t[r] = probe_now() - t0;
    }
    const double s = stats_median(t, PROBE_REPEATS);
    *bw = (double)(g->n_rows * g->row_bytes) / (s > 0 ? s : 1e-9);
}

int probe_cpu(int threads, uint32_t type, struct probe_result *out)
{
    const double t0 = probe_now();
    if (!quant_is_supported(type))
        type = QUANT_TYPE_Q4_0;
    struct probe_gemv g = {.type = type, .row_bytes = quant_row_size(type, PROBE_ROW_ELEMS)};
    g.n_rows = PROBE_CPU_BYTES / g.row_bytes;
    g.rows_per_task = PROBE_TASK_BYTES / g.row_bytes ? PROBE_TASK_BYTES / g.row_bytes : 1;
    const int64_t tasks = (int64_t)((g.n_rows + g.rows_per_task - 1) / g.rows_per_task);
    float *x = malloc(PROBE_ROW_ELEMS * sizeof(float));
    g.y = malloc(g.n_rows * sizeof(float));
    g.w = aligned_alloc(64, (g.n_rows * g.row_bytes + 63) / 64 * 64);
    struct threadpool_config tc = {.n_threads = threads, .pin = false};
    struct threadpool *pool = x && g.y && g.w ? threadpool_create(&tc) : NULL;
    int rc = 0;
    if (!pool) {
        log_error("cpu probe: cannot allocate %u MiB and a thread pool of %d threads",
                  PROBE_CPU_BYTES >> 20, threads);
        rc = -ENOMEM;
        goto out_free;
    }
    for (int i = 0; i < PROBE_ROW_ELEMS; i++)
        x[i] = (float)(i % 7) * 0.25f - 0.75f;
    g.x = x;
    *out = (struct probe_result){.type = type, .threads = threadpool_n_threads(pool)};
    probe_cpu_passes(pool, &g, tasks, &out->gemv_bw);
    out->ms = 1e3 * (probe_now() - t0);
    threadpool_destroy(pool);
out_free:
    free(g.w);
    free(g.y);
    free(x);
    return rc;
}

#ifdef LAMINA_CUDA

static int probe_cuda_check(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess)
        return 0;
    log_write(LOG_LEVEL_ERROR, file, line, "%s failed: %s", what, cudaGetErrorString(e));
    return -EIO;
}

#define CUDA_CHECK(expr) probe_cuda_check((expr), #expr, __FILE__, __LINE__)

/* Device buffers and timing objects of one CUDA probe. */
struct probe_cuda {
    cudaStream_t stream;
    cudaEvent_t ev0, ev1;
    uint8_t *d_w;          /* PROBE_GPU_BYTES: the GEMV matrix, also the copy's target */
    float *d_x, *d_y;      /* activations, outputs */
    uint8_t *h_src;        /* PROBE_COPY_BYTES of pinned host memory */
};

/* Median seconds of PROBE_REPEATS runs of one GEMV (kind 0) or copy (kind 1). */
static int probe_cuda_time(struct probe_cuda *p, int kind, uint32_t type, size_t row_bytes,
                           uint64_t n_rows, double *secs)
{
    double t[PROBE_REPEATS];
    for (int r = -1; r < PROBE_REPEATS; r++) { /* r = -1: warm-up */
        int rc = CUDA_CHECK(cudaEventRecord(p->ev0, p->stream));
        if (!rc && kind == 0)
            rc = cuda_matvec(type, p->d_w, row_bytes, n_rows, PROBE_ROW_ELEMS, p->d_x, p->d_y,
                             p->stream);
        else if (!rc)
            rc = CUDA_CHECK(cudaMemcpyAsync(p->d_w, p->h_src, PROBE_COPY_BYTES,
                                            cudaMemcpyHostToDevice, p->stream));
        rc = rc ? rc : CUDA_CHECK(cudaEventRecord(p->ev1, p->stream));
        rc = rc ? rc : CUDA_CHECK(cudaEventSynchronize(p->ev1));
        float ms = 0;
        rc = rc ? rc : CUDA_CHECK(cudaEventElapsedTime(&ms, p->ev0, p->ev1));
        if (rc)
            return rc;
        if (r >= 0)
            t[r] = 1e-3 * ms;
    }
    *secs = stats_median(t, PROBE_REPEATS);
    return 0;
}

static int probe_cuda_alloc(struct probe_cuda *p, uint64_t n_rows)
{
    int rc = CUDA_CHECK(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
    rc = rc ? rc : CUDA_CHECK(cudaEventCreate(&p->ev0));
    rc = rc ? rc : CUDA_CHECK(cudaEventCreate(&p->ev1));
    rc = rc ? rc : CUDA_CHECK(cudaMalloc((void **)&p->d_w, PROBE_GPU_BYTES));
    rc = rc ? rc : CUDA_CHECK(cudaMalloc((void **)&p->d_x, PROBE_ROW_ELEMS * sizeof(float)));
    rc = rc ? rc : CUDA_CHECK(cudaMalloc((void **)&p->d_y, n_rows * sizeof(float)));
    rc = rc ? rc : CUDA_CHECK(cudaMallocHost((void **)&p->h_src, PROBE_COPY_BYTES));
    if (rc)
        return rc;
    memset(p->h_src, PROBE_FILL, PROBE_COPY_BYTES);
    rc = CUDA_CHECK(cudaMemsetAsync(p->d_w, PROBE_FILL, PROBE_GPU_BYTES, p->stream));
    rc = rc ? rc : CUDA_CHECK(cudaMemsetAsync(p->d_x, 0, PROBE_ROW_ELEMS * sizeof(float),
                                              p->stream));
    return rc ? rc : CUDA_CHECK(cudaStreamSynchronize(p->stream));
}

/* Frees what probe_cuda_alloc made (NULL members are skipped). */
static void probe_cuda_free(struct probe_cuda *p)
{
    cudaFreeHost(p->h_src);
    cudaFree(p->d_y);
    cudaFree(p->d_x);
    cudaFree(p->d_w);
    if (p->ev1)
        cudaEventDestroy(p->ev1);
    if (p->ev0)
        cudaEventDestroy(p->ev0);
    if (p->stream)
        cudaStreamDestroy(p->stream);
}

static int probe_cuda_select(int device)
{
    setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1); /* the order workers number cards in */
    int count = 0;
    if (CUDA_CHECK(cudaGetDeviceCount(&count)))
        return -ENODEV;
    if (device < 0 || device >= count) {
        log_error("cuda probe: device cuda:%d requested but %d present", device, count);
        return -ENODEV;
    }
    return CUDA_CHECK(cudaSetDevice(device));
}

int probe_cuda(int device, uint32_t type, struct probe_result *out)
{
    const double t0 = probe_now();
    if (!cuda_matvec_supports(type) || !quant_is_supported(type))
        type = QUANT_TYPE_Q4_0;
    const size_t row_bytes = quant_row_size(type, PROBE_ROW_ELEMS);
    const uint64_t n_rows = PROBE_GPU_BYTES / row_bytes;
    int rc = probe_cuda_select(device);
    if (rc)
        return rc;
    size_t mem_free = 0, mem_total = 0;
    struct probe_cuda p = {0};
    double gemv_s = 0, copy_s = 0;
    rc = CUDA_CHECK(cudaMemGetInfo(&mem_free, &mem_total));
    rc = rc ? rc : probe_cuda_alloc(&p, n_rows);
    rc = rc ? rc : probe_cuda_time(&p, 0, type, row_bytes, n_rows, &gemv_s);
    rc = rc ? rc : probe_cuda_time(&p, 1, type, row_bytes, n_rows, &copy_s);
    probe_cuda_free(&p);
    int rc_reset = CUDA_CHECK(cudaDeviceReset()); /* the process keeps nothing on the card */
    cuda_caps_forget(); /* nor the kernels' attributes the reset dropped */
    rc = rc ? rc : rc_reset;
    if (rc)
        return rc;
    *out = (struct probe_result){.type = type, .mem_total = mem_total, .mem_free = mem_free};
    out->gemv_bw = (double)(n_rows * row_bytes) / (gemv_s > 0 ? gemv_s : 1e-9);
    out->h2d_bw = (double)PROBE_COPY_BYTES / (copy_s > 0 ? copy_s : 1e-9);
    out->ms = 1e3 * (probe_now() - t0);
    return 0;
}

#else

int probe_cuda(int device, uint32_t type, struct probe_result *out)
{
    (void)type;
    (void)out;
    log_error("cuda probe: device cuda:%d cannot be probed, this build has no CUDA", device);
    return -ENODEV;
}

#endif

int probe_device(const char *name, int threads, uint32_t type, struct probe_result *out)
{
    if (!strcmp(name, "cpu"))
        return probe_cpu(threads, type, out);
    char *end = NULL;
    long dev = !strncmp(name, "cuda:", 5) ? strtol(name + 5, &end, 10) : -1;
    if (end && end != name + 5 && !*end && dev >= 0 && dev < 1024)
        return probe_cuda((int)dev, type, out);
    log_error("probe: cannot probe device '%s' (cpu or cuda:N)", name);
    return -EINVAL;
}
