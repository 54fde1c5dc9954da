/*
 * caps: the current card's compute capability and opt-in shared memory, as
 * the launchers of kernels/cuda choose their paths by them, and
 * LAMINA_CUDA_AS_SM, which lowers both to a consumer card's (caps.h).
 *
 * The build's device code is read from a one-line kernel of this file
 * (cudaFuncGetAttributes: ptxVersion is the virtual architecture it was
 * compiled for, 90 in a plain sm_90 build, 75 in one for compute_75, 80
 * where the driver compiled the build's compute_80 PTX for a card it has no
 * code of its own for): the capability the launchers see is never above it,
 * a lowered capability is refused where the kernels were compiled for a
 * later one, and a card the build has no code for is named as such.
 */
#include <errno.h>
#include <stdlib.h>

#include <atomic>
#include <mutex>

#include <cuda_runtime.h>

extern "C" {
#include "common/log.h"
}

#include "kernels/cuda/caps.h"

/* Compiled like every kernel of the library: its attributes say for which
 * virtual architecture the build's device code was made, and launched
 * (cuda_caps_probe) it writes that architecture as its code sees it. */
static __global__ void caps_probe_kernel(int *p)
{
    extern __shared__ int caps_smem[];
    if (p) {
#if defined(__CUDA_ARCH__)
        caps_smem[0] = __CUDA_ARCH__;
#else
        caps_smem[0] = 0;
#endif
        *p = caps_smem[0];
    }
}

extern "C" int cuda_caps_smem_optin_of(int cc)
{
    switch (cc) {
    case 75:
        return 65536;
    case 80:
    case 87:
        return 166912;
    case 86:
    case 89:
    case 120:
    case 121:
        return 101376;
    case 90:
    case 100:
    case 103:
        return 232448;
    default:
        return 0;
    }
}

extern "C" int cuda_caps_parse_as_sm(const char *value)
{
    if (!value || !*value)
        return 0;
    char *end = nullptr;
    const long v = strtol(value, &end, 10);
    if (*end || v <= 0 || v > 1000 || !cuda_caps_smem_optin_of(static_cast<int>(v)))
        return -EINVAL;
    return static_cast<int>(v);
}

/* What caps_card reads of a card. */
struct caps_card_facts {
    int cc;    /* 10 x major + minor */
    int optin; /* opt-in shared memory a block, bytes */
    int ptx;   /* the virtual architecture of the build's code for it */
    int sms;   /* multiprocessors */
};

/* The facts per device index: written once each (the same value by any
 * thread that races), so that a launcher's question costs an atomic load.
 * Bit 63 set once filled; capability in bits 0-9, the build's code's
 * architecture in 10-19, the opt-in shared memory in 20-39, the
 * multiprocessors in 40-50. */
constexpr int kCapsDevices = 64;
static std::atomic<uint64_t> caps_cache[kCapsDevices];

/* The current card's facts; -EIO (logged) where a query fails, -ENOTSUP
 * (logged) where the build has no code for the card. */
static int caps_card(struct caps_card_facts *f)
{
    int dev = 0, major = 0, minor = 0;
    cudaError_t e = cudaGetDevice(&dev);
    const uint64_t c = e == cudaSuccess && dev >= 0 && dev < kCapsDevices
                           ? caps_cache[dev].load(std::memory_order_relaxed)
                           : 0;
    if (c >> 63) {
        f->cc = static_cast<int>(c & 1023);
        f->ptx = static_cast<int>((c >> 10) & 1023);
        f->optin = static_cast<int>((c >> 20) & 0xFFFFF);
        f->sms = static_cast<int>((c >> 40) & 2047);
        return 0;
    }
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&f->optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&f->sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) {
        log_error("cuda caps: device query failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    f->cc = 10 * major + minor;
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, caps_probe_kernel);
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
        (void)cudaGetLastError();
        log_error("cuda caps: this build has no device code for the card (compute capability "
                  "%d.%d); rebuild with CUDA_ARCHS naming sm_%d (README)",
                  major, minor, f->cc);
        return -ENOTSUP;
    }
    if (e != cudaSuccess) {
        log_error("cuda caps: kernel attributes: %s", cudaGetErrorString(e));
        return -EIO;
    }
    f->ptx = fa.ptxVersion;
    if (dev < kCapsDevices && f->cc > 0 && f->cc < 1024 && f->ptx >= 0 && f->ptx < 1024 &&
        f->optin >= 0 && f->optin < 0x100000 && f->sms > 0 && f->sms < 2048)
        caps_cache[dev].store(1ull << 63 | static_cast<uint64_t>(f->sms) << 40 |
                                  static_cast<uint64_t>(f->optin) << 20 |
                                  static_cast<uint64_t>(f->ptx) << 10 |
                                  static_cast<uint64_t>(f->cc),
                              std::memory_order_relaxed);
    return 0;
}

extern "C" int cuda_caps_get(int *cc, int *smem_optin)
{
    struct caps_card_facts f;
    int rc = caps_card(&f);
    if (rc)
        return rc;
    int card = f.cc, optin = f.optin;
    const int ptx = f.ptx;
    const char *env = getenv("LAMINA_CUDA_AS_SM");
    const int as = cuda_caps_parse_as_sm(env);
    if (as < 0) {
        log_error("cuda caps: LAMINA_CUDA_AS_SM=%s is not a compute capability lamina knows "
                  "(75, 80, 86, 87, 89, 90, 100, 103, 120, 121)",
                  env);
        return -EINVAL;
    }
    int eff = card;
    if (as && as < card) {
        if (ptx > as) {
            log_error("cuda caps: LAMINA_CUDA_AS_SM=%d, but this build's device code is for "
                      "compute_%d: rebuild with CUDA_ARCHS=\"-gencode=arch=compute_%d,"
                      "code=sm_%d\"",
                      as, ptx, as, card);
            return -ENOTSUP;
        }
        eff = as;
        const int lowered = cuda_caps_smem_optin_of(as);
        optin = lowered < optin ? lowered : optin;
    }
    /* code for an older architecture than the card's (PTX compiled for the
     * card by the driver, or a build for compute_NN): the host takes the
     * paths that code has, or the two would disagree (a cluster launch of a
     * kernel compiled without clusters) */
    if (ptx > 0 && ptx < eff)
        eff = ptx;
    if (cc)
        *cc = eff;
    if (smem_optin)
        *smem_optin = optin;
    return 0;
}

extern "C" int cuda_caps_sms(void)
{
    struct caps_card_facts f;
    return caps_card(&f) ? 0 : f.sms;
}

extern "C" int cuda_caps_cc(void)
{
    int cc = 0;
    return cuda_caps_get(&cc, nullptr) ? 0 : cc;
}

/* Kernel attributes, asked of the driver once per kernel and device: the
 * launchers ask at every launch (cuda_caps_allow_smem, cuda_caps_fits_default)
 * and cudaFuncGetAttributes is a driver call each time. Past the table's
 * size the driver is asked every time, as before. */
struct caps_fn {
    const void *kernel;
    int dev;
    size_t stat;    /* static shared memory a block */
    size_t allowed; /* dynamic bytes cudaFuncSetAttribute granted (0: none asked) */
};
static caps_fn caps_fns[256];
static int caps_n_fns;
static std::mutex caps_mu;

/* The kernel's static shared memory on the current device into *stat, and
 * its entry's index in caps_fns (-1: not kept); the driver's error where it
 * does not answer (cleared). */
static cudaError_t caps_fn_stat(const void *kernel, size_t *stat, int *at)
{
    int dev = 0;
    *at = -1;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return e;
    }
    std::lock_guard<std::mutex> lock(caps_mu);
    for (int i = 0; i < caps_n_fns; i++) {
        if (caps_fns[i].kernel == kernel && caps_fns[i].dev == dev) {
            *stat = caps_fns[i].stat;
            *at = i;
            return cudaSuccess;
        }
    }
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, kernel);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return e;
    }
    *stat = fa.sharedSizeBytes;
    if (caps_n_fns < static_cast<int>(sizeof caps_fns / sizeof caps_fns[0])) {
        caps_fns[caps_n_fns] = caps_fn{kernel, dev, fa.sharedSizeBytes, 0};
        *at = caps_n_fns++;
    }
    return cudaSuccess;
}

extern "C" void cuda_caps_forget(void)
{
    std::lock_guard<std::mutex> lock(caps_mu);
    caps_n_fns = 0;
}

extern "C" int cuda_caps_allow_smem(const void *kernel, size_t bytes, const char *what)
{
    int optin = 0;
    int rc = cuda_caps_get(nullptr, &optin);
    if (rc)
        return rc;
    size_t stat = 0;
    int at = -1;
    cudaError_t e = caps_fn_stat(kernel, &stat, &at);
    if (e == cudaSuccess && bytes + stat > static_cast<size_t>(optin)) {
        log_error("%s: %zu bytes of shared memory a block (%zu of them static), past the "
                  "card's %d",
                  what, bytes + stat, stat, optin);
        return -ENOTSUP;
    }
    if (at >= 0) {
        std::lock_guard<std::mutex> lock(caps_mu);
        if (caps_fns[at].allowed == bytes) /* granted before: the attribute holds */
            return 0;
    }
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(bytes));
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        log_error("%s: %zu bytes of shared memory refused: %s", what, bytes,
                  cudaGetErrorString(e));
        return -EIO;
    }
    if (at >= 0) {
        std::lock_guard<std::mutex> lock(caps_mu);
        caps_fns[at].allowed = bytes;
    }
    return 0;
}

extern "C" bool cuda_caps_fits_default(const void *kernel, size_t bytes)
{
    size_t stat = 0;
    int at = -1;
    return caps_fn_stat(kernel, &stat, &at) == cudaSuccess && bytes + stat <= 48 * 1024;
}

extern "C" int cuda_caps_probe(int *d_arch, size_t smem, cudaStream_t stream)
{
    if (!d_arch || smem < sizeof(int)) {
        log_error("cuda_caps_probe: bad arguments (arch %p, %zu bytes of shared memory)",
                  static_cast<void *>(d_arch), smem);
        return -EINVAL;
    }
    const int rc = cuda_caps_allow_smem((const void *)caps_probe_kernel, smem, "cuda_caps_probe");
    if (rc)
        return rc;
    caps_probe_kernel<<<1, 1, smem, stream>>>(d_arch);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        log_error("cuda_caps_probe: launch failed: %s", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
