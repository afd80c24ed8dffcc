"""--param_path accepts a model directory as AstrAI writes it: a config.json with every AstrAI
key (nulls included, model_type, neftune_alpha, rope_scaling ...) and bf16 safetensors without
lm_head.weight (tied embeddings). The first steps' loss and grad norm match the PyTorch reference
on the same bf16 weights."""

import json
import os
import sys

import numpy as np
import torch

import train_util as tu
from ref import st_io
from ref.model import param_shapes

torch.set_num_threads(2)
WINDOW, BATCH = 32, 4

ASTRAI_CONFIG = {
    "model_type": "autoregressive_lm", "neftune_alpha": 0.0, "vocab_size": 256,
    "hidden_size": 64, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "intermediate_size": 128,
    "tie_word_embeddings": True, "max_position_embeddings": 64, "rope_theta": None,
    "rope_scaling": None, "attn_type": "gqa", "num_attention_heads": 4,
    "num_key_value_heads": 1, "use_qk_norm": None, "use_gated_attention": None,
    "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None, "ffn_type": "mlp",
    "n_routed_experts": None, "n_shared_experts": None, "n_activated_experts": None,
    "topk_method": None,
}


def write_astrai_model(root):
    out = os.path.join(root, "astrai-model")
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(ASTRAI_CONFIG, f, indent=2)
    rng = np.random.default_rng(7)
    weights = {name: (np.ones(shape) if "norm" in name else rng.normal(0, 0.02, shape))
               .astype(np.float32) for name, shape in param_shapes(ASTRAI_CONFIG).items()
               if name != "lm_head.weight"}
    st_io.save(os.path.join(out, "model.safetensors"), weights, bf16=True)
    return out


def main():
    root = tu.tmpdir()
    model = write_astrai_model(root)
    data, tokens = tu.make_text_data(root, 40 * WINDOW + 1)
    ckpt = os.path.join(root, "ckpt")
    tu.train({"train_type": "seq", "param_path": model, "data_root_path": data,
              "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt,
              "optimizer": "adamw", "max_lr": 1e-3, "max_steps": 3, "threads": 2})
    ours = tu.metric_rows(tu.latest_checkpoint(ckpt))
    ref, _ = tu.reference_training(model, tokens, WINDOW, BATCH, 1, 3, "adamw", 1e-3, 0.1, 1.0,
                                   seed=3407)
    failures = []
    for a, b in zip(ours, ref):
        for key in ("loss", "grad_norm"):
            if tu.rel_err(a[key], b[key]) > 1e-4:
                failures.append(f"step {a['step']}: {key} {a[key]} vs reference {b[key]}")
    if len(ours) != 3:
        failures.append(f"{len(ours)} steps, expected 3")
    saved = st_io.load(os.path.join(tu.latest_checkpoint(ckpt), "model.safetensors"))
    if "lm_head.weight" in saved:
        failures.append("a tied model's checkpoint holds lm_head.weight")
    print(f"AstrAI bf16 directory: loss {ours[0]['loss']:.5f} vs reference {ref[0]['loss']:.5f}")
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
