/*
 * ops: the small per-row operations of the forward pass on the CPU, with
 * llama.cpp's reference numerics (model-spec section 3): RMSNorm and L2 norm
 * accumulated in double, NEOX rope with the angle built by repeated f32
 * multiplication, softmax, SiLU, sigmoid, softplus, and the MoE router
 * (softmax, top-k, renormalisation with a clamped sum).
 *
 * Pure functions on caller-owned buffers; any thread. These are the CPU
 * twins the CUDA kernels are tested against.
 */
#ifndef KERNELS_CPU_OPS_H
#define KERNELS_CPU_OPS_H

#include <stdint.h>

/* y[i] = x[i] / sqrt(mean(x^2) + eps) * (w ? w[i] : 1). y may equal x. */
void ops_rmsnorm(float *y, const float *x, const float *w, uint32_t n, float eps);

/* x[i] /= sqrt(||x||^2 + eps), in place (HF / FLA's form; llama.cpp floors the
 * norm at eps instead, which differs only for near-zero vectors). */
void ops_l2norm(float *x, uint32_t n, float eps);

/* NEOX rope of the first n_rot dims of one head at position pos: pairs
 * (i, i + n_rot/2), theta_i = pos * base^(-2i/n_rot). Other dims untouched. */
void ops_rope_neox(float *v, uint32_t n_rot, int64_t pos, float base);

/* In-place softmax of n values (max subtracted first). */
void ops_softmax(float *x, uint32_t n);

float ops_silu(float x);
float ops_sigmoid(float x);
float ops_softplus(float x);

/* MoE router: softmax over the n logits, the k largest probabilities in
 * descending order (ties: lower id first) into ids, their weights divided by
 * max(sum, 6.103515625e-5) into w (llama.cpp's qwen3next clamp), computed as
 * the k largest logits (NaN below every other, weights NaN where one is
 * picked) and their expf(x - max) over those expf's sum, the clamp as the full
 * softmax sets it (it binds only for n > 16384; kernels/cuda/router.cu). The
 * weights equal the softmax's to rounding; the picks are the logits' order,
 * which a softmax's rounding can merge into ties. logits is left unchanged. */
void ops_router_topk(const float *logits, uint32_t n, uint32_t k, int32_t *ids, float *w);

#endif
