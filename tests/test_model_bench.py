"""``python -m twell.bench model`` and notebook 04's table on CPU: the same code as on a GPU, at tiny sizes."""
from __future__ import annotations

import json

import matplotlib
import pytest
import torch

from twell.bench.__main__ import main as bench_main
from twell.bench.model import ModelBenchConfig, markdown_report, run_model_bench, static_greedy, write_outputs
from twell.model import ModelConfig, build_model, save_pretrained
from twell.reports import efficiency

matplotlib.use("Agg")

SMALL = dict(device="cpu", prefill_batches=(2,), seq_len=16, decode_batches=(1, 2), prompt_len=8, new_tokens=4,
             train_batch=2, train_steps=1, reps=2, warmup=1, energy=False, decode_static=False, decode_graph=False)


def _checkpoint(path, seed):
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                     max_position_embeddings=64)
    save_pretrained(build_model(mc), None, path, dtype=torch.bfloat16)
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    return _checkpoint(d / "sparse", 0), _checkpoint(d / "dense", 1)


def test_rows_cover_every_measure_and_say_cpu(pair, tmp_path):
    res = run_model_bench(ModelBenchConfig(checkpoint=pair[0], dense_checkpoint=pair[1], label="t", **SMALL),
                          progress=False)
    kinds = [(r["measure"], r["batch"]) for r in res["rows"]]
    assert kinds == [("prefill", 2), ("decode", 1), ("decode", 2), ("training", 2)]
    for r in res["rows"]:
        key = "tokens_per_ms" if r["measure"] == "prefill" else "tokens_per_s"
        assert r["dense"][key] > 0 and r["sparse"][key] > 0
        assert r["speedup"] == pytest.approx(r["sparse"][key] / r["dense"][key])
    act = res["model"]["activity"]
    assert len(act["sparse"]["active_per_layer"]) == 2 and 0 < act["sparse"]["active_frac"] <= 1
    assert act["dense"]["ce"] != act["sparse"]["ce"]  # two different models
    assert "not GPU numbers" in res["meta"]["note"] and res["model"]["tokens"]["kind"] == "random ids"
    tr = res["rows"][-1]["sparse"]
    assert tr["routes"] == ["dense", "dense"] and any("cpu" in n for n in tr["notes"])
    jp, mp = write_outputs(res, tmp_path)
    assert json.loads(jp.read_text())["model"]["label"] == "t"
    assert "not GPU numbers" in mp.read_text() and mp.read_text() == markdown_report(res)


def test_dense_side_defaults_to_the_dense_path(pair):
    res = run_model_bench(ModelBenchConfig(checkpoint=pair[0], **{**SMALL, "train_batch": 0, "decode_batches": (1,)}),
                          progress=False)
    act = res["model"]["activity"]
    assert act["dense"]["ce"] == act["sparse"]["ce"]  # the same weights
    assert [r["measure"] for r in res["rows"]] == ["prefill", "decode"]


def test_static_cache_decode_rows_and_greedy_token_check(pair):
    """decode-static rows (static KV cache, which transformers compiles on a GPU) beside the eager ones,
    and the sparse weights' greedy tokens on the sparse path against the dense path (on CPU "auto" runs
    the TwELL reference: the same tokens)."""
    cfg = {**SMALL, "train_batch": 0, "decode_static": True, "token_check": True}
    res = run_model_bench(ModelBenchConfig(checkpoint=pair[0], dense_checkpoint=pair[1], **cfg), progress=False)
    kinds = [(r["measure"], r["batch"]) for r in res["rows"] if r["measure"] != "prefill"]
    assert kinds == [("decode", 1), ("decode-static", 1), ("decode", 2), ("decode-static", 2)], res["decode_errors"]
    tc = res["token_check"]
    assert tc["same"] and tc["all_divergences_near_ties"] and tc["rows"] == [{"first_diff": None}]
    assert "identical" in markdown_report(res)


def _decoder(layers: int = 2):
    """A tiny random decoder (seed 0) whose greedy tokens vary: what the static-cache decoder tests run."""
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=2,
                     num_kv_heads=2, max_position_embeddings=64, init_std=0.3)
    return build_model(mc).eval()


def test_static_greedy_gives_generate_s_tokens():
    """The CUDA-graph decoder's loop (eager here) with a static KV cache: the tokens of greedy generate."""
    m = _decoder()
    prompt = torch.randint(0, 97, (2, 9))
    with torch.inference_mode():
        tokens, secs = static_greedy(m, prompt, 12)
        ref = m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                         min_new_tokens=12, do_sample=False, pad_token_id=0)[:, 9:]
    assert torch.equal(tokens, ref) and secs > 0
    assert len(set(tokens.flatten().tolist())) > 6  # a varied sequence, not one token repeated


def test_static_greedy_teacher_forcing_and_scores():
    """Fed its own tokens the decoder predicts them again; fed others it predicts what generate gives after that
    history; the top-2 scores are the step's two largest logits, in order."""
    m = _decoder()
    prompt = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        free, _ = static_greedy(m, prompt, 10)
        again, _, top2 = static_greedy(m, prompt, 10, forced=free, scores=True)
        other = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(4))
        pred, _, _ = static_greedy(m, prompt, 10, forced=other, scores=True)
        want = m(input_ids=torch.cat([prompt, other[:, :-1]], 1)).logits[:, 8:].argmax(-1)
        with pytest.raises(ValueError, match="forced"):
            static_greedy(m, prompt, 10, forced=other[:, :5])
    assert torch.equal(again, free) and bool((top2[..., 0] >= top2[..., 1]).all())
    assert torch.equal(pred, want) and not torch.equal(pred, free)


def test_graph_decode_rows_and_their_token_check(pair):
    cfg = {**SMALL, "train_batch": 0, "decode_batches": (2,), "decode_graph": True, "token_check": True}
    res = run_model_bench(ModelBenchConfig(checkpoint=pair[0], dense_checkpoint=pair[1], **cfg), progress=False)
    assert [r["measure"] for r in res["rows"]] == ["prefill", "decode", "decode-graph"], res["decode_errors"]
    assert res["rows"][-1]["sparse"]["tokens_per_s"] > 0
    assert res["token_check"]["graph"]["same"] and "CUDA-graph decoder" in markdown_report(res)


def test_bad_settings():
    with pytest.raises(ValueError, match="new_tokens"):
        ModelBenchConfig(checkpoint="x", new_tokens=1).check()
    with pytest.raises(ValueError, match="prefill_batches"):
        ModelBenchConfig(checkpoint="x", prefill_batches=(0,)).check()


def test_cli_and_table(pair, tmp_path, capsys):
    code = bench_main(["model", pair[0], "--dense-checkpoint", pair[1], "--label", "0.5B", "--device", "cpu",
                       "--prefill-batch", "2", "--seq", "16", "--decode-batch", "1", "--prompt", "8",
                       "--new-tokens", "3", "--train-batch", "0", "--reps", "2", "--no-energy", "--out",
                       str(tmp_path), "--quiet"])
    assert code == 0 and "not GPU numbers" in capsys.readouterr().out
    results = efficiency.load_results(sorted(tmp_path.glob("model-*.json")))
    table = efficiency.efficiency_table(results)
    assert table["scale"].tolist() == ["0.5B"]
    assert table["paper: inference gain %"][0] == pytest.approx(17.0)  # the paper's 0.5B number, its own column
    assert table["prefill gain %"][0] == pytest.approx(100 * (results[0]["rows"][0]["speedup"] - 1))
    assert set(efficiency.figures(results)) == {"speedup", "energy", "memory"}


def test_labels_with_dots_and_tags_name_their_own_files(pair, tmp_path):
    """A label such as "0.5B" and a tag give each run its own JSON and MD, named for both."""
    for tag in ("a", "b"):
        assert bench_main(["model", pair[0], "--label", "0.5B (docs)", "--device", "cpu", "--prefill-batch", "2",
                           "--seq", "16", "--decode-batch", "1", "--prompt", "8", "--new-tokens", "3",
                           "--train-batch", "0", "--reps", "2", "--no-energy", "--no-static-decode",
                           "--no-graph-decode", "--no-token-check", "--out", str(tmp_path), "--tag", tag,
                           "--quiet"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 4 and all(n.startswith("model-0.5B__docs_-") for n in names)
    assert [n.rsplit("-", 1)[1] for n in names] == ["a.json", "a.md", "b.json", "b.md"]


def test_missing_checkpoint_names_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="train it first"):
        efficiency.run_scales({"x": {"sparse": "runs/nowhere/final"}}, tmp_path, **SMALL)


def test_paper_scale_of_row_labels():
    """Rows labelled by config name ("0p5b (5000 steps)") meet the paper's number for that scale."""
    assert efficiency.paper_scale("0p5b (5000 steps)") == "0.5B"
    assert efficiency.paper_scale("1p5b") == "1.5B" and efficiency.paper_scale("2B") == "2B"
    assert efficiency.paper_scale("small") == "small" and efficiency.paper_scale("tiny") == "tiny"


def test_compiled_graph_decode_rows(pair):
    """decode-compiled-graph rows: each step compiled before it is replayed (the eager backend here: the same
    tracing as inductor's, no code generation), both sides' tokens compared; training rows after them copy
    the model without its compiled steps."""
    cfg = {**SMALL, "train_batch": 1, "decode_batches": (2,), "decode_graph": False, "decode_compile": "eager"}
    res = run_model_bench(ModelBenchConfig(checkpoint=pair[0], **cfg), progress=False)  # one model, both paths
    assert [r["measure"] for r in res["rows"]] == ["prefill", "decode", "decode-compiled-graph", "training"], \
        res["decode_errors"]
    row = res["rows"][-2]
    assert row["compile_backend"] == "eager" and row["sparse"]["tokens_per_s"] > 0
    assert row["sparse"]["first_tokens_match_eager"] and row["dense"]["first_tokens_match_eager"]
    # one model on both paths; on CPU "auto" runs the TwELL reference, which gives the dense path's tokens
    assert row["tokens_same"] and row["first_diff"] == [None, None]
    assert "decode-compiled-graph, batch 2: the two sides' greedy tokens are identical" in markdown_report(res)
    table = efficiency.efficiency_table([res])
    assert table["decode CUDA graph step"][0] == "compiled"
    assert table["decode CUDA graph gain %"][0] == pytest.approx(100 * (row["speedup"] - 1))
    twin = run_model_bench(ModelBenchConfig(checkpoint=pair[0], dense_checkpoint=pair[1], **cfg), progress=False)
    assert "tokens_same" not in twin["rows"][-1]  # a dense twin is another model: its tokens are not compared


def test_compiled_static_greedy_gives_the_eager_tokens():
    m = _decoder()
    prompt = torch.randint(0, 97, (1, 9))
    with torch.inference_mode():
        eager, _ = static_greedy(m, prompt, 10, graph=False)
        compiled, _ = static_greedy(m, prompt, 10, compile_backend="eager")
    assert torch.equal(eager, compiled)


def test_static_greedy_cache_len():
    m = _decoder(1)
    prompt = torch.randint(0, 97, (1, 9))
    with torch.inference_mode():
        short, _ = static_greedy(m, prompt, 6, graph=False)
        long, _ = static_greedy(m, prompt, 6, graph=False, cache_len=40)  # a longer cache, the same tokens
        assert torch.equal(short, long)
        with pytest.raises(ValueError, match="cannot hold"):
            static_greedy(m, prompt, 6, cache_len=10)


def test_ffn_at_paper_sparsity_reads_the_committed_benchmarks():
    """Notebook 04's FFN-level table: the nnz29 rows of the three kernel benchmarks, as they recorded them."""
    files = {"inference": "reports/bench/ffn-NVIDIA-H100-80GB-HBM3-20261127T111641Z-s39-H100.json",
             "training": "reports/bench/ffn-NVIDIA-H200-20261129T030859Z.json",
             "decode": "reports/bench/decode-NVIDIA-H200-20261128T193313Z.json"}
    t = efficiency.ffn_at_paper_sparsity(files)
    assert t["measure"].tolist() == ["inference"] * 3 + ["training"] + ["decode"] * 4
    assert t[t["measure"] == "inference"]["M"].tolist() == [8192, 65536, 131072]
    train = json.loads((efficiency.repo_root() / files["training"]).read_text())
    want = [c["impls"]["twell-train-kernel"]["speedup"] for c in train["cases"] if c["case"]["sparsity"] == "nnz29"]
    assert t[t["measure"] == "training"]["sparse / dense"].tolist() == want
    assert set(t[t["measure"] == "decode"]["M"]) == {1, 4, 16, 32} and set(t["device"]) == {"NVIDIA H100 80GB HBM3",
                                                                                             "NVIDIA H200"}
    with pytest.raises(ValueError, match="unknown measure"):
        efficiency.ffn_at_paper_sparsity({"prefill": files["decode"]})
    with pytest.raises(ValueError, match="no decode result"):
        efficiency.ffn_at_paper_sparsity({"decode": files["decode"]}, case="nnz999")


def test_compiled_training_rows_say_what_the_compiler_did(pair):
    """training-compiled: each decoder layer compiled on both sides (inductor), compiled in the untimed steps; the
    notes count the graphs and the graph breaks, so a layer that fell back to eager would show."""
    cfg = {**SMALL, "prefill_batches": (), "decode_batches": (), "token_check": False, "train_compile": True}
    res = run_model_bench(ModelBenchConfig(checkpoint=pair[0], dense_checkpoint=pair[1], **cfg), progress=False)
    (row,) = res["rows"]
    assert row["measure"] == "training-compiled" and row["sparse"]["tokens_per_s"] > 0
    for side in ("dense", "sparse"):
        note = [n for n in row[side]["notes"] if n.startswith("compiled:")]
        assert note and note[0].endswith(", 0 graph breaks"), row[side]["notes"]
        assert int(note[0].split()[1]) >= 1
    assert "training-compiled: each decoder layer compiled" in markdown_report(res)


def test_record_holds_the_run_environment_and_marks_a_dirty_tree(pair, tmp_path, monkeypatch):
    from twell.bench import provenance as pv

    cfg = ModelBenchConfig(checkpoint=pair[0], **{**SMALL, "train_batch": 0, "decode_batches": (1,),
                                                  "token_check": False})
    state = {"repository": True, "dirty": False, "changed": [], "changed_count": 0, "diff_digest": None}
    monkeypatch.setattr(pv, "tree_state", lambda root=None: dict(state))
    clean = run_model_bench(cfg, progress=False)
    meta = clean["meta"]
    # "started" and the device's type, as the model JSONs and notebook 04 have them; the rest is run_meta's
    assert "started" in meta and "timestamp" not in meta and meta["device"] == "cpu"
    for key in ("host", "python", "torch", "cuda", "device_name", "argv", "command", "allow_dirty"):
        assert key in meta, key
    md = markdown_report(clean)
    assert pv.code_line(meta["code"]) in md and f"command: `{meta['command']}`" in md and "LOCAL CHANGES" not in md
    state.update(dirty=True, changed=[" M configs/0p5b.yaml"], changed_count=1, diff_digest="f" * 16)
    dirty = run_model_bench(cfg, progress=False, allow_dirty=True)
    jp, mp = write_outputs(dirty, tmp_path)
    saved = json.loads(jp.read_text())["meta"]
    assert saved["allow_dirty"] is True and saved["code"]["changed"] == [" M configs/0p5b.yaml"]
    assert "> LOCAL CHANGES (allowed by allow_dirty): 1 paths" in mp.read_text()
