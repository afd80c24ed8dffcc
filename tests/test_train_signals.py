"""astrai-train stopped before its end exits 3 (EXIT_INTERRUPTED) after a checkpoint at the step
it stopped, and --resume then completes with exit 0 on the curve of a straight run:
- one rank: SIGTERM and SIGINT; --max_steps is the run's end (exit 0, not 3);
- 2-rank ddp under the local launcher: SIGTERM to rank 1 only (the ranks agree on the stop, and
  the launcher exits 3), and SIGTERM to the launcher;
- 2 ranks started by hand (RANK/WORLD_SIZE): SIGTERM to rank 1: both processes exit 3;
- what a writer killed mid-checkpoint leaves in ckpt_dir (a `.tmp-*` directory; the `.old-*` of
  a replace cut between its renames) is settled when the next run starts, with a line saying
  what was done, and that run resumes from the last complete checkpoint."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import test_launch_util as lu
import train_util as tu
from test_parallel_signals import rank_of
from test_train_resume import signal_at_step

WINDOW = 32
N_BYTES = 80 * WINDOW + 1  # 80 windows: 20 optimizer steps per epoch (global batch 4)
EPOCHS = 6
INTERRUPTED = 3


def args(model, data, ckpt, nprocs=1, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "parallel_mode": "ddp" if nprocs > 1 else "none", "nprocs": nprocs,
         "batch_per_device": 4 // nprocs, "window_size": WINDOW, "ckpt_dir": ckpt,
         "max_lr": 3e-3, "threads": 1, "ckpt_interval": 1000, "n_epoch": EPOCHS,
         "comm_timeout": 60}
    a.update(extra)
    return [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]


def step_of(path):
    return int(path.rsplit("_", 1)[1])


def stopped_step(err):
    """The step of the "stopped at step N of M" line (None if absent)."""
    m = re.search(r"stopped at step (\d+) of (\d+)", err)
    return int(m.group(1)) if m else None


def interrupt(cmd, ckpt, sig, target=None, env=None):
    """Starts cmd, sends sig to target(proc) (the process itself by default) at its third
    step; returns (exit code, stderr)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    if not signal_at_step(proc, ckpt, 3, sig, target):
        proc.kill()
        return None, proc.communicate()[1]
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def check_stop(name, rc, err, ckpt, failures):
    """Exit 3, one stop, a checkpoint at that step before the end. Returns whether there is a
    checkpoint to resume from."""
    step = stopped_step(err)
    latest = tu.latest_checkpoint(ckpt) if os.path.isdir(ckpt) and \
        any(n.startswith("epoch_") for n in os.listdir(ckpt)) else None
    if rc != INTERRUPTED:
        failures.append(f"{name}: exit {rc}, expected {INTERRUPTED}: {err[-400:]}")
    elif step is None or err.count("stopped at step") != 1 or not latest or \
            step_of(latest) != step or not 3 <= step < 20 * EPOCHS:
        failures.append(f"{name}: stop at step {step}, checkpoint {latest}: {err[-400:]}")
    else:
        print(f"{name}: exit 3 at step {step}, checkpoint {os.path.basename(latest)}")
    return latest is not None


def check_resumed(name, cmd, ckpt, straight, failures, env=None):
    """--resume runs to the end (exit 0) on the straight run's curve. Returns stderr."""
    proc = subprocess.run(cmd + ["--resume=true"], capture_output=True, text=True, env=env,
                          timeout=300)
    if proc.returncode != 0:
        failures.append(f"{name}: resume exit {proc.returncode}: {proc.stderr[-400:]}")
        return proc.stderr
    a, b = tu.latest_checkpoint(straight), tu.latest_checkpoint(ckpt)
    if os.path.basename(a) != os.path.basename(b) or tu.metric_rows(a) != tu.metric_rows(b):
        failures.append(f"{name}: resumed to {os.path.basename(b)}, which differs from the "
                        f"straight run's {os.path.basename(a)}")
    else:
        print(f"{name}: resumed with exit 0 to {os.path.basename(b)} = the straight run")
    return proc.stderr


def check_single(root, model, data, failures):
    straight = os.path.join(root, "straight-1")
    tu.run(args(model, data, straight))
    for sig in (signal.SIGTERM, signal.SIGINT):
        name = f"one rank, {sig.name}"
        ck = os.path.join(root, f"single-{sig.name}")
        rc, err = interrupt(args(model, data, ck), ck, sig)
        if check_stop(name, rc, err, ck, failures):
            check_resumed(name, args(model, data, ck), ck, straight, failures)
    ck = os.path.join(root, "max-steps")
    _, err = tu.run(args(model, data, ck, max_steps=5))  # asserts exit 0
    if stopped_step(err) != 5 or step_of(tu.latest_checkpoint(ck)) != 5:
        failures.append(f"max_steps: {err[-300:]}")
    print("max_steps=5: exit 0 with a checkpoint at step 5")


def plant_leftovers(ck, failures):
    """What a writer killed mid-checkpoint leaves: a half-written .tmp-* directory, and the
    last checkpoint moved aside under .old-* by a replace cut between its renames. Returns the
    paths the next run must settle."""
    latest = tu.latest_checkpoint(ck)
    tmp = os.path.join(ck, ".tmp-epoch_9_step_199-2147483000")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 100000)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        f.write('{"epoch": 9, "consumed_sam')
    with open(os.path.join(tmp, ".astrai-tmp"), "w") as f:  # astrai's marker of its temp dirs
        f.write("astrai: a checkpoint being written or removed\n")
    old = os.path.join(ck, f".old-{os.path.basename(latest)}-2147483000")
    os.rename(latest, old)
    if [n for n in os.listdir(ck) if n.startswith("epoch_")]:
        failures.append("leftovers: another checkpoint than the one moved aside")
    return tmp, old, latest


def check_ddp_rank_signal(root, model, data, straight, failures):
    name = "ddp, SIGTERM to rank 1 only"
    ck = os.path.join(root, "ddp-rank1")
    cmd = args(model, data, ck, nprocs=2)

    def rank1(proc):
        return {rank_of(p): p for p in lu.children(proc.pid)}[1]

    rc, err = interrupt(cmd, ck, signal.SIGTERM, target=rank1)
    if not check_stop(name, rc, err, ck, failures):
        return
    tmp, old, latest = plant_leftovers(ck, failures)
    err = check_resumed(name + ", leftovers planted", cmd, ck, straight, failures)
    lines = [line for line in err.splitlines() if line.startswith("ckpt_dir cleanup:")]
    want = [f"removed {tmp} (", f"restored {latest} from {old} ("]
    if any(not any(w in line for line in lines) for w in want) or len(lines) != 2:
        failures.append(f"leftovers: cleanup lines {lines}, expected {want}")
    if os.path.exists(tmp) or os.path.exists(old):
        failures.append(f"leftovers still in {ck}: {sorted(os.listdir(ck))}")
    if f"resuming from {latest}: step {step_of(latest)}" not in err:
        failures.append(f"leftovers: did not resume from {latest}: {err[-400:]}")
    else:
        print(f"leftovers settled ({len(lines)} lines); resumed from {os.path.basename(latest)}")


def check_ddp_launcher_signal(root, model, data, straight, failures):
    name = "ddp, SIGTERM to the launcher"
    ck = os.path.join(root, "ddp-launcher")
    cmd = args(model, data, ck, nprocs=2)
    rc, err = interrupt(cmd, ck, signal.SIGTERM)
    if check_stop(name, rc, err, ck, failures):
        check_resumed(name, cmd, ck, straight, failures)


def check_by_hand(root, model, data, failures):
    """Two ranks started by hand: SIGTERM to rank 1 alone; every process must exit 3."""
    ck = os.path.join(root, "by-hand")
    cmd = args(model, data, ck, nprocs=2)
    port = str(tu.free_port())
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port,
                                       MASTER_ADDR="127.0.0.1"))
             for r in range(2)]
    if not signal_at_step(procs[0], ck, 3, signal.SIGTERM, lambda _: procs[1].pid,
                          [p.pid for p in procs]):
        failures.append("by hand: the run did not reach step 3")
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = [rc for rc, _ in results]
    step = stopped_step(results[0][1])
    if codes != [INTERRUPTED, INTERRUPTED] or step is None or \
            step_of(tu.latest_checkpoint(ck)) != step:
        failures.append(f"by hand: exits {codes}, stop at {step}: {results[0][1][-300:]} "
                        f"{results[1][1][-300:]}")
    else:
        print(f"by hand, SIGTERM to rank 1: both ranks exit 3 at step {step}")


def check_stop_while_meeting(root, model, data, failures):
    """Rank 0 of two started alone waits in the rendezvous for a rank that never comes (its
    launcher died, say): SIGTERM makes it give up at once and exit 3, not wait out the
    rendezvous timeout."""
    ck = os.path.join(root, "meeting")
    port = tu.free_port()
    proc = subprocess.Popen(args(model, data, ck, nprocs=2), stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port)))
    lu.wait_listening(port, proc)  # past the setup: rank 0 listens in the rendezvous
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        failures.append("a rank waiting in the rendezvous ignored SIGTERM for 30 s")
        return
    err = proc.stderr.read()
    if rc != INTERRUPTED or "rendezvous" not in err:
        failures.append(f"stopped in the rendezvous: exit {rc}, {err[-300:]!r}")
    else:
        print(f"SIGTERM in the rendezvous: exit 3 after {time.time() - t0:.2f} s")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    check_single(root, model, data, failures)
    straight = os.path.join(root, "straight-2")
    tu.run(args(model, data, straight, nprocs=2))
    check_ddp_rank_signal(root, model, data, straight, failures)
    check_ddp_launcher_signal(root, model, data, straight, failures)
    check_by_hand(root, model, data, failures)
    check_stop_while_meeting(root, model, data, failures)
    if not failures:
        shutil.rmtree(root)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
