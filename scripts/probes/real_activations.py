"""The FFN inputs of a trained sparse checkpoint as benchmark inputs (BENCHMARK.md: activations
captured from a trained sparse model are the best input of all).

For each SparseFFN layer, on batch x seq validation tokens in sequence order:
- activity of relu(x @ W_gate^T) in bf16: mean / max active neurons per token, max per 256-column tile;
- the union reuse factor of blocks of B consecutive tokens (active pairs / size of the block's union of
  active neurons): how much a kernel that loads each weight row once per block would save. The same
  numbers for the calibrated generator at the layer's mean nnz (tail 0.1) come beside them;
- BENCHMARK.md timing on these inputs: dense PyTorch FFN, the gate GEMM alone (cuBLAS), the TwELL
  gate kernel, the fused kernel, the whole sparse FFN; relative error against an fp32 FFN. Where
  D % 512 == 0, also the fused kernel with the block-union path (csrc/twell_union.cu) always on and at
  union=(0.5, 0) / (0.35, 0), and how many blocks each setting sends there.
Usage (on the H100): PYTHONPATH=src python scripts/probes/real_activations.py CKPT_DIR VAL_BIN OUT_JSON [batch] [seq]
"""
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from twell import kernels
from twell.bench.activity import gate_activity
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.model import load_pretrained
from twell.nn import SparseFFN
from twell.reference.ffn import UNION_RULE as RULE
from union_ratio import with_ratio, with_rule  # this script's directory is on sys.path

PREV_RULE = (0.43, 600.0)  # the rule fitted on the first union kernels, before they got cheaper (docs/kernels.md §7)


def timing(x, wg, wu, wd) -> dict:
    wdt = wd.t().contiguous()
    dense = lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    gate = kernels.twell_gate(x, wg)

    def sparse(union=None):
        return kernels.twell_gated_ffn(x, kernels.twell_gate(x, wg), wu, wdt, union=union)

    ratio = with_ratio  # the block-union path at union=(r, 0) (r = 0: off)

    fused = lambda union=None: kernels.twell_gated_ffn(x, gate, wu, wdt, union=union)  # noqa: E731
    fns = {"dense": dense, "sparse": ratio(0, sparse), "cublas_gate": lambda: F.linear(x, wg),
           "twell_gate": lambda: kernels.twell_gate(x, wg), "fused": ratio(0, fused)}
    union = x.shape[1] % 512 == 0
    if union:
        fns.update({"sparse_union": ratio(1e9, sparse), "fused_union": ratio(1e9, fused),
                    "fused_union_0.5": ratio(0.5, fused), "fused_union_0.35": ratio(0.35, fused),
                    "fused_union_rule": with_rule(*RULE, fused), "sparse_union_rule": with_rule(*RULE, sparse),
                    "fused_union_prev_rule": with_rule(*PREV_RULE, fused)})
    t = time_alternating(fns, "cuda", reps=30)
    xf = x.float()
    ref = F.linear(F.relu(F.linear(xf, wg.float())) * F.linear(xf, wu.float()), wd.float())
    err = lambda out: ((out.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    res = {k: round(v.median_ms, 4) for k, v in t.items()}
    res.update(speedup=round(t["dense"].median_ms / t["sparse"].median_ms, 3), rel_err_sparse=err(sparse()),
               rel_err_dense=err(dense()), overflow_rows=int(gate.n_overflow_rows),
               spilled_tiles=int(getattr(gate, "n_spilled_tiles", 0)))
    if union:
        res["rel_err_sparse_union"] = err(ratio(1e9, sparse)())
        res["speedup_union"] = round(t["dense"].median_ms / t["sparse_union"].median_ms, 3)
        res["speedup_union_rule"] = round(t["dense"].median_ms / t["sparse_union_rule"].median_ms, 3)
        res["rel_err_sparse_union_rule"] = err(with_rule(*RULE, sparse)())
        for r, b in ((1e9, 0.0), (0.5, 0.0), (0.35, 0.0), RULE, PREV_RULE):
            plan = kernels.union_plan(x, gate, wu, wdt, ratio=r, base=b)
            sz = plan["union_sizes"].float()
            res[f"union_plan_{r:g}" + (f"_base{b:g}" if b else "")] = {
                "blocks": plan["union_blocks"], "per_row_rows": plan["per_row_rows"],
                "mean_union": round(sz.mean().item(), 1) if sz.numel() else 0}
    return res


def main(ckpt, val_bin, out_json, batch=64, seq=1024):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run without the timing
    model, _ = load_pretrained(ckpt, ffn_path="dense", device=dev, dtype=torch.bfloat16)
    model.eval()
    ffns = [m for m in model.modules() if isinstance(m, SparseFFN)]
    captured = {i: [] for i in range(len(ffns))}
    hooks = [f.register_forward_pre_hook(lambda mod, args, i=i: captured[i].append(args[0].reshape(-1, args[0].shape[-1])))
             for i, f in enumerate(ffns)]
    toks = np.memmap(val_bin, dtype=np.uint16, mode="r")
    if len(toks) < batch * seq:
        raise SystemExit(f"{val_bin}: {len(toks)} tokens, need {batch * seq}")
    ids = torch.from_numpy(np.asarray(toks[:batch * seq], dtype=np.int64)).view(batch, seq).to(dev)
    with torch.no_grad():
        for s in range(0, batch, 8):
            model(ids[s:s + 8])
    for h in hooks:
        h.remove()
    result = {"checkpoint": str(ckpt), "tokens": batch * seq, "seq": seq,
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "layers": []}
    with torch.no_grad():
        for i, f in enumerate(ffns):
            x = torch.cat(captured[i]).contiguous()
            wg, wu, wd = f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight
            layer = {"layer": i, **gate_activity(x, wg)}
            nnz = max(1, round(layer["mean_active"]))
            syn = calibrated_ffn_inputs(x.shape[0], x.shape[1], wg.shape[0], nnz, 0.1, seed=0, device=dev)
            layer["generator_same_nnz"] = {"nnz": nnz, **gate_activity(syn.x, syn.w_gate)}
            if dev == "cuda":
                layer["timing_ms"] = timing(x, wg, wu, wd)
            result["layers"].append(layer)
            print(json.dumps(layer), flush=True)
    with open(out_json, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], *[int(v) for v in a[3:]])
