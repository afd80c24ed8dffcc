#!/usr/bin/python3
"""bench_comm_hier: fp32 all_reduce time of flat "gloo" against "hier" (shm within a host,
gloo between hosts) for 4 ranks as 2 hosts x 2, side by side, with hier/gloo ratios.

Each host is a network namespace (tests/netns_util.py: its own address, /dev/shm and veth link
to a bridge), so the cross-host traffic goes over TCP between namespaces; without namespaces
(not root) the two "hosts" share 127.0.0.1 and the table says so. The ranks are
bench_comm_hier_rank processes; they meet through a file exchange in a temporary directory.

    /usr/bin/python3 bench/bench_comm_hier.py --build build [--reps 5] [--mib 1 16 64]
"""

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import netns_util  # noqa: E402

HOST_OF = [0, 0, 1, 1]


def run_backend(exe, backend, hosts, args):
    """{MiB: (best s, median s)} of one backend's 4 ranks; hosts: (popen, addr) per host."""
    with tempfile.TemporaryDirectory(prefix="astrai-bench-hier-") as d:
        shm = "/" + os.path.basename(d)
        procs = []
        for rank, h in enumerate(HOST_OF):
            popen, addr = hosts[h]
            argv = [exe, backend, str(rank), ",".join(map(str, HOST_OF)), d, addr, shm,
                    str(args.reps)] + [str(m) for m in args.mib]
            procs.append(popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=600) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode:
            sys.exit(f"{backend} rank {rank} exited {p.returncode}: {err.strip()}")
    rows = (line.split() for line in outs[0][0].splitlines())
    return {int(m): (float(best), float(med)) for m, best, med in rows}


def report(times, where):
    print(f"all_reduce fp32 SUM, 4 ranks as 2 hosts x 2 ({where}); best / median of the reps")
    print(f"{'MiB':>5} {'gloo best':>10} {'hier best':>10} {'hier/gloo':>9}"
          f" {'gloo med':>10} {'hier med':>10} {'hier/gloo':>9}")
    for m in sorted(times["gloo"]):
        (gb, gm), (hb, hm) = times["gloo"][m], times["hier"][m]
        print(f"{m:>5} {gb * 1e3:>8.1f}ms {hb * 1e3:>8.1f}ms {hb / gb:>9.2f}"
              f" {gm * 1e3:>8.1f}ms {hm * 1e3:>8.1f}ms {hm / gm:>9.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    exe = os.path.abspath(os.path.join(args.build, "bench_comm_hier_rank"))
    try:
        with netns_util.Hosts(2) as hosts:
            on = [(h.popen, h.addr) for h in hosts]
            times = {b: run_backend(exe, b, on, args) for b in ("gloo", "hier")}
        where = "network namespaces, TCP over veth"
    except netns_util.Unavailable as e:
        on = [(subprocess.Popen, "127.0.0.1")] * 2
        times = {b: run_backend(exe, b, on, args) for b in ("gloo", "hier")}
        where = f"loopback: no namespaces ({e})"
    print(f"load average {os.getloadavg()[0]:.1f} (2 cores shared: numbers are noisy)")
    report(times, where)


if __name__ == "__main__":
    main()
