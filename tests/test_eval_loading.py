"""twell.eval.loading and evaluate_checkpoints: which loader ran, FFN paths, checkpoints that do not load.

The checkpoint is a FIXTURE (tiny random Llama with ReLU FFN saved by twell.eval.fixtures).
"""
import json
import random

import pytest
import torch

from twell.eval import CheckpointLoadError
from twell.eval.fixtures import save_fixture_checkpoint, write_fixture_task_data
from twell.eval.harness import evaluate_checkpoints
from twell.eval.loading import load_checkpoint, set_ffn_path, sparse_ffn_modules


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_fixture_checkpoint(tmp_path_factory.mktemp("fixture_ckpt") / "ckpt", seed=random.randint(0, 99))


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return write_fixture_task_data(tmp_path_factory.mktemp("eval_fixture_data"), n_docs=4)


def test_transformers_loader_is_recorded_and_runs_dense(checkpoint):
    lm = load_checkpoint(checkpoint, name="plain", loader="transformers", ffn_path="auto", offline=True)
    assert lm.loader == "transformers.AutoModelForCausalLM" and lm.ffn_path is None
    assert not sparse_ffn_modules(lm.model) and any("dense MLP" in n for n in lm.notes)
    assert lm.device == "cpu" and lm.tokenizer is not None
    with pytest.raises(ValueError, match="'reference' cannot run"):
        load_checkpoint(checkpoint, loader="transformers", ffn_path="reference", offline=True)


def test_project_loader_gives_sparse_modules(checkpoint, fixture_dir):
    lm = load_checkpoint(checkpoint, name="sparse", ffn_path="reference", dtype="bfloat16", offline=True)
    assert lm.loader == "twell.model.load_pretrained" and lm.ffn_path == "reference" and lm.dtype == "bfloat16"
    modules = sparse_ffn_modules(lm.model)
    assert len(modules) == 2 and all(m.path == "reference" for m in modules)
    set_ffn_path(lm.model, "dense")
    assert all(m.path == "dense" for m in modules)


def test_nonexistent_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointLoadError, match="'mine'.*no_such_ckpt"):
        load_checkpoint(tmp_path / "no_such_ckpt", name="mine", offline=True)
    with pytest.raises(CheckpointLoadError, match="'owner/name'"):
        load_checkpoint("not/a/hub/id", offline=True)


@pytest.mark.parametrize("loader", ["auto", "transformers"])
def test_corrupt_checkpoint_is_named(tmp_path, loader):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointLoadError, match=r"checkpoint 'broken' at .*broken could not be loaded with"):
        load_checkpoint(bad, loader=loader, offline=True)


def test_checkpoint_without_tokenizer_is_named(tmp_path, checkpoint):
    import shutil

    copy = tmp_path / "no_tok"
    shutil.copytree(checkpoint, copy)
    for f in copy.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(CheckpointLoadError, match="'no_tok'"):
        load_checkpoint(copy, loader="transformers", offline=True)


def test_bad_options_are_named(checkpoint):
    with pytest.raises(ValueError, match="loader"):
        load_checkpoint(checkpoint, loader="vllm")
    with pytest.raises(ValueError, match="FFN path"):
        load_checkpoint(checkpoint, ffn_path="sparse")
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(checkpoint, dtype="float8")


def test_evaluate_checkpoints_names_a_missing_checkpoint(tmp_path, fixture_dir):
    with pytest.raises(CheckpointLoadError, match="'sparse'"):
        evaluate_checkpoints({"sparse": str(tmp_path / "missing")}, tasks=["piqa"], data_dir=fixture_dir, offline=True)


def test_evaluate_checkpoints_fixture_fallback_is_loud(tmp_path, fixture_dir, checkpoint, capsys):
    ckpts = {"dense": str(checkpoint), "sparse": {"path": str(tmp_path / "missing"), "ffn_path": "dense"}}
    with pytest.warns(UserWarning, match="FIXTURE"):
        runs = evaluate_checkpoints(ckpts, tasks=["piqa", "winogrande"], data_dir=fixture_dir, offline=True,
                                    fixture_if_missing=True, limit=2, dtype="float32")
    assert "!!!" in capsys.readouterr().out
    # Both are FIXTURES: the stand-in for the missing one, and the checkpoint on disk (FIXTURE_README.txt).
    assert runs["dense"].fixture and runs["sparse"].fixture and runs["sparse"].loader == "fixture"
    assert runs["dense"].source == str(checkpoint.resolve())
    assert all(r.tasks["piqa"].n == 2 for r in runs.values())
    assert json.loads(json.dumps(runs["dense"].to_dict(), default=str))["tasks"]["winogrande"]["status"] == "ok"
    assert runs["dense"].loader == "twell.model.load_pretrained"
    assert runs["dense"].ffn_paths_observed == {"dense": 2}  # "dense" in the name -> dense path


def test_sparse_checkpoint_evaluated_on_the_reference_path(checkpoint, fixture_dir):
    runs = evaluate_checkpoints({"sparse": str(checkpoint)}, tasks=["hellaswag"], data_dir=fixture_dir, offline=True,
                                dtype="bfloat16", limit=3)
    run = runs["sparse"]
    assert run.ffn_path == "auto" and run.ffn_paths_observed == {"twell-reference": 2}
    assert run.dtype == "bfloat16" and run.tasks["hellaswag"].status == "ok"


def test_cuda_device_without_cuda_is_an_error(checkpoint):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_checkpoint(checkpoint, device="cuda", offline=True)


def test_fp32_checkpoint_on_auto_runs_dense_loudly_and_sparse_paths_need_bf16(checkpoint, fixture_dir):
    """An fp32 model on "auto" runs its SparseFFNs dense (no sparse path takes fp32): the evaluation
    finishes, records it and warns, instead of raising after the whole run. "reference" / "kernel"
    on fp32 are refused at load; the path check refuses an "auto" that ran nothing sparse."""
    from twell.eval.compare import check_checkpoint_paths

    with pytest.warns(UserWarning, match="ran every SparseFFN dense"):
        runs = evaluate_checkpoints({"sparse": str(checkpoint)}, tasks=["piqa"], data_dir=fixture_dir, offline=True,
                                    limit=2, dtype="float32")
    assert runs["sparse"].ffn_paths_observed == {"dense": 2} and runs["sparse"].tasks["piqa"].status == "ok"
    assert any("ran every SparseFFN dense" in n for n in runs["sparse"].notes)
    with pytest.raises(ValueError, match="'reference' needs a bfloat16 model, this one is float32"):
        load_checkpoint(checkpoint, ffn_path="reference", dtype="float32", offline=True)
    with pytest.raises(RuntimeError, match="ran no SparseFFN sparse"):
        check_checkpoint_paths("sparse", str(checkpoint), paths=("dense", "auto"), tasks=["piqa"], limit=2,
                               data_dir=fixture_dir, dtype="float32", offline=True)
    check = check_checkpoint_paths("sparse", str(checkpoint), paths=("dense", "reference"), tasks=["piqa"], limit=2,
                                   data_dir=fixture_dir, dtype="bfloat16", offline=True)
    assert check.fixture and check.fixture_data and "FIXTURE model and data" in check.summary()
    assert check.to_frame()["fixture"].iloc[0].startswith("FIXTURE")


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3"])
def test_limit_must_be_a_count_or_a_fraction(checkpoint, fixture_dir, bad):
    from twell.eval.compare import compare_paths
    from twell.eval.harness import evaluate_model

    lm = load_checkpoint(checkpoint, ffn_path="dense", dtype="bfloat16", offline=True)
    with pytest.raises(ValueError, match="limit must be None, a whole number"):
        evaluate_model(lm.model, lm.tokenizer, tasks=["piqa"], data_dir=fixture_dir, offline=True, limit=bad)
    with pytest.raises(ValueError, match="limit must be None, a whole number"):
        compare_paths(lm.model, lm.tokenizer, [("a", " b")], paths=("dense", "reference"), limit=bad)


def test_twell_allow_network_0_keeps_a_hub_id_offline(monkeypatch):
    """load_checkpoint with offline=None follows the environment: TWELL_ALLOW_NETWORK=0 means no
    download, as for load_pretrained (it passed allow_network=True, which beat the variable)."""
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kw):
        calls.append(kw.get("local_files_only"))
        raise RuntimeError("no network in tests")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TWELL_ALLOW_NETWORK", "0")
    with pytest.raises(CheckpointLoadError):
        load_checkpoint("twell-tests/not-here", device="cpu")
    assert calls == [True]
