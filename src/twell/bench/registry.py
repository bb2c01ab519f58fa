"""Named FFN implementations for the benchmark, resolved lazily.

Inference contract: ``fn(x, w_gate, w_up, w_down_t) -> out`` with x bf16 [M, D], w_gate/w_up
bf16 [H, D], w_down_t = W_down.T contiguous bf16 [H, D] (prepared once, outside the timed
region), out bf16 [M, D].

Training contract: ``fn(x, w_gate, w_up, w_down) -> (out, l1)`` differentiable with respect to
all four (leaf tensors requiring grad, nn.Linear layouts), where
``l1`` = |h| summed over hidden units (fp32), mean over tokens, where h = relu(x Wg^T) * (x Wu^T) is
the recipe's hidden activation (as in SparseFFN); the harness runs the backward.

A factory returns the callable or raises ImplUnavailable(reason); it runs only when the
implementation is asked for, so a registry can name kernels that do not build here.

A callable that runs only some shapes carries ``unsupported(M, D, H) -> str | None`` (the reason, or
None): the harness then records that case as unavailable for it, with the reason, instead of calling it
(a shape limit is a property of the implementation, not a wrong answer). The published kernels'
adapters (twell.bench.published: "published-twell", "published-hybrid") are registered from a
directory with :func:`twell.bench.published.register`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class ImplUnavailable(RuntimeError):
    """The implementation cannot run here (the message says why)."""


@dataclass
class Registry:
    """name -> factory, separately for inference and training implementations."""

    inference: dict[str, Callable[[], Callable]] = field(default_factory=dict)
    training: dict[str, Callable[[], Callable]] = field(default_factory=dict)

    def register(self, name: str, factory: Callable[[], Callable], kind: str = "inference") -> None:
        table = self._table(kind)
        if name in ("dense", "gate"):
            raise ValueError(f"{name!r} is reserved for the baselines; pick another implementation name")
        if name in table:
            raise ValueError(f"{kind} implementation {name!r} is already registered")
        table[name] = factory

    def register_fn(self, name: str, fn: Callable, kind: str = "inference") -> None:
        """Register a ready callable (no lazy import needed)."""
        self.register(name, lambda: fn, kind)

    def resolve(self, name: str, kind: str = "inference") -> Callable:
        """The callable, or ImplUnavailable (unknown name, or its factory says why not)."""
        table = self._table(kind)
        if name not in table:
            raise ImplUnavailable(f"unknown {kind} implementation {name!r}; registered: {sorted(table)}")
        return table[name]()

    def names(self, kind: str = "inference") -> list[str]:
        return list(self._table(kind))

    def _table(self, kind: str) -> dict:
        if kind not in ("inference", "training"):
            raise ValueError(f"kind must be 'inference' or 'training', got {kind!r}")
        return self.inference if kind == "inference" else self.training


def unsupported_reason(fn: Callable, M: int, D: int, H: int) -> str | None:
    """Why ``fn`` cannot run a case of [M, D] x [H, D] (its ``unsupported`` attribute), or None."""
    check = getattr(fn, "unsupported", None)
    return check(M, D, H) if check is not None else None


def _twell_kernel() -> Callable:
    return _kernels().sparse_gated_ffn  # internal TwELL: tile 256, compression 16 (SPARSE_FFN_COMPRESSION)


def _kernels():
    from twell import kernels

    ok, why = kernels.available()
    if not ok:
        raise ImplUnavailable(f"twell.kernels not available: {why}")
    return kernels


def _twell_kernel_ops() -> Callable:
    """The gate op (the published compression 8), then the fused op with the per-row kernel only: the
    route a caller that keeps the TwELL takes. Against "twell-kernel" (one op at compression 16 whose
    fused kernel overlaps the gate's last wave) it gives up about 0.3-2% (docs/kernels.md §6)."""
    kernels = _kernels()

    def fn(x, w_gate, w_up, w_down_t):
        return kernels.twell_gated_ffn(x, kernels.twell_gate(x, w_gate), w_up, w_down_t, union=(0.0, 0.0))

    return fn


def _twell_kernel_union() -> Callable:
    from twell.reference.ffn import SPARSE_FFN_COMPRESSION, UNION_BLOCK, UNION_RULE

    kernels = _kernels()

    def fn(x, w_gate, w_up, w_down_t):
        # What a SparseFFN layer runs once choose_union_paths gave it the rule: the one op with the
        # block-union path for the 64-row blocks the rule picks, per-row elsewhere (the kernels in
        # turn: the union plan reads the whole TwELL first).
        return kernels.sparse_gated_ffn(x, w_gate, w_up, w_down_t, union=UNION_RULE)

    def describe(x, w_gate, w_up, w_down_t) -> dict:
        """How many 64-row blocks the rule sent to the block-union path on these inputs."""
        gate = kernels.twell_gate(x, w_gate, compression=SPARSE_FFN_COMPRESSION)
        plan = kernels.union_plan(x, gate, w_up, w_down_t, *UNION_RULE)
        return {"union_rule": list(UNION_RULE), "union_blocks": plan["union_blocks"],
                "blocks": -(-x.shape[0] // UNION_BLOCK), "per_row_rows": plan["per_row_rows"]}

    fn.describe = describe
    return fn


def _twell_reference() -> Callable:
    from twell.reference import sparse_gated_ffn

    return sparse_gated_ffn


def _twell_train_kernel() -> Callable:
    from twell.kernels.training import train_gated_ffn

    _kernels()

    def fn(x, w_gate, w_up, w_down):
        return train_gated_ffn(x, w_gate, w_up, w_down)[:2]

    return fn


def _twell_train_kernel_hot() -> Callable:
    """The training op with its hot neurons (active on at least HOT_MIN_FREQ of the rows) as dense columns,
    the set chosen once from the case's own gate activity on the first call and kept for the timed calls, as
    a trainer keeps the set chosen from earlier steps (the generator's neurons keep their rates from batch to
    batch: each has its own offset; a trained layer's change slowly)."""
    from twell.kernels.training import train_gated_ffn
    from twell.reference import training as rt

    _kernels()
    chosen: dict = {}

    def hot_set(x, w_gate):
        # keyed by the data's addresses while the keyed tensors are held here: a freed case's memory, handed by
        # the allocator to the next case of the same size, would otherwise match (views such as .detach() do)
        key = (x.data_ptr(), w_gate.data_ptr(), tuple(x.shape), tuple(w_gate.shape))
        if chosen.get("key") != key:
            hot = rt.choose_hot(rt.gate_counts(x, w_gate), x.shape[0], rt.HOT_MIN_FREQ)
            chosen.update(key=key, held=(x, w_gate), hot=hot)  # one case at a time
        return chosen["hot"]

    def fn(x, w_gate, w_up, w_down):
        return train_gated_ffn(x, w_gate, w_up, w_down, hot=hot_set(x, w_gate))[:2]

    def describe(x, w_gate, w_up, w_down) -> dict:
        """The hot set's size and the share of these inputs' active (row, neuron) pairs it takes."""
        hot, counts = hot_set(x, w_gate), rt.gate_counts(x, w_gate)
        total = max(1, int(counts.sum()))
        return {"hot_min_freq": rt.HOT_MIN_FREQ, "hot_neurons": int(hot.numel()),
                "hot_pair_share": round(int(counts[hot].sum()) / total, 4)}

    fn.describe = describe
    return fn


def default_registry() -> Registry:
    """A fresh registry with "twell-kernel" (CUDA, sm_90a: the one-op sparse FFN, as a SparseFFN layer
    runs it), "twell-kernel-ops" (its gate and fused ops called one after the other, as a layer that
    keeps its TwELL does), "twell-kernel-union" (the one op with the fitted block-union rule,
    twell.reference.ffn.UNION_RULE, as a layer given the rule by choose_union_paths runs it) and
    "twell-reference" (pure PyTorch); for training, "twell-train-kernel" (twell.kernels.training) and
    "twell-train-kernel-hot" (the same with its hot neurons as dense columns)."""
    reg = Registry()
    reg.register("twell-kernel", _twell_kernel)
    reg.register("twell-kernel-ops", _twell_kernel_ops)
    reg.register("twell-kernel-union", _twell_kernel_union)
    reg.register("twell-reference", _twell_reference)
    reg.register("twell-train-kernel", _twell_train_kernel, kind="training")
    reg.register("twell-train-kernel-hot", _twell_train_kernel_hot, kind="training")
    return reg
