#!/usr/bin/python3
"""bench_pipeline.py: pipeline parallelism on CPU ranks (docs/design.md §13), one run, side by
side on the same model and global batch:

- step time of pp 2 (2 ranks x 1 thread) against none (1 rank x 2 threads) and ddp 2 (2 ranks
  x 1 thread), with grad_accum_steps M = 4;
- the measured bubble of pp 2 (each stage's share of a step spent waiting in its transfers,
  from the ranks' reports) against the theory (P-1)/(M+P-1) for M = 2, 4, 8;
- each stage's activation memory (bytes of its activation sets) under 1f1b and gpipe.

    /usr/bin/python3 bench/bench_pipeline.py --build build --steps 6
"""
import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile

import bench_train as bt

CONFIG = dict(bt.CONFIG, num_hidden_layers=4, hidden_size=256, intermediate_size=704,
              num_attention_heads=4, num_key_value_heads=2)


def run(args, root, model, data, name, mode, nprocs, threads, accum, pp=1, schedule="1f1b"):
    ckpt = os.path.join(root, name)
    report = os.path.join(root, name + "-report")
    os.makedirs(report)
    replicas = nprocs // pp
    flags = {"train_type": "seq", "param_path": model, "data_root_path": data,
             "parallel_mode": mode, "nprocs": nprocs, "pp_size": pp, "pp_schedule": schedule,
             "batch_per_device": args.batch // (accum * replicas), "grad_accum_steps": accum,
             "window_size": args.window, "threads": threads, "optimizer": "adamw",
             "shuffle": "false", "max_steps": args.warmup + args.steps,
             "ckpt_interval": 100000, "ckpt_dir": ckpt}
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    bt.run_child(cmd, os.path.join(root, name + ".log"), threads,
                 {"ASTRAI_MEMORY_REPORT": report})
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        rows = db.execute("SELECT loss, wall_time FROM steps ORDER BY step").fetchall()
    rate = bt.steady_rate([w for _, w in rows], [l for l, _ in rows], args)
    ranks = []
    for f in sorted(os.listdir(report)):
        with open(os.path.join(report, f)) as fh:
            ranks.append(json.load(fh))
    rate["step_s"] = rate["seconds"] / rate["steps"]
    rate["ranks"] = ranks
    return rate


def bubble(ranks):
    """Each stage's share of its training time spent in transfers (waits included)."""
    return {r["stage"]: r["transfer_s"] / (r["transfer_s"] + r["compute_s"]) for r in ranks}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=16, help="global batch (a multiple of 16)")
    p.add_argument("--window", type=int, default=128)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="astrai-bench-pipeline-")
    try:
        model = bt.make_model(args.build, root, CONFIG)
        data = bt.make_dataset(root, (args.warmup + args.steps) * args.batch, args.window)
        none = run(args, root, model, data, "none", "none", 1, 2, 4)
        ddp = run(args, root, model, data, "ddp", "ddp", 2, 1, 4)
        pp = run(args, root, model, data, "pp2", "none", 2, 1, 4, pp=2)
        result = {"step_s": {"none_1x2": none["step_s"], "ddp_2x1": ddp["step_s"],
                             "pp2_2x1": pp["step_s"]},
                  "pp2_over_none": none["step_s"] / pp["step_s"],
                  "pp2_over_ddp": ddp["step_s"] / pp["step_s"], "bubble": {}, "activations": {}}
        for m in (2, 4, 8):
            r = pp if m == 4 else run(args, root, model, data, f"pp2-m{m}", "none", 2, 1, m, pp=2)
            result["bubble"][m] = {"measured": bubble(r["ranks"]), "theory": 1 / (m + 1)}
        for schedule in ("1f1b", "gpipe"):
            r = run(args, root, model, data, f"act-{schedule}", "none", 2, 1, 8, pp=2,
                    schedule=schedule)
            result["activations"][schedule] = {x["stage"]: x["activation_bytes"]
                                               for x in r["ranks"]}
        result["load_average"] = os.getloadavg()
        print(json.dumps(result, indent=2))
        print(f"step time: none {none['step_s']:.3f} s, ddp 2 {ddp['step_s']:.3f} s, pp 2 "
              f"{pp['step_s']:.3f} s (pp 2 speed vs none {result['pp2_over_none']:.2f}, vs ddp "
              f"{result['pp2_over_ddp']:.2f})")
        for m, b in result["bubble"].items():
            meas = ", ".join(f"stage {s} {v:.2f}" for s, v in sorted(b["measured"].items()))
            print(f"bubble M={m}: measured {meas}; theory {b['theory']:.2f}")
        for schedule, a in result["activations"].items():
            print(f"activations M=8 {schedule}: " +
                  ", ".join(f"stage {s} {v / 2**20:.1f} MiB" for s, v in sorted(a.items())))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
