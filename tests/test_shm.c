/*
 * Tests of ipc/shm: the expert segment made from the qwen3next q8_0
 * conformance fixture (8 layers x gate/up/down stacks of 16 experts).
 *   - layout: 2 MiB alignment, no overlap, sizes equal the arch matrices,
 *     a fused gate_up model, plan errors;
 *   - create: name, mode 0400, header, READY, progress, zero gaps, the
 *     creator's mapping is read-only (a write faults), same name twice fails
 *     without harming the first;
 *   - a child process (fork + exec of this binary with --compare-child NAME)
 *     opens the segment read-only with its own GGUF and compares every
 *     expert's bytes with the GGUF's; a wrong hash is refused;
 *   - a test-made segment with each header / table field corrupted is
 *     rejected by shm_open_ro with a message naming the field; a fuzz of
 *     shm_validate over random byte flips never crashes and never accepts a
 *     table that breaks the invariants;
 *   - shm_cleanup_stale removes the segment of a dead child (it _exit()s
 *     without unlinking) and keeps a live child's, ours and foreign names;
 *   - shm_unlink_name removes the name and keeps the mapping;
 *   - no /dev/shm/lamina-<our or our children's pid>-* is left.
 * `test_shm --create-helper` creates and destroys one segment (exit 0), or
 * exits 2 when creation failed for lack of room with the "need X bytes"
 * message, 1 otherwise: tests/sys_shm_small.sh runs it over a tiny tmpfs.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "ipc/shm.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "tests/check.h"

#define FIXTURE "conformance/qwen3next/qwen3next-q8_0.gguf"
#define FUZZ_ITERS 20000

struct tmodel {
    struct gguf *g;
    struct arch_model *m;
};

static int tmodel_open(struct tmodel *tm)
{
    char path[512];
    struct gguf_config gc = {.path = test_fixture(path, sizeof(path), FIXTURE)};
    tm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = tm->g};
    tm->m = tm->g ? arch_load(&ac) : NULL;
    return tm->m ? 0 : -1;
}

static void tmodel_close(struct tmodel *tm)
{
    arch_free(tm->m);
    gguf_close(tm->g);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The matrix of a layer that kind k stores (mirrors the planner's order). */
static const struct arch_matrix *layer_matrix(const struct arch_layer *ly, int k)
{
    const struct arch_matrix *m[SHM_KIND_COUNT] = {&ly->gate_exps, &ly->up_exps, &ly->down_exps,
                                                   &ly->gate_up_exps};
    return m[k];
}

/* Entries of /dev/shm whose name starts with prefix; the first into first. */
static int shm_dir_count(const char *prefix, char *first, size_t first_len)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (strncmp(de->d_name, prefix, strlen(prefix)) != 0)
            continue;
        if (n++ == 0 && first)
            snprintf(first, first_len, "/%s", de->d_name);
    }
    closedir(d);
    return n;
}

static bool shm_name_exists(const char *name)
{
    char path[128];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    return access(path, F_OK) == 0;
}

static bool last_error_has(const char *what)
{
    return strstr(log_last_error(), what) != NULL;
}

/* ---- layout ---- */

static void test_layout(const struct arch_model *m)
{
    struct shm_layout lay;
    CHECK(shm_layout_plan(m, &lay) == 0, "plan failed");
    if (!lay.entries)
        return;
    CHECK(lay.n_layers == m->hp.n_layer, "n_layers %u", lay.n_layers);
    CHECK(lay.n_entries == 3 * m->hp.n_layer, "n_entries %u, expected 3 per layer", lay.n_entries);
    size_t table_end = sizeof(struct shm_header) + lay.n_entries * sizeof(struct shm_entry);
    CHECK(lay.data_offset % SHM_ALIGN == 0 && lay.data_offset >= table_end,
          "data_offset %llu", (unsigned long long)lay.data_offset);
    CHECK(lay.total_bytes % SHM_ALIGN == 0 && shm_size(&lay) == lay.total_bytes, "total %llu",
          (unsigned long long)lay.total_bytes);
    uint64_t end = lay.data_offset, payload = 0;
    uint32_t i = 0;
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        for (int k = 0; k < SHM_KIND_COUNT; k++) {
            const struct arch_matrix *am = layer_matrix(&m->layers[l], k);
            if (!am->data)
                continue;
            const struct shm_entry *e = &lay.entries[i];
            CHECK(e->layer == l && e->kind == (uint32_t)k, "entry %u is layer %u kind %u", i,
                  e->layer, e->kind);
            CHECK(e->offset % SHM_ALIGN == 0, "entry %u offset %llu unaligned", i,
                  (unsigned long long)e->offset);
            CHECK(e->offset >= end, "entry %u overlaps the previous one", i);
            CHECK(e->type == am->type && e->n_expert == am->n_mat && e->n_in == am->n_in &&
                      e->n_out == am->n_out && e->row_bytes == am->row_bytes &&
                      e->bytes_per_expert == am->mat_bytes &&
                      e->bytes == am->n_mat * am->mat_bytes,
                  "entry %u does not describe %s", i, am->name);
            CHECK(strcmp(e->name, am->name) == 0, "entry %u name %s", i, e->name);
            CHECK(lay.src[i] == am->data, "entry %u source pointer", i);
            end = e->offset + e->bytes;
            payload += e->bytes;
            i++;
        }
    }
    CHECK(i == lay.n_entries, "walked %u entries", i);
    CHECK(end <= lay.total_bytes && lay.total_bytes - end < SHM_ALIGN, "total %llu, last end %llu",
          (unsigned long long)lay.total_bytes, (unsigned long long)end);
    CHECK(payload == lay.payload_bytes, "payload %llu", (unsigned long long)lay.payload_bytes);
    MEASURE("layout: %u entries, %llu payload bytes in a %llu-byte segment (data at %llu)",
            lay.n_entries, (unsigned long long)lay.payload_bytes,
            (unsigned long long)lay.total_bytes, (unsigned long long)lay.data_offset);
    shm_layout_free(&lay);
    CHECK(lay.entries == NULL && lay.n_entries == 0, "layout not cleared");
}

/* A model whose layers use the fused gate_up stack (copied from m's layers,
 * data pointing at buf). */
static void fused_model(const struct arch_model *m, struct arch_model *fm, struct arch_layer *ly,
                        uint8_t *buf)
{
    *fm = *m;
    fm->hp.n_layer = 2;
    fm->layers = ly;
    for (int l = 0; l < 2; l++) {
        ly[l] = m->layers[l];
        struct arch_matrix g = m->layers[l].gate_exps;
        ly[l].gate_exps = (struct arch_matrix){0};
        ly[l].up_exps = (struct arch_matrix){0};
        g.n_out *= 2;
        g.mat_bytes *= 2;
        g.data = buf;
        g.name = l ? "blk.1.ffn_gate_up_exps.weight" : "blk.0.ffn_gate_up_exps.weight";
        ly[l].gate_up_exps = g;
    }
}

static void test_layout_fused_and_errors(const struct tmodel *tm)
{
    const struct arch_model *m = tm->m;
    const struct arch_matrix *g0 = &m->layers[0].gate_exps;
    size_t fused_bytes = 2 * g0->n_mat * g0->mat_bytes;
    uint8_t *buf = malloc(fused_bytes);
    for (size_t i = 0; i < fused_bytes; i++)
        buf[i] = (uint8_t)(i * 131 + 7);
    struct arch_model fm;
    struct arch_layer ly[2];
    fused_model(m, &fm, ly, buf);

    struct shm_layout lay;
    CHECK(shm_layout_plan(&fm, &lay) == 0, "fused plan failed");
    CHECK(lay.n_entries == 4 && lay.entries[0].kind == SHM_KIND_DOWN &&
              lay.entries[1].kind == SHM_KIND_GATE_UP,
          "fused layout: %u entries", lay.n_entries);
    shm_layout_free(&lay);

    struct shm_create_config cc = {.model = &fm, .gguf = tm->g, .instance = 900};
    struct shm_segment *seg = shm_create(&cc);
    CHECK(seg != NULL, "fused create failed");
    if (seg) {
        size_t row;
        uint32_t type;
        CHECK(shm_entry(seg, 0, SHM_KIND_GATE) == NULL && shm_entry(seg, 1, SHM_KIND_UP) == NULL,
              "absent kinds must look up as NULL");
        const uint8_t *p = shm_expert(seg, 1, SHM_KIND_GATE_UP, 3, &row, &type);
        size_t per = 2 * g0->mat_bytes;
        CHECK(p && memcmp(p, buf + 3 * per, per) == 0 && row == g0->row_bytes &&
                  type == g0->type,
              "fused expert 3 of layer 1 differs");
        CHECK(shm_expert(seg, 1, SHM_KIND_GATE, 0, NULL, NULL) == NULL, "absent expert not NULL");
        shm_destroy(seg);
    }

    /* Errors: no experts at all, a name too long. */
    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    for (int l = 0; l < 2; l++) {
        ly[l].gate_up_exps.data = NULL;
        ly[l].down_exps.data = NULL;
    }
    CHECK(shm_layout_plan(&fm, &lay) == -EINVAL && last_error_has("no routed expert"),
          "no experts: %s", log_last_error());
    CHECK(lay.entries == NULL && lay.src == NULL, "failed plan left arrays");
    fused_model(m, &fm, ly, buf);
    char longname[100];
    memset(longname, 'n', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    ly[1].down_exps.name = longname;
    CHECK(shm_layout_plan(&fm, &lay) == -EINVAL && last_error_has("longer than"),
          "long name: %s", log_last_error());
    fused_model(m, &fm, ly, buf);
    ly[0].down_exps.row_bytes += 1;
    CHECK(shm_layout_plan(&fm, &lay) == -EINVAL && last_error_has("unusable shape"),
          "bad row bytes: %s", log_last_error());
    free(buf);
}

/* ---- create, then read from a child ---- */

struct progress {
    int calls;
    uint64_t last, total;
    bool monotonic;
};

static void on_progress(void *ctx, uint64_t done, uint64_t total)
{
    struct progress *p = ctx;
    p->monotonic = p->monotonic && done >= p->last && done <= total;
    p->calls++;
    p->last = done;
    p->total = total;
}

/* The child: its own GGUF and model, the segment read-only, every expert
 * compared. Returns the exit code (0 = all equal). */
static int child_compare(const char *name)
{
    struct tmodel tm;
    if (tmodel_open(&tm))
        return 10;
    int bad = 0;
    uint64_t experts = 0, bytes = 0;
    struct shm_segment *seg = shm_open_ro(name, shm_model_hash(tm.g) ^ 1);
    if (seg || !last_error_has("another model"))
        bad += 100; /* a wrong hash must be refused */
    shm_destroy(seg);
    seg = shm_open_ro(name, shm_model_hash(tm.g));
    if (!seg) {
        tmodel_close(&tm);
        return 11;
    }
    for (uint32_t l = 0; l < tm.m->hp.n_layer; l++) {
        for (int k = 0; k < SHM_KIND_COUNT; k++) {
            const struct arch_matrix *am = layer_matrix(&tm.m->layers[l], k);
            if (!am->data) {
                bad += shm_entry(seg, l, (enum shm_kind)k) != NULL;
                continue;
            }
            for (uint32_t e = 0; e < am->n_mat; e++) {
                size_t row = 0;
                uint32_t type = 99;
                const void *p = shm_expert(seg, l, (enum shm_kind)k, e, &row, &type);
                bad += !p || row != am->row_bytes || type != am->type ||
                       memcmp(p, arch_matrix_expert(am, e), am->mat_bytes) != 0;
                experts++;
                bytes += am->mat_bytes;
            }
        }
    }
    MEASURE("child %d: compared %llu experts, %llu bytes, %d mismatches", (int)getpid(),
            (unsigned long long)experts, (unsigned long long)bytes, bad);
    shm_destroy(seg);
    tmodel_close(&tm);
    return bad ? 1 : (experts ? 0 : 12);
}

static void on_segv(int sig)
{
    (void)sig;
    _exit(42);
}

/* Exit status of a child that writes one byte at p (42: it faulted). */
static int child_write_status(const void *p)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        struct sigaction sa = {.sa_handler = on_segv};
        sigaction(SIGSEGV, &sa, NULL);
        sigaction(SIGBUS, &sa, NULL);
        *(volatile uint8_t *)p = 1;
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void check_created(const struct tmodel *tm, const struct shm_segment *seg)
{
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "/lamina-%d-", (int)getpid());
    CHECK(strncmp(shm_name(seg), prefix, strlen(prefix)) == 0, "name %s", shm_name(seg));
    char path[128];
    struct stat st;
    snprintf(path, sizeof(path), "/dev/shm%s", shm_name(seg));
    CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0400 &&
              (uint64_t)st.st_size == shm_bytes(seg),
          "%s: mode %o size %lld", path, st.st_mode & 0777, (long long)st.st_size);
    const struct shm_header *h = shm_header(seg);
    CHECK(memcmp(h->magic, SHM_MAGIC, 8) == 0 && h->version == SHM_VERSION &&
              h->flags == SHM_FLAG_READY && h->creator_pid == (uint32_t)getpid() &&
              h->model_file_size == gguf_file_size(tm->g) &&
              h->model_hash == shm_model_hash(tm->g) && h->n_layers == tm->m->hp.n_layer,
          "header fields");
    CHECK(shm_validate(shm_base(seg), shm_bytes(seg), shm_model_hash(tm->g), "self") == 0,
          "created segment does not validate");
    /* the gap after each tensor up to the next 2 MiB boundary is zero */
    const uint8_t *base = shm_base(seg);
    uint64_t nonzero = 0;
    for (uint32_t i = 0; i < h->n_entries; i++) {
        const struct shm_entry *e = shm_entry_at(seg, i);
        uint64_t end = e->offset + e->bytes, next = (end + SHM_ALIGN - 1) / SHM_ALIGN * SHM_ALIGN;
        for (uint64_t b = end; b < next; b += 4093)
            nonzero += base[b] != 0;
    }
    CHECK(nonzero == 0, "%llu sampled gap bytes are not zero", (unsigned long long)nonzero);
    CHECK(child_write_status(base + h->data_offset) == 42, "a write to the creator's mapping did "
          "not fault");
}

static struct shm_segment *test_create_and_child(const struct tmodel *tm)
{
    struct progress pr = {.monotonic = true};
    struct shm_create_config cc = {.model = tm->m, .gguf = tm->g, .instance = 1, .n_threads = 4,
                                   .progress = on_progress, .progress_ctx = &pr};
    double t0 = now_s();
    struct shm_segment *seg = shm_create(&cc);
    double secs = now_s() - t0;
    CHECK(seg != NULL, "create failed: %s", log_last_error());
    if (!seg)
        return NULL;
    MEASURE("create: %s, %llu bytes, in %.1f ms", shm_name(seg),
            (unsigned long long)shm_bytes(seg), secs * 1e3);
    CHECK(pr.calls >= 1 && pr.monotonic && pr.last == pr.total && pr.total > 0,
          "progress: %d calls, last %llu of %llu", pr.calls, (unsigned long long)pr.last,
          (unsigned long long)pr.total);
    check_created(tm, seg);

    /* A fresh process (exec), as a worker is: nothing inherited but the name. */
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_shm", "--compare-child", shm_name(seg), (char *)NULL);
        _exit(13);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child compare: status 0x%x", st);

    /* Same name again: refused, and the first segment is untouched. */
    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    CHECK(shm_create(&cc) == NULL && last_error_has("already exists"), "second create: %s",
          log_last_error());
    struct shm_segment *ro = shm_open_ro(shm_name(seg), shm_model_hash(tm->g));
    CHECK(ro != NULL, "first segment harmed by the failed second create");
    shm_destroy(ro);

    /* A single-threaded copy gives the same bytes. */
    cc.instance = 2;
    cc.n_threads = 1;
    cc.progress = NULL;
    struct shm_segment *one = shm_create(&cc);
    CHECK(one && shm_bytes(one) == shm_bytes(seg) &&
              memcmp(shm_base(one), shm_base(seg), shm_bytes(seg)) == 0,
          "a single-threaded copy differs from the 4-thread one");
    shm_destroy(one);
    return seg;
}

/* ---- corrupted segments ---- */

struct mutation {
    const char *what;   /* substring the error must contain */
    int entry;          /* -1: header */
    size_t off;         /* byte offset in the header or entry */
    uint64_t value;     /* written with width bytes */
    int width;          /* 1, 4 or 8; 0: special (see apply) */
};

static void put(uint8_t *p, uint64_t v, int width)
{
    if (width == 1)
        *p = (uint8_t)v;
    else if (width == 4)
        memcpy(p, &(uint32_t){(uint32_t)v}, 4);
    else
        memcpy(p, &v, 8);
}

/* A valid READY segment named name, made by hand through shm_init; returns
 * the read-write mapping (caller unmaps and unlinks). */
static uint8_t *make_test_segment(const struct tmodel *tm, const char *name, uint64_t *size)
{
    struct shm_layout lay;
    if (shm_layout_plan(tm->m, &lay))
        return NULL;
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    uint8_t *p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)lay.total_bytes) == 0)
        p = mmap(NULL, lay.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0)
        close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name);
        shm_layout_free(&lay);
        return NULL;
    }
    shm_init(p, &lay, shm_model_hash(tm->g), gguf_file_size(tm->g), (uint32_t)getpid());
    for (uint32_t i = 0; i < lay.n_entries; i++)
        memcpy(p + lay.entries[i].offset, lay.src[i], lay.entries[i].bytes);
    ((struct shm_header *)p)->flags = SHM_FLAG_READY;
    *size = lay.total_bytes;
    shm_layout_free(&lay);
    return p;
}

static void test_corrupt(const struct tmodel *tm)
{
    char name[64];
    snprintf(name, sizeof(name), "/lamina-%d-corrupt-test", (int)getpid());
    uint64_t size = 0;
    uint8_t *p = make_test_segment(tm, name, &size);
    CHECK(p != NULL, "cannot make the test segment");
    if (!p)
        return;
    uint64_t hash = shm_model_hash(tm->g);
    struct shm_segment *seg = shm_open_ro(name, hash);
    CHECK(seg != NULL, "the hand-made segment is refused: %s", log_last_error());
    const struct shm_entry *e0 = seg ? shm_entry_at(seg, 0) : NULL;
    shm_destroy(seg);
    if (!e0)
        goto out;

    const struct shm_header *h = (const void *)p;
    const struct shm_entry *t = (const void *)(p + sizeof(*h));
    uint32_t last = h->n_entries - 1;
    const struct mutation muts[] = {
        {"bad magic", -1, 0, 'X', 1},
        {"layout version 2", -1, 8, 2, 4},
        {"header_bytes 64", -1, 12, 64, 4},
        {"total_bytes", -1, 16, size + SHM_ALIGN, 8},
        {"n_layers 0", -1, 24, 0, 4},
        {"n_entries 1073741824", -1, 28, 1u << 30, 4},
        {"not ready", -1, 36, 0, 4},
        {"unknown flags 0x3", -1, 36, 3, 4},
        {"made from another model", -1, 48, hash ^ 0x100, 8},
        {"data_offset", -1, 56, h->data_offset + SHM_ALIGN, 8},
        {"entry_bytes 96", -1, 64, 96, 4},
        {"reserved", -1, 100, 1, 1},
        {"out of range or out of order", 0, 0, h->n_layers, 4},
        {"out of range or out of order", 0, 4, SHM_KIND_COUNT, 4},
        {"out of range or out of order", 1, 4, t[0].kind, 4}, /* duplicate (layer 0, kind 0) */
        {"unknown type 99", 0, 8, 99, 4},
        {"inconsistent", 0, 12, 0, 4},                         /* n_expert */
        {"inconsistent", 0, 16, t[0].n_in + 1, 8},             /* n_in off the block size */
        {"inconsistent", 0, 32, t[0].row_bytes + 1, 8},
        {"do not match", 0, 40, t[0].bytes_per_expert * 2, 8},
        {"do not match", 0, 56, t[0].bytes + 1, 8},
        {"is not a multiple of 2097152", 3, 48, t[3].offset + 4096, 8},
        {"overlaps the previous entry", 3, 48, t[2].offset, 8},
        {"overlaps the previous entry", 0, 48, 0, 8}, /* over the header */
        {"ends past", last, 48, size, 8},
        {"ends past", last, 48, UINT64_MAX - (SHM_ALIGN - 1), 8},
        {"no NUL-terminated name", 2, 64, 0, 0},
    };
    int n_rejected = 0;
    uint8_t save[sizeof(struct shm_header) + 64 * sizeof(struct shm_entry)];
    size_t save_len = sizeof(*h) + (size_t)h->n_entries * sizeof(*t);
    ASSERT(save_len <= sizeof(save));
    memcpy(save, p, save_len);
    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    for (size_t i = 0; i < sizeof(muts) / sizeof(muts[0]); i++) {
        const struct mutation *mu = &muts[i];
        uint8_t *at = mu->entry < 0 ? p : p + sizeof(*h) + (size_t)mu->entry * sizeof(*t);
        if (mu->width)
            put(at + mu->off, mu->value, mu->width);
        else
            memset(at + mu->off, 'x', SHM_ENTRY_NAME);
        struct shm_segment *bad = shm_open_ro(name, hash);
        bool ok = bad == NULL && last_error_has(mu->what) && last_error_has(name);
        n_rejected += ok;
        CHECK(ok, "mutation %zu (%s): %s", i, mu->what, bad ? "accepted" : log_last_error());
        shm_destroy(bad);
        memcpy(p, save, save_len);
    }
    seg = shm_open_ro(name, hash);
    CHECK(seg != NULL, "restored segment refused");
    shm_destroy(seg);

    /* Names and sizes. */
    CHECK(shm_open_ro("no-slash", hash) == NULL && last_error_has("bad segment name"),
          "bad name: %s", log_last_error());
    CHECK(shm_open_ro("/lamina-0-does-not-exist", hash) == NULL && last_error_has("cannot open"),
          "missing: %s", log_last_error());
    int fd = shm_open(name, O_RDWR, 0);
    CHECK(fd >= 0 && ftruncate(fd, (off_t)(size - SHM_ALIGN)) == 0, "shrink");
    CHECK(shm_open_ro(name, hash) == NULL && last_error_has("total_bytes"), "shrunk: %s",
          log_last_error());
    CHECK(ftruncate(fd, 100) == 0, "shrink to 100");
    CHECK(shm_open_ro(name, hash) == NULL && last_error_has("smaller than the 128-byte header"),
          "tiny: %s", log_last_error());
    if (fd >= 0)
        close(fd);
    MEASURE("corrupt: %d of %zu corrupted headers/tables rejected with the field named",
            n_rejected, sizeof(muts) / sizeof(muts[0]));
out:
    munmap(p, size);
    shm_unlink(name);
}

/* Independent check of what shm_validate promises for an accepted image. */
static bool image_sane(const uint8_t *img, uint64_t size)
{
    const struct shm_header *h = (const void *)img;
    const struct shm_entry *t = (const void *)(img + sizeof(*h));
    uint64_t end = h->data_offset;
    if ((uint64_t)h->n_entries * sizeof(*t) + sizeof(*h) > h->data_offset || end > size)
        return false;
    for (uint32_t i = 0; i < h->n_entries; i++) {
        if (t[i].offset % SHM_ALIGN || t[i].offset < end || t[i].offset > size ||
            t[i].bytes > size - t[i].offset || t[i].layer >= h->n_layers ||
            t[i].kind >= SHM_KIND_COUNT || t[i].bytes != (uint64_t)t[i].n_expert *
                                                             t[i].bytes_per_expert)
            return false;
        end = t[i].offset + t[i].bytes;
    }
    return true;
}

static void test_fuzz(const struct tmodel *tm)
{
    struct shm_layout lay;
    if (shm_layout_plan(tm->m, &lay))
        return;
    uint64_t size = lay.total_bytes, hash = shm_model_hash(tm->g);
    uint8_t *img = calloc(1, size);
    size_t meta = sizeof(struct shm_header) + lay.n_entries * sizeof(struct shm_entry);
    uint8_t *pristine = malloc(meta);
    shm_init(img, &lay, hash, gguf_file_size(tm->g), 1);
    ((struct shm_header *)img)->flags = SHM_FLAG_READY;
    memcpy(pristine, img, meta);
    CHECK(shm_validate(img, size, hash, "fuzz") == 0, "pristine image refused");
    /* 20000 expected rejections would bury the log: stderr goes to /dev/null meanwhile */
    fflush(stderr);
    int saved_err = dup(2), devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0)
        dup2(devnull, 2);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    int accepted = 0, insane = 0;
    for (int it = 0; it < FUZZ_ITERS; it++) {
        memcpy(img, pristine, meta);
        int flips = 1 + it % 4;
        for (int f = 0; f < flips; f++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            size_t at = (size_t)(rng >> 33) % meta;
            img[at] ^= (uint8_t)(1u << ((rng >> 20) & 7));
            if (it % 3 == 0)
                img[at] = (uint8_t)(rng >> 40);
        }
        if (shm_validate(img, size, hash, "fuzz") == 0) {
            accepted++;
            insane += !image_sane(img, size);
        }
    }
    if (saved_err >= 0)
        dup2(saved_err, 2);
    if (saved_err >= 0)
        close(saved_err);
    if (devnull >= 0)
        close(devnull);
    CHECK(insane == 0, "%d accepted images break the invariants", insane);
    MEASURE("fuzz: %d mutated images, %d accepted (harmless flips, e.g. name bytes), "
            "0 crashes, %d insane", FUZZ_ITERS, accepted, insane);
    free(pristine);
    free(img);
    shm_layout_free(&lay);
}

/* ---- stale segments ---- */

static void test_stale(const struct tmodel *tm, const struct shm_segment *ours)
{
    struct shm_create_config cc = {.model = tm->m, .gguf = tm->g, .instance = 7};
    fflush(stdout);
    pid_t dead = fork();
    if (dead == 0) {
        struct shm_segment *s = shm_create(&cc);
        _exit(s ? 0 : 1); /* a crash: never unlinked */
    }
    int st = 0;
    waitpid(dead, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "dead child could not create");
    int go[2], ready[2];
    CHECK(pipe(go) == 0 && pipe(ready) == 0, "pipe");
    pid_t live = fork();
    if (live == 0) {
        struct shm_segment *s = shm_create(&cc);
        char c = s ? 'y' : 'n';
        if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1)
            c = 0;
        shm_destroy(s);
        _exit(0);
    }
    char c = 0;
    CHECK(read(ready[0], &c, 1) == 1 && c == 'y', "live child could not create");
    char dead_prefix[64], live_prefix[64], ours_prefix[64], dead_name[300] = "";
    snprintf(dead_prefix, sizeof(dead_prefix), "lamina-%d-", (int)dead);
    snprintf(live_prefix, sizeof(live_prefix), "lamina-%d-", (int)live);
    snprintf(ours_prefix, sizeof(ours_prefix), "lamina-%d-", (int)getpid());
    CHECK(shm_dir_count(dead_prefix, dead_name, sizeof(dead_name)) == 1, "dead child's segment "
          "missing before cleanup");
    int fd = shm_open("/lamina-notapid-x", O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0)
        close(fd);
    int ours_before = shm_dir_count(ours_prefix, NULL, 0);

    log_set_level(LOG_LEVEL_INFO);
    int removed = shm_cleanup_stale();
    CHECK(removed >= 1, "cleanup removed %d", removed);
    CHECK(shm_dir_count(dead_prefix, NULL, 0) == 0, "dead pid %d's segment kept", (int)dead);
    CHECK(shm_dir_count(live_prefix, NULL, 0) == 1, "live pid %d's segment removed", (int)live);
    CHECK(shm_dir_count(ours_prefix, NULL, 0) == ours_before && ours_before >= 1 &&
              shm_name_exists(shm_name(ours)),
          "our own segments touched");
    CHECK(shm_name_exists("/lamina-notapid-x"), "a name without a pid was removed");
    MEASURE("cleanup: removed %d stale segment(s) incl. %s of dead pid %d; kept live pid %d",
            removed, dead_name, (int)dead, (int)live);

    CHECK(write(go[1], "g", 1) == 1, "signal live child");
    waitpid(live, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "live child status 0x%x", st);
    CHECK(shm_dir_count(live_prefix, NULL, 0) == 0, "live child's destroy left its name");
    shm_unlink("/lamina-notapid-x");
    close(go[0]), close(go[1]), close(ready[0]), close(ready[1]);
}

/* ---- unlink by name ---- */

static void test_unlink_name(const struct tmodel *tm)
{
    struct shm_create_config cc = {.model = tm->m, .gguf = tm->g, .instance = 3};
    struct shm_segment *seg = shm_create(&cc);
    CHECK(seg != NULL, "create for unlink");
    if (!seg)
        return;
    char name[SHM_NAME_MAX];
    snprintf(name, sizeof(name), "%s", shm_name(seg));
    errno = 1234;
    CHECK(shm_unlink_name(name) == 0 && errno == 1234, "unlink_name failed or changed errno");
    CHECK(!shm_name_exists(name), "%s still exists", name);
    const struct arch_matrix *am = &tm->m->layers[5].down_exps;
    const void *p = shm_expert(seg, 5, SHM_KIND_DOWN, 15, NULL, NULL);
    CHECK(p && memcmp(p, arch_matrix_expert(am, 15), am->mat_bytes) == 0,
          "mapping unusable after unlink");
    CHECK(shm_unlink_name(name) == -ENOENT, "second unlink");
    CHECK(shm_unlink_name("no-slash") == -EINVAL, "bad name accepted");
    char longname[200] = "/";
    memset(longname + 1, 'a', 150);
    CHECK(shm_unlink_name(longname) == -ENAMETOOLONG, "long name accepted");
    shm_destroy(seg); /* the name is gone already: no complaint, no crash */
}

/* ---- helper mode for tests/sys_shm_small.sh ---- */

static int helper_create(void)
{
    signal(SIGXFSZ, SIG_IGN); /* the RLIMIT_FSIZE fallback of the shell test */
    struct tmodel tm;
    if (tmodel_open(&tm)) {
        fprintf(stderr, "helper: cannot open the fixture\n");
        return 1;
    }
    struct shm_create_config cc = {.model = tm.m, .gguf = tm.g};
    struct shm_segment *seg = shm_create(&cc);
    int rc;
    if (!seg) {
        rc = last_error_has("need ") && last_error_has("bytes in /dev/shm") ? 2 : 1;
        fprintf(stderr, "helper: create failed: %s\n", log_last_error());
    } else {
        char name[SHM_NAME_MAX];
        snprintf(name, sizeof(name), "%s", shm_name(seg));
        printf("helper: created %s (%llu bytes)\n", name, (unsigned long long)shm_bytes(seg));
        shm_destroy(seg);
        rc = shm_name_exists(name) ? 1 : 0;
    }
    tmodel_close(&tm);
    return rc;
}

int main(int argc, char **argv)
{
    log_init("test", -1);
    if (argc > 1 && strcmp(argv[1], "--create-helper") == 0)
        return helper_create();
    if (argc > 2 && strcmp(argv[1], "--compare-child") == 0)
        return child_compare(argv[2]);
    struct tmodel tm;
    CHECK(tmodel_open(&tm) == 0, "cannot open the fixture %s", FIXTURE);
    if (!tm.m)
        return test_main_result("test_shm");
    test_layout(tm.m);
    test_layout_fused_and_errors(&tm);
    log_set_level(LOG_LEVEL_INFO);
    struct shm_segment *seg = test_create_and_child(&tm);
    test_corrupt(&tm);
    test_fuzz(&tm);
    if (seg)
        test_stale(&tm, seg);
    test_unlink_name(&tm);

    char name[SHM_NAME_MAX] = "";
    if (seg)
        snprintf(name, sizeof(name), "%s", shm_name(seg));
    shm_destroy(seg);
    shm_destroy(NULL);
    CHECK(!name[0] || !shm_name_exists(name), "%s left after destroy", name);
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "lamina-%d-", (int)getpid());
    CHECK(shm_dir_count(prefix, NULL, 0) == 0, "/dev/shm/%s* left behind", prefix);
    tmodel_close(&tm);
    return test_main_result("test_shm");
}
