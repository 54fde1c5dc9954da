/*
 * mvq: the decode product (one activation row) for Q4_0, Q8_0, Q4_K, Q5_K
 * and Q6_K weights with int8 activations and dp4a, the scheme of the CPU twin's integer path
 * (kernels/cpu/matvec.c: activations rounded per block of 32 to
 * q = round-half-even(x * 127/amax) with the f32 scale d = amax/127). Used by
 * cuda_matvec and cuda_matvec_experts (matvec.cu) for one activation row.
 *
 * Maths per weight block b of a row (32 elements) and the activation block
 * b (scale dx, levels q, their sum sq):
 *   Q8_0: dw * dx * sum_j w_j q_j
 *   Q4_0: dw * (dx * sum_j n_j q_j - 8 * dx * sq)   (w_j = n_j - 8)
 *   Q4_K: a lane's unit is 64 elements, sub-blocks j0, j1 of a super-block
 *         (w = d sc_j n - dmin mn_j, n in 0..15) with activation blocks
 *         2b, 2b + 1: d (sc0 dx0 isum0 + sc1 dx1 isum1) - dmin (mn0 sx0 + mn1 sx1)
 *         (sx = dx sq); Q5_K the same with levels n in 0..31 (a high bit a level)
 *   Q6_K: a unit is two blocks of 32 (mvq.cuh's unit_block), each two
 *         halves of 16 with an int8 scale (w = d sc (n - 32), n in 0..63):
 *         d (dxA (scA0 isumA0 + scA1 isumA1) + dxB (scB0 isumB0 + scB1 isumB1))
 *         the levels centred before the dot (signed bytes)
 *   (mvq.cuh's unit_dot; where the text below says block, read unit)
 * the integer sums exact in int32, the rest in f32, blocks added in a fixed
 * order per lane and lanes reduced in a fixed tree: results do not depend on
 * timing.
 *
 * Ownership: a block of 256 threads first rounds its activation row into
 * shared memory (warp w takes activation blocks w, w + 8, ...: lane j holds
 * element j, amax and the level sum by shuffles; four blocks' loads in
 * flight). The block's rows are cut among row groups of G lanes (G = 32,
 * 16 or 8 from the row length); a group owns R consecutive rows and its
 * lanes take weight blocks sub, sub + G, ... U at a time (U x R = 8 blocks
 * of loads in flight before any arithmetic; a row of up to 8G blocks is
 * read in one pass). A weight block starts 2-byte aligned; each lane reads the
 * 4-byte words around it (5 for Q4_0, 9 for Q8_0, never crossing a word
 * that holds none of its bytes) and shifts the bytes into place: from global
 * memory, or (ST, sm_90, the decode gate/up product: tma_wanted) from a copy
 * of the block's tile of rows that one thread asked for by one bulk copy. The
 * weight loads of the first pass are issued before the activations are
 * rounded, so the two latencies overlap. The rounding is most of a
 * block's work after its PDL wait, so it leaves that path where it can:
 * activations written two or more launches back (x_early: the decode
 * gate/up product's) are rounded before the wait, and activations a
 * producer already rounded (xq, cuda_mvq_xq: the combine writes the next
 * layer's input so) are copied into shared memory as they are (an H200,
 * 80b-a3b decode: gate/up 13.3 -> 8.9 us, DeltaNet input 8.5 -> 4.8 us a
 * layer; docs/perf.md).
 *
 * Jobs (grid y): one for a plain product; for experts one per (token, slot)
 * pair: the expert id and its weight address come from device memory, a
 * NULL address (or negative id) skips the pair. Activation rows of up to
 * kMaxN elements (shared memory); longer rows return -ENOTSUP so the caller
 * uses the f32 kernels.
 */
#include "kernels/cuda/mvq.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cp_async.cuh"
#include "kernels/cuda/mvq.cuh"
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
static_assert(kThreads == kTailThreads, "cuda tails assume blocks of kTailThreads");
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kMaxN = 16384; /* activation elements held in shared memory */
/* weight bytes a block asks for in L2 before its wait: 32 KiB decodes 1.6 % faster than 64 on an
 * H200 with pdl.cuh's 50 % shared memory split (docs/perf.md, twenty-fifth session) */
constexpr size_t kPrefetch = 32 * 1024;

struct MvqArgs {
    const uint8_t *w;             /* plain product: the matrix */
    uint32_t pf_bytes_row;        /* plain product: bytes a block asks for in L2 before its
                                   * wait (kPrefetch; LAMINA_CUDA_ROW_PF_KB) */
    const void *const *addr;      /* experts: address per expert id */
    const int32_t *ids;           /* experts: id per pair, or NULL */
    size_t row_bytes;
    uint32_t n_rows, n, nb;       /* rows, row length, blocks per row */
    const float *x;
    size_t ldx;
    uint32_t x_div;
    bool glu;                     /* x rows are [gate n | up n]: x = silu(gate) * up */
    float *y;
    size_t ldy;
    TailArgs tail;                /* run by the launch's last block (tail.cuh) */
    const void *const *pf_addr;   /* experts: the next product's table (L2 prefetch), or NULL */
    size_t pf_bytes;              /* bytes of one of its experts */
    bool pf_after;                /* experts: that prefetch issued after the block's own rows
                                   * (their weights arrived), not before them, so that the
                                   * product's own stream comes first in DRAM */
    uint32_t n_table;             /* experts: entries of addr and pf_addr to ask for in L2
                                   * before the wait (0: none) */
    bool ids_poll;                /* experts (not early): before the wait, thread 0 polls
                                   * the pair's id until it is no longer kIdsMark (the
                                   * router's top-k tail marks them, cuda_tail.mark_ids),
                                   * a bounded number of rounds, and the block asks for
                                   * that expert's weights; after the wait the id is read
                                   * again and the loads issued again where it differs */
    bool early;                   /* experts: ids (and a COMBINE_COLS tail's f) written two
                                   * or more launches back: read before the wait (entries
                                   * of addr: n_table) */
    bool x_early;                 /* x written two or more launches back: rounded into
                                   * shared memory before the wait (through L2) */
    const int8_t *xq;             /* x already rounded (mvq::xq_row_bytes layout, written
                                   * by the launch before), copied into shared memory
                                   * after the wait; x is not read */
    bool beside;                  /* plain, no tail: xq written two or more launches back
                                   * and y untouched by the launch before, so the block
                                   * computes and stores before its wait, which it keeps
                                   * for its end (cuda_mvq_xq_beside) */
    size_t xq_ld;                 /* bytes from one rounded row to the next (row job /
                                   * x_div); 0: every job reads the first */
    int8_t *gq;                   /* gate/up (GQ, clusters of 2): silu(gate) * up rounded
                                   * for the down product, row job at gq + job gq_ld */
    size_t gq_ld;
    uint32_t gq_half;             /* GQ: tiles of the gate half (block 2i takes gate tile
                                   * i, block 2i + 1 its up tile gq_half + i) */
    const float *nin_w;           /* norm in (plain products): x is a residual row h, */
    float nin_eps;                /* the product reads rmsnorm(h) * nin_w (NULL: 1) in */
    uint32_t nin_width;           /* cuda_rmsnorm_wide's tree of this width (0: off) */
    unsigned long long *probe;    /* cuda_mvq_probe_next's marks, or NULL */
    /* RT (cuda_mvq_xq_router; plain products of one tile a block, clusters of kRtCluster):
     * the layer's router in the mixer's output product. Each block forms its rows of
     * x = h + y, sums rt_w's columns of those rows times g x for every expert, the cluster
     * adds its blocks' sums (distributed shared memory) into rt_part, and the launch's
     * last block forms the row rmsnorm(x) * g and its rounding (rt_xa, rt_xq), the shared
     * expert's gate (rt_gs) and the logits (the clusters' sums times the norm's scale),
     * then the top-k (tail: its TOPK tail's ids and weights) */
    const float *rt_w;            /* router rows (F32), rt_ld floats apart, n_rows long */
    size_t rt_ld;
    uint32_t rt_e;                /* experts (rows of rt_w) */
    const float *rt_h, *rt_g;     /* the residual row, the norm's weights (NULL: 1) */
    float rt_eps;
    uint32_t rt_width;            /* cuda_norm_threads(n_rows) */
    const float *rt_gate;         /* the shared expert's gate (n_rows), or NULL */
    float *rt_gs;
    uint32_t rt_gate_width;       /* cuda_norm_wide_threads(n_rows) */
    float *rt_xa, *rt_logits, *rt_part;
    int8_t *rt_xq;
    uint32_t rt_skip;             /* LAMINA_CUDA_RT_SKIP (timing only, wrong outputs): 1 the
                                   * columns' copies, 2 the cluster's adds, 4 the last block,
                                   * 8 no clusters (go_rt); in the last block 16 the
                                   * pick, 32 the row and gate, 64 the partial sums' loads */
    const float *rt_wt;           /* rt_w transposed (n_rows rows of rt_e floats, a row one
                                   * column of rt_w), or NULL: each block's columns then one
                                   * contiguous read */
};

/* Mark i of this block (cuda_mvq_probe_next), by thread 0, in a build with
 * LAMINA_MVQ_PROBE only: each call sits beside a barrier or a wait the
 * kernel has anyway, but compiled in, the marks cost the decode 1.6 % with
 * the probe off (an H200, docs/perf.md, twenty-sixth session). */
__device__ __forceinline__ void probe_mark(const MvqArgs &a, int i)
{
#ifdef LAMINA_MVQ_PROBE
    if (!a.probe || threadIdx.x)
        return;
    const uint32_t b = blockIdx.y * gridDim.x + blockIdx.x;
    if (b >= CUDA_PROBE_MVQ_BLOCKS)
        return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    a.probe[static_cast<size_t>(b) * CUDA_PROBE_SLOTS + i] = t;
#else
    (void)a;
    (void)i;
#endif
}

/* Asks for this block's tiles of rows (blockIdx.x, + gridDim.x, ...) in L2,
 * at most kPrefetch bytes; tiles are rows_per_tile consecutive rows. */
__device__ __forceinline__ void prefetch_rows(const MvqArgs &a, uint32_t rows_per_tile,
                                              uint32_t n_tiles)
{
    size_t left = a.pf_bytes_row;
    for (uint32_t t = blockIdx.x; t < n_tiles && left; t += gridDim.x) {
        const uint32_t r0 = t * rows_per_tile;
        const uint32_t n = a.n_rows - r0 < rows_per_tile ? a.n_rows - r0 : rows_per_tile;
        const size_t bytes = static_cast<size_t>(n) * a.row_bytes;
        pdl_prefetch_l2(a.w + static_cast<size_t>(r0) * a.row_bytes, bytes < left ? bytes : left);
        left -= bytes < left ? bytes : left;
    }
}

/* The next product reads expert e's other matrix (pf_addr): the pair's
 * blocks ask for a share of it each in L2, beside this product (pf_after:
 * once the block's own rows are done). */
__device__ __forceinline__ void prefetch_next(const MvqArgs &a, int32_t e)
{
    const uint8_t *p = static_cast<const uint8_t *>(a.pf_addr[e]);
    const size_t share = (a.pf_bytes + gridDim.x - 1) / gridDim.x;
    const size_t off = static_cast<size_t>(blockIdx.x) * share;
    if (p && off < a.pf_bytes)
        pdl_prefetch_l2(p + off, a.pf_bytes - off < share ? a.pf_bytes - off : share);
}

/* tma (sm_90): a block's tile of rows (rows_per_tile consecutive rows, one
 * run of bytes) comes into shared memory by one bulk copy that a single
 * thread issues (cp.async.bulk, completion counted in bytes on an mbarrier),
 * instead of every lane loading the five or nine 4-byte words around each of
 * its blocks from global memory (about five L1 requests per word of weight,
 * the words of neighbouring blocks overlapping). The lanes then read the same
 * words from shared memory: the same values, so the same bits. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

__device__ __forceinline__ void tma_bar_init(uint64_t *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
    (void)bar;
#endif
}

/* One thread: [src, src + bytes) into dst (16-byte aligned, bytes a
 * multiple of 16), completing the barrier's current phase. The generic
 * proxy's reads of dst before it (ordered by a barrier of the block) are
 * ordered before the copy's writes by the proxy fence. */
__device__ __forceinline__ void tma_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_u32(dst)),
        "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
#else
    (void)dst;
    (void)src;
    (void)bytes;
    (void)bar;
#endif
}

/* Waits until the barrier's phase of this parity has completed. */
__device__ __forceinline__ void tma_wait(uint64_t *bar, uint32_t parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
#else
    (void)bar;
    (void)parity;
#endif
}

/* ids_poll: the pair's id once it is no longer the router's mark (tail.cuh's
 * kIdsMark), or -1 after 200 rounds (at most about 0.2 ms; then the block
 * reads it after its wait). A hint: the value read may be the launch
 * before's (no mark), which the read after the wait corrects. */
__device__ __forceinline__ int32_t poll_id(const int32_t *id)
{
    for (int round = 0; round < 200; round++) {
        int32_t v;
        asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(id) : "memory");
        if (v != kIdsMark)
            return v;
        __nanosleep(64);
    }
    return -1;
}

/* Cluster barrier halves (sm_90; all threads of the block): arrive (release:
 * this thread's writes before it, shared memory of the cluster included, are
 * seen after the matching wait) and wait (acquire). */
__device__ __forceinline__ void cluster_arrive(bool release)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (release)
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    else
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    (void)release;
#endif
}

__device__ __forceinline__ void cluster_wait(bool acquire)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (acquire)
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    else
        asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/* GQ: the tile's outputs, gate (rank 0) and up (rank 1), in rank 0's shared memory. */
__device__ __forceinline__ float *gq_slots()
{
    __shared__ float s_gq[2][32];
    return &s_gq[0][0];
}
#endif

/* GQ: output r (0..31) of this block's tile into rank 0's slots (after cluster_wait(false),
 * the partner's start seen). */
__device__ __forceinline__ void gq_put(float out, uint32_t r)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    const uint32_t rank = blockIdx.x & 1;
    cg::this_cluster().map_shared_rank(gq_slots(), 0)[rank * 32 + r] = out;
#else
    (void)out;
    (void)r;
#endif
}

/* GQ, every thread of both blocks: once the up block's outputs are in, the gate block's
 * first warp writes block b of the pair's down input, silu(gate) * up rounded (cuda_silu_mul's
 * expression, then mvq::round_levels: what the down product's glu rounding computes). */
__device__ __forceinline__ void gq_round(const MvqArgs &a, uint32_t job, uint32_t b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_arrive(true);
    cluster_wait(true);
    if ((blockIdx.x & 1) || threadIdx.x >= 32)
        return;
    const float *s = gq_slots();
    const float g = s[threadIdx.x], u = s[32 + threadIdx.x];
    const float xv = __fmul_rn(g / (1.0f + expf(-g)), u);
    int q;
    float d, sc;
    mvq::round_levels(xv, q, d, sc);
    int8_t *row = a.gq + static_cast<size_t>(job) * a.gq_ld;
    const uint32_t f = a.gq_half * 32; /* the down input's length */
    row[b * 32 + threadIdx.x] = static_cast<int8_t>(q);
    if (threadIdx.x == 0) {
        float *sc_row = reinterpret_cast<float *>(row + f);
        sc_row[b] = d;
        sc_row[f / 32 + b] = sc;
    }
#else
    (void)a;
    (void)job;
    (void)b;
#endif
}

/* ---- RT: the router in the output product ------------------------------------ */

constexpr int kRtCluster = 8;       /* blocks a cluster: their sums added in shared memory */
constexpr uint32_t kRtMaxE = 2 * kThreads; /* experts: two a thread */
constexpr uint32_t kRtMaxN = 2048;  /* the row: matvec.cu's norm-in bound (kXsMax) */
constexpr int kRtCols = 8;          /* a norm thread's columns (matvec.cu's kXsCols) */

/* The fewest rows of an RT launch's tiles (pick_rt: 16 or 32). */
constexpr int kRtMinRows = 16;

/* Shared memory an RT block of rpt-row tiles asks for past the row's levels (x_bytes): the
 * router's columns of its rows, rpt floats an expert, thread t's experts t and t + kThreads
 * (float4 j of slot m of thread t at float4 (m rpt / 4 + j) kThreads + t: a warp's reads are
 * consecutive), later the last block's row (rt_tail, 8 KiB at most). */
__host__ __device__ constexpr size_t rt_cols_bytes(uint32_t E, int rpt)
{
    return static_cast<size_t>(E > kThreads ? 2 : 1) * kThreads * rpt * sizeof(float);
}

static_assert(rt_cols_bytes(1, kRtMinRows) >= 2 * kRtMaxN * sizeof(float),
              "the last block's row and gate fit in its router columns' place");

/* What a block holds from before its wait (threads t < its rows): h and g of its row t. */
struct RtEarly {
    float h, g;
};

/* Every thread, before the wait: its experts' columns of the block's rows copied into
 * s_rw (cp.async, 16 bytes at a time: the rows and the tile's first row are multiples of 4
 * floats; columns past the rows and experts past E zero), h and g of its row. */
template <int RPT>
__device__ __forceinline__ void rt_early(const MvqArgs &a, uint32_t r0, float *s_rw, RtEarly &e)
{
    const uint32_t t = threadIdx.x;
    if (a.rt_wt) { /* rows r0 .. r0 + RPT - 1 of the transposed router, row j at s_rw + j es */
        const uint32_t es = a.rt_e > kThreads ? 2 * kThreads : kThreads, q4 = es / 4;
        for (uint32_t q = t; q < RPT * q4 && !(a.rt_skip & 1); q += kThreads) {
            const uint32_t j = q / q4, c = (q % q4) * 4;
            float4 *dst = reinterpret_cast<float4 *>(s_rw + static_cast<size_t>(j) * es + c);
            if (r0 + j < a.n_rows && c < a.rt_e)
                cp16(dst, a.rt_wt + static_cast<size_t>(r0 + j) * a.rt_e + c);
            else
                *dst = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    } else
    for (int m = 0; m < (a.rt_e > kThreads ? 2 : 1); m++) {
        const uint32_t x = t + m * kThreads;
        const float *src = a.rt_w + static_cast<size_t>(x < a.rt_e ? x : 0) * a.rt_ld + r0;
        float4 *dst = reinterpret_cast<float4 *>(s_rw) + static_cast<size_t>(m) * (RPT / 4) *
                                                             kThreads + t;
#pragma unroll
        for (int j = 0; j < RPT; j += 4) {
            if (a.rt_skip & 1)
                continue;
            if (x < a.rt_e && r0 + j < a.n_rows)
                cp16(dst + (j / 4) * kThreads, src + j);
            else
                dst[(j / 4) * kThreads] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    cp_commit();
    const bool in = t < static_cast<uint32_t>(RPT) && r0 + t < a.n_rows;
    e.h = in ? __ldcg(a.rt_h + r0 + t) : 0.0f;
    e.g = in && a.rt_g ? a.rt_g[r0 + t] : 1.0f;
}

/* The launch's last block (every thread; s_x: room for the row and the gate, 2 kRtMaxN
 * floats, the block's spent router columns), its loads first (the clusters' sums, the row's
 * two halves and norm weights, the gate into shared memory), all in flight together: the row
 * and its norm as matvec.cu's norm_in_row forms them (thread t's columns t, t + width, ... of x = h + y, the same sums, tree and
 * expressions: the bits of cuda_matvec_tail_norm_in's xout and xq), the logits (each
 * expert's cluster sums in cluster order, times the norm's scale) and, by warp 0, their
 * top k (router_topk_warp, from a copy in shared memory); warps 1-7 meanwhile write the row and its rounding and sum the
 * shared expert's gate as norm_in_gate does (its virtual warps' sums, then one butterfly
 * over them: the same bits). */
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900 /* rt_finish's, which runs on sm_90 */
__device__ __forceinline__ void rt_tail(const MvqArgs &a, float *s_x)
{
    __shared__ float s_red[32], s_gw[32], s_lg[kRtMaxE];
    __shared__ uint64_t s_pick[32];
    const uint32_t n = a.n_rows, width = a.rt_width, t = threadIdx.x, E = a.rt_e;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t clusters = gridDim.x / kRtCluster;
    /* clusters of a launch at most: n_rows <= kRtMaxN in tiles of kRtMinRows rows or more */
    constexpr int kRtMaxClusters = kRtMaxN / kRtMinRows / kRtCluster;
    float *s_g = s_x + kRtMaxN;
    float pv[2][kRtMaxClusters];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int c = 0; c < kRtMaxClusters; c++) {
            const uint32_t x = t + m * kThreads;
            pv[m][c] = x < E && static_cast<uint32_t>(c) < clusters && !(a.rt_skip & 64)
                           ? __ldcg(a.rt_part + static_cast<size_t>(c) * E + x)
                           : 0.0f;
        }
    float hv[kRtCols], dv[kRtCols], gv[kRtCols];
#pragma unroll
    for (int b = 0; b < kRtCols; b++) {
        const uint32_t i = t + b * width;
        const bool in = t < width && i < n;
        hv[b] = in ? __ldcg(a.rt_h + i) : 0.0f;
        dv[b] = in ? __ldcg(a.y + i) : 0.0f;
        gv[b] = in && a.rt_g ? __ldg(a.rt_g + i) : 1.0f; /* with the others, not one by one
                                                           * after the norm */
    }
    if (a.rt_gate) { /* copied beside the norm (loads and stores in registers went one by
                      * one); waited for before the barrier ahead of its reads */
        for (uint32_t j = t; j < n; j += kThreads)
            cp4(s_g + j, a.rt_gate + j);
        cp_commit();
    }
    float acc[2] = {0.0f, 0.0f}; /* the clusters' sums in cluster order */
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int c = 0; c < kRtMaxClusters; c++)
            if (static_cast<uint32_t>(c) < clusters)
                acc[m] += pv[m][c];
    const float scale = tail_add_norm_scale(hv, dv, n, width, a.rt_eps, s_red);
    if (t < width)
#pragma unroll
        for (int b = 0; b < kRtCols; b++) {
            const uint32_t i = t + b * width;
            if (i < n) {
                const float v = hv[b] * scale;
                s_x[i] = a.rt_g ? v * gv[b] : v;
            }
        }
#pragma unroll
    for (int m = 0; m < 2; m++) {
        const uint32_t x = t + m * kThreads;
        if (x < E) {
            const float l = acc[m] * scale;
            a.rt_logits[x] = l;
            s_lg[x] = l;
        }
    }
    cp_wait<0>();    /* the gate in s_g */
    __syncthreads(); /* the row in s_x, the logits in s_lg */
    if (warp == 0) {
        if (!(a.rt_skip & 16))
            router_topk_warp<false, true>(s_lg, E, a.tail.t.k, a.tail.t.ids, a.tail.t.w, s_pick,
                                          a.tail.t.topk_rounds, nullptr,
                                          a.tail.t.topk_softmax);
        return;
    }
    if (a.rt_skip & 32)
        return;
    int8_t *xl = a.rt_xq;
    float *xd = xl ? reinterpret_cast<float *>(xl + n) : nullptr;
    for (uint32_t bb = warp - 1; bb < n / 32; bb += kWarps - 1) {
        const float o = s_x[bb * 32 + lane];
        if (a.rt_xa)
            a.rt_xa[bb * 32 + lane] = o;
        if (xl)
            mvq::round_block(o, bb, true, xl, xd, xd + n / 32);
    }
    if (!a.rt_gate)
        return;
    const uint32_t gw = a.rt_gate_width;
    for (uint32_t vw = warp - 1; vw < gw / 32; vw += kWarps - 1) {
        float d = 0.0f;
        for (uint32_t j = vw * 32 + lane; j < n; j += gw)
            d += s_g[j] * s_x[j];
        d = ops_warp_sum(d);
        if (lane == 0)
            s_gw[vw] = d;
    }
    /* warps 1-7 only (warp 0 picks): a named barrier of their threads */
    asm volatile("bar.sync 1, %0;" ::"r"((kWarps - 1) * 32) : "memory");
    if (warp == 1) {
        float v = static_cast<uint32_t>(lane) < gw / 32 ? s_gw[lane] : 0.0f;
        v = ops_warp_sum(v);
        if (lane == 0)
            *a.rt_gs = 1.0f / (1.0f + expf(-v));
    }
}
#endif

/* Every thread of every block, after its rows are stored (s_out: the tile's outputs):
 * the block's sums, the cluster's, the count; the last block runs rt_tail. */
template <int RPT>
__device__ __forceinline__ void rt_finish(const MvqArgs &a, const RtEarly &e, float *s_rw,
                                          const float *s_out)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    __shared__ float s_gx[RPT];
    __shared__ __align__(16) float s_p[kRtMaxE];
    __shared__ unsigned int s_last;
    const uint32_t t = threadIdx.x, E = a.rt_e;
    const uint32_t r0 = blockIdx.x * static_cast<uint32_t>(RPT);
    __syncthreads(); /* the tile's outputs in s_out */
    if (t < static_cast<uint32_t>(RPT)) { /* x = h + y as norm_in_row adds them */
        float v = e.h;
        v += r0 + t < a.n_rows ? s_out[t] : 0.0f;
        s_gx[t] = v * e.g;
    }
    cp_wait<0>(); /* this thread's columns (it copied them), before the barrier */
    __syncthreads();
    for (int m = 0; m < (E > kThreads ? 2 : 1); m++) {
        const uint32_t x = t + m * kThreads;
        float p = 0.0f; /* the rows in order either way: the same sums */
        if (a.rt_wt) {
            const uint32_t es = E > kThreads ? 2 * kThreads : kThreads;
#pragma unroll
            for (int j = 0; j < RPT; j++)
                p = fmaf(s_rw[static_cast<size_t>(j) * es + x], s_gx[j], p);
        } else {
            const float4 *w4 = reinterpret_cast<const float4 *>(s_rw) +
                               static_cast<size_t>(m) * (RPT / 4) * kThreads + t;
#pragma unroll
            for (int j = 0; j < RPT / 4; j++) {
                const float4 w = w4[j * kThreads];
                p = fmaf(w.x, s_gx[4 * j], p);
                p = fmaf(w.y, s_gx[4 * j + 1], p);
                p = fmaf(w.z, s_gx[4 * j + 2], p);
                p = fmaf(w.w, s_gx[4 * j + 3], p);
            }
        }
        if (x < E)
            s_p[x] = p;
    }
    const bool cl_on = !(a.rt_skip & 2);
    if (cl_on) {
        cluster_arrive(true);
        cluster_wait(true);
    }
    const cg::cluster_group cl = cg::this_cluster();
    const uint32_t rank = cl.block_rank(), per = E / kRtCluster;
    if (t < per && cl_on) { /* experts rank * per + t: the cluster's blocks in rank order */
        const uint32_t x = rank * per + t;
        float v = 0.0f;
#pragma unroll
        for (int q = 0; q < kRtCluster; q++)
            v += cl.map_shared_rank(s_p, q)[x];
        a.rt_part[static_cast<size_t>(blockIdx.x / kRtCluster) * E + x] = v;
    }
    if (cl_on)
        cluster_arrive(true); /* this block's reads of the others' sums are done */
    __threadfence();      /* its sums before its arrival */
    __syncthreads();
    if (t == 0) {
        s_last = atomicAdd(a.tail.t.counter, 1u) + 1u == gridDim.x;
        if (s_last)
            *a.tail.t.counter = 0; /* every block has arrived: ready for the next launch */
    }
    __syncthreads();
    if (s_last && !(a.rt_skip & 4)) {
        __threadfence(); /* the other blocks' sums and rows, through L2 (__ldcg) */
        rt_tail(a, s_rw); /* the columns are spent: the row in their place */
    }
    if (cl_on)
        cluster_wait(false); /* the cluster's reads of this block's sums are done first */
#else
    (void)a;
    (void)e;
    (void)s_rw;
    (void)s_out;
#endif
}

/* MINB: blocks per SM the registers must allow (3 for expert products: the
 * decode's pairs then fit one wave on an H200, 2 blocks per SM took two; and for a
 * K type's plain product without a tail, plain_lean). */
/* GQ (with ST, 32-row tiles, launched as clusters of 2 blocks): a gate/up
 * product's blocks 2i and 2i + 1 take the pair's gate tile i and up tile
 * gq_half + i; the up block hands its 32 outputs to the gate block in
 * distributed shared memory, which writes silu(gate) * up rounded for the
 * down product (gq; what the down product's glu rounding gives, the same
 * bits) besides y. */
template <int TYPE, int G, int U, int R, bool TAIL, int MINB, bool ST, bool GQ = false,
          bool RT = false>
__global__ void __launch_bounds__(kThreads, MINB) mvq_kernel(const MvqArgs a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    if constexpr (ST) { /* launched on sm_90 and later only (tma_wanted) */
        __trap();
        return;
    }
#endif
    extern __shared__ int4 s_dyn[];
    int8_t *s_q = reinterpret_cast<int8_t *>(s_dyn);          /* n levels */
    float *s_d = reinterpret_cast<float *>(s_q + a.nb * 32);  /* nb scales */
    float *s_s = s_d + a.nb;                                  /* nb scale x level sums */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t job = blockIdx.y;
    const uint8_t *w = a.w;
    const float *x = a.x + static_cast<size_t>(job / a.x_div) * a.ldx;
    float *y = a.y + static_cast<size_t>(job) * a.ldy;
    const int grp = threadIdx.x / G, sub = threadIdx.x % G;
    /* tiles of (kThreads / G) * R rows: block x takes tiles x, x + grid.x,
     * ... (the activations are rounded once per block) */
    const uint32_t n_tiles = (a.n_rows + (kThreads / G) * R - 1) / ((kThreads / G) * R);
    uint32_t tile = GQ ? (blockIdx.x >> 1) + (blockIdx.x & 1) * a.gq_half : blockIdx.x;
    uint32_t row0 = (tile * (kThreads / G) + grp) * R;
    /* RT: one tile a block (the launcher's promise), its outputs kept for the router */
    constexpr int RPT = (kThreads / G) * R;
    [[maybe_unused]] __shared__ float s_out[RT ? RPT : 1];
    [[maybe_unused]] RtEarly re;
    static_assert(!RT || (RPT % 4 == 0 && RPT >= kRtMinRows), "RT tiles of whole float4s");
    /* RT: the router's columns past the row's levels (rt_cols_bytes) */
    [[maybe_unused]] float *s_rw =
        reinterpret_cast<float *>(reinterpret_cast<uint8_t *>(s_dyn) + (a.nb * 40 + 15) / 16 * 16);
    /* ST: the tile after the activations' levels, scales and sums, copied
     * from the 16-byte boundary at or before its first byte (so its bytes
     * keep their place modulo 16, and each lane's words and shifts are those
     * of the global rows) to the one after its last */
    uint8_t *s_w = reinterpret_cast<uint8_t *>(s_dyn) + (a.nb * 40 + 15) / 16 * 16;
    __shared__ uint64_t s_bar;
    uint32_t phase = 0;    /* parity of the barrier phase the next wait waits for */
    bool inflight = false; /* a copy issued and not yet waited for (block-uniform) */
    probe_mark(a, CUDA_PROBE_MVQ_START);
    if constexpr (GQ) /* paired with the wait before the first remote store: the partner runs */
        cluster_arrive(false);
    if (ST && threadIdx.x == 0)
        tma_bar_init(&s_bar);
    auto tile_src = [&](const uint8_t *base, uint32_t t) {
        return base + static_cast<size_t>(t) * ((kThreads / G) * R) * a.row_bytes;
    };
    /* thread 0: tile t of the matrix at base into s_w */
    auto tma_issue = [&](const uint8_t *base, uint32_t t) {
        const uint32_t rpt = (kThreads / G) * R, r0 = t * rpt;
        const uint32_t n = a.n_rows - r0 < rpt ? a.n_rows - r0 : rpt;
        const uintptr_t src = reinterpret_cast<uintptr_t>(tile_src(base, t));
        const uintptr_t lo = src & ~static_cast<uintptr_t>(15);
        const uintptr_t hi = (src + static_cast<size_t>(n) * a.row_bytes + 15) &
                             ~static_cast<uintptr_t>(15);
        tma_copy(s_w, reinterpret_cast<const void *>(lo), static_cast<uint32_t>(hi - lo),
                 &s_bar);
    };

    /* a pass: units b0 + u*G (u < U) of the group's R rows (a unit: mvq::Blk,
     * a block of 32 for Q4_0 and Q8_0, 64 elements for the K types), all loads
     * issued before any is used; the first pass before the activations */
    const uint32_t nu = a.nb / Blk<TYPE>::XB; /* units a row */
    uint32_t v[U][R][Blk<TYPE>::WORDS], sh[U][R];
    auto issue = [&](uint32_t b0) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t b = b0 + u * G;
                if (b < nu && row0 + r < a.n_rows)
                    load_block<TYPE>(w + static_cast<size_t>(row0 + r) * a.row_bytes, b, v[u][r],
                                     &sh[u][r]);
            }
    };
    /* the activation row into shared memory (x through L2: with x_early
     * before the wait, beside the launch just before) */
    auto prep_x = [&]() {
        /* norm in: the scale of cuda_rmsnorm_wide over x (its virtual threads'
         * sums of squares in its order and tree), two rounds' loads at a time */
        float nscale = 1.0f;
        if (a.nin_width) {
            __shared__ float s_red[32];
            const uint32_t width = a.nin_width, rounds = (a.n + width - 1) / width;
            float part[kTailVirtual];
#pragma unroll
            for (int m = 0; m < kTailVirtual; m++)
                part[m] = 0.0f;
            for (uint32_t t0 = 0; t0 < rounds; t0 += 2) {
                float hv[2][kTailVirtual];
#pragma unroll
                for (int t = 0; t < 2; t++)
#pragma unroll
                    for (int m = 0; m < kTailVirtual; m++) {
                        const uint32_t v = threadIdx.x + m * kThreads, j = v + (t0 + t) * width;
                        hv[t][m] = v < width && j < a.n ? __ldcg(x + j) : 0.0f;
                    }
#pragma unroll
                for (int m = 0; m < kTailVirtual; m++)
#pragma unroll
                    for (int t = 0; t < 2; t++) {
                        const uint32_t v = threadIdx.x + m * kThreads, j = v + (t0 + t) * width;
                        if (v < width && j < a.n)
                            part[m] += hv[t][m] * hv[t][m];
                    }
            }
            const float sum = tail_vsum<kTailVirtual>(part, width, s_red);
            nscale = 1.0f / sqrtf(sum / static_cast<float>(a.n) + a.nin_eps);
        }

        /* round the activation row into shared memory: warp w takes blocks
         * w, w + 8, ...; four blocks' loads in flight at a time */
        constexpr int XB = 4;
        for (uint32_t b0 = warp; b0 < a.nb; b0 += XB * kWarps) {
            float xv[XB];
#pragma unroll
            for (int i = 0; i < XB; i++) {
                const uint32_t b = b0 + i * kWarps;
                xv[i] = b < a.nb ? __ldcg(x + b * 32 + lane) : 0.0f;
                if (a.nin_width && b < a.nb) { /* norm_rows_kernel's expressions */
                    xv[i] = xv[i] * nscale;
                    if (a.nin_w)
                        xv[i] = xv[i] * a.nin_w[b * 32 + lane];
                }
                if (a.glu) /* cuda_silu_mul's formula: the rounding sees the same values */
                    xv[i] = b < a.nb ? __fmul_rn(xv[i] / (1.0f + expf(-xv[i])),
                                                 __ldcg(x + a.n + b * 32 + lane))
                                     : 0.0f;
            }
            uint32_t bb[XB];
            bool st[XB];
#pragma unroll
            for (int i = 0; i < XB; i++) {
                bb[i] = b0 + i * kWarps;
                st[i] = bb[i] < a.nb;
            }
            mvq::round_blocks<XB>(xv, bb, st, s_q, s_d, s_s);
        }
    };
    /* PDL: a plain product's weights (its tiles in L2, the first pass in
     * registers) before the wait for the activations; an expert's address
     * needs the ids, so after it, unless they are early (written by a launch
     * that completed before the one just before this started: through L2) */
    int32_t e = -1;
    bool polled = false; /* ids_poll: e and w from before the wait, loads issued */
    /* the first tile's loads: one copy (ST), or lane by lane */
    auto issue_first = [&]() {
        if constexpr (ST) {
            if (threadIdx.x == 0)
                tma_issue(w, tile);
            inflight = true;
        } else {
            issue(sub);
        }
    };
    if (!a.ids) {
        if (threadIdx.x == 0)
            prefetch_rows(a, (kThreads / G) * R, n_tiles);
        issue_first();
        if constexpr (RT) {
            if (blockIdx.x == 0 && threadIdx.x == 0 && a.rt_gate)
                pdl_prefetch_l2(a.rt_gate, a.n_rows * sizeof(float));
            if (blockIdx.x == 1 && threadIdx.x == 0 && a.rt_g)
                pdl_prefetch_l2(a.rt_g, a.n_rows * sizeof(float));
            rt_early<RPT>(a, blockIdx.x * RPT, s_rw, re);
        }
    } else if (a.early) {
        e = __ldcg(a.ids + job);
        w = e >= 0 && static_cast<uint32_t>(e) < a.n_table
                ? static_cast<const uint8_t *>(a.addr[e])
                : nullptr;
        if (w)
            issue_first();
    } else {
        if (a.n_table && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
            /* the address tables: the ids pick their entries after the wait */
            pdl_prefetch_l2(a.addr, a.n_table * sizeof(void *));
            if (a.pf_addr)
                pdl_prefetch_l2(a.pf_addr, a.n_table * sizeof(void *));
        }
        if (a.ids_poll) { /* the id as soon as the router writes it: its weights asked for */
            __shared__ int32_t s_id;
            if (threadIdx.x == 0) {
                s_id = poll_id(a.ids + job);
                const int32_t e0 = s_id; /* ST: the copy issued before the barrier */
                const uint8_t *w0 = e0 >= 0 && static_cast<uint32_t>(e0) < a.n_table
                                        ? static_cast<const uint8_t *>(a.addr[e0])
                                        : nullptr;
                if (ST && w0)
                    tma_issue(w0, tile);
            }
            probe_mark(a, CUDA_PROBE_MVQ_POLLED);
            __syncthreads();
            e = s_id;
            w = e >= 0 && static_cast<uint32_t>(e) < a.n_table
                    ? static_cast<const uint8_t *>(a.addr[e])
                    : nullptr;
            polled = w != nullptr;
            if (polled) {
                if constexpr (ST)
                    inflight = true;
                else
                    issue(sub);
            }
        }
    }
    float gs = 1.0f; /* a COMBINE_COLS tail's gate, early: before the wait too */
    if constexpr (TAIL) {
        tail_prefetch(a.tail);
        if (a.early && a.tail.t.kind == CUDA_TAIL_COMBINE_COLS) {
            __shared__ float s_gate[32];
            gs = tail_gate(a.tail, s_gate);
        }
    }
    if (a.nin_width && a.nin_w && blockIdx.x == 0 && threadIdx.x == 0)
        pdl_prefetch_l2(a.nin_w, a.n * sizeof(float));
    if (a.x_early && !a.xq)
        prep_x();
    /* beside: the wait at the end instead (a plain product's form without a tail) */
    const bool beside = !TAIL && !RT && !GQ && !ST && a.beside;
    if (!beside) {
        pdl_wait();
        probe_mark(a, CUDA_PROBE_MVQ_WAITED);
        if constexpr (TAIL || RT) /* a quantized router's top-k tail marks its ids as
                                   * matvec.cu's does; RT's top-k too */
            tail_mark_ids(a.tail);
        pdl_trigger();
    }
    if (a.ids) {
        bool again = !a.early;
        if (!a.early) {
            const int32_t e2 = a.ids[job];
            again = !polled || e2 != e; /* the poll saw another launch's id, or none */
            if (again) {
                e = e2;
                w = e >= 0 ? static_cast<const uint8_t *>(a.addr[e]) : nullptr;
            }
        }
        if (again && inflight) { /* the polled copy lands before another into its place */
            if (threadIdx.x == 0)
                tma_wait(&s_bar, phase);
            phase ^= 1;
            inflight = false;
        }
        if (!w) { /* the whole block: the pair runs elsewhere (both blocks of a GQ pair) */
            if constexpr (TAIL)
                tail_finish<true>(a.tail, gs, a.early);
            if constexpr (GQ)
                cluster_wait(false);
            return;
        }
        if (again)
            issue_first();
        if (a.pf_addr && !a.pf_after && threadIdx.x == 0)
            prefetch_next(a, e);
    }

    if (a.xq) { /* levels, scales, sums: the layout of s_q, s_d, s_s */
        const uint2 *src =
            reinterpret_cast<const uint2 *>(a.xq + static_cast<size_t>(job / a.x_div) * a.xq_ld);
        uint2 *dst = reinterpret_cast<uint2 *>(s_dyn);
        for (uint32_t i = threadIdx.x; i < a.nb * 5; i += kThreads)
            dst[i] = __ldcg(src + i);
    } else if (!a.x_early) {
        prep_x();
    }
    __syncthreads();
    probe_mark(a, CUDA_PROBE_MVQ_X);

    for (; tile < n_tiles; tile += gridDim.x) {
    row0 = (tile * (kThreads / G) + grp) * R;
    const uint8_t *s_rows = s_w; /* ST: the group's first row in shared memory */
    if constexpr (ST) {
        tma_wait(&s_bar, phase);
        phase ^= 1;
        inflight = false;
        probe_mark(a, CUDA_PROBE_MVQ_DATA);
        s_rows = s_w + (reinterpret_cast<uintptr_t>(tile_src(w, tile)) & 15) +
                 static_cast<size_t>(grp * R) * a.row_bytes;
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        acc[r] = 0.0f;
    for (uint32_t b0 = sub; b0 < nu; b0 += U * G) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t b = b0 + u * G;
            if (b >= nu)
                break;
            const mvq::UnitX<TYPE> xu = mvq::unit_x<TYPE>(s_q, s_d, s_s, b);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (row0 + r >= a.n_rows)
                    continue;
                if constexpr (ST) { /* the words read from the tile as they are used */
                    uint32_t vs[Blk<TYPE>::WORDS], shs;
                    mvq::load_block<TYPE, true>(s_rows + static_cast<size_t>(r) * a.row_bytes,
                                                b, vs, &shs);
                    acc[r] += mvq::unit_dot<TYPE>(vs, shs, xu);
                } else {
                    acc[r] += mvq::unit_dot<TYPE>(v[u][r], sh[u][r], xu);
                }
            }
        }
        if constexpr (ST) /* one pass, one tile a block */
            continue;
        if (b0 + U * G < nu)
            issue(b0 + U * G);
        else if (tile + gridDim.x < n_tiles) { /* the next tile's first pass */
            row0 += gridDim.x * (kThreads / G) * R;
            issue(sub);
            row0 -= gridDim.x * (kThreads / G) * R;
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int o = G / 2; o > 0; o >>= 1)
            acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], o);
    }
    if constexpr (GQ) /* the arrive at the start: the partner runs (remote stores below) */
        cluster_wait(false);
    if (sub < R && row0 + sub < a.n_rows) {
        float out = acc[0];
#pragma unroll
        for (int r = 1; r < R; r++)
            out = sub == r ? acc[r] : out;
        y[row0 + sub] = out;
        if constexpr (GQ)
            gq_put(out, grp * R + sub);
        if constexpr (RT)
            s_out[grp * R + sub] = out;
    }
    }
    if (beside) { /* the launch after this one finds the one before it done too */
        pdl_wait();
        pdl_trigger();
    }
    if constexpr (GQ)
        gq_round(a, job, blockIdx.x >> 1);
    /* pf_after: the id read again (kept live over the loop, it cost the gate/up
     * instantiation spills) */
    if (a.pf_after && a.pf_addr && a.ids && threadIdx.x == 0)
        prefetch_next(a, __ldcg(a.ids + job));
    probe_mark(a, CUDA_PROBE_MVQ_STORED);
    if constexpr (TAIL) /* its own instantiation: the others keep their registers */
        tail_finish<true>(a.tail, gs, a.early);
    if constexpr (RT)
        rt_finish<RPT>(a, re, s_rw, s_out);
    probe_mark(a, CUDA_PROBE_MVQ_END);
}

/* Two blocks per SM of the current device: the blocks a launch should have
 * (264, an H200's, if the query fails). */
uint32_t want_blocks()
{
    const int sms = cuda_caps_sms();
    return 2u * static_cast<uint32_t>(sms > 0 ? sms : 132);
}

/* Which expert products copy their tiles by tma (ST): on devices of compute
 * capability 9.0 or later, by LAMINA_CUDA_TMA: unset, those that poll the
 * router's ids (the decode gate/up product, whose experts come from DRAM
 * once the ids are known: 9.02 -> 8.64 us a layer, tg128 +2.8 % on an H200) and
 * Q6_K's (k6: whose lanes hold one unit each, so that a down product took two waves of
 * blocks of one row a group, where the tile gives two); "poll", the polled ones only;
 * "all", every expert product without a tail (tests); "0", none. Plain products
 * and the other down products read weights already asked for in L2 or in registers
 * before their PDL wait, and were slower so (docs/perf.md). Read at each launch. */
bool tma_wanted(const MvqArgs &a, bool k6)
{
    const char *env = getenv("LAMINA_CUDA_TMA");
    if (env && env[0] == '0')
        return false;
    const bool all = env && !strcmp(env, "all");
    const bool poll = env && !strcmp(env, "poll");
    return a.ids && a.tail.t.kind == CUDA_TAIL_NONE && (all || a.ids_poll || (k6 && !poll)) &&
           device_sm90();
}

/* Whether a plain product without a tail takes the experts' register budget (three
 * blocks an SM: 77-80 registers, no spills) rather than one block's: by
 * LAMINA_CUDA_PLAIN_LEAN, unset the K types (kk), "0" none, "all" every type. Two blocks
 * of a K type's plain form at 94-108 registers left no room for a block of the launch
 * after them, which then started only as they ended: on an H100's Q4_K_M decode the
 * router's increment after the DeltaNet output product fell from 10.2 to 7.4 us a layer,
 * tg128 +5 %; Q4_0's plain products so were 8 % slower (docs/perf.md, forty-sixth
 * session). The same bits either way. Read at each launch. */
bool plain_lean(bool kk)
{
    const char *env = getenv("LAMINA_CUDA_PLAIN_LEAN");
    if (env && env[0] == '0')
        return false;
    return kk || (env && !strcmp(env, "all"));
}

/* The blocks a lean plain product (plain_lean, no tail) loops its tiles over: two an SM
 * (want_blocks), or LAMINA_CUDA_LEAN_BLOCKS (1 to 3) an SM, which its registers allow
 * (measurements). Read at each launch. */
uint32_t lean_blocks()
{
    const char *env = getenv("LAMINA_CUDA_LEAN_BLOCKS");
    const long per = env ? strtol(env, nullptr, 10) : 0;
    if (per < 1 || per > 3)
        return want_blocks();
    return static_cast<uint32_t>(per) * (want_blocks() / 2);
}

/* Whether the last product this thread launched copied its tiles by tma
 * (cuda_mvq_last_tma; tests). */
thread_local bool last_tma = false;

/* cuda_mvq_probe_next's marks for this thread's next launch. */
thread_local unsigned long long *next_probe = nullptr;

/* The launch of a form. WHO: the launches it is built for (pick's choices),
 * the others' kernels not instantiated (-ENOTSUP): kPlain a plain product,
 * kExperts an expert product whose lanes load their weights, kTma one whose
 * tiles come by tma (and its GQ clusters). K types (Blk WORDS > 9) build no
 * expert product with a tail (COMBINE_COLS, opt-in: the callers fall back). */
constexpr int kPlain = 1, kExperts = 2, kTma = 4, kAll = 7;

template <int TYPE, int G, int U, int R, int WHO = kAll>
int go(const MvqArgs &args, uint32_t jobs, cudaStream_t stream)
{
    constexpr bool kK = Blk<TYPE>::WORDS > 9;
    if (!(WHO & (jobs > 1 ? kExperts | kTma : kPlain)))
        return -ENOTSUP;
    MvqArgs a = args;
    a.probe = next_probe;
    next_probe = nullptr;
    const uint32_t rows_per_block = (kThreads / G) * R;
    const uint32_t tiles = (a.n_rows + rows_per_block - 1) / rows_per_block;
    /* one product: at most two blocks per SM (lean_blocks' where lean), each looping over
     * tiles */
    const bool lean = jobs == 1 && a.tail.t.kind == CUDA_TAIL_NONE && plain_lean(kK) &&
                      (WHO & kPlain) != 0;
    const uint32_t cap = jobs > 1 ? tiles : lean ? lean_blocks() : want_blocks();
    const dim3 grid(tiles < cap ? tiles : cap, jobs);
    a.tail.rows_per_tile = rows_per_block;
    a.tail.n_tiles = tiles;
    if (a.tail.t.kind == CUDA_TAIL_COMBINE_COLS && grid.x > CUDA_TAIL_COLS_MAX)
        return -ENOTSUP;
    size_t smem = static_cast<size_t>(a.nb) * 32 + 2 * sizeof(float) * a.nb;
    /* ST (tma): expert products (one tile a block) as tma_wanted says, a row
     * read in one pass, the tile (with up to 15 bytes each side to the
     * 16-byte boundaries, and the last block's words past it) within the
     * default 48 KiB */
    const size_t x_bytes = (static_cast<size_t>(a.nb) * 40 + 15) / 16 * 16;
    const size_t tile_bytes = static_cast<size_t>(rows_per_block) * a.row_bytes + 48;
    const bool tail = a.tail.t.kind != CUDA_TAIL_NONE;
    last_tma = false;
    bool st = false;
    if constexpr ((WHO & kTma) != 0) {
        st = jobs > 1 && tma_wanted(a, TYPE == QUANT_TYPE_Q6_K) &&
             a.nb / Blk<TYPE>::XB <= static_cast<uint32_t>(U * G) &&
             x_bytes + tile_bytes <= 48 * 1024 &&
             cuda_caps_fits_default((const void *)mvq_kernel<TYPE, G, U, R, false, 3, true>,
                                    x_bytes + tile_bytes);
        if (st)
            smem = x_bytes + tile_bytes;
        last_tma = st;
        if (a.gq) { /* GQ: tma, a tile of 32 rows, a gate tile and its up tile a cluster */
            last_tma = false;
            if constexpr ((kThreads / G) * R == 32) {
                if (!st || tail || tiles != 2 * a.gq_half || grid.x != tiles ||
                    !cuda_caps_fits_default(
                        (const void *)mvq_kernel<TYPE, G, U, R, false, 3, true, true>, smem))
                    return -ENOTSUP;
                last_tma = true;
                pdl_launch_cluster(mvq_kernel<TYPE, G, U, R, false, 3, true, true>, grid, kThreads,
                                   2, smem, stream, a);
            } else {
                return -ENOTSUP;
            }
        } else if (st) {
            pdl_launch(mvq_kernel<TYPE, G, U, R, false, 3, true>, grid, kThreads, smem, stream, a);
        }
    } else if (a.gq) {
        return -ENOTSUP;
    }
    if (jobs > 1 && !st && !a.gq) {
        if constexpr ((WHO & kExperts) != 0) {
            if (tail) { /* experts: registers for three blocks per SM */
                if constexpr (!kK)
                    pdl_launch(mvq_kernel<TYPE, G, U, R, true, 3, false>, grid, kThreads, smem,
                               stream, a);
                else
                    return -ENOTSUP;
            } else {
                pdl_launch(mvq_kernel<TYPE, G, U, R, false, 3, false>, grid, kThreads, smem,
                           stream, a);
            }
        } else {
            return -ENOTSUP;
        }
    }
    if constexpr ((WHO & kPlain) != 0) {
        if (jobs == 1 && tail)
            pdl_launch(mvq_kernel<TYPE, G, U, R, true, 1, false>, grid, kThreads, smem, stream, a);
        else if (jobs == 1 && plain_lean(kK))
            pdl_launch(mvq_kernel<TYPE, G, U, R, false, 3, false>, grid, kThreads, smem, stream,
                       a);
        else if (jobs == 1)
            pdl_launch(mvq_kernel<TYPE, G, U, R, false, 1, false>, grid, kThreads, smem, stream,
                       a);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda mvq: kernel launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

/* Whether a cluster of kRtCluster blocks of an RT kernel with smem bytes of dynamic shared
 * memory (its static too) fits the current device: the driver's answer, kept a kernel, size
 * and device (a table under a lock; past its size the driver is asked each time). */
bool rt_cluster_fits(const void *kernel, size_t smem)
{
    struct Fit {
        int dev;
        const void *kernel;
        size_t smem;
        bool fits;
    };
    static Fit fits[32];
    static int n_fits;
    static std::mutex mu;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < n_fits; i++)
        if (fits[i].dev == dev && fits[i].kernel == kernel && fits[i].smem == smem)
            return fits[i].fits;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = kRtCluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kRtCluster, 1);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const bool ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess &&
                    clusters >= 1;
    if (!ok) {
        (void)cudaGetLastError();
        log_debug("cuda mvq router: no cluster of %d blocks with %zu bytes of dynamic shared "
                  "memory fits device %d", kRtCluster, smem, dev);
    }
    if (n_fits < static_cast<int>(sizeof fits / sizeof fits[0]))
        fits[n_fits++] = Fit{dev, kernel, smem, ok};
    return ok;
}

/* RT (cuda_mvq_xq_router): one tile of (kThreads / G) * R rows a block, the grid
 * rounded up to whole clusters (blocks past the rows add nothing). A row's bits depend on
 * G alone (its lanes take blocks sub, sub + G, ... in order, whatever U and R), so they are
 * those of cuda_mvq_xq_tail's launch. */
template <int TYPE, int G, int U, int R>
int go_rt(const MvqArgs &args, cudaStream_t stream, bool dry)
{
    MvqArgs a = args;
    a.probe = nullptr;
    constexpr uint32_t rows_per_block = (kThreads / G) * R;
    const uint32_t tiles = (a.n_rows + rows_per_block - 1) / rows_per_block;
    const uint32_t blocks = (tiles + kRtCluster - 1) / kRtCluster * kRtCluster;
    a.tail.rows_per_tile = rows_per_block;
    a.tail.n_tiles = tiles;
    const size_t smem =
        (static_cast<size_t>(a.nb) * 40 + 15) / 16 * 16 + rt_cols_bytes(a.rt_e, rows_per_block);
    last_tma = false;
    const auto kernel = mvq_kernel<TYPE, G, U, R, false, 2, false, false, true>;
    /* a cluster of these blocks must fit the device (asked once a form, size and device,
     * first by cuda_mvq_router_ok's dry run before any graph capture): else the caller's
     * two launches */
    if (!cuda_caps_fits_default(reinterpret_cast<const void *>(kernel), smem) ||
        !rt_cluster_fits(reinterpret_cast<const void *>(kernel), smem))
        return -ENOTSUP;
    if (dry)
        return 0;
    /* LAMINA_CUDA_RT_SKIP bit 8 (timing only): the same blocks launched without clusters
     * (their adds left out, as bit 2) */
    if (a.rt_skip & 8)
        a.rt_skip |= 2;
    pdl_launch_cluster(kernel, dim3(blocks, 1), kThreads, (a.rt_skip & 8) ? 1u : kRtCluster,
                       smem, stream, a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda mvq router: kernel launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

/* The RT forms built: rows of at most 4 blocks a lane (mvq::lanes_per_row's lanes; 4096
 * elements at 32 lanes), U = 2 or 4 blocks a lane a pass, tiles of 16 rows (32 at 8 lanes),
 * two blocks an SM (so that whole clusters find room beside the launch before). -ENOTSUP
 * for longer rows. */
template <int TYPE>
int pick_rt(const MvqArgs &a, cudaStream_t stream, bool dry)
{
    const uint32_t g = mvq::lanes_per_row(a.nb);
    if (a.nb > 4 * g)
        return -ENOTSUP;
    if (g == 8)
        return go_rt<TYPE, 8, 2, 1>(a, stream, dry);
    if (g == 16)
        return go_rt<TYPE, 16, 2, 1>(a, stream, dry);
    /* Q8_0 rows in two passes (U 2): the registers of two blocks an SM without spills */
    if constexpr (TYPE == QUANT_TYPE_Q8_0) {
        return go_rt<TYPE, 32, 2, 2>(a, stream, dry);
    } else {
        if (a.nb <= 2 * 32)
            return go_rt<TYPE, 32, 2, 2>(a, stream, dry);
        return go_rt<TYPE, 32, 4, 2>(a, stream, dry);
    }
}

/* RT: the form that takes these rows (a.nb, a.rt_e); dry: only whether its clusters fit
 * the device (nothing launched). */
int dispatch_rt(uint32_t type, const MvqArgs &a, cudaStream_t stream, bool dry)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return pick_rt<QUANT_TYPE_Q4_0>(a, stream, dry);
    case QUANT_TYPE_Q8_0: return pick_rt<QUANT_TYPE_Q8_0>(a, stream, dry);
    default: return -ENOTSUP;
    }
}

/* Lanes per row from the blocks per row; blocks per lane per pass U (all
 * of a row's blocks in one pass up to 8 per lane) and rows per group R
 * with U * R = 8 loads in flight per lane, fewer rows where the launch
 * would not give each SM of the device two blocks. */
template <int TYPE>
int pick(const MvqArgs &a, uint32_t jobs, cudaStream_t stream)
{
    /* K types: units of 12 (Q4_K), 20 (Q5_K) or 24 (Q6_K) words a lane, two
     * of Q4_K or one of the others in flight where the lanes hold them in registers (three
     * blocks an SM for experts and, plain_lean, plain products without a tail: the
     * registers of eight Q4_0 blocks, without spills), four where tma reads them from
     * the block's tile; a row of at most one unit a lane keeps U = 1, so
     * that an expert product's rows per block, and its blocks, are Q4_0's */
    constexpr bool kK = Blk<TYPE>::WORDS > 9;
    const uint32_t nu = a.nb / Blk<TYPE>::XB;
    const uint32_t g = mvq::lanes_per_row(nu);
    const uint32_t per_lane = (nu + g - 1) / g;
    /* tma for a K type where a tile of up to 2 x 256 / g rows (the most
     * its forms take) fits go's 48 KiB */
    const bool st = jobs > 1 && tma_wanted(a, TYPE == QUANT_TYPE_Q6_K) &&
                    (static_cast<size_t>(a.nb) * 40 + 15) / 16 * 16 +
                            static_cast<size_t>(2 * (kThreads / g)) * a.row_bytes + 48 <=
                        48 * 1024;
    const int in_flight = !kK                     ? 8
                          : st                    ? 4
                          : Blk<TYPE>::WORDS > 16 ? 1
                                                  : 2;
    const int u = kK && (in_flight == 1 || (jobs > 1 && per_lane <= 1)) ? 1
                  : per_lane <= 2 || in_flight == 2                      ? 2
                  : per_lane <= 4 || in_flight == 4                      ? 4
                                                                         : 8;
    const uint64_t groups = static_cast<uint64_t>(a.n_rows) * jobs;
    const auto blocks = [&](int r) { return groups / ((kThreads / g) * r); };
    const uint64_t want = want_blocks();
    int r = in_flight / u;
    if (kK && u == 1 && r > 2) /* the U = 1 forms built: R 2 and 1 */
        r = 2;
    if (jobs > 1) {
        while (r > 1 && blocks(r) < want)
            r /= 2;
    } else { /* blocks loop over tiles: the largest tiles that still share out evenly */
        int best = r;
        double best_eff = 0.0;
        for (int rr = r; rr >= 1; rr /= 2) {
            const double t = static_cast<double>(blocks(rr) ? blocks(rr) : 1);
            const double waves =
                t < want ? 1.0 : static_cast<double>((blocks(rr) + want - 1) / want);
            const double eff = t < want ? 1.0 : t / (waves * want);
            if (eff > best_eff + 0.1) {
                best = rr;
                best_eff = eff;
            }
        }
        r = best;
    }
#define MVQ_GO(G)                                                                                  \
    switch (u * 8 + r) {                                                                           \
    case 2 * 8 + 4: return go<TYPE, G, 2, 4>(a, jobs, stream);                                     \
    case 2 * 8 + 2: return go<TYPE, G, 2, 2>(a, jobs, stream);                                     \
    case 2 * 8 + 1: return go<TYPE, G, 2, 1>(a, jobs, stream);                                     \
    case 4 * 8 + 2: return go<TYPE, G, 4, 2>(a, jobs, stream);                                     \
    case 4 * 8 + 1: return go<TYPE, G, 4, 1>(a, jobs, stream);                                     \
    default: return go<TYPE, G, 8, 1>(a, jobs, stream);                                            \
    }
/* K types: Q4_K's lanes hold units at U 1 (R 2, 1) and U 2 (R 1), Q5_K's and
 * Q6_K's at U 1 R 1; the other forms only by tma */
#define MVQ_GO4(G)                                                                                 \
    switch (u * 8 + r) {                                                                           \
    case 1 * 8 + 2:                                                                                \
        return go<TYPE, G, 1, 2, TYPE == QUANT_TYPE_Q4_K ? kExperts | kTma : kTma>(a, jobs,       \
                                                                                 stream);          \
    case 1 * 8 + 1: return go<TYPE, G, 1, 1>(a, jobs, stream);                                     \
    case 2 * 8 + 2: return go<TYPE, G, 2, 2, kTma>(a, jobs, stream);                               \
    case 2 * 8 + 1:                                                                                \
        return go<TYPE, G, 2, 1, TYPE == QUANT_TYPE_Q4_K ? kAll : kTma>(a, jobs, stream);         \
    default: return go<TYPE, G, 4, 1, kTma>(a, jobs, stream);                                      \
    }
    if constexpr (kK) { /* only the forms these units take */
        if (g == 32)
            MVQ_GO4(32);
        if (g == 16)
            MVQ_GO4(16);
        MVQ_GO4(8);
    } else {
        if (g == 32)
            MVQ_GO(32);
        if (g == 16)
            MVQ_GO(16);
        MVQ_GO(8);
    }
#undef MVQ_GO4
#undef MVQ_GO
}

int dispatch(uint32_t type, const MvqArgs &a, uint32_t jobs, cudaStream_t stream)
{
    switch (type) {
    case QUANT_TYPE_Q4_0: return pick<QUANT_TYPE_Q4_0>(a, jobs, stream);
    case QUANT_TYPE_Q8_0: return pick<QUANT_TYPE_Q8_0>(a, jobs, stream);
    case QUANT_TYPE_Q4_K: return pick<QUANT_TYPE_Q4_K>(a, jobs, stream);
    case QUANT_TYPE_Q5_K: return pick<QUANT_TYPE_Q5_K>(a, jobs, stream);
    case QUANT_TYPE_Q6_K: return pick<QUANT_TYPE_Q6_K>(a, jobs, stream);
    default: return -ENOTSUP;
    }
}

/* Whether the K-type forms (Q4_K, Q5_K, Q6_K) run: LAMINA_CUDA_MVQ_K=1 takes them,
 * =0 leaves those types to the f32 kernels, unset kKqDefault (read at each
 * call: tests compare both in one process). On by default since their first
 * GPU runs (docs/perf.md, forty-third session: an H100's tg128 on a Q4_K file
 * 383.5 tok/s against 272.6 on the f32 kernels). */
constexpr bool kKqDefault = true;

bool kq_on()
{
    const char *env = getenv("LAMINA_CUDA_MVQ_K");
    return env && env[0] ? env[0] == '1' : kKqDefault;
}

bool usable(uint32_t type, uint64_t n_rows, uint64_t n, const float *x, size_t ldx, size_t ldy,
            bool glu)
{
    return (type == QUANT_TYPE_Q4_0 || type == QUANT_TYPE_Q8_0 ||
            ((type == QUANT_TYPE_Q4_K || type == QUANT_TYPE_Q5_K || type == QUANT_TYPE_Q6_K) &&
             n % 256 == 0 && kq_on())) &&
           n % 32 == 0 && n > 0 && n <= kMaxN && n_rows > 0 && n_rows < (1u << 31) &&
           (reinterpret_cast<uintptr_t>(x) & 3) == 0 && ldx >= (glu ? 2 : 1) * n && ldy >= n_rows;
}

/* The arguments of a plain product of one activation row (ldx n, or 2n with
 * glu); false when these kernels do not take it. */
/* Bytes of its rows a plain product's block asks for in L2 before its PDL
 * wait: kPrefetch, or LAMINA_CUDA_ROW_PF_KB KiB (0 to 1024; measurements). */
static uint32_t row_prefetch_bytes()
{
    const char *env = getenv("LAMINA_CUDA_ROW_PF_KB");
    const long kb = env ? strtol(env, nullptr, 10) : -1;
    return kb >= 0 && kb <= 1024 ? static_cast<uint32_t>(kb * 1024) : kPrefetch;
}

bool plain_args(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows, uint64_t n,
                const float *d_x, bool glu, float *d_y, MvqArgs *a)
{
    if (!usable(type, n_rows, n, d_x, glu ? 2 * n : n, n_rows, glu) || !d_w || !d_y)
        return false;
    *a = MvqArgs{};
    a->w = static_cast<const uint8_t *>(d_w);
    a->pf_bytes_row = row_prefetch_bytes();
    a->row_bytes = row_bytes;
    a->n_rows = static_cast<uint32_t>(n_rows);
    a->n = static_cast<uint32_t>(n);
    a->nb = a->n / 32;
    a->x = d_x;
    a->ldx = glu ? 2 * n : n;
    a->x_div = 1;
    a->glu = glu;
    a->y = d_y;
    a->ldy = n_rows;
    return true;
}

/* The arguments of an expert product over n_pairs pairs; false when these
 * kernels do not take it. */
bool experts_args(uint32_t type, const void *const *d_addr, size_t row_bytes, uint64_t n_rows,
                  uint64_t n, const int32_t *d_ids, uint32_t n_pairs, const float *d_X,
                  size_t ldx, uint32_t x_div, bool glu, float *d_Y, size_t ldy, MvqArgs *a)
{
    if (!usable(type, n_rows, n, d_X, ldx, ldy, glu) || !d_addr || !d_ids || !d_Y || x_div == 0 ||
        n_pairs == 0 || n_pairs > 65535)
        return false;
    *a = MvqArgs{};
    a->addr = d_addr;
    a->ids = d_ids;
    a->row_bytes = row_bytes;
    a->n_rows = static_cast<uint32_t>(n_rows);
    a->n = static_cast<uint32_t>(n);
    a->nb = a->n / 32;
    a->x = d_X;
    a->ldx = ldx;
    a->x_div = x_div;
    a->glu = glu;
    a->y = d_Y;
    a->ldy = ldy;
    return true;
}

/* Whether an expert product's tail t (NULL or NONE: none) may follow n_pairs pairs of n_rows
 * outputs at Y: a combine; COMBINE_COLS may have the shared expert as pair k, its output row
 * k. Logs why not. */
bool experts_tail_ok(const struct cuda_tail *t, uint32_t n_pairs, uint64_t n_rows,
                     const float *d_Y)
{
    if (!t || t->kind == CUDA_TAIL_NONE)
        return true;
    const bool cols = t->kind == CUDA_TAIL_COMBINE_COLS;
    const bool pairs_ok =
        t->k == n_pairs || (cols && t->k + 1 == n_pairs && t->so == d_Y + t->k * n_rows);
    if ((t->kind == CUDA_TAIL_COMBINE || cols) && t->n == n_rows && pairs_ok &&
        cuda_tail_ok(t, n_rows))
        return true;
    log_error("cuda mvq experts: a tail of kind %d does not follow %u pairs of %llu rows",
              static_cast<int>(t->kind), n_pairs, static_cast<unsigned long long>(n_rows));
    return false;
}

} /* namespace */

/* cuda_mvq with a tail (matvec.cu's cuda_matvec_tail; t checked there). */
extern "C" int cuda_mvq_tail(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                             uint64_t n, const float *d_x, float *d_y, const struct cuda_tail *t,
                             cudaStream_t stream)
{
    MvqArgs a;
    if (!plain_args(type, d_w, row_bytes, n_rows, n, d_x, false, d_y, &a))
        return -ENOTSUP;
    a.tail = tail_args(t, d_y, n_rows);
    return dispatch(type, a, 1, stream);
}

extern "C" bool cuda_mvq_norm_ok(uint32_t type, uint64_t n_rows, uint64_t n)
{
    return usable(type, n_rows, n, nullptr, n, n_rows, false) &&
           cuda_norm_wide_threads(static_cast<uint32_t>(n)) <= kTailVirtual * kThreads;
}

extern "C" int cuda_mvq_norm(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                             uint64_t n, const float *d_h, const float *d_norm_w, float eps,
                             float *d_y, cudaStream_t stream)
{
    MvqArgs a;
    if (!cuda_mvq_norm_ok(type, n_rows, n) ||
        !plain_args(type, d_w, row_bytes, n_rows, n, d_h, false, d_y, &a))
        return -ENOTSUP;
    a.nin_w = d_norm_w;
    a.nin_eps = eps;
    a.nin_width = cuda_norm_wide_threads(static_cast<uint32_t>(n));
    return dispatch(type, a, 1, stream);
}

extern "C" bool cuda_mvq_xq_ok(uint32_t type, uint64_t n_rows, uint64_t n)
{
    return usable(type, n_rows, n, nullptr, n, n_rows, false);
}

/* A plain product's arguments over a rounded input d_xq (16-byte aligned): false where it
 * cannot take them. */
static bool xq_args(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                    uint64_t n, const int8_t *d_xq, float *d_y, MvqArgs *a)
{
    if (!d_xq || reinterpret_cast<uintptr_t>(d_xq) % 16 ||
        !plain_args(type, d_w, row_bytes, n_rows, n, reinterpret_cast<const float *>(d_xq),
                    false, d_y, a))
        return false;
    a->xq = d_xq;
    return true;
}

extern "C" int cuda_mvq_xq_tail(uint32_t type, const void *d_w, size_t row_bytes,
                                uint64_t n_rows, uint64_t n, const int8_t *d_xq, float *d_y,
                                const struct cuda_tail *t, cudaStream_t stream)
{
    MvqArgs a;
    if (!xq_args(type, d_w, row_bytes, n_rows, n, d_xq, d_y, &a))
        return -ENOTSUP;
    if (!cuda_tail_plain_ok(t, n_rows, "cuda mvq xq"))
        return -EINVAL;
    a.tail = tail_args(t, d_y, n_rows);
    return dispatch(type, a, 1, stream);
}

/* Whether a product launched beside the one before it (cuda_mvq_xq_beside) computes before
 * its wait: LAMINA_CUDA_BESIDE=0 keeps the wait first (the same bits). Read at each launch. */
static bool beside_on()
{
    const char *env = getenv("LAMINA_CUDA_BESIDE");
    return !(env && env[0] == '0');
}

extern "C" int cuda_mvq_xq_beside(uint32_t type, const void *d_w, size_t row_bytes,
                                  uint64_t n_rows, uint64_t n, const int8_t *d_xq, float *d_y,
                                  cudaStream_t stream)
{
    MvqArgs a;
    if (!cuda_mvq_pays(n, n_rows) || !xq_args(type, d_w, row_bytes, n_rows, n, d_xq, d_y, &a))
        return -ENOTSUP;
    a.beside = beside_on();
    return dispatch(type, a, 1, stream);
}

extern "C" size_t cuda_mvq_router_part_floats(uint64_t n_rows, uint32_t E)
{
    /* tiles of kRtMinRows rows or more (pick_rt), whole clusters */
    const uint64_t tiles = (n_rows + kRtMinRows - 1) / kRtMinRows;
    return static_cast<size_t>((tiles + kRtCluster - 1) / kRtCluster) * E;
}

extern "C" bool cuda_mvq_router_ok(uint32_t type, uint64_t n_rows, uint64_t n, uint32_t E,
                                   size_t r_row_bytes)
{
    const uint32_t nb = static_cast<uint32_t>(n / 32);
    const int rpt = mvq::lanes_per_row(nb) == 8 ? 32 : kRtMinRows; /* pick_rt's tiles */
    MvqArgs a = MvqArgs{}; /* the dry run's: the form, its shared memory */
    a.n_rows = static_cast<uint32_t>(n_rows);
    a.nb = nb;
    a.rt_e = E;
    return device_sm90() && cuda_mvq_xq_ok(type, n_rows, n) &&
           nb <= 4 * mvq::lanes_per_row(nb) &&
           (static_cast<size_t>(nb) * 40 + 15) / 16 * 16 + rt_cols_bytes(E, rpt) <= 48 * 1024 &&
           n_rows <= kRtMaxN && E >= static_cast<uint32_t>(kRtCluster) &&
           E <= kRtMaxE && E <= ROUTER_MAX_E && E % kRtCluster == 0 &&
           cuda_matvec_norm_in_ok(QUANT_TYPE_F32, E, n_rows, r_row_bytes) &&
           cuda_norm_threads(static_cast<uint32_t>(n_rows)) <= kThreads &&
           (n_rows + cuda_norm_threads(static_cast<uint32_t>(n_rows)) - 1) /
                   cuda_norm_threads(static_cast<uint32_t>(n_rows)) <=
               static_cast<uint64_t>(kRtCols) &&
           cuda_norm_wide_threads(static_cast<uint32_t>(n_rows)) <= 1024 &&
           dispatch_rt(type, a, nullptr, true) == 0;
}

extern "C" int cuda_mvq_xq_router(uint32_t type, const void *d_w, size_t row_bytes,
                                  uint64_t n_rows, uint64_t n, const int8_t *d_xq, float *d_y,
                                  const void *d_rw, size_t r_row_bytes, const float *d_rwt,
                                  uint32_t E, const struct cuda_norm_in *nin, float *d_xout,
                                  int8_t *d_xq_out, float *d_logits, float *d_part,
                                  size_t part_floats, const struct cuda_tail *t,
                                  cudaStream_t stream)
{
    const char *what = "cuda mvq_xq_router";
    MvqArgs a;
    if (!cuda_mvq_router_ok(type, n_rows, n, E, r_row_bytes) || !d_rw ||
        reinterpret_cast<uintptr_t>(d_rw) % 16 || reinterpret_cast<uintptr_t>(d_rwt) % 16 ||
        !xq_args(type, d_w, row_bytes, n_rows, n, d_xq, d_y, &a))
        return -ENOTSUP;
    if (!t || t->kind != CUDA_TAIL_TOPK || !cuda_tail_ok(t, E) || !t->counter || !t->ids ||
        !t->w || t->k > E) {
        log_error("%s: the top-k tail is missing or bad", what);
        return -EINVAL;
    }
    if (!nin || !nin->h || nin->add != d_y || !d_logits || !d_part ||
        part_floats < cuda_mvq_router_part_floats(n_rows, E) || !nin->gate != !nin->gs ||
        (reinterpret_cast<uintptr_t>(nin->h) | reinterpret_cast<uintptr_t>(d_xout) |
         reinterpret_cast<uintptr_t>(d_logits) | reinterpret_cast<uintptr_t>(d_part) |
         reinterpret_cast<uintptr_t>(nin->gate) | reinterpret_cast<uintptr_t>(nin->gs)) & 3 ||
        reinterpret_cast<uintptr_t>(d_xq_out) % 16) {
        log_error("%s: bad buffers (h %p add %p y %p out %p logits %p part %p (%zu floats) "
                  "gate %p gs %p)",
                  what, nin ? static_cast<const void *>(nin->h) : nullptr,
                  nin ? static_cast<const void *>(nin->add) : nullptr, static_cast<void *>(d_y),
                  static_cast<void *>(d_xout), static_cast<void *>(d_logits),
                  static_cast<void *>(d_part), part_floats,
                  nin ? static_cast<const void *>(nin->gate) : nullptr,
                  nin ? static_cast<void *>(nin->gs) : nullptr);
        return -EINVAL;
    }
    a.tail = tail_args(t, d_logits, E);
    a.rt_w = static_cast<const float *>(d_rw);
    a.rt_ld = r_row_bytes / sizeof(float);
    a.rt_wt = d_rwt;
    a.rt_e = E;
    a.rt_h = nin->h;
    a.rt_g = nin->w;
    a.rt_eps = nin->eps;
    a.rt_width = cuda_norm_threads(static_cast<uint32_t>(n_rows));
    a.rt_gate = nin->gate;
    a.rt_gs = nin->gs;
    a.rt_gate_width = cuda_norm_wide_threads(static_cast<uint32_t>(n_rows));
    a.rt_xa = d_xout;
    a.rt_xq = d_xq_out;
    a.rt_logits = d_logits;
    a.rt_part = d_part;
    const char *skip = getenv("LAMINA_CUDA_RT_SKIP"); /* timing experiments only */
    a.rt_skip = skip ? static_cast<uint32_t>(strtoul(skip, nullptr, 0)) & 127u : 0u;
    return dispatch_rt(type, a, stream, false);
}

extern "C" int cuda_mvq_xq(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                           uint64_t n, const int8_t *d_xq, float *d_y, cudaStream_t stream)
{
    if (!cuda_mvq_pays(n, n_rows))
        return -ENOTSUP;
    return cuda_mvq_xq_tail(type, d_w, row_bytes, n_rows, n, d_xq, d_y, NULL, stream);
}

extern "C" bool cuda_mvq_last_tma(void)
{
    return last_tma;
}

extern "C" void cuda_mvq_probe_next(unsigned long long *p)
{
    next_probe = p;
}

extern "C" bool cuda_mvq_probe_built(void)
{
#ifdef LAMINA_MVQ_PROBE
    return true;
#else
    return false;
#endif
}

extern "C" size_t cuda_mvq_xq_bytes(uint64_t n)
{
    return mvq::xq_row_bytes(n);
}

extern "C" int cuda_mvq(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                        uint64_t n, const float *d_x, float *d_y, cudaStream_t stream)
{
    return cuda_mvq_glu(type, d_w, row_bytes, n_rows, n, d_x, false, d_y, stream);
}

extern "C" int cuda_mvq_glu(uint32_t type, const void *d_w, size_t row_bytes, uint64_t n_rows,
                            uint64_t n, const float *d_x, bool glu, float *d_y,
                            cudaStream_t stream)
{
    MvqArgs a;
    if (!plain_args(type, d_w, row_bytes, n_rows, n, d_x, glu, d_y, &a))
        return -ENOTSUP;
    return dispatch(type, a, 1, stream);
}

extern "C" int cuda_mvq_experts(uint32_t type, const void *const *d_addr, size_t row_bytes,
                                uint64_t n_rows, uint64_t n, const int32_t *d_ids,
                                uint32_t n_pairs, const float *d_X, size_t ldx, uint32_t x_div,
                                float *d_Y, size_t ldy, cudaStream_t stream)
{
    return cuda_mvq_experts_glu(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs, d_X, ldx,
                                x_div, false, d_Y, ldy, stream);
}

extern "C" int cuda_mvq_experts_glu(uint32_t type, const void *const *d_addr, size_t row_bytes,
                                    uint64_t n_rows, uint64_t n, const int32_t *d_ids,
                                    uint32_t n_pairs, const float *d_X, size_t ldx,
                                    uint32_t x_div, bool glu, float *d_Y, size_t ldy,
                                    cudaStream_t stream)
{
    MvqArgs a;
    if (!experts_args(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs, d_X, ldx, x_div, glu,
                      d_Y, ldy, &a))
        return -ENOTSUP;
    return dispatch(type, a, n_pairs, stream);
}

extern "C" int cuda_mvq_experts_glu_tail(uint32_t type, const void *const *d_addr,
                                         size_t row_bytes, uint64_t n_rows, uint64_t n,
                                         const int32_t *d_ids, uint32_t n_early,
                                         uint32_t n_pairs, const float *d_X,
                                         size_t ldx, bool glu, float *d_Y,
                                         const struct cuda_tail *t, cudaStream_t stream)
{
    MvqArgs a;
    if (!experts_args(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs, d_X, ldx, 1, glu, d_Y,
                      n_rows, &a))
        return -ENOTSUP;
    if (!experts_tail_ok(t, n_pairs, n_rows, d_Y))
        return -EINVAL;
    a.tail = tail_args(t, d_Y, n_rows);
    a.early = n_early > 0;
    a.n_table = n_early;
    return dispatch(type, a, n_pairs, stream);
}

extern "C" int cuda_mvq_experts_prefetch(uint32_t type, const void *const *d_addr,
                                         size_t row_bytes, uint64_t n_rows, uint64_t n,
                                         const int32_t *d_ids, uint32_t n_pairs, const float *d_X,
                                         size_t ldx, uint32_t x_div, float *d_Y, size_t ldy,
                                         const void *const *d_next_addr, size_t next_bytes,
                                         uint32_t n_table, bool x_early, const int8_t *d_xq,
                                         bool ids_poll, bool pf_after, cudaStream_t stream)
{
    return cuda_mvq_experts_prefetch_gq(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs, d_X,
                                        ldx, x_div, d_Y, ldy, d_next_addr, next_bytes, n_table,
                                        x_early, d_xq, ids_poll, pf_after, NULL, stream);
}

extern "C" int cuda_mvq_experts_prefetch_gq(uint32_t type, const void *const *d_addr,
                                            size_t row_bytes, uint64_t n_rows, uint64_t n,
                                            const int32_t *d_ids, uint32_t n_pairs,
                                            const float *d_X, size_t ldx, uint32_t x_div,
                                            float *d_Y, size_t ldy,
                                            const void *const *d_next_addr, size_t next_bytes,
                                            uint32_t n_table, bool x_early, const int8_t *d_xq,
                                            bool ids_poll, bool pf_after, int8_t *d_gq,
                                            cudaStream_t stream)
{
    if (d_gq && (n_rows % 64 || reinterpret_cast<uintptr_t>(d_gq) % 16 || !device_sm90()))
        return -ENOTSUP;
    MvqArgs a;
    if (d_xq && (reinterpret_cast<uintptr_t>(d_xq) % 16 || n_pairs > x_div))
        return -ENOTSUP; /* one activation row, rounded */
    if (!experts_args(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs, d_X, ldx, x_div, false,
                      d_Y, ldy, &a))
        return -ENOTSUP;
    a.xq = d_xq;
    a.pf_addr = d_next_addr;
    a.pf_bytes = d_next_addr ? next_bytes : 0;
    a.pf_after = pf_after;
    a.n_table = n_table;
    a.x_early = x_early;
    a.ids_poll = ids_poll && n_table;
    a.gq = d_gq;
    a.gq_ld = d_gq ? mvq::xq_row_bytes(n_rows / 2) : 0;
    a.gq_half = static_cast<uint32_t>(n_rows / 64);
    return dispatch(type, a, n_pairs, stream);
}

extern "C" int cuda_mvq_experts_xq_tail(uint32_t type, const void *const *d_addr,
                                        size_t row_bytes, uint64_t n_rows, uint64_t n,
                                        const int32_t *d_ids, uint32_t n_early, uint32_t n_pairs,
                                        const int8_t *d_xq, float *d_Y,
                                        const struct cuda_tail *t, cudaStream_t stream)
{
    if (!d_xq || reinterpret_cast<uintptr_t>(d_xq) % 16)
        return -ENOTSUP;
    MvqArgs a;
    /* x is not read: the rounded rows stand in for it (usable's checks of ldx) */
    if (!experts_args(type, d_addr, row_bytes, n_rows, n, d_ids, n_pairs,
                      reinterpret_cast<const float *>(d_xq), n, 1, false, d_Y, n_rows, &a))
        return -ENOTSUP;
    if (!experts_tail_ok(t, n_pairs, n_rows, d_Y))
        return -EINVAL;
    a.xq = d_xq;
    a.xq_ld = mvq::xq_row_bytes(n);
    a.tail = tail_args(t, d_Y, n_rows);
    a.early = n_early > 0;
    a.n_table = n_early;
    return dispatch(type, a, n_pairs, stream);
}

extern "C" bool cuda_mvq_k_on(void)
{
    return kq_on();
}
