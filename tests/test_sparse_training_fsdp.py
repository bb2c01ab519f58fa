"""The sparse training backend under FSDP2 on two CPU processes (gloo): the pure-PyTorch reference as the
backend (the kernels need a GPU) must give the gradients of the dense path bit for bit, with the unsharded
bf16 parameters FSDP2 gathers, and fill the layers' statistics. The kernels' own agreement with the reference
is tested on the GPU (tests/test_train_kernels.py)."""
import subprocess
import sys

import pytest

from twell.paths import repo_root

WORKER = r'''
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from twell.model import ModelConfig, build_model, set_tracking, sparse_ffns
from twell.nn.sparse_training import SparseTraining, use_sparse_training
from twell.train.parallel import decoder_layers
from twell.train.recipe import sparse_lm_loss

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def grads(backend):
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                     num_kv_heads=2, max_position_embeddings=32)
    model = build_model(mc)
    set_tracking(model, True)
    if backend:
        use_sparse_training(model, SparseTraining(impl="reference", start="sparse"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, 61, (2, 17), generator=g)
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    ffns = sparse_ffns(model)
    paths = [f.last_path for f in ffns]
    active = [int(f.stats.active_per_token.sum()) for f in ffns]
    sparse_lm_loss(logits, ids[:, 1:], ffns, 0.1).loss.backward()
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return full, paths, active


dense, p_d, a_d = grads(False)
sparse, p_s, a_s = grads(True)
assert p_d == ["dense", "dense"] and p_s == ["train-reference", "train-reference"], (p_d, p_s)
assert a_d == a_s, (a_d, a_s)
bad = [n for n in dense if not torch.equal(dense[n], sparse[n])]
assert not bad, bad
if rank == 0:
    print("OK", len(dense), "gradients equal")
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_reference_backend_under_fsdp2_matches_dense(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {"PYTHONPATH": str(repo_root() / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout and "gradients equal" in proc.stdout
