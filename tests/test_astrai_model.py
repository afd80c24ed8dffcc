"""astrai-model init / info / consolidate, checked from Python.

- init writes config.json and model.safetensors that Python reads: AstrAI key
  names and shapes (tests/ref/model.py), BF16 by default, AstrAI's init
  statistics (N(0, 0.02); o_proj and mlp.down N(0, 0.02/sqrt(2*n_layers)); norms 1),
  deterministic per seed, fp32 and bf16 files of one seed agree (torch rounding).
- info prints the tensors (text and --json) and refuses a directory whose
  weights do not match its config.
- bad input exits 2 with a message naming the file / key / flag.
- consolidate turns astrai-train's sharded checkpoint (fsdp, 2 ranks) into the full one the same
  run writes with --ckpt_format full, byte for byte (model and optimizer, fp32 and bf16); info
  describes the sharded checkpoint (its files, each tensor once); a broken or hostile index, a
  truncated shard, mixed dtypes, an occupied --out are refused naming the culprit (exit 2);
  the same for a MoE model (MLA + DeepSeekMoE) sharded under fsdp with ep_size 2, ddp, and ddp in
  a pipeline of 2 stages, whose ranks' shards are what astrai-train --dry-run says each rank
  steps.
"""

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

import train_util as tu
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


MOE_MLA_CONFIG = dict(CONFIG, attn_type="mla", kv_lora_rank=16, qk_nope_head_dim=10,
                      qk_rope_head_dim=6, ffn_type="moe", n_routed_experts=6,
                      n_shared_experts=2, n_activated_experts=2, topk_method="greedy")


def check_moe_mla_init(tmp):
    """An MLA + DeepSeekMoE model: AstrAI's tensors, the experts' down std, active parameters."""
    cfg = dict(MOE_MLA_CONFIG, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    out = init(tmp, "moe_mla", cfg)
    weights = check_files(out, cfg, "BF16")
    L, S, k = cfg["num_hidden_layers"], cfg["n_shared_experts"], cfg["n_activated_experts"]
    want = 0.02 / math.sqrt(2 * L * (1 / max(S, 1) + 1 / k))
    downs = np.concatenate([w.astype(np.float64).reshape(-1) for n, w in weights.items()
                            if "_experts." in n and n.endswith(".down.weight")])
    assert abs(downs.std() / want - 1) < 0.05, (downs.std(), want)
    router = np.concatenate([w.astype(np.float64).reshape(-1) for n, w in weights.items()
                             if n.endswith("mlp.router.weight")])
    assert abs(router.std() / 0.02 - 1) < 0.1, router.std()
    info = json.loads(run("info", out, "--json").stdout)
    total = sum(w.size for w in weights.values())
    unused = L * (cfg["n_routed_experts"] - k) * 3 * cfg["intermediate_size"] * cfg["hidden_size"]
    assert info["num_parameters"] == total and info["active_parameters"] == total - unused, info
    assert f"{total - unused} active per token: 2 of 6 routed experts" in run("info", out).stdout
    print("mla + moe init: AstrAI's tensors and stds, active parameters")


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
        # size limits, checked before anything is planned (exit 2, not "out of memory")
        (dict(CONFIG, num_hidden_layers=10**9), "'num_hidden_layers' = 1000000000 is above "
         "astrai's limit of 4096"),
        (dict(CONFIG, hidden_size=2**40), "'hidden_size' = 1099511627776 is above astrai's "
         "limit of 65536"),
        (dict(CONFIG, attn_type="mla"), "missing required key 'kv_lora_rank'"),
        (dict(CONFIG, attn_type="sparse"), "attn_type 'sparse'"),
        (dict(CONFIG, ffn_type="moe", n_routed_experts=4, n_shared_experts=1,
              n_activated_experts=5), "n_activated_experts 5 exceeds n_routed_experts 4"),
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


# ---------------------------------------------------------------- sharded checkpoints

WINDOW = 16
SHARDED_STEP = "epoch_0_step_2"


def train_args(model, data, ckpt_dir, fmt, dtype, **extra):
    return dict({"train_type": "seq", "param_path": model, "data_root_path": data,
                 "ckpt_dir": ckpt_dir, "parallel_mode": "fsdp", "nprocs": 2, "ckpt_format": fmt,
                 "ckpt_dtype": dtype, "max_steps": 2, "ckpt_interval": 1, "threads": 1,
                 "batch_per_device": 2, "window_size": WINDOW, "random_seed": 7}, **extra)


def train_checkpoints(root, model, data, fmt, dtype, name="", **extra):
    """A 2-step fsdp run over 2 ranks (extra: other flags), a checkpoint after each step; returns
    the last one."""
    ckpt_dir = os.path.join(root, f"ckpt-{name}{fmt}-{dtype}")
    tu.train(train_args(model, data, ckpt_dir, fmt, dtype, **extra))
    return os.path.join(ckpt_dir, SHARDED_STEP)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def check_consolidate(root, full, sharded, dtype, failures):
    """The consolidated sharded checkpoint is the full one: the same tensor files, byte for byte,
    and the text files of the checkpoint."""
    out = os.path.join(root, f"consolidated-{dtype}")
    run("consolidate", sharded, "--out", out)
    for name in ("model.safetensors", "optimizer.safetensors"):
        got, want = read_bytes(os.path.join(out, name)), read_bytes(os.path.join(full, name))
        if got != want:
            failures.append(f"{dtype}: consolidated {name} ({len(got)} bytes) differs from the "
                            f"full format's ({len(want)} bytes)")
    for name in ("meta.json", "config.json", "scheduler.json", "sampler.json", "metric.jsonl"):
        if read_bytes(os.path.join(out, name)) != read_bytes(os.path.join(sharded, name)):
            failures.append(f"{dtype}: {name} is not a copy of the checkpoint's")
    if [n for n in os.listdir(out) if ".tmp." in n]:
        failures.append(f"{dtype}: temporary files left in {out}: {os.listdir(out)}")
    model_dtype = header_of(os.path.join(out, "model.safetensors"))["embed_tokens.weight"]["dtype"]
    print(f"consolidate ({dtype}, model {model_dtype}): model and optimizer identical to the "
          "full format's")
    return out


def check_sharded_info(full, sharded, failures):
    """info of a sharded checkpoint: its format, files and every tensor once, the full format's
    parameter count."""
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    wmap, total = index["weight_map"], index["metadata"]["total_size"]
    files = sorted(set(wmap.values()))
    info = json.loads(run("info", sharded, "--json").stdout)
    full_info = json.loads(run("info", full, "--json").stdout)
    if info["format"] != "sharded" or full_info["format"] != "full":
        failures.append(f"info format: {info['format']} / {full_info['format']}")
    if info["num_parameters"] != full_info["num_parameters"]:
        failures.append(f"info num_parameters {info['num_parameters']} != the full format's "
                        f"{full_info['num_parameters']}")
    if info.get("meta", {}).get("step") != 2:
        failures.append(f"info meta: {info.get('meta')}")
    listed = [t["name"] for t in info["tensors"]]
    if sorted(listed) != sorted(wmap) or len(set(listed)) != len(listed):
        failures.append(f"info --json tensors {listed} are not the weight_map's, each once")
    for t in info["tensors"]:
        if t["file"] != wmap.get(t["name"]):
            failures.append(f"info --json: {t['name']} in {t['file']}, index says "
                            f"{wmap.get(t['name'])}")
    want_files = [{"name": f, "tensors": sum(1 for v in wmap.values() if v == f),
                   "bytes": sum(t["bytes"] for t in info["tensors"] if t["file"] == f)}
                  for f in files]
    if info.get("files") != want_files or info.get("total_size") != total:
        failures.append(f"info --json files {info.get('files')}, total_size "
                        f"{info.get('total_size')}: want {want_files}, {total}")
    text = run("info", sharded).stdout
    line = (f"format: sharded, {len(files)} files ({files[0]} ... {files[-1]}), "
            f"total_size {total} bytes")
    if line not in text:
        failures.append(f"info text lacks {line!r}:\n{text}")
    rows = [ln.split() for ln in text.splitlines() if ln.split() and ln.split()[0] in wmap]
    if sorted(r[0] for r in rows) != sorted(wmap) or any(r[-1] != wmap[r[0]] for r in rows):
        failures.append(f"info text rows are not the weight_map's tensors, each once with its "
                        f"file:\n{text}")
    if "format: full" not in run("info", full).stdout:
        failures.append("info of a full checkpoint does not say 'format: full'")
    print(f"info of a sharded checkpoint: {len(files)} files, {len(listed)} tensors, "
          f"{info['num_parameters']} parameters")


def broken_copy(root, sharded, name, edit):
    """A copy of the sharded checkpoint with edit(directory) applied to it."""
    bad = os.path.join(root, "bad", name)
    shutil.copytree(sharded, bad)
    edit(bad)
    return bad


def edit_index(stem, change):
    """An edit of STEM.safetensors.index.json: change(index) edits it, returns the culprit."""
    culprit = []

    def edit(bad):
        path = os.path.join(bad, f"{stem}.safetensors.index.json")
        with open(path) as f:
            index = json.load(f)
        culprit.append(change(index["weight_map"]))
        with open(path, "w") as f:
            json.dump(index, f)
    return edit, culprit


def first_in(wmap, file_prefix):
    return next(n for n, f in sorted(wmap.items()) if f.startswith(file_prefix))


def escape(wmap):
    wmap[sorted(wmap)[0]] = "../x.safetensors"
    return "../x.safetensors"


def missing_file(wmap):
    wmap[sorted(wmap)[0]] = "model-00009-of-00009.safetensors"
    return "model-00009-of-00009.safetensors"


def wrong_file(wmap):  # a tensor of file 1 mapped to file 2, which does not hold it
    name = first_in(wmap, "model-00001")
    wmap[name] = "model-00002-of-00002.safetensors"
    return name


def opt_wrong_file(wmap):
    name = first_in(wmap, "optimizer-00001")
    if name == "step":  # every file has its own step: pick a tensor only file 1 holds
        name = first_in({k: v for k, v in wmap.items() if k != "step"}, "optimizer-00001")
    wmap[name] = "optimizer-00002-of-00002.safetensors"
    return name


def truncate(name):
    def edit(bad):
        path = os.path.join(bad, name)
        blob = read_bytes(path)
        with open(path, "wb") as f:
            f.write(blob[:len(blob) - 100])
    return edit


def write_text(name, text):
    def edit(bad):
        with open(os.path.join(bad, name), "w") as f:
            f.write(text)
    return edit


def refused(args, needles, what, failures):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=60)
    missing = [n for n in needles if n not in p.stderr]
    if p.returncode != 2 or missing:
        failures.append(f"{what}: {' '.join(args)}: exit {p.returncode} (want 2), stderr lacks "
                        f"{missing}:\n{p.stderr}")
    return p.stderr


def check_sharded_errors(root, sharded, sharded_bf16, full, failures):
    """Broken sharded checkpoints: info and consolidate refuse them naming the index / file /
    tensor at fault, exit 2, and consolidate writes nothing."""
    index = "model.safetensors.index.json"
    cases = []
    for what, change in (("escape", escape), ("missing file", missing_file),
                         ("wrong file", wrong_file)):
        edit, culprit = edit_index("model", change)
        bad = broken_copy(root, sharded, what.replace(" ", "-"), edit)
        cases.append((what, bad, [index, culprit[0]], True))
    edit, culprit = edit_index("optimizer", opt_wrong_file)
    bad = broken_copy(root, sharded, "optimizer-wrong-file", edit)
    cases.append(("optimizer wrong file", bad, ["optimizer.safetensors.index.json", culprit[0]],
                  False))
    cases.append(("truncated shard", broken_copy(
        root, sharded, "truncated", truncate("model-00002-of-00002.safetensors")),
        ["model-00002-of-00002.safetensors", "past the data size"], True))
    cases.append(("index not JSON", broken_copy(
        root, sharded, "not-json", write_text(index, '{"weight_map": {"norm.weight": ')),
        [index, "not valid JSON"], True))
    cases.append(("optimizer index not JSON", broken_copy(
        root, sharded, "opt-not-json", write_text("optimizer.safetensors.index.json", "[1, 2")),
        ["optimizer.safetensors.index.json", "not valid JSON"], False))
    # A bf16 set with one fp32 shard: the model loads, but no one dtype can write it back.
    mixed = broken_copy(root, sharded_bf16, "mixed-dtype", lambda bad: shutil.copy(
        os.path.join(sharded, "model-00002-of-00002.safetensors"), bad))
    cases.append(("mixed dtypes", mixed, [index, "model-00002-of-00002.safetensors", "F32",
                                          "BF16"], False))
    for what, bad, needles, for_info in cases:
        out = os.path.join(root, "bad-out", what.replace(" ", "-"))
        err = refused(["consolidate", bad, "--out", out], needles, what, failures)
        if os.path.exists(out):
            failures.append(f"{what}: a refused consolidate left {out}: {os.listdir(out)}")
        if for_info:
            refused(["info", bad], needles, what, failures)
            refused(["info", bad, "--json"], needles, what, failures)
        print(f"{what}: refused: {err.strip().splitlines()[0]}")
    # An occupied --out, and the checkpoint itself as --out.
    taken = os.path.join(root, "taken")
    shutil.copytree(full, taken)
    before = read_bytes(os.path.join(taken, "model.safetensors"))
    refused(["consolidate", sharded, "--out", taken], [taken, "is not empty", "--force"],
            "occupied --out", failures)
    if read_bytes(os.path.join(taken, "model.safetensors")) != before:
        failures.append("a refused consolidate changed the model in --out")
    refused(["consolidate", sharded, "--out", sharded, "--force"], ["itself"], "--out = CKPT",
            failures)
    refused(["consolidate", sharded], ["--out"], "no --out", failures)
    refused(["consolidate", "--out", taken], ["checkpoint directory"], "no CKPT", failures)
    # A user's directory: refused without --force, and with it only consolidate's own files are
    # replaced (the user's notes stay; nothing of theirs is deleted).
    mine = os.path.join(root, "mine")
    os.makedirs(mine)
    with open(os.path.join(mine, "notes.txt"), "w") as f:
        f.write("mine\n")
    refused(["consolidate", sharded, "--out", mine], [mine, "is not empty", "--force"],
            "user's --out", failures)
    if sorted(os.listdir(mine)) != ["notes.txt"]:
        failures.append(f"a refused consolidate wrote into {mine}: {os.listdir(mine)}")
    run("consolidate", sharded, "--out", mine, "--force")
    if read_bytes(os.path.join(mine, "notes.txt")) != b"mine\n":
        failures.append("consolidate --force touched the user's notes.txt")
    # --force replaces it: the full checkpoint again, from the sharded one.
    run("consolidate", sharded, "--out", taken, "--force")
    if read_bytes(os.path.join(taken, "model.safetensors")) != before:
        failures.append("consolidate --force did not write the full format's model")
    print("occupied --out refused without --force, replaced with it")


# A DeepSeekMoE model with MLA attention (docs/design.md §7a): its router and every expert are
# tensors of their own, each whole in one rank's shard.
MOE_TRAIN_CONFIG = dict(tu.SMALL_CONFIG, attn_type="mla", kv_lora_rank=24, qk_nope_head_dim=12,
                        qk_rope_head_dim=4, num_key_value_heads=4, ffn_type="moe",
                        n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
                        topk_method="greedy", intermediate_size=32)


def shard_contents(sharded, world):
    """[(parameters, tensors)] of each rank's model-RRRRR-of-NNNNN.safetensors (fp32)."""
    out = []
    for k in range(1, world + 1):
        h = header_of(os.path.join(sharded, f"model-{k:05d}-of-{world:05d}.safetensors"))
        t = {n: v for n, v in h.items() if n != "__metadata__"}
        out.append((sum((v["data_offsets"][1] - v["data_offsets"][0]) // 4 for v in t.values()),
                     len(t)))
    return out


def check_sharded_moe(tmp, failures):
    """The MoE model's sharded checkpoints under fsdp (ep_size 2, gradient buckets of 0.1 MiB),
    ddp over 2 ranks, and ddp 2 x pp_size 2: consolidate writes the full format's files byte for
    byte, which hold every tensor of the config (each expert's); each rank's shard is what
    --dry-run says the rank steps."""
    import re
    model = tu.make_model(os.path.join(tmp, "sharded-moe"), MOE_TRAIN_CONFIG)
    data, _ = tu.make_text_data(os.path.join(tmp, "sharded-moe"), 12 * WINDOW + 1)
    want = set(param_shapes(MOE_TRAIN_CONFIG))
    # bucket_mb 0.1: the plan in buckets (a few blocks' gradients each), as on GPUs
    for label, mode, extra in (("fsdp ep 2", "fsdp", {"ep_size": 2, "bucket_mb": 0.1}),
                               ("ddp", "ddp", {}),
                               ("ddp pp 2", "ddp", {"pp_size": 2, "nprocs": 4})):
        name = "moe-" + label.replace(" ", "") + "-"
        full = train_checkpoints(tmp, model, data, "full", "fp32", name, parallel_mode=mode,
                                 **extra)
        sharded = train_checkpoints(tmp, model, data, "sharded", "fp32", name,
                                    parallel_mode=mode, **extra)
        out = check_consolidate(tmp, full, sharded, f"moe {label.replace(' ', '')} fp32",
                                failures)
        got = {n for n in header_of(os.path.join(out, "model.safetensors")) if n != "__metadata__"}
        if got != want:
            failures.append(f"moe {label}: consolidated tensors differ from the config's: "
                            f"{sorted(got ^ want)}")
        args = train_args(model, data, os.path.join(tmp, "dry"), "sharded", "fp32",
                          parallel_mode=mode, **extra)
        dry, _ = tu.run([tu.binary("astrai-train"), "--dry-run"] +
                        [f"--{k}={v}" for k, v in args.items()])
        said = [tuple(int(x) for x in m.groups()) for m in
                re.finditer(r"^# rank \d+: .*?steps (\d+) \((\d+) tensors\)", dry, re.M)]
        files = shard_contents(sharded, args["nprocs"])
        print(f"moe {label}: rank shards (parameters, tensors) {files}, --dry-run says {said}")
        if said != files:
            failures.append(f"moe {label}: the ranks' shards {files} are not what --dry-run says "
                            f"they step: {said}")


def check_sharded(tmp, failures):
    model = tu.make_model(os.path.join(tmp, "sharded"))
    data, _ = tu.make_text_data(os.path.join(tmp, "sharded"), 12 * WINDOW + 1)
    ckpts = {}
    for dtype in ("fp32", "bf16"):
        full = train_checkpoints(tmp, model, data, "full", dtype)
        sharded = train_checkpoints(tmp, model, data, "sharded", dtype)
        if not os.path.exists(os.path.join(sharded, "model.safetensors.index.json")):
            failures.append(f"{sharded}: astrai-train wrote no sharded checkpoint")
            return
        check_consolidate(tmp, full, sharded, dtype, failures)
        ckpts[dtype] = full, sharded
    check_sharded_info(*ckpts["fp32"], failures)
    check_sharded_errors(tmp, ckpts["fp32"][1], ckpts["bf16"][1], ckpts["fp32"][0], failures)
    check_sharded_moe(tmp, failures)


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        out = init(tmp, "main")
        weights = check_files(out, CONFIG, "BF16")
        check_init_statistics(weights, CONFIG["num_hidden_layers"])
        check_info(out, weights)
        check_moe_mla_init(tmp)
        check_seeds_and_dtypes(tmp)
        check_errors(tmp, out)
        check_sharded(tmp, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
