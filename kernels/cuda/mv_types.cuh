/*
 * mv_types.cuh: the weight formats of the f32-activation products (matvec.cu):
 * how lane l of a warp decodes its unit of 8 elements of a 256-element group
 * of each GGUF type (matvec.cu's file comment has the scheme). Private to
 * matvec.cu, and compiled for the host as well (a C++ compiler without
 * CUDA: the intrinsics below get portable twins) so that
 * tests/test_mv_types.cpp checks every type's decode against the CPU's
 * dequantization (model/quant.c) on a machine without a GPU. The device
 * code is what it was in matvec.cu: the wrappers inline to the intrinsics.
 */
#ifndef KERNELS_CUDA_MV_TYPES_CUH
#define KERNELS_CUDA_MV_TYPES_CUH

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define MV_FN __device__ __forceinline__
#else
#include <math.h>
#define MV_FN inline
#endif

extern "C" {
#include "model/quant.h"
}

namespace mv {

#ifdef __CUDACC__
MV_FN uint32_t mv_byte_perm(uint32_t x, uint32_t y, uint32_t s)
{
    return __byte_perm(x, y, s);
}

MV_FN uint32_t mv_funnel_r(uint32_t lo, uint32_t hi, uint32_t shift)
{
    return __funnelshift_r(lo, hi, shift);
}

MV_FN float mv_as_float(int v)
{
    return __int_as_float(v);
}

MV_FN float mv_half(uint32_t h)
{
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
#else
/* PTX prmt's default mode: byte i of the result is byte (s >> 4i) & 7 of y:x. */
inline uint32_t mv_byte_perm(uint32_t x, uint32_t y, uint32_t s)
{
    const uint64_t xy = static_cast<uint64_t>(y) << 32 | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++)
        r |= static_cast<uint32_t>((xy >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}

/* __funnelshift_r: the low 32 bits of hi:lo shifted right by shift & 31. */
inline uint32_t mv_funnel_r(uint32_t lo, uint32_t hi, uint32_t shift)
{
    const uint64_t v = static_cast<uint64_t>(hi) << 32 | lo;
    return static_cast<uint32_t>(v >> (shift & 31u));
}

inline float mv_as_float(int v)
{
    float f;
    memcpy(&f, &v, 4);
    return f;
}

inline float mv_half(uint32_t h)
{
    return quant_f16_to_f32(static_cast<uint16_t>(h));
}
#endif

constexpr float kMagic = 8388608.0f; /* 2^23: a float whose low byte is an integer */

/* One lane's 8 elements of a group: run A adds sa*sum(q*x) + ca*sum(x). */
struct Unit {
    float q[8];
    float sa, sb, ca, cb;
};

/* ---- reading staged bytes ----------------------------------------------- */

MV_FN uint32_t rd16(const uint8_t *p)
{
    return *reinterpret_cast<const uint16_t *>(p);
}

/* N little-endian words at byte off of the staged group g (2-byte aligned):
 * N+1 aligned loads joined by funnel shifts (the staging buffer has room
 * for the extra word). AL: g is 4-byte aligned, so the shift depends on the
 * lane's offset alone and the compiler computes it once. */
template <int N, bool AL>
MV_FN void rdw(const uint8_t *g, unsigned off, uint32_t *out)
{
    const unsigned mis = AL ? off & 3u
                            : static_cast<unsigned>((reinterpret_cast<uintptr_t>(g) + off) & 3u);
    const uint32_t *w = reinterpret_cast<const uint32_t *>(g + off - mis);
    uint32_t prev = w[0];
#pragma unroll
    for (int i = 0; i < N; i++) {
        uint32_t next = w[i + 1];
        out[i] = mv_funnel_r(prev, next, mis * 8u);
        prev = next;
    }
}

MV_FN float f16(uint32_t h)
{
    return mv_half(h);
}

/* q[i] = 2^23 + byte i of v, minus off (exact for off = 2^23 + integer). */
MV_FN void levels_low(uint32_t v, float off, float *q)
{
    q[0] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x4B000000u, 0x7650))) - off;
    q[1] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x4B000000u, 0x7651))) - off;
    q[2] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x4B000000u, 0x7652))) - off;
    q[3] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x4B000000u, 0x7653))) - off;
}

/* q[i] = the float with bytes 0x3F, byte i of v, 0, 0: for bytes 0x80 | b
 * (b < 128) that is 1 + b/128, so 6-bit values v give 1 + v/128 and
 * nibbles placed as v << 3 give 1 + v/16. */
MV_FN void levels_mid(uint32_t v, float *q)
{
    q[0] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x3F000000u, 0x7054)));
    q[1] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x3F000000u, 0x7154)));
    q[2] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x3F000000u, 0x7254)));
    q[3] = mv_as_float(static_cast<int>(mv_byte_perm(v, 0x3F000000u, 0x7354)));
}

/* get_scale_min_k4 (model-spec 2.3) of sub-block j from the 12 scale bytes
 * (little-endian words s0, s1, s2), without indexing arrays by j. */
MV_FN void scale_min_k4(uint32_t s0, uint32_t s1, uint32_t s2, int j,
                                             uint32_t *sc, uint32_t *m)
{
    const uint32_t sh = (j & 3) * 8, b0 = s0 >> sh, b1 = s1 >> sh, b2 = s2 >> sh;
    if (j < 4) {
        *sc = b0 & 63u;
        *m = b1 & 63u;
    } else {
        *sc = (b2 & 0x0Fu) | ((b0 >> 2) & 0x30u);
        *m = ((b2 >> 4) & 0x0Fu) | ((b1 >> 2) & 0x30u);
    }
}

/* ---- the types ------------------------------------------------------------
 * Each type: EE elements in EB bytes (its block), GB bytes per group, U
 * groups per step, VW the widest load its steps allow, FIN the power of
 * two the sums are multiplied by at the end; PLAIN (no scales; rows may
 * end inside a unit), SAME (one scale for both runs, offsets K*s), MIN
 * (own offsets ca, cb), else offsets K*sa and K*sb; pa (where lane l's
 * run A starts in a group; run B starts DPB later), first/end (lowest element and one past the
 * highest of lane l's unit) and unit() (decode lane l's unit of the group
 * at g); LEAN: its aligned decode fits 64 registers. */

struct TQ8_0 {
    static constexpr int EE = 32, EB = 34, GB = 272, U = 1, VW = 16;
    static constexpr bool PLAIN = false, SAME = true, MIN = false, LEAN = true;
    static constexpr float K = 0.0f, FIN = 1.0f;
    MV_FN static int pa(int l) { return 32 * (l >> 2) + 8 * (l & 3); }
    static constexpr int DPB = 4;
    MV_FN static int first(int l) { return 32 * (l >> 2); }
    MV_FN static int end(int l) { return first(l) + 32; }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int b = 34 * (l >> 2);
        uint32_t v[2];
        rdw<2, AL>(g, b + 2 + 8 * (l & 3), v);
        u.sa = f16(rd16(g + b));
        levels_low(v[0] ^ 0x80808080u, kMagic + 128.0f, u.q);
        levels_low(v[1] ^ 0x80808080u, kMagic + 128.0f, u.q + 4);
    }
};

/* Q4_0: level 1 + v/16 for nibble v, so (v - 8) = 16 * (level - 1.5). */
struct TQ4_0 {
    static constexpr int EE = 32, EB = 18, GB = 144, U = 2, VW = 16;
    static constexpr bool PLAIN = false, SAME = true, MIN = false, LEAN = true;
    static constexpr float K = -1.5f, FIN = 16.0f;
    MV_FN static int pa(int l) { return 32 * (l >> 2) + 4 * (l & 3); }
    static constexpr int DPB = 16;
    MV_FN static int first(int l) { return 32 * (l >> 2); }
    MV_FN static int end(int l) { return first(l) + 32; }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int b = 18 * (l >> 2);
        uint32_t v;
        rdw<1, AL>(g, b + 2 + 4 * (l & 3), &v);
        u.sa = f16(rd16(g + b));
        levels_mid(((v << 3) & 0x78787878u) | 0x80808080u, u.q);
        levels_mid(((v >> 1) & 0x78787878u) | 0x80808080u, u.q + 4);
    }
};

/* Q4_K and Q5_K scales: lane l = 8c + j takes sub-blocks 2c and 2c + 1;
 * a run adds d*sc*sum(v*x) - dmin*m*sum(x) with v = F*(level - 1), so
 * s = d*sc and c = -(d*sc + dmin*m/F) once the sum is multiplied by F. */
template <bool AL>
MV_FN void kquant_scales(const uint8_t *g, int l, float inv_f, Unit &u)
{
    uint32_t s[3];
    rdw<3, AL>(g, 4, s);
    const float d = f16(rd16(g)), dmin = f16(rd16(g + 2)) * inv_f;
    const int c = l >> 3;
    uint32_t sc, m;
    scale_min_k4(s[0], s[1], s[2], 2 * c, &sc, &m);
    u.sa = d * static_cast<float>(sc);
    u.ca = -fmaf(dmin, static_cast<float>(m), u.sa);
    scale_min_k4(s[0], s[1], s[2], 2 * c + 1, &sc, &m);
    u.sb = d * static_cast<float>(sc);
    u.cb = -fmaf(dmin, static_cast<float>(m), u.sb);
}

/* Lane l = 8c + j takes qs bytes 4j..4j+3 of chunk c: low nibbles are
 * elements 64c + 4j.., high ones 64c + 32 + 4j.. */
struct TQ4_K {
    static constexpr int EE = 256, EB = 144, GB = 144, U = 2, VW = 16;
    static constexpr bool PLAIN = false, SAME = false, MIN = true, LEAN = true;
    static constexpr float K = 0.0f, FIN = 16.0f;
    MV_FN static int pa(int l) { return 64 * (l >> 3) + 4 * (l & 7); }
    static constexpr int DPB = 32;
    MV_FN static int first(int) { return 0; }
    MV_FN static int end(int) { return 256; }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v;
        rdw<1, AL>(g, 16 + 32 * (l >> 3) + 4 * (l & 7), &v);
        kquant_scales<AL>(g, l, 1.0f / FIN, u);
        levels_mid(((v << 3) & 0x78787878u) | 0x80808080u, u.q);
        levels_mid(((v >> 1) & 0x78787878u) | 0x80808080u, u.q + 4);
    }
};

/* Q5_K: 5-bit values v as levels 1 + v/128. */
struct TQ5_K {
    static constexpr int EE = 256, EB = 176, GB = 176, U = 2, VW = 16;
    static constexpr bool PLAIN = false, SAME = false, MIN = true, LEAN = false;
    static constexpr float K = 0.0f, FIN = 128.0f;
    MV_FN static int pa(int l) { return TQ4_K::pa(l); }
    static constexpr int DPB = 32;
    MV_FN static int first(int) { return 0; }
    MV_FN static int end(int) { return 256; }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int c = l >> 3;
        uint32_t v, h;
        rdw<1, AL>(g, 48 + 32 * c + 4 * (l & 7), &v);
        rdw<1, AL>(g, 16 + 4 * (l & 7), &h);
        kquant_scales<AL>(g, l, 1.0f / FIN, u);
        const uint32_t lo = (v & 0x0F0F0F0Fu) | (((h >> (2 * c)) & 0x01010101u) << 4);
        const uint32_t hi = ((v >> 4) & 0x0F0F0F0Fu) | (((h >> (2 * c + 1)) & 0x01010101u) << 4);
        levels_mid(lo | 0x80808080u, u.q);
        levels_mid(hi | 0x80808080u, u.q + 4);
    }
};

/* Q6_K: lane l = 16h + 8p + t takes ql bytes 32p + 4t.. of half h (low
 * nibbles: elements 128h + 32p + 4t.., high: 64 further) and qh bytes 4t..
 * (bits 2p and 4 + 2p); 6-bit values v as levels 1 + v/128, so
 * v - 32 = 128 * (level - 1.25). */
struct TQ6_K {
    static constexpr int EE = 256, EB = 210, GB = 210, U = 2, VW = 4;
    static constexpr bool PLAIN = false, SAME = false, MIN = false, LEAN = false;
    static constexpr float K = -1.25f, FIN = 128.0f;
    MV_FN static int pa(int l) { return 128 * (l >> 4) + 32 * ((l >> 3) & 1) + 4 * (l & 7); }
    static constexpr int DPB = 64;
    MV_FN static int first(int) { return 0; }
    MV_FN static int end(int) { return 256; }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int h = l >> 4, p = (l >> 3) & 1, t = l & 7;
        uint32_t v, hb;
        rdw<1, AL>(g, 64 * h + 32 * p + 4 * t, &v);
        rdw<1, AL>(g, 128 + 32 * h + 4 * t, &hb);
        const uint32_t lo = (v & 0x0F0F0F0Fu) | (((hb >> (2 * p)) & 0x03030303u) << 4);
        const uint32_t hi = ((v >> 4) & 0x0F0F0F0Fu) | (((hb >> (4 + 2 * p)) & 0x03030303u) << 4);
        levels_mid(lo | 0x80808080u, u.q);
        levels_mid(hi | 0x80808080u, u.q + 4);
        const int ia = 192 + 8 * h + (t >> 2) + 2 * p, ib = ia + 4;
        const float d = f16(rd16(g + 208));
        const int8_t sa = static_cast<int8_t>(rd16(g + (ia & ~1)) >> ((ia & 1) * 8));
        const int8_t sb = static_cast<int8_t>(rd16(g + (ib & ~1)) >> ((ib & 1) * 8));
        u.sa = d * static_cast<float>(sa);
        u.sb = d * static_cast<float>(sb);
    }
};

/* Bit i of t (t < 16) to bit 8i: four one-bit fields, one a byte (no carries:
 * the shifted copies occupy bits 0-3, 7-10, 14-17, 21-24). */
MV_FN uint32_t spread4(uint32_t t)
{
    return (t * 0x00204081u) & 0x01010101u;
}

/* The blocks of 32 after Q4_0's pattern: lane l takes block l / 4 of the
 * group, its elements 4 (l % 4) .. (run A) and 16 further (run B). */
struct TB32 {
    static constexpr int EE = 32, U = 2, VW = 16, DPB = 16;
    static constexpr bool PLAIN = false, LEAN = false;
    MV_FN static int pa(int l) { return 32 * (l >> 2) + 4 * (l & 3); }
    MV_FN static int first(int l) { return 32 * (l >> 2); }
    MV_FN static int end(int l) { return first(l) + 32; }
};

/* Q4_1: Q4_0's levels (1 + v/16), with a minimum: w = d v + m =
 * 16 (d level + m/16 - d). */
struct TQ4_1 : TB32 {
    static constexpr int EB = 20, GB = 160;
    static constexpr bool SAME = false, MIN = true;
    static constexpr float K = 0.0f, FIN = 16.0f;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int b = 20 * (l >> 2);
        uint32_t v;
        rdw<1, AL>(g, b + 4 + 4 * (l & 3), &v);
        const float d = f16(rd16(g + b)), m = f16(rd16(g + b + 2));
        u.sa = u.sb = d;
        u.ca = u.cb = m * (1.0f / FIN) - d;
        levels_mid(((v << 3) & 0x78787878u) | 0x80808080u, u.q);
        levels_mid(((v >> 1) & 0x78787878u) | 0x80808080u, u.q + 4);
    }
};

/* Q5_0 and Q5_1: Q4_0's lanes; element j of a block takes bit j of the
 * 32-bit qh as its fifth bit; 5-bit values v as levels 1 + v/128. Q5_0:
 * w = d (v - 16) = 128 d (level - 1.125). */
template <bool AL>
MV_FN void q5_levels(const uint8_t *g, int qh, int qs, int l, Unit &u)
{
    const int j = 4 * (l & 3);
    uint32_t v, h;
    rdw<1, AL>(g, qs + j, &v);
    rdw<1, AL>(g, qh, &h);
    const uint32_t lo = (v & 0x0F0F0F0Fu) | (spread4((h >> j) & 15u) << 4);
    const uint32_t hi = ((v >> 4) & 0x0F0F0F0Fu) | (spread4((h >> (j + 16)) & 15u) << 4);
    levels_mid(lo | 0x80808080u, u.q);
    levels_mid(hi | 0x80808080u, u.q + 4);
}

struct TQ5_0 : TB32 {
    static constexpr int EB = 22, GB = 176;
    static constexpr bool SAME = true, MIN = false;
    static constexpr float K = -1.125f, FIN = 128.0f;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int b = 22 * (l >> 2);
        u.sa = f16(rd16(g + b));
        q5_levels<AL>(g, b + 2, b + 6, l, u);
    }
};

/* Q5_1: w = d v + m = 128 (d level + m/128 - d). */
struct TQ5_1 : TB32 {
    static constexpr int EB = 24, GB = 192;
    static constexpr bool SAME = false, MIN = true;
    static constexpr float K = 0.0f, FIN = 128.0f;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int b = 24 * (l >> 2);
        const float d = f16(rd16(g + b)), m = f16(rd16(g + b + 2));
        u.sa = u.sb = d;
        u.ca = u.cb = m * (1.0f / FIN) - d;
        q5_levels<AL>(g, b + 4, b + 8, l, u);
    }
};

/* IQ4_NL and IQ4_XS: nibble v stands for kvalues_iq4nl[v] (model/quant.c's
 * quant_iq4nl_levels), looked up four at a time: the table as bytes
 * kvalues + 128 in four words, two byte permutes on the low three bits of
 * each nibble and a select on the fourth; levels_low makes them floats,
 * exactly. */
MV_FN uint32_t iq4_bytes(uint32_t nib)
{
    /* kvalues + 128: 1 24 45 63 | 79 93 106 118 | 129 141 153 166 | 181 197 217 241 */
    const uint32_t sel = (nib & 7u) | ((nib >> 4) & 0x70u) | ((nib >> 8) & 0x700u) |
                         ((nib >> 12) & 0x7000u);
    const uint32_t lo = mv_byte_perm(0x3F2D1801u, 0x766A5D4Fu, sel);
    const uint32_t hi = mv_byte_perm(0xA6998D81u, 0xF1D9C5B5u, sel);
    const uint32_t m = ((nib >> 3) & 0x01010101u) * 0xFFu;
    return (lo & ~m) | (hi & m);
}

struct TIQ4_NL : TB32 {
    static constexpr int EB = 18, GB = 144;
    static constexpr bool SAME = true, MIN = false;
    static constexpr float K = 0.0f, FIN = 1.0f;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int b = 18 * (l >> 2);
        uint32_t v;
        rdw<1, AL>(g, b + 2 + 4 * (l & 3), &v);
        u.sa = f16(rd16(g + b));
        levels_low(iq4_bytes(v & 0x0F0F0F0Fu), kMagic + 128.0f, u.q);
        levels_low(iq4_bytes((v >> 4) & 0x0F0F0F0Fu), kMagic + 128.0f, u.q + 4);
    }
};

/* IQ4_XS: 8 sub-blocks of 32, each IQ4_NL's layout with a 6-bit scale
 * (low nibble ib of the 4 bytes at 4, high bits 2ib of the half-word at 2)
 * less 32; lane l = 4ib + j takes bytes 4j.. of sub-block ib, so both runs
 * have its scale: w = d (ls - 32) kvalue, rounded as the CPU rounds it. */
struct TIQ4_XS {
    static constexpr int EE = 256, EB = 136, GB = 136, U = 2, VW = 16;
    static constexpr bool PLAIN = false, SAME = true, MIN = false, LEAN = false;
    static constexpr float K = 0.0f, FIN = 1.0f;
    MV_FN static int pa(int l) { return 32 * (l >> 2) + 4 * (l & 3); }
    static constexpr int DPB = 16;
    MV_FN static int first(int) { return 0; }
    MV_FN static int end(int) { return 256; }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int ib = l >> 2;
        uint32_t v, sl;
        rdw<1, AL>(g, 8 + 16 * ib + 4 * (l & 3), &v);
        rdw<1, AL>(g, 4, &sl);
        const uint32_t ls = ((sl >> (4 * ib)) & 15u) | (((rd16(g + 2) >> (2 * ib)) & 3u) << 4);
        u.sa = f16(rd16(g)) * static_cast<float>(static_cast<int>(ls) - 32);
        levels_low(iq4_bytes(v & 0x0F0F0F0Fu), kMagic + 128.0f, u.q);
        levels_low(iq4_bytes((v >> 4) & 0x0F0F0F0Fu), kMagic + 128.0f, u.q + 4);
    }
};

/* Q2_K and Q3_K: 16 sub-blocks of 16; element 128h + 32t + 16s + i (i < 16)
 * is bits 2t.. of qs byte 32h + 16s + i. Lane l = 16h + 8p + 4s + c takes
 * i = 4c.. at t = 2p (run A) and t = 2p + 1 (run B, 32 further): one qs word
 * for both. Its sub-blocks: 8h + 2t + s. */
MV_FN int q23_h(int l) { return l >> 4; }
MV_FN int q23_p(int l) { return (l >> 3) & 1; }
MV_FN int q23_s(int l) { return (l >> 2) & 1; }
MV_FN int q23_pa(int l) { return 128 * q23_h(l) + 64 * q23_p(l) + 16 * q23_s(l) + 4 * (l & 3); }
MV_FN int q23_qs(int l) { return 32 * q23_h(l) + 16 * q23_s(l) + 4 * (l & 3); }

/* Q2_K's and Q3_K's lanes and groups: super-blocks of 84 and 110 bytes
 * allow no wider loads than 4 bytes. */
struct TB23 {
    static constexpr int EE = 256, U = 2, VW = 4, DPB = 32;
    static constexpr bool PLAIN = false, SAME = false, LEAN = false;
    MV_FN static int pa(int l) { return q23_pa(l); }
    MV_FN static int first(int) { return 0; }
    MV_FN static int end(int) { return 256; }
};

/* Byte i of the little-endian words w0, w1, w2 (i < 12), without indexing
 * an array by i. */
MV_FN uint32_t byte_of3(uint32_t w0, uint32_t w1, uint32_t w2, int i)
{
    const uint32_t w = i < 4 ? w0 : i < 8 ? w1 : w2;
    return (w >> (8 * (i & 3))) & 0xFFu;
}

/* Q2_K: scales at 0 (16 bytes: low nibble the scale, high the min), qs at
 * 16, d at 80, dmin at 82; w = d sc q - dmin m with 2-bit q as levels
 * 1 + q/8: w = 8 (d sc level - d sc - dmin m/8). */
struct TQ2_K : TB23 {
    static constexpr int EB = 84, GB = 84;
    static constexpr bool MIN = true;
    static constexpr float K = 0.0f, FIN = 8.0f;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int t = 2 * q23_p(l);
        uint32_t v, sw;
        rdw<1, AL>(g, 16 + q23_qs(l), &v);
        /* sub-blocks 8h + 2t + s and 2 further: bytes s and s + 2 of word 2h + p */
        rdw<1, AL>(g, 4 * (2 * q23_h(l) + q23_p(l)), &sw);
        const float d = f16(rd16(g + 80)), dmin = f16(rd16(g + 82)) * (1.0f / FIN);
        const uint32_t sa = (sw >> (8 * q23_s(l))) & 0xFFu;
        const uint32_t sb = (sw >> (8 * q23_s(l) + 16)) & 0xFFu;
        u.sa = d * static_cast<float>(sa & 15u);
        u.ca = -fmaf(dmin, static_cast<float>(sa >> 4), u.sa);
        u.sb = d * static_cast<float>(sb & 15u);
        u.cb = -fmaf(dmin, static_cast<float>(sb >> 4), u.sb);
        levels_mid((((v >> (2 * t)) & 0x03030303u) << 4) | 0x80808080u, u.q);
        levels_mid((((v >> (2 * t + 2)) & 0x03030303u) << 4) | 0x80808080u, u.q + 4);
    }
};

/* Q3_K: hmask at 0 (bit 4h + t of byte 16s + i: 4 added to the 2-bit
 * level), qs at 32, the 12 scale bytes at 96 (sub-block j: low nibble of
 * byte j (j < 8) or high nibble of byte j - 8, high two bits at 2(j / 4) of
 * byte 8 + j % 4, less 32), d at 108; w = d sc (v - 4) with v = q + 4 hbit
 * (0..7) as levels 1 + v/8: w = 8 d sc (level - 1.5). */
struct TQ3_K : TB23 {
    static constexpr int EB = 110, GB = 110;
    static constexpr bool MIN = false;
    static constexpr float K = -1.5f, FIN = 8.0f;
    MV_FN static int scale(uint32_t s0, uint32_t s1, uint32_t s2, int j)
    {
        const uint32_t low = j < 8 ? byte_of3(s0, s1, s2, j) & 15u
                                   : byte_of3(s0, s1, s2, j - 8) >> 4;
        const uint32_t high = (byte_of3(s0, s1, s2, 8 + (j & 3)) >> (2 * (j >> 2))) & 3u;
        return static_cast<int>(low | high << 4) - 32;
    }
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int h = q23_h(l), t = 2 * q23_p(l), sub = 8 * h + 2 * t + q23_s(l);
        uint32_t v, hm, s[3];
        rdw<1, AL>(g, 32 + q23_qs(l), &v);
        rdw<1, AL>(g, 16 * q23_s(l) + 4 * (l & 3), &hm);
        rdw<3, AL>(g, 96, s);
        const float d = f16(rd16(g + 108));
        u.sa = d * static_cast<float>(scale(s[0], s[1], s[2], sub));
        u.sb = d * static_cast<float>(scale(s[0], s[1], s[2], sub + 2));
        const int bit = 4 * h + t;
        const uint32_t a = ((v >> (2 * t)) & 0x03030303u) | (((hm >> bit) & 0x01010101u) << 2);
        const uint32_t b = ((v >> (2 * t + 2)) & 0x03030303u) |
                           (((hm >> (bit + 1)) & 0x01010101u) << 2);
        levels_mid((a << 4) | 0x80808080u, u.q);
        levels_mid((b << 4) | 0x80808080u, u.q + 4);
    }
};

/* Plain types: lane l owns elements 8l .. 8l + 7. */
struct TPlain {
    static constexpr int EE = 1, U = 1, VW = 16;
    static constexpr bool PLAIN = true, SAME = true, MIN = false;
    static constexpr float K = 0.0f, FIN = 1.0f;
    MV_FN static int pa(int l) { return 8 * l; }
    static constexpr int DPB = 4;
    MV_FN static int first(int l) { return 8 * l; }
    MV_FN static int end(int l) { return 8 * l + 8; }
};

struct TF16 : TPlain {
    static constexpr int EB = 2, GB = 512;
    static constexpr bool LEAN = true;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v[4];
        rdw<4, AL>(g, 16 * l, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u.q[2 * i] = f16(v[i] & 0xFFFFu);
            u.q[2 * i + 1] = f16(v[i] >> 16);
        }
    }
};

struct TBF16 : TPlain {
    static constexpr int EB = 2, GB = 512;
    static constexpr bool LEAN = true;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v[4];
        rdw<4, AL>(g, 16 * l, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u.q[2 * i] = mv_as_float(static_cast<int>(v[i] << 16));
            u.q[2 * i + 1] = mv_as_float(static_cast<int>(v[i] & 0xFFFF0000u));
        }
    }
};

struct TF32 : TPlain {
    static constexpr int EB = 4, GB = 1024;
    static constexpr bool LEAN = false;
    template <bool AL>
    MV_FN static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v[8];
        rdw<8, AL>(g, 32 * l, v);
#pragma unroll
        for (int i = 0; i < 8; i++)
            u.q[i] = mv_as_float(static_cast<int>(v[i]));
    }
};

} /* namespace mv */

#endif
