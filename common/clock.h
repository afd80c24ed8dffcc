// clock.h: the one clock helper of every binary. Wall time is for what is shown and stored
// (timestamps, created_at, a row's wall_time); monotonic time is for durations, rates, ETAs,
// backoffs and deadlines, which must not jump when the system clock is set.
#pragma once
#include <stdint.h>

double clock_wall_s(void);   // unix seconds (CLOCK_REALTIME)
double clock_mono_s(void);   // seconds of CLOCK_MONOTONIC
int64_t clock_mono_ms(void); // milliseconds of CLOCK_MONOTONIC
