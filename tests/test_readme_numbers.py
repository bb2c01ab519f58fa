"""The README's Results table shows the committed records' numbers, rounded once.

Each figure checked here is recomputed from the record it comes from (a JSON in reports/, or the CSV a
notebook wrote beside its table) and compared with the README's text. The rounding rule: a value ``v`` of
the record (or a ratio, difference or scale of such values, computed in float) is shown with a fixed number
of decimals per kind, rounded once from the exact binary value of ``v``, ties to even
(``decimal.ROUND_HALF_EVEN``), never from a table's already rounded figure:

- speed ratios (``1.16x``): 2 decimals;
- percentages (energy change, CE change, accuracy and its standard error): 1 decimal; shares of active
  neurons: 2 decimals; peak memory saved: 0 decimals;
- energy per token in uJ, times in ms: 1 decimal; memory in MB (bytes / 2**20): 0 decimals;
- relative errors: 1 decimal of the mantissa at the exponent the README writes (``8.8e-4``; a range shares
  one exponent, ``2.7-3.2e-3``).

A range ``lo-hi`` is the minimum and maximum over the cases named, each rounded by the same rule, written
once when both round alike. The README's rows that rest on text files (probe logs) are not checked here.
"""
from __future__ import annotations

import csv
import json
import re
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "reports" / "bench"
TABLES = ROOT / "reports" / "tables"
FFN_RECORD = BENCH / "ffn-NVIDIA-H100-80GB-HBM3-20261127T111641Z-s39-H100.json"
TRAIN_RECORD = BENCH / "ffn-NVIDIA-H200-20261202T032332Z.json"
DECODE_RECORD = BENCH / "decode-NVIDIA-H200-20261128T193313Z.json"
NEAR_DENSE = BENCH / "near-dense-rounds-H200.json"
CHOOSER = BENCH / "auto-chooser-e2e-s32b-small8-H100-20261126.json"
GRAPH_DECODE_0P5B = BENCH / "model-0p5b__5000_steps_-NVIDIA_H200-20261129T000908.json"
EVAL_RUNS = TABLES / "03_downstream_eval_runs.json"
CASES = ("nnz8", "nnz29", "nnz64", "nnz29-heavy")


# ---------------------------------------------------------------- the rule
def rounded(value, decimals: int, scale=1) -> str:
    """``value * scale`` to ``decimals`` decimals, ties to even, from the exact binary value (see the module)."""
    with localcontext() as ctx:
        ctx.prec = 60  # exact for the products and quotients here: nothing is rounded before the quantize
        return str((Decimal(value) * Decimal(scale)).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_EVEN))


def ratio(value) -> str:
    return rounded(value, 2) + "x"


def span(values, decimals: int, scale=1) -> str:
    lo, hi = rounded(min(values), decimals, scale), rounded(max(values), decimals, scale)
    return lo if lo == hi else f"{lo}-{hi}"


def rel_err(values, exponent: int) -> str:
    return f"{span(values, 1, Decimal(10) ** -exponent)}e{exponent}"


def mb(nbytes) -> str:
    return rounded(nbytes, 0, Decimal(1) / Decimal(2 ** 20))


def test_the_rule_rounds_once_and_ties_to_even():
    assert rounded(1.1647731896140185, 2) == "1.16"  # the 2B prefill: 1.165 in its .md, 1.17 if rounded again
    assert rounded(0.125, 2) == "0.12" and rounded(0.375, 2) == "0.38"  # exact binary ties go to the even digit
    assert rounded(2.675, 2) == "2.67"  # 2.675 is 2.67499999... in binary: no tie, rounded down
    assert rounded(-0.14449779542236674, 1, 100) == "-14.4"
    assert mb(503587840) == "480" and span([1.0, 1.0004], 2) == "1.00" and span([0.9, 1.1], 1) == "0.9-1.1"
    assert rel_err([0.00232, 0.00328], -3) == "2.3-3.3e-3"


# ---------------------------------------------------------------- the README's table
def _results_rows() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| what ") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a Results row without exactly three cells: {line}"
        rows[cells[0]] = (cells[1], cells[2])
    return rows


ROWS = _results_rows()


def row(what_starts: str) -> tuple[str, str, str]:
    """(what, result, file) of the one Results row whose first cell starts with ``what_starts``."""
    found = [(what, *rest) for what, rest in ROWS.items() if what.startswith(what_starts)]
    assert len(found) == 1, f"{len(found)} Results rows start with {what_starts!r}"
    return found[0]


def starts(readme: str, expected: str) -> None:
    assert readme.startswith(expected), f"\nREADME: {readme}\nrecord: {expected}"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _ffn_cases(path: Path) -> dict[tuple[str, int, str], dict]:
    return {(c["case"]["kind"], c["case"]["M"], c["case"]["sparsity"]): c for c in _load(path)["cases"]}


def test_ffn_speedups_of_the_table_of_record():
    cases = _ffn_cases(FFN_RECORD)
    kernel = {k: c["impls"]["twell-kernel"] for k, c in cases.items() if k[0] != "train"}  # its train rows: dense only
    at = {s: kernel["inference", 65536, s] for s in CASES}
    _, result, where = row("sparse FFN speedup at nnz 8 / 29 / 64")
    assert f"**{' / '.join(ratio(at[s]['speedup']) for s in CASES[:3])}**" in result
    assert FFN_RECORD.stem in where
    what, result, _ = row("heavy-tailed activations")
    heavy = cases["inference", 65536, "nnz29-heavy"]
    assert f"up to {heavy['sparsity']['max_active']} active" in what
    assert f"**{ratio(at['nnz29-heavy']['speedup'])}**, relative error {rel_err([at['nnz29-heavy']['rel_err']], -4)}" \
        in result
    assert row("M = 131072")[1] == " / ".join(ratio(kernel["inference", 131072, s]["speedup"]) for s in CASES)
    _, result, _ = row("energy per token, nnz 8 / 29 / 64 / heavy tail")
    dense = [cases["inference", 65536, s]["dense"]["joules_per_token"] for s in CASES]
    assert result == (" / ".join(rounded(at[s]["joules_per_token"], 1, 10 ** 6) for s in CASES)
                      + f" uJ sparse against {span(dense, 1, 10 ** 6)} uJ dense")
    sparse_mb = {mb(at[s]["peak_bytes_above_inputs"]) for s in CASES}
    dense_mb = {mb(cases["inference", 65536, s]["dense"]["peak_bytes_above_inputs"]) for s in CASES}
    assert len(sparse_mb) == len(dense_mb) == 1  # one figure each in the README: the four cases agree
    assert row("peak memory above inputs and weights")[1] == (f"{sparse_mb.pop()} MB sparse against "
                                                              f"{dense_mb.pop()} MB dense")
    # Errors against dense bf16: every case of the kernel but the heavy tail (its own row above).
    _, result, where = row("accuracy of the kernels")
    vs_dense = [v["rel_err"] for (_, _, s), v in kernel.items() if s != "nnz29-heavy"]
    vs_fp32 = [v["rel_err_vs_fp32"] for v in kernel.values()]
    dense_fp32 = [cases[k]["dense"]["rel_err_vs_fp32"] for k in kernel]
    assert result == (f"relative error {rel_err(vs_dense, -3)} against dense bf16 (limit 1e-2); against an fp32 FFN, "
                      f"kernels {rel_err(vs_fp32, -3)}, dense bf16 {rel_err(dense_fp32, -3)}")
    assert FFN_RECORD.name in where


def test_published_inference_kernels():
    with open(TABLES / "01_kernel_speedup.csv") as f:
        published = {r["case"]: r["published"] for r in csv.DictReader(f)
                     if r["shape"] == "inference" and r["M"] == "65536" and r["impl"] == "twell-kernel"}
    _, result, where = row("the paper's published kernels, same protocol")
    starts(result, " / ".join(ratio(float(published[s])) for s in CASES[:3]) + ", wrong results on the heavy")
    assert "01_kernel_speedup.md" in where


def test_near_dense_and_whole_model_forward():
    rows = {(r["M"], r["nnz"], r["cap"]): r for r in _load(NEAR_DENSE)["rows"]}
    _, result, where = row("near-dense input")
    starts(result, f"{ratio(rows[8192, 1500, 'default']['slowdown'])} (M = 8192) and "
           f"{ratio(rows[65536, 1500, 'default']['slowdown'])} (M = 65536) the time of dense, exact")
    assert all(rows[k]["rel_err"] == 0 for k in rows if k[1] == 1500) and NEAR_DENSE.name in where
    ms = _load(CHOOSER)["forward_ms"]
    _, result, where = row("whole 8-layer model")
    assert result == (f"dense {rounded(ms['dense'], 1)} ms, sparse with per-layer path choice "
                      f"{rounded(ms['chooser'], 1)} ms ({ratio(ms['dense'] / ms['chooser'])})")
    assert CHOOSER.stem.split("-small8")[0] in where


def test_decoding_ffn():
    speed = {(r["case"], r["M"]): r["impls"]["decode-kernel"]["speedup"] for r in _load(DECODE_RECORD)["rows"]}
    _, result, where = row("decoding FFN, H200, 1 / 4 / 16 rows, nnz 29")
    at_one_row = [speed[c, 1] for c in ("nnz8", "nnz29", "nnz64")]
    starts(result, f"**{' / '.join(ratio(speed['nnz29', m]) for m in (1, 4, 16))}** dense "
           f"({span(at_one_row, 2)}x at one row for nnz 8-64), exact")
    assert DECODE_RECORD.name.replace(".json", ".md") in where


def _efficiency_records() -> list[dict]:
    """The model benchmarks notebook 04 tabulates in 04_efficiency.md (its gpu-small profile), in its order."""
    profiles = yaml.safe_load((ROOT / "configs" / "pipeline" / "04_efficiency.yaml").read_text())["profiles"]
    return [_load(ROOT / p) for p in profiles["gpu-small"]["results"]]


def _measure(res: dict, measure: str, batch: int) -> dict:
    (found,) = [r for r in res["rows"] if r["measure"] == measure and r["batch"] == batch]
    return found


def test_the_four_shapes_against_their_twins():
    recs = _efficiency_records()
    assert [r["model"]["label"].split()[0] for r in recs] == ["0p5b", "1b", "1p5b", "2b"]
    what, result, where = row("0.5B / 1B / 1.5B / 2B shapes trained here")
    active = [rounded(r["model"]["activity"]["sparse"]["active_frac"], 2, 100) for r in recs]
    assert f"({' / '.join(active)}% active)" in what
    prefill = [_measure(r, "prefill", 32) for r in recs]
    assert {p["seq"] for p in prefill} == {1024}
    energy = [rounded(p["sparse"]["joules_per_token"] / p["dense"]["joules_per_token"] - 1, 1, 100) + "%"
              for p in prefill]
    train = [_measure(r, "training", 8) for r in recs]
    saved = [1 - t["sparse"]["peak_bytes"] / t["dense"]["peak_bytes"] for t in train]
    starts(result,
           f"prefill at 32 x 1024 tokens **{' / '.join(ratio(p['speedup']) for p in prefill)}**, energy per token "
           f"**{' / '.join(energy)}**, training **{' / '.join(ratio(t['speedup']) for t in train)}** with "
           f"{span(saved, 0, 100)}% less peak memory")
    # The linked table was made from these records.
    assert "04_efficiency.md" in where
    with open(TABLES / "04_efficiency.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["scale"] for t in table] == [r["model"]["label"] for r in recs]
    for t, p, tr in zip(table, prefill, train):
        assert float(t["prefill gain %"]) == pytest.approx(100 * (p["speedup"] - 1), rel=1e-9)
        assert float(t["training gain %"]) == pytest.approx(100 * (tr["speedup"] - 1), rel=1e-9)


def test_greedy_decoding_under_cuda_graphs():
    small = _load(GRAPH_DECODE_0P5B)
    others = _efficiency_records()[1:]
    _, result, where = row("greedy decoding at batch 1 under CUDA graphs")
    scales = ", ".join(f"{name} **{ratio(_measure(r, 'decode-graph', 1)['speedup'])}**"
                       for name, r in zip(("1B", "1.5B", "2B"), others))
    starts(result, f"0.5B **{ratio(_measure(small, 'decode-graph', 1)['speedup'])}** (step compiled: "
           f"**{ratio(_measure(small, 'decode-compiled-graph', 1)['speedup'])}**), {scales};")
    assert GRAPH_DECODE_0P5B.stem in where


def test_training_ffn_and_the_published_training_kernels():
    cases = _ffn_cases(TRAIN_RECORD)
    train = [cases["train", 16384, s] for s in CASES]
    kernel = [c["impls"]["twell-train-kernel"] for c in train]
    # the published kernels timed in the same run (their own child process per case)
    published = [c["published"]["published-hybrid"] for c in train]
    _, result, where = row("training FFN (forward + backward + L1), H200, M = 16384")
    dense_mb = {mb(c["dense"]["peak_bytes_above_inputs"]) for c in train}
    assert len(dense_mb) == 1
    starts(result, f"**{' / '.join(ratio(k['speedup']) for k in kernel)}** dense "
                   f"({' / '.join(ratio(k['speedup_vs_compiled']) for k in kernel)} against compiled dense), exact")
    assert (f"peak memory {span([k['peak_bytes_above_inputs'] for k in kernel], 0, Decimal(1) / 2 ** 20)} MB "
            f"against {dense_mb.pop()} MB") in result
    assert all(p["ok"] for p in published[:3]) and not published[3]["ok"]
    assert f"published kernels in the same run {' / '.join(ratio(p['speedup']) for p in published[:3])}, wrong" in result
    assert TRAIN_RECORD.name.replace(".json", ".md") in where


def test_small_run_and_its_downstream_evaluation():
    runs = ROOT / "reports" / "runs"
    sparse, dense = (_load(runs / name / "summary.json")["final"] for name in ("small", "small_dense"))
    change = rounded(sparse["val_ce"] / dense["val_ce"] - 1, 1, 100)
    _, result, _ = row("`small` (2 layers of paper width)")
    assert result == (f"**{rounded(sparse['active_frac_mean'], 2, 100)}%** of FFN neurons active per token (dense "
                      f"ReLU twin: {rounded(dense['active_frac_mean'], 2, 100)}%); validation CE "
                      f"{rounded(sparse['val_ce'], 3)} against {rounded(dense['val_ce'], 3)} "
                      f"({'+' if not change.startswith('-') else ''}{change}%)")
    ev = {k: v["tasks"]["commonsense_qa"] for k, v in _load(EVAL_RUNS).items()}
    score = {k: f"{rounded(t['metrics']['acc']['value'], 1, 100)} ± {rounded(t['metrics']['acc']['stderr'], 1, 100)}"
             for k, t in ev.items()}
    what, result, where = row("CommonsenseQA, `small_v1` dense against sparse")
    assert f"{ev['dense']['n']} questions)" in what and ev["dense"]["n"] == ev["sparse"]["n"]
    starts(result, f"{score['dense']}% against {score['sparse']}%")
    # The linked table shows the same scores from the same runs.
    assert "03_downstream_eval.md" in where
    table = (TABLES / "03_downstream_eval.md").read_text()
    assert f"| commonsense_qa | acc | {ev['dense']['n']} | {score['dense']} | {score['sparse']} |" in table
    # Its tasks without a score are those the runs skipped, and it names no path of the machine that ran them.
    runs = _load(EVAL_RUNS)
    skipped = [t for t, r in runs["sparse"]["tasks"].items() if r["status"] != "ok"]
    assert f"Not evaluated (no score, not zero): {', '.join(skipped)}." in " ".join(table.split())
    assert "/work/" not in table and runs["sparse"]["source"].endswith("runs/small/final")


def test_records_from_a_tree_with_local_changes_say_so():
    """A record linked from the Results table whose code differs from its recorded commit says so in its row."""
    checked = 0
    for what, (_, where) in ROWS.items():
        for name in re.findall(r"\(reports/bench/([^)]+?)\.(?:json|md)\)", where):
            code = _load(BENCH / f"{name}.json").get("meta", {}).get("code") or {}
            dirty = code.get("dirty", code.get("matches_commit") is False)
            assert dirty == ("with local changes" in where), (what, name, code.get("matches_commit"))
            checked += 1
    assert checked >= 6  # the records linked by name: the FFN, training, decoding and decode-model ones
