// log.c: astraid's log lines on stderr (systemd's journal adds the time itself, a
// terminal gets it from us): "2024-01-01T00:00:00Z astraid[123] info: text".
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/daemon.h"

static const char *const LEVEL_NAMES[] = {"error", "warn", "info", "debug"};
static int log_level = LOG_INFO;

int log_set_level(const char *name, Err *err) {
    for (int i = 0; i < (int)(sizeof LEVEL_NAMES / sizeof *LEVEL_NAMES); i++)
        if (!strcmp(name, LEVEL_NAMES[i])) {
            log_level = i;
            return 0;
        }
    return err_set(err, "log-level: '%s' is not one of error, warn, info, debug", name);
}

void log_msg(int level, const char *fmt, ...) {
    if (level > log_level) return;
    char stamp[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s astraid[%d] %s: %s\n", stamp, (int)getpid(), LEVEL_NAMES[level], msg);
}
