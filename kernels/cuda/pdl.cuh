/*
 * pdl: programmatic dependent launch (PDL) for the decode kernels. Private
 * to the .cu files of kernels/cuda; host C code never includes it.
 *
 * A kernel launched through pdl_launch on a device of compute capability 9.0
 * or later (and LAMINA_CUDA_PDL not "0") may start while the kernel before
 * it in the stream is still running; inside a stream capture the edge
 * becomes a programmatic graph edge (CUDA 12.3 and later). The contract of
 * every kernel launched so:
 *   - every thread calls pdl_wait() before its first read of anything an
 *     earlier kernel wrote (activations, expert ids, positions, states) and
 *     before its first global write (an earlier kernel may still read the
 *     buffer), on every path, early exits included;
 *   - before pdl_wait() it reads only what no kernel writes (weights), and
 *     may ask for them in L2 (pdl_prefetch_l2), or what a kernel two or
 *     more launches back wrote, through L2 (__ldcg), where its launcher
 *     says the caller guarantees that distance ("early" arguments: the
 *     kernel just before started only after it passed its own wait, so
 *     everything before it had completed), or, as a hint only, what the
 *     kernel just before is still writing, read again after the wait and
 *     used only where equal (mvq.cu's ids_poll: the router's expert ids);
 *   - one exception to the two rules above: where its launcher's caller guarantees
 *     that the kernel just before neither reads nor writes its outputs, and its
 *     inputs were written two or more launches back (mvq.cu's cuda_mvq_xq_beside),
 *     it computes and stores before pdl_wait(), which it then calls at its end;
 *   - it calls pdl_trigger() after pdl_wait(): the next kernel then starts
 *     its own prologue (weight prefetch) beside this one's main work, at most
 *     one kernel ahead (that kernel waits for this one to complete, which
 *     implies that everything before it completed).
 * pdl_wait returns at once where the launch had no programmatic edge (PDL
 * off, or a plain launch); on architectures before sm_90 the three device
 * helpers compile to nothing and pdl_launch launches as <<<>>> does.
 */
#ifndef KERNELS_CUDA_PDL_CUH
#define KERNELS_CUDA_PDL_CUH

#include <stdint.h>
#include <stdlib.h>

#include <utility>

#include <cuda_runtime.h>

#include "kernels/cuda/caps.h"

/* Waits until the kernels this one depends on have completed and their
 * writes are visible (griddepcontrol.wait). */
static __device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Lets the next kernel of the stream be scheduled once every block of this
 * one has called it or exited (griddepcontrol.launch_dependents). */
static __device__ __forceinline__ void pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Asks for [p, p + bytes) in L2 (one thread calls it; read-only data only).
 * Only the 16-byte aligned part inside the range is fetched, in pieces of at
 * most 64 KiB (cp.async.bulk.prefetch.L2). */
static __device__ __forceinline__ void pdl_prefetch_l2(const void *p, size_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uintptr_t a = (reinterpret_cast<uintptr_t>(p) + 15) & ~static_cast<uintptr_t>(15);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~static_cast<uintptr_t>(15);
    for (; a < end; a += 65536) {
        const uint32_t n = static_cast<uint32_t>(end - a < 65536 ? end - a : 65536);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n) : "memory");
    }
#else
    (void)p;
    (void)bytes;
#endif
}

/* Whether the current device has compute capability 9.0 or later (as
 * caps.h gives it: LAMINA_CUDA_AS_SM may lower it). */
static inline bool device_sm90()
{
    return cuda_caps_cc() >= 90;
}

/* Whether launches on the current device use PDL: compute capability 9.0 or
 * later and LAMINA_CUDA_PDL not "0" (read at each launch, so that a test
 * can compare both ways in one process). */
static inline bool pdl_on()
{
    const char *env = getenv("LAMINA_CUDA_PDL");
    if (env && env[0] == '0')
        return false;
    return device_sm90();
}

/* The shared memory carveout every launch through pdl_launch asks for (percent of the
 * SM's unified L1/shared memory, cudaLaunchAttributePreferredSharedMemoryCarveout). An SM
 * runs blocks of several kernels at once only in one split, chosen when it was idle for the
 * blocks it got then; a split the driver picks for a kernel of little shared memory (a
 * DeltaNet layer's products and conv + heads) leaves no room for the next kernels' blocks
 * (the router's 42 KB), which then wait for SMs to drain: PDL's overlap lost. One split for
 * every launch keeps them resident together. Default kCarveout: on an H200 (228 KB of shared
 * memory an SM at most) 50 % (a 132 KB split) decodes 4.8 % faster than the driver's choice,
 * 100 % 0.7 %, 60 % 3 %, 75 % 2 % slower, 40 %, 25 % and 10 % 4-7 % slower (less room for
 * the gate/up tiles beside the router; docs/perf.md). Measured on an H200 only: before
 * compute capability 9.0 (no PDL, so no overlap to keep) the default is the driver's
 * choice. LAMINA_CUDA_CARVEOUT=N (0-100) asks for N %, -1 for none (the driver's
 * choice); anything else: the default. Read at each launch, as pdl_on. */
constexpr int kCarveout = 50;

static inline int pdl_carveout()
{
    const char *env = getenv("LAMINA_CUDA_CARVEOUT");
    const int dflt = device_sm90() ? kCarveout : -1;
    if (!env || !*env)
        return dflt;
    char *end = nullptr;
    const long v = strtol(env, &end, 10);
    return *end || v < -1 || v > 100 ? dflt : static_cast<int>(v);
}

/* Launches kernel<<<grid, block, smem, stream>>>(args...) through
 * cudaLaunchKernelEx: blocks in thread block clusters of cluster_x
 * consecutive blocks along x where cluster_x > 1 (grid.x a multiple of it,
 * at most 8; compute capability 9.0 or later, which the caller checks), with
 * the shared memory carveout `carveout` (percent; -1: none, the driver's
 * choice) where it is set, and
 * with the programmatic stream serialization attribute where pdl_on(). The
 * kernel keeps the contract above. Errors are left for cudaGetLastError, as
 * after <<<>>>. */
template <typename... P, typename... A>
static inline void pdl_launch_cv(void (*kernel)(P...), dim3 grid, dim3 block, unsigned cluster_x,
                                 int carveout, size_t smem, cudaStream_t stream, A &&...args)
{
    cudaLaunchAttribute attr[3];
    unsigned n_attrs = 0;
    if (carveout >= 0) {
        attr[n_attrs].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
        attr[n_attrs++].val.sharedMemCarveout = static_cast<unsigned>(carveout);
    }
    if (cluster_x > 1) {
        attr[n_attrs].id = cudaLaunchAttributeClusterDimension;
        attr[n_attrs].val.clusterDim.x = cluster_x;
        attr[n_attrs].val.clusterDim.y = 1;
        attr[n_attrs++].val.clusterDim.z = 1;
    }
    if (pdl_on()) {
        attr[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n_attrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = n_attrs;
    (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

/* pdl_launch_cv with pdl_carveout(): what every launch asks for. */
template <typename... P, typename... A>
static inline void pdl_launch_cluster(void (*kernel)(P...), dim3 grid, dim3 block,
                                      unsigned cluster_x, size_t smem, cudaStream_t stream,
                                      A &&...args)
{
    pdl_launch_cv(kernel, grid, block, cluster_x, pdl_carveout(), smem, stream,
                  std::forward<A>(args)...);
}

/* pdl_launch_cluster without clusters. */
template <typename... P, typename... A>
static inline void pdl_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, A &&...args)
{
    pdl_launch_cluster(kernel, grid, block, 1, smem, stream, std::forward<A>(args)...);
}

#endif
