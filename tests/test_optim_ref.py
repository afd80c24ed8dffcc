"""engine/optim.c against the PyTorch reference (tests/ref/optim.py).

Random parameters and fresh random gradients (fixed seeds) for a hand-built set of tensors named
like the model's, N steps with a changing lr and gradient clipping, both optimizers: the C weights
after every step, the clip norms and the final optimizer state (read back from the C
optimizer.safetensors) agree with torch within 1e-5 relative per tensor. Saving and loading the
state mid-run continues bitwise identically, and bad state files are rejected with errors naming
the file and tensor.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

from ref.optim import make_optimizer, clip_grad_norm, muon_owns

torch.set_num_threads(2)
BUILD = os.environ["ASTRAI_BUILD"]
OPTIM_STEP = os.path.join(BUILD, "optim_step")
TOL = 1e-5

# (name, shape): Muon-owned matrices wide, tall, square and large enough for the threaded
# loops; AdamW-owned embeddings, norms, head (and in adamw mode, everything).
SPEC = [
    ("embed_tokens.weight", (50, 16)),
    ("layers.0.input_norm.weight", (16,)),
    ("layers.0.attention.q_proj.weight", (32, 16)),
    ("layers.0.attention.k_proj.weight", (16, 16)),
    ("layers.0.attention.o_proj.weight", (16, 32)),
    ("layers.0.attention.v_proj.weight", (16, 16)),  # zero grads: Newton-Schulz's norm clamp
    ("layers.0.post_attention_norm.weight", (16,)),
    ("layers.0.mlp.up.weight", (300, 64)),
    ("layers.0.mlp.down.weight", (64, 300)),
    ("norm.weight", (16,)),
    ("lm_head.weight", (400, 64)),
]
LRS = [0.01, 0.02, 0.015, 0.005, 0.03]
# Per-step gradient scales: with max_norm 5 some steps are clipped, some are not.
GRAD_SCALES = [0.01, 0.05, 0.002, 0.03, 0.015]

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL", msg)


def write_problem(d, spec, seed):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(shape, generator=g) * 0.1 + (1.0 if "norm" in n else 0.0)
               for n, shape in spec]
    grads = [[torch.randn(shape, generator=g) * s * ("v_proj" not in n) for n, shape in spec]
             for s in GRAD_SCALES]
    with open(os.path.join(d, "spec.txt"), "w") as f:
        for name, shape in spec:
            f.write(f"{name} {len(shape)} {' '.join(map(str, shape))}\n")
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts]).numpy().astype("<f4")
    flat(weights).tofile(os.path.join(d, "weights.bin"))
    np.concatenate([flat(gs) for gs in grads]).tofile(os.path.join(d, "grads.bin"))
    with open(os.path.join(d, "lrs.txt"), "w") as f:
        f.write("\n".join(repr(lr) for lr in LRS) + "\n")
    return weights, grads


def run_c(*args, env=None):
    return subprocess.run([OPTIM_STEP, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})},
                          timeout=60)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (path, name, info)
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + b:8 + n + e], dtype="<f4").reshape(info["shape"])
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def rel_err(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def reference_run(spec, weights, grads, kind, wd, max_norm, muon=None):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    named = [(n, p) for (n, _), p in zip(spec, params)]
    opt = make_optimizer(kind, named, lr=LRS[0], weight_decay=wd, **(muon or {}))
    trajectory, norms = [], []
    for step_grads, lr in zip(grads, LRS):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        norms.append(clip_grad_norm(params, max_norm))
        opt.step(lr)
        opt.zero_grad()
        trajectory.append([p.detach().clone() for p in params])
    return trajectory, norms, opt.state_tensors()


# The --muon_* knobs as optim_step's environment.
def muon_env(muon):
    names = {"momentum": "MUON_MOMENTUM", "ns_steps": "MUON_NS_STEPS",
             "nesterov": "MUON_NESTEROV", "adjust_lr": "MUON_ADJUST_LR"}
    return {names[k]: str(int(v) if isinstance(v, bool) else v) for k, v in (muon or {}).items()}


def compare_run(d, spec, weights, grads, kind, wd, max_norm, muon=None):
    label = f"{kind} wd={wd} max_norm={max_norm}" + (f" {muon}" if muon else "")
    tag = f"{kind}_{max_norm}" + ("_" + "_".join(map(str, muon.values())) if muon else "")
    r = run_c("run", d, kind, wd, max_norm, 0, tag, env=muon_env(muon))
    check(r.returncode == 0, f"{label}: optim_step failed: {r.stdout}{r.stderr}")
    if r.returncode:
        return
    trajectory, norms, state = reference_run(spec, weights, grads, kind, wd, max_norm, muon)
    sizes = [int(np.prod(s)) for _, s in spec]
    c_traj = np.fromfile(os.path.join(d, f"{tag}.weights.bin"), dtype="<f4")
    c_traj = c_traj.reshape(len(LRS), sum(sizes))
    c_norms = [float(x) for x in open(os.path.join(d, f"{tag}.norms.txt")).read().split()]
    for s in range(len(LRS)):
        check(abs(c_norms[s] - norms[s]) <= 1e-6 * norms[s],
              f"{label} step {s}: clip norm C {c_norms[s]} vs torch {norms[s]}")
        offset = 0
        for (name, shape), size, want in zip(spec, sizes, trajectory[s]):
            got = c_traj[s, offset:offset + size].reshape(shape)
            offset += size
            e = rel_err(got, want.numpy())
            check(e <= TOL, f"{label} step {s + 1}: {name} differs, rel err {e:.3g}")
            # The update itself (not only the weights) must match.
            before = weights[[n for n, _ in spec].index(name)] if s == 0 else None
            if before is not None:
                e = rel_err(got - before.numpy(), (want - before).numpy())
                check(e <= 2e-5, f"{label} step 1: update of {name} differs, rel err {e:.3g}")
    c_state = read_safetensors(os.path.join(d, f"{tag}.state.safetensors"))
    check(sorted(c_state) == sorted(state),
          f"{label}: state tensor names {sorted(set(c_state) ^ set(state))} differ")
    for name in sorted(set(c_state) & set(state)):
        e = rel_err(c_state[name], state[name].numpy())
        check(e <= TOL, f"{label}: state {name} differs, rel err {e:.3g}")
    clipped = sum(n > max_norm for n in norms) if max_norm > 0 else 0
    print(f"ok? {label}: {len(LRS)} steps, {clipped} clipped")
    return clipped


def check_resume(d, kind):
    whole = run_c("run", d, kind, 0.1, 5.0, 0, f"whole_{kind}")
    resumed = run_c("run", d, kind, 0.1, 5.0, 2, f"resumed_{kind}")
    check(whole.returncode == 0 and resumed.returncode == 0,
          f"resume {kind}: {whole.stdout}{whole.stderr}{resumed.stdout}{resumed.stderr}")
    if whole.returncode or resumed.returncode:
        return
    for suffix in ("weights.bin", "norms.txt", "state.safetensors"):
        a = open(os.path.join(d, f"whole_{kind}.{suffix}"), "rb").read()
        b = open(os.path.join(d, f"resumed_{kind}.{suffix}"), "rb").read()
        check(a == b, f"resume {kind}: {suffix} differs after save/load at step 2")
    mid = read_safetensors(os.path.join(d, f"resumed_{kind}.resume.safetensors"))
    check(mid.get("step") is not None and mid["step"].tolist() == [2.0],
          f"resume {kind}: saved step {mid.get('step')} (expected [2.0])")


def expect_load_error(d, kind, path, *fragments):
    r = run_c("load", d, kind, path)
    msg = r.stdout.strip()
    ok = r.returncode == 2 and all(f in msg for f in fragments)
    check(ok, f"load {kind} {os.path.basename(path)}: rc {r.returncode}, message {msg!r}, "
              f"expected {fragments}")


def check_load_errors(d):
    muon_state = os.path.join(d, "whole_muon.state.safetensors")
    adamw_state = os.path.join(d, "whole_adamw.state.safetensors")
    check(run_c("load", d, "muon", muon_state).stdout.strip() == "ok", "muon state reloads")
    expect_load_error(d, "adamw", muon_state, muon_state, "momentum_buffer.layers.0",
                      "written by the 'muon' optimizer", "uses 'adamw'")
    expect_load_error(d, "muon", adamw_state, adamw_state,
                      "exp_avg.layers.0.attention.q_proj.weight",
                      "written by the 'adamw' optimizer", "uses 'muon'")
    expect_load_error(d, "muon", os.path.join(d, "absent.safetensors"), "absent.safetensors")

    good = read_safetensors(adamw_state)
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "exp_avg_sq.norm.weight"},
                    ["missing tensor 'exp_avg_sq.norm.weight'"]),
        "no_step": ({k: v for k, v in good.items() if k != "step"}, ["missing tensor 'step'"]),
        "shape": ({**good, "exp_avg.lm_head.weight": np.zeros((64, 400), "f4")},
                  ["exp_avg.lm_head.weight", "[64, 400]", "[400, 64]"]),
        "extra": ({**good, "exp_avg.layers.9.mlp.up.weight": np.zeros(3, "f4")},
                  ["unexpected tensor 'exp_avg.layers.9.mlp.up.weight'"]),
        "bad_step": ({**good, "step": np.array([2.5], "f4")}, ["'step'", "2.5"]),
        "negative_step": ({**good, "step": np.array([-1.0], "f4")}, ["'step'", "-1"]),
    }
    for case, (tensors, fragments) in cases.items():
        path = os.path.join(d, f"{case}.safetensors")
        write_safetensors(path, tensors)
        expect_load_error(d, "adamw", path, path, *fragments)
    muon_extra = os.path.join(d, "muon_extra.safetensors")
    write_safetensors(muon_extra, {**read_safetensors(muon_state),
                                   "momentum_buffer.norm.weight": np.zeros(16, "f4")})
    expect_load_error(d, "muon", muon_extra, muon_extra,
                      "unexpected tensor 'momentum_buffer.norm.weight'")
    # A file from a different model shape.
    other = os.path.join(d, "other")
    os.mkdir(other)
    write_problem(other, [(n, (s[0] + 1,) + s[1:]) if n == "norm.weight" else (n, s)
                          for n, s in SPEC], seed=3)
    expect_load_error(other, "adamw", adamw_state, "exp_avg.norm.weight", "[16]", "[17]")


def main():
    with tempfile.TemporaryDirectory() as d:
        weights, grads = write_problem(d, SPEC, seed=1234)
        owned = [n for n, s in SPEC if muon_owns(n, torch.empty(s))]
        assert len(owned) == 6, owned  # the spec exercises both halves of MuonMix
        clipped = 0
        for kind in ("adamw", "muon"):
            clipped += compare_run(d, SPEC, weights, grads, kind, 0.1, 5.0) or 0
            compare_run(d, SPEC, weights, grads, kind, 0.05, 0.0)
        check(0 < clipped < 2 * len(LRS), f"clipping exercised on {clipped} steps (want some)")
        # The --muon_* flags (issue 8): plain momentum, adjust_lr "original", other knobs.
        for muon in ({"nesterov": False}, {"adjust_lr": "original"},
                     {"momentum": 0.9, "ns_steps": 3, "nesterov": False,
                      "adjust_lr": "original"}):
            compare_run(d, SPEC, weights, grads, "muon", 0.1, 5.0, muon)
        for kind in ("adamw", "muon"):
            check_resume(d, kind)
        check_load_errors(d)
        if hasattr(torch.optim, "Muon"):
            compare_with_torch_muon()
        else:
            print(f"note: torch {torch.__version__} has no torch.optim.Muon; reference not "
                  "compared with it")
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")


def compare_with_torch_muon():
    """ref Muon (fp32 Newton-Schulz) vs torch.optim.Muon (bf16): equal within bf16 error."""
    from ref.optim import Muon

    g = torch.Generator().manual_seed(7)
    for shape, nesterov, adjust in [((32, 16), True, "match_rms_adamw"),
                                    ((16, 48), True, "match_rms_adamw"),
                                    ((32, 16), False, "original"), ((16, 48), False, "original")]:
        w0, grads = torch.randn(shape, generator=g), [torch.randn(shape, generator=g)
                                                      for _ in range(3)]
        ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
        a = Muon([ours], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr=adjust)
        b = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95,
                             nesterov=nesterov, ns_steps=5, adjust_lr_fn=adjust)
        for grad in grads:
            ours.grad, theirs.grad = grad.clone(), grad.clone()
            a.step()
            b.step()
        e = rel_err((ours - w0).detach().numpy(), (theirs - w0).detach().numpy())
        check(e <= 3e-2, f"ref Muon vs torch.optim.Muon {shape} nesterov={nesterov} {adjust}: "
              f"update rel err {e:.3g}")


if __name__ == "__main__":
    main()
