"""Pipeline parallelism (docs/design.md §13) on CPU ranks over shm: the same job gives the same
loss curve for any pp_size (10 optimizer steps against pp_size 1): seq and sft with packed
documents, dpo and grpo, pp 2 and pp 2 x ddp 2 / fsdp 2 (4 ranks), gpipe = 1f1b bit for bit, tied
and untied embeddings (pp 2 and 4), adamw and muon, NEFTune, gradient checkpointing, validation;
a pp run stopped at step 5 resumes under pp 1 (and a pp-1 checkpoint under pp 2, and a pp 2 x
fsdp 2 one under ddp 2) on the uninterrupted curve; the checkpoint is the same AstrAI files
whatever pp_size wrote it; bad pipeline settings exit 2 naming the key."""

import json
import os
import shutil
import sys

import train_util as tu

WINDOW = 16
N_BYTES = 160 * WINDOW + 1  # 160 windows: 10 steps of 16 samples
CONFIG = dict(tu.SMALL_CONFIG, num_hidden_layers=4)  # positions up to 32: packed documents
STRIP = ("tokens_per_s", "wall_time", "timestamp")


def train(root, model, data, name, nprocs=1, pp=1, mode="none", batch=2, accum=8, expect=0,
          **extra):
    """(checkpoint directory, stderr) of a run."""
    ckpt = os.path.join(root, name)
    args = {"train_type": "seq", "param_path": model, "data_root_path": data,
            "parallel_mode": mode, "nprocs": nprocs, "pp_size": pp, "batch_per_device": batch,
            "grad_accum_steps": accum, "window_size": WINDOW, "ckpt_dir": ckpt,
            "optimizer": "adamw", "max_lr": 3e-3, "threads": 1, "ckpt_interval": 5,
            "comm_timeout": 60}
    args.update(extra)
    return ckpt, tu.train(args, expect)[1]


def run(*args, **kw):
    return train(*args, **kw)[0]


def rows(ckpt):
    return tu.metric_rows(tu.latest_checkpoint(ckpt))


def compare(a, b, what, failures, tol=2e-5, exact=False):
    if len(a) != len(b) or len(a) < 5:
        failures.append(f"{what}: {len(a)} vs {len(b)} step rows")
        return
    worst = 0.0
    for x, y in zip(a, b):
        if x["step"] != y["step"] or x["consumed_samples"] != y["consumed_samples"]:
            failures.append(f"{what}: step/consumed_samples differ at step {x['step']}")
            return
        for key in set(x) - {"type", "epoch", "step", "consumed_samples", "tokens_per_s",
                             "wall_time"}:
            worst = max(worst, abs(x[key] - y[key]) / max(abs(y[key]), 1e-2))
    if (worst > 0) if exact else (worst > tol):
        failures.append(f"{what}: loss/grad_norm/lr differ by {worst:.2e} relative "
                        f"({'exact' if exact else f'> {tol}'})")
    print(f"{what}: {len(a)} steps, worst relative difference {worst:.2e}")


def curves(root, model, data, sft, failures):
    base = rows(run(root, model, data, "pp1"))
    compare(rows(run(root, model, data, "pp2", 2, 2)), base, "seq pp 2 vs pp 1", failures)
    gpipe = rows(run(root, model, data, "pp2-gpipe", 2, 2, pp_schedule="gpipe"))
    compare(gpipe, rows(os.path.join(root, "pp2")), "seq gpipe vs 1f1b", failures, exact=True)
    # 4 ranks: 2 replicas of 2 stages, against the same global batch on 2 ranks without pp.
    for mode in ("ddp", "fsdp"):
        two = rows(run(root, model, data, f"{mode}2", 2, 1, mode, batch=1))
        four = rows(run(root, model, data, f"pp2x{mode}2", 4, 2, mode, batch=1))
        compare(four, two, f"seq pp 2 x {mode} 2 vs {mode} 2", failures)
    sft1 = rows(run(root, model, sft, "sft-pp1", train_type="sft"))
    compare(rows(run(root, model, sft, "sft-pp2", 2, 2, train_type="sft")), sft1,
            "sft (packed documents) pp 2 vs pp 1", failures)
    for name, knobs in (("muon", {"optimizer": "muon"}), ("neftune", {"neftune_alpha": 5})):
        one = rows(run(root, model, data, f"{name}-pp1", **knobs))
        if [r["loss"] for r in one] == [r["loss"] for r in base]:
            failures.append(f"{name}: the same losses as without it (not applied?)")
        compare(rows(run(root, model, data, f"{name}-pp2", 2, 2, **knobs)), one,
                f"{name} pp 2 vs pp 1", failures)
    ck1 = rows(run(root, model, data, "ckpt-pp1", gradient_checkpointing="true"))
    compare(rows(run(root, model, data, "ckpt-pp2", 2, 2, gradient_checkpointing="true")), ck1,
            "gradient checkpointing pp 2 vs pp 1", failures)
    v1 = run(root, model, data, "val-pp1", val_split=0.1, val_step=3)
    v2 = run(root, model, data, "val-pp2", 2, 2, val_split=0.1, val_step=3)
    val = lambda ck: [r for r in tu.all_metric_rows(tu.latest_checkpoint(ck))
                      if r.get("type") == "validation"]
    a, b = val(v2), val(v1)
    if len(a) != len(b) or not a or any(tu.rel_err(x["val_loss"], y["val_loss"]) > 2e-5
                                        for x, y in zip(a, b)):
        failures.append(f"validation under pp 2 differs:\n{a}\n{b}")
    compare(rows(v2), rows(v1), "with validation: pp 2 vs pp 1", failures)


def tied(root, data, failures):
    model = tu.make_model(os.path.join(root, "tied"), dict(CONFIG, tie_word_embeddings=True))
    base = rows(run(root, model, data, "tied-pp1"))
    for pp in (2, 4):
        compare(rows(run(root, model, data, f"tied-pp{pp}", pp, pp)), base,
                f"tied embeddings pp {pp} vs pp 1", failures)
    # One embed_tokens.weight in the checkpoint, no lm_head.weight.
    names = tensor_names(os.path.join(tu.latest_checkpoint(os.path.join(root, "tied-pp2")),
                                      "model.safetensors"))
    if names != tensor_names(os.path.join(tu.latest_checkpoint(os.path.join(root, "tied-pp1")),
                                          "model.safetensors")) or "lm_head.weight" in names:
        failures.append(f"tied pp 2 checkpoint tensors: {sorted(names)}")


def pref(root, failures):
    """dpo and grpo: the frozen reference split like the policy, its pass before each step's."""
    import numpy as np
    import test_train_pref as tp
    model = tu.make_model(os.path.join(root, "pref"), dict(tp.CONFIG, num_hidden_layers=4))
    rng = np.random.default_rng(5)
    for kind, objects in (("dpo", tp.dpo_objects(rng, 20)), ("grpo", tp.grpo_objects(rng, 20))):
        jsonl, _ = tp.make_data(root, kind, objects, kind)
        common = dict(train_type=kind, window_size=tp.WINDOW, batch=1, accum=2, **tp.KNOBS[kind])
        base = rows(run(root, model, jsonl, f"{kind}-pp1", **common))
        compare(rows(run(root, model, jsonl, f"{kind}-pp2", 2, 2, **common)), base,
                f"{kind} pp 2 vs pp 1", failures, tol=1e-4)
        compare(rows(run(root, model, jsonl, f"{kind}-pp2x{2}", 4, 2, "ddp", **common)),
                rows(run(root, model, jsonl, f"{kind}-ddp2", 2, 1, "ddp", **common)),
                f"{kind} pp 2 x ddp 2 vs ddp 2", failures, tol=1e-4)


def tensor_names(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k for k in header if k != "__metadata__"}


def same_files(root, failures):
    """pp 2 writes the files pp 1 does: the same tensors in model and optimizer state."""
    a, b = (tu.latest_checkpoint(os.path.join(root, n)) for n in ("pp2", "pp1"))
    for name in ("model.safetensors", "optimizer.safetensors"):
        if tensor_names(os.path.join(a, name)) != tensor_names(os.path.join(b, name)):
            failures.append(f"{name}: pp 2 and pp 1 checkpoints hold different tensors")
    if sorted(os.listdir(a)) != sorted(os.listdir(b)):
        failures.append(f"checkpoint files differ: {os.listdir(a)} vs {os.listdir(b)}")


def resume(root, model, data, failures):
    straight = rows(os.path.join(root, "pp1"))
    for name, first, then in (("pp2-then-pp1", (2, 2), (1, 1)), ("pp1-then-pp2", (1, 1), (2, 2))):
        ck = run(root, model, data, name, *first, max_steps=5)
        run(root, model, data, name, *then, resume="true")
        compare(rows(ck), straight, f"stopped at 5 under pp {first[1]}, resumed under pp "
                f"{then[1]}", failures)
    # Another world size and parallel mode too: 4 ranks of pp 2 x fsdp 2, then ddp on 2.
    ck = run(root, model, data, "pp2xfsdp2-then-ddp2", 4, 2, "fsdp", batch=1, max_steps=5)
    run(root, model, data, "pp2xfsdp2-then-ddp2", 2, 1, "ddp", batch=1, resume="true")
    compare(rows(ck), rows(os.path.join(root, "ddp2")),
            "stopped at 5 under pp 2 x fsdp 2, resumed under ddp 2", failures)


def bad_input(root, model, data, failures):
    cases = [({"nprocs": 3, "pp": 2}, "pp_size"),
             ({"nprocs": 8, "pp": 8, "mode": "none"}, "pp_size"),  # 8 stages, 4 blocks
             ({"nprocs": 2, "pp": 2, "pp_schedule": "zigzag"}, "pp_schedule")]
    for i, (kw, key) in enumerate(cases):
        _, err = train(root, model, data, f"bad{i}", expect=2, **kw)
        if key not in err:
            failures.append(f"{kw}: exit 2 but the message does not name {key}: {err}")
    # --dry-run checks a pipeline job in one process.
    def dry_run(nprocs, expect):
        flags = {"train_type": "seq", "param_path": model, "data_root_path": data,
                 "nprocs": nprocs, "pp_size": nprocs, "parallel_mode": "none",
                 "ckpt_dir": os.path.join(root, "dry")}
        return tu.run([tu.binary("astrai-train"), "--dry-run"] +
                      [f"--{k}={v}" for k, v in flags.items()], expect)
    out, _ = dry_run(2, 0)
    if "pp_size = 2" not in out:
        failures.append(f"--dry-run of a pipeline: {out}")
    _, err = dry_run(8, 2)
    if "pp_size: 8 stages but the model has 4 decoder blocks" not in err:
        failures.append(f"--dry-run of 8 stages of 4 blocks: {err}")
    _, err = train(root, model, data, "bubble", 2, 2, accum=1, max_steps=1)
    if "bubble" not in err and "idle" not in err:
        failures.append(f"grad_accum_steps 1 < pp_size 2 gave no bubble warning: {err}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root, CONFIG)
    data, _ = tu.make_text_data(root, N_BYTES)
    sft = tu.make_sft_data(root, N_BYTES)
    curves(root, model, data, sft, failures)
    same_files(root, failures)
    resume(root, model, data, failures)
    tied(root, data, failures)
    pref(root, failures)
    bad_input(root, model, data, failures)
    if not failures:
        shutil.rmtree(root)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
