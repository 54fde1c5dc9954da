/*
 * stats: the order statistics the benchmarks and diagnostics share (the
 * medians of `lamina bench`, the bandwidth probes, graph_trace and the CUDA
 * backend's probe report).
 */
#ifndef COMMON_STATS_H
#define COMMON_STATS_H

#include <stddef.h>

/* qsort's comparison of two doubles, ascending. */
int stats_cmp_double(const void *a, const void *b);

/* The median of v[0..n), sorting v in place: the middle value, the mean of
 * the two middle ones for an even n, 0 for none. */
double stats_median(double *v, size_t n);

#endif
