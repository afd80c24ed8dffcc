"""--async_checkpoint: rank 0 writes checkpoints on a background thread (with --ckpt_format
sharded every rank its own files, which rank 0 commits once all are written).
- the files equal the synchronous run's, byte for byte (weights and optimizer state of every
  checkpoint), on 1 rank and under fsdp on 2, in both formats;
- training goes on while a write is in flight (the writer held by ASTRAI_TEST_CKPT_HOLD until the
  test releases it): later steps are recorded while the checkpoint is not yet committed, and it
  counts (progress.db) only once committed; SIGTERM during the write ends with that checkpoint and
  the stop checkpoint committed, exit 3;
- a write that fails stops every rank with exit 1, naming the step and the path.
The last two in both formats (sharded: fsdp over 2 ranks)."""

import os
import signal
import sqlite3
import subprocess
import sys

import train_util as tu
from test_train_resume import wait_for_step

WINDOW = 32
N_BYTES = 48 * WINDOW + 1  # 48 windows: 12 steps of 4


def args(model, data, ckpt, binary="astrai-train", **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "batch_per_device": 4, "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3,
         "threads": 1, "ckpt_interval": 3}
    a.update(extra)
    return [tu.binary(binary)] + [f"--{k}={v}" for k, v in a.items()]


def files(ckpt):
    """{checkpoint/file: bytes} of the tensor files of every checkpoint."""
    out = {}
    for name in sorted(os.listdir(ckpt)):
        if name.startswith("epoch_"):
            for f in sorted(os.listdir(os.path.join(ckpt, name))):
                if not f.endswith((".safetensors", ".index.json")):
                    continue
                with open(os.path.join(ckpt, name, f), "rb") as fh:
                    out[f"{name}/{f}"] = fh.read()
    return out


def committed(ckpt):
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        return [r[0] for r in db.execute("SELECT step FROM checkpoints ORDER BY step")]


def same_files(root, model, data, failures):
    for what, extra in (("1 rank", {}), ("fsdp 2", FSDP2), ("fsdp 2 sharded", SHARDED)):
        sync, asyn = (os.path.join(root, f"{k}-{what.replace(' ', '')}") for k in ("sync", "async"))
        tu.run(args(model, data, sync, **extra))
        tu.run(args(model, data, asyn, async_checkpoint="true", **extra))
        a, b = files(sync), files(asyn)
        if not a or a != b:
            failures.append(f"{what}: async checkpoints differ from sync ({sorted(a)} vs {sorted(b)})")
        if committed(asyn) != [3, 6, 9, 12]:
            failures.append(f"{what}: async progress.db checkpoints {committed(asyn)}")
        print(f"{what}: {len(a)} checkpoint files, async = sync byte for byte")


FSDP2 = {"nprocs": 2, "parallel_mode": "fsdp", "batch_per_device": 2}
SHARDED = dict(FSDP2, ckpt_format="sharded")


def held(root, model, data, name, **extra):
    ckpt = os.path.join(root, name)
    hold = os.path.join(root, name + ".hold")
    env = dict(os.environ, ASTRAI_TEST_CKPT_HOLD=hold)
    # astrai-train with the tests' seams (train/test_seam.h) takes ASTRAI_TEST_CKPT_HOLD
    proc = subprocess.Popen(args(model, data, ckpt, "astrai-train-seams", async_checkpoint="true",
                                 n_epoch=40, **extra),
                            stderr=subprocess.PIPE, text=True, env=env)
    return ckpt, hold, proc


def in_flight_and_sigterm(root, model, data, failures, name="held", **extra):
    ckpt, hold, proc = held(root, model, data, name, **extra)
    # The checkpoint of step 3 is held; step 4 is recorded while it is in flight.
    if not wait_for_step(ckpt, 4, proc):
        failures.append("held write: training did not go on past the checkpoint of step 3")
    if "epoch_0_step_3" in os.listdir(ckpt) or committed(ckpt):
        failures.append(f"held write: committed before its release: {os.listdir(ckpt)}, "
                        f"{committed(ckpt)}")
    proc.send_signal(signal.SIGTERM)
    open(hold, "w").close()
    _, err = proc.communicate(timeout=120)
    steps = committed(ckpt)
    if proc.returncode != 3 or len(steps) < 2 or steps[0] != 3 or any(
            f"epoch_0_step_{s}" not in os.listdir(ckpt) for s in steps):
        failures.append(f"SIGTERM during a write: exit {proc.returncode}, committed {steps}, "
                        f"{os.listdir(ckpt)}: {err[-500:]}")
    leftovers = [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]
    if leftovers:
        failures.append(f"SIGTERM during a write ({name}): left {leftovers}")
    print(f"held write ({name}): step 4 trained while step 3's checkpoint was in flight; "
          f"SIGTERM: exit {proc.returncode}, committed {steps}")


def failed_write(root, model, data, failures, name="fails", **extra):
    ckpt, hold, proc = held(root, model, data, name, **extra)
    if not wait_for_step(ckpt, 4, proc):
        failures.append("failing write: the run did not reach step 4")
    os.rename(ckpt, ckpt + ".moved")  # the writer finds a file where ckpt_dir was
    open(ckpt, "w").close()
    open(hold, "w").close()
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 1 or "step 3" not in err or ckpt not in err:
        failures.append(f"failed write: exit {proc.returncode}: {err[-500:]}")
    print(f"failed write ({name}): exit {proc.returncode}: {err.strip().splitlines()[-1]}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    same_files(root, model, data, failures)
    in_flight_and_sigterm(root, model, data, failures)
    in_flight_and_sigterm(root, model, data, failures, "held-sharded", **SHARDED)
    failed_write(root, model, data, failures)
    failed_write(root, model, data, failures, "fails-sharded", **SHARDED)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
