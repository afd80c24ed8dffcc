// comm/hier.c: hierarchical CPU collectives for several ranks per host on several hosts
// (comm.h): shared memory within a host, Gloo between hosts, so that each byte crosses the
// network once per host instead of once per rank.
//
// Three sub-Comms, made at comm_create:
//   flat  - gloo over every rank: the store of cross's connect (cfg->exchange is a collective
//           over all ranks, so cross is split from it) and the ops not made hierarchical
//           (broadcast, barrier, all_to_all, p2p, split);
//   cross - gloo among the ranks of one local index, one per host, ranked by host;
//   local - shm among the ranks of this host, ranked by world rank (its rank 0, the host's
//           lowest rank, creates the segment "<shm_name>-h<host>": one per host).
// Hosts are numbered by their lowest rank. Each sub-call has the call timeout of its own. An
// error is the failed sub-Comm's (its label first) behind the hier call that made it:
// "hier rank 0/4: all_reduce: shm /astrai-x-h0 rank 0/2: ...".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_backend.h"

typedef struct {
    Comm *flat, *cross, *local;
    int hosts, per_host; // H, L
    int contiguous;      // rank_of[i] == i: gathers land in rank order as they come
    int *rank_of;        // (H, L): the world rank of local rank l on host h
} Hier;

static Hier *hier_of(Comm *c) {
    return c->state;
}

// ---------------------------------------------------------------- layout

// num[r]: rank r's host, hosts numbered by their lowest rank; returns how many hosts.
static int number_hosts(const int *host_of, int world, int *num) {
    int hosts = 0;
    for (int r = 0; r < world; r++) {
        int q = 0;
        while (q < r && host_of[q] != host_of[r])
            q++;
        num[r] = q < r ? num[q] : hosts++;
    }
    return hosts;
}

// The cross all_reduce carries one slice per host: it needs every host to hold L ranks.
static int check_even(const int *num, int world, int hosts, Err *err) {
    int count[hosts];
    memset(count, 0, sizeof count);
    for (int r = 0; r < world; r++)
        count[num[r]]++;
    for (int h = 1; h < hosts; h++)
        if (count[h] != count[0])
            return err_set(err,
                           "hier: the hosts hold different numbers of ranks (%d on rank 0's "
                           "host, %d on host %d); use gloo",
                           count[0], count[h], h);
    return 0;
}

// Fills h's layout and this rank's (host, local index) from cfg->host_of.
static int make_layout(Hier *h, const CommConfig *cfg, int *host, int *local, Err *err) {
    int W = cfg->world_size;
    int *num = malloc((size_t)W * sizeof *num);
    h->rank_of = malloc((size_t)W * sizeof *h->rank_of);
    if (!num || !h->rank_of) {
        free(num);
        return err_resource(err, "hier: out of memory");
    }
    h->hosts = number_hosts(cfg->host_of, W, num);
    int rc = check_even(num, W, h->hosts, err);
    h->per_host = W / h->hosts;
    int filled[h->hosts];
    memset(filled, 0, sizeof filled);
    h->contiguous = 1;
    for (int r = 0; !rc && r < W; r++) {
        int i = num[r] * h->per_host + filled[num[r]]++;
        h->rank_of[i] = r;
        h->contiguous &= i == r;
        if (r == cfg->rank) *host = num[r], *local = i % h->per_host;
    }
    free(num);
    return rc;
}

// ---------------------------------------------------------------- connect

static int check_hier_config(const CommConfig *cfg, Err *err) {
    if (!cfg->host_of) return err_set(err, "hier: CommConfig.host_of is not set (want the layout)");
    if (!cfg->shm_name) return err_set(err, "hier: CommConfig.shm_name is not set");
    return 0;
}

static int connect_local(Hier *h, const CommConfig *cfg, int host, int local, Err *err) {
    char name[128];
    snprintf(name, sizeof name, "%s-h%d", cfg->shm_name, host);
    CommConfig lc = {.backend = "shm",
                     .rank = local,
                     .world_size = h->per_host,
                     .timeout_ms = cfg->timeout_ms,
                     .shm_name = name,
                     .shm_chunk_bytes = cfg->shm_chunk_bytes};
    return comm_create(&h->local, &lc, err);
}

static int connect_all(Hier *h, const CommConfig *cfg, int host, int local, Err *err) {
    CommConfig fc = *cfg;
    fc.backend = "gloo";
    return comm_create(&h->flat, &fc, err) || comm_split(h->flat, local, host, &h->cross, err) ||
           connect_local(h, cfg, host, local, err);
}

static void hier_free(Hier *h) {
    comm_destroy(h->local);
    comm_destroy(h->cross); // before its parent
    comm_destroy(h->flat);
    free(h->rank_of);
    free(h);
}

static void hier_destroy(Comm *c) {
    hier_free(hier_of(c));
    c->state = NULL;
}

// ---------------------------------------------------------------- collectives

static int fp32_only(DType dt, const char *call, Err *err) {
    if (dt == DT_F32) return 0;
    return err_set(err, "%s: the hier backend reduces fp32 only, not %s", call, dtype_name(dt));
}

static void scale_avg(float *x, size_t n, int world, CommOp op) {
    if (op != COMM_AVG) return;
    const float s = 1.0f / (float)world;
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

// buf: (n,) = (L*k + t,), t < L. Local rank l reduces slice l of k elements and, when t > 0,
// element l of the tail padded to L; its k (+1) sums cross hosts in one gloo call, then every
// rank gathers the slices. Each element is summed on one rank only: bitwise equal everywhere.
static int hier_all_reduce(Comm *c, void *buf, size_t n, DType dt, CommOp op, Err *err) {
    if (fp32_only(dt, "all_reduce", err)) return -1;
    if (!n) return 0;
    Hier *h = hier_of(c);
    size_t L = (size_t)h->per_host, k = n / L, t = n % L, m = k + (t > 0);
    float *x = buf, *s = calloc(m + L, sizeof *s), *tail = s + m; // s: (m,) slice; tail: (L,)
    if (!s) return err_resource(err, "all_reduce: out of memory");
    memcpy(tail, x + L * k, t * sizeof *x);
    int rc = (k && comm_reduce_scatter(h->local, x, s, k, DT_F32, COMM_SUM, err)) ||
             (t && comm_reduce_scatter(h->local, tail, s + k, 1, DT_F32, COMM_SUM, err)) ||
             comm_all_reduce(h->cross, s, m, DT_F32, COMM_SUM, err);
    scale_avg(s, m, c->world, op);
    rc = rc || (k && comm_all_gather(h->local, s, x, k, DT_F32, err)) ||
         (t && comm_all_gather(h->local, s + k, tail, 1, DT_F32, err));
    if (!rc) memcpy(x + L * k, tail, t * sizeof *x);
    free(s);
    return rc ? err_prefix(err, "all_reduce") : 0;
}

// send: (W, n) by world rank, regrouped as (L, H, n): local rank l's share is every host's
// slice of local index l. Local reduce_scatter: (H, n) summed over this host; cross
// reduce_scatter (ranked by host): (n,) summed over the hosts, this rank's slice.
static int hier_reduce_scatter(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                               Err *err) {
    if (fp32_only(dt, "reduce_scatter", err)) return -1;
    if (!n) return 0;
    Hier *h = hier_of(c);
    size_t H = (size_t)h->hosts, L = (size_t)h->per_host;
    float *grouped = malloc((L * H + H) * n * sizeof *grouped), *mid = grouped + L * H * n;
    if (!grouped) return err_resource(err, "reduce_scatter: out of memory");
    for (size_t l = 0; l < L; l++)
        for (size_t g = 0; g < H; g++)
            memcpy(grouped + (l * H + g) * n,
                   (const float *)send + (size_t)h->rank_of[g * L + l] * n, n * sizeof *grouped);
    int rc = comm_reduce_scatter(h->local, grouped, mid, H * n, DT_F32, COMM_SUM, err) ||
             comm_reduce_scatter(h->cross, mid, recv, n, DT_F32, COMM_SUM, err);
    scale_avg(recv, n, c->world, op);
    free(grouped);
    return rc ? err_prefix(err, "reduce_scatter") : 0;
}

// Local all_gather: (L, n) of this host; cross all_gather: (H, L, n), put in world rank order
// (straight into recv when the hosts' ranks are contiguous).
static int hier_all_gather(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err) {
    if (!n) return 0;
    Hier *h = hier_of(c);
    size_t W = (size_t)c->world, L = (size_t)h->per_host, b = n * dtype_size(dt);
    char *tmp = malloc(L * b + (h->contiguous ? 0 : W * b)); // (L, n), then (H, L, n)
    if (!tmp) return err_resource(err, "all_gather: out of memory");
    char *all = h->contiguous ? recv : tmp + L * b;
    int rc = comm_all_gather(h->local, send, tmp, n, dt, err) ||
             comm_all_gather(h->cross, tmp, all, L * n, dt, err);
    for (size_t i = 0; !rc && !h->contiguous && i < W; i++)
        memcpy((char *)recv + (size_t)h->rank_of[i] * b, all + i * b, b);
    free(tmp);
    return rc ? err_prefix(err, "all_gather") : 0;
}

// ---------------------------------------------------------------- the flat ops

static int hier_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err) {
    return comm_broadcast(hier_of(c)->flat, buf, bytes, root, err);
}

static int hier_barrier(Comm *c, Err *err) {
    return comm_barrier(hier_of(c)->flat, err);
}

static int hier_all_to_all(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                           const size_t *recv_bytes, Err *err) {
    return comm_all_to_all(hier_of(c)->flat, send, send_bytes, recv, recv_bytes, err);
}

static int hier_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    return comm_p2p(hier_of(c)->flat, ops, n, err);
}

// A gloo sub-communicator of flat, moved into the Comm that comm.c allocated.
static int hier_split(Comm *c, int color, int key, Comm *out, Err *err) {
    Comm *sub;
    if (comm_split(hier_of(c)->flat, color, key, &sub, err)) return -1;
    *out = *sub;
    free(sub);
    return 0;
}

static const CommBackend HIER_OPS = {.device_memory = 0,
                                     .all_reduce = hier_all_reduce,
                                     .reduce_scatter = hier_reduce_scatter,
                                     .all_gather = hier_all_gather,
                                     .broadcast = hier_broadcast,
                                     .barrier = hier_barrier,
                                     .all_to_all = hier_all_to_all,
                                     .p2p = hier_p2p,
                                     .split = hier_split,
                                     .destroy = hier_destroy};

int hier_comm_init(Comm *c, const CommConfig *cfg, Err *err) {
    snprintf(c->label, sizeof c->label, "hier rank %d/%d", c->rank, c->world);
    c->ops = &HIER_OPS;
    Hier *h = calloc(1, sizeof *h);
    if (!h) return err_resource(err, "hier: out of memory");
    int host = 0, local = 0;
    if (check_hier_config(cfg, err) || make_layout(h, cfg, &host, &local, err) ||
        connect_all(h, cfg, host, local, err)) {
        hier_free(h);
        return err_prefix(err, "%s", c->label);
    }
    c->state = h;
    return 0;
}
