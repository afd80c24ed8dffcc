"""test_hf_model: `astrai-model import-hf` / `export-hf` against transformers 4.46 and safetensors.

- Tiny random models made by transformers (llama; llama saved bf16 in shards; llama in fp16;
  llama with Llama 3's rope_scaling and tied embeddings; mistral; qwen2 with q/k/v biases;
  qwen3 written by hand: transformers 4.46 has none; mixtral, top-2 of 4 experts, and top-1 of
  3 with a window, bf16 in shards) are imported: every AstrAI tensor equals the HF tensor
  renamed (mixtral's router and experts as DeepSeekMoE's routed experts), its q/k rows (biases,
  qk-norm weights) permuted per head from halves (i, i+D/2) to pairs (2i, 2i+1), bit for bit
  (--dtype fp32 / bf16: cast as torch's .to());
  import then export gives back the HF tensors, config and tokenizer files bit for bit;
  transformers loads the export (model and tokenizer) and its logits equal the engine's on the
  imported directory (tests/model_dump) within 1e-4.
- AstrAI models (astrai-model init, fp32 and bf16) exported, sharded or not, load in
  transformers with the engine's logits; export then import gives back their tensors bit for
  bit; --dtype bf16 rounds as torch does. Likewise with a window (mistral), four attention
  biases (llama) and routed experts without shared ones (mixtral).
- `astrai-train --param_path HF_DIR` trains from the HF directory and leaves it unchanged; its
  checkpoints (full and sharded layout) export to models transformers loads.
- Bad inputs exit 2 naming the file and key, and write nothing: among them mixtral's
  router_jitter_noise, the other mixture-of-experts families (qwen2_moe, deepseek_v2/v3, olmoe,
  dbrx, jamba, ...) naming what differs, and exports of shared experts, MLA or NTK rope
  scaling.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

import train_util as tu
from ref import st_io
from ref.hf_map import rel_err, to_astrai

torch.set_num_threads(2)
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
TOL = 1e-4
MODEL = tu.binary("astrai-model")

BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
            rms_norm_eps=1e-6)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
CASES = {  # name: (config class, overrides, save dtype, max_shard_size)
    "llama": (transformers.LlamaConfig, {}, torch.float32, None),
    "llama bf16 sharded": (transformers.LlamaConfig, {}, torch.bfloat16, "20KB"),
    "llama fp16": (transformers.LlamaConfig, {}, torch.float16, None),
    "llama3 rope_scaling tied": (transformers.LlamaConfig, dict(
        rope_theta=500000.0, tie_word_embeddings=True, rope_scaling=LLAMA3), torch.float32, None),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None), torch.float32, None),
    # a window shorter than the 12 tokens check_logits feeds
    "mistral sliding_window": (transformers.MistralConfig, dict(sliding_window=4), torch.float32,
                               None),
    "llama attention_bias": (transformers.LlamaConfig, dict(attention_bias=True), torch.float32,
                             None),
    "qwen2": (transformers.Qwen2Config, {}, torch.float32, None),
    "qwen3": (None, {}, torch.float32, None),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                                 intermediate_size=48), torch.float32, None),
    # top-1 routing, a window shorter than check_logits' 12 tokens, bf16 in shards
    "mixtral top-1 sliding_window bf16 sharded": (transformers.MixtralConfig, dict(
        num_local_experts=3, num_experts_per_tok=1, sliding_window=4), torch.bfloat16, "20KB"),
}
# The engine computes these families' functions (q/k/v biases, qk-norm before RoPE and Llama
# 3's rope scaling are model/config.c's attention_bias, qk_norm_before_rope, rope_scaling).
# Mixtral's routing is DeepSeekMoE's without shared experts (ffn_type moe; the engine takes
# torch.topk's CPU order among ties, so random weights route alike).
HF_PEER = {"llama", "llama bf16 sharded", "llama fp16", "llama3 rope_scaling tied", "mistral",
           "mistral sliding_window", "llama attention_bias", "qwen2", "mixtral",
           "mixtral top-1 sliding_window bf16 sharded"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def astrai_model(args, expect=0):
    return tu.run([MODEL] + args, expect)


# ---------------------------------------------------------------- models

def save_tokenizer(out):
    import tokenizers
    vocab = {f"w{i}": i for i in range(BASE["vocab_size"] - 1)}
    vocab["<unk>"] = BASE["vocab_size"] - 1
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="w1", eos_token="w2")
    fast.save_pretrained(out)


def randomize(model, seed):
    """Non-trivial norms and biases (HF initialises them to 1 and 0)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3 / p.shape[1] ** 0.5)


def save_qwen3(out, seed):
    """A Qwen3 checkpoint by hand: Llama's tensors plus q_norm/k_norm, Qwen3's config keys."""
    cfg = transformers.LlamaConfig(**BASE)
    model = transformers.LlamaForCausalLM(cfg)
    randomize(model, seed)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    D = BASE["hidden_size"] // BASE["num_attention_heads"]
    for i in range(BASE["num_hidden_layers"]):
        for q in ("q", "k"):
            state[f"model.layers.{i}.self_attn.{q}_norm.weight"] = 1 + 0.1 * torch.randn(D)
    os.makedirs(out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf = dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=D,
              attention_bias=False, use_sliding_window=False, sliding_window=None,
              max_window_layers=2, hidden_act="silu", rope_theta=1000000.0,
              tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)


def save_case(name, out, seed, **sizes):
    config_cls, over, dtype, shard = CASES[name]
    if config_cls is None:
        save_qwen3(out, seed)
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            config_cls(**dict(BASE, **over, **sizes)))
        randomize(model, seed)
        model.to(dtype).save_pretrained(out, safe_serialization=True,
                                        **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(out)


def load_dir(d):
    """{name: tensor} of d's model.safetensors or sharded set."""
    index = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(d, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        out.update(load_file(os.path.join(d, name)))
    return out


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- the mapping

def astrai_view(hf, D):
    """The AstrAI tensors the specification makes of HF tensors."""
    return dict(to_astrai(name, t, D) for name, t in hf.items())


def bits(t):
    return t.view(torch.int16 if t.dtype in (torch.bfloat16, torch.float16) else torch.int32)


def same_tensors(a, b):
    """'' when a and b hold the same names, dtypes and bits; else what differs."""
    if set(a) != set(b):
        return f"names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape:
            return f"{k}: {a[k].dtype} {tuple(a[k].shape)} vs {b[k].dtype} {tuple(b[k].shape)}"
        if not torch.equal(bits(a[k]), bits(b[k])):
            return f"{k}: values differ"
    return ""


# ---------------------------------------------------------------- logits

def engine_logits(model_dir, root, inputs):
    inp, out = os.path.join(root, "inputs.safetensors"), os.path.join(root, "dump.safetensors")
    st_io.save(inp, {"inputs": inputs, "targets": inputs})
    tu.run([tu.binary("model_dump"), model_dir, inp, out])
    return st_io.load(out)["logits"]


def hf_logits(hf_dir, inputs):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(inputs).long()).logits.numpy()


def check_logits(what, engine_dir, hf_dir, root, failures):
    inputs = np.random.default_rng(5).integers(0, BASE["vocab_size"], (2, 12)).astype(np.int32)
    e = rel_err(engine_logits(engine_dir, root, inputs), hf_logits(hf_dir, inputs))
    print(f"  {what}: engine vs transformers logits, relative difference {e:.2e}")
    if not e <= TOL:
        failures.append(f"{what}: logits differ by {e:.2e}")


# ---------------------------------------------------------------- the cases

def check_import(name, root, failures):
    hf_dir, ours, back = (os.path.join(root, n) for n in ("hf", "astrai", "back"))
    save_case(name, hf_dir, seed=len(name))
    astrai_model(["import-hf", hf_dir, "--out", ours])
    hf = load_dir(hf_dir)
    D = BASE["hidden_size"] // BASE["num_attention_heads"]
    diff = same_tensors(load_file(os.path.join(ours, "model.safetensors")), astrai_view(hf, D))
    cfg = read_json(os.path.join(ours, "config.json"))
    family = read_json(os.path.join(hf_dir, "config.json"))["model_type"]
    llama_bias = "attention_bias" in name
    # import writes "type" beside "rope_type" (AstrAI reads only "type": docs/design.md §7b)
    want = {"hf_model_type": family, "attention_bias": family == "qwen2" or llama_bias,
            "o_proj_bias": llama_bias, "sliding_window": 4 if "sliding" in name else None,
            "use_qk_norm": family == "qwen3", "qk_norm_before_rope": family == "qwen3",
            "rope_scaling": dict(LLAMA3, type="llama3") if "llama3" in name else None}
    over = CASES[name][1]
    moe = family == "mixtral"
    want.update({"ffn_type": "moe" if moe else "mlp",
                 "n_routed_experts": over["num_local_experts"] if moe else None,
                 "n_shared_experts": 0 if moe else None,
                 "n_activated_experts": over["num_experts_per_tok"] if moe else None,
                 "topk_method": "greedy" if moe else None})
    got = {k: cfg.get(k) for k in want}
    print(f"{name}: {len(hf)} tensors{' in shards' if CASES[name][3] else ''}, import "
          f"{'bit-identical to the permuted HF tensors' if not diff else diff}, config {got}")
    if diff:
        failures.append(f"{name}: import: {diff}")
    if got != want:
        failures.append(f"{name}: import config {got}, expected {want}")
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        cast = os.path.join(root, "cast-" + dtype)
        astrai_model(["import-hf", hf_dir, "--out", cast, "--dtype", dtype])
        diff = same_tensors(load_file(os.path.join(cast, "model.safetensors")),
                            {k: v.to(torch_dtype) for k, v in astrai_view(hf, D).items()})
        print(f"  import --dtype {dtype}: {'equal to torch .to()' if not diff else diff}")
        if diff:
            failures.append(f"{name}: import --dtype {dtype}: {diff}")
    astrai_model(["export-hf", ours, "--out", back])
    diff = same_tensors(load_dir(back), hf)
    orig, again = (read_json(os.path.join(d, "config.json")) for d in (hf_dir, back))
    cfg_diff = {k for k in set(orig) | set(again) if orig.get(k) != again.get(k)}
    # Floats stay floats in the JSON text ("factor": 8.0, not 8: transformers warns otherwise).
    for key, o_val, a_val in [(k, orig[k], again.get(k)) for k in orig] + [
            ("rope_scaling." + k, v, (again.get("rope_scaling") or {}).get(k))
            for k, v in (orig.get("rope_scaling") or {}).items()]:
        if isinstance(o_val, float) and not isinstance(a_val, float):
            cfg_diff.add(f"{key} written as {a_val!r}, not a float")
    tok_diff = [f for f in TOKENIZER_FILES if open(os.path.join(hf_dir, f), "rb").read()
                != open(os.path.join(back, f), "rb").read()]
    print(f"  import+export: tensors {'bit-identical' if not diff else diff}, config keys "
          f"differing {sorted(cfg_diff)}, tokenizer files differing {tok_diff}")
    if diff or cfg_diff or tok_diff:
        failures.append(f"{name}: import+export: {diff} config {cfg_diff} tokenizer {tok_diff}")
    if name in HF_PEER:
        check_logits(name, ours, back, root, failures)
        text = "w3 w17 w90 zz w2"
        ids, want = (transformers.AutoTokenizer.from_pretrained(d)(text)["input_ids"]
                     for d in (back, hf_dir))
        print(f"  AutoTokenizer of the export: {text!r} -> {ids} (the source's: {want})")
        if ids != want:
            failures.append(f"{name}: the exported tokenizer encodes {ids}, the source {want}")


ASTRAI_CONFIG = dict(BASE, rope_theta=10000.0, tie_word_embeddings=False, attn_type="gqa",
                     ffn_type="mlp", use_qk_norm=False, use_gated_attention=False)
MOE = dict(ffn_type="moe", n_routed_experts=4, n_shared_experts=0, n_activated_experts=2,
           topk_method="greedy")


def check_astrai_export(root, failures):
    for dtype in ("fp32", "bf16"):
        d = os.path.join(root, dtype)
        os.makedirs(d)
        with open(os.path.join(d, "model.json"), "w") as f:
            json.dump(ASTRAI_CONFIG, f)
        src = os.path.join(d, "model")
        astrai_model(["init", "--config", os.path.join(d, "model.json"), "--out", src,
                      "--dtype", dtype])
        for shards in ("5", "0.00002"):
            hf, back = os.path.join(d, f"hf{shards}"), os.path.join(d, f"back{shards}")
            astrai_model(["export-hf", src, "--out", hf, "--max_shard_gb", shards])
            n = len([f for f in os.listdir(hf) if f.endswith(".safetensors")])
            astrai_model(["import-hf", hf, "--out", back])
            diff = same_tensors(load_file(os.path.join(back, "model.safetensors")),
                                load_file(os.path.join(src, "model.safetensors")))
            print(f"astrai init {dtype}: export in {n} file(s), export+import "
                  f"{'bit-identical' if not diff else diff}")
            if diff:
                failures.append(f"astrai {dtype} export+import: {diff}")
            check_logits(f"astrai {dtype} export ({n} files)", src, hf, d, failures)
    # AstrAI configs with a window or with all four attention biases: Mistral and Llama exports
    for what, over, family in (("sliding_window 5", dict(sliding_window=5), "mistral"),
                               ("q/k/v/o biases", dict(attention_bias=True, o_proj_bias=True),
                                "llama"),
                               ("top-2 of 4 routed experts", MOE, "mixtral")):
        d = os.path.join(root, family + "-features")
        os.makedirs(d)
        with open(os.path.join(d, "model.json"), "w") as f:
            json.dump(dict(ASTRAI_CONFIG, **over), f)
        src, hf, back = (os.path.join(d, n) for n in ("model", "hf", "back"))
        astrai_model(["init", "--config", os.path.join(d, "model.json"), "--out", src])
        if over.get("o_proj_bias"):  # init's biases are 0: make them matter
            edit_tensors(src, lambda s: s.update({k: 0.1 * torch.randn_like(v) for k, v in s.items()
                                                  if k.endswith(".bias")}))
        astrai_model(["export-hf", src, "--out", hf])
        cfg = read_json(os.path.join(hf, "config.json"))
        got = {k: cfg.get(k) for k in ("model_type", "sliding_window", "attention_bias",
                                       "num_local_experts", "num_experts_per_tok") if k in cfg}
        astrai_model(["import-hf", hf, "--out", back])
        diff = same_tensors(load_file(os.path.join(back, "model.safetensors")),
                            load_file(os.path.join(src, "model.safetensors")))
        print(f"astrai {what}: exported as {got}, export+import "
              f"{'bit-identical' if not diff else diff}")
        if cfg["model_type"] != family or diff:
            failures.append(f"astrai {what}: export {got}, export+import {diff}")
        check_logits(f"astrai {what} export", src, hf, d, failures)
    # an existing model is refused without --force; with it, the shards of the old go
    hf = os.path.join(root, "fp32", "hf0.00002")
    _, err = astrai_model(["export-hf", os.path.join(root, "fp32", "model"), "--out", hf],
                          expect=2)
    astrai_model(["export-hf", os.path.join(root, "fp32", "model"), "--out", hf, "--force"])
    left = sorted(f for f in os.listdir(hf) if f.startswith("model"))
    print(f"export over a sharded export: refused ({err.strip()}); with --force it holds {left}")
    if "already exists" not in err or left != ["model.safetensors"]:
        failures.append(f"export over an export: {err!r}, then {left}")
    # --dtype bf16 of fp32 weights: torch's rounding (nearest even)
    src, hf = os.path.join(root, "fp32", "model"), os.path.join(root, "cast")
    astrai_model(["export-hf", src, "--out", hf, "--dtype", "bf16"])
    want = {k: v.to(torch.bfloat16) for k, v in load_dir(os.path.join(root, "fp32", "hf5")).items()}
    diff = same_tensors(load_dir(hf), want)
    torch_dtype = read_json(os.path.join(hf, "config.json"))["torch_dtype"]
    print(f"export --dtype bf16: {'equal to torch .to(bfloat16)' if not diff else diff}, "
          f"torch_dtype {torch_dtype}")
    if diff or torch_dtype != "bfloat16":
        failures.append(f"export --dtype bf16: {diff} torch_dtype {torch_dtype}")


def tree_digest(d):
    h = hashlib.sha256()
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        st = os.stat(p)
        h.update(f"{name} {st.st_size} {st.st_mtime_ns}".encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def check_param_path(root, failures):
    hf_dir = os.path.join(root, "hf")
    save_case("llama bf16 sharded", hf_dir, seed=9, vocab_size=256)  # byte tokens
    before = tree_digest(hf_dir)
    data_dir, _ = tu.make_text_data(root, 4 * 4 * 16 + 1)
    for fmt in ("full", "sharded"):
        ckpt_dir = os.path.join(root, "ckpt-" + fmt)
        tu.train({"train_type": "seq", "param_path": hf_dir, "data_root_path": data_dir,
                  "batch_per_device": 2, "window_size": 16, "max_lr": 1e-3, "threads": 2,
                  "ckpt_dir": ckpt_dir, "ckpt_interval": 1000, "max_steps": 2,
                  "ckpt_format": fmt})
        ckpt = tu.latest_checkpoint(ckpt_dir)
        out = os.path.join(root, "export-" + fmt)
        astrai_model(["export-hf", ckpt, "--out", out])
        layout = "sharded" if os.path.exists(
            os.path.join(ckpt, "model.safetensors.index.json")) else "full"
        D = BASE["hidden_size"] // BASE["num_attention_heads"]
        diff = same_tensors(astrai_view(load_dir(out), D), load_dir(ckpt))
        orig, again = (read_json(os.path.join(d, "config.json")) for d in (hf_dir, out))
        # the checkpoint's dtype (--ckpt_dtype), not the source's
        orig["torch_dtype"] = str(load_dir(ckpt)["embed_tokens.weight"].dtype).split(".")[1]
        cfg_diff = sorted(k for k in set(orig) | set(again) if orig.get(k) != again.get(k))
        print(f"astrai-train --param_path HF_DIR: 2 steps; its {layout} checkpoint exported "
              f"{'bit-identical to the permuted checkpoint tensors' if not diff else diff}, "
              f"config keys differing from the HF source {cfg_diff}")
        if diff or cfg_diff:
            failures.append(f"export of the {fmt} checkpoint: {diff} config {cfg_diff}")
        if layout == "sharded":  # model_dump reads model.safetensors
            astrai_model(["consolidate", ckpt, "--out", ckpt + "-full"])
            ckpt += "-full"
        check_logits(f"export of the {layout} checkpoint", ckpt, out, root, failures)
    if tree_digest(hf_dir) != before:
        failures.append(f"--param_path changed the HF directory {hf_dir}")
    else:
        print("  the HF directory is unchanged (bytes and mtimes)")


# ---------------------------------------------------------------- bad inputs

def edit_config(d, **kv):
    p = os.path.join(d, "config.json")
    cfg = read_json(p)
    cfg.update(kv)
    with open(p, "w") as f:
        json.dump(cfg, f)


def edit_tensors(d, fn, file="model.safetensors"):
    p = os.path.join(d, file)
    state = load_file(p)
    fn(state)
    save_file(state, p, metadata={"format": "pt"})


def truncate(d):
    p = os.path.join(d, "model.safetensors")
    os.truncate(p, os.path.getsize(p) // 2)


def first_shard(d):
    return sorted(f for f in os.listdir(d) if f.startswith("model-"))[0]


def drop_shard(d):
    os.remove(os.path.join(d, first_shard(d)))


def misplace_tensor(d):
    p = os.path.join(d, "model.safetensors.index.json")
    idx = read_json(p)
    files = sorted(set(idx["weight_map"].values()))
    idx["weight_map"]["model.norm.weight"] = next(
        f for f in files if f != idx["weight_map"]["model.norm.weight"])
    with open(p, "w") as f:
        json.dump(idx, f)


def pickle_only(d):
    os.remove(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x02not read")


def cut_rows(s):
    s["model.layers.1.self_attn.q_proj.weight"] = s["model.layers.1.self_attn.q_proj.weight"][:24]


BAD = [  # (case, edit, substrings stderr must hold)
    ("llama", lambda d: edit_config(d, foo_scale=2.0), ["config.json", "unknown key 'foo_scale'"]),
    ("llama", lambda d: edit_config(d, model_type="gpt2"), ["config.json", "model_type 'gpt2'"]),
    ("llama", lambda d: edit_config(d, num_local_experts=8), ["config.json", "num_local_experts",
                                                              "mixture-of-experts"]),
    ("llama", lambda d: edit_config(d, mlp_bias=True), ["config.json", "mlp_bias"]),
    ("llama", lambda d: edit_config(d, num_hidden_layers=10**9),
     ["config.json", "num_hidden_layers", "above astrai's limit of 4096"]),
    ("llama", lambda d: edit_config(d, hidden_size=2**40),
     ["config.json", "hidden_size", "above astrai's limit of 65536"]),
    ("llama", lambda d: edit_config(d, attention_bias="yes"), ["config.json", "attention_bias",
                                                               "true or false"]),
    ("qwen3", lambda d: edit_config(d, attention_bias=True), ["config.json", "attention_bias"]),
    ("llama", lambda d: edit_config(d, head_dim=16), ["config.json", "head_dim"]),
    ("llama", lambda d: edit_config(d, hidden_act="gelu"), ["config.json", "hidden_act"]),
    ("llama", lambda d: edit_config(d, rope_scaling={"type": "linear", "factor": 2.0}),
     ["config.json", "rope_scaling", "linear"]),
    ("llama", lambda d: edit_config(d, rope_scaling=dict(LLAMA3, high_freq_factor=0.5)),
     ["config.json", "high_freq_factor"]),
    ("llama", lambda d: edit_config(d, rope_scaling=dict(LLAMA3, beta=1.0)),
     ["config.json", "rope_scaling.beta"]),
    ("llama", lambda d: edit_config(d, rms_norm_eps="tiny"), ["config.json", "rms_norm_eps"]),
    ("mistral", lambda d: edit_config(d, sliding_window=0), ["config.json", "sliding_window",
                                                              "positive integer"]),
    ("mistral", lambda d: edit_config(d, sliding_window=2.5), ["config.json", "sliding_window",
                                                                "integer"]),
    ("qwen2", lambda d: edit_config(d, use_sliding_window=True),
     ["config.json", "use_sliding_window", "max_window_layers"]),
    ("llama", truncate, ["model.safetensors"]),
    ("llama bf16 sharded", drop_shard, ["model.safetensors.index.json", "model-00001-of-"]),
    ("llama bf16 sharded", misplace_tensor, ["model.safetensors.index.json", "model.norm.weight",
                                             "does not hold it"]),
    ("llama", lambda d: edit_tensors(d, cut_rows), [
        "model.safetensors", "model.layers.1.self_attn.q_proj.weight", "[24, 32]",
        "num_attention_heads*head_dim"]),
    ("llama", lambda d: edit_tensors(d, lambda s: s.pop("model.norm.weight")),
     ["model.safetensors", "'model.norm.weight' is missing"]),
    ("llama", lambda d: edit_tensors(d, lambda s: s.update(extra=torch.zeros(3))),
     ["model.safetensors", "unexpected tensor 'extra'"]),
    ("llama3 rope_scaling tied", lambda d: edit_tensors(
        d, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()})),
     ["unexpected tensor 'lm_head.weight'"]),
    ("llama", pickle_only, ["pytorch_model.bin", "pickle"]),
    # mixtral: what the engine does not compute, sizes in HF terms
    ("mixtral", lambda d: edit_config(d, router_jitter_noise=0.01),
     ["config.json", "router_jitter_noise", "jitter noise"]),
    ("mixtral", lambda d: edit_config(d, num_experts_per_tok=5),
     ["config.json", "num_experts_per_tok 5 exceeds num_local_experts 4"]),
    ("mixtral", lambda d: edit_config(d, num_local_experts=10**6),
     ["config.json", "num_local_experts", "above astrai's limit of 4096"]),
    ("mixtral", lambda d: edit_config(d, n_shared_experts=1),
     ["config.json", "'n_shared_experts' is not mixtral's"]),
    ("mixtral", lambda d: edit_config(d, output_router_logits="yes"),
     ["config.json", "output_router_logits", "true or false"]),
    ("mixtral", lambda d: edit_tensors(d, lambda s: s.update({
        "model.layers.1.block_sparse_moe.gate.weight":
            s["model.layers.1.block_sparse_moe.gate.weight"][:3]})),
     ["model.safetensors", "model.layers.1.block_sparse_moe.gate.weight", "[3, 32]",
      "(num_local_experts, hidden_size)"]),
    ("mixtral", lambda d: edit_tensors(
        d, lambda s: s.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight")),
     ["'model.layers.1.block_sparse_moe.experts.3.w2.weight' is missing",
      "(hidden_size, intermediate_size)"]),
    ("mixtral", lambda d: edit_tensors(d, lambda s: s.update({
        "model.layers.0.mlp.up_proj.weight": torch.zeros(48, 32)})),
     ["unexpected tensor 'model.layers.0.mlp.up_proj.weight'"]),
    # 4096 layers of 4096 experts: the plan holds no more entries than the file has tensors
    # (not 50 million, 15 GB), and the first that differs is named
    ("mixtral", lambda d: edit_config(d, num_hidden_layers=4096, num_local_experts=4096),
     ["model.safetensors", "model.layers.0.block_sparse_moe.gate.weight", "expected [4096, 32]"]),
    # other mixture-of-experts families: refused naming what is not DeepSeekMoE's function
    ("mixtral", lambda d: edit_config(d, model_type="qwen2_moe"),
     ["config.json", "'qwen2_moe'", "shared_expert gating", "mean of shared experts"]),
    ("mixtral", lambda d: edit_config(d, model_type="deepseek_v2"),
     ["config.json", "'deepseek_v2'", "grouped top-k"]),
    ("mixtral", lambda d: edit_config(d, model_type="deepseek_v3"),
     ["config.json", "'deepseek_v3'", "sigmoid routing", "grouped top-k"]),
    ("mixtral", lambda d: edit_config(d, model_type="olmoe"),
     ["config.json", "'olmoe'", "not renormalised"]),
    ("mixtral", lambda d: edit_config(d, model_type="dbrx"), ["config.json", "'dbrx'", "fused"]),
    ("mixtral", lambda d: edit_config(d, model_type="jamba"), ["config.json", "'jamba'", "Mamba"]),
]


def replace_file(d, name, text):
    os.remove(os.path.join(d, name))
    with open(os.path.join(d, name), "w") as f:
        f.write(text)


def link_to(d, name, target):
    os.remove(os.path.join(d, name))
    os.symlink(target, os.path.join(d, name))


# A BPE tokenizer.json (one astrai loads, so it is loaded whole) giving one id to two tokens.
DUP_BPE = json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 0, "c": 1}, "merges": []}})
BAD += [
    # support files are parsed as what they claim to be before anything is written
    ("llama", lambda d: link_to(d, "tokenizer.json", "/etc/passwd"),
     ["tokenizer.json", "not valid JSON"]),
    ("llama", lambda d: replace_file(d, "tokenizer_config.json", "[1, 2]"),
     ["tokenizer_config.json", "not a JSON object"]),
    ("llama", lambda d: replace_file(d, "tokenizer.json", '{"model": {"type": "WordLevel"}}'),
     ["tokenizer.json", "not a tokenizer"]),
    ("llama", lambda d: replace_file(d, "tokenizer.json", DUP_BPE),
     ["tokenizer.json", 'tokens "a" and "b" both have id 0']),
]


def check_support_links(root, failures):
    """Hugging Face's cache layout: every file a symlink into blobs/. import-hf follows the links,
    copies what they hold, and never makes a copy more permissive than its source (0640)."""
    hf, out = os.path.join(root, "hf"), os.path.join(root, "out")
    save_case("llama", hf, seed=2)
    blobs = os.path.join(root, "blobs")
    os.makedirs(blobs)
    want = {}
    for name in TOKENIZER_FILES:
        blob = os.path.join(blobs, name + ".blob")
        shutil.move(os.path.join(hf, name), blob)
        os.chmod(blob, 0o640)
        os.symlink(blob, os.path.join(hf, name))
        want[name] = open(blob, "rb").read()
    astrai_model(["import-hf", hf, "--out", out])
    for name in TOKENIZER_FILES:
        path = os.path.join(out, name)
        mode = os.stat(path).st_mode & 0o777
        same = not os.path.islink(path) and open(path, "rb").read() == want[name]
        print(f"symlinked {name}: copied {'as it is' if same else 'WRONG'}, mode {oct(mode)}")
        if not same or mode & ~0o640:
            failures.append(f"symlinked {name}: same content {same}, mode {oct(mode)} (source 0640)")


def check_bad(root, failures):
    made = {}
    for i, (case, edit, needles) in enumerate(BAD):
        if case not in made:
            made[case] = os.path.join(root, f"good{len(made)}")
            save_case(case, made[case], seed=1)
        d, out = os.path.join(root, f"bad{i}"), os.path.join(root, f"out{i}")
        shutil.copytree(made[case], d)
        edit(d)
        proc = subprocess.run([MODEL, "import-hf", d, "--out", out], capture_output=True,
                              text=True, timeout=60)
        missing = [n for n in needles if n not in proc.stderr]
        wrote = os.path.exists(out)
        print(f"bad {case}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[0]}")
        if proc.returncode != 2 or missing or wrote:
            failures.append(f"bad input {i} ({case}): exit {proc.returncode}, stderr "
                            f"{proc.stderr.strip()!r} lacks {missing}, wrote --out: {wrote}")
    # export: what no HF family computes
    d = os.path.join(root, "gated")
    os.makedirs(d)
    with open(os.path.join(d, "model.json"), "w") as f:
        json.dump(dict(ASTRAI_CONFIG, use_gated_attention=True), f)
    astrai_model(["init", "--config", os.path.join(d, "model.json"), "--out", d + "/model"])
    _, err = astrai_model(["export-hf", d + "/model", "--out", d + "/hf"], expect=2)
    print(f"bad export (gated attention): {err.strip().splitlines()[0]}")
    if "use_gated_attention" not in err or "config.json" not in err:
        failures.append(f"export of gated attention: {err!r}")
    for what, over, needle in (
            ("a window with qk-norm (qwen3)", dict(sliding_window=8, use_qk_norm=True,
                                                   qk_norm_before_rope=True), "sliding_window"),
            ("an o_proj bias alone", dict(o_proj_bias=True), "o_proj_bias true"),
            ("shared experts", dict(MOE, n_shared_experts=1), "n_shared_experts 1"),
            ("experts with qk-norm (qwen3)", dict(MOE, use_qk_norm=True,
                                                  qk_norm_before_rope=True), "use_qk_norm true"),
            ("MLA", dict(attn_type="mla", kv_lora_rank=16, qk_nope_head_dim=4,
                         qk_rope_head_dim=4), "attn_type mla"),
            # AstrAI's NTK (a larger base): transformers has no such type, and would read
            # {"type": "ntk"} otherwise or refuse it
            ("NTK rope scaling", dict(rope_scaling={"type": "ntk", "factor": 2.0}),
             "rope_scaling ntk")):
        d = os.path.join(root, "export-" + what.replace(" ", "-").replace("/", ""))
        os.makedirs(d)
        with open(os.path.join(d, "model.json"), "w") as f:
            json.dump(dict(ASTRAI_CONFIG, **over), f)
        astrai_model(["init", "--config", os.path.join(d, "model.json"), "--out", d + "/model"])
        _, err = astrai_model(["export-hf", d + "/model", "--out", d + "/hf"], expect=2)
        print(f"bad export ({what}): {err.strip().splitlines()[0]}")
        if needle not in err or "config.json" not in err or os.path.exists(d + "/hf"):
            failures.append(f"export of {what}: {err!r}")


def main():
    failures = []
    root = tu.tmpdir()

    def sub(name):
        os.makedirs(os.path.join(root, name))
        return os.path.join(root, name)

    try:
        for i, name in enumerate(CASES):
            check_import(name, sub(f"case{i}"), failures)
        check_astrai_export(sub("astrai"), failures)
        check_param_path(sub("train"), failures)
        check_bad(sub("bad"), failures)
        check_support_links(sub("links"), failures)
    finally:
        shutil.rmtree(root)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
