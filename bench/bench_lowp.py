#!/usr/bin/python3
"""bench_lowp.py: reduced precision on the CPU, in one run on the bench model of bench_train.py:
astrai-train in fp32 and in bf16 (and fp16), and the PyTorch peer (tests/ref/model.py) in fp32
and under torch.autocast("cpu", dtype=torch.bfloat16), one after the other on the same
threads. Prints tokens/s (the steady rate over the timed steps), peak RSS, the GEMM path astrai
ran and the CPU's bf16/fp16 instruction flags, and the ratios.

    /usr/bin/python3 bench/bench_lowp.py --build build --steps 10 --threads 2
"""
import json
import os
import shutil
import sys

import bench_train as bt

FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        words = set(next((l for l in f if l.startswith("flags")), "").split())
    return [w for w in FLAGS if w in words]


def astrai(args, root, model, data, dtype):
    rows, rss, _ = bt.train_astrai(args, root, "seq", model, data, args.batch,
                                   f"astrai-{dtype}.log", {"dtype": dtype, "device_type": "cpu"})
    shutil.move(os.path.join(root, "ckpt-seq"), os.path.join(root, f"ckpt-seq-{dtype}"))
    r = bt.steady_rate([w for _, _, w in rows], [l for l, _, _ in rows], args)
    with open(os.path.join(root, f"astrai-{dtype}.log")) as f:
        path = next((l.strip() for l in f if "GEMM:" in l), "sgemm (OpenBLAS)")
    r.update(peak_rss_bytes=rss, gemm=path)
    return r


def main(argv):
    args = bt.parse_args(argv)
    if args.peer_worker:
        return bt.peer_main(args)
    with bt.work_dir(args, "bench_lowp", ("astrai-model", "astrai-train")) as root:
        model = bt.make_model(args.build, root)
        data = bt.make_dataset(root, (args.warmup + args.steps) * args.batch, args.window)
        out = {"cpu_flags": cpu_flags(), "load_start": os.getloadavg()[0]}
        for dtype in ("fp32", "bf16", "fp16"):
            out[f"astrai_{dtype}"] = astrai(args, root, model, data, dtype)
        out["pytorch_fp32"] = bt.run_peer(args, root, model, data)
        out["pytorch_autocast_bf16"] = bt.run_peer(args, root, model, data, "bf16")
        out["load_end"] = os.getloadavg()[0]
        rate = {k: v["tokens_per_s"] for k, v in out.items() if isinstance(v, dict)}
        out["ratios"] = {"astrai_bf16/astrai_fp32": rate["astrai_bf16"] / rate["astrai_fp32"],
                         "astrai_fp16/astrai_fp32": rate["astrai_fp16"] / rate["astrai_fp32"],
                         "astrai_bf16/pytorch_autocast_bf16":
                             rate["astrai_bf16"] / rate["pytorch_autocast_bf16"],
                         "astrai_fp32/pytorch_fp32": rate["astrai_fp32"] / rate["pytorch_fp32"]}
        print(json.dumps(out, indent=2))
        for k, v in out.items():
            if isinstance(v, dict) and "tokens_per_s" in v:
                print(f"{k:24s} {v['tokens_per_s']:9.0f} tok/s  peak RSS "
                      f"{v['peak_rss_bytes'] / 2**20:6.0f} MiB  {v.get('gemm', '')}")
        print("ratios:", {k: round(v, 2) for k, v in out["ratios"].items()}, "cpu flags:",
              out["cpu_flags"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
