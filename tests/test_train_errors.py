"""Bad input to astrai-train: each case exits 2 with a message naming the file and the problem,
never a crash (no signal, no sanitizer report)."""

import json
import os
import shutil
import struct
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
    model_case("attn-mla", ["config.json", "attn_type", "mla"], config={"attn_type": "mla"})
    model_case("ffn-moe", ["config.json", "ffn_type", "moe"], config={"ffn_type": "moe"})
    model_case("no-hidden", ["config.json", "hidden_size"], config={"hidden_size": None})
    model_case("truncated", ["model.safetensors"], weights="truncated")
    model_case("past-end", ["model.safetensors"], weights="past_end")
    model_case("overlap", ["model.safetensors", "overlap"], weights="overlap")
    model_case("bad-dtype", ["model.safetensors", "Q7"], weights="dtype")
    model_case("bad-shape", ["model.safetensors", "norm.weight"], weights="shape")
    model_case("missing-tensor", ["model.safetensors", "norm.weight"], weights="missing")
    small = tu.make_model(os.path.join(root, "small-vocab"), dict(tu.SMALL_CONFIG, vocab_size=64))
    out.append(("small vocab", {"param_path": small}, [data, "vocab"]))
    out.append(("sft on text data", {"train_type": "sft"}, ["loss_mask"]))
    out.append(("window too large", {"window_size": "64"}, ["window_size", "max_position_embeddings"]))
    no_data = os.path.join(root, "no-data")
    os.makedirs(no_data)
    out.append(("no shards", {"data_root_path": no_data}, [no_data]))
    out.append(("missing data dir", {"data_root_path": os.path.join(root, "nope")}, ["nope"]))
    return out


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
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
