"""``python -m twell.bench activity`` (twell.bench.activity.checkpoint_activity) on CPU: per-layer and
per-position activity of a checkpoint on token blocks, checked against counts made independently from
each layer's input and gate weights."""
from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from twell.bench.__main__ import main as bench_main
from twell.bench.activity import checkpoint_activity, model_activity_profile, position_bins
from twell.model import ModelConfig, build_model, load_pretrained, save_pretrained, sparse_ffns

VOCAB = 97


def _checkpoint(path, seed, layers=2, width=48):
    torch.manual_seed(seed)
    mc = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=width, num_layers=layers, num_heads=2,
                     num_kv_heads=2, max_position_embeddings=64)
    model = build_model(mc)
    with torch.no_grad():  # heavy-tailed gate rows: some neurons fire often, some almost never
        for f in sparse_ffns(model):
            w = f.gate_proj.weight
            w.mul_(torch.rand(w.shape[0], 1) ** 3 * 4)
            w[: w.shape[0] // 4] -= 0.2
    save_pretrained(model, None, path, dtype=torch.bfloat16)
    return str(path)


def _reference(checkpoint, ids: torch.Tensor) -> dict:
    """Per layer [N, T] active counts from relu(x W_gate^T) of the captured FFN inputs, and the mean CE."""
    model, _ = load_pretrained(checkpoint, ffn_path="dense", device="cpu", dtype=torch.bfloat16, load_tokenizer=False)
    ffns = sparse_ffns(model)
    counts = {i: [] for i in range(len(ffns))}

    def hook(i):
        def pre(mod, args):
            counts[i].append((F.relu(F.linear(args[0], mod.gate_proj.weight)) > 0).sum(-1))
        return pre

    handles = [f.register_forward_pre_hook(hook(i)) for i, f in enumerate(ffns)]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    for h in handles:
        h.remove()
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).item()
    return {"counts": [torch.cat(counts[i]).double() for i in range(len(ffns))], "ce": ce,
            "H": ffns[0].intermediate_size}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("act") / "final", random.randint(0, 999))


@pytest.mark.parametrize("seq,n_extra,batch,bins", [(13, 7, 2, 4), (16, 0, 8, 32), (5, 4, 3, 2)])
def test_profile_matches_independent_counts(ckpt, tmp_path, seq, n_extra, batch, bins):
    n_seq = random.randint(3, 6)
    ids = np.random.randint(0, VOCAB, size=n_seq * seq + n_extra)  # a tail shorter than a sequence is left out
    np.save(tmp_path / "ids.npy", ids)
    res = checkpoint_activity(ckpt, tmp_path / "ids.npy", seq=seq, batch=batch, bins=bins)
    ref = _reference(ckpt, torch.from_numpy(ids[: n_seq * seq]).view(n_seq, seq))
    H = ref["H"]
    assert (res["sequences"], res["seq"], res["tokens"], res["intermediate_size"]) == (n_seq, seq, n_seq * seq, H)
    assert res["ce"] == pytest.approx(ref["ce"], rel=1e-4)
    for layer, c in enumerate(ref["counts"]):
        assert res["active_mean_per_layer"][layer] == pytest.approx(c.mean().item())
        assert res["active_frac_per_layer"][layer] == pytest.approx(c.mean().item() / H)
        assert res["active_per_position"][layer] == pytest.approx(c.mean(0).tolist())
        flat = c.flatten().sort().values
        for p in (0.5, 0.9, 0.99):  # the smallest count v with at least a fraction p of the tokens at or below it
            k = next(i for i in range(len(flat)) if Fraction(i + 1, len(flat)) >= Fraction(str(p)))
            assert res["active_quantiles_per_layer"][f"p{round(100 * p)}"][layer] == int(flat[k])
        assert res["active_quantiles_per_layer"]["max"][layer] == int(flat[-1])
        edges = res["positions"]["edges"]
        assert edges == position_bins(seq, bins) and edges[0] == 0 and edges[-1] == seq
        assert res["positions"]["active"][layer] == pytest.approx([c[:, a:b].mean().item()
                                                                   for a, b in zip(edges[:-1], edges[1:])])
    assert res["active_frac_mean"] == pytest.approx(np.mean(res["active_frac_per_layer"]))
    assert res["data"]["tokens"].endswith("ids.npy") and res["checkpoint"] == ckpt


def test_dead_fraction_counts_neurons_silent_on_every_token(tmp_path):
    path = tmp_path / "final"
    _checkpoint(path, 1)
    model, _ = load_pretrained(str(path), ffn_path="dense", device="cpu", dtype=torch.bfloat16, load_tokenizer=False)
    with torch.no_grad():  # rows of zeros never fire: relu(0) = 0
        w = sparse_ffns(model)[1].gate_proj.weight
        w[:12] = 0
    ids = torch.randint(0, VOCAB, (3, 10))
    res = model_activity_profile(model, ids, batch=2)
    assert res["dead_frac_per_layer"][1] >= 12 / 48
    assert all(0 <= d < 1 for d in res["dead_frac_per_layer"])
    assert sparse_ffns(model)[0].track is False  # tracking is switched off again


def test_cli_writes_both_models_and_prints_the_table(ckpt, tmp_path, capsys):
    dense = _checkpoint(tmp_path / "dense" / "final", 5)
    np.save(tmp_path / "ids.npy", np.random.randint(0, VOCAB, size=40))
    out = tmp_path / "a.json"
    assert bench_main(["activity", ckpt, "--dense-checkpoint", dense, "--tokens", str(tmp_path / "ids.npy"),
                       "--seq", "8", "--device", "cpu", "--out", str(out), "--bins", "3"]) == 0
    res = json.loads(out.read_text())
    assert set(res["models"]) == {"sparse", "dense"} and res["label"] == Path(ckpt).parent.name
    assert res["models"]["sparse"]["ce"] != res["models"]["dense"]["ce"]
    assert len(res["models"]["dense"]["positions"]["active"][0]) == 3
    text = capsys.readouterr().out
    assert "| layer |" in text and "CE" in text and str(out) in text


@pytest.mark.parametrize("kwargs,match", [
    ({"seq": 65}, "seq must be in"),
    ({"seq": 1}, "seq must be in"),
    ({"seq": 16, "max_tokens": 15}, "no whole sequence"),
])
def test_bad_settings_raise(ckpt, tmp_path, kwargs, match):
    np.save(tmp_path / "ids.npy", np.random.randint(0, VOCAB, size=100))
    with pytest.raises(ValueError, match=match):
        checkpoint_activity(ckpt, tmp_path / "ids.npy", **kwargs)


def test_tokens_of_another_vocabulary_raise(ckpt, tmp_path):
    np.save(tmp_path / "ids.npy", np.full(64, VOCAB + 3))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        checkpoint_activity(ckpt, tmp_path / "ids.npy", seq=8)
    with pytest.raises(ValueError, match=r"ids must be \[sequences"):
        model_activity_profile(load_pretrained(ckpt, device="cpu", load_tokenizer=False)[0], torch.zeros(4, 1).long())


def test_activity_table_figure_and_findings():
    """Notebook 02's view of an activity result: one row per model and layer, a figure, two sentences."""
    import matplotlib

    matplotlib.use("Agg")
    from twell.train import plots, study

    def model(per_layer, first):
        L, bins = len(per_layer), 4
        return {"tokens": 64, "active_mean_per_layer": [10 * a for a in per_layer], "active_frac_per_layer": per_layer,
                "active_frac_mean": sum(per_layer) / L, "dead_frac_per_layer": [0.1] * L,
                "active_quantiles_per_layer": {"p50": [1] * L, "p99": [5] * L, "max": [9] * L},
                "positions": {"edges": [0, 4, 8, 12, 16], "active": [[first * a] + [a] * (bins - 1) for a in per_layer]}}

    res = {"label": "t", "models": {"sparse": model([0.03, 0.001, 0.02], 4.0), "dense": model([0.1, 0.05, 0.2], 1.5)}}
    t = plots.activity_table(res)
    assert len(t) == 6 and list(t["model"].unique()) == ["sparse", "dense"]
    assert t.loc[t["model"] == "sparse", "first bin / later bins"].tolist() == pytest.approx([4.0] * 3)
    plots.plot_checkpoint_activity(res, title="t")
    text = study.activity_findings(res)
    assert "sparse: least active layer 1 (0.10% of H), most active layer 0 (3.00%)" in text
    assert "4.0-4.0x" in text and "dense: least active layer 1" in text
    with pytest.raises(ValueError, match="twell.bench activity"):
        plots.activity_table({"label": "x"})
    # several results (scales of different depth) by relative depth
    deep = {"label": "d", "models": {"sparse": model([0.08, 0.002, 0.001, 0.004, 0.14], 2.0)}}
    fig, depth = plots.activity_by_depth({"3 layers": res, "5 layers": deep})
    assert depth[["result", "model", "layers"]].values.tolist() == [["3 layers", "sparse", 3], ["3 layers", "dense", 3],
                                                                   ["5 layers", "sparse", 5]]
    row = depth.iloc[2]
    assert (row["first layer %"], row["last layer %"], row["least active layer"]) == pytest.approx((8.0, 14.0, 2))
    assert len(fig.axes[0].lines) == 3
    with pytest.raises(ValueError, match="at least one"):
        plots.activity_by_depth({})
