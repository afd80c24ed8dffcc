"""Resume: 20 steps straight, and 10 steps + --resume 10 more, give identical metric rows,
weights and progress rows; SIGTERM mid-run checkpoints, exits 3 (interrupted), and --resume
continues the same curve."""

import os
import signal
import sqlite3
import subprocess
import sys
import time

import test_launch_util as lu
import train_util as tu

WINDOW, BATCH = 32, 4
N_BYTES = 80 * WINDOW + 1  # 80 windows: 20 optimizer steps per epoch


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt, "ckpt_interval": 1000,
         "max_lr": 3e-3, "threads": 2}
    a.update(extra)
    return a


def weights(path):
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return f.read()


def progress_rows(ckpt_dir):
    db = sqlite3.connect(os.path.join(ckpt_dir, "progress.db"))
    rows = db.execute("SELECT step, epoch, consumed_samples, loss, lr, grad_norm FROM steps "
                      "ORDER BY step").fetchall()
    db.close()
    return rows


def check_max_steps_resume(root, model, data, failures):
    straight = os.path.join(root, "straight")
    tu.train(args(model, data, straight, n_epoch=2))
    split = os.path.join(root, "split")
    _, err = tu.train(args(model, data, split, n_epoch=2, max_steps=10))
    if "stopped at step 10 of 40" not in err:
        failures.append(f"max_steps run did not stop at step 10: {err[-300:]}")
    tu.train(args(model, data, split, n_epoch=2, resume="true"))
    a, b = tu.latest_checkpoint(straight), tu.latest_checkpoint(split)
    if os.path.basename(a) != os.path.basename(b) or os.path.basename(a) != "epoch_1_step_40":
        failures.append(f"final checkpoints {a} and {b}, expected epoch_1_step_40")
    if tu.metric_rows(a) != tu.metric_rows(b):
        failures.append("metric rows of the resumed run differ from the straight run")
    if weights(a) != weights(b):
        failures.append("final weights of the resumed run differ from the straight run")
    if progress_rows(straight) != progress_rows(split):
        failures.append("progress.db rows of the resumed run differ")
    if len(tu.metric_rows(b)) != 40:
        failures.append(f"{len(tu.metric_rows(b))} metric rows, expected 40")


def wait_for_step(ckpt_dir, step, proc, timeout=120):
    deadline = time.time() + timeout
    db_path = os.path.join(ckpt_dir, "progress.db")
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(db_path):
            try:
                db = sqlite3.connect(db_path, timeout=1)
                n = db.execute("SELECT count(*) FROM steps").fetchone()[0]
                db.close()
                if n >= step:
                    return True
            except sqlite3.OperationalError:
                pass
        time.sleep(0.05)
    return False


def signal_at_step(proc, ckpt_dir, step, sig, target=None, ranks=None):
    """Once the run of proc has reached `step`, sends sig to target(proc) (proc's pid by
    default) with its ranks held (lu.Held: ranks, by default a launcher's children or proc
    itself) until the signal is on its way to one of them: the run stops a step or so later,
    however fast the machine. False (nothing sent) when it did not reach step."""
    if not wait_for_step(ckpt_dir, step, proc):
        return False
    with lu.Held(ranks or lu.children(proc.pid) or [proc.pid]) as held:
        os.kill(target(proc) if target else proc.pid, sig)
        held.wait_signal(sig)  # a launcher forwards it
    return True


def check_sigterm_resume(root, model, data, failures):
    straight = os.path.join(root, "straight-long")
    extra = {"n_epoch": 8}
    tu.train(args(model, data, straight, **extra))
    stopped = os.path.join(root, "sigterm")
    cmd = [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in
                                         args(model, data, stopped, **extra).items()]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    if not signal_at_step(proc, stopped, 5, signal.SIGTERM):
        failures.append("the run did not reach step 5")
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 3:
        failures.append(f"SIGTERM: exit {proc.returncode}, expected 3: {err[-300:]}")
    ckpt = tu.latest_checkpoint(stopped)
    stop_step = int(ckpt.rsplit("_", 1)[1])
    if not 5 <= stop_step < 160:
        failures.append(f"SIGTERM checkpoint at step {stop_step}, expected mid-run")
    tu.train(args(model, data, stopped, resume="true", **extra))
    a, b = tu.latest_checkpoint(straight), tu.latest_checkpoint(stopped)
    if tu.metric_rows(a) != tu.metric_rows(b) or weights(a) != weights(b):
        failures.append(f"run stopped by SIGTERM at step {stop_step} and resumed differs "
                        "from the straight run")
    print(f"SIGTERM stopped the run at step {stop_step}; resumed to {os.path.basename(b)}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    check_max_steps_resume(root, model, data, failures)
    check_sigterm_resume(root, model, data, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
