"""Distributed set-up and the things applied to the model from outside (torchtitan style).

The model never knows about these: :func:`apply_activation_checkpointing`, :func:`apply_compile`
and :func:`apply_fsdp` take a built ``LlamaForCausalLM`` and change how it runs, in that order.
Launch several processes with torchrun, e.g. ``torchrun --nproc_per_node 8 -m twell.train ...``
(several nodes: add ``--nnodes``, ``--node_rank`` and ``--rdzv_endpoint``).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from twell.model.llama import decoder_layers


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Start the process group when launched by torchrun with WORLD_SIZE > 1 (NCCL on CUDA, else gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but torch.cuda.is_available() is False")
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        kwargs = {"device_id": dev} if device == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30), **kwargs)
    return DistInfo(rank=rank, world=world, local_rank=local_rank, device=dev)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        dist.all_reduce(t)
    return t


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's decision, on every rank (wall-clock stops must agree)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], device=info.device)
    dist.broadcast(t, 0)
    return bool(t.item())


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (torchtitan style: wrap the layer, then FSDP wraps the wrapper).

    Non-reentrant checkpointing, so the FFN's in-graph L1 side output (``stats.l1``) still gets its
    gradient. ``state_dict`` keys are unchanged (the wrapper strips its prefix).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder layer in place (parameter names unchanged)."""
    for layer in decoder_layers(model):
        layer.compile()


def apply_fsdp(model: nn.Module, info: DistInfo, *, bf16: bool) -> None:
    """FSDP2: shard each decoder layer, then the root (embeddings, final norm, tied lm_head).

    With bf16 the parameters are all-gathered in bf16 and gradients reduced in fp32 (sharded fp32
    master weights stay with the optimizer).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(info.device.type, (info.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def set_gradient_sync(model: nn.Module, on: bool) -> None:
    """FSDP2: skip the reduce-scatter on all but the last micro-batch of a step."""
    fn = getattr(model, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(on)


def total_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip (when max_norm > 0) and return the global grad norm as a plain tensor (DTensor-aware)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
