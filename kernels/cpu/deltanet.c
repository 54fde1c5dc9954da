/*
 * deltanet: conv, delta rule and gated norm of the gated DeltaNet layer
 * (see deltanet.h).
 *
 * The chunked form follows transformers' torch_chunk_gated_delta_rule step by
 * step in float32. Every matrix product sums its inner dimension in ascending
 * order with a float accumulator; the loops are written as row updates
 * (dn_axpy: y[:] += x * row[:]) so that they vectorise without reordering
 * any sum.
 * Padding the last chunk with zero tokens, as transformers does, only adds
 * exact zeros, so the code works on the n real tokens of each chunk instead.
 */
#include "kernels/cpu/deltanet.h"

#include <math.h>
#include <string.h>

#include "common/check.h"

#include "kernels/cpu/ops.h"

void deltanet_conv_channel(float *state, const float *w, uint32_t K, const float *x,
                           size_t x_stride, float *u, size_t u_stride, uint32_t S)
{
    for (uint32_t s = 0; s < S; s++) {
        const float xs = x[s * x_stride];
        float acc = 0.0f;
        for (uint32_t t = 0; t + 1 < K; t++)
            acc += w[t] * state[t];
        acc += w[K - 1] * xs;
        for (uint32_t t = 0; t + 2 < K; t++)
            state[t] = state[t + 1];
        if (K > 1)
            state[K - 2] = xs;
        u[s * u_stride] = ops_silu(acc);
    }
}

void deltanet_head_step(float *state, const float *q, const float *k, const float *v, float beta,
                        float gdec, uint32_t dk, uint32_t dv, float *o)
{
    const float decay = expf(gdec);
    for (uint32_t j = 0; j < dv; j++) {
        float *row = state + (size_t)j * dk;
        float mem = 0.0f;
        for (uint32_t i = 0; i < dk; i++) {
            row[i] *= decay;
            mem += row[i] * k[i];
        }
        const float d = (v[j] - mem) * beta;
        float acc = 0.0f;
        for (uint32_t i = 0; i < dk; i++) {
            row[i] += k[i] * d;
            acc += row[i] * q[i];
        }
        o[j] = acc;
    }
}

/* Views into the caller's scratch for one chunk; c = DELTANET_CHUNK. */
struct dn_chunk {
    uint32_t dk, dv; /* head sizes */
    uint32_t n;      /* real tokens in this chunk, 1..c */
    float *q;        /* c x dk: q * scale, later times exp(g) */
    float *k;        /* dk x c: k transposed */
    float *kb;       /* c x dk: k * beta, later times exp(g) */
    float *vb;       /* c x dv: v * beta */
    float *val;      /* c x dv: A @ v_beta, then v_new */
    float *kcd;      /* c x dk: k_cumdecay = A @ (k_beta * exp(g)) */
    float *st;       /* dk x dv: the state, key-major (transformers' layout) */
    float *dm;       /* c x c: decay mask exp(g_t - g_u), u <= t */
    float *a;        /* c x c: the WY matrix A (lower triangle, unit diagonal) */
    float *at;       /* c x c: (q k^T) * decay mask, u <= t */
    float *g;        /* c: cumulative log-decay within the chunk */
    float *eg;       /* c: exp(g) */
    float *w;        /* c: exp(g_last - g) */
    float *row;      /* c: copy of one row of A during the solve */
    float *sum;      /* c: the solve's accumulators */
    float *acc;      /* dv: one output row's accumulator */
    float *inter;    /* dv: q_t * exp(g_t) @ state */
};

size_t deltanet_chunk_scratch(uint32_t dk, uint32_t dv)
{
    const size_t c = DELTANET_CHUNK;
    return 4 * c * dk + 2 * c * dv + (size_t)dk * dv + 3 * c * c + 5 * c + 2 * (size_t)dv;
}

/* y[:n] += x * r[:n], one independent sum per element; unrolled by 8 so that
 * the -O2 build's SLP vectoriser turns it into vector code. */
static void dn_axpy(float *restrict y, float x, const float *restrict r, size_t n)
{
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        y[j + 0] += x * r[j + 0];
        y[j + 1] += x * r[j + 1];
        y[j + 2] += x * r[j + 2];
        y[j + 3] += x * r[j + 3];
        y[j + 4] += x * r[j + 4];
        y[j + 5] += x * r[j + 5];
        y[j + 6] += x * r[j + 6];
        y[j + 7] += x * r[j + 7];
    }
    for (; j < n; j++)
        y[j] += x * r[j];
}

static float *dn_take(float **p, size_t n)
{
    float *r = *p;
    *p += n;
    return r;
}

static void dn_chunk_views(struct dn_chunk *ck, float *scratch, uint32_t dk, uint32_t dv)
{
    const size_t c = DELTANET_CHUNK;
    float *p = scratch;
    ck->dk = dk;
    ck->dv = dv;
    ck->q = dn_take(&p, c * dk);
    ck->k = dn_take(&p, c * dk);
    ck->kb = dn_take(&p, c * dk);
    ck->kcd = dn_take(&p, c * dk);
    ck->vb = dn_take(&p, c * dv);
    ck->val = dn_take(&p, c * dv);
    ck->st = dn_take(&p, (size_t)dk * dv);
    ck->dm = dn_take(&p, c * c);
    ck->a = dn_take(&p, c * c);
    ck->at = dn_take(&p, c * c);
    ck->g = dn_take(&p, c);
    ck->eg = dn_take(&p, c);
    ck->w = dn_take(&p, c);
    ck->row = dn_take(&p, c);
    ck->sum = dn_take(&p, c);
    ck->acc = dn_take(&p, dv);
    ck->inter = dn_take(&p, dv);
    ASSERT((size_t)(p - scratch) == deltanet_chunk_scratch(dk, dv));
}

/* Loads the chunk's q*scale, k, k*beta, v*beta, and its cumulative decays and
 * decay mask. */
static void dn_chunk_load(struct dn_chunk *ck, const float *q, size_t q_stride, const float *k,
                          size_t k_stride, const float *v, size_t v_stride, const float *beta,
                          const float *gdec)
{
    const size_t c = DELTANET_CHUNK, dk = ck->dk, dv = ck->dv;
    const float scale = (float)(1.0 / sqrt((double)dk));
    float g = 0.0f;
    for (size_t t = 0; t < ck->n; t++) {
        const float *qt = q + t * q_stride, *kt = k + t * k_stride, *vt = v + t * v_stride;
        for (size_t i = 0; i < dk; i++) {
            ck->q[t * dk + i] = qt[i] * scale;
            ck->k[i * c + t] = kt[i];
            ck->kb[t * dk + i] = kt[i] * beta[t];
        }
        for (size_t j = 0; j < dv; j++)
            ck->vb[t * dv + j] = vt[j] * beta[t];
        g += gdec[t];
        ck->g[t] = g;
        ck->eg[t] = expf(g);
    }
    for (size_t t = 0; t < ck->n; t++)
        for (size_t u = 0; u <= t; u++)
            ck->dm[t * c + u] = expf(ck->g[t] - ck->g[u]);
}

/* A = -(k_beta k^T * decay) strictly below the diagonal, then the row-by-row
 * solve A[t][:t] = row + sum_m row[m] * A[m][:t], then A + I. */
static void dn_chunk_solve(struct dn_chunk *ck)
{
    const size_t c = DELTANET_CHUNK, dk = ck->dk, n = ck->n;
    for (size_t t = 0; t < n; t++) {
        float *ar = ck->a + t * c;
        memset(ar, 0, t * sizeof(float));
        for (size_t i = 0; i < dk; i++) {
            const float x = ck->kb[t * dk + i];
            const float *kr = ck->k + i * c;
            dn_axpy(ar, x, kr, t);
        }
        for (size_t u = 0; u < t; u++)
            ar[u] = -(ar[u] * ck->dm[t * c + u]);
    }
    /* A[m][u] is zero for u >= m, so the sum over m for column u starts at
     * u + 1; the skipped terms are exact zeros. */
    for (size_t t = 1; t < n; t++) {
        float *ar = ck->a + t * c;
        memcpy(ck->row, ar, t * sizeof(float));
        memset(ck->sum, 0, t * sizeof(float));
        for (size_t m = 1; m < t; m++) {
            const float x = ck->row[m];
            const float *am = ck->a + m * c;
            dn_axpy(ck->sum, x, am, m);
        }
        for (size_t u = 0; u < t; u++)
            ar[u] = ck->row[u] + ck->sum[u];
    }
    for (size_t t = 0; t < n; t++)
        ck->a[t * c + t] = 1.0f;
}

/* out[t][:] = sum_{u <= t} A[t][u] * x[u][:] for t < n (row length d). */
static void dn_chunk_lower_mul(const struct dn_chunk *ck, const float *x, size_t d, float *out)
{
    const size_t c = DELTANET_CHUNK;
    for (size_t t = 0; t < ck->n; t++) {
        float *orow = out + t * d;
        memset(orow, 0, d * sizeof(float));
        for (size_t u = 0; u <= t; u++) {
            const float a = ck->a[t * c + u];
            const float *xr = x + u * d;
            dn_axpy(orow, a, xr, d);
        }
    }
}

/* acc[:] = sum_i x[i] * st[i][:] (x has dk entries). */
static void dn_chunk_state_mul(const struct dn_chunk *ck, const float *x, float *acc)
{
    const size_t dk = ck->dk, dv = ck->dv;
    memset(acc, 0, dv * sizeof(float));
    for (size_t i = 0; i < dk; i++) {
        const float xi = x[i];
        const float *sr = ck->st + i * dv;
        dn_axpy(acc, xi, sr, dv);
    }
}

/* The intra-chunk attention at = (q k^T) * decay mask, u <= t; then q *= exp(g). */
static void dn_chunk_attn(struct dn_chunk *ck)
{
    const size_t c = DELTANET_CHUNK, dk = ck->dk;
    for (size_t t = 0; t < ck->n; t++) {
        float *ar = ck->at + t * c;
        memset(ar, 0, (t + 1) * sizeof(float));
        for (size_t i = 0; i < dk; i++) {
            const float x = ck->q[t * dk + i];
            const float *kr = ck->k + i * c;
            dn_axpy(ar, x, kr, t + 1);
        }
        for (size_t u = 0; u <= t; u++)
            ar[u] *= ck->dm[t * c + u];
        for (size_t i = 0; i < dk; i++)
            ck->q[t * dk + i] *= ck->eg[t];
    }
}

/* Per token t: v_new[t] = value[t] - k_cumdecay[t] @ S0, then
 * o[t] = (q[t] * exp(g[t])) @ S0 + sum_{u <= t} at[t][u] * v_new[u]. */
static void dn_chunk_output(struct dn_chunk *ck, float *o, size_t o_stride)
{
    const size_t c = DELTANET_CHUNK, dk = ck->dk, dv = ck->dv;
    for (size_t t = 0; t < ck->n; t++) {
        float *vn = ck->val + t * dv;
        dn_chunk_state_mul(ck, ck->kcd + t * dk, ck->acc);
        for (size_t j = 0; j < dv; j++)
            vn[j] -= ck->acc[j];
        dn_chunk_state_mul(ck, ck->q + t * dk, ck->inter);
        memset(ck->acc, 0, dv * sizeof(float));
        for (size_t u = 0; u <= t; u++) {
            const float a = ck->at[t * c + u];
            const float *vr = ck->val + u * dv;
            dn_axpy(ck->acc, a, vr, dv);
        }
        float *ot = o + t * o_stride;
        for (size_t j = 0; j < dv; j++)
            ot[j] = ck->inter[j] + ck->acc[j];
    }
}

/* S0 = S0 * exp(g_last) + (k * exp(g_last - g))^T @ v_new. */
static void dn_chunk_update(struct dn_chunk *ck)
{
    const size_t c = DELTANET_CHUNK, dv = ck->dv, n = ck->n;
    const float glast = ck->g[n - 1], decay = expf(glast);
    for (size_t t = 0; t < n; t++)
        ck->w[t] = expf(glast - ck->g[t]);
    for (size_t i = 0; i < ck->dk; i++) {
        memset(ck->acc, 0, dv * sizeof(float));
        for (size_t t = 0; t < n; t++) {
            const float x = ck->k[i * c + t] * ck->w[t];
            const float *vr = ck->val + t * dv;
            dn_axpy(ck->acc, x, vr, dv);
        }
        float *sr = ck->st + i * dv;
        for (size_t j = 0; j < dv; j++)
            sr[j] = sr[j] * decay + ck->acc[j];
    }
}

void deltanet_chunk_head(float *state, const float *q, size_t q_stride, const float *k,
                         size_t k_stride, const float *v, size_t v_stride, const float *beta,
                         const float *gdec, uint32_t S, uint32_t dk, uint32_t dv, float *o,
                         size_t o_stride, float *scratch)
{
    ASSERT(dk > 0 && dv > 0);
    if (S == 0)
        return;
    struct dn_chunk ck;
    dn_chunk_views(&ck, scratch, dk, dv);
    for (size_t i = 0; i < dk; i++)
        for (size_t j = 0; j < dv; j++)
            ck.st[i * dv + j] = state[j * dk + i];
    for (size_t s0 = 0; s0 < S; s0 += DELTANET_CHUNK) {
        ck.n = S - s0 < DELTANET_CHUNK ? (uint32_t)(S - s0) : DELTANET_CHUNK;
        dn_chunk_load(&ck, q + s0 * q_stride, q_stride, k + s0 * k_stride, k_stride,
                      v + s0 * v_stride, v_stride, beta + s0, gdec + s0);
        dn_chunk_solve(&ck);
        dn_chunk_lower_mul(&ck, ck.vb, dv, ck.val);
        for (size_t u = 0; u < ck.n; u++)
            for (size_t i = 0; i < dk; i++)
                ck.kb[u * dk + i] *= ck.eg[u];
        dn_chunk_lower_mul(&ck, ck.kb, dk, ck.kcd);
        dn_chunk_attn(&ck);
        dn_chunk_output(&ck, o + s0 * o_stride, o_stride);
        dn_chunk_update(&ck);
    }
    for (size_t i = 0; i < dk; i++)
        for (size_t j = 0; j < dv; j++)
            state[j * dk + i] = ck.st[i * dv + j];
}

void deltanet_gated_norm(float *y, const float *o, const float *z, const float *w, uint32_t dv,
                         float eps)
{
    ops_rmsnorm(y, o, w, dv, eps);
    for (uint32_t j = 0; j < dv; j++)
        y[j] *= ops_silu(z[j]);
}
