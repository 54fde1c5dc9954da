/*
 * router: the MoE router of S tokens on the GPU (twin: ops_router_topk in
 * kernels/cpu/ops.c).
 *
 * Maths, per token s with logits x[s][0..E-1]:
 *   ids[s][0..k-1] = the k largest x_e, descending, ties lower id first
 *     (NaN below every other logit; -0 equals +0)
 *   e_i = expf(x_ids[i] - x_ids[0])   (x_ids[0] = max x)
 *   w[s][i] = e_i / sum_{i<k} e_i     (sum in f32, in order)
 * which is softmax, top-k of the probabilities, renormalised by
 * max(sum, 6.103515625e-5) (llama.cpp's qwen3next clamp) without the full
 * softmax: p_e = e_e / S with S the sum of all expf(x - max), so the
 * weights are e_i / max(sum e_i, 6.103515625e-5 S); sum e_i >= e_0 = 1 and
 * S <= E <= 512, so the clamp never binds here (the CPU twin applies it
 * for E > 16384). Picking by the logits is picking by the probabilities,
 * but where two logits round to one probability.
 * Shapes: logits S x E f32; ids S x k int32; w S x k f32; E <= 512, k <= min(E, 16).
 *
 * Ownership: one warp per token (4 tokens per block). Lane L holds experts
 * L, L + 32, ... (up to 16) in registers as order-keeping keys of the
 * logits; the top-k (the larger key first, the lower id among equal ones)
 * takes the k-th of the 32 lane bests as a floor; the keys at or above it,
 * when at most 32, are placed by counting, one per lane, against each
 * other. Past 32 (the largest crowded into a few lanes) it runs k rounds of
 * a warp arg-max, whose winner's owner retires it and finds its next best
 * by a tree. Both give the same picks, the CPU's. expf may differ from the
 * CPU's by an ulp, so weights agree to ~1e-7 relative.
 */
#include "kernels/cuda/ops.h"

#include "kernels/cuda/ops_device.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/router.cuh"

enum { kRouterWarps = 4 }; /* tokens per block */

static __global__ void router_topk_kernel(const float *logits, uint32_t E, uint32_t k,
                                          uint32_t S, int32_t *ids, float *w)
{
    __shared__ uint64_t s_pick[kRouterWarps][32];
    pdl_wait(); /* the logits come from the router product */
    pdl_trigger();
    const uint32_t s = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (s >= S)
        return; /* the whole warp leaves together */
    router_topk_warp(logits + (size_t)s * E, E, k, ids + (size_t)s * k, w + (size_t)s * k,
                     s_pick[threadIdx.x >> 5], false);
}

extern "C" int cuda_router_topk(const float *d_logits, uint32_t E, uint32_t k, uint32_t S,
                                int32_t *d_ids, float *d_w, cudaStream_t stream)
{
    if (!d_logits || !d_ids || !d_w || E == 0 || E > ROUTER_MAX_E || k == 0 ||
        k > ROUTER_MAX_K || k > E) {
        log_error("cuda_router_topk: bad arguments (logits %p, ids %p, w %p, E %u (max %d), "
                  "k %u (max %d))",
                  (const void *)d_logits, (void *)d_ids, (void *)d_w, E, ROUTER_MAX_E, k,
                  ROUTER_MAX_K);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    const unsigned int per_block = kRouterWarps;
    pdl_launch(router_topk_kernel, (S + per_block - 1) / per_block, per_block * 32, 0, stream,
               d_logits, E, k, S, d_ids, d_w);
    return OPS_LAUNCH_CHECK("cuda_router_topk");
}

static __global__ void router_topk_cycles_kernel(const float *logits, uint32_t E, uint32_t k,
                                                 bool rounds, bool softmax, int32_t *ids,
                                                 float *w, long long *cycles)
{
    __shared__ uint64_t s_pick[32];
    long long clk[4];
    const long long t0 = clock64();
    router_topk_warp<true>(logits, E, k, ids, w, s_pick, rounds, clk, softmax);
    if (threadIdx.x == 0)
        for (int i = 0; i < 4; i++)
            cycles[i] = clk[i] - t0;
}

extern "C" int cuda_router_topk_cycles(const float *d_logits, uint32_t E, uint32_t k,
                                       bool rounds, bool softmax, int32_t *d_ids, float *d_w,
                                       long long *d_cycles, cudaStream_t stream)
{
    if (!d_logits || !d_ids || !d_w || !d_cycles || E == 0 || E > ROUTER_MAX_E || k == 0 ||
        k > ROUTER_MAX_K || k > E) {
        log_error("cuda_router_topk_cycles: bad arguments (E %u, k %u)", E, k);
        return -EINVAL;
    }
    router_topk_cycles_kernel<<<1, 32, 0, stream>>>(d_logits, E, k, rounds, softmax, d_ids,
                                                    d_w, d_cycles);
    return OPS_LAUNCH_CHECK("cuda_router_topk_cycles");
}
