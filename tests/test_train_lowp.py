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
- a checkpoint of a bf16 run holds fp32 masters and resumes in fp32 and vice versa;
- MoE models (gqa+moe, mla+moe): 10-step curves in bf16 and fp16 (loss scaling) against the
  reference scheme (mla+moe also under ep_size 2 against its one-rank curve), the loss within TOL (the grad norm within 10 TOL: MOE_NORM_TOL); fp16
  started at 2^24 backs off as GradScaler does and then follows the reference."""

import math
import os
import sys

import torch

import train_util as tu
from ref.grad_scaler import GradScaler
from test_model_ref import moe_keys

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


# DeepSeekMoE models (docs/design.md §7a): the router's softmax in fp32 rounded to the dtype, the
# experts' rows gathered, computed and combined in it (the configs of tests/test_moe_ref.py).
MOE_CONFIGS = {
    "gqa+moe": dict(tu.SMALL_CONFIG, **moe_keys(4, 1, 2), intermediate_size=64),
    "mla+moe": dict(tu.SMALL_CONFIG, attn_type="mla", kv_lora_rank=24, qk_nope_head_dim=12,
                    qk_rope_head_dim=4, num_key_value_heads=4, **moe_keys(4, 2, 2),
                    intermediate_size=64),
}
MOE_STEPS = 10
# A token whose k-th and (k+1)-th router probabilities are within an ulp of the dtype picks its
# experts by the last rounding, which the two implementations reach in their own summation
# orders: the grad norm moves more than the loss (the reference's own bf16 grad norm moves by
# 2e-3 when its initial weights move by 1e-6 relative), so it is held to 10 TOL.
MOE_NORM_TOL = {dt: 10 * tol for dt, tol in TOL.items()}


def moe_curves(root, data, tokens, failures):
    """10 steps of each MoE model in bf16 and in fp16 (dynamic loss scaling, its default) against
    the reference scheme: the loss within TOL, the grad norm within MOE_NORM_TOL, the loss within
    3e-2 of the model's fp32 curve."""
    for name, cfg in MOE_CONFIGS.items():
        model = tu.make_model(os.path.join(root, name), cfg)
        fp32, _ = run(root, model, data, f"{name}-fp32", max_steps=MOE_STEPS)
        for dt in DTYPES:
            rows, _ = run(root, model, data, f"{name}-{dt}", dtype=dt, max_steps=MOE_STEPS)
            ref, _ = tu.reference_training(
                model, tokens, WINDOW, BATCH, 1, MOE_STEPS, "adamw", 3e-3, 0.1, 1.0, 3407,
                dtype=DTYPES[dt], scaler=GradScaler(65536, 2000) if dt == "fp16" else None)
            w_ref, w_norm = worst(rows, ref), worst(rows, ref, ("grad_norm",))
            w_fp32 = worst(rows, fp32)
            scales = sorted({r.get("loss_scale") for r in rows})
            print(f"{name} {dt}: {len(rows)} steps, worst difference from the reference: loss "
                  f"{w_ref:.2e} (tolerance {TOL[dt]}), grad_norm {w_norm:.2e} (tolerance "
                  f"{MOE_NORM_TOL[dt]:g}); loss from fp32 {w_fp32:.2e}; loss scales {scales}")
            if len(rows) != MOE_STEPS or len(ref) != MOE_STEPS or w_ref > TOL[dt] or \
                    w_norm > MOE_NORM_TOL[dt] or w_fp32 > 3e-2:
                failures.append(f"{name} {dt}: {len(rows)} rows, loss {w_ref:.2e} and grad_norm "
                                f"{w_norm:.2e} from the reference, loss {w_fp32:.2e} from fp32")
            if name == "mla+moe":  # the experts' rows travel in the compute dtype
                ep, _ = run(root, model, data, f"{name}-{dt}-ep2", dtype=dt, max_steps=MOE_STEPS,
                            parallel_mode="ddp", nprocs=2, batch_per_device=BATCH // 2, ep_size=2)
                w_ep = worst(ep, rows)
                print(f"{name} {dt}: ep_size 2 over 2 ranks vs one rank: worst loss {w_ep:.2e}")
                if len(ep) != MOE_STEPS or w_ep > TOL[dt]:
                    failures.append(f"{name} {dt} ep 2: {len(ep)} rows, loss {w_ep:.2e} from one "
                                    "rank's")
            if dt == "fp16" and (scales != [65536] or any(r["skipped"] for r in rows)):
                failures.append(f"{name} fp16: loss scales {scales}, skipped "
                                f"{[r['step'] for r in rows if r['skipped']]}: expected 65536 "
                                "throughout, none skipped (as the reference)")
        if name == "mla+moe":
            moe_fp16_backoff(root, model, data, tokens, name, failures)


def moe_fp16_backoff(root, model, data, tokens, name, failures):
    """fp16 from 2^24 (the activation gradients overflow): the skipped steps, the back-off by
    GradScaler's rule, and the curve after it equal the reference's skipping the same steps."""
    init, interval = 2.0 ** 24, 4
    rows, _ = run(root, model, data, f"{name}-fp16-2e24", dtype="fp16", max_steps=MOE_STEPS,
                  init_loss_scale=init, loss_scale_growth_interval=interval)
    skipped = [r["step"] for r in rows if r["skipped"]]
    ref, _ = tu.reference_training(model, tokens, WINDOW, BATCH, 1, MOE_STEPS, "adamw", 3e-3,
                                   0.1, 1.0, 3407, dtype=torch.float16,
                                   scaler=GradScaler(init, interval), overflows=skipped)
    trained = [(a, b) for a, b in zip(rows, ref) if not a["skipped"]]
    w = max((tu.rel_err(a["loss"], b["loss"]) for a, b in trained), default=math.inf)
    print(f"{name} fp16 from 2^24: skipped {skipped}, scales (log2) "
          f"{[round(math.log2(r['loss_scale'])) for r in rows]}, worst loss difference from the "
          f"reference over the {len(trained)} trained steps {w:.2e}")
    if [r["loss_scale"] for r in rows] != [r["loss_scale"] for r in ref] or not skipped or \
            skipped[0] != 1 or len(trained) < 3 or w > TOL["fp16"]:
        failures.append(f"{name} fp16 from 2^24: skipped {skipped}, scales "
                        f"{[r['loss_scale'] for r in rows]} vs the reference's "
                        f"{[r['loss_scale'] for r in ref]}, worst loss difference {w:.2e}")


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
    moe_curves(root, data, tokens, failures)
    fp16_scaling(root, model, data, failures)
    handoff(root, model, data, straight, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
