// schedule_factors.c: prints engine/schedule.c's factors for tests/test_schedule.py.
//
//   schedule_factors KIND TOTAL WARMUP_RATIO MIN_RATE STABLE DECAY CYCLE T_MULT T...
// KIND is cosine|wsd|sgdr; prints one factor per T (%.17g), one per line.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/schedule.h"

int main(int argc, char **argv) {
    static const char *names[] = {"cosine", "wsd", "sgdr"};
    static const ScheduleKind kinds[] = {SCHED_COSINE, SCHED_WSD, SCHED_SGDR};
    int k = 0;
    while (argc > 1 && k < 3 && strcmp(argv[1], names[k]))
        k++;
    if (argc < 9 || k == 3) {
        fprintf(stderr, "usage: schedule_factors cosine|wsd|sgdr TOTAL WARMUP_RATIO MIN_RATE "
                        "STABLE DECAY CYCLE T_MULT T...\n");
        return 2;
    }
    Schedule s;
    schedule_init(&s, kinds[k], atol(argv[2]), atof(argv[3]), atof(argv[4]), atol(argv[5]),
                  atol(argv[6]), atol(argv[7]), atol(argv[8]));
    for (int i = 9; i < argc; i++)
        printf("%.17g\n", schedule_factor(&s, atol(argv[i])));
    return 0;
}
