#!/usr/bin/python3
"""bench_ckpt.py: what a checkpoint costs training, side by side in one run, on a ~100M-parameter
model (1.2 GB of fp32 weights and AdamW state per checkpoint) with fsdp over 2 ranks (1 thread
each: both cores busy), a checkpoint every other step, in four ways: the full format (rank 0
gathers and writes) and --ckpt_format sharded (every rank writes its own), each synchronous and
with --async_checkpoint. For each: the time training is blocked per checkpoint (the wall time of
a step followed by one less the median of the steps that are not) and rank 0's memory during a
checkpoint (ASTRAI_MEMORY_REPORT: the most resident bytes a checkpoint added, and what rank 0
holds between steps).

    /usr/bin/python3 bench/bench_ckpt.py --build build --steps 9
"""
import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile

import bench_train as bt

# ~100M parameters: 14 blocks of 768, the bench vocabulary.
CONFIG = dict(bt.CONFIG, hidden_size=768, num_hidden_layers=14, num_attention_heads=12,
              num_key_value_heads=4, intermediate_size=2048)
WAYS = {"full": {}, "full+async": {"async_checkpoint": "true"},
        "sharded": {"ckpt_format": "sharded"},
        "sharded+async": {"ckpt_format": "sharded", "async_checkpoint": "true"}}


def run(args, root, model, data, name, extra):
    ckpt = os.path.join(root, name)
    report = os.path.join(root, name + ".mem")
    os.makedirs(report)
    flags = {"train_type": "seq", "param_path": model, "data_root_path": data,
             "parallel_mode": "fsdp", "nprocs": 2, "batch_per_device": args.batch // 2,
             "window_size": args.window, "threads": 1, "optimizer": "adamw", "shuffle": "false",
             "max_steps": args.steps, "ckpt_interval": 2, "ckpt_dir": ckpt,
             "checkpoint_keep_last": 1}
    flags.update(extra)
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    bt.run_child(cmd, os.path.join(root, name + ".log"), 1, {"ASTRAI_MEMORY_REPORT": report})
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        times = [w for (w,) in db.execute("SELECT wall_time FROM steps ORDER BY step")]
    with open(os.path.join(report, "rank0.json")) as f:
        mem = json.load(f)
    # A step's row is written before the checkpoint that follows it: the checkpoint after step s
    # (s even) falls between the rows of s and s + 1, in the span the duration of step s + 1 has.
    span = {s: times[s - 1] - times[s - 2] for s in range(2, len(times) + 1)}  # step s's
    with_ckpt = [d for s, d in span.items() if s % 2 == 1]
    without = [d for s, d in span.items() if s % 2 == 0]
    base = statistics.median(without)
    shutil.rmtree(ckpt)
    return {"step_s": base, "blocked_s": [d - base for d in with_ckpt],
            "blocked_median_s": statistics.median(d - base for d in with_ckpt),
            "rank0_ckpt_added_bytes": mem["ckpt_bytes"], "rank0_state_bytes": mem["state_bytes"]}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="astrai-bench-ckpt-")
    try:
        model = bt.make_model(args.build, root, CONFIG)
        n_params = sum(bt.count_params(os.path.join(model, "model.safetensors")).values())
        data = bt.make_dataset(root, args.steps * args.batch, args.window)
        result = {"parameters": n_params, "load_average": None}
        for way, extra in WAYS.items():
            r = run(args, root, model, data, way.replace("+", "-"), extra)
            result[way] = r
            print(f"{way:14s} blocked per checkpoint (median) {r['blocked_median_s']:.3f} s "
                  f"(steps without one {r['step_s']:.3f} s); rank 0 during a checkpoint "
                  f"+{r['rank0_ckpt_added_bytes'] / 2**20:.0f} MiB over "
                  f"{r['rank0_state_bytes'] / 2**20:.0f} MiB", flush=True)
        result["load_average"] = os.getloadavg()
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
