#!/usr/bin/python3
"""bench_moe.py: astrai-train's mixture-of-experts step against a dense step of the same active
size, and against PyTorch running AstrAI's DeepSeekMoE (its per-expert python loop).

One run measures, on the same threads and one after the other (never side by side), in
--rounds rounds that alternate the three sides:
  1. astrai dense: seq training, fp32, a SwiGLU MLP of intermediate (k+S)*I per layer;
  2. astrai moe: the same model with ffn_type "moe": E routed experts of intermediate I, top-k
     greedy routing, S shared experts, so a token runs through k+S experts of size I: the same
     active FFN parameters per token as the dense model (plus the E x hidden router);
  3. the PyTorch peer in its own process: the MoE model written the way AstrAI's code
     (c8b1e40 astrai/model/components/mlp.py DeepSeekMoE) is: for each expert, nonzero of the
     top-k mask, gather, the expert's MLP, index_add_; full forward + backward + clipping +
     torch.optim.AdamW on the same weights and batches;
and prints one JSON object and a summary: each side's step time (warm-up steps discarded) and
the step-time ratios astrai moe / astrai dense (the issue's goal: <= 1.3) and astrai moe /
PyTorch moe (below 1: astrai is faster). See bench/README.md.

    /usr/bin/python3 bench/bench_moe.py --build build --threads 2
"""
import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys

import numpy as np

import bench_train as bt

# bench_pref's "small" shape (bench_train's config at hidden 256, 4 layers, 4 heads, 1 KV head).
BASE = {**bt.CONFIG, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1}
# The goal: a MoE step <= 1.3x the dense step of the same active size.
GOAL_MOE_OVER_DENSE = 1.3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with the binaries")
    p.add_argument("--steps", type=int, default=6,
                   help="timed optimizer steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps, >= 1 (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads for every side (default 2)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each side, alternating dense, moe, pytorch (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--window", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--experts", type=int, default=8, help="routed experts E (default 8)")
    p.add_argument("--topk", type=int, default=2, help="activated experts k (default 2)")
    p.add_argument("--shared", type=int, default=1, help="shared experts S (default 1)")
    p.add_argument("--intermediate", type=int, default=256,
                   help="each expert's intermediate_size I (default 256); the dense model's "
                        "is (k+S)*I")
    p.add_argument("--workdir", help="keep models, data and logs here (default: a temp dir, "
                                     "removed)")
    p.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("steps", "threads", "rounds", "batch", "window", "experts", "topk",
                 "intermediate"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.shared < 0:
        p.error("--shared must be >= 0")
    if a.topk > a.experts:
        p.error("--topk must be <= --experts")
    if a.warmup < 1:  # steps are timed from the end of the last warm-up step
        p.error("--warmup must be >= 1")
    if a.window > BASE["max_position_embeddings"]:
        p.error(f"--window must be <= {BASE['max_position_embeddings']}")
    return a


def configs(args):
    dense = {**BASE, "ffn_type": "mlp",
             "intermediate_size": (args.topk + args.shared) * args.intermediate}
    moe = {**BASE, "ffn_type": "moe", "intermediate_size": args.intermediate,
           "n_routed_experts": args.experts, "n_shared_experts": args.shared,
           "n_activated_experts": args.topk, "topk_method": "greedy"}
    return dense, moe


def active_params(params, cfg):
    """Parameters a token's forward reads: everything but the routed experts it is not sent
    to (k of E routed experts count)."""
    total = sum(params.values())
    if cfg["ffn_type"] != "moe":
        return total
    routed = sum(v for k, v in params.items() if ".mlp.routed_experts." in k)
    return total - routed + routed * cfg["n_activated_experts"] // cfg["n_routed_experts"]


# ------------------------------------------------------------------ the sides


def run_astrai(args, root, name, model_dir, data):
    """One astrai-train run: its per-step wall times and losses (progress.db), peak RSS."""
    side_root = os.path.join(root, name)  # its ckpt-seq/ (progress.db) and log
    os.makedirs(side_root)
    rows, rss, _ = bt.train_astrai(args, side_root, "seq", model_dir, data, args.batch,
                                   "astrai-train.log", {"dtype": "fp32", "device_type": "cpu"})
    return {"times": [w for _, _, w in rows], "losses": [l for l, _, _ in rows],
            "peak_rss_bytes": rss}


def run_peer(args, root, name, model_dir, data):
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-worker", "--model", model_dir,
           "--data", data, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--batch", str(args.batch),
           "--window", str(args.window)]
    out, rss, _ = bt.run_child(cmd, os.path.join(root, name + ".log"), args.threads)
    peer = json.loads(out)
    return {"times": peer["times"], "losses": peer["losses"], "peak_rss_bytes": rss,
            "rss_after_import_bytes": peer["rss_after_import_bytes"],
            "first_step_tokens_per_expert": peer["tokens_per_expert"]}


def summarize(args, runs):
    """The timed steps of every round of one side (warm-up steps of each run discarded): mean
    step time (the wall time of the timed span over its steps, bench_train's tokens/s), median,
    fastest and slowest step."""
    steps = []
    for r in runs:
        t = r["times"]
        steps += [b - a for a, b in zip(t[args.warmup - 1:-1], t[args.warmup:])]
    mean = sum(steps) / len(steps)
    out = {"step_s": mean, "step_s_median": statistics.median(steps),
           "step_s_min": min(steps), "step_s_max": max(steps), "steps": len(steps),
           "step_s_all": steps, "tokens_per_s": args.batch * args.window / mean,
           "loss_first": runs[0]["losses"][0], "loss_last": runs[0]["losses"][-1],
           "peak_rss_mib": max(r["peak_rss_bytes"] for r in runs) / bt.MIB}
    for key in ("rss_after_import_bytes", "first_step_tokens_per_expert"):
        if key in runs[0]:
            out[key] = runs[0][key]
    return out


# ------------------------------------------------------------------ the PyTorch peer


def peer_modules(cfg, torch):
    """AstrAI's model (c8b1e40 astrai/model/transformer.py and components/) as nn.Modules with
    its parameter names, for torch 1.13: RMSNorm written out (no F.rms_norm) and attention as
    softmax(QK^T/sqrt(d) + causal mask)V (no F.scaled_dot_product_attention). The MoE is
    AstrAI's DeepSeekMoE, line for line."""
    nn, F = torch.nn, torch.nn.functional

    class Linear(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(d_out, d_in))

        def forward(self, x):
            return F.linear(x, self.weight)

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class MLP(nn.Module):
        def __init__(self, dim, dim_ffn):
            super().__init__()
            self.up, self.gate, self.down = (Linear(dim, dim_ffn), Linear(dim, dim_ffn),
                                             Linear(dim_ffn, dim))

        def forward(self, x):
            return self.down(self.up(x) * F.silu(self.gate(x)))

    class DeepSeekMoE(nn.Module):
        def __init__(self, dim, dim_ffn, n_routed, n_shared, k):
            super().__init__()
            self.n_routed, self.n_shared, self.k = n_routed, n_shared, k
            self.router = Linear(dim, n_routed)
            self.shared_experts = nn.ModuleList([MLP(dim, dim_ffn) for _ in range(n_shared)])
            self.routed_experts = nn.ModuleList([MLP(dim, dim_ffn) for _ in range(n_routed)])
            self.counts = None  # tokens per routed expert of the last forward

        def forward(self, x):
            bsz, seq_len, dim = x.shape
            x_flat = x.view(-1, dim)
            if self.n_shared == 0:
                shared = torch.zeros_like(x_flat)
            else:
                shared = sum(e(x_flat) for e in self.shared_experts) / self.n_shared
            return (shared + self._routed(x_flat)).view(bsz, seq_len, dim)

        def _routed(self, x):
            N, D = x.shape
            probs = torch.softmax(self.router(x).float(), dim=-1).to(x.dtype)
            topk_weights, topk_indices = torch.topk(probs, self.k, dim=-1)
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
            output = torch.zeros(N, D, dtype=x.dtype)
            counts = []
            for e in range(self.n_routed):
                token_idx, k_idx = (topk_indices == e).nonzero(as_tuple=True)
                counts.append(int(token_idx.numel()))
                if token_idx.numel() == 0:
                    continue
                out = self.routed_experts[e](x[token_idx])
                weights = topk_weights[token_idx, k_idx].unsqueeze(-1)
                output.index_add_(0, token_idx, out * weights)
            self.counts = counts
            return output

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            C, H, K = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
            self.H, self.K, self.D = H, K, C // H
            self.q_proj, self.k_proj = Linear(C, H * self.D), Linear(C, K * self.D)
            self.v_proj, self.o_proj = Linear(C, K * self.D), Linear(H * self.D, C)

        def forward(self, x, freqs_cis, mask):
            B, T, _ = x.shape
            q = rope(self.q_proj(x).view(B, T, self.H, self.D), freqs_cis)
            k = rope(self.k_proj(x).view(B, T, self.K, self.D), freqs_cis)
            v = self.v_proj(x).view(B, T, self.K, self.D)
            rep = self.H // self.K  # AstrAI's repeat_kv
            k = k[:, :, :, None, :].expand(B, T, self.K, rep, self.D).reshape(B, T, self.H, self.D)
            v = v[:, :, :, None, :].expand(B, T, self.K, rep, self.D).reshape(B, T, self.H, self.D)
            q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.D) + mask
            out = (torch.softmax(scores, dim=-1) @ v).permute(0, 2, 1, 3).contiguous().flatten(2)
            return self.o_proj(out)

    def rope(x, freqs_cis):  # AstrAI's apply_rotary_emb: interleaved pairs as complex numbers
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis.unsqueeze(2)).flatten(-2).to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            C, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
            self.attention = Attention()
            self.input_norm, self.post_attention_norm = RMSNorm(C, eps), RMSNorm(C, eps)
            if cfg["ffn_type"] == "moe":
                self.mlp = DeepSeekMoE(C, cfg["intermediate_size"], cfg["n_routed_experts"],
                                       cfg["n_shared_experts"], cfg["n_activated_experts"])
            else:
                self.mlp = MLP(C, cfg["intermediate_size"])

        def forward(self, x, freqs_cis, mask):
            x = self.attention(self.input_norm(x), freqs_cis, mask) + x
            return self.mlp(self.post_attention_norm(x)) + x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            C, V = cfg["hidden_size"], cfg["vocab_size"]
            self.embed_tokens = nn.Embedding(V, C)
            self.layers = nn.ModuleList([Block() for _ in range(cfg["num_hidden_layers"])])
            self.norm = RMSNorm(C, cfg["rms_norm_eps"])
            self.lm_head = Linear(C, V)
            D = C // cfg["num_attention_heads"]  # AstrAI's get_rotary_emb (fp64 angles)
            theta = cfg["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
            t = torch.arange(cfg["max_position_embeddings"], dtype=torch.float64)
            freqs = torch.outer(t, theta).float()
            self.freqs_cis = torch.complex(torch.cos(freqs), torch.sin(freqs))

        def forward(self, ids):
            B, T = ids.shape
            mask = torch.full((T, T), float("-inf")).triu(1)
            freqs_cis = self.freqs_cis[:T].unsqueeze(0).expand(B, T, -1)
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x, freqs_cis, mask)
            return self.lm_head(self.norm(x))

    return Model()


def peer_main(args):
    """The MoE model on the batches astrai-train sees (shuffle off: step s trains on windows
    batch*s ... batch*s + batch-1), with bench_train's optimizer loop (AdamW, clipping, the
    cosine schedule)."""
    rss_import = bt.peer_start(args.threads)
    import torch
    import torch.nn.functional as F
    from ref import st_io

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    model = peer_modules(cfg, torch)
    weights = st_io.load(os.path.join(args.model, "model.safetensors"))
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32))
                           for k, v in weights.items()}, strict=True)
    tokens = np.fromfile(os.path.join(args.data, "part0", "sequence.bin"), dtype="<i4")
    seq = torch.from_numpy(tokens.astype(np.int64))
    n_windows = (len(tokens) - 1) // args.window
    total = math.ceil(n_windows / args.batch)  # astrai-train's total_steps (one epoch)
    span = args.batch * args.window
    counts = []

    def step_loss(step):
        chunk = seq[step * span:(step + 1) * span + 1]
        x = chunk[:-1].view(args.batch, args.window)
        y = chunk[1:].view(args.batch, args.window)
        logits = model(x)
        if step == 0:
            counts.extend(layer.mlp.counts for layer in model.layers)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    # bench_train's loop prints its JSON; ours adds the routing of the first step to it.
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bt.peer_train(args, model.parameters(), step_loss, total, rss_import)
    out = json.loads(buf.getvalue())
    out["tokens_per_expert"] = counts
    print(json.dumps(out))


# ------------------------------------------------------------------ report


def main(argv):
    args = parse_args(argv)
    if args.peer_worker:
        return peer_main(args)
    dense_cfg, moe_cfg = configs(args)
    with bt.work_dir(args, "bench_moe", ("astrai-model", "astrai-train")) as root:
        models = {}
        for name, cfg in (("dense", dense_cfg), ("moe", moe_cfg)):
            os.makedirs(os.path.join(root, name))
            models[name] = bt.make_model(args.build, os.path.join(root, name), cfg)
        data = bt.make_dataset(root, (args.warmup + args.steps) * args.batch, args.window)
        params = {n: bt.count_params(os.path.join(d, "model.safetensors"))
                  for n, d in models.items()}
        load = {"start": os.getloadavg()[0]}
        runs = {"astrai_dense": [], "astrai_moe": [], "pytorch_moe": []}
        # Rounds alternate the sides (dense, moe, pytorch, dense, ...), so a burst of other
        # load falls on all of them rather than on one.
        for i in range(args.rounds):
            for name, fn, model in (("astrai_dense", run_astrai, "dense"),
                                    ("astrai_moe", run_astrai, "moe"),
                                    ("pytorch_moe", run_peer, "moe")):
                runs[name].append(fn(args, root, f"{name}-{i}", models[model], data))
                load[f"after_{name}_{i}"] = os.getloadavg()[0]
        sides = {name: summarize(args, r) for name, r in runs.items()}
        dense, moe, peer = sides["astrai_dense"], sides["astrai_moe"], sides["pytorch_moe"]
        ratios = {}
        for key, label in (("step_s", ""), ("step_s_median", "median_step: "),
                           ("step_s_min", "best_step: ")):
            ratios[label + "astrai_moe/astrai_dense"] = moe[key] / dense[key]
            ratios[label + "astrai_moe/pytorch_moe"] = moe[key] / peer[key]
        result = {"configs": {"dense": dense_cfg, "moe": moe_cfg},
                  "params": {n: sum(p.values()) for n, p in params.items()},
                  "active_params_per_token": {"dense": active_params(params["dense"], dense_cfg),
                                              "moe": active_params(params["moe"], moe_cfg)},
                  "batch": args.batch, "window": args.window, "threads": args.threads,
                  "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds,
                  "load_average_1min": load, **sides, "step_time_ratios": ratios,
                  "goal": {"astrai_moe/astrai_dense_max": GOAL_MOE_OVER_DENSE,
                           "met": ratios["astrai_moe/astrai_dense"] <= GOAL_MOE_OVER_DENSE}}
        print(json.dumps(result, indent=2))
        act = result["active_params_per_token"]
        print(f"E={args.experts} k={args.topk} S={args.shared} I={args.intermediate} vs dense "
              f"I={dense_cfg['intermediate_size']}; params moe {result['params']['moe']/1e6:.2f}M "
              f"(active {act['moe']/1e6:.2f}M), dense {result['params']['dense']/1e6:.2f}M "
              f"(active {act['dense']/1e6:.2f}M); batch {args.batch}x{args.window}, "
              f"{args.threads} threads")
        for name, s in sides.items():
            print(f"{name:13s} step {s['step_s']:.3f} s (median {s['step_s_median']:.3f}, fastest "
                  f"{s['step_s_min']:.3f}, slowest {s['step_s_max']:.3f}; {s['steps']} steps), "
                  f"{s['tokens_per_s']:.0f} tok/s, peak RSS "
                  f"{s['peak_rss_mib']:.0f} MiB, first loss {s['loss_first']:.5f}")
        print(f"astrai moe / astrai dense step time {ratios['astrai_moe/astrai_dense']:.2f}x "
              f"(goal <= {GOAL_MOE_OVER_DENSE}: {'met' if result['goal']['met'] else 'NOT met'};"
              f" median steps {ratios['median_step: astrai_moe/astrai_dense']:.2f}x, fastest "
              f"{ratios['best_step: astrai_moe/astrai_dense']:.2f}x); astrai moe / pytorch moe "
              f"{ratios['astrai_moe/pytorch_moe']:.2f}x (median steps "
              f"{ratios['median_step: astrai_moe/pytorch_moe']:.2f}x, fastest "
              f"{ratios['best_step: astrai_moe/pytorch_moe']:.2f}x)")
        if abs(moe["loss_first"] - peer["loss_first"]) > 1e-3 * abs(peer["loss_first"]):
            print(f"warning: first-step losses differ (astrai {moe['loss_first']:.5f}, pytorch "
                  f"{peer['loss_first']:.5f}): the two sides did not train the same step")
        bt.warn_load(load, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
