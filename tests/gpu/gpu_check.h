/*
 * gpu_check: what the GPU tests share: CU() for the harness's own CUDA calls,
 * the xorshift64 generator their random data comes from (one stream per
 * seed, the same in every test that uses it), and host/device buffer helpers.
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

/* malloc that ends the test when the host is out of memory. */
static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* count floats uniform in [-1, 1) from r. */
static inline float *rand_floats(size_t count, struct rng *r)
{
    float *x = xmalloc(count * sizeof(float));
    for (size_t i = 0; i < count; i++)
        x[i] = rng_float(r);
    return x;
}

/* A device copy of bytes bytes at h (16 bytes of slack after it). */
static inline void *dev_bytes(const void *h, size_t bytes)
{
    void *d;
    CU(cudaMalloc(&d, bytes + 16));
    CU(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

/* A device copy of h[0 .. count) (16 bytes of slack after it). */
static inline float *dev_floats(const float *h, size_t count)
{
    return (float *)dev_bytes(h, count * sizeof(float));
}

#endif
