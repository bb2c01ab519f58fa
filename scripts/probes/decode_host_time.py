"""Host time per call of the FFN at one row, eager: what a token-by-token loop on the host pays per layer.
A SparseFFN on "auto" (the decoding op), the same layer on "dense", and the decoding op's two entries
(checked, and the trusted one "auto" uses). Each is called N times without a sync and the wall time
divided by N; the GPU time of one call (its CUDA-event median, printed beside) must stay below it for the
number to be the host's. Usage: python scripts/probes/decode_host_time.py [N]"""
import sys
import time

import torch

from twell import kernels
from twell.bench.generator import calibrated_ffn_inputs
from twell.nn import SparseFFN


def host_us(fn, n):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def gpu_us(fn, reps=200):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    inp = calibrated_ffn_inputs(1, 2048, 5632, 29, tail=0.0, seed=0, device="cuda")
    f = SparseFFN(2048, 5632).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        f.gate_proj.weight.copy_(inp.w_gate)
        f.up_proj.weight.copy_(inp.w_up)
        f.down_proj.weight.copy_(inp.w_down)
    d = SparseFFN(2048, 5632, path="dense").to(device="cuda", dtype=torch.bfloat16)
    d.load_state_dict(f.state_dict())
    x = inp.x.view(1, 1, 2048)
    wt = f.w_down_t()
    calls = {
        "SparseFFN auto (decoding op)": lambda: f(x),
        "SparseFFN dense": lambda: d(x),
        "decode_gated_ffn (checked)": lambda: kernels.decode_gated_ffn(inp.x, inp.w_gate, inp.w_up, wt),
        "decode_gated_ffn_trusted": lambda: kernels.decode_gated_ffn_trusted(inp.x, inp.w_gate, inp.w_up, wt),
    }
    with torch.inference_mode():
        f(x)  # the first call measures the layer's activity
        assert f.last_path == "twell-kernel", f.auto_note
        print(f"| call | host us per call ({n} calls) | GPU us per call |")
        print("|---|---|---|")
        for name, fn in calls.items():
            print(f"| {name} | {host_us(fn, n):.1f} | {gpu_us(fn):.1f} |")


if __name__ == "__main__":
    main()
