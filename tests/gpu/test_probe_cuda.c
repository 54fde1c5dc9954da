/*
 * test_probe_cuda: the CUDA device probe (worker/probe.h) on cuda:0. For
 * Q4_0 and Q8_0 matrices: the GEMV rate is plausible for device memory
 * (50 GB/s to 20 TB/s), the pinned copy rate for a bus (0.5 to 1000 GB/s),
 * the card's memory is reported, a second probe after the first (which
 * reset the card's context) agrees within a factor of 1.5, and the probe's
 * wall time is printed (the goal: under 300 ms once the context exists).
 * A card index past the last is -ENODEV. Prints [measure] lines.
 */
#include "worker/probe.h"

#include <errno.h>
#include <stdio.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "model/quant.h"
#include "tests/check.h"

static void test_type(uint32_t type)
{
    struct probe_result r[2];
    for (int k = 0; k < 2; k++) {
        int rc = probe_cuda(0, type, &r[k]);
        CHECK(rc == 0, "probe_cuda(0, %s) run %d: %d", quant_type_name(type), k, rc);
        if (rc)
            return;
        CHECK(r[k].type == type, "matrix type %u, want %u", r[k].type, type);
        CHECK(r[k].gemv_bw > 50e9 && r[k].gemv_bw < 20e12, "gemv %g B/s", r[k].gemv_bw);
        CHECK(r[k].h2d_bw > 0.5e9 && r[k].h2d_bw < 1e12, "h2d %g B/s", r[k].h2d_bw);
        CHECK(r[k].mem_total > 0 && r[k].mem_free <= r[k].mem_total, "memory %llu of %llu",
              (unsigned long long)r[k].mem_free, (unsigned long long)r[k].mem_total);
        MEASURE("cuda:0 probe %s run %d: gemv %.0f GB/s over %u MiB, h2d %.1f GB/s over %u MiB, "
                "%.0f ms (context included), %.1f of %.1f GiB free", quant_type_name(type), k,
                r[k].gemv_bw / 1e9, PROBE_GPU_BYTES >> 20, r[k].h2d_bw / 1e9,
                PROBE_COPY_BYTES >> 20, r[k].ms, r[k].mem_free / 1073741824.0,
                r[k].mem_total / 1073741824.0);
    }
    const double g = r[1].gemv_bw / r[0].gemv_bw, h = r[1].h2d_bw / r[0].h2d_bw;
    CHECK(g > 1 / 1.5 && g < 1.5 && h > 1 / 1.5 && h < 1.5,
          "two probes agree within 1.5x: gemv ratio %.2f, h2d ratio %.2f", g, h);
}

int main(void)
{
    log_init("test", -1);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
        CHECK(0, "no CUDA device");
        return test_main_result("test_probe_cuda");
    }
    test_type(QUANT_TYPE_Q4_0);
    test_type(QUANT_TYPE_Q8_0);
    struct probe_result r;
    log_set_level(LOG_LEVEL_ERROR);
    CHECK(probe_cuda(count, QUANT_TYPE_Q4_0, &r) == -ENODEV, "cuda:%d does not exist", count);
    CHECK(probe_device("cuda:0", 0, QUANT_TYPE_Q4_0, &r) == 0, "probe_device(cuda:0)");
    return test_main_result("test_probe_cuda");
}
