"""``python -m twell.train --config configs/<name>.yaml [--set key=value ...] [--data PATH] [--out DIR]
[--resume | --resume-if-exists | --overwrite]``

Several GPUs / nodes: ``torchrun --nproc_per_node 8 -m twell.train --config configs/1p5b.yaml``.

Under torchrun an error on any rank ends the job within seconds: one rank prints it, and a failing rank exits at
once, without tearing the process group down (see twell.train.parallel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from twell.cli import error_line
from twell.paths import repo_root
from twell.train.config import RunConfig, load_config, parse_overrides
from twell.train.loop import TrainingDiverged, run
from twell.train.parallel import PeerFailed, first_to_fail

PROG = "python -m twell.train"
# Errors whose message says what to change: printed as one line (anything else prints its traceback).
_EXPECTED = (ValueError, FileNotFoundError, FileExistsError, TrainingDiverged)
# What the trainer counts as an earlier run in --out (it refuses to start over one without --resume or
# --overwrite); without either there is nothing for --resume to continue.
_RUN_FILES = ("ckpt", "metrics.jsonl")


class _UsageError(ValueError):
    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # reported like any other error (once under torchrun), not printed by argparse
        raise _UsageError(message, self.format_usage().strip())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Train a sparse (ReLU + L1) Llama model.")
    p.add_argument("--config", required=True, help="config name under configs/ (tiny, small, 1p5b, ...) or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 --set sparsity.l1_coef=0 (repeatable)")
    p.add_argument("--data", default=None,
                   help="corpus (.jsonl/.parquet/.txt file or dir, 'smoke', 'fineweb-edu', 'shared:<path>') or a prepared "
                        "data directory; replaces data.source")
    p.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its latest checkpoint; an error when --out holds no run")
    start.add_argument("--resume-if-exists", action="store_true",
                       help="continue the run in --out if it holds one, else start a new run there (and say so)")
    start.add_argument("--overwrite", action="store_true", help="delete an earlier run in --out and start again")
    return p


def _load(args: argparse.Namespace) -> RunConfig:
    """The config with its overrides, read before any process group or output folder exists."""
    for item in args.overrides:  # values are YAML: name the --set whose value does not parse
        try:
            parse_overrides([item])
        except yaml.YAMLError as exc:
            why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"--set {item!r}: the value is not valid YAML ({why}); quote it if it is meant as "
                             "text") from None
    try:
        cfg = load_config(args.config, args.overrides)
    except yaml.YAMLError as exc:  # the parser's message names the file, line and column
        raise ValueError(f"--config {args.config} is not valid YAML: {' '.join(str(exc).split())}") from None
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is cuda but no CUDA device is visible on this machine; run it on a GPU "
                         "machine, or --set train.device=cpu (auto takes CUDA where there is one)")
    return cfg


def _holds_run(out: Path) -> bool:
    return any((out / name).exists() for name in _RUN_FILES)


def _resume(args: argparse.Namespace, out: Path) -> bool:
    """Whether the trainer should resume: ``--resume`` insists on a run to continue, ``--resume-if-exists``
    starts a new one where there is none. Every rank decides alike: the trainer writes a run's files only after
    a collective that every rank reaches after this check."""
    if args.resume and not _holds_run(out):
        what = "does not exist" if not out.exists() else f"holds no run (no {' or '.join(_RUN_FILES)})"
        default = " (default runs/<config name>)" if args.out is None else ""
        raise ValueError(f"--resume: {out} {what}, so there is nothing to continue; check --out{default}, or pass "
                         "--resume-if-exists to start a new run there when it holds none")
    if args.resume_if_exists and not _holds_run(out):
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: no run in {out} to resume: starting a new run at step 0", file=sys.stderr, flush=True)
        return False
    return args.resume or args.resume_if_exists


def _report(exc: BaseException, world: int) -> int:
    """Print the error unless another rank does; return the exit code (2: an error that names its fix)."""
    code = 2 if isinstance(exc, _EXPECTED) else 1
    if isinstance(exc, PeerFailed) or not first_to_fail():
        return code
    where = f" (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else ""
    if isinstance(exc, _UsageError):
        print(exc.usage, file=sys.stderr)
    if isinstance(exc, _EXPECTED):
        print(error_line(PROG + where, str(exc)), file=sys.stderr)
    else:
        print(f"{PROG}{where}: error:", file=sys.stderr)
        traceback.print_exception(exc)
    return code


def main(argv=None) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = build_parser().parse_args(argv)
        cfg = _load(args)
        out = Path(args.out) if args.out is not None else repo_root() / "runs" / cfg.name  # run()'s default
        result = run(cfg, data=args.data, out=out, resume=_resume(args, out), overwrite=args.overwrite)
    except BaseException as exc:
        if isinstance(exc, SystemExit):  # --help
            raise
        if world == 1:
            if not isinstance(exc, _EXPECTED):
                raise
            return _report(exc, world)
        code = _report(exc, world)
        # Exit now, skipping destroy_process_group and the interpreter's clean-up: with NCCL both can wait for
        # the other ranks, which may sit in a collective this rank will never join. torchrun's agent sees this
        # exit and stops the other workers (SIGTERM, then SIGKILL after 30 s).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # every rank finished the run (its last step is a barrier)
    if result.summary:
        f = result.summary["final"]
        print(json.dumps({"summary": str(result.summary_path), "steps": result.summary["steps_done"],
                          "val_ce": f.get("val_ce"), "active_frac_mean": f.get("active_frac_mean"),
                          "hf_checkpoint": str(result.hf_dir)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
