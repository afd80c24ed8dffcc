#!/usr/bin/env python3
"""bench_online.py: where the time of an online GRPO step goes (docs/training.md "Online GRPO and
DPO"): generating the rollout, waiting for the reward command, and training on it.

astrai-train --train_type online_grpo runs --steps steps (after --warmup untimed ones) on a
bench_train-shaped model with a byte vocabulary (vocab 256: the byte tokenizer's), prompts of
~40 bytes, --group_size responses of --max_tokens tokens each (a reward that never ends them
early: no stop token in the byte tokenizer), and a reward command in Python that counts the
lowercase letters of each response. Each step row of progress.db has rollout_s and reward_s (the
rank's seconds in the step); the step's wall time is the difference of consecutive steps'
wall_time, and training is what is left of it. Printed: each part's mean seconds and share,
and the rollout's generated tokens per second.

    /usr/bin/python3 bench/bench_online.py --build build
"""
import argparse
import json
import os
import sqlite3
import sys

import bench_train as bt

CONFIG = {**bt.CONFIG, "vocab_size": 256, "max_position_embeddings": 512}
REWARD = r'''
import json, sys
for line in sys.stdin:
    q = json.loads(line)
    print(json.dumps({"id": q["id"], "rewards": [float(sum(c.islower() for c in r))
                                                  for r in q["responses"]]}), flush=True)
'''


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with the binaries")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    p.add_argument("--group_size", type=int, default=8, help="responses per prompt (default 8)")
    p.add_argument("--max_tokens", type=int, default=64, help="tokens per response (default 64)")
    p.add_argument("--workdir", help="keep the model, logs and progress.db here")
    a = p.parse_args(argv)
    if min(a.steps, a.warmup, a.threads, a.prompts, a.group_size, a.max_tokens) < 1:
        p.error("every count must be >= 1")
    return a


def inputs(root, args):
    model = bt.make_model(args.build, root, CONFIG)
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range((args.warmup + args.steps) * args.prompts):
            f.write(json.dumps({"prompt": f"Question {i}: write some words in lower case. "}) +
                    "\n")
    reward = os.path.join(root, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    return model, prompts, reward


def train(args, root, model, prompts, reward):
    ckpt = os.path.join(root, "ckpt")
    flags = {"train_type": "online_grpo", "param_path": model, "data_root_path": prompts,
             "reward_command": f"{sys.executable} {reward}", "group_size": args.group_size,
             "batch_per_device": args.prompts, "rollout_max_tokens": args.max_tokens,
             "rollout_temperature": 1.0, "threads": args.threads, "optimizer": "adamw",
             "max_lr": 1e-4, "shuffle": "false", "max_steps": args.warmup + args.steps,
             "ckpt_interval": 100000, "log_interval": 1, "ckpt_dir": ckpt}
    cmd = [os.path.join(args.build, "astrai-train")] + [f"--{k}={v}" for k, v in flags.items()]
    bt.run_child(cmd, os.path.join(root, "astrai-train.log"), args.threads)
    with sqlite3.connect(os.path.join(ckpt, "progress.db")) as db:
        walls = [w for (w,) in db.execute("SELECT wall_time FROM steps ORDER BY step")]
        parts = {name: [v for (v,) in db.execute(
            "SELECT value FROM step_metrics WHERE name = ? ORDER BY step", (name,))]
            for name in ("rollout_s", "reward_s", "response_len")}
    return walls, parts


def report(args, walls, parts):
    w = args.warmup
    step = [b - a for a, b in zip(walls[w - 1:], walls[w:])]
    rollout, reward = parts["rollout_s"][w:], parts["reward_s"][w:]
    training = [s - r - q for s, r, q in zip(step, rollout, reward)]
    mean = lambda xs: sum(xs) / len(xs)
    total = mean(step)
    tokens = args.prompts * args.group_size * mean(parts["response_len"][w:])
    print(f"online_grpo step over {len(step)} steps ({args.prompts} prompts x {args.group_size} "
          f"responses x {args.max_tokens} tokens, {args.threads} threads): {total:.3f} s")
    for name, xs in (("rollout", rollout), ("reward", reward), ("training", training)):
        print(f"  {name:9s} {mean(xs):8.3f} s  {100 * mean(xs) / total:5.1f}%")
    print(f"  rollout generation: {tokens / mean(rollout):.0f} tokens/s")


def main(argv):
    args = parse_args(argv)
    load = {"before": os.getloadavg()[0]}
    with bt.work_dir(args, "bench_online", ["astrai-train", "astrai-model"]) as root:
        walls, parts = train(args, root, *inputs(root, args))
    load["after"] = os.getloadavg()[0]
    report(args, walls, parts)
    bt.warn_load(load, args.threads)


if __name__ == "__main__":
    main(sys.argv[1:])
