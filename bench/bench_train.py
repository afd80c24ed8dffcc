#!/usr/bin/python3
"""bench_train.py: astrai-train against the PyTorch reference doing the same training steps.

One run measures, on the same threads and one after the other (never side by side):
  1. the sgemm peak (build/bench_sgemm_peak on the model's matmul shapes), before and after,
  2. astrai-train: tokens/s from progress.db (warm-up steps discarded), peak RSS,
  3. the PyTorch peer (tests/ref/model.py + torch.optim.AdamW) in its own process:
     tokens/s over the same steps, peak RSS,
and prints one JSON object and a one-line summary. See bench/README.md for the formulas.

    /usr/bin/python3 bench/bench_train.py --build build --steps 20 --threads 2
"""
import contextlib
import argparse
import json
import math
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")

# The issue's ~20M-parameter config. Untied head (AstrAI's checkpoints usually carry their own
# lm_head), no qk-norm, no gated attention.
CONFIG = {
    "vocab_size": 8192, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 1408, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "attn_type": "gqa", "ffn_type": "mlp", "use_qk_norm": False, "use_gated_attention": False,
}
MAX_LR, WEIGHT_DECAY, MAX_GRAD_NORM = 3e-4, 0.1, 1.0
WARMUP_RATIO, MIN_RATE = 0.05, 0.01  # astrai-train's cosine defaults
SEED = 3407
MIB = 1024 * 1024


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with the binaries")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps, >= 1 (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for every side (default 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--window", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--sgemm-seconds", type=float, default=2.0,
                   help="seconds per sgemm shape (default 2)")
    p.add_argument("--workdir", help="keep model, data and logs here (default: a temp dir, removed)")
    p.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--autocast", default="", help=argparse.SUPPRESS)  # peer: torch.autocast dtype
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("steps", "threads", "batch", "window"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup < 1:  # steps are timed from the end of the last warm-up step
        p.error("--warmup must be >= 1")
    return a


# ------------------------------------------------------------------ processes


def run_child(cmd, log_path, threads, extra_env=None):
    """Runs cmd with stdout+stderr into log_path; returns (stdout text, peak RSS bytes, seconds).
    The peak RSS is this child's own (os.wait4), not the max over every child we ran."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    env.update(extra_env or {})
    out_path = log_path + ".out"
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=out, stderr=log, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    with open(out_path) as f:
        stdout = f.read()
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        sys.exit(f"bench_train: {' '.join(cmd)} exited {proc.returncode}\n{tail}")
    return stdout, usage.ru_maxrss * 1024, seconds


# ------------------------------------------------------------------ inputs


@contextlib.contextmanager
def work_dir(args, prog, binaries):
    """The checks before a run (the binaries built, --workdir empty), then the work dir: a
    temporary one is removed at the end, --workdir's is kept."""
    args.build = os.path.abspath(args.build)
    for name in binaries:
        if not os.access(os.path.join(args.build, name), os.X_OK):
            sys.exit(f"{prog}: {os.path.join(args.build, name)} not found (build first)")
    if args.workdir and os.path.exists(args.workdir) and os.listdir(args.workdir):
        sys.exit(f"{prog}: --workdir {args.workdir} is not empty")
    root = args.workdir or tempfile.mkdtemp(prefix="astrai-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        yield root
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


def make_model(build, root, cfg=CONFIG):
    cfg_path = os.path.join(root, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(root, "model")
    run_child([os.path.join(build, "astrai-model"), "init", "--config", cfg_path, "--out", out,
               "--dtype", "fp32", "--seed", str(SEED)], os.path.join(root, "model.log"), 1)
    return out


def make_dataset(root, n_windows, window):
    """One AstrAI bin shard (data/dataset.h) of random ids: exactly n_windows windows."""
    shard = os.path.join(root, "data", "part0")
    os.makedirs(shard)
    n = n_windows * window + 1
    ids = np.random.default_rng(SEED).integers(0, CONFIG["vocab_size"], n, dtype=np.int32)
    ids.astype("<i4").tofile(os.path.join(shard, "sequence.bin"))
    with open(os.path.join(shard, "meta.json"), "w") as f:
        json.dump({"sequence": {"shape": [n], "dtype": "int32"}}, f)
    return os.path.join(root, "data")


def count_params(safetensors_path):
    """{name: element count} from the safetensors header."""
    with open(safetensors_path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"}


# ------------------------------------------------------------------ measurements


def sgemm_peak(args, root, label):
    """The model's forward matmul shapes at B*T rows, on args.threads threads."""
    rows = args.batch * args.window
    C, FF, V = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = CONFIG["num_key_value_heads"] * C // CONFIG["num_attention_heads"]
    shapes = [(rows, C, C), (rows, kv, C), (rows, FF, C), (rows, C, FF), (rows, V, C)]
    cmd = [os.path.join(args.build, "bench_sgemm_peak"), "--threads", str(args.threads),
           "--seconds", str(args.sgemm_seconds)]
    for m, n, k in shapes:
        cmd += ["--shape", f"{m},{n},{k}"]
    out, _, _ = run_child(cmd, os.path.join(root, f"sgemm-{label}.log"), args.threads)
    return json.loads(out)


def steady_rate(times, losses, args):
    """Tokens/s over the steps after the warm-up; times[i] = wall time step i+1 ended."""
    timed, start = times[args.warmup:], times[args.warmup - 1]
    seconds = timed[-1] - start
    tokens = len(timed) * args.batch * args.window
    step_s = [b - a for a, b in zip([start] + timed[:-1], timed)]
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "steps": len(timed),
            "step_s_min": min(step_s), "step_s_max": max(step_s),
            "tokens_per_s_best_step": args.batch * args.window / min(step_s),
            "loss_first": losses[0], "loss_last": losses[-1]}


def train_astrai(args, root, train_type, model_dir, data, batch, log_name, extra=None):
    """Runs astrai-train for warmup + steps AdamW steps (the peer's settings, shuffle off);
    returns its progress.db rows (loss, tokens_per_s, wall_time), peak RSS and seconds."""
    ckpt_dir = os.path.join(root, "ckpt-" + train_type)
    total = args.warmup + args.steps
    flags = {"train_type": train_type, "param_path": model_dir, "data_root_path": data,
             "batch_per_device": batch, "window_size": args.window,
             "threads": args.threads, "optimizer": "adamw", "max_lr": MAX_LR,
             "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM, "shuffle": "false",
             "random_seed": SEED, "max_steps": total, "ckpt_interval": 100000,
             "log_interval": 1, "ckpt_dir": ckpt_dir, **(extra or {})}
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    _, rss, seconds = run_child(cmd, os.path.join(root, log_name), args.threads)
    with sqlite3.connect(os.path.join(ckpt_dir, "progress.db")) as db:
        rows = db.execute("SELECT loss, tokens_per_s, wall_time FROM steps "
                          "ORDER BY step").fetchall()
    if len(rows) != total:
        sys.exit(f"astrai-train {train_type}: progress.db has {len(rows)} steps, "
                 f"expected {total}")
    return rows, rss, seconds


def run_astrai(args, root, model_dir, data_dir):
    rows, rss, seconds = train_astrai(args, root, "seq", model_dir, data_dir, args.batch,
                                      "astrai-train.log")
    r = steady_rate([w for _, _, w in rows], [l for l, _, _ in rows], args)
    r["mean_step_tokens_per_s"] = float(np.mean([t for _, t, _ in rows[args.warmup:]]))
    r.update(peak_rss_bytes=rss, process_seconds=seconds)
    return r


def run_peer(args, root, model_dir, data_dir, autocast=""):
    """autocast: "" (fp32) or "bf16": the peer's forward under torch.autocast("cpu", bf16)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-worker", "--model", model_dir,
           "--data", data_dir, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--batch", str(args.batch),
           "--window", str(args.window), "--autocast", autocast]
    out, rss, seconds = run_child(cmd, os.path.join(root, f"pytorch{autocast}.log"), args.threads)
    peer = json.loads(out)
    r = steady_rate(peer["times"], peer["losses"], args)
    r.update(peak_rss_bytes=rss, process_seconds=seconds,
             rss_after_import_bytes=peer["rss_after_import_bytes"])
    return r


# ------------------------------------------------------------------ the PyTorch peer


def cosine_lr(step, total):
    """astrai-train's default schedule (docs/design.md §8: cosine with warmup), so the steps
    match."""
    w = int(WARMUP_RATIO * total)
    if step < w:
        return MAX_LR * max(MIN_RATE, step / max(w, 1))
    p = min((step - w) / max(total - w, 1), 1.0)
    return MAX_LR * max(MIN_RATE, 0.5 * (1 + math.cos(math.pi * p)))


def peer_start(threads):
    """torch on `threads` threads, tests/ importable; the peak RSS after importing it."""
    import resource

    import torch

    sys.path.insert(0, TESTS)
    torch.set_num_threads(threads)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peer_train(args, params, step_loss, total, rss_import):
    """astrai-train's optimizer steps on the peer's side: step_loss(step) is step's loss, then
    clipping, AdamW at the cosine lr of `total` steps; prints {"times": [...], "losses": [...],
    ...} as JSON."""
    import torch

    params = list(params)
    # foreach: the multi-tensor AdamW, same arithmetic as the per-tensor loop, less overhead.
    opt = torch.optim.AdamW(params, lr=MAX_LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=WEIGHT_DECAY, foreach=True)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        l = step_loss(step)
        l.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(l))
        times.append(time.time())
    print(json.dumps({"times": times, "losses": losses, "rss_after_import_bytes": rss_import}))


def peer_main(args):
    """Trains the reference model on the same batches astrai-train sees (shuffle off, so window
    i of the dataset is sample i)."""
    rss_import = peer_start(args.threads)
    import torch
    from ref.model import RefModel, loss

    model = RefModel.from_dir(args.model)
    tokens = np.fromfile(os.path.join(args.data, "part0", "sequence.bin"), dtype="<i4")
    seq = torch.from_numpy(tokens.astype(np.int64))
    n_windows = (len(tokens) - 1) // args.window
    total = math.ceil(n_windows / args.batch)  # astrai-train's total_steps (one epoch)
    span = args.batch * args.window

    def step_loss(step):
        chunk = seq[step * span:(step + 1) * span + 1]
        x = chunk[:-1].view(args.batch, args.window)
        y = chunk[1:].view(args.batch, args.window)  # window b's targets: its inputs shifted
        if not args.autocast:
            return loss(model.forward(x), y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model.forward(x)
        return loss(logits.float(), y)

    peer_train(args, model.parameters(), step_loss, total, rss_import)


# ------------------------------------------------------------------ report


def flops_per_token(params, window):
    """6·params (fwd+bwd of every weight) + causal attention: per layer, QK^T and AV are
    2 FLOP · T²/2 · hidden each forward, ×3 for forward+backward, / T tokens = 6·T·hidden."""
    L, C = CONFIG["num_hidden_layers"], CONFIG["hidden_size"]
    attention = 6 * L * window * C
    embedding = params.get("embed_tokens.weight", 0)  # a lookup, not a matmul
    total = sum(params.values())
    return {"params": total, "params_embedding_lookup": embedding,
            "attention_flops_per_token": attention,
            "flops_per_token": 6 * total + attention,
            "flops_per_token_excl_embedding": 6 * (total - embedding) + attention,
            "formula": "flops/token = 6*params + 6*n_layers*window*hidden "
                       "(causal QK^T and AV: 2*2*T^2/2*hidden per layer and sequence forward, "
                       "x3 with backward, /T); MFU = tokens/s * flops/token / sgemm peak"}


def report(args, sgemm, flops, astrai, peer, load):
    peak = sgemm["peak_gflops"] * 1e9
    for side in (astrai, peer):
        side["achieved_gflops"] = side["tokens_per_s"] * flops["flops_per_token"] / 1e9
        side["mfu"] = side["tokens_per_s"] * flops["flops_per_token"] / peak
        side["mfu_excl_embedding"] = (side["tokens_per_s"] *
                                      flops["flops_per_token_excl_embedding"] / peak)
        side["peak_rss_mib"] = side["peak_rss_bytes"] / MIB
    ratio = astrai["tokens_per_s"] / peer["tokens_per_s"]
    result = {"config": CONFIG, "batch": args.batch, "window": args.window,
              "threads": args.threads, "warmup_steps": args.warmup, "timed_steps": args.steps,
              "load_average_1min": load,
              "sgemm": sgemm, **flops, "astrai": astrai, "pytorch": peer,
              "ratio_tokens_per_s": ratio,
              "targets": {"ratio_min": 1.5, "mfu_min": 0.5,
                          "ratio_met": ratio >= 1.5, "mfu_met": astrai["mfu"] >= 0.5}}
    print(json.dumps(result, indent=2))
    print(f"astrai {astrai['tokens_per_s']:.0f} tok/s, pytorch {peer['tokens_per_s']:.0f} tok/s, "
          f"ratio {ratio:.2f}x, MFU {100 * astrai['mfu']:.0f}% "
          f"({100 * astrai['mfu_excl_embedding']:.0f}% without the embedding lookup; "
          f"pytorch {100 * peer['mfu']:.0f}%) "
          f"(peak sgemm {sgemm['peak_gflops']:.0f} GFLOP/s), "
          f"peak RSS astrai {astrai['peak_rss_mib']:.0f} MiB / "
          f"pytorch {peer['peak_rss_mib']:.0f} MiB; fastest step: astrai "
          f"{astrai['tokens_per_s_best_step']:.0f} tok/s, pytorch "
          f"{peer['tokens_per_s_best_step']:.0f} tok/s")
    if abs(astrai["loss_first"] - peer["loss_first"]) > 1e-3 * abs(peer["loss_first"]):
        print(f"warning: first-step losses differ (astrai {astrai['loss_first']:.5f}, pytorch "
              f"{peer['loss_first']:.5f}): the two sides did not train the same step")
    warn_load(load, args.threads)


def warn_load(load, threads):
    """A warning when the 1-minute load average sampled around the runs passed our threads."""
    busiest = max(load.values())
    if busiest > threads + 0.5:
        print(f"warning: 1-minute load average reached {busiest:.1f} on {os.cpu_count()} cores "
              f"during the run: other work shared the cores, the numbers are noisy")


def main(argv):
    args = parse_args(argv)
    if args.peer_worker:
        return peer_main(args)
    with work_dir(args, "bench_train", ("astrai-model", "astrai-train", "bench_sgemm_peak")) as root:
        model_dir = make_model(args.build, root)
        data_dir = make_dataset(root, (args.warmup + args.steps) * args.batch, args.window)
        params = count_params(os.path.join(model_dir, "model.safetensors"))
        # sgemm before and after the training runs: the better of the two is the peak, so a
        # burst of load from elsewhere during one of them does not lower it.
        load = {"start": os.getloadavg()[0]}
        sgemm = {"before": sgemm_peak(args, root, "before")}
        astrai = run_astrai(args, root, model_dir, data_dir)
        load["after_astrai"] = os.getloadavg()[0]
        peer = run_peer(args, root, model_dir, data_dir)
        load["after_pytorch"] = os.getloadavg()[0]
        sgemm["after"] = sgemm_peak(args, root, "after")
        sgemm["peak_gflops"] = max(sgemm["before"]["peak_gflops"], sgemm["after"]["peak_gflops"])
        report(args, sgemm, flops_per_token(params, args.window), astrai, peer, load)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
