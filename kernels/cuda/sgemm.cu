/*
 * sgemm: the prefill product of F32 weights (routers, small projections kept
 * in f32) for many activation rows, as a tiled f32 matrix product on the CUDA
 * cores: Y[s][r] = sum_i W[r][i] X[s][i], f32 products and sums (FMA), no
 * tensor cores, so results stay within f32 rounding of the exact dot. Used
 * by cuda_matmul (matvec.cu) for F32 weights and S >= 16 rows, where the
 * matvec kernels would read the weights once per 8 rows.
 *
 * Ownership: a block of (T/4)^2 threads computes a T (rows s) x T (weight
 * rows r) tile of Y, each thread a 4 x 4 piece (rows ty + (T/4) i, weight
 * rows tx + (T/4) j). The K dimension goes in steps of 16: the block stages
 * the step's T x 16 slices of X and of W into shared memory (transposed, k
 * outer, padded against bank conflicts; two buffers, the next step's slices
 * loaded into registers while this step's products run), then every thread
 * adds its 16 products per output in k order. Edges (S, n_rows or n not
 * multiples of the tile) load zeros and skip the stores.
 *
 * T is 64 (256 threads) where that gives every multiprocessor two blocks,
 * else 32 (64 threads): a 512 x 2048 router over 512 rows is 64 tiles of 64,
 * half an H100 idle, or 256 of 32. Each output is the same chain of FMAs in
 * k order (zeros past n included) either way, so both give the same bits.
 *
 * Split (KS 4, tile 32 only): where even tiles of 32 leave the
 * multiprocessors under four blocks of work each and n is long (a 512-row
 * prompt's router: 256 tiles of 64 threads, two warps an SM), a block has
 * four groups of 64 threads, group g owning the g-th quarter of the K steps
 * (its own two buffers, zeros past n), and group 0 adds the others' 4 x 4
 * pieces to its own in group order through shared memory: four chains
 * summed in one fixed order, the same bits at every run, not those of
 * split 1.
 */
#include "kernels/cuda/sgemm.h"

#include <errno.h>

#include "kernels/cuda/caps.h"

extern "C" {
#include "common/log.h"
}

namespace {

constexpr int kStep = 16;
constexpr int kSplit = 4;        /* K groups of a split block */
constexpr uint64_t kSplitN = 1024; /* shortest row split: 16 steps a group */

template <int T, int KS>
__global__ void __launch_bounds__((T / 4) * (T / 4) * KS)
    sgemm_nt_kernel(const float *__restrict__ w, size_t ldw, uint32_t n_rows, uint32_t n,
                    const float *__restrict__ x, size_t ldx, uint32_t S, float *__restrict__ y,
                    size_t ldy, bool vec)
{
    constexpr int TD = T / 4, NT = TD * TD;
    /* float4 pieces of a slice (T rows x 16 k) a thread loads */
    constexpr int LD = T * kStep / 4 / NT;
    __shared__ float s_xg[KS][2][kStep][T + 4];
    __shared__ float s_wg[KS][2][kStep][T + 4];
    const int grp = KS > 1 ? static_cast<int>(threadIdx.x) / NT : 0;
    const int tid = KS > 1 ? static_cast<int>(threadIdx.x) % NT : static_cast<int>(threadIdx.x);
    float(*s_x)[kStep][T + 4] = s_xg[grp];
    float(*s_w)[kStep][T + 4] = s_wg[grp];
    const int tx = tid % TD, ty = tid / TD;
    const uint32_t s0 = blockIdx.y * T, r0 = blockIdx.x * T;
    /* the group's K steps: [k_begin, k_end), the same count in every group */
    const uint32_t steps = (n + kStep - 1) / kStep, per = (steps + KS - 1) / KS;
    const uint32_t k_begin = grp * per * kStep, k_end = k_begin + per * kStep;
    float acc[4][4] = {};
    /* loader: piece q of thread t is row (t + q NT) / 4, k quarter ((t + q NT) % 4) * 4 */
    float4 rx[LD], rw[LD];
    auto load = [&](uint32_t k0) {
#pragma unroll
        for (int q = 0; q < LD; q++) {
            const int idx = tid + q * NT, lr = idx / 4, lk = (idx % 4) * 4;
            const uint32_t s = s0 + lr, r = r0 + lr, k = k0 + lk;
            if (vec && k + 3 < n) { /* 16-byte loads */
                rx[q] = s < S ? *reinterpret_cast<const float4 *>(x + s * ldx + k)
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                rw[q] = r < n_rows ? *reinterpret_cast<const float4 *>(w + r * ldw + k)
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            } else {
                float xv[4], wv[4];
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    xv[c] = s < S && k + c < n ? x[s * ldx + k + c] : 0.0f;
                    wv[c] = r < n_rows && k + c < n ? w[r * ldw + k + c] : 0.0f;
                }
                rx[q] = make_float4(xv[0], xv[1], xv[2], xv[3]);
                rw[q] = make_float4(wv[0], wv[1], wv[2], wv[3]);
            }
        }
    };
    auto store = [&](int b) {
#pragma unroll
        for (int q = 0; q < LD; q++) {
            const int idx = tid + q * NT, lr = idx / 4, lk = (idx % 4) * 4;
            s_x[b][lk][lr] = rx[q].x, s_x[b][lk + 1][lr] = rx[q].y;
            s_x[b][lk + 2][lr] = rx[q].z, s_x[b][lk + 3][lr] = rx[q].w;
            s_w[b][lk][lr] = rw[q].x, s_w[b][lk + 1][lr] = rw[q].y;
            s_w[b][lk + 2][lr] = rw[q].z, s_w[b][lk + 3][lr] = rw[q].w;
        }
    };
    load(k_begin);
    store(0);
    __syncthreads();
    int b = 0;
    for (uint32_t k0 = k_begin; k0 < k_end; k0 += kStep, b ^= 1) {
        const bool more = k0 + kStep < k_end;
        if (more) /* the next step's slices in flight during this step's products */
            load(k0 + kStep);
#pragma unroll
        for (int k = 0; k < kStep; k++) {
            float xs[4], ws[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                xs[i] = s_x[b][k][ty + TD * i];
                ws[i] = s_w[b][k][tx + TD * i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[i][j] = fmaf(xs[i], ws[j], acc[i][j]);
        }
        /* buffer b ^ 1 was last read in the step before, whose reads all
         * came before that step's barrier */
        if (more)
            store(b ^ 1);
        __syncthreads();
    }
    if (KS > 1) { /* the other groups' pieces into group 0's, in group order */
        float *red = &s_xg[0][0][0][0]; /* (KS - 1) x NT x 16 floats, after the last barrier */
        static_assert((KS - 1) * NT * 16 <= KS * 2 * kStep * (T + 4), "reduction space");
        if (grp > 0)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    red[((grp - 1) * 16 + i * 4 + j) * NT + tid] = acc[i][j];
        __syncthreads();
        if (grp > 0)
            return;
        for (int g = 1; g < KS; g++)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[i][j] += red[((g - 1) * 16 + i * 4 + j) * NT + tid];
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t s = s0 + ty + TD * i, r = r0 + tx + TD * j;
            if (s < S && r < n_rows)
                y[s * ldy + r] = acc[i][j];
        }
}

} /* namespace */

extern "C" int cuda_sgemm_nt_form(uint32_t tile, uint32_t split, const float *d_w,
                                  size_t row_bytes, uint64_t n_rows, uint64_t n, const float *d_X,
                                  size_t ldx, uint32_t S, float *d_Y, size_t ldy,
                                  cudaStream_t stream)
{
    if (!d_w || !d_X || !d_Y || row_bytes % 4 || row_bytes < n * 4 || ldx < n || ldy < n_rows ||
        n_rows > UINT32_MAX || n > UINT32_MAX || (tile && tile != 32 && tile != 64) ||
        (split && split != 1 && split != kSplit) || (split == kSplit && tile != 32) ||
        (!tile && split) || (uint64_t)S * ldx > (1ull << 40) || n_rows / 32 >= 65535u * 1024) {
        log_error("cuda_sgemm_nt: bad arguments (w %p row_bytes %zu rows %llu n %llu x %p ldx %zu "
                  "S %u y %p ldy %zu tile %u split %u)", (const void *)d_w, row_bytes,
                  (unsigned long long)n_rows, (unsigned long long)n, (const void *)d_X, ldx, S,
                  (void *)d_Y, ldy, tile, split);
        return -EINVAL;
    }
    if (n_rows == 0 || S == 0)
        return 0;
    if (!tile) { /* 64 where every multiprocessor gets two blocks of them, else 32, split
                  * where its tiles give the multiprocessors under four blocks each */
        const uint64_t tiles64 = (n_rows + 63) / 64 * ((S + 63) / 64);
        const uint64_t tiles32 = (n_rows + 31) / 32 * ((S + 31) / 32);
        const int sms = cuda_caps_sms();
        tile = sms > 0 && tiles64 >= 2 * (uint64_t)sms ? 64 : 32;
        split = tile == 32 && sms > 0 && tiles32 < 4 * (uint64_t)sms && n >= kSplitN ? kSplit : 1;
    }
    if (!split)
        split = 1;
    const dim3 grid((unsigned)((n_rows + tile - 1) / tile), (S + tile - 1) / tile);
    if (grid.y > 65535) {
        log_error("cuda_sgemm_nt: %u activation rows exceed the grid", S);
        return -EINVAL;
    }
    const uintptr_t addr = reinterpret_cast<uintptr_t>(d_w) | reinterpret_cast<uintptr_t>(d_X);
    const bool vec = (addr & 15) == 0 && row_bytes % 16 == 0 && ldx % 4 == 0;
    if (tile == 64)
        sgemm_nt_kernel<64, 1><<<grid, 256, 0, stream>>>(d_w, row_bytes / 4, (uint32_t)n_rows,
                                                         (uint32_t)n, d_X, ldx, S, d_Y, ldy, vec);
    else if (split == kSplit)
        sgemm_nt_kernel<32, kSplit><<<grid, 64 * kSplit, 0, stream>>>(
            d_w, row_bytes / 4, (uint32_t)n_rows, (uint32_t)n, d_X, ldx, S, d_Y, ldy, vec);
    else
        sgemm_nt_kernel<32, 1><<<grid, 64, 0, stream>>>(d_w, row_bytes / 4, (uint32_t)n_rows,
                                                        (uint32_t)n, d_X, ldx, S, d_Y, ldy, vec);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda_sgemm_nt: kernel launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

extern "C" int cuda_sgemm_nt(const float *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                             const float *d_X, size_t ldx, uint32_t S, float *d_Y, size_t ldy,
                             cudaStream_t stream)
{
    return cuda_sgemm_nt_form(0, 0, d_w, row_bytes, n_rows, n, d_X, ldx, S, d_Y, ldy, stream);
}
