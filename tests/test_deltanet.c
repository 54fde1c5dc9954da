/*
 * test_deltanet: the gated DeltaNet kernels against direct evaluations. The
 * chunked prefill (deltanet_chunk_head) gives the outputs and final state of
 * deltanet_head_step run token by token, for head sizes 16 and 64, lengths
 * around the chunk size, strong and mild decay, zero and random initial state,
 * strided inputs, and a sequence split over two calls; both float forms are
 * also measured against a double-precision recurrence. The causal conv and the
 * gated norm are checked against their formulas in double.
 */
#include "kernels/cpu/deltanet.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "tests/check.h"

/* Bound on max |chunked - recurrent| relative to the largest recurrent magnitude. */
#define TD_TOL 1e-4
/* A value no kernel writes, to detect writes outside their buffers. */
#define TD_CANARY 12345.0f

/* splitmix64 stream of the test's random inputs. */
struct td_rng {
    uint64_t s;
};

static double td_uniform(struct td_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static float td_range(struct td_rng *r, double lo, double hi)
{
    return (float)(lo + (hi - lo) * td_uniform(r));
}

static void td_unit(struct td_rng *r, float *x, uint32_t n)
{
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        x[i] = td_range(r, -1.0, 1.0);
        sum += (double)x[i] * x[i];
    }
    const float inv = (float)(1.0 / sqrt(sum));
    for (uint32_t i = 0; i < n; i++)
        x[i] *= inv;
}

static double td_max_abs(const float *x, size_t n, size_t stride, size_t row)
{
    double m = 0.0;
    for (size_t s = 0; s < n; s++)
        for (size_t j = 0; j < row; j++)
            m = fmax(m, fabs((double)x[s * stride + j]));
    return m;
}

static double td_max_diff(const float *a, const float *b, size_t n, size_t stride, size_t row)
{
    double m = 0.0;
    for (size_t s = 0; s < n; s++)
        for (size_t j = 0; j < row; j++)
            m = fmax(m, fabs((double)a[s * stride + j] - (double)b[s * stride + j]));
    return m;
}

/* One case: inputs for one head, token t's q, k, v packed in a row of
 * `stride` floats (q at 0, k at dk, v at 2*dk), beta and gdec per token. */
struct td_case {
    uint32_t dk, dv, S;
    size_t stride, o_stride;
    float *in, *beta, *gdec, *state0;
};

static void td_case_fill(struct td_case *tc, struct td_rng *r, double gmin, bool zero_state)
{
    const uint32_t dk = tc->dk, dv = tc->dv;
    for (uint32_t s = 0; s < tc->S; s++) {
        float *row = tc->in + (size_t)s * tc->stride;
        td_unit(r, row, dk);
        td_unit(r, row + dk, dk);
        for (uint32_t j = 0; j < dv; j++)
            row[2 * dk + j] = td_range(r, -1.0, 1.0);
        tc->beta[s] = td_range(r, 0.001, 0.999);
        tc->gdec[s] = td_range(r, gmin, 0.0);
    }
    for (size_t i = 0; i < (size_t)dk * dv; i++)
        tc->state0[i] = zero_state ? 0.0f : td_range(r, -0.5, 0.5);
}

/* The recurrence in double: the exact answer both float forms approximate. */
static void td_recurrent_double(const struct td_case *tc, double *st, double *o)
{
    const uint32_t dk = tc->dk, dv = tc->dv;
    const double scale = 1.0 / sqrt((double)dk);
    for (size_t i = 0; i < (size_t)dk * dv; i++)
        st[i] = tc->state0[i];
    for (uint32_t s = 0; s < tc->S; s++) {
        const float *q = tc->in + (size_t)s * tc->stride, *k = q + dk, *v = q + 2 * dk;
        const double decay = exp((double)tc->gdec[s]);
        for (uint32_t j = 0; j < dv; j++) {
            double *row = st + (size_t)j * dk, mem = 0.0, acc = 0.0;
            for (uint32_t i = 0; i < dk; i++) {
                row[i] *= decay;
                mem += row[i] * k[i];
            }
            const double d = ((double)v[j] - mem) * tc->beta[s];
            for (uint32_t i = 0; i < dk; i++) {
                row[i] += k[i] * d;
                acc += row[i] * (q[i] * scale);
            }
            o[(size_t)s * dv + j] = acc;
        }
    }
}

static double td_err_double(const float *x, size_t stride, const double *ref, size_t n, size_t row,
                            double *ref_max)
{
    double m = 0.0, rm = 0.0;
    for (size_t s = 0; s < n; s++)
        for (size_t j = 0; j < row; j++) {
            m = fmax(m, fabs((double)x[s * stride + j] - ref[s * row + j]));
            rm = fmax(rm, fabs(ref[s * row + j]));
        }
    *ref_max = rm;
    return m;
}

/* Worst relative errors over all cases, for the report. */
struct td_worst {
    double chunk_vs_rec; /* chunked vs float recurrence, outputs and state */
    double chunk_vs_exact;
    double rec_vs_exact;
};

/* deltanet_head_step token by token; q scaled here, as the step expects. */
static void td_run_recurrent(const struct td_case *tc, float *st, float *o, float *qs)
{
    const uint32_t dk = tc->dk, dv = tc->dv;
    const float scale = (float)(1.0 / sqrt((double)dk));
    for (uint32_t s = 0; s < tc->S; s++) {
        const float *row = tc->in + (size_t)s * tc->stride;
        for (uint32_t i = 0; i < dk; i++)
            qs[i] = row[i] * scale;
        deltanet_head_step(st, qs, row + dk, row + 2 * dk, tc->beta[s], tc->gdec[s], dk, dv,
                           o + (size_t)s * dv);
    }
}

/* deltanet_chunk_head over all tokens, as two calls when split is in (0, S). */
static void td_run_chunked(const struct td_case *tc, uint32_t split, float *st, float *o,
                           float *scratch)
{
    const uint32_t dk = tc->dk;
    for (uint32_t s0 = 0; s0 < tc->S;) {
        const uint32_t n = split && s0 == 0 && split < tc->S ? split : tc->S - s0;
        const float *in = tc->in + (size_t)s0 * tc->stride;
        deltanet_chunk_head(st, in, tc->stride, in + dk, tc->stride, in + 2 * dk, tc->stride,
                            tc->beta + s0, tc->gdec + s0, n, dk, tc->dv,
                            o + (size_t)s0 * tc->o_stride, tc->o_stride, scratch);
        s0 += n;
    }
}

/* Runs one case both ways and checks agreement; a nonzero split runs the
 * chunked form as two calls, the first over `split` tokens. */
static void td_case_run(const struct td_case *tc, uint32_t split, struct td_worst *worst)
{
    const uint32_t dk = tc->dk, dv = tc->dv, S = tc->S;
    const size_t nst = (size_t)dk * dv, nsc = deltanet_chunk_scratch(dk, dv);
    float *st_r = malloc(nst * sizeof(float)), *st_c = malloc(nst * sizeof(float));
    float *o_r = malloc((size_t)S * dv * sizeof(float));
    float *o_c = malloc((size_t)S * tc->o_stride * sizeof(float));
    float *scratch = malloc((nsc + 16) * sizeof(float)), *qs = malloc(dk * sizeof(float));
    double *st_d = malloc(nst * sizeof(double)), *o_d = malloc((size_t)S * dv * sizeof(double));
    ASSERT(st_r && st_c && o_r && o_c && scratch && qs && st_d && o_d);
    memcpy(st_r, tc->state0, nst * sizeof(float));
    memcpy(st_c, tc->state0, nst * sizeof(float));
    for (size_t i = 0; i < (size_t)S * tc->o_stride; i++)
        o_c[i] = TD_CANARY;
    for (size_t i = nsc; i < nsc + 16; i++)
        scratch[i] = TD_CANARY;

    td_run_recurrent(tc, st_r, o_r, qs);
    td_run_chunked(tc, split, st_c, o_c, scratch);
    td_recurrent_double(tc, st_d, o_d);

    const double o_max = td_max_abs(o_r, S, dv, dv), st_max = td_max_abs(st_r, 1, 0, nst);
    double e_out = 0.0;
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t j = 0; j < dv; j++)
            e_out = fmax(e_out, fabs((double)o_c[(size_t)s * tc->o_stride + j] -
                                     (double)o_r[(size_t)s * dv + j]));
    const double e_st = td_max_diff(st_c, st_r, 1, 0, nst);
    const double rel_o = e_out / o_max, rel_st = e_st / st_max;
    CHECK(rel_o <= TD_TOL && rel_st <= TD_TOL,
          "dk %u S %u split %u: chunked vs recurrent outputs %.3g state %.3g (of max %.3g, %.3g)",
          dk, S, split, rel_o, rel_st, o_max, st_max);
    bool gap_ok = true, scratch_ok = true;
    for (uint32_t s = 0; s < S; s++)
        for (size_t j = dv; j < tc->o_stride; j++)
            gap_ok &= o_c[(size_t)s * tc->o_stride + j] == TD_CANARY;
    for (size_t i = nsc; i < nsc + 16; i++)
        scratch_ok &= scratch[i] == TD_CANARY;
    CHECK(gap_ok, "dk %u S %u: chunked form wrote between output rows", dk, S);
    CHECK(scratch_ok, "dk %u S %u: chunked form wrote past its scratch", dk, S);

    double rm_o, rm_st;
    const double xc = fmax(td_err_double(o_c, tc->o_stride, o_d, S, dv, &rm_o) / rm_o,
                           td_err_double(st_c, 0, st_d, 1, nst, &rm_st) / rm_st);
    const double xr = fmax(td_err_double(o_r, dv, o_d, S, dv, &rm_o) / rm_o,
                           td_err_double(st_r, 0, st_d, 1, nst, &rm_st) / rm_st);
    worst->chunk_vs_rec = fmax(worst->chunk_vs_rec, fmax(rel_o, rel_st));
    worst->chunk_vs_exact = fmax(worst->chunk_vs_exact, xc);
    worst->rec_vs_exact = fmax(worst->rec_vs_exact, xr);
    free(st_r), free(st_c), free(o_r), free(o_c), free(scratch), free(qs), free(st_d), free(o_d);
}

static void td_chunk_tests(struct td_rng *r)
{
    static const uint32_t dims[] = {16, 64};
    static const uint32_t lens[] = {1, 5, 64, 93, 130};
    static const double gmins[] = {-3.0, -0.1};
    for (size_t di = 0; di < 2; di++) {
        for (size_t gi = 0; gi < 2; gi++) {
            struct td_worst worst = {0};
            for (size_t li = 0; li < 5; li++) {
                for (int zero = 0; zero < 2; zero++) {
                    const uint32_t d = dims[di], S = lens[li];
                    struct td_case tc = {.dk = d, .dv = d, .S = S};
                    tc.stride = 2 * (size_t)d + d + 3;
                    tc.o_stride = d + 1;
                    tc.in = malloc((size_t)S * tc.stride * sizeof(float));
                    tc.beta = malloc(S * sizeof(float));
                    tc.gdec = malloc(S * sizeof(float));
                    tc.state0 = malloc((size_t)d * d * sizeof(float));
                    ASSERT(tc.in && tc.beta && tc.gdec && tc.state0);
                    td_case_fill(&tc, r, gmins[gi], zero);
                    td_case_run(&tc, 0, &worst);
                    if (S > 64)
                        td_case_run(&tc, S == 93 ? 40 : 70, &worst);
                    free(tc.in), free(tc.beta), free(tc.gdec), free(tc.state0);
                }
            }
            MEASURE("chunk dk=dv=%u gdec in [%g,0]: chunked vs recurrent %.3g; vs double: "
                    "chunked %.3g, recurrent %.3g (max abs error / max magnitude)",
                    dims[di], gmins[gi], worst.chunk_vs_rec, worst.chunk_vs_exact,
                    worst.rec_vs_exact);
        }
    }
}

static void td_chunk_empty(void)
{
    float state[16 * 16], before[16 * 16], scratch[1];
    for (int i = 0; i < 16 * 16; i++)
        state[i] = before[i] = (float)i;
    /* S = 0 touches nothing, not even the scratch. */
    deltanet_chunk_head(state, NULL, 16, NULL, 16, NULL, 16, NULL, NULL, 0, 16, 16, NULL, 16,
                        scratch);
    CHECK(memcmp(state, before, sizeof(state)) == 0, "S = 0 changed the state");
}

static double td_silu(double x)
{
    return x / (1.0 + exp(-x));
}

static void td_conv_test(struct td_rng *r, uint32_t K)
{
    enum { S = 10, STRIDE = 3 };
    float w[8], state[8], x[S * STRIDE], u[S * 2], ext[8 + S];
    for (uint32_t t = 0; t < K; t++)
        w[t] = td_range(r, -1.0, 1.0);
    for (uint32_t t = 0; t + 1 < K; t++)
        state[t] = ext[t] = td_range(r, -2.0, 2.0);
    for (uint32_t s = 0; s < S; s++)
        x[s * STRIDE] = ext[K - 1 + s] = td_range(r, -2.0, 2.0);
    for (uint32_t s = 0; s < S; s++)
        u[2 * s + 1] = TD_CANARY;
    deltanet_conv_channel(state, w, K, x, STRIDE, u, 2, S);
    double err = 0.0;
    bool gap_ok = true;
    for (uint32_t s = 0; s < S; s++) {
        double acc = 0.0;
        for (uint32_t t = 0; t < K; t++)
            acc += (double)w[t] * ext[s + t];
        const double want = td_silu(acc);
        err = fmax(err, fabs(u[2 * s] - want) / fmax(1.0, fabs(want)));
        gap_ok &= u[2 * s + 1] == TD_CANARY;
    }
    bool state_ok = true;
    for (uint32_t t = 0; t + 1 < K; t++)
        state_ok &= state[t] == ext[S + t];
    CHECK(err < 1e-6, "conv K=%u: max error %.3g against the direct sum", K, err);
    CHECK(gap_ok, "conv K=%u wrote between output strides", K);
    CHECK(state_ok, "conv K=%u: state is not the last K-1 inputs", K);
    MEASURE("conv K=%u: max error %.3g against double", K, err);
}

static void td_norm_test(struct td_rng *r)
{
    enum { DV = 128 };
    const float eps = 1e-6f;
    float o[DV], z[DV], w[DV], y[DV];
    double ss = 0.0;
    for (uint32_t j = 0; j < DV; j++) {
        o[j] = td_range(r, -3.0, 3.0);
        z[j] = td_range(r, -4.0, 4.0);
        w[j] = td_range(r, 0.5, 1.5);
        ss += (double)o[j] * o[j];
    }
    deltanet_gated_norm(y, o, z, w, DV, eps);
    const double inv = 1.0 / sqrt(ss / DV + eps);
    double err = 0.0;
    for (uint32_t j = 0; j < DV; j++) {
        const double want = o[j] * inv * w[j] * td_silu(z[j]);
        err = fmax(err, fabs(y[j] - want) / fmax(1.0, fabs(want)));
    }
    CHECK(err < 1e-5, "gated norm: max error %.3g against the formula", err);
    MEASURE("gated norm: max error %.3g against double", err);
}

int main(void)
{
    log_init("test", -1);
    struct td_rng r = {0x5eed0de17a11ull};
    td_conv_test(&r, 4);
    td_conv_test(&r, 2);
    td_norm_test(&r);
    td_chunk_empty();
    td_chunk_tests(&r);
    return test_main_result("test_deltanet");
}
