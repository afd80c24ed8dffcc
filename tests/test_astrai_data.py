"""astrai-data prep/inspect against the bin format of docs/data.md, read back the
way AstrAI's load_bin reads it (numpy memmap with meta.json's dtype and shape),
DPO/GRPO record shards (prep --format dpo-jsonl|grpo-jsonl, inspect), and the C
sampler against tests/ref/sampler.py."""

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


def field_ids(field):
    """A record's text field as the bytes tokenizer reads it: a string, token ids, or a
    conversation list whose contents are joined (AstrAI's _extract_text)."""
    if isinstance(field, str):
        return list(field.encode())
    if field and isinstance(field[0], dict):
        return list("".join(m.get("content", "") for m in field).encode())
    return list(field)


def load_bin_like_astrai(shard_dir):
    """astrai/serialization/dataset.py load_bin, without torch."""
    with open(os.path.join(shard_dir, "meta.json")) as f:
        meta = json.load(f)
    return {
        key: np.memmap(os.path.join(shard_dir, f"{key}.bin"), dtype=info["dtype"], mode="r",
                       shape=tuple(info["shape"]))
        for key, info in meta.items() if isinstance(info, dict)
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


class JsonlCase(unittest.TestCase):
    """A temporary directory to write JSONL inputs into."""

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


class PrepSft(JsonlCase):
    RECORDS = [
        {"prompt": "Hi", "response": "Yo!"},
        None,  # a blank line, skipped
        {"prompt": [1, 2, 3], "response": [300, 4]},
        {"response": "x"},
        {"prompt": "only prompt", "response": ""},
        {"prompt": [{"role": "user", "content": "Q: "}, {"role": "x"}, {"content": "2+2"}],
         "response": "4"},
    ]


    ids = staticmethod(lambda field: field_ids(field))

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
        self.assertEqual(info["documents"], 5)
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
            (json.dumps({"response": 7}),
             '"response" must be a string, an array of token ids or a conversation list'),
            (json.dumps({"response": [{"content": "a"}, 5]}), '"response"[1] is not a message'),
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


class PrepRecords(JsonlCase):
    """DPO/GRPO records: the shards of docs/data.md, read back with numpy, and inspect."""

    DPO = [
        {"prompt": "Hello", "chosen": " world", "rejected": " there", "id": 1},
        {"input": [1, 2, 300], "chosen": [4], "rejected": [5, 6, 7]},
        {"prompt": [{"role": "user", "content": "Q?"}], "chosen": "yes",
         "rejected": [{"role": "assistant", "content": "n"}, {"content": "o"}]},
    ]
    GRPO = [
        {"prompt": "p%d" % r, "responses": ["a" * (r + 1), [r, 9], "bc"],
         "rewards": [r, -0.5 * r, 1e-3]}
        for r in range(5)
    ]


    def expect_bad(self, args, *needles, status=2):
        r = run(*args)
        self.assertEqual(r.returncode, status, r.stdout + r.stderr)
        for needle in needles:
            self.assertIn(needle, r.stderr)
        return r

    @staticmethod
    def expected(records, kind):
        """The shard keys of records: prompts and responses concatenated, their lengths."""
        prompt, prompt_len, response, response_len, reward = [], [], [], [], []
        for rec in records:
            p = field_ids(rec.get("prompt") or rec.get("input"))
            group = [rec["chosen"], rec["rejected"]] if kind == "dpo" else rec["responses"]
            prompt += p
            prompt_len.append(len(p))
            for field in group:
                ids = field_ids(field)
                response += ids
                response_len.append(len(ids))
            reward += rec.get("rewards", [])
        keys = {"prompt": prompt, "prompt_len": prompt_len, "response": response,
                "response_len": response_len}
        out = {k: np.array(v, dtype="<i4") for k, v in keys.items()}
        if kind == "grpo":
            out["reward"] = np.array(reward, dtype="<f4")
        return out

    def read_shards(self, out):
        shards = sorted(os.listdir(out))
        parts = [load_bin_like_astrai(os.path.join(out, s)) for s in shards]
        return shards, {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def test_dpo_byte_for_byte(self):
        src = self.write("dpo.jsonl", [json.dumps(r) for r in self.DPO])
        out = os.path.join(self.dir, "out")
        r = run("prep", "--out", out, "--format", "dpo-jsonl", src)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("wrote 3 dpo records (0 skipped) in 1 shard(s)", r.stdout)
        want = self.expected(self.DPO, "dpo")
        shard = os.path.join(out, "shard_0000")
        with open(os.path.join(shard, "meta.json")) as f:
            meta_text = f.read()
        meta = {"format": "dpo", "group_size": 2, "records": 3}
        meta.update({k: {"shape": [len(v)], "dtype": "int32"} for k, v in want.items()})
        self.assertEqual(meta_text, json.dumps(meta))
        for key, value in want.items():
            with open(os.path.join(shard, f"{key}.bin"), "rb") as f:
                self.assertEqual(f.read(), value.tobytes(), key)

        r = run("inspect", out, "--json", "--window_size", "4")
        self.assertEqual(r.returncode, 0, r.stderr)
        info = json.loads(r.stdout)
        rows = [(p, q) for p, q in zip(np.repeat(want["prompt_len"], 2), want["response_len"])]
        self.assertEqual((info["format"], info["group_size"], info["records"]), ("dpo", 2, 3))
        self.assertEqual(info["prompt_tokens"], len(want["prompt"]))
        self.assertEqual(info["response_tokens"], len(want["response"]))
        self.assertEqual((info["min_prompt_len"], info["max_prompt_len"]),
                         (want["prompt_len"].min(), want["prompt_len"].max()))
        self.assertEqual((info["min_response_len"], info["max_response_len"]),
                         (want["response_len"].min(), want["response_len"].max()))
        self.assertEqual(info["max_token_id"], 300)
        self.assertIsNone(info["min_reward"])
        self.assertEqual(info["rows"], 6)
        self.assertEqual(info["truncated_rows"], sum(p + q > 4 + 1 for p, q in rows))
        r = run("inspect", out)
        self.assertIn("format: dpo (group_size 2)\nrecords: 3\n", r.stdout)

    def test_grpo_shards_and_skips(self):
        lines = [json.dumps(r) for r in self.GRPO]
        bad = json.dumps({"prompt": "p", "responses": ["a", "b"], "rewards": [1, 2]})
        lines.insert(2, bad)
        src = self.write("grpo.jsonl", lines)
        out = os.path.join(self.dir, "out")
        args = ["prep", "--out", out, "--format=grpo-jsonl", "--group_size", "3", src]
        self.expect_bad(args, f"{src}:3: ", '"responses" has 2 elements, not group_size 3')
        self.assertFalse(os.path.exists(out) and os.listdir(out), "nothing written")

        r = run(*args, "--skip_bad_records", "--shard_records", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("wrote 5 grpo records (1 skipped) in 3 shard(s)", r.stdout)
        self.assertIn(f"skipped 1 bad record(s); the first: {src}:3: ", r.stderr)
        shards, got = self.read_shards(out)
        self.assertEqual(shards, ["shard_0000", "shard_0001", "shard_0002"])
        want = self.expected(self.GRPO, "grpo")
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, key)
        with open(os.path.join(out, "shard_0002", "meta.json")) as f:
            meta = json.load(f)
        self.assertEqual((meta["format"], meta["group_size"], meta["records"]), ("grpo", 3, 1))
        self.assertEqual(meta["reward"], {"shape": [3], "dtype": "float32"})

        info = json.loads(run("inspect", out, "--json").stdout)
        self.assertEqual((info["shards"], info["records"], info["group_size"]), (3, 5, 3))
        self.assertAlmostEqual(info["min_reward"], float(want["reward"].min()))
        self.assertAlmostEqual(info["max_reward"], float(want["reward"].max()))
        self.assertNotIn("window_size", info)
        self.expect_bad(["inspect", out, "--window_size", "4", "--stride", "2"],
                        "--stride applies to token datasets")

    def test_bad_records_and_flags(self):
        good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
        cases = [
            ("{\"prompt\": ", "malformed JSON"),
            (json.dumps({"prompt": "p", "chosen": "c"}), 'key "rejected" missing'),
            (json.dumps({"prompt": "", "chosen": "c", "rejected": "r"}), '"prompt" is empty'),
            (json.dumps({"prompt": "p", "chosen": "", "rejected": "r"}), '"chosen" is empty'),
            (json.dumps({"prompt": [-1], "chosen": "c", "rejected": "r"}),
             '"prompt"[0] is not a token id'),
            (json.dumps({"prompt": "p", "chosen": [200], "rejected": "r"}),
             '"chosen"[0]: token id 200 is outside the vocabulary [0, 150)'),
        ]
        for i, (bad, message) in enumerate(cases):
            src = self.write(f"bad{i}.jsonl", [good, "", bad, good])
            out = os.path.join(self.dir, f"out{i}")
            args = ["prep", "--out", out, "--format", "dpo-jsonl", "--vocab_size", "150", src]
            self.expect_bad(args, f"{src}:3: ", message)
            self.assertFalse(os.path.exists(out) and os.listdir(out), "nothing written")
            r = run(*args, "--skip_bad_records")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("wrote 2 dpo records (1 skipped)", r.stdout)

        grpo = self.write("g.jsonl", [json.dumps(self.GRPO[0])])
        dpo = self.write("d.jsonl", [good])
        out = os.path.join(self.dir, "flags")
        self.expect_bad(["prep", "--out", out, "--format", "grpo-jsonl", grpo],
                        '"responses" has 3 elements, not group_size 4')  # the default G
        self.expect_bad(["prep", "--out", out, "--format", "grpo-jsonl", "--group_size", "0",
                         grpo], "--group_size")
        self.expect_bad(["prep", "--out", out, "--format", "dpo-jsonl", "--group_size", "2", dpo],
                        "--group_size applies to --format grpo-jsonl")
        self.expect_bad(["prep", "--out", out, "--format", "dpo-jsonl", "--shard_tokens", "9",
                         dpo], "--shard_tokens applies to --format text or sft-jsonl")
        self.expect_bad(["prep", "--out", out, "--shard_records", "9", dpo],
                        "--shard_records applies to --format dpo-jsonl or grpo-jsonl")
        self.expect_bad(["prep", "--out", out, "--format", "sft-jsonl", "--skip_bad_records",
                         dpo], "--skip_bad_records applies")
        self.expect_bad(["prep", "--out", out, "--format", "dpo-jsonl", "--vocab_size", "x",
                         dpo], "--vocab_size")
        empty = self.write("e.jsonl", ["{}"])
        self.expect_bad(["prep", "--out", out, "--format", "dpo-jsonl", "--skip_bad_records",
                         empty], "no records (1 bad ones skipped)")
        self.assertFalse(os.path.exists(out))

    def test_write_failure_exits_1(self):
        # --out is accepted (an empty directory) but its shard paths exceed PATH_MAX (the
        # message, which names the path, is cut at its 1 KiB limit).
        out = self.dir
        while len(out) < 4080:
            out = os.path.join(out, "d" * min(200, 4080 - len(out)))
            os.mkdir(out)
        src = self.write("d.jsonl", [json.dumps(self.DPO[0])])
        self.expect_bad(["prep", "--out", out, "--format", "dpo-jsonl", src], "astrai-data: ",
                        status=1)
        self.assertEqual(os.listdir(out), [])


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
