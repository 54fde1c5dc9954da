/*
 * test_log: the log line format, level filtering and the last-error record,
 * with stderr redirected into a temporary file. Checks: LAMINA_LOG selects
 * the level at log_init (any case; an unknown value leaves it), log_set_level
 * overrides it, lines above the level are dropped and their arguments not
 * evaluated, each line reads "HH:MM:SS.mmm role[pid] file:line level: msg"
 * (role with the rank appended when rank >= 0, file without its directory),
 * one line per call, long messages truncated without overflow; log_last_error
 * holds the last error message of the calling thread only (warnings do not
 * touch it; another thread starts empty and does not see ours).
 */
#include "common/log.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/check.h"

/* stderr captured into a temporary file between log_capture_begin/end. */
struct log_capture {
    int saved;      /* the original stderr */
    FILE *f;        /* the temporary file */
};

static void log_capture_begin(struct log_capture *c)
{
    fflush(stderr);
    c->f = tmpfile();
    c->saved = dup(2);
    if (c->f)
        dup2(fileno(c->f), 2);
}

/* Restores stderr; returns what was written (caller frees). */
static char *log_capture_end(struct log_capture *c)
{
    fflush(stderr);
    dup2(c->saved, 2);
    close(c->saved);
    if (!c->f)
        return strdup("");
    long n = ftell(c->f);
    if (n < 0)
        n = lseek(fileno(c->f), 0, SEEK_CUR);
    char *buf = calloc((size_t)(n > 0 ? n : 0) + 1, 1);
    rewind(c->f);
    if (n > 0 && fread(buf, 1, (size_t)n, c->f) != (size_t)n)
        buf[0] = 0;
    fclose(c->f);
    return buf;
}

static int log_count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static int log_evaluations;

static int log_side_effect(void)
{
    return ++log_evaluations;
}

/* Parses one line; returns true when it has the documented shape, and
 * fills who, file, line, level and the message. */
static bool log_parse(const char *line, char *who, char *file, int *lineno, char *level,
                      char *msg)
{
    int hh, mm, ss, ms, pid, used = 0;
    char rest[600];
    if (sscanf(line, "%2d:%2d:%2d.%3d %63[^[][%d] %63[^:]:%d %15[^:]: %n", &hh, &mm, &ss, &ms,
               who, &pid, file, lineno, level, &used) != 9 || used == 0)
        return false;
    snprintf(rest, sizeof(rest), "%s", line + used);
    char *nl = strchr(rest, '\n');
    if (nl)
        *nl = 0;
    strcpy(msg, rest);
    return hh >= 0 && hh < 24 && mm >= 0 && mm < 60 && ss >= 0 && ss < 61 && ms >= 0 &&
           ms < 1000 && line[2] == ':' && line[8] == '.' && pid == (int)getpid();
}

static void log_test_levels(void)
{
    unsetenv("LAMINA_LOG");
    log_init("test", -1);
    CHECK(log_is_enabled(LOG_LEVEL_INFO) && !log_is_enabled(LOG_LEVEL_DEBUG),
          "default level is info");
    setenv("LAMINA_LOG", "debug", 1);
    log_init("test", -1);
    CHECK(log_is_enabled(LOG_LEVEL_DEBUG), "LAMINA_LOG=debug");
    setenv("LAMINA_LOG", "WaRn", 1);
    log_init("test", -1);
    CHECK(log_is_enabled(LOG_LEVEL_WARN) && !log_is_enabled(LOG_LEVEL_INFO),
          "LAMINA_LOG=WaRn selects warn");
    setenv("LAMINA_LOG", "loud", 1);
    log_init("test", -1);
    CHECK(log_is_enabled(LOG_LEVEL_WARN) && !log_is_enabled(LOG_LEVEL_INFO),
          "an unknown LAMINA_LOG leaves the level");
    setenv("LAMINA_LOG", "error", 1);
    log_init("test", -1);
    CHECK(log_is_enabled(LOG_LEVEL_ERROR) && !log_is_enabled(LOG_LEVEL_WARN), "LAMINA_LOG=error");
    unsetenv("LAMINA_LOG");
    log_set_level(LOG_LEVEL_DEBUG);
    CHECK(log_is_enabled(LOG_LEVEL_DEBUG), "log_set_level(debug)");

    /* filtering: at warn, info and debug lines are dropped unevaluated */
    log_set_level(LOG_LEVEL_WARN);
    struct log_capture cap;
    log_evaluations = 0;
    log_capture_begin(&cap);
    log_debug("dropped %d", log_side_effect());
    log_info("dropped %d", log_side_effect());
    log_warn("kept warn %d", log_side_effect());
    log_error("kept error %d", log_side_effect());
    char *out = log_capture_end(&cap);
    CHECK(log_evaluations == 2, "arguments evaluated %d times, expected 2 (kept lines only)",
          log_evaluations);
    CHECK(log_count_lines(out) == 2, "expected 2 lines at warn, got:\n%s", out);
    CHECK(!strstr(out, "dropped") && strstr(out, "kept warn 1") && strstr(out, "kept error 2"),
          "filtered output:\n%s", out);
    free(out);

    log_set_level(LOG_LEVEL_ERROR);
    log_capture_begin(&cap);
    log_warn("not at error level");
    log_error("only this");
    out = log_capture_end(&cap);
    CHECK(log_count_lines(out) == 1 && strstr(out, "only this"), "at error level:\n%s", out);
    free(out);
}

static void log_test_format(void)
{
    log_init("coord", -1);
    log_set_level(LOG_LEVEL_DEBUG);
    struct log_capture cap;
    log_capture_begin(&cap);
    const int line_info = __LINE__ + 1;
    log_info("hello %s %d", "world", 42);
    log_debug("debug line");
    const int line_err = __LINE__ + 1;
    log_error("bad thing: %s", "why");
    char *out = log_capture_end(&cap);
    CHECK(log_count_lines(out) == 3, "3 lines expected:\n%s", out);
    char who[64], file[64], level[16], msg[600];
    int ln;
    const char *p = out;
    CHECK(log_parse(p, who, file, &ln, level, msg), "line 1 does not parse: %s", p);
    CHECK(!strcmp(who, "coord") && !strcmp(file, "test_log.c") && ln == line_info &&
              !strcmp(level, "info") && !strcmp(msg, "hello world 42"),
          "line 1 fields: who '%s' file '%s' line %d level '%s' msg '%s'", who, file, ln, level,
          msg);
    p = strchr(p, '\n') + 1;
    CHECK(log_parse(p, who, file, &ln, level, msg) && !strcmp(level, "debug") &&
              !strcmp(msg, "debug line"), "line 2: %s", p);
    p = strchr(p, '\n') + 1;
    CHECK(log_parse(p, who, file, &ln, level, msg) && !strcmp(level, "error") && ln == line_err &&
              !strcmp(msg, "bad thing: why"), "line 3: %s", p);
    free(out);

    /* the rank is appended to the role */
    log_init("worker", 3);
    log_capture_begin(&cap);
    log_warn("w");
    out = log_capture_end(&cap);
    CHECK(log_parse(out, who, file, &ln, level, msg) && !strcmp(who, "worker3") &&
              !strcmp(level, "warn"), "ranked line: %s", out);
    free(out);

    /* a role longer than the field is cut, a message longer than the line
     * buffer is truncated: one line, no overflow */
    log_init("a-very-long-role-name-indeed", -1);
    char big[2000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    log_capture_begin(&cap);
    log_error("%s", big);
    out = log_capture_end(&cap);
    CHECK(log_count_lines(out) == 1 && strlen(out) < 600, "long message: %zu bytes, %d lines",
          strlen(out), log_count_lines(out));
    CHECK(strstr(out, "a-very-long-rol[") != NULL, "role cut to 15 chars: %.60s", out);
    CHECK(strlen(log_last_error()) >= 400 && strlen(log_last_error()) < 512,
          "last error of a long message has %zu chars", strlen(log_last_error()));
    free(out);
    log_init("test", -1);
}

static void *log_thread(void *arg)
{
    char *seen = arg;
    snprintf(seen, 128, "%s", log_last_error()); /* a new thread starts empty */
    log_error("thread error");
    return NULL;
}

static void log_test_last_error(void)
{
    log_set_level(LOG_LEVEL_ERROR);
    struct log_capture cap;
    log_capture_begin(&cap);
    log_error("first %d", 1);
    CHECK(!strcmp(log_last_error(), "first 1"), "last error '%s'", log_last_error());
    log_warn("a warning");
    CHECK(!strcmp(log_last_error(), "first 1"), "a warning replaced the last error: '%s'",
          log_last_error());
    log_error("second");
    CHECK(!strcmp(log_last_error(), "second"), "last error '%s'", log_last_error());
    char seen[128] = "unset";
    pthread_t t;
    CHECK(pthread_create(&t, NULL, log_thread, seen) == 0, "pthread_create");
    pthread_join(t, NULL);
    char *out = log_capture_end(&cap);
    CHECK(seen[0] == 0, "a new thread's last error is '%s', expected empty", seen);
    CHECK(!strcmp(log_last_error(), "second"), "another thread's error leaked: '%s'",
          log_last_error());
    CHECK(log_count_lines(out) == 3, "3 error lines expected:\n%s", out);
    free(out);
    log_set_level(LOG_LEVEL_INFO);
}

int main(void)
{
    log_init("test", -1);
    log_test_levels();
    log_test_format();
    log_test_last_error();
    return test_main_result("test_log");
}
