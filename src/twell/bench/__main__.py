"""``python -m twell.bench ffn [...]``: the FFN benchmark of shared/BENCHMARK.md (see twell.bench.ffn);
``python -m twell.bench train-ffn [...]``: its training cases with the sparse training kernels;
``python -m twell.bench model CHECKPOINT [...]``: a whole model, dense against sparse (twell.bench.model);
``python -m twell.bench decode [...]``: the FFN at decoding sizes under CUDA graphs (twell.bench.decode);
``python -m twell.bench activity CHECKPOINT --tokens DIR [...]``: active FFN neurons per layer and per position of a
checkpoint (and its dense twin) on held-out tokens (twell.bench.activity);
``python -m twell.bench provenance FILE.json``: the commits whose code made a result (twell.bench.provenance)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from twell.bench.ffn import SHAPES, SPARSITY, BenchConfig, BenchRunner, exit_code, markdown_report, write_outputs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m twell.bench")
    sub = p.add_subparsers(dest="command", required=True)
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
    mo.add_argument("--prefill-batch", nargs="+", type=int, default=[8, 32])
    mo.add_argument("--seq", type=int, help="prefill and training sequence length (default min(2048, context))")
    mo.add_argument("--decode-batch", nargs="+", type=int, default=[1, 32])
    mo.add_argument("--prompt", type=int, default=512)
    mo.add_argument("--new-tokens", type=int, default=256)
    mo.add_argument("--train-batch", type=int, default=8, help="sequences per training step (0: no training rows)")
    mo.add_argument("--train-steps", type=int, default=5)
    mo.add_argument("--train-compile", action="store_true",
                    help="compile each decoder layer for the training rows (both sides), as train.compile does")
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
    mo.add_argument("--reps", type=int, default=10)
    mo.add_argument("--no-energy", action="store_true")
    mo.add_argument("--energy-seconds", type=float, default=2.0)
    mo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    mo.add_argument("--out", type=Path, help="output directory (default reports/bench)")
    mo.add_argument("--tag", default="")
    mo.add_argument("--quiet", action="store_true")
    de = sub.add_parser("decode", help="the FFN at decoding sizes (M = 1 .. 2048), dense against sparse, CUDA graphs",
                        description="twell.bench.decode: calibrated cases nnz8 / nnz29 / nnz64 at D 2048, H 5632.")
    from twell.bench.decode import add_arguments

    add_arguments(de)
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
    a.add_argument("--seq", type=int, help="tokens per sequence (default: the model's context, at most 1024)")
    a.add_argument("--max-tokens", type=int, help="at most this many tokens (default: every whole sequence)")
    a.add_argument("--batch", type=int, default=8, help="sequences per forward")
    a.add_argument("--bins", type=int, default=32, help="position bins of the binned profile")
    a.add_argument("--label", help="name of the result, e.g. 0.5B (default: the checkpoint's folder name)")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--out", type=Path, help="JSON file to write (default reports/bench/activity-<label>.json)")
    v = sub.add_parser("provenance", help="the commits whose code matches a benchmark JSON's meta.code",
                       description="Recomputes the csrc and package digests of the newest commits from git and "
                                   "lists those whose kernel sources match the JSON's (a run in a copy of the tree, as "
                                   "on the GPU machine, may record no commit or an older one: the digests are what "
                                   "ties it to a tree).")
    v.add_argument("json", type=Path, help="a benchmark JSON (reports/bench/ffn-*.json)")
    v.add_argument("--max-count", type=int, default=500, help="how many commits back to look (default 500)")
    return p


def _ffn_arguments(f: argparse.ArgumentParser) -> None:
    f.add_argument("--shapes", choices=SHAPES, default="all",
                   help="inference (includes the odd correctness shape and, with --checkpoint, the real cases), "
                        "odd, train, real (the checkpoint's layers only), or all (default)")
    f.add_argument("--cases", nargs="+", choices=list(SPARSITY), default=list(SPARSITY),
                   help="sparsity cases (nnz target, tail): " + ", ".join(f"{k}={v}" for k, v in SPARSITY.items()))
    f.add_argument("--M", nargs="+", type=int, help="inference token counts")
    f.add_argument("--D", type=int, help="hidden size")
    f.add_argument("--H", type=int, help="intermediate size")
    f.add_argument("--odd-M", type=int, help="token count of the odd shape")
    f.add_argument("--odd-H", type=int, help="intermediate size of the odd shape")
    f.add_argument("--train-M", type=int, help="token count of the training shape")
    f.add_argument("--impl", nargs="+", help="inference implementations: twell-kernel (one op, as SparseFFN runs "
                                             "it), twell-kernel-ops (gate op then fused op), twell-kernel-union "
                                             "(the one op with the fitted block-union rule), twell-reference "
                                             "(default: twell-kernel on CUDA, twell-reference on CPU)")
    f.add_argument("--train-impl", nargs="+", default=[], help="training implementations besides dense")
    f.add_argument("--reps", type=int, default=30)
    f.add_argument("--warmup", type=int, default=3)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--tol", type=float, default=1e-2, help="max relative Frobenius error vs dense")
    f.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    f.add_argument("--no-energy", action="store_true", help="skip the NVML energy loops")
    f.add_argument("--energy-seconds", type=float, default=2.0)
    f.add_argument("--no-memory", action="store_true")
    f.add_argument("--no-flush-l2", action="store_true", help="do not overwrite L2 before each timed call")
    f.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 context error")
    f.add_argument("--out", type=Path, help="output directory (default reports/bench)")
    f.add_argument("--tag", default="", help="suffix of the output file names")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    r = f.add_argument_group("real activations (BENCHMARK.md: the best input of all)")
    r.add_argument("--checkpoint", help="trained sparse checkpoint (directory or hub id): adds one case per "
                                        "SparseFFN layer on the inputs it receives from --tokens")
    r.add_argument("--tokens", help="prepared data directory (twell.data.prepare) or .npy of token ids")
    r.add_argument("--tokens-split", choices=("val", "train"), default="val")
    r.add_argument("--real-M", type=int, help="tokens per real case (default 65536 on CUDA, 256 on CPU)")
    r.add_argument("--real-seq", type=int, help="sequence length (default: the model's context, at most 1024)")
    r.add_argument("--real-layers", nargs="+", type=int, help="SparseFFN layer indices (default: all)")


def provenance_main(args: argparse.Namespace) -> int:
    from twell.bench.provenance import code_line, matching_commits

    try:
        code = json.loads(args.json.read_text())["meta"].get("code")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"error: cannot read meta of {args.json}: {exc!r}") from None
    if not isinstance(code, dict) or not code.get("csrc"):
        raise SystemExit(f"error: {args.json} records no code digests (written before they were added)")
    print(code_line(code))
    try:
        found = matching_commits(code, max_count=args.max_count)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
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
        raise SystemExit(f"error: {exc}") from None
    if args.out is None:
        from twell.paths import reports_dir

        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        out = reports_dir("bench") / f"activity-{slug}.json"
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


def _out_dir(args: argparse.Namespace) -> Path:
    """--out, else reports/bench/."""
    if args.out is not None:
        return args.out
    from twell.paths import reports_dir

    return reports_dir("bench")


def _show(markdown: str, paths: tuple[Path, Path]) -> None:
    print(markdown)
    print("\n".join(f"wrote {p}" for p in paths))


def decode_main(args: argparse.Namespace) -> int:
    from twell.bench.decode import config_from_args, markdown_report, run_decode_bench, write_outputs

    try:
        result = run_decode_bench(config_from_args(args), progress=not args.quiet)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    _show(markdown_report(result), write_outputs(result, _out_dir(args), args.tag))
    if result["failures"]:
        print("\nFAILURES:\n  " + "\n  ".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


def model_main(args: argparse.Namespace) -> int:
    from twell.bench.model import ModelBenchConfig, markdown_report, run_model_bench, write_outputs

    cfg = ModelBenchConfig(
        checkpoint=args.checkpoint, dense_checkpoint=args.dense_checkpoint, label=args.label, device=args.device,
        sparse_path=args.sparse_path, prefill_batches=tuple(args.prefill_batch), seq_len=args.seq,
        decode_batches=tuple(args.decode_batch), prompt_len=args.prompt, new_tokens=args.new_tokens,
        train_batch=args.train_batch, train_steps=args.train_steps, train_compile=args.train_compile, reps=args.reps, energy=not args.no_energy,
        energy_seconds=args.energy_seconds, tokens=args.tokens, decode_static=not args.no_static_decode, decode_graph=not args.no_graph_decode,
        decode_compile=args.compiled_graph_decode, token_check=not args.no_token_check)
    try:
        res = run_model_bench(cfg, progress=not args.quiet)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None
    out_dir = _out_dir(args)
    _show(markdown_report(res), write_outputs(res, out_dir, args.tag))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "provenance":
        return provenance_main(args)
    if args.command == "model":
        return model_main(args)
    if args.command == "activity":
        return activity_main(args)
    if args.command == "decode":
        return decode_main(args)
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    cfg = BenchConfig(
        device=args.device, shapes=args.shapes, cases=tuple(args.cases), Ms=tuple(args.M) if args.M else None,
        D=args.D, H=args.H, odd_M=args.odd_M, odd_H=args.odd_H, train_M=args.train_M,
        impls=tuple(args.impl) if args.impl is not None and (args.impl or args.command == "train-ffn") else None, train_impls=tuple(args.train_impl), reps=args.reps,
        warmup=args.warmup, seed=args.seed, tol=args.tol, energy=not args.no_energy,
        energy_seconds=args.energy_seconds, memory=not args.no_memory, flush_l2=not args.no_flush_l2,
        fp32_check=not args.no_fp32_check, out=args.out, tag=args.tag, checkpoint=args.checkpoint,
        tokens=args.tokens, tokens_split=args.tokens_split, real_M=args.real_M, real_seq=args.real_seq,
        real_layers=tuple(args.real_layers) if args.real_layers else None)
    try:
        runner = BenchRunner(cfg, progress=not args.quiet)
        runner.capture()  # a bad checkpoint or token file fails here, before any measurement
        if args.checkpoint and runner.captured is None:
            print(f"WARNING: --shapes {args.shapes} takes no real case: --checkpoint is not used", file=sys.stderr)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None
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
