/*
 * down_combine: the decode MoE's down product and combine in one launch,
 * cut by output rows instead of by pairs. Block x owns rows [x T, x T + T)
 * of the hidden vector and computes them for every pair of the token (the
 * k routed experts and the shared expert as pair k), then adds the pairs'
 * rows into h in the combine's order. No block waits for another: the
 * combine needs no launch, no counter and no fence (the COMBINE_COLS tail's
 * cost), and the next layer's input product normalises h itself
 * (cuda_matvec_norm), as with COMBINE_COLS.
 *
 * The same bits as cuda_mvq_experts_glu_tail (no tail) followed by
 * cuda_moe_combine: each pair's activation row is silu(gate) * up rounded
 * to int8 per block of 32 (mvq.cuh's round_levels, the mvq kernel's
 * expressions), each row's dot is taken by a group of G lanes
 * (mvq::lanes_per_row) whose lane sub adds blocks sub, sub + G, ... in
 * ascending order and whose lanes are reduced by the same xor tree; the
 * combine adds the routed rows in order, then the gated shared row, then
 * the residual, rounding each product and sum (__fmul_rn / __fadd_rn); the
 * shared-expert gate is tail_gate's dot, the combine kernel's tree.
 *
 * Ownership: blocks of 256 threads, two an SM's worth of rows each (T) and
 * registers for three an SM (so that they fit beside the gate/up product's
 * blocks and start early); a block's T x P (row, pair) "virtual rows" are
 * dealt to its 256 / G groups, VR each at most, every lane holding all of
 * its virtual rows' weight blocks in registers. Every block needs all P
 * activation rows rounded: on sm_90 the blocks run in clusters of 8 that
 * split the rounding (each takes every 8th activation block and writes its
 * levels into the shared memory of all 8; a cluster barrier before the
 * dots), elsewhere each block rounds them all. Everything the kernel
 * reads except the gate/up output was written two or more launches before
 * (the caller's promise, kernels/cuda/pdl.cuh): the ids, the experts'
 * weights, the router's weights, the gate's input and h are read before the
 * PDL wait; after it only the P activation rows (2F floats each, through L2)
 * are rounded into shared memory.
 *
 * On an H200 (docs/perf.md, ninth session) it costs what the two launches
 * it replaces cost (a graph increment of 10.1 us a layer against 4.7 + 5.5):
 * a cluster cannot start while the gate/up product's blocks fill its SMs,
 * so its weights are not read ahead as the down product's are, and clusters
 * of 4 or 2 (more rounding a block) were slower still; the norm moved into
 * the next input product adds 2.1 us there. So the backend takes it only
 * when asked (LAMINA_CUDA_TAIL=...,rows). Activations rounded once, by the
 * gate/up product, would remove the clusters.
 */
#include <errno.h>

#include <cooperative_groups.h>

#include "kernels/cuda/mvq.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/tail.cuh"

extern "C" {
#include "common/log.h"
#include "model/quant.h"
}

namespace {

using mvq::Blk;
using mvq::block_dot;
using mvq::load_block;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMinBlocks = 3;     /* per SM: the registers of the gate/up product's blocks */
constexpr uint32_t kMaxK = 16;    /* routed pairs (the combine's bound) */
constexpr uint32_t kMaxP = kMaxK + 1;
/* activation blocks a warp rounds per round of loads: alone, or an eighth
 * of them in a cluster */
template <bool CL>
constexpr int kXB = CL ? 4 : 12;

struct DcArgs {
    const void *const *addr; /* experts' matrices by id (n_table entries) */
    const int32_t *ids;      /* P pair ids */
    uint32_t n_table;
    size_t row_bytes;
    uint32_t n, F, nb;       /* output rows (hidden), row length, blocks per row */
    uint32_t P, k, T;        /* pairs, routed pairs (P = k or k + 1), rows per block */
    const float *X;          /* P rows of [gate F | up F] */
    size_t ldx;
    float *Y;                /* optional: the pairs' output rows (ldy n) */
    TailArgs g;              /* the combine's h, w, so (pair k), shexp_gate, f, width */
};

/* PL: a row's blocks per lane (nb <= PL G); VR: virtual rows per group;
 * CL: the launch is in thread block clusters (sm_90), whose blocks share the
 * rounding of the activations (each rounds every C-th activation block and
 * writes it into every block of the cluster). */
template <int TYPE, int G, int PL, int VR, bool CL>
__global__ void __launch_bounds__(kThreads, kMinBlocks) down_combine_kernel(const DcArgs a)
{
    extern __shared__ int4 s_dyn[];
    const uint32_t P = a.P, nb = a.nb, T = a.T;
    int8_t *s_q = reinterpret_cast<int8_t *>(s_dyn);              /* P x F levels */
    float *s_d = reinterpret_cast<float *>(s_q + P * nb * 32);    /* P x nb scales */
    float *s_s = s_d + P * nb;                                    /* P x nb scale x sums */
    float *s_y = s_s + P * nb;                                    /* P x T outputs */
    __shared__ float s_w[kMaxK];
    __shared__ float s_tmp[32];
    __shared__ const uint8_t *s_addr[kMaxP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t grp = threadIdx.x / G, sub = threadIdx.x % G, groups = kThreads / G;
    const uint32_t j0 = blockIdx.x * T;
    uint32_t rank = 0, C = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CL) { /* every block of the cluster started before the first remote write */
        rank = cooperative_groups::this_cluster().block_rank();
        C = cooperative_groups::this_cluster().num_blocks();
        cooperative_groups::this_cluster().sync();
    }
#endif

    /* before the wait: the pairs' matrices (one round trip for all), then
     * the weights of every virtual row in registers */
    if (threadIdx.x < P) {
        const int32_t e = __ldcg(a.ids + threadIdx.x);
        s_addr[threadIdx.x] = e >= 0 && static_cast<uint32_t>(e) < a.n_table
                                  ? static_cast<const uint8_t *>(a.addr[e])
                                  : nullptr;
    } else if (threadIdx.x >= 32 && threadIdx.x < 32 + a.k) {
        s_w[threadIdx.x - 32] = __ldcg(a.g.t.w + threadIdx.x - 32);
    }
    float hv = 0.0f;
    if (threadIdx.x >= 64 && threadIdx.x < 64 + T && j0 + threadIdx.x - 64 < a.n)
        hv = __ldcg(a.g.t.h + j0 + threadIdx.x - 64);
    __syncthreads();
    uint32_t v[VR][PL][9], sh[VR][PL];
    uint32_t vp[VR], vt[VR];
    bool vin[VR];
#pragma unroll
    for (int i = 0; i < VR; i++) {
        const uint32_t vr = grp + i * groups, p = vr / T, t = vr % T;
        vp[i] = p;
        vt[i] = t;
        const uint8_t *w = p < P && j0 + t < a.n ? s_addr[p] : nullptr;
        vin[i] = w != nullptr;
#pragma unroll
        for (int u = 0; u < PL; u++) {
            const uint32_t b = sub + u * G;
            if (w && b < nb)
                load_block<TYPE>(w + static_cast<size_t>(j0 + t) * a.row_bytes, b, v[i][u],
                                 &sh[i][u]);
        }
    }
    const float gs = tail_gate<kThreads>(a.g, s_tmp);

    pdl_wait();
    pdl_trigger();

    /* the pairs' activation rows, silu(gate) * up rounded per block of 32:
     * block `rank` of the cluster takes blocks rank, rank + C, ... of the
     * P x nb, its warp w every kWarps-th of those, kXB at a time */
    const uint32_t total = P * nb, step = C * kWarps;
    constexpr int XB = kXB<CL>;
    for (uint32_t c0 = rank + warp * C; c0 < total; c0 += XB * step) {
        float xv[XB];
#pragma unroll
        for (int i = 0; i < XB; i++) {
            const uint32_t c = c0 + i * step;
            const uint32_t p = c / nb, b = c % nb;
            const float *x = a.X + static_cast<size_t>(p) * a.ldx + b * 32 + lane;
            const float gt = c < total ? x[0] : 0.0f, up = c < total ? x[a.F] : 0.0f;
            xv[i] = c < total ? __fmul_rn(gt / (1.0f + expf(-gt)), up) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < XB; i++) {
            const uint32_t c = c0 + i * step;
            int q;
            float d, sc;
            mvq::round_levels(xv[i], q, d, sc);
            if (c >= total)
                continue;
            for (uint32_t r = 0; r < C; r++) {
                int8_t *dq = s_q;
                float *dd = s_d, *ds = s_s;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                if constexpr (CL) {
                    dq = cooperative_groups::this_cluster().map_shared_rank(s_q, r);
                    dd = cooperative_groups::this_cluster().map_shared_rank(s_d, r);
                    ds = cooperative_groups::this_cluster().map_shared_rank(s_s, r);
                }
#endif
                dq[c * 32 + lane] = static_cast<int8_t>(q);
                if (lane == 0) {
                    dd[c] = d;
                    ds[c] = sc;
                }
            }
        }
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CL)
        cooperative_groups::this_cluster().sync();
    else
        __syncthreads();
#else
    __syncthreads();
#endif

    /* the dots, each group's rows in mvq_kernel's order and tree */
#pragma unroll
    for (int i = 0; i < VR; i++) {
        float acc = 0.0f;
        if (vin[i]) {
#pragma unroll
            for (int u = 0; u < PL; u++) {
                const uint32_t b = sub + u * G;
                if (b >= nb)
                    break;
                const uint32_t c = vp[i] * nb + b;
                const int4 *xq = reinterpret_cast<const int4 *>(s_q + c * 32);
                acc += block_dot<TYPE>(v[i][u], sh[i][u], xq[0], xq[1], s_d[c], s_s[c]);
            }
        }
#pragma unroll
        for (int o = G / 2; o > 0; o >>= 1)
            acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
        const bool real = vp[i] < P && j0 + vt[i] < a.n;
        if (sub == 0 && real)
            s_y[vp[i] * T + vt[i]] = acc;
    }
    __syncthreads();

    if (a.Y)
        for (uint32_t c = threadIdx.x; c < P * T; c += kThreads) {
            const uint32_t p = c / T, t = c % T;
            if (j0 + t < a.n)
                a.Y[static_cast<size_t>(p) * a.n + j0 + t] = s_y[c];
        }
    /* the combine of row j0 + t (combine.cu's expressions and order) */
    if (threadIdx.x >= 64 && threadIdx.x < 64 + T && j0 + threadIdx.x - 64 < a.n) {
        const uint32_t t = threadIdx.x - 64;
        float out = 0.0f;
        for (uint32_t i = 0; i < a.k; i++)
            out = __fadd_rn(out, __fmul_rn(s_w[i], s_y[i * T + t]));
        if (a.g.t.so)
            out = __fadd_rn(out, __fmul_rn(gs, s_y[a.k * T + t]));
        a.g.t.h[j0 + t] = __fadd_rn(hv, out);
    }
}

constexpr uint32_t kCluster = 8; /* blocks sharing the rounding (sm_90 and later) */

/* The streaming multiprocessors of the current device (132 if the query
 * fails) and whether it launches clusters (compute capability 9.0 or later). */
uint32_t sm_count(bool *clusters)
{
    const int n = cuda_caps_sms();
    *clusters = n > 0 && device_sm90();
    return n > 0 ? static_cast<uint32_t>(n) : 132u;
}

template <int TYPE, int G, int PL, int VR>
int go(DcArgs a, cudaStream_t stream)
{
    constexpr uint32_t groups = kThreads / G;
    /* rows a block can hold, and the rows that give each SM two blocks */
    bool clusters;
    const uint32_t fit = VR * groups / a.P, sms = sm_count(&clusters);
    const uint32_t spread = (a.n + 2 * sms - 1) / (2 * sms);
    a.T = fit < spread ? fit : spread;
    if (a.T == 0 || a.T > kThreads - 64)
        return -ENOTSUP;
    const size_t smem = static_cast<size_t>(a.P) * a.nb * (32 + 2 * sizeof(float)) +
                        static_cast<size_t>(a.P) * a.T * sizeof(float);
    if (!cuda_caps_fits_default(clusters ? (const void *)down_combine_kernel<TYPE, G, PL, VR, true>
                                          : (const void *)down_combine_kernel<TYPE, G, PL, VR, false>,
                                smem))
        return -ENOTSUP;
    const uint32_t tiles = (a.n + a.T - 1) / a.T;
    if (clusters) /* the grid a whole number of clusters (blocks past n only round) */
        pdl_launch_cluster(down_combine_kernel<TYPE, G, PL, VR, true>,
                           (tiles + kCluster - 1) / kCluster * kCluster, kThreads, kCluster, smem,
                           stream, a);
    else
        pdl_launch(down_combine_kernel<TYPE, G, PL, VR, false>, tiles, kThreads, smem, stream,
                   a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda_moe_down_combine: kernel launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

/* PL from the blocks per lane; VR so that a lane holds at most 6 (Q4_0: 30
 * registers) or 4 (Q8_0: 36) weight blocks. */
template <int TYPE, int G>
int pick_pl(DcArgs a, cudaStream_t stream)
{
    constexpr int budget = TYPE == QUANT_TYPE_Q4_0 ? 6 : 4;
    switch ((a.nb + G - 1) / G) {
    case 1: return go<TYPE, G, 1, budget>(a, stream);
    case 2: return go<TYPE, G, 2, budget / 2>(a, stream);
    case 3: return go<TYPE, G, 3, budget / 3>(a, stream);
    case 4: return go<TYPE, G, 4, budget / 4>(a, stream);
    default: return -ENOTSUP;
    }
}

template <int TYPE>
int pick(const DcArgs &a, cudaStream_t stream)
{
    switch (mvq::lanes_per_row(a.nb)) {
    case 32: return pick_pl<TYPE, 32>(a, stream);
    case 16: return pick_pl<TYPE, 16>(a, stream);
    default: return pick_pl<TYPE, 8>(a, stream);
    }
}

} /* namespace */

extern "C" int cuda_moe_down_combine(uint32_t type, const void *const *d_addr, uint32_t n_table,
                                     size_t row_bytes, uint64_t n, uint64_t F,
                                     const int32_t *d_ids, uint32_t n_pairs, uint32_t k,
                                     const float *d_X, size_t ldx, const float *d_w,
                                     const float *d_shexp_gate, const float *d_f, float *d_h,
                                     float *d_Y, cudaStream_t stream)
{
    if (!d_addr || !d_ids || !d_X || !d_w || !d_h || n == 0 || F == 0 || k == 0 ||
        (n_pairs != k && n_pairs != k + 1) || (d_shexp_gate && !d_f) || ldx < 2 * F ||
        n > UINT32_MAX || n_table == 0) {
        log_error("cuda_moe_down_combine: bad arguments (addr %p, ids %p, X %p, w %p, h %p, "
                  "n %llu, F %llu, pairs %u, k %u, gate %p, f %p, ldx %zu, table %u)",
                  (const void *)d_addr, (const void *)d_ids, (const void *)d_X,
                  (const void *)d_w, (void *)d_h, (unsigned long long)n, (unsigned long long)F,
                  n_pairs, k, (const void *)d_shexp_gate, (const void *)d_f, ldx, n_table);
        return -EINVAL;
    }
    if ((type != QUANT_TYPE_Q4_0 && type != QUANT_TYPE_Q8_0) || F % 32 || F > 16384 ||
        k > kMaxK || (reinterpret_cast<uintptr_t>(d_X) & 3) ||
        cuda_norm_wide_threads(static_cast<uint32_t>(n)) > 1024)
        return -ENOTSUP;
    DcArgs a = {};
    a.addr = d_addr;
    a.ids = d_ids;
    a.n_table = n_table;
    a.row_bytes = row_bytes;
    a.n = static_cast<uint32_t>(n);
    a.F = static_cast<uint32_t>(F);
    a.nb = a.F / 32;
    a.P = n_pairs;
    a.k = k;
    a.X = d_X;
    a.ldx = ldx;
    a.Y = d_Y;
    struct cuda_tail t = {};
    t.kind = CUDA_TAIL_COMBINE_COLS; /* for tail_args' width: the combine's */
    t.n = a.n;
    t.h = d_h;
    t.k = k;
    t.w = const_cast<float *>(d_w);
    t.so = n_pairs == k + 1 ? d_X : nullptr; /* only tested against NULL: pair k is the row */
    t.shexp_gate = d_shexp_gate;
    t.f = d_f;
    a.g = tail_args(&t, nullptr, a.n);
    return type == QUANT_TYPE_Q4_0 ? pick<QUANT_TYPE_Q4_0>(a, stream)
                                   : pick<QUANT_TYPE_Q8_0>(a, stream);
}
