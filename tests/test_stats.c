/*
 * test_stats: common/stats. Checks: stats_cmp_double orders below, equal and
 * above (and signed zeros as equal); stats_median of no values is 0, of one
 * the value, of an odd count the middle one and of an even count the mean of
 * the two middle ones, whatever the input order (ascending, descending,
 * shuffled, with repeats and negatives), leaving the values sorted.
 */
#include "common/stats.h"

#include <stdbool.h>
#include <stdlib.h>

#include "tests/check.h"

static bool stats_sorted(const double *v, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (v[i - 1] > v[i])
            return false;
    return true;
}

static void stats_test_cmp(void)
{
    const double a = 1.5, b = 2.0, pz = 0.0, nz = -0.0;
    CHECK(stats_cmp_double(&a, &b) < 0, "1.5 against 2: not below");
    CHECK(stats_cmp_double(&b, &a) > 0, "2 against 1.5: not above");
    CHECK(stats_cmp_double(&a, &a) == 0, "1.5 against itself: not equal");
    CHECK(stats_cmp_double(&pz, &nz) == 0, "+0 against -0: not equal");
}

static void stats_test_median(void)
{
    CHECK(stats_median(NULL, 0) == 0.0, "the median of nothing is not 0");
    double one[] = {-3.25};
    CHECK(stats_median(one, 1) == -3.25, "the median of one value: %g", one[0]);
    double odd[] = {9, -1, 4, 4, 7}; /* sorted: -1 4 4 7 9 */
    CHECK(stats_median(odd, 5) == 4.0, "odd count: median %g, want 4", stats_median(odd, 5));
    CHECK(stats_sorted(odd, 5), "odd count: values left unsorted");
    double even[] = {10, 2, 8, 4}; /* sorted: 2 4 8 10 */
    double m = stats_median(even, 4);
    CHECK(m == 6.0, "even count: median %g, want 6 (the mean of 4 and 8)", m);
    CHECK(stats_sorted(even, 4), "even count: values left unsorted");
    /* 1..n in three orders: the median (n + 1) / 2 each time */
    enum { N = 101 };
    double v[N];
    for (int order = 0; order < 3; order++) {
        for (int i = 0; i < N; i++)
            v[i] = order == 0 ? i + 1 : order == 1 ? N - i : (double)((i * 37) % N + 1);
        m = stats_median(v, N);
        CHECK(m == 51.0, "order %d of 1..%d: median %g, want 51", order, N, m);
        CHECK(stats_sorted(v, N), "order %d: values left unsorted", order);
        m = stats_median(v, N - 1); /* 1..100 */
        CHECK(m == 50.5, "1..%d: median %g, want 50.5", N - 1, m);
    }
}

int main(void)
{
    stats_test_cmp();
    stats_test_median();
    return test_main_result("test_stats");
}
