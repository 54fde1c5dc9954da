/*
 * test_deltanet_cuda: the CUDA gated DeltaNet kernels (kernels/cuda/deltanet.h)
 * against their CPU twins on fresh random data.
 *   - cuda_deltanet_heads (token by token) for dk = dv = 16, 64, 128; nk/nv =
 *     2/4 and 16/32; grouped and tiled key heads; S = 1 and 64 tokens per call;
 *     the state carried over three calls from a random start. Compared with the
 *     CPU glue of fw_dn_head_task run token by token (ops_l2norm, the 1/sqrt(dk)
 *     scale, deltanet_head_step, deltanet_gated_norm): outputs and final state
 *     within TDC_TOL_STEP; and with the chunked CPU prefill form
 *     (deltanet_chunk_head) within TDC_TOL_CHUNK.
 *   - cuda_deltanet_heads_chunked at the 80b shape (nk/nv 16/32, dk = dv = 128,
 *     grouped), the qwen35moe shape (the same, tiled) and a small one (2/4, 64):
 *     a prefill of S = 1, 63, 64, 65, 512, 1000 tokens from a random state, then
 *     TDC_DECODE decode steps (S = 1) carrying the state, with the work buffer
 *     and the outputs poisoned before every call. The reference is the CPU
 *     forward's choice (deltanet_chunk_head for S > 1, deltanet_head_step for
 *     S = 1); outputs and state after every call within TDC_TOL_REL relative
 *     L2 (tf32 tensor-core products), or within TDC_TOL_STEP max abs when no
 *     call took the chunked path.
 *   - the chunked prefill's state pass staged in shared memory (the default
 *     where the card has room) against LAMINA_CUDA_DN_STAGE=0: y and state
 *     byte for byte from one start (128/16/32 S 512 and 65, 64/2/4 S 1000, 16).
 *   - cuda_deltanet_conv for the same channel counts, K = 4, S = 1, 3, 64, 512,
 *     1000, state carried: against deltanet_conv_channel within TDC_TOL_CONV.
 *   - cuda_deltanet_conv_heads (decode: conv and heads in one launch) against
 *     cuda_deltanet_conv + cuda_deltanet_heads (S = 1) on the same inputs, for
 *     dk = dv = 16, 64, 128, nk/nv 2/4, 16/32 and 4/4, grouped and tiled, K =
 *     4 and 2, TDC_CALLS steps with both states carried: outputs, conv state
 *     and delta state bit for bit equal (the same sums in the same order);
 *     each of the two ways also with the heads split over a cluster of
 *     blocks (LAMINA_CUDA_DN_SPLIT 1: the launcher's choice; 2, 4, 8 forced),
 *     all ten bit for bit equal to conv then heads with one block per head;
 *     also dk != dv (64/128, 128/64, 128/96, 32/48; K = 3), grouped and
 *     tiled. The fused ways also write y rounded for the int8 products
 *     (cuda_deltanet_conv_heads_yq) wherever the launcher takes it (dv a
 *     multiple of 32, whole blocks of 32 rows a block; one block per head
 *     must): y and states still equal, the rounded row equal to the host's
 *     rounding of y (tests/gpu/xq_check.h); those launches also read the
 *     states before their PDL wait where they split the heads (early: the
 *     poisoning between launches serialises them). The 80b shape also with CUDA
 *     graphs of 36 chained launches each way, one block per head and split,
 *     and eager (median of 5 x 50 steps) every way.
 *   - cuda_deltanet_heads for TDC_SPLIT_S tokens per call, split (auto, 2,
 *     4, 8) against one block per head: outputs and state bit for bit over
 *     TDC_CALLS calls, seven shapes (dk 16..128, dv 16..128, grouped and
 *     tiled).
 *   - bad shapes and short or misaligned work buffers are refused with -EINVAL.
 * Output buffers are poisoned with NaN bit patterns before every launch.
 * Timings (median of 20 after warm-up, CUDA events) at the 80b shape: the
 * token-by-token (split and one block per head) and chunked heads for S =
 * 1 .. 512, the conv, and the fused decode launch against the two (a graph
 * of 36 layers' launches; eager steps, split and one block per head).
 * Needs a CUDA device: exits 1 with a message when there is none.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "kernels/cpu/deltanet.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/deltanet.h"
#include "kernels/cuda/mvq.h"
#include "tests/check.h"
#include "tests/gpu/xq_check.h"

#define TDC_TOL_STEP 1e-4  /* max |gpu - cpu token by token|, outputs and state */
#define TDC_TOL_CHUNK 1e-3 /* max |gpu - cpu chunked prefill| */
#define TDC_TOL_CONV 1e-5  /* max |gpu - cpu| of the conv outputs and state */
#define TDC_CALLS 3        /* calls per case, state carried */
#define TDC_K 4            /* conv taps */
#define TDC_TOL_REL 2e-3   /* relative L2 |gpu - cpu| / |cpu| of the chunked path */
#define TDC_DECODE 3       /* decode steps after each chunked-path prefill */

struct tdc_rng {
    uint64_t s;
};

static float tdc_uniform(struct tdc_rng *r, float lo, float hi)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return lo + (hi - lo) * (float)((double)(z >> 11) * (1.0 / 9007199254740992.0));
}

static void tdc_fill(struct tdc_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tdc_uniform(r, lo, hi);
}

/* |a - b| / |b| in the L2 norm; infinity when a holds a NaN. */
static double tdc_rel(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = (double)a[i] - b[i];
        num += e * e;
        den += (double)b[i] * b[i];
    }
    return isnan(num) ? INFINITY : sqrt(num / (den > 0.0 ? den : 1.0));
}

static double tdc_maxdiff(const float *a, const float *b, size_t n)
{
    double d = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        d = isnan(e) ? INFINITY : fmax(d, e);
    }
    return d;
}

static bool tdc_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return true;
    CHECK(false, "%s: %s", what, cudaGetErrorString(e));
    return false;
}

/* The LAMINA_CUDA_DN_SPLIT settings the decode comparisons run under: one
 * block per head (the reference), the launchers' own choice, and each forced
 * split (one block per head where dv does not allow it). */
static const char *const tdc_splits[] = {"0", "1", "2", "4", "8"};
#define TDC_N_SPLITS ((int)(sizeof(tdc_splits) / sizeof(tdc_splits[0])))
#define TDC_WAYS (2 * TDC_N_SPLITS) /* way w: split tdc_splits[w / 2]; fused when w is odd */
#define TDC_SPLIT_S 7               /* tokens per call of the multi-token split comparison */

static void tdc_split(const char *setting)
{
    setenv("LAMINA_CUDA_DN_SPLIT", setting, 1);
}

/* One test shape. */
struct tdc_case {
    uint32_t dk, dv, nk, nv;
    bool tiled;
    uint32_t S;
};

/* Host and device buffers of one case. */
struct tdc_bufs {
    size_t ud, vd, st_n;
    float *u, *b, *alpha, *z, *a, *dt, *nw;  /* inputs (host) */
    float *st_step, *st_chunk, *st_gpu;       /* state: cpu token by token, cpu chunked, gpu */
    float *y_step, *y_chunk, *y_gpu;          /* outputs */
    float *d_u, *d_b, *d_alpha, *d_z, *d_a, *d_dt, *d_nw, *d_st, *d_y;
};

/* The CPU glue of fw_dn_head_task, one token at a time (the decode path),
 * over the first S tokens of t's inputs: st_all (all heads) and y. */
static void tdc_cpu_step(const struct tdc_case *c, const struct tdc_bufs *t, uint32_t S,
                         float *st_all, float *y, float *q, float *k, float *o)
{
    const uint32_t dk = c->dk, dv = c->dv, nv = c->nv;
    const size_t kd = (size_t)c->nk * dk;
    const float qscale = 1.0f / sqrtf((float)dk), eps = 1e-6f;
    for (uint32_t h = 0; h < nv; h++) {
        const uint32_t g = c->tiled ? h % c->nk : h / (nv / c->nk);
        float *state = st_all + (size_t)h * dk * dv;
        for (uint32_t s = 0; s < S; s++) {
            const float *us = t->u + s * t->ud;
            memcpy(q, us + (size_t)g * dk, dk * sizeof(float));
            memcpy(k, us + kd + (size_t)g * dk, dk * sizeof(float));
            ops_l2norm(q, dk, eps);
            ops_l2norm(k, dk, eps);
            for (uint32_t i = 0; i < dk; i++)
                q[i] *= qscale;
            const float beta = ops_sigmoid(t->b[(size_t)s * nv + h]);
            const float gd = t->a[h] * ops_softplus(t->alpha[(size_t)s * nv + h] + t->dt[h]);
            deltanet_head_step(state, q, k, us + 2 * kd + (size_t)h * dv, beta, gd, dk, dv, o);
            deltanet_gated_norm(y + s * t->vd + (size_t)h * dv, o,
                                t->z + s * t->vd + (size_t)h * dv, t->nw, dv, eps);
        }
    }
}

/* The same through the chunked prefill form (the CPU forward for S > 1). */
static void tdc_cpu_chunk(const struct tdc_case *c, const struct tdc_bufs *t, uint32_t S,
                          float *st_all, float *y, float *qn, float *kn, float *bb, float *gg,
                          float *oo, float *cs)
{
    const uint32_t dk = c->dk, dv = c->dv, nv = c->nv;
    const size_t kd = (size_t)c->nk * dk;
    const float eps = 1e-6f;
    for (uint32_t h = 0; h < nv; h++) {
        const uint32_t g = c->tiled ? h % c->nk : h / (nv / c->nk);
        for (uint32_t s = 0; s < S; s++) {
            const float *us = t->u + s * t->ud;
            memcpy(qn + (size_t)s * dk, us + (size_t)g * dk, dk * sizeof(float));
            memcpy(kn + (size_t)s * dk, us + kd + (size_t)g * dk, dk * sizeof(float));
            ops_l2norm(qn + (size_t)s * dk, dk, eps);
            ops_l2norm(kn + (size_t)s * dk, dk, eps);
            bb[s] = ops_sigmoid(t->b[(size_t)s * nv + h]);
            gg[s] = t->a[h] * ops_softplus(t->alpha[(size_t)s * nv + h] + t->dt[h]);
        }
        deltanet_chunk_head(st_all + (size_t)h * dk * dv, qn, dk, kn, dk,
                            t->u + 2 * kd + (size_t)h * dv, t->ud, bb, gg, S, dk, dv, oo, dv, cs);
        for (uint32_t s = 0; s < S; s++)
            deltanet_gated_norm(y + s * t->vd + (size_t)h * dv, oo + (size_t)s * dv,
                                t->z + s * t->vd + (size_t)h * dv, t->nw, dv, eps);
    }
}

static bool tdc_alloc(const struct tdc_case *c, struct tdc_bufs *t)
{
    const size_t S = c->S, nv = c->nv;
    t->vd = nv * c->dv;
    t->ud = 2 * (size_t)c->nk * c->dk + t->vd;
    t->st_n = nv * c->dv * c->dk;
    float **host[] = {&t->u, &t->b, &t->alpha, &t->z, &t->a, &t->dt, &t->nw, &t->st_step,
                      &t->st_chunk, &t->st_gpu, &t->y_step, &t->y_chunk, &t->y_gpu};
    const size_t hn[] = {S * t->ud, S * nv, S * nv, S * t->vd, nv, nv, c->dv, t->st_n, t->st_n,
                         t->st_n, S * t->vd, S * t->vd, S * t->vd};
    bool ok = true;
    for (size_t i = 0; i < sizeof(hn) / sizeof(hn[0]); i++)
        ok &= (*host[i] = malloc(hn[i] * sizeof(float))) != NULL;
    float **dev[] = {&t->d_u, &t->d_b, &t->d_alpha, &t->d_z, &t->d_a, &t->d_dt, &t->d_nw,
                     &t->d_st, &t->d_y};
    const size_t dn[] = {S * t->ud, S * nv, S * nv, S * t->vd, nv, nv, c->dv, t->st_n, S * t->vd};
    for (size_t i = 0; i < sizeof(dn) / sizeof(dn[0]); i++)
        ok &= tdc_ok(cudaMalloc((void **)dev[i], dn[i] * sizeof(float)), "cudaMalloc");
    return ok;
}

static void tdc_free(struct tdc_bufs *t)
{
    void *host[] = {t->u, t->b, t->alpha, t->z, t->a, t->dt, t->nw, t->st_step, t->st_chunk,
                    t->st_gpu, t->y_step, t->y_chunk, t->y_gpu};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++)
        free(host[i]);
    void *dev[] = {t->d_u, t->d_b, t->d_alpha, t->d_z, t->d_a, t->d_dt, t->d_nw, t->d_st, t->d_y};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        cudaFree(dev[i]);
}

static bool tdc_upload(float *d, const float *h, size_t n)
{
    return tdc_ok(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice), "upload");
}

/* Fresh inputs of one call into the host and device buffers. */
static bool tdc_new_inputs(const struct tdc_case *c, struct tdc_bufs *t, struct tdc_rng *r,
                           size_t S)
{
    const size_t nv = c->nv;
    tdc_fill(r, t->u, S * t->ud, -1.0f, 1.0f);
    tdc_fill(r, t->b, S * nv, -3.0f, 3.0f);
    tdc_fill(r, t->alpha, S * nv, -4.0f, 2.0f);
    tdc_fill(r, t->z, S * t->vd, -2.0f, 2.0f);
    return tdc_upload(t->d_u, t->u, S * t->ud) && tdc_upload(t->d_b, t->b, S * nv) &&
           tdc_upload(t->d_alpha, t->alpha, S * nv) && tdc_upload(t->d_z, t->z, S * t->vd);
}

/* A random start: state (both CPU copies and the device), a, dt, norm_w. */
static bool tdc_start(const struct tdc_case *c, struct tdc_bufs *t, struct tdc_rng *r)
{
    tdc_fill(r, t->st_step, t->st_n, -0.5f, 0.5f);
    memcpy(t->st_chunk, t->st_step, t->st_n * sizeof(float));
    for (uint32_t h = 0; h < c->nv; h++) {
        t->a[h] = -expf(tdc_uniform(r, -1.0f, 1.0f));
        t->dt[h] = tdc_uniform(r, -1.0f, 1.0f);
    }
    tdc_fill(r, t->nw, c->dv, 0.5f, 1.5f);
    return tdc_upload(t->d_st, t->st_step, t->st_n) && tdc_upload(t->d_a, t->a, c->nv) &&
           tdc_upload(t->d_dt, t->dt, c->nv) && tdc_upload(t->d_nw, t->nw, c->dv);
}

static int tdc_heads(const struct tdc_case *c, struct tdc_bufs *t, cudaStream_t st)
{
    return cuda_deltanet_heads(t->d_st, t->d_u, t->d_b, t->d_alpha, t->d_a, t->d_dt, t->d_z,
                               t->d_nw, t->d_y, c->nk, c->nv, c->dk, c->dv, c->tiled, c->S, 1e-6f,
                               st);
}

static void tdc_case_run(const struct tdc_case *c, uint64_t seed)
{
    struct tdc_bufs t = {0};
    struct tdc_rng r = {seed};
    const uint32_t dk = c->dk, dv = c->dv, S = c->S;
    float *scr = malloc(((size_t)S * (2 * dk + dv + 2) + deltanet_chunk_scratch(dk, dv) + 3 * 128) *
                        sizeof(float));
    if (!scr || !tdc_alloc(c, &t))
        goto out;
    if (!tdc_start(c, &t, &r))
        goto out;
    double ey = 0, es = 0, ecy = 0, ecs = 0;
    for (int call = 0; call < TDC_CALLS; call++) {
        if (!tdc_new_inputs(c, &t, &r, S) ||
            !tdc_ok(cudaMemset(t.d_y, 0xff, (size_t)S * t.vd * sizeof(float)), "poison"))
            goto out;
        int rc = tdc_heads(c, &t, 0);
        CHECK(rc == 0, "cuda_deltanet_heads returned %d", rc);
        if (!tdc_ok(cudaDeviceSynchronize(), "heads kernel") ||
            !tdc_ok(cudaMemcpy(t.y_gpu, t.d_y, (size_t)S * t.vd * sizeof(float),
                               cudaMemcpyDeviceToHost), "download y") ||
            !tdc_ok(cudaMemcpy(t.st_gpu, t.d_st, t.st_n * sizeof(float), cudaMemcpyDeviceToHost),
                    "download state"))
            goto out;
        float *q = scr, *k = q + 128, *o = k + 128;
        tdc_cpu_step(c, &t, S, t.st_step, t.y_step, q, k, o);
        float *qn = scr, *kn = qn + (size_t)S * dk, *bb = kn + (size_t)S * dk, *gg = bb + S;
        float *oo = gg + S, *cs = oo + (size_t)S * dv;
        tdc_cpu_chunk(c, &t, S, t.st_chunk, t.y_chunk, qn, kn, bb, gg, oo, cs);
        ey = fmax(ey, tdc_maxdiff(t.y_gpu, t.y_step, (size_t)S * t.vd));
        es = fmax(es, tdc_maxdiff(t.st_gpu, t.st_step, t.st_n));
        ecy = fmax(ecy, tdc_maxdiff(t.y_gpu, t.y_chunk, (size_t)S * t.vd));
        ecs = fmax(ecs, tdc_maxdiff(t.st_gpu, t.st_chunk, t.st_n));
    }
    MEASURE("heads dk=dv=%u nk/nv=%u/%u %s S=%u x%d calls: max |gpu-cpu step| y %.3g state "
            "%.3g; vs cpu chunked y %.3g state %.3g",
            dk, c->nk, c->nv, c->tiled ? "tiled" : "grouped", S, TDC_CALLS, ey, es, ecy, ecs);
    CHECK(ey <= TDC_TOL_STEP && es <= TDC_TOL_STEP, "heads dk %u nv %u S %u: step diff y %.3g "
          "state %.3g > %.0e", dk, c->nv, S, ey, es, TDC_TOL_STEP);
    CHECK(ecy <= TDC_TOL_CHUNK && ecs <= TDC_TOL_CHUNK, "heads dk %u nv %u S %u: chunked diff y "
          "%.3g state %.3g > %.0e", dk, c->nv, S, ecy, ecs, TDC_TOL_CHUNK);
out:
    free(scr);
    tdc_free(&t);
}

/* The chunked launcher on d_work (work_bytes) for the first S tokens. */
static int tdc_heads_chunked(const struct tdc_case *c, struct tdc_bufs *t, uint32_t S,
                             void *d_work, size_t work_bytes)
{
    return cuda_deltanet_heads_chunked(t->d_st, t->d_u, t->d_b, t->d_alpha, t->d_a, t->d_dt,
                                       t->d_z, t->d_nw, t->d_y, c->nk, c->nv, c->dk, c->dv,
                                       c->tiled, S, 1e-6f, d_work, work_bytes, 0);
}

/* Worst errors of the chunked-path case over its calls. */
struct tdc_errs {
    double ry, rs;     /* relative L2 of y and state against the CPU forward's choice */
    double ay, as;     /* max abs of the same */
    double pre_step;   /* relative L2 of the prefill's y against the CPU step form */
};

/* One call of S tokens through the chunked launcher (work and y poisoned),
 * the CPU forward's choice on t->st_chunk, errors into e. */
static bool tdc_chunk_call(const struct tdc_case *c, struct tdc_bufs *t, struct tdc_rng *r,
                           uint32_t S, void *d_work, size_t work_bytes, float *scr,
                           struct tdc_errs *e)
{
    const uint32_t dk = c->dk, dv = c->dv;
    const size_t ny = (size_t)S * t->vd;
    if (!tdc_new_inputs(c, t, r, S) || !tdc_ok(cudaMemset(t->d_y, 0xff, ny * 4), "poison y") ||
        (d_work && !tdc_ok(cudaMemset(d_work, 0xff, work_bytes), "poison work")))
        return false;
    const int rc = tdc_heads_chunked(c, t, S, d_work, work_bytes);
    CHECK(rc == 0, "cuda_deltanet_heads_chunked returned %d", rc);
    if (rc || !tdc_ok(cudaDeviceSynchronize(), "chunked heads") ||
        !tdc_ok(cudaMemcpy(t->y_gpu, t->d_y, ny * 4, cudaMemcpyDeviceToHost), "download y") ||
        !tdc_ok(cudaMemcpy(t->st_gpu, t->d_st, t->st_n * 4, cudaMemcpyDeviceToHost), "download"))
        return false;
    if (S == 1) {
        tdc_cpu_step(c, t, S, t->st_chunk, t->y_chunk, scr, scr + 128, scr + 256);
    } else {
        float *qn = scr, *kn = qn + (size_t)S * dk, *bb = kn + (size_t)S * dk, *gg = bb + S;
        float *oo = gg + S, *cs = oo + (size_t)S * dv;
        memcpy(t->st_step, t->st_chunk, t->st_n * sizeof(float));
        tdc_cpu_chunk(c, t, S, t->st_chunk, t->y_chunk, qn, kn, bb, gg, oo, cs);
        tdc_cpu_step(c, t, S, t->st_step, t->y_step, scr, scr + 128, scr + 256);
        e->pre_step = fmax(e->pre_step, tdc_rel(t->y_gpu, t->y_step, ny));
    }
    e->ry = fmax(e->ry, tdc_rel(t->y_gpu, t->y_chunk, ny));
    e->rs = fmax(e->rs, tdc_rel(t->st_gpu, t->st_chunk, t->st_n));
    e->ay = fmax(e->ay, tdc_maxdiff(t->y_gpu, t->y_chunk, ny));
    e->as = fmax(e->as, tdc_maxdiff(t->st_gpu, t->st_chunk, t->st_n));
    return true;
}

/* A prefill of c->S tokens through cuda_deltanet_heads_chunked from a random
 * state, then TDC_DECODE decode steps carrying the state. */
static void tdc_chunk_run(const struct tdc_case *c, uint64_t seed)
{
    struct tdc_bufs t = {0};
    struct tdc_rng r = {seed};
    struct tdc_errs e = {0};
    const uint32_t dk = c->dk, dv = c->dv, S = c->S;
    const size_t work_bytes = cuda_deltanet_work_bytes(c->nv, dk, dv, S);
    void *d_work = NULL;
    float *scr = malloc(((size_t)S * (2 * dk + dv + 2) + deltanet_chunk_scratch(dk, dv) + 3 * 128) *
                        sizeof(float));
    bool ok = scr && tdc_alloc(c, &t) &&
              (!work_bytes || tdc_ok(cudaMalloc(&d_work, work_bytes), "cudaMalloc work")) &&
              tdc_start(c, &t, &r);
    ok = ok && tdc_chunk_call(c, &t, &r, S, d_work, work_bytes, scr, &e);
    for (int i = 0; i < TDC_DECODE && ok; i++)
        ok = tdc_chunk_call(c, &t, &r, 1, d_work, work_bytes, scr, &e);
    CHECK(ok, "chunked case dk %u nv %u S %u did not run", dk, c->nv, S);
    MEASURE("chunked heads dk=dv=%u nk/nv=%u/%u %s prefill S=%u (%s) + %d decode steps: rel L2 "
            "y %.3g state %.3g, max abs y %.3g state %.3g; prefill y vs cpu step form rel %.3g",
            dk, c->nk, c->nv, c->tiled ? "tiled" : "grouped", S,
            work_bytes ? "chunked" : "token by token", TDC_DECODE, e.ry, e.rs, e.ay, e.as,
            e.pre_step);
    CHECK(e.ry <= TDC_TOL_REL && e.rs <= TDC_TOL_REL, "chunked dk %u nv %u S %u: rel L2 y %.3g "
          "state %.3g > %.0e", dk, c->nv, S, e.ry, e.rs, TDC_TOL_REL);
    CHECK(work_bytes || (e.ay <= TDC_TOL_STEP && e.as <= TDC_TOL_STEP), "token-by-token dk %u "
          "nv %u S %u: max abs y %.3g state %.3g > %.0e", dk, c->nv, S, e.ay, e.as, TDC_TOL_STEP);
    free(scr);
    cudaFree(d_work);
    tdc_free(&t);
}

/* The chunked prefill's state pass with each record staged in shared memory
 * (the default where the card has room) against LAMINA_CUDA_DN_STAGE=0 (read
 * from global memory): y and the state byte for byte, from one start. */
static void tdc_stage_compare(const struct tdc_case *c, uint64_t seed)
{
    struct tdc_bufs t = {0};
    struct tdc_rng r = {seed};
    const uint32_t S = c->S;
    const size_t work_bytes = cuda_deltanet_work_bytes(c->nv, c->dk, c->dv, S);
    const size_t ny = (size_t)S * c->nv * c->dv;
    void *d_work = NULL;
    float *d_st0 = NULL, *y0 = malloc(ny * sizeof(float)), *st0 = NULL;
    bool ok = y0 && work_bytes && tdc_alloc(c, &t) &&
              tdc_ok(cudaMalloc(&d_work, work_bytes), "cudaMalloc work") &&
              tdc_start(c, &t, &r) && tdc_new_inputs(c, &t, &r, S) &&
              tdc_ok(cudaMalloc((void **)&d_st0, t.st_n * sizeof(float)), "cudaMalloc") &&
              tdc_ok(cudaMemcpy(d_st0, t.d_st, t.st_n * sizeof(float), cudaMemcpyDeviceToDevice),
                     "copy state") &&
              (st0 = malloc(t.st_n * sizeof(float))) != NULL;
    for (int form = 0; form < 2 && ok; form++) {
        if (form)
            CHECK(setenv("LAMINA_CUDA_DN_STAGE", "0", 1) == 0, "setenv");
        ok = tdc_ok(cudaMemcpy(t.d_st, d_st0, t.st_n * sizeof(float), cudaMemcpyDeviceToDevice),
                    "restore state") &&
             tdc_ok(cudaMemset(t.d_y, 0xff, ny * sizeof(float)), "poison y") &&
             tdc_heads_chunked(c, &t, S, d_work, work_bytes) == 0 &&
             tdc_ok(cudaDeviceSynchronize(), "chunked heads") &&
             tdc_ok(cudaMemcpy(form ? t.y_gpu : y0, t.d_y, ny * sizeof(float),
                               cudaMemcpyDeviceToHost), "download y") &&
             tdc_ok(cudaMemcpy(form ? t.st_gpu : st0, t.d_st, t.st_n * sizeof(float),
                               cudaMemcpyDeviceToHost), "download state");
    }
    unsetenv("LAMINA_CUDA_DN_STAGE");
    CHECK(ok, "stage compare dk %u nv %u S %u did not run", c->dk, c->nv, S);
    if (ok) {
        CHECK(memcmp(y0, t.y_gpu, ny * sizeof(float)) == 0 &&
                  memcmp(st0, t.st_gpu, t.st_n * sizeof(float)) == 0,
              "chunked dk %u nv %u S %u: the staged state pass differs from "
              "LAMINA_CUDA_DN_STAGE=0", c->dk, c->nv, S);
        MEASURE("chunked heads dk=dv=%u nk/nv=%u/%u S=%u: the staged state pass and "
                "LAMINA_CUDA_DN_STAGE=0 byte for byte equal", c->dk, c->nk, c->nv, S);
    }
    free(y0);
    free(st0);
    cudaFree(d_st0);
    cudaFree(d_work);
    tdc_free(&t);
}

/* Median of 20 timed launches of fn after 3 warm-ups, in milliseconds. */
static double tdc_time(int (*fn)(void *), void *ctx)
{
    cudaEvent_t e0, e1;
    float ms[20];
    if (!tdc_ok(cudaEventCreate(&e0), "event") || !tdc_ok(cudaEventCreate(&e1), "event"))
        return -1;
    for (int i = 0; i < 3; i++)
        fn(ctx);
    for (int i = 0; i < 20; i++) {
        cudaEventRecord(e0, 0);
        fn(ctx);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms[i], e0, e1);
    }
    for (int i = 1; i < 20; i++)
        for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
            float x = ms[j];
            ms[j] = ms[j - 1];
            ms[j - 1] = x;
        }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 0.5 * (ms[9] + ms[10]);
}

struct tdc_timed {
    const struct tdc_case *c;
    struct tdc_bufs *t;
    void *d_work;      /* NULL: the token-by-token launcher */
    size_t work_bytes;
};

static int tdc_timed_heads(void *ctx)
{
    struct tdc_timed *x = ctx;
    if (!x->d_work)
        return tdc_heads(x->c, x->t, 0);
    return tdc_heads_chunked(x->c, x->t, x->c->S, x->d_work, x->work_bytes);
}

/* Both launchers at the 80b shape (nk/nv 16/32, dk = dv = 128) for S tokens. */
static void tdc_heads_timing(uint32_t S)
{
    const struct tdc_case c = {128, 128, 16, 32, false, S};
    struct tdc_bufs t = {0};
    struct tdc_rng r = {99};
    struct tdc_timed x = {&c, &t, NULL, cuda_deltanet_work_bytes(c.nv, c.dk, c.dv, S)};
    if (!tdc_alloc(&c, &t) || !tdc_new_inputs(&c, &t, &r, S) ||
        (x.work_bytes && !tdc_ok(cudaMalloc(&x.d_work, x.work_bytes), "cudaMalloc work")))
        goto out;
    tdc_fill(&r, t.a, c.nv, -1.0f, -0.5f);
    tdc_fill(&r, t.dt, c.nv, -1.0f, 1.0f);
    tdc_fill(&r, t.nw, c.dv, 0.5f, 1.5f);
    if (!tdc_upload(t.d_a, t.a, c.nv) || !tdc_upload(t.d_dt, t.dt, c.nv) ||
        !tdc_upload(t.d_nw, t.nw, c.dv) ||
        !tdc_ok(cudaMemset(t.d_st, 0, t.st_n * sizeof(float)), "memset"))
        goto out;
    void *d_work = x.d_work;
    x.d_work = NULL;
    tdc_split("0");
    const double ms_one = tdc_time(tdc_timed_heads, &x);
    tdc_split("1");
    const double ms_tok = tdc_time(tdc_timed_heads, &x);
    unsetenv("LAMINA_CUDA_DN_SPLIT");
    x.d_work = d_work;
    const double ms_chunk = d_work ? tdc_time(tdc_timed_heads, &x) : ms_tok;
    /* the chunked form's three kernels one at a time (LAMINA_CUDA_DN_CHUNK_ONLY), the
     * state pass also unstaged (LAMINA_CUDA_DN_STAGE=0) */
    static const char *const only[4] = {"prep", "state", "norm", "state"};
    double ms_only[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4 && d_work; i++) {
        CHECK(setenv("LAMINA_CUDA_DN_CHUNK_ONLY", only[i], 1) == 0, "setenv");
        if (i == 3)
            CHECK(setenv("LAMINA_CUDA_DN_STAGE", "0", 1) == 0, "setenv");
        ms_only[i] = tdc_time(tdc_timed_heads, &x);
    }
    unsetenv("LAMINA_CUDA_DN_CHUNK_ONLY");
    unsetenv("LAMINA_CUDA_DN_STAGE");
    CHECK(tdc_ok(cudaDeviceSynchronize(), "timed heads"), "timed heads");
    if (d_work)
        MEASURE("chunked heads dk=dv=128 nk/nv=16/32 S=%u, its kernels alone: prep %.1f us, "
                "state %.1f us (LAMINA_CUDA_DN_STAGE=0 %.1f us), norm %.1f us", S,
                ms_only[0] * 1e3, ms_only[1] * 1e3, ms_only[3] * 1e3, ms_only[2] * 1e3);
    MEASURE("heads dk=dv=128 nk/nv=16/32 S=%u: token by token %.1f us per call (%.2f us per "
            "token; one block per head %.1f us, %.2fx); chunked %.1f us per call (%.3f us per "
            "token, %.1fx; work %.1f MB)", S, ms_tok * 1e3, ms_tok * 1e3 / S, ms_one * 1e3,
            ms_one / ms_tok, ms_chunk * 1e3, ms_chunk * 1e3 / S, ms_tok / ms_chunk,
            x.work_bytes / 1e6);
out:
    cudaFree(x.d_work);
    tdc_free(&t);
}

/* Conv over C channels, S tokens, three calls with the state carried. */
static void tdc_conv_run(uint32_t C, uint32_t S, uint64_t seed)
{
    struct tdc_rng r = {seed};
    const size_t sn = (size_t)C * (TDC_K - 1), xn = (size_t)S * C;
    float *w = malloc((size_t)C * TDC_K * sizeof(float)), *st = malloc(sn * sizeof(float));
    float *x = malloc(xn * sizeof(float)), *u = malloc(xn * sizeof(float));
    float *ug = malloc(xn * sizeof(float)), *sg = malloc(sn * sizeof(float));
    float *d_w = NULL, *d_st = NULL, *d_x = NULL, *d_u = NULL;
    bool ok = w && st && x && u && ug && sg &&
              tdc_ok(cudaMalloc((void **)&d_w, (size_t)C * TDC_K * sizeof(float)), "malloc") &&
              tdc_ok(cudaMalloc((void **)&d_st, sn * sizeof(float)), "malloc") &&
              tdc_ok(cudaMalloc((void **)&d_x, xn * sizeof(float)), "malloc") &&
              tdc_ok(cudaMalloc((void **)&d_u, xn * sizeof(float)), "malloc");
    double eu = 0, es = 0;
    if (ok) {
        tdc_fill(&r, w, (size_t)C * TDC_K, -1.0f, 1.0f);
        tdc_fill(&r, st, sn, -1.0f, 1.0f);
        ok = tdc_upload(d_w, w, (size_t)C * TDC_K) && tdc_upload(d_st, st, sn);
    }
    for (int call = 0; call < TDC_CALLS && ok; call++) {
        tdc_fill(&r, x, xn, -2.0f, 2.0f);
        ok = tdc_upload(d_x, x, xn) && tdc_ok(cudaMemset(d_u, 0xff, xn * sizeof(float)), "poison");
        int rc = ok ? cuda_deltanet_conv(d_st, d_w, TDC_K, d_x, d_u, C, S, 0) : -1;
        CHECK(rc == 0, "cuda_deltanet_conv returned %d", rc);
        ok = ok && tdc_ok(cudaMemcpy(ug, d_u, xn * sizeof(float), cudaMemcpyDeviceToHost), "dl") &&
             tdc_ok(cudaMemcpy(sg, d_st, sn * sizeof(float), cudaMemcpyDeviceToHost), "dl");
        for (uint32_t ch = 0; ch < C && ok; ch++)
            deltanet_conv_channel(st + (size_t)ch * (TDC_K - 1), w + (size_t)ch * TDC_K, TDC_K,
                                  x + ch, C, u + ch, C, S);
        if (ok) {
            eu = fmax(eu, tdc_maxdiff(ug, u, xn));
            es = fmax(es, tdc_maxdiff(sg, st, sn));
        }
    }
    MEASURE("conv C=%u K=%d S=%u x%d calls: max |gpu-cpu| u %.3g state %.3g", C, TDC_K, S,
            TDC_CALLS, eu, es);
    CHECK(ok && eu <= TDC_TOL_CONV && es <= TDC_TOL_CONV, "conv C %u S %u: diff u %.3g state %.3g",
          C, S, eu, es);
    if (ok && C >= 8192 && (S == 1 || S == 512)) {
        cudaEvent_t e0, e1;
        float ms = 0;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        for (int i = 0; i < 3; i++)
            cuda_deltanet_conv(d_st, d_w, TDC_K, d_x, d_u, C, S, 0);
        cudaEventRecord(e0, 0);
        for (int i = 0; i < 20; i++)
            cuda_deltanet_conv(d_st, d_w, TDC_K, d_x, d_u, C, S, 0);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms, e0, e1);
        MEASURE("conv C=%u S=%u: %.2f us per call (mean of 20 after warm-up)", C, S,
                ms * 1e3 / 20);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    free(w), free(st), free(x), free(u), free(ug), free(sg);
    cudaFree(d_w), cudaFree(d_st), cudaFree(d_x), cudaFree(d_u);
}

/* Device buffers of the fused-decode comparison: the conv input x, conv
 * taps, and per way (TDC_WAYS) conv state, delta state and output; the rest
 * in tdc_bufs (u is the unfused conv output). */
struct tdc_fused {
    const struct tdc_case *c;
    struct tdc_bufs *t;
    uint32_t K;
    float *d_x, *d_w, *d_cs[TDC_WAYS], *d_st[TDC_WAYS], *d_y[TDC_WAYS];
    int8_t *d_yq[TDC_WAYS]; /* fused ways, where vd % 32 == 0: y rounded (conv_heads_yq) */
    bool yq[TDC_WAYS];      /* the way's last step wrote d_yq */
    uint32_t yq_checked;    /* steps x ways whose yq was checked */
};

/* One decode step one way on stream s, under the split setting the caller
 * set: conv then heads (even ways) or the fused launch (odd ways; with the
 * rounded y where the way has a yq buffer and the launcher takes it, and
 * then with `early`: the caller's promise that the way's states were written
 * two or more launches back). */
static int tdc_fused_step(struct tdc_fused *f, int way, bool early, cudaStream_t s)
{
    const struct tdc_case *c = f->c;
    const struct tdc_bufs *t = f->t;
    const uint32_t C = (uint32_t)t->ud;
    f->yq[way] = false;
    if (way % 2 && f->d_yq[way]) {
        const int rc = cuda_deltanet_conv_heads_yq(
            f->d_cs[way], f->d_w, f->K, f->d_x, f->d_st[way], t->d_b, t->d_alpha, t->d_a, t->d_dt,
            t->d_z, t->d_nw, f->d_y[way], f->d_yq[way], c->nk, c->nv, c->dk, c->dv, c->tiled,
            1e-6f, early, s);
        f->yq[way] = rc == 0;
        if (rc != -ENOTSUP)
            return rc;
    }
    if (way % 2)
        return cuda_deltanet_conv_heads(f->d_cs[way], f->d_w, f->K, f->d_x, f->d_st[way], t->d_b,
                                        t->d_alpha, t->d_a, t->d_dt, t->d_z, t->d_nw, f->d_y[way],
                                        c->nk, c->nv, c->dk, c->dv, c->tiled, 1e-6f, s);
    int rc = cuda_deltanet_conv(f->d_cs[way], f->d_w, f->K, f->d_x, t->d_u, C, 1, s);
    return rc ? rc
              : cuda_deltanet_heads(f->d_st[way], t->d_u, t->d_b, t->d_alpha, t->d_a, t->d_dt,
                                    t->d_z, t->d_nw, f->d_y[way], c->nk, c->nv, c->dk, c->dv,
                                    c->tiled, 1, 1e-6f, s);
}

/* Whether device buffers a and b of n floats hold the same bytes. */
static bool tdc_same(const float *d_a, const float *d_b, size_t n, float *ha, float *hb)
{
    return tdc_ok(cudaMemcpy(ha, d_a, n * sizeof(float), cudaMemcpyDeviceToHost), "dl") &&
           tdc_ok(cudaMemcpy(hb, d_b, n * sizeof(float), cudaMemcpyDeviceToHost), "dl") &&
           !memcmp(ha, hb, n * sizeof(float));
}

static void tdc_sort(float *x, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && x[j] < x[j - 1]; j--) {
            float v = x[j];
            x[j] = x[j - 1];
            x[j - 1] = v;
        }
}

/* Median us of a graph of `layers` decode steps one way (each step on its
 * own state, as the layers of a model), after warm-up; captured under the
 * split setting the caller set. */
static double tdc_fused_graph_us(struct tdc_fused *f, int way, uint32_t layers)
{
    cudaStream_t s;
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t e0, e1;
    float ms[20];
    if (!tdc_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"))
        return -1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    bool ok = tdc_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
    for (uint32_t l = 0; l < layers && ok; l++)
        ok = tdc_fused_step(f, way, false, s) == 0;
    ok = tdc_ok(cudaStreamEndCapture(s, &g), "end capture") && ok;
    ok = ok && tdc_ok(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    for (int i = 0; i < 3 && ok; i++)
        ok = tdc_ok(cudaGraphLaunch(ge, s), "graph launch");
    for (int i = 0; i < 20 && ok; i++) {
        cudaEventRecord(e0, s);
        ok = tdc_ok(cudaGraphLaunch(ge, s), "graph launch");
        cudaEventRecord(e1, s);
        ok = ok && tdc_ok(cudaEventSynchronize(e1), "graph run");
        cudaEventElapsedTime(&ms[i], e0, e1);
    }
    if (ok)
        tdc_sort(ms, 20);
    if (ge)
        cudaGraphExecDestroy(ge);
    if (g)
        cudaGraphDestroy(g);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(s);
    return ok ? 1e3 * 0.5 * (ms[9] + ms[10]) : -1;
}

/* Us per decode step one way, eager on stream 0 under the split setting the
 * caller set: 5 warm-up steps, then the median of 5 runs of 50 steps between
 * two events; -1 on a failure. */
static double tdc_fused_eager_us(struct tdc_fused *f, int way)
{
    cudaEvent_t e0, e1;
    float ms[5];
    if (!tdc_ok(cudaEventCreate(&e0), "event"))
        return -1;
    if (!tdc_ok(cudaEventCreate(&e1), "event")) {
        cudaEventDestroy(e0);
        return -1;
    }
    bool ok = true;
    for (int i = 0; i < 5 && ok; i++)
        ok = tdc_fused_step(f, way, false, 0) == 0;
    for (int run = 0; run < 5 && ok; run++) {
        ok = tdc_ok(cudaEventRecord(e0, 0), "record");
        for (int i = 0; i < 50 && ok; i++)
            ok = tdc_fused_step(f, way, false, 0) == 0;
        ok = ok && tdc_ok(cudaEventRecord(e1, 0), "record") &&
             tdc_ok(cudaEventSynchronize(e1), "eager steps") &&
             tdc_ok(cudaEventElapsedTime(&ms[run], e0, e1), "elapsed");
    }
    if (ok)
        tdc_sort(ms, 5);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ok ? 1e3 * ms[2] / 50 : -1;
}

/* The timings of tdc_fused_run at the 80b shape: graphs of 36 layers' steps
 * (one block per head and split), and eager steps every way. */
static void tdc_fused_timing(struct tdc_fused *f)
{
    const struct tdc_case *c = f->c;
    double g[4], e[TDC_WAYS];
    for (int w = 0; w < 4; w++) {
        tdc_split(tdc_splits[w / 2]);
        g[w] = tdc_fused_graph_us(f, w, 36);
    }
    MEASURE("conv+heads dk=dv=%u nk/nv=%u/%u, graph of 36 layers' launches (median of 20): "
            "one block per head: conv then heads %.1f us (%.2f per layer), fused %.1f us (%.2f "
            "per layer); split: conv then heads %.1f us (%.2f), fused %.1f us (%.2f)",
            c->dk, c->nk, c->nv, g[0], g[0] / 36, g[1], g[1] / 36, g[2], g[2] / 36, g[3],
            g[3] / 36);
    for (int w = 0; w < TDC_WAYS; w++) {
        tdc_split(tdc_splits[w / 2]);
        e[w] = tdc_fused_eager_us(f, w);
    }
    for (int fused = 1; fused >= 0; fused--)
        MEASURE("conv+heads %s dk=dv=%u nk/nv=%u/%u K=%u eager (median of 5 x 50 steps after "
                "warm-up): one block per head %.2f us per step, split %.2f us (%.2fx faster); "
                "forced split 2 / 4 / 8: %.2f / %.2f / %.2f us",
                fused ? "fused" : "two launches", c->dk, c->nk, c->nv, f->K, e[fused],
                e[2 + fused], e[fused] / e[2 + fused], e[4 + fused], e[6 + fused], e[8 + fused]);
    bool ran = true;
    for (int w = 0; w < TDC_WAYS; w++)
        ran &= e[w] > 0 && (w >= 4 || g[w] > 0);
    CHECK(ran, "fused timings ran");
}

/* Launches and compares one decode step every way (TDC_WAYS), against way
 * 0 (conv then heads, one block per head): outputs, conv state and delta
 * state bit for bit. Returns whether every way matched. */
static bool tdc_fused_compare(struct tdc_fused *f, int step, size_t csn, float *ha, float *hb,
                              bool *ok)
{
    const struct tdc_case *c = f->c;
    const size_t vd = f->t->vd, st_n = f->t->st_n;
    int rc[TDC_WAYS];
    for (int w = 0; w < TDC_WAYS; w++) {
        tdc_split(tdc_splits[w / 2]);
        *ok = *ok && tdc_ok(cudaMemset(f->d_y[w], w ? 0xfe : 0xff, vd * 4), "poison");
        if (f->d_yq[w])
            *ok = *ok && tdc_ok(cudaMemset(f->d_yq[w], 0xfe, cuda_mvq_xq_bytes(vd)), "poison");
        /* the poisoning serialises the launches: early where the way takes it */
        rc[w] = *ok ? tdc_fused_step(f, w, true, 0) : -1;
        CHECK(rc[w] == 0, "dk %u nk/nv %u/%u K %u way %d: launch returned %d", c->dk, c->nk,
              c->nv, f->K, w, rc[w]);
        *ok = *ok && rc[w] == 0;
    }
    *ok = *ok && tdc_ok(cudaDeviceSynchronize(), "fused step");
    bool all = *ok;
    for (int w = 1; w < TDC_WAYS && *ok; w++) {
        const bool y = tdc_same(f->d_y[0], f->d_y[w], vd, ha, hb);
        const bool s1 = tdc_same(f->d_cs[0], f->d_cs[w], csn, ha, hb);
        const bool s2 = tdc_same(f->d_st[0], f->d_st[w], st_n, ha, hb);
        CHECK(y && s1 && s2, "dk %u dv %u nk/nv %u/%u %s K %u step %d: %s split %s %s%s%s "
              "differ from conv then heads, one block per head", c->dk, c->dv, c->nk, c->nv,
              c->tiled ? "tiled" : "grouped", f->K, step, w % 2 ? "fused" : "conv then heads",
              tdc_splits[w / 2], y ? "" : "y ", s1 ? "" : "conv-state ", s2 ? "" : "state");
        all &= y && s1 && s2;
    }
    /* the rounded y: the host's rounding of way 0's y (one block per head
     * takes it wherever dv is a multiple of 32) */
    CHECK(!*ok || c->dv % 32 || f->yq[1], "dk %u dv %u nk/nv %u/%u: the fused launch with one "
          "block per head declined the rounded y", c->dk, c->dv, c->nk, c->nv);
    const size_t xb = vd % 32 ? 0 : cuda_mvq_xq_bytes(vd);
    uint8_t *hq = xb ? malloc(xb) : NULL;
    for (int w = 1; w < TDC_WAYS && *ok && hq; w += 2) {
        if (!f->yq[w])
            continue;
        *ok = tdc_ok(cudaMemcpy(ha, f->d_y[0], vd * 4, cudaMemcpyDeviceToHost), "dl") &&
              tdc_ok(cudaMemcpy(hq, f->d_yq[w], xb, cudaMemcpyDeviceToHost), "dl");
        const int bad = *ok ? xq_mismatches(ha, hq, (uint32_t)vd) : -1;
        CHECK(bad == 0, "dk %u dv %u nk/nv %u/%u step %d: fused split %s: %d levels, scales or "
              "sums of the rounded y differ from the host's rounding of y", c->dk, c->dv, c->nk,
              c->nv, step, tdc_splits[w / 2], bad);
        all &= bad == 0;
        f->yq_checked++;
    }
    free(hq);
    return all;
}

/* The fused decode launch against conv + heads, each with one block per head
 * and split (TDC_WAYS): TDC_CALLS steps from the same random states, outputs
 * and both states compared bit for bit after every step; timed at the 80b
 * shape when `timed`. */
static void tdc_fused_run(const struct tdc_case *c, uint32_t K, uint64_t seed, bool timed)
{
    struct tdc_bufs t = {0};
    struct tdc_rng r = {seed};
    struct tdc_fused f = {.c = c, .t = &t, .K = K};
    bool ok = tdc_alloc(c, &t);
    const size_t C = t.ud, csn = C * (K - 1);
    float *w = malloc(C * K * sizeof(float)), *cs = malloc(csn * sizeof(float));
    const size_t hn = C * K + t.st_n;
    float *ha = malloc(hn * sizeof(float)), *hb = malloc(hn * sizeof(float));
    ok = ok && w && cs && ha && hb && tdc_ok(cudaMalloc((void **)&f.d_x, C * 4), "malloc") &&
         tdc_ok(cudaMalloc((void **)&f.d_w, C * K * 4), "malloc");
    for (int i = 0; i < TDC_WAYS && ok; i++)
        ok = tdc_ok(cudaMalloc((void **)&f.d_cs[i], csn * 4 + 4), "malloc") &&
             tdc_ok(cudaMalloc((void **)&f.d_st[i], t.st_n * 4), "malloc") &&
             tdc_ok(cudaMalloc((void **)&f.d_y[i], t.vd * 4), "malloc");
    for (int i = 1; i < TDC_WAYS && ok && t.vd % 32 == 0; i += 2)
        ok = tdc_ok(cudaMalloc((void **)&f.d_yq[i], cuda_mvq_xq_bytes(t.vd)), "malloc") &&
             tdc_ok(cudaMemset(f.d_yq[i], 0xff, cuda_mvq_xq_bytes(t.vd)), "poison");
    ok = ok && tdc_start(c, &t, &r);
    if (ok) {
        tdc_fill(&r, w, C * K, -1.0f, 1.0f);
        tdc_fill(&r, cs, csn, -1.0f, 1.0f);
        ok = tdc_upload(f.d_w, w, C * K);
        for (int i = 0; i < TDC_WAYS && ok; i++)
            ok = tdc_upload(f.d_cs[i], cs, csn) && tdc_upload(f.d_st[i], t.st_step, t.st_n);
    }
    int steps = 0;
    for (int call = 0; call < TDC_CALLS && ok; call++) {
        ok = tdc_new_inputs(c, &t, &r, 1) && tdc_upload(f.d_x, t.u, C) &&
             tdc_ok(cudaMemset(t.d_u, 0xff, C * 4), "poison");
        steps += tdc_fused_compare(&f, call, csn, ha, hb, &ok);
    }
    CHECK(ok, "dk %u dv %u nk/nv %u/%u K %u: fused comparison did not run", c->dk, c->dv, c->nk,
          c->nv, K);
    MEASURE("conv+heads dk=%u dv=%u nk/nv=%u/%u %s K=%u: %d of %d steps bit for bit equal, "
            "fused and conv then heads, one block per head and split (auto, 2, 4, 8); rounded "
            "y checked in %u fused launches", c->dk, c->dv, c->nk, c->nv,
            c->tiled ? "tiled" : "grouped", K, steps, TDC_CALLS, f.yq_checked);
    if (ok && timed)
        tdc_fused_timing(&f);
    unsetenv("LAMINA_CUDA_DN_SPLIT");
    free(w), free(cs), free(ha), free(hb);
    cudaFree(f.d_x), cudaFree(f.d_w);
    for (int i = 0; i < TDC_WAYS; i++)
        cudaFree(f.d_cs[i]), cudaFree(f.d_st[i]), cudaFree(f.d_y[i]), cudaFree(f.d_yq[i]);
    tdc_free(&t);
}

/* cuda_deltanet_heads for c->S tokens per call under every split setting
 * against one block per head: TDC_CALLS calls from the same random state,
 * outputs and state bit for bit equal after every call. */
static void tdc_split_heads_run(const struct tdc_case *c, uint64_t seed)
{
    struct tdc_bufs t = {0};
    struct tdc_rng r = {seed};
    float *d_st[TDC_N_SPLITS] = {0}, *d_y[TDC_N_SPLITS] = {0};
    bool ok = tdc_alloc(c, &t);
    const size_t ny = (size_t)c->S * t.vd, hn = ny > t.st_n ? ny : t.st_n;
    float *ha = malloc(hn * sizeof(float)), *hb = malloc(hn * sizeof(float));
    ok = ok && ha && hb && tdc_start(c, &t, &r);
    for (int i = 0; i < TDC_N_SPLITS && ok; i++)
        ok = tdc_ok(cudaMalloc((void **)&d_st[i], t.st_n * 4), "malloc") &&
             tdc_ok(cudaMalloc((void **)&d_y[i], ny * 4), "malloc") &&
             tdc_upload(d_st[i], t.st_step, t.st_n);
    int calls = 0;
    for (int call = 0; call < TDC_CALLS && ok; call++) {
        ok = tdc_new_inputs(c, &t, &r, c->S);
        for (int i = 0; i < TDC_N_SPLITS && ok; i++) {
            tdc_split(tdc_splits[i]);
            ok = tdc_ok(cudaMemset(d_y[i], i ? 0xfe : 0xff, ny * 4), "poison");
            const int rc = ok ? cuda_deltanet_heads(d_st[i], t.d_u, t.d_b, t.d_alpha, t.d_a,
                                                    t.d_dt, t.d_z, t.d_nw, d_y[i], c->nk, c->nv,
                                                    c->dk, c->dv, c->tiled, c->S, 1e-6f, 0)
                              : -1;
            CHECK(rc == 0, "heads split %s returned %d", tdc_splits[i], rc);
            ok = ok && rc == 0;
        }
        ok = ok && tdc_ok(cudaDeviceSynchronize(), "split heads");
        bool all = ok;
        for (int i = 1; i < TDC_N_SPLITS && ok; i++) {
            const bool y = tdc_same(d_y[0], d_y[i], ny, ha, hb);
            const bool st = tdc_same(d_st[0], d_st[i], t.st_n, ha, hb);
            CHECK(y && st, "heads dk %u dv %u nk/nv %u/%u %s S %u call %d: split %s %s%s differ "
                  "from one block per head", c->dk, c->dv, c->nk, c->nv,
                  c->tiled ? "tiled" : "grouped", c->S, call, tdc_splits[i], y ? "" : "y ",
                  st ? "" : "state");
            all &= y && st;
        }
        calls += all;
    }
    CHECK(ok, "heads dk %u dv %u nk/nv %u/%u: split comparison did not run", c->dk, c->dv, c->nk,
          c->nv);
    MEASURE("heads dk=%u dv=%u nk/nv=%u/%u %s S=%u: %d of %d calls bit for bit equal, one block "
            "per head and split (auto, 2, 4, 8)", c->dk, c->dv, c->nk, c->nv,
            c->tiled ? "tiled" : "grouped", c->S, calls, TDC_CALLS);
    unsetenv("LAMINA_CUDA_DN_SPLIT");
    free(ha), free(hb);
    for (int i = 0; i < TDC_N_SPLITS; i++)
        cudaFree(d_st[i]), cudaFree(d_y[i]);
    tdc_free(&t);
}

static void tdc_bad_args(void)
{
    float *d = NULL;
    if (!tdc_ok(cudaMalloc((void **)&d, 1 << 20), "malloc"))
        return;
    int r1 = cuda_deltanet_heads(d, d, d, d, d, d, d, d, d, 2, 4, 48, 16, false, 1, 1e-6f, 0);
    int r2 = cuda_deltanet_heads(d, d, d, d, d, d, d, d, d, 2, 4, 16, 8, false, 1, 1e-6f, 0);
    int r3 = cuda_deltanet_heads(d, d, d, d, d, d, d, d, d, 3, 4, 16, 16, false, 1, 1e-6f, 0);
    int r4 = cuda_deltanet_heads(d + 1, d, d, d, d, d, d, d, d, 2, 4, 16, 16, false, 1, 1e-6f, 0);
    int r5 = cuda_deltanet_conv(d, d, 9, d, d, 16, 1, 0);
    int r6 = cuda_deltanet_conv(d, d, 4, d, d, 0, 1, 0);
    CHECK(r1 == -EINVAL && r2 == -EINVAL && r3 == -EINVAL && r4 == -EINVAL && r5 == -EINVAL &&
          r6 == -EINVAL, "bad shapes refused: %d %d %d %d %d %d", r1, r2, r3, r4, r5, r6);
    const size_t need = cuda_deltanet_work_bytes(4, 64, 64, 64);
    int r7 = cuda_deltanet_heads_chunked(d, d, d, d, d, d, d, d, d, 2, 4, 64, 64, false, 64, 1e-6f,
                                         d, need - 4, 0);
    int r8 = cuda_deltanet_heads_chunked(d, d, d, d, d, d, d, d, d, 2, 4, 64, 64, false, 64, 1e-6f,
                                         d + 1, need, 0);
    int r9 = cuda_deltanet_heads_chunked(d, d, d, d, d, d, d, d, d, 2, 4, 64, 64, false, 64, 1e-6f,
                                         NULL, need, 0);
    CHECK(need > 0 && r7 == -EINVAL && r8 == -EINVAL && r9 == -EINVAL,
          "short, misaligned or missing work refused: need %zu, %d %d %d", need, r7, r8, r9);
    CHECK(cuda_deltanet_work_bytes(4, 64, 64, 1) == 0 &&
          cuda_deltanet_work_bytes(4, 16, 16, 512) == 0, "decode and small heads need no work");
    cudaFree(d);
}

int main(void)
{
    log_init("test", -1);
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_deltanet_cuda: no CUDA device present\n");
        return 1;
    }
    const uint32_t dims[] = {16, 64, 128};
    const uint32_t heads[][2] = {{2, 4}, {16, 32}};
    const uint32_t lens[] = {1, 64};
    uint64_t seed = 1;
    for (size_t d = 0; d < 3; d++)
        for (size_t hh = 0; hh < 2; hh++)
            for (int tiled = 0; tiled < 2; tiled++)
                for (size_t l = 0; l < 2; l++) {
                    const struct tdc_case c = {dims[d], dims[d], heads[hh][0], heads[hh][1],
                                               tiled != 0, lens[l]};
                    tdc_case_run(&c, seed++);
                }
    const struct tdc_case chunk_shapes[] = {
        {128, 128, 16, 32, false, 0}, /* qwen3next 80b-a3b */
        {128, 128, 16, 32, true, 0},  /* qwen35moe: tiled key heads */
        {64, 64, 2, 4, false, 0},
    };
    const uint32_t prefills[] = {1, 63, 64, 65, 512, 1000};
    for (size_t i = 0; i < 3; i++)
        for (size_t l = 0; l < sizeof(prefills) / sizeof(prefills[0]); l++) {
            struct tdc_case c = chunk_shapes[i];
            c.S = prefills[l];
            tdc_chunk_run(&c, seed++);
        }
    const struct tdc_case staged[] = {{128, 128, 16, 32, false, 512}, {128, 128, 16, 32, true, 65},
                                      {64, 64, 2, 4, false, 1000}, {64, 64, 2, 4, true, 16}};
    for (size_t i = 0; i < sizeof(staged) / sizeof(staged[0]); i++)
        tdc_stage_compare(&staged[i], seed++);
    const uint32_t conv_lens[] = {1, 3, 64, 512, 1000};
    for (size_t d = 0; d < 3; d++)
        for (size_t hh = 0; hh < 2; hh++)
            for (size_t l = 0; l < sizeof(conv_lens) / sizeof(conv_lens[0]); l++)
                tdc_conv_run(2 * heads[hh][0] * dims[d] + heads[hh][1] * dims[d], conv_lens[l],
                             seed++);
    const uint32_t fused_heads[][2] = {{2, 4}, {16, 32}, {4, 4}};
    for (size_t d = 0; d < 3; d++)
        for (size_t hh = 0; hh < 3; hh++)
            for (int tiled = 0; tiled < 2; tiled++)
                for (uint32_t K = 2; K <= 4; K += 2) {
                    const struct tdc_case c = {dims[d], dims[d], fused_heads[hh][0],
                                               fused_heads[hh][1], tiled != 0, 1};
                    tdc_fused_run(&c, K, seed++, d == 2 && hh == 1 && !tiled && K == 4);
                }
    /* dk != dv, and dv whose warps split only 2 ways (48: 3 warps a block) */
    const uint32_t split_shapes[][4] = {{64, 128, 2, 4}, {128, 64, 4, 8}, {128, 96, 2, 4},
                                        {32, 48, 3, 6}};
    for (size_t i = 0; i < 4; i++)
        for (int tiled = 0; tiled < 2; tiled++) {
            const uint32_t *sh = split_shapes[i];
            const struct tdc_case c = {sh[0], sh[1], sh[2], sh[3], tiled != 0, 1};
            tdc_fused_run(&c, 3, seed++, false);
        }
    const struct tdc_case split_heads[] = {
        {128, 128, 16, 32, false, TDC_SPLIT_S}, {128, 128, 16, 32, true, TDC_SPLIT_S},
        {64, 64, 2, 4, false, TDC_SPLIT_S},     {64, 128, 2, 4, true, TDC_SPLIT_S},
        {128, 64, 4, 8, false, TDC_SPLIT_S},    {32, 48, 3, 6, true, TDC_SPLIT_S},
        {16, 16, 2, 4, false, TDC_SPLIT_S},
    };
    for (size_t i = 0; i < sizeof(split_heads) / sizeof(split_heads[0]); i++)
        tdc_split_heads_run(&split_heads[i], seed++);
    tdc_bad_args();
    tdc_heads_timing(1);
    const uint32_t timed[] = {16, 32, 64, 128, 512};
    for (size_t i = 0; i < sizeof(timed) / sizeof(timed[0]); i++)
        tdc_heads_timing(timed[i]);
    return test_main_result("test_deltanet_cuda");
}
