"""Instruction mix of the hot loops of a csrc kernel, from its sm_90a SASS (no GPU needed).

Compiles one .cu with the extension's own flags (twell.kernels.build.compile_command), disassembles
it with cuobjdump, and for every kernel whose name contains FILTER prints each backward-branch loop
that holds more than MIN_FFMA FFMA instructions: its length and most common opcodes. The per-pair
loop of the fused kernel is the one that matters (docs/kernels.md §4, "inner loop").

Usage: python scripts/probes/sass_loops.py csrc/twell_ffn.cu light_kernel [MIN_FFMA]
cuobjdump comes with the CUDA toolkit, or as the pip wheel nvidia-cuda-cuobjdump (put its bin/ on PATH,
or point CUOBJDUMP at the binary).
"""
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from twell.kernels.build import compile_command, find_nvcc  # noqa: E402

INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
TARGET = re.compile(r"(0x[0-9a-f]+)\s*$")


def opcode(text: str) -> str:
    parts = text.split()
    return parts[1] if parts[0].startswith("@") else parts[0]


def hot_loops(sass: str, name_filter: str, min_ffma: int):
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        if name_filter not in name:
            continue
        ins = [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, block.splitlines()) if m]
        index = {a: i for i, (a, _) in enumerate(ins)}
        loops = []
        for i, (addr, text) in enumerate(ins):
            m = TARGET.search(text)
            if "BRA" in text and m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
                body = [t for _, t in ins[index[int(m.group(1), 16)]:i + 1]]
                ops = collections.Counter(opcode(t) for t in body)
                if ops["FFMA"] > min_ffma:
                    loops.append((len(body), ops))
        yield name, len(ins), sorted(loops, key=lambda x: x[0])


def main(source: str, name_filter: str, min_ffma: int = 20) -> int:
    dump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    nvcc = find_nvcc()
    if dump is None or nvcc is None:
        print("needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump, then put its bin/ on PATH)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(compile_command(Path(source), cubin, nvcc), check=True, capture_output=True)
        sass = subprocess.run([dump, "--dump-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    for name, total, loops in hot_loops(sass, name_filter, min_ffma):
        print(f"{name}: {total} instructions")
        for n, ops in loops:  # shortest first: the innermost loop
            print(f"  loop of {n} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(args[0], args[1], *(int(a) for a in args[2:3])))
