/*
 * matvec: the CPU's weight-times-activation products. A weight row is n
 * elements of one ggml type in its GGUF blocks as stored (any byte
 * alignment, never converted up front); activations are f32.
 *
 * Every function here is pure and single-threaded: callers split row ranges
 * [r0, r1) across their own threads, and any number of threads may call at
 * once. Scratch lives on the stack (under 20 KiB per call).
 *
 * Numerics. Plain types (F32, F16, BF16) multiply in f32 and never round
 * the activations. Every block type takes llama.cpp's integer scheme
 * (model-spec 2.4): each call rounds the activations once to int8 in the
 * form matvec_x_type names (Q8_0: blocks of 32 with an f32 scale amax/127;
 * Q8_K: blocks of 256), and the block dot is an exact integer sum times the
 * product of the scales. The result is the f32-rounded dot of the
 * dequantized row with the rounded activations (matvec_dot_ref_xq; the
 * test bounds the difference by 2e-6 of sum |w_i xq_i|); against the true
 * activations (matvec_dot_ref) each element adds at most |w_i| * dx/2,
 * with dx its activation block's scale, about 1e-3 of sum |w_i x_i| in
 * practice.
 *
 * Paths: on a CPU with AVX2, FMA and F16C (checked at run time, so the same
 * binary runs on older CPUs) the integer dots use byte multiplies
 * (maddubs/madd) and plain types fused f32 FMAs; without AVX2 everything
 * takes the portable C path (the *_portable functions), the scalar
 * reference of the same integer dot (identical activation rounding) and a
 * dequantize-then-dot for plain types. Paths may differ from each other in
 * the last bits.
 *
 * Shared contract of every function below (bugs, checked with ASSERT):
 * quant_is_supported(type); n a multiple of quant_block_elems(type) (n may
 * be 0); row pointers valid for quant_row_size(type, n) bytes; activation
 * pointers valid for n floats (4-byte aligned, no stronger alignment needed).
 */
#ifndef KERNELS_CPU_MATVEC_H
#define KERNELS_CPU_MATVEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The fastest dot product of one weight row with x, in f32; the same bits
 * as matvec_rows gives for that row. */
float matvec_dot(uint32_t type, const void *row, const float *x, uint64_t n);

/* The same dot product through the portable C path only (what matvec_dot
 * runs on a CPU without AVX2, the scalar reference of the integer dot);
 * exported so tests cover it on any machine. */
float matvec_dot_portable(uint32_t type, const void *row, const float *x, uint64_t n);

/* Reference for tests: dequantizes with quant_dequantize_row and accumulates
 * each product (computed in double) in double. Slow. */
double matvec_dot_ref(uint32_t type, const void *row, const float *x, uint64_t n);

/* matvec_dot_ref with x first rounded exactly as the integer paths round it
 * (each activation replaced by q * dx in double); the same as
 * matvec_dot_ref for plain types. Slow. */
double matvec_dot_ref_xq(uint32_t type, const void *row, const float *x, uint64_t n);

/* The form activations take for a weight type: QUANT_TYPE_Q8_0 (blocks of
 * 32), QUANT_TYPE_Q8_K (blocks of 256) or QUANT_TYPE_F32 (not rounded). */
uint32_t matvec_x_type(uint32_t type);

/* True when this CPU runs the AVX2/FMA/F16C paths. */
bool matvec_has_simd(void);

/* y[r] = W[r] . x for r in [r0, r1), where W[r] starts at
 * (const char *)w + r * row_bytes and row_bytes >= quant_row_size(type, n).
 * y is indexed by absolute row: it must hold at least r1 floats; y[r] outside
 * [r0, r1) is not touched. x is rounded once per call (in segments of 8192
 * elements) and a row's result does not depend on r0 and r1. */
void matvec_rows(uint32_t type, const void *w, size_t row_bytes, const float *x, uint64_t n,
                 float *y, uint64_t r0, uint64_t r1);

/* Y[s * ldy + r] = W[r] . X[s * ldx .. s * ldx + n) for s in [0, S) and r in
 * [r0, r1); ldx >= n, ldy >= r1, and Y must not overlap X or W. Weight rows
 * are decoded once for several activation rows (block types: each weight
 * block unpacked once for 4 activation rows rounded together, in segments
 * of 2048 elements; plain types: tiles of 4 rows x 1024 elements in L1,
 * each multiplied with 2 activation rows at a time), so this is the prefill
 * and grouped-expert path. For S >= 2 each output depends only on its
 * weight row and activation row, not on S, r0, r1 or how a caller splits
 * the work; S == 1 is exactly matvec_rows (which may differ from S >= 2 in
 * the last bits). Elements of Y outside the given rows are not touched. */
void matvec_rows_batch(uint32_t type, const void *w, size_t row_bytes, const float *X,
                       size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy, uint64_t r0,
                       uint64_t r1);

/* matvec_rows_batch through the portable C path only (what runs on a CPU
 * without AVX2); exported so tests cover it on any machine. */
void matvec_rows_batch_portable(uint32_t type, const void *w, size_t row_bytes, const float *X,
                                size_t ldx, uint64_t S, uint64_t n, float *Y, size_t ldy,
                                uint64_t r0, uint64_t r1);

#endif
