"""Per-stage times of the sparse training FFN (CUDA events, medians of 20) at M 16384, D 2048, H 5632:
gate GEMM, compaction, light-row forward, light-row backward, work list, weight-gradient kernel, and
dense fwd+bwd for scale; then the host time of one forward and one backward call (queued behind a long
GPU sleep, so the host never waits for the GPU), and for the first case the profiler's tables by GPU
time and by host time. Usage: python scripts/probes/train_breakdown.py [nnz tail ...]"""
import json
import sys
import time

import torch

from twell.bench.generator import calibrated_ffn_inputs
from twell.kernels import load
from twell.kernels import training as kt


def med(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def host_ms(queue, reps=20):
    """Host milliseconds per call of queue() while the GPU is busy with a long sleep (nothing waits)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time at ~2 GHz: longer than the calls take to queue
    t0 = time.perf_counter()
    for _ in range(reps):
        queue()
    dt = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return dt


def main():
    args = [float(a) for a in sys.argv[1:]] or [8, 0.1, 29, 0.1, 64, 0.1, 29, 0.35]
    ext = load()
    rows = []
    for nnz, tail in zip(args[::2], args[1::2]):
        inp = calibrated_ffn_inputs(16384, 2048, 5632, nnz, tail, seed=0, device="cuda")
        x, wg, wu, wd = inp.x, inp.w_gate, inp.w_up, inp.w_down
        S = 128
        g = torch.mm(x, wg.t())
        idx, val, cnt, act = ext.train_compact(g, S)
        wdt = wd.t().contiguous()
        out, u, h, l1 = ext.train_rows_forward(x, idx, val, cnt, wu, wdt, S)
        dy = torch.randn_like(x)
        l1g = torch.full((1,), 1e-5, device="cuda")
        dx, du, dg = ext.train_rows_backward(dy, idx, val, u, h, cnt, wdt, wu, wg, l1g, S)
        ent, items, longs, totals = ext.train_worklist(idx, cnt, 5632, S, kt.COLUMN_CHUNK)
        n_items, n_part, n_long = totals.tolist()
        cols = (ent, *[items[i, :n_items] for i in range(4)], *[longs[i, :n_long] for i in range(3)], n_part)
        r = {"nnz": nnz, "tail": tail, "heavy_rows": int((cnt > S).sum()), "nnz_mean": float(cnt.float().mean()),
             "gate_gemm": med(lambda: torch.mm(x, wg.t())),
             "compact": med(lambda: ext.train_compact(g, S)),
             "rows_fwd": med(lambda: ext.train_rows_forward(x, idx, val, cnt, wu, wdt, S)),
             "rows_bwd": med(lambda: ext.train_rows_backward(dy, idx, val, u, h, cnt, wdt, wu, wg, l1g, S)),
             "work_items": med(lambda: ext.train_worklist(idx, cnt, 5632, S, kt.COLUMN_CHUNK)),
             "transpose": med(lambda: ext.transpose_bf16(wd)),
             "columns": med(lambda: ext.train_columns(*cols, h, du, dg, x, dy, None, None, None, 5632, S,
                                                              kt.COLUMN_PARTS))}
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wg, wu, wd)]

        coef = torch.tensor(2e-5, device="cuda")  # made once: a host-to-device copy waits for the stream

        def sparse():
            o, l, _, _ = kt.train_gated_ffn(*leaves)
            torch.autograd.grad((o, l), leaves, (dy, coef))

        def dense():
            hh = torch.relu(leaves[0] @ leaves[1].t()) * (leaves[0] @ leaves[2].t())
            o = hh @ leaves[3].t()
            l = hh.abs().sum(-1).float().mean()
            torch.autograd.grad((o, l), leaves, (dy, coef))

        r["sparse_total"] = med(sparse)
        r["dense_total"] = med(dense)
        # Host time: forwards alone (no wait in them), then backwards of finished forwards. Each forward
        # takes a pinned block for its sizes; as in a training loop's steady state, the pool has free ones
        # (a new pinned allocation would wait for the GPU).
        warm = [kt.train_gated_ffn(*leaves) for _ in range(21)]
        torch.cuda.synchronize()
        del warm
        r["host_fwd"] = host_ms(lambda: kt.train_gated_ffn(*leaves))
        pending = []
        for _ in range(20):
            o, l, _, _ = kt.train_gated_ffn(*leaves)
            pending.append((o, l))
        torch.cuda.synchronize()
        r["host_bwd"] = host_ms(lambda: torch.autograd.grad(pending.pop(), leaves, (dy, coef)))
        rows.append(r)
        if nnz == args[0]:  # where the time of one sparse call goes: kernels by GPU time, and the wall
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    sparse()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        print(json.dumps(r), flush=True)
    keys = [k for k in rows[0] if k not in ("tail",)]
    print("| " + " | ".join(keys) + " |")
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
