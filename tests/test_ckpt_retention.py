"""Checkpoint retention (--checkpoint_keep_last N, --checkpoint_keep_best K): after each
checkpoint exactly the newest N that astrai wrote are left, plus the K of lowest val_loss; the
checkpoint a run resumed from stays; progress.db lists the checkpoints left; checkpoints astrai
did not write (an AstrAI one, without sampler.json) and other files in ckpt_dir stay; 0 keeps
everything; both are job keys."""

import json
import os
import shutil
import sqlite3
import sys

import train_util as tu

WINDOW = 16
N_BYTES = 96 * WINDOW + 1  # 96 windows: 12 steps of 8


def run(root, model, data, name, expect=0, **extra):
    ckpt = os.path.join(root, name)
    args = {"train_type": "seq", "param_path": model, "data_root_path": data,
            "batch_per_device": 8, "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3,
            "threads": 1, "ckpt_interval": 1}
    args.update(extra)
    return ckpt, tu.train(args, expect)[1]


def ours(ckpt):
    """The steps of the epoch_E_step_S checkpoints in ckpt, sorted."""
    return sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(ckpt) if n.startswith("epoch_"))


def foreign(ckpt):
    """An AstrAI checkpoint (meta.json, no sampler.json) and a file of the user's."""
    d = os.path.join(ckpt, "epoch_0_step_0")
    os.makedirs(d)
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"epoch": 0, "consumed_samples": 0}, f)
    with open(os.path.join(ckpt, "notes.txt"), "w") as f:
        f.write("mine\n")


def check(what, got, want, failures):
    print(f"{what}: {got}")
    if got != want:
        failures.append(f"{what}: {got}, want {want}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    # keep the newest 3 of 12; the foreign checkpoint (step 0) and file stay.
    ckpt = os.path.join(root, "last3")
    os.makedirs(ckpt)
    foreign(ckpt)
    _, err = run(root, model, data, "last3", checkpoint_keep_last=3)
    check("keep_last 3 of 12", ours(ckpt), [0, 10, 11, 12], failures)
    if not os.path.exists(os.path.join(ckpt, "notes.txt")) or err.count("removed") != 9:
        failures.append(f"keep_last 3: notes.txt gone or not 9 removals: {err[-600:]}")
    if [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]:
        failures.append(f"keep_last 3: leftovers {os.listdir(ckpt)}")
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        rows = [r[0] for r in db.execute("SELECT step FROM checkpoints ORDER BY step")]
    check("keep_last 3: progress.db checkpoints", rows, [10, 11, 12], failures)
    # 0 keeps all.
    ckpt, _ = run(root, model, data, "all")
    check("keep_last 0", ours(ckpt), list(range(1, 13)), failures)
    # the newest 1 and the 2 of lowest val_loss (validation at every step): a run stopped at
    # step 5 whose rows say that steps 2 and 4 validated best, then resumed with the retention.
    val_args = dict(val_split=0.25, val_step=1)
    ckpt, _ = run(root, model, data, "best2", max_steps=5, **val_args)
    rows_path = os.path.join(ckpt, "epoch_0_step_5", "metric.jsonl")
    rows = tu.all_metric_rows(os.path.join(ckpt, "epoch_0_step_5"))
    for r in rows:
        if r.get("type") == "validation" and r["step"] in (2, 4):
            r["val_loss"] = {2: 0.5, 4: 0.25}[r["step"]]
    with open(rows_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    run(root, model, data, "best2", resume="true", checkpoint_keep_last=1,
        checkpoint_keep_best=2, **val_args)
    check("keep_last 1 + keep_best 2, resumed from 5", ours(ckpt), [2, 4, 5, 9], failures)
    # a resumed run keeps the checkpoint it resumed from.
    ckpt, _ = run(root, model, data, "resumed", checkpoint_keep_last=1, max_steps=4)
    check("keep_last 1, stopped at 4", ours(ckpt), [4], failures)
    run(root, model, data, "resumed", checkpoint_keep_last=1, resume="true")
    check("keep_last 1, resumed from 4", ours(ckpt), [4, 12], failures)
    # (The checkpoint resumed from stays: 6 below, 8 in the branch.)
    # A lookalike of the user's (a real checkpoint copied in, as epoch_0_step_7) and a symlink
    # to it (epoch_0_step_9): never the newest, never deleted, never resumed from.
    ckpt = os.path.join(root, "lookalike")
    os.makedirs(ckpt)
    shutil.copytree(os.path.join(root, "all", "epoch_0_step_7"),
                    os.path.join(ckpt, "epoch_0_step_7"))
    os.symlink(os.path.join(ckpt, "epoch_0_step_7"), os.path.join(ckpt, "epoch_0_step_9"))
    os.makedirs(os.path.join(ckpt, ".tmp-notes"))
    with open(os.path.join(ckpt, ".tmp-notes", "todo"), "w") as f:
        f.write("mine\n")
    run(root, model, data, "lookalike", checkpoint_keep_last=1, ckpt_interval=2, max_steps=6)
    check("lookalike: keep_last 1 of 2, 4, 6", ours(ckpt), [6, 7, 9], failures)
    if not os.path.islink(os.path.join(ckpt, "epoch_0_step_9")):
        failures.append("lookalike: the symlink epoch_0_step_9 is gone")
    if not os.path.exists(os.path.join(ckpt, ".tmp-notes", "todo")):
        failures.append("lookalike: the user's .tmp-notes/ was cleaned")
    _, err = run(root, model, data, "lookalike", checkpoint_keep_last=1, ckpt_interval=2,
                 max_steps=8, resume="true")
    check("lookalike: resumed from 6 (not 7 or 9) to 8", ours(ckpt), [6, 7, 8, 9], failures)
    if "epoch_0_step_7 is not one astrai committed" not in err:
        failures.append(f"lookalike: not reported: {err[-600:]}")
    # A run resumed from an older checkpoint is a branch: its retention leaves the first run's
    # checkpoints alone, and a later plain --resume continues the branch, not the first run.
    ckpt, _ = run(root, model, data, "branch", ckpt_interval=2, max_steps=10)
    run(root, model, data, "branch", ckpt_interval=2, max_steps=8, resume="true",
        checkpoint_keep_last=1, param_path=os.path.join(ckpt, "epoch_0_step_4"))
    check("branch from 4 to 8, keep_last 1", ours(ckpt), [2, 4, 8, 10], failures)
    run(root, model, data, "branch", ckpt_interval=2, max_steps=9, resume="true",
        checkpoint_keep_last=1)
    check("plain resume continues the branch (8 -> 9)", ours(ckpt), [2, 4, 8, 9, 10], failures)
    # the job keys and their range.
    _, err = run(root, model, data, "bad", expect=2, checkpoint_keep_last=-1)
    if "checkpoint_keep_last" not in err:
        failures.append(f"checkpoint_keep_last -1: {err}")
    if not failures:
        shutil.rmtree(root)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
