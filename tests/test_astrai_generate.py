"""astrai-generate, checked against engine/generate.h through tests/gen_dump.

- Greedy text prompts (bytes tokenizer): the tokens and model log-probs gen_dump gives for the
  same ids, whatever --batch_size; the same from the model as a sharded checkpoint and as a
  Hugging Face directory (astrai-model export-hf, its tokenizer files with it); the ids of
  generation_config.json's eos_token_id stop it as gen_dump's stop ids do.
- A jsonl of {"messages"} and {"prompt"} lines with the model directory's tokenizer.json
  (default --tokenizer): the conversation rendered by tokenizer_config.json's chat template with
  the generation prompt, greedy tokens = gen_dump's with the eos_token as stop token, the
  completion = astrai-data decode of the tokens before it; --chat_template FILE instead.
- Sampling: the same seed gives the same completion (and gen_dump's draws for the same sequence
  indices), another seed another one; --stream writes the prompt and its text before the line.
- Bad input exits 2 naming it: a missing model, a malformed jsonl line (its number), bad flag
  values, a prompt too long for max_position_embeddings, a tokenizer's ids past vocab_size.
"""
import json
import os
import subprocess
import tempfile

import numpy as np

from ref import st_io
from test_model_ref import make_config, random_weights, write_model

BUILD = os.environ["ASTRAI_BUILD"]
GEN = os.path.join(BUILD, "astrai-generate")
DUMP = os.path.join(BUILD, "gen_dump")

CHARS = "abcdefghijklmnopqrstuvwxyz <>/|\n:!?."
V = 64  # the tokenizer.json model: CHARS, fillers, then "<eos>" (special) as id V - 1
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def run(*args, expect=0):
    p = subprocess.run([GEN, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == expect, f"{args}: exit {p.returncode}, want {expect}\n{p.stderr}"
    return p


def generate(*args):
    return [json.loads(line) for line in run(*args).stdout.splitlines()]


def dump(d, prompts, **kv):
    path = os.path.join(d, "ids.txt")
    with open(path, "w") as f:
        f.writelines(" ".join(map(str, p)) + "\n" for p in prompts)
    r = subprocess.run([DUMP, d, path] + [f"{k}={v}" for k, v in kv.items()],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def same(got, want, what):
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"], f"{what}: {g['tokens']} != gen_dump {w['tokens']}"
        err = np.abs(np.subtract(g["logprobs"], w["model_logprobs"])).max()
        assert err <= 1e-6, f"{what}: log-probs differ by {err}"
        assert g["stopped"] == w["stopped"], what


def model(d, vocab):
    cfg = make_config(vocab_size=vocab, max_position_embeddings=64)
    weights = random_weights(cfg, np.random.default_rng(7))
    write_model(d, cfg, weights)
    return cfg, weights


def write_tokenizer(d, eos="<eos>", template=TEMPLATE, chars=CHARS, size=V):
    """tokenizer.json of chars, fillers <tN>, "<eos>" as id size - 1; tokenizer_config.json."""
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({f"<t{i}>": i for i in range(len(chars), size - 1)})
    added = [{"id": size - 1, "content": "<eos>", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []}}
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "chat_template": template}, f)


def write_sharded(d, weights, cfg):
    os.makedirs(d)
    names = sorted(weights)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for k, part in enumerate(halves):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        st_io.save(os.path.join(d, file), {n: weights[n] for n in part})
        weight_map.update({n: file for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
                   "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_text_prompts(tmp):
    d = os.path.join(tmp, "bytes")
    cfg, weights = model(d, 256)
    texts = ["hello", "ab", "the quick brown fox"]
    ids = [list(t.encode()) for t in texts]
    want = dump(d, ids, max_tokens=10)
    flags = ["--max_tokens", "10", "--temperature", "0", "--threads", "2"]
    args = [a for t in texts for a in ("--prompt", t)]
    got = generate("--param_path", d, *args, *flags)
    same(got, want, "text prompts")
    assert [g["prompt"] for g in got] == texts
    same(generate("--param_path", d, *args, *flags, "--batch_size", "2"), want, "batch_size 2")
    sharded = os.path.join(tmp, "sharded")
    write_sharded(sharded, weights, cfg)
    same(generate("--param_path", sharded, *args, *flags), want, "sharded checkpoint")
    hf = os.path.join(tmp, "hf")
    subprocess.run([os.path.join(BUILD, "astrai-model"), "export-hf", d, "--out", hf],
                   check=True, capture_output=True, timeout=60)
    same(generate("--param_path", hf, *args, *flags), want, "Hugging Face directory")
    out = os.path.join(tmp, "out.jsonl")
    p = run("--param_path", d, *args, *flags, "--out", out, "--stream")
    with open(out) as f:
        same([json.loads(line) for line in f], want, "--out")
    for t in texts:
        assert t in p.stdout, f"--stream: {t!r} not in {p.stdout!r}"
    # generation_config.json's eos_token_id (an id or a list) are stop tokens too
    gc = os.path.join(d, "generation_config.json")
    stops = [want[0]["tokens"][1], want[2]["tokens"][3]]
    with open(gc, "w") as f:
        json.dump({"eos_token_id": stops}, f)
    stopped = dump(d, ids, max_tokens=10, stop=",".join(map(str, stops)))
    same(generate("--param_path", d, *args, *flags), stopped, "generation_config.json")
    with open(gc, "w") as f:
        json.dump({"eos_token_id": 999}, f)
    refused(["--param_path", d, *args, *flags], gc, "eos_token_id")
    os.remove(gc)
    return d


def test_jsonl_chat(tmp):
    d = os.path.join(tmp, "chat")
    model(d, V)
    write_tokenizer(d)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = "".join(f"<{m['role']}>{m['content']}\n" for m in conv) + "<assistant>"
    records = [{"messages": conv}, {"prompt": "once upon a time"}]
    jsonl = os.path.join(tmp, "prompts.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    ids = [[CHARS.index(c) for c in s] for s in (rendered, "once upon a time")]
    plain = dump(d, ids, max_tokens=12)
    # the eos_token: the third greedy token of the conversation, so that it stops there
    eos = plain[0]["tokens"][2]
    name = CHARS[eos] if eos < len(CHARS) else f"<t{eos}>" if eos < V - 1 else "<eos>"
    write_tokenizer(d, eos=name)
    want = dump(d, ids, max_tokens=12, stop=eos)
    assert want[0]["stopped"] and len(want[0]["tokens"]) == 3
    got = generate("--param_path", d, "--prompts", jsonl, "--max_tokens", "12",
                   "--temperature", "0")
    same(got, want, "jsonl with messages")
    assert got[0]["prompt"] == rendered, got[0]["prompt"]
    for g in got:
        text = g["tokens"][: len(g["tokens"]) - g["stopped"]]
        r = subprocess.run([os.path.join(BUILD, "astrai-data"), "decode", "--tokenizer", d,
                            "--skip_special_tokens", "-"], input=" ".join(map(str, text)),
                           capture_output=True, text=True, check=True)
        assert g["completion"] == r.stdout, (g["completion"], r.stdout)
    # --chat_template FILE renders instead of tokenizer_config.json's
    tpl = os.path.join(tmp, "other.jinja")
    with open(tpl, "w") as f:
        f.write("{% for m in messages %}{{ m.content }}|{% endfor %}")
    other = generate("--param_path", d, "--prompts", jsonl, "--chat_template", tpl,
                     "--max_tokens", "4", "--temperature", "0")
    assert other[0]["prompt"] == "be brief|hi there|", other[0]["prompt"]


def test_seed(d):
    flags = ["--param_path", d, "--prompt", "abc", "--prompt", "xyz", "--max_tokens", "12",
             "--temperature", "0.9", "--top_k", "40", "--top_p", "0.95"]
    a = generate(*flags, "--seed", "11")
    assert a == generate(*flags, "--seed", "11", "--batch_size", "1"), "same seed, other batch"
    want = dump(d, [list(b"abc"), list(b"xyz")], max_tokens=12, temperature=0.9, top_k=40,
                top_p=0.95, seed=11)
    assert [g["tokens"] for g in a] == [w["tokens"] for w in want], (a, want)
    b = generate(*flags, "--seed", "12")
    assert [g["tokens"] for g in a] != [g["tokens"] for g in b], "seeds 11 and 12 agree"


def refused(args, *needles):
    p = run(*args, expect=2)
    for n in needles:
        assert n in p.stderr, f"{args}: {n!r} not in {p.stderr!r}"


def test_bad_input(tmp, d):
    missing = os.path.join(tmp, "nowhere")
    refused(["--param_path", missing, "--prompt", "x"], missing)
    jsonl = os.path.join(tmp, "bad.jsonl")
    with open(jsonl, "w") as f:
        f.write('{"prompt": "ok"}\n{"prompt": "unterminated\n')
    refused(["--param_path", d, "--max_tokens", "4", "--prompts", jsonl], f"{jsonl}:2")
    with open(jsonl, "w") as f:
        f.write('{"prompt": "ok"}\n\n{"messages": [{"role": "user", "content": 3}]}\n')
    refused(["--param_path", d, "--max_tokens", "4", "--prompts", jsonl], f"{jsonl}:3", '"messages"[0]')
    with open(jsonl, "w") as f:
        f.write('{"prompt": "ok", "extra": 1}\n')
    refused(["--param_path", d, "--max_tokens", "4", "--prompts", jsonl], f"{jsonl}:1")
    with open(jsonl, "w") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}]}\n')
    refused(["--param_path", d, "--max_tokens", "4", "--prompts", jsonl], f"{jsonl}:1", "chat template")
    base = ["--param_path", d, "--prompt", "x", "--max_tokens", "4"]
    for flag, value in (("--temperature", "-1"), ("--top_p", "0"), ("--top_p", "1.5"),
                        ("--max_tokens", "0"), ("--max_tokens", "ten"), ("--top_k", "-2"),
                        ("--rep_window", "1.5"), ("--seed", "-1"), ("--threads", "x"),
                        ("--frequency_penalty", "nan"), ("--batch_size", "0")):
        refused(base + [flag, value], flag, value)
    refused(base + ["--device_type", "tpu"], "--device_type", "tpu")
    refused(base + ["--dtype", "fp8"], "--dtype", "fp8")
    refused(base + ["--temprature", "1"], "--temprature", "--temperature")
    refused(["--prompt", "x"], "--param_path")
    refused(["--param_path", d], "--prompt")
    refused(base + ["--prompts", jsonl], "not both")
    refused(["--param_path", d, "--prompt", "y" * 60, "--max_tokens", "8"], "--prompt 1",
            "60 tokens", "max_position_embeddings 64")
    refused(["--param_path", d, "--prompt", "x"], "--max_tokens 128")
    chat = os.path.join(tmp, "chat")
    refused(["--param_path", chat, "--tokenizer", "bytes", "--prompt", "~", "--max_tokens", "4"],
            "--prompt 1", "vocab_size 64")


def test_ids_past_the_tokenizer(tmp):
    """A model whose vocabulary is larger than its tokenizer's (bytes: 256 ids): the ids past the
    tokenizer are U+FFFD in the completion, the others decoded, the tokens all there."""
    d = os.path.join(tmp, "wide")
    os.makedirs(d)
    model(d, 1024)
    out = generate("--param_path", d, "--tokenizer", "bytes", "--prompt", "hello",
                   "--max_tokens", "12", "--temperature", "0")[0]
    want = "".join("\ufffd" if t >= 256 else chr(t) for t in out["tokens"])
    wide = sum(t >= 256 for t in out["tokens"])
    assert wide, f"no id past 255 in {out['tokens']}: the case is not exercised"
    ascii_only = all(t < 128 or t >= 256 for t in out["tokens"])
    if ascii_only:
        assert out["completion"] == want, f"{out['completion']!r} != {want!r}"
    assert out["completion"].count("\ufffd") >= wide, out["completion"]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        d = test_text_prompts(tmp)
        test_jsonl_chat(tmp)
        test_seed(d)
        test_bad_input(tmp, d)
        test_ids_past_the_tokenizer(tmp)
    print("ok")


if __name__ == "__main__":
    main()
