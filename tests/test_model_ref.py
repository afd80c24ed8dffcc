"""test_model_ref: the C model (tests/model_dump) against the PyTorch reference
(tests/ref/model.py): logits, loss and every parameter gradient, fp32, for several
configs (GQA / MHA, tied / untied, qk-norm after or before RoPE, gated attention, q/k/v
biases, Llama 3 rope scaling, SFT masks with packed documents, label smoothing, a long window
over several attention tiles, sliding-window attention with packed documents and o_proj biases;
MLA with K = 1, 1 < K < H and K = H, DeepSeekMoE with 0, 1 and 2 shared experts, NTK
rope_scaling with and without "type" and an unknown type), plus load errors naming the tensor
at fault. tests/test_moe_ref.py adds the router's edge cases (ties, unused experts)."""
import json
import os
import subprocess
import tempfile

import numpy as np
import torch

from ref import st_io
from ref.model import RefModel, loss, param_shapes

torch.set_num_threads(2)
BUILD = os.environ["ASTRAI_BUILD"]
DUMP = os.path.join(BUILD, "model_dump")
TOL = 1e-4


def make_config(**over):
    cfg = dict(vocab_size=67, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
               max_position_embeddings=128, rope_theta=None, tie_word_embeddings=False,
               use_qk_norm=False, use_gated_attention=False, attn_type="gqa", ffn_type="mlp")
    cfg.update(over)
    return cfg


def moe_keys(n_routed=4, n_shared=1, k=2):
    """The config keys of DeepSeekMoE feed-forward (docs/design.md §7a)."""
    return dict(ffn_type="moe", n_routed_experts=n_routed, n_shared_experts=n_shared,
                n_activated_experts=k, topk_method="greedy")


def moe_config(n_routed=4, n_shared=1, k=2, **over):
    return make_config(**moe_keys(n_routed, n_shared, k), **over)


def mla_config(nope, rope, rank, **over):
    """make_config with multi-head latent attention: heads * (nope + rope) = hidden_size."""
    cfg = make_config(attn_type="mla", kv_lora_rank=rank, qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, **over)
    assert cfg["num_attention_heads"] * (nope + rope) == cfg["hidden_size"], cfg
    return cfg


def random_weights(cfg, rng):
    """Larger than AstrAI's init (std 0.02) so every nonlinearity is exercised."""
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif len(shape) == 1:
            out[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.3 * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return out


def packed_positions(T, starts):
    pos = np.zeros(T, np.int32)
    bounds = list(starts) + [T]
    for a, b in zip(bounds[:-1], bounds[1:]):
        pos[a:b] = np.arange(b - a)
    return pos


def write_model(d, cfg, weights, bf16=False):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    st_io.save(os.path.join(d, "model.safetensors"), weights, bf16=bf16)


def run_dump(d, batch, smoothing):
    inp = os.path.join(d, "inputs.safetensors")
    out = os.path.join(d, "out.safetensors")
    st_io.save(inp, {k: v.astype(np.int32) for k, v in batch.items()})
    r = subprocess.run([DUMP, d, inp, out, repr(smoothing)], capture_output=True, text=True)
    return r, (st_io.load(out) if r.returncode == 0 else None)


def rel_err(got, ref):
    ref = np.asarray(ref, np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    return np.abs(np.asarray(got, np.float64) - ref).max() / scale


def make_case(cfg, B, T, seed, sft=False, doc_starts=None, edit_weights=None):
    """(weights, batch) of a case: random weights (edit_weights(weights, rng) may change them),
    random tokens, a loss mask when sft, packed documents' position ids from doc_starts."""
    rng = np.random.default_rng(seed)
    weights = random_weights(cfg, rng)
    if edit_weights is not None:
        edit_weights(weights, rng)
    V = cfg["vocab_size"]
    batch = {"inputs": rng.integers(0, V, (B, T)), "targets": rng.integers(0, V, (B, T))}
    if sft:
        batch["loss_mask"] = (rng.random((B, T)) < 0.6).astype(np.int32)
    if doc_starts is not None:
        batch["position_ids"] = np.stack([packed_positions(T, s) for s in doc_starts])
    return weights, batch


def check_case(name, cfg, B, T, seed, smoothing=0.0, sft=False, doc_starts=None, bf16=False,
               edit_weights=None, zero_floor=None, check_ref=None):
    """check_ref(ref): called after the reference's forward (asserts what the case is about).
    zero_floor: a gradient whose reference is below zero_floor x the largest of all the
    reference gradients is numerically zero (the router's under top-1 routing, where each
    weight is p/p = 1): its error is taken against that largest gradient."""
    weights, batch = make_case(cfg, B, T, seed, sft, doc_starts, edit_weights)
    with tempfile.TemporaryDirectory() as d:
        write_model(d, cfg, weights, bf16)
        r, out = run_dump(d, batch, smoothing)
        assert r.returncode == 0, f"{name}: model_dump failed: {r.stderr}"
        ref = RefModel.from_dir(d)
    logits = ref.forward(batch["inputs"], batch.get("position_ids"))
    if check_ref is not None:
        check_ref(ref)
    l = loss(logits, batch["targets"], batch.get("loss_mask"), smoothing)
    l.backward()
    errors = {"logits": rel_err(out["logits"], logits.detach().numpy()),
              "loss": rel_err(out["loss"], [l.item()])}
    grads = {k: g.numpy() for k, g in ref.grads().items()}
    largest = max(float(np.abs(g).max()) for g in grads.values())
    for k, g in grads.items():
        if zero_floor is not None and np.abs(g).max() < zero_floor * largest:
            errors["grad." + k] = np.abs(out["grad." + k]).max() / largest
        else:
            errors["grad." + k] = rel_err(out["grad." + k], g)
    missing = set(out) - set(errors)
    assert not missing, f"{name}: unexpected dump tensors {missing}"
    worst = max(errors, key=errors.get)
    print(f"{name}: loss {l.item():.6f}, worst {worst} {errors[worst]:.2e}")
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"{name}: outside {TOL}: {bad}"


def check_load_errors():
    cfg = make_config()
    rng = np.random.default_rng(7)
    batch = {"inputs": rng.integers(0, 67, (1, 4)), "targets": rng.integers(0, 67, (1, 4))}
    cases = []
    w = random_weights(cfg, rng)
    w["layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    cases.append((w, "layers.0.mlp.extra.weight"))
    w = random_weights(cfg, rng)
    del w["layers.1.post_attention_norm.weight"]
    cases.append((w, "layers.1.post_attention_norm.weight"))
    w = random_weights(cfg, rng)
    w["layers.0.attention.k_proj.weight"] = np.zeros((32, 32), np.float32)
    cases.append((w, "layers.0.attention.k_proj.weight"))
    for weights, fragment in cases:
        with tempfile.TemporaryDirectory() as d:
            write_model(d, cfg, weights)
            r, _ = run_dump(d, batch, 0.0)
        assert r.returncode == 2 and fragment in r.stderr and "model.safetensors" in r.stderr, (
            fragment, r.returncode, r.stderr)
    print("load errors: ok")


LLAMA3 = dict(rope_type="llama3", type="llama3", factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=16)

# MLA, DeepSeekMoE and NTK rope_scaling: (name, config, check_case arguments, whether AstrAI's
# own modules can run it: its MLA only broadcasts K = 1 or K = H, and it has no Llama 3 rule).
MLA_MOE_CASES = [
    ("gqa moe S=1 k=2 untied", moe_config(), dict(B=2, T=16, seed=21), True),
    ("gqa moe S=0 k=2 tied qknorm gated sft packed",
     moe_config(6, 0, 2, tie_word_embeddings=True, use_qk_norm=True, use_gated_attention=True),
     dict(B=2, T=24, seed=22, sft=True, doc_starts=[[0, 9, 10], [0, 17]]), True),
    ("gqa moe S=2 k=3 mha ntk(type) smoothing",
     moe_config(5, 2, 3, num_key_value_heads=4, rope_theta=500.0,
                rope_scaling={"type": "ntk", "factor": 4.0}),
     dict(B=2, T=20, seed=23, smoothing=0.1), True),
    ("gqa moe S=2 k=1 K=1 packed", moe_config(4, 2, 1, num_key_value_heads=1),
     dict(B=2, T=16, seed=24, doc_starts=[[0, 5], [0, 1, 12]], zero_floor=1e-6), True),
    ("gqa mlp ntk without type", make_config(rope_scaling={"factor": 16.0}),
     dict(B=2, T=32, seed=25), True),
    ("gqa mlp unknown rope_scaling type (base unchanged)",
     make_config(rope_scaling={"type": "yarn", "factor": 16.0}), dict(B=2, T=32, seed=26), True),
    ("mla mlp K=1 untied", mla_config(4, 4, 12, num_key_value_heads=1),
     dict(B=2, T=20, seed=31), True),
    ("mla mlp K=H tied qknorm gated sft packed smoothing",
     mla_config(6, 2, 8, num_key_value_heads=4, tie_word_embeddings=True, use_qk_norm=True,
                use_gated_attention=True),
     dict(B=3, T=20, seed=32, sft=True, doc_starts=[[0, 7, 8, 15], [0], [0, 1, 19]],
          smoothing=0.1), True),
    ("mla mlp K=2<H=4 gated ntk without type",
     mla_config(2, 6, 16, num_key_value_heads=2, use_gated_attention=True,
                rope_scaling={"factor": 8.0}),
     dict(B=2, T=24, seed=33), False),
    ("mla mlp H=2 K=1 D=16 qknorm ntk(type) packed T=40",
     mla_config(10, 6, 20, num_attention_heads=2, num_key_value_heads=1, use_qk_norm=True,
                rope_scaling={"type": "ntk", "factor": 4.0}),
     dict(B=2, T=40, seed=34, doc_starts=[[0, 13, 30], [0, 1]]), True),
    ("mla moe K=1 S=2 qknorm gated sft packed bf16 weights",
     mla_config(4, 4, 12, num_key_value_heads=1, use_qk_norm=True, use_gated_attention=True,
                **moe_keys(4, 2, 2)),
     dict(B=2, T=24, seed=41, sft=True, doc_starts=[[0, 11], [0, 3, 4, 20]], bf16=True), True),
    ("mla moe K=H S=0 k=3 untied unknown rope_scaling type",
     mla_config(2, 6, 10, num_key_value_heads=4, rope_scaling={"type": "dynamic", "factor": 4.0},
                **moe_keys(5, 0, 3)),
     dict(B=2, T=16, seed=42), True),
    ("mla moe H=8 K=2 S=1 llama3 rope_scaling",
     mla_config(2, 2, 8, num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                rope_scaling=LLAMA3, **moe_keys(4, 1, 2)),
     dict(B=2, T=40, seed=43), False),
    ("mla moe K=2<H=4 S=1 tied gated 3 layers packed",
     mla_config(4, 4, 12, num_key_value_heads=2, num_hidden_layers=3, tie_word_embeddings=True,
                use_gated_attention=True, **moe_keys(6, 1, 2)),
     dict(B=2, T=20, seed=44, doc_starts=[[0, 6], [0, 10, 11]]), False),
]


def main():
    check_case("seq gqa untied", make_config(), B=2, T=16, seed=1)
    check_case("seq mha tied qknorm gated smoothing",
               make_config(num_key_value_heads=4, tie_word_embeddings=True, use_qk_norm=True,
                           use_gated_attention=True, rope_theta=500.0),
               B=2, T=24, seed=2, smoothing=0.1)
    check_case("sft packed gqa qknorm gated bf16",
               make_config(num_attention_heads=8, num_key_value_heads=2, use_qk_norm=True,
                           use_gated_attention=True),
               B=3, T=20, seed=3, sft=True, doc_starts=[[0, 7, 8, 15], [0], [0, 1, 19]],
               bf16=True)
    check_case("sft smoothing mha untied", make_config(num_key_value_heads=4, num_hidden_layers=3),
               B=2, T=12, seed=4, sft=True, smoothing=0.2, doc_starts=[[0, 5], [0, 6, 9]])
    check_case("long window T=512 packed across tiles",
               make_config(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                           max_position_embeddings=512),
               B=2, T=512, seed=5, doc_starts=[[0, 50, 130, 200, 333, 500], [0, 64, 65, 257]])
    check_case("long window T=512 causal", make_config(num_attention_heads=2,
               num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=512,
               use_qk_norm=True), B=1, T=512, seed=6)
    check_case("qkv biases, qk-norm before RoPE, llama3 rope_scaling",
               make_config(attention_bias=True, use_qk_norm=True, qk_norm_before_rope=True,
                           rope_theta=500000.0,
                           rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0,
                                             original_max_position_embeddings=16)),
               B=2, T=40, seed=8)
    check_case("sft packed qkv biases bf16", make_config(attention_bias=True),
               B=2, T=16, seed=9, sft=True, doc_starts=[[0, 5], [0, 9]], bf16=True)
    # the window with documents shorter and longer than it, across the CPU's query tiles
    check_case("sliding window 37 packed, q/k/v/o biases, T=300",
               make_config(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                           max_position_embeddings=512, sliding_window=37, attention_bias=True,
                           o_proj_bias=True),
               B=2, T=300, seed=10, doc_starts=[[0, 20, 30, 130, 131, 250], [0, 64]])
    check_case("sliding window 5 sft packed gqa q/k/v/o biases bf16",
               make_config(sliding_window=5, attention_bias=True, o_proj_bias=True),
               B=2, T=24, seed=11, sft=True, doc_starts=[[0, 3, 12], [0]], bf16=True)
    check_case("sliding window 1 (each token itself) causal",
               make_config(sliding_window=1), B=1, T=12, seed=12)
    # Mistral 7B v0.1's case: a window (4096) longer than the sequence changes nothing
    check_case("sliding window 4096 over T=40 (none in effect), packed",
               make_config(sliding_window=4096), B=2, T=40, seed=13,
               doc_starts=[[0, 17], [0]])
    for name, cfg, args, _ in MLA_MOE_CASES:
        check_case(name, cfg, **args)
    check_load_errors()


if __name__ == "__main__":
    main()
