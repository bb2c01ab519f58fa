"""Where the event-timed sparse call spends time beyond its GPU ops (nnz 8, M = 65536): medians of
30 event-timed calls under variants of the benchmark's loop, to separate the L2 flush's dirty
lines, the GPU's clock under the power limit and the events' own cost.
Usage (on the H100): PYTHONPATH=src python scripts/probes/event_overhead.py
"""
import statistics

import torch

from twell import kernels, reference
from twell.bench.generator import calibrated_ffn_inputs
from twell.bench.timing import L2Flusher


def timed(fn, before, reps=30):
    """Median event time of fn in us, `before` run ahead of every call (outside the events)."""
    for _ in range(3):
        before()
        fn()
    ev = []
    for _ in range(reps):
        before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ev.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3


def spin():
    """~1.5 ms on the GPU doing nothing: a rest, and every later op is queued before it runs."""
    torch.cuda._sleep(3_000_000)


def main():
    inp = calibrated_ffn_inputs(65536, 2048, 5632, 8, 0.1, seed=0, device="cuda")
    wdt = inp.w_down.t().contiguous()
    sparse = lambda: kernels.sparse_gated_ffn(inp.x, inp.w_gate, inp.w_up, wdt)  # noqa: E731
    gate = lambda: kernels.twell_gate(inp.x, inp.w_gate)  # noqa: E731
    dense = lambda: reference.dense_gated_ffn(inp.x, inp.w_gate, inp.w_up, inp.w_down)  # noqa: E731
    flush = L2Flusher(torch.device("cuda"))

    variants = {
        "flush (bench loop, sparse only)": (sparse, flush),
        "flush + spin": (sparse, lambda: (flush(), spin())),
        "no flush": (sparse, lambda: None),
        "dense, flush (bench loop with dense)": (sparse, lambda: (dense(), flush())),
        "dense, flush, spin": (sparse, lambda: (dense(), flush(), spin())),
        "empty call, flush": (lambda: None, flush),
        "gate only, flush": (gate, flush),
        "gate only, flush + spin": (gate, lambda: (flush(), spin())),
        "dense ffn, flush": (dense, flush),
        "dense ffn, flush + spin": (dense, lambda: (flush(), spin())),
    }
    for name, (fn, before) in variants.items():
        print(f"{name:40s} {timed(fn, before):9.1f} us", flush=True)


if __name__ == "__main__":
    main()
