/*
 * cuda deltanet: the gated DeltaNet recurrence on the GPU, twin of
 * kernels/cpu/deltanet.h plus the per-head glue of worker/forward.c
 * (fw_dn_head_task): the state never leaves the card.
 * State layouts are those of the CPU twin: conv state channel-major (K-1 per
 * channel); delta state per v-head dv rows of dk floats (key index fastest).
 * Launchers validate (-EINVAL), enqueue on `stream`, check the launch (-EIO).
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
 * each channel): x rows of C floats, u rows of C floats. */
int cuda_deltanet_conv(float *d_state, const float *d_w, uint32_t K, const float *d_x, float *d_u,
                       uint32_t C, uint32_t S, cudaStream_t stream);

/* Per-layer head step for S tokens, tokens in order (decode S = 1; prefill
 * runs the same recurrence token by token, or a chunked form: results must
 * match the CPU twin within tolerance). For value head h (< nv) with key head
 * g = tiled ? h % nk : h / (nv / nk), token s:
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

#ifdef __cplusplus
}
#endif

#endif
