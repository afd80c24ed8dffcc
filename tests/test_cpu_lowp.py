"""test_cpu_lowp: the CPU backend's fp16 and bf16 converters (engine/cpu/lowp.h) against
numpy's float16 and torch's bfloat16, through tests/test_cpu_lowp --convert: every fp16 value,
every rounding boundary between two neighbours (the midpoint and the floats either side),
past the fp16 range, subnormals, and random fp32 bit patterns; NaN must stay NaN. Then two
runs of every reduced-dtype op (test_cpu_lowp --dump, on this CPU's GEMM path) must give the
same bits."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

BUILD = os.environ["ASTRAI_BUILD"]
PROG = os.path.join(BUILD, "test_cpu_lowp")


def inputs():
    """fp32 values that exercise fp16 and bf16 rounding."""
    h = np.arange(0x7C00, dtype=np.uint16)  # the finite non-negative fp16 values
    lo = h.view(np.float16).astype(np.float32)
    hi = np.append(lo[1:], np.float32(65536.0))  # the next one up (65536 past the top)
    mid = (lo + hi) / 2  # exact in fp32: fp16 has 11 significant bits
    edges = [mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf)), lo]
    rng = np.random.default_rng(7)
    random_bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    special = np.array([np.inf, 65519.996, 65520.0, 1e5, 3e38, 2.0**-25, 2.0**-26, 1e-40, 0.0],
                       dtype=np.float32)
    x = np.concatenate(edges + [special])
    return np.concatenate([x, -x, random_bits.view(np.float32), np.float32([np.nan])])


def check_converters(tmp, failures):
    x = inputs()
    src, dst = os.path.join(tmp, "in.f32"), os.path.join(tmp, "out.bin")
    x.tofile(src)
    subprocess.run([PROG, "--convert", src, dst], check=True)
    raw = np.fromfile(dst, dtype=np.uint8)
    n = x.size
    f16 = raw[: 2 * n].view(np.uint16)
    bf16 = raw[2 * n: 4 * n].view(np.uint16)
    widened = raw[4 * n:].view(np.uint32)

    with np.errstate(over="ignore", invalid="ignore"):
        want16 = x.astype(np.float16)
    both_nan = np.isnan(f16.view(np.float16)) & np.isnan(want16)
    bad = np.nonzero((f16 != want16.view(np.uint16)) & ~both_nan)[0]
    if bad.size:
        i = bad[0]
        failures.append(f"fp16: {bad.size} of {n} differ from numpy, e.g. {x[i]!r} -> "
                        f"{f16[i]:#06x}, numpy {want16.view(np.uint16)[i]:#06x}")
    else:
        print(f"fp16: {n} fp32 -> fp16 roundings match numpy")

    every = np.arange(0x10000, dtype=np.uint16).view(np.float16).astype(np.float32)
    if not np.array_equal(widened, every.view(np.uint32)):
        failures.append("fp16 -> fp32 differs from numpy on some of the 65536 patterns")
    else:
        print("fp16: all 65536 fp16 -> fp32 match numpy bit for bit (NaN payloads too)")

    want_bf = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    bad = np.nonzero((bf16 != want_bf) & ~np.isnan(x))[0]
    nan_ok = np.all((bf16[np.isnan(x)] & 0x7FFF) > 0x7F80)
    if bad.size or not nan_ok:
        i = bad[0] if bad.size else 0
        failures.append(f"bf16: {bad.size} of {n} differ from torch, e.g. {x[i]!r} -> "
                        f"{bf16[i]:#06x}, torch {want_bf[i]:#06x} (NaN kept: {nan_ok})")
    else:
        print(f"bf16: {n} fp32 -> bf16 roundings match torch (NaN stays NaN)")


def check_reruns(tmp, failures):
    dumps = []
    for run in range(2):
        path = os.path.join(tmp, f"dump{run}.bin")
        r = subprocess.run([PROG, "--dump", path], capture_output=True, text=True)
        if r.returncode:
            failures.append(f"test_cpu_lowp --dump failed: {r.stderr[-2000:]}")
            return
        with open(path, "rb") as f:
            dumps.append(f.read())
    if dumps[0] != dumps[1] or not dumps[0]:
        failures.append("two runs of the reduced-dtype ops differ")
    else:
        print(f"reruns: {len(dumps[0])} bytes of bf16/fp16 outputs identical "
              f"({r.stdout.splitlines()[0]})")


def main():
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        check_converters(tmp, failures)
        check_reruns(tmp, failures)
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
