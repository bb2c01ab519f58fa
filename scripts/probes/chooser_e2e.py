"""twell.model.choose_union_paths end to end on a trained sparse checkpoint: what it chooses per layer,
what the choice costs to make, and what it gains on the whole model and on its FFNs.

On batch x seq validation tokens in sequence order (one forward, so each FFN sees batch * seq tokens),
all layers on the TwELL kernels:
- the chooser's report per layer and its wall time (one calibration forward plus a plan per layer);
- forward time (BENCHMARK.md protocol: alternating, L2 flushed, median of 30) with every layer
  per-row (union (0, 0)), with the fitted rule on every layer, and with the chooser's choice;
- the sparse FFNs alone on each layer's captured inputs under the same three settings, summed;
- the relative difference of the chosen model's logits from the per-row model's.
Usage (on the H100): PYTHONPATH=src python scripts/probes/chooser_e2e.py CKPT_DIR VAL_BIN OUT_JSON [batch] [seq]
"""
import json
import sys
import time

import numpy as np
import torch

from twell import kernels
from twell.bench.timing import time_alternating
from twell.model import choose_union_paths, load_pretrained, set_ffn_path
from twell.model.llama import sparse_ffns
from twell.reference.ffn import UNION_RULE

OFF = (0.0, 0.0)


def val_ids(val_bin, batch, seq):
    """The first batch x seq tokens of a prepared val.bin, in order, as a [batch, seq] CUDA tensor."""
    toks = np.memmap(val_bin, dtype=np.uint16, mode="r")
    if len(toks) < batch * seq:
        raise SystemExit(f"{val_bin}: {len(toks)} tokens, need {batch * seq}")
    return torch.from_numpy(np.asarray(toks[:batch * seq], dtype=np.int64)).view(batch, seq).cuda()


def main(ckpt, val_bin, out_json, batch=64, seq=1024):
    model, _ = load_pretrained(ckpt, ffn_path="dense", device="cuda", dtype=torch.bfloat16)
    model.eval()
    set_ffn_path(model, "kernel")
    ffns = sparse_ffns(model)
    ids = val_ids(val_bin, batch, seq)

    with torch.no_grad():
        model(ids)  # build and warm the kernels before timing the chooser
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = choose_union_paths(model, ids)
    torch.cuda.synchronize()
    choose_s = time.perf_counter() - t0
    settings = {"per_row": [OFF] * len(ffns), "rule_everywhere": [UNION_RULE] * len(ffns),
                "chosen": [f.union for f in ffns]}

    def forward(unions):
        def call():
            for f, u in zip(ffns, unions):
                f.union = u
            with torch.no_grad():
                return model(ids).logits
        return call

    fwd = {k: forward(v) for k, v in settings.items()}
    t_fwd = time_alternating(fwd, "cuda", reps=30)
    base = fwd["per_row"]().float()
    diff = ((fwd["chosen"]().float() - base).norm() / base.norm()).item()
    del base

    xs = []  # each layer's FFN input from one forward
    hooks = [f.register_forward_pre_hook(lambda mod, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
             for f in ffns]
    fwd["per_row"]()
    for h in hooks:
        h.remove()
    ffn_ms = {k: 0.0 for k in settings}
    per_layer = []
    for i, (f, x) in enumerate(zip(ffns, xs)):
        x = x.contiguous()
        wg, wu, wdt = f.gate_proj.weight, f.up_proj.weight, f.w_down_t()
        fns = {k: (lambda u=v[i]: kernels.twell_gated_ffn(
                   x, kernels.twell_gate(x, wg, tile=f.tile, compression=f.compression), wu, wdt, union=u))
               for k, v in settings.items()}
        t = time_alternating(fns, "cuda", reps=30)
        row = {k: round(t[k].median_ms, 4) for k in settings}
        per_layer.append(row)
        for k in settings:
            ffn_ms[k] += t[k].median_ms
    result = {
        "checkpoint": str(ckpt), "tokens": batch * seq, "seq": seq, "device": torch.cuda.get_device_name(),
        "rule": list(UNION_RULE), "choose_seconds": round(choose_s, 3),
        "chooser_report": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()} for r in report],
        "forward_ms": {k: round(t_fwd[k].median_ms, 3) for k in settings},
        "ffn_ms_per_layer": per_layer, "ffn_ms_sum": {k: round(v, 3) for k, v in ffn_ms.items()},
        "logits_rel_diff_chosen_vs_per_row": diff,
    }
    print(json.dumps(result, indent=1), flush=True)
    with open(out_json, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], *[int(v) for v in a[3:]])
