/*
 * combine: the glue of the MoE feed-forward on the GPU: the SiLU-gated
 * product of gate|up rows (twin: the loop in fw_shared_expert) and the
 * weighted sum of expert outputs plus the gated shared expert into the
 * residual (twin: fw_moe_combine followed by the residual add, both in
 * worker/forward.c).
 *
 * silu_mul: act[r][j] = silu(gu[r][j]) * gu[r][F + j], silu(x) = x / (1 + expf(-x));
 * rows of 2F in, F out, f32. One thread per output, grid-stride.
 *
 * moe_combine, per token s < S and column j < n:
 *   out = sum_{i<k, ascending} w[s*k + i] * Y[(s*k + i)*n + j]
 *       + sigmoid(shexp_gate . f[s]) * so[s*n + j]      (when so; gate 1 without shexp_gate)
 *   h[s*n + j] += out
 * One block per token, cuda_norm_wide_threads(n) threads striding over the
 * columns; the decode's early form (cuda_moe_combine_early) on sm_90 runs
 * those threads as a thread block cluster of 2 to 8 blocks per token
 * (moe_combine_cluster_kernel: the same bits, its loads over several SMs;
 * 2 % more decode tokens a second on an H200, LAMINA_CUDA_COMBINE_CLUSTER=0
 * takes it back); with the next norm either form can also write that
 * norm's output rounded to int8 per block of 32 as the int8 decode products
 * round their activations (xq, mvq.cuh's round_block on the values it
 * stores in y; a warp's 32 columns are one block), so that the next layer's
 * input product copies it instead of rounding y in each of its blocks (an
 * H200's 80b-a3b decode, one block a token: 7.2 us a layer with xq, 5.8
 * without, the input product then 4.9 against 8.5). Products and sums
 * are rounded separately (__fmul_rn / __fadd_rn, no FMA) in the CPU's order,
 * so without the shared-expert gate the result is bit-identical to the
 * CPU's; the gate's dot product is a fixed block tree, so it differs from
 * the CPU's serial sum by a few ulp.
 */
#include "kernels/cuda/ops.h"

#include <stdlib.h>

#include <cooperative_groups.h>

#include "kernels/cuda/mvq.cuh"
#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"

static __global__ void silu_mul_kernel(const float *gu, uint32_t F, uint32_t rows, float *act)
{
    pdl_wait();
    pdl_trigger();
    const size_t total = (size_t)rows * F;
    const size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
        const size_t r = idx / F, j = idx % F;
        const float g = gu[r * 2 * F + j], u = gu[r * 2 * F + F + j];
        act[idx] = __fmul_rn(g / (1.0f + expf(-g)), u);
    }
}

/* moe_combine for row blockIdx.x, and with NORM the next layer's RMSNorm of
 * h into y. The two launchers run this one kernel with the same block width
 * (combine_threads), so h is the same bit for bit with and without the
 * norm, and so is the shared-expert gate's dot product: a layer range that
 * ends at layer l (no next norm here) hands on exactly the h that one range
 * over l and l + 1 computes. The up to 16 expert rows of a column are loaded
 * before they are summed in order. The norm's f32 sum of squares is the
 * same loop as cuda_rmsnorm_wide's (norm.cu), so a range's first layer
 * normalises h as the previous layer's combine would have. f is read
 * (shared-expert gate) before any y is written: y may be f. EARLY: f was
 * written two or more launches back, so the gate is computed before the
 * PDL wait (f through L2), beside the launch just before, and the router's
 * weights w (three launches back) are read before it too.
 * Where a thread has at most kCombineCols columns and k <= kCombineK (hidden
 * sizes up to 2048), its columns' expert rows, h and the shared expert's row
 * are all loaded in one round after the wait (and the norm weights before
 * it), and h stays in registers for the norm: the same operations in the same
 * order as the loop below, which serves the rest. (The loop's loads of one
 * column waited for the store of the one before: one read of L2 a column.) */
constexpr uint32_t kCombineCols = 2; /* columns per thread of the one-round path */
constexpr uint32_t kCombineK = 16;   /* expert rows of the one-round path */

/* Whether the one-round path serves n columns and k expert rows over a
 * block (or a cluster) of `threads` threads. */
static __host__ __device__ __forceinline__ bool combine_one_round(uint32_t n, uint32_t k,
                                                                  uint32_t threads)
{
    return n <= kCombineCols * threads && k <= kCombineK;
}

template <bool NORM, bool EARLY>
static __global__ void __launch_bounds__(1024)
    moe_combine_norm_kernel(float *h, const float *Y, const float *w, uint32_t k, const float *so,
                            const float *gate, const float *f, uint32_t n, const float *nw,
                            float eps, float *y, int8_t *xq, const float *mix, const float *gsp)
{
    __shared__ float s_tmp[32];
    if (threadIdx.x == 0 && blockIdx.x == 0) { /* weights: in L2 before the wait */
        if (so && gate && !EARLY)
            pdl_prefetch_l2(gate, n * sizeof(float));
        if (NORM && nw)
            pdl_prefetch_l2(nw, n * sizeof(float));
    }
    const size_t s = blockIdx.x;
    float gs = 1.0f;
    const auto gate_of = [&]() {
        float d = 0.0f;
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
            d += gate[j] * __ldcg(f + s * n + j);
        d = ops_block_sum(d, s_tmp);
        return 1.0f / (1.0f + expf(-d));
    };
    float *hr = h + s * n;
    if (combine_one_round(n, k, blockDim.x)) { /* every load in flight at once */
        __shared__ float s_w[kCombineK];
        float nwv[kCombineCols];
#pragma unroll
        for (uint32_t c = 0; c < kCombineCols; c++) { /* weights: before the wait */
            const uint32_t j = threadIdx.x + c * blockDim.x;
            nwv[c] = NORM && nw && j < n ? nw[j] : 1.0f;
        }
        if (EARLY) { /* the router's weights, three launches back: through L2 */
            if (threadIdx.x < k)
                s_w[threadIdx.x] = __ldcg(w + s * k + threadIdx.x);
            __syncthreads();
            if (so && gsp) /* the gate summed by the router's launch */
                gs = __ldcg(gsp + s);
            else if (so && gate)
                gs = gate_of();
        }
        pdl_wait();
        pdl_trigger();
        if (!EARLY) {
            if (threadIdx.x < k)
                s_w[threadIdx.x] = w[s * k + threadIdx.x];
            __syncthreads();
            if (so && gate)
                gs = gate_of();
        }
        float yv[kCombineCols][kCombineK], hv[kCombineCols], sv[kCombineCols], mv[kCombineCols];
#pragma unroll
        for (uint32_t c = 0; c < kCombineCols; c++) {
            const uint32_t j = threadIdx.x + c * blockDim.x;
#pragma unroll
            for (uint32_t i = 0; i < kCombineK; i++)
                yv[c][i] = j < n && i < k ? Y[(s * k + i) * n + j] : 0.0f;
            hv[c] = j < n ? hr[j] : 0.0f;
            mv[c] = j < n && mix ? mix[s * n + j] : 0.0f;
            sv[c] = j < n && so ? so[s * n + j] : 0.0f;
        }
        if (mix) /* the mixer's output first, as cuda_add_rmsnorm adds it */
#pragma unroll
            for (uint32_t c = 0; c < kCombineCols; c++)
                hv[c] = __fadd_rn(hv[c], mv[c]);
        float sum = 0.0f;
#pragma unroll
        for (uint32_t c = 0; c < kCombineCols; c++) {
            const uint32_t j = threadIdx.x + c * blockDim.x;
            if (j >= n)
                continue;
            float out = 0.0f;
#pragma unroll
            for (uint32_t i = 0; i < kCombineK; i++)
                if (i < k)
                    out = __fadd_rn(out, __fmul_rn(s_w[i], yv[c][i]));
            if (so)
                out = __fadd_rn(out, __fmul_rn(gs, sv[c]));
            hv[c] = __fadd_rn(hv[c], out);
            hr[j] = hv[c];
            sum += hv[c] * hv[c];
        }
        if (!NORM)
            return;
        sum = ops_block_sum(sum, s_tmp);
        const float scale = 1.0f / sqrtf(sum / (float)n + eps);
        /* xq as the cluster form writes it (a warp's columns are one block) */
        int8_t *xl = xq ? xq + s * mvq::xq_row_bytes(n) : nullptr;
        float *xd = xq ? reinterpret_cast<float *>(xl + n) : nullptr;
        float ov[kCombineCols];
        uint32_t bb[kCombineCols];
        bool st[kCombineCols];
#pragma unroll
        for (uint32_t c = 0; c < kCombineCols; c++) {
            const uint32_t j = threadIdx.x + c * blockDim.x;
            ov[c] = 0.0f;
            bb[c] = j / 32;
            st[c] = j < n;
            if (j < n) {
                const float v = hv[c] * scale;
                const float out = nw ? v * nwv[c] : v;
                y[s * n + j] = out;
                ov[c] = out;
            }
        }
        if (xq) /* a warp's columns: one block each round (j < n warp-uniform) */
            mvq::round_blocks<kCombineCols>(ov, bb, st, xl, xd, xd + n / 32);
        return;
    }
    if (EARLY && so && gsp)
        gs = __ldcg(gsp + s);
    else if (EARLY && so && gate)
        gs = gate_of();
    pdl_wait();
    pdl_trigger();
    if (!EARLY && so && gate)
        gs = gate_of();
    float sum = 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        float out = 0.0f;
        for (uint32_t i0 = 0; i0 < k; i0 += 16) {
            float yv[16], wv[16];
#pragma unroll
            for (uint32_t i = 0; i < 16; i++) {
                const bool in = i0 + i < k;
                wv[i] = in ? w[s * k + i0 + i] : 0.0f;
                yv[i] = in ? Y[(s * k + i0 + i) * n + j] : 0.0f;
            }
#pragma unroll
            for (uint32_t i = 0; i < 16; i++)
                if (i0 + i < k)
                    out = __fadd_rn(out, __fmul_rn(wv[i], yv[i]));
        }
        if (so)
            out = __fadd_rn(out, __fmul_rn(gs, so[s * n + j]));
        const float hj = mix ? __fadd_rn(hr[j], mix[s * n + j]) : hr[j];
        const float v = __fadd_rn(hj, out);
        hr[j] = v;
        sum += v * v;
    }
    if (!NORM)
        return;
    sum = ops_block_sum(sum, s_tmp);
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = hr[j] * scale;
        y[s * n + j] = nw ? v * nw[j] : v;
    }
}

/* The early one-round combine (and next norm) of token blockIdx.x / C over
 * a thread block cluster of C blocks of kClusterThreads (sm_90): block b's
 * thread t plays thread v = b kClusterThreads + t of the W = C
 * kClusterThreads threads of moe_combine_norm_kernel<NORM, true>, so its
 * columns, loads and sums are that thread's, and the two block sums (the
 * gate's dot, the norm's squares) are ops_block_sum's tree: each warp's
 * butterfly, its sum written into slot (its warp index in W) of every
 * block of the cluster, a cluster barrier, then every warp's butterfly over
 * the W / 32 slots. The same bits, with the 96 KB of a 2048-column token's
 * loads spread over C SMs instead of one. */
constexpr uint32_t kClusterThreads = 128;

template <bool NORM>
static __global__ void __launch_bounds__(kClusterThreads)
    moe_combine_cluster_kernel(float *h, const float *Y, const float *w, uint32_t k,
                               const float *so, const float *gate, const float *f, uint32_t n,
                               const float *nw, float eps, float *y, int8_t *xq,
                               const float *mix, const float *gsp)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    const uint32_t C = cl.num_blocks(), b = cl.block_rank();
    const uint32_t W = C * kClusterThreads, v = b * kClusterThreads + threadIdx.x;
    const uint32_t lane = threadIdx.x & 31, vw = v >> 5;
    const size_t s = blockIdx.x / C;
    __shared__ float s_w[kCombineK], s_gate[32], s_sq[32];
    float nwv[kCombineCols];
#pragma unroll
    for (uint32_t c = 0; c < kCombineCols; c++) { /* weights: before the wait */
        const uint32_t j = v + c * W;
        nwv[c] = NORM && nw && j < n ? nw[j] : 1.0f;
    }
    if (threadIdx.x < k)
        s_w[threadIdx.x] = __ldcg(w + s * k + threadIdx.x);
    float gs = so && gsp ? __ldcg(gsp + s) : 1.0f; /* the gate summed by the router's launch */
    cl.sync(); /* every block of the cluster started (remote writes below); s_w */
    if (so && gate && !gsp) { /* gate_of's sums, f early (through L2) */
        float d = 0.0f;
        for (uint32_t j = v; j < n; j += W)
            d += gate[j] * __ldcg(f + s * n + j);
        d = ops_warp_sum(d);
        if (lane == 0)
            for (uint32_t r = 0; r < C; r++)
                cl.map_shared_rank(s_gate, r)[vw] = d;
        cl.sync();
        d = lane < W / 32 ? s_gate[lane] : 0.0f;
        d = ops_warp_sum(d);
        gs = 1.0f / (1.0f + expf(-d));
    }
    pdl_wait();
    pdl_trigger();
    float *hr = h + s * n;
    float yv[kCombineCols][kCombineK], hv[kCombineCols], sv[kCombineCols], mv[kCombineCols];
#pragma unroll
    for (uint32_t c = 0; c < kCombineCols; c++) {
        const uint32_t j = v + c * W;
#pragma unroll
        for (uint32_t i = 0; i < kCombineK; i++)
            yv[c][i] = j < n && i < k ? Y[(s * k + i) * n + j] : 0.0f;
        hv[c] = j < n ? hr[j] : 0.0f;
        mv[c] = j < n && mix ? mix[s * n + j] : 0.0f;
        sv[c] = j < n && so ? so[s * n + j] : 0.0f;
    }
    if (mix) /* the mixer's output first, as cuda_add_rmsnorm adds it */
#pragma unroll
        for (uint32_t c = 0; c < kCombineCols; c++)
            hv[c] = __fadd_rn(hv[c], mv[c]);
    float sum = 0.0f;
#pragma unroll
    for (uint32_t c = 0; c < kCombineCols; c++) {
        const uint32_t j = v + c * W;
        if (j >= n)
            continue;
        float out = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < kCombineK; i++)
            if (i < k)
                out = __fadd_rn(out, __fmul_rn(s_w[i], yv[c][i]));
        if (so)
            out = __fadd_rn(out, __fmul_rn(gs, sv[c]));
        hv[c] = __fadd_rn(hv[c], out);
        hr[j] = hv[c];
        sum += hv[c] * hv[c];
    }
    if (!NORM)
        return; /* no remote access after the last barrier */
    sum = ops_warp_sum(sum);
    if (lane == 0)
        for (uint32_t r = 0; r < C; r++)
            cl.map_shared_rank(s_sq, r)[vw] = sum;
    cl.sync();
    sum = lane < W / 32 ? s_sq[lane] : 0.0f;
    sum = ops_warp_sum(sum);
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    /* xq: y rounded as the int8 products round it; a warp's columns are one
     * block of 32 (W and n multiples of 32), so every lane of it calls */
    int8_t *xl = xq ? xq + s * mvq::xq_row_bytes(n) : nullptr;
    float *xd = xq ? reinterpret_cast<float *>(xl + n) : nullptr;
    float ov[kCombineCols];
    uint32_t bb[kCombineCols];
    bool st[kCombineCols];
#pragma unroll
    for (uint32_t c = 0; c < kCombineCols; c++) {
        const uint32_t j = v + c * W;
        ov[c] = 0.0f;
        bb[c] = j / 32;
        st[c] = j < n;
        if (j < n) {
            const float x = hv[c] * scale;
            const float out = nw ? x * nwv[c] : x;
            y[s * n + j] = out;
            ov[c] = out;
        }
    }
    if (xq) /* a warp's columns: one block each round (j < n warp-uniform) */
        mvq::round_blocks<kCombineCols>(ov, bb, st, xl, xd, xd + n / 32);
#else
    (void)h, (void)Y, (void)w, (void)k, (void)so, (void)gate, (void)f, (void)n, (void)nw,
        (void)eps, (void)y, (void)xq, (void)mix, (void)gsp;
    __trap(); /* launched on sm_90 and later only (caps.h): never silently nothing */
#endif
}

/* The blocks of moe_combine_cluster_kernel's cluster for n columns and k
 * expert rows, or 0 where it does not serve: a device before sm_90,
 * LAMINA_CUDA_COMBINE_CLUSTER=0 (read at each launch), the loop path of the
 * one-block kernel (more than kCombineCols columns a thread, more than
 * kCombineK rows), a block width that is not a whole number (2 to 8) of
 * cluster blocks. */
static unsigned combine_cluster_size(uint32_t n, uint32_t k)
{
    const char *env = getenv("LAMINA_CUDA_COMBINE_CLUSTER");
    if (env && env[0] == '0')
        return 0;
    const unsigned W = cuda_norm_wide_threads(n);
    if (!combine_one_round(n, k, W) || W % kClusterThreads ||
        W / kClusterThreads < 2 || !device_sm90()) {
        (void)cudaGetLastError();
        return 0;
    }
    return W / kClusterThreads; /* W <= 1024: at most 8 */
}

extern "C" int cuda_silu_mul(const float *d_gu, uint32_t F, uint32_t rows, float *d_act,
                             cudaStream_t stream)
{
    if (!d_gu || !d_act || F == 0) {
        log_error("cuda_silu_mul: bad arguments (gu %p, act %p, F %u)", (const void *)d_gu,
                  (void *)d_act, F);
        return -EINVAL;
    }
    const size_t total = (size_t)rows * F;
    if (total == 0)
        return 0;
    pdl_launch(silu_mul_kernel, ops_grid_for(total, 256), 256, 0, stream, d_gu, F, rows, d_act);
    return OPS_LAUNCH_CHECK("cuda_silu_mul");
}

/* The combine launchers' argument check (need_y: a norm's output row);
 * -EINVAL, logged under `what`, or 0. */
static int combine_check(const char *what, bool need_y, const float *d_h, const float *d_y,
                         const float *d_Y, const float *d_w, uint32_t k, const float *d_so,
                         const float *d_shexp_gate, const float *d_f, uint32_t n, uint32_t S)
{
    if (!d_h || (need_y && !d_y) || (k && (!d_Y || !d_w)) || n == 0 ||
        (d_so && d_shexp_gate && !d_f) || S > INT32_MAX) {
        log_error("%s: bad arguments (h %p, y %p, Y %p, w %p, k %u, so %p, gate %p, f %p, n %u, "
                  "S %u)",
                  what, (const void *)d_h, (const void *)d_y, (const void *)d_Y,
                  (const void *)d_w, k, (const void *)d_so, (const void *)d_shexp_gate,
                  (const void *)d_f, n, S);
        return -EINVAL;
    }
    return 0;
}

/* One block per token, the combine kernel's width; d_y NULL: no norm. The
 * early form over a cluster per token where combine_cluster_size allows. */
template <bool EARLY>
static void combine_launch(float *d_h, const float *d_Y, const float *d_w, uint32_t k,
                           const float *d_so, const float *d_shexp_gate, const float *d_f,
                           uint32_t n, uint32_t S, const float *d_norm_w, float eps, float *d_y,
                           cudaStream_t stream, int8_t *d_xq = nullptr,
                           const float *d_mix = nullptr, const float *d_gs = nullptr)
{
    const unsigned C = EARLY ? combine_cluster_size(n, k) : 0;
    if (C && d_y)
        pdl_launch_cluster(moe_combine_cluster_kernel<true>, S * C, kClusterThreads, C, 0,
                           stream, d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, d_norm_w, eps,
                           d_y, d_xq, d_mix, d_gs);
    else if (C)
        pdl_launch_cluster(moe_combine_cluster_kernel<false>, S * C, kClusterThreads, C, 0,
                           stream, d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n,
                           (const float *)nullptr, 0.0f, (float *)nullptr, (int8_t *)nullptr,
                           d_mix, d_gs);
    else if (d_y)
        pdl_launch(moe_combine_norm_kernel<true, EARLY>, S, cuda_norm_wide_threads(n), 0, stream,
                   d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, d_norm_w, eps, d_y, d_xq, d_mix,
                   d_gs);
    else
        pdl_launch(moe_combine_norm_kernel<false, EARLY>, S, cuda_norm_wide_threads(n), 0,
                   stream, d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, (const float *)nullptr,
                   0.0f, (float *)nullptr, (int8_t *)nullptr, d_mix, d_gs);
}

extern "C" int cuda_moe_combine(float *d_h, const float *d_Y, const float *d_w, uint32_t k,
                                const float *d_so, const float *d_shexp_gate, const float *d_f,
                                uint32_t n, uint32_t S, cudaStream_t stream)
{
    int rc = combine_check("cuda_moe_combine", false, d_h, NULL, d_Y, d_w, k, d_so, d_shexp_gate,
                           d_f, n, S);
    if (rc || S == 0)
        return rc;
    combine_launch<false>(d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, S, NULL, 0.0f, NULL,
                          stream);
    return OPS_LAUNCH_CHECK("cuda_moe_combine");
}

extern "C" int cuda_moe_combine_norm(float *d_h, const float *d_Y, const float *d_w, uint32_t k,
                                     const float *d_so, const float *d_shexp_gate,
                                     const float *d_f, uint32_t n, uint32_t S,
                                     const float *d_norm_w, float eps, float *d_y,
                                     cudaStream_t stream)
{
    int rc = combine_check("cuda_moe_combine_norm", true, d_h, d_y, d_Y, d_w, k, d_so,
                           d_shexp_gate, d_f, n, S);
    if (rc || S == 0)
        return rc;
    combine_launch<false>(d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, S, d_norm_w, eps, d_y,
                          stream);
    return OPS_LAUNCH_CHECK("cuda_moe_combine_norm");
}

extern "C" bool cuda_moe_combine_xq_ok(uint32_t n, uint32_t k)
{
    /* the one-round path of either form (the cluster's serves where that does) */
    return n % 32 == 0 && combine_one_round(n, k, cuda_norm_wide_threads(n));
}

extern "C" int cuda_moe_combine_early(float *d_h, const float *d_Y, const float *d_w, uint32_t k,
                                      const float *d_so, const float *d_shexp_gate,
                                      const float *d_f, uint32_t n, uint32_t S,
                                      const float *d_norm_w, float eps, float *d_y,
                                      int8_t *d_xq, cudaStream_t stream)
{
    return cuda_moe_combine_early_mix(d_h, NULL, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, S,
                                      d_norm_w, eps, d_y, d_xq, NULL, stream);
}

extern "C" int cuda_moe_combine_early_mix(float *d_h, const float *d_mix, const float *d_Y,
                                          const float *d_w, uint32_t k, const float *d_so,
                                          const float *d_shexp_gate, const float *d_f,
                                          uint32_t n, uint32_t S, const float *d_norm_w,
                                          float eps, float *d_y, int8_t *d_xq,
                                          const float *d_gs, cudaStream_t stream)
{
    int rc = combine_check("cuda_moe_combine_early", false, d_h, d_y, d_Y, d_w, k, d_so,
                           d_shexp_gate, d_f, n, S);
    if (!rc && d_mix && ((uintptr_t)d_mix % 4 || d_mix == d_h)) {
        log_error("cuda_moe_combine_early: bad mixer output %p (h %p)", (const void *)d_mix,
                  (void *)d_h);
        rc = -EINVAL;
    }
    if (!rc && d_xq && (!d_y || (uintptr_t)d_xq % 16 || !cuda_moe_combine_xq_ok(n, k))) {
        log_error("cuda_moe_combine_early: xq %p asked without the norm, unaligned or where "
                  "the one-round combine does not serve (n %u, k %u)", (void *)d_xq, n, k);
        rc = -EINVAL;
    }
    if (!rc && d_gs && (uintptr_t)d_gs % 4) {
        log_error("cuda_moe_combine_early: bad gate sums %p", (const void *)d_gs);
        rc = -EINVAL;
    }
    if (rc || S == 0)
        return rc;
    combine_launch<true>(d_h, d_Y, d_w, k, d_so, d_shexp_gate, d_f, n, S, d_norm_w, eps, d_y,
                         stream, d_xq, d_mix, d_gs);
    return OPS_LAUNCH_CHECK("cuda_moe_combine_early");
}
