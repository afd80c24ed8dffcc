"""astrai-data's tokenizer.json tokenizers against Hugging Face tokenizers (the real peer):
tokenizers trains five tokenizers of the families' shapes on the license texts of
/usr/share/common-licenses, and on a held-out text of about 1 MB (unseen license text mixed
with Unicode letters, emoji with ZWJ sequences, CJK, combining marks, whitespace runs,
numbers and the special tokens inline) astrai-data prep's ids must equal
Tokenizer.encode(text, add_special_tokens=False).ids and astrai-data decode must equal
Tokenizer.decode. Then malformed and unsupported tokenizer.json files exit 2 naming the file
and the key."""

import json
import os
import random
import re
import subprocess
import tempfile
import unittest

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

BUILD = os.environ["ASTRAI_BUILD"]
TOOL = os.path.join(BUILD, "astrai-data")
LICENSES = "/usr/share/common-licenses"
TRAIN = ["GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "Artistic", "MPL-2.0"]
HELD_OUT = ["GFDL-1.3", "LGPL-3", "MPL-1.1", "GFDL-1.2", "CC0-1.0", "BSD"]
SANITIZED = os.environ.get("ASTRAI_SANITIZED", "0") not in ("0", "", "FALSE", "OFF")
TEXT_BYTES = 200_000 if SANITIZED else 1_000_000

GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Pieces the held-out text is made of, besides license words.
UNICODE_BITS = [
    "naïve café", "Grüße aus Köln", "ÅNGSTRÖM", "İstanbul ılık", "ſtraße", "Ωμέγα λόγος",
    "Привет, мир", "Ünïcödé", "日本語のテキスト", "中文字符和标点，。", "한국어 문장",
    "العربية", "हिन्दी", "ไทย", "e\u0301cole", "a\u0308\u0301", "\u212b", "n\u0303o", "\u0301", "\u0327\u0308",
    "\u1100\u1161\u11a8",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇩🇪🇫🇷", "🧑🏿‍🚀", "\u200b", "\u200d",
    "\u00a0", "\u3000", "\u2028", "\u0085", "\u180e", "\u1680", "\u000b\u000c", "\u2009thin", "\ufeff", "x\u0000y", "Ⅻ ½ ٣",
    "１２３", "1234567", "3.14159", "2026-12-02", "0x1F", "$100,000", "...", "—", "«»", "“”",
    "It's", "WE'LL", "they'Re", "I'M", "don't", "'d", "#include <stdio.h>", "a\tb\t\tc",
    "  ", "    ", "\n", "\n\n", "\r\n", " \n ", "\t\n", "\n   \n", "line   ",
]


def read_license(name):
    with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
        return f.read()


def held_out_text(specials, size):
    """A deterministic mix of unseen license text, Unicode, whitespace, numbers and the
    special tokens, of about `size` characters."""
    rng = random.Random(1234)
    words = " ".join(read_license(n) for n in HELD_OUT).split(" ")
    out, total = [], 0
    while total < size:
        r = rng.random()
        if r < 0.55:
            i = rng.randrange(len(words))
            piece = " ".join(words[i:i + rng.randrange(1, 30)])
        elif r < 0.85:
            piece = rng.choice(UNICODE_BITS)
        elif r < 0.93:
            piece = rng.choice(specials)
        else:
            piece = rng.choice([" ", "  ", "\n", "\t", " \t ", "\n\n"]) * rng.randrange(1, 5)
        out.append(piece + rng.choice(["", " ", " ", "\n", ""]))
        total += len(out[-1])
    return "".join(out)


def bpe_trainer(vocab, specials, **kw):
    return trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                               **kw)


def byte_level_tokenizer(split, specials, ignore_merges=False, normalizer=None):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer:
        tok.normalizer = normalizer
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = bpe_trainer(3000, specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return tok, trainer


def metaspace_tokenizer(specials):
    """Llama 2 / Mistral: Metaspace, BPE with byte fallback (the <0xXX> tokens in the vocab,
    not added tokens), the Replace/ByteFallback/Fuse/Strip decoder."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = bpe_trainer(3000, specials + byte_tokens, limit_alphabet=120)
    return tok, trainer, byte_tokens


def drop_added(path, contents):
    """Removes tokens from tokenizer.json's added_tokens (they stay in the vocabulary)."""
    with open(path) as f:
        j = json.load(f)
    j["added_tokens"] = [t for t in j["added_tokens"] if t["content"] not in contents]
    with open(path, "w") as f:
        json.dump(j, f, ensure_ascii=False)


def edit_json(src, dst, fn):
    with open(src) as f:
        j = json.load(f)
    fn(j)
    with open(dst, "w") as f:
        json.dump(j, f, ensure_ascii=False)


def run(*args, stdin=None):
    return subprocess.run([TOOL, *args], capture_output=True, timeout=300, input=stdin)


def read_sequence(out_dir):
    shard = os.path.join(out_dir, "shard_0000")
    with open(os.path.join(shard, "meta.json")) as f:
        meta = json.load(f)
    assert meta["sequence"]["dtype"] == "int32", meta
    return np.fromfile(os.path.join(shard, "sequence.bin"), dtype="<i4").tolist()


def first_difference(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n if len(a) != len(b) else -1)


class HfTokenizers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = cls.tmp.name
        cls.train_files = [os.path.join(LICENSES, n) for n in TRAIN]
        cls.specials = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
                        "<|eot_id|>"]
        text = held_out_text(cls.specials + ["hello world", "café", " <mask> "], TEXT_BYTES)
        cls.text = text
        cls.text_path = os.path.join(cls.dir, "held_out.txt")
        with open(cls.text_path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"held-out text: {len(text.encode())} bytes, {len(text)} characters")
        cls.tokenizers = cls.build_all()

    @classmethod
    def save(cls, name, tok, specials, extra=()):
        d = os.path.join(cls.dir, name)
        os.makedirs(d)
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        tok.add_tokens(list(extra))
        path = os.path.join(d, "tokenizer.json")
        tok.save(path)
        return path

    @classmethod
    def build_all(cls):
        built = {}
        sp = cls.specials
        # (a) GPT-2: byte-level BPE with ByteLevel's own regex
        tok, tr = byte_level_tokenizer(None, sp[:1])
        tok.train(cls.train_files, tr)
        built["gpt2"] = cls.save("gpt2", tok, sp[:1], ["hello world",
                                 AddedToken("<mask>", lstrip=True, rstrip=True, special=True)])
        # (b) Llama 3: Split(llama3 regex) + ByteLevel(use_regex=False), ignore_merges
        tok, tr = byte_level_tokenizer(LLAMA3_SPLIT, ["<|eot_id|>"], ignore_merges=True)
        tok.train(cls.train_files, tr)
        built["llama3"] = cls.save("llama3", tok, ["<|eot_id|>", "<s>", "</s>"], ["hello world"])
        # (c) Qwen2: NFC + Split(qwen2 regex) + ByteLevel(use_regex=False)
        tok, tr = byte_level_tokenizer(QWEN2_SPLIT, ["<|endoftext|>"],
                                       normalizer=normalizers.NFC())
        tok.train(cls.train_files, tr)
        built["qwen2"] = cls.save("qwen2", tok, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  ["hello world", "café"])
        # (d) Mistral: Metaspace(first) + byte fallback
        tok, tr, byte_tokens = metaspace_tokenizer(["<unk>", "<s>", "</s>"])
        tok.train(cls.train_files, tr)
        built["mistral"] = cls.save("mistral", tok, ["<unk>", "<s>", "</s>"], ["hello world"])
        drop_added(built["mistral"], set(byte_tokens))
        # (e) Llama 2 (legacy): the same model behind Prepend + Replace and no pre-tokenizer
        d = os.path.join(cls.dir, "llama2")
        os.makedirs(d)
        built["llama2"] = os.path.join(d, "tokenizer.json")

        def legacy(j):
            j["normalizer"] = {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
            j["pre_tokenizer"] = None
        edit_json(built["mistral"], built["llama2"], legacy)
        return built

    def check_tokenizer(self, name, round_trip):
        path = self.tokenizers[name]
        peer = Tokenizer.from_file(path)
        want = peer.encode(self.text, add_special_tokens=False).ids
        out = os.path.join(self.dir, f"out_{name}")
        spec = path if name != "qwen2" else os.path.dirname(path)  # both forms of PATH
        r = run("prep", "--out", out, "--tokenizer", spec, self.text_path)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        got = read_sequence(out)
        at = first_difference(got, want)
        if at >= 0:
            lo = max(0, at - 8)
            self.fail(f"{name}: ids differ at {at} of {len(want)}: astrai {got[lo:at + 8]} "
                      f"tokenizers {want[lo:at + 8]}\n  astrai: "
                      f"{[peer.id_to_token(i) for i in got[lo:at + 8]]}\n  tokenizers: "
                      f"{[peer.id_to_token(i) for i in want[lo:at + 8]]}")
        print(f"{name}: {len(want)} ids equal to tokenizers' "
              f"(vocab {peer.get_vocab_size(with_added_tokens=True)})")
        for skip in (False, True):
            args = ["decode", "--tokenizer", spec, "--dataset", out]
            r = run(*args + (["--skip_special_tokens"] if skip else []))
            self.assertEqual(r.returncode, 0, r.stderr.decode())
            decoded = r.stdout.decode("utf-8")
            expect = peer.decode(want, skip_special_tokens=skip)
            self.assertTrue(decoded == expect, f"{name}: decode (skip_special_tokens={skip}) "
                            f"differs at character {first_difference(decoded, expect)}")
        if round_trip:
            self.assertEqual(peer.decode(want, skip_special_tokens=False), round_trip(self.text))
        print(f"{name}: decode equal to tokenizers' (with and without special tokens)"
              f"{', round trip as expected' if round_trip else ''}")

    def test_gpt2(self):  # the round trip loses the spaces <mask> (lstrip, rstrip) takes
        self.check_tokenizer("gpt2", lambda t: re.sub(r"\s*<mask>\s*", "<mask>", t))

    def test_llama3(self):
        self.check_tokenizer("llama3", lambda t: t)

    def test_qwen2(self):  # no exact round trip: ByteLevel decodes the added "café" to U+FFFD
        self.check_tokenizer("qwen2", None)

    def test_mistral(self):
        self.check_tokenizer("mistral", None)

    def test_llama2(self):
        self.check_tokenizer("llama2", None)

    def check_variant(self, base, name, edit, text):
        """The tokenizer `base` with its JSON changed by edit, on text: ids and decode."""
        path = os.path.join(self.dir, f"variant_{name}.json")
        edit_json(self.tokenizers[base], path, edit)
        text_path = os.path.join(self.dir, "variant.txt")
        with open(text_path, "w", encoding="utf-8") as f:
            f.write(text)
        peer = Tokenizer.from_file(path)
        want = peer.encode(text, add_special_tokens=False).ids
        out = os.path.join(self.dir, f"out_variant_{name}")
        r = run("prep", "--out", out, "--tokenizer", path, text_path)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        got = read_sequence(out)
        at = first_difference(got, want)
        self.assertEqual(at, -1, f"{name}: ids differ at {at}: astrai {got[max(0, at - 5):at + 5]} "
                         f"tokenizers {want[max(0, at - 5):at + 5]}")
        r = run("decode", "--tokenizer", path, "--dataset", out)
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        self.assertTrue(r.stdout.decode() == peer.decode(want, skip_special_tokens=False),
                        f"{name}: decode differs")
        return len(want)

    def test_components(self):
        """Each pre-tokenizer, normalizer, decoder and BPE option the families do not all use,
        on the GPT-2 or Mistral tokenizer, against tokenizers on the first 100 kB."""
        text = self.text[:100_000]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": False}

        def pre(*steps):
            return lambda j: j.update(pre_tokenizer={"type": "Sequence",
                                                     "pretokenizers": [*steps, byte_level]})

        def norm(*steps):
            return lambda j: j.update(normalizer={"type": "Sequence", "normalizers": list(steps)})

        variants = []
        for behavior in ["Isolated", "Removed", "MergedWithPrevious", "MergedWithNext",
                         "Contiguous"]:
            for invert in (False, True):
                for pattern in ({"String": " "}, {"Regex": r"\s+|[,.]"}):
                    kind = "str" if "String" in pattern else "re"
                    variants.append((f"split_{behavior}_{invert}_{kind}", "gpt2", pre(
                        {"type": "Split", "pattern": pattern, "behavior": behavior,
                         "invert": invert})))
        variants.append(("split_word_classes", "gpt2", pre(  # \w, \W, \s, \S as onig's
            {"type": "Split", "pattern": {"Regex": r"\w+|[^\w\s]+|\W\S|\s+"},
             "behavior": "Isolated", "invert": False})))
        for individual in (False, True):
            variants.append((f"digits_{individual}", "gpt2", pre(
                {"type": "Digits", "individual_digits": individual})))
        for scheme in ("always", "never", "first"):
            for split in (False, True):
                variants.append((f"metaspace_{scheme}_{split}", "gpt2", pre(
                    {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme,
                     "split": split})))
        variants += [
            ("prefix_space", "gpt2", lambda j: j["pre_tokenizer"].update(add_prefix_space=True)),
            ("lowercase", "gpt2", norm({"type": "Lowercase"})),
            ("strip", "gpt2", norm({"type": "Strip", "strip_left": True, "strip_right": True})),
            ("nfkc", "gpt2", norm({"type": "NFKC"})),
            ("nfd_nfkd", "gpt2", norm({"type": "NFD"}, {"type": "NFKD"})),
            ("replace_regex", "gpt2", norm({"type": "Replace", "pattern": {"Regex": r"\d+"},
                                            "content": "#"})),
            ("prepend", "gpt2", norm({"type": "Prepend", "prepend": "\u0120"})),
            ("no_byte_fallback", "mistral", lambda j: j["model"].update(byte_fallback=False)),
            ("no_fuse_unk", "mistral", lambda j: j["model"].update(byte_fallback=False,
                                                                    fuse_unk=False)),
            ("metaspace_decoder", "mistral", lambda j: j.update(decoder={
                "type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                "split": True})),
            ("strip_decoder", "mistral", lambda j: j.update(decoder={
                "type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, {
                    "type": "Strip", "content": "\u2581", "start": 2, "stop": 1}]})),
            ("no_decoder", "mistral", lambda j: j.update(decoder=None)),
            ("ignore_merges", "gpt2", lambda j: j["model"].update(ignore_merges=True)),
            ("string_merges", "gpt2", lambda j: j["model"].update(  # "a b", not ["a", "b"]
                merges=[" ".join(m) for m in j["model"]["merges"]])),
        ]
        for name, base, edit in variants:
            n = self.check_variant(base, name, edit, text)
            print(f"{name}: {n} ids and decode equal to tokenizers'")

    def test_affixes(self):
        """continuing_subword_prefix and end_of_word_suffix (BPE trained with them)."""
        tok = Tokenizer(models.BPE(continuing_subword_prefix="##", end_of_word_suffix="</w>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train(self.train_files, trainers.BpeTrainer(
            vocab_size=2000, continuing_subword_prefix="##", end_of_word_suffix="</w>",
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        path = os.path.join(self.dir, "affixes", "tokenizer.json")
        os.makedirs(os.path.dirname(path))
        tok.save(path)
        self.tokenizers["affixes"] = path
        n = self.check_variant("affixes", "affixes", lambda j: None, self.text[:100_000])
        print(f"affixes: {n} ids equal to tokenizers'")

    def test_long_runs(self):
        """Long runs (one pre-token of 100k spaces or letters, whitespace and newline runs,
        digits, U+180E) with each tokenizer: the regexes and the merging of long words."""
        k = 20_000 if SANITIZED else 100_000
        runs = " " * k + "x" + "ab" * k + " \t" * k + "\n" * 1000 + "!" * k + "1" * k + \
            "\u180e " * 1000 + "e\u0301" * 1000 + "\r\n" * k + "a\n \n" * 1000
        for name in ["gpt2", "llama3", "qwen2", "mistral", "llama2"]:
            n = self.check_variant(name, f"runs_{name}", lambda j: None, runs)
            print(f"long runs, {name}: {n} ids equal to tokenizers'")

    def test_decode_ids_from_stdin(self):
        peer = Tokenizer.from_file(self.tokenizers["gpt2"])
        text = "Hello <|endoftext|> wörld 👨‍👩‍👧‍👦 hello world"
        ids = peer.encode(text, add_special_tokens=False).ids
        r = run("decode", "--tokenizer", self.tokenizers["gpt2"], "-",
                stdin=" ".join(map(str, ids)).encode())
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        self.assertEqual(r.stdout.decode(), text)
        r = run("decode", "--tokenizer", self.tokenizers["gpt2"], "-", stdin=b"1 999999")
        self.assertEqual(r.returncode, 2)
        self.assertIn(b"999999", r.stderr)

    def expect_bad(self, path, *needles, text_path=None):
        out = os.path.join(self.dir, "bad_out")
        r = run("prep", "--out", out, "--tokenizer", path, text_path or self.text_path)
        err = r.stderr.decode()
        self.assertEqual(r.returncode, 2, err)
        for n in needles:
            self.assertIn(n, err)
        self.assertFalse(os.path.exists(out))
        print(f"refused: {err.strip()}")

    def test_bad_files(self):
        src = self.tokenizers["gpt2"]
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as f:
            f.write('{"model": {"type": "BPE", "vocab": {')
        self.expect_bad(bad, bad, "not valid JSON")
        missing = os.path.join(self.dir, "missing", "tokenizer.json")
        self.expect_bad(missing, missing)
        cases = [
            (lambda j: j["pre_tokenizer"].update(type="BertPreTokenizer"),
             "pre_tokenizer type 'BertPreTokenizer' is not supported"),
            (lambda j: j.update(normalizer={"type": "BertNormalizer"}),
             "normalizer type 'BertNormalizer' is not supported"),
            (lambda j: j.update(decoder={"type": "WordPiece", "prefix": "##"}),
             "decoder type 'WordPiece' is not supported"),
            (lambda j: j["model"].update(type="Unigram"), "model type 'Unigram' is not supported"),
            (lambda j: j["model"]["merges"].insert(3, ["zzq\u00e9", "qz"]),
             "model.merges[3]: 'zzq\u00e9' is not in model.vocab"),
            (lambda j: j["model"]["merges"].insert(0, "nospace"), "model.merges[0]"),
            (lambda j: j["model"]["merges"].insert(5, ["a", "b", "c"]), "model.merges[5]"),
            (lambda j: j["model"].update(dropout=0.1), "model.dropout"),
            (lambda j: j["model"]["vocab"].update(a="x"), 'model.vocab["a"]'),
            (lambda j: j.pop("model"), "model: missing"),
            (lambda j: j["model"].update(merges={}), "model.merges"),
            (lambda j: j["pre_tokenizer"].update(add_prefix_space="yes"),
             "pre_tokenizer.add_prefix_space"),
            (lambda j: j["added_tokens"][0].pop("content"), "added_tokens[0].content"),
        ]
        for i, (fn, needle) in enumerate(cases):
            path = os.path.join(self.dir, f"bad{i}.json")
            edit_json(src, path, fn)
            self.expect_bad(path, path, needle)
        # one id for two tokens: refused naming both (decoding could give back only one)
        dup = os.path.join(self.dir, "bad_dup.json")
        edit_json(src, dup, lambda j: j["model"]["vocab"].update(zzdup=j["model"]["vocab"]["a"]))
        self.expect_bad(dup, dup, 'tokens "a" and "zzdup" both have id')
        split = os.path.join(self.dir, "bad_split.json")
        edit_json(self.tokenizers["llama3"], split, lambda j: j["pre_tokenizer"]["pretokenizers"][0]
                  .update(pattern={"Regex": "(unclosed"}))
        self.expect_bad(split, split, "pre_tokenizer.pretokenizers[0].pattern")
        not_utf8 = os.path.join(self.dir, "latin1.txt")
        with open(not_utf8, "wb") as f:
            f.write(b"caf\xe9\n")
        self.expect_bad(src, not_utf8, "not UTF-8", text_path=not_utf8)


if __name__ == "__main__":
    unittest.main(verbosity=2)
