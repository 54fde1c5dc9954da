/*
 * cuda deltanet: the gated DeltaNet conv and per-head recurrence on the GPU
 * (see deltanet.h). CPU twins: deltanet_conv_channel, deltanet_head_step and
 * deltanet_gated_norm of kernels/cpu/deltanet.c with the per-head glue of
 * fw_dn_head_task (worker/forward.c). f32 throughout.
 *
 * dn_conv_kernel: causal depthwise conv + SiLU, C channels, S tokens.
 *   u[s][c] = silu(sum_{t<K-1} w[c][t] * st[c][t] + w[c][K-1] * x[s][c]), then
 *   the window st[c] (K-1 floats, oldest first) shifts in x[s][c].
 *   One thread owns one channel: its K taps and K-1 state floats sit in
 *   registers for the whole call and it walks the S tokens in order; a warp
 *   reads 32 consecutive channels of a token row (coalesced). 128 threads a
 *   block, ceil(C / 128) blocks. K <= DN_MAX_K.
 *
 * dn_heads_kernel<DK>: one block owns one value head h (grid nv) for all S
 * tokens, in order. The head's state, dv rows j of DK floats (key i fastest,
 * S[j][i]), is loaded once into registers, updated token by token and stored
 * once. 4 * dv threads (dv % 16 == 0, dv <= 128): thread t owns row j = t / 4
 * and, for sub = t % 4, the float4 key chunks c = sub + 4 * m (m < DK / 16) of
 * that row: DK / 4 state floats. Per token s:
 *   warp 0: q = l2norm(u[s][g*DK ..]) / sqrt(DK) into shared memory;
 *           lane 0: beta = sigmoid(b[s][h]), decay = exp(a[h] * softplus(alpha[s][h] + dt[h]));
 *   warp 1: k = l2norm(u[s][nk*DK + g*DK ..]) into shared memory;
 *   every thread: v_j = u[s][2*nk*DK + h*dv + j], z_j;
 *   (the global reads of token s + 1 are issued here, before token s's work)
 *   barrier A;
 *   S[j][:] *= decay; mem_j = S[j][:] . k (4-lane shuffle sum);
 *   d_j = (v_j - mem_j) * beta; S[j][:] += k * d_j; o_j = S[j][:] . q;
 *   sum of o_j^2 over the head: warp shuffle sums, one float per warp in
 *   shared memory, barrier B, every thread adds the (<= 16) warp sums;
 *   y[s][h*dv + j] = o_j / sqrt(mean + eps) * norm_w[j] * silu(z_j) (sub 0).
 * Two barriers per token suffice: q, k and the warp sums of token s are only
 * read between A(s) and the start of token s + 1's writes, which come after
 * B(s) (q, k) or after A(s + 1) (warp sums).
 * The key head of h is g = tiled ? h % nk : h / (nv / nk).
 * Sums differ in order from the CPU (4 partial sums per row, tree
 * reductions, fused multiply-adds): results agree to rounding, not bitwise.
 */
#include "kernels/cuda/deltanet.h"

#include <errno.h>

extern "C" {
#include "common/log.h"
}

#define DN_MAX_K 8        /* most conv taps dn_conv_kernel handles */
#define DN_CONV_THREADS 128

__device__ __forceinline__ float dn_silu(float x)
{
    return x / (1.0f + expf(-x));
}

__device__ __forceinline__ float dn_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float dn_softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float dn_warp_sum(float x)
{
    for (int o = 16; o > 0; o /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__global__ void dn_conv_kernel(float *state, const float *w, uint32_t K, const float *x,
                               float *u, uint32_t C, uint32_t S)
{
    const uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C)
        return;
    float st[DN_MAX_K - 1], wt[DN_MAX_K];
#pragma unroll
    for (uint32_t t = 0; t < DN_MAX_K; t++)
        wt[t] = t < K ? w[(size_t)ch * K + t] : 0.0f;
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        st[t] = t + 1 < K ? state[(size_t)ch * (K - 1) + t] : 0.0f;
    for (uint32_t s = 0; s < S; s++) {
        const float xs = x[(size_t)s * C + ch];
        float acc = 0.0f;
#pragma unroll
        for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
            if (t + 1 < K)
                acc += wt[t] * st[t];
        /* the last tap multiplies the new input: wt[K - 1] without dynamic indexing */
        float wl = 0.0f;
#pragma unroll
        for (uint32_t t = 0; t < DN_MAX_K; t++)
            wl = t + 1 == K ? wt[t] : wl;
        acc += wl * xs;
#pragma unroll
        for (uint32_t t = 0; t + 1 < DN_MAX_K; t++) {
            if (t + 2 < K)
                st[t] = st[t + 1];
            else if (t + 2 == K)
                st[t] = xs;
        }
        u[(size_t)s * C + ch] = dn_silu(acc);
    }
#pragma unroll
    for (uint32_t t = 0; t + 1 < DN_MAX_K; t++)
        if (t + 1 < K)
            state[(size_t)ch * (K - 1) + t] = st[t];
}

/* Per-head parameters of dn_heads_kernel, passed by value. */
struct dn_heads_args {
    float *state;
    const float *u, *b, *alpha, *a, *dt, *z, *norm_w;
    float *y;
    uint32_t nk, nv, dv, S;
    bool tiled;
    float eps;
};

/* The inputs of one token that the threads read from global memory: fetched
 * one token ahead so that their latency overlaps the previous token's work. */
template <int DK>
struct dn_tok {
    float qk[DK >= 32 ? DK / 32 : 1]; /* warps 0 and 1: raw q or k values of this lane */
    float b, alpha;                   /* warp 0 lane 0: raw beta and alpha inputs */
    float v, z;                       /* every thread: v_j and z_j */
};

template <int DK>
__device__ __forceinline__ void dn_fetch(const struct dn_heads_args &p, uint32_t s, uint32_t g,
                                         uint32_t h, uint32_t j, struct dn_tok<DK> &tk)
{
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t kd = (size_t)p.nk * DK, vd = (size_t)p.nv * p.dv;
    const float *us = p.u + (size_t)s * (2 * kd + vd);
    tk.v = us[2 * kd + (size_t)h * p.dv + j];
    tk.z = p.z[(size_t)s * vd + (size_t)h * p.dv + j];
    if (warp > 1)
        return;
    const float *src = us + (warp == 0 ? 0 : kd) + (size_t)g * DK;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        tk.qk[m] = lane + 32 * m < DK ? src[lane + 32 * m] : 0.0f;
    if (warp == 0 && lane == 0) {
        tk.b = p.b[(size_t)s * p.nv + h];
        tk.alpha = p.alpha[(size_t)s * p.nv + h];
    }
}

/* Warp 0 writes q = l2norm(raw q) / sqrt(DK) to qs, warp 1 k = l2norm(raw k)
 * to ks; warp 0 lane 0 writes beta and the decay factor to sc. */
template <int DK>
__device__ __forceinline__ void dn_norm_qk(const struct dn_heads_args &p, uint32_t h,
                                           const struct dn_tok<DK> &tk, float *qs, float *ks,
                                           float *sc)
{
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp > 1)
        return;
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        ss += tk.qk[m] * tk.qk[m];
    ss = dn_warp_sum(ss);
    const float scale = 1.0f / sqrtf(ss + p.eps);
    const float qscale = 1.0f / sqrtf((float)DK);
    float *dst = warp == 0 ? qs : ks;
#pragma unroll
    for (int m = 0; m < (DK >= 32 ? DK / 32 : 1); m++)
        if (lane + 32 * m < DK)
            dst[lane + 32 * m] = warp == 0 ? tk.qk[m] * scale * qscale : tk.qk[m] * scale;
    if (warp == 0 && lane == 0) {
        sc[0] = dn_sigmoid(tk.b);
        sc[1] = expf(p.a[h] * dn_softplus(tk.alpha + p.dt[h]));
    }
}

template <int DK>
__global__ void __launch_bounds__(512) dn_heads_kernel(const struct dn_heads_args p)
{
    constexpr int NC = DK / 16; /* float4 chunks of one row a thread owns */
    __shared__ float4 qs[DK / 4], ks[DK / 4];
    __shared__ float sc[2];
    __shared__ float red[16];
    const uint32_t h = blockIdx.x, t = threadIdx.x, j = t / 4, sub = t % 4;
    const uint32_t g = p.tiled ? h % p.nk : h / (p.nv / p.nk);
    const uint32_t n_warps = blockDim.x / 32, warp = t / 32;
    const size_t vd = (size_t)p.nv * p.dv;
    float4 *srow = reinterpret_cast<float4 *>(p.state + ((size_t)h * p.dv + j) * DK);
    struct dn_tok<DK> next;
    dn_fetch<DK>(p, 0, g, h, j, next);
    float4 st[NC];
#pragma unroll
    for (int m = 0; m < NC; m++)
        st[m] = srow[sub + 4 * m];
    const float wj = p.norm_w[j];
    for (uint32_t s = 0; s < p.S; s++) {
        const struct dn_tok<DK> cur = next;
        if (s + 1 < p.S)
            dn_fetch<DK>(p, s + 1, g, h, j, next);
        dn_norm_qk<DK>(p, h, cur, reinterpret_cast<float *>(qs), reinterpret_cast<float *>(ks),
                       sc);
        __syncthreads(); /* A */
        const float beta = sc[0], decay = sc[1];
        float mem = 0.0f;
#pragma unroll
        for (int m = 0; m < NC; m++) {
            const float4 k4 = ks[sub + 4 * m];
            st[m].x *= decay;
            st[m].y *= decay;
            st[m].z *= decay;
            st[m].w *= decay;
            mem += st[m].x * k4.x + st[m].y * k4.y + st[m].z * k4.z + st[m].w * k4.w;
        }
        mem += __shfl_xor_sync(0xffffffffu, mem, 1);
        mem += __shfl_xor_sync(0xffffffffu, mem, 2);
        const float d = (cur.v - mem) * beta;
        float o = 0.0f;
#pragma unroll
        for (int m = 0; m < NC; m++) {
            const float4 k4 = ks[sub + 4 * m], q4 = qs[sub + 4 * m];
            st[m].x += k4.x * d;
            st[m].y += k4.y * d;
            st[m].z += k4.z * d;
            st[m].w += k4.w * d;
            o += st[m].x * q4.x + st[m].y * q4.y + st[m].z * q4.z + st[m].w * q4.w;
        }
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        o += __shfl_xor_sync(0xffffffffu, o, 2);
        const float ss = dn_warp_sum(sub == 0 ? o * o : 0.0f);
        if (t % 32 == 0)
            red[warp] = ss;
        __syncthreads(); /* B */
        float total = 0.0f;
        for (uint32_t w = 0; w < n_warps; w++)
            total += red[w];
        if (sub == 0) {
            const float scale = 1.0f / sqrtf(total / (float)p.dv + p.eps);
            p.y[(size_t)s * vd + (size_t)h * p.dv + j] = o * scale * wj * dn_silu(cur.z);
        }
    }
#pragma unroll
    for (int m = 0; m < NC; m++)
        srow[sub + 4 * m] = st[m];
}

static int dn_check_launch(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return 0;
    log_error("%s launch failed: %s", what, cudaGetErrorString(e));
    return -EIO;
}

extern "C" int cuda_deltanet_conv(float *d_state, const float *d_w, uint32_t K, const float *d_x,
                                  float *d_u, uint32_t C, uint32_t S, cudaStream_t stream)
{
    if (K == 0 || K > DN_MAX_K || C == 0 || (K > 1 && !d_state) || !d_w ||
        (S && (!d_x || !d_u))) {
        log_error("cuda_deltanet_conv: bad arguments (K %u, max %d; C %u; S %u)", K, DN_MAX_K, C,
                  S);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    const uint32_t blocks = (C + DN_CONV_THREADS - 1) / DN_CONV_THREADS;
    dn_conv_kernel<<<blocks, DN_CONV_THREADS, 0, stream>>>(d_state, d_w, K, d_x, d_u, C, S);
    return dn_check_launch("cuda_deltanet_conv");
}

extern "C" int cuda_deltanet_heads(float *d_state, const float *d_u, const float *d_b,
                                   const float *d_alpha, const float *d_a, const float *d_dt,
                                   const float *d_z, const float *d_norm_w, float *d_y,
                                   uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv, bool tiled,
                                   uint32_t S, float eps, cudaStream_t stream)
{
    const bool dk_ok = dk == 16 || dk == 32 || dk == 64 || dk == 128;
    if (!dk_ok || dv < 16 || dv > 128 || dv % 16 || nk == 0 || nv == 0 || nv % nk ||
        nv > 65535 || !d_state || ((uintptr_t)d_state & 15) || !d_a || !d_dt || !d_norm_w ||
        (S && (!d_u || !d_b || !d_alpha || !d_z || !d_y))) {
        log_error("cuda_deltanet_heads: bad arguments (dk %u: 16, 32, 64 or 128; dv %u: a multiple "
                  "of 16 up to 128; nk %u, nv %u: nv a multiple of nk; state 16-byte aligned)",
                  dk, dv, nk, nv);
        return -EINVAL;
    }
    if (S == 0)
        return 0;
    const struct dn_heads_args p = {d_state, d_u,   d_b, d_alpha, d_a, d_dt, d_z, d_norm_w,
                                    d_y,     nk,    nv,  dv,      S,   tiled, eps};
    const dim3 grid(nv), block(4 * dv);
    switch (dk) {
    case 16:
        dn_heads_kernel<16><<<grid, block, 0, stream>>>(p);
        break;
    case 32:
        dn_heads_kernel<32><<<grid, block, 0, stream>>>(p);
        break;
    case 64:
        dn_heads_kernel<64><<<grid, block, 0, stream>>>(p);
        break;
    default:
        dn_heads_kernel<128><<<grid, block, 0, stream>>>(p);
        break;
    }
    return dn_check_launch("cuda_deltanet_heads");
}
