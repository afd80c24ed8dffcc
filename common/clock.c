// clock.c: common/clock.h.
#include "common/clock.h"

#include <time.h>

static double seconds(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double clock_wall_s(void) {
    return seconds(CLOCK_REALTIME);
}

double clock_mono_s(void) {
    return seconds(CLOCK_MONOTONIC);
}

int64_t clock_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
