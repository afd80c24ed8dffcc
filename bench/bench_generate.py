#!/work/main/.venv-hf/bin/python
"""bench_generate.py: generation tokens/s of `astrai-generate` against Hugging Face transformers'
`model.generate` (KV cache, use_cache=True) on the same model, on the same CPU threads, fp32,
greedy, in one run, one side after the other (never both at once), at batch 1 and batch 16.

The model is a random llama (hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1408,
vocab 8192, max_position_embeddings 512, untied head: 30.9M parameters) made by transformers and
saved with save_pretrained (safetensors); astrai-generate reads that HF directory directly
(--param_path). Its tokenizer.json is a hand-written BPE without merges whose first ids are
single letters, so a prompt of L letters is L known ids, which transformers gets as they are
(with the `bytes` tokenizer, a generated id >= 256 of the 8192-id vocabulary would be text
U+FFFD). Prompts: --prompt-len random letters each, all of one length, so neither side pads.

No early stop on either side: the config has no eos_token_id (no generation_config.json
stop ids, no tokenizer eos_token), so both generate exactly --new-tokens tokens per prompt
(both checked).

Timing. astrai-generate prints no timings, and its process also loads the model. So each side
is timed twice per batch size: a run of 1 new token (load, prefill, one token) and a run of N;
the decode rate is B*(N-1) / (t_N - t_1), the same definition on both sides: the time per
generated token after the prompt, load and prefill removed. astrai: the wall time of the
process (after one untimed run that warms the page cache); transformers: the wall time of
the generate() call (after one untimed call) in a child process that holds the model and
waits on its stdin while astrai runs. The sides take turns within each of --repeats rounds
(astrai t_1, t_N, then transformers t_1, t_N), so a burst of other load falls on both; the
rate printed uses the least t_1 and the least t_N of the rounds (the least disturbed), and the
JSON also has each round's own rate.

Threads: every child gets OMP_NUM_THREADS and OPENBLAS_NUM_THREADS = --threads; astrai gets
--threads, transformers torch.set_num_threads. Sanity check: the greedy tokens of both sides
for the first --agree tokens of each prompt (same weights, same ids: they should agree up to
near-ties of the fp32 rounding).

    .venv-hf/bin/python bench/bench_generate.py --build build
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

CONFIG = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, intermediate_size=1408, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None)
LETTERS = "abcdefghijklmnopqrstuvwxyz"  # ids 0..25 of the tokenizer
SEED = 3407


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--build", default="build", help="build directory with astrai-generate")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--batches", default="1,16", help="batch sizes (default 1,16)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--agree", type=int, default=32, help="first tokens compared (default 32)")
    p.add_argument("--workdir", help="keep the model and outputs here (default: a temp dir)")
    p.add_argument("--make", help=argparse.SUPPRESS)         # child: writes the model there
    p.add_argument("--peer-worker", help=argparse.SUPPRESS)  # child: transformers on that dir
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    if min(a.batches + [a.threads, a.repeats, a.agree, a.prompt_len]) < 1 or a.new_tokens < 2:
        p.error("sizes must be >= 1 (--new-tokens >= 2)")
    if a.prompt_len + a.new_tokens > CONFIG["max_position_embeddings"]:
        p.error("--prompt-len + --new-tokens passes max_position_embeddings 512")
    a.agree = min(a.agree, a.new_tokens)
    return a


def thread_env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))


# ------------------------------------------------------------------ the model (child)


def write_tokenizer(d):
    """BPE without merges: the letters, then fillers up to the vocab; no eos_token."""
    V = CONFIG["vocab_size"]
    vocab = {c: i for i, c in enumerate(LETTERS)}
    vocab.update({f"<t{i}>": i for i in range(len(LETTERS), V)})
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []}}
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({}, f)


def make_model(d):
    import torch
    import transformers
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(d, safe_serialization=True)
    # transformers writes one only when it differs from the defaults; a stop id there would
    # end astrai's sequences early
    gen_config = os.path.join(d, "generation_config.json")
    if os.path.exists(gen_config):
        os.remove(gen_config)
    write_tokenizer(d)


# ------------------------------------------------------------------ transformers (child)


def hf_generate(model, ids, new_tokens):
    """(seconds, output ids without the prompt) of one greedy generate() call."""
    import torch
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, use_cache=True, pad_token_id=0,
                         # one process; left to generate, finding that out imports
                         # torch.distributed.fsdp, which Debian's torch 1.13 cannot import
                         # under Python 3.11
                         synced_gpus=False)
    dt = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new_tokens, "transformers stopped early"
    return dt, out[:, ids.shape[1]:].tolist()


def peer_main(a):
    """The transformers side as a server: loads the model, says "ready", then for each line
    "B N" on stdin answers one JSON line {"t": seconds, "tokens": ids} of generate()."""
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    model = transformers.LlamaForCausalLM.from_pretrained(a.peer_worker, torch_dtype=torch.float32)
    model.eval()
    assert model.generation_config.eos_token_id is None, "the model must have no EOS"
    prompts = torch.tensor(all_prompt_ids(max(a.batches), a.prompt_len))
    with torch.inference_mode():
        hf_generate(model, prompts[:1], 2)  # untimed: first-call costs
        print("ready", flush=True)
        for line in sys.stdin:
            B, n = map(int, line.split())
            t, tokens = hf_generate(model, prompts[:B], n)
            print(json.dumps({"t": t, "tokens": tokens}), flush=True)


class Peer:
    """The transformers child: one process holding the model for the whole run, idle (blocked
    on its stdin) while astrai runs."""

    def __init__(self, a, model_dir):
        cmd = [sys.executable, os.path.abspath(__file__), "--peer-worker", model_dir,
               "--threads", str(a.threads), "--batches", ",".join(map(str, a.batches)),
               "--prompt-len", str(a.prompt_len)]
        self.proc = subprocess.Popen(cmd, env=thread_env(a.threads), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.expect("ready")

    def expect(self, want=None):
        line = self.proc.stdout.readline()
        if not line or (want and line.strip() != want):
            sys.exit(f"bench_generate: the transformers peer exited {self.proc.wait()}")
        return line

    def generate(self, B, new_tokens):
        """(seconds, tokens) of one generate() call in the child."""
        self.proc.stdin.write(f"{B} {new_tokens}\n")
        self.proc.stdin.flush()
        r = json.loads(self.expect())
        return r["t"], r["tokens"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


# ------------------------------------------------------------------ prompts


def all_prompt_ids(n, length):
    rng = random.Random(SEED)
    return [[rng.randrange(len(LETTERS)) for _ in range(length)] for _ in range(n)]


def write_prompts(path, ids):
    with open(path, "w") as f:
        for p in ids:
            f.write(json.dumps({"prompt": "".join(LETTERS[i] for i in p)}) + "\n")


# ------------------------------------------------------------------ astrai


class Astrai:
    """astrai-generate processes on the model directory, one prompts file per batch size."""

    def __init__(self, a, root, model_dir):
        self.a, self.model_dir, self.out = a, model_dir, os.path.join(root, "astrai.jsonl")
        ids = all_prompt_ids(max(a.batches), a.prompt_len)
        self.prompts = {B: os.path.join(root, f"prompts{B}.jsonl") for B in a.batches}
        for B, path in self.prompts.items():
            write_prompts(path, ids[:B])
        self.generate(1, 1)  # untimed: the model's files into the page cache

    def generate(self, B, new_tokens):
        """(seconds, tokens) of one process: its wall time, load included."""
        a = self.a
        cmd = [os.path.join(a.build, "astrai-generate"), "--param_path", self.model_dir,
               "--prompts", self.prompts[B], "--max_tokens", str(new_tokens),
               "--temperature", "0", "--batch_size", str(B), "--threads", str(a.threads),
               "--device_type", "cpu", "--dtype", "fp32", "--no-stream", "--out", self.out]
        t = time.perf_counter()
        p = subprocess.run(cmd, env=thread_env(a.threads), capture_output=True, text=True)
        dt = time.perf_counter() - t
        if p.returncode != 0:
            sys.exit(f"bench_generate: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-3000:]}")
        with open(self.out) as f:
            rows = [json.loads(line) for line in f]
        assert all(len(r["tokens"]) == new_tokens and not r["stopped"] for r in rows), \
            "astrai-generate stopped early"
        return dt, [r["tokens"] for r in rows]


def measure(a, sides, load):
    """{side: {B: {"t_1": [s...], "t_n": [s...], "tokens": ...}}}. The sides take turns within
    each repeat, so a burst of other load lands on both rather than on one side's block."""
    result = {name: {B: {"t_1": [], "t_n": []} for B in a.batches} for name in sides}
    for B in a.batches:
        for _ in range(a.repeats):
            for name, side in sides.items():
                r = result[name][B]
                r["t_1"].append(side.generate(B, 1)[0])
                t, r["tokens"] = side.generate(B, a.new_tokens)
                r["t_n"].append(t)
        load[f"after_batch_{B}"] = os.getloadavg()[0]
    return result


# ------------------------------------------------------------------ report


def decode_rate(t_1, t_n, B, new_tokens):
    """Tokens/s of the decode steps: B*(N-1) tokens in t_N - t_1 (nan when other load made
    t_N no longer than t_1)."""
    return B * (new_tokens - 1) / (t_n - t_1) if t_n > t_1 else float("nan")


def side_row(side, B, new_tokens):
    """A side's numbers at batch B: the rate from the least t_1 and the least t_N, and each
    repeat's rate (its own t_1 and t_N), which shows how noisy the run was."""
    return {"tokens_per_s": decode_rate(min(side["t_1"]), min(side["t_n"]), B, new_tokens),
            "tokens_per_s_each_repeat": [decode_rate(t1, tn, B, new_tokens)
                                         for t1, tn in zip(side["t_1"], side["t_n"])],
            "t_1_s": side["t_1"], "t_n_s": side["t_n"]}


def leading_agreement(x, y, k):
    """How many of the first k tokens agree before the first difference."""
    n = 0
    while n < k and n < len(x) and n < len(y) and x[n] == y[n]:
        n += 1
    return n


def summarize(a, result, load):
    rows = []
    for B in a.batches:
        ours, hf = result["astrai"][B], result["transformers"][B]
        agree = [leading_agreement(x, y, a.agree) for x, y in zip(ours["tokens"], hf["tokens"])]
        row = {"batch": B, "astrai": side_row(ours, B, a.new_tokens),
               "transformers": side_row(hf, B, a.new_tokens),
               "sequences_agreeing": sum(n == a.agree for n in agree),
               "min_leading_agreement": min(agree)}
        row["ratio"] = row["astrai"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        rows.append(row)
    return {"config": CONFIG, "threads": a.threads, "new_tokens": a.new_tokens,
            "prompt_len": a.prompt_len, "repeats": a.repeats, "agree_first": a.agree,
            "load_average_1min": load, "cpu": cpu_model(), "rows": rows}


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def print_report(result):
    print(json.dumps(result, indent=2))
    print(f"{result['cpu']}, {result['threads']} threads, fp32, greedy, "
          f"{result['prompt_len']}-token prompts, {result['new_tokens']} new tokens")
    print(f"{'batch':>5} {'astrai tok/s':>13} {'HF tok/s':>9} {'ratio':>6}  agreement")
    k = result["agree_first"]
    for r in result["rows"]:
        print(f"{r['batch']:5} {r['astrai']['tokens_per_s']:13.1f} "
              f"{r['transformers']['tokens_per_s']:9.1f} {r['ratio']:5.2f}x  "
              f"{r['sequences_agreeing']}/{r['batch']} sequences agree on the first {k} tokens "
              f"(least: {r['min_leading_agreement']})")
    warn_load(result["load_average_1min"], result["threads"])


def warn_load(load, threads):
    """A warning when the 1-minute load average sampled around the runs passed our threads."""
    busiest = max(load.values())
    if busiest > threads + 0.5:
        print(f"warning: 1-minute load average reached {busiest:.1f} on {os.cpu_count()} cores "
              f"during the run: other work shared the cores, the numbers are noisy")


def main(argv):
    a = parse_args(argv)
    if a.make:
        return make_model(a.make)
    if a.peer_worker:
        return peer_main(a)
    a.build = os.path.abspath(a.build)
    if not os.access(os.path.join(a.build, "astrai-generate"), os.X_OK):
        sys.exit(f"bench_generate: {a.build}/astrai-generate not found (build first)")
    root = a.workdir or tempfile.mkdtemp(prefix="bench-generate-")
    os.makedirs(root, exist_ok=True)
    try:
        model_dir = os.path.join(root, "hf")
        # made by a child: this process never imports torch (whose threads could spin
        # while astrai runs)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--make", model_dir],
                       check=True, env=thread_env(a.threads))
        load = {"start": os.getloadavg()[0]}
        peer = Peer(a, model_dir)
        try:
            result = measure(a, {"astrai": Astrai(a, root, model_dir), "transformers": peer},
                             load)
        finally:
            peer.close()
        print_report(summarize(a, result, load))
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
