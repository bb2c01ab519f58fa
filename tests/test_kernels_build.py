"""Tests of twell.kernels.build: flags, build-cache hashing, available() reasons, the JIT loader."""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import twell.kernels as kernels
from twell.kernels import build

DATA = Path(__file__).parent / "data"
needs_cxx = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                               reason="needs a C++ compiler (c++) and ninja on PATH")


def _spec_in(tmp_path, files: dict[str, str], **kw) -> build.ExtensionSpec:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return build.ExtensionSpec.from_dir(tmp_path, build_root=tmp_path / "cache", **kw)


def test_flags_in_one_place():
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.NVCC_FLAGS
    for flag in ("-O3", "-lineinfo", "-std=c++17"):
        assert flag in build.NVCC_FLAGS
    assert not any("fast_math" in f or "fast-math" in f for f in build.NVCC_FLAGS + build.CXX_FLAGS)
    assert "-O3" in build.CXX_FLAGS
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_ext")
    assert spec.nvcc_flags == build.NVCC_FLAGS and spec.cxx_flags == build.CXX_FLAGS


def test_fingerprint_tracks_sources_headers_and_flags(tmp_path):
    a = _spec_in(tmp_path, {"k.cu": "__global__ void k() {}\n", "common.cuh": "#pragma once\n"})
    assert [p.name for p in a.sources] == ["k.cu"] and [p.name for p in a.headers] == ["common.cuh"]
    assert a.fingerprint() == build.ExtensionSpec.from_dir(tmp_path, build_root=tmp_path / "cache").fingerprint()
    h0 = a.fingerprint()
    (tmp_path / "k.cu").write_text("__global__ void k() { }\n")  # one byte differs
    h1 = a.fingerprint()
    (tmp_path / "common.cuh").write_text("#pragma once\n#define X 1\n")
    h2 = a.fingerprint()
    h3 = build.ExtensionSpec(a.sources, a.headers, nvcc_flags=a.nvcc_flags + ("-DDEBUG",)).fingerprint()
    h4 = build.ExtensionSpec(a.sources, a.headers, cxx_flags=("-O2",)).fingerprint()
    assert len({h0, h1, h2, h3, h4}) == 5
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in (h0, h1))
    (tmp_path / "b.cpp").write_text("// another source\n")
    assert build.ExtensionSpec.from_dir(tmp_path).fingerprint() != h2


def test_fingerprint_tracks_torch_version(tmp_path, monkeypatch):
    spec = _spec_in(tmp_path, {"k.cu": "__global__ void k() {}\n"})
    before = spec.fingerprint()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert spec.fingerprint() != before


def test_build_dir_location(tmp_path, monkeypatch):
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_ext")
    monkeypatch.setenv("TWELL_BUILD_DIR", str(tmp_path / "root"))
    assert spec.build_dir == tmp_path / "root" / f"ext-{spec.fingerprint()}"
    monkeypatch.delenv("TWELL_BUILD_DIR")
    assert spec.build_dir == Path.home() / ".cache" / "twell" / f"ext-{spec.fingerprint()}"
    assert spec.module_name.startswith(build.EXTENSION_NAME + "_") and spec.fingerprint()[:10] in spec.module_name


def test_default_sources_are_every_cu_and_cpp(tmp_path):
    for name in ("b.cu", "a.cpp", "c.cuh", "d.h", "notes.md"):
        (tmp_path / name).write_text("")
    assert [p.name for p in build.default_sources(tmp_path)] == ["a.cpp", "b.cu"]


CSRC = build.csrc_dir()


def test_every_csrc_file_is_built_and_hashed():
    """Every file of csrc/ is a source the extension compiles or a header the build hash covers, so a
    new file (a bindings_<family>.cpp, a header) cannot be left out of the cached build; one file
    registers the module, the family files define what it registers."""
    spec = build.ExtensionSpec.from_dir()
    listed = {p.name for p in spec.sources + spec.headers}
    present = {p.name for p in CSRC.iterdir() if p.is_file()}
    assert present == listed, sorted(present ^ listed)
    assert {"bindings.cpp", "bindings_common.h"} <= listed
    assert [p.name for p in spec.sources if "PYBIND11_MODULE" in p.read_text()] == ["bindings.cpp"]


def test_csrc_reads_no_environment():
    """Every setting of a launch is an argument of the ops (docs/kernels.md §2): no getenv (nor
    environ) anywhere in csrc/."""
    pattern = re.compile(r"\b(secure_)?getenv\b|\benviron\b")
    hits = [f"{p.name}:{i}: {line.strip()}" for p in sorted(CSRC.iterdir()) if p.is_file()
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_launch_settings_have_no_defaults_in_the_extension():
    """The extension's functions require the settings of a launch (block-union rule, dense-path
    capacity, spill capacity, gate cluster), so that their defaults live only in the Python constants
    the ops pass (twell.reference.ffn, twell.kernels.ops.spill_capacity)."""
    text = (CSRC / "bindings.cpp").read_text()
    for name in ("union_ratio", "union_base", "dense_cap", "spill_cap", "cluster"):
        assert f'py::arg("{name}")' in text, name
        assert not re.search(rf'py::arg\("{name}"\)\s*=', text), name


def test_spill_capacity_has_one_formula():
    """The spill area's size comes from twell.kernels.ops.spill_capacity alone: the extension receives it
    (spill_cap) and has no formula of its own, and the gate op's fake output, what torch.compile and CUDA
    graphs plan memory with, is that many words plus the words-used counter, for concrete and symbolic
    row counts (the real op's size is checked on the GPU, tests/test_kernels.py)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from twell.kernels import ops

    host = "\n".join(p.read_text() for p in sorted(CSRC.glob("bindings*")))
    assert not re.search(r"\bspill_capacity\s*\(\s*int", host) and "1 << 20" not in host
    assert [ops.spill_capacity(M) for M in (0, 16384, 16385)] == [1 << 20, 1 << 20, 16385 * 64]
    w = torch.empty(300, 256, dtype=torch.bfloat16, device="meta")

    def spill_area(x, w):
        return ops._gate_op(x, w, 256, 16, 2)[1]

    traced = make_fx(spill_area, tracing_mode="symbolic")(torch.empty(3000, 256, dtype=torch.bfloat16, device="meta"),
                                                          w)
    for M in (1, 16384, 20000, 100000):
        x = torch.empty(M, 256, dtype=torch.bfloat16, device="meta")
        packed, spill = ops._gate_op(x, w, 256, 16, 2)
        assert packed.shape == (M, 2 * 16) and packed.dtype == torch.uint32
        assert spill.shape == traced(x, w).shape == (ops.spill_capacity(M) + 1,)



@pytest.fixture(autouse=True)
def _fresh_prerequisites():
    """available() caches the machine's prerequisites per process; the tests fake machines."""
    from twell.kernels import build

    build._prerequisites.cache_clear()
    build.default_loader().default_module = None
    yield
    build._prerequisites.cache_clear()
    build.default_loader().default_module = None

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given on a machine without CUDA")
def test_available_says_why_not_on_cpu(monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("available() must not build when CUDA is missing")

    monkeypatch.setattr(build.ExtensionLoader, "load", no_build)
    for b in (False, True):
        ok, why = kernels.available(build=b)
        assert ok is False and "CUDA" in why, why


def test_union_unsupported_says_why_without_building_where_the_kernels_cannot_run(monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("union_unsupported must not build where the kernels cannot run")

    monkeypatch.setattr(build.ExtensionLoader, "load", no_build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    build._prerequisites.cache_clear()
    assert "no CUDA device visible" in kernels.union_unsupported(2048, 5632)


def test_misaligned_tensors_are_refused_before_any_kernel_sees_them():
    """A contiguous view at an element offset faults in the kernels' vector/TMA loads and loses the
    CUDA context (found in a code review): the ops refuse it with a readable error. The
    check itself needs no GPU; tests/test_kernels.py runs it through every op on the H100."""
    from twell.kernels.ops import check_aligned

    buf = torch.zeros(8 * 64 + 8, dtype=torch.bfloat16)
    check_aligned(x=buf[:512].view(8, 64), w=None)  # aligned, and None is skipped
    check_aligned(x=buf[8:520].view(8, 64))  # 8 bf16 = 16 bytes in: still aligned
    check_aligned(x=buf[1:1])  # empty: no kernel reads it, wherever it points
    # the one predicate the ops and SparseFFN share, reached as the module uses it
    assert kernels.misaligned(buf[1:9]) and not kernels.misaligned(buf[8:16])
    assert not kernels.misaligned(buf[1:1]) and not kernels.misaligned(None)
    for k in (1, 4):  # 2 and 8 bytes in
        with pytest.raises(ValueError, match=r"w_up must start at a 16-byte aligned address.*w_up\.clone\(\)"):
            check_aligned(x=buf[:512].view(8, 64), w_up=buf[k:512 + k].view(8, 64))


def _fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


def test_available_reasons_with_faked_devices(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(build.ExtensionLoader, "load", lambda self, *a, **k: calls.append(1) or "module")
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100")
    ok, why = kernels.available()
    assert not ok and "sm_80" in why and "sm_90" in why and "A100" in why and not calls

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    build._prerequisites.cache_clear()  # each fake is another machine: forget the cached checks
    ok, why = kernels.available()
    assert not ok and "nvcc" in why and "CUDA_HOME" in why and not calls

    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(build, "csrc_dir", lambda: tmp_path)  # empty: no sources
    build._prerequisites.cache_clear()
    ok, why = kernels.available()
    assert not ok and "no .cu/.cpp sources" in why and not calls

    (tmp_path / "k.cu").write_text("")
    build._prerequisites.cache_clear()
    ok, why = kernels.available(build=False)
    assert ok and "not built" in why and not calls
    ok, why = kernels.available(build=True)
    assert ok and calls == [1]

    def failing(self, *a, **k):
        raise build.BuildError("building failed\ncompiler output (tail):\nerror: boom", tmp_path, "error: boom")

    monkeypatch.setattr(build.ExtensionLoader, "load", failing)
    build.default_loader().default_module = None  # forget the module "loaded" above
    ok, why = kernels.available()
    assert not ok and why.startswith("build failed") and "boom" in why


@needs_cxx
def test_build_error_shows_compiler_output_and_cache_path(tmp_path):
    spec = build.ExtensionSpec.from_dir(DATA / "broken_ext", build_root=tmp_path)
    loader = build.ExtensionLoader()
    with pytest.raises(build.BuildError) as info:
        loader.load(spec)
    msg = str(info.value)
    assert "deliberate build failure" in msg and str(spec.build_dir) in msg
    assert info.value.build_dir == spec.build_dir and "deliberate" in info.value.log_tail
    assert (spec.build_dir / "build_error.log").is_file()
    # The failure is remembered for the process: no second compile unless retry=True.
    t0 = time.perf_counter()
    with pytest.raises(build.BuildError) as again:
        loader.load(spec)
    assert again.value is info.value and time.perf_counter() - t0 < 0.5
    # A retry compiles again and shows the compiler's output (torch's in-process record of the name
    # skipped ninja and imported a library that was never built).
    with pytest.raises(build.BuildError, match="deliberate build failure"):
        loader.load(spec, retry=True)


@needs_cxx
def test_loader_builds_loads_and_caches(tmp_path):
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_cpu_ext", build_root=tmp_path)
    loader = build.ExtensionLoader()
    module = loader.load(spec)
    assert module.add_scaled(1.0, 2.0, 3.0) == 7.0
    assert loader.load(spec) is module  # cached in the loader object
    assert Path(module.__file__).parent == spec.build_dir
    assert (spec.build_dir / "build_info.txt").read_text().startswith(f"module {spec.module_name}")


def _static_only_cxx(tmp_path) -> str:
    """A compiler like the H100 image's /opt/gcc/bin/g++: it finds no shared libstdc++ and links libstdc++.a."""
    path = tmp_path / "static-only-c++"
    path.write_text("#!/bin/sh\n"
                    'for a in "$@"; do [ "$a" = "-print-file-name=libstdc++.so" ] && { echo libstdc++.so; exit 0; }; done\n'
                    f'exec {shutil.which("c++")} -static-libstdc++ "$@"\n')
    path.chmod(0o755)
    return str(path)


@needs_cxx
@pytest.mark.parametrize("compiler", ["c++", "static-only"])
def test_built_extension_formats_numbers_in_a_process_with_torch(tmp_path, monkeypatch, compiler):
    """An extension must share torch's libstdc++: with a private static copy (what CXX=/opt/gcc/bin/g++
    on the H100 image linked before libstdcxx_ldflags), formatting a number segfaults or comes out
    wrong, and with it every TORCH_CHECK message that holds one. The static-only compiler reproduces
    that toolchain on any machine. Run in a fresh process, so a crash fails this test only."""
    if compiler == "static-only":
        monkeypatch.setenv("CXX", _static_only_cxx(tmp_path))
        assert build.libstdcxx_ldflags()[0] == build.loaded_libstdcxx()
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_cpu_ext", build_root=tmp_path / "cache")
    module = build.ExtensionLoader().load(spec)
    code = ("import importlib.util, sys, torch\n"
            f"s = importlib.util.spec_from_file_location({module.__name__!r}, {module.__file__!r})\n"
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "print(m.format_int(-1234567890123))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "-1234567890123", (p.returncode, p.stdout[-500:],
                                                                          p.stderr[-2000:])


def test_libstdcxx_ldflags_name_the_loaded_library_only_when_the_driver_has_no_shared_one(tmp_path):
    def fake_cxx(name: str, prints: str) -> str:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\necho '{prints}'\n")
        path.chmod(0o755)
        return str(path)

    real = tmp_path / "libstdc++.so"
    real.write_text("")
    assert build.libstdcxx_ldflags(fake_cxx("shared", str(real))) == ()
    static_only = fake_cxx("static", "libstdc++.so")  # what g++ prints when it finds no such file
    loaded = build.loaded_libstdcxx()
    if sys.platform != "linux":
        assert build.libstdcxx_ldflags(static_only) == ()
    elif loaded is None:
        with pytest.raises(build.BuildError, match="no shared libstdc"):
            build.libstdcxx_ldflags(static_only)
    else:
        assert Path(loaded).is_file() and "libstdc++.so" in Path(loaded).name
        # this fake "links" anything, so it also passes the -nostdlib++ probe
        assert build.libstdcxx_ldflags(static_only) == (loaded, "-nostdlib++")
        # $CXX may hold a launcher and flags
        assert build.libstdcxx_ldflags(f"env LC_ALL=C {static_only}") == (loaded, "-nostdlib++")
    assert build.libstdcxx_ldflags(str(tmp_path / "no-such-compiler")) == ()


def test_loader_without_sources_raises(tmp_path):
    with pytest.raises(build.BuildError, match="no .cu/.cpp sources"):
        build.ExtensionLoader().load(build.ExtensionSpec(sources=(), build_root=tmp_path))


def test_kernels_package_forwards_unknown_names_to_ops():
    # AttributeError only: an ImportError of twell.kernels.ops would be a defect, not this behaviour.
    with pytest.raises(AttributeError, match="twell.kernels.ops"):
        kernels.definitely_not_an_op_name  # noqa: B018


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_tiny_cuda_extension_builds_and_runs(tmp_path):
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_ext", build_root=tmp_path)
    loader = build.ExtensionLoader()
    t0 = time.perf_counter()
    module = loader.load(spec)
    print(f"tiny CUDA extension built in {time.perf_counter() - t0:.1f} s")
    a = torch.randn(1000, 3, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1000, 3, device="cuda", dtype=torch.bfloat16)
    out = module.add_scaled(a, b, 0.5)
    ref = (a.float() + 0.5 * b.float()).to(torch.bfloat16)
    assert torch.equal(out, ref)
    assert loader.load(spec) is module


@pytest.mark.gpu
def test_gpu_available_builds_csrc():
    ok, why = kernels.available(build=False)
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        assert not ok and f"sm_{cap[0]}{cap[1]}" in why
        return
    assert ok, why
    ok, why = kernels.available(build=True)
    assert ok, why  # a build failure of csrc/ fails here with the compiler output
    assert kernels.load() is kernels.load()


def test_load_reuses_the_module_without_rehashing(monkeypatch):
    """The ops call load() on every call: after the first success no source is re-read."""
    calls = []
    monkeypatch.setattr(build.ExtensionLoader, "load", lambda self, *a, **k: calls.append(1) or "module")
    assert build.load() == "module" and build.load() == "module" and calls == [1]
    monkeypatch.setattr(build.ExtensionSpec, "fingerprint", lambda self: pytest.fail("re-hashed the sources"))
    assert build.load() == "module"
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(build.ExtensionLoader, "load", lambda self, *a, **k: calls.append(1) or "rebuilt")
    assert build.load(retry=True) == "rebuilt" and calls == [1]


_LOAD_IN_A_PROCESS = """
import sys
from pathlib import Path
from twell.kernels import build
spec = build.ExtensionSpec.from_dir(Path(sys.argv[1]), build_root=Path(sys.argv[2]))
try:
    build.ExtensionLoader().load(spec)
    print("LOADED")
except build.BuildError as err:
    print("BUILD ERROR", "deliberate build failure" in str(err))
"""


def _load_in_a_process(ext: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _LOAD_IN_A_PROCESS, str(DATA / ext), str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@needs_cxx
def test_a_killed_build_leaves_no_lock_that_blocks_the_next(tmp_path):
    """torch's lock file stays behind when a build is killed (OOM, a job's time limit); the next build
    must not wait on it forever."""
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_cpu_ext", build_root=tmp_path)
    spec.build_dir.mkdir(parents=True)
    (spec.build_dir / "lock").write_text("")  # what a killed build leaves
    proc = _load_in_a_process("tiny_cpu_ext", tmp_path)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the build waited on the stale lock file")
    assert "LOADED" in out, out[-2000:]


@needs_cxx
def test_two_processes_building_at_once_both_show_the_compiler_output(tmp_path):
    """Both wait while the test holds the build lock, then build at once: each must show the compiler's
    output (the one that waited on torch's lock imported a library that was never built)."""
    import fcntl

    spec = build.ExtensionSpec.from_dir(DATA / "broken_ext", build_root=tmp_path)
    spec.build_dir.mkdir(parents=True)
    held = os.open(spec.build_dir / ".twell-build.lock", os.O_RDONLY | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    logs = [tmp_path / f"out{i}.txt" for i in range(2)]
    procs = []
    try:
        for log in logs:
            with log.open("w") as fh:
                procs.append(subprocess.Popen([sys.executable, "-c", _LOAD_IN_A_PROCESS, str(DATA / "broken_ext"),
                                               str(tmp_path)], stdout=fh, stderr=subprocess.STDOUT, text=True))
        deadline = time.time() + 120
        while not all("waiting for another process" in log.read_text() for log in logs):
            assert time.time() < deadline, [log.read_text()[-500:] for log in logs]
            assert all(p.poll() is None for p in procs), [log.read_text()[-500:] for log in logs]
            time.sleep(0.2)
    finally:
        os.close(held)  # both start building now
    for p in procs:
        p.wait(timeout=240)
    outs = [log.read_text() for log in logs]
    assert all("BUILD ERROR True" in out for out in outs), [out[-1000:] for out in outs]


@needs_cxx
def test_a_file_system_without_flock_still_builds(tmp_path, monkeypatch):
    import errno

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(build.fcntl, "flock", no_locks)
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_cpu_ext", build_root=tmp_path)
    with pytest.warns(UserWarning, match="no file lock"):
        module = build.ExtensionLoader().load(spec)
    assert module.add_scaled(1.0, 2.0, 3.0) == 7.0


def test_cuda_home_reaches_cpp_extension_after_its_import(tmp_path, monkeypatch):
    """torch reads CUDA_HOME when cpp_extension is imported; where it took a wrapper's folder without the
    CUDA headers, the build must use the toolkit find_cuda_home found."""
    from torch.utils import cpp_extension

    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setattr(build, "find_cuda_home", lambda: home)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local")  # a wrapper nvcc in /usr/local/bin
    seen = []

    def fake_load(**kw):
        seen.append(cpp_extension.CUDA_HOME)
        raise RuntimeError("stop before compiling")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    spec = _spec_in(tmp_path, {"k.cpp": "int f() { return 1; }"})
    with pytest.raises(build.BuildError, match="stop before compiling"):
        build.ExtensionLoader().load(spec)
    assert seen == [str(home)]


def test_an_unusable_build_directory_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)  # the build may set it: restored after the test
    blocker = tmp_path / "file"
    blocker.write_text("")
    spec = _spec_in(tmp_path, {"k.cpp": "int f() { return 1; }"})
    spec = dataclasses.replace(spec, build_root=blocker / "cache")
    with pytest.raises(build.BuildError, match="cannot use the build directory"):
        build.ExtensionLoader().load(spec)
    # available() says so instead of raising
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setenv("TWELL_BUILD_DIR", str(blocker / "cache"))
    build._prerequisites.cache_clear()
    build.default_loader().default_module = None
    monkeypatch.setattr(build, "default_loader", lambda: build.ExtensionLoader())
    ok, why = kernels.available()
    assert not ok and "cannot use the build directory" in why


def test_a_layer_of_width_zero_is_unsupported():
    assert "positive multiple of 64" in kernels.layer_unsupported(0, 300)
    assert kernels.layer_unsupported(64, 300) == ""



@needs_cxx
def test_the_build_lock_is_taken_on_a_file_opened_for_writing(tmp_path, monkeypatch):
    """NFS emulates flock with byte-range locks, which need a file opened for writing (EBADF otherwise):
    a read-only lock file would build unlocked there."""
    import errno
    import fcntl
    import warnings

    real = fcntl.flock

    def nfs_like(fd, op):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    monkeypatch.setattr(build.fcntl, "flock", nfs_like)
    spec = build.ExtensionSpec.from_dir(DATA / "tiny_cpu_ext", build_root=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no file lock" warning
        module = build.ExtensionLoader().load(spec)
    assert module.add_scaled(1.0, 2.0, 3.0) == 7.0
