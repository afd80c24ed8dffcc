"""AstrAI's train.py flags (commit c8b1e40) in astrai-train (issue 8): every flag is parsed with
AstrAI's spelling and default (checked through --dry-run's resolved configuration), and a
non-default value either changes the configuration, warns (one stderr line), or is refused with
exit 2 and a reason. Also: --metrics (the step rows' keys, resume), -c/--config YAML (the
command line wins), --x v / --no-x forms, the position-id bad-input case (exit 2), and AstrAI's
documented command lines for a few steps; --dry-run's account of the parameters (a MoE model's
active ones per token) and of what each rank holds (stage, ddp/fsdp share, experts under
ep_size), checked against the config's shapes."""

import json
import os
import sys

import numpy as np

import train_util as tu

WINDOW = 16
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg)


def run(args, expect=None, cwd=None):
    import subprocess
    proc = subprocess.run([tu.binary("astrai-train")] + args, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    if expect is not None and proc.returncode != expect:
        check(False, f"{' '.join(args)}: exit {proc.returncode}, expected {expect}\n"
                     f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def resolved(stdout):
    """--dry-run's "key = value" lines as a dict."""
    out = {}
    for line in stdout.splitlines():
        if " = " in line and not line.startswith("#"):
            k, v = line.split(" = ", 1)
            out[k] = v
    return out


def same(got, want):
    try:
        return abs(float(got) - float(want)) <= 1e-12 * max(1.0, abs(float(want)))
    except ValueError:
        return got == want


# AstrAI flag → (AstrAI's default as our dry-run prints it (None: AstrAI's None, printed as our
# "unset" value), a non-default value, what it does: "set" | "warn" | "refuse").
NONE = {"window_size": "0", "stride": "0", "val_split": "0", "compile": "", "min_rate": "0.01",
        "cycle_length": "0", "stable_steps": "0", "decay_steps": "0", "tp_size": "0"}
FLAGS = {
    "resume": ("false", None, None),  # needs a checkpoint: test_train_resume covers it
    "n_epoch": ("1", "2", "set"),
    "batch_per_device": ("1", "2", "set"),
    "grad_accum_steps": ("1", "2", "set"),
    "warmup_ratio": ("0.05", "0.1", "set"),
    "max_lr": ("3e-4", "1e-4", "set"),
    "max_grad_norm": ("1.0", "0.5", "set"),
    "weight_decay": ("0.1", "0.05", "set"),
    "muon_momentum": ("0.95", "0.9", "set"),
    "muon_nesterov": ("true", "false", "set"),
    "muon_ns_steps": ("5", "3", "set"),
    "muon_adjust_lr": ("match_rms_adamw", "original", "set"),
    "random_seed": ("3407", "7", "set"),
    "num_workers": ("4", "8", "warn"),
    "pin_memory": ("true", "false", "warn"),
    "window_size": (None, "8", "set"),
    "stride": (None, "4", "set"),
    "dpo_beta": ("0.1", "0.2", "set"),
    "group_size": ("4", "8", "set"),
    "grpo_clip_eps": ("0.2", "0.3", "set"),
    "grpo_kl_coef": ("0.01", "0.02", "set"),
    "label_smoothing": ("0.0", "0.05", "set"),
    "rollout_interval": ("512", "256", "warn"),
    "rollout_temperature": ("0.7", "1.0", "warn"),
    "rollout_top_k": ("0", "5", "warn"),
    "rollout_top_p": ("0.9", "0.8", "warn"),
    "rollout_max_tokens": ("1024", "64", "warn"),
    "gradient_checkpointing": ("false", "true", "set"),
    "compile": (None, "default", "warn"),
    "ckpt_interval": ("5000", "100", "set"),
    "ckpt_dir": ("checkpoint", None, None),  # set in every other run
    "val_split": (None, "0.1", "set"),
    "val_step": ("1000", "50", "set"),
    "metrics": ("loss,lr,grad_norm", "loss", "set"),
    "start_epoch": ("0", "1", "set"),
    "start_samples": ("0", "3", "set"),
    "master_addr": ("localhost", "127.0.0.1", "set"),
    "master_port": ("29500", "29555", "set"),
    "backend": ("nccl", "gloo", "set"),
    "nprocs": ("1", "2", "set"),
    "parallel_mode": ("fsdp", "ddp", "set"),
    "device_type": ("auto", "cpu", "set"),  # AstrAI: cuda; ours picks cuda when a GPU is there
    "start_method": ("spawn", "fork", "warn"),
    "neftune_alpha": ("0.0", "5.0", "set"),
    "schedule_type": ("cosine", "wsd", "set"),
    "min_rate": (None, "0.1", "set"),
    "cycle_length": (None, "10", "set"),
    "t_mult": ("2", "3", "set"),
    "stable_steps": (None, "10", "set"),
    "decay_steps": (None, "10", "set"),
    "tp_size": (None, "2", "refuse"),
}


def base(model, data, root):
    return ["--train_type=seq", f"--param_path={model}", f"--data_root_path={data}",
            f"--window_size={WINDOW}", f"--ckpt_dir={os.path.join(root, 'ck')}", "--threads=1"]


def check_table(model, data, root):
    # Defaults: no ckpt_dir, no window_size given (AstrAI's None: max_position_embeddings).
    p = run(["--train_type=seq", f"--param_path={model}", f"--data_root_path={data}",
             "--dry-run"], expect=0, cwd=root)
    conf = resolved(p.stdout)
    check(not p.stderr.strip(), f"defaults: unexpected stderr {p.stderr!r}")
    for flag, (default, value, what) in FLAGS.items():
        want = NONE[flag] if default is None else default
        check(flag in conf and same(conf[flag], want),
              f"--{flag}: default {conf.get(flag)!r}, want {want!r}")
        if value is None:
            continue
        args = base(model, data, root) + [f"--{flag}={value}", "--dry-run"]
        if flag == "window_size" or flag == "stride":
            args = [a for a in args if not a.startswith("--window_size")] + [f"--{flag}={value}"]
        p = run(args)
        if what == "set":
            check(p.returncode == 0, f"--{flag}={value}: exit {p.returncode}: {p.stderr}")
            got = resolved(p.stdout).get(flag)
            check(got is not None and same(got, value), f"--{flag}={value}: resolved {got!r}")
        elif what == "warn":
            warn = [ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]
            check(p.returncode == 0 and len(warn) == 1 and f"--{flag}" in warn[0]
                  and "changes nothing" in warn[0], f"--{flag}={value}: {p.returncode} {warn}")
        else:
            check(p.returncode == 2 and flag in p.stderr and
                  ("not supported yet" in p.stderr or "refused" in p.stderr),
                  f"--{flag}={value}: exit {p.returncode}, stderr {p.stderr!r}")
    print(f"ok? table of {len(FLAGS)} AstrAI flags")
    # backend: gloo picks the CPU; a contradiction is named.
    conf = resolved(run(base(model, data, root) + ["--backend=gloo", "--dry-run"], 0).stdout)
    check(conf.get("device_type") == "cpu", f"--backend=gloo: device_type {conf.get('device_type')}")
    p = run(base(model, data, root) + ["--backend=gloo", "--device_type=cuda", "--dry-run"], 2)
    check("backend" in p.stderr and "cuda" in p.stderr, f"gloo+cuda: {p.stderr!r}")
    # dpo/grpo train on records (tests/test_train_pref.py): a token-window dataset is refused.
    for tt, word in (("online_grpo", "reward"), ("online_dpo", "reward"),
                     ("dpo", "record"), ("grpo", "record")):
        p = run(base(model, data, root)[1:] + [f"--train_type={tt}", "--dry-run"], 2)
        check(word in p.stderr, f"--train_type={tt}: {p.stderr!r}")
    check(run(base(model, data, root) + ["--tp_size=1", "--dry-run"], 0).returncode == 0,
          "--tp_size=1 refused")
    # Spellings: --x v, --no-x, repeated --metrics equal to the default.
    p = run(base(model, data, root) + ["--max_lr", "2e-4", "--no-muon_nesterov", "--no-shuffle",
                                        "--metrics", "loss", "--metrics", "lr", "--metrics",
                                        "grad_norm", "--dry-run"], 0)
    conf = resolved(p.stdout)
    check(same(conf.get("max_lr"), "2e-4") and conf.get("muon_nesterov") == "false"
          and conf.get("shuffle") == "false" and conf.get("metrics") == "loss,lr,grad_norm",
          f"spellings: {conf}")
    p = run(base(model, data, root) + ["--no-max_lr", "--dry-run"], 2)
    check("unknown key" in p.stderr, f"--no-max_lr: {p.stderr!r}")
    # '-' is '_' in names (as in every binary); --key=true|false for booleans; a boolean alone
    # does not take the next argument; a typo is named with the nearest key.
    p = run(base(model, data, root) + ["--max-lr", "5e-4", "--shuffle=false",
                                        "--gradient-checkpointing", "--dry_run"], 0)
    conf = resolved(p.stdout)
    check(same(conf.get("max_lr"), "5e-4") and conf.get("shuffle") == "false"
          and conf.get("gradient_checkpointing") == "true", f"spellings: {conf}")
    p = run(base(model, data, root) + ["--shuffle", "false", "--dry-run"], 2)
    check("unexpected argument 'false'" in p.stderr, f"--shuffle false: {p.stderr!r}")
    p = run(base(model, data, root) + ["--max_lrr=1", "--dry-run"], 2)
    check("unknown key 'max_lrr' (did you mean 'max_lr'?)" in p.stderr, f"typo: {p.stderr!r}")
    p = run(base(model, data, root) + ["--max_lr"], 2)
    check("--max_lr needs a value" in p.stderr, f"--max_lr without value: {p.stderr!r}")
    # --help groups as AstrAI's config sections.
    out = run(["--help"], 0).stdout
    check(out == run(["-h"], 0).stdout and "-c, --config FILE" in out and "--dry-run" in out,
          f"--help: {out[:400]!r}")
    for group in ("model:", "data:", "parallel:", "training:", "ckpt:", "log:"):
        check(f"\n{group}\n" in out, f"--help lacks group {group}")
    # --dry-run checks files: bad model dir, bad data root, unwritable ckpt_dir.
    p = run(base(model, data, root) + [f"--param_path={root}/nope", "--dry-run"], 2)
    check("nope" in p.stderr, f"dry-run bad model: {p.stderr!r}")
    p = run(base(model, data, root) + [f"--data_root_path={root}/nodata", "--dry-run"], 2)
    check("nodata" in p.stderr, f"dry-run bad data: {p.stderr!r}")
    if os.geteuid() != 0:
        ro = os.path.join(root, "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o500)
        p = run(base(model, data, root) + [f"--ckpt_dir={ro}/ck", "--dry-run"], 2)
        check("not writable" in p.stderr, f"dry-run ro ckpt_dir: {p.stderr!r}")
    check(not os.path.exists(os.path.join(root, "ck", "progress.db")),
          "--dry-run wrote progress.db into ckpt_dir")


# ------------------------------------------------------------- --dry-run's account of the ranks

MOE_CONFIG = dict(tu.SMALL_CONFIG, num_hidden_layers=4, tie_word_embeddings=True,
                  attn_type="mla", kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=4,
                  num_key_value_heads=4, intermediate_size=32, ffn_type="moe",
                  n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
                  topk_method="greedy")
RANK_LINE = (r"# rank (\d+): stage (\d+) of (\d+), blocks? (\d+)(?:-(\d+))?(, embedding)?"
             r"(, head)?: (\d+) parameters \((\d+) tensors\)(?:, (\d+) active per token)?; (.*)")


def inactive(cfg, blocks):
    """Parameters of `blocks` MoE blocks a token does not compute with: the E - k routed experts
    it is not sent to (up, gate, down: 3 x intermediate x hidden each)."""
    if cfg.get("ffn_type") != "moe":
        return 0
    return blocks * (cfg["n_routed_experts"] - cfg["n_activated_experts"]) * 3 * \
        cfg["intermediate_size"] * cfg["hidden_size"]


def stage_tensors(cfg, first, end):
    """[(name, numel)] of a pipeline stage of blocks [first, end) in AstrAI order
    (docs/design.md §13): the embedding on the first, the final norm and the head on the last
    (a tied head there, without the embedding, is a copy of it)."""
    from ref.model import param_shapes
    shapes = {k: int(np.prod(v)) for k, v in param_shapes(cfg).items()}
    L = cfg["num_hidden_layers"]
    out = [("embed_tokens.weight", shapes["embed_tokens.weight"])] if first == 0 else []
    out += [(k, n) for k, n in shapes.items()
            if k.startswith("layers.") and first <= int(k.split(".")[1]) < end]
    if end == L:
        out.append(("norm.weight", shapes["norm.weight"]))
        if not cfg["tie_word_embeddings"]:
            out.append(("lm_head.weight", shapes["lm_head.weight"]))
        elif first > 0:
            out.append(("embed_tokens.weight", shapes["embed_tokens.weight"]))
    return out


def greedy_owners(tensors, world):
    """train/executor.h's ownership by whole tensors (one gradient bucket, as CPU ranks and
    models under 25 MiB have): the largest first (ties in table order), each to the rank with the
    fewest parameters so far (the lowest such rank)."""
    load, owner = [0] * world, [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: -tensors[i][1]):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += tensors[i][1]
    return owner


def dry_run_ranks(stdout):
    """(the "# model:" line, {rank: the fields of its "# rank" line})."""
    import re
    model = [ln for ln in stdout.splitlines() if ln.startswith("# model: ")]
    ranks = {}
    for ln in stdout.splitlines():
        m = re.fullmatch(RANK_LINE, ln)
        if m:
            g, st, P, a, b, emb, head, n, nt, active, share = m.groups()
            ranks[int(g)] = dict(stage=int(st), stages=int(P), first=int(a),
                                 end=int(b if b is not None else a) + 1, embedding=bool(emb),
                                 head=bool(head), params=int(n), tensors=int(nt),
                                 active=None if active is None else int(active), share=share)
        elif ln.startswith("# rank"):
            check(False, f"--dry-run: a rank line not in the expected form: {ln!r}")
    return (model[0] if len(model) == 1 else None), ranks


def expected_share(cfg, mode, stage_t, owner, replica, replicas, ep):
    """What the "# rank" line says after the stage's parameters."""
    mine = [t for t, o in zip(stage_t, owner) if o == replica]
    n, nt = sum(x for _, x in mine), len(mine)
    if replicas == 1 or mode == "none":
        text = "holds and steps all of them"
    elif mode == "ddp":
        text = f"ddp: holds all of them, steps {n} ({nt} tensors)"
    else:
        text = f"fsdp: holds and steps {n} ({nt} tensors), gathers the rest for each micro-batch"
    if ep > 1:
        per = cfg["n_routed_experts"] // ep
        q = replica % ep
        text += f"; ep: computes routed experts {q * per}-{(q + 1) * per - 1} of each MoE layer"
    return text


def check_dry_run_ranks(model, data, root):
    """--dry-run prints the model's parameters (a MoE model's active ones per token too) and what
    each rank of the job holds: its pipeline stage's blocks and parameters, the tensors it owns
    under ddp/fsdp (whole tensors, greedy by size), the routed experts it computes under ep_size.
    Every number is computed here from the config's shapes."""
    from ref.model import param_shapes
    moe = tu.make_model(os.path.join(root, "moe"), MOE_CONFIG)
    dense_total = sum(int(np.prod(v)) for v in param_shapes(tu.SMALL_CONFIG).values())
    out = run(base(model, data, root) + ["--dry-run"], 0).stdout
    line, ranks = dry_run_ranks(out)
    check(line == f"# model: {dense_total} parameters" and list(ranks) == [0] and
          ranks[0]["share"] == "holds and steps all of them" and ranks[0]["active"] is None,
          f"--dry-run of the dense model: {line!r}, {ranks}")
    cfg, L = MOE_CONFIG, MOE_CONFIG["num_hidden_layers"]
    total = sum(int(np.prod(v)) for v in param_shapes(cfg).values())
    active = total - inactive(cfg, L)
    for mode, nprocs, pp, ep in (("none", 1, 1, 1), ("ddp", 2, 1, 1), ("fsdp", 3, 1, 1),
                                 ("fsdp", 4, 2, 2), ("none", 2, 2, 1), ("ddp", 4, 1, 2),
                                 ("none", 4, 4, 1)):
        what = f"--dry-run of the MoE model, {mode} nprocs {nprocs} pp_size {pp} ep_size {ep}"
        p = run(base(moe, data, root) + [f"--parallel_mode={mode}", f"--nprocs={nprocs}",
                                         f"--pp_size={pp}", f"--ep_size={ep}", "--dry-run"])
        if p.returncode != 0:
            check(False, f"{what}: exit {p.returncode}: {p.stderr}")
            continue
        line, ranks = dry_run_ranks(p.stdout)
        want = f"# model: {total} parameters ({active} active per token: 2 of 4 routed experts)"
        check(line == want, f"{what}: {line!r}, want {want!r}")
        check(sorted(ranks) == list(range(nprocs)), f"{what}: rank lines {sorted(ranks)}")
        if sorted(ranks) != list(range(nprocs)):
            continue
        replicas = nprocs // pp
        stages = sorted({(r["stage"], r["first"], r["end"]) for r in ranks.values()})
        check([s for s, _, _ in stages] == list(range(pp)) and stages[0][1] == 0 and
              stages[-1][2] == L and all(a[2] == b[1] and a[1] < a[2]
                                         for a, b in zip(stages, stages[1:] + [(0, L, 0)])),
              f"{what}: stages {stages} do not cut the {L} blocks in {pp}")
        for g, r in ranks.items():
            stage, replica = g % pp, g // pp
            tensors = stage_tensors(cfg, r["first"], r["end"])
            owner = greedy_owners(tensors, replicas)
            n = sum(x for _, x in tensors)
            got = (r["stage"], r["stages"], r["embedding"], r["head"], r["params"], r["tensors"],
                   r["active"], r["share"])
            exp = (stage, pp, r["first"] == 0, r["end"] == L, n, len(tensors),
                   n - inactive(cfg, r["end"] - r["first"]),
                   expected_share(cfg, mode, tensors, owner, replica, replicas, ep))
            check(got == exp, f"{what}: rank {g}: {got}, want {exp}")
        if mode != "none" and replicas > 1:  # the shares add up to the stage, each tensor once
            for st in range(pp):
                tensors = stage_tensors(cfg, *[(a, b) for s, a, b in stages if s == st][0])
                owned = sorted(greedy_owners(tensors, replicas))
                check(set(owned) == set(range(replicas)), f"{what}: a replica of stage {st} "
                      f"owns nothing: {owned}")
    print("ok? --dry-run: parameters, active per token, each rank's stage and share")


def check_changes(model, data, root):
    """Implemented knobs change the run: --no-muon_nesterov and --muon_adjust_lr change step 2;
    --start_samples/--start_epoch set where a fresh run starts."""
    def steps(name, extra):
        ck = os.path.join(root, name)
        run(base(model, data, root)[:-2] + [f"--ckpt_dir={ck}", "--threads=1", "--max_steps=3",
                                             "--batch_per_device=2", "--warmup_ratio=0",
                                             "--max_lr=1e-2"] + extra, 0)
        return tu.metric_rows(tu.latest_checkpoint(ck))

    ref = steps("ref", [])
    for extra in (["--no-muon_nesterov"], ["--muon_adjust_lr=original"], ["--muon_ns_steps=2"],
                  ["--muon_momentum=0.5"]):
        rows = steps("x" + extra[0].replace("-", ""), extra)
        # Step 1's Muon update is the orthogonalised gradient whatever the momentum knobs;
        # they show from step 2 (its loss is row 3's).
        check(rows[0]["loss"] == ref[0]["loss"] and rows[2]["loss"] != ref[2]["loss"],
              f"{extra}: step losses {[r['loss'] for r in rows]} vs {[r['loss'] for r in ref]}")
    rows = steps("start", ["--start_samples=5", "--start_epoch=1", "--n_epoch=2"])
    check(rows[0]["epoch"] == 1 and rows[0]["consumed_samples"] == 7,
          f"--start_samples=5 --start_epoch=1: first row {rows[0]}")
    print("ok? muon knobs and start position change the run")


STEP_KEYS = {"type", "timestamp", "epoch", "step", "consumed_samples"}


def check_metrics(model, data, root):
    """--metrics picks the keys of metric.jsonl's step rows (repeated, comma-separated, YAML
    list); validation rows come whatever it says; progress.db keeps every number; a resumed run
    keeps the restored rows' keys and writes its own selection from then on."""
    import sqlite3

    def rows(ck):
        return tu.all_metric_rows(tu.latest_checkpoint(ck))

    def train(name, extra, steps=2):
        ck = os.path.join(root, name)
        p = run(base(model, data, root)[:-2] + [f"--ckpt_dir={ck}", "--threads=1",
                                                 f"--max_steps={steps}", "--log_interval=1"]
                + extra, 0)
        return ck, p.stderr

    cases = [("rep", ["--metrics", "loss", "--metrics", "lr"], {"loss", "lr"}),
             ("comma", ["--metrics=grad_norm,val_loss", "--val_split=0.1", "--val_step=1"],
              {"grad_norm"}),
             ("default", [], {"loss", "lr", "grad_norm"})]
    yaml = os.path.join(root, "metrics.yaml")
    with open(yaml, "w") as f:
        f.write("log:\n  metrics: [loss]\n")
    cases.append(("yaml", ["-c", yaml], {"loss"}))
    for name, extra, want in cases:
        ck, err = train(name, extra)
        got = rows(ck)
        steps = [r for r in got if r["type"] == "step"]
        check(len(steps) == 2 and all(set(r) == STEP_KEYS | want for r in steps),
              f"--metrics {extra}: step rows {steps}")
        vals = [r for r in got if r["type"] == "validation"]
        check(len(vals) == (2 if "--val_split=0.1" in extra else 0)
              and all(set(r) == STEP_KEYS | {"val_loss"} for r in vals),
              f"--metrics {extra}: validation rows {vals}")
        with sqlite3.connect(os.path.join(ck, "progress.db")) as db:
            full = db.execute("SELECT count(*) FROM steps WHERE loss IS NOT NULL AND lr IS NOT "
                              "NULL AND grad_norm IS NOT NULL").fetchone()[0]
        check(full == 2, f"--metrics {extra}: progress.db has {full} complete step rows")
        check(err.count("grad_norm") >= 2, f"--metrics {extra}: progress lines {err!r}")
    # Resume from the loss,lr checkpoint with the default selection: rows 1-2 as they were.
    ck = os.path.join(root, "rep")
    before = [{k: v for k, v in r.items() if k != "timestamp"} for r in rows(ck)]
    run(base(model, data, root)[:-2] + [f"--ckpt_dir={ck}", "--threads=1", "--max_steps=4",
                                         "--resume"], 0)
    after = [{k: v for k, v in r.items() if k != "timestamp"} for r in rows(ck)]
    check(after[:2] == before and [r["step"] for r in after] == [1, 2, 3, 4]
          and all(set(r) == STEP_KEYS - {"timestamp"} | {"loss", "lr", "grad_norm"}
                  for r in after[2:]), f"--metrics resume: {before} then {after}")
    for bad, why in (("--metrics=los", "metrics: 'los' is not one of"),
                     ("--metrics=", "names no metric")):
        p = run(base(model, data, root) + [bad, "--dry-run"], 2)
        check(why in p.stderr, f"{bad}: {p.stderr!r}")
    print("ok? --metrics selects the step rows' keys")


def check_yaml(model, data, root):
    cfg = os.path.join(root, "train.yaml")
    with open(cfg, "w") as f:
        f.write(f"""# AstrAI's sections, flattened
model:
  param_path: {model}
data:
  train_type: seq
  data_root_path: {data}
  window_size: {WINDOW}
  stride: null
parallel:
  parallel_mode: none
  nprocs: 1
training:
  max_lr: 1.0e-4
  n_epoch: 3
  muon_nesterov: false
  metrics: [loss, lr, grad_norm]
ckpt:
  ckpt_dir: {os.path.join(root, 'yck')}
  ckpt_interval: 77
log:
  log_interval: 5
""")
    p = run(["-c", cfg, "--n_epoch=2", "--dry-run"], 0)
    conf = resolved(p.stdout)
    want = {"train_type": "seq", "param_path": model, "window_size": str(WINDOW), "stride": "0",
            "parallel_mode": "none", "max_lr": "1e-4", "n_epoch": "2", "muon_nesterov": "false",
            "ckpt_interval": "77", "log_interval": "5", "metrics": "loss,lr,grad_norm"}
    for k, v in want.items():
        check(same(conf.get(k), v), f"yaml: {k} = {conf.get(k)!r}, want {v!r}")
    p = run(["--config", cfg, "--max_lr=2e-4", "--dry-run"], 0)
    check(same(resolved(p.stdout).get("max_lr"), "2e-4"), "yaml: --max_lr after -c does not win")
    p = run(["--max_lr=2e-4", f"--config={cfg}", "--dry-run"], 0)
    check(same(resolved(p.stdout).get("max_lr"), "2e-4"), "yaml: --max_lr before -c does not win")
    bad = os.path.join(root, "bad.yaml")
    with open(bad, "w") as f:
        f.write("training:\n  max_lrr: 1\n")
    p = run(["-c", bad, "--dry-run"], 2)
    check("bad.yaml" in p.stderr and "max_lr" in p.stderr, f"yaml unknown key: {p.stderr!r}")
    with open(bad, "w") as f:
        f.write("training: [1, 2\n")
    p = run(["-c", bad, "--dry-run"], 2)
    check("bad.yaml" in p.stderr, f"yaml syntax: {p.stderr!r}")
    print("ok? yaml config")


def write_sft(root, name, n, max_pos):
    """An sft shard: sequence, loss_mask, position_ids (int32)."""
    d = os.path.join(root, name, "shard_0000")
    os.makedirs(d)
    rng = np.random.default_rng(1)
    arrays = {"sequence": rng.integers(0, 256, n), "loss_mask": np.ones(n),
              "position_ids": np.arange(n) % max_pos}
    meta = {}
    for key, a in arrays.items():
        a.astype("<i4").tofile(os.path.join(d, key + ".bin"))
        meta[key] = {"shape": [n], "dtype": "int32"}
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f)
    return os.path.join(root, name), os.path.join(d, "position_ids.bin")


def check_positions(model, root):
    data, pos = write_sft(root, "sft_bad", 400, 32)
    ids = np.fromfile(pos, dtype="<i4")
    ids[123] = 40  # past max_position_embeddings 32
    ids.tofile(pos)
    args = base(model, data, root)[1:] + ["--train_type=sft", "--max_steps=1"]
    for extra in ([], ["--dry-run"]):
        p = run(args + extra, 2)
        check("position_ids" in p.stderr and "40" in p.stderr and data in p.stderr
              and "max_position_embeddings" in p.stderr, f"position id: {p.stderr!r}")
    print("ok? position id past max_position_embeddings: exit 2")


def check_documented(model, root):
    """AstrAI's guides' command lines (training.md, distributed.md) with paths substituted,
    window_size 2048 → 16 (the test model's max_position_embeddings is 32), a few steps."""
    seq, _ = tu.make_text_data(root, 20000, "seqdata")
    sft, _ = write_sft(root, "sftdata", 20000, 32)
    lines = [
        f"--nprocs=4 --parallel_mode=ddp --train_type=seq --data_root_path={seq} "
        f"--param_path={model} --batch_per_device=4 --grad_accum_steps=8 --warmup_ratio=0.05 "
        f"--max_lr=1e-4 --max_grad_norm=1.0 --weight_decay=0.1 --window_size={WINDOW} "
        f"--ckpt_interval=10000 --ckpt_dir=./checkpoint --random_seed=3407 "
        f"--label_smoothing=0.05",
        f"--train_type=sft --param_path {model} --data_root_path {sft} --parallel_mode=none "
        f"--nprocs=1 --batch_per_device=4 --grad_accum_steps=8",
        f"--train_type=sft --param_path {model} --data_root_path {sft} --parallel_mode=ddp "
        f"--nprocs=4 --batch_per_device=4 --grad_accum_steps=8",
        f"--train_type=sft --param_path {model} --data_root_path {sft} --parallel_mode=fsdp "
        f"--nprocs=4 --batch_per_device=4 --grad_accum_steps=8",
        f"--train_type=seq --param_path {model} --data_root_path {seq} --parallel_mode=ddp "
        f"--nprocs=4 --n_epoch=1 --max_lr=2e-4 --schedule_type=wsd --warmup_ratio=0.02 "
        f"--window_size={WINDOW} --batch_per_device=4 --grad_accum_steps=32 --ckpt_interval=2000",
    ]
    for i, line in enumerate(lines):
        cwd = os.path.join(root, f"doc{i}")
        os.makedirs(cwd)
        args = line.split() + ["--max_steps=2", "--threads=1"]
        if "--window_size" not in line:
            args.append(f"--window_size={WINDOW}")
        run(args, 0, cwd=cwd)
        ck = os.path.join(cwd, "checkpoint")
        rows = tu.metric_rows(tu.latest_checkpoint(ck))
        check(len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows),
              f"documented line {i}: rows {rows}")
    print(f"ok? {len(lines)} documented command lines")


def main():
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, 3000)
    check_table(model, data, root)
    check_dry_run_ranks(model, data, root)
    check_changes(model, data, root)
    check_metrics(model, data, root)
    check_yaml(model, data, root)
    check_positions(model, root)
    check_documented(model, root)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
