"""``python -m twell.train --config configs/<name>.yaml [--set key=value ...] [--data PATH] [--out DIR] [--resume]``

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

import torch.distributed as dist

from twell.train.loop import TrainingDiverged, run
from twell.train.parallel import PeerFailed, first_to_fail

# Errors whose message says what to change: printed as one line (anything else prints its traceback).
_EXPECTED = (ValueError, FileNotFoundError, FileExistsError, TrainingDiverged)


class _UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # reported like any other error (once under torchrun), not printed by argparse
        raise _UsageError(f"{message}\n{self.format_usage().strip()}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m twell.train", description="Train a sparse (ReLU + L1) Llama model.")
    p.add_argument("--config", required=True, help="config name under configs/ (tiny, small, 1p5b, ...) or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 --set sparsity.l1_coef=0 (repeatable)")
    p.add_argument("--data", default=None,
                   help="corpus (.jsonl/.parquet/.txt file or dir, 'smoke', 'fineweb-edu', 'shared:<path>') or a prepared "
                        "data directory; replaces data.source")
    p.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier run in --out and start again")
    return p


def _report(exc: BaseException, world: int) -> int:
    """Print the error unless another rank does; return the exit code (2: an error that names its fix)."""
    code = 2 if isinstance(exc, _EXPECTED) else 1
    if isinstance(exc, PeerFailed) or not first_to_fail():
        return code
    where = f" (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else ""
    if isinstance(exc, _EXPECTED):
        print(f"error{where}: {exc}", file=sys.stderr)
    else:
        print(f"error{where}:", file=sys.stderr)
        traceback.print_exception(exc)
    return code


def main(argv=None) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = build_parser().parse_args(argv)
        result = run(args.config, data=args.data, out=args.out, resume=args.resume, overwrite=args.overwrite,
                     overrides=args.overrides)
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
