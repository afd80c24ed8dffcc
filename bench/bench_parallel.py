#!/usr/bin/python3
"""bench_parallel.py: ddp with 2 ranks of 1 thread each against none with 1 rank of 2 threads,
on the same global batch (the issue's ~20M config, window 256, global batch 8), one after the
other in the same run. Prints tokens/s of each and the ratio ddp / none (target >= 0.9).

    /usr/bin/python3 bench/bench_parallel.py --build build --steps 10
"""
import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile

import bench_train as bt


def run(args, root, model, data, name, mode, nprocs, threads):
    ckpt = os.path.join(root, name)
    total = args.warmup + args.steps
    flags = {"train_type": "seq", "param_path": model, "data_root_path": data,
             "parallel_mode": mode, "nprocs": nprocs, "batch_per_device": args.batch // nprocs,
             "window_size": args.window, "threads": threads, "optimizer": "adamw",
             "shuffle": "false", "max_steps": total, "ckpt_interval": 100000, "ckpt_dir": ckpt}
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    bt.run_child(cmd, os.path.join(root, name + ".log"), threads)
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        rows = db.execute("SELECT loss, wall_time FROM steps ORDER BY step").fetchall()
    return bt.steady_rate([w for _, w in rows], [l for l, _ in rows], args)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="global batch (even)")
    p.add_argument("--window", type=int, default=256)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="astrai-bench-parallel-")
    try:
        model = bt.make_model(args.build, root)
        data = bt.make_dataset(root, (args.warmup + args.steps) * args.batch, args.window)
        none = run(args, root, model, data, "none", "none", 1, 2)
        ddp = run(args, root, model, data, "ddp", "ddp", 2, 1)
        result = {"none_1x2_tokens_per_s": none["tokens_per_s"],
                  "ddp_2x1_tokens_per_s": ddp["tokens_per_s"],
                  "ratio": ddp["tokens_per_s"] / none["tokens_per_s"],
                  "same_loss": abs(none["loss_last"] - ddp["loss_last"]) < 1e-4 * abs(none["loss_last"]),
                  "load_average": os.getloadavg()}
        print(json.dumps(result, indent=2))
        print(f"none 1 rank x 2 threads {none['tokens_per_s']:.0f} tok/s, ddp 2 ranks x 1 thread "
              f"{ddp['tokens_per_s']:.0f} tok/s, ratio {result['ratio']:.2f} (target >= 0.9)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
