"""astrai-train --train_type online_grpo|online_dpo (docs/design.md §17, train/rollout.h) with a
reward command (train/reward.h), against the PyTorch reference (tests/ref/pref.py):

- 5 steps of online GRPO give the reference's rows (loss, kl, clip_fraction within 1e-4, grad
  norm within 1e-3) computing AstrAI's GRPOStrategy on the same responses (the reward command
  logs every request: the prompt and response ids are in its "meta"), with the behaviour policy
  synced to the policy at each rollout; the reward statistics (mean, population std, response
  length, equal-reward groups) are those of the logged rewards;
- online DPO likewise (chosen = the first highest reward, rejected = the first lowest);
- grad_accum_steps 2 (a rollout per micro-batch) against the reference; bf16 runs it;
- a short run raises the reward (lowercase letters written) from its start to near its most;
- ddp on 2 ranks equals one rank with the same global batch, and so does fsdp: a prompt's
  responses are keyed by (seed, step, prompt), whichever rank generates them;
- reward_url, an HTTP endpoint in this process, gives the rows of the same reward command;
- faults: a command that dies once is restarted (the run equals a clean run); one that always
  dies, hangs past reward_timeout_s, answers garbage, NaN, the wrong count or the wrong id fails
  the job with a message naming the request, the prompt and the line, after a checkpoint of
  the steps before, from which --resume (with a good command) finishes the clean run's rows;
- SIGTERM while a rollout waits for its rewards: the step completes, checkpoint, exit 3, and
  --resume finishes the clean run's rows exactly;
- prompts as messages and instruction/input/output rendered with the chat template, responses
  ending on the tokenizer's eos_token;
- hostile prompt text reaches the command verbatim as JSON data, runs nothing; the command's
  words are split without a shell (quotes kept as one argument);
- the same job through astraid completes with the same rows, its JOB showing the newest step's
  reward statistics;
- bad specs exit 2 naming the key.
"""

import copy
import http.server
import json
import math
import os
import signal
import subprocess
import sys
import threading

import torch

import train_util as tu
from ref.model import RefModel
from ref.optim import clip_grad_norm, make_optimizer
from ref.pref import dpo_loss, grpo_loss

torch.set_num_threads(2)
CONFIG = dict(tu.SMALL_CONFIG, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
G, BATCH, MAX_TOKENS, LR, WD, CLIP, SEED = 4, 2, 6, 1e-2, 0.1, 1.0, 3407
KNOBS = {"online_grpo": {"grpo_clip_eps": 0.2, "grpo_kl_coef": 0.3},
         "online_dpo": {"dpo_beta": 0.2}}
REF_KNOBS = {"online_grpo": {"clip_eps": 0.2, "kl_coef": 0.3}, "online_dpo": {"beta": 0.2}}
TOL = 1e-4

# The reward command: the count of lowercase ASCII letters in each response (with $REWARD_JITTER,
# plus a fraction from the text's CRC, so that a group's rewards tie only for equal texts). It logs
# each request and its rewards to $REWARD_LOG and misbehaves as $REWARD_FAULT says, from step
# $REWARD_FROM on.
REWARD = r'''
import json, os, sys, time, zlib
jitter = bool(os.environ.get("REWARD_JITTER"))
log = open(os.environ["REWARD_LOG"], "a") if os.environ.get("REWARD_LOG") else None
fault, since = os.environ.get("REWARD_FAULT", ""), int(os.environ.get("REWARD_FROM", "1"))
with open(os.environ["REWARD_ARGV"], "w") if os.environ.get("REWARD_ARGV") else open(os.devnull, "w") as f:
    json.dump(sys.argv[1:], f)
for line in sys.stdin:
    q = json.loads(line)
    rewards = [float(sum(c.islower() and c.isascii() for c in r)) +
               (zlib.crc32(r.encode("utf-8", "surrogatepass")) % 1000 / 1e4 if jitter else 0)
               for r in q["responses"]]
    if log:
        log.write(json.dumps({"request": q, "rewards": rewards}) + "\n"); log.flush()
    reply = {"id": q["id"], "rewards": rewards}
    if q["meta"]["step"] >= since and fault:
        if fault == "die_once" and not os.path.exists(os.environ["REWARD_MARK"]):
            open(os.environ["REWARD_MARK"], "w").close(); sys.exit(1)
        if fault == "die": sys.exit(1)
        if fault == "hang": time.sleep(3600)
        if fault == "garbage": print("this is not json", flush=True); continue
        if fault == "nan": reply["rewards"][0] = float("nan")  # Python writes NaN: not JSON
        if fault == "inf": print('{"id": %d, "rewards": [1e999, 0, 0, 0]}' % q["id"], flush=True); continue
        if fault == "count": reply["rewards"].pop()
        if fault == "id": reply["id"] += 100
        if fault == "wait":  # held until the test has signalled the trainer
            open(os.environ["REWARD_MARK"], "w").close()
            while not os.path.exists(os.environ["REWARD_MARK"] + ".go"): time.sleep(0.01)
            fault = ""
    print(json.dumps(reply), flush=True)
'''

PROMPTS = ["write: a", "say hello", "x", "lower case please", "abc", "zz top", "quiet", "why"]


def setup(root):
    model = tu.make_model(root, CONFIG)
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    script = os.path.join(root, "reward.py")
    with open(script, "w") as f:
        f.write(REWARD)
    return model, prompts, script


def args(kind, model, prompts, script, ckpt, **extra):
    a = {"train_type": kind, "param_path": model, "data_root_path": prompts,
         "reward_command": f"{sys.executable} {script}", "group_size": G,
         "batch_per_device": BATCH, "rollout_max_tokens": MAX_TOKENS, "rollout_temperature": 1.0,
         "rollout_top_p": 1.0, "ckpt_dir": ckpt, "ckpt_interval": 1000, "optimizer": "adamw",
         "max_lr": LR, "weight_decay": WD, "max_grad_norm": CLIP, "random_seed": SEED,
         "threads": 1, "reward_timeout_s": 60, "n_epoch": 2, **KNOBS[kind]}
    a.update(extra)
    return a


def run(a, env=None, expect=0, cwd=None):
    argv = [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]
    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       timeout=600, cwd=cwd)
    assert p.returncode == expect, f"exit {p.returncode}, expected {expect}:\n{p.stderr}"
    return p.stderr


def rows_of(ckpt_dir):
    """The step rows of the run's newest checkpoint."""
    return tu.metric_rows(tu.latest_checkpoint(ckpt_dir))


def wait_for_file(path):
    """Returns once path exists (the event a reward command signals by creating it)."""
    import time
    while not os.path.exists(path):
        time.sleep(0.01)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------- the reference

def groups_by_step(log):
    """{(step, prompt index): (prompt ids, [response ids], [rewards])} of the logged requests."""
    out = {}
    for entry in log:
        m = entry["request"]["meta"]
        out[(m["step"], m["index"])] = (m["prompt_ids"], m["response_ids"], entry["rewards"])
    return out


def micro_row(kind, policy, reference, old, recs, knobs):
    """One micro-batch's loss (backward run, weighted by `weight`) and its row numbers."""
    if kind == "online_grpo":
        loss, metrics = grpo_loss(policy, reference, recs, 64, old=old, **knobs)
    else:
        pairs = [(p, r[max(range(G), key=lambda j: (w[j], -j))],
                  r[min(range(G), key=lambda j: (w[j], j))]) for p, r, w in recs]
        loss, metrics = dpo_loss(policy, reference, pairs, 64, **knobs)
    rewards = torch.tensor([w for _, _, w in recs])
    lengths = torch.tensor([[len(x) for x in r] for _, r, _ in recs], dtype=torch.float64)
    return loss, {"loss": float(loss), **metrics, "reward_mean": float(rewards.mean()),
                  "reward_std": float(rewards.std(unbiased=False)),
                  "response_len": float(lengths.mean()),
                  "equal_reward_groups": sum(len(set(w)) == 1 for _, _, w in recs) / len(recs)}


def reference_rows(kind, model_dir, log, steps, n_prompts=len(PROMPTS), n_epoch=2, lr=LR,
                   knobs=None, accum=1):
    """AstrAI's strategy on the logged rollouts: a step's micro-batches are the prompts its
    rollout's requests name, in order, BATCH a micro-batch; a step without requests trains on
    the newest rollout again (kept: the same prompts, rollout_interval); GRPO's old policy is the
    policy when the rollout was made. A row's numbers are the means over its micro-batches."""
    groups = groups_by_step(log)
    order = {}
    for entry in log:
        m = entry["request"]["meta"]
        order.setdefault(m["step"], []).append(m["index"])
    policy, reference = RefModel.from_dir(model_dir), RefModel.from_dir(model_dir)
    for p in reference.parameters():
        p.requires_grad_(False)
    knobs = knobs or REF_KNOBS[kind]
    opt = make_optimizer("adamw", list(policy.named_parameters()), lr=lr, weight_decay=WD)
    total = n_epoch * (((n_prompts + BATCH - 1) // BATCH) // accum)
    rows, made = [], 0
    for step in range(1, steps + 1):
        if step in order:
            made, old = step, copy.deepcopy(policy)
        recs = [groups[(made, i)] for i in order[made]]
        sums = {}
        for b0 in range(0, len(recs), BATCH):
            loss, numbers = micro_row(kind, policy, reference, old, recs[b0:b0 + BATCH], knobs)
            (loss / accum).backward()
            for k, v in numbers.items():
                sums[k] = sums.get(k, 0.0) + v / accum
        step_lr = lr * tu.cosine_factor(step - 1, total, 0.05, 0.01)
        norm = clip_grad_norm(list(policy.parameters()), CLIP)
        opt.step(step_lr)
        opt.zero_grad()
        rows.append({"step": step, "grad_norm": norm, "lr": step_lr, **sums})
    return rows


def compare(ours, ref, what, failures):
    if len(ours) != len(ref):
        failures.append(f"{what}: {len(ours)} rows, reference {len(ref)}")
        return
    worst = {}
    for a, b in zip(ours, ref):
        for k, want in b.items():
            if k == "step":
                continue
            tol = 1e-3 if k == "grad_norm" else TOL
            e = abs(a[k] - want) / max(abs(want), 1e-2)
            worst[k] = max(worst.get(k, 0), e)
            if e > tol:
                failures.append(f"{what} step {a['step']}: {k} {a[k]} vs reference {want}")
    print(f"{what}: {len(ours)} steps, worst " +
          ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))


def same_rows(a, b, what, failures, keys=("loss", "grad_norm", "reward_mean", "response_len")):
    """Two runs of the same job: rows equal within 1e-5 (different rank counts round alike
    but for the reductions' order)."""
    if len(a) != len(b):
        failures.append(f"{what}: {len(a)} rows vs {len(b)}")
        return
    for x, y in zip(a, b):
        for k in keys:
            if abs(x[k] - y[k]) > 1e-5 * max(1.0, abs(y[k])):
                failures.append(f"{what} step {x['step']}: {k} {x[k]} vs {y[k]}")
                return


# ---------------------------------------------------------------- the cases

def against_reference(root, setup_, kind, failures):
    """DPO's rewards are jittered: a tie makes chosen and rejected the same response, whose
    gradients cancel to rounding noise that AdamW scales up to whole steps."""
    model, prompts, script = setup_
    log = os.path.join(root, f"{kind}.log")
    ckpt = os.path.join(root, kind)
    env = {"REWARD_LOG": log, **({"REWARD_JITTER": "1"} if kind == "online_dpo" else {})}
    run(args(kind, model, prompts, script, ckpt, max_steps=5), env=env)
    ours = rows_of(ckpt)
    compare(ours, reference_rows(kind, model, read_log(log), 5), kind, failures)
    for r in ours:
        if not (r["rollout_s"] > 0 and r["reward_s"] > 0):
            failures.append(f"{kind} step {r['step']}: rollout_s/reward_s not positive: {r}")
    return ours


def accumulation_bf16(root, setup_, failures):
    """grad_accum_steps 2: each micro-batch slot has its rollout; the rows are the reference's
    mean over the two (fp32). bf16 runs the same job to the end with finite numbers."""
    model, prompts, script = setup_
    log, ckpt = os.path.join(root, "accum.log"), os.path.join(root, "accum")
    run(args("online_grpo", model, prompts, script, ckpt, max_steps=3, grad_accum_steps=2),
        env={"REWARD_LOG": log})
    ref = reference_rows("online_grpo", model, read_log(log), 3, accum=2)
    compare(rows_of(ckpt), ref, "grad_accum_steps 2", failures)
    ckpt = os.path.join(root, "bf16")
    run(args("online_grpo", model, prompts, script, ckpt, max_steps=3, grad_accum_steps=2,
             dtype="bf16"))
    for r in rows_of(ckpt):
        if not all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "kl", "reward_mean")):
            failures.append(f"bf16 step {r['step']}: not finite: {r}")


def kept_rollouts(root, setup_, failures):
    """Two prompts, one micro-batch a step, shuffle off: every step has the same prompts, so a
    rollout serves rollout_interval 3 steps (made at steps 1 and 4), its behaviour policy falling
    behind the policy: GRPO's ratio leaves 1 and clips."""
    model, _, script = setup_
    prompts = os.path.join(root, "two.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt": PROMPTS[0]}) + "\n" + json.dumps({"prompt": PROMPTS[1]}))
    log, ckpt = os.path.join(root, "kept.log"), os.path.join(root, "kept")
    run(args("online_grpo", model, prompts, script, ckpt, max_steps=5, n_epoch=5,
             rollout_interval=3, shuffle="false", max_lr=1e-2, grpo_clip_eps=0.02),
        env={"REWARD_LOG": log})
    entries = read_log(log)
    made = sorted({e["request"]["meta"]["step"] for e in entries})
    if made != [1, 4]:
        failures.append(f"kept rollouts: made at steps {made}, expected [1, 4]")
        return
    ours = rows_of(ckpt)
    ref = reference_rows("online_grpo", model, entries, 5, n_prompts=2, n_epoch=5, lr=1e-2,
                         knobs={"clip_eps": 0.02, "kl_coef": 0.3})
    compare(ours, ref, "kept rollouts", failures)
    if not any(r["clip_fraction"] > 0 for r in ours):
        failures.append("kept rollouts: no step clipped")
    for r in ours:
        if (r["rollout_s"] > 0) != (r["step"] in made):
            failures.append(f"kept rollouts step {r['step']}: rollout_s {r['rollout_s']}")


def reward_rises(root, setup_, failures):
    model, prompts, script = setup_
    ckpt = os.path.join(root, "rises")
    run(args("online_grpo", model, prompts, script, ckpt, n_epoch=8, max_lr=3e-2,
             warmup_ratio=0, group_size=8, grpo_kl_coef=0.0))
    r = [x["reward_mean"] for x in rows_of(ckpt)]
    first, last = sum(r[:4]) / 4, sum(r[-4:]) / 4
    print(f"reward over {len(r)} steps: first 4 {first:.2f}, last 4 {last:.2f} (most {MAX_TOKENS})")
    if not (last > first + 2 and last >= MAX_TOKENS - 1.5):
        failures.append(f"the reward did not rise: {[round(x, 2) for x in r]}")


def distributed(root, setup_, one_rank, failures):
    model, prompts, script = setup_
    for mode in ("ddp", "fsdp"):
        ckpt = os.path.join(root, mode)
        run(args("online_grpo", model, prompts, script, ckpt, max_steps=5, nprocs=2,
                 parallel_mode=mode, batch_per_device=BATCH // 2))
        same_rows(rows_of(ckpt), one_rank, f"{mode} 2 ranks vs one", failures)


class RewardHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        q = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body = json.dumps({"id": q["id"], "rewards": [
            float(sum(c.islower() and c.isascii() for c in r)) for r in q["responses"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def reward_url(root, setup_, one_rank, failures):
    model, prompts, script = setup_
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RewardHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ckpt = os.path.join(root, "url")
    a = args("online_grpo", model, prompts, script, ckpt, max_steps=5,
             reward_url=f"http://127.0.0.1:{server.server_address[1]}/score")
    del a["reward_command"]
    run(a)
    server.shutdown()
    same_rows(rows_of(ckpt), one_rank, "reward_url vs reward_command", failures)


def faults(root, setup_, one_rank, failures):
    model, prompts, script = setup_
    mark = os.path.join(root, "mark")
    ckpt = os.path.join(root, "die_once")
    err = run(args("online_grpo", model, prompts, script, ckpt, max_steps=5),
              env={"REWARD_FAULT": "die_once", "REWARD_FROM": "2", "REWARD_MARK": mark})
    if "restarted" not in err:
        failures.append(f"die_once: no restart in the log:\n{err}")
    same_rows(rows_of(ckpt), one_rank, "a command restarted once", failures)
    cases = {"die": "exited with status 1", "hang": "within reward_timeout_s 3",
             "garbage": "this is not json", "nan": "is not valid JSON",
             "inf": "\"rewards\"[0] is not a finite number",
             "count": "not an array of 4 numbers", "id": "\"id\" is not the request's"}
    for fault, words in cases.items():
        ckpt = os.path.join(root, fault)
        err = run(args("online_grpo", model, prompts, script, ckpt, max_steps=5,
                       ckpt_interval=1000, reward_timeout_s=3),
                  env={"REWARD_FAULT": fault, "REWARD_FROM": "3"}, expect=1)
        if words not in err or "request" not in err or "(prompt " not in err:
            failures.append(f"{fault}: the message does not say '{words}' with the request and "
                            f"prompt:\n{err[-800:]}")
        names = sorted(os.listdir(ckpt))
        if "epoch_0_step_2" not in names:
            failures.append(f"{fault}: no checkpoint of the 2 steps before the failure: {names}")
            continue
        if fault == "die":  # the user mends the command and resumes: the clean run's rows
            run(args("online_grpo", model, prompts, script, ckpt, max_steps=5, resume="true"))
            same_rows(rows_of(ckpt), one_rank, "resumed after a failed reward", failures)


def sigterm_in_rollout(root, setup_, one_rank, failures):
    model, prompts, script = setup_
    ckpt, mark = os.path.join(root, "sigterm"), os.path.join(root, "held")
    a = args("online_grpo", model, prompts, script, ckpt, max_steps=5)
    argv = [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]
    env = {**os.environ, "REWARD_FAULT": "wait", "REWARD_FROM": "3", "REWARD_MARK": mark}
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_file(mark)  # the step-3 rollout waits for its reward
    p.send_signal(signal.SIGTERM)
    open(mark + ".go", "w").close()
    _, err = p.communicate(timeout=600)
    if p.returncode != 3:
        failures.append(f"SIGTERM during a rollout: exit {p.returncode}, expected 3:\n{err}")
        return
    if "epoch_0_step_3" not in os.listdir(ckpt):
        failures.append(f"SIGTERM during a rollout: no checkpoint at step 3: {os.listdir(ckpt)}")
    run(args("online_grpo", model, prompts, script, ckpt, max_steps=5, resume="true"))
    same_rows(rows_of(ckpt), one_rank, "resumed after SIGTERM in a rollout", failures,
              keys=("loss", "grad_norm", "reward_mean", "reward_std", "response_len", "kl"))


def hostile(root, setup_, failures):
    model, _, script = setup_
    evil = os.path.join(root, "e")  # relative to the run's working directory, root
    text = '$(touch e) `touch e`; touch e " \' \\ \n\t end'
    prompts = os.path.join(root, "hostile.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt": text}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    log, argv_file = os.path.join(root, "hostile.log"), os.path.join(root, "argv.json")
    a = args("online_grpo", model, prompts, script, os.path.join(root, "hostile"), max_steps=1)
    a["reward_command"] = f"{sys.executable} {script} 'one word' \"$HOME\" ;touch e"
    run(a, env={"REWARD_LOG": log, "REWARD_ARGV": argv_file}, cwd=root)
    seen = {entry["request"]["prompt"] for entry in read_log(log)}
    with open(argv_file) as f:
        words = json.load(f)
    if text not in seen:
        failures.append(f"hostile: the prompt did not arrive verbatim: {seen}")
    if os.path.exists(evil):
        failures.append("hostile: a prompt or the command line ran a command")
    if words != ["one word", "$HOME", ";touch", "e"]:
        failures.append(f"hostile: the command's words are {words}")


def chat_prompts(root, failures):
    """Prompts as messages and as AstrAI's instruction/input/output, rendered by the model
    directory's tokenizer and chat template with add_generation_prompt; its eos_token ends a
    response (the token kept in response_ids, not in the text)."""
    from test_astrai_generate import V, write_tokenizer
    model = tu.make_model(os.path.join(root, "chat"), dict(CONFIG, vocab_size=V))
    write_tokenizer(model)
    prompts = os.path.join(root, "chat.jsonl")
    lines = [{"messages": [{"role": "user", "content": "abc"}]},
             {"instruction": "be brief", "input": "hi", "output": ""},
             {"instruction": "only"}, {"prompt": "plain"}]
    with open(prompts, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    want = ["<user>abc\n<assistant>", "<system>be brief\n<user>hi\n<assistant>",
            "<system>only\n<assistant>", "plain"]
    log, script = os.path.join(root, "chat.log"), os.path.join(root, "reward.py")
    run(args("online_grpo", model, prompts, script, os.path.join(root, "chat-ckpt"),
             max_steps=2, shuffle="false", rollout_max_tokens=24, rollout_temperature=2.0),
        env={"REWARD_LOG": log})
    entries = read_log(log)
    seen = [e["request"]["prompt"] for e in entries]
    if seen != want:
        failures.append(f"chat prompts: the reward command saw {seen}, expected {want}")
    stopped = 0
    for e in entries:
        for ids, text in zip(e["request"]["meta"]["response_ids"], e["request"]["responses"]):
            if V - 1 in ids[:-1] or (ids[-1] != V - 1 and len(ids) < 24) or "<eos>" in text:
                failures.append(f"chat prompts: a response runs past its stop token: {ids}")
            stopped += ids[-1] == V - 1
    print(f"chat prompts: {stopped} of {len(entries) * G} responses ended on <eos>")


def bad_specs(root, setup_, failures):
    model, prompts, script = setup_
    base = args("online_grpo", model, prompts, script, os.path.join(root, "bad"), max_steps=1)
    cases = [({"reward_url": "http://127.0.0.1:1/x"}, "reward_command or reward_url"),
             ({"reward_command": ""}, "reward_command or reward_url"),
             ({"pp_size": 2, "nprocs": 2}, "pp_size"),
             ({"val_split": 0.5}, "val_split"),
             ({"reward_command": "/nonexistent/reward"}, "cannot run '/nonexistent/reward'"),
             ({"train_type": "online_dpo", "group_size": 1}, "group_size"),
             ({"reward_url": "https://example.com/", "reward_command": ""}, "https")]
    for extra, words in cases:
        a = {**base, **extra}
        a = {k: v for k, v in a.items() if v != ""}
        p = subprocess.run([tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 2 or words not in p.stderr:
            failures.append(f"{extra}: exit {p.returncode}, expected 2 with '{words}':\n"
                            f"{p.stderr[-400:]}")


def through_astraid(root, setup_, one_rank, failures):
    """The same job submitted to astraid: completed, with the same rows; its JOB, /metrics and
    `astraictl status` show the newest step's reward statistics."""
    import daemon_util as du
    from test_daemon_http import http_get
    model, prompts, script = setup_
    droot, port = os.path.join(root, "daemon"), tu.free_port()
    os.makedirs(droot)
    d = du.Daemon(droot, args=[f"--http=127.0.0.1:{port}"]).start()
    with du.guarded(d):
        c = d.client()
        a = args("online_grpo", model, prompts, script, os.path.join(root, "via-daemon"),
                 max_steps=5)
        job = c.call("submit", dict(a, name="online"))["job"]
        done = du.wait_job(c, job, ["completed"])
        c.close()
        metrics = http_get(port, "/metrics")[2].decode()
        status, _ = tu.run([tu.binary("astraictl"), "--socket", d.socket, "status", str(job)])
        d.stop()
    last = one_rank[-1]
    gauge = f'astrai_job_reward_mean{{job_id="{job}",job_name="online"}} '
    line = next((x for x in metrics.splitlines() if x.startswith(gauge)), None)
    if line is None or abs(float(line.split()[-1]) - last["reward_mean"]) > 1e-5:
        failures.append(f"through astraid: /metrics has {line!r} for reward_mean "
                        f"{last['reward_mean']}")
    if f"reward {last['reward_mean']:.3g} (std {last['reward_std']:.3g})" not in status:
        failures.append(f"through astraid: astraictl status does not show the reward:\n{status}")
    same_rows(tu.metric_rows(done["last_checkpoint"]), one_rank, "through astraid", failures)
    for key in ("reward_mean", "reward_std", "response_len", "equal_reward_groups"):
        if done.get(key) is None or abs(done[key] - last[key]) > 1e-5 * max(1, abs(last[key])):
            failures.append(f"through astraid: JOB {key} {done.get(key)}, the last step's "
                            f"{last[key]}")


def main():
    root = tu.tmpdir()
    setup_ = setup(root)
    failures = []
    grpo = against_reference(root, setup_, "online_grpo", failures)
    against_reference(root, setup_, "online_dpo", failures)
    kept_rollouts(root, setup_, failures)
    accumulation_bf16(root, setup_, failures)
    reward_rises(root, setup_, failures)
    distributed(root, setup_, grpo, failures)
    reward_url(root, setup_, grpo, failures)
    faults(root, setup_, grpo, failures)
    sigterm_in_rollout(root, setup_, grpo, failures)
    hostile(root, setup_, failures)
    through_astraid(root, setup_, grpo, failures)
    chat_prompts(root, failures)
    bad_specs(root, setup_, failures)
    sys.exit(tu.finish(failures))


if __name__ == "__main__":
    main()
