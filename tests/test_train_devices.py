"""Devices and numerics flags of astrai-train (issue 7): --gradient_checkpointing recomputes
each block in backward and gives the same numbers bit for bit (seq and sft with packed
documents, muon and adamw, one rank and fsdp); gradient buckets (--bucket_mb: reduced while
backward goes on) give the curve of one bucket (ddp and fsdp; only the grouping of the norm's
partial sums differs); --device_type/--dtype refuse what this machine or build cannot do with
a clear message and the documented exit code."""

import os
import sys


import train_util as tu

WINDOW, BATCH = 32, 4
N_BYTES = 24 * WINDOW + 1  # 24 windows: 6 optimizer steps


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "batch_per_device": BATCH, "window_size": WINDOW, "ckpt_dir": ckpt, "ckpt_interval": 1000,
         "max_lr": 3e-3, "threads": 2, "device_type": "cpu"}
    a.update(extra)
    return a


def weights(ckpt_dir):
    with open(os.path.join(tu.latest_checkpoint(ckpt_dir), "model.safetensors"), "rb") as f:
        return f.read()


def check_checkpointing(root, model, data, name, failures, **extra):
    plain = os.path.join(root, name + "-plain")
    ckpt = os.path.join(root, name + "-ckpt")
    tu.train(args(model, data, plain, **extra))
    tu.train(args(model, data, ckpt, gradient_checkpointing="true", **extra))
    a = tu.metric_rows(tu.latest_checkpoint(plain))
    b = tu.metric_rows(tu.latest_checkpoint(ckpt))
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "wall_time",
                                                                    "timestamp")} for r in rows]
    if len(a) < 3 or strip(a) != strip(b):
        failures.append(f"{name}: gradient_checkpointing changed the metric rows\n{a}\n{b}")
    elif weights(plain) != weights(ckpt):
        failures.append(f"{name}: gradient_checkpointing changed the final weights")
    else:
        print(f"{name}: {len(a)} steps identical with and without gradient_checkpointing, "
              f"last loss {a[-1]['loss']:.6f}")


def check_buckets(root, model, data, mode, failures):
    one = os.path.join(root, mode + "-one-bucket")
    many = os.path.join(root, mode + "-buckets")
    par = {"nprocs": 2, "parallel_mode": mode, "threads": 1, "grad_accum_steps": 2,
           "batch_per_device": 2}
    tu.train(args(model, data, one, **par))
    _, err = tu.train(args(model, data, many, bucket_mb=0.001, **par))  # a bucket per block
    a = tu.metric_rows(tu.latest_checkpoint(one))
    b = tu.metric_rows(tu.latest_checkpoint(many))
    worst = max((tu.rel_err(y[k], x[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm")),
                default=1.0)
    if len(a) < 3 or len(a) != len(b) or worst > 1e-5:
        failures.append(f"{mode}: bucketed gradients changed the curve (worst {worst:.2e})\n{a}\n{b}")
    else:
        print(f"{mode}: {len(a)} steps, buckets per block vs one bucket: worst rel diff {worst:.1e}")


def check_refusals(root, model, data, failures):
    ckpt = os.path.join(root, "refused")
    for bad in ("banana", "-1", "0", "inf"):
        _, err = tu.train(args(model, data, ckpt, loss_scale=bad), expect=2)
        if f"loss_scale: '{bad}'" not in err:
            failures.append(f"--loss_scale={bad}: unexpected message {err!r}")
    # No GPU here: a build without CUDA says so (bad input, 2); a CUDA build finds no
    # usable device (a resource failure, 1). Either way the rank and CUDA are named.
    proc_err = None
    for code in (1, 2):
        try:
            _, proc_err = tu.train(args(model, data, ckpt, device_type="cuda"), expect=code)
            break
        except AssertionError as e:
            proc_err = str(e)
    if not proc_err or "rank 0" not in proc_err or "CUDA" not in proc_err.upper():
        failures.append(f"--device_type=cuda without a GPU: {proc_err!r}")
    else:
        print("device_type=cuda without a GPU:", proc_err.strip().splitlines()[-1])


def main():
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    sft = tu.make_sft_data(root, N_BYTES)
    failures = []
    check_checkpointing(root, model, data, "seq-muon", failures)
    check_checkpointing(root, model, sft, "sft-adamw", failures, train_type="sft",
                        optimizer="adamw", grad_accum_steps=2)
    check_checkpointing(root, model, data, "fsdp2", failures, nprocs=2, parallel_mode="fsdp",
                        threads=1)
    for mode in ("ddp", "fsdp"):
        check_buckets(root, model, data, mode, failures)
    check_refusals(root, model, data, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
