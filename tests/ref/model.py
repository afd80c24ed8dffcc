"""model.py: an independent fp32 PyTorch implementation of the AstrAI LM (docs/design.md §7).

Straightforward on purpose (explicit (T,T) masks, no fusion): it is the reference the C
engine is checked against.

    m = RefModel.from_dir("model_dir")        # config.json + model.safetensors
    logits = m.forward(input_ids, position_ids=None)       # (B,T,V)
    l = loss(logits, targets, loss_mask=None, label_smoothing=0.0)
    l.backward(); m.grads()                   # {AstrAI name: grad}

With dtype=torch.bfloat16 or torch.float16 it follows astrai's reduced-precision scheme
(docs/design.md §15): the fp32 parameters are the master weights, rounded to the dtype where
forward reads them (their gradients stay fp32); every activation, and every activation
gradient in backward, is rounded to the dtype where astrai's kernels store one; the math in
between, the loss and its softmax run in fp32.
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from ref import st_io


def layer_keys(cfg, i):
    """AstrAI key names of layer i, in parameter order."""
    p = f"layers.{i}."
    keys = [p + f"attention.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]
    if cfg.get("attention_bias"):
        keys += [p + f"attention.{n}.bias" for n in ("q_proj", "k_proj", "v_proj")]
    keys += [p + "attention.o_proj.weight"]
    if cfg.get("o_proj_bias"):
        keys += [p + "attention.o_proj.bias"]
    if cfg.get("use_qk_norm"):
        keys += [p + "attention.q_norm.weight", p + "attention.k_norm.weight"]
    if cfg.get("use_gated_attention"):
        keys += [p + "attention.gate.weight"]
    keys += [p + "input_norm.weight", p + "post_attention_norm.weight"]
    keys += [p + f"mlp.{n}.weight" for n in ("up", "gate", "down")]
    return keys


def param_shapes(cfg):
    """{name: shape} in AstrAI parameter order (lm_head absent when tied)."""
    C, V, FF = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    D = C // cfg["num_attention_heads"]
    KV = cfg["num_key_value_heads"] * D
    shapes = {"embed_tokens.weight": (V, C)}
    for i in range(cfg["num_hidden_layers"]):
        for k in layer_keys(cfg, i):
            leaf = k.split(".")[-2]
            if k.endswith(".bias"):
                shapes[k] = (C,) if leaf in ("q_proj", "o_proj") else (KV,)
                continue
            shapes[k] = {
                "q_proj": (C, C), "k_proj": (KV, C), "v_proj": (KV, C), "o_proj": (C, C),
                "q_norm": (D,), "k_norm": (D,), "gate": (C, C) if "attention" in k else (FF, C),
                "input_norm": (C,), "post_attention_norm": (C,), "up": (FF, C), "down": (C, FF),
            }[leaf]
    shapes["norm.weight"] = (C,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, C)
    return shapes


class _RoundActivation(torch.autograd.Function):
    """An activation stored in the dtype: rounded forward, its gradient rounded backward."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).float()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).float(), None


class _RoundWeight(torch.autograd.Function):
    """A weight read in the dtype from its fp32 master: rounded forward, fp32 gradient."""

    @staticmethod
    def forward(ctx, w, dtype):
        return w.to(dtype).float()

    @staticmethod
    def backward(ctx, g):
        return g, None


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def llama3_frequencies(theta, rs):
    """Llama 3's rope_scaling of the frequencies theta (transformers' formula, in fp64)."""
    orig = rs["original_max_position_embeddings"]
    low, high, factor = rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
    wavelen = 2 * math.pi / theta
    smooth = (orig / wavelen - low) / (high - low)
    medium = (1 - smooth) * theta / factor + smooth * theta
    return torch.where(wavelen < orig / high, theta,
                       torch.where(wavelen > orig / low, theta / factor, medium))


def rope_cos_sin(positions, head_dim, base, rope_scaling=None):
    """positions: (B,T) -> cos, sin: (B,T,1,D/2), angles as AstrAI builds them (fp64 -> fp32)."""
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope_scaling:
        theta = llama3_frequencies(theta, rope_scaling)
    angle = (positions.to(torch.float64)[..., None] * theta).float()
    return torch.cos(angle)[:, :, None, :], torch.sin(angle)[:, :, None, :]


def apply_rope(x, cos, sin):
    """x: (B,T,H,D); rotates the interleaved pairs (2i, 2i+1)."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def attention_mask(positions, packed, sliding_window=None):
    """(B,1,T,T) bool: causal, within the last sliding_window keys (transformers' Mistral:
    key j hidden from query i when j <= i - sliding_window), and within one document when
    packed (new doc where position_ids[t] <= position_ids[t-1])."""
    B, T = positions.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if sliding_window:
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        causal &= j > i - sliding_window
    if not packed:
        return causal.expand(B, 1, T, T)
    new_doc = torch.zeros(B, T, dtype=torch.long)
    new_doc[:, 1:] = (positions[:, 1:] <= positions[:, :-1]).long()
    doc = new_doc.cumsum(1)
    same = doc[:, :, None] == doc[:, None, :]
    return (same & causal)[:, None]


class RefModel:
    def __init__(self, cfg, weights, dtype=None):
        """cfg: config.json dict; weights: {name: array/tensor} with AstrAI names; dtype: None
        (fp32), torch.bfloat16 or torch.float16 (the reduced-precision scheme above)."""
        self.cfg, self.dtype = cfg, dtype
        self.params = {}
        for name, shape in param_shapes(cfg).items():
            if name == "lm_head.weight" and name not in weights:
                w = weights["embed_tokens.weight"]  # AstrAI: untied head starts as a copy
            else:
                w = weights[name]
            t = torch.as_tensor(np.asarray(w, dtype=np.float32)).clone()
            assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
            self.params[name] = t.requires_grad_(True)

    @classmethod
    def from_dir(cls, path, dtype=None):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return cls(cfg, st_io.load(os.path.join(path, "model.safetensors")), dtype)

    def _act(self, x):
        return x if self.dtype is None else _RoundActivation.apply(x, self.dtype)

    def _weights(self):
        if self.dtype is None:
            return self.params
        return {k: _RoundWeight.apply(v, self.dtype) for k, v in self.params.items()}

    def parameters(self):
        return list(self.params.values())

    def named_parameters(self):
        return list(self.params.items())

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.params.items()}

    def grads(self):
        return {k: (v.grad if v.grad is not None else torch.zeros_like(v))
                for k, v in self.params.items()}

    def zero_grad(self):
        for v in self.params.values():
            v.grad = None

    def _projection(self, P, h, key, B, T):
        """h @ W^T (+ bias, rounded after the product as astrai adds it), as (B,T,heads,D)."""
        y = self._act(h @ P[key + ".weight"].T)
        if self.cfg.get("attention_bias"):
            y = self._act(y + P[key + ".bias"])
        D = self.cfg["hidden_size"] // self.cfg["num_attention_heads"]
        return y.view(B, T, -1, D)

    def forward(self, input_ids, position_ids=None, embed_noise=None):
        """embed_noise: (B,T,C) added to the input embeddings (NEFTune), or None."""
        cfg, P, r = self.cfg, self._weights(), self._act
        input_ids = torch.as_tensor(input_ids).long()
        B, T = input_ids.shape
        H, KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        C, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        D = C // H
        base = cfg.get("rope_theta") or 10000.0
        packed = position_ids is not None
        pos = (torch.as_tensor(position_ids).long() if packed
               else torch.arange(T).expand(B, T))
        cos, sin = rope_cos_sin(pos, D, base, cfg.get("rope_scaling"))
        mask = attention_mask(pos, packed, cfg.get("sliding_window"))

        x = r(P["embed_tokens.weight"][input_ids])
        if embed_noise is not None:
            x = r(x + torch.as_tensor(embed_noise))
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            h = r(rms_norm(x, P[p + "input_norm.weight"], eps))
            q, k, v = (self._projection(P, h, p + "attention." + n, B, T)
                       for n in ("q_proj", "k_proj", "v_proj"))
            norm_first = cfg.get("qk_norm_before_rope")
            if not norm_first:
                q, k = r(apply_rope(q, cos, sin)), r(apply_rope(k, cos, sin))
            if cfg.get("use_qk_norm"):  # over head_dim, after RoPE (AstrAI) or before (Qwen3)
                q = r(rms_norm(q, P[p + "attention.q_norm.weight"], eps))
                k = r(rms_norm(k, P[p + "attention.k_norm.weight"], eps))
            if norm_first:
                q, k = r(apply_rope(q, cos, sin)), r(apply_rope(k, cos, sin))
            k = k.repeat_interleave(H // KVH, dim=2)
            v = v.repeat_interleave(H // KVH, dim=2)
            q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (B,H,T,D)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            scores = scores.masked_fill(~mask, float("-inf"))
            att = r((scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, C))
            if cfg.get("use_gated_attention"):
                att = r(att * torch.sigmoid(r(h @ P[p + "attention.gate.weight"].T)))
            x = r(x + r(att @ P[p + "attention.o_proj.weight"].T))
            if cfg.get("o_proj_bias"):
                x = r(x + P[p + "attention.o_proj.bias"])
            h = r(rms_norm(x, P[p + "post_attention_norm.weight"], eps))
            up = r(h @ P[p + "mlp.up.weight"].T)
            gate = r(h @ P[p + "mlp.gate.weight"].T)
            x = r(x + r(r(up * F.silu(gate)) @ P[p + "mlp.down.weight"].T))
        x = r(rms_norm(x, P["norm.weight"], eps))
        head = P["embed_tokens.weight"] if cfg.get("tie_word_embeddings") else P["lm_head.weight"]
        return r(x @ head.T)


def loss(logits, targets, loss_mask=None, label_smoothing=0.0):
    """Mean CE over counted tokens (loss_mask 1), torch's label smoothing; 0 if none count."""
    V = logits.shape[-1]
    targets = torch.as_tensor(targets).long().clone()
    if loss_mask is not None:
        targets[torch.as_tensor(loss_mask) == 0] = -100
    if (targets != -100).sum() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100,
                           label_smoothing=label_smoothing)
