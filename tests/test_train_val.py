"""--val_split/--val_step against the PyTorch reference: the held-out windows are the tail of
the seeded split (docs/training.md), training draws only from the others, and every
validation row (at each val_step-th optimizer step and at the end) equals the reference's
mean loss over the held-out windows within 1e-4; progress.db holds the same rows; ddp and
fsdp over 2 ranks (the second rank with one window fewer; with one held-out window, ddp's second
rank with none), accumulation and a resumed run give the none run's rows; under
astraid the job's val_loss is the last validation row and `astraictl status` shows it."""

import math
import os
import sqlite3
import subprocess
import sys

import numpy as np
import torch

import train_util as tu
from ref import sampler as ref_sampler
from ref.model import RefModel, loss as ref_loss
from ref.optim import clip_grad_norm, make_optimizer

torch.set_num_threads(2)
WINDOW, BATCH, VAL_SPLIT, VAL_STEP, SEED = 32, 4, 0.2, 4, 3407
# 45 windows: 9 held out (floor(45 * 0.2)), 36 trained on = 9 optimizer steps of 4.
N_BYTES = 45 * WINDOW + 1
LR = 3e-3


def reference(model_dir, tokens):
    """Trains RefModel on the training windows as astrai-train does (one rank, adamw);
    returns (step rows, validation rows)."""
    torch.manual_seed(0)
    model = RefModel.from_dir(model_dir)
    samples = tu.windows(tokens, WINDOW, WINDOW)
    n_total = len(samples)
    n_val = max(1, int(n_total * VAL_SPLIT))
    n_train = n_total - n_val
    split = ref_sampler.permutation(n_total, SEED, True)
    train_ids, val_ids = split[:n_train], split[n_train:]
    total = math.ceil(n_train / BATCH)
    opt = make_optimizer("adamw", list(model.named_parameters()), lr=LR, weight_decay=0.1)
    order = [train_ids[i] for i in ref_sampler.rank_order(n_train, 1, 0, SEED, 0, True)]
    rows, vals, step = [], [], 0
    for b0 in range(0, len(order), BATCH):
        idx = order[b0:b0 + BATCH]
        x = torch.tensor(np.stack([samples[i][0] for i in idx]))
        y = torch.tensor(np.stack([samples[i][1] for i in idx]))
        loss = ref_loss(model.forward(x), y)
        loss.backward()
        norm = clip_grad_norm(list(model.parameters()), 1.0)
        lr = LR * tu.cosine_factor(step, total, 0.05, 0.01)
        opt.step(lr)
        opt.zero_grad()
        step += 1
        rows.append({"step": step, "loss": float(loss), "grad_norm": norm})
        if step % VAL_STEP == 0 or step == total:
            with torch.no_grad():
                losses = [float(ref_loss(model.forward(torch.tensor(samples[i][0][None])),
                                         torch.tensor(samples[i][1][None]))) for i in val_ids]
            vals.append({"step": step, "val_loss": sum(losses) / len(losses)})
    return rows, vals


def run(root, model_dir, data_dir, name, mode="none", nprocs=1, batch=BATCH, **extra):
    ckpt_dir = os.path.join(root, name)
    spec = {"train_type": "seq", "param_path": model_dir, "data_root_path": data_dir,
            "batch_per_device": batch, "window_size": WINDOW, "optimizer": "adamw",
            "max_lr": LR, "weight_decay": 0.1, "max_grad_norm": 1.0, "ckpt_dir": ckpt_dir,
            "ckpt_interval": 1000, "threads": 1, "val_split": VAL_SPLIT,
            "val_step": VAL_STEP, "parallel_mode": mode, "nprocs": nprocs,
            "random_seed": SEED}
    spec.update(extra)
    tu.train(spec)
    rows = tu.all_metric_rows(tu.latest_checkpoint(ckpt_dir))
    return ckpt_dir, rows


def main():
    failures = []
    root = tu.tmpdir()
    model_dir = tu.make_model(root)
    data_dir, tokens = tu.make_text_data(root, N_BYTES)
    ref_rows, ref_vals = reference(model_dir, tokens)
    ckpt_dir, rows = run(root, model_dir, data_dir, "none")
    steps = [r for r in rows if r["type"] == "step"]
    vals = [r for r in rows if r["type"] == "validation"]
    if len(steps) != len(ref_rows) or len(steps) != 9:
        failures.append(f"{len(steps)} step rows, reference {len(ref_rows)}, expected 9")
    for a, b in zip(steps, ref_rows):
        for key in ("loss", "grad_norm"):
            if tu.rel_err(a[key], b[key]) > 1e-4:
                failures.append(f"step {a['step']}: {key} {a[key]} vs reference {b[key]}")
    if [v["step"] for v in vals] != [v["step"] for v in ref_vals]:
        failures.append(f"validation at steps {[v['step'] for v in vals]}, reference at "
                        f"{[v['step'] for v in ref_vals]}")
    for a, b in zip(vals, ref_vals):
        if tu.rel_err(a["val_loss"], b["val_loss"]) > 1e-4 or "loss" in a:
            failures.append(f"step {a['step']}: validation row {a} vs reference {b['val_loss']}")
    # AstrAI's order: a step's validation row comes before its step row.
    kinds = [(r["type"], r["step"]) for r in rows if r["type"] != "epoch"]
    for v in vals:
        i = kinds.index(("validation", v["step"]))
        if i + 1 >= len(kinds) or kinds[i + 1] != ("step", v["step"]):
            failures.append(f"validation row of step {v['step']} is not just before its step row")
    db = sqlite3.connect(os.path.join(ckpt_dir, "progress.db"))
    db_vals = db.execute("SELECT step, val_loss FROM validation ORDER BY step").fetchall()
    db.close()
    if [(v["step"], round(v["val_loss"], 5)) for v in vals] != \
            [(s, round(v, 5)) for s, v in db_vals]:
        failures.append(f"progress.db validation rows {db_vals} vs metric.jsonl {vals}")
    print(f"none: validation {[(v['step'], round(v['val_loss'], 5)) for v in vals]}, "
          f"reference {[(v['step'], round(v['val_loss'], 5)) for v in ref_vals]}")
    for mode in ("ddp", "fsdp"):
        _, prow = run(root, model_dir, data_dir, mode, mode, 2, BATCH // 2)
        pvals = [r for r in prow if r["type"] == "validation"]
        if [v["step"] for v in pvals] != [v["step"] for v in vals]:
            failures.append(f"{mode}: validation at {[v['step'] for v in pvals]}")
        for a, b in zip(pvals, vals):
            if tu.rel_err(a["val_loss"], b["val_loss"]) > 1e-4:
                failures.append(f"{mode} step {a['step']}: val_loss {a['val_loss']} vs none "
                                f"{b['val_loss']}")
        print(f"{mode}: validation {[(v['step'], round(v['val_loss'], 5)) for v in pvals]}")
    check_lone_window(root, model_dir, data_dir, failures)
    check_accum_resume(root, model_dir, data_dir, vals, failures)
    check_daemon(root, model_dir, data_dir, failures)
    return tu.finish(failures)


def check_lone_window(root, model_dir, data_dir, failures):
    """One held-out window (floor(45 * 0.03)) over ddp's 2 ranks: the second rank evaluates
    nothing, and the validation rows are the one-rank run's."""
    runs = {}
    for mode, nprocs in (("none", 1), ("ddp", 2)):
        _, rows = run(root, model_dir, data_dir, f"lone-{mode}", mode, nprocs, BATCH // nprocs,
                      val_split=0.03, max_steps=VAL_STEP)
        runs[mode] = [r for r in rows if r["type"] == "validation"]
    if len(runs["none"]) != 1 or [v["step"] for v in runs["ddp"]] != [VAL_STEP]:
        failures.append(f"one held-out window: validation rows {runs}")
    for a, b in zip(runs["ddp"], runs["none"]):
        if tu.rel_err(a["val_loss"], b["val_loss"]) > 1e-4:
            failures.append(f"one held-out window, ddp 2: val_loss {a['val_loss']} vs none "
                            f"{b['val_loss']}")
    print(f"one held-out window: ddp {runs['ddp']}, none {runs['none']}")


def check_accum_resume(root, model_dir, data_dir, vals, failures):
    """The same global batch through accumulation (2 micro-batches of 2), and a run stopped at
    step 5 (after the validation of step 4) then resumed, validate as the straight run."""
    _, acc = run(root, model_dir, data_dir, "accum", batch=BATCH // 2, grad_accum_steps=2)
    run(root, model_dir, data_dir, "resumed", max_steps=5)
    _, res = run(root, model_dir, data_dir, "resumed", resume="true")
    for name, rows in (("accum", acc), ("resumed", res)):
        got = [r for r in rows if r["type"] == "validation"]
        if name == "resumed":  # the stopped run validated at its last step (--max_steps) too
            if [v["step"] for v in got].count(5) != 1:
                failures.append("resumed: no validation row at the --max_steps stop (step 5)")
            got = [v for v in got if v["step"] != 5]
        if [v["step"] for v in got] != [v["step"] for v in vals] or any(
                tu.rel_err(a["val_loss"], b["val_loss"]) > 1e-4 for a, b in zip(got, vals)):
            failures.append(f"{name}: validation {[(v['step'], v['val_loss']) for v in got]} vs "
                            f"{[(v['step'], v['val_loss']) for v in vals]}")
        print(f"{name}: validation {[(v['step'], round(v['val_loss'], 5)) for v in got]}")


def check_daemon(root, model_dir, data_dir, failures):
    import daemon_util as du
    droot = os.path.join(root, "daemon")
    os.makedirs(droot)
    d = du.Daemon(droot).start()
    with du.guarded(d):
        c = d.client()
        spec = du.spec(model_dir, data_dir, val_split=VAL_SPLIT, val_step=VAL_STEP,
                       batch_per_device=BATCH, window_size=WINDOW, name="val")
        jid = c.call("submit", spec)["job"]
        done = du.wait_job(c, jid, ["completed"])
        vals = [r for r in tu.all_metric_rows(done["last_checkpoint"])
                if r["type"] == "validation"]
        if not vals or done.get("val_loss") is None or \
                abs(done["val_loss"] - vals[-1]["val_loss"]) > 1e-6:
            failures.append(f"daemon: job val_loss {done.get('val_loss')}, last row {vals[-1:]}")
        p = subprocess.run([tu.binary("astraictl"), "--socket", d.socket, "status", str(jid)],
                           capture_output=True, text=True, timeout=60)
        if f"val_loss {done.get('val_loss') or 0:.4f}" not in p.stdout:
            failures.append(f"astraictl status shows no val_loss: {p.stdout!r} {p.stderr!r}")
        print(f"daemon: val_loss {done.get('val_loss')}; {p.stdout.splitlines()[:1]}")
        c.close()
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
