"""Downstream evaluation from the shell, one model per process (so two models can run on two GPUs at once):

``python -m twell.eval run CHECKPOINT --name sparse --out sparse.json [--tasks piqa ...] (default: the seven tasks of the paper) [--limit N]``
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

from twell.cli import (check_checkpoint_files, check_kernels, check_output_dir, check_output_file, fail, report,
                       torch_device)
from twell.eval.errors import CheckpointLoadError
from twell.eval.tasks import PAPER_TASKS

PROG = "python -m twell.eval"
TASKS = PAPER_TASKS  # the paper's seven tasks; their data ships offline (../shared/data/eval)


def parse_limit(text: str | None) -> int | float | None:
    """``"none"`` / None -> None, ``"200"`` -> 200, ``"0.1"`` -> 0.1 (lm-eval's fraction); else ValueError."""
    if text is None or str(text).strip().lower() in ("", "none", "all", "null"):
        return None
    value = float(text)
    limit = int(value) if value >= 1 and value == int(value) else value
    from twell.eval.harness import check_limit

    check_limit(limit)
    return limit


def _limit_argument(text: str) -> int | float | None:
    try:
        return parse_limit(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of documents (200), a fraction in (0, 1) "
                                         f"(0.1) or none, got {text!r}") from None


def _batch_size_argument(text: str) -> str | int:
    """lm-eval's batch size: ``auto``, ``auto:N`` (N re-searches) or a whole number >= 1."""
    head, _, tail = text.partition(":")
    if head == "auto" and (not tail or tail.isdigit()):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto, auto:N or a whole number >= 1, got {text!r}")


def _device_argument(text: str) -> str:
    return "auto" if text == "auto" else torch_device(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Downstream evaluation with lm-eval, one checkpoint per process (two models can run "
                               "on two GPUs at once), and the dense/sparse comparison of two such results.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="evaluate one checkpoint, write its EvalRun JSON",
                       description="lm-eval on one checkpoint, offline, from local task files; writes an EvalRun JSON "
                                   "with the per-document log-likelihoods. Exit status 2 on bad input, and when a "
                                   "task was skipped for want of data (unless --allow-skipped).")
    r.add_argument("checkpoint", help="Hugging Face checkpoint directory (runs/<run>/final) or hub id")
    r.add_argument("--name", required=True, help="name of the run in tables (e.g. dense, sparse)")
    r.add_argument("--out", type=Path, required=True, help="EvalRun JSON to write")
    r.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"lm-eval tasks (default {' '.join(TASKS)})")
    r.add_argument("--limit", type=_limit_argument, default=None,
                   help="documents per task: a count, a fraction, or none (default: all)")
    r.add_argument("--ffn-path", choices=("dense", "reference", "kernel", "auto"),
                   help="FFN path (default: dense for a name containing 'dense', else auto); kernel needs the "
                        "TwELL kernels (a Hopper GPU)")
    r.add_argument("--data-dir", default="auto", help="directory of <task>/<split>.jsonl (default: <shared data>/eval)")
    r.add_argument("--device", type=_device_argument, default="auto",
                   help="auto (CUDA when there is one), cpu or cuda[:N]")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--batch-size", type=_batch_size_argument, default="auto",
                   help="lm-eval batch size: auto (CUDA), auto:N or a number")
    r.add_argument("--online", action="store_true", help="allow the hub for tasks without local data")
    r.add_argument("--allow-skipped", action="store_true", help="exit 0 even when a task had no data")
    c = sub.add_parser("compare", help="dense/sparse table and chart from two EvalRun JSONs",
                       description="The dense/sparse table, markdown and chart of notebook 03 from two EvalRun JSONs "
                                   "(python -m twell.eval run), the first as the baseline; prints the markdown.")
    c.add_argument("baseline", type=Path, help="EvalRun JSON of the baseline (the dense model)")
    c.add_argument("other", type=Path, help="EvalRun JSON compared with it (the sparse model)")
    c.add_argument("--out", type=Path, required=True, help="root of tables/ and figures/")
    c.add_argument("--stem", default="downstream_eval", help="file name stem")
    return p


def run_main(args: argparse.Namespace) -> int:
    from twell.eval.loading import resolve_device

    device = resolve_device(args.device)
    check_output_file(args.out)
    check_checkpoint_files(args.checkpoint)
    if args.ffn_path == "kernel":
        check_kernels("--ffn-path kernel", device, "--ffn-path reference (the same sparse computation in PyTorch) "
                                                   "or auto")
    from twell.eval.harness import evaluate_checkpoints

    data_dir = None if args.data_dir == "none" else args.data_dir
    runs = evaluate_checkpoints({args.name: args.checkpoint}, tasks=args.tasks, limit=args.limit, data_dir=data_dir,
                                ffn_paths={args.name: args.ffn_path} if args.ffn_path else None,
                                device=device, dtype=args.dtype, batch_size=args.batch_size,
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
        return report(f"{PROG} run", f"tasks {skipped} were skipped (no data): put their files under <shared "
                                     "data>/eval/<task>/ (TWELL_SHARED_DATA) or pass --data-dir, or --allow-skipped")
    return 0


def _load_run(path: Path, which: str):
    from twell.eval.harness import EvalRun

    if not path.is_file():
        raise FileNotFoundError(f"{which} {path} does not exist; give an EvalRun JSON written by {PROG} run")
    try:
        return EvalRun.load_json(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{which} {path} is not an EvalRun JSON ({type(exc).__name__}: {exc}); give one written "
                         f"by {PROG} run") from None


def compare_main(args: argparse.Namespace) -> int:
    check_output_dir(args.out)
    base, other = _load_run(args.baseline, "baseline"), _load_run(args.other, "other")
    if base.name == other.name:
        fail(f"{PROG} compare", f"both runs are named {base.name!r}; evaluate them with different --name")
    from twell.eval.tables import write_comparison

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
        return report(f"{PROG} {args.command}", str(exc))


if __name__ == "__main__":
    sys.exit(main())
