"""``python -m twell.data --config small [--data PATH] [--out DIR] [--set data.key=value ...]``

Tokenise a run config's corpus into a prepared data directory (train.bin, val.bin, tokenizer/, meta.json)
ahead of training, e.g. on a CPU machine before a GPU run; print the directory.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twell.data", description=__doc__.splitlines()[2])
    p.add_argument("--config", required=True, help="run config name or YAML path (its data: and model.vocab_size)")
    p.add_argument("--data", default=None, help="corpus / source string; replaces data.source")
    p.add_argument("--out", default=None, help="prepared directory to write (default: the cache)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    from twell.data.prepare import prepare_data
    from twell.train.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.data is not None:
            cfg.data.source = args.data
        prepared = prepare_data(cfg.data, vocab_size=cfg.model.vocab_size, out_dir=args.out)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = prepared.meta
    print(json.dumps({"dir": str(prepared.dir), "source": m["source"]["label"], "tokenizer": m["tokenizer"]["name"],
                      "vocab_size": m["vocab_size"], "train_tokens": m["n_train_tokens"],
                      "val_tokens": m["n_val_tokens"], "train_docs": m["n_train_docs"], "val_docs": m["n_val_docs"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
