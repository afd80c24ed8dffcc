#!/usr/bin/env python3
"""gen.py: makes a C++ file of an engine/cuda/*.cu file for the CPU emulation of the kernels
(tests/cuda_emu/, test test_cuda_emu). Run by the build (tests/cuda_emu.cmake) whenever the
.cu file changes, so the emulation always runs the real kernel source: no copy of kernel
code is kept anywhere.

    gen.py INPUT.cu OUTPUT.cpp

The output is compiled as C++20 with tests/cuda_emu/emu.h force-included (it defines
__global__, __shared__, threadIdx, __syncthreads, __shfl_xor_sync, __nv_bfloat16, __half,
...) and tests/cuda_emu/stub_include/ first on the include path (its cuda_runtime.h,
cuda_bf16.h and cuda_fp16.h stand in for the toolkit's). What C++ cannot parse or run is
rewritten, mechanically, outside comments and string/character literals, keeping every
newline (so every line keeps its number), and nothing else:

  1. A first line `#line 1 "INPUT.cu"`, so compiler messages, __FILE__ and __LINE__ name the
     real source file and line.
  2. Every `<<<` becomes `| ::emu::config(__FILE__, __LINE__, ` and every `>>>` becomes
     `) | ::emu::args`, so

         kernel<T, 4><<<grid, block, 0, stream>>>(a, b);
     reads
         kernel<T, 4>| ::emu::config(__FILE__, __LINE__, grid, block, 0, stream) | ::emu::args(a, b);

     which emu.h's operator| overloads turn into a launch of `kernel` on the emulator. Only
     tokens are replaced (no parsing of the kernel expression). The kernel must name one
     function (a template with its arguments spelled out), as a launch of a template whose
     arguments the call would deduce does not compile.
  3. `extern __shared__ [__align__(N)] TYPE NAME[];` (dynamic shared memory) becomes
     `TYPE *const NAME = (TYPE *)::emu::dynamic_shared();` (N at most 16: the emulator's
     alignment).
  4. An asm statement of one PTX instruction that the emulator implements (PTX below)
     becomes a call of its emu::ptx function (emu.h): the opcode's optional qualifiers as
     bools, then the instruction's operands in PTX order, each %N replaced by the C++
     expression of asm operand N, cast to its constraint's type (r: uint32_t, l: uint64_t,
     f: float, n: int), and an output operand, where it first appears (the destination),
     by its address. So

         asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                      "l"(src), "r"(valid ? 16 : 0) : "memory");
     reads
         ::emu::ptx::cp_async(true, (uint32_t)(smem_addr(dst)), (uint64_t)(src), 16,
                              (uint32_t)(valid ? 16 : 0));

     The clobbers ("memory") need nothing: the emulated instruction is a function call.

It refuses (exit status 1, naming the file and line) what the emulation cannot run: other
inline PTX, atomics, and a `<<<` whose `>>>(` does not follow before the next `;` (a launch
it cannot pair up).
"""
import os
import re
import sys

UNSUPPORTED = [
    (re.compile(r"\batomic[A-Z]\w*\s*\("), "atomics"),
]
ASM = re.compile(r"\b(?:asm|__asm__)\b(?:\s+(?:volatile|__volatile__))?\s*\(")
EXTERN_SHARED = re.compile(
    r"\bextern\s+__shared__\s+(?:__align__\s*\(\s*(\d+)\s*\)\s+)?"
    r"([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]\s*;"
)
# The PTX instructions of emu.h's emu::ptx: the opcode (each named group an optional
# qualifier, passed first as a bool) -> the function.
PTX = [
    (r"ldmatrix\.sync\.aligned\.m8n8\.x4(?P<trans>\.trans)?\.shared\.b16", "ldmatrix_x4"),
    (
        r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(?:bf16\.bf16|(?P<f16>f16\.f16))\.f32",
        "mma_m16n8k16_f32",
    ),
    (r"cp\.async\.(?:ca|(?P<cg>cg))\.shared\.global", "cp_async"),
    (r"cp\.async\.commit_group", "cp_async_commit_group"),
    (r"cp\.async\.wait_group", "cp_async_wait_group"),
]
CAST = {"r": "uint32_t", "l": "uint64_t", "f": "float", "n": "int"}
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


class Refused(Exception):
    """What the emulation cannot run, at offset pos of the source."""

    def __init__(self, pos, what):
        super().__init__(what)
        self.pos, self.what = pos, what


def split_top(text, sep):
    """text split at each `sep` outside brackets, comments and literals."""
    mask, parts, depth, last = code_mask(text), [], 0, 0
    for i, c in enumerate(text):
        if not mask[i]:
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    return parts + [text[last:]]


def close_paren(src, mask, i):
    """The offset just past the `)` that closes the `(` at src[i]."""
    depth = 0
    for j in range(i, len(src)):
        if mask[j] and src[j] in "([{":
            depth += 1
        elif mask[j] and src[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    raise Refused(i, "an unbalanced `(`")


def asm_operands(text, pos):
    """[(constraint modifiers, letter, expression)] of one `:` section of an asm statement."""
    ops = []
    for part in split_top(text, ","):
        if not part.strip():
            continue
        m = re.fullmatch(r'\s*"([=+&]*)([a-z])"\s*\((.*)\)\s*', part, re.S)
        if not m or m.group(2) not in CAST:
            raise Refused(pos, f"asm operand `{part.strip()}`")
        ops.append(m.groups())
    return ops


def translate_asm(body, pos):
    """The emu::ptx call of the asm statement whose parenthesised text is body."""
    sections = split_top(body, ":") + ["", ""]
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0]))
    template = " ".join(template.replace("\\n", " ").replace("\\t", " ").split()).rstrip(";")
    ops = asm_operands(sections[1], pos) + asm_operands(sections[2], pos)
    opcode, _, rest = template.partition(" ")
    for pattern, func in PTX:
        m = re.fullmatch(pattern, opcode)
        if m and ";" not in rest:
            break
    else:
        raise Refused(pos, f"inline PTX `{template}`")
    args = ["true" if g else "false" for g in m.groupdict().values()]
    seen = set()

    def operand(ref):
        k = int(ref.group(1))
        if k >= len(ops):
            raise Refused(pos, f"`%{k}` in `{template}`: no such asm operand")
        mods, letter, expr = ops[k]
        if mods and k not in seen:  # an output: the destination, written through its address
            seen.add(k)
            return f"&({expr.strip()})"
        if "=" in mods:
            raise Refused(pos, f"`%{k}` in `{template}`: an output-only operand read")
        return f"({CAST[letter]})({expr.strip()})"

    for arg in split_top(rest, ",") if rest else []:
        arg = arg.strip()
        if arg.startswith("[") and arg.endswith("]"):  # an address: its value
            arg = arg[1:-1]
        args.append(re.sub(r"%(\d+)", operand, arg))
    return f"::emu::ptx::{func}({', '.join(args)})"


def rewrite(src, regex, replace):
    """src with every code match of regex replaced by replace(src, mask, match) -> (end,
    text); the newlines of what is replaced are kept."""
    mask, out, i = code_mask(src), [], 0
    for m in regex.finditer(src):
        if m.start() < i or not mask[m.start()]:
            continue
        end, text = replace(src, mask, m)
        out.append(src[i : m.start()] + text + "\n" * src.count("\n", m.start(), end))
        i = end
    return "".join(out) + src[i:]


def replace_asm(src, mask, m):
    end = close_paren(src, mask, m.end() - 1)
    return end, translate_asm(src[m.end() : end - 1], m.start())


def replace_extern_shared(src, mask, m):
    align, type_, name = m.group(1), " ".join(m.group(2).split()), m.group(3)
    if align and int(align) > 16:
        raise Refused(m.start(), f"dynamic shared memory aligned to {align} bytes (16 at most)")
    return m.end(), f"{type_} *const {name} = ({type_} *)::emu::dynamic_shared();"


def rewrite_launches(src):
    mask, out, i, pending = code_mask(src), [], 0, None
    for m in re.finditer(r"<<<|>>>|;", src):
        if not mask[m.start()]:
            continue
        tok = m.group()
        if tok == "<<<":
            if pending is not None:
                raise Refused(m.start(), "a `<<<` inside another launch")
            pending = m.start()
            out.append(src[i : m.start()] + OPEN)
            i = m.end()
        elif tok == ">>>":
            if pending is None:
                raise Refused(m.start(), "a `>>>` without its `<<<`")
            if not re.match(r"\s*\(", src[m.end() :]):
                raise Refused(m.start(), "a launch whose `>>>` is not followed by `(`")
            pending = None
            out.append(src[i : m.start()] + CLOSE)
            i = m.end()
        elif pending is not None:
            raise Refused(pending, "a `<<<` without its `>>>` before the next `;`")
    if pending is not None:
        raise Refused(pending, "a `<<<` without its `>>>`")
    return "".join(out) + src[i:]


def generate(path, src):
    mask = code_mask(src)
    for pattern, what in UNSUPPORTED:
        for m in pattern.finditer(src):
            if mask[m.start()]:
                raise Refused(m.start(), what)
    # Each step keeps the offsets of the lines (only their text changes): a position in
    # the rewritten text is on the same line of the source.
    src = rewrite(src, ASM, replace_asm)
    src = rewrite(src, EXTERN_SHARED, replace_extern_shared)
    return f'#line 1 "{os.path.abspath(path)}"\n' + rewrite_launches(src)


def main():
    if len(sys.argv) != 3:
        sys.stderr.write("usage: gen.py INPUT.cu OUTPUT.cpp\n")
        sys.exit(2)
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path, encoding="utf-8") as f:
        src = f.read()
    try:
        text = generate(src_path, src)
    except Refused as e:
        line = src.count("\n", 0, e.pos) + 1
        sys.stderr.write(f"{src_path}:{line}: gen.py: {e.what}: not emulated on the CPU\n")
        sys.exit(1)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main()
