/*
 * test_probe: the device probes (worker/probe.h) on the CPU. The host GEMV
 * probe gives a plausible rate (0.1 GB/s to 10 TB/s) within its time budget
 * on one thread and on every core, falls back to Q4_0 for a type the kernel
 * lacks, and names that are not devices are refused. A CUDA probe here either
 * measures a card or says there is none (-ENODEV); tests/gpu/test_probe_cuda
 * checks its figures on a GPU.
 */
#include "worker/probe.h"

#include <errno.h>
#include <string.h>

#include "common/log.h"
#include "model/quant.h"
#include "tests/check.h"

static void test_cpu(int threads, uint32_t type, uint32_t want_type)
{
    struct probe_result r;
    memset(&r, 0xff, sizeof(r));
    int rc = probe_cpu(threads, type, &r);
    CHECK(rc == 0, "probe_cpu(%d, %u): %d", threads, type, rc);
    if (rc)
        return;
    CHECK(r.gemv_bw > 1e8 && r.gemv_bw < 1e13, "gemv %g B/s", r.gemv_bw);
    CHECK(r.h2d_bw == 0 && r.mem_total == 0, "a cpu has no copy path");
    CHECK(r.type == want_type, "matrix type %u, want %u", r.type, want_type);
    CHECK(r.threads >= 1 && (threads <= 0 || r.threads == threads), "threads %d", r.threads);
    CHECK(r.ms > 0 && r.ms < 5000, "probe took %.0f ms", r.ms);
    MEASURE("cpu probe, %s, %d thread(s), %u MiB: gemv %.1f GB/s in %.0f ms",
            quant_type_name(r.type), r.threads, PROBE_CPU_BYTES >> 20, r.gemv_bw / 1e9, r.ms);
}

int main(void)
{
    log_init("test", -1);
    test_cpu(1, QUANT_TYPE_Q4_0, QUANT_TYPE_Q4_0);
    test_cpu(0, QUANT_TYPE_Q8_0, QUANT_TYPE_Q8_0);
    test_cpu(2, 9999, QUANT_TYPE_Q4_0);
    struct probe_result r;
    log_set_level(LOG_LEVEL_ERROR);
    const char *bad[] = {"gpu0", "cuda:", "cuda:x", "cuda:-1", "cpu0", ""};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(probe_device(bad[i], 1, QUANT_TYPE_Q4_0, &r) == -EINVAL &&
              strstr(log_last_error(), "cannot probe device"), "name '%s' refused", bad[i]);
    int rc = probe_device("cuda:0", 1, QUANT_TYPE_Q4_0, &r);
    CHECK(rc == 0 || rc == -ENODEV, "cuda:0 probe: %d", rc);
    if (rc == 0)
        MEASURE("cuda:0 probe: gemv %.0f GB/s, h2d %.1f GB/s", r.gemv_bw / 1e9, r.h2d_bw / 1e9);
    return test_main_result("test_probe");
}
