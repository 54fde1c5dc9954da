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

/* A logit's place in the router's order as one number (kernels/cuda/router.cuh's
 * router_key): larger logits larger, -0 as +0, NaN the smallest (1). */
static uint32_t router_key(float x)
{
    if (x != x)
        return 1u;
    const float z = x + 0.0f; /* -0 + 0 is +0 */
    uint32_t b;
    memcpy(&b, &z, sizeof(b));
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

void ops_router_topk(const float *logits, uint32_t n, uint32_t k, int32_t *ids, float *w)
{
    /* selection by insertion into a sorted list of k: k is small (<= 16 typically);
     * strict >: among equal keys the lower id first */
    uint32_t have = 0;
    for (uint32_t e = 0; e < n; e++) {
        const uint32_t key = router_key(logits[e]);
        if (have == k && !(key > router_key(logits[ids[k - 1]])))
            continue;
        uint32_t j = have < k ? have++ : k - 1;
        while (j > 0 && key > router_key(logits[ids[j - 1]])) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = (int32_t)e;
    }
    for (uint32_t i = 0; i < k; i++)
        w[i] = logits[ids[i]];
    /* e_i = expf(x_i - max x), the first pick holding the max; the softmax's
     * weights p_i / max(sum p_i, c) are e_i / max(sum e_i, c S), S the sum of
     * every expf(x - max x). sum e_i >= 1 and S <= n, so the clamp binds only
     * for n > 1 / c = 16384: only then is S needed (in double, as a softmax
     * sums). */
    const float mx = w[0];
    float sum = 0.0f;
    for (uint32_t i = 0; i < k; i++) {
        w[i] = expf(w[i] - mx);
        sum += w[i];
    }
    float denom = sum;
    if (n > 16384) {
        double S = 0.0;
        for (uint32_t e = 0; e < n; e++)
            if (logits[e] == logits[e])
                S += expf(logits[e] - mx);
        const float c = (float)(6.103515625e-5 * S);
        denom = sum > c ? sum : c;
    }
    for (uint32_t i = 0; i < k; i++)
        w[i] /= denom;
}
