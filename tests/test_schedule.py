"""engine/schedule.c against AstrAI's schedules (astrai/trainer/schedule.py, with the defaults
that scripts/tools/train.py resolves), at chosen steps and edge cases.

The reference below follows AstrAI's Python line by line; the one deliberate difference is the
guard against its endless SGDR loop (a cycle shorter than one step, or t_mult < 1).
"""

import math
import os
import subprocess
import sys

BUILD = os.environ["ASTRAI_BUILD"]


def resolve(kind, total, warmup_ratio, stable_steps, decay_steps, cycle_length, t_mult):
    """scripts/tools/train.py: scheduler kwargs from the flags (0 / None = not set)."""
    warmup = min(int(warmup_ratio * total), total)
    kw = {"warmup_steps": warmup}
    if kind == "cosine":
        kw["lr_decay_steps"] = total - warmup
    elif kind == "sgdr":
        kw["cycle_length"] = max(1, cycle_length or (total - warmup))  # guard: AstrAI loops
        kw["t_mult"] = max(1, t_mult)
    else:
        remaining = total - warmup
        stable = stable_steps or max(1, int(remaining * 0.8))
        kw["stable_steps"] = stable
        kw["decay_steps"] = max(1, decay_steps or (remaining - stable))
    return kw


def reference_factor(kind, t, min_rate, warmup_steps, **kw):
    """get_lr() / base_lr of AstrAI's CosineScheduler, WSDScheduler and SGDRScheduler."""
    if t < warmup_steps:
        return max(min_rate, t / max(warmup_steps, 1))
    if kind == "cosine":
        progress = min((t - warmup_steps) / max(kw["lr_decay_steps"], 1), 1.0)
        return max(min_rate, 0.5 * (1.0 + math.cos(math.pi * progress)))
    if kind == "wsd":
        offset = t - warmup_steps
        if offset < kw["stable_steps"]:
            return 1.0
        ratio = min((offset - kw["stable_steps"]) / max(kw["decay_steps"], 1), 1.0)
        return (1.0 - min_rate) * (1.0 - ratio) ** 2 + min_rate
    since = t - warmup_steps
    length, start = kw["cycle_length"], 0
    while start + length <= since:
        start += length
        length *= kw["t_mult"]
    cosine = 0.5 * (1 + math.cos(math.pi * (since - start) / length))
    return min_rate + (1 - min_rate) * cosine


def c_factors(kind, total, ratio, min_rate, stable, decay, cycle, t_mult, steps):
    args = [kind, total, ratio, min_rate, stable, decay, cycle, t_mult, *steps]
    out = subprocess.run(
        [os.path.join(BUILD, "schedule_factors"), *map(str, args)],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout.split()
    return [float(x) for x in out]


# (kind, total, warmup_ratio, min_rate, stable, decay, cycle, t_mult, steps)
CASES = [
    # cosine: 0, inside warmup, W-1, W, W+1, mid, end-1, end, beyond
    ("cosine", 100, 0.1, 0.01, 0, 0, 0, 2, [0, 1, 5, 9, 10, 11, 55, 99, 100, 101, 1000]),
    ("cosine", 100, 0.0, 0.01, 0, 0, 0, 2, [0, 1, 50, 99, 100, 250]),  # W = 0
    ("cosine", 100, 0.29, 0.0, 0, 0, 0, 2, [27, 28, 29, 64, 100]),  # int(0.29*100) = 28
    ("cosine", 100, 0.1, 0.3, 0, 0, 0, 2, [0, 2, 10, 80, 100]),  # min_rate floors both parts
    ("cosine", 0, 0.1, 0.01, 0, 0, 0, 2, [0, 1, 7]),  # total = 0
    ("cosine", 10, 1.0, 0.01, 0, 0, 0, 2, [0, 3, 9, 10, 11]),  # all warmup
    ("cosine", 7, 0.05, 0.01, 0, 0, 0, 2, [0, 3, 6, 7]),  # W truncates to 0
    ("cosine", 10, 1.5, 0.01, 0, 0, 0, 2, [0, 9, 10, 14, 15]),  # W capped at total
    # wsd defaults: W=10, S=int(0.8*90)=72, D=18; stable/decay boundary at t = W+S = 82
    ("wsd", 100, 0.1, 0.01, 0, 0, 0, 2, [0, 5, 9, 10, 50, 81, 82, 83, 91, 99, 100, 150]),
    ("wsd", 100, 0.1, 0.05, 20, 30, 0, 2, [10, 29, 30, 31, 45, 59, 60, 61, 500]),
    ("wsd", 100, 0.1, 0.01, 200, 0, 0, 2, [10, 100, 209, 210, 211, 212]),  # S > remaining: D=1
    ("wsd", 0, 0.1, 0.01, 0, 0, 0, 2, [0, 1, 2, 3]),  # total = 0
    ("wsd", 1, 0.0, 0.01, 0, 0, 0, 2, [0, 1, 2]),
    ("wsd", 7, 0.0, 0.01, 0, 0, 0, 2, [4, 5, 6, 7]),  # S = int(5.6) = 5, D = 2
    ("wsd", 100, 0.0, 0.01, 0, 0, 0, 2, [0, 79, 80, 81, 99, 100]),  # W = 0
    # sgdr with t_mult 2: cycles since warmup [0,10), [10,30), [30,70), [70,150)
    ("sgdr", 100, 0.1, 0.01, 0, 0, 10, 2,
     [0, 5, 10, 15, 19, 20, 39, 40, 79, 80, 100, 159, 160, 1000, 10**12]),
    ("sgdr", 100, 0.1, 0.01, 0, 0, 0, 2, [10, 55, 99, 100, 101, 280, 281]),  # L0 = total - W
    ("sgdr", 50, 0.0, 0.1, 0, 0, 7, 1, [0, 6, 7, 8, 13, 14, 700, 10**7 + 3]),  # t_mult 1
    ("sgdr", 50, 0.0, 0.1, 0, 0, 7, 3, [6, 7, 27, 28, 90, 91]),
    ("sgdr", 10, 1.0, 0.01, 0, 0, 0, 2, [0, 9, 10, 11, 12, 100]),  # L0 = 0: guarded to 1
    ("sgdr", 0, 0.1, 0.01, 0, 0, 0, 2, [0, 1, 5]),  # total = 0
    ("sgdr", 40, 0.0, 0.01, 0, 0, 5, 0, [0, 4, 5, 9, 10, 33]),  # t_mult 0: treated as 1
    ("sgdr", 40, 0.0, 0.01, 0, 0, -3, 2, [0, 1, 2, 3, 4]),  # negative cycle: guarded to 1
]


def main():
    failures = 0
    for kind, total, ratio, m, stable, decay, cycle, t_mult, steps in CASES:
        kw = resolve(kind, total, ratio, stable, decay, cycle, t_mult)
        got = c_factors(kind, total, ratio, m, stable, decay, cycle, t_mult, steps)
        assert len(got) == len(steps), (kind, total, got)
        for t, c in zip(steps, got):
            want = reference_factor(kind, t, m, **kw)
            if not abs(c - want) <= 1e-12:
                failures += 1
                print(f"FAIL {kind} total={total} ratio={ratio} m={m} stable={stable} "
                      f"decay={decay} cycle={cycle} t_mult={t_mult} t={t}: C {c!r} vs ref {want!r}")
    # The cases must exercise every branch the formulas have, not just agree.
    ref = lambda *a: reference_factor(a[0], a[1], 0.01, **resolve(a[0], 100, 0.1, 0, 0, 10, 2))
    assert ref("wsd", 81) == 1.0 and ref("wsd", 83) < 1.0
    assert ref("sgdr", 19) < ref("sgdr", 20) == 1.0  # restart at a cycle boundary
    if failures:
        print(f"{failures} factor(s) differ")
        sys.exit(1)
    print(f"ok: {sum(len(c[-1]) for c in CASES)} factors in {len(CASES)} cases")


if __name__ == "__main__":
    main()
