/*
 * cuda sample: picks the next token from a row of logits on the GPU, the twin of model/sampler.h
 * (penalties -> top_k -> top_p -> min_p -> temperature -> draw), so the last worker returns a
 * token id instead of the logits. The PRNG stays on the host: the caller passes the uniform
 * number the CPU sampler would draw (sampler_next_uniform) and the kernel does the filtering and
 * the inverse-CDF pick.
 *
 * Same token as the CPU: ranking is (higher penalized logit, then lower id), NaN counts as -inf
 * and -0 as +0; greedy (temperature 0, or no finite logit) is the arg-max, ties to the lowest id;
 * top_k and min_p are exact (min_p's floor is max + ln_min_p in f32, as on the CPU); the draw
 * cumulates in rank order when top_k (0 < top_k < n_vocab) or top_p (0 < top_p < 1) is active,
 * else in id order, and picks the first token whose cumulative weight passes u * total. What
 * cannot be equal in principle: the weights come from the GPU's expf (within 2 ulp of glibc's)
 * and are summed as integers of 2^-43 instead of doubles, so the top_p cutoff and the draw can
 * differ from the CPU only where a cumulative sum lies within ~1e-6 (relative) of the goal.
 *
 * Launchers validate (-EINVAL, logged), enqueue on `stream` without any host synchronisation
 * (capturable in a CUDA graph: everything that changes per token is read from device memory
 * when the kernel runs), and check the launch (-EIO, logged).
 */
#ifndef KERNELS_CUDA_SAMPLE_H
#define KERNELS_CUDA_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUDA_SAMPLE_MAX_VOCAB (1u << 20) /* largest n_vocab, tokens (integer mass fits 64 bits) */

/* One step's sampling parameters, read by the kernel from device-visible memory (device memory
 * written by cudaMemcpyAsync on the sampling stream, or mapped pinned host memory). The first
 * six fields mirror struct sampler_config; cuda_sample_params_prepare() checks them and sets
 * the two derived fields; uniform changes every token. */
struct cuda_sample_params {
    float temperature;      /* >= 0; 0 = greedy */
    int32_t top_k;          /* >= 0; 0 = off */
    float top_p;            /* [0, 1]; 0 or 1 = off */
    float min_p;            /* [0, 1]; 0 = off */
    float repeat_penalty;   /* >= 0; 0 or 1 = off */
    float presence_penalty; /* finite; 0 = off */
    float inv_temperature;  /* derived: 1.0f / temperature (0 when greedy) */
    float ln_min_p;         /* derived: logf(min_p) on the host, as the CPU computes it */
    double uniform;         /* [0, 1): sampler_next_uniform() of the CPU sampler; unused when
                               greedy */
};

/* Checks the six config fields of p (ranges as sampler_create) and fills the derived fields.
 * Returns 0, or -EINVAL (logged) naming the bad field. Host only; p is the caller's. */
int cuda_sample_params_prepare(struct cuda_sample_params *p);

/* Bytes of device scratch cuda_sample needs for n_vocab logits. */
size_t cuda_sample_work_bytes(uint32_t n_vocab);

/* Samples one token from d_logits[0 .. n_vocab) (device, f32, not modified) into *d_token
 * (device int32), with the parameters at d_params (device-visible, prepared) and the penalty
 * window d_recent[0 .. n_recent) (device int32 ids; ids outside [0, n_vocab) are ignored, so pad
 * unused slots with -1; repeats are harmless; may be NULL when n_recent is 0). d_work: scratch of
 * cuda_sample_work_bytes(n_vocab), 16-byte aligned, owned by the caller and busy until the
 * kernel ends. One block of 1024 threads, one launch on `stream`; *d_token is ready when the
 * stream reaches that point. Returns 0, -EINVAL (logged: a NULL pointer, n_vocab 0 or above
 * CUDA_SAMPLE_MAX_VOCAB, misaligned d_work), or -EIO (launch failed, logged). */
int cuda_sample(const float *d_logits, uint32_t n_vocab, const struct cuda_sample_params *d_params,
                const int32_t *d_recent, uint32_t n_recent, void *d_work, int32_t *d_token,
                cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
