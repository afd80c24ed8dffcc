#!/usr/bin/python3
"""bench_multihost.py: ranks on several hosts (network namespaces, tests/netns_util.py), in one run.

1. Training scaling: ddp samples/s with 1, 2, 4 ranks on one host (shm) and 2, 4 ranks on two
   hosts (1+1, 2+2; Gloo), the same batch per rank, threads=1; efficiency = rate(N) / (N rate(1)).
2. All-reduce bus bandwidth: Gloo between two hosts (bench_comm --backend gloo, one rank per
   host) against shm on one host (bench_comm) and a plain TCP stream between the two hosts
   (one direction, and both at once), 1-256 MiB.

    /usr/bin/python3 bench/bench_multihost.py --build build
"""
import argparse
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import bench_pref as bp  # noqa: E402
import bench_train as bt  # noqa: E402
import netns_util as nu  # noqa: E402
import test_multihost as tm  # noqa: E402
import train_util as tu  # noqa: E402

SIZES_MIB = (1, 4, 16, 64, 256)
GLOO_PORT, TCP_PORT = 29621, 29631
# (name, ranks per host, hosts)
RUNS = (("shm 1", 1, 1), ("shm 2", 2, 1), ("shm 4", 4, 1), ("gloo 1+1", 1, 2),
        ("gloo 2+2", 2, 2))


def parse_args(argv):
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default=os.environ.get("ASTRAI_BUILD", "build"))
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (at least 1)")
    p.add_argument("--batch", type=int, default=4, help="windows per rank per step")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-comm", action="store_true")
    p.add_argument("--workdir", help="keep models, data, logs there (default: a temporary dir)")
    p.add_argument("--tcp-worker", nargs=3, metavar=("ROLE", "ADDR", "PORT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------ training scaling


def train_flags(args, model, data, ckpt, world):
    """astrai-train's flags of one run: ddp (none for one rank), batch per rank fixed."""
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "parallel_mode": "ddp" if world > 1 else "none", "batch_per_device": args.batch,
         "window_size": args.window, "threads": 1, "optimizer": "adamw", "shuffle": "false",
         "max_steps": args.warmup + args.steps, "ckpt_interval": 100000, "log_interval": 1,
         "ckpt_dir": ckpt}
    return [f"--{k}={v}" for k, v in a.items()]


def check_backend(name, world, log):
    """Exits unless rank 0's log says the run used the collectives its name says."""
    want = f"collectives: {name.split()[0]}, {world} ranks" if world > 1 else ""
    if want not in log:
        sys.exit(f"bench_multihost: {name}: rank 0 did not say '{want}':\n{log[-1500:]}")


def run_training(args, root, hosts, model, data, name, per_host, n_hosts):
    """One run; its steady samples/s from progress.db (warm-up steps left out)."""
    world = per_host * n_hosts
    ckpt = os.path.join(root, name.replace(" ", "-").replace("+", "p"))
    flags = train_flags(args, model, data, ckpt, world)
    if n_hosts == 1:
        bt.run_child([tu.binary("astrai-train"), f"--nprocs={world}"] + flags, ckpt + ".log", 1)
        with open(ckpt + ".log") as f:
            err = f.read()
    else:
        res = tm.finish(tm.start_nodes(hosts, per_host, flags), 900)
        for node, (rc, e) in res.items():
            if rc:
                sys.exit(f"bench_multihost: {name} node {node} exited {rc}:\n{e[-3000:]}")
        err = res[0][1]
    check_backend(name, world, err)
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        rows = db.execute("SELECT loss, wall_time FROM steps ORDER BY step").fetchall()
    shape = types.SimpleNamespace(warmup=args.warmup, batch=args.batch * world, window=args.window)
    rate = bt.steady_rate([w for _, w in rows], [l for l, _ in rows], shape)
    return {"ranks": world, "hosts": n_hosts,
            "samples_per_s": rate["tokens_per_s"] / args.window,
            "samples_per_s_best_step": rate["tokens_per_s_best_step"] / args.window,
            "step_s_mean": rate["seconds"] / rate["steps"], "loss_last": rate["loss_last"]}


def training_scaling(args, root, hosts):
    """Every run of RUNS on one model and dataset; efficiency against the one-rank run."""
    model = bt.make_model(args.build, root, bp.MODELS["small"])
    data = bt.make_dataset(root, (args.warmup + args.steps) * args.batch * 4, args.window)
    out = {name: run_training(args, root, hosts, model, data, name, k, n) for name, k, n in RUNS}
    one = out["shm 1"]["samples_per_s"]
    for r in out.values():
        r["efficiency"] = r["samples_per_s"] / (r["ranks"] * one)
    return out


def print_training(args, runs):
    """The scaling table."""
    print(f"\nddp training, bench_pref's small model (7.0M params), {args.batch} windows of "
          f"{args.window} per rank per step, threads=1 per rank, {args.steps} timed steps after "
          f"{args.warmup} warm-up")
    print(f"{'run':>10} {'ranks':>5} {'samples/s':>10} {'best step':>10} {'step s':>8} "
          f"{'efficiency':>10}")
    for name, r in runs.items():
        print(f"{name:>10} {r['ranks']:>5} {r['samples_per_s']:>10.1f} "
              f"{r['samples_per_s_best_step']:>10.1f} {r['step_s_mean']:>8.3f} "
              f"{100 * r['efficiency']:>9.0f}%")
    cores = os.cpu_count()
    if cores < 4:
        print(f"note: this machine has {cores} cores: the 4-rank runs oversubscribe them "
              f"(efficiency <= {cores}/4 at best)")


# ------------------------------------------------------------------ all_reduce bandwidth


def parse_busbw(text, backend):
    """{MiB: busbw GB/s} from bench_comm's all_reduce table of backend."""
    table = text[text.index(f"{backend} all_reduce"):]
    rows = re.findall(r"^\s*(\d+) MiB\s+[\d.]+\s+([\d.]+)", table, re.M)
    return {int(m): float(bw) for m, bw in rows[:len(SIZES_MIB)]}


def shm_busbw():
    """bench_comm's shm all_reduce (2 forked ranks on this host)."""
    out = subprocess.run([tu.binary("bench_comm")], capture_output=True, text=True, check=True,
                         timeout=600)
    return parse_busbw(out.stdout, "shm")


def gloo_busbw(hosts):
    """bench_comm --backend gloo, rank r on host r."""
    procs = [h.popen([tu.binary("bench_comm"), "--backend", "gloo", "--rank", str(h.index),
                      "--world", str(len(hosts)), "--master", f"{hosts[0].addr}:{GLOO_PORT}"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in hosts]
    outs = [p.communicate(timeout=600) for p in procs]
    for h, p, (_, err) in zip(hosts, procs, outs):
        if p.returncode:
            sys.exit(f"bench_multihost: gloo rank {h.index} exited {p.returncode}:\n{err}")
    return parse_busbw(outs[0][0], "gloo")


def tcp_plan():
    """(MiB, both directions, reps) of the TCP stream, the same on both sides."""
    return [(m, both, max(3, min(20, 512 // m))) for m in SIZES_MIB for both in (False, True)]


def recv_exact(sock, view):
    """Fills view from sock."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def tcp_rep(sock, role, buf, sink, n, both):
    """One transfer of n bytes (client: to the server; both: each way at once); client's time."""
    view, ack = memoryview(buf)[:n], bytearray(1)
    t = time.perf_counter()
    if role == "client":
        sock.sendall(b"g")
    else:
        recv_exact(sock, memoryview(ack))
    sender = None
    if both or role == "client":
        sender = threading.Thread(target=sock.sendall, args=(view,))
        sender.start()
    if both or role == "server":
        recv_exact(sock, memoryview(sink)[:n])
    if sender:
        sender.join()
    if role == "server":
        sock.sendall(b"a")
    else:
        recv_exact(sock, memoryview(ack))
    return time.perf_counter() - t


def tcp_connect(role, addr, port):
    """The worker's one connection: the server listens on port, the client retries for 30 s."""
    if role == "server":
        with socket.create_server((addr, port)) as srv:
            srv.settimeout(60)
            return srv.accept()[0]
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection((addr, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def tcp_worker(role, addr, port):
    """One side of the TCP stream over tcp_plan(); the client prints the best times (JSON)."""
    sock = tcp_connect(role, addr, int(port))
    sock.settimeout(120)
    buf, sink = bytearray(max(SIZES_MIB) << 20), bytearray(max(SIZES_MIB) << 20)
    best = {}
    for mib, both, reps in tcp_plan():
        times = [tcp_rep(sock, role, buf, sink, mib << 20, both) for _ in range(reps + 1)][1:]
        best[f"{mib} {'both' if both else 'one'}"] = min(times)
    sock.close()
    if role == "client":
        print(json.dumps(best))


def tcp_bandwidth(hosts):
    """{MiB: (one-way GB/s, per-direction GB/s with both at once)} host 0 -> host 1."""
    me = [sys.executable, os.path.abspath(__file__), "--tcp-worker"]
    server = hosts[1].popen(me + ["server", hosts[1].addr, str(TCP_PORT)])
    client = hosts[0].popen(me + ["client", hosts[1].addr, str(TCP_PORT)],
                            stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=600)
    if server.wait(timeout=60) or client.returncode:
        sys.exit(f"bench_multihost: tcp stream failed ({server.returncode}, {client.returncode})")
    best = json.loads(out)
    return {m: ((m << 20) / best[f"{m} one"] / 1e9, (m << 20) / best[f"{m} both"] / 1e9)
            for m in SIZES_MIB}


def print_comm(shm, gloo, tcp):
    """The bandwidth table and its ratios."""
    print("\nall_reduce (AVG, fp32) bus bandwidth, 2 ranks, GB/s (busbw = 2(n-1)/n bytes/time = "
          "bytes/time); tcp: one stream host 0 -> host 1, and both directions at once (per "
          "direction)")
    print(f"{'size':>8} {'shm 1 host':>11} {'gloo 2 hosts':>13} {'tcp one-way':>12} "
          f"{'tcp both':>9} {'gloo/shm':>9} {'gloo/tcp':>9}")
    for m in SIZES_MIB:
        one, both = tcp[m]
        print(f"{m:>4} MiB {shm[m]:>11.2f} {gloo[m]:>13.2f} {one:>12.2f} {both:>9.2f} "
              f"{gloo[m] / shm[m]:>9.2f} {gloo[m] / both:>9.2f}")
    print("gloo/tcp is against tcp both: a 2-rank all_reduce sends and receives `bytes` per rank "
          "at once")


def comm_bandwidth(hosts):
    """shm, gloo and tcp at every size; gloo and tcp between hosts 0 and 1."""
    return {"shm": shm_busbw(), "gloo": gloo_busbw(hosts), "tcp": tcp_bandwidth(hosts)}


# ------------------------------------------------------------------ main


def bench(args, root):
    """Both parts on two namespaced hosts; the results as one dict (also printed)."""
    tu.BUILD = os.path.abspath(args.build)
    result = {"load_average_start": os.getloadavg(), "cpu_count": os.cpu_count()}
    with nu.Hosts(2) as hosts:
        if not args.skip_train:
            result["training"] = training_scaling(args, root, hosts)
        if not args.skip_comm:
            result["all_reduce"] = comm_bandwidth(hosts)
    result["load_average_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if "training" in result:
        print_training(args, result["training"])
    if "all_reduce" in result:
        print_comm(**result["all_reduce"])
    print(f"load average: {result['load_average_start'][0]:.1f} at the start, "
          f"{result['load_average_end'][0]:.1f} at the end")
    return result


def main(argv):
    args = parse_args(argv)
    if args.tcp_worker:
        return tcp_worker(*args.tcp_worker)
    root = args.workdir or tempfile.mkdtemp(prefix="astrai-bench-multihost-")
    os.makedirs(root, exist_ok=True)
    try:
        bench(args, root)
    except nu.Unavailable as e:
        sys.exit(f"bench_multihost: no namespaced hosts here: {e}")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
