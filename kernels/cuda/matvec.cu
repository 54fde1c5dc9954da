/*
 * cuda matvec: GGUF weight rows times f32 activations on the GPU (see
 * matvec.h; CPU twin kernels/cpu/matvec.h).
 *
 * Maths: y[r] = sum_i w[r][i] x[i] with w the dequantized weight of
 * model-spec 2.2/2.3 (each type's decoder: mv_types.cuh, also compiled for
 * the host by tests/test_mv_types.cpp), f32 products and f32 sums, activations never
 * quantized. Every type is cut into groups of 256 elements (8 blocks of
 * Q8_0/Q4_0, one K-quant super-block, 256 plain values; GB bytes each; the
 * last group of a row may be short). Lane l of a warp owns one unit of 8
 * elements of each group: two runs of 4 consecutive elements (positions pa
 * and pa + DPB). A unit decodes to float levels q with per-run scales s and
 * offsets c such that the run adds s * sum(q*x) + c * sum(x) (times a
 * per-type power of two FIN applied once at the end). Levels come from
 * bits planted into a float's mantissa with one byte permute each: 4-, 5-
 * and 6-bit values become 1 + v/16 or 1 + v/128 (the 1 is taken back through
 * sum(x); the cancellation costs a few ulps, far inside the tolerance),
 * Q8_0 bytes become 2^23 + (v + 128) minus 2^23 + 128 exactly. So there is
 * no int-to-float conversion and about two instructions per weight.
 *
 * Shapes and ownership (mv_kernel): a block is 8 warps. The warps form
 * 8/KS row groups of KS warps; a row group owns R = 8 consecutive rows (4
 * for F32 and Q6_K) and its KS warps split the row's steps (a step is U
 * groups) round-robin, KS chosen as the fewest that give the launch 4096
 * warps (long rows of few rows: KS = 8; the vocabulary projection: KS = 1).
 * A warp owns a staging buffer of two steps of its R rows in shared
 * memory. When the rows start at multiples of VW bytes (16, or 4 for Q6_K whose
 * 210-byte blocks allow no more) each lane copies VW-byte words of each
 * row with cp.async, the next step in flight while this one is decoded;
 * else (rows only 2-byte aligned: an odd number of 18-byte Q4_0 blocks, a
 * misplaced expert) words are gathered from 2-byte loads. Lanes read their
 * unit's bytes from the staging buffer as aligned words joined by funnel
 * shifts. Each lane loads its 8 activations of a step's groups (read-only
 * cache, 16-byte loads when aligned) before waiting for the weights, and
 * uses them for the R rows (and, for a matmul chunk, for NS activation
 * rows at once). Lanes reduce with shuffles; the KS warps of a row group
 * meet in shared memory in a fixed order, so results do not depend on
 * timing.
 *
 * Jobs (grid y): one for cuda_matvec and per matmul chunk; one per (token,
 * slot) pair for cuda_matvec_experts, whose blocks read the expert id and
 * its weight address from device memory, skip the pair when the address
 * is NULL (or the id negative), and pick the staging by the address's
 * alignment. Expert addresses must be 2-byte aligned (GGUF data always
 * is). cuda_matmul runs chunks of NS = 8, 4, 2, 1 activation rows, each
 * chunk reading the weights once.
 */
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/mv_types.cuh"
#include "kernels/cuda/mvq.h"
#include "kernels/cuda/mvq.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/sgemm.h"
#include "kernels/cuda/tail.cuh"

#include <errno.h>

#include <type_traits>

#include <cuda_fp16.h>

extern "C" {
#include "common/log.h"
#include "model/quant.h"
}

namespace {

using namespace mv;

constexpr int kWarps = 8;              /* warps per block */
static_assert(kWarps * 32 == kTailThreads, "cuda tails assume blocks of kTailThreads");
constexpr int kRows = 8;               /* rows per warp (R); F32 and Q6_K take 4 */
constexpr int kGroup = 256;            /* elements per group */
constexpr unsigned kMaxJobsY = 65535u; /* grid y limit */
constexpr uint64_t kWantWarps = 4096;  /* warps a launch should have to fill an H200 */
constexpr uint64_t kMaxN = 1ull << 28; /* longest row: its bytes fit 31 bits */
constexpr size_t kPrefetch = 64 * 1024; /* weight bytes a block asks for in L2 before its wait */

/* ---- staging ----------------------------------------------------------------- */

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
    int ks_log2;     /* warps per row group: 1 << ks_log2 */
    bool x_vec4;     /* every activation row is 16-byte aligned */
    bool rows_align; /* row_bytes and the row size are multiples of VW */
    TailArgs tail;   /* run by the launch's last block (tail.cuh; NS = 1 only) */
    /* norm in (mv_kernel's XS form): x is not read; every block forms the activation row
     * rmsnorm(nin_h + nin_add) * nin_w (cuda_norm_in) in shared memory, h and the weights
     * loaded before its wait (h was written launches back: the caller's promise), the added
     * row after it; the blocks also write the row to nin_out and, rounded for the int8
     * products (mvq.cuh's layout), to nin_xq (NULL: not) */
    const float *nin_h, *nin_add, *nin_w;
    float nin_eps;
    uint32_t nin_width; /* cuda_norm_threads(n) */
    float *nin_out;
    int8_t *nin_xq;
    /* the shared expert's gate (cuda_norm_in.gate, .gs): the launch's last block, which has
     * no rows, writes sigmoid(nin_gate . row) into *nin_gs by the combine's tree over
     * nin_gate_width (cuda_norm_wide_threads(n)) threads; nin_gate NULL: no such block */
    const float *nin_gate;
    float *nin_gs;
    uint32_t nin_gate_width;
    unsigned long long *probe; /* cuda_norm_in.probe (diagnostics), or NULL */
};

/* cuda_norm_in.probe's mark i of this block (thread 0): the time and the SM's clock. */
__device__ __forceinline__ void probe_mark(const MvArgs &a, int i)
{
#ifdef LAMINA_MVQ_PROBE
    if (!a.probe || threadIdx.x || blockIdx.y || blockIdx.x >= CUDA_PROBE_BLOCKS)
        return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    unsigned long long *p = a.probe + static_cast<size_t>(blockIdx.x) * CUDA_PROBE_SLOTS;
    p[i] = t;
    p[8 + i] = static_cast<unsigned long long>(clock64());
#else
    (void)a;
    (void)i;
#endif
}

/* The longest activation row the XS form takes: a thread's columns (n / nin_width, at most
 * kXsCols) stay in registers. */
constexpr uint32_t kXsMax = 2048;
constexpr int kXsCols = 8;

/* The XS form's columns of thread t (< nin_width <= 256): t, t + width, ... (at most
 * kXsCols), as cuda_add_rmsnorm's (norm_rows_kernel<true>, the ADD_NORM tail's) thread t
 * owns them. Before the wait: h and the weights. */
struct NormIn {
    float hv[kXsCols], wv[kXsCols];
};

__device__ __forceinline__ void norm_in_early(const MvArgs &a, NormIn &r)
{
    const uint32_t n = static_cast<uint32_t>(a.n), width = a.nin_width, v0 = threadIdx.x;
#pragma unroll
    for (int b = 0; b < kXsCols; b++) {
        const uint32_t i = v0 + b * width;
        const bool in = v0 < width && i < n;
        r.hv[b] = in ? __ldcg(a.nin_h + i) : 0.0f;
        r.wv[b] = in && a.nin_w ? a.nin_w[i] : 1.0f;
    }
}

/* After the wait: the added row, then the sums of squares in thread t's order, ops_block_sum's
 * tree (tail_vsum), the scale and the row into s_x, then the block's share of the copies: the
 * same expressions as cuda_add_rmsnorm. Every thread of the block calls it. */
__device__ __forceinline__ void norm_in_row(const MvArgs &a, NormIn &r, float *s_x)
{
    __shared__ float s_red[32];
    const uint32_t n = static_cast<uint32_t>(a.n), width = a.nin_width, v0 = threadIdx.x;
    float dv[kXsCols];
#pragma unroll
    for (int b = 0; b < kXsCols; b++) {
        const uint32_t i = v0 + b * width;
        dv[b] = v0 < width && i < n ? __ldcg(a.nin_add + i) : 0.0f;
    }
    const float scale = tail_add_norm_scale(r.hv, dv, n, width, a.nin_eps, s_red);
    if (v0 < width)
#pragma unroll
        for (int b = 0; b < kXsCols; b++) {
            const uint32_t i = v0 + b * width;
            if (i < n) {
                const float v = r.hv[b] * scale;
                s_x[i] = a.nin_w ? v * r.wv[b] : v;
            }
        }
    __syncthreads();
    /* the copies: block x's first warp writes blocks of 32 x, x + grid, ... of the row
     * (and rounds them as the int8 products do), so that no block does them all */
    int8_t *xl = a.nin_xq;
    float *xd = xl ? reinterpret_cast<float *>(xl + n) : nullptr;
    if (threadIdx.x < 32 && blockIdx.y == 0 && (a.nin_out || xl))
        for (uint32_t bb = blockIdx.x; bb < n / 32; bb += gridDim.x) {
            const float o = s_x[bb * 32 + threadIdx.x];
            if (a.nin_out)
                a.nin_out[bb * 32 + threadIdx.x] = o;
            if (xl)
                mvq::round_block(o, bb, true, xl, xd, xd + n / 32);
        }
}

/* The combine's virtual threads per thread of the gate's block: a block of kGateVirt *
 * kWarps * 32 = 1024 threads, the widest cuda_norm_wide_threads gives. */
constexpr int kGateVirt = 4;

/* The gate's block copies the gate (n floats) into s_g, its staging memory (it has no
 * rows), before its wait: every thread calls. */
__device__ __forceinline__ void norm_in_gate_load(const MvArgs &a, float *s_g)
{
    const uint32_t n = static_cast<uint32_t>(a.n);
    for (uint32_t j = threadIdx.x; j < n; j += kWarps * 32)
        s_g[j] = a.nin_gate[j];
}

/* The shared expert's gate over the formed row s_x, by the gate's block (every thread
 * calls, after norm_in_row's barrier): virtual thread v < nin_gate_width sums gate[j]
 * s_x[j] for j = v, v + width, ... as the combine's thread v does (combine.cu's gate_of, f
 * the row), ops_block_sum's tree over the virtual warps (tail_vsum), and thread 0 writes
 * the combine's sigmoid of it. The gate from s_g (norm_in_gate_load). */
__device__ __forceinline__ void norm_in_gate(const MvArgs &a, const float *s_x, const float *s_g)
{
    __shared__ float s_red[32];
    const uint32_t n = static_cast<uint32_t>(a.n), width = a.nin_gate_width;
    const float *gate = s_g;
    float part[kGateVirt];
#pragma unroll
    for (int m = 0; m < kGateVirt; m++) {
        const uint32_t v = threadIdx.x + m * kWarps * 32;
        float d = 0.0f;
        if (v < width)
            for (uint32_t j = v; j < n; j += width)
                d += gate[j] * s_x[j];
        part[m] = d;
    }
    const float d = tail_vsum<kGateVirt, kWarps * 32>(part, width, s_red);
    if (threadIdx.x == 0)
        *a.nin_gs = 1.0f / (1.0f + expf(-d));
}

/* Staging buffer bytes per row: a step plus the word rdw reads past it,
 * rounded to 16. */
template <class T>
constexpr int kStageRow = (T::U * T::GB + 4 + 15) / 16 * 16;

template <int VW>
struct VecOf;
template <>
struct VecOf<16> {
    using type = uint4;
};
template <>
struct VecOf<4> {
    using type = uint32_t;
};

/* Gathers the step bytes [0, len) of a row at the 2-byte aligned src into
 * the staging row dst (16-byte aligned) as VW-byte words assembled from
 * 2-byte loads, lane l taking words l, l + 32, ...; all loads are issued
 * before any store. */
template <class T>
__device__ __forceinline__ void gather_row(uint8_t *dst, const uint8_t *src, uint32_t len,
                                           int lane)
{
    constexpr int VW = T::VW, PER = (T::U * T::GB / VW + 31) / 32;
    using V = typename VecOf<VW>::type;
    V v[PER];
#pragma unroll
    for (int m = 0; m < PER; m++) {
        const uint32_t at = static_cast<uint32_t>(lane + 32 * m) * VW;
        uint32_t h[VW / 2];
#pragma unroll
        for (int k = 0; k < VW / 2; k++)
            h[k] = at + 2 * k < len
                       ? __ldcs(reinterpret_cast<const unsigned short *>(src + at + 2 * k))
                       : 0u;
        uint32_t *out = reinterpret_cast<uint32_t *>(&v[m]);
#pragma unroll
        for (int k = 0; k < VW / 4; k++)
            out[k] = h[2 * k] | h[2 * k + 1] << 16;
    }
#pragma unroll
    for (int m = 0; m < PER; m++) {
        const uint32_t at = static_cast<uint32_t>(lane + 32 * m) * VW;
        if (at < len)
            *reinterpret_cast<V *>(dst + at) = v[m];
    }
}

/* ---- the kernel ------------------------------------------------------------ */

/* Activation loads: through the read-only cache, or (XS: the row is in
 * shared memory, formed by the block) plain loads. */
template <bool XS>
__device__ __forceinline__ float4 ldx4(const float *p)
{
    if (XS)
        return *reinterpret_cast<const float4 *>(p);
    return __ldg(reinterpret_cast<const float4 *>(p));
}

template <bool XS>
__device__ __forceinline__ float ldx1(const float *p)
{
    if (XS)
        return *p;
    return __ldg(p);
}

/* The 4 activations at p, which is element `at` of a group of which n
 * elements exist (all of them when full). */
template <bool XS>
__device__ __forceinline__ float4 ld_x4(const float *p, int at, bool vec4, bool full, int n)
{
    if (full && vec4)
        return ldx4<XS>(p);
    float4 r;
    r.x = full || at < n ? ldx1<XS>(p) : 0.0f;
    r.y = full || at + 1 < n ? ldx1<XS>(p + 1) : 0.0f;
    r.z = full || at + 2 < n ? ldx1<XS>(p + 2) : 0.0f;
    r.w = full || at + 3 < n ? ldx1<XS>(p + 3) : 0.0f;
    return r;
}

__device__ __forceinline__ float dot4(const float *q, float4 x, float init)
{
    return fmaf(q[3], x.w, fmaf(q[2], x.z, fmaf(q[1], x.y, fmaf(q[0], x.x, init))));
}

__device__ __forceinline__ float sum4(float4 x)
{
    return (x.x + x.y) + (x.z + x.w);
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

/* acc += unit u times activations xa, xb (run sums sa, sb). */
template <class T>
__device__ __forceinline__ float unit_dot(const Unit &u, float4 xa, float4 xb, float suma,
                                          float sumb, float acc)
{
    if (T::PLAIN)
        return acc + dot4(u.q + 4, xb, dot4(u.q, xa, 0.0f));
    if (T::SAME) {
        const float bias = T::K != 0.0f ? T::K * (suma + sumb) : 0.0f;
        return fmaf(u.sa, dot4(u.q + 4, xb, dot4(u.q, xa, bias)), acc);
    }
    if (T::MIN) {
        acc = fmaf(u.ca, suma, fmaf(u.cb, sumb, acc));
        return fmaf(u.sa, dot4(u.q, xa, 0.0f), fmaf(u.sb, dot4(u.q + 4, xb, 0.0f), acc));
    }
    return fmaf(u.sa, dot4(u.q, xa, T::K * suma), fmaf(u.sb, dot4(u.q + 4, xb, T::K * sumb), acc));
}

/* Lane's unit of group gi of a staged row (16-byte aligned in shared
 * memory, so only the group offset decides the word alignment). */
template <class T>
__device__ __forceinline__ void decode(const uint8_t *row, int gi, int lane, Unit &u)
{
    if ((gi * T::GB) % 4 == 0)
        T::template unit<true>(row + gi * T::GB, lane, u);
    else
        T::template unit<false>(row + gi * T::GB, lane, u);
}

/* Adds lane's unit of group gi of the staged step (row i at g[i]) times
 * the activations xa, xb (runs A and B, loaded beforehand) into acc. */
template <class T, int R>
__device__ __forceinline__ void group_dot_x(const uint8_t *const *g, int gi, float4 xa, float4 xb,
                                            int lane, float (&acc)[R][1])
{
    const float suma = sum4(xa), sumb = sum4(xb);
#pragma unroll
    for (int i = 0; i < R; i++) {
        Unit u;
        decode<T>(g[i], gi, lane, u);
        acc[i][0] = unit_dot<T>(u, xa, xb, suma, sumb, acc[i][0]);
    }
}

/* Adds lane's unit of group gi of the staged step (row i at g[i]) times NS
 * activation rows into acc; xp is the lane's run A of the group in
 * activation row 0. FAST: the group is whole and the activations 16-byte
 * aligned; else elems of the group's elements exist. */
template <class T, int R, int NS, bool FAST, bool XS>
__device__ __forceinline__ void group_dot(const uint8_t *const *g, int gi, const float *xp,
                                          int elems, const MvArgs &a, int lane,
                                          float (&acc)[R][NS])
{
    bool full = true;
    const int pa = T::pa(lane), pb = pa + T::DPB;
    if (!FAST && T::EE != kGroup && elems < kGroup) {
        full = T::end(lane) <= elems;
        if (!full && !(T::PLAIN && T::first(lane) < elems))
            return;
    }
    auto ld = [&](const float *p, int at) {
        if (FAST)
            return ldx4<XS>(p);
        return ld_x4<XS>(p, at, a.x_vec4, full, elems);
    };
    if constexpr (NS == 1) {
        const float4 xa = ld(xp, pa), xb = ld(xp + T::DPB, pb);
        const float suma = sum4(xa), sumb = sum4(xb);
#pragma unroll
        for (int i = 0; i < R; i++) {
            Unit u;
            decode<T>(g[i], gi, lane, u);
            if (T::PLAIN && !full)
                mask_unit(u, pa, pb, elems);
            acc[i][0] = unit_dot<T>(u, xa, xb, suma, sumb, acc[i][0]);
        }
    } else {
        Unit u[R];
#pragma unroll
        for (int i = 0; i < R; i++) {
            decode<T>(g[i], gi, lane, u[i]);
            if (T::PLAIN && !full)
                mask_unit(u[i], pa, pb, elems);
        }
#pragma unroll
        for (int s = 0; s < NS; s++) {
            const float4 xa = ld(xp + s * a.ldx, pa), xb = ld(xp + s * a.ldx + T::DPB, pb);
            const float suma = sum4(xa), sumb = sum4(xb);
#pragma unroll
            for (int i = 0; i < R; i++)
                acc[i][s] = unit_dot<T>(u[i], xa, xb, suma, sumb, acc[i][s]);
        }
    }
}

/* Sums acc over the warp, then over the row group's warps, and writes the
 * rows below n_rows of y (activation row s at y + s*ldy). */
template <class T, int R, int NS>
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
                if (lane == ((i * NS + s) & 31) && row0 + i < a.n_rows)
                    y[s * a.ldy + row0 + i] = acc[i][s] * T::FIN;
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
            y[s * a.ldy + row] = v * T::FIN;
    }
}

/* Step geometry of one job's rows (32-bit: the launcher bounds a row to
 * 2^28 elements). */
template <class T>
struct Steps {
    static constexpr uint32_t SB = T::U * T::GB, SE = T::U * kGroup; /* bytes, elements */
    uint32_t n, ngroups, nfull, nsteps, nfast, row_size;

    __device__ __forceinline__ explicit Steps(uint64_t n64)
    {
        n = static_cast<uint32_t>(n64);
        ngroups = (n + kGroup - 1) / kGroup;
        nfull = n / kGroup;
        nsteps = (ngroups + T::U - 1) / T::U;
        nfast = nfull / T::U;
        row_size = n / T::EE * T::EB;
    }
    __device__ __forceinline__ uint32_t len(uint32_t s) const
    {
        return row_size - s * SB < SB ? row_size - s * SB : SB;
    }
};

/* Decodes step s staged at stage[i] (row i) against the activations. */
template <class T, int R, int NS, bool XS = false>
__device__ __forceinline__ void step_dot(const uint8_t (*stage)[kStageRow<T>], const Steps<T> &sp,
                                         uint32_t s, const MvArgs &a, const float *xp, int lane,
                                         float (&acc)[R][NS])
{
    const uint8_t *g[R];
#pragma unroll
    for (int i = 0; i < R; i++)
        g[i] = stage[i];
    const float *xs = xp + s * Steps<T>::SE;
    if (s < sp.nfast && a.x_vec4) {
#pragma unroll
        for (int gi = 0; gi < T::U; gi++)
            group_dot<T, R, NS, true, XS>(g, gi, xs + gi * kGroup, kGroup, a, lane, acc);
        return;
    }
#pragma unroll
    for (int gi = 0; gi < T::U; gi++) {
        const uint32_t G = s * T::U + gi;
        if (G < sp.ngroups) {
            const int elems = G < sp.nfull ? kGroup : static_cast<int>(sp.n - G * kGroup);
            group_dot<T, R, NS, false, XS>(g, gi, xs + gi * kGroup, elems, a, lane, acc);
        }
    }
}

/* cp.async copies (sm_80 and later; plain load and store before): VW bytes
 * from global src to shared dst, bypassing registers and, for 16 bytes,
 * L1. */
template <int VW>
__device__ __forceinline__ void copy_async(uint8_t *dst, const uint8_t *src)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    if (VW == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
#else
    using V = typename VecOf<VW>::type;
    *reinterpret_cast<V *>(dst) = *reinterpret_cast<const V *>(src);
#endif
}

__device__ __forceinline__ void copy_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

__device__ __forceinline__ void copy_wait_all()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;\n" ::);
#endif
}

/* Waits until at most one group of this thread's copies is in flight. */
__device__ __forceinline__ void copy_wait_one()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;\n" ::);
#endif
}

/* Copies step s of the R rows at row0 into staging buffer buf with cp.async
 * (not committed). */
template <class T, int R>
__device__ __forceinline__ void stage_issue(uint8_t (*stage)[R][kStageRow<T>], const MvArgs &a,
                                            const uint8_t *w, uint64_t row0, const Steps<T> &sp,
                                            uint32_t s, int buf, int lane)
{
    constexpr int VW = T::VW, PER = (T::U * T::GB / VW + 31) / 32;
    const int rows = a.n_rows - row0 < R ? static_cast<int>(a.n_rows - row0) : R;
    const uint8_t *src = w + row0 * a.row_bytes + lane * VW;
    const int lim = static_cast<int>(sp.len(s)) - lane * VW;
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int m = 0; m < PER; m++)
            if (i < rows && 32 * m * VW < lim)
                copy_async<VW>(stage[buf][i] + lane * VW + 32 * m * VW,
                               src + i * a.row_bytes + s * Steps<T>::SB + 32 * m * VW);
}

/* Rows starting at VW-aligned addresses: steps ks, ks + kn, ... copied
 * with cp.async into NB staging buffers; with two, the next step is in
 * flight while this one is decoded. pre: step ks is already in buffer 0,
 * its own committed group (issued before the PDL wait: weights only). */
template <class T, int R, int NB, int NS, bool XS = false>
__device__ __forceinline__ void run_steps_async(uint8_t (*stage)[R][kStageRow<T>],
                                                const MvArgs &a, const uint8_t *w,
                                                const float *x, uint64_t row0, int ks, int kn,
                                                int lane, float (&acc)[R][NS], bool pre)
{
    const Steps<T> sp(a.n);
    auto issue = [&](uint32_t s, int buf) { stage_issue<T, R>(stage, a, w, row0, sp, s, buf, lane); };
    const float *xp = x + T::pa(lane);
    uint32_t s = ks;
    int buf = 0;
    if (!pre) {
        if (NB == 2 && s < sp.nsteps)
            issue(s, 0);
        copy_commit();
    }
    for (; s < sp.nsteps; s += kn, buf ^= NB - 1) {
        if (NB == 1) {
            if (!(pre && s == static_cast<uint32_t>(ks)))
                issue(s, 0);
        } else if (s + kn < sp.nsteps)
            issue(s + kn, buf ^ 1);
        copy_commit();
        /* a whole step of one activation row: its loads start before the
         * wait for the weights, so the two latencies overlap */
        const bool fast = NS == 1 && s < sp.nfast && a.x_vec4;
        float4 xv[T::U][2];
        if (fast)
#pragma unroll
            for (int gi = 0; gi < T::U; gi++) {
                const float *xs = xp + s * Steps<T>::SE + gi * kGroup;
                xv[gi][0] = ldx4<XS>(xs);
                xv[gi][1] = ldx4<XS>(xs + T::DPB);
            }
        if (NB == 1)
            copy_wait_all();
        else
            copy_wait_one();
        __syncwarp();
        if constexpr (NS == 1) {
            if (fast) {
                const uint8_t *g[R];
#pragma unroll
                for (int i = 0; i < R; i++)
                    g[i] = stage[buf][i];
#pragma unroll
                for (int gi = 0; gi < T::U; gi++)
                    group_dot_x<T, R>(g, gi, xv[gi][0], xv[gi][1], lane, acc);
            } else {
                step_dot<T, R, NS, XS>(stage[buf], sp, s, a, xp, lane, acc);
            }
        } else {
            step_dot<T, R, NS, XS>(stage[buf], sp, s, a, xp, lane, acc);
        }
        __syncwarp();
    }
}

/* Rows only 2-byte aligned (rare): each step gathered row by row from
 * 2-byte loads, then decoded. */
template <class T, int R, int NS>
__device__ __forceinline__ void run_steps_regs(uint8_t (*stage)[kStageRow<T>], const MvArgs &a,
                                               const uint8_t *w, const float *x, uint64_t row0,
                                               int ks, int kn, int lane, float (&acc)[R][NS])
{
    const Steps<T> sp(a.n);
    const int rows = a.n_rows - row0 < R ? static_cast<int>(a.n_rows - row0) : R;
    const uint8_t *src = w + row0 * a.row_bytes;
    for (uint32_t s = ks; s < sp.nsteps; s += kn) {
        for (int i = 0; i < rows; i++)
            gather_row<T>(stage[i], src + i * a.row_bytes + s * Steps<T>::SB, sp.len(s), lane);
        __syncwarp();
        step_dot<T, R, NS>(stage, sp, s, a, x + T::pa(lane), lane, acc);
        __syncwarp();
    }
}

/* Blocks per SM the registers must allow: 4 (64 registers) for the
 * aligned decode of the types that fit without spilling (measured: more
 * warps beat more registers there), 3 for the others and the experts,
 * fewer for the matmul chunks. */
template <class T, int NS, int MODE>
constexpr int min_blocks()
{
    if (NS > 2)
        return 1;
    if (NS == 2)
        return 2;
    return MODE == 1 && T::LEAN ? 4 : 3;
}

/* MODE: 0 rows 2-byte aligned, 1 rows VW-aligned, 2 decided per job by
 * the weight address (experts). */
template <class T, int R, int NS, int MODE, bool TAIL = false, bool XS = false>
__global__ void __launch_bounds__(kWarps * 32, min_blocks<T, NS, MODE>()) mv_kernel(const MvArgs a)
{
    constexpr int NB = kWarps * 2 * R * kStageRow<T> <= 40 * 1024 ? 2 : 1;
    __shared__ __align__(16) uint8_t stage[kWarps][NB][R][kStageRow<T>];
    __shared__ __align__(16) float s_x[XS ? kXsMax : 4];
    __shared__ float red[kWarps][R * NS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kn = 1 << a.ks_log2, ks = warp & (kn - 1), rg = warp >> a.ks_log2;
    const uint64_t block_row0 = static_cast<uint64_t>(blockIdx.x) * (kWarps >> a.ks_log2) * R;
    const uint64_t row0 = block_row0 + static_cast<uint64_t>(rg) * R;
    if constexpr (XS)
        probe_mark(a, 0);
    /* PDL: the block's rows of a plain product are weights only, asked for
     * in L2 while the kernel before may still run; expert addresses need the
     * ids, activations the wait */
    if (!a.ids && blockIdx.y == 0 && threadIdx.x == 0 && block_row0 < a.n_rows) {
        const uint64_t rows = (kWarps >> a.ks_log2) * R;
        const uint64_t left = a.n_rows - block_row0;
        const size_t bytes = (left < rows ? left : rows) * a.row_bytes;
        pdl_prefetch_l2(a.w + block_row0 * a.row_bytes, bytes < kPrefetch ? bytes : kPrefetch);
    }
    if constexpr (TAIL)
        tail_prefetch(a.tail);
    /* the gate's block (XS only): the launch's last, past the rows */
    const bool gate_block = XS && a.nin_gate && blockIdx.x == gridDim.x - 1 && blockIdx.y == 0;
    float *s_g = reinterpret_cast<float *>(&stage[0][0][0][0]);
    static_assert(!XS || sizeof(stage) >= kXsMax * sizeof(float), "the gate fits in staging");
    if (gate_block)
        norm_in_gate_load(a, s_g);
    NormIn nr;
    if constexpr (XS)
        norm_in_early(a, nr);
    /* a plain product of aligned rows: its warp's first step into staging
     * before the wait too (the decode of one job) */
    const bool pre = MODE == 1 && NS == 1 && !a.ids && a.n_jobs == 1 && row0 < a.n_rows &&
                     static_cast<uint32_t>(ks) < Steps<T>(a.n).nsteps;
    if (pre) {
        stage_issue<T, R>(stage[warp], a, a.w, row0, Steps<T>(a.n), ks, 0, lane);
        copy_commit();
    }
    pdl_wait();
    if constexpr (XS)
        probe_mark(a, 1);
    if constexpr (TAIL)
        tail_mark_ids(a.tail);
    pdl_trigger();
    if constexpr (XS) {
        norm_in_row(a, nr, s_x);
        probe_mark(a, 2);
        if (gate_block)
            norm_in_gate(a, s_x, s_g);
    }
    for (uint32_t job = blockIdx.y; job < a.n_jobs; job += gridDim.y) {
        const uint8_t *w = a.w;
        const float *x = XS ? s_x : a.x;
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
        if (row0 < a.n_rows) {
            const bool wide = MODE == 1 || (MODE == 2 && a.rows_align &&
                                            (reinterpret_cast<uintptr_t>(w) & (T::VW - 1)) == 0);
            if (MODE != 0 && wide)
                run_steps_async<T, R, NB, NS, XS>(stage[warp], a, w, x, row0, ks, kn, lane,
                                                  acc, pre);
            else if (MODE != 1 && !XS)
                run_steps_regs<T, R, NS>(stage[warp][0], a, w, x, row0, ks, kn, lane, acc);
        }
        reduce_store<T, R, NS>(acc, red, a, y, block_row0, warp, lane);
        __syncthreads();
    }
    if constexpr (XS)
        probe_mark(a, 3);
    if constexpr (TAIL) /* its own instantiation: the others keep their registers */
        tail_finish<false>(a.tail);
    if constexpr (XS)
        probe_mark(a, 4);
}

/* ---- launchers ------------------------------------------------------------ */

/* ks_log2: the fewest warps per row (so each does several steps) that give
 * the launch kWantWarps warps, at most 8 and at most one per step. */
int pick_ks(uint64_t nsteps, uint64_t row_groups)
{
    int k = 0;
    while (k < 3 && (2ull << k) <= nsteps && (row_groups << k) < kWantWarps)
        k++;
    return k;
}

template <class T, int NS>
int launch_t(MvArgs a, int mode, cudaStream_t stream)
{
    const uint64_t nsteps = ((a.n + kGroup - 1) / kGroup + T::U - 1) / T::U;
    constexpr int R = T::GB >= 1024 || T::VW < 16 ? 4 : kRows; /* F32, Q6_K: 4 (measured) */
    const uint64_t row_groups = (a.n_rows + R - 1) / R;
    a.ks_log2 = pick_ks(nsteps, row_groups * (a.n_jobs < kMaxJobsY ? a.n_jobs : kMaxJobsY));
    const size_t row_size = a.n / T::EE * T::EB;
    a.rows_align = (a.row_bytes | row_size) % T::VW == 0;
    if (mode == 1 && !(a.rows_align && reinterpret_cast<uintptr_t>(a.w) % T::VW == 0))
        mode = 0;
    const uint64_t rows_per_block = static_cast<uint64_t>(kWarps >> a.ks_log2) * R;
    /* the norm-in form's gate: a block past the rows */
    const uint64_t blocks =
        (a.n_rows + rows_per_block - 1) / rows_per_block + (a.nin_gate ? 1 : 0);
    if (blocks > 0x7FFFFFFFull) {
        log_error("cuda matvec: %llu rows are too many", (unsigned long long)a.n_rows);
        return -EINVAL;
    }
    dim3 grid(static_cast<unsigned>(blocks), a.n_jobs < kMaxJobsY ? a.n_jobs : kMaxJobsY);
    if constexpr (NS > 1) {
        pdl_launch(mv_kernel<T, R, NS, 2>, grid, kWarps * 32, 0, stream, a);
    } else if (a.nin_h) { /* the norm-in form: F32 rows (routers), aligned */
        if constexpr (std::is_same<T, TF32>::value) {
            if (mode != 1)
                return -ENOTSUP;
            pdl_launch(mv_kernel<T, R, NS, 1, true, true>, grid, kWarps * 32, 0, stream, a);
        } else {
            return -ENOTSUP;
        }
    } else if (mode == 2)
        pdl_launch(mv_kernel<T, R, NS, 2>, grid, kWarps * 32, 0, stream, a);
    else if (a.tail.t.kind != CUDA_TAIL_NONE && mode == 1)
        pdl_launch(mv_kernel<T, R, NS, 1, true>, grid, kWarps * 32, 0, stream, a);
    else if (a.tail.t.kind != CUDA_TAIL_NONE)
        pdl_launch(mv_kernel<T, R, NS, 0, true>, grid, kWarps * 32, 0, stream, a);
    else if (mode == 1)
        pdl_launch(mv_kernel<T, R, NS, 1>, grid, kWarps * 32, 0, stream, a);
    else
        pdl_launch(mv_kernel<T, R, NS, 0>, grid, kWarps * 32, 0, stream, a);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        log_error("cuda matvec: launch failed: %s", cudaGetErrorString(err));
        return -EIO;
    }
    return 0;
}

/* mode: 1 when the weights may be aligned (matvec), 2 for experts; the
 * matmul chunks (NS > 1) decide per job like experts. */
template <int NS>
int launch(uint32_t type, const MvArgs &a, int mode, cudaStream_t stream)
{
    switch (type) {
    case QUANT_TYPE_Q8_0: return launch_t<TQ8_0, NS>(a, mode, stream);
    case QUANT_TYPE_Q4_0: return launch_t<TQ4_0, NS>(a, mode, stream);
    case QUANT_TYPE_Q4_K: return launch_t<TQ4_K, NS>(a, mode, stream);
    case QUANT_TYPE_Q5_K: return launch_t<TQ5_K, NS>(a, mode, stream);
    case QUANT_TYPE_Q6_K: return launch_t<TQ6_K, NS>(a, mode, stream);
    case QUANT_TYPE_Q4_1: return launch_t<TQ4_1, NS>(a, mode, stream);
    case QUANT_TYPE_Q5_0: return launch_t<TQ5_0, NS>(a, mode, stream);
    case QUANT_TYPE_Q5_1: return launch_t<TQ5_1, NS>(a, mode, stream);
    case QUANT_TYPE_IQ4_NL: return launch_t<TIQ4_NL, NS>(a, mode, stream);
    case QUANT_TYPE_IQ4_XS: return launch_t<TIQ4_XS, NS>(a, mode, stream);
    case QUANT_TYPE_Q2_K: return launch_t<TQ2_K, NS>(a, mode, stream);
    case QUANT_TYPE_Q3_K: return launch_t<TQ3_K, NS>(a, mode, stream);
    case QUANT_TYPE_F16: return launch_t<TF16, NS>(a, mode, stream);
    case QUANT_TYPE_BF16: return launch_t<TBF16, NS>(a, mode, stream);
    case QUANT_TYPE_F32: return launch_t<TF32, NS>(a, mode, stream);
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
    case QUANT_TYPE_Q4_1: *ee = 32, *eb = 20; return true;
    case QUANT_TYPE_Q5_0: *ee = 32, *eb = 22; return true;
    case QUANT_TYPE_Q5_1: *ee = 32, *eb = 24; return true;
    case QUANT_TYPE_IQ4_NL: *ee = 32, *eb = 18; return true;
    case QUANT_TYPE_IQ4_XS: *ee = 256, *eb = 136; return true;
    case QUANT_TYPE_Q2_K: *ee = 256, *eb = 84; return true;
    case QUANT_TYPE_Q3_K: *ee = 256, *eb = 110; return true;
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
    if (n > kMaxN) {
        log_error("%s: rows of %llu elements are longer than %llu", what, (unsigned long long)n,
                  (unsigned long long)kMaxN);
        return -EINVAL;
    }
    if (n % ee || row_bytes < n / ee * eb) {
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

/* The arguments of a plain product (one job; x and y set per launch). */
MvArgs plain_args(const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n, size_t ldx,
                  size_t ldy)
{
    MvArgs a = {};
    a.w = static_cast<const uint8_t *>(d_w);
    a.row_bytes = row_bytes;
    a.n_rows = n_rows;
    a.n = n;
    a.ldx = ldx;
    a.x_div = 1;
    a.ldy = ldy;
    a.n_jobs = 1;
    return a;
}

bool x_vec4(const float *x, size_t ldx)
{
    return (reinterpret_cast<uintptr_t>(x) & 15u) == 0 && ldx % 4 == 0;
}

/* Whether the int8 decode kernels (mvq.cu) beat the f32 ones for rows of n:
 * each of their blocks rounds the whole activation row first, which pays
 * for rows up to 2048 elements or for many rows (measured on an H200:
 * 12352 x 2048 Q4_0 9.5 us against 10.5, the 151936-row head 49 against 71,
 * but 2048 x 4096 9.2 against 5.3). LAMINA_CUDA_MVQ=0 turns them off. */
bool mvq_pays(uint64_t n, uint64_t n_rows)
{
    static int enabled = -1;
    if (enabled < 0) {
        const char *env = getenv("LAMINA_CUDA_MVQ");
        enabled = !(env && env[0] == '0');
    }
    return enabled && (n <= 2048 || n_rows >= 8 * n);
}

} /* namespace */

extern "C" bool cuda_mvq_pays(uint64_t n, uint64_t n_rows)
{
    return mvq_pays(n, n_rows);
}

extern "C" bool cuda_matvec_supports(uint32_t type)
{
    uint32_t ee, eb;
    return block_shape(type, &ee, &eb);
}

extern "C" bool cuda_matvec_norm_ok(uint32_t type, uint64_t n_rows, uint64_t n)
{
    return mvq_pays(n, n_rows) && cuda_mvq_norm_ok(type, n_rows, n);
}

extern "C" int cuda_matvec_norm(uint32_t type, const void *d_w, size_t row_bytes,
                                uint64_t n_rows, uint64_t n, const float *d_h,
                                const float *d_norm_w, float eps, float *d_y, cudaStream_t stream)
{
    if (!cuda_matvec_norm_ok(type, n_rows, n))
        return -ENOTSUP;
    const char *what = "cuda matvec_norm";
    int rc = check_weights(what, type, reinterpret_cast<uintptr_t>(d_w), row_bytes, n);
    if (rc)
        return rc;
    if (!d_w || !d_h || !d_y ||
        (reinterpret_cast<uintptr_t>(d_h) | reinterpret_cast<uintptr_t>(d_y)) & 3) {
        log_error("%s: bad buffers (w %p h %p y %p)", what, d_w, static_cast<const void *>(d_h),
                  static_cast<void *>(d_y));
        return -EINVAL;
    }
    return cuda_mvq_norm(type, d_w, row_bytes, n_rows, n, d_h, d_norm_w, eps, d_y, stream);
}

extern "C" int cuda_matvec(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                           uint64_t n, const float *d_x, float *d_y, cudaStream_t stream)
{
    return cuda_matmul(type, d_w, row_bytes, n_rows, n, d_x, n, 1, d_y, n_rows, stream);
}

extern "C" bool cuda_tail_ok(const struct cuda_tail *t, uint64_t n_out)
{
    bool ok = t && t->counter;
    if (ok) {
        switch (t->kind) {
        case CUDA_TAIL_ADD_NORM:
            ok = t->h && t->out && t->n == n_out && t->n > 0;
            break;
        case CUDA_TAIL_TOPK:
            ok = t->ids && t->w && n_out > 0 && n_out <= ROUTER_MAX_E && t->k > 0 &&
                 t->k <= ROUTER_MAX_K && t->k <= n_out;
            break;
        case CUDA_TAIL_COMBINE:
            ok = t->h && t->w && t->k > 0 && t->k <= 16 && t->n == n_out && t->n > 0 &&
                 (!t->norm_w || t->out) && (!(t->so && t->shexp_gate) || t->f);
            break;
        case CUDA_TAIL_COMBINE_COLS:
            ok = t->h && t->w && t->k > 0 && t->k <= 16 && t->n == n_out && t->n > 0 &&
                 !t->norm_w && (!(t->so && t->shexp_gate) || t->f) &&
                 cuda_norm_wide_threads(t->n) <= 1024;
            break;
        default: ok = false; break;
        }
    }
    if (!ok)
        log_debug("cuda tail: kind %d does not take %llu outputs", t ? static_cast<int>(t->kind) : -1,
                  static_cast<unsigned long long>(n_out));
    return ok;
}

extern "C" bool cuda_tail_plain_ok(const struct cuda_tail *t, uint64_t n_out, const char *what)
{
    if (!t || t->kind == CUDA_TAIL_NONE)
        return true;
    if (t->kind != CUDA_TAIL_COMBINE && t->kind != CUDA_TAIL_COMBINE_COLS &&
        cuda_tail_ok(t, n_out))
        return true;
    log_error("%s: a tail of kind %d does not follow a product of %llu rows", what,
              static_cast<int>(t->kind), static_cast<unsigned long long>(n_out));
    return false;
}

extern "C" int cuda_matvec_tail(uint32_t type, const void *d_w, size_t row_bytes,
                                uint64_t n_rows, uint64_t n, const float *d_x, float *d_y,
                                const struct cuda_tail *t, cudaStream_t stream)
{
    if (!t || t->kind == CUDA_TAIL_NONE)
        return cuda_matvec(type, d_w, row_bytes, n_rows, n, d_x, d_y, stream);
    const char *what = "cuda matvec_tail";
    if (!cuda_tail_plain_ok(t, n_rows, what))
        return -EINVAL;
    int rc = check_weights(what, type, reinterpret_cast<uintptr_t>(d_w), row_bytes, n);
    if (rc)
        return rc;
    if (!d_w || !d_x || !d_y ||
        (reinterpret_cast<uintptr_t>(d_x) | reinterpret_cast<uintptr_t>(d_y)) & 3) {
        log_error("%s: bad buffers (w %p x %p y %p)", what, d_w, static_cast<const void *>(d_x),
                  static_cast<void *>(d_y));
        return -EINVAL;
    }
    if (mvq_pays(n, n_rows)) {
        rc = cuda_mvq_tail(type, d_w, row_bytes, n_rows, n, d_x, d_y, t, stream);
        if (rc != -ENOTSUP)
            return rc;
    }
    MvArgs a = plain_args(d_w, row_bytes, n_rows, n, n, n_rows);
    a.x = d_x;
    a.y = d_y;
    a.x_vec4 = x_vec4(d_x, 0);
    a.tail = tail_args(t, d_y, n_rows);
    return launch<1>(type, a, 1, stream);
}

extern "C" bool cuda_matvec_norm_in_ok(uint32_t type, uint64_t n_rows, uint64_t n,
                                       size_t row_bytes)
{
    const uint32_t w = cuda_norm_threads(static_cast<uint32_t>(n));
    return type == QUANT_TYPE_F32 && n > 0 && n <= kXsMax && n % 32 == 0 && n_rows > 0 &&
           row_bytes % 16 == 0 && row_bytes >= n * sizeof(float) && w <= kTailThreads &&
           w % 32 == 0 && (n + w - 1) / w <= static_cast<uint32_t>(kXsCols);
}

extern "C" int cuda_matvec_tail_norm_in(uint32_t type, const void *d_w, size_t row_bytes,
                                        uint64_t n_rows, uint64_t n,
                                        const struct cuda_norm_in *nin, float *d_xout,
                                        int8_t *d_xq, float *d_y, const struct cuda_tail *t,
                                        cudaStream_t stream)
{
    const char *what = "cuda matvec_tail_norm_in";
    if (!cuda_matvec_norm_in_ok(type, n_rows, n, row_bytes) ||
        reinterpret_cast<uintptr_t>(d_w) % 16)
        return -ENOTSUP;
    if (!cuda_tail_plain_ok(t, n_rows, what))
        return -EINVAL;
    if (!nin || !nin->h || !nin->add || !d_y ||
        (reinterpret_cast<uintptr_t>(nin->h) | reinterpret_cast<uintptr_t>(nin->add) |
         reinterpret_cast<uintptr_t>(d_y) | reinterpret_cast<uintptr_t>(d_xout)) & 3 ||
        reinterpret_cast<uintptr_t>(d_xq) % 16 || !nin->gate != !nin->gs ||
        (reinterpret_cast<uintptr_t>(nin->gate) | reinterpret_cast<uintptr_t>(nin->gs)) & 3) {
        log_error("%s: bad buffers (h %p add %p y %p out %p gate %p gs %p)", what,
                  nin ? static_cast<const void *>(nin->h) : nullptr,
                  nin ? static_cast<const void *>(nin->add) : nullptr, static_cast<void *>(d_y),
                  static_cast<void *>(d_xout), nin ? static_cast<const void *>(nin->gate) : nullptr,
                  nin ? static_cast<void *>(nin->gs) : nullptr);
        return -EINVAL;
    }
    MvArgs a = plain_args(d_w, row_bytes, n_rows, n, n, n_rows);
    a.y = d_y;
    a.x_vec4 = true; /* shared memory, 16-byte aligned */
    a.tail = tail_args(t, d_y, n_rows);
    a.nin_h = nin->h;
    a.nin_add = nin->add;
    a.nin_w = nin->w;
    a.nin_eps = nin->eps;
    a.nin_width = cuda_norm_threads(static_cast<uint32_t>(n));
    a.nin_out = d_xout;
    a.nin_xq = d_xq;
    a.nin_gate = nin->gate;
    a.nin_gs = nin->gs;
    a.nin_gate_width = cuda_norm_wide_threads(static_cast<uint32_t>(n));
    a.probe = nin->probe;
    return launch<1>(type, a, 1, stream);
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
    if (type == QUANT_TYPE_F32 && S >= 16) /* a tiled product reads the weights once per 64 rows */
        return cuda_sgemm_nt(static_cast<const float *>(d_w), row_bytes, n_rows, n, d_X, ldx, S,
                             d_Y, ldy, stream);
    if (S == 1 && mvq_pays(n, n_rows)) { /* int8 activations and dp4a where the type allows */
        rc = cuda_mvq(type, d_w, row_bytes, n_rows, n, d_X, d_Y, stream);
        if (rc != -ENOTSUP)
            return rc;
        rc = 0;
    }
    MvArgs a = plain_args(d_w, row_bytes, n_rows, n, ldx, ldy);
    a.x_vec4 = x_vec4(d_X, S > 1 ? ldx : 0);
    for (uint32_t s = 0; s < S && rc == 0;) {
        const uint32_t left = S - s, ns = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        a.x = d_X + static_cast<size_t>(s) * ldx;
        a.y = d_Y + static_cast<size_t>(s) * ldy;
        switch (ns) {
        case 8: rc = launch<8>(type, a, 1, stream); break;
        case 4: rc = launch<4>(type, a, 1, stream); break;
        case 2: rc = launch<2>(type, a, 1, stream); break;
        default: rc = launch<1>(type, a, 1, stream); break;
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
    if (mvq_pays(n, n_rows)) {
        rc = cuda_mvq_experts(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs, d_X, ldx, x_div,
                              d_Y, ldy, stream);
        if (rc != -ENOTSUP)
            return rc;
        rc = 0;
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
    return launch<1>(type, a, 2, stream);
}
