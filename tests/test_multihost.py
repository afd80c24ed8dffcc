"""Ranks on several hosts (network namespaces with their own /dev/shm and host name,
tests/netns_util.py), started as torchrun starts them: one `astrai-train --nnodes N --node_rank R
--nproc_per_node K --master_addr A` per host. Across hosts the CPU collectives are Gloo's:
- ddp, fsdp and pp 2 with ranks on two hosts (1+1 and 2+2), bf16, and experts over both hosts
  (ep_size 2: all-to-all) train the one-host curve (reduction-order noise); --backend gloo on
  one host trains shm's curve;
- a two-host checkpoint resumes on one host, and a one-host checkpoint on two hosts;
- SIGTERM to one node's launcher stops every rank of every node at one step with one
  checkpoint, and --resume completes the straight curve;
- a node that never starts: the other fails after the rendezvous timeout naming the node;
  a node killed mid-run, or its link cut, fails the others within the collective timeout
  naming the peer, never a hang; the checkpoint before is intact and resume is exact;
- sharded checkpoints refuse a ckpt_dir that one host does not share, naming it.
Skipped (exit 77) where namespaces cannot be made."""

import os
import re
import signal
import subprocess
import sys
import time

import netns_util as nu
import test_launch_util as lu
import train_util as tu
from test_parallel import MOE_MLA_CONFIG
from test_train_resume import wait_for_step

WINDOW = 32
N_BYTES = 48 * WINDOW + 1  # 48 windows: 12 optimizer steps of global batch 4
SKIP = 77
PORT = 29611  # inside the namespaces nothing else listens


def flags(model, data, ckpt, mode, world, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "parallel_mode": mode, "batch_per_device": 4 // (world // extra.get("pp_size", 1)),
         "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3, "threads": 1,
         "ckpt_interval": 4, "comm_timeout": 20}
    a.update(extra)
    return [f"--{k}={v}" for k, v in a.items()]


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", ASTRAI_RENDEZVOUS_TIMEOUT_S="60")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def start_nodes(hosts, per_node, args, environ=None, nodes=None):
    """One launcher per host (or per host of `nodes`, their node ranks): {node: Popen}."""
    procs = {}
    for node in (range(len(hosts)) if nodes is None else nodes):
        cmd = [tu.binary("astrai-train"), f"--nnodes={len(hosts)}", f"--node_rank={node}",
               f"--nproc_per_node={per_node}", f"--master_addr={hosts[0].addr}",
               f"--master_port={PORT}"] + args
        procs[node] = hosts[node].popen(cmd, env=environ or env(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
    return procs


def finish(procs, timeout=300):
    """{node: (exit code, stderr)}; a launcher that does not end in time fails the test."""
    out = {}
    for node, p in procs.items():
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise AssertionError(f"node {node} did not exit within {timeout} s")
        out[node] = (p.returncode, err)
    return out


def run_nodes(hosts, per_node, args, expect=0):
    res = finish(start_nodes(hosts, per_node, args))
    for node, (rc, err) in res.items():
        assert rc == expect, f"node {node}: exit {rc}, expected {expect}:\n{err[-3000:]}"
    return res


def compare(a, b, what, failures, tol=1e-5):
    ra, rb = tu.metric_rows(tu.latest_checkpoint(a)), tu.metric_rows(tu.latest_checkpoint(b))
    if len(ra) != len(rb) or not ra:
        failures.append(f"{what}: {len(ra)} vs {len(rb)} steps")
        return
    worst = max(tu.rel_err(x[k], y[k]) for x, y in zip(ra, rb) for k in ("loss", "grad_norm"))
    if worst > tol or [x["step"] for x in ra] != [y["step"] for y in rb]:
        failures.append(f"{what}: curves differ by {worst:.2e} relative (> {tol})")
    print(f"{what}: {len(ra)} steps, worst relative difference {worst:.2e}")


def one_host(model, data, ckpt, mode, world, **extra):
    tu.run([tu.binary("astrai-train"), f"--nprocs={world}"] +
           flags(model, data, ckpt, mode, world, **extra), env=env())
    return ckpt


def check_curves(hosts, root, model, moe_model, data, failures):
    """(mode, ranks per node, model, flags): the modes, a 2-byte dtype, and experts (all-to-all)."""
    cases = (("ddp", 1, model, {}), ("fsdp", 1, model, {}), ("ddp", 1, model, {"pp_size": 2}),
             ("ddp", 2, model, {}), ("fsdp", 2, model, {}), ("fsdp", 1, model, {"dtype": "bf16"}),
             ("ddp", 1, moe_model, {"ep_size": 2}))
    for mode, per_node, m, extra in cases:
        world = per_node * len(hosts)
        name = "-".join([mode, f"{per_node}x{len(hosts)}"] + [f"{k}{v}" for k, v in extra.items()])
        base = one_host(m, data, os.path.join(root, name + "-one"), mode, world, **extra)
        two = os.path.join(root, name)
        res = run_nodes(hosts, per_node, flags(m, data, two, mode, world, **extra))
        want = f" {world} ranks on 2 hosts: {hosts[0].name} (rank"
        if not re.search(r"collectives: \w+," + re.escape(want), res[0][1]):
            failures.append(f"{name}: node 0 did not say '{want}':\n{res[0][1][-1000:]}")
        compare(two, base, f"{name} on two hosts vs one host", failures)


def check_backend_gloo_one_host(root, model, data, failures):
    shm = one_host(model, data, os.path.join(root, "shm"), "ddp", 2)
    gloo = os.path.join(root, "gloo")
    _, err = tu.run([tu.binary("astrai-train"), "--nprocs=2", "--backend=gloo"] +
                    flags(model, data, gloo, "ddp", 2), env=env())
    if "collectives: gloo, 2 ranks on one host" not in err:
        failures.append(f"--backend gloo did not use gloo:\n{err[-1000:]}")
    compare(gloo, shm, "--backend gloo vs shm on one host", failures)
    return shm


def check_resume_across(hosts, root, model, data, straight, failures):
    """Steps 1..4 on two hosts, then 5..12 on one; and the other way round."""
    for first, then in (("two", "one"), ("one", "two")):
        ckpt = os.path.join(root, f"resume-{first}-{then}")
        args = flags(model, data, ckpt, "ddp", 2)
        if first == "two":
            run_nodes(hosts, 1, args + ["--max_steps=4"])
            one_host(model, data, ckpt, "ddp", 2, resume="true")
        else:
            one_host(model, data, ckpt, "ddp", 2, max_steps=4)
            run_nodes(hosts, 1, args + ["--resume=true"])
        compare(ckpt, straight, f"{first} host(s) then {then} host(s) vs straight", failures)


def check_sigterm_one_node(hosts, root, model, data, straight, failures):
    ckpt = os.path.join(root, "sigterm")
    args = flags(model, data, ckpt, "ddp", 2)
    procs = start_nodes(hosts, 1, args)
    if wait_for_step(ckpt, 3, procs[0]):
        ranks = [c for p in procs.values() for c in lu.children(p.pid)]
        with lu.Held(ranks) as held:
            procs[1].send_signal(signal.SIGTERM)
            held.wait_signal(signal.SIGTERM)
    else:
        failures.append("sigterm: the run did not reach step 3")
    res = finish(procs)
    if any(rc != 3 for rc, _ in res.values()):
        failures.append(f"sigterm: exits {[rc for rc, _ in res.values()]}, expected 3 and 3:\n"
                        + "\n".join(e[-800:] for _, e in res.values()))
    stop = re.search(r"stopped at step (\d+) of", res[0][1])
    last = int(tu.latest_checkpoint(ckpt).rsplit("_", 1)[1])
    if not stop or int(stop.group(1)) != last:
        failures.append(f"sigterm: the stop's checkpoint is not the last one ({last}):\n"
                        f"{res[0][1][-800:]}")
    run_nodes(hosts, 1, args + ["--resume=true"])
    compare(ckpt, straight, "SIGTERM on node 1, resumed, vs straight", failures)


def check_node_never_starts(hosts, root, model, data, failures):
    ckpt = os.path.join(root, "alone")
    procs = start_nodes(hosts, 2, flags(model, data, ckpt, "ddp", 4),
                        env(ASTRAI_RENDEZVOUS_TIMEOUT_S=3), nodes=[0])
    rc, err = finish(procs)[0]
    want = "missing: rank 2, 3; node rank 1 never arrived"
    if rc != 1 or want not in err:
        failures.append(f"node never starts: exit {rc}, want '{want}':\n{err[-1500:]}")


def node_processes(proc):
    return [proc.pid] + lu.children(proc.pid)


def check_node_lost(hosts, root, model, data, straight, how, failures):
    """Node 1 killed (SIGKILL to its launcher and ranks) or its link cut at step 3: node 0
    fails within the collective timeout naming rank 1; the checkpoint of step 4 or the one
    before is intact, and resuming it on two hosts completes the straight curve."""
    ckpt = os.path.join(root, f"lost-{how}")
    args = flags(model, data, ckpt, "ddp", 2, ckpt_interval=2, comm_timeout=5)
    procs = start_nodes(hosts, 1, args)
    if not wait_for_step(ckpt, 3, procs[0]):
        failures.append(f"{how}: the run did not reach step 3")
    if how == "kill":
        for pid in node_processes(procs[1]):
            os.kill(pid, signal.SIGKILL)
    else:
        hosts[1].link_down()
    start = time.monotonic()
    rc0, err0 = finish({0: procs[0]}, timeout=120)[0]
    took = time.monotonic() - start
    if how != "kill":
        rc1, err1 = finish({1: procs[1]}, timeout=120)[1]
        hosts[1].link_up()
        if rc1 == 0:
            failures.append(f"{how}: node 1 finished its run with its link down:\n{err1[-800:]}")
    else:
        procs[1].wait(timeout=60)
    # The failure names the peer: its rank and its host.
    named = [l for l in err0.splitlines()
             if l.startswith("astrai-train:") and "rank 1" in l and hosts[1].name in l]
    if rc0 == 0 or not named:
        failures.append(f"{how}: node 0 exit {rc0}, want a failure naming rank 1 on "
                        f"{hosts[1].name}:\n{err0[-1500:]}")
    print(f"{how}: node 0 failed {took:.1f} s after (comm_timeout 5 s): {named[:1]}")
    run_nodes(hosts, 1, args + ["--resume=true"])
    compare(ckpt, straight, f"node lost ({how}), resumed, vs straight", failures)


def check_unshared_ckpt_dir(hosts, root, model, data, failures):
    ckpt = os.path.join(root, "sharded")
    os.makedirs(ckpt)
    # Host 1 sees its own empty tmpfs there: a directory that is not shared.
    hosts[1].run(["mount", "-t", "tmpfs", "tmpfs", ckpt], check=True)
    res = finish(start_nodes(hosts, 1, flags(model, data, ckpt, "fsdp", 2,
                                             ckpt_format="sharded")))
    want = f"is not the same directory on every host: rank 1 ({hosts[1].name}) cannot read"
    if not any(rc != 0 and want in err for rc, err in res.values()):
        failures.append(f"unshared ckpt_dir: want '{want}':\n"
                        + "\n".join(f"exit {rc}: {e[-800:]}" for rc, e in res.values()))
    hosts[1].run(["umount", ckpt], check=True)


def main():
    root = tu.tmpdir()
    failures = []
    model = tu.make_model(root)
    moe_model = tu.make_model(os.path.join(root, "moe"), MOE_MLA_CONFIG)
    data, _ = tu.make_text_data(root, N_BYTES)
    try:
        with nu.Hosts(2) as hosts:
            straight = check_backend_gloo_one_host(root, model, data, failures)
            check_curves(hosts, root, model, moe_model, data, failures)
            check_resume_across(hosts, root, model, data, straight, failures)
            check_sigterm_one_node(hosts, root, model, data, straight, failures)
            check_node_never_starts(hosts, root, model, data, failures)
            check_node_lost(hosts, root, model, data, straight, "kill", failures)
            check_node_lost(hosts, root, model, data, straight, "link", failures)
            check_unshared_ckpt_dir(hosts, root, model, data, failures)
    except nu.Unavailable as e:
        print(f"SKIP: network namespaces unavailable: {e}")
        return SKIP
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
