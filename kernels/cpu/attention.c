/*
 * attention: one query head against the KV cache (see attention.h).
 */
#include "kernels/cpu/attention.h"

#include <math.h>
#include <string.h>

#include "model/quant.h"

static float attention_dot(const float *q, const void *kp, bool f16, uint32_t hd)
{
    float s = 0.0f;
    if (f16) {
        const uint16_t *k = kp;
        for (uint32_t i = 0; i < hd; i++)
            s += q[i] * quant_f16_to_f32(k[i]);
    } else {
        const float *k = kp;
        for (uint32_t i = 0; i < hd; i++)
            s += q[i] * k[i];
    }
    return s;
}

void attention_head(const float *q, const void *k, const void *v, bool f16, size_t stride,
                    uint32_t n_kv, uint32_t hd, float scale, float *out, float *scores)
{
    const size_t esz = f16 ? 2 : 4;
    float mx = -INFINITY;
    for (uint32_t p = 0; p < n_kv; p++) {
        scores[p] = attention_dot(q, (const char *)k + p * stride * esz, f16, hd) * scale;
        mx = scores[p] > mx ? scores[p] : mx;
    }
    double sum = 0.0;
    for (uint32_t p = 0; p < n_kv; p++) {
        scores[p] = expf(scores[p] - mx);
        sum += scores[p];
    }
    const float inv = (float)(1.0 / sum);
    memset(out, 0, hd * sizeof(float));
    for (uint32_t p = 0; p < n_kv; p++) {
        const float a = scores[p] * inv;
        if (f16) {
            const uint16_t *vp = (const uint16_t *)v + p * stride;
            for (uint32_t i = 0; i < hd; i++)
                out[i] += a * quant_f16_to_f32(vp[i]);
        } else {
            const float *vp = (const float *)v + p * stride;
            for (uint32_t i = 0; i < hd; i++)
                out[i] += a * vp[i];
        }
    }
}
