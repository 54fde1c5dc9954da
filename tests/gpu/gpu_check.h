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

#include "model/quant.h"

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

/* rows random rows of n of a quantized type on the device (quant_row_size bytes a row, 16
 * bytes of slack): element j of a row uniform in [-1, 1) times 1 + j % 7, so that a
 * row's blocks have different scales. */
static inline void *dev_quant_rows(uint32_t type, uint64_t rows, uint64_t n, struct rng *r)
{
    const size_t rb = quant_row_size(type, n);
    uint8_t *h = (uint8_t *)xmalloc(rows * rb);
    float *f = (float *)xmalloc(n * sizeof(float));
    for (uint64_t i = 0; i < rows; i++) {
        for (uint64_t j = 0; j < n; j++)
            f[j] = rng_float(r) * (1.0f + (float)(j % 7));
        if (quant_quantize_row(type, f, h + i * rb, n)) {
            fprintf(stderr, "quantize failed\n");
            exit(1);
        }
    }
    void *d = dev_bytes(h, rows * rb);
    free(h);
    free(f);
    return d;
}

/* The first byte at which two device buffers of bytes bytes differ, or bytes where they
 * are equal. */
static inline size_t dev_first_diff(const void *a, const void *b, size_t bytes)
{
    uint8_t *ha = (uint8_t *)xmalloc(bytes), *hb = (uint8_t *)xmalloc(bytes);
    CU(cudaMemcpy(ha, a, bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hb, b, bytes, cudaMemcpyDeviceToHost));
    size_t first = bytes;
    for (size_t i = 0; i < bytes && first == bytes; i++)
        if (ha[i] != hb[i])
            first = i;
    free(ha);
    free(hb);
    return first;
}

/* Fills bytes bytes at d with 0xC3 (outputs poisoned before a run). */
static inline void dev_poison_bytes(void *d, size_t bytes)
{
    CU(cudaMemset(d, 0xC3, bytes));
}

/* The value of a device counter (a tail's: 0 between launches). */
static inline unsigned int dev_counter(const unsigned int *d)
{
    unsigned int v;
    CU(cudaMemcpy(&v, d, sizeof(v), cudaMemcpyDeviceToHost));
    return v;
}

static inline int gpu_cmp_f(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median over 20 replays of a graph of `copies` captured calls of fn, in
 * us per call. */
static inline float graph_median_us(void (*fn)(void *, cudaStream_t), void *arg, int copies)
{
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < copies; i++)
        fn(arg, s);
    CU(cudaStreamEndCapture(s, &g));
    CU(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CU(cudaEventCreate(&a));
    CU(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++)
        CU(cudaGraphLaunch(ge, s));
    float t[20];
    for (int i = 0; i < 20; i++) {
        CU(cudaEventRecord(a, s));
        CU(cudaGraphLaunch(ge, s));
        CU(cudaEventRecord(b, s));
        CU(cudaEventSynchronize(b));
        CU(cudaEventElapsedTime(&t[i], a, b));
    }
    qsort(t, 20, sizeof(float), gpu_cmp_f);
    CU(cudaGraphExecDestroy(ge));
    CU(cudaGraphDestroy(g));
    CU(cudaEventDestroy(a));
    CU(cudaEventDestroy(b));
    CU(cudaStreamDestroy(s));
    return t[10] * 1000.0f / (float)copies;
}

#endif
