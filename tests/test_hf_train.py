"""test_hf_train: Hugging Face models trained by astrai equal transformers, fp32.

For each family (llama, llama with Llama 3's rope_scaling and tied embeddings, mistral,
mistral with a sliding window shorter than the sequence, llama with attention_bias (q/k/v/o
biases), qwen2 with q/k/v biases, qwen3 with qk-norm before RoPE), a tiny random model made by
transformers and saved as safetensors is imported with `astrai-model import-hf`; then
- step 0: the engine's logits, loss and every gradient (tests/model_dump) equal transformers'
  on the same batch within 1e-4 (the gradients mapped to AstrAI's names and RoPE layout);
- 10 steps: `astrai-train --param_path HF_DIR` (the HF directory itself, converted in memory)
  gives the loss, grad-norm and lr curve of transformers + torch.optim.AdamW with the same
  data order, clipping and cosine schedule (tests/train_util.reference_loop).

transformers 4.46 has no Qwen3: the qwen3 peer is transformers' LlamaForCausalLM with a
per-head RMSNorm between the q/k projections and RoPE, which is what Qwen3's attention does
(q_norm/k_norm over head_dim before the rotary embedding), saved under Qwen3's names.
"""
import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

import train_util as tu
from ref import st_io
from ref.hf_map import rel_err, to_astrai
from ref.model import loss as ref_loss

torch.set_num_threads(2)
TOL = 1e-4
WINDOW, BATCH, STEPS = 16, 4, 10

BASE = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
            rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3 rope_scaling tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=None)),
    "mistral sliding_window 5": (transformers.MistralConfig, transformers.MistralForCausalLM,
                                 dict(sliding_window=5)),  # shorter than the 16-token windows
    "llama attention_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                             dict(attention_bias=True)),  # q, k, v and o_proj biases
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        use_sliding_window=False)),
    "qwen3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
}


class HeadNorm(torch.nn.Module):
    """A projection followed by Qwen3's RMSNorm over each head (before RoPE)."""

    def __init__(self, proj, head_dim, eps):
        super().__init__()
        self.proj, self.head_dim, self.eps = proj, head_dim, eps
        self.weight = torch.nn.Parameter(torch.ones(head_dim))

    def forward(self, x):
        y = self.proj(x)
        h = y.view(*y.shape[:-1], -1, self.head_dim)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return h.reshape(y.shape)


def qwen3_peer(model, cfg):
    for layer in model.model.layers:
        att = layer.self_attn
        att.q_proj = HeadNorm(att.q_proj, cfg.head_dim, cfg.rms_norm_eps)
        att.k_proj = HeadNorm(att.k_proj, cfg.head_dim, cfg.rms_norm_eps)
    return model


def peer_params(family, model):
    """{HF name: parameter} of the peer (the qwen3 peer's HeadNorm under Qwen3's names)."""
    out = {}
    for name, p in model.named_parameters():
        if family == "qwen3":
            for q in ("q", "k"):
                if name.endswith(f"self_attn.{q}_proj.weight"):  # HeadNorm's own weight
                    name = name.replace(f"{q}_proj.weight", f"{q}_norm.weight")
                name = name.replace(f"{q}_proj.proj.", f"{q}_proj.")
        out[name] = p
    return out


def make_peer(family, seed):
    config_cls, model_cls, over = FAMILIES[family]
    cfg = config_cls(**dict(BASE, **over))
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    if family == "qwen3":
        model = qwen3_peer(model, cfg)
    # Non-trivial norms and biases (HF initialises them to 1 and 0), weights above std 0.02 so
    # that every nonlinearity matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3 / p.shape[1] ** 0.5)
    return cfg, model.eval()


def save_peer(family, cfg, model, out):
    """save_pretrained; the qwen3 peer as a Qwen3 checkpoint (config and tensor names)."""
    if family != "qwen3":
        model.save_pretrained(out, safe_serialization=True)
        return
    os.makedirs(out)
    state = {k: v.detach().contiguous() for k, v in peer_params(family, model).items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf = {k: v for k, v in cfg.to_dict().items()
          if k in BASE or k in ("bos_token_id", "eos_token_id", "initializer_range")}
    hf.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=cfg.head_dim,
              attention_bias=False, use_sliding_window=False, sliding_window=None,
              torch_dtype="float32")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f)


def batch(seed, T=WINDOW, B=2):
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(0, 256, (B, T)).astype(np.int32),
            "targets": rng.integers(0, 256, (B, T)).astype(np.int32)}


def check_step0(family, cfg, model, hf_dir, root, failures):
    astrai_dir = os.path.join(root, "astrai")
    tu.run([tu.binary("astrai-model"), "import-hf", hf_dir, "--out", astrai_dir])
    b = batch(11)
    inp, out = os.path.join(root, "inputs.safetensors"), os.path.join(root, "dump.safetensors")
    st_io.save(inp, b)
    tu.run([tu.binary("model_dump"), astrai_dir, inp, out])
    ours = st_io.load(out)
    logits = model(torch.tensor(b["inputs"]).long()).logits
    loss = ref_loss(logits, b["targets"])
    model.zero_grad()
    loss.backward()
    errors = {"logits": rel_err(ours["logits"], logits.detach().numpy()),
              "loss": rel_err(ours["loss"], [loss.item()])}
    D = cfg.hidden_size // cfg.num_attention_heads
    for name, p in peer_params(family, model).items():
        key, g = to_astrai(name, p.grad.detach(), D)
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        errors["grad." + key] = rel_err(ours["grad." + key], g.numpy())
    unmatched = {k for k in ours if k.startswith("grad.")} - set(errors)
    if unmatched:
        failures.append(f"{family}: engine gradients without a transformers peer: {unmatched}")
    worst = max(errors, key=errors.get)
    print(f"{family}: step 0 loss {loss.item():.6f}, {len(errors) - 2} gradients, worst {worst} "
          f"{errors[worst]:.2e}")
    failures += [f"{family}: {k} differs by {v:.2e}" for k, v in errors.items() if not v <= TOL]


def check_curve(family, model, hf_dir, root, failures):
    data_dir, tokens = tu.make_text_data(root, (STEPS * BATCH + 1) * WINDOW + 1)
    ckpt_dir = os.path.join(root, "ckpt")
    lr, wd = 3e-3, 0.1
    tu.train({"train_type": "seq", "param_path": hf_dir, "data_root_path": data_dir,
              "batch_per_device": BATCH, "window_size": WINDOW, "optimizer": "adamw",
              "max_lr": lr, "weight_decay": wd, "max_grad_norm": 1.0, "ckpt_dir": ckpt_dir,
              "ckpt_interval": 1000, "threads": 2, "max_steps": STEPS})
    ours = tu.metric_rows(tu.latest_checkpoint(ckpt_dir))
    samples = tu.windows(tokens, WINDOW, WINDOW)
    model.zero_grad(set_to_none=True)  # step 0's gradients
    model.train()

    def micro_loss(idx, consumed):
        x = torch.tensor(np.stack([samples[i][0] for i in idx])).long()
        y = torch.tensor(np.stack([samples[i][1] for i in idx]))
        return ref_loss(model(x).logits, y), {}

    torch.manual_seed(0)
    ref = tu.reference_loop(model, len(samples), BATCH, 1, STEPS, "adamw", lr, wd, 1.0, 3407,
                            micro_loss)
    if len(ours) != STEPS or len(ref) != STEPS:
        failures.append(f"{family}: {len(ours)} steps, reference {len(ref)}, expected {STEPS}")
        return
    worst = 0.0
    for a, r in zip(ours, ref):
        for key in ("loss", "grad_norm", "lr"):
            e = tu.rel_err(a[key], r[key])
            worst = max(worst, e)
            if e > TOL:
                failures.append(f"{family} step {a['step']}: {key} {a[key]} vs transformers "
                                f"{r[key]}")
    print(f"{family}: {STEPS} steps, loss {ours[0]['loss']:.4f} -> {ours[-1]['loss']:.4f} "
          f"(transformers {ref[-1]['loss']:.4f}), worst relative difference {worst:.2e}")


def main():
    failures = []
    for i, family in enumerate(FAMILIES):
        root = tu.tmpdir()
        hf_dir = os.path.join(root, "hf")
        cfg, model = make_peer(family, seed=100 + i)
        save_peer(family, cfg, model, hf_dir)
        before = {n: os.path.getmtime(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir)}
        check_step0(family, cfg, model, hf_dir, root, failures)
        check_curve(family, model, hf_dir, root, failures)
        after = {n: os.path.getmtime(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir)}
        if before != after:
            failures.append(f"{family}: --param_path changed the HF directory {hf_dir}")
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
