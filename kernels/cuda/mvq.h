/*
 * cuda mvq: decode products (one activation row) of Q4_0, Q8_0, Q4_K, Q5_K
 * and Q6_K weights with the activations rounded to int8 per block of 32 and
 * dp4a dots, as the CPU twin's integer path computes them for Q4_0 and Q8_0
 * (kernels/cpu/matvec.c; the CPU rounds a K-type row's activations per 256,
 * llama.cpp's CUDA decode per 32 as here). cuda_matvec and
 * cuda_matvec_experts (matvec.h) call these first for one activation row
 * and fall back to their f32 kernels on -ENOTSUP (another type, rows longer
 * than 16384 elements, K-type rows not of whole 256-element super-blocks,
 * LAMINA_CUDA_MVQ=0; the Q4_K, Q5_K and Q6_K forms with LAMINA_CUDA_MVQ_K=0,
 * read at each call: cuda_mvq_k_on). Contracts as in matvec.h.
 */
#ifndef KERNELS_CUDA_MVQ_H
#define KERNELS_CUDA_MVQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

struct cuda_tail;

/* Whether these kernels take Q4_K, Q5_K and Q6_K rows now (LAMINA_CUDA_MVQ_K, or
 * the default; tests ask which reference applies). */
bool cuda_mvq_k_on(void);

/* d_y[r] = W[r] . d_x; -ENOTSUP when this kernel does not take the case,
 * -EIO for a failed launch (logged). */
int cuda_mvq(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
             const float *d_x, float *d_y, cudaStream_t stream);

/* cuda_mvq with the activation row already rounded (d_xq: the layout of
 * mvq::xq_row_bytes, 16-byte aligned, written by a launch before this one in
 * the stream, e.g. cuda_moe_combine_early's xq): the same bits as cuda_matvec
 * on the row it was rounded from. -ENOTSUP where cuda_matvec would not take
 * these kernels (cuda_mvq_pays, the type) or d_xq is unaligned. */
int cuda_mvq_xq(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                const int8_t *d_xq, float *d_y, cudaStream_t stream);

/* cuda_mvq_xq for a product that runs beside the launch just before it in the stream:
 * d_xq was written two or more launches back, and that launch neither reads nor writes
 * d_y. Its blocks compute and store before their PDL wait and wait at their end (so
 * the launch after this one still finds both done): the same bits as cuda_mvq_xq
 * (LAMINA_CUDA_BESIDE=0: its wait first, as cuda_mvq_xq). -ENOTSUP as cuda_mvq_xq. */
int cuda_mvq_xq_beside(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                       uint64_t n, const int8_t *d_xq, float *d_y, cudaStream_t stream);

/* cuda_mvq_xq for any row length these kernels take (cuda_mvq_xq_ok),
 * whether or not cuda_matvec would take them for the row (cuda_mvq_pays),
 * followed by a tail (tail.h; not a combine: -EINVAL): the same bits as
 * cuda_mvq_tail over the row the producer rounded (cuda_deltanet_conv_heads_yq
 * writes the DeltaNet output product's input so). -ENOTSUP where the type or
 * n rules these kernels out or d_xq is unaligned. */
int cuda_mvq_xq_tail(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                     uint64_t n, const int8_t *d_xq, float *d_y, const struct cuda_tail *t,
                     cudaStream_t stream);
bool cuda_mvq_xq_ok(uint32_t type, uint64_t n_rows, uint64_t n);

/* Bytes of one such rounded row of n activations (n a multiple of 32). */
size_t cuda_mvq_xq_bytes(uint64_t n);

/* cuda_matvec_experts for one activation row per pair (see matvec.h). */
int cuda_mvq_experts(uint32_t type, const void *const *d_addr, size_t row_bytes, uint64_t n_rows,
                     uint64_t n, const int32_t *d_ids, uint32_t n_pairs, const float *d_X,
                     size_t ldx, uint32_t x_div, float *d_Y, size_t ldy, cudaStream_t stream);

/* The same with the SiLU-gated input of a feed-forward down product: when
 * glu, activation row i holds gate (n floats) then up (n floats) and the
 * product takes x = silu(gate) * up as cuda_silu_mul computes it (so one
 * launch replaces cuda_silu_mul + the product, with the same result);
 * ldx >= 2n. */
int cuda_mvq_glu(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                 const float *d_x, bool glu, float *d_y, cudaStream_t stream);
int cuda_mvq_experts_glu(uint32_t type, const void *const *d_addr, size_t row_bytes,
                         uint64_t n_rows, uint64_t n, const int32_t *d_ids, uint32_t n_pairs,
                         const float *d_X, size_t ldx, uint32_t x_div, bool glu, float *d_Y,
                         size_t ldy, cudaStream_t stream);

/* Whether cuda_matvec and cuda_matvec_experts take these kernels for one
 * activation row of n over n_rows (the rule in matvec.cu; LAMINA_CUDA_MVQ=0:
 * never). */
bool cuda_mvq_pays(uint64_t n, uint64_t n_rows);

/* Whether the last product the calling thread launched here copied each
 * block's tile of rows into shared memory by one bulk copy (tma: compute
 * capability 9.0 or later; expert products that poll the router's ids, or
 * every expert product without a tail with LAMINA_CUDA_TMA=all, none with
 * "0"; a row read in one pass and the tile within 48 KiB) instead of loading
 * its words lane by lane; the outputs are the same bits either way. For
 * tests. */
bool cuda_mvq_last_tma(void);

/* Diagnostics (LAMINA_CUDA_PROBE), in a build with LAMINA_MVQ_PROBE defined
 * (`make NVCC_DEFS=-DLAMINA_MVQ_PROBE`; cuda_mvq_probe_built says; without,
 * p is never written): the next launch of these kernels by the
 * calling thread has thread 0 of each block b (grid.x * y + x, b <
 * CUDA_PROBE_MVQ_BLOCKS) write %globaltimer (ns) into p[b * CUDA_PROBE_SLOTS
 * + i] at CUDA_PROBE_MVQ_START (its start), _POLLED (ids_poll: its id
 * polled), _WAITED (its PDL wait returned), _X (its activations in shared
 * memory), _DATA (tma: its tile arrived), _STORED (its outputs
 * stored and, pf_after, the next product's share asked for) and _END (after
 * the tail); slots it does not reach stay as they
 * were. The outputs are those of a launch without. NULL: none. A launch
 * these kernels do not take leaves p for the next one: set NULL after. */
enum {
    CUDA_PROBE_MVQ_START, CUDA_PROBE_MVQ_POLLED, CUDA_PROBE_MVQ_WAITED, CUDA_PROBE_MVQ_X,
    CUDA_PROBE_MVQ_DATA, CUDA_PROBE_MVQ_STORED, CUDA_PROBE_MVQ_END
};
#define CUDA_PROBE_MVQ_BLOCKS 512
void cuda_mvq_probe_next(unsigned long long *p);
bool cuda_mvq_probe_built(void);

/* cuda_mvq_experts that also asks for the pairs' experts in a second table
 * (next_bytes each from d_next_addr[id]; NULL entries skipped) in L2 while
 * it runs: the decode gate/up product prefetches the down matrices the next
 * launch reads. n_table: entries of d_addr and d_next_addr, asked for in L2
 * before the kernel waits for the one before it (the ids pick among them;
 * 0: not). x_early: d_X was written by a launch at least two before this
 * one in the stream (kernels/cuda/pdl.cuh), so the activations are rounded
 * before the wait, beside the launch just before. The same outputs as
 * cuda_mvq_experts. d_xq (NULL: none; every pair reads one activation row,
 * n_pairs <= x_div): that row already rounded (cuda_mvq_xq's layout, e.g.
 * by cuda_matvec_tail_norm_in in the launch before), copied after the wait
 * instead of rounding d_X (the same bits where d_X rounds to it).
 * ids_poll (with n_table): before its wait each block polls its pair's id
 * until it is no longer the mark the router's top-k tail leaves
 * (cuda_tail.mark_ids; 200 rounds at most) and asks for that expert's
 * weights; after the wait it reads the id again and asks again where it
 * differs (a launch before's id read early), so the outputs never depend
 * on the poll. pf_after: each block asks for its share of the second table's
 * expert once its own rows are done (their weights arrived) instead of
 * before them, so that this product's weights come first from DRAM. */
int cuda_mvq_experts_prefetch(uint32_t type, const void *const *d_addr, size_t row_bytes,
                              uint64_t n_rows, uint64_t n, const int32_t *d_ids, uint32_t n_pairs,
                              const float *d_X, size_t ldx, uint32_t x_div, float *d_Y,
                              size_t ldy, const void *const *d_next_addr, size_t next_bytes,
                              uint32_t n_table, bool x_early, const int8_t *d_xq,
                              bool ids_poll, bool pf_after, cudaStream_t stream);

/* cuda_mvq_experts_prefetch whose launch also writes the down product's input
 * rounded (d_gq; NULL: as cuda_mvq_experts_prefetch): the pairs' rows are
 * gate (n_rows / 2) then up, and pair p's silu(gate) * up rounded as
 * cuda_mvq_experts_glu rounds it goes to d_gq + p * cuda_mvq_xq_bytes(n_rows / 2)
 * (16-byte aligned), for cuda_mvq_experts_xq_tail. Each gate tile and its up
 * tile (32 rows each) are a thread block cluster of 2. -ENOTSUP where the
 * form does not take it (compute capability below 9.0, tiles other than 32
 * rows, n_rows not a multiple of 64, tiles not copied by tma: see
 * cuda_mvq_last_tma; ids_poll off among them): launch without d_gq then,
 * nothing was enqueued. Y as without. */
int cuda_mvq_experts_prefetch_gq(uint32_t type, const void *const *d_addr, size_t row_bytes,
                                 uint64_t n_rows, uint64_t n, const int32_t *d_ids,
                                 uint32_t n_pairs, const float *d_X, size_t ldx, uint32_t x_div,
                                 float *d_Y, size_t ldy, const void *const *d_next_addr,
                                 size_t next_bytes, uint32_t n_table, bool x_early,
                                 const int8_t *d_xq, bool ids_poll, bool pf_after, int8_t *d_gq,
                                 cudaStream_t stream);

/* cuda_mvq_experts_glu_tail (tail.h) over activation rows already rounded: pair
 * p's at d_xq + p * cuda_mvq_xq_bytes(n) (cuda_mvq_experts_prefetch_gq's d_gq),
 * the same bits as the glu form over the rows they were rounded from. */
int cuda_mvq_experts_xq_tail(uint32_t type, const void *const *d_addr, size_t row_bytes,
                             uint64_t n_rows, uint64_t n, const int32_t *d_ids, uint32_t n_early,
                             uint32_t n_pairs, const int8_t *d_xq, float *d_Y,
                             const struct cuda_tail *t, cudaStream_t stream);

/* cuda_matvec_norm (matvec.h) through these kernels; -ENOTSUP where
 * cuda_mvq_norm_ok is false. */
bool cuda_mvq_norm_ok(uint32_t type, uint64_t n_rows, uint64_t n);
int cuda_mvq_norm(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                  const float *d_h, const float *d_norm_w, float eps, float *d_y,
                  cudaStream_t stream);

/* cuda_mvq followed by a tail (tail.h; checked by the caller). */
int cuda_mvq_tail(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                  const float *d_x, float *d_y, const struct cuda_tail *t, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
