"""Can the gate GEMM and the fused up/down kernel run at the same time? (probe, not part of the package)

The gate kernel is bound by the tensor cores, the fused kernel by L2 gathers. Run back to back they
add up (nnz 29: ~2.0 + ~2.1 ms). Split M into chunks and run the gate of chunk i+1 on one stream
while the fused kernel does chunk i on another, each capped to a share of the SMs (both kernels are
persistent and take a whole SM per CTA, so the caps partition the GPU). If the fused kernel's gathers
are limited by L2 rather than by the SMs issuing them, it loses little speed on fewer SMs and the
gate's time hides behind it.

Modes:
  scaling   each kernel alone over the whole M, at several SM caps (how each scales with SMs)
  pipe      the chunked two-stream pipeline at several (chunks, gate SMs) settings, against dense
            and the plain sparse call, alternating in one process (BENCHMARK.md timing)
Usage: PYTHONPATH=src python scripts/probes/overlap.py {scaling|pipe} [M]
"""
import sys

import torch
import torch.nn.functional as F

from twell.bench.ffn import rel_error
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import time_alternating
from twell.kernels.build import load
from twell.kernels.ops import spill_capacity

# the extension's settings, as the ops pass them: the default gate cluster, no union rule, the default dense cap
FFN_KW = dict(union_ratio=0.0, union_base=0.0, dense_cap=None)


def gate_kw(M):
    return dict(spill_cap=spill_capacity(M), cluster=2)

CASES = [(8, 0.1), (29, 0.1), (64, 0.1), (29, 0.35)]
TILE, COMP = 256, 8


def inputs(M, nnz, tail, D=2048, H=5632):
    inp = calibrated_ffn_inputs(M, D, H, nnz, tail, seed=0, device="cuda")
    return inp.x, inp.w_gate, inp.w_up, inp.w_down, inp.w_down.t().contiguous()


def dense(x, wg, wu, wd):
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def sparse(ext, x, wg, wu, wdt):
    packed, spill = ext.gate_twell(x, wg, TILE, COMP, **gate_kw(x.shape[0]))
    return ext.ffn_forward(x, packed, spill, wg, wu, wdt, TILE, COMP, **FFN_KW)


class Pipeline:
    """Gate of chunk i+1 on stream A while the fused kernel does chunk i on stream B."""

    def __init__(self, ext, chunks, g_sms, f_sms):
        self.ext, self.chunks, self.g_sms, self.f_sms = ext, chunks, g_sms, f_sms
        self.sa, self.sb = torch.cuda.Stream(), torch.cuda.Stream()

    def __call__(self, x, wg, wu, wdt):
        ext, n = self.ext, self.chunks
        M = x.shape[0]
        bounds = [M * i // n for i in range(n + 1)]
        cur = torch.cuda.current_stream()
        out = torch.empty_like(x)
        self.sa.wait_stream(cur)
        self.sb.wait_stream(cur)
        keep = []
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            with torch.cuda.stream(self.sa):  # the first gate runs alone: all SMs
                packed, spill = ext.gate_twell(x[lo:hi], wg, TILE, COMP, self.g_sms if i else 0, **gate_kw(x[lo:hi].shape[0]))
                ev = torch.cuda.Event()
                ev.record(self.sa)
            with torch.cuda.stream(self.sb):  # the last fused chunk runs alone: all SMs
                self.sb.wait_event(ev)
                packed.record_stream(self.sb)
                spill.record_stream(self.sb)
                ext.ffn_forward(x[lo:hi], packed, spill, wg, wu, wdt, TILE, COMP,
                                self.f_sms if i < n - 1 else 0, out[lo:hi], **FFN_KW)
            keep.append((packed, spill))
        cur.wait_stream(self.sa)
        cur.wait_stream(self.sb)
        out.record_stream(self.sb)
        return out


def scaling(M):
    ext = load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    caps = [c for c in (132, 116, 100, 84, 66, 50, 34, 20) if c <= sms]
    print("case,kernel,sms,median_ms,rate")
    for nnz, tail in CASES:
        x, wg, wu, wd, wdt = inputs(M, nnz, tail)
        packed, spill = ext.gate_twell(x, wg, TILE, COMP, **gate_kw(x.shape[0]))
        fns = {}
        for c in caps:
            fns[("gate", c)] = lambda c=c: ext.gate_twell(x, wg, TILE, COMP, c, **gate_kw(x.shape[0]))
            fns[("ffn", c)] = lambda c=c: ext.ffn_forward(x, packed, spill, wg, wu, wdt, TILE, COMP, c, **FFN_KW)
        t = time_alternating(fns, "cuda", reps=20)
        for (k, c), v in t.items():
            full = t[(k, caps[0])].median_ms
            print(f"nnz{nnz}_t{tail},{k},{c},{v.median_ms:.3f},{full / v.median_ms:.3f}", flush=True)


def pipe(M):
    ext = load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    settings = [(n, g) for n in (4, 8, 16) for g in (66, 84, 100)]
    print("case,chunks,gate_sms,ffn_sms,dense_ms,sparse_ms,pipe_ms,speedup_sparse,speedup_pipe,rel_err,equal_to_sparse")
    for nnz, tail in CASES:
        x, wg, wu, wd, wdt = inputs(M, nnz, tail)
        ref = dense(x, wg, wu, wd)
        base = sparse(ext, x, wg, wu, wdt)
        pipes = {s: Pipeline(ext, s[0], s[1], sms - s[1]) for s in settings}
        fns = {"dense": lambda: dense(x, wg, wu, wd), "sparse": lambda: sparse(ext, x, wg, wu, wdt)}
        for s, p in pipes.items():
            fns[s] = lambda p=p: p(x, wg, wu, wdt)
        t = time_alternating(fns, "cuda", reps=30)
        d, sp = t["dense"].median_ms, t["sparse"].median_ms
        for s, p in pipes.items():
            out = p(x, wg, wu, wdt)
            torch.cuda.synchronize()
            eq = bool(torch.equal(out, base))
            pm = t[s].median_ms
            print(f"nnz{nnz}_t{tail},{s[0]},{s[1]},{sms - s[1]},{d:.3f},{sp:.3f},{pm:.3f},{d / sp:.3f},{d / pm:.3f},"
                  f"{rel_error(out, ref):.2e},{eq}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "pipe"
    M = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    {"scaling": scaling, "pipe": pipe}[mode](M)
