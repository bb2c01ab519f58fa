"""``python -m twell.eval run`` / ``compare`` on CPU: one FIXTURE checkpoint per process, then the
dense/sparse table from the two JSON files (the model and the task files are FIXTURES: the scores mean
nothing, the test checks what is written and the exit status)."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from twell import kernels
from twell.eval.__main__ import _parser, main, parse_limit
from twell.eval.fixtures import save_fixture_checkpoint, write_fixture_task_data
from twell.eval.harness import EvalRun
from twell.paths import repo_root

TASKS = ["piqa", "commonsense_qa"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli")
    data = write_fixture_task_data(root / "data", n_docs=random.randint(5, 8), seed=random.randint(0, 99))
    ckpts = {name: save_fixture_checkpoint(root / name, seed=random.randint(0, 99)) for name in ("dense", "sparse")}
    return root, data, ckpts


def _run(setup, name, path, limit, *extra):
    root, data, ckpts = setup
    out = root / f"{name}-{limit}.json"
    rc = main(["run", str(ckpts[name]), "--name", name, "--out", str(out), "--tasks", *TASKS, "--data-dir", str(data),
               "--limit", str(limit), "--device", "cpu", "--ffn-path", path, *extra])
    return rc, out


def test_run_then_compare(setup, capsys):
    root = setup[0]
    rc_d, dense = _run(setup, "dense", "dense", 4)
    rc_s, sparse = _run(setup, "sparse", "reference", 4)
    assert rc_d == rc_s == 0
    printed = capsys.readouterr().out
    assert "sparse piqa: n 4/" in printed and "twell-reference" in printed
    runs = {p: EvalRun.load_json(p) for p in (dense, sparse)}
    for run in runs.values():
        assert set(run.tasks) == set(TASKS) and run.limit == 4 and run.dtype == "bfloat16"
        for res in run.tasks.values():
            assert res.status == "ok" and res.n == 4 and len(res.samples) == 4  # per-document scores kept
    assert runs[sparse].ffn_paths_observed == {"twell-reference": 2}
    assert runs[dense].ffn_paths_observed == {"dense": 2}

    assert main(["compare", str(dense), str(sparse), "--out", str(root / "report"), "--stem", "t"]) == 0
    md = (root / "report" / "tables" / "t.md").read_text()
    assert "dense" in md and "sparse" in md and "piqa" in md
    assert (root / "report" / "figures" / "t.png").stat().st_size > 0
    saved = json.loads((root / "report" / "tables" / "t_runs.json").read_text())
    assert set(saved) == {"dense", "sparse"}
    assert "piqa" in capsys.readouterr().out


def test_a_task_without_data_fails_unless_allowed(setup, tmp_path, capsys):
    data = setup[1]
    only = tmp_path / "only_piqa"
    shutil.copytree(data / "piqa", only / "piqa")
    out = tmp_path / "r.json"
    args = ["run", str(setup[2]["dense"]), "--name", "dense", "--out", str(out), "--tasks", "piqa", "arc_easy",
            "--data-dir", str(only), "--limit", "2", "--device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "arc_easy" in err and "--allow-skipped" in err
    assert EvalRun.load_json(out).tasks["arc_easy"].status == "skipped"  # written all the same
    assert main(args + ["--allow-skipped"]) == 0


def test_compare_refuses_two_runs_of_one_name(setup):
    _, dense = _run(setup, "dense", "dense", 2)
    with pytest.raises(SystemExit, match="both runs are named 'dense'"):
        main(["compare", str(dense), str(dense), "--out", str(setup[0] / "x")])


def test_missing_checkpoint_is_an_error_naming_it(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope"), "--name", "dense", "--out", str(tmp_path / "o.json"),
                 "--device", "cpu", "--tasks", "piqa"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [(None, None), ("none", None), ("", None), ("200", 200), ("0.25", 0.25),
                                        ("1", 1)])
def test_parse_limit(text, value):
    assert parse_limit(text) == value and type(parse_limit(text)) is type(value)


@pytest.mark.parametrize("text", ["0", "-3", "2.5", "abc"])
def test_parse_limit_refuses(text):
    with pytest.raises(ValueError):
        parse_limit(text)


# -- bad input: one line on stderr, exit status 2, before lm-eval or the model is loaded ---------------------------
def test_help_ends_on_a_sentence():
    description = _parser().description
    assert description.endswith(".") and "lm-eval" in description


@pytest.mark.skipif(kernels.available(build=False)[0], reason="the kernels can run here")
def test_kernel_path_without_the_kernels_is_refused_before_loading(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, "-m", "twell.eval", "run", str(tmp_path / "never-loaded"),
                           "--name", "sparse", "--out", str(out), "--ffn-path", "kernel"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo_root() / "src"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("python -m twell.eval run: error: --ffn-path kernel: the TwELL kernels cannot run here")
    assert "--ffn-path reference" in lines[0] and not out.exists()


@pytest.mark.parametrize("option,value,message", [
    ("--limit", "abc", "expected a whole number of documents"),
    ("--limit", "2.5", "expected a whole number of documents"),
    ("--batch-size", "big", "expected auto, auto:N or a whole number >= 1"),
    ("--device", "bogus", "expected cpu, cuda or cuda:N"),
])
def test_bad_run_options_are_usage_errors(tmp_path, capsys, option, value, message):
    with pytest.raises(SystemExit) as info:
        main(["run", str(tmp_path), "--name", "x", "--out", str(tmp_path / "o.json"), option, value])
    assert info.value.code == 2
    assert f"python -m twell.eval run: error: argument {option}: {message}" in capsys.readouterr().err


def test_damaged_checkpoint_and_out_folder_are_named(setup, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(setup[2]["dense"], bad)
    (bad / "config.json").write_text("{\n")
    assert main(["run", str(bad), "--name", "dense", "--out", str(tmp_path / "o.json"), "--device", "cpu"]) == 2
    assert f"python -m twell.eval run: error: {bad / 'config.json'} cannot be read as JSON" in capsys.readouterr().err
    assert main(["run", str(setup[2]["dense"]), "--name", "dense", "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err


def test_compare_names_a_file_that_is_not_an_eval_run(tmp_path, capsys):
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "broken.json").write_text("{")
    for name, why in (("empty.json", "KeyError"), ("broken.json", "JSONDecodeError"),
                      ("missing.json", "does not exist")):
        assert main(["compare", str(tmp_path / name), str(tmp_path / name), "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"python -m twell.eval compare: error: baseline {tmp_path / name}") and why in err
