"""Does a dense path for the most active neurons pay? (probe, not part of the package)

The per-row fused kernel pays ~8 KB of L2 gathers per (token, active neuron), whatever the neuron.
A neuron active for a fraction p of the tokens costs the gather p * M times; computed densely (its
gate and up columns in one cuBLAS GEMM, relu * up, its down column added by addmm) it costs ~4 kFLOP
per token and projection for every token. Neurons with p above the break-even go dense, the rest stay
on the TwELL kernels (gate kernel and fused kernel over the cold columns only).

The hot set comes from a calibration sample drawn with the same weights (rows past M of one
generator call), not from the timed rows. Timing: twell.bench.timing.time_alternating (alternating
calls, L2 flushed, median of 30), dense and the plain sparse path in the same process.
Output: out = addmm(sparse cold part in bf16, h_hot, W_down_hot^T), so the output is rounded twice
(the cold part once to bf16, then the sum); the error column shows what that costs.
Usage: PYTHONPATH=src python scripts/probes/hot_split.py [M D H]
       PYTHONPATH=src python scripts/probes/hot_split.py parts   (each piece of the hybrid timed alone)
"""
import sys

import torch
import torch.nn.functional as F

from twell import kernels
from twell.bench.ffn import rel_error
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating

CAL = 8192  # calibration rows
THRESHOLDS = (0.005, 0.01, 0.015, 0.02, 0.03)


def split(wg, wu, wd, hot):
    cold = ~hot
    return dict(
        wg_cold=wg[cold].contiguous(), wu_cold=wu[cold].contiguous(), wdt_cold=wd[:, cold].t().contiguous(),
        w_gu_hot=torch.cat([wg[hot], wu[hot]]).contiguous(), wd_hot_t=wd[:, hot].t().contiguous(),
        wg_hot=wg[hot].contiguous(), wu_hot=wu[hot].contiguous(),
        k=int(hot.sum()))


def case_inputs(M, D, H, nnz, tail):
    """Generator inputs: the timed rows x, the calibration rows xc, the weights and w_down^T."""
    inp = calibrated_ffn_inputs(M + CAL, D, H, nnz, tail, seed=0, device="cuda")
    return inp.x[:M].contiguous(), inp.x[M:].contiguous(), inp.w_gate, inp.w_up, inp.w_down, inp.w_down.t().contiguous()


def cold(x, s):
    """The TwELL kernels over the cold neurons only."""
    return kernels.twell_gated_ffn(x, kernels.twell_gate(x, s["wg_cold"]), s["wu_cold"], s["wdt_cold"])


def hybrid(x, s):
    out = cold(x, s)
    if s["k"] == 0:
        return out
    g, u = F.linear(x, s["w_gu_hot"]).split(s["k"], dim=1)
    return torch.addmm(out, F.relu(g) * u, s["wd_hot_t"])


def hybrid_inplace(x, s):
    """As hybrid, without temporaries: relu and the product in place, the down part added in place."""
    out = cold(x, s)
    if s["k"] == 0:
        return out
    g = F.linear(x, s["wg_hot"]).relu_().mul_(F.linear(x, s["wu_hot"]))
    return out.addmm_(g, s["wd_hot_t"])


def main(M=65536, D=2048, H=5632):
    print("case,threshold,hot_neurons,hot_share_of_pairs,dense_ms,sparse_ms,hybrid_ms,speedup_sparse,speedup_hybrid,"
          "rel_err_sparse,rel_err_hybrid,hybrid_inplace_ms,speedup_hybrid_inplace,rel_err_hybrid_inplace")
    for nnz, tail in [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)]:
        x, xc, wg, wu, wd, wdt = case_inputs(M, D, H, nnz, tail)
        freq = (F.linear(xc, wg) > 0).float().mean(0)
        act = (F.linear(x, wg) > 0).sum(0).float()  # pairs per neuron on the timed rows (for the share)
        ref = F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)
        err_sparse = rel_error(kernels.sparse_gated_ffn(x, wg, wu, wdt), ref)
        for th in THRESHOLDS:
            hot = freq > th
            s = split(wg, wu, wd, hot)
            err_h = rel_error(hybrid(x, s), ref)
            err_hi = rel_error(hybrid_inplace(x, s), ref)
            t = time_alternating({
                "dense": lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd),
                "sparse": lambda: kernels.sparse_gated_ffn(x, wg, wu, wdt),
                "hybrid": lambda: hybrid(x, s),
                "hybrid_inplace": lambda: hybrid_inplace(x, s),
            }, "cuda", reps=30)
            d, sp, hy = t["dense"].median_ms, t["sparse"].median_ms, t["hybrid"].median_ms
            hi = t["hybrid_inplace"].median_ms
            share = float(act[hot].sum() / act.sum())
            print(f"nnz{nnz}-tail{tail},{th},{s['k']},{share:.3f},{d:.3f},{sp:.3f},{hy:.3f},{d / sp:.2f},{d / hy:.2f},"
                  f"{err_sparse:.2e},{err_h:.2e},{hi:.3f},{d / hi:.2f},{err_hi:.2e}", flush=True)
            del s
        del x, xc, ref
        torch.cuda.empty_cache()


def parts(M=65536, D=2048, H=5632):
    """Each piece of the hybrid alone, at one threshold per case."""
    print("case,threshold,hot_neurons,piece,ms")
    for nnz, tail, th in [(8, 0.1, 0.02), (29, 0.1, 0.02), (64, 0.1, 0.01)]:
        x, xc, wg, wu, wd, wdt = case_inputs(M, D, H, nnz, tail)
        s = split(wg, wu, wd, (F.linear(xc, wg) > 0).float().mean(0) > th)
        k = s["k"]
        gate_all, gate_cold = kernels.twell_gate(x, wg), kernels.twell_gate(x, s["wg_cold"])
        out = kernels.twell_gated_ffn(x, gate_cold, s["wu_cold"], s["wdt_cold"])
        g, u = F.linear(x, s["w_gu_hot"]).split(k, dim=1)
        h = F.relu(g) * u
        hc = h.contiguous()
        t = time_alternating({
            "gate_all": lambda: kernels.twell_gate(x, wg),
            "gate_cold": lambda: kernels.twell_gate(x, s["wg_cold"]),
            "fused_all": lambda: kernels.twell_gated_ffn(x, gate_all, wu, wdt),
            "fused_cold": lambda: kernels.twell_gated_ffn(x, gate_cold, s["wu_cold"], s["wdt_cold"]),
            "gemm_gate_up_hot": lambda: F.linear(x, s["w_gu_hot"]),
            "relu_mul_hot": lambda: F.relu(g) * u,
            "addmm_down_hot": lambda: torch.addmm(out, h, s["wd_hot_t"]),
            "inplace_gate_hot_relu": lambda: F.linear(x, s["wg_hot"]).relu_(),
            "inplace_up_hot_mul": lambda: F.linear(x, s["wu_hot"]).mul_(hc),
            "inplace_addmm_down_hot": lambda: out.addmm_(hc, s["wd_hot_t"]),
        }, "cuda", reps=30)
        for name, r in t.items():
            print(f"nnz{nnz}-tail{tail},{th},{k},{name},{r.median_ms:.3f}", flush=True)
        del x, xc, s, gate_all, gate_cold, out, g, u, h, hc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:2] == ["parts"]:
        parts()
    else:
        main(*[int(a) for a in sys.argv[1:]])
