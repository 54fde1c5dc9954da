/*
 * test_attention: attention_head against a double-precision evaluation of
 * softmax(q.K * scale) . V, for f32 caches and f16 caches built with
 * quant_f32_to_f16 (the reference then reads the same halves back, so both
 * sides see identical K and V), head dims 16, 64 and 128, n_kv 1 (output = V
 * of the only position), 7, 100 and 3000, a cache stride wider than the head
 * (interleaved heads, as the KV cache stores them) whose other bytes are
 * poisoned, and a one-hot case (one key aligned with q and a large scale:
 * the output is that position's V). Bounds: 2e-6 of max |V| (f32) and the
 * same for f16 (the halves are exact inputs for the reference).
 */
#include "kernels/cpu/attention.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "model/quant.h"
#include "tests/check.h"

#define ATT_TOL 2e-6 /* max |out - ref| / max |V| */

static uint64_t att_rng = 0x5eed5eedull;

static float att_range(double lo, double hi)
{
    uint64_t z = (att_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(lo + (hi - lo) * (double)(z >> 11) * (1.0 / 9007199254740992.0));
}

/* A cache of n_kv positions, `stride` elements apart, the head at offset
 * `off` in each; other elements hold NaN (f32) or a NaN half. */
struct att_cache {
    float *kf, *vf;     /* the values as f32 (exactly the halves for f16) */
    void *k, *v;        /* what the kernel reads */
};

static void att_fill(struct att_cache *c, bool f16, uint32_t n_kv, uint32_t hd, size_t stride,
                     size_t off, float vscale)
{
    const size_t total = (size_t)n_kv * stride;
    const size_t esz = f16 ? 2 : 4;
    c->kf = malloc(total * sizeof(float));
    c->vf = malloc(total * sizeof(float));
    c->k = malloc(total * esz);
    c->v = malloc(total * esz);
    for (size_t i = 0; i < total; i++) {
        const bool in_head = i % stride >= off && i % stride < off + hd;
        float kx = in_head ? att_range(-1, 1) : NAN;
        float vx = in_head ? att_range(-vscale, vscale) : NAN;
        if (f16) {
            uint16_t kh = in_head ? quant_f32_to_f16(kx) : 0x7e00;
            uint16_t vh = in_head ? quant_f32_to_f16(vx) : 0x7e00;
            ((uint16_t *)c->k)[i] = kh;
            ((uint16_t *)c->v)[i] = vh;
            kx = quant_f16_to_f32(kh);
            vx = quant_f16_to_f32(vh);
        } else {
            ((float *)c->k)[i] = kx;
            ((float *)c->v)[i] = vx;
        }
        c->kf[i] = kx;
        c->vf[i] = vx;
    }
}

static void att_free(struct att_cache *c)
{
    free(c->kf);
    free(c->vf);
    free(c->k);
    free(c->v);
}

static void att_ref(const float *q, const struct att_cache *c, size_t stride, size_t off,
                    uint32_t n_kv, uint32_t hd, float scale, double *out)
{
    double *s = malloc(n_kv * sizeof(double));
    double mx = -INFINITY, sum = 0;
    for (uint32_t p = 0; p < n_kv; p++) {
        double d = 0;
        for (uint32_t i = 0; i < hd; i++)
            d += (double)q[i] * c->kf[p * stride + off + i];
        s[p] = d * scale;
        mx = fmax(mx, s[p]);
    }
    for (uint32_t p = 0; p < n_kv; p++)
        sum += s[p] = exp(s[p] - mx);
    for (uint32_t i = 0; i < hd; i++)
        out[i] = 0;
    for (uint32_t p = 0; p < n_kv; p++)
        for (uint32_t i = 0; i < hd; i++)
            out[i] += s[p] / sum * c->vf[p * stride + off + i];
    free(s);
}

/* One case; returns max |out - ref| / max|V|. */
static double att_case(bool f16, uint32_t n_kv, uint32_t hd, size_t stride, size_t off)
{
    struct att_cache c;
    const float vscale = 3.0f;
    att_fill(&c, f16, n_kv, hd, stride, off, vscale);
    float *q = malloc(hd * sizeof(float)), *out = malloc((hd + 1) * sizeof(float));
    float *scores = malloc((n_kv + 1) * sizeof(float));
    double *ref = malloc(hd * sizeof(double));
    for (uint32_t i = 0; i < hd; i++)
        q[i] = att_range(-2, 2);
    out[hd] = 777.0f;        /* canaries past the output and the scores */
    scores[n_kv] = 777.0f;
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t esz = f16 ? 2 : 4;
    attention_head(q, (const char *)c.k + off * esz, (const char *)c.v + off * esz, f16, stride,
                   n_kv, hd, scale, out, scores);
    att_ref(q, &c, stride, off, n_kv, hd, scale, ref);
    double err = 0;
    for (uint32_t i = 0; i < hd; i++)
        err = fmax(err, isfinite(out[i]) ? fabs(out[i] - ref[i]) / vscale : INFINITY);
    CHECK(out[hd] == 777.0f && scores[n_kv] == 777.0f, "f16=%d n_kv=%u hd=%u: wrote past a buffer",
          f16, n_kv, hd);
    if (n_kv == 1) /* one position: softmax weight 1, output = V exactly */
        for (uint32_t i = 0; i < hd; i++)
            CHECK(out[i] == c.vf[off + i], "f16=%d n_kv=1 hd=%u: out[%u] %g != v %g", f16, hd, i,
                  out[i], c.vf[off + i]);
    CHECK(err <= ATT_TOL, "f16=%d n_kv=%u hd=%u stride=%zu: error %g", f16, n_kv, hd, stride, err);
    free(q);
    free(out);
    free(scores);
    free(ref);
    att_free(&c);
    return err;
}

/* One key equals q (scaled up), the rest are orthogonal-ish noise of small
 * size: the attention is one-hot on that position. */
static void att_one_hot(bool f16)
{
    const uint32_t hd = 32, n_kv = 50, hot = 17;
    const size_t stride = hd;
    struct att_cache c;
    att_fill(&c, f16, n_kv, hd, stride, 0, 1.0f);
    float q[32], out[32], scores[50];
    for (uint32_t i = 0; i < hd; i++)
        q[i] = (i % 2 ? 1.0f : -1.0f);
    for (uint32_t p = 0; p < n_kv; p++) {
        for (uint32_t i = 0; i < hd; i++) {
            float kx = p == hot ? q[i] : 0.01f * att_range(-1, 1);
            if (f16) {
                uint16_t h = quant_f32_to_f16(kx);
                ((uint16_t *)c.k)[p * stride + i] = h;
                kx = quant_f16_to_f32(h);
            } else {
                ((float *)c.k)[p * stride + i] = kx;
            }
            c.kf[p * stride + i] = kx;
        }
    }
    /* q.k_hot = 32, others ~ +-0.3; scale 10 makes the gap ~ 300: exp(-300) ~ 0 */
    attention_head(q, c.k, c.v, f16, stride, n_kv, hd, 10.0f, out, scores);
    int bad = 0;
    for (uint32_t i = 0; i < hd; i++)
        bad += out[i] != c.vf[hot * stride + i];
    CHECK(bad == 0, "one-hot f16=%d: %d outputs differ from V[%u]", f16, bad, hot);
    att_free(&c);
}

int main(void)
{
    log_init("test", -1);
    static const uint32_t n_kvs[] = {1, 7, 100, 3000};
    static const uint32_t hds[] = {16, 64, 128};
    double worst[2] = {0, 0};
    for (int f16 = 0; f16 < 2; f16++) {
        for (size_t a = 0; a < 4; a++) {
            for (size_t b = 0; b < 3; b++) {
                const uint32_t hd = hds[b];
                /* a dense cache of one head, and a cache of 4 heads with this one third */
                double e1 = att_case(f16, n_kvs[a], hd, hd, 0);
                double e2 = att_case(f16, n_kvs[a], hd, 4 * (size_t)hd, 2 * (size_t)hd);
                worst[f16] = fmax(worst[f16], fmax(e1, e2));
            }
        }
        att_one_hot(f16);
    }
    MEASURE("attention_head vs double: worst error / max|V| %.3g (f32 cache), %.3g (f16 cache); "
            "bound %.0e", worst[0], worst[1], ATT_TOL);
    return test_main_result("test_attention");
}
