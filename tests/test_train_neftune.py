"""NEFTune (--neftune_alpha) against the PyTorch reference: astrai draws its noise from a
counter-based generator (tests/ref/noise.py), so the reference adds the very same noise to its
input embeddings (std alpha/sqrt(T), AstrAI's scaling) and 8 optimizer steps agree within 1e-4.
Also: the noise changes the curve (alpha 0 gives another one), a second run repeats it bit for
bit, validation runs without noise, and a resumed run draws the noise of an uninterrupted one."""

import os
import sys

import torch

import train_util as tu

torch.set_num_threads(2)
WINDOW, BATCH, ALPHA = 16, 4, 5.0
N_BYTES = 32 * WINDOW + 1  # 32 windows: 8 optimizer steps


def run(root, name, extra):
    ckpt_dir = os.path.join(root, name)
    spec = {"train_type": "seq", "param_path": os.path.join(root, "model"),
            "data_root_path": os.path.join(root, "data"), "batch_per_device": BATCH,
            "window_size": WINDOW, "optimizer": "adamw", "max_lr": 3e-3, "ckpt_dir": ckpt_dir,
            "ckpt_interval": 4, "threads": 2}
    spec.update(extra)
    tu.train(spec)
    return tu.metric_rows(tu.latest_checkpoint(ckpt_dir))


def main():
    failures = []
    root = tu.tmpdir()
    model_dir = tu.make_model(root)
    _, tokens = tu.make_text_data(root, N_BYTES)
    noisy = run(root, "noisy", {"neftune_alpha": ALPHA})
    ref, _ = tu.reference_training(model_dir, tokens, WINDOW, BATCH, 1, 0, "adamw", 3e-3, 0.1,
                                   1.0, seed=3407, neftune_alpha=ALPHA)
    if len(noisy) != len(ref) or len(noisy) != 8:
        failures.append(f"{len(noisy)} steps, reference {len(ref)}, expected 8")
    for a, b in zip(noisy, ref):
        for key in ("loss", "grad_norm"):
            if tu.rel_err(a[key], b[key]) > 1e-4:
                failures.append(f"step {a['step']}: {key} {a[key]} vs reference {b[key]}")
    print("alpha 5: loss " + " ".join(f"{r['loss']:.5f}" for r in noisy))
    print("reference: loss " + " ".join(f"{r['loss']:.5f}" for r in ref))

    plain = run(root, "plain", {})
    if abs(plain[0]["loss"] - noisy[0]["loss"]) < 1e-4:
        failures.append(f"step 1: the noise changed nothing ({plain[0]['loss']} both)")
    again = run(root, "again", {"neftune_alpha": ALPHA})
    if [r["loss"] for r in again] != [r["loss"] for r in noisy]:
        failures.append("a second run with the same seed drew other noise")

    # Resumed at step 4: the rest of the curve is the uninterrupted one's.
    part = run(root, "part", {"neftune_alpha": ALPHA, "max_steps": 4})
    resumed = run(root, "part", {"neftune_alpha": ALPHA, "resume": True})
    if len(part) != 4 or [r["loss"] for r in resumed] != [r["loss"] for r in noisy]:
        failures.append(f"resume: {[r['loss'] for r in resumed]} vs {[r['loss'] for r in noisy]}")

    # Validation is evaluation, without noise: with max_lr 0 the weights stay the initial ones,
    # so runs with and without noise must report the same held-out losses.
    for name, alpha in (("v0", 0.0), ("v5", ALPHA)):
        run(root, name, {"neftune_alpha": alpha, "max_lr": 0.0, "val_split": 0.25, "val_step": 2})
    vals = [[r["val_loss"] for r in tu.all_metric_rows(tu.latest_checkpoint(os.path.join(root, n)))
             if r["type"] == "validation"] for n in ("v0", "v5")]
    if not vals[0] or vals[0] != vals[1]:
        failures.append(f"validation with noise {vals[1]} vs without {vals[0]}")
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
