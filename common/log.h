/*
 * log: one greppable line per event, for every lamina process.
 *
 * Each line: time, role and rank, pid, file:line, level, message. The level
 * comes from LAMINA_LOG (error, warn, info, debug; default info), read once by
 * log_init() which main() calls before anything else. The process state kept
 * here (role, rank, level) is written only by log_init(); logging itself is
 * thread-safe (one fprintf per line). Lines go to stderr.
 */
#ifndef COMMON_LOG_H
#define COMMON_LOG_H

#include <stdbool.h>

enum log_level {
    LOG_LEVEL_ERROR = 0,
    LOG_LEVEL_WARN = 1,
    LOG_LEVEL_INFO = 2,
    LOG_LEVEL_DEBUG = 3,
};

/* Sets the role ("coord", "worker", "test", ...) and rank shown on each line
 * and reads LAMINA_LOG. Call once from main before any other thread exists. */
void log_init(const char *role, int rank);

/* Overrides the level (tests use this to silence expected errors). */
void log_set_level(enum log_level level);

/* True when lines of this level are printed. */
bool log_is_enabled(enum log_level level);

/* Writes one line; use the macros below. */
void log_write(enum log_level level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The last error line written by this thread (tests read rejection messages
 * through it); borrowed until the next log call of this thread. */
const char *log_last_error(void);

#define LOG_AT(lvl, ...)                                                                           \
    do {                                                                                           \
        if (log_is_enabled(lvl))                                                                   \
            log_write(lvl, __FILE__, __LINE__, __VA_ARGS__);                                       \
        else if ((lvl) == LOG_LEVEL_ERROR)                                                         \
            log_write(lvl, NULL, __LINE__, __VA_ARGS__);                                           \
    } while (0)

#define log_error(...) LOG_AT(LOG_LEVEL_ERROR, __VA_ARGS__)
#define log_warn(...) LOG_AT(LOG_LEVEL_WARN, __VA_ARGS__)
#define log_info(...) LOG_AT(LOG_LEVEL_INFO, __VA_ARGS__)
#define log_debug(...) LOG_AT(LOG_LEVEL_DEBUG, __VA_ARGS__)

#endif
