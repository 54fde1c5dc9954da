/*
 * step_floor: what one dependent step of a decode chain costs on the
 * device, as launches and as a persistent kernel (a measurement for the
 * design of the decode path, tests/gpu/test_step_floor_cuda.c).
 *
 * A step: every block reads the whole previous vector x (n floats, in L2),
 * sums it in a fixed tree and writes its slice of the next vector,
 * y[j] = 0.5 x[j] + 1e-4 sum(x). That is the shape of a decode product's
 * boundary (each block needs all of the previous output) with no weights.
 *   launches:   one kernel a step, captured in a CUDA graph, chained with
 *               programmatic dependent launch (wait first, trigger after);
 *   persistent: one kernel whose blocks (one an SM, all resident) run the
 *               steps, separated by a grid barrier: each block's thread 0
 *               fences, adds 1 to a counter in device memory (release) and
 *               spins until it reaches (step + 1) x blocks (acquire).
 * Both give the same bits (the same sums in the same order); the persistent
 * form needs every block resident at once (cooperative launch checks it).
 */
#include <errno.h>

#include "kernels/cuda/caps.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

extern "C" {
#include "common/log.h"
}

#include "kernels/cuda/step_floor.h"

namespace {

constexpr int kThreads = 256;

/* One step of block b: the sum of x in a fixed tree, then the slice. */
__device__ __forceinline__ void floor_step(const float *x, float *y, uint32_t n, float *s_tmp)
{
    float part = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += kThreads)
        part += __ldcg(x + i);
    const float sum = ops_block_sum(part, s_tmp);
    const uint32_t per = (n + gridDim.x - 1) / gridDim.x;
    const uint32_t j0 = blockIdx.x * per, j1 = j0 + per < n ? j0 + per : n;
    for (uint32_t j = j0 + threadIdx.x; j < j1; j += kThreads)
        y[j] = __fadd_rn(__fmul_rn(0.5f, __ldcg(x + j)), __fmul_rn(1e-4f, sum));
}

__global__ void __launch_bounds__(kThreads) floor_launch_kernel(const float *x, float *y,
                                                                uint32_t n)
{
    __shared__ float s_tmp[32];
    pdl_wait();
    pdl_trigger();
    floor_step(x, y, n, s_tmp);
}

__device__ __forceinline__ void grid_arrive_wait(unsigned int *ctr, unsigned int target)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
        unsigned int v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kThreads) floor_persistent_kernel(float *a, float *b,
                                                                    uint32_t n, uint32_t steps,
                                                                    unsigned int *ctr)
{
    __shared__ float s_tmp[32];
    for (uint32_t s = 0; s < steps; s++) {
        const float *x = s % 2 ? b : a;
        float *y = s % 2 ? a : b;
        floor_step(x, y, n, s_tmp);
        if (s + 1 < steps)
            grid_arrive_wait(ctr, (s + 1) * gridDim.x);
    }
}

/* The code-size form: the same step, then NF multiply-adds unrolled into
 * straight-line code (eight independent accumulators), run by every thread
 * once a launch. Instance V differs from the others only in its constants,
 * so each is its own code of the same length. The accumulators reach
 * memory only where `sink` is set (never in the measurement), so the step's
 * output is the plain form's. */
template <int V, int NF>
__global__ void __launch_bounds__(kThreads) floor_code_kernel(const float *x, float *y,
                                                              uint32_t n, float *sink)
{
    __shared__ float s_tmp[32];
    pdl_wait();
    pdl_trigger();
    floor_step(x, y, n, s_tmp);
    float a[8];
#pragma unroll
    for (int k = 0; k < 8; k++)
        a[k] = __ldcg(x + (threadIdx.x * 8 + k) % n);
#pragma unroll
    for (int i = 0; i < NF; i++)
        a[i & 7] = fmaf(a[i & 7], 1.0f + (float)(V * NF + i) * 1e-7f, 0.25f);
    if (sink) {
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++)
            t += a[k];
        sink[blockIdx.x * kThreads + threadIdx.x] = t;
    }
}

typedef void (*floor_code_fn)(const float *, float *, uint32_t, float *);

template <int NF>
floor_code_fn floor_code_pick(uint32_t v)
{
    static const floor_code_fn k[CUDA_STEP_FLOOR_VARIANTS] = {
        floor_code_kernel<0, NF>, floor_code_kernel<1, NF>, floor_code_kernel<2, NF>,
        floor_code_kernel<3, NF>, floor_code_kernel<4, NF>, floor_code_kernel<5, NF>,
        floor_code_kernel<6, NF>};
    return k[v];
}

} /* namespace */

extern "C" int cuda_step_floor(int persistent, float *d_a, float *d_b, uint32_t n,
                               uint32_t steps, unsigned int *d_ctr, cudaStream_t stream)
{
    if (!d_a || !d_b || n == 0 || steps == 0 || (persistent && !d_ctr)) {
        log_error("cuda_step_floor: bad arguments (a %p, b %p, n %u, steps %u, ctr %p)",
                  (void *)d_a, (void *)d_b, n, steps, (void *)d_ctr);
        return -EINVAL;
    }
    const int sms = cuda_caps_sms(); /* 0 where it cannot be read (logged there) */
    if (sms <= 0)
        return -EIO;
    if (!persistent) {
        for (uint32_t s = 0; s < steps; s++)
            pdl_launch(floor_launch_kernel, sms, kThreads, 0, stream, s % 2 ? d_b : d_a,
                       s % 2 ? d_a : d_b, n);
    } else {
        /* cooperative: every block resident, or the launch fails */
        void *args[] = {&d_a, &d_b, &n, &steps, &d_ctr};
        const cudaError_t e =
            cudaLaunchCooperativeKernel((const void *)floor_persistent_kernel, dim3(sms),
                                        dim3(kThreads), args, 0, stream);
        if (e == cudaErrorNotSupported || e == cudaErrorCooperativeLaunchTooLarge) {
            (void)cudaGetLastError();
            return -ENOTSUP;
        }
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda_step_floor: launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

extern "C" int cuda_step_floor_code(uint32_t fmas, uint32_t variants, float *d_a, float *d_b,
                                    uint32_t n, uint32_t steps, float *d_sink,
                                    cudaStream_t stream)
{
    if (!d_a || !d_b || n == 0 || steps == 0 || variants == 0 ||
        variants > CUDA_STEP_FLOOR_VARIANTS ||
        (fmas != 512 && fmas != 2048 && fmas != 8192)) {
        log_error("cuda_step_floor_code: bad arguments (a %p, b %p, n %u, steps %u, fmas %u, "
                  "variants %u: fmas 512, 2048 or 8192, variants 1 to %d)",
                  (void *)d_a, (void *)d_b, n, steps, fmas, variants, CUDA_STEP_FLOOR_VARIANTS);
        return -EINVAL;
    }
    const int sms = cuda_caps_sms(); /* 0 where it cannot be read (logged there) */
    if (sms <= 0)
        return -EIO;
    for (uint32_t s = 0; s < steps; s++) {
        const uint32_t v = s % variants;
        const floor_code_fn k = fmas == 512    ? floor_code_pick<512>(v)
                                : fmas == 2048 ? floor_code_pick<2048>(v)
                                               : floor_code_pick<8192>(v);
        pdl_launch(k, sms, kThreads, 0, stream, (const float *)(s % 2 ? d_b : d_a),
                   s % 2 ? d_a : d_b, n, d_sink);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda_step_floor_code: launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
