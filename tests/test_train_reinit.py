"""Dead-neuron re-initialisation (sparsity.reinit_dead) under FSDP2 on CPU processes (gloo) against one process.

Two levels:

- ``reinit_dead_gates`` on FSDP2-sharded FFNs (3 ranks, widths 4 and 7, so shards are uneven and one is empty) must
  leave the full weights and AdamW moments bit for bit equal to the single-process function applied to the gathered
  state, and the next forward (FSDP2's all-gather) must see the new rows.
- A training run with a block of neurons dead from the start (their gate rows zeroed at build time by a test-only
  wrapper around tests/test_train_dist.py's worker) re-initialises that block at the same step on 2 ranks as in one
  process: the same event, and in the checkpoint of that step the same rows, bit for bit, equal to the generator's
  draws. Only the re-drawn rows are compared exactly: the rest of the weights differ between 2 ranks and 1 process by
  the order of the gradient reduction (as in tests/test_train_runs.py::test_torchrun_two_processes_match_one_process),
  so they and the final export are compared with that test's tolerance.

Both also run on 2 GPUs (NCCL; the run in bf16) where there are 2, like tests/test_train_resume_gpu.py.
"""
import json
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from twell.train import read_metrics

from test_train_dist import HANG_S, run_to_exit, tiny_cfg, torchrun_cmd, worker, write_cfg  # noqa: F401
from test_train_runs import smoke_data  # noqa: F401

SHARDED_REINIT = '''\
"""reinit_dead_gates on FSDP2 shards and, in one process, on the gathered state; rank 0 saves what both gave
(weights, AdamW moments, every rank's rows and forward) to argv[2] for the test to compare.
On CUDA (NCCL) when asked, else on CPU (gloo)."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from twell.nn import SparseFFN
from twell.train.tracker import dim0_rows, reinit_dead_gates

cuda = sys.argv[1] == "cuda"
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
ffns = torch.nn.ModuleList([SparseFFN(8, 4), SparseFFN(8, 7), SparseFFN(8, 7, gated=False)]).to(dev)
plain = copy.deepcopy(ffns)
mesh = init_device_mesh(dev.type, (world,))
for f in ffns:
    fully_shard(f, mesh=mesh)
opt = torch.optim.AdamW(ffns.parameters(), lr=1e-2)
x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).to(dev)  # the same batch on every rank
sum(f(x).square().sum() for f in ffns).backward()
opt.step()  # nonzero moments in every row


def rows_of(f):
    w = f.gate_proj.weight if f.gated else f.up_proj.weight
    return w, opt.state[w]["exp_avg"]


def everyone(value):
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


# (first row, rows) of each rank's shard of the re-drawn weight and of its moment, per layer.
ranges = [everyone([(dim0_rows(t)[1], dim0_rows(t)[0].shape[0]) for t in rows_of(f)]) for f in ffns]

# One process's view of the same state: the gathered weights and moments.
ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
for p, q in zip(ffns.parameters(), plain.parameters()):
    q.data.copy_(p.full_tensor())
    ref_opt.state[q] = {k: (v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone())
                        for k, v in opt.state[p].items()}
dead = [torch.tensor([False, True, True, True]),  # across ranks 0 and 1
        torch.tensor([False, False, True, True, False, False, True]),  # every rank, the last one's single row
        torch.tensor([True, False, False, False, False, True, False])]  # up_proj of the non-gated FFN
gathered = lambda f: {name: p.full_tensor().cpu() for name, p in f.named_parameters()}
moments = lambda f, o: {name: {k: (o.state[p][k].full_tensor() if hasattr(o.state[p][k], "full_tensor")
                                   else o.state[p][k]).cpu() for k in ("exp_avg", "exp_avg_sq")}
                        for name, p in f.named_parameters()}
before = [gathered(f) for f in ffns]
n = reinit_dead_gates(ffns, dead, opt, std=0.02, generator=torch.Generator().manual_seed(5))
n_ref = reinit_dead_gates(plain, dead, ref_opt, std=0.02, generator=torch.Generator().manual_seed(5))
result = {
    "world": world, "dead": dead, "n": everyone(n), "n_ref": n_ref, "ranges": ranges, "before": before,
    "after": [gathered(f) for f in ffns], "ref_after": [{k: v.detach().cpu() for k, v in g.named_parameters()}
                                                        for g in plain],
    "moments": [moments(f, opt) for f in ffns], "ref_moments": [moments(g, ref_opt) for g in plain],
    # every rank's forward: FSDP2's all-gather must read the rewritten shards
    "forward": everyone([f(x).detach().cpu() for f in ffns]), "ref_forward": [g(x).detach().cpu() for g in plain],
}
if rank == 0:
    torch.save(result, sys.argv[2])
dist.barrier()
dist.destroy_process_group()
'''


def sharded_reinit(tmp_path, nproc, device):
    script, saved = tmp_path / "sharded_reinit.py", tmp_path / "sharded_reinit.pt"
    script.write_text(SHARDED_REINIT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script),
           device, str(saved)]
    rc, out, secs = run_to_exit(cmd, tmp_path / "log")
    print(f"{nproc} ranks on {device}: {secs:.1f} s")
    assert rc == 0, out[-4000:]
    check_sharded_reinit(torch.load(saved, weights_only=False), nproc)


def check_sharded_reinit(r, nproc):
    """What the script saved: the shards, counts, weights, moments and forwards of both paths agree."""
    assert r["world"] == nproc
    assert r["n"] == [8] * nproc and r["n_ref"] == 8
    for layer, dead in enumerate(r["dead"]):
        # Each rank's rows: consecutive torch.chunk pieces covering the width (the last rank of width 4 holds none).
        chunks = [len(c) for c in torch.arange(len(dead)).chunk(nproc)]
        chunks += [0] * (nproc - len(chunks))
        want = [[(sum(chunks[:rank]), n)] * 2 for rank, n in enumerate(chunks)]  # the weight and its moment
        assert r["ranges"][layer] == want, (layer, r["ranges"][layer])
        redrawn = "gate_proj.weight" if "gate_proj.weight" in r["after"][layer] else "up_proj.weight"
        for name, p in r["after"][layer].items():
            old = r["before"][layer][name]
            assert torch.equal(p, r["ref_after"][layer][name]), (layer, name)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(r["moments"][layer][name][k], r["ref_moments"][layer][name][k]), (layer, name, k)
            if name == redrawn:
                assert torch.equal((p != old).any(1), dead), (layer, (p != old).any(1))
                assert (r["moments"][layer][name]["exp_avg"][dead] == 0).all()
                assert (r["moments"][layer][name]["exp_avg"][~dead] != 0).any(1).all()  # the others kept theirs
            else:
                assert torch.equal(p, old), (layer, name)
        for rank in range(nproc):
            assert torch.equal(r["forward"][rank][layer], r["ref_forward"][layer]), (rank, layer)


@pytest.mark.timeout(2 * HANG_S)
def test_reinit_dead_gates_on_fsdp2_shards_matches_one_process(tmp_path):
    sharded_reinit(tmp_path, 3, "cpu")


@pytest.mark.gpu
@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(2 * HANG_S)
def test_reinit_dead_gates_on_fsdp2_shards_of_two_gpus_matches_one_process(tmp_path):
    sharded_reinit(tmp_path, 2, "cuda")


DEAD_WORKER = '''\
"""The test worker of tests/test_train_dist.py with FFN neurons dead from the start (test only): the gate rows
DEAD names ({{layer: (first, stop)}}) are zeroed in the built model. A zero gate row gives a zero pre-activation
(ReLU inactive) on every token and a zero gradient, so the rows stay zero, and the neurons dead, until
sparsity.reinit_dead re-draws them."""
import runpy
import sys

import torch

from twell.model import sparse_ffns
from twell.train import loop

WORKER, DEAD = {worker!r}, {dead!r}


def build_model_with_dead_neurons(*args, **kw):
    model = _build(*args, **kw)
    with torch.no_grad():
        for layer, (lo, hi) in DEAD.items():
            sparse_ffns(model)[layer].gate_proj.weight[lo:hi] = 0
    return model


_build, loop.build_model = loop.build_model, build_model_with_dead_neurons
sys.argv[0] = WORKER
runpy.run_path(WORKER, run_name="__main__")
'''

# Width 95 on 2 ranks: gate rows 0-47 on rank 0, 48-94 on rank 1. Layer 0's block crosses the boundary, layer 1's
# sits in the shorter last shard.
DEAD = {0: (40, 56), 1: (90, 95)}
REINIT_STEP = 2


def _events(out):
    return [{k: e[k] for k in ("step", "neurons", "per_layer")}
            for e in read_metrics(out / "metrics.jsonl")["event"] if e["event"] == "reinit"]


def _checkpoint(out, step, tmp_path):
    """model and optimizer state of a run's checkpoint, as full tensors."""
    path = tmp_path / f"{out.name}-{step}.pt"
    dcp_to_torch_save(out / "ckpt" / f"step_{step:07d}", path)
    return torch.load(path, weights_only=False)


def two_ranks_and_one_process(tmp_path, data, worker, **train):
    """The run with DEAD's neurons dead from the start on 2 ranks (torchrun) and in one process; checks the
    re-initialisation and returns (one, two, the checkpoints of the reinit step as full tensors)."""
    cfg = tiny_cfg(data, steps=4, eval_every=4, ckpt_every=REINIT_STEP, **train)
    cfg["model"]["intermediate_size"] = 95
    cfg["sparsity"].update(reinit_dead=True, reinit_every=REINIT_STEP)  # dead: silent for one step's 256 tokens
    path = write_cfg(tmp_path, cfg)
    dead_worker = tmp_path / "dead_worker.py"
    dead_worker.write_text(DEAD_WORKER.format(worker=str(worker), dead=DEAD))
    one, two = tmp_path / "one", tmp_path / "two"
    # The same worker without torchrun is one process (2 micro-batches of 4 per step instead of 2 ranks x 4).
    rc, log, s1 = run_to_exit([sys.executable, str(dead_worker), "--config", str(path), "--out", str(one)],
                              tmp_path / "one.log")
    assert rc == 0, log[-4000:]
    rc, log, s2 = run_to_exit(torchrun_cmd(dead_worker, path, two), tmp_path / "two.log")
    print(f"one process {s1:.1f} s, two ranks {s2:.1f} s")
    assert rc == 0, log[-4000:]
    assert "FSDP2" in read_metrics(two / "metrics.jsonl")["event"][0]["describe"]
    assert [json.loads((d / "summary.json").read_text())["world_size"] for d in (one, two)] == [1, 2]

    # (a) The block is re-initialised at the first reinit step, logged once, and is alive by the next one.
    sizes = [hi - lo for lo, hi in DEAD.values()]
    want = [{"step": REINIT_STEP, "neurons": sum(sizes), "per_layer": sizes},
            {"step": 2 * REINIT_STEP, "neurons": 0, "per_layer": [0, 0]}]
    assert _events(two) == _events(one) == want

    # (b) In the checkpoint of that step (saved after the re-initialisation; fp32 master weights) the rows are the
    # generator's draws, bit for bit, on 2 ranks and in 1 process, with zeroed moments.
    draws = torch.Generator().manual_seed(cfg["train"].get("seed", 0) * 1_000_003 + REINIT_STEP)
    ck1, ck2 = _checkpoint(one, REINIT_STEP, tmp_path), _checkpoint(two, REINIT_STEP, tmp_path)
    for layer, (lo, hi) in DEAD.items():
        key = f"model.layers.{layer}.mlp.gate_proj.weight"
        fresh = torch.randn(hi - lo, cfg["model"]["hidden_size"], generator=draws) * 0.02
        for ck in (ck1, ck2):
            assert torch.equal(ck["model"][key][lo:hi].cpu(), fresh), layer
            for moment in ("exp_avg", "exp_avg_sq"):
                assert (ck["optim"]["state"][key][moment][lo:hi] == 0).all(), (layer, moment)
    return one, two, ck1, ck2


@pytest.mark.timeout(4 * HANG_S)
def test_reinit_dead_neurons_on_two_ranks_matches_one_process(tmp_path, smoke_data, worker):  # noqa: F811
    """fp32 on CPU: besides the exact re-drawn rows, every weight of the 2-rank run stays within the reduction-order
    tolerance of the one-process run, through the training that follows the re-initialisation and the export."""
    one, two, ck1, ck2 = two_ranks_and_one_process(tmp_path, smoke_data, worker)
    for key, p in ck1["model"].items():
        torch.testing.assert_close(ck2["model"][key], p, rtol=1e-3, atol=1e-4, msg=key)
    from twell.model import load_pretrained

    m1, _ = load_pretrained(one / "final", ffn_path="dense")
    m2, _ = load_pretrained(two / "final", ffn_path="dense")
    for (key, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-4, msg=key)
    for layer, (lo, hi) in DEAD.items():
        assert (m2.model.layers[layer].mlp.gate_proj.weight[lo:hi] != 0).any(1).all()


@pytest.mark.gpu
@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(4 * HANG_S)
def test_reinit_dead_neurons_on_two_gpus_matches_one_gpu(tmp_path, smoke_data, worker):  # noqa: F811
    """bf16 (FSDP2 mixed precision on 2 GPUs, autocast on one): the same events and the same re-drawn rows bit for bit;
    the other weights differ by more than fp32's reduction order, so they are not compared."""
    two_ranks_and_one_process(tmp_path, smoke_data, worker, precision="bf16", device="cuda", export_dtype="bf16",
                              compile=False)
