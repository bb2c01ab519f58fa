"""Distributed set-up and the things applied to the model from outside (torchtitan style).

The model never knows about these: :func:`apply_activation_checkpointing`, :func:`apply_compile`
and :func:`apply_fsdp` take a built ``LlamaForCausalLM`` and change how it runs, in that order.
Launch several processes with torchrun, e.g. ``torchrun --nproc_per_node 8 -m twell.train ...``
(several nodes: add ``--nnodes``, ``--node_rank`` and ``--rdzv_endpoint``).

Errors on some ranks only: where the ranks wait for one another's work during set-up (rank 0 prepares the data,
the others wait for it), :func:`fail_together` makes every rank raise when any did. Anywhere else (a rank that
fails while the others sit in a collective) the failing process exits at once, without tearing the process group
down, and torchrun stops the others (``python -m twell.train`` does both). :func:`first_to_fail` picks the one
rank that prints the error.
"""
from __future__ import annotations

import contextlib
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


def all_ranks_true(mask: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """A bool tensor that is True where it is True on every rank (the same result on every rank)."""
    if not info.distributed:
        return mask
    t = mask.to(torch.uint8)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.bool()


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's decision, on every rank (wall-clock stops must agree)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], device=info.device)
    dist.broadcast(t, 0)
    return bool(t.item())


class PeerFailed(RuntimeError):
    """Raised on a rank that did not fail itself when another rank's error stops the job (that rank reports it)."""


@contextlib.contextmanager
def fail_together(info: DistInfo):
    """Run the block on every rank, then agree: when it raised on any rank, it raises on every rank.

    A rank that raised re-raises its own error; the others raise :class:`PeerFailed` naming the first failing rank
    and its message. The outcome travels in one small all-gather at the end of the block, which is therefore a
    synchronisation point (a barrier). The block must not enter a collective that a rank raising earlier in the
    block would skip: that would pair the agreement with the wrong collective.
    """
    if not info.distributed:
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is not an Exception
        error = exc
    outcomes: list[str | None] = [None] * info.world
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if failed:
        r, msg = failed[0]
        raise PeerFailed(f"rank {r} of {info.world} failed: {msg}")


def broadcast_object(obj, info: DistInfo, src: int = 0):
    """Rank ``src``'s ``obj`` (picklable), on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def first_to_fail(timeout_s: float = 5.0) -> bool:
    """True on the one rank of a failing multi-process job that should print the error: the first to ask.

    The ranks ask torchrun's key-value store (hosted by its agent, so it outlives any worker, and reachable before
    the process group exists). A rank whose error only follows from another's (a peer closed the connection) asks
    after that rank did, so it stays quiet. Without torchrun's store every failing rank prints.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return True
    rank = os.environ.get("RANK", "0")
    key = f"twell/first_failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return store.compare_set(key, "", rank).decode() == rank
    except Exception:  # no store to ask (the agent is gone): better twice than never
        return True


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
