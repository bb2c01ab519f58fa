"""The sparse training backend under FSDP2 on two processes: on CPUs (gloo) the pure-PyTorch reference as the
backend must give the gradients of the dense path bit for bit, with the unsharded bf16 parameters FSDP2
gathers, and fill the layers' statistics; on GPUs the kernels must give them within bf16 rounding, light rows
and heavy rows alike, with the same statistics: on two GPUs over NCCL, and with both processes on one GPU over
gloo (NCCL refuses two ranks on one device; gloo stages CUDA tensors through the host, so the sharding, the bf16
gathers and the reduce-scatter of the gradients are FSDP2's own, only the transport differs). The kernels' own
agreement with the reference is tested on one GPU (tests/test_train_kernels.py)."""
import os
import subprocess
import sys

import pytest
import torch

from twell.paths import repo_root

WORKER = r'''
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from twell.model import ModelConfig, build_model, set_tracking, sparse_ffns
from twell.nn.sparse_training import SparseTraining, use_sparse_training
from twell.train.parallel import decoder_layers
from twell.train.recipe import sparse_lm_loss

CUDA = os.environ["TWELL_TEST_DEVICE"] == "cuda"
dist.init_process_group(os.environ.get("TWELL_TEST_BACKEND") or ("nccl" if CUDA else "gloo"))
rank = dist.get_rank()
if CUDA:  # one GPU per rank, or all ranks on the one GPU there is (gloo)
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
# CPU: a tiny model on the reference; GPU: widths the kernels take (D a multiple of 64), light rows only
# (slots 512) and mostly heavy rows (slots 8: half the gate is open at initialisation).
if CUDA:
    mc = dict(vocab_size=61, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2, num_kv_heads=2,
              max_position_embeddings=64)
    backends = {"light": SparseTraining(min_rows=0, impl="kernel", start="sparse", slots=512),
                "heavy": SparseTraining(min_rows=0, impl="kernel", start="sparse", slots=8)}
    want_path, seq = "train-kernel", 33
else:
    mc = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=2,
              max_position_embeddings=32)
    backends = {"reference": SparseTraining(min_rows=0, impl="reference", start="sparse")}
    want_path, seq = "train-reference", 17


def grads(backend):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**mc)).to(device)
    set_tracking(model, True)
    if backend is not None:
        use_sparse_training(model, backend)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, 61, (2, seq), generator=g).to(device)
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    ffns = sparse_ffns(model)
    paths = [f.last_path for f in ffns]
    active = [int(f.stats.active_per_token.sum()) for f in ffns]
    sparse_lm_loss(logits, ids[:, 1:], ffns, 0.1).loss.backward()
    full = {n: full_grad(p.grad) for n, p in model.named_parameters()}
    return full, paths, active


def full_grad(g):
    """The whole gradient from each rank's dim-0 shard, over c10d (DTensor.full_tensor's functional collectives
    crash with gloo on CUDA tensors)."""
    assert g.placements == (Shard(0),), g.placements
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, g.to_local().float().cpu())
    full = torch.cat(shards, 0)
    assert full.shape == g.shape, (full.shape, g.shape)
    return full


dense, p_d, a_d = grads(None)
assert p_d == ["dense", "dense"], p_d
for name, backend in backends.items():
    sparse, p_s, a_s = grads(backend)
    assert p_s == [want_path] * 2, (name, p_s)
    # Layer 0 sees the same input on both paths: the same gate, the same count. Deeper layers see inputs a
    # bf16 step apart where the kernels round differently, which can flip gates near zero.
    assert a_d[0] == a_s[0] if CUDA else a_d == a_s, (name, a_d, a_s)
    assert all(abs(d - s) <= 0.01 * d + 2 for d, s in zip(a_d, a_s)), (name, a_d, a_s)
    if CUDA:  # the kernels sum in their own order: within bf16 rounding of the dense path's gradients
        err = {n: float((sparse[n] - dense[n]).norm() / dense[n].norm().clamp_min(1e-12)) for n in dense}
        bad = {n: e for n, e in err.items() if e > 2e-2}
    else:
        bad = [n for n in dense if not torch.equal(dense[n], sparse[n])]
    assert not bad, (name, bad)
    if rank == 0:
        print("OK", name, len(dense), "gradients equal" if not CUDA else "gradients agree")
dist.destroy_process_group()
'''


def _run_workers(tmp_path, device: str, backend: str = "") -> str:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {"PYTHONPATH": str(repo_root() / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "TWELL_TEST_DEVICE": device, "TWELL_TEST_BACKEND": backend}
    if device == "cuda":  # the kernel build's settings and tools (CXX, CUDA_HOME, TWELL_BUILD_DIR, PATH, HOME)
        env = {**os.environ, **env, "PATH": os.environ.get("PATH", env["PATH"])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_reference_backend_under_fsdp2_matches_dense(tmp_path):
    out = _run_workers(tmp_path, "cpu")
    assert "OK reference" in out and "gradients equal" in out


@pytest.mark.gpu
@pytest.mark.usefixtures("kernels_ready")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_kernel_backend_under_fsdp2_on_two_gpus_matches_dense(tmp_path):
    out = _run_workers(tmp_path, "cuda")
    assert "OK light" in out and "OK heavy" in out


@pytest.mark.gpu
@pytest.mark.usefixtures("kernels_ready")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_backend_under_fsdp2_two_ranks_on_one_gpu_matches_dense(tmp_path):
    out = _run_workers(tmp_path, "cuda", backend="gloo")
    assert "OK light" in out and "OK heavy" in out
