/*
 * log: formatting and level filtering of log lines (see log.h).
 */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static struct {
    char role[16];            /* process role shown on each line */
    int rank;                 /* worker rank, -1 for none */
    enum log_level level;     /* lines above this level are dropped */
} log_state = {"lamina", -1, LOG_LEVEL_INFO};

static _Thread_local char log_last[512];

static const char *const log_names[] = {"error", "warn", "info", "debug"};

void log_init(const char *role, int rank)
{
    snprintf(log_state.role, sizeof(log_state.role), "%s", role ? role : "lamina");
    log_state.rank = rank;
    const char *env = getenv("LAMINA_LOG");
    if (!env)
        return;
    for (int i = 0; i < 4; i++)
        if (strcasecmp(env, log_names[i]) == 0)
            log_state.level = (enum log_level)i;
}

void log_set_level(enum log_level level)
{
    log_state.level = level;
}

bool log_is_enabled(enum log_level level)
{
    return level <= log_state.level;
}

void log_write(enum log_level level, const char *file, int line, const char *fmt, ...)
{
    char msg[480];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (level == LOG_LEVEL_ERROR)
        snprintf(log_last, sizeof(log_last), "%s", msg);
    if (!file)
        return; /* error below the level: kept for log_last_error only */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    localtime_r(&ts.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    char who[32];
    if (log_state.rank >= 0)
        snprintf(who, sizeof(who), "%s%d", log_state.role, log_state.rank);
    else
        snprintf(who, sizeof(who), "%s", log_state.role);
    fprintf(stderr, "%02d:%02d:%02d.%03ld %s[%d] %s:%d %s: %s\n", tm.tm_hour, tm.tm_min,
            tm.tm_sec, ts.tv_nsec / 1000000, who, (int)getpid(), base, line, log_names[level],
            msg);
}

const char *log_last_error(void)
{
    return log_last;
}
