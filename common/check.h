/*
 * check: the error-check wrappers around foreign APIs, and ASSERT for bugs.
 *
 * SYS_CHECK(expr) evaluates a libc call returning -1/errno style; on failure it
 * logs file:line, the call and strerror, and evaluates to -errno; on success
 * to 0. It never returns or jumps: write `if (SYS_CHECK(x)) goto out;`.
 * ASSERT is always on: it is for broken invariants of our own code, never for
 * bad input (that returns an error).
 */
#ifndef COMMON_CHECK_H
#define COMMON_CHECK_H

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static inline int check_sys(long rc, const char *what, const char *file, int line)
{
    if (rc >= 0)
        return 0;
    int e = errno ? errno : EIO;
    if (log_is_enabled(LOG_LEVEL_ERROR))
        log_write(LOG_LEVEL_ERROR, file, line, "%s failed: %s", what, strerror(e));
    return -e;
}

#define SYS_CHECK(expr) check_sys((long)(expr), #expr, __FILE__, __LINE__)

#define ASSERT(cond)                                                                               \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            log_write(LOG_LEVEL_ERROR, __FILE__, __LINE__, "assertion failed: %s", #cond);         \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif
