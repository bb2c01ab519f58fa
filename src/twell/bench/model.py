"""``python -m twell.bench model``: a whole model, dense against sparse, as the paper's main table.

For a trained sparse checkpoint (a directory or a hub id) this measures, in one process and
alternating where it times (shared/BENCHMARK.md):

- **prefill**: tokens/ms of a forward over ``batch x seq`` tokens, per prefill batch;
- **decode**: tokens/s of greedy ``generate`` with a KV cache after a prompt (the prompt's own
  forward taken out: the time of ``max_new_tokens=1`` is subtracted), per decode batch;
- **energy**: J per token from NVML's total-energy counter around loops of the prefill calls;
- **memory**: peak GPU memory above the loaded model during each measurement;
- **training**: tokens/s and peak memory of optimizer steps (forward, backward with the L1 term,
  AdamW), the sparse run on the sparse training kernels (``twell.nn.sparse_training``, layers
  routed by their measured activity) against the dense path; with ``train_compile`` each decoder
  layer is compiled first (``torch.compile``, both sides, as ``train.compile`` does in training).

The dense side is the dense twin when ``dense_checkpoint`` is given (the paper's comparison: a model
trained without L1 on the dense path), else the same checkpoint on the dense path. Every result
records the model's active neurons per token per layer and its cross-entropy on the measured tokens
(real text when ``tokens`` names a prepared data directory or a ``.npy`` of ids; random ids otherwise,
which say nothing about activity and are labelled so), the device and the code. On a CPU the same
code runs (for a smoke test): its numbers are not GPU numbers, and the result says so.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from twell.bench.memory import peak_memory_above_baseline
from twell.bench.provenance import code_line, dirty_line
from twell.bench.timing import time_alternating

# What the paper reports for its four scales (8x H100 PCIe, sequence 2048, L1 2e-5), sparse against
# dense. Per scale where the text gives it; the ranges span its scales.
PAPER = {
    "inference": {"0.5B": 0.17, "2B": 0.205},
    "inference_range": (0.17, 0.205),
    "training_range": (-0.015, 0.219),
    "energy_range": (-0.17, -0.12),
    "setting": "8x H100 PCIe, sequence 2048, FineWeb-Edu models, L1 2e-5",
}


@dataclasses.dataclass
class ModelBenchConfig:
    checkpoint: str
    dense_checkpoint: Optional[str] = None
    label: Optional[str] = None                  # e.g. "0.5B"; default: the checkpoint's name
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    sparse_path: str = "auto"                    # SparseFFN inference path of the sparse side
    prefill_batches: tuple[int, ...] = (8, 32)
    seq_len: Optional[int] = None                # default: min(2048, the model's context)
    decode_batches: tuple[int, ...] = (1, 32)
    prompt_len: int = 512
    new_tokens: int = 256
    train_batch: int = 8                         # sequences per training step (0: no training rows)
    train_steps: int = 5                         # timed steps per side (after 2 untimed)
    train_compile: bool = False                  # training rows with each decoder layer compiled (both sides)
    # the sparse side's training threshold (a fraction of H); None: timed as python -m twell.train's default does
    # (twell.train.calibration, on a GPU at forwards of at least the row floor; the fixed default elsewhere)
    train_max_active: Optional[float] = None
    # the sparse side's hot neurons (twell.reference.training.choose_hot): a layer on the kernels computes the
    # neurons active on at least this fraction of the step's rows (counted on its tokens) as dense columns
    train_hot: Optional[float] = None
    # how the sparse side's layers get their routes: "activity" (the threshold, as python -m twell.train does)
    # or "timed" (each layer's routes timed on its own input of the routing forward: dense, the op, and with
    # train_hot the op with the layer's hot neurons; twell.train.calibration.time_layer)
    train_routes: str = "activity"
    l1_coef: float = 2e-5
    reps: int = 10
    warmup: int = 2
    energy: bool = True
    energy_seconds: float = 2.0
    decode_static: bool = True                   # also decode with a static KV cache, compiled (CUDA graphs)
    decode_graph: bool = True                    # also greedy decode with each step replayed from a CUDA graph
    decode_compile: Optional[str] = None         # torch.compile backend of one more graph row ("inductor" on a GPU)
    token_check: bool = True                     # greedy tokens of the sparse weights, sparse path vs dense path
    tokens: Optional[str] = None                 # prepared data dir or .npy of token ids (default: random ids)
    tokens_split: str = "val"
    seed: int = 0

    def check(self) -> None:
        for name in ("prefill_batches", "decode_batches"):
            v = getattr(self, name)
            if any((not isinstance(b, int)) or b < 1 for b in v):
                raise ValueError(f"{name} must be positive integers, got {v}")
        for name in ("prompt_len", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (decode speed is measured past the first), got {self.new_tokens}")
        if self.train_batch < 0 or self.train_steps < 1 or self.warmup < 0:
            raise ValueError("train_batch must be >= 0, train_steps >= 1 and warmup >= 0")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.train_routes not in ("activity", "timed"):
            raise ValueError(f"train_routes must be activity or timed, got {self.train_routes!r}")
        for name in ("train_max_active", "train_hot"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"{name} must be a fraction in (0, 1], got {v}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load(path: str, ffn_path: str, device: torch.device):
    from twell.model import load_pretrained

    model, _ = load_pretrained(path, ffn_path=ffn_path, device=device, dtype=torch.bfloat16, load_tokenizer=False)
    model.eval()
    return model


def _token_ids(cfg: ModelBenchConfig, count: int, vocab: int) -> tuple[torch.Tensor, dict]:
    """``count`` token ids: real text from cfg.tokens, else uniform random ids (labelled)."""
    if cfg.tokens:
        from twell.bench.captured import read_tokens

        ids, where = read_tokens(cfg.tokens, count, cfg.tokens_split)
        ids = torch.from_numpy(np.asarray(ids[:count], dtype=np.int64))
        if int(ids.max()) >= vocab:
            raise ValueError(f"token id {int(ids.max())} of {cfg.tokens} is outside the model's vocabulary ({vocab})")
        return ids, {**where, "kind": "text"}
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(0, vocab, (count,), generator=g), {
        "kind": "random ids", "note": "uniform random token ids: activity and CE are not those of text"}


@torch.inference_mode()
def model_activity(model, ids: torch.Tensor) -> dict:
    """Active FFN neurons per token per layer and the mean cross-entropy of next-token prediction on
    ``ids`` [B, T] (the model's dense path records the statistics; its paths are restored)."""
    from twell.model import set_tracking, sparse_ffns

    ffns = sparse_ffns(model)
    set_tracking(model, True)
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        active = [float(f.stats.active_per_token.float().mean()) for f in ffns]
    finally:
        set_tracking(model, False)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                           ids[:, 1:].reshape(-1))
    H = ffns[0].intermediate_size if ffns else 0
    return {"active_per_layer": active, "active_mean": float(np.mean(active)) if active else None,
            "active_frac": float(np.mean(active)) / H if active else None, "intermediate_size": H, "ce": float(ce)}


def _energy(fn: Callable[[], object], device: torch.device, seconds: float, tokens: int) -> Optional[float]:
    from twell.bench.energy import EnergyMeter, EnergyUnavailable

    try:
        meter = EnergyMeter(device)
    except EnergyUnavailable:
        return None
    return meter.measure(fn, seconds).per_token(tokens)


def _generate(model, prompt: torch.Tensor, new: int, pad: int) -> torch.Tensor:
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=pad, use_cache=True)


def _generate_static(model, prompt: torch.Tensor, new: int, pad: int) -> torch.Tensor:
    """Greedy generate with a static KV cache, which transformers compiles (CUDA graphs: launch overhead
    out of the comparison, as BENCHMARK.md asks for decoding)."""
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=pad, use_cache=True,
                          cache_implementation="static")


_COMPILED_STEPS = "_twell_compiled_steps"


def _compiled(model, backend: str):
    """``torch.compile(model, backend=backend)``, one per model and backend, kept in the model's own
    ``__dict__`` (not a submodule; freed with the model)."""
    per = model.__dict__.setdefault(_COMPILED_STEPS, {})
    if backend not in per:
        per[backend] = torch.compile(model, backend=backend, dynamic=False)
    return per[backend]


def _cache_argument(model, cache) -> dict:
    """The KV cache as the keyword the model's forward takes: ``cache`` in the transformers releases that
    renamed it (they warn that ``past_key_values`` goes away in 5.40), ``past_key_values`` in the older
    ones pyproject still admits, where an unknown ``cache`` would be swallowed by ``**kwargs`` and the
    steps would run without a cache."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def static_greedy(model, prompt: torch.Tensor, new: int, graph: bool = True,
                  compile_backend: Optional[str] = None,
                  cache_len: Optional[int] = None, forced: Optional[torch.Tensor] = None,
                  scores: bool = False) -> tuple:
    """Greedy decoding of ``new`` tokens after ``prompt`` with a static KV cache: ``(tokens [b, new], seconds)``,
    the seconds those of the ``new - 1`` steps after the prompt's forward. With ``graph`` (CUDA) each step's
    forward and argmax replay one CUDA graph, so launch overhead does not decide the comparison
    (BENCHMARK.md); otherwise the same steps run eagerly. ``compile_backend`` (e.g. ``"inductor"``) compiles
    the step's forward first, which fuses the small kernels around the FFN (norms, rotary embedding,
    attention's reshapes) for both paths alike; the prompt's forward stays eager. Same tokens as ``generate``
    with greedy search (a compiled step may round differently: its tokens can part at a near-tie).
    ``cache_len`` (default ``P + new``) sizes the KV cache: a compiled step is compiled per cache length,
    so calls that should share it pass the same one. ``forced`` ([b, new] token ids): each step is fed
    the forced token instead of its own prediction (teacher forcing), so every step of two models can be
    compared on the same history. ``scores``: also return the top-2 logits of every step ([b, new, 2], fp32):
    ``(tokens, seconds, top2)``."""
    from transformers import StaticCache

    b, P = prompt.shape
    device = prompt.device
    if cache_len is not None and cache_len < P + new:
        raise ValueError(f"cache_len {cache_len} cannot hold the prompt ({P}) and {new} new tokens")
    cache = StaticCache(config=model.config, max_cache_len=cache_len or P + new)
    with_cache = _cache_argument(model, cache)
    if forced is not None and tuple(forced.shape) != (b, new):
        raise ValueError(f"forced must hold [{b}, {new}] token ids, got {tuple(forced.shape)}")
    logits = model(input_ids=prompt, **with_cache, cache_position=torch.arange(P, device=device),
                   use_cache=True).logits[:, -1]
    out = torch.empty(b, new, dtype=torch.long, device=device)
    out[:, 0] = logits.argmax(-1)
    top2 = torch.empty(b, new, 2, dtype=torch.float32, device=device) if scores else None
    if scores:
        top2[:, 0] = logits.float().topk(2, -1).values
    feed = out if forced is None else forced
    ids = out.new_empty((b, 1)).copy_(feed[:, :1])  # its own strides, whatever new is (a compiled step guards them)
    pos = torch.tensor([P], device=device)

    fwd = model if compile_backend is None else _compiled(model, compile_backend)

    def step():
        last = fwd(input_ids=ids, **with_cache, cache_position=pos, use_cache=True).logits[:, -1]
        return (last.argmax(-1), last.float().topk(2, -1).values) if scores else last.argmax(-1)

    # Warm-up steps (before a capture) write position P's cache entry, which the first real step writes
    # again; but transformers' static cache layers also count the tokens they hold (cumulative_length, the
    # slot of the next write, whatever cache_position says), so the counters are put back after them.
    counters = [c for c in (getattr(layer, "cumulative_length", None) for layer in getattr(cache, "layers", []))
                if isinstance(c, torch.Tensor)]
    saved = [c.clone() for c in counters]

    def restore() -> None:
        for c, v in zip(counters, saved):
            c.copy_(v)

    run = step
    if graph and device.type == "cuda" and new > 1:
        from twell.bench.timing import graphed

        replay, nxt = graphed(step, device, after_warmup=restore)

        def run():
            replay()
            return nxt
    elif new > 1:
        step()  # the same warm-up without a graph, so that both loops start from the same restored state
        restore()
    _sync(device)
    t0 = time.perf_counter()
    for i in range(1, new):
        tok = run()
        if scores:
            tok, top2[:, i] = tok
        out[:, i] = tok
        ids.copy_(tok[:, None] if forced is None else forced[:, i:i + 1])
        pos += 1
    _sync(device)
    secs = time.perf_counter() - t0
    return (out, secs, top2) if scores else (out, secs)


def _first_diffs(a: torch.Tensor, b: torch.Tensor) -> list:
    """Per row of two [rows, tokens] token tensors: the index of the first token where they differ, or None."""
    diff = [(a[r] != b[r]).nonzero() for r in range(a.shape[0])]
    return [None if d.numel() == 0 else int(d[0]) for d in diff]


def _graph_decode_row(models: dict, prompt: torch.Tensor, cfg: "ModelBenchConfig", device: torch.device,
                      compile_backend: Optional[str] = None) -> dict:
    """decode-graph (eager step) or decode-compiled-graph (``compile_backend``) row. When both sides hold the
    same weights (no dense twin), ``tokens_same`` compares their greedy tokens of the last timed run and
    ``first_diff`` gives the first differing new token per row."""
    b = prompt.shape[0]
    row = {"measure": "decode-graph" if compile_backend is None else "decode-compiled-graph", "batch": b,
           "prompt": cfg.prompt_len, "new_tokens": cfg.new_tokens}
    if compile_backend is not None:
        row["compile_backend"] = compile_backend
    reps = max(1, cfg.reps // 3)
    toks = {}
    n_cache = cfg.prompt_len + cfg.new_tokens  # one cache length: one compiled step per side and batch
    n_check = min(8, cfg.new_tokens)  # tokens of the checks before timing
    # A compiled step past dynamo's recompile limit would run eagerly under this row's name: fail instead.
    # Each side and batch compiles once (one code object for all of them): room for a few dozen.
    limits = {name: v for name, v in (("fail_on_recompile_limit_hit", True), ("recompile_limit", 32))
              if hasattr(torch._dynamo.config, name)}
    with torch._dynamo.config.patch(**limits):
        for side, m in models.items():
            # warm-up (the sparse layers' first-call measurement happens eagerly), and a check that replaying
            # the graph decodes what the same steps decode without it (eager, or compiled: a compiled step may
            # round differently from the eager one, which is recorded)
            eager, _ = static_greedy(m, prompt, n_check, graph=False, cache_len=n_cache)
            plain = eager if compile_backend is None else static_greedy(
                m, prompt, n_check, graph=False, compile_backend=compile_backend, cache_len=n_cache)[0]
            graphed, _ = static_greedy(m, prompt, n_check, compile_backend=compile_backend, cache_len=n_cache)
            if not torch.equal(plain, graphed):
                raise RuntimeError(f"{side}: the CUDA-graph decoder's tokens differ from the same steps without "
                                   f"the graph ({graphed.tolist()} vs {plain.tolist()})")
            times = []
            for _ in range(reps):
                toks[side], secs = static_greedy(m, prompt, cfg.new_tokens, compile_backend=compile_backend,
                                                 cache_len=n_cache)
                times.append(secs)
            secs = float(np.median(times))
            row[side] = {"seconds": secs, "tokens_per_s": b * (cfg.new_tokens - 1) / secs,
                         "peak_bytes": peak_memory_above_baseline(
                             lambda: static_greedy(m, prompt, cfg.new_tokens, compile_backend=compile_backend,
                                                   cache_len=n_cache), device)}
            if compile_backend is not None:
                row[side]["first_tokens_match_eager"] = bool(torch.equal(eager, graphed))
    if cfg.dense_checkpoint is None:  # a twin's tokens are another model's: nothing to compare
        row["first_diff"] = _first_diffs(toks["dense"], toks["sparse"])
        row["tokens_same"] = all(f is None for f in row["first_diff"])
    row["speedup"] = row["sparse"]["tokens_per_s"] / row["dense"]["tokens_per_s"]
    return row


def _decode_row(models: dict, prompt: torch.Tensor, cfg: "ModelBenchConfig", pad: int, device: torch.device,
                gen: Callable, mode: str) -> dict:
    b = prompt.shape[0]
    row = {"measure": "decode" if mode == "eager" else f"decode-{mode}", "batch": b, "prompt": cfg.prompt_len,
           "new_tokens": cfg.new_tokens}
    for side, m in models.items():
        gen(m, prompt, 2, pad)  # warm-up (compiles; the sparse layers' first-call measurement)
        gen(m, prompt, cfg.new_tokens, pad)
    for side, m in models.items():
        full = _timed(lambda: gen(m, prompt, cfg.new_tokens, pad), device, max(1, cfg.reps // 3))
        first = _timed(lambda: gen(m, prompt, 1, pad), device, max(1, cfg.reps // 3))
        decode_s = max(full - first, 1e-9)
        row[side] = {"seconds": full, "prompt_seconds": first, "tokens_per_s": b * (cfg.new_tokens - 1) / decode_s,
                     "peak_bytes": peak_memory_above_baseline(lambda: gen(m, prompt, cfg.new_tokens, pad), device)}
    row["speedup"] = row["sparse"]["tokens_per_s"] / row["dense"]["tokens_per_s"]
    return row


def graph_token_check(model, prompt: torch.Tensor, new: int, sparse_path: str = "auto") -> dict:
    """The greedy tokens of :func:`static_greedy` (the timed decoder), sparse weights on the sparse path
    against the dense path: ``same`` and the first differing new token per row. Then ``forced``: both paths
    fed the dense path's tokens (teacher forcing), so that every step is compared on the same history, not
    only those before a first divergence: the steps whose predictions differ and whether each is a near-tie
    (the dense path's top-2 margin within 4 bf16 steps of its top logit, as in :func:`greedy_token_check`)."""
    from twell.model import set_ffn_path

    toks, top = {}, {}
    try:
        for path in ("dense", sparse_path):
            set_ffn_path(model, path)
            static_greedy(model, prompt, 2)
            toks[path] = static_greedy(model, prompt, new)[0]
        forced = toks["dense"]
        for path in ("dense", sparse_path):
            set_ffn_path(model, path)
            pred, _, top[path] = static_greedy(model, prompt, new, forced=forced, scores=True)
            toks["forced " + path] = pred
    finally:
        set_ffn_path(model, sparse_path)
    first = _first_diffs(toks["dense"], toks[sparse_path])
    differ = (toks["forced dense"] != toks["forced " + sparse_path]).nonzero().tolist()
    d = top["dense"]
    at = [{"row": r, "step": i, **_tie(d[r, i, 0], d[r, i, 1])} for r, i in differ]
    return {"same": all(f is None for f in first), "first_diff": first, "new_tokens": new,
            "forced": {"steps": int(forced.numel()), "differ": at,
                       "dense_reproduces_itself": bool(torch.equal(toks["forced dense"], forced)),
                       "all_near_ties": all(a["near_tie"] for a in at)}}


def _tie(top1: torch.Tensor, top2: torch.Tensor) -> dict:
    """The dense path's top-2 logits at a step where the paths' tokens differ: their ``margin``, ``bf16_step``
    (the bf16 spacing at the top logit) and ``near_tie`` (the margin within 4 such steps, BENCHMARK.md)."""
    margin = float(top1 - top2)
    step = float(torch.finfo(torch.bfloat16).eps) * max(abs(float(top1)), 1e-30)
    return {"margin": margin, "bf16_step": step, "near_tie": bool(margin <= 4 * step)}


def greedy_token_check(model, prompt: torch.Tensor, new: int, pad: int, sparse_path: str = "auto") -> dict:
    """Greedy tokens of one model on its sparse path against the same weights on the dense path.

    Returns ``same`` (every token equal), ``first_diff`` (index of the first differing new token per
    row, or None), and at that step the dense path's top-2 logit ``margin`` with ``bf16_step``, the bf16
    spacing at the top logit: a divergence where the margin is within a few such steps is a near-tie
    (BENCHMARK.md), anything else a failure of the sparse path."""
    from twell.model import set_ffn_path

    outs = {}
    try:
        for path in ("dense", sparse_path):
            set_ffn_path(model, path)
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad, use_cache=True,
                                 output_scores=True, return_dict_in_generate=True)
            outs[path] = out
    finally:
        set_ffn_path(model, sparse_path)
    d, s = outs["dense"], outs[sparse_path]
    P = prompt.shape[1]
    dt, st = d.sequences[:, P:], s.sequences[:, P:]
    rows = []
    for r, i in enumerate(_first_diffs(dt, st)):
        if i is None:
            rows.append({"first_diff": None})
            continue
        top = d.scores[i][r].float().topk(2).values
        rows.append({"first_diff": i, **_tie(top[0], top[1])})
    return {"same": all(r["first_diff"] is None for r in rows), "rows": rows, "new_tokens": new,
            "all_divergences_near_ties": all(r["first_diff"] is None or r["near_tie"] for r in rows)}


def _timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` synchronized calls (generate is host-driven: wall time)."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _threshold(ffns, rows: int, device: torch.device, compiled: bool, max_active: Optional[float]):
    """(max_active, source, keep_max, calibration record or None) of the sparse side's SparseTraining: timed
    as the trainer times it, where the op can run the layers at these rows; the fixed default elsewhere."""
    from twell.nn.sparse_training import MAX_ACTIVE, MIN_ROWS

    from twell import kernels
    from twell.train.calibration import calibrate, can_time

    if max_active is not None:
        return max_active, "set", None, None
    if device.type != "cuda" or not can_time(ffns, rows, MIN_ROWS) or not kernels.available()[0]:
        return MAX_ACTIVE, "set", None, None
    f = ffns[0]
    cal = calibrate(f.hidden_size, f.intermediate_size, rows, device, compiled_dense=compiled)
    return cal.max_active, "timed", cal.keep_max, cal.as_dict()


def _train_steps(model, ids: torch.Tensor, steps: int, warmup: int, coef: float, sparse: bool,
                 device: torch.device, compile_layers: bool = False, max_active: Optional[float] = None,
                 hot_min_freq: Optional[float] = None, routes_by: str = "activity") -> dict:
    """tokens/s and peak memory of optimizer steps on a copy of ``model`` (the original is untouched);
    ``compile_layers``: each decoder layer compiled after the routes are set (compiled in the untimed steps);
    ``hot_min_freq``: hot neurons chosen from the routing forward's gate activity; ``routes_by`` "timed": each
    layer's route timed on its own input of the routing forward (ModelBenchConfig.train_routes)."""
    from twell.model import set_tracking, sparse_ffns
    from twell.nn.sparse_training import COMPILED_WHY, SparseTraining, use_sparse_training
    from twell.train.recipe import sparse_lm_loss

    # The compiled decoding steps cached on the model (decode-compiled-graph rows) cannot be copied.
    compiled = model.__dict__.pop(_COMPILED_STEPS, None)
    try:
        m = copy.deepcopy(model).train()
    finally:
        if compiled is not None:
            model.__dict__[_COMPILED_STEPS] = compiled
    for p in m.parameters():
        p.requires_grad_(True)
    set_tracking(m, True)
    ffns = sparse_ffns(m)
    routes = calibration = layer_timings = None
    tokens = ids.shape[0] * (ids.shape[1] - 1)  # rows of each forward
    timed = False
    if sparse and routes_by == "timed" and device.type == "cuda":
        from twell import kernels
        from twell.nn.sparse_training import MIN_ROWS
        from twell.train.calibration import can_time

        # forwards under the row floor train dense whatever a timing says; without kernels nothing can be timed
        timed = can_time(ffns, tokens, MIN_ROWS) and kernels.available()[0]
    if timed:  # the threshold is not used: every layer's route comes from its own timings
        from twell.nn.sparse_training import MAX_ACTIVE

        max_active, source, keep = MAX_ACTIVE if max_active is None else max_active, "not used", None
    elif sparse:
        max_active, source, keep, calibration = _threshold(ffns, tokens, device, compile_layers, max_active)
    if sparse:
        backend = use_sparse_training(m, SparseTraining(max_active=max_active, threshold_source=source,
                                                        keep_max=keep))
        from twell.nn.ffn import ffn_inputs
        from twell.reference.training import choose_hot, gate_counts

        seen = [None] * len(ffns)  # per layer: its input (timed routes) or its gate's counts (hot sets alone)

        def on_input(i, x):
            seen[i] = x if timed else (gate_counts(x, ffns[i].gate_proj.weight), x.shape[0])

        with torch.no_grad(), ffn_inputs(ffns if timed or hot_min_freq is not None else [], on_input):
            m(input_ids=ids[:, :-1], use_cache=False)  # the routes from the activity on the training forward's rows
        backend.update(ffns, [float(f.stats.active_per_token.float().mean()) for f in ffns])
        if timed:
            from twell.train.calibration import time_layer

            layer_timings = []
            for i, f in enumerate(ffns):
                t, hot = time_layer(seen[i], f.gate_proj.weight, f.up_proj.weight, f.down_proj.weight,
                                    compiled_dense=compile_layers, hot_min_freq=hot_min_freq)
                seen[i] = None
                backend.set_route(f, t["route"], t["why"], hot)
                layer_timings.append(t)
        elif hot_min_freq is not None:
            for f, (counts, rows) in zip(ffns, seen):
                if backend.route(f) == "sparse":
                    backend.set_hot(f, choose_hot(counts, rows, hot_min_freq))
        del seen
        # "hot": a sparse route with hot neurons
        routes = ["hot" if backend.layer(f).hot is not None else backend.route(f) for f in ffns]
    if compile_layers:
        from torch._dynamo.utils import counters
        from twell.train.parallel import apply_compile
        counters.clear()
        apply_compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        logits = m(input_ids=ids[:, :-1], use_cache=False).logits
        parts = sparse_lm_loss(logits, ids[:, 1:], ffns, coef)
        parts.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for f in ffns:
            f.stats = None

    for _ in range(max(warmup, 2 if compile_layers else 0)):
        step()
    peak = peak_memory_above_baseline(step, device)
    secs = _timed(step, device, steps)
    # why layers trained dense (the last step's Routes): too active, or a layer the training op cannot run
    # (a compiled call carries a fixed reason, COMPILED_WHY: each layer's own is in its training state)
    notes = sorted({f.last_route.reason.replace(COMPILED_WHY, f.train_state.why) if f.train_state is not None
                    else f.last_route.reason
                    for f in ffns if f.last_route is not None and f.last_route.op == "dense"})
    if compile_layers:  # what the compiler did: a graph break or a fall-back to eager would show here
        breaks = sum(counters["graph_break"].values())
        notes.append(f"compiled: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks"
                     + (f" ({', '.join(sorted(counters['graph_break']))[:300]})" if breaks else ""))
    del m, opt
    if sparse and routes_by == "timed" and not timed:
        notes.append("routes by activity: timing each layer's routes needs a GPU with the kernels, layers the op "
                     "can run and forwards of at least the row floor")
    if sparse and not timed:
        notes.append(f"threshold {100 * max_active:.2f}% of H ({source})")
        if hot_min_freq is not None:
            sizes = [0 if f.train_state is None or f.train_state.hot is None else int(f.train_state.hot.numel())
                     for f in ffns]
            notes.append(f"hot neurons (active on >= {100 * hot_min_freq:g}% of rows) per layer: {sizes}")
    out = {"seconds_per_step": secs, "tokens_per_s": tokens / secs, "peak_bytes": peak, "routes": routes,
           "notes": notes}
    if calibration is not None:
        out["calibration"] = calibration
    if layer_timings is not None:
        out["layer_timings"] = layer_timings
        notes.append("routes timed per layer on its own rows: " + "; ".join(
            f"layer {i} {t['route']} ({t['why'].split(': ', 1)[1]})" for i, t in enumerate(layer_timings)))
    return out


def run_model_bench(cfg: ModelBenchConfig, progress: bool = True, allow_dirty: bool = False) -> dict:
    """All measurements of one checkpoint; a JSON-ready dict (``rows``: one per measure and batch). A GPU run
    from a tree with local changes raises :class:`twell.bench.provenance.DirtyTreeError` before a model is
    loaded, unless ``allow_dirty``: then its record says so."""
    from twell.bench.provenance import run_meta
    from twell.progress import progress_bar

    cfg.check()
    device = torch.device(cfg.device)
    env = run_meta(device, allow_dirty=allow_dirty)  # the tree as the run starts
    sparse = _load(cfg.checkpoint, cfg.sparse_path, device)
    dense = _load(cfg.dense_checkpoint or cfg.checkpoint, "dense", device)
    mc = sparse.config
    seq = cfg.seq_len or min(2048, int(mc.max_position_embeddings))
    n_tok = max(max(cfg.prefill_batches, default=0) * seq, max(cfg.decode_batches, default=0) * cfg.prompt_len,
                cfg.train_batch * (seq + 1), seq)
    ids, source = _token_ids(cfg, n_tok, int(mc.vocab_size))
    pad = int(mc.pad_token_id if mc.pad_token_id is not None else (mc.eos_token_id if isinstance(mc.eos_token_id, int)
                                                                   else 0))
    models = {"dense": dense, "sparse": sparse}
    rows: list[dict] = []
    steps = (len(cfg.prefill_batches) + len(cfg.decode_batches) + (1 if cfg.train_batch else 0))
    bar = progress_bar(total=steps, desc="model bench", progress=progress)

    # activity and CE on the first prefill batch (both models: the dense twin's are its own)
    probe = ids[: min(cfg.prefill_batches, default=1) * seq].view(-1, seq).to(device)
    activity = {side: model_activity(m, probe) for side, m in models.items()}

    for b in cfg.prefill_batches:
        x = ids[: b * seq].view(b, seq).to(device)
        calls = {side: (lambda m=m: m(input_ids=x, use_cache=False)) for side, m in models.items()}
        with torch.inference_mode():
            t = time_alternating(calls, device, cfg.reps, cfg.warmup, flush_l2=False)
            row = {"measure": "prefill", "batch": b, "seq": seq, "tokens": b * seq}
            for side in models:
                r = {"ms": t[side].median_ms, "tokens_per_ms": b * seq / t[side].median_ms,
                     "peak_bytes": peak_memory_above_baseline(calls[side], device)}
                if cfg.energy:
                    r["joules_per_token"] = _energy(calls[side], device, cfg.energy_seconds, b * seq)
                row[side] = r
        row["speedup"] = row["sparse"]["tokens_per_ms"] / row["dense"]["tokens_per_ms"]
        rows.append(row)
        bar.update(1)

    decode_errors = {}
    for b in cfg.decode_batches:
        prompt = ids[: b * cfg.prompt_len].view(b, cfg.prompt_len).to(device)
        with torch.inference_mode():
            rows.append(_decode_row(models, prompt, cfg, pad, device, _generate, "eager"))
            if cfg.decode_static:
                try:
                    rows.append(_decode_row(models, prompt, cfg, pad, device, _generate_static, "static"))
                except Exception as exc:  # recorded in the result, the other measurements go on
                    decode_errors[f"static, batch {b}"] = f"{type(exc).__name__}: {exc}"[:500]
            if cfg.decode_graph:
                try:
                    rows.append(_graph_decode_row(models, prompt, cfg, device))
                except Exception as exc:
                    decode_errors[f"graph, batch {b}"] = f"{type(exc).__name__}: {exc}"[:500]
            if cfg.decode_compile:
                try:
                    rows.append(_graph_decode_row(models, prompt, cfg, device, cfg.decode_compile))
                except Exception as exc:
                    decode_errors[f"compiled graph, batch {b}"] = f"{type(exc).__name__}: {exc}"[:500]
        bar.update(1)
    token_check = None
    if cfg.token_check:
        prompt = ids[: cfg.prompt_len].view(1, cfg.prompt_len).to(device)
        with torch.inference_mode():
            token_check = greedy_token_check(sparse, prompt, cfg.new_tokens, pad, cfg.sparse_path)
            if cfg.decode_graph:
                try:
                    token_check["graph"] = graph_token_check(sparse, prompt, cfg.new_tokens, cfg.sparse_path)
                except Exception as exc:
                    decode_errors["graph token check"] = f"{type(exc).__name__}: {exc}"[:500]

    if cfg.train_batch:
        x = ids[: cfg.train_batch * (seq + 1)].view(cfg.train_batch, seq + 1).to(device)
        row = {"measure": "training-compiled" if cfg.train_compile else "training", "batch": cfg.train_batch,
               "seq": seq, "tokens": cfg.train_batch * seq}
        for side, m in models.items():
            row[side] = _train_steps(m, x, cfg.train_steps, cfg.warmup, cfg.l1_coef, side == "sparse", device,
                                     compile_layers=cfg.train_compile, max_active=cfg.train_max_active,
                                     hot_min_freq=cfg.train_hot, routes_by=cfg.train_routes)
        row["speedup"] = row["sparse"]["tokens_per_s"] / row["dense"]["tokens_per_s"]
        rows.append(row)
        bar.update(1)
    bar.close()

    return {
        # "started" (not run_meta's "timestamp") and the device's type: the names this JSON has always used
        "meta": {"started": env.pop("timestamp"), **env, "device": device.type, "config": dataclasses.asdict(cfg),
                 "note": None if device.type == "cuda" else "CPU run: a smoke test of the code, not GPU numbers",
                 "clock": "cuda-events (prefill), wall time (decode, training)" if device.type == "cuda"
                 else "perf_counter / wall time on a CPU"},
        "model": {"label": cfg.label or Path(str(cfg.checkpoint).rstrip("/")).name, "checkpoint": str(cfg.checkpoint),
                  "dense_checkpoint": cfg.dense_checkpoint, "layers": int(mc.num_hidden_layers),
                  "hidden": int(mc.hidden_size), "intermediate": int(mc.intermediate_size),
                  "trained": getattr(mc, "twell_tokenizer", None), "activity": activity, "tokens": source},
        "paper": PAPER,
        "rows": rows,
        "decode_errors": decode_errors,
        "token_check": token_check,
    }


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def markdown_report(res: dict) -> str:
    m, meta = res["model"], res["meta"]
    act = m["activity"]
    lines = [f"# Model benchmark: {m['label']} ({m['layers']} layers, D {m['hidden']}, H {m['intermediate']})", "",
             f"{meta['device_name']} ({meta['device']}), torch {meta['torch']}, started {meta['started']}; "
             f"checkpoint `{m['checkpoint']}`" + (f", dense twin `{m['dense_checkpoint']}`" if m["dense_checkpoint"]
                                                 else " (dense side: the same weights on the dense path)"), ""]
    if meta.get("note"):
        lines += [f"**{meta['note']}**", ""]
    lines += [f"Tokens: {m['tokens']['kind']}" + (f" ({m['tokens'].get('label', m['tokens'].get('tokens', ''))})"
                                                 if m['tokens']['kind'] == 'text' else f" ({m['tokens']['note']})"),
              "", "| side | active neurons per token (mean over layers) | % of H | CE on these tokens |",
              "|---|---|---|---|"]
    for side in ("dense", "sparse"):
        a = act[side]
        lines.append(f"| {side} | {_fmt(a['active_mean'], '.1f')} | {_fmt(100 * (a['active_frac'] or 0), '.2f')} "
                     f"| {_fmt(a['ce'], '.4f')} |")
    lines += ["", "| measure | batch | dense | sparse | sparse / dense | dense peak MB | sparse peak MB "
                  "| dense J/token | sparse J/token |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        unit = ("tokens_per_ms", "tok/ms") if r["measure"] == "prefill" else ("tokens_per_s", "tok/s")
        d, s = r["dense"], r["sparse"]
        mb = lambda v: _fmt(None if v is None else v / 2**20, ".0f")  # noqa: E731
        lines.append(f"| {r['measure']} | {r['batch']} | {_fmt(d[unit[0]], '.1f')} {unit[1]} | "
                     f"{_fmt(s[unit[0]], '.1f')} {unit[1]} | {_fmt(r['speedup'], '.3f')}x | {mb(d.get('peak_bytes'))} "
                     f"| {mb(s.get('peak_bytes'))} | {_fmt(d.get('joules_per_token'), '.3g')} "
                     f"| {_fmt(s.get('joules_per_token'), '.3g')} |")
    tr = [r for r in res["rows"] if r["measure"] in ("training", "training-compiled")]
    if tr and tr[0]["sparse"].get("routes"):
        lines += ["", f"Training routes of the sparse side (from its activity on these tokens, or timed per layer): "
                  f"{tr[0]['sparse']['routes']}"]
        if tr[0]["sparse"].get("notes"):
            lines.append(f"Notes of the sparse side's training: {'; '.join(tr[0]['sparse']['notes'])}")
        if tr[0]["measure"] == "training-compiled":
            lines.append(f"training-compiled: each decoder layer compiled (torch.compile), both sides; the dense "
                         f"side's compiler notes: {'; '.join(tr[0]['dense'].get('notes') or ['-'])}")
    if any(r["measure"] in ("decode-static", "decode-graph", "decode-compiled-graph") for r in res["rows"]):
        lines += ["", "decode: greedy generate, eager; decode-static: generate with a static KV cache (transformers "
                      "compiles the step where it can); decode-graph: greedy steps with a static KV cache, each step's "
                      "forward and argmax replayed from one CUDA graph (launch overhead out); decode-compiled-graph: "
                      "the same with the step compiled first (torch.compile fuses the kernels around the FFN). "
                      "Both sides alike."]
    for r in res["rows"]:
        if "tokens_same" in r:
            lines.append(f"{r['measure']}, batch {r['batch']}: the two sides' greedy tokens are "
                         + ("identical." if r["tokens_same"] else f"not identical (first differing new token per "
                                                                   f"row: {r['first_diff']})."))
    for k, v in (res.get("decode_errors") or {}).items():
        lines.append(f"Decode {k} failed: {v}")
    tc = res.get("token_check")
    if tc:
        diffs = [r for r in tc["rows"] if r["first_diff"] is not None]
        lines += ["", f"Greedy tokens, sparse weights on the sparse path against the dense path ({tc['new_tokens']} new "
                      f"tokens): " + ("identical." if tc["same"] else
                                      "first divergence at token " + ", ".join(
                                          f"{r['first_diff']} (top-2 margin {r['margin']:.3g}, bf16 step "
                                          f"{r['bf16_step']:.3g}: {'a near-tie' if r['near_tie'] else 'NOT a near-tie'})"
                                          for r in diffs) + ".")]
        if tc.get("graph"):
            g = tc["graph"]
            lines.append("Greedy tokens of the CUDA-graph decoder, same comparison: " + (
                "identical." if g["same"] else f"first divergence at new token(s) {g['first_diff']}."))
            f = g.get("forced")
            if f:
                near = sum(d["near_tie"] for d in f["differ"])
                lines.append(f"The same decoder fed the dense path's tokens (teacher forcing, {f['steps']} steps): "
                             + ("every step predicts the same token." if not f["differ"] else
                                f"{len(f['differ'])} step(s) predict another token, {near} of them near-ties "
                                "(dense top-2 margin within 4 bf16 steps)"
                                + ("." if near == len(f["differ"]) else ": THE OTHERS ARE NOT."))
                             + ("" if f["dense_reproduces_itself"] else
                                " (the dense path fed its own tokens did not reproduce them: nondeterministic decoder)"))
    lines += ["", f"python {meta.get('python', '-')}, torch {meta['torch']}, CUDA {meta.get('cuda') or '-'}; "
                  f"command: `{meta.get('command', '-')}`"]
    if meta.get("code"):
        lines += [code_line(meta["code"])]
    if dirty_line(meta):
        lines += [dirty_line(meta)]
    return "\n".join(lines) + "\n"


def write_outputs(res: dict, out_dir: Path, tag: str = "") -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = res["meta"]["started"].replace("-", "").replace(":", "").split("+")[0]
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{res['model']['label']}-{res['meta']['device_name']}")
    stem = f"model-{slug}-{stamp}{'-' + tag if tag else ''}"
    # appended, not Path.with_suffix: a label such as "0.5B" puts a dot in the stem, and with_suffix would cut
    # the name there (every run of that label the same file)
    jp, mp = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    jp.write_text(json.dumps(res, indent=1))
    mp.write_text(markdown_report(res))
    return jp, mp
