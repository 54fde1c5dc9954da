/*
 * cuda caps: what the current card can do, as every launcher of kernels/cuda
 * asks it: its compute capability (10 x major + minor: 75, 86, 89, 90) and
 * the shared memory a block may opt in to. The launchers choose their paths
 * by these (clusters, programmatic dependent launch and the bulk copies on
 * 9.0 and later, cp.async and the tensor-core prefill from 8.0, larger tiles
 * where the shared memory allows) and by nothing else, so that one switch
 * can put a card in another card's place:
 *
 * LAMINA_CUDA_AS_SM=NN (a known capability below the card's) lowers both to
 * those of an sm_NN card. With a build whose device code was compiled for
 * the virtual architecture compute_NN (`CUDA_ARCHS=-gencode=arch=compute_NN,
 * code=sm_90` for an H200: __CUDA_ARCH__ is NN0 in the kernels), an H200 then
 * runs the code paths a consumer card runs, device and host side alike
 * (tools/device-check.sh, AS_SM). Where the build's device code is for a
 * later architecture than NN the queries fail (-ENOTSUP, logged): the card
 * would run code that NN lacks, and nothing it measured would hold.
 * Unset or empty: the card as it is.
 */
#ifndef KERNELS_CUDA_CAPS_H
#define KERNELS_CUDA_CAPS_H

#include <stdbool.h>
#include <stddef.h>

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The opt-in shared memory of one block (bytes) on a card of capability cc:
 * 65536 on 7.5, 166912 on 8.0 and 8.7, 101376 on 8.6, 8.9 and 12.x, 232448
 * on 9.0 and 10.x; 0 for a capability not in that list. */
int cuda_caps_smem_optin_of(int cc);

/* `value` (LAMINA_CUDA_AS_SM's text) as a capability: 0 for NULL or "",
 * else a capability cuda_caps_smem_optin_of knows, or -EINVAL. */
int cuda_caps_parse_as_sm(const char *value);

/* The current device's capability into *cc and its opt-in shared memory per
 * block into *smem_optin (either may be NULL), both lowered under
 * LAMINA_CUDA_AS_SM (read at each call), the capability never above the
 * architecture the build's code for the card was compiled for (a card
 * running the build's compute_80 PTX, compiled by the driver, is an 8.0 card
 * to the launchers). The card's facts are read once per device. 0; -EIO
 * where the device cannot be asked, -EINVAL for a LAMINA_CUDA_AS_SM not
 * understood, -ENOTSUP where it asks for an architecture older than the
 * build's device code or where the build has no code for the card (all
 * logged). */
int cuda_caps_get(int *cc, int *smem_optin);

/* The current device's capability, 0 where cuda_caps_get fails (logged
 * there): for launchers choosing a path, "at least 90" and "at least 80" are
 * then false and they take the plainest one. */
int cuda_caps_cc(void);

/* The current device's multiprocessor count (read once per device), 0
 * where it cannot be read (logged). */
int cuda_caps_sms(void);

/* Lets `kernel` (a __global__ function) launch with `bytes` of dynamic
 * shared memory: 0; -ENOTSUP where they and its static shared memory pass
 * the card's opt-in limit as cuda_caps_get gives it, -EIO where the runtime
 * refuses (both logged with `what`). */
int cuda_caps_allow_smem(const void *kernel, size_t bytes, const char *what);

/* Both ask the driver once per kernel and device and keep the answer (and
 * what cuda_caps_allow_smem granted); a cudaDeviceReset drops the context's
 * attributes, so whoever resets calls this after it. */
void cuda_caps_forget(void);

/* Whether `kernel` (a __global__ function) launches with `bytes` of dynamic
 * shared memory without opting in: they and its static shared memory within
 * 48 KiB (false where its attributes cannot be read). */
bool cuda_caps_fits_default(const void *kernel, size_t bytes);

/* Enqueues a one-thread kernel with `smem` bytes of dynamic shared memory
 * (at least an int; cuda_caps_allow_smem first) that writes __CUDA_ARCH__
 * as its code was compiled (900 in a plain sm_90 build, 750 in one for
 * compute_75) to *d_arch (device memory): what the card runs, for tests and
 * tools/device-check.sh. 0; -EINVAL, cuda_caps_allow_smem's codes, -EIO for
 * a failed launch (logged). */
int cuda_caps_probe(int *d_arch, size_t smem, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
