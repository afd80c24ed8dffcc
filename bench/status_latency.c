// status_latency: the round-trip latency of astraid's `status` method, measured by C clients
// (bench/bench_daemon.py drives it; a Python client's own overhead would hide sub-millisecond
// differences).
//
//   bench_status_latency SOCKET JOB CLIENTS REQUESTS_PER_CLIENT [INTERVAL_MS]
//
// Each client is a thread with its own connection. Without INTERVAL_MS (or 0) it sends
// `status` back to back (the next request when the reply's newline arrives): that measures
// throughput, and with many clients the latency is mostly queueing (p50 ~ clients /
// throughput). With INTERVAL_MS each client sends one request every INTERVAL_MS, the clients
// spread evenly over the interval (users running `astraictl status`/`watch`, not in step):
// that measures the latency a user sees. Prints one JSON object: clients, requests,
// interval_ms, p50_ms, p99_ms, max_ms, req_per_s. Exit 1 if a connection fails or a reply
// is an error.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    const char *socket_path;
    long job;
    int requests;
    double interval, offset; // seconds between requests (0: back to back), first one's delay
    double *lat;             // (requests,) seconds
    int failed;
} Client;

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_until(double t) {
    double left = t - mono_s();
    if (left <= 0) return;
    struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
    nanosleep(&ts, NULL);
}

static int connect_unix(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

// Reads one reply line into buf (its start kept, NUL-terminated; the rest of a long line
// dropped): 0, or -1. Reads as much as has arrived at once: a byte per read() would cost
// the client more than astraid takes to answer. One request is in flight at a time, so
// nothing follows the newline.
static int read_line(int fd, char *buf, size_t cap) {
    size_t n = 0;
    char chunk[4096];
    for (;;) {
        ssize_t r = read(fd, chunk, sizeof chunk);
        if (r <= 0) return -1;
        size_t take = n + (size_t)r < cap ? (size_t)r : cap - 1 - n;
        memcpy(buf + n, chunk, take);
        n += take;
        if (memchr(chunk, '\n', (size_t)r)) break;
    }
    buf[n] = 0;
    return 0;
}

static void *client_main(void *arg) {
    Client *c = arg;
    int fd = connect_unix(c->socket_path);
    if (fd < 0) {
        c->failed = 1;
        return NULL;
    }
    char req[256], reply[512];
    int len = snprintf(
        req, sizeof req,
        "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"status\",\"params\":{\"job\":%ld}}\n", c->job);
    double next = mono_s() + c->offset;
    for (int i = 0; i < c->requests && !c->failed; i++) {
        if (c->interval > 0) { // on its schedule; a late reply does not shift the next slots
            sleep_until(next);
            next += c->interval;
        }
        double t0 = mono_s();
        if (write(fd, req, (size_t)len) != len || read_line(fd, reply, sizeof reply) ||
            !strstr(reply, "\"result\""))
            c->failed = 1;
        c->lat[i] = mono_s() - t0;
    }
    close(fd);
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: %s SOCKET JOB CLIENTS REQUESTS_PER_CLIENT [INTERVAL_MS]\n",
                argv[0]);
        return 2;
    }
    int clients = atoi(argv[3]), per = atoi(argv[4]);
    double interval = argc == 6 ? atof(argv[5]) * 1e-3 : 0;
    if (clients < 1 || per < 1 || interval < 0) return 2;
    Client *cs = calloc((size_t)clients, sizeof *cs);
    pthread_t *th = calloc((size_t)clients, sizeof *th);
    double *all = calloc((size_t)clients * per, sizeof *all);
    if (!cs || !th || !all) return 1;
    double t0 = mono_s();
    for (int i = 0; i < clients; i++) {
        cs[i] = (Client){.socket_path = argv[1],
                         .job = atol(argv[2]),
                         .requests = per,
                         .interval = interval,
                         .offset = interval * i / clients,
                         .lat = all + (size_t)i * per};
        pthread_create(&th[i], NULL, client_main, &cs[i]);
    }
    int failed = 0;
    for (int i = 0; i < clients; i++) {
        pthread_join(th[i], NULL);
        failed |= cs[i].failed;
    }
    double wall = mono_s() - t0;
    size_t n = (size_t)clients * per;
    qsort(all, n, sizeof *all, cmp_double);
    printf("{\"clients\": %d, \"requests\": %zu, \"interval_ms\": %g, \"p50_ms\": %.4f, "
           "\"p99_ms\": %.4f, \"max_ms\": %.4f, \"req_per_s\": %.1f, \"failed\": %s}\n",
           clients, n, interval * 1e3, all[n / 2] * 1e3,
           all[(size_t)(0.99 * (double)(n - 1))] * 1e3, all[n - 1] * 1e3, (double)n / wall,
           failed ? "true" : "false");
    free(cs), free(th), free(all);
    return failed;
}
