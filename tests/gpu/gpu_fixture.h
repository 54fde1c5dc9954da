/*
 * gpu_fixture: the conformance checkpoint the GPU backend tests load
 * (conformance/ARCH/ARCH-f32.gguf of the shared fixtures).
 */
#ifndef TESTS_GPU_GPU_FIXTURE_H
#define TESTS_GPU_GPU_FIXTURE_H

#include <stdio.h>

#include "model/arch.h"
#include "model/gguf.h"
#include "tests/check.h"

/* Opens the f32 checkpoint of arch into *g and loads its model; NULL (a
 * failed CHECK) when either fails. The caller frees both. */
static inline struct arch_model *gpu_fixture_model(const char *arch, struct gguf **g)
{
    char path[512], rel[256];
    snprintf(rel, sizeof(rel), "conformance/%s/%s-f32.gguf", arch, arch);
    struct gguf_config gc = {.path = test_fixture(path, sizeof(path), rel)};
    *g = gguf_open(&gc);
    struct arch_config ac = {.gguf = *g};
    struct arch_model *m = *g ? arch_load(&ac) : NULL;
    CHECK(m != NULL, "%s: %s loads", arch, path);
    return m;
}

#endif
