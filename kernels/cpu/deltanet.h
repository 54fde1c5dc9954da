/*
 * deltanet: the gated DeltaNet recurrence on the CPU (model-spec 5.6): the
 * causal depthwise conv with its ring state, the delta-rule update of one
 * value head's state matrix (token by token, or chunked for a prefill), and
 * the gated RMSNorm.
 *
 * State layouts (shared with the CUDA twin and the state snapshots):
 *   conv state: channel-major, K-1 floats per channel, oldest first;
 *   delta state of one v-head: dv rows of dk floats, element (key i, value j)
 *   at j*dk + i (key index fastest, as llama.cpp stores it).
 * Pure functions on caller buffers; any thread.
 */
#ifndef KERNELS_CPU_DELTANET_H
#define KERNELS_CPU_DELTANET_H

#include <stddef.h>
#include <stdint.h>

/* Runs one channel's causal conv + SiLU over S tokens:
 * u[s] = silu(sum_{t<K-1} w[t]*state[t] + w[K-1]*x[s]) with the window
 * shifting by one per token; x[s] is at x + s*x_stride, u[s] at
 * u + s*u_stride. state (K-1 floats) is updated to the last K-1 inputs. */
void deltanet_conv_channel(float *state, const float *w, uint32_t K, const float *x,
                           size_t x_stride, float *u, size_t u_stride, uint32_t S);

/* One token of one value head: S <- S*exp(gdec); d = (v - S^T k) * beta;
 * S <- S + k d^T; o = S^T q. q must already be scaled by 1/sqrt(dk); q and k
 * are L2-normalised key-head vectors of dk, v and o have dv. */
void deltanet_head_step(float *state, const float *q, const float *k, const float *v, float beta,
                        float gdec, uint32_t dk, uint32_t dv, float *o);

/* Tokens per chunk of deltanet_chunk_head (transformers' chunk_size). */
#define DELTANET_CHUNK 64

/* Floats of scratch deltanet_chunk_head needs for head sizes dk, dv (about
 * 4*64*dk + 2*64*dv + dk*dv + 3*64*64 floats, 306 KiB at dk = dv = 128; independent of S). */
size_t deltanet_chunk_scratch(uint32_t dk, uint32_t dv);

/* The same delta rule as deltanet_head_step over S tokens of one value head,
 * in the chunked form of transformers' torch_chunk_gated_delta_rule (chunks of
 * DELTANET_CHUNK tokens; WY form with a per-chunk triangular solve, then one
 * state product per chunk), in float32 with its order of operations, so that
 * a prefill rounds as the HF reference does. Mathematically equal to calling
 * deltanet_head_step on each token in turn with q scaled by 1/sqrt(dk).
 *   state: dv rows of dk floats (layout above), the state before token 0 on
 *          entry and after token S-1 on return;
 *   q[s] at q + s*q_stride, dk floats, L2-normalised, NOT yet scaled (the
 *          function multiplies by 1/sqrt(dk) as transformers does);
 *   k[s] at k + s*k_stride, dk floats, L2-normalised;
 *   v[s] at v + s*v_stride, dv floats;
 *   beta[s]: S floats, the write strength (already through the sigmoid);
 *   gdec[s]: S floats, the log-decay (<= 0) of token s;
 *   o[s] at o + s*o_stride receives dv floats (no overlap with the inputs);
 *   scratch: deltanet_chunk_scratch(dk, dv) floats, clobbered.
 * All pointers are borrowed for the call. S may be 0 (state unchanged). */
void deltanet_chunk_head(float *state, const float *q, size_t q_stride, const float *k,
                         size_t k_stride, const float *v, size_t v_stride, const float *beta,
                         const float *gdec, uint32_t S, uint32_t dk, uint32_t dv, float *o,
                         size_t o_stride, float *scratch);

/* y[j] = o[j] / sqrt(mean(o^2) + eps) * w[j] * silu(z[j]) for j < dv. */
void deltanet_gated_norm(float *y, const float *o, const float *z, const float *w, uint32_t dv,
                         float eps);

#endif
