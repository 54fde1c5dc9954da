/*
 * cuda step_floor: the cost of one dependent step of a decode chain on the
 * device, as kernel launches and as one persistent kernel with grid
 * barriers (kernels/cuda/step_floor.cu; measured by
 * tests/gpu/test_step_floor_cuda.c). Not used by the engine: a measurement
 * for the design of the decode path.
 */
#ifndef KERNELS_CUDA_STEP_FLOOR_H
#define KERNELS_CUDA_STEP_FLOOR_H

#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* `steps` steps of y[j] = 0.5 x[j] + 1e-4 sum(x) over n floats, alternating
 * between d_a (the input of step 0) and d_b, one block an SM: as one kernel
 * launch a step (persistent 0; capture them in a graph to time them), or as
 * one cooperative kernel with a grid barrier between steps (persistent 1;
 * d_ctr: a counter at 0, left at (steps - 1) x blocks). The result is in
 * d_b for an odd step count, d_a for an even one, the same bits both ways.
 * -EINVAL for bad arguments, -ENOTSUP where the cooperative launch is not
 * possible, -EIO for a failed launch (logged). */
int cuda_step_floor(int persistent, float *d_a, float *d_b, uint32_t n, uint32_t steps,
                    unsigned int *d_ctr, cudaStream_t stream);

/* Distinct kernels cuda_step_floor_code can rotate through. */
#define CUDA_STEP_FLOOR_VARIANTS 7

/* What a kernel's code size costs a step of the chain: the launches' form
 * (one kernel a step, capture them), each step followed in every thread by
 * `fmas` (512, 2048 or 8192: about 8, 32 or 128 KiB of straight-line code)
 * multiply-adds into registers, the steps rotating through `variants` (1 to
 * CUDA_STEP_FLOOR_VARIANTS) kernels of the same length and different code.
 * One variant: the code stays in the SMs' instruction caches from step to
 * step; seven: each step's code was last run seven steps back, as a layer's
 * seven kernels are. The output is cuda_step_floor's (launches) bit for bit;
 * d_sink (NULL in the measurement) receives the accumulators, a float a
 * thread of blocks x 256. Errors as cuda_step_floor. */
int cuda_step_floor_code(uint32_t fmas, uint32_t variants, float *d_a, float *d_b, uint32_t n,
                         uint32_t steps, float *d_sink, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
