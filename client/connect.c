// connect.c: astraictl's connection to astraid: Unix socket or TCP with a bearer
// token (docs/protocol.md, Authentication), requests and replies over NDJSON, and the
// reconnection of the commands that follow a stream when astraid restarts.
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"
#include "client/text.h"
#include "common/clock.h"
#include "common/json.h"
#include "common/socket_path.h"

int client_socket_path(const Options *o, char *buf, size_t cap, Err *err) {
    if (!o->socket_path) return socket_default_path(buf, cap, err) ? EXIT_USAGE : EXIT_OK;
    int n = snprintf(buf, cap, "%s", o->socket_path);
    if (n < 0 || (size_t)n >= cap) return err_set(err, "socket path too long: %s", buf), EXIT_USAGE;
    return EXIT_OK;
}

// Connects fd to addr, giving up after timeout_ms.
static int connect_within(int fd, const struct sockaddr *addr, socklen_t len, int timeout_ms) {
    int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int rc = connect(fd, addr, len);
    if (rc && errno == EINPROGRESS) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        rc = poll(&p, 1, timeout_ms);
        if (rc == 0)
            errno = ETIMEDOUT;
        else if (rc > 0 && !getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl))
            errno = soerr;
        rc = rc > 0 && soerr == 0 ? 0 : -1;
    }
    fcntl(fd, F_SETFL, flags);
    return rc;
}

static int open_unix(Client *c, const char *path, Err *err) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return err_set(err, "socket path too long: %s", path), EXIT_USAGE;
    strcpy(addr.sun_path, path);
    c->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0 || connect_within(c->fd, (struct sockaddr *)&addr, sizeof addr, c->timeout_ms))
        return err_set(err, "cannot connect to %s: %s (is astraid running?)", path,
                       strerror(errno)),
               EXIT_CONNECT;
    return EXIT_OK;
}

static int open_tcp(Client *c, const char *hostport, Err *err) {
    char host[256];
    const char *colon = strrchr(hostport, ':');
    if (!colon || colon == hostport || !colon[1] || (size_t)(colon - hostport) >= sizeof host)
        return err_set(err, "--host: expected HOST:PORT, got '%s'", hostport), EXIT_USAGE;
    memcpy(host, hostport, (size_t)(colon - hostport));
    host[colon - hostport] = '\0';
    if (host[0] == '[' && host[strlen(host) - 1] == ']') { // [::1]:7070
        memmove(host, host + 1, strlen(host));
        host[strlen(host) - 1] = '\0';
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    int gai = getaddrinfo(host, colon + 1, &hints, &res);
    if (gai)
        return err_set(err, "cannot resolve %s: %s", hostport, gai_strerror(gai)), EXIT_CONNECT;
    int saved = ECONNREFUSED;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        c->fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (c->fd >= 0 && !connect_within(c->fd, a->ai_addr, a->ai_addrlen, c->timeout_ms)) break;
        saved = errno;
        if (c->fd >= 0) close(c->fd);
        c->fd = -1;
    }
    freeaddrinfo(res);
    if (c->fd < 0)
        return err_set(err, "cannot connect to %s: %s", hostport, strerror(saved)), EXIT_CONNECT;
    return EXIT_OK;
}

// The token file's content without trailing whitespace.
static int read_token(const char *path, char *buf, size_t cap, Err *err) {
    FILE *f = fopen(path, "r");
    if (!f) return err_set(err, "--token-file %s: %s", path, strerror(errno)), EXIT_USAGE;
    size_t n = fread(buf, 1, cap - 1, f);
    int too_long = n == cap - 1 && fgetc(f) != EOF;
    fclose(f);
    buf[n] = '\0';
    while (n && strchr(" \t\r\n", buf[n - 1]))
        buf[--n] = '\0';
    if (too_long || !n)
        return err_set(err, "--token-file %s: %s", path, n ? "token too long" : "empty"),
               EXIT_USAGE;
    return EXIT_OK;
}

static int authenticate(Client *c, const char *token, Err *err) {
    cJSON *params = cJSON_CreateObject(), *result = NULL;
    cJSON_AddStringToObject(params, "token", token);
    int rc = client_call(c, "auth", params, &result, err);
    cJSON_Delete(result);
    return rc;
}

int client_open(Client *c, const Options *o, Err *err) {
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->next_id = 1;
    c->timeout_ms = (int)(o->timeout_s * 1000);
    c->raw = o->json;
    rpc_reader_init(&c->reader);
    if (o->host && !o->token_file)
        return err_set(err, "--host needs --token-file (the daemon's bearer token)"), EXIT_USAGE;
    if (o->host) { // a bad token file is bad usage, found before connecting
        char token[4096];
        int rc = read_token(o->token_file, token, sizeof token, err);
        if (!rc) rc = open_tcp(c, o->host, err);
        return rc ? rc : authenticate(c, token, err);
    }
    char path[4096];
    int rc = client_socket_path(o, path, sizeof path, err);
    return rc ? rc : open_unix(c, path, err);
}

void client_close(Client *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    rpc_reader_free(&c->reader);
}

static int send_all(Client *c, const char *line, Err *err) {
    for (size_t off = 0, n = strlen(line); off < n;) {
        ssize_t w = send(c->fd, line + off, n - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) {
            c->lost = true;
            return err_set(err, "sending to astraid: %s", strerror(errno)), EXIT_CONNECT;
        }
        off += (size_t)w;
    }
    return EXIT_OK;
}

// Replaces *s, a string of a parsed cJSON tree (malloc'd: no cJSON hooks are set), by its
// terminal-safe form; -1 when out of memory.
static int make_safe(char **s) {
    char *safe = text_for_terminal(*s);
    if (!safe) return -1;
    cJSON_free(*s);
    *s = safe;
    return 0;
}

// The strings of v and of everything in it, member names included, made safe to print.
static int make_tree_safe(cJSON *v) {
    if ((v->string && make_safe(&v->string)) || (cJSON_IsString(v) && make_safe(&v->valuestring)))
        return -1;
    for (cJSON *child = v->child; child; child = child->next)
        if (make_tree_safe(child)) return -1;
    return 0;
}

// A message as it is shown: with --json its result and params as sent (only the error's
// message, printed as text, made safe), else all of it safe for a terminal.
static int make_message_safe(const Client *c, cJSON *msg, Err *err) {
    cJSON *shown = c->raw ? cJSON_GetObjectItemCaseSensitive(msg, "error") : msg;
    if (shown && make_tree_safe(shown))
        return err_resource(err, "out of memory reading astraid's reply"), EXIT_CONNECT;
    return EXIT_OK;
}

// The start of a line that is not a message, safe to print.
static int malformed(const char *line, Err *err) {
    char start[201];
    snprintf(start, sizeof start, "%s", line);
    char *safe = text_for_terminal(start);
    err_set(err, "astraid sent a malformed line: %s", safe ? safe : "?");
    free(safe);
    return EXIT_CONNECT;
}

// Reads the next message, waiting at most timeout_ms (-1: no limit).
static int read_message(Client *c, int timeout_ms, cJSON **msg, Err *err) {
    double deadline = clock_mono_s() + timeout_ms / 1000.0;
    for (;;) {
        char *line;
        size_t len;
        int got = rpc_reader_next(&c->reader, &line, &len);
        if (got == RPC_LINE_OVERSIZED)
            return err_set(err, "astraid sent a line longer than %u bytes", RPC_MAX_LINE),
                   EXIT_CONNECT;
        if (got == RPC_LINE_OK) {
            *msg = cJSON_ParseWithLength(line, len);
            if (!*msg && len && json_out_of_memory())
                return err_resource(err, "out of memory reading astraid's reply"), EXIT_CONNECT;
            if (!cJSON_IsObject(*msg)) {
                cJSON_Delete(*msg);
                return malformed(line, err);
            }
            int rc = make_message_safe(c, *msg, err);
            if (rc) cJSON_Delete(*msg);
            return rc;
        }
        int wait_ms = timeout_ms < 0 ? -1 : (int)((deadline - clock_mono_s()) * 1000);
        if (timeout_ms >= 0 && wait_ms <= 0)
            return err_set(err, "no reply from astraid within %.3g s", timeout_ms / 1000.0),
                   EXIT_CONNECT;
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        int ready = poll(&p, 1, wait_ms);
        if (ready < 0 && errno == EINTR) continue;
        if (ready <= 0) continue; // timeout: the deadline check above reports it
        char buf[65536];
        ssize_t r = recv(c->fd, buf, sizeof buf, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            c->lost = true;
            return err_set(err, "connection to astraid %s", r ? strerror(errno) : "closed"),
                   EXIT_CONNECT;
        }
        if (rpc_reader_feed(&c->reader, buf, (size_t)r))
            return err_resource(err, "out of memory reading astraid's reply"), EXIT_CONNECT;
    }
}

static void dispatch_push(Client *c, const cJSON *msg) {
    const cJSON *method = cJSON_GetObjectItemCaseSensitive(msg, "method");
    if (c->on_push && cJSON_IsString(method))
        c->on_push(method->valuestring, cJSON_GetObjectItemCaseSensitive(msg, "params"),
                   c->push_ctx);
}

// Takes the result out of a reply, or reports its error.
static int take_result(cJSON *reply, cJSON **result, Err *err) {
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(reply, "error");
    if (error) {
        const cJSON *message = cJSON_GetObjectItemCaseSensitive(error, "message");
        err_set(err, "%s",
                cJSON_IsString(message) ? message->valuestring : "error without message");
        return EXIT_DAEMON_ERROR;
    }
    *result = cJSON_DetachItemFromObjectCaseSensitive(reply, "result");
    if (!*result) return err_set(err, "astraid sent a reply without result or error"), EXIT_CONNECT;
    return EXIT_OK;
}

int client_call(Client *c, const char *method, cJSON *params, cJSON **result, Err *err) {
    *result = NULL;
    char *line = rpc_request(c->next_id++, method, params);
    if (!line) return err_resource(err, "%s: out of memory for the request", method), EXIT_CONNECT;
    int rc = send_all(c, line, err);
    free(line);
    while (!rc) {
        cJSON *msg = NULL;
        rc = read_message(c, c->timeout_ms, &msg, err);
        if (rc) break;
        if (cJSON_HasObjectItem(msg, "id")) { // replies come in order: this one is ours
            rc = take_result(msg, result, err);
            cJSON_Delete(msg);
            break;
        }
        dispatch_push(c, msg);
        cJSON_Delete(msg);
    }
    return rc;
}

int client_wait_push(Client *c, Err *err) {
    cJSON *msg = NULL;
    int rc = read_message(c, -1, &msg, err);
    if (!rc) dispatch_push(c, msg);
    cJSON_Delete(msg);
    return rc;
}

#define RECONNECT_FIRST_MS 100 // the first retry of a lost connection; then doubled
#define RECONNECT_MAX_MS 2000  // up to this between two tries

static void sleep_ms(long ms) {
    nanosleep(&(struct timespec){ms / 1000, ms % 1000 * 1000000L}, NULL);
}

// A new connection in place of c's lost one, tried until it opens (astraid restarted) or
// o->reconnect_s has passed; c's push handler is kept. Only a connection that cannot be made
// is tried again: a bad token file or a refused token ends it.
static int client_reconnect(Client *c, const Options *o, Err *err) {
    char why[sizeof err->msg];
    snprintf(why, sizeof why, "%s", err->msg);
    c->lost = false;
    if (o->reconnect_s == 0) return EXIT_CONNECT; // err still says why
    fprintf(stderr, "astraictl: %s; reconnecting\n", why);
    PushHandler on_push = c->on_push;
    void *push_ctx = c->push_ctx;
    double give_up = clock_mono_s() + (double)o->reconnect_s;
    for (long delay_ms = RECONNECT_FIRST_MS;;
         delay_ms = delay_ms * 2 > RECONNECT_MAX_MS ? RECONNECT_MAX_MS : delay_ms * 2) {
        double left_ms = (give_up - clock_mono_s()) * 1000;
        if (o->reconnect_s > 0 && left_ms <= 0)
            return err_set(err, "%s; not back within %ld s (--reconnect-timeout)", why,
                           o->reconnect_s),
                   EXIT_CONNECT;
        sleep_ms(o->reconnect_s > 0 && left_ms < delay_ms ? (long)left_ms + 1 : delay_ms);
        client_close(c);
        int rc = client_open(c, o, err);
        c->on_push = on_push;
        c->push_ctx = push_ctx;
        if (rc != EXIT_CONNECT) {
            if (!rc) fprintf(stderr, "astraictl: reconnected to astraid\n");
            return rc;
        }
    }
}

int client_stream(Client *c, const Options *o, StreamFn fn, void *ctx, Err *err) {
    int rc = fn(c, ctx, false, err);
    while (rc == EXIT_CONNECT && c->lost) {
        rc = client_reconnect(c, o, err);
        if (!rc) rc = fn(c, ctx, true, err);
    }
    return rc;
}
