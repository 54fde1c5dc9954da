/*
 * sgemm: the prefill product of F32 weights (routers, small projections kept
 * in f32) for many activation rows, as a tiled f32 matrix product on the CUDA
 * cores: Y[s][r] = sum_i W[r][i] X[s][i], f32 products and sums (FMA), no
 * tensor cores, so results stay within f32 rounding of the exact dot. Used
 * by cuda_matmul (matvec.cu) for F32 weights and S >= 16 rows, where the
 * matvec kernels would read the weights once per 8 rows.
 *
 * Ownership: a block of 256 threads computes a 64 (rows s) x 64 (weight
 * rows r) tile of Y, each thread a 4 x 4 piece (rows ty + 16i, weight rows
 * tx + 16j). The K dimension goes in steps of 16: the block stages the
 * step's 64 x 16 slices of X and of W into shared memory (transposed, k
 * outer, padded against bank conflicts), then every thread adds its 16
 * products per output in k order. Edges (S, n_rows or n not multiples of
 * the tile) load zeros and skip the stores.
 */
#include "kernels/cuda/sgemm.h"

#include <errno.h>

extern "C" {
#include "common/log.h"
}

namespace {

constexpr int kTile = 64, kStep = 16, kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    sgemm_nt_kernel(const float *__restrict__ w, size_t ldw, uint32_t n_rows, uint32_t n,
                    const float *__restrict__ x, size_t ldx, uint32_t S, float *__restrict__ y,
                    size_t ldy, bool vec)
{
    __shared__ float s_x[kStep][kTile + 4];
    __shared__ float s_w[kStep][kTile + 4];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const uint32_t s0 = blockIdx.y * kTile, r0 = blockIdx.x * kTile;
    float acc[4][4] = {};
    /* loader: thread t copies row t / 4, k quarter (t % 4) * 4 .. + 3 of both slices */
    const int lr = threadIdx.x / 4, lk = (threadIdx.x % 4) * 4;
    for (uint32_t k0 = 0; k0 < n; k0 += kStep) {
        const uint32_t s = s0 + lr, r = r0 + lr, k = k0 + lk;
        if (vec && k + 3 < n) { /* 16-byte loads */
            const float4 xv = s < S ? *reinterpret_cast<const float4 *>(x + s * ldx + k)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            const float4 wv = r < n_rows ? *reinterpret_cast<const float4 *>(w + r * ldw + k)
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            s_x[lk][lr] = xv.x, s_x[lk + 1][lr] = xv.y, s_x[lk + 2][lr] = xv.z;
            s_x[lk + 3][lr] = xv.w;
            s_w[lk][lr] = wv.x, s_w[lk + 1][lr] = wv.y, s_w[lk + 2][lr] = wv.z;
            s_w[lk + 3][lr] = wv.w;
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                s_x[lk + q][lr] = s < S && k + q < n ? x[s * ldx + k + q] : 0.0f;
                s_w[lk + q][lr] = r < n_rows && k + q < n ? w[r * ldw + k + q] : 0.0f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kStep; k++) {
            float xs[4], ws[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                xs[i] = s_x[k][ty + 16 * i];
                ws[i] = s_w[k][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[i][j] = fmaf(xs[i], ws[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t s = s0 + ty + 16 * i, r = r0 + tx + 16 * j;
            if (s < S && r < n_rows)
                y[s * ldy + r] = acc[i][j];
        }
}

} /* namespace */

extern "C" int cuda_sgemm_nt(const float *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                             const float *d_X, size_t ldx, uint32_t S, float *d_Y, size_t ldy,
                             cudaStream_t stream)
{
    if (!d_w || !d_X || !d_Y || row_bytes % 4 || row_bytes < n * 4 || ldx < n || ldy < n_rows ||
        n_rows > UINT32_MAX || n > UINT32_MAX ||
        (uint64_t)S * ldx > (1ull << 40) || n_rows / kTile >= 65535u * 1024) {
        log_error("cuda_sgemm_nt: bad arguments (w %p row_bytes %zu rows %llu n %llu x %p ldx %zu "
                  "S %u y %p ldy %zu)", (const void *)d_w, row_bytes,
                  (unsigned long long)n_rows, (unsigned long long)n, (const void *)d_X, ldx, S,
                  (void *)d_Y, ldy);
        return -EINVAL;
    }
    if (n_rows == 0 || S == 0)
        return 0;
    const dim3 grid((unsigned)((n_rows + kTile - 1) / kTile), (S + kTile - 1) / kTile);
    if (grid.y > 65535) {
        log_error("cuda_sgemm_nt: %u activation rows exceed the grid", S);
        return -EINVAL;
    }
    const uintptr_t addr = reinterpret_cast<uintptr_t>(d_w) | reinterpret_cast<uintptr_t>(d_X);
    const bool vec = (addr & 15) == 0 && row_bytes % 16 == 0 && ldx % 4 == 0;
    sgemm_nt_kernel<<<grid, kThreads, 0, stream>>>(d_w, row_bytes / 4, (uint32_t)n_rows,
                                                   (uint32_t)n, d_X, ldx, S, d_Y, ldy, vec);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda_sgemm_nt: kernel launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
