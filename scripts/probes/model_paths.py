"""A trained checkpoint on the GPU through each FFN path: dense, pure-PyTorch reference, TwELL kernels.

Checks that the kernels are what runs inside the model (module.last_path), that the three paths give
the same validation cross-entropy and near-identical logits, and times a forward pass per path.
Usage: PYTHONPATH=src python scripts/probes/model_paths.py CKPT_DIR VAL_BIN [batch] [seq]
"""
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from twell.model import load_pretrained, set_ffn_path
from twell.nn import SparseFFN


def main(ckpt, val_bin, batch=16, seq=1024):
    model, _ = load_pretrained(ckpt, ffn_path="dense", device="cuda", dtype=torch.bfloat16)
    model.eval()
    toks = np.memmap(val_bin, dtype=np.uint16, mode="r")
    n = batch * (seq + 1)
    ids = torch.from_numpy(np.asarray(toks[:n], dtype=np.int64)).view(batch, seq + 1).cuda()
    inp, tgt = ids[:, :-1], ids[:, 1:]
    ffns = [m for m in model.modules() if isinstance(m, SparseFFN)]
    ffns[-1].keep_gate = True  # its TwELL is read below (overflow rows)
    out = {"checkpoint": ckpt, "tokens": batch * seq, "layers": len(ffns)}
    logits = {}
    with torch.no_grad():
        for path in ("dense", "reference", "kernel"):
            set_ffn_path(model, path)
            lg = model(inp).logits.float()
            logits[path] = lg
            ran = sorted({m.last_path for m in ffns})
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1)).item()
            times = []
            for _ in range(3):
                model(inp)
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                model(inp)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            out[path] = {"ran": ran, "val_ce": ce, "forward_ms_median": sorted(times)[5],
                         "overflow_rows_last_layer": (ffns[-1].last_gate.n_overflow_rows
                                                         if ffns[-1].last_gate is not None else None)}
    ref = logits["dense"]
    for path in ("reference", "kernel"):
        d = logits[path] - ref
        out[path]["max_abs_logit_diff_vs_dense"] = d.abs().max().item()
        out[path]["rel_logit_diff_vs_dense"] = (d.norm() / ref.norm()).item()
        out[path]["argmax_agreement"] = (logits[path].argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *[int(a) for a in sys.argv[3:]])
