/*
 * test_ops: the CPU row operations against their formulas evaluated in
 * double. RMSNorm (with and without weights, in place), L2 norm, softmax
 * (sums to 1, invariant to a shift, huge inputs), SiLU, sigmoid and softplus
 * over a sweep of inputs (relative error bounds stated below); NEOX rope:
 * pair norms preserved, the closed form at positions 0, 1, 7, 4095 and 100000,
 * position 0 is the identity, dims >= n_rot untouched; the router: exact ids
 * and weights on constructed logits, ties to the lower id, k = n, and the
 * clamp of the renormalising sum.
 */
#include "kernels/cpu/ops.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "tests/check.h"

#define OPS_TOL_NORM 2e-6   /* relative, norms and softmax (f32 rounding of a few ops) */
#define OPS_TOL_ACT 4e-6    /* relative, silu / sigmoid / softplus */

static uint64_t ops_rng = 0x1234abcdull;

static double ops_uniform(void)
{
    uint64_t z = (ops_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static float ops_range(double lo, double hi)
{
    return (float)(lo + (hi - lo) * ops_uniform());
}

static double ops_rel(double got, double want)
{
    double d = fabs(got - want);
    return d / fmax(fabs(want), 1e-30);
}

static void ops_test_rmsnorm(void)
{
    static const uint32_t sizes[] = {1, 7, 64, 96, 2048};
    double worst = 0;
    for (size_t t = 0; t < sizeof(sizes) / sizeof(sizes[0]); t++) {
        const uint32_t n = sizes[t];
        float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
        float *y = malloc(n * sizeof(float)), *y2 = malloc(n * sizeof(float));
        for (uint32_t i = 0; i < n; i++) {
            x[i] = ops_range(-3, 3);
            w[i] = ops_range(0.5, 1.5);
        }
        const float eps = 1e-6f;
        double ss = 0;
        for (uint32_t i = 0; i < n; i++)
            ss += (double)x[i] * x[i];
        const double scale = 1.0 / sqrt(ss / n + eps);
        ops_rmsnorm(y, x, w, n, eps);
        ops_rmsnorm(y2, x, NULL, n, eps);
        for (uint32_t i = 0; i < n; i++) {
            double r1 = ops_rel(y[i], x[i] * scale * w[i]);
            double r2 = ops_rel(y2[i], x[i] * scale);
            worst = fmax(worst, fmax(r1, r2));
            CHECK(r1 <= OPS_TOL_NORM && r2 <= OPS_TOL_NORM, "rmsnorm n=%u i=%u: %g %g", n, i,
                  r1, r2);
        }
        /* in place gives the same bits */
        memcpy(y2, x, n * sizeof(float));
        ops_rmsnorm(y2, y2, w, n, eps);
        CHECK(memcmp(y, y2, n * sizeof(float)) == 0, "rmsnorm in place differs (n=%u)", n);
        free(x);
        free(w);
        free(y);
        free(y2);
    }
    /* all zeros: eps keeps it finite */
    float z[8] = {0}, zo[8];
    ops_rmsnorm(zo, z, NULL, 8, 1e-6f);
    for (int i = 0; i < 8; i++)
        CHECK(zo[i] == 0.0f, "rmsnorm of zeros: %g", zo[i]);
    MEASURE("rmsnorm: worst relative error vs double %.3g (bound %.0e)", worst, OPS_TOL_NORM);
}

static void ops_test_l2norm(void)
{
    const uint32_t n = 128;
    float x[128], x0[128];
    double worst = 0;
    for (int rep = 0; rep < 20; rep++) {
        double ss = 0;
        for (uint32_t i = 0; i < n; i++) {
            x0[i] = x[i] = ops_range(-2, 2) * (float)(rep + 1);
            ss += (double)x0[i] * x0[i];
        }
        const float eps = 1e-6f;
        ops_l2norm(x, n, eps);
        const double inv = 1.0 / sqrt(ss + eps);
        double nrm = 0;
        for (uint32_t i = 0; i < n; i++) {
            worst = fmax(worst, ops_rel(x[i], x0[i] * inv));
            nrm += (double)x[i] * x[i];
        }
        CHECK(fabs(sqrt(nrm) - 1.0) < 1e-5, "l2norm: norm %.9g", sqrt(nrm));
    }
    CHECK(worst <= OPS_TOL_NORM, "l2norm worst relative error %g", worst);
    /* near-zero vector: eps dominates (HF's form: x / sqrt(|x|^2 + eps)) */
    float t[2] = {1e-4f, 0.0f};
    ops_l2norm(t, 2, 1e-6f);
    const double want = 1e-4 / sqrt(1e-8 + 1e-6);
    CHECK(ops_rel(t[0], want) < 1e-5 && t[1] == 0.0f, "l2norm near zero: %g want %g", t[0], want);
    MEASURE("l2norm: worst relative error vs double %.3g", worst);
}

static void ops_test_softmax(void)
{
    static const uint32_t sizes[] = {1, 2, 5, 16, 1000};
    double worst = 0;
    for (size_t t = 0; t < sizeof(sizes) / sizeof(sizes[0]); t++) {
        const uint32_t n = sizes[t];
        float *x = malloc(n * sizeof(float)), *xs = malloc(n * sizeof(float));
        double *ref = malloc(n * sizeof(double));
        double mx = -INFINITY, sum = 0;
        for (uint32_t i = 0; i < n; i++) {
            x[i] = ops_range(-10, 10);
            xs[i] = x[i] + 1000.0f; /* shifted: same softmax, would overflow without max */
            mx = fmax(mx, x[i]);
        }
        for (uint32_t i = 0; i < n; i++)
            sum += ref[i] = exp(x[i] - mx);
        ops_softmax(x, n);
        ops_softmax(xs, n);
        double got = 0;
        for (uint32_t i = 0; i < n; i++) {
            got += x[i];
            double r = ops_rel(x[i], ref[i] / sum);
            worst = fmax(worst, r);
            CHECK(r <= OPS_TOL_NORM * 4 || fabs(x[i] - ref[i] / sum) < 1e-12, "softmax n=%u i=%u",
                  n, i);
            CHECK(isfinite(xs[i]) && fabs(xs[i] - ref[i] / sum) < 1e-4, "shifted softmax n=%u",
                  n);
        }
        CHECK(fabs(got - 1.0) < 1e-5, "softmax n=%u sums to %.9g", n, got);
        if (n == 1)
            CHECK(x[0] == 1.0f, "softmax of one value: %g", x[0]);
        free(x);
        free(xs);
        free(ref);
    }
    /* -inf entries get probability 0 */
    float m[3] = {0.0f, -INFINITY, 0.0f};
    ops_softmax(m, 3);
    CHECK(m[0] == 0.5f && m[1] == 0.0f && m[2] == 0.5f, "softmax with -inf: %g %g %g", m[0], m[1],
          m[2]);
    MEASURE("softmax: worst relative error vs double %.3g", worst);
}

static void ops_test_activations(void)
{
    double ws = 0, wg = 0, wp = 0;
    for (int i = 0; i <= 4000; i++) {
        const float x = -40.0f + i * 0.02f;
        const double xd = x;
        const double silu = xd / (1.0 + exp(-xd)), sig = 1.0 / (1.0 + exp(-xd));
        const double sp = log1p(exp(xd));
        const double rs = fabs(ops_silu(x) - silu) / fmax(fabs(silu), 1e-30);
        const double rg = ops_rel(ops_sigmoid(x), sig);
        const double rp = ops_rel(ops_softplus(x), sp);
        /* silu near 0 crosses zero: judge absolutely there */
        ws = fmax(ws, fabs(xd) < 1e-3 ? fabs(ops_silu(x) - silu) : rs);
        wg = fmax(wg, rg);
        wp = fmax(wp, rp);
    }
    CHECK(ws <= OPS_TOL_ACT, "silu worst relative error %g", ws);
    CHECK(wg <= OPS_TOL_ACT, "sigmoid worst relative error %g", wg);
    CHECK(wp <= OPS_TOL_ACT, "softplus worst relative error %g", wp);
    /* exact points and limits */
    CHECK(ops_silu(0.0f) == 0.0f && ops_sigmoid(0.0f) == 0.5f, "silu(0), sigmoid(0)");
    CHECK(ops_sigmoid(100.0f) == 1.0f && ops_sigmoid(-200.0f) == 0.0f, "sigmoid limits");
    CHECK(ops_softplus(50.0f) == 50.0f && ops_softplus(-120.0f) >= 0.0f, "softplus limits");
    CHECK(fabs(ops_softplus(0.0f) - log(2.0)) < 1e-7, "softplus(0) = %.9g", ops_softplus(0.0f));
    CHECK(ops_silu(-100.0f) <= 0.0f && ops_silu(-100.0f) > -1e-30f, "silu(-100) = %g",
          ops_silu(-100.0f));
    MEASURE("activations on [-40, 40]: worst relative error silu %.3g, sigmoid %.3g, softplus %.3g",
            ws, wg, wp);
}

static void ops_test_rope(void)
{
    static const int64_t positions[] = {0, 1, 7, 4095, 100000};
    const uint32_t hd = 32;
    static const uint32_t rots[] = {32, 8, 2};
    static const float bases[] = {10000.0f, 1e6f};
    double worst_norm = 0, worst_form = 0, worst_exact = 0;
    for (size_t ri = 0; ri < 3; ri++) {
        for (size_t bi = 0; bi < 2; bi++) {
            for (size_t pi = 0; pi < 5; pi++) {
                const uint32_t nr = rots[ri], half = nr / 2;
                const int64_t pos = positions[pi];
                const float base = bases[bi];
                float v[32], v0[32];
                for (uint32_t i = 0; i < hd; i++)
                    v0[i] = v[i] = ops_range(-2, 2);
                ops_rope_neox(v, nr, pos, base);
                for (uint32_t i = nr; i < hd; i++)
                    CHECK(v[i] == v0[i], "rope n_rot=%u pos=%lld touched dim %u", nr,
                          (long long)pos, i);
                if (pos == 0)
                    CHECK(memcmp(v, v0, sizeof(v)) == 0, "rope at position 0 is not identity");
                for (uint32_t i = 0; i < half; i++) {
                    const double a = v0[i], b = v0[i + half];
                    const double n0 = sqrt(a * a + b * b);
                    const double n1 = sqrt((double)v[i] * v[i] + (double)v[i + half] * v[i + half]);
                    worst_norm = fmax(worst_norm, fabs(n1 - n0) / fmax(n0, 1e-30));
                    /* The kernel builds theta by repeated f32 multiplication
                     * (llama.cpp's numerics). Against the f32 angle it builds,
                     * evaluated in double, only sinf/cosf round: tight. Against
                     * the exact pos * base^(-2i/n) the angle is off by a
                     * relative ~(i + 2) * 6e-8, i.e. up to ~0.1 rad at
                     * position 100000: bound by that. */
                    float tf = (float)pos;
                    const float ts = powf(base, -2.0f / (float)nr);
                    for (uint32_t j = 0; j < i; j++)
                        tf *= ts;
                    const double thf = tf, th = (double)pos * pow(base, -2.0 * i / nr);
                    const double f0 = a * cos(thf) - b * sin(thf), f1 = a * sin(thf) + b * cos(thf);
                    const double e0 = a * cos(th) - b * sin(th), e1 = a * sin(th) + b * cos(th);
                    const double errf = fmax(fabs(v[i] - f0), fabs(v[i + half] - f1));
                    const double erre = fmax(fabs(v[i] - e0), fabs(v[i + half] - e1));
                    const double tole = n0 * (fabs(th) * (i + 2) * 1.2e-7 + 2e-6) + 1e-6;
                    worst_form = fmax(worst_form, errf);
                    CHECK(errf <= 1e-6 * (1.0 + n0), "rope n_rot=%u base=%g pos=%lld pair %u: "
                          "error %g vs the f32 angle", nr, base, (long long)pos, i, errf);
                    CHECK(erre <= tole, "rope n_rot=%u base=%g pos=%lld pair %u: error %g vs "
                          "the exact angle (bound %g)", nr, base, (long long)pos, i, erre, tole);
                    if (pos <= 4095)
                        worst_exact = fmax(worst_exact, erre);
                }
            }
        }
    }
    CHECK(worst_norm <= 1e-6, "rope pair norm changed by %g", worst_norm);
    /* n_rot 2: the one pair (0, 1) turns by theta_0 = pos; dims 2, 3 stay */
    float q[4] = {1.0f, 5.0f, 0.0f, 7.0f};
    ops_rope_neox(q, 2, 0, 10000.0f);
    CHECK(q[0] == 1.0f && q[1] == 5.0f && q[2] == 0.0f && q[3] == 7.0f, "n_rot 2 at pos 0");
    float r[4] = {1.0f, 0.0f, 3.0f, 4.0f};
    ops_rope_neox(r, 2, 3, 10000.0f); /* theta_0 = 3 */
    CHECK(fabs(r[0] - cos(3.0)) < 1e-6 && fabs(r[1] - sin(3.0)) < 1e-6 && r[2] == 3.0f &&
              r[3] == 4.0f, "rope pair 0 at pos 3: (%g, %g)", r[0], r[1]);
    MEASURE("rope: worst pair-norm change %.3g; worst error vs its f32 angle %.3g, vs the exact "
            "angle at positions <= 4095 %.3g", worst_norm, worst_form, worst_exact);
}

/* Router on logits whose softmax is known: checks ids and weights. */
static void ops_router_case(const char *what, const float *logits, uint32_t n, uint32_t k,
                            const int32_t *want_ids)
{
    int32_t ids[64];
    float w[64], copy[64];
    memcpy(copy, logits, n * sizeof(float));
    ops_router_topk(logits, n, k, ids, w);
    CHECK(memcmp(copy, logits, n * sizeof(float)) == 0, "%s: logits modified", what);
    double mx = -INFINITY, z = 0;
    for (uint32_t i = 0; i < n; i++)
        mx = fmax(mx, logits[i]);
    for (uint32_t i = 0; i < n; i++)
        z += exp(logits[i] - mx);
    double sel = 0;
    for (uint32_t i = 0; i < k; i++) {
        CHECK(ids[i] == want_ids[i], "%s: slot %u id %d, want %d", what, i, ids[i], want_ids[i]);
        sel += exp(logits[want_ids[i]] - mx) / z;
    }
    const double denom = fmax(sel, 6.103515625e-5);
    double wsum = 0;
    for (uint32_t i = 0; i < k; i++) {
        const double want = exp(logits[want_ids[i]] - mx) / z / denom;
        CHECK(fabs(w[i] - want) <= 2e-6 * fmax(want, 1e-3), "%s: slot %u weight %.9g, want %.9g",
              what, i, w[i], want);
        wsum += w[i];
        if (i)
            CHECK(w[i] <= w[i - 1], "%s: weights not descending at %u", what, i);
    }
    if (sel >= 6.103515625e-5)
        CHECK(fabs(wsum - 1.0) < 1e-5, "%s: weights sum to %.9g", what, wsum);
}

static void ops_test_router(void)
{
    /* distinct logits: order by value */
    const float a[8] = {0.1f, 2.0f, -1.0f, 3.5f, 0.0f, 1.0f, 2.5f, -3.0f};
    ops_router_case("distinct k=1", a, 8, 1, (const int32_t[]){3});
    ops_router_case("distinct k=3", a, 8, 3, (const int32_t[]){3, 6, 1});
    ops_router_case("distinct k=n", a, 8, 8, (const int32_t[]){3, 6, 1, 5, 0, 4, 2, 7});
    /* ties: lower id first, also when the tie straddles the cut */
    const float b[6] = {1.0f, 2.0f, 2.0f, 0.5f, 2.0f, 1.0f};
    ops_router_case("ties k=2", b, 6, 2, (const int32_t[]){1, 2});
    ops_router_case("ties k=3", b, 6, 3, (const int32_t[]){1, 2, 4});
    ops_router_case("ties k=5", b, 6, 5, (const int32_t[]){1, 2, 4, 0, 5});
    const float c[5] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    ops_router_case("all equal k=2", c, 5, 2, (const int32_t[]){0, 1});
    ops_router_case("all equal k=n", c, 5, 5, (const int32_t[]){0, 1, 2, 3, 4});
    /* the best at the end, the worst at the start */
    const float d[4] = {-5.0f, -1.0f, 0.0f, 9.0f};
    ops_router_case("best last", d, 4, 2, (const int32_t[]){3, 2});
    /* k = n = 1 */
    const float e[1] = {-7.0f};
    ops_router_case("n=1", e, 1, 1, (const int32_t[]){0});
    /* -0 equals +0 (lower id first); NaN comes after every other logit, -inf
     * included, so that the ids stay experts */
    const float z[4] = {-1.0f, -0.0f, 0.0f, -2.0f};
    ops_router_case("signed zeros", z, 4, 2, (const int32_t[]){1, 2});
    {
        const float q[5] = {NAN, 1.0f, -INFINITY, NAN, 3.0f};
        int32_t qi[5];
        float qw[5];
        ops_router_topk(q, 5, 3, qi, qw);
        CHECK(qi[0] == 4 && qi[1] == 1 && qi[2] == 2, "NaN logits: ids %d %d %d", qi[0], qi[1],
              qi[2]);
        CHECK(qw[2] == 0.0f && fabsf(qw[0] + qw[1] - 1.0f) < 1e-6f,
              "NaN logits (none picked): weights %g %g %g", qw[0], qw[1], qw[2]);
        ops_router_topk(q, 5, 5, qi, qw);
        CHECK(qi[3] == 0 && qi[4] == 3 && qw[0] != qw[0],
              "NaN logits picked last, lower id first: ids %d %d, weight %g", qi[3], qi[4],
              qw[0]);
    }
    /* k = n: the selected mass is 1, weights are the probabilities */
    const float f[3] = {0.0f, 0.0f, 30.0f};
    int32_t ids[3];
    float w[3];
    ops_router_topk(f, 3, 3, ids, w);
    CHECK(ids[0] == 2 && ids[1] == 0 && ids[2] == 1, "k=n ids %d %d %d", ids[0], ids[1], ids[2]);
    CHECK(fabs(w[0] - 1.0) < 1e-6 && w[1] == w[2], "k=n weights %g %g %g", w[0], w[1], w[2]);
    /* The clamp: the top-k always hold at least k/n of the mass, so the sum
     * falls below 6.103515625e-5 only for n > 16384 k. With 20000 equal
     * logits and k = 1 the mass is 5e-5: the weight is 5e-5 / 6.1035e-5,
     * not 1. With k = 2 the mass 1e-4 is above the clamp: weights 1/2. */
    const uint32_t big = 20000;
    float *g = calloc(big, sizeof(float));
    int32_t gid[2];
    float gw[2];
    ops_router_topk(g, big, 1, gid, gw);
    const double p = 1.0 / big;
    CHECK(gid[0] == 0, "clamp case id %d", gid[0]);
    CHECK(fabs(gw[0] - p / 6.103515625e-5) < 1e-5, "clamped weight %.9g, want %.9g", gw[0],
          p / 6.103515625e-5);
    ops_router_topk(g, big, 2, gid, gw); /* mass 1e-4 > clamp: plain renormalisation */
    CHECK(gid[0] == 0 && gid[1] == 1 && fabs(gw[0] - 0.5) < 1e-6 && fabs(gw[1] - 0.5) < 1e-6,
          "unclamped pair: ids %d %d weights %g %g", gid[0], gid[1], gw[0], gw[1]);
    free(g);

    /* random logits, k = 4 of 16, against a sort in double */
    int bad = 0;
    for (int rep = 0; rep < 200; rep++) {
        float l[16];
        int32_t want[16];
        for (int i = 0; i < 16; i++) {
            l[i] = (float)(int)(ops_range(-4, 4) * 4) / 4.0f; /* quarter steps: many ties */
            want[i] = i;
        }
        for (int i = 1; i < 16; i++) /* insertion sort: value desc, id asc */
            for (int j = i; j > 0 && l[want[j]] > l[want[j - 1]]; j--) {
                int32_t t = want[j];
                want[j] = want[j - 1];
                want[j - 1] = t;
            }
        int32_t got[4];
        float gw4[4];
        ops_router_topk(l, 16, 4, got, gw4);
        bad += memcmp(got, want, sizeof(got)) != 0;
    }
    CHECK(bad == 0, "random router cases with ties: %d of 200 differ from a stable sort", bad);
}

int main(void)
{
    log_init("test", -1);
    ops_test_rmsnorm();
    ops_test_l2norm();
    ops_test_softmax();
    ops_test_activations();
    ops_test_rope();
    ops_test_router();
    return test_main_result("test_ops");
}
