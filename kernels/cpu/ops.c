/*
 * ops: reference row operations of the CPU forward pass (see ops.h).
 */
#include "kernels/cpu/ops.h"

#include <math.h>
#include <string.h>

void ops_rmsnorm(float *y, const float *x, const float *w, uint32_t n, float eps)
{
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++)
        sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    if (w) {
        for (uint32_t i = 0; i < n; i++)
            y[i] = x[i] * scale * w[i];
    } else {
        for (uint32_t i = 0; i < n; i++)
            y[i] = x[i] * scale;
    }
}

void ops_l2norm(float *x, uint32_t n, float eps)
{
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++)
        sum += (double)(x[i] * x[i]);
    const float scale = 1.0f / sqrtf((float)sum + eps);
    for (uint32_t i = 0; i < n; i++)
        x[i] *= scale;
}

void ops_rope_neox(float *v, uint32_t n_rot, int64_t pos, float base)
{
    const uint32_t half = n_rot / 2;
    const float theta_scale = powf(base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (uint32_t i = 0; i < half; i++) {
        const float c = cosf(theta), s = sinf(theta);
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * c - x1 * s;
        v[i + half] = x0 * s + x1 * c;
        theta *= theta_scale;
    }
}

void ops_softmax(float *x, uint32_t n)
{
    float mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    const float inv = (float)(1.0 / sum);
    for (uint32_t i = 0; i < n; i++)
        x[i] *= inv;
}

float ops_silu(float x)
{
    return x / (1.0f + expf(-x));
}

float ops_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

float ops_softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

void ops_router_topk(const float *logits, uint32_t n, uint32_t k, int32_t *ids, float *w,
                     float *scratch)
{
    memcpy(scratch, logits, n * sizeof(float));
    ops_softmax(scratch, n);
    /* selection by insertion into a sorted list of k: k is small (<= 16 typically) */
    uint32_t have = 0;
    for (uint32_t e = 0; e < n; e++) {
        const float p = scratch[e];
        if (have == k && !(p > w[k - 1]))
            continue;
        uint32_t j = have < k ? have++ : k - 1;
        while (j > 0 && p > w[j - 1]) {
            w[j] = w[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        w[j] = p;
        ids[j] = (int32_t)e;
    }
    float sum = 0.0f;
    for (uint32_t i = 0; i < k; i++)
        sum += w[i];
    const float denom = sum > 6.103515625e-5f ? sum : 6.103515625e-5f;
    for (uint32_t i = 0; i < k; i++)
        w[i] /= denom;
}
