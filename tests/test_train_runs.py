"""End-to-end training runs on CPU: outputs, errors, wall-clock stop, kill-and-resume, torchrun (gloo) vs one process,
and the sparsity the L1 recipe produces (tiny config, L1 2e-5 vs 0).

Runs use a fixture corpus: the smoke corpus (installed packages' metadata, not FineWeb-Edu), tokenised once per session.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from twell.data import DataConfig, build_smoke_corpus, prepare_data
from twell.model import load_pretrained
from twell.paths import repo_root
from twell.train import read_metrics, run

ENV = {**os.environ, "PYTHONPATH": str(repo_root() / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    return prepare_data(DataConfig(source="smoke", vocab_size=512, max_docs=150),
                        out_dir=tmp_path_factory.mktemp("data") / "smoke512", progress=False)


def _cfg(data, **train):
    t = {"steps": 12, "seq_len": 32, "global_batch": 8, "micro_batch": 4, "precision": "fp32", "device": "cpu",
         "eval_every": 6, "eval_tokens": 2048, "ckpt_every": 4, "export_dtype": "fp32", "progress": False}
    t.update(train)
    return {"name": "t", "model": {"vocab_size": 512, "hidden_size": 48, "intermediate_size": 96, "num_layers": 2,
                                   "num_heads": 2, "num_kv_heads": 2, "max_position_embeddings": 64},
            "data": {"source": str(data.dir)}, "train": t, "optim": {"lr": 3e-3, "warmup_steps": 3},
            "sparsity": {"l1_coef": 2e-5, "positions_every": 4}}


def _yaml(tmp_path, cfg, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return p


def _train_ce(metrics_path):
    return [(r["step"], r["ce"]) for r in read_metrics(metrics_path)["train"]]


@pytest.mark.slow
def test_cli_run_writes_metrics_summary_and_a_transformers_checkpoint(tmp_path, smoke_data):
    cfg = _yaml(tmp_path, _cfg(smoke_data))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "twell.train", "--config", str(cfg), "--out", str(out)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs["train"]] == list(range(1, 13))
    assert [r["step"] for r in recs["val"]] == [6, 12]
    assert {e["event"] for e in recs["event"]} >= {"start", "end"}
    tr = recs["train"][-1]
    assert len(tr["active_mean"]) == 2 and len(tr["dead_frac"]) == 2 and 0 < tr["active_frac"] < 1
    assert len(recs["positions"][-1]["active"]) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 12 and not summary["stopped_early"]
    assert "smoke corpus" in summary["data"]["label"] and summary["data"]["tokenizer"]["kind"] == "trained"
    assert summary["final"]["val_ce"] == recs["val"][-1]["val_ce"]
    # The export loads in plain transformers (ReLU-gated Llama) and in twell, with the same logits.
    plain = LlamaForCausalLM.from_pretrained(out / "final").eval()
    model, tok = load_pretrained(out / "final", ffn_path="dense")
    assert model.config.twell_tokenizer["kind"] == "trained" and tok is not None
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, model(input_ids=x).logits)
    # A second run into the same directory must be explicit.
    again = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_run_errors_are_clear(tmp_path, smoke_data):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(_cfg(smoke_data), data=str(tmp_path / "no-such-corpus.jsonl"), out=tmp_path / "a")
    bad = _cfg(smoke_data)
    bad["model"]["vocab_size"] = 300
    with pytest.raises(ValueError, match="vocab mismatch"):
        run(bad, out=tmp_path / "b")
    with pytest.raises(ValueError, match="divisible"):
        run(_cfg(smoke_data, micro_batch=3), out=tmp_path / "c")


def test_wall_clock_guard_saves_and_stops(tmp_path, smoke_data):
    res = run(_cfg(smoke_data, steps=100_000, max_wall_seconds=6.0, wall_reserve_s=0.0), out=tmp_path / "w")
    s = res.summary
    assert s["stopped_early"] and 0 < s["steps_done"] < 100_000 and "wall-clock" in s["stop_reason"]
    assert res.checkpoint_dir is not None and res.checkpoint_dir.name == f"step_{s['steps_done']:07d}"
    assert (res.hf_dir / "config.json").is_file()
    assert any(e["event"] == "stop" for e in read_metrics(res.metrics_path)["event"])


def test_reinit_dead_neurons_runs_and_logs(tmp_path, smoke_data):
    cfg = _cfg(smoke_data, steps=6)
    # A strong L1 at a high learning rate silences most of a layer within a few steps, so that there is
    # something to count; a neuron is dead after one whole silent step (a window of 1 token).
    cfg["sparsity"].update(reinit_dead=True, reinit_every=2, dead_window_tokens=1, l1_coef=1.0)
    cfg["optim"]["lr"] = 3e-2
    res = run(cfg, out=tmp_path / "r")
    recs = read_metrics(res.metrics_path)
    events = [e for e in recs["event"] if e["event"] == "reinit"]
    assert [e["step"] for e in events] == [2, 4, 6]
    # The step's train record, written before the re-draw, gives the dead fraction per layer: the event
    # must have re-drawn exactly those neurons.
    H = cfg["model"]["intermediate_size"]
    dead_frac = {r["step"]: r["dead_frac"] for r in recs["train"]}
    for e in events:
        assert e["per_layer"] == [round(f * H) for f in dead_frac[e["step"]]], e
        assert e["neurons"] == sum(e["per_layer"])
    assert sum(e["neurons"] for e in events) > 0, "no neuron died: the counts above prove nothing"
    # The re-draw itself is tested in tests/test_train.py::test_reinit_dead_gates_touches_only_dead_rows.


def test_resume_refuses_data_that_changed(tmp_path, smoke_data):
    """Data settings outside the fixed ones (max_docs) or the corpus files can change the prepared data (and the
    trained tokenizer); the checkpoint's data key must match the data loaded now."""
    docs = build_smoke_corpus(tmp_path / "smoke.jsonl").read_text().splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(docs[:120]) + "\n")
    cfg = _cfg(smoke_data, steps=3, ckpt_every=3)
    cfg["data"] = {"source": str(corpus), "vocab_size": 512, "max_docs": 100, "prepared_dir": str(tmp_path / "prep")}
    out = tmp_path / "r"
    run(cfg, out=out)
    longer = {**cfg, "train": {**cfg["train"], "steps": 5}}
    with pytest.raises(ValueError, match=r"prepared data changed.*data\.max_docs: checkpoint 100 vs now 80"):
        run({**longer, "data": {**cfg["data"], "max_docs": 80}}, out=out, resume=True)
    corpus.write_text("\n".join(docs[10:130]) + "\n")  # same settings, other documents
    with pytest.raises(ValueError, match=r"prepared data changed.*no data setting changed"):
        run(longer, out=out, resume=True)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")["train"]] == [1, 2, 3]


def test_resume_records_the_settings_that_changed(tmp_path, smoke_data):
    out = tmp_path / "r"
    run(_cfg(smoke_data, steps=3, ckpt_every=3), out=out)
    with pytest.warns(UserWarning, match=r"change the training from here on: train\.steps: 3 -> 5"):
        run(_cfg(smoke_data, steps=5, ckpt_every=3, progress=True), out=out, resume=True)
    (event,) = [e for e in read_metrics(out / "metrics.jsonl")["event"] if e["event"] == "resume"]
    assert event["changed"] == ["train.progress: False -> True", "train.steps: 3 -> 5"]



def test_resume_takes_the_optimizer_settings_of_the_config(tmp_path, smoke_data):
    """The checkpoint gives the optimizer's state; weight decay, betas and eps are the config's (the resume
    warning says they change), not the ones saved with the optimizer state."""
    from twell.train import load_config
    from twell.train.loop import Trainer

    out = tmp_path / "r"
    run(_cfg(smoke_data, steps=3, ckpt_every=3), out=out)
    cfg = _cfg(smoke_data, steps=5, ckpt_every=3)
    cfg["optim"].update(weight_decay=0.0, beta1=0.5, beta2=0.6, eps=1e-3)
    with pytest.warns(UserWarning, match="optim.weight_decay"):
        trainer = Trainer(load_config(cfg), out, resume=True)
    decay, no_decay = trainer.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.0, 0.0)
    assert all(tuple(g["betas"]) == (0.5, 0.6) and g["eps"] == 1e-3 for g in (decay, no_decay))
    state = trainer.optimizer.state[decay["params"][0]]
    assert int(state["step"]) == 3 and state["exp_avg"].abs().sum() > 0  # the state itself was restored
    trainer.metrics.close()


@pytest.mark.parametrize("key,value", [("intermediate_size", 128), ("num_layers", 3)])
def test_resume_with_another_model_shape_names_the_setting(tmp_path, smoke_data, key, value):
    out = tmp_path / "r"
    run(_cfg(smoke_data, steps=3, ckpt_every=3), out=out)
    cfg = _cfg(smoke_data, steps=5, ckpt_every=3)
    cfg["model"][key] = value
    with pytest.raises(ValueError, match=f"cannot resume.*model.{key}"):
        run(cfg, out=out, resume=True)


def test_evaluation_settings_fail_before_training(tmp_path, smoke_data):
    with pytest.raises(ValueError, match="eval_micro_batch must be a positive integer"):
        run(_cfg(smoke_data, eval_micro_batch=-1), out=tmp_path / "a")
    with pytest.raises(ValueError, match="lower train.eval_micro_batch"):
        run(_cfg(smoke_data, eval_micro_batch=100_000), out=tmp_path / "b")
    assert "train" not in read_metrics(tmp_path / "b" / "metrics.jsonl") if (tmp_path / "b" / "metrics.jsonl").exists() \
        else True  # no step ran
    with pytest.raises(ValueError, match="train.eval_tokens = 64 gives 2 validation blocks"):
        run(_cfg(smoke_data, eval_tokens=64), out=tmp_path / "c")


@pytest.mark.parametrize("steps,eval_every,eval_s,want_steps,want_wall", [
    (100_000, 1, 2.0, 4, 8.4), (5, 1, 2.0, 4, 8.4), (100_000, 3, 4.0, 6, 8.6)])
def test_wall_clock_guard_counts_the_next_evaluation(tmp_path, smoke_data, monkeypatch, steps, eval_every, eval_s,
                                                     want_steps, want_wall):
    """Steps of 0.1 s and evaluations of eval_s, on a clock the test drives, deadline 9 s (limit 10, reserve
    1): the guard must stop before the next step and an evaluation would end past the deadline (a run's
    last step evaluates, and so does a stop on a step that did not), which leaves the reserve to the final
    save and export. Counting steps only, the first case ran to 10.5 s and the third to 12.8 s."""
    import types

    from twell.train import loop

    clock = [1000.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(time=lambda: clock[0]))
    step, evaluate = loop.Trainer._train_step, loop.Trainer.evaluate

    def timed_step(self, i):
        clock[0] += 0.1
        return step(self, i)

    def timed_eval(self):
        clock[0] += eval_s
        return evaluate(self)

    monkeypatch.setattr(loop.Trainer, "_train_step", timed_step)
    monkeypatch.setattr(loop.Trainer, "evaluate", timed_eval)
    res = run(_cfg(smoke_data, steps=steps, max_wall_seconds=10.0, wall_reserve_s=1.0, eval_every=eval_every,
                   ckpt_every=100_000), out=tmp_path / "w")
    assert res.summary["stopped_early"] and res.summary["steps_done"] == want_steps
    assert res.summary["process_wall_seconds"] == pytest.approx(want_wall)  # <= 9 s: the reserve is left


def test_refused_resume_keeps_the_runs_config_yaml(tmp_path, smoke_data):
    out = tmp_path / "r"
    run(_cfg(smoke_data, steps=3, ckpt_every=3), out=out)
    before = (out / "config.yaml").read_text()
    with pytest.raises(ValueError, match="cannot resume.*train.data_seed"):
        run(_cfg(smoke_data, steps=5, ckpt_every=3, data_seed=7), out=out, resume=True)
    assert (out / "config.yaml").read_text() == before  # still the config the checkpoint was trained with


def test_resume_without_a_checkpoint_starts_the_metrics_afresh(tmp_path, smoke_data):
    out = tmp_path / "r"
    run(_cfg(smoke_data, steps=3), out=out)
    shutil.rmtree(out / "ckpt")  # as if killed before its first checkpoint
    res = run(_cfg(smoke_data, steps=4), out=out, resume=True)
    recs = read_metrics(res.metrics_path)
    assert [r["step"] for r in recs["train"]] == [1, 2, 3, 4]
    assert [e["event"] for e in recs["event"]] == ["resume-requested", "start", "end"]


def test_diverging_run_stops_at_the_first_non_finite_step(tmp_path, smoke_data, monkeypatch):
    """The weights turn non-finite just before step BAD, a step the test picks (when a run with a huge learning rate
    diverges depends on the installed torch/transformers/numpy); BAD is due for a checkpoint and an evaluation, so
    the guard must stop there before either runs."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from twell.train import loop

    BAD = 6
    step = loop.Trainer._train_step

    def poisoned_step(self, i):  # i: steps done so far, so this is step i + 1
        if i + 1 == BAD:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))
        return step(self, i)

    monkeypatch.setattr(loop.Trainer, "_train_step", poisoned_step)
    cfg = _cfg(smoke_data, steps=12, ckpt_every=2, eval_every=6, keep_checkpoints=1)
    out = tmp_path / "nan"
    with pytest.raises(RuntimeError, match=r"non-finite loss or gradient norm at step \d+") as err:
        run(cfg, out=out)
    bad = int(re.search(r"at step (\d+)", str(err.value)).group(1))
    assert bad == BAD
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs["train"]] == list(range(1, bad + 1))  # log_every 1: detected at once
    assert all(isinstance(r[k], float) and math.isfinite(r[k]) for r in recs["train"][:-1] for k in ("loss", "grad_norm"))
    assert any(not math.isfinite(recs["train"][-1][k]) for k in ("loss", "grad_norm"))  # read back as floats
    # The plots and the table take a diverged run: numbers on the axis, NaN in the table.
    from twell.train import plots

    fig = plots.plot_loss({"nan": out / "metrics.jsonl"})
    assert all(line.get_ydata().dtype.kind == "f" for ax in fig.axes for line in ax.lines)
    plots.plot_active({"nan": out / "metrics.jsonl"})
    table = plots.summary_table({"nan": out / "metrics.jsonl"}, {"nan": out / "summary.json"})
    assert table.loc[0, "steps"] == bad
    assert recs["event"][-1]["event"] == "stop" and f"step {bad}" in recs["event"][-1]["reason"]
    assert not recs.get("val")  # the bad step was due for the first evaluation; nothing was evaluated
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps_done"] == bad and f"step {bad}" in summary["stop_reason"]
    assert summary["paths"]["hf_checkpoint"] is None and not (out / "final").exists()
    # Nothing saved from the non-finite state: the last finite checkpoint is kept (keep_checkpoints 1).
    last = (bad - 1) // 2 * 2
    assert last == 4 and [p.name for p in (out / "ckpt").glob("step_*")] == [f"step_{last:07d}"]
    assert summary["paths"]["train_checkpoint"] == str(out / "ckpt" / f"step_{last:07d}")
    dcp_to_torch_save(out / "ckpt" / f"step_{last:07d}", tmp_path / "last.pt")
    weights = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    assert weights and all(torch.isfinite(v).all() for v in weights.values())



def test_summary_tail_counts_steps_not_records(tmp_path, smoke_data):
    # 40 steps logged every 2 (and step 1): 21 records, a tail of 2 records, steps 38 and 40, spans 3 steps
    res = run(_cfg(smoke_data, steps=40, log_every=2, eval_every=40, ckpt_every=40), out=tmp_path / "r")
    final = res.summary["final"]
    assert (final["tail_records"], final["tail_steps"]) == (2, 3)

@pytest.mark.slow
def test_kill_and_resume_reproduces_the_loss_curve(tmp_path, smoke_data):
    steps, every = 80, 20
    ref = run(_cfg(smoke_data, steps=steps, ckpt_every=every, eval_every=40), out=tmp_path / "ref")
    cfg = _yaml(tmp_path, _cfg(smoke_data, steps=steps, ckpt_every=every, eval_every=40))
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "twell.train", "--config", str(cfg), "--out", str(out)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed_at = None
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        latest = out / "ckpt" / "latest.json"
        if latest.is_file() and json.loads(latest.read_text())["step"] >= every and (out / "metrics.jsonl").is_file():
            text = (out / "metrics.jsonl").read_text()
            complete = text.splitlines()[:text.count("\n")]  # the run may be writing the last line right now
            logged = [json.loads(x)["step"] for x in complete if '"kind": "train"' in x]
            if logged and logged[-1] >= every + 5:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed_at = logged[-1]
                break
        time.sleep(0.005)
    assert killed_at is not None and proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert killed_at < steps
    res = run(cfg, out=out, resume=True)
    recs = read_metrics(res.metrics_path)
    assert any(e["event"] == "resume" for e in recs["event"])
    got, want = _train_ce(res.metrics_path), _train_ce(ref.metrics_path)
    assert [s for s, _ in got] == list(range(1, steps + 1))  # records past the checkpoint were dropped, then redone
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-7)
    assert [r["val_ce"] for r in recs["val"]] == pytest.approx([r["val_ce"] for r in read_metrics(ref.metrics_path)["val"]],
                                                               rel=1e-6)


@pytest.mark.slow
def test_torchrun_two_processes_match_one_process(tmp_path, smoke_data):
    cfg = _cfg(smoke_data, steps=8, eval_every=4, ckpt_every=100)
    single = run(cfg, out=tmp_path / "single")  # 1 process: 2 micro-batches of 4 per step
    cfg_ac = json.loads(json.dumps(cfg))
    cfg_ac["train"]["activation_checkpointing"] = True  # FSDP2 wraps the checkpointed layers
    path = _yaml(tmp_path, cfg_ac)
    out = tmp_path / "fsdp"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "twell.train", "--config", str(path), "--out", str(out)],
                          env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = read_metrics(single.metrics_path), read_metrics(out / "metrics.jsonl")
    assert "FSDP2" in b["event"][0]["describe"] and "2 ranks" in b["event"][0]["describe"]
    assert [r["ce"] for r in b["train"]] == pytest.approx([r["ce"] for r in a["train"]], rel=1e-4)
    assert [r["val_ce"] for r in b["val"]] == pytest.approx([r["val_ce"] for r in a["val"]], rel=1e-4)
    for ra, rb in zip(a["train"], b["train"]):
        assert rb["active_mean"] == pytest.approx(ra["active_mean"], rel=2e-3)
    # The FSDP run's export is a plain checkpoint with the single run's weights (up to reduction order).
    m1, _ = load_pretrained(single.hf_dir, ffn_path="dense")
    m2, _ = load_pretrained(out / "final", ffn_path="dense")
    for (k, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=k)


@pytest.mark.slow
def test_l1_makes_the_tiny_model_sparser_than_its_dense_twin(tmp_path, smoke_data):
    """The tiny config (1 layer here, 1000 steps of 256 tokens) with L1 2e-5 vs the same run with L1 0.

    Measured on the development machine (2 CPU cores): mean active neurons per token over the last 100
    steps 330 (L1 2e-5) vs 426 (L1 0) of 1024, i.e. about 22 % fewer; validation CE 3.416 vs 3.429.
    At this width and step budget the paper's coefficient acts slowly (see the report); the assertion
    asks for at least 10 % fewer active neurons in every layer and a validation CE within 3 %.
    """
    over = ["model.vocab_size=512", "model.num_layers=1", "train.steps=1000", "train.eval_every=100000",
            "train.ckpt_every=100000", "train.eval_tokens=4096", "train.progress=false"]
    res = {}
    for coef in (2e-5, 0.0):
        r = run("tiny", data=str(smoke_data.dir), out=tmp_path / f"c{coef}", overrides=over + [f"sparsity.l1_coef={coef}"])
        tail = read_metrics(r.metrics_path)["train"][-100:]
        res[coef] = ([sum(x["active_mean"][i] for x in tail) / len(tail) for i in range(1)], r.summary["final"]["val_ce"])
    (sparse, ce_s), (dense, ce_d) = res[2e-5], res[0.0]
    print(f"active per token, last 100 steps: L1 2e-5 {sparse} vs L1 0 {dense}; val CE {ce_s:.4f} vs {ce_d:.4f}")
    assert all(s < 0.9 * d for s, d in zip(sparse, dense)), (sparse, dense)
    assert ce_s < 1.03 * ce_d


@pytest.mark.gpu
@pytest.mark.parametrize("compile_layers", [False, True])
def test_bf16_cuda_run(tmp_path, smoke_data, compile_layers):
    """One GPU, bf16 autocast, fused AdamW (and torch.compile of each layer): finite, decreasing loss and a loadable export."""
    cfg = _cfg(smoke_data, steps=30, precision="bf16", device="cuda", export_dtype="bf16", eval_every=15,
               compile=compile_layers, micro_batch=8)
    res = run(cfg, out=tmp_path / "gpu")
    ce = [r["ce"] for r in read_metrics(res.metrics_path)["train"]]
    assert all(map(lambda v: v == v and v < 20, ce)) and ce[-1] < ce[0]
    assert res.summary["device"] != "cpu"
    plain = LlamaForCausalLM.from_pretrained(res.hf_dir)
    assert plain.dtype == torch.bfloat16


def test_the_calibration_event_and_the_records_after_it_survive_a_resume(tmp_path, smoke_data, monkeypatch):
    """The timed threshold's ``ffn-calibration`` event is written after a resume has rewritten metrics.jsonl
    up to its checkpoint: written before, it opened the file that the rewrite replaced, and every later record
    went to the replaced file. (CPU: the timing itself is stood in for; on a GPU it runs.)"""
    from twell.train import loop
    from twell.train.calibration import Calibration

    def fake(self, model):
        self.calibration = Calibration(rows=128, D=48, H=96, compiled_dense=False, impl="kernel",
                                       points=[{"nnz": 2, "active": 2 / 96, "dense_ms": 1.0, "sparse_ms": 0.5,
                                                "speedup": 2.0}], max_active=2 / 96)
        return None, "a stand-in for the timed threshold"

    monkeypatch.setattr(loop.Trainer, "_sparse_training", fake)
    out = tmp_path / "run"
    run(_cfg(smoke_data, steps=4, ckpt_every=2, eval_every=4), out=out)
    run(_cfg(smoke_data, steps=8, ckpt_every=2, eval_every=4), out=out, resume=True)
    m = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in m["train"]] == list(range(1, 9))
    assert [e["step"] for e in m["event"] if e["event"] == "ffn-calibration"] == [0, 4]
