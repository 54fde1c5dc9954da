/*
 * test_step_floor_cuda: the cost of one dependent step of a decode chain
 * (kernels/cuda/step_floor.h) as kernel launches in a CUDA graph chained
 * with programmatic dependent launch, and as one persistent kernel with a
 * grid barrier between steps: 336 steps (48 layers x 7 boundaries) over
 * 2048 floats, one block an SM.
 *   - both forms give the same bits as each other and as the CPU's
 *     recurrence computed here in the kernels' order (block sum tree), and
 *     the barrier counter ends at (steps - 1) x blocks;
 *   - timed: median of 10 replays after warm-up (CUDA events), [measure]
 *     lines in us a step;
 *   - what code size costs: the launches followed by 512, 2048 or 8192
 *     straight-line multiply-adds a thread, one kernel every step against
 *     seven in rotation (same bits as the recurrence; [measure] lines).
 * Needs a CUDA device: exits 1 with a message when there is none.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "kernels/cuda/step_floor.h"
#include "tests/check.h"
#include "tests/gpu/gpu_check.h"

#define SF_N 2048u
#define SF_STEPS 336u
#define SF_REPS 10

static int sf_cmp(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Runs one form `reps` times (after three warm-up runs) from the same
 * input; returns the median us of a run and leaves the last output in out.
 * persistent 0: launches; 1: the persistent kernel; 2: the code-size form
 * with `fmas` and `variants`. */
static float sf_time(int persistent, uint32_t fmas, uint32_t variants, const float *h_in,
                     float *d_a, float *d_b, unsigned int *d_ctr, cudaStream_t s, float *out)
{
    cudaGraphExec_t ge = NULL;
    if (persistent != 1) {
        cudaGraph_t g;
        CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        const int rc = persistent ? cuda_step_floor_code(fmas, variants, d_a, d_b, SF_N,
                                                         SF_STEPS, NULL, s)
                                  : cuda_step_floor(0, d_a, d_b, SF_N, SF_STEPS, NULL, s);
        CU(cudaStreamEndCapture(s, &g));
        CHECK(rc == 0, "launches (form %d, fmas %u, variants %u): rc %d", persistent, fmas,
              variants, rc);
        CU(cudaGraphInstantiate(&ge, g, 0));
        CU(cudaGraphDestroy(g));
    }
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float t[SF_REPS];
    for (int i = 0; i < 3 + SF_REPS; i++) {
        CU(cudaMemcpyAsync(d_a, h_in, SF_N * sizeof(float), cudaMemcpyHostToDevice, s));
        CU(cudaMemsetAsync(d_ctr, 0, sizeof(unsigned int), s));
        CU(cudaEventRecord(e0, s));
        if (persistent == 1) {
            const int rc = cuda_step_floor(1, d_a, d_b, SF_N, SF_STEPS, d_ctr, s);
            CHECK(rc == 0, "persistent: rc %d", rc);
        } else {
            CU(cudaGraphLaunch(ge, s));
        }
        CU(cudaEventRecord(e1, s));
        CU(cudaEventSynchronize(e1));
        if (i >= 3)
            CU(cudaEventElapsedTime(&t[i - 3], e0, e1));
    }
    /* an even step count ends in a */
    CU(cudaMemcpy(out, d_a, SF_N * sizeof(float), cudaMemcpyDeviceToHost));
    if (ge)
        CU(cudaGraphExecDestroy(ge));
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    qsort(t, SF_REPS, sizeof(float), sf_cmp);
    return t[SF_REPS / 2] * 1000.0f;
}

/* The CPU recurrence in the kernels' order: each of 256 threads sums its
 * strided elements, warps by butterfly, then the 8 warp sums by butterfly. */
static float sf_block_sum(const float *x)
{
    float part[256], warp[32] = {0};
    for (int t = 0; t < 256; t++) {
        part[t] = 0.0f;
        for (uint32_t i = (uint32_t)t; i < SF_N; i += 256)
            part[t] += x[i];
    }
    for (int w = 0; w < 8; w++) {
        float v[32];
        for (int l = 0; l < 32; l++)
            v[l] = part[w * 32 + l];
        for (int o = 16; o > 0; o >>= 1) {
            float nv[32];
            for (int l = 0; l < 32; l++)
                nv[l] = v[l] + v[l ^ o];
            memcpy(v, nv, sizeof(v));
        }
        warp[w] = v[0];
    }
    float v[32];
    memcpy(v, warp, sizeof(v));
    for (int o = 16; o > 0; o >>= 1) {
        float nv[32];
        for (int l = 0; l < 32; l++)
            nv[l] = v[l] + v[l ^ o];
        memcpy(v, nv, sizeof(v));
    }
    return v[0];
}

int main(void)
{
    log_init("test", -1);
    int n_dev = 0, dev = 0, sms = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_step_floor_cuda: no CUDA device present\n");
        return 1;
    }
    CU(cudaGetDevice(&dev));
    CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    struct rng r = {0x5EEDF100ull};
    float *h_in = rand_floats(SF_N, &r), *ref = xmalloc(SF_N * sizeof(float));
    float *tmp = xmalloc(SF_N * sizeof(float)), *outs[2];
    for (int i = 0; i < 2; i++)
        outs[i] = xmalloc(SF_N * sizeof(float));
    memcpy(ref, h_in, SF_N * sizeof(float));
    for (uint32_t s = 0; s < SF_STEPS; s++) {
        const float sum = sf_block_sum(ref);
        for (uint32_t j = 0; j < SF_N; j++)
            tmp[j] = 0.5f * ref[j] + 1e-4f * sum;
        memcpy(ref, tmp, SF_N * sizeof(float));
    }
    float *d_a, *d_b;
    unsigned int *d_ctr;
    CU(cudaMalloc((void **)&d_a, SF_N * sizeof(float)));
    CU(cudaMalloc((void **)&d_b, SF_N * sizeof(float)));
    CU(cudaMalloc((void **)&d_ctr, sizeof(unsigned int)));
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const float us_launch = sf_time(0, 0, 0, h_in, d_a, d_b, d_ctr, s, outs[0]);
    const float us_pers = sf_time(1, 0, 0, h_in, d_a, d_b, d_ctr, s, outs[1]);
    unsigned int ctr = 0;
    CU(cudaMemcpy(&ctr, d_ctr, sizeof(ctr), cudaMemcpyDeviceToHost));
    CHECK(ctr == (SF_STEPS - 1) * (unsigned)sms, "barrier counter %u, want %u", ctr,
          (SF_STEPS - 1) * (unsigned)sms);
    CHECK(!memcmp(outs[0], outs[1], SF_N * sizeof(float)),
          "the persistent kernel's result differs from the launches'");
    CHECK(!memcmp(outs[0], ref, SF_N * sizeof(float)),
          "the launches' result differs from the CPU recurrence");
    MEASURE("dependent step floor (%u steps over %u floats, %d blocks, median of %d): launches "
            "in a graph with PDL %.2f us a step, persistent kernel with grid barriers %.2f us a "
            "step", SF_STEPS, SF_N, sms, SF_REPS, us_launch / SF_STEPS, us_pers / SF_STEPS);
    /* The code-size form: straight-line code after each step, the same
     * kernel every step (its code stays in the instruction caches) against
     * seven kernels in rotation (as a layer's seven launches). */
    static const uint32_t fmas[3] = {512, 2048, 8192};
    for (int f = 0; f < 3; f++) {
        float us[2];
        for (int r = 0; r < 2; r++) {
            const uint32_t variants = r ? CUDA_STEP_FLOOR_VARIANTS : 1;
            memset(tmp, 0xff, SF_N * sizeof(float));
            us[r] = sf_time(2, fmas[f], variants, h_in, d_a, d_b, d_ctr, s, tmp);
            CHECK(!memcmp(tmp, ref, SF_N * sizeof(float)),
                  "code form (%u fmas, %u variants): the result differs from the CPU recurrence",
                  fmas[f], variants);
        }
        MEASURE("step with %u straight-line fmas a thread (about %u KiB of code): one kernel "
                "%.2f us a step, %d kernels in rotation %.2f us a step (+%.2f)", fmas[f],
                fmas[f] * 16 / 1024, us[0] / SF_STEPS, CUDA_STEP_FLOOR_VARIANTS,
                us[1] / SF_STEPS, (us[1] - us[0]) / SF_STEPS);
    }
    /* refusals: nothing launched */
    CHECK(cuda_step_floor_code(1000, 1, d_a, d_b, SF_N, 4, NULL, s) == -EINVAL,
          "fmas 1000: not -EINVAL");
    CHECK(cuda_step_floor_code(512, CUDA_STEP_FLOOR_VARIANTS + 1, d_a, d_b, SF_N, 4, NULL, s) ==
              -EINVAL,
          "too many variants: not -EINVAL");
    CHECK(cuda_step_floor(1, d_a, d_b, SF_N, 4, NULL, s) == -EINVAL, "no counter: not -EINVAL");
    CHECK(cuda_step_floor(0, d_a, d_b, 0, 4, NULL, s) == -EINVAL, "n 0: not -EINVAL");
    CU(cudaStreamDestroy(s));
    cudaFree(d_a);
    cudaFree(d_b);
    cudaFree(d_ctr);
    free(h_in);
    free(ref);
    free(tmp);
    free(outs[0]);
    free(outs[1]);
    return test_main_result("test_step_floor_cuda");
}
