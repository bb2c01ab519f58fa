"""``python -m twell.train --config configs/<name>.yaml [--set key=value ...] [--data PATH] [--out DIR] [--resume]``

Several GPUs / nodes: ``torchrun --nproc_per_node 8 -m twell.train --config configs/1p5b.yaml``.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch.distributed as dist

from twell.train.loop import TrainingDiverged, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m twell.train", description="Train a sparse (ReLU + L1) Llama model.")
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args.config, data=args.data, out=args.out, resume=args.resume, overwrite=args.overwrite,
                     overrides=args.overrides)
    except (ValueError, FileNotFoundError, FileExistsError, TrainingDiverged) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if result.summary:
        f = result.summary["final"]
        print(json.dumps({"summary": str(result.summary_path), "steps": result.summary["steps_done"],
                          "val_ce": f.get("val_ce"), "active_frac_mean": f.get("active_frac_mean"),
                          "hf_checkpoint": str(result.hf_dir)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
