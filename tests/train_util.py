"""Helpers shared by the training tests: run the binaries, make models and datasets,
and train the PyTorch reference on the batches astrai-train sees."""

import json
import math
import os
import socket
import subprocess
import tempfile

import numpy as np
import torch

from ref import noise as ref_noise
from ref import sampler as ref_sampler
from ref.model import RefModel, loss as ref_loss
from ref.optim import clip_grad_norm, make_optimizer

BUILD = os.environ.get("ASTRAI_BUILD", os.path.join(os.path.dirname(__file__), "..", "build"))
TEXT = "/usr/share/common-licenses/GPL-3"


def binary(name):
    return os.path.join(BUILD, name)


def run(args, expect=0, timeout=600, env=None):
    """Runs a binary; asserts its exit code; returns (stdout, stderr)."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != expect:
        raise AssertionError(
            f"{' '.join(args)}: exit {proc.returncode}, expected {expect}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc.stdout, proc.stderr


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tmpdir():
    return tempfile.mkdtemp(prefix="astrai-test-")


SMALL_CONFIG = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 160, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 32, "tie_word_embeddings": False,
    "attn_type": "gqa", "ffn_type": "mlp", "use_qk_norm": True, "use_gated_attention": True,
}
# Large enough (~1.5M parameters) for its state to stand out of a process's resident memory.
MEM_CONFIG = dict(SMALL_CONFIG, hidden_size=256, num_hidden_layers=4, intermediate_size=704,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                  use_qk_norm=False, use_gated_attention=False)


def make_model(root, config=None, seed=3407):
    """astrai-model init, fp32, into root/model."""
    os.makedirs(root, exist_ok=True)
    cfg_path = os.path.join(root, "model.json")
    with open(cfg_path, "w") as f:
        json.dump(config or SMALL_CONFIG, f)
    out = os.path.join(root, "model")
    run([binary("astrai-model"), "init", "--config", cfg_path, "--out", out, "--dtype", "fp32",
         "--seed", str(seed)])
    return out


def make_text_data(root, n_bytes, name="data"):
    """astrai-data prep of the first n_bytes of a real text (byte tokenizer)."""
    with open(TEXT, "rb") as f:
        text = f.read(n_bytes)
    src = os.path.join(root, name + ".txt")
    with open(src, "wb") as f:
        f.write(text)
    out = os.path.join(root, name)
    run([binary("astrai-data"), "prep", "--out", out, "--format", "text", "--tokenizer", "bytes",
         src])
    return out, np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def sft_arrays(n):
    """(sequence, loss_mask, position_ids) of make_sft_data's n tokens (int32)."""
    rng = np.random.default_rng(7)
    seq = rng.integers(0, 256, n, dtype=np.int32)
    pos = np.concatenate([np.arange(k) for k in rng.integers(5, 20, n)])[:n].astype(np.int32)
    mask = (rng.random(n) < 0.5).astype(np.int32)
    return seq, mask, pos


def make_sft_data(root, n):
    """Packed documents: position ids restart inside windows, half the tokens masked."""
    seq, mask, pos = sft_arrays(n)
    out = os.path.join(root, "sft")
    os.makedirs(out)
    for key, arr in (("sequence", seq), ("loss_mask", mask), ("position_ids", pos)):
        arr.tofile(os.path.join(out, key + ".bin"))
    with open(os.path.join(out, "meta.json"), "w") as f:
        f.write('{"sequence": {"shape": [%d], "dtype": "int32"}, '
                '"loss_mask": {"shape": [%d], "dtype": "int32"}, '
                '"position_ids": {"shape": [%d], "dtype": "int32"}}' % (n, n, n))
    return out


def train(args, expect=0):
    return run([binary("astrai-train")] + [f"--{k}={v}" for k, v in args.items()], expect)


def all_metric_rows(ckpt):
    """Every row of ckpt/metric.jsonl as written (AstrAI's shapes: type step/epoch/validation,
    timestamp, ...)."""
    with open(os.path.join(ckpt, "metric.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def metric_rows(ckpt):
    """The step rows of ckpt/metric.jsonl without their timestamp (which differs between runs
    that computed the same numbers)."""
    return [{k: v for k, v in r.items() if k != "timestamp"} for r in all_metric_rows(ckpt)
            if r.get("type", "step") == "step"]


def latest_checkpoint(ckpt_dir):
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("epoch_")]
    return os.path.join(ckpt_dir, max(names, key=lambda n: int(n.rsplit("_", 1)[1])))


def windows(tokens, window, stride, loss_mask=None, position_ids=None):
    """docs/design.md §8 windowing: (inputs, targets) per sample index; with sft's loss_mask and
    position_ids (docs/data.md), (inputs, targets, loss_mask[begin+1:end+1],
    position_ids[begin:end])."""
    T = len(tokens)
    n = (T - 1 - window) // stride + 1 if T > window else 0
    out = []
    for i in range(n):
        begin = min(i * stride, T - 1 - window)
        end = min(begin + window, T - 1)
        sample = (tokens[begin:end], tokens[begin + 1:end + 1])
        if loss_mask is not None:
            sample += (loss_mask[begin + 1:end + 1], position_ids[begin:end])
        out.append(sample)
    return out


def cosine_factor(t, total, warmup_ratio, min_rate):
    """docs/design.md §8 cosine schedule, written from the formula."""
    W = int(warmup_ratio * total)
    if t < W:
        return max(min_rate, t / max(W, 1))
    p = min((t - W) / max(total - W, 1), 1.0)
    return max(min_rate, 0.5 * (1 + math.cos(math.pi * p)))


def reference_loop(model, n, batch, accum, steps_limit, optimizer, max_lr, weight_decay,
                   max_grad_norm, seed, micro_loss, shuffle=True, warmup_ratio=0.05,
                   min_rate=0.01, n_epoch=1, scaler=None, overflows=None):
    """astrai-train's steps (one rank) over n samples: the sampler's order, micro-batches of
    `batch` samples, `accum` of them per step, clipping, the cosine lr, at most steps_limit
    steps. micro_loss(idx, consumed) is (loss, {metric: float}) of the samples idx, consumed
    those read before them; a step row has the mean loss and metrics over its micro-batches.
    scaler (tests/ref/grad_scaler.py): dynamic loss scaling as GradScaler does it: the loss
    backpropagated times S (the float32 weight S/accum, as astrai-train's), a step whose
    gradients are not finite skipped (the lr advances), else the gradients divided by S before
    clipping; rows gain loss_scale and skipped. overflows: the steps (1-based) that overflow,
    given rather than found (where the last float of the range decides, implementations may
    round differently)."""
    total = (math.ceil(n / batch) // accum) * n_epoch
    opt = make_optimizer(optimizer, list(model.named_parameters()), lr=max_lr,
                         weight_decay=weight_decay)
    rows, step, micro, consumed, sums = [], 0, 0, 0, {}
    for epoch in range(n_epoch):
        order = ref_sampler.rank_order(n, 1, 0, seed, epoch, shuffle)
        for b0 in range(0, n, batch):
            idx = order[b0:b0 + batch]
            loss, metrics = micro_loss(idx, consumed)
            scale = scaler.scale if scaler else 1.0
            if scaler is None:
                (loss / accum).backward()
            else:
                (loss * torch.tensor(scale / accum, dtype=torch.float32)).backward()
            for key, value in {"loss": float(loss), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + value
            consumed += len(idx)
            micro += 1
            if micro % accum:
                continue
            lr = max_lr * cosine_factor(step, total, warmup_ratio, min_rate)
            params = list(model.parameters())
            overflow = scaler is not None and not all(
                bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
            if overflows is not None:
                overflow = step + 1 in overflows
            norm = math.nan
            if not overflow:
                if scaler is not None:
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(torch.tensor(1.0 / scale, dtype=torch.float32))
                norm = clip_grad_norm(params, max_grad_norm)
                opt.step(lr)
            opt.zero_grad()
            step += 1
            row = {"step": step, "epoch": epoch, "lr": lr, "grad_norm": norm,
                   "consumed_samples": consumed}
            if scaler is not None:
                row.update(loss_scale=scale, skipped=int(overflow))
                scaler.update(overflow)
            row.update({key: value / accum for key, value in sums.items()})
            rows.append(row)
            sums = {}
            if step == steps_limit:
                return rows
    return rows


def reference_training(model_dir, tokens, window, batch, accum, steps_limit, optimizer, max_lr,
                       weight_decay, max_grad_norm, seed, shuffle=True, warmup_ratio=0.05,
                       min_rate=0.01, n_epoch=1, neftune_alpha=0.0, scaler=None,
                       overflows=None, dtype=None, loss_mask=None, position_ids=None):
    """Trains RefModel like astrai-train does (one rank); returns (rows, model). dtype: the
    compute dtype of RefModel's reduced-precision scheme (None: fp32). loss_mask and
    position_ids (arrays as long as tokens): sft, the loss over the masked targets of each
    micro-batch, attention within the packed documents."""
    torch.manual_seed(0)
    model = RefModel.from_dir(model_dir, dtype)
    samples = windows(tokens, window, window, loss_mask, position_ids)

    def stacked(idx, k):
        return torch.tensor(np.stack([samples[i][k] for i in idx]).astype(np.int64))

    def micro_loss(idx, consumed):
        x, y = stacked(idx, 0), stacked(idx, 1)
        mask, pos = (stacked(idx, 2), stacked(idx, 3)) if loss_mask is not None else (None, None)
        noise = None
        if neftune_alpha > 0:
            noise = ref_noise.neftune_noise(neftune_alpha, seed, consumed, x.shape[0],
                                            x.shape[1], model.cfg["hidden_size"])
        return ref_loss(model.forward(x, pos, embed_noise=noise), y, mask), {}

    rows = reference_loop(model, len(samples), batch, accum, steps_limit, optimizer, max_lr,
                          weight_decay, max_grad_norm, seed, micro_loss, shuffle, warmup_ratio,
                          min_rate, n_epoch, scaler, overflows)
    return rows, model


def rel_err(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def finish(failures):
    """Prints the failures; the test's exit code (0 when there are none)."""
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0
