"""test_pref_ref: the C DPO and GRPO losses (tests/pref_dump) against the PyTorch reference
(tests/ref/pref.py): loss, metrics and every parameter gradient within 1e-4, fp32, with a
reference model other than the policy, prompts and responses of different lengths, rows
truncated by the window from either side, non-default knobs, and a GRPO group of equal rewards;
plus the exact values at the start of training: DPO's loss is log 2 with accuracy 0 when the
policy is the reference, and a GRPO group of equal rewards (zero advantage) then has loss and
gradient 0."""
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

from ref import st_io
from ref.model import RefModel
from ref.pref import build_row, dpo_loss, grpo_loss
from test_model_ref import BUILD, TOL, make_config, random_weights, rel_err, write_model

DUMP = os.path.join(BUILD, "pref_dump")
V = 131  # byte strings (< 128) and id arrays both fit
ZERO_TOL = 1e-7  # AstrAI's 1e-8 inside the KL's log is this far from an exact 0 at most
METRIC_NAMES = {"dpo": ("reward_margin", "reward_accuracy"), "grpo": ("kl", "clip_fraction")}


# The smallest scale a metric's error is relative to. Metrics start at exactly 0 (policy ==
# reference). The DPO margin is a small difference of large fp32 log-prob sums, so its error is
# absolute; the KL is small early in training and still checked relative to its size.
METRIC_SCALE = {"reward_margin": 1.0, "reward_accuracy": 1.0, "reward_mean": 1.0, "kl": 1e-2,
                "clip_fraction": 1.0}


def metric_err(name, got, want):
    return abs(got - want) / max(abs(want), METRIC_SCALE[name])


def perturbed(weights, rng, scale):
    """The weights plus relative noise: a policy near the reference, so that GRPO's ratios
    spread on both sides of the clip range instead of all landing outside it."""
    return {k: (w * (1 + scale * rng.standard_normal(w.shape))).astype(np.float32)
            for k, w in weights.items()}


def tokens(field):
    """A JSONL text field as the byte tokenizer reads it: a string's UTF-8 bytes, or ids."""
    return list(field.encode()) if isinstance(field, str) else list(field)


def write_jsonl(path, objects):
    with open(path, "w") as f:
        for obj in objects:
            f.write(json.dumps(obj) + "\n")


def ids(rng, n):
    return [int(x) for x in rng.integers(0, V, n)]


def dpo_objects(rng, window):
    """Pairs of every shape: short; a prompt longer than the window (its start is cut); a chosen
    longer than the window (its end is cut, one prompt token kept); AstrAI's "input" spelling;
    string fields; a one-token prompt."""
    return [
        {"prompt": ids(rng, 5), "chosen": ids(rng, 3), "rejected": ids(rng, 7)},
        {"prompt": ids(rng, window + 6), "chosen": ids(rng, 4), "rejected": ids(rng, 2)},
        {"input": ids(rng, 3), "chosen": ids(rng, window + 5), "rejected": ids(rng, 5)},
        {"prompt": "Tell me a story.", "chosen": "Once upon a time", "rejected": "No."},
        {"prompt": ids(rng, 1), "chosen": ids(rng, 1), "rejected": ids(rng, window)},
    ]


def dpo_records(objects):
    return [(tokens(o.get("prompt") or o["input"]), tokens(o["chosen"]), tokens(o["rejected"]))
            for o in objects]


def grpo_objects(rng, window, G, equal_only=False):
    """Groups of G responses of different lengths (one longer than the window, one prompt longer
    than it); the last group's rewards are all equal (zero advantage)."""
    equal = {"prompt": ids(rng, 6), "responses": [ids(rng, n) for n in (3, 5, 1, 8)][:G],
             "rewards": [0.75] * G}
    if equal_only:
        return [equal]
    return [
        {"prompt": ids(rng, 4), "responses": [ids(rng, n) for n in (3, window + 4, 2, 6)][:G],
         "rewards": [1.0, -0.5, 0.25, 2.0][:G]},
        {"prompt": ids(rng, window + 3), "responses": [ids(rng, n) for n in (5, 1, 7, 4)][:G],
         "rewards": [0.0, 1.0, 0.0, 0.0][:G]},
        {"prompt": "Add 2 and 3.", "responses": ["5", "It is 5.", "6", "2 + 3 = 5"][:G],
         "rewards": [1.0, 1.0, 0.0, 0.5][:G]},
        equal,
    ]


def grpo_records(objects):
    return [(tokens(o["prompt"]), [tokens(r) for r in o["responses"]], o["rewards"])
            for o in objects]


def run_dump(d, kind, policy_dir, ref_dir, data, window, knobs):
    out = os.path.join(d, "out.safetensors")
    cmd = [DUMP, "--model", policy_dir, "--reference", ref_dir, "--data", data,
           "--train_type", kind, "--window", str(window), "--out", out]
    for k, v in knobs.items():
        cmd += ["--" + k, repr(v)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr}"
    return st_io.load(out)


def check_case(name, kind, cfg, policy_w, ref_w, objects, window, knobs, zero=False):
    """pref_dump against the reference; returns pref_dump's loss and metrics and the
    reference's metrics. zero: the gradient must vanish (both pref_dump's and the
    reference's), so it is checked absolutely instead of relative to its scale."""
    with tempfile.TemporaryDirectory() as d:
        policy_dir = os.path.join(d, "policy")
        write_model(policy_dir, cfg, policy_w)
        ref_dir = policy_dir
        if ref_w is not None:
            ref_dir = os.path.join(d, "reference")
            write_model(ref_dir, cfg, ref_w)
        data = os.path.join(d, "records.jsonl")
        write_jsonl(data, objects)
        out = run_dump(d, kind, policy_dir, ref_dir, data, window, knobs)
        policy, reference = RefModel.from_dir(policy_dir), RefModel.from_dir(ref_dir)
    if kind == "dpo":
        loss, metrics = dpo_loss(policy, reference, dpo_records(objects), window,
                                 beta=knobs.get("dpo_beta", 0.1))
    else:
        loss, metrics = grpo_loss(policy, reference, grpo_records(objects), window,
                                  clip_eps=knobs.get("grpo_clip_eps", 0.2),
                                  kl_coef=knobs.get("grpo_kl_coef", 0.01))
    loss.backward()
    want = [metrics[k] for k in METRIC_NAMES[kind]]
    errors = {"loss": rel_err(out["loss"], [loss.item()])}
    for i, key in enumerate(METRIC_NAMES[kind]):
        errors[key] = metric_err(key, float(out["metrics"][i]), want[i])
    nonzero = {}
    for k, g in policy.grads().items():
        got = out["grad." + k]
        if zero:
            errors["grad." + k] = 0.0
            size = max(float(np.abs(got).max()), float(g.abs().max()))
            if size > ZERO_TOL:
                nonzero[k] = size
        else:
            errors["grad." + k] = rel_err(got, g.numpy())
    assert not nonzero, f"{name}: gradients not 0: {nonzero}"
    missing = set(out) - set(errors) - {"metrics"}
    assert not missing, f"{name}: unexpected dump tensors {missing}"
    worst = max(errors, key=errors.get)
    print(f"{name}: loss {loss.item():.6f}, metrics {metrics}, worst {worst} "
          f"{errors[worst]:.2e}")
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, f"{name}: outside {TOL}: {bad}"
    return float(out["loss"][0]), [float(x) for x in out["metrics"]], metrics


def check_dpo(cfg, seed):
    rng = np.random.default_rng(seed)
    ref_w = random_weights(cfg, rng)
    window = 12
    objects = dpo_objects(rng, window)
    rows = [build_row(p, c, window) for p, c, _ in dpo_records(objects)]
    assert any(len(s) == window + 1 for s, _ in rows), "no row is truncated by the window"
    _, _, m = check_case("dpo: policy != reference, beta 0.5", "dpo", cfg,
                         random_weights(cfg, rng), ref_w, objects, window, {"dpo_beta": 0.5})
    assert 0 < m["reward_accuracy"] < 1, f"dpo: every pair on one side ({m}): a weak case"
    loss, metrics, _ = check_case("dpo: policy == reference (step 0)", "dpo", cfg, ref_w, None,
                                  objects, window, {})
    assert abs(loss - math.log(2)) <= 1e-6, f"dpo step 0: loss {loss}, expected log 2"
    assert metrics == [0.0, 0.0], f"dpo step 0: reward margin/accuracy {metrics}, expected 0, 0"


def check_grpo(cfg, seed):
    rng = np.random.default_rng(seed)
    ref_w = random_weights(cfg, rng)
    window, G = 10, 4
    knobs = {"group_size": G, "grpo_clip_eps": 0.15, "grpo_kl_coef": 0.05}
    _, _, m = check_case("grpo: policy != reference, G 4, one group of equal rewards", "grpo",
                         cfg, perturbed(ref_w, rng, 0.3), ref_w, grpo_objects(rng, window, G),
                         window, knobs)
    assert 0 < m["clip_fraction"] < 1 and m["kl"] > 0, f"grpo: a weak case ({m})"
    check_case("grpo: policy == reference, G 4", "grpo", cfg, ref_w, None,
               grpo_objects(rng, window, G), window, {"group_size": G})
    loss, metrics, _ = check_case("grpo: policy == reference, equal rewards only", "grpo", cfg,
                                  ref_w, None, grpo_objects(rng, window, G, equal_only=True),
                                  window, knobs, zero=True)
    assert abs(loss) <= ZERO_TOL and metrics == [0.0, 0.0], (
        f"grpo, zero advantage at step 0: loss {loss}, kl/clip fraction {metrics}, expected 0")


def main():
    check_dpo(make_config(vocab_size=V, use_qk_norm=True, use_gated_attention=True), seed=11)
    check_grpo(make_config(vocab_size=V, num_key_value_heads=4, tie_word_embeddings=True,
                           rope_theta=500.0), seed=12)
    check_grpo(make_config(vocab_size=V, use_qk_norm=True), seed=13)


if __name__ == "__main__":
    sys.exit(main())
