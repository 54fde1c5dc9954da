/*
 * stats: see stats.h.
 */
#include "common/stats.h"

#include <stdlib.h>

int stats_cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double stats_median(double *v, size_t n)
{
    if (!n)
        return 0.0;
    qsort(v, n, sizeof(*v), stats_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
