"""test_hf_generate: `astrai-generate --param_path HF_DIR --temperature 0` decodes as transformers'
greedy `generate` (4.46) does, end to end: the HF directory read directly (import-hf's renaming
and RoPE permutation), the prefill and the KV-cached decode of engine/generate.h, the argmax, and
the stop at generation_config.json's eos_token_id.

Tiny random models made by transformers and saved with save_pretrained (fp32): llama; qwen2
(q/k/v biases); llama with Llama 3's rope_scaling and tied embeddings; mistral with a sliding
window (4) shorter than the sequences. Four ASCII prompts (--tokenizer bytes: the ids are the
bytes, no BOS) of 1 to 11 tokens, MAX_NEW greedy tokens each:
- the token ids equal those of `model.generate(do_sample=False, max_new_tokens=MAX_NEW)` run on
  each prompt alone, stop included: both stop at the same eos_token_id, or neither does (each
  side's `stopped` / sequence length says which); llama once more with eos_token_id set to a token
  that prompt 0's greedy decoding first reaches after 3 or more, so that both must stop there;
- each token's "logprobs" (the untempered model's, sample_model_logprob) is within 1e-4 of
  log_softmax (double) of transformers' logits at that step (output_logits; for greedy
  decoding no logits processor runs, so they are also output_scores, which is checked).
A mismatch names the prompt and the reference's top-2 margin at the first differing step, so a
near tie is told from a bug."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

import train_util as tu
from test_hf_model import BASE, LLAMA3, randomize

torch.set_num_threads(2)
transformers.logging.set_verbosity_error()
# generate() asks whether the model is FSDP-managed by importing torch.distributed.fsdp, which
# Debian's torch 1.13 cannot import under Python 3.11 (a dataclass with a mutable default); a
# model made here never is.
transformers.generation.utils.is_fsdp_managed_module = lambda module: False
GEN = tu.binary("astrai-generate")
TOL = 1e-4
MAX_NEW = 16
PROMPT_LENS = [5, 11, 1, 8]
SIZES = dict(vocab_size=256, max_position_embeddings=64)  # the bytes tokenizer's ids
CASES = {  # name: (config class, overrides, seed)
    "llama": (transformers.LlamaConfig, {}, 1),
    "qwen2 q/k/v biases": (transformers.Qwen2Config, dict(eos_token_id=2), 2),
    "llama3 rope_scaling tied": (transformers.LlamaConfig, dict(
        rope_theta=500000.0, tie_word_embeddings=True, rope_scaling=LLAMA3), 3),
    "mistral sliding_window 4": (transformers.MistralConfig, dict(sliding_window=4), 4),
}


def save_model(d, name):
    config_cls, over, seed = CASES[name]
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**dict(BASE, **SIZES, **over)))
    randomize(model, seed)
    model.save_pretrained(d, safe_serialization=True)
    return model.eval()


def make_prompts(seed):
    rng = np.random.default_rng(seed)
    return ["".join(map(chr, rng.integers(33, 127, n))) for n in PROMPT_LENS]


def astrai_generate(d, prompts):
    argv = [GEN, "--param_path", d, "--tokenizer", "bytes", "--temperature", "0",
            "--max_tokens", str(MAX_NEW), "--device_type", "cpu", "--dtype", "fp32",
            "--threads", "2"] + [a for p in prompts for a in ("--prompt", p)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines()]


def hf_generate(model, prompt):
    """transformers' greedy tokens for prompt alone, each step's log_softmax (double) and top-2
    margin of the logits."""
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW, output_logits=True, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    assert len(out.logits) == len(tokens), (len(out.logits), tokens)
    lps, margins = [], []
    for t, logits, scores in zip(tokens, out.logits, out.scores):
        assert torch.equal(logits, scores), "a logits processor changed greedy's scores"
        x = logits[0].double()
        lps.append(float(torch.log_softmax(x, -1)[t]))
        top2 = torch.topk(x, 2).values
        margins.append(float(top2[0] - top2[1]))
    eos = model.generation_config.eos_token_id
    return tokens, lps, margins, set([eos] if isinstance(eos, int) else eos or [])


def compare(name, b, got, want):
    tokens, lps, margins, eos = want
    if got["tokens"] != tokens:
        i = next((i for i, (g, w) in enumerate(zip(got["tokens"], tokens)) if g != w),
                 min(len(tokens), len(got["tokens"])))
        return (f"{name}, prompt {b}: tokens {got['tokens']} != transformers {tokens} (first "
                f"difference at step {i}, transformers' top-2 margin there "
                f"{margins[i] if i < len(margins) else None})")
    hf_stopped = tokens[-1] in eos
    if got["stopped"] != hf_stopped:
        return f"{name}, prompt {b}: stopped {got['stopped']}, transformers {hf_stopped}"
    err = float(np.abs(np.subtract(got["logprobs"], lps)).max())
    if err > TOL:
        return f"{name}, prompt {b}: log-prob error {err:.2e} > {TOL}"
    return None


def check_prompts(name, d, model, prompts, failures):
    """astrai-generate against transformers on each prompt; what is printed, or None."""
    got = astrai_generate(d, prompts)
    assert len(got) == len(prompts), f"{name}: {len(got)} lines for {len(prompts)} prompts"
    worst, stops, margin, wants = 0.0, 0, np.inf, []
    for b, (g, p) in enumerate(zip(got, prompts)):
        want = hf_generate(model, p)
        wants.append(want)
        fail = compare(name, b, g, want)
        if fail:
            failures.append(fail)
            continue
        worst = max(worst, float(np.abs(np.subtract(g["logprobs"], want[1])).max()))
        stops += g["stopped"]
        margin = min(margin, min(want[2]))
    print(f"{name}: greedy tokens = transformers' generate for {len(prompts)} prompts "
          f"({stops} stopped at eos), worst log-prob error {worst:.1e}, smallest top-2 "
          f"margin {margin:.1e}")
    return wants


def set_eos(d, model, eos):
    """eos_token_id of the model's generation_config.json (astrai-generate's stop) and of
    transformers' generation config."""
    path = os.path.join(d, "generation_config.json")
    with open(path) as f:
        gc = json.load(f)
    gc["eos_token_id"] = eos
    with open(path, "w") as f:
        json.dump(gc, f)
    model.generation_config.eos_token_id = eos


def first_new(tokens, start):
    """The first index >= start whose token does not come earlier, or None."""
    return next((i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i]), None)


def check_case(name, failures, stop=False):
    """The case's prompts; with stop, again with an eos_token_id that prompt 0's greedy tokens
    reach after 3 or more, so that both sides stop on it (wherever it comes in the others)."""
    with tempfile.TemporaryDirectory() as d:
        model = save_model(d, name)
        prompts = make_prompts(CASES[name][2])
        tokens = check_prompts(name, d, model, prompts, failures)[0][0]
        i = first_new(tokens, 2) if stop else None
        if i is not None:
            set_eos(d, model, tokens[i])
            got = check_prompts(f"{name}, eos {tokens[i]}", d, model, prompts, failures)[0][0]
            if len(got) != i + 1:
                failures.append(f"{name}: transformers stopped prompt 0 after {len(got)} "
                                f"tokens, not at its eos {tokens[i]} ({i + 1})")
        elif stop:
            failures.append(f"{name}: prompt 0's greedy tokens {tokens} have no eos to test")


def main():
    failures = []
    for i, name in enumerate(CASES):
        check_case(name, failures, stop=i == 0)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
