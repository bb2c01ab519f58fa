"""All seven paper tasks through lm-eval's own task logic, offline, and the paper's table of them.

The task files are FIXTURES in each task's hub schema (twell.eval.fixtures, under the file names the
offline data uses) and the model is the project's FIXTURE model (a tiny random Llama). A random model
prefers some answer to every question: the test reads which from lm-eval's log-likelihoods, writes that
answer as the gold one in each task's own schema (an ARC label, HellaSwag's index as text, WinoGrande's
"1"/"2", ...) and checks that lm-eval then scores 100%, and 0% with the answer it likes least. The real
files in the offline data directory are checked for their layout and row counts when they exist.
"""
import json
import math

import numpy as np
import pytest
import torch

from twell.eval import PAPER_TASKS
from twell.eval.fixtures import (SHIPPED_FILES, answer_count, build_fixture_model, even_fixture_rows, with_gold,
                                 write_fixture_tasks)
from twell.eval.harness import evaluate_model
from twell.eval.paper_table import paper_markdown, paper_metric, paper_table
from twell.eval.tasks import default_data_dir, resolve_task_sources

N_DOCS = 6
PAPER_SPLITS = {"arc_easy": "test", "arc_challenge": "test", "openbookqa": "test", "hellaswag": "validation",
                "piqa": "validation", "winogrande": "validation", "commonsense_qa": "validation"}
PAPER_METRICS = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                 "openbookqa": "acc_norm", "piqa": "acc_norm", "winogrande": "acc", "commonsense_qa": "acc"}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return build_fixture_model(seed=3, dtype=torch.float32)


def _evaluate(model_and_tokenizer, root, name):
    model, tok = model_and_tokenizer
    return evaluate_model(model, tok, name=name, tasks=PAPER_TASKS, data_dir=root, offline=True, batch_size=8,
                          fixture=True, log_samples=True, progress=False)


@pytest.fixture(scope="module")
def runs(model_and_tokenizer, tmp_path_factory):
    """Three runs of the seven FIXTURE tasks: arbitrary gold answers, then the model's favourite, then its least
    favourite option as the gold one."""
    rows = {t: even_fixture_rows(t, N_DOCS, seed=11) for t in PAPER_TASKS}
    first = _evaluate(model_and_tokenizer, write_fixture_tasks(tmp_path_factory.mktemp("as_written"), rows), "first")
    out = {"first": first}
    for name, pick in (("favourite", np.argmax), ("least", np.argmin)):
        relabelled = {}
        for task, task_rows in rows.items():
            lls = [s["loglikelihoods"] for s in first.tasks[task].samples]
            relabelled[task] = [with_gold(task, row, int(pick(ll))) for row, ll in zip(task_rows, lls)]
        out[name] = _evaluate(model_and_tokenizer, write_fixture_tasks(tmp_path_factory.mktemp(name), relabelled),
                              name)
    return rows, out


def test_the_metric_table_is_the_papers():
    assert {t: paper_metric(t) for t in PAPER_TASKS} == PAPER_METRICS


def test_all_seven_fixture_tasks_are_scored_offline(runs):
    rows, out = runs
    run = out["first"]
    assert list(run.tasks) == list(PAPER_TASKS)
    for task, res in run.tasks.items():
        assert res.status == "ok" and res.source == "fixture-data", (task, res.reason)
        assert list(res.files) == [PAPER_SPLITS[task]] and res.files[PAPER_SPLITS[task]].endswith(SHIPPED_FILES[task])
        assert res.n == N_DOCS and PAPER_METRICS[task] in res.metrics
        assert [len(s["loglikelihoods"]) for s in res.samples] == [answer_count(task, r) for r in rows[task]]


def test_a_model_scores_100_percent_on_the_answers_it_prefers_and_0_on_the_others(runs):
    _, out = runs
    for task in PAPER_TASKS:
        lls = [s["loglikelihoods"] for s in out["first"].tasks[task].samples]
        for name, want in (("favourite", 1.0), ("least", 0.0)):
            res = out[name].tasks[task]
            # the gold answer does not change the requests: the same log-likelihoods, only the scores move
            for got, first in zip([s["loglikelihoods"] for s in res.samples], lls, strict=True):
                np.testing.assert_allclose(got, first, rtol=1e-5, atol=1e-5)
            for metric, score in res.metrics.items():  # acc_norm too: the options are of one length
                assert score["value"] == want, (task, name, metric)
                assert score["stderr"] == 0.0


def test_paper_table_means_the_seven_tasks(runs):
    _, out = runs
    table = paper_table({"favourite": out["favourite"], "least": out["least"], "first": out["first"]})
    assert list(table.task[:7]) == list(PAPER_TASKS) and list(table.metric[:7]) == [PAPER_METRICS[t] for t in PAPER_TASKS]
    mean = table.iloc[-1]
    assert mean.task == "mean (7 tasks)" and mean.status == "mean"
    assert mean.favourite == 1.0 and mean.least == 0.0
    firsts = [out["first"].tasks[t].metrics[PAPER_METRICS[t]]["value"] for t in PAPER_TASKS]
    assert mean["first"] == pytest.approx(sum(firsts) / 7)  # a plain mean, not weighted by questions
    ses = [out["first"].tasks[t].metrics[PAPER_METRICS[t]]["stderr"] for t in PAPER_TASKS]
    assert mean["first_se"] == pytest.approx(math.sqrt(sum(s * s for s in ses)) / 7)
    chance = dict(zip(table.task, table.chance))
    assert chance["piqa"] == chance["winogrande"] == 0.5 and chance["commonsense_qa"] == pytest.approx(0.2)
    assert chance["hellaswag"] == 0.25 and chance["arc_easy"] == pytest.approx(
        np.mean([1 / len(s["loglikelihoods"]) for s in out["first"].tasks["arc_easy"].samples]))
    md = paper_markdown(table)
    assert "| **mean (7 tasks)** **[FIXTURE data]** | mean | 42 |" in md and "| 100.0 ± 0.0 | 0.0 ± 0.0 |" in md


def test_paper_table_says_when_its_mean_is_not_the_papers(runs):
    _, out = runs
    run = out["favourite"]
    partial = type(run).from_dict(run.to_dict())
    del partial.tasks["hellaswag"]
    partial.tasks["piqa"].metrics.pop("acc_norm")  # never replaced by acc
    table = paper_table(partial)
    rows = dict(zip(table.task, table.status))
    assert rows["hellaswag"] == "missing" and rows["piqa"] == "missing"
    assert table.iloc[-1].task == "mean (5 of 7 tasks; not the paper's mean)"
    assert "no acc_norm in the run" in paper_markdown(table)


# Row counts of the offline data's files (its README).
REAL_ROWS = {"arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "openbookqa": 500, "piqa": 1838,
             "winogrande": 1267, "commonsense_qa": 1221}


@pytest.mark.skipif(default_data_dir() is None or not all((default_data_dir() / t).is_dir() for t in PAPER_TASKS),
                    reason="offline evaluation data for the seven tasks (<shared data>/eval/<task>/) not present")
def test_the_real_files_of_the_seven_tasks_resolve_locally():
    sources = {s.task: s for s in resolve_task_sources(PAPER_TASKS)}
    for task, src in sources.items():
        assert src.kind == "local" and not src.fixture, task
        path = src.files[src.eval_split]
        assert path.endswith(SHIPPED_FILES[task])
        with open(path, encoding="utf-8") as fh:
            assert sum(1 for line in fh if line.strip()) == REAL_ROWS[task], task
        with open(path, encoding="utf-8") as fh:
            json.loads(fh.readline())
