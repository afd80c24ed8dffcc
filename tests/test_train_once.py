"""The lines meant once per job come from rank 0 alone, whichever launcher started the ranks
(the rank of launch_detect, train/launch.h: RANK, else SLURM_PROCID):
- two ranks under srun's variables (SLURM_PROCID without RANK), two under torchrun's (RANK)
  and two of the local launcher (whose parent leaves them to its rank 0), all given an AstrAI
  flag astrai ignores (--num_workers): its warning is printed once in the job, by rank 0;
- rank 1 under srun's variables whose launch fails (no MASTER_ADDR) prints no warning;
- DPO resumed by two ranks from a checkpoint whose meta.json names no reference_path (as
  AstrAI's): the warning that its weights are the reference is printed once."""

import json
import os
import subprocess
import sys

import train_util as tu
from test_launch_util import clean_env
from test_pref_ref import write_jsonl

WINDOW = 32
IGNORED = "warning: --num_workers changes nothing"
NO_REFERENCE = "names no reference_path"


def args(model, data, ckpt, **extra):
    a = {"train_type": "seq", "param_path": model, "data_root_path": data,
         "parallel_mode": "ddp", "batch_per_device": 1, "window_size": WINDOW,
         "ckpt_dir": ckpt, "threads": 1, "max_steps": 2, "ckpt_interval": 1000,
         "comm_timeout": 60, "num_workers": 2}
    a.update(extra)
    return [tu.binary("astrai-train")] + [f"--{k}={v}" for k, v in a.items()]


def run_ranks(cmd, envs, timeout=300):
    """[(exit code, stderr)] of one process per environment, run together."""
    procs = [subprocess.Popen(cmd, env=clean_env(**e), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


def rank_envs(style, world, port):
    envs = []
    for r in range(world):
        e = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        if style == "srun":
            e.update(SLURM_PROCID=r, SLURM_NTASKS=world, SLURM_LOCALID=r)
        else:
            e.update(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, LOCAL_WORLD_SIZE=world)
        envs.append(e)
    return envs


def check_launchers(root, model, data, failures):
    for style in ("srun", "torchrun"):
        results = run_ranks(args(model, data, os.path.join(root, style)),
                            rank_envs(style, 2, tu.free_port()))
        if any(rc != 0 for rc, _ in results):
            failures.append(f"{style}: exits {[rc for rc, _ in results]}: "
                            f"{[err[-300:] for _, err in results]}")
            continue
        counts = [err.count(IGNORED) for _, err in results]
        if counts != [1, 0]:
            failures.append(f"{style}: the ignored flag's warning by rank: {counts}, want [1, 0]")
        print(f"{style}: the warning printed {counts} times by ranks 0 and 1")
    p = subprocess.run(args(model, data, os.path.join(root, "local"), nprocs=2),
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    if p.returncode != 0 or p.stderr.count(IGNORED) != 1:
        failures.append(f"local launch: exit {p.returncode}, the warning "
                        f"{p.stderr.count(IGNORED)} times: {p.stderr[-400:]}")
    print(f"local launch of 2 ranks: the warning printed {p.stderr.count(IGNORED)} time(s)")


def check_failed_launch(root, model, data, failures):
    """No MASTER_ADDR: rank 1 exits 2 naming it, without the warning."""
    for style, var in (("srun", "SLURM_PROCID"), ("torchrun", "RANK")):
        env = rank_envs(style, 2, "29500")[1]
        del env["MASTER_ADDR"]
        (rc, err), = run_ranks(args(model, data, os.path.join(root, "failed")), [env], 60)
        if rc != 2 or "MASTER_ADDR" not in err or IGNORED in err:
            failures.append(f"{var}=1 without MASTER_ADDR: exit {rc}, the warning "
                            f"{err.count(IGNORED)} times (want 0): {err[-300:]}")
    print("rank 1 of a failed launch prints no warning (SLURM_PROCID and RANK)")


def check_reference_warning(root, model, failures):
    data = os.path.join(root, "dpo.jsonl")
    write_jsonl(data, [{"prompt": [1 + i, 2, 3], "chosen": [4, 5 + i], "rejected": [6, 7, 8 + i]}
                       for i in range(8)])
    ckpt = os.path.join(root, "dpo")
    base = {"train_type": "dpo", "data_root_path": data, "ckpt_dir": ckpt, "window_size": 16,
            "parallel_mode": "none", "max_steps": 2}
    tu.run(args(model, data, ckpt, **dict(base, param_path=model)))
    first = tu.latest_checkpoint(ckpt)
    meta_path = os.path.join(first, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta.pop("reference_path", None)  # as AstrAI writes it
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    resumed = dict(base, param_path=first, resume="true", parallel_mode="ddp", nprocs=2,
                   max_steps=4)
    p = subprocess.run(args(model, data, ckpt, **resumed), env=clean_env(), capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0 or p.stderr.count(NO_REFERENCE) != 1:
        failures.append(f"dpo resumed by 2 ranks from a checkpoint without reference_path: exit "
                        f"{p.returncode}, the warning {p.stderr.count(NO_REFERENCE)} times: "
                        f"{p.stderr[-400:]}")
    print(f"dpo resumed by 2 ranks: the reference warning printed "
          f"{p.stderr.count(NO_REFERENCE)} time(s)")


def main():
    failures = []
    root = tu.tmpdir()
    model = tu.make_model(root)
    data, _ = tu.make_text_data(root, 12 * WINDOW + 1)
    check_launchers(root, model, data, failures)
    check_failed_launch(root, model, data, failures)
    check_reference_warning(root, model, failures)
    return tu.finish(failures)


if __name__ == "__main__":
    sys.exit(main())
