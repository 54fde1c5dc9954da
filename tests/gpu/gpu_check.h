/*
 * gpu_check: what the GPU tests share: CU() for the harness's own CUDA calls
 * and the xorshift64 generator their random data comes from (one stream per
 * seed, the same in every test that uses it).
 */
#ifndef TESTS_GPU_GPU_CHECK_H
#define TESTS_GPU_GPU_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

/* A failed CUDA call ends the test: nothing after it can be trusted. */
#define CU(expr)                                                                                   \
    do {                                                                                           \
        cudaError_t cu_err_ = (expr);                                                              \
        if (cu_err_ != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,                   \
                    cudaGetErrorString(cu_err_));                                                  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

struct rng {
    uint64_t s;
};

static inline uint64_t rng_next(struct rng *r)
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

/* Uniform in [-1, 1). */
static inline float rng_float(struct rng *r)
{
    return (float)((double)(rng_next(r) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

#endif
