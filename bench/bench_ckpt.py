#!/usr/bin/python3
"""bench_ckpt.py: the time training is blocked per checkpoint, synchronous against
--async_checkpoint, side by side in one run: fsdp over 2 ranks (1 thread each: both cores busy)
and 1 rank of 1 thread (a core left for the writer) on the bench model of bench_train.py (30.9M
parameters: a checkpoint holds ~370 MB of fp32 weights and AdamW state), a checkpoint every
other step. The blocked time of a checkpoint is the wall time of a step
followed by one less the median of the steps that are not.

    /usr/bin/python3 bench/bench_ckpt.py --build build --steps 8
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


def run(args, root, model, data, name, nprocs, extra):
    ckpt = os.path.join(root, name)
    flags = {"train_type": "seq", "param_path": model, "data_root_path": data,
             "parallel_mode": "fsdp", "nprocs": nprocs, "batch_per_device": args.batch // nprocs,
             "window_size": args.window, "threads": 1, "optimizer": "adamw", "shuffle": "false",
             "max_steps": args.steps, "ckpt_interval": 2, "ckpt_dir": ckpt}
    flags.update(extra)
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    bt.run_child(cmd, os.path.join(root, name + ".log"), 1)
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        times = [w for (w,) in db.execute("SELECT wall_time FROM steps ORDER BY step")]
    # A step's row is written before the checkpoint that follows it: the checkpoint after step s
    # (s even) falls between the rows of s and s + 1, in the span the duration of step s + 1 has.
    span = {s: times[s - 1] - times[s - 2] for s in range(2, len(times) + 1)}  # step s's
    with_ckpt = [d for s, d in span.items() if s % 2 == 1]
    without = [d for s, d in span.items() if s % 2 == 0]
    base = statistics.median(without)
    return {"step_s": base, "blocked_s": [d - base for d in with_ckpt],
            "blocked_median_s": statistics.median(d - base for d in with_ckpt)}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=128)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="astrai-bench-ckpt-")
    try:
        model = bt.make_model(args.build, root)
        data = bt.make_dataset(root, args.steps * args.batch, args.window)
        result = {"load_average": None}
        for nprocs in (2, 1):
            sync = run(args, root, model, data, f"sync{nprocs}", nprocs, {})
            asyn = run(args, root, model, data, f"async{nprocs}", nprocs,
                       {"async_checkpoint": "true"})
            result[f"{nprocs}x1"] = {"sync": sync, "async": asyn}
            print(f"{nprocs} rank(s) x 1 thread: blocked per checkpoint (median) sync "
                  f"{sync['blocked_median_s']:.3f} s, async {asyn['blocked_median_s']:.3f} s "
                  f"(steps without one: {sync['step_s']:.3f} s, {asyn['step_s']:.3f} s)",
                  flush=True)
        result["load_average"] = os.getloadavg()
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
