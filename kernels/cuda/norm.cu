/*
 * norm: RMSNorm of rows on the GPU (twin: ops_rmsnorm in kernels/cpu/ops.c),
 * the fused residual add + RMSNorm of a layer boundary, and the plain residual
 * add (twins: the h += delta loops of worker/forward.c).
 *
 * Maths: y[r][i] = x[r][i] * (1 / sqrtf(sum_i x[r][i]^2 / n + eps)) * w[i]
 * (w absent: 1). f32 rows of n; row r at x + r*x_stride and y + r*y_stride
 * (cuda_add_rmsnorm: contiguous rows, x = h after h += delta).
 *
 * Ownership: one block per row, blockDim a warp multiple chosen from n alone
 * (32..256). Thread i owns elements i, i + blockDim, ...: it adds the delta,
 * squares and sums in f32, the block sums the partials in a fixed tree (so
 * two runs agree bit for bit), and each thread scales its own elements. The
 * CPU sums in double; the f32 tree differs by a few ulp of the scale. Each
 * thread reads its elements before writing them, so y may be x.
 * cuda_add: grid-stride, one element per thread per step, exact.
 */
#include "kernels/cuda/ops.h"

#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

extern "C" unsigned int cuda_norm_threads(uint32_t n)
{
    unsigned int t = (n / 4 + 31) / 32 * 32;
    return t < 32 ? 32 : t > 256 ? 256 : t;
}

/* ADD: h += delta first (delta may be NULL). */
template <bool ADD>
static __global__ void norm_rows_kernel(float *y, size_t y_stride, float *x, size_t x_stride,
                                        const float *delta, const float *w, uint32_t n,
                                        float eps)
{
    __shared__ float s_tmp[32];
    if (w && blockIdx.x == 0 && threadIdx.x == 0) /* the weights: in L2 before the wait */
        pdl_prefetch_l2(w, n * sizeof(float));
    pdl_wait(); /* x and delta come from the kernels before */
    pdl_trigger();
    const size_t r = blockIdx.x;
    float *xr = x + r * x_stride;
    float *yr = y + r * y_stride;
    float sum = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (ADD && delta) {
            v += delta[r * n + i];
            xr[i] = v;
        }
        sum += v * v;
    }
    sum = ops_block_sum(sum, s_tmp);
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] * scale;
        yr[i] = w ? v * w[i] : v;
    }
}

static __global__ void add_kernel(float *h, const float *d, size_t count)
{
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += step)
        h[i] += d[i];
}

static int norm_check(const char *op, const void *y, const void *x, uint32_t n, uint32_t rows)
{
    if (!y || !x || n == 0 || rows > INT32_MAX) {
        log_error("%s: bad arguments (y %p, x %p, n %u, rows %u)", op, y, x, n, rows);
        return -EINVAL;
    }
    return 0;
}

extern "C" int cuda_rmsnorm(float *d_y, size_t y_stride, const float *d_x, size_t x_stride,
                            const float *d_w, uint32_t n, uint32_t rows, float eps,
                            cudaStream_t stream)
{
    int rc = norm_check("cuda_rmsnorm", d_y, d_x, n, rows);
    if (rc)
        return rc;
    if (rows > 1 && (y_stride < n || x_stride < n)) {
        log_error("cuda_rmsnorm: row strides %zu/%zu below n %u", y_stride, x_stride, n);
        return -EINVAL;
    }
    if (rows == 0)
        return 0;
    pdl_launch(norm_rows_kernel<false>, rows, cuda_norm_threads(n), 0, stream, d_y, y_stride,
               (float *)d_x, x_stride, (const float *)nullptr, d_w, n, eps);
    return OPS_LAUNCH_CHECK("cuda_rmsnorm");
}

extern "C" unsigned int cuda_norm_wide_threads(uint32_t n)
{
    unsigned int t = (n / 2 + 31) / 32 * 32;
    return t < 32 ? 32 : t > 1024 ? 1024 : t;
}

extern "C" int cuda_rmsnorm_wide(float *d_y, const float *d_x, const float *d_w, uint32_t n,
                                 uint32_t rows, float eps, cudaStream_t stream)
{
    int rc = norm_check("cuda_rmsnorm_wide", d_y, d_x, n, rows);
    if (rc || rows == 0)
        return rc;
    pdl_launch(norm_rows_kernel<false>, rows, cuda_norm_wide_threads(n), 0, stream, d_y,
               (size_t)n, (float *)d_x, (size_t)n, (const float *)nullptr, d_w, n, eps);
    return OPS_LAUNCH_CHECK("cuda_rmsnorm_wide");
}

extern "C" int cuda_add_rmsnorm(float *d_h, const float *d_delta, float *d_y, const float *d_w,
                                uint32_t n, uint32_t rows, float eps, cudaStream_t stream)
{
    int rc = norm_check("cuda_add_rmsnorm", d_y, d_h, n, rows);
    if (rc || rows == 0)
        return rc;
    pdl_launch(norm_rows_kernel<true>, rows, cuda_norm_threads(n), 0, stream, d_y, (size_t)n, d_h,
               (size_t)n, d_delta, d_w, n, eps);
    return OPS_LAUNCH_CHECK("cuda_add_rmsnorm");
}

extern "C" int cuda_add(float *d_h, const float *d_d, size_t count, cudaStream_t stream)
{
    if (!d_h || !d_d) {
        log_error("cuda_add: null buffer (h %p, d %p)", (void *)d_h, (const void *)d_d);
        return -EINVAL;
    }
    if (count == 0)
        return 0;
    add_kernel<<<ops_grid_for(count, 256), 256, 0, stream>>>(d_h, d_d, count);
    return OPS_LAUNCH_CHECK("cuda_add");
}
