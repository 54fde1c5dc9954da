/*
 * cuda matvec: GGUF weight rows times f32 activations on the GPU (see
 * matvec.h; CPU twin kernels/cpu/matvec.h).
 *
 * Maths: y[r] = sum_i w[r][i] x[i] with w the dequantized weight of
 * model-spec 2.2/2.3, f32 products and f32 sums, activations never
 * quantized. Every type is cut into groups of 256 elements (8 blocks of
 * Q8_0/Q4_0, one K-quant super-block, 256 plain values; GB bytes each, the
 * last group of a row may be short). Lane l of a warp owns one unit of 8
 * elements of each group: two runs of 4 consecutive elements (positions pa
 * and pb) with per-run scale s and min m, decoded to float levels q so that
 * w = s*q - m. The levels come from byte bits planted into the mantissa of
 * 2^23 (one byte permute and one add per element, no int-to-float
 * conversion); each run's dot adds s * sum(q*x) - m * sum(x), as the CPU
 * twin does.
 *
 * Shapes and ownership (mv_kernel): a block is 8 warps. The warps form
 * 8/KS row groups of KS warps; a row group owns R consecutive rows and its
 * KS warps split the row's steps (a step is U groups) round-robin, so short
 * matrices still fill the GPU (KS = 8 for long rows, 1 for rows of one
 * step). Per step a warp copies the R rows' U*GB bytes into its own shared
 * staging buffer: 16-byte loads for the 16-byte granules inside each row's
 * range, 2-byte loads for the head and tail (rows and blocks are only 2-byte
 * aligned in general: an 18-byte Q4_0 block or a 210-byte Q6_K row), all
 * loads issued before any store. The bytes keep their address mod 16 in
 * shared memory. Then each lane decodes its unit of every group for all R
 * rows from shared memory (aligned 4-byte words joined with funnel shifts)
 * and multiplies them with its 8 activations, read once through the
 * read-only cache and used for the R rows (and, for a matmul chunk, NS
 * activation rows at once). Lanes reduce with shuffles; the KS warps of a
 * row group meet in shared memory in a fixed order, so results do not
 * depend on timing.
 *
 * Jobs (grid y): one for cuda_matvec and a matmul chunk; one per (token,
 * slot) pair for cuda_matvec_experts, whose blocks read the expert id and
 * its weight address from device memory and skip the pair when the
 * address is NULL. cuda_matmul runs chunks of NS = 8, 4, 2, 1 activation
 * rows, each chunk reading the weights once.
 */
#include "kernels/cuda/matvec.h"

#include <errno.h>

#include <cuda_fp16.h>

extern "C" {
#include "common/log.h"
#include "model/quant.h"
}

namespace {

constexpr int kWarps = 8;              /* warps per block */
constexpr int kGroup = 256;            /* elements per group */
constexpr float kMagic = 8388608.0f;   /* 2^23: a float whose low byte is an integer */
constexpr unsigned kMaxJobsY = 65535u; /* grid y limit */

/* One lane's 8 elements of a group: w = s*q - m per run of 4. */
struct Unit {
    float q[8];
    float sa, sb, ma, mb;
};

/* ---- reading staged bytes ----------------------------------------------- */

__device__ __forceinline__ uint32_t rd16(const uint8_t *p)
{
    return *reinterpret_cast<const uint16_t *>(p);
}

/* N little-endian words starting at the 2-byte aligned shared address p:
 * N+1 aligned loads joined by funnel shifts (the staging buffer has room
 * for the extra word). */
template <int N>
__device__ __forceinline__ void rdw(const uint8_t *p, uint32_t *out)
{
    const unsigned mis = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 3u);
    const uint32_t *w = reinterpret_cast<const uint32_t *>(p - mis);
    uint32_t prev = w[0];
#pragma unroll
    for (int i = 0; i < N; i++) {
        uint32_t next = w[i + 1];
        out[i] = __funnelshift_r(prev, next, mis * 8u);
        prev = next;
    }
}

__device__ __forceinline__ float f16(uint32_t h)
{
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

/* q[i] = byte i of v minus off, through the mantissa of 2^23. */
__device__ __forceinline__ void levels4(uint32_t v, float off, float *q)
{
    q[0] = __int_as_float(static_cast<int>(__byte_perm(v, 0x4B000000u, 0x7650))) - off;
    q[1] = __int_as_float(static_cast<int>(__byte_perm(v, 0x4B000000u, 0x7651))) - off;
    q[2] = __int_as_float(static_cast<int>(__byte_perm(v, 0x4B000000u, 0x7652))) - off;
    q[3] = __int_as_float(static_cast<int>(__byte_perm(v, 0x4B000000u, 0x7653))) - off;
}

/* Byte k of the little-endian words w. */
__device__ __forceinline__ uint32_t byte_at(const uint32_t *w, int k)
{
    return (w[k >> 2] >> ((k & 3) * 8)) & 0xFFu;
}

/* get_scale_min_k4 (model-spec 2.3) of sub-block j from the 12 scale bytes. */
__device__ __forceinline__ void scale_min_k4(const uint32_t *s, int j, uint32_t *sc, uint32_t *m)
{
    if (j < 4) {
        *sc = byte_at(s, j) & 63u;
        *m = byte_at(s, j + 4) & 63u;
    } else {
        *sc = (byte_at(s, j + 4) & 0x0Fu) | ((byte_at(s, j - 4) >> 6) << 4);
        *m = (byte_at(s, j + 4) >> 4) | ((byte_at(s, j) >> 6) << 4);
    }
}

/* ---- the types ------------------------------------------------------------
 * Each type: EB bytes per EE elements (its block), GB bytes per group, U
 * groups per step, MIN (has mins), PLAIN (no scales; elements may end
 * inside a unit), pa/pb (run positions of lane l in a group), first/end
 * (lowest element and one past the highest of lane l's unit) and unit()
 * (decode lane l's unit of the group at g). */

struct TQ8_0 {
    static constexpr int EE = 32, EB = 34, GB = 272, U = 2;
    static constexpr bool MIN = false, PLAIN = false;
    __device__ static int pa(int l) { return 32 * (l >> 2) + 8 * (l & 3); }
    __device__ static int pb(int l) { return pa(l) + 4; }
    __device__ static int first(int l) { return 32 * (l >> 2); }
    __device__ static int end(int l) { return first(l) + 32; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        const uint8_t *b = g + 34 * (l >> 2);
        uint32_t v[2];
        rdw<2>(b + 2 + 8 * (l & 3), v);
        u.sa = u.sb = f16(rd16(b));
        levels4(v[0] ^ 0x80808080u, kMagic + 128.0f, u.q);
        levels4(v[1] ^ 0x80808080u, kMagic + 128.0f, u.q + 4);
    }
};

struct TQ4_0 {
    static constexpr int EE = 32, EB = 18, GB = 144, U = 2;
    static constexpr bool MIN = false, PLAIN = false;
    __device__ static int pa(int l) { return 32 * (l >> 2) + 4 * (l & 3); }
    __device__ static int pb(int l) { return pa(l) + 16; }
    __device__ static int first(int l) { return 32 * (l >> 2); }
    __device__ static int end(int l) { return first(l) + 32; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        const uint8_t *b = g + 18 * (l >> 2);
        uint32_t v;
        rdw<1>(b + 2 + 4 * (l & 3), &v);
        u.sa = u.sb = f16(rd16(b));
        levels4(v & 0x0F0F0F0Fu, kMagic + 8.0f, u.q);
        levels4((v >> 4) & 0x0F0F0F0Fu, kMagic + 8.0f, u.q + 4);
    }
};

/* Q4_K and Q5_K: lane l = 8c + j takes bytes 4j..4j+3 of chunk c; low
 * nibbles are elements 64c + 4j.. (sub-block 2c), high ones 64c + 32 + 4j..
 * (sub-block 2c + 1). */
__device__ __forceinline__ void kquant_scales(const uint8_t *g, int l, Unit &u)
{
    uint32_t s[3];
    rdw<3>(g + 4, s);
    const float d = f16(rd16(g)), dmin = f16(rd16(g + 2));
    const int c = l >> 3;
    uint32_t sc, m;
    scale_min_k4(s, 2 * c, &sc, &m);
    u.sa = d * static_cast<float>(sc);
    u.ma = dmin * static_cast<float>(m);
    scale_min_k4(s, 2 * c + 1, &sc, &m);
    u.sb = d * static_cast<float>(sc);
    u.mb = dmin * static_cast<float>(m);
}

struct TQ4_K {
    static constexpr int EE = 256, EB = 144, GB = 144, U = 2;
    static constexpr bool MIN = true, PLAIN = false;
    __device__ static int pa(int l) { return 64 * (l >> 3) + 4 * (l & 7); }
    __device__ static int pb(int l) { return pa(l) + 32; }
    __device__ static int first(int) { return 0; }
    __device__ static int end(int) { return 256; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v;
        rdw<1>(g + 16 + 32 * (l >> 3) + 4 * (l & 7), &v);
        kquant_scales(g, l, u);
        levels4(v & 0x0F0F0F0Fu, kMagic, u.q);
        levels4((v >> 4) & 0x0F0F0F0Fu, kMagic, u.q + 4);
    }
};

struct TQ5_K {
    static constexpr int EE = 256, EB = 176, GB = 176, U = 2;
    static constexpr bool MIN = true, PLAIN = false;
    __device__ static int pa(int l) { return TQ4_K::pa(l); }
    __device__ static int pb(int l) { return TQ4_K::pb(l); }
    __device__ static int first(int) { return 0; }
    __device__ static int end(int) { return 256; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int c = l >> 3;
        uint32_t v, h;
        rdw<1>(g + 48 + 32 * c + 4 * (l & 7), &v);
        rdw<1>(g + 16 + 4 * (l & 7), &h);
        kquant_scales(g, l, u);
        const uint32_t lo = (v & 0x0F0F0F0Fu) | (((h >> (2 * c)) & 0x01010101u) << 4);
        const uint32_t hi = ((v >> 4) & 0x0F0F0F0Fu) | (((h >> (2 * c + 1)) & 0x01010101u) << 4);
        levels4(lo, kMagic, u.q);
        levels4(hi, kMagic, u.q + 4);
    }
};

/* Q6_K: lane l = 16h + 8p + t takes ql bytes 32p + 4t.. of half h (low
 * nibbles: elements 128h + 32p + 4t.., high: 64 further) and qh bytes 4t..
 * (bits 2p and 4 + 2p). */
struct TQ6_K {
    static constexpr int EE = 256, EB = 210, GB = 210, U = 2;
    static constexpr bool MIN = false, PLAIN = false;
    __device__ static int pa(int l) { return 128 * (l >> 4) + 32 * ((l >> 3) & 1) + 4 * (l & 7); }
    __device__ static int pb(int l) { return pa(l) + 64; }
    __device__ static int first(int) { return 0; }
    __device__ static int end(int) { return 256; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        const int h = l >> 4, p = (l >> 3) & 1, t = l & 7;
        uint32_t v, hb;
        rdw<1>(g + 64 * h + 32 * p + 4 * t, &v);
        rdw<1>(g + 128 + 32 * h + 4 * t, &hb);
        const uint32_t lo = (v & 0x0F0F0F0Fu) | (((hb >> (2 * p)) & 0x03030303u) << 4);
        const uint32_t hi = ((v >> 4) & 0x0F0F0F0Fu) | (((hb >> (4 + 2 * p)) & 0x03030303u) << 4);
        levels4(lo, kMagic + 32.0f, u.q);
        levels4(hi, kMagic + 32.0f, u.q + 4);
        const int ia = 192 + 8 * h + (t >> 2) + 2 * p, ib = ia + 4;
        const float d = f16(rd16(g + 208));
        const int8_t sa = static_cast<int8_t>(rd16(g + (ia & ~1)) >> ((ia & 1) * 8));
        const int8_t sb = static_cast<int8_t>(rd16(g + (ib & ~1)) >> ((ib & 1) * 8));
        u.sa = d * static_cast<float>(sa);
        u.sb = d * static_cast<float>(sb);
    }
};

/* Plain types: lane l owns elements 8l .. 8l + 7. */
struct TF16 {
    static constexpr int EE = 1, EB = 2, GB = 512, U = 1;
    static constexpr bool MIN = false, PLAIN = true;
    __device__ static int pa(int l) { return 8 * l; }
    __device__ static int pb(int l) { return 8 * l + 4; }
    __device__ static int first(int l) { return 8 * l; }
    __device__ static int end(int l) { return 8 * l + 8; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v[4];
        rdw<4>(g + 16 * l, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u.q[2 * i] = f16(v[i] & 0xFFFFu);
            u.q[2 * i + 1] = f16(v[i] >> 16);
        }
    }
};

struct TBF16 {
    static constexpr int EE = 1, EB = 2, GB = 512, U = 1;
    static constexpr bool MIN = false, PLAIN = true;
    __device__ static int pa(int l) { return 8 * l; }
    __device__ static int pb(int l) { return 8 * l + 4; }
    __device__ static int first(int l) { return 8 * l; }
    __device__ static int end(int l) { return 8 * l + 8; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v[4];
        rdw<4>(g + 16 * l, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u.q[2 * i] = __int_as_float(static_cast<int>(v[i] << 16));
            u.q[2 * i + 1] = __int_as_float(static_cast<int>(v[i] & 0xFFFF0000u));
        }
    }
};

struct TF32 {
    static constexpr int EE = 1, EB = 4, GB = 1024, U = 1;
    static constexpr bool MIN = false, PLAIN = true;
    __device__ static int pa(int l) { return 8 * l; }
    __device__ static int pb(int l) { return 8 * l + 4; }
    __device__ static int first(int l) { return 8 * l; }
    __device__ static int end(int l) { return 8 * l + 8; }
    __device__ static void unit(const uint8_t *g, int l, Unit &u)
    {
        uint32_t v[8];
        rdw<8>(g + 32 * l, v);
#pragma unroll
        for (int i = 0; i < 8; i++)
            u.q[i] = __int_as_float(static_cast<int>(v[i]));
    }
};

/* ---- the kernel ------------------------------------------------------------ */

struct MvArgs {
    const uint8_t *w;        /* weights (matvec, matmul) */
    const void *const *addr; /* expert table, or NULL */
    const int32_t *ids;      /* expert id per job, or NULL */
    size_t row_bytes;
    uint64_t n_rows, n;
    const float *x; /* activation row of job 0 */
    size_t ldx;     /* floats between activation rows */
    uint32_t x_div; /* job j reads activation row j / x_div */
    float *y;
    size_t ldy;
    uint32_t n_jobs;
    int ks_log2;  /* warps per row group: 1 << ks_log2 */
    bool x_vec4;  /* every activation row is 16-byte aligned */
};

/* Staging buffer bytes per row: U groups, up to 15 bytes of misalignment,
 * one word read past the end by rdw, rounded to 16. */
template <class T>
constexpr int kStageRow = (T::U * T::GB + 15 + 4 + 15) / 16 * 16;

/* Copies bytes [off, off + len) of rows row0 .. row0 + R - 1 (those below
 * n_rows) into dst[i] (dst[i] + (a & 15) is byte off of row i, a its
 * address). Loads first, then stores, so they are all in flight at once. */
template <class T, int R>
__device__ __forceinline__ void stage_rows(uint8_t (*dst)[kStageRow<T>], const uint8_t *w,
                                           size_t row_bytes, uint64_t row0, uint64_t n_rows,
                                           size_t off, uint32_t len, int lane)
{
    constexpr int GPR = T::U * T::GB / 16 + 1; /* most granules a row range holds */
    constexpr int NG = (R * GPR + 31) / 32;
    constexpr int NH = (R * 16 + 31) / 32;
    uint4 g[NG];
    uint32_t h[NH];
#pragma unroll
    for (int k = 0; k < NG; k++) {
        const int j = lane + 32 * k, i = j / GPR, q = j % GPR;
        if (j < R * GPR && row0 + i < n_rows) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(w + (row0 + i) * row_bytes + off);
            const uintptr_t a0 = (a + 15) & ~uintptr_t{15}, a1 = (a + len) & ~uintptr_t{15};
            if (a0 + 16u * (q + 1) <= a1)
                g[k] = __ldcs(reinterpret_cast<const uint4 *>(a0 + 16u * q));
        }
    }
#pragma unroll
    for (int k = 0; k < NH; k++) {
        const int j = lane + 32 * k, i = j >> 4, slot = j & 15;
        if (i < R && row0 + i < n_rows) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(w + (row0 + i) * row_bytes + off);
            const uintptr_t a0 = (a + 15) & ~uintptr_t{15}, a1 = (a + len) & ~uintptr_t{15};
            const uintptr_t p = slot < 8 ? a + 2u * slot : a1 + 2u * (slot - 8);
            const bool ok = slot < 8 ? p < a0 && p < a + len : a1 >= a0 && p < a + len;
            if (ok)
                h[k] = __ldcs(reinterpret_cast<const unsigned short *>(p));
        }
    }
#pragma unroll
    for (int k = 0; k < NG; k++) {
        const int j = lane + 32 * k, i = j / GPR, q = j % GPR;
        if (j < R * GPR && row0 + i < n_rows) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(w + (row0 + i) * row_bytes + off);
            const uintptr_t a0 = (a + 15) & ~uintptr_t{15}, a1 = (a + len) & ~uintptr_t{15};
            if (a0 + 16u * (q + 1) <= a1)
                *reinterpret_cast<uint4 *>(dst[i] + (a0 - (a & ~uintptr_t{15})) + 16 * q) = g[k];
        }
    }
#pragma unroll
    for (int k = 0; k < NH; k++) {
        const int j = lane + 32 * k, i = j >> 4, slot = j & 15;
        if (i < R && row0 + i < n_rows) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(w + (row0 + i) * row_bytes + off);
            const uintptr_t a0 = (a + 15) & ~uintptr_t{15}, a1 = (a + len) & ~uintptr_t{15};
            const uintptr_t p = slot < 8 ? a + 2u * slot : a1 + 2u * (slot - 8);
            const bool ok = slot < 8 ? p < a0 && p < a + len : a1 >= a0 && p < a + len;
            if (ok)
                *reinterpret_cast<uint16_t *>(dst[i] + (p - (a & ~uintptr_t{15}))) =
                    static_cast<uint16_t>(h[k]);
        }
    }
}

/* The 4 activations at x[p..p+3] (n elements valid from x; all of them
 * when full). */
__device__ __forceinline__ float4 ld_x4(const float *x, int p, bool vec4, bool full, int n)
{
    if (full && vec4)
        return __ldg(reinterpret_cast<const float4 *>(x + p));
    float4 r;
    r.x = full || p < n ? __ldg(x + p) : 0.0f;
    r.y = full || p + 1 < n ? __ldg(x + p + 1) : 0.0f;
    r.z = full || p + 2 < n ? __ldg(x + p + 2) : 0.0f;
    r.w = full || p + 3 < n ? __ldg(x + p + 3) : 0.0f;
    return r;
}

__device__ __forceinline__ float dot4(const float *q, float4 x)
{
    return fmaf(q[3], x.w, fmaf(q[2], x.z, fmaf(q[1], x.y, q[0] * x.x)));
}

/* Zeroes the levels of elements at or past n (a short plain group). */
__device__ __forceinline__ void mask_unit(Unit &u, int pa, int pb, int n)
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u.q[i] = pa + i < n ? u.q[i] : 0.0f;
        u.q[4 + i] = pb + i < n ? u.q[4 + i] : 0.0f;
    }
}

/* Adds lane's unit of group G (staged at g[i] + gi*GB for row i) times NS
 * activation rows into acc. */
template <class T, int R, int NS>
__device__ __forceinline__ void group_dot(const uint8_t *const *g, int gi, uint64_t G,
                                          const MvArgs &a, const float *x, int lane,
                                          float (&acc)[R][NS])
{
    const int elems = a.n - G * kGroup < kGroup ? static_cast<int>(a.n - G * kGroup) : kGroup;
    const bool full = T::end(lane) <= elems;
    if (!full && !(T::PLAIN && T::first(lane) < elems))
        return;
    const int pa = T::pa(lane), pb = T::pb(lane);
    Unit u[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        T::unit(g[i] + gi * T::GB, lane, u[i]);
        if (T::PLAIN && !full)
            mask_unit(u[i], pa, pb, elems);
    }
#pragma unroll
    for (int s = 0; s < NS; s++) {
        const float *xs = x + s * a.ldx + G * kGroup;
        const float4 xa = ld_x4(xs, pa, a.x_vec4, full, elems);
        const float4 xb = ld_x4(xs, pb, a.x_vec4, full, elems);
        const float suma = (xa.x + xa.y) + (xa.z + xa.w), sumb = (xb.x + xb.y) + (xb.z + xb.w);
#pragma unroll
        for (int i = 0; i < R; i++) {
            const float ra = dot4(u[i].q, xa), rb = dot4(u[i].q + 4, xb);
            if (T::PLAIN) {
                acc[i][s] += ra + rb;
                continue;
            }
            float v = fmaf(u[i].sa, ra, u[i].sb * rb);
            if (T::MIN)
                v -= fmaf(u[i].ma, suma, u[i].mb * sumb);
            acc[i][s] += v;
        }
    }
}

/* Sums acc over the warp, then over the row group's warps, and writes the
 * rows below n_rows of y (activation row s at y + s*ldy). */
template <int R, int NS>
__device__ __forceinline__ void reduce_store(float (&acc)[R][NS], float (*red)[R * NS],
                                             const MvArgs &a, float *y, uint64_t block_row0,
                                             int warp, int lane)
{
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int s = 0; s < NS; s++)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                acc[i][s] += __shfl_xor_sync(0xFFFFFFFFu, acc[i][s], o);
    const int kn = 1 << a.ks_log2;
    if (kn == 1) {
        const uint64_t row0 = block_row0 + static_cast<uint64_t>(warp) * R;
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int s = 0; s < NS; s++)
                if (lane == i * NS + s && row0 + i < a.n_rows)
                    y[s * a.ldy + row0 + i] = acc[i][s];
        return;
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int s = 0; s < NS; s++)
                red[warp][i * NS + s] = acc[i][s];
    __syncthreads();
    const int t = threadIdx.x, per_group = R * NS;
    if (t < (kWarps >> a.ks_log2) * per_group) {
        const int rg = t / per_group, k = t % per_group, i = k / NS, s = k % NS;
        float v = 0.0f;
        for (int w = 0; w < kn; w++)
            v += red[rg * kn + w][k];
        const uint64_t row = block_row0 + static_cast<uint64_t>(rg) * R + i;
        if (row < a.n_rows)
            y[s * a.ldy + row] = v;
    }
}

template <class T, int R, int NS>
__global__ void __launch_bounds__(kWarps * 32) mv_kernel(const MvArgs a)
{
    __shared__ __align__(16) uint8_t stage[kWarps][R][kStageRow<T>];
    __shared__ float red[kWarps][R * NS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kn = 1 << a.ks_log2, ks = warp & (kn - 1), rg = warp >> a.ks_log2;
    const uint64_t block_row0 = static_cast<uint64_t>(blockIdx.x) * (kWarps >> a.ks_log2) * R;
    const uint64_t row0 = block_row0 + static_cast<uint64_t>(rg) * R;
    const uint64_t ngroups = (a.n + kGroup - 1) / kGroup;
    const uint64_t nsteps = (ngroups + T::U - 1) / T::U;
    const size_t row_size = a.n / T::EE * T::EB;
    for (uint32_t job = blockIdx.y; job < a.n_jobs; job += gridDim.y) {
        const uint8_t *w = a.w;
        const float *x = a.x;
        float *y = a.y;
        if (a.ids) {
            const int32_t e = a.ids[job];
            w = e >= 0 ? static_cast<const uint8_t *>(a.addr[e]) : nullptr;
            if (!w)
                continue;
            x += static_cast<size_t>(job / a.x_div) * a.ldx;
            y += static_cast<size_t>(job) * a.ldy;
        }
        float acc[R][NS];
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int s = 0; s < NS; s++)
                acc[i][s] = 0.0f;
        for (uint64_t st = ks; st < nsteps; st += kn) {
            const size_t off = st * T::U * T::GB;
            const uint32_t len = static_cast<uint32_t>(
                row_size - off < T::U * T::GB ? row_size - off : T::U * T::GB);
            stage_rows<T, R>(stage[warp], w, a.row_bytes, row0, a.n_rows, off, len, lane);
            __syncwarp();
            const uint8_t *g[R];
#pragma unroll
            for (int i = 0; i < R; i++)
                g[i] = stage[warp][i] +
                       (reinterpret_cast<uintptr_t>(w + (row0 + i) * a.row_bytes + off) & 15u);
#pragma unroll
            for (int gi = 0; gi < T::U; gi++) {
                const uint64_t G = st * T::U + gi;
                if (G < ngroups)
                    group_dot<T, R, NS>(g, gi, G, a, x, lane, acc);
            }
            __syncwarp();
        }
        reduce_store<R, NS>(acc, red, a, y, block_row0, warp, lane);
        __syncthreads();
    }
}

/* ---- launchers ------------------------------------------------------------ */

constexpr int kRows = 4; /* rows per warp */

/* ks_log2 for rows of nsteps steps: up to 8 warps per row, none idle. */
int pick_ks(uint64_t nsteps)
{
    int k = 0;
    while (k < 3 && (2ull << k) <= nsteps)
        k++;
    return k;
}

template <class T, int NS>
int launch_t(MvArgs a, cudaStream_t stream)
{
    const uint64_t nsteps = ((a.n + kGroup - 1) / kGroup + T::U - 1) / T::U;
    a.ks_log2 = pick_ks(nsteps);
    const uint64_t rows_per_block = static_cast<uint64_t>(kWarps >> a.ks_log2) * kRows;
    const uint64_t blocks = (a.n_rows + rows_per_block - 1) / rows_per_block;
    if (blocks > 0x7FFFFFFFull) {
        log_error("cuda matvec: %llu rows are too many", (unsigned long long)a.n_rows);
        return -EINVAL;
    }
    dim3 grid(static_cast<unsigned>(blocks), a.n_jobs < kMaxJobsY ? a.n_jobs : kMaxJobsY);
    mv_kernel<T, kRows, NS><<<grid, kWarps * 32, 0, stream>>>(a);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        log_error("cuda matvec: launch failed: %s", cudaGetErrorString(err));
        return -EIO;
    }
    return 0;
}

template <int NS>
int launch(uint32_t type, const MvArgs &a, cudaStream_t stream)
{
    switch (type) {
    case QUANT_TYPE_Q8_0: return launch_t<TQ8_0, NS>(a, stream);
    case QUANT_TYPE_Q4_0: return launch_t<TQ4_0, NS>(a, stream);
    case QUANT_TYPE_Q4_K: return launch_t<TQ4_K, NS>(a, stream);
    case QUANT_TYPE_Q5_K: return launch_t<TQ5_K, NS>(a, stream);
    case QUANT_TYPE_Q6_K: return launch_t<TQ6_K, NS>(a, stream);
    case QUANT_TYPE_F16: return launch_t<TF16, NS>(a, stream);
    case QUANT_TYPE_BF16: return launch_t<TBF16, NS>(a, stream);
    case QUANT_TYPE_F32: return launch_t<TF32, NS>(a, stream);
    default: return -EINVAL;
    }
}

/* Elements and bytes per block of a supported type, else false. */
bool block_shape(uint32_t type, uint32_t *ee, uint32_t *eb)
{
    switch (type) {
    case QUANT_TYPE_Q8_0: *ee = 32, *eb = 34; return true;
    case QUANT_TYPE_Q4_0: *ee = 32, *eb = 18; return true;
    case QUANT_TYPE_Q4_K: *ee = 256, *eb = 144; return true;
    case QUANT_TYPE_Q5_K: *ee = 256, *eb = 176; return true;
    case QUANT_TYPE_Q6_K: *ee = 256, *eb = 210; return true;
    case QUANT_TYPE_F16: *ee = 1, *eb = 2; return true;
    case QUANT_TYPE_BF16: *ee = 1, *eb = 2; return true;
    case QUANT_TYPE_F32: *ee = 1, *eb = 4; return true;
    default: return false;
    }
}

/* The checks shared by all launchers; logs and returns -EINVAL. */
int check_weights(const char *what, uint32_t type, uintptr_t w, size_t row_bytes, uint64_t n)
{
    uint32_t ee, eb;
    if (!block_shape(type, &ee, &eb)) {
        log_error("%s: type %u is not supported", what, type);
        return -EINVAL;
    }
    if (n % ee || n / ee > SIZE_MAX / eb || row_bytes < n / ee * eb) {
        log_error("%s: %llu elements of type %u do not fit rows of %zu bytes", what,
                  (unsigned long long)n, type, row_bytes);
        return -EINVAL;
    }
    if ((w | row_bytes) & 1) {
        log_error("%s: weights %#llx with rows of %zu bytes are not 2-byte aligned", what,
                  (unsigned long long)w, row_bytes);
        return -EINVAL;
    }
    return 0;
}

bool x_vec4(const float *x, size_t ldx)
{
    return (reinterpret_cast<uintptr_t>(x) & 15u) == 0 && ldx % 4 == 0;
}

} /* namespace */

extern "C" bool cuda_matvec_supports(uint32_t type)
{
    uint32_t ee, eb;
    return block_shape(type, &ee, &eb);
}

extern "C" int cuda_matvec(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                           uint64_t n, const float *d_x, float *d_y, cudaStream_t stream)
{
    return cuda_matmul(type, d_w, row_bytes, n_rows, n, d_x, n, 1, d_y, n_rows, stream);
}

extern "C" int cuda_matmul(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                           uint64_t n, const float *d_X, size_t ldx, uint32_t S, float *d_Y,
                           size_t ldy, cudaStream_t stream)
{
    const char *what = "cuda matmul";
    int rc = check_weights(what, type, reinterpret_cast<uintptr_t>(d_w), row_bytes, n);
    if (rc)
        return rc;
    if (n_rows == 0 || S == 0)
        return 0;
    if (!d_w || !d_X || !d_Y || ldx < n || ldy < n_rows ||
        (reinterpret_cast<uintptr_t>(d_X) | reinterpret_cast<uintptr_t>(d_Y)) & 3) {
        log_error("%s: bad buffers (w %p x %p ldx %zu y %p ldy %zu for %llu x %llu)", what, d_w,
                  static_cast<const void *>(d_X), ldx, static_cast<void *>(d_Y), ldy,
                  (unsigned long long)n_rows, (unsigned long long)n);
        return -EINVAL;
    }
    MvArgs a = {};
    a.w = static_cast<const uint8_t *>(d_w);
    a.row_bytes = row_bytes;
    a.n_rows = n_rows;
    a.n = n;
    a.ldx = ldx;
    a.x_div = 1;
    a.ldy = ldy;
    a.n_jobs = 1;
    a.x_vec4 = x_vec4(d_X, S > 1 ? ldx : 0);
    for (uint32_t s = 0; s < S && rc == 0;) {
        const uint32_t left = S - s, ns = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        a.x = d_X + static_cast<size_t>(s) * ldx;
        a.y = d_Y + static_cast<size_t>(s) * ldy;
        switch (ns) {
        case 8: rc = launch<8>(type, a, stream); break;
        case 4: rc = launch<4>(type, a, stream); break;
        case 2: rc = launch<2>(type, a, stream); break;
        default: rc = launch<1>(type, a, stream); break;
        }
        s += ns;
    }
    return rc;
}

extern "C" int cuda_matvec_experts(uint32_t type, const void *const *d_addr, size_t row_bytes,
                                   uint64_t n_rows, uint64_t n, const int32_t *d_ids,
                                   uint32_t n_pairs, const float *d_X, size_t ldx, uint32_t x_div,
                                   float *d_Y, size_t ldy, cudaStream_t stream)
{
    const char *what = "cuda matvec_experts";
    int rc = check_weights(what, type, 0, row_bytes, n);
    if (rc)
        return rc;
    if (n_rows == 0 || n_pairs == 0)
        return 0;
    if (!d_addr || !d_ids || !d_X || !d_Y || x_div == 0 || ldx < n || ldy < n_rows ||
        (reinterpret_cast<uintptr_t>(d_X) | reinterpret_cast<uintptr_t>(d_Y)) & 3) {
        log_error("%s: bad buffers (addr %p ids %p x %p ldx %zu x_div %u y %p ldy %zu for "
                  "%llu x %llu)",
                  what, static_cast<const void *>(d_addr), static_cast<const void *>(d_ids),
                  static_cast<const void *>(d_X), ldx, x_div, static_cast<void *>(d_Y), ldy,
                  (unsigned long long)n_rows, (unsigned long long)n);
        return -EINVAL;
    }
    MvArgs a = {};
    a.addr = d_addr;
    a.ids = d_ids;
    a.row_bytes = row_bytes;
    a.n_rows = n_rows;
    a.n = n;
    a.x = d_X;
    a.ldx = ldx;
    a.x_div = x_div;
    a.y = d_Y;
    a.ldy = ldy;
    a.n_jobs = n_pairs;
    a.x_vec4 = x_vec4(d_X, ldx);
    return launch<1>(type, a, stream);
}
