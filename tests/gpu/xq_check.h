/*
 * xq_check: the host's rounding of an activation row for the int8 decode
 * products, against which the GPU tests check the rows that producers
 * write rounded (the combine's xq, conv + heads' yq).
 */
#ifndef TESTS_GPU_XQ_CHECK_H
#define TESTS_GPU_XQ_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* x (n floats, n a multiple of 32) rounded for the int8 decode products
 * into row (kernels/cuda/mvq.h, cuda_mvq_xq_bytes(n) bytes: n levels, then
 * n / 32 scales, then n / 32 sums) as kernels/cuda/mvq.cuh defines it: per
 * block of 32, q = round-half-even(x * 127 / amax), d = amax / 127, s = d *
 * (sum of q). */
static inline void xq_round(const float *x, uint8_t *row, uint32_t n)
{
    for (uint32_t b = 0; b < n / 32; b++) {
        const float *xb = x + (size_t)b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int qs = 0;
        for (int j = 0; j < 32; j++) {
            const int q = (int)nearbyintf(xb[j] * id);
            qs += q;
            row[b * 32 + j] = (uint8_t)(int8_t)q;
        }
        const float d = amax / 127.0f, sc = d * (float)qs;
        memcpy(row + n + 4 * b, &d, 4);
        memcpy(row + n + 4 * (n / 32) + 4 * b, &sc, 4);
    }
}

/* How many levels, scales and sums of a rounded row (as xq_round writes
 * it) differ from xq_round of y. */
static inline int xq_mismatches(const float *y, const uint8_t *row, uint32_t n)
{
    const size_t bytes = n + 8 * (size_t)(n / 32);
    uint8_t *want = (uint8_t *)malloc(bytes);
    if (!want)
        return -1;
    xq_round(y, want, n);
    int bad = 0;
    for (uint32_t i = 0; i < n; i++)
        bad += row[i] != want[i];
    for (size_t i = n; i < bytes; i += 4)
        bad += memcmp(row + i, want + i, 4) != 0;
    free(want);
    return bad;
}

#endif
