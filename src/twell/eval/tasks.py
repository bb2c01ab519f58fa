"""The paper's seven zero-shot tasks, and where their data comes from (local files or the hub).

lm-eval's built-in task definitions are used unchanged except for the data source. For a task
with local data, :func:`build_tasks` writes a derived task YAML that ``include:``s the installed
built-in YAML and overrides only the dataset keys::

    include: <site-packages>/lm_eval/tasks/arc/arc_easy.yaml
    task: arc_easy
    dataset_path: json                   # or parquet
    dataset_name: null
    dataset_kwargs: {data_files: {test: <data_dir>/arc_easy/test.jsonl}}
    validation_split: null               # only for declared splits with no local file

Declared splits with no local file are set to null because lm-eval opens the few-shot source
split while building the task even at zero shots; with ``num_fewshot=0`` that split is never
read for scoring. A task without local data uses the built-in YAML as is (hub download); offline,
it is tried from the Hugging Face cache and otherwise reported as skipped with the reason.

Local layout (hub schema, one JSON object per line; ``.json`` and ``.parquet`` are accepted too,
and hub parquet shards ``<split>-*.parquet``, all of them; each ``<split>.jsonl`` may also be named
``<task>_<split>.jsonl``, ``winogrande_xl_<split>.jsonl`` for WinoGrande, as the offline data ships them,
and the original releases' names listed in ``TaskSpec.aliases`` are found too)::

    <data_dir>/arc_easy/test.jsonl            allenai/ai2_arc ARC-Easy        id question choices{text,label} answerKey
    <data_dir>/arc_challenge/test.jsonl       allenai/ai2_arc ARC-Challenge   (same fields)
    <data_dir>/hellaswag/validation.jsonl     Rowan/hellaswag                 activity_label ctx_a ctx_b endings label
    <data_dir>/openbookqa/test.jsonl          allenai/openbookqa main         id question_stem choices{text,label} answerKey
    <data_dir>/piqa/validation.jsonl          baber/piqa                      goal sol1 sol2 label
    <data_dir>/winogrande/validation.jsonl    allenai/winogrande winogrande_xl sentence option1 option2 answer
    <data_dir>/commonsense_qa/validation.jsonl (or dev_rand_split.jsonl)
                                              tau/commonsense_qa              id question question_concept choices{label,text} answerKey

The split that is scored is the built-in ``test_split`` when it declares one, else its
``validation_split`` (ARC and OpenBookQA score ``test``, the others ``validation``). Optional:
``train.jsonl`` (few-shot source; required only with ``num_fewshot > 0``) and the other declared
splits. The default data directory is ``<shared data>/eval`` (see :func:`twell.paths.shared_data_dir`).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from twell.eval.errors import TaskDataError, TaskSchemaError, UnknownTaskError
from twell.eval.offline import hf_offline

PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "winogrande", "commonsense_qa")
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
AUTO = "auto"


@dataclass(frozen=True)
class TaskSpec:
    """What this module needs to know about one lm-eval task beyond its built-in YAML."""

    name: str
    lm_eval_dir: str  # sub-directory of lm_eval/tasks holding the built-in YAML
    fields: tuple[str, ...]  # top-level fields the built-in prompt templates read
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # original file names per split
    headline: str = "acc_norm"  # the metric the paper reports for the task (see TASK_SPECS)
    choices: int = 4  # answer options per question: chance accuracy is 1 / choices (ARC: most questions have 4)
    file_stem: str | None = None  # <file_stem>_<split>.jsonl is accepted too (default: the task name)


# The one table of which metric each task reports (``headline``), as the paper's tables do: acc_norm (lm-eval's
# accuracy with each answer's log-likelihood divided by its length in characters) for ARC-Easy, ARC-Challenge,
# HellaSwag, OpenBookQA and PIQA; acc for WinoGrande (lm-eval scores the fixed continuation after each option,
# so it defines no acc_norm) and CommonsenseQA (the answers are the letters A-E, of one length: lm-eval defines
# only acc). The paper's average is the plain mean of these seven numbers (twell.eval.paper_table).
TASK_SPECS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("arc_easy", "arc", ("question", "choices", "answerKey")),
        TaskSpec("arc_challenge", "arc", ("question", "choices", "answerKey")),
        TaskSpec("hellaswag", "hellaswag", ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
                 {"validation": ("hellaswag_val.jsonl",), "train": ("hellaswag_train.jsonl",)}),
        TaskSpec("openbookqa", "openbookqa", ("question_stem", "choices", "answerKey")),
        TaskSpec("piqa", "piqa", ("goal", "sol1", "sol2", "label"), choices=2),
        TaskSpec("winogrande", "winogrande", ("sentence", "option1", "option2", "answer"), headline="acc",
                 choices=2, file_stem="winogrande_xl"),
        TaskSpec("commonsense_qa", "commonsense_qa", ("question", "choices", "answerKey"),
                 {"validation": ("dev_rand_split.jsonl",), "train": ("train_rand_split.jsonl",)}, headline="acc",
                 choices=5),
    )
}


def chance(task: str) -> float | None:
    """Accuracy of guessing uniformly on a task (1 / its answer options), or None for a task not known
    here (a fixture's)."""
    spec = TASK_SPECS.get(task)
    return None if spec is None else 1.0 / spec.choices


def task_spec(name: str) -> TaskSpec:
    """The :class:`TaskSpec` of a supported task; :class:`UnknownTaskError` names the choices."""
    if not isinstance(name, str) or name not in TASK_SPECS:
        raise UnknownTaskError(f"unknown task {name!r}; supported tasks: {', '.join(PAPER_TASKS)}")
    return TASK_SPECS[name]


def split_file_candidates(task: str, split: str) -> list[str]:
    """File names accepted for ``split`` of ``task`` under ``<data_dir>/<task>/``, in lookup order."""
    spec = task_spec(task)
    return [*spec.aliases.get(split, ()), f"{split}.jsonl", f"{spec.file_stem or task}_{split}.jsonl", f"{split}.json",
            f"{split}.parquet", f"{split}-*.parquet"]


@dataclass
class TaskSource:
    """Where one task's data comes from. ``kind`` is ``"local"`` or ``"hub"``."""

    task: str
    kind: str
    builtin_yaml: str
    eval_split: str
    hub_dataset: str
    files: dict[str, str | list[str]] = field(default_factory=dict)  # split -> absolute path, or its parquet shards
    builder: str | None = None  # datasets builder for local files: "json" or "parquet"
    dropped_splits: tuple[str, ...] = ()  # declared splits with no local file
    null_keys: tuple[str, ...] = ()  # the built-in split keys set to null because their split is dropped
    note: str = ""  # why the hub is used (no local directory, ...)
    fixture: bool = False  # the local files are FIXTURES (a FIXTURE_README.txt sits next to or above them)

    def derived_config(self) -> dict[str, Any]:
        """The task YAML that includes the built-in one and changes only the data source."""
        cfg: dict[str, Any] = {"include": self.builtin_yaml, "task": self.task}
        if self.kind == "local":
            cfg.update(dataset_path=self.builder, dataset_name=None, dataset_kwargs={"data_files": dict(self.files)})
            cfg.update({key: None for key in self.null_keys})
        return cfg


# -- built-in definitions ------------------------------------------------------------------------
def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _builtin_entry(task: str):
    """lm-eval's index entry for a built-in task, found by scanning only its sub-directory (fast)."""
    from lm_eval.tasks import TaskManager

    spec = task_spec(task)
    directory = _lm_eval_tasks_dir() / spec.lm_eval_dir
    entry = TaskManager(include_path=directory, include_defaults=False).task_index.get(task) if directory.is_dir() else None
    if entry is None or entry.yaml_path is None:
        import lm_eval

        raise UnknownTaskError(
            f"task {task!r} not found in the installed lm-eval {getattr(lm_eval, '__version__', '?')} "
            f"(looked in {directory}); this module was written against lm-eval 0.4.13"
        )
    return entry


def builtin_yaml_path(task: str) -> Path:
    """Path of the installed built-in YAML of ``task``."""
    return Path(_builtin_entry(task).yaml_path)


# -- resolving the data source -------------------------------------------------------------------
def default_data_dir() -> Path | None:
    """``<shared data>/eval`` when the shared data directory exists, else None."""
    from twell.paths import shared_data_dir

    shared = shared_data_dir()
    return shared / "eval" if shared is not None and (shared / "eval").is_dir() else None


def _find_split_files(task_dir: Path, task: str, split: str) -> list[Path]:
    for name in split_file_candidates(task, split):
        if "*" in name:
            matches = sorted(task_dir.glob(name))
            if matches:
                return matches  # every shard: the split is their union
        elif (task_dir / name).is_file():
            return [task_dir / name]
    return []


def _builder_for(path: Path) -> str:
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in (".jsonl", ".json"):
        return "json"
    raise TaskDataError(f"unsupported data file {path}: expected .jsonl, .json or .parquet")


def _first_row_fields(path: Path) -> set[str]:
    """Field names of the first row of a local data file (the hub schema check)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.read_metadata(path)
        if meta.num_rows == 0:
            raise TaskSchemaError(f"data file {path} has no rows")
        return set(meta.schema.to_arrow_schema().names)
    with path.open("r", encoding="utf-8") as fh:
        head = fh.read(1)
        while head and head.isspace():
            head = fh.read(1)
        if not head:
            raise TaskSchemaError(f"data file {path} has no rows")
        if head == "[":  # a JSON array rather than JSON lines
            fh.seek(0)
            rows = json.load(fh)
            if not rows:
                raise TaskSchemaError(f"data file {path} has no rows")
            return set(rows[0])
        line = head + fh.readline()
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskSchemaError(f"data file {path}: the first line is not a JSON object ({err})") from None
    if not isinstance(row, dict):
        raise TaskSchemaError(f"data file {path}: expected one JSON object per line, got {type(row).__name__}")
    return set(row)


def _check_schema(task: str, path: Path) -> None:
    spec = task_spec(task)
    found = _first_row_fields(path)
    missing = [f for f in spec.fields if f not in found]
    if missing:
        raise TaskSchemaError(
            f"data file {path} for task {task!r} lacks field(s) {missing} of the hub schema; expected at least "
            f"{list(spec.fields)}, found {sorted(found)} (convert it to the hub dataset's fields)"
        )


def is_fixture_file(path: str | Path) -> bool:
    """True for files written by twell.eval.fixtures (marked by a FIXTURE_README.txt one or two levels up)."""
    path = Path(path).resolve()
    return any((parent / "FIXTURE_README.txt").is_file() for parent in (path.parent, path.parent.parent))


def _hub_name(cfg: Mapping[str, Any]) -> str:
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    return f"{path} ({name})" if name else str(path)


def resolve_task_sources(
    tasks: Iterable[str] = PAPER_TASKS,
    *,
    data_dir: str | os.PathLike | None = AUTO,
    data_files: Mapping[str, str | os.PathLike | Mapping[str, str | os.PathLike]] | None = None,
    num_fewshot: int = 0,
) -> list[TaskSource]:
    """Decide, per task, whether it reads local files or the hub.

    data_dir: ``"auto"`` = ``<shared data>/eval`` when present; ``None`` = no local directory;
        a path must exist. A task uses local data when ``<data_dir>/<task>/`` exists; that
        directory must then hold the scored split.
    data_files: explicit per-task files, ``{task: path_of_scored_split}`` or ``{task: {split: path}}``
        (a list of paths for a split in shards); they take precedence over ``data_dir`` and must exist.
    Raises UnknownTaskError, TaskDataError (missing directory/file), TaskSchemaError.
    """
    tasks = list(tasks)
    if not tasks:
        raise UnknownTaskError(f"no tasks given; supported tasks: {', '.join(PAPER_TASKS)}")
    for name in tasks:
        task_spec(name)
    for name in data_files or {}:
        task_spec(name)
    if isinstance(data_dir, str) and data_dir == AUTO:
        root = default_data_dir()
    elif data_dir is None:
        root = None
    else:
        root = Path(data_dir).expanduser()
        if not root.is_dir():
            raise TaskDataError(f"evaluation data directory {root} does not exist (data_dir={str(data_dir)!r})")

    sources = []
    for name in tasks:
        entry = _builtin_entry(name)
        cfg = dict(entry.cfg or {})
        eval_split = cfg.get("test_split") or cfg.get("validation_split")
        declared = [cfg[k] for k in SPLIT_KEYS if cfg.get(k)]
        files: dict[str, list[Path]] = {}
        origin = ""
        if data_files and name in data_files:
            given = data_files[name]
            given = {eval_split: given} if isinstance(given, (str, os.PathLike)) else dict(given)
            for split, value in given.items():
                value = [value] if isinstance(value, (str, os.PathLike)) else value
                files[split] = [Path(p).expanduser() for p in value]
                if not files[split]:
                    raise TaskDataError(f"data_files for task {name!r} split {split!r} is an empty list")
                for path in files[split]:
                    if not path.is_file():
                        raise TaskDataError(f"data file for task {name!r} split {split!r} does not exist: {path}")
            origin = "data_files"
            if eval_split not in files:
                raise TaskDataError(
                    f"data_files for task {name!r} name splits {sorted(files)} but not the scored split {eval_split!r}"
                )
        elif root is not None and (root / name).is_dir():
            for split in declared:
                found = _find_split_files(root / name, name, split)
                if found:
                    files[split] = found
            origin = str(root / name)
            if eval_split not in files:
                raise TaskDataError(
                    f"local data directory {root / name} for task {name!r} has no file for the scored split "
                    f"{eval_split!r}; expected one of {split_file_candidates(name, eval_split)}"
                )
        if not files:
            where = f"no directory {root / name}" if root is not None else "no local data directory set"
            note = f"{where}; local data would be <data_dir>/{name}/ with one of {split_file_candidates(name, eval_split)}"
            sources.append(TaskSource(name, "hub", str(entry.yaml_path), eval_split, _hub_name(cfg), note=note))
            continue
        paths = [p for split_paths in files.values() for p in split_paths]
        builders = {_builder_for(p) for p in paths}
        if len(builders) != 1:
            raise TaskDataError(f"data files for task {name!r} mix formats {sorted(builders)}: {files}")
        for path in paths:  # every shard, not only the first
            _check_schema(name, path)
        dropped = tuple(s for s in dict.fromkeys(declared) if s not in files)
        null_keys = tuple(k for k in SPLIT_KEYS if cfg.get(k) in dropped)
        fewshot_source = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split")
        if num_fewshot > 0 and fewshot_source not in files:
            raise TaskDataError(
                f"num_fewshot={num_fewshot} for task {name!r} needs its few-shot split {fewshot_source!r}, "
                f"but {origin} has no file for it (expected one of {split_file_candidates(name, fewshot_source)})"
            )
        sources.append(TaskSource(
            name, "local", str(entry.yaml_path), eval_split, _hub_name(cfg),
            files={s: str(ps[0].resolve()) if len(ps) == 1 else [str(p.resolve()) for p in ps]
                   for s, ps in files.items()},
            builder=builders.pop(), dropped_splits=dropped, null_keys=null_keys, note=f"local files from {origin}",
            fixture=any(is_fixture_file(p) for p in paths),
        ))
    return sources


# -- building lm-eval Task objects ---------------------------------------------------------------
@dataclass
class BuiltTasks:
    """lm-eval Task objects ready for ``simple_evaluate``, and the tasks that could not be built."""

    task_manager: Any
    tasks: dict[str, Any]  # name -> lm_eval.api.task.Task
    skipped: dict[str, str]  # name -> reason
    sources: dict[str, TaskSource]
    configs: dict[str, str]  # name -> derived YAML text (for the record)


def build_tasks(sources: list[TaskSource], *, offline: bool) -> BuiltTasks:
    """Instantiate lm-eval tasks (this loads their datasets).

    Local tasks read their files; hub tasks download, or when ``offline`` try the Hugging Face
    cache and otherwise are skipped with the reason. Online, a failed download raises
    TaskDataError naming the task (it is a set-up problem, not a result).
    """
    from lm_eval.tasks import TaskManager

    built: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    configs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="twell-eval-tasks-") as workdir, hf_offline(offline):
        for src in sources:
            text = "# Derived by twell.eval.tasks: the built-in task, only the data source changed.\n"
            text += yaml.safe_dump(src.derived_config(), sort_keys=False)
            (Path(workdir) / f"{src.task}.yaml").write_text(text)
            configs[src.task] = text
        manager = TaskManager(include_path=workdir, include_defaults=False)
        for src in sources:
            try:
                built[src.task] = manager.load([src.task])["tasks"][src.task]
            except Exception as err:  # noqa: BLE001 - classified below, never swallowed silently
                if src.kind == "local":
                    raise TaskDataError(f"task {src.task!r}: could not load local files {src.files}: {err}") from err
                if not offline:
                    raise TaskDataError(
                        f"task {src.task!r}: could not download {src.hub_dataset} from the hub: {err}. Without "
                        f"internet pass offline=True (tasks without local data are then skipped) or put files "
                        f"in the hub schema under <data_dir>/{src.task}/ ({src.note})"
                    ) from err
                skipped[src.task] = (
                    f"no local data ({src.note}) and offline: {src.hub_dataset} is not in the Hugging Face "
                    f"cache ({type(err).__name__})"
                )
    return BuiltTasks(manager, built, skipped, {s.task: s for s in sources}, configs)
