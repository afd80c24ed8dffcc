"""Dynamic loss scaling (--loss_scale dynamic, docs/design.md §15) against the PyTorch reference
doing PyTorch GradScaler's rule (tests/ref/grad_scaler.py) on the same gradients:
- a run started at a scale too large for a float (2^132) skips its first steps (the loss weight
  S/grad_accum_steps is infinite), backs off by halves exactly as the rule says, then trains,
  and grows the scale after the growth interval (and overflows and backs off again); the rows
  (loss, grad_norm, loss_scale, lr: the schedule advances over skipped steps) equal the
  reference's skipping the same steps (near the top of the float range, where the last
  rounding decides whether a gradient overflows, the reference is told which steps did), and
  metric.jsonl and progress.db carry loss_scale and skipped;
- a resume in the middle of a back-off continues identically (the scaler's state is in the
  checkpoint);
- one rank overflowing (ASTRAI_TEST_OVERFLOW) skips the step on every rank under ddp and fsdp:
  the curve equals one rank's with the same step skipped;
- through astraid: the JOB shows the newest loss_scale and the skipped steps (and `astraictl
  status` says them), the history rows carry loss_scale and skipped;
- bad values of --loss_scale are refused naming the value (tests/test_train_devices.py)."""

import math
import os
import sqlite3
import sys


import daemon_util as du
import train_util as tu
from ref.grad_scaler import GradScaler
WINDOW = 32
N_BYTES = 96 * WINDOW + 1  # 96 windows: 24 steps of 4, 12 of 8
# 2^132 down to 2^128 make the float loss weight infinite: the first 5 steps are skipped.
STEPS, INIT, INTERVAL = 16, 2.0 ** 132, 3


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data, "batch_per_device": 4,
         "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3, "threads": 1,
         "loss_scale": "dynamic", "init_loss_scale": INIT, "loss_scale_growth_interval": INTERVAL,
         "max_steps": STEPS, "optimizer": "adamw"}
    a.update(extra)
    return a


def scaler_rows(ckpt):
    return [r for r in tu.all_metric_rows(tu.latest_checkpoint(ckpt)) if r.get("type") == "step"]


def check_rule(rows, failures, what):
    """The rows' scales follow GradScaler's rule from INIT given their skipped flags."""
    rule = GradScaler(INIT, INTERVAL)
    for r in rows:
        if r["loss_scale"] != rule.scale:
            failures.append(f"{what}: step {r['step']} ran at scale {r['loss_scale']}, the rule "
                            f"says {rule.scale}")
            return
        rule.update(bool(r["skipped"]))


def against_reference(root, model, data, tokens, failures):
    ckpt = os.path.join(root, "dynamic")
    tu.train(args(model, data, ckpt))
    rows = scaler_rows(ckpt)
    skipped = [r["step"] for r in rows if r["skipped"]]
    ref, _ = tu.reference_training(model, tokens, WINDOW, 4, 1, STEPS, "adamw", 3e-3, 0.1, 1.0,
                                   3407, scaler=GradScaler(INIT, INTERVAL), overflows=skipped)
    print(f"astrai: scales {[math.log2(r['loss_scale']) for r in rows]} (log2), skipped steps "
          f"{skipped}")
    infinite = [r["step"] for r in rows if r["loss_scale"] >= 2.0 ** 128]  # float(S) is inf
    if len(rows) != STEPS or not set(infinite) <= set(skipped):
        failures.append(f"{len(rows)} rows; skipped {skipped}, but an infinite weight at {infinite}")
    if [r["loss_scale"] for r in rows] != [r["loss_scale"] for r in ref]:
        failures.append(f"scales {[r['loss_scale'] for r in rows]} vs the reference's "
                        f"{[r['loss_scale'] for r in ref]}")
    if not skipped or skipped[0] != 1 or len(skipped) == len(rows):
        failures.append(f"expected the first steps skipped and later ones trained: {skipped}")
    if not any(b["loss_scale"] > a["loss_scale"] for a, b in zip(rows, rows[1:])):
        failures.append("the scale never grew")
    worst = 0.0
    for a, b in zip(rows, ref):
        worst = max(worst, tu.rel_err(a["lr"], b["lr"]))
        if not a["skipped"]:
            worst = max(worst, tu.rel_err(a["loss"], b["loss"]),
                        tu.rel_err(a["grad_norm"], b["grad_norm"]))
        elif "grad_norm" in a:
            failures.append(f"step {a['step']}: skipped with a finite grad_norm {a['grad_norm']}")
    print(f"against the reference: {len(rows)} steps, worst difference {worst:.2e}")
    if worst > 1e-4:
        failures.append(f"loss/grad_norm/lr differ from the reference by {worst:.2e}")
    check_rule(rows, failures, "dynamic")
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        got = dict(db.execute("SELECT step, value FROM step_metrics WHERE name = 'skipped'"))
        nulls = [s for (s,) in db.execute("SELECT step FROM steps WHERE grad_norm IS NULL")]
    if [s for s, v in sorted(got.items()) if v] != skipped or nulls != skipped:
        failures.append(f"progress.db: skipped {got}, NULL grad_norm at {nulls}")
    return rows


def resume_mid_backoff(root, model, data, straight, failures):
    ckpt = os.path.join(root, "resumed")
    tu.train(args(model, data, ckpt, max_steps=2))
    tu.train(args(model, data, ckpt, resume="true"))
    rows = scaler_rows(ckpt)
    same = [(r["loss_scale"], r["skipped"], r.get("loss")) for r in rows] == \
        [(r["loss_scale"], r["skipped"], r.get("loss")) for r in straight]
    print(f"stopped at step 2 (scale {rows[1]['loss_scale']}), resumed: "
          f"{'identical' if same else 'DIFFERENT'} rows")
    if not same:
        failures.append("a resume in the middle of the back-off differs from the straight run")


def one_rank_overflows(root, model, data, failures):
    """Rank 1's gradients overflow at step 5 (the scale is 2^16 there, below any real overflow):
    every rank skips that step; the curve is one rank's with rank 0 overflowing there."""
    env_run = {}
    for name, extra, who in (("one", {"nprocs": 1, "batch_per_device": 8}, "0:5"),
                             ("ddp", {"nprocs": 2, "parallel_mode": "ddp"}, "1:5"),
                             ("fsdp", {"nprocs": 2, "parallel_mode": "fsdp"}, "1:5")):
        ckpt = os.path.join(root, f"overflow-{name}")
        a = args(model, data, ckpt, init_loss_scale=2.0 ** 16, **extra)
        # astrai-train with the tests' seams (train/test_seam.h) takes ASTRAI_TEST_OVERFLOW
        cmd = [tu.binary("astrai-train-seams")] + [f"--{k}={v}" for k, v in a.items()]
        tu.run(cmd, env=dict(os.environ, ASTRAI_TEST_OVERFLOW=who))
        env_run[name] = scaler_rows(ckpt)
    base = env_run["one"]
    for name in ("ddp", "fsdp"):
        rows = env_run[name]
        skipped = [r["step"] for r in rows if r["skipped"]]
        worst = max(tu.rel_err(a["loss"], b["loss"]) for a, b in zip(rows, base))
        print(f"{name}: rank 1 overflowed at step 5: skipped {skipped}, scales "
              f"{[r['loss_scale'] for r in rows][:7]}, worst difference from one rank {worst:.1e}")
        if skipped != [5] or worst > 1e-5 or [r["loss_scale"] for r in rows] != \
                [r["loss_scale"] for r in base]:
            failures.append(f"{name}: one rank's overflow: skipped {skipped}, worst {worst:.2e}")


def through_astraid(root, model, data, failures):
    os.makedirs(os.path.join(root, "astraid"))
    d = du.Daemon(os.path.join(root, "astraid")).start()
    with du.guarded(d):
        c = d.client()
        spec = du.spec(model, data, **{k: v for k, v in args(model, data, "").items()
                                       if k not in ("ckpt_dir", "param_path", "data_root_path")})
        jid = c.call("submit", spec)["job"]
        job = du.wait_job(c, jid, ["completed"], timeout=300)
        rows = c.call("history", {"job": jid})["steps"]
        out, _ = tu.run([tu.binary("astraictl"), "--socket", d.socket, "status", str(jid)])
        d.stop()
    want_skipped = [r["step"] for r in rows if r.get("skipped")]
    line = out.splitlines()[0] if out else ""
    print(f"astraid: JOB loss_scale {job['loss_scale']}, skipped_steps {job['skipped_steps']}; "
          f"history skipped {want_skipped}; status: {line}")
    if job["loss_scale"] != rows[-1].get("loss_scale") or job["skipped_steps"] != \
            len(want_skipped) or not want_skipped or any("loss_scale" not in r for r in rows):
        failures.append(f"astraid: JOB {job} vs history {rows}")
    if f"loss_scale {job['loss_scale']:g} ({len(want_skipped)} skipped)" not in line:
        failures.append(f"astraictl status does not say the loss scale: {out[:300]}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, tokens = tu.make_text_data(root, N_BYTES)
    straight = against_reference(root, model, data, tokens, failures)
    resume_mid_backoff(root, model, data, straight, failures)
    one_rank_overflows(root, model, data, failures)
    through_astraid(root, model, data, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
