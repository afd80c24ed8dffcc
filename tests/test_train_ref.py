"""astrai-train against the PyTorch reference: 20 optimizer steps with adamw and with muon give
the same loss curve (and grad norms, lr) within 1e-4 relative, the final weights agree, and the
checkpoint we wrote loads in the reference and gives the same loss."""

import os
import sys

import numpy as np
import torch

import train_util as tu
from ref.model import RefModel, loss as ref_loss

torch.set_num_threads(2)
WINDOW, BATCH = 32, 4
# 81 windows of 32 tokens: ceil(81/4) = 21 micro-batches, the last one of a single sample.
N_BYTES = 81 * WINDOW + 1


def check_optimizer(kind, failures):
    root = tu.tmpdir()
    model_dir = tu.make_model(root)
    data_dir, tokens = tu.make_text_data(root, N_BYTES)
    ckpt_dir = os.path.join(root, "ckpt")
    lr, wd = 3e-3, 0.1
    tu.train({"train_type": "seq", "param_path": model_dir, "data_root_path": data_dir,
              "batch_per_device": BATCH, "window_size": WINDOW, "optimizer": kind,
              "max_lr": lr, "weight_decay": wd, "max_grad_norm": 1.0, "ckpt_dir": ckpt_dir,
              "ckpt_interval": 1000, "threads": 2})
    ckpt = tu.latest_checkpoint(ckpt_dir)
    ours = tu.metric_rows(ckpt)
    ref_rows, ref_model = tu.reference_training(model_dir, tokens, WINDOW, BATCH, 1, 0, kind, lr,
                                                wd, 1.0, seed=3407)
    if len(ours) != len(ref_rows) or len(ours) != 21:
        failures.append(f"{kind}: {len(ours)} steps, reference {len(ref_rows)}, expected 21")
        return
    for a, b in zip(ours, ref_rows):
        for key in ("loss", "grad_norm", "lr"):
            if tu.rel_err(a[key], b[key]) > 1e-4:
                failures.append(f"{kind} step {a['step']}: {key} {a[key]} vs reference {b[key]}")
        if a["consumed_samples"] != b["consumed_samples"]:
            failures.append(f"{kind} step {a['step']}: consumed_samples differ")
    # The checkpoint loads in the reference: same weights, same loss on a batch.
    loaded = RefModel.from_dir(ckpt)
    ref_state = dict(ref_model.named_parameters())
    for name, p in loaded.named_parameters():
        err = (p - ref_state[name]).abs().max() / ref_state[name].abs().max()
        if err > 1e-3:
            failures.append(f"{kind}: checkpoint tensor {name} differs from the reference "
                            f"training by {float(err):.2e}")
    samples = tu.windows(tokens, WINDOW, WINDOW)[:8]
    x = torch.tensor(np.stack([s[0] for s in samples]))
    y = torch.tensor(np.stack([s[1] for s in samples]))
    with torch.no_grad():
        a = float(ref_loss(loaded.forward(x), y))
        b = float(ref_loss(ref_model.forward(x), y))
    if tu.rel_err(a, b) > 1e-4:
        failures.append(f"{kind}: loss of the loaded checkpoint {a} vs reference {b}")
    print(f"{kind}: 21 steps, loss {ours[0]['loss']:.4f} -> {ours[-1]['loss']:.4f}, "
          f"checkpoint loss {a:.5f} vs reference {b:.5f}")


def main():
    failures = []
    for kind in ("adamw", "muon"):
        check_optimizer(kind, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
