"""test_generate_stats: the tokens a sampled generation draws (engine/generate.h through
tests/gen_dump) follow the distribution that AstrAI's sampling defines over the PyTorch
reference model's logits (tests/ref/model.py), end to end: the model's last logits, then
engine/sample.h's pipeline in AstrAI's order (temperature -> top-k -> top-p -> frequency penalty
over the prompt's last rep_window tokens and the output, which is not DESIGN.md §17's summary),
then the draw keyed (seed, sequence, position).

One fixed prompt is generated as N sequences (gen_dump repeat=N: sequence indices 0..N-1, so
each draws its own uniforms) for 2 tokens, in several settings (plain t = 1; low temperature and
top-k; high temperature and top-p; all four with a positive and a negative penalty):
- step 1: the counts of the N first tokens against N times the expected distribution, by
  Pearson's chi-square goodness of fit (bins of expected count < 5 pooled into one); a token
  outside the allowed set (top-k / top-p removed it) must be drawn exactly 0 times;
- step 2, conditioned on the first token, for the two most frequent first tokens: the same
  test on the second tokens of those sequences, against the reference's logits over
  prompt + [first token], whose penalty also counts the first token (the output);
- every drawn token's reported log-prob (under the distribution it was drawn from) is the log of
  its expected probability within 1e-4.

False-alarm rate: each chi-square test rejects at p-value < ALPHA = 1e-4, so a correct sampler
fails one of the 15 tests with probability <= 1.5e-3; the model, prompt and seeds are fixed,
so the outcome is deterministic (this seed passes). Power: with N = 16000 draws, an expected
distribution computed with a temperature 10% off fails 13 of the 15 chi-square tests (step 1's
at p-values of 1e-22 to 1e-214) and every log-prob check; one that applies the penalty first
(DESIGN.md §17's summary) draws removed tokens and fails chi-square at p 1e-198; one whose
penalty ignores the output fails step 2 (checked by hand when the test was written).

The top-k and top-p boundaries of the settings are checked to lie more than 1e-4 (in logits /
cumulative probability) from a tie, so that the reference's and the engine's logits (which agree
to ~1e-5) give the same allowed set."""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from ref.model import RefModel
from test_model_ref import make_config, random_weights, write_model

torch.set_num_threads(2)
GEN = os.path.join(os.environ["ASTRAI_BUILD"], "gen_dump")
ALPHA = 1e-4
N = 16000
MIN_EXPECTED = 5.0
LOGPROB_TOL = 1e-4
BOUNDARY_MARGIN = 1e-4
# The last 6 tokens hold 46 twice and 60 once, the model's likely next tokens before the
# prompt ended so: the penalty moves the distribution (check_setting makes sure it does).
PROMPT = [3, 17, 5, 40, 60, 46, 22, 46]
MIN_PENALTY_TV = 0.05
SETTINGS = {  # name: gen_dump's sampling keys
    "t 1": dict(temperature=1.0),
    "t 0.7 top-k 12": dict(temperature=0.7, top_k=12),
    "t 1.3 top-p 0.7": dict(temperature=1.3, top_p=0.7),
    "t 0.8 top-k 20 top-p 0.9 penalty 1.5 window 6": dict(
        temperature=0.8, top_k=20, top_p=0.9, frequency_penalty=1.5, rep_window=6),
    "t 1.2 top-p 0.95 penalty -0.8 window 6": dict(
        temperature=1.2, top_p=0.95, frequency_penalty=-0.8, rep_window=6),
}


def make_model(d):
    """A tiny random model whose logits spread over several units (lm_head scaled up), so
    that temperature and truncation change the distribution by much more than the noise."""
    cfg = make_config(max_position_embeddings=16)  # the KV cache of N sequences stays small
    w = random_weights(cfg, np.random.default_rng(32))
    w["lm_head.weight"] *= 8.0
    write_model(d, cfg, w)
    return RefModel.from_dir(d)


def run_gen(d, n, **args):
    """gen_dump's generations of PROMPT as n sequences (0..n-1) of 2 tokens."""
    path = os.path.join(d, "prompt.txt")
    with open(path, "w") as f:
        f.write(" ".join(map(str, PROMPT)) + "\n")
    argv = [GEN, d, path, f"repeat={n}", "max_tokens=2", "seed=20240"]
    argv += [f"{k}={v}" for k, v in args.items()]
    # one thread: OpenMP's spinning threads slow to a crawl on a loaded 2-core machine
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{argv}: {r.stderr}"
    return json.loads(r.stdout)


def ref_logits(ref, seq):
    with torch.no_grad():
        return ref.forward(np.array([seq]))[0, -1].double()


def expected_probs(logits, s, output):
    """AstrAI's final distribution (engine/sample.h steps 1-5) over logits (double), written
    directly: temperature, top-k, top-p (tokens whose preceding cumulative probability is
    <= p), then the penalty over the prompt's last rep_window tokens and `output`, on the
    survivors. Returns the probabilities (exact 0 for removed tokens)."""
    w = logits / s.get("temperature", 1.0)
    k, p, f = s.get("top_k", 0), s.get("top_p", 1.0), s.get("frequency_penalty", 0.0)
    if 0 < k < len(w):
        srt = torch.sort(w, descending=True).values
        assert srt[k - 1] - srt[k] > BOUNDARY_MARGIN, f"top-k {k}: a near tie at the boundary"
        w = torch.where(w < srt[k - 1], torch.tensor(-np.inf, dtype=w.dtype), w)
    if p < 1.0:
        srt, idx = torch.sort(w, descending=True, stable=True)
        before = torch.cumsum(torch.softmax(srt, -1), -1) - torch.softmax(srt, -1)
        live = before[torch.isfinite(srt)]
        assert (live - p).abs().min() > BOUNDARY_MARGIN, f"top-p {p}: a near tie at the boundary"
        removed = idx[before > p]
        w = w.clone()
        w[removed] = -np.inf
    if f != 0.0:
        window = s.get("rep_window", 64)
        counts = torch.zeros_like(w)
        for t in PROMPT[max(0, len(PROMPT) - window):] + list(output):
            counts[t] += 1
        w = w - f * counts  # -inf stays -inf
    return torch.softmax(w, -1).numpy()


def chi_square(counts, probs):
    """Pearson's statistic of counts against sum(counts) * probs over the tokens of probability
    > 0, bins of expected count < MIN_EXPECTED pooled (and the pool, if still short, into the
    smallest other bin); returns (statistic, degrees of freedom, p-value)."""
    n = counts.sum()
    live = np.nonzero(probs > 0)[0]
    exp, obs = n * probs[live], counts[live].astype(float)
    small = exp < MIN_EXPECTED
    e_bins, o_bins = list(exp[~small]), list(obs[~small])
    if small.any():
        e_bins.append(exp[small].sum())
        o_bins.append(obs[small].sum())
        if e_bins[-1] < MIN_EXPECTED and len(e_bins) > 1:
            j = int(np.argmin(e_bins[:-1]))
            e_bins[j] += e_bins.pop()
            o_bins[j] += o_bins.pop()
    e_bins, o_bins = np.array(e_bins), np.array(o_bins)
    x2 = float(((o_bins - e_bins) ** 2 / e_bins).sum())
    df = len(e_bins) - 1
    if df < 1:
        return x2, df, 1.0
    pv = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                       torch.tensor(x2 / 2.0, dtype=torch.float64)))
    return x2, df, pv


def check_draws(what, tokens, logprobs, probs, failures):
    """The chi-square test and the zero counts of removed tokens, for draws of one position."""
    counts = np.bincount(tokens, minlength=len(probs))
    outside = np.nonzero((probs == 0) & (counts > 0))[0]
    if len(outside):
        failures.append(f"{what}: removed tokens drawn: " + ", ".join(
            f"{t} x{counts[t]}" for t in outside))
        return
    lp_err = np.abs(np.log(probs[tokens]) - logprobs).max()
    if lp_err > LOGPROB_TOL:
        failures.append(f"{what}: a reported log-prob is {lp_err:.2e} from the expected")
    x2, df, pv = chi_square(counts, probs)
    allowed = int((probs > 0).sum())
    print(f"  {what}: {len(tokens)} draws over {allowed} allowed tokens, chi2 {x2:.1f} "
          f"df {df}, p-value {pv:.3g}, log-prob error {lp_err:.1e}")
    if pv < ALPHA:
        failures.append(f"{what}: chi-square {x2:.1f} on {df} df, p-value {pv:.3g} < {ALPHA}")


def check_setting(d, ref, name, s, failures):
    gens = run_gen(d, N, **s)
    tokens = np.array([g["tokens"] for g in gens])
    lps = np.array([g["logprobs"] for g in gens])
    assert tokens.shape == (N, 2), f"{name}: generations of shape {tokens.shape}"
    probs = expected_probs(ref_logits(ref, PROMPT), s, [])
    print(f"{name}:")
    if s.get("frequency_penalty"):
        plain = expected_probs(ref_logits(ref, PROMPT), dict(s, frequency_penalty=0.0), [])
        tv = 0.5 * np.abs(probs - plain).sum()
        print(f"  the penalty moves step 1's distribution by {tv:.3f} (total variation)")
        assert tv > MIN_PENALTY_TV, f"{name}: the penalty changes too little to be tested"
    check_draws(f"{name}, step 1", tokens[:, 0], lps[:, 0], probs, failures)
    for first in np.argsort(-np.bincount(tokens[:, 0]), kind="stable")[:2]:
        rows = tokens[:, 0] == first
        probs = expected_probs(ref_logits(ref, PROMPT + [int(first)]), s, [int(first)])
        check_draws(f"{name}, step 2 after {first}", tokens[rows, 1], lps[rows, 1], probs,
                    failures)


def main():
    start, failures = time.time(), []
    with tempfile.TemporaryDirectory() as d:
        ref = make_model(d)
        for name, s in SETTINGS.items():
            check_setting(d, ref, name, s, failures)
    print(f"{len(SETTINGS)} settings, {N} sequences each, alpha {ALPHA} per test: "
          f"{len(failures)} failures ({time.time() - start:.1f} s)")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
