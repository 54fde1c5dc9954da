/*
 * tail.cuh: the device side of cuda tails (tail.h): what the last block of
 * a product launch runs. Private to the .cu files of kernels/cuda.
 *
 * The product kernels (matvec.cu's mv_kernel, mvq.cu's mvq_kernel) are
 * blocks of kTailThreads threads; each calls tail_finish once at its end,
 * with every thread, after its last store of y.
 *
 * Bit-exactness: the stand-alone kernels are one block per row of W threads
 * (cuda_norm_threads(n) for the residual norm, cuda_norm_wide_threads(n) for
 * the combine), thread v owning columns v, v + W, ... and summing them in
 * order, the block adding the per-thread sums with ops_block_sum (warp
 * butterflies, then one butterfly over the warp sums). Here thread t plays
 * virtual threads t, t + 256, ... < W: the same per-thread sums, each
 * virtual warp's sum by the same butterfly, the same final butterfly over
 * the W / 32 warp sums. Element-wise work uses the stand-alone kernels'
 * expressions (explicit __fadd_rn / __fmul_rn where they have them), so
 * the outputs are the same bits.
 */
#ifndef KERNELS_CUDA_TAIL_CUH
#define KERNELS_CUDA_TAIL_CUH

#include "kernels/cuda/ops.h"
#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/router.cuh"
#include "kernels/cuda/tail.h"

constexpr int kTailThreads = 256;
constexpr int kTailVirtual = 1024 / kTailThreads; /* virtual threads a thread plays, at most */

/* What a product kernel carries: the caller's tail, the product's output and
 * the emulated block width (TOPK: the logit count). */
struct TailArgs {
    struct cuda_tail t;
    const float *y;
    uint32_t width;
    uint32_t rows_per_tile; /* COMBINE_COLS: the product's row tiles (set by the */
    uint32_t n_tiles;       /* launcher): grid column x holds tiles x, x + grid.x, ... */
};

/* Host: the TailArgs of a launch (kind NONE when t is NULL). */
static inline TailArgs tail_args(const struct cuda_tail *t, const float *y, uint64_t n_out)
{
    TailArgs a = {};
    if (!t || t->kind == CUDA_TAIL_NONE)
        return a;
    a.t = *t;
    a.y = y;
    switch (t->kind) {
    case CUDA_TAIL_ADD_NORM: a.width = cuda_norm_threads(t->n); break;
    case CUDA_TAIL_COMBINE:
    case CUDA_TAIL_COMBINE_COLS: a.width = cuda_norm_wide_threads(t->n); break;
    default: a.width = static_cast<uint32_t>(n_out); break;
    }
    return a;
}

/* ops_block_sum over a block of `width` virtual threads (a multiple of 32,
 * at most 1024) whose sums are part[m] of thread threadIdx.x - THREADS m
 * (THREADS: the calling block's width, a multiple of 32). */
template <int M, int THREADS = kTailThreads>
static __device__ __forceinline__ float tail_vsum(const float (&part)[M], uint32_t width,
                                                  float *s_tmp)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float v = ops_warp_sum(part[m]);
        const uint32_t vw = static_cast<uint32_t>(warp + m * (THREADS / 32));
        if (lane == 0 && vw < width / 32)
            s_tmp[vw] = v;
    }
    __syncthreads();
    float v = static_cast<uint32_t>(lane) < width / 32 ? s_tmp[lane] : 0.0f;
    v = ops_warp_sum(v);
    __syncthreads();
    return v;
}

/* A residual add + norm's scale over a row of n formed by a block as cuda_add_rmsnorm's
 * threads form it (norm_rows_kernel<true>): thread t (< width) owns columns t, t + width,
 * ... (at most COLS), adds dv[b] into hv[b] in place, sums the squares in that order and
 * the block's sums by ops_block_sum's tree (tail_vsum); returns 1 / sqrt(mean + eps). Every
 * thread of the block calls it (matvec.cu's norm-in rows, mvq.cu's router in the output
 * product: the same bits). */
template <int COLS>
static __device__ __forceinline__ float tail_add_norm_scale(float (&hv)[COLS],
                                                            const float (&dv)[COLS], uint32_t n,
                                                            uint32_t width, float eps,
                                                            float *s_red)
{
    const uint32_t v0 = threadIdx.x;
    float part[1] = {0.0f};
#pragma unroll
    for (int b = 0; b < COLS; b++) {
        const uint32_t i = v0 + b * width;
        if (v0 < width && i < n) {
            float v = hv[b];
            v += dv[b];
            hv[b] = v;
            part[0] += v * v;
        }
    }
    const float sum = tail_vsum<1>(part, width, s_red);
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* Loads in flight per thread in the residual norm's column loops (more
 * spill registers in the 64-register f32-activation products). */
constexpr int kTailBatch = 4;

/* cuda_add_rmsnorm of one row (norm.cu's norm_rows_kernel<true>). A thread's
 * columns are visited in the stand-alone kernel's order; their loads go out
 * kTailBatch at a time. */
static __device__ __forceinline__ void tail_add_norm(const TailArgs &a)
{
    __shared__ float s_tmp[32];
    const uint32_t width = a.width, n = a.t.n, v0 = threadIdx.x;
    float *h = a.t.h;
    float part[1] = {0.0f};
    if (v0 < width)
        for (uint32_t i0 = v0; i0 < n; i0 += kTailBatch * width) {
            float hv[kTailBatch], dv[kTailBatch];
#pragma unroll
            for (int b = 0; b < kTailBatch; b++) {
                const uint32_t i = i0 + b * width;
                hv[b] = i < n ? h[i] : 0.0f;
                dv[b] = i < n ? __ldcg(a.y + i) : 0.0f;
            }
#pragma unroll
            for (int b = 0; b < kTailBatch; b++) {
                const uint32_t i = i0 + b * width;
                if (i < n) {
                    float v = hv[b];
                    v += dv[b];
                    h[i] = v;
                    part[0] += v * v;
                }
            }
        }
    const float sum = tail_vsum<1>(part, width, s_tmp);
    const float scale = 1.0f / sqrtf(sum / (float)n + a.t.eps);
    if (v0 < width)
        for (uint32_t i0 = v0; i0 < n; i0 += kTailBatch * width) {
            float hv[kTailBatch], wv[kTailBatch];
#pragma unroll
            for (int b = 0; b < kTailBatch; b++) {
                const uint32_t i = i0 + b * width;
                hv[b] = i < n ? h[i] : 0.0f;
                wv[b] = i < n && a.t.norm_w ? a.t.norm_w[i] : 1.0f;
            }
#pragma unroll
            for (int b = 0; b < kTailBatch; b++) {
                const uint32_t i = i0 + b * width;
                if (i < n) {
                    const float v = hv[b] * scale;
                    a.t.out[i] = a.t.norm_w ? v * wv[b] : v;
                }
            }
        }
}

/* cuda_moe_combine(_norm) of one token (combine.cu's
 * moe_combine_norm_kernel; k <= 16). Virtual thread v = threadIdx.x + 256 m
 * owns columns v, v + width, ...: round t takes column v + t * width of
 * every m at once (their loads in flight together), so each virtual
 * thread's sums still run over its columns in order. */
/* The combine's shared-expert gate sigmoid(shexp_gate . f) (1 without a
 * gate or shared expert), the dot product in the combine kernel's tree;
 * every thread of the block (THREADS of them) calls it. */
template <int THREADS = kTailThreads>
static __device__ __forceinline__ float tail_gate(const TailArgs &a, float *s_tmp)
{
    constexpr int M = 1024 / THREADS; /* virtual threads a thread plays */
    const uint32_t width = a.width, n = a.t.n;
    const float *gate = a.t.shexp_gate, *f = a.t.f;
    if (!a.t.so || !gate)
        return 1.0f;
    const uint32_t rounds = (n + width - 1) / width;
    float part[M];
#pragma unroll
    for (int m = 0; m < M; m++)
        part[m] = 0.0f;
    for (uint32_t t = 0; t < rounds; t++) {
        float gv[M], fv[M];
#pragma unroll
        for (int m = 0; m < M; m++) {
            const uint32_t v = threadIdx.x + m * THREADS, j = v + t * width;
            const bool in = v < width && j < n;
            gv[m] = in ? gate[j] : 0.0f;
            fv[m] = in ? __ldcg(f + j) : 0.0f; /* L2: maybe before the PDL wait */
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
            const uint32_t v = threadIdx.x + m * THREADS, j = v + t * width;
            if (v < width && j < n)
                part[m] += gv[m] * fv[m];
        }
    }
    const float d = tail_vsum<M, THREADS>(part, width, s_tmp);
    return 1.0f / (1.0f + expf(-d));
}

static __device__ __forceinline__ void tail_combine(const TailArgs &a)
{
    __shared__ float s_tmp[32];
    const uint32_t width = a.width, n = a.t.n, k = a.t.k;
    const float *Y = a.y, *so = a.t.so;
    float *h = a.t.h;
    const uint32_t rounds = (n + width - 1) / width;
    float wv[16];
#pragma unroll
    for (int i = 0; i < 16; i++)
        wv[i] = static_cast<uint32_t>(i) < k ? a.t.w[i] : 0.0f;
    float part[kTailVirtual];
    const float gs = tail_gate(a, s_tmp);
#pragma unroll
    for (int m = 0; m < kTailVirtual; m++)
        part[m] = 0.0f;
    for (uint32_t t = 0; t < rounds; t++) {
        /* two virtual threads' columns at a time: 2 x (k + 2) loads in flight */
#pragma unroll
        for (int m0 = 0; m0 < kTailVirtual; m0 += 2) {
            float yv[2][16], hv[2], sv[2];
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const uint32_t v = threadIdx.x + (m0 + c) * kTailThreads, j = v + t * width;
                const bool in = v < width && j < n;
#pragma unroll
                for (int i = 0; i < 16; i++)
                    yv[c][i] = in && static_cast<uint32_t>(i) < k
                                   ? __ldcg(Y + static_cast<size_t>(i) * n + j)
                                   : 0.0f;
                hv[c] = in ? h[j] : 0.0f;
                sv[c] = in && so ? so[j] : 0.0f;
            }
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const uint32_t v = threadIdx.x + (m0 + c) * kTailThreads, j = v + t * width;
                if (v >= width || j >= n)
                    continue;
                float out = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; i++)
                    if (static_cast<uint32_t>(i) < k)
                        out = __fadd_rn(out, __fmul_rn(wv[i], yv[c][i]));
                if (so)
                    out = __fadd_rn(out, __fmul_rn(gs, sv[c]));
                const float hj = __fadd_rn(hv[c], out);
                h[j] = hj;
                part[m0 + c] += hj * hj;
            }
        }
    }
    if (!a.t.norm_w)
        return;
    const float sum = tail_vsum<kTailVirtual>(part, width, s_tmp);
    const float scale = 1.0f / sqrtf(sum / (float)n + a.t.eps);
    for (uint32_t t = 0; t < rounds; t++) {
        float hv[kTailVirtual], nv[kTailVirtual];
#pragma unroll
        for (int m = 0; m < kTailVirtual; m++) {
            const uint32_t v = threadIdx.x + m * kTailThreads, j = v + t * width;
            const bool in = v < width && j < n;
            hv[m] = in ? h[j] : 0.0f;
            nv[m] = in ? a.t.norm_w[j] : 0.0f;
        }
#pragma unroll
        for (int m = 0; m < kTailVirtual; m++) {
            const uint32_t v = threadIdx.x + m * kTailThreads, j = v + t * width;
            if (v < width && j < n)
                a.t.out[j] = (hv[m] * scale) * nv[m];
        }
    }
}

/* The combine of the rows of grid column blockIdx.x (COMBINE_COLS), after
 * every pair of its tiles is done: column j of h gets the combine kernel's
 * sum for j, the same bits (the expert rows in order, then the gated shared
 * expert, then the residual add). Its loads (k + 2 a row) go out together. */
static __device__ __forceinline__ void tail_combine_cols(const TailArgs &a, float gs_early,
                                                         bool have_gs)
{
    __shared__ float s_tmp[32];
    const uint32_t n = a.t.n, k = a.t.k, rpt = a.rows_per_tile;
    const float *Y = a.y, *so = a.t.so;
    float *h = a.t.h;
    const float gs = have_gs ? gs_early : tail_gate(a, s_tmp);
    for (uint32_t tile = blockIdx.x; tile < a.n_tiles; tile += gridDim.x) {
        const uint32_t r1 = (tile + 1) * rpt < n ? (tile + 1) * rpt : n;
        for (uint32_t j = tile * rpt + threadIdx.x; j < r1; j += blockDim.x) {
            float yv[16];
#pragma unroll
            for (int i = 0; i < 16; i++)
                yv[i] = static_cast<uint32_t>(i) < k
                            ? __ldcg(Y + static_cast<size_t>(i) * n + j)
                            : 0.0f;
            const float sv = so ? __ldcg(so + j) : 0.0f, hv = h[j];
            float out = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; i++)
                if (static_cast<uint32_t>(i) < k)
                    out = __fadd_rn(out, __fmul_rn(a.t.w[i], yv[i]));
            if (so)
                out = __fadd_rn(out, __fmul_rn(gs, sv));
            h[j] = __fadd_rn(hv, out);
        }
    }
}

/* cuda_router_topk of one token (router.cu's kernel): its first warp. */
static __device__ __forceinline__ void tail_topk(const TailArgs &a)
{
    __shared__ uint64_t s_pick[32];
    if (threadIdx.x < 32)
        router_topk_warp(a.y, a.width, a.t.k, a.t.ids, a.t.w, s_pick, a.t.topk_rounds, nullptr,
                         a.t.topk_softmax);
}

/* The mark a TOPK tail leaves in the ids it is about to pick (tail.h's
 * mark_ids; mvq.cu's ids_poll waits for it to go). */
constexpr int32_t kIdsMark = INT32_MIN;

/* Called by every thread of the product between its PDL wait and trigger:
 * a TOPK tail's mark in the ids (tail.h's mark_ids), by block 0, before the
 * next launch may start. */
static __device__ __forceinline__ void tail_mark_ids(const TailArgs &a)
{
    if (a.t.kind != CUDA_TAIL_TOPK || !a.t.mark_ids || blockIdx.x || blockIdx.y || blockIdx.z)
        return;
    if (threadIdx.x < a.t.k)
        asm volatile("st.relaxed.gpu.global.s32 [%0], %1;" ::"l"(a.t.ids + threadIdx.x),
                     "r"(kIdsMark)
                     : "memory");
    __syncthreads();
}

/* Called by every thread of the product before its PDL wait: block 0's
 * first thread asks for the tail's weight vectors in L2 (they are read
 * after the whole product, by one block). */
static __device__ __forceinline__ void tail_prefetch(const TailArgs &a)
{
    if (a.t.kind == CUDA_TAIL_NONE || blockIdx.x || blockIdx.y || threadIdx.x)
        return;
    if ((a.t.kind == CUDA_TAIL_ADD_NORM || a.t.kind == CUDA_TAIL_COMBINE) && a.t.norm_w)
        pdl_prefetch_l2(a.t.norm_w, a.t.n * sizeof(float));
    if ((a.t.kind == CUDA_TAIL_COMBINE || a.t.kind == CUDA_TAIL_COMBINE_COLS) &&
        a.t.shexp_gate)
        pdl_prefetch_l2(a.t.shexp_gate, a.t.n * sizeof(float));
}

/* Called by every thread of every block of the product at its end: the
 * block that completes the launch runs the tail. COMBINE: whether the
 * kernel may carry a combine tail (its registers; matvec.cu's f32
 * products never do). have_gs: gs is tail_gate's value, computed before
 * (COMBINE_COLS). */
template <bool COMBINE>
static __device__ __forceinline__ void tail_finish(const TailArgs &a, float gs = 1.0f,
                                                   bool have_gs = false)
{
    if (a.t.kind == CUDA_TAIL_NONE)
        return;
    __shared__ unsigned int s_last;
    __threadfence(); /* this thread's outputs before the block's arrival */
    __syncthreads();
    if (threadIdx.x == 0) {
        /* COMBINE_COLS: a counter per grid column, whose blocks are the pairs */
        const bool cols = a.t.kind == CUDA_TAIL_COMBINE_COLS;
        unsigned int *ctr = cols ? a.t.counter + blockIdx.x : a.t.counter;
        const unsigned int total = cols ? gridDim.y : gridDim.x * gridDim.y * gridDim.z;
        s_last = atomicAdd(ctr, 1u) + 1u == total;
        if (s_last)
            *ctr = 0; /* every block has arrived: ready for the next launch */
    }
    __syncthreads();
    if (!s_last)
        return;
    __threadfence(); /* the other blocks' outputs, seen through L2 (__ldcg) */
    switch (a.t.kind) {
    case CUDA_TAIL_ADD_NORM: tail_add_norm(a); break;
    case CUDA_TAIL_TOPK: tail_topk(a); break;
    case CUDA_TAIL_COMBINE:
        if constexpr (COMBINE)
            tail_combine(a);
        break;
    case CUDA_TAIL_COMBINE_COLS:
        if constexpr (COMBINE)
            tail_combine_cols(a, gs, have_gs);
        break;
    default: break;
    }
}

#endif
