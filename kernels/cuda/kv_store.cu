/*
 * kv_store: appends K and V rows to a layer's KV cache on the GPU (twin: the
 * cache writes of fw_attn_prep_task in worker/forward.c).
 *
 * Maths: for token t < n_tok and i < kv_dim,
 *   kcache[(pos0 + t)*kv_dim + i] = cvt(k[t*tok_stride + i]), same for V,
 * cvt the identity (f32 cache) or f32 -> f16 rounding to nearest even
 * (__float2half_rn: bit-identical to quant_f32_to_f16 for every non-NaN
 * input; NaNs become the canonical f16 NaN).
 *
 * Ownership: one thread per (token, element), grid-stride; each thread
 * writes its K and its V element.
 */
#include "kernels/cuda/ops.h"

#include <cuda_fp16.h>

#include "kernels/cuda/ops_device.cuh"

template <bool F16>
static __global__ void kv_store_kernel(void *kc, void *vc, const float *k, const float *v,
                                       size_t tok_stride, uint32_t kv_dim, uint32_t n_tok,
                                       uint32_t pos0)
{
    const size_t total = (size_t)n_tok * kv_dim;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const size_t t = idx / kv_dim, i = idx % kv_dim;
        const size_t src = t * tok_stride + i, dst = ((size_t)pos0 + t) * kv_dim + i;
        if (F16) {
            ((__half *)kc)[dst] = __float2half_rn(k[src]);
            ((__half *)vc)[dst] = __float2half_rn(v[src]);
        } else {
            ((float *)kc)[dst] = k[src];
            ((float *)vc)[dst] = v[src];
        }
    }
}

extern "C" int cuda_kv_store(void *d_kcache, void *d_vcache, bool f16, const float *d_k,
                             const float *d_v, size_t tok_stride, uint32_t kv_dim, uint32_t n_tok,
                             uint32_t pos0, cudaStream_t stream)
{
    if (!d_kcache || !d_vcache || !d_k || !d_v || kv_dim == 0 ||
        (n_tok > 1 && tok_stride < kv_dim)) {
        log_error("cuda_kv_store: bad arguments (kcache %p, vcache %p, k %p, v %p, "
                  "tok_stride %zu, kv_dim %u, n_tok %u)",
                  d_kcache, d_vcache, (const void *)d_k, (const void *)d_v, tok_stride, kv_dim,
                  n_tok);
        return -EINVAL;
    }
    const size_t total = (size_t)n_tok * kv_dim;
    if (total == 0)
        return 0;
    if (f16)
        kv_store_kernel<true><<<ops_grid_for(total, 256), 256, 0, stream>>>(
            d_kcache, d_vcache, d_k, d_v, tok_stride, kv_dim, n_tok, pos0);
    else
        kv_store_kernel<false><<<ops_grid_for(total, 256), 256, 0, stream>>>(
            d_kcache, d_vcache, d_k, d_v, tok_stride, kv_dim, n_tok, pos0);
    return OPS_LAUNCH_CHECK("cuda_kv_store");
}
