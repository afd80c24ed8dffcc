#!/work/main/.venv-hf/bin/python
"""bench_hf.py: `astrai-model import-hf` and `export-hf` on a ~1B-parameter sharded bf16 llama
checkpoint, side by side in one run with the same conversion done in Python by transformers +
safetensors (each shard loaded as a state dict by transformers' load_state_dict, renamed, q/k
rows permuted, saved by safetensors), as a ratio: wall time and peak resident memory of each
converting process (/usr/bin/time's maximum RSS), the source out of the page cache first.

The checkpoint is synthetic: a llama config (hidden 2048, 16 layers, intermediate 5632, vocab
32000, 16 heads: 0.95 B parameters, 1.9 GB of bf16) written as ~1 GB shards with an index by
safetensors' torch API straight from random tensors (no model is built). Needs ~10 GB of free
disk under --tmp; everything is removed afterwards.

    .venv-hf/bin/python bench/bench_hf.py --build build
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from ref.hf_map import RENAMES  # noqa: E402  (the name mapping of docs/design.md §16)

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
              hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
              num_key_value_heads=16, intermediate_size=5632, max_position_embeddings=2048,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", torch_dtype="bfloat16")
SHARD_BYTES = 1 << 30

# The Python peer: what a user of transformers + safetensors writes for the same conversion, one
# shard's state dict at a time (transformers' own loader, safetensors' writer).
# argv: direction (import/export), source dir, output dir.
PEER = r'''
import json, os, sys
import torch
from safetensors.torch import save_file
from transformers.modeling_utils import load_state_dict
direction, src, out = sys.argv[1:4]
D = 2048 // 16
RENAMES = %(renames)r
def rename(name):
    for a, b in RENAMES:
        name = name.replace(a, b) if direction == "import" else name.replace(b, a)
    return name
def permute(t):
    if direction == "import":   # halves -> pairs
        return t.reshape(-1, 2, D // 2, t.shape[1]).transpose(1, 2).reshape(t.shape)
    return t.reshape(-1, D // 2, 2, t.shape[1]).transpose(1, 2).reshape(t.shape)
os.makedirs(out)
index = os.path.join(src, "model.safetensors.index.json")
files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
    else ["model.safetensors"]
weight_map = {}
for i, f in enumerate(files):
    state = {}
    for name, t in load_state_dict(os.path.join(src, f)).items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t = permute(t).contiguous()
        state[rename(name)] = t
    name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" if len(files) > 1 \
        else "model.safetensors"
    save_file(state, os.path.join(out, name), metadata={"format": "pt"})
    weight_map.update({k: name for k in state})
    del state
if len(files) > 1:
    json.dump({"metadata": {}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"))
'''


def make_checkpoint(d):
    import torch
    from safetensors.torch import save_file
    os.makedirs(d)
    H, I, V = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    shapes = [("model.embed_tokens.weight", (V, H))]
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{x}_proj.weight", (H, H)) for x in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                   (p + "mlp.down_proj.weight", (H, I)), (p + "input_layernorm.weight", (H,)),
                   (p + "post_attention_layernorm.weight", (H,))]
    shapes += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    groups, size = [[]], 0
    for name, shape in shapes:
        n = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        if size and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    torch.manual_seed(0)
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        state = {name: (torch.randn(shape) * 0.02).to(torch.bfloat16) for name, shape in group}
        save_file(state, os.path.join(d, file), metadata={"format": "pt"})
        for name, t in state.items():
            weight_map[name] = file
            total += t.numel() * 2
        del state
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)


def measure(args, root):
    """(seconds, peak RSS in bytes) of one process, as /usr/bin/time sees it (its own child:
    a child of this Python would inherit this process's peak through fork)."""
    report = os.path.join(root, "time.txt")
    t = time.perf_counter()
    subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report] + args, check=True,
                   stdout=subprocess.DEVNULL)
    dt = time.perf_counter() - t
    with open(report) as f:
        return dt, int(f.read().split()[-1]) * 1024


def drop_cache(d):
    """Source pages out of the page cache (posix_fadvise), so every way reads from disk alike."""
    for root, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--make", help=argparse.SUPPRESS)  # the child writing the checkpoint
    a = ap.parse_args()
    if a.make:
        make_checkpoint(a.make)
        return
    model = os.path.join(a.build, "astrai-model")
    free = shutil.disk_usage(a.tmp).free
    if free < 10e9:
        sys.exit(f"{a.tmp}: {free / 1e9:.1f} GB free, the bench needs 10 GB")
    root = tempfile.mkdtemp(prefix="bench-hf-", dir=a.tmp)
    try:
        hf = os.path.join(root, "hf")
        # made by a child: this process stays small
        subprocess.run([sys.executable, __file__, "--make", hf], check=True)
        with open(os.path.join(hf, "model.safetensors.index.json")) as f:
            total = json.load(f)["metadata"]["total_size"]
        n = len(os.listdir(hf)) - 2
        print(f"synthetic llama: {total / 2 / 1e9:.2f} B parameters, {total / 1e9:.2f} GB bf16 "
              f"in {n} shards")
        rows = []
        for what, src in (("import-hf", hf), ("export-hf", os.path.join(root, "astrai"))):
            direction = what.split("-")[0]
            ours_out = os.path.join(root, "astrai" if direction == "import" else "hf-back")
            peer_out = os.path.join(root, "peer-" + direction)
            drop_cache(src)
            ours = measure([model, what, src, "--out", ours_out], root)
            drop_cache(src)
            peer = measure([sys.executable, "-c", PEER % {"renames": RENAMES}, direction, src,
                            peer_out], root)
            shutil.rmtree(peer_out)
            rows.append((what, ours, peer))
        print(f"{'':10} {'astrai s':>9} {'peer s':>8} {'ratio':>6} {'astrai RSS':>11} "
              f"{'peer RSS':>9} {'ratio':>6}  (model {total / 2**30:.2f} GiB)")
        for what, (t, m), (pt, pm) in rows:
            print(f"{what:10} {t:9.2f} {pt:8.2f} {pt / t:5.2f}x {m / 2**30:8.2f} GiB "
                  f"{pm / 2**30:6.2f} GiB {pm / m:5.2f}x")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
