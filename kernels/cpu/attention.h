/*
 * attention: causal scaled dot-product attention of one query head over a
 * KV cache on the CPU (model-spec 3 and 4.3): scores q.k * scale, softmax in
 * f32 over positions 0..n_kv-1, weighted sum of V. The cache is f32 or f16.
 *
 * Pure function on caller buffers; any thread.
 */
#ifndef KERNELS_CPU_ATTENTION_H
#define KERNELS_CPU_ATTENTION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* out[hd] = softmax(q . K[p] * scale) . V[p] over p < n_kv. k and v point at
 * the head's slice of position 0; consecutive positions are `stride` elements
 * apart; f16 says the cache holds IEEE halves instead of floats. scores is
 * scratch of n_kv floats. */
void attention_head(const float *q, const void *k, const void *v, bool f16, size_t stride,
                    uint32_t n_kv, uint32_t hd, float scale, float *out, float *scores);

#endif
