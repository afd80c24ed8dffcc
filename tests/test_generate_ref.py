"""test_generate_ref: engine/generate.h (through tests/gen_dump) against the PyTorch reference
(tests/ref/model.py), whose greedy decoding runs a whole forward per token.

- Greedy tokens equal the reference's, with the KV cache and without it (a full recomputation
  per step), and each token's model log-prob is within 1e-4 of the reference's (fp32), for GQA;
  qk-norm, gated attention, q/k/v/o biases and a sliding window shorter than the sequences;
  Llama 3 rope scaling with qk-norm before RoPE; NTK rope scaling; MLA + MoE; GQA + MoE.
- A stop token ends a sequence on it (included, `stopped`), as the reference's decoding does.
- bf16 and fp16: the cache gives the tokens of the recomputation.
- Prompts of different lengths in one batch give each prompt's tokens alone.
- A sampled run (temperature, top-k, top-p, frequency penalty) is reproducible, independent of
  the batch (each prompt alone, keyed by its sequence index), the same without the cache, and
  its drawn tokens' model log-probs are the reference's over the same tokens.
- Errors name the prompt at fault."""
import json
import os
import subprocess
import tempfile

import numpy as np
import torch

from ref.model import RefModel
from test_model_ref import (LLAMA3, make_config, mla_config, moe_config, moe_keys,
                            random_weights, write_model)

torch.set_num_threads(2)
GEN = os.path.join(os.environ["ASTRAI_BUILD"], "gen_dump")
TOL = 1e-4
PROMPT_LENS = [5, 11, 1, 8]
MAX_TOKENS = 8


def run_gen(d, prompts, **args):
    """gen_dump's generations of prompts (lists of ids) with KEY=VALUE args."""
    path = os.path.join(d, "prompts.txt")
    with open(path, "w") as f:
        f.writelines(" ".join(map(str, p)) + "\n" for p in prompts)
    argv = [GEN, d, path] + [f"{k}={v}" for k, v in args.items()]
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 0, f"{argv}: {r.stderr}"
    return json.loads(r.stdout)


def ref_greedy(ref, prompt, max_tokens, stop=()):
    """The reference's greedy decoding: argmax of a whole forward's last logits, each token's
    log_softmax (double) with it."""
    seq, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = ref.forward(np.array([seq]))[0, -1].double()
            t = int(torch.argmax(logits))
            top2 = torch.topk(logits, 2).values
            tokens.append(t)
            logprobs.append((float(torch.log_softmax(logits, -1)[t]), float(top2[0] - top2[1])))
            seq.append(t)
            if t in stop:
                break
    return tokens, logprobs


def ref_logprobs(ref, prompt, tokens):
    """log_softmax of the reference over prompt + tokens at each of the tokens."""
    seq = list(prompt) + list(tokens)
    with torch.no_grad():
        logits = ref.forward(np.array([seq]))[0].double()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def make_prompts(cfg, seed, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg["vocab_size"], n).tolist() for n in lens]


def check_against_ref(name, got, want, how):
    for b, (g, (tokens, lps)) in enumerate(zip(got, want)):
        margins = [m for _, m in lps]
        assert g["tokens"] == tokens, (
            f"{name} ({how}), prompt {b}: tokens {g['tokens']} != reference {tokens} "
            f"(reference top-2 margins {margins})")
        err = max(abs(a - r) for a, (r, _) in zip(g["model_logprobs"], lps))
        assert err <= TOL, f"{name} ({how}), prompt {b}: log-prob error {err:.2e}"
        assert g["logprobs"] == [0.0] * len(tokens), f"{name}: greedy log-probs {g['logprobs']}"
    return max(abs(a - r) for g, (_, lps) in zip(got, want)
               for a, (r, _) in zip(g["model_logprobs"], lps))


def check_greedy(name, cfg, seed, lowp=("bf16", "fp16"), alone=False, lens=PROMPT_LENS,
                 max_tokens=MAX_TOKENS):
    prompts = make_prompts(cfg, seed, lens)
    with tempfile.TemporaryDirectory() as d:
        write_model(d, cfg, random_weights(cfg, np.random.default_rng(seed)))
        ref = RefModel.from_dir(d)
        want = [ref_greedy(ref, p, max_tokens) for p in prompts]
        worst = 0.0
        for how, args in (("cache", {}), ("no cache", {"no_cache": 1})):
            got = run_gen(d, prompts, max_tokens=max_tokens, **args)
            worst = max(worst, check_against_ref(name, got, want, how))
            assert not any(g["stopped"] for g in got), name
        # a stop token: the third of prompt 0's greedy tokens ends it there
        # stop tokens: the third of prompt 0's greedy tokens ends it there; and the last id
        stop = (want[0][0][2], cfg["vocab_size"] - 1)
        stopped = [ref_greedy(ref, p, max_tokens, stop) for p in prompts]
        got = run_gen(d, prompts, max_tokens=max_tokens, stop=",".join(map(str, stop)))
        check_against_ref(name, got, stopped, "stop tokens")
        for g, (tokens, _) in zip(got, stopped):
            assert g["stopped"] == (tokens[-1] in stop), (name, g)
        if alone:
            batch = run_gen(d, prompts, max_tokens=max_tokens)
            for b, p in enumerate(prompts):
                one = run_gen(d, [p], max_tokens=max_tokens)[0]
                assert one["tokens"] == batch[b]["tokens"], (name, b, one, batch[b])
                err = np.abs(np.subtract(one["model_logprobs"], batch[b]["model_logprobs"])).max()
                assert err <= 1e-5, f"{name}: prompt {b} alone vs in the batch: {err:.2e}"
        for dtype in lowp:
            cached = run_gen(d, prompts, max_tokens=max_tokens, dtype=dtype)
            full = run_gen(d, prompts, max_tokens=max_tokens, dtype=dtype, no_cache=1)
            assert [g["tokens"] for g in cached] == [g["tokens"] for g in full], (
                f"{name} {dtype}: cache {cached} != no cache {full}")
    print(f"{name}: greedy = reference with and without the cache, worst log-prob {worst:.1e}"
          f"{', alone = batch' if alone else ''}{', ' + '/'.join(lowp) + ' cache = no cache' if lowp else ''}")


def check_sampled(name, cfg, seed):
    prompts = make_prompts(cfg, seed)
    args = dict(max_tokens=10, temperature=0.8, top_k=20, top_p=0.95, frequency_penalty=0.3,
                rep_window=4, seed=1234)
    with tempfile.TemporaryDirectory() as d:
        write_model(d, cfg, random_weights(cfg, np.random.default_rng(seed)))
        ref = RefModel.from_dir(d)
        first = run_gen(d, prompts, **args)
        assert run_gen(d, prompts, **args) == first, f"{name}: two runs differ"
        full = run_gen(d, prompts, no_cache=1, **args)
        assert [g["tokens"] for g in full] == [g["tokens"] for g in first], (name, full, first)
        for b, p in enumerate(prompts):
            one = run_gen(d, [p], first_sequence=b, **args)[0]
            assert one["tokens"] == first[b]["tokens"], (name, b, one, first[b])
            err = np.abs(np.subtract(one["logprobs"], first[b]["logprobs"])).max()
            assert err <= 1e-5, f"{name}: prompt {b} alone vs in the batch: {err:.2e}"
            want = ref_logprobs(ref, p, first[b]["tokens"])
            err = np.abs(np.subtract(first[b]["model_logprobs"], want)).max()
            assert err <= TOL, f"{name}: prompt {b}: sampled tokens' log-probs {err:.2e}"
            assert all(lp <= 0 for lp in first[b]["logprobs"]), first[b]
        other = run_gen(d, prompts, **dict(args, seed=99))
        assert [g["tokens"] for g in other] != [g["tokens"] for g in first], f"{name}: seeds"
    print(f"{name}: sampled run reproducible, alone = batch, cache = no cache, log-probs = "
          "reference")


def check_errors():
    cfg = make_config(max_position_embeddings=16)
    with tempfile.TemporaryDirectory() as d:
        write_model(d, cfg, random_weights(cfg, np.random.default_rng(5)))
        cases = [([[1, 2], list(range(10))], dict(max_tokens=8),
                  "prompt 1 of 10 tokens with max_tokens 8 passes max_position_embeddings 16"),
                 ([[1, 2], [3, 99]], {}, "input token 99 at (1,1) outside vocab_size 67"),
                 ([[1, 2]], dict(stop="70"), "stop token 70 outside vocab_size 67"),
                 ([[1, 2]], dict(top_p=0), "generation: top_p")]
        for prompts, args, fragment in cases:
            path = os.path.join(d, "prompts.txt")
            with open(path, "w") as f:
                f.writelines(" ".join(map(str, p)) + "\n" for p in prompts)
            r = subprocess.run([GEN, d, path] + [f"{k}={v}" for k, v in args.items()],
                               capture_output=True, text=True)
            assert r.returncode == 2 and fragment in r.stderr, (fragment, r.returncode, r.stderr)
    print("errors: ok")


def main():
    check_greedy("gqa untied", make_config(), seed=1, alone=True)
    check_greedy("gqa tied qk-norm gated q/k/v/o biases sliding window 4",
                 make_config(tie_word_embeddings=True, use_qk_norm=True,
                             use_gated_attention=True, attention_bias=True, o_proj_bias=True,
                             sliding_window=4), seed=2)
    check_greedy("mha qk-norm before RoPE llama3 rope_scaling",
                 make_config(num_key_value_heads=4, use_qk_norm=True, qk_norm_before_rope=True,
                             rope_theta=500000.0, rope_scaling=LLAMA3), seed=3, lowp=())
    check_greedy("gqa H=8 K=2 ntk rope_scaling", make_config(
        num_attention_heads=8, num_key_value_heads=2, rope_scaling={"type": "ntk", "factor": 4.0}),
        seed=4, lowp=())
    # decoding past several of the CPU kernel's key blocks, inside and past the window
    check_greedy("gqa sliding window 21 long prompts",
                 make_config(sliding_window=21, max_position_embeddings=256), seed=9,
                 lowp=("bf16",), lens=[40, 3, 70], max_tokens=30)
    check_greedy("gqa moe S=0 k=2 K=1", moe_config(6, 0, 2, num_key_value_heads=1), seed=5,
                 lowp=())
    check_greedy("mla moe K=2<H=4 S=1 qk-norm gated",
                 mla_config(4, 4, 12, num_key_value_heads=2, use_qk_norm=True,
                            use_gated_attention=True, **moe_keys(4, 1, 2)), seed=6, alone=True)
    check_sampled("gqa sampled", make_config(), seed=7)
    check_sampled("mla moe sampled", mla_config(4, 4, 12, num_key_value_heads=1,
                                                **moe_keys(4, 1, 2)), seed=8)
    check_errors()


if __name__ == "__main__":
    main()
