/*
 * cuda matvec: matrix-vector and matrix-matrix products on the GPU that read
 * GGUF blocks as stored (no re-quantization): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, F16, BF16, F32 (the decoders:
 * mv_types.cuh), with f32 activations and f32 accumulation. CPU twin:
 * kernels/cpu/matvec.h (matvec_rows, matvec_rows_batch).
 *
 * Weights: n_rows rows of n elements, row r at (const char *)d_w + r*row_bytes,
 * device memory or mapped pinned host memory (any device-accessible address).
 * All launchers validate their arguments (-EINVAL, logged), enqueue on the
 * given stream, check the launch (-EIO, logged) and return; results are ready
 * when the stream reaches that point.
 */
#ifndef KERNELS_CUDA_MATVEC_H
#define KERNELS_CUDA_MATVEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* True when the kernels handle this enum quant_type. */
bool cuda_matvec_supports(uint32_t type);

/* Whether cuda_matvec_norm takes this product (int8 decode kernels, the rule
 * of cuda_mvq_pays, n at most 4096 elements a 1024-thread norm covers). */
bool cuda_matvec_norm_ok(uint32_t type, uint64_t n_rows, uint64_t n);

/* d_y = W (rmsnorm(d_h) * d_norm_w) for one row (decode): the norm is
 * cuda_rmsnorm_wide's, bit for bit, computed by every block of the product
 * before it rounds the activations (no norm launch; d_norm_w NULL: weights
 * 1). -ENOTSUP where cuda_matvec_norm_ok is false (nothing launched). */
int cuda_matvec_norm(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                     uint64_t n, const float *d_h, const float *d_norm_w, float eps, float *d_y,
                     cudaStream_t stream);

/* d_y[r] = W[r] . d_x for r < n_rows (decode). */
int cuda_matvec(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                const float *d_x, float *d_y, cudaStream_t stream);

/* d_Y[s*ldy + r] = W[r] . d_X[s*ldx ...] for s < S, r < n_rows (prefill);
 * each weight tile is read once for many activation rows. */
int cuda_matmul(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                const float *d_X, size_t ldx, uint32_t S, float *d_Y, size_t ldy,
                cudaStream_t stream);

/* Routed experts through a device-side address table. For each pair
 * p < n_pairs: e = d_ids[p]; if d_addr[e] is NULL the pair is skipped (its
 * output row untouched: the expert runs elsewhere); else
 * d_Y[p*ldy + r] = W_e[r] . d_X[(p / x_div) * ldx ...] for r < n_rows, where
 * W_e starts at d_addr[e]. x_div = top_k makes pairs of one token share its
 * input row (gate and up products); x_div = 1 gives each pair its own row
 * (down product). d_addr has one entry per expert (device memory). */
int cuda_matvec_experts(uint32_t type, const void *const *d_addr, size_t row_bytes,
                        uint64_t n_rows, uint64_t n, const int32_t *d_ids, uint32_t n_pairs,
                        const float *d_X, size_t ldx, uint32_t x_div, float *d_Y, size_t ldy,
                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
