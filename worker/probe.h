/*
 * probe: the measured speeds of one device, which the placement planner
 * uses for the layer split and the value of a byte of device memory
 * (issue 5, "unequal cards"; architecture.md, "Memory tiers and placement").
 *
 *  - cpu: a GEMV with the CPU matvec kernel (kernels/cpu/matvec.h) on every
 *    given thread over a PROBE_CPU_BYTES matrix, larger than the caches: the
 *    rate at which host memory is read by the code that reads it (the CPU
 *    backend, the coordinator's expert pool).
 *  - cuda:N: a GEMV with cuda_matvec (kernels/cuda/matvec.h) over a
 *    PROBE_GPU_BYTES matrix in device memory (HBM rate), and a copy of
 *    PROBE_COPY_BYTES from pinned host memory to the device (bus rate: the
 *    price of the bytes that stay in host memory).
 *
 * Each measurement is one warm-up pass, then the median of PROBE_REPEATS
 * timed passes (CUDA: cudaEvents on one stream); a probe takes well under
 * 300 ms on an H200 host after the CUDA context exists. The matrix holds a
 * constant byte pattern (finite, normal scales), and rows are 4096 elements
 * of the type given (the model's expert type: speeds differ by type).
 *
 * Process rules: the coordinator calls these from its main thread before it
 * starts any worker (and `lamina plan --probe`), when nothing else runs on
 * the device. A CUDA probe numbers cards in PCI bus order (as workers do:
 * it sets CUDA_DEVICE_ORDER), creates the card's primary context and resets
 * it (cudaDeviceReset) at the end, so the process keeps no device memory;
 * never call it in a process that uses that card for anything else.
 */
#ifndef WORKER_PROBE_H
#define WORKER_PROBE_H

#include <stdint.h>

#define PROBE_CPU_BYTES (256u << 20)  /* matrix of the CPU GEMV, bytes */
#define PROBE_GPU_BYTES (512u << 20)  /* matrix of the CUDA GEMV, bytes */
#define PROBE_COPY_BYTES (256u << 20) /* pinned host -> device copy, bytes */
#define PROBE_REPEATS 5               /* timed passes; the median counts */
#define PROBE_ROW_ELEMS 4096          /* elements per matrix row */

struct probe_result {
    double gemv_bw;  /* bytes/s a GEMV reads the device's own memory at */
    double h2d_bw;   /* bytes/s from pinned host memory to the device; 0 for cpu */
    double ms;       /* wall time of the whole probe (CUDA: context creation included), ms */
    uint32_t type;   /* enum quant_type of the matrix actually used */
    int threads;     /* cpu: threads that ran the GEMV; 0 for CUDA */
    uint64_t mem_total, mem_free; /* CUDA: bytes of the card, and free before the probe; 0 cpu */
};

/* Host memory: a GEMV of `type` (Q4_0 when the CPU kernel lacks it) on
 * `threads` threads (<= 0: one per physical core). Returns 0 and fills *out,
 * or -ENOMEM (logged). Blocks for the probe's duration. */
int probe_cpu(int threads, uint32_t type, struct probe_result *out);

/* CUDA card `device` (PCI bus order): GEMV of `type` (Q4_0 when cuda_matvec
 * lacks it) and the pinned copy. Returns 0 and fills *out; -ENODEV when the
 * card does not exist or the build has no CUDA, -ENOMEM, -EIO on a failed
 * CUDA call (each logged once). Blocks; leaves no context on the card. */
int probe_cuda(int device, uint32_t type, struct probe_result *out);

/* Probes a device named as on the command line: "cpu" (probe_cpu with
 * `threads`) or "cuda:N" (probe_cuda). Returns as those, or -EINVAL (logged)
 * for any other name. */
int probe_device(const char *name, int threads, uint32_t type, struct probe_result *out);

#endif
