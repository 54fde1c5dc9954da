/*
 * test_nccl: what ipc/nccl does without a second GPU (make test, CPU machines):
 *  - a library that cannot be loaded ($LAMINA_NCCL_LIB at a missing file) fails cleanly,
 *    naming the path it tried, and opening sets NCCL_NVLS_ENABLE=0 first;
 *  - the real libnccl.so.2 where one is installed (the CUDA toolkit's): a version of 2.14 or
 *    later, unique ids of 128 bytes that differ from call to call; where none is installed,
 *    the failure names both places it looked;
 *  - a communicator with a bad rank, or whose peer never joins (1 s deadline; on a machine
 *    without a GPU the CUDA setup already fails) is refused with NULL, no hang.
 * The transfers themselves need two GPUs: tests/gpu2/sys_nccl_handoff.sh (make test-gpu2).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "ipc/nccl.h"
#include "tests/check.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void test_missing_library(void)
{
    unsetenv("NCCL_NVLS_ENABLE");
    setenv("LAMINA_NCCL_LIB", "/nonexistent/libnccl-test.so.2", 1);
    log_set_level(LOG_LEVEL_ERROR);
    struct nccl_lib *lib = nccl_lib_open(false);
    CHECK(!lib, "a missing library is refused");
#ifdef LAMINA_CUDA
    const char *nvls = getenv("NCCL_NVLS_ENABLE");
    CHECK(nvls && !strcmp(nvls, "0"), "NCCL_NVLS_ENABLE set to 0 by the open (%s)",
          nvls ? nvls : "unset");
    CHECK(strstr(log_last_error(), "/nonexistent/libnccl-test.so.2"),
          "the message names the path tried: '%s'", log_last_error());
#else
    CHECK(strstr(log_last_error(), "no CUDA support"), "no-CUDA build says so: '%s'",
          log_last_error());
#endif
    nccl_lib_close(lib);
    unsetenv("LAMINA_NCCL_LIB");
    MEASURE("missing library: refused with '%s'", log_last_error());
}

static void test_real_library(void)
{
    log_set_level(LOG_LEVEL_ERROR);
    struct nccl_lib *lib = nccl_lib_open(false);
    if (!lib) {
#ifdef LAMINA_CUDA
        CHECK(strstr(log_last_error(), "libnccl.so.2") &&
                  strstr(log_last_error(), "/usr/local/cuda"),
              "no NCCL here: the message names both places looked at: '%s'", log_last_error());
#endif
        MEASURE("no libnccl.so.2 on this machine: '%s'", log_last_error());
        return;
    }
    const int v = nccl_lib_version(lib);
    CHECK(v >= 21400, "NCCL version %d is 2.14 or later", v);
    uint8_t a[NCCL_COMM_ID_BYTES], b[NCCL_COMM_ID_BYTES], zero[NCCL_COMM_ID_BYTES] = {0};
    memset(a, 0, sizeof(a));
    memset(b, 0, sizeof(b));
    CHECK(nccl_lib_unique_id(lib, a) == 0 && nccl_lib_unique_id(lib, b) == 0, "unique ids");
    CHECK(memcmp(a, zero, sizeof(a)) && memcmp(a, b, sizeof(a)),
          "two unique ids are set and differ");

    struct nccl_comm_config cfg = {.lib = lib, .id = a, .rank = 7, .init_timeout_s = 1.0,
                                   .name = "test pair"};
    CHECK(!nccl_comm_create(&cfg) && strstr(log_last_error(), "rank 7"), "rank 7 refused: '%s'",
          log_last_error());
    cfg.rank = NCCL_COMM_RANK_RECEIVER;
    const double t0 = now_s();
    struct nccl_comm *c = nccl_comm_create(&cfg); /* nobody joins as rank 0 */
    const double dt = now_s() - t0;
    CHECK(!c, "a pair whose peer never joins is refused");
    CHECK(dt < 30.0, "and that takes %.1f s, not forever", dt);
    nccl_comm_destroy(c);
    MEASURE("NCCL %d: unique ids differ; bad rank refused; lone rank refused after %.2f s "
            "('%s')", v, dt, log_last_error());
    nccl_lib_close(lib);
}

int main(void)
{
    log_init("test", -1);
    test_missing_library();
    test_real_library();
    return test_main_result("test_nccl");
}
