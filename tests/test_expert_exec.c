/*
 * test_expert_exec: grouped routed-expert products on a synthetic qwen3next
 * tiny model (synth_write, Q8_0, Q4_0 and F16 matrices, written to /tmp).
 *
 * For groups of 1..5 rows (several groups per call, experts repeated and in
 * any order):
 *   - a group of one row equals, bit for bit, the direct per-row reference
 *     down(silu(gate x) * up x) computed with matvec_rows and ops_silu;
 *   - a group of S >= 2 rows equals, bit for bit, the same reference built
 *     with matvec_rows_batch over the group's rows (the batch path's result
 *     depends only on weight row and activation row), and the per-row
 *     matvec_rows reference within 1e-3 of the output's scale (the two
 *     paths round activations in different segment sizes);
 *   - the outputs are bit-identical for 1 and 2 threads;
 *   - a fused gate_up stack (rows 0..F-1 gate, F..2F-1 up, built by copying
 *     the model's gate and up matrices) gives the same bits as the separate
 *     stacks, and so do expert refs pointing at copies of the weights;
 *   - more rows than max_rows is -EINVAL with a message; rows outside the
 *     call's groups are not written.
 */
#include "worker/expert_exec.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/threadpool.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"

#define XE_TOL 1e-3 /* batch vs per-row rounding, relative to the output's max magnitude */

struct xe_model {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
};

static int xe_open(struct xe_model *xm, uint32_t type)
{
    snprintf(xm->path, sizeof(xm->path), "/tmp/test_expert_exec_%d_%u.gguf", (int)getpid(), type);
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = type, .seed = 11,
                              .path = xm->path, .threads = 1};
    if (synth_write(&sc))
        return -1;
    struct gguf_config gc = {.path = xm->path};
    xm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = xm->g};
    xm->m = xm->g ? arch_load(&ac) : NULL;
    return xm->m ? 0 : -1;
}

static void xe_close(struct xe_model *xm)
{
    arch_free(xm->m);
    gguf_close(xm->g);
    unlink(xm->path);
}

static uint64_t xe_rng = 99;

static float xe_uniform(void)
{
    uint64_t z = (xe_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Reference of one group of S rows: per-row matvec_rows (batch = false) or
 * one matvec_rows_batch over the group (batch = true; S == 1 is the same). */
static void xe_reference(const struct arch_layer *ly, uint32_t e, const float *X, uint32_t S,
                         bool batch, float *Y)
{
    const uint64_t n = ly->gate_exps.n_in, F = ly->gate_exps.n_out;
    const uint8_t *gw = arch_matrix_expert(&ly->gate_exps, e);
    const uint8_t *uw = arch_matrix_expert(&ly->up_exps, e);
    const uint8_t *dw = arch_matrix_expert(&ly->down_exps, e);
    float *g = malloc(S * F * sizeof(float)), *u = malloc(S * F * sizeof(float));
    float *a = malloc(S * F * sizeof(float));
    if (batch && S >= 2) {
        matvec_rows_batch(ly->gate_exps.type, gw, ly->gate_exps.row_bytes, X, n, S, n, g, F, 0, F);
        matvec_rows_batch(ly->up_exps.type, uw, ly->up_exps.row_bytes, X, n, S, n, u, F, 0, F);
    } else {
        for (uint32_t s = 0; s < S; s++) {
            matvec_rows(ly->gate_exps.type, gw, ly->gate_exps.row_bytes, X + s * n, n, g + s * F,
                        0, F);
            matvec_rows(ly->up_exps.type, uw, ly->up_exps.row_bytes, X + s * n, n, u + s * F, 0,
                        F);
        }
    }
    for (uint64_t i = 0; i < S * F; i++)
        a[i] = ops_silu(g[i]) * u[i];
    if (batch && S >= 2) {
        matvec_rows_batch(ly->down_exps.type, dw, ly->down_exps.row_bytes, a, F, S, F, Y, n, 0, n);
    } else {
        for (uint32_t s = 0; s < S; s++)
            matvec_rows(ly->down_exps.type, dw, ly->down_exps.row_bytes, a + s * F, F, Y + s * n,
                        0, n);
    }
    free(g);
    free(u);
    free(a);
}

/* One call layout: groups of given experts and sizes. */
struct xe_call {
    uint32_t n_groups;
    uint32_t experts[8];
    uint32_t counts[8];
};

static const struct xe_call xe_calls[] = {
    {1, {3}, {1}},
    {1, {0}, {5}},
    {5, {0, 1, 2, 3, 4}, {1, 2, 3, 4, 5}},
    {5, {7, 2, 7, 5, 6}, {5, 4, 3, 2, 1}},
    {8, {0, 1, 2, 3, 4, 5, 6, 7}, {2, 1, 1, 3, 1, 5, 4, 2}},
    {3, {6, 6, 6}, {1, 1, 1}},
};

/* Runs every call on layer l with x1 (1 thread) and x2 (2 threads); checks
 * against the references. Returns the worst relative batch-vs-row diff. */
static double xe_layer(const struct arch_model *m, uint32_t l, struct expert_exec *x1,
                       struct expert_exec *x2)
{
    const struct arch_layer *ly = &m->layers[l];
    const uint32_t n = m->hp.n_embd;
    double worst = 0;
    for (size_t c = 0; c < sizeof(xe_calls) / sizeof(xe_calls[0]); c++) {
        const struct xe_call *call = &xe_calls[c];
        uint32_t rows = 0;
        struct expert_ref refs[8];
        for (uint32_t g = 0; g < call->n_groups; g++) {
            rows += call->counts[g];
            refs[g] = expert_exec_model_ref(ly, call->experts[g]);
        }
        float *X = malloc((size_t)rows * n * sizeof(float));
        float *Y1 = malloc((size_t)(rows + 1) * n * sizeof(float));
        float *Y2 = malloc((size_t)(rows + 1) * n * sizeof(float));
        float *R = malloc((size_t)rows * n * sizeof(float));
        float *Rr = malloc((size_t)rows * n * sizeof(float));
        for (size_t i = 0; i < (size_t)rows * n; i++)
            X[i] = xe_uniform();
        for (size_t i = 0; i < (size_t)(rows + 1) * n; i++)
            Y1[i] = Y2[i] = 12345.0f;
        CHECK(expert_exec_run(x1, ly, refs, call->counts, call->n_groups, X, Y1) == 0,
              "layer %u call %zu: run (1 thread)", l, c);
        CHECK(expert_exec_run(x2, ly, refs, call->counts, call->n_groups, X, Y2) == 0,
              "layer %u call %zu: run (2 threads)", l, c);
        CHECK(memcmp(Y1, Y2, (size_t)rows * n * sizeof(float)) == 0,
              "layer %u call %zu: 1 and 2 threads differ", l, c);
        CHECK(Y1[(size_t)rows * n] == 12345.0f && Y2[(size_t)rows * n] == 12345.0f,
              "layer %u call %zu: wrote past the last row", l, c);
        for (uint32_t g = 0, a = 0; g < call->n_groups; a += call->counts[g++]) {
            const uint32_t S = call->counts[g], e = call->experts[g];
            const float *Xg = X + (size_t)a * n;
            xe_reference(ly, e, Xg, S, true, R + (size_t)a * n);
            xe_reference(ly, e, Xg, S, false, Rr + (size_t)a * n);
            CHECK(memcmp(Y1 + (size_t)a * n, R + (size_t)a * n, (size_t)S * n * sizeof(float)) == 0,
                  "layer %u call %zu group %u (expert %u, %u rows): not bit-identical to the %s "
                  "reference", l, c, g, e, S, S == 1 ? "matvec_rows" : "matvec_rows_batch");
            double mx = 0, d = 0;
            for (size_t i = (size_t)a * n; i < (size_t)(a + S) * n; i++) {
                mx = fmax(mx, fabs(Rr[i]));
                d = fmax(d, fabs((double)Y1[i] - Rr[i]));
            }
            if (S == 1)
                CHECK(d == 0, "layer %u: one-row group differs from matvec_rows by %g", l, d);
            worst = fmax(worst, d / fmax(mx, 1e-30));
            CHECK(d <= XE_TOL * mx, "layer %u call %zu group %u: %g from the per-row reference "
                  "(scale %g)", l, c, g, d, mx);
        }
        free(X);
        free(Y1);
        free(Y2);
        free(R);
        free(Rr);
    }
    return worst;
}

/* Fused gate_up stacks and copied weights give the separate stacks' bits. */
static void xe_fused(const struct arch_model *m, uint32_t l, struct expert_exec *x)
{
    const struct arch_layer *ly = &m->layers[l];
    const uint32_t n = m->hp.n_embd, E = m->hp.n_expert, F = m->hp.n_ff_exp;
    const size_t gb = ly->gate_exps.mat_bytes, db = ly->down_exps.mat_bytes;
    uint8_t *fused = malloc(2 * gb * E), *copy = malloc((2 * gb + db) * E);
    struct arch_layer fl = *ly;
    memset(&fl.gate_exps, 0, sizeof(fl.gate_exps));
    memset(&fl.up_exps, 0, sizeof(fl.up_exps));
    fl.gate_up_exps = ly->gate_exps;
    fl.gate_up_exps.data = fused;
    fl.gate_up_exps.n_out = 2 * (uint64_t)F;
    fl.gate_up_exps.mat_bytes = 2 * gb;
    struct expert_ref fref[8], cref[8], mref[8];
    const uint32_t experts[4] = {1, 4, 5, 7}, counts[4] = {1, 3, 2, 5};
    for (uint32_t e = 0; e < E; e++) {
        memcpy(fused + 2 * gb * e, arch_matrix_expert(&ly->gate_exps, e), gb);
        memcpy(fused + 2 * gb * e + gb, arch_matrix_expert(&ly->up_exps, e), gb);
        uint8_t *c = copy + (2 * gb + db) * e;
        memcpy(c, arch_matrix_expert(&ly->gate_exps, e), gb);
        memcpy(c + gb, arch_matrix_expert(&ly->up_exps, e), gb);
        memcpy(c + 2 * gb, arch_matrix_expert(&ly->down_exps, e), db);
    }
    for (int g = 0; g < 4; g++) {
        const uint32_t e = experts[g];
        mref[g] = expert_exec_model_ref(ly, e);
        fref[g] = expert_exec_model_ref(&fl, e);
        uint8_t *c = copy + (2 * gb + db) * e;
        cref[g] = (struct expert_ref){.gate = c, .up = c + gb, .down = c + 2 * gb};
    }
    CHECK(fref[0].gate == fused + 2 * gb * 1 && fref[0].up == NULL &&
              fref[0].down == mref[0].down, "fused model ref");
    CHECK(mref[1].gate == ly->gate_exps.data + gb * 4 && mref[1].up == ly->up_exps.data + gb * 4 &&
              mref[1].down == ly->down_exps.data + db * 4, "model ref pointers");
    const uint32_t rows = 11;
    float *X = malloc(rows * n * sizeof(float)), *Ym = malloc(rows * n * sizeof(float));
    float *Yf = malloc(rows * n * sizeof(float)), *Yc = malloc(rows * n * sizeof(float));
    for (size_t i = 0; i < (size_t)rows * n; i++)
        X[i] = xe_uniform();
    CHECK(expert_exec_run(x, ly, mref, counts, 4, X, Ym) == 0, "separate run");
    CHECK(expert_exec_run(x, &fl, fref, counts, 4, X, Yf) == 0, "fused run");
    CHECK(expert_exec_run(x, ly, cref, counts, 4, X, Yc) == 0, "copied-weights run");
    CHECK(memcmp(Ym, Yf, rows * n * sizeof(float)) == 0, "fused gate_up differs from separate");
    CHECK(memcmp(Ym, Yc, rows * n * sizeof(float)) == 0, "copied weights differ from the model's");
    free(X);
    free(Ym);
    free(Yf);
    free(Yc);
    free(fused);
    free(copy);
}

static void xe_model_case(uint32_t type, struct threadpool *p1, struct threadpool *p2)
{
    struct xe_model xm = {0};
    CHECK(xe_open(&xm, type) == 0, "tiny %s model: %s", quant_type_name(type), log_last_error());
    if (!xm.m) {
        xe_close(&xm);
        return;
    }
    const struct arch_hparams *hp = &xm.m->hp;
    struct expert_exec_config c1 = {.pool = p1, .n_embd = hp->n_embd, .n_ff = hp->n_ff_exp,
                                    .max_rows = 40};
    struct expert_exec_config c2 = c1;
    c2.pool = p2;
    struct expert_exec *x1 = expert_exec_create(&c1), *x2 = expert_exec_create(&c2);
    CHECK(x1 && x2, "expert_exec_create");
    double worst = 0;
    for (uint32_t l = 0; x1 && x2 && l < hp->n_layer; l++)
        worst = fmax(worst, xe_layer(xm.m, l, x1, x2));
    MEASURE("%s: grouped experts bit-identical to the matvec references and across 1/2 threads; "
            "batch vs per-row path: worst relative diff %.3g", quant_type_name(type), worst);
    if (x1 && x2) {
        xe_fused(xm.m, 0, x1);
        xe_fused(xm.m, 3, x2);
        /* more rows than the scratch holds */
        const uint32_t counts[2] = {30, 11};
        struct expert_ref refs[2] = {expert_exec_model_ref(&xm.m->layers[0], 0),
                                     expert_exec_model_ref(&xm.m->layers[0], 1)};
        float *X = calloc(41 * hp->n_embd, sizeof(float)), *Y = calloc(41 * hp->n_embd, 4);
        CHECK(expert_exec_run(x1, &xm.m->layers[0], refs, counts, 2, X, Y) == -EINVAL,
              "41 rows with max_rows 40 accepted");
        CHECK(strstr(log_last_error(), "41 rows") != NULL, "message: %s", log_last_error());
        const uint32_t ok[2] = {29, 11};
        CHECK(expert_exec_run(x1, &xm.m->layers[0], refs, ok, 2, X, Y) == 0, "40 rows rejected");
        free(X);
        free(Y);
    }
    expert_exec_destroy(x1);
    expert_exec_destroy(x2);
    expert_exec_destroy(NULL);
    xe_close(&xm);
}

int main(void)
{
    log_init("test", -1);
    struct threadpool_config t1 = {.n_threads = 1, .pin = false};
    struct threadpool_config t2 = {.n_threads = 2, .pin = false};
    struct threadpool *p1 = threadpool_create(&t1), *p2 = threadpool_create(&t2);
    CHECK(p1 && p2, "pools");
    if (p1 && p2) {
        xe_model_case(QUANT_TYPE_Q8_0, p1, p2);
        xe_model_case(QUANT_TYPE_Q4_0, p1, p2);
        xe_model_case(QUANT_TYPE_F16, p1, p2);
    }
    threadpool_destroy(p1);
    threadpool_destroy(p2);
    return test_main_result("test_expert_exec");
}
