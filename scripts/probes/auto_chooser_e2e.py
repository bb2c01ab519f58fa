"""SparseFFN's "auto" path on a trained checkpoint: the activity threshold alone against
twell.model.choose_union_paths, which also times dense against sparse per layer (docs/kernels.md §8).

On batch x seq validation tokens in sequence order (one forward, so each FFN sees batch * seq tokens),
every layer on path "auto":
- threshold: each layer decides on its first call (dense above auto_max_active, 1% of H), per-row;
- chooser: choose_union_paths(model, ids) (union rule and dense-or-sparse, both timed);
- dense: every layer dense, the model's dense baseline;
- forward time of the three settings (BENCHMARK.md protocol: alternating, L2 flushed, median of 30), the
  paths each layer ran, and the relative difference of the chooser and threshold models' logits from the
  dense model's and from each other.
Usage (on the H100): PYTHONPATH=src python scripts/probes/auto_chooser_e2e.py CKPT_DIR VAL_BIN OUT_JSON [batch] [seq]
"""
import json
import sys
import time

import torch

from chooser_e2e import val_ids  # same directory
from twell.bench.timing import time_alternating
from twell.model import choose_union_paths, load_pretrained
from twell.model.llama import sparse_ffns


def main(ckpt, val_bin, out_json, batch=64, seq=1024):
    model, _ = load_pretrained(ckpt, ffn_path="auto", device="cuda", dtype=torch.bfloat16)
    model.eval()
    ffns = sparse_ffns(model)
    ids = val_ids(val_bin, batch, seq)

    with torch.no_grad():
        model(ids)  # first "auto" call of every layer: the threshold decides
    threshold = [(f._auto_dense, f.auto_note, f.union) for f in ffns]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = choose_union_paths(model, ids)
    torch.cuda.synchronize()
    choose_s = time.perf_counter() - t0
    chosen = [(f._auto_dense, f.auto_note, f.union) for f in ffns]

    def forward(setting):
        def call():
            for f, (dense, note, union) in zip(ffns, setting):
                f.set_auto_choice(dense, note or "")
                f.union = union
            with torch.no_grad():
                return model(ids).logits
        return call

    dense = [(True, "every layer dense (probe baseline)", None)] * len(ffns)
    fwd = {"dense": forward(dense), "threshold": forward(threshold), "chooser": forward(chosen)}
    times = time_alternating(fwd, "cuda", reps=30)
    paths = {}
    for name, call in fwd.items():
        call()
        paths[name] = [f.last_path for f in ffns]
    logits = {k: call().float() for k, call in fwd.items()}

    def rel(a, b):
        return ((logits[a] - logits[b]).norm() / logits[b].norm()).item()

    diff = rel("chooser", "threshold")
    out = {
        "checkpoint": ckpt, "tokens": batch * seq, "choose_seconds": choose_s,
        "forward_ms": {k: v.median_ms for k, v in times.items()},
        "paths": paths,
        "threshold_notes": [t[1] for t in threshold],
        "chooser_report": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()} for r in report],
        "logits_rel_diff_chooser_vs_threshold": diff,
        "logits_rel_diff_vs_dense": {k: rel(k, "dense") for k in ("threshold", "chooser")},
    }
    with open(out_json, "w") as fh:
        json.dump(out, fh, indent=1)
    ms = out["forward_ms"]
    print(f"chooser took {choose_s:.2f} s; forward ms: dense {ms['dense']:.3f}, threshold {ms['threshold']:.3f} "
          f"({ms['dense'] / ms['threshold']:.3f}x), chooser {ms['chooser']:.3f} ({ms['dense'] / ms['chooser']:.3f}x); "
          f"logits rel. diff chooser vs threshold {diff:.2e}, vs dense {out['logits_rel_diff_vs_dense']}")
    for r, p0, p1 in zip(report, paths["threshold"], paths["chooser"]):
        print(f"layer {r['layer']}: {r['active_per_token']:.1f} active; threshold ran {p0}; chooser ran {p1} "
              f"(union {r['union']}, dense {r['dense_ms']} ms, sparse {r['sparse_ms']} ms)")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], *(int(v) for v in a[3:]))
