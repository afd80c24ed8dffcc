// notify.c: notify_command (docs/astraid.md "Notifications"): a program astraid runs on a job's
// events, its words as sh would split them (no shell runs: a pipe or a redirection is the
// program's own business) plus the event's name, the JOB object (as it is after the event) on
// its stdin. Run once per event through helper.c: never waited on, SIGKILL after
// notify_timeout seconds; a failure is logged and not retried.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/words.h"
#include "daemon/daemon.h"

#define NOTIFY_MAX_WORDS 64

int notify_check_config(const Config *c, Err *err) {
    char *words[NOTIFY_MAX_WORDS];
    int n;
    if (!c->notify_command) return 0;
    char *copy =
        words_split("notify-command", c->notify_command, words, NOTIFY_MAX_WORDS - 2, &n, err);
    free(copy);
    if (!copy) return -1;
    return n ? 0 : err_set(err, "notify-command: no program in '%s'", c->notify_command);
}

typedef struct {
    long job_id;
    char event[16];
} Notice;

static void notice_done(void *arg, const char *output, size_t len, int exit_code, int term_signal,
                        int timed_out) {
    (void)len;
    Notice *n = arg;
    if (!output) {
        free(n);
        return;
    }
    if (timed_out)
        log_warn("job %ld: notify-command (%s) killed after %g s", n->job_id, n->event,
                 astraid.cfg.notify_timeout);
    else if (term_signal)
        log_warn("job %ld: notify-command (%s) was killed by signal %d", n->job_id, n->event,
                 term_signal);
    else if (exit_code)
        log_warn("job %ld: notify-command (%s) exited with code %d", n->job_id, n->event,
                 exit_code);
    else
        log_debug("job %ld: notify-command (%s) done", n->job_id, n->event);
    free(n);
}

// The JOB object as the event leaves j (its row may still be on its way: clients then see the
// state before it a moment longer).
static char *job_text_now(const Job *j) {
    Job now = *j;
    now.shown_state = j->state;
    now.text = NULL; // printed afresh, not from (nor into) j's kept text
    cJSON *raw = job_to_raw_json(&now);
    char *text = raw ? strdup(raw->valuestring) : NULL;
    cJSON_Delete(raw);
    return text;
}

static void notify_job(const Job *j, const char *event) {
    const char *command = astraid.cfg.notify_command;
    if (!command) return;
    char *words[NOTIFY_MAX_WORDS];
    int n;
    Err err = {0};
    char *copy = words_split("notify-command", command, words, NOTIFY_MAX_WORDS - 2, &n, &err);
    char *json = copy ? job_text_now(j) : NULL;
    Notice *notice = json ? malloc(sizeof *notice) : NULL;
    if (notice) {
        words[n++] = (char *)event;
        words[n] = NULL;
        *notice = (Notice){.job_id = j->id};
        snprintf(notice->event, sizeof notice->event, "%s", event);
        if (helper_run(words, json, strlen(json), 0, astraid.cfg.notify_timeout, notice_done,
                       notice, &err)) {
            free(notice);
            notice = NULL;
        }
    } else if (!err.msg[0]) {
        err_resource(&err, "out of memory");
    }
    if (!notice) log_warn("job %ld: notify-command (%s) not run: %s", j->id, event, err.msg);
    free(json);
    free(copy);
}

void notify_on_job(const Job *j, JobChange what, const char *event) {
    if (what == JOB_EVENT && j && event) notify_job(j, event);
}
