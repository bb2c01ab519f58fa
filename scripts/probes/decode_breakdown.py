"""Where the decoding FFN's time goes: per-kernel device durations and the span of one call (first
kernel start to last kernel end), from torch.profiler over eager calls with L2 overwritten between
calls, for the decoding op and dense; plus CUDA graph replay times (events) of both and of an
almost empty graph (the replay floor). Usage: python scripts/probes/decode_breakdown.py [M ...]"""
import json
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import L2Flusher, time_alternating


def spans(fn, flush, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and "zero" not in e.name and "fill" not in e.name]
    evs.sort(key=lambda e: e.time_range.start)
    per = defaultdict(list)
    for e in evs:
        per[e.name[:60]].append(e.time_range.elapsed_us())
    # calls: split by gaps > 20 us
    calls, cur = [], [evs[0]]
    for e in evs[1:]:
        if e.time_range.start - cur[-1].time_range.end > 20:
            calls.append(cur)
            cur = [e]
        else:
            cur.append(e)
    calls.append(cur)
    span = sorted(c[-1].time_range.end - c[0].time_range.start for c in calls)
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}, span[len(span) // 2], len(calls)


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    Ms = [int(a) for a in sys.argv[1:]] or [1, 16]
    flush = L2Flusher(torch.device("cuda"))
    res = []
    tiny = torch.zeros(1, device="cuda")
    for M in Ms:
        for nnz in (29,):
            inp = calibrated_ffn_inputs(M, 2048, 5632, nnz, 0.0, seed=M, device="cuda")
            x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
            wdt = wd.t().contiguous()
            dec = lambda: kernels.decode_gated_ffn(x, wg, wu, wdt)  # noqa: E731
            dense = lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
            kd, sd, nd = spans(dec, flush)
            kn, sn, nn_ = spans(dense, flush)
            t = time_alternating({"decode": graphed(dec), "dense": graphed(dense), "empty": graphed(lambda: tiny.add_(1))},
                                 "cuda", reps=50, warmup=5)
            row = {"M": M, "nnz": nnz, "decode_kernels_us": kd, "decode_span_us": sd, "dense_kernels_us": kn,
                   "dense_span_us": sn, "graph_us": {k: v.median_ms * 1e3 for k, v in t.items()}}
            res.append(row)
            print(json.dumps(row, indent=1))
    print("| M | decode span | dense span | decode graph | dense graph | empty graph |")
    for r in res:
        g = r["graph_us"]
        print(f"| {r['M']} | {r['decode_span_us']:.1f} | {r['dense_span_us']:.1f} | {g['decode']:.1f} | {g['dense']:.1f} | {g['empty']:.1f} |")


if __name__ == "__main__":
    main()
