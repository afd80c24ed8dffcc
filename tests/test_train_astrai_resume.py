"""AstrAI's files as it writes them (commit c8b1e40):

- metric.jsonl rows have AstrAI's shapes: {"type": "step"|"epoch"|"validation", "timestamp",
  "epoch", "step", "consumed_samples", ...metrics}, an epoch row at the end of each epoch;
- config.json carries every key AstrAI's AutoRegressiveLMConfig writes;
- --resume from a checkpoint directory laid out exactly as AstrAI writes one (meta.json
  without "step", metric rows with epoch and validation rows and a first row without
  grad_norm, optimizer.pt and scheduler.pt as opaque bytes, no optimizer.safetensors /
  sampler.json / scheduler.json) continues at the right step, sample and learning rate: the
  first resumed step equals the straight run's step (same weights, same batch, same lr); the
  optimizer state starts fresh with one warning line; the pickles are never read;
- a malformed row is an error naming metric.jsonl and the line (exit 2)."""

import json
import os
import re
import shutil
import sys

import train_util as tu

WINDOW, BATCH = 32, 4
N_BYTES = 80 * WINDOW + 1  # 80 windows: 20 optimizer steps per epoch
N_EPOCH = 2

# AstrAI's AutoRegressiveLMConfig fields (astrai/config/model_config.py), i.e. the keys of its
# config.json.
ASTRAI_CONFIG_KEYS = [
    "model_type", "neftune_alpha", "vocab_size", "hidden_size", "num_hidden_layers",
    "rms_norm_eps", "intermediate_size", "tie_word_embeddings", "max_position_embeddings",
    "rope_theta", "rope_scaling", "attn_type", "num_attention_heads", "num_key_value_heads",
    "use_qk_norm", "use_gated_attention", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "ffn_type", "n_routed_experts", "n_shared_experts",
    "n_activated_experts", "topk_method",
]
# The first keys of every AstrAI metric row, in its order (MetricCallback._append).
ASTRAI_ROW_KEYS = ["type", "timestamp", "epoch", "step", "consumed_samples"]
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$")


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt,
         "ckpt_interval": 1000, "max_lr": 3e-3, "n_epoch": N_EPOCH, "threads": 2}
    a.update(extra)
    return a


def check_row_shapes(ckpt, failures):
    rows = tu.all_metric_rows(ckpt)
    for i, r in enumerate(rows, 1):
        if list(r)[:5] != ASTRAI_ROW_KEYS:
            failures.append(f"row {i}: keys {list(r)}, expected AstrAI's {ASTRAI_ROW_KEYS} first")
        elif not TIMESTAMP.match(r["timestamp"]):
            failures.append(f"row {i}: timestamp {r['timestamp']!r} is not AstrAI's format")
    steps = [r for r in rows if r.get("type") == "step"]
    if [r["step"] for r in steps] != list(range(1, 20 * N_EPOCH + 1)):
        failures.append(f"step rows: steps {[r['step'] for r in steps]}")
    for r in steps:
        if set(r) != set(ASTRAI_ROW_KEYS) | {"loss", "lr", "grad_norm"}:
            failures.append(f"step row {r['step']}: keys {sorted(r)}")
            break
    epochs = [(r["epoch"], r["step"], r["consumed_samples"], len(r))
              for r in rows if r.get("type") == "epoch"]
    want = [(e, 20 * (e + 1), 80 * (e + 1), 5) for e in range(N_EPOCH)]
    if epochs != want:
        failures.append(f"epoch rows (epoch, step, consumed_samples, keys) {epochs}, want {want}")
    # AstrAI appends its epoch row after the epoch's last step row.
    for e, step, _, _ in epochs:
        i = next(i for i, r in enumerate(rows) if r.get("type") == "epoch" and r["epoch"] == e)
        if rows[i - 1].get("type") != "step" or rows[i - 1]["step"] != step:
            failures.append(f"epoch {e} row does not follow the step {step} row")


def check_config_keys(ckpt, failures):
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    missing = [k for k in ASTRAI_CONFIG_KEYS if k not in cfg]
    if missing:
        failures.append(f"config.json lacks AstrAI's keys {missing}")


def astrai_metric_rows(straight_rows, step, per_epoch=20):
    """metric.jsonl as AstrAI's MetricCallback writes it for a run from step 0 to `step` with
    validation every 20 steps: a validation row before the step row it runs at, grad_norm one
    step late (none in the first row), an epoch row after each epoch's last step, and one row
    with a key we do not know."""
    rows = []
    for r in straight_rows:
        if r["step"] > step:
            break
        head = {"timestamp": "2026-07-30T00:49:04", "epoch": r["epoch"], "step": r["step"],
                "consumed_samples": r["consumed_samples"]}
        if r["step"] % 20 == 1:
            rows.append({"type": "validation", **head, "val_loss": 5.25 + r["step"]})
        row = {"type": "step", **head, "loss": r["loss"], "lr": r["lr"]}
        if r["step"] > 1:
            row["grad_norm"] = straight_rows[r["step"] - 2]["grad_norm"]
        if r["step"] == 3:
            row["tokens_seen"] = 384  # a column of a newer AstrAI: ignored
        rows.append(row)
        if r["step"] % per_epoch == 0 and r["step"] < step:  # on_epoch_end follows the flush
            rows.append({"type": "epoch", **head})
    return rows


def write_astrai_checkpoint(root, weights_from, straight_rows, step, world=1):
    """The directory AstrAI's CheckpointCallback + MetricCallback write at `step` of a run of
    `world` ranks (ddp for several: 20 / world steps an epoch)."""
    per_epoch = 20 // world
    epoch = (step - 1) // per_epoch
    d = os.path.join(root, f"epoch_{epoch}_step_{step}")
    os.makedirs(d)
    shutil.copy(os.path.join(weights_from, "model.safetensors"), d)
    with open(os.path.join(weights_from, "config.json")) as f:
        ours = json.load(f)
    config = {k: ours.get(k) for k in ASTRAI_CONFIG_KEYS}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    meta = {"epoch": epoch, "consumed_samples": step * BATCH * world,
            "timestamp": "2026-07-30T00:49:04",
            "strategy": "seq", "n_epoch": N_EPOCH, "batch_per_device": BATCH,
            "grad_accum_steps": 1, "max_grad_norm": 1.0, "gradient_checkpointing_modules": [],
            "compile_mode": None, "start_epoch": 0, "start_samples": 0, "ckpt_dir": root,
            "ckpt_interval": step, "lora": None, "metrics": ["loss", "lr", "grad_norm"],
            "random_seed": 3407, "num_workers": 0, "prefetch_factor": None,
            "pin_memory": False, "nprocs": world, "backend": "nccl", "master_addr": "localhost",
            "master_port": "29500", "parallel_mode": "ddp" if world > 1 else "none",
            "start_method": "spawn",
            "device_type": "cuda", "val_split": 0.05, "val_step": 20, "neftune_alpha": 0.0,
            "rollout_interval": 512, "rollout_temperature": 0.7, "rollout_top_k": 0,
            "rollout_top_p": 0.9, "rollout_max_tokens": 1024, "executor_kwargs": {},
            "extra_kwargs": {}}
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    # torch.save output is a zip of pickles; opaque bytes here (never to be read).
    for name in ("optimizer.pt", "scheduler.pt"):
        with open(os.path.join(d, name), "wb") as f:
            f.write(b"PK\x03\x04" + b"\x80\x02cos\nsystem\n(S'exit 3'\ntR." * 8)
    with open(os.path.join(d, "metric.jsonl"), "w") as f:
        for r in astrai_metric_rows(straight_rows, step, per_epoch):
            f.write(json.dumps(r) + "\n")
    return d


def check_resume(root, model, data, straight_rows, step, failures):
    """AstrAI's checkpoint at `step` (weights of our run stopped there), resumed to the end."""
    stopped = os.path.join(root, f"stopped-{step}")
    tu.train(args(model, data, stopped, max_steps=step))
    astrai_dir = os.path.join(root, f"astrai-{step}")
    ck = write_astrai_checkpoint(astrai_dir, tu.latest_checkpoint(stopped), straight_rows, step)
    _, err = tu.train(args(ck, data, astrai_dir, resume="true"))
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    if len(warnings) != 1 or "optimizer.pt" not in warnings[0] or "pickle" not in warnings[0]:
        failures.append(f"step {step}: expected one warning about optimizer.pt: {warnings}")
    if f"step {step} (from the directory name)" not in err:
        failures.append(f"step {step}: resume line not found: {err[-500:]}")
    final = tu.latest_checkpoint(astrai_dir)
    if os.path.basename(final) != f"epoch_{N_EPOCH - 1}_step_{20 * N_EPOCH}":
        failures.append(f"step {step}: final checkpoint {final}")
        return
    rows = tu.metric_rows(final)
    if [r["step"] for r in rows] != list(range(1, 20 * N_EPOCH + 1)):
        failures.append(f"step {step}: steps {[r['step'] for r in rows]}")
        return
    first, want = rows[step], straight_rows[step]
    for key in ("epoch", "consumed_samples", "lr"):
        if first[key] != want[key]:
            failures.append(f"step {step + 1}: {key} {first[key]} != straight run's {want[key]}")
    # Same weights and same batch: the same loss and gradient (the optimizer state is fresh,
    # so only this first resumed step equals the straight run's).
    for key in ("loss", "grad_norm"):
        if tu.rel_err(first[key], want[key]) > 1e-6:
            failures.append(f"step {step + 1}: {key} {first[key]} != straight run's {want[key]}")
    for r, s in zip(rows[step:], straight_rows[step:]):
        if r["lr"] != s["lr"] or r["consumed_samples"] != s["consumed_samples"]:
            failures.append(f"step {r['step']}: lr/consumed_samples differ from the straight run")
            break
    # AstrAI's rows are kept as they were: no grad_norm in the first, validation rows.
    kept = tu.all_metric_rows(final)
    if "grad_norm" in kept[1] or kept[0].get("type") != "validation":
        failures.append(f"step {step}: AstrAI's first rows changed: {kept[:2]}")
    epochs = [(r["epoch"], r["step"]) for r in kept if r.get("type") == "epoch"]
    # At an epoch's end AstrAI's position is the next epoch's start: that epoch's row was
    # not in AstrAI's file and is not written by the resumed run either.
    if epochs != [(e, 20 * (e + 1)) for e in range(N_EPOCH) if 20 * (e + 1) != step]:
        failures.append(f"step {step}: epoch rows {epochs}")
    print(f"AstrAI checkpoint at step {step}: step {step + 1} loss {first['loss']:.6f} "
          f"(straight {want['loss']:.6f}), lr {first['lr']:.6e}")
    return ck


def check_resume_ranks(root, model, data, failures):
    """Two ddp ranks: AstrAI's checkpoint at step 5 of epoch 1 (10 steps an epoch), resumed by
    two ranks, continues the two-rank straight run at its step, samples and lr."""
    ranks = {"nprocs": 2, "parallel_mode": "ddp"}
    straight = os.path.join(root, "straight-2")
    tu.train(args(model, data, straight, **ranks))
    straight_rows = tu.metric_rows(tu.latest_checkpoint(straight))
    stopped = os.path.join(root, "stopped-2")
    tu.train(args(model, data, stopped, max_steps=15, **ranks))
    astrai_dir = os.path.join(root, "astrai-2")
    ck = write_astrai_checkpoint(astrai_dir, tu.latest_checkpoint(stopped), straight_rows, 15, 2)
    tu.train(args(ck, data, astrai_dir, resume="true", **ranks))
    rows = tu.metric_rows(tu.latest_checkpoint(astrai_dir))
    if [r["step"] for r in rows] != list(range(1, 10 * N_EPOCH + 1)):
        failures.append(f"2 ranks: steps {[r['step'] for r in rows]}")
        return
    first, want = rows[15], straight_rows[15]
    for key in ("epoch", "consumed_samples", "lr"):
        if first[key] != want[key]:
            failures.append(f"2 ranks, step 16: {key} {first[key]} != straight run's {want[key]}")
    for key in ("loss", "grad_norm"):
        if tu.rel_err(first[key], want[key]) > 1e-6:
            failures.append(f"2 ranks, step 16: {key} {first[key]} != straight {want[key]}")
    print(f"AstrAI checkpoint of 2 ranks at step 15: step 16 loss {first['loss']:.6f} "
          f"(straight {want['loss']:.6f}), consumed_samples {first['consumed_samples']}")


def check_renamed(root, data, ck, straight_rows, failures):
    """A directory not named epoch_E_step_S: the step comes from consumed_samples."""
    renamed = os.path.join(root, "renamed", "latest")
    shutil.copytree(ck, renamed)
    _, err = tu.train(args(renamed, data, os.path.join(root, "renamed"), resume="true"))
    if "step 25 (from consumed_samples)" not in err:
        failures.append(f"renamed directory: step not derived from consumed_samples: {err[-400:]}")
    rows = tu.metric_rows(tu.latest_checkpoint(os.path.join(root, "renamed")))
    if len(rows) != 40 or rows[25]["lr"] != straight_rows[25]["lr"]:
        failures.append("renamed directory: the resumed run differs")


def check_malformed(root, data, ck, failures):
    bad = os.path.join(root, "bad", os.path.basename(ck))
    shutil.copytree(ck, bad)
    path = os.path.join(bad, "metric.jsonl")
    with open(path) as f:
        lines = f.readlines()
    lines[2] = '{"type": "step", "epoch": 0, "step": "three"}\n'
    with open(path, "w") as f:
        f.writelines(lines)
    _, err = tu.train(args(bad, data, os.path.join(root, "bad"), resume="true"), expect=2)
    if f"{path}:3: not a metric row" not in err or '"step"' not in err:
        failures.append(f"malformed row: message does not name the file and line: {err[-300:]}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    straight = os.path.join(root, "straight")
    tu.train(args(model, data, straight))
    final = tu.latest_checkpoint(straight)
    check_row_shapes(final, failures)
    check_config_keys(final, failures)
    straight_rows = tu.metric_rows(final)
    # Mid-epoch (epoch 1, 5 samples in) and at an epoch's end (AstrAI then starts epoch 1).
    ck = None
    for step in (25, 20):
        c = check_resume(root, model, data, straight_rows, step, failures)
        ck = ck or c
    check_resume_ranks(root, model, data, failures)
    if ck:
        check_renamed(root, data, ck, straight_rows, failures)
        check_malformed(root, data, ck, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
