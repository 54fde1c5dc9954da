/*
 * cuda sgemm: Y[s*ldy + r] = W[r] . X[s*ldx ..] for F32 weights (rows
 * row_bytes apart) and S activation rows, a tiled f32 product on the CUDA
 * cores (see sgemm.cu). cuda_matmul calls it for F32 weights and S >= 16.
 * -EINVAL for bad arguments, -EIO for a failed launch (both logged).
 */
#ifndef KERNELS_CUDA_SGEMM_H
#define KERNELS_CUDA_SGEMM_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

int cuda_sgemm_nt(const float *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                  const float *d_X, size_t ldx, uint32_t S, float *d_Y, size_t ldy,
                  cudaStream_t stream);

/* The same with the form chosen: tile 32 or 64 (rows of Y and of W a block)
 * and split 1 (every tile the same bits: one chain of FMAs an output) or 4
 * (tile 32 only: four chains over quarters of the row, summed in one fixed
 * order; other bits than split 1, the same at every run). Tile 0 and split
 * 0 for cuda_sgemm_nt's choice: 64 where every multiprocessor gets two such
 * blocks, else 32, split 4 where those tiles give the multiprocessors under
 * four blocks each and rows are at least 1024 long. */
int cuda_sgemm_nt_form(uint32_t tile, uint32_t split, const float *d_w, size_t row_bytes,
                       uint64_t n_rows, uint64_t n, const float *d_X, size_t ldx, uint32_t S,
                       float *d_Y, size_t ldy, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
