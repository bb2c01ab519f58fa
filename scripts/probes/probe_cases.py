"""The BENCHMARK.md cases (twell.bench.ffn.SPARSITY) at the benchmark's shape, as the probes time them.
Imported by sibling probes (this directory is on sys.path when one of them runs as a script)."""
from twell.bench.ffn import SPARSITY
from twell.bench.generator import calibrated_ffn_inputs


def benchmark_inputs(M=65536, D=2048, H=5632, names=tuple(SPARSITY), device="cuda"):
    """Yield (nnz, tail, inputs, w_down_t) per case: calibrated inputs, seed 0, W_down transposed."""
    for name in names:
        nnz, tail = SPARSITY[name]
        inp = calibrated_ffn_inputs(M, D, H, nnz, tail, seed=0, device=device)
        yield nnz, tail, inp, inp.w_down.t().contiguous()
