/*
 * attn_prep: the steps of an attention layer between the q/k/v products and
 * the attention kernel, in one launch: per-head RMSNorm of q and k with their
 * weights (q_norm, k_norm), NEOX rope of the first n_rot dims of q and k, and
 * the store of k and v into the KV cache. Twin: cuda_rmsnorm + cuda_rope_neox
 * x 2 + cuda_kv_store (and ops_rmsnorm / ops_rope_neox / the cache writes of
 * fw_attn on the CPU), with the same formulas: scale = 1 / sqrtf(sum x^2 / hd
 * + eps), theta = (pos0 + t) * powf(base, -2i / n_rot). Only the order of the
 * f32 sum of squares differs from cuda_rmsnorm (a few ulp).
 *
 * Ownership: one block per (token, row) with rows 0..nh-1 the query heads,
 * nh..nh+nkv-1 the key heads and then the value heads; thread i owns element
 * i of the head (blockDim = hd rounded up to a warp multiple). Rope pairs go
 * through shared memory. The position comes from pos0, or from *d_pos (a
 * device word, so a captured graph replays unchanged from step to step).
 */
#include "kernels/cuda/ops.h"

#include <cuda_fp16.h>

#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

struct prep_args {
    float *q, *k;
    const float *v;
    size_t q_tok_stride, q_head_stride, kv_tok_stride;
    uint32_t nh, nkv, hd, half, S, pos0;
    const uint32_t *pos_ptr;
    const float *q_norm, *k_norm;
    float eps, base;
    void *kc, *vc;
    bool f16;
};

static __global__ void __launch_bounds__(256) attn_prep_kernel(const struct prep_args a)
{
    __shared__ float s_tmp[32];
    __shared__ float s_x[256];
    if (blockIdx.x == 0 && threadIdx.x == 0) { /* the norm weights: in L2 before the wait */
        if (a.q_norm)
            pdl_prefetch_l2(a.q_norm, a.hd * sizeof(float));
        if (a.k_norm)
            pdl_prefetch_l2(a.k_norm, a.hd * sizeof(float));
    }
    pdl_wait(); /* q, k, v and the position come from the kernels before */
    pdl_trigger();
    const uint32_t rows = a.nh + 2 * a.nkv;
    const uint32_t t = blockIdx.x / rows, r = blockIdx.x % rows, i = threadIdx.x;
    const uint32_t pos = (a.pos_ptr ? *a.pos_ptr : a.pos0) + t;
    const size_t kv_dim = (size_t)a.nkv * a.hd;
    if (r >= a.nh + a.nkv) { /* a value head: store only */
        const uint32_t j = r - a.nh - a.nkv;
        if (i < a.hd) {
            const float x = a.v[t * a.kv_tok_stride + (size_t)j * a.hd + i];
            const size_t dst = (size_t)pos * kv_dim + (size_t)j * a.hd + i;
            if (a.f16)
                ((__half *)a.vc)[dst] = __float2half_rn(x);
            else
                ((float *)a.vc)[dst] = x;
        }
        return;
    }
    const bool is_q = r < a.nh;
    const uint32_t j = is_q ? r : r - a.nh;
    float *row = is_q ? a.q + t * a.q_tok_stride + (size_t)j * a.q_head_stride
                      : a.k + t * a.kv_tok_stride + (size_t)j * a.hd;
    const float *w = is_q ? a.q_norm : a.k_norm;
    float x = i < a.hd ? row[i] : 0.0f;
    if (w) {
        const float sum = ops_block_sum(x * x, s_tmp);
        const float scale = 1.0f / sqrtf(sum / (float)a.hd + a.eps);
        x = i < a.hd ? x * scale * w[i] : 0.0f;
    }
    s_x[i] = x;
    __syncthreads();
    if (i < a.half) {
        const float theta = (float)pos * powf(a.base, -(float)(2 * i) / (float)(2 * a.half));
        float s, c;
        sincosf(theta, &s, &c);
        const float x0 = s_x[i], x1 = s_x[i + a.half];
        x = x0 * c - x1 * s;
    } else if (i < 2 * a.half) {
        const uint32_t i0 = i - a.half;
        const float theta = (float)pos * powf(a.base, -(float)(2 * i0) / (float)(2 * a.half));
        float s, c;
        sincosf(theta, &s, &c);
        const float x0 = s_x[i0], x1 = s_x[i];
        x = x0 * s + x1 * c;
    }
    if (i >= a.hd)
        return;
    row[i] = x;
    if (!is_q) {
        const size_t dst = (size_t)pos * kv_dim + (size_t)j * a.hd + i;
        if (a.f16)
            ((__half *)a.kc)[dst] = __float2half_rn(x);
        else
            ((float *)a.kc)[dst] = x;
    }
}

extern "C" int cuda_attn_prep(float *d_q, size_t q_tok_stride, size_t q_head_stride,
                              uint32_t n_head, float *d_k, const float *d_v,
                              size_t kv_tok_stride, uint32_t n_head_kv, uint32_t hd,
                              const float *d_q_norm, const float *d_k_norm, float eps,
                              uint32_t n_rot, float base, void *d_kcache, void *d_vcache,
                              bool f16, uint32_t S, uint32_t pos0, const uint32_t *d_pos,
                              cudaStream_t stream)
{
    const size_t kvd = (size_t)n_head_kv * hd;
    if (!d_q || !d_k || !d_v || !d_kcache || !d_vcache || !n_head || !n_head_kv || !hd ||
        hd > 256 || n_rot > hd || n_rot % 2 || !(base > 0.0f) ||
        (n_head > 1 && q_head_stride < hd) || (S > 1 && kv_tok_stride < kvd) ||
        (S > 1 && q_tok_stride < (size_t)(n_head - 1) * q_head_stride + hd) ||
        (uint64_t)S * (n_head + 2 * n_head_kv) > INT32_MAX ||
        (!d_pos && (uint64_t)pos0 + S > (1u << 24))) {
        log_error("cuda_attn_prep: bad arguments (q %p, k %p, v %p, caches %p/%p, n_head %u, "
                  "n_head_kv %u, hd %u, n_rot %u, base %g, strides %zu/%zu/%zu, S %u, pos0 %u)",
                  (void *)d_q, (void *)d_k, (const void *)d_v, d_kcache, d_vcache, n_head,
                  n_head_kv, hd, n_rot, (double)base, q_tok_stride, q_head_stride,
                  kv_tok_stride, S, pos0);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    struct prep_args a = {};
    a.q = d_q;
    a.k = d_k;
    a.v = d_v;
    a.q_tok_stride = q_tok_stride;
    a.q_head_stride = q_head_stride;
    a.kv_tok_stride = kv_tok_stride;
    a.nh = n_head;
    a.nkv = n_head_kv;
    a.hd = hd;
    a.half = n_rot / 2;
    a.S = S;
    a.pos0 = pos0;
    a.pos_ptr = d_pos;
    a.q_norm = d_q_norm;
    a.k_norm = d_k_norm;
    a.eps = eps;
    a.base = base;
    a.kc = d_kcache;
    a.vc = d_vcache;
    a.f16 = f16;
    const unsigned threads = (hd + 31) / 32 * 32;
    pdl_launch(attn_prep_kernel, S * (n_head + 2 * n_head_kv), threads, 0, stream, a);
    return OPS_LAUNCH_CHECK("cuda_attn_prep");
}
