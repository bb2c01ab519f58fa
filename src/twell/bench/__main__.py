"""``python -m twell.bench ffn [...]``: the FFN benchmark of shared/BENCHMARK.md (see twell.bench.ffn);
``python -m twell.bench train-ffn [...]``: its training cases with the sparse training kernels;
``python -m twell.bench model CHECKPOINT [...]``: a whole model, dense against sparse (twell.bench.model);
``python -m twell.bench decode [...]``: the FFN at decoding sizes under CUDA graphs (twell.bench.decode);
``python -m twell.bench activity CHECKPOINT --tokens DIR [...]``: active FFN neurons per layer and per position of a
checkpoint (and its dense twin) on held-out tokens (twell.bench.activity);
``python -m twell.bench synthetic --shape NAME --active A --out DIR``: a random-weight checkpoint of a public model's
shape, its FATReLU gates calibrated to an activity, for ``model`` (twell.model.synthetic);
``python -m twell.bench provenance FILE.json``: the commits whose code made a result (twell.bench.provenance)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from twell.bench.ffn import (DEFAULT_CASES, SHAPES, SPARSITY, BenchConfig, BenchRunner, exit_code, markdown_report,
                             write_outputs)
from twell.cli import (check_args, check_checkpoint_files, check_kernels, check_output_dir, check_output_file, fail,
                       fraction, non_negative_int, positive_float, positive_int, torch_device)
from twell.paths import SMOKE_PROFILE, reports_root

PROG = "python -m twell.bench"
_DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_OUT_HELP = ("output directory (default reports/bench/ on CUDA, reports/smoke/bench/ otherwise; $TWELL_REPORTS/bench/ "
             "when set)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmarks of the sparse (TwELL) FFN against dense: the FFN alone (ffn, train-ffn, decode), a\n"
                    "whole model (model), a checkpoint's FFN activity (activity), and the commits whose code made a\n"
                    "result (provenance).",
        epilog="Results go to reports/bench/ from a CUDA run and to reports/smoke/bench/ (git-ignored) from any\n"
               "other, so that a CPU run never lands beside the committed GPU results; $TWELL_REPORTS replaces\n"
               "reports/ and --out names the directory. Exit status 2: bad input (for ffn also an\n"
               "implementation that could not run); 1: a failed correctness check (provenance: no matching\n"
               "commit). See COMMAND --help.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    f = sub.add_parser("ffn", help="dense vs sparse gated FFN: correctness, time, energy, memory",
                       description="Defaults: protocol shapes on CUDA (M 8192/65536/131072, D 2048, H 5632, "
                                   "odd shape 12345 x 5600, training M 16384); tiny shapes on CPU.")
    _ffn_arguments(f)
    t = sub.add_parser("train-ffn", help="the training FFN (forward + backward + L1) against dense: time, memory",
                       description="python -m twell.bench ffn --shapes train --train-impl twell-train-kernel: "
                                   "M 16384, D 2048, H 5632, cases nnz8 / nnz29 / nnz64 / nnz29-heavy on CUDA.")
    _ffn_arguments(t)
    t.set_defaults(shapes="train", train_impl=["twell-train-kernel"], impl=[])
    mo = sub.add_parser("model", help="a whole model, dense against sparse: prefill, decode, energy, memory, training",
                        description="twell.bench.model: a trained sparse checkpoint (directory or hub id) against its "
                                    "dense twin (--dense-checkpoint) or its own dense path.")
    mo.add_argument("checkpoint", help="sparse checkpoint: a Hugging Face directory (runs/<run>/final) or hub id")
    mo.add_argument("--dense-checkpoint", help="the dense twin (default: the same checkpoint on the dense path)")
    mo.add_argument("--label", help="name of the row, e.g. 0.5B (default: the checkpoint's folder name)")
    mo.add_argument("--tokens", help="prepared data directory or .npy of token ids (default: random ids, labelled)")
    mo.add_argument("--prefill-batch", nargs="+", type=positive_int, default=[8, 32])
    mo.add_argument("--seq", type=positive_int,
                    help="prefill and training sequence length (default min(2048, context))")
    mo.add_argument("--decode-batch", nargs="+", type=positive_int, default=[1, 32])
    mo.add_argument("--prompt", type=positive_int, default=512)
    mo.add_argument("--new-tokens", type=positive_int, default=256)
    mo.add_argument("--train-batch", type=non_negative_int, default=8,
                    help="sequences per training step (0: no training rows)")
    mo.add_argument("--train-steps", type=positive_int, default=5)
    mo.add_argument("--train-compile", action="store_true",
                    help="compile each decoder layer for the training rows (both sides), as train.compile does")
    mo.add_argument("--train-max-active", type=fraction, metavar="FRACTION",
                    help="the sparse side's training threshold, a fraction of H (default: timed, as "
                         "python -m twell.train's train.sparse_max_active auto); 1 trains every layer sparse")
    mo.add_argument("--train-hot", type=fraction, metavar="MIN_FREQ",
                    help="the sparse side's layers on the kernels compute their hot neurons (active on at least "
                         "MIN_FREQ of the step's rows, counted on its tokens) as dense columns (default: none)")
    mo.add_argument("--train-routes", default="activity", choices=["activity", "timed"],
                    help="the sparse side's training routes: by the activity threshold, as python -m twell.train "
                         "sets them (default), or timed per layer on its own rows (dense, the op, and with "
                         "--train-hot the op with the layer's hot neurons; GPU)")
    mo.add_argument("--sparse-path", default="auto", choices=["auto", "kernel", "reference"])
    mo.add_argument("--no-static-decode", action="store_true",
                    help="skip the decode rows with a static KV cache (compiled: CUDA graphs)")
    mo.add_argument("--no-graph-decode", action="store_true",
                    help="skip the decode rows whose steps replay one CUDA graph each")
    mo.add_argument("--compiled-graph-decode", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="one more decode row per batch: each step compiled (torch.compile backend, default "
                         "inductor) and replayed from one CUDA graph")
    mo.add_argument("--no-token-check", action="store_true",
                    help="skip the greedy-token comparison of the sparse weights on the sparse and dense paths")
    mo.add_argument("--reps", type=positive_int, default=10)
    mo.add_argument("--no-energy", action="store_true")
    mo.add_argument("--energy-seconds", type=positive_float, default=2.0)
    mo.add_argument("--device", type=torch_device, default=_DEFAULT_DEVICE)
    mo.add_argument("--out", type=Path, help=_OUT_HELP)
    mo.add_argument("--tag", default="", help="suffix of the output file names")
    mo.add_argument("--quiet", action="store_true", help="no progress bar")
    _allow_dirty_argument(mo)
    de = sub.add_parser("decode", help="the FFN at decoding sizes (M = 1 .. 2048), dense against sparse, CUDA graphs",
                        description="twell.bench.decode: calibrated cases nnz8 / nnz29 / nnz64 at D 2048, H 5632.")
    from twell.bench.decode import add_arguments

    add_arguments(de)
    _allow_dirty_argument(de)
    a = sub.add_parser("activity", help="active FFN neurons per layer and per position on held-out tokens",
                       description="twell.bench.activity.checkpoint_activity: a checkpoint (and --dense-checkpoint, "
                                   "its dense twin) on consecutive blocks of a prepared split, every FFN on its "
                                   "dense path; one JSON with both.")
    a.add_argument("checkpoint", help="sparse checkpoint: a Hugging Face directory (runs/<run>/final) or hub id")
    a.add_argument("--dense-checkpoint", help="its dense twin, measured the same way")
    a.add_argument("--tokens", required=True, help="prepared data directory (the run's summary.json: data.prepared_dir) "
                                                   "or .npy of token ids")
    a.add_argument("--split", choices=("val", "train"), default="val", help="split of a prepared directory (val: "
                                                                             "held-out documents)")
    a.add_argument("--seq", type=positive_int,
                   help="tokens per sequence (default: the model's context, at most 1024)")
    a.add_argument("--max-tokens", type=positive_int, help="at most this many tokens (default: every whole sequence)")
    a.add_argument("--batch", type=positive_int, default=8, help="sequences per forward")
    a.add_argument("--bins", type=positive_int, default=32, help="position bins of the binned profile")
    a.add_argument("--label", help="name of the result, e.g. 0.5B (default: the checkpoint's folder name)")
    a.add_argument("--device", type=torch_device, default=_DEFAULT_DEVICE)
    a.add_argument("--out", type=Path, help="JSON file to write (default activity-<label>.json in the directory "
                                            "that --out of the other commands defaults to)")
    sy = sub.add_parser("synthetic", help="a random-weight checkpoint of a public model's shape, gates calibrated",
                        description="twell.model.synthetic: transformers' Llama initialisation, then each FATReLU "
                                    "layer's gate weights scaled so that --active of its neurons pass the model's "
                                    "threshold on random tokens; saved in bf16 in the format's config.")
    from twell.model.synthetic import SHAPES as MODEL_SHAPES

    sy.add_argument("--shape", required=True, choices=sorted(MODEL_SHAPES))
    sy.add_argument("--active", type=fraction, default=0.11, help="fraction of neurons active per layer (default 0.11)")
    sy.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    sy.add_argument("--seed", type=non_negative_int, default=0)
    sy.add_argument("--calib-tokens", type=positive_int, default=2048, help="random tokens the gates are calibrated on")
    sy.add_argument("--device", type=torch_device, default=_DEFAULT_DEVICE)
    sy.add_argument("--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("provenance", help="the commits whose code matches a benchmark JSON's meta.code",
                       description="Recomputes the csrc and package digests of the newest commits from git and "
                                   "lists those whose kernel sources match the JSON's (a run in a copy of the tree, as "
                                   "on the GPU machine, may record no commit or an older one: the digests are what "
                                   "ties it to a tree).")
    v.add_argument("json", type=Path, help="a benchmark JSON (reports/bench/ffn-*.json)")
    v.add_argument("--max-count", type=positive_int, default=500, help="how many commits back to look (default 500)")
    for command in sub.choices.values():  # its own usage line for the checks after parsing (_check_common)
        command.set_defaults(subparser=command)
    return p


def _ffn_arguments(f: argparse.ArgumentParser) -> None:
    f.add_argument("--shapes", choices=SHAPES, default="all",
                   help="inference (includes the odd correctness shape and, with --checkpoint, the real cases), "
                        "odd, train, real (the checkpoint's layers only), or all (default)")
    f.add_argument("--cases", nargs="+", choices=list(SPARSITY), default=list(DEFAULT_CASES),
                   help="sparsity cases (nnz target, tail): " + ", ".join(f"{k}={v}" for k, v in SPARSITY.items()))
    f.add_argument("--M", nargs="+", type=positive_int, help="inference token counts")
    f.add_argument("--D", type=positive_int, help="hidden size")
    f.add_argument("--H", type=positive_int, help="intermediate size")
    f.add_argument("--odd-M", type=positive_int, help="token count of the odd shape")
    f.add_argument("--odd-H", type=positive_int, help="intermediate size of the odd shape")
    f.add_argument("--train-M", type=positive_int, help="token count of the training shape")
    f.add_argument("--impl", nargs="+", help="inference implementations: twell-kernel (one op, as SparseFFN runs "
                                             "it), twell-kernel-ops (gate op then fused op), twell-kernel-union "
                                             "(the one op with the fitted block-union rule), twell-reference "
                                             "(default: twell-kernel on CUDA, twell-reference on CPU)")
    f.add_argument("--train-impl", nargs="+", default=[], help="training implementations besides dense")
    f.add_argument("--reps", type=positive_int, default=30)
    f.add_argument("--warmup", type=non_negative_int, default=3)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--tol", type=positive_float, default=1e-2, help="max relative Frobenius error vs dense")
    f.add_argument("--device", type=torch_device, default=_DEFAULT_DEVICE)
    f.add_argument("--no-energy", action="store_true", help="skip the NVML energy loops")
    f.add_argument("--energy-seconds", type=positive_float, default=2.0)
    f.add_argument("--no-memory", action="store_true")
    f.add_argument("--no-flush-l2", action="store_true", help="do not overwrite L2 before each timed call")
    f.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 context error")
    f.add_argument("--out", type=Path, help=_OUT_HELP)
    f.add_argument("--tag", default="", help="suffix of the output file names")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    _allow_dirty_argument(f)
    from twell.bench.published import dir_argument

    f.add_argument("--published", metavar="DIR", type=dir_argument,
                   help="also time the paper's published kernels from DIR (a SakanaAI/sparser-faster-llms checkout "
                        "holding custom_models/): published-twell (inference), published-hybrid (training), each "
                        "case in a child process beside dense and ours, crashes and wrong results recorded")
    r = f.add_argument_group("real activations (BENCHMARK.md: the best input of all)")
    r.add_argument("--checkpoint", help="trained sparse checkpoint (directory or hub id): adds one case per "
                                        "SparseFFN layer on the inputs it receives from --tokens")
    r.add_argument("--tokens", help="prepared data directory (twell.data.prepare) or .npy of token ids")
    r.add_argument("--tokens-split", choices=("val", "train"), default="val")
    r.add_argument("--real-M", type=positive_int, help="tokens per real case (default 65536 on CUDA, 256 on CPU)")
    r.add_argument("--real-seq", type=positive_int, help="sequence length (default: the model's context, at most 1024)")
    r.add_argument("--real-layers", nargs="+", type=non_negative_int, help="SparseFFN layer indices (default: all)")


def _allow_dirty_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-dirty", action="store_true",
                   help="record a GPU run from a tree with local changes (marked as such) instead of refusing it")


# What twell.bench.decode's own options must satisfy (its add_arguments gives them no types).
_DECODE_TYPES = {"M": positive_int, "D": positive_int, "H": positive_int, "reps": positive_int,
                 "warmup": non_negative_int, "tol": positive_float, "energy_M": positive_int,
                 "energy_seconds": positive_float, "device": torch_device}


def _check_common(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks of the options every command shares, before anything is loaded or measured."""
    if args.command == "decode":
        check_args(parser, args, _DECODE_TYPES)
    tag = getattr(args, "tag", "")
    if tag in (".", "..") or any(c in tag for c in "/\\"):
        parser.error(f"argument --tag: {tag!r} would be a path; use letters, digits, '-', '_' or '.'")
    try:
        if args.command == "activity":
            check_output_file(args.out)
        elif args.command != "provenance":
            check_output_dir(args.out)
        for option in ("checkpoint", "dense_checkpoint"):
            check_checkpoint_files(getattr(args, option, None))
    except ValueError as exc:
        fail(f"{PROG} {args.command}", str(exc))


def provenance_main(args: argparse.Namespace) -> int:
    from twell.bench.provenance import code_line, matching_commits

    try:
        code = json.loads(args.json.read_text())["meta"].get("code")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        fail(f"{PROG} provenance", f"cannot read meta of {args.json}: {why}")
    if not isinstance(code, dict) or not code.get("csrc"):
        fail(f"{PROG} provenance", f"{args.json} records no code digests (written before they were added)")
    print(code_line(code))
    try:
        found = matching_commits(code, max_count=args.max_count)
    except ValueError as exc:
        fail(f"{PROG} provenance", str(exc))
    if not found:
        print(f"no commit among the newest {args.max_count} has these kernel sources")
        return 1
    for commit, subject, package in found:
        print(f"{commit[:10]}  kernels {'and package ' if package else ''}match  {subject[:90]}")
    return 0


def activity_main(args: argparse.Namespace) -> int:
    import datetime as dt

    from twell.bench.activity import checkpoint_activity
    from twell.bench.provenance import provenance

    ck = Path(str(args.checkpoint).rstrip("/"))
    label = args.label or (ck.parent.name if ck.name == "final" and ck.parent.name else ck.name)
    models = {"sparse": args.checkpoint, **({"dense": args.dense_checkpoint} if args.dense_checkpoint else {})}
    res = {"label": label, "meta": {
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if str(args.device).startswith("cuda") else "cpu",
        "torch": torch.__version__, "code": provenance(),
        "note": "every FFN on its dense path with tracking: activity counted from the exact ReLU gate (bf16)"},
        "models": {}}
    try:
        for side, path in models.items():
            res["models"][side] = checkpoint_activity(path, args.tokens, seq=args.seq, max_tokens=args.max_tokens,
                                                      split=args.split, device=args.device, batch=args.batch,
                                                      bins=args.bins)
    except (ValueError, FileNotFoundError) as exc:
        fail(f"{PROG} activity", str(exc))
    if args.out is None:
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        out = _default_out(args.device) / f"activity-{slug}.json"
    else:
        out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(activity_table(res))
    print(f"wrote {out}")
    return 0


def activity_table(res: dict) -> str:
    """Markdown: active neurons per token (% of H) per layer, and at the first / middle / last position bin."""
    sides = list(res["models"])
    first = res["models"][sides[0]]
    lines = [f"# FFN activity: {res['label']} ({first['sequences']} x {first['seq']} {first['data'].get('split', '')} "
             f"tokens)", "", "| layer | " + " | ".join(f"{s} % of H | {s} first / mid / last bin %" for s in sides)
             + " |", "|---" * (1 + 2 * len(sides)) + "|"]
    for layer in range(first["layers"]):
        cells = []
        for s in sides:
            m = res["models"][s]
            pos = m["positions"]["active"][layer]
            pct = [100 * v / m["intermediate_size"] for v in (pos[0], pos[len(pos) // 2], pos[-1])]
            cells += [f"{100 * m['active_frac_per_layer'][layer]:.2f}", " / ".join(f"{v:.2f}" for v in pct)]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines.append("| mean | " + " | ".join(f"{100 * res['models'][s]['active_frac_mean']:.2f} | CE "
                                          f"{res['models'][s]['ce']:.4f}" for s in sides) + " |")
    return "\n".join(lines)


def _default_out(device: str) -> Path:
    """reports/bench/ for a CUDA run; reports/smoke/bench/ (git-ignored, as the pipeline's smoke profile writes)
    for any other, whose tiny shapes must not land beside the committed GPU results. $TWELL_REPORTS replaces
    reports/ in both."""
    on_cuda = torch.device(device).type == "cuda"
    path = reports_root(None if on_cuda else SMOKE_PROFILE) / "bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _out_dir(args: argparse.Namespace) -> Path:
    """--out, else the default for the run's device."""
    return args.out if args.out is not None else _default_out(args.device)


def _show(markdown: str, paths: tuple[Path, Path]) -> None:
    print(markdown)
    print("\n".join(f"wrote {p}" for p in paths))


# On CPU the sparse implementations run the PyTorch reference path (decode-kernel's and auto's), about 5 to 8
# times a dense call at D 2048, H 5632 and any M; on CUDA the kernels take at most about a dense call.
_CPU_REFERENCE_COST = 7.0


def _dense_call_seconds(M: int, D: int, H: int, device: torch.device) -> float:
    """One dense gated-FFN call on random bf16 inputs of the benchmark's shape (the estimate's unit)."""
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)
    x, w_gate, w_up, w_down = (torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)
                               for shape in ((M, D), (H, D), (H, D), (D, H)))

    def call():
        with torch.no_grad():
            F.linear(F.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for _ in range(2):  # the second without the first call's set-up (allocation, library plans) ...
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if times[-1] > 0.2:  # ... unless the call is long enough that its set-up hardly counts
            break
    return min(times)


def decode_estimate(cfg) -> float:
    """Rough seconds of a decode benchmark: per case, its reps, warm-up and checked call of dense and of each
    sparse implementation that runs at that M, from one timed dense call per M; plus the energy loops on CUDA.
    Input generation, CUDA graph capture and a first build of the kernels are not counted."""
    from twell.reference.decode import DECODE_MAX_ROWS

    device = torch.device(cfg.device)
    on_cuda = device.type == "cuda"
    _dense_call_seconds(1, 64, 64, device)  # the libraries' one-time start (cuBLAS handle, thread pools)
    total = 0.0
    for M in sorted(set(int(m) for m in cfg.rows)):
        sparse = [i for i in cfg.impls if not (i == "decode-kernel" and M > DECODE_MAX_ROWS)
                  and not (i == "twell-kernel" and not on_cuda)]
        per_call = _dense_call_seconds(M, cfg.D, cfg.H, device)
        case = (cfg.reps + cfg.warmup + 1) * per_call * (1 + len(sparse) * (1.0 if on_cuda else _CPU_REFERENCE_COST))
        if on_cuda and M in cfg.energy_rows:
            case += cfg.energy_seconds * (1 + len(sparse))
        total += case * sum(1 for m in cfg.rows if int(m) == M)
    if on_cuda:
        torch.cuda.empty_cache()  # the benchmark starts from the memory it would have found
    return total * len(cfg.cases)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def decode_plan_line(cfg, seconds: float) -> str:
    n = len(cfg.cases) * len(cfg.rows)
    line = (f"decode bench: {n} cases ({len(cfg.cases)} sparsity cases x {len(cfg.rows)} M: "
            f"{' '.join(map(str, cfg.rows))}), dense and {len(cfg.impls)} implementation(s), {cfg.reps} reps + "
            f"{cfg.warmup} warm-up calls each, on {cfg.device}: roughly {_duration(seconds)}")
    if torch.device(cfg.device).type != "cuda":
        line += " (CPU: the sparse reference path; the largest M take most of it)"
    return line


def decode_main(args: argparse.Namespace) -> int:
    from twell.bench.decode import config_from_args, markdown_report, run_decode_bench, write_outputs

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        fail(f"{PROG} decode", str(exc))
    # Said before the first case: on CPU the defaults take many minutes.
    print(decode_plan_line(cfg, decode_estimate(cfg)), file=sys.stderr, flush=True)
    try:
        result = run_decode_bench(cfg, progress=not args.quiet, allow_dirty=args.allow_dirty)
    except ValueError as exc:
        fail(f"{PROG} decode", str(exc))
    _show(markdown_report(result), write_outputs(result, _out_dir(args), args.tag))
    if result["failures"]:
        print("\nFAILURES:\n  " + "\n  ".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


def model_main(args: argparse.Namespace) -> int:
    from twell.bench.model import ModelBenchConfig, markdown_report, run_model_bench, write_outputs

    try:
        cfg = ModelBenchConfig(
            checkpoint=args.checkpoint, dense_checkpoint=args.dense_checkpoint, label=args.label, device=args.device,
            sparse_path=args.sparse_path, prefill_batches=tuple(args.prefill_batch), seq_len=args.seq,
            decode_batches=tuple(args.decode_batch), prompt_len=args.prompt, new_tokens=args.new_tokens,
            train_batch=args.train_batch, train_steps=args.train_steps, train_compile=args.train_compile,
            train_max_active=args.train_max_active, train_hot=args.train_hot, train_routes=args.train_routes,
            reps=args.reps, energy=not args.no_energy, energy_seconds=args.energy_seconds, tokens=args.tokens,
            decode_static=not args.no_static_decode, decode_graph=not args.no_graph_decode,
            decode_compile=args.compiled_graph_decode, token_check=not args.no_token_check)
        if args.sparse_path == "kernel":
            check_kernels("--sparse-path kernel", args.device, "--sparse-path reference")
        res = run_model_bench(cfg, progress=not args.quiet, allow_dirty=args.allow_dirty)
    except (ValueError, FileNotFoundError) as exc:
        fail(f"{PROG} model", str(exc))
    out_dir = _out_dir(args)
    _show(markdown_report(res), write_outputs(res, out_dir, args.tag))
    return 0


def synthetic_main(args) -> int:
    from twell.model.synthetic import synthetic_checkpoint

    try:
        info = synthetic_checkpoint(args.shape, args.out, args.active, seed=args.seed, device=args.device,
                                    calib_tokens=args.calib_tokens, progress=not args.quiet)
    except ValueError as exc:
        fail(f"{PROG} synthetic", str(exc))
    a = info["measured_active"]
    print(f"{args.out}: {args.shape}, {len(a)} layers, active {min(a):.4f} .. {max(a):.4f} "
          f"(target {args.active}) on {info['calib_tokens']} random tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_common(args.subparser, args)
    if args.command == "provenance":
        return provenance_main(args)
    if args.command == "model":
        return model_main(args)
    if args.command == "activity":
        return activity_main(args)
    if args.command == "decode":
        return decode_main(args)
    if args.command == "synthetic":
        return synthetic_main(args)
    cfg = BenchConfig(
        device=args.device, shapes=args.shapes, cases=tuple(args.cases), Ms=tuple(args.M) if args.M else None,
        D=args.D, H=args.H, odd_M=args.odd_M, odd_H=args.odd_H, train_M=args.train_M,
        impls=tuple(args.impl) if args.impl is not None and (args.impl or args.command == "train-ffn") else None, train_impls=tuple(args.train_impl), reps=args.reps,
        warmup=args.warmup, seed=args.seed, tol=args.tol, energy=not args.no_energy,
        energy_seconds=args.energy_seconds, memory=not args.no_memory, flush_l2=not args.no_flush_l2,
        fp32_check=not args.no_fp32_check, out=args.out, tag=args.tag, checkpoint=args.checkpoint,
        tokens=args.tokens, tokens_split=args.tokens_split, real_M=args.real_M, real_seq=args.real_seq,
        real_layers=tuple(args.real_layers) if args.real_layers else None, published=args.published)
    try:
        runner = BenchRunner(cfg, progress=not args.quiet, allow_dirty=args.allow_dirty)
        runner.capture()  # a bad checkpoint or token file fails here, before any measurement
        if args.checkpoint and runner.captured is None:
            print(f"WARNING: --shapes {args.shapes} takes no real case: --checkpoint is not used", file=sys.stderr)
    except (ValueError, FileNotFoundError) as exc:
        fail(f"{PROG} {args.command}", str(exc))
    for name, why in runner.unavailable.items():
        print(f"WARNING: implementation {name!r} unavailable: {why}", file=sys.stderr)
    out_dir = _out_dir(args)
    # Results so far are written after every case, so a run cut short still leaves its numbers.
    result = runner.run(on_case=lambda partial: write_outputs(partial, out_dir, args.tag))
    _show(markdown_report(result), write_outputs(result, out_dir, args.tag))
    code = exit_code(result)
    if code == 1:
        print(f"\nCORRECTNESS FAILURES ({len(result['failures'])}):\n  " + "\n  ".join(result["failures"]),
              file=sys.stderr)
    elif code == 2:
        print("\nsome requested implementations were unavailable (see above): exit 2", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
