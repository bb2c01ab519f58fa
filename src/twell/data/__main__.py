"""``python -m twell.data --config NAME [--data PATH] [--shards FILE ...] [--out DIR] [--set data.key=value ...]``

Tokenise a run config's corpus into a prepared data directory (train.bin, val.bin, tokenizer/, meta.json)
ahead of training, e.g. on a CPU machine before a GPU run; print what was prepared from what.

One command prepares the book corpus for the 0.5B book-corpus pair (the tokenizer trained on its training
shards, then the token files; the dense twin shares them)::

    python -m twell.data --config 0p5b_books

With ``data.max_epochs`` set (1: no token seen twice) the run's ``train.steps x global_batch x seq_len`` is
checked against the prepared training tokens: exit status 2, naming the fix, when the run would repeat
tokens (the prepared directory stays, for a corrected config to reuse).
"""
from __future__ import annotations

import argparse
import json
import sys


def summary(prepared, budget: dict | None) -> dict:
    """What was prepared: the printed record (the full one is the directory's meta.json)."""
    m = prepared.meta
    tok = m["tokenizer"]
    out = {"dir": str(prepared.dir), "source": m["source"]["label"], "tokenizer": tok["name"],
           "vocab_size": m["vocab_size"], "train_tokens": m["n_train_tokens"], "val_tokens": m["n_val_tokens"],
           "train_docs": m["n_train_docs"], "val_docs": m["n_val_docs"]}
    if "n_train_chars" in m:
        out.update(train_chars=m["n_train_chars"], val_chars=m["n_val_chars"], split=m["split"]["what"])
    if tok.get("training"):
        t = tok["training"]
        out["tokenizer_trained_on"] = {k: t[k] for k in ("source", "sample", "docs", "chars", "corpus_chars")
                                       if k in t}
    if m.get("shards") and len(m["shards"]) > 1:
        out["shards"] = {s["name"]: {k: s[k] for k in ("train_docs", "val_docs", "unused_docs", "train_tokens",
                                                       "val_tokens", "verified") if s.get(k)}
                         for s in m["shards"]}
    if budget is not None:
        out["run"] = {k: budget[k] for k in ("tokens_needed", "tokens_available", "epochs", "max_unique_steps")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m twell.data", description=__doc__.splitlines()[2])
    p.add_argument("--config", required=True, help="run config name or YAML path (its data: and model.vocab_size)")
    p.add_argument("--data", default=None, help="corpus / source string; replaces data.source")
    p.add_argument("--shards", nargs="+", default=None, metavar="FILE",
                   help="files of a directory source to read, in order; replaces data.shards")
    p.add_argument("--out", default=None, help="prepared directory to write (default: the cache)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    from twell.data.budget import check_run_budget
    from twell.data.prepare import prepare_data
    from twell.train.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.data is not None:
            cfg.data.source = args.data
        if args.shards is not None:
            cfg.data.shards = list(args.shards)
        cfg.data.check()
        prepared = prepare_data(cfg.data, vocab_size=cfg.model.vocab_size, out_dir=args.out)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        budget = check_run_budget(cfg, prepared)
    except ValueError as exc:
        print(json.dumps(summary(prepared, None), indent=1))
        print(f"error: config {cfg.name}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary(prepared, budget), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
