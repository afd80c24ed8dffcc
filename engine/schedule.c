// schedule.c: AstrAI's cosine, wsd and sgdr learning-rate schedules
// (astrai/trainer/schedule.py, with the defaults resolved as in scripts/tools/train.py).
#include "engine/schedule.h"

#include <limits.h>
#include <math.h>

void schedule_init(Schedule *s, ScheduleKind kind, long total_steps, double warmup_ratio,
                   double min_rate, long stable_steps, long decay_steps, long cycle_length,
                   long t_mult) {
    if (total_steps < 0) total_steps = 0;
    // W = min(int(warmup_ratio * total), total); int() truncates toward zero like the cast.
    long warmup = (long)(warmup_ratio * (double)total_steps);
    if (warmup > total_steps) warmup = total_steps;
    if (warmup < 0) warmup = 0;
    long remaining = total_steps - warmup;

    *s = (Schedule){.kind = kind,
                    .warmup_steps = warmup,
                    .total_steps = total_steps,
                    .min_rate = min_rate,
                    .t_mult = t_mult};
    switch (kind) {
    case SCHED_COSINE:
        s->decay_steps = remaining;
        break;
    case SCHED_WSD: {
        // Python `x or y`: 0 means "not set".
        long stable = stable_steps ? stable_steps : (long)((double)remaining * 0.8);
        if (!stable_steps && stable < 1) stable = 1;
        long decay = decay_steps ? decay_steps : remaining - stable;
        s->stable_steps = stable;
        s->decay_steps = decay < 1 ? 1 : decay;
        break;
    }
    case SCHED_SGDR:
        // A cycle shorter than 1 step (total == W, or cycle_length given <= 0) would make
        // AstrAI's cycle search loop forever; one step is the shortest meaningful cycle.
        s->cycle_length = cycle_length ? cycle_length : remaining;
        if (s->cycle_length < 1) s->cycle_length = 1;
        // t_mult < 1 would shrink cycles to 0 steps (the same endless loop).
        if (s->t_mult < 1) s->t_mult = 1;
        break;
    }
}

static double warmup_factor(const Schedule *s, long t) {
    long w = s->warmup_steps > 1 ? s->warmup_steps : 1;
    return fmax(s->min_rate, (double)t / (double)w);
}

static double cosine_factor(const Schedule *s, long since_warmup) {
    long d = s->decay_steps > 1 ? s->decay_steps : 1;
    double progress = fmin((double)since_warmup / (double)d, 1.0);
    return fmax(s->min_rate, 0.5 * (1.0 + cos(M_PI * progress)));
}

static double wsd_factor(const Schedule *s, long since_warmup) {
    if (since_warmup < s->stable_steps) return 1.0;
    double ratio = fmin((double)(since_warmup - s->stable_steps) / (double)s->decay_steps, 1.0);
    return (1.0 - s->min_rate) * (1.0 - ratio) * (1.0 - ratio) + s->min_rate;
}

static double sgdr_factor(const Schedule *s, long since_warmup) {
    long len = s->cycle_length, start = 0;
    if (s->t_mult == 1) {
        start = since_warmup - since_warmup % len; // equal cycles: no search needed
    } else {
        while (since_warmup - start >= len) { // cycle [start, start+len) ends before t
            start += len;
            if (len > LONG_MAX / s->t_mult) {
                // The next cycle is longer than any reachable t; its exact length
                // only moves cos() by < 1e-18.
                len = LONG_MAX;
                break;
            }
            len *= s->t_mult;
        }
    }
    double cosine = 0.5 * (1.0 + cos(M_PI * (double)(since_warmup - start) / (double)len));
    return s->min_rate + (1.0 - s->min_rate) * cosine;
}

double schedule_factor(const Schedule *s, long t) {
    if (t < 0) t = 0;
    if (t < s->warmup_steps) return warmup_factor(s, t);
    long since_warmup = t - s->warmup_steps;
    switch (s->kind) {
    case SCHED_COSINE:
        return cosine_factor(s, since_warmup);
    case SCHED_WSD:
        return wsd_factor(s, since_warmup);
    case SCHED_SGDR:
        return sgdr_factor(s, since_warmup);
    }
    return 1.0;
}
