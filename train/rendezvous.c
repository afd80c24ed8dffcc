// rendezvous.c: rank 0 gathers a hello from every rank over TCP, checks them, answers each
// with the payload and the layout or with the error that stopped the meeting, and keeps the
// connections for the all-gathers that follow.
//
// Wire format, all words big-endian uint32:
//   challenge (rank 0 → a new connection): magic, version, then 16 random bytes (the nonce)
//   hello (rank r → rank 0): magic, version, rank, world_size, payload length, identity length,
//                            the 16 bytes of the challenge, then the identity
//                            (rendezvous_host_identity)
//   reply (rank 0 → rank r): magic, status (0 ok, 1 error), n, then n bytes: the payload and
//                            the layout (hosts H, host of each rank, then per host its name's
//                            length and the name), or the error message
//   all-gather (rank r → rank 0): magic, GATHER_BLOB, n, then n bytes;
//              (rank 0 → rank r): a reply whose n bytes are world sizes, then the blobs
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
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define RDZV_MAGIC 0x4153525au // "ASRZ"
#define RDZV_VERSION 2u
#define NONCE_BYTES 16
#define CHALLENGE_BYTES (8 + NONCE_BYTES)
#define HELLO_WORDS 6
#define HELLO_HEAD (4 * HELLO_WORDS + NONCE_BYTES)
#define IDENTITY_MAX 320 // host name (64) + boot id (36) + a device number, with room
#define HOST_NAME_CAP 65
#define REPLY_WORDS 3
#define GATHER_BLOB 7u
#define GATHER_MAX ((size_t)64 << 20) // one rank's blob of an all-gather
#define RETRY_MS 100
#define CONNECT_TRY_MS 1000 // one connect attempt (an unroutable address never answers)
#define REPLY_SLACK_MS 2000 // peers wait longer than rank 0 so they hear its verdict
#define REPLY_SEND_MS 2000  // rank 0's time to hand one rank its reply
#define MAX_PENDING 64      // connections accepted but not yet identified
#define MAX_MISSING_LISTED 16

enum { REPLY_OK = 0, REPLY_ERROR = 1 };
typedef enum { IO_OK, IO_TIMEOUT, IO_CLOSED, IO_ERROR } IoStatus;

struct Rendezvous {
    int rank, world, timeout_ms;
    int *fd;      // rank 0: (world) the connection of each rank (fd[0] = -1); else fd[0]: rank 0's
    int *host_of; // (world) host index of each rank
    char (*host)[HOST_NAME_CAP]; // (n_hosts) names
    int n_hosts;
    char local_addr[INET6_ADDRSTRLEN];
    char master[300]; // "addr:port" of rank 0, for messages
};

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

// ---------------------------------------------------------------- identity and layout

void rendezvous_host_identity(char *out, size_t cap) {
    char host[HOST_NAME_CAP] = "", boot[64] = "";
    if (gethostname(host, sizeof host - 1)) host[0] = 0;
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = 0;
        fclose(f);
        boot[strcspn(boot, "\n")] = 0;
    }
    // Network namespaces share a boot id; what decides whether shm reaches is /dev/shm itself.
    struct stat st;
    unsigned long long shm = stat("/dev/shm", &st) == 0 ? (unsigned long long)st.st_dev : 0;
    snprintf(out, cap, "%s %s %llx", host, boot, shm);
}

// The host name part of an identity.
static void identity_name(const char *id, char *out) {
    size_t n = strcspn(id, " ");
    n = n < HOST_NAME_CAP - 1 ? n : HOST_NAME_CAP - 1;
    memcpy(out, id, n);
    out[n] = 0;
    if (!out[0]) snprintf(out, HOST_NAME_CAP, "?");
}

static Rendezvous *rendezvous_new(const RendezvousConfig *cfg) {
    Rendezvous *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->rank = cfg->rank;
    r->world = cfg->world_size;
    r->timeout_ms = cfg->timeout_ms;
    snprintf(r->master, sizeof r->master, "%s:%d", cfg->master_addr ? cfg->master_addr : "?",
             cfg->port);
    r->fd = malloc(sizeof(int) * (size_t)r->world);
    r->host_of = calloc((size_t)r->world, sizeof(int));
    if (!r->fd || !r->host_of) {
        free(r->fd);
        free(r->host_of);
        free(r);
        return NULL;
    }
    for (int i = 0; i < r->world; i++)
        r->fd[i] = -1;
    return r;
}

void rendezvous_close(Rendezvous *r) {
    if (!r) return;
    for (int i = 0; i < r->world; i++)
        if (r->fd[i] >= 0) close(r->fd[i]);
    free(r->fd);
    free(r->host_of);
    free(r->host);
    free(r);
}

int rendezvous_hosts(const Rendezvous *r) {
    return r->n_hosts;
}

int rendezvous_host_of(const Rendezvous *r, int rank) {
    return r->host_of[rank];
}

const char *rendezvous_host_name(const Rendezvous *r, int host) {
    return r->host[host];
}

const char *rendezvous_local_addr(const Rendezvous *r) {
    return r->local_addr;
}

// The layout from every rank's identity (ids: world strings): hosts in order of their lowest rank.
static int layout_from_ids(Rendezvous *r, char (*ids)[IDENTITY_MAX], Err *err) {
    r->host = calloc((size_t)r->world, sizeof *r->host);
    if (!r->host) return err_resource(err, "rendezvous: out of memory for %d hosts", r->world);
    int *first = malloc(sizeof(int) * (size_t)r->world); // lowest rank of each host
    if (!first) return err_resource(err, "rendezvous: out of memory for %d hosts", r->world);
    r->n_hosts = 0;
    for (int i = 0; i < r->world; i++) {
        int h = 0;
        while (h < r->n_hosts && strcmp(ids[first[h]], ids[i]))
            h++;
        if (h == r->n_hosts) {
            first[h] = i;
            identity_name(ids[i], r->host[h]);
            r->n_hosts++;
        }
        r->host_of[i] = h;
    }
    free(first);
    return 0;
}

// "rank R (HOST)" for messages.
static void rank_label(const Rendezvous *r, int rank, char *out, size_t cap) {
    if (r->host && r->n_hosts > 0)
        snprintf(out, cap, "rank %d (%s)", rank, r->host[r->host_of[rank]]);
    else
        snprintf(out, cap, "rank %d", rank);
}

static void local_name(int fd, char *out, size_t cap) {
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    out[0] = 0;
    if (getsockname(fd, (struct sockaddr *)&sa, &sl)) return;
    if (sa.ss_family == AF_INET) {
        inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, out, (socklen_t)cap);
    } else if (sa.ss_family == AF_INET6) {
        struct in6_addr *a = &((struct sockaddr_in6 *)&sa)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a))
            inet_ntop(AF_INET, &a->s6_addr[12], out, (socklen_t)cap);
        else
            inet_ntop(AF_INET6, a, out, (socklen_t)cap);
    }
}

// The layout as rank 0 sends it: H, host of each rank, then each host's name (length, bytes).
static uint8_t *layout_encode(const Rendezvous *r, size_t *n) {
    size_t bytes = 4 * (1 + (size_t)r->world);
    for (int h = 0; h < r->n_hosts; h++)
        bytes += 4 + strlen(r->host[h]);
    uint8_t *out = malloc(bytes), *p = out;
    if (!out) return NULL;
    uint32_t w = (uint32_t)r->n_hosts;
    put_words(p, &w, 1), p += 4;
    for (int i = 0; i < r->world; i++, p += 4) {
        w = (uint32_t)r->host_of[i];
        put_words(p, &w, 1);
    }
    for (int h = 0; h < r->n_hosts; h++) {
        w = (uint32_t)strlen(r->host[h]);
        put_words(p, &w, 1), p += 4;
        memcpy(p, r->host[h], w), p += w;
    }
    *n = bytes;
    return out;
}

static int layout_decode(Rendezvous *r, const uint8_t *p, size_t n, Err *err) {
    const uint8_t *end = p + n;
    uint32_t hosts;
    if (n < 4 * (1 + (size_t)r->world)) goto bad;
    get_words(p, &hosts, 1), p += 4;
    if (hosts < 1 || hosts > (uint32_t)r->world) goto bad;
    r->n_hosts = (int)hosts;
    r->host = calloc(hosts, sizeof *r->host);
    if (!r->host) return err_resource(err, "rendezvous: out of memory for %u hosts", hosts);
    for (int i = 0; i < r->world; i++, p += 4) {
        uint32_t h;
        get_words(p, &h, 1);
        if (h >= hosts) goto bad;
        r->host_of[i] = (int)h;
    }
    for (uint32_t h = 0; h < hosts; h++) {
        uint32_t len;
        if (end - p < 4) goto bad;
        get_words(p, &len, 1), p += 4;
        if (len >= HOST_NAME_CAP || (size_t)(end - p) < len) goto bad;
        memcpy(r->host[h], p, len), p += len;
    }
    return 0;
bad:
    return err_set(err, "rendezvous: rank 0 at %s sent a malformed layout", r->master);
}

// ---------------------------------------------------------------- rank 0

typedef struct {
    int fd;
    size_t got;
    uint8_t nonce[NONCE_BYTES];
    uint8_t hello[HELLO_HEAD + IDENTITY_MAX];
} Pending;

typedef struct {
    const RendezvousConfig *cfg;
    Rendezvous *rv;
    size_t len;
    char (*ids)[IDENTITY_MAX]; // (world) each arrived rank's identity
    int arrived;               // rank 0 included
    Pending pend[MAX_PENDING];
    int npend;
} Root;

static void send_reply(int fd, uint32_t status, const void *body, size_t n, const void *body2,
                       size_t n2) {
    uint8_t head[4 * REPLY_WORDS];
    uint32_t w[REPLY_WORDS] = {RDZV_MAGIC, status, (uint32_t)(n + n2)};
    put_words(head, w, REPLY_WORDS);
    int64_t deadline = clock_mono_ms() + REPLY_SEND_MS;
    // A rank that is gone needs no answer: its send error is not ours.
    if (send_all(fd, head, sizeof head, deadline) == IO_OK &&
        send_all(fd, body, n, deadline) == IO_OK && n2)
        send_all(fd, body2, n2, deadline);
}

static void send_error(int fd, const char *msg) {
    send_reply(fd, REPLY_ERROR, msg, strlen(msg), NULL, 0);
}

static int missing_error(const Root *r, Err *err) {
    char list[256] = "", nodes[160] = "";
    size_t used = 0, nused = 0;
    int listed = 0, last_node = -1, node_size = r->cfg->node_size;
    for (int i = 1; i < r->cfg->world_size && listed < MAX_MISSING_LISTED; i++) {
        if (r->rv->fd[i] >= 0) continue;
        used += (size_t)snprintf(list + used, sizeof list - used, "%s%d", listed ? ", " : "", i);
        listed++;
        if (node_size > 0 && i / node_size != last_node && nused < sizeof nodes - 16) {
            nused += (size_t)snprintf(nodes + nused, sizeof nodes - nused, "%s%d",
                                      last_node < 0 ? "" : ", ", i / node_size);
            last_node = i / node_size;
        }
    }
    int missing = r->cfg->world_size - r->arrived;
    return err_set(err,
                   "rendezvous: only %d of %d ranks arrived within %g s (missing: rank %s%s%s%s%s)",
                   r->arrived, r->cfg->world_size, secs(r->cfg->timeout_ms), list,
                   missing > listed ? ", ..." : "", nodes[0] ? "; node rank " : "", nodes,
                   nodes[0] ? " never arrived" : "");
}

// A connection that is not a rank of this job: logged and closed, the meeting goes on. `told`:
// it spoke our protocol, so it hears why.
static void refuse(int fd, const char *from, int told, const char *why) {
    fprintf(stderr, "astrai-train: rendezvous: refused a connection from %s: %s\n", from, why);
    if (told) send_error(fd, why);
    close(fd);
}

// Checks one rank's hello (its nonce already checked). 1: refused (the meeting goes on), 0: the
// connection is that rank's, -1: the meeting fails with err.
static int identify(Root *r, int fd, const uint8_t *hello, const char *from, Err *err) {
    uint32_t w[HELLO_WORDS];
    get_words(hello, w, HELLO_WORDS);
    uint32_t rank = w[2], world = w[3], len = w[4], id_len = w[5];
    char why[ERR_MSG_MAX];
    if (world != (uint32_t)r->cfg->world_size)
        return err_set(err,
                       "rendezvous: rank %u (%s) says WORLD_SIZE=%u but rank 0 has WORLD_SIZE=%d",
                       rank, from, world, r->cfg->world_size);
    if (rank >= world)
        return err_set(err, "rendezvous: %s says RANK=%u, not below WORLD_SIZE=%u", from, rank,
                       world);
    if (rank == 0 || r->rv->fd[rank] >= 0) {
        char owner[INET6_ADDRSTRLEN + 16] = "rank 0 itself";
        if (rank) peer_name(r->rv->fd[rank], owner, sizeof owner);
        snprintf(why, sizeof why,
                 "rendezvous: rank %u is already taken (by %s; RANK must differ on every process)",
                 rank, owner);
        refuse(fd, from, 1, why);
        return 1;
    }
    if (len != r->len)
        return err_set(err,
                       "rendezvous: rank %u (%s) expects a %u-byte payload but rank 0 sends "
                       "%zu bytes (different builds, or NCCL on only some ranks?)",
                       rank, from, len, r->len);
    memcpy(r->ids[rank], hello + HELLO_HEAD, id_len);
    r->ids[rank][id_len] = 0;
    r->rv->fd[rank] = fd;
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
        Pending *p = &r->pend[r->npend];
        uint8_t challenge[CHALLENGE_BYTES];
        uint32_t w[2] = {RDZV_MAGIC, RDZV_VERSION};
        put_words(challenge, w, 2);
        // A flood of strangers must not push out ranks still to come; a fresh socket's buffer
        // always takes the few bytes of the challenge.
        if (r->npend == MAX_PENDING || getrandom(p->nonce, NONCE_BYTES, 0) != NONCE_BYTES) {
            close(fd);
            continue;
        }
        memcpy(challenge + 8, p->nonce, NONCE_BYTES);
        if (send(fd, challenge, sizeof challenge, MSG_NOSIGNAL | MSG_DONTWAIT) !=
            (ssize_t)sizeof challenge) {
            close(fd);
            continue;
        }
        p->fd = fd;
        p->got = 0;
        r->npend++;
    }
}

// The bytes a hello needs in all, once its head is in (0 while it is not).
static size_t hello_size(const Pending *p) {
    if (p->got < HELLO_HEAD) return 0;
    uint32_t id_len;
    get_words(p->hello + 4 * 5, &id_len, 1);
    return HELLO_HEAD + (id_len < IDENTITY_MAX ? id_len : IDENTITY_MAX);
}

// What is wrong with a complete hello's framing, or NULL: not ours, or not an answer to this
// connection's challenge.
static const char *bad_hello(const Pending *p) {
    uint32_t w[HELLO_WORDS];
    get_words(p->hello, w, HELLO_WORDS);
    if (w[0] != RDZV_MAGIC) return "not an astrai rank (wrong magic)";
    if (w[1] != RDZV_VERSION) return "a different rendezvous protocol version";
    if (w[5] >= IDENTITY_MAX) return "an oversized host identity";
    if (memcmp(p->hello + 4 * HELLO_WORDS, p->nonce, NONCE_BYTES))
        return "its hello does not answer this connection's challenge (replayed or forged)";
    return NULL;
}

// Reads what arrived on pending connection i; a complete hello is checked.
static int read_pending(Root *r, int i, Err *err) {
    Pending *p = &r->pend[i];
    size_t want = p->got < HELLO_HEAD ? HELLO_HEAD : hello_size(p);
    ssize_t n = recv(p->fd, p->hello + p->got, want - p->got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    char from[INET6_ADDRSTRLEN + 16];
    peer_name(p->fd, from, sizeof from);
    if (n <= 0) { // gone before it said who it is
        if (p->got)
            refuse(p->fd, from, 0, "closed before its hello was complete");
        else
            close(p->fd);
        drop_pending(r, i);
        return 0;
    }
    p->got += (size_t)n;
    uint32_t magic;
    get_words(p->hello, &magic, 1);
    if (p->got >= 4 && magic != RDZV_MAGIC) { // a port scanner, a stray client, garbage
        refuse(p->fd, from, 0, "not an astrai rank (wrong magic)");
        drop_pending(r, i);
        return 0;
    }
    if (p->got < HELLO_HEAD || p->got < hello_size(p)) return 0;
    Pending done = *p;
    drop_pending(r, i);
    const char *why = bad_hello(&done);
    if (why) {
        refuse(done.fd, from, 0, why);
        return 0;
    }
    int rc = identify(r, done.fd, done.hello, from, err);
    if (rc < 0) {
        send_error(done.fd, err->msg);
        close(done.fd);
    }
    return rc < 0 ? -1 : 0;
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

// Rank 0's own address as the others see it: that of a connection from another host if any.
static void root_local_addr(Rendezvous *rv) {
    for (int i = 1; i < rv->world; i++)
        if (rv->host_of[i] != rv->host_of[0] || !rv->local_addr[0])
            local_name(rv->fd[i], rv->local_addr, sizeof rv->local_addr);
}

// Every rank that came hears the outcome: the payload and the layout, or why there is none.
static int answer_all(Root *r, const uint8_t *payload, int rc, Err *err) {
    Rendezvous *rv = r->rv;
    size_t n_layout = 0;
    uint8_t *layout = NULL;
    if (!rc) rc = layout_from_ids(rv, r->ids, err);
    if (!rc && !(layout = layout_encode(rv, &n_layout)))
        rc = err_resource(err, "rendezvous: out of memory for the layout");
    for (int i = 1; i < rv->world; i++) {
        if (rv->fd[i] < 0) continue;
        if (rc == 0)
            send_reply(rv->fd[i], REPLY_OK, payload, r->len, layout, n_layout);
        else
            send_error(rv->fd[i], err->msg);
    }
    for (int i = 0; i < r->npend; i++) {
        if (rc) send_error(r->pend[i].fd, err->msg);
        close(r->pend[i].fd);
    }
    free(layout);
    if (!rc) root_local_addr(rv);
    return rc;
}

static int run_root(const RendezvousConfig *cfg, const uint8_t *payload, size_t len, Rendezvous *rv,
                    Err *err) {
    int64_t deadline = clock_mono_ms() + cfg->timeout_ms;
    int lfd = cfg->listen_fd;
    if (lfd < 0 && ranks_listen(NULL, cfg->port, &lfd, NULL, err)) return -1;
    fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK);
    Root r = {.cfg = cfg, .rv = rv, .len = len, .arrived = 1};
    r.ids = calloc((size_t)cfg->world_size, sizeof *r.ids);
    int rc =
        r.ids ? 0 : err_resource(err, "rendezvous: out of memory for %d ranks", cfg->world_size);
    if (!rc) {
        rendezvous_host_identity(r.ids[0], IDENTITY_MAX);
        rc = gather(&r, lfd, deadline, err);
    }
    rc = answer_all(&r, payload, rc, err);
    free(r.ids);
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

static int io_error(const Rendezvous *rv, IoStatus st, const char *what, Err *err) {
    if (st == IO_TIMEOUT)
        return err_set(err, "rendezvous: rank 0 at %s did not %s within %g s", rv->master, what,
                       secs(rv->timeout_ms));
    if (st == IO_CLOSED)
        return err_set(err,
                       "rendezvous: rank 0 at %s closed the connection before it would %s "
                       "(did rank 0 die, or is something else on that port?)",
                       rv->master, what);
    return err_set(err, "rendezvous: talking to rank 0 at %s: %s", rv->master, strerror(errno));
}

// Reads a reply's head and, for an error, its message (returned in err). *n: the body's size.
static int read_reply_head(const Rendezvous *rv, int fd, int64_t deadline, const char *what,
                           uint32_t *n, Err *err) {
    uint8_t head[4 * REPLY_WORDS];
    IoStatus st = recv_all(fd, head, sizeof head, deadline);
    if (st != IO_OK) return io_error(rv, st, what, err);
    uint32_t w[REPLY_WORDS];
    get_words(head, w, REPLY_WORDS);
    if (w[0] != RDZV_MAGIC || w[1] > REPLY_ERROR)
        return err_set(err, "rendezvous: %s is not an astrai rank 0 (unexpected answer)",
                       rv->master);
    if (w[1] == REPLY_ERROR) {
        char msg[ERR_MSG_MAX] = "";
        size_t m = w[2] < sizeof msg - 1 ? w[2] : sizeof msg - 1;
        recv_all(fd, msg, m, deadline);
        return err_set(err, "%s", msg);
    }
    *n = w[2];
    return 0;
}

static int read_reply(Rendezvous *rv, int fd, int64_t deadline, uint8_t *payload, size_t len,
                      Err *err) {
    uint32_t n;
    if (read_reply_head(rv, fd, deadline, "answer", &n, err)) return -1;
    if (n < len || n - len > 4 * (1 + (size_t)rv->world) + (size_t)rv->world * (4 + HOST_NAME_CAP))
        return err_set(err, "rendezvous: rank 0 sent a %u-byte answer for a %zu-byte payload", n,
                       len);
    uint8_t *body = malloc(n ? n : 1);
    if (!body) return err_resource(err, "rendezvous: out of memory for a %u-byte answer", n);
    IoStatus st = recv_all(fd, body, n, deadline);
    int rc = st != IO_OK ? io_error(rv, st, "send the payload", err)
                         : layout_decode(rv, body + len, n - len, err);
    if (!rc) memcpy(payload, body, len);
    free(body);
    return rc;
}

static int read_challenge(Rendezvous *rv, int fd, int64_t deadline, uint8_t *nonce, Err *err) {
    uint8_t c[CHALLENGE_BYTES];
    IoStatus st = recv_all(fd, c, sizeof c, deadline);
    if (st != IO_OK) return io_error(rv, st, "greet", err);
    uint32_t w[2];
    get_words(c, w, 2);
    if (w[0] != RDZV_MAGIC)
        return err_set(err, "rendezvous: %s is not an astrai rank 0 (unexpected greeting)",
                       rv->master);
    if (w[1] != RDZV_VERSION)
        return err_set(err,
                       "rendezvous: rank 0 at %s speaks protocol version %u but this rank speaks "
                       "%u (different astrai builds?)",
                       rv->master, w[1], RDZV_VERSION);
    memcpy(nonce, c + 8, NONCE_BYTES);
    return 0;
}

static int send_hello(const RendezvousConfig *cfg, Rendezvous *rv, int fd, int64_t deadline,
                      size_t len, Err *err) {
    uint8_t hello[HELLO_HEAD + IDENTITY_MAX];
    char id[IDENTITY_MAX];
    rendezvous_host_identity(id, sizeof id);
    size_t id_len = strlen(id);
    uint32_t w[HELLO_WORDS] = {RDZV_MAGIC,          RDZV_VERSION,
                               (uint32_t)cfg->rank, (uint32_t)cfg->world_size,
                               (uint32_t)len,       (uint32_t)id_len};
    put_words(hello, w, HELLO_WORDS);
    if (read_challenge(rv, fd, deadline, hello + 4 * HELLO_WORDS, err)) return -1;
    memcpy(hello + HELLO_HEAD, id, id_len);
    IoStatus st = send_all(fd, hello, HELLO_HEAD + id_len, deadline);
    return st == IO_OK ? 0 : io_error(rv, st, "listen", err);
}

static int run_peer(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Rendezvous *rv,
                    Err *err) {
    int64_t deadline = clock_mono_ms() + cfg->timeout_ms;
    int fd = -1;
    if (connect_root(cfg, deadline, &fd, err)) return -1;
    rv->fd[0] = fd;
    local_name(fd, rv->local_addr, sizeof rv->local_addr);
    return send_hello(cfg, rv, fd, deadline, len, err) ||
           read_reply(rv, fd, deadline + REPLY_SLACK_MS, payload, len, err);
}

// ---------------------------------------------------------------- all-gather

// Rank 0: every other rank's blob, in rank order; blob[r] malloc'ed.
static int gather_blobs(Rendezvous *rv, int64_t deadline, uint8_t **blob, size_t *lens, Err *err) {
    for (int i = 1; i < rv->world; i++) {
        char who[HOST_NAME_CAP + 32];
        rank_label(rv, i, who, sizeof who);
        uint8_t head[4 * REPLY_WORDS];
        uint32_t w[REPLY_WORDS];
        IoStatus st = recv_all(rv->fd[i], head, sizeof head, deadline);
        if (st != IO_OK)
            return err_set(err, "rendezvous all-gather: %s %s", who,
                           st == IO_TIMEOUT ? "sent nothing within the timeout"
                                            : "closed its connection (did it die?)");
        get_words(head, w, REPLY_WORDS);
        if (w[0] != RDZV_MAGIC || w[1] != GATHER_BLOB || w[2] > GATHER_MAX)
            return err_set(err, "rendezvous all-gather: %s sent garbage", who);
        lens[i] = w[2];
        if (!(blob[i] = malloc(lens[i] ? lens[i] : 1)))
            return err_resource(err, "rendezvous all-gather: out of memory");
        if (recv_all(rv->fd[i], blob[i], lens[i], deadline) != IO_OK)
            return err_set(err, "rendezvous all-gather: %s stopped sending mid-blob", who);
    }
    return 0;
}

static int root_all_gather(Rendezvous *rv, const void *mine, size_t len, uint8_t **all,
                           size_t *lens, Err *err) {
    int64_t deadline = clock_mono_ms() + rv->timeout_ms;
    uint8_t **blob = calloc((size_t)rv->world, sizeof *blob);
    if (!blob) return err_resource(err, "rendezvous all-gather: out of memory");
    lens[0] = len;
    int rc = gather_blobs(rv, deadline, blob, lens, err);
    size_t total = 0;
    for (int i = 0; !rc && i < rv->world; i++)
        total += lens[i];
    size_t head = 4 * (size_t)rv->world;
    uint8_t *out = rc ? NULL : malloc(head + total + 1);
    if (!rc && !out) rc = err_resource(err, "rendezvous all-gather: out of memory");
    for (int i = 0, off = 0; !rc && i < rv->world; off += (int)lens[i], i++) {
        uint32_t w = (uint32_t)lens[i];
        put_words(out + 4 * i, &w, 1);
        memcpy(out + head + off, i ? blob[i] : mine, lens[i]);
    }
    for (int i = 1; i < rv->world; i++) {
        if (rc)
            send_error(rv->fd[i], err->msg);
        else
            send_reply(rv->fd[i], REPLY_OK, out, head + total, NULL, 0);
        free(blob[i]);
    }
    free(blob);
    if (!rc) {
        memmove(out, out + head, total);
        *all = out;
    } else {
        free(out);
    }
    return rc;
}

static int peer_all_gather(Rendezvous *rv, const void *mine, size_t len, uint8_t **all,
                           size_t *lens, Err *err) {
    int64_t deadline = clock_mono_ms() + rv->timeout_ms;
    uint8_t head[4 * REPLY_WORDS];
    uint32_t w[REPLY_WORDS] = {RDZV_MAGIC, GATHER_BLOB, (uint32_t)len}, n;
    put_words(head, w, REPLY_WORDS);
    IoStatus st = send_all(rv->fd[0], head, sizeof head, deadline);
    if (st == IO_OK) st = send_all(rv->fd[0], mine, len, deadline);
    if (st != IO_OK) return io_error(rv, st, "take this rank's part of an all-gather", err);
    if (read_reply_head(rv, rv->fd[0], deadline + REPLY_SLACK_MS, "answer an all-gather", &n, err))
        return -1;
    size_t head_n = 4 * (size_t)rv->world;
    uint8_t *body = n >= head_n ? malloc(n + 1) : NULL;
    if (!body) return err_set(err, "rendezvous all-gather: a %u-byte answer from rank 0", n);
    st = recv_all(rv->fd[0], body, n, deadline + REPLY_SLACK_MS);
    if (st != IO_OK) {
        free(body);
        return io_error(rv, st, "finish an all-gather", err);
    }
    size_t total = 0;
    for (int i = 0; i < rv->world; i++) {
        uint32_t l;
        get_words(body + 4 * i, &l, 1);
        lens[i] = l;
        total += l;
    }
    if (total != n - head_n) {
        free(body);
        return err_set(err, "rendezvous all-gather: rank 0's sizes do not add up");
    }
    memmove(body, body + head_n, total);
    *all = body;
    return 0;
}

int rendezvous_all_gather(void *rendezvous, const void *mine, size_t len, uint8_t **all,
                          size_t *lens, Err *err) {
    Rendezvous *rv = rendezvous;
    *all = NULL;
    if (len > GATHER_MAX)
        return err_set(err, "rendezvous all-gather: a %zu-byte blob is over the %zu-byte limit",
                       len, GATHER_MAX);
    if (rv->world == 1) {
        lens[0] = len;
        if (!(*all = malloc(len ? len : 1)))
            return err_resource(err, "rendezvous all-gather: out of memory");
        memcpy(*all, mine, len);
        return 0;
    }
    return rv->rank == 0 ? root_all_gather(rv, mine, len, all, lens, err)
                         : peer_all_gather(rv, mine, len, all, lens, err);
}

// ---------------------------------------------------------------- the meeting

// World 1: this host alone.
static int alone(Rendezvous *rv, Err *err) {
    char id[IDENTITY_MAX];
    rendezvous_host_identity(id, sizeof id);
    return layout_from_ids(rv, &id, err);
}

int rendezvous_open(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Rendezvous **out,
                    Err *err) {
    *out = NULL;
    if (len > UINT32_MAX / 2)
        return err_set(err, "rendezvous: payload of %zu bytes is too large", len);
    Rendezvous *rv = rendezvous_new(cfg);
    if (!rv) return err_resource(err, "rendezvous: out of memory for %d ranks", cfg->world_size);
    int rc = cfg->world_size <= 1 ? alone(rv, err)
             : cfg->rank == 0     ? run_root(cfg, payload, len, rv, err)
                                  : run_peer(cfg, payload, len, rv, err);
    if (rc) {
        rendezvous_close(rv);
        return -1;
    }
    *out = rv;
    return 0;
}

int rendezvous_run(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Err *err) {
    Rendezvous *rv;
    if (rendezvous_open(cfg, payload, len, &rv, err)) return -1;
    rendezvous_close(rv);
    return 0;
}
