/*
 * mvq.cuh: the per-block pieces of the int8 decode products (mvq.cu): the
 * row-format constants of Q4_0 and Q8_0, the load of the 4-byte words
 * around a weight block, one block's dot with an activation block rounded
 * to int8, the rounding of one activation block by a warp, and the lane
 * count per row. Shared by mvq.cu and the fused DeltaNet input
 * (deltanet.cu), so that a row computed by either comes out with the same
 * bits. Private to the .cu files of kernels/cuda.
 */
#ifndef KERNELS_CUDA_MVQ_CUH
#define KERNELS_CUDA_MVQ_CUH

#include <stdint.h>

#include <cuda_fp16.h>

extern "C" {
#include "model/quant.h"
}

namespace mvq {

template <int TYPE>
struct Blk;

template <>
struct Blk<QUANT_TYPE_Q4_0> {
    static constexpr int BYTES = 18, WORDS = 5;
};

template <>
struct Blk<QUANT_TYPE_Q8_0> {
    static constexpr int BYTES = 34, WORDS = 9;
};

/* The words around weight block b of a row: base aligned down to 4 bytes.
 * SHARED: the row is a copy in shared memory that keeps its bytes' places
 * modulo 4 (the same words and shift), read by plain loads; otherwise the
 * row is in global memory, read through the read-only path. */
template <int TYPE, bool SHARED = false>
__device__ __forceinline__ void load_block(const uint8_t *row, uint32_t b, uint32_t (&v)[9],
                                           uint32_t *shift)
{
    const uintptr_t at =
        reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(b) * Blk<TYPE>::BYTES;
    const uint32_t *p = reinterpret_cast<const uint32_t *>(at & ~static_cast<uintptr_t>(3));
    *shift = static_cast<uint32_t>(at & 3) * 8;
#pragma unroll
    for (int i = 0; i < Blk<TYPE>::WORDS; i++)
        v[i] = SHARED ? p[i] : __ldg(p + i);
}

/* Integer part and scale of one block dot: returns dw * (dx * isum - c * s). */
template <int TYPE>
__device__ __forceinline__ float block_dot(const uint32_t (&v)[9], uint32_t shift,
                                           const int4 &xa, const int4 &xb, float dx, float sx)
{
    /* byte k of the block = byte (shift/8 + k) of the word run */
    const uint32_t d16 = __funnelshift_rc(v[0], v[1], shift) & 0xFFFFu;
    const float dw = __half2float(__ushort_as_half(static_cast<unsigned short>(d16)));
    const uint32_t qs = shift + 16; /* quants start at byte 2: 16 or 32 bits in */
    uint32_t q[8];
#pragma unroll
    for (int i = 0; i < (TYPE == QUANT_TYPE_Q4_0 ? 4 : 8); i++)
        q[i] = qs >= 32 ? v[i + 1] : __funnelshift_rc(v[i], v[i + 1], qs);
    const int xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int sum = 0;
    if constexpr (TYPE == QUANT_TYPE_Q4_0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sum = __dp4a(static_cast<int>(q[i] & 0x0F0F0F0Fu), xw[i], sum);
            sum = __dp4a(static_cast<int>((q[i] >> 4) & 0x0F0F0F0Fu), xw[4 + i], sum);
        }
        return dw * (dx * static_cast<float>(sum) - 8.0f * sx);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            sum = __dp4a(static_cast<int>(q[i]), xw[i], sum);
        return dw * (dx * static_cast<float>(sum));
    }
}

/* Warp lanes per row for rows of nb blocks (mvq's choice: the lanes and
 * their reduction tree fix the bits of a row). */
__host__ __device__ constexpr uint32_t lanes_per_row(uint32_t nb)
{
    return nb >= 64 ? 32 : nb >= 32 ? 16 : 8;
}

/* One activation block (32 elements, lane j holds xv = element j) rounded
 * by a warp: lane j's level q = round(x * 127 / amax), the block's scale
 * d = amax / 127 and scale x level sum s (every lane gets them); every lane
 * must call it (shuffles). */
static __device__ __forceinline__ void round_levels(float xv, int &q, float &d, float &s)
{
    float amax = fabsf(xv);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    q = __float2int_rn(xv * id);
    int qs = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        qs += __shfl_xor_sync(0xFFFFFFFFu, qs, o);
    d = amax / 127.0f;
    s = d * static_cast<float>(qs);
}

/* round_levels of activation block b into s_q[b * 32 + j] (lane j), s_d[b]
 * and s_s[b] (lane 0); `store` false for a b past the row. */
static __device__ __forceinline__ void round_block(float xv, uint32_t b, bool store, int8_t *s_q,
                                            float *s_d, float *s_s)
{
    const int lane = threadIdx.x & 31;
    int q;
    float d, sc;
    round_levels(xv, q, d, sc);
    if (store) {
        s_q[b * 32 + lane] = static_cast<int8_t>(q);
        if (lane == 0) {
            s_d[b] = d;
            s_s[b] = sc;
        }
    }
}

/* Bytes of one activation row of n (a multiple of 32) rounded for these
 * products, as a producer writes it for them (cuda_moe_combine_early's xq)
 * and as they keep it in shared memory: n levels (int8), then n/32 scales
 * (f32), then n/32 scale x level sums (f32); rows 16-byte aligned. */
__host__ __device__ constexpr size_t xq_row_bytes(size_t n)
{
    return (n + 8 * (n / 32) + 15) / 16 * 16;
}

} /* namespace mvq */

#endif
