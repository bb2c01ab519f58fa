"""Probe: the weight-stationary down pass of stationary_down.cu against the gather down pass.

For each BENCHMARK.md case (M = 65536), the gate's nonzeros become a CSR (rows padded to 4 entries,
value bf16 << 16 | neuron) and out = h @ w_down^T is computed three ways:
- `gather`: the existing non-gated kernel on the gate's TwELL (kernels.twell_ffn), which is exactly a
  down pass that gathers one 4 KB w_down_t row per (token, active neuron) from L2;
- `f32`: stationary_down.cu (fp32 FMAs), rows in their natural order;
- `f32_sorted`: the same on a CSR whose rows are stored sorted by entry count within each 1024-row
  chunk (what a producer that buckets rows by length could emit), its 32-row groups rotated over
  the warps from chunk to chunk: the 32 rows of a warp have similar lengths, so fewer lanes idle
  (ncu at nnz 29: 11 of 32 active in natural order), and every warp gets the same mix;
- `h2`, `h2_sorted`: the same with the tile in fp16 and packed fp16 FMAs per 4 entries (H2);
- `h2_noconf`, `f32_sorted_noconf`, `h2_sorted_noconf` (timing only, wrong values): those variants with each neuron's
  low 3 bits replaced by the lane's, so that shared-memory reads never conflict: what a producer
  that ordered entries to avoid bank conflicts could reach at best.
The first run (session 22) also had 512 threads and rows ordered through an index list; both were
slower and were removed from the probe.
All against F.linear(h, w_down) (cuBLAS, bf16) for the relative error; timed alternating, L2
flushed, median of 30. The CSR build is not timed: this is the down pass alone.
Usage (on the H100, from the repository root): PYTHONPATH=src python scripts/probes/stationary_down.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from twell import kernels
from twell.reference.ffn import SPARSE_FFN_COMPRESSION as C
from twell.bench.timing import time_alternating

sys.path.insert(0, str(Path(__file__).parent))
from probe_cases import benchmark_inputs  # noqa: E402

ext = load("stationary_down_probe", [str(Path(__file__).with_name("stationary_down.cu"))],
           extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)


def csr(h: torch.Tensor):
    """Row-padded CSR of h's positive entries: rowptr [M + 1] int32, ent int32, entries per row [M]."""
    pos = h > 0
    cnt = pos.sum(1)
    padded = (cnt + 3) // 4 * 4
    rowptr = torch.zeros(h.shape[0] + 1, dtype=torch.int64, device=h.device)
    rowptr[1:] = torch.cumsum(padded, 0)
    rows, cols = pos.nonzero(as_tuple=True)  # row-major order
    start = torch.zeros_like(cnt)
    start[1:] = torch.cumsum(cnt, 0)[:-1]
    dest = rowptr[rows] + (torch.arange(rows.numel(), device=h.device) - start[rows])
    bits = h[rows, cols].view(torch.int16).to(torch.int64) & 0xFFFF
    word = (bits << 16) | cols
    word = torch.where(word >= 2**31, word - 2**32, word)
    ent = torch.zeros(int(rowptr[-1]) + 4, dtype=torch.int32, device=h.device)
    ent[dest] = word.to(torch.int32)
    return rowptr.to(torch.int32), ent, cnt


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


print("case,mean_nnz,max_nnz,gather_ms,f32_ms,f32_sorted_ms,h2_ms,h2_sorted_ms,h2_noconf_ms,f32_sorted_noconf_ms,h2_sorted_noconf_ms,"
      "err_gather,err_f32,err_f32_sorted,err_h2,err_h2_sorted")
T = 1024
for nnz, tail, inp, wdt in benchmark_inputs():
    x, wg = inp.x, inp.w_gate
    M, D = x.shape
    h = torch.relu(F.linear(x, wg))
    ref = F.linear(h, inp.w_down)
    *csr_nat, cnt = csr(h)
    perm = torch.empty(M, dtype=torch.int64, device=x.device)
    for i, c in enumerate(range(0, M, T)):
        # each chunk of T rows in descending count order, its 32-row groups rotated over the warps by
        # chunk (thread t takes position t of every chunk, so without the rotation warp 0 would get
        # the longest rows of every chunk: the first runs of this probe)
        s_ = torch.argsort(cnt[c:c + T], descending=True) + c
        if s_.numel() == T:
            s_ = torch.roll(s_.view(T // 32, 32), shifts=i, dims=0).reshape(-1)
        perm[c:c + s_.numel()] = s_
    csr_srt = csr(h[perm])[:2]
    variants = {  # name: (CSR, noconf, h2)
        "f32": (csr_nat, False, False), "f32_sorted": (csr_srt, False, False),
        "h2": (csr_nat, False, True), "h2_sorted": (csr_srt, False, True),
        "h2_noconf": (csr_nat, True, True), "f32_sorted_noconf": (csr_srt, True, False),
        "h2_sorted_noconf": (csr_srt, True, True)}
    outs = {k: torch.full((M, D), float("nan"), dtype=torch.bfloat16, device=x.device) for k in variants}
    g = kernels.twell_gate(x, wg, compression=C)
    og = kernels.twell_ffn(g, wdt)

    def sd(key, c, noconf, h2):
        return lambda: ext.sdown(c[0], c[1], wdt, outs[key], noconf, h2)

    fns = {"gather": lambda: kernels.twell_ffn(g, wdt), **{k: sd(k, *v) for k, v in variants.items()}}
    t = time_alternating(fns, "cuda", reps=30)
    ref_p = ref[perm]
    ms = ",".join(f"{t[k].median_ms:.4f}" for k in fns)
    print(f"nnz{nnz}/{tail},{cnt.float().mean():.2f},{int(cnt.max())},{ms},{rel(og, ref):.2e},"
          f"{rel(outs['f32'], ref):.2e},{rel(outs['f32_sorted'], ref_p):.2e},{rel(outs['h2'], ref):.2e},"
          f"{rel(outs['h2_sorted'], ref_p):.2e}", flush=True)
    del h, ref, ref_p, g, og, outs, variants, csr_nat, csr_srt
    torch.cuda.empty_cache()
