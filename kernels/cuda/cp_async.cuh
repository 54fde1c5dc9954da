/*
 * cp_async: copies from global into shared memory that run beside the
 * kernel's own work (cp.async, compute capability 8.0 and later; the
 * functions do nothing when compiled for older devices, whose kernels
 * must not take these paths). Private to the .cu files of kernels/cuda.
 *
 * A thread's copies are grouped by cp_commit(); cp_wait<N>() returns once
 * at most N of its newest groups are still in flight. Another thread's
 * copies are visible only after the wait and a barrier (__syncthreads),
 * which is also what keeps the compiler from moving shared loads above
 * the wait.
 */
#ifndef KERNELS_CUDA_CP_ASYNC_CUH
#define KERNELS_CUDA_CP_ASYNC_CUH

/* 16 bytes, both ends 16-byte aligned (through L2 only). */
__device__ __forceinline__ void cp16(void *dst, const void *src)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
#endif
}

/* 8 bytes, both ends 8-byte aligned. */
__device__ __forceinline__ void cp8(void *dst, const void *src)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(d), "l"(src));
#endif
}

/* 4 bytes, both ends 4-byte aligned. */
__device__ __forceinline__ void cp4(void *dst, const void *src)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src));
#endif
}

__device__ __forceinline__ void cp_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

#endif
