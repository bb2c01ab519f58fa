"""Two ranks on one GPU over gloo: which collective FSDP2 needs works on CUDA tensors (run under torchrun,
PYTHONFAULTHANDLER=1)."""
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)


def step(name, fn):
    print(f"[{rank}] {name} ...", flush=True)
    fn()
    torch.cuda.synchronize()
    print(f"[{rank}] {name} ok", flush=True)


x = torch.full((8,), float(rank + 1), device=dev)
step("all_reduce", lambda: dist.all_reduce(x))
out = torch.empty(8 * ws, device=dev)
step("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, torch.ones(8, device=dev)))
rs = torch.empty(4, device=dev)
step("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs, torch.ones(4 * ws, device=dev)))
step("all_gather_into_tensor bf16", lambda: dist.all_gather_into_tensor(
    torch.empty(8 * ws, device=dev, dtype=torch.bfloat16), torch.ones(8, device=dev, dtype=torch.bfloat16)))

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
mesh = init_device_mesh("cuda", (ws,))
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
step("fsdp2 forward+backward", lambda: model(torch.randn(4, 64, device=dev)).sum().backward())
dist.destroy_process_group()
print(f"[{rank}] done", flush=True)
