"""A stack of SparseFFN layers (path "kernel") eager and compiled, with W_down's transpose
cache as it now is (ops inside the graph make and check it: one graph; the compiled variants start
with no copy) and as it was (checked in Python: a graph break per layer). Wall time per call
(synchronize before and after, median), graphs and breaks dynamo counted (cumulative over the two
shapes), CUDA-graph skips inductor counted, and bit-equality with eager. BENCHMARK.md generator
weights (nnz 29).
Usage (on the H100): PYTHONPATH=src python scripts/probes/compiled_stack.py [layers] [reps]
"""
import statistics
import sys
import time

import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn

from twell.bench.generator import calibrated_ffn_inputs
from twell.nn import SparseFFN


def old_w_down_t(self):
    """The earlier cache (address and version checked in Python), for the A/B."""
    w = self.down_proj.weight
    key = (w.data_ptr(), w._version, w.device, w.dtype)
    if getattr(self, "_old_t", None) is None or self._old_key != key:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            return w.detach().t().contiguous()
        self._old_t = w.detach().t().contiguous()
        self._old_key = key
    return self._old_t


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):  # no arithmetic across layers: inductor would round a fused sum differently
        return torch.cat([f(x) for f in self.layers])


def wall_ms(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(n_layers=8, reps=30):
    inp = calibrated_ffn_inputs(65536, 2048, 5632, 29, 0.1, seed=0, device="cuda")
    layers = []
    for _ in range(n_layers):
        f = SparseFFN(2048, 5632, path="kernel").to(device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        with torch.no_grad():
            for m, w in ((f.gate_proj, inp.w_gate), (f.up_proj, inp.w_up), (f.down_proj, inp.w_down)):
                m.weight.copy_(w)
        layers.append(f)
    model = Stack(layers)
    print(f"torch {torch.__version__}, inductor graph_partition={torch._inductor.config.graph_partition}")
    print("cache,mode,M,ms_per_call,graphs,breaks,cudagraph_skips,equal_eager")
    for cache in ("new", "old"):
        if cache == "old":
            SparseFFN.w_down_t = old_w_down_t
        for mode in ("eager", "default", "reduce-overhead"):
            torch._dynamo.reset()
            dynamo_utils.counters.clear()
            run = model if mode == "eager" else torch.compile(model, mode=None if mode == "default" else mode)
            for M in (64, 65536):
                x = inp.x[:M]
                with torch.no_grad():
                    if cache == "new" and mode != "eager":
                        for f in layers:  # as if compiled before any eager call: the graph makes the copies
                            f._w_down_t = None
                    for _ in range(3):  # compile, CUDA-graph warm-up and record
                        out = run(x)
                    out = out.clone()  # CUDA-graph trees reuse their output memory
                    equal = torch.equal(out, model(x))
                    ms = wall_ms(lambda: run(x), reps)
                c = dynamo_utils.counters
                skips = sum(n for k, n in c["inductor"].items() if "skip" in k)
                print(f"{cache},{mode},{M},{ms:.3f},{c['stats'].get('unique_graphs', 0)},"
                      f"{sum(c['graph_break'].values())},{skips},{equal}", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
