/*
 * test_caps_cuda: the card as the kernels see it (kernels/cuda/caps.h).
 *   - without LAMINA_CUDA_AS_SM (as the test starts, unless the call set
 *     it): the capability is the card's own or, where lower, that of the
 *     code it runs (the probe kernel writes its __CUDA_ARCH__), the opt-in
 *     shared memory and multiprocessors the card's;
 *   - with LAMINA_CUDA_AS_SM set by the caller (tools/device-check.sh
 *     with a pack staged with AS_SM=NN): the capability is NN, the shared
 *     memory NN's, and the probe kernel's code was compiled for compute_NN;
 *   - the probe launches with exactly the opt-in limit less its static
 *     memory and is refused (-ENOTSUP) a byte past it, the lowered limit
 *     included, where the card itself would allow it; launches again with
 *     the kept grant, and after a cudaDeviceReset and cuda_caps_forget;
 *   - LAMINA_CUDA_AS_SM set here: text that is not a known capability is
 *     -EINVAL; one at or above the card's leaves the card as it is; one
 *     below the build's device code is -ENOTSUP (it cannot be honoured);
 *   - cuda_caps_smem_optin_of and cuda_caps_parse_as_sm on their table.
 * Needs a CUDA device: exits 1 with a message when there is none.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "common/log.h"
#include "kernels/cuda/caps.h"
#include "tests/check.h"
#include "tests/gpu/gpu_check.h"

/* The probe's architecture with `smem` bytes of shared memory; the
 * launcher's code in *rc, -1 as the architecture where it refused. */
static int tc_probe(int *d_arch, size_t smem, int *rc)
{
    int arch = -1;
    CU(cudaMemset(d_arch, 0xff, sizeof(int)));
    *rc = cuda_caps_probe(d_arch, smem, 0);
    if (*rc)
        return -1;
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(&arch, d_arch, sizeof(int), cudaMemcpyDeviceToHost));
    return arch;
}

static void test_table(void)
{
    CHECK(cuda_caps_smem_optin_of(75) == 65536, "sm_75: %d", cuda_caps_smem_optin_of(75));
    CHECK(cuda_caps_smem_optin_of(86) == 101376 && cuda_caps_smem_optin_of(89) == 101376,
          "sm_86 / sm_89: %d / %d", cuda_caps_smem_optin_of(86), cuda_caps_smem_optin_of(89));
    CHECK(cuda_caps_smem_optin_of(90) == 232448, "sm_90: %d", cuda_caps_smem_optin_of(90));
    CHECK(cuda_caps_smem_optin_of(70) == 0 && cuda_caps_smem_optin_of(0) == 0,
          "unknown capabilities have no limit");
    CHECK(cuda_caps_parse_as_sm(NULL) == 0 && cuda_caps_parse_as_sm("") == 0, "unset");
    CHECK(cuda_caps_parse_as_sm("75") == 75 && cuda_caps_parse_as_sm("89") == 89, "75, 89");
    const char *bad[] = {"7.5", "sm_75", "74", "75x", "-75", "0", "99999999999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(cuda_caps_parse_as_sm(bad[i]) == -EINVAL, "'%s' accepted", bad[i]);
}

int main(void)
{
    log_init("test", -1);
    int n_dev = 0, dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "test_caps_cuda: no CUDA device present\n");
        return 1;
    }
    test_table();
    struct cudaDeviceProp prop;
    CU(cudaGetDevice(&dev));
    CU(cudaGetDeviceProperties(&prop, dev));
    const int card = 10 * prop.major + prop.minor;
    const char *as_env = getenv("LAMINA_CUDA_AS_SM");
    char as_saved[16] = "";
    if (as_env)
        snprintf(as_saved, sizeof(as_saved), "%s", as_env);
    const int as = cuda_caps_parse_as_sm(as_saved);
    CHECK(as >= 0, "LAMINA_CUDA_AS_SM=%s from the caller is not understood", as_saved);
    int *d_arch;
    CU(cudaMalloc((void **)&d_arch, sizeof(int)));

    /* the probe first: the architecture of the code the card runs */
    int prc;
    const int arch = tc_probe(d_arch, sizeof(int), &prc);
    CHECK(prc == 0 && arch > 0 && arch <= 10 * card, "probe: rc %d, arch %d on sm_%d", prc, arch,
          card);
    const int code = arch > 0 ? arch / 10 : card; /* the capability the kernels are for */

    int cc = 0, optin = 0, rc;
    rc = cuda_caps_get(&cc, &optin);
    const bool lowered = as > 0 && as < card;
    int want_cc = lowered ? as : card;
    want_cc = code < want_cc ? code : want_cc;
    int want_optin = (int)prop.sharedMemPerBlockOptin;
    if (lowered && cuda_caps_smem_optin_of(as) < want_optin)
        want_optin = cuda_caps_smem_optin_of(as);
    CHECK(rc == 0 && cc == want_cc && optin == want_optin,
          "caps: rc %d, capability %d (want %d), shared memory %d (want %d)", rc, cc, want_cc,
          optin, want_optin);
    CHECK(cuda_caps_cc() == want_cc, "cuda_caps_cc %d, want %d", cuda_caps_cc(), want_cc);
    CHECK(cuda_caps_sms() == prop.multiProcessorCount, "cuda_caps_sms %d, the card has %d",
          cuda_caps_sms(), prop.multiProcessorCount);
    if (lowered)
        CHECK(arch == 10 * as, "LAMINA_CUDA_AS_SM=%d but the kernels' code is for %d", as, arch);
    MEASURE("card sm_%d (%s), kernels compiled for %d, seen as sm_%d with %d bytes of shared "
            "memory a block",
            card, prop.name, arch, cc, optin);
    int full = tc_probe(d_arch, (size_t)optin, &prc);
    CHECK(prc == 0 && full == arch, "probe with %d bytes: rc %d, arch %d", optin, prc, full);
    full = tc_probe(d_arch, (size_t)optin + 1, &prc);
    CHECK(prc == -ENOTSUP && full == -1, "probe with %d + 1 bytes: rc %d (want -ENOTSUP)", optin,
          prc);
    CU(cudaGetLastError());
    /* the grant is kept (asked of the driver once), and asked again after a reset, which
     * drops it with the context (cuda_caps_forget) */
    full = tc_probe(d_arch, (size_t)optin, &prc);
    CHECK(prc == 0 && full == arch, "probe with %d bytes again: rc %d, arch %d", optin, prc, full);
    CU(cudaFree(d_arch));
    CU(cudaDeviceReset());
    cuda_caps_forget();
    CU(cudaMalloc((void **)&d_arch, sizeof(int)));
    full = tc_probe(d_arch, (size_t)optin, &prc);
    CHECK(prc == 0 && full == arch, "probe with %d bytes after a reset: rc %d, arch %d", optin,
          prc, full);
    CU(cudaGetLastError());

    /* the switch's own answers */
    setenv("LAMINA_CUDA_AS_SM", "sm_75", 1);
    CHECK(cuda_caps_get(&cc, &optin) == -EINVAL && cuda_caps_cc() == 0,
          "LAMINA_CUDA_AS_SM=sm_75 accepted");
    setenv("LAMINA_CUDA_AS_SM", "121", 1); /* at or above any card we run on */
    rc = cuda_caps_get(&cc, &optin);
    CHECK(card > 121 || (rc == 0 && cc == (code < card ? code : card) &&
                         optin == (int)prop.sharedMemPerBlockOptin),
          "LAMINA_CUDA_AS_SM=121 on sm_%d (code for %d): rc %d, capability %d, shared memory %d",
          card, code, rc, cc, optin);
    if (arch > 750 && card > 75) {
        /* this build's code is for a later architecture than 7.5: not honoured */
        setenv("LAMINA_CUDA_AS_SM", "75", 1);
        CHECK(cuda_caps_get(&cc, &optin) == -ENOTSUP, "LAMINA_CUDA_AS_SM=75 on code for %d",
              arch);
        CHECK(tc_probe(d_arch, sizeof(int), &prc) == -1 && prc == -ENOTSUP,
              "the probe ran as sm_75 on code for %d (rc %d)", arch, prc);
    }
    if (arch >= 860 && arch < 900 && card >= 90) {
        /* a build for compute_86 / 89 on a later card: the limit is the lower one */
        char v[8];
        snprintf(v, sizeof(v), "%d", arch / 10);
        setenv("LAMINA_CUDA_AS_SM", v, 1);
        CHECK(tc_probe(d_arch, 101377, &prc) == -1 && prc == -ENOTSUP,
              "101377 bytes allowed as sm_%s (rc %d)", v, prc);
    }
    if (as_saved[0])
        setenv("LAMINA_CUDA_AS_SM", as_saved, 1);
    else
        unsetenv("LAMINA_CUDA_AS_SM");
    CHECK(cuda_caps_cc() == want_cc, "the caller's setting restored: %d", cuda_caps_cc());
    CU(cudaFree(d_arch));
    return test_main_result("test_caps_cuda");
}
