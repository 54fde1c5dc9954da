/*
 * cuda mmq: quantized matrix-matrix products on int8 tensor cores for
 * prefill, dense weights and routed experts grouped by expert (the shape
 * llama.cpp calls MMQ). Weights are GGUF rows read as stored (Q4_0, Q8_0,
 * Q4_K, Q5_K, Q6_K); activations are first rounded to int8 in blocks of 32 (f32
 * scale d = amax/127, q = round(x/d), and d * sum(q) for the K-quant mins)
 * into a caller-provided scratch buffer, then each 32-element block dot is
 * an exact integer sum (mma.sync m16n8k32 s8; Q6_K, a scale per 16
 * elements: two m16n8k16 halves) times the two scales, summed
 * in f32. So a result is the f32-rounded dot of the dequantized row with
 * the rounded activations (CPU twin: the test's f64 reference; about 1e-3
 * of sum |w x| from the dot with the true activations).
 *
 * Needs sm_80 or later and rows whose length n is a multiple of 256: for
 * anything else (another type, an older GPU, other n) the launchers return
 * -ENOTSUP without logging, so the caller falls back to cuda_matmul or
 * cuda_matvec_experts (kernels/cuda/matvec.h, same contracts).
 *
 * Weights: row r at (const char *)d_w + r*row_bytes, device-accessible,
 * 2-byte aligned, the matrix n_rows * row_bytes bytes (a Q6_K stage is
 * read as the 16-byte or 4-byte words around its 210 bytes); rows at
 * 16-byte aligned addresses with row_bytes a multiple of 16 are staged with
 * cp.async (Q6_K rows 4-byte aligned with row_bytes a multiple of 4 too, by
 * 4-byte copies), others through plain loads (slower, same results). All
 * launchers validate their arguments (-EINVAL, logged), enqueue on the
 * given stream without any host synchronisation
 * (safe inside stream capture), check the launches (-EIO, logged) and
 * return; results are ready when the stream reaches that point. The
 * scratch buffer d_work (device memory, 16-byte aligned, owned by the
 * caller) is in use until then.
 */
#ifndef KERNELS_CUDA_MMQ_H
#define KERNELS_CUDA_MMQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* True when the mmq kernels handle this enum quant_type (on sm_80+, for n
 * a multiple of 256). */
bool cuda_mmq_supports(uint32_t type);

/* Bytes of d_work cuda_mmq needs for S activation rows of n elements. */
size_t cuda_mmq_work_bytes(uint64_t n, uint32_t S);

/* d_Y[s*ldy + r] = W[r] . d_X[s*ldx ...] for s < S, r < n_rows (prefill),
 * the contract of cuda_matmul; elements of d_Y outside those are not
 * touched. d_work holds at least cuda_mmq_work_bytes(n, S) bytes. Returns
 * 0, -EINVAL, -ENOTSUP (fall back) or -EIO. */
int cuda_mmq(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
             const float *d_X, size_t ldx, uint32_t S, float *d_Y, size_t ldy, void *d_work,
             cudaStream_t stream);

/* One destination of cuda_mmq_parts: the next `rows` weight rows of the
 * product (the parts follow each other), the part's row r of activation
 * row s at d_Y[s*ldy + r]. */
#define CUDA_MMQ_MAX_PARTS 4
struct cuda_mmq_part {
    float *d_Y;
    size_t ldy;
    uint64_t rows;
};

/* cuda_mmq over W's n_rows = the parts' rows summed, each part's outputs
 * to its own buffer: one launch (and one rounding of d_X) for matrices
 * stored back to back that their consumers want apart, the same bits as a
 * cuda_mmq of each. 1 to CUDA_MMQ_MAX_PARTS parts of at least one row. */
int cuda_mmq_parts(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n,
                   const float *d_X, size_t ldx, uint32_t S, const struct cuda_mmq_part *parts,
                   uint32_t n_parts, void *d_work, cudaStream_t stream);

/* Bytes of d_work cuda_mmq_experts needs for n_pairs pairs of rows of n
 * elements over n_expert experts (any x_div). */
size_t cuda_mmq_experts_work_bytes(uint64_t n, uint32_t n_pairs, uint32_t n_expert);

/* Routed experts, the contract of cuda_matvec_experts: for each pair
 * p < n_pairs, e = d_ids[p]; if e is outside [0, n_expert) or d_addr[e] is
 * NULL the pair is skipped (its output row untouched); else
 * d_Y[p*ldy + r] = W_e[r] . d_X[(p / x_div) * ldx ...] for r < n_rows,
 * W_e at d_addr[e] (d_addr: n_expert device pointers). The pairs are
 * grouped by expert on the device (no host round trip), so each weight
 * tile is read once for all pairs of its expert. n_expert <= 8192;
 * work_bytes >= cuda_mmq_experts_work_bytes(n, n_pairs, n_expert).
 * Returns 0, -EINVAL, -ENOTSUP (fall back) or -EIO. */
int cuda_mmq_experts(uint32_t type, const void *const *d_addr, uint32_t n_expert,
                     size_t row_bytes, uint64_t n_rows, uint64_t n, const int32_t *d_ids,
                     uint32_t n_pairs, const float *d_X, size_t ldx, uint32_t x_div, float *d_Y,
                     size_t ldy, void *d_work, size_t work_bytes, cudaStream_t stream);

/* cuda_mmq_experts (x_div 1) for the down product of gated experts: pair
 * p's activation row is silu(g) * u of its gate/up row d_GU[p*ldgu ...] (g
 * its first n floats, u the next n, ldgu >= 2n) as cuda_silu_mul computes
 * it, rounded straight from d_GU (no row of it written): the bits of
 * cuda_silu_mul then cuda_mmq_experts. grouped: d_work still holds the
 * grouping of the cuda_mmq_experts call just before on this stream with
 * this work buffer, over the same d_ids, n_pairs and n_expert and with the
 * same entries of its d_addr NULL as here (the gate/up product of the same
 * experts): it is not done again. */
int cuda_mmq_experts_glu(uint32_t type, const void *const *d_addr, uint32_t n_expert,
                         size_t row_bytes, uint64_t n_rows, uint64_t n, const int32_t *d_ids,
                         uint32_t n_pairs, const float *d_GU, size_t ldgu, bool grouped,
                         float *d_Y, size_t ldy, void *d_work, size_t work_bytes,
                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
