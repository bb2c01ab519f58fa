"""JIT build of the CUDA extension (every csrc/*.cu and csrc/*.cpp) and the ptxas resource report.

One extension is built from all sources with ``torch.utils.cpp_extension.load`` and ninja into a
build directory keyed by a hash of the sources, headers, flags, torch version and CUDA version
(``~/.cache/twell/ext-<hash>``; the root can be moved with ``TWELL_BUILD_DIR``). The compiler
flags live in one place (``NVCC_FLAGS``/``CXX_FLAGS``/``LDFLAGS`` below) and are shared with the
ptxas report so that CI checks exactly what the build compiles.

No ``--use_fast_math``: the kernels must keep exact ReLU / NaN behaviour.

CLI (for humans; CI runs tests/test_kernels_compile.py):
    python -m twell.kernels.build --report     # nvcc -cubin every csrc/*.cu, table of regs/spills/smem
    python -m twell.kernels.build --build      # build + load the extension, print path and time
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from twell.paths import repo_root

# The single list of device flags (the real build and the ptxas check both use it).
NVCC_FLAGS: tuple[str, ...] = (
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",  # wgmma/TMA need the arch-specific 'a' target
    "-lineinfo",
    "-std=c++17",
)
CXX_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17")
LDFLAGS: tuple[str, ...] = ()
# torch adds these to every CUDA compile of an extension; the ptxas check adds them too.
TORCH_NVCC_DEFINES: tuple[str, ...] = (
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
)
EXTENSION_NAME = "twell_kernels"
SOURCE_SUFFIXES = (".cu", ".cpp")  # compiled into the one extension
HEADER_SUFFIXES = (".h", ".cuh", ".hpp", ".inl")
REQUIRED_CAPABILITY = (9, 0)
LOG_TAIL_CHARS = 8000


class BuildError(RuntimeError):
    """The extension failed to build; ``build_dir`` and ``log_tail`` (compiler output) attached."""

    def __init__(self, message: str, build_dir: Path, log_tail: str):
        super().__init__(message)
        self.build_dir = Path(build_dir)
        self.log_tail = log_tail


def csrc_dir() -> Path:
    """``<repo>/csrc``."""
    return repo_root() / "csrc"


def default_sources(root: Path | None = None) -> list[Path]:
    """Every csrc/*.cu and csrc/*.cpp (sorted), i.e. what goes into the one extension."""
    root = Path(root) if root is not None else csrc_dir()
    return sorted(p for suffix in SOURCE_SUFFIXES for p in root.glob("*" + suffix))


def find_cuda_home() -> Path | None:
    """The CUDA toolkit root (holding bin/nvcc and include/cuda_runtime.h), or None.

    Tries $CUDA_HOME, $CUDA_PATH, the resolved nvcc on PATH, then /usr/local/cuda. An nvcc on
    PATH can be a wrapper script (/usr/local/bin/nvcc here), whose parent is not the toolkit:
    torch would then take /usr/local as CUDA_HOME and miss the CUDA headers for host sources.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(str(Path(on_path).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file() and (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c)
    return None


def find_nvcc() -> str | None:
    """Path of nvcc: the toolkit's (see find_cuda_home), else any nvcc on PATH; None if absent."""
    home = find_cuda_home()
    if home is not None:
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


def cxx_compiler() -> str:
    """The host C++ compiler cpp_extension compiles and links with ($CXX, else c++)."""
    try:
        from torch.utils.cpp_extension import get_cxx_compiler
        return get_cxx_compiler()
    except ImportError:  # older torch
        return os.environ.get("CXX", "c++")


def loaded_libstdcxx() -> str | None:
    """Path of the libstdc++ shared library this process has loaded (torch needs it), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = sorted(set(re.findall(r"(/\S*/libstdc\+\+\.so[.\d]*)$", maps, re.M)))
    return found[0] if found else None


def libstdcxx_ldflags(cxx: str | None = None) -> tuple[str, ...]:
    """Link flags that keep the extension on the process's shared libstdc++.

    A compiler driver that finds only libstdc++.a (the H100 image's CXX=/opt/gcc/bin/g++) links a
    private static copy of libstdc++ into the extension. Its iostream locale facets then disagree
    with those of the shared copy torch loaded, and formatting a number (any TORCH_CHECK message
    holding one) crashes (SIGSEGV) or comes out wrong instead of raising (docs/kernels.md §11). In
    that case the loaded libstdc++.so is named as a link input, so the static archive is never used.
    """
    return _libstdcxx_ldflags(cxx or cxx_compiler())


def _run_cxx(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=8)
def _libstdcxx_ldflags(cxx: str) -> tuple[str, ...]:
    if sys.platform != "linux":
        return ()
    argv = shlex.split(cxx)  # $CXX may carry a launcher or flags ("ccache g++")
    probe = _run_cxx(argv + ["-print-file-name=libstdc++.so"])
    if probe is None:
        return ()  # no usable compiler: the build itself will report that
    found = probe.stdout.strip()
    if os.path.isabs(found) and Path(found).exists():
        return ()  # the driver links the shared library itself
    loaded = loaded_libstdcxx()
    if loaded is None:
        raise BuildError(f"{cxx} has no shared libstdc++ (it would link libstdc++.a into the extension, which "
                         "crashes on error messages) and this process has none loaded to link instead; "
                         "set CXX to a compiler with a shared libstdc++", default_build_root(), "")
    # -nostdlib++ (GCC >= 13, clang) also drops the driver's own -lstdc++, so no archive member can fill
    # in a symbol the loaded library lacks: such a symbol fails at import instead of mixing in silently.
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("int twell_probe() { return 0; }\n")
        link = _run_cxx(argv + ["-nostdlib++", "-shared", "-fPIC", "-o", str(Path(tmp) / "probe.so"), str(src)])
    return (loaded,) + (("-nostdlib++",) if link is not None and link.returncode == 0 else ())


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str | None = None) -> str:
    """``release X.Y, VX.Y.Z`` line of ``nvcc --version`` ('' when nvcc is missing)."""
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        return ""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"release [^\n]*", out)
    return m.group(0) if m else out.strip().splitlines()[-1] if out.strip() else ""


def default_build_root() -> Path:
    """$TWELL_BUILD_DIR, else ~/.cache/twell (the ext-<hash> directories go inside)."""
    env = os.environ.get("TWELL_BUILD_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "twell"


@dataclasses.dataclass(frozen=True)
class ExtensionSpec:
    """Everything that determines one build: sources, headers, flags, toolchain versions."""

    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    name: str = EXTENSION_NAME
    nvcc_flags: tuple[str, ...] = NVCC_FLAGS
    cxx_flags: tuple[str, ...] = CXX_FLAGS
    ldflags: tuple[str, ...] = LDFLAGS
    build_root: Path | None = None

    @classmethod
    def from_dir(cls, root: Path | None = None, **kw) -> "ExtensionSpec":
        """All .cu/.cpp of a directory as sources and its headers (default: csrc/)."""
        root = Path(root) if root is not None else csrc_dir()
        headers = sorted(p for p in root.glob("*") if p.suffix in HEADER_SUFFIXES)
        return cls(sources=tuple(default_sources(root)), headers=tuple(headers), **kw)

    def fingerprint(self) -> str:
        """16 hex chars of sha256 over source/header contents, flags, torch/CUDA/nvcc/python versions."""
        h = hashlib.sha256()

        def add(tag: str, value: str | bytes) -> None:
            data = value.encode() if isinstance(value, str) else value
            h.update(f"{tag}:{len(data)}:".encode())
            h.update(data)

        add("name", self.name)
        for path in self.sources + self.headers:
            add("file", Path(path).name)
            add("content", Path(path).read_bytes())
        for flag in self.nvcc_flags:
            add("nvcc_flag", flag)
        for flag in self.cxx_flags:
            add("cxx_flag", flag)
        for flag in self.link_flags():
            add("ldflag", flag)
        add("cxx", cxx_compiler())
        add("torch", torch.__version__)
        add("torch_cuda", str(torch.version.cuda))
        add("nvcc", nvcc_version())
        add("python", sys.version.split()[0])
        return h.hexdigest()[:16]

    def link_flags(self) -> tuple[str, ...]:
        """``ldflags`` plus what the host compiler needs to keep libstdc++ shared (libstdcxx_ldflags)."""
        return self.ldflags + libstdcxx_ldflags()

    @property
    def build_dir(self) -> Path:
        root = Path(self.build_root) if self.build_root is not None else default_build_root()
        return root / f"ext-{self.fingerprint()}"

    @property
    def module_name(self) -> str:
        # The hash in the module name lets a process load a rebuilt extension after an edit
        # (Python refuses two modules of one name from different files only by overwriting).
        return f"{self.name}_{self.fingerprint()[:10]}"


class ExtensionLoader:
    """Builds and loads extensions, caching the module (or the build error) per fingerprint."""

    def __init__(self):
        self._modules: dict[str, object] = {}
        self._errors: dict[str, BuildError] = {}
        self.default_module = None  # what load() returned first; reused without re-hashing csrc/

    def load(self, spec: ExtensionSpec | None = None, verbose: bool = False, retry: bool = False):
        """Build (if needed) and import the extension; raises BuildError with the compiler output."""
        spec = spec or ExtensionSpec.from_dir()
        if not spec.sources:
            raise BuildError(f"no .cu/.cpp sources to build (looked in {csrc_dir()})", spec.build_dir, "")
        key = spec.fingerprint()
        if key in self._modules:
            return self._modules[key]
        if key in self._errors and not retry:
            raise self._errors[key]
        try:
            module = self._build(spec, verbose)
        except BuildError as err:
            self._errors[key] = err
            raise
        self._modules[key] = module
        return module

    @staticmethod
    def _build(spec: ExtensionSpec, verbose: bool):
        from torch.utils import cpp_extension

        home = find_cuda_home()
        if home is not None and not os.environ.get("CUDA_HOME"):
            os.environ["CUDA_HOME"] = str(home)
        # cpp_extension read CUDA_HOME when it was first imported (before this function): where its
        # choice lacks the CUDA headers (an nvcc wrapper on PATH, /usr/local/bin/nvcc here), use ours.
        torch_home = getattr(cpp_extension, "CUDA_HOME", None)
        if home is not None and not (torch_home and (Path(torch_home) / "include" / "cuda_runtime.h").is_file()):
            cpp_extension.CUDA_HOME = str(home)
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        build_dir = spec.build_dir
        started = time.perf_counter()
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            lock_file = build_dir / ".twell-build.lock"
            try:  # for writing: NFS emulates flock with byte-range locks, which need it
                lock = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
            except PermissionError:  # another user's lock file: a local flock works read-only
                lock = os.open(lock_file, os.O_RDONLY)
        except OSError as exc:
            raise BuildError(f"cannot use the build directory {build_dir}: {exc}", build_dir, str(exc)) from exc
        try:
            # One build per directory at a time. The kernel drops this lock when its holder dies, unlike
            # torch's own lock file, which a killed build leaves behind (every later build would wait on
            # it forever): found while holding ours, it is stale.
            locked = True
            try:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    print(f"[twell] waiting for another process building the kernels in {build_dir}", flush=True)
                    fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as exc:  # a file system without flock (NFS without locking, some FUSE mounts)
                locked = False
                warnings.warn(f"no file lock in {build_dir} ({exc}): building without one, under torch's lock "
                              "file only (a build killed there leaves it behind: delete "
                              f"{build_dir / 'lock'} if a build waits forever)", stacklevel=3)
            if locked:
                (build_dir / "lock").unlink(missing_ok=True)
            # torch skips ninja for a name it has loaded or tried in this process: a retry, or a build another
            # process failed while this one waited, would import a library that was never built.
            versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
            if versioner is not None:
                versioner.entries.pop(spec.module_name, None)
            try:
                module = cpp_extension.load(
                    name=spec.module_name,
                    sources=[str(p) for p in spec.sources],
                    extra_cflags=list(spec.cxx_flags),
                    extra_cuda_cflags=list(spec.nvcc_flags),
                    extra_ldflags=list(spec.link_flags()),
                    extra_include_paths=sorted({str(Path(p).parent) for p in spec.sources}),
                    build_directory=str(build_dir),
                    verbose=verbose,
                )
            except Exception as exc:  # cpp_extension raises RuntimeError/OSError/ImportError with the log
                text = str(exc)
                log = build_dir / "build_error.log"
                try:
                    log.write_text(text)
                except OSError as log_exc:
                    log = f"not written: {log_exc}"
                tail = text[-LOG_TAIL_CHARS:]
                raise BuildError(
                    f"building the twell CUDA extension failed ({type(exc).__name__}).\n"
                    f"build dir: {build_dir}  (full log: {log})\n"
                    f"compiler output (tail):\n{tail}", build_dir, tail) from exc
            try:
                (build_dir / "build_info.txt").write_text(
                    f"module {spec.module_name}\nseconds {time.perf_counter() - started:.1f}\n"
                    f"torch {torch.__version__} cuda {torch.version.cuda} nvcc {nvcc_version()}\n"
                    f"nvcc_flags {' '.join(spec.nvcc_flags)}\ncxx_flags {' '.join(spec.cxx_flags)}\n"
                    f"cxx {cxx_compiler()} ldflags {' '.join(spec.link_flags())}\n")
            except OSError:
                pass  # a record for people, not needed to run
        finally:
            os.close(lock)  # releases the flock
        return module


@functools.lru_cache(maxsize=1)
def default_loader() -> ExtensionLoader:
    """The process's loader (one object, so a module is built and imported once per process)."""
    return ExtensionLoader()


def load(verbose: bool = False, retry: bool = False):
    """Build (cached on disk by hash) and import the extension from csrc/; returns the module.

    Raises BuildError (message: compiler output tail and build directory) when the build fails;
    a failed build is remembered for this process unless ``retry=True``. The ops call this on every
    call, so after the first success the module is returned without re-reading and re-hashing the
    sources (that host work would sit inside every timed kernel call); ``retry=True`` looks again,
    e.g. after editing csrc/ in a running process.
    """
    loader = default_loader()
    if loader.default_module is not None and not retry:
        return loader.default_module
    loader.default_module = loader.load(ExtensionSpec.from_dir(), verbose=verbose, retry=retry)
    return loader.default_module


def available(build: bool = True) -> tuple[bool, str]:
    """(True, where) when the kernels can run here, else (False, every reason why not).

    Checks CUDA, an sm_90 (Hopper) device, nvcc, ninja and csrc sources; with ``build=True``
    also builds/loads the extension (a build failure is a reason), with ``build=False`` builds
    nothing.
    """
    reasons, detail = _prerequisites()
    if reasons:
        return False, "; ".join(reasons)
    if not build:
        return True, detail
    try:
        module = load()
    except BuildError as err:
        return False, f"build failed: {err}"
    return True, f"loaded {getattr(module, '__file__', module)}"


@functools.lru_cache(maxsize=1)
def _prerequisites() -> tuple[tuple[str, ...], str]:
    """(reasons the kernels cannot run, description when they can); fixed for a process."""
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"no CUDA: torch {torch.__version__} is a CPU-only build")
    elif not torch.cuda.is_available():
        reasons.append("no CUDA device visible (torch.cuda.is_available() is False)")
    else:
        cap = torch.cuda.get_device_capability()
        if cap != REQUIRED_CAPABILITY:
            reasons.append(f"device {torch.cuda.get_device_name()} is sm_{cap[0]}{cap[1]}; "
                           f"the kernels are built for sm_90a (Hopper, e.g. H100)")
    nvcc = find_nvcc()
    if nvcc is None:
        reasons.append("no nvcc found (set CUDA_HOME to the CUDA toolkit or put nvcc on PATH)")
    if shutil.which("ninja") is None:
        reasons.append("no ninja on PATH (pip install ninja)")
    sources = default_sources()
    if not sources:
        reasons.append(f"no .cu/.cpp sources in {csrc_dir()}")
    if reasons:
        return tuple(reasons), ""
    return (), (f"prerequisites present ({torch.cuda.get_device_name()}, nvcc {nvcc_version(nvcc)}, "
                f"{len(sources)} sources); not built (build=False)")


# ------------------------------------------------------------------ ptxas report
@dataclasses.dataclass
class KernelResources:
    """ptxas -v numbers of one entry function."""

    name: str            # demangled when c++filt/cu++filt is available
    mangled: str
    arch: str
    registers: int | None = None
    stack_bytes: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem_bytes: int = 0  # static shared memory (dynamic smem is set at launch, not seen here)
    barriers: int | None = None

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)


@dataclasses.dataclass
class CompileResult:
    source: Path
    ok: bool
    returncode: int
    output: str
    seconds: float
    kernels: list[KernelResources]


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")


def parse_ptxas(text: str) -> list[KernelResources]:
    """Entry functions with registers, stack, spills, static smem and barriers from ptxas -v output."""
    kernels: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    props_for: str | None = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = kernels.setdefault(m.group(1), KernelResources(m.group(1), m.group(1), m.group(2)))
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _STACK.search(line)
        if m and props_for in kernels:
            k = kernels[props_for]
            k.stack_bytes, k.spill_stores, k.spill_loads = (int(v) for v in m.groups())
            continue
        m = _USED.search(line)
        if m and current is not None:
            current.registers = int(m.group(1))
            s = _SMEM.search(line)
            current.smem_bytes = int(s.group(1)) if s else 0
            b = _BARRIERS.search(line)
            current.barriers = int(b.group(1)) if b else None
    out = list(kernels.values())
    _demangle(out)
    return out


def _demangle(kernels: list[KernelResources]) -> None:
    tool = shutil.which("cu++filt") or (str(Path(find_nvcc()).parent / "cu++filt") if find_nvcc() else None)
    if not tool or not Path(tool).exists():
        tool = shutil.which("c++filt")
    if not tool or not kernels:
        return
    try:
        res = subprocess.run([tool], input="\n".join(k.mangled for k in kernels), capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return
    names = res.stdout.splitlines()
    if res.returncode == 0 and len(names) == len(kernels):
        for k, n in zip(kernels, names):
            k.name = n.strip()


def compile_command(source: Path, output: Path, nvcc: str, extra: tuple[str, ...] = ()) -> list[str]:
    """nvcc command that compiles the device code of one .cu to a cubin with ptxas -v.

    Same device flags and defines as the extension build; torch's include dirs plus a shim dir
    (see _shim_include_dir) and Python's include dir.
    """
    from torch.utils import cpp_extension

    includes = list(cpp_extension.include_paths()) + [str(_shim_include_dir()),
                                                       sysconfig.get_paths()["include"],
                                                       str(Path(source).parent)]
    return [nvcc, *NVCC_FLAGS, *TORCH_NVCC_DEFINES, *extra,
            f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f"-I{p}" for p in includes), "-Xptxas", "-v", "-cubin", "-o", str(output), str(source)]


@functools.lru_cache(maxsize=1)
def _shim_include_dir() -> Path:
    """Include dir with the one generated c10 header that the CPU torch wheel does not ship.

    ``c10/cuda/CUDAMacros.h`` includes ``c10/cuda/impl/cuda_cmake_macros.h``, which only CUDA
    builds of torch contain; for a compile-only check it just declares shared-library linkage.
    A CUDA build of torch ships the real one, which then comes first on the include path.
    """
    root = Path(tempfile.mkdtemp(prefix="twell-shim-"))
    header = root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True)
    header.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return root


def compile_one(source: Path, nvcc: str | None = None, extra: tuple[str, ...] = ()) -> CompileResult:
    """Compile one .cu for sm_90a (device code only) and parse its ptxas resource usage."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    with tempfile.TemporaryDirectory(prefix="twell-ptxas-") as tmp:
        cmd = compile_command(Path(source), Path(tmp) / (Path(source).stem + ".cubin"), nvcc, extra)
        started = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    output = res.stdout + res.stderr
    return CompileResult(Path(source), res.returncode == 0, res.returncode, output, seconds,
                         parse_ptxas(output))


def compile_all(sources: list[Path] | None = None, jobs: int | None = None,
                extra: tuple[str, ...] = ()) -> list[CompileResult]:
    """compile_one over every csrc/*.cu (or ``sources``) in parallel (``jobs`` default: cpu count)."""
    sources = [Path(s) for s in (sources if sources is not None else sorted(csrc_dir().glob("*.cu")))]
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(sources) or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda s: compile_one(s, nvcc, extra), sources))


def check_host_syntax(source: Path, cxx: str | None = None) -> CompileResult:
    """``c++ -fsyntax-only`` of one host source (csrc/*.cpp) with the build's C++ flags and includes.

    Catches host-side errors (bindings) on a CPU machine; the CUDA include dir comes from nvcc.
    """
    from torch.utils import cpp_extension

    cxx = cxx or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (c++/g++) on PATH")
    home = find_cuda_home()
    includes = list(cpp_extension.include_paths()) + [str(_shim_include_dir())]
    if home is not None:
        includes.append(str(home / "include"))
    includes += [sysconfig.get_paths()["include"], str(Path(source).parent)]
    cmd = [cxx, "-fsyntax-only", *CXX_FLAGS, "-w", f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}",
           "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-I{p}" for p in includes), str(source)]
    started = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    return CompileResult(Path(source), res.returncode == 0, res.returncode, res.stdout + res.stderr,
                         time.perf_counter() - started, [])


def format_report(results: list[CompileResult], name_width: int = 70) -> str:
    """Plain-text table: file, kernel, registers, stack, spill stores/loads, static smem, barriers."""
    head = f"{'file':<24} {'kernel':<{name_width}} {'regs':>5} {'stack':>6} {'spill st':>8} {'spill ld':>8} {'smem':>7} {'bar':>4}"
    lines = [f"ptxas resource usage, sm_90a, flags: {' '.join(NVCC_FLAGS)}", head, "-" * len(head)]
    for r in results:
        if not r.ok:
            lines.append(f"{r.source.name:<24} COMPILE FAILED (exit {r.returncode}, {r.seconds:.1f} s)")
            continue
        if not r.kernels:
            lines.append(f"{r.source.name:<24} (no kernels) ({r.seconds:.1f} s)")
        for k in r.kernels:
            name = k.name if len(k.name) <= name_width else k.name[: name_width - 3] + "..."
            flag = "  <-- SPILLS" if k.spills else ""
            lines.append(f"{r.source.name:<24} {name:<{name_width}} {k.registers!s:>5} {k.stack_bytes!s:>6} "
                         f"{k.spill_stores!s:>8} {k.spill_loads!s:>8} {k.smem_bytes:>7} {k.barriers!s:>4}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twell.kernels.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="compile every csrc/*.cu, print ptxas table")
    parser.add_argument("--build", action="store_true", help="build and load the extension")
    parser.add_argument("--verbose", action="store_true", help="show the ninja/compiler output of --build")
    parser.add_argument("files", nargs="*", help="with --report: .cu files instead of csrc/*.cu")
    args = parser.parse_args(argv)
    if not (args.report or args.build):
        parser.error("give --report and/or --build")
    status = 0
    if args.report:
        results = compile_all([Path(f) for f in args.files] if args.files else None)
        print(format_report(results))
        for r in results:
            if not r.ok:
                status = 1
                print(f"\n=== {r.source} failed to compile (exit {r.returncode}):\n{r.output[-LOG_TAIL_CHARS:]}")
        spilling = [k.name for r in results for k in r.kernels if k.spills]
        if spilling:
            status = 1
            print(f"\nkernels with register spills: {spilling}")
    if args.build:
        spec = ExtensionSpec.from_dir()
        print(f"building {len(spec.sources)} sources into {spec.build_dir}", flush=True)
        started = time.perf_counter()
        try:
            module = default_loader().load(spec, verbose=args.verbose)
        except BuildError as err:
            print(err)
            return 1
        print(f"built and loaded {module.__file__} in {time.perf_counter() - started:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
