#!/usr/bin/env python3
"""bench_gpu.py: astrai-train on one GPU against PyTorch training the same model, in one run.

For each model config (the issue's ~125M and ~1B, below), one after the other, never side by
side on the GPU:
  1. astrai-train --device_type=cuda --dtype=bf16, AdamW, seq training: tokens/s from
     progress.db over the steps after the warm-up, peak GPU memory;
  2. PyTorch on the same architecture and batches, in its own process: fp32 master weights
     with bf16 autocast, F.scaled_dot_product_attention forced to the flash backend,
     torch.compile per decoder block (one compiled block serves every layer, so compiling
     takes seconds, not minutes), torch.optim.AdamW(fused=True): tokens/s over the same
     steps, peak GPU memory;
and, before and after, the bf16 GEMM rate of torch.matmul on large square matrices (the
better of the two is the MFU denominator).

    MFU = tokens/s * flops/token / GEMM rate,
    flops/token = 6*N + 12*L*H*D*T  (N: every parameter, embedding and head included; the
    attention term is PaLM's, counting the full T x T score matrix of QK^T and AV, forward
    and backward; L layers, H query heads of D, window T).
    mfu_excl_embedding uses N without the embedding table (a gather, not a GEMM).

Peak GPU memory: the device's memory in use, sampled every 20 ms through NVML (nvidia-ml-py;
`nvidia-smi -lms 50` where NVML is missing) while the process runs, minus the reading just
before it started: it includes the CUDA context and, for PyTorch, the caching allocator's
reserve (torch's own max_memory_allocated is reported beside it).

astrai-train is stopped (SIGKILL) once progress.db has its last timed step, so that the final
checkpoint (13 GB at 1B with the optimizer state) is not written; --keep-final-checkpoint
lets it finish.

Prints one JSON object, then one summary line per config ("bench_gpu: ..."), with the ratio
astrai/PyTorch tokens/s. Flags: --configs 125m,1b --steps 10 --warmup 3 --batch-125m 16
--batch-1b 8 --json PATH --time-limit S --no-compile --gemm-size 8192 --workdir DIR.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The CPU bench's optimizer settings and schedule: the same training on both benches.
from bench_train import MAX_GRAD_NORM, MAX_LR, SEED, WEIGHT_DECAY, cosine_lr  # noqa: E402

GIB = 1 << 30

# Untied lm_head (as AstrAI's checkpoints), no qk-norm, no gated attention.
_COMMON = {"vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "attn_type": "gqa", "ffn_type": "mlp",
           "use_qk_norm": False, "use_gated_attention": False}
CONFIGS = {
    # 134M parameters with the untied head (110M tied); intermediate 2048 (SwiGLU, ~8/3 C).
    "125m": {"model": dict(_COMMON, hidden_size=768, num_hidden_layers=12,
                           num_attention_heads=12, num_key_value_heads=12,
                           intermediate_size=2048, max_position_embeddings=1024),
             "window": 1024, "batch": 16},
    # 852M parameters with the untied head.
    "1b": {"model": dict(_COMMON, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=4,
                         intermediate_size=5632, max_position_embeddings=2048),
           "window": 2048, "batch": 8},
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build-gpu", help="build directory with the binaries")
    p.add_argument("--configs", default="125m,1b", help="comma-separated: 125m, 1b")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps, >= 2 (default 3)")
    p.add_argument("--batch-125m", type=int, default=CONFIGS["125m"]["batch"])
    p.add_argument("--batch-1b", type=int, default=CONFIGS["1b"]["batch"])
    p.add_argument("--gemm-size", type=int, default=8192, help="square bf16 GEMM size")
    p.add_argument("--no-compile", action="store_true", help="PyTorch eager (no torch.compile)")
    p.add_argument("--keep-final-checkpoint", action="store_true",
                   help="let astrai-train write its final checkpoint")
    p.add_argument("--json", help="also write the JSON object here")
    p.add_argument("--time-limit", type=float, default=900,
                   help="seconds for everything; configs that do not fit are skipped")
    p.add_argument("--workdir", help="keep models, data and logs here (default: temp, removed)")
    p.add_argument("--worker", choices=["gemm", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 2:
        p.error("--steps must be >= 1 and --warmup >= 2 (the first steps compile)")
    a.configs = [c for c in a.configs.split(",") if c]
    for c in a.configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown config '{c}' (125m, 1b)")
    return a


# ------------------------------------------------------------------ formulas


def param_count(cfg):
    C, L, V, FF = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"],
                   cfg["intermediate_size"])
    D = C // cfg["num_attention_heads"]
    KV = cfg["num_key_value_heads"] * D
    layer = 2 * C * C + 2 * KV * C + 3 * FF * C + 2 * C  # q, o, k, v, mlp, two norms
    head = 0 if cfg["tie_word_embeddings"] else V * C
    return {"total": V * C + L * layer + C + head, "embedding": V * C}


def flops_per_token(cfg, window):
    n = param_count(cfg)
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    D = cfg["hidden_size"] // H
    attention = 12 * L * H * D * window
    return {"params": n["total"], "params_embedding": n["embedding"],
            "attention_flops_per_token": attention,
            "flops_per_token": 6 * n["total"] + attention,
            "flops_per_token_excl_embedding": 6 * (n["total"] - n["embedding"]) + attention}


def steady_rate(times, tokens_per_step, warmup):
    """Tokens/s from the end of the last warm-up step to the end of the last step."""
    timed, start = times[warmup:], times[warmup - 1]
    step_s = [b - a for a, b in zip([start] + timed[:-1], timed)]
    return {"tokens_per_s": len(timed) * tokens_per_step / (timed[-1] - start),
            "timed_steps": len(timed), "step_s_min": min(step_s), "step_s_max": max(step_s),
            "tokens_per_s_best_step": tokens_per_step / min(step_s)}


# ------------------------------------------------------------------ GPU memory


class GpuMemory:
    """Samples the device's memory in use from a thread while a child runs."""

    def __init__(self):
        self.method, self._read = None, None
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
            self._read()
            self.method = "nvml, every 20 ms"
        except Exception:
            if shutil.which("nvidia-smi"):
                self.method = "nvidia-smi -lms 50"

    def _smi_once(self):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits", "-i", "0"], capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0]) << 20

    def start(self):
        self.peak = self.base = self._read() if self._read else (
            self._smi_once() if self.method else 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        if self._read:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._read())
                time.sleep(0.02)
        elif self.method:
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,"
                                    "noheader,nounits", "-i", "0", "-lms", "50"],
                                   stdout=subprocess.PIPE, text=True)
            for line in smi.stdout:
                if self._stop.is_set():
                    break
                if line.strip().isdigit():
                    self.peak = max(self.peak, int(line) << 20)
            smi.terminate()
            smi.wait()

    def stop(self):
        """Peak bytes in use above the reading before start()."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak - self.base if self.method else None


def run_child(cmd, log_path, timeout, memory, done=None):
    """Runs cmd (stdout to log_path.out, stderr to log_path) while sampling GPU memory; stops
    it with SIGKILL once done() is true. Returns (exit code, peak bytes, seconds, stopped)."""
    t0 = time.time()
    stopped = False
    memory.start()
    with open(log_path + ".out", "w") as out, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=out, stderr=log)
        polls = 0
        while proc.poll() is None:
            time.sleep(0.05)
            polls += 1
            if time.time() - t0 > timeout:
                proc.kill()
                proc.wait()
                memory.stop()
                raise TimeoutError(f"{' '.join(cmd[:2])}... ran past {timeout:.0f} s")
            if done and polls % 4 == 0 and done():
                proc.send_signal(signal.SIGKILL)
                stopped = True
        proc.wait()
    return proc.returncode, memory.stop(), time.time() - t0, stopped


def log_tail(path, n=3000):
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


# ------------------------------------------------------------------ inputs


def param_shapes(cfg):
    """{AstrAI name: shape} (docs/design.md §7 keys; no qk-norm, no gate, as CONFIGS)."""
    C, V, FF = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    KV = cfg["num_key_value_heads"] * (C // cfg["num_attention_heads"])
    shapes = {"embed_tokens.weight": (V, C), "norm.weight": (C,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "attention.q_proj.weight": (C, C), p + "attention.k_proj.weight": (KV, C),
                       p + "attention.v_proj.weight": (KV, C), p + "attention.o_proj.weight": (C, C),
                       p + "input_norm.weight": (C,), p + "post_attention_norm.weight": (C,),
                       p + "mlp.up.weight": (FF, C), p + "mlp.gate.weight": (FF, C),
                       p + "mlp.down.weight": (C, FF)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def write_model(root, cfg):
    """A bf16 model directory written directly: linear weights tiled from a pool of 2^24
    N(0, 0.02) values (random at the scale of a GEMM tile, so the GEMMs run at their
    random-data speed), norms 1. Seconds where astrai-model init of the 1B model takes
    tens of seconds; the values do not matter to a throughput benchmark."""
    out = os.path.join(root, "model")
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"model_type": "autoregressive_lm", **cfg, "rope_scaling": None}, f, indent=1)
    bits = (np.random.default_rng(SEED).standard_normal(1 << 24, dtype=np.float32) * 0.02)
    bits = bits.view(np.uint32)
    pool = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to bf16
    shapes = param_shapes(cfg)
    header, offset = {}, 0
    for name in sorted(shapes):
        n = math.prod(shapes[name])
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + 2 * n]}
        offset += 2 * n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for k, name in enumerate(sorted(shapes)):
            n = math.prod(shapes[name])
            if name.endswith("norm.weight"):
                f.write(np.full(n, 0x3F80, dtype=np.uint16).tobytes())  # 1.0
                continue
            start = (k * 7919) % len(pool)
            while n:
                m = min(n, len(pool) - start)
                f.write(pool[start:start + m].tobytes())
                n, start = n - m, 0
    return out


def make_model(build, root, cfg):
    """write_model, checked by `astrai-model info` (else astrai-model init). Returns
    (model directory, how it was made)."""
    model = os.path.join(build, "astrai-model")
    out = write_model(root, cfg)
    info = subprocess.run([model, "info", out, "--json"], capture_output=True, text=True)
    if info.returncode == 0:
        return out, "written by bench_gpu.py (bf16, tiled N(0,0.02))"
    print(f"bench_gpu: astrai-model info rejected the written model ({info.stderr.strip()}); "
          "using astrai-model init", file=sys.stderr)
    path = os.path.join(root, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    subprocess.run([model, "init", "--config", path, "--out", out, "--dtype", "bf16", "--seed",
                    str(SEED), "--force"], check=True, capture_output=True, text=True)
    return out, "astrai-model init --dtype bf16"


def make_dataset(root, n_windows, window, vocab):
    """One bin shard of uniform random ids: exactly n_windows windows."""
    shard = os.path.join(root, "data", "part0")
    os.makedirs(shard)
    n = n_windows * window + 1
    ids = np.random.default_rng(SEED).integers(0, vocab, n, dtype=np.int32)
    ids.astype("<i4").tofile(os.path.join(shard, "sequence.bin"))
    with open(os.path.join(shard, "meta.json"), "w") as f:
        json.dump({"sequence": {"shape": [n], "dtype": "int32"}}, f)
    return os.path.join(root, "data")


# ------------------------------------------------------------------ the two sides


def run_astrai(args, root, name, model_dir, data_dir, batch, window, memory, timeout):
    ckpt = os.path.join(root, "ckpt")
    total = args.warmup + args.steps
    flags = {"train_type": "seq", "param_path": model_dir, "data_root_path": data_dir,
             "batch_per_device": batch, "window_size": window, "optimizer": "adamw",
             "max_lr": MAX_LR, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
             "shuffle": "false", "random_seed": SEED, "max_steps": total,
             "ckpt_interval": 10 ** 12, "log_interval": 1, "ckpt_dir": ckpt,
             "device_type": "cuda", "dtype": "bf16"}
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    db_path = os.path.join(ckpt, "progress.db")

    def rows():
        with sqlite3.connect(db_path, timeout=5) as db:
            return db.execute("SELECT step, loss, tokens_per_s, wall_time FROM steps "
                              "ORDER BY step").fetchall()

    def all_steps_done():
        try:
            return os.path.exists(db_path) and len(rows()) >= total
        except sqlite3.Error:
            return False

    log = os.path.join(root, f"astrai-{name}.log")
    rc, peak, seconds, stopped = run_child(
        cmd, log, timeout, memory, None if args.keep_final_checkpoint else all_steps_done)
    if rc != 0 and not stopped:
        raise RuntimeError(f"astrai-train exited {rc}:\n{log_tail(log)}")
    r = rows()
    if len(r) < total:
        raise RuntimeError(f"progress.db has {len(r)} steps, expected {total}\n{log_tail(log)}")
    out = steady_rate([w for _, _, _, w in r], batch * window, args.warmup)
    out.update(mean_step_tokens_per_s=float(np.mean([t for _, _, t, _ in r[args.warmup:]])),
               loss_first=r[0][1], loss_last=r[-1][1], peak_gpu_memory_bytes=peak,
               process_seconds=seconds, stopped_before_final_checkpoint=stopped,
               attention_kernels=attention_kernels(log))
    return out


def attention_kernels(log):
    """Which attention kernels a bf16 astrai-train ran: attention.cu logs each reason for the
    SIMT fallback once; without such a line the tensor-core kernels served every call."""
    with open(log, errors="replace") as f:
        fallbacks = [line.split("CUDA attention: ", 1)[1].strip() for line in f
                     if "CUDA attention: " in line and "SIMT" in line]
    return "simt: " + "; ".join(fallbacks) if fallbacks else "tensor-core"


def run_torch(args, root, name, data_dir, batch, memory, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "torch", "--config", name,
           "--data", data_dir, "--batch", str(batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + (["--no-compile"] if args.no_compile else [])
    log = os.path.join(root, f"pytorch-{name}.log")
    rc, peak, seconds, _ = run_child(cmd, log, timeout, memory)
    if rc != 0:
        raise RuntimeError(f"the PyTorch worker exited {rc}:\n{log_tail(log)}")
    with open(log + ".out") as f:
        peer = json.loads(f.read().strip().splitlines()[-1])
    out = steady_rate(peer.pop("times"), batch * CONFIGS[name]["window"], args.warmup)
    losses = peer.pop("losses")
    out.update(peer, loss_first=losses[0], loss_last=losses[-1], peak_gpu_memory_bytes=peak,
               process_seconds=seconds)
    return out


def gemm_rate(args, root, memory, label):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "gemm", "--gemm-size",
           str(args.gemm_size)]
    log = os.path.join(root, f"gemm-{label}.log")
    rc, _, _, _ = run_child(cmd, log, 120, memory)
    if rc != 0:
        raise RuntimeError(f"the GEMM worker exited {rc}:\n{log_tail(log)}")
    with open(log + ".out") as f:
        return json.loads(f.read().strip().splitlines()[-1])


# ------------------------------------------------------------------ workers (child processes)


def gemm_worker(args):
    """bf16 torch.matmul of two (n, n) matrices: the best of 5 timings of 10 products."""
    import torch

    n = args.gemm_size
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        rates.append(2 * n ** 3 * 10 / (start.elapsed_time(end) / 1e3))
    print(json.dumps({"size": n, "tflops": max(rates) / 1e12,
                      "tflops_mean": sum(rates) / len(rates) / 1e12,
                      "device": torch.cuda.get_device_name(0), "torch": torch.__version__}))


def torch_worker(args):
    """The model of CONFIGS[args.config] trained on the dataset's first windows (shuffle off,
    like astrai-train here); prints {"times", "losses", ...} as one JSON line."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg, window = CONFIGS[args.config]["model"], CONFIGS[args.config]["window"]
    V, C, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    H, KVH, FF, eps = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                       cfg["intermediate_size"], cfg["rms_norm_eps"])
    D, B, T = C // H, args.batch, window
    dev = torch.device("cuda")
    torch.manual_seed(SEED)

    def weight(*shape, std=0.02):
        return (torch.randn(*shape, device=dev) * std).requires_grad_()

    def ones(n):
        return torch.ones(n, device=dev, requires_grad=True)

    out_std = 0.02 / math.sqrt(2 * L)  # docs/design.md §7 init
    embed, norm, head = weight(V, C), ones(C), weight(V, C)
    layers = [(ones(C), weight(C, C), weight(KVH * D, C), weight(KVH * D, C),
               weight(C, C, std=out_std), ones(C), weight(FF, C), weight(FF, C),
               weight(C, FF, std=out_std)) for _ in range(L)]
    params = [embed] + [p for layer in layers for p in layer] + [norm, head]

    # RoPE on interleaved pairs, angles in fp64 as astrai builds them.
    theta = cfg["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = (torch.arange(T, dtype=torch.float64)[:, None] * theta).float()
    cos, sin = angle.cos().to(dev)[:, None, :], angle.sin().to(dev)[:, None, :]  # (T,1,D/2)

    def rope(x):  # x: (B,T,h,D)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    # Flash attention, with native GQA where this torch's flash path takes enable_gqa, else
    # K/V repeated to H heads; torch's own choice of backend if flash refuses both.
    def flash_works(native):
        q = torch.randn(1, H, 256, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, KVH if native else H, 256, D, device=dev, dtype=torch.bfloat16)
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                F.scaled_dot_product_attention(q, k, k, is_causal=True,
                                               enable_gqa=native and KVH != H)
            return True
        except Exception:
            return False

    native_gqa = KVH == H or flash_works(True)
    flash = flash_works(native_gqa)
    sdpa = {"backend": "flash (forced)" if flash else "torch's choice (flash refused)",
            "gqa": "native" if native_gqa else "repeat_interleave"}

    def block(x, n1, wq, wk, wv, wo, n2, up, gate, down):  # x: (B,T,C) fp32 residual
        h = F.rms_norm(x, (C,), n1, eps)
        q = rope(F.linear(h, wq).view(B, T, H, D)).to(torch.bfloat16).transpose(1, 2)
        k = rope(F.linear(h, wk).view(B, T, KVH, D)).to(torch.bfloat16).transpose(1, 2)
        v = F.linear(h, wv).view(B, T, KVH, D).to(torch.bfloat16).transpose(1, 2)
        if native_gqa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KVH != H)
        else:
            k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, C), wo)
        h = F.rms_norm(x, (C,), n2, eps)
        return x + F.linear(F.linear(h, up) * F.silu(F.linear(h, gate)), down)

    def head_loss(x, norm_w, head_w, y):
        logits = F.linear(F.rms_norm(x, (C,), norm_w, eps), head_w)
        return F.cross_entropy(logits.view(-1, V).float(), y.view(-1))

    if not args.no_compile:
        block, head_loss = torch.compile(block), torch.compile(head_loss)
    opt = torch.optim.AdamW(params, lr=MAX_LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=WEIGHT_DECAY, fused=True)
    tokens = np.fromfile(os.path.join(args.data, "part0", "sequence.bin"), dtype="<i4")
    seq = torch.from_numpy(tokens.astype(np.int64)).to(dev)
    total_schedule = (len(tokens) - 1) // T // B  # astrai-train's total_steps (one epoch)
    span = B * T
    times, losses = [], []
    t0 = time.time()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else contextlib.nullcontext():
        for step in range(args.warmup + args.steps):
            chunk = seq[step * span:(step + 1) * span + 1]
            x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)  # window b: tokens b*T.., next
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = F.embedding(x, embed)
                for layer in layers:
                    h = block(h, *layer)
                loss = head_loss(h, norm, head, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, total_schedule)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())  # one read-back per step, as astrai-train
            times.append(time.time())
    print(json.dumps({"times": times, "losses": losses, "params": sum(p.numel() for p in params),
                      "first_step_seconds": times[0] - t0, "compile": not args.no_compile,
                      "sdpa": sdpa, "torch": torch.__version__,
                      "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                      "max_memory_reserved_bytes": torch.cuda.max_memory_reserved()}))


# ------------------------------------------------------------------ report


def finish_config(res, gemm_flops):
    for side in ("astrai", "pytorch"):
        s = res.get(side)
        if not isinstance(s, dict) or "tokens_per_s" not in s:
            continue
        s["mfu"] = s["tokens_per_s"] * res["flops_per_token"] / gemm_flops
        s["mfu_excl_embedding"] = (s["tokens_per_s"] * res["flops_per_token_excl_embedding"] /
                                   gemm_flops)
        if s.get("peak_gpu_memory_bytes") is not None:
            s["peak_gpu_memory_gib"] = s["peak_gpu_memory_bytes"] / GIB
    a, p = res.get("astrai", {}), res.get("pytorch", {})
    if "tokens_per_s" in a and "tokens_per_s" in p:
        res["ratio_tokens_per_s"] = a["tokens_per_s"] / p["tokens_per_s"]


def summary_line(name, res):
    def side(s):
        if not isinstance(s, dict) or "tokens_per_s" not in s:
            return f"FAILED ({(s or {}).get('error', 'not run')[:200]!r})"
        mem = s.get("peak_gpu_memory_gib")
        return (f"{s['tokens_per_s']:.0f} tok/s, MFU {100 * s.get('mfu', 0):.1f}%, peak "
                + (f"{mem:.1f} GiB" if mem is not None else "n/a")
                + (f", attention {s['attention_kernels']}" if "attention_kernels" in s else ""))
    ratio = res.get("ratio_tokens_per_s")
    return (f"bench_gpu: {name}: astrai {side(res.get('astrai'))} | pytorch "
            f"{side(res.get('pytorch'))} | ratio astrai/pytorch "
            + (f"{ratio:.2f}x" if ratio else "n/a"))


def main(argv):
    args = parse_args(argv)
    if args.worker == "gemm":
        return gemm_worker(args)
    if args.worker == "torch":
        return torch_worker(args)
    deadline = time.time() + args.time_limit
    args.build = os.path.abspath(args.build)
    for b in ("astrai-train", "astrai-model"):
        if not os.access(os.path.join(args.build, b), os.X_OK):
            sys.exit(f"bench_gpu: {os.path.join(args.build, b)} not found (build first)")
    root = args.workdir or tempfile.mkdtemp(prefix="astrai-bench-gpu-")
    os.makedirs(root, exist_ok=True)
    memory = GpuMemory()
    result = {"steps": args.steps, "warmup": args.warmup, "memory_method": memory.method,
              "mfu_formula": "MFU = tokens/s * (6*N + 12*L*H*D*T) / bf16 GEMM rate (N: all "
                             "parameters incl. embedding and head; T: window)",
              "configs": {}, "targets": {"ratio_min": 1.0, "mfu_1b_min": 0.4}}

    def write():
        text = json.dumps(result, indent=2)
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                f.write(text + "\n")
            os.replace(args.json + ".tmp", args.json)
        return text

    failed = False
    try:
        try:
            result["gemm"] = {"before": gemm_rate(args, root, memory, "before")}
        except (RuntimeError, TimeoutError) as e:
            result["error"] = f"the GEMM rate could not be measured: {e}"
            write()
            print(f"bench_gpu: {result['error']}", file=sys.stderr)
            return 1
        gemm_flops = result["gemm"]["before"]["tflops"] * 1e12
        result["device"] = result["gemm"]["before"]["device"]
        result["torch"] = result["gemm"]["before"]["torch"]
        write()
        # Rough seconds each config needs (model init, both sides with compiling).
        need = {"125m": 45, "1b": 90}
        for name in args.configs:
            spec = CONFIGS[name]
            batch = args.batch_125m if name == "125m" else args.batch_1b
            res = {"model": spec["model"], "batch": batch, "window": spec["window"],
                   **flops_per_token(spec["model"], spec["window"])}
            result["configs"][name] = res
            if deadline - time.time() < need[name]:
                res["skipped"] = f"less than {need[name]} s left of --time-limit"
                failed = True
                write()
                continue
            croot = os.path.join(root, name)
            os.makedirs(croot, exist_ok=True)
            try:
                model_dir, res["model_init"] = make_model(args.build, croot, spec["model"])
            except subprocess.CalledProcessError as e:
                res["astrai"] = res["pytorch"] = {"error": f"astrai-model init: {e.stderr}"}
                failed = True
                write()
                continue
            data_dir = make_dataset(croot, (args.warmup + args.steps) * batch, spec["window"],
                                    spec["model"]["vocab_size"])
            for side, fn in (("astrai", lambda t: run_astrai(args, croot, name, model_dir,
                                                              data_dir, batch, spec["window"],
                                                              memory, t)),
                             ("pytorch", lambda t: run_torch(args, croot, name, data_dir, batch,
                                                             memory, t))):
                try:
                    res[side] = fn(max(10, deadline - time.time()))
                except Exception as e:  # one side failing must not lose the other's numbers
                    res[side] = {"error": str(e)}
                    failed = True
                    print(f"bench_gpu: {name} {side}: {e}", file=sys.stderr)
                finish_config(res, gemm_flops)
                write()
            if not args.workdir:
                shutil.rmtree(croot, ignore_errors=True)  # the 1B model is 1.7 GB
        if deadline - time.time() > 20:
            try:
                result["gemm"]["after"] = gemm_rate(args, root, memory, "after")
            except (RuntimeError, TimeoutError) as e:
                result["gemm"]["after"] = {"error": str(e)}
        rates = [g["tflops"] for g in result["gemm"].values() if "tflops" in g]
        result["gemm"]["tflops"] = max(rates)
        for res in result["configs"].values():
            finish_config(res, result["gemm"]["tflops"] * 1e12)
        met = {f"ratio_{n}": r.get("ratio_tokens_per_s", 0) >= 1.0
               for n, r in result["configs"].items()}
        if "1b" in result["configs"]:
            met["mfu_1b"] = result["configs"]["1b"].get("astrai", {}).get("mfu", 0) >= 0.4
        result["targets"]["met"] = met
        print(write())
        print(f"bench_gpu: bf16 GEMM {result['gemm']['tflops']:.0f} TFLOP/s "
              f"({args.gemm_size}^3, {result.get('device')}); peak memory: {memory.method}")
        for name, res in result["configs"].items():
            print(summary_line(name, res) if "skipped" not in res
                  else f"bench_gpu: {name}: skipped ({res['skipped']})")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
