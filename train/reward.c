// reward.c: the reward command and the reward endpoint (train/reward.h).
#include "train/reward.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/buf.h"
#include "common/clock.h"
#include "common/json.h"
#include "common/words.h"
#include "proto/rpc.h" // rpc_utf8_sanitize: a reader of the requests may insist on UTF-8

enum { MAX_WORDS = 256, MAX_REPLY = 16 << 20, QUOTED = 160 };

struct Reward {
    RewardOptions o;
    // the command
    char *words; // words_split's copy
    char *argv[MAX_WORDS + 1];
    pid_t pid; // 0: not running
    int to_child, from_child;
    Buf in;     // bytes read from the child, not yet a whole line
    int deaths; // in a row, since the last reply
    // the endpoint
    char host[256], port[8], path[2048];
};

// ---------------------------------------------------------------- the command's process

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

// The child's side: stdin and stdout on the pipes, dying with the rank, then the program; a
// failed exec reports its errno on the status pipe (close-on-exec: EOF there means it ran).
static void exec_child(Reward *r, const int in[2], const int out[2], int status_fd) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    signal(SIGPIPE, SIG_DFL);
    execvp(r->argv[0], r->argv);
    int e = errno;
    if (write(status_fd, &e, sizeof e) < 0) _exit(127);
    _exit(127);
}

static int spawn(Reward *r, Err *err) {
    int in[2], out[2], st[2];
    if (pipe2(in, O_CLOEXEC)) return err_errno(err, errno, "reward_command: pipe");
    if (pipe2(out, O_CLOEXEC)) {
        close(in[0]), close(in[1]);
        return err_errno(err, errno, "reward_command: pipe");
    }
    if (pipe2(st, O_CLOEXEC)) {
        close(in[0]), close(in[1]), close(out[0]), close(out[1]);
        return err_errno(err, errno, "reward_command: pipe");
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) exec_child(r, in, out, st[1]);
    close(in[0]), close(out[1]), close(st[1]);
    if (pid < 0) {
        close(in[1]), close(out[0]), close(st[0]);
        return err_errno(err, errno, "reward_command: fork");
    }
    int e = 0;
    ssize_t n = read(st[0], &e, sizeof e);
    close(st[0]);
    r->pid = pid, r->to_child = in[1], r->from_child = out[0];
    r->in.len = 0;
    if (n <= 0) return 0;
    waitpid(pid, NULL, 0);
    r->pid = 0;
    close_fd(&r->to_child), close_fd(&r->from_child);
    return err_set(err, "reward_command: cannot run '%s': %s", r->argv[0], strerror(e));
}

// Ends the child: SIGKILL (a child that closed its stdout may still run), then its status as
// words ("exited with status 1").
static void reap(Reward *r, char *how, size_t cap) {
    snprintf(how, cap, "is gone");
    if (!r->pid) return;
    close_fd(&r->to_child), close_fd(&r->from_child);
    int status;
    pid_t got = waitpid(r->pid, &status, WNOHANG);
    if (got == 0) {
        kill(r->pid, SIGKILL);
        got = waitpid(r->pid, &status, 0);
    }
    if (got == r->pid && WIFEXITED(status))
        snprintf(how, cap, "exited with status %d", WEXITSTATUS(status));
    else if (got == r->pid && WIFSIGNALED(status))
        snprintf(how, cap, "was killed by signal %d", WTERMSIG(status));
    r->pid = 0;
}

// ---------------------------------------------------------------- requests and replies

// The request's JSON line (newline-terminated, valid UTF-8); NULL when out of memory.
static char *request_line(const RewardRequest *q) {
    cJSON *o = cJSON_CreateObject(), *rs = cJSON_CreateArray();
    cJSON_AddItemToObject(o, "id", cJSON_CreateNumber((double)q->id));
    cJSON_AddItemToObject(o, "prompt", cJSON_CreateString(q->prompt_text));
    for (int j = 0; j < q->G; j++)
        cJSON_AddItemToArray(rs, cJSON_CreateString(q->responses[j]));
    cJSON_AddItemToObject(o, "responses", rs);
    cJSON_AddItemToObject(o, "meta", q->meta ? cJSON_Duplicate(q->meta, 1) : cJSON_CreateObject());
    char *text = json_out_of_memory() ? NULL : rpc_utf8_sanitize(cJSON_PrintUnformatted(o));
    cJSON_Delete(o);
    Buf b = {0};
    int rc = text ? buf_printf(&b, "%s\n", text) : -1;
    free(text);
    return rc ? (buf_free(&b), NULL) : buf_take(&b);
}

// The first QUOTED bytes of a reply for a message, sanitised.
static void quote(const char *line, char *out, size_t cap) {
    size_t n = strlen(line);
    snprintf(out, cap, "%.*s%s", (int)(n > QUOTED ? QUOTED : n), line, n > QUOTED ? "..." : "");
    for (char *c = out; *c; c++)
        if ((unsigned char)*c < 0x20) *c = ' ';
}

// The reply's rewards, checked against the request.
static int parse_reply(const char *what, const RewardRequest *q, const char *line, float *rewards,
                       Err *err) {
    char shown[QUOTED + 8];
    quote(line, shown, sizeof shown);
    cJSON *o = cJSON_Parse(line);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "id");
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(o, "rewards");
    int rc = 0;
    if (!o && !json_out_of_memory())
        rc = err_set(err, "is not valid JSON (nor are NaN and Infinity)");
    else if (!cJSON_IsObject(o))
        rc = err_set(err, "is not a JSON object");
    else if (!cJSON_IsNumber(id) || id->valuedouble != (double)q->id)
        rc = err_set(err, "\"id\" is not the request's %ld", q->id);
    else if (!cJSON_IsArray(rs) || cJSON_GetArraySize(rs) != q->G)
        rc = err_set(err, "\"rewards\" is not an array of %d numbers (one per response)", q->G);
    for (int j = 0; !rc && j < q->G; j++) {
        const cJSON *x = cJSON_GetArrayItem(rs, j);
        if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble) || fabs(x->valuedouble) > 3e38)
            rc = err_set(err, "\"rewards\"[%d] is not a finite number", j);
        else
            rewards[j] = (float)x->valuedouble;
    }
    cJSON_Delete(o);
    if (json_out_of_memory()) return err_resource(err, "%s: out of memory for a reply", what);
    return rc ? err_prefix(err, "%s: request %ld (prompt %ld): the reply '%s'", what, q->id,
                           q->prompt, shown)
              : 0;
}

static int remaining_ms(double deadline) {
    double left = deadline - clock_mono_s();
    return left <= 0 ? 0 : left > 1e6 ? 1000000000 : (int)ceil(left * 1000);
}

// Waits until fd is readable (events POLLIN) or writable: 1 ready, 0 past the deadline, -1 error.
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, remaining_ms(deadline));
        if (n >= 0) return n;
        if (errno != EINTR) return -1;
    }
}

// ---------------------------------------------------------------- the command

enum { GOT_LINE, GOT_EOF, GOT_TIMEOUT, GOT_ERROR };

// Writes the whole request: GOT_LINE, GOT_EOF (the child is gone: a broken pipe) or GOT_ERROR.
static int send_all(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno == EPIPE ? GOT_EOF : GOT_ERROR;
        s += w, n -= (size_t)w;
    }
    return GOT_LINE;
}

// The child's next line into *line (malloc'd, without its newline).
static int read_line(Reward *r, double deadline, char **line) {
    for (;;) {
        char *nl = r->in.len ? memchr(r->in.data, '\n', r->in.len) : NULL;
        if (nl) {
            size_t n = (size_t)(nl - r->in.data);
            if (!(*line = strndup(r->in.data, n))) return GOT_ERROR;
            memmove(r->in.data, nl + 1, r->in.len - n - 1);
            r->in.len -= n + 1;
            return GOT_LINE;
        }
        if (r->in.len > MAX_REPLY) return GOT_ERROR;
        int ready = wait_fd(r->from_child, POLLIN, deadline);
        if (ready <= 0) return ready ? GOT_ERROR : GOT_TIMEOUT;
        char chunk[65536];
        ssize_t n = read(r->from_child, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return n ? GOT_ERROR : GOT_EOF;
        if (buf_append(&r->in, chunk, (size_t)n)) return GOT_ERROR;
    }
}

// One exchange with a running child: GOT_LINE with the reply, or what stopped it.
static int exchange(Reward *r, const char *request, char **line) {
    double deadline = clock_mono_s() + r->o.timeout_s;
    int rc = send_all(r->to_child, request, strlen(request));
    return rc == GOT_LINE ? read_line(r, deadline, line) : rc;
}

static int command_score(Reward *r, const RewardRequest *q, const char *request, float *rewards,
                         Err *err) {
    for (;;) {
        if (!r->pid && spawn(r, err)) return -1;
        char *line = NULL, how[64];
        int got = exchange(r, request, &line);
        if (got == GOT_LINE) {
            r->deaths = 0;
            int rc = parse_reply("reward_command", q, line, rewards, err);
            free(line);
            return rc;
        }
        reap(r, how, sizeof how);
        if (got == GOT_TIMEOUT)
            return err_set(err,
                           "reward_command: no reply to request %ld (prompt %ld) within "
                           "reward_timeout_s %g: killed",
                           q->id, q->prompt, r->o.timeout_s);
        if (got == GOT_ERROR)
            return err_set(err, "reward_command: request %ld (prompt %ld): %s", q->id, q->prompt,
                           r->in.len > MAX_REPLY ? "a reply line over 16 MiB" : "the pipes failed");
        if (++r->deaths > r->o.restarts)
            return err_set(err,
                           "reward_command '%s' %s before replying to request %ld (prompt %ld), "
                           "%d time(s) in a row (reward_restarts %d): giving up",
                           r->argv[0], how, q->id, q->prompt, r->deaths, r->o.restarts);
        fprintf(stderr,
                "warning: reward_command '%s' %s before replying to request %ld: restarted "
                "(%d of reward_restarts %d in a row)\n",
                r->argv[0], how, q->id, r->deaths, r->o.restarts);
    }
}

// ---------------------------------------------------------------- the endpoint

static int parse_url(Reward *r, const char *url, Err *err) {
    const char *p = url + 7;
    if (strncmp(url, "http://", 7))
        return err_set(err,
                       "reward_url: '%s' is not http://HOST[:PORT]/PATH (https is not "
                       "spoken here: put a local proxy in front)",
                       url);
    size_t hn = strcspn(p, ":/");
    if (!hn || hn >= sizeof r->host) return err_set(err, "reward_url: '%s' has no host", url);
    memcpy(r->host, p, hn);
    r->host[hn] = 0;
    p += hn;
    snprintf(r->port, sizeof r->port, "80");
    if (*p == ':') {
        size_t pn = strspn(++p, "0123456789");
        if (!pn || pn > 5 || atoi(p) < 1 || atoi(p) > 65535 || (p[pn] && p[pn] != '/'))
            return err_set(err, "reward_url: '%s' has no port in 1-65535 after the ':'", url);
        snprintf(r->port, sizeof r->port, "%.*s", (int)pn, p);
        p += pn;
    }
    if (strlen(*p ? p : "/") >= sizeof r->path)
        return err_set(err, "reward_url: '%s': the path is too long", url);
    snprintf(r->path, sizeof r->path, "%s", *p ? p : "/");
    return 0;
}

// A connected socket to the endpoint, or -1 (errno set).
static int connect_endpoint(const Reward *r, double deadline) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    if (getaddrinfo(r->host, r->port, &hints, &res)) return errno = EHOSTUNREACH, -1;
    int fd = -1, e = ECONNREFUSED;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        socklen_t len = sizeof e;
        if (rc && errno == EINPROGRESS && wait_fd(fd, POLLOUT, deadline) == 1 &&
            !getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) && !e)
            rc = 0;
        else if (rc)
            e = errno == EINPROGRESS ? ETIMEDOUT : errno;
        if (rc) close(fd), fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) errno = e;
    return fd;
}

// POSTs body and reads the whole response into *resp (the server closes the connection).
static int http_exchange(const Reward *r, const char *body, double deadline, Buf *resp, Err *err) {
    int fd = connect_endpoint(r, deadline);
    if (fd < 0) return err_errno(err, errno, "connecting to %s:%s", r->host, r->port);
    Buf req = {0};
    int rc = buf_printf(&req,
                        "POST %s HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                        "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                        r->path, r->host, r->port, strlen(body), body)
                 ? err_resource(err, "out of memory for a request")
                 : 0;
    for (size_t off = 0; !rc && off < req.len;) {
        ssize_t w = wait_fd(fd, POLLOUT, deadline) == 1
                        ? send(fd, req.data + off, req.len - off, MSG_NOSIGNAL)
                        : -1;
        if (w < 0) rc = err_set(err, "sending the request failed or timed out");
        off += w > 0 ? (size_t)w : 0;
    }
    while (!rc) {
        char chunk[65536];
        int ready = wait_fd(fd, POLLIN, deadline);
        ssize_t n = ready == 1 ? recv(fd, chunk, sizeof chunk, 0) : -1;
        if (ready == 0)
            rc = err_set(err, "no reply within reward_timeout_s %g", r->o.timeout_s);
        else if (n < 0 && errno != EINTR && errno != EAGAIN)
            rc = err_errno(err, errno, "reading the reply");
        else if (n == 0)
            break;
        else if (n > 0 && (resp->len + (size_t)n > MAX_REPLY || buf_append(resp, chunk, (size_t)n)))
            rc = err_set(err, "a reply over 16 MiB");
    }
    close(fd);
    buf_free(&req);
    return rc;
}

// The body of a 200 response (pointing into resp), or an error naming the status.
static int http_body(Buf *resp, const char **body, Err *err) {
    if (!resp->len) return err_set(err, "the endpoint closed the connection without a reply");
    int status = 0;
    if (sscanf(resp->data, "HTTP/1.%*d %d", &status) != 1)
        return err_set(err, "the reply is not HTTP");
    char *end = strstr(resp->data, "\r\n\r\n");
    if (!end) return err_set(err, "the reply's headers do not end");
    *end = 0;
    if (strcasestr(resp->data, "\r\ntransfer-encoding: chunked"))
        return err_set(err, "a chunked reply: send it with a Content-Length");
    if (status != 200) return err_set(err, "HTTP status %d", status);
    *body = end + 4;
    return 0;
}

static int url_score(Reward *r, const RewardRequest *q, const char *request, float *rewards,
                     Err *err) {
    double deadline = clock_mono_s() + r->o.timeout_s;
    for (int attempt = 0;; attempt++) {
        Buf resp = {0};
        const char *body = NULL;
        int rc = http_exchange(r, request, deadline, &resp, err) || http_body(&resp, &body, err);
        if (!rc)
            rc = parse_reply("reward_url", q, body, rewards, err);
        else if (attempt < r->o.restarts && strstr(err->msg, "connecting to"))
            rc = 1; // not up (yet, or again): another try within the same deadline
        else
            rc = err_prefix(err, "reward_url http://%s:%s%s: request %ld (prompt %ld)", r->host,
                            r->port, r->path, q->id, q->prompt);
        buf_free(&resp);
        if (rc <= 0) return rc;
    }
}

// ---------------------------------------------------------------- the interface

int reward_open(Reward **out, const RewardOptions *o, Err *err) {
    Reward *r = calloc(1, sizeof *r);
    if (!r) return err_resource(err, "reward: out of memory");
    *out = r;
    r->o = *o;
    r->to_child = r->from_child = -1;
    if (o->url) return parse_url(r, o->url, err);
    int n;
    if (!(r->words = words_split("reward_command", o->command, r->argv, MAX_WORDS, &n, err)))
        return -1;
    if (!n) return err_set(err, "reward_command: no program in '%s'", o->command);
    r->argv[n] = NULL;
    return spawn(r, err);
}

int reward_score(Reward *r, const RewardRequest *q, float *rewards, Err *err) {
    char *request = request_line(q);
    if (!request) return err_resource(err, "reward: out of memory for request %ld", q->id);
    int rc = r->o.url ? url_score(r, q, request, rewards, err)
                      : command_score(r, q, request, rewards, err);
    free(request);
    return rc;
}

void reward_close(Reward *r) {
    if (!r) return;
    if (r->pid) {
        close_fd(&r->to_child); // EOF on its stdin: a well-behaved command exits
        int status;
        if (waitpid(r->pid, &status, WNOHANG) == 0) {
            kill(r->pid, SIGKILL);
            waitpid(r->pid, &status, 0);
        }
        close_fd(&r->from_child);
    }
    buf_free(&r->in);
    free(r->words);
    free(r);
}
