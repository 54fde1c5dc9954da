/*
 * cuda ops: the small row operations of a decoder layer on the GPU, each the
 * twin of a CPU function in kernels/cpu/ops.h, kernels/cpu/attention.h or the
 * combine steps of worker/forward.c. f32 throughout (KV cache f16 or f32).
 * Launchers validate (-EINVAL, logged), enqueue on `stream`, check the launch
 * (-EIO, logged). Row-major buffers; "rows" of `n` floats `stride` apart.
 */
#ifndef KERNELS_CUDA_OPS_H
#define KERNELS_CUDA_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[r] = rmsnorm(x[r]) * w for rows r (ops_rmsnorm); w may be NULL; y may be x.
 * Rows are x + r*x_stride, y + r*y_stride. */
int cuda_rmsnorm(float *d_y, size_t y_stride, const float *d_x, size_t x_stride,
                 const float *d_w, uint32_t n, uint32_t rows, float eps, cudaStream_t stream);

/* cuda_rmsnorm over contiguous rows, launched as cuda_moe_combine_norm's norm
 * (cuda_norm_wide_threads(n) threads, the same loop): the same bits as the
 * norm that a layer's combine computes for the next layer. The first layer of
 * a range normalises its input with it, so that cutting the layers into ranges
 * never changes a bit. */
int cuda_rmsnorm_wide(float *d_y, const float *d_x, const float *d_w, uint32_t n, uint32_t rows,
                      float eps, cudaStream_t stream);

/* Block width of the row kernels of combine.cu and cuda_rmsnorm_wide: two
 * columns a thread, 32..1024 threads. */
unsigned int cuda_norm_wide_threads(uint32_t n);

/* Block width of cuda_rmsnorm and cuda_add_rmsnorm: four columns a
 * thread, 32..256 threads. */
unsigned int cuda_norm_threads(uint32_t n);

/* Fused residual + norm: h[r] += delta[r]; y[r] = rmsnorm(h[r]) * w (rows of n,
 * contiguous). delta may be NULL (norm only). */
int cuda_add_rmsnorm(float *d_h, const float *d_delta, float *d_y, const float *d_w, uint32_t n,
                     uint32_t rows, float eps, cudaStream_t stream);

/* h[i] += d[i] for i < count. */
int cuda_add(float *d_h, const float *d_d, size_t count, cudaStream_t stream);

/* NEOX rope of the first n_rot dims of each head: token t (t < n_tok) has
 * position pos0 + t; head j of token t starts at x + t*tok_stride +
 * j*head_stride (ops_rope_neox). */
int cuda_rope_neox(float *d_x, uint32_t n_tok, size_t tok_stride, uint32_t n_heads,
                   size_t head_stride, uint32_t n_rot, uint32_t pos0, float base,
                   cudaStream_t stream);

/* Writes n_tok rows of K and V (kv_dim floats each, k/v rows tok_stride apart)
 * into the cache at positions pos0.. (rows of kv_dim, f16 when f16). */
int cuda_kv_store(void *d_kcache, void *d_vcache, bool f16, const float *d_k, const float *d_v,
                  size_t tok_stride, uint32_t kv_dim, uint32_t n_tok, uint32_t pos0,
                  cudaStream_t stream);

/* Causal GQA attention (attention_head for every token and head): token t of
 * n_tok (position pos0 + t) attends to cache positions 0..pos0+t. Query head h
 * of token t at d_q + t*q_tok_stride + h*q_head_stride (hd floats); kv head
 * h / (n_head / n_head_kv). Output head h of token t at
 * d_out + t*n_head*hd + h*hd. When gated, out *= sigmoid(gate) with the gate of
 * head h at the query pointer + hd (qwen3next layout). Long contexts are
 * split across blocks (online softmax). Over an f16 cache with hd 16, 32, 64,
 * 128 or 256 on compute capability 8.0 or later, the tensor-core kernels run
 * unless LAMINA_CUDA_ATTN_MMA=0 (read at each call; other roundings, within
 * f32's error of the CUDA-core kernels'; the same for
 * cuda_attention_decode_at and _at_xq). */
int cuda_attention(const float *d_q, size_t q_tok_stride, size_t q_head_stride,
                   const void *d_kcache, const void *d_vcache, bool f16, uint32_t n_head,
                   uint32_t n_head_kv, uint32_t hd, uint32_t n_tok, uint32_t pos0, float scale,
                   bool gated, float *d_out, cudaStream_t stream);

/* Whether the last cuda_attention, cuda_attention_decode_at or _at_xq the
 * calling thread launched ran a tensor-core kernel (tests). */
bool cuda_attention_last_mma(void);

/* cuda_attention for one token whose position is *d_pos (device memory) at
 * most max_kv - 1: the grid and workspace are sized for max_kv, so a graph
 * captured once replays for every position; same results as cuda_attention.
 * d_ws: cuda_attention_decode_ws_bytes() bytes of device memory, 16-byte
 * aligned (no allocation inside). */
size_t cuda_attention_decode_ws_bytes(uint32_t n_head, uint32_t n_head_kv, uint32_t hd,
                                      uint32_t max_kv);
int cuda_attention_decode_at(const float *d_q, size_t q_head_stride, const void *d_kcache,
                             const void *d_vcache, bool f16, uint32_t n_head, uint32_t n_head_kv,
                             uint32_t hd, const uint32_t *d_pos, uint32_t max_kv, float scale,
                             bool gated, float *d_out, float *d_ws, size_t ws_bytes,
                             cudaStream_t stream);

/* cuda_attention_decode_at that also writes the output row (n_head * hd
 * floats) rounded for the int8 decode products into d_outq (mvq.h:
 * cuda_mvq_xq_bytes(n_head * hd) bytes, 16-byte aligned; levels, scales and
 * sums of each block of 32 as cuda_mvq would round the row), which the
 * output product then copies (cuda_mvq_xq_tail) instead of rounding it in
 * each of its blocks; d_out is the same. d_outq NULL: cuda_attention_decode_at.
 * -ENOTSUP (nothing launched) where hd is not a multiple of 32 or d_outq is
 * unaligned. */
int cuda_attention_decode_at_xq(const float *d_q, size_t q_head_stride, const void *d_kcache,
                                const void *d_vcache, bool f16, uint32_t n_head,
                                uint32_t n_head_kv, uint32_t hd, const uint32_t *d_pos,
                                uint32_t max_kv, float scale, bool gated, float *d_out,
                                int8_t *d_outq, float *d_ws, size_t ws_bytes,
                                cudaStream_t stream);

/* One token's cuda_attn_prep, cuda_attention_decode_at_xq and its split merge
 * in one launch (d_outq may be NULL): q (raw, head j at d_q + j*q_head_stride,
 * its gate after hd when gated), k and v (raw, kv head j at + j*hd) of the
 * token at *d_pos; its k and v stored into the caches as cuda_attn_prep stores
 * them (the same bits), the output within f32 rounding of the three launches
 * (another order of sums; the same bits run to run). d_ws:
 * cuda_attention_fused_ws_bytes() bytes, 16-byte aligned. In an H200's decode
 * graph faster at short contexts, slower at long ones (docs/perf.md): the CUDA
 * backend calls it below a position (LAMINA_CUDA_ATTN_FUSED_BELOW).
 * LAMINA_CUDA_ATTN_SPLITS=N, 1 to 128: its splits a kv head at most, default
 * 32, read by both this and the workspace's size. -ENOTSUP (nothing launched)
 * with LAMINA_CUDA_ATTN_FUSED=0 (read at each call) and
 * where it does not take the shape: an f32 cache, hd not 32, 64, 128 or 256,
 * more than 16 query heads a kv head or 64 kv heads, a device before compute
 * capability 8.0 or short of shared memory. */
size_t cuda_attention_fused_ws_bytes(uint32_t n_head, uint32_t n_head_kv, uint32_t hd,
                                     uint32_t max_kv);
int cuda_attention_decode_fused(const float *d_q, size_t q_head_stride, const float *d_k,
                                const float *d_v, const float *d_q_norm, const float *d_k_norm,
                                float eps, uint32_t n_rot, float base, void *d_kcache,
                                void *d_vcache, bool f16, uint32_t n_head, uint32_t n_head_kv,
                                uint32_t hd, const uint32_t *d_pos, uint32_t max_kv, float scale,
                                bool gated, float *d_out, int8_t *d_outq, float *d_ws,
                                size_t ws_bytes, cudaStream_t stream);

/* Between the q/k/v products and the attention of S tokens, in one launch:
 * per-head RMSNorm of q and k (weights q_norm/k_norm of hd, each may be NULL:
 * no norm), NEOX rope of n_rot dims at positions pos (pos = *d_pos when d_pos
 * is not NULL, else pos0) + t, and k, v stored into the cache rows pos + t.
 * q head j of token t at d_q + t*q_tok_stride + j*q_head_stride; k and v head
 * j at + t*kv_tok_stride + j*hd. hd <= 256. */
int cuda_attn_prep(float *d_q, size_t q_tok_stride, size_t q_head_stride, uint32_t n_head,
                   float *d_k, const float *d_v, size_t kv_tok_stride, uint32_t n_head_kv,
                   uint32_t hd, const float *d_q_norm, const float *d_k_norm, float eps,
                   uint32_t n_rot, float base, void *d_kcache, void *d_vcache, bool f16,
                   uint32_t S, uint32_t pos0, const uint32_t *d_pos, cudaStream_t stream);

/* MoE router for S tokens: softmax over E logits, top-k (ties: lower id),
 * weights renormalised by max(sum, 6.103515625e-5) (ops_router_topk), by
 * the top k logits and their expf only (router.cu). */
int cuda_router_topk(const float *d_logits, uint32_t E, uint32_t k, uint32_t S, int32_t *d_ids,
                     float *d_w, cudaStream_t stream);

/* cuda_router_topk of one token by one warp of one block, timed: d_cycles[0..3] get the SM
 * clock cycles from the warp's start to the logits' loads through L2, their keys, the picks
 * and the last store issued.
 * rounds: the picks by k rounds of a warp arg-max instead of by counted places (the same
 * picks). softmax: the keys are the probabilities of the full softmax (max, expf of every
 * logit, the sum in double), the form before 2026-12-04, its weights renormalised with
 * llama.cpp's clamp: the same ids where no two logits round to one probability, weights
 * within an ulp or two. For tests and benchmarks. */
int cuda_router_topk_cycles(const float *d_logits, uint32_t E, uint32_t k, bool rounds,
                            bool softmax, int32_t *d_ids, float *d_w, long long *d_cycles,
                            cudaStream_t stream);

/* act[r][j] = silu(gu[r][j]) * gu[r][F + j] for rows r < rows (gate | up rows of 2F). */
int cuda_silu_mul(const float *d_gu, uint32_t F, uint32_t rows, float *d_act,
                  cudaStream_t stream);

/* MoE combine for S tokens of n: out[s] = sum_{i<k, ascending} w[s*k+i] * Y[(s*k+i)*n ...]
 * (+ sigmoid(dot(shexp_gate, f[s])) * so[s] when d_so is not NULL; the gate is 1
 * when d_shexp_gate is NULL). Then h[s] += out[s]. */
int cuda_moe_combine(float *d_h, const float *d_Y, const float *d_w, uint32_t k, const float *d_so,
                     const float *d_shexp_gate, const float *d_f, uint32_t n, uint32_t S,
                     cudaStream_t stream);

/* cuda_moe_combine (the same h, bit for bit), then y[s] = rmsnorm(h[s]) *
 * norm_w (norm_w may be NULL: no weight), bit for bit as cuda_rmsnorm_wide
 * computes it: the two launches in one. y may be f (f is read first). */
int cuda_moe_combine_norm(float *d_h, const float *d_Y, const float *d_w, uint32_t k,
                          const float *d_so, const float *d_shexp_gate, const float *d_f,
                          uint32_t n, uint32_t S, const float *d_norm_w, float eps, float *d_y,
                          cudaStream_t stream);

/* cuda_moe_combine_norm (d_y not NULL) or cuda_moe_combine (d_y NULL), the
 * same bits, for an f written at least two launches before this one in the
 * stream: the shared-expert gate is computed before the PDL wait, beside
 * the launch just before (kernels/cuda/pdl.cuh). d_xq (NULL: none; only
 * with d_y, 16-byte aligned, where cuda_moe_combine_xq_ok): each token's y
 * also rounded as the int8 decode products round their activations, in the
 * layout cuda_mvq_xq reads (kernels/cuda/mvq.h), at d_xq + s * ((n + 8 n/32)
 * rounded up to 16) bytes. */
int cuda_moe_combine_early(float *d_h, const float *d_Y, const float *d_w, uint32_t k,
                           const float *d_so, const float *d_shexp_gate, const float *d_f,
                           uint32_t n, uint32_t S, const float *d_norm_w, float eps, float *d_y,
                           int8_t *d_xq, cudaStream_t stream);

/* cuda_moe_combine_early over h + mix: each row of d_mix (S x n, the mixer's output,
 * not h) is added to h first (__fadd_rn, as cuda_add_rmsnorm adds it), then the experts'
 * rows: for a layer whose residual add + norm was formed by its consumers (tail.h's
 * cuda_norm_in) instead of written into h. d_mix NULL: cuda_moe_combine_early. d_gs (S
 * floats, or NULL): the shared expert's gates sigmoid(shexp_gate . f), summed already
 * (cuda_norm_in.gs, written two or more launches back), read instead of summed: the same
 * bits where they are the router's. */
int cuda_moe_combine_early_mix(float *d_h, const float *d_mix, const float *d_Y,
                               const float *d_w, uint32_t k, const float *d_so,
                               const float *d_shexp_gate, const float *d_f, uint32_t n,
                               uint32_t S, const float *d_norm_w, float eps, float *d_y,
                               int8_t *d_xq, const float *d_gs, cudaStream_t stream);

/* Whether cuda_moe_combine_early can write xq for n columns and k experts:
 * n a multiple of 32 and within the kernels' one-round path (at most two
 * columns a thread of cuda_norm_wide_threads(n), k <= 16). Either form (a
 * cluster a token on sm_90, or one block: before sm_90 or with
 * LAMINA_CUDA_COMBINE_CLUSTER=0) writes it. */
bool cuda_moe_combine_xq_ok(uint32_t n, uint32_t k);

/* Greedy sampling: d_out[s] = argmax of logits row s (ties: lowest id). */
int cuda_argmax(const float *d_logits, uint32_t n_vocab, uint32_t S, int32_t *d_out,
                cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
