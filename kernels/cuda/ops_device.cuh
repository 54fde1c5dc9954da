/*
 * ops_device: what the ops kernels (norm, rope, kv_store, attention, router,
 * argmax, combine) share: the launch check of their extern "C" launchers and
 * fixed-order warp and block reductions. Private to the .cu files of kernels/cuda; host C
 * code never includes it.
 *
 * The reductions always combine the same lanes in the same order for a given
 * block size, so every kernel built on them is deterministic run to run.
 */
#ifndef KERNELS_CUDA_OPS_DEVICE_CUH
#define KERNELS_CUDA_OPS_DEVICE_CUH

#include <errno.h>
#include <math.h>

#include <cuda_runtime.h>

extern "C" {
#include "common/log.h"
}

#define OPS_FULL_MASK 0xFFFFFFFFu

/* Evaluates to 0, or logs the pending launch error of `op` and gives -EIO. */
#define OPS_LAUNCH_CHECK(op) ops_launch_status((op), __FILE__, __LINE__)

static inline int ops_launch_status(const char *op, const char *file, int line)
{
    const cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return 0;
    log_write(LOG_LEVEL_ERROR, file, line, "%s: kernel launch failed: %s", op,
              cudaGetErrorString(e));
    return -EIO;
}

/* Sum over the 32 lanes of a warp (butterfly); every lane gets the result. */
static __device__ __forceinline__ float ops_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(OPS_FULL_MASK, v, o);
    return v;
}

static __device__ __forceinline__ float ops_warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(OPS_FULL_MASK, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every
 * thread gets the result. `s_tmp` is 32 floats of shared memory, free again
 * when this returns. Called by all threads of the block. */
static __device__ __forceinline__ float ops_block_sum(float v, float *s_tmp)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = ops_warp_sum(v);
    if (lane == 0)
        s_tmp[warp] = v;
    __syncthreads();
    v = lane < n_warps ? s_tmp[lane] : 0.0f;
    v = ops_warp_sum(v);
    __syncthreads();
    return v;
}

static __device__ __forceinline__ float ops_block_max(float v, float *s_tmp)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = ops_warp_max(v);
    if (lane == 0)
        s_tmp[warp] = v;
    __syncthreads();
    v = lane < n_warps ? s_tmp[lane] : -INFINITY;
    v = ops_warp_max(v);
    __syncthreads();
    return v;
}

/* Grid size for a grid-stride loop over `count` items with `threads` per
 * block (capped; the loops cover the rest). */
static inline unsigned int ops_grid_for(size_t count, unsigned int threads)
{
    size_t blocks = (count + threads - 1) / threads;
    return (unsigned int)(blocks < 65535 * 8 ? (blocks ? blocks : 1) : 65535 * 8);
}

#endif
