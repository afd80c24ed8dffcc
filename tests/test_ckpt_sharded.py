"""Sharded checkpoints (--ckpt_format sharded, docs/design.md §14): every rank writes the tensors it
owns into rank 0's temporary directory, in Hugging Face's sharded layout; the index maps every
tensor of the full format to a file that holds it; resume with another world size, parallel mode
or pp_size gives the uninterrupted curve; rank 0 gathers nothing (its peak memory during the
checkpoint stays near its own share, where the full format's rises by the whole state); a bad
index is refused naming the file and the tensor."""

import json
import os
import shutil
import struct
import sys

import train_util as tu

WINDOW = 16
N_BYTES = 48 * WINDOW + 1  # 48 windows: 6 steps of 8


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data, "batch_per_device": 4,
         "window_size": WINDOW, "ckpt_dir": ckpt, "max_lr": 3e-3, "threads": 1,
         "ckpt_interval": 3, "parallel_mode": "fsdp", "nprocs": 2}
    a.update(extra)
    return a


def train(root, model, data, name, expect=0, env=None, **extra):
    ckpt = os.path.join(root, name)
    a = args(model, data, ckpt, **extra)
    cmd = [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]
    _, err = tu.run(cmd, expect, env=dict(os.environ, **(env or {})))
    return ckpt, err


def read_header(path):
    with open(path, "rb") as f:
        n, = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def header_names(path):
    return set(n for n in read_header(path) if n != "__metadata__")


def check_layout(full, sharded, world, failures):
    """The sharded checkpoint holds the files of §14 and its indexes map exactly the full
    format's tensors, each to a file that holds it."""
    files = sorted(os.listdir(sharded))
    for stem in ("model", "optimizer"):
        want = [f"{stem}-{k:05d}-of-{world:05d}.safetensors" for k in range(1, world + 1)]
        if not set(want) <= set(files) or f"{stem}.safetensors" in files:
            failures.append(f"{sharded}: files {files}, expected {want} and no {stem}.safetensors")
            continue
        with open(os.path.join(sharded, f"{stem}.safetensors.index.json")) as f:
            index = json.load(f)
        wmap = index["weight_map"]
        if set(wmap) != header_names(os.path.join(full, f"{stem}.safetensors")):
            failures.append(f"{stem} index: tensors differ from the full format's")
        total = 0
        for name, file in wmap.items():
            h = read_header(os.path.join(sharded, file))
            if name not in h:
                failures.append(f"{stem} index: {name} mapped to {file}, which lacks it")
                continue
            b, e = h[name]["data_offsets"]
            total += e - b
        if index["metadata"]["total_size"] != total:
            failures.append(f"{stem} index: total_size {index['metadata']['total_size']} != {total}")
        per_file = {f: sum(1 for v in wmap.values() if v == f) for f in want}
        print(f"{stem}: {len(wmap)} tensors over {world} files {list(per_file.values())}, "
              f"total_size {total}")
    for text in ("meta.json", "config.json", "scheduler.json", "sampler.json", "metric.jsonl"):
        if text not in files:
            failures.append(f"{sharded}: no {text}")


def compare(rows, base, what, failures, tol=1e-5):
    worst = max(tu.rel_err(a["loss"], b["loss"]) for a, b in zip(rows, base))
    print(f"{what}: {len(rows)} steps, worst difference {worst:.2e}")
    if len(rows) != len(base) or worst > tol:
        failures.append(f"{what}: {len(rows)} rows vs {len(base)}, worst {worst:.2e}")


def resume(root, model, data, failures, name, first, then):
    """A sharded checkpoint of `first` at step 3 resumed under `then` to the end gives the
    uninterrupted run's curve (`first` straight through)."""
    straight, _ = train(root, model, data, f"{name}-straight", **first)
    stop, _ = train(root, model, data, f"{name}-stop", max_steps=3, ckpt_format="sharded", **first)
    ck = os.path.join(root, f"{name}-resumed")
    shutil.copytree(os.path.join(stop, "epoch_0_step_3"), os.path.join(ck, "epoch_0_step_3"))
    train(root, model, data, f"{name}-resumed", resume="true", ckpt_format="sharded", **then)
    compare(tu.metric_rows(tu.latest_checkpoint(ck)),
            tu.metric_rows(tu.latest_checkpoint(straight)), f"resume {first} -> {then}", failures)


def ckpt_memory(root, model, data, fmt):
    """Rank 0's memory report: ckpt_bytes, the most resident bytes a checkpoint added."""
    report = os.path.join(root, f"mem-{fmt}")
    os.makedirs(report)
    train(root, model, data, f"memck-{fmt}", env={"ASTRAI_MEMORY_REPORT": report},
          ckpt_format=fmt, max_steps=2, batch_per_device=1, optimizer="adamw")
    with open(os.path.join(report, "rank0.json")) as f:
        return json.load(f)


def memory(root, failures):
    """The full format gathers the fp32 weights and both AdamW moments of the whole model on
    every rank (12 bytes per parameter beside the half rank 0 owns); the sharded one writes the
    rank's own, so its peak during a checkpoint stays near what it holds between steps."""
    model = tu.make_model(os.path.join(root, "mem"), tu.MEM_CONFIG)
    data, _ = tu.make_text_data(os.path.join(root, "mem"), 2000)
    params = sum(v["data_offsets"][1] - v["data_offsets"][0]
                 for k, v in read_header(os.path.join(model, "model.safetensors")).items()
                 if k != "__metadata__") // 2  # bf16
    gathered = 12 * params
    full = ckpt_memory(root, model, data, "full")
    sharded = ckpt_memory(root, model, data, "sharded")
    rise = {"full": full["ckpt_bytes"], "sharded": sharded["ckpt_bytes"]}
    print(f"rank 0 during a checkpoint, above what it holds between steps: full "
          f"{rise['full'] / 2**20:+.1f} MiB, sharded {rise['sharded'] / 2**20:+.1f} MiB "
          f"(the whole state: {gathered / 2**20:.1f} MiB; between steps "
          f"{sharded['state_bytes'] / 2**20:.1f} MiB)")
    if rise["full"] < 0.5 * gathered:
        failures.append(f"the full format's checkpoint rose only {rise['full']} bytes: "
                        "the measurement does not see a gather")
    if rise["sharded"] > 0.15 * gathered:
        failures.append(f"the sharded checkpoint rose by {rise['sharded']} bytes: a gather?")


def corrupt(index, sharded, what):
    """Edits the model index of a copy of a sharded checkpoint; returns what the error must name."""
    wmap = index["weight_map"]
    first = sorted(wmap)[0]
    if what == "escape":
        wmap[first] = "../x.safetensors"
        return "../x.safetensors"
    if what == "missing file":
        wmap[first] = "model-00009-of-00009.safetensors"
        return "model-00009-of-00009.safetensors"
    if what == "wrong file":  # a tensor of file 1 mapped to file 2
        name = next(n for n, f in sorted(wmap.items()) if f.startswith("model-00001"))
        wmap[name] = "model-00002-of-00002.safetensors"
        return name
    del index["weight_map"]
    return "weight_map"


def bad_index(root, model, data, sharded, failures):
    """A hostile or broken index is refused naming it and what is at fault, never followed out of
    the checkpoint's directory (exit 2: bad input)."""
    for what in ("escape", "missing file", "wrong file", "no map"):
        name = f"bad-{what.replace(' ', '-')}"
        shutil.copytree(sharded, os.path.join(root, name, "epoch_0_step_3"))
        path = os.path.join(root, name, "epoch_0_step_3", "model.safetensors.index.json")
        with open(path) as f:
            index = json.load(f)
        want = corrupt(index, sharded, what)
        with open(path, "w") as f:
            json.dump(index, f)
        _, err = train(root, model, data, name, expect=2, resume="true", max_steps=4)
        named = [ln for ln in err.splitlines() if "index" in ln or want in ln]
        print(f"index with {what}: {named[:1]}")
        if want not in err or "model.safetensors.index.json" not in err:
            failures.append(f"index with {what}: the error does not name {want}: {err[-400:]}")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, N_BYTES)
    # fsdp over 2 ranks: the layout, against the full format of the same run.
    full, _ = train(root, model, data, "full", max_steps=3)
    sharded, _ = train(root, model, data, "sharded", max_steps=3, ckpt_format="sharded")
    check_layout(os.path.join(full, "epoch_0_step_3"), os.path.join(sharded, "epoch_0_step_3"), 2,
                 failures)
    if [n for n in os.listdir(sharded) if n.startswith(".tmp-")]:
        failures.append(f"leftovers in {sharded}: {os.listdir(sharded)}")
    # --param_path: a fresh run from the sharded checkpoint's weights, as from the full one's.
    rows = {}
    for fmt, ck in (("full", full), ("sharded", sharded)):
        out, _ = train(root, os.path.join(ck, "epoch_0_step_3"), data, f"from-{fmt}", max_steps=2)
        rows[fmt] = tu.metric_rows(tu.latest_checkpoint(out))
    compare(rows["sharded"], rows["full"], "--param_path sharded vs full checkpoint", failures,
            tol=0)
    # resume across world sizes, modes and pp_size.
    # (8 samples per step: 4 per replica on 2, 8 on 1.)
    one = dict(parallel_mode="none", nprocs=1, batch_per_device=8)
    resume(root, model, data, failures, "2to1", dict(), one)
    resume(root, model, data, failures, "1to2", one, dict(parallel_mode="fsdp", nprocs=2))
    resume(root, model, data, failures, "ddp2topp2", dict(parallel_mode="ddp"),
           dict(parallel_mode="none", pp_size=2, batch_per_device=8))
    resume(root, model, data, failures, "pp2to1", dict(parallel_mode="none", pp_size=2),
           dict(parallel_mode="none", nprocs=1))
    memory(root, failures)
    bad_index(root, model, data, os.path.join(sharded, "epoch_0_step_3"), failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
