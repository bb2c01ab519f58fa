"""The paper's published kernels beside ours: ``python -m twell.bench ffn|train-ffn --published DIR``.

DIR is a checkout (or copy) of SakanaAI/sparser-faster-llms holding ``custom_models/``. Nothing of it is
part of this repository: it is imported from DIR at benchmark time, through its public entry points,
and only inside child processes:

- ``published-twell`` (inference): ``custom_models.twell_modules.twell.TwELLGatedMLP(0, W_gate, W_up,
  W_down.T)`` built once per weight set, then ``mlp(x)``. Runs M a multiple of 256, D = 2048 and
  H = 5632 or 8192 only (:func:`twell_unsupported`).
- ``published-hybrid`` (training): ``torch.ops.sparse_ops.ff_forward_gated(x.view(8, M // 8, D), W_gate,
  W_up, V)`` with V = W_down.T [H, D] after ``load_sparse_ops()``; differentiable; returns
  ``(y, l0, l1, P, R, T)``. Its l1 is the mean over rows of sum_j |h_ij| (fp32 accumulation; backward
  adds sign(h) / M), the same as BENCHMARK.md's ``h.abs().sum(-1).float().mean()``: factor 1, so
  outputs, l1 and the four gradients are compared with dense's as they are (:data:`L1_DEFINITION`).

Their code can crash the process (segfaults on large or near-dense inputs), so each case runs in a
child process (``python -m twell.bench.published child SPEC``) that times dense, our implementations
and the published one alternately on the parent's inputs (saved to a file: the same tensors), and
writes its record as JSON. A signal, an exit status or a timeout becomes that case's failure row; the
bench goes on. Their wrong answers are compared with dense exactly like ours and marked wrong.

``python -m twell.bench.published build DIR`` builds (or loads from torch's extension cache) both
extensions and reports, so the first build (minutes) can run before the benchmark.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.machinery
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from twell.bench.registry import ImplUnavailable, Registry

PUBLISHED_INFERENCE = "published-twell"
PUBLISHED_TRAINING = "published-hybrid"
KINDS = {PUBLISHED_INFERENCE: "inference", PUBLISHED_TRAINING: "training"}
REPO = "SakanaAI/sparser-faster-llms"
ENTRY_FILES = ("custom_models/twell_modules/twell.py", "custom_models/hybrid_modules/sparse_ops_loader.py")
BUILD_TIMEOUT = 1800.0  # both extensions from source: minutes on a 16-core host
LOG_TAIL = 3000

# Capacities of the hybrid format as its KNOBS.md documents the defaults: the per-row ELL width, the
# rows its dense tail holds (rows past it are dropped), and the slots of one 256-wide tile of the
# packed gate at compression 8 (one holds the count). Used only to say why a result is wrong.
HYBRID_ELL_WIDTH = 128
HYBRID_TAIL_ROWS = 2048
TILE_SLOTS_C8 = 256 // 8 - 1

L1_DEFINITION = ("published-hybrid's l1 is the mean over rows of sum_j |h_ij| with h = relu(x W_gate^T) * "
                 "(x W_up^T), accumulated in fp32 (its backward adds sign(h) / M to dh): the same as "
                 "BENCHMARK.md's h.abs().sum(-1).float().mean(), factor 1, so its l1 and gradients are "
                 "compared with dense's unscaled. Rows it drops past its dense-tail capacity add nothing to it.")


# ------------------------------------------------------------------ what they can run
def twell_unsupported(M: int, D: int, H: int) -> str | None:
    """Why the published TwELL inference kernels cannot run [M, D] x [H, D], or None."""
    why = []
    if M % 256:
        why.append(f"M = {M} is not a multiple of 256")
    if D != 2048:
        why.append(f"D = {D}: they are built for D = 2048 only")
    if H % 256 or H // 256 not in (22, 32):
        why.append(f"H = {H}: they take H = 5632 or 8192 only (22 or 32 tiles of 256)")
    return f"the published TwELL kernels cannot run this shape: {'; '.join(why)}" if why else None


def hybrid_unsupported(M: int, D: int, H: int) -> str | None:
    """Why the published hybrid training op cannot take [M, D] x [H, D], or None. Shapes off its fast
    path (M, H multiples of 256, D of 64) run its own einsum fallback, which is still theirs to time."""
    why = []
    if M % 8:
        why.append(f"M = {M} is not a multiple of 8 (the op takes x as [8, M / 8, D])")
    if D % 8 or H % 8:
        why.append(f"D = {D}, H = {H}: both must be multiples of 8 (its kernels move 8 bf16 at a time)")
    if H > 65536:
        why.append(f"H = {H} does not fit its 16-bit column indices")
    return f"the published hybrid training op cannot run this shape: {'; '.join(why)}" if why else None


UNSUPPORTED: dict[str, Callable[[int, int, int], str | None]] = {
    PUBLISHED_INFERENCE: twell_unsupported, PUBLISHED_TRAINING: hybrid_unsupported}


# ------------------------------------------------------------------ the directory
def check_dir(path) -> Path:
    """DIR resolved, or ValueError naming what is missing and what to pass instead."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"--published {path}: no such directory; pass the directory of a {REPO} checkout "
                         "(the one holding custom_models/)")
    if not (root / "custom_models").is_dir():
        hint = ""
        if root.name == "custom_models" or (root / "twell_modules").is_dir():
            hint = f" (it looks like custom_models/ itself: pass its parent, {root.resolve().parent})"
        raise ValueError(f"--published {path}: no custom_models/ in it{hint}; pass the directory of a {REPO} "
                         "checkout (the one holding custom_models/)")
    missing = [f for f in ENTRY_FILES if not (root / f).is_file()]
    if missing:
        raise ValueError(f"--published {path}: custom_models/ lacks {', '.join(missing)}; pass a complete "
                         f"{REPO} checkout (commit 661f1fc has both)")
    return root.resolve()


def dir_argument(text: str) -> str:
    """argparse type of --published DIR: the resolved directory, or the usage error (exit 2) before any work."""
    try:
        return str(check_dir(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--published {text}: ")) from exc


def source_info(path) -> dict:
    """What code the published columns ran: DIR, its commit (git, or as the README beside it states) and a
    sha256 over every file under custom_models/ (relative path and bytes), which tells copies apart."""
    root = check_dir(path)
    h = hashlib.sha256()
    files = sorted(p for p in (root / "custom_models").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    commit, source = _git_commit(root), "git"
    if commit is None:
        commit, source = _stated_commit(root)
    return {"repo": REPO, "dir": str(root), "commit": commit, "commit_source": source,
            "sources_sha256": h.hexdigest(), "files": len(files)}


def _git_commit(root: Path) -> str | None:
    """HEAD of DIR when DIR is itself the top of a git work tree (not a folder inside another repository,
    such as an ignored folder of this one, whose HEAD says nothing about DIR)."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=20)
        if top.returncode or Path(top.stdout.strip()).resolve() != root:
            return None
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20)
        if head.returncode:
            return None
        return head.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _stated_commit(root: Path) -> tuple[str | None, str | None]:
    """The commit a README beside DIR (or in it) says the copy is of: "<name>/ ... at commit <hex>"."""
    for readme in (root.parent / "README.md", root / "README.md"):
        try:
            text = readme.read_text(errors="replace")
        except OSError:
            continue
        m = (re.search(rf"{re.escape(root.name)}\S*.{{0,200}}?at commit ([0-9a-f]{{7,40}})", text, re.S)
             or re.search(r"at commit ([0-9a-f]{7,40})", text))
        if m:
            return m.group(1), f"stated in {readme}"
    return None, None


# ------------------------------------------------------------------ loading their modules
_LOADED_FROM: Path | None = None


def _import(root: Path, module: str):
    """Import ``custom_models.<...>`` from DIR without running custom_models/__init__.py: that file imports
    the Hugging Face model classes (transformers), which the kernels do not use and whose import breaks
    across transformers versions. A package object for custom_models is put in its place; the submodules
    are their own files, imported as the paper's code imports them."""
    global _LOADED_FROM
    pkg_dir = root / "custom_models"
    if _LOADED_FROM != root:  # another DIR loaded before (tests): its modules must not answer for this one
        for key in [k for k in sys.modules if k == "custom_models" or k.startswith("custom_models.")]:
            del sys.modules[key]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if "custom_models" not in sys.modules:
        pkg = types.ModuleType("custom_models")
        pkg.__path__ = [str(pkg_dir)]
        pkg.__spec__ = importlib.machinery.ModuleSpec("custom_models", None, is_package=True)
        pkg.__spec__.submodule_search_locations = [str(pkg_dir)]
        sys.modules["custom_models"] = pkg
    _LOADED_FROM = root
    return importlib.import_module(module)


def _short(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else "..." + text[-(limit - 3):]  # a build error's end says most


def load_twell(path):
    """Their twell module with the twell_mlp extension built (torch's extension cache) and loaded."""
    root = check_dir(path)
    try:
        twell = _import(root, "custom_models.twell_modules.twell")
        twell.get_ext(algorithms=["twell_mlp"])
    except Exception as exc:  # a failed nvcc build, a missing toolchain, an import error: say which
        raise ImplUnavailable(f"the published TwELL kernels from {root} did not build or load: {_short(exc)} "
                              f"(python -m twell.bench.published build {root} shows the whole log)") from exc
    return twell


def load_hybrid(path) -> Callable:
    """``torch.ops.sparse_ops.ff_forward_gated`` after their loader built (or found) and registered it."""
    root = check_dir(path)
    try:
        loader = _import(root, "custom_models.hybrid_modules.sparse_ops_loader")
        loader.load_sparse_ops()
        return torch.ops.sparse_ops.ff_forward_gated
    except Exception as exc:
        raise ImplUnavailable(f"the published hybrid training op from {root} did not build or load: "
                              f"{_short(exc)} (python -m twell.bench.published build {root} shows the whole "
                              "log)") from exc


# ------------------------------------------------------------------ adapters (our registry's contracts)
class TwellAdapter:
    """Inference contract ``fn(x, w_gate, w_up, w_down_t) -> out [M, D]`` over TwELLGatedMLP.

    The module is built once per weight set (it uploads the gate weight into its cached plan, as a model
    does once at load time): the harness's first call, its correctness check, builds it outside the timed
    region, as w_down_t is prepared outside it."""

    unsupported = staticmethod(twell_unsupported)

    def __init__(self, twell_module):
        self.twell = twell_module
        self.mlp = None
        self.key = None

    def __call__(self, x, w_gate, w_up, w_down_t):
        key = tuple((t.data_ptr(), tuple(t.shape), t._version, str(t.device)) for t in (w_gate, w_up, w_down_t))
        if key != self.key:
            self.close()
            self.mlp = self.twell.TwELLGatedMLP(0, w_gate, w_up, w_down_t)
            self.key = key
        return self.mlp(x.contiguous())

    def close(self) -> None:
        if self.mlp is not None:
            self.mlp.destroy()
        self.mlp, self.key = None, None


class _InTheirLayout(torch.autograd.Function):
    """W_down [D, H] seen as their V = W_down.T [H, D]: the contiguous copy ``v`` comes from the adapter's
    cache, and V's gradient goes back to W_down transposed (a view, no copy)."""

    @staticmethod
    def forward(ctx, w_down, v):
        return v

    @staticmethod
    def backward(ctx, grad_v):
        return grad_v.t(), None


class HybridAdapter:
    """Training contract ``fn(x, w_gate, w_up, w_down) -> (out [M, D], l1)`` over ff_forward_gated.

    Their layer stores V = W_down.T [H, D] as its weight, so a training step never transposes it: the
    adapter makes the [H, D] copy once per weight version (outside the timed region after the first call)
    and hands V's gradient back as W_down's, so the timed work is their op alone, forward and backward."""

    unsupported = staticmethod(hybrid_unsupported)

    def __init__(self, op: Callable):
        self.op = op
        self.v = None
        self.v_key = None

    def their_down(self, w_down: torch.Tensor) -> torch.Tensor:
        key = (w_down.data_ptr(), tuple(w_down.shape), w_down._version, str(w_down.device))
        if key != self.v_key:
            self.v = w_down.detach().t().contiguous()
            self.v_key = key
        return _InTheirLayout.apply(w_down, self.v)

    def __call__(self, x, w_gate, w_up, w_down):
        M, D = x.shape
        y, _l0, l1, *_ = self.op(x.reshape(8, M // 8, D), w_gate, w_up, self.their_down(w_down))
        return y.reshape(M, D), l1

    @staticmethod
    def describe(x, w_gate, w_up, w_down) -> dict:
        """How far these inputs go past the capacities of their format (documented defaults), from the
        gate activations: rows past the ELL width spill to the dense tail, and rows (forward) or neurons
        (backward, transposed) past its capacity are dropped; a 256-tile with more than 31 active
        entries in a row loses the rest."""
        with torch.no_grad():
            active = F.linear(x, w_gate) > 0
            rows, cols = active.sum(1), active.sum(0)
            M, H = active.shape
            full = H // 256 * 256
            tiles = active[:, :full].reshape(M, -1, 256).sum(-1) if full else active[:, :0]
            over_rows, over_cols = int((rows > HYBRID_ELL_WIDTH).sum()), int((cols > HYBRID_ELL_WIDTH).sum())
            return {"their_defaults": {"ell_width": HYBRID_ELL_WIDTH, "tail_rows": HYBRID_TAIL_ROWS,
                                       "tile_slots": TILE_SLOTS_C8},
                    "rows_over_ell": over_rows, "rows_past_tail": max(0, over_rows - HYBRID_TAIL_ROWS),
                    "neurons_over_ell": over_cols, "neurons_past_tail": max(0, over_cols - HYBRID_TAIL_ROWS),
                    "rows_with_a_full_tile": int((tiles > TILE_SLOTS_C8).any(1).sum()) if full else 0,
                    "fast_path": M % 256 == 0 and x.shape[1] % 64 == 0 and H % 256 == 0}


def register(registry: Registry, path) -> Registry:
    """Add published-twell (inference) and published-hybrid (training) from DIR to ``registry``. Their
    factories build/load the extensions when resolved (ImplUnavailable with the reason when not)."""
    root = check_dir(path)
    registry.register(PUBLISHED_INFERENCE, lambda: TwellAdapter(load_twell(root)))
    registry.register(PUBLISHED_TRAINING, lambda: HybridAdapter(load_hybrid(root)), kind="training")
    return registry


# ------------------------------------------------------------------ child processes
def _child_env() -> dict:
    """The parent's environment, with this twell package first on the path (so the child imports the
    same code) and faulthandler on (a segfault prints the Python stack into the child's log)."""
    import twell

    env = dict(os.environ)
    src = str(Path(twell.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def run_child(args: list[str], workdir: Path, timeout: float) -> dict:
    """``python -m twell.bench.published ARGS`` in its own process group; returns returncode, signal (a
    name, when killed by one), timed_out, seconds and the tail of its output (stdout and stderr)."""
    log_path = workdir / "child.log"
    cmd = [sys.executable, "-m", "twell.bench.published", *args]
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:  # the group: a build's ninja and nvcc go too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
    tail = log_path.read_bytes()[-LOG_TAIL:].decode(errors="replace")
    return {"returncode": rc, "signal": _signal_name(-rc) if rc is not None and rc < 0 else None,
            "timed_out": timed_out, "seconds": round(time.perf_counter() - t0, 1), "log_tail": tail}


def child_failure(child: dict, what: str) -> str:
    """One line for a child that did not finish: killed by a signal, timed out, or exited non-zero."""
    if child["timed_out"]:
        how = f"timed out after {child['seconds']:.0f} s (killed)"
    elif child["signal"]:
        how = f"crashed: killed by {child['signal']}"
    else:
        how = f"exited with status {child['returncode']} without a result"
    where = _crash_site(child["log_tail"])
    if where:
        return f"{what} {how} ({where})"
    last = [ln.strip() for ln in child["log_tail"].splitlines() if ln.strip()][-3:]
    return f"{what} {how}" + (f"; last output: {' | '.join(last)[-400:]}" if last else "")


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _crash_site(log: str) -> str | None:
    """From faulthandler's dump: the error, the innermost frame, and the harness frame it was under
    (run_inference / time_alternating / peak_memory_above_baseline... say which stage crashed)."""
    m = re.search(r"Fatal Python error: ([^\n]+)", log)
    if not m:
        return None
    frames = _FRAME.findall(log[m.end():])
    if not frames:
        return m.group(1).strip()
    inner = frames[0]
    text = f"{m.group(1).strip()} in {inner[2]} at {Path(inner[0]).name}:{inner[1]}"
    ours = [f for f in frames[1:] if "/twell/" in f[0] and not f[0].endswith("published.py")
            and not f[2].startswith("<")]
    if ours:
        text += f", under {ours[0][2]} ({Path(ours[0][0]).name}:{ours[0][1]})"
    return text


def build(path, names=tuple(KINDS), timeout: float = BUILD_TIMEOUT) -> dict[str, dict]:
    """Build/load the named published extensions in a child process: name -> {"ok", "reason", "seconds"}.
    A crash or timeout of the child is every name's reason."""
    root = check_dir(path)
    with tempfile.TemporaryDirectory(prefix="twell-published-build-") as tmp:
        out = Path(tmp) / "build.json"
        child = run_child(["build", str(root), "--impls", *names, "--json", str(out)], Path(tmp), timeout)
        if out.is_file():  # written after every attempt; status 1 only says that one failed
            return json.loads(out.read_text())
        why = child_failure(child, "the build child process")
        return {n: {"ok": False, "reason": why, "seconds": child["seconds"]} for n in names}


def save_inputs(inp, path: Path) -> None:
    torch.save({"x": inp.x, "w_gate": inp.w_gate, "w_up": inp.w_up, "w_down": inp.w_down, "bias": inp.bias,
                "nnz": inp.nnz, "tail": inp.tail, "seed": inp.seed}, path)


def load_inputs(path: Path, device):
    from twell.bench.generator import FFNInputs

    d = torch.load(path, map_location=device, weights_only=True)
    return FFNInputs(d["x"], d["w_gate"], d["w_up"], d["w_down"], d["bias"], d["nnz"], d["tail"], d["seed"])


class PublishedCases:
    """The parent's side: builds the published extensions once, then runs each case's published impl in a
    child process on the parent's inputs, and turns what came back (or did not) into the case's entry."""

    def __init__(self, cfg, progress: bool = False):
        self.cfg = cfg
        self.root = check_dir(cfg.published)
        self.source = source_info(self.root)
        self.progress = progress
        self.status: dict[str, dict] = {}

    def prepare(self, kinds: set[str]) -> None:
        """Build the impls the cases need ("inference", "training"), once."""
        names = [n for n, k in KINDS.items() if k in kinds and n not in self.status]
        if not names:
            return
        self._say(f"building/loading the published kernels from {self.root} ({', '.join(names)}; a first build "
                  "takes minutes)")
        self.status.update(build(self.root, names, max(BUILD_TIMEOUT, self.cfg.published_timeout)))
        for n in names:
            if not self.status[n]["ok"]:
                self._say(f"WARNING: {n} unavailable: {self.status[n]['reason']}")

    def unavailable(self) -> dict[str, str]:
        return {n: s["reason"] for n, s in self.status.items() if not s["ok"]}

    def _say(self, text: str) -> None:
        if self.progress:
            print(f"[published] {text}", file=sys.stderr, flush=True)

    def run_case(self, case, inp, ours: list[str]) -> dict:
        """{impl: entry} for the published impl of this case's kind, timed in a child beside ``ours``."""
        kind = "training" if case.kind == "train" else "inference"
        (name,) = [n for n, k in KINDS.items() if k == kind]
        if name not in self.status:
            self.prepare({kind})
        if not self.status[name]["ok"]:
            return {name: {"status": "unavailable", "unavailable": f"not built: {self.status[name]['reason']}"}}
        why = UNSUPPORTED[name](case.M, case.D, case.H)
        if why:
            return {name: {"status": "unavailable", "unavailable": why}}
        if inp is None:
            return {name: {"status": "unavailable", "unavailable": "the case's inputs were not kept for the child"}}
        self._say(f"{case.name}: {name} in a child process")
        with tempfile.TemporaryDirectory(prefix="twell-published-case-") as tmp:
            tmp = Path(tmp)
            save_inputs(inp, tmp / "inputs.pt")
            cfg = dataclasses.replace(self.cfg, published=None, checkpoint=None, tokens=None, out=None,
                                      impls=tuple(ours) + (name,) if kind == "inference" else (),
                                      train_impls=tuple(ours) + (name,) if kind == "training" else ())
            spec = {"config": _jsonable(dataclasses.asdict(cfg)), "case": dataclasses.asdict(case),
                    "inputs": str(tmp / "inputs.pt"), "dir": str(self.root), "impl": name, "ours": list(ours),
                    "out": str(tmp / "record.json")}
            (tmp / "spec.json").write_text(json.dumps(spec))
            child = run_child(["child", str(tmp / "spec.json")], tmp, self.cfg.published_timeout)
            got = None
            if child["returncode"] == 0 and (tmp / "record.json").is_file():
                got = json.loads((tmp / "record.json").read_text())
        return {name: self._entry(name, ours, child, got)}

    def _entry(self, name: str, ours: list[str], child: dict, got: dict | None) -> dict:
        info = {k: child[k] for k in ("returncode", "signal", "timed_out", "seconds")}
        if got is None:
            return {"status": "timed out" if child["timed_out"] else "crashed" if child["signal"] else "failed",
                    "ok": False, "error": child_failure(child, "the child process"), "child": info,
                    "log_tail": child["log_tail"]}
        rec = got["record"]
        if name not in rec["impls"]:  # its factory failed in the child although the build child loaded it
            why = got["unavailable"].get(name, "not resolved")
            return {"status": "failed", "ok": False, "error": f"did not load in the case's child process: {why}",
                    "child": info}
        entry = {"status": "done", **rec["impls"][name], "child": info}
        if child["log_tail"].strip():  # what their code printed (printf warnings, TORCH_WARN) is evidence too
            entry["log_tail"] = child["log_tail"][-1500:]
        if entry.get("unavailable"):
            entry["status"] = "unavailable"
            return entry
        same = {"dense": rec["dense"].get("timing"), "sparsity": rec["sparsity"],
                "dense_energy_memory": {k: rec["dense"][k] for k in ("joules_per_token", "peak_bytes_above_inputs")
                                        if k in rec["dense"]}}
        if "gate" in rec:
            same["gate"] = rec["gate"].get("timing")
        if "dense_compiled" in rec:
            same["dense_compiled"] = {k: v for k, v in rec["dense_compiled"].items() if k != "rel_err_parts"}
        same["ours"] = {o: {k: v for k, v in rec["impls"][o].items()
                            if k in ("ok", "rel_err", "timing", "speedup", "speedup_vs_compiled", "error",
                                     "unavailable")}
                        for o in ours if o in rec["impls"]}
        entry["same_process"] = same
        mine = entry.get("timing")
        entry["ours_vs_published"] = {
            o: mine["median_ms"] / v["timing"]["median_ms"]
            for o, v in same["ours"].items() if mine and v.get("timing")}  # > 1: ours is faster
        return entry


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def failures(result: dict, tol: float) -> list[str]:
    """One line per case and published impl that ran and failed: wrong, non-finite, raised, crashed."""
    from twell.bench.ffn import _failure_text

    out = []
    for r in result["cases"]:
        for n, v in r.get("published", {}).items():
            if v.get("status") != "unavailable" and not v.get("ok"):
                out.append(f"{r['name']}: {n}: {_failure_text(v, tol)}")
    return out


def result_block(pub: PublishedCases, result: dict, tol: float) -> dict:
    return {"source": pub.source, "build": pub.status, "unavailable": pub.unavailable(),
            "failures": failures(result, tol), "l1": L1_DEFINITION,
            "timed_in": "a child process per case and implementation: dense, the gate GEMM (inference), "
                        "dense-compiled (training), our implementations and the published one alternately, "
                        "on the parent's inputs"}


# ------------------------------------------------------------------ markdown
def _ms(t) -> str:
    return f"{t['median_ms']:.3f}" if t else "-"


def _x(v) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def markdown_section(result: dict) -> list[str]:
    """The published kernels' section: source, failures banner, one table per kind."""
    pub = result.get("published")
    if not pub:
        return []
    tol = result["meta"]["config"]["tol"]
    src = pub["source"]
    commit = f"commit {src['commit']}" + (f" ({src['commit_source']})" if src.get("commit_source") else "") \
        if src.get("commit") else "commit unknown"
    lines = ["## Published kernels", "",
             f"`{src['repo']}`, {commit}, from `{src['dir']}` (sources sha256 {src['sources_sha256'][:16]}, "
             f"{src['files']} files). Timed in {pub['timed_in']}; ratios come from that process only. "
             "\"ours vs published\" = published ms / ours ms (> 1: ours is faster).", ""]
    if pub["failures"]:
        lines += ["### **PUBLISHED KERNELS: WRONG RESULTS, CRASHES**", ""]
        lines += [f"- **FAIL** {f}" for f in pub["failures"]] + [""]
    for n, why in pub["unavailable"].items():
        lines.append(f"- `{n}` unavailable: {why}")
    if pub["unavailable"]:
        lines.append("")
    infer = [r for r in result["cases"] if r["case"]["kind"] != "train" and r.get("published")]
    train = [r for r in result["cases"] if r["case"]["kind"] == "train" and r.get("published")]
    if infer:
        lines += ["| case | M | impl | dense ms | published ms | speedup | ours | ours ms | ours speedup "
                  "| ours vs published | rel. error | status |", "|---" * 12 + "|"]
        lines += [row for r in infer for row in _pub_rows(r, tol, training=False)] + [""]
    if train:
        lines += [L1_DEFINITION, "",
                  "| case | M | impl | dense ms | compiled ms | published ms | speedup | vs compiled | ours | ours ms "
                  "| ours speedup | ours vs compiled | ours vs published | rel. error (max of out, l1, grads) "
                  "| status | past their capacity |", "|---" * 16 + "|"]
        lines += [row for r in train for row in _pub_rows(r, tol, training=True)] + [""]
    return lines


def _pub_rows(r: dict, tol: float, training: bool) -> list[str]:
    from twell.bench.ffn import _failure_text

    c = r["case"]
    rows = []
    for n, v in r["published"].items():
        head = f"| {c['kind']} {c['sparsity']} | {c['M']} | {n} "
        if v.get("status") == "unavailable":
            width = 13 if training else 9
            rows.append(head + "| - " * width + f"| n/a: {v['unavailable']} |" + (" - |" if training else ""))
            continue
        status = "ok" if v.get("ok") else f"**FAIL** ({_failure_text(v, tol)})"
        same = v.get("same_process", {})
        ours = same.get("ours") or {"-": {}}
        err = f"{v['rel_err']:.2e}" if v.get("rel_err") is not None else "-"
        comp = same.get("dense_compiled", {}).get("timing")
        for o, ov in ours.items():
            ratio = _x(v.get("ours_vs_published", {}).get(o))
            if training:
                info = v.get("info", {})
                past = (f"rows {info.get('rows_past_tail', '-')}, neurons {info.get('neurons_past_tail', '-')}, "
                        f"full tiles {info.get('rows_with_a_full_tile', '-')}") if info else "-"
                rows.append(head + f"| {_ms(same.get('dense'))} | {_ms(comp)} | {_ms(v.get('timing'))} "
                            f"| {_x(v.get('speedup'))} | {_x(v.get('speedup_vs_compiled'))} | {o} "
                            f"| {_ms(ov.get('timing'))} | {_x(ov.get('speedup'))} "
                            f"| {_x(ov.get('speedup_vs_compiled'))} "
                            f"| {ratio} | {err} | {status} | {past} |")
            else:
                rows.append(head + f"| {_ms(same.get('dense'))} | {_ms(v.get('timing'))} | {_x(v.get('speedup'))} "
                            f"| {o} | {_ms(ov.get('timing'))} | {_x(ov.get('speedup'))} | {ratio} | {err} | {status} |")
    return rows


# ------------------------------------------------------------------ child entry points
def _child_case(spec_path: str) -> int:
    """Run one case (dense, ours, the published impl) on the saved inputs; write the record as JSON."""
    import faulthandler

    from twell.bench.ffn import BenchConfig, BenchRunner, Case
    from twell.bench.registry import default_registry

    faulthandler.enable()
    spec = json.loads(Path(spec_path).read_text())
    cfg = BenchConfig.from_dict(spec["config"])
    case = Case(**spec["case"])
    registry = register(default_registry(), spec["dir"])
    runner = BenchRunner(cfg, registry=registry, progress=False, allow_dirty=True)  # the parent checked the tree
    runner.preset_inputs = load_inputs(Path(spec["inputs"]), runner.device)
    try:
        rec = runner.run_training(case) if case.kind == "train" else runner.run_inference(case)
    finally:
        for fn in list(runner.infer_fns.values()) + list(runner.train_fns.values()):
            if hasattr(fn, "close"):
                fn.close()
    Path(spec["out"]).write_text(json.dumps({"record": rec, "unavailable": runner.unavailable}, default=str))
    return 0


def _child_build(root: str, names: list[str], out: str | None) -> int:
    import faulthandler

    faulthandler.enable()
    loaders = {PUBLISHED_INFERENCE: load_twell, PUBLISHED_TRAINING: load_hybrid}
    status = {}
    for n in names:
        t0 = time.perf_counter()
        try:
            loaders[n](root)
            status[n] = {"ok": True, "reason": None, "seconds": round(time.perf_counter() - t0, 1)}
        except ImplUnavailable as exc:
            status[n] = {"ok": False, "reason": str(exc), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{n}: {'built and loaded' if status[n]['ok'] else status[n]['reason']} "
              f"({status[n]['seconds']} s)", flush=True)
    if out:
        Path(out).write_text(json.dumps(status))
    return 0 if all(s["ok"] for s in status.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m twell.bench.published",
                                description="Build the published kernels (build DIR), or run one benchmark case "
                                            "in a child process (child SPEC, used by twell.bench.ffn).")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build/load the published extensions from DIR and report")
    b.add_argument("dir")
    b.add_argument("--impls", nargs="+", choices=list(KINDS), default=list(KINDS))
    b.add_argument("--json", help="write the status to this file")
    c = sub.add_parser("child", help=argparse.SUPPRESS)
    c.add_argument("spec")
    args = p.parse_args(argv)
    if args.command == "child":
        return _child_case(args.spec)
    try:
        root = check_dir(args.dir)
    except ValueError as exc:
        print(f"python -m twell.bench.published build: error: {exc}", file=sys.stderr)
        return 2
    return _child_build(str(root), args.impls, args.json)


if __name__ == "__main__":
    # Through the package's module object, so that ffn's imports of this module and the child's code are
    # the same classes (runpy runs this file as a second module called __main__).
    from twell.bench.published import main as _main

    sys.exit(_main())
