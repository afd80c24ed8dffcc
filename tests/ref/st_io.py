"""st_io.py: a tiny safetensors reader/writer (struct + json + numpy) for the tests.

load(path)  -> {name: numpy array}; BF16 tensors come back as float32.
save(path, {name: array}, bf16=False): float arrays as F32 (or BF16 when bf16=True),
integer arrays as I32/I64/U8 by their dtype. Header keys sorted, like the Python
`safetensors` package.
"""
import json
import struct

import numpy as np

_NP_OF = {
    "F32": np.float32,
    "F16": np.float16,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
}
_NAME_OF = {np.dtype(v): k for k, v in _NP_OF.items()}


def bf16_to_f32(raw):
    """uint16 bit patterns -> float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """float32 -> uint16 bit patterns, rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def load(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = memoryview(blob)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = info["shape"]
        dt = info["dtype"]
        if dt == "BF16":
            arr = bf16_to_f32(np.frombuffer(data[begin:end], dtype=np.uint16))
        else:
            arr = np.frombuffer(data[begin:end], dtype=_NP_OF[dt]).copy()
        out[name] = arr.reshape(shape)
    return out


def save(path, tensors, bf16=False):
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype.kind == "f" and bf16:
            dt, raw = "BF16", f32_to_bf16(arr).tobytes()
        elif arr.dtype.kind == "f":
            dt, raw = "F32", np.ascontiguousarray(arr, dtype=np.float32).tobytes()
        else:
            dt = _NAME_OF[arr.dtype]
            raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data area 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
