"""Multi-rank runs under signals and external launchers (real processes, real signals):
- SIGTERM to the launcher mid-run: every rank stops at the same step, rank 0 checkpoints, all
  exit 3 (interrupted), and --resume continues the very same curve;
- kill -9 of one rank: the other exits with a clear error naming the dead rank well within the
  timeout, the launcher fails, and no rank process or shm segment is left behind;
- the same two under a pipeline of 3 stages (kill -9 of the middle stage: the error names the
  stage and the dead peer);
- external launch (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand, and SLURM variables):
  two processes train together like one rank with the global batch; a wrong WORLD_SIZE or an
  unreachable master is a clear error after the rendezvous timeout."""

import os
import signal
import subprocess
import sys
import time

import train_util as tu
from test_launch_util import children
from test_train_resume import signal_at_step, wait_for_step

WINDOW = 32
N_BYTES = 80 * WINDOW + 1


def args(model, data, ckpt, mode="ddp", nprocs=2, batch=2, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "parallel_mode": mode, "nprocs": nprocs, "batch_per_device": batch,
         "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3, "threads": 1,
         "ckpt_interval": 1000, "comm_timeout": 60}
    a.update(extra)
    return [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]


def rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"])


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("astrai")}


def check_sigterm(root, model, data, failures, name="sigterm", **extra):
    extra = dict({"n_epoch": 6}, **extra)
    straight = os.path.join(root, name + "-straight")
    tu.run(args(model, data, straight, **extra))
    ck = os.path.join(root, name)
    proc = subprocess.Popen(args(model, data, ck, **extra), stderr=subprocess.PIPE, text=True)
    if not signal_at_step(proc, ck, 4, signal.SIGTERM):
        failures.append("sigterm: the run did not reach step 4")
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 3:
        failures.append(f"sigterm: launcher exit {proc.returncode}, expected 3: {err[-400:]}")
    stop = tu.latest_checkpoint(ck)
    step = int(stop.rsplit("_", 1)[1])
    if err.count("stopped at step") != 1 or f"stopped at step {step} " not in err:
        failures.append(f"sigterm: expected one stop at step {step}: {err[-400:]}")
    tu.run(args(model, data, ck, resume="true", **extra))
    a, b = tu.latest_checkpoint(straight), tu.latest_checkpoint(ck)
    if tu.metric_rows(a) != tu.metric_rows(b):
        failures.append(f"sigterm at step {step} + resume differs from the straight run")
    print(f"SIGTERM ({name}): every rank stopped at step {step}; resumed to "
          f"{os.path.basename(b)}")


def check_kill9(root, model, data, failures, name="kill9", victim=1, named=("rank 1",), **extra):
    before = shm_segments()
    ck = os.path.join(root, name)
    proc = subprocess.Popen(args(model, data, ck, **dict({"n_epoch": 50, "comm_timeout": 30},
                                                          **extra)),
                            stderr=subprocess.PIPE, text=True)
    if not wait_for_step(ck, 2, proc):
        failures.append("kill -9: the run did not reach step 2")
    ranks = {rank_of(p): p for p in children(proc.pid)}
    os.kill(ranks[victim], signal.SIGKILL)
    t0 = time.time()
    _, err = proc.communicate(timeout=120)
    took = time.time() - t0
    if proc.returncode == 0:
        failures.append("kill -9: the launcher exited 0")
    if any(n not in err for n in named) or took > 30:
        failures.append(f"kill -9 ({name}): no clear error naming {named} within the timeout "
                        f"({took:.1f} s): {err[-600:]}")
    left = [p for p in ranks.values() if alive(p)]
    if left:
        failures.append(f"kill -9: rank processes left: {left}")
    if shm_segments() - before:
        failures.append(f"kill -9: shm segments left: {shm_segments() - before}")
    print(f"kill -9 of rank {victim} ({name}): launcher exit {proc.returncode} after "
          f"{took:.1f} s: {[l for l in err.splitlines() if 'rank' in l][:4]}")


def external(cmd, env_list, timeout=300):
    procs = [subprocess.Popen(cmd, env=dict(os.environ, **e), stderr=subprocess.PIPE, text=True)
             for e in env_list]
    return [(p.wait(timeout=timeout), p.stderr.read()) for p in procs]


def check_external(root, model, data, failures, name="ext", **job):
    """Two processes launched by hand (torchrun's and srun's variables) train like the local
    launch: the job (fsdp over 2 ranks by default) gives none's curve for the same batch."""
    job = job or {"mode": "fsdp"}
    none = os.path.join(root, "ext-none")
    if not os.path.isdir(none):
        tu.run(args(model, data, none, mode="none", nprocs=1, batch=4))
    base = tu.metric_rows(tu.latest_checkpoint(none))
    for style in ("torchrun", "slurm"):
        port = tu.free_port()
        ck = os.path.join(root, f"{name}-{style}")
        envs = []
        for r in range(2):
            e = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            if style == "torchrun":
                e.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2")
            else:
                e.update(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r))
            envs.append(e)
        results = external(args(model, data, ck, **job), envs)
        if any(rc != 0 for rc, _ in results):
            failures.append(f"external {style} {job}: exits {[rc for rc, _ in results]}: "
                            f"{results[0][1][-300:]} {results[1][1][-300:]}")
            continue
        rows = tu.metric_rows(tu.latest_checkpoint(ck))
        worst = max(tu.rel_err(a["loss"], b["loss"]) for a, b in zip(rows, base))
        if len(rows) != len(base) or worst > 1e-5:
            failures.append(f"external {style} {job}: curve differs from none ({worst:.2e})")
        print(f"external launch ({style}, {job}): {len(rows)} steps, worst difference "
              f"{worst:.2e}")


def check_external_errors(root, model, data, failures):
    env = {"ASTRAI_RENDEZVOUS_TIMEOUT_S": "3"}
    port = tu.free_port()
    ck = os.path.join(root, "ext-bad")
    common = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t0 = time.time()
    results = external(args(model, data, ck),
                       [dict(common, RANK="0", WORLD_SIZE="2"),
                        dict(common, RANK="1", WORLD_SIZE="3")], timeout=60)
    took = time.time() - t0
    for r, (rc, err) in enumerate(results):
        if rc == 0 or "WORLD_SIZE" not in err:
            failures.append(f"wrong WORLD_SIZE: rank {r} exit {rc}: {err[-300:]}")
    print(f"wrong WORLD_SIZE: exits {[rc for rc, _ in results]} after {took:.1f} s: "
          f"{results[0][1].strip().splitlines()[-1]}")
    t0 = time.time()
    (rc, err), = external(args(model, data, ck),
                          [dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(tu.free_port()),
                                RANK="1", WORLD_SIZE="2")], timeout=60)
    took = time.time() - t0
    if rc == 0 or "127.0.0.1" not in err or not 2.5 <= took <= 30:
        failures.append(f"unreachable master: exit {rc} after {took:.1f} s: {err[-300:]}")
    print(f"unreachable master: exit {rc} after {took:.1f} s: {err.strip().splitlines()[-1]}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    check_sigterm(root, model, data, failures)
    check_kill9(root, model, data, failures)
    # Pipelines (docs/design.md §13): 3 stages of a 4-block model; rank 1 is the middle stage.
    deep = tu.make_model(os.path.join(root, "deep"), dict(tu.SMALL_CONFIG, num_hidden_layers=4))
    check_sigterm(root, deep, data, failures, "sigterm-pp", mode="none", nprocs=3, pp_size=3,
                  grad_accum_steps=4, batch=1)
    # The launcher names the stage whichever collective the others were in when they found
    # the rank gone (a transfer of the pipeline or the step's sums).
    check_kill9(root, deep, data, failures, "kill9-pp", victim=1,
                named=("rank 1 (pipeline stage 1 of 3",),
                mode="none", nprocs=3, pp_size=3, grad_accum_steps=4, batch=1)
    check_external(root, model, data, failures)
    check_external(root, model, data, failures, "ext-pp", mode="none", pp_size=2, batch=4)
    check_external_errors(root, model, data, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
