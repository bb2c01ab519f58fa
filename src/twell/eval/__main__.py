"""Downstream evaluation from the shell, one model per process (so two models can run on two GPUs at once):

``python -m twell.eval run CHECKPOINT --name sparse --out sparse.json [--tasks piqa commonsense_qa] [--limit N]``
    lm-eval on one checkpoint (twell.eval.harness.evaluate_checkpoints, offline, local task files from
    ``<shared data>/eval`` by default), written as an :class:`~twell.eval.harness.EvalRun` JSON with the
    per-document log-likelihoods (for the paired comparison). Exit status 2 when a task was skipped (no
    data) unless ``--allow-skipped``.
``python -m twell.eval compare DENSE.json SPARSE.json --out DIR [--stem NAME]``
    the dense/sparse table, markdown and chart of notebook 03 (twell.eval.tables.write_comparison) from two
    such files, the first as the baseline; prints the markdown.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twell.eval.errors import CheckpointLoadError

TASKS = ("piqa", "commonsense_qa")  # the tasks whose data ships offline (../shared/data/eval)


def parse_limit(text: str | None) -> int | float | None:
    """``"none"`` / None -> None, ``"200"`` -> 200, ``"0.1"`` -> 0.1 (lm-eval's fraction); else ValueError."""
    if text is None or str(text).strip().lower() in ("", "none", "all", "null"):
        return None
    value = float(text)
    limit = int(value) if value >= 1 and value == int(value) else value
    from twell.eval.harness import check_limit

    check_limit(limit)
    return limit


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m twell.eval", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="evaluate one checkpoint, write its EvalRun JSON")
    r.add_argument("checkpoint", help="Hugging Face checkpoint directory (runs/<run>/final) or hub id")
    r.add_argument("--name", required=True, help="name of the run in tables (e.g. dense, sparse)")
    r.add_argument("--out", type=Path, required=True, help="EvalRun JSON to write")
    r.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"lm-eval tasks (default {' '.join(TASKS)})")
    r.add_argument("--limit", default=None, help="documents per task: a count, a fraction, or none (default: all)")
    r.add_argument("--ffn-path", choices=("dense", "reference", "kernel", "auto"),
                   help="FFN path (default: dense for a name containing 'dense', else auto)")
    r.add_argument("--data-dir", default="auto", help="directory of <task>/<split>.jsonl (default: <shared data>/eval)")
    r.add_argument("--device", default="auto")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--batch-size", default="auto", help="lm-eval batch size: auto (CUDA) or a number")
    r.add_argument("--online", action="store_true", help="allow the hub for tasks without local data")
    r.add_argument("--allow-skipped", action="store_true", help="exit 0 even when a task had no data")
    c = sub.add_parser("compare", help="dense/sparse table and chart from two EvalRun JSONs")
    c.add_argument("baseline", type=Path, help="EvalRun JSON of the baseline (the dense model)")
    c.add_argument("other", type=Path, help="EvalRun JSON compared with it (the sparse model)")
    c.add_argument("--out", type=Path, required=True, help="root of tables/ and figures/")
    c.add_argument("--stem", default="downstream_eval", help="file name stem")
    return p


def run_main(args: argparse.Namespace) -> int:
    from twell.eval.harness import evaluate_checkpoints
    from twell.eval.loading import resolve_device

    limit = parse_limit(args.limit)
    batch_size = args.batch_size if str(args.batch_size).startswith("auto") else int(args.batch_size)
    data_dir = None if args.data_dir == "none" else args.data_dir
    runs = evaluate_checkpoints({args.name: args.checkpoint}, tasks=args.tasks, limit=limit, data_dir=data_dir,
                                ffn_paths={args.name: args.ffn_path} if args.ffn_path else None,
                                device=resolve_device(args.device), dtype=args.dtype, batch_size=batch_size,
                                offline=not args.online, log_samples=True, progress=False)
    run = runs[args.name]
    run.save_json(args.out)
    skipped = []
    for task, res in run.tasks.items():
        if res.status != "ok":
            skipped.append(task)
            print(f"{args.name} {task}: skipped: {res.reason}")
            continue
        scores = ", ".join(f"{m} {v['value']:.4f} +- {v['stderr']:.4f}" for m, v in res.metrics.items())
        print(f"{args.name} {task}: n {res.n}/{res.n_total}, {scores} ({res.source})")
    print(f"{args.name}: FFN paths run {run.ffn_paths_observed}, {run.seconds:.1f} s, batch {run.batch_size_note}; "
          f"wrote {args.out}")
    if skipped and not args.allow_skipped:
        print(f"error: tasks {skipped} were skipped (no data): put their files under <shared data>/eval/<task>/ "
              "(TWELL_SHARED_DATA) or pass --data-dir, or --allow-skipped", file=sys.stderr)
        return 2
    return 0


def compare_main(args: argparse.Namespace) -> int:
    from twell.eval.harness import EvalRun
    from twell.eval.tables import write_comparison

    base, other = EvalRun.load_json(args.baseline), EvalRun.load_json(args.other)
    if base.name == other.name:
        raise SystemExit(f"error: both runs are named {base.name!r}; evaluate them with different --name")
    out = write_comparison({base.name: base, other.name: other}, baseline=base.name, other=other.name,
                           stem=args.stem, reports_root=args.out, include_samples=False)
    print(out["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in out.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run_main(args) if args.command == "run" else compare_main(args)
    except (ValueError, FileNotFoundError, CheckpointLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
