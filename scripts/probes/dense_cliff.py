"""Near-dense inputs on the one-op sparse FFN: time against dense PyTorch for several dense-path
capacities (the ops' dense_cap: its rule, then M rows), and what non-finite inputs and weights give.
Writes JSON to $OUT."""
import json, math, os, sys, time
import torch
import torch.nn.functional as F
from twell.bench.generator import calibrated_ffn_inputs
from twell.kernels import dense_capacity, sparse_gated_ffn

def timeit(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]

def dense(x, wg, wu, wd):
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

out = os.environ.get("OUT", "/tmp"); rows = []
cases = [(4096, 1500), (8192, 1500), (8192, 2816), (8192, 5000), (16384, 1500), (65536, 1500), (65536, 64)]
if len(sys.argv) > 1: cases = [tuple(map(int, c.split(":"))) for c in sys.argv[1:]]
for M, nnz in cases:
    t0 = time.time()
    inp = calibrated_ffn_inputs(M, 2048, 5632, nnz, 0.1, seed=1, device="cuda")
    x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
    wdt = wd.t().contiguous()
    ref = dense(x, wg, wu, wd)
    td = timeit(lambda: dense(x, wg, wu, wd))
    for cap in [None, M]:
        y = sparse_gated_ffn(x, wg, wu, wdt, dense_cap=cap)
        err = float((y.float() - ref.float()).norm() / ref.float().norm())
        ts = timeit(lambda: sparse_gated_ffn(x, wg, wu, wdt, dense_cap=cap), reps=5 if cap is None and nnz > 500 else 20)
        rows.append(dict(M=M, nnz=nnz, cap="default" if cap is None else str(cap), cap_rows=dense_capacity(M, cap), dense_ms=td, sparse_ms=ts, slowdown=ts / td, rel_err=err))
        print(rows[-1], flush=True)
    del inp, x, wg, wu, wd, wdt, ref; torch.cuda.empty_cache()

# Non-finite values: compare which output rows are non-finite, sparse against dense.
nf = []
inp = calibrated_ffn_inputs(4096, 2048, 5632, 29, 0.1, seed=2, device="cuda")
base = dict(x=inp.x, wg=inp.w_gate, wu=inp.w_up, wd=inp.w_down)
h = F.relu(F.linear(inp.x, inp.w_gate))
act = (h[0] > 0).nonzero().flatten(); inact = (h[0] == 0).nonzero().flatten()
def put(name, idx, val):
    t = {k: v.clone() for k, v in base.items()}
    t[name][idx] = val
    return t
tests = {
  "x row 0 nan": put("x", (0, 5), float("nan")),
  "x row 0 +inf": put("x", (0, 5), float("inf")),
  "w_gate row(active of row0) nan": put("wg", (int(act[0]), 3), float("nan")),
  "w_gate row(inactive of row0) nan": put("wg", (int(inact[0]), 3), float("nan")),
  "w_up row(active) nan": put("wu", (int(act[0]), 3), float("nan")),
  "w_up row(inactive) nan": put("wu", (int(inact[0]), 3), float("nan")),
  "w_down col(inactive) inf": put("wd", (3, int(inact[0])), float("inf")),
}
for name, t in tests.items():
    r = dense(t["x"], t["wg"], t["wu"], t["wd"])
    try:
        y = sparse_gated_ffn(t["x"], t["wg"], t["wu"], t["wd"].t().contiguous()); torch.cuda.synchronize()
        rd = (~torch.isfinite(r)).any(1); ys = (~torch.isfinite(y)).any(1)
        fin = torch.isfinite(r) & torch.isfinite(y)
        nf.append(dict(case=name, dense_bad_rows=int(rd.sum()), sparse_bad_rows=int(ys.sum()), same_rows=bool((rd == ys).all()),
                       finite_err=float((y.float()[fin] - r.float()[fin]).abs().max()) if fin.any() else None))
    except Exception as e:
        nf.append(dict(case=name, error=repr(e)[:300]))
    print(nf[-1], flush=True)
json.dump(dict(rows=rows, nonfinite=nf, device=torch.cuda.get_device_name()), open(f"{out}/dense_cliff.json", "w"), indent=1)
print(f"{'M':>6} {'nnz':>5} {'cap':>8} {'dense ms':>9} {'sparse ms':>9} {'slowdown':>8}")
for r in rows: print(f"{r['M']:>6} {r['nnz']:>5} {r['cap_rows']:>8} {r['dense_ms']:>9.3f} {r['sparse_ms']:>9.3f} {r['slowdown']:>8.2f}  err {r['rel_err']:.1e}")
