// http.c: astraid's HTTP listener (--http HOST:PORT, docs/monitoring.md): GET / (the web
// page, web/web.h), /metrics (metrics.c), /api/jobs, /api/history, /api/samples and /api/gpus,
// and POST /api/pause, /api/resume, /api/checkpoint and /api/cancel (the page's buttons) and
// /login.
//
// libmicrohttpd parses HTTP on its own threads (HTTP_THREADS of them, each polling its share
// of at most HTTP_CONNECTIONS connections; a connection silent for HTTP_TIMEOUT_S is
// closed; a request whose line and headers pass HTTP_HEADER_BYTES gets 431), so nothing a
// client does reaches the event loop. Those threads never touch the Job list: they read a Snapshot.
// A request that finds the current snapshot stale wakes the loop (uv_async) and waits, at most
// SNAPSHOT_WAIT_S, for the loop to build a new one and hand it over under the mutex; the loop holds
// the mutex only to swap a pointer. Stale means built before the last http_changed (a job
// submitted, changed or removed, a request counted: what the control socket acknowledged is in the
// next answer here), or, for the progress numbers that change at every step, older than
// SNAPSHOT_MAX_AGE_S. Readers hold a reference, so a snapshot is freed by whoever drops the last
// one. An idle listener costs the loop nothing. /api/history and /api/samples read the job's
// progress.db (curve_read, job_samples_read) on the HTTP thread: blocking there holds no one else
// up.
//
// Slow clients (slowloris): a connection is "waiting" from its accept, or from the end of its
// previous answer, until its whole request (line, headers, any body) is read; it must be read
// within HTTP_REQUEST_S of that start, however steadily its bytes trickle in (the silence
// timeout alone never fires on a line every few seconds). A reaper thread (not
// daemon/watchdog.c, which judges jobs), asleep until the earliest such deadline (forever when
// nothing waits), shuts a late connection's socket down;
// libmicrohttpd then reads its end and closes it. The connections are tracked in `clients`
// under clients_mu from libmicrohttpd's STARTED notification to its CLOSED one, which 0.9.75
// gives before it closes the fd (MHD_cleanup_connections), so a shutdown() under clients_mu
// never reaches an fd reused by a newer connection. At most HTTP_ADMITTED connections are
// served at once and HTTP_PEER_CONNECTIONS of one peer (an IPv4 address, an IPv6 /64): a new
// one past either cap makes room by closing the oldest waiting connection (of that peer, or
// of all), one whose socket holds no unread bytes first, and is refused (closed at once) only
// when every one counted is being answered.
// So a client that sends its request at once is served whatever slow clients hold: it is the
// newest waiting one while its request arrives. That matters on loopback, where every peer,
// a local attacker included, is 127.0.0.1 and shares one cap. The HTTP_CONNECTIONS -
// HTTP_ADMITTED left over are for connections being closed, so accepting never waits on them.
//
// Access: like --tcp, a peer on loopback needs no token when its Host header names a loopback
// host; any other one must send "Authorization: Bearer TOKEN" (--token-file, compared in
// constant time) or gets 401. On a loopback listener a request whose Host is not a loopback
// name gets 421, whatever its path: a browser's page on a name rebound to 127.0.0.1 (DNS
// rebinding) reads nothing. The token's exception is the page itself (/): it holds no data
// (it is the same static file for everyone), and a browser cannot send a header when it opens
// an address; the page then sends the token on its /api requests (docs/monitoring.md "The
// web page"). With --token-file an action (a POST) needs the token from every peer, loopback
// included: the bearer header, or the HttpOnly login cookie POST /login sets (may_act).
//
// Actions and GPUs: the HTTP threads may not touch the jobs, so an action (and /api/gpus, the
// GPUs of daemon.info) is a call the loop makes for them ("calls on the loop" below) of the
// very functions the control socket's verbs call: the same checks, the same records, the same
// reply (JOB, or the error with its code). An action is a POST
// (never a GET, which browsers send on their own: links, prefetches) under the access rule
// above, and one whose Origin names another site than the Host is refused (403): a page on
// any site the user visits could otherwise post a form to the loopback listener.
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "daemon/daemon.h"
#include "web/web.h"

#define HTTP_THREADS 2
#define HTTP_CONNECTIONS 64u     // open at once; more wait in the kernel's backlog
#define HTTP_ADMITTED 48         // served at once (the others are being closed)
#define HTTP_PEER_CONNECTIONS 16 // of one peer: a browser opens 6, Prometheus 1
#define HTTP_REQUEST_S 10.0      // from accept or the last answer to the request read
#define HTTP_TIMEOUT_S 10u       // a connection silent this long is closed (an answer unread)
#define HTTP_HEADER_BYTES 32768u // of a request's line and headers (431 past it)
// A connection's memory (libmicrohttpd touches all of it: 64 kept connections hold 64 times
// this): the request's HTTP_HEADER_BYTES and, measured on 0.9.75, 64 bytes for each header
// and query parameter parsed. Past HTTP_FIELDS of them the pool runs out and libmicrohttpd
// closes the connection with no answer (~2 MiB would answer a 32 KiB "?&&&...": too dear).
// 0.9.75 does queue a 431 then, but its request-line parser ignores that failure and goes
// on parsing over it (parse_initial_message_line), so no hook of ours can have it sent.
#define HTTP_FIELDS 4096u
#define HTTP_POOL_BYTES (HTTP_HEADER_BYTES + 1024u + 64u * HTTP_FIELDS)
#define SHOWN_BYTES 64          // of a bad value quoted in an error
#define SNAPSHOT_MAX_AGE_S 0.25 // older: the loop is asked for new progress numbers
#define SNAPSHOT_WAIT_S 2.0     // for the loop's new snapshot; then the old one serves
#define API_FINISHED 100        // finished jobs in /api/jobs and /metrics: the newest ones
#define CALL_TIMEOUT_S 10       // for the loop's answer to an action

static struct MHD_Daemon *mhd;
static uv_async_t wake;
static int wake_open;
static int loopback_listener; // --http is a loopback address: every Host must be one too
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fresh;    // a new snapshot was published (CLOCK_MONOTONIC)
static Snapshot *current;       // under mu
static int stopping;            // under mu: no more waiting for the loop
static atomic_ulong generation; // bumped by the loop at each http_changed; read by readers

// A connection libmicrohttpd holds (the top comment: its states, caps and deadline).
typedef enum { CLIENT_FREE, CLIENT_WAITING, CLIENT_ANSWERING, CLIENT_CLOSING } ClientState;
typedef struct {
    ClientState state;
    int fd;
    unsigned char peer[16]; // peer_key
    double since;           // CLIENT_WAITING: its request is awaited since (clock_mono_s)
} Client;

static pthread_mutex_t clients_mu = PTHREAD_MUTEX_INITIALIZER;
static Client clients[HTTP_CONNECTIONS]; // under clients_mu, as the three below
static pthread_cond_t deadline_near;     // a deadline before watch_until, or stop (CLOCK_MONOTONIC)
static double watch_until = INFINITY;    // when the reaper wakes next (INFINITY: nothing waits)
static int watch_stop;
static pthread_t reaper;
static int reaper_running;

// ---------------------------------------------------------------- time

// A condition variable whose timed waits read CLOCK_MONOTONIC (clock_mono_s).
static void cond_init_monotonic(pthread_cond_t *c) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(c, &attr);
    pthread_condattr_destroy(&attr);
}

// t (clock_mono_s seconds) for pthread_cond_timedwait.
static struct timespec mono_timespec(double t) {
    double sec = floor(t);
    return (struct timespec){.tv_sec = (time_t)sec, .tv_nsec = (long)((t - sec) * 1e9)};
}

// ---------------------------------------------------------------- snapshots

static void snapshot_free(Snapshot *s) {
    if (!s) return;
    cJSON_free(s->jobs_json);
    for (int i = 0; i < s->n_jobs; i++) {
        free(s->jobs[i].name);
        free(s->jobs[i].last_checkpoint);
    }
    free(s->jobs);
    for (int i = 0; i < s->n_runs; i++)
        free(s->runs[i].run_dir);
    free(s->runs);
    free(s->devices);
    free(s);
}

static void snapshot_release(Snapshot *s) {
    if (!s) return;
    pthread_mutex_lock(&mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&mu);
    if (last) snapshot_free(s);
}

static char *dup_or_null(const char *s) {
    return s ? strdup(s) : NULL;
}

static int add_job(Snapshot *s, cJSON *array, const Job *j) {
    JobGauge *g = &s->jobs[s->n_jobs++];
    *g = (JobGauge){.id = j->id,
                    .name = strdup(j->name),
                    .state = j->shown_state,
                    .step = (double)j->progress.step,
                    .total_steps = (double)j->progress.total_steps,
                    .restarts = (double)j->restarts_total,
                    .loss = j->progress.loss,
                    .lr = j->progress.lr,
                    .grad_norm = j->progress.grad_norm,
                    .tokens_per_s = j->progress.tokens_per_s,
                    .eta_s = j->progress.eta_s,
                    .val_loss = j->progress.val_loss,
                    .has_progress = j->progress.has_step,
                    .has_val_loss = j->progress.has_val_loss,
                    .expert_load_max = j->progress.expert_load_max,
                    .expert_load_min = j->progress.expert_load_min,
                    .has_expert_load = j->progress.has_expert_load,
                    .rollout = j->progress.rollout,
                    .last_checkpoint = dup_or_null(j->last_checkpoint)};
    cJSON *o = job_to_raw_json(j); // the text status serves: no tree, no printing again
    if (!o || !cJSON_AddItemToArray(array, o)) {
        cJSON_Delete(o);
        return -1;
    }
    return g->name && (!j->last_checkpoint || g->last_checkpoint) ? 0 : -1;
}

// The GPUs' memory and use as gpu.c last sampled them (gpus_to_json: its one public view).
static void add_gpu_samples(Snapshot *s) {
    cJSON *gpus = gpus_to_json(), *g;
    cJSON_ArrayForEach(g, gpus) {
        const cJSON *index = cJSON_GetObjectItemCaseSensitive(g, "index");
        const cJSON *mem = cJSON_GetObjectItemCaseSensitive(g, "memory_used_bytes");
        const cJSON *util = cJSON_GetObjectItemCaseSensitive(g, "utilization_pct");
        for (int i = 0; astraid.devices.gpu && i < s->n_devices; i++) {
            if (!cJSON_IsNumber(index) || astraid.devices.ids[i] != index->valueint) continue;
            if (cJSON_IsNumber(mem)) s->devices[i].mem_used = (int64_t)mem->valuedouble;
            if (cJSON_IsNumber(util)) s->devices[i].util_pct = util->valueint;
        }
    }
    cJSON_Delete(gpus);
}

// What the HTTP threads show, read off the Job list and the devices (loop thread). NULL
// when out of memory.
static Snapshot *snapshot_build(void) {
    Snapshot *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->refs = 1;
    s->generation = atomic_load(&generation); // the loop's own writes: all already applied
    s->built_mono = clock_mono_s();
    s->connections = server_connections();
    metrics_requests(&s->requests);
    int n = 0, finished = 0;
    for (const Job *j = astraid.jobs; j; j = j->next) {
        if (!job_visible(j)) continue;
        n++;
        finished += job_is_final(j->state);
        s->by_state[j->shown_state]++;
    }
    Devices *d = &astraid.devices;
    s->jobs = calloc((size_t)n + 1, sizeof *s->jobs);
    s->runs = calloc((size_t)n + 1, sizeof *s->runs);
    s->devices = calloc((size_t)d->n + 1, sizeof *s->devices);
    cJSON *array = cJSON_CreateArray();
    int ok = s->jobs && s->runs && s->devices && array;
    int skip = finished > API_FINISHED ? finished - API_FINISHED : 0; // the oldest finished
    for (const Job *j = astraid.jobs; j && ok; j = j->next) {
        if (!job_visible(j)) continue;
        char dir[PATH_MAX];
        JobRunDir *r = &s->runs[s->n_runs];
        r->id = j->id;
        ok = !job_run_dir(j, dir, sizeof dir) && (r->run_dir = strdup(dir));
        s->n_runs += ok;
        if (ok && job_is_final(j->state) && skip > 0)
            skip--;
        else if (ok)
            ok = !add_job(s, array, j);
    }
    for (int i = 0; ok && i < d->n; i++) {
        device_name(d, d->ids[i], s->devices[i].name, sizeof s->devices[i].name);
        s->devices[i].job = d->used[i];
        s->devices[i].mem_used = -1;
        s->devices[i].util_pct = -1;
    }
    s->n_devices = ok ? d->n : 0;
    if (ok) add_gpu_samples(s);
    s->jobs_json = ok ? cJSON_PrintUnformatted(array) : NULL;
    cJSON_Delete(array);
    if (!s->jobs_json) {
        snapshot_free(s);
        return NULL;
    }
    return s;
}

// Loop thread: a reader asked for a new snapshot.
static void on_wake(uv_async_t *h) {
    (void)h;
    Snapshot *s = snapshot_build(), *old = NULL;
    if (!s) {
        log_warn("http: out of memory building the snapshot; serving the last one");
        return;
    }
    pthread_mutex_lock(&mu);
    old = current;
    current = s;
    pthread_cond_broadcast(&fresh);
    pthread_mutex_unlock(&mu);
    snapshot_release(old);
}

void http_changed(void) {
    atomic_fetch_add(&generation, 1);
}

void http_on_job(const Job *j, JobChange what, const char *event) {
    (void)j, (void)event;
    if (what == JOB_SHOWN || what == JOB_GONE) http_changed();
}

static int snapshot_stale(const Snapshot *s) {
    return !s || s->generation != atomic_load(&generation) ||
           clock_mono_s() - s->built_mono > SNAPSHOT_MAX_AGE_S;
}

// A reference to a snapshot that is not stale (or the last one when the loop does not
// answer within SNAPSHOT_WAIT_S); NULL when there has never been one. Any snapshot
// published after a stale one was seen is fresh for this request: the loop builds and
// publishes in one callback, so one built before a change the client saw acknowledged
// was published before that acknowledgement.
static Snapshot *snapshot_get(void) {
    pthread_mutex_lock(&mu);
    Snapshot *seen = current;
    if (!stopping && snapshot_stale(seen)) {
        uv_async_send(&wake);
        struct timespec until = mono_timespec(clock_mono_s() + SNAPSHOT_WAIT_S);
        while (current == seen && !stopping)
            if (pthread_cond_timedwait(&fresh, &mu, &until) == ETIMEDOUT) break;
    }
    Snapshot *s = current;
    if (s) s->refs++;
    pthread_mutex_unlock(&mu);
    return s;
}

// ---------------------------------------------------------------- connections

// Under clients_mu: c's request is awaited from now; the reaper, if asleep past its
// deadline, wakes to count it.
static void client_wait(Client *c) {
    c->state = CLIENT_WAITING;
    c->since = clock_mono_s();
    if (c->since + HTTP_REQUEST_S < watch_until) pthread_cond_signal(&deadline_near);
}

// Under clients_mu (c's fd is libmicrohttpd's until its CLOSED notification): libmicrohttpd
// reads the end of c's socket and closes it.
static void client_close(Client *c) {
    shutdown(c->fd, SHUT_RDWR);
    c->state = CLIENT_CLOSING;
}

// The reaper thread: closes each connection whose request is not read HTTP_REQUEST_S
// after it began waiting; asleep until the earliest such deadline, or until woken.
static void *watch_deadlines(void *arg) {
    (void)arg;
    pthread_mutex_lock(&clients_mu);
    while (!watch_stop) {
        double now = clock_mono_s();
        watch_until = INFINITY;
        for (unsigned i = 0; i < HTTP_CONNECTIONS; i++) {
            Client *c = &clients[i];
            double deadline = c->since + HTTP_REQUEST_S;
            if (c->state == CLIENT_WAITING && deadline <= now)
                client_close(c);
            else if (c->state == CLIENT_WAITING)
                watch_until = fmin(watch_until, deadline);
        }
        struct timespec until = mono_timespec(isinf(watch_until) ? 0 : watch_until);
        if (isinf(watch_until))
            pthread_cond_wait(&deadline_near, &clients_mu);
        else
            pthread_cond_timedwait(&deadline_near, &clients_mu, &until);
    }
    pthread_mutex_unlock(&clients_mu);
    return NULL;
}

// Whom a connection counts against: its IPv4 address (IPv4-mapped, as a dual-stack listener
// sees IPv4 peers) or its IPv6 /64 (a host is commonly given a whole /64).
static void peer_key(const struct sockaddr *a, unsigned char key[16]) {
    memset(key, 0, 16);
    if (a && a->sa_family == AF_INET) {
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &((const struct sockaddr_in *)a)->sin_addr, 4);
    } else if (a && a->sa_family == AF_INET6) {
        const struct in6_addr *a6 = &((const struct sockaddr_in6 *)a)->sin6_addr;
        memcpy(key, a6->s6_addr, IN6_IS_ADDR_V4MAPPED(a6) ? 16 : 8);
    }
}

// Whether bytes c sent are in its socket, not yet read: it waits on astraid, not on its
// client (a request sent at once, while a loaded machine has not run our thread yet).
static int has_unread(const Client *c) {
    int n = 0;
    return ioctl(c->fd, FIONREAD, &n) == 0 && n > 0;
}

// Under clients_mu: closes the oldest connection waiting for its request (of peer; of any
// peer when NULL), preferring one whose bytes have all been read (else a flood of new
// connections would close a probe whose request sits unread). 0 when none waits.
static int evict_oldest(const unsigned char *peer) {
    Client *oldest = NULL, *oldest_read = NULL;
    for (unsigned i = 0; i < HTTP_CONNECTIONS; i++) {
        Client *c = &clients[i];
        if (c->state != CLIENT_WAITING || (peer && memcmp(c->peer, peer, sizeof c->peer))) continue;
        if (!oldest || c->since < oldest->since) oldest = c;
        if ((!oldest_read || c->since < oldest_read->since) && !has_unread(c)) oldest_read = c;
    }
    if (oldest_read) oldest = oldest_read;
    if (oldest) client_close(oldest);
    return oldest != NULL;
}

// Under clients_mu: room for one more connection of peer within HTTP_PEER_CONNECTIONS and
// HTTP_ADMITTED, made at a cap by closing the oldest waiting connection there. 0 when
// every connection counted at that cap is being answered.
static int make_room(const unsigned char *peer) {
    int all = 0, of_peer = 0;
    for (unsigned i = 0; i < HTTP_CONNECTIONS; i++) {
        const Client *c = &clients[i];
        int counted = c->state == CLIENT_WAITING || c->state == CLIENT_ANSWERING;
        all += counted;
        of_peer += counted && !memcmp(c->peer, peer, sizeof c->peer);
    }
    if (of_peer >= HTTP_PEER_CONNECTIONS) return evict_oldest(peer);
    return all < HTTP_ADMITTED || evict_oldest(NULL);
}

// A new connection (its STARTED notification): its entry in clients, waiting; NULL when it
// is refused, its socket shut down (libmicrohttpd then closes it).
static Client *client_admit(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *fd =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    const union MHD_ConnectionInfo *addr =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    unsigned char peer[16];
    peer_key(addr ? addr->client_addr : NULL, peer);
    Client *c = NULL;
    pthread_mutex_lock(&clients_mu);
    for (unsigned i = 0; !c && i < HTTP_CONNECTIONS; i++) // one for each libmicrohttpd holds
        if (clients[i].state == CLIENT_FREE) c = &clients[i];
    if (c && make_room(peer)) {
        c->fd = fd->connect_fd;
        memcpy(c->peer, peer, sizeof c->peer);
        client_wait(c);
    } else {
        c = NULL;
        shutdown(fd->connect_fd, SHUT_RDWR);
    }
    pthread_mutex_unlock(&clients_mu);
    return c;
}

// libmicrohttpd's STARTED and CLOSED notifications; the entry is socket_context.
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    (void)cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        *socket_context = client_admit(conn);
        return;
    }
    Client *c = *socket_context;
    if (!c) return;
    pthread_mutex_lock(&clients_mu);
    c->state = CLIENT_FREE;
    pthread_mutex_unlock(&clients_mu);
}

static Client *client_of(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info ? *(void *const *)(const void *)info : NULL; // a pointer to socket_context
}

// conn's request is read: it is answered, no longer held to HTTP_REQUEST_S nor evicted (a
// connection the reaper or an eviction closed meanwhile stays closing).
static void client_answering(struct MHD_Connection *conn) {
    Client *c = client_of(conn);
    if (!c) return;
    pthread_mutex_lock(&clients_mu);
    if (c->state == CLIENT_WAITING) c->state = CLIENT_ANSWERING;
    pthread_mutex_unlock(&clients_mu);
}

// A request is over (its answer sent, or given up): a kept-alive connection waits for the
// next one from now.
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)cls, (void)con_cls, (void)toe;
    Client *c = client_of(conn);
    if (!c) return;
    pthread_mutex_lock(&clients_mu);
    if (c->state == CLIENT_ANSWERING) client_wait(c);
    pthread_mutex_unlock(&clients_mu);
}

static int reaper_start(Err *err) {
    int rc = pthread_create(&reaper, NULL, watch_deadlines, NULL);
    if (rc) return err_errno(err, rc, "http: cannot start the slow-request reaper");
    reaper_running = 1;
    return 0;
}

static void reaper_stop(void) {
    if (!reaper_running) return;
    pthread_mutex_lock(&clients_mu);
    watch_stop = 1;
    pthread_cond_signal(&deadline_near);
    pthread_mutex_unlock(&clients_mu);
    pthread_join(reaper, NULL);
    reaper_running = 0;
}

// ---------------------------------------------------------------- responses

// allow: the methods of a 405's Allow header (NULL for any other status).
static enum MHD_Result respond_allow(struct MHD_Connection *conn, unsigned status, const char *type,
                                     char *body, size_t len, enum MHD_ResponseMemoryMode mode,
                                     const char *allow) {
    client_answering(conn); // an answer before the body (405, 401...) too
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    if (!r) {
        if (mode == MHD_RESPMEM_MUST_FREE) free(body);
        return MHD_NO; // out of memory: the connection is closed
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (status == MHD_HTTP_UNAUTHORIZED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result rc = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, const char *type,
                               char *body, size_t len, enum MHD_ResponseMemoryMode mode) {
    return respond_allow(conn, status, type, body, len, mode,
                         status == MHD_HTTP_METHOD_NOT_ALLOWED ? "GET, HEAD" : NULL);
}

static enum MHD_Result respond_text(struct MHD_Connection *conn, unsigned status,
                                    const char *text) {
    return respond(conn, status, "text/plain; charset=utf-8", (char *)text, strlen(text),
                   MHD_RESPMEM_PERSISTENT);
}

// Takes text (malloc'd, or NULL when out of memory). A message may quote what the client
// sent, which need not be UTF-8: bytes that are not are replaced (U+FFFD).
static enum MHD_Result respond_utf8(struct MHD_Connection *conn, unsigned status, const char *type,
                                    char *text) {
    text = text ? rpc_utf8_sanitize(text) : NULL;
    if (!text) return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    return respond(conn, status, type, text, strlen(text), MHD_RESPMEM_MUST_FREE);
}

// Takes o. cJSON allocates with malloc (its default hooks): MHD frees the text with free().
static enum MHD_Result respond_json(struct MHD_Connection *conn, unsigned status, cJSON *o) {
    char *text = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return respond_utf8(conn, status, "application/json", text);
}

// The first SHOWN_BYTES of a client's value v at most, for a message, in out: cut before a
// UTF-8 character it would split (a byte that is no UTF-8 is replaced by respond_utf8).
static const char *shown(const char *v, char out[SHOWN_BYTES + 1]) {
    size_t n = strnlen(v, SHOWN_BYTES);
    for (int k = 0; k < 3 && n > 0 && ((unsigned char)v[n] & 0xC0) == 0x80; k++)
        n--; // v[n] continues the character that starts before it
    memcpy(out, v, n);
    out[n] = 0;
    return out;
}

static enum MHD_Result respond_error(struct MHD_Connection *conn, unsigned status,
                                     const char *msg) {
    cJSON *o = cJSON_CreateObject();
    if (o) cJSON_AddStringToObject(o, "error", msg);
    return respond_json(conn, status, o);
}

// ---------------------------------------------------------------- routes

static enum MHD_Result get_metrics(struct MHD_Connection *conn, const Snapshot *s) {
    size_t len;
    char *text = metrics_render(s, &len);
    if (!text) return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    return respond(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len,
                   MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result get_jobs(struct MHD_Connection *conn, const Snapshot *s) {
    const char *fmt = "{\"jobs\":%s,\"uptime_s\":%.3f}";
    double uptime = clock_mono_s() - astraid.started_at;
    int n = snprintf(NULL, 0, fmt, s->jobs_json, uptime);
    char *body = n > 0 ? malloc((size_t)n + 1) : NULL;
    if (!body) return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    snprintf(body, (size_t)n + 1, fmt, s->jobs_json, uptime);
    return respond(conn, MHD_HTTP_OK, "application/json", body, (size_t)n, MHD_RESPMEM_MUST_FREE);
}

// s: one ASCII digit or more, nothing else.
static int all_digits(const char *s) {
    return *s && strspn(s, "0123456789") == strlen(s);
}

// Query parameter `key`, ASCII digits only (no sign, no space: strtol alone would take
// "+1" and " 1" but not "1 ") of an integer in [lo, hi]; *out keeps its default when
// absent. -1 with a message naming it in err.
static int query_long(struct MHD_Connection *conn, const char *key, long lo, long hi, long *out,
                      Err *err) {
    const char *v = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, key);
    if (!v) return 0;
    errno = 0;
    long x = strtol(v, NULL, 10);
    char quoted[SHOWN_BYTES + 1];
    if (!all_digits(v) || errno || x < lo || x > hi)
        return err_set(err, "%s: expected an integer in [%ld, %ld], got '%s'", key, lo, hi,
                       shown(v, quoted));
    *out = x;
    return 0;
}

static const char *run_dir_of(const Snapshot *s, long id) {
    int lo = 0, hi = s->n_runs - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (s->runs[mid].id == id) return s->runs[mid].run_dir;
        if (s->runs[mid].id < id)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

// The required ?job=ID (a positive integer, as the control socket takes it).
static int query_job(struct MHD_Connection *conn, long *job, Err *err) {
    if (!MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "job"))
        return err_set(err, "job: missing (?job=ID)");
    return query_long(conn, "job", 1, 1L << 53, job, err);
}

static enum MHD_Result no_such_job(struct MHD_Connection *conn, long job) {
    char msg[64];
    snprintf(msg, sizeof msg, "no such job: %ld", job);
    return respond_error(conn, MHD_HTTP_NOT_FOUND, msg);
}

// {key: items, "more": more} (items taken), as the control socket's page of the same rows.
static enum MHD_Result respond_page(struct MHD_Connection *conn, const char *key, cJSON *items,
                                    int more) {
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddItemToObject(o, key, items)) {
        cJSON_Delete(items);
        cJSON_Delete(o);
        return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    }
    cJSON_AddBoolToObject(o, "more", more);
    return respond_json(conn, MHD_HTTP_OK, o);
}

static enum MHD_Result get_history(struct MHD_Connection *conn, const Snapshot *s) {
    Err err = {0};
    long job = 0, since = 0, limit = HISTORY_LIMIT;
    if (query_job(conn, &job, &err) || query_long(conn, "since_step", 0, 1L << 53, &since, &err) ||
        query_long(conn, "limit", 1, HISTORY_LIMIT_MAX, &limit, &err))
        return respond_error(conn, MHD_HTTP_BAD_REQUEST, err.msg);
    const char *run_dir = run_dir_of(s, job);
    if (!run_dir) return no_such_job(conn, job);
    cJSON *steps = NULL;
    int more = 0;
    if (curve_read(run_dir, since, limit, &steps, &more, &err))
        return respond_error(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, err.msg);
    return respond_page(conn, "steps", steps, more);
}

// ?job=ID[&step=N]: the samples of step N, else of the newest step that has some (the page's
// view beside the loss curve), as the `samples` method's.
static enum MHD_Result get_samples(struct MHD_Connection *conn, const Snapshot *s) {
    Err err = {0};
    long job = 0;
    SamplesQuery q = {.step = -1};
    if (query_job(conn, &job, &err) || query_long(conn, "step", 0, 1L << 53, &q.step, &err))
        return respond_error(conn, MHD_HTTP_BAD_REQUEST, err.msg);
    const char *run_dir = run_dir_of(s, job);
    if (!run_dir) return no_such_job(conn, job);
    cJSON *rows = NULL;
    int more = 0;
    if (job_samples_read(run_dir, &q, &rows, &more, &err))
        return respond_error(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, err.msg);
    return respond_page(conn, "samples", rows, more);
}

// ---------------------------------------------------------------- calls on the loop

// An action (and /api/gpus) is a call the loop makes for an HTTP thread, of the very functions
// the control socket's verbs call (jobs.c): the thread queues it under mu and wakes the loop;
// the loop runs it, and its answer (a JSON result, or an RPC error code and its message) is
// handed back under mu. The thread waits at most CALL_TIMEOUT_S; a call the loop finishes
// after that is freed by the loop (refs). Counted in /metrics under the verb's method, as the
// control socket counts its requests.
// The action routes, /api/NAME, and the verb each calls (NULL: job_checkpoint, which changes no
// state and is answered at once).
typedef struct {
    const char *name;
    JobVerb verb;
} Action;

static const Action ACTIONS[] = {
    {"pause", job_pause}, {"resume", job_resume}, {"checkpoint", NULL}, {"cancel", job_cancel}};

typedef struct LoopCall {
    const Action *action; // NULL: the GPUs
    long job;
    double t0;
    int refs, done, code; // under mu; code 0: result
    char msg[ERR_MSG_MAX];
    cJSON *result;
    struct LoopCall *next; // queued for the loop, under mu
} LoopCall;

static uv_async_t call_wake;
static LoopCall *queued;        // under mu
static pthread_cond_t answered; // a call was answered (CLOCK_MONOTONIC)

static void call_release(LoopCall *c) { // under mu
    if (--c->refs) return;
    cJSON_Delete(c->result);
    free(c);
}

// Loop thread: c's answer (takes result).
static void call_finish(LoopCall *c, int code, const char *msg, cJSON *result) {
    if (c->action) metrics_request(c->action->name, 1, code, clock_mono_s() - c->t0);
    pthread_mutex_lock(&mu);
    c->code = code;
    snprintf(c->msg, sizeof c->msg, "%s", msg);
    c->result = result;
    c->done = 1;
    pthread_cond_broadcast(&answered);
    call_release(c);
    pthread_mutex_unlock(&mu);
}

// The ChangeDone of a verb: the job as it is now, as the control socket answers.
static void verb_done(void *arg, int code, const Err *err) {
    LoopCall *c = arg;
    Job *j = job_find(c->job);
    cJSON *result = !code && j ? job_to_raw_json(j) : NULL;
    call_finish(c,
                code     ? code
                : result ? 0
                         : RPC_INTERNAL_ERROR,
                code ? err->msg
                : j  ? "out of memory"
                     : "the job is gone",
                result);
}

static void run_call(LoopCall *c) {
    if (!c->action) {
        cJSON *o = cJSON_CreateObject(), *gpus = gpus_to_json();
        if (o && gpus && cJSON_AddItemToObject(o, "gpus", gpus)) {
            call_finish(c, 0, "", o);
        } else {
            cJSON_Delete(gpus);
            cJSON_Delete(o);
            call_finish(c, RPC_INTERNAL_ERROR, "out of memory", NULL);
        }
        return;
    }
    Job *j = job_find(c->job);
    int code = 0;
    Err err = {0};
    if (!j) {
        snprintf(err.msg, sizeof err.msg, "no such job: %ld", c->job);
        call_finish(c, RPC_NO_SUCH_JOB, err.msg, NULL);
        return;
    }
    if (!c->action->verb) { // checkpoint: no state change, answered at once
        if (job_checkpoint(j, &code, &err))
            call_finish(c, code, err.msg, NULL);
        else
            verb_done(c, 0, &err);
        return;
    }
    if (c->action->verb(j, verb_done, c, &code, &err)) call_finish(c, code, err.msg, NULL);
}

// Loop thread: the queued calls, in order.
static void on_call_wake(uv_async_t *h) {
    (void)h;
    pthread_mutex_lock(&mu);
    LoopCall *list = NULL;
    while (queued) { // reversed: queued is newest first
        LoopCall *c = queued;
        queued = c->next;
        c->next = list;
        list = c;
    }
    pthread_mutex_unlock(&mu);
    while (list) {
        LoopCall *c = list;
        list = c->next;
        run_call(c);
    }
}

// HTTP thread: the loop's answer to action (NULL: the GPUs) of job, within CALL_TIMEOUT_S.
// -1 with the code RPC_BUSY when the loop did not answer in time (or astraid is stopping).
static int loop_call(const Action *action, long job, int *code, char *msg, size_t cap,
                     cJSON **result) {
    *result = NULL;
    LoopCall *c = calloc(1, sizeof *c);
    if (!c) {
        *code = RPC_INTERNAL_ERROR;
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    *c = (LoopCall){.action = action, .job = job, .t0 = clock_mono_s(), .refs = 2};
    pthread_mutex_lock(&mu);
    int rc = 0;
    if (stopping) {
        c->refs = 1, rc = -1;
    } else {
        c->next = queued;
        queued = c;
        uv_async_send(&call_wake);
        struct timespec until = mono_timespec(clock_mono_s() + CALL_TIMEOUT_S);
        while (!c->done && !stopping)
            if (pthread_cond_timedwait(&answered, &mu, &until) == ETIMEDOUT) break;
        rc = c->done ? 0 : -1;
    }
    if (rc) {
        *code = RPC_BUSY;
        snprintf(msg, cap, "astraid did not answer within %d s", CALL_TIMEOUT_S);
    } else {
        *code = c->code;
        snprintf(msg, cap, "%s", c->msg);
        *result = c->result;
        c->result = NULL;
    }
    call_release(c);
    pthread_mutex_unlock(&mu);
    return rc;
}

// The HTTP status that says what a control error code says.
static unsigned status_of_rpc_error(int code) {
    switch (code) {
    case RPC_NO_SUCH_JOB:
        return MHD_HTTP_NOT_FOUND;
    case RPC_BAD_STATE:
        return MHD_HTTP_CONFLICT;
    case RPC_INVALID_PARAMS:
        return MHD_HTTP_BAD_REQUEST;
    case RPC_BUSY:
        return MHD_HTTP_SERVICE_UNAVAILABLE;
    default:
        return MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
}

// The answer to action of job (NULL: the GPUs) on the loop: 200 with its result, or its error
// as {"error": message} with the status that says the same (404 no such job, 409 bad state,
// ...); 503 when the loop does not answer.
static enum MHD_Result respond_call(struct MHD_Connection *conn, const Action *action, long job) {
    client_answering(conn); // not held to the request's deadline while the loop answers
    int code = 0;
    char msg[ERR_MSG_MAX];
    cJSON *result = NULL;
    loop_call(action, job, &code, msg, sizeof msg, &result);
    if (code) return respond_error(conn, status_of_rpc_error(code), msg);
    if (!result) return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    return respond_json(conn, MHD_HTTP_OK, result);
}

// The action of a route (/api/pause, ...), NULL for any other path.
static const Action *action_of(const char *url) {
    for (size_t i = 0; !strncmp(url, "/api/", 5) && i < sizeof ACTIONS / sizeof *ACTIONS; i++)
        if (!strcmp(url + 5, ACTIONS[i].name)) return &ACTIONS[i];
    return NULL;
}

// POST /api/NAME?job=ID: the action's JOB, as the control socket answers its verb.
static enum MHD_Result post_action(struct MHD_Connection *conn, const Action *action) {
    Err err = {0};
    long job = 0;
    if (query_job(conn, &job, &err)) return respond_error(conn, MHD_HTTP_BAD_REQUEST, err.msg);
    return respond_call(conn, action, job);
}

// ---------------------------------------------------------------- access

static int is_loopback(const struct sockaddr *a) {
    if (a->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)a)->sin_addr.s_addr) >> 24) == 127;
    if (a->sa_family != AF_INET6) return 0;
    const struct in6_addr *a6 = &((const struct sockaddr_in6 *)a)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(a6) || (IN6_IS_ADDR_V4MAPPED(a6) && a6->s6_addr[12] == 127);
}

// host: "NAME" or "NAME:PORT", NAME a loopback name (localhost, 127.x.y.z, [::1]). NULL
// (HTTP/1.0 without Host; on_request answers 400 to a later version without one) passes: a
// browser always sends Host.
static int host_is_loopback(const char *host) {
    if (!host) return 1;
    size_t n = strcspn(host, host[0] == '[' ? "]" : ":");
    if (host[0] == '[' && host[n]) n++; // the ']'
    const char *port = host + n;
    if (port[0] == ':' && all_digits(port + 1)) port = "";
    char name[64];
    if (*port || n >= sizeof name) return 0;
    memcpy(name, host, n);
    name[n] = 0;
    struct in_addr a;
    return !strcasecmp(name, "localhost") || !strcmp(name, "[::1]") ||
           (inet_pton(AF_INET, name, &a) == 1 && ntohl(a.s_addr) >> 24 == 127);
}

static const char *host_of(struct MHD_Connection *conn) {
    return MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
}

// auth: "Bearer TOKEN", the scheme in any case (RFC 7235 §2.1), then spaces, the token and
// maybe whitespace that is no part of it (RFC 7230 §3.2's OWS).
// The token of such a header (malloc'd), NULL when there is none.
static char *bearer_of(const char *auth) {
    const char *scheme = "Bearer ";
    if (!auth || strncasecmp(auth, scheme, strlen(scheme))) return NULL;
    const char *token = auth + strlen(scheme);
    token += strspn(token, " ");
    size_t n = strlen(token);
    while (n > 0 && (token[n - 1] == ' ' || token[n - 1] == '\t'))
        n--;
    return strndup(token, n);
}

static int bearer_ok(const char *auth) {
    char *given = bearer_of(auth);
    int ok = given && server_check_token(given);
    free(given);
    return ok;
}

// The login cookie (POST /login sets it): the token, hex-encoded so that any byte of it fits a
// cookie value. HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it).
#define LOGIN_COOKIE "astraid_login"

static int cookie_ok(struct MHD_Connection *conn) {
    const char *hex = MHD_lookup_connection_value(conn, MHD_COOKIE_KIND, LOGIN_COOKIE);
    size_t n = hex ? strlen(hex) : 0;
    if (!n || n % 2 || n > 2 * 4096) return 0;
    char *given = malloc(n / 2 + 1);
    int ok = given != NULL;
    for (size_t i = 0; ok && i < n / 2; i++) {
        unsigned v;
        ok = sscanf(hex + 2 * i, "%2x", &v) == 1 && isxdigit((unsigned char)hex[2 * i]) &&
             isxdigit((unsigned char)hex[2 * i + 1]);
        given[i] = (char)v;
    }
    if (ok) given[n / 2] = '\0';
    ok = ok && strlen(given) == n / 2 && server_check_token(given);
    free(given);
    return ok;
}

// A loopback peer that named a loopback host, or one with the bearer token. A loopback peer
// naming another host may be a browser's page whose name was rebound to 127.0.0.1 (DNS
// rebinding): it is no one to trust.
static int authorized(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (info && info->client_addr && is_loopback(info->client_addr) &&
        host_is_loopback(host_of(conn)))
        return 1;
    return bearer_ok(
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION));
}

// A state-changing request (an action, POST): with --token-file every peer, loopback included,
// needs the token (the bearer header, or the login cookie); without one, the read rule.
static int may_act(struct MHD_Connection *conn) {
    if (!astraid.cfg.token_file) return authorized(conn);
    return bearer_ok(
               MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION)) ||
           cookie_ok(conn);
}

// POST /login with the bearer token: 204 setting the login cookie, so that the page's buttons
// act without the token in its URL; a wrong or missing token is 401.
static enum MHD_Result login(struct MHD_Connection *conn) {
    char *given = bearer_of(
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION));
    if (!astraid.cfg.token_file || !given || !server_check_token(given)) {
        free(given);
        return respond_text(conn, MHD_HTTP_UNAUTHORIZED,
                            "unauthorized: POST /login with Authorization: Bearer TOKEN (the "
                            "--token-file token)\n");
    }
    size_t n = strlen(given);
    char *cookie = malloc(2 * n + 128);
    if (cookie) {
        int k = snprintf(cookie, 2 * n + 128, LOGIN_COOKIE "=");
        for (size_t i = 0; i < n; i++)
            k += snprintf(cookie + k, 3, "%02x", (unsigned char)given[i]);
        snprintf(cookie + k, 2 * n + 128 - (size_t)k, "; HttpOnly; SameSite=Strict; Path=/");
    }
    free(given);
    struct MHD_Response *r =
        cookie ? MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT) : NULL;
    client_answering(conn);
    if (!r) {
        free(cookie);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_SET_COOKIE, cookie);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    free(cookie);
    enum MHD_Result rc = MHD_queue_response(conn, MHD_HTTP_NO_CONTENT, r);
    MHD_destroy_response(r);
    return rc;
}

// A browser sends Origin on every POST: "http://HOST[:PORT]" of the page that posts. An
// action passes only without one (a client that is no browser) or from a page of this
// listener, whose Origin names the Host it asks.
static int same_origin(struct MHD_Connection *conn) {
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
    const char *host = host_of(conn);
    if (!origin) return 1;
    const char *rest = !strncasecmp(origin, "http://", 7)    ? origin + 7
                       : !strncasecmp(origin, "https://", 8) ? origin + 8
                                                             : NULL;
    return rest && host && !strcasecmp(rest, host);
}

// 421 naming the Host at fault: on a loopback listener every request names a loopback
// host, the page included (a rebound name must not even get the page, whose scripts would
// then read /api as same-origin).
static enum MHD_Result misdirected(struct MHD_Connection *conn) {
    char msg[160], host[SHOWN_BYTES + 1];
    snprintf(msg, sizeof msg,
             "misdirected: Host '%s' is not a loopback name (localhost, 127.0.0.1, [::1])\n",
             shown(host_of(conn), host));
    return respond_utf8(conn, MHD_HTTP_MISDIRECTED_REQUEST, "text/plain; charset=utf-8",
                        strdup(msg));
}

// The request line and headers' size past HTTP_HEADER_BYTES. The pool holds more
// (HTTP_POOL_BYTES, for the parameters parsed): libmicrohttpd's own 431 comes only past it.
static int too_big(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    return info && info->header_size > HTTP_HEADER_BYTES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
    (void)cls, (void)upload_data;
    // A method the path does not take (POST for actions, GET and HEAD for the rest): answered
    // at once, its body unread (the connection then closes). A HEAD is served as a GET:
    // libmicrohttpd sends the response's headers only.
    const Action *action = action_of(url);
    int logging_in = !strcmp(url, "/login");
    int reads = !strcmp(method, MHD_HTTP_METHOD_GET) || !strcmp(method, MHD_HTTP_METHOD_HEAD);
    if ((action || logging_in) && strcmp(method, MHD_HTTP_METHOD_POST))
        return respond_allow(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain; charset=utf-8",
                             "only POST\n", strlen("only POST\n"), MHD_RESPMEM_PERSISTENT, "POST");
    if (!action && !logging_in && !reads)
        return respond_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    if (too_big(conn))
        return respond_text(conn, MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE,
                            "request line and headers past 32 KiB\n");
    if (!host_of(conn) && strcmp(version, MHD_HTTP_VERSION_1_0)) // RFC 7230 §5.4
        return respond_text(conn, MHD_HTTP_BAD_REQUEST, "bad request: no Host header\n");
    if (loopback_listener && !host_is_loopback(host_of(conn))) return misdirected(conn);
    int page = !strcmp(url, "/");
    if ((action || logging_in) && !same_origin(conn))
        return respond_error(conn, MHD_HTTP_FORBIDDEN,
                             "forbidden: an action from a page of another origin");
    if (!page && !logging_in && !(action ? may_act(conn) : authorized(conn)))
        return respond_text(conn, MHD_HTTP_UNAUTHORIZED,
                            action && astraid.cfg.token_file
                                ? "unauthorized: with --token-file every action needs the token "
                                  "(Authorization: Bearer TOKEN, or log in: POST /login)\n"
                                : "unauthorized: send Authorization: Bearer TOKEN\n");
    // A request's first call has its headers only; answered then, libmicrohttpd could not know
    // the request is over and would close the connection. Answered on the next call, the
    // connection stays open for the next request.
    static int headers_seen;
    if (!*con_cls) {
        *con_cls = &headers_seen;
        return MHD_YES;
    }
    if (*upload_data_size) {
        *upload_data_size = 0; // a body: read and dropped (an action's parameter is ?job=)
        return MHD_YES;
    }
    if (page)
        return respond(conn, MHD_HTTP_OK, "text/html; charset=utf-8", (char *)web_index_html,
                       web_index_html_len, MHD_RESPMEM_PERSISTENT);
    if (logging_in) return login(conn);
    if (action) return post_action(conn, action);
    if (!strcmp(url, "/api/gpus")) return respond_call(conn, NULL, 0);
    int metrics = !strcmp(url, "/metrics"), jobs = !strcmp(url, "/api/jobs");
    int history = !strcmp(url, "/api/history"), samples = !strcmp(url, "/api/samples");
    if (!metrics && !jobs && !history && !samples)
        return respond_text(conn, MHD_HTTP_NOT_FOUND, "not found\n");
    client_answering(conn); // not while it waits for the loop's snapshot
    Snapshot *s = snapshot_get();
    if (!s) return respond_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "astraid is not answering\n");
    enum MHD_Result rc = metrics   ? get_metrics(conn, s)
                         : jobs    ? get_jobs(conn, s)
                         : history ? get_history(conn, s)
                                   : get_samples(conn, s);
    snapshot_release(s);
    return rc;
}

// Percent-decoding of the path and of each query key and value, except for one holding
// "%00", left as sent: its NUL would end the string every strcmp and strtol reads there
// ("/metrics%00" would be served as /metrics, "job=1%00" read as 1).
static size_t unescape(void *cls, struct MHD_Connection *conn, char *s) {
    (void)cls, (void)conn;
    return strstr(s, "%00") ? strlen(s) : MHD_http_unescape(s);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    msg[strcspn(msg, "\n")] = 0;
    log_debug("http: %s", msg);
}

// ---------------------------------------------------------------- start, stop

int http_check_config(const Config *c, Err *err) {
    struct sockaddr_storage ss;
    if (!c->http) return 0;
    if (server_parse_address("http", c->http, &ss, err)) return -1;
    if (!is_loopback((struct sockaddr *)&ss) && !c->token_file)
        return err_set(err,
                       "http: --http %s is not a loopback address: it needs --token-file (peers "
                       "off loopback send it as a bearer token)",
                       c->http);
    return 0;
}

int http_start(Err *err) {
    struct sockaddr_storage ss;
    if (!astraid.cfg.http) return 0;
    if (server_parse_address("http", astraid.cfg.http, &ss, err)) return -1;
    cond_init_monotonic(&fresh);
    cond_init_monotonic(&deadline_near);
    cond_init_monotonic(&answered);
    uv_async_init(astraid.loop, &wake, on_wake);
    uv_async_init(astraid.loop, &call_wake, on_call_wake);
    wake_open = 1;
    if (reaper_start(err)) return -1;
    unsigned flags = MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_DUAL_STACK; // [::]: IPv4 peers too
    loopback_listener = is_loopback((struct sockaddr *)&ss);
    mhd = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, NULL, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_THREAD_POOL_SIZE,
        (unsigned)HTTP_THREADS, MHD_OPTION_CONNECTION_LIMIT, HTTP_CONNECTIONS,
        MHD_OPTION_CONNECTION_TIMEOUT, HTTP_TIMEOUT_S, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        (size_t)HTTP_POOL_BYTES, MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, NULL, MHD_OPTION_NOTIFY_COMPLETED,
        on_completed, NULL, MHD_OPTION_END);
    if (!mhd)
        return err_resource(err, "http: cannot listen on %s (in use, or not an address here?)",
                            astraid.cfg.http);
    log_info("http: listening on %s", astraid.cfg.http);
    return 0;
}

void http_stop(void) {
    if (!wake_open) return; // never started
    pthread_mutex_lock(&mu);
    stopping = 1; // a reader waiting for the loop takes what there is
    pthread_cond_broadcast(&fresh);
    pthread_cond_broadcast(&answered);
    pthread_mutex_unlock(&mu);
    if (mhd) MHD_stop_daemon(mhd); // its threads are gone: nothing reads the snapshot
    mhd = NULL;
    reaper_stop(); // after: every connection is closed
    if (!uv_is_closing((uv_handle_t *)&wake)) uv_close((uv_handle_t *)&wake, NULL);
    if (!uv_is_closing((uv_handle_t *)&call_wake)) uv_close((uv_handle_t *)&call_wake, NULL);
    while (queued) { // queued after the loop's last turn: their threads are gone (MHD stopped)
        LoopCall *c = queued;
        queued = c->next;
        c->refs = 1;
        call_release(c);
    }
    snapshot_release(current);
    current = NULL;
}
