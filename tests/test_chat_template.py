"""Chat templates (data/chat_template.h) against transformers' apply_chat_template: the
Llama 3 / 3.1, Mistral v0.1-v0.3 and Qwen2 / 2.5 templates of tests/data/chat_templates and
small templates for each construct of the subset render byte for byte as transformers renders
them (the chat_render helper); templates that raise fail with their message; constructs
outside the subset are refused naming them; the assistant spans follow docs/data.md's rule;
and astrai-data prep --format sft-jsonl turns conversations into sequence/loss_mask/
position_ids equal to the per-segment encodes of `tokenizers`, the masked tokens decoding to
the assistant replies and their end-of-turn markers."""

import json
import os
import random
import subprocess
import tempfile
import time
import unittest

import numpy as np
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BUILD = os.environ["ASTRAI_BUILD"]
SRC = os.environ["ASTRAI_SRC"]
RENDER = os.path.join(BUILD, "chat_render")
TOOL = os.path.join(BUILD, "astrai-data")
TEMPLATES = os.path.join(SRC, "tests", "data", "chat_templates")
CORPUS = "/usr/share/common-licenses/GPL-3"

# family -> (template file, bos, eos, the text of an assistant reply's span given its content)
FAMILIES = {
    "llama3": ("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>", lambda c: c.strip() + "<|eot_id|>"),
    "llama3.1": ("llama3.1.jinja", "<|begin_of_text|>", "<|eot_id|>",
                 lambda c: c.strip() + "<|eot_id|>"),
    "mistral-v0.1": ("mistral-v0.1.jinja", "<s>", "</s>", lambda c: c + "</s> "),
    "mistral-v0.2": ("mistral-v0.2.jinja", "<s>", "</s>", lambda c: " " + c + "</s>"),
    "mistral-v0.3": ("mistral-v0.3.jinja", "<s>", "</s>", lambda c: " " + c.strip() + "</s>"),
    "qwen2": ("qwen2.jinja", None, "<|im_end|>", lambda c: c + "<|im_end|>\n"),
    "qwen2.5": ("qwen2.5.jinja", None, "<|im_end|>", lambda c: c + "<|im_end|>\n"),
}


def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = {
    "user only": [msg("user", "Hello there")],
    "system user assistant": [msg("system", "You are terse."), msg("user", "Hi"),
                              msg("assistant", "Hello.")],
    "multi-turn": [msg("user", "1+1?"), msg("assistant", "2"), msg("user", "and 2+2?"),
                   msg("assistant", "4"), msg("user", "thanks")],
    "system multi-turn": [msg("system", "Answer in French."), msg("user", "Hello"),
                          msg("assistant", "Bonjour"), msg("user", "Bye"),
                          msg("assistant", "Au revoir")],
    "unicode and spaces": [msg("user", "  na\u00efve caf\u00e9 \u2014 \u4e16\u754c \U0001f642\n"),
                           msg("assistant", "\tr\u00e9ponse\u3000 \n")],
    "jinja-looking content": [msg("user", "{{ x }} {% if y %}z{% endif %} {# c #}"),
                              msg("assistant", "'quotes' \"and\" \\back\\slash {{ raise_exception('no') }}")],
    "empty contents": [msg("user", ""), msg("assistant", "")],
    "bad alternation": [msg("user", "a"), msg("user", "b")],
    "assistant first": [msg("assistant", "I start"), msg("user", "ok")],
}


def hf_tokenizer(bos, eos, tokenizer_object=None):
    if tokenizer_object is None:
        tokenizer_object = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    kw = {"eos_token": eos}
    if bos is not None:
        kw["bos_token"] = bos
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **kw)


def hf_render(tok, template, messages, add_generation_prompt):
    """transformers' rendering, or ("error", message) when the template raises."""
    try:
        return tok.apply_chat_template(messages, tokenize=False, chat_template=template,
                                       add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        return ("error", str(e))


class Driver:
    """Runs tests/chat_render.c on a template text and a conversation."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.count = 0

    def run(self, template, messages, bos=None, eos=None, add_generation_prompt=False,
            spans=False, now=None):
        self.count += 1
        tpath = os.path.join(self.tmp, f"t{self.count}.jinja")
        cpath = os.path.join(self.tmp, f"c{self.count}.json")
        with open(tpath, "w", encoding="utf-8", newline="") as f:
            f.write(template)
        conv = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                "spans": spans}
        for key, value in (("bos_token", bos), ("eos_token", eos), ("now", now)):
            if value is not None:
                conv[key] = value
        with open(cpath, "w", encoding="utf-8") as f:
            json.dump(conv, f)
        p = subprocess.run([RENDER, tpath, cpath], capture_output=True, timeout=60)
        if p.returncode != 0:
            return p.returncode, p.stderr.decode()
        out = p.stdout.decode("utf-8")
        return 0, json.loads(out) if spans else out


def read_template(name):
    with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
        return f.read()


class Families(unittest.TestCase):
    """The shipped templates: every conversation, with and without the generation prompt."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.driver = Driver(cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_renderings_equal_transformers(self):
        compared = raised = 0
        for family, (fname, bos, eos, _) in FAMILIES.items():
            template = read_template(fname)
            tok = hf_tokenizer(bos, eos)
            for cname, messages in CONVERSATIONS.items():
                for agp in (False, True):
                    with self.subTest(family=family, conversation=cname, agp=agp):
                        want = hf_render(tok, template, messages, agp)
                        rc, got = self.driver.run(template, messages, bos, eos, agp)
                        if isinstance(want, tuple):
                            self.assertEqual(rc, 2, got)
                            self.assertIn(f"the template raised an error: {want[1]}", got)
                            raised += 1
                        else:
                            self.assertEqual(rc, 0, got)
                            self.assertEqual(got, want)
                            compared += 1
        print(f"families: {compared} renderings equal transformers', {raised} raised as it did")
        self.assertGreater(raised, 0)

    def test_mistral_bad_alternation_message(self):
        template = read_template("mistral-v0.1.jinja")
        rc, err = self.driver.run(template, CONVERSATIONS["bad alternation"], "<s>", "</s>")
        print("mistral v0.1, user twice:", err.strip())
        self.assertEqual(rc, 2)
        self.assertIn(":1: the template raised an error: Conversation roles must alternate "
                      "user/assistant/user/assistant/...", err)

    def test_assistant_spans(self):
        """Each assistant span is Q[len(P):] of transformers' renderings (P: up to the reply
        with the generation prompt, Q: with the reply), holds the reply and its end-of-turn
        marker, and nothing else of the text is inside a span. Where transformers' P is not a
        prefix of Q (or Q of the whole), astrai refuses naming the message."""
        checked = refused = 0
        for family, (fname, bos, eos, reply_span) in FAMILIES.items():
            template = read_template(fname)
            tok = hf_tokenizer(bos, eos)
            for cname, messages in CONVERSATIONS.items():
                full = hf_render(tok, template, messages, False)
                if isinstance(full, tuple):
                    continue
                with self.subTest(family=family, conversation=cname):
                    want, failed_at = span_rule(tok, template, messages, full)
                    rc, got = self.driver.run(template, messages, bos, eos, True, spans=True)
                    if failed_at is not None:
                        self.assertEqual(rc, 2, got)
                        self.assertIn(f"message {failed_at} (assistant)", got)
                        refused += 1
                        continue
                    self.assertEqual(rc, 0, got)
                    self.assertEqual(got["text"], full)
                    self.assertEqual(got["spans"], want)
                    data = full.encode()
                    replies = [m["content"] for m in messages if m["role"] == "assistant"]
                    for (b, e), reply in zip(want, replies):
                        self.assertEqual(data[b:e].decode(), reply_span(reply))
                    checked += len(want)
        print(f"spans: {checked} assistant spans equal transformers' P/Q renderings and hold "
              f"the reply; {refused} conversations refused where transformers' P/Q are no prefixes")
        self.assertGreater(checked, 40)


def span_rule(tok, template, messages, full):
    """docs/data.md's span rule on transformers' renderings: ([[begin, end]...] in bytes,
    None), or (None, i) for the first assistant message i it fails on."""
    data, spans = full.encode(), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:  # transformers cannot render an empty conversation (IndexError)
            p = hf_render(tok, template, messages[:i], True)
        except IndexError:
            return None, i
        q = hf_render(tok, template, messages[:i + 1], False)
        if isinstance(p, tuple) or isinstance(q, tuple):
            return None, i
        p, q = p.encode(), q.encode()
        if not q.startswith(p) or not data.startswith(q):
            return None, i
        spans.append([len(p), len(q)])
    return spans, None


# Small templates, one construct (or a few) each, rendered over CONV by both.
CONV = [msg("system", "sys"), msg("user", "Hi \u00e9"), msg("assistant", " Yo "),
        msg("user", "{{ x }}")]
CONSTRUCTS = [
    # whitespace control, trim_blocks, lstrip_blocks, comments, newlines
    "a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}\n e",
    "line1\n    {% if true %}\n    kept\n    {% endif %}\nline2\n",
    "x {% if true %}y{% endif %} z\n  {# comment #}\n  w\n\n",
    "{%+ if true %} plus{% endif +%}\nnext",
    "a\r\nb\rc\n{% if true %}\r\nd{% endif %}\n\n",
    "  {{ 'var' }}\n  {% for m in messages %}{{ m.role }}\n  {% endfor %}end",
    "{#- leading -#}   x   {#- trailing #}\ny",
    "\u3000{%- if true %}u{% endif %}|x\n\u3000\u00a0 {% if true %}y{% endif %}|\u3000{% if 1 %}z{% endif %}",
    "{% if true %}\n   {% if true %}x{% endif %}\n{% endif %}\n  {{ 'a' -}}\n  {% if 1 %}b{% endif %}",
    "a {#- c -#} b {#+ c +#} c\n{# c #}\n  {#- c #}d",
    # loops
    "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.length }}"
    "/{{ loop.first }}/{{ loop.last }}/{{ loop.revindex }}/{{ loop.revindex0 }};{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role }}"
    "{{ loop.length }},{% endfor %}",
    "{% for m in [] %}x{% else %}empty{% endfor %}|{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}",
    "{% for c in 'h\u00e9!' %}[{{ c }}]{% endfor %}",
    "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
    "{% if loop.index0 == 3 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    "{% for k, v in {'a': 1, 'b': [2]} | items %}{{ k }}={{ v }};{% endfor %}",
    "{% for a in [1, 2] %}{% for b in [3, 4] %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}"
    "{{ loop.index }}{% endfor %}",
    "{% for m in messages %}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}"
    "{% if loop.nextitem is defined %}{{ loop.nextitem.role }}{% endif %},{% endfor %}",
    # scoping and set
    "{% set c = 0 %}{% for i in [1, 2, 3] %}{% set c = c + i %}{{ c }}{% endfor %}{{ c }}",
    "{% set ns = namespace(c=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.c = ns.c + i %}"
    "{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.c }} {{ ns.s }}",
    "{% if true %}{% set x = 'set in if' %}{% endif %}{{ x }}",
    "{% set x = 'o' %}{% for i in [1, 2] %}[{{ x }}]{% set x = i %}[{{ x }}]{% endfor %}{{ x }}"
    "|{% for i in [1, 2] %}{% for j in [3] %}{% set i = j %}{% endfor %}{{ i }}{% endfor %}"
    "|{% set bos_token = 'B' %}{{ bos_token }}",
    "{% set messages = messages[1:] %}{{ messages | length }}{{ messages[0].role }}",
    # literals, printing
    "{{ 'a\\nb\\t\\u00e9\\x41\\\\' }}|{{ \"dq'\" }}|{{ 'ad' 'jacent' }}|{{ 1_000 }}",
    "{{ [1, 'a', none, true, false, {'k': 'v'}] }}|{{ {'a': [1, 2]} }}|{{ none }}|{{ true }}",
    "{{ [\"it's\", 'q\"', 'both\\'\"', 'nl\\n'] }}",
    "{{ undefined_name }}|{{ messages[9] }}|{{ messages[0].nope }}|{{ none.x }}|{{ 'ab'[7] }}",
    # subscripts and slices
    "{{ messages[-1].content }}|{{ messages[0]['role'] }}|{{ 'h\u00e9llo'[1] }}|{{ 'h\u00e9llo'[1:3] }}",
    "{{ [1, 2, 3, 4, 5][::2] }}|{{ [1, 2, 3][::-1] }}|{{ 'abcdef'[-2:] }}|{{ 'abc'[:-1] }}"
    "|{{ [1, 2, 3][5:] }}|{{ 'abcdef'[4:1:-1] }}|{{ [1,2,3][-9:2] }}",
    # operators
    "{{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 2 * 3 - 1 }}"
    " {{ 'ab' * 2 }} {{ [1] + [2] }} {{ 1 ~ 'a' ~ none ~ undefined_x }} {{ -(3) }}",
    "{{ 1 == 1 }} {{ 1 == true }} {{ 'a' != 'b' }} {{ 1 < 2 }} {{ 'b' >= 'a' }} {{ 2 <= 1 }}"
    " {{ [1, {'a': 2}] == [1, {'a': 2}] }} {{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }}",
    "{{ 'a' in 'cat' }} {{ 2 in [1, 2] }} {{ 'role' in messages[0] }} {{ 'x' not in 'abc' }}"
    " {{ 'tool_calls' in messages[0] }} {{ '' in 'a' }}",
    "{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ '' and 'b' }} {{ none or [] }} {{ not 0 }}"
    " {{ not messages }} {{ 'y' if true }}|{{ 'y' if false }}|{{ 'a' if 0 else 'b' if 1 else 'c' }}",
    "{{ (1 + 2) ~ 3 }} {{ 2 + 3 * 4 }} {{ (2 + 3) * 4 }} {{ 'a' ~ 1 ~ 2 }} {{ -2 | string }}"
    " {{ 1 - -1 }} {{ 10 - 2 - 3 }} {{ 2 * 3 % 4 }}",
    # tests
    "{{ x is defined }} {{ messages is defined }} {{ none is none }} {{ 'a' is string }}"
    " {{ {} is mapping }} {{ [] is iterable }} {{ 'a' is sequence }} {{ 1 is number }}"
    " {{ 1 is integer }} {{ true is boolean }} {{ true is integer }} {{ 3 is odd }}"
    " {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(2) }} {{ 'a' is equalto 'a' }}"
    " {{ 2 is in [1, 2] }} {{ x is not defined }} {{ not x is defined }} {{ none is not none }}"
    " {{ u is iterable }} {{ none is iterable }} {{ 1 is true }} {{ true is true }}",
    "{{ tools is none }} {{ documents is defined }} {{ bos_token }}|{{ eos_token }}"
    "|{{ add_generation_prompt }}|{{ pad_token is defined }}|{{ date_string is defined }}",
    # filters
    "{{ '  a b \\n' | trim }}|{{ messages | length }}|{{ 'h\u00e9' | length }}|{{ 'aBc' | upper }}"
    "|{{ 'aBc' | lower }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'xxaxx' | trim('x') }}"
    "|{{ u | length }}|{{ {'a': 1} | count }}",
    "{{ u | default('d') }}|{{ '' | default('d') }}|{{ '' | default('d', true) }}"
    "|{{ none | default('d') }}|{{ u | d('dd') }}|{{ 0 | default(boolean=true, default_value=5) }}",
    "{{ ['a', 'b'] | join(', ') }}|{{ [1, 2] | join }}|{{ messages | join('-', attribute='role') }}"
    "|{{ messages | first }}|{{ (messages | last).role }}|{{ 'abc' | first }}|{{ [] | first }}",
    "{{ {'a': 1, 'b': [2]} | items | list }}|{{ u | items | list }}|{{ 'ab' | list }}"
    "|{{ {'k': 1} | list }}|{{ 12 | string }}|{{ none | string }}|{{ [1] | string }}",
    "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
    "|{{ messages | rejectattr('role', 'equalto', 'user') | map(attribute='role') | join(',') }}"
    "|{{ [0, 1, 2, '', 'a'] | select | list }}|{{ [1, 2, 3, 4] | reject('odd') | list }}"
    "|{{ messages | selectattr('content') | list | length }}"
    "|{{ [1, 2, 3] | select('in', [2, 3]) | list }}",
    "{{ messages | map(attribute='missing', default='m') | list }}|{{ 'a-b-a' | replace('a', 'x') }}"
    "|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'x' | safe }}",
    "{{ {'a': 'x\"y\\n\\u00e9\\u0001', 'b': [1, none, true, {}], 'c': []} | tojson }}"
    "|{{ messages[:2] | tojson(indent=2) }}|{{ {'n': {'m': [1, [2]]}} | tojson(indent=4) }}"
    "|{{ 'plain' | tojson }}",
    # methods
    "{{ {'a': 1, 'b': 2}.items() | list }}|{{ {'a': 1}.keys() | list }}|{{ {'a': 1}.values() | list }}"
    "|{{ {'a': 1}.get('a') }}|{{ {'a': 1}.get('b') }}|{{ {'a': 1}.get('b', 'd') }}",
    "{{ '  s  '.strip() }}|{{ '  s  '.lstrip() }}|{{ '  s  '.rstrip() }}|{{ 'xsx'.strip('x') }}"
    "|{{ 'a b  c '.split() }}|{{ 'a,b,,c,'.split(',') }}|{{ ''.split(',') }}"
    "|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith('bc') }}|{{ 'abc'.endswith('x') }}"
    "|{{ 'aB'.upper() }}|{{ 'aB'.lower() }}|{{ 'aXa'.replace('a', '-') }}",
    # global functions
    "{{ range(3) | list }}|{{ range(1, 7, 2) | list }}|{{ range(3, 0, -1) | list }}"
    "|{% for i in range(2) %}{{ i }}{% endfor %}|{{ raise_exception is defined }}"
    "|{{ strftime_now is defined }}",
]


class Constructs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.driver = Driver(cls.tmp.name)
        cls.tok = hf_tokenizer("<s>", "</s>")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_constructs_equal_transformers(self):
        for template in CONSTRUCTS:
            with self.subTest(template=template):
                want = hf_render(self.tok, template, CONV, True)
                self.assertIsInstance(want, str)
                rc, got = self.driver.run(template, CONV, "<s>", "</s>", True)
                self.assertEqual(rc, 0, got)
                self.assertEqual(got, want)
        print(f"constructs: {len(CONSTRUCTS)} templates render as transformers renders them")

    def test_random_whitespace_layouts(self):
        """Seeded random mixes of text, whitespace, tags with every whitespace control and
        comments: the lexing rules (trim_blocks, lstrip_blocks, '-', '+') as Jinja2's."""
        rng = random.Random(22)
        texts = ["", " ", "  ", "\n", " \n ", "\t", "x", "\u3000", "\n\n", "a\n  ", "\n \t"]
        signs = ["", "-", "+"]

        def block(depth):
            out = []
            for _ in range(rng.randint(1, 4)):
                out.append(rng.choice(texts))
                kind = rng.randrange(4 if depth < 2 else 3)
                if kind == 0:
                    out.append("{{%s 'v' %s}}" % (rng.choice(signs[:2]), rng.choice(signs[:2])))
                elif kind == 1:
                    out.append("{#%s c %s#}" % (rng.choice(signs), rng.choice(signs)))
                elif kind == 2:
                    out.append("{%%%s set z = 1 %s%%}" % (rng.choice(signs), rng.choice(signs)))
                else:
                    cond = rng.choice(["true", "false"])
                    out.append("{%%%s if %s %s%%}" % (rng.choice(signs), cond, rng.choice(signs)))
                    out.append(block(depth + 1))
                    out.append("{%%%s endif %s%%}" % (rng.choice(signs), rng.choice(signs)))
            out.append(rng.choice(texts))
            return "".join(out)

        for _ in range(150):
            template = block(0)
            with self.subTest(template=template):
                want = hf_render(self.tok, template, CONV, False)
                rc, got = self.driver.run(template, CONV)
                self.assertEqual(rc, 0, got)
                self.assertEqual(got, want)
        print("whitespace layouts: 150 random templates render as transformers renders them")

    def test_runtime_errors_where_jinja_fails(self):
        """Where Jinja2 raises at render time, so does astrai (naming the line)."""
        failing = ["\n{{ u.attr }}", "{{ u + 'a' }}", "{{ messages[0].content + 1 }}",
                   "{{ 1 // 0 }}", "{% for x in 3 %}{% endfor %}", "{{ u['k'] }}",
                   "{{ 'a' < 1 }}", "{{ 3 in 4 }}", "{{ u | tojson }}", "{{ 1 + 2 ~ 3 }}",
                   "{% for m in messages %}{{ loop.nextitem.role }}{% endfor %}"]
        for template in failing:
            with self.subTest(template=template):
                self.assertIsInstance(hf_render_any(self.tok, template), Exception)
                rc, err = self.driver.run(template, CONV, "<s>", "</s>")
                self.assertEqual(rc, 2, err)
                self.assertRegex(err, r"t\d+\.jinja:\d+: ")
        print(f"runtime errors: {len(failing)} templates fail in both")

    def test_unsupported_constructs_refused(self):
        cases = {"{{ x }}\n\n{{ x | wordwrap }}": ":3: filter 'wordwrap' is not supported",
                 "{% macro m() %}x{% endmacro %}": ":1: tag 'macro' is not supported",
                 "\n{{ 'a'.format(1) }}": ":2: method 'format' is not supported",
                 "{{ x is sameas y }}": ":1: test 'sameas' is not supported",
                 "{{ 1.5 }}": ":1: float literals are not supported",
                 "{% generation %}{% endgeneration %}": "tag 'generation' is not supported"}
        for template, want in cases.items():
            with self.subTest(template=template):
                rc, err = self.driver.run(template, CONV)
                self.assertEqual(rc, 2, err)
                self.assertIn(want, err)
                print("refused:", err.strip())

    def test_strftime_now(self):
        """strftime_now formats ChatVars.now in UTC, as Python's time.strftime does."""
        now = 1721952000 + 12345
        fmt = "%d %b %Y %H:%M:%S %A %j"
        rc, got = self.driver.run("{{ strftime_now('" + fmt + "') }}", CONV, now=now)
        self.assertEqual(rc, 0, got)
        self.assertEqual(got, time.strftime(fmt, time.gmtime(now)))
        print("strftime_now:", got)


def hf_render_any(tok, template):
    try:
        return tok.apply_chat_template(CONV, tokenize=False, chat_template=template)
    except Exception as e:  # noqa: BLE001 - any failure of Jinja2 counts
        return e


# ------------------------------------------------------------------ astrai-data prep


def train_tokenizer(special):
    """A byte-level BPE trained on the GPL, with the template's special tokens added."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([CORPUS], trainer)
    return tok


def load_shards(root):
    """Every shard's keys, concatenated in sorted path order (docs/data.md)."""
    arrays = {}
    for d in sorted(os.listdir(root)):
        with open(os.path.join(root, d, "meta.json")) as f:
            meta = json.load(f)
        for key, info in meta.items():
            a = np.fromfile(os.path.join(root, d, f"{key}.bin"), dtype=info["dtype"])
            arrays[key] = np.concatenate([arrays[key], a]) if key in arrays else a
    return arrays


def prep(*args):
    return subprocess.run([TOOL, "prep", "--format", "sft-jsonl", *args], capture_output=True,
                          text=True, timeout=120)


class Prep(unittest.TestCase):
    FAMILY = "qwen2.5"
    SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = cls.tmp.name
        fname, bos, eos, reply_span = FAMILIES[cls.FAMILY]
        cls.reply_span = staticmethod(reply_span)
        cls.template = read_template(fname)
        cls.tok = train_tokenizer(cls.SPECIAL)
        cls.tokdir = os.path.join(cls.dir, "tok")
        os.mkdir(cls.tokdir)
        cls.tok.save(os.path.join(cls.tokdir, "tokenizer.json"))
        with open(os.path.join(cls.tokdir, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": cls.template, "eos_token": eos, "bos_token": None}, f)
        cls.hf = hf_tokenizer(bos, eos, cls.tok)
        cls.records = [m for name, m in CONVERSATIONS.items()
                       if name not in ("bad alternation", "assistant first")]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def write_jsonl(self, name, records):
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        return path

    def expected(self, messages, template):
        """(sequence, loss_mask) by the rule of docs/data.md, from transformers' renderings
        and per-segment encodes of `tokenizers`."""
        full = self.hf.apply_chat_template(messages, tokenize=False, chat_template=template)
        segments, at = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            p = self.hf.apply_chat_template(messages[:i], tokenize=False, chat_template=template,
                                            add_generation_prompt=True)
            q = self.hf.apply_chat_template(messages[:i + 1], tokenize=False,
                                            chat_template=template)
            self.assertTrue(q.startswith(p) and full.startswith(q))
            segments += [(full[at:len(p)], 0), (full[len(p):len(q)], 1)]
            at = len(q)
        segments.append((full[at:], 0))
        seq, mask = [], []
        for text, loss in segments:
            ids = self.tok.encode(text, add_special_tokens=False).ids if text else []
            seq += ids
            mask += [loss] * len(ids)
        return seq, mask

    def test_conversations(self):
        path = self.write_jsonl("conv.jsonl", [{"messages": m} for m in self.records] +
                                [{"prompt": "p", "response": "r"}])
        out = os.path.join(self.dir, "out")
        p = prep("--tokenizer", self.tokdir, "--out", out, path)
        self.assertEqual(p.returncode, 0, p.stderr)
        got = load_shards(out)
        seq, mask, pos = [], [], []
        for m in self.records:
            s, k = self.expected(m, self.template)
            seq += s
            mask += k
            pos += list(range(len(s)))
        tail = self.tok.encode("p").ids, self.tok.encode("r").ids
        seq += tail[0] + tail[1]
        mask += [0] * len(tail[0]) + [1] * len(tail[1])
        pos += list(range(len(tail[0]) + len(tail[1])))
        self.assertEqual(got["sequence"].tolist(), seq)
        self.assertEqual(got["loss_mask"].tolist(), mask)
        self.assertEqual(got["position_ids"].tolist(), pos)
        # the masked runs decode to the replies and their end-of-turn markers
        runs, run = [], []
        for t, (tid, loss) in enumerate(zip(got["sequence"].tolist(), got["loss_mask"].tolist())):
            if loss:
                run.append(tid)
            if run and (not loss or t + 1 == len(seq) or got["position_ids"][t + 1] == 0):
                runs.append(run)
                run = []
        replies = [self.reply_span(x["content"]) for m in self.records for x in m
                   if x["role"] == "assistant"] + ["r"]
        decoded = [self.tok.decode(r, skip_special_tokens=False) for r in runs]
        self.assertEqual(decoded, replies)
        print(f"prep: {len(seq)} tokens of {len(self.records)} conversations equal the "
              f"per-segment encodes; {len(runs)} masked runs decode to the replies")

    def test_chat_template_flag_overrides(self):
        mistral = os.path.join(TEMPLATES, "mistral-v0.2.jinja")
        conv = [CONVERSATIONS["multi-turn"][:4]]
        path = self.write_jsonl("flag.jsonl", [{"messages": m} for m in conv])
        out = os.path.join(self.dir, "out_flag")
        p = prep("--tokenizer", self.tokdir, "--chat_template", mistral, "--out", out, path)
        self.assertEqual(p.returncode, 0, p.stderr)
        got = load_shards(out)
        seq, mask = self.expected(conv[0], read_template("mistral-v0.2.jinja"))
        self.assertEqual(got["sequence"].tolist(), seq)
        self.assertEqual(got["loss_mask"].tolist(), mask)
        print(f"--chat_template: {len(seq)} tokens rendered with the mistral v0.2 template")

    def test_bad_records(self):
        cases = [
            ({"messages": [msg("user", "a")], "prompt": "p"}, 'key "prompt" beside "messages"'),
            ({"messages": [msg("tool", "a")]}, '"messages"[0]: unknown role "tool"'),
            ({"messages": [msg("user", "a"), {"role": "assistant", "content": 3}]},
             '"messages"[1]: "content" is missing or not a string'),
            ({"messages": [{"role": "user", "content": "a", "name": "x"}]},
             '"messages"[0]: unknown key "name"'),
            ({"messages": []}, '"messages" must be a non-empty list'),
            ({"messages": "hi"}, '"messages" must be a non-empty list'),
        ]
        for i, (record, want) in enumerate(cases):
            with self.subTest(want=want):
                path = self.write_jsonl(f"bad{i}.jsonl", [{"prompt": "ok", "response": "ok"},
                                                          record])
                p = prep("--tokenizer", self.tokdir, "--out", os.path.join(self.dir, f"o{i}"),
                         path)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(f"{path}:2: {want}", p.stderr)
                print("refused:", p.stderr.strip())

    def test_no_template(self):
        path = self.write_jsonl("notmpl.jsonl", [{"messages": [msg("user", "a")]}])
        p = prep("--tokenizer", "bytes", "--out", os.path.join(self.dir, "o_none"), path)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"{path}:1: a conversation (\"messages\") needs a chat template", p.stderr)
        p = subprocess.run([TOOL, "prep", "--format", "text", "--chat_template", "x", "--out",
                            os.path.join(self.dir, "o_text"), path], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--chat_template applies to --format sft-jsonl", p.stderr)
        print("refused:", p.stderr.strip())

    def test_template_raising_names_record(self):
        mistral = os.path.join(TEMPLATES, "mistral-v0.1.jinja")
        path = self.write_jsonl("alt.jsonl", [{"messages": CONVERSATIONS["multi-turn"]},
                                              {"messages": CONVERSATIONS["bad alternation"]}])
        p = prep("--tokenizer", self.tokdir, "--chat_template", mistral, "--out",
                 os.path.join(self.dir, "o_alt"), path)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"{path}:2: ", p.stderr)
        self.assertIn("Conversation roles must alternate", p.stderr)
        print("refused:", p.stderr.strip())


class Budgets(unittest.TestCase):
    """A rendering's budgets (docs/data.md "Template budgets"): counted, never timed; past one
    is exit 2 naming the budget and the template line; flags raise them."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = cls.tmp.name
        cls.data = os.path.join(cls.dir, "c.jsonl")
        with open(cls.data, "w") as f:
            f.write(json.dumps({"messages": [msg("user", "hi"), msg("assistant", "yo")]}) + "\n")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def render(self, name, template, *flags):
        path = os.path.join(self.dir, name + ".jinja")
        with open(path, "w") as f:
            f.write("{% for m in messages %}{{ m.content }}{% endfor %}\n" + template)
        out = os.path.join(self.dir, name + "-out")
        return prep("--out", out, "--tokenizer", "bytes", "--chat_template", path, *flags,
                    self.data), path

    def refused(self, p, path, line, *needles):
        self.assertEqual(p.returncode, 2, p.stderr)
        for n in (f"{os.path.basename(path)}:{line}:", "template budget exceeded", *needles):
            self.assertIn(n, p.stderr)
        print("refused:", p.stderr.strip())

    def test_nested_empty_loops(self):
        nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        p, path = self.render("nested", nested, "--template_max_iterations", "1000")
        self.refused(p, path, 2, "iterations", "more than 1000", "--template_max_iterations")
        p, path = self.render("nested-default", nested)
        self.refused(p, path, 2, "iterations", "more than 10000000")

    def test_empty_loop_costs_no_memory(self):
        # 3 million empty iterations within 128 MB of values: only the range lists (30 x 2.4 MB)
        # are held, nothing per iteration (it was ~800 bytes each: 2.4 GB).
        loops = "{% for i in range(30) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        p, _ = self.render("empty", loops, "--template_max_memory", str(128 << 20))
        self.assertEqual(p.returncode, 0, p.stderr)
        p, path = self.render("empty-small", loops, "--template_max_memory", str(1 << 20))
        self.refused(p, path, 2, "memory", "--template_max_memory")

    def test_doubling_tojson(self):
        grow = ('{% set ns = namespace(s="ab") %}{% for i in range(40) %}'
                '{% set ns.s = ns.s|tojson %}{% endfor %}')
        p, path = self.render("tojson", grow, "--template_max_bytes", str(1 << 20))
        self.refused(p, path, 2, "bytes", "more than 1048576", "--template_max_bytes")
        # never output: the bound is on every value built, not only on the output
        few = grow.replace("range(40)", "range(10)")
        p, _ = self.render("tojson-few", few, "--template_max_bytes", str(1 << 20))
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_operations(self):
        loop = "{% for i in range(1000) %}{% set x = i + i %}{% endfor %}"
        p, path = self.render("ops", loop, "--template_max_ops", "500")
        self.refused(p, path, 2, "operations", "more than 500", "--template_max_ops")
        p, _ = self.render("ops-raised", loop, "--template_max_ops", "100000")
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_nesting(self):
        deep = "{% if true %}" * 300 + "x" + "{% endif %}" * 300
        p, path = self.render("deep", deep)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("nested too deeply", p.stderr)
        print("refused:", p.stderr.strip())


if __name__ == "__main__":
    unittest.main(verbosity=2)
