#!/usr/bin/env python3
"""train_checks.py: astrai-train end to end on a GPU (issue 7 §6), with the binaries of a
CUDA build. A small model (hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 512, qk-norm and
gated attention on, window 128) trained for 20 optimizer steps (Muon + AdamW, batch 8) on a
learnable synthetic token stream, in these checks:

  (a) curves      --dtype=fp32 on cuda = the CPU run within 1e-4 relative per step;
                  bf16 within 2e-2 (loss of every step, from metric.jsonl).
  (b) determinism two identical cuda bf16 runs: identical losses, grad norms and weights.
  (c) handoff     10 steps on cuda (--max_steps), --resume on the CPU to 15, --resume on
                  cuda to 20, in bf16 and in fp32 mode: every resume loads (the checkpoint's
                  metric rows continue the previous ones exactly) and the curve matches the
                  straight runs (CPU within 1e-4 in fp32 mode, 2e-2 in bf16; the first 10
                  steps equal the straight cuda run's bit for bit).
      resume      10 + --resume 10 on cuda fp32 = straight 20: losses and weights identical.
  (d) SIGTERM     a long cuda run stopped by SIGTERM after step 5: exit 0, a checkpoint at
                  the step it stopped at (its metric rows and progress.db end there).
  (e) gradient checkpointing  --gradient_checkpointing=true gives the same curve: identical
                  in fp32 mode (cuda and cpu), within 1e-6 in bf16.
  (f) DPO, GRPO   offline DPO and GRPO (10 steps of 4 records, --train_type dpo|grpo, the
                  frozen reference on the device): cuda fp32 = cpu within 1e-4, bf16 within 2e-2.
  (g) HF features q/k/v biases, qk-norm before RoPE, Llama 3 rope scaling: cuda vs cpu.
  (h) MLA, MoE    the group `--group moe` runs alone (tests/gpu/run.sh gives it a part and
                  a time of its own): DeepSeek's attention and mixture of experts (the
                  copy_rows / moe_route / moe_combine kernels of engine/cuda/moe.cu) in three
                  models, the dense model's but for
                    mla_mlp  attn_type mla (kv_lora_rank 64, qk_nope 32 + qk_rope 32), dense FFN;
                    gqa_moe  ffn_type moe: 6 routed experts, top-3, 2 shared (scale 1/2);
                    mla_moe  both: 8 routed experts, top-2, 1 shared;
                  each with the dense tolerances: cuda fp32 = cpu within 1e-4, bf16 within
                  2e-2, fp16 (the MoE models) within 5e-3 of the cpu's fp32. The MoE models'
                  expert_load (progress.db: pairs per expert per layer per step, moe_route's
                  counts): every step and layer routes BATCH * WINDOW * k pairs, and cuda fp32
                  sends at most 1e-3 of them to other experts than the cpu (an ulp of expf may
                  decide a near tie). mla_moe also: two cuda bf16 runs identical (losses, grad
                  norms, weights, expert loads), and --gradient_checkpointing identical in fp32.

Prints one PASS/FAIL line per check and writes REPORT/train.json (rewritten after each check,
so a timeout leaves what was done; `--group moe` writes its report as the key "moe" of that
file, keeping what an earlier run of the other group wrote there). Exit 1 on any FAIL.

    python3 tests/gpu/train_checks.py --build build-gpu --report gpu-report [--time-limit S]
        [--group all|dense|moe]
"""
import argparse
import json
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import train_util as tu  # noqa: E402  (tests/train_util.py: binaries, models, metric rows)

CONFIG = {
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 704, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
    "attn_type": "gqa", "ffn_type": "mlp", "use_qk_norm": True, "use_gated_attention": True,
}
# (g) what the Hugging Face families add to the engine (docs/design.md §7): q/k/v biases
# (a rank-1 GEMM on cuBLASLt), qk-norm before RoPE, Llama 3's rope scaling.
HF_CONFIG = dict(CONFIG, attention_bias=True, qk_norm_before_rope=True, use_gated_attention=False,
                 rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
# (h) DeepSeek's attention and mixture of experts (docs/design.md §7a): per-head d = 32 + 32
# (H * d = hidden); experts of intermediate 128: top-3 of 6 with two shared experts under
# GQA, top-2 of 8 with one shared expert under MLA.
MLA_CONFIG = dict(CONFIG, attn_type="mla", kv_lora_rank=64, qk_nope_head_dim=32,
                  qk_rope_head_dim=32, num_key_value_heads=4)
GQA_MOE_CONFIG = dict(CONFIG, ffn_type="moe", intermediate_size=128, n_routed_experts=6,
                      n_shared_experts=2, n_activated_experts=3, topk_method="greedy")
MOE_CONFIG = dict(MLA_CONFIG, ffn_type="moe", intermediate_size=128, n_routed_experts=8,
                  n_shared_experts=1, n_activated_experts=2, topk_method="greedy")
MLA_MOE_MODELS = (("mla_mlp", MLA_CONFIG), ("gqa_moe", GQA_MOE_CONFIG), ("mla_moe", MOE_CONFIG))
WINDOW, BATCH, STEPS = 128, 8, 20
# fp16: 3 more significand bits than bf16 (the CPU's fp16 curve is 1.5e-5 from its reference,
# tests/test_train_lowp.py); not yet measured on a GPU.
TOL_FP32, TOL_BF16, TOL_FP16, TOL_GC_BF16 = 1e-4, 2e-2, 5e-3, 1e-6
# (h) the fraction of a run's (token, choice) pairs that cuda fp32 routes to another expert
# than the cpu run: a weight 1e-6 away can tip a near tie of the router, rarely.
TOL_LOAD_FP32 = 1e-3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build-gpu", help="build directory with the binaries")
    p.add_argument("--report", default=".", help="directory for train.json")
    p.add_argument("--time-limit", type=float, default=600,
                   help="seconds for everything; checks that do not fit fail (default 600)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--group", choices=("all", "dense", "moe"), default="all",
                   help="the checks to run: (a)-(g) dense, (h) moe (MLA and MoE), or all")
    return p.parse_args(argv)


def make_dataset(root):
    """One bin shard of exactly STEPS*BATCH windows: a token stream that mostly follows
    t -> 7t+3 (mod V), with 20% random tokens, so the loss falls over the 20 steps."""
    V = CONFIG["vocab_size"]
    n = STEPS * BATCH * WINDOW + 1
    rng = np.random.default_rng(1234)
    jumps, noisy = rng.integers(0, V, n), rng.random(n) < 0.2
    ids = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        ids[i] = jumps[i] if noisy[i] else (ids[i - 1] * 7 + 3) % V
    shard = os.path.join(root, "data", "part0")
    os.makedirs(shard)
    ids.astype("<i4").tofile(os.path.join(shard, "sequence.bin"))
    with open(os.path.join(shard, "meta.json"), "w") as f:
        json.dump({"sequence": {"shape": [n], "dtype": "int32"}}, f)
    return os.path.join(root, "data")


def make_records(root, kind):
    """AstrAI DPO or GRPO records as id arrays (no id 0): 40 records, 10 steps of 4."""
    V, rng = CONFIG["vocab_size"], np.random.default_rng(99)
    path = os.path.join(root, f"{kind}.jsonl")
    with open(path, "w") as f:
        for r in range(40):
            prompt = [int(x) for x in rng.integers(1, V, 5 + r % 7)]
            follow = [(prompt[-1] * 7 + 3 + k) % (V - 1) + 1 for k in range(4 + r % 9)]
            noise = [int(x) for x in rng.integers(1, V, 3 + r % 11)]
            if kind == "dpo":
                rec = {"prompt": prompt, "chosen": follow, "rejected": noise}
            else:  # longer responses get more reward: the token-weighted advantage is not 0
                rec = {"prompt": prompt, "responses": [follow[:2 + j * 2] for j in range(4)],
                       "rewards": [float(j) for j in range(4)]}
            f.write(json.dumps(rec) + "\n")
    return path


def max_rel(a, b):
    """max over steps of |a - b| / |b| (b the reference)."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def weights(ckpt):
    with open(os.path.join(ckpt, "model.safetensors"), "rb") as f:
        return f.read()


def tensor_bytes(ckpt, stem):
    """{tensor: raw bytes} of a checkpoint's model or optimizer state, in either layout."""
    index = os.path.join(ckpt, f"{stem}.safetensors.index.json")
    files = [f"{stem}.safetensors"]
    wmap = None
    if os.path.isfile(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        files = sorted(set(wmap.values()))
    out = {}
    for name in files:
        with open(os.path.join(ckpt, name), "rb") as f:
            data = f.read()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        for k, v in header.items():
            if k != "__metadata__" and (wmap is None or wmap.get(k) == name):
                b, e = v["data_offsets"]
                out[k] = (v["dtype"], v["shape"], data[8 + n + b:8 + n + e])
    return out


def same_tensors(a, b):
    return all(tensor_bytes(a, s) == tensor_bytes(b, s) for s in ("model", "optimizer"))


def ckpt_step(path):
    return int(os.path.basename(path).rsplit("_", 1)[1])


def expert_load(ckpt_dir):
    """{(step, layer): [pairs per expert]} of a run's progress.db."""
    with sqlite3.connect(os.path.join(ckpt_dir, "progress.db")) as db:
        rows = db.execute("SELECT step, layer, expert, tokens FROM expert_load "
                          "ORDER BY step, layer, expert").fetchall()
    load = {}
    for step, layer, _, tokens in rows:
        load.setdefault((step, layer), []).append(tokens)
    return load


class Checks:
    def __init__(self, args, root, model, data):
        self.args, self.root, self.model, self.data = args, root, model, data
        self.deadline = time.time() + args.time_limit
        self.results, self.runs, self.curves = [], {}, {}

    # ------------------------------------------------------------- bookkeeping
    def add(self, name, ok, detail, **extra):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.results.append({"check": name, "status": "PASS" if ok else "FAIL",
                             "detail": detail, **extra})
        self.write()

    def write(self):
        failed = sum(r["status"] == "FAIL" for r in self.results)
        report = {"group": self.args.group, "config": CONFIG, "window": WINDOW, "batch": BATCH,
                  "steps": STEPS,
                  "tolerances": {"fp32_vs_cpu": TOL_FP32, "bf16_vs_cpu": TOL_BF16,
                                 "fp16_vs_cpu": TOL_FP16,
                                 "gradient_checkpointing_bf16": TOL_GC_BF16,
                                 "expert_load_fp32_vs_cpu": TOL_LOAD_FP32,
                                 "metric": "max over steps of |loss - loss_ref| / |loss_ref|"},
                  "passed": len(self.results) - failed, "failed": failed,
                  "checks": self.results, "curves": self.curves, "runs": self.runs}
        if self.args.group != "dense":
            report["mla_moe_configs"] = dict(MLA_MOE_MODELS)
        path = os.path.join(self.args.report, "train.json")
        if self.args.group == "moe":  # a key of the file the dense group's run wrote
            try:
                with open(path) as f:
                    base = json.load(f)
            except (OSError, ValueError):
                base = {}
            base["moe"] = report
            report = base
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)

    def left(self):
        return self.deadline - time.time()

    # ------------------------------------------------------------- runs
    def flags(self, ckpt, device, dtype, extra):
        a = {"train_type": "seq", "param_path": self.model, "data_root_path": self.data,
             "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt,
             "ckpt_interval": 100000, "max_lr": 1e-3, "device_type": device}
        if dtype:
            a["dtype"] = dtype
        a.update(extra)
        return [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]

    def train(self, name, device, dtype=None, ckpt=None, **extra):
        """Runs astrai-train; returns the metric rows of its latest checkpoint, or None (the
        failure is recorded as a FAIL line)."""
        ckpt = ckpt or os.path.join(self.root, name)
        if self.left() < 10:
            self.add(f"run {name}", False, "not run: the time limit is reached")
            return None
        cmd = self.flags(ckpt, device, dtype, extra)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.left())
        except subprocess.TimeoutExpired:
            self.runs[name] = {"seconds": round(time.time() - t0, 2), "exit": "timeout"}
            self.add(f"run {name}", False, f"timed out: {' '.join(cmd)}")
            return None
        self.runs[name] = {"seconds": round(time.time() - t0, 2), "exit": proc.returncode}
        if proc.returncode != 0:
            self.add(f"run {name}", False, f"exit {proc.returncode}: {' '.join(cmd)}\n"
                     f"{proc.stderr[-1500:]}")
            return None
        rows = tu.metric_rows(tu.latest_checkpoint(ckpt))
        self.curves[name] = [r["loss"] for r in rows]
        return rows

    def curve_check(self, name, rows, ref, tol, what):
        if rows is None or ref is None:
            self.add(name, False, f"{what}: a run failed")
            return
        if len(rows) != len(ref):
            self.add(name, False, f"{what}: {len(rows)} steps vs {len(ref)}")
            return
        err = max_rel([r["loss"] for r in rows], [r["loss"] for r in ref])
        gn = max_rel([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref])
        ok = err <= tol if tol > 0 else all(r["loss"] == q["loss"] for r, q in zip(rows, ref))
        self.add(name, ok, f"{what}: max rel loss err {err:.3e} (tol {tol:g}); grad_norm "
                 f"{gn:.3e}", max_rel_err=err, tol=tol, grad_norm_max_rel_err=gn)

    # ------------------------------------------------------------- the checks
    def run_all(self):
        if self.args.group in ("all", "dense"):
            self.run_dense()
        if self.args.group in ("all", "moe"):
            self.run_mla_moe()

    def run_dense(self):
        cpu = self.train("cpu", "cpu")
        f32 = self.train("cuda_fp32", "cuda", "fp32")
        bf16 = self.train("cuda_bf16", "cuda", "bf16")
        if cpu is not None and len(cpu) != STEPS:
            self.add("cpu steps", False, f"{len(cpu)} metric rows, expected {STEPS}")
        # (a)
        self.curve_check("a.fp32_vs_cpu", f32, cpu, TOL_FP32, "cuda fp32 vs cpu")
        self.curve_check("a.bf16_vs_cpu", bf16, cpu, TOL_BF16, "cuda bf16 vs cpu")
        # fp16 with its default dynamic loss scaling, against the CPU's fp32 and its fp16
        f16 = self.train("cuda_fp16", "cuda", "fp16")
        self.curve_check("a.fp16_vs_cpu", f16, cpu, TOL_FP16, "cuda fp16 vs cpu fp32")
        self.curve_check("a.fp16_vs_cpu_fp16", f16, self.train("cpu_fp16", "cpu", "fp16"),
                         TOL_FP16, "cuda fp16 vs cpu fp16")
        # (b)
        again = self.train("cuda_bf16_again", "cuda", "bf16")
        if bf16 is None or again is None:
            self.add("b.determinism", False, "a run failed")
        else:
            same_rows = all(r["loss"] == q["loss"] and r["grad_norm"] == q["grad_norm"]
                            for r, q in zip(bf16, again)) and len(bf16) == len(again)
            same_w = weights(tu.latest_checkpoint(os.path.join(self.root, "cuda_bf16"))) == \
                weights(tu.latest_checkpoint(os.path.join(self.root, "cuda_bf16_again")))
            self.add("b.determinism", same_rows and same_w,
                     f"two cuda bf16 runs: losses/grad norms {'identical' if same_rows else 'DIFFER'}"
                     f", final weights {'identical' if same_w else 'DIFFER'}")
        # (c)
        self.handoff("bf16", bf16, cpu, TOL_BF16)
        self.handoff("fp32", f32, cpu, TOL_FP32)
        self.handoff("fp16", f16, cpu, TOL_FP16)
        self.resume_exact(f32)
        self.async_sharded()
        # (d)
        self.sigterm()
        # (e)
        gc = {"gradient_checkpointing": "true"}
        self.curve_check("e.gc_fp32_cuda", self.train("cuda_fp32_gc", "cuda", "fp32", **gc), f32,
                         0, "cuda fp32 --gradient_checkpointing vs without (identical)")
        self.curve_check("e.gc_bf16_cuda", self.train("cuda_bf16_gc", "cuda", "bf16", **gc), bf16,
                         TOL_GC_BF16, "cuda bf16 --gradient_checkpointing vs without")
        self.curve_check("e.gc_cpu", self.train("cpu_gc", "cpu", **gc), cpu, 0,
                         "cpu --gradient_checkpointing vs without (identical)")
        # (f) offline DPO and GRPO: the preference losses and the frozen reference on the device
        for kind in ("dpo", "grpo"):
            pref = {"train_type": kind, "data_root_path": make_records(self.root, kind),
                    "batch_per_device": 4}
            ref = self.train(f"{kind}_cpu", "cpu", **pref)
            for dt, tol in (("fp32", TOL_FP32), ("bf16", TOL_BF16)):
                self.curve_check(f"f.{kind}_{dt}_vs_cpu",
                                 self.train(f"{kind}_cuda_{dt}", "cuda", dt, **pref), ref, tol,
                                 f"{kind} cuda {dt} vs cpu")

        # (g) the Hugging Face families' engine features, cuda against cpu
        hf = {"param_path": tu.make_model(os.path.join(self.root, "hf"), HF_CONFIG)}
        hf_cpu = self.train("hf_cpu", "cpu", **hf)
        for dt, tol in (("fp32", TOL_FP32), ("bf16", TOL_BF16)):
            self.curve_check(f"g.hf_{dt}_vs_cpu", self.train(f"hf_cuda_{dt}", "cuda", dt, **hf),
                             hf_cpu, tol, f"biases, qk-norm before RoPE, llama3 rope: cuda {dt} "
                             "vs cpu")

    def run_mla_moe(self):
        """(h) each model of MLA_MOE_MODELS: cuda against cpu, as (a) does the dense model."""
        for tag, cfg in MLA_MOE_MODELS:
            if self.left() < 30:
                self.add(f"h.{tag}", False, "not run: the time limit is reached")
                continue
            self.mla_moe_model(tag, cfg)

    def mla_moe_model(self, tag, cfg):
        moe = cfg["ffn_type"] == "moe"
        what = tag.replace("_", " + ")
        model = {"param_path": tu.make_model(os.path.join(self.root, tag), cfg)}
        ref = self.train(f"{tag}_cpu", "cpu", **model)
        runs = {}
        dtypes = (("fp32", TOL_FP32), ("bf16", TOL_BF16)) + ((("fp16", TOL_FP16),) if moe else ())
        for dt, tol in dtypes:
            runs[dt] = self.train(f"{tag}_cuda_{dt}", "cuda", dt, **model)
            self.curve_check(f"h.{tag}_{dt}_vs_cpu", runs[dt], ref, tol,
                             f"{what}: cuda {dt} vs cpu")
        if not moe:
            return
        self.expert_loads(tag, cfg, [f"{tag}_cpu"] + [f"{tag}_cuda_{dt}" for dt in runs])
        if tag != "mla_moe":
            return
        # Two cuda bf16 runs bit for bit: the routing's top-k, counts and pair order are
        # integer work, its sums in fixed order.
        again = self.train(f"{tag}_cuda_bf16_again", "cuda", "bf16", **model)
        if runs["bf16"] is None or again is None:
            self.add(f"h.{tag}_determinism", False, "a run failed")
        else:
            same_rows = [(r["loss"], r["grad_norm"]) for r in runs["bf16"]] == \
                [(r["loss"], r["grad_norm"]) for r in again]
            a, b = (os.path.join(self.root, f"{tag}_cuda_bf16{n}") for n in ("", "_again"))
            same_w = weights(tu.latest_checkpoint(a)) == weights(tu.latest_checkpoint(b))
            same_load = expert_load(a) == expert_load(b)
            self.add(f"h.{tag}_determinism", same_rows and same_w and same_load,
                     f"two cuda bf16 {what} runs: losses/grad norms "
                     f"{'identical' if same_rows else 'DIFFER'}, final weights "
                     f"{'identical' if same_w else 'DIFFER'}, expert loads "
                     f"{'identical' if same_load else 'DIFFER'}")
        # Gradient checkpointing recomputes the routing in the backward: the same bits.
        self.curve_check(f"h.{tag}_gc_fp32",
                         self.train(f"{tag}_cuda_fp32_gc", "cuda", "fp32",
                                    gradient_checkpointing="true", **model), runs["fp32"], 0,
                         f"{what}: cuda fp32 --gradient_checkpointing vs without (identical)")

    def expert_loads(self, tag, cfg, names):
        """The expert_load tables of the runs `names` (the cpu run's first): every step and
        layer routed BATCH * WINDOW tokens k times over the routed experts; and the share of
        the pairs that cuda fp32 routed to other experts than the cpu run."""
        pairs, E = BATCH * WINDOW * cfg["n_activated_experts"], cfg["n_routed_experts"]
        loads, bad = {}, []
        for name in names:
            if self.runs.get(name, {}).get("exit") != 0:
                bad.append(f"{name} did not finish")
                continue
            load = loads[name] = expert_load(os.path.join(self.root, name))
            wrong = [key for key, v in load.items() if len(v) != E or sum(v) != pairs]
            layers = {layer for _, layer in load}
            if wrong or len(layers) != cfg["num_hidden_layers"] or len(load) != STEPS * len(layers):
                bad.append(f"{name}: {len(load)} (step, layer) rows, wrong sums at {wrong[:3]}")
        moved = None
        cpu, f32 = loads.get(f"{tag}_cpu"), loads.get(f"{tag}_cuda_fp32")
        if cpu and f32 and set(cpu) == set(f32):
            moved = sum(abs(a - b) for key in cpu for a, b in zip(cpu[key], f32[key])) / \
                (2 * pairs * len(cpu))
        ok = not bad and moved is not None and moved <= TOL_LOAD_FP32
        detail = f"{len(loads)} of {len(names)} runs: " + (
            "; ".join(bad) if bad else f"every step and layer {pairs} pairs over {E} experts")
        if moved is not None:
            detail += f"; cuda fp32 routed {moved:.2e} of the pairs elsewhere than cpu " \
                f"(tol {TOL_LOAD_FP32:g})"
        self.add(f"h.{tag}_expert_load", ok, f"{tag.replace('_', ' + ')}: {detail}",
                 moved=moved, tol=TOL_LOAD_FP32)

    def handoff(self, dtype, straight, cpu, tol):
        """cuda to step 10, cpu --resume to 15, cuda --resume to 20, one ckpt_dir."""
        name, ckpt = f"c.handoff_{dtype}", os.path.join(self.root, f"handoff_{dtype}")
        stages = [("cuda", dtype, {"max_steps": 10}), ("cpu", None, {"max_steps": 15}),
                  ("cuda", dtype, {})]
        prev, loads = [], []
        for i, (device, dt, extra) in enumerate(stages):
            if i:
                extra = dict(extra, resume="true")
            rows = self.train(f"handoff_{dtype}_{i + 1}_{device}", device, dt, ckpt=ckpt, **extra)
            if rows is None:
                self.add(name, False, f"stage {i + 1} ({device}) failed")
                return
            step = ckpt_step(tu.latest_checkpoint(ckpt))
            want = (10, 15, STEPS)[i]
            if step != want or len(rows) != want or rows[:len(prev)] != prev:
                self.add(name, False, f"stage {i + 1} ({device}): checkpoint at step {step}, "
                         f"{len(rows)} metric rows, expected {want} continuing the previous "
                         f"{len(prev)} (the resume did not load?)")
                return
            loads.append(f"{device}:{step}")
            prev = rows
        self.add(f"{name}.resumes", True, "every stage loaded the last one's checkpoint (" +
                 " -> ".join(loads) + ")")
        if straight is not None:
            first = [r["loss"] for r in prev[:10]] == [r["loss"] for r in straight[:10]]
            self.add(f"{name}.first10", first, "first 10 steps vs the straight cuda run: " +
                     ("identical" if first else "DIFFER"))
            if dtype in ("bf16", "fp16"):
                self.curve_check(f"{name}.vs_cuda", prev, straight, tol,
                                 "cuda->cpu->cuda vs straight cuda")
        self.curve_check(f"{name}.vs_cpu", prev, cpu, tol, "cuda->cpu->cuda vs straight cpu")

    def async_sharded(self):
        """--async_checkpoint (host copy in pinned memory) with --ckpt_format sharded on cuda:
        the checkpoints hold the synchronous full-format run's tensors, byte for byte."""
        sync_dir, async_dir = (os.path.join(self.root, n) for n in ("ckpt_sync", "ckpt_async"))
        every = {"ckpt_interval": 5}
        a = self.train("ckpt_sync", "cuda", "fp32", ckpt=sync_dir, **every)
        b = self.train("ckpt_async", "cuda", "fp32", ckpt=async_dir, async_checkpoint="true",
                       ckpt_format="sharded", **every)
        if a is None or b is None:
            self.add("c.async_sharded", False, "a run failed")
            return
        names = sorted(n for n in os.listdir(sync_dir) if n.startswith("epoch_"))
        differ = [n for n in names if not os.path.isdir(os.path.join(async_dir, n)) or
                  not same_tensors(os.path.join(sync_dir, n), os.path.join(async_dir, n))]
        self.add("c.async_sharded", bool(names) and not differ,
                 f"cuda fp32 async sharded vs sync full: {len(names)} checkpoints, "
                 f"{'identical tensors' if not differ else 'DIFFER: ' + ', '.join(differ)}")

    def resume_exact(self, straight):
        ckpt = os.path.join(self.root, "resume_fp32")
        a = self.train("resume_fp32_1", "cuda", "fp32", ckpt=ckpt, max_steps=10)
        b = self.train("resume_fp32_2", "cuda", "fp32", ckpt=ckpt, resume="true") \
            if a is not None else None
        if b is None or straight is None:
            self.add("c.resume_exact", False, "a run failed")
            return
        same = [r["loss"] for r in b] == [r["loss"] for r in straight]
        same_w = weights(tu.latest_checkpoint(ckpt)) == \
            weights(tu.latest_checkpoint(os.path.join(self.root, "cuda_fp32")))
        self.add("c.resume_exact", same and same_w,
                 f"cuda fp32 10 + --resume 10 vs straight 20: losses "
                 f"{'identical' if same else 'DIFFER'}, weights "
                 f"{'identical' if same_w else 'DIFFER'}")

    def sigterm(self):
        name, ckpt = "d.sigterm", os.path.join(self.root, "sigterm")
        if self.left() < 30:
            self.add(name, False, "not run: the time limit is reached")
            return
        # 100 epochs (2000 steps): long enough to be stopped mid-run.
        cmd = self.flags(ckpt, "cuda", "bf16", {"n_epoch": 100})
        log_path = os.path.join(self.root, "sigterm.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        reached = wait_for_steps(ckpt, 5, proc, timeout=min(60, self.left() - 20))
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self.add(name, False, "still running 60 s after SIGTERM (killed)")
            return
        with open(log_path) as f:
            err = f.read()
        if not reached or proc.returncode != 0:
            self.add(name, False, f"reached step 5: {reached}; exit {proc.returncode}: "
                     f"{err[-800:]}")
            return
        latest = tu.latest_checkpoint(ckpt)
        step, rows = ckpt_step(latest), tu.metric_rows(latest)
        with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
            last = db.execute("SELECT max(step) FROM steps").fetchone()[0]
        ok = 5 <= step < 100 * STEPS and len(rows) == step and last == step
        self.add(name, ok, f"stopped with exit 0 at step {step} of {100 * STEPS}: checkpoint "
                 f"{os.path.basename(latest)} with {len(rows)} metric rows, progress.db last "
                 f"step {last}")


def wait_for_steps(ckpt_dir, n, proc, timeout):
    """Whether progress.db shows n optimizer steps before the process ends or timeout."""
    deadline = time.time() + timeout
    db_path = os.path.join(ckpt_dir, "progress.db")
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(db_path):
            try:
                with sqlite3.connect(db_path, timeout=1) as db:
                    if db.execute("SELECT count(*) FROM steps").fetchone()[0] >= n:
                        return True
            except sqlite3.OperationalError:
                pass  # created but not yet initialised, or locked
        time.sleep(0.02)
    return False


def main(argv):
    args = parse_args(argv)
    args.build = os.path.abspath(args.build)
    os.makedirs(args.report, exist_ok=True)
    tu.BUILD = args.build
    for b in ("astrai-train", "astrai-model"):
        if not os.access(tu.binary(b), os.X_OK):
            sys.exit(f"train_checks: {tu.binary(b)} not found (build first)")
    root = tempfile.mkdtemp(prefix="astrai-gpu-train-")
    checks = None
    try:
        checks = Checks(args, root, None, None)
        if args.group != "moe":
            checks.model = tu.make_model(root, CONFIG)
        checks.data = make_dataset(root)
        checks.write()
        checks.run_all()
    except Exception as e:  # a broken setup or helper: still a report, and a FAIL
        checks.add("error", False, f"{type(e).__name__}: {e}")
    finally:
        if args.keep:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    failed = [r for r in checks.results if r["status"] == "FAIL"]
    print(f"train_checks: {len(checks.results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
