/*
 * cuda tail: the small row operation that follows a decode product, run by
 * the product's own last block instead of a launch of its own. Every block
 * of the product fences its outputs and bumps a counter in device memory;
 * the block that brings the counter to the launch's block count sets it
 * back to 0 and runs the tail over the complete output. A decode layer has
 * three such boundaries (mixer output -> residual add + norm, router
 * logits -> top-k, expert outputs -> combine + next norm), each worth a
 * kernel launch per layer. A tail is one block's work after the whole
 * product, so it pays only where that work is short: on an H200 the norm
 * and top-k tails made decode 6 % faster, the combine tail (10 expert rows)
 * 9 % slower (docs/perf.md; the CUDA backend's LAMINA_CUDA_TAIL). The
 * COMBINE_COLS tail splits the combine over the product's grid columns (a
 * counter per column, the next norm left to the next layer's input product,
 * cuda_matvec_norm): as fast as the combine launch it replaces.
 *
 * Each tail computes what its stand-alone kernel computes, bit for bit: the
 * tail loops emulate that kernel's block width (the row kernels' threads own
 * strided columns and sum in a fixed tree; the tail's 256 threads play
 * those threads' parts, virtual warp by virtual warp), so fusing never
 * changes a result.
 *
 * The counter: one unsigned int per stream of launches (launches that may
 * run at the same time need their own), 0 before the first launch; each
 * launch leaves it at 0. With programmatic dependent launch a kernel may
 * start before the one before it ends, but it touches the counter only
 * after its griddepcontrol.wait, when the earlier launch has completed.
 */
#ifndef KERNELS_CUDA_TAIL_H
#define KERNELS_CUDA_TAIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

enum cuda_tail_kind {
    CUDA_TAIL_NONE = 0,
    /* the product's y (n floats) is the mixer's output delta:
     * cuda_add_rmsnorm(h, y, out, norm_w, n, 1, eps) */
    CUDA_TAIL_ADD_NORM,
    /* the product's y (E floats) are router logits: cuda_router_topk(y, E,
     * k, 1, ids, w) */
    CUDA_TAIL_TOPK,
    /* the product's y are the k (<= 16) expert rows (n floats each, ldy n) of one
     * token: cuda_moe_combine(h, y, w, k, so, shexp_gate, f, n, 1), and with
     * norm_w cuda_moe_combine_norm's norm into out */
    CUDA_TAIL_COMBINE,
    /* expert products only: the product's y are the k (<= 16) expert rows
     * of one token (ldy n) and, where so = y + k n, the shared expert's
     * output as row k: cuda_moe_combine(h, y, w, k, so, shexp_gate, f, n, 1)
     * split by the launch's grid columns: the block that completes a column
     * (every pair of its row tiles) adds those rows into h. No norm: the
     * next layer's input product normalises h (cuda_matvec_norm). */
    CUDA_TAIL_COMBINE_COLS,
};

/* Counters a COMBINE_COLS tail needs: one per grid column, at most this many. */
#define CUDA_TAIL_COLS_MAX 1024u

struct cuda_tail {
    enum cuda_tail_kind kind;
    unsigned int *counter; /* device; 0 before and after the launch (COMBINE_COLS:
                            * CUDA_TAIL_COLS_MAX of them) */
    uint32_t n;            /* ADD_NORM, COMBINE: row length */
    float eps;
    float *h;              /* ADD_NORM, COMBINE: the residual row, updated */
    const float *norm_w;   /* ADD_NORM: norm weights (NULL: 1); COMBINE: NULL = no norm */
    float *out;            /* ADD_NORM, COMBINE with norm_w: the normalised row */
    uint32_t k;            /* TOPK, COMBINE: experts per token */
    int32_t *ids;          /* TOPK: the k expert ids */
    float *w;              /* TOPK: their weights; COMBINE(_COLS): the weights read */
    const float *so;       /* COMBINE(_COLS): shared expert output or NULL */
    const float *shexp_gate; /* COMBINE(_COLS): its gate (NULL: 1) */
    const float *f;        /* COMBINE(_COLS): the normalised input the gate reads */
    /* TOPK: block 0 writes INT32_MIN into ids[0..k-1] after its PDL wait and before it lets
     * the next launch start, so that an expert product polling them (mvq.cu's ids_poll)
     * waits for this launch's picks rather than taking the launch before's */
    bool mark_ids;
    /* TOPK: the picks by k rounds of a warp arg-max (router.cuh's router_pick_rounds), not by
     * counting places: the same picks, slower (a check and a baseline) */
    bool topk_rounds;
    /* TOPK: the picks and weights by the full softmax first (router.cu), the form before
     * 2026-12-04 (cuda_router_topk_cycles' softmax): a baseline for measurements */
    bool topk_softmax;
};

/* A decode product's input formed as the product loads it: rmsnorm(h + add) * w, what
 * cuda_add_rmsnorm (and the CUDA_TAIL_ADD_NORM tail) would have written, bit for bit (the
 * same per-thread sums of a block of cuda_norm_threads(n), the same tree, the same
 * expressions). So the residual add + norm after a mixer needs neither a launch nor a tail:
 * the router and the gate/up product form it from h and the mixer's output, and the combine
 * adds the output into h (cuda_moe_combine_early's d_mix). h is not written. */
struct cuda_norm_in {
    const float *h;   /* the residual row (n floats) */
    const float *add; /* the row added to it first (the mixer's output) */
    const float *w;   /* norm weights (n), or NULL: 1 */
    float eps;
    /* the shared expert's gate (n floats), or NULL: a block of its own (past the rows) writes
     * sigmoid(gate . row) into *gs, the bits cuda_moe_combine_early computes from the row
     * (its block of cuda_norm_wide_threads(n) threads' sums and tree), so that the combine
     * reads it (cuda_moe_combine_early_mix's d_gs) instead of summing it; gs: with gate */
    const float *gate;
    float *gs;
    /* diagnostics (LAMINA_CUDA_PROBE; written only by kernels built with LAMINA_MVQ_PROBE,
     * cuda_mvq_probe_built), NULL: none: thread 0 of each block b of the product
     * (b < CUDA_PROBE_BLOCKS) writes CUDA_PROBE_SLOTS values at probe + b CUDA_PROBE_SLOTS:
     * %globaltimer (ns) at its start, after its PDL wait, once the row is formed, after its
     * products and after the tail (the launch's last block: once the tail is done) in slots
     * 0-4, the SM's clock64 at the same points in slots 8-12 */
    unsigned long long *probe;
};

#define CUDA_PROBE_BLOCKS 256
#define CUDA_PROBE_SLOTS 16

/* Whether a tail of this kind can follow a product with n_out outputs
 * (n_out: E for TOPK, n for ADD_NORM; COMBINE products write k rows of n).
 * False (logged at debug level) for arguments the tail does not take. */
bool cuda_tail_ok(const struct cuda_tail *t, uint64_t n_out);

/* Whether t may follow a plain product of n_out rows (cuda_matvec_tail,
 * cuda_mvq_xq_tail): t NULL or kind NONE, or a tail other than the combines
 * that cuda_tail_ok takes; where not, logs it as an error of what. */
bool cuda_tail_plain_ok(const struct cuda_tail *t, uint64_t n_out, const char *what);

/* cuda_matvec (matvec.h) followed by the tail: y = W x, then the tail over
 * y. t NULL or kind NONE: cuda_matvec. */
int cuda_matvec_tail(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                     uint64_t n, const float *d_x, float *d_y, const struct cuda_tail *t,
                     cudaStream_t stream);

/* Whether cuda_matvec_tail_norm_in takes this product: F32 rows (a router),
 * 16-byte aligned, n a multiple of 32 and at most 2048 (a thread's columns
 * are held in registers, the row in shared memory). */
bool cuda_matvec_norm_in_ok(uint32_t type, uint64_t n_rows, uint64_t n, size_t row_bytes);

/* cuda_matvec_tail over the row rmsnorm(nin->h + nin->add) * nin->w
 * (tail.h's cuda_norm_in: cuda_add_rmsnorm's bits), which every block forms
 * (nin->h and nin->w read before its PDL wait: h must have been written two
 * or more launches back, kernels/cuda/pdl.cuh); d_xout (NULL: none) gets
 * that row too, and d_xq (NULL: none; 16-byte aligned) the row rounded as
 * cuda_mvq_xq reads it (mvq.h), both written by the blocks, 32 columns
 * each. With nin->gate, a block past the rows writes the shared expert's gate into *nin->gs
 * (cuda_norm_in; a gate without gs, or either unaligned: -EINVAL, nothing launched).
 * The tail t (NULL, or TOPK) as cuda_matvec_tail's. -ENOTSUP (nothing launched) where
 * cuda_matvec_norm_in_ok is false or d_w is not 16-byte aligned; the same
 * y as cuda_add_rmsnorm into x, then cuda_matvec_tail. */
int cuda_matvec_tail_norm_in(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                             uint64_t n, const struct cuda_norm_in *nin, float *d_xout,
                             int8_t *d_xq, float *d_y, const struct cuda_tail *t,
                             cudaStream_t stream);

/* The decode output product of a mixer and the layer's router in one launch (sm_90,
 * thread block clusters): d_y = W xq (cuda_mvq_xq_tail without a tail: the same bits),
 * then what cuda_matvec_tail_norm_in of the F32 router d_rw (E rows of n_rows) over
 * nin (nin->add must be d_y) with the TOPK tail t would write: d_xout, d_xq_out and
 * *nin->gs the same bits, d_logits and t's ids and weights from logits summed in another
 * order (each block's rows of x = h + y times g, summed a cluster at a time into d_part,
 * the clusters' sums times the norm's scale): within rounding of the router's, so the
 * picks may differ where two logits are that close. No launch boundary between the
 * product and the router: a decode layer's mixer output and router in one kernel.
 * d_rw: F32 rows (a router; cuda_matvec_norm_in_ok's); d_rwt: NULL or d_rw transposed
 * (n_rows rows of E floats, 16-byte aligned), which the blocks then copy their columns from
 * in one contiguous read (the same bits). nin->h, nin->w and d_rw (d_rwt) are read
 * before the kernel's PDL wait: h must have been written two or more launches back
 * (kernels/cuda/pdl.cuh). d_part: scratch of at least cuda_mvq_router_part_floats(n_rows,
 * E) floats. The counter as the tails' (0 before and after). -ENOTSUP (nothing launched) where
 * cuda_mvq_router_ok is false or a buffer is unaligned for the products (xq, d_rw: 16
 * bytes); -EINVAL for a missing or bad tail or buffers (logged); -EIO for a failed launch. */
bool cuda_mvq_router_ok(uint32_t type, uint64_t n_rows, uint64_t n, uint32_t E,
                        size_t r_row_bytes);
size_t cuda_mvq_router_part_floats(uint64_t n_rows, uint32_t E);
int cuda_mvq_xq_router(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                       uint64_t n, const int8_t *d_xq, float *d_y, const void *d_rw,
                       size_t r_row_bytes, const float *d_rwt, uint32_t E,
                       const struct cuda_norm_in *nin,
                       float *d_xout, int8_t *d_xq_out, float *d_logits, float *d_part,
                       size_t part_floats, const struct cuda_tail *t, cudaStream_t stream);

/* cuda_mvq_experts_glu (mvq.h) for the k pairs of one token, then a
 * COMBINE tail over their rows (d_Y, ldy = n_rows = the tail's n), or a
 * COMBINE_COLS tail (n_pairs k, or k + 1 with so = d_Y + k n_rows); t NULL
 * or kind NONE: no tail. n_early: the entries of d_addr where the ids (and
 * a COMBINE_COLS tail's f) were written at least two launches before this
 * one in the stream: the kernel then reads them, its pairs' weights and the
 * shared-expert gate before it waits for the launch just before it (that
 * launch started only after the ones before it completed; kernels/cuda/
 * pdl.cuh); 0: after the wait. -ENOTSUP where cuda_mvq_experts_glu would
 * return it. */
int cuda_mvq_experts_glu_tail(uint32_t type, const void *const *d_addr, size_t row_bytes,
                              uint64_t n_rows, uint64_t n, const int32_t *d_ids, uint32_t n_early,
                              uint32_t n_pairs,
                              const float *d_X, size_t ldx, bool glu, float *d_Y,
                              const struct cuda_tail *t, cudaStream_t stream);

/* The decode MoE's down product and combine in one launch, for one token
 * whose experts are all on this card: h[j] += sum_{i<k} w[i] Y_i[j]
 * (+ sigmoid(shexp_gate . f) Y_k[j] where n_pairs is k + 1: the shared
 * expert as pair k), Y_p = down(id_p) . (silu(gate_p) * up_p), the gate/up
 * rows d_X (ldx >= 2F, [gate F | up F] a pair). The same bits as
 * cuda_mvq_experts_glu_tail (no tail) into Y followed by cuda_moe_combine
 * (kernels/cuda/down_combine.cu); h is not normalised (the next input
 * product does it, cuda_matvec_norm). d_Y: where the pairs' rows go as well
 * (n_pairs x n, ldy n), or NULL. The ids, the router's weights d_w, the
 * gate's input d_f and h must have been written two or more launches
 * before this one in the stream (kernels/cuda/pdl.cuh): the kernel reads
 * them, the experts' weights (d_addr[id], id < n_table; a NULL entry or an
 * id outside counts as a row of zeros) and the gate before it waits for
 * the launch just before it. -EINVAL for bad arguments (logged), -ENOTSUP
 * for a type other than Q4_0 / Q8_0 or a shape it does not take (nothing
 * launched: the caller runs the two steps), -EIO for a failed launch. */
int cuda_moe_down_combine(uint32_t type, const void *const *d_addr, uint32_t n_table,
                          size_t row_bytes, uint64_t n, uint64_t F, const int32_t *d_ids,
                          uint32_t n_pairs, uint32_t k, const float *d_X, size_t ldx,
                          const float *d_w, const float *d_shexp_gate, const float *d_f,
                          float *d_h, float *d_Y, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
