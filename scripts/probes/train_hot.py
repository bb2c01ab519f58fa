"""The training op with its hot neurons as dense columns, by the hot rate threshold (probe, not part of the
package): where ``train_gated_ffn(..., hot=choose_hot(counts, M, min_freq))`` pays against the plain op.

Cases: the BENCHMARK.md generator at 16384 rows (nnz 29, 64, heavy tail 0.35; tail 0.1 otherwise) and, with
CKPT and TOKENS set, each layer of that checkpoint on its first 16384 captured rows of held-out text. The hot
set comes from rows 16384-32767 of the same source (a generator draw of 32768 rows; the next captured rows),
as a trainer's comes from earlier steps. Per case: dense (twell.bench.ffn.dense_train_ffn), the plain op, and
the op with hot sets at each MIN_FREQ, each a forward and torch.autograd.grad of (out, l1), alternating
(twell.bench.timing, L2 flushed, median of 20); the largest relative error of the six outputs against dense.
JSON to $OUT/train_hot.json; the table prints last.
Usage (GPU machine): PYTHONPATH=src [CKPT=dir TOKENS=prepared_dir] [GENERATOR=0] python scripts/probes/train_hot.py [f,...]
(GENERATOR=0: the checkpoint's layers only)
"""
import json
import math
import os
import sys

import torch

from twell.bench.ffn import L1_COEF, dense_train_ffn, rel_error
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.kernels.training import train_gated_ffn
from twell.reference.training import choose_hot, gate_counts

M, D, H = 16384, 2048, 5632
GENERATOR = (("nnz29", 29, 0.1), ("nnz64", 64, 0.1), ("nnz29-heavy", 29, 0.35))


def cases():
    for name, nnz, tail in (GENERATOR if os.environ.get("GENERATOR", "1") != "0" else ()):
        inp = calibrated_ffn_inputs(2 * M, D, H, nnz, tail, seed=0, device="cuda")
        yield name, inp.x[:M], inp.x[M:], inp.w_gate, inp.w_up, inp.w_down
    ckpt, tokens = os.environ.get("CKPT"), os.environ.get("TOKENS")
    if ckpt and tokens:
        from twell.bench.captured import capture_ffn_inputs

        cap = capture_ffn_inputs(ckpt, tokens, 2 * M, device="cuda")
        for layer in cap.layers:
            x = layer.x.cuda()
            yield (f"layer{layer.layer}", x[:M], x[M:], layer.w_gate.cuda(), layer.w_up.cuda(),
                   layer.w_down.cuda())


def main(freqs=(0.01, 0.02, 0.04)):
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator(device="cpu").manual_seed(1)
    grad_out = torch.randn(M, D, generator=g).div_(math.sqrt(M * D)).to(torch.bfloat16).cuda()
    l1_grad = torch.tensor(L1_COEF, dtype=torch.float32, device="cuda")
    results = []
    for name, x, x_cal, wg, wu, wd in cases():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wg, wu, wd)]
        counts, cal_counts = gate_counts(x, wg), gate_counts(x_cal, wg)
        total = max(1, int(counts.sum()))

        def step(fn):
            out, l1 = fn(*leaves)
            return (out.detach(), l1.detach(),
                    *torch.autograd.grad((out, l1), leaves, (grad_out, l1_grad.to(l1.dtype))))

        fns = {"dense": dense_train_ffn, "plain": lambda *a: train_gated_ffn(*a)[:2]}
        hots = {}
        for f in freqs:
            hot = choose_hot(cal_counts, x_cal.shape[0], f)
            hots[f"hot{f:g}"] = hot
            fns[f"hot{f:g}"] = lambda *a, hot=hot: train_gated_ffn(*a, hot=hot)[:2]
        ref = step(dense_train_ffn)
        row = {"case": name, "nnz_mean": int(counts.sum()) / M, "impls": {}}
        for k, fn in fns.items():
            got = step(fn)
            row["impls"][k] = {"rel_err": max(rel_error(a, b) for a, b in zip(got, ref))}
            if k in hots:
                row["impls"][k].update(hot_neurons=int(hots[k].numel()),
                                       pair_share=int(counts[hots[k]].sum()) / total)
            del got
        del ref
        t = time_alternating({k: (lambda fn=fn: step(fn)) for k, fn in fns.items()}, "cuda", reps=20, warmup=3)
        for k in fns:
            row["impls"][k]["ms"] = t[k].median_ms
            row["impls"][k]["speedup"] = t["dense"].median_ms / t[k].median_ms
        results.append(row)
        print(json.dumps(row), flush=True)
        del leaves, x, x_cal, wg, wu, wd
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "train_hot.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "M": M, "D": D, "H": H, "results": results}, fh, indent=1)
    print(f"{'case':>12} {'nnz':>6} {'plain':>6} " + " ".join(f"{'hot' + format(f, 'g'):>18}" for f in freqs))
    for r in results:
        im = r["impls"]
        cells = [f"{im[f'hot{f:g}']['speedup']:5.2f}x K{im[f'hot{f:g}']['hot_neurons']:>4} "
                 f"{100 * im[f'hot{f:g}']['pair_share']:3.0f}%" for f in freqs]
        print(f"{r['case']:>12} {r['nnz_mean']:6.1f} {im['plain']['speedup']:5.2f}x " + " ".join(f"{c:>18}" for c in cells)
              + f"  err {max(v['rel_err'] for v in im.values()):.1e}")


if __name__ == "__main__":
    main(*[tuple(float(v) for v in a.split(",")) for a in sys.argv[1:2]])
