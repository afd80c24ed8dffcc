#!/usr/bin/python3
"""bench_daemon.py: astraid's control-socket latency and its training overhead.

One run measures, while a job trains through astraid:
  1. `status` round trips on the unix socket, from C clients (bench_status_latency, one thread
     and connection each): p50/p99/max latency and requests/s with 1 client and with 64
     clients sending back to back (throughput: with 64 clients the latency is mostly
     queueing, p50 ~ 64 / throughput), and with 64 clients each sending one request every
     --interval-ms (64 users of `astraictl status`/`watch`: the latency they see); each with
     astraid's CPU time per request;
  2. training tokens/s of a job run through astraid vs the same astrai-train command run
     alone, one after the other (never side by side), both read from their progress.db
     (median tokens_per_s over the steps after the warm-up).
Prints one JSON object and a summary. On a shared machine the rounds are noisy: the best
round of each side is reported too.

    /usr/bin/python3 bench/bench_daemon.py --build build-h8
"""
import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

CONFIG = {  # steps of ~0.1-1 s: long enough to show a daemon's overhead, short enough to bench
    "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 352, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
    "attn_type": "gqa", "ffn_type": "mlp", "use_qk_norm": False, "use_gated_attention": False,
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with the binaries")
    p.add_argument("--requests", type=int, default=3000, help="status calls per measurement")
    p.add_argument("--interval-ms", type=float, default=50,
                   help="each of the 64 paced clients sends one status per this interval")
    p.add_argument("--paced-s", type=float, default=10, help="length of the paced measurement")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating alone/astraid rounds (0: the latencies alone)")
    return p.parse_args()


def cpu_s(pid):
    """CPU seconds (user + system) process pid has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_trips(build, d, job, clients, total, interval_ms=0):
    """`status` round trips from C clients (bench/status_latency.c), one connection each;
    interval_ms 0: back to back, else one request per client every interval_ms. Also the
    CPU time astraid spent per request (its whole process: the loop and its threadpool's
    progress.db polls): what the machine's load does not change much, unlike the tails."""
    cpu0 = cpu_s(d.proc.pid)
    out = subprocess.run([os.path.join(build, "bench_status_latency"), d.socket, str(job),
                          str(clients), str(max(1, total // clients)), str(interval_ms)],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    r["astraid_cpu_us_per_req"] = (cpu_s(d.proc.pid) - cpu0) / r["requests"] * 1e6
    return r


def tokens_per_s(progress_db, warmup):
    db = sqlite3.connect(progress_db, timeout=5)
    rows = [r[0] for r in db.execute("SELECT tokens_per_s FROM steps WHERE step > ? ORDER BY step",
                                     (warmup,))]
    db.close()
    return statistics.median(rows), len(rows)


def training(a, c, d, root, train):
    """2. the same training alone and through astraid, one after the other, in alternating
    rounds (the machine is shared: the median of the rounds is the figure)."""
    import daemon_util as du
    import train_util as tu
    rounds = []
    for r in range(a.rounds):
        alone_dir = os.path.join(root, f"alone{r}")
        subprocess.run([tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in train.items()] +
                       [f"--ckpt_dir={alone_dir}"], check=True, capture_output=True)
        job = c.call("submit", dict(train, name=f"measured{r}"))["job"]
        du.wait_job(c, job, ["completed"], timeout=3600)
        alone, n = tokens_per_s(os.path.join(alone_dir, "progress.db"), a.warmup)
        through, _ = tokens_per_s(os.path.join(d.state_dir, "jobs", str(job), "progress.db"),
                                  a.warmup)
        rounds.append({"steps_measured": n, "alone_tokens_per_s": alone,
                       "astraid_tokens_per_s": through})
    alone = statistics.median(x["alone_tokens_per_s"] for x in rounds)
    through = statistics.median(x["astraid_tokens_per_s"] for x in rounds)
    # On a busy machine the best round of each side is the least disturbed one.
    best_alone = max(x["alone_tokens_per_s"] for x in rounds)
    best_through = max(x["astraid_tokens_per_s"] for x in rounds)
    return {"rounds": rounds, "alone_tokens_per_s": alone, "astraid_tokens_per_s": through,
            "overhead_pct": (alone - through) / alone * 100,
            "best_alone_tokens_per_s": best_alone, "best_astraid_tokens_per_s": best_through,
            "best_overhead_pct": (best_alone - best_through) / best_alone * 100}


def training_setup(build, prefix, threads):
    """For a bench of astraid: ASTRAI_BUILD set for the test helpers, a temp root with the
    CONFIG model and 1 MiB of text, and the spec of a job training one epoch of it (~34
    steps: batch 8 x window 128). Returns (root, spec)."""
    os.environ["ASTRAI_BUILD"] = build
    import train_util as tu
    root = tempfile.mkdtemp(prefix=prefix)
    model = tu.make_model(os.path.join(root, "m"), CONFIG)
    data, _ = tu.make_text_data(root, 1 << 20)
    train = {"train_type": "seq", "param_path": model, "data_root_path": data,
             "batch_per_device": 8, "window_size": 128, "threads": threads,
             "ckpt_interval": 100000, "random_seed": 1, "n_epoch": 1}
    return root, train


def main():
    a = parse_args()
    a.build = os.path.abspath(a.build)
    root, train = training_setup(a.build, "astrai-bench-daemon-", a.threads)
    import daemon_util as du
    d = du.Daemon(root, devices="cpu:2").start()
    c = d.client()
    out = {"load_avg_start": os.getloadavg()[0]}
    # 1. round trips while a job trains (a long background job on the second slot)
    busy = c.call("submit", dict(train, n_epoch=1000, name="background"))["job"]
    du.wait_job(c, busy, ["running"], pred=lambda j: j["step"] > 0)
    out["status_1_client"] = round_trips(a.build, d, busy, 1, a.requests)
    out["status_64_clients"] = round_trips(a.build, d, busy, 64, a.requests * 4)
    paced = int(a.paced_s * 1000 / a.interval_ms) * 64
    out["status_64_paced"] = round_trips(a.build, d, busy, 64, paced, a.interval_ms)
    assert c.call("status", {"job": busy})["state"] == "running"
    c.call("cancel", {"job": busy})
    du.wait_job(c, busy, ["cancelled"], pred=lambda j: not j["devices"])
    time.sleep(1)
    if a.rounds:
        out["training"] = training(a, c, d, root, train)
    out["load_avg_end"] = os.getloadavg()[0]
    c.close()
    d.stop()
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    s1, s64, sp = out["status_1_client"], out["status_64_clients"], out["status_64_paced"]
    print(f"status 1 client: p50 {s1['p50_ms']:.3f} ms p99 {s1['p99_ms']:.3f} ms "
          f"{s1['req_per_s']:.0f} req/s | 64 clients back to back: p50 {s64['p50_ms']:.3f} ms "
          f"p99 {s64['p99_ms']:.3f} ms {s64['req_per_s']:.0f} req/s | 64 clients every "
          f"{sp['interval_ms']:g} ms: p50 {sp['p50_ms']:.3f} ms p99 {sp['p99_ms']:.3f} ms "
          f"max {sp['max_ms']:.3f} ms | astraid CPU per request {s1['astraid_cpu_us_per_req']:.0f} / "
          f"{s64['astraid_cpu_us_per_req']:.0f} / {sp['astraid_cpu_us_per_req']:.0f} us | load "
          f"{out['load_avg_start']:.1f} -> {out['load_avg_end']:.1f}")
    t = out.get("training")
    if t:
        print(f"tokens/s alone {t['alone_tokens_per_s']:.0f} vs astraid {t['astraid_tokens_per_s']:.0f} "
              f"({t['overhead_pct']:+.2f}% overhead; best rounds "
              f"{t['best_alone_tokens_per_s']:.0f} vs {t['best_astraid_tokens_per_s']:.0f}, "
              f"{t['best_overhead_pct']:+.2f}%)")


if __name__ == "__main__":
    main()
