"""bf16 and fp16 on the CPU backend (docs/design.md §15): weights and activations in the dtype,
fp32 master weights, optimizer state, accumulation and loss.
- 20-step curves in bf16 and fp16 against the PyTorch reference doing the same scheme
  (tests/ref/model.py with dtype: the master rounded where forward reads it, every activation
  and activation gradient rounded where astrai stores one), within TOL, and within 3e-2 of the
  fp32 curve;
- ddp and fsdp over 2 ranks equal none in each dtype; a rerun is bit-identical;
- the portable GEMM (ASTRAI_CPU_GEMM=portable: convert, then sgemm) and the fast one (oneDNN on
  CPUs with bf16/fp16 instructions) agree; the path each dtype ran is printed;
- fp16 trains with dynamic loss scaling by default: started at 2^24 it skips its first steps
  (the activation gradients overflow fp16) and backs off exactly as GradScaler's rule says;
- a checkpoint of a bf16 run holds fp32 masters and resumes in fp32 and vice versa."""

import math
import os
import sys

import torch

import train_util as tu
from ref.grad_scaler import GradScaler

WINDOW, BATCH, STEPS = 32, 4, 20
N_BYTES = 80 * WINDOW + 1  # 80 windows: 20 steps of 4
# The reference rounds at the same points but sums in its own order (oneDNN or sgemm against
# torch's matmul): a few ulps of the dtype per op, compounding over the steps.
TOL = {"bf16": 1e-3, "fp16": 2e-4}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run(root, model, data, name, expect=0, env=None, **extra):
    ckpt = os.path.join(root, name)
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3,
         "threads": 1, "optimizer": "adamw", "max_steps": STEPS, "device_type": "cpu"}
    a.update(extra)
    cmd = [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]
    _, err = tu.run(cmd, expect, env=dict(os.environ, **(env or {})))
    return tu.metric_rows(tu.latest_checkpoint(ckpt)), err


def worst(rows, base, keys=("loss",)):
    return max(tu.rel_err(a[k], b[k]) for a, b in zip(rows, base) for k in keys
               if k in a and k in b)


def curves(root, model, data, tokens, failures):
    """The straight runs' rows by dtype."""
    fp32, _ = run(root, model, data, "fp32")
    out = {"fp32": fp32}
    for dt in DTYPES:
        rows, err = run(root, model, data, dt, dtype=dt)
        out[dt] = rows
        path = [line for line in err.splitlines() if "GEMM" in line]
        ref, _ = tu.reference_training(model, tokens, WINDOW, BATCH, 1, STEPS, "adamw", 3e-3,
                                       0.1, 1.0, 3407, dtype=DTYPES[dt],
                                       scaler=GradScaler(65536, 2000) if dt == "fp16" else None)
        w_ref, w_fp32 = worst(rows, ref), worst(rows, fp32)
        print(f"{dt}: {len(rows)} steps, worst loss difference from the reference {w_ref:.2e} "
              f"(tolerance {TOL[dt]}), from fp32 {w_fp32:.2e}; {path[:1]}")
        if len(rows) != STEPS or w_ref > TOL[dt] or w_fp32 > 3e-2:
            failures.append(f"{dt}: {len(rows)} rows, {w_ref:.2e} from the reference, "
                            f"{w_fp32:.2e} from fp32")
        again, _ = run(root, model, data, dt + "-again", dtype=dt)
        if again != rows:
            failures.append(f"{dt}: a rerun differs")
        portable, _ = run(root, model, data, dt + "-portable", dtype=dt,
                          env={"ASTRAI_CPU_GEMM": "portable"})
        w_port = worst(portable, rows)
        print(f"{dt}: portable GEMM vs the default path: worst loss difference {w_port:.2e}")
        if w_port > TOL[dt]:
            failures.append(f"{dt}: the portable GEMM differs by {w_port:.2e}")
        for mode in ("ddp", "fsdp"):
            par, _ = run(root, model, data, f"{dt}-{mode}", dtype=dt, nprocs=2,
                         parallel_mode=mode, batch_per_device=BATCH // 2)
            w_par = worst(par, rows)
            print(f"{dt}: {mode} over 2 ranks vs none: worst loss difference {w_par:.2e}")
            if w_par > TOL[dt]:
                failures.append(f"{dt}: {mode} differs from none by {w_par:.2e}")
    return out


def fp16_scaling(root, model, data, failures):
    """2^24 overflows fp16's activation gradients (its largest finite value is 65504): the first
    steps are skipped, then the scale settles where they fit."""
    run(root, model, data, "fp16-2e24", dtype="fp16", init_loss_scale=2.0 ** 24,
        loss_scale_growth_interval=4)
    rows = [r for r in tu.all_metric_rows(tu.latest_checkpoint(os.path.join(root, "fp16-2e24")))
            if r.get("type") == "step"]
    rule = GradScaler(2.0 ** 24, 4)
    for r in rows:
        if r["loss_scale"] != rule.scale:
            failures.append(f"fp16 from 2^24: step {r['step']} at {r['loss_scale']}, the rule "
                            f"says {rule.scale}")
            break
        rule.update(bool(r["skipped"]))
    skipped = [r["step"] for r in rows if r["skipped"]]
    print(f"fp16 from 2^24: skipped {skipped}, scales (log2) "
          f"{[round(math.log2(r['loss_scale'])) for r in rows]}")
    if not skipped or skipped[0] != 1 or len(skipped) == len(rows):
        failures.append(f"fp16 from 2^24: skipped {skipped}")


def handoff(root, model, data, straight, failures):
    """A checkpoint holds fp32 masters whatever the dtype: bf16 to step 10 then fp32 --resume to
    20 in one ckpt_dir, and fp32 then bf16: the first 10 rows are the first run's, the rest
    stay within 3e-2 of the straight run in the second dtype."""
    for first, then in (("bf16", "fp32"), ("fp32", "bf16")):
        ck = f"handoff-{first}"
        run(root, model, data, ck, dtype=first, max_steps=10)
        rows, _ = run(root, model, data, ck, dtype=then, resume="true")
        a, b = straight[first], straight[then]
        w_first, w_then = worst(rows[:10], a[:10]), worst(rows[10:], b[10:])
        print(f"{first} 10 steps + {then} --resume to {len(rows)}: the first 10 rows differ from "
              f"{first}'s by {w_first:.1e}, the rest from {then}'s by {w_then:.1e}")
        if len(rows) != STEPS or w_first != 0 or w_then > 3e-2:
            failures.append(f"handoff {first} -> {then}: {len(rows)} rows, {w_first}, {w_then}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, tokens = tu.make_text_data(root, N_BYTES)
    straight = curves(root, model, data, tokens, failures)
    fp16_scaling(root, model, data, failures)
    handoff(root, model, data, straight, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
