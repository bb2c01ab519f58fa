"""A short training run on the sparse training kernels against the same run on the dense path (GPU)."""
from __future__ import annotations

import pytest
import torch

from twell.data import DataConfig, prepare_data
from twell.train import run
from twell.train.metrics import read_metrics

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return prepare_data(DataConfig(source="smoke", vocab_size=512, max_docs=150),
                        out_dir=tmp_path_factory.mktemp("data") / "smoke512", progress=False)


def _cfg(data, sparse: str, steps: int = 200):
    return {"name": f"run-{sparse}",
            "model": {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 1024, "num_layers": 2,
                      "num_heads": 4, "num_kv_heads": 4, "max_position_embeddings": 128},
            "data": {"source": str(data.dir)},
            "train": {"steps": steps, "seq_len": 64, "global_batch": 16, "micro_batch": 8, "precision": "bf16",
                      "device": "cuda", "eval_every": steps, "eval_tokens": 2048, "ckpt_every": steps,
                      "export_dtype": None, "progress": False, "sparse_kernels": sparse, "sparse_max_active": 1.0,
                      "sparse_min_tokens": 0, "compile": False},
            "optim": {"lr": 3e-3, "warmup_steps": 20},
            "sparsity": {"l1_coef": 3e-3, "positions_every": 50}}


def test_sparse_kernels_train_like_dense(tmp_path, data):
    res = {}
    for mode in ("always", "never"):
        out = tmp_path / mode
        run(_cfg(data, mode), out=out)
        m = read_metrics(out / "metrics.jsonl")
        res[mode] = [(r["ce"], r["active_frac"]) for r in m["train"]]
        start = next(r for r in m["event"] if r["event"] == "start")
        assert ("SparseTraining(impl='kernel'" in start["describe"]) == (mode == "always")
    sparse, dense = res["always"], res["never"]
    assert len(sparse) == len(dense) == 200
    # the first steps agree to bf16 rounding
    for (cs, _), (cd, _) in zip(sparse[:3], dense[:3]):
        assert abs(cs - cd) <= 2e-3 * cd
    # then within noise: the last 50 steps' mean CE within 2%, and sparsity set in on both
    tail = lambda rs, i: sum(r[i] for r in rs[-50:]) / 50  # noqa: E731
    assert abs(tail(sparse, 0) - tail(dense, 0)) <= 0.02 * tail(dense, 0)
    assert tail(sparse, 1) < 0.2 and tail(dense, 1) < 0.2


def test_dead_neuron_reinit_with_the_kernels(tmp_path, data):
    """Dead-neuron re-initialisation in a run on the kernels: neurons die and are re-initialised, and the
    run trains as well as the same run on the dense path. (That the kernels see the new rows at once is
    tested on one batch in test_sparse_training.py: across steps the batch changes, and the activity's
    step-to-step noise hides a few dozen revived neurons.)"""
    res = {}
    for mode in ("always", "never"):
        cfg = _cfg(data, mode)
        cfg["sparsity"].update(reinit_dead=True, reinit_every=50)
        out = tmp_path / f"reinit-{mode}"
        run(cfg, out=out)
        m = read_metrics(out / "metrics.jsonl")
        active = {r["step"]: sum(r["active_mean"]) for r in m["train"]}
        revived = [(e["step"], e["neurons"]) for e in m["event"] if e["event"] == "reinit"]
        rise = sum(active[s + 1] - active[s] for s, n in revived if n > 0 and s + 1 in active)
        res[mode] = (sum(n for s, n in revived if s + 1 in active), rise,
                     sum(r["ce"] for r in m["train"][-50:]) / 50)
    print("revived neurons, rise of active per token at the next step, tail CE:", res)
    for mode, (n, _, _) in res.items():
        assert n >= 10, (mode, n)  # neurons died and were re-initialised
    assert abs(res["always"][2] - res["never"][2]) <= 0.02 * res["never"][2]


def test_compiled_layers_have_no_graph_break(tmp_path, data):
    """torch.compile of each decoder layer on the kernels: no graph break. (With activation
    checkpointing too, dense and sparse alike break once per layer on the statistics the FFN records
    inside the checkpoint: docs/training_kernels.md.)"""
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = _cfg(data, "always", steps=4)
    cfg["train"].update(compile=True)
    run(cfg, out=tmp_path / "compiled")
    m = read_metrics(tmp_path / "compiled" / "metrics.jsonl")
    assert len(m["train"]) == 4 and all(r["ce"] == r["ce"] for r in m["train"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_defaults_time_the_threshold_and_route_by_it(tmp_path, data):
    """train.sparse_max_active auto (the default) times the op against dense at the run's rows per forward
    before the first step: the run logs the timings, and its backend routes by the threshold they give."""
    cfg = _cfg(data, "auto", steps=3)
    for k in ("sparse_max_active", "compile"):
        del cfg["train"][k]
    cfg["train"]["sparse_min_tokens"] = 512  # the run's forwards: 8 x 64 rows
    out = tmp_path / "timed"
    run(cfg, out=out)
    m = read_metrics(out / "metrics.jsonl")
    cal = next(e for e in m["event"] if e["event"] == "ffn-calibration")
    assert cal["rows"] == 512 and cal["compiled_dense"] is True and cal["points"]
    assert all(p["speedup"] > 1 for p in cal["points"] if p["active"] <= cal["max_active"])
    start = next(r for r in m["event"] if r["event"] == "start")
    assert f"max_active={cal['max_active']}" in start["describe"], start["describe"]


def test_timed_routes_with_hot_neurons(tmp_path, data):
    """train.sparse_routes timed: every sparse_retime_every steps each layer's routes are timed on its own input;
    the run logs the records and routes by them (with hot sets where the split was fastest)."""
    cfg = _cfg(data, "auto", steps=4)
    cfg["train"].update(sparse_routes="timed", sparse_hot=0.02, sparse_retime_every=2, sparse_min_tokens=512)
    out = tmp_path / "timed-routes"
    run(cfg, out=out)
    m = read_metrics(out / "metrics.jsonl")
    timed = [e for e in m["event"] if e["event"] == "ffn-timed-routes"]
    assert [e["step"] for e in timed] == [2, 4]
    for e in timed:
        assert len(e["layers"]) == 2
        for rec in e["layers"]:
            assert rec["route"] in ("dense", "sparse", "hot") and rec["rows"] == 512
            best = min(("sparse", "hot"), key=lambda k: rec[f"{k}_ms"] if rec[f"{k}_ms"] is not None else 1e9)
            assert rec["route"] == (best if rec["dense_ms"] > rec[f"{best}_ms"] else "dense")
    # the first route event after the timing: its routes, hot sets, and the paths the next step ran
    after = next(e for e in m["event"] if e["event"] == "ffn-routes" and e["step"] > 2)
    layers = timed[0]["layers"]
    assert after["routes"] == ["dense" if r["route"] == "dense" else "sparse" for r in layers]
    assert after.get("hot_neurons", [0, 0]) == [r["hot_neurons"] if r["route"] == "hot" else 0 for r in layers]
    assert after["ran"] == ["dense" if r["route"] == "dense" else "train-kernel" for r in layers]
