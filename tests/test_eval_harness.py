"""twell.eval.harness through the real lm-eval code path on CPU.

The model is a FIXTURE (tiny random Llama, ReLU FFN) and the task files are FIXTURES in the hub
schema of each of the seven tasks; the numbers mean nothing, the test checks that lm-eval ran this
model on these documents: its accuracies are recomputed independently from the model's logits.
The real CommonsenseQA dev file is used too when the shared data directory has it.
"""
import math
import random
import socket

import numpy as np
import pytest
import torch

from twell.eval import PAPER_TASKS, TaskDataError, UnknownTaskError
from twell.eval.fixtures import build_fixture_model, write_fixture_task_data
from twell.eval.harness import CPU_BATCH_SIZE, EvalRun, choose_batch_size, evaluate_model
from twell.eval.tasks import default_data_dir

N_DOCS = 8


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return write_fixture_task_data(tmp_path_factory.mktemp("eval_fixture_data"), n_docs=N_DOCS, seed=random.randint(0, 99))


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return build_fixture_model(seed=random.randint(0, 99), dtype=torch.float32)


@pytest.fixture(scope="module")
def run_and_connects(fixture_dir, model_and_tokenizer):
    """All seven fixture tasks evaluated once, offline, with every socket connection recorded."""
    model, tok = model_and_tokenizer
    connects = []
    real_connect = socket.socket.connect

    def spy(self, address):
        connects.append(address)
        return real_connect(self, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", spy)
        run = evaluate_model(model, tok, name="fixture", tasks=PAPER_TASKS, data_dir=fixture_dir, offline=True,
                             batch_size="auto", fixture=True, log_samples=True)
    return run, connects


def _loglikelihoods(model, tok, pairs):
    """log p(continuation | context) per (context, continuation) pair, split the way lm-eval's causal path
    splits (context tokens = tokens of the context alone); one right-padded forward (causal, so padding
    after a sequence cannot change it)."""
    wholes = [tok.encode(c + x) for c, x in pairs]
    n_ctx = [len(tok.encode(c)) for c, _ in pairs]
    width = max(map(len, wholes))
    ids = torch.tensor([w + [0] * (width - len(w)) for w in wholes])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    out = []
    for row, (whole, n) in enumerate(zip(wholes, n_ctx)):
        positions = torch.arange(n - 1, len(whole) - 1)
        out.append(float(logp[row, positions, torch.tensor(whole[n:])].sum()))
    return out


def _scores(model, tok, docs, context_of, choices_of, gold_of):
    """(per-document log-likelihoods [n, choices], acc, acc_norm) computed here, without lm-eval."""
    pairs = [(context_of(doc), " " + c) for doc in docs for c in choices_of(doc)]
    flat = iter(_loglikelihoods(model, tok, pairs))
    lls, acc, acc_norm = [], [], []
    for doc in docs:
        choices = choices_of(doc)
        ll = np.array([next(flat) for _ in choices])
        lls.append(ll)
        acc.append(float(np.argmax(ll) == gold_of(doc)))
        acc_norm.append(float(np.argmax(ll / np.array([len(c) for c in choices])) == gold_of(doc)))
    return np.array(lls), float(np.mean(acc)), float(np.mean(acc_norm))


def _assert_same_scores(result, lls, acc, acc_norm=None):
    harness_lls = np.array([s["loglikelihoods"] for s in result.samples])
    assert [s["doc_id"] for s in result.samples] == list(range(len(lls)))
    np.testing.assert_allclose(harness_lls, lls, rtol=1e-5, atol=1e-4)
    assert result.metrics["acc"]["value"] == pytest.approx(acc)
    if acc_norm is not None:
        assert result.metrics["acc_norm"]["value"] == pytest.approx(acc_norm)


def _read_jsonl(path):
    import json

    return [json.loads(line) for line in open(path)]


def test_all_seven_fixture_tasks_are_scored(run_and_connects):
    run, _ = run_and_connects
    assert isinstance(run, EvalRun) and run.fixture
    assert list(run.tasks) == list(PAPER_TASKS)
    for task, res in run.tasks.items():
        assert res.status == "ok", (task, res.reason)
        assert res.source == "fixture-data"  # FIXTURE_README.txt marks the files as fixtures
        assert res.n == N_DOCS and res.n_total == N_DOCS and res.num_fewshot == 0
        expected = {"acc"} if task in ("winogrande", "commonsense_qa") else {"acc", "acc_norm"}
        assert set(res.metrics) == expected
        for m in res.metrics.values():
            p = m["value"]
            assert 0.0 <= p <= 1.0
            # lm-eval's standard error of a mean of 0/1 outcomes: sqrt(p(1-p)/(n-1))
            assert m["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (N_DOCS - 1)), rel=1e-9, abs=1e-12)
    assert run.batch_size == str(CPU_BATCH_SIZE) and "CPU" in run.batch_size_note
    assert run.ffn_paths_observed in ({}, {"dense": 2})  # the fixture's SparseFFN modules ran dense


def test_nothing_touched_the_network(run_and_connects):
    _, connects = run_and_connects
    assert connects == []


def test_lm_eval_scored_this_model(run_and_connects, fixture_dir, model_and_tokenizer):
    """Recompute piqa's acc/acc_norm and commonsense_qa's acc from the model's own logits."""
    run, _ = run_and_connects
    model, tok = model_and_tokenizer
    import pyarrow.parquet as pq

    piqa = pq.read_table(fixture_dir / "piqa" / "validation.parquet").to_pylist()
    lls, acc, acc_norm = _scores(model, tok, piqa, lambda d: f"Question: {d['goal']}\nAnswer:",
                                 lambda d: [d["sol1"], d["sol2"]], lambda d: d["label"])
    _assert_same_scores(run.tasks["piqa"], lls, acc, acc_norm)
    csqa = _read_jsonl(fixture_dir / "commonsense_qa" / "dev_rand_split.jsonl")
    lls, acc, _ = _scores(model, tok, csqa, _csqa_context, lambda d: list("ABCDE"),
                          lambda d: "ABCDE".index(d["answerKey"]))
    _assert_same_scores(run.tasks["commonsense_qa"], lls, acc)


def _csqa_context(d):
    t = d["choices"]["text"]
    return (f"Question: {d['question'].strip()}\nA. {t[0]}\nB. {t[1]}\nC. {t[2]}\nD. {t[3]}\nE. {t[4]}\nAnswer:")


def test_run_record_round_trips(run_and_connects, tmp_path):
    run, _ = run_and_connects
    again = EvalRun.load_json(run.save_json(tmp_path / "run.json"))
    assert again == run
    import gzip

    (tmp_path / "run.json.gz").write_bytes(gzip.compress((tmp_path / "run.json").read_bytes()))
    assert EvalRun.load_json(tmp_path / "run.json.gz") == run


def test_missing_task_is_skipped_not_zero(fixture_dir, model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    (tmp_path / "piqa").symlink_to(fixture_dir / "piqa")
    run = evaluate_model(model, tok, tasks=["piqa", "hellaswag"], data_dir=tmp_path, offline=True, limit=3)
    assert run.tasks["piqa"].status == "ok" and run.tasks["piqa"].n == 3
    skipped = run.tasks["hellaswag"]
    assert skipped.status == "skipped" and skipped.metrics == {} and skipped.n is None
    assert "Rowan/hellaswag" in skipped.reason and "validation.jsonl" in skipped.reason


def test_every_task_skipped_returns_the_skips_without_an_ffn_path_error(fixture_dir, tmp_path):
    from twell.eval.harness import evaluate_loaded
    from twell.eval.loading import fixture_model

    loaded = fixture_model("fx", ffn_path="reference")
    for first in (True, False):
        # no task has data: nothing runs, so there is no path to check, and an earlier run's path is not claimed
        run = evaluate_loaded(loaded, tasks=["hellaswag"], data_dir=tmp_path, offline=True, batch_size=2)
        assert run.tasks["hellaswag"].status == "skipped" and "Rowan/hellaswag" in run.tasks["hellaswag"].reason
        assert run.ffn_paths_observed == {"None": 2}
        if first:
            ran = evaluate_loaded(loaded, tasks=["piqa"], data_dir=fixture_dir, offline=True, limit=2, batch_size=2)
            assert ran.ffn_paths_observed == {"twell-reference": 2}


@pytest.mark.skipif(default_data_dir() is None or not (default_data_dir() / "commonsense_qa").is_dir(),
                    reason="shared data directory with commonsense_qa/dev_rand_split.jsonl not present")
def test_real_commonsense_qa_dev_file(model_and_tokenizer):
    model, tok = model_and_tokenizer
    limit = 12
    run = evaluate_model(model, tok, tasks=["commonsense_qa"], offline=True, limit=limit, log_samples=True)
    res = run.tasks["commonsense_qa"]
    assert res.status == "ok" and res.source == "local" and res.files["validation"].endswith("dev_rand_split.jsonl")
    assert res.n == limit and res.n_total == 1221
    docs = _read_jsonl(res.files["validation"])[:limit]
    lls, acc, _ = _scores(model, tok, docs, _csqa_context, lambda d: list("ABCDE"),
                          lambda d: "ABCDE".index(d["answerKey"]))
    _assert_same_scores(res, lls, acc)


def test_unknown_task_is_named_before_any_work(model_and_tokenizer, fixture_dir):
    model, tok = model_and_tokenizer
    with pytest.raises(UnknownTaskError, match="'hellaswagg'"):
        evaluate_model(model, tok, tasks=["piqa", "hellaswagg"], data_dir=fixture_dir, offline=True)


def test_missing_data_file_is_named(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    with pytest.raises(TaskDataError, match="nope.jsonl"):
        evaluate_model(model, tok, tasks=["piqa"], data_dir=None, data_files={"piqa": tmp_path / "nope.jsonl"},
                       offline=True)


def test_batch_size_choice():
    assert choose_batch_size("auto", "cpu")[0] == CPU_BATCH_SIZE
    assert choose_batch_size("auto", "cuda:0")[0] == "auto"
    assert choose_batch_size(3, "cpu") == (3, "fixed 3 (requested)")
    with pytest.raises(ValueError, match="batch_size"):
        choose_batch_size(0, "cpu")


def test_fixture_data_fills_only_tasks_without_data(tmp_path, fixture_dir):
    from twell.eval.harness import fixture_data_files

    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "piqa").symlink_to(fixture_dir / "piqa")
    extra = fixture_data_files(["piqa", "winogrande", "arc_easy"], data_dir=tmp_path / "real", root=tmp_path / "fx")
    assert set(extra) == {"winogrande", "arc_easy"}
    assert extra["arc_easy"]["test"].startswith(str((tmp_path / "fx").resolve()))
    assert (tmp_path / "fx" / "FIXTURE_README.txt").is_file()


def test_hf_offline_sets_and_restores(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    from twell.eval.offline import hf_offline, resolve_offline

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TWELL_ALLOW_NETWORK"):
        monkeypatch.delenv(name, raising=False)
    before = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    assert resolve_offline(None) is False and resolve_offline(True) is True
    with hf_offline(True):
        assert huggingface_hub.constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE is True
        assert resolve_offline(None) is True
    assert (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before
    assert "HF_HUB_OFFLINE" not in __import__("os").environ
    monkeypatch.setenv("TWELL_ALLOW_NETWORK", "0")  # no network for anything, evaluations included
    assert resolve_offline(None) is True
    monkeypatch.setenv("TWELL_ALLOW_NETWORK", "1")
    assert resolve_offline(None) is False
