"""The benchmark's real-activation cases: FFN inputs captured from a checkpoint on prepared tokens."""
import json
import random

import numpy as np
import pytest
import torch

from twell.bench.activity import union_reuse
from twell.bench.captured import capture_ffn_inputs, read_tokens
from twell.bench.ffn import BenchConfig, BenchRunner, build_cases, dense_ffn, markdown_report
from twell.data import DataConfig, prepare_data
from twell.model import ModelConfig, build_model, save_pretrained
from twell.model.llama import sparse_ffns

WORDS = "sparse gate relu tile token neuron kernel layer the a of to in is and".split()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    rng = random.Random(7)
    d = tmp_path_factory.mktemp("corpus")
    with (d / "docs.jsonl").open("w") as f:
        for i in range(80):
            f.write(json.dumps({"id": f"fixture-{i}", "text": " ".join(rng.choice(WORDS) for _ in range(60))}) + "\n")
    return prepare_data(DataConfig(source=str(d / "docs.jsonl"), vocab_size=300, val_fraction=0.3),
                        out_dir=tmp_path_factory.mktemp("prep") / "p", progress=False)


def _checkpoint(path, vocab, hidden=64, inter=160, layers=3, seed=0, tokenizer_choice=None):
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                     num_heads=2, num_kv_heads=2, max_position_embeddings=128)
    save_pretrained(build_model(mc), None, path, dtype=torch.bfloat16, tokenizer_choice=tokenizer_choice)
    return path


@pytest.fixture(scope="module")
def checkpoint(prepared, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("ck") / "model", prepared.vocab_size)


def test_captured_inputs_are_what_each_layer_receives(checkpoint, prepared):
    """Outputs recorded by forward hooks in a separate forward equal the dense FFN of the captured inputs,
    row for row: right layer, right tokens, right order across batches."""
    n, seq = 200, 48  # 5 sequences, the last one cut: n is not a multiple of seq
    cap = capture_ffn_inputs(checkpoint, prepared.dir, n, seq, layers=[2, 0], batch=2, progress=False)
    assert [c.layer for c in cap.layers] == [2, 0]
    assert cap.source["seq"] == seq and cap.source["n_tokens"] == n and cap.source["split"] == "val"
    from twell.model import load_pretrained

    model, _ = load_pretrained(checkpoint, ffn_path="dense", dtype=torch.bfloat16, load_tokenizer=False)
    ffns = sparse_ffns(model)
    outs = {}
    for i in (0, 2):
        ffns[i].register_forward_hook(lambda mod, args, out, i=i: outs.setdefault(i, []).append(out))
    ids, _ = read_tokens(prepared.dir, 5 * seq)
    with torch.no_grad():
        model(torch.from_numpy(ids).view(5, seq))
    for c in cap.layers:
        assert c.x.shape == (n, 64) and c.x.dtype == torch.bfloat16 and c.w_down.shape == (64, 160)
        assert torch.equal(c.w_gate, ffns[c.layer].gate_proj.weight)
        want = torch.cat(outs[c.layer]).reshape(-1, 64)[:n]
        assert torch.equal(dense_ffn(c.x, c.w_gate, c.w_up, c.w_down), want)
    # Different layers see different inputs.
    assert not torch.equal(cap.layers[0].x, cap.layers[1].x)



def test_capture_takes_an_input_passed_by_keyword(checkpoint, prepared, monkeypatch):
    """A custom model may call its MLP as mlp(x=h): the capture hook must find the input there too."""
    import twell.model

    class ByKeyword(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            return self.inner(x=h)

    load = twell.model.load_pretrained

    def load_wrapped(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        for layer in model.model.layers:
            layer.mlp = ByKeyword(layer.mlp)
        return model, tok

    monkeypatch.setattr(twell.model, "load_pretrained", load_wrapped)
    by_kw = capture_ffn_inputs(checkpoint, prepared.dir, 96, 48, layers=[1], progress=False)
    monkeypatch.undo()
    plain = capture_ffn_inputs(checkpoint, prepared.dir, 96, 48, layers=[1], progress=False)
    assert torch.equal(by_kw.layers[0].x, plain.layers[0].x)


def test_bench_real_cases_on_cpu(checkpoint, prepared):
    cfg = BenchConfig(device="cpu", shapes="real", checkpoint=str(checkpoint), tokens=str(prepared.dir),
                      real_M=130, real_seq=64, energy=False, memory=False, reps=3, warmup=1)
    runner = BenchRunner(cfg, progress=False)
    result = runner.run()
    cases = result["cases"]
    assert [r["name"] for r in cases] == [f"real M=130 layer{i}" for i in range(3)]
    for r, cap in zip(cases, runner.captured.layers):
        c = r["case"]
        assert (c["kind"], c["M"], c["D"], c["H"], c["layer"]) == ("real", 130, 64, 160, cap.layer)
        per_row = (torch.relu(cap.x @ cap.w_gate.t()) != 0).sum(1).float()
        assert r["sparsity"]["mean_active"] == pytest.approx(per_row.mean().item())
        active = torch.relu(cap.x @ cap.w_gate.t()) != 0
        assert r["sparsity"]["union_reuse_64"] == pytest.approx(union_reuse(active, (64,))[64]) and r["bias"] is None
        v = r["impls"]["twell-reference"]
        assert v["ok"] and v["rel_err"] < 1e-2 and v["speedup"] > 0
    assert result["real_inputs"]["layers"] == [0, 1, 2] and not result["failures"]
    md = markdown_report(result)
    assert "| real layer1 | 130 | 64 x 160 | captured |" in md
    assert "Real cases: the inputs of SparseFFN layers [0, 1, 2] (of 3)" in md
    assert "pairs per distinct neuron in blocks of 64 consecutive rows" in md
    json.dumps(result)  # the JSON the CLI writes


def test_speedup_plot_shows_real_layers_as_points(checkpoint, prepared):
    from twell.reports import kernel_study as ks

    cfg = BenchConfig(device="cpu", shapes="inference", cases=("nnz8", "nnz29"), Ms=(256,), checkpoint=str(checkpoint),
                      tokens=str(prepared.dir), real_M=64, energy=False, memory=False, reps=2, warmup=1)
    run = ks.BenchRun(BenchRunner(cfg, progress=False).run(), None, this_run=True)
    table = ks.speedup_table(run)
    real = table[table["shape"] == "real"]
    assert list(real["case"]) == ["layer0", "layer1", "layer2"] and (real["correct"] == "yes").all()
    fig = ks.plot_speedup(table, run)
    ax = fig.axes[0]
    points = [ln for ln in ax.get_lines() if ln.get_label() == "real inputs (checkpoint layers), M = 64"]
    assert len(points) == 1 and points[0].get_linestyle() == "None" and len(points[0].get_xdata()) == 3
    assert sum(t.get_text().startswith("layer") for t in ax.texts) == 3

    # A second implementation (as twell-kernel-union beside twell-kernel on the GPU): its real layers
    # become hollow diamonds at their own speedups, one of them wrong; generator rows are not drawn.
    import copy

    result = copy.deepcopy(run.result)
    for i, r in enumerate(result["cases"]):
        other = dict(r["impls"]["twell-reference"], speedup=0.5 + 0.25 * i, ok=i % 2 == 0)
        r["impls"] = {"twell-reference": r["impls"]["twell-reference"], "other-impl": other}
    two = ks.BenchRun(result, None, this_run=True)
    assert ks.impl_names(result) == ["twell-reference", "other-impl"]
    others = [ks.speedup_table(two, n) for n in ks.impl_names(result)[1:]]
    fig = ks.plot_speedup(ks.speedup_table(two), two, others=others)
    ax = fig.axes[0]
    (hollow,) = [ln for ln in ax.get_lines() if ln.get_label() == "real inputs, other-impl, M = 64"]
    real_rows = [i for i, r in enumerate(result["cases"]) if r["case"]["kind"] == "real"]
    assert list(hollow.get_ydata()) == [0.5 + 0.25 * i for i in real_rows] and hollow.get_markerfacecolor() == "white"
    assert [ln for ln in ax.get_lines() if ln.get_markerfacecolor() == "white" and ln.get_marker() == "D"] == [hollow]
    crosses = [ln for ln in ax.get_lines() if ln.get_marker() == "x" and len(ln.get_xdata())]
    assert [list(ln.get_ydata()) for ln in crosses] == [[0.5 + 0.25 * i for i in real_rows if i % 2]]
    assert ks.WRONG_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]


def test_bench_all_adds_real_cases_after_generator_cases(checkpoint, prepared):
    cfg = BenchConfig(device="cpu", shapes="inference", cases=("nnz8",), checkpoint=str(checkpoint),
                      tokens=str(prepared.dir), real_M=64, real_layers=(1,)).resolved()
    runner = BenchRunner(BenchConfig(**{**cfg.__dict__, "shapes": "all"}), progress=False)
    names = [c.name for c in build_cases(runner.cfg, runner.capture())]
    assert names[-2] == "real M=64 layer1" and names[-1].startswith("train")
    assert [c.name for c in build_cases(cfg, runner.capture())][-1] == "real M=64 layer1"
    # Neither the odd shape nor training alone brings real cases.
    for shapes in ("odd", "train"):
        only = BenchConfig(**{**cfg.__dict__, "shapes": shapes})
        assert all(c.kind != "real" for c in build_cases(only, runner.capture()))


def test_checkpoint_without_real_shapes_is_not_run(checkpoint, prepared, monkeypatch):
    import twell.bench.ffn as ffn

    monkeypatch.setattr(ffn, "capture_ffn_inputs", lambda *a, **k: pytest.fail("captured without real cases"))
    cfg = BenchConfig(device="cpu", shapes="odd", cases=("nnz8",), checkpoint=str(checkpoint), tokens=str(prepared.dir),
                      energy=False, memory=False, reps=2, warmup=1)
    result = BenchRunner(cfg, progress=False).run()
    assert [r["case"]["kind"] for r in result["cases"]] == ["odd"] and "real_inputs" not in result
    assert "Real cases" not in markdown_report(result)


def test_tokens_of_another_tokenizer_are_refused(prepared, tmp_path):
    other = {**prepared.tokenizer_choice, "name": "another-bpe"}
    ck = _checkpoint(tmp_path / "other", prepared.vocab_size, layers=1, tokenizer_choice=other)
    with pytest.raises(ValueError, match="another tokenizer than"):
        capture_ffn_inputs(ck, prepared.dir, 32, progress=False)
    same = _checkpoint(tmp_path / "same", prepared.vocab_size, layers=1, tokenizer_choice=prepared.tokenizer_choice)
    cap = capture_ffn_inputs(same, prepared.dir, 32, progress=False)
    assert cap.source["tokenizer"] == prepared.tokenizer_choice


def test_bench_real_errors(checkpoint, prepared, tmp_path):
    with pytest.raises(ValueError, match="need both a checkpoint and tokens"):
        BenchRunner(BenchConfig(device="cpu", checkpoint=str(checkpoint)), progress=False)
    with pytest.raises(ValueError, match="shapes 'real' needs a checkpoint"):
        BenchRunner(BenchConfig(device="cpu", shapes="real"), progress=False)
    with pytest.raises(ValueError, match="layers must be distinct indices in"):
        capture_ffn_inputs(checkpoint, prepared.dir, 32, layers=[3], progress=False)
    with pytest.raises(ValueError, match="need 100000000"):
        capture_ffn_inputs(checkpoint, prepared.dir, 10**8, progress=False)
    with pytest.raises(FileNotFoundError, match="prepared data directory"):
        capture_ffn_inputs(checkpoint, tmp_path, 32, progress=False)
    big = np.arange(1000, dtype=np.int64) + 5000  # ids beyond the model's 300-token vocabulary
    np.save(tmp_path / "ids.npy", big)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        capture_ffn_inputs(checkpoint, tmp_path / "ids.npy", 32, progress=False)
    np.save(tmp_path / "ok.npy", np.arange(64, dtype=np.int32) % 50)
    cap = capture_ffn_inputs(checkpoint, tmp_path / "ok.npy", 64, progress=False)
    assert cap.source["tokens"].endswith("ok.npy") and len(cap.layers) == 3
    np.save(tmp_path / "neg.npy", np.arange(64, dtype=np.int64) - 1)
    with pytest.raises(ValueError, match="negative token id -1"):
        capture_ffn_inputs(checkpoint, tmp_path / "neg.npy", 64, progress=False)
    with pytest.raises(ValueError, match="seq must be in"):
        capture_ffn_inputs(checkpoint, tmp_path / "ok.npy", 64, seq=129, progress=False)


def test_cli_rejects_incomplete_real_settings(capsys):
    from twell.bench.__main__ import main

    with pytest.raises(SystemExit, match="need both a checkpoint and tokens"):
        main(["ffn", "--device", "cpu", "--tokens", "/nowhere", "--quiet"])


@pytest.mark.gpu
def test_bench_real_cases_run_the_kernels(tmp_path, prepared):
    """The kernels (per-row and with the block-union rule) on captured inputs of a model with the
    kernels' shape limits met (D = 512 for the union path): correct within the protocol's tolerance."""
    from twell import kernels

    ok, why = kernels.available()
    if not ok:
        pytest.skip(why)
    # A random model's gates are ~50% active, past the union path's 128 entries per row; the generator
    # case at nnz 64 over H = 1408 gives blocks the rule takes, so the union path runs too.
    ck = _checkpoint(tmp_path / "model", prepared.vocab_size, hidden=512, inter=1408, layers=2, seed=1)
    cfg = BenchConfig(device="cuda", shapes="inference", cases=("nnz64",), Ms=(4096,), D=512, H=1408, odd_M=333,
                      odd_H=1000, checkpoint=str(ck), tokens=str(prepared.dir), real_M=1000, real_seq=100,
                      impls=("twell-kernel", "twell-kernel-ops", "twell-kernel-union"), energy=False, reps=3)
    result = BenchRunner(cfg, progress=False).run()
    assert not result["failures"] and not result["unavailable"]
    assert [r["name"] for r in result["cases"]] == ["inference M=4096 nnz64", "odd M=333 nnz64",
                                                   "real M=1000 layer0", "real M=1000 layer1"]
    for r in result["cases"]:
        for name in ("twell-kernel", "twell-kernel-ops", "twell-kernel-union"):
            v = r["impls"][name]
            assert v["ok"] and v["rel_err"] < 1e-2 and v["nonfinite"] == 0, (r["name"], name, v)
    info = result["cases"][0]["impls"]["twell-kernel-union"]["info"]
    assert info["blocks"] == 64 and 0 < info["union_blocks"] <= 64, info


def test_train_ffn_with_a_checkpoint_adds_its_layers_as_training_cases(checkpoint, prepared):
    """train-ffn with a checkpoint: after the generator's training cases, one per layer on the first train_M rows
    it captured from real text, at the activity the model learnt; the same protocol (exactness, timings)."""
    from twell.bench.registry import Registry
    from twell.reference.training import train_gated_ffn

    def ref_train(x, w_gate, w_up, w_down):
        out, l1, _, _ = train_gated_ffn(x, w_gate, w_up, w_down)
        return out, l1

    reg = Registry()
    reg.register_fn("ref-train", ref_train, kind="training")
    cfg = BenchConfig(device="cpu", shapes="train", cases=("nnz8",), D=64, H=160, train_M=100, impls=(),
                      train_impls=("ref-train",), checkpoint=str(checkpoint), tokens=str(prepared.dir), real_M=130,
                      real_seq=64, energy=False, memory=False, reps=2, warmup=1)
    runner = BenchRunner(cfg, registry=reg, progress=False)
    result = runner.run()
    cases = result["cases"]
    assert [(r["case"]["kind"], r["case"]["sparsity"], r["case"]["M"], r["case"]["layer"]) for r in cases] == \
        [("train", "nnz8", 100, None)] + [("train", f"layer{i}", 100, i) for i in range(3)]
    for r, cap in zip(cases[1:], runner.captured.layers):
        active = (torch.relu(cap.x[:100] @ cap.w_gate.t()) != 0).sum(1).float()
        assert r["sparsity"]["mean_active"] == pytest.approx(active.mean().item()) and r["bias"] is None
        assert r["impls"]["ref-train"]["ok"], r["impls"]["ref-train"]
    assert not result["failures"]
    md = markdown_report(result)
    assert "| train layer2 | 100 | 64 x 160 | captured |" in md and "Training cases `train layer<i>`" in md
    json.dumps(result)
