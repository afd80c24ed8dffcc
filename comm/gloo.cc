// gloo.cc: the `gloo` backend: CPU ranks on any hosts, Facebook's Gloo over TCP (the one C++
// file of astrai: a shim between comm_backend.h and Gloo's C++ API).
//
// Connect: a gloo::rendezvous::Context over one full mesh of TCP pairs, its store an
// ExchangeStore whose set() is a collective over CommConfig.exchange (below). Then one
// all-gather of every rank's socket addresses, so that a peer address in Gloo's messages
// ("Connection closed by peer [10.0.0.2]:41234") names a rank.
//
// Collectives: Gloo's own (all_reduce: its ring, reduce-scatter then all-gather, so every
// rank gets the same bits; all_gather, broadcast, barrier, alltoallv), each with a fresh tag.
// reduce_scatter is an all_reduce of a copy of the whole send buffer (twice the traffic of a
// true reduce-scatter: this Gloo's only one is the old-API halving-doubling).
// all_to_all all-gathers every rank's sizes first, so every rank checks every pair alike.
//
// Point-to-point: per ordered pair three FIFO slots: each side of a transfer first sends the
// other its size (the sender on HDR, the receiver on ACK), so both see a mismatch before any
// data moves; then the data on DATA. Every size swap of a group is posted before any wait, so
// two neighbours sending to each other never deadlock (run_p2p says what that allows).
//
// Errors: Gloo throws; every extern "C" entry catches everything and turns it into an Err
// naming the op, and the peer: from the message's address, else the peers whose connection
// is known broken, else every rank's host.
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
// common/dtype.h's table uses C99 array designators, an extension to clang's C++.
#pragma GCC diagnostic push
#ifdef __clang__
#pragma GCC diagnostic ignored "-Wc99-designator"
#endif
#include "comm/comm_backend.h"
#pragma GCC diagnostic pop
}

namespace {

using Blob = std::vector<char>;
using Blobs = std::vector<Blob>; // one per rank, in rank order
using Gather = std::function<Blobs(const Blob &)>;
using Ms = std::chrono::milliseconds;

// A failure whose peer is known (p2p): the message, and that rank.
struct PeerError : std::runtime_error {
    int peer;
    PeerError(const std::string &msg, int peer_) : std::runtime_error(msg), peer(peer_) {}
};

// Gloo's store, made of collective rounds: set() all-gathers this rank's (key, value), then
// holds every rank's; get() and wait() only read that table. This relies on
// connectFullMesh (gloo/rendezvous/context.cc at 5b14351) calling set() exactly twice on
// every rank ("rank_<r>": the host name, then "<r>": the pair addresses), each before any
// get() or wait() of what it publishes, so the rounds line up across ranks.
class ExchangeStore : public gloo::rendezvous::Store {
  public:
    explicit ExchangeStore(Gather gather) : gather_(std::move(gather)) {}

    // blob: (u32 key length, key, value)
    void set(const std::string &key, const std::vector<char> &data) override {
        Blob mine(sizeof(uint32_t) + key.size() + data.size());
        uint32_t len = (uint32_t)key.size();
        memcpy(mine.data(), &len, sizeof len);
        memcpy(mine.data() + sizeof len, key.data(), key.size());
        std::copy(data.begin(), data.end(), mine.begin() + sizeof len + key.size());
        for (const Blob &b : gather_(mine))
            insert(b);
    }

    std::vector<char> get(const std::string &key) override {
        auto it = table_.find(key);
        if (it == table_.end())
            throw std::runtime_error("store: key \"" + key + "\" absent after the exchange");
        return it->second;
    }

    void wait(const std::vector<std::string> &keys) override {
        for (const std::string &k : keys)
            get(k);
    }

    void wait(const std::vector<std::string> &keys, const Ms &) override {
        wait(keys);
    }

  private:
    void insert(const Blob &b) {
        uint32_t len;
        if (b.size() < sizeof len)
            throw std::runtime_error("store: a blob of " + std::to_string(b.size()) + " bytes");
        memcpy(&len, b.data(), sizeof len);
        if (b.size() - sizeof len < len)
            throw std::runtime_error("store: a key of " + std::to_string(len) +
                                     " bytes in a blob of " + std::to_string(b.size()));
        std::string key(b.data() + sizeof len, len);
        table_[key] = Blob(b.begin() + sizeof len + len, b.end());
    }

    Gather gather_;
    std::map<std::string, Blob> table_;
};

// p2p slots: a prefix no Gloo collective uses (theirs are small), then the kind.
enum : uint64_t { SLOT_HDR = 0xa5ull << 56, SLOT_ACK = SLOT_HDR + 1, SLOT_DATA = SLOT_HDR + 2 };

#define ADDR_CHARS 96 // one socket address as Gloo prints it ("[ipv6]:port"), NUL-padded

struct Gloo {
    std::shared_ptr<gloo::transport::Device> device;
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    std::vector<std::string> hosts;     // [world]; empty: unknown
    std::vector<std::string> peer_ends; // [world]: rank r's end of its connection to this rank
    std::vector<uint64_t> next[2];      // [recv, send][peer]: messages numbered so far
    uint32_t tag = 0;                   // of the next collective
    Ms timeout;
};

Gloo *gloo_of(Comm *c) {
    return static_cast<Gloo *>(c->state);
}

// ---------------------------------------------------------------- errors

// Gloo's messages start with "[/path/to/file.cc:123] ": only the text matters here.
std::string strip_location(const char *what) {
    const char *end = what[0] == '[' ? strstr(what, "] ") : nullptr;
    return end ? std::string(end + 2) : std::string(what);
}

std::string rank_name(const Gloo *g, int r) {
    std::string s = "rank " + std::to_string(r);
    if (!g->hosts.empty()) s += " (" + g->hosts[r] + ")";
    return s;
}

// The ranks whose connection to this one is known broken: sending to them throws at once.
std::vector<int> broken_peers(Comm *c) {
    Gloo *g = gloo_of(c);
    std::vector<int> out;
    char probe = 0;
    auto buf = g->ctx->createUnboundBuffer(&probe, 0);
    for (int r = 0; r < c->world; r++) {
        if (r == c->rank) continue;
        try {
            buf->send(r, SLOT_HDR - 1, 0, 0);
        } catch (const std::exception &) {
            out.push_back(r);
        }
    }
    return out;
}

// Who the failure is about: the rank whose address the message names, and every other rank
// whose connection is known lost (a peer that failed first may have closed its connections:
// the death behind it shows as a lost connection), else every rank's host (when known).
std::string which_peer(Comm *c, const std::string &msg) {
    Gloo *g = gloo_of(c);
    int named = -1;
    for (int r = 0; r < c->world && named < 0; r++)
        if (r != c->rank && !g->peer_ends[r].empty() &&
            msg.find(g->peer_ends[r]) != std::string::npos)
            named = r;
    std::string s = named >= 0 ? " (peer: " + rank_name(g, named) : "";
    std::string lost;
    for (int r : broken_peers(c))
        if (r != named) lost += (lost.empty() ? "connection lost to " : ", ") + rank_name(g, r);
    if (!lost.empty()) s += (s.empty() ? " (" : "; ") + lost;
    if (!s.empty()) return s + ")";
    for (int r = 0; r < c->world && !g->hosts.empty(); r++)
        s += (s.empty() ? " (ranks: " : ", ") + rank_name(g, r);
    return s.empty() ? s : s + ")";
}

// Runs f; an exception becomes err ("<op>: <what> (<peer>)"), never crossing into C.
template <typename F> int guarded(Comm *c, const char *op, Err *err, F &&f) {
    try {
        return f();
    } catch (const PeerError &e) {
        return err_set(err, "%s: %s (peer: %s)", op, strip_location(e.what()).c_str(),
                       rank_name(gloo_of(c), e.peer).c_str());
    } catch (const std::bad_alloc &) {
        return err_resource(err, "%s: out of memory", op);
    } catch (const std::exception &e) {
        std::string msg = strip_location(e.what());
        std::string peer;
        try {
            peer = which_peer(c, msg);
        } catch (...) { // naming the peer is best effort
        }
        return err_set(err, "%s: %s%s", op, msg.c_str(), peer.c_str());
    } catch (...) {
        return err_set(err, "%s: an unknown exception", op);
    }
}

// ---------------------------------------------------------------- collectives

int fp32_only(DType dt, const char *call, Err *err) {
    if (dt == DT_F32) return 0;
    return err_set(err, "%s: the gloo backend reduces fp32 only, not %s", call, dtype_name(dt));
}

void scale_avg(float *x, size_t n, int world, CommOp op) {
    if (op != COMM_AVG) return;
    const float s = 1.0f / (float)world;
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

// buf: (n,) summed in place by Gloo's ring (n > 0).
void ring_sum(Gloo *g, float *buf, size_t n) {
    gloo::AllreduceOptions opts(g->ctx);
    opts.setOutput(buf, n);
    opts.setReduceFunction(
        static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::sum<float>));
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setTag(g->tag++);
    opts.setTimeout(g->timeout);
    gloo::allreduce(opts);
}

// send: (bytes,) from each rank; recv: (world * bytes,).
void gather_bytes(Gloo *g, const void *send, void *recv, size_t bytes) {
    if (!bytes) return;
    gloo::AllgatherOptions opts(g->ctx);
    opts.setInput(const_cast<char *>(static_cast<const char *>(send)), bytes);
    opts.setOutput(static_cast<char *>(recv), bytes * g->ctx->size);
    opts.setTag(g->tag++);
    opts.setTimeout(g->timeout);
    gloo::allgather(opts);
}

int gloo_all_reduce(Comm *c, void *buf, size_t n, DType dt, CommOp op, Err *err) {
    if (fp32_only(dt, "all_reduce", err)) return -1;
    return guarded(c, "all_reduce", err, [&] {
        if (n) ring_sum(gloo_of(c), static_cast<float *>(buf), n);
        scale_avg(static_cast<float *>(buf), n, c->world, op);
        return 0;
    });
}

int gloo_reduce_scatter(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                        Err *err) {
    if (fp32_only(dt, "reduce_scatter", err)) return -1;
    return guarded(c, "reduce_scatter", err, [&] {
        if (!n) return 0;
        const float *s = static_cast<const float *>(send);
        std::vector<float> all(s, s + (size_t)c->world * n); // (world * n,)
        ring_sum(gloo_of(c), all.data(), all.size());
        float *out = static_cast<float *>(recv);
        std::copy_n(all.data() + (size_t)c->rank * n, n, out);
        scale_avg(out, n, c->world, op);
        return 0;
    });
}

int gloo_all_gather(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err) {
    return guarded(c, "all_gather", err, [&] {
        gather_bytes(gloo_of(c), send, recv, n * dtype_size(dt));
        return 0;
    });
}

int gloo_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err) {
    return guarded(c, "broadcast", err, [&] {
        if (!bytes) return 0;
        Gloo *g = gloo_of(c);
        gloo::BroadcastOptions opts(g->ctx);
        opts.setOutput(static_cast<char *>(buf), bytes);
        opts.setRoot(root);
        opts.setTag(g->tag++);
        opts.setTimeout(g->timeout);
        gloo::broadcast(opts);
        return 0;
    });
}

void barrier(Gloo *g) {
    gloo::BarrierOptions opts(g->ctx);
    opts.setTag(g->tag++);
    opts.setTimeout(g->timeout);
    gloo::barrier(opts);
}

int gloo_barrier(Comm *c, Err *err) {
    return guarded(c, "barrier", err, [&] {
        barrier(gloo_of(c));
        return 0;
    });
}

// ---------------------------------------------------------------- all-to-all

// sizes: (world, 2 * world): rank q's row holds what it sends to each rank, then what it
// receives from each. Every pair in the same order on every rank: all fail alike.
int check_pair_sizes(const std::vector<uint64_t> &sizes, int W, Err *err) {
    for (int q = 0; q < W; q++)
        for (int r = 0; r < W; r++) {
            uint64_t sent = sizes[(size_t)q * 2 * W + r], got = sizes[(size_t)r * 2 * W + W + q];
            if (sent == got) continue;
            return err_set(err,
                           "all_to_all: rank %d sends %llu bytes to rank %d, which receives "
                           "%llu from rank %d",
                           q, (unsigned long long)sent, r, (unsigned long long)got, q);
        }
    return 0;
}

void move_parts(Gloo *g, const void *send, const size_t *send_bytes, void *recv,
                const size_t *recv_bytes) {
    int W = g->ctx->size;
    std::vector<int64_t> out_parts(send_bytes, send_bytes + W),
        in_parts(recv_bytes, recv_bytes + W);
    gloo::AlltoallvOptions opts(g->ctx);
    opts.setInput(const_cast<char *>(static_cast<const char *>(send)), out_parts);
    opts.setOutput(static_cast<char *>(recv), in_parts);
    opts.setTag(g->tag++);
    opts.setTimeout(g->timeout);
    gloo::alltoallv(opts);
}

int gloo_all_to_all(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                    const size_t *recv_bytes, Err *err) {
    return guarded(c, "all_to_all", err, [&] {
        Gloo *g = gloo_of(c);
        int W = c->world;
        std::vector<uint64_t> mine(send_bytes, send_bytes + W), all((size_t)W * 2 * W);
        mine.insert(mine.end(), recv_bytes, recv_bytes + W);
        gather_bytes(g, mine.data(), all.data(), mine.size() * sizeof(uint64_t));
        if (check_pair_sizes(all, W, err)) return -1;
        bool any = std::any_of(all.begin(), all.end(), [](uint64_t b) { return b != 0; });
        if (any) move_parts(g, send, send_bytes, recv, recv_bytes);
        return 0;
    });
}

// ---------------------------------------------------------------- point-to-point

// One transfer's state: its message number in its direction, the sizes swapped first.
struct Transfer {
    uint64_t index, mine, theirs;
    std::unique_ptr<gloo::transport::UnboundBuffer> out, in, data;
};

Ms left_until(std::chrono::steady_clock::time_point deadline) {
    auto left = std::chrono::duration_cast<Ms>(deadline - std::chrono::steady_clock::now());
    return std::max(left, Ms(1));
}

// Waits for what the transfer posted; a failure names its peer.
void wait_transfer(Transfer &t, int peer, std::chrono::steady_clock::time_point deadline) {
    try {
        if (t.out) t.out->waitSend(left_until(deadline));
        if (t.in) t.in->waitRecv(left_until(deadline));
        t.out.reset();
        t.in.reset();
    } catch (const std::exception &e) {
        throw PeerError(e.what(), peer);
    }
}

int sizes_differ(Comm *c, const CommP2p &o, const Transfer &t, Err *err) {
    return err_set(err,
                   "p2p: rank %d %s %zu bytes %s rank %d, which %s %llu (message %llu from "
                   "rank %d to rank %d)",
                   c->rank, o.send ? "sends" : "receives", o.bytes, o.send ? "to" : "from", o.peer,
                   o.send ? "receives" : "sends", (unsigned long long)t.theirs,
                   (unsigned long long)t.index, o.send ? c->rank : o.peer,
                   o.send ? o.peer : c->rank);
}

// Posts the size swap of a transfer: the sender's size on HDR, the receiver's on ACK.
void post_sizes(Gloo *g, const CommP2p &o, Transfer &t) {
    t.index = g->next[o.send][o.peer]++;
    t.mine = o.bytes;
    t.out = g->ctx->createUnboundBuffer(&t.mine, sizeof t.mine);
    t.in = g->ctx->createUnboundBuffer(&t.theirs, sizeof t.theirs);
    t.out->send(o.peer, o.send ? SLOT_HDR : SLOT_ACK);
    t.in->recv(o.peer, o.send ? SLOT_ACK : SLOT_HDR);
}

// Gloo moves a send's data once the receiver posted its receive, and a message longer than
// the receive fails Gloo's event loop: the receive is posted only once both sizes agree.
void post_data(Gloo *g, const CommP2p &o, Transfer &t) {
    if (!o.bytes) return;
    auto buf = g->ctx->createUnboundBuffer(o.buf, o.bytes);
    if (o.send)
        buf->send(o.peer, SLOT_DATA);
    else
        buf->recv(o.peer, SLOT_DATA);
    (o.send ? t.out : t.in) = std::move(buf);
}

// Every size swap is posted first, so a transfer's swap never waits for another's data; then
// in order each transfer's swap is waited for, checked and its data posted; then the data
// waited for. (Gloo has no wait for any of several buffers, and a wait that times out closes
// every connection: a chain of groups over three ranks that needs a later transfer's data
// before an earlier one's swap can complete would wait out the timeout here.)
int run_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    Gloo *g = gloo_of(c);
    auto deadline = std::chrono::steady_clock::now() + g->timeout;
    std::vector<Transfer> t((size_t)n);
    for (int i = 0; i < n; i++)
        post_sizes(g, ops[i], t[i]);
    for (int i = 0; i < n; i++) {
        wait_transfer(t[i], ops[i].peer, deadline);
        if (t[i].theirs != t[i].mine) return sizes_differ(c, ops[i], t[i], err);
        post_data(g, ops[i], t[i]);
    }
    for (int i = 0; i < n; i++)
        wait_transfer(t[i], ops[i].peer, deadline);
    return 0;
}

int gloo_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    return guarded(c, "p2p", err, [&] { return run_p2p(c, ops, n, err); });
}

// ---------------------------------------------------------------- connect

// Every rank's variable-size blob over Gloo itself (a comm_split's store): the sizes first.
Blobs gather_blobs(Gloo *g, const Blob &mine) {
    int W = g->ctx->size;
    uint64_t len = mine.size();
    std::vector<uint64_t> lens((size_t)W);
    gather_bytes(g, &len, lens.data(), sizeof len);
    std::vector<size_t> counts(lens.begin(), lens.end());
    Blob all(std::accumulate(counts.begin(), counts.end(), (size_t)0));
    gloo::AllgathervOptions opts(g->ctx);
    opts.setInput(const_cast<char *>(mine.data()), mine.size());
    opts.setOutput(all.data(), counts);
    opts.setTag(g->tag++);
    opts.setTimeout(g->timeout);
    gloo::allgatherv(opts);
    Blobs out;
    size_t off = 0;
    for (size_t len_r : counts) {
        out.emplace_back(all.begin() + off, all.begin() + off + len_r);
        off += len_r;
    }
    return out;
}

// The blobs of CommConfig.exchange (comm_create's store).
Blobs exchange_blobs(const CommExchange *x, int world, const Blob &mine) {
    uint8_t *all = nullptr;
    std::vector<size_t> lens((size_t)world);
    Err err = {};
    if (x->all_gather(x->ctx, mine.data(), mine.size(), &all, lens.data(), &err))
        throw std::runtime_error("exchange: " + std::string(err.msg));
    std::unique_ptr<uint8_t, decltype(&free)> owned(all, &free);
    Blobs out;
    size_t off = 0;
    for (size_t len : lens) {
        out.emplace_back(all + off, all + off + len);
        off += len;
    }
    return out;
}

// Publishes this rank's end of each connection; keeps each peer's end of its connection to
// this rank (Gloo's messages print those).
void learn_peer_ends(Gloo *g) {
    int W = g->ctx->size, me = g->ctx->rank;
    std::vector<char> mine((size_t)W * ADDR_CHARS), all((size_t)W * mine.size());
    for (int r = 0; r < W; r++)
        if (r != me)
            snprintf(&mine[(size_t)r * ADDR_CHARS], ADDR_CHARS, "%s",
                     g->ctx->getPair(r)->address().str().c_str());
    gather_bytes(g, mine.data(), all.data(), mine.size());
    g->peer_ends.assign((size_t)W, "");
    for (int r = 0; r < W; r++)
        if (r != me) g->peer_ends[r] = &all[((size_t)r * W + me) * ADDR_CHARS];
}

std::shared_ptr<gloo::transport::Device> make_device(const char *addr) {
    gloo::transport::tcp::attr attr;
    const char *iface = getenv("GLOO_SOCKET_IFNAME");
    if (addr && *addr)
        attr.hostname = addr;
    else if (iface && *iface)
        attr.iface = iface; // neither: Gloo binds the host name's address
    return gloo::transport::tcp::CreateDevice(attr);
}

// Fills c's state: a full mesh over `device` through a store made of `gather`'s rounds.
void connect(Comm *c, std::shared_ptr<gloo::transport::Device> device, const Gather &gather,
             std::vector<std::string> hosts) {
    std::unique_ptr<Gloo> g(new Gloo());
    g->timeout = Ms(c->timeout_ms);
    g->device = std::move(device);
    g->hosts = std::move(hosts);
    g->next[0].assign((size_t)c->world, 0);
    g->next[1].assign((size_t)c->world, 0);
    g->ctx = std::make_shared<gloo::rendezvous::Context>(c->rank, c->world);
    g->ctx->setTimeout(g->timeout);
    ExchangeStore store(gather);
    g->ctx->connectFullMesh(store, g->device);
    c->state = g.get();
    try {
        learn_peer_ends(g.get());
    } catch (...) {
        c->state = nullptr;
        throw;
    }
    g.release();
}

void gloo_destroy(Comm *c) {
    delete gloo_of(c);
    c->state = nullptr;
}

int gloo_split(Comm *c, int color, int key, Comm *out, Err *err);

const CommBackend GLOO_OPS = {/*device_memory=*/0,
                              gloo_all_reduce,
                              gloo_reduce_scatter,
                              gloo_all_gather,
                              /*reduce_scatter_start=*/nullptr,
                              /*all_gather_start=*/nullptr,
                              /*join=*/nullptr,
                              /*wait=*/nullptr,
                              gloo_broadcast,
                              gloo_barrier,
                              gloo_all_to_all,
                              gloo_p2p,
                              /*p2p_start=*/nullptr,
                              gloo_split,
                              gloo_destroy};

void set_label(Comm *c) {
    snprintf(c->label, sizeof c->label, "gloo rank %d/%d", c->rank, c->world);
    c->ops = &GLOO_OPS;
}

// ---------------------------------------------------------------- sub-communicators

// The ranks of this rank's color, by key then parent rank: (color, key) of every rank.
std::vector<int> members_of(const std::vector<int32_t> &ck, int me) {
    std::vector<int> m;
    for (int r = 0; r < (int)ck.size() / 2; r++)
        if (ck[2 * r] == ck[2 * me]) m.push_back(r);
    std::stable_sort(m.begin(), m.end(),
                     [&](int a, int b) { return ck[2 * a + 1] < ck[2 * b + 1]; });
    return m;
}

int gloo_split(Comm *c, int color, int key, Comm *out, Err *err) {
    return guarded(c, "comm_split", err, [&] {
        Gloo *g = gloo_of(c);
        int32_t mine[2] = {color, key};
        std::vector<int32_t> ck((size_t)2 * c->world);
        gather_bytes(g, mine, ck.data(), sizeof mine);
        std::vector<int> members = members_of(ck, c->rank);
        out->world = (int)members.size();
        out->rank = (int)(std::find(members.begin(), members.end(), c->rank) - members.begin());
        std::vector<std::string> hosts;
        for (int r : members)
            if (!g->hosts.empty()) hosts.push_back(g->hosts[r]);
        // Every parent rank takes part in each round, whatever its color; keep the members'.
        Gather gather = [g, members](const Blob &b) {
            Blobs all = gather_blobs(g, b), kept;
            for (int r : members)
                kept.push_back(std::move(all[r]));
            return kept;
        };
        set_label(out);
        connect(out, g->device, gather, hosts);
        return 0;
    });
}

// Gloo writes its sockets without MSG_NOSIGNAL: a write to a peer that died would end this
// process with SIGPIPE instead of failing the call. Ignored unless the program handles it.
void ignore_sigpipe() {
    struct sigaction old;
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL)
        signal(SIGPIPE, SIG_IGN);
}

int check_gloo_config(const CommConfig *cfg, Err *err) {
    if (!cfg->exchange || !cfg->exchange->all_gather)
        return err_set(err,
                       "gloo: CommConfig.exchange %s (the connect needs an all-gather of "
                       "one blob per rank, e.g. train/rendezvous.h's)",
                       cfg->exchange ? "has no all_gather" : "is not set");
    return 0;
}

} // namespace

extern "C" int gloo_comm_init(Comm *c, const CommConfig *cfg, Err *err) {
    set_label(c);
    if (check_gloo_config(cfg, err)) return err_prefix(err, "%s", c->label);
    std::vector<std::string> hosts;
    for (int r = 0; r < c->world && cfg->hosts; r++)
        hosts.push_back(cfg->hosts[r] ? cfg->hosts[r] : "?");
    ignore_sigpipe();
    const CommExchange *x = cfg->exchange;
    int world = c->world;
    try {
        Gather gather = [x, world](const Blob &b) { return exchange_blobs(x, world, b); };
        connect(c, make_device(cfg->gloo_addr), gather, hosts);
        return 0;
    } catch (const std::exception &e) {
        err_set(err, "comm_create: %s", strip_location(e.what()).c_str());
    } catch (...) {
        err_set(err, "comm_create: an unknown exception");
    }
    c->state = nullptr;
    return err_prefix(err, "%s", c->label);
}
