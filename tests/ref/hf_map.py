"""Hugging Face tensors as AstrAI names them (docs/design.md §16): the name pieces renamed, and
the rows of q/k projections (their biases and qk-norm weights) of each head reordered from HF's
RoPE layout, halves (i, i + D/2), to AstrAI's, pairs (2i, 2i + 1). Mixtral's experts are
DeepSeekMoE's routed experts (§7a): block_sparse_moe.gate is the router, expert e's w1, w3, w2
its gate, up and down."""

import re

import numpy as np

# HF name pieces -> AstrAI's.
RENAMES = [("model.embed_tokens.", "embed_tokens."), ("model.norm.", "norm."),
           ("model.layers.", "layers."), (".self_attn.", ".attention."),
           (".input_layernorm.", ".input_norm."),
           (".post_attention_layernorm.", ".post_attention_norm."),
           (".mlp.up_proj.", ".mlp.up."), (".mlp.gate_proj.", ".mlp.gate."),
           (".mlp.down_proj.", ".mlp.down.")]
# Mixtral's feed-forward (regular expressions over the HF name) -> AstrAI's.
MOE_RENAMES = [(r"\.block_sparse_moe\.gate\.", ".mlp.router."),
               (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.routed_experts.\1.gate."),
               (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.routed_experts.\1.up."),
               (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.routed_experts.\1.down.")]
ROPE_LEAVES = ("q_proj", "k_proj", "q_norm", "k_norm")


def to_pairs(t, head_dim):
    """t [heads * D, ...] (or [D]): each head's rows from halves order to pairs order."""
    rows = t.reshape(-1, 2, head_dim // 2, *t.shape[1:])
    return rows.transpose(1, 2).reshape(t.shape)


def to_astrai(name, t, head_dim):
    """(AstrAI name, AstrAI tensor) of the HF tensor `name`."""
    for a, b in RENAMES:
        name = name.replace(a, b)
    for a, b in MOE_RENAMES:
        name = re.sub(a, b, name)
    if name.split(".")[-2] in ROPE_LEAVES:
        t = to_pairs(t, head_dim)
    return name, t


def rel_err(got, ref):
    """max |got - ref| / max |ref| over arrays (or scalars)."""
    ref = np.asarray(ref, np.float64)
    return np.abs(np.asarray(got, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
