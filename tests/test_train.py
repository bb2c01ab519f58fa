"""twell.train pieces: configs, schedules, the L1 recipe, the sparsity tracker, re-initialisation, AC."""
import random
import re
import warnings

import numpy as np
import pytest
import torch

from twell.model import ModelConfig, build_model, set_tracking, sparse_ffns
from twell.paths import repo_root
from twell.train import (RunConfig, SparsityTracker, l1_coef_at, l1_penalty, load_config, lr_at, parse_overrides,
                         reinit_dead_gates, sparse_lm_loss)
from twell.train.config import config_path
from twell.train.parallel import apply_activation_checkpointing

CONFIGS = sorted(p.stem for p in (repo_root() / "configs").glob("*.yaml"))
PAPER = {"0p5b": (8, 10_000), "1b": (18, 20_000), "1p5b": (28, 30_000), "2b": (38, 40_000)}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_loads_and_validates(name):
    cfg = load_config(name)
    cfg.validate(world_size=1)
    assert cfg.name == name
    assert cfg.model.max_position_embeddings >= cfg.train.seq_len


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_configs_have_the_paper_hyperparameters(name):
    layers, steps = PAPER[name]
    c = load_config(name)
    m, t, o = c.model, c.train, c.optim
    assert (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.num_layers) == (2048, 5632, 32, 32, layers)
    assert (m.vocab_size, m.rope_theta, m.ffn, m.tie_embeddings) == (49152, 1e5, "relu_gated", True)
    assert (t.seq_len, t.global_batch, t.steps, t.precision) == (2048, 512, steps, "bf16")
    assert c.tokens_per_step == 1_048_576
    assert (o.lr, o.weight_decay, o.beta1, o.beta2, o.warmup_steps, o.grad_clip) == (1e-3, 0.1, 0.9, 0.95, 600, 1.0)
    assert c.sparsity.l1_coef == 2e-5
    assert c.data.source == "fineweb-edu" and c.data.hub_tokenizer == "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.endswith("_dense")])
def test_dense_baselines_differ_only_in_l1(name):
    dense, sparse = load_config(name).to_dict(), load_config(name[: -len("_dense")]).to_dict()
    assert dense["sparsity"]["l1_coef"] == 0.0 and sparse["sparsity"]["l1_coef"] > 0
    for d in (dense, sparse):
        d["sparsity"].pop("l1_coef")
        d.pop("name")
        d.pop("description")
    assert dense == sparse


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\] in train"):
        load_config("tiny", ["train.stepz=3"])
    with pytest.raises(ValueError, match="unknown top-level"):
        load_config({"base": "tiny", "trian": {}})
    with pytest.raises(ValueError, match=r"global_batch \(16\) must be divisible by train.micro_batch \(3\)"):
        load_config("tiny", ["train.global_batch=16", "train.micro_batch=3"]).validate()
    with pytest.raises(ValueError, match=r"x world size \(3\)"):
        load_config("tiny", ["train.global_batch=16", "train.micro_batch=4"]).validate(world_size=3)
    with pytest.raises(ValueError, match="exceeds model.max_position_embeddings"):
        load_config("tiny", ["train.seq_len=100000"]).validate()
    with pytest.raises(ValueError, match="needs a ReLU FFN"):
        load_config("tiny", ["model.ffn=silu_gated"]).validate()
    load_config("tiny", ["sparsity.reinit_dead=true", "train.micro_batch=2"]).validate(world_size=2)  # FSDP2 too
    with pytest.raises(ValueError, match="must be an integer"):
        load_config("tiny", ["train.steps=many"])
    with pytest.raises(ValueError, match="bad override"):
        parse_overrides(["train.steps"])
    with pytest.raises(FileNotFoundError, match="no config named"):
        config_path("no-such-config")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="inheritance loop"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize("over", ["optim.lr=.nan", "optim.grad_clip=.nan", "optim.weight_decay=.inf",
                                  "sparsity.l1_coef=.nan", "sparsity.l1_coef=.inf", "train.max_wall_seconds=.nan",
                                  "model.rope_theta=.inf"])
def test_config_rejects_non_finite_numbers(over):
    # NaN compares False with every bound, so range checks alone let it through.
    key = over.split("=")[0]
    with pytest.raises(ValueError, match=rf"{re.escape(key)} must be a finite number"):
        load_config("tiny", [over]).validate()
    with pytest.raises(ValueError, match=rf"{re.escape(key)} must be a finite number"):
        load_config("tiny", ["model.ffn=silu_gated", "sparsity.l1_coef=0", over]).validate()


def test_config_warns_when_warmup_outlasts_the_run():
    with pytest.warns(UserWarning, match=r"optim.warmup_steps \(50000\) exceeds train.steps \(2000\)"):
        load_config("tiny", ["optim.warmup_steps=50000"]).validate()
    with pytest.warns(UserWarning, match=r"sparsity.l1_warmup_steps \(2001\) exceeds train.steps \(2000\)"):
        load_config("tiny", ["sparsity.l1_warmup_steps=2001"]).validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("tiny", ["optim.warmup_steps=2000", "sparsity.l1_warmup_steps=2000"]).validate()  # the whole run


def test_overrides_parse_numbers_yaml_reads_as_text():
    c = load_config("tiny", ["sparsity.l1_coef=3e-5", "train.steps=1e3", "optim.lr=2E-3", "train.max_wall_seconds=null"])
    assert c.sparsity.l1_coef == 3e-5 and c.train.steps == 1000 and c.optim.lr == 2e-3
    assert c.train.max_wall_seconds is None
    assert RunConfig.from_dict(c.to_dict()).to_dict() == c.to_dict()


def test_lr_schedule():
    kw = dict(lr=1e-3, warmup_steps=600, total_steps=10_000, min_lr_ratio=0.0)
    assert lr_at(0, **kw) == pytest.approx(1e-3 / 600)
    assert lr_at(599, **kw) == pytest.approx(1e-3)
    assert lr_at(600, **kw) == pytest.approx(1e-3)
    assert lr_at(600 + 9400 // 2, **kw) == pytest.approx(5e-4)
    assert lr_at(10_000, **kw) == pytest.approx(0.0, abs=1e-12)
    vals = [lr_at(s, **kw) for s in range(600, 10_000, 97)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert lr_at(10_000, **{**kw, "min_lr_ratio": 0.1}) == pytest.approx(1e-4)
    assert l1_coef_at(0, coef=2e-5, warmup_steps=0) == 2e-5
    assert l1_coef_at(49, coef=2e-5, warmup_steps=100) == pytest.approx(1e-5)
    assert l1_coef_at(500, coef=2e-5, warmup_steps=100) == 2e-5


def _tiny_model(ffn="relu_gated", layers=None):
    mc = ModelConfig(vocab_size=97, hidden_size=24, intermediate_size=random.randint(20, 70),
                     num_layers=layers or random.randint(1, 3), num_heads=2, num_kv_heads=2, ffn=ffn,
                     max_position_embeddings=64)
    model = build_model(mc)
    set_tracking(model, True)
    return mc, model


@pytest.mark.parametrize("ffn", ["relu_gated", "relu"])
def test_l1_penalty_is_the_papers_normalisation(ffn):
    mc, model = _tiny_model(ffn)
    x = torch.randint(0, mc.vocab_size, (3, random.randint(4, 11)))
    hs = []
    hooks = [f.register_forward_hook(lambda mod, inp, out: hs.append(mod.hidden(inp[0])[1])) for f in sparse_ffns(model)]
    logits = model(input_ids=x).logits
    for h in hooks:
        h.remove()
    want = torch.stack([h.abs().sum(-1).mean() for h in hs]).mean()  # sum hidden, mean tokens, mean layers
    torch.testing.assert_close(l1_penalty(sparse_ffns(model)), want)
    parts = sparse_lm_loss(logits, x, sparse_ffns(model), coef=2e-5)
    torch.testing.assert_close(parts.loss, parts.ce + 2e-5 * want.detach())
    parts.loss.backward()
    w = sparse_ffns(model)[0].up_proj.weight
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_l1_gradient_pushes_hidden_activations_down():
    """With CE switched off (coef only), an optimizer step on the L1 term lowers the L1 term."""
    mc, model = _tiny_model()
    x = torch.randint(0, mc.vocab_size, (4, 9))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model(input_ids=x)
    before = l1_penalty(sparse_ffns(model))
    before.backward()
    opt.step()
    with torch.no_grad():
        model(input_ids=x)
    assert l1_penalty(sparse_ffns(model)).item() < before.item()


def test_l1_penalty_errors():
    with pytest.raises(ValueError, match="no SparseFFN"):
        l1_penalty([])
    mc, model = _tiny_model()
    set_tracking(model, False)
    with pytest.raises(RuntimeError, match="set_tracking"):
        l1_penalty(sparse_ffns(model))
    with pytest.raises(ValueError, match="matching targets"):
        sparse_lm_loss(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), sparse_ffns(model), 0.0)


class _FakeStats:
    def __init__(self, apt, active):
        self.active_per_token, self.neuron_active = apt, active


class _FakeFFN:
    def __init__(self, apt, active):
        self.stats = _FakeStats(apt, active)


def test_tracker_counts_active_dead_and_positions():
    L, H, T, B = 3, 10, 8, 4
    tr = SparsityTracker(L, H, T, window_tokens=2 * B * T, device="cpu", position_bins=4)
    apt = torch.randint(0, H + 1, (L, B, T), dtype=torch.int32)
    active = torch.zeros(L, H, dtype=torch.bool)
    active[:, :6] = True  # neurons 6..9 never fire
    tr.observe([_FakeFFN(apt[l], active[l]) for l in range(L)])
    out = tr.end_step()
    torch.testing.assert_close(torch.tensor(out["active_mean"], dtype=torch.float64), apt.double().mean((1, 2)))
    assert out["active_max"] == apt.amax((1, 2)).double().tolist()
    assert out["dead_frac"] == [0.0] * L  # silent for one step = B*T tokens < window
    tr.observe([_FakeFFN(apt[l], active[l]) for l in range(L)])
    out = tr.end_step()
    assert out["dead_frac"] == [0.4] * L  # now silent for 2*B*T tokens
    active[:, 7] = True
    tr.observe([_FakeFFN(apt[l], active[l]) for l in range(L)])
    assert tr.end_step()["dead_frac"] == [pytest.approx(0.3)] * L  # firing resets the counter
    pos = tr.positions()
    assert pos["edges"] == [0, 2, 4, 6, 8] and pos["sequences"] == 3 * B
    torch.testing.assert_close(torch.tensor(pos["active"], dtype=torch.float64),
                               apt.double().mean(1).view(L, 4, 2).mean(-1))
    assert tr.positions() == {}  # reset after reading
    state = tr.state_dict()
    tr2 = SparsityTracker(L, H, T, window_tokens=2 * B * T, device="cpu")
    tr2.load_state_dict(state)
    assert torch.equal(tr2.dead_mask(), tr.dead_mask())
    with pytest.raises(RuntimeError, match="without any observe"):
        tr.end_step()
    with pytest.raises(ValueError, match="expected 3 SparseFFN"):
        tr.observe([])


def test_reinit_dead_gates_touches_only_dead_rows():
    mc, model = _tiny_model(layers=2)
    ffns = sparse_ffns(model)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, mc.vocab_size, (2, 7))
    model(input_ids=x).logits.sum().backward()
    opt.step()
    dead = torch.zeros(2, mc.intermediate_size, dtype=torch.bool)
    dead[1, [0, 3]] = True
    before = [f.gate_proj.weight.detach().clone() for f in ffns]
    n = reinit_dead_gates(ffns, dead, opt, std=0.02, generator=torch.Generator().manual_seed(0))
    assert n == 2
    assert torch.equal(ffns[0].gate_proj.weight, before[0])
    changed = (ffns[1].gate_proj.weight != before[1]).any(1)
    assert changed.tolist() == dead[1].tolist()
    assert (opt.state[ffns[1].gate_proj.weight]["exp_avg"][[0, 3]] == 0).all()


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    mc, model = _tiny_model(layers=2)
    model_ac = build_model(mc)
    model_ac.load_state_dict(model.state_dict())
    set_tracking(model_ac, True)
    apply_activation_checkpointing(model_ac)
    model.train()
    model_ac.train()
    x = torch.randint(0, mc.vocab_size, (2, 9))
    losses = []
    for m in (model, model_ac):
        parts = sparse_lm_loss(m(input_ids=x, use_cache=False).logits, x, sparse_ffns(m), coef=1e-2)
        parts.loss.backward()
        losses.append(parts.loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert set(model_ac.state_dict()) == set(model.state_dict())  # wrapper leaves the keys alone
    for (n, p), (_, q) in zip(model.named_parameters(), model_ac.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_publish_run_files_copies_outside_runs_only(tmp_path):
    """Notebook 02 copies runs trained elsewhere into reports/runs/, but not runs already kept there."""
    from twell.train import study

    reports = tmp_path / "reports"
    inside = reports / "runs" / "small"
    outside = tmp_path / "runs" / "tiny"
    for d in (inside, outside):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
        (d / "summary.json").write_text("{}")
    runs = {"small (L1 2e-5)": (inside / "metrics.jsonl", inside / "summary.json"),
            "tiny": (outside / "metrics.jsonl", None)}
    written = study.publish_run_files(runs, reports)
    assert written == [reports / "runs" / "02_tiny" / "metrics.jsonl"]
    assert sorted(p.name for p in (reports / "runs").iterdir()) == ["02_tiny", "small"]


def test_training_plots_centre_their_moving_mean_and_name_its_span():
    """Records logged every 10 steps: a 20-record mean spans 200 steps (the label says so), and a drop
    at step 1000 is drawn at step ~1000, not one window late."""
    import matplotlib

    matplotlib.use("Agg")
    from twell.train import plots

    steps = list(range(10, 2001, 10))
    recs = {"train": [{"step": s, "ce": 5.0 if s < 1000 else 4.0, "active_mean": [50.0 if s < 1000 else 10.0],
                       "dead_frac": [0.0]} for s in steps], "val": []}
    fig = plots.plot_loss({"run": recs}, smooth=20)
    assert fig.axes[0].get_ylabel() == "train cross-entropy\n(moving mean, 20 records = 200 steps)"
    x, y = fig.axes[0].get_lines()[0].get_data()
    assert abs(float(np.interp(4.5, y[::-1], x[::-1])) - 1000) <= 10  # the mean crosses halfway at the drop
    fig = plots.plot_active({"run": recs}, smooth=20)
    x, y = fig.axes[0].get_lines()[0].get_data()
    assert abs(float(np.interp(30.0, y[::-1], x[::-1])) - 1000) <= 10
    assert "20 records = 200 steps" in fig.axes[0].get_ylabel()


def test_read_metrics_skips_a_half_written_last_line(tmp_path):
    """A run that is still writing (or was killed mid-line) leaves a last line without its newline:
    the records before it are read, with a warning. A bad line elsewhere still raises, by line."""
    from twell.train import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "ce": 5.0}\n{"kind": "train", "step": 2, "ce": 4.9}\n{"kind": "tr')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: incomplete last line"):
        assert [r["step"] for r in read_metrics(path)["train"]] == [1, 2]
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr\n{"kind": "train", "step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(path)


def test_a_folder_named_like_a_config_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # e.g. runs/tiny, the default output of --config tiny, when run from runs/
    assert config_path("tiny") == repo_root() / "configs" / "tiny.yaml"


# -- python -m twell.train: --resume and bad input ---------------------------------------------------------------
def _cli_run(monkeypatch):
    """Replace the training run of the CLI by a recorder of its arguments."""
    import types

    from twell.train import __main__ as cli

    calls = []

    def record(cfg, **kwargs):
        calls.append(dict(kwargs, cfg=cfg))
        return types.SimpleNamespace(summary=None)  # no summary: main prints nothing more

    monkeypatch.setattr(cli, "run", record)
    return cli, calls


def test_resume_refuses_an_out_dir_without_a_run(tmp_path, monkeypatch, capsys):
    cli, calls = _cli_run(monkeypatch)
    assert cli.main(["--config", "tiny", "--out", str(tmp_path / "typo"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m twell.train: error: --resume: {tmp_path / 'typo'} does not exist")
    assert "--resume-if-exists" in err and not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    assert cli.main(["--config", "tiny", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "holds no run (no ckpt or metrics.jsonl)" in capsys.readouterr().err
    monkeypatch.setattr(cli, "repo_root", lambda: tmp_path)  # the default --out: runs/<config name>
    assert cli.main(["--config", "tiny", "--resume"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "runs" / "tiny") in err and "(default runs/<config name>)" in err
    assert calls == []


def test_resume_continues_a_run_and_resume_if_exists_starts_one_where_there_is_none(tmp_path, monkeypatch, capsys):
    cli, calls = _cli_run(monkeypatch)
    out = tmp_path / "run"
    assert cli.main(["--config", "tiny", "--out", str(out), "--resume-if-exists"]) == 0
    assert calls[-1]["resume"] is False and calls[-1]["out"] == out
    assert f"no run in {out} to resume: starting a new run at step 0" in capsys.readouterr().err
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # an attempt killed before its first checkpoint is a run to continue
    assert cli.main(["--config", "tiny", "--out", str(out), "--resume-if-exists"]) == 0
    assert calls[-1]["resume"] is True and "starting a new run" not in capsys.readouterr().err
    assert cli.main(["--config", "tiny", "--out", str(out), "--resume", "--set", "train.steps=7"]) == 0
    assert calls[-1]["resume"] is True and calls[-1]["cfg"].train.steps == 7


def test_cli_config_errors_are_one_line(tmp_path, monkeypatch, capsys):
    cli, calls = _cli_run(monkeypatch)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [\n")
    assert cli.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m twell.train: error: --config {bad} is not valid YAML") and str(bad) in err
    assert cli.main(["--config", "tiny", "--set", "train.steps=["]) == 2
    assert "--set 'train.steps=[': the value is not valid YAML" in capsys.readouterr().err
    assert cli.main(["--config", "tiny", "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("usage: python -m twell.train")
    assert "python -m twell.train: error: argument --overwrite: not allowed with argument --resume" in err
    if not torch.cuda.is_available():
        assert cli.main(["--config", "tiny", "--set", "train.device=cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
    assert calls == []


def test_cli_resume_of_nothing_exits_2_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(repo_root() / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "twell.train", "--config", "tiny", "--out", str(tmp_path / "none"),
                           "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("python -m twell.train: error: --resume:")
