/*
 * rope: NEOX rotary position embedding on the GPU (twin: ops_rope_neox in
 * kernels/cpu/ops.c), in place.
 *
 * Maths: for head j of token t (position pos0 + t) and pair i < n_rot/2,
 * with half = n_rot/2 and theta_i = (pos0 + t) * base^(-2i/n_rot):
 *   v[i]        = v[i] cos(theta_i) - v[i + half] sin(theta_i)
 *   v[i + half] = v[i] sin(theta_i) + v[i + half] cos(theta_i)
 * where v = x + t*tok_stride + j*head_stride (f32); dims >= n_rot untouched.
 *
 * Ownership: one thread per (token, head, pair), grid-stride. theta_i is
 * computed directly with powf; the CPU builds it by repeated f32
 * multiplication, so the two angles differ by a few ulp of theta (about
 * 1e-7 * pos radians), which is the expected difference at large positions.
 */
#include "kernels/cuda/ops.h"

#include "kernels/cuda/ops_device.cuh"

static __global__ void rope_neox_kernel(float *x, uint32_t n_tok, size_t tok_stride,
                                        uint32_t n_heads, size_t head_stride, uint32_t half,
                                        uint32_t pos0, float base)
{
    const size_t total = (size_t)n_tok * n_heads * half;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const uint32_t i = (uint32_t)(idx % half);
        const size_t th = idx / half;
        const uint32_t j = (uint32_t)(th % n_heads), t = (uint32_t)(th / n_heads);
        float *v = x + t * tok_stride + j * head_stride;
        const float theta = (float)(pos0 + t) * powf(base, -(float)(2 * i) / (float)(2 * half));
        float s, c;
        sincosf(theta, &s, &c);
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * c - x1 * s;
        v[i + half] = x0 * s + x1 * c;
    }
}

extern "C" int cuda_rope_neox(float *d_x, uint32_t n_tok, size_t tok_stride, uint32_t n_heads,
                              size_t head_stride, uint32_t n_rot, uint32_t pos0, float base,
                              cudaStream_t stream)
{
    if (!d_x || n_rot == 0 || n_rot % 2 || !(base > 0.0f) ||
        (n_heads > 1 && head_stride < n_rot) ||
        (n_tok > 1 && tok_stride < (size_t)(n_heads - 1) * head_stride + n_rot) ||
        (uint64_t)pos0 + n_tok > (1u << 24)) {
        log_error("cuda_rope_neox: bad arguments (x %p, n_tok %u, tok_stride %zu, n_heads %u, "
                  "head_stride %zu, n_rot %u, pos0 %u, base %g)",
                  (void *)d_x, n_tok, tok_stride, n_heads, head_stride, n_rot, pos0,
                  (double)base);
        return -EINVAL;
    }
    const size_t total = (size_t)n_tok * n_heads * (n_rot / 2);
    if (total == 0)
        return 0;
    rope_neox_kernel<<<ops_grid_for(total, 256), 256, 0, stream>>>(
        d_x, n_tok, tok_stride, n_heads, head_stride, n_rot / 2, pos0, base);
    return OPS_LAUNCH_CHECK("cuda_rope_neox");
}
