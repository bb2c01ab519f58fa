"""Why does a failing TORCH_CHECK whose message holds a number segfault on the H100 image (torch 2.11)
while text-only messages raise? (Even a two-line inline extension crashed there; on the CPU
machine, torch 2.13 + g++ 12, the same code raises.) Each case runs in its own process with a SIGSEGV
handler that prints the native backtrace. Usage: PYTHONPATH=src python scripts/probes/throw_diag.py
"""
import subprocess
import sys

SRC = r"""
#include <torch/extension.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
#include <sstream>
#include <string>
static void on_segv(int) { void* a[64]; int n = backtrace(a, 64); backtrace_symbols_fd(a, n, 2); _exit(139); }
void install() { signal(SIGSEGV, on_segv); }
std::string fmt_int(int64_t v) { std::ostringstream ss; ss << v; return ss.str(); }
std::string cstr_int(int64_t v) { return c10::str("v=", v); }
void t_text() { TORCH_CHECK(false, "text only"); }
void t_text3() { TORCH_CHECK(false, "a", "b", std::string("c")); }
void t_int(int64_t v) { TORCH_CHECK(false, "int ", v); }
void t_tostring(int64_t v) { TORCH_CHECK(false, "to_string ", std::to_string(v)); }
void t_runtime(int64_t v) { throw std::runtime_error("runtime_error " + std::to_string(v)); }
void t_c10error(int64_t v) { throw c10::Error(c10::SourceLocation{__func__, __FILE__, uint32_t(__LINE__)}, "c10::Error direct " + std::to_string(v)); }
"""
FUNCS = ["install", "fmt_int", "cstr_int", "t_text", "t_text3", "t_int", "t_tostring", "t_runtime", "t_c10error"]
CASES = {"fmt_int": "m.fmt_int(42)", "cstr_int": "m.cstr_int(42)", "t_text": "m.t_text()", "t_text3": "m.t_text3()",
         "t_int": "m.t_int(7)", "t_tostring": "m.t_tostring(7)", "t_runtime": "m.t_runtime(7)",
         "t_c10error": "m.t_c10error(7)"}


def mod():
    """DIAG_TAG names the build (one per compiler / flag variant), DIAG_LDFLAGS adds link flags."""
    import os
    from torch.utils.cpp_extension import load_inline
    return load_inline("twell_throw_diag" + os.environ.get("DIAG_TAG", ""), SRC, functions=FUNCS,
                       extra_ldflags=os.environ.get("DIAG_LDFLAGS", "").split())


if len(sys.argv) > 1:
    m = mod()
    m.install()
    try:
        print(sys.argv[1], "returned", repr(eval(CASES[sys.argv[1]], {"m": m})))
    except Exception as e:
        print(sys.argv[1], "raised", type(e).__name__, str(e).splitlines()[0][:100])
    sys.exit(0)

import torch
print("torch", torch.__version__, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI)
print("\n".join(l for l in torch.__config__.show().splitlines() if "GCC" in l or "CXX" in l or "compiler" in l.lower()))
import os
from torch.utils.cpp_extension import get_cxx_compiler
print("CXX", os.environ.get("CXX"), "| torch uses", get_cxx_compiler(), "| DIAG_LDFLAGS", os.environ.get("DIAG_LDFLAGS"))
m = mod()
print(subprocess.run(f"ldd {m.__file__} | grep -i 'stdc\\|gcc'; nm -C {m.__file__} | grep -c ' [TW] std::'",
                     shell=True, capture_output=True, text=True).stdout)
import re
maps = open("/proc/self/maps").read()
print("libstdc++ in process:", sorted(set(re.findall(r"\S*libstdc\+\+\S*", maps))))
print("libgcc_s in process:", sorted(set(re.findall(r"\S*libgcc_s\S*", maps))))
for name in CASES:
    p = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
    out = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"{name:12s} rc={p.returncode:4d} {out}")
    if p.returncode:
        print("   " + "\n   ".join(p.stderr.strip().splitlines()[:25]))
