// commands.c: astraictl's commands (docs/astraictl.md), each one request (plus pushes
// for watch, logs -f and submit --wait/--follow) rendered for humans or as --json.
#include <cjson/cJSON.h>
#include <errno.h>
#include <langinfo.h>
#include <locale.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"
#include "client/plot.h"
#include "client/text.h"
#include "common/buf.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "proto/job_spec.h"

static int fail(int code, const Err *err) {
    fprintf(stderr, "astraictl: %s\n", err->msg);
    return code;
}

static void print_json(const cJSON *v) {
    char *text = cJSON_PrintUnformatted(v);
    printf("%s\n", text ? text : "null");
    cJSON_free(text);
    fflush(stdout);
}

static int parse_job_id(const char *text, long *id, Err *err) {
    char *end;
    errno = 0;
    *id = strtol(text, &end, 10);
    if (errno || end == text || *end || *id < 1)
        return err_set(err, "bad job id '%s' (a positive integer)", text), EXIT_USAGE;
    return EXIT_OK;
}

static cJSON *job_params(long id) {
    cJSON *params = cJSON_CreateObject();
    cJSON_AddNumberToObject(params, "job", (double)id);
    return params;
}

// One request on a fresh connection; prints errors and returns the exit code.
static int call_once(const Options *o, const char *method, cJSON *params, cJSON **result) {
    Client c;
    Err err;
    int rc = client_open(&c, o, &err);
    if (!rc)
        rc = client_call(&c, method, params, result, &err);
    else
        cJSON_Delete(params);
    client_close(&c);
    return rc ? fail(rc, &err) : EXIT_OK;
}

// ---------------------------------------------------------------- progress (watch, --follow)

typedef struct {
    long job;    // the job followed, -1 for every job
    cJSON *jobs; // latest JOB of each job seen, in the order first seen
    bool show;   // print progress (watch, --follow) or not (--wait)
    bool json;   // one JOB per line
    bool tty;    // redraw bars in place
    int drawn;   // lines of the last redraw
    bool done;
    char final_state[32];
} WatchView;

static long job_id_of(const cJSON *job) {
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(job, "id");
    return cJSON_IsNumber(id) ? (long)id->valuedouble : -1;
}

// The terminal's width in cells: TIOCGWINSZ of stdout, else $COLUMNS, else 80.
static int terminal_width(void) {
    struct winsize ws;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
    const char *columns = getenv("COLUMNS");
    long n = columns ? strtol(columns, NULL, 10) : 0;
    return n > 0 && n <= 10000 ? (int)n : 80;
}

// Moves back to the first bar and rewrites every bar (the last without a newline,
// so a single job is redrawn with \r only).
static void redraw_bars(WatchView *p) {
    char line[1024];
    int width = terminal_width() - 1;
    printf("\r");
    if (p->drawn > 1) printf("\033[%dA", p->drawn - 1);
    int i = 0;
    const cJSON *job;
    cJSON_ArrayForEach(job, p->jobs) {
        render_progress_line(job, true, width, line, sizeof line);
        printf("%s\033[K%s", i++ ? "\n" : "", line);
    }
    p->drawn = i;
    fflush(stdout);
}

static void show_job(WatchView *p, const cJSON *job) {
    char line[1024];
    if (!p->show) return;
    if (p->json)
        print_json(job);
    else if (p->tty)
        redraw_bars(p);
    else {
        render_progress_line(job, false, 0, line, sizeof line);
        printf("%s\n", line);
        fflush(stdout);
    }
}

static void finish(WatchView *p, const char *state) {
    snprintf(p->final_state, sizeof p->final_state, "%s", state);
    p->done = true;
}

// Records a JOB (replacing the older copy) and shows it.
static void update_job(WatchView *p, const cJSON *job) {
    long id = job_id_of(job);
    if (id < 0 || (p->job >= 0 && id != p->job)) return;
    cJSON *copy = cJSON_Duplicate(job, 1), *old;
    if (!copy) return;
    int i = 0;
    cJSON_ArrayForEach(old, p->jobs) {
        if (job_id_of(old) == id) break;
        i++;
    }
    if (old && cJSON_Compare(old, copy, true)) { // nothing new: the reply after a reconnect
        cJSON_Delete(copy);
        return;
    }
    if (old)
        cJSON_ReplaceItemInArray(p->jobs, i, copy);
    else
        cJSON_AddItemToArray(p->jobs, copy);
    show_job(p, copy);
    const cJSON *state = cJSON_GetObjectItemCaseSensitive(copy, "state");
    if (p->job >= 0 && cJSON_IsString(state) && job_state_is_final(state->valuestring))
        finish(p, state->valuestring);
}

static void on_progress_push(const char *method, const cJSON *params, void *ctx) {
    WatchView *p = ctx;
    if (!strcmp(method, "progress")) update_job(p, params);
    const cJSON *state = cJSON_GetObjectItemCaseSensitive(params, "state");
    if (!strcmp(method, "end") && p->job >= 0 && job_id_of(params) < 0 &&
        cJSON_IsString(state)) // {"job":ID,"state":S}
        finish(p, state->valuestring);
}

// watch on an open connection until the followed job ends (forever for every job); after a
// reconnect the reply's JOBs bring the view up to date (client_stream).
static int watch_stream(Client *c, void *ctx, bool resumed, Err *err) {
    (void)resumed;
    WatchView *p = ctx;
    c->on_push = on_progress_push;
    c->push_ctx = p;
    cJSON *result = NULL;
    int rc = client_call(c, "watch", p->job >= 0 ? job_params(p->job) : cJSON_CreateObject(),
                         &result, err);
    const cJSON *job;
    cJSON_ArrayForEach(job, cJSON_GetObjectItemCaseSensitive(result, "jobs")) update_job(p, job);
    cJSON_Delete(result);
    while (!rc && !p->done)
        rc = client_wait_push(c, err);
    return rc;
}

static int follow_progress(Client *c, WatchView *p, const Options *o, Err *err) {
    p->jobs = cJSON_CreateArray();
    int rc = client_stream(c, o, watch_stream, p, err);
    if (p->tty && p->drawn) printf("\n");
    return rc;
}

// ---------------------------------------------------------------- submit

// Relative paths in the job file are taken from the current directory (the daemon
// runs elsewhere).
static int absolutize_paths(cJSON *spec, Err *err) {
    char cwd[4096];
    if (!getcwd(cwd, sizeof cwd)) return err_set(err, "getcwd: %s", strerror(errno));
    for (const char *const *key = JOB_SPEC_PATH_KEYS; *key; key++) {
        cJSON *v = cJSON_GetObjectItemCaseSensitive(spec, *key);
        if (!cJSON_IsString(v) || v->valuestring[0] == '/' ||
            !job_spec_value_is_path(*key, v->valuestring))
            continue;
        size_t n = strlen(cwd) + strlen(v->valuestring) + 2;
        char *path = malloc(n);
        if (!path) return err_resource(err, "%s: out of memory", v->string);
        snprintf(path, n, "%s/%s", cwd, v->valuestring);
        cJSON_ReplaceItemInObjectCaseSensitive(spec, *key, cJSON_CreateString(path));
        free(path);
    }
    return 0;
}

// Reads and validates the job file with the daemon's own validator.
static int load_job_file(const char *path, cJSON **spec, Err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return err_set(err, "%s: %s", path, strerror(errno));
    Buf text = {0};
    size_t n;
    char chunk[65536];
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0 && text.len + n < RPC_MAX_LINE)
        if (buf_append(&text, chunk, n)) break;
    int too_big = n > 0, read_error = ferror(f);
    fclose(f);
    if (too_big || read_error || !text.data) {
        buf_free(&text);
        return err_set(err, "%s: %s", path,
                       read_error  ? "read error"
                       : text.data ? "too big"
                                   : "empty");
    }
    *spec = cJSON_ParseWithLength(text.data, text.len);
    buf_free(&text);
    if (!*spec && json_out_of_memory()) return err_resource(err, "%s: out of memory", path);
    if (!*spec) return err_set(err, "%s: not valid JSON", path);
    JobSpec job;
    if (job_spec_parse(&job, *spec, err) || absolutize_paths(*spec, err)) {
        cJSON_Delete(*spec);
        return err_prefix(err, "%s", path);
    }
    job_spec_free(&job);
    return 0;
}

static const char *job_error(const WatchView *p) {
    const cJSON *job = cJSON_GetArrayItem(p->jobs, 0);
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(job, "error");
    return cJSON_IsString(error) ? error->valuestring : "no cause recorded";
}

// "astraictl: job 3 failed: CAUSE" on stderr, safe for a terminal also with --json (whose
// strings are kept as sent).
static void print_job_failure(long id, const WatchView *p) {
    char line[1024];
    snprintf(line, sizeof line, "job %ld %s: %s", id, p->final_state, job_error(p));
    char *safe = text_for_terminal(line);
    fprintf(stderr, "astraictl: %s\n", safe ? safe : "out of memory");
    free(safe);
}

// submit --wait / --follow: follow the job until it ends; 0 only when completed.
static int await_job(Client *c, long id, const Options *o, Err *err) {
    WatchView p = {.job = id, .show = o->follow, .json = o->json, .tty = !o->json && isatty(1)};
    int rc = follow_progress(c, &p, o, err);
    if (!rc && o->json && !o->follow) print_json(cJSON_GetArrayItem(p.jobs, 0));
    if (!rc && strcmp(p.final_state, "completed")) {
        print_job_failure(id, &p);
        rc = EXIT_JOB_FAILED;
    } else if (!rc && !o->json)
        printf("job %ld completed\n", id);
    cJSON_Delete(p.jobs);
    return rc;
}

static int cmd_submit(const char *name, char **args, const Options *o) {
    (void)name;
    Err err;
    cJSON *spec, *result = NULL;
    if (load_job_file(args[0], &spec, &err)) return fail(EXIT_USAGE, &err);
    Client c;
    int rc = client_open(&c, o, &err);
    if (rc)
        cJSON_Delete(spec);
    else
        rc = client_call(&c, "submit", spec, &result, &err);
    const cJSON *job = cJSON_GetObjectItemCaseSensitive(result, "job");
    if (!rc && !cJSON_IsNumber(job)) {
        err_set(&err, "submit reply without a job id");
        rc = EXIT_CONNECT;
    }
    if (!rc && o->json && !o->wait && !o->follow)
        print_json(result);
    else if (!rc) {
        const cJSON *state = cJSON_GetObjectItemCaseSensitive(result, "state");
        printf("job %.0f %s\n", job->valuedouble, cJSON_IsString(state) ? state->valuestring : "?");
    }
    if (!rc && (o->wait || o->follow)) {
        fflush(stdout);
        rc = await_job(&c, (long)job->valuedouble, o, &err);
    }
    cJSON_Delete(result);
    client_close(&c);
    return rc && rc != EXIT_JOB_FAILED ? fail(rc, &err) : rc;
}

// preflight FILE.json: astraid's preflight of a run of the job (docs/astraid.md "Preflight"):
// exit 0 when it would start, EXIT_JOB_FAILED when it would wait or fail.
static int cmd_preflight(const char *name, char **args, const Options *o) {
    (void)name;
    Err err;
    cJSON *spec, *result = NULL;
    if (load_job_file(args[0], &spec, &err)) return fail(EXIT_USAGE, &err);
    int rc = call_once(o, "preflight", spec, &result);
    if (!rc && o->json)
        print_json(result);
    else if (!rc)
        render_preflight(stdout, result);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(result, "verdict");
    if (!rc && !(cJSON_IsString(v) && !strcmp(v->valuestring, "ok"))) rc = EXIT_JOB_FAILED;
    cJSON_Delete(result);
    return rc;
}

// ---------------------------------------------------------------- reads and verbs

// Every page of `list` (docs/protocol.md: "after" the last id of the previous page, until
// "next" is null), on one connection, shown as one table (or one JSON object).
static int cmd_list(const char *name, char **args, const Options *o) {
    (void)name, (void)args;
    Client c;
    Err err;
    cJSON *all = cJSON_CreateObject(), *jobs = cJSON_AddArrayToObject(all, "jobs");
    int rc = client_open(&c, o, &err);
    double after = 0;
    for (bool more = !rc; more;) {
        cJSON *params = cJSON_CreateObject(), *result = NULL;
        if (o->state) cJSON_AddStringToObject(params, "state", o->state);
        if (after > 0) cJSON_AddNumberToObject(params, "after", after);
        rc = client_call(&c, "list", params, &result, &err);
        cJSON *page = cJSON_GetObjectItemCaseSensitive(result, "jobs"), *job;
        while (!rc && (job = cJSON_DetachItemFromArray(page, 0)))
            cJSON_AddItemToArray(jobs, job);
        const cJSON *next = cJSON_GetObjectItemCaseSensitive(result, "next");
        more = !rc && cJSON_IsNumber(next) && next->valuedouble > after; // a cursor moves on
        if (more) after = next->valuedouble;
        cJSON_Delete(result);
    }
    client_close(&c);
    if (!rc && o->json)
        print_json(all);
    else if (!rc)
        render_job_table(stdout, jobs);
    cJSON_Delete(all);
    return rc ? fail(rc, &err) : EXIT_OK;
}

static int cmd_status(const char *name, char **args, const Options *o) {
    Err err;
    long id;
    if (!args[0]) return cmd_list(name, args, o);
    if (parse_job_id(args[0], &id, &err)) return fail(EXIT_USAGE, &err);
    cJSON *result = NULL;
    int rc = call_once(o, "status", job_params(id), &result);
    if (!rc && o->json)
        print_json(result);
    else if (!rc)
        render_job_detail(stdout, result);
    cJSON_Delete(result);
    return rc;
}

// pause, resume, checkpoint, cancel: the JOB in its new state.
static int cmd_verb(const char *verb, char **args, const Options *o) {
    Err err;
    long id;
    if (parse_job_id(args[0], &id, &err)) return fail(EXIT_USAGE, &err);
    cJSON *result = NULL;
    int rc = call_once(o, verb, job_params(id), &result);
    const cJSON *state = cJSON_GetObjectItemCaseSensitive(result, "state");
    if (!rc && o->json)
        print_json(result);
    else if (!rc)
        printf("job %ld: %s\n", id, cJSON_IsString(state) ? state->valuestring : "?");
    cJSON_Delete(result);
    return rc;
}

// rm: a final job's state and run directory go; its checkpoints stay.
static int cmd_rm(const char *name, char **args, const Options *o) {
    (void)name;
    Err err;
    long id;
    if (parse_job_id(args[0], &id, &err)) return fail(EXIT_USAGE, &err);
    cJSON *result = NULL;
    int rc = call_once(o, "rm", job_params(id), &result);
    const cJSON *ckpt = cJSON_GetObjectItemCaseSensitive(result, "ckpt_dir");
    if (!rc && o->json)
        print_json(result);
    else if (!rc)
        printf("job %ld removed (its checkpoints stay in %s)\n", id,
               cJSON_IsString(ckpt) ? ckpt->valuestring : "its ckpt_dir");
    cJSON_Delete(result);
    return rc;
}

static int cmd_daemon(const char *name, char **args, const Options *o) {
    (void)name, (void)args;
    cJSON *result = NULL;
    int rc = call_once(o, "daemon.info", cJSON_CreateObject(), &result);
    if (!rc && o->json)
        print_json(result);
    else if (!rc)
        render_daemon_info(stdout, result);
    cJSON_Delete(result);
    return rc;
}

// ---------------------------------------------------------------- samples

// text on stdout with its line breaks, each line made safe for a terminal (text.h): a sample is
// read as the model wrote it.
static void print_lines(const char *text) {
    for (const char *p = text;; p++) {
        size_t n = strcspn(p, "\n");
        char *line = strndup(p, n), *safe = line ? text_for_terminal(line) : NULL;
        fputs(safe ? safe : "?", stdout);
        free(line);
        free(safe);
        p += n;
        if (!*p) break;
        putchar('\n');
    }
}

static const char *sample_string(const cJSON *s, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    return cJSON_IsString(v) ? v->valuestring : "";
}

static double sample_number(const cJSON *s, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

// "step 40, sample 1:" (sample N: the Nth prompt of sample_prompts), then "PROMPT → COMPLETION".
static void render_samples(long job, const cJSON *samples, const Options *o) {
    const cJSON *s;
    if (!cJSON_GetArraySize(samples)) {
        if (o->step >= 0)
            printf("job %ld: no samples at step %ld\n", job, o->step);
        else
            printf("job %ld: no samples yet\n", job);
    }
    cJSON_ArrayForEach(s, samples) {
        printf("%sstep %.0f, sample %.0f:\n", s == samples->child ? "" : "\n",
               sample_number(s, "step"), sample_number(s, "index") + 1);
        print_lines(sample_string(s, "prompt"));
        fputs(" \u2192 ", stdout);
        print_lines(sample_string(s, "completion"));
        putchar('\n');
    }
}

// One page of samples into `all`; *since: the step of its last row, *more: pages left (--all).
static int fetch_samples(Client *c, long job, const Options *o, cJSON *all, long *since, bool *more,
                         Err *err) {
    cJSON *params = job_params(job), *result = NULL, *row;
    if (o->step >= 0) cJSON_AddNumberToObject(params, "step", (double)o->step);
    if (o->all) cJSON_AddTrueToObject(params, "all");
    if (o->all) cJSON_AddNumberToObject(params, "since_step", (double)*since);
    int rc = client_call(c, "samples", params, &result, err);
    cJSON *page = cJSON_GetObjectItemCaseSensitive(result, "samples");
    *more = false;
    int n = 0;
    while (!rc && (row = cJSON_DetachItemFromArray(page, 0))) {
        *since = (long)sample_number(row, "step");
        cJSON_AddItemToArray(all, row);
        n++;
    }
    bool left = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(result, "more"));
    *more = o->all && left && n > 0;
    if (!rc && left && !o->all)
        fprintf(stderr, "astraictl: step %ld has more samples than one reply holds: %d shown\n",
                *since, n);
    cJSON_Delete(result);
    return rc;
}

// samples JOB [--step N] [--all]: the texts as sent (shown line by line, made safe there), page
// after page with --all (since_step: the last step received).
static int cmd_samples(const char *name, char **args, const Options *o) {
    Err err;
    long id, since = 0;
    if (parse_job_id(args[0], &id, &err)) return fail(EXIT_USAGE, &err);
    if (o->all && o->step >= 0)
        return err_set(&err, "%s: --step and --all exclude each other", name),
               fail(EXIT_USAGE, &err);
    Client c;
    cJSON *all = cJSON_CreateArray();
    int rc = client_open(&c, o, &err);
    c.raw = true;
    for (bool more = !rc; more;)
        rc = fetch_samples(&c, id, o, all, &since, &more, &err);
    client_close(&c);
    if (!rc && o->json) {
        cJSON *out = cJSON_CreateObject();
        cJSON_AddNumberToObject(out, "job", (double)id);
        cJSON_AddItemReferenceToObject(out, "samples", all);
        print_json(out);
        cJSON_Delete(out);
    } else if (!rc) {
        render_samples(id, all, o);
    }
    cJSON_Delete(all);
    return rc ? fail(rc, &err) : EXIT_OK;
}

#define LOGS_KEPT 1000 // lines logs -f remembers: as many as one logs reply holds

// What logs -f printed last, oldest first: a ring of the last LOGS_KEPT lines.
typedef struct {
    char *line[LOGS_KEPT];
    size_t start, n;
} Printed;

static const char *printed_at(const Printed *p, size_t i) {
    return p->line[(p->start + i) % LOGS_KEPT];
}

static void printed_add(Printed *p, const char *line) {
    char *copy = strdup(line);
    if (!copy) return; // out of memory: this line may be printed again after a reconnect
    if (p->n == LOGS_KEPT) {
        free(p->line[p->start]);
        p->line[p->start] = copy;
        p->start = (p->start + 1) % LOGS_KEPT;
    } else {
        p->line[(p->start + p->n++) % LOGS_KEPT] = copy;
    }
}

static void printed_free(Printed *p) {
    for (size_t i = 0; i < p->n; i++)
        free(p->line[(p->start + i) % LOGS_KEPT]);
}

// How many of the n lines of a logs reply after a reconnect were printed already: up to the
// end of the last place where they hold the lines printed last (all those kept, or as many as
// there are from the reply's first). The reply is the end of the rank's log (the lines of a
// run astraid's restart interrupted, from its files), or the lines since that restart only
// (the new run's, from memory): then none matches and all are new.
static size_t printed_already(const Printed *p, const cJSON *const *lines, size_t n) {
    for (size_t end = n; end > 0 && p->n > 0; end--) {
        size_t k = end < p->n ? end : p->n, i = 0;
        while (i < k && !strcmp(lines[end - k + i]->valuestring, printed_at(p, p->n - k + i)))
            i++;
        if (i == k) return end;
    }
    return 0;
}

typedef struct {
    long job, rank, tail; // rank, tail: -1 when not given
    bool json, follow, done;
    Printed printed;
} LogFollow;

static void print_log_line(LogFollow *f, const char *line, const cJSON *push) {
    if (f->json) {
        cJSON *params = push ? NULL : cJSON_CreateObject();
        if (params) {
            cJSON_AddNumberToObject(params, "job", (double)f->job);
            cJSON_AddNumberToObject(params, "rank", f->rank < 0 ? 0 : (double)f->rank);
            cJSON_AddStringToObject(params, "line", line);
        }
        print_json(push ? push : params);
        cJSON_Delete(params);
    } else {
        printf("%s\n", line);
        fflush(stdout);
    }
    if (f->follow) printed_add(&f->printed, line);
}

static void on_log_push(const char *method, const cJSON *params, void *ctx) {
    LogFollow *f = ctx;
    const cJSON *job = cJSON_GetObjectItemCaseSensitive(params, "job");
    if (!cJSON_IsNumber(job) || (long)job->valuedouble != f->job) return;
    const cJSON *line = cJSON_GetObjectItemCaseSensitive(params, "line");
    if (!strcmp(method, "end"))
        f->done = true;
    else if (!strcmp(method, "log") && cJSON_IsString(line))
        print_log_line(f, line->valuestring, params);
}

// The reply's lines: all of them (with --json the reply as sent), or after a reconnect those
// not printed yet (with --json each as a log push's params). -1 when out of memory.
static int show_log_reply(LogFollow *f, const cJSON *result, bool resumed) {
    const cJSON *lines = cJSON_GetObjectItemCaseSensitive(result, "lines"), *line;
    size_t n = 0, skip = 0;
    cJSON_ArrayForEach(line, lines) n += cJSON_IsString(line);
    const cJSON **strings = calloc(n + 1, sizeof *strings);
    if (!strings) return -1;
    n = 0;
    cJSON_ArrayForEach(line, lines) {
        if (cJSON_IsString(line)) strings[n++] = line;
    }
    if (resumed) skip = printed_already(&f->printed, strings, n);
    bool whole = f->json && !resumed;
    if (whole) print_json(result);
    for (size_t i = skip; i < n; i++) {
        const char *text = strings[i]->valuestring;
        if (!whole)
            print_log_line(f, text, NULL);
        else if (f->follow)
            printed_add(&f->printed, text); // printed in the reply
    }
    free(strings);
    fflush(stdout);
    return 0;
}

// logs (with -f, then its pushes until the job is final); after a reconnect, the kept lines
// again, without those printed (client_stream).
static int logs_stream(Client *c, void *ctx, bool resumed, Err *err) {
    LogFollow *f = ctx;
    c->on_push = on_log_push;
    c->push_ctx = f;
    cJSON *params = job_params(f->job), *result = NULL;
    if (f->rank >= 0) cJSON_AddNumberToObject(params, "rank", (double)f->rank);
    if (f->tail >= 0 && !resumed) cJSON_AddNumberToObject(params, "tail", (double)f->tail);
    if (f->follow) cJSON_AddBoolToObject(params, "follow", 1);
    int rc = client_call(c, "logs", params, &result, err);
    if (!rc && show_log_reply(f, result, resumed)) {
        err_resource(err, "out of memory for the lines of job %ld", f->job);
        rc = EXIT_DAEMON_ERROR;
    }
    cJSON_Delete(result);
    while (!rc && f->follow && !f->done)
        rc = client_wait_push(c, err);
    return rc;
}

static int cmd_logs(const char *name, char **args, const Options *o) {
    (void)name;
    Err err;
    LogFollow f = {.rank = o->rank, .tail = o->tail, .json = o->json, .follow = o->follow};
    if (parse_job_id(args[0], &f.job, &err)) return fail(EXIT_USAGE, &err);
    Client c;
    int rc = client_open(&c, o, &err);
    if (!rc)
        rc = f.follow ? client_stream(&c, o, logs_stream, &f, &err)
                      : logs_stream(&c, &f, false, &err);
    printed_free(&f.printed);
    client_close(&c);
    return rc ? fail(rc, &err) : EXIT_OK;
}

static int cmd_watch(const char *name, char **args, const Options *o) {
    (void)name;
    Err err;
    WatchView p = {.job = -1, .show = true, .json = o->json, .tty = !o->json && isatty(1)};
    if (args[0] && parse_job_id(args[0], &p.job, &err)) return fail(EXIT_USAGE, &err);
    Client c;
    int rc = client_open(&c, o, &err);
    if (!rc) rc = follow_progress(&c, &p, o, &err);
    cJSON_Delete(p.jobs);
    client_close(&c);
    return rc ? fail(rc, &err) : EXIT_OK;
}

// ---------------------------------------------------------------- plot

#define PLOT_PAGE 10000     // steps asked for in one history request (its largest limit)
#define PLOT_POLL_MS 1000   // --follow: between looks for new steps
#define PLOT_MAX_WIDTH 1000 // --width
#define PLOT_MAX_HEIGHT 500 // --height
#define PLOT_HEIGHT 20      // lines, unless --height (or a shorter terminal) says
#define SVG_WIDTH 960       // pixels of --svg
#define SVG_HEIGHT 480

static const char *const PLOT_METRICS[] = {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s"};

typedef struct {
    long job;
    const char *metric;
    PlotPoint *points; // (n,) the metric at each step that has it (NaN: null, a gap)
    size_t n, cap;
    long last_step; // of the newest row read: since_step of the next page
    cJSON *rows;    // --json: every row read (else NULL: none kept)
    cJSON *status;  // the job's latest JOB object
} PlotData;

// The rows after last_step, every page of them (since_step paging, until "more" is false);
// *got: rows read.
static int fetch_history(Client *c, PlotData *p, size_t *got, Err *err) {
    *got = 0;
    for (bool more = true; more;) {
        cJSON *params = job_params(p->job), *result = NULL;
        cJSON_AddNumberToObject(params, "since_step", (double)p->last_step);
        cJSON_AddNumberToObject(params, "limit", PLOT_PAGE);
        int rc = client_call(c, "history", params, &result, err);
        if (rc) return rc;
        cJSON *steps = cJSON_GetObjectItemCaseSensitive(result, "steps"), *row;
        size_t before = *got;
        while ((row = cJSON_DetachItemFromArray(steps, 0))) {
            const cJSON *step = cJSON_GetObjectItemCaseSensitive(row, "step");
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(row, p->metric);
            // a step not after the last one read: not a page of this curve
            if (!cJSON_IsNumber(step) || step->valuedouble <= (double)p->last_step) {
                cJSON_Delete(row);
                continue;
            }
            p->last_step = (long)step->valuedouble;
            (*got)++;
            // val_loss exists only at the validation steps; null is a gap
            if (v && buf_reserve(&p->points, &p->cap, p->n + 1, sizeof *p->points)) {
                cJSON_Delete(row);
                cJSON_Delete(result);
                return err_resource(err, "out of memory for the plot's points"), EXIT_DAEMON_ERROR;
            }
            if (v)
                p->points[p->n++] =
                    (PlotPoint){p->last_step, cJSON_IsNumber(v) ? v->valuedouble : NAN};
            if (p->rows)
                cJSON_AddItemToArray(p->rows, row);
            else
                cJSON_Delete(row);
        }
        more = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(result, "more")) && *got > before;
        cJSON_Delete(result);
    }
    return EXIT_OK;
}

static const char *status_string(const cJSON *job, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(job, key);
    return cJSON_IsString(v) ? v->valuestring : "?";
}

static double status_number(const cJSON *job, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(job, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

// "job 3 tiny | loss 2.861 | running | step 40/400 | restarts 1"
static void plot_title(const PlotData *p, char *out, size_t cap) {
    char last[32] = "-";
    for (size_t i = p->n; i-- > 0;)
        if (isfinite(p->points[i].value)) {
            snprintf(last, sizeof last, "%.4g", p->points[i].value);
            break;
        }
    snprintf(out, cap, "job %ld %s | %s %s | %s | step %.0f/%.0f | restarts %.0f", p->job,
             status_string(p->status, "name"), p->metric, last, status_string(p->status, "state"),
             status_number(p->status, "step"), status_number(p->status, "total_steps"),
             status_number(p->status, "restarts"));
}

typedef struct {
    int width, height;
    bool utf8, tty;
    int drawn; // lines of the chart on the terminal (tty: redrawn in place)
} PlotOut;

// The chart on stdout: on a terminal over the one drawn before (cursor up, clear below).
static int draw_text(const PlotSeries *s, PlotOut *out, Err *err) {
    char *text = plot_text(s, out->width, out->height, out->utf8);
    if (!text) return err_resource(err, "out of memory drawing the plot"), EXIT_DAEMON_ERROR;
    if (out->tty && out->drawn) printf("\033[%dA\r\033[J", out->drawn);
    fputs(text, stdout);
    fflush(stdout);
    out->drawn = 0;
    for (const char *c = text; *c; c++)
        out->drawn += *c == '\n';
    free(text);
    return EXIT_OK;
}

static int write_svg(const PlotSeries *s, const char *path, Err *err) {
    char *svg = plot_svg(s, SVG_WIDTH, SVG_HEIGHT);
    if (!svg)
        return err_resource(err, "%s: out of memory drawing the plot", path), EXIT_DAEMON_ERROR;
    int rc = fs_write_file_atomic(path, svg, strlen(svg), err);
    free(svg);
    return rc ? EXIT_DAEMON_ERROR : EXIT_OK;
}

// The size of the terminal chart: --width/--height, else the terminal's (a chart that
// fits under the prompt).
static int plot_size(const Options *o, PlotOut *out, Err *err) {
    struct winsize ws;
    int rows = ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 ? ws.ws_row : 0;
    out->width = o->width >= 0 ? (int)o->width : terminal_width();
    out->height = o->height >= 0                       ? (int)o->height
                  : rows > 1 && rows - 1 < PLOT_HEIGHT ? rows - 1
                                                       : PLOT_HEIGHT;
    if (o->width < 0) // the terminal's: as much of it as a chart may take
        out->width = out->width < PLOT_MIN_WIDTH   ? PLOT_MIN_WIDTH
                     : out->width > PLOT_MAX_WIDTH ? PLOT_MAX_WIDTH
                                                   : out->width;
    if (o->height < 0 && out->height < PLOT_MIN_HEIGHT) out->height = PLOT_MIN_HEIGHT;
    if (out->width < PLOT_MIN_WIDTH || out->width > PLOT_MAX_WIDTH)
        return err_set(err, "--width: %ld is not in [%d, %d]", o->width, PLOT_MIN_WIDTH,
                       PLOT_MAX_WIDTH);
    if (out->height < PLOT_MIN_HEIGHT || out->height > PLOT_MAX_HEIGHT)
        return err_set(err, "--height: %ld is not in [%d, %d]", o->height, PLOT_MIN_HEIGHT,
                       PLOT_MAX_HEIGHT);
    return 0;
}

static int check_metric(const char *metric, Err *err) {
    for (size_t i = 0; i < sizeof PLOT_METRICS / sizeof *PLOT_METRICS; i++)
        if (!strcmp(metric, PLOT_METRICS[i])) return 0;
    return err_set(err, "--metric: '%s' is not one of loss, val_loss, lr, grad_norm, tokens_per_s",
                   metric);
}

// The job's status and its new steps, then the chart (the SVG) when either changed; with
// --follow again every PLOT_POLL_MS until the job is final (its last steps are read after
// the status that says so).
static int plot_loop(Client *c, PlotData *p, PlotOut *out, const Options *o, Err *err) {
    char title[1024], shown[1024] = "";
    for (bool first = true;; first = false) {
        cJSON *status = NULL;
        size_t got = 0;
        int rc = client_call(c, "status", job_params(p->job), &status, err);
        if (rc) return rc;
        cJSON_Delete(p->status);
        p->status = status;
        if ((rc = fetch_history(c, p, &got, err))) return rc;
        plot_title(p, title, sizeof title);
        PlotSeries s = {title, p->points, p->n};
        if ((o->svg || !o->json) && (first || got || strcmp(title, shown))) {
            rc = o->svg ? write_svg(&s, o->svg, err) : draw_text(&s, out, err);
            if (rc) return rc;
            snprintf(shown, sizeof shown, "%s", title);
        }
        if (!o->follow || job_state_is_final(status_string(status, "state"))) return EXIT_OK;
        nanosleep(&(struct timespec){PLOT_POLL_MS / 1000, PLOT_POLL_MS % 1000 * 1000000L}, NULL);
    }
}

typedef struct {
    PlotData *data;
    PlotOut *out;
    const Options *o;
} PlotFollow;

// plot --follow; after a reconnect the whole curve is read and drawn again: astraid's restart
// interrupted the job, whose next run resumes from its checkpoint and writes the steps after
// it again (client_stream).
static int plot_stream(Client *c, void *ctx, bool resumed, Err *err) {
    PlotFollow *f = ctx;
    PlotData *p = f->data;
    cJSON *row;
    if (resumed) {
        p->n = 0;
        p->last_step = 0;
        while (p->rows && (row = cJSON_DetachItemFromArray(p->rows, 0)))
            cJSON_Delete(row);
    }
    return plot_loop(c, p, f->out, f->o, err);
}

static int cmd_plot(const char *name, char **args, const Options *o) {
    (void)name;
    Err err;
    PlotData p = {.metric = o->metric ? o->metric : "loss"};
    PlotOut out = {.tty = isatty(STDOUT_FILENO)};
    if (parse_job_id(args[0], &p.job, &err) || check_metric(p.metric, &err) ||
        plot_size(o, &out, &err))
        return fail(EXIT_USAGE, &err);
    setlocale(LC_CTYPE, ""); // braille where the locale speaks UTF-8
    out.utf8 = !strcmp(nl_langinfo(CODESET), "UTF-8");
    if (o->json && !(p.rows = cJSON_CreateArray()))
        return err_resource(&err, "out of memory for the plot's rows"),
               fail(EXIT_DAEMON_ERROR, &err);
    Client c;
    int rc = client_open(&c, o, &err);
    PlotFollow follow = {&p, &out, o};
    if (!rc)
        rc = o->follow ? client_stream(&c, o, plot_stream, &follow, &err)
                       : plot_loop(&c, &p, &out, o, &err);
    client_close(&c);
    if (!rc && o->json) {
        cJSON *all = cJSON_CreateObject();
        cJSON_AddNumberToObject(all, "job", (double)p.job);
        cJSON_AddItemReferenceToObject(all, "steps", p.rows);
        print_json(all);
        cJSON_Delete(all);
    }
    if (!rc && o->svg && !o->json)
        printf("job %ld: %zu points of %s written to %s\n", p.job, p.n, p.metric, o->svg);
    free(p.points);
    cJSON_Delete(p.rows);
    cJSON_Delete(p.status);
    return rc ? fail(rc, &err) : EXIT_OK;
}

// ---------------------------------------------------------------- dispatch

// The one list of commands: their arguments, the options each takes, what runs them and the
// lines of --help. A command's function gets its own name (the verbs share one).
typedef struct {
    const char *name;
    int min_args, max_args;
    unsigned options; // OPT_* bits this command takes
    int (*run)(const char *name, char **args, const Options *o);
    const char *synopsis, *help;
} Command;

static const Command COMMANDS[] = {
    {"submit", 1, 1, OPT_WAIT | OPT_FOLLOW, cmd_submit, "submit FILE.json [--wait|--follow]",
     "validate and submit a job"},
    {"preflight", 1, 1, 0, cmd_preflight, "preflight FILE.json",
     "would a run of the job start now (disk for its checkpoint, its GPUs)"},
    {"list", 0, 0, OPT_STATE, cmd_list, "list [--state S]", "jobs as a table"},
    {"status", 0, 1, OPT_STATE, cmd_status, "status [JOB]", "one job's details (no JOB: list)"},
    {"pause", 1, 1, 0, cmd_verb, "pause JOB", "checkpoint at the next step and stop"},
    {"resume", 1, 1, 0, cmd_verb, "resume JOB", "start a paused job from its checkpoint"},
    {"checkpoint", 1, 1, 0, cmd_verb, "checkpoint JOB", "checkpoint at the next step, go on"},
    {"cancel", 1, 1, 0, cmd_verb, "cancel JOB", "stop now (the checkpoints stay)"},
    {"rm", 1, 1, 0, cmd_rm, "rm JOB", "remove a finished job (its checkpoints stay)"},
    {"logs", 1, 1, OPT_RANK | OPT_TAIL | OPT_FOLLOW, cmd_logs,
     "logs JOB [--rank R] [--tail N] [-f]", "stderr of a rank (-f: follow)"},
    {"watch", 0, 1, 0, cmd_watch, "watch [JOB]", "live progress (step, loss, tok/s, ETA)"},
    {"daemon", 0, 0, 0, cmd_daemon, "daemon", "daemon.info"},
    {"plot", 1, 1, OPT_FOLLOW | OPT_METRIC | OPT_SVG | OPT_WIDTH | OPT_HEIGHT, cmd_plot,
     "plot JOB [--metric M] [--follow] [--svg FILE] [--width N] [--height N]",
     "a training curve of M (default loss; also val_loss, lr, grad_norm, tokens_per_s)"},
    {"samples", 1, 1, OPT_STEP | OPT_ALL, cmd_samples, "samples JOB [--step N] [--all]",
     "what the model wrote at the newest sampled step (or step N, or every one)"},
};

// Each command option's bit and flag, for "does not apply" (the bits are client.h's).
static const struct {
    unsigned bit;
    const char *flag;
} OPTION_FLAGS[] = {
    {OPT_WAIT, "--wait"}, {OPT_FOLLOW, "--follow"}, {OPT_STATE, "--state"},
    {OPT_RANK, "--rank"}, {OPT_TAIL, "--tail"},     {OPT_METRIC, "--metric"},
    {OPT_SVG, "--svg"},   {OPT_WIDTH, "--width"},   {OPT_HEIGHT, "--height"},
    {OPT_STEP, "--step"}, {OPT_ALL, "--all"},
};

void commands_usage(FILE *out) {
    for (size_t i = 0; i < sizeof COMMANDS / sizeof *COMMANDS; i++) {
        const Command *c = &COMMANDS[i];
        if (strlen(c->synopsis) <= 36)
            fprintf(out, "  %-36s %s\n", c->synopsis, c->help);
        else
            fprintf(out, "  %s\n  %-36s %s\n", c->synopsis, "", c->help);
    }
}

int run_command(const char *name, int argc, char **argv, const Options *o) {
    const Command *cmd = NULL;
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (!strcmp(COMMANDS[i].name, name)) cmd = &COMMANDS[i];
    if (!cmd) {
        fprintf(stderr, "astraictl: unknown command '%s' (see astraictl --help)\n", name);
        return EXIT_USAGE;
    }
    if (argc < cmd->min_args || argc > cmd->max_args) {
        fprintf(stderr, "astraictl %s: expected %d to %d argument(s), got %d\n", name,
                cmd->min_args, cmd->max_args, argc);
        return EXIT_USAGE;
    }
    for (size_t i = 0; i < sizeof OPTION_FLAGS / sizeof *OPTION_FLAGS; i++)
        if (o->given & ~cmd->options & OPTION_FLAGS[i].bit) {
            fprintf(stderr, "astraictl %s: %s does not apply to this command\n", name,
                    OPTION_FLAGS[i].flag);
            return EXIT_USAGE;
        }
    if ((o->given & OPT_WAIT) && (o->given & OPT_FOLLOW)) {
        fprintf(stderr, "astraictl submit: --wait and --follow exclude each other\n");
        return EXIT_USAGE;
    }
    return cmd->run(name, argv, o);
}
