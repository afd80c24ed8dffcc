"""astrai-train --train_type dpo|grpo against the PyTorch reference (tests/ref/pref.py):

- 10 optimizer steps give the reference's rows (loss and metrics within 1e-4, lr exact, grad
  norm within 1e-3), with the records as `astrai-data prep` shards and as the .jsonl itself;
  and so do DeepSeekMoE models (gqa+moe, mla+moe) for both, mla+moe also under ep_size 2;
- ddp and fsdp with 2 ranks equal none for the same global batch (DPO: a mean over pairs;
  GRPO: a mean over the response tokens of all ranks' records, whose count the ranks sum);
- grad_accum_steps 2 equals the reference;
- a checkpoint and --resume continue the uninterrupted curve (the frozen reference stays the
  initial weights, not the checkpoint's);
- a synthetic preference (chosen continues the prompt, rejected shuffles it) is learned:
  reward accuracy >= 0.8 at the end;
- the same job through astraid completes with the same rows;
- bad records exit 2 naming file:line, and a group size other than the shards' exits 2.
"""

import os
import sys

import numpy as np
import torch

import train_util as tu
from ref.pref import METRICS, reference_pref_training
from test_model_ref import moe_keys
from test_pref_ref import dpo_records, grpo_records, metric_err, write_jsonl

torch.set_num_threads(2)
CONFIG = dict(tu.SMALL_CONFIG, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
WINDOW, N_RECORDS, BATCH, G = 24, 20, 2, 4  # 20 records, 2 per micro-batch: 10 steps
LR, WD, CLIP, SEED = 3e-3, 0.1, 1.0, 3407
KNOBS = {"dpo": {"dpo_beta": 0.2}, "grpo": {"group_size": G, "grpo_clip_eps": 0.1,
                                            "grpo_kl_coef": 0.3}}
REF_KNOBS = {"dpo": {"beta": 0.2}, "grpo": {"clip_eps": 0.1, "kl_coef": 0.3}}


def field(rng, n):
    """A text field of n tokens: printable ASCII text, or ids over the whole byte range."""
    if rng.random() < 0.5:
        return "".join(chr(c) for c in rng.integers(32, 127, n))
    return [int(x) for x in rng.integers(0, 256, n)]


def length(rng):
    """Mostly short, sometimes past the window (truncated)."""
    return int(rng.integers(WINDOW, WINDOW + 10) if rng.random() < 0.15 else rng.integers(1, 14))


def dpo_objects(rng, n):
    return [{"prompt": field(rng, length(rng)), "chosen": field(rng, length(rng)),
             "rejected": field(rng, length(rng))} for _ in range(n)]


def grpo_objects(rng, n):
    out = []
    for i in range(n):
        rewards = ([0.5] * G if i % 7 == 3 else  # some groups of equal rewards
                   [float(x) for x in np.round(rng.normal(size=G), 3)])
        out.append({"prompt": field(rng, length(rng)),
                    "responses": [field(rng, length(rng)) for _ in range(G)],
                    "rewards": rewards})
    return out


RECORDS = {"dpo": (dpo_objects, dpo_records), "grpo": (grpo_objects, grpo_records)}


def make_data(root, kind, objects, name):
    """(jsonl path, shard dir) of the same records."""
    jsonl = os.path.join(root, name + ".jsonl")
    write_jsonl(jsonl, objects)
    shards = os.path.join(root, name)
    group = ["--group_size", str(G)] if kind == "grpo" else []
    tu.run([tu.binary("astrai-data"), "prep", "--format", kind + "-jsonl", *group,
            "--out", shards, jsonl])
    return jsonl, shards


def train_args(model, kind, data, ckpt, **extra):
    a = {"train_type": kind, "param_path": model, "data_root_path": data,
         "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt,
         "ckpt_interval": 1000, "optimizer": "adamw", "max_lr": LR, "weight_decay": WD,
         "max_grad_norm": CLIP, "random_seed": SEED, "threads": 1, **KNOBS[kind]}
    a.update(extra)
    return a


def run(root, name, model, kind, data, **extra):
    ckpt = os.path.join(root, name)
    tu.train(train_args(model, kind, data, ckpt, **extra))
    return tu.metric_rows(tu.latest_checkpoint(ckpt))


def daemon_run(root, model, kind, data):
    """The same job submitted to astraid: completed, with the same rows."""
    import daemon_util as du
    droot = os.path.join(root, f"daemon-{kind}")
    os.makedirs(droot)
    d = du.Daemon(droot).start()
    with du.guarded(d):
        c = d.client()
        args = train_args(model, kind, data, os.path.join(root, f"{kind}-daemon"))
        job = c.call("submit", dict(args, name=kind))["job"]
        done = du.wait_job(c, job, ["completed"])
        c.close()
        d.stop()
    return tu.metric_rows(done["last_checkpoint"])


def reference(model, kind, records, batch=BATCH, accum=1, optimizer="adamw",
              lr=LR, n_epoch=1):
    rows, _ = reference_pref_training(model, kind, records, WINDOW, batch, accum, 0, optimizer,
                                      lr, WD, CLIP, SEED, REF_KNOBS[kind],
                                      n_epoch=n_epoch)
    return rows


def compare(ours, ref, kind, what, failures, tol=1e-4):
    """Row by row: loss and metrics within tol (relative), lr exact, grad_norm within 1e-3,
    same step and consumed samples."""
    if len(ours) != len(ref) or not ours:
        failures.append(f"{what}: {len(ours)} steps, reference {len(ref)}")
        return
    worst = {}
    for a, b in zip(ours, ref):
        if (a["step"], a["consumed_samples"]) != (b["step"], b["consumed_samples"]):
            failures.append(f"{what}: step/consumed_samples {a['step']}/"
                            f"{a['consumed_samples']} vs {b['step']}/{b['consumed_samples']}")
            return
        missing = [k for k in ("loss", "lr", "grad_norm") + METRICS[kind] if k not in a]
        if missing:
            failures.append(f"{what}: step {a['step']} has no {', '.join(missing)}")
            return
        errs = {"loss": (tu.rel_err(a["loss"], b["loss"]), tol), "lr": (tu.rel_err(a["lr"],
                b["lr"]), 1e-12), "grad_norm": (tu.rel_err(a["grad_norm"], b["grad_norm"]), 1e-3)}
        for k in METRICS[kind]:
            errs[k] = (metric_err(k, a[k], b[k]), tol)
        for k, (e, limit) in errs.items():
            if e > limit:
                failures.append(f"{what} step {a['step']}: {k} {a[k]} vs {b[k]}")
            worst[k] = max(worst.get(k, 0.0), e)
    print(f"{what}: {len(ours)} steps, loss {ours[0]['loss']:.5f} -> {ours[-1]['loss']:.5f}, "
          "worst " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def curves(root, model, kind, failures):
    rng = np.random.default_rng(5 if kind == "dpo" else 6)
    make_objects, to_records = RECORDS[kind]
    objects = make_objects(rng, N_RECORDS)
    records = to_records(objects)
    jsonl, shards = make_data(root, kind, objects, kind)
    ref = reference(model, kind, records)
    none = run(root, f"{kind}-none", model, kind, shards)
    compare(none, ref, kind, f"{kind} shards", failures)
    compare(daemon_run(root, model, kind, shards), none, kind, f"{kind} through astraid",
            failures, tol=1e-6)
    compare(run(root, f"{kind}-jsonl", model, kind, jsonl), ref, kind, f"{kind} jsonl", failures)
    compare(run(root, f"{kind}-accum", model, kind, shards, batch_per_device=1,
                grad_accum_steps=2), reference(model, kind, records, batch=1, accum=2),
            kind, f"{kind} accumulation 2", failures)
    # Two ranks of batch 1 are one batch of 2 (BATCH): the same rows as none and the reference.
    for mode in ("ddp", "fsdp"):
        ours = run(root, f"{kind}-{mode}", model, kind, shards, parallel_mode=mode, nprocs=2,
                   batch_per_device=BATCH // 2)
        compare(ours, ref, kind, f"{kind} {mode} 2 ranks", failures)
        compare(ours, none, kind, f"{kind} {mode} vs none", failures, tol=1e-5)
    # Stopped at step 5 (checkpoint), resumed: the same rows as the uninterrupted run.
    name = f"{kind}-resume"
    first = run(root, name, model, kind, shards, max_steps=5)
    if len(first) != 5 or not tu.latest_checkpoint(os.path.join(root, name)).endswith("_step_5"):
        failures.append(f"{kind}: the run with max_steps 5 did not stop at step 5")
    resumed = run(root, name, model, kind, shards, resume="true")
    compare(resumed, none, kind, f"{kind} stopped at 5 and resumed", failures, tol=1e-6)


# Tiny DeepSeekMoE models (docs/design.md §7a): the policy and the frozen reference both route
# their tokens through the experts (GQA and MLA attention).
MOE_CONFIGS = {
    "gqa+moe": dict(CONFIG, **moe_keys(4, 1, 2), intermediate_size=32),
    "mla+moe": dict(CONFIG, attn_type="mla", kv_lora_rank=16, qk_nope_head_dim=6,
                    qk_rope_head_dim=2, num_key_value_heads=1, **moe_keys(4, 2, 2),
                    intermediate_size=32),
}


def moe_curves(root, failures):
    """10 steps of dpo and grpo on each MoE model against the reference (the records of
    curves()); mla+moe also with its experts split over 2 ranks (ep_size 2)."""
    for name, cfg in MOE_CONFIGS.items():
        model = tu.make_model(os.path.join(root, name), cfg)
        for kind in ("dpo", "grpo"):
            rng = np.random.default_rng(5 if kind == "dpo" else 6)
            make_objects, to_records = RECORDS[kind]
            objects = make_objects(rng, N_RECORDS)
            _, shards = make_data(root, kind, objects, f"{kind}-{name}-data")
            ref = reference(model, kind, to_records(objects))
            compare(run(root, f"{kind}-{name}", model, kind, shards), ref, kind,
                    f"{kind} {name}", failures)
            if name == "mla+moe":  # expert parallelism: the reference's forwards exchange too
                compare(run(root, f"{kind}-{name}-ep2", model, kind, shards, parallel_mode="ddp",
                            nprocs=2, batch_per_device=BATCH // 2, ep_size=2), ref, kind,
                        f"{kind} {name} ep 2", failures)


def synthetic_objects(rng, n):
    """chosen continues the prompt's pattern (ascending letters, or a repeated unit); rejected
    is the same bytes shuffled."""
    out = []
    for i in range(n):
        plen = int(rng.integers(6, 12))
        if i % 2:
            start = int(rng.integers(0, 26))
            text = "".join(chr(97 + (start + k) % 26) for k in range(plen + 8))
        else:
            unit = "".join(chr(97 + int(x)) for x in rng.integers(0, 26, int(rng.integers(2, 5))))
            text = unit * 8
        chosen = text[plen:plen + 8]
        out.append({"prompt": text[:plen], "chosen": chosen,
                    "rejected": "".join(rng.permutation(list(chosen)))})
    return out


def synthetic(root, model, failures):
    rng = np.random.default_rng(7)
    jsonl = os.path.join(root, "synthetic.jsonl")
    write_jsonl(jsonl, synthetic_objects(rng, 60))
    rows = run(root, "synthetic", model, "dpo", jsonl, batch_per_device=4, n_epoch=2,
               max_lr=1e-3, dpo_beta=0.1, window_size=32)
    acc = float(np.mean([r["reward_accuracy"] for r in rows[-5:]]))
    print(f"synthetic preference: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> "
          f"{rows[-1]['loss']:.4f}, reward accuracy of the last 5 steps {acc:.2f}")
    if len(rows) != 30 or not acc >= 0.8:
        failures.append(f"synthetic preference: {len(rows)} steps (expected 30), reward "
                        f"accuracy {acc} at the end (expected >= 0.8)")


def bad_data(root, model, failures):
    good_dpo = {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}
    good_grpo = {"prompt": "1+1", "responses": ["2", "3", "two", "11"],
                 "rewards": [1.0, 0.0, 1.0, 0.0]}
    cases = [
        ("dpo", [good_dpo, good_dpo, {"prompt": "Hi", "chosen": "Hello."}], 3, "rejected"),
        ("grpo", [good_grpo, dict(good_grpo, rewards=[1.0, 0.0, 1.0])], 2, "rewards"),
        ("dpo", [good_dpo, dict(good_dpo, chosen=[72, 300, 33])], 2, "chosen"),
    ]
    for i, (kind, objects, line, key) in enumerate(cases):
        path = os.path.join(root, f"bad{i}.jsonl")
        write_jsonl(path, objects)
        _, err = tu.train(train_args(model, kind, path, os.path.join(root, f"bad{i}")),
                          expect=2)
        if f"{path}:{line}" not in err or key not in err:
            failures.append(f"bad record {i}: stderr does not name {path}:{line} and {key}: "
                            f"{err.strip()}")
    # grpo shards of 4 responses per record, trained with --group_size 3.
    _, shards = make_data(root, "grpo", [good_grpo] * 4, "grpo-g4")
    _, err = tu.train(train_args(model, "grpo", shards, os.path.join(root, "bad-g"),
                                 group_size=3), expect=2)
    if shards not in err or "group_size 3" not in err or "group_size 4" not in err:
        failures.append(f"group size 3 on shards of 4: stderr does not name {shards} and both "
                        f"sizes: {err.strip()}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root, CONFIG)
    for kind in ("dpo", "grpo"):
        curves(root, model, kind, failures)
    moe_curves(root, failures)
    synthetic(root, model, failures)
    bad_data(root, model, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
