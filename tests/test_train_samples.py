"""Samples during training (--sample_interval, --sample_prompts; train/samples.h):

- A run of 5 steps with sample_interval 2 writes samples into progress.db at steps 2, 4 and 5 (the
  end) and no other, one row per prompt (a {"prompt"} line and a {"messages"} line rendered with
  the model directory's tokenizer.json chat template): each row's prompt, completion and token
  count are what astrai-generate writes (same max_tokens, temperature 0, seed random_seed) from
  the checkpoint of that step (ckpt_interval 2), and the samples of different steps differ, so
  the check tells the steps' weights apart (a constant learning rate keeps them moving). The losses are those of the same run without samples
  (generation leaves training as it is).
- Resumed from the step-2 checkpoint, the rows after step 2 are dropped and written again, equal.
- ddp and fsdp on 2 ranks with max_steps 3: samples at steps 2 and 3 (max_steps ends the run),
  equal to astrai-generate's from that run's checkpoints; fsdp's conversation rendered by the
  chat_template key's file (astrai-generate's --chat_template).
- Bad input exits 2 naming the key: sample_interval without sample_prompts and the reverse, a
  missing prompts file or chat template, a malformed line, pp_size 2, a temperature out of
  range, a prompt too long for sample_max_tokens.
"""
import json
import os
import shutil
import sqlite3
import subprocess

import test_astrai_generate as ag
import train_util as tu

CHARS = ag.CHARS + "&"
V = 256  # the tokenizer's ids: CHARS, fillers, "<eos>" (special) last; bytes data fits under it
CONFIG = dict(tu.SMALL_CONFIG, max_position_embeddings=64)
WINDOW = 16
MAX_TOKENS = 10
SEED = 11
PROMPTS = [{"prompt": "once upon a time"},
           {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hi <b>&"}]}]
RENDERED = ["once upon a time", "<system>be brief\n<user>hi <b>&\n<assistant>"]


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data, "ckpt_dir": ckpt,
         "window_size": WINDOW, "batch_per_device": 2, "max_lr": 2e-3, "optimizer": "adamw",
         "warmup_ratio": 0, "min_rate": 1, "threads": 1, "random_seed": SEED}
    a.update(extra)
    return a


def sampling(prompts):
    return {"sample_interval": 2, "sample_prompts": prompts, "sample_max_tokens": MAX_TOKENS,
            "ckpt_interval": 2}


def rows(ckpt):
    """progress.db's samples: {step: [(idx, prompt, completion, tokens, wall_time)...]}."""
    db = sqlite3.connect(os.path.join(ckpt, "progress.db"))
    out = {}
    for r in db.execute("SELECT step, idx, prompt, completion, tokens, wall_time FROM samples "
                        "ORDER BY step, idx"):
        out.setdefault(r[0], []).append(r[1:])
    total = db.execute("SELECT value FROM run WHERE key = 'total_steps'").fetchone()[0]
    db.close()
    return out, int(total)


def generated(ckpt_dir, model, prompts, template):
    """astrai-generate's lines for the checkpoint."""
    p = subprocess.run([tu.binary("astrai-generate"), "--param_path", ckpt_dir, "--tokenizer",
                        model, "--prompts", prompts, "--max_tokens", str(MAX_TOKENS),
                        "--temperature", "0", "--seed", str(SEED), "--threads", "1",
                        "--no-stream"] + (["--chat_template", template] if template else []),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines()]


def check_against_checkpoints(ckpt, model, prompts, steps, what, template=None,
                              rendered=RENDERED):
    got, _ = rows(ckpt)
    assert sorted(got) == steps, f"{what}: samples at steps {sorted(got)}, want {steps}"
    for step in steps:
        want = generated(os.path.join(ckpt, f"epoch_0_step_{step}"), model, prompts, template)
        have = got[step]
        assert [r[0] for r in have] == [0, 1], f"{what}: step {step} indices {have}"
        for r, w, text in zip(have, want, rendered, strict=True):
            assert r[1] == w["prompt"] == text, f"{what}: step {step} prompt {r[1]!r}, {w}"
            assert (r[2], r[3]) == (w["completion"], len(w["tokens"])), \
                f"{what}: step {step}: sample {r[2]!r} ({r[3]} tokens), astrai-generate " \
                f"{w['completion']!r} ({len(w['tokens'])})"
    return got


def losses(ckpt):
    return [(r["step"], r["loss"]) for r in tu.metric_rows(tu.latest_checkpoint(ckpt))]


def check_run(root, model, data, prompts):
    ckpt = os.path.join(root, "run")
    _, err = tu.train(args(model, data, ckpt, **sampling(prompts)))
    got, total = rows(ckpt)
    assert total == 5, f"the test wants a run of 5 steps, not {total}"
    assert "sample(s) in progress.db" in err, err
    got = check_against_checkpoints(ckpt, model, prompts, [2, 4, 5], "one rank")
    texts = {step: [r[2] for r in got[step]] for step in got}
    assert len({tuple(t) for t in texts.values()}) == len(texts), \
        f"two steps wrote the same samples {texts}: the check cannot tell their weights apart"
    plain = os.path.join(root, "plain")
    tu.train(args(model, data, plain, ckpt_interval=2))
    assert losses(ckpt) == losses(plain), "samples changed the training"
    print(f"ok: samples at steps 2, 4, 5 = astrai-generate's from each checkpoint: {texts}")
    return ckpt, got


def check_resume(model, data, prompts, ckpt, before):
    """Resumed from step 2: the rows after it go and come again, the same."""
    # A checkpoint holds no tokenizer: the key names the model directory's.
    tu.train(args(model, data, ckpt, resume="true", tokenizer=model,
                  param_path=os.path.join(ckpt, "epoch_0_step_2"), **sampling(prompts)))
    after, _ = rows(ckpt)
    assert sorted(after) == [2, 4, 5], sorted(after)
    assert after[2] == before[2], "the samples of the step resumed from changed"
    for step in (4, 5):
        assert [r[:4] for r in after[step]] == [r[:4] for r in before[step]], step
        assert after[step][0][4] > before[step][0][4], f"step {step}: its rows were not rewritten"
    print("ok: resumed at step 2, samples 4 and 5 rewritten, equal")


def check_parallel(root, model, data, prompts):
    """2 ranks under ddp and fsdp (which gathers the weights for it), the latter with the
    chat_template key's FILE in place of the tokenizer's template."""
    template = os.path.join(root, "other.jinja")
    with open(template, "w") as f:
        f.write("{% for m in messages %}{{ m.content }}|{% endfor %}")
    for mode, tpl, rendered in (("ddp", None, RENDERED),
                                ("fsdp", template, [RENDERED[0], "be brief|hi <b>&|"])):
        ckpt = os.path.join(root, mode)
        extra = {"chat_template": tpl} if tpl else {}
        tu.train(args(model, data, ckpt, nprocs=2, parallel_mode=mode, max_steps=3,
                      batch_per_device=1, **extra, **sampling(prompts)))
        check_against_checkpoints(ckpt, model, prompts, [2, 3], f"{mode} 2 ranks", tpl, rendered)
    print("ok: ddp and fsdp on 2 ranks: samples at steps 2 and 3 (max_steps) = astrai-generate's")


def refused(a, *needles):
    _, err = tu.train(a, expect=2)
    for n in needles:
        assert n in err, f"{a}: {n!r} not in {err!r}"


def check_bad_input(root, model, data, prompts):
    ck = os.path.join(root, "bad")
    refused(args(model, data, ck, sample_interval=2), "sample_interval", "sample_prompts")
    refused(args(model, data, ck, sample_prompts=prompts), "sample_prompts", "sample_interval")
    missing = os.path.join(root, "nowhere.jsonl")
    refused(args(model, data, ck, **dict(sampling(prompts), sample_prompts=missing)),
            "sample_prompts", missing)
    bad = os.path.join(root, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"prompt": "ok"}\n{"text": "no"}\n')
    refused(args(model, data, ck, **dict(sampling(prompts), sample_prompts=bad)),
            "sample_prompts", f"{bad}:2")
    refused(args(model, data, ck, chat_template=missing, **sampling(prompts)), "sample_prompts",
            missing)
    refused(args(model, data, ck, nprocs=2, pp_size=2, **sampling(prompts)), "sample_interval",
            "pp_size 2")
    refused(args(model, data, ck, sample_temperature=-1, **sampling(prompts)),
            "sample_temperature")
    refused(args(model, data, ck, **dict(sampling(prompts), sample_max_tokens=60)),
            "sample_prompts", "sample_max_tokens 60")
    print("ok: bad input refused naming the key")


def main():
    root = tu.tmpdir()
    model = tu.make_model(root, CONFIG)
    ag.write_tokenizer(model, chars=CHARS, size=V)  # its chat template renders "messages"
    data, _ = tu.make_text_data(root, 10 * WINDOW + 1)  # 10 windows: 5 steps of 2
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in PROMPTS)
    ckpt, got = check_run(root, model, data, prompts)
    check_resume(model, data, prompts, ckpt, got)
    check_parallel(root, model, data, prompts)
    check_bad_input(root, model, data, prompts)
    shutil.rmtree(root, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
