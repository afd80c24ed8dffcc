#!/usr/bin/python3
"""bench_metrics.py: astraid's HTTP listener (--http): what /metrics and the web page cost.

One run measures:
  1. scrape latency of GET /metrics (one kept-alive connection, as Prometheus scrapes) with
     100 jobs known to the daemon (2 training, 48 queued, 50 cancelled): p50/p99 of scrapes
     spaced --gap-s apart (each one finds its snapshot stale: the loop builds a new one, as
     for a Prometheus scrape every few seconds) and of scrapes back to back (most reuse a
     snapshot under 0.25 s old);
  2. astraid's CPU (utime + stime of the process, /proc/PID/stat, as percent of one core)
     over --load-s seconds with nothing asking, then while /metrics is scraped every second
     and the web page polls (/api/jobs and /api/history of a training job every second);
  3. training tokens/s of the same job through astraid without --http and through astraid
     with --http scraped and polled every second: alternating rounds (never at once), each
     read from the job's progress.db (median over the steps after the warm-up); the ratio of
     the medians over the rounds.
Prints one JSON object and a summary.

    /usr/bin/python3 bench/bench_metrics.py --build build
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from bench_daemon import tokens_per_s, training_setup  # noqa: E402  the same job and measure


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with the binaries")
    p.add_argument("--scrapes", type=int, default=60, help="spaced scrapes (and 10x back to back)")
    p.add_argument("--gap-s", type=float, default=0.3, help="between spaced scrapes")
    p.add_argument("--load-s", type=float, default=20, help="length of each CPU measurement")
    p.add_argument("--rounds", type=int, default=2, help="training rounds of each side")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--threads", type=int, default=1, help="of each training job")
    return p.parse_args()


def get(conn, path):
    conn.request("GET", path)
    r = conn.getresponse()
    body = r.read()
    assert r.status == 200, (path, r.status, body[:200])
    return body


def percentiles(xs):
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": statistics.median(xs) * 1e3,
            "p99_ms": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3, "max_ms": xs[-1] * 1e3}


def scrape_latency(port, n, gap):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    spaced, back = [], []
    for _ in range(n):
        time.sleep(gap)
        t0 = time.perf_counter()
        body = get(conn, "/metrics")
        spaced.append(time.perf_counter() - t0)
    for _ in range(n * 10):
        t0 = time.perf_counter()
        get(conn, "/metrics")
        back.append(time.perf_counter() - t0)
    conn.close()
    return {"spaced": percentiles(spaced), "back_to_back": percentiles(back),
            "bytes": len(body), "series": sum(1 for x in body.splitlines() if x[:1] != b"#")}


class Watchers:
    """Prometheus (/metrics) and the web page (/api/jobs, /api/history of job), each
    once a second, in a thread, until stopped."""

    def __init__(self, port, job):
        self.port, self.job, self.run, self.n = port, job, True, 0
        self.t = threading.Thread(target=self.loop)
        self.t.start()

    def loop(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while self.run:
            t0 = time.monotonic()
            get(conn, "/metrics")
            get(conn, "/api/jobs")
            get(conn, f"/api/history?job={self.job}")
            self.n += 1
            time.sleep(max(0.0, 1 - (time.monotonic() - t0)))
        conn.close()

    def stop(self):
        self.run = False
        self.t.join()
        return self.n


def cpu_percent(pid, seconds):
    from test_daemon_http import cpu_seconds  # after main() set ASTRAI_BUILD
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 100


def training(a, root, train):
    """3. the same job through astraid without and with the listener, alternating."""
    import daemon_util as du
    import train_util as tu
    rounds = []
    for r in range(a.rounds):
        row = {}
        for side in ("without", "with"):
            port = tu.free_port()
            args = [f"--http=127.0.0.1:{port}"] if side == "with" else []
            os.makedirs(os.path.join(root, f"{side}{r}"))
            d = du.Daemon(os.path.join(root, f"{side}{r}"), args=args).start()
            c = d.client()
            job = c.call("submit", dict(train, name=f"{side}{r}"))["job"]
            w = Watchers(port, job) if side == "with" else None
            du.wait_job(c, job, ["completed"], timeout=3600)
            if w:
                row["polls"] = w.stop()
            row[side] = tokens_per_s(os.path.join(d.state_dir, "jobs", str(job), "progress.db"),
                                     a.warmup)[0]
            c.close()
            d.stop()
        rounds.append(row)
    without = statistics.median(x["without"] for x in rounds)
    with_http = statistics.median(x["with"] for x in rounds)
    return {"rounds": rounds, "without_tokens_per_s": without, "with_tokens_per_s": with_http,
            "ratio": with_http / without}


def main():
    a = parse_args()
    a.build = os.path.abspath(a.build)
    root, train = training_setup(a.build, "astrai-bench-metrics-", a.threads)
    import daemon_util as du
    import train_util as tu
    tiny_model, tiny_data = du.make_setup(os.path.join(root, "tiny"), n_windows=16)
    port = tu.free_port()
    os.makedirs(os.path.join(root, "d"))
    d = du.Daemon(os.path.join(root, "d"), args=[f"--http=127.0.0.1:{port}"],
                  devices="cpu:2").start()
    c = d.client()
    out = {"load_avg_start": os.getloadavg()[0]}
    # 100 jobs: 2 training (long), 48 queued behind them, 50 cancelled.
    busy = [c.call("submit", dict(train, n_epoch=1000, name=f"busy{i}"))["job"] for i in range(2)]
    for j in busy:
        du.wait_job(c, j, ["running"], pred=lambda s: s["step"] > 0)
    for i in range(98):
        j = c.call("submit", du.spec(tiny_model, tiny_data, name=f"tiny{i}"))["job"]
        if i % 2:
            c.call("cancel", {"job": j})
    out["jobs"] = len(c.call("list", {"limit": 1000})["jobs"])
    out["scrape"] = scrape_latency(port, a.scrapes, a.gap_s)
    out["cpu_idle_pct"] = cpu_percent(d.proc.pid, a.load_s)
    w = Watchers(port, busy[0])
    out["cpu_watched_pct"] = cpu_percent(d.proc.pid, a.load_s)
    out["watch_polls"] = w.stop()
    for j in c.call("list", {"limit": 1000})["jobs"]:
        if j["state"] in ("queued", "running"):
            c.call("cancel", {"job": j["id"]})
    for j in busy:
        du.wait_job(c, j, ["cancelled"], pred=lambda s: not s["devices"])
    c.close()
    d.stop()
    if a.rounds:
        out["training"] = training(a, root, train)
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    s = out["scrape"]
    print(f"/metrics with {out['jobs']} jobs ({s['series']} series, {s['bytes']} bytes): "
          f"spaced {a.gap_s:g} s p50 {s['spaced']['p50_ms']:.2f} ms p99 "
          f"{s['spaced']['p99_ms']:.2f} ms | back to back p50 {s['back_to_back']['p50_ms']:.2f} "
          f"ms p99 {s['back_to_back']['p99_ms']:.2f} ms")
    print(f"astraid CPU: {out['cpu_idle_pct']:.2f}% unwatched, {out['cpu_watched_pct']:.2f}% "
          f"scraped + page polling every second")
    t = out.get("training")
    if t:
        print(f"tokens/s without --http {t['without_tokens_per_s']:.0f}, with (scraped, polled) "
              f"{t['with_tokens_per_s']:.0f}: ratio {t['ratio']:.3f}")


if __name__ == "__main__":
    main()
