/*
 * mvq.cuh: the per-unit pieces of the int8 decode products (mvq.cu): the
 * row-format constants of Q4_0, Q8_0, Q4_K, Q5_K and Q6_K, the load of the 4-byte
 * words of a weight unit, one unit's dot with its activation blocks rounded
 * to int8, the rounding of one activation block by a warp, and the lane
 * count per row. Shared by mvq.cu, the fused DeltaNet input (deltanet.cu)
 * and the down product + combine (down_combine.cu), so that a row computed
 * by any comes out with the same bits. Private to the .cu files of
 * kernels/cuda; the unit pieces compile for the host too (a C++ compiler
 * without CUDA: the intrinsics they use get portable twins), so that
 * tests/test_mvq_units.cpp checks each type's unit dot against the CPU's
 * dequantization without a GPU. The device code inlines to the intrinsics.
 */
#ifndef KERNELS_CUDA_MVQ_CUH
#define KERNELS_CUDA_MVQ_CUH

#include <stdint.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define MVQ_FN __device__ __forceinline__
#define MVQ_HD __host__ __device__
#else
#define MVQ_FN inline
#define MVQ_HD
/* CUDA's vector types of four ints, for the host */
struct int4 {
    int x, y, z, w;
};
struct uint4 {
    unsigned int x, y, z, w;
};
struct uint2 {
    unsigned int x, y;
};
#endif

extern "C" {
#include "model/quant.h"
}

namespace mvq {

#ifdef __CUDACC__
template <class T>
MVQ_FN T ldg(const T *p)
{
    return __ldg(p);
}

MVQ_FN uint32_t funnel_rc(uint32_t lo, uint32_t hi, uint32_t shift)
{
    return __funnelshift_rc(lo, hi, shift);
}

MVQ_FN int dp4a(int a, int b, int c)
{
    return __dp4a(a, b, c);
}

MVQ_FN float half_bits(uint32_t h)
{
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
#else
template <class T>
inline T ldg(const T *p)
{
    return *p;
}

/* __funnelshift_rc: the low 32 bits of hi:lo shifted right by min(shift, 32). */
inline uint32_t funnel_rc(uint32_t lo, uint32_t hi, uint32_t shift)
{
    const uint64_t v = static_cast<uint64_t>(hi) << 32 | lo;
    return static_cast<uint32_t>(v >> (shift < 32 ? shift : 32));
}

/* __dp4a: c plus the sum of the four signed byte products of a and b. */
inline int dp4a(int a, int b, int c)
{
    for (int k = 0; k < 4; k++)
        c += static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * k)) *
             static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * k));
    return c;
}

inline float half_bits(uint32_t h)
{
    return quant_f16_to_f32(static_cast<uint16_t>(h));
}
#endif

template <int TYPE>
struct Blk;

/* A weight unit: what one lane takes at a time, XB activation blocks of 32
 * elements; WORDS: the 4-byte words a lane holds for it. Q4_0 and Q8_0: one
 * block of 32 (BYTES each, 2-byte aligned). Q4_K: half of the two quarters
 * of a 256-element super-block (BYTES 144: d, dmin, 12 bytes of 6-bit
 * scales and mins, 128 bytes of nibbles) that share 32 bytes of nibbles:
 * unit b is super-block b / 4, its sub-blocks 2 (b % 4) (the low nibbles)
 * and 2 (b % 4) + 1 (the high ones), held as the 4 header words and those 8
 * nibble words. Q5_K (BYTES 176: d, dmin, scales, qh[32], qs[128]): as Q4_K,
 * its 8 words of high bits (bit 2 (b % 4) of qh[l] is 16 in the low
 * nibbles' level l, the next bit in the high ones') after the nibbles'.
 * Q6_K (BYTES 210: ql[128], qh[64], 16 int8 scales of 16
 * elements, d): unit b is super-block b / 4, half n = (b / 2) % 2, h = b %
 * 2: its blocks 128n + 32h + [0, 32) (the low nibbles of ql[64n + 32h +
 * l] and bits 2h of qh[32n + l]) and that + 64 (the high nibbles, bits 4 +
 * 2h), activation blocks 8 (b / 4) + 4n + h and that + 2 (unit_block);
 * held as the 9 words around those 32 bytes of ql, the 9 around the 32 of
 * qh (a super-block is 2-byte aligned every other one), the blocks' four
 * scale bytes and d's two bytes. */
template <>
struct Blk<QUANT_TYPE_Q4_0> {
    static constexpr int BYTES = 18, WORDS = 5, XB = 1;
};

template <>
struct Blk<QUANT_TYPE_Q8_0> {
    static constexpr int BYTES = 34, WORDS = 9, XB = 1;
};

template <>
struct Blk<QUANT_TYPE_Q4_K> {
    static constexpr int BYTES = 144, WORDS = 12, XB = 2;
};

template <>
struct Blk<QUANT_TYPE_Q5_K> {
    static constexpr int BYTES = 176, WORDS = 20, XB = 2;
};

template <>
struct Blk<QUANT_TYPE_Q6_K> {
    static constexpr int BYTES = 210, WORDS = 24, XB = 2;
};

/* Activation block i (< XB) of weight unit b. */
template <int TYPE>
MVQ_HD constexpr uint32_t unit_block(uint32_t b, uint32_t i)
{
    return TYPE == QUANT_TYPE_Q6_K ? 8 * (b >> 2) + 4 * ((b >> 1) & 1) + (b & 1) + 2 * i
                                   : b * Blk<TYPE>::XB + i;
}

/* v[i .. i + 3] = the four words of w. */
template <int N>
MVQ_FN void put4(uint32_t (&v)[N], int i, const uint4 &w)
{
    v[i] = w.x;
    v[i + 1] = w.y;
    v[i + 2] = w.z;
    v[i + 3] = w.w;
}

/* The words of weight unit b of a row (Blk). Q4_0, Q8_0: the words around
 * the block, base aligned down to 4 bytes, *shift its byte offset in bits.
 * Q4_K, Q5_K: the header, nibble (and high-bit) words in place, 16 bytes a load where the
 * super-block is at a 16-byte boundary (shift, which the dot does not
 * need, is the unit's quarter b % 4); a super-block not 4-byte aligned (a
 * row of a file whose alignment is 2: never in the buffers lamina fills)
 * is read byte by byte into the same words. Q6_K: the words around its ql
 * and qh runs (their offsets in the super-block are multiples of 4, so one
 * shift, in bits 0-4 of *shift, serves both; read 8 bytes a load), its scale
 * and d bytes one a word (read from the three words that hold them); bit 5
 * of *shift is h. SHARED: the row is a copy in
 * shared memory that keeps its bytes' places modulo 8 (the same words and
 * shift; mvq.cu's tiles keep them modulo 16), read by plain loads; otherwise the row is in global memory, read
 * through the read-only path. */
template <int TYPE, bool SHARED = false, int N>
MVQ_FN void load_block(const uint8_t *row, uint32_t b, uint32_t (&v)[N], uint32_t *shift)
{
    static_assert(N >= Blk<TYPE>::WORDS, "room for the unit's words");
    if constexpr (TYPE == QUANT_TYPE_Q6_K) {
        const uint8_t *sb = row + static_cast<size_t>(b >> 2) * Blk<TYPE>::BYTES;
        const uint32_t n = (b >> 1) & 1u, h = b & 1u;
        const uintptr_t ql = reinterpret_cast<uintptr_t>(sb) + 64 * n + 32 * h;
        *shift = static_cast<uint32_t>(ql & 3) * 8 | h << 5;
        /* the 9 words of each run as 5 loads of 8 bytes from the 8-byte boundary at or
         * before it (ql and qh sit at the same offset modulo 8: 64n + 32h and 128 + 32n),
         * then the 9 from the second word on where the run starts 4 or more bytes past
         * it: the words of 4-byte loads, in 10 load instructions instead of 18 */
        const uint2 *pl = reinterpret_cast<const uint2 *>(ql & ~static_cast<uintptr_t>(7));
        const uint2 *ph = reinterpret_cast<const uint2 *>(
            (reinterpret_cast<uintptr_t>(sb) + 128 + 32 * n) & ~static_cast<uintptr_t>(7));
        uint32_t lw[10], hw[10];
#pragma unroll
        for (int i = 0; i < 5; i++) {
            const uint2 a = SHARED ? pl[i] : ldg(pl + i), c = SHARED ? ph[i] : ldg(ph + i);
            lw[2 * i] = a.x, lw[2 * i + 1] = a.y;
            hw[2 * i] = c.x, hw[2 * i + 1] = c.y;
        }
        const bool up = (ql & 4) != 0;
#pragma unroll
        for (int i = 0; i < 9; i++) {
            v[i] = up ? lw[i + 1] : lw[i];
            v[9 + i] = up ? hw[i + 1] : hw[i];
        }
        /* the scale bytes 0, 1, 4, 5 (2-byte aligned: a pair never straddles a word) and
         * d's two bytes, from three words */
        const uintptr_t sc = reinterpret_cast<uintptr_t>(sb) + 192 + 8 * n + 2 * h;
        const uint32_t *ps = reinterpret_cast<const uint32_t *>(sc & ~static_cast<uintptr_t>(3));
        const uint32_t *pd = reinterpret_cast<const uint32_t *>(
            (reinterpret_cast<uintptr_t>(sb) + 208) & ~static_cast<uintptr_t>(3));
        const uint32_t s0 = SHARED ? ps[0] : ldg(ps), s1 = SHARED ? ps[1] : ldg(ps + 1),
                       wd = SHARED ? pd[0] : ldg(pd);
        const uint32_t ss = static_cast<uint32_t>(sc & 3) * 8,
                       sd = static_cast<uint32_t>((reinterpret_cast<uintptr_t>(sb) + 208) & 3) * 8;
        v[18] = (s0 >> ss) & 0xFFu;
        v[19] = (s0 >> (ss + 8)) & 0xFFu;
        v[20] = (s1 >> ss) & 0xFFu;
        v[21] = (s1 >> (ss + 8)) & 0xFFu;
        v[22] = (wd >> sd) & 0xFFu;
        v[23] = (wd >> (sd + 8)) & 0xFFu;
    } else if constexpr (TYPE == QUANT_TYPE_Q4_K || TYPE == QUANT_TYPE_Q5_K) {
        /* Q5_K: the nibbles at 48 (after 32 bytes of high bits at 16), those
         * 8 words of high bits after the nibbles' */
        constexpr bool k5 = TYPE == QUANT_TYPE_Q5_K;
        constexpr uint32_t qs0 = k5 ? 48 : 16;
        const uint8_t *sb = row + static_cast<size_t>(b >> 2) * Blk<TYPE>::BYTES;
        const uint32_t g = b & 3u;
        *shift = g;
        if ((reinterpret_cast<uintptr_t>(sb) & 15) == 0) {
            /* a super-block at a 16-byte boundary (every one of a row that starts at one: 144
             * and 176 are multiples of 16): the same words, 16 bytes a load */
            const uint4 *h = reinterpret_cast<const uint4 *>(sb);
            const uint4 *q = h + qs0 / 16 + 2 * g;
            put4(v, 0, SHARED ? h[0] : ldg(h));
            put4(v, 4, SHARED ? q[0] : ldg(q));
            put4(v, 8, SHARED ? q[1] : ldg(q + 1));
            if constexpr (k5) {
                put4(v, 12, SHARED ? h[1] : ldg(h + 1));
                put4(v, 16, SHARED ? h[2] : ldg(h + 2));
            }
        } else if ((reinterpret_cast<uintptr_t>(sb) & 3) == 0) {
            const uint32_t *h = reinterpret_cast<const uint32_t *>(sb);
            const uint32_t *q = h + qs0 / 4 + 8 * g;
#pragma unroll
            for (int i = 0; i < 4; i++)
                v[i] = SHARED ? h[i] : ldg(h + i);
#pragma unroll
            for (int i = 0; i < 8; i++)
                v[4 + i] = SHARED ? q[i] : ldg(q + i);
            if constexpr (k5)
#pragma unroll
                for (int i = 0; i < 8; i++)
                    v[12 + i] = SHARED ? h[4 + i] : ldg(h + 4 + i);
        } else {
#pragma unroll
            for (int i = 0; i < Blk<TYPE>::WORDS; i++) {
                const uint8_t *p = sb + (i < 4    ? 4 * i
                                         : i < 12 ? qs0 + 32 * g + 4 * (i - 4)
                                                  : 16 + 4 * (i - 12));
                uint32_t w = 0;
#pragma unroll
                for (int k = 0; k < 4; k++)
                    w |= static_cast<uint32_t>(SHARED ? p[k] : ldg(p + k)) << (8 * k);
                v[i] = w;
            }
        }
    } else {
        const uintptr_t at =
            reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(b) * Blk<TYPE>::BYTES;
        const uint32_t *p = reinterpret_cast<const uint32_t *>(at & ~static_cast<uintptr_t>(3));
        *shift = static_cast<uint32_t>(at & 3) * 8;
#pragma unroll
        for (int i = 0; i < Blk<TYPE>::WORDS; i++)
            v[i] = SHARED ? p[i] : ldg(p + i);
    }
}

/* Integer part and scale of one block dot (Q4_0, Q8_0): returns
 * dw * (dx * isum - c * s). */
template <int TYPE, int N>
MVQ_FN float block_dot(const uint32_t (&v)[N], uint32_t shift,
                                           const int4 &xa, const int4 &xb, float dx, float sx)
{
    static_assert(TYPE == QUANT_TYPE_Q4_0 || TYPE == QUANT_TYPE_Q8_0, "one block of 32");
    /* byte k of the block = byte (shift/8 + k) of the word run */
    const uint32_t d16 = funnel_rc(v[0], v[1], shift) & 0xFFFFu;
    const float dw = half_bits(d16);
    const uint32_t qs = shift + 16; /* quants start at byte 2: 16 or 32 bits in */
    uint32_t q[8];
#pragma unroll
    for (int i = 0; i < (TYPE == QUANT_TYPE_Q4_0 ? 4 : 8); i++)
        q[i] = qs >= 32 ? v[i + 1] : funnel_rc(v[i], v[i + 1], qs);
    const int xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int sum = 0;
    if constexpr (TYPE == QUANT_TYPE_Q4_0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sum = dp4a(static_cast<int>(q[i] & 0x0F0F0F0Fu), xw[i], sum);
            sum = dp4a(static_cast<int>((q[i] >> 4) & 0x0F0F0F0Fu), xw[4 + i], sum);
        }
        return dw * (dx * static_cast<float>(sum) - 8.0f * sx);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            sum = dp4a(static_cast<int>(q[i]), xw[i], sum);
        return dw * (dx * static_cast<float>(sum));
    }
}

/* The activation side of one weight unit: its XB blocks' levels (two int4
 * a block), scales and scale x level sums, from the layout of round_block. */
template <int TYPE>
struct UnitX {
    int4 q[2 * Blk<TYPE>::XB];
    float d[Blk<TYPE>::XB], s[Blk<TYPE>::XB];
};

template <int TYPE>
MVQ_FN UnitX<TYPE> unit_x(const int8_t *s_q, const float *s_d, const float *s_s, uint32_t b)
{
    UnitX<TYPE> x;
    constexpr int XB = Blk<TYPE>::XB;
#pragma unroll
    for (int i = 0; i < XB; i++) {
        const uint32_t k = unit_block<TYPE>(b, i);
        const int4 *q = reinterpret_cast<const int4 *>(s_q + static_cast<size_t>(k) * 32);
        x.q[2 * i] = q[0];
        x.q[2 * i + 1] = q[1];
        x.d[i] = s_d[k];
        x.s[i] = s_s[k];
    }
    return x;
}

/* Sub-block j's 6-bit scale and min of a Q4_K or Q5_K super-block from the bytes k
 * = j % 4 of its scale words a (bytes 0-3), m (4-7) and c (8-11), hi: j >= 4
 * (ggml's get_scale_min_k4). */
MVQ_FN void q4k_scale_min(uint32_t a, uint32_t m, uint32_t c, uint32_t k, bool hi, float &sc,
                          float &mn)
{
    const uint32_t A = (a >> (8 * k)) & 0xFFu, B = (m >> (8 * k)) & 0xFFu,
                   C = (c >> (8 * k)) & 0xFFu;
    const uint32_t s = hi ? (C & 0x0Fu) | ((A >> 6) << 4) : A & 63u;
    const uint32_t n = hi ? (C >> 4) | ((B >> 6) << 4) : B & 63u;
    sc = static_cast<float>(s);
    mn = static_cast<float>(n);
}

/* A Q6_K word's four 6-bit levels (0..63 a byte) minus 32, as signed bytes:
 * + 96 a byte (no carry), then the top bit flipped (mmq.cu's sub32). */
MVQ_FN uint32_t q6k_centre(uint32_t w)
{
    return (w + 0x60606060u) ^ 0x80808080u;
}

/* One weight unit's dot with its activation blocks. Q4_0, Q8_0: block_dot.
 * Q4_K, Q5_K: sub-blocks j0 = 2g (low nibbles) and j1 = 2g + 1 (high),
 * levels n in 0..15 (Q5_K: 0..31, a high bit each), w = d sc n - dmin mn:
 *   d (sc0 dx0 isum0 + sc1 dx1 isum1) - dmin (mn0 sx0 + mn1 sx1)
 * Q6_K: blocks A and B, each two halves of 16 with an int8 scale, levels
 * centred to n - 32: d (dxA (scA0 isumA0 + scA1 isumA1) + dxB (...)).
 * The integer sums exact in int32. */
template <int TYPE, int N>
MVQ_FN float unit_dot(const uint32_t (&v)[N], uint32_t shift, const UnitX<TYPE> &x)
{
    if constexpr (TYPE == QUANT_TYPE_Q6_K) {
        const uint32_t s = shift & 31u, h = shift >> 5;
        const int xa[8] = {x.q[0].x, x.q[0].y, x.q[0].z, x.q[0].w,
                           x.q[1].x, x.q[1].y, x.q[1].z, x.q[1].w};
        const int xb[8] = {x.q[2].x, x.q[2].y, x.q[2].z, x.q[2].w,
                           x.q[3].x, x.q[3].y, x.q[3].z, x.q[3].w};
        int a0 = 0, a1 = 0, b0 = 0, b1 = 0; /* the blocks' halves of 16 */
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t ql = funnel_rc(v[i], v[i + 1], s);
            const uint32_t qh = funnel_rc(v[9 + i], v[10 + i], s);
            const uint32_t la =
                q6k_centre((ql & 0x0F0F0F0Fu) | ((qh >> (2 * h)) & 0x03030303u) << 4);
            const uint32_t lb =
                q6k_centre(((ql >> 4) & 0x0F0F0F0Fu) | ((qh >> (4 + 2 * h)) & 0x03030303u) << 4);
            if (i < 4) {
                a0 = dp4a(static_cast<int>(la), xa[i], a0);
                b0 = dp4a(static_cast<int>(lb), xb[i], b0);
            } else {
                a1 = dp4a(static_cast<int>(la), xa[i], a1);
                b1 = dp4a(static_cast<int>(lb), xb[i], b1);
            }
        }
        const int sa = static_cast<int8_t>(v[18]) * a0 + static_cast<int8_t>(v[19]) * a1;
        const int sb = static_cast<int8_t>(v[20]) * b0 + static_cast<int8_t>(v[21]) * b1;
        const float d = half_bits(v[22] | v[23] << 8);
        return d * (x.d[0] * static_cast<float>(sa) + x.d[1] * static_cast<float>(sb));
    } else if constexpr (TYPE == QUANT_TYPE_Q4_K || TYPE == QUANT_TYPE_Q5_K) {
        const uint32_t g = shift;
        const float d = half_bits(v[0] & 0xFFFFu);
        const float dmin = half_bits(v[0] >> 16);
        float sc0, mn0, sc1, mn1;
        const bool hi = g >= 2;
        q4k_scale_min(v[1], v[2], v[3], (2 * g) & 3u, hi, sc0, mn0);
        q4k_scale_min(v[1], v[2], v[3], (2 * g + 1) & 3u, hi, sc1, mn1);
        const int x0[8] = {x.q[0].x, x.q[0].y, x.q[0].z, x.q[0].w,
                           x.q[1].x, x.q[1].y, x.q[1].z, x.q[1].w};
        const int x1[8] = {x.q[2].x, x.q[2].y, x.q[2].z, x.q[2].w,
                           x.q[3].x, x.q[3].y, x.q[3].z, x.q[3].w};
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            uint32_t lo = v[4 + i] & 0x0F0F0F0Fu, hi = (v[4 + i] >> 4) & 0x0F0F0F0Fu;
            if constexpr (TYPE == QUANT_TYPE_Q5_K) { /* bit 2g (2g + 1) of qh[l]: 16 */
                lo |= ((v[12 + i] >> (2 * g)) & 0x01010101u) << 4;
                hi |= ((v[12 + i] >> (2 * g + 1)) & 0x01010101u) << 4;
            }
            s0 = dp4a(static_cast<int>(lo), x0[i], s0);
            s1 = dp4a(static_cast<int>(hi), x1[i], s1);
        }
        return d * (sc0 * x.d[0] * static_cast<float>(s0) + sc1 * x.d[1] * static_cast<float>(s1)) -
               dmin * (mn0 * x.s[0] + mn1 * x.s[1]);
    } else {
        return block_dot<TYPE>(v, shift, x.q[0], x.q[1], x.d[0], x.s[0]);
    }
}

/* Warp lanes per row for rows of nb blocks (mvq's choice: the lanes and
 * their reduction tree fix the bits of a row). */
MVQ_HD constexpr uint32_t lanes_per_row(uint32_t nb)
{
    return nb >= 64 ? 32 : nb >= 32 ? 16 : 8;
}

#ifdef __CUDACC__
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

/* round_block of N blocks at once, lane j's element of block b[i] in xv[i] (store[i] false:
 * a block past the row, computed, not stored): their butterflies side by side, block i's two
 * divisions by lane i, handed back by shuffles (each IEEE division is a branch of its own,
 * which the compiler does not overlap from one round_block to the next). The same operands,
 * so the same bits as N calls of round_block. Every lane of the warp calls. */
template <int N>
static __device__ __forceinline__ void round_blocks(const float (&xv)[N], const uint32_t (&b)[N],
                                                    const bool (&store)[N], int8_t *s_q,
                                                    float *s_d, float *s_s)
{
    static_assert(N >= 1 && N <= 32, "a lane's divisions a block");
    if constexpr (N == 1) {
        round_block(xv[0], b[0], store[0], s_q, s_d, s_s);
    } else {
        const int lane = threadIdx.x & 31;
        float amax[N];
#pragma unroll
        for (int i = 0; i < N; i++)
            amax[i] = fabsf(xv[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < N; i++)
                amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xFFFFFFFFu, amax[i], o));
        float am = amax[0]; /* lane i: block i's (round_levels' expressions) */
#pragma unroll
        for (int i = 1; i < N; i++)
            am = lane == i ? amax[i] : am;
        const float id_l = am > 0.0f ? 127.0f / am : 0.0f, d_l = am / 127.0f;
        int q[N], qs[N];
#pragma unroll
        for (int i = 0; i < N; i++) {
            q[i] = __float2int_rn(xv[i] * __shfl_sync(0xFFFFFFFFu, id_l, i));
            qs[i] = q[i];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < N; i++)
                qs[i] += __shfl_xor_sync(0xFFFFFFFFu, qs[i], o);
#pragma unroll
        for (int i = 0; i < N; i++) {
            const float d = __shfl_sync(0xFFFFFFFFu, d_l, i);
            if (store[i]) {
                s_q[b[i] * 32 + lane] = static_cast<int8_t>(q[i]);
                if (lane == 0) {
                    s_d[b[i]] = d;
                    s_s[b[i]] = d * static_cast<float>(qs[i]);
                }
            }
        }
    }
}

#endif

/* Bytes of one activation row of n (a multiple of 32) rounded for these
 * products, as a producer writes it for them (cuda_moe_combine_early's xq)
 * and as they keep it in shared memory: n levels (int8), then n/32 scales
 * (f32), then n/32 scale x level sums (f32); rows 16-byte aligned. */
MVQ_HD constexpr size_t xq_row_bytes(size_t n)
{
    return (n + 8 * (n / 32) + 15) / 16 * 16;
}

} /* namespace mvq */

#endif
