"""twell.eval.tasks: where each task's data comes from, derived task configs, bad input.

All task files here are FIXTURES written by twell.eval.fixtures (synthetic text in the hub schema).
"""
import json
import random

import pytest

from twell.eval import PAPER_TASKS, TaskDataError, TaskSchemaError, UnknownTaskError, resolve_task_sources
from twell.eval.fixtures import fixture_rows, write_fixture_task_data
from twell.eval.tasks import SPLIT_KEYS, build_tasks, builtin_yaml_path, split_file_candidates

# Changed by the derived config; everything else must equal the built-in definition.
DATA_KEYS = {"dataset_path", "dataset_name", "dataset_kwargs"}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return write_fixture_task_data(tmp_path_factory.mktemp("eval_fixture_data"), n_docs=random.randint(3, 7))


def _load_yaml(path):
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False)


def test_all_seven_tasks_resolve_to_local_fixture_files(fixture_dir):
    sources = {s.task: s for s in resolve_task_sources(PAPER_TASKS, data_dir=fixture_dir)}
    assert list(sources) == list(PAPER_TASKS)
    assert all(s.kind == "local" for s in sources.values())
    # scored splits as the built-in configs declare them
    assert sources["arc_easy"].eval_split == "test" and sources["openbookqa"].eval_split == "test"
    assert sources["hellaswag"].eval_split == "validation" and sources["commonsense_qa"].eval_split == "validation"
    # variants: original CSQA file name, parquet, all ARC splits present
    assert sources["commonsense_qa"].files["validation"].endswith("dev_rand_split.jsonl")
    assert sources["piqa"].builder == "parquet" and sources["arc_easy"].builder == "json"
    assert sources["arc_easy"].dropped_splits == ()
    assert set(sources["openbookqa"].dropped_splits) == {"train", "validation"}
    assert sources["openbookqa"].null_keys == ("training_split", "validation_split")


def test_derived_config_changes_only_the_data_source(fixture_dir, tmp_path):
    for src in resolve_task_sources(PAPER_TASKS, data_dir=fixture_dir):
        derived_path = tmp_path / f"{src.task}.yaml"
        import yaml

        derived_path.write_text(yaml.safe_dump(src.derived_config()))
        derived, builtin = _load_yaml(derived_path), _load_yaml(builtin_yaml_path(src.task))
        changed = {k for k in set(derived) | set(builtin) if derived.get(k) != builtin.get(k)}
        assert changed <= DATA_KEYS | set(src.null_keys), (src.task, changed)
        assert derived["dataset_path"] == src.builder
        assert derived["dataset_kwargs"] == {"data_files": src.files}
        for key in src.null_keys:
            assert key in SPLIT_KEYS and derived[key] is None


def test_built_tasks_use_the_builtin_prompts_on_fixture_docs(fixture_dir):
    sources = resolve_task_sources(["arc_easy", "piqa", "commonsense_qa", "winogrande"], data_dir=fixture_dir)
    built = build_tasks(sources, offline=True)
    assert not built.skipped
    arc = built.tasks["arc_easy"]
    doc = arc.test_docs()[0]
    assert arc.doc_to_text(doc) == f"Question: {doc['question']}\nAnswer:"
    assert arc.doc_to_choice(doc) == doc["choices"]["text"]
    assert arc.doc_to_target(doc) == doc["choices"]["label"].index(doc["answerKey"])
    piqa = built.tasks["piqa"]
    doc = piqa.validation_docs()[0]
    assert piqa.doc_to_text(doc) == f"Question: {doc['goal']}\nAnswer:" and piqa.doc_to_target(doc) == doc["label"]
    csqa = built.tasks["commonsense_qa"]
    doc = csqa.validation_docs()[0]
    assert csqa.doc_to_choice(doc) == ["A", "B", "C", "D", "E"]
    assert csqa.doc_to_text(doc).startswith(f"Question: {doc['question'].strip()}\nA. {doc['choices']['text'][0]}")
    wino = built.tasks["winogrande"]
    doc = wino.validation_docs()[0]
    assert wino.doc_to_text(doc) == int(doc["answer"]) - 1  # multiple-input task: the index of the gold context
    # the documents are the fixture rows, in order
    assert [d["id"] for d in arc.test_docs()] == [r["id"] for r in fixture_rows("arc_easy", len(arc.test_docs()))]


def test_task_without_local_data_uses_the_hub_definition_unchanged(tmp_path, monkeypatch):
    (tmp_path / "arc_easy").mkdir(parents=False)
    (tmp_path / "arc_easy" / "test.jsonl").write_text(json.dumps(fixture_rows("arc_easy", 1)[0]) + "\n")
    sources = {s.task: s for s in resolve_task_sources(["arc_easy", "hellaswag"], data_dir=tmp_path)}
    assert sources["hellaswag"].kind == "hub"
    assert sources["hellaswag"].derived_config() == {"include": str(builtin_yaml_path("hellaswag")), "task": "hellaswag"}
    # online: the built-in hub dataset is requested; a failed download names the task (no network used here)
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append(kwargs)
        raise ConnectionError("no network in this test")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(TaskDataError, match="hellaswag.*Rowan/hellaswag.*offline=True"):
        build_tasks([sources["hellaswag"]], offline=False)
    assert calls and calls[-1]["path"] == "Rowan/hellaswag"


def test_offline_task_without_data_is_skipped_with_the_reason(tmp_path):
    sources = resolve_task_sources(["openbookqa"], data_dir=tmp_path)
    built = build_tasks(sources, offline=True)
    assert not built.tasks
    reason = built.skipped["openbookqa"]
    assert "no local data" in reason and "allenai/openbookqa" in reason and "test.jsonl" in reason


def test_data_files_override_and_alias_names(tmp_path):
    rows = fixture_rows("commonsense_qa", 3)
    path = tmp_path / "my_csqa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (src,) = resolve_task_sources(["commonsense_qa"], data_dir=None, data_files={"commonsense_qa": path})
    assert src.kind == "local" and src.files == {"validation": str(path.resolve())}
    assert split_file_candidates("commonsense_qa", "validation")[0] == "dev_rand_split.jsonl"


def test_json_array_files_are_accepted(tmp_path):
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "validation.json").write_text(json.dumps(fixture_rows("piqa", 2)))
    (src,) = resolve_task_sources(["piqa"], data_dir=tmp_path)
    assert src.builder == "json" and src.files["validation"].endswith("validation.json")


@pytest.mark.parametrize("bad", ["arc_easyy", "mmlu", "", "ARC_EASY"])
def test_unknown_task_is_named(bad, fixture_dir):
    with pytest.raises(UnknownTaskError, match=repr(bad)):
        resolve_task_sources(["piqa", bad], data_dir=fixture_dir)


def test_missing_data_dir_is_named(tmp_path):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(TaskDataError, match="no_such_dir"):
        resolve_task_sources(["piqa"], data_dir=missing)


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(TaskDataError, match="missing.jsonl"):
        resolve_task_sources(["piqa"], data_dir=None, data_files={"piqa": tmp_path / "missing.jsonl"})
    (tmp_path / "winogrande").mkdir()
    (tmp_path / "winogrande" / "train.jsonl").write_text(json.dumps(fixture_rows("winogrande", 1)[0]) + "\n")
    with pytest.raises(TaskDataError, match=r"winogrande.*'validation'.*validation\.jsonl"):
        resolve_task_sources(["winogrande"], data_dir=tmp_path)


def test_file_in_another_schema_is_rejected(tmp_path):
    # The original CommonsenseQA release nests the question; lm-eval's task needs the hub fields.
    original = {"answerKey": "A", "id": "x", "question": {"stem": "?", "choices": [{"label": "A", "text": "a"}]}}
    (tmp_path / "commonsense_qa").mkdir()
    (tmp_path / "commonsense_qa" / "validation.jsonl").write_text(json.dumps(original) + "\n")
    with pytest.raises(TaskSchemaError, match=r"commonsense_qa.*\['choices'\]"):
        resolve_task_sources(["commonsense_qa"], data_dir=tmp_path)
    (tmp_path / "commonsense_qa" / "validation.jsonl").write_text("")
    with pytest.raises(TaskSchemaError, match="no rows"):
        resolve_task_sources(["commonsense_qa"], data_dir=tmp_path)


def test_fewshot_needs_the_fewshot_split(fixture_dir):
    with pytest.raises(TaskDataError, match="num_fewshot=5.*'train'"):
        resolve_task_sources(["piqa"], data_dir=fixture_dir, num_fewshot=5)
    (src,) = resolve_task_sources(["arc_easy"], data_dir=fixture_dir, num_fewshot=5)  # has train.jsonl
    assert "train" in src.files


def test_every_parquet_shard_of_a_split_is_used(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "piqa").mkdir()
    rows = fixture_rows("piqa", 5)
    shards = [tmp_path / "piqa" / f"validation-0000{i}-of-00002.parquet" for i in range(2)]
    for shard, part in zip(shards, (rows[:2], rows[2:])):
        pq.write_table(pa.Table.from_pylist(part), shard)
    (src,) = resolve_task_sources(["piqa"], data_dir=tmp_path)
    assert src.files == {"validation": [str(p.resolve()) for p in shards]}
    assert src.derived_config()["dataset_kwargs"] == {"data_files": src.files}
    built = build_tasks([src], offline=True)
    assert [d["goal"] for d in built.tasks["piqa"].validation_docs()] == [r["goal"] for r in rows]
    # explicit data_files take a list per split too
    (again,) = resolve_task_sources(["piqa"], data_dir=None, data_files={"piqa": {"validation": shards}})
    assert again.files == src.files
    # each shard is schema-checked, not only the first
    pq.write_table(pa.Table.from_pylist([{"question": "?", "label": 0}]), shards[1])
    with pytest.raises(TaskSchemaError, match=r"validation-00001-of-00002\.parquet.*\['goal', 'sol1', 'sol2'\]"):
        resolve_task_sources(["piqa"], data_dir=tmp_path)


def test_the_offline_data_file_names_are_found(tmp_path):
    """<task>_<split>.jsonl (winogrande_xl_<split>.jsonl), as <shared data>/eval ships them, besides <split>.jsonl."""
    from twell.eval.fixtures import SHIPPED_FILES, write_fixture_tasks

    write_fixture_tasks(tmp_path, {t: fixture_rows(t, 2) for t in PAPER_TASKS})
    for src in resolve_task_sources(PAPER_TASKS, data_dir=tmp_path):
        assert src.kind == "local" and src.fixture
        assert src.files == {src.eval_split: str((tmp_path / src.task / SHIPPED_FILES[src.task]).resolve())}
    assert "winogrande_xl_validation.jsonl" in split_file_candidates("winogrande", "validation")
    assert "openbookqa_test.jsonl" in split_file_candidates("openbookqa", "test")
