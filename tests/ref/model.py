"""model.py: an independent fp32 PyTorch implementation of the AstrAI LM (docs/design.md §7).

Straightforward on purpose (explicit (T,T) masks, no fusion): it is the reference the C
engine is checked against.

    m = RefModel.from_dir("model_dir")        # config.json + model.safetensors
    logits = m.forward(input_ids, position_ids=None)       # (B,T,V)
    l = loss(logits, targets, loss_mask=None, label_smoothing=0.0)
    l.backward(); m.grads()                   # {AstrAI name: grad}

Besides GQA and the SwiGLU MLP it computes AstrAI's multi-head latent attention (attn_type
"mla"), DeepSeekMoE feed-forward (ffn_type "moe") and rope_scaling (NTK, Llama 3; §7a, §7b),
written from what AstrAI computes at commit c8b1e40 in astrai/model/components/attention.py
(MLA), mlp.py (DeepSeekMoE), rope.py (RotaryEmbedding, ntk_base), decoder_block.py,
astrai/model/transformer.py (the rotated dimension) and astrai/config/model_config.py.

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


def head_dim(cfg):
    """The per-head dimension of q, k and v: hidden/heads (GQA), nope + rope (MLA)."""
    if cfg.get("attn_type") == "mla":
        return cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def rope_dim(cfg):
    """The dimensions RoPE rotates per head: head_dim (GQA), qk_rope_head_dim (MLA)."""
    return cfg["qk_rope_head_dim"] if cfg.get("attn_type") == "mla" else head_dim(cfg)


def layer_keys(cfg, i):
    """AstrAI key names of layer i, in parameter order."""
    p = f"layers.{i}."
    if cfg.get("attn_type") == "mla":  # MLA.__init__'s order: q_proj, [q_norm, k_norm], kv_a...
        keys = [p + "attention.q_proj.weight"]
        if cfg.get("use_qk_norm"):
            keys += [p + "attention.q_norm.weight", p + "attention.k_norm.weight"]
        keys += [p + f"attention.{n}.weight" for n in ("kv_a_proj", "kv_norm", "kv_b_proj",
                                                       "o_proj")]
        if cfg.get("use_gated_attention"):
            keys += [p + "attention.gate.weight"]
    else:
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
    if cfg.get("ffn_type") == "moe":  # DeepSeekMoE: router, shared experts, routed experts
        keys += [p + "mlp.router.weight"]
        for group, n in (("shared_experts", cfg["n_shared_experts"]),
                         ("routed_experts", cfg["n_routed_experts"])):
            for e in range(n):
                keys += [p + f"mlp.{group}.{e}.{m}.weight" for m in ("up", "gate", "down")]
    else:
        keys += [p + f"mlp.{n}.weight" for n in ("up", "gate", "down")]
    return keys


def param_shapes(cfg):
    """{name: shape} in AstrAI parameter order (lm_head absent when tied)."""
    C, V, FF = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, K, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    attn = {"q_proj": (H * D, C), "k_proj": (K * D, C), "v_proj": (K * D, C),
            "o_proj": (C, H * D), "q_norm": (D,), "k_norm": (D,), "gate": (C, C)}
    bias = {"q_proj": (H * D,), "k_proj": (K * D,), "v_proj": (K * D,), "o_proj": (C,)}
    if cfg.get("attn_type") == "mla":
        R = cfg["kv_lora_rank"]
        attn.update(kv_a_proj=(R, C), kv_norm=(R,), kv_b_proj=(K * 2 * D, R))
    ffn = {"up": (FF, C), "gate": (FF, C), "down": (C, FF)}
    shapes = {"embed_tokens.weight": (V, C)}
    for i in range(cfg["num_hidden_layers"]):
        for k in layer_keys(cfg, i):
            parts = k.split(".")
            leaf = parts[-2]
            if parts[2] == "attention":
                shapes[k] = bias[leaf] if k.endswith(".bias") else attn[leaf]
            elif parts[2] == "mlp":
                shapes[k] = (cfg.get("n_routed_experts"), C) if leaf == "router" else ffn[leaf]
            else:  # input_norm, post_attention_norm
                shapes[k] = (C,)
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


def rope_scaling_kind(rs):
    """None, "ntk", "llama3" or "ignored" (docs/design.md §7b). AstrAI's RotaryEmbedding reads
    only "type", default "ntk": NTK for "type" "ntk" or an object with neither "type" nor
    "rope_type"; "llama3" (as "rope_type" or "type") is the HF import's Llama 3 rule; any other
    type leaves the base alone (so does a "rope_type" other than llama3 without "type", which
    AstrAI itself would read as NTK)."""
    if not rs:
        return None
    kind, rope_type = rs.get("type"), rs.get("rope_type")
    if kind == "llama3" or rope_type == "llama3":
        return "llama3"
    if kind == "ntk" or (kind is None and rope_type is None):
        return "ntk"
    return "ignored"


def rope_base(base, dim, rope_scaling=None):
    """The base after NTK scaling (AstrAI's ntk_base: base * factor^(d/(d-2)), d the rotated
    dimension, factor 1.0 when absent); unchanged otherwise."""
    if rope_scaling_kind(rope_scaling) == "ntk":
        return base * rope_scaling.get("factor", 1.0) ** (dim / (dim - 2))
    return base


def rope_cos_sin(positions, dim, base, rope_scaling=None):
    """positions: (B,T) -> cos, sin: (B,T,1,dim/2), angles as AstrAI builds them (fp64 ->
    fp32); dim: the rotated dimension (head_dim, or MLA's qk_rope_head_dim)."""
    base = rope_base(base, dim, rope_scaling)
    theta = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rope_scaling_kind(rope_scaling) == "llama3":
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
        if cfg.get("attn_type") == "mla":  # AstrAI's MLA has none of these (no biases)
            assert not any(cfg.get(k) for k in ("attention_bias", "o_proj_bias",
                                                 "qk_norm_before_rope")), cfg
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
        return y.view(B, T, -1, head_dim(self.cfg))

    def _gqa_qkv(self, P, p, h, cos, sin):
        """q (B,T,H,D), k, v (B,T,K,D) of GQA: projections, RoPE and qk-norm."""
        cfg, r, eps = self.cfg, self._act, self.cfg["rms_norm_eps"]
        B, T = h.shape[:2]
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
        return q, k, v

    def _mla_qkv(self, P, p, h, cos, sin):
        """q (B,T,H,D), k, v (B,T,K,D) of MLA (AstrAI's attention.py MLA, docs/design.md §7a):
        q = q_proj(h) per head [q_nope | q_rope]; kv = kv_b_proj(kv_norm(kv_a_proj(h))) per kv
        head [k_nope | k_rope | v]; RoPE on q_rope and k_rope; qk-norm over D after that."""
        cfg, r, eps = self.cfg, self._act, self.cfg["rms_norm_eps"]
        B, T = h.shape[:2]
        H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        nope, D = cfg["qk_nope_head_dim"], head_dim(cfg)
        q = r(h @ P[p + "attention.q_proj.weight"].T).view(B, T, H, D)
        c = r(h @ P[p + "attention.kv_a_proj.weight"].T)
        c = r(rms_norm(c, P[p + "attention.kv_norm.weight"], eps))
        kv = r(c @ P[p + "attention.kv_b_proj.weight"].T).view(B, T, K, 2 * D)
        k_nope, k_rope, v = kv[..., :nope], kv[..., nope:D], kv[..., D:]
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        q = torch.cat((q_nope, r(apply_rope(q_rope, cos, sin))), dim=-1)
        k = torch.cat((k_nope, r(apply_rope(k_rope, cos, sin))), dim=-1)
        if cfg.get("use_qk_norm"):
            q = r(rms_norm(q, P[p + "attention.q_norm.weight"], eps))
            k = r(rms_norm(k, P[p + "attention.k_norm.weight"], eps))
        return q, k, v

    def _swiglu(self, P, key, x):
        """up(x) * silu(gate(x)) of the SwiGLU MLP at key (its down GEMM is the caller's)."""
        r = self._act
        up = r(x @ P[key + "up.weight"].T)
        gate = r(x @ P[key + "gate.weight"].T)
        return r(up * F.silu(gate))

    def _moe(self, P, p, h):
        """DeepSeekMoE (AstrAI's mlp.py, docs/design.md §7a) of h (B,T,C): the sum of the mean of
        the shared experts and the chosen routed experts weighted by their renormalised router
        probabilities, unrounded (the caller adds it to the residual and rounds once)."""
        cfg, r = self.cfg, self._act
        B, T, C = h.shape
        E, S, k = cfg["n_routed_experts"], cfg["n_shared_experts"], cfg["n_activated_experts"]
        x = h.reshape(B * T, C)
        logits = r(x @ P[p + "mlp.router.weight"].T)
        probs = r(torch.softmax(logits.float(), dim=-1))
        top_w, top_i = torch.topk(probs, k, dim=-1)
        top_w = r(top_w / top_w.sum(dim=-1, keepdim=True))
        self.routing[p] = (logits.detach(), top_i)
        routed = torch.zeros_like(x)
        for e in range(E):
            token, choice = (top_i == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            key = p + f"mlp.routed_experts.{e}."
            y = r(self._swiglu(P, key, x[token]) @ P[key + "down.weight"].T)
            routed = routed.index_add(0, token, top_w[token, choice, None] * y)
        out = routed
        if S:
            shared = None  # down GEMMs accumulating into one buffer, rounded after each add
            for e in range(S):
                key = p + f"mlp.shared_experts.{e}."
                y = self._swiglu(P, key, x) @ P[key + "down.weight"].T
                shared = r(y) if shared is None else r(shared + y)
            out = shared / S + routed
        return out.view(B, T, C)

    def forward(self, input_ids, position_ids=None, embed_noise=None):
        """embed_noise: (B,T,C) added to the input embeddings (NEFTune), or None."""
        cfg, P, r = self.cfg, self._weights(), self._act
        self.routing = {}  # MoE: {"layers.{i}.": (router logits (N,E), chosen experts (N,k))}
        input_ids = torch.as_tensor(input_ids).long()
        B, T = input_ids.shape
        H, KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        eps, D = cfg["rms_norm_eps"], head_dim(cfg)
        mla, moe = cfg.get("attn_type") == "mla", cfg.get("ffn_type") == "moe"
        base = cfg.get("rope_theta") or 10000.0
        packed = position_ids is not None
        pos = (torch.as_tensor(position_ids).long() if packed
               else torch.arange(T).expand(B, T))
        cos, sin = rope_cos_sin(pos, rope_dim(cfg), base, cfg.get("rope_scaling"))
        mask = attention_mask(pos, packed, cfg.get("sliding_window"))

        x = r(P["embed_tokens.weight"][input_ids])
        if embed_noise is not None:
            x = r(x + torch.as_tensor(embed_noise))
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            h = r(rms_norm(x, P[p + "input_norm.weight"], eps))
            q, k, v = (self._mla_qkv if mla else self._gqa_qkv)(P, p, h, cos, sin)
            k = k.repeat_interleave(H // KVH, dim=2)
            v = v.repeat_interleave(H // KVH, dim=2)
            q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (B,H,T,D)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            scores = scores.masked_fill(~mask, float("-inf"))
            att = r((scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, H * D))
            if cfg.get("use_gated_attention"):
                att = r(att * torch.sigmoid(r(h @ P[p + "attention.gate.weight"].T)))
            x = r(x + r(att @ P[p + "attention.o_proj.weight"].T))
            if cfg.get("o_proj_bias"):
                x = r(x + P[p + "attention.o_proj.bias"])
            h = r(rms_norm(x, P[p + "post_attention_norm.weight"], eps))
            if moe:
                x = r(x + self._moe(P, p, h))
            else:
                act = self._swiglu(P, p + "mlp.", h)
                x = r(x + r(act @ P[p + "mlp.down.weight"].T))
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
