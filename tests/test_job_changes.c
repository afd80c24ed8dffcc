// test_job_changes: jobs.c's announcement of job changes (job_changed) reaches every listener
// once per change, in the order they listen, with the change's job and event; a listener past
// JOB_LISTENERS_MAX is refused.
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "daemon/daemon.h"

enum { MAX_HEARD = 16 };

typedef struct {
    const Job *job;
    JobChange what;
    const char *event;
    int order; // when it was heard, over every listener
} Heard;

static Heard heard[2][MAX_HEARD];
static int n_heard[2], clock_ticks;

static void hear(int who, const Job *j, JobChange what, const char *event) {
    if (n_heard[who] < MAX_HEARD) heard[who][n_heard[who]++] = (Heard){j, what, event, clock_ticks};
    clock_ticks++;
}

static void first(const Job *j, JobChange what, const char *event) {
    hear(0, j, what, event);
}

static void second(const Job *j, JobChange what, const char *event) {
    hear(1, j, what, event);
}

static void ignore(const Job *j, JobChange what, const char *event) {
    (void)j, (void)what, (void)event;
}

int main(void) {
    Err err = {0};
    CHECK(jobs_listen(first, &err) == 0 && jobs_listen(second, &err) == 0);
    Job a = {.id = 1}, b = {.id = 2};
    const struct {
        const Job *job;
        JobChange what;
        const char *event;
    } changes[] = {
        {&a, JOB_SHOWN, NULL},        {&a, JOB_EVENT, "failed"}, {&b, JOB_PROGRESS, NULL},
        {&a, JOB_FINAL, NULL},        {NULL, JOB_GONE, NULL},    {&b, JOB_RELEASED, NULL},
        {&b, JOB_EVENT, "restarted"},
    };
    int n = sizeof changes / sizeof *changes;
    for (int i = 0; i < n; i++)
        job_changed(changes[i].job, changes[i].what, changes[i].event);
    for (int who = 0; who < 2; who++) {
        CHECK_MSG(n_heard[who] == n, "listener %d heard %d changes of %d", who, n_heard[who], n);
        for (int i = 0; i < n && i < n_heard[who]; i++) {
            const Heard *h = &heard[who][i];
            CHECK_MSG(h->job == changes[i].job && h->what == changes[i].what &&
                          (h->event == changes[i].event ||
                           (h->event && changes[i].event && !strcmp(h->event, changes[i].event))),
                      "listener %d: change %d heard as another", who, i);
            CHECK_MSG(h->order == 2 * i + who, "listener %d heard change %d out of order", who, i);
        }
    }
    for (int i = 2; i < JOB_LISTENERS_MAX; i++)
        CHECK(jobs_listen(ignore, &err) == 0);
    CHECK(jobs_listen(ignore, &err) == -1 && strstr(err.msg, "listeners"));
    printf("%d changes heard once each by both listeners, in order; listener %d refused\n", n,
           JOB_LISTENERS_MAX + 1);
    CHECK_DONE();
}
