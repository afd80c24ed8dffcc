"""astrai-data prep/inspect against the bin format of docs/data.md, read back the
way AstrAI's load_bin reads it (numpy memmap with meta.json's dtype and shape),
and the C sampler against tests/ref/sampler.py."""

import json
import os
import subprocess
import tempfile
import unittest

import numpy as np

from ref import sampler as ref_sampler

BUILD = os.environ["ASTRAI_BUILD"]
TOOL = os.path.join(BUILD, "astrai-data")
SAMPLER = os.path.join(BUILD, "test_sampler")
KEYS_SFT = ["sequence", "loss_mask", "position_ids"]


def run(*args):
    return subprocess.run([TOOL, *args], capture_output=True, text=True, timeout=60)


def load_bin_like_astrai(shard_dir):
    """astrai/serialization/dataset.py load_bin, without torch."""
    with open(os.path.join(shard_dir, "meta.json")) as f:
        meta = json.load(f)
    return {
        key: np.memmap(os.path.join(shard_dir, f"{key}.bin"), dtype=info["dtype"], mode="r",
                       shape=tuple(info["shape"]))
        for key, info in meta.items()
    }


class PrepText(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.texts = [b"hello, world\n", bytes(range(256)), "na\u00efve \u2603".encode()]
        self.files = []
        for i, data in enumerate(self.texts):
            path = os.path.join(self.dir, f"in{i}.txt")
            with open(path, "wb") as f:
                f.write(data)
            self.files.append(path)
        # bytes tokenizer: token id = byte value; files concatenated in order
        self.expected = np.frombuffer(b"".join(self.texts), dtype=np.uint8).astype("<i4")

    def tearDown(self):
        self.tmp.cleanup()

    def test_one_shard_byte_for_byte(self):
        out = os.path.join(self.dir, "out")
        r = run("prep", "--out", out, "--format", "text", "--tokenizer", "bytes", *self.files)
        self.assertEqual(r.returncode, 0, r.stderr)
        shard = os.path.join(out, "shard_0000")
        self.assertEqual(sorted(os.listdir(out)), ["shard_0000"])
        self.assertEqual(sorted(os.listdir(shard)), ["meta.json", "sequence.bin"])
        with open(os.path.join(shard, "meta.json")) as f:
            meta_text = f.read()
        n = len(self.expected)
        self.assertEqual(meta_text, json.dumps({"sequence": {"shape": [n], "dtype": "int32"}}))
        with open(os.path.join(shard, "sequence.bin"), "rb") as f:
            self.assertEqual(f.read(), self.expected.tobytes())
        np.testing.assert_array_equal(load_bin_like_astrai(shard)["sequence"], self.expected)

        r = run("inspect", out, "--json", "--window_size", "16", "--stride", "5")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = json.loads(r.stdout)
        self.assertEqual(info["shards"], 1)
        self.assertEqual(info["keys"], ["sequence"])
        self.assertEqual(info["tokens"], n)
        self.assertEqual(info["min_token_id"], int(self.expected.min()))
        self.assertEqual(info["max_token_id"], int(self.expected.max()))
        self.assertIsNone(info["documents"])
        self.assertIsNone(info["loss_fraction"])
        self.assertEqual(info["windows"], len(range(0, n - 1 - 16 + 1, 5)))

        r = run("inspect", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"tokens: {n}\n", r.stdout)

    def test_shard_tokens_splits_the_stream(self):
        out = os.path.join(self.dir, "split")
        r = run("prep", f"--out={out}", "--shard_tokens=100", *self.files)
        self.assertEqual(r.returncode, 0, r.stderr)
        n = len(self.expected)
        shards = sorted(os.listdir(out))
        self.assertEqual(shards, [f"shard_{i:04d}" for i in range((n + 99) // 100)])
        parts = [load_bin_like_astrai(os.path.join(out, s))["sequence"] for s in shards]
        self.assertTrue(all(len(p) == 100 for p in parts[:-1]))
        np.testing.assert_array_equal(np.concatenate(parts), self.expected)
        info = json.loads(run("inspect", out, "--json").stdout)
        self.assertEqual((info["shards"], info["tokens"]), (len(shards), n))


class PrepSft(unittest.TestCase):
    RECORDS = [
        {"prompt": "Hi", "response": "Yo!"},
        None,  # a blank line, skipped
        {"prompt": [1, 2, 3], "response": [300, 4]},
        {"response": "x"},
        {"prompt": "only prompt", "response": ""},
    ]

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, lines):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    @staticmethod
    def ids(field):
        return list(field.encode()) if isinstance(field, str) else list(field)

    def expected(self):
        seq, mask, pos = [], [], []
        for rec in self.RECORDS:
            if rec is None:
                continue
            prompt, response = self.ids(rec.get("prompt", [])), self.ids(rec["response"])
            seq += prompt + response
            mask += [0] * len(prompt) + [1] * len(response)  # loss on the response
            pos += list(range(len(prompt) + len(response)))  # restarts per record
        return {k: np.array(v, dtype="<i4") for k, v in zip(KEYS_SFT, (seq, mask, pos))}

    def test_sft_byte_for_byte(self):
        lines = ["   " if r is None else json.dumps(r) for r in self.RECORDS]
        src = self.write("sft.jsonl", lines)
        out = os.path.join(self.dir, "out")
        r = run("prep", "--out", out, "--format", "sft-jsonl", src)
        self.assertEqual(r.returncode, 0, r.stderr)
        shard = os.path.join(out, "shard_0000")
        want = self.expected()
        n = len(want["sequence"])
        with open(os.path.join(shard, "meta.json")) as f:
            meta_text = f.read()
        meta = {k: {"shape": [n], "dtype": "int32"} for k in KEYS_SFT}
        self.assertEqual(meta_text, json.dumps(meta))
        for key in KEYS_SFT:
            with open(os.path.join(shard, f"{key}.bin"), "rb") as f:
                self.assertEqual(f.read(), want[key].tobytes(), key)

        r = run("inspect", out, "--json", "--window_size", "4")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = json.loads(r.stdout)
        self.assertEqual(info["keys"], KEYS_SFT)
        self.assertEqual(info["tokens"], n)
        self.assertEqual(info["documents"], 4)
        self.assertEqual(info["loss_tokens"], int(want["loss_mask"].sum()))
        self.assertAlmostEqual(info["loss_fraction"], want["loss_mask"].mean())
        self.assertEqual(info["max_token_id"], 300)
        self.assertEqual(info["windows"], (n - 1 - 4) // 4 + 1)

    def expect_bad(self, args, *needles):
        r = run(*args)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        for needle in needles:
            self.assertIn(needle, r.stderr)
        return r

    def test_bad_lines_name_file_and_line(self):
        good = json.dumps({"prompt": "a", "response": "b"})
        cases = [
            ("{\"prompt\": \"a\", ", "malformed JSON"),
            (good + " trailing", "malformed JSON"),
            (json.dumps({"prompt": "a", "respons": "b"}), 'unknown key "respons"'),
            (json.dumps({"prompt": "a"}), 'key "response" missing'),
            (json.dumps({"response": [1, -1]}), '"response"[1] is not a token id'),
            (json.dumps({"response": [1.5]}), '"response"[0] is not a token id'),
            (json.dumps({"response": 7}), '"response" must be a string or an array'),
            (json.dumps({"response": "", "prompt": []}), "no tokens"),
            ("[1, 2]", "must be a JSON object"),
        ]
        for i, (bad, message) in enumerate(cases):
            src = self.write(f"bad{i}.jsonl", [good, "", bad, good])
            out = os.path.join(self.dir, f"out{i}")
            self.expect_bad(["prep", "--out", out, "--format", "sft-jsonl", src],
                            f"{src}:3: ", message)
            self.assertFalse(os.path.exists(out) and os.listdir(out), "nothing written")

    def test_bad_invocations(self):
        src = self.write("ok.jsonl", [json.dumps({"response": "b"})])
        out = os.path.join(self.dir, "out")
        missing = os.path.join(self.dir, "missing.txt")
        self.expect_bad(["prep", "--out", out, missing], missing)
        self.expect_bad(["prep", "--out", out, "--tokenizer", "gpt2", src],
                        "unknown tokenizer 'gpt2'")
        self.expect_bad(["prep", "--out", out, "--format", "csv", src], "'csv'")
        self.expect_bad(["prep", src], "--out")
        self.expect_bad(["prep", "--out", out], "no input FILE")
        self.expect_bad(["prep", "--out", out, "--shard_tokens", "-3", src], "--shard_tokens")
        self.expect_bad(["prep", "--out", out, "--bogus", src], "--bogus")
        self.expect_bad(["prep", "--out"], "--out needs a value")
        self.assertEqual(run("prep", "--out", out, src).returncode, 0)
        self.expect_bad(["prep", "--out", out, src], "not empty")
        empty = os.path.join(self.dir, "empty")
        os.mkdir(empty)
        self.expect_bad(["inspect", empty], empty, "no meta.json")
        self.expect_bad(["inspect", out, "--window_size", "0"], "--window_size")
        self.expect_bad(["frobnicate"], "unknown command 'frobnicate'")
        r = run("--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("usage: astrai-data prep", r.stdout)


class SamplerMatchesReference(unittest.TestCase):
    def c_output(self, *args):
        r = subprocess.run([SAMPLER, *map(str, args)], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        return [int(x) for x in r.stdout.split()]

    def test_splitmix64_reference_values(self):
        # Published outputs of Vigna's splitmix64.c for the seed 0.
        rng = ref_sampler.SplitMix64(0)
        self.assertEqual(rng.next(), 0xE220A8397B1DCDAF)
        self.assertEqual(rng.next(), 0x6E789E6AA1B965F4)

    def test_permutations(self):
        for n, seed in [(1, 0), (2, 5), (17, 42), (1000, 43), (5, 2**64 - 1)]:
            for shuffle in (0, 1):
                self.assertEqual(self.c_output("perm", n, seed, shuffle),
                                 ref_sampler.permutation(n, seed, bool(shuffle)), (n, seed))

    def test_rank_orders(self):
        for n, world, seed, epoch, shuffle in [(10, 4, 42, 3, 1), (37, 3, 7, 0, 1),
                                               (8, 8, 1, 2, 1), (9, 2, 0, 1, 0)]:
            orders = []
            for rank in range(world):
                got = self.c_output("order", n, world, rank, seed, epoch, shuffle)
                self.assertEqual(got, ref_sampler.rank_order(n, world, rank, seed, epoch,
                                                             bool(shuffle)))
                orders.append(got)
            self.assertEqual(set(sum(orders, [])), set(range(n)))


if __name__ == "__main__":
    unittest.main()
