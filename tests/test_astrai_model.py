"""astrai-model init / info, checked from Python.

- init writes config.json and model.safetensors that Python reads: AstrAI key
  names and shapes (tests/ref/model.py), BF16 by default, AstrAI's init
  statistics (N(0, 0.02); o_proj and mlp.down N(0, 0.02/sqrt(2*n_layers)); norms 1),
  deterministic per seed, fp32 and bf16 files of one seed agree (torch rounding).
- info prints the tensors (text and --json) and refuses a directory whose
  weights do not match its config.
- bad input exits 2 with a message naming the file / key / flag.
"""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

from ref import st_io
from ref.model import param_shapes

torch.set_num_threads(2)
BIN = os.path.join(os.environ["ASTRAI_BUILD"], "astrai-model")

CONFIG = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": None,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_gated_attention": True,
    "attn_type": "gqa",
    "ffn_type": "mlp",
}


def run(*args, expect=0):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == expect, f"{args}: exit {p.returncode}, want {expect}\n{p.stdout}\n{p.stderr}"
    return p


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def header_of(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def init(tmp, name, config=CONFIG, *flags):
    cfg_path = os.path.join(tmp, name + ".json")
    write_json(cfg_path, config)
    out = os.path.join(tmp, name)
    run("init", "--config", cfg_path, "--out", out, *flags)
    return out


def check_files(out, config, dtype):
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    for key, value in config.items():
        want = 10000 if key == "rope_theta" and value is None else value
        got = written.get(key)
        assert got == want or (isinstance(want, float) and math.isclose(got, want, rel_tol=1e-6)), (key, got, want)
    path = os.path.join(out, "model.safetensors")
    header = {k: v for k, v in header_of(path).items() if k != "__metadata__"}
    shapes = param_shapes(config)
    assert sorted(header) == sorted(shapes), set(header) ^ set(shapes)
    for name, shape in shapes.items():
        assert header[name]["dtype"] == dtype and tuple(header[name]["shape"]) == shape, (name, header[name])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], os.listdir(out)
    return st_io.load(path)


def check_init_statistics(weights, n_layers):
    """AstrAI init: N(0, 0.02), o_proj/mlp.down scaled, norms exactly 1."""
    scaled_std = 0.02 / math.sqrt(2 * n_layers)
    pools = {0.02: [], scaled_std: []}
    for name, w in weights.items():
        w = w.astype(np.float64).reshape(-1)
        if w.ndim == 1 and name.endswith("norm.weight"):
            assert np.all(w == 1.0), name
            continue
        std = scaled_std if ("o_proj" in name or "mlp.down" in name) else 0.02
        n = w.size
        tol = max(0.05, 5 / math.sqrt(2 * n))  # 5 standard errors of a std estimate
        assert abs(w.std() / std - 1) < tol, f"{name}: std {w.std():.5f} vs {std:.5f}"
        assert abs(w.mean()) < 5 * std / math.sqrt(n), f"{name}: mean {w.mean():.6f}"
        pools[std].append(w / std)
    for std, parts in pools.items():
        z = np.concatenate(parts)
        assert abs(z.std() - 1) < 0.03, (std, z.std())
        # Gaussian: 68.27% within one std (a uniform law would give 57.7%).
        inside = np.mean(np.abs(z) < 1)
        assert abs(inside - 0.6827) < 0.02, (std, inside)
    print("init statistics as AstrAI's")


def check_info(out, weights):
    text = run("info", out).stdout
    for name in weights:
        assert name in text, name
    info = json.loads(run("info", out, "--json").stdout)
    assert info["num_parameters"] == sum(w.size for w in weights.values())
    assert info["config"]["hidden_size"] == CONFIG["hidden_size"]
    listed = {t["name"]: t for t in info["tensors"]}
    assert sorted(listed) == sorted(weights)
    for name, w in weights.items():
        t = listed[name]
        assert tuple(t["shape"]) == w.shape and t["dtype"] == "BF16" and t["bytes"] == 2 * w.size, t
    # A checkpoint directory also shows its meta.json.
    write_json(os.path.join(out, "meta.json"), {"epoch": 2, "consumed_samples": 64, "step": 7})
    info = json.loads(run("info", out, "--json").stdout)
    assert info["meta"]["epoch"] == 2 and info["meta"]["step"] == 7, info["meta"]
    assert "epoch 2, step 7" in run("info", out).stdout
    os.remove(os.path.join(out, "meta.json"))
    print("info lists every tensor")


def check_seeds_and_dtypes(tmp):
    a = init(tmp, "seed_a", CONFIG, "--seed", "11")
    b = init(tmp, "seed_b", CONFIG, "--seed=11")
    c = init(tmp, "seed_c", CONFIG, "--seed", "12")
    f = init(tmp, "seed_f", CONFIG, "--seed", "11", "--dtype", "fp32")
    read = lambda d: open(os.path.join(d, "model.safetensors"), "rb").read()
    assert read(a) == read(b), "same seed, different files"
    assert read(a) != read(c), "different seeds, same file"
    check_files(f, CONFIG, "F32")
    wa, wf = st_io.load(os.path.join(a, "model.safetensors")), st_io.load(os.path.join(f, "model.safetensors"))
    for name in wa:
        rounded = torch.from_numpy(wf[name].copy()).to(torch.bfloat16).float().numpy()
        assert np.array_equal(wa[name], rounded), f"{name}: bf16 file is not the rounded fp32 file"
    tied = init(tmp, "tied", dict(CONFIG, tie_word_embeddings=True))
    assert "lm_head.weight" not in check_files(tied, dict(CONFIG, tie_word_embeddings=True), "BF16")
    print("seeds deterministic; bf16 = rounded fp32; tied embeddings")


def expect_bad(args, *needles):
    p = run(*args, expect=2)
    for needle in needles:
        assert needle in p.stderr, f"{args}: stderr lacks {needle!r}:\n{p.stderr}"


def check_errors(tmp, good):
    bad_cfg = os.path.join(tmp, "bad.json")
    out = os.path.join(tmp, "bad_out")
    for broken, key in [
        ({k: v for k, v in CONFIG.items() if k != "hidden_size"}, "hidden_size"),
        (dict(CONFIG, num_hidden_layers="two"), "num_hidden_layers"),
        (dict(CONFIG, attn_type="mla"), "attn_type"),
        (dict(CONFIG, num_key_value_heads=3), "num_key_value_heads"),
    ]:
        write_json(bad_cfg, broken)
        expect_bad(["init", "--config", bad_cfg, "--out", out], "bad.json", key)
        assert not os.path.exists(out), "a bad config left an output directory"
    with open(bad_cfg, "w") as f:
        f.write('{"vocab_size": 12,')
    expect_bad(["init", "--config", bad_cfg, "--out", out], "bad.json")
    expect_bad(["init", "--config", os.path.join(tmp, "missing.json"), "--out", out], "missing.json")
    good_cfg = os.path.join(tmp, "main.json")
    expect_bad(["init", "--config", good_cfg, "--out", out, "--dtype", "fp8"], "--dtype", "fp8")
    expect_bad(["init", "--config", good_cfg, "--out", out, "--seed", "-1"], "--seed")
    expect_bad(["init", "--config", good_cfg], "--out")
    expect_bad(["init", "--config", good_cfg, "--out", good], "already exists", "--force")
    expect_bad(["frobnicate"], "unknown command 'frobnicate'")
    expect_bad([], "no command")
    expect_bad(["info", os.path.join(tmp, "nowhere")], "nowhere/config.json")

    # Weights that do not match the config, or a truncated file.
    mismatch = os.path.join(tmp, "mismatch")
    os.makedirs(mismatch)
    write_json(os.path.join(mismatch, "config.json"), dict(CONFIG, intermediate_size=80))
    os.link(os.path.join(good, "model.safetensors"), os.path.join(mismatch, "model.safetensors"))
    expect_bad(["info", mismatch], "mismatch/model.safetensors", "mlp.", "expected")
    truncated = os.path.join(tmp, "truncated")
    os.makedirs(truncated)
    write_json(os.path.join(truncated, "config.json"), CONFIG)
    blob = open(os.path.join(good, "model.safetensors"), "rb").read()
    with open(os.path.join(truncated, "model.safetensors"), "wb") as f:
        f.write(blob[: len(blob) - 100])
    expect_bad(["info", truncated], "truncated/model.safetensors", "past the data size")
    assert "init" in run("--help").stdout and "info" in run("info", "--help").stdout
    print("bad input exits 2 naming the culprit")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        out = init(tmp, "main")
        weights = check_files(out, CONFIG, "BF16")
        check_init_statistics(weights, CONFIG["num_hidden_layers"])
        check_info(out, weights)
        check_seeds_and_dtypes(tmp)
        check_errors(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
