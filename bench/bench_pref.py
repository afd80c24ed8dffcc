#!/usr/bin/python3
"""bench_pref.py: what offline DPO costs in astrai-train, against a plain seq step on the same
tokens and against PyTorch doing the same DPO step.

One run measures, on the same threads and one after the other (never side by side):
  1. astrai seq: windows of L tokens, 2b per step;
  2. astrai dpo: b records per step, whose chosen and rejected rows are each exactly L tokens,
     so a step's policy reads the same 2b x L tokens as a seq step (and the frozen reference
     reads them once more, forward only);
  3. the PyTorch peer in its own process: tests/ref/model.py RefModel as policy and frozen
     reference, tests/ref/pref.py's DPO loss (AstrAI's DPOStrategy), torch.optim.AdamW;
and prints one JSON object and a one-line summary: tokens/s of each, the dpo/seq time per
step (a reference forward is about a third of a training step: expect ~1.33) and astrai
dpo / PyTorch dpo tokens/s. See bench/README.md.

    /usr/bin/python3 bench/bench_pref.py --build build --steps 10 --threads 2
"""
import argparse
import json
import math
import os
import statistics
import sys

import numpy as np

import bench_train as bt

# "issue" is bench_train's ~30M config; "small" the same shape at half the width and depth
# (head_dim 64 and 4 query heads per KV head kept), which suits 2 cores.
MODELS = {
    "issue": bt.CONFIG,
    "small": {**bt.CONFIG, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 1, "intermediate_size": 704},
}
DPO_BETA = 0.1  # astrai-train's and AstrAI's default
EXPECTED_DPO_SEQ = 4 / 3  # reference forward (1) + policy forward and backward (3) over 3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with the binaries")
    p.add_argument("--model", choices=sorted(MODELS), default="small",
                   help="small: hidden 256, 4 layers (default); issue: bench_train's config")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps, >= 1 (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads for every side (default 2)")
    p.add_argument("--records", type=int, default=4,
                   help="DPO records per step, b; seq steps take 2b windows (default 4)")
    p.add_argument("--window", type=int, default=256, help="tokens per row, L (default 256)")
    p.add_argument("--workdir", help="keep model, data and logs here (default: a temp dir, removed)")
    p.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("steps", "threads", "records"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if a.warmup < 1:  # steps are timed from the end of the last warm-up step
        p.error("--warmup must be >= 1")
    max_pos = MODELS[a.model]["max_position_embeddings"]
    if not 2 <= a.window <= max_pos:  # a row keeps >= 1 prompt token and <= window inputs
        p.error(f"--window must be in [2, {max_pos}] (max_position_embeddings)")
    # bench_train's step arithmetic (steady_rate) counts batch x window tokens per step: the
    # 2b rows of L tokens of both astrai sides and of the peer.
    a.batch = 2 * a.records
    return a


# ------------------------------------------------------------------ inputs


def make_records(n, window, vocab):
    """n DPO records of random ids in [1, vocab) (0 is AstrAI's padding): a prompt of L//2
    ids and responses of L - L//2 + 1, so each row (prompt's tail + response's head, AstrAI's
    truncation) is the whole prompt and response: L + 1 ids, L model inputs."""
    rng = np.random.default_rng(bt.SEED)
    p, q = window // 2, window - window // 2 + 1
    return [tuple(rng.integers(1, vocab, k).tolist() for k in (p, q, q)) for _ in range(n)]


def write_records(root, records):
    path = os.path.join(root, "dpo.jsonl")
    with open(path, "w") as f:
        for prompt, chosen, rejected in records:
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def write_windows(root, records, b, window):
    """The seq side's bin shard: the DPO steps' rows in their order (per step: the b chosen,
    then the b rejected), so seq window i reads the inputs of DPO row i. Its targets are those
    of the row too, but for the last, which is the next row's first id (the shard is one
    stream)."""
    rows = []
    for s in range(0, len(records), b):
        step = records[s:s + b]
        rows += [pr + c for pr, c, _ in step] + [pr + r for pr, _, r in step]
    ids = [t for row in rows for t in row[:window]] + [rows[-1][window]]
    shard = os.path.join(root, "windows", "part0")
    os.makedirs(shard)
    np.asarray(ids, dtype="<i4").tofile(os.path.join(shard, "sequence.bin"))
    with open(os.path.join(shard, "meta.json"), "w") as f:
        json.dump({"sequence": {"shape": [len(ids)], "dtype": "int32"}}, f)
    return os.path.join(root, "windows")


# ------------------------------------------------------------------ astrai


def run_astrai(args, root, train_type, model_dir, data, batch):
    extra = {"dpo_beta": DPO_BETA} if train_type == "dpo" else {}
    rows, rss, seconds = bt.train_astrai(args, root, train_type, model_dir, data, batch,
                                         f"astrai-{train_type}.log", extra)
    losses, rates, times = zip(*rows)
    r = bt.steady_rate(list(times), list(losses), args)
    # The tokens astrai-train itself counted per timed step (its tokens_per_s times the step's
    # time; a step is timed from the previous row): they should be the 2b x L we assume.
    counted = [rate * (b - a) for rate, a, b in
               zip(rates[args.warmup:], times[args.warmup - 1:], times[args.warmup:])]
    r.update(progress_tokens_per_step=statistics.median(counted), losses=list(losses),
             peak_rss_bytes=rss, process_seconds=seconds)
    return r


# ------------------------------------------------------------------ the PyTorch peer


def run_peer(args, root, model_dir, data):
    cmd = [sys.executable, os.path.abspath(__file__), "--peer-worker", "--model-dir", model_dir,
           "--data", data, "--model", args.model, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--records", str(args.records), "--window", str(args.window)]
    out, rss, seconds = bt.run_child(cmd, os.path.join(root, "pytorch.log"), args.threads)
    peer = json.loads(out)
    r = bt.steady_rate(peer["times"], peer["losses"], args)
    r.update(losses=peer["losses"], peak_rss_bytes=rss, process_seconds=seconds,
             rss_after_import_bytes=peer["rss_after_import_bytes"])
    return r


def peer_main(args):
    """DPO-trains the reference model on the records astrai-train sees (shuffle off: step s
    takes records b*s .. b*s+b-1)."""
    rss_import = bt.peer_start(args.threads)
    from ref.model import RefModel
    from ref.pref import dpo_loss

    policy = RefModel.from_dir(args.model_dir)
    reference = RefModel.from_dir(args.model_dir)
    for p in reference.parameters():
        p.requires_grad_(False)
    with open(args.data) as f:
        records = [(r["prompt"], r["chosen"], r["rejected"]) for r in map(json.loads, f)]
    total = math.ceil(len(records) / args.records)  # astrai-train's total_steps (one epoch)

    def step_loss(step):
        batch = records[step * args.records:(step + 1) * args.records]
        return dpo_loss(policy, reference, batch, args.window, beta=DPO_BETA)[0]

    bt.peer_train(args, policy.parameters(), step_loss, total, rss_import)


# ------------------------------------------------------------------ report


def report(args, cfg, params, seq, dpo, peer, load):
    tokens = args.batch * args.window
    for side in (seq, dpo, peer):
        side["step_s_mean"] = side["seconds"] / side["steps"]
        side["peak_rss_mib"] = side["peak_rss_bytes"] / bt.MIB
    dpo_seq = dpo["step_s_mean"] / seq["step_s_mean"]
    dpo_seq_best = dpo["step_s_min"] / seq["step_s_min"]
    vs_torch = dpo["tokens_per_s"] / peer["tokens_per_s"]
    vs_torch_best = dpo["tokens_per_s_best_step"] / peer["tokens_per_s_best_step"]
    loss_diff = max(abs(a - b) for a, b in zip(dpo["losses"], peer["losses"]))
    result = {"model": args.model, "config": cfg, "params": params, "records": args.records,
              "rows": args.batch, "window": args.window, "tokens_per_step": tokens,
              "threads": args.threads, "warmup_steps": args.warmup, "timed_steps": args.steps,
              "dpo_beta": DPO_BETA, "load_average_1min": load,
              "astrai_seq": seq, "astrai_dpo": dpo, "pytorch_dpo": peer,
              "ratio_dpo_seq_step_time": dpo_seq, "ratio_dpo_seq_best_step": dpo_seq_best,
              "expected_dpo_seq_step_time": EXPECTED_DPO_SEQ,
              "ratio_astrai_pytorch_dpo_tokens_per_s": vs_torch,
              "ratio_astrai_pytorch_dpo_best_step": vs_torch_best,
              "dpo_loss_max_abs_diff_astrai_pytorch": loss_diff}
    print(json.dumps(result, indent=2))
    print(f"seq {seq['tokens_per_s']:.0f} tok/s, dpo {dpo['tokens_per_s']:.0f} tok/s, pytorch dpo "
          f"{peer['tokens_per_s']:.0f} tok/s; dpo/seq step time {dpo_seq:.2f}x (expected "
          f"~{EXPECTED_DPO_SEQ:.2f}), astrai/pytorch dpo {vs_torch:.2f}x; fastest steps: dpo/seq "
          f"{dpo_seq_best:.2f}x, astrai/pytorch {vs_torch_best:.2f}x; peak RSS seq "
          f"{seq['peak_rss_mib']:.0f} / dpo {dpo['peak_rss_mib']:.0f} / pytorch "
          f"{peer['peak_rss_mib']:.0f} MiB")
    for side, name in ((seq, "seq"), (dpo, "dpo")):
        if abs(side["progress_tokens_per_step"] - tokens) > 0.01 * tokens:
            print(f"warning: astrai {name} counted {side['progress_tokens_per_step']:.0f} tokens "
                  f"per step, expected {tokens}: its rows are not {args.batch} x {args.window}")
    # Same weights, records and optimizer: the losses agree but for float rounding.
    if loss_diff > 1e-3:
        print(f"warning: astrai and pytorch dpo losses differ by up to {loss_diff:.2g}: "
              f"the two sides did not train the same steps")
    bt.warn_load(load, args.threads)


def main(argv):
    args = parse_args(argv)
    if args.peer_worker:
        return peer_main(args)
    cfg = MODELS[args.model]
    with bt.work_dir(args, "bench_pref", ("astrai-model", "astrai-train")) as root:
        model_dir = bt.make_model(args.build, root, cfg)
        records = make_records((args.warmup + args.steps) * args.records, args.window,
                               cfg["vocab_size"])
        jsonl = write_records(root, records)
        windows = write_windows(root, records, args.records, args.window)
        params = sum(bt.count_params(os.path.join(model_dir, "model.safetensors")).values())
        load = {"start": os.getloadavg()[0]}
        seq = run_astrai(args, root, "seq", model_dir, windows, args.batch)
        load["after_seq"] = os.getloadavg()[0]
        dpo = run_astrai(args, root, "dpo", model_dir, jsonl, args.records)
        load["after_dpo"] = os.getloadavg()[0]
        peer = run_peer(args, root, model_dir, jsonl)
        load["after_pytorch"] = os.getloadavg()[0]
        report(args, cfg, params, seq, dpo, peer, load)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
