// schedule.h: learning-rate schedules of AstrAI (docs/design.md §8), as a factor of max_lr.
#pragma once
#include "common/error.h"

typedef enum { SCHED_COSINE, SCHED_WSD, SCHED_SGDR } ScheduleKind;

typedef struct {
    ScheduleKind kind;
    long warmup_steps; // W = int(warmup_ratio * total)
    long total_steps;
    double min_rate;   // m, default 0.01
    long decay_steps;  // cosine: total - W; wsd: D
    long stable_steps; // wsd: S
    long cycle_length; // sgdr: L0
    long t_mult;       // sgdr
} Schedule;

// Resolves AstrAI's defaults: stable/decay/cycle given as 0 mean "not set".
void schedule_init(Schedule *s, ScheduleKind kind, long total_steps, double warmup_ratio,
                   double min_rate, long stable_steps, long decay_steps, long cycle_length,
                   long t_mult);

// Factor f(t) for t optimizer steps done; lr = max_lr * f(t).
double schedule_factor(const Schedule *s, long t);
