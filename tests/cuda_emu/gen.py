#!/usr/bin/env python3
"""gen.py: makes a C++ file of an engine/cuda/*.cu file for the CPU emulation of the kernels
(tests/cuda_emu/, test test_cuda_emu). Run by the build (tests/cuda_emu.cmake) whenever the
.cu file changes, so the emulation always runs the real kernel source: no copy of kernel
code is kept anywhere.

    gen.py INPUT.cu OUTPUT.cpp

The output is compiled as C++17 with tests/cuda_emu/emu.h force-included (it defines
__global__, __shared__, threadIdx, __syncthreads, __shfl_xor_sync, __nv_bfloat16, ...) and
tests/cuda_emu/stub_include/ first on the include path (its cuda_runtime.h and cuda_bf16.h
stand in for the toolkit's). The one thing C++ cannot parse is the launch syntax, so this
script rewrites exactly that, mechanically, and nothing else:

  1. A first line `#line 1 "INPUT.cu"`, so compiler messages, __FILE__ and __LINE__ name the
     real source file and line (every other line keeps its number).
  2. Outside comments and string/character literals, every `<<<` becomes
     `| ::emu::config(__FILE__, __LINE__, ` and every `>>>` becomes `) | ::emu::args`, so

         kernel<T, 4><<<grid, block, 0, stream>>>(a, b);
     reads
         kernel<T, 4>| ::emu::config(__FILE__, __LINE__, grid, block, 0, stream) | ::emu::args(a, b);

     which emu.h's operator| overloads turn into a launch of `kernel` on the emulator. Only
     tokens are replaced (no parsing of the kernel expression), and newlines are kept. The
     kernel must name one function (a template with its arguments spelled out), as a
     launch of a template whose arguments the call would deduce does not compile.

It refuses (exit status 1, naming the file and line) what the emulation cannot run: inline
PTX (asm), dynamic `extern __shared__` memory, atomics, and a `<<<` whose `>>>(` does not
follow before the next `;` (a launch it cannot pair up).
"""
import os
import re
import sys

UNSUPPORTED = [
    (re.compile(r"\b(asm|__asm__)\b"), "inline PTX (asm)"),
    (re.compile(r"\bextern\s+__shared__\b"), "dynamic shared memory (extern __shared__)"),
    (re.compile(r"\batomic[A-Z]\w*\s*\("), "atomics"),
]
OPEN = "| ::emu::config(__FILE__, __LINE__, "
CLOSE = ") | ::emu::args"


def code_mask(src):
    """A list of booleans: True where src[i] is code (not in a comment or a literal)."""
    mask = [True] * len(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c == '"' or (c == "'" and not (i > 0 and src[i - 1].isalnum())):
            # (a ' after a digit is a digit separator, 1'000, not a literal)
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def fail(path, src, pos, what):
    line = src.count("\n", 0, pos) + 1
    sys.stderr.write(f"{path}:{line}: gen.py: {what}: not emulated on the CPU\n")
    sys.exit(1)


def generate(path, src):
    mask = code_mask(src)
    for pattern, what in UNSUPPORTED:
        for m in pattern.finditer(src):
            if mask[m.start()]:
                fail(path, src, m.start(), what)
    out, i, pending = [], 0, None
    for m in re.finditer(r"<<<|>>>|;", src):
        if not mask[m.start()]:
            continue
        tok = m.group()
        if tok == "<<<":
            if pending is not None:
                fail(path, src, m.start(), "a `<<<` inside another launch")
            pending = m.start()
            out.append(src[i : m.start()] + OPEN)
            i = m.end()
        elif tok == ">>>":
            if pending is None:
                fail(path, src, m.start(), "a `>>>` without its `<<<`")
            if not re.match(r"\s*\(", src[m.end() :]):
                fail(path, src, m.start(), "a launch whose `>>>` is not followed by `(`")
            pending = None
            out.append(src[i : m.start()] + CLOSE)
            i = m.end()
        elif pending is not None:
            fail(path, src, pending, "a `<<<` without its `>>>` before the next `;`")
    if pending is not None:
        fail(path, src, pending, "a `<<<` without its `>>>`")
    out.append(src[i:])
    return f'#line 1 "{os.path.abspath(path)}"\n' + "".join(out)


def main():
    if len(sys.argv) != 3:
        sys.stderr.write("usage: gen.py INPUT.cu OUTPUT.cpp\n")
        sys.exit(2)
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path, encoding="utf-8") as f:
        text = generate(src_path, f.read())
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
