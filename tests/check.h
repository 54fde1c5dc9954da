/*
 * tests/check: the assertion macros of the test binaries.
 *
 * CHECK(cond, fmt, ...) records a failure with file:line and keeps going;
 * test_main_result() returns the exit code. Measurements worth printing in CI
 * go through MEASURE(), which tests/run.sh shows for passing tests too.
 */
#ifndef TESTS_CHECK_H
#define TESTS_CHECK_H

#include <stdio.h>

static int check_failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            check_failures++;                                                                      \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

#define MEASURE(...)                                                                               \
    do {                                                                                           \
        printf("[measure] " __VA_ARGS__);                                                          \
        putchar('\n');                                                                             \
        fflush(stdout);                                                                            \
    } while (0)

static inline int test_main_result(const char *name)
{
    if (check_failures)
        fprintf(stderr, "%s: %d check(s) failed\n", name, check_failures);
    else
        printf("%s: all checks passed\n", name);
    return check_failures ? 1 : 0;
}

/* Path of a file under ../shared/fixtures (LAMINA_FIXTURES overrides). */
static inline const char *test_fixture(char *buf, size_t len, const char *rel)
{
    extern char *getenv(const char *);
    const char *root = getenv("LAMINA_FIXTURES");
    snprintf(buf, len, "%s/%s", root ? root : "../shared/fixtures", rel);
    return buf;
}

#endif
