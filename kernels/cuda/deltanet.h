/*
 * cuda deltanet: the gated DeltaNet recurrence on the GPU, twin of
 * kernels/cpu/deltanet.h plus the per-head glue of worker/forward.c
 * (fw_dn_head_task): the state never leaves the card.
 * State layouts are those of the CPU twin: conv state channel-major (K-1 per
 * channel); delta state per v-head dv rows of dk floats (key index fastest).
 * Launchers validate (-EINVAL), enqueue on `stream`, check the launch (-EIO).
 * On sm_90 and later the conv and step kernels chain with programmatic
 * dependent launch (kernels/cuda/pdl.cuh; LAMINA_CUDA_PDL=0: off), and the
 * token-by-token and decode kernels spread each head over a cluster of up to
 * 8 blocks, as many as fill the SMs (same results to the bit;
 * LAMINA_CUDA_DN_SPLIT=0: one block per head; 2, 4 or 8: that many blocks).
 */
#ifndef KERNELS_CUDA_DELTANET_H
#define KERNELS_CUDA_DELTANET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Causal conv + SiLU of S tokens over C channels (deltanet_conv_channel for
 * each channel): x rows of C floats, u rows of C floats; K <= 8 taps,
 * S < 2^20. */
int cuda_deltanet_conv(float *d_state, const float *d_w, uint32_t K, const float *d_x, float *d_u,
                       uint32_t C, uint32_t S, cudaStream_t stream);

/* Per-layer head step for S tokens, in order, token by token (decode S = 1;
 * prefills should use cuda_deltanet_heads_chunked below). For value head h
 * (< nv) with key head g = tiled ? h % nk : h / (nv / nk), token s:
 *   q = l2norm(u[s][g*dk ..]) / sqrt(dk), k = l2norm(u[s][nk*dk + g*dk ..]),
 *   v = u[s][2*nk*dk + h*dv ..], beta = sigmoid(b[s*nv+h]),
 *   gdec = a[h] * softplus(alpha[s*nv+h] + dt[h]),
 *   delta rule on the state of head h (deltanet_head_step),
 *   y[s][h*dv ..] = rmsnorm(o) * norm_w * silu(z[s][h*dv ..]) (eps).
 * u rows have 2*nk*dk + nv*dv floats; z and y rows nv*dv; b, alpha rows nv. */
int cuda_deltanet_heads(float *d_state, const float *d_u, const float *d_b, const float *d_alpha,
                        const float *d_a, const float *d_dt, const float *d_z,
                        const float *d_norm_w, float *d_y, uint32_t nk, uint32_t nv, uint32_t dk,
                        uint32_t dv, bool tiled, uint32_t S, float eps, cudaStream_t stream);

/* cuda_deltanet_conv (C = 2*nk*dk + nv*dv channels, S = 1) and then
 * cuda_deltanet_heads (S = 1) in one launch, for a decode step: x is the
 * token's conv input (C floats: q | k | v), the conv outputs stay on chip
 * (no u is written); conv state, delta state and y come out equal bit for
 * bit to the two launches'. nk <= 1024. Uses device-wide counters per key
 * head (left zero): launches on one device must not run concurrently. */
int cuda_deltanet_conv_heads(float *d_conv_state, const float *d_conv_w, uint32_t K,
                             const float *d_x, float *d_state, const float *d_b,
                             const float *d_alpha, const float *d_a, const float *d_dt,
                             const float *d_z, const float *d_norm_w, float *d_y, uint32_t nk,
                             uint32_t nv, uint32_t dk, uint32_t dv, bool tiled, float eps,
                             cudaStream_t stream);

/* cuda_deltanet_conv_heads that also writes y rounded for the int8 decode
 * products into d_yq (mvq.h: cuda_mvq_xq_bytes(nv * dv) bytes, 16-byte
 * aligned; levels, scales and sums of each block of 32 as cuda_mvq would
 * round y), which the output product then copies (cuda_mvq_xq_tail) instead
 * of rounding y in each of its blocks; y, the states and the yq's source
 * values are those of cuda_deltanet_conv_heads. -ENOTSUP (nothing launched)
 * where the launch's blocks would not hold whole blocks of 32 rows of a
 * head (dv not a multiple of 32, or the split of the device leaves fewer
 * or more than 32k <= 128 rows a block) or d_yq is unaligned. d_yq NULL:
 * cuda_deltanet_conv_heads. early: the caller's promise that the conv and
 * delta states were last written two or more launches before this one on
 * the stream (kernels/cuda/pdl.cuh; a decode step's input product runs
 * between), so that the launch may read them before its PDL wait (on sm_90,
 * where it splits the heads; LAMINA_CUDA_DN_EARLY=0 declines): the same
 * bits. */
int cuda_deltanet_conv_heads_yq(float *d_conv_state, const float *d_conv_w, uint32_t K,
                                const float *d_x, float *d_state, const float *d_b,
                                const float *d_alpha, const float *d_a, const float *d_dt,
                                const float *d_z, const float *d_norm_w, float *d_y,
                                int8_t *d_yq, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                                bool tiled, float eps, bool early, cudaStream_t stream);

/* The layer's stacked decode input product (rows q | k | v | z | beta |
 * alpha of the weights w, type Q4_0 or Q8_0, rows of n elements, over the
 * normalised activation row x, as cuda_matvec computes it with the int8
 * kernels: the same bits, into dec, 2*nk*dk + 2*nv*dv + 2*nv floats) and
 * then cuda_deltanet_conv_heads over dec in one launch (a thread block
 * cluster per key head computes the rows its heads read; sm_90 and later).
 * -ENOTSUP (nothing launched: the caller runs the product and
 * cuda_deltanet_conv_heads) where the device, the type, n, the int8 kernels'
 * choice (cuda_mvq_pays), the heads' cluster shape (every cluster resident
 * at once) or LAMINA_CUDA_DN_SPLIT=0 rule it out; -EINVAL for bad arguments, -EIO for a
 * failed launch or device query. Same state contracts as
 * cuda_deltanet_conv_heads, and like it launches on one device must not run
 * concurrently. */
int cuda_deltanet_in_conv_heads(uint32_t type, const void *d_w, size_t row_bytes, uint32_t n,
                                const float *d_x, float *d_dec, float *d_conv_state,
                                const float *d_conv_w, uint32_t K, float *d_state,
                                const float *d_a, const float *d_dt, const float *d_norm_w,
                                float *d_y, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
                                bool tiled, float eps, cudaStream_t stream);

/* cuda_deltanet_in_conv_heads' product and step in one launch without
 * clusters: the key heads' rows cut into shares of whole row tiles, as many
 * blocks as two an SM hold (the plain int8 product's width), and each value
 * head's conv + heads step run in one block of the launch once the rows
 * that head reads are in (a counter per value head): in a block named for
 * it in advance that waits for them (a bounded wait: past it, the block that
 * completes them), or with LAMINA_CUDA_DN_TAIL=last (read at each launch)
 * in the block that completes them, while the other blocks go on. d_xq: the activation row already rounded (cuda_mvq_xq's layout,
 * 16-byte aligned; the previous layer's combine writes it), or NULL: d_x
 * (floats) rounded by each block. d_yq: y also rounded for the output
 * product as cuda_deltanet_conv_heads_yq writes it (16-byte aligned, dv a
 * multiple of 32), or NULL. dec, y, yq and both states equal the product
 * then cuda_deltanet_conv_heads(_yq) bit for bit. sm_90 and later, Q4_0 or
 * Q8_0 rows the int8 kernels take (cuda_mvq_pays); -ENOTSUP (nothing
 * launched) otherwise, -EINVAL for bad arguments, -EIO for a failed launch.
 * Launches on one device must not run concurrently (device counters). */
int cuda_deltanet_in_tail(uint32_t type, const void *d_w, size_t row_bytes, uint32_t n,
                          const float *d_x, const int8_t *d_xq, float *d_dec, float *d_conv_state,
                          const float *d_conv_w, uint32_t K, float *d_state, const float *d_a,
                          const float *d_dt, const float *d_norm_w, float *d_y, int8_t *d_yq,
                          uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv, bool tiled,
                          float eps, cudaStream_t stream);

/* Bytes of work memory cuda_deltanet_heads_chunked needs for nv value heads
 * of dk x dv and S tokens: 0 when those S tokens take the token-by-token
 * kernel (S < 16, or dk != dv, or dk not 64 or 128), else about
 * nv * ceil(S / 64) * 147 KiB at dk = dv = 128 (37.7 MB for nv 32, S 512). */
size_t cuda_deltanet_work_bytes(uint32_t nv, uint32_t dk, uint32_t dv, uint32_t S);

/* cuda_deltanet_heads with the same arguments and results, for prefills: S
 * tokens in the chunked form of deltanet_chunk_head (chunks of 64 tokens,
 * products on tensor cores in tf32 with f32 accumulation: outputs and state
 * match the CPU twin to about 1e-3 relative L2, not to f32 rounding) when
 * cuda_deltanet_work_bytes(nv, dk, dv, S) > 0 and the device is sm_80 or
 * later; otherwise exactly cuda_deltanet_heads (d_work unused, may be NULL).
 * d_work: work_bytes >= cuda_deltanet_work_bytes(nv, dk, dv, S) bytes of
 * device memory, 32-byte aligned, borrowed until the work on `stream` ends
 * (contents clobbered; no state lives there). The state keeps the layout
 * above, so decode steps continue from it. -EINVAL for bad shapes or a short
 * or misaligned work buffer, -EIO for a failed device query or launch. */
int cuda_deltanet_heads_chunked(float *d_state, const float *d_u, const float *d_b,
                                const float *d_alpha, const float *d_a, const float *d_dt,
                                const float *d_z, const float *d_norm_w, float *d_y, uint32_t nk,
                                uint32_t nv, uint32_t dk, uint32_t dv, bool tiled, uint32_t S,
                                float eps, void *d_work, size_t work_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
