"""Tests of twell.bench.published: the paper's kernels beside ours (--published DIR).

The CPU tests write a TEST FAKE of the published package into tmp_path: the same module layout and entry
points (custom_models/twell_modules/twell.py, custom_models/hybrid_modules/sparse_ops_loader.py), computing
a dense FFN in plain PyTorch, with variants that return a wrong answer, kill their process with a signal
(as a segfault does) or fail to build. None of it is the paper's code. The GPU test runs the real
directory named by $TWELL_PUBLISHED_DIR.
"""
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from twell.bench import ffn as bench_ffn
from twell.bench import published
from twell.bench.__main__ import main as bench_main
from twell.bench.registry import Registry

FAKE_TWELL = '''\
"""TEST FAKE of the published twell module (pure PyTorch, dense math); not the paper's code."""
import os
import signal
import time

import torch

MODE = {mode!r}
BUILT = []


def get_ext(algorithms=None, verbose=False):
    if MODE == "build_fails":
        raise RuntimeError("Error building extension 'twell_prod_ext': fake nvcc failure")
    BUILT.append(tuple(algorithms))
    return object()


class TwELLGatedMLP:
    made = 0

    def __init__(self, layer_number, GATE, UP, DOWN, **kw):
        assert layer_number == 0 and DOWN.shape == GATE.shape == UP.shape, "DOWN must be W_down.T [H, D]"
        assert DOWN.is_contiguous()
        self.g, self.u, self.d = GATE, UP, DOWN
        self.destroyed = False
        TwELLGatedMLP.made += 1

    def __call__(self, A):
        assert not self.destroyed
        if MODE == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if MODE == "hang":  # a kernel that never returns
            time.sleep(3600)
        a = A.float()
        h = torch.relu(a @ self.g.float().t()) * (a @ self.u.float().t())
        out = (h @ self.d.float()).to(A.dtype)
        return out * 1.25 if MODE == "wrong" else out

    def destroy(self):
        self.destroyed = True
'''

FAKE_LOADER = '''\
"""TEST FAKE of the published sparse_ops loader (pure PyTorch, dense math); not the paper's code."""
import os
import signal

import torch

MODE = {mode!r}


def _ff_forward_gated(X, G, K, V):
    assert X.dim() == 3 and X.shape[0] == 8, "X must be [8, M / 8, D]"
    assert V.shape == G.shape == K.shape, "V must be W_down.T [H, D]"
    if MODE == "abort":
        os.abort()
    h = torch.relu(X @ G.t()) * (X @ K.t())
    y = h @ V
    l1 = h.abs().float().sum(-1).mean()
    l0 = (h != 0).float().sum(-1).mean().detach()
    return y, l0, (2 * l1 if MODE == "wrong" else l1), None, None, None


def load_sparse_ops(verbose=False):
    if MODE == "build_fails":
        raise RuntimeError("Error building extension 'sparse_ops': fake nvcc failure")
    torch.ops.sparse_ops.ff_forward_gated = _ff_forward_gated
'''

README = "## sparser-faster-llms/\nThe paper's public code, SakanaAI/sparser-faster-llms at commit 661f1fc (test).\n"


def fake_published(where: Path, mode: str = "good") -> Path:
    """A fake published checkout at where/sparser-faster-llms, with a README beside it stating its commit."""
    root = where / "sparser-faster-llms"
    (root / "custom_models" / "twell_modules").mkdir(parents=True)
    (root / "custom_models" / "hybrid_modules").mkdir(parents=True)
    # Like the real one it drags in a dependency the kernels do not need: the loader must not run it.
    (root / "custom_models" / "__init__.py").write_text(
        'raise ImportError("test fake: custom_models/__init__.py must not be imported")\n')
    (root / "custom_models" / "twell_modules" / "twell.py").write_text(FAKE_TWELL.format(mode=mode))
    (root / "custom_models" / "hybrid_modules" / "sparse_ops_loader.py").write_text(FAKE_LOADER.format(mode=mode))
    (where / "README.md").write_text(README)
    return root


def _cfg(tmp_path, pub, **kw):
    # Inference at the one D x H the published TwELL kernels take (M a multiple of 256); training tiny.
    base = dict(device="cpu", shapes="inference", cases=("nnz8",), Ms=(256,), D=2048, H=5632, odd_M=45,
                odd_H=200, train_M=64, impls=("twell-reference",), reps=2, warmup=1, energy=False,
                fp32_check=False, out=tmp_path, published=str(pub), published_timeout=300)
    base.update(kw)
    return bench_ffn.BenchConfig(**base)


def _dense_inputs(M, D, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, wg, wu = (torch.randn(*s, generator=g).bfloat16() for s in ((M, D), (H, D), (H, D)))
    wd = (torch.randn(D, H, generator=g) / H ** 0.5).bfloat16()
    return x, wg / D ** 0.5, wu / D ** 0.5, wd


# ---------------------------------------------------------------- directory, provenance, loading
def test_check_dir_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        published.check_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no custom_models/"):
        published.check_dir(tmp_path)
    root = fake_published(tmp_path / "a")
    with pytest.raises(ValueError, match="pass its parent"):
        published.check_dir(root / "custom_models")
    (root / "custom_models" / "hybrid_modules" / "sparse_ops_loader.py").unlink()
    with pytest.raises(ValueError, match="sparse_ops_loader.py"):
        published.check_dir(root)
    assert published.check_dir(fake_published(tmp_path / "b")) == (tmp_path / "b" / "sparser-faster-llms").resolve()


def test_source_info_commit_from_git_or_readme_and_a_digest_of_the_sources(tmp_path):
    # Inside another repository (as .device/ of this one is), that repository's HEAD is not DIR's commit.
    outer = tmp_path / "outer"
    outer.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q", str(outer)], check=True)
    root = fake_published(outer / "baselines")
    subprocess.run(git + ["-C", str(outer), "add", "-A"], check=True)
    subprocess.run(git + ["-C", str(outer), "commit", "-qm", "x"], check=True)
    info = published.source_info(root)
    assert info["commit"] == "661f1fc" and info["commit_source"].startswith("stated in")
    assert info["files"] == 3 and len(info["sources_sha256"]) == 64 and info["dir"] == str(root.resolve())
    before = info["sources_sha256"]
    (root / "custom_models" / "twell_modules" / "twell.py").write_text("# changed\n")
    assert published.source_info(root)["sources_sha256"] != before
    # A checkout of its own: git's HEAD.
    subprocess.run(git + ["init", "-q", str(root)], check=True)
    subprocess.run(git + ["-C", str(root), "add", "-A"], check=True)
    subprocess.run(git + ["-C", str(root), "commit", "-qm", "y"], check=True)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    info = published.source_info(root)
    assert info["commit"] == head and info["commit_source"] == "git"


def test_unsupported_shapes_name_the_limit():
    assert published.twell_unsupported(65536, 2048, 5632) is None
    assert published.twell_unsupported(8192, 2048, 8192) is None
    why = published.twell_unsupported(12345, 2048, 5600)
    assert "M = 12345 is not a multiple of 256" in why and "H = 5600" in why
    assert "D = 1024" in published.twell_unsupported(256, 1024, 5632)
    assert published.hybrid_unsupported(16384, 2048, 5632) is None
    assert "M = 203 is not a multiple of 8" in published.hybrid_unsupported(203, 64, 320)
    assert "16-bit" in published.hybrid_unsupported(64, 64, 70000)


def test_adapters_have_the_registry_contracts_and_match_dense(tmp_path):
    reg = published.register(Registry(), fake_published(tmp_path))
    x, wg, wu, wd = _dense_inputs(64, 32, 96)
    twell_fn = reg.resolve("published-twell")
    out = twell_fn(x, wg, wu, wd.t().contiguous())
    ref = bench_ffn.dense_ffn(x, wg, wu, wd)
    assert out.shape == (64, 32) and out.dtype == torch.bfloat16 and bench_ffn.rel_error(out, ref) < 1e-2
    first = twell_fn.mlp
    twell_fn(x, wg, wu, wd.t().contiguous())  # a new w_down_t tensor: a new module, the old one destroyed
    assert twell_fn.mlp is not first and first.destroyed
    second = twell_fn.mlp
    wdt = wd.t().contiguous()
    twell_fn(x, wg, wu, wdt)
    twell_fn(x, wg, wu, wdt)
    assert twell_fn.mlp is not second and twell_fn.mlp.made == 3  # built once per weight set, not per call
    assert twell_fn.unsupported(64, 32, 96) is not None  # the real kernels' limits, whatever the fake does

    hybrid = reg.resolve("published-hybrid", kind="training")
    leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    out, l1 = hybrid(*leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    ref_out, ref_l1 = bench_ffn.dense_train_ffn(*ref_leaves)
    assert out.shape == (64, 32) and l1.dim() == 0 and l1.dtype == torch.float32
    assert float(l1.detach()) == pytest.approx(float(ref_l1.detach()), rel=1e-2)
    g = torch.randn(64, 32).bfloat16()
    grads = torch.autograd.grad((out, l1), leaves, (g, torch.tensor(2e-5)))
    ref_grads = torch.autograd.grad((ref_out, ref_l1), ref_leaves, (g, torch.tensor(2e-5)))
    for a, b in zip(grads, ref_grads):
        assert a.shape == b.shape and bench_ffn.rel_error(a, b) < 2e-2
    v = hybrid.v
    hybrid(*leaves)
    assert hybrid.v is v  # their [H, D] copy made once per weight version
    info = hybrid.describe(*(t.detach() for t in leaves))
    assert {"rows_over_ell", "rows_past_tail", "neurons_over_ell", "neurons_past_tail"} <= set(info)


def test_a_build_failure_is_reported_not_raised(tmp_path):
    reg = published.register(Registry(), fake_published(tmp_path, "build_fails"))
    with pytest.raises(published.ImplUnavailable, match="did not build or load.*fake nvcc failure"):
        reg.resolve("published-twell")
    with pytest.raises(published.ImplUnavailable, match="fake nvcc failure"):
        reg.resolve("published-hybrid", kind="training")


def test_config_round_trips_through_json(tmp_path):
    cfg = _cfg(tmp_path, fake_published(tmp_path)).resolved()
    back = bench_ffn.BenchConfig.from_dict(json.loads(json.dumps(published._jsonable(dataclasses.asdict(cfg)))))
    assert back == cfg


# ---------------------------------------------------------------- the bench, child processes
def test_cli_validates_the_directory_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["train-ffn", "--published", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "o"),
                    "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --published: no custom_models/ in it" in err and "pass the directory of a" in err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_cli_inference_with_a_correct_published_impl(tmp_path, capsys):
    root = fake_published(tmp_path / "pub")
    code = bench_main(["ffn", "--shapes", "inference", "--M", "256", "--D", "2048", "--H", "5632", "--odd-M", "45",
                       "--odd-H", "200", "--cases", "nnz8", "--reps", "2", "--warmup", "1", "--no-fp32-check",
                       "--impl", "twell-reference", "--published", str(root), "--out", str(tmp_path), "--quiet"])
    assert code == 0
    (js,) = tmp_path.glob("ffn-*.json")
    res = json.loads(js.read_text())
    block = res["published"]
    assert block["source"]["commit"] == "661f1fc" and block["source"]["dir"] == str(root.resolve())
    assert block["build"]["published-twell"]["ok"] and block["failures"] == [] and block["unavailable"] == {}
    assert "factor 1" in block["l1"]
    main, odd = res["cases"]
    e = main["published"]["published-twell"]
    assert e["status"] == "done" and e["ok"] and e["rel_err"] < 1e-2 and e["child"]["returncode"] == 0
    same = e["same_process"]
    assert e["speedup"] == pytest.approx(same["dense"]["median_ms"] / e["timing"]["median_ms"])
    ours = same["ours"]["twell-reference"]
    assert ours["ok"] and e["ours_vs_published"]["twell-reference"] == pytest.approx(
        e["timing"]["median_ms"] / ours["timing"]["median_ms"])
    assert same["sparsity"] == main["sparsity"]  # the child ran on the parent's inputs
    assert "gate" in same
    o = odd["published"]["published-twell"]
    assert o["status"] == "unavailable" and "not a multiple of 256" in o["unavailable"] and "child" not in o
    md = capsys.readouterr().out
    assert "## Published kernels" in md and "| inference nnz8 | 256 | published-twell |" in md
    assert "n/a: the published TwELL kernels cannot run this shape" in md and "FAIL" not in md


@pytest.mark.parametrize("mode", ["wrong", "segfault"])
def test_wrong_and_crashing_published_inference_is_recorded(tmp_path, mode):
    cfg = _cfg(tmp_path, fake_published(tmp_path / "pub", mode), cases=("nnz8", "nnz29"), shapes="inference",
               Ms=(256,), odd_M=45)
    runner = bench_ffn.BenchRunner(cfg, progress=False)
    result = runner.run()
    assert result["complete"] and len(result["cases"]) == 4  # the bench survived every child
    assert result["failures"] == [] and bench_ffn.exit_code(result) == 0  # ours are fine: the run passes
    fails = result["published"]["failures"]
    ran = [r for r in result["cases"] if r["case"]["kind"] == "inference"]
    assert len(fails) == len(ran) == 2
    for r in ran:
        e = r["published"]["published-twell"]
        assert r["impls"]["twell-reference"]["ok"] and not e["ok"]
        if mode == "wrong":
            assert e["status"] == "done" and e["rel_err"] > 0.2 and e["same_process"]["ours"]["twell-reference"]["ok"]
        else:
            assert e["status"] == "crashed" and e["child"]["signal"] == "SIGSEGV"
            assert "crashed: killed by SIGSEGV" in e["error"] and "Segmentation fault" in e["log_tail"]
            # where: their frame, and the harness stage it was under (the correctness call)
            assert "in __call__ at twell.py:" in e["error"] and "under run_inference (ffn.py:" in e["error"]
    md = bench_ffn.markdown_report(result)
    assert "PUBLISHED KERNELS: WRONG RESULTS, CRASHES" in md and "CORRECTNESS FAILURES" not in md
    assert ("rel. error" if mode == "wrong" else "SIGSEGV") in fails[0]


def test_a_hung_published_kernel_is_killed_and_recorded(tmp_path):
    cfg = _cfg(tmp_path, fake_published(tmp_path / "pub", "hang"), shapes="inference", odd_M=45, published_timeout=15)
    result = bench_ffn.BenchRunner(cfg, progress=False).run()
    assert result["complete"]
    e = result["cases"][0]["published"]["published-twell"]
    assert e["status"] == "timed out" and not e["ok"] and e["child"]["timed_out"] and e["child"]["seconds"] < 60
    assert "timed out after" in e["error"] and "timed out after" in result["published"]["failures"][0]


@pytest.mark.parametrize("mode", ["good", "wrong", "abort"])
def test_published_training_in_a_child(tmp_path, mode):
    cfg = _cfg(tmp_path, fake_published(tmp_path / "pub", mode), shapes="train", cases=("nnz29",), D=64, H=320,
               impls=(), train_impls=())
    result = bench_ffn.BenchRunner(cfg, progress=False).run()
    (rec,) = result["cases"]
    e = rec["published"]["published-hybrid"]
    if mode == "good":
        assert e["status"] == "done" and e["ok"], e
        assert set(e["rel_err_parts"]) == {"out", "l1", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down"}
        assert e["speedup"] == pytest.approx(e["same_process"]["dense"]["median_ms"] / e["timing"]["median_ms"])
        assert "rows_past_tail" in e["info"] and e["info"]["their_defaults"]["tail_rows"] == 2048
        assert result["published"]["failures"] == []
    elif mode == "wrong":  # twice the L1 term: l1 and every gradient it reaches are off
        assert e["status"] == "done" and not e["ok"] and e["rel_err_parts"]["l1"] > 0.5
        assert "published-hybrid" in result["published"]["failures"][0]
    else:
        assert e["status"] == "crashed" and e["child"]["signal"] == "SIGABRT" and not e["ok"]
    md = bench_ffn.markdown_report(result)
    assert "| train nnz29 | 64 | published-hybrid |" in md and "factor 1" in md


def test_a_published_build_failure_leaves_the_bench_running(tmp_path):
    cfg = _cfg(tmp_path, fake_published(tmp_path / "pub", "build_fails"), shapes="inference", odd_M=45)
    result = bench_ffn.BenchRunner(cfg, progress=False).run()
    assert result["complete"] and all(r["impls"]["twell-reference"]["ok"] for r in result["cases"])
    why = result["published"]["unavailable"]["published-twell"]
    assert why.startswith("the published TwELL kernels from") and "fake nvcc failure" in why  # the loader's reason
    for r in result["cases"]:
        assert r["published"]["published-twell"]["status"] == "unavailable"
    assert bench_ffn.exit_code(result) == 2  # asked for, could not run
    assert "`published-twell` unavailable" in bench_ffn.markdown_report(result)


# ---------------------------------------------------------------- harness additions
def test_an_impl_that_does_not_run_a_shape_is_unavailable_for_that_case(tmp_path):
    def some_shapes(x, w_gate, w_up, w_down_t):
        h = torch.relu(x.float() @ w_gate.float().t()) * (x.float() @ w_up.float().t())
        return (h @ w_down_t.float()).bfloat16()

    some_shapes.unsupported = lambda M, D, H: f"M = {M}: odd" if M % 2 else None
    reg = Registry()
    reg.register_fn("some", some_shapes)
    cfg = _cfg(tmp_path, None, published=None, impls=("some",), Ms=(96,), D=64, H=320, odd_M=45)
    result = bench_ffn.BenchRunner(cfg, registry=reg, progress=False).run()
    big, odd = result["cases"]
    assert big["impls"]["some"]["ok"] and odd["impls"]["some"] == {"unavailable": "M = 45: odd"}
    assert result["failures"] == [] and bench_ffn.exit_code(result) == 0
    assert "n/a: M = 45: odd" in bench_ffn.markdown_report(result)


def test_dense_compiled_training_baseline(tmp_path):
    def good(x, w_gate, w_up, w_down):
        h = torch.relu(x @ w_gate.t()) * (x @ w_up.t())
        return h @ w_down.t(), h.abs().sum(-1, dtype=torch.float32).mean()

    reg = Registry()
    reg.register_fn("good", good, kind="training")
    # aot_eager: the compile path (graph capture, AOT autograd) without a C++ toolchain, fast on CPU.
    cfg = _cfg(tmp_path, None, published=None, shapes="train", cases=("nnz29",), D=64, H=320, impls=(),
               train_impls=("good",), dense_compile="aot_eager")
    result = bench_ffn.BenchRunner(cfg, registry=reg, progress=False).run()
    (rec,) = result["cases"]
    comp = rec["dense_compiled"]
    assert comp["backend"] == "aot_eager" and comp["rel_err"] < 1e-2 and "error" not in comp
    assert comp["speedup"] == pytest.approx(rec["dense"]["timing"]["median_ms"] / comp["timing"]["median_ms"])
    r = rec["impls"]["good"]
    assert r["speedup_vs_compiled"] == pytest.approx(comp["timing"]["median_ms"] / r["timing"]["median_ms"])
    md = bench_ffn.markdown_report(result)
    assert "speedup vs compiled" in md and "Dense compiled (torch.compile, backend aot_eager" in md
    off = _cfg(tmp_path, None, published=None, shapes="train", cases=("nnz29",), D=64, H=320, impls=(),
               train_impls=("good",))
    (rec,) = bench_ffn.BenchRunner(off, registry=reg, progress=False).run()["cases"]
    assert "dense_compiled" not in rec  # the CPU default: none


# ---------------------------------------------------------------- the real kernels
@pytest.mark.gpu
def test_gpu_real_published_kernels_beside_ours(tmp_path):
    """The paper's kernels from $TWELL_PUBLISHED_DIR at the protocol's D x H: built, run in child processes,
    each case's entry either a measurement (checked against dense like ours) or a recorded crash."""
    root = os.environ.get("TWELL_PUBLISHED_DIR")
    if not root:
        pytest.skip("set TWELL_PUBLISHED_DIR to a SakanaAI/sparser-faster-llms checkout to run the real kernels")
    cfg = bench_ffn.BenchConfig(device="cuda", shapes="all", cases=("nnz29", "nnz29-heavy"), Ms=(8192,),
                                impls=("twell-kernel",), train_impls=("twell-train-kernel",), reps=5, warmup=2,
                                energy=False, out=tmp_path, published=root)
    result = bench_ffn.BenchRunner(cfg, progress=False, allow_dirty=True).run()
    assert result["complete"] and result["published"]["unavailable"] == {}, result["published"]["unavailable"]
    tol = cfg.tol
    for r in result["cases"]:
        (name, e), = r["published"].items()
        if r["case"]["kind"] == "odd":
            assert e["status"] == "unavailable"
            continue
        assert e["status"] in ("done", "crashed", "timed out"), e
        if e["status"] == "done":
            assert e["ok"] == (e["rel_err"] < tol and e["nonfinite"] == 0)
            assert e["timing"]["median_ms"] > 0 and e["same_process"]["ours"]
        if r["case"]["kind"] == "inference" and r["case"]["sparsity"] == "nnz29":
            assert e["status"] == "done" and e["ok"], e  # their kernels are right on light tails
    train = [r for r in result["cases"] if r["case"]["kind"] == "train"]
    assert train and all("timing" in r.get("dense_compiled", {}) for r in train)
    md = bench_ffn.markdown_report(result)
    assert "## Published kernels" in md
