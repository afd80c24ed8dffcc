"""Our safetensors files against Python's view of the format.

1. Files written by st_write (via `test_safetensors --write-sample`) have the
   exact header bytes the Python `safetensors` writer produces (compact JSON,
   keys sorted, offsets packed, spaces to a multiple of 8), and their data is
   the fp32 values / torch's own fp32 -> bf16 rounding.
2. Files written here, the way Python writes them (bf16, f16 with subnormals,
   f32, a __metadata__ entry), read back in C (`test_safetensors --dump`) as
   torch's `.float()` of the same tensors.

The format is parsed with struct/json/numpy (the `safetensors` package is not
installed on the build machines).
"""

import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

torch.set_num_threads(2)
BIN = os.path.join(os.environ["ASTRAI_BUILD"], "test_safetensors")
DTYPES = {"F32": (np.float32, 4), "BF16": (None, 2), "F16": (np.float16, 2)}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def python_header(tensors, dtype):
    """The header bytes the Python safetensors writer makes for one dtype."""
    header, offset = {}, 0
    for name in sorted(tensors):
        shape = list(tensors[name].shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * ((8 - len(text) % 8) % 8)


def read_file(path):
    """(header bytes, {name: (dtype, shape, raw bytes)}) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = blob[8 : 8 + n]
    data = blob[8 + n :]
    out = {}
    for name, e in json.loads(header).items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[b:end])
    return header, out


def sample_tensors():
    """The values `test_safetensors --write-sample` writes (same formula as the C side)."""
    specs = [("layers.0.mlp.up.weight", (5, 7)), ("norm.weight", (7,)), ("scalar", ()), ("empty", (3, 0))]
    specials = [0x3F808000, 0x3F818000, 0x3F808001, 0x7F800001, 0x7F7FFFFF, 0xFF800000, 0x00000001, 0x80000000]
    out = {}
    for k, (name, shape) in enumerate(specs):
        store = np.array(
            [np.float32(k * 0.37 + i * 0.01137 - 0.5) * np.float32(1.0 if i % 3 else -3.0) for i in range(64)],
            dtype=np.float32,
        )
        if k == 0:
            store[: len(specials)] = np.array(specials, dtype=np.uint32).view(np.float32)
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = store[:n].reshape(shape)
    return out


def check_written_by_c(tmp):
    subprocess.run([BIN, "--write-sample", tmp], check=True)
    expected = sample_tensors()
    for dtype, fname in (("F32", "sample_f32.safetensors"), ("BF16", "sample_bf16.safetensors")):
        header, tensors = read_file(os.path.join(tmp, fname))
        want_header = python_header(expected, dtype)
        assert header == want_header, f"{fname}: header\n{header!r}\n!=\n{want_header!r}"
        assert list(tensors) == sorted(expected), f"{fname}: order {list(tensors)}"
        for name, value in expected.items():
            got_dtype, shape, raw = tensors[name]
            assert got_dtype == dtype and shape == list(value.shape), (fname, name, got_dtype, shape)
            if dtype == "F32":
                got = np.frombuffer(raw, dtype="<u4")
                want = value.reshape(-1).view(np.uint32)
            else:  # torch's rounding is the reference for bf16
                got = np.frombuffer(raw, dtype="<u2")
                want = torch.from_numpy(value.reshape(-1).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            nan = np.isnan(value.reshape(-1))
            assert np.array_equal(got[~nan], want[~nan]), f"{fname}: {name}: {got} != {want}"
            # NaN stays NaN: exponent all ones, mantissa non-zero
            exp_mask, mant_mask = (0x7F80, 0x7F) if dtype == "BF16" else (0x7F800000, 0x7FFFFF)
            assert all((h & exp_mask) == exp_mask and (h & mant_mask) for h in got[nan]), (name, got[nan])
    print("C-written files match the Python writer's format")


def write_python_style(path, tensors):
    """Writes like safetensors' Python writer, plus a __metadata__ entry first."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        t = tensors[name]
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = {v: k for k, v in TORCH_DTYPES.items()}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def check_read_by_c(tmp):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 6, generator=g) * 3
    specials = torch.tensor([0.0, -0.0, 1e-7, -6e-8, 65504.0, 1e5, float("inf"), float("-inf"), 3.14159, -2.5e-5])
    tensors = {
        "a.bf16": base.to(torch.bfloat16),
        "b.f16": base.to(torch.float16),
        "c.f32": base.clone(),
        "d.f16_special": specials.to(torch.float16),
        "e.bf16_special": specials.to(torch.bfloat16),
        "f.empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }
    path = os.path.join(tmp, "python.safetensors")
    write_python_style(path, tensors)
    out = subprocess.run([BIN, "--dump", path], check=True, capture_output=True, text=True).stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert sorted(rows) == sorted(tensors), rows.keys()
    for name, t in tensors.items():
        shape, *hexes = rows[name]
        assert shape == "[" + ",".join(map(str, t.shape)) + "]", (name, shape)
        got = np.array([int(h, 16) for h in hexes], dtype=np.uint32)
        want = t.float().reshape(-1).numpy().view(np.uint32)
        assert np.array_equal(got, want), f"{name}: {got} != {want}"
    print("Python-written bf16/f16/f32 files read in C as torch's .float()")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        check_written_by_c(tmp)
        check_read_by_c(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
