// rendezvous.c: rank 0 gathers a hello from every rank over TCP, checks them, and
// answers each with the payload or with the error that stopped the meeting.
//
// Wire format, all words big-endian uint32:
//   hello (rank r → rank 0): magic, version, rank, world_size, payload length
//   reply (rank 0 → rank r): magic, status (0 ok, 1 error), n, then n bytes
//                            (the payload, or the error message)
#include "train/rendezvous.h"
#include "common/clock.h"
#include "ranks/ranks.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RDZV_MAGIC 0x4153525au // "ASRZ"
#define RDZV_VERSION 1u
#define HELLO_WORDS 5
#define REPLY_WORDS 3
#define RETRY_MS 100
#define CONNECT_TRY_MS 1000 // one connect attempt (an unroutable address never answers)
#define REPLY_SLACK_MS 2000 // peers wait longer than rank 0 so they hear its verdict
#define REPLY_SEND_MS 2000  // rank 0's time to hand one rank its reply
#define MAX_PENDING 64      // connections accepted but not yet identified
#define MAX_MISSING_LISTED 16

enum { REPLY_OK = 0, REPLY_ERROR = 1 };
typedef enum { IO_OK, IO_TIMEOUT, IO_CLOSED, IO_ERROR } IoStatus;

static int ms_left(int64_t deadline) {
    int64_t left = deadline - clock_mono_ms();
    return left < 0 ? 0 : (int)left;
}

static double secs(int ms) {
    return ms / 1000.0;
}

// A stop request arrived (cfg->stop): the ranks that did not come may never come.
static int stopped(const RendezvousConfig *cfg, Err *err) {
    if (!cfg->stop || !*cfg->stop) return 0;
    return err_set(err, "rendezvous: stopped by a signal while the ranks met");
}

// 1 when fd is ready for `events` (or has an error to report), 0 at the deadline.
static int wait_fd(int fd, short events, int64_t deadline) {
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, ms_left(deadline));
        if (r >= 0) return r;
        if (errno != EINTR) return -1;
    }
}

static IoStatus send_all(int fd, const void *buf, size_t len, int64_t deadline) {
    const uint8_t *p = buf;
    while (len > 0) {
        int r = wait_fd(fd, POLLOUT, deadline);
        if (r <= 0) return r == 0 ? IO_TIMEOUT : IO_ERROR;
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n < 0) return errno == EPIPE || errno == ECONNRESET ? IO_CLOSED : IO_ERROR;
        p += n;
        len -= (size_t)n;
    }
    return IO_OK;
}

static IoStatus recv_all(int fd, void *buf, size_t len, int64_t deadline) {
    uint8_t *p = buf;
    while (len > 0) {
        int r = wait_fd(fd, POLLIN, deadline);
        if (r <= 0) return r == 0 ? IO_TIMEOUT : IO_ERROR;
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n == 0 || (n < 0 && errno == ECONNRESET)) return IO_CLOSED;
        if (n < 0) return IO_ERROR;
        p += n;
        len -= (size_t)n;
    }
    return IO_OK;
}

static void put_words(uint8_t *out, const uint32_t *w, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t be = htonl(w[i]);
        memcpy(out + 4 * i, &be, 4);
    }
}

static void get_words(const uint8_t *in, uint32_t *w, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t be;
        memcpy(&be, in + 4 * i, 4);
        w[i] = ntohl(be);
    }
}

// "host:port" of the other end of a connection.
static void peer_name(int fd, char *out, size_t cap) {
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (getpeername(fd, (struct sockaddr *)&sa, &sl) == 0) {
        if (sa.ss_family == AF_INET) {
            struct sockaddr_in *in = (struct sockaddr_in *)&sa;
            inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
            port = ntohs(in->sin_port);
        } else if (sa.ss_family == AF_INET6) {
            struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&sa;
            if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) // an IPv4 rank on the dual-stack socket
                inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], host, sizeof host);
            else
                inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
            port = ntohs(in6->sin6_port);
        }
    }
    snprintf(out, cap, "%s:%d", host, port);
}

// ---------------------------------------------------------------- rank 0

typedef struct {
    int fd;
    size_t got;
    uint8_t hello[4 * HELLO_WORDS];
} Pending;

typedef struct {
    const RendezvousConfig *cfg;
    size_t len;
    int *by_rank; // (world_size,) connection of each rank that arrived, -1 if not yet
    int arrived;  // rank 0 included
    Pending pend[MAX_PENDING];
    int npend;
} Root;

static void send_reply(int fd, uint32_t status, const void *body, size_t n) {
    uint8_t head[4 * REPLY_WORDS];
    uint32_t w[REPLY_WORDS] = {RDZV_MAGIC, status, (uint32_t)n};
    put_words(head, w, REPLY_WORDS);
    int64_t deadline = clock_mono_ms() + REPLY_SEND_MS;
    // A rank that is gone needs no answer: its send error is not ours.
    if (send_all(fd, head, sizeof head, deadline) == IO_OK) send_all(fd, body, n, deadline);
}

static int missing_error(const Root *r, Err *err) {
    char list[256] = "";
    size_t used = 0;
    int listed = 0;
    for (int i = 1; i < r->cfg->world_size && listed < MAX_MISSING_LISTED; i++) {
        if (r->by_rank[i] >= 0) continue;
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%d", listed ? ", " : "", i);
        listed++;
    }
    int missing = r->cfg->world_size - r->arrived;
    return err_set(err, "rendezvous: only %d of %d ranks arrived within %g s (missing: rank %s%s)",
                   r->arrived, r->cfg->world_size, secs(r->cfg->timeout_ms), list,
                   missing > listed ? ", ..." : "");
}

// Checks one rank's hello; on success the connection becomes that rank's.
static int identify(Root *r, int fd, const uint8_t *hello, Err *err) {
    uint32_t w[HELLO_WORDS];
    get_words(hello, w, HELLO_WORDS);
    uint32_t version = w[1], rank = w[2], world = w[3], len = w[4];
    char from[INET6_ADDRSTRLEN + 16];
    peer_name(fd, from, sizeof from);
    if (version != RDZV_VERSION)
        return err_set(err,
                       "rendezvous: %s speaks protocol version %u but rank 0 speaks %u "
                       "(different astrai builds?)",
                       from, version, RDZV_VERSION);
    if (world != (uint32_t)r->cfg->world_size)
        return err_set(err,
                       "rendezvous: rank %u (%s) says WORLD_SIZE=%u but rank 0 has WORLD_SIZE=%d",
                       rank, from, world, r->cfg->world_size);
    if (rank == 0)
        return err_set(err,
                       "rendezvous: a second rank 0 connected from %s (RANK must differ "
                       "on every process)",
                       from);
    if (rank >= world)
        return err_set(err, "rendezvous: %s says RANK=%u, not below WORLD_SIZE=%u", from, rank,
                       world);
    if (r->by_rank[rank] >= 0)
        return err_set(err,
                       "rendezvous: rank %u connected twice (again from %s; RANK must differ "
                       "on every process)",
                       rank, from);
    if (len != r->len)
        return err_set(err,
                       "rendezvous: rank %u (%s) expects a %u-byte payload but rank 0 sends "
                       "%zu bytes (different builds, or NCCL on only some ranks?)",
                       rank, from, len, r->len);
    r->by_rank[rank] = fd;
    r->arrived++;
    return 0;
}

static void drop_pending(Root *r, int i) {
    r->pend[i] = r->pend[--r->npend];
}

static void accept_new(Root *r, int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) return; // EAGAIN: no more; other errors: the listener stays usable
        if (r->npend == MAX_PENDING) {
            close(fd); // a flood of strangers must not push out ranks still to come
            continue;
        }
        r->pend[r->npend++] = (Pending){.fd = fd};
    }
}

// Reads what arrived on pending connection i; a complete hello is checked.
static int read_pending(Root *r, int i, Err *err) {
    Pending *p = &r->pend[i];
    ssize_t n = recv(p->fd, p->hello + p->got, sizeof p->hello - p->got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (n <= 0) {
        close(p->fd);
        drop_pending(r, i);
        return 0;
    }
    p->got += (size_t)n;
    if (p->got < sizeof p->hello) return 0;
    uint8_t hello[sizeof p->hello];
    memcpy(hello, p->hello, sizeof hello);
    int fd = p->fd;
    drop_pending(r, i);
    uint32_t magic;
    get_words(hello, &magic, 1);
    if (magic != RDZV_MAGIC) { // not one of ours (a port scanner, a stray client)
        close(fd);
        return 0;
    }
    if (identify(r, fd, hello, err)) {
        send_reply(fd, REPLY_ERROR, err->msg, strlen(err->msg));
        close(fd);
        return -1;
    }
    return 0;
}

static int gather(Root *r, int lfd, int64_t deadline, Err *err) {
    struct pollfd fds[1 + MAX_PENDING];
    while (r->arrived < r->cfg->world_size) {
        int left = ms_left(deadline);
        if (stopped(r->cfg, err)) return -1;
        if (left == 0) return missing_error(r, err);
        fds[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
        for (int i = 0; i < r->npend; i++)
            fds[1 + i] = (struct pollfd){.fd = r->pend[i].fd, .events = POLLIN};
        int npend = r->npend;
        if (poll(fds, (nfds_t)(1 + npend), left) < 0 && errno != EINTR)
            return err_set(err, "rendezvous: poll: %s", strerror(errno));
        // Back to front: drop_pending moves the last entry into the freed slot.
        for (int i = npend - 1; i >= 0; i--)
            if (fds[1 + i].revents && read_pending(r, i, err)) return -1;
        if (fds[0].revents & POLLIN) accept_new(r, lfd);
    }
    return 0;
}

static int run_root(const RendezvousConfig *cfg, const uint8_t *payload, size_t len, Err *err) {
    int64_t deadline = clock_mono_ms() + cfg->timeout_ms;
    int lfd = cfg->listen_fd;
    if (lfd < 0 && ranks_listen(NULL, cfg->port, &lfd, NULL, err)) return -1;
    fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK);
    Root r = {.cfg = cfg, .len = len, .arrived = 1};
    r.by_rank = malloc(sizeof(int) * (size_t)cfg->world_size);
    if (!r.by_rank) {
        if (cfg->listen_fd < 0) close(lfd);
        return err_resource(err, "rendezvous: out of memory for %d ranks", cfg->world_size);
    }
    for (int i = 0; i < cfg->world_size; i++)
        r.by_rank[i] = -1;
    int rc = gather(&r, lfd, deadline, err);
    // Every rank that came hears the outcome: the payload, or why there is none.
    for (int i = 1; i < cfg->world_size; i++) {
        if (r.by_rank[i] < 0) continue;
        if (rc == 0)
            send_reply(r.by_rank[i], REPLY_OK, payload, len);
        else
            send_reply(r.by_rank[i], REPLY_ERROR, err->msg, strlen(err->msg));
        close(r.by_rank[i]);
    }
    for (int i = 0; i < r.npend; i++) {
        if (rc) send_reply(r.pend[i].fd, REPLY_ERROR, err->msg, strlen(err->msg));
        close(r.pend[i].fd);
    }
    free(r.by_rank);
    if (cfg->listen_fd < 0) close(lfd);
    return rc;
}

// ---------------------------------------------------------------- the other ranks

// One attempt on every address of host; *why gets the reason of a failure.
static int connect_once(const RendezvousConfig *cfg, int64_t deadline, int *fd_out, char *why,
                        size_t cap) {
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    int gai = getaddrinfo(cfg->master_addr, port, &hints, &res);
    if (gai) {
        snprintf(why, cap, "%s", gai_strerror(gai));
        return -1;
    }
    int rc = -1;
    for (struct addrinfo *ai = res; ai && rc; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        int64_t try_deadline = clock_mono_ms() + CONNECT_TRY_MS;
        int e = 0;
        socklen_t el = sizeof e;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) && errno != EINPROGRESS)
            e = errno;
        else if (wait_fd(fd, POLLOUT, try_deadline < deadline ? try_deadline : deadline) <= 0)
            e = ETIMEDOUT;
        else
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        if (e) {
            snprintf(why, cap, "%s", strerror(e));
            close(fd);
            continue;
        }
        *fd_out = fd;
        rc = 0;
    }
    freeaddrinfo(res);
    return rc;
}

// Connects to rank 0, retrying while nobody listens yet (rank 0 may start later).
static int connect_root(const RendezvousConfig *cfg, int64_t deadline, int *fd, Err *err) {
    char why[256] = "timed out";
    for (;;) {
        if (connect_once(cfg, deadline, fd, why, sizeof why) == 0) return 0;
        if (stopped(cfg, err)) return -1;
        int left = ms_left(deadline);
        if (left == 0)
            return err_set(err, "rendezvous: no connection to MASTER_ADDR %s:%d after %g s (%s)",
                           cfg->master_addr, cfg->port, secs(cfg->timeout_ms), why);
        struct timespec pause = {0, (long)(left < RETRY_MS ? left : RETRY_MS) * 1000000L};
        nanosleep(&pause, NULL);
    }
}

static int io_error(const RendezvousConfig *cfg, IoStatus st, const char *what, Err *err) {
    if (st == IO_TIMEOUT)
        return err_set(err, "rendezvous: rank 0 at %s:%d did not %s within %g s", cfg->master_addr,
                       cfg->port, what, secs(cfg->timeout_ms));
    if (st == IO_CLOSED)
        return err_set(err,
                       "rendezvous: rank 0 at %s:%d closed the connection before it would %s "
                       "(did rank 0 die, or is something else on that port?)",
                       cfg->master_addr, cfg->port, what);
    return err_set(err, "rendezvous: talking to rank 0 at %s:%d: %s", cfg->master_addr, cfg->port,
                   strerror(errno));
}

static int read_reply(const RendezvousConfig *cfg, int fd, int64_t deadline, uint8_t *payload,
                      size_t len, Err *err) {
    uint8_t head[4 * REPLY_WORDS];
    IoStatus st = recv_all(fd, head, sizeof head, deadline);
    if (st != IO_OK) return io_error(cfg, st, "answer", err);
    uint32_t w[REPLY_WORDS];
    get_words(head, w, REPLY_WORDS);
    if (w[0] != RDZV_MAGIC || w[1] > REPLY_ERROR)
        return err_set(err, "rendezvous: %s:%d is not an astrai rank 0 (unexpected answer)",
                       cfg->master_addr, cfg->port);
    if (w[1] == REPLY_ERROR) {
        char msg[ERR_MSG_MAX] = "";
        size_t n = w[2] < sizeof msg - 1 ? w[2] : sizeof msg - 1;
        recv_all(fd, msg, n, deadline);
        return err_set(err, "%s", msg);
    }
    if (w[2] != len)
        return err_set(err, "rendezvous: rank 0 sent a %u-byte payload, expected %zu", w[2], len);
    st = recv_all(fd, payload, len, deadline);
    return st == IO_OK ? 0 : io_error(cfg, st, "send the payload", err);
}

static int run_peer(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Err *err) {
    int64_t deadline = clock_mono_ms() + cfg->timeout_ms;
    int fd = -1;
    if (connect_root(cfg, deadline, &fd, err)) return -1;
    uint8_t hello[4 * HELLO_WORDS];
    uint32_t w[HELLO_WORDS] = {RDZV_MAGIC, RDZV_VERSION, (uint32_t)cfg->rank,
                               (uint32_t)cfg->world_size, (uint32_t)len};
    put_words(hello, w, HELLO_WORDS);
    IoStatus st = send_all(fd, hello, sizeof hello, deadline);
    int rc = st == IO_OK ? read_reply(cfg, fd, deadline + REPLY_SLACK_MS, payload, len, err)
                         : io_error(cfg, st, "listen", err);
    close(fd);
    return rc;
}

int rendezvous_run(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Err *err) {
    if (cfg->world_size <= 1) return 0;
    if (len > UINT32_MAX) return err_set(err, "rendezvous: payload of %zu bytes is too large", len);
    return cfg->rank == 0 ? run_root(cfg, payload, len, err) : run_peer(cfg, payload, len, err);
}
