"""The command-line tools on bad input: one line ``<prog>: error: ...`` on stderr and exit status 2, before any
work starts; and python -m twell.bench's defaults (output folder off CUDA, the decode plan line, --help)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

import pytest
import torch

from twell import paths
from twell.bench import __main__ as bench_cli
from twell.cli import (USAGE_STATUS, UsageExit, check_args, check_checkpoint_files, fail, non_negative_int,
                       positive_float, positive_int, torch_device)
from twell.paths import repo_root

ENV = {**os.environ, "PYTHONPATH": str(repo_root() / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# The smallest ffn run: one odd-shape case at D 64.
TINY_FFN = ["ffn", "--shapes", "odd", "--cases", "nnz8", "--D", "64", "--odd-M", "20", "--odd-H", "100", "--reps", "1",
            "--warmup", "0", "--no-energy", "--no-memory", "--no-fp32-check", "--quiet", "--device", "cpu"]


def _cli(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          env=env or ENV)


def _bench_exit(argv: list[str], capsys) -> str:
    """The stderr of a bench command that must stop with status 2."""
    with pytest.raises(SystemExit) as info:
        bench_cli.main(argv)
    assert info.value.code == USAGE_STATUS
    return capsys.readouterr().err


# -- twell.cli ----------------------------------------------------------------------------------------------
def test_fail_prints_one_argparse_style_line_and_exits_2(capsys):
    with pytest.raises(SystemExit, match="^bad thing$") as info:
        fail("python -m twell.x", "bad thing")
    assert isinstance(info.value, UsageExit) and info.value.code == 2
    assert capsys.readouterr().err == "python -m twell.x: error: bad thing\n"


def test_number_and_device_types():
    assert positive_int("3") == 3 and non_negative_int("0") == 0 and positive_float("0.5") == 0.5
    for kind, text in [(positive_int, "0"), (positive_int, "-5"), (positive_int, "2.5"), (non_negative_int, "-1"),
                       (positive_float, "0"), (positive_float, "nan"), (positive_float, "inf"), (positive_float, "x")]:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            kind(text)
    assert torch_device("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match="expected cpu, cuda or cuda:N"):
        torch_device("bogus")
    with pytest.raises(argparse.ArgumentTypeError, match="expected cpu, cuda or cuda:N"):
        torch_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device"):
            torch_device("cuda")


def test_check_args_reports_through_the_parser(capsys):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--M", nargs="+", type=int)
    args = parser.parse_args(["--M", "4", "-2"])
    with pytest.raises(SystemExit):
        check_args(parser, args, {"M": positive_int})
    assert "p: error: argument --M: expected a positive integer, got '-2'" in capsys.readouterr().err


def test_damaged_checkpoint_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{\n")
    (tmp_path / "generation_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config\.json cannot be read as JSON \(Expecting"):
        check_checkpoint_files(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    check_checkpoint_files(tmp_path)
    check_checkpoint_files(tmp_path / "missing")  # left to the loader, which names what it expected
    check_checkpoint_files("owner/hub-model")


# -- python -m twell.bench ------------------------------------------------------------------------------------
def test_bench_help_describes_the_commands():
    help_text = bench_cli._parser().format_help()
    assert "Benchmarks of the sparse (TwELL) FFN against dense" in help_text
    assert "reports/smoke/bench/" in help_text and "Exit status 2" in help_text


@pytest.mark.parametrize("extra,message", [
    (["--M", "-5"], "argument --M: expected a positive integer, got '-5'"),
    (["--reps", "0"], "argument --reps: expected a positive integer, got '0'"),
    (["--warmup", "-1"], "argument --warmup: expected an integer >= 0"),
    (["--tol", "-1"], "argument --tol: expected a positive number"),
    (["--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N"),
    (["--tag", "a/b"], "argument --tag: 'a/b' would be a path"),
])
def test_bench_ffn_refuses_bad_arguments_before_any_case(extra, message, capsys, tmp_path):
    err = _bench_exit(TINY_FFN + ["--out", str(tmp_path)] + extra, capsys)
    assert f"python -m twell.bench ffn: error: {message}" in err
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_bench_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    err = _bench_exit(TINY_FFN + ["--out", str(tmp_path / "f")], capsys)
    assert "--out" in err and "is a file; give a directory" in err


def test_bench_reps_0_exits_2_with_one_line_and_no_traceback(tmp_path):
    proc = _cli("twell.bench", *TINY_FFN, "--out", str(tmp_path), "--reps", "0")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("python -m twell.bench ffn: error: argument --reps: expected a "
                                                    "positive integer, got '0'")
    assert "Traceback" not in proc.stderr


def test_bench_names_the_damaged_config_json(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{\n")
    for argv in (["model", str(ck), "--device", "cpu", "--quiet"],
                 ["activity", str(ck), "--tokens", str(tmp_path), "--device", "cpu"],
                 TINY_FFN + ["--checkpoint", str(ck), "--tokens", str(tmp_path), "--out", str(tmp_path)]):
        err = _bench_exit(argv, capsys)
        assert f"{ck / 'config.json'} cannot be read as JSON (Expecting" in err and ": error: " in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels may run here")
def test_bench_model_kernel_path_on_cpu_is_refused_before_loading(tmp_path, capsys):
    err = _bench_exit(["model", str(tmp_path / "not-loaded"), "--sparse-path", "kernel", "--device", "cpu"], capsys)
    assert "python -m twell.bench model: error: --sparse-path kernel: the TwELL kernels cannot run here" in err
    assert "--sparse-path reference" in err and "not-loaded" not in err


def test_bench_provenance_of_a_missing_file_exits_2(tmp_path, capsys):
    err = _bench_exit(["provenance", str(tmp_path / "none.json")], capsys)
    assert "python -m twell.bench provenance: error: cannot read meta of" in err and "No such file" in err


def _point_repo_at(monkeypatch, root):
    monkeypatch.setattr(paths, "repo_root", lambda: root)
    monkeypatch.delenv("TWELL_REPORTS", raising=False)


def test_bench_on_cpu_writes_to_the_smoke_reports_by_default(tmp_path, monkeypatch, capsys):
    _point_repo_at(monkeypatch, tmp_path)
    assert bench_cli.main(TINY_FFN + ["--tag", "where"]) == 0
    assert len(list((tmp_path / "reports" / "smoke" / "bench").glob("ffn-*-where.json"))) == 1
    assert not (tmp_path / "reports" / "bench").exists()
    monkeypatch.setenv("TWELL_REPORTS", str(tmp_path / "mine"))  # the variable still decides
    assert bench_cli.main(TINY_FFN + ["--tag", "where"]) == 0
    assert len(list((tmp_path / "mine" / "bench").glob("ffn-*-where.json"))) == 1


def test_bench_default_folder_follows_the_device(tmp_path, monkeypatch):
    _point_repo_at(monkeypatch, tmp_path)
    assert bench_cli._default_out("cpu") == tmp_path / "reports" / "smoke" / "bench"
    assert bench_cli._default_out("cuda:0") == tmp_path / "reports" / "bench"


DECODE_TINY = ["decode", "--M", "1", "4", "--cases", "nnz8", "--D", "64", "--H", "128", "--reps", "1", "--warmup", "0",
               "--no-energy", "--device", "cpu", "--quiet"]


def test_bench_decode_says_how_many_cases_and_how_long_before_the_first(tmp_path, monkeypatch, capsys):
    from twell.bench import decode

    seen = {}

    def fake_run(cfg, progress=True, allow_dirty=False):
        seen["stderr"] = capsys.readouterr().err  # what was printed before the benchmark started
        raise ValueError("stopped by the test")

    monkeypatch.setattr(decode, "run_decode_bench", fake_run)
    _bench_exit(DECODE_TINY + ["--out", str(tmp_path)], capsys)
    line = seen["stderr"].strip()
    assert line.startswith("decode bench: 2 cases (1 sparsity cases x 2 M: 1 4), dense and 3 implementation(s), "
                           "1 reps + 0 warm-up calls each, on cpu: roughly ")
    assert line.endswith("(CPU: the sparse reference path; the largest M take most of it)")


def test_bench_decode_estimate_counts_cases_and_calls():
    from twell.bench.decode import DecodeBenchConfig

    base = dict(rows=(1,), D=64, H=128, device="cpu", energy_rows=())
    one = bench_cli.decode_estimate(DecodeBenchConfig(cases=("nnz8",), reps=1, warmup=0, **base))
    many = bench_cli.decode_estimate(DecodeBenchConfig(cases=("nnz8", "nnz29"), reps=200, warmup=0, **base))
    assert 0 < one < many  # 2 cases x 201 calls against 1 x 2: far more, whatever the timing noise
    assert bench_cli._duration(30) == "30 s" and bench_cli._duration(600) == "10 min"
    assert bench_cli._duration(7200) == "2.0 h"


@pytest.mark.parametrize("extra,message", [
    (["--M", "0"], "argument --M: expected a positive integer, got '0'"),
    (["--energy-seconds", "-1"], "argument --energy-seconds: expected a positive number"),
    (["--tol", "0"], "argument --tol: expected a positive number"),
])
def test_bench_decode_checks_its_options_before_starting(extra, message, capsys, tmp_path):
    err = _bench_exit(DECODE_TINY + ["--out", str(tmp_path)] + extra, capsys)
    assert f"python -m twell.bench decode: error: {message}" in err and "decode bench:" not in err


def test_bench_decode_bad_shape_exits_2(capsys, tmp_path):
    err = _bench_exit(DECODE_TINY + ["--out", str(tmp_path), "--D", "100"], capsys)
    assert "python -m twell.bench decode: error: D must be a positive multiple of 64" in err


# -- the KV cache keyword of the model benchmark ---------------------------------------------------------------
def test_static_greedy_passes_the_cache_without_the_deprecated_keyword():
    from twell.bench.model import static_greedy
    from twell.model import ModelConfig, build_model

    torch.manual_seed(0)
    m = build_model(ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                num_kv_heads=2, max_position_embeddings=64)).eval()
    prompt = torch.randint(0, 97, (1, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' notice that past_key_values goes away
        with torch.inference_mode():
            tokens, _ = static_greedy(m, prompt, 4, graph=False)
            ref = m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                             min_new_tokens=4, do_sample=False, pad_token_id=0)[:, 5:]
    assert torch.equal(tokens, ref)  # the cache is used: the same tokens as generate


def test_cache_keyword_follows_the_forward_signature():
    from twell.bench.model import _cache_argument

    class Renamed(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return None

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return None

    assert _cache_argument(Renamed(), "c") == {"cache": "c"}
    assert _cache_argument(Older(), "c") == {"past_key_values": "c"}


# -- one format everywhere ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("module,args", [
    ("twell.bench", ["ffn", "--reps", "0"]),
    ("twell.eval", ["run", "x", "--name", "n", "--out", "o.json", "--limit", "abc"]),
    ("twell.pipeline", ["--cell-timeout", "-1"]),
    ("twell.train", ["--config", "tiny", "--resume", "--overwrite"]),
])
def test_every_cli_reports_a_usage_error_alike(module, args):
    proc = _cli(module, *args)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m {module}") and ": error: argument --" in last, proc.stderr
    assert "Traceback" not in proc.stderr
