/*
 * tests/fixture: readers for the conformance fixtures' side files: integer
 * lists from refs.json (found by key after the architecture's entry; the file
 * is trusted test data) and float32 .npy arrays.
 */
#ifndef TESTS_FIXTURE_H
#define TESTS_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Reads a whole file; caller frees. NULL if unreadable. */
static inline char *fixture_read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        if (len)
            *len = (size_t)n;
    }
    return buf;
}

/* refs.json[arch][key] as ints into out (at most cap); returns the count or -1. */
static inline int fixture_refs_ints(const char *json, const char *arch, const char *key,
                                    int32_t *out, int cap)
{
    char pat[128];
    snprintf(pat, sizeof(pat), "\"%s\": {", arch);
    const char *p = strstr(json, pat);
    if (!p)
        return -1;
    snprintf(pat, sizeof(pat), "\"%s\": [", key);
    p = strstr(p, pat);
    if (!p)
        return -1;
    p += strlen(pat);
    int n = 0;
    while (*p && *p != ']' && n < cap) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) {
            p++;
            continue;
        }
        out[n++] = (int32_t)v;
        p = end;
    }
    return n;
}

/* A float32 C-order .npy file of 2 dims; returns the data (caller frees). */
static inline float *fixture_npy_f32(const char *path, int *rows, int *cols)
{
    size_t len;
    char *buf = fixture_read_all(path, &len);
    if (!buf || len < 10 || memcmp(buf, "\x93NUMPY", 6) != 0) {
        free(buf);
        return NULL;
    }
    size_t hl = (unsigned char)buf[8] | ((size_t)(unsigned char)buf[9] << 8);
    const char *hdr = buf + 10;
    const char *shape = strstr(hdr, "'shape': (");
    if (!strstr(hdr, "'descr': '<f4'") || strstr(hdr, "'fortran_order': True") || !shape ||
        sscanf(shape, "'shape': (%d, %d)", rows, cols) != 2 ||
        10 + hl + (size_t)*rows * *cols * 4 > len) {
        free(buf);
        return NULL;
    }
    float *out = malloc((size_t)*rows * *cols * 4);
    memcpy(out, buf + 10 + hl, (size_t)*rows * *cols * 4);
    free(buf);
    return out;
}

#endif
