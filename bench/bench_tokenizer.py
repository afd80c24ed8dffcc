#!/usr/bin/env python3
"""bench_tokenizer.py: tokenizer.json throughput, one thread, in one run: astrai-data prep
--format text --tokenizer PATH against Hugging Face tokenizers' Tokenizer.encode(text,
add_special_tokens=False) on the whole text and encode_batch of its lines (RAYON_NUM_THREADS=1,
the faster of the two counts) on the same file, for the tokenizer shapes of
tests/test_hf_tokenizer.py (GPT-2, Llama 3, Qwen2, Mistral, Llama 2), trained by tokenizers on
the license texts. Prints MB/s of both and the ratio, in CPU time (user + system, fastest of
--repeat runs). astrai's time is the whole prep (read, tokenize, write the shard); the bytes
tokenizer's prep of the same file is shown as that overhead. Run with the Hugging Face venv:

    .venv-hf/bin/python bench/bench_tokenizer.py --build build --mb 4
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its thread pool
os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build", help="the build directory (astrai-data)")
    p.add_argument("--mb", type=float, default=4, help="size of the text in MB")
    p.add_argument("--repeat", type=int, default=3, help="runs of each side; the fastest counts")
    p.add_argument("--kinds", default="gpt2,llama3,qwen2,mistral,llama2")
    return p.parse_args(argv)


def cpu_seconds():
    """CPU time (user + system) of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def best_time(fn, repeat):
    """The fastest of `repeat` runs, in CPU seconds: the machine is shared, and one thread's
    CPU time is what a busy neighbour does not inflate."""
    times = []
    for _ in range(repeat):
        t = cpu_seconds()
        fn()
        times.append(cpu_seconds() - t)
    return min(times)


def astrai_prep(tool, spec, text_path, out):
    def run():
        subprocess.run(["rm", "-rf", out], check=True)
        subprocess.run([tool, "prep", "--out", out, "--tokenizer", spec, text_path], check=True,
                       capture_output=True)
    return run


def main(argv):
    args = parse_args(argv)
    os.environ.setdefault("ASTRAI_BUILD", args.build)
    import test_hf_tokenizer as hf  # the tokenizers of the test, trained the same way
    from tokenizers import Tokenizer
    tool = os.path.join(args.build, "astrai-data")
    with tempfile.TemporaryDirectory() as root:
        hf.HfTokenizers.dir = root
        hf.HfTokenizers.train_files = [os.path.join(hf.LICENSES, n) for n in hf.TRAIN]
        hf.HfTokenizers.specials = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>",
                                    "<|im_end|>", "<|eot_id|>"]
        paths = hf.HfTokenizers.build_all()
        text = hf.held_out_text(hf.HfTokenizers.specials + ["hello world"],
                                int(args.mb * 1_000_000))
        text_path = os.path.join(root, "text.txt")
        with open(text_path, "w", encoding="utf-8") as f:
            f.write(text)
        mb = len(text.encode()) / 1e6
        lines = text.splitlines(keepends=True)
        out = {"text_mb": mb, "load_start": os.getloadavg()[0], "tokenizers": {}}
        overhead = best_time(astrai_prep(tool, "bytes", text_path, os.path.join(root, "o")),
                             args.repeat)
        out["astrai_bytes_prep_s"] = overhead
        for kind in args.kinds.split(","):
            peer = Tokenizer.from_file(paths[kind])
            t_whole = best_time(lambda: peer.encode(text, add_special_tokens=False), args.repeat)
            t_lines = best_time(lambda: peer.encode_batch(lines, add_special_tokens=False),
                                args.repeat)
            t_peer = min(t_whole, t_lines)
            t_astrai = best_time(astrai_prep(tool, paths[kind], text_path,
                                             os.path.join(root, "o")), args.repeat)
            out["tokenizers"][kind] = {"astrai_mb_per_s": mb / t_astrai,
                                       "tokenizers_mb_per_s": mb / t_peer,
                                       "tokenizers_whole_mb_per_s": mb / t_whole,
                                       "tokenizers_lines_mb_per_s": mb / t_lines,
                                       "ratio": t_peer / t_astrai}
        out["load_end"] = os.getloadavg()[0]
        print(json.dumps(out, indent=2))
        print(f"{mb:.2f} MB of text; astrai's prep overhead (bytes tokenizer): "
              f"{overhead:.3f} s")
        for kind, r in out["tokenizers"].items():
            print(f"{kind:8s} astrai {r['astrai_mb_per_s']:6.2f} MB/s  tokenizers "
                  f"{r['tokenizers_whole_mb_per_s']:5.2f} (whole text) "
                  f"{r['tokenizers_lines_mb_per_s']:5.2f} (lines) MB/s  "
                  f"astrai/tokenizers {r['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
