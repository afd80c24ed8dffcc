"""Bad input to astrai-train: each case exits 2 with a message naming the file and the problem,
never a crash (no signal, no sanitizer report). What is not bad input exits 1: a diverged run
(a non-finite loss, named with its step), and a ckpt_dir on a read-only or full file system (a
small tmpfs; skipped, saying why, where mounting is not permitted)."""

import json
import os
import shutil
import struct
import subprocess
import sys

import train_util as tu

WINDOW = 16


def base_args(model, data, root):
    return {"train_type": "seq", "param_path": model, "data_root_path": data,
            "batch_per_device": 2, "window_size": WINDOW, "ckpt_dir": os.path.join(root, "ck"),
            "threads": 1}


def copy_model(model, root, name):
    """A copy of the model directory to break in one way."""
    out = os.path.join(root, name)
    shutil.copytree(model, out)
    return out


def edit_config(model_dir, **changes):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)


def read_st(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path, header, data):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def corrupt_weights(model_dir, how):
    path = os.path.join(model_dir, "model.safetensors")
    header, data = read_st(path)
    names = sorted(k for k in header if k != "__metadata__")
    first = min(names, key=lambda k: header[k]["data_offsets"][0])
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
        return
    if how == "past_end":
        header[first]["data_offsets"] = [0, len(data) + 4096]
    elif how == "overlap":
        other = [k for k in names if k != first][0]
        header[other]["data_offsets"] = list(header[first]["data_offsets"])
        header[other]["shape"] = header[first]["shape"]
    elif how == "dtype":
        header[first]["dtype"] = "Q7"
    elif how == "shape":
        key = "norm.weight"
        begin = header[key]["data_offsets"][0]
        header[key]["shape"] = [header[key]["shape"][0] // 2]
        header[key]["data_offsets"] = [begin, begin + 4 * header[key]["shape"][0]]
    elif how == "missing":
        del header["norm.weight"]
    write_st(path, header, data)


def cases(root, model, data):
    """(name, args changes, expected exit, substrings the message must contain)."""
    out = []

    def model_case(name, expect_words, config=None, weights=None):
        m = copy_model(model, root, name)
        if config is not None:
            edit_config(m, **config)
        if weights is not None:
            corrupt_weights(m, weights)
        out.append((name, {"param_path": m}, expect_words))

    out.append(("unknown flag", {"max_lrr": "1"}, ["max_lrr", "max_lr"]))
    out.append(("zero batch", {"batch_per_device": "0"}, ["batch_per_device", "0"]))
    out.append(("bad number", {"max_lr": "fast"}, ["max_lr", "fast"]))
    out.append(("bad optimizer", {"optimizer": "sgd"}, ["optimizer", "sgd"]))
    out.append(("bad bool", {"shuffle": "maybe"}, ["shuffle", "maybe"]))
    empty = os.path.join(root, "empty-model")
    os.makedirs(empty)
    out.append(("missing config", {"param_path": empty}, ["config.json"]))
    bad_json = copy_model(model, root, "bad-json")
    with open(os.path.join(bad_json, "config.json"), "w") as f:
        f.write('{"vocab_size": 256, "hidden_size": ')
    out.append(("malformed config", {"param_path": bad_json}, ["config.json"]))
    model_case("attn-mla", ["config.json", "missing required key 'kv_lora_rank'"],
               config={"attn_type": "mla"})
    model_case("ffn-moe", ["config.json", "missing required key 'n_routed_experts'"],
               config={"ffn_type": "moe"})
    model_case("attn-unknown", ["config.json", "attn_type", "'sparse'"],
               config={"attn_type": "sparse"})
    model_case("moe-topk", ["config.json", "n_activated_experts 9", "n_routed_experts 8"],
               config={"ffn_type": "moe", "n_routed_experts": 8, "n_shared_experts": 1,
                       "n_activated_experts": 9})
    model_case("no-hidden", ["config.json", "hidden_size"], config={"hidden_size": None})
    model_case("truncated", ["model.safetensors"], weights="truncated")
    model_case("past-end", ["model.safetensors"], weights="past_end")
    model_case("overlap", ["model.safetensors", "overlap"], weights="overlap")
    model_case("bad-dtype", ["model.safetensors", "Q7"], weights="dtype")
    model_case("bad-shape", ["model.safetensors", "norm.weight"], weights="shape")
    model_case("missing-tensor", ["model.safetensors", "norm.weight"], weights="missing")
    # expert parallelism: ep_size needs replicas it divides, a MoE model whose routed experts it
    # divides, and ranks that share gradients
    out.append(("ep with none", {"ep_size": "2", "parallel_mode": "none"},
                ["ep_size: 2", "parallel_mode ddp or fsdp"]))
    out.append(("ep of one rank", {"ep_size": "2", "parallel_mode": "ddp"},
                ["ep_size: 2", "does not divide the job's 1 data-parallel replica"]))
    out.append(("ep over the replicas", {"ep_size": "4", "parallel_mode": "ddp", "nprocs": "2"},
                ["ep_size: 4", "does not divide the 2 data-parallel replicas"]))
    out.append(("ep of a dense model", {"ep_size": "2", "parallel_mode": "ddp", "nprocs": "2"},
                ["ep_size: 2", "ffn_type 'moe'"]))
    moe3 = tu.make_model(os.path.join(root, "moe3"), dict(
        tu.SMALL_CONFIG, ffn_type="moe", n_routed_experts=3, n_shared_experts=0,
        n_activated_experts=2, topk_method="greedy"))
    out.append(("ep over the experts", {"param_path": moe3, "ep_size": "2", "parallel_mode": "fsdp",
                                        "nprocs": "2"},
                ["ep_size: 2", "does not divide n_routed_experts 3"]))
    small = tu.make_model(os.path.join(root, "small-vocab"), dict(tu.SMALL_CONFIG, vocab_size=64))
    out.append(("small vocab", {"param_path": small}, [data, "vocab"]))
    out.append(("sft on text data", {"train_type": "sft"}, ["loss_mask"]))
    out.append(("window too large", {"window_size": "64"}, ["window_size", "max_position_embeddings"]))
    no_data = os.path.join(root, "no-data")
    os.makedirs(no_data)
    out.append(("no shards", {"data_root_path": no_data}, [no_data]))
    out.append(("missing data dir", {"data_root_path": os.path.join(root, "nope")}, ["nope"]))
    out.append(("missing param_path", {"param_path": os.path.join(root, "no-model")},
                ["no-model", "config.json", "No such file"]))
    # 4000 bytes in windows of 16: 249 samples, 125 micro-batches of 2: no optimizer step.
    out.append(("accumulation past the epoch", {"grad_accum_steps": "1000"},
                ["grad_accum_steps: 1000", "125 micro-batch", "249 training samples",
                 "batch_per_device 2"]))
    return out


def diverged_case(root, model, data, failures):
    """A non-finite loss is a training failure (exit 1) naming its step; nothing records it."""
    m = copy_model(model, root, "nan-weight")
    path = os.path.join(m, "model.safetensors")
    header, raw = read_st(path)
    begin = header["norm.weight"]["data_offsets"][0]
    raw = raw[:begin] + struct.pack("<f", float("nan")) + raw[begin + 4:]
    write_st(path, header, raw)
    args = base_args(m, data, root)
    args["ckpt_dir"] = os.path.join(root, "ck-nan")
    try:
        _, err = tu.train(args, expect=1)
    except AssertionError as e:
        failures.append(f"diverged: {e}")
        return
    left = [n for n in os.listdir(args["ckpt_dir"]) if n != "progress.db" and
            not n.startswith("progress.db-")]
    if "loss is nan at step 1" not in err or left:
        failures.append(f"diverged: message or leftovers {left}: {err.strip()}")
    else:
        print(f"ok diverged: exit 1: {err.strip().splitlines()[-1]}")


def mount_tmpfs(path, options):
    """A tmpfs at path; None, or why it could not be mounted."""
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit {proc.returncode}")


def fill(path):
    """Writes into path until its file system is full."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    os.close(fd)


def resource_cases(root, model, data, failures):
    """ckpt_dir (progress.db lives there without astraid) on a read-only and on a full tmpfs:
    exit 1 naming the path and the system's error."""
    ro, full = os.path.join(root, "ro"), os.path.join(root, "full")
    why = mount_tmpfs(ro, "ro,size=64k") or mount_tmpfs(full, "size=64k")
    if why:
        print(f"skip: read-only and full ckpt_dir: cannot mount a tmpfs ({why})")
        return
    try:
        fill(full)
        for name, ckpt, words in [
                ("read-only ckpt_dir to create", os.path.join(ro, "ck"),
                 ["ro/ck", "Read-only file system"]),
                ("read-only ckpt_dir", ro, [os.path.join(ro, "progress.db")]),
                ("full ckpt_dir", os.path.join(full, "ck"), ["full/ck"])]:
            args = base_args(model, data, root)
            args["ckpt_dir"] = ckpt
            try:
                _, err = tu.train(args, expect=1)
            except AssertionError as e:
                failures.append(f"{name}: {e}")
                continue
            missing = [w for w in words if w not in err]
            if missing:
                failures.append(f"{name}: message lacks {missing}: {err.strip()}")
            else:
                print(f"ok {name}: exit 1: {err.strip().splitlines()[-1]}")
    finally:
        for path in (ro, full):
            subprocess.run(["umount", "-l", path], capture_output=True)


def main():
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, 4000)
    failures = []
    for name, changes, words in cases(root, model, data):
        args = base_args(model, data, root)
        args.update(changes)
        try:
            _, err = tu.train(args, expect=2)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
            continue
        missing = [w for w in words if w not in err]
        if missing or "Sanitizer" in err or "runtime error" in err:
            failures.append(f"{name}: message lacks {missing}: {err.strip()}")
        else:
            print(f"ok {name}: {err.strip().splitlines()[-1]}")
    diverged_case(root, model, data, failures)
    resource_cases(root, model, data, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
