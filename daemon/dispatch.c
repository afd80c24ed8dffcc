// dispatch.c: the methods of the control protocol (docs/design.md §3, docs/protocol.md).
// Each handler returns a result (a cJSON tree) or fills code and err; the reply is
// written by dispatch_line. Requests without an id (notifications) get no reply. A reply
// that cJSON could not build whole for want of memory is an internal error instead.
// A request that changes state (submit, pause, resume, cancel, rm) is answered once its
// change is written (state.c's writer, off the loop): its handler returns ANSWER_LATER,
// and its connection is served no further line until then, so replies stay in order.
// So is one that reads a file (history, samples: a progress.db), on libuv's threadpool.
#include <grp.h>
#include <limits.h>
#include <math.h>
#include <pwd.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/buf.h"
#include "common/json.h"
#include "daemon/daemon.h"

#define LIST_LIMIT 100                    // jobs in a list page unless "limit" says
#define LIST_LIMIT_MAX 1000               // the largest "limit"
#define LIST_MAX_BYTES (RPC_MAX_LINE / 2) // of a page's JOBs: far below the line limit
#define HISTORY_MAX_BYTES LIST_MAX_BYTES  // of a history page's steps

#define ANSWER_LATER 1 // a handler's *code (RPC codes are negative): the reply comes later

typedef cJSON *(*Handler)(Conn *c, const cJSON *params, int *code, Err *err);

// Of the request being dispatched, for an answer sent later: its id, its method's name
// and when it came (its count and latency are taken when it is answered).
static const cJSON *request_id;
static const char *request_method;
static double request_t0;

// The reply a state change waits for.
typedef enum { LATER_JOB, LATER_SUBMIT, LATER_RESULT } LaterKind;
typedef struct {
    Conn *c;
    cJSON *id; // the request's, NULL for a notification
    LaterKind kind;
    long job;      // LATER_JOB: its JOB object; LATER_SUBMIT: {"job", "state"} of the new job
    cJSON *result; // LATER_RESULT: made when the request came
    const char *method;
    double t0; // clock_mono_s() when the request came
} Later;

// The reply line for id: line, unless cJSON could not print it or built the result short
// (a member dropped) for want of memory: then an internal error, which says so. The request
// itself may have been carried out. NULL only when even that error cannot be made.
static char *whole_reply(char *line, const cJSON *id, bool built_short) {
    if (line && !built_short) return line;
    free(line);
    return rpc_error(id, RPC_INTERNAL_ERROR, "out of memory for the reply", NULL);
}

// The reply line of a result (taken), checked against the cJSON failures counted since
// `failures`: the request's own, and those of the line.
static char *result_reply(const cJSON *id, cJSON *result, unsigned long failures) {
    char *line = rpc_result(id, result);
    return whole_reply(line, id, json_failures() != failures);
}

// Takes result; NULL when out of memory.
static Later *later_new(Conn *c, LaterKind kind, long job, cJSON *result) {
    Later *l = malloc(sizeof *l);
    cJSON *id = l && request_id ? cJSON_Duplicate(request_id, 1) : NULL;
    if (!l || (request_id && !id)) {
        free(l);
        cJSON_Delete(result);
        return NULL;
    }
    *l = (Later){c, id, kind, job, result, request_method, request_t0};
    return l;
}

static void later_free(Later *l) {
    cJSON_Delete(l->id);
    cJSON_Delete(l->result);
    free(l);
}

static cJSON *state_data(long id) {
    Job *j = job_find(id);
    if (!j) return NULL;
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "state", job_state_name(j->state));
    return d;
}

// ChangeDone of the state changes: the reply, then the connection's next lines.
static void later_done(void *arg, int code, const Err *err) {
    unsigned long failures = json_failures();
    Later *l = arg;
    Job *j = l->kind != LATER_RESULT ? job_find(l->job) : NULL;
    cJSON *result = NULL;
    if (!code && l->kind == LATER_JOB && j) {
        result = job_to_raw_json(j);
    } else if (!code && l->kind == LATER_SUBMIT && j) {
        result = cJSON_CreateObject();
        cJSON_AddNumberToObject(result, "job", (double)j->id);
        cJSON_AddStringToObject(result, "state", job_state_name(j->shown_state));
    } else if (!code && l->kind == LATER_RESULT) {
        result = l->result;
        l->result = NULL;
    }
    char *msg = !l->id   ? NULL
                : result ? result_reply(l->id, result, failures)
                         : whole_reply(rpc_error(l->id, code ? code : RPC_INTERNAL_ERROR,
                                                 code                           ? err->msg
                                                 : j || l->kind == LATER_RESULT ? "out of memory"
                                                                                : "the job is gone",
                                                 code == RPC_BAD_STATE ? state_data(l->job) : NULL),
                                       l->id, false);
    metrics_request(l->method, 1,
                    result ? 0
                    : code ? code
                           : RPC_INTERNAL_ERROR,
                    clock_mono_s() - l->t0);
    if (!l->id) cJSON_Delete(result);
    conn_answer(l->c, msg);
    later_free(l);
}

// rc: what queueing l's change returned (jobs_submit, a verb, job_remove). ANSWER_LATER
// once it is queued, else the refusal already in code and err.
static cJSON *answer_later(Conn *c, Later *l, int rc, int *code) {
    if (rc) {
        later_free(l);
        return NULL;
    }
    conn_defer(c);
    *code = ANSWER_LATER;
    return NULL;
}

static cJSON *fail(int *code, int value, Err *err, const char *msg) {
    *code = value;
    err_set(err, "%s", msg);
    return NULL;
}

// params.job: an existing job's id.
static Job *param_job(const cJSON *params, int *code, Err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(params, "job");
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble)) {
        *code = RPC_INVALID_PARAMS;
        err_set(err, "job: expected an integer job id");
        return NULL;
    }
    Job *j = job_find((long)v->valuedouble);
    if (!j) {
        *code = RPC_NO_SUCH_JOB;
        err_set(err, "no such job: %.0f", v->valuedouble);
    }
    return j;
}

// An optional integer param in [lo, hi]; *out keeps its default when absent.
static int param_long(const cJSON *params, const char *key, long lo, long hi, long *out, int *code,
                      Err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(params, key);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo ||
        v->valuedouble > hi) {
        *code = RPC_INVALID_PARAMS;
        return err_set(err, "%s: expected an integer in [%ld, %ld]", key, lo, hi);
    }
    *out = (long)v->valuedouble;
    return 0;
}

static cJSON *out_of_memory(int *code, Err *err) {
    *code = RPC_INTERNAL_ERROR;
    err_resource(err, "out of memory");
    return NULL;
}

static cJSON *do_submit(Conn *c, const cJSON *params, int *code, Err *err) {
    Later *l = later_new(c, LATER_SUBMIT, 0, NULL);
    if (!l) return out_of_memory(code, err);
    int rc = jobs_submit(params, conn_uid(c), later_done, l, &l->job, err);
    // the spec's fault, or the daemon's (its state directory: nothing was queued)
    if (rc) *code = err->resource ? RPC_INTERNAL_ERROR : RPC_INVALID_PARAMS;
    return answer_later(c, l, rc, code);
}

// The preflight's report is the result, whatever its verdict (astraictl preflight's exit
// status tells it).
static void preflight_answer(void *arg, PreflightVerdict v, const cJSON *report, const Err *why) {
    (void)v, (void)why;
    Later *l = arg;
    l->result = cJSON_Duplicate(report, 1);
    Err oom = {0};
    if (!l->result) err_resource(&oom, "out of memory");
    later_done(l, l->result ? 0 : RPC_INTERNAL_ERROR, &oom);
}

static cJSON *do_preflight(Conn *c, const cJSON *params, int *code, Err *err) {
    Later *l = later_new(c, LATER_RESULT, 0, NULL);
    if (!l) return out_of_memory(code, err);
    int rc = jobs_preflight(params, preflight_answer, l, err);
    if (rc) *code = err->resource ? RPC_INTERNAL_ERROR : RPC_INVALID_PARAMS;
    return answer_later(c, l, rc, code);
}

// One page of the jobs by ascending id: those after the cursor "after" (and in "state"
// when given), at most "limit" of them and LIST_MAX_BYTES of JSON; "next" is the cursor
// of the next page (the last id of this one), null when no job is left.
static cJSON *do_list(Conn *c, const cJSON *params, int *code, Err *err) {
    (void)c;
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(params, "state");
    JobState want = JOB_NSTATES;
    if (s && (!cJSON_IsString(s) || job_state_parse(s->valuestring, &want))) {
        *code = RPC_INVALID_PARAMS;
        err_set(err, "state: expected one of queued, starting, running, pausing, paused, "
                     "completed, failed, cancelled, interrupted");
        return NULL;
    }
    long limit = LIST_LIMIT, after = 0;
    if (param_long(params, "limit", 1, LIST_LIMIT_MAX, &limit, code, err) ||
        param_long(params, "after", 0, 1L << 53, &after, code, err))
        return NULL;
    cJSON *r = cJSON_CreateObject(), *jobs = cJSON_AddArrayToObject(r, "jobs");
    long n = 0, last_id = 0;
    int more = 0;
    size_t bytes = 0;
    for (Job *j = astraid.jobs; j && !more; j = j->next) {
        if (j->id <= after || !job_visible(j) || (want != JOB_NSTATES && j->shown_state != want))
            continue;
        cJSON *o = n < limit ? job_to_raw_json(j) : NULL;
        size_t len = o ? strlen(o->valuestring) + 1 : 0;
        more = !o || (n > 0 && bytes + len > LIST_MAX_BYTES); // the first JOB always goes
        if (more) {
            cJSON_Delete(o);
            continue;
        }
        cJSON_AddItemToArray(jobs, o);
        bytes += len;
        n++;
        last_id = j->id;
    }
    if (more)
        cJSON_AddNumberToObject(r, "next", (double)last_id);
    else
        cJSON_AddNullToObject(r, "next");
    return r;
}

static cJSON *do_status(Conn *c, const cJSON *params, int *code, Err *err) {
    (void)c;
    Job *j = param_job(params, code, err);
    cJSON *status = j ? job_to_raw_json(j) : NULL;
    return status || !j ? status : out_of_memory(code, err);
}

// Whether uid is in the group named `group` (its primary group or a listed member).
static bool in_group(long uid, const char *group) {
    const struct group *g = getgrnam(group);
    if (!g) return false;
    const struct passwd *pw = getpwuid((uid_t)uid);
    if (!pw) return false;
    if (pw->pw_gid == g->gr_gid) return true;
    for (char **m = g->gr_mem; m && *m; m++)
        if (!strcmp(*m, pw->pw_name)) return true;
    return false;
}

// The job of params, if the caller may change it (docs/protocol.md "Who may act"): its owner
// (the uid that submitted it), root, astraid's own user (the web page's actions, which passed
// the token), a member of --admin-group, or a TCP peer (it presented the token). As Slurm's
// scancel: on a shared box one user cannot stop another's training.
static Job *owned_job(Conn *c, const cJSON *params, const char *verb, int *code, Err *err) {
    Job *j = param_job(params, code, err);
    if (!j) return NULL;
    long uid = conn_uid(c);
    if (conn_is_tcp(c) || uid == 0 || uid == (long)getuid() || uid == j->submitted_by ||
        (astraid.cfg.admin_group && in_group(uid, astraid.cfg.admin_group)))
        return j;
    *code = RPC_FORBIDDEN;
    err_set(err,
            "forbidden: job %ld was submitted by uid %ld; uid %ld may not %s it (only its "
            "owner%s%s may)",
            j->id, j->submitted_by, uid, verb,
            astraid.cfg.admin_group ? ", root or a member of group " : " or root",
            astraid.cfg.admin_group ? astraid.cfg.admin_group : "");
    return NULL;
}

// A verb's reply is the JOB once its change is written.
static cJSON *do_verb(Conn *c, const cJSON *params, JobVerb verb, const char *name, int *code,
                      Err *err) {
    Job *j = owned_job(c, params, name, code, err);
    if (!j) return NULL;
    Later *l = later_new(c, LATER_JOB, j->id, NULL);
    if (!l) return out_of_memory(code, err);
    return answer_later(c, l, verb(j, later_done, l, code, err), code);
}

static cJSON *do_pause(Conn *c, const cJSON *p, int *code, Err *err) {
    return do_verb(c, p, job_pause, "pause", code, err);
}

static cJSON *do_resume(Conn *c, const cJSON *p, int *code, Err *err) {
    return do_verb(c, p, job_resume, "resume", code, err);
}

static cJSON *do_checkpoint(Conn *c, const cJSON *p, int *code, Err *err) {
    Job *j = owned_job(c, p, "checkpoint", code, err);
    if (!j || job_checkpoint(j, code, err)) return NULL;
    cJSON *status = job_to_raw_json(j);
    return status ? status : out_of_memory(code, err);
}

static cJSON *do_cancel(Conn *c, const cJSON *p, int *code, Err *err) {
    return do_verb(c, p, job_cancel, "cancel", code, err);
}

// ---------------------------------------------------------------- history, samples

// A read of a job's progress.db on the threadpool: its Later (LATER_RESULT) gets the result
// `read` makes, or code and err; the run directory is copied, so the job may go meanwhile (and
// the connection: conn_answer frees a closed one).
typedef struct DbRead {
    uv_work_t req;
    Later *later;
    char run_dir[PATH_MAX];
    cJSON *(*read)(struct DbRead *r); // NULL with code and err on failure
    long since_step, limit;           // history's
    SamplesQuery samples;             // samples'
    int code;
    Err err;
} DbRead;

// steps printed as a JSON array (the rows, in order, while they fit in HISTORY_MAX_BYTES;
// the first always goes): the reply's "steps", printed here rather than on the loop.
static char *print_steps(const cJSON *steps, int *more) {
    Buf out = {0};
    if (buf_append(&out, "[", 1)) return NULL;
    int rc = 0;
    const cJSON *row;
    cJSON_ArrayForEach(row, steps) {
        char *text = cJSON_PrintUnformatted(row);
        size_t len = text ? strlen(text) : 0;
        if (text && out.len > 1 && out.len + len + 2 > HISTORY_MAX_BYTES) { // + ',' and ']'
            *more = 1;
            cJSON_free(text);
            break;
        }
        rc = !text || (out.len > 1 && buf_append(&out, ",", 1)) || buf_append(&out, text, len);
        cJSON_free(text);
        if (rc) break;
    }
    if (rc || buf_append(&out, "]", 1)) {
        buf_free(&out);
        return NULL;
    }
    return buf_take(&out);
}

static cJSON *read_failed(DbRead *r, const char *what) {
    r->code = RPC_INTERNAL_ERROR;
    if (!*r->err.msg) err_resource(&r->err, "%s: out of memory", what);
    return NULL;
}

static cJSON *history_read(DbRead *h) {
    cJSON *steps = NULL;
    int more = 0;
    if (curve_read(h->run_dir, h->since_step, h->limit, &steps, &more, &h->err))
        return read_failed(h, "history");
    char *text = print_steps(steps, &more);
    cJSON_Delete(steps);
    cJSON *r = text ? cJSON_CreateObject() : NULL;
    if (!r || !cJSON_AddRawToObject(r, "steps", text) || !cJSON_AddBoolToObject(r, "more", more)) {
        cJSON_Delete(r);
        r = NULL;
    }
    free(text);
    return r ? r : read_failed(h, "history");
}

static void db_read_work(uv_work_t *req) {
    DbRead *r = req->data;
    r->later->result = r->read(r);
}

static void db_read_done(uv_work_t *req, int status) {
    DbRead *r = req->data;
    (void)status; // the loop is never closed under queued work: it always ran
    later_done(r->later, r->code, &r->err);
    free(r);
}

// Queues r (taken) to read j's progress.db off the loop; the reply comes when it is done.
static cJSON *queue_db_read(Conn *c, Job *j, DbRead *r, const char *method, int *code, Err *err) {
    Later *l = later_new(c, LATER_RESULT, j->id, NULL);
    if (!l) {
        free(r);
        return out_of_memory(code, err);
    }
    if (job_run_dir(j, r->run_dir, sizeof r->run_dir)) {
        free(r);
        later_free(l);
        *code = RPC_INTERNAL_ERROR;
        err_set(err, "%s: run directory path too long", method);
        return NULL;
    }
    r->req.data = r;
    r->later = l;
    int rc = uv_queue_work(astraid.loop, &r->req, db_read_work, db_read_done);
    if (rc) {
        *code = RPC_INTERNAL_ERROR;
        err_set(err, "%s: %s", method, uv_strerror(rc));
        free(r);
    }
    return answer_later(c, l, rc, code);
}

// The steps of the job's curve after since_step (default 0), at most limit of them
// (docs/protocol.md), read off the loop.
static cJSON *do_history(Conn *c, const cJSON *params, int *code, Err *err) {
    Job *j = param_job(params, code, err);
    long since_step = 0, limit = HISTORY_LIMIT;
    if (!j || param_long(params, "since_step", 0, 1L << 53, &since_step, code, err) ||
        param_long(params, "limit", 1, HISTORY_LIMIT_MAX, &limit, code, err))
        return NULL;
    DbRead *h = calloc(1, sizeof *h);
    if (!h) return out_of_memory(code, err);
    *h = (DbRead){.read = history_read, .since_step = since_step, .limit = limit};
    return queue_db_read(c, j, h, "history", code, err);
}

// {"job", "samples": [...], "more"}: job_samples_read's rows.
static cJSON *samples_result(DbRead *r) {
    cJSON *rows = NULL, *o = NULL;
    int more = 0;
    long job = r->later->job;
    if (job_samples_read(r->run_dir, &r->samples, &rows, &more, &r->err))
        return read_failed(r, "samples");
    if (!(o = cJSON_CreateObject()) || !cJSON_AddNumberToObject(o, "job", (double)job) ||
        !cJSON_AddItemToObject(o, "samples", rows)) {
        cJSON_Delete(rows);
        cJSON_Delete(o);
        return read_failed(r, "samples");
    }
    return cJSON_AddBoolToObject(o, "more", more) ? o
                                                  : (cJSON_Delete(o), read_failed(r, "samples"));
}

// What the job's model wrote as it trained (docs/protocol.md): the samples of `step` (default:
// the newest step that has some), or with all those of every step after since_step.
static cJSON *do_samples(Conn *c, const cJSON *params, int *code, Err *err) {
    Job *j = param_job(params, code, err);
    SamplesQuery q = {.step = -1};
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(params, "all");
    if (!j || param_long(params, "step", 0, 1L << 53, &q.step, code, err) ||
        param_long(params, "since_step", 0, 1L << 53, &q.since_step, code, err))
        return NULL;
    if (all && !cJSON_IsBool(all))
        return fail(code, RPC_INVALID_PARAMS, err, "all: expected true or false");
    q.all = cJSON_IsTrue(all);
    if (q.all && q.step >= 0)
        return fail(code, RPC_INVALID_PARAMS, err, "step and all exclude each other");
    DbRead *r = calloc(1, sizeof *r);
    if (!r) return out_of_memory(code, err);
    *r = (DbRead){.read = samples_result, .samples = q};
    return queue_db_read(c, j, r, "samples", code, err);
}

// A final job's state and run directory go; its ckpt_dir, named in the reply, stays.
static cJSON *do_rm(Conn *c, const cJSON *params, int *code, Err *err) {
    Job *j = owned_job(c, params, "rm", code, err);
    if (!j) return NULL;
    cJSON *r = cJSON_CreateObject();
    cJSON_AddNumberToObject(r, "job", (double)j->id);
    cJSON_AddTrueToObject(r, "removed");
    cJSON_AddStringToObject(r, "ckpt_dir", j->ckpt_dir);
    Later *l = later_new(c, LATER_RESULT, j->id, r);
    if (!l) return out_of_memory(code, err);
    return answer_later(c, l, job_remove(j, later_done, l, code, err), code);
}

// The kept lines of one rank (default 0), the last `tail` of them; then, with
// follow, every new line is pushed.
static cJSON *do_logs(Conn *c, const cJSON *params, int *code, Err *err) {
    Job *j = param_job(params, code, err);
    long rank = 0, tail = JOB_LOG_LINES;
    if (!j || param_long(params, "rank", 0, 1 << 20, &rank, code, err) ||
        param_long(params, "tail", 0, 1L << 30, &tail, code, err))
        return NULL;
    const cJSON *follow = cJSON_GetObjectItemCaseSensitive(params, "follow");
    if (follow && !cJSON_IsBool(follow))
        return fail(code, RPC_INVALID_PARAMS, err, "follow: expected true or false");
    cJSON *r = cJSON_CreateObject();
    cJSON_AddItemToObject(r, "lines", job_log_tail(j, (int)rank, tail));
    if (cJSON_IsTrue(follow)) conn_follow(c, j->id, (int)rank);
    return r;
}

static cJSON *do_watch(Conn *c, const cJSON *params, int *code, Err *err) {
    Job *one = NULL;
    if (cJSON_GetObjectItemCaseSensitive(params, "job") && !(one = param_job(params, code, err)))
        return NULL;
    cJSON *r = cJSON_CreateObject(), *jobs = cJSON_AddArrayToObject(r, "jobs");
    // Watching every job starts from the live ones: the finished history can be long.
    for (Job *j = astraid.jobs; j; j = j->next)
        if (one ? j == one : job_visible(j) && !job_is_final(j->state))
            cJSON_AddItemToArray(jobs, job_to_raw_json(j));
    conn_watch(c, one ? one->id : 0);
    return r;
}

static cJSON *do_info(Conn *c, const cJSON *params, int *code, Err *err) {
    (void)c, (void)params, (void)code, (void)err;
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "version", ASTRAID_VERSION);
    cJSON_AddNumberToObject(r, "pid", getpid());
    cJSON_AddNumberToObject(r, "uptime_s", clock_mono_s() - astraid.started_at);
    cJSON_AddItemToObject(r, "devices", devices_to_json(&astraid.devices));
    cJSON_AddItemToObject(r, "gpus", gpus_to_json());
    cJSON *socks = cJSON_AddArrayToObject(r, "sockets");
    cJSON_AddItemToArray(socks, cJSON_CreateString(astraid.cfg.socket_path));
    if (astraid.cfg.tcp) {
        char tcp[300];
        snprintf(tcp, sizeof tcp, "tcp:%s", astraid.cfg.tcp);
        cJSON_AddItemToArray(socks, cJSON_CreateString(tcp));
    }
    cJSON_AddStringToObject(r, "state_dir", astraid.cfg.state_dir);
    const char *damage = state_damage();
    char database[ERR_MSG_MAX + 16] = "ok";
    if (damage) snprintf(database, sizeof database, "damaged (%s)", damage);
    cJSON_AddStringToObject(r, "database", database);
    cJSON_AddStringToObject(r, "train_binary", astraid.cfg.train_binary);
    cJSON_AddNumberToObject(r, "connections", server_connections());
    cJSON_AddItemToObject(r, "unknown_job_dirs", jobs_unknown_dirs());
    int counts[JOB_NSTATES] = {0};
    for (Job *j = astraid.jobs; j; j = j->next)
        counts[j->shown_state] += job_visible(j);
    cJSON *jobs = cJSON_AddObjectToObject(r, "jobs");
    for (int s = 0; s < JOB_NSTATES; s++)
        if (counts[s]) cJSON_AddNumberToObject(jobs, job_state_name((JobState)s), counts[s]);
    return r;
}

static cJSON *do_auth(Conn *c, const cJSON *params, int *code, Err *err) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(params, "token");
    // On the unix socket every client is authenticated (by the socket's mode).
    if (!conn_is_authed(c) && (!cJSON_IsString(t) || !server_check_token(t->valuestring)))
        return fail(code, RPC_UNAUTHORIZED, err, "unauthorized: wrong token");
    if (conn_set_authed(c))
        return fail(code, RPC_BUSY, err, "too many connections; try again later");
    cJSON *r = cJSON_CreateObject();
    cJSON_AddTrueToObject(r, "ok");
    return r;
}

typedef struct {
    const char *name;
    Handler fn;
} Method;

static const Method METHODS[] = {
    {"submit", do_submit},    {"list", do_list},           {"status", do_status},
    {"pause", do_pause},      {"resume", do_resume},       {"checkpoint", do_checkpoint},
    {"cancel", do_cancel},    {"logs", do_logs},           {"watch", do_watch},
    {"daemon.info", do_info}, {"auth", do_auth},           {"rm", do_rm},
    {"history", do_history},  {"preflight", do_preflight}, {"samples", do_samples},
};

static const Method *find_method(const char *name) {
    for (size_t i = 0; i < sizeof METHODS / sizeof *METHODS; i++)
        if (!strcmp(name, METHODS[i].name)) return &METHODS[i];
    return NULL;
}

static cJSON *bad_state_data(const cJSON *params) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(params, "job");
    return cJSON_IsNumber(v) ? state_data((long)v->valuedouble) : NULL;
}

static void call(Conn *c, const RpcRequest *req) {
    double t0 = clock_mono_s();
    unsigned long failures = json_failures();
    const Method *m = find_method(req->method);
    Handler fn = m ? m->fn : NULL;
    int code = RPC_INTERNAL_ERROR, hang_up = 0;
    Err err = {0};
    cJSON *result = NULL;
    if (!conn_is_authed(c) && (!fn || fn != do_auth)) {
        code = RPC_UNAUTHORIZED;
        err_set(&err, "unauthorized: send auth first");
        hang_up = 1;
    } else if (!fn) {
        code = RPC_METHOD_NOT_FOUND;
        err_set(&err, "no such method: %s", req->method);
    } else {
        request_id = req->id;
        request_method = m->name; // the table's: req's is freed before a later answer
        request_t0 = t0;
        result = fn(c, req->params, &code, &err);
        request_id = NULL;
        // No result and no reason: cJSON had no memory for the result's first node.
        if (!result && code != ANSWER_LATER && !*err.msg) out_of_memory(&code, &err);
        hang_up = !result && code == RPC_UNAUTHORIZED;
    }
    if (!result && code == ANSWER_LATER) return; // counted when it is answered (later_done)
    metrics_request(req->method, fn != NULL, result ? 0 : code, clock_mono_s() - t0);
    if (req->id && result)
        conn_send(c, result_reply(req->id, result, failures));
    else if (req->id)
        conn_send(c,
                  whole_reply(rpc_error(req->id, code, err.msg,
                                        code == RPC_BAD_STATE ? bad_state_data(req->params) : NULL),
                              req->id, false));
    else
        cJSON_Delete(result);
    if (result && (fn == do_logs || fn == do_watch)) conn_end_if_final(c); // after the reply
    if (hang_up) conn_hang_up(c);
}

void dispatch_line(Conn *c, const char *line, size_t len) {
    RpcRequest req;
    int code;
    Err err = {0};
    if (rpc_parse_request(&req, line, len, &code, &err))
        conn_send(c, whole_reply(rpc_error(req.id, code, err.msg, NULL), req.id, false));
    else
        call(c, &req);
    rpc_request_free(&req);
}
